// Prefill matmul (matmul_tiled) and its activation staging (stage_x): what its bodies share.
// Weight blocks, slot_row() and epilogue() come from matmul_common.cl. One grid and one epilogue,
// four bodies, each in a file of its own after this one (codegen: _PRELUDE, then _BODIES):
//   matmul_fp32.cl     the portable fp32 body: every device, every weight type
//   matmul_mma.cl      tensor cores, register-staged mma.sync (NVIDIA sm_80+, -DUSE_NV_MMA):
//                      q4_0 / q4_1 / q8_0, and f16 on 64-row tiles
//   matmul_async.cl    tensor cores, f16 on 128-row tiles (-DMMA_ASYNC): cp.async stages and
//                      ldmatrix fragments
//   matmul_wgmma.cl    the same stages multiplied by Hopper's wgmma (-DUSE_NV_WGMMA)
// The tensor-core bodies run anywhere with -DEMU_MMA (common.cl): mma.sync, ldmatrix and wgmma
// emulated in C, for tests.

// A group of 256 threads computes a TM-token x TN-row tile of the output.
//   -DTN=<64|128>   weight rows per group (128: fewer x reloads; 64: more groups for narrow N)
// Grid: (groups * 256, ceil(rows / TM)).
#define TM 64
#ifndef TN
#define TN 128
#endif
// -DMM_TPAIR: a group takes two token tiles (TM_G = 128 tokens; codegen's row_tile). The
// cp.async body computes both at once (warp tiles of 32 tokens x 64 rows: each weight stage
// feeds twice the MMAs, and the weights are read half as often); the other bodies take the two
// tiles one after the other, so a plan runs on any device.
#ifdef MM_TPAIR
#define TM_G (2 * TM)
#else
#define TM_G TM
#endif

// b (BIAS), qn, kn and qk_eps (QK_NORM), then positions, slots and n_slots (STEP_ROWS):
// matmul_tiled's last arguments, passed on to tile_epilogue by every body as TILE_EPI_EXTRA
#ifdef BIAS
#define MM_BIAS_ARGS , gin biasb, ulong bias_off
#define MM_BIAS biasb + bias_off
#else
#define MM_BIAS_ARGS
#define MM_BIAS 0
#endif
#ifdef QK_NORM
#define MM_QK_ARGS , gin qnormb, ulong qnorm_off, gin knormb, ulong knorm_off, float qk_eps
#define MM_QK_LOCALS __local float qk_part[TM * QK_HPG * QK_PARTS];   /* pre_epilogue's sums of squares */
#define MM_QK qnormb + qnorm_off, knormb + knorm_off, qk_eps, qk_part
#else
#define MM_QK_ARGS
#define MM_QK_LOCALS
#define MM_QK 0, 0, 0.0f, 0
#endif
#define TILE_EPI_EXTRA , MM_BIAS, MM_QK, EPI_ROWS_OF(step)

// The finished tile out [TM][TN] (token, slot) through the fused epilogue, rows t0.. of the step.
inline void tile_epilogue(__local float* out, int t0, int rows, int g, int lid, gout e0, gout e1,
                          gout e2, gout y, int N, int n_heads, int n_kv_heads, int hd,
                          __global const int* step, gin bias, gin qn, gin kn, float qk_eps,
                          __local float* qk_part, EPI_ROWS_PARAMS) {
#ifdef PRE_EPILOGUE
    pre_epilogue(out, TM, TN, g, TN, lid, 256, N, n_heads, n_kv_heads, hd, bias, qn, kn, qk_eps, qk_part);
#endif
#if defined(EPI_ROPE_KV) && defined(KV_BLOCKS)
    for (int e = lid; e < TM * (TN / 32); e += 256) {
        int tt = e / (TN / 32), c = e % (TN / 32);
        if (t0 + tt < rows)
            epilogue_chunk(t0 + tt, g, c, TN, out + tt * TN, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd,
                           EPI_ROWS_PASS);
    }
#else
    for (int e = lid; e < TM * TN; e += 256) {
        int tt = e / TN, r = e % TN;
        if (t0 + tt < rows)
            epilogue(t0 + tt, g, r, TN, out + tt * TN, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd,
                     EPI_ROWS_PASS);
    }
#endif
}

