// matmul_tiled's wgmma body (matmul.cl): f16 weights on 128-row tiles, staged f16 x, -DMMA_ASYNC
// and -DUSE_NV_WGMMA (the runtime, on compute capability 9.0): the cp.async stages and ring of
// matmul_async.cl, multiplied by Hopper's warpgroup MMA. wgmma.mma_async (m64nNk16, f16 in, f32 accumulated) reads both operands
// from local memory through matrix descriptors, so no fragment is loaded into registers, and a
// warpgroup (4 warps) issues one instruction per 64 x N x 16 where mma.sync needs 4 N / 8.
// NVIDIA's OpenCL compiler targets sm_90, which has no wgmma: the kernel writes each wgmma
// instruction as a PTX comment, `// LLMRS_WGMMA_<what> <registers>`, through inline asm (so the
// compiler binds the accumulator registers), and the runtime rewrites those comments into the
// instructions and the target into sm_90a before the driver assembles the PTX
// (runtime/backends/opencl.py patch_wgmma_ptx). A stage holds x's TM_G rows, then the TN weight
// rows, each WG_K values (WG_RB bytes) in 16-byte units, in the swizzled layouts wgmma reads:
// row r at byte WG_RB r, its unit u stored as unit u ^ WG_SWZ(r), the XOR of the 32 / 64-byte
// swizzle modes, so the MMA's reads of 8 rows meet distinct banks; 8 rows (512 or 256 bytes,
// aligned) are one swizzle atom, the descriptors' stride (the interleaved 8 x 8 core matrices:
// H200 10.54 ms against 10.34, round 13). Warpgroup wg computes tokens 64 wg.. x all TN slots
// (MM_TPAIR: N = TN) or all 64 tokens x slots WG_N wg.. (N = TN / 2).
// A ring of WG_STAGES stages of WG_K values (-DWG_K=<16|32>; -DWG_STAGES, default as many as 40
// KB hold, at most 7); one barrier a stage; the copies run WG_STAGES - 1 stages ahead, and a
// warpgroup waits for a stage's MMAs before it issues the next (letting one stage's MMAs run
// behind the next: 7.39 -> 8.20 ms, round 13).
// -DEMU_MMA: wgmma computed in C from the same local memory (tests on any device).
#if defined(MMA_ASYNC_BODY) && defined(USE_NV_WGMMA)
#ifdef MM_TPAIR
#define WG_N TN
#else
#define WG_N (TN / 2)
#endif
#define WG_ACC (WG_N / 2)                    // accumulators per thread
#ifndef WG_K
#define WG_K 32
#endif
#define WG_UNITS (WG_K / 8)                  // 16-byte units of a row's stage
#define WG_RB (2 * WG_K)                     // bytes of a row's stage
#define WG_STAGE_BYTES ((TM_G + TN) * WG_RB)
#ifndef WG_STAGES
#if 40960 / WG_STAGE_BYTES > 7
#define WG_STAGES 7
#else
#define WG_STAGES (40960 / WG_STAGE_BYTES)
#endif
#endif
#define WG_AHEAD (WG_STAGES - 1)             // stages whose copies fly during a stage's MMAs
#define WG_SBO (8 * WG_RB)
#define WG_LBO 16                            // (unused by the swizzled K-major layouts)
#if WG_K == 32
#define WG_LAYOUT 2                          // the descriptor's 64-byte swizzle
#else
#define WG_LAYOUT 3                          // 32-byte
#endif
#define WG_KSTEP 32
#define WG_SWZ(r) (((r) & 7) / (8 / WG_UNITS))
#define WG_OFF(r, u) ((r) * WG_RB + 16 * ((u) ^ WG_SWZ(r)))
#define WG_LDS_W (WG_STAGES * WG_STAGE_BYTES / 4 > TM * TN ? WG_STAGES * WG_STAGE_BYTES / 4 : TM * TN)

