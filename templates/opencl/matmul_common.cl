// Shared by matvec.cl and matmul.cl (prepended by codegen): weight blocks, slot rows, epilogues
// of fused_matmul as compiler/ir.py defines it; y = epilogue(prologue(x) @ w.T).
//   -DW_T=<q4_0|q4_1|q8_0|f16|bf16|f32> and -DW_<T>   weight element type
//   -DPROLOGUE_RMS -DNORM_T=<f32|f16|bf16>        x is RMS-normalised first (norm_w[K], eps)
//   -DEPI_ADD | -DEPI_SILU_MUL | -DEPI_ROPE_KV     epilogue (none: plain y)
//   -DKV_T=<f32|f16|q8_0|q4_0> -DKV_<T>            cache element type (EPI_ROPE_KV); q8_0 and
//                                                  q4_0 caches (KV_BLOCKS) are written a 32-value
//                                                  block at a time by epilogue_chunk()
//   -DROPE_HEADS                                   (EPI_ROPE_KV, KV_BLOCKS, matvec) a group per
//                                                  head of [q; k; v], RW = hd, in row order
//   -DQK_NORM -DQK_HPG=<h> -DQK_PARTS=<p> -DQKN_T=<f32|f16|bf16>
//                                                  (EPI_ROPE_KV) each q and k head RMS-normed
//                                                  (weights qn, kn [hd], eps qk_eps) before
//                                                  RoPE; a group holds QK_HPG whole heads
//   -DBIAS                                         b f32 [N] added to every dot product before
//                                                  the epilogue
//   -DQK_SPLIT=<s>                                 (QK_NORM, matvec) a head's rows over s groups,
//                                                  pairs as without norms: each writes its dot
//                                                  products to scratch, the last to take the
//                                                  head's ticket finishes the head (qk_split_epilogue)
//   -DQK_DEFER                                     (EPI_ROPE_KV, matvec, no QK_NORM) q and k
//                                                  rows written raw (q into y, k into e0, the
//                                                  staging buffer), v stored: the attention
//                                                  kernel normalises, ropes and stores them
//   -DROPE_HD=<hd>                                 (EPI_ROPE_KV with BIAS or QK_NORM) head_dim
//                                                  known at build time: the slot arithmetic
//                                                  of pre_epilogue() divides by no variable
//   -DSTEP_ROWS                                    (EPI_ROPE_KV) a step graph's rows: row t is
//                                                  roped at positions[t] and stored at cache
//                                                  row slots[t] (none where that is outside
//                                                  the cache's n_slots rows), not start_pos + t
//                                                  and n_past + t; the kernels' last arguments
//   -DMV_WG, -DMV_ROWS, -DMV_K, -DMV_LOADS          matvec shape (matvec.cl)
// Quantized weights multiply Q8_0-quantized activations block by block; a block's dot product
// of integers is exact in f32 (|sum| <= 32*127*128 < 2^24), then scaled by d_x * d_w, as GGML.
// q4_1 weights (value = code * d_w + m_w, codes 0..15) take Q8_1 activations, Q8_0's codes and
// scale plus s_x = f16(d_x * sum of the codes), d_x before its f16 rounding; a block adds
// d_w * d_x * sumi + m_w * s_x (ggml_vec_dot_q4_1_q8_1).
//
// Every group of a launch owns RW "slots"; slot_row() maps a slot to the weight row it computes.
// Pair epilogues put a row and its partner in the same group: silu_mul pairs gate row u with
// up row F + u; rope pairs row j of a q/k head with row j + hd/2 (or, with ROPE_HEADS, a group
// holds a whole head, so both are there). Arguments of every kernel:
//   x      f32 [M, K]                 activations (row t of the step)
//   w      W_T [N, K]                 weight rows (HF layout)
//   nw     NORM_T [K]                 norm weight (PROLOGUE_RMS)
//   e0     f32 [M, N] residual (EPI_ADD) | f32 [hd/2] inv_freq (EPI_ROPE_KV)
//   e1,e2  KV_T [S, KVH, hd]          k and v caches (EPI_ROPE_KV), rows n_past + t (or slots[t])
//   y      f32 [M, N] | [M, N/2] (EPI_SILU_MUL) | q_roped [M, H*hd] (EPI_ROPE_KV)
//   b      f32 [N]                    bias (BIAS)
//   qn,kn  QKN_T [hd]                 per-head q / k norm weights (QK_NORM)
//   positions, slots  int [M], n_slots  the rows' positions and cache rows (STEP_ROWS), last
// With BIAS or QK_NORM, pre_epilogue() first changes a group's finished dot products in local
// memory: b added to each, then each q / k head normalised (QK_NORM needs the slot rule to give
// a group whole heads: with pairs, a group takes QK_HPG heads' pairs, the rest of its pair
// slots idle).

