// attention_paged_rows: a row spread over work-groups, flash-decoding style (attention_paged.cl
// holds the shared definitions and the arithmetic every row follows). A group is (ATT_HPG query
// heads of one KV head, group g of the row's slots, row); warp w takes slot g NW + w, lane i
// entry 32 c + i of each chunk c, scoring it against each head's q (its whole K row, loaded once
// for the heads), then sums the chunk's V rows (loaded once) over its dims, for each head in the
// order one head alone sums them: -DATT_HPG=<heads a group> changes no head's bits.
// Groups past the row's slots return at once, so the grid (sized by codegen for the whole
// cache) costs nothing at short contexts. The warps' states fold in local memory; a row of one
// group writes o directly, else each group writes its partial, takes a ticket, and the last
// folds them all in order and puts the counter back to 0.
//   scratch  int counters [M, H] (a group's first head's), then f32 partials [M, H, ATT_SPLITS, hd + 2]
// Grid: (H / ATT_HPG * ATT_SPLITS * ATT_WG, rows); -DATT_GRID_BY_ROWS: (H / ATT_HPG * ceil(longest
// row / ATT_WG) * ATT_WG, rows).
#ifndef ATT_HPG
#define ATT_HPG 1
#endif
// the heads' loops with barriers inside (PoCL's warp reductions): unrolled where shuffles keep the
// heads' states in registers; elsewhere a loop, as PoCL copies the code between barriers per copy
#ifdef USE_NV_PTX
#define ATT_HEAD_LOOP _Pragma("unroll")
#else
#define ATT_HEAD_LOOP _Pragma("unroll 1")
#endif
#define ATT_VB (ATT_DPL > 2 ? 16 : 32)          // V rows per batch of loads (registers)

