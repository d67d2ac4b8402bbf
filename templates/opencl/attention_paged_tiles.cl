// attention_paged_tiles: runs of rows of one sequence (a prompt chunk), ATT_PQ rows a group
// (attention_paged.cl holds the shared definitions and the arithmetic every row follows). A
// group is (query head, ATT_PQ consecutive rows of the step); it takes each run of rows of one
// sequence among them in turn (rows with no neighbour of their sequence are the rows kernel's),
// stages each chunk of 32 entries' K and V once in local memory for all of the run's rows, and
// warp w scores it for rows w, w + NW, ... of the run (lane i: entry i), keeping each row's
// slot, group and total states in registers as the rows kernel's groups keep them.
// Grid: (H * ATT_WG, ceil(rows / ATT_PQ)).
//
// Each chunk and each run ends at a barrier (rather than the next one starting with it): the
// branches that differ between work-items (a warp's row past the run, lanes past HEAD_DIM) must
// rejoin at a barrier of the kernel's own. PoCL 3.x puts implicit barriers on the exit and latch
// of a loop that holds barriers; a branch that rejoins only there it takes for a conditional
// barrier, uniform in the group, and work-item 0 (its "peeled" work-item) decides for all: lanes
// past HEAD_DIM and warps past the run then wrote o rows that are not theirs, past the run and
// past o itself (NaN logits from a step whose prompt chunk filled a group's last warp row).
#ifdef ATT_TILES
#define ATT_PQ (ATT_NW * ATT_RPW)                // rows a group

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_paged_tiles(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                           gin vb, ulong v_off, gout ob, ulong o_off, gin rsb, ulong rs_off,
                           gin clb, ulong cl_off, gin tbb, ulong tb_off,
                           int n_heads, int n_kv_heads, float scale, int M, int tab_w) {
    int lid = get_local_id(0), lane = lid & 31, warp = lid >> 5, h = get_group_id(0);
    int n = min(M, STEP_N_TOKENS(step)), r0 = get_group_id(1) * ATT_PQ, r_end = min(n, r0 + ATT_PQ);
    __global const int* row_seq = (__global const int*)(rsb + rs_off);
    __global const int* ctx_len = (__global const int*)(clb + cl_off);
    int kvh = h / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM, head_at = (size_t)kvh * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    __global const float4* q = (__global const float4*)(qb + q_off);
    // K rows padded by a float4: lane i reads row i, and rows a multiple of 128 bytes apart
    // would put every lane's load in one bank
    __local float4 ks[32][ATT_D4 + 1];
    __local float4 vs4[32][ATT_D4];              // V rows; lanes read consecutive dims
    __local float4 qs[ATT_PQ][ATT_D4];
    __local const float* vs = (__local const float*)vs4;
#ifndef USE_NV_PTX
    __local float scr[ATT_WG];
#endif
    for (int cur = r0; cur < r_end;) {           // uniform: every thread reads the same rows
        int seq = row_seq[cur], end = cur + 1;
        while (end < r_end && row_seq[end] == seq) end++;
        bool run = end - cur > 1 || in_run(row_seq, cur, n);
        if (!run) {
            cur = end;
            continue;
        }
        __global const int* tab = (__global const int*)(tbb + tb_off) + (size_t)seq * tab_w;
        int lmax = 0;
        for (int r = cur; r < end; r++) lmax = max(lmax, ctx_len[r]);
        for (int e = lid; e < (end - cur) * ATT_D4; e += ATT_WG)
            qs[e / ATT_D4][e % ATT_D4] = q[((size_t)(cur + e / ATT_D4) * n_heads + h) * ATT_D4 + e % ATT_D4];
        // each row of the warp: L, P (chunks a slot), and its slot (cm, cl, co), group (gm, gl,
        // go) and total (tm, tl, to) states
        int L[ATT_RPW], P[ATT_RPW];
        float cm[ATT_RPW], cl[ATT_RPW], co[ATT_RPW][ATT_DPL];
        float gm[ATT_RPW], gl[ATT_RPW], go[ATT_RPW][ATT_DPL];
        float tm[ATT_RPW], tl[ATT_RPW], to[ATT_RPW][ATT_DPL];
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++) {
            int t = cur + warp + ATT_NW * r;
            L[r] = t < end ? ctx_len[t] : 0;
            int nch = (L[r] + 31) / 32;
            P[r] = max(1, (nch + ATT_NW * ATT_SPLITS - 1) / (ATT_NW * ATT_SPLITS));
            cm[r] = gm[r] = tm[r] = -INFINITY;
            cl[r] = gl[r] = tl[r] = 0.0f;
            for (int i = 0; i < ATT_DPL; i++) co[r][i] = go[r][i] = to[r][i] = 0.0f;
        }
        for (int c = 0; c < (lmax + 31) / 32; c++) {
            for (int e = lid; e < 32 * ATT_D4; e += ATT_WG) {
                int i = e / ATT_D4, d4 = e % ATT_D4;
                size_t at = kv_row(tab, min(32 * c + i, lmax - 1)) * kv_stride + head_at + 4 * d4;
                ks[i][d4] = pg_kv4(k, at);
                vs4[i][d4] = pg_kv4(v, at);
            }
            barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
            for (int r = 0; r < ATT_RPW; r++) {
                int key = 32 * c + lane;
                bool active = 32 * c < L[r];     // warp-uniform
                if (active && c > 0 && c % P[r] == 0) {   // a new slot: the last one folds in
                    float2 fw = fold_weights(gm[r], cm[r]);
                    gl[r] = fold1(gl[r], cl[r], fw);
                    for (int i = 0; i < ATT_DPL; i++) go[r][i] = fold1(go[r][i], co[r][i], fw);
                    gm[r] = fmax(gm[r], cm[r]);
                    if (c / P[r] % ATT_NW == 0) {         // and a new group: its group too
                        fw = fold_weights(tm[r], gm[r]);
                        tl[r] = fold1(tl[r], gl[r], fw);
                        for (int i = 0; i < ATT_DPL; i++) to[r][i] = fold1(to[r][i], go[r][i], fw);
                        tm[r] = fmax(tm[r], gm[r]);
                        gm[r] = -INFINITY;
                        gl[r] = 0.0f;
                        for (int i = 0; i < ATT_DPL; i++) go[r][i] = 0.0f;
                    }
                    cm[r] = -INFINITY;
                    cl[r] = 0.0f;
                    for (int i = 0; i < ATT_DPL; i++) co[r][i] = 0.0f;
                }
                __local const float4* qr = qs[warp + ATT_NW * r];
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < ATT_D4; e++) s = s + dot(qr[e], ks[lane][e]);
                s = active && key < L[r] ? s * scale : -INFINITY;
                float mt = cm[r], lt = cl[r], p, alpha;
                CHUNK_SOFTMAX(mt, lt, s, p, alpha)
                if (active) {
                    cm[r] = mt;
                    cl[r] = lt;
                    for (int i = 0; i < ATT_DPL; i++) co[r][i] = co[r][i] * alpha;
                }
                SEG_PUBLISH(p)
                int jn = active ? min(32, L[r] - 32 * c) : 0;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    float pj = SEG_BCAST(p, j);
                    if (j < jn)
#pragma unroll
                        for (int i = 0; i < ATT_DPL; i++)
                            if (lane + 32 * i < HEAD_DIM)
                                co[r][i] = fma(pj, vs[j * HEAD_DIM + lane + 32 * i], co[r][i]);
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);        // the chunk's reads are done; its branches rejoin
        }
#pragma unroll
        for (int r = 0; r < ATT_RPW; r++) {
            int t = cur + warp + ATT_NW * r;
            if (t >= end) continue;
            // the last slot into its group, the group into the total (the rows kernel's folds)
            float2 fw = fold_weights(gm[r], cm[r]);
            gl[r] = fold1(gl[r], cl[r], fw);
            for (int i = 0; i < ATT_DPL; i++) go[r][i] = fold1(go[r][i], co[r][i], fw);
            gm[r] = fmax(gm[r], cm[r]);
            fw = fold_weights(tm[r], gm[r]);
            tl[r] = fold1(tl[r], gl[r], fw);
            __global float* out = (__global float*)(ob + o_off) + ((size_t)t * n_heads + h) * HEAD_DIM;
            for (int i = 0; i < ATT_DPL; i++)
                if (lane + 32 * i < HEAD_DIM) out[lane + 32 * i] = fold1(to[r][i], go[r][i], fw) / tl[r];
        }
        barrier(CLK_LOCAL_MEM_FENCE);            // the run's branches rejoin (see the top)
        cur = end;
    }
}
#endif
