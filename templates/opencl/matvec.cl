// Decode matvec; weight blocks, slot_row() and epilogue() come from matmul_common.cl.

#ifndef MV_WG
#define MV_WG 64
#endif
#ifndef MV_ROWS
#define MV_ROWS 4
#endif

// Decode: one token per group row (grid dim 1 = tokens), MV_ROWS weight rows per group, the
// group's threads split K by blocks. Grid: (groups * MV_WG, rows of x).
__kernel __attribute__((reqd_work_group_size(MV_WG, 1, 1)))
void matvec(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off,
            gin nwb, ulong nw_off, gout e0b, ulong e0_off, gout e1b, ulong e1_off,
            gout e2b, ulong e2_off, gout yb, ulong y_off,
            int M, int K, int N, float eps, int n_heads, int n_kv_heads, int hd) {
    int lid = get_local_id(0), g = get_group_id(0), t = get_group_id(1);
    __global const float* x = (__global const float*)(xb + x_off) + (size_t)t * K;
    gin w = wb + w_off;
    size_t row_bytes = (size_t)(K / 32) * W_BLOCK_BYTES;
    __local float red[MV_ROWS * MV_WG];   // [MV_ROWS][MV_WG] partial sums
    int nb = K / 32;

#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
    float ss = 0.0f;
    for (int k = lid; k < K; k += MV_WG) ss += x[k] * x[k];
    float rms = sqrt(wg_sum(ss, red) / (float)K + eps);
#endif

    int rows[MV_ROWS];
    float acc[MV_ROWS];
    for (int r = 0; r < MV_ROWS; r++) {
        rows[r] = slot_row(g, r, MV_ROWS, N, n_heads, n_kv_heads, hd);
        acc[r] = 0.0f;
    }
    for (int b = lid; b < nb; b += MV_WG) {
        float16 x0 = vload16(2 * b, x), x1 = vload16(2 * b + 1, x);
#ifdef PROLOGUE_RMS
        x0 = x0 / rms * LD16_NORM(nw, 2 * b);
        x1 = x1 / rms * LD16_NORM(nw, 2 * b + 1);
#endif
#ifdef W_QUANT
        float xd = quantize_q8_block(&x0, &x1);
#endif
        for (int r = 0; r < MV_ROWS; r++) {
            if (rows[r] < 0) continue;
            gin blk = w + rows[r] * row_bytes + (size_t)b * W_BLOCK_BYTES;
#ifdef W_QUANT
            acc[r] += wblock_dot(blk, x0, x1) * (xd * wblock_scale(blk));
#else
            acc[r] += wblock_dot(blk, x0, x1);
#endif
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < MV_ROWS; r++) red[r * MV_WG + lid] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = MV_WG / 2; s > 0; s >>= 1) {
        if (lid < s)
            for (int r = 0; r < MV_ROWS; r++) red[r * MV_WG + lid] += red[r * MV_WG + lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < MV_ROWS)
        epilogue(t, g, lid, MV_ROWS, red, MV_WG, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                 yb + y_off, N, n_heads, n_kv_heads, hd, STEP_N_PAST(step), STEP_START_POS(step));
}