// A tensor-core body (NVIDIA sm_80+, -DUSE_NV_MMA with -DUSE_NV_PTX; or emulated, -DEMU_MMA, on
// any device) wherever x is staged (codegen: quantized and f16 weights, K a multiple of 32)
#if defined(USE_NV_MMA) && (defined(USE_NV_PTX) || defined(EMU_MMA)) && defined(X_STAGED)
#define MMA_BODY 1
#endif

// -DX_STAGED: stage_x, a launch of its own, prepares the activations once per matmul (RMS
// prologue included) in the staging buffer, and matmul_tiled reads them there (its last
// argument): every one of the N / TN groups that share a token tile once repeated the loads of
// f32 x (twice with the prologue), the prologue and the quantization. Staging layout for M rows
// (codegen's staging_bytes):
//   quantized weights: codes int8 [M][K], then d f32 [M][K / 32] (Q8_0 scale, f16-rounded),
//                      then for q4_1 s f32 [M][K / 32] (Q8_1's s = f16(d * sum of the codes))
//   f16 weights:       x as f16 [M][K], what the tensor-core body multiplies; only that body
//                      reads it (the fp32 body keeps x in f32: stage_x is empty there)
#define STAGE_WG 256
#if defined(X_STAGED) && defined(W_QUANT)
#define X_STAGED_Q 1
#elif defined(W_F16) && defined(MMA_BODY)
#define X_STAGED_H 1
#ifdef MMA_ASYNC
#define MMA_ASYNC_BODY 1                     // the cp.async / ldmatrix body (matmul_async.cl)
#endif
#endif
#define STAGED_D(sb, M, K) ((__global const float*)((sb) + (size_t)(M) * (K)))
#define STAGED_S(sb, M, K) (STAGED_D(sb, M, K) + (size_t)(M) * ((K) / 32))

#ifdef X_STAGED
// A group per token. Thread i takes float4 i, i + STAGE_WG, .. of the row, so every load and
// store of a warp is one contiguous run; a Q8_0 block is 8 neighbouring threads, which meet in
// local memory for its amax (and q4_1's code sum).
__kernel __attribute__((reqd_work_group_size(STAGE_WG, 1, 1)))
void stage_x(__global const int* step, gin xb, ulong x_off, gin nwb, ulong nw_off, gout sb, ulong s_off,
             int M, int K, float eps) {
#if defined(X_STAGED_Q) || defined(X_STAGED_H)
#ifdef STAGE_REST   // for the generated rows' matvec (matvec.cl MV_MMA): rows from the split on
    int lid = get_local_id(0), t = MV_ROW0(step) + get_group_id(1), n4 = K / 4;
    if (t >= min(M, STEP_N_TOKENS(step))) return;   // the whole group: no barrier below is skipped by half
#else
    int lid = get_local_id(0), t = get_group_id(1), n4 = K / 4;
    if (t >= min(M, MM_ROWS(step))) return;   // the whole group: no barrier below is skipped by half
#endif
    __global const float4* x = (__global const float4*)(xb + x_off) + (size_t)t * n4;
    gout s = sb + s_off;
    __local float red[STAGE_WG];
#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
    float ss = 0.0f;
    for (int f = lid; f < n4; f += STAGE_WG) {
        float4 v = x[f];
        ss += dot(v, v);
    }
    ss = group_sum(ss, red);
    float rms = sqrt(ss / (float)K + eps);
#endif
    for (int f0 = 0; f0 < n4; f0 += STAGE_WG) {   // uniform trip count: barriers inside
        int f = f0 + lid;
        bool live = f < n4;
        float4 v = live ? x[f] : (float4)0.0f;
#ifdef PROLOGUE_RMS
        // x / rms * w as the interpreter (and norm.cl, the CPU prologue) rounds it: x * (1 / rms)
        // rounds twice, and a value one ulp off can take the other Q8_0 code
        if (live) v = v / rms * LD4_NORM(nw, f);
#endif
#ifdef X_STAGED_H
        if (live) {
            ushort4 h;
            vstore_half4_rte(v, 0, (__private half*)&h);
            ((__global uint2*)s)[(size_t)t * n4 + f] = as_uint2(h);   // one 8-byte store
        }
#else
        float4 a = fabs(v);
        barrier(CLK_LOCAL_MEM_FENCE);
        red[lid] = fmax(fmax(a.x, a.y), fmax(a.z, a.w));
        barrier(CLK_LOCAL_MEM_FENCE);
        int o = lid & ~7;
        float amax = fmax(fmax(fmax(red[o], red[o + 1]), fmax(red[o + 2], red[o + 3])),
                          fmax(fmax(red[o + 4], red[o + 5]), fmax(red[o + 6], red[o + 7])));
        float d = amax / 127.0f;                 // as quantize_q8_block
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        float4 q = round(v * id);
        if (live) ((__global uint*)s)[(size_t)t * n4 + f] = as_uint(convert_char4(q));
#ifdef W_Q4_1
        barrier(CLK_LOCAL_MEM_FENCE);
        red[lid] = (q.x + q.y) + (q.z + q.w);    // integers: exact in any order
        barrier(CLK_LOCAL_MEM_FENCE);
        float sum = ((red[o] + red[o + 1]) + (red[o + 2] + red[o + 3])) +
                    ((red[o + 4] + red[o + 5]) + (red[o + 6] + red[o + 7]));
#endif
        if (live && (lid & 7) == 0) {
            size_t blk = (size_t)t * (K / 32) + f / 8;
            ((__global float*)STAGED_D(s, M, K))[blk] = round_to_half(d);
#ifdef W_Q4_1
            ((__global float*)STAGED_S(s, M, K))[blk] = round_to_half(d * sum);
#endif
        }
#endif  // X_STAGED_H
    }
#endif  // X_STAGED_Q || X_STAGED_H
}
#endif  // X_STAGED

