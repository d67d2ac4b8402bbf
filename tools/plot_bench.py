"""BENCHMARKS.md's figures, from llmrs-bench JSON and llmrs-run --profile traces (needs matplotlib:
pip install 'llmrs[plot]').

    python tools/plot_bench.py cpu.json opencl.json -o speeds.png [--kernels kernels.png]
    python tools/plot_bench.py --trace trace.json -o profile.png

speeds   per bench file: prefill and decode tok/s (log scale), and decode's weight read against the
         bandwidth ceiling / prefill's G op/s against numpy's GEMM, as measured in that run
kernels  (the first file's --kernels table) each kernel's GB/s and GFLOP/s as fractions of the ceilings
trace    the time of an average step by kernel (layers summed), per phase; the same as a Markdown
         table on stdout
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from llmrs.compiler.outputs import check_output_file
from llmrs.measure.plotting import PlotError, pyplot, save_figure


def _label(r: dict) -> str:
    return f"{r['backend']} ({r['device']})" if r.get("device") else f"{r['backend']}, {r['threads']} threads"


def plot_speeds(results: list[dict], path: Path) -> dict[str, list[float]]:
    """Bars of tok/s and of fractions of the ceilings, one colour per bench file; returns
    {file label: [values in bar order]}."""
    plt = pyplot()
    names = [f"prefill {p['tokens']}" for p in results[0]["prefill"]] + ["decode (empty)", "decode (deep)"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / len(results)
    drawn = {}
    for i, r in enumerate(results):
        vals = [p["tok_s"] for p in r["prefill"]] + [r["decode"]["empty"]["tok_s"], r["decode"]["deep"]["tok_s"]]
        xs = [j + i * width for j in range(len(vals))]
        bars = ax.bar(xs, vals, width, label=_label(r))
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in vals], fontsize=7)
        fr = [r["decode_of_bandwidth"], r["prefill_of_gemm"]]
        b2 = ax2.bar([j + i * width for j in range(2)], fr, width, label=_label(r))
        ax2.bar_label(b2, labels=[f"{v:.2f}" for v in fr], fontsize=7)
        drawn[_label(r)] = vals + fr
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (log)")
    deep = results[0]["decode"]["deep"]["context"]
    ax.set_title(f"{Path(results[0]['plan']).name}: speeds (medians of {results[0]['repeats']}; "
                 f"deep = after {deep} tokens)", fontsize=10)
    ax.legend(fontsize=8)
    ax2.set_xticks([j + width * (len(results) - 1) / 2 for j in range(2)],
                   ["decode weight read\n/ bandwidth", f"prefill {results[0]['prefill'][-1]['tokens']} G op/s\n"
                    "/ numpy f32 GEMM"])
    ax2.set_title("against this run's ceilings", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, "-o")
    plt.close(fig)
    return drawn


def _short(label: str) -> str:
    """'fused_matmul(rms_norm+silu_mul) f32[1,576] q4_1[3072,576]' -> 'matmul(rms_norm+silu_mul) q4_1[3072,576]'."""
    kind, _, types = label.partition(" ")
    kind = kind.replace("fused_matmul", "matmul")
    weights = [t for t in types.split() if not t.startswith(("f32[", "i32["))]
    return f"{kind} {weights[0]}" if weights else kind


def plot_kernels(result: dict, path: Path) -> list[tuple[str, float, float]]:
    plt = pyplot()
    rows = result["kernels"]
    if not rows:
        raise PlotError(f"{result['plan']}: the bench JSON has no kernels (run llmrs-bench --kernels)")
    labels = [f"{k['phase']}: {_short(k['label'])}" for k in rows]
    bw = [k["of_bandwidth"] or 0.0 for k in rows]
    gf = [k["of_gemm"] or 0.0 for k in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.4))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], bw, 0.4, label="GB/s / read bandwidth")
    if any(gf):
        ax.barh([y + 0.2 for y in ys], gf, 0.4, label="GFLOP/s / numpy f32 GEMM")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of this run's ceiling")
    ax.set_title(f"{Path(result['plan']).name} on {_label(result)}: each kernel alone", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, "--kernels")
    plt.close(fig)
    return list(zip(labels, bw, gf))


def trace_breakdown(trace: dict) -> dict[str, list[tuple[str, float, int]]]:
    """{phase: [(kernel title, ms per step, kernels per step)], largest first} over a trace's steps."""
    steps: dict[str, set[int]] = defaultdict(set)
    total: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    count: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in trace["traceEvents"]:
        if e.get("cat") != "kernel":
            continue
        ph, title = e["args"]["phase"], e["args"].get("kernel", e["name"])
        steps[ph].add(e["args"]["step"])
        total[ph][title] += e["dur"] / 1e3
        count[ph][title] += 1
    return {ph: sorted(((t, ms / len(steps[ph]), count[ph][t] // len(steps[ph])) for t, ms in per.items()),
                       key=lambda x: -x[1]) for ph, per in total.items()}


def trace_table(trace: dict) -> str:
    lines = ["| phase | kernel | per step | ms per step | share |", "|---|---|---|---|---|"]
    for ph, rows in trace_breakdown(trace).items():
        step_ms = sum(ms for _, ms, _ in rows)
        lines += [f"| {ph} | {t} | {n} | {ms:.3f} | {ms / step_ms:.1%} |" for t, ms, n in rows]
    return "\n".join(lines)


def plot_trace(trace: dict, path: Path) -> dict[str, list[tuple[str, float, int]]]:
    plt = pyplot()
    data = trace_breakdown(trace)
    phases = sorted(data, key=lambda p: (p != "prefill", p))
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 3.6), squeeze=False)
    for ax, ph in zip(axes[0], phases):
        rows = data[ph]
        step_ms = sum(ms for _, ms, _ in rows)
        bars = ax.barh([f"{t} (x{n})" for t, _, n in rows], [ms for _, ms, _ in rows], color="tab:blue")
        ax.bar_label(bars, labels=[f"{ms / step_ms:.0%}" for _, ms, _ in rows], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
        ax.set_xlabel("ms per step (kernels of all layers summed)")
        ax.set_title(f"{ph}: {step_ms:.2f} ms of kernels per step", fontsize=10)
    meta = trace.get("otherData", {})
    where = " ".join(x for x in (meta.get("backend"), meta.get("device")) if x)
    fig.suptitle(f"{Path(meta.get('plan', '')).name} on {where}: where a step's time goes", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, "-o")
    plt.close(fig)
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="*", type=Path, help="llmrs-bench --json files")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--kernels", type=Path, metavar="PNG", help="also the first file's per-kernel figure")
    ap.add_argument("--trace", type=Path, help="an llmrs-run --profile trace instead of bench files")
    a = ap.parse_args(argv)
    if bool(a.trace) == bool(a.bench):
        ap.error("give bench JSON files or --trace TRACE.json")
    try:
        for out, flag in ((a.out, "-o"), (a.kernels, "--kernels")):
            if out:   # never over an input, a device or a folder, and before any work
                check_output_file(out, flag, [*a.bench, *([a.trace] if a.trace else [])])
        if a.trace:
            trace = json.loads(a.trace.read_text())
            plot_trace(trace, a.out)
            print(trace_table(trace))
        else:
            results = [json.loads(p.read_text()) for p in a.bench]
            plot_speeds(results, a.out)
            if a.kernels:
                plot_kernels(results[0], a.kernels)
    except (PlotError, OSError, ValueError, KeyError) as e:
        print(f"plot_bench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