// Weight access (quantized weights in the split layout of common.cl; blk = row * K/32 + b):
//   welem(w, blk, k, nblk)   element k of block blk (quantized: the integer code)
//   wscale(w, blk, nblk)     block scale (q4_0, q8_0)
//   wheader(w, blk, nblk) -> WS_T   what a block's dot product scales by: its scale d, or for
//                                q4_1 (d, m) from one 4-byte load
//   WQ_LOAD(w, blk) -> WQ_T     a block's quants
//   wq_idot(q, xq, xs)           exact integer dot of those with Q8_0 activations packed
//                                4 per int in xq[8] (xs = their sum, for q4_0's -8 offset;
//                                q4_1's codes carry no offset and ignore it)
//   wunit_load(w, unit) -> WU_T, wunit_dot_bits(u, x)   float types: 8 consecutive weights
//                                (a 16-byte unit) and their dot with x
#if defined(W_Q4_0) || defined(W_Q4_1)
#define W_QUANT 1
#define W_QBYTES 16
#ifdef W_Q4_0
#define W_CODE_OFFSET 8
#else
#define W_CODE_OFFSET 0
#endif
inline float welem(gin w, size_t blk, int k, size_t nblk) {
    uchar q = w[blk * 16 + (k & 15)];
    return (float)((k < 16 ? (q & 15) : (q >> 4)) - W_CODE_OFFSET);
}
#define WQ_T uint4
#define WQ_LOAD(w, blk) (((__global const uint4*)(w))[blk])
// nibbles (n & 0x0F0F0F0F, of a uint or a vector of them) as the int8 codes the tensor cores take:
// q4_0's n - 8 (n + 120 never carries, ^ 0x80 then subtracts 128), q4_1's as they are
#ifdef W_Q4_0
#define Q4_S8(n) (((n) + 0x78787878u) ^ 0x80808080u)
#else
#define Q4_S8(n) (n)
#endif
inline int wq_idot(uint4 q, const int* xq, int xs) {   // byte j: value j (low nibble), j + 16 (high)
    int s = -W_CODE_OFFSET * xs;
    s = dot4_us(q.s0 & 0x0F0F0F0Fu, xq[0], s);
    s = dot4_us(q.s1 & 0x0F0F0F0Fu, xq[1], s);
    s = dot4_us(q.s2 & 0x0F0F0F0Fu, xq[2], s);
    s = dot4_us(q.s3 & 0x0F0F0F0Fu, xq[3], s);
    s = dot4_us((q.s0 >> 4) & 0x0F0F0F0Fu, xq[4], s);
    s = dot4_us((q.s1 >> 4) & 0x0F0F0F0Fu, xq[5], s);
    s = dot4_us((q.s2 >> 4) & 0x0F0F0F0Fu, xq[6], s);
    s = dot4_us((q.s3 >> 4) & 0x0F0F0F0Fu, xq[7], s);
    return s;
}
#elif defined(W_Q8_0)
#define W_QUANT 1
#define W_QBYTES 32
inline float welem(gin w, size_t blk, int k, size_t nblk) { return (float)((__global const char*)w)[blk * 32 + k]; }
#define WQ_T int8
#define WQ_LOAD(w, blk) (((__global const int8*)(w))[blk])
inline int wq_idot(int8 q, const int* xq, int xs) {
    int4 a = q.lo, b = q.hi;
    int s = dot4_ss(a.s0, xq[0], 0);
    s = dot4_ss(a.s1, xq[1], s);
    s = dot4_ss(a.s2, xq[2], s);
    s = dot4_ss(a.s3, xq[3], s);
    s = dot4_ss(b.s0, xq[4], s);
    s = dot4_ss(b.s1, xq[5], s);
    s = dot4_ss(b.s2, xq[6], s);
    s = dot4_ss(b.s3, xq[7], s);
    return s;
}
#elif defined(W_F16)
inline float welem(gin w, size_t blk, int k, size_t nblk) { return ld_f16(w, blk * 32 + k); }
#define WU_T uint4
inline uint4 wunit_load(gin w, size_t unit) { return ((__global const uint4*)w)[unit]; }
inline float wunit_dot_bits(uint4 u, float8 x) {
    float2 a = half2_bits_to_float2(u.s0), b = half2_bits_to_float2(u.s1);
    float2 c = half2_bits_to_float2(u.s2), d = half2_bits_to_float2(u.s3);
    return fma(a.x, x.s0, fma(a.y, x.s1, fma(b.x, x.s2, fma(b.y, x.s3,
           fma(c.x, x.s4, fma(c.y, x.s5, fma(d.x, x.s6, d.y * x.s7)))))));
}
#elif defined(W_BF16)
inline float welem(gin w, size_t blk, int k, size_t nblk) { return ld_bf16(w, blk * 32 + k); }
#define WU_T uint4
inline uint4 wunit_load(gin w, size_t unit) { return ((__global const uint4*)w)[unit]; }
inline float wunit_dot_bits(uint4 u, float8 x) {
    float8 f = as_float8((uint8)(u.s0 << 16, u.s0 & 0xFFFF0000u, u.s1 << 16, u.s1 & 0xFFFF0000u,
                                 u.s2 << 16, u.s2 & 0xFFFF0000u, u.s3 << 16, u.s3 & 0xFFFF0000u));
    return dot(f.lo, x.lo) + dot(f.hi, x.hi);
}
#else  // W_F32
inline float welem(gin w, size_t blk, int k, size_t nblk) { return ld_f32(w, blk * 32 + k); }
#define WU_T float8
inline float8 wunit_load(gin w, size_t unit) { return ((__global const float8*)w)[unit]; }
inline float wunit_dot_bits(float8 u, float8 x) { return dot(u.lo, x.lo) + dot(u.hi, x.hi); }
#endif
#ifndef W_QUANT
inline float wval(gin w, size_t i) { return CAT(ld_, W_T)(w, i); }   // element i of a float tensor
#endif
#if defined(W_Q4_1)
#define WS_T float2
inline float2 wheader(gin w, size_t blk, size_t nblk) {
    return half2_bits_to_float2(((__global const uint*)(w + nblk * W_QBYTES))[blk]);
}
#elif defined(W_QUANT)
#define WS_T float
inline float wscale(gin w, size_t blk, size_t nblk) {
    return vload_half(blk, (__global const half*)(w + nblk * W_QBYTES));
}
#define wheader wscale
#endif

