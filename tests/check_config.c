/* check_config.c — tests of model/config: the conformance configs resolve
 * to what the conformance README says, library defaults for sparse configs,
 * presets validate and round-trip through config.json, bad input is refused
 * with a message naming the file and the field. Run from the repository
 * root (the conformance configs are read from tests/data/conformance). */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/config.h"
#include "model/observer.h"

/* ---- helpers ------------------------------------------------------------ */

static void make_tmpdir(char dir[64])
{
    snprintf(dir, 64, "/tmp/kvdiff-config-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

/* Removes a flat temporary folder and everything in it. */
static void remove_tmpdir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    char path[512];
    while (d && (de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* A valid gemma4_text body, for the Gemma 4 tests and refusals. */
#define G4_BASE "\"model_type\": \"gemma4_text\", \"hidden_size\": 64, " \
    "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, " \
    "\"num_key_value_heads\": 2, \"vocab_size\": 256, " \
    "\"layer_types\": [\"sliding_attention\", \"full_attention\"]"

static kv_config parse_ok(const char *json)
{
    kv_config c;
    kv_err e = { "" };
    memset(&c, 0, sizeof c);
    int rc = config_parse_json(json, strlen(json), "test.json", &c, &e);
    ck_assert_msg(rc == 0, "parse failed: %s", e.msg);
    return c;
}

static kv_config load_ok(const char *path)
{
    kv_config c;
    kv_err e = { "" };
    memset(&c, 0, sizeof c);
    ck_assert_msg(config_load_json(path, &c, &e) == 0, "%s", e.msg);
    ck_assert_msg(config_validate(&c, &e) == 0, "%s", e.msg);
    return c;
}

static void assert_owners_are_self(const kv_config *c)
{
    for (int i = 0; i < c->n_layers; i++)
        ck_assert_int_eq(c->kv_owner[i], i);
}

static void assert_all_global(const kv_config *c)
{
    for (int i = 0; i < c->n_layers; i++) {
        ck_assert_int_eq(c->layer_type[i], ATTN_GLOBAL);
        ck_assert_int_eq(config_layer_window(c, i), 0);
        ck_assert(config_layer_theta(c, i) == c->rope_theta);
    }
}

/* Field-by-field equality, then the bytes (both sides start memset to 0). */
static void assert_same_config(const kv_config *a, const kv_config *b)
{
    ck_assert_int_eq(a->arch, b->arch);
    ck_assert_str_eq(a->model_type, b->model_type);
    ck_assert_int_eq(a->hidden, b->hidden);
    ck_assert_int_eq(a->n_layers, b->n_layers);
    ck_assert_int_eq(a->n_heads, b->n_heads);
    ck_assert_int_eq(a->n_kv_heads, b->n_kv_heads);
    ck_assert_int_eq(a->head_dim, b->head_dim);
    ck_assert_int_eq(a->intermediate, b->intermediate);
    ck_assert_int_eq(a->vocab, b->vocab);
    ck_assert_int_eq(a->max_positions, b->max_positions);
    ck_assert(a->rms_eps == b->rms_eps);
    ck_assert(a->norm_plus_one == b->norm_plus_one && a->act == b->act);
    ck_assert(a->qkv_bias == b->qkv_bias && a->qk_norm == b->qk_norm);
    ck_assert(a->o_bias == b->o_bias);
    ck_assert(a->sandwich_norms == b->sandwich_norms);
    ck_assert(a->tie_embeddings == b->tie_embeddings);
    ck_assert(a->embed_scale == b->embed_scale);
    ck_assert(a->attn_scale == b->attn_scale);
    ck_assert(a->query_pre_attn_scalar == b->query_pre_attn_scalar);
    ck_assert(a->final_softcap == b->final_softcap);
    ck_assert(a->rope_theta == b->rope_theta);
    ck_assert(a->rope_local_theta == b->rope_local_theta);
    ck_assert_int_eq(a->rope_scaling.type, b->rope_scaling.type);
    ck_assert(a->rope_scaling.factor == b->rope_scaling.factor);
    ck_assert(a->rope_scaling.low_freq_factor == b->rope_scaling.low_freq_factor);
    ck_assert(a->rope_scaling.high_freq_factor == b->rope_scaling.high_freq_factor);
    ck_assert_int_eq(a->rope_scaling.original_max_position, b->rope_scaling.original_max_position);
    ck_assert_int_eq(a->sliding_window, b->sliding_window);
    for (int i = 0; i < KV_MAX_LAYERS; i++) {
        ck_assert_int_eq(a->layer_type[i], b->layer_type[i]);
        ck_assert_int_eq(a->kv_owner[i], b->kv_owner[i]);
    }
    ck_assert_int_eq(a->bos_id, b->bos_id);
    ck_assert_int_eq(a->n_eos, b->n_eos);
    for (int i = 0; i < KV_MAX_EOS; i++)
        ck_assert_int_eq(a->eos_ids[i], b->eos_ids[i]);
    ck_assert_str_eq(a->tensor_prefix, b->tensor_prefix);
    ck_assert_str_eq(a->lm_head_name, b->lm_head_name);
    ck_assert_int_eq(memcmp(a, b, sizeof *a), 0);
}

/* Writes c to a temporary config.json, reads it back, compares; a second
 * write of what was read gives the same bytes. */
static void assert_round_trip(const kv_config *c)
{
    char dir[64], p1[128], p2[128], b1[8192], b2[8192];
    kv_err e = { "" };
    make_tmpdir(dir);
    snprintf(p1, sizeof p1, "%s/config.json", dir);
    snprintf(p2, sizeof p2, "%s/again.json", dir);
    ck_assert_msg(config_write_json(c, p1, &e) == 0, "%s", e.msg);
    kv_config back = load_ok(p1);
    assert_same_config(c, &back);
    ck_assert_msg(config_write_json(&back, p2, &e) == 0, "%s", e.msg);
    FILE *f1 = fopen(p1, "r"), *f2 = fopen(p2, "r");
    ck_assert(f1 && f2);
    size_t n1 = fread(b1, 1, sizeof b1, f1), n2 = fread(b2, 1, sizeof b2, f2);
    fclose(f1);
    fclose(f2);
    ck_assert(n1 == n2 && memcmp(b1, b2, n1) == 0);
    remove_tmpdir(dir);
}

/* ---- the conformance configs -------------------------------------------- */

START_TEST(conformance_llama)
{
    kv_config c = load_ok("tests/data/conformance/llama/config.json");
    ck_assert_int_eq(c.arch, ARCH_LLAMA);
    ck_assert_str_eq(c.model_type, "llama");
    ck_assert_int_eq(c.hidden, 64);
    ck_assert_int_eq(c.n_layers, 4);
    ck_assert_int_eq(c.n_heads, 4);
    ck_assert_int_eq(c.n_kv_heads, 2);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.intermediate, 96);
    ck_assert_int_eq(c.vocab, 256);
    ck_assert_int_eq(c.max_positions, 4096);
    ck_assert(c.rms_eps == 1e-5);
    ck_assert(!c.norm_plus_one && !c.qkv_bias && !c.qk_norm && !c.sandwich_norms);
    ck_assert_int_eq(c.act, ACT_SILU);
    ck_assert(!c.tie_embeddings);
    ck_assert(c.embed_scale == 1.0f);
    ck_assert(c.attn_scale == 1.0 / sqrt(16.0));
    ck_assert(c.query_pre_attn_scalar == 0.0 && c.final_softcap == 0.0);
    ck_assert(c.rope_theta == 500000.0 && c.rope_local_theta == 500000.0);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
    ck_assert_int_eq(c.sliding_window, 0);
    assert_all_global(&c);
    assert_owners_are_self(&c);
    ck_assert_int_eq(c.bos_id, 1);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 2);
    ck_assert_str_eq(c.tensor_prefix, "model.");
    ck_assert_str_eq(c.lm_head_name, "lm_head.weight");
}
END_TEST

START_TEST(conformance_qwen2)
{
    kv_config c = load_ok("tests/data/conformance/qwen2/config.json");
    ck_assert_int_eq(c.arch, ARCH_QWEN2);
    ck_assert_str_eq(c.model_type, "qwen2");
    ck_assert_int_eq(c.hidden, 96);
    ck_assert_int_eq(c.n_layers, 4);
    ck_assert_int_eq(c.n_heads, 6);
    ck_assert_int_eq(c.n_kv_heads, 2);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert_int_eq(c.intermediate, 128);
    ck_assert_int_eq(c.vocab, 320);
    ck_assert_int_eq(c.max_positions, 4096);
    ck_assert(c.rms_eps == 1e-6);
    ck_assert(c.qkv_bias && c.tie_embeddings);
    ck_assert(!c.norm_plus_one && !c.qk_norm && !c.sandwich_norms);
    ck_assert_int_eq(c.act, ACT_SILU);
    ck_assert(c.embed_scale == 1.0f);
    ck_assert(c.attn_scale == 1.0 / sqrt(16.0));
    ck_assert(c.rope_theta == 1e6 && c.rope_local_theta == 1e6);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
    /* sliding_window 4096 is present but use_sliding_window is false */
    ck_assert_int_eq(c.sliding_window, 0);
    assert_all_global(&c);
    assert_owners_are_self(&c);
    ck_assert_int_eq(c.bos_id, 1);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 2);
    ck_assert_str_eq(c.tensor_prefix, "model.");
}
END_TEST

START_TEST(conformance_gemma3)
{
    static const int sliding[6] = { 1, 1, 0, 1, 1, 0 };
    kv_config c = load_ok("tests/data/conformance/gemma3/config.json");
    ck_assert_int_eq(c.arch, ARCH_GEMMA3);
    ck_assert_str_eq(c.model_type, "gemma3_text");
    ck_assert_int_eq(c.hidden, 64);
    ck_assert_int_eq(c.n_layers, 6);
    ck_assert_int_eq(c.n_heads, 4);
    ck_assert_int_eq(c.n_kv_heads, 2);
    ck_assert_int_eq(c.head_dim, 32);
    ck_assert_int_eq(c.intermediate, 96);
    ck_assert_int_eq(c.vocab, 256);
    ck_assert(c.rms_eps == 1e-6);
    ck_assert(c.norm_plus_one && c.qk_norm && c.sandwich_norms && !c.qkv_bias);
    ck_assert_int_eq(c.act, ACT_GELU_TANH);
    ck_assert(c.tie_embeddings);
    ck_assert(c.embed_scale == 8.0f);
    ck_assert(c.query_pre_attn_scalar == 24.0);
    ck_assert(c.attn_scale == 1.0 / sqrt(24.0));
    ck_assert(c.final_softcap == 0.0);
    ck_assert(c.rope_theta == 1e6 && c.rope_local_theta == 1e4);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
    ck_assert_int_eq(c.sliding_window, 8);
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(c.layer_type[i], sliding[i] ? ATTN_SLIDING : ATTN_GLOBAL);
        ck_assert_int_eq(config_layer_window(&c, i), sliding[i] ? 8 : 0);
        ck_assert(config_layer_theta(&c, i) == (sliding[i] ? 1e4 : 1e6));
    }
    assert_owners_are_self(&c);
    ck_assert_int_eq(c.bos_id, 1);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 2);
    ck_assert_str_eq(c.tensor_prefix, "model.");
}
END_TEST

