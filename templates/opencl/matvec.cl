// Decode matvec; weight access, slot_row() and the epilogues come from matmul_common.cl.
//   -DMV_WG=<threads, a multiple of 32>   -DMV_ROWS=<weight rows (slots) per group>
//
// One token per group row (grid dim 1 = tokens), MV_ROWS weight rows per group. The group's
// threads split K: quantized weights one 32-value block per thread step (16 or 32 B of
// quants + the f16 scale), float weights one 8-value unit (16 B). A thread loads and (for
// quantized weights) Q8_0-quantizes its piece of x once and reuses it for all MV_ROWS rows,
// so weight bytes are the only stream; neighbouring threads read neighbouring 16 B.
// Grid: (groups * MV_WG, rows of x).

#ifndef MV_WG
#define MV_WG 64
#endif
#ifndef MV_ROWS
#define MV_ROWS 4
#endif
#define MV_BATCH (MV_ROWS < 16 ? MV_ROWS : 16)   // rows whose loads are in flight together

#ifdef W_QUANT
// x's block b (after the RMS prologue) quantized to Q8_0 as quantize_row_q8_0_ref:
// d = amax / 127 (kept as f16), q = round(x / d) half away from zero
inline void quantize_x(__global const float4* x4, int b, int* xq, float* xd, int* xs
#ifdef PROLOGUE_RMS
                       , gin nw, float rms
#endif
                       ) {
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
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) {
        float4 q = round(v[i] * id);
        sum += (q.x + q.y) + (q.z + q.w);
        xq[i] = as_int(convert_char4(q));
    }
    *xd = round_to_half(d);
    *xs = (int)sum;
}
#endif

__kernel __attribute__((reqd_work_group_size(MV_WG, 1, 1)))
void matvec(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off,
            gin nwb, ulong nw_off, gout e0b, ulong e0_off, gout e1b, ulong e1_off,
            gout e2b, ulong e2_off, gout yb, ulong y_off,
            int M, int K, int N, float eps, int n_heads, int n_kv_heads, int hd) {
    int lid = get_local_id(0), g = get_group_id(0), t = get_group_id(1);
    __global const float4* x4 = (__global const float4*)(xb + x_off) + (size_t)t * (K / 4);  // [K/4]
    gin w = wb + w_off;
    __local float red[MV_ROWS * MV_WG];   // partial sums: [MV_ROWS][MV_WG] (or [warps][MV_ROWS])
    __local float out[MV_ROWS];           // the group's finished dot products, by slot

#ifdef PROLOGUE_RMS
    gin nw = nwb + nw_off;
    float ss = 0.0f;
    for (int i = lid; i < K / 4; i += MV_WG) {
        float4 v = x4[i];
        ss += dot(v, v);
    }
    float rms = sqrt(group_sum(ss, red) / (float)K + eps);
#endif

    int rows[MV_ROWS];
    float acc[MV_ROWS];
#ifdef W_QUANT
    int xq[8], xs = 0;      // this thread's Q8_0 block of x: 32 int8 packed 4 per int, their sum
    float xd = 0.0f;        // and its scale
#else
    float8 xv = (float8)(0.0f);
#endif
    for (int r = 0; r < MV_ROWS; r++) {
        rows[r] = slot_row(g, r, MV_ROWS, N, n_heads, n_kv_heads, hd);
        acc[r] = 0.0f;
    }
#ifdef W_QUANT
    size_t nb = K / 32, nblk = (size_t)N * nb;
    for (int b = lid; b < (int)nb; b += MV_WG) {
      for (int r0 = 0; r0 < MV_ROWS; r0 += MV_BATCH) {
        // all of a batch's weight loads issue before any is used: DRAM latency once per batch
        WQ_T wq[MV_BATCH];
        float wd[MV_BATCH];
#pragma unroll
        for (int i = 0; i < MV_BATCH; i++) {
            size_t blk = (size_t)max(rows[r0 + i], 0) * nb + b;   // a padding slot reads row 0
            wq[i] = WQ_LOAD(w, blk);
            wd[i] = wscale(w, blk, nblk);
        }
        if (r0 == 0) quantize_x(x4, b, xq, &xd, &xs
#ifdef PROLOGUE_RMS
                                , nw, rms
#endif
                                );
#pragma unroll
        for (int i = 0; i < MV_BATCH; i++)
            acc[r0 + i] += (float)wq_idot(wq[i], xq, xs) * (xd * wd[i]);
      }
    }
#else
    int nu = K / 8;
    for (int u = lid; u < nu; u += MV_WG) {
      for (int r0 = 0; r0 < MV_ROWS; r0 += MV_BATCH) {
        WU_T wu[MV_BATCH];
#pragma unroll
        for (int i = 0; i < MV_BATCH; i++) wu[i] = wunit_load(w, (size_t)max(rows[r0 + i], 0) * nu + u);
        if (r0 == 0) {
            float4 lo = x4[2 * u], hi = x4[2 * u + 1];
#ifdef PROLOGUE_RMS
            lo = lo / rms * LD4_NORM(nw, 2 * u);
            hi = hi / rms * LD4_NORM(nw, 2 * u + 1);
#endif
            xv = (float8)(lo, hi);
        }
#pragma unroll
        for (int i = 0; i < MV_BATCH; i++) acc[r0 + i] += wunit_dot_bits(wu[i], xv);
      }
    }
#endif

#ifdef USE_NV_PTX
    for (int r = 0; r < MV_ROWS; r++) acc[r] = warp_sum(acc[r]);
    barrier(CLK_LOCAL_MEM_FENCE);
    if ((lid & 31) == 0)
        for (int r = 0; r < MV_ROWS; r++) red[(lid >> 5) * MV_ROWS + r] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = lid; r < MV_ROWS; r += MV_WG) {
        float s = 0.0f;
        for (int wi = 0; wi < MV_WG / 32; wi++) s += red[wi * MV_ROWS + r];
        out[r] = s;
    }
#else
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < MV_ROWS; r++) red[r * MV_WG + lid] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = MV_WG / 2; s > 0; s >>= 1) {
        if (lid < s)
            for (int r = 0; r < MV_ROWS; r++) red[r * MV_WG + lid] += red[r * MV_WG + lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int r = lid; r < MV_ROWS; r += MV_WG) out[r] = red[r * MV_WG];
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
#if defined(EPI_ROPE_KV) && defined(KV_Q8_0)
    if (lid < MV_ROWS / 32)
        epilogue_chunk(t, g, lid, MV_ROWS, out, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                       yb + y_off, N, n_heads, n_kv_heads, hd, STEP_N_PAST(step), STEP_START_POS(step));
#else
    for (int r = lid; r < MV_ROWS; r += MV_WG)
        epilogue(t, g, r, MV_ROWS, out, 1, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                 yb + y_off, N, n_heads, n_kv_heads, hd, STEP_N_PAST(step), STEP_START_POS(step));
#endif
}
