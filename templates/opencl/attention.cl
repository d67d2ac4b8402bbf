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
    mem_fence(CLK_GLOBAL_MEM_FENCE);   // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (lid == 0) last = atomic_inc(count) == ATT_SPLITS - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    mem_fence(CLK_GLOBAL_MEM_FENCE);
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

// Two bodies of attention_tiled with one signature and grid: the tensor-core body below
// (NVIDIA sm_80+, f16 caches; H100 1B prefill attention 2.29 -> 0.53 ms, round 10) and the
// portable fp32 body, one thread per query row, for everything else. -DEMU_MMA (common.cl)
// runs the tensor-core body anywhere, its mma.sync and shuffles emulated through local memory
// (tests: PoCL checks the body's tiling, masking and softmax; only the fragment layouts, which
// the emulation decodes as the PTX ISA defines them, are left to the hardware).
#if defined(USE_NV_MMA) && (defined(USE_NV_PTX) || defined(EMU_MMA)) && defined(KV_F16) && \
    HEAD_DIM % 16 == 0 && HEAD_DIM <= 128 && ATT_BQ == 128
#define ATT_MMA_BODY 1
#endif

// Both bodies below (fp32 and tensor-core) take the arguments codegen binds by position: one
// signature and prologue.
#define ATT_TILED_BEGIN \
__kernel __attribute__((reqd_work_group_size(ATT_BQ, 1, 1))) \
void attention_tiled(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off, \
                     gin vb, ulong v_off, gout ob, ulong o_off, \
                     int n_heads, int n_kv_heads, float scale, int M) { \
    int lid = get_local_id(0), h = get_group_id(0), t0 = get_group_id(1) * ATT_BQ; \
    int rows = min(M, STEP_N_TOKENS(step)); \
    int n_past = STEP_N_PAST(step);

#ifndef ATT_MMA_BODY
ATT_TILED_BEGIN
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
#endif  // !ATT_MMA_BODY

#ifdef ATT_MMA_BODY
// Tensor-core prefill attention (FlashAttention-2 with mma.sync m16n8k16, f16 operands, f32
// accumulation). The group's 4 warps own 32 query rows each, as two 16-row MMA tiles (heads
// up to 64 wide: one pass over the keys) or one tile at a time (wider heads: two passes, so
// the O accumulators fit in registers). Q, times scale * log2(e), is rounded to f16 once and
// kept as A fragments; the keys go through local memory ATT_MMA_BK at a time, f16, as 32-bit
// words with a padded stride (a fragment load's row r, word w hits bank 4r + w: distinct):
//   ks [ATT_MMA_BK][ATT_KS_W]  K as stored: word w of key i = dims 2w, 2w + 1 (the B operand
//                              of S = Q K^T is K's rows)
//   vt [HEAD_DIM][ATT_VT_W]    V transposed: word w of dim d = keys 2w, 2w + 1 (P V's B)
// S (f32 C fragments) gets the causal mask and an online softmax per row (exp2, rows reduced
// over the 4 lanes of a quad); P, rounded to f16, is the A operand of P V straight from the
// registers (C fragments of two adjacent 8-key tiles are one 16-key A fragment).
// Fragments (lane = 4 gq + tq): A 16x16 row: a0 (gq, 2tq..+1), a1 (gq+8, 2tq..), a2 (gq, 2tq+8..),
// a3 (gq+8, 2tq+8..); B 16x8 col: b0 (k 2tq..+1, n gq), b1 (k 2tq+8.., n gq); C 16x8:
// c0, c1 (gq, 2tq, 2tq+1), c2, c3 (gq+8, same); lower k / column in the lower half-word.
#define ATT_MMA_BK 64                     // keys per staged tile
#define ATT_KS_W (HEAD_DIM / 2 + 4)       // words per key row of ks (= 4 mod 8: distinct banks)
#define ATT_VT_W (ATT_MMA_BK / 2 + 4)     // words per dim row of vt
#if HEAD_DIM <= 64
#define ATT_MT 2                          // 16-row MMA tiles per warp and pass
#else
#define ATT_MT 1
#endif
#define ATT_PASSES (2 / ATT_MT)

#ifdef EMU_MMA
// common.cl's emulation: every work-item of the group reaches every call (the body's control
// flow is uniform when emulating)
// (bit arithmetic: see emu_f32_to_f16)
inline uint att_pack_emu(float lo, float hi) {
    return emu_f32_to_f16(lo) | (emu_f32_to_f16(hi) << 16);
}
#define ATT_MMA(c, a, b0, b1) emu_mma_f16(c, a, b0, b1, emu)
#define ATT_UNROLL _Pragma("unroll 1")    // rolled: unrolled, PoCL takes minutes to build it
#define ATT_XOR(v, o) emu_shfl_xor(v, o, emu)
#define ATT_PACK(lo, hi) att_pack_emu(lo, hi)
#else
// c[0..3] += A (16x16 f16, row) * B (16x8 f16, col)
#define ATT_MMA(c, a, b0, b1)                                                                  \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "      \
        "{%8,%9}, {%0,%1,%2,%3};"                                                              \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
// two floats -> f16 (nearest even) in one word, lo in the lower half
inline uint att_pack(float lo, float hi) {
    uint u;
    asm("{ .reg .b16 l, h; cvt.rn.f16.f32 l, %1; cvt.rn.f16.f32 h, %2; mov.b32 %0, {l, h}; }"
        : "=r"(u) : "f"(lo), "f"(hi));
    return u;
}
#define ATT_XOR(v, o) shfl_xor_f(v, o)
#define ATT_PACK(lo, hi) att_pack(lo, hi)
#define ATT_UNROLL _Pragma("unroll")      // whole: fragments and accumulators stay in registers
#endif

ATT_TILED_BEGIN
    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM;
    __global const uint2* kg = (__global const uint2*)(kb + k_off);   // 4 f16 a load
    __global const uint2* vg = (__global const uint2*)(vb + v_off);
    __global const float2* q = (__global const float2*)(qb + q_off);
    __global float2* o = (__global float2*)(ob + o_off);
    __local uint2 ks2[ATT_MMA_BK * ATT_KS_W / 2];   // uint2-typed: 8-byte stores of K
    __local uint vt[HEAD_DIM * ATT_VT_W];
    __local uint* ks = (__local uint*)ks2;
#ifdef EMU_MMA
    __local uint emu[EMU_SC_WORDS];
#endif
    int last = n_past + min(rows, t0 + ATT_BQ) - 1;    // the group's last visible slot
    float qscale = scale * M_LOG2E_F;                  // scores in log2 units: exp2 below

    for (int pass = 0; pass < ATT_PASSES; pass++) {
        int rb = 32 * warp + 16 * ATT_MT * pass;       // the warp's first row (of the group) this pass
        uint qa[ATT_MT][HEAD_DIM / 16][4];
        float acc[ATT_MT][HEAD_DIM / 8][4], m_run[ATT_MT][2], l_run[ATT_MT][2];
ATT_UNROLL
        for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
            for (int hr = 0; hr < 2; hr++) {
                int t = t0 + rb + 16 * mi + gq + 8 * hr;
                size_t at = ((size_t)t * n_heads + h) * (HEAD_DIM / 2) + tq;   // float2 units
ATT_UNROLL
                for (int c = 0; c < HEAD_DIM / 16; c++) {
                    float2 x0 = t < rows ? q[at + 8 * c] : (float2)(0.0f);       // dims 16c + 2tq..
                    float2 x1 = t < rows ? q[at + 8 * c + 4] : (float2)(0.0f);   // dims 16c + 2tq + 8..
                    qa[mi][c][hr] = ATT_PACK(x0.x * qscale, x0.y * qscale);
                    qa[mi][c][2 + hr] = ATT_PACK(x1.x * qscale, x1.y * qscale);
                }
                m_run[mi][hr] = -INFINITY;
                l_run[mi][hr] = 0.0f;
ATT_UNROLL
                for (int n = 0; n < HEAD_DIM / 8; n++) acc[mi][n][2 * hr] = acc[mi][n][2 * hr + 1] = 0.0f;
            }

        for (int c0 = 0; c0 <= last; c0 += ATT_MMA_BK) {
            // K rows as stored: thread e loads dims 4 d4.. of key i (a warp reads whole rows)
            for (int e = lid; e < ATT_MMA_BK * HEAD_DIM / 4; e += ATT_BQ) {
                int i = e / (HEAD_DIM / 4), d4 = e % (HEAD_DIM / 4);
                size_t at = ((size_t)(c0 + i) * kv_stride + kvh * HEAD_DIM) / 4 + d4;
                ks2[(i * ATT_KS_W) / 2 + d4] = c0 + i <= last ? kg[at] : (uint2)(0u);
            }
            // V transposed: thread e takes keys 2 i2, 2 i2 + 1 at dims 4 d4..; a warp's 32 lanes
            // write 32 consecutive words of each dim row
            for (int e = lid; e < ATT_MMA_BK / 2 * HEAD_DIM / 4; e += ATT_BQ) {
                int i2 = e % (ATT_MMA_BK / 2), d4 = e / (ATT_MMA_BK / 2), key = c0 + 2 * i2;
                size_t at = ((size_t)key * kv_stride + kvh * HEAD_DIM) / 4 + d4;
                uint2 u0 = key <= last ? vg[at] : (uint2)(0u);
                uint2 u1 = key + 1 <= last ? vg[at + kv_stride / 4] : (uint2)(0u);
                __local uint* dst = vt + 4 * d4 * ATT_VT_W + i2;
                dst[0] = (u0.x & 0xFFFFu) | (u1.x << 16);
                dst[ATT_VT_W] = (u0.x >> 16) | (u1.x & 0xFFFF0000u);
                dst[2 * ATT_VT_W] = (u0.y & 0xFFFFu) | (u1.y << 16);
                dst[3 * ATT_VT_W] = (u0.y >> 16) | (u1.y & 0xFFFF0000u);
            }
            barrier(CLK_LOCAL_MEM_FENCE);
            // warp-uniform: skip tiles none of the warp's rows sees, and warps of rows past the step
            bool live = t0 + rb < rows && c0 <= n_past + t0 + rb + 16 * ATT_MT - 1;
#ifdef EMU_MMA
            // emulated MMAs hold barriers, so every warp takes every tile; what a skipped tile
            // did is undone after it, which tests the skip as well
            float keep[ATT_MT][HEAD_DIM / 8 + 1][4];
            for (int mi = 0; mi < ATT_MT; mi++) {
                for (int n = 0; n < HEAD_DIM / 8; n++)
                    for (int i = 0; i < 4; i++) keep[mi][n][i] = acc[mi][n][i];
                for (int hr = 0; hr < 2; hr++) {
                    keep[mi][HEAD_DIM / 8][hr] = m_run[mi][hr];
                    keep[mi][HEAD_DIM / 8][2 + hr] = l_run[mi][hr];
                }
            }
            {
#else
            if (live) {
#endif
                float s[ATT_MT][ATT_MMA_BK / 8][4];
ATT_UNROLL
                for (int j = 0; j < ATT_MMA_BK / 8; j++) {   // S = Q K^T, 8 keys a column tile
ATT_UNROLL
                    for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
                        for (int i = 0; i < 4; i++) s[mi][j][i] = 0.0f;
ATT_UNROLL
                    for (int c = 0; c < HEAD_DIM / 16; c++) {
                        __local const uint* p = ks + (8 * j + gq) * ATT_KS_W + 8 * c + tq;
                        uint b0 = p[0], b1 = p[4];
ATT_UNROLL
                        for (int mi = 0; mi < ATT_MT; mi++) ATT_MMA(s[mi][j], qa[mi][c], b0, b1);
                    }
                }
                bool full = c0 + ATT_MMA_BK - 1 <= n_past + t0 + rb;   // every row sees every key
ATT_UNROLL
                for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
                    for (int hr = 0; hr < 2; hr++) {
                        // the row's keys in this tile: index <= lim (slot <= n_past + t)
                        int lim = n_past + t0 + rb + 16 * mi + gq + 8 * hr - c0;
                        float mx = -INFINITY;
ATT_UNROLL
                        for (int j = 0; j < ATT_MMA_BK / 8; j++)
ATT_UNROLL
                            for (int e = 0; e < 2; e++) {
                                float x = s[mi][j][2 * hr + e];
                                if (!full && 8 * j + 2 * tq + e > lim) x = -INFINITY;
                                s[mi][j][2 * hr + e] = x;
                                mx = fmax(mx, x);
                            }
                        mx = fmax(mx, ATT_XOR(mx, 1));
                        mx = fmax(mx, ATT_XOR(mx, 2));
                        float m_new = fmax(m_run[mi][hr], mx);
                        float m_use = m_new == -INFINITY ? 0.0f : m_new;   // no -inf - -inf
                        float alpha = native_exp2(m_run[mi][hr] - m_use);
                        m_run[mi][hr] = m_new;
                        float ls = 0.0f;   // this lane's part of the row sum (quads add at the end)
ATT_UNROLL
                        for (int j = 0; j < ATT_MMA_BK / 8; j++)
ATT_UNROLL
                            for (int e = 0; e < 2; e++) {
                                float p = native_exp2(s[mi][j][2 * hr + e] - m_use);
                                s[mi][j][2 * hr + e] = p;
                                ls += p;
                            }
                        l_run[mi][hr] = l_run[mi][hr] * alpha + ls;
ATT_UNROLL
                        for (int n = 0; n < HEAD_DIM / 8; n++) {
                            acc[mi][n][2 * hr] *= alpha;
                            acc[mi][n][2 * hr + 1] *= alpha;
                        }
                    }
ATT_UNROLL
                for (int j2 = 0; j2 < ATT_MMA_BK / 16; j2++) {   // O += P V, 16 keys a step
                    uint pa[ATT_MT][4];
ATT_UNROLL
                    for (int mi = 0; mi < ATT_MT; mi++) {
                        pa[mi][0] = ATT_PACK(s[mi][2 * j2][0], s[mi][2 * j2][1]);
                        pa[mi][1] = ATT_PACK(s[mi][2 * j2][2], s[mi][2 * j2][3]);
                        pa[mi][2] = ATT_PACK(s[mi][2 * j2 + 1][0], s[mi][2 * j2 + 1][1]);
                        pa[mi][3] = ATT_PACK(s[mi][2 * j2 + 1][2], s[mi][2 * j2 + 1][3]);
                    }
ATT_UNROLL
                    for (int n = 0; n < HEAD_DIM / 8; n++) {
                        __local const uint* p = vt + (8 * n + gq) * ATT_VT_W + 8 * j2 + tq;
                        uint b0 = p[0], b1 = p[4];
ATT_UNROLL
                        for (int mi = 0; mi < ATT_MT; mi++) ATT_MMA(acc[mi][n], pa[mi], b0, b1);
                    }
                }
            }
#ifdef EMU_MMA
            if (!live)
                for (int mi = 0; mi < ATT_MT; mi++) {
                    for (int n = 0; n < HEAD_DIM / 8; n++)
                        for (int i = 0; i < 4; i++) acc[mi][n][i] = keep[mi][n][i];
                    for (int hr = 0; hr < 2; hr++) {
                        m_run[mi][hr] = keep[mi][HEAD_DIM / 8][hr];
                        l_run[mi][hr] = keep[mi][HEAD_DIM / 8][2 + hr];
                    }
                }
#endif
            barrier(CLK_LOCAL_MEM_FENCE);
        }

ATT_UNROLL
        for (int mi = 0; mi < ATT_MT; mi++)
ATT_UNROLL
            for (int hr = 0; hr < 2; hr++) {
                float l = l_run[mi][hr];
                l += ATT_XOR(l, 1);
                l += ATT_XOR(l, 2);
                int t = t0 + rb + 16 * mi + gq + 8 * hr;
                if (t < rows) {
                    size_t at = ((size_t)t * n_heads + h) * (HEAD_DIM / 2) + tq;   // dims 8n + 2tq..
ATT_UNROLL
                    for (int n = 0; n < HEAD_DIM / 8; n++)
                        o[at + 4 * n] = (float2)(acc[mi][n][2 * hr], acc[mi][n][2 * hr + 1]) / l;
                }
            }
    }
}
#endif  // ATT_MMA_BODY
