// Prefill matmul; weight blocks, slot_row() and epilogue() come from matmul_common.cl.
// Bodies with one grid and one epilogue: the tensor-core bodies (USE_NV_MMA, below) for
// q4_0 / q4_1 / q8_0 / f16 weights on NVIDIA (mma.sync with register-staged stages; f16 with
// -DMMA_ASYNC: cp.async stages and ldmatrix, or on Hopper, -DUSE_NV_WGMMA, wgmma), the portable
// fp32 body for everything else.

// Prefill: a TM-token x TN-row tile per group, K walked one 32-value block at a time through
// local memory (each block of a token is one Q8_0 block; Q8_1, with its s, for q4_1 weights; with
// -DK_TAIL, float weights whose K is no multiple of 32, the last block is cut at K and read value
// by value). 256 threads; thread (ty, tx) owns tokens 4ty..4ty+3 and rows 64h + 4tx..64h + 4tx + 3
// for h < TN / 64: 16 or 32 outputs, and per k it reads 1 + TN / 64 float4 from local memory. The
// tiles sit k-major in local memory (xs [32][TM], ws [32][TN]) so those reads are float4 across
// tokens / rows.
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
#define TN_H (TN / 64)        // 64-row halves of the tile
#define XR_STRIDE 33          // raw x rows [TM][33]: pad so a token's 32 values hit distinct banks
#define XS_STRIDE (TM + 4)    // k-major x [32][TM + 4]
#define WS_STRIDE (TN + 4)    // k-major w [32][TN + 4]
#define LDS_FLOATS (TM * XR_STRIDE + 32 * XS_STRIDE + 32 * WS_STRIDE)

// The finished tile out [TM][TN] (token, slot) through the fused epilogue, rows t0.. of the step.
inline void tile_epilogue(__local const float* out, int t0, int rows, int g, int lid, gout e0, gout e1,
                          gout e2, gout y, int N, int n_heads, int n_kv_heads, int hd,
                          __global const int* step) {
#if defined(EPI_ROPE_KV) && defined(KV_Q8_0)
    for (int e = lid; e < TM * (TN / 32); e += 256) {
        int tt = e / (TN / 32), c = e % (TN / 32);
        if (t0 + tt < rows)
            epilogue_chunk(t0 + tt, g, c, TN, out + tt * TN, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd,
                           STEP_N_PAST(step), STEP_START_POS(step));
    }
#else
    for (int e = lid; e < TM * TN; e += 256) {
        int tt = e / TN, r = e % TN;
        if (t0 + tt < rows)
            epilogue(t0 + tt, g, r, TN, out + tt * TN, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd,
                     STEP_N_PAST(step), STEP_START_POS(step));
    }
#endif
}

// (emulated, -DEMU_MMA: only with X_STAGED, whose tensor-core path needs no warp shuffles)
#if defined(USE_NV_MMA) && (defined(USE_NV_PTX) || (defined(EMU_MMA) && defined(X_STAGED))) \
    && (defined(W_QUANT) || defined(W_F16)) && !defined(K_TAIL)
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
#elif defined(X_STAGED) && defined(W_F16) && defined(MMA_BODY)
#define X_STAGED_H 1
#if defined(MMA_ASYNC) && (defined(USE_NV_PTX) || defined(EMU_MMA))
#define MMA_ASYNC_BODY 1                     // the cp.async / ldmatrix body (below)
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
    int lid = get_local_id(0), t = get_group_id(1), n4 = K / 4;
    if (t >= min(M, STEP_N_TOKENS(step))) return;   // the whole group: no barrier below is skipped by half
    __global const float4* x = (__global const float4*)(xb + x_off) + (size_t)t * n4;
    gout s = sb + s_off;
    __local float red[STAGE_WG];
    float scale = 1.0f;
#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
    float ss = 0.0f;
    for (int f = lid; f < n4; f += STAGE_WG) {
        float4 v = x[f];
        ss += dot(v, v);
    }
    ss = group_sum(ss, red);
    scale = 1.0f / sqrt(ss / (float)K + eps);
