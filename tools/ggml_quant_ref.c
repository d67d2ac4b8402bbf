// Reference outputs of ggml's Q4_0/Q8_0/Q4_1 code, for tests/compiler/test_quant.py.
//
// Built and driven by tools/make_ggml_quant_ref.sh against a ggml checkout outside this
// project; this file only calls ggml's public API (type traits), it contains no ggml code.
//
// stdin: records until EOF, each
//     int64 k (a multiple of 32), float32 x[k] (a weight row), float32 y[k] (an activation row)
// stdout: per record, in this order (nb = k / 32)
//     uint8   q4_0(x)        [nb*18]   quantize_row_q4_0_ref (what llama-quantize writes)
//     uint8   q8_0(x)        [nb*34]   quantize_row_q8_0_ref
//     uint8   chunk_q4_0(x)  [nb*18]   ggml_quantize_chunk, the entry point llama-quantize uses
//     uint8   chunk_q8_0(x)  [nb*34]
//     float32 deq_q4_0       [k]       dequantize_row_q4_0 of q4_0(x)
//     float32 deq_q8_0       [k]       dequantize_row_q8_0 of q8_0(x)
//     uint8   q8_0_ref(y)    [nb*34]   quantize_row_q8_0_ref
//     uint8   q8_0_cpu(y)    [nb*34]   the CPU backend's from_float (SIMD, rounds differently)
//     float32 dot_q4         [1]       CPU vec_dot q4_0(x) . q8_0_ref(y)
//     float32 dot_q8         [1]       CPU vec_dot q8_0(x) . q8_0_ref(y)
//     int32   isum_q4        [nb]      per-block integer sums of the CPU q4_0 x q8_0 kernel
//     int32   isum_q8        [nb]      per-block integer sums of the CPU q8_0 x q8_0 kernel
//     uint8   q4_1(x)        [nb*20]   quantize_row_q4_1_ref
//     uint8   chunk_q4_1(x)  [nb*20]   ggml_quantize_chunk
//     float32 deq_q4_1       [k]       dequantize_row_q4_1 of q4_1(x)
//     uint8   q8_1_ref(y)    [nb*36]   quantize_row_q8_1_ref (d, s = f16(d * sum(q)), 32 int8)
//     uint8   q8_1_cpu(y)    [nb*36]   the CPU backend's from_float for Q8_1 (what llama.cpp runs)
//     float32 dot_q4_1       [1]       CPU vec_dot q4_1(x) . q8_1_ref(y) (ggml_vec_dot_q4_1_q8_1)
//     int32   isum_q4_1      [nb]      per-block integer sums of the CPU q4_1 x q8_1 kernel
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"

enum { QK = 32 };

static void die(const char * msg) {
    fprintf(stderr, "ggml_quant_ref: %s\n", msg);
    exit(1);
}

static void put(const void * p, size_t n) {
    if (fwrite(p, 1, n, stdout) != n) die("short write to stdout");
}

// The vec_dot kernels only return d_x*d_y*isum summed over blocks (plus m*s for q4_1); with
// both scales set to f16 1.0, q4_1's m and q8_1's s to 0, and one block at a time the kernel's
// own integer sum comes out exactly (|isum| < 2^24, so it is representable in f32).
static void block_sums(enum ggml_type wt, const uint8_t * w, const uint8_t * a, int nb, int32_t * out) {
    const struct ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(wt);
    const size_t wb = ggml_type_size(wt), ab = ggml_type_size(tr->vec_dot_type);
    uint8_t wblk[64], ablk[64];
    const ggml_fp16_t one = ggml_fp32_to_fp16(1.0f), zero = ggml_fp32_to_fp16(0.0f);
    for (int b = 0; b < nb; b++) {
        memcpy(wblk, w + b*wb, wb);
        memcpy(ablk, a + b*ab, ab);
        memcpy(wblk, &one, sizeof one);  // d is the first field of every block type
        memcpy(ablk, &one, sizeof one);
        if (wt == GGML_TYPE_Q4_1) {      // m and s are the second f16 of block_q4_1 / block_q8_1
            memcpy(wblk + sizeof one, &zero, sizeof zero);
            memcpy(ablk + sizeof one, &zero, sizeof zero);
        }
        float s = 0.0f;
        tr->vec_dot(QK, &s, 0, wblk, 0, ablk, 0, 1);
        out[b] = (int32_t) s;
    }
}

