/* check_compare.c — the comparer against the engines.
 *
 * Every injection of the catalogue, recorded with cmp_memrec beside the
 * reference, must be located at exactly the (position, layer, stage)
 * docs/injections.md predicts and named by the matching diagnosis. Correct
 * strategies compare identical; cascade attention is numeric drift in
 * exact mode and the same within a tolerance or a noise floor. Refusals,
 * partial overlaps, NaN, element locations, fingerprints, tokens and the
 * renderers are checked on small planted cases. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "chunked/chunked.h"
#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "model/pcg32.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

#define P 40      /* prompt: longer than every tiny window (12) */
#define NEW 24    /* decode crosses the window again */
#define W 12      /* tiny-gemma3's window */

/* ------------------------------------------------------------------ */
/* Recording                                                            */

typedef struct {
    const char *preset;
    const chk_opts *o;           /* NULL: the reference */
    const char *inject;          /* for the settings JSON only */
    int p, nnew;
    int prompt_salt;             /* 0: the standard prompt */
    const cmp_memrec_opts *mo;   /* NULL: record everything */
} rec_spec;

static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

static void settings_json(const rec_spec *s, char *buf, size_t n)
{
    if (!s->o) {
        snprintf(buf, n, "{\"engine\":\"reference\",\"max_ctx\":%d}", s->p + s->nnew);
        return;
    }
    snprintf(buf, n, "{\"engine\":\"chunked\",\"chunk\":%d,\"cache\":\"%s\",\"attention\":\"%s\","
             "\"inject\":\"%s\",\"max_ctx\":%d}", s->o->chunk, chk_cache_name(s->o->cache),
             s->o->attn == CHK_ATTN_CASCADE ? "cascade" : "exact", s->inject ? s->inject : "none",
             s->p + s->nnew);
}

/* Runs the engine on the model and returns its recording. */
static cmp_memrec *record(const kv_model *m, const rec_spec *s)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    char settings[512];
    settings_json(s, settings, sizeof settings);
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, s->o ? "chunked" : "reference", settings, s->mo, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    kv_engine *eng;
    if (s->o) {
        chk_opts co = *s->o;
        co.max_ctx = s->p + s->nnew;
        eng = chk_create(m, &kc, &co, obs, &e);
    } else {
        ref_opts ro = {.max_ctx = s->p + s->nnew, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, &e);
    }
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[256];
    for (int i = 0; i < s->p; i++)
        prompt[i] = (int32_t)((i * 53 + 7 + s->prompt_salt * (i == 5)) % m->cfg.vocab);
    gen_opts go = {.max_new = s->nnew, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, s->p, &go, obs, &res, &e) == 0, "%s", e.msg);
    ck_assert_msg(cmp_memrec_error(rec) == NULL, "%s", cmp_memrec_error(rec));
    gen_result_free(&res);
    engine_free(eng);
    return rec;
}

static cmp_memrec *record_ref(const kv_model *m, int p, int nnew)
{
    rec_spec s = {.preset = NULL, .p = p, .nnew = nnew};
    return record(m, &s);
}

static chk_opts chunked(chk_cache_kind cache, int chunk)
{
    chk_opts o;
    chk_opts_default(&o);
    o.cache = cache;
    o.chunk = chunk;
    return o;
}

/* Compares two recordings; asserts success. */
static void compare(cmp_memrec *a, cmp_memrec *b, const cmp_opts *o, cmp_result *r)
{
    cmp_source sa, sb;
    kv_err e = {{0}};
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    ck_assert_msg(cmp_compare(&sa, &sb, o, r, &e) == 0, "%s", e.msg);
}

static void dump_on_failure(const cmp_result *r, char *buf, size_t n)
{
    char *t = cmp_render_text(r, 0);
    snprintf(buf, n, "%s", t ? t : "(render failed)");
    free(t);
}

/* ------------------------------------------------------------------ */
/* Every injection: exact location and the matching diagnosis           */

typedef struct {
    const char *preset;
    chk_cache_kind cache;
    int chunk;
    const char *inject;
    chk_share_kind share;
    int64_t pos;
    int layer;
    kv_stage stage;
    cmp_diag_kind diag;
} inj_case;

