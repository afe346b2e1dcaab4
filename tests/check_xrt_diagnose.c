/* check_xrt_diagnose.c — diagnoses from what another runtime can give (q,
 * k, v, attn_out, x_out; no attn_lse, no attn_nkeys), under its drift.
 * Each bug is made inside the real llama.cpp through a wrong value the
 * exporter could have written into the GGUF, recorded with an f32 and an
 * f16 KV cache, and compared with kvdiff's reference on the correct
 * model: the diagnosis must name the bug, with the figures that prove it. */
#include <check.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#include "compare/compare.h"
#include "gguf_patch.h"
#include "reports/report.h"
#include "model/model.h"
#include "h5edit.h"
#include "testutil.h"

static char out[1 << 16];

/* The model, its GGUF and the reference run (gguf_patch.h). */
static void setup_model(const char *dir)
{
    ck_assert_msg(test_gemma3_gguf(dir, out, sizeof out) == 0, "%s", out);
}

/* dir/m.gguf with key set to v, as dir/bad.gguf. */
static void make_bad(const char *dir, const char *key, double v)
{
    char gguf[512], bad[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_patch(gguf, bad, key, v), 0);
}

/* Records dir/bad.gguf with llama.cpp (config from the HF folder) and
 * compares it with the reference in cross-runtime mode: a step, exit 1,
 * at (pos, layer, stage). Returns the JSON's diagnosis (owned by *j). */
static json_t *diagnose(const char *dir, const char *rec_opts, long pos, int layer,
                        const char *stage, json_t **j)
{
    char args[2048];
    snprintf(args, sizeof args, "%s/bad.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 2 "
             "--ignore-eos --threads 1 %s --dump %s/llama.h5", dir, dir, dir, rec_opts, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json", dir, dir);
    const int rc = test_run_cli(args, out, sizeof out);
    json_error_t je;
    *j = json_loads(out, 0, &je);
    ck_assert_msg(*j, "%s\n%s", je.text, out);
    ck_assert_msg(rc == 1, "%s: exit %d\n%.3000s", rec_opts, rc, out);
    json_t *d = json_object_get(*j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == pos &&
                  json_integer_value(json_object_get(d, "layer")) == layer &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), stage),
                  "%s: expected position %ld layer %d %s\n%.3000s", rec_opts, pos, layer, stage,
                  out);
    return json_object_get(*j, "diagnosis");
}

static const char *field(json_t *g, const char *k)
{
    const char *s = json_string_value(json_object_get(g, k));
    return s ? s : "";
}

/* The diagnosis is of kind `kind`, by recomputation, and its texts hold
 * each of the NULL-terminated phrases. */
static void expect_diag(json_t *g, const char *rec_opts, const char *kind, const char *basis,
                        ...)
{
    char all[8192];
    snprintf(all, sizeof all, "%s %s %s", field(g, "summary"), field(g, "detail"),
             field(g, "evidence"));
    ck_assert_msg(!strcmp(field(g, "kind"), kind) && !strcmp(field(g, "basis"), basis),
                  "%s: expected %s (%s), got %s (%s): %s", rec_opts, kind, basis,
                  field(g, "kind"), field(g, "basis"), all);
    /* A count the runtime did not record is never printed as one. */
    ck_assert_msg(!strstr(all, "vs -1") && !strstr(all, " -1 key"), "%s: %s", rec_opts, all);
    va_list ap;
    va_start(ap, basis);
    for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
        ck_assert_msg(strstr(all, s), "%s: '%s' not in: %s", rec_opts, s, all);
    va_end(ap);
}

static const char *const kv_types[] = {"--cache-type f32", "--cache-type f16 --ubatch 7"};

static void setup_preset(const char *dir, const char *preset, const char *scaling);

/* ------------------------------------------------------------------ */
/* Key sets                                                             */

/* The GGUF says window 4 where config.json says 12: attention recomputed
 * from llama.cpp's own q, k, v over the last 4 keys reproduces its
 * attn_out within drift, the config's 5 keys do not. */
