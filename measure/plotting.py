"""Pictures (matplotlib, the optional extra `pip install 'llmrs[plot]'`): the arena of a plan.

plot_arena draws each phase's activation arena as tensors over time: a tensor is a rectangle
from the op that makes it to the last op that reads it (x, op index in schedule order) and over
the bytes it holds (y, arena offset), with the arena's size and the lower bound (the most bytes
live at one op: no layout of these lifetimes fits in less) drawn across. It returns the
rectangles it drew, so what the picture shows can be checked against the plan."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compiler.outputs import output_file
from ..compiler.ir import Graph
from ..compiler.passes.plan_memory import live_intervals

INSTALL = "pip install 'llmrs[plot]' (matplotlib)"


class PlotError(ValueError):
    """No matplotlib, or a plan without what the picture shows; one line."""


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(f"pictures need matplotlib: {INSTALL}") from None
    matplotlib.use("Agg")    # files only, no display
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig: Any, path: str | Path, flag: str = "--plot") -> None:
    """fig as the file `path` names, exactly (no suffix added), written whole or not at all; the
    format from the suffix, png without one."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    if fmt not in fig.canvas.get_supported_filetypes():
        raise PlotError(f"{flag} {path}: matplotlib cannot write .{fmt} files; use .png, .pdf or .svg")
    try:
        with output_file(path, flag) as f:
            fig.savefig(f, dpi=110, format=fmt)
    except ValueError as e:    # the path became something that must not be replaced
        raise PlotError(str(e)) from None


@dataclass(frozen=True)
class Rect:
    name: str
    first_op: int    # x from first_op ...
    end_op: int      # ... to end_op (exclusive): live over ops first_op..end_op - 1
    offset: int      # y from offset ...
    nbytes: int      # ... to offset + nbytes


def arena_rects(g: Graph) -> list[Rect]:
    """One rectangle per arena tensor of a planned graph: its lifetime and its bytes."""
    layout = g.meta.get("layout")
    if not isinstance(layout, dict):
        raise PlotError(f"graph {g.name} has no memory layout (the plan_memory pass did not run)")
    offsets = layout["arena"]
    return [Rect(iv.name, iv.start, iv.end + 1, offsets[iv.name], iv.size)
            for iv in live_intervals(g) if iv.name in offsets]


def _scale(nbytes: int) -> tuple[float, str]:
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= 4 * div:
            return div, unit
    return 1, "B"


def _fmt(nbytes: int, div: float, unit: str) -> str:
    return f"{nbytes} B" if unit == "B" else f"{nbytes / div:.2f} {unit}"


def plot_arena(graphs: dict[str, Graph], path: Path) -> dict[str, list[Rect]]:
    """A PNG of every phase's arena (one panel each, prefill first); returns {phase: rects}."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    phases = sorted(graphs, key=lambda p: (p != "prefill", p))
    drawn = {p: arena_rects(graphs[p]) for p in phases}
    fig, axes = plt.subplots(len(phases), 1, figsize=(11, 3.6 * len(phases)), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, phase in zip(axes[:, 0], phases):
        g, rects = graphs[phase], drawn[phase]
        lay = g.meta["layout"]
        div, unit = _scale(lay["arena_bytes"])
        for i, r in enumerate(sorted(rects, key=lambda r: (r.first_op, r.offset))):
            ax.add_patch(Rectangle((r.first_op, r.offset / div), r.end_op - r.first_op, r.nbytes / div,
                                   facecolor=cmap(i % 20), edgecolor="black", linewidth=0.3, alpha=0.85))
        lb, arena = lay["lower_bound_bytes"], lay["arena_bytes"]
        ax.axhline(arena / div, color="black", linewidth=1, label=f"arena {_fmt(arena, div, unit)}")
        ax.axhline(lb / div, color="red", linestyle="--", linewidth=1.4, zorder=5,
                   label=f"lower bound (max live bytes) {_fmt(lb, div, unit)}")
        ax.set_xlim(0, max(len(g.ops), 1))
        ax.set_ylim(0, max(arena, lb) / div * 1.12)
        ax.set_xlabel("op index (schedule order)")
        ax.set_ylabel(f"arena offset ({unit})")
        ax.set_title(f"{phase} (T={g.T}): {len(rects)} tensors in {_fmt(arena, div, unit)}; naive sum "
                     f"{_fmt(lay['naive_bytes'], div, unit)}", fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return drawn