static const inj_case inj_cases[] = {
    {"tiny-gemma3", CACHE_DENSE, 5, "isolated-chunks", SHARE_PLAIN, 5, 0, STAGE_ATTN_LSE, CMP_DIAG_CHUNK_ISOLATED},
    {"tiny-llama", CACHE_RING, 16, "isolated-chunks", SHARE_PLAIN, 16, 0, STAGE_ATTN_LSE, CMP_DIAG_CHUNK_ISOLATED},
    {"tiny-gemma3", CACHE_SPLIT, 64, "isolated-chunks", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_CHUNK_ISOLATED},
    {"tiny-qwen2", CACHE_SPLIT, 7, "isolated-chunks-pos", SHARE_PLAIN, 7, 0, STAGE_Q, CMP_DIAG_ROPE_OFFSET},
    {"tiny-gemma3", CACHE_RING, 5, "window=4", SHARE_PLAIN, 4, 0, STAGE_ATTN_LSE, CMP_DIAG_WINDOW},
    {"tiny-gemma3", CACHE_DENSE, 16, "window=20", SHARE_PLAIN, W, 0, STAGE_ATTN_LSE, CMP_DIAG_WINDOW},
    {"tiny-gemma3", CACHE_RING, 5, "stale-local", SHARE_PLAIN, 5, 0, STAGE_ATTN_LSE, CMP_DIAG_STALE_CACHE},
    {"tiny-gemma3-kvshared", CACHE_DENSE, 7, "stale-local", SHARE_PLAIN, 7, 0, STAGE_ATTN_LSE, CMP_DIAG_STALE_CACHE},
    {"tiny-gemma3", CACHE_DENSE, P, "stale-local", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_STALE_CACHE},
    {"tiny-gemma3-kvshared", CACHE_DENSE, 16, "zero-shared-kv", SHARE_PLAIN, 0, 8, STAGE_ATTN_LSE, CMP_DIAG_ZERO_KV},
    {"tiny-gemma3-kvshared", CACHE_RING, 16, "zero-shared-kv", SHARE_OWNER_READ_ONLY, 0, 8, STAGE_ATTN_LSE, CMP_DIAG_ZERO_KV},
    /* Gemma 4: head sizes and KV heads differ between layer types. */
    {"tiny-gemma4", CACHE_DENSE, 16, "zero-shared-kv", SHARE_PLAIN, 0, 8, STAGE_ATTN_LSE, CMP_DIAG_ZERO_KV},
    {"tiny-gemma4", CACHE_RING, 5, "window=4", SHARE_PADDED, 4, 0, STAGE_ATTN_LSE, CMP_DIAG_WINDOW},
    {"tiny-gemma4", CACHE_DENSE, 7, "stale-local", SHARE_PLAIN, 7, 0, STAGE_ATTN_LSE, CMP_DIAG_STALE_CACHE},
    {"tiny-gemma4", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    /* gpt-oss: the sink bugs (first seen in attn_sink, the sink's share),
     * and the cache bugs of a sink model (attention recomputed with the
     * sinks recovered from the reference). */
    {"tiny-gpt-oss", CACHE_DENSE, 5, "sink-dropped", SHARE_PLAIN, 0, 0, STAGE_ATTN_SINK, CMP_DIAG_SINK},
    {"tiny-gpt-oss", CACHE_RING, 7, "sink-dropped@3", SHARE_PLAIN, 0, 3, STAGE_ATTN_SINK, CMP_DIAG_SINK},
    {"tiny-gpt-oss", CACHE_SPLIT, 16, "sink-prefill-only", SHARE_PLAIN, P, 0, STAGE_ATTN_SINK, CMP_DIAG_SINK},
    {"tiny-gpt-oss", CACHE_RING, 5, "sink-windowed", SHARE_PLAIN, W, 0, STAGE_ATTN_SINK, CMP_DIAG_SINK},
    {"tiny-gpt-oss", CACHE_DENSE, 5, "window=11", SHARE_PLAIN, 11, 0, STAGE_ATTN_LSE, CMP_DIAG_WINDOW},
    {"tiny-gpt-oss", CACHE_RING, 5, "window=13", SHARE_PLAIN, W, 0, STAGE_ATTN_LSE, CMP_DIAG_WINDOW},
    {"tiny-gpt-oss", CACHE_DENSE, 5, "isolated-chunks", SHARE_PLAIN, 5, 0, STAGE_ATTN_LSE, CMP_DIAG_CHUNK_ISOLATED},
    {"tiny-gpt-oss", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    {"tiny-llama", CACHE_SPLIT, 16, "split-mask-off-by-one", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_EXTRA_KEY},
    {"tiny-gemma3", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    {"tiny-gemma3", CACHE_DENSE, 16, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    {"tiny-gemma3", CACHE_RING, 3, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    {"tiny-qwen2", CACHE_DENSE, 16, "rope-offset=3", SHARE_PLAIN, P, 0, STAGE_Q, CMP_DIAG_ROPE_OFFSET},
    {"tiny-gemma3", CACHE_RING, 5, "ring-no-wrap", SHARE_PLAIN, W + 5, 0, STAGE_ATTN_LSE, CMP_DIAG_RING_NO_WRAP},
    {"tiny-gemma3", CACHE_RING, 16, "ring-no-wrap", SHARE_PLAIN, W + 16, 0, STAGE_ATTN_LSE, CMP_DIAG_RING_NO_WRAP},
    /* MLA (latent caches): their own bugs, and the cache bugs of a model
     * whose values are narrower than its keys. */
    {"tiny-deepseek-v2", CACHE_DENSE, 5, "mla-rope-twice", SHARE_PLAIN, 1, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v3", CACHE_SPLIT, 7, "mla-rope-twice", SHARE_PLAIN, 1, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v2", CACHE_DENSE, 7, "mla-rope-uncached", SHARE_PLAIN, 7, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v3", CACHE_RING, 16, "mla-rope-uncached", SHARE_PLAIN, 16, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v2", CACHE_SPLIT, 16, "mla-no-mscale", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v3", CACHE_DENSE, 5, "mla-no-mscale", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v2", CACHE_DENSE, 16, "mla-mixed-forms", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v3", CACHE_SPLIT, 5, "mla-mixed-forms", SHARE_PLAIN, P, 0, STAGE_ATTN_LSE, CMP_DIAG_LATENT_CACHE},
    {"tiny-deepseek-v2", CACHE_DENSE, 7, "isolated-chunks", SHARE_PLAIN, 7, 0, STAGE_ATTN_LSE, CMP_DIAG_CHUNK_ISOLATED},
    {"tiny-deepseek-v2", CACHE_SPLIT, 16, "decode-index-stuck", SHARE_PLAIN, P + 1, 0, STAGE_ATTN_LSE, CMP_DIAG_DECODE_STUCK},
    {"tiny-deepseek-v3", CACHE_DENSE, 16, "rope-offset=3", SHARE_PLAIN, P, 0, STAGE_Q, CMP_DIAG_ROPE_OFFSET},
    {"tiny-deepseek-v2", CACHE_SPLIT, 7, "isolated-chunks-pos", SHARE_PLAIN, 7, 0, STAGE_Q, CMP_DIAG_ROPE_OFFSET},
};

/* The catalogue entry of an injection on a cache and chunk size. */
static const inj_case *find_case(const char *inject, chk_cache_kind cache, int chunk)
{
    for (size_t i = 0; i < sizeof inj_cases / sizeof *inj_cases; i++)
        if (!strcmp(inj_cases[i].inject, inject) && inj_cases[i].cache == cache &&
            inj_cases[i].chunk == chunk)
            return &inj_cases[i];
    ck_abort_msg("no case %s", inject);
    return NULL;
}

static void run_injection(const inj_case *ic, const cmp_memrec_opts *mo, cmp_result *r,
                          kv_model *m, cmp_memrec **ref, cmp_memrec **got)
{
    kv_err e = {{0}};
    open_model(ic->preset, m);
    chk_opts o = chunked(ic->cache, ic->chunk);
    o.share = ic->share;
    ck_assert_msg(chk_injection_parse(ic->inject, &o.inj, &e) == 0, "%s", e.msg);
    rec_spec rs = {.p = P, .nnew = NEW, .mo = mo};
    *ref = record(m, &rs);
    rec_spec s = {.o = &o, .inject = ic->inject, .p = P, .nnew = NEW, .mo = mo};
    *got = record(m, &s);
    compare(*ref, *got, NULL, r);
}

START_TEST(test_injection_located_and_diagnosed)
{
    const inj_case *ic = &inj_cases[_i];
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, NULL, &r, &m, &ref, &got);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    const cmp_divergence *d = &r.first;
    ck_assert_msg(r.verdict == CMP_DIVERGED && d->found, "%s on %s: not diverged\n%s", ic->inject,
                  ic->preset, text);
    ck_assert_msg(d->pos == ic->pos && d->layer == ic->layer && d->stage == ic->stage,
                  "%s on %s (%s, chunk %d): first divergence at %lld/%d/%s, predicted "
                  "%lld/%d/%s\n%s", ic->inject, ic->preset, chk_cache_name(ic->cache), ic->chunk,
                  (long long)d->pos, d->layer, stage_name(d->stage), (long long)ic->pos,
                  ic->layer, stage_name(ic->stage), text);
    ck_assert_msg(r.diag.kind == ic->diag, "%s on %s: diagnosis %s, expected %s\n%s", ic->inject,
                  ic->preset, cmp_diag_name(r.diag.kind), cmp_diag_name(ic->diag), text);
    /* Every one is established from the recorded values, not guessed. */
    ck_assert_msg(r.diag.basis == CMP_BASIS_RECOMPUTED || r.diag.basis == CMP_BASIS_EXACT_CHECK,
                  "%s: basis %s\n%s", ic->inject, cmp_basis_name(r.diag.basis), text);
    ck_assert_int_eq(cmp_exit_code(0, &r), 1);
    /* The injections move attention's reads or q's rotation, never q/k/v. */
    if (ic->stage != STAGE_Q)
        ck_assert_msg(r.ev.qkv == 1, "%s: q, k, v not identical up to p\n%s", ic->inject, text);
    if (!strncmp(ic->inject, "rope-offset=", 12))
        ck_assert_int_eq(r.ev.rope_delta, 3);
    if (!strcmp(ic->inject, "isolated-chunks-pos"))
        ck_assert_int_eq(ic->pos + r.ev.rope_delta, 0);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* Where an injection cannot matter, the comparer says identical. */
typedef struct {
    const char *preset;
    chk_cache_kind cache;
    int chunk;
    const char *inject;
    int p, nnew;
} noop_case;

static const noop_case noop_cases[] = {
    {"tiny-gemma3", CACHE_DENSE, 16, "window=12", P, NEW},
    {"tiny-gemma3", CACHE_RING, 5, "ring-no-wrap", 6, 4},
    {"tiny-llama", CACHE_SPLIT, 16, "split-mask-off-by-one", P, 1},
    {"tiny-gemma3", CACHE_SPLIT, 16, "decode-index-stuck", P, 2},
    {"tiny-gemma3", CACHE_DENSE, P, "stale-local", P, 1},
};

START_TEST(test_injection_that_cannot_matter_is_identical)
{
    const noop_case *nc = &noop_cases[_i];
    kv_model m;
    kv_err e = {{0}};
    open_model(nc->preset, &m);
    chk_opts o = chunked(nc->cache, nc->chunk);
    ck_assert_int_eq(chk_injection_parse(nc->inject, &o.inj, &e), 0);
    cmp_memrec *ref = record_ref(&m, nc->p, nc->nnew);
    rec_spec s = {.o = &o, .inject = nc->inject, .p = nc->p, .nnew = nc->nnew};
    cmp_memrec *got = record(&m, &s);
    cmp_result r;
    compare(ref, got, NULL, &r);
    ck_assert_int_eq(r.verdict, CMP_IDENTICAL);
    ck_assert_int_eq(r.tokens.kind, CMP_TOKENS_IDENTICAL);
    ck_assert_int_eq(cmp_exit_code(0, &r), 0);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* Without q, k, v in the recordings (another engine may record only the
 * attention statistics) the key-set rules fall back to positions and
 * counts, and say so. */
START_TEST(test_heuristic_when_not_recomputable)
{
    const inj_case *cases[] = {find_case("window=4", CACHE_RING, 5),
                               find_case("ring-no-wrap", CACHE_RING, 5),
                               find_case("decode-index-stuck", CACHE_DENSE, 16),
                               find_case("stale-local", CACHE_RING, 5)};
    const inj_case *ic = cases[_i];
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    mo.stages[STAGE_Q] = mo.stages[STAGE_K] = mo.stages[STAGE_V] = false;
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, &mo, &r, &m, &ref, &got);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.first.pos == ic->pos && r.first.layer == ic->layer &&
                  r.first.stage == ic->stage, "%s\n%s", ic->inject, text);
    ck_assert_msg(r.diag.kind == ic->diag && r.diag.basis == CMP_BASIS_HEURISTIC,
                  "%s: %s / %s\n%s", ic->inject, cmp_diag_name(r.diag.kind),
                  cmp_basis_name(r.diag.basis), text);
    ck_assert_int_eq(r.ev.qkv, -1);
    ck_assert_ptr_nonnull(strstr(text, "heuristic"));
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Correct strategies are identical; cascade is drift                   */

static const char *const presets[] = {"tiny-llama", "tiny-qwen2", "tiny-gemma3",
                                      "tiny-gemma3-kvshared", "tiny-gemma4", "tiny-gpt-oss",
                                      "tiny-deepseek-v2", "tiny-deepseek-v3"};
#define N_PRESETS (int)(sizeof presets / sizeof *presets)

/* One correct strategy against the reference: identical, all of it. */
static void check_identical(const kv_model *m, cmp_memrec *ref, chk_share_kind share,
                            chk_cache_kind cache, int chunk)
{
    chk_opts o = chunked(cache, chunk);
    o.share = share;
    rec_spec s = {.o = &o, .p = P, .nnew = NEW};
    cmp_memrec *got = record(m, &s);
    cmp_result r;
    compare(ref, got, NULL, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_IDENTICAL && r.tokens.kind == CMP_TOKENS_IDENTICAL,
                  "%s share %s cache %s chunk %d:\n%s", m->cfg.model_type, chk_share_name(share),
                  chk_cache_name(cache), chunk, text);
    ck_assert_int_eq(r.compared.n_layers, m->cfg.n_layers);
    ck_assert_int_eq(r.compared.n_stages, test_layer_stages(&m->cfg));
    ck_assert_int_eq(r.compared.pos_lo, 0);
    ck_assert_int_eq(r.compared.pos_hi, P + NEW - 2);   /* the last token is not run */
    ck_assert(!r.compared.partial);
    ck_assert_ptr_nonnull(strstr(text, "identical: "));
    ck_assert_ptr_nonnull(strstr(text, "tokens byte-identical"));
    cmp_result_free(&r);
    cmp_memrec_free(got);
}

START_TEST(test_correct_strategies_identical)
{
    static const int chunks[] = {1, 5, W + 1, P};
    kv_model m;
    open_model(presets[_i], &m);
    cmp_memrec *ref = record_ref(&m, P, NEW);
    /* KV-shared models: every way of sharing too. */
    const int shares = strcmp(presets[_i], "tiny-gemma3-kvshared") &&
                       strcmp(presets[_i], "tiny-gemma4") ? 1 : SHARE_KIND_COUNT;
    for (int share = 0; share < shares; share++)
        for (int cache = 0; cache < CACHE_KIND_COUNT; cache++)
            for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++)
                check_identical(&m, ref, (chk_share_kind)share, (chk_cache_kind)cache, chunks[c]);
    cmp_memrec_free(ref);
    model_free(&m);
}
END_TEST

static cmp_memrec *record_cascade(const kv_model *m, chk_cache_kind cache, int chunk,
                                  const char *inject)
{
    kv_err e = {{0}};
    chk_opts o = chunked(cache, chunk);
    o.attn = CHK_ATTN_CASCADE;
    if (inject)
        ck_assert_int_eq(chk_injection_parse(inject, &o.inj, &e), 0);
    rec_spec s = {.o = &o, .inject = inject, .p = P, .nnew = NEW};
    return record(m, &s);
}

START_TEST(test_cascade_exact_is_numeric_drift)
{
    kv_model m;
    open_model(presets[_i], &m);
    cmp_memrec *ref = record_ref(&m, P, NEW);
    cmp_memrec *got = record_cascade(&m, CACHE_DENSE, 5, NULL);
    cmp_result r;
    compare(ref, got, NULL, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_DIVERGED && r.first.found, "%s\n%s", presets[_i], text);
    ck_assert_msg(r.diag.kind == CMP_DIAG_NUMERIC_DRIFT, "%s: %s\n%s", presets[_i],
                  cmp_diag_name(r.diag.kind), text);
    ck_assert_msg(r.first.row_rel < 1e-4, "%s\n%s", presets[_i], text);
    ck_assert_int_eq(r.ev.nkeys_diff_pos, -1);
    ck_assert(!r.beyond.found);
    ck_assert_ptr_nonnull(strstr(text, "not a cache bug"));
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* MLA's absorbed decode: another rounding of the same attention, drift;
 * a bug after its first decode step is still found beyond it and named. */
START_TEST(test_mla_absorbed_decode)
{
    static const char *const mla_presets[] = {"tiny-deepseek-v2", "tiny-deepseek-v3"};
    kv_model m;
    open_model(mla_presets[_i / 2], &m);
    const bool bug = _i % 2;
    cmp_memrec *ref = record_ref(&m, P, NEW);
    kv_err e = {{0}};
    chk_opts o = chunked(bug ? CACHE_DENSE : CACHE_SPLIT, 7);
    o.mla_absorbed = true;
    if (bug)
        ck_assert_int_eq(chk_injection_parse("decode-index-stuck", &o.inj, &e), 0);
    rec_spec sp = {.o = &o, .inject = bug ? "decode-index-stuck" : NULL, .p = P, .nnew = NEW};
    cmp_memrec *got = record(&m, &sp);
    cmp_result r;
    compare(ref, got, NULL, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_DIVERGED && r.first.found && r.first.pos == P &&
                  r.first.row_rel < 1e-4, "%s", text);
    if (!bug) {
        ck_assert_msg(r.diag.kind == CMP_DIAG_NUMERIC_DRIFT, "%s", text);
        ck_assert(!r.beyond.found);
        ck_assert_ptr_nonnull(strstr(text, "not a cache bug"));
    } else {
        ck_assert_msg(r.beyond.found && r.beyond.pos == P + 1 && r.beyond.layer == 0,
                      "%s", text);
        ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_STUCK && r.diag.basis == CMP_BASIS_RECOMPUTED,
                      "%s", text);
        ck_assert_ptr_null(strstr(text, "not a cache bug"));
    }
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* A bug behind cascade drift is found and named, never "not a cache bug". */
START_TEST(test_bug_behind_drift)
{
    static const struct {
        chk_cache_kind cache;
        int chunk;
        const char *inject;
        int64_t pos;
        cmp_diag_kind diag;
    } cases[] = {
        {CACHE_RING, 3, "window=4", 4, CMP_DIAG_WINDOW},
        {CACHE_DENSE, 3, "decode-index-stuck", P + 1, CMP_DIAG_DECODE_STUCK},
        {CACHE_RING, 5, "ring-no-wrap", W + 5, CMP_DIAG_RING_NO_WRAP},
    };
    kv_model m;
    open_model("tiny-gemma3", &m);
    cmp_memrec *ref = record_ref(&m, P, NEW);
    cmp_memrec *got = record_cascade(&m, cases[_i].cache, cases[_i].chunk, cases[_i].inject);
    cmp_result r;
    compare(ref, got, NULL, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.first.found && r.first.pos < cases[_i].pos && r.first.row_rel < 1e-4,
                  "%s", text);
    ck_assert_msg(r.beyond.found && r.beyond.pos == cases[_i].pos && r.beyond.layer == 0 &&
                  r.beyond.stage == STAGE_ATTN_LSE, "%s", text);
    ck_assert_msg(r.diag.kind == cases[_i].diag && r.diag.basis == CMP_BASIS_RECOMPUTED, "%s",
                  text);
    ck_assert_ptr_nonnull(strstr(text, "BEYOND DRIFT  position"));
    ck_assert_ptr_null(strstr(text, "not a cache bug"));
    char *js = cmp_render_json(&r, 0);
    json_t *j = json_loads(js, 0, NULL);
    json_t *b = json_object_get(j, "beyond_drift");
    ck_assert_int_eq(json_integer_value(json_object_get(b, "position")), cases[_i].pos);
    json_decref(j);
    free(js);
    cmp_result_free(&r);
    cmp_memrec_free(got);
    cmp_memrec_free(ref);
    model_free(&m);
}
END_TEST

START_TEST(test_cascade_within_tolerance)
{
    kv_model m;
    open_model(presets[_i], &m);
    cmp_memrec *ref = record_ref(&m, P, NEW);
    cmp_memrec *got = record_cascade(&m, CACHE_RING, 5, NULL);
    cmp_opts o;
    cmp_opts_default(&o);
    o.rtol = 1e-5;
    cmp_result r;
    compare(ref, got, &o, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_WITHIN_TOLERANCE, "%s\n%s", presets[_i], text);
    ck_assert_int_eq(cmp_exit_code(0, &r), 0);
    ck_assert_ptr_nonnull(strstr(text, "same within tolerance"));
    cmp_result_free(&r);
    cmp_memrec_free(got);

    /* The noise floor: another cascade run (other chunking) sets, per
     * stage, how much difference is noise. */
    cmp_memrec *noise = record_cascade(&m, CACHE_DENSE, 7, NULL);
    got = record_cascade(&m, CACHE_SPLIT, 3, NULL);
    cmp_source ns;
    cmp_memrec_source(noise, &ns);
    cmp_opts_default(&o);
    o.noise = &ns;
    o.noise_factor = 4;
    compare(ref, got, &o, &r);
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_WITHIN_TOLERANCE, "%s noise floor\n%s", presets[_i], text);
    const cmp_stage_result *emb = cmp_result_stage(&r, -1, STAGE_EMBED);
    ck_assert_ptr_nonnull(emb);
    /* Stages cascade never touches keep an exact comparison. */
    ck_assert(emb->noise_floor == 0 && emb->atol_eff == 0);
    cmp_result_free(&r);
    cmp_memrec_free(got);

    /* ... and it does not hide a real bug. */
    if (m.cfg.sliding_window > 0) {
        got = record_cascade(&m, CACHE_DENSE, 16, "window=4");
        compare(ref, got, &o, &r);
        dump_on_failure(&r, text, sizeof text);
        ck_assert_msg(r.verdict == CMP_DIVERGED && r.first.pos == 4 &&
                      r.first.stage == STAGE_ATTN_LSE && r.diag.kind == CMP_DIAG_WINDOW,
                      "%s\n%s", presets[_i], text);
        cmp_result_free(&r);
        cmp_memrec_free(got);
    }
    cmp_memrec_free(noise);
    cmp_memrec_free(ref);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Planted differences: element location, NaN                           */

typedef struct {
    kv_model m;
    cmp_memrec *a, *b;
} pair;

static void pair_open(pair *pr, const char *preset, int p, int nnew)
{
    open_model(preset, &pr->m);
    pr->a = record_ref(&pr->m, p, nnew);
    pr->b = record_ref(&pr->m, p, nnew);
}

static void pair_close(pair *pr)
{
    cmp_memrec_free(pr->a);
    cmp_memrec_free(pr->b);
    model_free(&pr->m);
}

static float *plant(pair *pr, int layer, kv_stage st, int64_t pos, int col, float value)
{
    int cols;
    float *row = cmp_memrec_row(pr->b, layer, st, pos, &cols);
    ck_assert_ptr_nonnull(row);
    ck_assert_int_lt(col, cols);
    row[col] = value;
    return row;
}

START_TEST(test_element_location)
{
    pair pr;
    pair_open(&pr, "tiny-gemma3", 12, 4);
    const int D = pr.m.cfg.head_dim;   /* 32 */
    struct {
        int layer;
        kv_stage st;
        int64_t pos;
        int col, head, dim;
    } cases[] = {
        {2, STAGE_Q, 7, 2 * D + 5, 2, 5},
        {1, STAGE_K, 3, 1 * D + 9, 1, 9},
        {3, STAGE_ATTN_OUT, 9, 3 * D + 31, 3, 31},
        {4, STAGE_ATTN_LSE, 5, 3, 3, -1},
        {0, STAGE_FFN_OUT, 2, 17, -1, -1},
        {-1, STAGE_LOGITS, 6, 200, -1, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int cols;
        float *row = cmp_memrec_row(pr.b, cases[i].layer, cases[i].st, cases[i].pos, &cols);
        const float old = row[cases[i].col];
        const bool second = cases[i].col + 1 < cols;
        const float old2 = second ? row[cases[i].col + 1] : 0;
        /* Two differences in the row: the lower column is the one reported. */
        plant(&pr, cases[i].layer, cases[i].st, cases[i].pos, cases[i].col, old + 0.5f);
        if (second)
            row[cases[i].col + 1] += 1.0f;
        cmp_result r;
        compare(pr.a, pr.b, NULL, &r);
        const cmp_divergence *d = &r.first;
        ck_assert_msg(d->found && d->pos == cases[i].pos && d->layer == cases[i].layer &&
                      d->stage == cases[i].st && d->col == cases[i].col &&
                      d->head == cases[i].head && d->dim == cases[i].dim,
                      "case %zu: %lld/%d/%s col %d head %d dim %d", i, (long long)d->pos,
                      d->layer, stage_name(d->stage), d->col, d->head, d->dim);
        ck_assert_float_eq(d->ref, old);
        ck_assert_float_eq(d->test, old + 0.5f);
        ck_assert(fabs(d->abs_err - 0.5) < 1e-3);
        ck_assert_uint_eq(d->ulp, cmp_ulp_distance(old + 0.5f, old));
        cmp_result_free(&r);
        row[cases[i].col] = old;
        if (second)
            row[cases[i].col + 1] = old2;
    }
    cmp_result r;
    compare(pr.a, pr.b, NULL, &r);   /* restored exactly */
    ck_assert_int_eq(r.verdict, CMP_IDENTICAL);
    cmp_result_free(&r);
    pair_close(&pr);
}
END_TEST

START_TEST(test_nan_one_side)
{
    pair pr;
    pair_open(&pr, "tiny-llama", 12, 4);
    /* A planted difference later in dataflow order than the NaN. */
    plant(&pr, 3, STAGE_X_OUT, 9, 0, 123.0f);
    plant(&pr, 2, STAGE_H_MID, 9, 7, NAN);
    cmp_opts o;
    cmp_opts_default(&o);
    o.rtol = 1e-3;   /* no tolerance excuses a NaN */
    cmp_result r;
    compare(pr.a, pr.b, &o, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.first.found && r.first.pos == 9 && r.first.layer == 2 &&
                  r.first.stage == STAGE_H_MID && r.first.col == 7, "%s", text);
    ck_assert(r.first.nonfinite && isnan(r.first.test));
    ck_assert_int_eq(r.diag.kind, CMP_DIAG_NONFINITE);
    ck_assert_ptr_nonnull(strstr(text, "nan"));
    ck_assert_int_eq(cmp_result_stage(&r, 2, STAGE_H_MID)->all.nonfinite, 1);
    cmp_result_free(&r);
    pair_close(&pr);

    /* The same NaN bits on both sides are equal, even in exact mode. */
    pair_open(&pr, "tiny-llama", 12, 4);
    plant(&pr, 1, STAGE_V, 4, 0, NAN);
    float *a = cmp_memrec_row(pr.a, 1, STAGE_V, 4, NULL);
    a[0] = NAN;
    compare(pr.a, pr.b, NULL, &r);
    ck_assert_int_eq(r.verdict, CMP_IDENTICAL);
    cmp_result_free(&r);
    /* An infinity against a number is a divergence. */
    plant(&pr, 0, STAGE_Q, 2, 1, INFINITY);
    compare(pr.a, pr.b, NULL, &r);
    ck_assert(r.first.found && r.first.nonfinite && r.first.stage == STAGE_Q);
    cmp_result_free(&r);
    pair_close(&pr);
}
END_TEST

/* A tiny planted difference in a late stage: not attention, not a key
 * count: numeric drift; tolerance absorbs it. */
START_TEST(test_tolerance_modes)
{
    pair pr;
    pair_open(&pr, "tiny-qwen2", 12, 4);
    float *row = cmp_memrec_row(pr.b, 1, STAGE_FFN_OUT, 6, NULL);
    const float old = row[4];
    row[4] = nextafterf(nextafterf(old, INFINITY), INFINITY);   /* 2 ulp */
    cmp_result r;
    compare(pr.a, pr.b, NULL, &r);
    ck_assert(r.first.found && r.first.ulp == 2 && r.first.col == 4);
    ck_assert_int_eq(r.diag.kind, CMP_DIAG_NUMERIC_DRIFT);
    cmp_result_free(&r);
    cmp_opts o;
    cmp_opts_default(&o);
    o.ulp = 2;
    compare(pr.a, pr.b, &o, &r);
    ck_assert_int_eq(r.verdict, CMP_WITHIN_TOLERANCE);
    ck_assert_uint_eq(cmp_result_stage(&r, 1, STAGE_FFN_OUT)->all.max_ulp, 2);
    ck_assert_int_eq(cmp_result_stage(&r, 1, STAGE_FFN_OUT)->all.bitequal_rows,
                     cmp_result_stage(&r, 1, STAGE_FFN_OUT)->all.rows - 1);
    cmp_result_free(&r);
    o.ulp = 1;
    compare(pr.a, pr.b, &o, &r);
    ck_assert_int_eq(r.verdict, CMP_DIVERGED);
    cmp_result_free(&r);
    cmp_opts_default(&o);
    o.atol = fabs((double)row[4] - old);
    compare(pr.a, pr.b, &o, &r);
    ck_assert_int_eq(r.verdict, CMP_WITHIN_TOLERANCE);
    cmp_result_free(&r);
    pair_close(&pr);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Refusals and overlap                                                 */

START_TEST(test_refusals_and_force)
{
    kv_model g, q;
    kv_err e = {{0}};
    open_model("tiny-gemma3", &g);
    open_model("tiny-qwen2", &q);
    cmp_memrec *a = record_ref(&g, 12, 4), *b = record_ref(&q, 12, 4);
    cmp_source sa, sb;
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    cmp_result r;
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &r, &e), -1);
    ck_assert_msg(strstr(e.msg, "not the same model") && strstr(e.msg, "--force"), "%s", e.msg);
    ck_assert_int_eq(cmp_exit_code(-1, &r), 2);
    cmp_result_free(&r);
    cmp_opts o;
    cmp_opts_default(&o);
    o.force = true;
    ck_assert_msg(cmp_compare(&sa, &sb, &o, &r, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(r.verdict, CMP_DIVERGED);
    ck_assert_ptr_nonnull(strstr(r.notes[0], "forced"));
    cmp_result_free(&r);
    cmp_memrec_free(b);

    /* Another prompt (token 5 differs) is refused; forced, the positions
     * before it are compared and found identical, the tokens differ. */
    rec_spec s = {.p = 12, .nnew = 4, .prompt_salt = 1};
    b = record(&g, &s);
    cmp_memrec_source(b, &sb);
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &r, &e), -1);
    ck_assert_msg(strstr(e.msg, "prompts differ at position 5"), "%s", e.msg);
    cmp_result_free(&r);
    ck_assert_msg(cmp_compare(&sa, &sb, &o, &r, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(r.compared.pos_cut, 5);
    ck_assert_int_eq(r.compared.pos_hi, 4);
    ck_assert(!r.first.found);
    ck_assert_int_eq(r.tokens.kind, CMP_TOKENS_DIFFER);
    ck_assert_int_eq(r.verdict, CMP_DIVERGED);
    cmp_result_free(&r);
    cmp_memrec_free(b);

    /* Another prompt length. */
    rec_spec s2 = {.p = 10, .nnew = 6};
    b = record(&g, &s2);
    cmp_memrec_source(b, &sb);
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &r, &e), -1);
    ck_assert_msg(strstr(e.msg, "prompt lengths 12 vs 10"), "%s", e.msg);
    cmp_result_free(&r);
    cmp_memrec_free(b);

    /* Different weights, when both say which. */
    b = record_ref(&g, 12, 4);
    cmp_memrec_source(b, &sb);
    sa.weights = "0123456789abcdef";
    sb.weights = "fedcba9876543210";
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &r, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "weight fingerprints"));
    cmp_result_free(&r);
    cmp_memrec_free(b);

    /* Fingerprints compare exactly only. */
    cmp_memrec_source(a, &sa);
    sb = sa;
    sb.read = NULL;
    sb.read_hash = NULL;
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &r, &e), -1);
    cmp_result_free(&r);
    cmp_memrec_free(a);
    model_free(&g);
    model_free(&q);
}
END_TEST

START_TEST(test_partial_overlap)
{
    kv_model m;
    open_model("tiny-gemma3", &m);
    cmp_memrec *ref = record_ref(&m, P, NEW);
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    mo.layer_lo = 1;
    mo.layer_hi = 3;
    mo.pos_lo = 8;
    mo.pos_hi = 30;
    memset(mo.stages, 0, sizeof mo.stages);
    mo.stages[STAGE_K] = mo.stages[STAGE_V] = mo.stages[STAGE_ATTN_LSE] = true;
    mo.stages[STAGE_ATTN_NKEYS] = mo.stages[STAGE_X_OUT] = mo.stages[STAGE_LOGITS] = true;
    chk_opts o = chunked(CACHE_RING, 5);
    rec_spec s = {.o = &o, .p = P, .nnew = NEW, .mo = &mo};
    cmp_memrec *got = record(&m, &s);
    cmp_result r;
    compare(ref, got, NULL, &r);
    char text[4096];
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.verdict == CMP_IDENTICAL, "%s", text);
    ck_assert(r.compared.partial);
    ck_assert_int_eq(r.compared.n_layers, 3);
    ck_assert_int_eq(r.compared.n_stages, 5);
    ck_assert_int_eq(r.compared.n_model_stages, 1);
    ck_assert_int_eq(r.compared.pos_lo, 8);
    ck_assert_int_eq(r.compared.pos_hi, 30);
    ck_assert_msg(strstr(text, "overlap only (layers 1-3, positions 8..30): ") &&
                      strstr(text, " alone holds x_in, ") && strstr(text, ", embed, "),
                  "%s", text);
    ck_assert_int_eq(r.n_stages, 3 * 5 + 1);
    cmp_result_free(&r);
    cmp_memrec_free(got);

    /* A bug outside the overlap shows inside it where it first can: window=4
     * moves layer 0 at position 4 (not recorded); the first recorded row it
     * reaches is k of layer 1 at position 8 (its input went through layer 0). */
    kv_err e = {{0}};
    ck_assert_int_eq(chk_injection_parse("window=4", &o.inj, &e), 0);
    got = record(&m, &s);
    compare(ref, got, NULL, &r);
    dump_on_failure(&r, text, sizeof text);
    ck_assert_msg(r.first.found && r.first.pos == 8 && r.first.layer == 1 &&
                  r.first.stage == STAGE_K, "%s", text);
    cmp_result_free(&r);
    cmp_memrec_free(got);
    cmp_memrec_free(ref);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Streaming, fingerprints, tokens, rendering                           */

/* Block boundaries do not move anything: one position per block gives
 * the same result as 64, and a full walk counts every row. */
START_TEST(test_block_size_invariant)
{
    const inj_case *ic = find_case("ring-no-wrap", CACHE_RING, 5);   /* p = 17 */
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, NULL, &r, &m, &ref, &got);
    for (int block = 1; block <= 7; block += 3) {
        cmp_opts o;
        cmp_opts_default(&o);
        o.block_rows = block;
        o.full = block == 7;
        cmp_result q;
        compare(ref, got, &o, &q);
        ck_assert(q.first.pos == r.first.pos && q.first.layer == r.first.layer &&
                  q.first.stage == r.first.stage && q.first.col == r.first.col);
        ck_assert_int_eq(q.diag.kind, r.diag.kind);
        for (int i = 0; i < q.n_stages; i++) {
            ck_assert_int_eq(q.stages[i].upto.rows, r.stages[i].upto.rows);
            ck_assert_int_eq(q.stages[i].upto.bitequal_rows, r.stages[i].upto.bitequal_rows);
            if (o.full)
                ck_assert_int_eq(q.stages[i].all.rows,
                                 q.stages[i].pos_hi - q.stages[i].pos_lo + 1);
        }
        cmp_result_free(&q);
    }
    /* upto stops exactly at the divergence: attn_lse of layer 0 has rows
     * 0..16 before it, q (earlier in dataflow) 0..17. */
    ck_assert_int_eq(cmp_result_stage(&r, 0, STAGE_ATTN_LSE)->upto.rows, W + 5);
    ck_assert_int_eq(cmp_result_stage(&r, 0, STAGE_ATTN_LSE)->upto.bitequal_rows, W + 5);
    ck_assert_int_eq(cmp_result_stage(&r, 0, STAGE_Q)->upto.rows, W + 6);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* A fingerprint-only source: hashes of the rows, no rows. */
static int hash_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, uint64_t *hash,
                     kv_err *e)
{
    int cols;
    for (int64_t r = 0; r < n; r++) {
        const float *row = cmp_memrec_row(ctx, layer, st, pos0 + r, &cols);
        if (!row)
            return kv_errf(e, "no row");
        hash[r] = XXH3_64bits(row, (size_t)cols * sizeof(float));
    }
    return 0;
}

START_TEST(test_fingerprint_source)
{
    const inj_case *ic = find_case("window=4", CACHE_RING, 5);
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, NULL, &r, &m, &ref, &got);
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(got, &sb);
    sb.read = NULL;
    sb.read_hash = hash_read;
    kv_err e = {{0}};
    cmp_result q;
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, &q, &e) == 0, "%s", e.msg);
    ck_assert(q.first.found && q.first.hashed && q.first.col == -1);
    ck_assert(q.first.pos == r.first.pos && q.first.layer == r.first.layer &&
              q.first.stage == r.first.stage);
    ck_assert_int_eq(q.diag.kind, CMP_DIAG_UNCLASSIFIED);
    ck_assert(q.compared.hashed);
    char *text = cmp_render_text(&q, 0);
    ck_assert_ptr_nonnull(strstr(text, "fingerprints"));
    free(text);
    cmp_result_free(&q);
    /* Identical recordings through hashes: identical. */
    cmp_memrec_source(ref, &sb);
    sb.read = NULL;
    sb.read_hash = hash_read;
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &q, &e), 0);
    ck_assert_int_eq(q.verdict, CMP_IDENTICAL);
    cmp_result_free(&q);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* Sources with rows, row hashes and row statistics (a full dump with row
 * hashes): reads of layer rows are counted to see which the comparer
 * skipped. */
