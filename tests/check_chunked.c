/* check_chunked.c — the chunked engine against the reference.
 *
 * Correct strategies: every preset x cache x chunk size (around the window
 * and the chunk boundaries), prompt longer than the window and decode
 * crossing it, gives the reference's tokens and logits bit for bit.
 * Cascade attention stays within 1e-5. Every injection moves the first
 * divergence to exactly where docs/injections.md predicts, and changes
 * nothing where it cannot matter. The ring keeps its memory flat. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunked/chunked.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

#define P 40      /* prompt: longer than every tiny window (12) */
#define NEW 24    /* decode crosses the window again */
#define W 12      /* tiny-gemma3's window */

static const char *const presets[] = {"tiny-llama", "tiny-qwen2", "tiny-gemma3",
                                      "tiny-gemma3-kvshared", "tiny-llama3", "tiny-qwen3",
                                      "tiny-llama+attention_bias", "tiny-gemma4", "tiny-gpt-oss",
                                      "tiny-deepseek-v2", "tiny-deepseek-v3"};
#define N_PRESETS (int)(sizeof presets / sizeof *presets)

typedef struct {
    gen_result res;
    capture *cap;
} run_out;

/* A preset, or "PRESET+attention_bias": the preset with its q/k/v/o
 * biases switched on (as attention_bias in config.json does). */
static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    const char *plus = strchr(name, '+');
    if (!plus) {
        ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
        return;
    }
    char base[64];
    kv_config c;
    snprintf(base, sizeof base, "%.*s", (int)(plus - name), name);
    ck_assert_str_eq(plus + 1, "attention_bias");
    ck_assert_msg(config_preset(base, &c, &e) == 0, "%s", e.msg);
    c.qkv_bias = c.o_bias = true;
    ck_assert_msg(model_from_config(&c, name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

/* Runs `engine` ("reference" or chunked with o) on a fixed prompt. */
static void run(const kv_model *m, const chk_opts *o, int p, int nnew, bool record, run_out *out)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    out->cap = record ? capture_new(p + nnew) : NULL;
    kv_observer *obs = record ? &out->cap->base : NULL;
    kv_engine *eng;
    if (o) {
        chk_opts co = *o;
        co.max_ctx = p + nnew;
        eng = chk_create(m, &kc, &co, obs, &e);
    } else {
        ref_opts ro = {.max_ctx = p + nnew, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, &e);
    }
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[256];
    for (int i = 0; i < p; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m->cfg.vocab);
    gen_opts go = {.max_new = nnew, .ignore_eos = true, .keep_logits = true,
                   .samp = {.temperature = 0, .top_p = 1}};
    ck_assert_msg(generate(eng, &m->cfg, prompt, p, &go, obs, &out->res, &e) == 0, "%s", e.msg);
    engine_free(eng);
}

static void run_free(run_out *r)
{
    gen_result_free(&r->res);
    capture_free(r->cap);
}

static bool same_output(const run_out *a, const run_out *b, int vocab)
{
    int n = a->res.n_prompt + a->res.n_new;
    return memcmp(a->res.tokens, b->res.tokens, (size_t)n * 4) == 0 &&
           memcmp(a->res.step_logits, b->res.step_logits,
                  (size_t)a->res.n_new * vocab * 4) == 0;
}

/* ------------------------------------------------------------------ */
/* Bit-identical sweep                                                  */

START_TEST(test_sweep_bit_identical)
{
    static const int chunks[] = {1, 2, 3, W - 1, W, W + 1, 16, P};
    kv_model m;
    open_model(presets[_i], &m);
    run_out ref;
    run(&m, NULL, P, NEW, false, &ref);
    for (int cache = 0; cache < CACHE_KIND_COUNT; cache++)
        for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++) {
            chk_opts o;
            chk_opts_default(&o);
            o.cache = (chk_cache_kind)cache;
            o.chunk = chunks[c];
            run_out got;
            run(&m, &o, P, NEW, false, &got);
            ck_assert_msg(same_output(&ref, &got, m.cfg.vocab),
                          "%s: cache %s chunk %d differs from the reference", presets[_i],
                          chk_cache_name(o.cache), o.chunk);
            run_free(&got);
        }
    run_free(&ref);
    model_free(&m);
}
END_TEST

