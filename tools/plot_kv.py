"""Plot tools/eval_kv.py's JSON: perplexity, agreement with the full cache and passkey retrieval
against the budget, one line per policy, the full cache as a dashed line.

    python tools/plot_kv.py bench/kv_eval.json -o bench/kv_eval.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from llmrs.cliutil import OneLineParser
from llmrs.compiler.outputs import check_output_file
from llmrs.measure.plotting import save_figure

PANELS = (   # (row key, title, y label)
    ("ppl", "perplexity (lower is better)", "perplexity"),
    ("top1_agreement", "top-1 agreement, teacher-forced", "fraction of positions"),
    ("greedy_agreement", "greedy tokens equal to the full cache's", "fraction of tokens"),
    ("passkey", "passkey: prompt longer than the cache", "fraction of prompts"),
    ("passkey_fit", "passkey: prompt in the cache, then evicted", "fraction of prompts"),
)


def plot(result: dict, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    full = next(r for r in rows if r["policy"] == "full")
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    fig, grid = plt.subplots(2, 3, figsize=(14, 8))
    axes = grid.ravel()
    axes[-1].axis("off")
    for ax, (key, title, ylabel) in zip(axes, PANELS):
        for name in policies:
            pts = sorted((r["budget"], r[key]) for r in rows if r["policy"] == name)
            sinks = result["settings"].get("sinks", {}).get(name)
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o",
                    label=name if sinks is None else f"{name} ({sinks} sinks)")
        ax.axhline(full[key], color="black", linestyle="--", linewidth=1, label="full cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (KV slots kept)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if key == "ppl":
            ax.set_yscale("log")
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[-1].legend(*axes[0].get_legend_handles_labels(), loc="center", title="policy")
    s = result["settings"]
    fig.suptitle(f"KV-cache eviction: {Path(result.get('plan', '')).name}, {s['scored_tokens']} scored tokens of "
                 f"{Path(result['text']).name},\n{s['passkey_trials']} passkey prompts of ~{max(s['passkey_prompt_tokens'])} "
                 f"tokens, cache = budget + {s['headroom']} slots ({result['date']})", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out, "-o")


def table(result: dict) -> str:
    """The rows as a Markdown table, budgets down, policies across (perplexity / top-1 / greedy / passkey)."""
    rows = result["rows"]
    full = next(r for r in rows if r["policy"] == "full")
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    n = len(full["passkey_answers"])
    cell = lambda r: (f"{r['ppl']:.2f} / {r['top1_agreement']:.2f} / {r['greedy_agreement']:.2f} / "  # noqa: E731
                      f"{round(r['passkey'] * n)}/{n} / {round(r['passkey_fit'] * n)}/{n}")
    lines = ["| budget | " + " | ".join(policies) + " |", "|---:|" + "---|" * len(policies)]
    for b in sorted({r["budget"] for r in rows if r["budget"]}):
        by = {r["policy"]: r for r in rows if r["budget"] == b}
        lines.append(f"| {b} | " + " | ".join(cell(by[p]) for p in policies) + " |")
    lines.append("| full | " + " | ".join(cell(full) for _ in policies) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="plot_kv.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="tools/eval_kv.py's output")
    ap.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    ap.add_argument("--table", action="store_true", help="also print the results as a Markdown table")
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
        result["rows"]
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{args.json}: not an eval_kv.py result ({e})")
    try:
        check_output_file(args.output, "-o", [args.json])
        plot(result, args.output)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"plot_kv.py: error: {e}", file=sys.stderr)
        return 2
    if args.table:
        print(table(result))
    print(f"plot_kv.py: wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