#endif
    for (int f0 = 0; f0 < n4; f0 += STAGE_WG) {   // uniform trip count: barriers inside
        int f = f0 + lid;
        bool live = f < n4;
        float4 v = live ? x[f] : (float4)0.0f;
#ifdef PROLOGUE_RMS
        if (live) v = v * scale * LD4_NORM(nw, f);
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
    mem_fence(CLK_GLOBAL_MEM_FENCE);   // the partial reaches memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) *last = atomic_inc(count) == MM_SPLIT - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*last) return 0;
    mem_fence(CLK_GLOBAL_MEM_FENCE);
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

// Both bodies below (portable fp32 and tensor-core MMA) take the arguments codegen binds by
// position, so they share one signature and prologue.
#define MATMUL_TILED_BEGIN \
__kernel __attribute__((reqd_work_group_size(256, 1, 1))) \
void matmul_tiled(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off, \
                  gin nwb, ulong nw_off, gout e0b, ulong e0_off, gout e1b, ulong e1_off, \
                  gout e2b, ulong e2_off, gout yb, ulong y_off, \
                  int M, int K, int N, float eps, int n_heads, int n_kv_heads, int hd, \
                  gin sbb, ulong sb_off MM_SPLIT_ARGS) { \
    int lid = get_local_id(0), t0g = get_group_id(1) * TM_G;   /* the group's first token */ \
    int g = get_group_id(0) / MM_SPLIT, split = get_group_id(0) % MM_SPLIT; \
    int kb = split * (K / MM_SPLIT), ke = MM_SPLIT > 1 ? kb + K / MM_SPLIT : K;   /* this group's K */ \
    MM_SPLIT_LOCALS \
    int rows = min(M, STEP_N_TOKENS(step)); \
    __global const float* x = (__global const float*)(xb + x_off); \
    gin sb = sbb + sb_off;   /* stage_x's output (X_STAGED) */ \
    gin w = wb + w_off;

// bodies that compute one token tile at a time: each of the group's TM_G / TM tiles, t0 its
// first token (out, the epilogue's tile, lies over the local memory the next tile reuses)
#define TILE_LOOP_BEGIN for (int tile_i = 0; tile_i < TM_G / TM; tile_i++) { int t0 = t0g + TM * tile_i;
#define TILE_LOOP_END barrier(CLK_LOCAL_MEM_FENCE); }


#ifndef MMA_BODY

MATMUL_TILED_BEGIN
    size_t nb = K / 32, nblk = (size_t)N * nb;
    __local float lds[LDS_FLOATS] __attribute__((aligned(16)));   // xr, xs, ws; at the end out [TM][TN] (float4: split_merge)
    __local float* xr = lds;                                   // [TM][XR_STRIDE]
    __local float* xs = lds + TM * XR_STRIDE;                  // [32][XS_STRIDE]
    __local float* ws = xs + 32 * XS_STRIDE;                   // [32][WS_STRIDE]
    __local float xd[TM], xid[TM], wd[TN], rms[TM];
#ifdef W_Q4_1
    __local float xsum[TM], wm[TN];   // Q8_1's s of each token's block; each row's block minimum
#endif
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);
#if defined(PROLOGUE_RMS) && !defined(X_STAGED_Q)
    gin nw = nwb + nw_off;
#endif

    TILE_LOOP_BEGIN
#if defined(PROLOGUE_RMS) && !defined(X_STAGED_Q)   // staged codes carry it
    {   // 4 threads per token sum squares over strided k
        int tl = lid % TM, part = lid / TM;
        float ss = 0.0f;
        if (t0 + tl < rows)
            for (int k = part; k < K; k += 4) {
                float v = x[(size_t)(t0 + tl) * K + k];
                ss += v * v;
            }
        xr[part * TM + tl] = ss;
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < TM)
            rms[lid] = sqrt((((xr[lid] + xr[TM + lid]) + xr[2 * TM + lid]) + xr[3 * TM + lid]) / (float)K + eps);
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);

    int tx = lid % 16, ty = lid / 16;
    float acc[4][4 * TN_H];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4 * TN_H; i++) acc[j][i] = 0.0f;

    for (int b = kb / 32; b < (MM_SPLIT > 1 ? ke / 32 : K_BLOCKS); b++) {
#ifdef X_STAGED_Q
        for (int e = lid; e < TM * 32; e += 256) {   // codes, k-major: thread e -> token e % TM
            int tt = e % TM, k = e / TM;
            xs[k * XS_STRIDE + tt] = t0 + tt < rows ? (float)((__global const char*)sb)[(size_t)(t0 + tt) * K + b * 32 + k] : 0.0f;
        }
        for (int tt = lid; tt < TM; tt += 256) {
            size_t at = (size_t)(t0 + tt) * nb + b;
            xd[tt] = t0 + tt < rows ? STAGED_D(sb, M, K)[at] : 0.0f;
#ifdef W_Q4_1
            xsum[tt] = t0 + tt < rows ? STAGED_S(sb, M, K)[at] : 0.0f;
#endif
        }
#else
        for (int e = lid; e < TM * 32; e += 256) {   // x: coalesced along k
            int tt = e >> 5, k = e & 31;
            float v = 0.0f;
            if (t0 + tt < rows && K_LIVE(b, k)) {
                v = x[(size_t)(t0 + tt) * K + b * 32 + k];
#ifdef PROLOGUE_RMS
                v = v / rms[tt] * LD_NORM(nw, b * 32 + k);
#endif
            }
            xr[tt * XR_STRIDE + k] = v;
        }
#endif  // X_STAGED_Q
        for (int e = lid; e < TN * 32; e += 256) {   // w: along k, stored k-major
            int n = e >> 5, k = e & 31, row = rowmap[n];
            ws[k * WS_STRIDE + n] = row >= 0 && K_LIVE(b, k) ? W_ELEM(w, row, b, k) : 0.0f;
        }
#ifdef W_QUANT
        for (int n = lid; n < TN; n += 256) {
            int row = rowmap[n];
#ifdef W_Q4_1
            float2 dm = row >= 0 ? wheader(w, (size_t)row * nb + b, nblk) : (float2)0.0f;
            wd[n] = dm.x;
            wm[n] = dm.y;
#else
            wd[n] = row >= 0 ? wscale(w, (size_t)row * nb + b, nblk) : 0.0f;
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#ifndef X_STAGED_Q
        if (lid < TM) {
            float amax = 0.0f;
            for (int k = 0; k < 32; k++) amax = fmax(amax, fabs(xr[lid * XR_STRIDE + k]));
            float d = amax / 127.0f;
            xid[lid] = d != 0.0f ? 1.0f / d : 0.0f;
            xd[lid] = round_to_half(d);
#ifdef W_Q4_1
            float sum = 0.0f;   // of the codes the loop below makes: integers, exact
            for (int k = 0; k < 32; k++) sum += round(xr[lid * XR_STRIDE + k] * xid[lid]);
            xsum[lid] = round_to_half(d * sum);
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < TM * 32; e += 256) {   // k-major, quantized: thread e -> token e % TM
            int tt = e % TM, k = e / TM;
            xs[k * XS_STRIDE + tt] = round(xr[tt * XR_STRIDE + k] * xid[tt]);
        }
#endif  // !X_STAGED_Q
#else
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < TM * 32; e += 256) {
            int tt = e % TM, k = e / TM;
            xs[k * XS_STRIDE + tt] = xr[tt * XR_STRIDE + k];
        }
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        float p[4][4 * TN_H];
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4 * TN_H; i++) p[j][i] = 0.0f;
        for (int k = 0; k < 32; k++) {
            float4 xa = vload4(0, xs + k * XS_STRIDE + 4 * ty);
            float xk[4] = {xa.x, xa.y, xa.z, xa.w};
            float wk[4 * TN_H];
            for (int h = 0; h < TN_H; h++) {
                float4 wa = vload4(0, ws + k * WS_STRIDE + 64 * h + 4 * tx);
                wk[4 * h] = wa.x; wk[4 * h + 1] = wa.y; wk[4 * h + 2] = wa.z; wk[4 * h + 3] = wa.w;
            }
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4 * TN_H; i++) p[j][i] += xk[j] * wk[i];
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4 * TN_H; i++)
#ifdef W_Q4_1
                acc[j][i] += p[j][i] * (xd[4 * ty + j] * wd[64 * (i >> 2) + 4 * tx + (i & 3)])
                             + xsum[4 * ty + j] * wm[64 * (i >> 2) + 4 * tx + (i & 3)];
#elif defined(W_QUANT)
                acc[j][i] += p[j][i] * (xd[4 * ty + j] * wd[64 * (i >> 2) + 4 * tx + (i & 3)]);
#else
                acc[j][i] += p[j][i];
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    __local float* out = lds;   // [TM][TN]
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4 * TN_H; i++) out[(4 * ty + j) * TN + 64 * (i >> 2) + 4 * tx + (i & 3)] = acc[j][i];
    barrier(CLK_LOCAL_MEM_FENCE);
    MM_SPLIT_MERGE(out, t0 / TM)
    tile_epilogue(out, t0, rows, g, lid, e0b + e0_off, e1b + e1_off, e2b + e2_off, yb + y_off, N,
                  n_heads, n_kv_heads, hd, step);
    TILE_LOOP_END
}
#endif  // !MMA_BODY

