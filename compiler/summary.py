"""The compile summary: what the plan holds and what each number is measured against."""
from __future__ import annotations

from ..models.config import LlamaConfig
from .ir import Graph


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def decode_weight_bytes(decode: Graph) -> tuple[int, int]:
    """(bytes of weights one decode step reads, params of all its matmuls). An embedding table
    counts one row unless a matmul (a tied lm_head) also reads it whole."""
    whole, rows, params = set(), {}, 0
    for op in decode.ops:
        for name in op.inputs:
            v = decode.values[name]
            if v.kind not in ("param", "const"):
                continue
            if op.kind == "embedding":
                rows[name] = v.nbytes // v.shape[0]
            else:
                whole.add(name)
        if op.kind in ("matmul", "fused_matmul"):
            w = decode.values[op.inputs[1]]
            params += w.shape[0] * w.shape[1]
    total = sum(decode.values[n].nbytes for n in whole) + sum(b for n, b in rows.items() if n not in whole)
    return total, params


def plan_stats(cfg: LlamaConfig, graphs: dict[str, Graph]) -> dict[str, float]:
    """The figures the summary prints, as plain numbers (bench.py and tests read them too)."""
    decode, prefill = graphs["decode"], graphs["prefill"]
    weights = {n: g.values[n] for g in graphs.values() for n in g.by_kind("param") + g.by_kind("const")}
    lay = {p: g.meta.get("layout", {}) for p, g in graphs.items()}
    layers = cfg.num_hidden_layers
    return {
        "params": cfg.n_params,
        "weight_bytes": sum(v.nbytes for v in weights.values()),
        "decode_kernels": decode.kernel_count(),
        "prefill_kernels": prefill.kernel_count(),
        "decode_kernels_per_layer": sum(1 for op in decode.ops if op.kind != "slice" and
                                        any(o.startswith("l0.") for o in op.outputs)),
        "layers": layers,
        "arena_bytes": max(d.get("arena_bytes", 0) for d in lay.values()),
        "decode_arena_bytes": lay["decode"].get("arena_bytes", 0),
        "decode_naive_bytes": lay["decode"].get("naive_bytes", 0),
        "decode_lower_bound_bytes": lay["decode"].get("lower_bound_bytes", 0),
        "prefill_arena_bytes": lay["prefill"].get("arena_bytes", 0),
        "prefill_naive_bytes": lay["prefill"].get("naive_bytes", 0),
        "prefill_lower_bound_bytes": lay["prefill"].get("lower_bound_bytes", 0),
        # the K and V caches [S, KVH, hd]; other state: eviction scores and their control
        "kv_bytes": sum(decode.values[s].nbytes for s in decode.state if len(decode.values[s].shape) == 3),
        "kv_score_bytes": sum(decode.values[s].nbytes for s in decode.state if len(decode.values[s].shape) != 3),
    }


def summarize(cfg: LlamaConfig, graphs: dict[str, Graph], info, seconds: float) -> str:
    s = plan_stats(cfg, graphs)
    prefill_T = graphs["prefill"].T

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}x" if b else "n/a"

    lines = [
        f"plan          {info.path} ({fmt_bytes(info.file_bytes)})",
        f"parameters    {s['params'] / 1e6:.1f} M   weights {fmt_bytes(s['weight_bytes'])}",
        f"kernels       decode step {s['decode_kernels']} ({s['decode_kernels_per_layer']} per layer x "
        f"{s['layers']} layers + {s['decode_kernels'] - s['decode_kernels_per_layer'] * s['layers']}), "
        f"prefill chunk of {prefill_T} tokens {s['prefill_kernels']}",
    ]
    for phase in ("decode", "prefill"):
        a, n, lb = (s[f"{phase}_{k}"] for k in ("arena_bytes", "naive_bytes", "lower_bound_bytes"))
        lines.append(f"arena {phase:<8}{fmt_bytes(a)}   naive sum {fmt_bytes(n)} ({ratio(n, a)} of arena), "
                     f"lower bound {fmt_bytes(lb)} (arena = {ratio(a, lb)} of it)")
    step = graphs.get("step")
    if step is not None:
        B, M = step.values["block_tables"].shape
        bs = step.kv_slots // M
        arena = step.meta.get("layout", {}).get("arena_bytes", 0)
        lines.append(f"step graph    up to {B} sequences, {step.T} tokens a step, KV in blocks of {bs} tokens: "
                     f"{step.kernel_count()} kernels, arena {fmt_bytes(arena)}")
    verify = graphs.get("verify")
    if verify is not None:
        lines.append(f"verify graph  {verify.T - 1} drafts and the token before them, each row as a decode step "
                     f"(OpenCL): {verify.kernel_count()} kernels")
    short = graphs.get("prefill_short")
    if short is not None:
        lines.append(f"short prefill prompts and a long prompt's tail of up to {short.T} tokens, in matmuls tiled for "
                     f"them (OpenCL): {short.kernel_count()} kernels")
    lines += [
        f"arena shared  {fmt_bytes(s['arena_bytes'])} (max of the phases)",
        f"KV cache      {fmt_bytes(s['kv_bytes'])} (+ {fmt_bytes(s['kv_score_bytes'])} of eviction scores)",
        f"time          {seconds:.1f} s",
    ]
    return "\n".join(lines)