static int64_t rows_read;

static int stats_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                      kv_err *e)
{
    int cols;
    for (int64_t r = 0; r < n; r++) {
        const float *row = cmp_memrec_row(ctx, layer, st, pos0 + r, &cols);
        if (!row)
            return kv_errf(e, "no row");
        double ss = 0;
        float mx = 0;
        for (int j = 0; j < cols; j++) {
            ss += (double)row[j] * row[j];
            mx = fabsf(row[j]) > mx ? fabsf(row[j]) : mx;
        }
        out[2 * r] = (float)sqrt(ss);
        out[2 * r + 1] = mx;
    }
    return 0;
}

static int (*memrec_read)(void *, int, kv_stage, int64_t, int64_t, float *, kv_err *);

static int counted_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                        kv_err *e)
{
    if (layer >= 0)   /* the logits are read apart, for the KL statistics */
        rows_read += n;
    return memrec_read(ctx, layer, st, pos0, n, out, e);
}

static void hashed_source(cmp_memrec *m, cmp_source *s)
{
    cmp_memrec_source(m, s);
    memrec_read = s->read;
    s->read = counted_read;
    s->read_hash = hash_read;
    s->read_stats = stats_read;
}

START_TEST(test_row_hashes_first)
{
    const inj_case *ic = find_case("window=4", CACHE_RING, 5);
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result plain, q;
    run_injection(ic, NULL, &plain, &m, &ref, &got);
    cmp_source sa, sb;
    kv_err e = {{0}};
    /* The hashes' sample, as on a recording too large to hash again whole. */
    cmp_opts samp;
    cmp_opts_default(&samp);
    samp.hash_audit_whole = -1;
    /* Identical recordings: every row settled by its hash, none read. */
    hashed_source(ref, &sa);
    hashed_source(ref, &sb);
    rows_read = 0;
    ck_assert_msg(cmp_compare(&sa, &sb, &samp, &q, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(q.verdict, CMP_IDENTICAL);
    /* the only rows read: the sample whose hashes are checked again */
    ck_assert_int_gt(q.hashcheck.rows_checked, 0);
    ck_assert_int_gt(rows_read, 0);   /* (embed and logits are read uncounted) */
    ck_assert_int_le(rows_read, q.hashcheck.rows_checked);
    ck_assert(!q.hashcheck.stale);
    for (int i = 0; i < q.n_stages; i++) {
        const cmp_stage_result *sr = &q.stages[i];
        ck_assert_int_eq(sr->rows_by_hash, sr->all.rows);
        ck_assert_int_eq(sr->all.bitequal_rows, sr->all.rows);
        ck_assert(fabs(cmp_stats_cosine(&sr->all) - 1) < 1e-6);
        ck_assert(cmp_stats_nmse(&sr->all) == 0);
    }
    ck_assert(!q.compared.hashed);   /* compared as rows, not as fingerprints */
    const int64_t sampled = q.hashcheck.rows_checked;
    cmp_result_free(&q);
    /* A recording this small: every row settled by hash hashed again. */
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, &q, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(q.verdict, CMP_IDENTICAL);
    int64_t settled = 0;
    for (int i = 0; i < q.n_stages; i++)
        settled += q.stages[i].rows_by_hash;
    ck_assert_int_eq(q.hashcheck.rows_checked, 2 * settled);
    ck_assert_int_gt(q.hashcheck.rows_checked, sampled);
    cmp_result_free(&q);
    /* A bug: the same first divergence and diagnosis as reading every row,
     * while the rows before it were never read. */
    hashed_source(got, &sb);
    cmp_opts all;
    cmp_opts_default(&all);
    all.no_hashes = true;
    rows_read = 0;
    ck_assert_int_eq(cmp_compare(&sa, &sb, &all, &q, &e), 0);
    const int64_t read_all = rows_read;
    cmp_result_free(&q);
    rows_read = 0;
    ck_assert_msg(cmp_compare(&sa, &sb, &samp, &q, &e) == 0, "%s", e.msg);
    ck_assert(q.first.found && q.first.pos == plain.first.pos &&
              q.first.layer == plain.first.layer && q.first.stage == plain.first.stage &&
              q.first.col == plain.first.col && !q.first.hashed);
    ck_assert_int_eq(q.diag.kind, plain.diag.kind);
    ck_assert_int_lt(rows_read, read_all);
    ck_assert_int_gt(cmp_result_stage(&q, 0, STAGE_X_IN)->rows_by_hash, 0);
    cmp_result_free(&q);
    /* --no-hashes reads everything. */
    cmp_opts o;
    cmp_opts_default(&o);
    o.no_hashes = true;
    hashed_source(ref, &sb);
    rows_read = 0;
    ck_assert_int_eq(cmp_compare(&sa, &sb, &o, &q, &e), 0);
    ck_assert_int_gt(rows_read, 0);
    ck_assert_int_eq(cmp_result_stage(&q, 0, STAGE_X_IN)->rows_by_hash, 0);
    cmp_result_free(&q);
    /* A NaN on both sides (bit-equal rows, non-finite statistics): the rows
     * are read, and still equal. */
    float *row = cmp_memrec_row(ref, 2, STAGE_V, 3, NULL);
    row[1] = NAN;
    rows_read = 0;
    ck_assert_int_eq(cmp_compare(&sa, &sb, NULL, &q, &e), 0);
    ck_assert_int_eq(q.verdict, CMP_IDENTICAL);
    ck_assert_int_gt(rows_read, 0);
    ck_assert_int_lt(cmp_result_stage(&q, 2, STAGE_V)->rows_by_hash,
                     cmp_result_stage(&q, 2, STAGE_V)->all.rows);
    cmp_result_free(&q);
    cmp_result_free(&plain);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* Blocks larger than the hash span (block_rows 4096 over 3000 positions):
 * each span holds a whole block, every row settles by its hash, and one
 * differing row is still found at its place. */
START_TEST(test_row_hashes_big_blocks)
{
    kv_config c;
    kv_err e = {{0}};
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    enum { N = 3000, C = 64 };
    float *rows = malloc((size_t)N * C * sizeof *rows);
    for (int i = 0; i < N * C; i++)
        rows[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
    cmp_memrec *m[2];
    for (int k = 0; k < 2; k++) {
        m[k] = cmp_memrec_new(&c, "x", NULL, NULL, &e);
        ck_assert_ptr_nonnull(m[k]);
        kv_observer *obs = cmp_memrec_observer(m[k]);
        kv_event ev = {.stage = STAGE_X_IN, .layer = 0, .pos0 = 0, .nrows = N, .ncols = C,
                       .data = rows};
        ck_assert_int_eq(obs->emit(obs, &ev), 0);
    }
    cmp_source sa, sb;
    hashed_source(m[0], &sa);
    hashed_source(m[1], &sb);
    cmp_opts o;
    cmp_opts_default(&o);
    o.block_rows = 4096;
    o.hash_audit_whole = -1;   /* the sample, as on a large recording */
    cmp_result r;
    rows_read = 0;
    ck_assert_msg(cmp_compare(&sa, &sb, &o, &r, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(r.verdict, CMP_IDENTICAL);
    ck_assert_int_le(rows_read, r.hashcheck.rows_checked);
    ck_assert_int_lt(rows_read, 2 * N / 16);
    ck_assert_int_eq(cmp_result_stage(&r, 0, STAGE_X_IN)->rows_by_hash, N);
    cmp_result_free(&r);
    cmp_memrec_row(m[1], 0, STAGE_X_IN, 2500, NULL)[7] += 1.0f;
    ck_assert_msg(cmp_compare(&sa, &sb, &o, &r, &e) == 0, "%s", e.msg);
    ck_assert(r.first.found && r.first.pos == 2500 && r.first.col == 7);
    cmp_result_free(&r);
    cmp_memrec_free(m[0]);
    cmp_memrec_free(m[1]);
    free(rows);
}
END_TEST

/* The row comparison agrees with the element rule, element by element,
 * on random finite rows (its fast path) and rows with NaN / infinities
 * (its general path), in every tolerance mode; its AVX2 and scalar loops
 * give the same record. */
START_TEST(test_row_compare_matches_element_rule)
{
    pcg32 g;
    pcg32_seed(&g, 7, 1);
    const cmp_tol tols[] = {{.exact = true}, {.atol = 1e-4}, {.rtol = 1e-3},
                            {.ulp = 4}, {.atol = 1e-6, .rtol = 1e-4, .ulp = 2}};
    float a[300], b[300];
    for (int trial = 0; trial < 400; trial++) {
        const int n = 1 + (int)(pcg32_next(&g) % 300);
        for (int i = 0; i < n; i++) {
            b[i] = ((float)pcg32_next(&g) / 4294967296.0f - 0.5f) * 8.0f;
            uint32_t r = pcg32_next(&g) % 8;
            a[i] = r == 0   ? b[i] + 1e-3f
                   : r == 1 ? nextafterf(b[i], 10.0f)
                   : r == 2 ? -b[i]
                            : b[i];
            if (trial % 3 == 0 && r == 3)
                a[i] = trial % 2 ? NAN : INFINITY;
            /* the largest finite floats: their squares still sum finite */
            if (trial % 5 == 1 && r == 4) {
                b[i] = trial % 2 ? FLT_MAX : -FLT_MAX;
                a[i] = -b[i];
            }
            if (trial % 7 == 2 && r == 5)
                b[i] = trial % 2 ? NAN : -INFINITY;
        }
        if (trial % 4 == 3)   /* a bit-equal row: weighed by its own loop */
            memcpy(a, b, (size_t)n * sizeof *a);
        for (size_t k = 0; k < sizeof tols / sizeof *tols; k++) {
            const cmp_tol *t = &tols[k];
            double rowmax = 0, max_abs = 0;
            uint64_t max_ulp = 0;
            int bad = 0, first = -1;
            for (int i = 0; i < n; i++)
                if (isfinite(b[i]) && fabs((double)b[i]) > rowmax)
                    rowmax = fabs((double)b[i]);
            for (int i = 0; i < n; i++) {
                if (!cmp_elem_ok(a[i], b[i], rowmax, t)) {
                    bad++;
                    first = first < 0 ? i : first;
                }
                if (isfinite(a[i]) && isfinite(b[i])) {
                    double d = fabs((double)a[i] - (double)b[i]);
                    max_abs = d > max_abs ? d : max_abs;
                    uint64_t u = cmp_ulp_distance(a[i], b[i]);
                    max_ulp = u > max_ulp ? u : max_ulp;
                }
            }
            cmp_rowrec rec;
            cmp_row_compare(a, b, n, t, &rec);
            ck_assert_msg(rec.n_bad == bad && rec.first_bad == first,
                          "trial %d tol %zu: %d bad from %d, want %d from %d", trial, k,
                          rec.n_bad, rec.first_bad, bad, first);
            ck_assert(rec.bad == (bad > 0));
            ck_assert(rec.max_abs == max_abs);
            ck_assert_uint_eq(rec.max_ulp, max_ulp);
            /* the scalar loop: the same record, bit for bit */
            cmp_rowrec sc;
            cmp_rows_use_simd(false);
            cmp_row_compare(a, b, n, t, &sc);
            cmp_rows_use_simd(true);
            ck_assert(sc.bitequal == rec.bitequal && sc.bad == rec.bad &&
                      sc.first_bad == rec.first_bad && sc.n_bad == rec.n_bad &&
                      sc.nonfinite == rec.nonfinite && sc.max_ulp == rec.max_ulp);
            const double *x[] = {&sc.max_abs, &sc.ref_absmax, &sc.dot, &sc.ref_sq, &sc.test_sq,
                                 &sc.err_sq};
            const double *y[] = {&rec.max_abs, &rec.ref_absmax, &rec.dot, &rec.ref_sq,
                                 &rec.test_sq, &rec.err_sq};
            for (int q = 0; q < 6; q++)
                ck_assert_msg(memcmp(x[q], y[q], sizeof(double)) == 0,
                              "trial %d, n %d: figure %d differs between AVX2 and scalar",
                              trial, n, q);
        }
    }
}
END_TEST

/* A differing generated token: both ids and each run's margin. */
START_TEST(test_tokens_margin)
{
    /* stale-local on tiny-gemma3: the tokens move */
    const inj_case *ic = find_case("stale-local", CACHE_RING, 5);
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, NULL, &r, &m, &ref, &got);
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(got, &sb);
    ck_assert_int_eq(r.tokens.kind, CMP_TOKENS_DIFFER);
    const int64_t t = r.tokens.pos;
    ck_assert_int_gt(t, P - 1);
    ck_assert_int_eq(r.tokens.step, t - P);
    ck_assert_int_eq(r.tokens.ref_id, sa.tokens[t]);
    ck_assert_int_eq(r.tokens.test_id, sb.tokens[t]);
    /* The margin is top-1 minus top-2 of the logits that chose the token. */
    int V;
    const float *lg = cmp_memrec_row(ref, -1, STAGE_LOGITS, t - 1, &V);
    float t1 = -INFINITY, t2 = -INFINITY;
    for (int i = 0; i < V; i++) {
        if (lg[i] > t1)
            t2 = t1, t1 = lg[i];
        else if (lg[i] > t2)
            t2 = lg[i];
    }
    ck_assert(fabs(r.tokens.ref_margin - ((double)t1 - t2)) < 1e-6);
    ck_assert(isfinite(r.tokens.test_margin) && r.tokens.test_margin >= 0);
    char *text = cmp_render_text(&r, 0);
    char want[128];
    snprintf(want, sizeof want, "first differing generated token at step %lld", (long long)(t - P));
    ck_assert_msg(strstr(text, want) != NULL, "%s", text);
    free(text);
    /* The walk stops before the first differing input token. */
    ck_assert_int_eq(r.compared.pos_cut, t);
    ck_assert_int_le(r.compared.pos_hi, t - 1);
    cmp_result_free(&r);

    /* Without full logits the margins come from /output top-k. */
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    mo.stages[STAGE_LOGITS] = false;
    ck_assert_int_ge(t, 1);
    cmp_memrec_free(got);
    chk_opts o = chunked(ic->cache, ic->chunk);
    kv_err e = {{0}};
    ck_assert_int_eq(chk_injection_parse(ic->inject, &o.inj, &e), 0);
    rec_spec s = {.o = &o, .p = P, .nnew = NEW, .mo = &mo};
    got = record(&m, &s);
    compare(ref, got, NULL, &r);
    ck_assert_int_eq(r.tokens.kind, CMP_TOKENS_DIFFER);
    ck_assert(isfinite(r.tokens.ref_margin) && isfinite(r.tokens.test_margin));
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

START_TEST(test_render_text_and_json)
{
    const inj_case *ic = find_case("window=4", CACHE_RING, 5);
    kv_model m;
    cmp_memrec *ref, *got;
    cmp_result r;
    run_injection(ic, NULL, &r, &m, &ref, &got);
    char *text = cmp_render_text(&r, CMP_RENDER_STAGES);
    const char *want[] = {
        "FIRST DIVERGENCE  position 4, layer 0 (sliding, window 12), stage attn_lse, head 0\n",
        "  before it: q, k, v of every position <= 4 identical; every earlier stage",
        "keys attended 5 vs 4",
        "DIAGNOSIS  attention read a different key set at the sliding-window boundary\n"
        "           (window in test appears to be 4, config says 12)\n",
        /* the evidence one clause a line, no ulp count past CMP_ULP_SHOWN */
        "           verified:\n             - recomputing attention from the test's q, k, v",
        "\n             - it does so at ",
        "      >1024 ",
        "TOKENS     first differing generated token at step",
        "attn_nkeys",
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(strstr(text, want[i]) != NULL, "missing '%s' in\n%s", want[i], text);
    /* attn_lse 2.07 against 2.01 is 2.7e5 ulp apart: a count that says nothing */
    ck_assert_msg(r.first.ulp > CMP_ULP_SHOWN && !strstr(text, " ulp"), "%s", text);
    free(text);
    char *js = cmp_render_json(&r, CMP_RENDER_STAGES);
    json_error_t je;
    json_t *j = json_loads(js, 0, &je);
    ck_assert_msg(j != NULL, "%s", je.text);
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "diverged");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "exit_code")), 1);
    json_t *fd = json_object_get(j, "first_divergence");
    ck_assert_int_eq(json_integer_value(json_object_get(fd, "position")), 4);
    ck_assert_int_eq(json_integer_value(json_object_get(fd, "layer")), 0);
    ck_assert_str_eq(json_string_value(json_object_get(fd, "stage")), "attn_lse");
    ck_assert_str_eq(json_string_value(json_object_get(fd, "attention")), "sliding");
    json_t *dg = json_object_get(j, "diagnosis");
    ck_assert_str_eq(json_string_value(json_object_get(dg, "kind")), "window");
    ck_assert_str_eq(json_string_value(json_object_get(dg, "basis")), "recomputed");
    json_t *ev = json_object_get(j, "evidence");
    ck_assert_int_eq(json_integer_value(json_object_get(ev, "nkeys_ref")), 5);
    ck_assert_int_eq(json_integer_value(json_object_get(ev, "nkeys_test")), 4);
    ck_assert(json_is_true(json_object_get(ev, "qkv_identical_upto_position")));
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "tokens"), "verdict")),
                     "differ");
    ck_assert_int_eq(json_array_size(json_object_get(j, "stages")), r.n_stages);
    json_decref(j);
    free(js);
    cmp_result_free(&r);

    /* The identical form, in text and JSON. */
    compare(ref, ref, NULL, &r);
    text = cmp_render_text(&r, 0);
    char line[160];
    snprintf(line, sizeof line, "identical: %d layers x %d positions x 15 stages (+ embed, "
             "final_norm, logits), tokens byte-identical\n", m.cfg.n_layers, P + NEW - 1);
    ck_assert_str_eq(text, line);
    free(text);
    js = cmp_render_json(&r, 0);
    j = json_loads(js, 0, &je);
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "identical");
    ck_assert(json_is_null(json_object_get(j, "first_divergence")));
    json_decref(j);
    free(js);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Small units                                                          */