#ifdef K_TAIL
#define K_BLOCKS ((K + 31) / 32)
#define K_LIVE(b, k) ((b) * 32 + (k) < K)
#define W_ELEM(w, row, b, k) wval(w, (size_t)(row) * K + (b) * 32 + (k))   // float weights only
#else
#define K_BLOCKS (K / 32)
#define K_LIVE(b, k) 1
#define W_ELEM(w, row, b, k) welem(w, (size_t)(row) * nb + (b), k, nblk)
#endif

// Split-K (-DMM_SPLIT=S, codegen's tile_shape: where a matmul has too few tiles to fill the
// GPU): the S groups of a tile (adjacent group ids) each sum K / S of its dot products. Each
// writes its [TM][TN] partial to the staging buffer, after stage_x's output (its own slot, so
// no group waits for another), and takes a ticket from the tile's counter (a scratch slice that
// the last group puts back to 0); the last to arrive adds the S partials in split order, the
// same bits whichever group is last, and runs the epilogue. K / S is a multiple of every body's
// stage (codegen), so no stage straddles two splits.
#ifndef MM_SPLIT
#define MM_SPLIT 1
#endif
#if MM_SPLIT > 1
#define MM_SPLIT_ARGS , gout pbb, ulong pb_off, gout cbb, ulong cb_off
#define MM_SPLIT_LOCALS __local int mm_last;
#ifdef W_F16
#define MM_STAGED_BYTES(M, K) (2 * (size_t)(M) * (K))
#elif defined(W_Q4_1)
#define MM_STAGED_BYTES(M, K) ((size_t)(M) * (K) + 8 * (size_t)(M) * ((K) / 32))
#else
#define MM_STAGED_BYTES(M, K) ((size_t)(M) * (K) + 4 * (size_t)(M) * ((K) / 32))
#endif
#define MM_PARTS_AT(M, K) ((MM_STAGED_BYTES(M, K) + 255) / 256 * 256)   // codegen's split_parts_at

