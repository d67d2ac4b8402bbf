// attention_tiled's tensor-core body (NVIDIA sm_80+, f16 caches; emulated with -DEMU_MMA).
#ifdef ATT_MMA_BODY
// Tensor-core prefill attention (FlashAttention-2 with mma.sync m16n8k16, f16 operands, f32
// accumulation). The group's 4 warps own 32 query rows each, as two 16-row MMA tiles (heads
// up to 64 wide: one pass over the keys) or one tile at a time (wider heads: two passes, so
// the O accumulators fit in registers). Q, times scale * log2(e), is rounded to f16 once and
// kept as A fragments; the keys go through local memory ATT_MMA_BK at a time, f16, as 32-bit
// words with a padded stride (a fragment load's row r, word w hits bank 4r + w: distinct):
//   ks [ATT_MMA_BK][ATT_KS_W]  K as stored: word w of key i = dims 2w, 2w + 1 (the B operand
//                              of S = Q K^T is K's rows)
//   vt [HEAD_DIM][ATT_VT_W]    V transposed: word w of dim d = keys 2w, 2w + 1 (P V's B)
// S (f32 C fragments) gets the causal mask and an online softmax per row (exp2, rows reduced
// over the 4 lanes of a quad); P, rounded to f16, is the A operand of P V straight from the
// registers (C fragments of two adjacent 8-key tiles are one 16-key A fragment).
// Fragments (lane = 4 gq + tq): A 16x16 row: a0 (gq, 2tq..+1), a1 (gq+8, 2tq..), a2 (gq, 2tq+8..),
// a3 (gq+8, 2tq+8..); B 16x8 col: b0 (k 2tq..+1, n gq), b1 (k 2tq+8.., n gq); C 16x8:
// c0, c1 (gq, 2tq, 2tq+1), c2, c3 (gq+8, same); lower k / column in the lower half-word.
#define ATT_MMA_BK 64                     // keys per staged tile
#define ATT_KS_W (HEAD_DIM / 2 + 4)       // words per key row of ks (= 4 mod 8: distinct banks)
#define ATT_VT_W (ATT_MMA_BK / 2 + 4)     // words per dim row of vt
#if HEAD_DIM <= 64
#define ATT_MT 2                          // 16-row MMA tiles per warp and pass
#else
#define ATT_MT 1
#endif
#define ATT_PASSES (2 / ATT_MT)

#ifdef EMU_MMA
// common.cl's emulation: every work-item of the group reaches every call (the body's control
// flow is uniform when emulating)
// (bit arithmetic: see emu_f32_to_f16)
inline uint att_pack_emu(float lo, float hi) {
    return emu_f32_to_f16(lo) | (emu_f32_to_f16(hi) << 16);
}
#define ATT_MMA(c, a, b0, b1) emu_mma_f16(c, a, b0, b1, emu)
#define ATT_UNROLL _Pragma("unroll 1")    // rolled: unrolled, PoCL takes minutes to build it
#define ATT_XOR(v, o) emu_shfl_xor(v, o, emu)
#define ATT_PACK(lo, hi) att_pack_emu(lo, hi)
#else
#define ATT_MMA(c, a, b0, b1) MMA_F16(c, a, b0, b1)   // common.cl's mma.sync m16n8k16
// two floats -> f16 (nearest even) in one word, lo in the lower half
inline uint att_pack(float lo, float hi) {
    uint u;
    asm("{ .reg .b16 l, h; cvt.rn.f16.f32 l, %1; cvt.rn.f16.f32 h, %2; mov.b32 %0, {l, h}; }"
        : "=r"(u) : "f"(lo), "f"(hi));
    return u;
}
#define ATT_XOR(v, o) shfl_xor_f(v, o)
#define ATT_PACK(lo, hi) att_pack(lo, hi)
#define ATT_UNROLL _Pragma("unroll")      // whole: fragments and accumulators stay in registers
#endif

ATT_TILED_BEGIN
    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    __global const uint2* kg = (__global const uint2*)(kb + k_off);   // 4 f16 a load
    __global const uint2* vg = (__global const uint2*)(vb + v_off);
    __global const float2* q = (__global const float2*)(qb + q_off);
    __global float2* o = (__global float2*)(ob + o_off);
    __local uint2 ks2[ATT_MMA_BK * ATT_KS_W / 2];   // uint2-typed: 8-byte stores of K
    __local uint vt[HEAD_DIM * ATT_VT_W];
    __local uint* ks = (__local uint*)ks2;
#ifdef EMU_MMA
    __local uint emu[EMU_SC_WORDS];