#if defined(PROLOGUE_RMS) && defined(NORM_UNIT)
// the norm weight is ones, its values already in the matmul weight (fuse.py norm_weight_fold)
#define LD4_NORM(p, i4) ((float4)(1.0f))
#define LD_NORM(p, i) 1.0f
#elif defined(PROLOGUE_RMS)
#define LD4_NORM(p, i4) CAT(ld4_, NORM_T)(p, i4)
#define LD_NORM(p, i) CAT(ld_, NORM_T)(p, i)
#endif
#if defined(EPI_ROPE_KV) && !defined(KV_BLOCKS)
#define ST_KV(p, i, v) CAT(st_, KV_T)(p, i, v)
#endif
// Where row t of the step goes: its RoPE position and the cache row it writes. The epilogues
// take EPI_ROWS_PARAMS (passed on as EPI_ROWS_PASS); a kernel gives them EPI_ROWS_OF(step) from
// the step scalars or, with STEP_ROWS, from its last arguments KERNEL_ROWS_ARGS.
#ifdef STEP_ROWS
#define KERNEL_ROWS_ARGS , gin posb, ulong pos_off, gin slotb, ulong slot_off, int n_slots
#define EPI_ROWS_OF(step) posb + pos_off, slotb + slot_off, n_slots
#define EPI_ROWS_PARAMS gin positions, gin slots, int n_slots
#define EPI_ROWS_PASS positions, slots, n_slots
#define ROW_POS(t) (((__global const int*)positions)[t])
#define ROW_SLOT(t) (((__global const int*)slots)[t])
// the runtime refuses a step whose slots leave the cache (rope.cl kv_store): one that got here
// anyway stores nothing rather than write next to the cache
#define SLOT_IN_CACHE(slot) ((slot) >= 0 && (slot) < n_slots)
#else
#define KERNEL_ROWS_ARGS
#define EPI_ROWS_OF(step) STEP_N_PAST(step), STEP_START_POS(step)
#define EPI_ROWS_PARAMS int n_past, int start_pos
#define EPI_ROWS_PASS n_past, start_pos
#define ROW_POS(t) (start_pos + (t))
#define ROW_SLOT(t) (n_past + (t))
#define SLOT_IN_CACHE(slot) 1
#endif

