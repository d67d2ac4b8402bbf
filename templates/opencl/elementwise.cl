// Row-wise elementwise ops on f32 [M, D]; grid (D, rows), one thread per element.

__kernel void add(__global const int* step, gin ab, ulong a_off, gin bb, ulong b_off,
                  gout yb, ulong y_off, int D) {
    int d = get_global_id(0);
    if (d >= D) return;
    size_t i = (size_t)get_global_id(1) * D + d;
    ((__global float*)(yb + y_off))[i] = ((__global const float*)(ab + a_off))[i] + ((__global const float*)(bb + b_off))[i];
}

__kernel void mul(__global const int* step, gin ab, ulong a_off, gin bb, ulong b_off,
                  gout yb, ulong y_off, int D) {
    int d = get_global_id(0);
    if (d >= D) return;
    size_t i = (size_t)get_global_id(1) * D + d;
    ((__global float*)(yb + y_off))[i] = ((__global const float*)(ab + a_off))[i] * ((__global const float*)(bb + b_off))[i];
}

// silu(g) * u; silu alone passes u = null and D_u = 0.
__kernel void silu_mul(__global const int* step, gin gb, ulong g_off, gin ub, ulong u_off,
                       gout yb, ulong y_off, int D, int with_u) {
    int d = get_global_id(0);
    if (d >= D) return;
    size_t i = (size_t)get_global_id(1) * D + d;
    float g = ((__global const float*)(gb + g_off))[i];
    float s = g / (1.0f + exp(-g));
    if (with_u) s *= ((__global const float*)(ub + u_off))[i];
    ((__global float*)(yb + y_off))[i] = s;
}

// slice(rows="last"): y[0] = x[n_tokens - 1].   Grid: (D, 1).
__kernel void last_row(__global const int* step, gin xb, ulong x_off, gout yb, ulong y_off, int D) {
    int d = get_global_id(0);
    if (d >= D) return;
    size_t src = (size_t)(STEP_N_TOKENS(step) - 1) * D + d;
    ((__global float*)(yb + y_off))[d] = ((__global const float*)(xb + x_off))[src];
}

// gather: y[r] = x[rows[r]], a step graph's rows that need logits.   Grid: (D, R).
// Row ids were range-checked on the host (runtime/backends/opencl_step.py).
__kernel void gather_rows(__global const int* step, gin xb, ulong x_off, gin rb, ulong r_off,
                          gout yb, ulong y_off, int D) {
    int d = get_global_id(0), r = get_global_id(1);
    if (d >= D) return;
    size_t src = (size_t)((__global const int*)(rb + r_off))[r] * D + d;
    ((__global float*)(yb + y_off))[(size_t)r * D + d] = ((__global const float*)(xb + x_off))[src];
}
