/* check_llamacpp.c — the llama.cpp recorder (kvdiff-llama) run for real:
 * a kvdiff-generated model as GGUF, recorded by the real libllama, checked
 * by `kvdiff validate` and compared with kvdiff's reference within a stated
 * tolerance; and bad input (unsupported architecture, truncated file,
 * missing tensor, token ids out of range) refused in one line, exit 2,
 * with no dump that claims to be complete.
 *
 * Every GGUF comes from make_gguf(). It asks `kvdiff gen --gguf` first;
 * until that option exists it writes the GGUF itself from the generated
 * Hugging Face folder (write_gguf below: F32, llama.cpp's converter's
 * conventions), which also makes the damaged files of the bad-input cases. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dump/dump.h"
#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "gguf_patch.h"
#include "testutil.h"

static char out[1 << 16];

/* Runs KVDIFF_LLAMA_BIN (or ./kvdiff-llama) with args; output into buf. */

/* ------------------------------------------------------------------ */
/* A GGUF from a Hugging Face folder, as llama.cpp's converter writes it */

typedef struct {
    const char *arch;         /* override general.architecture (NULL: the model's) */
    const char *drop;         /* leave this tensor out */
} gguf_damage;

typedef struct {
    FILE *f;
    int ok;
} gw;

static void put(gw *w, const void *p, size_t n)
{
    if (fwrite(p, 1, n, w->f) != n)
        w->ok = 0;
}
static void put_u32(gw *w, uint32_t v) { put(w, &v, 4); }
static void put_u64(gw *w, uint64_t v) { put(w, &v, 8); }
static void put_str(gw *w, const char *s)
{
    put_u64(w, strlen(s));
    put(w, s, strlen(s));
}
enum { T_U32 = 4, T_F32 = 6, T_STR = 8 };
static void kv_u32(gw *w, const char *arch, const char *k, uint32_t v)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    put_str(w, key);
    put_u32(w, T_U32);
    put_u32(w, v);
}
static void kv_f32(gw *w, const char *arch, const char *k, float v)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    put_str(w, key);
    put_u32(w, T_F32);
    put(w, &v, 4);
}
static void kv_str(gw *w, const char *k, const char *v)
{
    put_str(w, k);
    put_u32(w, T_STR);
    put_str(w, v);
}

typedef struct {
    char gguf[96];
    const st_tensor *t;
    int permute_heads;        /* Llama q/k: rows permuted per head (0: none) */
    float add, mul;           /* value -> (value + add) * mul */
} gtensor;

/* HF name -> GGUF name and conversion, following llama.cpp's converter:
 * Llama q/k rows permuted for its adjacent-pair RoPE; Gemma norms stored
 * as 1 + w; Gemma 3's query_pre_attn_scalar folded into q_norm, since
 * llama.cpp scales q.k by 1/sqrt(head_dim). */
static int map_name(const kv_config *c, const char *hf, gtensor *g)
{
    const bool gemma = c->arch == ARCH_GEMMA3;
    int l, off = 0;
    g->permute_heads = 0;
    g->add = 0;
    g->mul = 1;
    if (!strcmp(hf, "model.embed_tokens.weight"))
        snprintf(g->gguf, sizeof g->gguf, "token_embd.weight");
    else if (!strcmp(hf, "model.norm.weight"))
        snprintf(g->gguf, sizeof g->gguf, "output_norm.weight");
    else if (!strcmp(hf, "lm_head.weight"))
        snprintf(g->gguf, sizeof g->gguf, "output.weight");
    else if (sscanf(hf, "model.layers.%d.%n", &l, &off) == 1 && off > 0) {
        static const char *const names[][3] = {
            {"input_layernorm.weight", "attn_norm.weight", "attn_norm.weight"},
            {"self_attn.q_proj.weight", "attn_q.weight", "attn_q.weight"},
            {"self_attn.k_proj.weight", "attn_k.weight", "attn_k.weight"},
            {"self_attn.v_proj.weight", "attn_v.weight", "attn_v.weight"},
            {"self_attn.q_proj.bias", "attn_q.bias", "attn_q.bias"},
            {"self_attn.k_proj.bias", "attn_k.bias", "attn_k.bias"},
            {"self_attn.v_proj.bias", "attn_v.bias", "attn_v.bias"},
            {"self_attn.o_proj.weight", "attn_output.weight", "attn_output.weight"},
            {"self_attn.q_norm.weight", "", "attn_q_norm.weight"},
            {"self_attn.k_norm.weight", "", "attn_k_norm.weight"},
            {"post_attention_layernorm.weight", "ffn_norm.weight", "post_attention_norm.weight"},
            {"pre_feedforward_layernorm.weight", "", "ffn_norm.weight"},
            {"post_feedforward_layernorm.weight", "", "post_ffw_norm.weight"},
            {"mlp.gate_proj.weight", "ffn_gate.weight", "ffn_gate.weight"},
            {"mlp.up_proj.weight", "ffn_up.weight", "ffn_up.weight"},
            {"mlp.down_proj.weight", "ffn_down.weight", "ffn_down.weight"},
        };
        const char *to = NULL;
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!strcmp(hf + off, names[i][0]))
                to = names[i][gemma ? 2 : 1];
        if (!to || !*to)
            return -1;
        snprintf(g->gguf, sizeof g->gguf, "blk.%d.%s", l, to);
        if (c->arch == ARCH_LLAMA && !strcmp(to, "attn_q.weight"))
            g->permute_heads = c->n_heads;
        if (c->arch == ARCH_LLAMA && !strcmp(to, "attn_k.weight"))
            g->permute_heads = c->n_kv_heads;
        if (gemma && !strcmp(to, "attn_q_norm.weight"))
            g->mul = (float)(c->attn_scale * sqrt((double)c->head_dim));
    } else {
        return -1;
    }
    if (gemma && strstr(g->gguf, "norm.weight"))
        g->add = 1.0f;
    return 0;
}