#ifdef MMA_BODY
// Tensor-core prefill (NVIDIA, -DUSE_NV_MMA; same grid, slots and epilogue as above). A stage
// holds STAGE_K values of K for the tile's TM tokens and TN weight rows in local memory as 32-bit
// words, row-major with a padded stride (row r of a fragment load hits bank 4r + lane % 4):
//   xq [TM][MMA_ROW_W]  activations: Q8_0 codes (4 per word) | f16 (2 per word)
//   wq [TN][MMA_ROW_W]  weights:     q4_0/q4_1/q8_0 codes as int8  | f16 as stored
// A stage is 4 chunks of 8 words. Quantized: a chunk is one Q8_0 block (32 values) and one
// m16n8k32 s8 MMA per 16x8 sub-tile, whose exact int32 sum is scaled by d_x * d_w, as GGML;
// q4_1 (codes 0..15, Q8_1 activations) adds m_w * s_x per block.
// f16: a chunk is 16 values, one m16n8k16 MMA with f32 accumulation (x rounded to f16).
// Paired layout (staged x, unless -DMMA_UNPAIRED): each chunk's 8 words are stored in the
// order 0 4 1 5 2 6 3 7, so the two registers a lane takes from a row (words tq and tq + 4) are
// one 8-byte local load, and the row stride is 40 words (a half-warp's 8-byte loads of rows
// gq = 0..3 cover the 32 banks once); block scales sit chunk-major ([4][TN], [4][TM]) so a
// lane's two slot scales (2 tq, 2 tq + 1) are one 8-byte load too. Unpaired: stride 36 (row r
// of a fragment load hits bank 4r + lane % 4), 4-byte loads, scales [TN][4].
#if (defined(X_STAGED_Q) || defined(X_STAGED_H)) && !defined(MMA_UNPAIRED)
#define MMA_PAIRED 1
#define MMA_ROW_W 40
#define SC_W(n, c) ((c) * TN + (n))
#define SC_X(t, c) ((c) * TM + (t))
#else
#define MMA_ROW_W 36
#define SC_W(n, c) ((n) * 4 + (c))
#define SC_X(t, c) ((t) * 4 + (c))
#endif
// Warp w computes tokens 32 (w / MMA_WARPS_N) .. + 31 of the body's tokens (TM; the cp.async
// body's MM_TPAIR: TM_G) and MMA_WN slots from MMA_WN (w % MMA_WARPS_N)
#ifdef MMA_ASYNC_BODY
#define MMA_TOKENS TM_G
#else
#define MMA_TOKENS TM
#endif
#define MMA_WARPS_N (8 / (MMA_TOKENS / 32))
#define MMA_WN (TN / MMA_WARPS_N)
#define MMA_NT (MMA_WN / 8)                  // 8-slot MMA columns per warp
#ifdef W_QUANT
#define STAGE_K 128
#else
#define STAGE_K 64
#endif
#define MMA_LDS_WORDS ((TM + TN) * MMA_ROW_W > TM * TN ? (TM + TN) * MMA_ROW_W : TM * TN)
#ifdef W_Q4_1
#define MMA_HDR 2     // block values per token / row and block: the scale, then s_x / m_w
#else
#define MMA_HDR 1
#endif

#ifdef EMU_MMA
#define EMU_SC_ARG emu_sc                    // the emulation's scratch, for put_w's shuffles
#define MMA_S8(d, a, b0, b1) emu_mma_s8(d, a, b0, b1, emu_sc)
#define MMA_F16(c, a, b0, b1) emu_mma_f16(c, a, b0, b1, emu_sc)
#else
#define EMU_SC_ARG 0
// d[0..3] = A (16x32 s8, row) * B (32x8 s8, col), fragments as the PTX ISA lays them out
#define MMA_S8(d, a, b0, b1)                                                                   \
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
        "{%10,%10,%10,%10};"                                                                   \
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0))
// c[0..3] += A (16x16 f16, row) * B (16x8 f16, col)
#define MMA_F16(c, a, b0, b1)                                                                  \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "      \
        "{%8,%9}, {%0,%1,%2,%3};"                                                              \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#endif

// a chunk's 8 words (lo = words 0..3, hi = 4..7) into local memory, in the layout's order.
// A 16-byte store is served 8 lanes at a time; the callers' 8 lanes are 2 rows x 4 chunks, and
// rows 40 words apart (paired layout) put both rows' first halves on the same 16 banks. Odd
// rows (-DMMA_PLAIN_STORES aside) store their second half first (rot), so each store's 8 lanes
// cover the 32 banks once: one wavefront, not two.
inline void put_chunk(__local uint* dst, uint4 lo, uint4 hi, int rot) {
#ifdef MMA_PAIRED
    uint4 a = (uint4)(lo.x, hi.x, lo.y, hi.y), b = (uint4)(lo.z, hi.z, lo.w, hi.w);
#else
    uint4 a = lo, b = hi;
#endif
#if !defined(MMA_PAIRED) || defined(MMA_PLAIN_STORES)
    rot = 0;   // unpaired rows are 36 words apart: their halves already meet distinct banks
#endif
    *(__local uint4*)(dst + 4 * rot) = rot ? b : a;
    *(__local uint4*)(dst + 4 - 4 * rot) = rot ? a : b;
}

// v of lane (lane ^ o); emulated through put_w's scratch sc (every thread calls it)
#ifdef EMU_MMA
#define SHFL_XOR_U(v, o) emu_shfl_xor_u(v, o, sc)
#else
#define SHFL_XOR_U(v, o) shfl_xor_u(v, o)
#endif

// |s| < 2^22 (a block's sum is at most 32 * 127 * 128): the float through the mantissa, which
// issues at full rate where int-to-float conversion runs at a quarter
inline float small_int_to_float(int s) { return as_float(s + 0x4B400000) - 12582912.0f; }

// A stage is fetched into registers (fetch_x, fetch_w) and written to local memory (put_x,
// put_w). -DMMA_PREFETCH_X / -DMMA_PREFETCH_W fetch the activations / weights one stage ahead,
// during the previous stage's MMAs, so global latency hides behind tensor-core work (at the
// cost of the registers that hold them).
//
// Activations of tokens t0.. for K values k0..k0 + STAGE_K. Warp wp owns tokens 8 wp .. 8 wp + 7
// and reads each token's stage row as one contiguous run (lanes 4 floats apart), so every load
// instruction touches whole lines; inv_rms [TM] is 1 / rms (prologue).
//   quantized: lane l holds values 4l..4l+3, block l / 8; 8 lanes find the block's amax
//   f16:       lanes 0..15 and 16..31 hold two tokens, values 4 (l % 16)..
#ifdef W_QUANT
#define X_FETCH 8
#define X_LANE_K(lane) (4 * (lane))
#define X_TOKEN(wp, lane, i) (8 * (wp) + (i))
#else
#define X_FETCH 4
#define X_LANE_K(lane) (4 * ((lane) & 15))
#define X_TOKEN(wp, lane, i) (8 * (wp) + 2 * (i) + ((lane) >> 4))
#endif
#if defined(X_STAGED_Q) || defined(X_STAGED_H)
// Staged activations (stage_x): thread e owns 32 bytes of token e / 4's stage row, part e % 4
// (quantized: block e % 4, its codes and d, q4_1 also s; f16: values 16 (e % 4) ..), as
// fetch_w owns weight blocks: two 16-byte loads.
#define X_PART_VALUES (STAGE_K / 4)
typedef struct { uint4 q[2]; float d, s; } x_stage;

inline void fetch_x(gin sb, int t0, int rows, int M, int K, int k0, int lid, gin nw, x_stage* r) {
    int tt = lid >> 2, part = lid & 3, k = k0 + X_PART_VALUES * part;
    bool live = t0 + tt < rows && k < K;
    size_t row = (size_t)(live ? t0 + tt : 0);
#ifdef X_STAGED_Q
    __global const uint4* c = (__global const uint4*)(sb + row * K + k);
#else
    __global const uint4* c = (__global const uint4*)(sb + 2 * (row * K + k));
#endif
    r->q[0] = live ? c[0] : (uint4)0;
    r->q[1] = live ? c[1] : (uint4)0;
#ifdef X_STAGED_Q
    r->d = live ? STAGED_D(sb, M, K)[row * (K / 32) + k / 32] : 0.0f;
#ifdef W_Q4_1
    r->s = live ? STAGED_S(sb, M, K)[row * (K / 32) + k / 32] : 0.0f;
#endif
#endif
}