#endif
    int last = n_past + min(rows, t0 + ATT_BQ) - 1;    // the group's last visible slot
    float qscale = scale * M_LOG2E_F;                  // scores in log2 units: exp2 below

    for (int pass = 0; pass < ATT_PASSES; pass++) {
        int rb = 32 * warp + 16 * ATT_MT * pass;       // the warp's first row (of the group) this pass
        uint qa[ATT_MT][HEAD_DIM / 16][4];
        float acc[ATT_MT][HEAD_DIM / 8][4], m_run[ATT_MT][2], l_run[ATT_MT][2];
ATT_UNROLL
        for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
            for (int hr = 0; hr < 2; hr++) {
                int t = t0 + rb + 16 * mi + gq + 8 * hr;
                size_t at = ((size_t)t * n_heads + h) * (HEAD_DIM / 2) + tq;   // float2 units
ATT_UNROLL
                for (int c = 0; c < HEAD_DIM / 16; c++) {
                    float2 x0 = t < rows ? q[at + 8 * c] : (float2)(0.0f);       // dims 16c + 2tq..
                    float2 x1 = t < rows ? q[at + 8 * c + 4] : (float2)(0.0f);   // dims 16c + 2tq + 8..
                    qa[mi][c][hr] = ATT_PACK(x0.x * qscale, x0.y * qscale);
                    qa[mi][c][2 + hr] = ATT_PACK(x1.x * qscale, x1.y * qscale);
                }
                m_run[mi][hr] = -INFINITY;
                l_run[mi][hr] = 0.0f;
ATT_UNROLL
                for (int n = 0; n < HEAD_DIM / 8; n++) acc[mi][n][2 * hr] = acc[mi][n][2 * hr + 1] = 0.0f;
            }

        for (int c0 = 0; c0 <= last; c0 += ATT_MMA_BK) {
            // K rows as stored: thread e loads dims 4 d4.. of key i (a warp reads whole rows)
            for (int e = lid; e < ATT_MMA_BK * HEAD_DIM / 4; e += ATT_BQ) {
                int i = e / (HEAD_DIM / 4), d4 = e % (HEAD_DIM / 4);
                size_t at = ((size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM) / 4 + d4;
                ks2[(i * ATT_KS_W) / 2 + d4] = c0 + i <= last ? kg[at] : (uint2)(0u);
            }
            // V transposed: thread e takes keys 2 i2, 2 i2 + 1 at dims 4 d4..; a warp's 32 lanes
            // write 32 consecutive words of each dim row
            for (int e = lid; e < ATT_MMA_BK / 2 * HEAD_DIM / 4; e += ATT_BQ) {
                int i2 = e % (ATT_MMA_BK / 2), d4 = e / (ATT_MMA_BK / 2), key = c0 + 2 * i2;
                size_t at = ((size_t)key * kv_stride + kvh * HEAD_DIM) / 4 + d4;
                uint2 u0 = key <= last ? vg[at] : (uint2)(0u);
                uint2 u1 = key + 1 <= last ? vg[at + kv_stride / 4] : (uint2)(0u);
                __local uint* dst = vt + 4 * d4 * ATT_VT_W + i2;
                dst[0] = (u0.x & 0xFFFFu) | (u1.x << 16);
                dst[ATT_VT_W] = (u0.x >> 16) | (u1.x & 0xFFFF0000u);
                dst[2 * ATT_VT_W] = (u0.y & 0xFFFFu) | (u1.y << 16);
                dst[3 * ATT_VT_W] = (u0.y >> 16) | (u1.y & 0xFFFF0000u);
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            // warp-uniform: skip tiles none of the warp's rows sees, and warps of rows past the step
            bool live = t0 + rb < rows && c0 <= n_past + t0 + rb + 16 * ATT_MT - 1;
#ifdef EMU_MMA
            // emulated MMAs hold barriers, so every warp takes every tile; what a skipped tile
            // did is undone after it, which tests the skip as well
            float keep[ATT_MT][HEAD_DIM / 8 + 1][4];
            for (int mi = 0; mi < ATT_MT; mi++) {
                for (int n = 0; n < HEAD_DIM / 8; n++)
                    for (int i = 0; i < 4; i++) keep[mi][n][i] = acc[mi][n][i];
                for (int hr = 0; hr < 2; hr++) {
                    keep[mi][HEAD_DIM / 8][hr] = m_run[mi][hr];
                    keep[mi][HEAD_DIM / 8][2 + hr] = l_run[mi][hr];
                }
            }
            {
#else
            if (live) {
#endif
                float s[ATT_MT][ATT_MMA_BK / 8][4];
ATT_UNROLL
                for (int j = 0; j < ATT_MMA_BK / 8; j++) {   // S = Q K^T, 8 keys a column tile
ATT_UNROLL
                    for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
                        for (int i = 0; i < 4; i++) s[mi][j][i] = 0.0f;
ATT_UNROLL
                    for (int c = 0; c < HEAD_DIM / 16; c++) {
                        __local const uint* p = ks + (8 * j + gq) * ATT_KS_W + 8 * c + tq;
                        uint b0 = p[0], b1 = p[4];
ATT_UNROLL
                        for (int mi = 0; mi < ATT_MT; mi++) ATT_MMA(s[mi][j], qa[mi][c], b0, b1);
                    }
                }
                bool full = c0 + ATT_MMA_BK - 1 <= n_past + t0 + rb;   // every row sees every key
ATT_UNROLL
                for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
                    for (int hr = 0; hr < 2; hr++) {
                        // the row's keys in this tile: index <= lim (slot <= n_past + t)
                        int lim = n_past + t0 + rb + 16 * mi + gq + 8 * hr - c0;
                        float mx = -INFINITY;
ATT_UNROLL
                        for (int j = 0; j < ATT_MMA_BK / 8; j++)
ATT_UNROLL
                            for (int e = 0; e < 2; e++) {
                                float x = s[mi][j][2 * hr + e];
                                if (!full && 8 * j + 2 * tq + e > lim) x = -INFINITY;
                                s[mi][j][2 * hr + e] = x;
                                mx = fmax(mx, x);
                            }
                        mx = fmax(mx, ATT_XOR(mx, 1));
                        mx = fmax(mx, ATT_XOR(mx, 2));
                        float m_new = fmax(m_run[mi][hr], mx);
                        float m_use = m_new == -INFINITY ? 0.0f : m_new;   // no -inf - -inf
                        float alpha = native_exp2(m_run[mi][hr] - m_use);
                        m_run[mi][hr] = m_new;
                        float ls = 0.0f;   // this lane's part of the row sum (quads add at the end)
ATT_UNROLL
                        for (int j = 0; j < ATT_MMA_BK / 8; j++)
ATT_UNROLL
                            for (int e = 0; e < 2; e++) {
                                float p = native_exp2(s[mi][j][2 * hr + e] - m_use);
                                s[mi][j][2 * hr + e] = p;
                                ls += p;
                            }
                        l_run[mi][hr] = l_run[mi][hr] * alpha + ls;
ATT_UNROLL
                        for (int n = 0; n < HEAD_DIM / 8; n++) {
                            acc[mi][n][2 * hr] *= alpha;
                            acc[mi][n][2 * hr + 1] *= alpha;
                        }
                    }
ATT_UNROLL
                for (int j2 = 0; j2 < ATT_MMA_BK / 16; j2++) {   // O += P V, 16 keys a step
                    uint pa[ATT_MT][4];
ATT_UNROLL
                    for (int mi = 0; mi < ATT_MT; mi++) {
                        pa[mi][0] = ATT_PACK(s[mi][2 * j2][0], s[mi][2 * j2][1]);
                        pa[mi][1] = ATT_PACK(s[mi][2 * j2][2], s[mi][2 * j2][3]);
                        pa[mi][2] = ATT_PACK(s[mi][2 * j2 + 1][0], s[mi][2 * j2 + 1][1]);
                        pa[mi][3] = ATT_PACK(s[mi][2 * j2 + 1][2], s[mi][2 * j2 + 1][3]);
                    }
ATT_UNROLL
                    for (int n = 0; n < HEAD_DIM / 8; n++) {
                        __local const uint* p = vt + (8 * n + gq) * ATT_VT_W + 8 * j2 + tq;
                        uint b0 = p[0], b1 = p[4];
ATT_UNROLL
                        for (int mi = 0; mi < ATT_MT; mi++) ATT_MMA(acc[mi][n], pa[mi], b0, b1);
                    }
                }
            }
#ifdef EMU_MMA
            if (!live)
                for (int mi = 0; mi < ATT_MT; mi++) {
                    for (int n = 0; n < HEAD_DIM / 8; n++)
                        for (int i = 0; i < 4; i++) acc[mi][n][i] = keep[mi][n][i];
                    for (int hr = 0; hr < 2; hr++) {
                        m_run[mi][hr] = keep[mi][HEAD_DIM / 8][hr];
                        l_run[mi][hr] = keep[mi][HEAD_DIM / 8][2 + hr];
                    }
                }
#endif
            barrier(CLK_LOCAL_MEM_FENCE);
        }

ATT_UNROLL
        for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
            for (int hr = 0; hr < 2; hr++) {
                float l = l_run[mi][hr];
                l += ATT_XOR(l, 1);
                l += ATT_XOR(l, 2);
                int t = t0 + rb + 16 * mi + gq + 8 * hr;
                if (t < rows) {
                    size_t at = ((size_t)t * n_heads + h) * (HEAD_DIM / 2) + tq;   // dims 8n + 2tq..
ATT_UNROLL
                    for (int n = 0; n < HEAD_DIM / 8; n++)
                        o[at + 4 * n] = (float2)(acc[mi][n][2 * hr], acc[mi][n][2 * hr + 1]) / l;
                }
            }
    }
}
#endif  // ATT_MMA_BODY
