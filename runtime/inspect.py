"""llmrs-inspect plan.bin: what a plan holds (model, weight formats, sections, kernels, arena)."""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, TextIO

from pathlib import Path

from ..cliutil import OneLineParser
from ..compiler.outputs import check_output_file
from ..measure.plotting import PlotError, plot_arena, pyplot
from ..compiler.ir import Graph
from .plan import VERIFY_MODES, Plan, PlanError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; bytes stay exact below 1 KiB."""
    x, unit = float(n), 0
    while x >= 1024 and unit < len(_UNITS) - 1:
        x, unit = x / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{x:.2f} {_UNITS[unit]}"


def _config(plan: Plan, graphs: dict[str, Graph]) -> dict[str, Any] | None:
    for key in ("model", "config"):  # llmrs-compile writes the model config under "model"
        if isinstance(plan.manifest.get(key), dict):
            return plan.manifest[key]
    for g in graphs.values():
        if isinstance(g.meta.get("config"), dict):
            return g.meta["config"]
    return None


def _print_summary(plan: Plan, graphs: dict[str, Graph], out: TextIO) -> None:
    size = plan.header.file_bytes
    print(f"plan {plan.path}: format v{plan.header.version}, {human_bytes(size)} ({size} bytes)", file=out)
    if plan.manifest.get("compile_command"):
        print(f"compiled with: {plan.manifest['compile_command']}", file=out)
    cfg = _config(plan, graphs)
    if cfg:
        print("model:", file=out)
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "rope_scaling",
                    "tie_word_embeddings", "max_position_embeddings"):
            if key in cfg:
                print(f"  {key:<26} {cfg[key]}", file=out)

    by_dtype: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for t in plan.tensors.values():
        by_dtype[t.dtype] += t.nbytes
        count[t.dtype] += 1
    print(f"weights: {len(plan.tensors)} tensors", file=out)
    for dtype, n in sorted(by_dtype.items(), key=lambda kv: -kv[1]):
        print(f"  {dtype:<6} {count[dtype]:>5} tensors  {human_bytes(n):>12}", file=out)

    print(f"sections (weights checksum: {plan.verification}):", file=out)
    for name, sec in sorted(plan.sections.items(), key=lambda kv: kv[1].offset):
        print(f"  {name:<28} offset {sec.offset:>12}  {human_bytes(sec.size):>12}  crc32 {sec.crc32:08x}", file=out)
    for backend in ("cpu", "opencl"):
        missing = plan.missing_code(backend)
        if missing:
            print(f"  {missing}", file=out)

    print("kernels per step:", file=out)
    width = max(8, *map(len, graphs))
    for phase, g in graphs.items():
        kinds = Counter(op.kind for op in g.ops if op.kind != "slice")
        per = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        print(f"  {phase:<{width}} T={g.T:<5} {g.kernel_count():>5} kernels ({per})", file=out)


def _print_offsets(title: str, table: Any, g: Graph, out: TextIO) -> None:
    """offset, size, value name for each entry of a {value: byte offset} table, by offset."""
    rows = sorted((off, name) for name, off in (table.items() if isinstance(table, dict) else ())
                  if isinstance(off, int))
    if not rows:
        return
    print(title, file=out)
    for off, name in rows:
        v = g.values.get(name)
        print(f"  {off:>12}  {human_bytes(v.nbytes) if v is not None else '?':>12}  {name}", file=out)


def _print_layout(phase: str, g: Graph, out: TextIO) -> None:
    layout = g.meta.get("layout")
    if not isinstance(layout, dict):
        print(f"arena {phase}: no layout (the plan_memory pass did not run)", file=out)
        return
    _print_offsets(f"arena {phase} (offset, size, value):", layout.get("arena"), g, out)
    _print_offsets(f"kv {phase} (offset, size, cache):", layout.get("kv"), g, out)
    for key in ("arena_bytes", "naive_bytes", "lower_bound_bytes", "kv_bytes"):
        if isinstance(layout.get(key), int):
            print(f"  {key:<18} {human_bytes(layout[key]):>12} ({layout[key]} bytes)", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="llmrs-inspect", description=__doc__)
    ap.add_argument("plan", help="a plan.bin written by llmrs-compile")
    ap.add_argument("--verify", default="auto", choices=VERIFY_MODES,
                    help="checksum the weights: auto (in the background, before any weight is used), always (while opening), never")
    ap.add_argument("--no-layout", action="store_true", help="leave out the arena layouts")
    ap.add_argument("--plot", type=Path, metavar="ARENA.png",
                    help="draw each phase's arena: tensors as rectangles over op index x offset, the lower "
                         "bound marked (needs matplotlib: pip install 'llmrs[plot]')")
    args = ap.parse_args(argv)
    try:
        if args.plot:
            check_output_file(args.plot, "--plot", [args.plan])
            pyplot()    # before any output: a missing matplotlib is the one line said
        plan = Plan.open(args.plan, verify=args.verify)
        plan.check_weights()   # damaged weights are this one error line, not a traceback later
    except (PlanError, PlotError, ValueError) as e:
        print(f"llmrs-inspect: error: {e}", file=sys.stderr)
        return 2
    graphs = plan.graphs()
    if args.plot:
        try:
            drawn = plot_arena(graphs, args.plot)
        except PlotError as e:
            print(f"llmrs-inspect: error: {e}", file=sys.stderr)
            return 2
        print(f"arena picture: {args.plot} (" + ", ".join(f"{p} {len(r)} tensors" for p, r in drawn.items()) + ")",
              file=sys.stderr)
    out = sys.stdout
    _print_summary(plan, graphs, out)
    if not args.no_layout:
        for phase, g in graphs.items():
            _print_layout(phase, g, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