// head_dim as a build-time constant where codegen gives one (the int argument otherwise)
#ifdef ROPE_HD
#define FIX_HD(hd) hd = ROPE_HD
#else
#define FIX_HD(hd)
#endif
// RoPE pairs a group holds: half its slots, or with QK_NORM those of QK_HPG whole heads
#if defined(QK_NORM) && !defined(QK_SPLIT)
#define ROPE_PPG(RW, hh) (QK_HPG * (hh))
#else
#define ROPE_PPG(RW, hh) ((RW) / 2)
#endif

// Groups of a launch over the rows (the host sizes the grid with the same rule).
inline int slot_row(int g, int r, int RW, int N, int n_heads, int n_kv_heads, int hd) {
    FIX_HD(hd);
#if defined(EPI_SILU_MUL)
    int half_rw = RW / 2, u = g * half_rw + (r % half_rw);
    if (u >= N / 2) return -1;
    return r < half_rw ? u : N / 2 + u;
#elif defined(EPI_ROPE_KV) && !defined(ROPE_HEADS)
    int half_rw = RW / 2, hh = hd / 2, ppg = ROPE_PPG(RW, hh);
    int pairs = (n_heads + n_kv_heads) * hh;
    int pair_groups = (pairs + ppg - 1) / ppg;
    if (g < pair_groups) {
#if defined(QK_NORM) && !defined(QK_SPLIT)
        if (r % half_rw >= ppg) return -1;
#endif
        int p = g * ppg + (r % half_rw);
        if (p >= pairs) return -1;
        return (p / hh) * hd + (p % hh) + (r < half_rw ? 0 : hh);
    }
    int row = (n_heads + n_kv_heads) * hd + (g - pair_groups) * RW + r;
    return row < N ? row : -1;
#else
    int row = g * RW + r;
    return row < N ? row : -1;
#endif
}

