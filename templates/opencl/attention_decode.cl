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
// -DQK_DEFER -DQKN_T=<f32|f16|bf16> -DQK_PARTS=<p> (Qwen3's per-head q / k norms, decode): the
// qkv matvec wrote q and k raw (q in place, k into kraw f32 [M, KVH * hd], the staging buffer)
// and this kernel finishes them: each group normalises and ropes its q head into local memory,
// and the groups of the split holding the row's own key (the last) do the same to that key and
// store it in the cache before they read keys (the groups of a KV head's query heads store the
// same bits). The finished q heads go to kraw's buffer after k, [M, H * hd], for the eviction
// scores launched next (never back into q: an op writes only its outputs, whose memory may be
// its inputs'). This spares the matvec a tail per head (a ticket, or a group per head): H100
// Qwen3-0.6B q4_0 qkv 11.4 us a launch against 6.6-7.7 for o_proj and down_proj; decode 1331 ->
// 1438 tok/s (BENCHMARKS.md round 25).
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

#ifdef QK_DEFER
#define ATT_K_T gout   // the row's own key is stored here
#define LD_QKN(p, i) CAT(ld_, QKN_T)(p, i)
#define ST_KV(p, i, v) CAT(st_, KV_T)(p, i, v)
#define ATT_Q(e) qs4[e]
#if HEAD_DIM > ATT_WG
#error "QK_DEFER: a thread per RoPE pair of q and k (codegen: head_dim <= att_dec_wg)"
#endif
// q (a head's raw values) and k (its KV head's), in local memory, each x / sqrt(mean(x^2) + eps)
// * its norm weight, then roped (pairs d, d + HEAD_DIM / 2): the operations and order of the
// matvec's epilogue (matmul_common.cl qk_norm_vals, epilogue), so the same bits. Thread e <
// HEAD_DIM takes pair e of q (e < HEAD_DIM / 2) or of k: its weights w1, w2 and its angle's
// cosine and sine c, s, which the kernel loaded and computed beside q's loads, so the norm weights
// cost no round trip of their own. Every thread calls it (barriers inside).
inline void qk_finish(__local float* q, __local float* k, __local float* part, float w1, float w2,
                      float c, float s, float eps, int lid) {
    if (lid < 2 * QK_PARTS) {
        __local const float* x = lid < QK_PARTS ? q : k;
        float ss = 0.0f;
        for (int d = lid % QK_PARTS; d < HEAD_DIM; d += QK_PARTS) ss += x[d] * x[d];
        part[lid] = ss;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float rq = 0.0f, rk = 0.0f;
    for (int p = 0; p < QK_PARTS; p++) {
        rq += part[p];
        rk += part[QK_PARTS + p];
    }
    rq = sqrt(rq / (float)HEAD_DIM + eps);
    rk = sqrt(rk / (float)HEAD_DIM + eps);
    const int hh = HEAD_DIM / 2;
    if (lid < HEAD_DIM) {                  // only this thread reads and writes its pair
        bool isq = lid < hh;
        int j = isq ? lid : lid - hh;
        __local float* x = isq ? q : k;
        float r = isq ? rq : rk;
        float x1 = x[j] / r * w1, x2 = x[j + hh] / r * w2;
        x[j] = x1 * c - x2 * s;
        x[j + hh] = x2 * c + x1 * s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#else
#define ATT_K_T gin
#define ATT_Q(e) q[e]
#endif

#ifdef USE_NV_PTX
#define SEG_MAX(v) warp_max(v)
#define SEG_SUM(v) warp_sum(v)
#else
#define SEG_MAX(v) seg_reduce(v, scr, true)
#define SEG_SUM(v) seg_reduce(v, scr, false)
#endif

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_decode(__global const int* step, gin qb, ulong q_off, ATT_K_T kb, ulong k_off,
                      gin vb, ulong v_off, gout ob, ulong o_off, gout sb, ulong s_off,
                      int n_heads, int n_kv_heads, float scale, int M
#ifdef QK_DEFER
                      , gout krawb, ulong kraw_off, gin freqb, ulong freq_off, gin qnb, ulong qn_off,
                      gin knb, ulong kn_off, float qk_eps
#endif
                      ) {
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
#ifdef QK_DEFER
    __local float4 qs4[HEAD_DIM / 4];
    __local float kh[HEAD_DIM], qk_part[2 * QK_PARTS];
    __local float* qh = (__local float*)qs4;
    // every load of the prologue at once: the raw values, the weights, the angle (threads past
    // HEAD_DIM load element 0's and leave them unused)
    int e0 = lid < HEAD_DIM ? lid : 0, j0 = e0 < HEAD_DIM / 2 ? e0 : e0 - HEAD_DIM / 2;
    gin wqk = e0 < HEAD_DIM / 2 ? qnb + qn_off : knb + kn_off;
    float qv = ((__global const float*)q)[e0];
    float kv = ((__global const float*)(krawb + kraw_off))[((size_t)t * n_kv_heads + kvh) * HEAD_DIM + e0];
    float w1 = LD_QKN(wqk, j0), w2 = LD_QKN(wqk, j0 + HEAD_DIM / 2), rc;
    float ang = (float)(STEP_START_POS(step) + t) * ((__global const float*)(freqb + freq_off))[j0];
    float rs = sincos(ang, &rc);   // one range reduction for both, as the matvec's epilogue
    if (lid < HEAD_DIM) {
        qh[lid] = qv;
        kh[lid] = kv;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    qk_finish(qh, kh, qk_part, w1, w2, rc, rs, qk_eps, lid);
    // the row's own key, length - 1, is in the last split; the finished q heads go out once
    if (split == active - 1 && lid < HEAD_DIM)
        ST_KV(kb + k_off, (size_t)(length - 1) * kv_stride + head_at + lid, kh[lid]);
    if (split == 0 && lid < HEAD_DIM)
        ((__global float*)(krawb + kraw_off))[(size_t)M * n_kv_heads * HEAD_DIM + ((size_t)t * n_heads + h) * HEAD_DIM + lid] =
            qh[lid];
    // the group's reads of that key below see it. Every group passes it: PoCL compiled this
    // barrier wrongly inside `if (split == active - 1)`: with one split, the finished q never
    // reached the buffer
    barrier(CLK_GLOBAL_MEM_FENCE);
#endif
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
        for (int e = 0; e < HEAD_DIM / 4; e++) s += dot(ATT_Q(e), ld_kv4(k, krow + 4 * e));
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