static float dot(enum ggml_type wt, const uint8_t * w, const uint8_t * a, int k) {
    float s = 0.0f;
    ggml_get_type_traits_cpu(wt)->vec_dot(k, &s, 0, w, 0, a, 0, 1);
    return s;
}

int main(void) {
    ggml_cpu_init();
    const struct ggml_type_traits * t4 = ggml_get_type_traits(GGML_TYPE_Q4_0);
    const struct ggml_type_traits * t8 = ggml_get_type_traits(GGML_TYPE_Q8_0);
    const struct ggml_type_traits * t41 = ggml_get_type_traits(GGML_TYPE_Q4_1);
    const struct ggml_type_traits * t81 = ggml_get_type_traits(GGML_TYPE_Q8_1);
    if (ggml_type_size(GGML_TYPE_Q4_1) != 20 || ggml_type_size(GGML_TYPE_Q8_1) != 36) die("unexpected block sizes");
    if (ggml_get_type_traits_cpu(GGML_TYPE_Q4_1)->vec_dot_type != GGML_TYPE_Q8_1) die("q4_1 does not dot with q8_1");
    int64_t k;
    while (fread(&k, sizeof k, 1, stdin) == 1) {
        if (k <= 0 || k % QK) die("record length k must be a positive multiple of 32");
        const int nb = (int) (k / QK);
        float * x = malloc(k * sizeof *x), * y = malloc(k * sizeof *y), * f = malloc(k * sizeof *f);
        uint8_t * q4 = malloc(nb * 18), * q8 = malloc(nb * 34), * c = malloc(nb * 34);
        uint8_t * y8 = malloc(nb * 36), * yc = malloc(nb * 36), * q41 = malloc(nb * 20);
        int32_t * is = malloc(nb * sizeof *is);
        if (!x || !y || !f || !q4 || !q8 || !c || !y8 || !yc || !q41 || !is) die("out of memory");
        if (fread(x, sizeof *x, k, stdin) != (size_t) k || fread(y, sizeof *y, k, stdin) != (size_t) k)
            die("truncated record on stdin");

        t4->from_float_ref(x, q4, k);
        t8->from_float_ref(x, q8, k);
        put(q4, nb * 18);
        put(q8, nb * 34);
        ggml_quantize_chunk(GGML_TYPE_Q4_0, x, c, 0, 1, k, NULL);
        put(c, nb * 18);
        ggml_quantize_chunk(GGML_TYPE_Q8_0, x, c, 0, 1, k, NULL);
        put(c, nb * 34);
        t4->to_float(q4, f, k);
        put(f, k * sizeof *f);
        t8->to_float(q8, f, k);
        put(f, k * sizeof *f);

        t8->from_float_ref(y, y8, k);
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(y, yc, k);
        put(y8, nb * 34);
        put(yc, nb * 34);
        const float d4 = dot(GGML_TYPE_Q4_0, q4, y8, (int) k), d8 = dot(GGML_TYPE_Q8_0, q8, y8, (int) k);
        put(&d4, sizeof d4);
        put(&d8, sizeof d8);
        block_sums(GGML_TYPE_Q4_0, q4, y8, nb, is);
        put(is, nb * sizeof *is);
        block_sums(GGML_TYPE_Q8_0, q8, y8, nb, is);
        put(is, nb * sizeof *is);

        t41->from_float_ref(x, q41, k);
        put(q41, nb * 20);
        ggml_quantize_chunk(GGML_TYPE_Q4_1, x, c, 0, 1, k, NULL);
        put(c, nb * 20);
        t41->to_float(q41, f, k);
        put(f, k * sizeof *f);
        t81->from_float_ref(y, y8, k);
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_1)->from_float(y, yc, k);
        put(y8, nb * 36);
        put(yc, nb * 36);
        const float d41 = dot(GGML_TYPE_Q4_1, q41, y8, (int) k);
        put(&d41, sizeof d41);
        block_sums(GGML_TYPE_Q4_1, q41, y8, nb, is);
        put(is, nb * sizeof *is);

        free(x); free(y); free(f); free(q4); free(q8); free(c); free(y8); free(yc); free(q41); free(is);
    }
    ggml_quantize_free();
    return 0;
}