// Writes slot r of group g for token t; vals[s * stride] is slot s's dot product.
inline void epilogue(int t, int g, int r, int RW, __local const float* vals, int stride,
                     gout e0, gout e1, gout e2, gout y, int N, int n_heads, int n_kv_heads,
                     int hd, EPI_ROWS_PARAMS) {
    FIX_HD(hd);
#if defined(EPI_SILU_MUL)
    int half_rw = RW / 2, F = N / 2, u = g * half_rw + r;
    if (r >= half_rw || u >= F) return;
    float gate = vals[r * stride], up = vals[(r + half_rw) * stride];
    ((__global float*)y)[(size_t)t * F + u] = gate / (1.0f + exp(-gate)) * up;
#elif defined(EPI_ROPE_KV) && !defined(KV_BLOCKS)
    int half_rw = RW / 2, hh = hd / 2, ppg = ROPE_PPG(RW, hh);
    int pairs = (n_heads + n_kv_heads) * hh;
    int pair_groups = (pairs + ppg - 1) / ppg;
    int slot = ROW_SLOT(t);
    size_t kv_row = (size_t)slot * n_kv_heads * hd;
    if (g < pair_groups) {
        int p = g * ppg + r;
#if defined(QK_NORM) && !defined(QK_SPLIT)
        if (r >= ppg) return;
#endif
        if (r >= half_rw || p >= pairs) return;
        int head = p / hh, j = p % hh;
        float x1 = vals[r * stride], x2 = vals[(r + half_rw) * stride];
#ifdef QK_DEFER
        // the attention kernel normalises and ropes both (attention_decode.cl): q as it is into
        // y, k into e0 (the staging buffer, f32 [M, KVH * hd]); it stores k in the cache itself
        __global float* raw = head < n_heads ? (__global float*)y + (size_t)t * n_heads * hd + head * hd
                                             : (__global float*)e0 + ((size_t)t * n_kv_heads + head - n_heads) * hd;
        raw[j] = x1;
        raw[j + hh] = x2;
        return;
#endif
        float ang = (float)ROW_POS(t) * ((__global const float*)e0)[j];
        float c, s = sincos(ang, &c);   // one range reduction for both
        float o1 = x1 * c - x2 * s, o2 = x2 * c + x1 * s;
        if (head < n_heads) {
            __global float* q = (__global float*)y + (size_t)t * n_heads * hd + head * hd;
            q[j] = o1;
            q[j + hh] = o2;
        } else if (SLOT_IN_CACHE(slot)) {
            size_t base = kv_row + (head - n_heads) * hd;
            ST_KV(e1, base + j, o1);
            ST_KV(e1, base + j + hh, o2);
        }
    } else {
        int row = (g - pair_groups) * RW + r;
        if (row < n_kv_heads * hd && SLOT_IN_CACHE(slot)) ST_KV(e2, kv_row + row, vals[r * stride]);
    }
#elif defined(EPI_ROPE_KV)
    // KV_BLOCKS: epilogue_chunk() writes whole blocks instead
#else
    int row = g * RW + r;
    if (row >= N) return;
    size_t i = (size_t)t * N + row;
#if defined(EPI_ADD)
    ((__global float*)y)[i] = ((__global const float*)e0)[i] + vals[r * stride];
#else
    ((__global float*)y)[i] = vals[r * stride];
#endif
#endif
}


#if defined(EPI_ROPE_KV) && defined(KV_Q4_0)
// o, 32 values, as the q4_0 block of cache holding element `first` (a multiple of 32)
inline void store_kv_block(gout cache, size_t first, const float* o) {
    store_q4_0_block(cache + (first >> 5) * 18, o);
}
#elif defined(EPI_ROPE_KV) && defined(KV_Q8_0)
// o, 32 values, as the Q8_0 block of cache holding element `first` (a multiple of 32), as
// quant.quantize does (d = amax / 127 kept as f16, q = round(x / d) half away from zero)
inline void store_kv_block(gout cache, size_t first, const float* o) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(o[i]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    gout blk = cache + (first >> 5) * 34;
    vstore_half_rte(d, 0, (__global half*)blk);
    for (int i = 0; i < 32; i++) ((__global char*)(blk + 2))[i] = (char)(int)round(o[i] * id);
}
#endif

