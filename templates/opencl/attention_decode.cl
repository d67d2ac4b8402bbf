// attention_decode: decode attention, one key per lane (attention.cl holds the shared
// definitions and attention_split; codegen builds them together).
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
    DEVICE_FENCE();            // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    __local int last;
    if (lid == 0) last = atomic_inc(count) == active - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    DEVICE_FENCE();
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
