// attention_tiled: prefill attention, the signature both bodies share and the portable
// fp32 body (the tensor-core body: attention_mma.cl).
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
