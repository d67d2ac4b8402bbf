// Causal GQA attention over the KV cache: row t of the step sees cache slots [0, n_past + t].
//   -DHEAD_DIM=<hd, a multiple of 4>  -DKV_T=<f32|f16|q8_0> -DKV_<T>
//   -DATT_WG=<threads, a multiple of HEAD_DIM and of 32>  -DATT_SPLITS=<groups per head>
//   q  f32 [M, H*hd]        k, v  KV_T [S, KVH, hd]        o  f32 [M, H*hd]
// Softmax is online (running max and sum, rescaled per chunk of keys), so any context length
// runs in a fixed amount of local memory.

#define LD_KV(p, i) CAT(ld_, KV_T)(p, i)
#ifndef ATT_WG
#define ATT_WG 128
#endif
#define ATT_CHUNK 512          // keys scored per pass
#define ATT_PARTS (ATT_WG / HEAD_DIM)
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

// Decode (any step whose query rows see n_past + t + 1 slots), split-K as flash-decoding:
// group (h, s) scores slots [s * span, (s + 1) * span) of head h for row t with an online
// softmax, writes its partial (max m, sum l, o[hd] unnormalised) to scratch, and takes a
// ticket; the last of the ATT_SPLITS groups of (t, h) merges the partials, writes o and puts
// the ticket counter back to 0 for the next launch. One group per head alone leaves most of
// a large GPU idle.
//   scratch  int counters [M, H], then f32 partials [M, H, ATT_SPLITS, hd + 2]
// Grid: (H * ATT_SPLITS * ATT_WG, rows).
__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_split(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                     gin vb, ulong v_off, gout ob, ulong o_off, gout sb, ulong s_off,
                     int n_heads, int n_kv_heads, float scale, int M) {
    int lid = get_local_id(0), t = get_group_id(1);
    int h = get_group_id(0) / ATT_SPLITS, split = get_group_id(0) % ATT_SPLITS;
    int length = STEP_N_PAST(step) + t + 1;
    int span = (length + ATT_SPLITS - 1) / ATT_SPLITS;
    int begin = min(length, split * span), end = min(length, begin + span);
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    __local float4 qs[HEAD_DIM / 4];
    __local float sc[ATT_CHUNK];
    __local float red[ATT_WG];
    __local int last;
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h) * (HEAD_DIM / 4);
    for (int d = lid; d < HEAD_DIM / 4; d += ATT_WG) qs[d] = q[d];
    barrier(CLK_LOCAL_MEM_FENCE);

    int d = lid % HEAD_DIM, part = lid / HEAD_DIM;
    float m_run = -INFINITY, l_run = 0.0f, o = 0.0f;
    for (int c0 = begin; c0 < end; c0 += ATT_CHUNK) {
        int n = min(ATT_CHUNK, end - c0);
        float m_loc = -INFINITY;
        for (int i = lid; i < n; i += ATT_WG) {
            size_t base = (size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM;
            float s = 0.0f;
            for (int e = 0; e < HEAD_DIM / 4; e++) s += dot(qs[e], ld_kv4(k, base + 4 * e));
            s *= scale;
            sc[i] = s;
            m_loc = fmax(m_loc, s);
        }
        float m_new = fmax(m_run, group_max(m_loc, red));
        float alpha = exp(m_run - m_new);
        float l_loc = 0.0f;
        for (int i = lid; i < n; i += ATT_WG) {
            float p = exp(sc[i] - m_new);
            sc[i] = p;
            l_loc += p;
        }
        l_run = l_run * alpha + group_sum(l_loc, red);   // its barriers publish sc
        o *= alpha;
        for (int i = part; i < n; i += ATT_PARTS)
            o += sc[i] * LD_KV(v, (size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM + d);
        m_run = m_new;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    red[lid] = o;
    barrier(CLK_LOCAL_MEM_FENCE);

    __global volatile int* count = (__global volatile int*)(sb + s_off) + (size_t)t * n_heads + h;
    __global volatile float* parts = (__global volatile float*)(sb + s_off + (size_t)M * n_heads * 4);
    __global volatile float* mine = parts + (((size_t)t * n_heads + h) * ATT_SPLITS + split) * (HEAD_DIM + 2);
    if (part == 0) {
        float total = 0.0f;
        for (int p = 0; p < ATT_PARTS; p++) total += red[p * HEAD_DIM + d];
        mine[2 + d] = total;
    }
    if (lid == 0) {
        mine[0] = m_run;
        mine[1] = l_run;
    }
    mem_fence(CLK_GLOBAL_MEM_FENCE);   // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) last = atomic_inc(count) == ATT_SPLITS - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    __global volatile float* all = parts + ((size_t)t * n_heads + h) * ATT_SPLITS * (HEAD_DIM + 2);
    if (lid < HEAD_DIM) {
        float m = -INFINITY;
        for (int s = 0; s < ATT_SPLITS; s++) m = fmax(m, all[s * (HEAD_DIM + 2)]);
        float l = 0.0f, acc = 0.0f;
        for (int s = 0; s < ATT_SPLITS; s++) {
            __global volatile float* ps = all + s * (HEAD_DIM + 2);
            float wgt = ps[1] == 0.0f ? 0.0f : exp(ps[0] - m);   // empty splits carry m = -inf
            l += ps[1] * wgt;
            acc += ps[2 + lid] * wgt;
        }
        ((__global float*)(ob + o_off))[((size_t)t * n_heads + h) * HEAD_DIM + lid] = acc / l;
    }
    if (lid == 0) *count = 0;
}

// Prefill: one group per (query head, tile of ATT_BQ rows); each thread owns one query row and
// walks the keys in tiles of ATT_BK staged in local memory, with an online softmax per row.
// Grid: (H * ATT_BQ, ceil(rows / ATT_BQ)).
#define ATT_BQ 32
#define ATT_BK 32

__kernel __attribute__((reqd_work_group_size(ATT_BQ, 1, 1)))
void attention_tiled(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                     gin vb, ulong v_off, gout ob, ulong o_off,
                     int n_heads, int n_kv_heads, float scale, int M) {
    int lid = get_local_id(0), h = get_group_id(0), t0 = get_group_id(1) * ATT_BQ;
    int rows = min(M, STEP_N_TOKENS(step));
    int n_past = STEP_N_PAST(step);
    int t = t0 + lid;
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    __local float ks[ATT_BK][HEAD_DIM];
    __local float vs[ATT_BK][HEAD_DIM];

    float qr[HEAD_DIM], acc[HEAD_DIM];
    __global const float* q = (__global const float*)(qb + q_off) + ((size_t)t * n_heads + h) * HEAD_DIM;
    for (int e = 0; e < HEAD_DIM; e++) {
        qr[e] = t < rows ? q[e] : 0.0f;
        acc[e] = 0.0f;
    }
    float m_run = -INFINITY, l_run = 0.0f;
    int last = n_past + min(rows, t0 + ATT_BQ) - 1;    // the tile's last visible slot
    for (int c0 = 0; c0 <= last; c0 += ATT_BK) {
        for (int e = lid; e < ATT_BK * HEAD_DIM; e += ATT_BQ) {
            int i = e / HEAD_DIM, dd = e % HEAD_DIM;
            size_t at = (size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM + dd;
            bool in = c0 + i <= last;
            ks[i][dd] = in ? LD_KV(k, at) : 0.0f;
            vs[i][dd] = in ? LD_KV(v, at) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        int visible = min(ATT_BK, n_past + t - c0 + 1);   // keys of this tile row t sees
        if (t < rows && visible > 0) {
            float s[ATT_BK];
            float m_tile = -INFINITY;
            for (int i = 0; i < ATT_BK; i++) {
                float dot = 0.0f;
                for (int e = 0; e < HEAD_DIM; e++) dot += qr[e] * ks[i][e];
                s[i] = i < visible ? dot * scale : -INFINITY;
                m_tile = fmax(m_tile, s[i]);
            }
            float m_new = fmax(m_run, m_tile);
            float alpha = exp(m_run - m_new);
            l_run *= alpha;
            for (int e = 0; e < HEAD_DIM; e++) acc[e] *= alpha;
            for (int i = 0; i < ATT_BK; i++) {
                float p = exp(s[i] - m_new);
                l_run += p;
                for (int e = 0; e < HEAD_DIM; e++) acc[e] += p * vs[i][e];
            }
            m_run = m_new;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (t < rows) {
        __global float* o = (__global float*)(ob + o_off) + ((size_t)t * n_heads + h) * HEAD_DIM;
        for (int e = 0; e < HEAD_DIM; e++) o[e] = acc[e] / l_run;
    }
}