START_TEST(test_ulp_and_exit_codes)
{
    ck_assert_uint_eq(cmp_ulp_distance(1.0f, 1.0f), 0);
    ck_assert_uint_eq(cmp_ulp_distance(1.0f, nextafterf(1.0f, 2.0f)), 1);
    ck_assert_uint_eq(cmp_ulp_distance(0.0f, -0.0f), 0);
    ck_assert_uint_eq(cmp_ulp_distance(-1e-45f, 1e-45f), 2);   /* across zero */
    ck_assert_uint_eq(cmp_ulp_distance(NAN, 1.0f), UINT64_MAX);
    cmp_result r;
    memset(&r, 0, sizeof r);
    r.verdict = CMP_IDENTICAL;
    ck_assert_int_eq(cmp_exit_code(0, &r), 0);
    r.verdict = CMP_WITHIN_TOLERANCE;
    ck_assert_int_eq(cmp_exit_code(0, &r), 0);
    r.verdict = CMP_DIVERGED;
    ck_assert_int_eq(cmp_exit_code(0, &r), 1);
    ck_assert_int_eq(cmp_exit_code(-1, &r), 2);
    for (int k = 0; k < CMP_DIAG_COUNT; k++)
        ck_assert_str_ne(cmp_diag_name((cmp_diag_kind)k), "?");
}
END_TEST

