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

// Greedy sampling on the device: y[t] = argmax of row t (first of equal maxima), i32 [M], over
// ARG_GROUPS groups per row so a 128K vocabulary is read by many cores; each group leaves
// its best (value, index) in scratch and takes a ticket, the last one merges them and puts
// the counter back to 0.
//   scratch  int counters [M], then [M, ARG_GROUPS] x (f32 value, i32 index)
// Grid: (ARG_GROUPS * RED_WG, rows).
// -DARG_ADVANCE (decode, one row): the merging group also feeds the next step, so many greedy
// steps run back to back with no host round trip: y[step[3]] = token (the batch's k-th
// result), the token into the graph's input tb (int32 [1]), and n_past, start_pos and k
// (step[1..3]) each + 1.
#ifndef ARG_GROUPS
#define ARG_GROUPS 32
#endif

inline void better(float* b, int* at, float ob, int oa) {
    if (ob > *b || (ob == *b && oa < *at)) { *b = ob; *at = oa; }
}

__kernel __attribute__((reqd_work_group_size(RED_WG, 1, 1)))
void argmax_split(__global const int* step, gin xb, ulong x_off, gout yb, ulong y_off,
                  gout sb, ulong s_off, int D, int M
#ifdef ARG_ADVANCE
                  , gout tb, ulong t_off
#endif
                  ) {
    int lid = get_local_id(0), g = get_group_id(0), t = get_group_id(1);
    __global const float* x = (__global const float*)(xb + x_off) + (size_t)t * D;
    __local float best[RED_WG];
    __local int where[RED_WG];
    __local int last;
    float b = -INFINITY;
    int at = D;
    for (int i = g * RED_WG + lid; i < D; i += ARG_GROUPS * RED_WG) better(&b, &at, x[i], i);
    best[lid] = b;
    where[lid] = at;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            float bb = best[lid];
            int aa = where[lid];
            better(&bb, &aa, best[lid + s], where[lid + s]);
            best[lid] = bb;
            where[lid] = aa;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    __global volatile int* count = (__global volatile int*)(sb + s_off) + t;
    __global volatile int* parts = (__global volatile int*)(sb + s_off) + M + (size_t)t * ARG_GROUPS * 2;
    if (lid == 0) {
        parts[2 * g] = as_int(best[0]);
        parts[2 * g + 1] = where[0];
        DEVICE_FENCE();   // the partial reaches memory before the ticket
        last = atomic_inc(count) == ARG_GROUPS - 1;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last || lid != 0) return;
    DEVICE_FENCE();
    float bb = -INFINITY;
    int aa = D;
    for (int p = 0; p < ARG_GROUPS; p++) better(&bb, &aa, as_float(parts[2 * p]), parts[2 * p + 1]);
    int tok = aa == D ? 0 : aa;
#ifdef ARG_ADVANCE
    __global int* st = (__global int*)step;   // the back end allocates it read-write
    ((__global int*)(yb + y_off))[st[3]] = tok;
    ((__global int*)(tb + t_off))[0] = tok;
    st[1] += 1;
    st[2] += 1;
    st[3] += 1;
#else
    ((__global int*)(yb + y_off))[t] = tok;
#endif
    *count = 0;
}
