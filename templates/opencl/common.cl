// Shared by every kernel family (prepended by compiler/codegen/opencl.py).
// Buffers are byte-addressed: each tensor argument is a buffer plus a byte offset, because
// sub-buffers need CL_DEVICE_MEM_BASE_ADDR_ALIGN, which some mobile drivers report unusably.
// The step scalars live in a small int buffer every kernel reads, so a step sets no arguments:
//   step[0] = n_tokens, step[1] = n_past, step[2] = start_pos
// Element-type tokens passed with -D: f32 f16 bf16 q4_0 q4_1 q8_0 (W_T, NORM_T, TABLE_T, KV_T).
// KV caches are f32, f16, q8_0 or q4_0 (-DKV_T=<t> -DKV_<T>), the blocked ones in GGML's own
// 34 / 18-byte blocks (not the weights' split layout), which kernels write a whole block at a time.
#if defined(KV_Q8_0) || defined(KV_Q4_0)
#define KV_BLOCKS
#endif
// Device switches chosen at bind time (runtime/backends/opencl.py device_options):
//   -DUSE_NV_PTX   NVIDIA: warp shuffles and dp4a through inline PTX (the driver reports no
//                  cl_khr_subgroups); without it the same arithmetic runs in portable C.
//   -DUSE_NV_MMA   NVIDIA sm_80+ (with USE_NV_PTX): the prefill matmul's tensor-core body
//                  (matmul.cl) for q4_0 / q4_1 / q8_0 / f16 weights, and prefill attention's
//                  (attention.cl) for f16 KV caches.
//   -DEMU_MMA      (tests, with USE_NV_MMA) the tensor-core bodies on any device: see below.
//   -DUSE_NV_PDL   NVIDIA sm_90+ (with USE_NV_PTX; LLMRS_OPENCL_PDL_MATVEC=1, off by default):
//                  programmatic dependent launch placed by the decode matvec itself when a
//                  CUDA graph replays the kernels (runtime/backends/opencl_cuda.py). PDL_WAIT():
//                  nothing before it may touch memory the kernels before write; PDL_TRIGGER():
//                  the next kernel may launch now (its groups wait at their PDL_WAIT);
//                  PDL_PREFETCH(p): an L2 prefetch of read-only bytes, allowed before the wait.
//                  Launched any other way they do nothing. A kernel that has them gets no wait
//                  of opencl_cuda.pdl_ptx's at its entry; every other kernel does.
//
// Quantized WEIGHTS (not KV caches) sit on the device in a split layout the back end makes
// at upload, same bytes in total: for a tensor of nblk blocks, the blocks' quants first
// (16 B per q4_0 / q4_1 block, 32 B per q8_0 block, so every block starts 16-byte aligned and
// neighbouring threads read neighbouring 16 B), then the nblk block headers: an f16 scale d,
// for q4_1 a pair (f16 d, f16 m), one 4-byte load. GGML's interleaved 18/20/34-byte blocks
// would force 1- or 2-byte loads.

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#define STEP_N_TOKENS(s) ((s)[0])
#define STEP_N_PAST(s) ((s)[1])
#define STEP_START_POS(s) ((s)[2])
// A step graph's row split (-DROW_SPLIT, compiler/codegen/opencl.py): its prompt rows 0..lead-1
// go through the tiled matmuls and its generated rows lead..n-1 through the matvec, so a row's
// arithmetic follows its own kind, never what else shares the step. The last word counts the
// generated rows (0 unless a step says so: every row then leads, as without the split).
#define STEP_ROW_LEAD(s) ((s)[0] - (s)[3])
#ifdef ROW_SPLIT
#define MM_ROWS(s) STEP_ROW_LEAD(s)
#define MV_ROW0(s) STEP_ROW_LEAD(s)
#else
#define MM_ROWS(s) STEP_N_TOKENS(s)
#define MV_ROW0(s) 0
#endif

typedef __global const uchar* gin;   // read-only tensor bytes
typedef __global uchar* gout;        // written tensor bytes

