// RoPE (HF rotate_half: pairs j, j + hd/2) and the KV-cache store.   -DKV_T=<f32|f16>
// Positions: row t is at start_pos + t; the angle is float(pos) * inv_freq[j] in f32.

#define ST_KV(p, i, v) CAT(st_, KV_T)(p, i, v)

// x f32 [M, H*hd]   inv_freq f32 [hd/2]   y f32 [M, H*hd] (may be x itself)
// Grid: (H * hd/2, rows).
__kernel void rope(__global const int* step, gin xb, ulong x_off, gin fb, ulong f_off,
                   gout yb, ulong y_off, int n_heads, int hd) {
    int p = get_global_id(0), t = get_global_id(1), hh = hd / 2;
    if (p >= n_heads * hh) return;
    int head = p / hh, j = p % hh;
    size_t base = (size_t)t * n_heads * hd + head * hd + j;
    __global const float* x = (__global const float*)(xb + x_off);
    __global float* y = (__global float*)(yb + y_off);
    float ang = (float)(STEP_START_POS(step) + t) * ((__global const float*)(fb + f_off))[j];
    float c = cos(ang), s = sin(ang);
    float x1 = x[base], x2 = x[base + hh];
    y[base] = x1 * c - x2 * s;
    y[base + hh] = x2 * c + x1 * s;
}

// src f32 [M, KVH*hd]  ->  cache KV_T [S, KVH, hd] rows n_past + t.   Grid: (KVH*hd, rows).
__kernel void kv_store(__global const int* step, gin sb, ulong s_off, gout cb, ulong c_off, int width) {
    int i = get_global_id(0), t = get_global_id(1);
    if (i >= width) return;
    float v = ((__global const float*)(sb + s_off))[(size_t)t * width + i];
    ST_KV(cb + c_off, (size_t)(STEP_N_PAST(step) + t) * width + i, v);
}