/* ---- defaults and variants ---------------------------------------------- */

/* The shape of google/gemma-3-4b-it's config.json: the text config leaves
 * heads, head_dim, vocab, query_pre_attn_scalar and the RoPE bases to the
 * library; eos is at the top level. */
static const char GEMMA3_4B_LIKE[] =
    "{\"architectures\": [\"Gemma3ForConditionalGeneration\"],"
    " \"boi_token_index\": 255999, \"eoi_token_index\": 256000,"
    " \"eos_token_id\": [1, 106], \"image_token_index\": 262144,"
    " \"initializer_range\": 0.02, \"mm_tokens_per_image\": 256,"
    " \"model_type\": \"gemma3\","
    " \"text_config\": {\"hidden_size\": 2560, \"intermediate_size\": 10240,"
    "   \"model_type\": \"gemma3_text\", \"num_hidden_layers\": 34,"
    "   \"rope_scaling\": {\"factor\": 8.0, \"rope_type\": \"linear\"},"
    "   \"sliding_window\": 1024},"
    " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.50.0.dev0\","
    " \"vision_config\": {\"hidden_size\": 1152, \"image_size\": 896,"
    "   \"model_type\": \"siglip_vision_model\", \"num_hidden_layers\": 27}}";

START_TEST(gemma3_nested_defaults)
{
    kv_config c = parse_ok(GEMMA3_4B_LIKE);
    ck_assert_int_eq(c.arch, ARCH_GEMMA3);
    ck_assert_str_eq(c.model_type, "gemma3_text");
    ck_assert_int_eq(c.hidden, 2560);
    ck_assert_int_eq(c.n_layers, 34);
    ck_assert_int_eq(c.intermediate, 10240);
    ck_assert_int_eq(c.n_heads, 8);
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert_int_eq(c.head_dim, 256);
    ck_assert_int_eq(c.vocab, 262208);
    ck_assert_int_eq(c.max_positions, 131072);
    ck_assert(c.rms_eps == 1e-6);
    ck_assert(c.query_pre_attn_scalar == 256.0);
    ck_assert(c.attn_scale == 1.0 / 16.0);
    ck_assert(c.embed_scale == sqrtf(2560.0f));
    ck_assert(c.rope_theta == 1e6 && c.rope_local_theta == 1e4);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_LINEAR);
    ck_assert(c.rope_scaling.factor == 8.0);
    ck_assert_int_eq(c.sliding_window, 1024);
    for (int i = 0; i < 34; i++)
        ck_assert_int_eq(c.layer_type[i], (i + 1) % 6 ? ATTN_SLIDING : ATTN_GLOBAL);
    ck_assert(c.tie_embeddings);
    ck_assert_int_eq(c.bos_id, 2);
    ck_assert_int_eq(c.n_eos, 2);
    ck_assert_int_eq(c.eos_ids[0], 1);
    ck_assert_int_eq(c.eos_ids[1], 106);
    ck_assert_str_eq(c.tensor_prefix, "language_model.model.");
    assert_owners_are_self(&c);
}
END_TEST

START_TEST(gemma3_pattern_without_layer_types)
{
    kv_config c = parse_ok("{\"model_type\": \"gemma3_text\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 7,"
                           " \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                           " \"head_dim\": 32, \"vocab_size\": 256, \"sliding_window\": 8,"
                           " \"sliding_window_pattern\": 3}");
    static const int sliding[7] = { 1, 1, 0, 1, 1, 0, 1 };
    for (int i = 0; i < 7; i++)
        ck_assert_int_eq(c.layer_type[i], sliding[i] ? ATTN_SLIDING : ATTN_GLOBAL);
    ck_assert_int_eq(c.sliding_window, 8);
    /* library defaults for what is absent */
    ck_assert(c.query_pre_attn_scalar == 256.0 && c.rope_local_theta == 1e4);
    ck_assert_int_eq(c.bos_id, 2);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 1);
    assert_round_trip(&c);
}
END_TEST

START_TEST(gemma3_no_sliding_layers)
{
    kv_config c = parse_ok("{\"model_type\": \"gemma3_text\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
                           " \"vocab_size\": 256, \"sliding_window\": null,"
                           " \"layer_types\": [\"full_attention\", \"full_attention\"],"
                           " \"final_logit_softcapping\": 30.0}");
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert(c.final_softcap == 30.0);
    assert_all_global(&c);
    assert_round_trip(&c);
}
END_TEST

START_TEST(llama_defaults)
{
    kv_config c = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100}");
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert(c.rms_eps == 1e-6 && c.rope_theta == 10000.0);
    ck_assert(!c.tie_embeddings);
    ck_assert_int_eq(c.max_positions, 2048);
    ck_assert_int_eq(c.bos_id, 1);
    ck_assert_int_eq(c.n_eos, 1);
    ck_assert_int_eq(c.eos_ids[0], 2);
}
END_TEST

START_TEST(qwen2_defaults)
{
    kv_config c = parse_ok("{\"model_type\": \"qwen2\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"num_key_value_heads\": null,"
                           " \"vocab_size\": 100, \"eos_token_id\": null,"
                           " \"layer_types\": [\"full_attention\", \"full_attention\"]}");
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert_int_eq(c.head_dim, 16);
    ck_assert(c.rope_theta == 10000.0 && !c.tie_embeddings && c.qkv_bias);
    ck_assert_int_eq(c.max_positions, 32768);
    ck_assert_int_eq(c.bos_id, -1);
    ck_assert_int_eq(c.n_eos, 0);
    assert_round_trip(&c);
}
END_TEST

START_TEST(conformance_qwen3)
{
    kv_config c = load_ok("tests/data/conformance/qwen3/config.json");
    ck_assert_int_eq(c.arch, ARCH_QWEN3);
    ck_assert(c.hidden == 64 && c.n_layers == 4 && c.n_heads == 4 && c.n_kv_heads == 2);
    ck_assert(c.head_dim == 32 && c.intermediate == 96 && c.vocab == 256);
    ck_assert(c.rms_eps == 1e-6 && c.rope_theta == 1e6 && c.tie_embeddings);
    ck_assert(c.qk_norm && !c.norm_plus_one && !c.qkv_bias && !c.o_bias && !c.sandwich_norms);
    ck_assert(c.attn_scale == 1.0 / sqrt(32.0));
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
    assert_all_global(&c);
    assert_owners_are_self(&c);
}
END_TEST