// the lane's V dims of cache row `row` (lane + 32 i; dims past HEAD_DIM left as they are)
inline void ld_v_lane(gin v, size_t row, size_t kv_stride, size_t head_at, int lane, float* out) {
#pragma unroll
    for (int i = 0; i < ATT_DPL; i++)
        if (lane + 32 * i < HEAD_DIM) out[i] = LD_KV(v, row * kv_stride + head_at + lane + 32 * i);
}

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1)))
void attention_paged_rows(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                          gin vb, ulong v_off, gout ob, ulong o_off, gin rsb, ulong rs_off,
                          gin clb, ulong cl_off, gin tbb, ulong tb_off, gout sb, ulong s_off,
                          int n_heads, int n_kv_heads, float scale, int M, int tab_w) {
    int lid = get_local_id(0), lane = lid & 31, warp = lid >> 5, t = get_group_id(1);
#ifdef ATT_GRID_BY_ROWS
    // the grid holds only the splits the step's longest row has chunks for (the runtime sizes it:
    // ceil(longest / ATT_WG)); a row's splits depend on its own length alone, as below
    int ns = get_num_groups(0) / (n_heads / ATT_HPG);
#else
    int ns = ATT_SPLITS;
#endif
    int h0 = get_group_id(0) / ns * ATT_HPG, g = get_group_id(0) % ns;   // the group's first head
    __global const int* row_seq = (__global const int*)(rsb + rs_off);
#ifdef ATT_TILES
    if (in_run(row_seq, t, min(M, STEP_N_TOKENS(step)))) return;   // attention_paged_tiles takes it
#endif
    int L = ((__global const int*)(clb + cl_off))[t];
    int nch = (L + 31) / 32;
    int P = (nch + ATT_NW * ATT_SPLITS - 1) / (ATT_NW * ATT_SPLITS);   // chunks a slot
    int G = (nch + ATT_NW * P - 1) / (ATT_NW * P);                     // groups with chunks
    if (g >= G) return;
    __global const int* tab = (__global const int*)(tbb + tb_off) + (size_t)row_seq[t] * tab_w;
    int kvh = h0 / (n_heads / n_kv_heads);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM, head_at = (size_t)kvh * HEAD_DIM;
    gin k = kb + k_off;
    gin v = vb + v_off;
    __global const float4* q = (__global const float4*)(qb + q_off) + ((size_t)t * n_heads + h0) * ATT_D4;
#ifndef USE_NV_PTX
    __local float scr[ATT_WG];
#endif
    float m[ATT_HPG], l[ATT_HPG], o[ATT_HPG][ATT_DPL];
    for (int hh = 0; hh < ATT_HPG; hh++) {
        m[hh] = -INFINITY;
        l[hh] = 0.0f;
        for (int i = 0; i < ATT_DPL; i++) o[hh][i] = 0.0f;
    }
    int c0 = (g * ATT_NW + warp) * P;           // the warp's slot: chunks [c0, c0 + P)
    for (int pass = 0; pass < P; pass++) {      // every warp the same count: barriers inside
        int c = c0 + pass, key = 32 * c + lane;
        bool active = c < nch;                  // warp-uniform
        size_t krow = kv_row(tab, min(key, L - 1));
        float s[ATT_HPG], p[ATT_HPG];
        for (int hh = 0; hh < ATT_HPG; hh++) s[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_D4; e++) {
            float4 k4 = pg_kv4(k, krow * kv_stride + head_at + 4 * e);
            for (int hh = 0; hh < ATT_HPG; hh++) s[hh] = s[hh] + dot(q[hh * ATT_D4 + e], k4);
        }
        ATT_HEAD_LOOP
        for (int hh = 0; hh < ATT_HPG; hh++) {
            float sh = active && key < L ? s[hh] * scale : -INFINITY;
            float mt = m[hh], lt = l[hh], ph, alpha;
            CHUNK_SOFTMAX(mt, lt, sh, ph, alpha)
            p[hh] = ph;
            if (active) {
                m[hh] = mt;
                l[hh] = lt;
                for (int i = 0; i < ATT_DPL; i++) o[hh][i] = o[hh][i] * alpha;
            }
        }
        int jn = active ? min(32, L - 32 * c) : 0;   // the chunk's entries
        // the table read once a block: a chunk lies in one block, or spans whole blocks
#if KV_BLOCK % 32 == 0
        size_t vbase = kv_row(tab, min(32 * c, L - 1));
#define V_ROW(j) (vbase + (j))
#elif 32 % KV_BLOCK == 0
        size_t vblk[32 / KV_BLOCK];
        for (int b = 0; b < 32 / KV_BLOCK; b++)
            vblk[b] = (size_t)tab[min(32 * c / KV_BLOCK + b, (L - 1) / KV_BLOCK)] * KV_BLOCK;
#define V_ROW(j) (vblk[(j) / KV_BLOCK] + (j) % KV_BLOCK)
#else
#define V_ROW(j) kv_row(tab, min(32 * c + (j), L - 1))
#endif
        for (int j0 = 0; j0 < 32; j0 += ATT_VB) {
            float vv[ATT_VB][ATT_DPL];
#pragma unroll
            for (int j = 0; j < ATT_VB; j++)
                if (j0 + j < jn) ld_v_lane(v, V_ROW(j0 + j), kv_stride, head_at, lane, vv[j]);
            ATT_HEAD_LOOP
            for (int hh = 0; hh < ATT_HPG; hh++) {
                SEG_PUBLISH(p[hh])
#pragma unroll
                for (int j = 0; j < ATT_VB; j++) {
                    float pj = SEG_BCAST(p[hh], j0 + j);
                    if (j0 + j < jn)
#pragma unroll
                        for (int i = 0; i < ATT_DPL; i++)
                            if (lane + 32 * i < HEAD_DIM) o[hh][i] = fma(pj, vv[j][i], o[hh][i]);
                }
            }
        }
#undef V_ROW
    }

    // the warps' slot states -> the group's, folded in slot order, a head at a time
    __local float wm[ATT_HPG * ATT_NW], wl[ATT_HPG * ATT_NW], wo[ATT_HPG * ATT_NW * HEAD_DIM];
    for (int hh = 0; hh < ATT_HPG; hh++) {
        if (lane == 0) {
            wm[hh * ATT_NW + warp] = m[hh];
            wl[hh * ATT_NW + warp] = l[hh];
        }
        for (int i = 0; i < ATT_DPL; i++)
            if (lane + 32 * i < HEAD_DIM) wo[(hh * ATT_NW + warp) * HEAD_DIM + lane + 32 * i] = o[hh][i];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __global float* out = (__global float*)(ob + o_off) + ((size_t)t * n_heads + h0) * HEAD_DIM;
    __global volatile int* count = (__global volatile int*)(sb + s_off) + (size_t)t * n_heads + h0;
    __global volatile float* parts = (__global volatile float*)(sb + s_off + (size_t)M * n_heads * 4)
                                     + ((size_t)t * n_heads + h0) * ATT_SPLITS * (HEAD_DIM + 2);
    for (int e = lid; e < ATT_HPG * HEAD_DIM; e += ATT_WG) {
        int hh = e / HEAD_DIM, d = e % HEAD_DIM;
        float gm = -INFINITY, gl = 0.0f, go = 0.0f;
        for (int w = 0; w < ATT_NW; w++) {
            int hw = hh * ATT_NW + w;
            if (wl[hw] == 0.0f) continue;         // a slot past the row's chunks
            float2 fw = fold_weights(gm, wm[hw]);
            gl = fold1(gl, wl[hw], fw);
            go = fold1(go, wo[hw * HEAD_DIM + d], fw);
            gm = fmax(gm, wm[hw]);
        }
        if (G == 1) {
            // the total is this group folded into the empty state: itself (attention_paged.cl)
            out[hh * HEAD_DIM + d] = go / gl;
        } else {
            __global volatile float* mine = parts + (hh * ATT_SPLITS + g) * (HEAD_DIM + 2);
            mine[2 + d] = go;
            if (d == 0) {
                mine[0] = gm;
                mine[1] = gl;
            }
        }
    }
    if (G == 1) return;
    DEVICE_FENCE();            // partials reach memory before the ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    __local int last;
    if (lid == 0) last = atomic_inc(count) == G - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last) return;
    DEVICE_FENCE();
    for (int e = lid; e < ATT_HPG * HEAD_DIM; e += ATT_WG) {
        int hh = e / HEAD_DIM, d = e % HEAD_DIM;
        float tm = -INFINITY, tl = 0.0f, to = 0.0f;
        for (int gg = 0; gg < G; gg++) {
            __global volatile float* ps = parts + (hh * ATT_SPLITS + gg) * (HEAD_DIM + 2);
            float2 fw = fold_weights(tm, ps[0]);
            tl = fold1(tl, ps[1], fw);
            to = fold1(to, ps[2 + d], fw);
            tm = fmax(tm, ps[0]);
        }
        out[hh * HEAD_DIM + d] = to / tl;
    }
    if (lid == 0) *count = 0;
}
