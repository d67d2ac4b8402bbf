// matmul_tiled's register-staged tensor-core body (matmul.cl; NVIDIA sm_80+, -DUSE_NV_MMA, or
// emulated): q4_0 / q4_1 / q8_0 weights, and f16 weights on 64-row tiles; the same grid, slots
// and epilogue as the fp32 body. A stage holds STAGE_K values of K for the tile's TM tokens and
// TN weight rows in local memory as 32-bit words, row-major with a padded stride:
//   xq [TM][MMA_ROW_W]  activations: Q8_0 codes (4 per word) | f16 (2 per word), as stage_x wrote them
//   wq [TN][MMA_ROW_W]  weights:     q4_0/q4_1/q8_0 codes as int8  | f16 as stored
// A stage is 4 chunks of 8 words. Quantized: a chunk is one Q8_0 block (32 values) and one
// m16n8k32 s8 MMA per 16x8 sub-tile, whose exact int32 sum is scaled by d_x * d_w, as GGML;
// q4_1 (codes 0..15, Q8_1 activations) adds m_w * s_x per block.
// f16: a chunk is 16 values, one m16n8k16 MMA with f32 accumulation (x rounded to f16).
// Paired layout: each chunk's 8 words are stored in the order 0 4 1 5 2 6 3 7, so the two
// registers a lane takes from a row (words tq and tq + 4) are one 8-byte local load, and the row
// stride is 40 words (a half-warp's 8-byte loads of rows gq = 0..3 cover the 32 banks once);
// block scales sit chunk-major ([4][TN], [4][TM]) so a lane's two slot scales (2 tq, 2 tq + 1)
// are one 8-byte load too (the unpaired layout, 4-byte loads: neutral, H100 round 10).
#if defined(MMA_BODY) && !defined(MMA_ASYNC_BODY)
#define MMA_ROW_W 40
#define SC_W(n, c) ((c) * TN + (n))
#define SC_X(t, c) ((c) * TM + (t))
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
#else
#define EMU_SC_ARG 0
#endif

// a chunk's 8 words (lo = words 0..3, hi = 4..7) into local memory, in the paired order.
// A 16-byte store is served 8 lanes at a time; the callers' 8 lanes are 2 rows x 4 chunks, and
// rows 40 words apart put both rows' first halves on the same 16 banks. Odd rows store their
// second half first (rot), so each store's 8 lanes cover the 32 banks once: one wavefront, not
// two (H200 1B f16 prefill 10.20 -> 8.35 ms with the f16 stores of put_w, round 11).
inline void put_chunk(__local uint* dst, uint4 lo, uint4 hi, int rot) {
    uint4 a = (uint4)(lo.x, hi.x, lo.y, hi.y), b = (uint4)(lo.z, hi.z, lo.w, hi.w);
    *(__local uint4*)(dst + 4 * rot) = rot ? b : a;
    *(__local uint4*)(dst + 4 - 4 * rot) = rot ? a : b;
}

// v of lane (lane ^ o); emulated through put_w's scratch sc (every thread calls it)
#ifdef EMU_MMA
#define SHFL_XOR_U(v, o) emu_shfl_xor_u(v, o, sc)
#else
#define SHFL_XOR_U(v, o) shfl_xor_u(v, o)
#endif


// A stage is fetched into registers (fetch_x, fetch_w) and written to local memory (put_x,
// put_w). f16 weights fetch both operands one stage ahead, during the previous stage's MMAs, so
// global latency hides behind tensor-core work (H200 1B prefill 8.14 ms; x alone 8.74, w alone
// 8.62, neither 9.05, round 11); quantized weights fetch neither (a stage ahead: 12.36 ms of
// kernels against 10.6, H100 round 10: the registers that hold it cost occupancy).
#ifdef W_F16
#define MMA_PREFETCH 1
#endif

// Activations as stage_x wrote them: thread e owns 32 bytes of token e / 4's stage row, part
// e % 4 (quantized: block e % 4, its codes and d, q4_1 also s; f16: values 16 (e % 4) ..), as
// fetch_w owns weight blocks: two 16-byte loads.
#define X_PART_VALUES (STAGE_K / 4)
typedef struct { uint4 q[2]; float d, s; } x_stage;