START_TEST(conformance_llama3_bias)
{
    kv_config c = load_ok("tests/data/conformance/llama3-bias/config.json");
    ck_assert_int_eq(c.arch, ARCH_LLAMA);
    ck_assert(c.hidden == 64 && c.n_layers == 2 && c.head_dim == 16 && c.vocab == 128);
    ck_assert(c.qkv_bias && c.o_bias && !c.qk_norm && c.tie_embeddings);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_LLAMA3);
    ck_assert(c.rope_scaling.factor == 8.0 && c.rope_scaling.low_freq_factor == 1.0);
    ck_assert(c.rope_scaling.high_freq_factor == 4.0);
    ck_assert_int_eq(c.rope_scaling.original_max_position, 64);
    ck_assert(c.rope_theta == 500000.0 && c.rms_eps == 1e-5);
}
END_TEST

/* LlamaAttention with attention_bias: q, k, v and o_proj all biased. */
START_TEST(llama_attention_bias)
{
    kv_config c = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100,"
                           " \"attention_bias\": true, \"mlp_bias\": false}");
    ck_assert(c.qkv_bias && c.o_bias);
    ck_assert(!c.qk_norm && !c.norm_plus_one);
    assert_round_trip(&c);
    c = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 64,"
                 " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                 " \"num_attention_heads\": 4, \"vocab_size\": 100,"
                 " \"attention_bias\": false}");
    ck_assert(!c.qkv_bias && !c.o_bias);
}
END_TEST

/* Qwen3Config's defaults: head_dim 128 whatever hidden/heads is, KV heads
 * = heads, rope_theta 10000, untied, no token ids; q/k norms with plain w,
 * no biases unless attention_bias. */
START_TEST(qwen3_defaults)
{
    kv_config c = parse_ok("{\"model_type\": \"qwen3\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100}");
    ck_assert_int_eq(c.arch, ARCH_QWEN3);
    ck_assert_str_eq(c.model_type, "qwen3");
    ck_assert_int_eq(c.head_dim, 128);
    ck_assert_int_eq(c.n_kv_heads, 4);
    ck_assert(c.rope_theta == 10000.0 && c.rms_eps == 1e-6 && !c.tie_embeddings);
    ck_assert_int_eq(c.max_positions, 32768);
    ck_assert_int_eq(c.bos_id, -1);
    ck_assert_int_eq(c.n_eos, 0);
    ck_assert(c.qk_norm && !c.norm_plus_one && !c.sandwich_norms);
    ck_assert(!c.qkv_bias && !c.o_bias);
    ck_assert_int_eq(c.act, ACT_SILU);
    ck_assert(c.attn_scale == 1.0 / sqrt(128.0));
    ck_assert(c.embed_scale == 1.0f && c.query_pre_attn_scalar == 0.0);
    assert_all_global(&c);
    assert_round_trip(&c);
    /* Qwen3-0.6B's own config.json (trimmed of keys kvdiff ignores). */
    c = parse_ok("{\"architectures\": [\"Qwen3ForCausalLM\"], \"attention_bias\": false,"
                 " \"attention_dropout\": 0.0, \"bos_token_id\": 151643,"
                 " \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
                 " \"hidden_size\": 1024, \"intermediate_size\": 3072,"
                 " \"max_position_embeddings\": 40960, \"max_window_layers\": 28,"
                 " \"model_type\": \"qwen3\", \"num_attention_heads\": 16,"
                 " \"num_hidden_layers\": 28, \"num_key_value_heads\": 8,"
                 " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000,"
                 " \"sliding_window\": null, \"tie_word_embeddings\": true,"
                 " \"torch_dtype\": \"bfloat16\", \"use_cache\": true,"
                 " \"use_sliding_window\": false, \"vocab_size\": 151936}");
    kv_config p;
    kv_err e;
    ck_assert_int_eq(config_preset("qwen3-0.6b-shape", &p, &e), 0);
    assert_same_config(&c, &p);
    /* attention_bias: q, k, v and o_proj, as Qwen3Attention builds them. */
    c = parse_ok("{\"model_type\": \"qwen3\", \"hidden_size\": 64,"
                 " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                 " \"num_attention_heads\": 4, \"vocab_size\": 100, \"head_dim\": 16,"
                 " \"attention_bias\": true}");
    ck_assert(c.qkv_bias && c.o_bias && c.head_dim == 16);
    assert_round_trip(&c);
}
END_TEST

/* openai/gpt-oss-20b's config.json without its quantization_config (a
 * dequantized checkpoint): the preset gpt-oss-20b-shape but for the
 * experts' width, cut there. */
#define GPT_OSS_20B "{\"architectures\": [\"GptOssForCausalLM\"], \"attention_bias\": true," \
    " \"attention_dropout\": 0.0, \"eos_token_id\": 200002, \"experts_per_token\": 4," \
    " \"head_dim\": 64, \"hidden_act\": \"silu\", \"hidden_size\": 2880," \
    " \"initial_context_length\": 4096, \"intermediate_size\": 2880," \
    " \"max_position_embeddings\": 131072, \"model_type\": \"gpt_oss\"," \
    " \"num_attention_heads\": 64, \"num_experts_per_tok\": 4, \"num_hidden_layers\": 24," \
    " \"num_key_value_heads\": 8, \"num_local_experts\": 32, \"output_router_logits\": false," \
    " \"pad_token_id\": 199999, \"rms_norm_eps\": 1e-05, \"rope_scaling\": {\"beta_fast\": 32.0," \
    " \"beta_slow\": 1.0, \"factor\": 32.0, \"original_max_position_embeddings\": 4096," \
    " \"rope_type\": \"yarn\", \"truncate\": false}, \"rope_theta\": 150000," \
    " \"router_aux_loss_coef\": 0.9, \"sliding_window\": 128, \"swiglu_limit\": 7.0," \
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", \"use_cache\": true," \
    " \"vocab_size\": 201088"

START_TEST(gpt_oss_config)
{
    kv_config c = parse_ok(GPT_OSS_20B "}"), p;
    kv_err e;
    ck_assert_int_eq(c.arch, ARCH_GPT_OSS);
    ck_assert(c.attn_sinks && c.qkv_bias && c.o_bias && !c.qk_norm && !c.norm_plus_one);
    ck_assert_int_eq(c.n_experts, 32);
    ck_assert_int_eq(c.n_experts_used, 4);
    ck_assert(c.swiglu_limit == 7.0);
    /* layer_types absent: even layers slide, odd ones are full */
    for (int i = 0; i < c.n_layers; i++)
        ck_assert_int_eq(c.layer_type[i], i % 2 == 0 ? ATTN_SLIDING : ATTN_GLOBAL);
    ck_assert_int_eq(config_layer_window(&c, 0), 128);
    ck_assert_int_eq(config_layer_window(&c, 1), 0);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_YARN);
    ck_assert(!c.rope_scaling.truncate && c.rope_scaling.beta_fast == 32.0);
    ck_assert(fabs(c.rope_scaling.attn_factor - (0.1 * log(32.0) + 1.0)) < 1e-15);
    ck_assert(c.attn_scale == 0.125);
    /* YaRN turns on every layer, sliding ones too, with the same factor */
    ck_assert(config_rope_mscale(&c, true) == config_rope_mscale(&c, false));
    ck_assert_int_eq(config_preset("gpt-oss-20b-shape", &p, &e), 0);
    p.intermediate = c.intermediate;
    assert_same_config(&c, &p);
    assert_round_trip(&c);
    /* The same with the original release's MXFP4 experts: named. */
    static const char mxfp4[] = GPT_OSS_20B ", \"quantization_config\": {\"quant_method\":"
                                " \"mxfp4\"}}";
    ck_assert_int_eq(config_parse_json(mxfp4, strlen(mxfp4), "bad.json", &c, &e), -1);
    ck_assert_msg(strstr(e.msg, "bad.json: quantization_config is an object; kvdiff reads "
                         "gpt-oss with BF16/F16/F32 expert weights"), "%s", e.msg);
}
END_TEST

/* deepseek-ai/DeepSeek-V2-Lite's config.json: the preset
 * deepseek-v2-lite-shape but for the experts' width, cut there. */