// -- scalar element loads by flat index; quantized rows are whole 32-value blocks ------------
inline float ld_f32(gin p, size_t i) { return ((__global const float*)p)[i]; }
inline float ld_f16(gin p, size_t i) { return vload_half(i, (__global const half*)p); }
inline float ld_bf16(gin p, size_t i) { return as_float(((uint)((__global const ushort*)p)[i]) << 16); }
inline float ld_q4_0(gin p, size_t i) {
    gin blk = p + (i >> 5) * 18;  // 18 B: f16 d, 16 B of nibbles (low = j, high = j + 16)
    uint k = (uint)(i & 31);
    uchar q = blk[2 + (k & 15)];
    int nib = k < 16 ? (q & 15) : (q >> 4);
    return (float)(nib - 8) * vload_half(0, (__global const half*)blk);
}
inline float ld_q8_0(gin p, size_t i) {
    gin blk = p + (i >> 5) * 34;  // 34 B: f16 d, 32 int8
    return (float)((__global const char*)blk)[2 + (i & 31)] * vload_half(0, (__global const half*)blk);
}

// split-layout weights: element i of a tensor of nblk blocks
inline float ld_q4_0_split(gin p, size_t i, size_t nblk) {
    size_t b = i >> 5;
    uint k = (uint)(i & 31);
    uchar q = p[b * 16 + (k & 15)];
    int nib = k < 16 ? (q & 15) : (q >> 4);
    return (float)(nib - 8) * vload_half(b, (__global const half*)(p + nblk * 16));
}
inline float ld_q8_0_split(gin p, size_t i, size_t nblk) {
    size_t b = i >> 5;
    return (float)((__global const char*)p)[i] * vload_half(b, (__global const half*)(p + nblk * 32));
}
inline float ld_q4_1_split(gin p, size_t i, size_t nblk) {
#pragma OPENCL FP_CONTRACT OFF   // q * d is rounded before + m, as in ggml's dequantize_row_q4_1
    size_t b = i >> 5;
    uint k = (uint)(i & 31);
    uchar q = p[b * 16 + (k & 15)];
    float2 dm = vload_half2(b, (__global const half*)(p + nblk * 16));   // (d, m)
    return (float)(k < 16 ? (q & 15) : (q >> 4)) * dm.x + dm.y;
}

// -- stores (KV caches) ----------------------------------------------------------------------
inline void st_f32(gout p, size_t i, float v) { ((__global float*)p)[i] = v; }
inline void st_f16(gout p, size_t i, float v) { vstore_half_rte(v, i, (__global half*)p); }

// f32 -> nearest f16 -> f32, as numpy's astype(float16) does to a Q8_0 block scale
inline float round_to_half(float v) {
    ushort h;
    vstore_half_rte(v, 0, (__private half*)&h);
    return vload_half(0, (__private const half*)&h);
}

inline float hsum16(float16 v) {
    float4 s = v.s0123 + v.s4567 + v.s89ab + v.scdef;
    return (s.x + s.y) + (s.z + s.w);
}

inline float hmax16(float16 v) {
    float8 a = fmax(v.lo, v.hi);
    float4 b = fmax(a.lo, a.hi);
    float2 c = fmax(b.lo, b.hi);
    return fmax(c.x, c.y);
}

// Q8_0 activation block, as ggml's quantize_row_q8_0_ref: d = amax/127 (kept as f16),
// q = round(x / d) half away from zero. x0 = values 0..15, x1 = 16..31 become the ints.
inline float quantize_q8_block(float16* x0, float16* x1) {
    float amax = fmax(hmax16(fabs(*x0)), hmax16(fabs(*x1)));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    *x0 = round(*x0 * id);
    *x1 = round(*x1 * id);
    return round_to_half(d);
}

// A q4_0 KV block from 32 values, as ggml's quantize_row_q4_0_ref: m = the first value of
// largest magnitude, d = m / -8 (kept as f16), q = min(15, trunc(x / d + 8.5)); byte j holds
// q[j] in its low nibble and q[j + 16] in its high one. x * id and + 8.5 round apart, as in C.
inline void store_q4_0_block(gout blk, const float* x) {
#pragma OPENCL FP_CONTRACT OFF
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < 32; i++) {
        if (amax < fabs(x[i])) { amax = fabs(x[i]); m = x[i]; }
    }
    float d = m / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    vstore_half_rte(d, 0, (__global half*)blk);
    for (int j = 0; j < 16; j++) {
        int lo = min(15, (int)(x[j] * id + 8.5f)), hi = min(15, (int)(x[j + 16] * id + 8.5f));
        blk[2 + j] = (uchar)(lo | (hi << 4));
    }
}