#if defined(EPI_ROPE_KV) && defined(KV_BLOCKS) && defined(ROPE_HEADS)
// Q8_0 / q4_0 caches where head_dim % 64 == 32: a 32-value block then holds the end of one RoPE half
// and the start of the other, which pair groups would split between groups. So group g holds
// head g of [q; k; v] whole (RW = hd, slot r = row r of the head), and thread c finishes its
// block c: RoPE from the head's own rows (q, k), then q stored as f32, k/v as a cache block.
inline void epilogue_chunk(int t, int g, int c, int RW, __local const float* vals, int stride,
                           gout e0, gout e1, gout e2, gout y, int N, int n_heads, int n_kv_heads,
                           int hd, EPI_ROWS_PARAMS) {
    FIX_HD(hd);
    int hh = hd / 2;
    bool rope = g < n_heads + n_kv_heads;
    float pos = (float)ROW_POS(t);
    float o[32];
    for (int i = 0; i < 32; i++) {
        int d = 32 * c + i;
        float x = vals[d * stride];
        if (rope) {
            bool low = d < hh;
            float partner = vals[(low ? d + hh : d - hh) * stride];
            float cs, sn = sincos(pos * ((__global const float*)e0)[low ? d : d - hh], &cs);
            x = low ? x * cs - partner * sn : x * cs + partner * sn;
        }
        o[i] = x;
    }
    if (g < n_heads) {
        __global float* q = (__global float*)y + ((size_t)t * n_heads + g) * hd + 32 * c;
        for (int i = 0; i < 32; i++) q[i] = o[i];
        return;
    }
    int kh = rope ? g - n_heads : g - n_heads - n_kv_heads, slot = ROW_SLOT(t);
    if (SLOT_IN_CACHE(slot)) store_kv_block(rope ? e1 : e2, ((size_t)slot * n_kv_heads + kh) * hd + 32 * c, o);
}
#elif defined(EPI_ROPE_KV) && defined(KV_BLOCKS)
// Q8_0 / q4_0 caches: thread c of a group finishes slots [32c, 32c + 32) of token t, which the slot
// rule makes one aligned 32-value block of one head (codegen checks RW % 64 == 0 and
// hd % 64 == 0): RoPE for q/k, then q rows stored as f32 and k/v as cache blocks.
inline void epilogue_chunk(int t, int g, int c, int RW, __local const float* vals, int stride,
                           gout e0, gout e1, gout e2, gout y, int N, int n_heads, int n_kv_heads,
                           int hd, EPI_ROWS_PARAMS) {
    FIX_HD(hd);
    int half_rw = RW / 2, hh = hd / 2, ppg = ROPE_PPG(RW, hh);   // QK_NORM: codegen keeps ppg == half_rw
    int pairs = (n_heads + n_kv_heads) * hh;
    int pair_groups = (pairs + ppg - 1) / ppg;
    int slot = ROW_SLOT(t);
    size_t kv_row = (size_t)slot * n_kv_heads * hd;           // element index of the cache row
    float o[32];
    gout cache;
    size_t first;                                              // element index of o[0]
    int r0 = 32 * c;
    if (g < pair_groups) {
        bool high = r0 >= half_rw;
        int p0 = g * ppg + r0 % half_rw;
        if (p0 >= pairs) return;
        int head = p0 / hh, j0 = p0 % hh;
        float pos = (float)ROW_POS(t);
        for (int i = 0; i < 32; i++) {
            int rl = r0 % half_rw + i;
            float x1 = vals[rl * stride], x2 = vals[(rl + half_rw) * stride];
            float ang = pos * ((__global const float*)e0)[j0 + i];
            float cs, sn = sincos(ang, &cs);
            o[i] = high ? x2 * cs + x1 * sn : x1 * cs - x2 * sn;
        }
        int j = j0 + (high ? hh : 0);
        if (head < n_heads) {
            __global float* q = (__global float*)y + (size_t)t * n_heads * hd + head * hd + j;
            for (int i = 0; i < 32; i++) q[i] = o[i];
            return;
        }
        cache = e1;
        first = kv_row + (size_t)(head - n_heads) * hd + j;
    } else {
        int row0 = (g - pair_groups) * RW + r0;
        if (row0 >= n_kv_heads * hd) return;
        for (int i = 0; i < 32; i++) o[i] = vals[(r0 + i) * stride];
        cache = e2;
        first = kv_row + row0;
    }
    if (SLOT_IN_CACHE(slot)) store_kv_block(cache, first, o);
}
#endif

