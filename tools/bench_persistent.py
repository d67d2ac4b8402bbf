"""A decode step as one persistent kernel, or with its matvecs chained, against launching kernel
by kernel, on one OpenCL device: the same plan opened twice (--mode persistent:
LLMRS_OPENCL_PERSISTENT=1 / 0; --mode chain: LLMRS_OPENCL_CHAIN=1 / 0), checked, then timed.

    python tools/bench_persistent.py PLAN [PLAN ...] [--mode chain] [--repeats 7] [--steps 64] [--context 64]

Check: after the same prompt, `steps` decode steps fed the same tokens give both back ends'
logits (max |difference| printed; bit-identical is expected) and the same greedy tokens
(run_greedy_steps). Time: tok/s of `steps` greedy steps enqueued at once (run_greedy_steps, the
engine's greedy path) and of step-by-step decode with the logits read back (run), medians of
interleaved repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from llmrs.runtime.backends.opencl import OpenCLBackend
from llmrs.runtime.plan import Plan


MODES = {"persistent": "LLMRS_OPENCL_PERSISTENT", "chain": "LLMRS_OPENCL_CHAIN"}


def open_both(path: str, mode: str) -> dict[str, OpenCLBackend]:
    """{"launches": kernel by kernel, "fused": in `mode`}."""
    out = {}
    for on in ("0", "1"):
        for m, var in MODES.items():
            os.environ[var] = on if m == mode else "0"
        out["fused" if on == "1" else "launches"] = OpenCLBackend(Plan.open(path))
    return out


def prompt_tokens(be: OpenCLBackend, n: int, rng: np.random.Generator) -> int:
    """The prompt through the prefill graph; its greedy next token."""
    be.reset()
    vocab = be.graphs["decode"].values[be.graphs["decode"].outputs[0]].shape[-1]
    chunk = be.graphs["prefill"].T
    ids = rng.integers(0, vocab, n).astype(np.int32)
    for s in range(0, n, chunk):
        logits = be.run("prefill", ids[s:s + chunk], s, s)
    return int(np.argmax(logits[-1]))


def check(bes: dict[str, OpenCLBackend], context: int, steps: int) -> dict[str, object]:
    logits, greedy = {}, {}
    for name, be in bes.items():
        first = prompt_tokens(be, context, np.random.default_rng(0))
        vocab = be.graphs["decode"].values[be.graphs["decode"].outputs[0]].shape[-1]
        feed = np.random.default_rng(1).integers(0, vocab, steps).astype(np.int32)
        logits[name] = np.stack([be.run("decode", feed[i:i + 1], context + i, context + i)[0] for i in range(steps)])
        prompt_tokens(be, context, np.random.default_rng(0))
        greedy[name] = be.run_greedy_steps(first, context, context, steps).tolist()
    diff = float(np.max(np.abs(logits["fused"] - logits["launches"])))
    return {"max_abs_diff": diff, "bit_identical": bool(np.array_equal(logits["fused"], logits["launches"])),
            "same_greedy_tokens": greedy["fused"] == greedy["launches"],
            "notes": bes["fused"].build_notes}


def timed(be: OpenCLBackend, context: int, steps: int, greedy: bool) -> float:
    first = prompt_tokens(be, context, np.random.default_rng(2))
    be.queue.finish()
    t0 = time.perf_counter()
    if greedy:
        be.run_greedy_steps(first, context, context, steps)
    else:
        tok = np.array([first], np.int32)
        for i in range(steps):
            tok = be.run("decode", tok, context + i, context + i, want="argmax")
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--mode", choices=sorted(MODES), default="persistent")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the timed steps")
    ap.add_argument("--checks", type=int, default=1, help="times the check runs (a race shows as a difference)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    results = {}
    for path in a.plans:
        bes = open_both(path, a.mode)
        r: dict[str, object] = {"mode": a.mode, "device": bes["launches"].device_name,
                                "check": check(bes, a.context, 16)}
        for _ in range(a.checks - 1):
            again = check(bes, a.context, 16)
            if not again["bit_identical"] or not again["same_greedy_tokens"]:
                r["check"] = again
        fused = bes["fused"]
        r["launches_per_step"] = len(fused._step_launches("decode", 1)) + 1
        if a.mode == "persistent":
            pk = fused._persistent.get(("greedy", False))
            r["persistent_groups"] = pk.groups if pk else 0
            prog = fused._persistent_program
            r["group"], r["kernel_max_wg"] = (prog.group, prog.registers_bound) if prog else (0, 0)
            r["private_bytes"] = prog.private_bytes if prog else 0
            shape = f"one of {r['persistent_groups']} groups of {r['group']} (kernel's largest group " \
                    f"{r['kernel_max_wg']}, {r['private_bytes']} B private)"
        else:
            ch = fused._chains.get(("greedy", False))
            r["fused_launches_per_step"] = len(ch.launches) if ch else r["launches_per_step"]
            prog = fused._chain_program
            r["group"] = prog.group if prog else 0
            r["private_bytes"] = prog.private_bytes if prog else 0
            r["registers"], r["spill_stores"] = (prog.registers, prog.spills) if prog else ([], [])
            r["kernel_max_wg"] = prog.max_group if prog else 0
            r["standalone_max_wg"] = sorted({int(k.get_work_group_info(0x11B0, fused.device))
                                             for k, *_ in fused._step_launches("decode", 1)
                                             if k.function_name == "matvec"})
            shape = (f"{r['fused_launches_per_step']} chained (groups of {r['group']}, {r['private_bytes']} B private, "
                     f"registers {r['registers'][:4]}, spill stores {r['spill_stores'][:4]}; largest group: chain "
                     f"{r['kernel_max_wg']}, the matvecs alone {r['standalone_max_wg']}; "
                     f"{os.environ.get('LLMRS_OPENCL_CHAIN_MAX', '')})")
        for greedy in (True, False):
            runs: dict[str, list[float]] = {name: [] for name in bes}
            for name, be in bes.items():   # warm-up: builds, first launches
                timed(be, a.context, 8, greedy)
            for _ in range(a.repeats):
                for name, be in bes.items():
                    runs[name].append(timed(be, a.context, a.steps, greedy))
            key = "greedy_steps" if greedy else "step_by_step"
            r[key] = {name: statistics.median(v) for name, v in runs.items()}
            r[key]["ratio"] = r[key]["fused"] / r[key]["launches"]
        results[path] = r
        print(f"{path}: {r['device']}, {r['launches_per_step']} launches a greedy step -> {shape}")
        print(f"  check: {r['check']}")
        for key in ("greedy_steps", "step_by_step"):
            v = r[key]
            print(f"  {key}: launches {v['launches']:.1f} tok/s, {a.mode} {v['fused']:.1f} tok/s "
                  f"({v['ratio']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
