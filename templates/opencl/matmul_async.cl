// matmul_tiled's cp.async body (matmul.cl): f16 weights on 128-row tiles, staged f16 x,
// -DMMA_ASYNC, mma.sync (NVIDIA sm_80+, or emulated); Hopper takes matmul_wgmma.cl instead. The
// tiles and warps of matmul_mma.cl, fed as sm_80 GEMMs are: cp.async copies each stage's rows
// into local memory, ASYNC_STAGES stages of ASYNC_K values in flight in a ring, one barrier per
// stage; ldmatrix.x4 loads the A and B fragments (four 8x8 halves matrices per instruction).
// Local rows are ASYNC_K halves plus 16 bytes of pad (80 bytes: a ldmatrix phase's 8 rows of 16
// bytes land on distinct banks). -DEMU_MMA: ldmatrix as a local-memory exchange of row addresses.
// -DASYNC_K=<16|32> -DASYNC_STAGES=<2..5> override the defaults below (codegen, MM_TPAIR).
#if defined(MMA_ASYNC_BODY) && !defined(USE_NV_WGMMA)
#ifndef ASYNC_K
#define ASYNC_K 32
#endif
#ifndef ASYNC_STAGES
#define ASYNC_STAGES 3                       // 46 KB of the 48 KB a group may hold
#endif
#define ASYNC_ROW_W (ASYNC_K / 2 + 4)        // words per local row: 48 or 80 bytes, both
                                             // put a ldmatrix phase's 8 rows on distinct banks
#define ASYNC_UNITS (ASYNC_K / 8)            // 16-byte units per row
#define ASYNC_STAGE_W ((TM_G + TN) * ASYNC_ROW_W)
#define ASYNC_LDS_W (ASYNC_STAGES * ASYNC_STAGE_W > TM * TN ? ASYNC_STAGES * ASYNC_STAGE_W : TM * TN)

#ifdef EMU_MMA
#define CP_ASYNC_WAIT_PENDING()
// lane l of the warp gets, of matrix j, word l % 4 of row l / 4, whose address lane 8 j + l / 4 gave
inline void ldmatrix_x4(uint* r, __local const uint* base, int off, __local uint* sc) {
    int lid = get_local_id(0), lane = lid & 31;
    barrier(CLK_LOCAL_MEM_FENCE);
    sc[lid] = (uint)off;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < 4; j++) r[j] = base[sc[(lid & ~31) + 8 * j + (lane >> 2)] + (lane & 3)];
}
#define LDMATRIX_X4(r, base, off) ldmatrix_x4(r, base, off, emu_sc)
#else
#if ASYNC_STAGES == 2                       // wait_group's count must be a literal: ASYNC_STAGES - 2
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 0;" ::: "memory")
#elif ASYNC_STAGES == 3
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 1;" ::: "memory")
#elif ASYNC_STAGES == 4
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 2;" ::: "memory")
#elif ASYNC_STAGES == 5
#define CP_ASYNC_WAIT_PENDING() asm volatile("cp.async.wait_group 3;" ::: "memory")
#else
#error "ASYNC_STAGES: 2 to 5"
#endif
#define LDMATRIX_X4(r, base, off)                                                              \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"               \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SHARED_ADDR((base) + (off))))
#endif

// stage kt (from K value kb) into ring slot kt % ASYNC_STAGES: the TM_G x rows (thread e: row
// e / ASYNC_UNITS, 16-byte unit e % ASYNC_UNITS), then the TN weight rows the same way
inline void async_stage(__local uint* lds, gin sb, gin w, int t0, int rows, int K, int kb, int kt, int lid,
                        __local const int* rowmap) {
    __local uint* st = lds + (kt % ASYNC_STAGES) * ASYNC_STAGE_W;
    int k = kb + kt * ASYNC_K;
#pragma unroll
    for (int e = lid; e < (TM_G + TN) * ASYNC_UNITS; e += 256) {
        int r = e / ASYNC_UNITS, u = e % ASYNC_UNITS;
        int live;
        __global const uint4* src = stage_src(sb, w, t0, rows, K, k, r, u, rowmap, &live);
        cp_async16(st + r * ASYNC_ROW_W + 4 * u, src, live);
    }
}

MATMUL_TILED_BEGIN
    __local uint lds[ASYNC_LDS_W] __attribute__((aligned(16)));   // the ring; at the end out [TM][TN]
#ifdef EMU_MMA
    __local uint emu_sc[EMU_SC_WORDS];
#endif
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);
    barrier(CLK_LOCAL_MEM_FENCE);
    int t0 = t0g;                            // both token tiles at once (MM_TPAIR)

    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3;
    int wm = (warp / MMA_WARPS_N) * 32, wn = (warp % MMA_WARPS_N) * MMA_WN;
    float acc[2][MMA_NT][4] = {{{0.0f}}};   // warp tile: 2 x 16 tokens, MMA_NT x 8 slots
    // ldmatrix row addresses (words, within a stage): A, matrices (rows 0-7 | 8-15) x (k 0-7 |
    // 8-15) of 16 tokens; B, (k 0-7 | 8-15) x (slots 0-7 | 8-15) of 16 weight rows
    int a_off = (wm + (lane & 15)) * ASYNC_ROW_W + 4 * (lane >> 4);
    int b_off = (TM_G + wn + (lane & 7) + 8 * (lane >> 4)) * ASYNC_ROW_W + 4 * ((lane >> 3) & 1);

    int nk = (ke - kb) / ASYNC_K;
    for (int s = 0; s < ASYNC_STAGES - 1; s++) {
        if (s < nk) async_stage(lds, sb, w, t0, rows, K, kb, s, lid, rowmap);
        CP_ASYNC_COMMIT();
    }
    for (int kt = 0; kt < nk; kt++) {
        CP_ASYNC_WAIT_PENDING();             // this thread's copies of stage kt have landed
        barrier(CLK_LOCAL_MEM_FENCE);        // everyone's; and stage kt - 1's slot is free
        if (kt + ASYNC_STAGES - 1 < nk) async_stage(lds, sb, w, t0, rows, K, kb, kt + ASYNC_STAGES - 1, lid, rowmap);
        CP_ASYNC_COMMIT();                   // (empty groups keep the count of pending ones)
        __local const uint* st = lds + (kt % ASYNC_STAGES) * ASYNC_STAGE_W;
#pragma unroll
        for (int c = 0; c < ASYNC_K / 16; c++) {
            uint a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) LDMATRIX_X4(a[mi], st, a_off + 16 * mi * ASYNC_ROW_W + 8 * c);
#pragma unroll
            for (int nj = 0; nj < MMA_NT; nj += 2) {
                uint b[4];                   // b0, b1 of slots 8 nj .., then of 8 (nj + 1) ..
                LDMATRIX_X4(b, st, b_off + 8 * nj * ASYNC_ROW_W + 8 * c);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    MMA_F16(acc[mi][nj], a[mi], b[0], b[1]);
                    MMA_F16(acc[mi][nj + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }
    CP_ASYNC_WAIT_ALL();
    barrier(CLK_LOCAL_MEM_FENCE);

    MMA_TILE_END
}
#endif  // MMA_ASYNC_BODY && !USE_NV_WGMMA