#define DEEPSEEK_V2_LITE "{\"architectures\": [\"DeepseekV2ForCausalLM\"]," \
    " \"attention_bias\": false, \"attention_dropout\": 0.0, \"aux_loss_alpha\": 0.001," \
    " \"bos_token_id\": 100000, \"eos_token_id\": 100001, \"first_k_dense_replace\": 1," \
    " \"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02," \
    " \"intermediate_size\": 10944, \"kv_lora_rank\": 512, \"max_position_embeddings\": 163840," \
    " \"model_type\": \"deepseek_v2\", \"moe_intermediate_size\": 1408, \"moe_layer_freq\": 1," \
    " \"n_group\": 1, \"n_routed_experts\": 64, \"n_shared_experts\": 2," \
    " \"norm_topk_prob\": false, \"num_attention_heads\": 16, \"num_experts_per_tok\": 6," \
    " \"num_hidden_layers\": 27, \"num_key_value_heads\": 16, \"pretraining_tp\": 1," \
    " \"q_lora_rank\": null, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64," \
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1," \
    " \"factor\": 40, \"mscale\": 0.707, \"mscale_all_dim\": 0.707," \
    " \"original_max_position_embeddings\": 4096, \"type\": \"yarn\"}, \"rope_theta\": 10000," \
    " \"routed_scaling_factor\": 1.0, \"scoring_func\": \"softmax\", \"seq_aux\": true," \
    " \"tie_word_embeddings\": false, \"topk_group\": 1, \"topk_method\": \"greedy\"," \
    " \"torch_dtype\": \"bfloat16\", \"use_cache\": true, \"v_head_dim\": 128," \
    " \"vocab_size\": 102400"

START_TEST(deepseek_v2_config)
{
    kv_config c = parse_ok(DEEPSEEK_V2_LITE "}"), p;
    kv_err e;
    ck_assert_int_eq(c.arch, ARCH_DEEPSEEK2);
    ck_assert(config_mla(&c) && c.kv_lora_rank == 512 && c.q_lora_rank == 0);
    ck_assert(c.head_dim == 192 && c.qk_rope_dim == 64 && c.v_head_dim == 128);
    ck_assert(c.n_kv_heads == 16 && !c.qkv_bias && !c.o_bias && !c.norm_plus_one);
    ck_assert_int_eq(config_mla_row(&c), 576);
    ck_assert_int_eq(config_layer_v_head_dim(&c, 3), 128);
    ck_assert(c.n_experts == 64 && c.n_experts_used == 6 && c.n_shared_experts == 2);
    ck_assert(c.route == ROUTE_SOFTMAX && c.n_group == 0 && !c.norm_topk && c.routed_scale == 1.0);
    /* the first layer dense, the others experts of 1408 and a shared MLP of 2816 */
    ck_assert(!config_layer_moe(&c, 0) && config_layer_moe(&c, 1) && config_layer_moe(&c, 26));
    ck_assert_int_eq(config_layer_intermediate(&c, 0), 10944);
    ck_assert_int_eq(config_layer_intermediate(&c, 1), 1408);
    ck_assert_int_eq(config_layer_dense_width(&c, 1), 2816);
    ck_assert(config_layer_has_stage(&c, 0, STAGE_KV_LATENT));
    ck_assert(!config_layer_has_stage(&c, 0, STAGE_ROUTER_LOGITS));
    /* YaRN: cos and sin unscaled (mscale = mscale_all_dim), q.k times m^2 */
    const double m = 0.1 * 0.707 * log(40.0) + 1.0;
    ck_assert(c.rope_scaling.type == ROPE_SCALE_YARN && c.rope_scaling.attn_factor == 1.0);
    ck_assert(fabs(c.attn_scale - m * m / sqrt(192.0)) < 1e-15);
    ck_assert_int_eq(config_preset("deepseek-v2-lite-shape", &p, &e), 0);
    p.moe_intermediate = c.moe_intermediate;
    assert_same_config(&c, &p);
    assert_round_trip(&c);
    /* What kvdiff does not run is named, file and key. */
#define DS_BASE "{\"model_type\": \"deepseek_v2\", \"hidden_size\": 64," \
    " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4," \
    " \"vocab_size\": 256, \"kv_lora_rank\": 32, \"q_lora_rank\": null," \
    " \"qk_nope_head_dim\": 16, \"n_routed_experts\": 8, \"num_experts_per_tok\": 2"
    static const struct { const char *text, *msg; } bad[] = {
        {DS_BASE ", \"attention_bias\": true}", "bad.json: attention_bias is true"},
        {DS_BASE ", \"topk_method\": \"noaux_tc\"}", "bad.json: topk_method 'noaux_tc'"},
        {DS_BASE ", \"qk_rope_head_dim\": 8, \"v_head_dim\": 32}", "v_head_dim 32 out of 1..24"},
        {DS_BASE ", \"num_key_value_heads\": 1}", "bad.json: num_key_value_heads is 1"},
        {DS_BASE ", \"qk_rope_head_dim\": 7}", "bad.json: qk_rope_head_dim is 7"},
        {DS_BASE ", \"topk_method\": \"group_limited_greedy\", \"n_group\": 3}",
         "bad.json: n_group is 3, which does not divide n_routed_experts 8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_int_eq(config_parse_json(bad[i].text, strlen(bad[i].text), "bad.json", &c, &e),
                         -1);
        ck_assert_msg(strstr(e.msg, bad[i].msg), "%s", e.msg);
    }
}
END_TEST

/* DeepSeek-V3's parts on a small config: a q LoRA, sigmoid routing with
 * groups and a correction bias, the interleaved RoPE it must say. */
START_TEST(deepseek_v3_config)
{
    static const char v3[] = "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64,"
        " \"intermediate_size\": 96, \"num_hidden_layers\": 4, \"num_attention_heads\": 4,"
        " \"vocab_size\": 256, \"kv_lora_rank\": 64, \"q_lora_rank\": 24,"
        " \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 32, \"v_head_dim\": 16,"
        " \"n_routed_experts\": 8, \"num_experts_per_tok\": 3, \"moe_intermediate_size\": 32,"
        " \"n_shared_experts\": 1, \"first_k_dense_replace\": 1, \"n_group\": 4,"
        " \"topk_group\": 2, \"norm_topk_prob\": true, \"routed_scaling_factor\": 2.5,"
        " \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-6, \"bos_token_id\": 0,"
        " \"eos_token_id\": 1, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 8,"
        " \"original_max_position_embeddings\": 64, \"mscale\": 1.0, \"mscale_all_dim\": 1.0,"
        " \"beta_fast\": 32, \"beta_slow\": 1}}";
    kv_config c = parse_ok(v3), p;
    kv_err e;
    ck_assert_int_eq(c.arch, ARCH_DEEPSEEK3);
    ck_assert(c.q_lora_rank == 24 && c.route == ROUTE_SIGMOID && c.n_group == 4 &&
              c.topk_group == 2 && c.norm_topk && c.routed_scale == 2.5);
    ck_assert_int_eq(config_preset("tiny-deepseek-v3", &p, &e), 0);
    assert_same_config(&c, &p);
    assert_round_trip(&c);
    static const char no_interleave[] = "{\"model_type\": \"deepseek_v3\", \"hidden_size\": 64,"
        " \"intermediate_size\": 96, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
        " \"vocab_size\": 256, \"n_routed_experts\": null, \"rope_interleave\": false}";
    ck_assert_int_eq(config_parse_json(no_interleave, strlen(no_interleave), "bad.json", &c, &e), -1);
    ck_assert_msg(strstr(e.msg, "bad.json: rope_interleave is false"), "%s", e.msg);
}
END_TEST

START_TEST(llama3_rope_scaling)
{
    kv_config c = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                           " \"vocab_size\": 300, \"rope_theta\": 500000.0,"
                           " \"eos_token_id\": [7, 9, 11], \"bos_token_id\": null,"
                           " \"rope_scaling\": {\"factor\": 32.0, \"high_freq_factor\": 4.0,"
                           " \"low_freq_factor\": 1.0, \"original_max_position_embeddings\": 8192,"
                           " \"rope_type\": \"llama3\"}}");
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_LLAMA3);
    ck_assert(c.rope_scaling.factor == 32.0);
    ck_assert(c.rope_scaling.low_freq_factor == 1.0);
    ck_assert(c.rope_scaling.high_freq_factor == 4.0);
    ck_assert_int_eq(c.rope_scaling.original_max_position, 8192);
    ck_assert_int_eq(c.bos_id, -1);
    ck_assert_int_eq(c.n_eos, 3);
    ck_assert_int_eq(c.eos_ids[2], 11);
    assert_round_trip(&c);
}
END_TEST

START_TEST(rope_type_synonyms)
{
    /* the old key "type", alone or agreeing with rope_type */
    kv_config c = parse_ok("{\"model_type\": \"qwen2\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100,"
                           " \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}}");
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_LINEAR);
    ck_assert(c.rope_scaling.factor == 2.0);
    c = parse_ok("{\"model_type\": \"qwen2\", \"hidden_size\": 64,"
                 " \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                 " \"num_attention_heads\": 4, \"vocab_size\": 100,"
                 " \"rope_scaling\": {\"type\": \"default\", \"rope_type\": \"default\"}}");
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
}
END_TEST

