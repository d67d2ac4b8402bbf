"""The OpenCL kernels' tuning as a value: work-group sizes, tile shapes and split counts that
codegen (opencl.py) turns into launch shapes and -D options.

OpenCLTuning() holds the values measured on NVIDIA H100 / H200 (BENCHMARKS.md, GPU rounds 1-13),
the tuning of a plan compiled without a device in mind; tuning_for(kind) adapts it to a device
kind's properties. Variants that lost their measurement were deleted rather than kept as
switches; BENCHMARKS.md keeps their figures. A measurement run overrides fields with
dataclasses.replace(tuning, FIELD=value) (tools/bench_opencl.py --variants).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class OpenCLTuning:
    # -- decode matvec (matvec.cl) ------------------------------------------------------------
    mv_wg: int = 256                 # threads per group, float weights
    mv_wg_quant: int = 512           # and quantized weights: 16 warps share one Q8_0 copy of x,
                                     # so half the groups prepare it (H200 q4_0 956 -> 997 tok/s,
                                     # round 5; 256 again in round 12: 1501 -> 1374)
    mv_max_rpw: int = 8              # weight rows per warp at most
    mv_target_warps: int = 4096      # rows per warp grow while a launch keeps about this many
                                     # warps (an H200: 132 SMs x 32), so every core's loads stay in
                                     # flight (8192: 0.80 ms a q4_0 step against 0.75, round 9)
    mv_loads: int = 16               # 16-byte weight loads a lane keeps in flight (registers
                                     # allowing; 8: the same, rounds 5 and 9)
    mv_split_target_warps: int = 8192   # narrow matrices (N under mv_target_warps) split K over
    mv_max_split: int = 2            # up to this many warps per row until a launch has about this
                                     # many warps (an H200 holds 132 x 64); a group keeps >= 2 rows
                                     # (pair epilogues). H200 f16 decode, same run: 2 gave 866.7
                                     # tok/s, 4 852.8 (down_proj 232 vs 247 us per step; round 12:
                                     # 4 splits and 16384 warps 991 -> 956)
    mv_max_k: int = 32768            # longest K of a quantized decode matvec: x's Q8_0 copy (1.25
                                     # bytes a value) sits in local memory (40 KB of NVIDIA's 48)
    mv_toks_quant: int = 1           # a step graph's generated rows a matvec group takes (matvec.cl
                                     # MV_TOKS), quantized weights: each weight batch read once for
                                     # them all; their Q8_0 copies of x share mv_max_k's local memory.
                                     # H100 1B q4_0, aggregate tok/s at 1 / 16 rows, one run: T 1
                                     # 749 / 3393, T 4 503 / 2994, T 16 379 / 2884 (round 17)
    mv_toks_float: int = 4           # and float weights (x read per token; acc[T][MV_RPW] registers):
                                     # 1B f16, T 1 504 / 1475, T 4 417 / 1884, T 8 373 / 1847
    mv_generated_rows: bool = True   # a step graph's generated rows through the decode matvec
                                     # (ROW_SPLIT), so each reads every weight once per row; False:
                                     # through the tiled kernels with the prompt rows, each weight
                                     # tile read once per 64 rows. H100 1B, aggregate tok/s at 1 /
                                     # 16 rows, one run: q4_0 781 / 3346 -> 235 / 2715, f16 511 /
                                     # 2406 -> 240 / 3063 (round 24: a tile's groups are few)
    mv_mma: bool = False             # a step graph's generated rows with quantized weights: 16 a
                                     # group on tensor cores (matvec.cl MV_MMA), each weight block
                                     # read once for them all; x prepared once by stage_x. Off: H200
                                     # 1B q4_0 aggregate tok/s at 1 / 4 / 8 / 16 rows a step, one
                                     # run, 1085 / 2494 / 3187 / 3668 without, 649 / 2123 / 3455 /
                                     # 5093 with it (round 24): a lone stream pays 0.6x
    mv_mma_f16: bool = True          # and with f16 weights (two m16n8k16 a block; x rounded to f16,
                                     # as the prefill matmul takes it), the one variant at every row
                                     # count, the step's head too. H200 1B f16, aggregate tok/s at 1 /
                                     # 4 / 8 / 16 rows, one run: without 835-846 / 1833-1837 / 2425-
                                     # 2463 / 2873-2894; with it 719 / 2520-2542 / 3806-3908 / 5124-
                                     # 5397 (a warp's K slice in consecutive blocks; every 8th block:
                                     # 639-645 / 2286-2310 / 3683-3720 / 4989-5057; round 28)
    mv_mma_f16_wg: int = 256         # its threads a group (512: 545-594 / 1998-2081 / 3287-3422 /
    mv_mma_f16_split: int = 8        # 4669-4888), and warps on one 8-row column's K (4: 470-482 /
                                     # 1810-1817 / 3169-3189 / 5224-5234; 8 slices only where a launch
                                     # has fewer than 8192 or 16384 warps without them, -1-7 %)
    mv_mma_f16_rpw: int = 16         # and weight rows a warp, a multiple of 8 (16: two MMA columns
                                     # share each lane's x values, half the reads of x a weight byte;
                                     # H200 1B f16, one run: 738-748 / 2615-2659 / 4258-4312 / 5972-
                                     # 6128 tok/s, 8: 694 / 2469 / 3855 / 5018; round 29)
    mv_mma_f16_rpw_wide: int = 64    # rows a warp of a matrix of mv_mma_f16_wide rows or more (0:
    mv_mma_f16_wide: int = 8192      # none; the same bits whatever the rows a warp): the 1B's gate/up
                                     # and head, its others 16. H200 1B f16 tok/s at 1 / 16 streams,
                                     # two passes each in one run: 64 744-799 / 6543-7183, 32
                                     # 734-735 / 6362-6400; in another, 32 701-714 / 5949-6068
                                     # against 16 everywhere 706-710 / 5649-5670 (round 29)
    mv_mma_wg: int = 256             # its threads per group (H200 1B q4_0, 16 rows a step: 4950
                                     # tok/s; 512: 4760, and OUT_OF_RESOURCES on OpenCL's queue)
    mv_mma_split: int = 4            # its warps on one 8-row column's K
    mv_mma_chunk: int = 2048         # its K values of x a group holds at once at most (local memory)
    mv_mma_lx: bool = False          # its lanes quantize their values of x themselves, as stage_x
                                     # does (the RMS sums first, a warp a token): no stage_x launch
                                     # before it. Tested on PoCL, directly and emulated; not yet
                                     # measured on a card
    mv_sx_from: int = 4              # a step graph's generated rows (and quantized head) from this
                                     # many rows a step on (0: never) run the one-token matvec's twin:
                                     # quantized weights matvec.cl MV_SX (x's blocks staged once a row
                                     # by matvec_stage, mv_sx_toks rows a group, each weight batch
                                     # read once for them), float weights mv_toks_float rows a group;
                                     # fewer rows keep the one-token matvec (the same bits). H200 1B
                                     # q4_0, aggregate tok/s at 1 / 4 / 8 / 16 rows, one run: without
                                     # 1106 / 2519 / 3357 / 3794; T 4, 8 rows a warp 1113 / 2566 /
                                     # 4066 / 6026 (round 26)
    mv_sx_toks: int = 4              # its rows a group: T 8 / 16 (4 rows a warp) 5287 / ~4100 at 16
                                     # rows, T 2 5690 (round 26): fewer rows, more groups in flight
    mv_sx_wg: int = 128              # its threads a group and weight rows a warp (x's blocks, read
    mv_sx_rpw: int = 8               # once a token, serve a warp's rows; 4: 5692 at 16 rows; 4 or
                                     # 2 for N <= 3072 only: 4 / 8 rows +2-13 %, 16 rows -3-8 %,
                                     # through the engine no gain, round 27)
    mv_sx_loads: int = 16            # its 16-byte weight loads in flight a lane (T 8: 4 even; 8: the
                                     # same, round 27)
    mv_tokens_inner: bool = True     # a matvec over several token rows (a step's generated rows, a
                                     # verify step) walks its groups token-fastest (matvec.cl
                                     # MV_TOKS_INNER): the groups of one weight batch for every row
                                     # run together, so the batch comes from DRAM once and from L2
                                     # for the other rows, not once a row as each row's sweep of
                                     # the whole matrix evicted it
    qk_defer: bool = True            # decode: per-head q / k norms, RoPE and the key's store in the
                                     # attention kernel's prologue, not a tail of the qkv matvec
                                     # (QK_DEFER). H100 Qwen3-0.6B q4_0, interleaved: 1331 -> 1438
                                     # tok/s (round 25; whole heads a group instead of the split's
                                     # tickets: 256 / 512 / 1024 threads 0.99 / 1.03 / 1.00x)
    # -- prefill matmul (matmul*.cl) ----------------------------------------------------------
    tile_n_min_groups: int = 256     # 128-row weight tiles where they give this many groups
                                     # (about two per SM of an H100 / H200), else 64-row tiles or
                                     # split-K. 1B prefill 512, q4_0: 9.02 ms with 128 here, 8.48
                                     # with 256 (H100; H200 9.09 / 8.72); f16 even; f16 with 384:
                                     # 7.47 ms against 7.40 (wgmma, round 13)
    tile_split_k_f16: int = 2        # a staged matmul with fewer 128-row tiles than that splits K
    tile_split_k_quant: int = 1      # over up to this many groups per tile (matmul.cl MM_SPLIT),
                                     # 128-row tiles kept, instead of halving the tiles; 1: never.
                                     # H200 1B prefill: f16 8.06 -> 7.79 ms with 2 (4 and 512
                                     # groups: 8.65), q4_0 8.11 -> 8.40 with 2 (round 12)
    tile_pair_f16: bool = True       # f16 weights, cp.async body, more than one token tile and no
                                     # split: a group takes two token tiles (matmul.cl MM_TPAIR;
                                     # row_tile 128), one 128-token tile of 32 x 64 warp tiles (H200
                                     # 1B f16 prefill 512: gate_up 3172 -> 2996 us, 8.03 -> 7.87 ms
                                     # with mma.sync; wgmma 7.66 -> 7.39). The other bodies take
                                     # the two tiles one after the other
    async_pair_k: int = 32           # paired tiles' cp.async stage (K values) and ring depth: 256
    async_pair_stages: int = 2       # local rows of 80 bytes a stage (40 KB; K 16 x 3 stages, 36
                                     # KB: 7.94 -> 8.02 ms, round 13)
    wgmma_k: int = 32                # the wgmma body's stage (K values; the ring holds as many as
                                     # 40 KB allow). H200 1B f16 prefill 512: K 32 7.39 ms, K 16
                                     # (5 stages) 7.94 (round 13)
    # -- attention (attention*.cl) ------------------------------------------------------------
    att_wg: int = 128                # attention_split threads
    att_bq: int = 128                # attention_tiled query rows per group (H200 q4_0 prefill 512:
                                     # attention 4.0 ms with 32, 3.5 with 128); the tensor-core
                                     # body needs 128
    att_tile_bytes: int = 32 << 10   # attention_tiled: local memory for a tile of K and V rows
                                     # (f32): 32 keys of head_dim 128, fewer keys for wider heads
    att_keys_per_split: int = 64     # attention_split: splits = S / 64, at most att_max_splits
    att_max_splits: int = 32         # (32 keys a split: 169 -> 238 us per step, round 6)
    att_dec_wg: int = 128            # attention_decode: keys per split and pass (64: neutral,
                                     # round 12; 256 and 512 threads slower, rounds 8-9)
    att_dec_max_splits: int = 64     # and splits at most (attention_paged_rows too)
    att_paged_rpw: int = 4           # attention_paged_tiles: rows a warp (16-row groups)
    att_paged_local_bytes: int = 48 << 10   # and its local memory at most: wider heads leave
                                     # every row to attention_paged_rows (NVIDIA's 48 KB)
    att_paged_scratch_bytes: int = 64 << 20   # attention_paged_rows' partials of a step's rows
                                     # at most (splits halve until they fit; not measured)
    att_paged_gqa: bool = False      # attention_paged_rows: a group takes a KV head's query heads
    att_paged_hpg_bytes: int = 16 << 10   # (as many as their warps' states fit in this local
                                     # memory), each K and V row read once for them; the same bits.
                                     # Tested on PoCL; not yet measured on a card
    # -- the small kernels (not measured against other sizes) ---------------------------------
    norm_wg: int = 64                # rms_norm threads per row
    red_wg: int = 256                # softmax / argmax threads per row
    elt_wg: int = 64                 # elementwise, rope, kv_store, embedding threads per group
    sc_wg: int = 128                 # attention_scores: threads per KV head
    compact_wg: int = 64             # kv_compact: rows moved per pass of a group
    arg_values_per_thread: int = 16  # greedy argmax: groups per row = V / (red_wg * this),
    arg_max_groups: int = 64         # at most this many


@dataclass(frozen=True)
class DeviceKind:
    """What tuning_for reads of an OpenCL device: the properties the runtime's choice of kernel
    bodies (runtime/backends/opencl.py device_options) and the kernels' local arrays depend on."""
    nvidia_cc: tuple[int, int] = (0, 0)   # NVIDIA compute capability; (0, 0): another vendor
    local_mem_bytes: int = 48 << 10       # CL_DEVICE_LOCAL_MEM_SIZE
    max_work_group_size: int = 1024

    @property
    def tensor_cores(self) -> bool:
        """Whether the prefill matmul runs a tensor-core body here (mma.sync: sm_80 on)."""
        return self.nvidia_cc >= (8, 0)


