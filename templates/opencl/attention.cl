// Causal GQA attention over the KV cache: row t of the step sees cache slots [0, n_past + t].
//   -DHEAD_DIM=<hd, a multiple of 4, at most 4 * ATT_WG>  -DKV_T=<f32|f16|q8_0|q4_0> -DKV_<T>
//   -DATT_WG=<threads, a multiple of 32>  -DATT_SPLITS=<groups per head>
//   q  f32 [M, H*hd]        k, v  KV_T [S, KVH, hd]        o  f32 [M, H*hd]
// Softmax is online (running max and sum, rescaled per chunk of keys), so any context length
// runs in a fixed amount of local memory.
// The other bodies are files of their own, built after this one: attention_decode.cl (decode,
// one key per lane), attention_tiled.cl (prefill, portable) and attention_mma.cl (its tensor-core body).

#define LD_KV(p, i) CAT(ld_, KV_T)(p, i)
#ifndef ATT_WG
#define ATT_WG 128
#endif
#define ATT_CHUNK 512          // keys scored per pass
#ifndef ATT_SPLITS
#define ATT_SPLITS 1
#endif

// 4 consecutive cache elements from element i (a multiple of 4)
#if defined(KV_F16)
inline float4 ld_kv4(gin p, size_t i) {
    uint2 u = ((__global const uint2*)p)[i >> 2];
    return (float4)(half2_bits_to_float2(u.x), half2_bits_to_float2(u.y));
}
#elif defined(KV_F32)
inline float4 ld_kv4(gin p, size_t i) { return ((__global const float4*)p)[i >> 2]; }
#else
inline float4 ld_kv4(gin p, size_t i) { return (float4)(LD_KV(p, i), LD_KV(p, i + 1), LD_KV(p, i + 2), LD_KV(p, i + 3)); }
#endif

// Decode (any step whose query rows see n_past + t + 1 slots), split-K as flash-decoding, one
// group per (query head, split): it scores slots [s * span, (s + 1) * span) with an online
// softmax, writes its partial (max m, sum l, o[hd] unnormalised) to scratch and takes a ticket;
// the last of the ATT_SPLITS groups of (t, head) merges the partials, writes o and puts the
// ticket counter back to 0 for the next launch. One group per head alone leaves most of a large
// GPU idle. (A group for all query heads of a KV head, each K and V row read once: H200 167 ->
// 185 us a step, round 2.)
//   scratch  int counters [M, H], then f32 partials [M, H, ATT_SPLITS, hd + 2]
// Threads: scores one key each; the V sum as (part, 4 dims): ATT_WG * 4 / hd parts of the keys
// (rounded down: where hd / 4 does not divide ATT_WG, the threads left over take no part).
// Grid: (H * ATT_SPLITS * ATT_WG, rows).
#define ATT_D4 (HEAD_DIM / 4)
#define ATT_VPARTS (ATT_WG / ATT_D4)

// the group's max (is_max) or sum of v; red holds ATT_WG floats
inline float group_reduce(float v, __local float* red, bool is_max) {
    int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
#ifdef USE_NV_PTX
    int lane = lid & 31, warp = lid >> 5;
    float r = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) red[warp] = r;
    barrier(CLK_LOCAL_MEM_FENCE);
    r = red[0];
    for (int w = 1; w < ATT_WG / 32; w++) {
        float x = red[w];
        r = is_max ? fmax(r, x) : r + x;
    }
    return r;