inline void put_x(const x_stage* r, int lid, __local uint* xq, __local float* xd, __local const float* inv_rms) {
    int tt = lid >> 2, part = lid & 3;
    put_chunk(xq + tt * MMA_ROW_W + part * 8, r->q[0], r->q[1], tt & 1);
#ifdef X_STAGED_Q
    xd[SC_X(tt, part)] = r->d;
#ifdef W_Q4_1
    xd[TM * 4 + SC_X(tt, part)] = r->s;
#endif
#endif
}
#define X_SRC sb
#else
#define X_SRC x
typedef struct { float4 v[X_FETCH]; float4 nv; } x_stage;

inline void fetch_x(__global const float* x, int t0, int rows, int M, int K, int k0, int lid, gin nw,
                    x_stage* r) {
    int lane = lid & 31, wp = lid >> 5, k = k0 + X_LANE_K(lane);
    bool k_live = k < K;
#ifdef PROLOGUE_RMS
    r->nv = k_live ? LD4_NORM(nw, k / 4) : (float4)0.0f;
#endif
#pragma unroll
    for (int i = 0; i < X_FETCH; i++) {
        int tt = X_TOKEN(wp, lane, i);
        r->v[i] = k_live && t0 + tt < rows ? vload4(0, x + (size_t)(t0 + tt) * K + k) : (float4)0.0f;
    }
}

inline void put_x(const x_stage* r, int lid, __local uint* xq, __local float* xd, __local const float* inv_rms) {
    int lane = lid & 31, wp = lid >> 5;
#pragma unroll
    for (int i = 0; i < X_FETCH; i++) {
        int tt = X_TOKEN(wp, lane, i);
        float4 v = r->v[i];
#ifdef PROLOGUE_RMS
        v = v * inv_rms[tt] * r->nv;
#endif
#ifdef W_QUANT
        float4 av = fabs(v);
        float amax = fmax(fmax(av.x, av.y), fmax(av.z, av.w));
        for (int o = 4; o > 0; o >>= 1) {   // over the 8 lanes of the block
            float t;
            asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(t) : "f"(amax), "r"(o));
            amax = fmax(amax, t);
        }
        float d = amax / 127.0f;                 // as quantize_q8_block
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        float4 q = round(v * id);
        xq[tt * MMA_ROW_W + lane] = as_uint(convert_char4(q));
        if ((lane & 7) == 0) xd[SC_X(tt, lane >> 3)] = round_to_half(d);
#ifdef W_Q4_1
        float sum = (q.x + q.y) + (q.z + q.w);   // integers: exact in any order
        for (int o = 4; o > 0; o >>= 1) {
            float t;
            asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(t) : "f"(sum), "r"(o));
            sum += t;
        }
        if ((lane & 7) == 0) xd[TM * 4 + SC_X(tt, lane >> 3)] = round_to_half(d * sum);   // Q8_1's s
#endif
#else
        vstore_half4_rte(v, 0, (__local half*)(xq + tt * MMA_ROW_W + 2 * (lane & 15)));
#endif
    }
}
#endif  // X_STAGED_Q || X_STAGED_H

// The weight rows of the tile's slots for K values k0..k0 + STAGE_K.
//   quantized: thread e owns (slot e / 4, block e % 4) of the stage, TN / 64 of them
//   f16:       thread e owns (slot e / 8, 16-byte unit e % 8), TN / 32 of them
#ifdef W_QUANT
#define W_FETCH (TN / 64)
typedef struct { WQ_T q[W_FETCH]; WS_T d[W_FETCH]; } w_stage;
#else
#define W_FETCH (TN / 32)
typedef struct { uint4 u[W_FETCH]; } w_stage;
#endif

inline void fetch_w(gin w, int K, int k0, int lid, size_t nblk, __local const int* rowmap, w_stage* r) {
#pragma unroll
    for (int i = 0; i < W_FETCH; i++) {
        int e = lid + 256 * i;
#ifdef W_QUANT
        int row = rowmap[e >> 2], kb = k0 / 32 + (e & 3);
        bool live = row >= 0 && kb < K / 32;
        size_t blk = (size_t)max(row, 0) * (K / 32) + kb;
        r->q[i] = live ? WQ_LOAD(w, blk) : (WQ_T)0;
        r->d[i] = live ? wheader(w, blk, nblk) : (WS_T)0.0f;
#else
        int row = rowmap[e >> 3], k = k0 + (e & 7) * 8;
        r->u[i] = row >= 0 && k < K ? ((__global const uint4*)w)[((size_t)row * K + k) / 8] : (uint4)0;
#endif
    }
}