/* transformers 5 writes rope_parameters instead of rope_theta/rope_scaling. */
START_TEST(rope_parameters_v5)
{
    kv_config c = parse_ok("{\"model_type\": \"llama\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100,"
                           " \"rope_parameters\": {\"rope_type\": \"default\","
                           " \"rope_theta\": 500000.0}}");
    ck_assert(c.rope_theta == 500000.0 && c.rope_local_theta == 500000.0);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_NONE);
    c = parse_ok("{\"model_type\": \"gemma3_text\", \"hidden_size\": 64,"
                 " \"intermediate_size\": 96, \"num_hidden_layers\": 6,"
                 " \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
                 " \"vocab_size\": 100, \"rope_parameters\": {"
                 " \"full_attention\": {\"rope_type\": \"linear\", \"factor\": 8.0,"
                 "   \"rope_theta\": 2000000.0},"
                 " \"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": 20000.0}}}");
    ck_assert(c.rope_theta == 2e6 && c.rope_local_theta == 2e4);
    ck_assert_int_eq(c.rope_scaling.type, ROPE_SCALE_LINEAR);
    ck_assert(c.rope_scaling.factor == 8.0);
}
END_TEST

START_TEST(parse_unterminated_buffer)
{
    static const char json[] = "{\"model_type\": \"llama\", \"hidden_size\": 64,"
                               " \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                               " \"num_attention_heads\": 4, \"vocab_size\": 100}";
    size_t n = sizeof json - 1;
    char *copy = malloc(n);  /* no terminating NUL: ASan catches an over-read */
    kv_config c;
    kv_err e;
    ck_assert_ptr_nonnull(copy);
    memcpy(copy, json, n);
    ck_assert_msg(config_parse_json(copy, n, "buf", &c, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(c.hidden, 64);
    free(copy);
}
END_TEST

/* ---- Gemma 4 ------------------------------------------------------------- */

/* google/gemma-4-E2B's text config (as transformers writes it), nested in
 * a Gemma4ForConditionalGeneration config: every field resolves. */
START_TEST(gemma4_e2b_config)
{
    char json[4096], types[2048] = "";
    for (int i = 0; i < 35; i++)
        snprintf(types + strlen(types), sizeof types - strlen(types), "%s\"%s\"", i ? ", " : "",
                 (i + 1) % 5 ? "sliding_attention" : "full_attention");
    snprintf(json, sizeof json,
             "{\"model_type\": \"gemma4\", \"text_config\": {\"model_type\": \"gemma4_text\", "
             "\"hidden_size\": 1536, \"intermediate_size\": 6144, \"num_hidden_layers\": 35, "
             "\"num_attention_heads\": 8, \"num_key_value_heads\": 1, "
             "\"num_global_key_value_heads\": null, \"head_dim\": 256, \"global_head_dim\": 512, "
             "\"vocab_size\": 262144, \"vocab_size_per_layer_input\": 262144, "
             "\"hidden_size_per_layer_input\": 256, \"num_kv_shared_layers\": 20, "
             "\"use_double_wide_mlp\": true, \"attention_k_eq_v\": false, "
             "\"enable_moe_block\": false, \"num_experts\": null, "
             "\"final_logit_softcapping\": 30.0, \"sliding_window\": 512, "
             "\"use_bidirectional_attention\": null, \"layer_types\": [%s], "
             "\"rope_parameters\": {\"full_attention\": {\"partial_rotary_factor\": 0.25, "
             "\"rope_theta\": 1000000.0, \"rope_type\": \"proportional\"}, "
             "\"sliding_attention\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}}, "
             "\"hidden_activation\": \"gelu_pytorch_tanh\", \"rms_norm_eps\": 1e-06, "
             "\"tie_word_embeddings\": true}}", types);
    kv_config c = parse_ok(json);
    ck_assert_int_eq(c.arch, ARCH_GEMMA4);
    ck_assert_str_eq(c.tensor_prefix, "model.language_model.");
    ck_assert_int_eq(config_layer_head_dim(&c, 0), 256);
    ck_assert_int_eq(config_layer_head_dim(&c, 4), 512);
    ck_assert_int_eq(config_layer_kv_heads(&c, 4), 1);
    ck_assert_int_eq(config_layer_rope_pairs(&c, 4), 64);     /* 0.25 x 256 pairs */
    ck_assert_int_eq(config_layer_rope_pairs(&c, 3), 128);
    ck_assert_int_eq(config_layer_intermediate(&c, 14), 6144);
    ck_assert_int_eq(config_layer_intermediate(&c, 15), 12288);
    /* Shared layers read the last non-shared layer of their type: 13
     * (sliding) and 14 (full), llama.cpp's n_layer_kv_from_start - 2 / - 1. */
    ck_assert_int_eq(c.kv_owner[15], 13);
    ck_assert_int_eq(c.kv_owner[19], 14);
    ck_assert_int_eq(c.kv_owner[34], 14);
    ck_assert(config_layer_has_v_proj(&c, 4));
    ck_assert_int_eq(c.per_layer_dim, 256);
    ck_assert(c.attn_scale == 1.0);
    ck_assert(c.final_softcap == 30.0);
    ck_assert(!c.norm_plus_one && c.v_norm && c.layer_scalar);
    ck_assert_int_eq(c.sliding_window, 512);
    /* config.json is written flat (gemma4_text): the prefix is the flat one. */
    memset(c.tensor_prefix, 0, sizeof c.tensor_prefix);
    memset(c.lm_head_name, 0, sizeof c.lm_head_name);
    snprintf(c.tensor_prefix, sizeof c.tensor_prefix, "model.");
    snprintf(c.lm_head_name, sizeof c.lm_head_name, "lm_head.weight");
    assert_round_trip(&c);
}
END_TEST

/* per_layer_config in place of global_head_dim (the converter reads both). */
START_TEST(gemma4_per_layer_config)
{
    kv_config c = parse_ok("{" G4_BASE ", \"per_layer_config\": {\"1\": {\"head_dim\": 64, "
                           "\"num_key_value_heads\": 1}}, \"attention_k_eq_v\": true}");
    ck_assert_int_eq(config_layer_head_dim(&c, 1), 64);
    ck_assert_int_eq(config_layer_kv_heads(&c, 1), 1);
    ck_assert_int_eq(config_layer_head_dim(&c, 0), 256);
    ck_assert(!config_layer_has_v_proj(&c, 1));
    ck_assert(config_layer_has_v_proj(&c, 0));
    ck_assert(c.rope_partial_full == 0.25);   /* Gemma4TextConfig's default */
}
END_TEST

/* ---- presets ------------------------------------------------------------ */

START_TEST(presets_validate_and_round_trip)
{
    int n = 0;
    for (const char *const *name = config_preset_names(); *name; name++, n++) {
        kv_config c;
        kv_err e;
        memset(&c, 0x55, sizeof c);  /* presets must not depend on the caller's bytes */
        ck_assert_msg(config_preset(*name, &c, &e) == 0, "%s: %s", *name, e.msg);
        ck_assert_msg(config_validate(&c, &e) == 0, "%s: %s", *name, e.msg);
        assert_round_trip(&c);
    }
    ck_assert_int_eq(n, 17);
}
END_TEST

START_TEST(preset_values)
{
    kv_config c;
    kv_err e;
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    ck_assert(c.arch == ARCH_LLAMA && c.hidden == 64 && c.n_layers == 4 && c.head_dim == 16);
    ck_assert(c.rope_theta == 500000.0 && c.rms_eps == 1e-5 && !c.tie_embeddings);
    ck_assert(c.bos_id == 1 && c.n_eos == 1 && c.eos_ids[0] == 2);
    ck_assert(!c.qkv_bias && !c.o_bias && c.rope_scaling.type == ROPE_SCALE_NONE);
    ck_assert_int_eq(config_preset("tiny-llama3", &c, &e), 0);
    ck_assert(c.arch == ARCH_LLAMA && c.head_dim == 16 && c.tie_embeddings);
    ck_assert(c.rope_scaling.type == ROPE_SCALE_LLAMA3 && c.rope_scaling.factor == 32.0);
    ck_assert(c.rope_scaling.low_freq_factor == 1.0 && c.rope_scaling.high_freq_factor == 4.0);
    ck_assert_int_eq(c.rope_scaling.original_max_position, 64);
    ck_assert_int_eq(config_preset("tiny-qwen2", &c, &e), 0);
    ck_assert(c.qkv_bias && !c.o_bias && c.tie_embeddings && c.rope_theta == 1e6);
    ck_assert_int_eq(config_preset("tiny-qwen3", &c, &e), 0);
    ck_assert(c.arch == ARCH_QWEN3 && c.qk_norm && !c.norm_plus_one && !c.qkv_bias);
    ck_assert(c.head_dim == 32 && c.hidden / c.n_heads == 16 && c.tie_embeddings);
    ck_assert(c.attn_scale == 1.0 / sqrt(32.0));
    ck_assert_int_eq(config_preset("qwen3-0.6b-shape", &c, &e), 0);
    ck_assert(c.hidden == 1024 && c.n_layers == 28 && c.n_heads == 16 && c.n_kv_heads == 8);
    ck_assert(c.head_dim == 128 && c.intermediate == 3072 && c.vocab == 151936);
    ck_assert(c.max_positions == 40960 && c.bos_id == 151643 && c.eos_ids[0] == 151645);
    ck_assert_int_eq(config_preset("tiny-gemma3", &c, &e), 0);
    ck_assert(c.head_dim == 32 && c.sliding_window == 12 && c.query_pre_attn_scalar == 24.0);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(c.layer_type[i], i < 5 ? ATTN_SLIDING : ATTN_GLOBAL);
    ck_assert_int_eq(config_preset("qwen2.5-0.5b-shape", &c, &e), 0);
    ck_assert(c.hidden == 896 && c.n_layers == 24 && c.n_heads == 14 && c.n_kv_heads == 2);
    ck_assert(c.head_dim == 64 && c.intermediate == 4864 && c.vocab == 151936);
    ck_assert_int_eq(config_preset("gemma3-1b-shape", &c, &e), 0);
    ck_assert(c.hidden == 1152 && c.n_layers == 26 && c.n_heads == 4 && c.n_kv_heads == 1);
    ck_assert(c.head_dim == 256 && c.intermediate == 6912 && c.vocab == 262144);
    ck_assert(c.sliding_window == 512 && c.n_eos == 2 && c.eos_ids[1] == 106);
    ck_assert_int_eq(config_preset("tiny-mistral", &c, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "tiny-mistral"));
}
END_TEST

START_TEST(kvshared_owners)
{
    static const int owner[12] = { 0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 5 };
    kv_config c;
    kv_err e;
    ck_assert_int_eq(config_preset("tiny-gemma3-kvshared", &c, &e), 0);
    ck_assert_int_eq(c.n_layers, 12);
    for (int i = 0; i < 12; i++) {
        ck_assert_int_eq(c.layer_type[i], (i + 1) % 6 ? ATTN_SLIDING : ATTN_GLOBAL);
        ck_assert_int_eq(c.kv_owner[i], owner[i]);
    }
    /* the same from config.json */
    kv_config p = parse_ok("{\"model_type\": \"gemma3_text\", \"hidden_size\": 64,"
                           " \"intermediate_size\": 128, \"num_hidden_layers\": 12,"
                           " \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                           " \"head_dim\": 32, \"vocab_size\": 256, \"sliding_window\": 12,"
                           " \"num_kv_shared_layers\": 4}");
    for (int i = 0; i < 12; i++)
        ck_assert_int_eq(p.kv_owner[i], owner[i]);
}
END_TEST

START_TEST(describe_line)
{
    kv_config c;
    kv_err e;
    char buf[200];
    ck_assert_int_eq(config_preset("tiny-gemma3", &c, &e), 0);
    config_describe(&c, buf, sizeof buf);
    ck_assert_str_eq(buf, "gemma3_text: 6 layers (5 sliding W=12, 1 global), "
                          "E=64 H=4/KV=2 D=32 I=128 V=256");
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    config_describe(&c, buf, sizeof buf);
    ck_assert_str_eq(buf, "llama: 4 layers (4 global), E=64 H=4/KV=2 D=16 I=128 V=256");
    ck_assert_int_eq(config_preset("tiny-gemma3-kvshared", &c, &e), 0);
    config_describe(&c, buf, sizeof buf);
    ck_assert_ptr_nonnull(strstr(buf, "(10 sliding W=12, 2 global, 4 KV-shared)"));
    ck_assert_int_eq(config_preset("tiny-qwen3", &c, &e), 0);
    c.qkv_bias = c.o_bias = true;
    config_describe(&c, buf, sizeof buf);
    ck_assert_str_eq(buf, "qwen3: 4 layers (4 global), E=64 H=4/KV=2 D=32 I=128 V=256 "
                          "attention_bias");
    ck_assert_int_eq(config_preset("tiny-gemma3-kvshared", &c, &e), 0);
    config_describe(&c, buf, 8);
    ck_assert_str_eq(buf, "gemma3_");
}
END_TEST

/* ---- validation of hand-made structs ------------------------------------ */

START_TEST(validate_rejects)
{
    kv_config base, c;
    kv_err e;
    ck_assert_int_eq(config_preset("tiny-gemma3-kvshared", &base, &e), 0);
    c = base; c.n_kv_heads = 3;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "n_kv_heads"));
    c = base; c.kv_owner[3] = 4;          /* a later layer */
    ck_assert_int_eq(config_validate(&c, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "kv_owner[3]"));
    c = base; c.kv_owner[11] = 7;         /* global layer reading a sliding one */
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.kv_owner[10] = 9;         /* 9 does not own its cache */
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.attn_scale = 1.0 / sqrt(32.0);
    ck_assert_int_eq(config_validate(&c, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "attn_scale"));
    c = base; c.embed_scale = 1.0f;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.sliding_window = 0;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    /* Biases: Llama and Qwen3 bias all four projections or none; Qwen2
     * q/k/v only; Gemma none. Qwen3 has its q/k norms, with plain w. */
    static const struct { const char *preset; bool qkv, o; } biases[] = {
        {"tiny-llama", true, false}, {"tiny-llama", false, true}, {"tiny-qwen3", true, false},
        {"tiny-qwen2", true, true}, {"tiny-qwen2", false, false}, {"tiny-gemma3", true, true},
    };
    for (size_t i = 0; i < sizeof biases / sizeof *biases; i++) {
        ck_assert_int_eq(config_preset(biases[i].preset, &c, &e), 0);
        c.qkv_bias = biases[i].qkv;
        c.o_bias = biases[i].o;
        ck_assert_msg(config_validate(&c, &e) == -1, "%s qkv %d o %d accepted",
                      biases[i].preset, biases[i].qkv, biases[i].o);
        ck_assert_ptr_nonnull(strstr(e.msg, "o_bias"));
    }
    ck_assert_int_eq(config_preset("tiny-qwen3", &c, &e), 0);
    c.qkv_bias = c.o_bias = true;
    ck_assert_msg(config_validate(&c, &e) == 0, "%s", e.msg);
    c.qk_norm = false;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    ck_assert_int_eq(config_preset("tiny-qwen3", &c, &e), 0);
    c.norm_plus_one = true;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.head_dim = 31;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.eos_ids[0] = 256;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.qkv_bias = true;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.n_layers = KV_MAX_LAYERS + 1;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    c = base; c.rope_scaling.type = ROPE_SCALE_LLAMA3; c.rope_scaling.factor = 8;
    c.rope_scaling.low_freq_factor = 4; c.rope_scaling.high_freq_factor = 1;
    c.rope_scaling.original_max_position = 8192;
    ck_assert_int_eq(config_validate(&c, &e), -1);
    ck_assert_int_eq(config_validate(NULL, &e), -1);
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    c.layer_type[1] = ATTN_SLIDING;
    c.sliding_window = 4;
    ck_assert_int_eq(config_validate(&c, &e), -1);
}
END_TEST

