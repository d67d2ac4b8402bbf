// Shared by matvec.cl and matmul.cl (prepended by codegen): weight blocks, slot rows, epilogues
// of fused_matmul as compiler/ir.py defines it; y = epilogue(prologue(x) @ w.T).
//   -DW_T=<q4_0|q8_0|f16|bf16|f32> and -DW_<T>   weight element type
//   -DPROLOGUE_RMS -DNORM_T=<f32|f16|bf16>        x is RMS-normalised first (norm_w[K], eps)
//   -DEPI_ADD | -DEPI_SILU_MUL | -DEPI_ROPE_KV     epilogue (none: plain y)
//   -DKV_T=<f32|f16>                               cache element type (EPI_ROPE_KV)
//   -DMV_WG, -DMV_ROWS                             matvec work-group size and rows per group
// Quantized weights multiply Q8_0-quantized activations block by block; a block's dot product
// of integers is exact in f32 (|sum| <= 32*127*128 < 2^24), then scaled by d_x * d_w, as GGML.
//
// Every group of a launch owns RW "slots"; slot_row() maps a slot to the weight row it computes.
// Pair epilogues put a row and its partner in the same group: silu_mul pairs gate row u with
// up row F + u; rope pairs row j of a q/k head with row j + hd/2. Arguments of every kernel:
//   x      f32 [M, K]                 activations (row t of the step)
//   w      W_T [N, K]                 weight rows (HF layout)
//   nw     NORM_T [K]                 norm weight (PROLOGUE_RMS)
//   e0     f32 [M, N] residual (EPI_ADD) | f32 [hd/2] inv_freq (EPI_ROPE_KV)
//   e1,e2  KV_T [S, KVH, hd]          k and v caches (EPI_ROPE_KV), rows n_past + t
//   y      f32 [M, N] | [M, N/2] (EPI_SILU_MUL) | q_roped [M, H*hd] (EPI_ROPE_KV)

#if defined(W_Q4_0)
#define W_BLOCK_BYTES 18
#define W_QUANT 1
inline float wblock_dot(gin blk, float16 x0, float16 x1) {
    uchar16 q = vload16(0, blk + 2);
    float16 lo = convert_float16(q & (uchar16)15) - 8.0f;
    float16 hi = convert_float16(q >> (uchar16)4) - 8.0f;
    return hsum16(lo * x0 + hi * x1);
}
inline float wblock_elem(gin blk, int k) {
    uchar q = blk[2 + (k & 15)];
    return (float)((k < 16 ? (q & 15) : (q >> 4)) - 8);
}
inline float wblock_scale(gin blk) { return vload_half(0, (__global const half*)blk); }
#elif defined(W_Q8_0)
#define W_BLOCK_BYTES 34
#define W_QUANT 1
inline float wblock_dot(gin blk, float16 x0, float16 x1) {
    __global const char* q = (__global const char*)(blk + 2);
    return hsum16(convert_float16(vload16(0, q)) * x0 + convert_float16(vload16(1, q)) * x1);
}
inline float wblock_elem(gin blk, int k) { return (float)((__global const char*)(blk + 2))[k]; }
inline float wblock_scale(gin blk) { return vload_half(0, (__global const half*)blk); }
#elif defined(W_F16)
#define W_BLOCK_BYTES 64
inline float wblock_dot(gin blk, float16 x0, float16 x1) {
    return hsum16(ld16_f16(blk, 0) * x0 + ld16_f16(blk, 1) * x1);
}
inline float wblock_elem(gin blk, int k) { return ld_f16(blk, k); }
#elif defined(W_BF16)
#define W_BLOCK_BYTES 64
inline float wblock_dot(gin blk, float16 x0, float16 x1) {
    return hsum16(ld16_bf16(blk, 0) * x0 + ld16_bf16(blk, 1) * x1);
}
inline float wblock_elem(gin blk, int k) { return ld_bf16(blk, k); }
#else  // W_F32
#define W_BLOCK_BYTES 128
inline float wblock_dot(gin blk, float16 x0, float16 x1) {
    return hsum16(ld16_f32(blk, 0) * x0 + ld16_f32(blk, 1) * x1);
}
inline float wblock_elem(gin blk, int k) { return ld_f32(blk, k); }
#endif

#ifdef PROLOGUE_RMS
#define LD16_NORM(p, i16) CAT(ld16_, NORM_T)(p, i16)
#define LD_NORM(p, i) CAT(ld_, NORM_T)(p, i)
#endif
#ifdef EPI_ROPE_KV
#define ST_KV(p, i, v) CAT(st_, KV_T)(p, i, v)
#endif

// Groups of a launch over the rows (the host sizes the grid with the same rule).
inline int slot_row(int g, int r, int RW, int N, int n_heads, int n_kv_heads, int hd) {
#if defined(EPI_SILU_MUL)
    int half_rw = RW / 2, u = g * half_rw + (r % half_rw);
    if (u >= N / 2) return -1;
    return r < half_rw ? u : N / 2 + u;
#elif defined(EPI_ROPE_KV)
    int half_rw = RW / 2, hh = hd / 2;
    int pairs = (n_heads + n_kv_heads) * hh;
    int pair_groups = (pairs + half_rw - 1) / half_rw;
    if (g < pair_groups) {
        int p = g * half_rw + (r % half_rw);
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
                     int hd, int n_past, int start_pos) {
#if defined(EPI_SILU_MUL)
    int half_rw = RW / 2, F = N / 2, u = g * half_rw + r;
    if (r >= half_rw || u >= F) return;
    float gate = vals[r * stride], up = vals[(r + half_rw) * stride];
    ((__global float*)y)[(size_t)t * F + u] = gate / (1.0f + exp(-gate)) * up;
#elif defined(EPI_ROPE_KV)
    int half_rw = RW / 2, hh = hd / 2;
    int pairs = (n_heads + n_kv_heads) * hh;
    int pair_groups = (pairs + half_rw - 1) / half_rw;
    size_t kv_row = (size_t)(n_past + t) * n_kv_heads * hd;
    if (g < pair_groups) {
        int p = g * half_rw + r;
        if (r >= half_rw || p >= pairs) return;
        int head = p / hh, j = p % hh;
        float x1 = vals[r * stride], x2 = vals[(r + half_rw) * stride];
        float ang = (float)(start_pos + t) * ((__global const float*)e0)[j];
        float c = cos(ang), s = sin(ang);
        float o1 = x1 * c - x2 * s, o2 = x2 * c + x1 * s;
        if (head < n_heads) {
            __global float* q = (__global float*)y + (size_t)t * n_heads * hd + head * hd;
            q[j] = o1;
            q[j + hh] = o2;
        } else {
            size_t base = kv_row + (head - n_heads) * hd;
            ST_KV(e1, base + j, o1);
            ST_KV(e1, base + j + hh, o2);
        }
    } else {
        int row = (g - pair_groups) * RW + r;
        if (row < n_kv_heads * hd) ST_KV(e2, kv_row + row, vals[r * stride]);
    }
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

