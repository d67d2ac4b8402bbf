// Decode matvec; weight access, slot_row() and the epilogues come from matmul_common.cl.
//   -DMV_WG=<threads, a multiple of 32>   -DMV_ROWS=<weight rows (slots) per group, a multiple
//   of MV_WG / 32 / MV_SPLIT>   -DMV_K=<K, a multiple of 32>   -DMV_LOADS=<16-byte loads in flight
//   per lane>   -DMV_SPLIT=<warps sharing each row's K, a power of 2 dividing MV_WG / 32>
//
// One token per group row (grid dim 1 = tokens), MV_ROWS weight rows per group, MV_RPW of them
// per warp (32 threads). Split-K (MV_SPLIT > 1, for narrow N, so that a launch still has enough
// warps to keep DRAM busy): warp w works on the rows of row set w / MV_SPLIT over K slice
// s = w % MV_SPLIT, i.e. on units (p * MV_SPLIT + s) * 32 + lane of pass p; the slices' warp
// sums meet in local memory inside the group, so the epilogues see whole dot products and no
// extra launch or scratch is needed. Two phases:
//   1. the group prepares x once: the RMS prologue's sum of squares, then (quantized weights)
//      x's Q8_0 blocks (q4_1: Q8_1) into local memory, one block per thread (NVIDIA: 8 lanes
//      a block, quantize_x_lanes); float weights issue their first weight batch before it;
//   2. each warp walks its rows along K: lane l reads blocks (units) l, l + 32, ... so a warp
//      reads 512 consecutive bytes of one row per load; MV_UNROLL passes of all MV_RPW rows
//      issue their loads before any is used, so DRAM latency is paid once per batch. Each
//      row's partial sums meet in a warp reduction; no barrier inside the K loop.
// Float weights read x straight from global memory (every warp reads the same bytes, so they
// come from the cache), normalised on the fly. With -DMV_RMS_LATE (float weights with the RMS
// prologue) nothing is prepared: dot(w, x / rms * nw) = dot(w, x * nw) / rms, so each warp
// sums x's squares over the units it reads anyway (a row set's MV_SPLIT slices cover K once)
// and scales its dot products at the end: no group barrier before the first weight load.
// -DMV_TOKS=<T> (a step graph's generated rows, ROW_SPLIT): T consecutive token rows a group,
// so each weight batch is loaded once and dotted with all T tokens' x (x quantized per token into
// local memory). Every token runs the same operations in the same order as it would alone (its
// own RMS sum, dot products, reductions and epilogue; nothing summed across tokens), so a row's
// bits do not depend on the rows sharing its group. Slots past the step's last row read row t0
// and write nothing.
// Grid: (groups * MV_WG, ceil(rows of x / MV_TOKS)); -DMV_TOKS_INNER walks it token-fastest.
// -DMV_MMA (a step graph's generated rows, quantized or f16 weights; MV_TOKS = 16): each weight
// block is read once for the group's 16 token rows and multiplied on tensor cores. Quantized: an
// m16n8k32 s8 MMA per block and 8 rows (the exact int32 block sums scaled by d_x * d_w, as the
// T = 1 path scales each block's dot product); x comes as Q8_0 codes from stage_x (matmul.cl,
// -DSTAGE_REST), which prepares it once for the launch, so no group repeats the RMS prologue or
// the quantization; or, with -DMV_MMA_LX, each lane quantizes its own values of x as stage_x does
// (the group's RMS sums first), with no launch before. f16: two m16n8k16 f16 MMAs a block, summed in f32, of x rounded to f16 (as
// the prefill matmul's tensor-core body takes it), which each lane reads and rounds itself.
// Warp w takes the MV_RPW rows of row set w / MV_SPLIT over K slice w % MV_SPLIT (blocks s,
// s + MV_SPLIT, ...); the slices meet in local memory in slice order. A (token, row)'s sum thus
// runs in one fixed order whatever the other rows of its group: its bits do not depend on them.
// Without tensor cores (or with their emulation) each lane computes its four int32 sums
// directly: the same integers, so the same bits (f16: f32 sums, in the device's own order).
// -DMV_SX (a step graph's generated rows, quantized weights, MV_TOKS > 1): x's Q8_0 blocks come
// from matvec_stage (-DMV_SX_STAGE), a launch before that runs the one-token group's own prologue
// (RMS sum, then quantize_x / quantize_x_lanes) once a row. So no group repeats it for its
// MV_TOKS rows or holds their copies in local memory; the K loop reads the blocks from global
// memory (L1 / L2: every group reads the same bytes). Each (token, row) runs the T = 1 matvec's
// operations in its order (rows a warp and threads a group change no row's sums; K slices
// would), so a row's bits equal the one-token matvec's: a plan runs this variant for steps with
// many generated rows and the one-token one for the others, and a row's logits do not depend on
// which ran.

#ifndef MV_WG
#define MV_WG 256
#endif
#ifndef MV_ROWS
#define MV_ROWS 8
#endif
#ifndef MV_SPLIT
#define MV_SPLIT 1
#endif
#ifndef MV_TOKS
#define MV_TOKS 1
#endif
// the token loops with barriers inside: unrolled where warp shuffles keep acc[token] in registers;
// elsewhere (PoCL) a loop, as 16 copies of their barrier regions took PoCL minutes to compile
#ifdef USE_NV_PTX
#define MV_TOK_LOOP _Pragma("unroll")
#else
#define MV_TOK_LOOP _Pragma("unroll 1")
#endif
#if MV_TOKS > 1 && (defined(QK_SPLIT) || defined(ROPE_HEADS))
#error "MV_TOKS > 1: QK_SPLIT and ROPE_HEADS take one token a group"
#endif
#if defined(MV_SX) && (MV_TOKS < 2 || !defined(W_QUANT) || defined(MV_MMA))
#error "MV_SX: a step's generated rows, several a group, quantized weights"
#endif
#if defined(MV_MMA) && (MV_TOKS != 16 || !(defined(W_QUANT) || defined(W_F16)) || \
                        (MV_ROWS * MV_SPLIT / (MV_WG / 32)) % 8 || MV_K % 32)
#error "MV_MMA: 16 token rows a group, quantized or f16 weights, rows a warp a multiple of 8"
#endif
#define MV_WARPS (MV_WG / 32)
#define MV_RPW (MV_ROWS * MV_SPLIT / MV_WARPS)      // rows per warp
#if defined(PROLOGUE_RMS) && defined(MV_RMS_LATE) && !defined(W_QUANT) && !defined(MV_MMA)
#define MV_LATE 1                                   // rms applied after the K loop
#else
#define MV_LATE 0
#endif
#define MV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define MV_MAX(a, b) ((a) > (b) ? (a) : (b))
#ifdef W_QUANT
#define MV_UNITS (MV_K / 32)                        // 32-value blocks per row
#else
#define MV_UNITS (MV_K / 8)                         // 8-value (16-byte) units per row
#endif
#define MV_PASSES ((MV_UNITS + 32 * MV_SPLIT - 1) / (32 * MV_SPLIT))   // K steps of one warp
#ifndef MV_LOADS
#define MV_LOADS 8                                  // 16-byte weight loads in flight per lane
#endif
// passes whose loads are in flight together
#define MV_UNROLL MV_MIN(MV_PASSES, MV_MAX(1, MV_LOADS / MV_RPW))

// the RMS prologue's sqrt(mean(x^2) + eps) of one token row, summed in the group's order (its
// MV_WG threads, then group_sum): matvec_stage repeats it for MV_SX by calling it with the same
// MV_WG, so the two agree to the bit
inline float mv_rms(__global const float4* x4, __local float* red, float eps) {
    float ss = 0.0f;
    for (int i = get_local_id(0); i < MV_K / 4; i += MV_WG) {
        float4 v = x4[i];
        ss += dot(v, v);
    }
    return sqrt(group_sum(ss, red) / (float)MV_K + eps);
}

