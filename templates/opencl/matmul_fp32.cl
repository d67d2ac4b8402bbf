// matmul_tiled's portable fp32 body (matmul.cl): every device, every weight type. K is walked
// one 32-value block at a time through local memory (each block of a token is one Q8_0 block,
// Q8_1 with its s for q4_1 weights, as stage_x wrote it; with -DK_TAIL, float weights whose K is
// no multiple of 32, the last block is cut at K and read value by value). 256 threads; thread
// (ty, tx) owns tokens 4ty..4ty+3 and rows 64h + 4tx..64h + 4tx + 3 for h < TN / 64: 16 or 32
// outputs, and per k it reads 1 + TN / 64 float4 from local memory. The tiles sit k-major in
// local memory (xs [32][TM], ws [32][TN]) so those reads are float4 across tokens / rows.
// Paired token tiles (MM_TPAIR) are taken one after the other.
#ifndef MMA_BODY
#define TN_H (TN / 64)        // 64-row halves of the tile
#define XR_STRIDE 33          // raw x rows [TM][33]: pad so a token's 32 values hit distinct banks
#define XS_STRIDE (TM + 4)    // k-major x [32][TM + 4]
#define WS_STRIDE (TN + 4)    // k-major w [32][TN + 4]
#define LDS_FLOATS (TM * XR_STRIDE + 32 * XS_STRIDE + 32 * WS_STRIDE)

MATMUL_TILED_BEGIN
    size_t nb = K / 32, nblk = (size_t)N * nb;
    __local float lds[LDS_FLOATS] __attribute__((aligned(16)));   // xr, xs, ws; at the end out [TM][TN] (float4: split_merge)
    __local float* xr = lds;                                   // [TM][XR_STRIDE]
    __local float* xs = lds + TM * XR_STRIDE;                  // [32][XS_STRIDE]
    __local float* ws = xs + 32 * XS_STRIDE;                   // [32][WS_STRIDE]
    __local float xd[TM], wd[TN], rms[TM];
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
                  n_heads, n_kv_heads, hd, step TILE_EPI_EXTRA);
    TILE_LOOP_END
}
#endif  // !MMA_BODY
