// Causal GQA attention over the KV cache: row t of the step sees cache slots [0, n_past + t].
//   -DHEAD_DIM=<hd, a multiple of 4, at most 4 * ATT_WG>  -DKV_T=<f32|f16|q8_0> -DKV_<T>
//   -DATT_WG=<threads, a multiple of 32>  -DATT_SPLITS=<groups per head>
//   q  f32 [M, H*hd]        k, v  KV_T [S, KVH, hd]        o  f32 [M, H*hd]
// Softmax is online (running max and sum, rescaled per chunk of keys), so any context length
// runs in a fixed amount of local memory.

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
// group per (ATT_GROUP query heads of one KV head, split): it scores slots [s * span,
// (s + 1) * span) for all of those heads, so with ATT_GROUP = n_heads / n_kv_heads (GQA) each
// K and V row is read once, not once per query head. Each head keeps an online softmax; the group writes per head its partial (max m, sum
// l, o[hd] unnormalised) to scratch and takes a ticket; the last of the ATT_SPLITS groups of
// (t, KV head) merges the partials, writes o and puts the ticket counter back to 0 for the next
// launch. One group per head alone leaves most of a large GPU idle.
//   -DATT_GROUP=<query heads per group: 1 or a divisor of n_heads / n_kv_heads>
//   scratch  int counters [M, H / ATT_GROUP], then f32 partials [M, H, ATT_SPLITS, hd + 2]
// Threads: scores one key each; the V sum as (part, 4 dims): ATT_WG * 4 / hd parts of the keys
// (rounded down: where hd / 4 does not divide ATT_WG, the threads left over take no part).
// Grid: (H / ATT_GROUP * ATT_SPLITS * ATT_WG, rows).
#ifndef ATT_GROUP
#define ATT_GROUP 1
#endif
#define ATT_D4 (HEAD_DIM / 4)
#define ATT_VPARTS (ATT_WG / ATT_D4)

// v[j] <- the group's max (is_max) or sum of v[j], for every head j at once (one pair of
// barriers for all of them); red holds ATT_GROUP * ATT_WG floats
inline void group_reduce_heads(float* v, __local float* red, bool is_max) {
    int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
#ifdef USE_NV_PTX
    int lane = lid & 31, warp = lid >> 5;
#pragma unroll
    for (int j = 0; j < ATT_GROUP; j++) {
        float r = is_max ? warp_max(v[j]) : warp_sum(v[j]);
        if (lane == 0) red[j * (ATT_WG / 32) + warp] = r;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
    for (int j = 0; j < ATT_GROUP; j++) {
        float r = red[j * (ATT_WG / 32)];
        for (int w = 1; w < ATT_WG / 32; w++) {
            float x = red[j * (ATT_WG / 32) + w];
            r = is_max ? fmax(r, x) : r + x;
        }
        v[j] = r;
    }
#else
    for (int j = 0; j < ATT_GROUP; j++) red[j * ATT_WG + lid] = v[j];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = ATT_WG / 2; s > 0; s >>= 1) {
        if (lid < s)
            for (int j = 0; j < ATT_GROUP; j++) {
                float a = red[j * ATT_WG + lid], b = red[j * ATT_WG + lid + s];
                red[j * ATT_WG + lid] = is_max ? fmax(a, b) : a + b;
            }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int j = 0; j < ATT_GROUP; j++) v[j] = red[j * ATT_WG];
#endif
}

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_split(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                     gin vb, ulong v_off, gout ob, ulong o_off, gout sb, ulong s_off,
                     int n_heads, int n_kv_heads, float scale, int M) {
    int lid = get_local_id(0), t = get_group_id(1);
    int hg = get_group_id(0) / ATT_SPLITS, split = get_group_id(0) % ATT_SPLITS;
    int h0 = hg * ATT_GROUP;                        // first query head of this group's heads
    int kvh = h0 / (n_heads / n_kv_heads);
    int length = STEP_N_PAST(step) + t + 1;
    int span = (length + ATT_SPLITS - 1) / ATT_SPLITS;
    int begin = min(length, split * span), end = min(length, begin + span);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    size_t head_at = (size_t)kvh * HEAD_DIM;       // element index of this head in a cache row
    __local float4 qs[ATT_GROUP * ATT_D4];          // q of the group's heads: [G][hd/4]
    __local float sc[ATT_GROUP * ATT_CHUNK];        // scores, then p: [G][ATT_CHUNK]; at the
                                                    // end the V parts [VPARTS][G][hd]
#ifdef USE_NV_PTX
    __local float red[ATT_GROUP * (ATT_WG / 32)];
#else
    __local float red[ATT_GROUP * ATT_WG];
#endif
    __local int last;
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h0) * ATT_D4;
    for (int e = lid; e < ATT_GROUP * ATT_D4; e += ATT_WG) qs[e] = q[e];
    barrier(CLK_LOCAL_MEM_FENCE);

    int d4 = lid % ATT_D4, part = lid / ATT_D4;