#ifdef W_QUANT
#ifdef W_Q4_1
#define XS_T float    // Q8_1's s = d * sum(q), d before its f16 rounding, kept as f16
#define X_SUM(d, sum) round_to_half((d) * (sum))
#else
#define XS_T int      // sum(q), for q4_0's -8 offset
#define X_SUM(d, sum) ((int)(sum))
#endif
// x's block b (after the RMS prologue: x / rms * nw) quantized to Q8_0 as quantize_row_q8_0_ref:
// d = amax / 127 (kept as f16), q = round(x / d) half away from zero; codes[8] by words (word i:
// values 4 i .. 4 i + 3), d and the block's X_SUM (q4_1's s)
inline void quantize_block(__global const float4* x4, gin nw, int b, float rms, uint* codes, float* d, float* s) {
    float4 v[8];
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) {
        v[i] = x4[8 * b + i];
#ifdef PROLOGUE_RMS
        v[i] = v[i] / rms * LD4_NORM(nw, 8 * b + i);
#endif
        float4 a = fabs(v[i]);
        amax = fmax(amax, fmax(fmax(a.x, a.y), fmax(a.z, a.w)));
    }
    float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f, sum = 0.0f;
    for (int i = 0; i < 8; i++) {
        float4 q = round(v[i] * id);
        sum += (q.x + q.y) + (q.z + q.w);
        codes[i] = as_uint(convert_char4(q));
    }
    *d = round_to_half(dd);
    *s = X_SUM(dd, sum);
}

// the same, into local memory
inline void quantize_x(__global const float4* x4, int b, __local int4* xq, __local float* xd,
                       __local XS_T* xs
#ifdef PROLOGUE_RMS
                       , gin nw, float rms
#endif
                       ) {
#ifndef PROLOGUE_RMS
    gin nw = 0;
    float rms = 1.0f;
#endif
    uint c[8];
    float d, sx;
    quantize_block(x4, nw, b, rms, c, &d, &sx);
    xq[2 * b] = as_int4((uint4)(c[0], c[1], c[2], c[3]));
    xq[2 * b + 1] = as_int4((uint4)(c[4], c[5], c[6], c[7]));
    xd[b] = d;
    xs[b] = (XS_T)sx;
}

#ifdef USE_NV_PTX
#define MV_X_LANES 1
// The same Q8_0 blocks, 8 lanes to a block (a float4 each): the block's amax and code sum meet by
// butterfly shuffles within the 8 lanes, so every thread of the group works on x, not one in 8
// as in quantize_x (H200 1B q4_0 decode 1322 -> 1500 tok/s, round 12). Integer code sums are
// exact in any order, so the bytes equal quantize_x's. Whole warps loop (the shuffles need all 32 lanes); K / 4 is a
// multiple of 8, so a block's 8 lanes are all in or all out.
inline float oct_max(float v) {
    for (int o = 4; o > 0; o >>= 1) v = fmax(v, shfl_xor_f(v, o));
    return v;
}
inline float oct_sum(float v) {
    for (int o = 4; o > 0; o >>= 1) v += shfl_xor_f(v, o);
    return v;
}
inline void quantize_x_lanes(__global const float4* x4, __local int* xq, __local float* xd,
                             __local XS_T* xs
#ifdef PROLOGUE_RMS
                             , gin nw, float rms
#endif
                             ) {
    int lid = get_local_id(0), lane = lid & 31;
    for (int base = lid - lane; base < MV_K / 4; base += MV_WG) {
        int i = base + lane;             // this lane's float4 of x: block i / 8
        int live = i < MV_K / 4;
        float4 v = live ? x4[i] : (float4)(0.0f);
#ifdef PROLOGUE_RMS
        if (live) v = v / rms * LD4_NORM(nw, i);
#endif
        float4 a = fabs(v);
        float amax = oct_max(fmax(fmax(a.x, a.y), fmax(a.z, a.w)));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        float4 q = round(v * id);
        float sum = oct_sum((q.x + q.y) + (q.z + q.w));
        if (live) {
            xq[i] = as_int(convert_char4(q));
            if ((i & 7) == 0) {
                xd[i >> 3] = round_to_half(d);
                xs[i >> 3] = X_SUM(d, sum);
            }
        }
    }
}
#endif
#endif

#ifdef MV_MMA
#define MV_NT (MV_RPW / 8)                          // 8-row MMA columns a warp
#define MV_MB (MV_K / 32)                           // 32-value blocks a row: an s8 m16n8k32, or
                                                    // two f16 m16n8k16, a block and 8 rows
#ifdef EMU_MMA
#define MV_EMU_PARAM , __local uint* emu_sc
#define MV_EMU_ARG , emu_sc
#else
#define MV_EMU_PARAM
#define MV_EMU_ARG
#endif

// A warp's weight rows: of its 8-row column j, B's column gq is slot 8 j + gq, C's columns are
// 2 tq and 2 tq + 1 (padding slots read row 0, never stored); its accumulators zeroed
inline void mv_mma_rows(int g, int rset, int gq, int tq, int N, int n_heads, int n_kv_heads, int hd,
                        int* wrow, int (*crow)[2], float (*acc)[4]) {
#pragma unroll
    for (int j = 0; j < MV_NT; j++) {
        int s0 = rset * MV_RPW + 8 * j;
        wrow[j] = max(slot_row(g, s0 + gq, MV_ROWS, N, n_heads, n_kv_heads, hd), 0);
        crow[j][0] = max(slot_row(g, s0 + 2 * tq, MV_ROWS, N, n_heads, n_kv_heads, hd), 0);
        crow[j][1] = max(slot_row(g, s0 + 2 * tq + 1, MV_ROWS, N, n_heads, n_kv_heads, hd), 0);
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;
    }
}

// The warp's C fragments into its K slice's sums, part [MV_SPLIT][16][MV_ROWS] (by token, slot)
inline void mv_mma_parts(float (*acc)[4], __local float* part, int rset, int split, int gq, int tq) {
    __local float* p = part + split * MV_TOKS * MV_ROWS;
#pragma unroll
    for (int j = 0; j < MV_NT; j++) {
        int s0 = rset * MV_RPW + 8 * j + 2 * tq;
        p[gq * MV_ROWS + s0] = acc[j][0];
        p[gq * MV_ROWS + s0 + 1] = acc[j][1];
        p[(gq + 8) * MV_ROWS + s0] = acc[j][2];
        p[(gq + 8) * MV_ROWS + s0 + 1] = acc[j][3];
    }
}

// The K slices' sums, in slice order, into out_all [16][MV_ROWS] (after part); each token's
// divided by its rms where one is given (the RMS prologue applied late)
inline void mv_mma_fold(__local const float* part, __local float* out_all, __local const float* rms, int lid) {
    for (int e = lid; e < MV_TOKS * MV_ROWS; e += MV_WG) {
        float s = part[e];
        for (int k = 1; k < MV_SPLIT; k++) s += part[k * MV_TOKS * MV_ROWS + e];
        out_all[e] = rms ? s / rms[e / MV_ROWS] : s;
    }
}
#endif

#if defined(MV_MMA) && defined(W_QUANT)
#ifdef W_Q8_0
#define MV_W_WORDS 2                                // a lane's words of a row's block
#else
#define MV_W_WORDS 1
#endif

// A block's B fragment (k = 4 tq .. and 16 + 4 tq ..) from a lane's words of it: q4_0's byte j
// holds value j (low nibble) and j + 16 (high), so word tq gives both halves; codes as s8
inline void mv_b_frag(const uint* wv, uint* b0, uint* b1) {
#if defined(W_Q8_0)
    *b0 = wv[0];
    *b1 = wv[1];
#else
    *b0 = Q4_S8(wv[0] & 0x0F0F0F0Fu);
    *b1 = Q4_S8((wv[0] >> 4) & 0x0F0F0F0Fu);
#endif
}

#ifndef USE_NV_MMA
// without tensor cores: the int32 sum of one token's block codes xw[8] and one row's block ww
// (the MMA's element, exact in any order)
inline int mv_block_isum(const uint* xw, __global const uint* ww) {
    int s = 0;
    for (int q = 0; q < 4; q++) {
        uint wv[2] = {ww[q], MV_W_WORDS > 1 ? ww[4 + q] : 0u}, b0, b1;
        mv_b_frag(wv, &b0, &b1);
        s = dot4_ss((int)b0, (int)xw[q], s);
        s = dot4_ss((int)b1, (int)xw[4 + q], s);
    }
    return s;
}
#endif

