// Row reductions over f32 [M, D]; one group of RED_WG threads per row.  Grid: (RED_WG, rows).
#ifndef RED_WG
#define RED_WG 256
#endif

__kernel __attribute__((reqd_work_group_size(RED_WG, 1, 1)))
void softmax(__global const int* step, gin xb, ulong x_off, gout yb, ulong y_off, int D) {
    int lid = get_local_id(0), t = get_group_id(1);
    __global const float* x = (__global const float*)(xb + x_off) + (size_t)t * D;
    __global float* y = (__global float*)(yb + y_off) + (size_t)t * D;
    __local float red[RED_WG];
    float m = -INFINITY;
    for (int i = lid; i < D; i += RED_WG) m = fmax(m, x[i]);
    m = wg_max(m, red);
    float s = 0.0f;
    for (int i = lid; i < D; i += RED_WG) s += exp(x[i] - m);
    s = wg_sum(s, red);
    for (int i = lid; i < D; i += RED_WG) y[i] = exp(x[i] - m) / s;
}

// y[t] = index of the first maximum of row t (numpy's argmax), i32 [M].
__kernel __attribute__((reqd_work_group_size(RED_WG, 1, 1)))
void argmax(__global const int* step, gin xb, ulong x_off, gout yb, ulong y_off, int D) {
    int lid = get_local_id(0), t = get_group_id(1);
    __global const float* x = (__global const float*)(xb + x_off) + (size_t)t * D;
    __local float best[RED_WG];
    __local int where[RED_WG];
    float b = -INFINITY;
    int at = D;
    for (int i = lid; i < D; i += RED_WG)
        if (x[i] > b || (at == D && x[i] == b)) { b = x[i]; at = i; }
    best[lid] = b;
    where[lid] = at;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            float ob = best[lid + s];
            int oa = where[lid + s];
            if (ob > best[lid] || (ob == best[lid] && oa < where[lid])) { best[lid] = ob; where[lid] = oa; }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) ((__global int*)(yb + y_off))[t] = where[0] == D ? 0 : where[0];
}
