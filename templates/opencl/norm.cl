// RMSNorm over runs of G values: y = x / sqrt(mean(x^2) + eps) * w for each run, G == D the whole
// row, G == head_dim each head (Qwen3's q/k norms).   -DNORM_T=<f32|f16|bf16>  -DNORM_WG=<threads>
//   x f32 [M, D]      w NORM_T [G]      y f32 [M, D]
// Grid: (NORM_WG * D / G, rows): one group per run of a row.

#define LD_NORM(p, i) CAT(ld_, NORM_T)(p, i)
#ifndef NORM_WG
#define NORM_WG 64
#endif

__kernel __attribute__((reqd_work_group_size(NORM_WG, 1, 1)))
void rms_norm(__global const int* step, gin xb, ulong x_off, gin wb, ulong w_off,
              gout yb, ulong y_off, int D, float eps, int G) {
    int lid = get_local_id(0), t = get_group_id(1);
    size_t at = (size_t)t * D + (size_t)get_group_id(0) * G;   // the run's first value
    __global const float* x = (__global const float*)(xb + x_off) + at;
    __global float* y = (__global float*)(yb + y_off) + at;
    gin w = wb + w_off;
    __local float red[NORM_WG];
    float ss = 0.0f;
    for (int i = lid; i < G; i += NORM_WG) ss += x[i] * x[i];
    float rms = sqrt(wg_sum(ss, red) / (float)G + eps);
    for (int i = lid; i < G; i += NORM_WG) y[i] = x[i] / rms * LD_NORM(w, i);
}
