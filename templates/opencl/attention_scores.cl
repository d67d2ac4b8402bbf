// Eviction scores of an attention op (compiler/ir.py): when score_ctl[0] != 0, each query row t
// at cache slot n_past + t >= score_ctl[1] adds its softmax weights over slots [0, n_past + t],
// summed over the query heads of each KV head, to scores[kvh, slot].
//   -DHEAD_DIM=<hd>  -DKV_T=<f32|f16|q8_0|q4_0> -DKV_<T>  -DSC_WG=<threads, a power of 2>
//   -DSC_GROUP=<query heads per KV head>
//   q  f32 [M, H*hd]     k  KV_T [S, KVH, hd]     scores  f32 [KVH, S]     ctl  i32 [2]
// One group per KV head: thread i owns slots i, i + SC_WG, ..., so it adds to its own scores
// without atomics, across all rows. Per row: each thread reads each of its K rows once for all
// SC_GROUP query heads and keeps an online max and sum per head; the group combines them; then
// each thread adds its slots' weights, summed over the heads (a second read of its K rows). The
// back end launches this only while a policy wants scores (free when off).
// Grid: (KVH * SC_WG, 1).

#define LD_KV(p, i) CAT(ld_, KV_T)(p, i)

// The cache row of a row's entry s: s itself, or through its block table (table != 0).
inline size_t score_slot(__global const int* table, int block, int s) {
    return table ? (size_t)table[s / block] * block + s % block : (size_t)s;
}

// One row's query heads (qs) dotted with the key at element `at` of the cache (one read of it).
inline void key_dots(__local const float* qs, gin k, size_t at, float* dot) {
    for (int j = 0; j < SC_GROUP; j++) dot[j] = 0.0f;
    for (int d = 0; d < HEAD_DIM; d++) {
        float kd = LD_KV(k, at + d);
        for (int j = 0; j < SC_GROUP; j++) dot[j] += qs[j * HEAD_DIM + d] * kd;
    }
}

// One query row's softmax weights over its `length` entries, summed over the SC_GROUP query heads
// of KV head kvh (q_row: the row's queries of those heads), added to sc at each entry's cache row.
// Every thread of the group calls it (barriers inside).
inline void score_row(__global const float* q_row, gin k, size_t kv_stride, size_t head_at, float scale,
                      int length, __global const int* table, int block, __global float* sc,
                      __local float* qs, __local float* red) {
    int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);              // the previous row's reads of qs are done
    for (int e = lid; e < SC_GROUP * HEAD_DIM; e += SC_WG) qs[e] = q_row[e];
    barrier(CLK_LOCAL_MEM_FENCE);
    float m[SC_GROUP], l[SC_GROUP];
    for (int j = 0; j < SC_GROUP; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int s = lid; s < length; s += SC_WG) {
        size_t slot = score_slot(table, block, s);
        float dot[SC_GROUP];
        key_dots(qs, k, slot * kv_stride + head_at, dot);
        for (int j = 0; j < SC_GROUP; j++) {
            float x = dot[j] * scale, mn = fmax(m[j], x);
            l[j] = l[j] * exp(m[j] - mn) + exp(x - mn);   // exp(-inf) = 0 before the first slot
            m[j] = mn;
        }
    }
    float gm[SC_GROUP], gl[SC_GROUP];
    for (int j = 0; j < SC_GROUP; j++) {
        gm[j] = wg_max(m[j], red);
        gl[j] = wg_sum(m[j] == -INFINITY ? 0.0f : l[j] * exp(m[j] - gm[j]), red);
    }
    for (int s = lid; s < length; s += SC_WG) {
        size_t slot = score_slot(table, block, s);
        float dot[SC_GROUP];
        key_dots(qs, k, slot * kv_stride + head_at, dot);
        float add = 0.0f;
        for (int j = 0; j < SC_GROUP; j++) add += exp(dot[j] * scale - gm[j]) / gl[j];
        sc[slot] += add;
    }
}