inline void put_w(const w_stage* r, int lid, __local uint* wq, __local float* wd, __local uint* sc) {
#pragma unroll
    for (int i = 0; i < W_FETCH; i++) {
        int e = lid + 256 * i;
#ifdef W_QUANT
        int n = e >> 2, part = e & 3;
#ifdef W_Q4_0
        uint4 p = r->q[i];                   // byte j: value j (low nibble), j + 16 (high)
        // nibble n -> n - 8 as int8 in each byte: n + 120 never carries, ^ 0x80 subtracts 128
        uint8 q;
        q.lo = ((p & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
        q.hi = (((p >> 4) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
#elif defined(W_Q4_1)
        uint4 p = r->q[i];                   // codes 0..15 are already int8
        uint8 q;
        q.lo = p & 0x0F0F0F0Fu;
        q.hi = (p >> 4) & 0x0F0F0F0Fu;
#else
        uint8 q = as_uint8(r->q[i]);
#endif
        put_chunk(wq + n * MMA_ROW_W + part * 8, q.lo, q.hi, n & 1);
#ifdef W_Q4_1
        wd[SC_W(n, part)] = r->d[i].x;
        wd[TN * 4 + SC_W(n, part)] = r->d[i].y;
#else
        wd[SC_W(n, part)] = r->d[i];
#endif
#elif defined(MMA_PAIRED) && defined(MMA_PLAIN_STORES)
        // unit e % 8 is words 0..3 (even units) or 4..7 (odd) of chunk (e % 8) / 2
        __local uint* dst = wq + (e >> 3) * MMA_ROW_W + ((e & 7) >> 1) * 8 + (e & 1);
        dst[0] = r->u[i].x; dst[2] = r->u[i].y; dst[4] = r->u[i].z; dst[6] = r->u[i].w;
#elif defined(MMA_PAIRED)
        // unit e % 8 is words 0..3 (even units: lo) or 4..7 (odd: hi) of chunk (e % 8) / 2; the
        // lane pair swaps halves by shuffles so that the even lane stores paired words 0..3
        // (lo.x hi.x lo.y hi.y) and the odd lane 4..7 (lo.z hi.z lo.w hi.w): one 16-byte store
        // each, a row's 8 lanes on distinct banks (scalar stores 2 words apart: 4-way conflicts)
        int odd = e & 1;
        uint4 u = r->u[i];
        uint g0 = SHFL_XOR_U(odd ? u.x : u.z, 1), g1 = SHFL_XOR_U(odd ? u.y : u.w, 1);
        *(__local uint4*)(wq + (e >> 3) * MMA_ROW_W + ((e & 7) >> 1) * 8 + 4 * odd) =
            odd ? (uint4)(g0, u.z, g1, u.w) : (uint4)(u.x, g0, u.y, g1);
#else
        vstore4(r->u[i], 0, wq + (e >> 3) * MMA_ROW_W + (e & 7) * 4);
#endif
    }
}

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
                      yb + y_off, N, n_heads, n_kv_heads, hd, step);                           \
        barrier(CLK_LOCAL_MEM_FENCE);                                                          \
    }

#ifndef MMA_ASYNC_BODY
MATMUL_TILED_BEGIN
    gin nw = nwb + nw_off;
    size_t nblk = (size_t)N * (K / 32);
    // 16-byte aligned: chunks are stored, fragments and scale pairs loaded, as whole vectors
    __local uint lds[MMA_LDS_WORDS] __attribute__((aligned(16)));   // xq, wq; at the end out [TM][TN]
    __local uint* xq = lds;                  // [TM][MMA_ROW_W]
    __local uint* wq = lds + TM * MMA_ROW_W; // [TN][MMA_ROW_W]
    __local float xd[TM * 4 * MMA_HDR] __attribute__((aligned(16)));   // block scales of the
    __local float wd[TN * 4 * MMA_HDR] __attribute__((aligned(16)));   // stage ([TM][4], [TN][4] or
                                             // chunk-major, SC_X / SC_W); q4_1: then
                                             // s_x, m_w in the same layout
    __local float rms[TM];                   // 1 / rms of each token (prologue)
#ifdef EMU_MMA
    __local uint emu_sc[EMU_SC_WORDS];
#endif
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);

    TILE_LOOP_BEGIN
#if defined(PROLOGUE_RMS) && !defined(X_STAGED_Q) && !defined(X_STAGED_H)   // staged x carries it
    for (int i = 0; i < TM / 8; i++) {   // warp w: tokens 8w.., each read along k, whole lines
        int tt = 8 * (lid >> 5) + i;
        float ss = 0.0f;
        if (t0 + tt < rows)
            for (int k = 4 * (lid & 31); k < K; k += 128) {
                float4 v = vload4(0, x + (size_t)(t0 + tt) * K + k);
                ss += dot(v, v);
            }
        ss = warp_sum(ss);
        if ((lid & 31) == 0) rms[tt] = 1.0f / sqrt(ss / (float)K + eps);
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);

    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int wm = (warp / MMA_WARPS_N) * 32, wn = (warp % MMA_WARPS_N) * MMA_WN;
    float acc[2][MMA_NT][4] = {{{0.0f}}};   // warp tile: 2 x 16 tokens, MMA_NT x 8 slots

    x_stage xr;
    w_stage wr;
#ifdef MMA_PREFETCH_X
    fetch_x(X_SRC, t0, rows, M, K, kb, lid, nw, &xr);
#endif
#ifdef MMA_PREFETCH_W
    fetch_w(w, K, kb, lid, nblk, rowmap, &wr);
#endif
    for (int k0 = kb; k0 < ke; k0 += STAGE_K) {
#ifndef MMA_PREFETCH_X
        fetch_x(X_SRC, t0, rows, M, K, k0, lid, nw, &xr);
#endif
#ifndef MMA_PREFETCH_W
        fetch_w(w, K, k0, lid, nblk, rowmap, &wr);
#endif
        put_x(&xr, lid, xq, xd, rms);
        put_w(&wr, lid, wq, wd, EMU_SC_ARG);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (k0 + STAGE_K < ke) {   // the next stage's loads fly during this stage's MMAs
#ifdef MMA_PREFETCH_X
            fetch_x(X_SRC, t0, rows, M, K, k0 + STAGE_K, lid, nw, &xr);
#endif
#ifdef MMA_PREFETCH_W
            fetch_w(w, K, k0 + STAGE_K, lid, nblk, rowmap, &wr);
#endif
        }
#pragma unroll
        for (int c = 0; c < 4; c++) {
            uint a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
#ifdef MMA_PAIRED
                __local const uint* p = xq + (wm + 16 * mi + gq) * MMA_ROW_W + 8 * c + 2 * tq;
                uint2 r0 = *(__local const uint2*)p, r8 = *(__local const uint2*)(p + 8 * MMA_ROW_W);
                a[mi][0] = r0.x;
                a[mi][1] = r8.x;
                a[mi][2] = r0.y;
                a[mi][3] = r8.y;
#else
                __local const uint* p = xq + (wm + 16 * mi + gq) * MMA_ROW_W + 8 * c + tq;
                a[mi][0] = p[0];
                a[mi][1] = p[8 * MMA_ROW_W];
                a[mi][2] = p[4];
                a[mi][3] = p[8 * MMA_ROW_W + 4];
#endif
            }
#ifdef W_QUANT
            float sx[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                sx[mi][0] = xd[SC_X(wm + 16 * mi + gq, c)];
                sx[mi][1] = xd[SC_X(wm + 16 * mi + gq + 8, c)];
            }
#endif
#ifdef W_Q4_1
            float ssx[2][2];                 // s_x of the same rows
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                ssx[mi][0] = xd[TM * 4 + SC_X(wm + 16 * mi + gq, c)];
                ssx[mi][1] = xd[TM * 4 + SC_X(wm + 16 * mi + gq + 8, c)];
            }
#endif
#pragma unroll
            for (int ni = 0; ni < MMA_NT; ni++) {
#ifdef MMA_PAIRED
                uint2 bb = *(__local const uint2*)(wq + (wn + 8 * ni + gq) * MMA_ROW_W + 8 * c + 2 * tq);
                uint b0 = bb.x, b1 = bb.y;
#else
                __local const uint* p = wq + (wn + 8 * ni + gq) * MMA_ROW_W + 8 * c + tq;
                uint b0 = p[0], b1 = p[4];
#endif
#if defined(W_QUANT) && defined(MMA_PAIRED)
                float2 sw = *(__local const float2*)(wd + SC_W(wn + 8 * ni + 2 * tq, c));
                float sw0 = sw.x, sw1 = sw.y;
#ifdef W_Q4_1
                float2 mw = *(__local const float2*)(wd + TN * 4 + SC_W(wn + 8 * ni + 2 * tq, c));
                float mw0 = mw.x, mw1 = mw.y;
#endif
#elif defined(W_QUANT)
                float sw0 = wd[(wn + 8 * ni + 2 * tq) * 4 + c], sw1 = wd[(wn + 8 * ni + 2 * tq + 1) * 4 + c];
#ifdef W_Q4_1
                float mw0 = wd[TN * 4 + (wn + 8 * ni + 2 * tq) * 4 + c];
                float mw1 = wd[TN * 4 + (wn + 8 * ni + 2 * tq + 1) * 4 + c];
#endif
#endif
#ifdef W_QUANT
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    int s[4];
                    MMA_S8(s, a[mi], b0, b1);
                    acc[mi][ni][0] += small_int_to_float(s[0]) * (sx[mi][0] * sw0);
                    acc[mi][ni][1] += small_int_to_float(s[1]) * (sx[mi][0] * sw1);
                    acc[mi][ni][2] += small_int_to_float(s[2]) * (sx[mi][1] * sw0);
                    acc[mi][ni][3] += small_int_to_float(s[3]) * (sx[mi][1] * sw1);
#ifdef W_Q4_1
                    acc[mi][ni][0] += ssx[mi][0] * mw0;
                    acc[mi][ni][1] += ssx[mi][0] * mw1;
                    acc[mi][ni][2] += ssx[mi][1] * mw0;
                    acc[mi][ni][3] += ssx[mi][1] * mw1;
#endif
                }
#else
#pragma unroll
                for (int mi = 0; mi < 2; mi++) MMA_F16(acc[mi][ni], a[mi], b0, b1);
#endif
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    MMA_TILE_END
    TILE_LOOP_END
}
#else  // MMA_ASYNC_BODY
// f16 weights, staged f16 x, -DMMA_ASYNC: the same tiles and warps, fed as sm_80 GEMMs are.
// cp.async copies each stage's rows from global to local memory without passing through
// registers (rows past the tokens or the weights zero-filled), ASYNC_STAGES stages of
// ASYNC_K values in flight in a ring, one barrier per stage; ldmatrix.x4 loads the A and B
// fragments (four 8x8 halves matrices per instruction). Local rows are ASYNC_K halves plus 16
// bytes of pad (80 bytes: a ldmatrix phase's 8 rows of 16 bytes land on distinct banks).
// -DEMU_MMA: both run as plain copies and a local-memory exchange of row addresses.
// -DASYNC_K=<16|32> -DASYNC_STAGES=<2..5> override the defaults below (codegen, MM_TPAIR).
#ifndef ASYNC_K
#define ASYNC_K 32
#endif
#ifndef ASYNC_STAGES
#if TN == 64
#define ASYNC_STAGES 4                       // 41 KB: three stages in flight behind the MMAs
#else
#define ASYNC_STAGES 3                       // 46 KB of the 48 KB a group may hold
#endif
#endif
#define ASYNC_ROW_W (ASYNC_K / 2 + 4)        // words per local row: 48 or 80 bytes, both
                                             // put a ldmatrix phase's 8 rows on distinct banks