#if ATT_WG % ATT_D4
    if (part >= ATT_VPARTS) part = ATT_CHUNK;       // left over: past every chunk's keys
#endif
    float m_run[ATT_GROUP], l_run[ATT_GROUP];
    float4 o[ATT_GROUP];
#pragma unroll
    for (int j = 0; j < ATT_GROUP; j++) {
        m_run[j] = -INFINITY;
        l_run[j] = 0.0f;
        o[j] = (float4)(0.0f);
    }
    for (int c0 = begin; c0 < end; c0 += ATT_CHUNK) {
        int n = min(ATT_CHUNK, end - c0);
        float mx[ATT_GROUP], ls[ATT_GROUP];
#pragma unroll
        for (int j = 0; j < ATT_GROUP; j++) mx[j] = -INFINITY;
        for (int i = lid; i < n; i += ATT_WG) {
            size_t base = (size_t)(c0 + i) * kv_stride + head_at;
            float s[ATT_GROUP];
#pragma unroll
            for (int j = 0; j < ATT_GROUP; j++) s[j] = 0.0f;
            for (int e = 0; e < ATT_D4; e++) {
                float4 kk = ld_kv4(k, base + 4 * e);
#pragma unroll
                for (int j = 0; j < ATT_GROUP; j++) s[j] += dot(qs[j * ATT_D4 + e], kk);
            }
#pragma unroll
            for (int j = 0; j < ATT_GROUP; j++) {
                sc[j * ATT_CHUNK + i] = s[j] * scale;
                mx[j] = fmax(mx[j], s[j] * scale);
            }
        }
        group_reduce_heads(mx, red, true);
        float alpha[ATT_GROUP];
#pragma unroll
        for (int j = 0; j < ATT_GROUP; j++) {
            mx[j] = fmax(m_run[j], mx[j]);
            alpha[j] = exp(m_run[j] - mx[j]);
            ls[j] = 0.0f;
        }
        for (int i = lid; i < n; i += ATT_WG)
#pragma unroll
            for (int j = 0; j < ATT_GROUP; j++) {
                float p = exp(sc[j * ATT_CHUNK + i] - mx[j]);
                sc[j * ATT_CHUNK + i] = p;
                ls[j] += p;
            }
        group_reduce_heads(ls, red, false);          // its barriers publish sc
#pragma unroll
        for (int j = 0; j < ATT_GROUP; j++) {
            l_run[j] = l_run[j] * alpha[j] + ls[j];
            o[j] *= alpha[j];
            m_run[j] = mx[j];
        }
        for (int i = part; i < n; i += ATT_VPARTS) {
            float4 vv = ld_kv4(v, (size_t)(c0 + i) * kv_stride + head_at + 4 * d4);
#pragma unroll
            for (int j = 0; j < ATT_GROUP; j++) o[j] += sc[j * ATT_CHUNK + i] * vv;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local float4* vparts = (__local float4*)sc;   // [VPARTS][G][hd/4]
#if ATT_WG % ATT_D4
    if (part < ATT_VPARTS)
#endif
#pragma unroll
    for (int j = 0; j < ATT_GROUP; j++) vparts[(part * ATT_GROUP + j) * ATT_D4 + d4] = o[j];
    barrier(CLK_LOCAL_MEM_FENCE);

    __global volatile int* count = (__global volatile int*)(sb + s_off) + (size_t)t * (n_heads / ATT_GROUP) + hg;
    __global volatile float* parts = (__global volatile float*)(sb + s_off + (size_t)M * n_heads * 4);
    for (int e = lid; e < ATT_GROUP * ATT_D4; e += ATT_WG) {   // e = (head j, 4 dims)
        int j = e / ATT_D4, dd = e % ATT_D4;
        float4 total = (float4)(0.0f);
        for (int p = 0; p < ATT_VPARTS; p++) total += vparts[(p * ATT_GROUP + j) * ATT_D4 + dd];
        __global volatile float* mine = parts + (((size_t)t * n_heads + h0 + j) * ATT_SPLITS + split) * (HEAD_DIM + 2);
        mine[2 + 4 * dd] = total.x;
        mine[3 + 4 * dd] = total.y;
        mine[4 + 4 * dd] = total.z;
        mine[5 + 4 * dd] = total.w;
    }
#pragma unroll
    for (int j = 0; j < ATT_GROUP; j++)
        if (lid == j) {
            __global volatile float* mine = parts + (((size_t)t * n_heads + h0 + j) * ATT_SPLITS + split) * (HEAD_DIM + 2);
            mine[0] = m_run[j];
            mine[1] = l_run[j];
        }
    mem_fence(CLK_GLOBAL_MEM_FENCE);   // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) last = atomic_inc(count) == ATT_SPLITS - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    // each split's (m, l) once into local memory, then its weight exp(m_s - m) per head
    __local float wm[ATT_GROUP * ATT_SPLITS], wl[ATT_GROUP * ATT_SPLITS], lsum[ATT_GROUP];
    for (int e = lid; e < ATT_GROUP * ATT_SPLITS; e += ATT_WG) {
        __global volatile float* ps = parts + ((size_t)t * n_heads + h0) * ATT_SPLITS * (HEAD_DIM + 2)
                                      + (size_t)e * (HEAD_DIM + 2);   // e = head j * SPLITS + split
        wm[e] = ps[0];
        wl[e] = ps[1];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < ATT_GROUP) {
        float m = -INFINITY, l = 0.0f;
        for (int sp = 0; sp < ATT_SPLITS; sp++) m = fmax(m, wm[lid * ATT_SPLITS + sp]);
        for (int sp = 0; sp < ATT_SPLITS; sp++) {
            int e = lid * ATT_SPLITS + sp;
            float wgt = wl[e] == 0.0f ? 0.0f : exp(wm[e] - m);   // empty splits carry m = -inf
            l += wl[e] * wgt;
            wm[e] = wgt;
        }
        lsum[lid] = l;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = lid; e < ATT_GROUP * HEAD_DIM; e += ATT_WG) {
        int j = e / HEAD_DIM, dd = e % HEAD_DIM;
        __global volatile float* all = parts + ((size_t)t * n_heads + h0 + j) * ATT_SPLITS * (HEAD_DIM + 2);
        float acc = 0.0f;
        for (int sp = 0; sp < ATT_SPLITS; sp++) acc += all[sp * (HEAD_DIM + 2) + 2 + dd] * wm[j * ATT_SPLITS + sp];
        ((__global float*)(ob + o_off))[((size_t)t * n_heads + h0 + j) * HEAD_DIM + dd] = acc / lsum[j];
    }
    if (lid == 0) *count = 0;
}

// Decode, one key per lane (-DATT_DECODE_WARP; HEAD_DIM a multiple of 32). A group of ATT_WG
// threads covers ATT_WG consecutive keys of one query head per pass: lane l of warp w scores
// key w * 32 + l against q (its whole K row), the warp takes its max and sum by shuffles, and
// each lane accumulates HEAD_DIM / 32 dims of the warp's 32 V rows, whose loads are issued
// together with the K row's so one DRAM round trip serves both. The warps' (m, l, o) meet in
// local memory once. Only ceil(length / (ATT_WG * passes)) splits of a head have keys: the
// others return at once, so the grid (sized by codegen for the whole cache) costs nothing
// at short contexts, and where one split suffices it writes o directly. Otherwise each
// split writes its partial and takes a ticket; the last merges them, as attention_split.
//   scratch  int counters [M, H], then f32 partials [M, H, ATT_SPLITS, hd + 2]
// Grid: (H * ATT_SPLITS * ATT_WG, rows).
#ifdef ATT_DECODE_WARP
#define ATT_DPL (HEAD_DIM / 32)                 // V dims per lane
#define ATT_NW (ATT_WG / 32)
#define ATT_VB (ATT_DPL > 2 ? 16 : 32)          // V rows per batch of loads (registers)

// this lane's ATT_DPL consecutive elements from element i
inline void ld_kv_lane(gin p, size_t i, float* out) {
#if defined(KV_F16) && ATT_DPL % 2 == 0
    for (int d = 0; d < ATT_DPL; d += 2) {
        float2 f = half2_bits_to_float2(((__global const uint*)p)[(i + d) >> 1]);
        out[d] = f.x;
        out[d + 1] = f.y;
    }
#else
    for (int d = 0; d < ATT_DPL; d++) out[d] = LD_KV(p, i + d);
#endif
}

#ifdef USE_NV_PTX
#define SEG_MAX(v) warp_max(v)
#define SEG_SUM(v) warp_sum(v)
#else
// the same over each 32 threads through local memory (every thread of the group calls it)
inline float seg_reduce(float v, __local float* scr, bool is_max) {
    int lid = get_local_id(0), base = lid & ~31;
    barrier(CLK_LOCAL_MEM_FENCE);
    scr[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float r = scr[base];
    for (int i = 1; i < 32; i++) r = is_max ? fmax(r, scr[base + i]) : r + scr[base + i];
    return r;
}
#define SEG_MAX(v) seg_reduce(v, scr, true)
#define SEG_SUM(v) seg_reduce(v, scr, false)
#endif

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_decode(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                      gin vb, ulong v_off, gout ob, ulong o_off, gout sb, ulong s_off,
                      int n_heads, int n_kv_heads, float scale, int M) {
    int lid = get_local_id(0), lane = lid & 31, warp = lid >> 5, t = get_group_id(1);
    int h = get_group_id(0) / ATT_SPLITS, split = get_group_id(0) % ATT_SPLITS;
    int length = STEP_N_PAST(step) + t + 1;
    int passes = (length + ATT_WG * ATT_SPLITS - 1) / (ATT_WG * ATT_SPLITS);
    int span = ATT_WG * passes;
    int active = (length + span - 1) / span;    // splits that have keys
    if (split >= active) return;
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM, head_at = (size_t)kvh * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h) * (HEAD_DIM / 4);
#ifndef USE_NV_PTX
    __local float scr[ATT_WG];
#endif
    float m = -INFINITY, l = 0.0f, o[ATT_DPL];
    for (int d = 0; d < ATT_DPL; d++) o[d] = 0.0f;
    for (int pass = 0; pass < passes; pass++) {
        int key0 = split * span + pass * ATT_WG + warp * 32, key = key0 + lane;
        bool valid = key < length;
        size_t krow = (size_t)min(key, length - 1) * kv_stride + head_at;
        float vv[ATT_VB][ATT_DPL];
#pragma unroll
        for (int j = 0; j < ATT_VB; j++)
            ld_kv_lane(v, (size_t)min(key0 + j, length - 1) * kv_stride + head_at + lane * ATT_DPL, vv[j]);
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < HEAD_DIM / 4; e++) s += dot(q[e], ld_kv4(k, krow + 4 * e));
        s = valid ? s * scale : -INFINITY;
        float mn = fmax(m, SEG_MAX(s));         // -inf only while the warp has seen no key
        float p = valid ? exp(s - mn) : 0.0f;
        float alpha = m == -INFINITY ? 0.0f : exp(m - mn);
        l = l * alpha + SEG_SUM(p);
        m = mn;
#pragma unroll
        for (int d = 0; d < ATT_DPL; d++) o[d] *= alpha;
#ifndef USE_NV_PTX
        barrier(CLK_LOCAL_MEM_FENCE);
        scr[lid] = p;                           // the warp's p, read back by key
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
        for (int j0 = 0; j0 < 32; j0 += ATT_VB) {
            if (j0 > 0)
#pragma unroll
                for (int j = 0; j < ATT_VB; j++)
                    ld_kv_lane(v, (size_t)min(key0 + j0 + j, length - 1) * kv_stride + head_at + lane * ATT_DPL, vv[j]);
#pragma unroll
            for (int j = 0; j < ATT_VB; j++) {
#ifdef USE_NV_PTX
                float pj = warp_bcast(p, j0 + j);
#else
                float pj = scr[(lid & ~31) + j0 + j];
#endif
#pragma unroll
                for (int d = 0; d < ATT_DPL; d++) o[d] += pj * vv[j][d];
            }
        }
    }

    // the warps' partials -> the split's (m, l, o): warps that saw no key carry l = 0
    __local float wm[ATT_NW], wl[ATT_NW], wo[ATT_NW * HEAD_DIM];
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int d = 0; d < ATT_DPL; d++) wo[warp * HEAD_DIM + lane * ATT_DPL + d] = o[d];
    barrier(CLK_LOCAL_MEM_FENCE);
    float gm = -INFINITY;
    for (int w = 0; w < ATT_NW; w++) gm = fmax(gm, wm[w]);
    float gl = 0.0f, go = 0.0f;
    for (int w = 0; w < ATT_NW; w++) {
        float wgt = wl[w] == 0.0f ? 0.0f : exp(wm[w] - gm);
        gl += wl[w] * wgt;
        if (lid < HEAD_DIM) go += wo[w * HEAD_DIM + lid] * wgt;
    }
    __global float* out = (__global float*)(ob + o_off) + ((size_t)t * n_heads + h) * HEAD_DIM;
    if (active == 1) {
        if (lid < HEAD_DIM) out[lid] = go / gl;
        return;
    }

    __global volatile int* count = (__global volatile int*)(sb + s_off) + (size_t)t * n_heads + h;
    __global volatile float* parts = (__global volatile float*)(sb + s_off + (size_t)M * n_heads * 4)
                                     + ((size_t)t * n_heads + h) * ATT_SPLITS * (HEAD_DIM + 2);
    __global volatile float* mine = parts + split * (HEAD_DIM + 2);
    if (lid < HEAD_DIM) mine[2 + lid] = go;
    if (lid == 0) {
        mine[0] = gm;
        mine[1] = gl;
    }
    mem_fence(CLK_GLOBAL_MEM_FENCE);            // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    __local int last;
    if (lid == 0) last = atomic_inc(count) == active - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    if (lid < HEAD_DIM) {                       // online merge of the active splits
        float mm = -INFINITY, ll = 0.0f, acc = 0.0f;
        for (int sp = 0; sp < active; sp++) {
            __global volatile float* ps = parts + sp * (HEAD_DIM + 2);
            float ms = ps[0], ls = ps[1], os = ps[2 + lid];
            float mn = fmax(mm, ms);
            float a = mm == -INFINITY ? 0.0f : exp(mm - mn), b = exp(ms - mn);
            ll = ll * a + ls * b;
            acc = acc * a + os * b;
            mm = mn;
        }
        out[lid] = acc / ll;
    }
    if (lid == 0) *count = 0;
}
#endif