#ifdef EMU_MMA
// K step c (values 16 c..) of the operands whose rows start at pa and pb (8-row aligned)
inline void emu_wgmma(float* d, __local const uchar* pa, __local const uchar* pb, int c, int lid) {
    int lane = lid & 31, w4 = (lid >> 5) & 3, gq = lane >> 2, tq = lane & 3;
    for (int idx = 0; idx < WG_ACC; idx++) {
        int j = idx >> 2, i = idx & 3, row = 16 * w4 + gq + 8 * (i >> 1), col = 8 * j + 2 * tq + (i & 1);
        float acc = 0.0f;
        for (int k = 16 * c; k < 16 * c + 16; k++)
            acc += vload_half(0, (__local const half*)(pa + WG_OFF(row, k >> 3) + 2 * (k & 7)))
                 * vload_half(0, (__local const half*)(pb + WG_OFF(col, k >> 3) + 2 * (k & 7)));
        d[idx] += acc;
    }
}
#define WG_MMA(d, pa, pb, c) emu_wgmma(d, pa, pb, c, lid)
#define WG_FENCE(d)
#define WG_COMMIT()
#define WG_WAIT0(d)
#define WG_CP_WAIT()
#define WG_PROXY_FENCE()
#else
#if WG_N == 128
#define WG_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_REGS "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_MMA_TEXT "// LLMRS_WGMMA_M64N128K16 " WG_REGS ", %64, %65, %66"
#elif WG_N == 64
#define WG_OPS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_REGS "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define WG_MMA_TEXT "// LLMRS_WGMMA_M64N64K16 " WG_REGS ", %32, %33, %34"
#else
#error "WG_N: 64 or 128 (128-row tiles)"
#endif

// a matrix descriptor: start address, leading and stride byte offsets, layout (swizzle) type
inline ulong wg_desc(__local const uchar* p) {
    return (ulong)((SHARED_ADDR(p) & 0x3FFFF) >> 4) | ((ulong)(WG_LBO >> 4) << 16) | ((ulong)(WG_SBO >> 4) << 32)
           | ((ulong)WG_LAYOUT << 62);
}
// the accumulators are operands of the fence and the wait, so the compiler keeps every use of
// them on its side of the asynchronous MMAs
#define WG_FENCE(d) asm volatile("// LLMRS_WGMMA_FENCE " WG_REGS : WG_OPS(d) :: "memory")
#define WG_MMA(d, pa, pb, c) asm volatile(WG_MMA_TEXT : WG_OPS(d) \
    : "l"(wg_desc((pa) + WG_KSTEP * (c))), "l"(wg_desc((pb) + WG_KSTEP * (c))), "r"(1) : "memory")
#define WG_COMMIT() asm volatile("// LLMRS_WGMMA_COMMIT" ::: "memory")
#define WG_WAIT0(d) asm volatile("// LLMRS_WGMMA_WAIT0 " WG_REGS : WG_OPS(d) :: "memory")
// cp.async.wait_group's count is a literal: WG_AHEAD - 1 groups may stay pending
#if WG_AHEAD == 1
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 0;" ::: "memory")
#elif WG_AHEAD == 2
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 1;" ::: "memory")
#elif WG_AHEAD == 3
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 2;" ::: "memory")
#elif WG_AHEAD == 4
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 3;" ::: "memory")
#elif WG_AHEAD == 5
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 4;" ::: "memory")
#elif WG_AHEAD == 6
#define WG_CP_WAIT() asm volatile("cp.async.wait_group 5;" ::: "memory")
#else
#error "WG_STAGES: at most 7"
#endif
// cp.async's stores, made visible to the MMAs' reads (the async proxy)
#define WG_PROXY_FENCE() asm volatile("fence.proxy.async.shared::cta;" ::: "memory")
#endif

// stage kt into ring slot kt % WG_STAGES in wgmma's layout; thread e: row e / WG_UNITS, unit
// e % WG_UNITS, so a warp reads whole rows (full 32-byte sectors; a lane a row, half sectors,
// made the body 33% slower) and, in the swizzled layouts, a quarter-warp's 16-byte stores fill
// 128 contiguous bytes
inline void wg_stage(__local uchar* lds, gin sb, gin w, int t0, int rows, int K, int kb, int kt, int lid,
                     __local const int* rowmap) {
    __local uchar* st = lds + (kt % WG_STAGES) * WG_STAGE_BYTES;
    int k = kb + kt * WG_K;
#pragma unroll
    for (int e = lid; e < (TM_G + TN) * WG_UNITS; e += 256) {
        int r = e / WG_UNITS, u = e % WG_UNITS;
        int live;
        __global const uint4* src = stage_src(sb, w, t0, rows, K, k, r, u, rowmap, &live);
        cp_async16((__local uint*)(st + WG_OFF(r, u)), src, live);
    }
}