// 1 for the group that finishes the tile, out [TM][TN] then holding the whole sums; 0 for the
// others, which go on to their next token tile (uniformly: `last` is the group's)
inline int split_merge(__local float* out, gout parts_b, __global volatile int* count, int split,
                       int lid, __local int* last) {
    __global float4* mine = (__global float4*)parts_b + (size_t)split * (TM * TN / 4);
    __local float4* o4 = (__local float4*)out;
    for (int e = lid; e < TM * TN / 4; e += 256) mine[e] = o4[e];
    DEVICE_FENCE();   // the partial reaches memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) *last = atomic_inc(count) == MM_SPLIT - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*last) return 0;
    DEVICE_FENCE();
    __global volatile float* all = (__global volatile float*)parts_b;   // past L1: other SMs wrote it
    for (int e = lid; e < TM * TN / 4; e += 256) {
        float4 total = (float4)(0.0f);
        for (int sp = 0; sp < MM_SPLIT; sp++) {
            if (sp == split) {
                total += o4[e];
            } else {
                __global volatile float* p = all + ((size_t)sp * (TM * TN / 4) + e) * 4;
                total += (float4)(p[0], p[1], p[2], p[3]);
            }
        }
        o4[e] = total;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) *count = 0;
    return 1;
}
// the partials and counter of token tile tile_t's tile: tiles numbered token tile-major (64-token
// tiles, paired or not). Every caller sits in a loop over its token tiles: a group that does not
// finish this tile continues with the next
#define MM_SPLIT_MERGE(out, tile_t)                                                            \
    {                                                                                          \
        size_t tile = (size_t)(tile_t) * (get_num_groups(0) / MM_SPLIT) + g;                   \
        if (!split_merge(out, pbb + pb_off + MM_PARTS_AT(M, K) + tile * MM_SPLIT * (TM * TN * 4), \
                         (__global volatile int*)(cbb + cb_off) + tile, split, lid, &mm_last)) \
            continue;                                                                          \
    }
#else
#define MM_SPLIT_ARGS
#define MM_SPLIT_LOCALS
#define MM_SPLIT_MERGE(out, tile_t)
#endif