inline void fetch_x(gin sb, int t0, int rows, int M, int K, int k0, int lid, x_stage* r) {
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

inline void put_x(const x_stage* r, int lid, __local uint* xq, __local float* xd) {
    int tt = lid >> 2, part = lid & 3;
    put_chunk(xq + tt * MMA_ROW_W + part * 8, r->q[0], r->q[1], tt & 1);
#ifdef X_STAGED_Q
    xd[SC_X(tt, part)] = r->d;
#ifdef W_Q4_1
    xd[TM * 4 + SC_X(tt, part)] = r->s;
#endif
#endif
}

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
#if defined(W_Q4_0) || defined(W_Q4_1)
        uint4 p = r->q[i];                   // byte j: value j (low nibble), j + 16 (high)
        uint8 q;
        q.lo = Q4_S8(p & 0x0F0F0F0Fu);
        q.hi = Q4_S8((p >> 4) & 0x0F0F0F0Fu);
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
#else
        // unit e % 8 is words 0..3 (even units: lo) or 4..7 (odd: hi) of chunk (e % 8) / 2; the
        // lane pair swaps halves by shuffles so that the even lane stores paired words 0..3
        // (lo.x hi.x lo.y hi.y) and the odd lane 4..7 (lo.z hi.z lo.w hi.w): one 16-byte store
        // each, a row's 8 lanes on distinct banks (scalar stores 2 words apart: 4-way conflicts)
        int odd = e & 1;
        uint4 u = r->u[i];
        uint g0 = SHFL_XOR_U(odd ? u.x : u.z, 1), g1 = SHFL_XOR_U(odd ? u.y : u.w, 1);
        *(__local uint4*)(wq + (e >> 3) * MMA_ROW_W + ((e & 7) >> 1) * 8 + 4 * odd) =
            odd ? (uint4)(g0, u.z, g1, u.w) : (uint4)(u.x, g0, u.y, g1);
#endif
    }
}

MATMUL_TILED_BEGIN
    size_t nblk = (size_t)N * (K / 32);
    // 16-byte aligned: chunks are stored, fragments and scale pairs loaded, as whole vectors
    __local uint lds[MMA_LDS_WORDS] __attribute__((aligned(16)));   // xq, wq; at the end out [TM][TN]
    __local uint* xq = lds;                  // [TM][MMA_ROW_W]
    __local uint* wq = lds + TM * MMA_ROW_W; // [TN][MMA_ROW_W]
    __local float xd[TM * 4 * MMA_HDR] __attribute__((aligned(16)));   // block scales of the
    __local float wd[TN * 4 * MMA_HDR] __attribute__((aligned(16)));   // stage (chunk-major, SC_X /
                                             // SC_W); q4_1: then s_x, m_w in the same layout
#ifdef EMU_MMA
    __local uint emu_sc[EMU_SC_WORDS];
#endif
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);

    TILE_LOOP_BEGIN
    barrier(CLK_LOCAL_MEM_FENCE);

    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int wm = (warp / MMA_WARPS_N) * 32, wn = (warp % MMA_WARPS_N) * MMA_WN;
    float acc[2][MMA_NT][4] = {{{0.0f}}};   // warp tile: 2 x 16 tokens, MMA_NT x 8 slots

    x_stage xr;
    w_stage wr;
#ifdef MMA_PREFETCH
    fetch_x(sb, t0, rows, M, K, kb, lid, &xr);
    fetch_w(w, K, kb, lid, nblk, rowmap, &wr);
#endif
    for (int k0 = kb; k0 < ke; k0 += STAGE_K) {
#ifndef MMA_PREFETCH
        fetch_x(sb, t0, rows, M, K, k0, lid, &xr);
        fetch_w(w, K, k0, lid, nblk, rowmap, &wr);
#endif
        put_x(&xr, lid, xq, xd);
        put_w(&wr, lid, wq, wd, EMU_SC_ARG);
        barrier(CLK_LOCAL_MEM_FENCE);
#ifdef MMA_PREFETCH
        if (k0 + STAGE_K < ke) {   // the next stage's loads fly during this stage's MMAs
            fetch_x(sb, t0, rows, M, K, k0 + STAGE_K, lid, &xr);
            fetch_w(w, K, k0 + STAGE_K, lid, nblk, rowmap, &wr);
        }
#endif
#pragma unroll
        for (int c = 0; c < 4; c++) {
            uint a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                __local const uint* p = xq + (wm + 16 * mi + gq) * MMA_ROW_W + 8 * c + 2 * tq;
                uint2 r0 = *(__local const uint2*)p, r8 = *(__local const uint2*)(p + 8 * MMA_ROW_W);
                a[mi][0] = r0.x;
                a[mi][1] = r8.x;
                a[mi][2] = r0.y;
                a[mi][3] = r8.y;
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
                uint2 bb = *(__local const uint2*)(wq + (wn + 8 * ni + gq) * MMA_ROW_W + 8 * c + 2 * tq);
                uint b0 = bb.x, b1 = bb.y;
#ifdef W_QUANT
                float2 sw = *(__local const float2*)(wd + SC_W(wn + 8 * ni + 2 * tq, c));
                float sw0 = sw.x, sw1 = sw.y;
#ifdef W_Q4_1
                float2 mw = *(__local const float2*)(wd + TN * 4 + SC_W(wn + 8 * ni + 2 * tq, c));
                float mw0 = mw.x, mw1 = mw.y;
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
#endif  // MMA_BODY && !MMA_ASYNC_BODY