#define ASYNC_UNITS (ASYNC_K / 8)            // 16-byte units per row
#define ASYNC_STAGE_W ((TM_G + TN) * ASYNC_ROW_W)
#define ASYNC_LDS_W (ASYNC_STAGES * ASYNC_STAGE_W > TM * TN ? ASYNC_STAGES * ASYNC_STAGE_W : TM * TN)

#ifdef EMU_MMA
inline void cp_async16(__local uint* dst, __global const uint4* src, int live) {
    *(__local uint4*)dst = live ? *src : (uint4)0;
}
#define CP_ASYNC_COMMIT()
#define CP_ASYNC_WAIT_PENDING()
#define CP_ASYNC_WAIT_ALL()
// lane l of the warp gets, of matrix j, word l % 4 of row l / 4, whose address lane 8 j + l / 4 gave
inline void ldmatrix_x4(uint* r, __local const uint* base, int off, __local uint* sc) {
    int lid = get_local_id(0), lane = lid & 31;
    barrier(CLK_LOCAL_MEM_FENCE);
    sc[lid] = (uint)off;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < 4; j++) r[j] = base[sc[(lid & ~31) + 8 * j + (lane >> 2)] + (lane & 3)];
}
#define LDMATRIX_X4(r, base, off) ldmatrix_x4(r, base, off, emu_sc)
#else
#define SHARED_ADDR(p) ((uint)(size_t)(p))
inline void cp_async16(__local uint* dst, __global const uint4* src, int live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(SHARED_ADDR(dst)), "l"(src), "r"(live ? 16 : 0) : "memory");
}
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#if ASYNC_STAGES == 2                       // wait_group's count must be a literal: ASYNC_STAGES - 2
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 0;" ::: "memory")
#elif ASYNC_STAGES == 3
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 1;" ::: "memory")
#elif ASYNC_STAGES == 4
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 2;" ::: "memory")
#elif ASYNC_STAGES == 5
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 3;" ::: "memory")
#else
#error "ASYNC_STAGES: 2 to 5"
#endif
#define CP_ASYNC_WAIT_ALL() asm volatile("cp.async.wait_group 0;" ::: "memory")
#define LDMATRIX_X4(r, base, off)                                                              \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"               \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SHARED_ADDR((base) + (off))))
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

// stage kt (from K value kb) into ring slot kt % ASYNC_STAGES: the TM_G x rows (thread e: row
// e / ASYNC_UNITS, 16-byte unit e % ASYNC_UNITS), then the TN weight rows the same way
inline void async_stage(__local uint* lds, gin sb, gin w, int t0, int rows, int K, int kb, int kt, int lid,
                        __local const int* rowmap) {
    __local uint* st = lds + (kt % ASYNC_STAGES) * ASYNC_STAGE_W;
    int k = kb + kt * ASYNC_K;
#pragma unroll
    for (int e = lid; e < (TM_G + TN) * ASYNC_UNITS; e += 256) {
        int r = e / ASYNC_UNITS, u = e % ASYNC_UNITS;
        int live;
        __global const uint4* src = stage_src(sb, w, t0, rows, K, k, r, u, rowmap, &live);
        cp_async16(st + r * ASYNC_ROW_W + 4 * u, src, live);
    }
}