START_TEST(test_memrec_contract)
{
    kv_config c;
    kv_err e = {{0}};
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    cmp_memrec *m = cmp_memrec_new(&c, "x", NULL, NULL, &e);
    kv_observer *obs = cmp_memrec_observer(m);
    float rows[3 * 64] = {0};
    kv_event ev = {.stage = STAGE_X_IN, .layer = 1, .pos0 = 0, .nrows = 3, .ncols = 64,
                   .data = rows};
    ck_assert_int_eq(obs->emit(obs, &ev), 0);
    ev.pos0 = 2;   /* overlaps: overwrites 2, appends 3 and 4 */
    ck_assert_int_eq(obs->emit(obs, &ev), 0);
    cmp_source s;
    cmp_memrec_source(m, &s);
    int64_t first, n;
    int cols;
    ck_assert_int_eq(s.info(s.ctx, 1, STAGE_X_IN, &first, &n, &cols), 0);
    ck_assert(first == 0 && n == 5 && cols == 64);
    ev.pos0 = 9;   /* a gap */
    ck_assert_int_ne(obs->emit(obs, &ev), 0);
    ck_assert_ptr_nonnull(strstr(cmp_memrec_error(m), "jumps to position 9"));
    ck_assert_int_ne(s.info(s.ctx, 2, STAGE_X_IN, &first, &n, &cols), 0);
    ck_assert_int_eq(cmp_memrec_bytes(m), 5 * 64 * sizeof(float));
    cmp_memrec_free(m);
    cmp_memrec_free(NULL);
}
END_TEST