// block b of the warp's weight rows: lane tq's words of its B rows (wrow) and the d_w of its C
// rows (crow), all loads issued before any is used
inline void mv_q_load(gin w, int b, int tq, const int* wrow, int (*crow)[2], size_t nblk, uint (*wv)[MV_W_WORDS],
                      WS_T (*dw)[2]) {
#pragma unroll
    for (int j = 0; j < MV_NT; j++) {
        __global const uint* ww = (__global const uint*)w + ((size_t)wrow[j] * MV_UNITS + b) * (W_QBYTES / 4);
        wv[j][0] = ww[tq];
#if MV_W_WORDS > 1
        wv[j][1] = ww[4 + tq];
#endif
        dw[j][0] = wheader(w, (size_t)crow[j][0] * MV_UNITS + b, nblk);
        dw[j][1] = wheader(w, (size_t)crow[j][1] * MV_UNITS + b, nblk);
    }
}

// a block's four int32 sums c (tokens a, a, b, b by rows 0, 1, 0, 1 of the lane's C fragment)
// into the lane's accumulators, scaled by the tokens' d_x and the rows' d_w (q4_1: plus m_w s_x)
inline void mv_q_acc(float* acc, const int* c, float dxa, float dxb, float sxa, float sxb, WS_T dw0, WS_T dw1) {
#ifdef W_Q4_1
    acc[0] += small_int_to_float(c[0]) * (dxa * dw0.x) + dw0.y * sxa;
    acc[1] += small_int_to_float(c[1]) * (dxa * dw1.x) + dw1.y * sxa;
    acc[2] += small_int_to_float(c[2]) * (dxb * dw0.x) + dw0.y * sxb;
    acc[3] += small_int_to_float(c[3]) * (dxb * dw1.x) + dw1.y * sxb;
#else
    acc[0] += small_int_to_float(c[0]) * (dxa * dw0);
    acc[1] += small_int_to_float(c[1]) * (dxa * dw1);
    acc[2] += small_int_to_float(c[2]) * (dxb * dw0);
    acc[3] += small_int_to_float(c[3]) * (dxb * dw1);
#endif
}
#endif

#if defined(MV_MMA) && defined(W_QUANT) && !defined(MV_MMA_LX)
#ifndef MV_MMA_KC
#define MV_MMA_KC MV_K                              // K values a chunk (codegen: a divisor of K)
#endif
#define MV_KCB (MV_MMA_KC / 32)                     // blocks a chunk
#define MV_BPW ((MV_KCB + MV_SPLIT - 1) / MV_SPLIT) // a warp's blocks of a chunk, consecutive
#define MV_XW (MV_MMA_KC / 4 + 4)                   // a staged token's words: the chunk's codes, then
                                                    // 4 more, so the A loads of 8 tokens x 4 lanes
                                                    // fall on 32 different banks
#ifdef W_Q4_1
#define MV_XHDR 2                                   // d, and Q8_1's s
#else
#define MV_XHDR 1
#endif
// local words: the chunk's x for 16 tokens, or after the K loop the slices' sums and out_all
#define MV_STAGE_WORDS (16 * MV_XW + 16 * MV_KCB * MV_XHDR)
#define MV_SUM_WORDS ((MV_SPLIT + 1) * MV_TOKS * MV_ROWS)
#define MV_MMA_LDS MV_MAX(MV_STAGE_WORDS, MV_SUM_WORDS)

