"""OpenCL C for a plan: template sources plus, per graph, a launch table of kernels.

Kernels are never pasted together here: each kernel family is one file of
templates/opencl/ (prefixed with common.cl) and is specialised with -D build options.
Sizes that only change the loop bounds are plain int arguments, so a model needs a handful of
builds (one per weight dtype x fused variant), not one per layer.

generate(graphs) returns a JSON-able dict, stored as the plan's "opencl" section:

    {"format": 1,
     "sources": {family: source text},
     "graphs": {graph name: [launch, ...]},             # launches in schedule order
     "greedy": {graph name: launch},                    # device-side argmax of the output
     "kv_compact": [compaction, ...]}                   # eviction's gather of cache rows

    launch = {"op": op name, "family": str, "kernel": str, "options": [str],
              "args": [arg, ...],        # after the step buffer every kernel takes first
              "local": int,              # work-group size along dim 0
              "groups": int,             # groups along dim 0
              "rows": int,               # static row count M of the op's activation
              "row_tile": int,           # rows per group along dim 1: dim-1 groups are
                                         # ceil(min(rows, n_tokens) / row_tile)
              "scores": bool}            # eviction scores: launched only while a policy
                                         # wants them (runtime/kv)
    arg = {"value": name}                # a tensor: buffer + byte offset (two kernel args)
        | {"none": true}                 # an unused tensor slot: any buffer, offset 0
        | {"scratch": nbytes}            # nbytes of the back end's scratch buffer, a slice of
                                         # its own per launch, zero-filled at load; kernels
                                         # leave their ticket counters at 0: buffer + offset
        | {"staging": nbytes[, "at": b]} # the back end's staging buffer (offset b or 0, shared by all
                                         # launches): a launch writes it for the next to read
                                         # (stage_x, then its matmul; a split-K matmul also keeps
                                         # its partials there, past stage_x's output)
        | {"result": nbytes}             # the back end's small result buffer (greedy tokens)
        | {"int": n} | {"float": x}

    compaction = {"state": name,         # a KV cache or scores state (kv_compact.cl)
                  "options": [str], "local": int,
                  "heads": int, "rows": int,          # its [rows, heads] rows of `unit` bytes each
                  "unit": int,                        # bytes a kernel moves at once
                  "slot_stride": int, "head_stride": int,   # in units
                  "zero_tail": bool}                  # rows past the survivors are zeroed

Quantized weights are read in the split layout common.cl describes (the back end converts
GGML blocks at upload).

Work-group sizes are fixed per kernel (reqd_work_group_size); the runtime checks them against
the device limits at bind time. They, the tiles and the splits come from the OpenCLTuning value
generate() is given (opencl_tuning.py; by default the values measured on H100 / H200).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from ..ir import Graph, IRError, Op
from .opencl_tuning import OpenCLTuning

FORMAT = 1
FAMILIES = ("matvec", "matmul", "attention", "attention_paged", "attention_scores", "norm", "rope", "embedding",
            "elementwise", "reduce", "kv_compact")
# templates/opencl/ files before a family's kernels (shared parts), and the files of its kernel
# bodies where they are several (default: the family's own file)
_PRELUDE = {"matvec": ("common", "matmul_common"), "matmul": ("common", "matmul_common", "matmul")}
_BODIES = {"matmul": ("matmul_fp32", "matmul_mma", "matmul_async", "matmul_wgmma"),
           "attention": ("attention", "attention_decode", "attention_tiled", "attention_mma"),
           "attention_paged": ("attention_paged", "attention_paged_rows", "attention_paged_tiles")}
KV_TYPES = ("f32", "f16", "q8_0", "q4_0")
KV_BLOCK_TYPES = ("q8_0", "q4_0")   # caches of 32-value blocks, written a whole block at a time
FLOAT_TYPES = ("f32", "f16", "bf16")
WEIGHT_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q8_0")
QUANT_TYPES = ("q4_0", "q4_1", "q8_0")   # multiplied as GGML does: integer dots with Q8 activations

TILE_M = 64                   # matmul_tiled: tokens per group (matmul.cl's TM)
TILE_N_WIDE = 128             # and the wider of its two weight-row tiles (TN: 64 or 128)
STAGE_WG = 256                # stage_x: threads per token (matmul.cl's STAGE_WG)


class CodegenError(IRError):
    """An op the OpenCL back end cannot lower; the message names the op and what to change."""


@dataclass
class Launch:
    op: str
    family: str
    kernel: str
    options: list[str]
    args: list[dict[str, Any]]
    local: int
    groups: int
    rows: int
    row_tile: int = 1
    scores: bool = False
    part: str = ""        # a step graph's row split (ROW_SPLIT): "lead" rows before it, "rest" from it;
                          # "logits": its head, sized by the step's logit rows (not its tokens)
    rows_from: int = 0    # "rest" / "logits": runs only in steps whose part has this many rows at least
    rows_below: int = 0   # and fewer than this many (0: no bound): matvec.cl MV_SX's pair splits there


@dataclass
class _Ctx:
    graph: Graph
    tuning: OpenCLTuning
    launches: list[Launch] = field(default_factory=list)
    # q values whose per-head norms and RoPE the attention kernel finishes (QK_DEFER): q -> its
    # qkv op's (inv_freq, q norm, k norm, eps, norm dtype, kraw staging bytes)
    deferred: dict[str, dict[str, Any]] = field(default_factory=dict)

    def dtype(self, name: str) -> str:
        v = self.graph.values[name]
        return self.graph.values[v.alias].dtype if v.alias else v.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.graph.values[name].shape


def template_source(family: str) -> str:
    """common.cl (and shared parts) followed by the family's kernels: the text one build compiles."""
    root = resources.files("llmrs.templates").joinpath("opencl")
    parts = _PRELUDE.get(family, ("common",)) + _BODIES.get(family, (family,))
    return "\n".join(root.joinpath(f"{p}.cl").read_text() for p in parts)


def _v(name: str) -> dict[str, Any]:
    return {"value": name}


_NONE: dict[str, Any] = {"none": True}


def _need(cond: bool, op: Op, msg: str) -> None:
    if not cond:
        raise CodegenError(f"op {op.name} ({op.kind}): {msg}")


def _float_type(ctx: _Ctx, op: Op, name: str, what: str) -> str:
    dt = ctx.dtype(name)
    _need(dt in FLOAT_TYPES, op, f"{what} {name!r} is {dt}; the OpenCL kernels read {', '.join(FLOAT_TYPES)}")
    return dt


def _kv_type(ctx: _Ctx, op: Op, name: str) -> str:
    dt = ctx.dtype(name)
    _need(dt in KV_TYPES, op, f"KV cache {name!r} is {dt}; the OpenCL back end stores "
          f"{', '.join(KV_TYPES)} caches (compile with --kv-type f16)")
    return dt


def _kv_options(kv: str) -> list[str]:
    """KV_BLOCKS (also defined by common.cl) lets codegen see from the options alone that a
    kernel writes whole 32-value blocks."""
    return [f"-DKV_T={kv}", f"-DKV_{kv.upper()}"] + (["-DKV_BLOCKS"] if kv in KV_BLOCK_TYPES else [])


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1, n)))))


