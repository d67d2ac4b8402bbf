"""Benchmark the OpenCL back end: decode and prefill tok/s with the ceilings measured in the same run.

    python tools/bench_opencl.py MODEL_DIR --weights q4_0,f16 --prefill 512 --out bench.json

For each weights dtype: compile the model (pipeline + OpenCL codegen) into a plan, load it with
OpenCLBackend, then measure
    launch_us         one empty kernel launch as the runtime launches (no events; mean of many,
                      queue drained); launch_us_pyopencl: the same through pyopencl, with events
    copy_gbps         device buffer-to-buffer copy, (read + written bytes) / time
    decode            kernels per step, weight bytes read per step, tok/s of greedy steps (argmax
                      on the device, 4 bytes read back; the better of step by step and
                      run_greedy_steps, all --steps enqueued at once) and of sampling steps (logits
                      read back),
                      and the floor max(launches x launch, bytes / copy bw)
    prefill           tok/s of one prompt of --prefill tokens (one chunk)
and writes one JSON object per dtype (a list) to --out. The kernels are generated with the tuning
for the device's kind (compiler/codegen/opencl_tuning.py tuning_for); --variants measures other
values of its fields on the same compiled model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from llmrs.compiler.outputs import write_output
from llmrs.compiler.codegen.opencl import generate
from llmrs.compiler.codegen.opencl_tuning import DeviceKind, OpenCLTuning, tuning_for
from llmrs.compiler.passes.quantize import WEIGHT_DTYPES
from llmrs.compiler.pipeline import CompileOptions, compile_graphs
from llmrs.compiler.summary import decode_weight_bytes
from llmrs.compiler.plan import write_graph_plan
from llmrs.measure.ceilings import device_copy_gbps, launch_us
from llmrs.runtime.backends.opencl import OpenCLBackend, pick_device
from llmrs.runtime.plan import Plan

def launch_cost_us(be: OpenCLBackend, n: int = 2000, pyopencl: bool = False) -> float:
    """One empty launch as the runtime launches (llmrs-bench's probe, measure/ceilings.py)."""
    return launch_us(be, n, pyopencl)


def kernel_profile(be: OpenCLBackend, phase: str, tokens: np.ndarray, n_past: int,
                   by_op: dict[str, float] | None = None) -> dict[str, float]:
    """Device time per kernel of one step, summed by kernel and variant (profiling events);
    by_op, when given, receives each launch's own time by op name."""
    import pyopencl as cl
    queue = be.queue
    be.queue = cl.CommandQueue(be.ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    be.enqueue(phase, tokens, n_past, n_past, kernels=False)   # tokens and scalars only
    events = [(b, cl.enqueue_nd_range_kernel(be.queue, b.kernel, b.global_size(len(tokens)), (b.local, 1)))
              for b in [b for b in be.launches[phase] if not b.scores] + [be.greedy[phase]]]   # eviction off
    be.queue.finish()
    out: dict[str, float] = {}
    for b, ev in events:
        key = b.kernel.function_name + (f"[{b.variant}]" if b.variant else "")
        out[key] = out.get(key, 0.0) + (ev.profile.end - ev.profile.start) / 1e3
        if by_op is not None:
            by_op[b.op] = (ev.profile.end - ev.profile.start) / 1e3
    be.queue = queue
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def matrix_bandwidth(graph, op_us: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per weight matrix of the decode matmuls (layers summed: 'layers.*'), device time per step
    and weight bytes / that time: which matrices leave bandwidth unused."""
    out: dict[str, dict[str, float]] = {}
    for op in graph.ops:
        if op.kind not in ("matmul", "fused_matmul") or op.name not in op_us:
            continue
        w = graph.values[op.inputs[1]]
        key = ".".join("*" if part.isdigit() else part for part in w.name.split("."))
        r = out.setdefault(key, {"us": 0.0, "bytes": 0})
        r["us"] += op_us[op.name]
        r["bytes"] += w.nbytes
    return {k: {"us": round(r["us"], 1), "gbps": round(r["bytes"] / r["us"] / 1e3, 1)} for k, r in out.items()}


TUNING_FIELDS = {f.name: f.type for f in dataclasses.fields(OpenCLTuning)}


def parse_variant(spec: str) -> dict[str, Any]:
    """'default' or FIELD=VALUE[+FIELD=VALUE...]: fields of OpenCLTuning
    (compiler/codegen/opencl_tuning.py) to override, each value parsed as the field's type."""
    out: dict[str, Any] = {}
    if spec == "default":
        return out
    for item in spec.split("+"):
        name, sep, value = item.partition("=")
        if not sep or name not in TUNING_FIELDS:
            raise ValueError(f"{item!r} is not FIELD=VALUE for a field of OpenCLTuning "
                             f"(compiler/codegen/opencl_tuning.py: {', '.join(TUNING_FIELDS)})")
        kind = TUNING_FIELDS[name]
        try:
            out[name] = bool(int(value)) if kind in ("bool", bool) else int(value)
        except ValueError:
            raise ValueError(f"{item!r}: {name} takes {'0 or 1' if kind in ('bool', bool) else 'an integer'}") from None
    return out


def device_kind(dev: Any) -> DeviceKind:
    """The properties of a pyopencl device that tuning_for reads."""
    try:
        cc = (int(dev.compute_capability_major_nv), int(dev.compute_capability_minor_nv))
    except Exception:   # another vendor's driver: no cl_nv_device_attribute_query
        cc = (0, 0)
    return DeviceKind(nvidia_cc=cc, local_mem_bytes=int(dev.local_mem_size),
                      max_work_group_size=int(dev.max_work_group_size))


def bench(model: Path, weights: str, prefill: int, steps: int, max_seq: int, kv: str, workdir: Path,
          variants: list[str], tuning: OpenCLTuning) -> list[dict]:
    """One result per variant (fields of `tuning` overridden; see parse_variant); the model
    compiles once, each variant regenerates the kernels."""
    t0 = time.perf_counter()
    p, d = compile_graphs(model, CompileOptions(weights=weights, kv_type=kv, prefill_chunk=prefill,
                                                max_seq_len=max_seq))
    compile_s = time.perf_counter() - t0
    out = []
    for spec in variants:
        r = measure(model, p, d, weights, prefill, steps, kv, workdir,
                    dataclasses.replace(tuning, **parse_variant(spec)))
        r.update(compile_s=round(compile_s, 1), variant=spec)
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def measure(model: Path, p, d, weights: str, prefill: int, steps: int, kv: str, workdir: Path,
            tuning: OpenCLTuning) -> dict:
    t0 = time.perf_counter()
    graphs = {"prefill": p, "decode": d}
    path = workdir / f"plan-{weights}.bin"
    write_graph_plan(path, graphs, sections={"opencl": json.dumps(generate(graphs, tuning))})
    compile_s = time.perf_counter() - t0
    r = measure_plan(path, prefill, steps)
    r.update(model=str(model), weights=weights, kv=kv, codegen_s=round(compile_s, 1),
             tuning=dataclasses.asdict(tuning))
    return r


PREFILL_REPEATS = 7   # prefill: the median of this many runs, each from an empty cache


def measure_plan(path: Path, prefill: int, steps: int) -> dict:
    """Everything above for one plan file (compiled with --target opencl): prefill of `prefill`
    tokens in one chunk, then `steps` decode steps each way."""
    t0 = time.perf_counter()
    be = OpenCLBackend(Plan.open(path))
    load_s = time.perf_counter() - t0
    p, d = be.graphs["prefill"], be.graphs["decode"]
    vocab = p.values[p.outputs[0]].shape[1]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prefill).astype(np.int32)

    be.run("prefill", prompt, 0, 0)   # warm-up: first launches, lazy driver work
    prefill_runs = []
    for _ in range(PREFILL_REPEATS):   # a single run varied up to 2x on a shared H100
        be.reset()
        be.queue.finish()
        t = time.perf_counter()
        logits = be.run("prefill", prompt, 0, 0)
        prefill_runs.append(time.perf_counter() - t)
    prefill_s = float(np.median(prefill_runs))

    n = prefill
    tok = np.array([int(np.argmax(logits[-1]))], np.int32)
    for _ in range(3):
        be.run("decode", tok, n, n)
        n += 1
    t = time.perf_counter()
    for _ in range(steps):      # greedy: the argmax comes from the device
        tok[0] = be.run("decode", tok, n, n, want="argmax")[0]
        n += 1
    decode_s = (time.perf_counter() - t) / steps
    be.run_greedy_steps(int(tok[0]), n, n, steps)   # records its command buffer
    t = time.perf_counter()     # greedy, all steps enqueued at once, one read at the end
    chosen = be.run_greedy_steps(int(tok[0]), n, n, steps)
    decode_batched_s = (time.perf_counter() - t) / steps
    decode_batched_plain_s = None
    if be.use_command_buffers:   # the same batch enqueued kernel by kernel, for comparison
        kept, be.use_command_buffers = be._command_buffers.pop((("greedy",), steps)), False
        t = time.perf_counter()
        be.run_greedy_steps(int(tok[0]), n, n, steps)
        decode_batched_plain_s = (time.perf_counter() - t) / steps
        be._command_buffers[(("greedy",), steps)], be.use_command_buffers = kept, True
    decode_batched_pyopencl_s = None
    if be.direct is not None and not be.use_command_buffers:   # launched through pyopencl, with events
        direct, be.direct = be.direct, None
        t = time.perf_counter()
        be.run_greedy_steps(int(tok[0]), n, n, steps)
        decode_batched_pyopencl_s = (time.perf_counter() - t) / steps
        be.direct = direct
    tok[0] = chosen[-1]
    n += steps
    t = time.perf_counter()
    for _ in range(steps):      # sampling: the logits come back every step
        logits = be.run("decode", tok, n, n)
        tok[0] = int(np.argmax(logits[-1]))
        n += 1
    decode_logits_s = (time.perf_counter() - t) / steps
    t = time.perf_counter()   # enqueue only, one drain at the end: the device-side rate
    for _ in range(steps):
        be.enqueue("decode", tok, n - steps, n - steps)
    be.queue.finish()
    decode_enqueue_s = (time.perf_counter() - t) / steps

    decode_op_us: dict[str, float] = {}
    profile = {"decode": kernel_profile(be, "decode", tok, n, decode_op_us),
               "prefill": kernel_profile(be, "prefill", prompt, 0)}
    profile["decode_matrices"] = matrix_bandwidth(d, decode_op_us)
    launch_us = launch_cost_us(be)
    launch_py_us = launch_cost_us(be, pyopencl=True)
    bw = device_copy_gbps(be)
    launches = sum(1 for b in be.launches["decode"] if not b.scores) + 1     # + the greedy argmax
    wbytes, _ = decode_weight_bytes(d)
    floor_s = max(launches * launch_us * 1e-6, wbytes / (bw * 1e9))
    best_s = min(decode_s, decode_batched_s)
    return {
        "device": be.device_name, "plan": str(path),
        "build_options": be.build_options, "build_notes": be.build_notes, "load_s": round(load_s, 1),
        "launch_us": round(launch_us, 2), "launch_us_pyopencl": round(launch_py_us, 2), "copy_gbps": round(bw, 1),
        "decode": {"kernels_per_step": launches, "weight_bytes": wbytes,
                   "ms_per_token": round(best_s * 1e3, 3), "tok_s": round(1 / best_s, 1),
                   "ms_per_token_step_by_step": round(decode_s * 1e3, 3),
                   "ms_per_token_batched": round(decode_batched_s * 1e3, 3),
                   "ms_per_token_batched_without_command_buffer": decode_batched_plain_s and
                   round(decode_batched_plain_s * 1e3, 3),
                   "ms_per_token_batched_pyopencl_launches": decode_batched_pyopencl_s and
                   round(decode_batched_pyopencl_s * 1e3, 3),
                   "command_buffers": be.use_command_buffers,
                   "ms_per_token_logits_read": round(decode_logits_s * 1e3, 3),
                   "ms_per_token_enqueue_only": round(decode_enqueue_s * 1e3, 3),
                   "weight_read_gbps": round(wbytes / best_s / 1e9, 1),
                   "weight_read_of_copy_bw": round(wbytes / best_s / 1e9 / bw, 3),
                   "floor_ms": round(floor_s * 1e3, 3), "over_floor": round(best_s / floor_s, 2),
                   "context_at_end": n},
        "profile_us": profile,
        "prefill": {"tokens": prefill, "ms": round(prefill_s * 1e3, 2), "tok_s": round(prefill / prefill_s, 1),
                    "ms_runs": [round(r * 1e3, 2) for r in prefill_runs],
                    "kernels": sum(1 for b in be.launches["prefill"] if not b.scores)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--weights", default="q4_0,f16",
                    help=f"comma-separated weight formats, each of {', '.join(WEIGHT_DTYPES)} or native (a GGUF's "
                         "own formats; default q4_0,f16)")
    ap.add_argument("--kv", default="f16", help="KV cache dtype (f32 | f16 | q8_0)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (one prefill chunk)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--variants", default="default",
                    help="comma-separated kernel-shape variants, each measured on the same compiled model: "
                         "'default' (the device's tuning) or FIELD=VALUE[+FIELD=VALUE...] overriding fields "
                         "of OpenCLTuning (compiler/codegen/opencl_tuning.py), e.g. "
                         "default,tile_pair_f16=0,mv_loads=8+mv_wg=512")
    ap.add_argument("--kv-list", help="comma-separated KV dtypes to run each weights dtype with (overrides --kv)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    weights = args.weights.split(",")
    bad = [w for w in weights if w not in (*WEIGHT_DTYPES, "native")]   # native: a GGUF's own formats
    if bad:
        ap.error(f"--weights {','.join(bad)}: choose from {', '.join(WEIGHT_DTYPES)}, native")
    variants = args.variants.split(",")
    for spec in variants:
        try:
            parse_variant(spec)
        except ValueError as e:
            ap.error(f"--variants: {e}")
    tuning = tuning_for(device_kind(pick_device()))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in weights:
            for kv in (args.kv_list or args.kv).split(","):
                results += bench(args.model, w, args.prefill, args.steps, args.max_seq_len, kv, Path(tmp),
                                 variants, tuning)
                if args.out:   # after each run, so a later failure keeps what was measured
                    write_output(args.out, json.dumps(results, indent=1) + "\n", "--out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