// The group's 16 token rows (from t0; nt valid) times its weight rows, into out_all [16][MV_ROWS]
// = lds + MV_SPLIT * 16 * MV_ROWS. sx: stage_x's output for the step's M rows: codes int8 [M][K],
// then d f32 [M][K / 32] (then q4_1's s f32 [M][K / 32]). K in chunks of MV_MMA_KC: each warp
// first asks for its weights of the chunk (all of them in flight at once), then the group copies
// the chunk of x into local memory (16-byte loads), then the warp's MMAs read A from there.
inline void mv_mma_sums(gin sx, gin w, int M, int N, int g, int t0, int nt, int lid, int rset, int split,
                        int n_heads, int n_kv_heads, int hd, __local uint* lds MV_EMU_PARAM) {
    int lane = lid & 31, gq = lane >> 2, tq = lane & 3;
    size_t nblk = (size_t)N * MV_UNITS;
    __local uint* xc = lds;                                   // [16][MV_XW] codes
    __local float* xd = (__local float*)(lds + 16 * MV_XW);   // [16][MV_KCB] scales (q4_1: then s)
    __global const float* sd = (__global const float*)(sx + (size_t)M * MV_K);
    int ra = gq < nt ? gq : 0, rb = gq + 8 < nt ? gq + 8 : 0;   // A rows; past nt the first (never stored)
    int wrow[MV_NT], crow[MV_NT][2];
    float acc[MV_NT][4];
    mv_mma_rows(g, rset, gq, tq, N, n_heads, n_kv_heads, hd, wrow, crow, acc);
    for (int c0 = 0; c0 < MV_UNITS; c0 += MV_KCB) {
        uint wv[MV_BPW][MV_NT][MV_W_WORDS];
        WS_T dw[MV_BPW][MV_NT][2];
#pragma unroll
        for (int i = 0; i < MV_BPW; i++)
            mv_q_load(w, min(c0 + split * MV_BPW + i, MV_UNITS - 1), tq, wrow, crow, nblk, wv[i], dw[i]);
        if (c0 == 0) PDL_WAIT();   // x is the kernel before's (stage_x); the weights are not
        barrier(CLK_LOCAL_MEM_FENCE);   // the last chunk's A loads are done
        for (int e = lid; e < nt * (MV_MMA_KC / 16); e += MV_WG) {
            int tt = e / (MV_MMA_KC / 16), u = e % (MV_MMA_KC / 16);
            *(__local uint4*)(xc + tt * MV_XW + 4 * u) =
                ((__global const uint4*)(sx + (size_t)(t0 + tt) * MV_K + (size_t)c0 * 32))[u];
        }
        for (int e = lid; e < nt * MV_KCB; e += MV_WG) {
            int tt = e / MV_KCB, b = e % MV_KCB;
            xd[tt * MV_KCB + b] = sd[(size_t)(t0 + tt) * MV_UNITS + c0 + b];
#ifdef W_Q4_1
            xd[16 * MV_KCB + tt * MV_KCB + b] = sd[(size_t)M * MV_UNITS + (size_t)(t0 + tt) * MV_UNITS + c0 + b];
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int i = 0; i < MV_BPW; i++) {
            int bl = split * MV_BPW + i, bc = min(bl, MV_KCB - 1);   // the block within the chunk
            bool live = bl < MV_KCB;        // every warp runs every MMA (the emulation's barriers)
            float dxa = xd[ra * MV_KCB + bc], dxb = xd[rb * MV_KCB + bc], sxa = 0.0f, sxb = 0.0f;
#ifdef W_Q4_1
            sxa = xd[16 * MV_KCB + ra * MV_KCB + bc];
            sxb = xd[16 * MV_KCB + rb * MV_KCB + bc];
#endif
            __local const uint* pa = xc + ra * MV_XW + 8 * bc;
            __local const uint* pb = xc + rb * MV_XW + 8 * bc;
#ifdef USE_NV_MMA
            uint a[4] = {pa[tq], pb[tq], pa[4 + tq], pb[4 + tq]};
#endif
#pragma unroll
            for (int j = 0; j < MV_NT; j++) {
                int c[4];
#ifdef USE_NV_MMA
                uint b0, b1;
                mv_b_frag(wv[i][j], &b0, &b1);
                MMA_S8(c, a, b0, b1);
#else
                int b = min(c0 + bl, MV_UNITS - 1);
                uint xa[8], xb[8];
                for (int q = 0; q < 8; q++) {
                    xa[q] = pa[q];
                    xb[q] = pb[q];
                }
                for (int q = 0; q < 4; q++)
                    c[q] = mv_block_isum(q < 2 ? xa : xb,
                                         (__global const uint*)w + ((size_t)crow[j][q & 1] * MV_UNITS + b) * (W_QBYTES / 4));
#endif
                if (live) mv_q_acc(acc[j], c, dxa, dxb, sxa, sxb, dw[i][j][0], dw[i][j][1]);
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);   // the stage's last reads, before the sums take its words
    __local float* part = (__local float*)lds;                 // [MV_SPLIT][16][MV_ROWS]
    mv_mma_parts(acc, part, rset, split, gq, tq);
    barrier(CLK_LOCAL_MEM_FENCE);
    mv_mma_fold(part, part + MV_SPLIT * MV_TOKS * MV_ROWS, 0, lid);
}
#endif

#if defined(MV_MMA) && (!defined(W_QUANT) || defined(MV_MMA_LX))
// The variants whose lanes read x themselves (f16 weights; quantized weights with -DMV_MMA_LX).
// Warp w takes the MV_RPW rows of row set w / MV_SPLIT over K slice s = w % MV_SPLIT (blocks
// s * MV_MPASS ..), MV_MU blocks' weight loads in flight at once, with no barrier and no local
// memory in the K loop: a lane reads its A values of x (f32, from L1: every warp of the launch
// reads the same rows), scales them by the RMS prologue's norm weight and converts them in
// registers; it sums their squares on the way, and each token's dot products are divided by its
// rms at the end: dot(w, x / rms * nw) = dot(w, x * nw) / rms. A token's sums run in one fixed
// order whatever its place in the group or the other tokens (lanes of any row do the same work;
// the slices meet in slice order): its bits do not depend on them.
#define MV_MPASS ((MV_MB + MV_SPLIT - 1) / MV_SPLIT)        // a warp's blocks, consecutive: each
                                                            // row's bytes in one run (every
                                                            // MV_SPLIT-th block: 0.89x at 1 row)
#define MV_MBLK(p) (split * MV_MPASS + (p))                 // the slice's p-th block
#define MV_MU MV_MIN(MV_MPASS, MV_MAX(1, MV_LOADS / MV_NT)) // blocks whose weights load together
// local words after the K loop: the slices' sums, out_all, each token's rms, and row set 0's
// lanes' sums of squares
#define MV_MMA_LDS ((MV_SPLIT + 1) * MV_TOKS * MV_ROWS + MV_TOKS + MV_SPLIT * 64)

// After the K loop: the warps' sums into part, each token's rms from its lanes' sums of squares
// ssa, ssb (row set 0's: every row set reads the same x), and the slices folded into out_all
// [16][MV_ROWS] = lds + MV_SPLIT * 16 * MV_ROWS, divided by it
inline void mv_mma_late(float (*acc)[4], __local uint* lds, int rset, int split, int lid, float ssa, float ssb,
                        float eps) {
    int lane = lid & 31;
    __local float* part = (__local float*)lds;                 // [MV_SPLIT][16][MV_ROWS]
    __local float* out_all = part + MV_SPLIT * MV_TOKS * MV_ROWS;
    __local float* rms = out_all + MV_TOKS * MV_ROWS;          // [16]
    __local float* ssl = rms + MV_TOKS;                        // [MV_SPLIT][32 lanes][2]
    __local const float* late = 0;                             // each token's rms, if applied here
    mv_mma_parts(acc, part, rset, split, lane >> 2, lane & 3);
#if defined(PROLOGUE_RMS) && !defined(W_QUANT)
    if (rset == 0) {
        ssl[(split * 32 + lane) * 2] = ssa;
        ssl[(split * 32 + lane) * 2 + 1] = ssb;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < MV_TOKS) {   // token lid: row lid % 8 of A's lanes, their first or second row
        float s = 0.0f;
        for (int k = 0; k < MV_SPLIT; k++)
            for (int q = 0; q < 4; q++) s += ssl[(k * 32 + (lid & 7) * 4 + q) * 2 + (lid >> 3)];
        rms[lid] = sqrt(s / (float)MV_K + eps);
    }
    late = rms;
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    mv_mma_fold(part, out_all, late, lid);
}
#endif

#if defined(MV_MMA) && !defined(W_QUANT)
// f16 weights: lane (gq, tq)'s 16-byte unit of a block (values 8 tq .. 8 tq + 7) of its B row, and
// the same values of its two A rows (rounded to f16), serve two m16n8k16 as their k = 2 tq, 2 tq + 1
// (words 0, 2 of the unit) and 8 + 2 tq, 9 + 2 tq (words 1, 3): A and B take the block's k in the
// same order, so each MMA sums 16 of its terms and every weight load is a whole unit.

// two values rounded to f16 (nearest even), the first in the low half
inline uint mv_half2(float lo, float hi) {
#if defined(USE_NV_PTX) && defined(USE_NV_MMA)
    uint r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // sm_80 on
    return r;
#else
    return emu_f32_to_f16(lo) | (emu_f32_to_f16(hi) << 16);
#endif
}

#ifndef USE_NV_MMA
// without tensor cores: one token's block b of x (scaled, rounded to f16) dotted with one row's
// block ww in f32 (the MMA's element; halves by bit arithmetic: common.cl's note on PoCL)
inline float mv_block_fsum(__global const float4* x4, gin nw, int b, __global const uint* ww) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) {
        float4 v = x4[8 * b + i];
#ifdef PROLOGUE_RMS
        v = v * LD4_NORM(nw, 8 * b + i);
#endif
        uint2 h = (uint2)(mv_half2(v.x, v.y), mv_half2(v.z, v.w));
        uint2 wv = (uint2)(ww[2 * i], ww[2 * i + 1]);
        s = fma(emu_half(h.x, 0), emu_half(wv.x, 0), s);
        s = fma(emu_half(h.x, 1), emu_half(wv.x, 1), s);
        s = fma(emu_half(h.y, 0), emu_half(wv.y, 0), s);
        s = fma(emu_half(h.y, 1), emu_half(wv.y, 1), s);
    }
    return s;
}
#endif