#ifdef USE_NV_WGMMA
// -DUSE_NV_WGMMA (the runtime, on compute capability 9.0): the same stages and ring, multiplied by
// Hopper's warpgroup MMA. wgmma.mma_async (m64nNk16, f16 in, f32 accumulated) reads both operands
// from local memory through matrix descriptors, so no fragment is loaded into registers, and a
// warpgroup (4 warps) issues one instruction per 64 x N x 16 where mma.sync needs 4 N / 8.
// NVIDIA's OpenCL compiler targets sm_90, which has no wgmma: the kernel writes each wgmma
// instruction as a PTX comment, `// LLMRS_WGMMA_<what> <registers>`, through inline asm (so the
// compiler binds the accumulator registers), and the runtime rewrites those comments into the
// instructions and the target into sm_90a before the driver assembles the PTX
// (runtime/backends/opencl.py patch_wgmma_ptx). A stage holds x's TM_G rows, then the TN weight
// rows, each WG_K values (WG_RB bytes) in 16-byte units, in the layouts wgmma reads:
//   swizzled (default): row r at byte WG_RB r, its unit u stored as unit u ^ WG_SWZ(r), the XOR of
//     the 32 / 64-byte swizzle modes, so the MMA's reads of 8 rows meet distinct banks; 8 rows
//     (512 or 256 bytes, aligned) are one swizzle atom, the descriptors' stride
//   -DWG_NO_SWIZZLE: 8 x 8 "core matrices" of 128 bytes, unit u of row r at byte (r / 8) WG_SBO +
//     128 u + 16 (r % 8), 128 bytes apart along K (the leading offset), WG_SBO along rows.
// Warpgroup wg computes
// tokens 64 wg.. x all TN slots (MM_TPAIR: N = TN) or all 64 tokens x slots WG_N wg.. (N = TN / 2).
// A ring of WG_STAGES stages of WG_K values (-DWG_K=<16|32>, default 16; -DWG_STAGES, default as
// many as 40 KB hold, at most 8); one barrier a stage; the copies run WG_STAGES - 1 - WG_INFLIGHT
// stages ahead, and the MMAs of WG_INFLIGHT (0 or 1, -DWG_INFLIGHT; 0 where the ring has 2
// stages) earlier stages may still run while a warpgroup issues the next.
// -DEMU_MMA: wgmma computed in C from the same local memory (tests on any device).
#ifdef MM_TPAIR
#define WG_N TN
#else
#define WG_N (TN / 2)
#endif
#define WG_ACC (WG_N / 2)                    // accumulators per thread
#ifndef WG_K
#define WG_K 16
#endif
#ifndef WG_INFLIGHT
#define WG_INFLIGHT 1
#endif
#define WG_UNITS (WG_K / 8)                  // 16-byte units of a row's stage
#define WG_RB (2 * WG_K)                     // bytes of a row's stage
#define WG_STAGE_BYTES ((TM_G + TN) * WG_RB)
#ifndef WG_STAGES
#if 40960 / WG_STAGE_BYTES > 8
#define WG_STAGES 8
#else
#define WG_STAGES (40960 / WG_STAGE_BYTES)
#endif
#endif
#if WG_STAGES - 1 - WG_INFLIGHT < 1         // a ring of 2: no stage's MMAs may stay in flight
#undef WG_INFLIGHT
#define WG_INFLIGHT 0
#endif
#define WG_AHEAD (WG_STAGES - 1 - WG_INFLIGHT)   // stages whose copies fly during a stage's MMAs
#ifdef WG_NO_SWIZZLE
#define WG_SBO (128 * WG_UNITS)
#define WG_LBO 128
#define WG_LAYOUT 0
#define WG_KSTEP 256                         // bytes from one 16-value K step to the next
#define WG_OFF(r, u) (((r) >> 3) * WG_SBO + 128 * (u) + 16 * ((r) & 7))
#else
#define WG_SBO (8 * WG_RB)
#define WG_LBO 16                            // (unused by the swizzled K-major layouts)
#if WG_K == 32
#define WG_LAYOUT 2                          // the descriptor's 64-byte swizzle
#else
#define WG_LAYOUT 3                          // 32-byte
#endif
#define WG_KSTEP 32
#define WG_SWZ(r) (((r) & 7) / (8 / WG_UNITS))
#define WG_OFF(r, u) ((r) * WG_RB + 16 * ((u) ^ WG_SWZ(r)))
#endif
#define WG_LDS_W (WG_STAGES * WG_STAGE_BYTES / 4 > TM * TN ? WG_STAGES * WG_STAGE_BYTES / 4 : TM * TN)

#ifdef EMU_MMA
// K step c (values 16 c..) of the operands whose rows start at pa and pb (8-row aligned)
inline void emu_wgmma(float* d, __local const uchar* pa, __local const uchar* pb, int c, int lid) {
    int lane = lid & 31, w4 = (lid >> 5) & 3, gq = lane >> 2, tq = lane & 3;
    for (int idx = 0; idx < WG_ACC; idx++) {
        int j = idx >> 2, i = idx & 3, row = 16 * w4 + gq + 8 * (i >> 1), col = 8 * j + 2 * tq + (i & 1);
        float acc = 0.0f;
        for (int k = 16 * c; k < 16 * c + 16; k++)
            acc += vload_half(0, (__local const half*)(pa + WG_OFF(row, k >> 3) + 2 * (k & 7)))
                 * vload_half(0, (__local const half*)(pb + WG_OFF(col, k >> 3) + 2 * (k & 7)));
        d[idx] += acc;
    }
}
#define WG_MMA(d, pa, pb, c) emu_wgmma(d, pa, pb, c, lid)
#define WG_FENCE(d)
#define WG_COMMIT()
#define WG_WAIT0(d)
#define WG_WAIT_INFLIGHT(d)
#define WG_CP_WAIT()
#define WG_PROXY_FENCE()
#else
#if WG_N == 128
#define WG_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_REGS "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_MMA_TEXT "// LLMRS_WGMMA_M64N128K16 " WG_REGS ", %64, %65, %66"
#elif WG_N == 64
#define WG_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_REGS "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define WG_MMA_TEXT "// LLMRS_WGMMA_M64N64K16 " WG_REGS ", %32, %33, %34"
#elif WG_N == 32
#define WG_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WG_REGS "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define WG_MMA_TEXT "// LLMRS_WGMMA_M64N32K16 " WG_REGS ", %16, %17, %18"
#else
#error "WG_N: 32, 64 or 128"
#endif

// a matrix descriptor: start address, leading and stride byte offsets, layout (swizzle) type
inline ulong wg_desc(__local const uchar* p) {
    return (ulong)((SHARED_ADDR(p) & 0x3FFFF) >> 4) | ((ulong)(WG_LBO >> 4) << 16) | ((ulong)(WG_SBO >> 4) << 32)
           | ((ulong)WG_LAYOUT << 62);
}
// the accumulators are operands of the fence and the wait, so the compiler keeps every use of
// them on its side of the asynchronous MMAs
#define WG_FENCE(d) asm volatile("// LLMRS_WGMMA_FENCE " WG_REGS : WG_OPS(d) :: "memory")
#define WG_MMA(d, pa, pb, c) asm volatile(WG_MMA_TEXT : WG_OPS(d) \
    : "l"(wg_desc((pa) + WG_KSTEP * (c))), "l"(wg_desc((pb) + WG_KSTEP * (c))), "r"(1) : "memory")
#define WG_COMMIT() asm volatile("// LLMRS_WGMMA_COMMIT" ::: "memory")
#define WG_WAIT0(d) asm volatile("// LLMRS_WGMMA_WAIT0 " WG_REGS : WG_OPS(d) :: "memory")
#if WG_INFLIGHT == 1
#define WG_WAIT_INFLIGHT(d) asm volatile("// LLMRS_WGMMA_WAIT1 " WG_REGS : WG_OPS(d) :: "memory")
#else
#define WG_WAIT_INFLIGHT(d) WG_WAIT0(d)
#endif
// cp.async.wait_group's count is a literal: WG_AHEAD - 1 groups may stay pending
#if WG_AHEAD == 1
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 0;" ::: "memory")
#elif WG_AHEAD == 2
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 1;" ::: "memory")
#elif WG_AHEAD == 3
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 2;" ::: "memory")
#elif WG_AHEAD == 4
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 3;" ::: "memory")
#elif WG_AHEAD == 5
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 4;" ::: "memory")
#elif WG_AHEAD == 6
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 5;" ::: "memory")
#else
#error "WG_STAGES: at most 8"
#endif
// cp.async's stores, made visible to the MMAs' reads (the async proxy)
#define WG_PROXY_FENCE() asm volatile("fence.proxy.async.shared::cta;" ::: "memory")
#endif