static int write_gguf(const char *hf_dir, const char *path, const gguf_damage *dmg)
{
    char cfg_path[1024];
    kv_config c;
    kv_err e;
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", hf_dir);
    if (config_load_json(cfg_path, &c, &e) < 0)
        return -1;
    st_file *st = st_open_dir(hf_dir, &e);
    if (!st)
        return -1;
    size_t n_all = st_count(st), n = 0;
    gtensor *ts = calloc(n_all, sizeof *ts);
    for (size_t i = 0; ts && i < n_all; i++) {
        const st_tensor *t = st_at(st, i);
        if (map_name(&c, t->name, &ts[n]) < 0 || (dmg && dmg->drop && !strcmp(ts[n].gguf, dmg->drop)))
            continue;
        ts[n++].t = t;
    }
    const char *arch = c.arch == ARCH_LLAMA ? "llama" : c.arch == ARCH_QWEN2 ? "qwen2" : "gemma3";
    gw w = {fopen(path, "wb"), 1};
    if (!w.f || !ts) {
        free(ts);
        st_close(st);
        return -1;
    }
    int n_kv = 13 + (c.arch == ARCH_GEMMA3 ? 2 : 0);
    put(&w, "GGUF", 4);
    put_u32(&w, 3);
    put_u64(&w, n);
    put_u64(&w, (uint64_t)n_kv);
    kv_str(&w, "general.architecture", dmg && dmg->arch ? dmg->arch : arch);
    kv_str(&w, "tokenizer.ggml.model", "none");
    kv_u32(&w, arch, "vocab_size", (uint32_t)c.vocab);
    kv_u32(&w, arch, "context_length", (uint32_t)c.max_positions);
    kv_u32(&w, arch, "embedding_length", (uint32_t)c.hidden);
    kv_u32(&w, arch, "block_count", (uint32_t)c.n_layers);
    kv_u32(&w, arch, "feed_forward_length", (uint32_t)c.intermediate);
    kv_u32(&w, arch, "attention.head_count", (uint32_t)c.n_heads);
    kv_u32(&w, arch, "attention.head_count_kv", (uint32_t)c.n_kv_heads);
    kv_u32(&w, arch, "attention.key_length", (uint32_t)c.head_dim);
    kv_u32(&w, arch, "attention.value_length", (uint32_t)c.head_dim);
    kv_f32(&w, arch, "attention.layer_norm_rms_epsilon", (float)c.rms_eps);
    kv_f32(&w, arch, "rope.freq_base", (float)c.rope_theta);
    if (c.arch == ARCH_GEMMA3) {
        kv_f32(&w, arch, "rope.freq_base_swa", (float)c.rope_local_theta);
        kv_u32(&w, arch, "attention.sliding_window", (uint32_t)c.sliding_window);
    }
    uint64_t offset = 0;
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = ts[i].t;
        put_str(&w, ts[i].gguf);
        put_u32(&w, (uint32_t)t->ndim);
        for (int d = t->ndim - 1; d >= 0; d--)
            put_u64(&w, (uint64_t)t->shape[d]);
        put_u32(&w, 0);                    /* GGML_TYPE_F32 */
        put_u64(&w, offset);
        offset += (t->nelem * 4 + 31) / 32 * 32;
    }
    static const char zeros[32];
    long pos = ftell(w.f);
    put(&w, zeros, (size_t)((32 - pos % 32) % 32));
    for (size_t i = 0; i < n && w.ok; i++) {
        const st_tensor *t = ts[i].t;
        float *v = malloc(t->nelem * 4), *p = malloc(t->nelem * 4);
        if (!v || !p || st_read_f32(t, 0, t->nelem, v, &e) < 0) {
            w.ok = 0;
        } else {
            for (uint64_t k = 0; k < t->nelem; k++)
                v[k] = (v[k] + ts[i].add) * ts[i].mul;
            if (ts[i].permute_heads) {
                /* out row h*D + 2m + s = in row h*D + s*D/2 + m */
                const uint64_t cols = t->nelem / (uint64_t)t->shape[0];
                const int D = (int)(t->shape[0] / (uint64_t)ts[i].permute_heads), half = D / 2;
                for (int h = 0; h < ts[i].permute_heads; h++)
                    for (int m = 0; m < half; m++)
                        for (int s = 0; s < 2; s++)
                            memcpy(p + ((uint64_t)h * D + 2 * m + s) * cols,
                                   v + ((uint64_t)h * D + s * half + m) * cols, cols * 4);
                memcpy(v, p, t->nelem * 4);
            }
            put(&w, v, t->nelem * 4);
            put(&w, zeros, (size_t)((32 - (t->nelem * 4) % 32) % 32));
        }
        free(v);
        free(p);
    }
    int rc = w.ok && fclose(w.f) == 0 ? 0 : -1;
    free(ts);
    st_close(st);
    return rc;
}

/* The one way these tests get a GGUF: `kvdiff gen --preset P -o DIR/hf
 * --gguf FILE` when kvdiff has it (and the file is to be sound), else the
 * HF folder from `kvdiff gen` written as GGUF above. */
static int make_gguf(const char *preset, const char *dir, const char *gguf,
                     const gguf_damage *dmg)
{
    char args[1024];
    static int has_gguf = -1;
    if (has_gguf < 0) {
        test_run_cli("gen --help", out, sizeof out);
        has_gguf = strstr(out, "--gguf") != NULL;
    }
    if (has_gguf && !dmg) {
        snprintf(args, sizeof args, "gen --preset %s -o %s/hf --gguf %s", preset, dir, gguf);
        return test_run_cli(args, out, sizeof out) == 0 ? 0 : -1;
    }
    snprintf(args, sizeof args, "gen --preset %s -o %s/hf", preset, dir);
    if (test_run_cli(args, out, sizeof out) != 0)
        return -1;
    char hf[512];
    snprintf(hf, sizeof hf, "%s/hf", dir);
    return write_gguf(hf, gguf, dmg);
}

/* "PRESET+attention_bias": the preset with q/k/v/o biases, written as a
 * folder by model_gen_folder_config and exported with `kvdiff gen --from`;
 * a plain preset goes through make_gguf. */