def matvec_shape(tuning: OpenCLTuning, k: int, n: int, quantized: bool, epilogue: str | None,
                 kv_blocks: bool) -> tuple[int, int, int]:
    """(threads per group, weight rows per group, warps per row) of a decode matvec (matvec.cl).
    mv_wg threads, mv_wg / 32 warps of MV_RPW rows each: one row per warp for narrow matrices
    (most groups), more for wide ones (x prepared fewer times, more loads per lane), at most
    mv_max_rpw. q8_0 / q4_0 KV stores whole 32-value blocks of a head: 64 rows (32 RoPE pairs).
    Split-K (S warps per row: a power of 2, at most mv_max_split, no more than the row has
    32-unit passes, until the launch has about mv_split_target_warps warps) only where a group
    prepares nothing from x: S times the groups repeat the Q8_0 copy of x or the RMS sum, which
    on the H200 cost more than the extra warps gained (q4_0 down_proj 194 -> 340 us per step,
    f16 qkv 250 -> 300 us; with x quantized by lanes, q4_0 qkv 149 -> 158-179 us, round 12),
    while f16 o_proj / down_proj gained (452 -> 367 us). Float weights' RMS prologue prepares
    nothing once K splits (it is then applied late, _rms_late), so f16 qkv splits as well.
    Every row count is even, as pair epilogues need."""
    wg = tuning.mv_wg_quant if quantized else tuning.mv_wg
    warps = wg // 32
    if epilogue == "rope_kv_store" and kv_blocks:
        return wg, max(64, warps), 1
    if n < tuning.mv_target_warps and not quantized:
        units = k // 8                                          # a lane's 16-byte loads
        split = min(tuning.mv_max_split, warps // 2, _pow2_at_most(max(1, tuning.mv_split_target_warps // n)),
                    _pow2_at_most(math.ceil(units / 32)))
        return wg, warps // split, split
    rpw = min(tuning.mv_max_rpw, _pow2_at_most(max(1, n // tuning.mv_target_warps)))
    return wg, warps * rpw, 1


MMA_TOKENS = 16   # token rows a group of the generated rows' tensor-core matvec (the MMA's m16)


def matvec_mma_shape(tuning: OpenCLTuning, epilogue: str | None, kv_blocks: bool,
                     wt: str = "q4_0", n: int = 0) -> tuple[int, int, int]:
    """(threads, weight rows, K slices) of a group of the generated rows' tensor-core matvec
    (matvec.cl MV_MMA): mv_mma_wg threads, mv_mma_split warps on each 8-row MMA column's K (a
    group's rows are few, so a launch has many groups, and each group reads its 16 rows' x once
    from stage_x's output); f16 weights mv_mma_f16_wg, mv_mma_f16_split and mv_mma_f16_rpw rows a
    warp, mv_mma_f16_rpw_wide for a matrix of n >= mv_mma_f16_wide rows (a multiple of 8: 8-row
    columns sharing each lane's A values; fewer groups, so only wide matrices gain; their K loop holds
    no barrier, so more slices cost nothing but their sums: a narrow matrix then has warps
    enough, and fewer for wide matrices measured slower, round 28); q8_0 / q4_0 KV stores whole
    32-value blocks of a head: 64 rows."""
    if wt == "f16":
        wg, split, rpw = tuning.mv_mma_f16_wg, tuning.mv_mma_f16_split, tuning.mv_mma_f16_rpw
        if tuning.mv_mma_f16_wide and n >= tuning.mv_mma_f16_wide:
            rpw = tuning.mv_mma_f16_rpw_wide
    else:
        wg, split, rpw = tuning.mv_mma_wg, tuning.mv_mma_split, 8
    warps = wg // 32
    split = min(split, warps)
    if epilogue == "rope_kv_store" and kv_blocks:
        rpw = max(rpw, 64 // (warps // split))
    return wg, warps // split * rpw, split


def mma_chunk(k: int, most: int = 2048) -> int:
    """K values of a chunk of the quantized generated rows' tensor-core matvec (matvec.cl
    MV_MMA_KC): the largest multiple of 32 dividing K up to `most`, whose 16 token rows of Q8_0
    codes (33 KB at 2048) and scales fit NVIDIA's 48 KB of local memory."""
    return next(c for c in range(min(k, most) // 32 * 32, 0, -32) if k % c == 0)


def matvec_mma(tuning: OpenCLTuning, wt: str, k: int, qk_norm: bool, rope_heads: bool) -> bool:
    """Whether a step graph's generated rows of a matmul run on the tensor-core matvec (matvec.cl
    MV_MMA, 16 rows a group) at every row count: quantized weights with mv_mma, f16 weights with
    mv_mma_f16 (rows of whole 32-value blocks). Its rows are summed alike whatever their number,
    so it needs no one-token twin below mv_sx_from rows."""
    if qk_norm or rope_heads:
        return False
    return tuning.mv_mma if wt in QUANT_TYPES else (wt == "f16" and tuning.mv_mma_f16 and k % 32 == 0)


def matvec_tokens(tuning: OpenCLTuning, m: int, k: int, quantized: bool, one_token: bool) -> int:
    """Token rows a group of a step graph's generated-row matvec takes (matvec.cl MV_TOKS): as many
    as fit, each weight batch then read once for all of them. Quantized weights keep one Q8_0 copy
    of x a token in local memory, within the bytes mv_max_k gives one copy; float weights read x
    per token, held to mv_toks_float by the accumulators' registers. `one_token`: the variants
    with a token a group (QK_SPLIT's tickets, ROPE_HEADS)."""
    if one_token:
        return 1
    most = min(tuning.mv_toks_quant, max(1, tuning.mv_max_k // k)) if quantized else tuning.mv_toks_float
    return max(1, min(most, m))


def _rms_late(split: int, norm_folded: bool) -> bool:
    """Whether a float-weight matvec applies its RMS prologue's 1 / rms to the finished dot
    products (matvec.cl MV_RMS_LATE: the sum of squares taken in the K loop, so the group
    prepares nothing): where K splits (H200 f16 qkv 242 -> 231 us per step) or the norm weight
    is folded (nothing left to load per unit). Everywhere, gate_up (unsplit, with its norm
    weight) went 363 -> 397 us (round 6)."""
    return split > 1 or norm_folded


def rope_heads_q8(a: dict[str, Any], kv: str) -> bool:
    """Whether a rope_kv_store epilogue into Q8_0 / q4_0 caches needs a group per head (ROPE_HEADS in
    matmul_common.cl): where head_dim % 64 == 32 a 32-value block spans both RoPE halves."""
    return kv in KV_BLOCK_TYPES and a["head_dim"] % 64 != 0


def staging_bytes(m: int, k: int, wt: str) -> int:
    """Bytes of stage_x's output for m rows of K values (matmul.cl): int8 codes, then an f32
    scale per 32-value block, and for q4_1 weights an f32 Q8_1 sum per block; f16 weights: x
    as f16."""
    if wt == "f16":
        return 2 * m * k
    return m * k + 4 * m * (k // 32) * (2 if wt == "q4_1" else 1)


def split_parts_at(m: int, k: int, wt: str) -> int:
    """Offset in the staging buffer of split-K partials (matmul.cl MM_PARTS_AT): after stage_x's
    output, 256-byte aligned."""
    return -(-staging_bytes(m, k, wt) // 256) * 256


def tile_shape(tuning: OpenCLTuning, m: int, k: int, n: int, wt: str, epilogue: str | None,
               a: dict[str, Any]) -> tuple[int, int, bool]:
    """(weight rows per group, groups per tile along K, token tiles paired) of a prefill
    matmul_tiled. 128-row tiles while they give tile_n_min_groups groups; below that a matmul
    whose x is staged splits K over S groups per tile (the smallest power of 2 up to
    tile_split_k_* that reaches the count, K / S a multiple of 128, every body's stage), else its
    tiles halve to 64 rows. f16 weights pair their token tiles (tile_pair_f16: matmul.cl
    MM_TPAIR, a pair counted as one tile here) where the pairs alone give the groups: a matmul
    that must split keeps unpaired tiles (pairs that split: H200 1B f16 o_proj + down_proj
    2689 -> 3034 us with mma.sync, 2580 -> 4918 with wgmma, round 13)."""
    row_groups = _row_groups(epilogue, TILE_N_WIDE, n, a)
    if (tuning.tile_pair_f16 and wt == "f16" and k % 32 == 0 and m > TILE_M
            and row_groups * math.ceil(m / (2 * TILE_M)) >= tuning.tile_n_min_groups):
        return TILE_N_WIDE, 1, True
    groups = row_groups * math.ceil(m / TILE_M)
    if groups >= tuning.tile_n_min_groups:
        return TILE_N_WIDE, 1, False
    most = tuning.tile_split_k_f16 if wt == "f16" else tuning.tile_split_k_quant if wt in QUANT_TYPES else 1
    split = 1
    while groups * split < tuning.tile_n_min_groups and 2 * split <= most and k % (2 * split * 128) == 0:
        split *= 2
    if split == 1 and _qk_norm(epilogue, a) and a["head_dim"] > 64:
        return TILE_N_WIDE, 1, False   # a 64-row tile holds no whole head of the per-head norms
    return (TILE_N_WIDE, split, False) if split > 1 else (64, 1, False)


def _qk_norm(epilogue: str | None, a: dict[str, Any]) -> bool:
    return epilogue == "rope_kv_store" and bool(a.get("qk_norm"))


def _heads_per_group(rw: int, epilogue: str | None, a: dict[str, Any]) -> int:
    """Whole heads a group of rw slots holds (matmul_common.cl QK_HPG): per-head norms need
    them; 0 for another epilogue."""
    return rw // a["head_dim"] if _qk_norm(epilogue, a) else 0


def _row_groups(epilogue: str | None, rw: int, n: int, a: dict[str, Any], rope_heads: bool = False) -> int:
    """Groups along dim 0 of a matmul launch, by the slot rule of matmul.cl's slot_row()."""
    if epilogue == "silu_mul":
        return math.ceil(n // 2 / (rw // 2))
    if rope_heads:
        return a["n_heads"] + 2 * a["n_kv_heads"]
    if epilogue == "rope_kv_store":
        h, kvh, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
        pairs_per_group = _heads_per_group(rw, epilogue, a) * hd // 2 or rw // 2
        return math.ceil((h + kvh) * hd // 2 / pairs_per_group) + math.ceil(kvh * hd / rw)
    return math.ceil(n / rw)


def qk_norm_rows(wg: int, hd: int, kv_blocks: bool) -> int:
    """Slots of a decode matvec group with per-head norms: whole heads (the head_dim rounded up
    to the group's warps, one row set each: no split), a multiple of 64 for Q8_0 / q4_0 caches, whose
    blocks epilogue_chunk writes (head_dim is one there: a multiple of 64 stays unpadded)."""
    step = math.lcm(wg // 32, 64 if kv_blocks else 2)
    return -(-hd // step) * step


def qk_split_rows(wg: int, hd: int, kv_blocks: bool) -> int | None:
    """Slots of a decode matvec group whose heads are split over several groups (matvec.cl
    QK_SPLIT): the fewest that divide head_dim (a group's pairs then lie in one head), are a
    multiple of the group's warps (whole rows a warp) and, for Q8_0 / q4_0 caches, of the 32-value
    blocks v groups store; None where no such split exists (each group then takes whole heads).
    Groups of whole heads are few: H100, Qwen3-0.6B's qkv (q4_0, 32 groups of 128 rows) took
    12.3 us a decode step against 8.6 without the norms."""
    step = math.lcm(wg // 32, 32 if kv_blocks else 2)
    return next((rw for rw in range(step, hd, step) if hd % rw == 0), None)


def _qk_defer(ctx: _Ctx, op: Op, m: int, k: int, hd: int, options: list[str]) -> bool:
    """Whether a qkv matvec with per-head norms leaves them, with RoPE and the key's cache store,
    to the decode attention kernel that reads its q (attention_decode.cl QK_DEFER): a decode
    graph's single row into an f32 / f16 cache, whose attention takes that kernel."""
    if not ctx.tuning.qk_defer or ctx.graph.name in (STEP, VERIFY) or m != 1 or k % 8 or "-DKV_BLOCKS" in options:
        return False
    return hd % 32 == 0 and hd <= ctx.tuning.att_dec_wg and any(
        o.kind == "attention" and o.inputs[0] == op.outputs[0] and "block_size" not in o.attrs for o in ctx.graph.ops)


def qk_norm_parts(threads: int, tokens: int, hpg: int, hd: int) -> int:
    """Threads summing one head's squares in matmul_common.cl's pre_epilogue (QK_PARTS): the
    group's threads over its tokens' heads, each summing at least 8 values."""
    return max(1, min(threads // (tokens * hpg), hd // 8))


VERIFY = "verify"   # compiler/pipeline.py: its rows go through decode's matvec and attention kernels
STEP = "step"       # models/step.py: many sequences' rows a step


def _matmul(ctx: _Ctx, op: Op) -> None:
    tuning = ctx.tuning
    matvec = ctx.graph.name == VERIFY
    a = op.attrs if op.kind == "fused_matmul" else {}
    x, w, extra = op.inputs[0], op.inputs[1], list(op.inputs[2:])
    m, k = ctx.shape(x)
    n = ctx.shape(w)[0]
    wt = ctx.dtype(w)
    _need(wt in WEIGHT_TYPES, op, f"weight {w!r} is {wt}; expected one of {', '.join(WEIGHT_TYPES)}")
    quantized = wt in QUANT_TYPES
    _need(k % (32 if quantized else 4) == 0, op, f"K = {k} is not a multiple of {32 if quantized else 4}, "
          "which the OpenCL matmul kernels need")
    options = [f"-DW_T={wt}", f"-DW_{wt.upper()}"]
    if k % 32:
        options.append("-DK_TAIL")             # float weights: matmul.cl cuts the last block at K
    nw = _NONE
    bias = None   # the last input: a plain matmul's third, or attr bias (compiler/ir.py)
    if (op.kind == "matmul" and len(extra) == 1) or a.get("bias"):
        bias = extra.pop()
        options.append("-DBIAS")
    if a.get("prologue") == "rms_norm":
        nw_name = extra.pop(0)
        options += ["-DPROLOGUE_RMS", f"-DNORM_T={_float_type(ctx, op, nw_name, 'norm weight')}"]
        if a.get("norm_folded"):
            options.append("-DNORM_UNIT")      # nw is ones (fuse.py norm_weight_fold): not loaded
        nw = _v(nw_name)
    e = [_NONE, _NONE, _NONE]
    epi = a.get("epilogue")
    heads = (0, 0, 0)
    rope_heads = False
    if epi == "add":
        options.append("-DEPI_ADD")
        e[0] = _v(extra[0])
    elif epi == "silu_mul":
        options.append("-DEPI_SILU_MUL")
    elif epi == "rope_kv_store":
        kv = _kv_type(ctx, op, extra[1])
        _need(ctx.dtype(extra[2]) == kv, op, "k and v caches must share one dtype")
        options += ["-DEPI_ROPE_KV", *_kv_options(kv)]
        e = [_v(extra[0]), _v(extra[1]), _v(extra[2])]
        heads = (a["n_heads"], a["n_kv_heads"], a["head_dim"])
        rope_heads = rope_heads_q8(a, kv)
    elif epi is not None:
        raise CodegenError(f"op {op.name} (fused_matmul): epilogue {epi!r} has no OpenCL kernel")
    # a step graph's positions and slots (matmul_common.cl STEP_ROWS): the kernel's last arguments
    step_rows = []
    if epi == "rope_kv_store" and a.get("step_rows"):
        options.append("-DSTEP_ROWS")
        step_rows = [_v(extra[-2]), _v(extra[-1]), {"int": ctx.shape(extra[1])[0]}]
    qk_norm = _qk_norm(epi, a)
    if qk_norm:   # Qwen3's q_norm / k_norm weights, after the caches
        qkn = _float_type(ctx, op, extra[3], "q norm weight")
        _need(ctx.dtype(extra[4]) == qkn, op, "the q and k norm weights must share one dtype")
    if qk_norm and _qk_defer(ctx, op, m, k, heads[2], options):
        # raw k [m, KVH * hd], then the attention's finished q [m, H * hd] for the eviction scores
        kraw = {"staging": 4 * m * (heads[1] + heads[0]) * heads[2]}
        ctx.deferred[op.outputs[0]] = {"freq": extra[0], "qn": extra[3], "kn": extra[4], "eps": float(a["qk_eps"]),
                                       "qkn_t": qkn, "kraw": kraw}
        options.append("-DQK_DEFER")
        e[0] = kraw                              # the epilogue writes raw k there, not RoPE's inv_freq
        a, qk_norm = {**a, "qk_norm": False}, False
    if qk_norm:
        options += ["-DQK_NORM", f"-DQKN_T={qkn}"]
    # a group per head is a matvec (its RW = hd is no tile width), prefill too: one token a group
    # row, weights read once per token; only Q8_0 / q4_0 caches of head_dim % 64 == 32 take it. Rows of
    # float weights that are no whole 16-byte units (K % 8, e.g. 9 heads x 100) only the tiled
    # kernel reads, in decode too
    # heads wider than a 128-row tile take the matvec with per-head norms (whole heads a group)
    wide_heads = qk_norm and heads[2] > TILE_N_WIDE
    _need(not (wide_heads and k % 8), op, f"head_dim {heads[2]} with per-head norms and K = {k} (no multiple "
          "of 8): the OpenCL kernels have no layout for it; use --weights q8_0 or the CPU")
    # a step graph's row matmuls run each row by its kind (ROW_SPLIT): prompt rows through the
    # tiled kernels, generated rows through the matvec, so no row's bits depend on what else is
    # in its step, and a decode row pays a matvec, not a 64-row tile
    if (ctx.graph.name == STEP and m == ctx.graph.T and m > 1 and k % 8 == 0 and not rope_heads and not wide_heads
            and tuning.mv_generated_rows):
        _matmul_variant(ctx, op, True, "lead", **_variant_inputs(locals()))
        _matvec_rows(ctx, op, "rest", _variant_inputs(locals()))
        return
    # a step graph's quantized head (its logit rows, fewer than its tokens) is a matvec for every
    # row too, sized by the step's logit rows: the tiled head read its weights in 64-token tiles
    # for a row or two (H200 1B q4_0 212 us a step against decode's ~60; one sequence 570 -> 654
    # tok/s, 8 sequences 2337 -> 2435, 16 2921 -> 2869). A float head stays tiled (its matvec read
    # the 525 MB f16 head once per 1 or 4 rows: 16 sequences 2344 -> 2147 and 2215 -> 1945) unless
    # the tensor-core matvec takes it, 16 rows a group, as it takes the generated rows
    head = ctx.graph.name == STEP and m < ctx.graph.T and (quantized or matvec_mma(tuning, wt, k, False, False))
    tiled = ((m > 1 and not matvec and not head) or k % 8 != 0) and not rope_heads and not wide_heads
    if head and not tiled:
        _matvec_rows(ctx, op, "logits", _variant_inputs(locals()))
        return
    _matmul_variant(ctx, op, tiled, "", **_variant_inputs(locals()))


def _matvec_rows(ctx: _Ctx, op: Op, part: str, inputs: dict[str, Any]) -> None:
    """A step graph's generated rows ("rest") or quantized head ("logits") as matvecs: where the
    one-token matvec has a twin that sums each row alike, the pair (the one-token matvec below
    mv_sx_from rows a step, the twin from there: quantized weights' MV_SX, x staged once a row;
    float weights' mv_toks_float rows a group), else the one variant for every row count."""
    tuning, sx = ctx.tuning, ctx.tuning.mv_sx_from
    quantized, qk_norm, epi = inputs["quantized"], inputs["qk_norm"], inputs["epi"]
    if matvec_mma(tuning, inputs["wt"], inputs["k"], qk_norm, inputs["rope_heads"]):
        pair = False    # MV_MMA is the one variant
    elif quantized:   # no twin where a group needs whole heads or KV blocks, nor beside MV_MMA
        pair = (not tuning.mv_mma and tuning.mv_sx_toks > 1 and not qk_norm
                and not (epi == "rope_kv_store" and "-DKV_BLOCKS" in inputs["options"]))
    else:           # float weights off the tensor-core matvec: their head is tiled, never here
        pair = tuning.mv_toks_float > 1 and not qk_norm
    if not (sx and pair and inputs["m"] >= sx):
        _matmul_variant(ctx, op, False, part, **inputs)
        return
    _matmul_variant(ctx, op, False, part, **inputs, rows=(0, sx))
    _matmul_variant(ctx, op, False, part, **inputs, rows=(sx, 0))


_VARIANT_INPUTS = ("options", "a", "x", "w", "extra", "m", "k", "n", "wt", "quantized", "nw", "bias", "e", "epi",
                   "heads", "rope_heads", "step_rows", "qk_norm")


def _variant_inputs(names: dict[str, Any]) -> dict[str, Any]:
    return {key: names[key] for key in _VARIANT_INPUTS}


def _matmul_variant(ctx: _Ctx, op: Op, tiled: bool, part: str, *, options: list[str], a: dict[str, Any], x: str,
                    w: str, extra: list[str], m: int, k: int, n: int, wt: str, quantized: bool, nw: dict[str, Any],
                    bias: str | None, e: list[dict[str, Any]], epi: str | None, heads: tuple[int, int, int],
                    rope_heads: bool, step_rows: list[dict[str, Any]], qk_norm: bool,
                    rows: tuple[int, int] = (0, 0)) -> None:
    """One launch (two with X_STAGED or MV_SX) of a matmul: the tiled kernel or the matvec; `part`
    "lead" / "rest": only the step's rows before / from its row split (ROW_SPLIT); `rows`: a
    "rest" / "logits" variant's (rows_from, rows_below): a token a group below, and from
    rows_from > 0 on quantized weights' MV_SX twin or float weights' mv_toks_float a group."""
    tuning = ctx.tuning
    options = options + (["-DROW_SPLIT"] if part in ("lead", "rest") else [])
    mv_wg = tuning.mv_wg_quant if quantized else tuning.mv_wg
    qk_split = 0
    # a step graph's generated rows on tensor cores, 16 a group (matvec.cl MV_MMA)
    mma = (part == "rest" or (part == "logits" and not quantized)) and matvec_mma(tuning, wt, k, qk_norm,
                                                                                   rope_heads)
    if mma:
        mv_wg, mv_rows, mv_split = matvec_mma_shape(tuning, epi, "-DKV_BLOCKS" in options, wt, n)
    elif rows[0] > 0 and quantized:   # MV_SX: its own shape (a row's sums are the one-token matvec's whatever it)
        mv_wg, mv_rows, mv_split = tuning.mv_sx_wg, tuning.mv_sx_wg // 32 * tuning.mv_sx_rpw, 1
    elif rope_heads:
        mv_rows, mv_split = heads[2], 1
        options.append("-DROPE_HEADS")
    elif qk_norm and not tiled and (split_rows := qk_split_rows(mv_wg, heads[2], "-DKV_BLOCKS" in options)):
        mv_rows, mv_split = split_rows, 1       # a head over hd / rows groups, merged by tickets
        qk_split = heads[2] // split_rows
        options.append(f"-DQK_SPLIT={qk_split}")
    elif qk_norm:   # whole heads a group: float weights too take the larger groups of quantized
        # ones, more warps (fewer rows each) on a head (H100 f16 Qwen3-0.6B qkv 12.5 -> 11.9 us)
        mv_wg = max(mv_wg, tuning.mv_wg_quant)
        mv_rows, mv_split = qk_norm_rows(mv_wg, heads[2], "-DKV_BLOCKS" in options), 1
    else:
        mv_wg, mv_rows, mv_split = matvec_shape(tuning, k, n, quantized, epi, "-DKV_BLOCKS" in options)
    tile_n, split, pair = tile_shape(tuning, m, k, n, wt, epi, a) if tiled else (0, 1, False)
    if epi == "rope_kv_store" and (qk_norm or bias):
        options.append(f"-DROPE_HD={heads[2]}")   # pre_epilogue's slot arithmetic by constants
    if qk_norm:
        rw = tile_n if tiled else mv_rows
        hpg = 1 if rope_heads or qk_split else _heads_per_group(rw, epi, a)
        tokens, threads = (TILE_M, 256) if tiled else (1, mv_wg)
        options += [f"-DQK_HPG={hpg}", f"-DQK_PARTS={qk_norm_parts(threads, tokens, hpg, heads[2])}"]
    if tiled:
        options.append(f"-DTN={tile_n}")
        if split > 1:
            options.append(f"-DMM_SPLIT={split}")
    rw = tile_n if tiled else mv_rows
    row_groups = _row_groups(epi, rw, n, a, rope_heads)
    tiles = row_groups * math.ceil(m / TILE_M)   # split-K's counters and partials (pairs never split)
    if pair:
        options += ["-DMM_TPAIR", f"-DASYNC_K={tuning.async_pair_k}", f"-DASYNC_STAGES={tuning.async_pair_stages}"]
    if not tiled:
        _need(wt not in QUANT_TYPES or k <= tuning.mv_max_k, op, f"K = {k} is over {tuning.mv_max_k}, the "
              "longest row the decode matvec keeps in local memory; use --weights f16")
        loads = tuning.mv_sx_loads if rows[0] > 0 and quantized else tuning.mv_loads
        options += [f"-DMV_WG={mv_wg}", f"-DMV_ROWS={mv_rows}", f"-DMV_K={k}", f"-DMV_LOADS={loads}",
                    f"-DMV_SPLIT={mv_split}"]
        if not mma and _rms_late(mv_split, bool(a.get("norm_folded"))):
            options.append("-DMV_RMS_LATE")   # matvec.cl applies it to float weights' RMS prologue
    # the generated rows of a step graph, T a group; decode, verify and a step's head keep a token a group
    sx = rows[0] > 0 and quantized
    if mma:
        toks = MMA_TOKENS
        if quantized and tuning.mv_mma_lx:
            options += ["-DMV_MMA", "-DMV_MMA_LX"]   # its lanes quantize x: no stage_x
        else:
            options += ["-DMV_MMA"] + ([f"-DMV_MMA_KC={mma_chunk(k, tuning.mv_mma_chunk)}"] if quantized else [])
    elif sx:
        toks = max(2, min(tuning.mv_sx_toks, m))
        stage_wg, stage_rows, _ = matvec_shape(tuning, k, n, quantized, epi, "-DKV_BLOCKS" in options)
        stage_options = [o for o in options if not o.startswith(("-DMV_WG=", "-DMV_ROWS="))]
        stage_options += [f"-DMV_WG={stage_wg}", f"-DMV_ROWS={stage_rows}", "-DMV_SX_STAGE"]
        options.append("-DMV_SX")
    else:
        one = bool(qk_split or rope_heads or rows[1])   # rows_below: the pair's one-token variant
        toks = matvec_tokens(tuning, m, k, quantized, one) if part == "rest" else 1
    if toks > 1:
        options.append(f"-DMV_TOKS={toks}")
    if not tiled and m > toks and tuning.mv_tokens_inner:
        options.append("-DMV_TOKS_INNER")
    eps, ints = {"float": float(a.get("eps", 0.0))}, [{"int": h} for h in heads]
    # last: b (BIAS); qn, kn, qk_eps (QK_NORM)
    late = ([_v(bias)] if bias else []) + ([_v(extra[3]), _v(extra[4]), {"float": float(a["qk_eps"])}]
                                           if qk_norm else [])
    if tiled:
        args = [_v(x), _v(w), nw, *e, _v(op.outputs[0]), {"int": m}, {"int": k}, {"int": n}, eps, *ints]
    else:   # only what the variant reads (matvec.cl's MV_HAS_*): a launch's host time on NVIDIA's
        # driver grows ~0.08 us per argument (SmolLM2 decode, H100: 550 -> 643 tok/s, round 10)
        rms, kv = a.get("prologue") == "rms_norm", epi == "rope_kv_store"
        args = [_v(x), _v(w), *([nw] if rms else []), *([e[0]] if epi in ("add", "rope_kv_store") else []),
                *(e[1:] if kv else []), _v(op.outputs[0]), {"int": m}, {"int": k}, {"int": n},
                *([eps] if rms else []), *(ints if kv else []), *late]
        if qk_split:   # the heads' tickets, then their rows
            args.append({"scratch": 4 * m * (heads[0] + heads[1]) * (1 + heads[2])})
        if mma and quantized and not tuning.mv_mma_lx:   # x as stage_x leaves it for the step's
            # rows from the split on (f16 weights, and quantized ones with mv_mma_lx: each lane
            # reads and converts its values of x, matvec.cl mv_mma_sums)
            staged = {"staging": staging_bytes(m, k, wt)}
            ctx.launches.append(Launch(op.name, "matmul", "stage_x", options + ["-DX_STAGED", "-DSTAGE_REST"],
                                       [_v(x), nw, staged, {"int": m}, {"int": k}, eps],
                                       local=STAGE_WG, groups=1, rows=m, row_tile=1, part=part))
            args.append(staged)
        if sx:   # x's blocks as matvec_stage leaves them, its launch first
            staged = {"staging": m * k + 8 * m * (k // 32)}
            # built with the one-token matvec's threads, which order its RMS sum
            ctx.launches.append(Launch(op.name, "matvec", "matvec_stage", stage_options,
                                       [_v(x), *([nw] if rms else []), staged, {"int": m}, *([eps] if rms else [])],
                                       local=stage_wg, groups=1, rows=m, row_tile=1, part=part,
                                       rows_from=rows[0], rows_below=rows[1]))
            args.append(staged)
        args += step_rows
    if tiled:
        staged = _NONE
        if (quantized or wt == "f16") and k % 32 == 0:
            options.append("-DX_STAGED")
            # f16 128-row tiles: the cp.async body (H200 1B prefill 8.30 -> 8.10 ms; on 64-row
            # tiles too, o_proj + down_proj 3.00 -> 3.19 ms, round 11)
            if wt == "f16" and tile_n == TILE_N_WIDE:
                options += ["-DMMA_ASYNC", f"-DWG_K={tuning.wgmma_k}"]
            parts = split_parts_at(m, k, wt) + 4 * split * TILE_M * tile_n * tiles if split > 1 else 0
            staged = {"staging": max(staging_bytes(m, k, wt), parts)}
            ctx.launches.append(Launch(op.name, "matmul", "stage_x", options,
                                       [_v(x), nw, staged, {"int": m}, {"int": k}, eps],
                                       local=STAGE_WG, groups=1, rows=m, row_tile=1, part=part))
        args.append(staged)
        if split > 1:   # partials (in the staging buffer, after x) and the tiles' ticket counters
            args += [staged, {"scratch": 4 * tiles}]
        args += late + step_rows
    ctx.launches.append(Launch(op.name, "matmul" if tiled else "matvec", "matmul_tiled" if tiled else "matvec",
                               options, args,
                               local=256 if tiled else mv_wg, groups=row_groups * split,
                               rows=m, row_tile=(2 * TILE_M if pair else TILE_M) if tiled else toks, part=part,
                               rows_from=rows[0], rows_below=rows[1]))


def _attention(ctx: _Ctx, op: Op) -> None:
    tuning = ctx.tuning
    a = op.attrs
    q, k, v = op.inputs[:3]
    m = ctx.shape(q)[0]
    hd, h = a["head_dim"], a["n_heads"]
    kv = _kv_type(ctx, op, k)
    _need(ctx.dtype(v) == kv, op, "k and v caches must share one dtype")
    _need(hd % 4 == 0 and hd <= 4 * tuning.att_wg, op, f"head_dim {hd}: the OpenCL attention kernels need a "
          f"multiple of 4 (they read K/V rows 4 values at a time) of at most {4 * tuning.att_wg}")
    kvh = a["n_kv_heads"]
    _need(h % kvh == 0, op, f"n_heads {h} is not a multiple of n_kv_heads {kvh}")
    _need(q not in ctx.deferred or (m == 1 and hd % 32 == 0 and hd <= tuning.att_dec_wg), op,
          "internal: a deferred q/k norm needs the decode attention kernel")
    if "block_size" in a:
        _paged_attention(ctx, op, kv)
        return
    # the scores read q and the new key, which a deferred q/k norm leaves to the attention kernel
    if len(op.inputs) == 5 and q not in ctx.deferred:
        _attention_scores(ctx, op, kv)
    options = [f"-DHEAD_DIM={hd}", *_kv_options(kv), f"-DATT_WG={tuning.att_wg}"]
    args = [_v(q), _v(k), _v(v), _v(op.outputs[0])]
    scalars = [{"int": h}, {"int": a["n_kv_heads"]}, {"float": float(a["scale"])}, {"int": m}]
    if m > 1 and ctx.graph.name != VERIFY:     # a verify step's rows each as a decode step (row t: t + 1 more keys)
        keys = min(32, _pow2_at_most(tuning.att_tile_bytes // (2 * 4 * hd)))
        tile = [f"-DATT_BQ={tuning.att_bq}"] + ([f"-DATT_BK={keys}"] if keys != 32 else [])
        ctx.launches.append(Launch(op.name, "attention", "attention_tiled", options + tile,
                                   args + scalars,
                                   local=tuning.att_bq, groups=h, rows=m, row_tile=tuning.att_bq))
    elif hd % 32 == 0 and hd <= tuning.att_dec_wg:   # a key per lane (H200 170 -> 157 us a step, round 8)
        splits = max(1, min(tuning.att_dec_max_splits, math.ceil(ctx.shape(k)[0] / tuning.att_dec_wg)))
        scratch = 4 * m * h + 4 * m * h * splits * (hd + 2)   # counters, then partials
        qk, late = [], []
        if (d := ctx.deferred.get(q)) is not None:   # the qkv matvec left q / k norms and RoPE here
            qk = ["-DQK_DEFER", f"-DQKN_T={d['qkn_t']}", f"-DQK_PARTS={qk_norm_parts(tuning.att_dec_wg, 1, 1, hd)}"]
            late = [d["kraw"], _v(d["freq"]), _v(d["qn"]), _v(d["kn"]), {"float": d["eps"]}]
        ctx.launches.append(Launch(op.name, "attention", "attention_decode",
                                   [f"-DHEAD_DIM={hd}", *_kv_options(kv), f"-DATT_WG={tuning.att_dec_wg}",
                                    f"-DATT_SPLITS={splits}", "-DATT_DECODE_WARP", *qk],
                                   args + [{"scratch": scratch}] + scalars + late,
                                   local=tuning.att_dec_wg, groups=h * splits, rows=m))
        if qk and len(op.inputs) == 5:   # q as the attention finished it (attention_decode.cl)
            _attention_scores(ctx, op, kv, q_arg={"staging": 4 * m * h * hd, "at": 4 * m * kvh * hd})
    else:
        splits = max(1, min(tuning.att_max_splits, ctx.shape(k)[0] // tuning.att_keys_per_split))
        scratch = 4 * m * h + 4 * m * h * splits * (hd + 2)   # counters, then partials
        ctx.launches.append(Launch(op.name, "attention", "attention_split",
                                   options + [f"-DATT_SPLITS={splits}"],
                                   args + [{"scratch": scratch}] + scalars,
                                   local=tuning.att_wg, groups=h * splits, rows=m))


def paged_splits(tuning: OpenCLTuning, m: int, h: int, hd: int, slots: int) -> int:
    """Work-groups a row and head of attention_paged_rows at most: a group per att_dec_wg
    entries of the whole cache, at most att_dec_max_splits, halved while the partials of m
    rows (scratch) would pass att_paged_scratch_bytes. Fixed by the graph, never by a step: a
    row's arithmetic depends on it (attention_paged.cl)."""
    splits = max(1, min(tuning.att_dec_max_splits, math.ceil(slots / tuning.att_dec_wg)))
    while splits > 1 and 4 * m * h * splits * (hd + 2) > tuning.att_paged_scratch_bytes:
        splits //= 2
    return splits


def paged_tiles(tuning: OpenCLTuning, m: int, hd: int) -> bool:
    """Whether runs of rows of one sequence go to attention_paged_tiles: a step of several rows
    whose staged K (rows padded by 16 bytes), V and q, and the portable reductions' floats, fit
    att_paged_local_bytes (head_dim 128: 41 KB; 256 does not fit NVIDIA's 48 KB)."""
    rows = tuning.att_dec_wg // 32 * tuning.att_paged_rpw
    local = 16 * (32 * (hd // 4 + 1) + 32 * hd // 4 + rows * hd // 4) + 4 * tuning.att_dec_wg
    return m > 1 and local <= tuning.att_paged_local_bytes


def paged_heads(tuning: OpenCLTuning, h: int, kvh: int, hd: int) -> int:
    """Query heads a group of attention_paged_rows takes (ATT_HPG): with att_paged_gqa, the most
    heads of one KV head whose warps' states fit att_paged_hpg_bytes of local memory, each K and
    V row then read once for them; else 1. A head's bits are the same either way."""
    if not tuning.att_paged_gqa:
        return 1
    group = h // kvh
    fits = [n for n in range(1, group + 1)
            if group % n == 0 and 4 * n * (tuning.att_dec_wg // 32) * (hd + 2) <= tuning.att_paged_hpg_bytes]
    return max(fits)


def _paged_attention(ctx: _Ctx, op: Op, kv: str) -> None:
    """A step graph's attention through block tables (attention_paged*.cl): rows with a
    neighbour row of their sequence in attention_paged_tiles (where it is on), the others in
    attention_paged_rows; the same bits either way."""
    tuning, a = ctx.tuning, op.attrs
    q, k, v, row_seq, ctx_len, tables = op.inputs[:6]
    m = ctx.shape(q)[0]
    hd, h, kvh = a["head_dim"], a["n_heads"], a["n_kv_heads"]
    _need(hd <= 256, op, f"head_dim {hd}: the paged attention kernels hold at most 256 dims (8 a lane)")
    splits = paged_splits(tuning, m, h, hd, ctx.shape(k)[0])
    wg = tuning.att_dec_wg
    # the runtime launches only the splits the step's longest row needs (ATT_GRID_BY_ROWS): a grid
    # sized for the whole cache was 16 384 groups at 16 rows, nearly all returning at once
    options = [f"-DHEAD_DIM={hd}", *_kv_options(kv), f"-DKV_BLOCK={a['block_size']}", f"-DATT_WG={wg}",
               f"-DATT_SPLITS={splits}", "-DATT_GRID_BY_ROWS"]
    tiles = paged_tiles(tuning, m, hd)
    if tiles:
        options += ["-DATT_TILES", f"-DATT_RPW={tuning.att_paged_rpw}"]
    hpg = paged_heads(tuning, h, kvh, hd)
    args = [_v(q), _v(k), _v(v), _v(op.outputs[0]), _v(row_seq), _v(ctx_len), _v(tables)]
    scalars = [{"int": h}, {"int": kvh}, {"float": float(a["scale"])}, {"int": m}, {"int": ctx.shape(tables)[1]}]
    scratch = 4 * m * h + 4 * m * h * splits * (hd + 2)   # counters, then partials
    ctx.launches.append(Launch(op.name, "attention_paged", "attention_paged_rows",
                               options + ([f"-DATT_HPG={hpg}"] if hpg > 1 else []),
                               args + [{"scratch": scratch}] + scalars, local=wg, groups=h // hpg * splits, rows=m))
    if tiles:
        ctx.launches.append(Launch(op.name, "attention_paged", "attention_paged_tiles", options, args + scalars,
                                   local=wg, groups=h, rows=m, row_tile=wg // 32 * tuning.att_paged_rpw))
    if len(op.inputs) == 8:
        _paged_attention_scores(ctx, op, kv)


def _attention_scores(ctx: _Ctx, op: Op, kv: str, q_arg: dict[str, Any] | None = None) -> None:
    """The op's eviction scores (attention_scores.cl), a launch of their own that the back end
    leaves out of a step unless a policy wants scores: the attention kernels stay as they are.
    q_arg: where q is, if not the op's input (a deferred q/k norm's, finished by the attention)."""
    a = op.attrs
    q, k, _, scores, ctl = op.inputs
    m = ctx.shape(q)[0]
    ctx.launches.append(Launch(op.name, "attention_scores", "attention_scores",
                               [f"-DHEAD_DIM={a['head_dim']}", *_kv_options(kv), f"-DSC_WG={ctx.tuning.sc_wg}",
                                f"-DSC_GROUP={a['n_heads'] // a['n_kv_heads']}"],
                               [q_arg or _v(q), _v(k), _v(scores), _v(ctl), {"int": a["n_heads"]},
                                {"int": a["n_kv_heads"]}, {"float": float(a["scale"])},
                                {"int": ctx.shape(scores)[1]}],
                               local=ctx.tuning.sc_wg, groups=a["n_kv_heads"], rows=m, row_tile=m, scores=True))


def _paged_attention_scores(ctx: _Ctx, op: Op, kv: str) -> None:
    """A step graph's eviction scores (attention_scores.cl attention_scores_paged): a group per
    KV head and sequence of the step, launched only while the back end is scoring."""
    a = op.attrs
    q, k, _, row_seq, ctx_len, tables, scores, score_from = op.inputs
    ctx.launches.append(Launch(op.name, "attention_scores", "attention_scores_paged",
                               [f"-DHEAD_DIM={a['head_dim']}", *_kv_options(kv), f"-DSC_WG={ctx.tuning.sc_wg}",
                                f"-DSC_GROUP={a['n_heads'] // a['n_kv_heads']}", f"-DKV_BLOCK={a['block_size']}"],
                               [_v(q), _v(k), _v(scores), _v(row_seq), _v(ctx_len), _v(tables), _v(score_from),
                                {"int": a["n_heads"]}, {"int": a["n_kv_heads"]}, {"float": float(a["scale"])},
                                {"int": ctx.shape(scores)[1]}, {"int": ctx.shape(tables)[1]}],
                               local=ctx.tuning.sc_wg, groups=a["n_kv_heads"] * ctx.shape(tables)[0],
                               rows=ctx.shape(q)[0], row_tile=ctx.shape(q)[0], scores=True))


def _unit(row_bytes: int) -> tuple[int, str]:
    """The widest load that divides a row: (bytes, OpenCL type)."""
    for size, name in ((16, "uint4"), (8, "uint2"), (4, "uint"), (2, "ushort")):
        if row_bytes % size == 0:
            return size, name
    raise CodegenError(f"a KV row of {row_bytes} bytes has no 2-byte unit to compact by")


def compactions(graph: Graph, tuning: OpenCLTuning) -> list[dict[str, Any]]:
    """How kv_compact.cl moves each state an eviction touches: the K and V caches and the
    scores of every attention op that writes scores."""
    out = []
    for op in graph.ops:
        if op.kind != "attention" or len(op.inputs) != 5:
            continue
        for name in op.inputs[1:4]:
            v = graph.values[name]
            state = graph.values[v.alias] if v.alias else v
            if len(state.shape) == 3:              # a cache [S, KVH, hd]: head rows of hd values
                rows, heads = state.shape[:2]
                row_bytes = state.nbytes // (rows * heads)
                unit, utype = _unit(row_bytes)
                slot_stride, head_stride, zero_tail = heads * row_bytes // unit, row_bytes // unit, False
            else:                                  # scores [KVH, S]: one f32 per row
                heads, rows = state.shape
                row_bytes, unit, utype = 4, 4, "uint"
                slot_stride, head_stride, zero_tail = 1, rows, True
            out.append({"state": state.name, "local": tuning.compact_wg,
                        "options": [f"-DKV_UNIT={utype}", f"-DROW_UNITS={row_bytes // unit}",
                                    f"-DCOMPACT_WG={tuning.compact_wg}"],
                        "heads": heads, "rows": rows, "unit": unit, "slot_stride": slot_stride,
                        "head_stride": head_stride, "zero_tail": zero_tail})
    return out


def _rms_norm(ctx: _Ctx, op: Op) -> None:
    x, w = op.inputs
    m, d = ctx.shape(x)
    group = ctx.shape(w)[0]       # a group per run of G values of a row (G == D: the row)
    options = [f"-DNORM_T={_float_type(ctx, op, w, 'norm weight')}", f"-DNORM_WG={ctx.tuning.norm_wg}"]
    ctx.launches.append(Launch(op.name, "norm", "rms_norm", options,
                               [_v(x), _v(w), _v(op.outputs[0]), {"int": d}, {"float": float(op.attrs["eps"])},
                                {"int": group}],
                               local=ctx.tuning.norm_wg, groups=d // group, rows=m))


def _rope(ctx: _Ctx, op: Op) -> None:
    a = op.attrs
    _need(len(op.inputs) >= 2 and ctx.dtype(op.inputs[1]) == "f32", op, "needs the folded inv_freq constant "
          "as its second input (run the fold pass before OpenCL codegen)")
    m = ctx.shape(op.inputs[0])[0]
    pairs = a["n_heads"] * a["head_dim"] // 2
    positions = op.inputs[2:]                           # a step graph's (rope.cl STEP_ROWS)
    ctx.launches.append(Launch(op.name, "rope", "rope", ["-DKV_T=f32"] + (["-DSTEP_ROWS"] if positions else []),
                               [_v(op.inputs[0]), _v(op.inputs[1]), _v(op.outputs[0]),
                                {"int": a["n_heads"]}, {"int": a["head_dim"]}, *map(_v, positions)],
                               local=ctx.tuning.elt_wg, groups=math.ceil(pairs / ctx.tuning.elt_wg), rows=m))


def _kv_store(ctx: _Ctx, op: Op) -> None:
    src, cache, *slots = op.inputs                      # slots: a step graph's (rope.cl STEP_ROWS)
    m, width = ctx.shape(src)
    kv = _kv_type(ctx, op, cache)
    threads = width // 32 if kv in KV_BLOCK_TYPES else width    # q8_0 / q4_0: one thread per 32-value block
    at = [_v(slots[0]), {"int": ctx.shape(cache)[0]}] if slots else []
    ctx.launches.append(Launch(op.name, "rope", "kv_store", _kv_options(kv) + (["-DSTEP_ROWS"] if slots else []),
                               [_v(src), _v(cache), {"int": width}, *at],
                               local=ctx.tuning.elt_wg, groups=math.ceil(threads / ctx.tuning.elt_wg), rows=m))


def _embedding(ctx: _Ctx, op: Op) -> None:
    table, tokens = op.inputs
    d = ctx.shape(table)[1]
    tt = ctx.dtype(table)
    _need(tt in WEIGHT_TYPES, op, f"table {table!r} is {tt}")
    ctx.launches.append(Launch(op.name, "embedding", "embedding", [f"-DTABLE_T={tt}", f"-DTABLE_{tt.upper()}"],
                               [_v(table), _v(tokens), _v(op.outputs[0]), {"int": d},
                                {"int": ctx.shape(table)[0]}],
                               local=ctx.tuning.elt_wg, groups=math.ceil(d / ctx.tuning.elt_wg),
                               rows=ctx.shape(tokens)[0]))


def _elementwise(ctx: _Ctx, op: Op) -> None:
    m, d = ctx.shape(op.inputs[0])
    if op.kind == "silu":
        kernel, args = "silu_mul", [_v(op.inputs[0]), _NONE, _v(op.outputs[0]), {"int": d}, {"int": 0}]
    elif op.kind == "silu_mul":
        kernel, args = "silu_mul", [_v(op.inputs[0]), _v(op.inputs[1]), _v(op.outputs[0]), {"int": d}, {"int": 1}]
    else:
        kernel, args = op.kind, [_v(op.inputs[0]), _v(op.inputs[1]), _v(op.outputs[0]), {"int": d}]
    ctx.launches.append(Launch(op.name, "elementwise", kernel, [], args,
                               local=ctx.tuning.elt_wg, groups=math.ceil(d / ctx.tuning.elt_wg), rows=m))


def _slice(ctx: _Ctx, op: Op) -> None:
    d = ctx.shape(op.inputs[0])[1]
    ctx.launches.append(Launch(op.name, "elementwise", "last_row", [],
                               [_v(op.inputs[0]), _v(op.outputs[0]), {"int": d}],
                               local=ctx.tuning.elt_wg, groups=math.ceil(d / ctx.tuning.elt_wg), rows=1))


def _gather(ctx: _Ctx, op: Op) -> None:
    x, rows = op.inputs
    d = ctx.shape(x)[1]
    ctx.launches.append(Launch(op.name, "elementwise", "gather_rows", [],
                               [_v(x), _v(rows), _v(op.outputs[0]), {"int": d}],
                               local=ctx.tuning.elt_wg, groups=math.ceil(d / ctx.tuning.elt_wg), rows=ctx.shape(rows)[0]))


def _reduce(ctx: _Ctx, op: Op) -> None:
    m, d = ctx.shape(op.inputs[0])
    ctx.launches.append(Launch(op.name, "reduce", op.kind, [f"-DRED_WG={ctx.tuning.red_wg}"],
                               [_v(op.inputs[0]), _v(op.outputs[0]), {"int": d}],
                               local=ctx.tuning.red_wg, groups=1, rows=m))


LOWER = {
    "matmul": _matmul, "fused_matmul": _matmul, "attention": _attention, "rms_norm": _rms_norm,
    "rope": _rope, "kv_store": _kv_store, "embedding": _embedding, "add": _elementwise,
    "mul": _elementwise, "silu": _elementwise, "silu_mul": _elementwise, "slice": _slice,
    "gather": _gather, "softmax": _reduce, "argmax": _reduce,
}


def lower_graph(graph: Graph, tuning: OpenCLTuning = OpenCLTuning()) -> list[Launch]:
    """One launch per op, in the graph's (scheduled) order."""
    ctx = _Ctx(graph, tuning)
    for op in graph.ops:
        if op.kind not in LOWER:
            raise CodegenError(f"op {op.name}: kind {op.kind!r} has no OpenCL kernel")
        LOWER[op.kind](ctx, op)
    return ctx.launches


def greedy_launch(graph: Graph, tuning: OpenCLTuning) -> Launch | None:
    """Device-side argmax of the graph's output logits f32 [rows, V] into the result buffer,
    so greedy decoding reads back 4 bytes per row instead of the logits."""
    if not graph.outputs:
        return None
    out = graph.values[graph.outputs[0]]
    if out.dtype != "f32" or len(out.shape) != 2:
        return None
    rows, vocab = out.shape
    wg = tuning.red_wg
    groups = max(1, min(tuning.arg_max_groups, vocab // (wg * tuning.arg_values_per_thread)))
    scratch = 4 * rows + 8 * rows * groups       # counters, then (value, index) per group
    return Launch(f"{graph.name}.greedy", "reduce", "argmax_split",
                  [f"-DRED_WG={wg}", f"-DARG_GROUPS={groups}"],
                  [_v(out.name), {"result": 4 * rows}, {"scratch": scratch}, {"int": vocab}, {"int": rows}],
                  local=wg, groups=groups, rows=rows)


def generate(graphs: dict[str, Graph] | list[Graph] | tuple[Graph, ...],
             tuning: OpenCLTuning = OpenCLTuning()) -> dict[str, Any]:
    """The plan's "opencl" section: template sources, each graph's launch table and its
    greedy (device argmax) launch, shaped by `tuning` (opencl_tuning.py: the H100 / H200
    values unless told otherwise)."""
    if not isinstance(graphs, dict):
        graphs = {g.name: g for g in graphs}
    tables = {name: [asdict(launch) for launch in lower_graph(g, tuning)] for name, g in graphs.items()}
    greedy = {name: asdict(launch) for name, g in graphs.items()
              if (launch := greedy_launch(g, tuning)) is not None}
    compact = compactions(graphs["decode"] if "decode" in graphs else next(iter(graphs.values())), tuning)
    used = sorted({launch["family"] for table in tables.values() for launch in table}
                  | {launch["family"] for launch in greedy.values()} | ({"kv_compact"} if compact else set()))
    return {"format": FORMAT, "sources": {f: template_source(f) for f in used}, "graphs": tables,
            "greedy": greedy, "kv_compact": compact}