// stage kt into ring slot kt % WG_STAGES in wgmma's layout; thread e: row e / WG_UNITS, unit
// e % WG_UNITS, so a warp reads whole rows (full 32-byte sectors; a lane a row, half sectors,
// made the body 33% slower) and, in the swizzled layouts, a quarter-warp's 16-byte stores fill
// 128 contiguous bytes
inline void wg_stage(__local uchar* lds, gin sb, gin w, int t0, int rows, int K, int kb, int kt, int lid,
                     __local const int* rowmap) {
    __local uchar* st = lds + (kt % WG_STAGES) * WG_STAGE_BYTES;
    int k = kb + kt * WG_K;
#pragma unroll
    for (int e = lid; e < (TM_G + TN) * WG_UNITS; e += 256) {
        int r = e / WG_UNITS, u = e % WG_UNITS;
        int live;
        __global const uint4* src = stage_src(sb, w, t0, rows, K, k, r, u, rowmap, &live);
        cp_async16((__local uint*)(st + WG_OFF(r, u)), src, live);
    }
}

MATMUL_TILED_BEGIN
    __local uint lds[WG_LDS_W] __attribute__((aligned(1024)));   // the ring (swizzle atoms aligned); at the end out [TM][TN]
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);
    barrier(CLK_LOCAL_MEM_FENCE);
    int t0 = t0g;
    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3, wg = warp >> 2, w4 = warp & 3;
    float d[WG_ACC];
#pragma unroll
    for (int i = 0; i < WG_ACC; i++) d[i] = 0.0f;
#ifdef MM_TPAIR
    int a_row = 64 * wg, b_row = TM_G;               // this warpgroup's A (token) and B (slot) rows
#else
    int a_row = 0, b_row = TM_G + WG_N * wg;
#endif
    __local uchar* ring = (__local uchar*)lds;

    int nk = (ke - kb) / WG_K;
    for (int s = 0; s < WG_AHEAD; s++) {
        if (s < nk) wg_stage(ring, sb, w, t0, rows, K, kb, s, lid, rowmap);
        CP_ASYNC_COMMIT();
    }
    for (int kt = 0; kt < nk; kt++) {
        WG_CP_WAIT();                        // this thread's copies of stage kt have landed
        WG_PROXY_FENCE();
        // everyone's; and each warpgroup's MMAs of stage kt - 1 - WG_INFLIGHT are done, so
        // stage kt + WG_AHEAD may take their slot
        barrier(CLK_LOCAL_MEM_FENCE);
        if (kt + WG_AHEAD < nk) wg_stage(ring, sb, w, t0, rows, K, kb, kt + WG_AHEAD, lid, rowmap);
        CP_ASYNC_COMMIT();
        __local const uchar* st = ring + (kt % WG_STAGES) * WG_STAGE_BYTES;
        WG_FENCE(d);
#pragma unroll
        for (int c = 0; c < WG_K / 16; c++)   // unit pairs 2c, 2c + 1: K values 16c..
            WG_MMA(d, st + WG_OFF(a_row, 0), st + WG_OFF(b_row, 0), c);
        WG_COMMIT();
        WG_WAIT_INFLIGHT(d);
    }
    WG_WAIT0(d);
    CP_ASYNC_WAIT_ALL();
    barrier(CLK_LOCAL_MEM_FENCE);

    // accumulator idx of a thread: row 16 w4 + gq (+ 8 for idx % 4 >= 2), column 8 (idx / 4) +
    // 2 tq + idx % 2 of the warpgroup's 64 x WG_N tile (the mma.sync C fragment, N / 8 times)
    __local float* out = (__local float*)lds;
    for (int mt = 0; mt < TM_G / TM; mt++) {
#ifdef MM_TPAIR
        if (wg == mt)
#endif
        {
#pragma unroll
            for (int idx = 0; idx < WG_ACC; idx++) {
                int row = 16 * w4 + gq + 8 * ((idx >> 1) & 1), col = 8 * (idx >> 2) + 2 * tq + (idx & 1);
#ifdef MM_TPAIR
                out[row * TN + col] = d[idx];
#else
                out[row * TN + WG_N * wg + col] = d[idx];
#endif
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        MM_SPLIT_MERGE(out, t0 / TM + mt)
        tile_epilogue(out, t0 + TM * mt, rows, g, lid, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                      yb + y_off, N, n_heads, n_kv_heads, hd, step);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}
#else  // !USE_NV_WGMMA
MATMUL_TILED_BEGIN
    __local uint lds[ASYNC_LDS_W] __attribute__((aligned(16)));   // the ring; at the end out [TM][TN]
#ifdef EMU_MMA
    __local uint emu_sc[EMU_SC_WORDS];
#endif
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);
    barrier(CLK_LOCAL_MEM_FENCE);
    int t0 = t0g;                            // both token tiles at once (MM_TPAIR)

    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int wm = (warp / MMA_WARPS_N) * 32, wn = (warp % MMA_WARPS_N) * MMA_WN;
    float acc[2][MMA_NT][4] = {{{0.0f}}};   // warp tile: 2 x 16 tokens, MMA_NT x 8 slots
    // ldmatrix row addresses (words, within a stage): A, matrices (rows 0-7 | 8-15) x (k 0-7 |
    // 8-15) of 16 tokens; B, (k 0-7 | 8-15) x (slots 0-7 | 8-15) of 16 weight rows
    int a_off = (wm + (lane & 15)) * ASYNC_ROW_W + 4 * (lane >> 4);
    int b_off = (TM_G + wn + (lane & 7) + 8 * (lane >> 4)) * ASYNC_ROW_W + 4 * ((lane >> 3) & 1);

    int nk = (ke - kb) / ASYNC_K;
    for (int s = 0; s < ASYNC_STAGES - 1; s++) {
        if (s < nk) async_stage(lds, sb, w, t0, rows, K, kb, s, lid, rowmap);
        CP_ASYNC_COMMIT();
    }
    for (int kt = 0; kt < nk; kt++) {
        CP_ASYNC_WAIT_PENDING();             // this thread's copies of stage kt have landed
        barrier(CLK_LOCAL_MEM_FENCE);        // everyone's; and stage kt - 1's slot is free
        if (kt + ASYNC_STAGES - 1 < nk) async_stage(lds, sb, w, t0, rows, K, kb, kt + ASYNC_STAGES - 1, lid, rowmap);
        CP_ASYNC_COMMIT();                   // (empty groups keep the count of pending ones)
        __local const uint* st = lds + (kt % ASYNC_STAGES) * ASYNC_STAGE_W;
#pragma unroll
        for (int c = 0; c < ASYNC_K / 16; c++) {
            uint a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) LDMATRIX_X4(a[mi], st, a_off + 16 * mi * ASYNC_ROW_W + 8 * c);
#pragma unroll
            for (int nj = 0; nj < MMA_NT; nj += 2) {
                uint b[4];                   // b0, b1 of slots 8 nj .., then of 8 (nj + 1) ..
                LDMATRIX_X4(b, st, b_off + 8 * nj * ASYNC_ROW_W + 8 * c);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    MMA_F16(acc[mi][nj], a[mi], b[0], b[1]);
                    MMA_F16(acc[mi][nj + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }
    CP_ASYNC_WAIT_ALL();
    barrier(CLK_LOCAL_MEM_FENCE);

    MMA_TILE_END
}
#endif  // USE_NV_WGMMA
#endif  // MMA_ASYNC_BODY
#endif  // MMA_BODY
