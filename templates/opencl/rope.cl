// RoPE (HF rotate_half: pairs j, j + hd/2) and the KV-cache store.
//   -DKV_T=<f32|f16|q8_0|q4_0> -DKV_<T>
// Positions: row t is at start_pos + t; the angle is float(pos) * inv_freq[j] in f32.
// -DSTEP_ROWS (a step graph's rows, compiler/ir.py "Step graphs"): each kernel takes one more
// i32 [M] input, rope the rows' positions, kv_store the cache rows (slots) they write.
#ifdef STEP_ROWS
#define ROW_INDEX_ARGS , gin ib, ulong i_off
#define ROW_INDEX(t) (((__global const int*)(ib + i_off))[t])
#define SLOTS_ARG , int n_slots          // kv_store: the cache's rows S
#else
#define ROW_INDEX_ARGS
#define SLOTS_ARG
#endif

#ifndef KV_BLOCKS
#define ST_KV(p, i, v) CAT(st_, KV_T)(p, i, v)
#endif

// x f32 [M, H*hd]   inv_freq f32 [hd/2]   y f32 [M, H*hd] (may be x itself)
// Grid: (H * hd/2, rows).
__kernel void rope(__global const int* step, gin xb, ulong x_off, gin fb, ulong f_off,
                   gout yb, ulong y_off, int n_heads, int hd ROW_INDEX_ARGS) {
    int p = get_global_id(0), t = get_global_id(1), hh = hd / 2;
    if (p >= n_heads * hh) return;
    int head = p / hh, j = p % hh;
    size_t base = (size_t)t * n_heads * hd + head * hd + j;
    __global const float* x = (__global const float*)(xb + x_off);
    __global float* y = (__global float*)(yb + y_off);
#ifdef STEP_ROWS
    float ang = (float)ROW_INDEX(t) * ((__global const float*)(fb + f_off))[j];
#else
    float ang = (float)(STEP_START_POS(step) + t) * ((__global const float*)(fb + f_off))[j];
#endif
    float c, s = sincos(ang, &c);   // one range reduction for both
    float x1 = x[base], x2 = x[base + hh];
    y[base] = x1 * c - x2 * s;
    y[base + hh] = x2 * c + x1 * s;
}

// src f32 [M, KVH*hd]  ->  cache KV_T [S, KVH, hd] rows n_past + t (STEP_ROWS: rows slots[t]).
// Grid: (KVH*hd, rows), or (KVH*hd/32, rows) for q8_0 / q4_0: one thread per 32-value block.
__kernel void kv_store(__global const int* step, gin sb, ulong s_off, gout cb, ulong c_off, int width
                       ROW_INDEX_ARGS SLOTS_ARG) {
    int i = get_global_id(0), t = get_global_id(1);
    __global const float* src = (__global const float*)(sb + s_off) + (size_t)t * width;
#ifdef STEP_ROWS
    // the runtime refuses a step whose slots leave the cache (opencl_step.py check_step); a bad
    // slot that got here anyway must not write into the memory next to the cache (another
    // layer's keys, or past the buffer): its row is dropped
    int slot = ROW_INDEX(t);
    if (slot < 0 || slot >= n_slots) return;
#else
    int slot = STEP_N_PAST(step) + t;
#endif
#ifdef KV_Q4_0
    if (i >= width / 32) return;
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = src[32 * i + j];
    store_q4_0_block(cb + c_off + ((size_t)slot * (width / 32) + i) * 18, x);
#elif defined(KV_Q8_0)
    if (i >= width / 32) return;
    float16 x0 = vload16(2 * i, src), x1 = vload16(2 * i + 1, src);
    float d = quantize_q8_block(&x0, &x1);
    gout blk = cb + c_off + ((size_t)slot * (width / 32) + i) * 34;
    vstore_half_rte(d, 0, (__global half*)blk);
    vstore16(convert_char16(x0), 0, (__global char*)(blk + 2));
    vstore16(convert_char16(x1), 1, (__global char*)(blk + 2));
#else
    if (i >= width) return;
    ST_KV(cb + c_off, (size_t)slot * width + i, src[i]);
#endif
}