START_TEST(xrt_diag_window_smaller)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    make_bad(dir, "gemma3.attention.sliding_window", 4);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 4, 0, "attn_out", &j);
        expect_diag(g, kv_types[i], "window", "recomputed", "window in test appears to be 4, "
                    "config says 12", "window of 4 keys (1..4)", "the config's keys do not",
                    i == 0 ? "the attention check's threshold (KV cache f32)"
                           : "drift model's floor", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* Key-set bugs planted inside llama.cpp through its memory API (the
 * recorder's test-only --fault), on the correct GGUF, with 4 decode steps
 * so that the position after the first decode step is recorded too. The
 * f32 run takes the prompt in one ubatch, the f16 run in ubatches of 7:
 * pos[i] is where the step is for kv_types[i]. */
static void fault_case(const char *fault, const long pos[2], const char *kind,
                       const char *words, const char *words2)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    char gguf[512], bad[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(rename(gguf, bad), 0);
    for (int i = 0; i < 2; i++) {
        char opts[256];
        snprintf(opts, sizeof opts, "%s --max-new 4 --fault %s", kv_types[i], fault);
        json_t *j, *g = diagnose(dir, opts, pos[i], 0, "attn_out", &j);
        expect_diag(g, opts, kind, "recomputed", words, words2, NULL);
        json_decref(j);
        /* The dump says the bug was planted. */
        char args[256], want[128];
        snprintf(args, sizeof args, "inspect %s/llama.h5", dir);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
        snprintf(want, sizeof want, "{\"fault\":\"%s\",", fault);
        ck_assert_msg(strstr(out, want), "%s", out);
    }
    test_rmtree(dir);
}

/* Each ubatch (and decode step) sees only its own keys. In one ubatch
 * the prompt is fine and the first decode step reads its own key alone,
 * which a decode-blind split cache does too: the next step tells. */
START_TEST(xrt_diag_isolate_ubatch)
{
    static const long pos[2] = {100, 7};
    fault_case("isolate-ubatch", pos, "chunk_isolated", "chunks attend only to themselves",
               "only its own chunk's keys");
}
END_TEST

/* Position 95 removed from the cache once its ubatch ran: the next
 * ubatch's first query (the first decode step, or 98) reads 11 of the 12
 * keys of its window. */
START_TEST(xrt_diag_drop_key)
{
    static const long pos[2] = {100, 98};
    fault_case("drop-key=95", pos, "missing_key", "one key too few: the key at position 95 is "
               "not read", "with key 95 left out reproduces its attn_out");
}
END_TEST

/* The prompt's keys removed before decoding: decode steps read the
 * decode tokens' keys only. */
START_TEST(xrt_diag_decode_blind)
{
    static const long pos[2] = {100, 100};
    fault_case("decode-blind", pos, "split_decode_blind", "decode steps attend only to the "
               "decode cache", "over the decode steps' keys 100..100 alone reproduces its attn_out");
}
END_TEST

/* Position 95 decoded again as a second cell of the sequence before
 * decoding: its first layer's key is read twice. */
START_TEST(xrt_diag_dup_key)
{
    static const long pos[2] = {100, 100};
    fault_case("dup-key=95", pos, "duplicate_key", "one key too many: the key at position 95 "
               "is read twice", "with key 95 read twice reproduces its attn_out");
}
END_TEST

/* k and v weights swapped by the exporter (layer 0), with an f32, an f16
 * and a q8_0 cache: at position 0, where RoPE turns nothing, the test's k
 * is the reference's v through the k norm, its v the reference's k before
 * it. */
START_TEST(xrt_diag_kv_swapped)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_swap_tensors(gguf, bad, "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
                     2);
    static const char *const caches[] = {"--cache-type f32", "--cache-type f16 --ubatch 7",
                                         "--cache-type q8_0 --flash-attn on"};
    for (int i = 0; i < 3; i++) {
        json_t *j, *g = diagnose(dir, caches[i], 0, 0, "k", &j);
        expect_diag(g, caches[i], "kv_swapped", "recomputed", "k and v projections swapped",
                    "under one fitted per-dimension norm gain", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* The GGUF's RMSNorm epsilon 1e-2 where config.json says 1e-6: every
 * norm's output scaled by sqrt((ms + 1e-6) / (ms + 1e-2)). */
START_TEST(xrt_diag_norm_eps)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    make_bad(dir, "gemma3.attention.layer_norm_rms_epsilon", 1e-2);
    json_t *j, *g = diagnose(dir, kv_types[0], 0, 0, "attn_norm", &j);
    expect_diag(g, kv_types[0], "norm_eps", "recomputed", "with eps 0.01 where the config says "
                "1e-06", NULL);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* RoPE conventions                                                     */

/* The caches a rotation is named under: a q8_0 cache too, where the
 * diagnosis reads the test's q, k, v rounded as the cache holds them for
 * recomputing attention, but compares the rows as recorded (rounding
 * them again cost a q8_0 block's 0.4 % of every fit, and the local base
 * set to the global one went unclassified). */
static const char *const rope_caches[] = {"--cache-type f32", "--cache-type f16 --ubatch 7",
                                          "--cache-type q8_0 --flash-attn on"};

/* key patched to v: the first step at (1, layer, q) (position 0 is not
 * rotated), diagnosed as that convention in words (and words2 when not
 * NULL). */
static void rope_case2(const char *key, double v, int layer, const char *words,
                       const char *words2, int ncaches)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    make_bad(dir, key, v);
    for (int i = 0; i < ncaches; i++) {
        json_t *j, *g = diagnose(dir, rope_caches[i], 1, layer, "q", &j);
        /* checked again at the last compared position: the last recorded
         * (100), or the one before the first differing token */
        json_t *cmp = json_object_get(j, "compared");
        long last = (long)json_integer_value(json_object_get(cmp, "position_hi"));
        json_t *cut = json_object_get(cmp, "token_cut");
        if (json_is_integer(cut) && json_integer_value(cut) - 1 < last)
            last = (long)json_integer_value(cut) - 1;
        char at[64];
        snprintf(at, sizeof at, "and at position %ld (", last);
        expect_diag(g, rope_caches[i], "rope_convention", "recomputed", words,
                    words2 ? words2 : words, "reproduces the test's at position 1", at, NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}

static void rope_case(const char *key, double v, int layer, const char *words)
{
    rope_case2(key, v, layer, words, NULL, 3);
}

/* The case: the local base set to the global one. */
START_TEST(xrt_diag_rope_local_is_global)
{
    rope_case("gemma3.rope.freq_base_swa", 1e6, 0, "the test's queries match theta 1e+06, the "
              "global layers' base, on a sliding layer; the config says 10000");
}
END_TEST

START_TEST(xrt_diag_rope_global_is_local)
{
    rope_case2("gemma3.rope.freq_base", 1e4, 5, "the test's queries match theta 10000, the "
               "sliding layers' base, on a global layer; the config says 1e+06", NULL, 3);
}
END_TEST

/* A common base other than either of the config's (Llama 3's). */
START_TEST(xrt_diag_rope_common_base)
{
    rope_case("gemma3.rope.freq_base_swa", 5e5, 0, "the test's queries match theta 500000 on a "
              "sliding layer; the config says 10000");
}
END_TEST

/* Qwen2's k and v weights swapped in the GGUF, each projection keeping
 * its own bias (the biases left in place, or traded too): the test's k is
 * the reference's v plus b_k - b_v per channel, its v the reference's k
 * minus it. Named, with which of the two it is; was "cause not
 * identified (a projection differs ...)". */
START_TEST(xrt_diag_kv_swapped_biased)
{
    char dir[64], gguf[512], tmp[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-qwen2", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s/w.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_swap_tensors(gguf, bad, "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
                     2);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 0, 0, "k", &j);
        expect_diag(g, kv_types[i], "kv_swapped", "recomputed", "k and v projection weights "
                    "swapped, each keeping its own bias", "plus one fitted offset per channel",
                    "the two offsets agree", NULL);
        json_decref(j);
    }
    /* both swapped, weights and biases: the plain swap */
    ck_assert_int_eq(gguf_swap_tensors(gguf, tmp, "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
                     2);
    ck_assert_int_eq(gguf_swap_tensors(tmp, bad, "blk.0.attn_k.bias", "blk.0.attn_v.bias"), 2);
    json_t *j, *g = diagnose(dir, kv_types[0], 0, 0, "k", &j);
    expect_diag(g, kv_types[0], "kv_swapped", "recomputed", "k and v projections swapped: the "
                "test's keys are the values' projection", NULL);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* A rope dimension count of 16 where the head has 32: llama.cpp turns
 * the first 16 dimensions as pairs (i, i + 8) at theta^(-i/8), the rest
 * unrotated. Named with the pairs turned and the factor they imply. */
START_TEST(xrt_diag_rope_dimension_count)
{
    rope_case2("gemma3.rope.dimension_count", 16, 0, "RoPE turns 8 of the 16 pairs of each head "
               "where the config turns 16: a rope dimension count of 16 of 32 (partial rotary "
               "factor 0.5)", "pairs (i, i + n) of the first 2n dimensions at theta^(-i/n)", 3);
}
END_TEST

/* dir/hf/config.json with its first `from` replaced by `to`. */
static void config_replace(const char *dir, const char *from, const char *to)
{
    char path[512];
    snprintf(path, sizeof path, "%s/hf/config.json", dir);
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    static char cfg[8192];
    const size_t n = fread(cfg, 1, sizeof cfg - 1, f);
    fclose(f);
    cfg[n] = '\0';
    char *at = strstr(cfg, from);
    ck_assert_msg(at, "%s: no %s", path, from);
    f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "%.*s%s%s", (int)(at - cfg), cfg, to, at + strlen(from));
    ck_assert_int_eq(fclose(f), 0);
}

/* preset as dir/hf (its config.json's rope_scaling replaced by `scaling`
 * when not NULL), exported as dir/m.gguf, and the reference on a 100-token
 * prompt as dir/ref.h5. */
static void setup_preset(const char *dir, const char *preset, const char *scaling)
{
    char args[1024];
    snprintf(args, sizeof args, "gen --preset %s -o %s/hf", preset, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    if (scaling) {
        char to[512];
        snprintf(to, sizeof to, "\"rope_scaling\": %s", scaling);
        config_replace(dir, "\"rope_scaling\": null", to);
    }
    snprintf(args, sizeof args, "gen --from %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

/* A Llama GGUF exported without the q/k row permutation: llama.cpp
 * rotates adjacent pairs (2i, 2i + 1) of rows laid out for halves. The
 * recorder maps its rows back as for a correct GGUF, so the test's q is
 * the reference's with each head's rows in another order from position
 * 0 (where nothing is rotated yet) on. */
START_TEST(xrt_diag_rope_unpermuted)
{
    char dir[64], gguf[512], tmp[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-llama", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s/q.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_unpermute_rows(gguf, tmp, "attn_q.weight", 16), 4);
    ck_assert_int_eq(gguf_unpermute_rows(tmp, bad, "attn_k.weight", 16), 4);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 0, 0, "q", &j);
        expect_diag(g, kv_types[i], "rope_convention", "recomputed", "interleaved RoPE pairs "
                    "(2i, 2i + 1) rotated on rows laid out for halves (i, i + 8)",
                    "without the row permutation", "reproduces the test's at position 0",
                    "and at position 99", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* tiny-gemma4 (sliding layers of 32-wide heads at base 1e4, full ones of
 * 64 at 1e6 turning 8 of their 32 pairs) as dir/hf, dir/m.gguf and the
 * reference, the GGUF changed by patch into dir/bad.gguf; the first step
 * at (1, layer, q) is named in words, on each cache in caches. */
static void gemma4_rope_case(int (*patch)(const char *in, const char *to), int layer,
                             const char *const *caches, int ncaches, const char *words,
                             const char *words2)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-gemma4", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(patch(gguf, bad), 0);
    for (int i = 0; i < ncaches; i++) {
        json_t *j, *g = diagnose(dir, caches[i], 1, layer, "q", &j);
        expect_diag(g, caches[i], "rope_convention", "recomputed", words, words2,
                    "reproduces the test's at position 1", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}

static int patch_swa_dims(const char *in, const char *to)
{
    return gguf_patch(in, to, "gemma4.rope.dimension_count_swa", 16);
}

static int patch_global_base(const char *in, const char *to)
{
    return gguf_patch(in, to, "gemma4.rope.freq_base", 1e4);
}

/* llama.cpp's rope_freqs: 1 on the pairs the partial factor turns, a huge
 * divisor on the rest; all 1 turns every pair. */
static int patch_freqs_ones(const char *in, const char *to)
{
    return gguf_affine_tensors(in, to, "rope_freqs", 0, 1) == 1 ? 0 : -1;
}

/* A Gemma 4 sliding layer run by llama.cpp as a full one: tiny-gemma4
 * with its full layers given the sliding layers' head size, KV heads and
 * a v_proj (bench/gemma4_equal_heads.py), so that either type runs on the
 * same tensors, and the GGUF's layer pattern saying layer 0 (then 5) is
 * full. The layer rotates with the global base and its partial pairs,
 * and reads every key: named a layer type at (1, L, q), on f16, bf16,
 * q8_0 and q4_0 caches. */
START_TEST(xrt_diag_gemma4_sliding_as_full)
{
    char dir[64], args[2048], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/hf0", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    const char *py = getenv("KVDIFF_PYTHON");
    snprintf(args, sizeof args, "%s bench/gemma4_equal_heads.py %s/hf0 %s/hf 2>&1",
             py && py[0] ? py : "python3", dir, dir);
    ck_assert_msg(system(args) == 0, "%s failed", args);
    snprintf(args, sizeof args, "gen --from %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    static const char *const caches[] = {"--cache-type f16 --ubatch 7",
                                         "--cache-type bf16 --flash-attn on",
                                         "--cache-type q8_0 --flash-attn on",
                                         "--cache-type q4_0 --flash-attn on"};
    static const int layers[] = {0, 5};
    for (int li = 0; li < 2; li++) {
        char key[96], words[96];
        snprintf(key, sizeof key, "gemma4.attention.sliding_window_pattern[%d]", layers[li]);
        ck_assert_int_eq(gguf_patch(gguf, bad, key, 0), 0);
        snprintf(words, sizeof words, "layer %d runs as a global layer", layers[li]);
        for (int i = 0; i < 4; i++) {
            if (li == 1 && i != 0 && i != 3)
                continue;   /* layer 5 on two caches: f16 and q4_0 */
            /* Layer 5 under q4_0's noise (four layers of it flowed in):
             * the rotation does not stand out before the layer's keys do,
             * at the window (attention checked from its own q, k, v). */
            const bool keys_first = li == 1 && i == 3;
            json_t *j, *g = diagnose(dir, caches[i], keys_first ? 12 : 1, layers[li],
                                     keys_first ? "attn_out" : "q", &j);
            if (keys_first)
                expect_diag(g, caches[i], "layer_type", "recomputed", "layer 5 attends every "
                            "key at every position checked", "it is global in the test", NULL);
            else
                expect_diag(g, caches[i], "layer_type", "recomputed", words,
                            "rotates with the global layers' base and reads every key", NULL);
            json_decref(j);
        }
    }
    test_rmtree(dir);
}
END_TEST

/* The sliding layers' rope dimension count halved: layer 0 turns 8 of
 * its 16 pairs. */
START_TEST(xrt_diag_gemma4_rope_swa_dims)
{
    gemma4_rope_case(patch_swa_dims, 0, rope_caches, 3, "RoPE turns 8 of the 16 pairs of each "
                     "head where the config turns 16: a rope dimension count of 16 of 32",
                     "pairs (i, i + n) of the first 2n dimensions at theta^(-i/n)");
}
END_TEST

/* The full layers' base set to the sliding layers' (1e6 to 1e4): the
 * convention keeps the full layers' partial rotation (8 of 32 pairs). */
START_TEST(xrt_diag_gemma4_rope_global_base)
{
    gemma4_rope_case(patch_global_base, 3, rope_caches, 3, "the test's queries match theta "
                     "10000, the sliding layers' base, on a global layer; the config says "
                     "1e+06", "position 1 is the first rotated");
}
END_TEST

/* rope_freqs all ones: every pair of the full layers' heads turns at the
 * whole head's frequencies; the low frequencies turn too little by
 * position 100 to tell 20 pairs from 32, and the verdict says so. */
START_TEST(xrt_diag_gemma4_rope_freqs_ones)
{
    gemma4_rope_case(patch_freqs_ones, 3, rope_caches, 3, "of the 32 pairs of each head where "
                     "the config turns 8: a proportional partial rotary factor of",
                     "at the whole head's frequencies theta^(-2i/64)");
}
END_TEST

/* A rotation born under the drift floor: with a q8_0 cache, layer 3's q
 * (the first full layer, base 1e4 where the config says 1e6) errs by
 * 0.084 at position 1, under the 0.11 the size walk allows there (what
 * flowed in from three layers of q8_0 rounding, times 8), and grows with
 * the position within 8 times its own history: the pair read "no bug".
 * The walk's rotation test finds the row to be the reference's turned
 * under the sliding base, leaving a tenth of its error: a step at
 * (1, 3, q), said so, and the JSON carries it and reads back whole. */
START_TEST(xrt_diag_rotation_under_floor)
{
    char dir[64], gguf[512], bad[512], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-gemma4", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(patch_global_base(gguf, bad), 0);
    json_t *j, *g = diagnose(dir, "--cache-type q8_0 --flash-attn on", 1, 3, "q", &j);
    json_t *rot = json_object_get(json_object_get(json_object_get(json_object_get(j, "mode"),
                      "cross_runtime"), "structure"), "rotation_step");
    ck_assert_msg(json_is_object(rot) &&
                  json_integer_value(json_object_get(rot, "position")) == 1 &&
                  !strcmp(json_string_value(json_object_get(rot, "stage")), "q") &&
                  json_real_value(json_object_get(rot, "residual")) * 8 <=
                      json_real_value(json_object_get(rot, "error")), "%.3000s", out);
    expect_diag(g, "q8_0", "rope_convention", "recomputed", "theta 10000, the sliding layers' "
                "base, on a global layer", NULL);
    /* written and read back: the same figures */
    char path[512];
    snprintf(path, sizeof path, "%s/c.json", dir);
    ck_assert_int_eq(json_dump_file(j, path, 0), 0);
    kv_err e = {{0}};
    report_json back;
    ck_assert_msg(report_json_load(path, &back, &e) == 0, "%s", e.msg);
    ck_assert(back.r.xrt.rot_step && back.r.xrt.rot_pos == 1 && back.r.xrt.rot_stage == STAGE_Q);
    json_t *j2 = cmp_result_json(&back.r, CMP_RENDER_STAGES);
    json_t *rot2 = json_object_get(json_object_get(json_object_get(json_object_get(j2, "mode"),
                       "cross_runtime"), "structure"), "rotation_step");
    ck_assert_msg(json_equal(rot, rot2), "%s", json_dumps(rot2, 0));
    json_decref(j2);
    report_json_free(&back);
    json_decref(j);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "a step by its structure: q at position 1 is the reference's "
                              "turned under theta 10000") &&
                  strstr(out, "rounding leaves noise no rotation explains"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A rotation under every threshold where it is born, stepping by size
 * downstream: tiny-gemma4's rope_freqs all ones on 600 positions with a
 * bf16 cache moves layer 3's q by 1.7 % at position 1 (under the bf16
 * floor), while layer 7 (global too, its input already changed) steps by
 * size at (1, 7, q), where no rotation explains it: "unclassified" at the
 * wrong layer. A candidate found where the rotation has grown (by the
 * walk's test on a row of a global layer, or at each q and k stage's last
 * position, where it reaches 170 %) is tried on every global layer and
 * explains layer 3's rows back to position 1: the step moves there,
 * named. */
START_TEST(xrt_diag_rotation_upstream_of_step)
{
    char dir[64], args[2048], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 600 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(patch_freqs_ones(gguf, bad), 0);
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 4 --ignore-eos "
             "--threads 1 --cache-type bf16 --flash-attn on --ubatch 7 --dump %s/llama.h5", bad,
             dir, dir, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_msg(j, "%.2000s", out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 1 &&
                  json_integer_value(json_object_get(d, "layer")) == 3 &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), "q"), "%.3000s", out);
    expect_diag(json_object_get(j, "diagnosis"), "bf16", "rope_convention", "recomputed",
                "of the 32 pairs of each head where the config turns 8", NULL);
    json_t *rot = json_object_get(json_object_get(json_object_get(json_object_get(j, "mode"),
                      "cross_runtime"), "structure"), "rotation_step");
    char *rs = json_dumps(rot, 0);
    ck_assert_msg(json_is_object(rot) &&
                  json_integer_value(json_object_get(rot, "position")) > 1 &&
                  json_real_value(json_object_get(rot, "residual")) * 8 <=
                      json_real_value(json_object_get(rot, "error")) &&
                  json_is_number(json_object_get(rot, "residual_at_step")), "%s", rs);
    free(rs);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* Linear RoPE scaling by 4 in config.json; the GGUF's factor dropped to
 * 1 (no scaling), or wrong (2). */
static void scaling_case(double factor, const char *words)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-llama", "{\"rope_type\": \"linear\", \"factor\": 4.0}");
    make_bad(dir, "llama.rope.scaling.factor", factor);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 1, 0, "q", &j);
        expect_diag(g, kv_types[i], "rope_convention", "recomputed", words,
                    "reproduces the test's at position 1", "and at position 99", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}

START_TEST(xrt_diag_rope_scaling_dropped)
{
    scaling_case(1, "the test's queries match no RoPE scaling; the config says linear scaling "
                 "by 4");
}
END_TEST

/* Every token given to llama.cpp K positions late (the recorder's
 * test-only --fault rope-offset=K; key sets unchanged, only the rotation
 * wrong): the step at (0, 0, q), named with its offset, small or large. */
START_TEST(xrt_diag_rope_offset)
{
    static const int offsets[] = {3, 1000};
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-llama", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(rename(gguf, bad), 0);
    for (int i = 0; i < 2; i++) {
        char opts[256], words[128];
        snprintf(opts, sizeof opts, "%s --fault rope-offset=%d", kv_types[i], offsets[i]);
        snprintf(words, sizeof words, "RoPE position offset of +%d", offsets[i]);
        json_t *j, *g = diagnose(dir, opts, 0, 0, "q", &j);
        expect_diag(g, opts, "rope_offset", "recomputed", words, NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* Llama 3 scaling lives in the GGUF as the rope_freqs tensor (llama.cpp's
 * converter writes no scaling metadata for it): a GGUF without it runs
 * unscaled, which the diagnosis names against the config's llama3 rule. */
START_TEST(xrt_diag_rope_llama3_dropped)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-llama3", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    static const char *const drop[] = {"rope_freqs", NULL};
    ck_assert_int_eq(gguf_rearch(gguf, bad, "llama", drop), 1);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 1, 0, "q", &j);
        expect_diag(g, kv_types[i], "rope_convention", "recomputed",
                    "the test's queries match no RoPE scaling; the config says llama3 scaling "
                    "by 32", "reproduces the test's at position 1", "and at position 100", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

START_TEST(xrt_diag_rope_scaling_wrong)
{
    scaling_case(2, "the test's queries match linear RoPE scaling by 2; the config says linear "
                 "scaling by 4");
}
END_TEST

/* ------------------------------------------------------------------ */
/* Attention scale                                                      */

/* An exporter that does not fold query_pre_attn_scalar (24) into the
 * q_norm weights where llama.cpp scales by 1/sqrt(head_dim) (32), and
 * says so (kvdiff.q_scale_folded 1): llama.cpp's scores are scaled by
 * 1/sqrt(32). The recorder maps q to the config's scale, so q is the
 * reference's times sqrt(24/32) from position 0 of layer 0. */
START_TEST(xrt_diag_attn_scale)
{
    char dir[64], gguf[512], tmp[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s/unfolded.gguf", dir);
    ck_assert_int_eq(gguf_scale_tensors(gguf, tmp, "attn_q_norm.weight", sqrt(24.0 / 32.0)), 6);
    char bad[512];
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_patch(tmp, bad, "kvdiff.q_scale_folded", 1), 0);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 0, 0, "q", &j);
        expect_diag(g, kv_types[i], "attn_scale", "recomputed", "scales scores by "
                    "1/sqrt(head_dim) = 1/sqrt(32)", "1/sqrt(24) (query_pre_attn_scalar)",
                    "times 0.866025", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Gemma's (1 + w) norm weights stored as w                             */

/* An exporter that writes Gemma's norm weights as w where llama.cpp
 * multiplies by the stored weight (the converter stores 1 + w): every
 * tensor named `part` shifted by add (-1, or minus the q scale folded
 * into q_norm). The step is at (0, layer 0, stage), and the diagnosis
 * names that norm and the convention. */
static void norm_case(const char *part, double add, const char *stage, const char *words)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_affine_tensors(gguf, bad, part, 1.0, add), 6);
    for (int i = 0; i < 2; i++) {
        json_t *j, *g = diagnose(dir, kv_types[i], 0, 0, stage, &j);
        expect_diag(g, kv_types[i], "norm_convention", "recomputed", words,
                    "w in place of (1 + w)", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}

START_TEST(xrt_diag_norm_input)
{
    norm_case("attn_norm.weight", -1.0, "attn_norm", "input_layernorm");
}
END_TEST

START_TEST(xrt_diag_norm_q)
{
    norm_case("attn_q_norm.weight", -sqrt(32.0 / 24.0), "q", "q_norm");
}
END_TEST

START_TEST(xrt_diag_norm_post_ffw)
{
    norm_case("post_ffw_norm.weight", -1.0, "ffn_out", "post_feedforward_layernorm");
}
END_TEST

/* ------------------------------------------------------------------ */
/* A q/k norm not applied                                               */

/* Qwen3 exported as a Llama GGUF, as a converter that maps every model
 * onto llama would: the same weights and hyper-parameters under
 * "llama.*", q/k rows permuted as llama.cpp's Llama converter does, and
 * attn_q_norm/attn_k_norm left out, since llama has none. (Not as qwen2:
 * llama.cpp's qwen2 loader wants q of hidden_size rows, and tiny-qwen3's
 * 4 heads of 32 are 128 against 64, as in Qwen3-0.6B.) llama.cpp runs it
 * without q/k norms. What a user does: kvdiff-llama --hf refuses config.json's
 * qwen3 for a llama GGUF, so record from the GGUF's metadata; compare
 * refuses two models, and --force compares anyway. The step is at
 * (0, layer 0, q): position 0 is not rotated, and q comes before k. */
START_TEST(xrt_diag_qk_norm_missing_llamacpp)
{
    char dir[64], args[2048], gguf[512], tmp[512], tmp2[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-qwen3 -o %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s/llama.gguf", dir);
    snprintf(tmp2, sizeof tmp2, "%s/q.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    static const char *const norms[] = {"attn_q_norm", "attn_k_norm", NULL};
    ck_assert_int_eq(gguf_rearch(gguf, tmp, "llama", norms), 8);
    ck_assert_int_eq(gguf_permute_rows(tmp, tmp2, "attn_q.weight", 32), 4);
    ck_assert_int_eq(gguf_permute_rows(tmp2, bad, "attn_k.weight", 32), 4);
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 2 --threads 1 "
             "--dump %s/llama.h5", bad, dir, dir, dir);
    ck_assert_int_eq(test_run_recorder(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "config.json's model_type qwen3 is not the GGUF's architecture"),
                  "%s", out);
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "%s --prompt-from %s/ref.h5 --max-new 2 --ignore-eos "
                 "--threads 1 %s --dump %s/llama.h5", bad, dir, kv_types[i], dir);
        ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
        snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5", dir, dir);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
        ck_assert_msg(strstr(out, "model_type 'qwen3' vs 'llama'"), "%s", out);
        snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --force --json", dir, dir);
        const int rc = test_run_cli(args, out, sizeof out);
        json_error_t je;
        json_t *j = json_loads(out, 0, &je);
        ck_assert_msg(j, "%s\n%s", je.text, out);
        ck_assert_msg(rc == 1, "%s: exit %d\n%.3000s", kv_types[i], rc, out);
        ck_assert(json_is_object(json_object_get(json_object_get(j, "mode"), "cross_runtime")));
        json_t *d = json_object_get(j, "first_divergence");
        ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 0 &&
                      json_integer_value(json_object_get(d, "layer")) == 0 &&
                      !strcmp(json_string_value(json_object_get(d, "stage")), "q"),
                      "%s: expected position 0 layer 0 q\n%.3000s", kv_types[i], out);
        expect_diag(json_object_get(j, "diagnosis"), kv_types[i], "qk_norm_missing",
                    "recomputed", "q_norm missing: the test's queries are not normalised per "
                    "head", "each head is the raw projection", "fitted over 4 heads at "
                    "position 0 and at the last compared position", "drift threshold", NULL);
        json_decref(j);
    }
    test_rmtree(dir);
}
END_TEST

/* On recordings edited by hand: the rule in exact mode (both kvdiff's),
 * and its other branch, q normalised per head but not weighted, which
 * no GGUF makes llama.cpp do. */

/* Rotates (sign 1) or rotates back (-1) each head of row at pos, RoPE
 * rotate-half with base theta (tiny-gemma3's layer 0: 1e4, D = 32). */
static void rope_row(float *row, int nh, int D, double theta, long pos, int sign)
{
    const int half = D / 2;
    for (int h = 0; h < nh; h++)
        for (int d = 0; d < half; d++) {
            const double ang = sign * (double)pos * pow(theta, -2.0 * d / D);
            float *x = row + h * D;
            const double a = x[d], b = x[d + half];
            x[d] = (float)(a * cos(ang) - b * sin(ang));
            x[d + half] = (float)(b * cos(ang) + a * sin(ang));
        }
}

/* dir/test.h5: dir/ref.h5 whose layer 0 q is what a runtime without
 * q_norm computes: each head rotated back, divided by q_norm's (1 + w),
 * times a scale of its own (the raw projection's RMS), rotated again.
 * With engine set, the recording names another engine. */
static void make_qnorm_missing(const char *dir, const char *engine, bool unit)
{
    char ref[512], test[512], cmd[1200];
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(test, sizeof test, "%s/test.h5", dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", ref, test);
    ck_assert_int_eq(system(cmd), 0);
    kv_model m;
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset("tiny-gemma3", 0, &mo, &m, &e) == 0, "%s", e.msg);
    const int nh = m.cfg.n_heads, D = m.cfg.head_dim, n = nh * D;
    hid_t f = H5Fopen(test, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t dq = f >= 0 ? H5Dopen2(f, "/layers/0/q", H5P_DEFAULT) : -1;
    hid_t dh = f >= 0 ? H5Dopen2(f, "/layers/0/q.hash", H5P_DEFAULT) : -1;
    ck_assert(f >= 0 && dq >= 0 && dh >= 0 && n <= 1024);
    hid_t fs = H5Dget_space(dq), hs = H5Dget_space(dh);
    hsize_t dims[2];
    H5Sget_simple_extent_dims(fs, dims, NULL);
    ck_assert_int_eq(dims[1], n);
    for (hsize_t p = 0; p < dims[0]; p++) {
        float row[1024];
        hsize_t start[2] = {p, 0}, count[2] = {1, (hsize_t)n}, one = 1;
        hid_t ms = H5Screate_simple(2, count, NULL), ms1 = H5Screate_simple(1, &one, NULL);
        H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL);
        ck_assert(H5Dread(dq, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, row) >= 0);
        rope_row(row, nh, D, 1e4, (long)p, -1);
        for (int h = 0; h < nh; h++)
            for (int d = 0; d < D; d++)
                row[h * D + d] *= (float)((unit ? 1.0 : 0.4 + 0.3 * h + 0.002 * (double)p) /
                                          (1.0 + m.layers[0].q_norm[d]));
        rope_row(row, nh, D, 1e4, (long)p, 1);
        ck_assert(H5Dwrite(dq, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, row) >= 0);
        uint64_t hash = XXH3_64bits(row, (size_t)n * sizeof(float));
        H5Sselect_hyperslab(hs, H5S_SELECT_SET, start, NULL, &one, NULL);
        ck_assert(H5Dwrite(dh, H5T_NATIVE_UINT64, ms1, hs, H5P_DEFAULT, &hash) >= 0);
        H5Sclose(ms);
        H5Sclose(ms1);
    }
    H5Sclose(fs);
    H5Sclose(hs);
    H5Dclose(dq);
    H5Dclose(dh);
    if (H5Lexists(f, "row_hash_index", H5P_DEFAULT) > 0)
        H5Ldelete(f, "row_hash_index", H5P_DEFAULT);
    if (engine) {
        test_set_str_attr(f, "engine", engine);
        test_set_str_attr(f, "engine_settings", "{\"cache_type\":\"f32\"}");
    }
    H5Fclose(f);
    model_free(&m);
}

/* Layer 0's q without q_norm: the step at (0, 0, q), named, in exact
 * mode (both recordings kvdiff's) and judged by the drift model. */
START_TEST(xrt_diag_qk_norm_missing)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    for (int i = 0; i < 2; i++) {
        make_qnorm_missing(dir, i ? "another-runtime" : NULL, false);
        snprintf(args, sizeof args, "compare %s/ref.h5 %s/test.h5 --json", dir, dir);
        const int rc = test_run_cli(args, out, sizeof out);
        json_error_t je;
        json_t *j = json_loads(out, 0, &je);
        ck_assert_msg(j && rc == 1, "exit %d: %.3000s", rc, out);
        json_t *d = json_object_get(j, "first_divergence");
        ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 0 &&
                      json_integer_value(json_object_get(d, "layer")) == 0 &&
                      !strcmp(json_string_value(json_object_get(d, "stage")), "q"), "%.3000s", out);
        json_t *mode = json_object_get(j, "mode");
        ck_assert(json_is_object(json_object_get(mode, "cross_runtime")) == i);
        expect_diag(json_object_get(j, "diagnosis"), i ? "cross-runtime" : "exact",
                    "qk_norm_missing", "recomputed", "q_norm missing: the test's queries are not "
                    "normalised per head", "each head is the raw projection",
                    "and at the last compared position", NULL);
        json_decref(j);
    }
    /* Normalised but not weighted: every head of RMS 1. Not the norm
     * missing, and said so. */
    make_qnorm_missing(dir, NULL, true);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/test.h5 --json", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(j);
    expect_diag(json_object_get(j, "diagnosis"), "unit", "unclassified", "recomputed",
                "normalised per head but not multiplied by q_norm's weight", NULL);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Below the drift floor: the attention check                           */

/* The JSON of `kvdiff compare dir/ref.h5 dir/llama.h5` after recording
 * gguf with opts; *rc its exit status. */
static json_t *record_compare(const char *dir, const char *gguf, const char *opts, int *rc)
{
    char args[2048];
    snprintf(args, sizeof args, "%s/%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 4 "
             "--ignore-eos --threads 1 %s --dump %s/llama.h5", dir, gguf, dir, dir, opts, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json", dir, dir);
    *rc = test_run_cli(args, out, sizeof out);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_msg(j, "%.3000s", out);
    return j;
}

static json_t *attention_check(json_t *j)
{
    return json_object_get(json_object_get(json_object_get(j, "mode"), "cross_runtime"),
                           "attention_check");
}

/* tiny-gemma3 with a window of 96 (so a decode step reads 96 keys) and a
 * bf16 cache: one key left out of 96 moves layer 0's attn_out by about
 * 5.6%, under the drift floor of a bf16 cache there (6.65%), so against
 * the reference alone it is drift. Recomputed from llama.cpp's own q, k,
 * v it is not: the attention check finds it at its place, and the
 * diagnosis names the key. The correct model with the same cache passes
 * the check; with an f16 cache the check stands aside. */
START_TEST(xrt_diag_below_drift_bf16)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/hf", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    config_replace(dir, "\"sliding_window\": 12,", "\"sliding_window\": 96,");
    snprintf(args, sizeof args, "gen --from %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);

    int rc;
    json_t *j = record_compare(dir, "m.gguf", "--cache-type bf16 --fault drop-key=95", &rc);
    ck_assert_msg(rc == 1, "exit %d: %.3000s", rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 100 &&
                  json_integer_value(json_object_get(d, "layer")) == 0 &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), "attn_out"),
                  "%.3000s", out);
    /* Drift against the reference: below the bf16 floor at attn_out. */
    const double row_rel = json_real_value(json_object_get(d, "row_rel"));
    ck_assert_msg(row_rel > 0.03 && row_rel < 4e-3 + 16 * 0x1p-8, "row_rel %g", row_rel);
    json_t *ac = attention_check(j);
    ck_assert_msg(json_is_true(json_object_get(ac, "step")), "%.3000s", out);
    expect_diag(json_object_get(j, "diagnosis"), "bf16 drop-key", "missing_key", "recomputed",
                "the key at position 95 is not read", "the attention check's threshold", NULL);
    json_decref(j);

    j = record_compare(dir, "m.gguf", "--cache-type bf16", &rc);
    ck_assert_msg(rc == 0, "exit %d: %.3000s", rc, out);
    ac = attention_check(j);
    ck_assert_msg(json_is_true(json_object_get(ac, "ran")) &&
                  json_integer_value(json_object_get(ac, "layers")) == 6 &&
                  json_real_value(json_object_get(json_object_get(ac, "closest"), "ratio")) < 1,
                  "%.3000s", out);
    json_decref(j);

    j = record_compare(dir, "m.gguf", "--cache-type f16", &rc);
    ck_assert_msg(rc == 0, "exit %d: %.3000s", rc, out);
    ac = attention_check(j);
    ck_assert_msg(json_is_false(json_object_get(ac, "ran")) &&
                  strstr(json_string_value(json_object_get(ac, "skipped")), "f16"),
                  "%.3000s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* A long prompt under llama.cpp's flash attention with an f16 cache: its
 * decode step sums 4000 weighted values in an f16 accumulator, which errs
 * at attn_out by about 0.023 on tiny-gemma3's global layer, twice the f16
 * floor (0.0118); the old model called a correct run a bug at position
 * 4000. The f16 accumulation model recomputes that summation and allows
 * for it; a decode step blind to the prompt is still found there. */
START_TEST(xrt_f16_accumulation_long)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 4000 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);

    int rc;
    json_t *j = record_compare(dir, "m.gguf", "--cache-type f16 --flash-attn on", &rc);
    ck_assert_msg(rc == 0, "exit %d: %.3000s", rc, out);
    json_t *x = json_object_get(json_object_get(j, "mode"), "cross_runtime");
    json_t *acc = json_object_get(x, "f16_accumulation");
    ck_assert_msg(json_is_object(acc), "%.3000s", out);
    /* the three decode rows (the 4th token is not run) of each of 6 layers */
    ck_assert_int_eq(json_integer_value(json_object_get(acc, "rows")), 18);
    const double gap = json_real_value(json_object_get(acc, "largest"));
    ck_assert_msg(gap > 0.0118, "largest modelled gap %g", gap);
    json_t *at = json_object_get(acc, "at");
    ck_assert_int_eq(json_integer_value(json_object_get(at, "layer")), 5);
    ck_assert_int_ge(json_integer_value(json_object_get(at, "position")), 4000);
    json_decref(j);

    /* The two the wrong way round: said, since the test's settings set
     * the model. */
    snprintf(args, sizeof args, "compare %s/llama.h5 %s/ref.h5 --json", dir, dir);
    test_run_cli(args, out, sizeof out);
    j = json_loads(out, 0, NULL);
    ck_assert_msg(j, "%.3000s", out);
    const char *swapped = json_string_value(json_object_get(j, "swapped"));
    ck_assert_msg(swapped && !strcmp(swapped, "the first recording is llama.cpp's and the second "
                                              "kvdiff's reference"), "%.3000s", out);
    json_decref(j);

    j = record_compare(dir, "m.gguf", "--cache-type f16 --flash-attn on --fault decode-blind",
                       &rc);
    ck_assert_msg(rc == 1, "exit %d: %.3000s", rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 4000 &&
                  json_integer_value(json_object_get(d, "layer")) == 0 &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), "attn_out"),
                  "%.3000s", out);
    json_decref(j);

    /* Without flash attention the values are summed in f32: no model. */
    j = record_compare(dir, "m.gguf", "--cache-type f16", &rc);
    ck_assert_msg(rc == 0, "exit %d: %.3000s", rc, out);
    x = json_object_get(json_object_get(j, "mode"), "cross_runtime");
    ck_assert_msg(json_is_null(json_object_get(x, "f16_accumulation")), "%.3000s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* head_dim 64 with a q8_0 cache: llama.cpp rotates q, k (blocks of 64
 * here) and v (64) by a Walsh-Hadamard matrix before quantizing, so its
 * kqv_out is rotated; the recorder rotates it back and says so
 * (attn_rot_k, attn_rot_v), and the attention check rounds q, k, v the
 * same way. A correct run leaves a tiny residual; key 40 left out of 101
 * moves attn_out by 8%, under the q8_0 floor, and is found by the check
 * and named. */
/* A q4_0 cache (blocks of 32 on 16 levels, a query as q8_0 blocks
 * against it): attn_out errs by 0.5 to 0.9 of its rows in a correct run
 * of tiny-gemma4, so the size walk's floor there is wide; the attention
 * check rounds q, k, v as the runtime does and keeps q8_0's allowance.
 * Correct: "no bug", the check's residual far under 0.0196. A key left
 * out: found by the check and named. The full layers' base set to the
 * sliding one, and rope_freqs all ones: rotations no size step finds,
 * found by the rotation search (the first where the rotation stands out
 * of the cache's noise) and named. KV sharing wired otherwise (layer 4
 * on layer 2's cache), the test's config recorded from the GGUF: within
 * drift at every row, and diverged by the configs, said so and read back
 * from the JSON. */
static json_t *q4_record(const char *dir, const char *gguf, bool hf, const char *extra, int *rc)
{
    char args[2048], with_hf[600] = "";
    if (hf)
        snprintf(with_hf, sizeof with_hf, "--hf %s/hf ", dir);
    snprintf(args, sizeof args, "%s/%s %s--prompt-from %s/ref.h5 --max-new 2 --ignore-eos "
             "--threads 1 --cache-type q4_0 --flash-attn on %s --dump %s/llama.h5", dir, gguf,
             with_hf, dir, extra, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json", dir, dir);
    *rc = test_run_cli(args, out, sizeof out);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_msg(j, "%.3000s", out);
    return j;
}

static void q4_expect_step(json_t *j, int rc, long pos, int layer, const char *stage)
{
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(rc == 1 && json_integer_value(json_object_get(d, "position")) == pos &&
                  json_integer_value(json_object_get(d, "layer")) == layer &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), stage),
                  "q4_0: expected exit 1 at %ld/%d/%s, exit %d\n%.3000s", pos, layer, stage, rc,
                  out);
}

START_TEST(xrt_diag_q4_0)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_preset(dir, "tiny-gemma4", NULL);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    int rc;
    json_t *j = q4_record(dir, "m.gguf", true, "", &rc);
    ck_assert_msg(rc == 0, "correct q4_0 run: exit %d\n%.3000s", rc, out);
    json_t *x = json_object_get(json_object_get(j, "mode"), "cross_runtime");
    ck_assert_str_eq(json_string_value(json_object_get(x, "kv_precision")), "q4_0");
    json_t *ac = attention_check(j);
    ck_assert_msg(json_is_true(json_object_get(ac, "ran")) &&
                  json_real_value(json_object_get(ac, "threshold")) < 0.02 &&
                  json_real_value(json_object_get(json_object_get(ac, "closest"), "residual")) <
                      5e-3, "%.3000s", out);
    json_decref(j);

    j = q4_record(dir, "m.gguf", true, "--fault drop-key=40", &rc);
    q4_expect_step(j, rc, 100, 3, "attn_out");
    ck_assert_msg(json_is_true(json_object_get(attention_check(j), "step")), "%.3000s", out);
    expect_diag(json_object_get(j, "diagnosis"), "q4_0 drop-key", "missing_key", "recomputed",
                "the key at position 40 is not read", NULL);
    json_decref(j);

    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(patch_global_base(gguf, bad), 0);
    j = q4_record(dir, "bad.gguf", true, "", &rc);
    q4_expect_step(j, rc, 1, 3, "k");
    expect_diag(json_object_get(j, "diagnosis"), "q4_0 global base", "rope_convention",
                "recomputed", "theta 10000, the sliding layers' base, on a global layer", NULL);
    json_decref(j);

    ck_assert_int_eq(patch_freqs_ones(gguf, bad), 0);
    j = q4_record(dir, "bad.gguf", true, "", &rc);
    q4_expect_step(j, rc, 8, 3, "q");
    expect_diag(json_object_get(j, "diagnosis"), "q4_0 rope_freqs ones", "rope_convention",
                "recomputed", "of the 32 pairs of each head where the config turns 8",
                "it turns every position from 1 on; position 8 is the first where it stands "
                "out of the drift", NULL);
    json_decref(j);

    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 8), 0);
    j = q4_record(dir, "bad.gguf", false, "", &rc);
    ck_assert_msg(rc == 1 && json_is_null(json_object_get(j, "first_divergence")) &&
                  !strcmp(json_string_value(json_object_get(j, "verdict")), "diverged"),
                  "share8 q4_0: exit %d\n%.3000s", rc, out);
    const char *why = json_string_value(json_object_get(j, "config_differs"));
    json_t *g = json_object_get(j, "diagnosis");
    ck_assert_msg(!strcmp(field(g, "kind"), "kv_owner") && !strcmp(field(g, "basis"), "heuristic") &&
                  strstr(field(g, "summary"), "the test runs another model structure"),
                  "%.3000s", out);
    ck_assert_msg(why && strstr(why, "layer 4 reads layer 2's KV cache in ") &&
                  strstr(why, "llama.h5's config, its own in ") && strstr(why, "ref.h5's"),
                  "%.3000s", out);
    char path[512];
    snprintf(path, sizeof path, "%s/c.json", dir);
    ck_assert_int_eq(json_dump_file(j, path, 0), 0);
    kv_err e = {{0}};
    report_json back;
    ck_assert_msg(report_json_load(path, &back, &e) == 0, "%s", e.msg);
    ck_assert_str_eq(back.r.config_diff, why);
    ck_assert_int_eq(back.r.verdict, CMP_DIVERGED);
    char line[1024];
    report_verdict_line(&back.r, line, sizeof line);
    ck_assert_msg(strstr(line, "configs differ in what attention reads"), "%s", line);
    report_json_free(&back);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

START_TEST(xrt_diag_rotated_q8_0)
{
    char dir[64], args[1024];
    const char *hf = "tests/data/conformance/qwen3-hd64";
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --from %s --gguf %s/m.gguf", hf, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s --prompt-random 100 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", hf, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    /* record_compare reads the config from dir/hf */
    snprintf(args, sizeof args, "%s/hf", dir);
    char cwd[512];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
    char target[1024];
    snprintf(target, sizeof target, "%s/%s", cwd, hf);
    ck_assert_int_eq(symlink(target, args), 0);

    int rc;
    json_t *j = record_compare(dir, "m.gguf", "--cache-type q8_0 --flash-attn on", &rc);
    ck_assert_msg(rc == 0, "exit %d: %.3000s", rc, out);
    json_t *ac = attention_check(j);
    ck_assert_msg(json_is_true(json_object_get(ac, "ran")) &&
                  json_integer_value(json_object_get(ac, "layers")) == 3 &&
                  json_real_value(json_object_get(json_object_get(ac, "closest"), "residual")) <
                      2e-3, "%.3000s", out);
    json_decref(j);
    snprintf(args, sizeof args, "inspect %s/llama.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "\"attn_rot_k\":64,\"attn_rot_v\":64"), "%s", out);

    j = record_compare(dir, "m.gguf", "--cache-type q8_0 --flash-attn on --fault drop-key=40",
                       &rc);
    ck_assert_msg(rc == 1, "exit %d: %.3000s", rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == 100 &&
                  json_integer_value(json_object_get(d, "layer")) == 0 &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), "attn_out"),
                  "%.3000s", out);
    ck_assert_msg(json_is_true(json_object_get(attention_check(j), "step")), "%.3000s", out);
    expect_diag(json_object_get(j, "diagnosis"), "q8_0 drop-key", "missing_key", "recomputed",
                "the key at position 40 is not read", "rounded as the test holds them",
                NULL);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

Suite *xrt_diagnose_suite(void)
{
    Suite *s = suite_create("xrt_diagnose");
    TCase *tc = tcase_create("llama");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, xrt_diag_window_smaller);
    tcase_add_test(tc, xrt_diag_isolate_ubatch);
    tcase_add_test(tc, xrt_diag_drop_key);
    tcase_add_test(tc, xrt_diag_decode_blind);
    tcase_add_test(tc, xrt_diag_dup_key);
    tcase_add_test(tc, xrt_diag_kv_swapped);
    tcase_add_test(tc, xrt_diag_norm_eps);
    tcase_add_test(tc, xrt_diag_rope_local_is_global);
    tcase_add_test(tc, xrt_diag_rope_global_is_local);
    tcase_add_test(tc, xrt_diag_rope_common_base);
    tcase_add_test(tc, xrt_diag_rope_unpermuted);
    tcase_add_test(tc, xrt_diag_rope_dimension_count);
    tcase_add_test(tc, xrt_diag_kv_swapped_biased);
    tcase_add_test(tc, xrt_diag_gemma4_rope_swa_dims);
    tcase_add_test(tc, xrt_diag_gemma4_rope_global_base);
    tcase_add_test(tc, xrt_diag_gemma4_rope_freqs_ones);
    tcase_add_test(tc, xrt_diag_gemma4_sliding_as_full);
    tcase_add_test(tc, xrt_diag_rotation_under_floor);
    tcase_add_test(tc, xrt_diag_rotation_upstream_of_step);
    tcase_add_test(tc, xrt_diag_rope_scaling_dropped);
    tcase_add_test(tc, xrt_diag_rope_scaling_wrong);
    tcase_add_test(tc, xrt_diag_rope_llama3_dropped);
    tcase_add_test(tc, xrt_diag_rope_offset);
    tcase_add_test(tc, xrt_diag_attn_scale);
    tcase_add_test(tc, xrt_diag_norm_input);
    tcase_add_test(tc, xrt_diag_norm_q);
    tcase_add_test(tc, xrt_diag_norm_post_ffw);
    tcase_add_test(tc, xrt_diag_qk_norm_missing_llamacpp);
    tcase_add_test(tc, xrt_diag_qk_norm_missing);
    tcase_add_test(tc, xrt_diag_below_drift_bf16);
    tcase_add_test(tc, xrt_diag_rotated_q8_0);
    tcase_add_test(tc, xrt_diag_q4_0);
    tcase_add_test(tc, xrt_f16_accumulation_long);
    suite_add_tcase(s, tc);
    return s;
}