// The group's 16 token rows (from t0; nt valid; x f32 [M][K]) times its weight rows, into
// out_all [16][MV_ROWS] = lds + MV_SPLIT * 16 * MV_ROWS
inline void mv_mma_sums(gin xg, gin nw, float eps, gin w, int N, int g, int t0, int nt, int lid, int rset,
                        int split, int n_heads, int n_kv_heads, int hd, __local uint* lds MV_EMU_PARAM) {
    int lane = lid & 31, gq = lane >> 2, tq = lane & 3;
    int ra = gq < nt ? gq : 0, rb = gq + 8 < nt ? gq + 8 : 0;   // A rows; past nt the first (never stored)
    __global const float4* xa4 = (__global const float4*)xg + (size_t)(t0 + ra) * (MV_K / 4);
    __global const float4* xb4 = (__global const float4*)xg + (size_t)(t0 + rb) * (MV_K / 4);
    __global const uint4* w4 = (__global const uint4*)w;
    int wrow[MV_NT], crow[MV_NT][2];
    float acc[MV_NT][4];
    mv_mma_rows(g, rset, gq, tq, N, n_heads, n_kv_heads, hd, wrow, crow, acc);
    float ssa = 0.0f, ssb = 0.0f;   // sums of squares of this lane's values of rows ra, rb
    for (int p0 = 0; p0 < MV_MPASS; p0 += MV_MU) {
        uint4 wv[MV_MU][MV_NT];
#pragma unroll
        for (int u = 0; u < MV_MU; u++) {
            int b = min(MV_MBLK(p0 + u), MV_MB - 1);
#pragma unroll
            for (int j = 0; j < MV_NT; j++) wv[u][j] = w4[((size_t)wrow[j] * MV_MB + b) * 4 + tq];
        }
        if (p0 == 0) PDL_WAIT();   // x is the kernel before's; the weights are not
#pragma unroll
        for (int u = 0; u < MV_MU; u++) {
            int bi = MV_MBLK(p0 + u), b = min(bi, MV_MB - 1);
            bool live = p0 + u < MV_MPASS && bi < MV_MB;   // uniform in the warp: its K slice
#if defined(USE_NV_MMA)
            float4 alo = xa4[8 * b + 2 * tq], ahi = xa4[8 * b + 2 * tq + 1], blo = alo, bhi = ahi;
            if (nt > 8) {   // else A's second rows are padding (uniform: the group's rows)
                blo = xb4[8 * b + 2 * tq];
                bhi = xb4[8 * b + 2 * tq + 1];
            }
#ifdef PROLOGUE_RMS
            if (live) {
                ssa += dot(alo, alo) + dot(ahi, ahi);
                ssb += dot(blo, blo) + dot(bhi, bhi);
            }
            float4 nlo = LD4_NORM(nw, 8 * b + 2 * tq), nhi = LD4_NORM(nw, 8 * b + 2 * tq + 1);
            alo *= nlo; ahi *= nhi; blo *= nlo; bhi *= nhi;
#endif
            uint a0[4] = {mv_half2(alo.x, alo.y), mv_half2(blo.x, blo.y), mv_half2(alo.z, alo.w), mv_half2(blo.z, blo.w)};
            uint a1[4] = {mv_half2(ahi.x, ahi.y), mv_half2(bhi.x, bhi.y), mv_half2(ahi.z, ahi.w), mv_half2(bhi.z, bhi.w)};
#pragma unroll
            for (int j = 0; j < MV_NT; j++) {
#ifdef EMU_MMA   // every work-item calls the emulation (its barriers)
                float c[4] = {acc[j][0], acc[j][1], acc[j][2], acc[j][3]};
                MMA_F16(c, a0, wv[u][j].x, wv[u][j].y);
                MMA_F16(c, a1, wv[u][j].z, wv[u][j].w);
                if (live)
                    for (int q = 0; q < 4; q++) acc[j][q] = c[q];
#else
                if (live) {
                    MMA_F16(acc[j], a0, wv[u][j].x, wv[u][j].y);
                    MMA_F16(acc[j], a1, wv[u][j].z, wv[u][j].w);
                }
#endif
            }
#else   // no tensor cores
            if (live) {
#ifdef PROLOGUE_RMS
                for (int i = 0; i < 2; i++) {
                    float4 va = xa4[8 * b + 2 * tq + i], vb = xb4[8 * b + 2 * tq + i];
                    ssa += dot(va, va);
                    ssb += dot(vb, vb);
                }
#endif
#pragma unroll
                for (int j = 0; j < MV_NT; j++)
                    for (int q = 0; q < 4; q++)
                        acc[j][q] += mv_block_fsum(q < 2 ? xa4 : xb4, nw, b,
                                                   (__global const uint*)w + ((size_t)crow[j][q & 1] * MV_MB + b) * 16);
            }
#endif
        }
    }
    mv_mma_late(acc, lds, rset, split, lid, ssa, ssb, eps);
}
#endif

#if defined(MV_MMA) && defined(MV_MMA_LX)
// Quantized weights, x quantized by the lanes (no stage_x launch before): lane (gq, tq) reads
// word tq of its B row's block (values 4 tq .. 4 tq + 3 in the low nibbles, 16 + 4 tq .. in the
// high; q8_0 words tq and 4 + tq) and the same 8 values of x of its two A rows, and quantizes
// them as stage_x quantizes a block: x / rms * nw (so the RMS prologue's sums come first, a warp
// a token, before the K loop: quantizing x * nw and dividing by rms late moves a value lying on
// a half step, as the golden models' bf16 embeddings do, to the other code), the block's amax
// from the quad's 4 lanes (a max: exact in any order), d = amax / 127 kept as f16, codes
// round(v / d). One m16n8k32 a block and 8 rows.
#ifdef USE_NV_MMA
#ifdef EMU_MMA
#define MV_XOR(v, o) emu_shfl_xor(v, o, emu_sc)
#else
#define MV_XOR(v, o) shfl_xor_f(v, o)
#endif
// a token's 8 values (lo: k = 4 tq ..; hi: 16 + 4 tq ..) of a block quantized with the quad's
// other lanes: their codes a[0], a[1], d (and q4_1's s = d * sum of the block's codes)
inline void mv_lx_quant(float4 lo, float4 hi, uint* a, float* d, float* s MV_EMU_PARAM) {
    float4 al = fabs(lo), ah = fabs(hi);
    float amax = fmax(fmax(fmax(al.x, al.y), fmax(al.z, al.w)), fmax(fmax(ah.x, ah.y), fmax(ah.z, ah.w)));
    amax = fmax(amax, MV_XOR(amax, 1));
    amax = fmax(amax, MV_XOR(amax, 2));
    float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    float4 ql = round(lo * id), qh = round(hi * id);
    a[0] = as_uint(convert_char4(ql));
    a[1] = as_uint(convert_char4(qh));
    *d = round_to_half(dd);
    float sum = ((ql.x + ql.y) + (ql.z + ql.w)) + ((qh.x + qh.y) + (qh.z + qh.w));
    sum += MV_XOR(sum, 1);
    sum += MV_XOR(sum, 2);
    *s = X_SUM(dd, sum);
}
#endif