Suite *compare_suite(void)
{
    Suite *s = suite_create("compare");
    TCase *tc = tcase_create("compare");
    tcase_add_loop_test(tc, test_injection_located_and_diagnosed, 0,
                        (int)(sizeof inj_cases / sizeof *inj_cases));
    tcase_add_loop_test(tc, test_injection_that_cannot_matter_is_identical, 0,
                        (int)(sizeof noop_cases / sizeof *noop_cases));
    tcase_add_loop_test(tc, test_heuristic_when_not_recomputable, 0, 4);
    tcase_add_loop_test(tc, test_correct_strategies_identical, 0, N_PRESETS);
    tcase_add_loop_test(tc, test_cascade_exact_is_numeric_drift, 0, N_PRESETS);
    tcase_add_loop_test(tc, test_cascade_within_tolerance, 0, N_PRESETS);
    tcase_add_loop_test(tc, test_bug_behind_drift, 0, 3);
    tcase_add_loop_test(tc, test_mla_absorbed_decode, 0, 4);
    tcase_add_test(tc, test_element_location);
    tcase_add_test(tc, test_nan_one_side);
    tcase_add_test(tc, test_tolerance_modes);
    tcase_add_test(tc, test_refusals_and_force);
    tcase_add_test(tc, test_partial_overlap);
    tcase_add_test(tc, test_block_size_invariant);
    tcase_add_test(tc, test_fingerprint_source);
    tcase_add_test(tc, test_row_hashes_first);
    tcase_add_test(tc, test_row_hashes_big_blocks);
    tcase_add_test(tc, test_row_compare_matches_element_rule);
    tcase_add_test(tc, test_tokens_margin);
    tcase_add_test(tc, test_render_text_and_json);
    tcase_add_test(tc, test_ulp_and_exit_codes);
    tcase_add_test(tc, test_memrec_contract);
    suite_add_tcase(s, tc);
    return s;
}