// Prefill: one group per (query head, tile of ATT_BQ rows); each thread owns one query row and
// walks the keys in tiles of ATT_BK staged in local memory, with an online softmax per row.
// Grid: (H * ATT_BQ, ceil(rows / ATT_BQ)).
#ifndef ATT_BQ
#define ATT_BQ 32              // query rows (threads) per group: more rows share each staged tile
#endif
#ifndef ATT_BK
#define ATT_BK 32              // keys per staged tile (codegen: fewer for wide heads, so K and V
#endif                         // tiles stay within 32 KB of local memory)

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
    // float4-typed tiles: each key row is read as 16-byte local loads (scalar indexing of a
    // float array gave one 4-byte load per element)
    __local float4 ks[ATT_BK][HEAD_DIM / 4];
    __local float4 vs[ATT_BK][HEAD_DIM / 4];

    float4 qr[HEAD_DIM / 4], acc[HEAD_DIM / 4];
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h) * (HEAD_DIM / 4);
    for (int e = 0; e < HEAD_DIM / 4; e++) {
        qr[e] = t < rows ? q[e] : (float4)(0.0f);
        acc[e] = (float4)(0.0f);
    }
    float m_run = -INFINITY, l_run = 0.0f;
    int last = n_past + min(rows, t0 + ATT_BQ) - 1;    // the tile's last visible slot
    for (int c0 = 0; c0 <= last; c0 += ATT_BK) {
        for (int e = lid; e < ATT_BK * HEAD_DIM / 4; e += ATT_BQ) {   // 4 elements a load
            int i = e / (HEAD_DIM / 4), d4 = e % (HEAD_DIM / 4);
            size_t at = (size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM + 4 * d4;
            bool in = c0 + i <= last;
            ks[i][d4] = in ? ld_kv4(k, at) : (float4)(0.0f);
            vs[i][d4] = in ? ld_kv4(v, at) : (float4)(0.0f);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        int visible = min(ATT_BK, n_past + t - c0 + 1);   // keys of this tile row t sees
        if (t < rows && visible > 0) {
            float s[ATT_BK];
            float m_tile = -INFINITY;
            for (int i = 0; i < ATT_BK; i++) {
                float d = 0.0f;
                for (int e = 0; e < HEAD_DIM / 4; e++) d += dot(qr[e], ks[i][e]);
                s[i] = i < visible ? d * scale : -INFINITY;
                m_tile = fmax(m_tile, s[i]);
            }
            float m_new = fmax(m_run, m_tile);
            float alpha = exp(m_run - m_new);
            l_run *= alpha;
            for (int e = 0; e < HEAD_DIM / 4; e++) acc[e] *= alpha;
            for (int i = 0; i < ATT_BK; i++) {
                float p = exp(s[i] - m_new);
                l_run += p;
                for (int e = 0; e < HEAD_DIM / 4; e++) acc[e] += p * vs[i][e];
            }
            m_run = m_new;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (t < rows) {
        __global float4* o = (__global float4*)(ob + o_off) + ((size_t)t * n_heads + h) * (HEAD_DIM / 4);
        for (int e = 0; e < HEAD_DIM / 4; e++) o[e] = acc[e] / l_run;
    }
}