/* ---- writing errors ----------------------------------------------------- */

START_TEST(write_unwritable_path)
{
    kv_config c;
    kv_err e;
    const char *path = "/nonexistent-kvdiff-dir/sub/config.json";
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    ck_assert_int_eq(config_write_json(&c, path, &e), -1);
    ck_assert_msg(strncmp(e.msg, path, strlen(path)) == 0, "%s", e.msg);
}
END_TEST

START_TEST(write_refuses_inexpressible_owners)
{
    char dir[64], path[128];
    kv_config c;
    kv_err e;
    make_tmpdir(dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ck_assert_int_eq(config_preset("tiny-gemma3-kvshared", &c, &e), 0);
    c.kv_owner[9] = 6;  /* valid for an engine, but not the num_kv_shared_layers rule */
    ck_assert_int_eq(config_validate(&c, &e), 0);
    ck_assert_int_eq(config_write_json(&c, path, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, path));
    ck_assert_ptr_nonnull(strstr(e.msg, "kv_owner[9]"));
    ck_assert_int_eq(access(path, F_OK), -1);
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    ck_assert_int_eq(config_write_json(&c, NULL, &e), -1);
    remove_tmpdir(dir);
}
END_TEST

START_TEST(load_errors_name_the_path)
{
    char dir[64], path[128];
    kv_config c;
    kv_err e;
    make_tmpdir(dir);
    snprintf(path, sizeof path, "%s/config.json", dir);
    ck_assert_int_eq(config_load_json(path, &c, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, path));
    write_file(path, "{\"model_type\": \"llama\", \"hidden_size\": -5}");
    ck_assert_int_eq(config_load_json(path, &c, &e), -1);
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "hidden_size"), "%s", e.msg);
    ck_assert_int_eq(config_load_json(dir, &c, &e), -1);   /* a folder */
    ck_assert_ptr_nonnull(strstr(e.msg, dir));
    remove_tmpdir(dir);
}
END_TEST