START_TEST(test_kv_share_variants_bit_identical)
{
    kv_model m;
    open_model("tiny-gemma3-kvshared", &m);
    run_out ref;
    run(&m, NULL, P, NEW, false, &ref);
    for (int share = 0; share < SHARE_KIND_COUNT; share++)
        for (int cache = 0; cache < CACHE_KIND_COUNT; cache++)
            for (int chunk = 3; chunk <= 16; chunk += 13) {
                chk_opts o;
                chk_opts_default(&o);
                o.share = (chk_share_kind)share;
                o.cache = (chk_cache_kind)cache;
                o.chunk = chunk;
                run_out got;
                run(&m, &o, P, NEW, false, &got);
                ck_assert_msg(same_output(&ref, &got, m.cfg.vocab),
                              "kv-share %s cache %s chunk %d differs", chk_share_name(o.share),
                              chk_cache_name(o.cache), chunk);
                run_free(&got);
            }
    run_free(&ref);
    model_free(&m);
}
END_TEST

/* Every recorded row, not just the output, matches (one strategy each). */
START_TEST(test_every_stage_bit_identical)
{
    kv_model m;
    open_model(presets[_i], &m);
    run_out ref, got;
    chk_opts o;
    chk_opts_default(&o);
    o.cache = CACHE_RING;
    o.chunk = 5;
    run(&m, NULL, P, NEW, true, &ref);
    run(&m, &o, P, NEW, true, &got);
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = -1; l < m.cfg.n_layers; l++) {
            int na, nb;
            const float *a = capture_get(ref.cap, st, l, &na), *b = capture_get(got.cap, st, l, &nb);
            ck_assert((a == NULL) == (b == NULL));
            if (a)
                ck_assert_msg(memcmp(a, b, (size_t)(P + NEW - 1) * na * 4) == 0,
                              "%s: %s of layer %d differs", presets[_i], stage_name(st), l);
        }
    run_free(&ref);
    run_free(&got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Cascade: close, not identical                                        */

START_TEST(test_cascade_within_tolerance)
{
    kv_model m;
    open_model(presets[_i], &m);
    run_out ref;
    run(&m, NULL, P, NEW, false, &ref);
    int differs = 0;
    for (int cache = 0; cache < CACHE_KIND_COUNT; cache++)
        for (int chunk = 3; chunk <= 16; chunk += 13) {
            chk_opts o;
            chk_opts_default(&o);
            o.attn = CHK_ATTN_CASCADE;
            o.cache = (chk_cache_kind)cache;
            o.chunk = chunk;
            run_out got;
            run(&m, &o, P, NEW, false, &got);
            ck_assert_int_eq(memcmp(ref.res.tokens, got.res.tokens, (P + NEW) * 4), 0);
            for (int s = 0; s < NEW; s++) {
                size_t off = (size_t)s * m.cfg.vocab;
                double rel = test_rel_err(got.res.step_logits + off, ref.res.step_logits + off,
                                          (size_t)m.cfg.vocab);
                ck_assert_msg(rel <= 1e-5, "%s cascade %s chunk %d step %d: %.3g", presets[_i],
                              chk_cache_name(o.cache), chunk, s, rel);
            }
            differs += !same_output(&ref, &got, m.cfg.vocab);
            run_free(&got);
        }
    ck_assert_msg(differs > 0, "cascade gave the reference's exact bits: not a different order");
    run_free(&ref);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Injections land where docs/injections.md says                        */

typedef struct {
    int64_t pos;
    int layer;
    int stage;
} where;

/* First differing row in dataflow order: positions, then layers (the
 * embedding first, logits last), then stages. pos = -1 when none. */
static where first_divergence(const capture *a, const capture *b, int T, int L)
{
    for (int64_t p = 0; p < T; p++)
        for (int l = -1; l <= L; l++) {
            int s0 = l < 0 ? STAGE_EMBED : l < L ? 0 : STAGE_FINAL_NORM;
            int s1 = l < 0 ? STAGE_EMBED + 1 : l < L ? STAGE_LAYER_COUNT : STAGE_COUNT;
            int layer = (l == L) ? -1 : l;
            for (int st = s0; st < s1; st++) {
                int na, nb;
                const float *x = capture_get(a, st, layer, &na), *y = capture_get(b, st, layer, &nb);
                if (!x || !y)
                    continue;
                if (memcmp(x + p * na, y + p * nb, (size_t)na * 4) != 0)
                    return (where){p, layer, st};
            }
        }
    return (where){-1, -1, -1};
}

typedef struct {
    const char *preset;
    chk_cache_kind cache;
    int chunk;
    const char *inject;
    chk_share_kind share;
    int p, nnew;
    where want;          /* pos -1: the injection cannot matter here */
} inj_case;

static const inj_case inj_cases[] = {
    {"tiny-gemma3", CACHE_DENSE, 5, "isolated-chunks", SHARE_PLAIN, P, NEW, {5, 0, STAGE_ATTN_LSE}},
    {"tiny-llama", CACHE_RING, 16, "isolated-chunks", SHARE_PLAIN, P, NEW, {16, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_SPLIT, 64, "isolated-chunks", SHARE_PLAIN, P, NEW, {P, 0, STAGE_ATTN_LSE}},
    {"tiny-qwen2", CACHE_SPLIT, 7, "isolated-chunks-pos", SHARE_PLAIN, P, NEW, {7, 0, STAGE_Q}},
    {"tiny-gemma3", CACHE_RING, 5, "window=4", SHARE_PLAIN, P, NEW, {4, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_DENSE, 16, "window=20", SHARE_PLAIN, P, NEW, {W, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_RING, 5, "stale-local", SHARE_PLAIN, P, NEW, {5, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3-kvshared", CACHE_DENSE, 7, "stale-local", SHARE_PLAIN, P, NEW, {7, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3-kvshared", CACHE_DENSE, 16, "zero-shared-kv", SHARE_PLAIN, P, NEW, {0, 8, STAGE_ATTN_LSE}},
    {"tiny-gemma3-kvshared", CACHE_RING, 16, "zero-shared-kv", SHARE_OWNER_READ_ONLY, P, NEW, {0, 8, STAGE_ATTN_LSE}},
    /* Gemma 4: the first shared layer is 8 (sliding, reading layer 6). */
    {"tiny-gemma4", CACHE_DENSE, 16, "zero-shared-kv", SHARE_PLAIN, P, NEW, {0, 8, STAGE_ATTN_LSE}},
    {"tiny-gemma4", CACHE_RING, 16, "zero-shared-kv", SHARE_OWNER_READ_ONLY, P, NEW, {0, 8, STAGE_ATTN_LSE}},
    {"tiny-gemma4", CACHE_RING, 5, "window=4", SHARE_PADDED, P, NEW, {4, 0, STAGE_ATTN_LSE}},
    {"tiny-llama", CACHE_SPLIT, 16, "split-mask-off-by-one", SHARE_PLAIN, P, NEW, {P, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P, NEW, {P + 1, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_DENSE, 16, "decode-index-stuck", SHARE_PLAIN, P, NEW, {P + 1, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_RING, 3, "decode-index-stuck", SHARE_PLAIN, P, NEW, {P + 1, 0, STAGE_ATTN_LSE}},
    {"tiny-qwen2", CACHE_DENSE, 16, "rope-offset=3", SHARE_PLAIN, P, NEW, {P, 0, STAGE_Q}},
    {"tiny-gemma3", CACHE_RING, 5, "ring-no-wrap", SHARE_PLAIN, P, NEW, {W + 5, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_RING, 16, "ring-no-wrap", SHARE_PLAIN, P, NEW, {W + 16, 0, STAGE_ATTN_LSE}},
    {"tiny-llama", CACHE_SPLIT, 16, "split-decode-blind", SHARE_PLAIN, P, NEW, {P, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3", CACHE_SPLIT, 5, "split-decode-blind", SHARE_PLAIN, P, NEW, {P, 0, STAGE_ATTN_LSE}},
    {"tiny-gemma3-kvshared", CACHE_SPLIT, P, "split-decode-blind", SHARE_OWNER_READ_ONLY, P, NEW, {P, 0, STAGE_ATTN_LSE}},
    /* Where the bug cannot matter, nothing changes. */
    {"tiny-gemma3", CACHE_DENSE, 16, "window=12", SHARE_PLAIN, P, NEW, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_DENSE, 4, "window=11", SHARE_PLAIN, 6, 4, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_RING, 5, "ring-no-wrap", SHARE_PLAIN, 6, 4, {-1, -1, -1}},
    {"tiny-llama", CACHE_SPLIT, 16, "split-mask-off-by-one", SHARE_PLAIN, P, 1, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P, 2, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_SPLIT, 16, "split-decode-blind", SHARE_PLAIN, P, 1, {-1, -1, -1}},
    {"tiny-qwen2", CACHE_DENSE, 16, "rope-offset=3", SHARE_PLAIN, P, 1, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_DENSE, P, "isolated-chunks", SHARE_PLAIN, P, 1, {-1, -1, -1}},
    {"tiny-gemma3", CACHE_DENSE, P, "stale-local", SHARE_PLAIN, P, 1, {-1, -1, -1}},
};

START_TEST(test_injection_lands_where_predicted)
{
    const inj_case *ic = &inj_cases[_i];
    kv_model m;
    kv_err e = {{0}};
    open_model(ic->preset, &m);
    chk_opts o;
    chk_opts_default(&o);
    o.cache = ic->cache;
    o.chunk = ic->chunk;
    o.share = ic->share;
    ck_assert_msg(chk_injection_parse(ic->inject, &o.inj, &e) == 0, "%s", e.msg);
    run_out ref, got;
    run(&m, NULL, ic->p, ic->nnew, true, &ref);
    run(&m, &o, ic->p, ic->nnew, true, &got);
    where w = first_divergence(ref.cap, got.cap, ic->p + ic->nnew, m.cfg.n_layers);
    ck_assert_msg(w.pos == ic->want.pos && w.layer == ic->want.layer && w.stage == ic->want.stage,
                  "%s on %s (%s, chunk %d, prompt %d + %d): first divergence at position %lld "
                  "layer %d stage %s; predicted position %lld layer %d stage %s",
                  ic->inject, ic->preset, chk_cache_name(ic->cache), ic->chunk, ic->p, ic->nnew,
                  (long long)w.pos, w.layer, w.stage >= 0 ? stage_name(w.stage) : "-",
                  (long long)ic->want.pos, ic->want.layer,
                  ic->want.stage >= 0 ? stage_name(ic->want.stage) : "-");
    /* The output moves exactly when the bug matters. */
    ck_assert_int_eq(same_output(&ref, &got, m.cfg.vocab), ic->want.pos < 0);
    run_free(&ref);
    run_free(&got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Memory and refusals                                                  */

START_TEST(test_ring_memory_flat)
{
    kv_model m;
    kv_err e = {{0}};
    open_model("tiny-gemma3", &m);
    kern_ctx kc = {.isa = kern_isa_best()};
    size_t sliding[2], global[2];
    const int ctx[2] = {64, 4096};
    for (int i = 0; i < 2; i++) {
        chk_opts o;
        chk_opts_default(&o);
        o.cache = CACHE_RING;
        o.chunk = 8;
        o.max_ctx = ctx[i];
        kv_engine *eng = chk_create(&m, &kc, &o, NULL, &e);
        ck_assert_msg(eng != NULL, "%s", e.msg);
        sliding[i] = chk_cache_bytes_of(eng, ATTN_SLIDING);
        global[i] = chk_cache_bytes_of(eng, ATTN_GLOBAL);
        engine_free(eng);
    }
    ck_assert_uint_eq(sliding[0], sliding[1]);
    /* window + chunk slots x 5 sliding layers x K and V x KV*D floats */
    ck_assert_uint_eq(sliding[0], (size_t)(W + 8) * 5 * 2 * 64 * sizeof(float));
    ck_assert_uint_eq(global[1], global[0] * 64);
    model_free(&m);
}
END_TEST

/* plain sharing keeps a copy per follower; the other variants none. */
START_TEST(test_kv_share_storage)
{
    kv_model m;
    kv_err e = {{0}};
    open_model("tiny-gemma3-kvshared", &m);
    kern_ctx kc = {.isa = kern_isa_best()};
    size_t bytes[SHARE_KIND_COUNT];
    for (int share = 0; share < SHARE_KIND_COUNT; share++) {
        chk_opts o;
        chk_opts_default(&o);
        o.share = (chk_share_kind)share;
        o.max_ctx = 64;
        o.share_pad = 48; /* head_dim 32 stored as 48 */
        kv_engine *eng = chk_create(&m, &kc, &o, NULL, &e);
        ck_assert_msg(eng != NULL, "%s", e.msg);
        bytes[share] = eng->cache_bytes(eng);
        engine_free(eng);
    }
    const size_t per_layer = 64 * 2 * 64 * sizeof(float); /* slots x K,V x KV*D */
    ck_assert_uint_eq(bytes[SHARE_OWNER_READ_ONLY], 8 * per_layer);  /* 8 owners */
    ck_assert_uint_eq(bytes[SHARE_PLAIN], 12 * per_layer);           /* + 4 followers */
    ck_assert_uint_eq(bytes[SHARE_PADDED], 8 * per_layer * 48 / 32); /* padded rows */
    model_free(&m);
}
END_TEST

START_TEST(test_refusals)
{
    kv_model g, k;
    kv_err e = {{0}};
    open_model("tiny-gemma3", &g);
    open_model("tiny-llama", &k);
    kern_ctx kc = {.isa = kern_isa_best()};
    struct {
        kv_model *m;
        int chunk, cache;
        const char *inject, *needle;
    } cases[] = {
        {&g, 0, CACHE_DENSE, NULL, "--chunk 0"},
        {&g, 65, CACHE_DENSE, NULL, "--chunk 65"},
        {&g, 4, CACHE_DENSE, "zero-shared-kv", "no KV-shared layer"},
        {&g, 4, CACHE_DENSE, "split-mask-off-by-one", "needs --cache split"},
        {&g, 4, CACHE_RING, "split-decode-blind", "needs --cache split"},
        {&g, 4, CACHE_SPLIT, "ring-no-wrap", "needs --cache ring"},
        {&k, 4, CACHE_RING, "ring-no-wrap", "no sliding-window layer"},
        {&k, 4, CACHE_DENSE, "window=8", "no sliding-window layer"},
        {&k, 4, CACHE_DENSE, "stale-local", "no sliding-window layer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        chk_opts o;
        chk_opts_default(&o);
        o.chunk = cases[i].chunk;
        o.cache = (chk_cache_kind)cases[i].cache;
        o.max_ctx = 64;
        if (cases[i].inject)
            ck_assert_int_eq(chk_injection_parse(cases[i].inject, &o.inj, &e), 0);
        ck_assert_ptr_null(chk_create(cases[i].m, &kc, &o, NULL, &e));
        ck_assert_msg(strstr(e.msg, cases[i].needle), "case %zu: %s", i, e.msg);
    }
    chk_injections inj;
    memset(&inj, 0, sizeof inj);
    ck_assert_int_eq(chk_injection_parse("nope", &inj, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "unknown injection 'nope'"));
    ck_assert_int_eq(chk_injection_parse("window", &inj, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "needs a value"));
    ck_assert_int_eq(chk_injection_parse("window=abc", &inj, &e), -1);
    ck_assert_int_eq(chk_injection_parse("window=0", &inj, &e), -1);
    ck_assert_int_eq(chk_injection_parse("stale-local=3", &inj, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "takes no value"));
    model_free(&g);
    model_free(&k);
}
END_TEST

Suite *chunked_suite(void)
{
    Suite *s = suite_create("chunked");
    TCase *tc = tcase_create("engine");
    tcase_add_loop_test(tc, test_sweep_bit_identical, 0, N_PRESETS);
    tcase_add_test(tc, test_kv_share_variants_bit_identical);
    tcase_add_loop_test(tc, test_every_stage_bit_identical, 0, N_PRESETS);
    tcase_add_loop_test(tc, test_cascade_within_tolerance, 0, N_PRESETS);
    tcase_add_loop_test(tc, test_injection_lands_where_predicted, 0,
                        (int)(sizeof inj_cases / sizeof *inj_cases));
    tcase_add_test(tc, test_ring_memory_flat);
    tcase_add_test(tc, test_kv_share_storage);
    tcase_add_test(tc, test_refusals);
    suite_add_tcase(s, tc);
    return s;
}