static int make_model_gguf(const char *preset, const char *dir, const char *gguf)
{
    const char *plus = strchr(preset, '+');
    if (!plus)
        return make_gguf(preset, dir, gguf, NULL);
    char base[64], args[1024];
    kv_config c;
    kv_err e = {{0}};
    snprintf(base, sizeof base, "%.*s", (int)(plus - preset), preset);
    if (strcmp(plus + 1, "attention_bias") || config_preset(base, &c, &e) < 0)
        return -1;
    c.qkv_bias = c.o_bias = true;
    snprintf(args, sizeof args, "%s/hf", dir);
    if (model_gen_folder_config(&c, 0, 0, args, &e) < 0) {
        snprintf(out, sizeof out, "%s", e.msg);
        return -1;
    }
    snprintf(args, sizeof args, "gen --from %s/hf --gguf %s", dir, gguf);
    return test_run_cli(args, out, sizeof out) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------ */
/* Real runs                                                            */

/* kvdiff's reference on the exported folder dir/hf: 40 random tokens
 * (seed 3) and max_new more, dumped to dir/ref.h5. */
static void run_reference(const char *dir, int max_new)
{
    char args[1024];
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 40 --seed 3 --max-new %d "
             "--ignore-eos --dump %s/ref.h5", dir, max_new, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

/* A finished recording says so in one line (out: the recorder's output):
 * the file, the positions and layers recorded, the tokens. */
static void assert_says_wrote(const char *dir, const char *file, int positions, int prompt,
                              int generated)
{
    char want[512];
    snprintf(want, sizeof want, "kvdiff-llama: wrote %s/%s: %d positions x ", dir, file,
             positions);
    ck_assert_msg(strstr(out, want), "expected '%s' in: %s", want, out);
    snprintf(want, sizeof want, " layers (%d prompt tokens, %d generated)\n", prompt,
             generated);
    ck_assert_msg(strstr(out, want), "expected '%s' in: %s", want, out);
    ck_assert_msg(strchr(out, '\n') == out + strlen(out) - 1, "not one line: %s", out);
}

/* kvdiff's reference and llama.cpp on the same prompt; returns the
 * compare exit status with out holding its JSON. */
static int record_and_compare(const char *preset, const char *dir, const char *rec_opts,
                              const char *atol)
{
    char args[2048], gguf[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    ck_assert_msg(make_model_gguf(preset, dir, gguf) == 0, "%s", out);
    run_reference(dir, 6);
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 6 --ignore-eos "
             "%s --dump %s/llama.h5", gguf, dir, dir, rec_opts, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    assert_says_wrote(dir, "llama.h5", 45, 40, 6);
    snprintf(args, sizeof args, "validate %s/llama.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "conforms"), "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --atol %s --json", dir, dir, atol);
    return test_run_cli(args, out, sizeof out);
}

static void check_preset(const char *preset, const char *rec_opts, const char *atol)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    int rc = record_and_compare(preset, dir, rec_opts, atol);
    ck_assert_msg(rc == 0, "%s: exit %d\n%s", preset, rc, out);
    /* Every stage llama.cpp exposes is in the dump, at every position. */
    char path[128];
    snprintf(path, sizeof path, "%s/llama.h5", dir);
    kv_err e;
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f, "%s", e.msg);
    ck_assert(dump_is_complete(f));
    ck_assert_str_eq(dump_attr(f, "engine"), "llama.cpp");
    ck_assert_ptr_nonnull(strstr(dump_attr(f, "engine_settings"), "\"llama_cpp_release\""));
    /* What llama.cpp computes activations in: the drift model's floor. */
    ck_assert_ptr_nonnull(strstr(dump_attr(f, "engine_settings"), "\"compute_dtype\":\"f32\""));
    static const kv_stage stages[] = {STAGE_X_IN, STAGE_ATTN_NORM, STAGE_Q, STAGE_K, STAGE_V,
                                      STAGE_ATTN_OUT, STAGE_ATTN_PROJ, STAGE_H_MID,
                                      STAGE_FFN_NORM, STAGE_FFN_OUT, STAGE_X_OUT};
    for (int l = 0; l < dump_n_layers(f); l++)
        for (size_t s = 0; s < sizeof stages / sizeof stages[0]; s++) {
            dump_dataset_info di = dump_stage_info(f, l, stages[s]);
            ck_assert_msg(di.present && di.first_position == 0 && di.rows == 45,
                          "%s layer %d %s: present %d rows %lld", preset, l,
                          stage_name(stages[s]), di.present, (long long)di.rows);
        }
    dump_dataset_info em = dump_stage_info(f, -1, STAGE_EMBED);
    ck_assert(em.present && em.rows == 45);
    ck_assert_int_eq(dump_n_tokens(f), 46);
    dump_file_close(f);
    test_rmtree(dir);
}

/* Tolerances: with an f32 KV cache llama.cpp differs from kvdiff's
 * reference by its own rounding only (measured max abs 4.1e-6 on
 * tiny-llama, 4.2e-6 on tiny-qwen2); Gemma 3 adds llama.cpp's table GELU
 * (f16 lookup) and an f16 cache its rounding of every key and value. A
 * layout slip (q/k rows left permuted, Gemma's q scale left folded) is
 * off by the size of the values themselves. */
START_TEST(test_llama_tiny_llama) { check_preset("tiny-llama", "--cache-type f32 --threads 1", "2e-5"); }
END_TEST
START_TEST(test_llama_tiny_llama_f16_fa)
{
    check_preset("tiny-llama", "--cache-type f16 --flash-attn on --ubatch 7 --threads 2", "1e-2");
}
END_TEST
START_TEST(test_llama_tiny_qwen2) { check_preset("tiny-qwen2", "--ubatch 7 --cache-type f32 --threads 1", "2e-5"); }
END_TEST
/* The newer families: Llama 3.x's llama3 RoPE scaling (a rope_freqs
 * tensor), Llama with attention_bias (permuted q/k biases, attn_output.bias)
 * and Qwen3 (arch qwen3, q/k norms); all exact up to rounding, like the
 * presets above. */
START_TEST(test_llama_tiny_llama3) { check_preset("tiny-llama3", "--cache-type f32 --threads 1", "2e-5"); }
END_TEST
START_TEST(test_llama_biased_llama)
{
    check_preset("tiny-llama+attention_bias", "--ubatch 7 --cache-type f32 --threads 1", "2e-5");
}
END_TEST
START_TEST(test_llama_tiny_qwen3) { check_preset("tiny-qwen3", "--ubatch 7 --cache-type f32 --threads 1", "2e-5"); }
END_TEST

START_TEST(test_llama_tiny_gemma3)
{
    check_preset("tiny-gemma3", "--ubatch 16 --cache-type f32 --threads 1", "2e-2");
}
END_TEST

/* A GGUF kvdiff exported says what it folded into Gemma 3's q_norm
 * (kvdiff.query_pre_attn_scalar): without --hf, q still comes back in the
 * model's own scale (tiny-gemma3 folds sqrt(32/24)), as exact as the rest. */
START_TEST(test_llama_gemma3_fold_from_gguf)
{
    char dir[64], args[2048], gguf[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    ck_assert_msg(make_gguf("tiny-gemma3", dir, gguf, NULL) == 0, "%s", out);
    run_reference(dir, 2);
    snprintf(args, sizeof args, "%s --prompt-from %s/ref.h5 --max-new 2 --ignore-eos "
             "--cache-type f32 --threads 1 --dump %s/llama.h5", gguf, dir, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json --stages --rtol 1 "
             "> %s/c.json", dir, dir, dir);
    test_run_cli(args, out, sizeof out);
    snprintf(args, sizeof args, "%s/c.json", dir);
    json_t *j = json_load_file(args, 0, NULL);
    ck_assert_msg(j != NULL, "%.300s", out);
    size_t i;
    json_t *st;
    bool seen = false;
    json_array_foreach(json_object_get(j, "stages"), i, st) {
        if (json_integer_value(json_object_get(st, "layer")) != 0 ||
            strcmp(json_string_value(json_object_get(st, "stage")), "q"))
            continue;
        double rel = json_real_value(json_object_get(json_object_get(st, "all"), "max_rel"));
        ck_assert_msg(rel < 1e-5, "q of layer 0 off by %g (the folded scale left in?)", rel);
        seen = true;
    }
    ck_assert_msg(seen, "no q of layer 0 compared");
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Gemma 4: the KV-shared family in real llama.cpp                      */

static void one_line_exit2(const char *args, const char *expect, const char *dump);

/* compare's JSON: the verdict, and the first divergence's layer,
 * position, stage and diagnosis kind (-1 / "" when none). */
typedef struct {
    char verdict[32], stage[32], kind[32];
    long layer, pos;
} g4_verdict;

static g4_verdict compare_json(const char *dir, const char *test)
{
    char args[1024], path[512];
    g4_verdict v = {"", "", "", -1, -1};
    snprintf(args, sizeof args, "compare %s/ref.h5 %s --json > %s/c.json", dir, test, dir);
    test_run_cli(args, out, sizeof out);
    snprintf(path, sizeof path, "%s/c.json", dir);
    json_t *j = json_load_file(path, 0, NULL);
    ck_assert_msg(j != NULL, "no JSON from compare: %.300s", out);
    const char *s = json_string_value(json_object_get(j, "verdict"));
    snprintf(v.verdict, sizeof v.verdict, "%s", s ? s : "");
    json_t *f = json_object_get(j, "first_divergence");
    if (json_is_object(f)) {
        v.layer = (long)json_integer_value(json_object_get(f, "layer"));
        v.pos = (long)json_integer_value(json_object_get(f, "position"));
        s = json_string_value(json_object_get(f, "stage"));
        snprintf(v.stage, sizeof v.stage, "%s", s ? s : "");
    }
    s = json_string_value(json_object_get(json_object_get(j, "diagnosis"), "kind"));
    snprintf(v.kind, sizeof v.kind, "%s", s ? s : "");
    json_decref(j);
    return v;
}

/* tiny-gemma4 exported and run by llama.cpp with an f32 cache, an f16
 * cache with flash attention, and q8_0: every one "no bug" against
 * kvdiff's reference; shared layers record no k/v, every layer its
 * per-layer input stages. */
START_TEST(test_llama_tiny_gemma4)
{
    static const char *const caches[] = {"--cache-type f32 --threads 1",
                                         "--cache-type f16 --flash-attn on --ubatch 7 --threads 2",
                                         "--cache-type q8_0 --flash-attn on --ubatch 16"};
    char dir[64], args[2048], gguf[512], path[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    ck_assert_msg(make_gguf("tiny-gemma4", dir, gguf, NULL) == 0, "%s", out);
    run_reference(dir, 6);
    for (size_t i = 0; i < sizeof caches / sizeof *caches; i++) {
        snprintf(path, sizeof path, "%s/llama%zu.h5", dir, i);
        snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 6 "
                 "--ignore-eos %s --dump %s", gguf, dir, dir, caches[i], path);
        ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
        snprintf(args, sizeof args, "llama%zu.h5", i);
        assert_says_wrote(dir, args, 45, 40, 6);
        snprintf(args, sizeof args, "validate %s", path);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        /* engine_settings names the cache (llama.cpp's full-size sliding
         * cache: dense): nothing to warn about. */
        ck_assert_msg(strstr(out, "conforms") && !strstr(out, "warning"), "%s", out);
        g4_verdict v = compare_json(dir, path);
        ck_assert_msg(!strcmp(v.verdict, "within_tolerance"), "%s: verdict %s at layer %ld position %ld "
                      "%s (%s)", caches[i], v.verdict, v.layer, v.pos, v.stage, v.kind);
    }
    kv_err e;
    snprintf(path, sizeof path, "%s/llama0.h5", dir);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f, "%s", e.msg);
    ck_assert_ptr_nonnull(strstr(dump_attr(f, "engine_settings"), "\"cache\":\"dense\""));
    for (int l = 0; l < 12; l++) {
        ck_assert_int_eq(dump_stage_info(f, l, STAGE_K).present, l < 8);
        ck_assert_int_eq(dump_stage_info(f, l, STAGE_V).present, l < 8);
        ck_assert(dump_stage_info(f, l, STAGE_PLE_IN).rows == 45);
        ck_assert(dump_stage_info(f, l, STAGE_PLE_OUT).rows == 45);
    }
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

/* A bug planted in llama.cpp, by kvdiff-llama --fault F (fault) or in the
 * GGUF (gguf: a file in dir; NULL: dir's m.gguf), run with opts on ref.h5's
 * prompt and max_new tokens (0: 6): found at layer 0, position pos, stage,
 * named kind, the compare saying `says` (its text is left in out). */
typedef struct {
    const char *fault, *opts, *stage, *says;
    long pos;
    const char *gguf;
    int max_new;
} planted_bug;

static void expect_planted(const char *dir, const char *what, const planted_bug *b,
                           const char *kind)
{
    char path[512], args[2048], fault[128] = "";
    const char *name = b->fault ? b->fault : b->gguf;
    if (b->fault)
        snprintf(fault, sizeof fault, "--fault %s", b->fault);
    snprintf(path, sizeof path, "%s/%s.h5", dir, name);
    snprintf(args, sizeof args, "%s/%s --prompt-from %s/ref.h5 --max-new %d --ignore-eos %s "
             "%s --dump %s", dir, b->gguf ? b->gguf : "m.gguf", dir, b->max_new ? b->max_new : 6,
             b->opts, fault, path);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    g4_verdict w = compare_json(dir, path);
    ck_assert_msg(!strcmp(w.verdict, "diverged") && w.layer == 0 && w.pos == b->pos &&
                  !strcmp(w.stage, b->stage) && !strcmp(w.kind, kind),
                  "%s %s: verdict %s at layer %ld position %ld %s (%s)", what, name,
                  w.verdict, w.layer, w.pos, w.stage, w.kind);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    test_run_cli(args, out, sizeof out);
    ck_assert_msg(strstr(out, b->says), "%s %s: %s", what, name, out);
}

/* tiny-deepseek-v2 and -v3 in llama.cpp's deepseek2 graph, MLA form (the
 * latent cache, absorbed attention; values through v_b): "no bug" with
 * f32, f16 and q8_0 caches, flash attention on and off, prefill in one
 * step or 7 tokens a step and decode; V3's q8_0 run flips its routing at a
 * near tie between expert groups, said in a note. kvdiff-llama records q
 * (the tails from the rotated q_pe), the cache row (Kcur), the attention
 * output and the router's selection scores; the expanded k and v, which
 * that graph never forms, it computes from each cache row and the GGUF's
 * attn_k_b / attn_v_b. */
START_TEST(test_llama_tiny_deepseek)
{
    static const char *const presets[] = {"tiny-deepseek-v2", "tiny-deepseek-v3"};
    static const char *const caches[] = {"--cache-type f32 --threads 1",
                                         "--cache-type f16",
                                         "--cache-type f16 --flash-attn on --ubatch 7",
                                         "--cache-type q8_0 --flash-attn on --ubatch 16"};
    char dir[64], args[2048], path[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset %s -o %s/hf", presets[_i], dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "gen --from %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    run_reference(dir, 6);
    for (size_t i = 0; i < sizeof caches / sizeof *caches; i++) {
        snprintf(path, sizeof path, "%s/llama%zu.h5", dir, i);
        snprintf(args, sizeof args, "%s/m.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 6 "
                 "--ignore-eos %s --dump %s", dir, dir, dir, caches[i], path);
        ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
        g4_verdict v = compare_json(dir, path);
        ck_assert_msg(!strcmp(v.verdict, "within_tolerance"), "%s %s: verdict %s at layer %ld "
                      "position %ld %s (%s)", presets[_i], caches[i], v.verdict, v.layer, v.pos,
                      v.stage, v.kind);
    }
    kv_err e;
    snprintf(path, sizeof path, "%s/llama0.h5", dir);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f, "%s", e.msg);
    ck_assert(dump_stage_info(f, 0, STAGE_KV_LATENT).rows == 45);
    ck_assert(dump_stage_info(f, 3, STAGE_Q).rows == 45);
    ck_assert(dump_stage_info(f, 3, STAGE_K).rows == 45);   /* expanded from the rows */
    ck_assert(dump_stage_info(f, 3, STAGE_V).rows == 45);
    ck_assert(dump_stage_info(f, 0, STAGE_ROUTER_LOGITS).rows == 0);   /* dense layer 0 */
    ck_assert(dump_stage_info(f, 1, STAGE_ROUTER_LOGITS).rows == 45);
    dump_file_close(f);
    /* A GGUF without DeepSeek's yarn_log_multiplier (a converter that
     * drops mscale_all_dim): llama.cpp scales q.k by head^-1/2 alone.
     * Found where attention first reads two keys and named from the
     * test's own q, k and v. */
    if (_i == 0) {
        char bad[512];
        snprintf(bad, sizeof bad, "%s/nomscale.gguf", dir);
        snprintf(path, sizeof path, "%s/m.gguf", dir);
        ck_assert_int_eq(gguf_patch(path, bad, "deepseek2.rope.scaling.yarn_log_multiplier",
                                    1e-9), 0);
        const planted_bug nomscale = {NULL, "--cache-type f16", "attn_out",
                                      "lacks YaRN's mscale_all_dim correction", 1,
                                      .gguf = "nomscale.gguf"};
        expect_planted(dir, presets[_i], &nomscale, "latent_cache");
        ck_assert_msg(strstr(out, "from the test's q, k, v"), "%s", out);
    }
    /* The latent cache's own bugs, made in llama.cpp's graph as it runs
     * (kvdiff-llama --fault): each found where it is born and named. */
    static const planted_bug planted[] = {
        {"mla-rope-twice", "--cache-type f16", "kv_latent", "tail is rotated twice", 1, NULL, 0},
        {"mla-rope-uncached", "--cache-type f16 --flash-attn on --ubatch 7", "attn_out",
         "holds no RoPE key tail: keys before position 7", 7, NULL, 0},
        {"mla-mixed-forms", "--cache-type f32", "attn_out",
         "decode reads the latent cache empty at every prompt position", 40, NULL, 0},
    };
    for (size_t i = 0; i < sizeof planted / sizeof *planted; i++)
        expect_planted(dir, presets[_i], &planted[i], "latent_cache");
    test_rmtree(dir);
}
END_TEST

/* tiny-gpt-oss in llama.cpp's openai-moe graph (sinks, window, YaRN,
 * experts). With YaRN's ramp ends whole (truncate true, which llama.cpp
 * always computes) every cache is "no bug"; with gpt-oss's own truncate
 * false llama.cpp rotates otherwise from position 1 on: found there, at
 * q, and named as that convention. */
static void oss_folder(const char *dir, bool truncate)
{
    char hf[512], args[1024];
    kv_config c;
    kv_err e = {{0}};
    snprintf(hf, sizeof hf, "%s/hf", dir);
    ck_assert_int_eq(config_preset("tiny-gpt-oss", &c, &e), 0);
    c.rope_scaling.truncate = truncate;
    ck_assert_msg(model_gen_folder_config(&c, 0, 0, hf, &e) == 0, "%s", e.msg);
    snprintf(args, sizeof args, "gen --from %s --gguf %s/m.gguf", hf, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

START_TEST(test_llama_tiny_gpt_oss)
{
    static const char *const caches[] = {"--cache-type f32 --threads 1",
                                         "--cache-type f16 --flash-attn on --ubatch 7",
                                         "--cache-type q8_0 --flash-attn on --ubatch 16"};
    char dir[64], args[2048], path[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    oss_folder(dir, true);
    run_reference(dir, 6);
    for (size_t i = 0; i < sizeof caches / sizeof *caches; i++) {
        snprintf(path, sizeof path, "%s/llama%zu.h5", dir, i);
        snprintf(args, sizeof args, "%s/m.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 6 "
                 "--ignore-eos %s --dump %s", dir, dir, dir, caches[i], path);
        ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
        g4_verdict v = compare_json(dir, path);
        ck_assert_msg(!strcmp(v.verdict, "within_tolerance"), "%s: verdict %s at layer %ld "
                      "position %ld %s (%s)", caches[i], v.verdict, v.layer, v.pos, v.stage,
                      v.kind);
    }
    kv_err e;
    snprintf(path, sizeof path, "%s/llama0.h5", dir);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f, "%s", e.msg);
    for (int l = 0; l < 4; l++)
        ck_assert(dump_stage_info(f, l, STAGE_ROUTER_LOGITS).rows == 45);
    dump_file_close(f);
    /* The window off by one in the GGUF (11 for 12), q8_0: llama.cpp's
     * router then also takes another expert at position 11 of layer 1,
     * within the error the bug leaves there; the bug, born upstream of it
     * at layer 0, is found first and named. */
    char bad[512];
    snprintf(bad, sizeof bad, "%s/w11.gguf", dir);
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    ck_assert_int_eq(gguf_patch(path, bad, "gpt-oss.attention.sliding_window", 11), 0);
    const planted_bug w11 = {NULL, "--cache-type q8_0 --flash-attn on", "attn_out", "window",
                             11, .gguf = "w11.gguf"};
    expect_planted(dir, "tiny-gpt-oss", &w11, "window");
    /* The sinks left out inside llama.cpp (kvdiff-llama --fault: the sink
     * weights set to -inf before attention reads them), in every softmax,
     * in decode only, or on a sliding layer's rows whose window has left
     * key 0 (the sink masked as that key): found where they act, named. */
    static const planted_bug sinks[] = {
        {"sink-dropped", "--cache-type f16 --flash-attn on", "attn_out",
         "sinks are left out of the softmax", 0, NULL, 0},
        {"sink-prefill-only", "--cache-type f32", "attn_out",
         "sinks are applied in prefill only", 40, NULL, 0},
        {"sink-windowed", "--cache-type f16 --flash-attn on --ubatch 1", "attn_out",
         "sink is masked like the key at position 0", 12, NULL, 0},
    };
    for (size_t i = 0; i < sizeof sinks / sizeof *sinks; i++)
        expect_planted(dir, "tiny-gpt-oss", &sinks[i], "attention_sink");
    test_rmtree(dir);
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    oss_folder(dir, false);
    run_reference(dir, 4);
    const planted_bug truncate = {NULL, "--cache-type f32", "q",
                                  "YaRN with the ramp's ends rounded to whole dims (truncate "
                                  "true, which llama.cpp always computes", 1, .gguf = "m.gguf",
                                  .max_new = 4};
    expect_planted(dir, "tiny-gpt-oss truncate false", &truncate, "rope_convention");
    test_rmtree(dir);
}
END_TEST

/* A GGUF whose shared_kv_layers (8) differs from the model's (4): llama.cpp
 * runs layers 4..7 on layers 2 and 3's caches. Found at layer 4, position
 * 0, attn_out, and named: the layer whose cache it read, verified at every
 * position. */
START_TEST(test_llama_gemma4_shared_kv_layers_wrong)
{
    char dir[64], args[2048], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_msg(make_gguf("tiny-gemma4", dir, gguf, NULL) == 0, "%s", out);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 8), 0);
    run_reference(dir, 4);
    snprintf(args, sizeof args, "%s --prompt-from %s/ref.h5 --max-new 4 --ignore-eos "
             "--cache-type f32 --dump %s/bad.h5", bad, dir, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "%s/bad.h5", dir);
    g4_verdict v = compare_json(dir, args);
    ck_assert_msg(!strcmp(v.verdict, "diverged") && v.layer == 4 && v.pos == 0 &&
                  !strcmp(v.stage, "attn_out") && !strcmp(v.kind, "kv_owner"),
                  "verdict %s at layer %ld position %ld %s (%s)", v.verdict, v.layer, v.pos,
                  v.stage, v.kind);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/bad.h5", dir, dir);
    test_run_cli(args, out, sizeof out);
    ck_assert_msg(strstr(out, "layer 4 read layer 2's KV cache where the config has it compute "
                          "its own") && strstr(out, "shares the last 8 layers' caches, the "
                          "reference's 4"), "%s", out);
    /* More shared layers than llama.cpp can run (it asserts on fewer than
     * two computing K/V): one line, exit 2, no dump. */
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 11), 0);
    snprintf(args, sizeof args, "%s --prompt-from %s/ref.h5 --max-new 1 --dump %s/worse.h5", bad,
             dir, dir);
    char worse[512];
    snprintf(worse, sizeof worse, "%s/worse.h5", dir);
    one_line_exit2(args, "attention.shared_kv_layers is 11: llama.cpp needs at least two of "
                   "the 12 layers computing K/V", worse);
    test_rmtree(dir);
}
END_TEST

/* The KV sharing is a size --hf checks as it does the others, and a
 * sharing count the weights contradict (layer 8 computes K/V by the
 * count, but the file has no K of its own for it) is blamed on the count,
 * not on the MLP widths that then look wrong. */
START_TEST(test_llama_gemma4_sharing_checked)
{
    char dir[64], args[2048], gguf[512], bad[512], dump[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    snprintf(dump, sizeof dump, "%s/d.h5", dir);
    ck_assert_msg(make_gguf("tiny-gemma4", dir, gguf, NULL) == 0, "%s", out);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 8), 0);
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-tokens 1,2,3 --max-new 1 --dump %s",
             bad, dir, dump);
    one_line_exit2(args, "4 layers share KV caches in config.json (num_kv_shared_layers) but "
                   "8 in the GGUF (attention.shared_kv_layers)", dump);
    ck_assert_int_eq(access(dump, F_OK), -1);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 3), 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --max-new 1 --dump %s", bad, dump);
    one_line_exit2(args, "gemma4.attention.shared_kv_layers is 3, so layer 8 computes its own "
                   "K/V, but the file has no blk.8.attn_k.weight", dump);
    ck_assert_msg(!strstr(out, "feed_forward_length"), "%s", out);
    ck_assert_int_eq(access(dump, F_OK), -1);
    /* The sound file with --hf: recorded, and said so. */
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-tokens 1,2,3 --max-new 2 --threads 1 "
             "--dump %s", gguf, dir, dump);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    assert_says_wrote(dir, "d.h5", 4, 3, 2);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Bad input                                                            */