// Work-group reductions over a __local scratch of get_local_size(0) floats.
inline float wg_sum(float v, __local float* red) {
    int lid = get_local_id(0), n = get_local_size(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = n >> 1; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return red[0];
}

inline float wg_max(float v, __local float* red) {
    int lid = get_local_id(0), n = get_local_size(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = n >> 1; s > 0; s >>= 1) {
        if (lid < s) red[lid] = fmax(red[lid], red[lid + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return red[0];
}

// -- device primitives ------------------------------------------------------------------------
// A group's global writes made visible to every other group before its next memory operation
// (the ticket pattern: partials, fence, atomic ticket; the last group fences and reads them).
// OpenCL 1.2's mem_fence orders a work-item's accesses only as its work-group sees them, and
// NVIDIA's compiler may take it at that scope: the last group then read a partial not yet in
// L2 (the Qwen3 shape's q/k norm heads gave other tokens, now and then, under any launcher;
// BENCHMARKS.md round 23). PTX's fence.acq_rel.gpu orders them for the whole device.
#ifdef USE_NV_PTX
#define DEVICE_FENCE() asm volatile("fence.acq_rel.gpu;" ::: "memory")
#else
#define DEVICE_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#endif
#ifdef USE_NV_PDL
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#ifdef PDL_NO_TRIGGER   // measurements (LLMRS_OPENCL_PDL_MATVEC=notrigger): the next launches as groups end
#define PDL_TRIGGER()
#else
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#endif
#ifdef PDL_NO_PREFETCH  // (LLMRS_OPENCL_PDL_MATVEC=noprefetch)
#define PDL_PREFETCH(p)
#else
#define PDL_PREFETCH(p) asm volatile("prefetch.global.L2 [%0];" :: "l"((ulong)(p)))
#endif
#else
#define PDL_WAIT()
#define PDL_TRIGGER()
#define PDL_PREFETCH(p)
#endif
#ifdef USE_NV_PTX
// v of lane (lane ^ o) of the warp, o < 32; floats go through as their bits
inline uint shfl_xor_u(uint v, int o) {
    uint t;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(t) : "r"(v), "r"(o));
    return t;
}
inline float shfl_xor_f(float v, int o) { return as_float(shfl_xor_u(as_uint(v), o)); }
inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += shfl_xor_f(v, o);
    return v;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, shfl_xor_f(v, o));
    return v;
}
// lane src's v, to every lane of the warp
inline float warp_bcast(float v, int src) {
    float t;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(t) : "f"(v), "r"(src));
    return t;
}
// c + dot of 4 unsigned bytes of a with 4 signed bytes of b (one dp4a)
inline int dot4_us(uint a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
inline int dot4_ss(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// two f16 in a word -> floats (cvt, no private-memory round trip)
inline float2 half2_bits_to_float2(uint u) {
    float2 f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(f.x), "=f"(f.y) : "r"(u));
    return f;
}
#else
inline int dot4_us(uint a, int b, int c) {
    uchar4 x = as_uchar4(a);
    char4 y = as_char4(b);
    return c + (int)x.s0 * y.s0 + (int)x.s1 * y.s1 + (int)x.s2 * y.s2 + (int)x.s3 * y.s3;
}
inline int dot4_ss(int a, int b, int c) {
    char4 x = as_char4(a), y = as_char4(b);
    return c + (int)x.s0 * y.s0 + (int)x.s1 * y.s1 + (int)x.s2 * y.s2 + (int)x.s3 * y.s3;
}
inline float2 half2_bits_to_float2(uint u) {
    return vload_half2(0, (__private const half*)&u);
}
// each 32 threads' max or sum through local memory, where there are no warp shuffles (every
// thread of the group calls it; scr holds a float per thread): the decode and paged attention
// kernels' SEG_MAX / SEG_SUM
inline float seg_reduce(float v, __local float* scr, bool is_max) {
    int lid = get_local_id(0), base = lid & ~31;
    barrier(CLK_LOCAL_MEM_FENCE);
    scr[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float r = scr[base];
    for (int i = 1; i < 32; i++) r = is_max ? fmax(r, scr[base + i]) : r + scr[base + i];
    return r;
}
#endif

// -- tensor-core emulation (tests) --------------------------------------------------------------
// -DEMU_MMA (with USE_NV_MMA; runtime's LLMRS_OPENCL_EMULATE_MMA=1): mma.sync's fragment
// semantics in portable C through local memory, so the tensor-core bodies run, and are tested,
// on devices without tensor cores (PoCL). sc: EMU_SC_WORDS words of local memory; every
// work-item of the group calls it (the bodies issue MMAs in uniform control flow). Fragments,
// as the PTX ISA lays them out (gq = lane / 4, tq = lane % 4; 32-bit registers):
//   m16n8k32 s8:  A a0..a3 = rows gq, gq + 8, gq, gq + 8; bytes k = 4 tq .. (a0, a1) and
//                 16 + 4 tq .. (a2, a3); B b0, b1 = column gq, k = 4 tq .., 16 + 4 tq ..
//   m16n8k16 f16: the same with 2 halves per register: k = 2 tq .. and 8 + 2 tq ..
//   C / D:        c0, c1 = row gq, columns 2 tq, 2 tq + 1; c2, c3 = row gq + 8
// f16 <-> f32 by bit arithmetic (defined on every device: matvec.cl's f16 MV_MMA without tensor
// cores uses them too), not vload_half / vstore_half through a cast pointer to a
// private scalar: these run in loops that hold barriers, and pip's generic PoCL 3.0 build
// (LLVM 14) gives such an address-taken private (its address passed to the vstore_half
// builtin) one slot for the whole work-group, so every work-item read the last one's packed
// value (the attention body's P fragments: wrong or NaN outputs). No pointer type-punning
// either, so no aliasing question.
// the f32 value of f16 bits h (low 16 bits)
inline float emu_f16_to_f32(uint h) {
    uint s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return as_float(s | 0x7F800000u | (m << 13));             // inf, NaN
    if (e) return as_float(s | ((e + 112u) << 23) | (m << 13));              // normal
    return as_float(s | as_uint((float)m * 0x1p-24f));                       // subnormal, 0
}
// f32 -> f16 bits, nearest even (as vstore_half_rte)
inline uint emu_f32_to_f16(float f) {
    uint x = as_uint(f), s = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return s | 0x7E00u;                                  // NaN
    if (a >= 0x477FF000u) return s | 0x7C00u;                                 // inf, or past 65504
    if (a < 0x38800000u) {                                                    // f16 subnormal, 0
        if (a < 0x33000000u) return s;                                        // under 2^-25
        uint e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, sh = 126u - e;   // m 2^(e - 150) / 2^-24
        uint r = m >> sh, rem = m & ((1u << sh) - 1u), half_ulp = 1u << (sh - 1u);
        return s | (r + (rem > half_ulp || (rem == half_ulp && (r & 1u))));
    }
    uint r = (a - 0x38000000u) >> 13, rem = a & 0x1FFFu;                     // rebias 127 -> 15
    return s | (r + (rem > 0x1000u || (rem == 0x1000u && (r & 1u))));        // a carry rounds up the exponent
}
inline float emu_half(uint w, int hi) {
    return emu_f16_to_f32(hi ? w >> 16 : w & 0xFFFFu);
}
#ifdef EMU_MMA
#if defined(MV_WG) && MV_WG > 256
#define EMU_SC_WORDS (MV_WG * 6)                    // a matvec's groups are larger
#else
#define EMU_SC_WORDS (((256 + 31) / 32) * 32 * 6)
#endif
inline void emu_mma_exchange(const uint* a, uint b0, uint b1, __local uint* sc) {
    int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    __local uint* me = sc + lid * 6;
    me[0] = a[0]; me[1] = a[1]; me[2] = a[2]; me[3] = a[3]; me[4] = b0; me[5] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
}
inline void emu_mma_s8(int* d, const uint* a, uint b0, uint b1, __local uint* sc) {
    emu_mma_exchange(a, b0, b1, sc);
    int lid = get_local_id(0), lane = lid & 31, gq = lane >> 2, tq = lane & 3;
    __local const uint* wp = sc + (lid - lane) * 6;
    for (int i = 0; i < 4; i++) {
        int row = gq + 8 * (i >> 1), col = 2 * tq + (i & 1), s = 0;
        for (int k = 0; k < 32; k++) {
            uint aw = wp[((row & 7) * 4 + (k & 15) / 4) * 6 + (row >> 3) + 2 * (k >> 4)];
            uint bw = wp[(col * 4 + (k & 15) / 4) * 6 + 4 + (k >> 4)];
            s += (int)(char)(aw >> (8 * (k & 3))) * (int)(char)(bw >> (8 * (k & 3)));
        }
        d[i] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
inline void emu_mma_f16(float* c, const uint* a, uint b0, uint b1, __local uint* sc) {
    emu_mma_exchange(a, b0, b1, sc);
    int lid = get_local_id(0), lane = lid & 31, gq = lane >> 2, tq = lane & 3;
    __local const uint* wp = sc + (lid - lane) * 6;
    for (int i = 0; i < 4; i++) {
        int row = gq + 8 * (i >> 1), col = 2 * tq + (i & 1);
        float s = c[i];
        for (int k = 0; k < 16; k++) {
            uint aw = wp[((row & 7) * 4 + (k & 7) / 2) * 6 + (row >> 3) + 2 * (k >> 3)];
            uint bw = wp[(col * 4 + (k & 7) / 2) * 6 + 4 + (k >> 3)];
            s += emu_half(aw, k & 1) * emu_half(bw, k & 1);
        }
        c[i] = s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
// v of lane (lane ^ o) of the warp, o < 32 (shfl.sync.bfly)
inline uint emu_shfl_xor_u(uint v, int o, __local uint* sc) {
    int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    sc[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    return sc[lid ^ o];
}
inline float emu_shfl_xor(float v, int o, __local uint* sc) { return as_float(emu_shfl_xor_u(as_uint(v), o, sc)); }
#endif

// mma.sync, real or emulated (emu_sc: the caller's EMU_SC_WORDS of local memory, by that name)
#ifdef USE_NV_MMA
#ifdef EMU_MMA
#define MMA_S8(d, a, b0, b1) emu_mma_s8(d, a, b0, b1, emu_sc)
#define MMA_F16(c, a, b0, b1) emu_mma_f16(c, a, b0, b1, emu_sc)
#else
// d[0..3] = A (16x32 s8, row) * B (32x8 s8, col), fragments as the PTX ISA lays them out
#define MMA_S8(d, a, b0, b1)                                                                   \
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
        "{%10,%10,%10,%10};"                                                                   \
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0))
// c[0..3] += A (16x16 f16, row) * B (16x8 f16, col)
#define MMA_F16(c, a, b0, b1)                                                                  \
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "      \
        "{%8,%9}, {%0,%1,%2,%3};"                                                              \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                       \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#endif
#endif

// |s| < 2^22 (a block's sum is at most 32 * 127 * 128): the float through the mantissa, which
// issues at full rate where int-to-float conversion runs at a quarter
inline float small_int_to_float(int s) { return as_float(s + 0x4B400000) - 12582912.0f; }

// -- 4 consecutive float elements, index counted in 4s --------------------------------------
// Every tensor starts 64-byte aligned (plan.py, galloc), so these are whole-vector loads:
// vload4 and vload_half4 may only assume element alignment, and NVIDIA's compiler then
// issues one load per element (H200, the f16 qkv matvec with its RMS prologue alone:
// 13.4 -> 10.7 us per launch).
inline float4 ld4_f32(gin p, size_t i4) { return ((__global const float4*)p)[i4]; }
inline float4 ld4_f16(gin p, size_t i4) {
    uint2 u = ((__global const uint2*)p)[i4];
    return (float4)(half2_bits_to_float2(u.x), half2_bits_to_float2(u.y));
}
inline float4 ld4_bf16(gin p, size_t i4) {
    uint2 u = ((__global const uint2*)p)[i4];
    return as_float4((uint4)(u.x << 16, u.x & 0xFFFF0000u, u.y << 16, u.y & 0xFFFF0000u));
}

// Sum over the work-group (any size that is a multiple of 32 with USE_NV_PTX); red holds
// get_local_size(0) floats.
inline float group_sum(float v, __local float* red) {
#ifdef USE_NV_PTX
    int lid = get_local_id(0), nw = get_local_size(0) >> 5;
    v = warp_sum(v);
    barrier(CLK_LOCAL_MEM_FENCE);
    if ((lid & 31) == 0) red[lid >> 5] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float s = 0.0f;
    for (int w = 0; w < nw; w++) s += red[w];
    return s;
#else
    return wg_sum(v, red);
#endif
}

inline float group_max(float v, __local float* red) {
#ifdef USE_NV_PTX
    int lid = get_local_id(0), nw = get_local_size(0) >> 5;
    v = warp_max(v);
    barrier(CLK_LOCAL_MEM_FENCE);
    if ((lid & 31) == 0) red[lid >> 5] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    float s = -INFINITY;
    for (int w = 0; w < nw; w++) s = fmax(s, red[w]);
    return s;
#else
    return wg_max(v, red);
#endif
}