#if defined(BIAS) || defined(QK_NORM)
#define PRE_EPILOGUE 1
#ifdef QK_NORM
#define LD_QKN(p, i) CAT(ld_, QKN_T)(p, i)
// slot of element d of local head lh of a group: a whole head in row order (ROPE_HEADS), or
// its RoPE pairs (element d of the first half at slot lh * hh + d, of the second RW / 2 on)
inline int qk_slot(int lh, int d, int RW, int hd) {
#ifdef ROPE_HEADS
    return d;
#else
    int hh = hd / 2;
    return d < hh ? lh * hh + d : RW / 2 + lh * hh + d - hh;
#endif
}
#endif

// The group's finished dot products vals [ntok][tstride] (slot r of token tt at tt * tstride +
// r) made what the epilogue takes: b added (BIAS), then each q / k head x / sqrt(mean(x^2) +
// eps) * w, w = qn or kn (QK_NORM). Every thread of the group calls these (barriers inside).
#ifdef BIAS
inline void add_bias(__local float* vals, int ntok, int tstride, int g, int RW, int lid, int nthreads,
                     int N, int n_heads, int n_kv_heads, int hd, gin bias) {
    for (int e = lid; e < ntok * RW; e += nthreads) {
        int tt = e / RW, r = e % RW;
        int row = slot_row(g, r, RW, N, n_heads, n_kv_heads, hd);
        if (row >= 0) vals[tt * tstride + r] += ((__global const float*)bias)[row];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#endif

#ifdef QK_NORM
// QK_PARTS threads sum a head's squares in parts, into part [ntok][QK_HPG][QK_PARTS], a thread
// per head adds them up into the first of its parts, then every value takes it
inline void qk_norm_vals(__local float* vals, int ntok, int tstride, int g, int RW, int lid, int nthreads,
                         int n_heads, int n_kv_heads, int hd, gin qn, gin kn, float qk_eps, __local float* part) {
#ifdef ROPE_HEADS
    int head0 = g;
#else
    int head0 = g * QK_HPG, pairs = (n_heads + n_kv_heads) * (hd / 2);
    if (g >= (pairs + QK_HPG * (hd / 2) - 1) / (QK_HPG * (hd / 2))) return;   // a group of v rows
#endif
    if (head0 >= n_heads + n_kv_heads) return;   // ROPE_HEADS: a v head (uniform in the group)
    for (int e = lid; e < ntok * QK_HPG * QK_PARTS; e += nthreads) {
        int q = e % QK_PARTS, lh = (e / QK_PARTS) % QK_HPG, tt = e / (QK_PARTS * QK_HPG);
        float ss = 0.0f;
        for (int d = q; d < hd; d += QK_PARTS) {
            float v = vals[tt * tstride + qk_slot(lh, d, RW, hd)];
            ss += v * v;
        }
        part[e] = ss;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = lid; e < ntok * QK_HPG; e += nthreads) {   // a head's rms into its first part
        float ss = 0.0f;
        for (int q = 0; q < QK_PARTS; q++) ss += part[e * QK_PARTS + q];
        part[e * QK_PARTS] = sqrt(ss / (float)hd + qk_eps);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = lid; e < ntok * QK_HPG * hd; e += nthreads) {
        int d = e % hd, lh = (e / hd) % QK_HPG, tt = e / (hd * QK_HPG);
        int head = head0 + lh;
        if (head >= n_heads + n_kv_heads) continue;
        __local float* v = vals + tt * tstride + qk_slot(lh, d, RW, hd);
        *v = *v / part[(tt * QK_HPG + lh) * QK_PARTS] * LD_QKN(head < n_heads ? qn : kn, d);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#endif

inline void pre_epilogue(__local float* vals, int ntok, int tstride, int g, int RW, int lid, int nthreads,
                         int N, int n_heads, int n_kv_heads, int hd, gin bias, gin qn, gin kn, float qk_eps,
                         __local float* part) {
    FIX_HD(hd);
#ifdef BIAS
    add_bias(vals, ntok, tstride, g, RW, lid, nthreads, N, n_heads, n_kv_heads, hd, bias);
#endif
#ifdef QK_NORM
    qk_norm_vals(vals, ntok, tstride, g, RW, lid, nthreads, n_heads, n_kv_heads, hd, qn, kn, qk_eps, part);
#endif
}
#endif

#ifdef QK_SPLIT
// The matvec's epilogue where a head's rows are split over QK_SPLIT groups (pairs as without norms,
// RW / 2 dividing hd / 2, so a pair group's slots are of one head): a v group finishes its rows
// as usual; a q / k group writes its dot products (bias added) into the head's row of scratch,
// f32 [M][heads][hd] after the tickets int [M][heads] (heads = n_heads + n_kv_heads; zero at
// load, and put back to zero), and takes the head's ticket; the group that takes the last one
// reads the whole head back into head [hd] and finishes it as a group of RW = hd would: norm,
// RoPE, q or the k cache. As split_merge (matmul.cl) does for split-K.
inline void qk_split_epilogue(int t, int g, int lid, int nthreads, __local float* out, int RW, gout e0, gout e1,
                              gout e2, gout y, int M, int N, int n_heads, int n_kv_heads, int hd,
                              EPI_ROWS_PARAMS, gin bias, gin qn, gin kn, float qk_eps, __local float* part,
                              __local float* head, __local int* last, gout scratch) {
    FIX_HD(hd);
    int hh = hd / 2, half_rw = RW / 2, heads = n_heads + n_kv_heads;
#ifdef BIAS
    add_bias(out, 1, RW, g, RW, lid, nthreads, N, n_heads, n_kv_heads, hd, bias);
#endif
    if (g >= heads * hh / half_rw) {   // a group of v rows
#ifdef KV_BLOCKS
        if (lid < RW / 32)
            epilogue_chunk(t, g, lid, RW, out, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd, EPI_ROWS_PASS);
#else
        for (int r = lid; r < RW; r += nthreads)
            epilogue(t, g, r, RW, out, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd, EPI_ROWS_PASS);
#endif
        return;
    }
    int h = g * half_rw / hh, j0 = g * half_rw % hh;   // the head, its first pair here
    __global volatile int* count = (__global volatile int*)scratch + (size_t)t * heads + h;
    __global volatile float* row = (__global volatile float*)(scratch + 4 * (size_t)M * heads) +
                                   ((size_t)t * heads + h) * hd;
    for (int r = lid; r < RW; r += nthreads) row[j0 + r % half_rw + (r < half_rw ? 0 : hh)] = out[r];
    DEVICE_FENCE();   // the values reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) *last = atomic_inc(count) == QK_SPLIT - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*last) return;
    DEVICE_FENCE();
    for (int d = lid; d < hd; d += nthreads) head[d] = row[d];   // past L1: other SMs wrote it
    if (lid == 0) *count = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    qk_norm_vals(head, 1, hd, h, hd, lid, nthreads, n_heads, n_kv_heads, hd, qn, kn, qk_eps, part);
#ifdef KV_BLOCKS
    if (lid < hd / 32)
        epilogue_chunk(t, h, lid, hd, head, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd, EPI_ROWS_PASS);
#else
    for (int r = lid; r < hd; r += nthreads)
        epilogue(t, h, r, hd, head, 1, e0, e1, e2, y, N, n_heads, n_kv_heads, hd, EPI_ROWS_PASS);
#endif
}
#endif
