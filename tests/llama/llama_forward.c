/* llama_forward.c — test helper: runs a prompt through llama.cpp in one
 * batch and writes the tensors the tests compare with kvdiff's reference.
 *
 * usage: llama_forward MODEL.gguf OUT.bin PREFIXES TOKENS
 *   PREFIXES  comma-separated graph tensor names to keep, matched up to the
 *             layer suffix ("l_out,sa_out" keeps l_out-0, l_out-1, ...)
 *   TOKENS    comma-separated token ids
 * OUT.bin holds records: name (64 bytes, NUL-padded), ne0 and ne1 (int32),
 * then ne0 x ne1 floats (ne1 rows of ne0; a 3-D tensor such as Kcur, one
 * row of heads x head_dim per token, is written as ne0*ne1 x ne2); the last
 * record is "logits" (V x T). Prints "vocab N" and "token ID TEXT" for the
 * first four prompt tokens to stdout. A name the graph gives several
 * tensors (Qcur: projection, then after norm and RoPE) has one record each,
 * in graph order. F32 KV cache, flash attention off, one thread, every position an
 * output. Built only for the tests (it links libllama; the library does
 * not). Exit 0, or 2 with a one-line reason. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"

#ifndef LLAMA_LIB_DIR
#define LLAMA_LIB_DIR "."
#endif

typedef struct {
    FILE *out;
    char prefixes[1024];
    int failed;
} capture;

/* name is PREFIX-LAYER with PREFIX in the list (not "Qcur-0 (view)"). */
static bool wanted(const capture *c, const char *name)
{
    const char *dash = strrchr(name, '-');
    if (!dash || !dash[1] || strspn(dash + 1, "0123456789") != strlen(dash + 1))
        return false;
    size_t n = (size_t)(dash - name);
    const char *p = c->prefixes;
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == n && !strncmp(p, name, n))
            return true;
        p += len + (comma ? 1 : 0);
    }
    return false;
}

static void put_record(FILE *f, const char *name, int32_t ne0, int32_t ne1, const float *data)
{
    char nm[64] = {0};
    snprintf(nm, sizeof nm, "%s", name);
    fwrite(nm, 1, sizeof nm, f);
    fwrite(&ne0, 4, 1, f);
    fwrite(&ne1, 4, 1, f);
    fwrite(data, 4, (size_t)ne0 * (size_t)ne1, f);
}

static bool on_tensor(struct ggml_tensor *t, bool ask, void *user)
{
    capture *c = user;
    if (!wanted(c, t->name))
        return ask ? false : true;
    if (ask)
        return true;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[3] != 1) {
        fprintf(stderr, "llama_forward: tensor %s is not a contiguous f32 tensor\n", t->name);
        c->failed = 1;
        return true;
    }
    float *buf = malloc(ggml_nbytes(t));
    if (!buf) {
        c->failed = 1;
        return true;
    }
    ggml_backend_tensor_get(t, buf, 0, ggml_nbytes(t));
    if (t->ne[2] == 1)
        put_record(c->out, t->name, (int32_t)t->ne[0], (int32_t)t->ne[1], buf);
    else
        put_record(c->out, t->name, (int32_t)(t->ne[0] * t->ne[1]), (int32_t)t->ne[2], buf);
    free(buf);
    return true;
}

static void quiet_log(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR || getenv("LLAMA_FORWARD_VERBOSE"))
        fputs(text, stderr);
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: llama_forward MODEL.gguf OUT.bin PREFIXES TOKENS\n");
        return 2;
    }
    int n = 1;
    for (const char *p = argv[4]; *p; p++)
        n += *p == ',';
    llama_token *tokens = malloc((size_t)n * sizeof *tokens);
    char *end = argv[4];
    for (int i = 0; i < n; i++) {
        tokens[i] = (llama_token)strtol(end, &end, 10);
        if (*end == ',')
            end++;
    }
    capture cap = {0};
    snprintf(cap.prefixes, sizeof cap.prefixes, "%s", argv[3]);
    cap.out = fopen(argv[2], "wb");
    if (!cap.out) {
        fprintf(stderr, "llama_forward: cannot write %s\n", argv[2]);
        return 2;
    }

    llama_log_set(quiet_log, NULL);
    ggml_backend_load_all_from_path(LLAMA_LIB_DIR);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama_forward: llama.cpp could not load %s\n", argv[1]);
        return 2;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n < 64 ? 64 : n);
    cp.n_batch = (uint32_t)n;
    cp.n_ubatch = (uint32_t)n;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = &cap;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_forward: llama.cpp could not create a context\n");
        return 2;
    }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    int rc = llama_decode(ctx, batch);
    if (rc != 0) {
        fprintf(stderr, "llama_forward: llama_decode returned %d\n", rc);
        return 2;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int V = llama_vocab_n_tokens(vocab);
    printf("vocab %d\n", V);
    for (int i = 0; i < n && i < 4 && llama_vocab_type(vocab) != LLAMA_VOCAB_TYPE_NONE; i++)
        printf("token %d %s\n", tokens[i], llama_vocab_get_text(vocab, tokens[i]));
    float *logits = malloc((size_t)V * (size_t)n * sizeof(float));
    for (int i = 0; i < n; i++)
        memcpy(logits + (size_t)i * V, llama_get_logits_ith(ctx, i), (size_t)V * sizeof(float));
    put_record(cap.out, "logits", V, n, logits);
    free(logits);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tokens);
    if (fclose(cap.out) != 0 || cap.failed) {
        fprintf(stderr, "llama_forward: could not write %s\n", argv[2]);
        return 2;
    }
    return 0;
}