MATMUL_TILED_BEGIN
    __local uint lds[WG_LDS_W] __attribute__((aligned(1024)));   // the ring (swizzle atoms aligned); at the end out [TM][TN]
    __local int rowmap[TN];
    for (int n = lid; n < TN; n += 256) rowmap[n] = slot_row(g, n, TN, N, n_heads, n_kv_heads, hd);
    barrier(CLK_LOCAL_MEM_FENCE);
    int t0 = t0g;
    int lane = lid & 31, warp = lid >> 5, gq = lane >> 2, tq = lane & 3, wg = warp >> 2, w4 = warp & 3;
    float d[WG_ACC];
#pragma unroll
    for (int i = 0; i < WG_ACC; i++) d[i] = 0.0f;
#ifdef MM_TPAIR
    int a_row = 64 * wg, b_row = TM_G;               // this warpgroup's A (token) and B (slot) rows
#else
    int a_row = 0, b_row = TM_G + WG_N * wg;
#endif
    __local uchar* ring = (__local uchar*)lds;

    int nk = (ke - kb) / WG_K;
    for (int s = 0; s < WG_AHEAD; s++) {
        if (s < nk) wg_stage(ring, sb, w, t0, rows, K, kb, s, lid, rowmap);
        CP_ASYNC_COMMIT();
    }
    for (int kt = 0; kt < nk; kt++) {
        WG_CP_WAIT();                        // this thread's copies of stage kt have landed
        WG_PROXY_FENCE();
        // everyone's; and each warpgroup's MMAs of stage kt - 1 are done, so
        // stage kt + WG_AHEAD may take their slot
        barrier(CLK_LOCAL_MEM_FENCE);
        if (kt + WG_AHEAD < nk) wg_stage(ring, sb, w, t0, rows, K, kb, kt + WG_AHEAD, lid, rowmap);
        CP_ASYNC_COMMIT();
        __local const uchar* st = ring + (kt % WG_STAGES) * WG_STAGE_BYTES;
        WG_FENCE(d);
#pragma unroll
        for (int c = 0; c < WG_K / 16; c++)   // unit pairs 2c, 2c + 1: K values 16c..
            WG_MMA(d, st + WG_OFF(a_row, 0), st + WG_OFF(b_row, 0), c);
        WG_COMMIT();
        WG_WAIT0(d);
    }
    WG_WAIT0(d);
    CP_ASYNC_WAIT_ALL();
    barrier(CLK_LOCAL_MEM_FENCE);

    // accumulator idx of a thread: row 16 w4 + gq (+ 8 for idx % 4 >= 2), column 8 (idx / 4) +
    // 2 tq + idx % 2 of the warpgroup's 64 x WG_N tile (the mma.sync C fragment, N / 8 times)
    __local float* out = (__local float*)lds;
    for (int mt = 0; mt < TM_G / TM; mt++) {
#ifdef MM_TPAIR
        if (wg == mt)
#endif
        {
#pragma unroll
            for (int idx = 0; idx < WG_ACC; idx++) {
                int row = 16 * w4 + gq + 8 * ((idx >> 1) & 1), col = 8 * (idx >> 2) + 2 * tq + (idx & 1);
#ifdef MM_TPAIR
                out[row * TN + col] = d[idx];
#else
                out[row * TN + WG_N * wg + col] = d[idx];
#endif
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        MM_SPLIT_MERGE(out, t0 / TM + mt)
        tile_epilogue(out, t0 + TM * mt, rows, g, lid, e0b + e0_off, e1b + e1_off, e2b + e2_off,
                      yb + y_off, N, n_heads, n_kv_heads, hd, step TILE_EPI_EXTRA);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}
#endif  // MMA_ASYNC_BODY && USE_NV_WGMMA
