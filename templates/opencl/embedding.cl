// y[t] = table[tokens[t]], dequantized.   -DTABLE_T=<q4_0|q4_1|q8_0|f16|bf16|f32>
//   table TABLE_T [V, D] (quantized tables in the split layout of common.cl)
//   tokens i32 [M]     y f32 [M, D]
// Grid: (D, rows). Token ids were range-checked on the host.

#if defined(TABLE_Q4_0) || defined(TABLE_Q4_1) || defined(TABLE_Q8_0)
#define LD_TABLE(p, i, nblk) CAT(CAT(ld_, TABLE_T), _split)(p, i, nblk)
#else
#define LD_TABLE(p, i, nblk) CAT(ld_, TABLE_T)(p, i)
#endif

__kernel void embedding(__global const int* step, gin tb, ulong t_off, gin ib, ulong i_off,
                        gout yb, ulong y_off, int D, int V) {
    int d = get_global_id(0), t = get_global_id(1);
    if (d >= D) return;
    int tok = ((__global const int*)(ib + i_off))[t];
    size_t nblk = (size_t)V * D / 32;
    ((__global float*)(yb + y_off))[(size_t)t * D + d] = LD_TABLE(tb + t_off, (size_t)tok * D + d, nblk);
}