/* ---- bad input ---------------------------------------------------------- */

#define LLAMA_HEAD "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96," \
                   " \"num_hidden_layers\": 4, \"num_attention_heads\": 4, \"vocab_size\": 256"
#define QWEN2_HEAD "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 96," \
                   " \"num_hidden_layers\": 4, \"num_attention_heads\": 4, \"vocab_size\": 256"
#define QWEN3_HEAD "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96," \
                   " \"num_hidden_layers\": 4, \"num_attention_heads\": 4, \"vocab_size\": 256"
#define GPT_OSS_HEAD "{\"model_type\": \"gpt_oss\", \"hidden_size\": 64," \
                     " \"intermediate_size\": 32, \"num_hidden_layers\": 2," \
                     " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256"
#define GEMMA_HEAD "{\"model_type\": \"gemma3_text\", \"hidden_size\": 64," \
                   " \"intermediate_size\": 96, \"num_hidden_layers\": 6," \
                   " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256"

typedef struct {
    const char *json;
    const char *expect;   /* must appear in the message, after "bad.json: " */
} bad_case;

static const bad_case BAD[] = {
    { "this is not json", "not valid JSON" },
    { "[1, 2, 3]", "top level is an array" },
    { "{\"hidden_size\": 64}", "model_type is missing" },
    { "{\"model_type\": 5}", "model_type is 5; expected a string" },
    { "{\"model_type\": \"mistral\", \"hidden_size\": 64}",
      "model_type 'mistral' is not supported (kvdiff reads llama, qwen2, gemma3_text, "
      "gemma3, qwen3, gemma4_text, gemma4, gpt_oss, deepseek_v2, deepseek_v3)" },
    { "{" G4_BASE ", \"enable_moe_block\": true}",
      "enable_moe_block is true; Gemma 4's mixture-of-experts block is not supported" },
    { "{" G4_BASE ", \"num_experts\": 128}",
      "num_experts is 128; Gemma 4's mixture-of-experts models are not supported" },
    { "{" G4_BASE ", \"num_kv_shared_layers\": 3}",
      "num_kv_shared_layers is 3 but the model has 2 layers" },
    { "{" G4_BASE ", \"global_head_dim\": 33}",
      "global_head_dim is 33; RoPE needs an even head size" },
    { "{" G4_BASE ", \"num_global_key_value_heads\": 3}",
      "num_global_key_value_heads is 3, which does not divide num_attention_heads 4" },
    { "{" G4_BASE ", \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"longrope\"}}}",
      "rope_parameters.full_attention rope_type 'longrope' is not supported" },
    /* the key at fault named: a missing rope_type said missing (not
     * "default"); the sliding entry's rope_type, not "linear and llama3" */
    { "{" G4_BASE ", \"rope_parameters\": {\"full_attention\": {\"partial_rotary_factor\": "
      "0.25}}}", "rope_parameters.full_attention.partial_rotary_factor is 0.25 but "
      "rope_parameters.full_attention has no rope_type (read as default)" },
    { "{" G4_BASE ", \"rope_parameters\": {\"sliding_attention\": {\"rope_type\": "
      "\"proportional\"}}}", "rope_parameters.sliding_attention.rope_type is 'proportional'; "
      "sliding layers rotate whole heads" },
    { "{\"model_type\": \"gemma4_text\", \"hidden_size\": 64, \"intermediate_size\": 96, "
      "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
      "\"vocab_size\": 256}", "layer_types is missing" },
    { "{\"model_type\": \"gemma4\", \"text_config\": {\"model_type\": \"gemma3_text\"}}",
      "text_config.model_type is the string \"gemma3_text\"; expected \"gemma4_text\"" },
    { "{\"model_type\": \"llama\", \"intermediate_size\": 96, \"num_hidden_layers\": 4,"
      " \"num_attention_heads\": 4, \"vocab_size\": 256}", "hidden_size is missing" },
    { "{\"model_type\": \"llama\", \"hidden_size\": -5}", "hidden_size is -5; expected 1..1048576" },
    { "{\"model_type\": \"llama\", \"hidden_size\": \"64\"}",
      "hidden_size is the string \"64\"; expected an integer" },
    { "{\"model_type\": \"llama\", \"hidden_size\": 64.5}", "hidden_size is 64.5" },
    { "{\"model_type\": \"llama\", \"hidden_size\": 2000000}", "hidden_size is 2000000" },
    { LLAMA_HEAD ", \"num_key_value_heads\": 3}",
      "num_key_value_heads is 3, which does not divide num_attention_heads 4" },
    { "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 100000}",
      "num_hidden_layers is 100000; expected 1..256" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"longrope\", \"factor\": 4.0}}",
      "rope_scaling type 'longrope' is not supported" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}}",
      "rope_scaling type 'dynamic' is not supported" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"longrope\"}}",
      "rope_scaling type 'longrope' is not supported" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"linear\"}}", "rope_scaling.factor is missing" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"factor\": 2.0}}", "rope_scaling has no rope_type" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"linear\", \"type\": \"yarn\", \"factor\": 2}}",
      "rope_scaling has rope_type 'linear' and type 'yarn'" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0,"
      " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
      "rope_scaling.low_freq_factor is missing" },
    { LLAMA_HEAD ", \"rope_scaling\": 8}", "rope_scaling is 8; expected an object or null" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": 3}}", "rope_scaling.rope_type is 3" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2},"
      " \"rope_parameters\": {\"rope_type\": \"default\"}}", "rope_scaling and rope_parameters" },
    { LLAMA_HEAD ", \"rope_parameters\": {\"full_attention\": {\"rope_type\": \"default\"}}}",
      "rope_parameters is keyed by layer type" },
    { LLAMA_HEAD ", \"partial_rotary_factor\": 0.5}", "partial_rotary_factor is 0.5" },
    { LLAMA_HEAD ", \"rope_theta\": -1}", "rope_theta is -1" },
    { LLAMA_HEAD ", \"rms_norm_eps\": 0}", "rms_norm_eps is 0" },
    { LLAMA_HEAD ", \"attention_bias\": \"yes\"}", "attention_bias is the string \"yes\"" },
    { LLAMA_HEAD ", \"attention_bias\": 1}", "attention_bias is 1; expected true or false" },
    { LLAMA_HEAD ", \"mlp_bias\": true}", "mlp_bias is true" },
    { LLAMA_HEAD ", \"hidden_act\": \"gelu\"}", "hidden_act 'gelu' is not supported for llama" },
    { LLAMA_HEAD ", \"tie_word_embeddings\": \"yes\"}", "tie_word_embeddings is the string" },
    { LLAMA_HEAD ", \"head_dim\": 15}", "head_dim is 15; RoPE needs an even head_dim" },
    { "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96,"
      " \"num_hidden_layers\": 4, \"num_attention_heads\": 3, \"vocab_size\": 256}",
      "head_dim is missing and hidden_size 64 is not a multiple of num_attention_heads 3" },
    { LLAMA_HEAD ", \"bos_token_id\": 256}", "bos_token_id is 256; expected 0..255" },
    { LLAMA_HEAD ", \"eos_token_id\": [1, \"2\"]}", "eos_token_id[1] is the string \"2\"" },
    { LLAMA_HEAD ", \"eos_token_id\": [1, 2.5]}", "eos_token_id[1] is 2.5" },
    { LLAMA_HEAD ", \"eos_token_id\": \"</s>\"}", "eos_token_id is the string" },
    { LLAMA_HEAD ", \"eos_token_id\": [1,2,3,4,5,6,7,8,9]}", "eos_token_id lists 9 ids" },
    { LLAMA_HEAD ", \"num_kv_shared_layers\": 2}", "num_kv_shared_layers is 2; KV sharing" },
    { LLAMA_HEAD ", \"hidden_size\": 32}", "not valid JSON: duplicate object key" },
    { QWEN2_HEAD ", \"use_sliding_window\": true}", "use_sliding_window is true" },
    { QWEN3_HEAD ", \"use_sliding_window\": true}",
      "use_sliding_window is true; sliding-window attention is not supported for qwen3" },
    { QWEN3_HEAD ", \"layer_types\": [\"full_attention\", \"full_attention\","
      " \"sliding_attention\", \"full_attention\"]}", "layer_types[2] is 'sliding_attention'" },
    { QWEN3_HEAD ", \"head_dim\": null}", "head_dim is null" },
    { QWEN3_HEAD ", \"head_dim\": 31}", "head_dim is 31; RoPE needs an even head_dim" },
    { QWEN3_HEAD ", \"attention_bias\": null}", "attention_bias is null; expected true or false" },
    { QWEN3_HEAD ", \"hidden_act\": \"gelu_pytorch_tanh\"}",
      "hidden_act 'gelu_pytorch_tanh' is not supported for qwen3" },
    { QWEN3_HEAD ", \"num_kv_shared_layers\": 1}", "num_kv_shared_layers is 1; KV sharing" },
    { "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96,"
      " \"num_hidden_layers\": 4, \"vocab_size\": 256}", "num_attention_heads is missing" },
    { "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"intermediate_size\": 96,"
      " \"num_hidden_layers\": 4, \"num_attention_heads\": 4}", "vocab_size is missing" },
    { QWEN2_HEAD ", \"layer_types\": [\"full_attention\", \"sliding_attention\","
      " \"full_attention\", \"full_attention\"]}", "layer_types[1] is 'sliding_attention'" },
    { GEMMA_HEAD ", \"layer_types\": [\"sliding_attention\", \"full_attention\"]}",
      "layer_types has 2 entries but num_hidden_layers is 6" },
    { GEMMA_HEAD ", \"layer_types\": [\"sliding_attention\", \"chunked_attention\","
      " \"full_attention\", \"sliding_attention\", \"sliding_attention\", \"full_attention\"]}",
      "layer_types[1] is the string \"chunked_attention\"; expected 'sliding_attention' or "
      "'full_attention'" },
    { GEMMA_HEAD ", \"layer_types\": \"sliding\"}", "layer_types is the string" },
    { GEMMA_HEAD ", \"num_kv_shared_layers\": 6}", "num_kv_shared_layers is 6 but the model has 6" },
    { GEMMA_HEAD ", \"num_kv_shared_layers\": -1}", "num_kv_shared_layers is -1" },
    { GEMMA_HEAD ", \"layer_types\": [\"full_attention\", \"sliding_attention\","
      " \"sliding_attention\", \"sliding_attention\", \"sliding_attention\", \"sliding_attention\"],"
      " \"num_kv_shared_layers\": 5}",
      "num_kv_shared_layers is 5: layer 1 (sliding_attention) has no earlier non-shared" },
    { GEMMA_HEAD ", \"sliding_window\": null}", "sliding_window is null but layer 0" },
    { GEMMA_HEAD ", \"sliding_window\": 0}", "sliding_window is 0" },
    { GEMMA_HEAD ", \"sliding_window_pattern\": 0}", "sliding_window_pattern is 0" },
    { GEMMA_HEAD ", \"attn_logit_softcapping\": 50.0}", "attn_logit_softcapping is 50" },
    { GEMMA_HEAD ", \"final_logit_softcapping\": 0}", "final_logit_softcapping is 0" },
    { GEMMA_HEAD ", \"hidden_activation\": \"gelu\"}", "hidden_activation 'gelu' is not supported" },
    { GEMMA_HEAD ", \"query_pre_attn_scalar\": 0}", "query_pre_attn_scalar is 0" },
    { GEMMA_HEAD ", \"head_dim\": null}", "head_dim is null" },
    { GEMMA_HEAD ", \"attention_bias\": true}", "attention_bias is true" },
    { GEMMA_HEAD ", \"use_bidirectional_attention\": true}", "use_bidirectional_attention is true" },
    { GEMMA_HEAD ", \"rope_parameters\": {\"rope_type\": \"default\"}}",
      "rope_parameters has neither full_attention nor sliding_attention" },
    { GEMMA_HEAD ", \"rope_parameters\": {\"sliding_attention\": {\"rope_type\": \"linear\","
      " \"factor\": 2}}}", "rope_parameters.sliding_attention is scaled" },
    { "{\"model_type\": \"gemma3\"}", "text_config is missing" },
    { "{\"model_type\": \"gemma3\", \"text_config\": [1]}", "text_config is an array" },
    { "{\"model_type\": \"gemma3\", \"text_config\": {\"model_type\": \"llama\"}}",
      "text_config.model_type is the string \"llama\"" },
    { "{\"model_type\": \"gemma3\", \"text_config\": {\"hidden_size\": -1}}",
      "text_config.hidden_size is -1" },
    { "{\"model_type\": \"gemma3\", \"eos_token_id\": [1, 999999],"
      " \"text_config\": {\"hidden_size\": 64, \"intermediate_size\": 64, \"num_hidden_layers\": 2}}",
      "eos_token_id[1] is 999999" },
    { "{\"model_type\": \"gemma3\", \"text_config\": {\"hidden_size\": 64, \"intermediate_size\": 64,"
      " \"num_hidden_layers\": 2, \"rope_scaling\": {\"rope_type\": \"longrope\"}}}",
      "text_config.rope_scaling type 'longrope' is not supported" },
    /* gpt-oss: experts, their choice, MXFP4, YaRN */
    { GPT_OSS_HEAD "}", "num_local_experts is missing" },
    { GPT_OSS_HEAD ", \"num_local_experts\": 4, \"num_experts_per_tok\": 5}",
      "num_experts_per_tok is 5; expected 1..4" },
    { GPT_OSS_HEAD ", \"num_local_experts\": 4, \"num_experts_per_tok\": 2,"
      " \"experts_per_token\": 3}", "experts_per_token is 3 but num_experts_per_tok is 2" },
    { GPT_OSS_HEAD ", \"num_local_experts\": 4, \"swiglu_limit\": 0}",
      "swiglu_limit is 0; expected a number > 0" },
    { GPT_OSS_HEAD ", \"num_local_experts\": 4, \"quantization_config\": {\"quant_method\":"
      " \"mxfp4\"}}", "quantization_config is an object; kvdiff reads gpt-oss with BF16/F16/F32" },
    { GPT_OSS_HEAD ", \"num_local_experts\": 4, \"layer_types\": [\"sliding_attention\"]}",
      "layer_types has 1 entries but num_hidden_layers is 2" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"yarn\"}}",
      "rope_scaling.factor is missing" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4,"
      " \"beta_fast\": 1, \"beta_slow\": 2}}", "rope_scaling has beta_fast 1 <= beta_slow 2" },
    { LLAMA_HEAD ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4,"
      " \"truncate\": 1}}", "truncate is 1; expected true or false" },
};

