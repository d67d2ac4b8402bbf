// Paged attention: a step graph's attention (compiler/ir.py "Step graphs"). Row t of the step
// attends the entries j < ctx_len[t] of its sequence, entry j at cache row
// block_tables[row_seq[t], j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK. This file holds what both
// kernels share; their bodies: attention_paged_rows.cl (a row spread over work-groups, as
// decode wants) and attention_paged_tiles.cl (a run of rows of one sequence per group, as a
// prompt chunk wants).
//   -DHEAD_DIM=<a multiple of 4, at most 256>  -DKV_T=<f32|f16|q8_0|q4_0> -DKV_<T>
//   -DKV_BLOCK=<entries a block>  -DATT_WG=<threads, a multiple of 32>
//   -DATT_SPLITS=<work-groups a row and head at most>  [-DATT_TILES -DATT_RPW=<rows a warp>]
//   q f32 [M, H*hd]   k, v KV_T [S, KVH, hd]   o f32 [M, H*hd]
//   row_seq, ctx_len i32 [M]   block_tables i32 [B, tab_w]
// The host checked every index (runtime/backends/opencl_step.py): a row reads the table entries
// of its own entries only (j < ctx_len), so entries past them may hold anything.
//
// Batch invariance: a row's output depends, bit for bit, on its query, its sequence's cache
// entries and ctx_len L alone, never on the other rows of the step, their number, or which of
// the two kernels took the row. Both run one arithmetic per row, fixed by L:
//   chunks of 32 entries, lane i scoring entry 32 c + i; nch = ceil(L / 32) chunks, P =
//   ceil(nch / (NW * ATT_SPLITS)) chunks a slot: slot s holds chunks [s P, (s + 1) P), taken in
//   order with an online softmax (CHUNK_SOFTMAX; then the V rows summed entry by entry, fma);
//   NW consecutive slots make a group, folded in order (fold), and the groups fold in order
//   into the row's total; o = total o / total l.
// A row with a neighbour row of the same sequence (a run: a prompt chunk) goes to the tiles
// kernel where it is on (ATT_TILES), any other row to the rows kernel: the same bits either way.
// Contraction is off and the fused multiply-adds are written out: a compiler free to contract
// a * b + c in one kernel and not in the other would break that identity.
#pragma OPENCL FP_CONTRACT OFF

#define LD_KV(p, i) CAT(ld_, KV_T)(p, i)
#define ATT_NW (ATT_WG / 32)                     // warps a group
#define ATT_D4 (HEAD_DIM / 4)
#define ATT_DPL ((HEAD_DIM + 31) / 32)           // V dims a lane holds: lane + 32 i

// 4 consecutive cache elements from element i (a multiple of 4)
#if defined(KV_F16)
inline float4 pg_kv4(gin p, size_t i) {
    uint2 u = ((__global const uint2*)p)[i >> 2];
    return (float4)(half2_bits_to_float2(u.x), half2_bits_to_float2(u.y));
}
#elif defined(KV_F32)
inline float4 pg_kv4(gin p, size_t i) { return ((__global const float4*)p)[i >> 2]; }
#else
inline float4 pg_kv4(gin p, size_t i) { return (float4)(LD_KV(p, i), LD_KV(p, i + 1), LD_KV(p, i + 2), LD_KV(p, i + 3)); }
#endif

// the cache row of entry j of a sequence (tab: its row of block_tables)
inline size_t kv_row(__global const int* tab, int j) {
    return (size_t)tab[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK;
}

// whether row t has a neighbour row of its sequence (the tiles kernel takes it)
inline bool in_run(__global const int* row_seq, int t, int n) {
    int s = row_seq[t];
    return (t > 0 && row_seq[t - 1] == s) || (t + 1 < n && row_seq[t + 1] == s);
}

#ifdef USE_NV_PTX
#define SEG_MAX(v) warp_max(v)
#define SEG_SUM(v) warp_sum(v)
#define SEG_BCAST(v, j) warp_bcast(v, j)
#define SEG_PUBLISH(v)
#else
#define SEG_MAX(v) seg_reduce(v, scr, true)
#define SEG_SUM(v) seg_reduce(v, scr, false)
// lane j's v, once SEG_PUBLISH(v) has put every lane's in scr
#define SEG_BCAST(v, j) scr[(get_local_id(0) & ~31) + (j)]
#define SEG_PUBLISH(v) { barrier(CLK_LOCAL_MEM_FENCE); scr[get_local_id(0)] = (v); barrier(CLK_LOCAL_MEM_FENCE); }
#endif

// One chunk into a slot's state (m, l), warp-collective: s is the lane's score (-inf: no
// entry). Returns the lane's weight p; *alpha is what the state's o is multiplied by.
#define CHUNK_SOFTMAX(m, l, s, p, alpha)                                          \
    {                                                                             \
        float mn_ = fmax(m, SEG_MAX(s));                                          \
        p = s == -INFINITY ? 0.0f : exp(s - mn_);                                 \
        alpha = m == -INFINITY ? 0.0f : exp(m - mn_);                             \
        l = l * alpha + SEG_SUM(p);                                               \
        m = mn_;                                                                  \
    }

// The weights (a, b) that fold a later part (max m2) into a state (max m): x = x a + x2 b for
// its l and o, then m = fmax(m, m2). The empty state (m = -inf) weighs 0, so the first part
// folded comes out unchanged (0 * 0 + x * 1); a part with no entries (l2 = 0) is never folded.
inline float2 fold_weights(float m, float m2) {
    float mn = fmax(m, m2);
    return (float2)(m == -INFINITY ? 0.0f : exp(m - mn), exp(m2 - mn));
}
inline float fold1(float x, float x2, float2 w) { return x * w.x + x2 * w.y; }
