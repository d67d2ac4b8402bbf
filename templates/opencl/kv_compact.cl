// KV-cache compaction for eviction (runtime/kv): per head, row j becomes old row idx[j], in place.
//   -DKV_UNIT=<uint4|uint2|uint|ushort>  -DROW_UNITS=<units in one head's row>  -DCOMPACT_WG=<threads>
//   cache  [rows, heads] of ROW_UNITS units each, at slot_stride / head_stride units apart
//          (a K or V cache [S, KVH, hd]: f32, f16, q8_0 or q4_0, whose head rows are whole 34 / 18-byte
//          blocks; or the scores f32 [KVH, S]: one unit a row)
//   idx    int [layers, heads, n_keep]: ascending old rows, idx[j] >= j
// One group per (head, layer). Its threads take the rows in chunks of COMPACT_WG: each reads
// its source row whole into registers, the group meets at a barrier, then each writes. A chunk's
// sources lie at or after its first row and every earlier chunk wrote only rows before it, so no
// row is overwritten before it is read: the gather is safe in place, in one launch. Rows
// [n_keep, zero_to) are then zeroed (scores: later steps add to them; 0 leaves them).
// Grid: (heads * COMPACT_WG, layers); layer l's cache lies layer_stride bytes after layer 0's.

__kernel __attribute__((reqd_work_group_size(COMPACT_WG, 1, 1)))
void kv_compact(gout cb, ulong c_off, ulong layer_stride, gin ib, ulong i_off, int n_keep,
                ulong slot_stride, ulong head_stride, int zero_to) {
    int lid = get_local_id(0), head = get_group_id(0), layer = get_group_id(1);
    int heads = get_num_groups(0);
    __global KV_UNIT* cache = (__global KV_UNIT*)(cb + c_off + layer * layer_stride) + head * head_stride;
    __global const int* idx = (__global const int*)(ib + i_off) + ((size_t)layer * heads + head) * n_keep;
    KV_UNIT row[ROW_UNITS];
    for (int j0 = 0; j0 < n_keep; j0 += COMPACT_WG) {
        int j = j0 + lid;
        if (j < n_keep)
            for (int u = 0; u < ROW_UNITS; u++) row[u] = cache[idx[j] * slot_stride + u];
        barrier(CLK_GLOBAL_MEM_FENCE);
        if (j < n_keep)
            for (int u = 0; u < ROW_UNITS; u++) cache[j * slot_stride + u] = row[u];
        barrier(CLK_GLOBAL_MEM_FENCE);
    }
    for (int j = n_keep + lid; j < zero_to; j += COMPACT_WG)
        for (int u = 0; u < ROW_UNITS; u++) cache[j * slot_stride + u] = (KV_UNIT)(0);
}
