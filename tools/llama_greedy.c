/* Greedy decoding with llama.cpp on given token ids, for side-by-side comparison with llmrs
 * (tools/compare_llama_cpp.py builds and drives it).
 *
 *     llama_greedy MODEL.gguf N_PREDICT THREADS < prompts
 *
 * Each stdin line is one prompt as space-separated token ids (so both engines see the same
 * tokens, whatever their tokenizers do). For each, on a cleared KV cache, prints one line:
 *     ids: t1 t2 ...  | gaps: g1 g2 ... | prefill_ms: P | decode_ms: D
 * where gap i is logit(top1) - logit(top2) at step i: a small gap marks a near-tie, where two
 * correct engines may pick differently. Generation stops at an end-of-generation token.
 */
#define _POSIX_C_SOURCE 199309L  /* clock_gettime under -std=c11 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* index of the largest logit; *gap = its lead over the second largest */
static int top1(const float *logits, int n, float *gap) {
    int best = 0, second = -1;
    for (int i = 1; i < n; i++) {
        if (logits[i] > logits[best]) { second = best; best = i; }
        else if (second < 0 || logits[i] > logits[second]) second = i;
    }
    *gap = logits[best] - logits[second];
    return best;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT THREADS < prompts (token ids, one prompt a line)\n", argv[0]);
        return 2;
    }
    int n_predict = atoi(argv[2]), threads = atoi(argv[3]);
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "llama_greedy: cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = 4096;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = threads;
    /* LLAMA_GREEDY_FLASH_ATTN=0|1 (default: llama.cpp's auto): its flash attention rounds Q and
       the V sums to f16 on the CPU, a source of differences of its own */
    const char *fa = getenv("LLAMA_GREEDY_FLASH_ATTN");
    if (fa && *fa) cp.flash_attn_type = atoi(fa) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "llama_greedy: cannot make a context\n"); return 1; }

    static char line[1 << 20];
    llama_token *prompt = malloc(sizeof(llama_token) * 4096);
    while (fgets(line, sizeof line, stdin)) {
        int n = 0;
        for (char *tok = strtok(line, " \t\n"); tok && n < 4096; tok = strtok(NULL, " \t\n"))
            prompt[n++] = atoi(tok);
        if (n == 0) continue;
        llama_memory_clear(llama_get_memory(ctx), true);
        double t0 = now_ms();
        if (llama_decode(ctx, llama_batch_get_one(prompt, n))) { fprintf(stderr, "llama_greedy: decode failed\n"); return 1; }
        double t1 = now_ms();
        llama_token ids[4096];
        float gaps[4096];
        int made = 0;
        for (; made < n_predict && made < 4096; ) {
            llama_token next = top1(llama_get_logits_ith(ctx, -1), n_vocab, &gaps[made]);
            if (llama_vocab_is_eog(vocab, next)) break;
            ids[made++] = next;
            if (made == n_predict) break;
            if (llama_decode(ctx, llama_batch_get_one(&next, 1))) { fprintf(stderr, "llama_greedy: decode failed\n"); return 1; }
        }
        double t2 = now_ms();
        printf("ids:");
        for (int i = 0; i < made; i++) printf(" %d", ids[i]);
        printf(" | gaps:");
        for (int i = 0; i < made; i++) printf(" %.4f", gaps[i]);
        printf(" | prefill_ms: %.3f | decode_ms: %.3f\n", t1 - t0, t2 - t1);
        fflush(stdout);
    }
    free(prompt);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