START_TEST(bad_input_is_refused)
{
    const bad_case *b = &BAD[_i];
    kv_config c;
    kv_err e = { "" };
    char want[700];
    snprintf(want, sizeof want, "bad.json: %s", b->expect);
    ck_assert_int_eq(config_parse_json(b->json, strlen(b->json), "bad.json", &c, &e), -1);
    ck_assert_msg(strstr(e.msg, want) != NULL, "case %d: message '%s' lacks '%s'", _i,
                  e.msg, want);
    ck_assert_ptr_null(strchr(e.msg, '\n'));
}
END_TEST

Suite *config_suite(void)
{
    Suite *s = suite_create("config");
    TCase *t = tcase_create("parse");
    tcase_add_test(t, conformance_llama);
    tcase_add_test(t, conformance_qwen2);
    tcase_add_test(t, conformance_gemma3);
    tcase_add_test(t, conformance_qwen3);
    tcase_add_test(t, conformance_llama3_bias);
    tcase_add_test(t, gemma3_nested_defaults);
    tcase_add_test(t, gemma3_pattern_without_layer_types);
    tcase_add_test(t, gemma3_no_sliding_layers);
    tcase_add_test(t, llama_defaults);
    tcase_add_test(t, qwen2_defaults);
    tcase_add_test(t, llama_attention_bias);
    tcase_add_test(t, qwen3_defaults);
    tcase_add_test(t, llama3_rope_scaling);
    tcase_add_test(t, gpt_oss_config);
    tcase_add_test(t, deepseek_v2_config);
    tcase_add_test(t, deepseek_v3_config);
    tcase_add_test(t, rope_type_synonyms);
    tcase_add_test(t, rope_parameters_v5);
    tcase_add_test(t, parse_unterminated_buffer);
    tcase_add_loop_test(t, bad_input_is_refused, 0, (int)(sizeof BAD / sizeof BAD[0]));
    tcase_add_test(t, gemma4_e2b_config);
    tcase_add_test(t, gemma4_per_layer_config);
    suite_add_tcase(s, t);
    TCase *p = tcase_create("presets");
    tcase_add_test(p, presets_validate_and_round_trip);
    tcase_add_test(p, preset_values);
    tcase_add_test(p, kvshared_owners);
    tcase_add_test(p, describe_line);
    tcase_add_test(p, validate_rejects);
    suite_add_tcase(s, p);
    TCase *w = tcase_create("files");
    tcase_add_test(w, write_unwritable_path);
    tcase_add_test(w, write_refuses_inexpressible_owners);
    tcase_add_test(w, load_errors_name_the_path);
    suite_add_tcase(s, w);
    return s;
}