// Every body takes the arguments codegen binds by position: one signature and prologue.
#define MATMUL_TILED_BEGIN \
__kernel __attribute__((reqd_work_group_size(256, 1, 1))) \
void matmul_tiled(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off, \
                  gin nwb, ulong nw_off, gout e0b, ulong e0_off, gout e1b, ulong e1_off, \
                  gout e2b, ulong e2_off, gout yb, ulong y_off, \
                  int M, int K, int N, float eps, int n_heads, int n_kv_heads, int hd, \
                  gin sbb, ulong sb_off MM_SPLIT_ARGS MM_BIAS_ARGS MM_QK_ARGS KERNEL_ROWS_ARGS) { \
    int lid = get_local_id(0), t0g = get_group_id(1) * TM_G;   /* the group's first token */ \
    int g = get_group_id(0) / MM_SPLIT, split = get_group_id(0) % MM_SPLIT; \
    int kb = split * (K / MM_SPLIT), ke = MM_SPLIT > 1 ? kb + K / MM_SPLIT : K;   /* this group's K */ \
    MM_SPLIT_LOCALS \
    MM_QK_LOCALS \
    int rows = min(M, MM_ROWS(step)); \
    __global const float* x = (__global const float*)(xb + x_off); \
    gin sb = sbb + sb_off;   /* stage_x's output (X_STAGED) */ \
    gin w = wb + w_off;

// bodies that compute one token tile at a time: each of the group's TM_G / TM tiles, t0 its
// first token (out, the epilogue's tile, lies over the local memory the next tile reuses)
#define TILE_LOOP_BEGIN for (int tile_i = 0; tile_i < TM_G / TM; tile_i++) { int t0 = t0g + TM * tile_i;
#define TILE_LOOP_END barrier(CLK_LOCAL_MEM_FENCE); }


#if defined(W_QUANT) && !defined(X_STAGED)
#error "quantized weights: matmul_tiled reads x as stage_x wrote it (-DX_STAGED)"
#endif

// -- what the tensor-core bodies share ---------------------------------------------------------
#ifdef MMA_BODY
// mma.sync warp tiles (matmul_mma.cl, matmul_async.cl): warp w computes tokens 32 (w /
// MMA_WARPS_N) .. + 31 of the body's tokens (TM; the cp.async body's MM_TPAIR: TM_G) and MMA_WN
// slots from MMA_WN (w % MMA_WARPS_N)
#ifdef MMA_ASYNC_BODY
#define MMA_TOKENS TM_G
#else
#define MMA_TOKENS TM
#endif
#define MMA_WARPS_N (8 / (MMA_TOKENS / 32))
#define MMA_WN (TN / MMA_WARPS_N)
#define MMA_NT (MMA_WN / 8)                  // 8-slot MMA columns per warp

// MMA_S8 / MMA_F16: common.cl

// Both tensor-core bodies end alike: the warps' accumulators into out [TM][TN] over the stages'
// local memory (C fragment: rows gq, gq + 8, columns 2 tq, 2 tq + 1), then the tile's epilogue;
// a token tile at a time where the body's tokens are two tiles (MM_TPAIR, cp.async body)
#define MMA_TILE_END                                                                           \
    __local float* out = (__local float*)lds;                                                  \
    for (int mt = 0; mt < MMA_TOKENS / TM; mt++) {                                             \
        if (wm / TM == mt) {                                                                   \
            _Pragma("unroll") for (int mi = 0; mi < 2; mi++)                                   \
            _Pragma("unroll") for (int ni = 0; ni < MMA_NT; ni++)                              \
            _Pragma("unroll") for (int i = 0; i < 4; i++)                                      \
                out[(wm % TM + 16 * mi + gq + 8 * (i >> 1)) * TN + wn + 8 * ni + 2 * tq + (i & 1)] = acc[mi][ni][i]; \
        }                                                                                      \
        barrier(CLK_LOCAL_MEM_FENCE);                                                          \
        MM_SPLIT_MERGE(out, t0 / TM + mt)                                                      \
        tile_epilogue(out, t0 + TM * mt, rows, g, lid, e0b + e0_off, e1b + e1_off, e2b + e2_off, \
                      yb + y_off, N, n_heads, n_kv_heads, hd, step TILE_EPI_EXTRA);            \
        barrier(CLK_LOCAL_MEM_FENCE);                                                          \
    }
#endif  // MMA_BODY

#ifdef MMA_ASYNC_BODY
// cp.async copies of a stage's rows (matmul_async.cl, matmul_wgmma.cl): from global to local
// memory without passing through registers, rows past the tokens or the weights zero-filled.
// -DEMU_MMA: plain copies.
#ifdef EMU_MMA
inline void cp_async16(__local uint* dst, __global const uint4* src, int live) {
    *(__local uint4*)dst = live ? *src : (uint4)0;
}
#define CP_ASYNC_COMMIT()
#define CP_ASYNC_WAIT_ALL()
#else
#define SHARED_ADDR(p) ((uint)(size_t)(p))
inline void cp_async16(__local uint* dst, __global const uint4* src, int live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(SHARED_ADDR(dst)), "l"(src), "r"(live ? 16 : 0) : "memory");
}
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_ASYNC_WAIT_ALL() asm volatile("cp.async.wait_group 0;" ::: "memory")
#endif

// 16-byte unit u of K values k.. of a stage's row r: x row t0 + r (r < TM_G), else the weight row
// of slot r - TM_G; *live is 0 for tokens past the step and slots past N (copied as zeros)
inline __global const uint4* stage_src(gin sb, gin w, int t0, int rows, int K, int k, int r, int u,
                                       __local const int* rowmap, int* live) {
    if (r < TM_G) {
        *live = t0 + r < rows;
        return (__global const uint4*)(sb + 2 * ((size_t)(*live ? t0 + r : 0) * K + k)) + u;
    }
    int row = rowmap[r - TM_G];
    *live = row >= 0;
    return (__global const uint4*)(w + 2 * ((size_t)max(row, 0) * K + k)) + u;
}
#endif  // MMA_ASYNC_BODY