#else
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = ATT_WG / 2; s > 0; s >>= 1) {
        if (lid < s) {
            float a = red[lid], b = red[lid + s];
            red[lid] = is_max ? fmax(a, b) : a + b;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return red[0];
#endif
}

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_split(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                     gin vb, ulong v_off, gout ob, ulong o_off, gout sb, ulong s_off,
                     int n_heads, int n_kv_heads, float scale, int M) {
    int lid = get_local_id(0), t = get_group_id(1);
    int h = get_group_id(0) / ATT_SPLITS, split = get_group_id(0) % ATT_SPLITS;
    int kvh = h / (n_heads / n_kv_heads);
    int length = STEP_N_PAST(step) + t + 1;
    int span = (length + ATT_SPLITS - 1) / ATT_SPLITS;
    int begin = min(length, split * span), end = min(length, begin + span);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    size_t head_at = (size_t)kvh * HEAD_DIM;       // element index of this head in a cache row
    __local float4 qs[ATT_D4];                      // q of the head [hd/4]
    __local float sc[ATT_CHUNK];                    // scores, then p; at the end the V parts
                                                    // [VPARTS][hd]
#ifdef USE_NV_PTX
    __local float red[ATT_WG / 32];
#else
    __local float red[ATT_WG];
#endif
    __local int last;
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h) * ATT_D4;
    for (int e = lid; e < ATT_D4; e += ATT_WG) qs[e] = q[e];
    barrier(CLK_LOCAL_MEM_FENCE);

    int d4 = lid % ATT_D4, part = lid / ATT_D4;
#if ATT_WG % ATT_D4
    if (part >= ATT_VPARTS) part = ATT_CHUNK;       // left over: past every chunk's keys
#endif
    float m_run = -INFINITY, l_run = 0.0f;
    float4 o = (float4)(0.0f);
    for (int c0 = begin; c0 < end; c0 += ATT_CHUNK) {
        int n = min(ATT_CHUNK, end - c0);
        float mx = -INFINITY;
        for (int i = lid; i < n; i += ATT_WG) {
            size_t base = (size_t)(c0 + i) * kv_stride + head_at;
            float s = 0.0f;
            for (int e = 0; e < ATT_D4; e++) s += dot(qs[e], ld_kv4(k, base + 4 * e));
            sc[i] = s * scale;
            mx = fmax(mx, s * scale);
        }
        mx = fmax(m_run, group_reduce(mx, red, true));
        float alpha = exp(m_run - mx), ls = 0.0f;
        for (int i = lid; i < n; i += ATT_WG) {
            float p = exp(sc[i] - mx);
            sc[i] = p;
            ls += p;
        }
        ls = group_reduce(ls, red, false);          // its barriers publish sc
        l_run = l_run * alpha + ls;
        o *= alpha;
        m_run = mx;
        for (int i = part; i < n; i += ATT_VPARTS)
            o += sc[i] * ld_kv4(v, (size_t)(c0 + i) * kv_stride + head_at + 4 * d4);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local float4* vparts = (__local float4*)sc;   // [VPARTS][hd/4]
#if ATT_WG % ATT_D4
    if (part < ATT_VPARTS)
#endif
    vparts[part * ATT_D4 + d4] = o;
    barrier(CLK_LOCAL_MEM_FENCE);

    __global volatile int* count = (__global volatile int*)(sb + s_off) + (size_t)t * n_heads + h;
    __global volatile float* parts = (__global volatile float*)(sb + s_off + (size_t)M * n_heads * 4);
    __global volatile float* mine = parts + (((size_t)t * n_heads + h) * ATT_SPLITS + split) * (HEAD_DIM + 2);
    for (int dd = lid; dd < ATT_D4; dd += ATT_WG) {
        float4 total = (float4)(0.0f);
        for (int p = 0; p < ATT_VPARTS; p++) total += vparts[p * ATT_D4 + dd];
        mine[2 + 4 * dd] = total.x;
        mine[3 + 4 * dd] = total.y;
        mine[4 + 4 * dd] = total.z;
        mine[5 + 4 * dd] = total.w;
    }
    if (lid == 0) {
        mine[0] = m_run;
        mine[1] = l_run;
    }
    DEVICE_FENCE();   // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) last = atomic_inc(count) == ATT_SPLITS - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    DEVICE_FENCE();
    // each split's (m, l) once into local memory, then its weight exp(m_s - m)
    __local float wm[ATT_SPLITS], wl[ATT_SPLITS], lsum;
    __global volatile float* all = parts + ((size_t)t * n_heads + h) * ATT_SPLITS * (HEAD_DIM + 2);
    for (int sp = lid; sp < ATT_SPLITS; sp += ATT_WG) {
        wm[sp] = all[sp * (HEAD_DIM + 2)];
        wl[sp] = all[sp * (HEAD_DIM + 2) + 1];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        float m = -INFINITY, l = 0.0f;
        for (int sp = 0; sp < ATT_SPLITS; sp++) m = fmax(m, wm[sp]);
        for (int sp = 0; sp < ATT_SPLITS; sp++) {
            float wgt = wl[sp] == 0.0f ? 0.0f : exp(wm[sp] - m);   // empty splits carry m = -inf
            l += wl[sp] * wgt;
            wm[sp] = wgt;
        }
        lsum = l;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int dd = lid; dd < HEAD_DIM; dd += ATT_WG) {
        float acc = 0.0f;
        for (int sp = 0; sp < ATT_SPLITS; sp++) acc += all[sp * (HEAD_DIM + 2) + 2 + dd] * wm[sp];
        ((__global float*)(ob + o_off))[((size_t)t * n_heads + h) * HEAD_DIM + dd] = acc / lsum;
    }
    if (lid == 0) *count = 0;
}
