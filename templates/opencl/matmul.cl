// Prefill matmul; weight blocks, slot_row() and epilogue() come from matmul_common.cl.

// Prefill: a TM-token x TN-row tile per group, K walked one 32-value block at a time through
// local memory (each block of a token is one Q8_0 block). 256 threads, 4x4 outputs each.
// Grid: (groups * 256, ceil(rows / TM)).
#define TM 64
#define TN 64
#define LDS_STRIDE 33   // pad a 32-float row so column reads hit distinct banks

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
    __local float lds[(TM + TN) * LDS_STRIDE];   // xs [TM][33] then ws [TN][33]; later out [TM][TN]
    __local float* xs = lds;
    __local float* ws = lds + TM * LDS_STRIDE;
    __local float xd[TM], xid[TM], wd[TN], rms[TM];
    __local int rowmap[TN];
    if (lid < TN) rowmap[lid] = slot_row(g, lid, TN, N, n_heads, n_kv_heads, hd);

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
        xs[part * TM + tl] = ss;
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < TM)
            rms[lid] = sqrt((((xs[lid] + xs[TM + lid]) + xs[2 * TM + lid]) + xs[3 * TM + lid]) / (float)K + eps);
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);

    int tx = lid % 16, ty = lid / 16;
    float acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;

    for (int b = 0; b < K / 32; b++) {
        for (int e = lid; e < TM * 32; e += 256) {
            int tt = e >> 5, k = e & 31;
            float v = 0.0f;
            if (t0 + tt < rows) {
                v = x[(size_t)(t0 + tt) * K + b * 32 + k];
#ifdef PROLOGUE_RMS
                v = v / rms[tt] * LD_NORM(nw, b * 32 + k);
#endif
            }
            xs[tt * LDS_STRIDE + k] = v;
        }
        for (int e = lid; e < TN * 32; e += 256) {
            int n = e >> 5, k = e & 31, row = rowmap[n];
            ws[n * LDS_STRIDE + k] = row >= 0 ? welem(w, (size_t)row * nb + b, k, nblk) : 0.0f;
        }
#ifdef W_QUANT
        if (lid < TN) {
            int row = rowmap[lid];
            wd[lid] = row >= 0 ? wscale(w, (size_t)row * nb + b, nblk) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < TM) {
            float amax = 0.0f;
            for (int k = 0; k < 32; k++) amax = fmax(amax, fabs(xs[lid * LDS_STRIDE + k]));
            float d = amax / 127.0f;
            xid[lid] = d != 0.0f ? 1.0f / d : 0.0f;
            xd[lid] = round_to_half(d);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < TM * 32; e += 256) {
            int tt = e >> 5, k = e & 31;
            xs[tt * LDS_STRIDE + k] = round(xs[tt * LDS_STRIDE + k] * xid[tt]);
        }
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        float p[4][4];
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++) p[j][i] = 0.0f;
        for (int k = 0; k < 32; k++) {
            float xk[4], wk[4];
            for (int j = 0; j < 4; j++) xk[j] = xs[(ty + 16 * j) * LDS_STRIDE + k];
            for (int i = 0; i < 4; i++) wk[i] = ws[(tx + 16 * i) * LDS_STRIDE + k];
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) p[j][i] += xk[j] * wk[i];
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++)
#ifdef W_QUANT
                acc[j][i] += p[j][i] * (xd[ty + 16 * j] * wd[tx + 16 * i]);
#else
                acc[j][i] += p[j][i];
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    __local float* out = lds;   // [TM][TN]
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) out[(ty + 16 * j) * TN + tx + 16 * i] = acc[j][i];
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