# the kinds the codegen's tests and checks model; an H100 / H200 is the measured one
DEVICE_KINDS = {
    "nvidia-sm90": DeviceKind((9, 0)),              # Hopper: wgmma, cp.async, mma.sync bodies
    "nvidia-sm80": DeviceKind((8, 0)),              # Ampere / Ada: cp.async and mma.sync bodies
    "nvidia-sm75": DeviceKind((7, 5)),              # older NVIDIA: warp shuffles, fp32 bodies
    "pocl-cpu": DeviceKind((0, 0), 1 << 20, 4096),  # Debian's PoCL: the portable bodies
}

_MV_RESERVED_LOCAL = 8 << 10   # the matvec's other local arrays (sums, outputs) stay under this


def tuning_for(device: DeviceKind) -> OpenCLTuning:
    """The tuning for a device kind: the H100 / H200 values, with what follows from the device's
    properties. Without tensor cores no body computes two token tiles at once (they take a pair
    one tile after the other: half the groups, the same work), so tiles stay unpaired; the
    longest quantized decode row and the paged tiles kernel's heads follow local memory;
    512-thread matvec groups need a device that takes them."""
    tuning = OpenCLTuning()
    mv_max_k = (device.local_mem_bytes - _MV_RESERVED_LOCAL) * 4 // 5 // 32 * 32
    return replace(tuning, tile_pair_f16=tuning.tile_pair_f16 and device.tensor_cores,
                   mv_max_k=mv_max_k, mv_wg_quant=min(tuning.mv_wg_quant, device.max_work_group_size),
                   att_paged_local_bytes=min(tuning.att_paged_local_bytes, device.local_mem_bytes))


def tuning_from_env(tuning: OpenCLTuning) -> OpenCLTuning:
    """`tuning` with the fields LLMRS_OPENCL_TUNING names ("field=value,field=value"): a
    measurement's variant of the plan compiled as a user compiles it (BENCHMARKS.md says which
    figures used one). An unknown field or a value of the wrong kind is a one-line error."""
    import os
    from dataclasses import fields
    spec = os.environ.get("LLMRS_OPENCL_TUNING", "").strip()
    if not spec:
        return tuning
    kinds = {f.name: f.type for f in fields(OpenCLTuning)}
    changes: dict[str, int | bool] = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in kinds:
            raise ValueError(f"LLMRS_OPENCL_TUNING: no field {name!r}; fields: {', '.join(kinds)}")
        try:
            changes[name] = value.strip().lower() in ("1", "true") if kinds[name] in (bool, "bool") \
                else int(value)
        except ValueError:
            raise ValueError(f"LLMRS_OPENCL_TUNING: {name}={value!r} is not a whole number") from None
    return replace(tuning, **changes)