static void one_line_exit2(const char *args, const char *expect, const char *dump)
{
    int rc = test_run_recorder(args, out, sizeof out);
    ck_assert_msg(rc == 2, "exit %d: %s", rc, out);
    ck_assert_msg(strstr(out, expect), "expected '%s' in: %s", expect, out);
    size_t len = strlen(out);
    ck_assert_msg(len > 0 && strchr(out, '\n') == out + len - 1, "not one line: %s", out);
    if (dump) {
        kv_err e;
        dump_file *f = dump_open(dump, &e);
        if (f) {
            ck_assert_msg(!dump_is_complete(f), "%s is marked complete", dump);
            dump_file_close(f);
        }
    }
}

START_TEST(test_llama_bad_input)
{
    char dir[64], gguf[256], args[1024], dump[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(dump, sizeof dump, "%s/x.h5", dir);

    gguf_damage arch = {"gpt2", NULL};
    snprintf(gguf, sizeof gguf, "%s/gpt2.gguf", dir);
    ck_assert(make_gguf("tiny-llama", dir, gguf, &arch) == 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", gguf, dump);
    one_line_exit2(args, "unsupported architecture 'gpt2'", dump);

    gguf_damage missing = {NULL, "blk.1.attn_k.weight"};
    snprintf(gguf, sizeof gguf, "%s/missing.gguf", dir);
    ck_assert(make_gguf("tiny-llama", dir, gguf, &missing) == 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", gguf, dump);
    one_line_exit2(args, "blk.1.attn_k.weight", dump);

    snprintf(gguf, sizeof gguf, "%s/good.gguf", dir);
    ck_assert(make_gguf("tiny-llama", dir, gguf, NULL) == 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,256,3 --threads 1 --dump %s", gguf, dump);
    one_line_exit2(args, "out of range", dump);
    /* a latent cache's fault on a model without one */
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --fault mla-rope-twice "
             "--dump %s", gguf, dump);
    one_line_exit2(args, "has no latent (MLA) cache", dump);

    struct stat sb;
    ck_assert(stat(gguf, &sb) == 0);
    char cut[256];
    snprintf(cut, sizeof cut, "%s/cut.gguf", dir);
    snprintf(args, sizeof args, "head -c %lld %s > %s", (long long)sb.st_size * 2 / 3, gguf, cut);
    ck_assert(system(args) == 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", cut, dump);
    one_line_exit2(args, "cut.gguf", dump);
    snprintf(args, sizeof args, "head -c 100 %s > %s", gguf, cut);
    ck_assert(system(args) == 0);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", cut, dump);
    one_line_exit2(args, "not a readable GGUF", dump);

    /* The dump never overwrites what the run reads: the model, the ids
     * file, or the recording the prompt comes from (left intact). */
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", gguf, gguf);
    one_line_exit2(args, "is the same file as the model", NULL);
    char ids[256];
    snprintf(ids, sizeof ids, "%s/ids.txt", dir);
    FILE *f = fopen(ids, "w");
    ck_assert_ptr_nonnull(f);
    fputs("5,17,42\n", f);
    fclose(f);
    snprintf(args, sizeof args, "%s --prompt-ids-file %s --threads 1 --dump %s", gguf, ids, ids);
    one_line_exit2(args, "is the same file as --prompt-ids-file", NULL);
    snprintf(args, sizeof args, "%s --prompt-ids-file %s --threads 1 --dump %s", gguf, ids, dump);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "%s --prompt-from %s --threads 1 --dump %s", gguf, dump, dump);
    one_line_exit2(args, "is the same file as --prompt-from", NULL);
    kv_err e;
    dump_file *d = dump_open(dump, &e);
    ck_assert_msg(d && dump_is_complete(d), "the prompt's recording was touched");
    dump_file_close(d);
    ck_assert(stat(gguf, &sb) == 0 && sb.st_size > 1000);
    test_rmtree(dir);
}
END_TEST

/* Each GGUF key checked is named on its own, with its value as written:
 * a key present with value 0 is not "missing", 2^31 is not -2147483648
 * (an int32 cast), and a wrong key_length is named, not the RoPE count
 * checked against it. */
START_TEST(test_llama_gguf_keys_named)
{
    char dir[64], gguf[256], bad[256], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gguf, sizeof gguf, "%s/g.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert(make_gguf("tiny-llama", dir, gguf, NULL) == 0);
    static const struct {
        const char *key;
        double v;
        const char *want, *not_want;
    } cases[] = {
        {"llama.block_count", 0, "llama.block_count is 0: the number of layers must be from 1 "
         "to 256", "missing"},
        {"llama.attention.head_count", 0, "llama.attention.head_count is 0: the number of "
         "attention heads must be from 1", "missing"},
        {"llama.embedding_length", 2147483648.0, "llama.embedding_length is 2147483648: the "
         "model width must be from 1 to 1048576", "-2147483648"},
        {"llama.context_length", 2147483648.0, "llama.context_length is 2147483648: the "
         "context length must be from 1 to 16777216", "-2147483648"},
        {"llama.rope.dimension_count", 2147483648.0, "llama.rope.dimension_count is "
         "2147483648", "e+09"},
        {"llama.attention.key_length", 8, "llama.attention.key_length is 8, but "
         "blk.0.attn_k.weight holds 2 K/V heads of 16 dimensions", "rope.dimension_count"},
        {"llama.attention.key_length", 0, "llama.attention.key_length is 0: the head size must "
         "be from 2 to 16384", "rope.dimension_count"},
        {"llama.attention.key_length", 2147483648.0, "llama.attention.key_length is "
         "2147483648", "-2147483648"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ck_assert_int_eq(gguf_patch(gguf, bad, cases[i].key, cases[i].v), 0);
        snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s/x.h5", bad,
                 dir);
        one_line_exit2(args, cases[i].want, NULL);
        ck_assert_msg(!strstr(out, cases[i].not_want), "'%s' in: %s", cases[i].not_want, out);
    }
    test_rmtree(dir);
}
END_TEST

/* A GGUF llama.cpp loads but cannot compute with made it abort (exit 134,
 * a debugger's backtrace, a dump half written): a RoPE dimension count its
 * rope op asserts on is refused before loading, and any other failed
 * GGML_ASSERT ends in one line, exit 2, and no dump. */
START_TEST(test_llama_abort_is_one_line)
{
    char dir[64], gguf[256], bad[256], args[1024], dump[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(dump, sizeof dump, "%s/x.h5", dir);
    snprintf(gguf, sizeof gguf, "%s/g.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert(make_gguf("tiny-gemma3", dir, gguf, NULL) == 0);
    const double counts[] = {3, 1000, 0};
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(gguf_patch(gguf, bad, "gemma3.rope.dimension_count", counts[i]), 0);
        snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --dump %s", bad, dump);
        one_line_exit2(args, "gemma3.rope.dimension_count is", NULL);
        ck_assert_msg(access(dump, F_OK) != 0, "a refused run left %s", dump);
    }
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2,3 --threads 1 --fault ggml-abort --dump %s",
             gguf, dump);
    one_line_exit2(args, "llama.cpp stopped on a failed internal check", NULL);
    ck_assert_msg(strstr(out, "no dump written") && access(dump, F_OK) != 0, "%s", out);
    /* a file-size limit while the dump is created: SIGXFSZ killed it, then
     * libhdf5's exit handler crashed on the file it could not close */
    const char *bin = getenv("KVDIFF_LLAMA_BIN") ? getenv("KVDIFF_LLAMA_BIN") : "./kvdiff-llama";
    snprintf(args, sizeof args, "bash -c 'ulimit -f 8; exec \"%s\" %s --prompt-tokens 1,2,3 "
             "--threads 1 --dump %s' 2>&1", bin, gguf, dump);
    FILE *p = popen(args, "r");
    ck_assert_ptr_nonnull(p);
    const size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = 0;
    const int st = pclose(p);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2 &&
                      strstr(out, "file size limit reached (ulimit -f)") &&
                      strchr(out, '\n') == out + len - 1, "status %d: %s", st, out);
    test_rmtree(dir);
}
END_TEST

Suite *llamacpp_suite(void)
{
    Suite *s = suite_create("llamacpp");
    TCase *tc = tcase_create("llamacpp");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_llama_tiny_llama);
    tcase_add_test(tc, test_llama_tiny_llama_f16_fa);
    tcase_add_test(tc, test_llama_tiny_qwen2);
    tcase_add_test(tc, test_llama_tiny_gemma3);
    tcase_add_test(tc, test_llama_tiny_llama3);
    tcase_add_test(tc, test_llama_biased_llama);
    tcase_add_test(tc, test_llama_tiny_qwen3);
    tcase_add_test(tc, test_llama_gemma3_fold_from_gguf);
    tcase_add_test(tc, test_llama_tiny_gemma4);
    tcase_add_test(tc, test_llama_tiny_gpt_oss);
    tcase_add_loop_test(tc, test_llama_tiny_deepseek, 0, 2);
    tcase_add_test(tc, test_llama_gemma4_shared_kv_layers_wrong);
    tcase_add_test(tc, test_llama_gemma4_sharing_checked);
    tcase_add_test(tc, test_llama_bad_input);
    tcase_add_test(tc, test_llama_gguf_keys_named);
    tcase_add_test(tc, test_llama_abort_is_one_line);
    suite_add_tcase(s, tc);
    return s;
}