__kernel __attribute__((reqd_work_group_size(SC_WG, 1, 1)))
void attention_scores(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                      gout sb, ulong s_off, gin cb, ulong c_off,
                      int n_heads, int n_kv_heads, float scale, int slots) {
    __global const int* ctl = (__global const int*)(cb + c_off);
    if (ctl[0] == 0) return;
    int kvh = get_group_id(0);
    int n_past = STEP_N_PAST(step), n_tokens = STEP_N_TOKENS(step);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM, head_at = (size_t)kvh * HEAD_DIM;
    gin k = kb + k_off;
    __global const float* q = (__global const float*)(qb + q_off);
    __global float* sc = (__global float*)(sb + s_off) + (size_t)kvh * slots;
    __local float qs[SC_GROUP * HEAD_DIM];          // the row's queries of this KV head's heads
    __local float red[SC_WG];
    for (int t = max(0, ctl[1] - n_past); t < n_tokens; t++)
        score_row(q + ((size_t)t * n_heads + kvh * SC_GROUP) * HEAD_DIM, k, kv_stride, head_at, scale,
                  n_past + t + 1, 0, 1, sc, qs, red);
}

#ifdef KV_BLOCK
// A step graph's eviction scores (compiler/ir.py "Step graphs"): row t adds its weights, as
// attention_scores does, when its own KV index ctx_len[t] - 1 >= score_from[t], at the cache row
// of each entry it attends: entry j at block_tables[row_seq[t], j / KV_BLOCK] * KV_BLOCK + j %
// KV_BLOCK. -DKV_BLOCK=<entries a block> beside attention_scores' options.
//   row_seq, ctx_len, score_from i32 [M]   block_tables i32 [B, tab_w]
// One group per (KV head, sequence row of block_tables): it walks the step's rows in order and
// takes those of its sequence, thread i owning entries i, i + SC_WG, ...; the sequences' blocks
// are disjoint (no prefix cache under a scoring policy), so no two groups add to one score and
// each score gets its sequence's rows in step order, without atomics.
// Grid: (KVH * B * SC_WG, 1).
__kernel __attribute__((reqd_work_group_size(SC_WG, 1, 1)))
void attention_scores_paged(__global const int* step, gin qb, ulong q_off, gin kb, ulong k_off,
                            gout sb, ulong s_off, gin rb, ulong r_off, gin lb, ulong l_off,
                            gin tb, ulong t_off, gin fb, ulong f_off,
                            int n_heads, int n_kv_heads, float scale, int slots, int tab_w) {
    int kvh = get_group_id(0) % n_kv_heads, seq = get_group_id(0) / n_kv_heads;
    int n_tokens = STEP_N_TOKENS(step);
    __global const int* row_seq = (__global const int*)(rb + r_off);
    __global const int* ctx_len = (__global const int*)(lb + l_off);
    __global const int* table = (__global const int*)(tb + t_off) + (size_t)seq * tab_w;
    __global const int* score_from = (__global const int*)(fb + f_off);
    size_t kv_stride = (size_t)n_kv_heads * HEAD_DIM, head_at = (size_t)kvh * HEAD_DIM;
    gin k = kb + k_off;
    __global const float* q = (__global const float*)(qb + q_off);
    __global float* sc = (__global float*)(sb + s_off) + (size_t)kvh * slots;
    __local float qs[SC_GROUP * HEAD_DIM];          // the row's queries of this KV head's heads
    __local float red[SC_WG];
    for (int t = 0; t < n_tokens; t++) {
        if (row_seq[t] != seq || ctx_len[t] - 1 < score_from[t]) continue;   // the same for the whole group
        score_row(q + ((size_t)t * n_heads + kvh * SC_GROUP) * HEAD_DIM, k, kv_stride, head_at, scale,
                  ctx_len[t], table, KV_BLOCK, sc, qs, red);
    }
}
#endif
