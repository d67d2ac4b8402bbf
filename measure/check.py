"""llmrs-check plan.bin: every distinct kernel of a plan, run alone on each back end on random
inputs and compared with the interpreter (the checks themselves: kernels.py)."""
from __future__ import annotations

import argparse
import sys

from ..cliutil import OneLineParser, Progress
from ..runtime.plan import VERIFY_MODES, Plan, PlanError
from .kernels import BACKENDS, HELP_TOLERANCES, check_kernels, format_table, open_runners, plan_kernels


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="llmrs-check", formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run every distinct kernel of a plan alone on each back end on random "
                                   "non-zero inputs and compare it with the numpy interpreter.",
                       epilog=HELP_TOLERANCES)
    ap.add_argument("plan", help="a plan.bin written by llmrs-compile")
    ap.add_argument("--backend", default="cpu,opencl", help="back ends to check, comma-separated: cpu, opencl "
                                                            "(default both)")
    ap.add_argument("--device", default=None, help="OpenCL device index or name substring (default: as llmrs-run)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per kernel (default 2: rows are split)")
    ap.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    ap.add_argument("--verify", default="auto", choices=VERIFY_MODES, help="checksum the plan's weights")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return ap


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise ValueError(f"--backend {text!r}: choose from {', '.join(BACKENDS)} (comma-separated)")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        backends = _backends(args.backend)
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: need at least 1")
        plan = Plan.open(args.plan, verify=args.verify)
        plan.check_weights()   # damaged weights are this one error line, not a traceback later
        kernels = plan_kernels(plan.graphs())
    except (PlanError, ValueError) as e:
        print(f"llmrs-check: error: {e}", file=sys.stderr)
        return 2
    runners = open_runners(plan, backends, args.threads, args.device)
    bar = Progress("kernels", len(kernels), enabled=False if args.quiet else None)
    results = check_kernels(kernels, runners, args.seed, lambda i, k: bar.update(i, f"{k.phase} {k.op.name}"))
    bar.close()
    print(format_table(results))
    failed = [r for r in results if r.status == "FAIL"]
    n_run = sum(r.status != "SKIP" for r in results)
    print(f"{len(kernels)} kernels x {len(runners)} back ends: {n_run - len(failed)} passed, {len(failed)} failed, "
          f"{len(results) - n_run} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