// The group's 16 token rows (from t0; nt valid; x f32 [M][K]) times its weight rows, into
// out_all [16][MV_ROWS] = lds + MV_SPLIT * 16 * MV_ROWS
inline void mv_mma_sums(gin xg, gin nw, float eps, gin w, int N, int g, int t0, int nt, int lid, int rset,
                        int split, int n_heads, int n_kv_heads, int hd, __local uint* lds MV_EMU_PARAM) {
    int lane = lid & 31, gq = lane >> 2, tq = lane & 3;
    size_t nblk = (size_t)N * MV_UNITS;
    int ra = gq < nt ? gq : 0, rb = gq + 8 < nt ? gq + 8 : 0;   // A rows; past nt the first (never stored)
    __global const float4* xa4 = (__global const float4*)xg + (size_t)(t0 + ra) * (MV_K / 4);
    __global const float4* xb4 = (__global const float4*)xg + (size_t)(t0 + rb) * (MV_K / 4);
    float rma = 1.0f, rmb = 1.0f;   // the tokens' rms (the RMS prologue)
#ifdef PROLOGUE_RMS
    __local float* rms = (__local float*)lds + (MV_SPLIT + 1) * MV_TOKS * MV_ROWS;   // [16], past the sums
    PDL_WAIT();
#ifdef USE_NV_PTX
    for (int tt = lid >> 5; tt < MV_TOKS; tt += MV_WARPS) {   // a warp a token, lanes along K
        __global const float4* x4 = (__global const float4*)xg + (size_t)(t0 + (tt < nt ? tt : 0)) * (MV_K / 4);
        float ss = 0.0f;
        if (tt < nt)   // uniform in the warp
            for (int i = lane; i < MV_K / 4; i += 32) ss += dot(x4[i], x4[i]);
        ss = warp_sum(ss);
        if (lane == 0) rms[tt] = sqrt(ss / (float)MV_K + eps);
    }
#else
    if (lid < MV_TOKS) {   // no warp shuffles: a thread a token
        __global const float4* x4 = (__global const float4*)xg + (size_t)(t0 + (lid < nt ? lid : 0)) * (MV_K / 4);
        float ss = 0.0f;
        for (int i = 0; i < MV_K / 4; i++) ss += dot(x4[i], x4[i]);
        rms[lid] = sqrt(ss / (float)MV_K + eps);
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    rma = rms[ra];
    rmb = rms[rb];
#endif
    int wrow[MV_NT], crow[MV_NT][2];
    float acc[MV_NT][4];
    mv_mma_rows(g, rset, gq, tq, N, n_heads, n_kv_heads, hd, wrow, crow, acc);
    for (int p0 = 0; p0 < MV_MPASS; p0 += MV_MU) {
        uint wv[MV_MU][MV_NT][MV_W_WORDS];
        WS_T dw[MV_MU][MV_NT][2];
#pragma unroll
        for (int u = 0; u < MV_MU; u++)
            mv_q_load(w, min(MV_MBLK(p0 + u), MV_MB - 1), tq, wrow, crow, nblk, wv[u], dw[u]);
#ifndef PROLOGUE_RMS
        if (p0 == 0) PDL_WAIT();   // x is the kernel before's; the weights are not
#endif
#pragma unroll
        for (int u = 0; u < MV_MU; u++) {
            int bi = MV_MBLK(p0 + u), b = min(bi, MV_MB - 1);
            bool live = p0 + u < MV_MPASS && bi < MV_MB;   // uniform in the warp: its K slice
#ifdef USE_NV_MMA
            float4 alo = xa4[8 * b + tq], ahi = xa4[8 * b + 4 + tq], blo = alo, bhi = ahi;
            if (nt > 8) {   // else A's second rows are padding (uniform: the group's rows)
                blo = xb4[8 * b + tq];
                bhi = xb4[8 * b + 4 + tq];
            }
#ifdef PROLOGUE_RMS
            float4 nlo = LD4_NORM(nw, 8 * b + tq), nhi = LD4_NORM(nw, 8 * b + 4 + tq);
            alo = alo / rma * nlo; ahi = ahi / rma * nhi; blo = blo / rmb * nlo; bhi = bhi / rmb * nhi;
#endif
            uint qa[2], qb[2];
            float dxa, dxb, sxa, sxb;
            mv_lx_quant(alo, ahi, qa, &dxa, &sxa MV_EMU_ARG);   // every lane: the quad's shuffles
            mv_lx_quant(blo, bhi, qb, &dxb, &sxb MV_EMU_ARG);
            uint a[4] = {qa[0], qb[0], qa[1], qb[1]};
#pragma unroll
            for (int j = 0; j < MV_NT; j++) {
                int c[4];
                uint b0, b1;
                mv_b_frag(wv[u][j], &b0, &b1);
                MMA_S8(c, a, b0, b1);
                if (live) mv_q_acc(acc[j], c, dxa, dxb, sxa, sxb, dw[u][j][0], dw[u][j][1]);
            }
#else   // no tensor cores: each lane quantizes its two tokens' whole block (quantize_block: the
        // same amax, so the same codes as the quad's)
            if (live) {
                uint ca[8], cb[8];
                float dxa, dxb, sxa, sxb;
                quantize_block(xa4, nw, b, rma, ca, &dxa, &sxa);
                quantize_block(xb4, nw, b, rmb, cb, &dxb, &sxb);
#pragma unroll
                for (int j = 0; j < MV_NT; j++) {
                    int c[4];
                    for (int q = 0; q < 4; q++)
                        c[q] = mv_block_isum(q < 2 ? ca : cb,
                                             (__global const uint*)w + ((size_t)crow[j][q & 1] * MV_UNITS + b) * (W_QBYTES / 4));
                    mv_q_acc(acc[j], c, dxa, dxb, sxa, sxb, dw[u][j][0], dw[u][j][1]);
                }
            }
#endif
        }
    }
    mv_mma_late(acc, lds, rset, split, lid, 0.0f, 0.0f, eps);
}
#endif

// Only the arguments the variant reads (codegen binds the same list): on NVIDIA's driver a
// launch's host time grows with its argument count, and a decode step is launch-bound there.
#ifdef PROLOGUE_RMS
#define MV_HAS_NW 1                          // nw, eps
#endif
#if defined(EPI_ADD) || defined(EPI_ROPE_KV)
#define MV_HAS_E0 1                          // e0
#endif
#ifdef EPI_ROPE_KV
#define MV_HAS_KV 1                          // e1, e2, n_heads, n_kv_heads, hd
#endif
// then b (BIAS); qn, kn, qk_eps (QK_NORM); QK_SPLIT's scratch; positions, slots, n_slots (STEP_ROWS)
__kernel __attribute__((reqd_work_group_size(MV_WG, 1, 1)))
void matvec(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off,
#ifdef MV_HAS_NW
            gin nwb, ulong nw_off,
#endif
#ifdef MV_HAS_E0
            gout e0b, ulong e0_off,
#endif
#ifdef MV_HAS_KV
            gout e1b, ulong e1_off, gout e2b, ulong e2_off,
#endif
            gout yb, ulong y_off, int M, int K, int N
#ifdef MV_HAS_NW
            , float eps
#endif
#ifdef MV_HAS_KV
            , int n_heads, int n_kv_heads, int hd
#endif
#ifdef BIAS
            , gin biasb, ulong bias_off
#endif
#ifdef QK_NORM
            , gin qnormb, ulong qnorm_off, gin knormb, ulong knorm_off, float qk_eps
#endif
#ifdef QK_SPLIT
            , gout qscb, ulong qsc_off
#endif
#if (defined(MV_MMA) && defined(W_QUANT) && !defined(MV_MMA_LX)) || defined(MV_SX)
            , gin sxb, ulong sx_off
#endif
            KERNEL_ROWS_ARGS) {
#ifndef MV_HAS_NW
    gin nwb = 0;
    ulong nw_off = 0;
    float eps = 0.0f;
#endif
#ifndef MV_HAS_E0
    gout e0b = 0;
    ulong e0_off = 0;
#endif
#ifndef MV_HAS_KV
    gout e1b = 0, e2b = 0;
    ulong e1_off = 0, e2_off = 0;
    int n_heads = 0, n_kv_heads = 0, hd = 0;
#endif
#ifdef MV_TOKS_INNER
    // groups launch in order of gid0 + gid1 * groups0; read as token group fastest, the groups
    // of one weight batch for every token run side by side and share its DRAM reads through L2
    int lin = get_group_id(0) + get_group_id(1) * get_num_groups(0);
    int g = lin / get_num_groups(1), tg = lin % get_num_groups(1);
#else
    int g = get_group_id(0), tg = get_group_id(1);
#endif
    int lid = get_local_id(0), t0 = tg * MV_TOKS + MV_ROW0(step);
    int lane = lid & 31, warp = lid >> 5;
    int rset = warp / MV_SPLIT, split = warp % MV_SPLIT;   // row set, K slice
#if MV_TOKS > 1
    // the group's valid tokens (uniform): within the step's rows and x's M (a step graph's head
    // has M logit rows, fewer than the step's tokens)
    int nt = MV_MIN(MV_TOKS, MV_MIN(M, STEP_N_TOKENS(step)) - t0);
#else
    int nt = 1;
#endif
    __global const float4* x4[MV_TOKS];      // token tt's x row [K/4]; past nt: row t0's
#pragma unroll
    for (int tt = 0; tt < MV_TOKS; tt++)
        x4[tt] = (__global const float4*)(xb + x_off) + (size_t)(tt < nt ? t0 + tt : t0) * (MV_K / 4);
    gin w = wb + w_off;
#ifdef USE_NV_PTX
    __local float red[MV_WG];                 // group_sum scratch
#if MV_SPLIT > 1
    __local float part[MV_WARPS * MV_RPW];    // [row set][slice][row of warp] warp sums
#endif
#else
    __local float red[MV_MAX(MV_WG, MV_WARPS * MV_RPW * 32)];   // [warp][row of warp][lane]
                                              // partial sums; group_sum scratch
#endif
#if MV_LATE
#ifdef USE_NV_PTX
    __local float ssw[MV_WARPS];              // [row set][slice] sums of x's squares
#else
    __local float ssl[MV_WG];                 // [row set][slice][lane] sums of x's squares
#endif
    float ssq[MV_TOKS];                       // this lane's, over the units it reads, by token
#pragma unroll
    for (int tt = 0; tt < MV_TOKS; tt++) ssq[tt] = 0.0f;
#endif
#ifdef MV_MMA
    // x's chunks, then the sums; uint4-typed: the chunk copy's 16-byte stores need that alignment
    __local uint4 mma_lds4[(MV_MMA_LDS + 3) / 4];
    __local uint* mma_lds = (__local uint*)mma_lds4;
    __local float* out_all = (__local float*)mma_lds + MV_SPLIT * MV_TOKS * MV_ROWS;   // [16][rows] dot products
#else
    __local float out[MV_ROWS];               // the group's finished dot products, by slot
#endif
#ifdef QK_NORM
    __local float qk_part[QK_HPG * QK_PARTS]; // pre_epilogue's sums of squares of the heads, in parts
#endif
#ifdef QK_SPLIT
    __local float qk_head[ROPE_HD];           // the head the group finishes, whole
    __local int qk_last;
#endif

#ifdef MV_MMA
#ifdef EMU_MMA
    __local uint emu_sc[EMU_SC_WORDS];
#endif
#if defined(W_QUANT) && !defined(MV_MMA_LX)
    mv_mma_sums(sxb + sx_off, wb + w_off, M, N, g, t0, nt, lid, rset, split, n_heads, n_kv_heads, hd,
                mma_lds MV_EMU_ARG);
#else
    mv_mma_sums(xb + x_off, nwb + nw_off, eps, wb + w_off, N, g, t0, nt, lid, rset, split, n_heads, n_kv_heads, hd,
                mma_lds MV_EMU_ARG);
#endif
#else
#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
#endif
    // this warp's weight rows; a padding slot (-1) reads row 0 and is never written
    int rows[MV_RPW];
    float acc[MV_TOKS][MV_RPW];
#pragma unroll
    for (int i = 0; i < MV_RPW; i++) {
        rows[i] = max(slot_row(g, rset * MV_RPW + i, MV_ROWS, N, n_heads, n_kv_heads, hd), 0);
#pragma unroll
        for (int tt = 0; tt < MV_TOKS; tt++) acc[tt][i] = 0.0f;
    }

    // weight batch p0: MV_UNROLL passes of this warp's MV_RPW rows
#ifdef W_QUANT
    WQ_T wq[MV_UNROLL][MV_RPW];
    WS_T wd[MV_UNROLL][MV_RPW];
    size_t nblk = (size_t)N * MV_UNITS;
#define MV_LOAD_BATCH(p0)                                                              \
    for (int u = 0; u < MV_UNROLL; u++) {                                              \
        int b = min((((p0) + u) * MV_SPLIT + split) * 32 + lane, MV_UNITS - 1); /* past K: last */ \
        for (int i = 0; i < MV_RPW; i++) {                                             \
            size_t blk = (size_t)rows[i] * MV_UNITS + b;                               \
            wq[u][i] = WQ_LOAD(w, blk);                                                \
            wd[u][i] = wheader(w, blk, nblk);                                          \
        }                                                                              \
    }
#else
    WU_T wu[MV_UNROLL][MV_RPW];
#define MV_LOAD_BATCH(p0)                                                              \
    for (int u = 0; u < MV_UNROLL; u++) {                                              \
        int un = min((((p0) + u) * MV_SPLIT + split) * 32 + lane, MV_UNITS - 1);        \
        for (int i = 0; i < MV_RPW; i++) wu[u][i] = wunit_load(w, (size_t)rows[i] * MV_UNITS + un); \
    }
#endif
#ifdef W_QUANT
#ifdef USE_NV_PDL
    // replayed with programmatic dependent launch: the first batch's blocks toward L2 while the
    // kernel before finishes (weights are read-only), then the wait before x is read
    for (int u = 0; u < MV_UNROLL; u++) {
        int b = min((u * MV_SPLIT + split) * 32 + lane, MV_UNITS - 1);
        for (int i = 0; i < MV_RPW; i++) PDL_PREFETCH(w + ((size_t)rows[i] * MV_UNITS + b) * W_QBYTES);
    }
#endif
    PDL_WAIT();
    // quantized weights load their first batch after quantize_x: the batch's registers, held
    // across it, cost more than the overlap (H200 1B q4_0 decode 1348 -> 1165 tok/s, round 12)
#define MV_NEXT_BATCH(p0) MV_LOAD_BATCH(p0)
#else
    // the first batch's DRAM reads fly while the group prepares x (the RMS sum): they need
    // nothing from x, and that preparation would otherwise come before any weight byte is asked
    // for (H200 1B f16 decode 979 -> 998 tok/s, round 12)
    MV_LOAD_BATCH(0)
    PDL_WAIT();   // replayed with programmatic dependent launch: those loads overlap the kernel before
#define MV_NEXT_BATCH(p0) if ((p0) > 0) { MV_LOAD_BATCH(p0) }
#endif

#ifdef MV_SX
    // matvec_stage's output: codes [M][K], then d [M][K / 32], then s [M][K / 32]
    __global const int4* sxq = (__global const int4*)(sxb + sx_off);
    __global const float* sxd = (__global const float*)(sxb + sx_off + (size_t)M * MV_K);
    __global const XS_T* sxs = (__global const XS_T*)(sxd + (size_t)M * MV_UNITS);
#elif defined(PROLOGUE_RMS) && !MV_LATE
    float rms[MV_TOKS];
    MV_TOK_LOOP
    for (int tt = 0; tt < MV_TOKS; tt++) rms[tt] = mv_rms(x4[tt], red, eps);
#endif

#if defined(W_QUANT) && !defined(MV_SX)
    __local int4 xq[MV_TOKS][MV_K / 16];   // [token] x as Q8_0: int8 [K] packed 4 per int; int4-typed so a
                                     // block is two 16-byte local loads (vload4 from an int
                                     // array gave 8 narrow ones; H200 q4_0 down_proj 196 ->
                                     // 160 us per decode step)
    __local float xd[MV_TOKS][MV_UNITS];   // block scales
    __local XS_T xs[MV_TOKS][MV_UNITS];    // block sums of the int8 values (q4_0's -8 offset;
                                     // q4_1: Q8_1's s)
#ifdef MV_X_LANES
#pragma unroll
    for (int tt = 0; tt < MV_TOKS; tt++) if (tt < nt)   // whole warps loop inside: nt is the group's
        quantize_x_lanes(x4[tt], (__local int*)xq[tt], xd[tt], xs[tt]
#ifdef PROLOGUE_RMS
                         , nw, rms[tt]
#endif
                         );
#else
    for (int j = lid; j < nt * MV_UNITS; j += MV_WG) {   // block j % MV_UNITS of token j / MV_UNITS
        int tt = j / MV_UNITS;
        quantize_x(x4[tt], j % MV_UNITS, xq[tt], xd[tt], xs[tt]
#ifdef PROLOGUE_RMS
                   , nw, rms[tt]
#endif
                   );
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#ifdef W_QUANT
    for (int p0 = 0; p0 < MV_PASSES; p0 += MV_UNROLL) {
        MV_NEXT_BATCH(p0)
#pragma unroll
        for (int u = 0; u < MV_UNROLL; u++) {
            int b = ((p0 + u) * MV_SPLIT + split) * 32 + lane;
            if (b < MV_UNITS) {
#pragma unroll
                for (int tt = 0; tt < MV_TOKS; tt++) if (tt < nt) {   // nt is the group's: no divergence
                    int q[8];
#ifdef MV_SX
                    size_t xb0 = (size_t)(t0 + tt) * MV_UNITS + b;
                    int4 lo = sxq[2 * xb0], hi = sxq[2 * xb0 + 1];
                    float d = sxd[xb0];
                    XS_T s = sxs[xb0];
#else
                    int4 lo = xq[tt][2 * b], hi = xq[tt][2 * b + 1];
                    float d = xd[tt][b];
                    XS_T s = xs[tt][b];
#endif
                    q[0] = lo.s0; q[1] = lo.s1; q[2] = lo.s2; q[3] = lo.s3;
                    q[4] = hi.s0; q[5] = hi.s1; q[6] = hi.s2; q[7] = hi.s3;
#pragma unroll
                    for (int i = 0; i < MV_RPW; i++)
#ifdef W_Q4_1
                        acc[tt][i] += (float)wq_idot(wq[u][i], q, 0) * (d * wd[u][i].x) + wd[u][i].y * s;
#else
                        acc[tt][i] += (float)wq_idot(wq[u][i], q, s) * (d * wd[u][i]);
#endif
                }
            }
        }
    }
#else
    for (int p0 = 0; p0 < MV_PASSES; p0 += MV_UNROLL) {
        MV_NEXT_BATCH(p0)
#pragma unroll
        for (int u = 0; u < MV_UNROLL; u++) {
            int un = ((p0 + u) * MV_SPLIT + split) * 32 + lane;
            if (un < MV_UNITS) {
#pragma unroll
                for (int tt = 0; tt < MV_TOKS; tt++) if (tt < nt) {   // nt is the group's: no divergence
                    float4 lo = x4[tt][2 * un], hi = x4[tt][2 * un + 1];
#if MV_LATE
                    ssq[tt] += dot(lo, lo) + dot(hi, hi);
                    lo = lo * LD4_NORM(nw, 2 * un);
                    hi = hi * LD4_NORM(nw, 2 * un + 1);
#elif defined(PROLOGUE_RMS)
                    lo = lo / rms[tt] * LD4_NORM(nw, 2 * un);
                    hi = hi / rms[tt] * LD4_NORM(nw, 2 * un + 1);
#endif
                    float8 xv = (float8)(lo, hi);
#pragma unroll
                    for (int i = 0; i < MV_RPW; i++) acc[tt][i] += wunit_dot_bits(wu[u][i], xv);
                }
            }
        }
    }
#endif

#endif   // MV_MMA
    PDL_TRIGGER();   // every weight byte is in: the next kernel may launch and wait
    // token by token: its reductions into out, then its epilogue, which only a valid token
    // (tt < nt) runs; every token passes the barriers (none under a condition: PoCL replicates
    // the code after a conditional barrier, exponentially in their number), and the next
    // token's first barrier keeps out until the epilogue is done
    MV_TOK_LOOP
    for (int tt = 0; tt < MV_TOKS; tt++) {
        int t = t0 + tt;
#if MV_TOKS > 1
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
#ifdef MV_MMA
        __local float* out = out_all + tt * MV_ROWS;
#elif defined(USE_NV_PTX)
#if MV_LATE
        float ssq_t = warp_sum(ssq[tt]);
#endif
#if MV_SPLIT > 1
#pragma unroll
        for (int i = 0; i < MV_RPW; i++) {
            float s = warp_sum(acc[tt][i]);
            if (lane == 0) part[warp * MV_RPW + i] = s;
        }
#if MV_LATE
        if (lane == 0) ssw[warp] = ssq_t;
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int r = lid; r < MV_ROWS; r += MV_WG) {   // slot r: row r % MV_RPW of row set r / MV_RPW
            float s = 0.0f;
            for (int k = 0; k < MV_SPLIT; k++) s += part[((r / MV_RPW) * MV_SPLIT + k) * MV_RPW + r % MV_RPW];
#if MV_LATE
            float sq = 0.0f;
            for (int k = 0; k < MV_SPLIT; k++) sq += ssw[(r / MV_RPW) * MV_SPLIT + k];
            s /= sqrt(sq / (float)MV_K + eps);
#endif
            out[r] = s;
        }
#else
#if MV_LATE
        float rinv = 1.0f / sqrt(ssq_t / (float)MV_K + eps);   // the warp read all of K
#endif
#pragma unroll
        for (int i = 0; i < MV_RPW; i++) {
            float s = warp_sum(acc[tt][i]);
#if MV_LATE
            s *= rinv;
#endif
            if (lane == 0) out[warp * MV_RPW + i] = s;
        }
#endif
#else
        barrier(CLK_LOCAL_MEM_FENCE);    // red may still be group_sum's
        for (int i = 0; i < MV_RPW; i++) red[(warp * MV_RPW + i) * 32 + lane] = acc[tt][i];
#if MV_LATE
        ssl[lid] = ssq[tt];
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int r = lid; r < MV_ROWS; r += MV_WG) {
            float s = 0.0f;
            for (int k = 0; k < MV_SPLIT; k++) {
                __local const float* p = red + (((r / MV_RPW) * MV_SPLIT + k) * MV_RPW + r % MV_RPW) * 32;
                for (int l = 0; l < 32; l++) s += p[l];
            }
#if MV_LATE
            float sq = 0.0f;              // the row set's MV_SPLIT warps, lane by lane
            for (int l = 0; l < 32 * MV_SPLIT; l++) sq += ssl[(r / MV_RPW) * MV_SPLIT * 32 + l];
            s /= sqrt(sq / (float)MV_K + eps);
#endif
            out[r] = s;
        }
#endif   // MV_MMA / USE_NV_PTX
        barrier(CLK_LOCAL_MEM_FENCE);
#ifdef PRE_EPILOGUE
#ifndef BIAS
        gin biasb = 0;
        ulong bias_off = 0;
#endif
#ifndef QK_NORM
        gin qnormb = 0, knormb = 0;
        ulong qnorm_off = 0, knorm_off = 0;
        float qk_eps = 0.0f;
        __local float* qk_part = 0;
#endif
#ifdef QK_SPLIT
        qk_split_epilogue(t, g, lid, MV_WG, out, MV_ROWS, e0b + e0_off, e1b + e1_off, e2b + e2_off, yb + y_off, M, N,
                          n_heads, n_kv_heads, hd, EPI_ROWS_OF(step), biasb + bias_off,
                          qnormb + qnorm_off, knormb + knorm_off, qk_eps, qk_part, qk_head, &qk_last, qscb + qsc_off);
        return;
#endif
        pre_epilogue(out, 1, MV_ROWS, g, MV_ROWS, lid, MV_WG, N, n_heads, n_kv_heads, hd, biasb + bias_off,
                     qnormb + qnorm_off, knormb + knorm_off, qk_eps, qk_part);
#endif
        if (tt < nt) {                   // after the last barrier: a slot past the step writes nothing
#if defined(EPI_ROPE_KV) && defined(KV_BLOCKS)
            if (lid < MV_ROWS / 32)
                epilogue_chunk(t, g, lid, MV_ROWS, out, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                               yb + y_off, N, n_heads, n_kv_heads, hd, EPI_ROWS_OF(step));
#else
            for (int r = lid; r < MV_ROWS; r += MV_WG)
                epilogue(t, g, r, MV_ROWS, out, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                         yb + y_off, N, n_heads, n_kv_heads, hd, EPI_ROWS_OF(step));
#endif
        }
    }
}

