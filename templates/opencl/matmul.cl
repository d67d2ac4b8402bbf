// Prefill matmul; weight blocks, slot_row() and epilogue() come from matmul_common.cl.

// Prefill: a TM-token x TN-row tile per group, K walked one 32-value block at a time through
// local memory (each block of a token is one Q8_0 block). 256 threads; thread (ty, tx) owns
// tokens 4ty..4ty+3 and rows 64h + 4tx..64h + 4tx + 3 for h < TN / 64: 16 or 32 outputs, and per
// k it reads 1 + TN / 64 float4 from local memory. The tiles sit k-major in local memory
// (xs [32][TM], ws [32][TN]) so those reads are float4 across tokens / rows.
//   -DTN=<64|128>   weight rows per group (128: fewer x reloads; 64: more groups for narrow N)
// Grid: (groups * 256, ceil(rows / TM)).
#define TM 64
#ifndef TN
#define TN 128
#endif
#define TN_H (TN / 64)        // 64-row halves of the tile
#define XR_STRIDE 33          // raw x rows [TM][33]: pad so a token's 32 values hit distinct banks
#define XS_STRIDE (TM + 4)    // k-major x [32][TM + 4]
#define WS_STRIDE (TN + 4)    // k-major w [32][TN + 4]
#define LDS_FLOATS (TM * XR_STRIDE + 32 * XS_STRIDE + 32 * WS_STRIDE)

__kernel __attribute__((reqd_work_group_size(256, 1, 1)))
void matmul_tiled(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off,
                  gin nwb, ulong nw_off, gout e0b, ulong e0_off, gout e1b, ulong e1_off,
                  gout e2b, ulong e2_off, gout yb, ulong y_off,
                  int M, int K, int N, float eps, int n_heads, int n_kv_heads, int hd) {
    int lid = get_local_id(0), g = get_group_id(0), t0 = get_group_id(1) * TM;
    int rows = min(M, STEP_N_TOKENS(step));
    __global const float* x = (__global const float*)(xb + x_off);
    gin w = wb + w_off;
    size_t nb = K / 32, nblk = (size_t)N * nb;
    __local float lds[LDS_FLOATS];   // xr, xs, ws; at the end out [TM][TN]
    __local float* xr = lds;                                   // [TM][XR_STRIDE]
    __local float* xs = lds + TM * XR_STRIDE;                  // [32][XS_STRIDE]
    __local float* ws = xs + 32 * XS_STRIDE;                   // [32][WS_STRIDE]
    __local float xd[TM], xid[TM], wd[TN], rms[TM];
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);

#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
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

    for (int b = 0; b < K / 32; b++) {
        for (int e = lid; e < TM * 32; e += 256) {   // x: coalesced along k
            int tt = e >> 5, k = e & 31;
            float v = 0.0f;
            if (t0 + tt < rows) {
                v = x[(size_t)(t0 + tt) * K + b * 32 + k];
#ifdef PROLOGUE_RMS
                v = v / rms[tt] * LD_NORM(nw, b * 32 + k);
#endif
            }
            xr[tt * XR_STRIDE + k] = v;
        }
        for (int e = lid; e < TN * 32; e += 256) {   // w: along k, stored k-major
            int n = e >> 5, k = e & 31, row = rowmap[n];
            ws[k * WS_STRIDE + n] = row >= 0 ? welem(w, (size_t)row * nb + b, k, nblk) : 0.0f;
        }
#ifdef W_QUANT
        for (int n = lid; n < TN; n += 256) {
            int row = rowmap[n];
            wd[n] = row >= 0 ? wscale(w, (size_t)row * nb + b, nblk) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < TM) {
            float amax = 0.0f;
            for (int k = 0; k < 32; k++) amax = fmax(amax, fabs(xr[lid * XR_STRIDE + k]));
            float d = amax / 127.0f;
            xid[lid] = d != 0.0f ? 1.0f / d : 0.0f;
            xd[lid] = round_to_half(d);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < TM * 32; e += 256) {   // k-major, quantized: thread e -> token e % TM
            int tt = e % TM, k = e / TM;
            xs[k * XS_STRIDE + tt] = round(xr[tt * XR_STRIDE + k] * xid[tt]);
        }
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
#ifdef W_QUANT
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
#if defined(EPI_ROPE_KV) && defined(KV_Q8_0)
    for (int e = lid; e < TM * (TN / 32); e += 256) {
        int tt = e / (TN / 32), c = e % (TN / 32);
        if (t0 + tt < rows)
            epilogue_chunk(t0 + tt, g, c, TN, out + tt * TN, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                           yb + y_off, N, n_heads, n_kv_heads, hd, STEP_N_PAST(step), STEP_START_POS(step));
    }
#else
    for (int e = lid; e < TM * TN; e += 256) {
        int tt = e / TN, r = e % TN;
        if (t0 + tt < rows)
            epilogue(t0 + tt, g, r, TN, out + tt * TN, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                     yb + y_off, N, n_heads, n_kv_heads, hd, STEP_N_PAST(step), STEP_START_POS(step));
    }
#endif
}