#ifdef MV_SX_STAGE
// x's Q8_0 blocks for the MV_SX matvec, a group per generated row of the step, built with the
// one-token matvec's options (its MV_WG above all, which orders the RMS sum): that group's own
// prologue, the same sums in the same order and the same quantization, its local copy then
// written out as codes [M][K], d [M][K / 32], s [M][K / 32].
__kernel __attribute__((reqd_work_group_size(MV_WG, 1, 1)))
void matvec_stage(__global const int* step, gin xb, ulong x_off,
#ifdef PROLOGUE_RMS
                  gin nwb, ulong nw_off,
#endif
                  gout sxb, ulong sx_off, int M
#ifdef PROLOGUE_RMS
                  , float eps
#endif
                  ) {
    PDL_TRIGGER();   // the matvec may launch and ask for its first weights while x is prepared
    int t = get_group_id(1) + MV_ROW0(step), lid = get_local_id(0);
    __global const float4* x4 = (__global const float4*)(xb + x_off) + (size_t)t * (MV_K / 4);
    __local float red[MV_WG];
    __local int4 xq[MV_K / 16];
    __local float xd[MV_UNITS];
    __local XS_T xs[MV_UNITS];
    PDL_WAIT();
#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
    float rms = mv_rms(x4, red, eps);
#endif
#ifdef MV_X_LANES
    quantize_x_lanes(x4, (__local int*)xq, xd, xs
#ifdef PROLOGUE_RMS
                     , nw, rms
#endif
                     );
#else
    for (int j = lid; j < MV_UNITS; j += MV_WG)
        quantize_x(x4, j, xq, xd, xs
#ifdef PROLOGUE_RMS
                   , nw, rms
#endif
                   );
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    __global int4* oq = (__global int4*)(sxb + sx_off) + (size_t)t * (MV_K / 16);
    __global float* od = (__global float*)(sxb + sx_off + (size_t)M * MV_K) + (size_t)t * MV_UNITS;
    __global XS_T* os = (__global XS_T*)((__global float*)(sxb + sx_off + (size_t)M * MV_K) + (size_t)M * MV_UNITS)
                        + (size_t)t * MV_UNITS;
    for (int i = lid; i < MV_K / 16; i += MV_WG) oq[i] = xq[i];
    for (int i = lid; i < MV_UNITS; i += MV_WG) {
        od[i] = xd[i];
        os[i] = xs[i];
    }
}
#endif
