/* diagnose.c — evidence at the first divergence and the rules that name
 * the bug class (docs/diagnosis.md). Rules run most specific first:
 * non-finite values, a RoPE offset (q/k rotated), a zero K/V read, numeric
 * drift, a different key set (refined by recomputing attention under each
 * candidate key set), and otherwise "unclassified" with the evidence.
 *
 * A diagnosis says how it was established: recomputed (our own attention
 * or rotation from recorded rows reproduces the test), an exact check of
 * recorded values, or a heuristic (positions and counts only). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmp_internal.h"

static void say(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

/* Appends printf-style text to buf (size n), truncating. */
static void append(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t n, const char *fmt, ...)
{
    size_t used = strlen(buf);
    if (used + 1 >= n)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, n - used, fmt, ap);
    va_end(ap);
}

static void set_diag(cmp_ctx *c, cmp_diag_kind k, cmp_basis b, const char *summary)
{
    c->g->kind = k;
    c->g->basis = b;
    say(c->g->summary, sizeof c->g->summary, "%s", summary);
}

static bool is_attn_stage(kv_stage s)
{
    return s == STAGE_ATTN_LSE || s == STAGE_ATTN_NKEYS || s == STAGE_ATTN_OUT;
}

/* A row of (layer, stage) at pos from src, malloc'd, or NULL (not
 * recorded, another width than the reference config's — a forced
 * comparison of other shapes —, or *rc = -1 on error). */
static float *row_of(const cmp_ctx *c, const cmp_source *src, int layer, kv_stage st,
                     int64_t pos, int *rc, kv_err *e)
{
    const int cols = cmp_stage_cols(c->cfg, layer, st);
    if (cols <= 0)
        return NULL;
    float *row = malloc((size_t)cols * sizeof(float));
    if (!row) {
        *rc = kv_errf(e, "compare: out of memory");
        return NULL;
    }
    int r = cmp_read_row(src, layer, st, pos, cols, row, e);
    if (r != 0) {
        if (r < 0)
            *rc = -1;
        free(row);
        return NULL;
    }
    return row;
}

/* ------------------------------------------------------------------ */
/* Evidence                                                             */

/* q of layer l and k, v of its KV owner bitwise identical at every
 * recorded position up to p (before p when the divergence is at one of
 * them), from the walk's per-stage statistics. */
static void qkv_evidence(cmp_ctx *c)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    const int owner = c->cfg->kv_owner[d->layer];
    const int layers[3] = {d->layer, owner, owner};
    const kv_stage stages[3] = {STAGE_Q, STAGE_K, STAGE_V};
    ev->qkv = 1;
    ev->qkv_from = 0;
    ev->qkv_to = d->stage <= STAGE_V ? d->pos - 1 : d->pos;
    if (ev->qkv_to < 0) {
        ev->qkv = -1;
        return;
    }
    for (int i = 0; i < 3; i++) {
        const cmp_stage_result *sr = cmp_result_stage(c->r, layers[i], stages[i]);
        if (!sr || sr->pos_hi < ev->qkv_to || sr->pos_lo > ev->qkv_to) {
            ev->qkv = -1;
            return;
        }
        ev->qkv_from = sr->pos_lo > ev->qkv_from ? sr->pos_lo : ev->qkv_from;
        const int64_t f = sr->all.first_bitdiff_pos;
        if (f >= 0 && f <= ev->qkv_to)
            ev->qkv = 0;
    }
}

static int attn_stats_evidence(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    int rc = 0;
    ev->n_heads = c->cfg->n_heads;
    ev->lse_ref = row_of(c, c->ref, d->layer, STAGE_ATTN_LSE, d->pos, &rc, e);
    ev->lse_test = row_of(c, c->test, d->layer, STAGE_ATTN_LSE, d->pos, &rc, e);
    float *na = row_of(c, c->ref, d->layer, STAGE_ATTN_NKEYS, d->pos, &rc, e);
    float *nb = row_of(c, c->test, d->layer, STAGE_ATTN_NKEYS, d->pos, &rc, e);
    ev->nkeys_ref = na ? (int)na[0] : -1;
    ev->nkeys_test = nb ? (int)nb[0] : -1;
    free(na);
    free(nb);
    return rc;
}

/* First (position, layer) where any recorded key count differs. */
static int nkeys_scan(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const int H = c->cfg->n_heads;
    float *a = malloc((size_t)64 * H * sizeof(float)), *b = malloc((size_t)64 * H * sizeof(float));
    int rc = (!a || !b) ? kv_errf(e, "compare: out of memory") : 0;
    ev->nkeys_diff_pos = -1;
    ev->nkeys_diff_layer = -1;
    for (int i = 0; rc == 0 && i < c->r->n_stages; i++) {
        const cmp_stage_result *sr = &c->r->stages[i];
        if (sr->stage != STAGE_ATTN_NKEYS || sr->hashed || sr->cols != H)
            continue;
        for (int64_t p = sr->pos_lo; rc == 0 && p <= sr->pos_hi; p += 64) {
            if (ev->nkeys_diff_pos >= 0 && p > ev->nkeys_diff_pos)
                break;
            const int64_t n = sr->pos_hi - p + 1 < 64 ? sr->pos_hi - p + 1 : 64;
            if (c->ref->read(c->ref->ctx, sr->layer, STAGE_ATTN_NKEYS, p, n, a, e) < 0 ||
                c->test->read(c->test->ctx, sr->layer, STAGE_ATTN_NKEYS, p, n, b, e) < 0) {
                rc = -1;
                break;
            }
            for (int64_t r = 0; r < n; r++)
                if (memcmp(a + r * H, b + r * H, (size_t)H * sizeof(float)) != 0) {
                    if (ev->nkeys_diff_pos < 0 || p + r < ev->nkeys_diff_pos) {
                        ev->nkeys_diff_pos = p + r;
                        ev->nkeys_diff_layer = sr->layer;
                    }
                    break;
                }
        }
    }
    free(a);
    free(b);
    return rc;
}

/* Row-relative error of x_out at p from layer l to the last recorded layer. */
static int growth_evidence(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    int rc = 0;
    ev->growth_first = ev->growth_last = NAN;
    ev->growth_layer_last = -1;
    for (int l = d->layer < 0 ? 0 : d->layer; l < c->cfg->n_layers && rc == 0; l++) {
        float *a = row_of(c, c->test, l, STAGE_X_OUT, d->pos, &rc, e);
        float *b = row_of(c, c->ref, l, STAGE_X_OUT, d->pos, &rc, e);
        if (a && b) {
            double rel = cmp_row_rel_err(a, b, c->cfg->hidden);
            if (isnan(ev->growth_first))
                ev->growth_first = rel;
            ev->growth_last = rel;
            ev->growth_layer_last = l;
        }
        free(a);
        free(b);
    }
    return rc;
}

/* ------------------------------------------------------------------ */
/* Recomputing attention at (p, l)                                      */

typedef struct {
    float *q_ref, *q_test, *out_ref, *out_test;
    int64_t P, C, R;             /* prompt length, chunk (0 unknown), ring size (0 none) */
    bool C_inferred;             /* no chunk in the settings: C is the divergence's */
    int64_t R_guess;             /* no cache kind in the settings: the ring size a ring
                                  * that stopped storing at p would have (0 none) */
    int W;                       /* the layer's window (0 global) */
    int64_t lo_ref;              /* first key the config's window allows */
    bool ref_rows_used;          /* the test lacked q or k/v: the reference's stood in */
} attn_case;

static void attn_case_free(attn_case *a)
{
    free(a->q_ref);
    free(a->q_test);
    free(a->out_ref);
    free(a->out_test);
}

static int attn_case_init(cmp_ctx *c, attn_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    int rc = 0;
    memset(a, 0, sizeof *a);
    a->q_ref = row_of(c, c->ref, d->layer, STAGE_Q, d->pos, &rc, e);
    a->q_test = row_of(c, c->test, d->layer, STAGE_Q, d->pos, &rc, e);
    a->out_ref = row_of(c, c->ref, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    a->out_test = row_of(c, c->test, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    a->P = c->test->prompt_length > 0 ? c->test->prompt_length : c->ref->prompt_length;
    /* The chunked run is normally the test; either side may say how it ran. */
    const cmp_source *run = cmp_settings_int(c->test, "chunk", 0) > 0 ? c->test : c->ref;
    a->C = cmp_settings_int(run, "chunk", 0);
    a->W = config_layer_window(c->cfg, d->layer);
    a->lo_ref = a->W > 0 && d->pos - a->W + 1 > 0 ? d->pos - a->W + 1 : 0;
    /* Without the settings, what the data says: the first divergence of a
     * chunk-shaped bug is the first chunk boundary (C = p; a prompt
     * in one chunk when p >= P: decode steps are chunks of one), and a
     * ring that stopped storing diverges first at its size (R = p).
     * Recomputation then verifies, as with the settings. */
    if (a->C <= 0 && d->pos > 0 && a->P > 0) {
        a->C = d->pos < a->P ? d->pos : a->P;
        a->C_inferred = true;
    }
    const bool cache_known = cmp_settings_is(run, "cache", "ring") ||
                             cmp_settings_is(run, "cache", "dense") ||
                             cmp_settings_is(run, "cache", "split");
    const bool ring = cmp_settings_is(run, "cache", "ring");
    if (a->W > 0 && a->C > 0 && !a->C_inferred && ring) {
        /* The ring holds at most the context; max_ctx >= the tokens run,
         * so without it a ring of W + C <= n_tokens is exact and a larger
         * one is never reached. */
        long ctx = cmp_settings_int(run, "max_ctx", 0);
        a->R = a->W + a->C;
        if (ctx > 0 && a->R > ctx)
            a->R = ctx;
    }
    if (a->R == 0 && (ring || !cache_known) && a->W > 0 && d->pos > a->W)
        a->R_guess = d->pos;
    return rc;
}

/* Error of hypothesis h against the test's recorded attention, from the
 * test's own q, k, v (the reference's when the test lacks them). +inf
 * when it cannot be recomputed. */
static int hyp_err(cmp_ctx *c, attn_case *a, const cmp_hyp *h, bool on_ref, double *err,
                   kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = cfg->head_dim;
    const cmp_evidence *ev = c->ev;
    const float *q = on_ref ? a->q_ref : (a->q_test ? a->q_test : a->q_ref);
    const float *lse_rec = on_ref ? ev->lse_ref : ev->lse_test;
    const float *out_rec = on_ref ? a->out_ref : a->out_test;
    *err = INFINITY;
    if (!q || (!lse_rec && !out_rec))
        return 0;
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    int rc = (!lse || !out) ? kv_errf(e, "compare: out of memory") : 1;
    if (rc == 1 && !on_ref)
        rc = cmp_recompute_attention(c->test, cfg, c->d->layer, q, h, lse, out, e);
    if (rc == 1 && !on_ref)
        a->ref_rows_used = true;
    if (rc == 1)   /* a match from the reference's k/v still pins the key set down */
        rc = cmp_recompute_attention(c->ref, cfg, c->d->layer, q, h, lse, out, e);
    if (!on_ref && !a->q_test)
        a->ref_rows_used = true;
    if (rc == 0)
        *err = cmp_attention_err(cfg, lse, out, lse_rec, out_rec, c->rms_weight);
    free(lse);
    free(out);
    return rc < 0 ? -1 : 0;
}

static cmp_hyp hyp_ref(const cmp_divergence *d, const attn_case *a)
{
    cmp_hyp h = {.lo = a->lo_ref, .hi = d->pos, .zero_lo = 0, .zero_hi = 0};
    say(h.what, sizeof h.what, "the config's keys %lld..%lld", (long long)h.lo, (long long)h.hi);
    return h;
}

/* First key the config's window allows at position q. */
static int64_t window_lo(const attn_case *a, int64_t q)
{
    return a->W > 0 && q - a->W + 1 > 0 ? q - a->W + 1 : 0;
}

/* Prefill runs in chunks of C; each decode step is a chunk of one. */
static int64_t chunk_start(int64_t p, const attn_case *a)
{
    return p >= a->P ? p : (p / a->C) * a->C;
}

static bool is_chunk_start(int64_t p, const attn_case *a)
{
    return p > 0 && chunk_start(p, a) == p;
}

/* First position of the chunk before the one starting at s. */
static int64_t prev_chunk_start(int64_t s, const attn_case *a)
{
    if (s > a->P)
        return s - 1;
    return ((s - 1) / a->C) * a->C;
}

/* The key set a bug of kind k makes attention read at position q >= p of
 * the divergent layer: the candidate at p itself, and what the same bug
 * predicts at later positions (which is what tells apart two bugs that
 * read the same keys at p). n_window: the keys a WINDOW candidate reads;
 * for MISSING_KEY and DUP_KEY, the position of the key left out or read
 * twice. Returns false where the kind predicts nothing at q. */
static bool hyp_of(const attn_case *a, cmp_diag_kind k, int64_t q, int64_t n_window, cmp_hyp *h)
{
    memset(h, 0, sizeof *h);
    h->lo = window_lo(a, q);
    h->hi = q;
    h->kind = k;
    const size_t nw = sizeof h->what;
    switch (k) {
    case CMP_DIAG_EXTRA_KEY:
        h->extra_zero = 1;
        say(h->what, nw, "the config's keys %lld..%lld plus one unwritten (zero) slot",
            (long long)h->lo, (long long)q);
        return true;
    case CMP_DIAG_CHUNK_ISOLATED:
        if (a->C <= 0)
            return false;
        h->lo = chunk_start(q, a) > h->lo ? chunk_start(q, a) : h->lo;
        say(h->what, nw, "only its own chunk's keys %lld..%lld", (long long)h->lo, (long long)q);
        return true;
    case CMP_DIAG_WINDOW:
        if (n_window <= 0)
            return false;
        h->lo = q - n_window + 1 > 0 ? q - n_window + 1 : 0;
        say(h->what, nw, "a window of %lld keys (%lld..%lld)", (long long)n_window,
            (long long)h->lo, (long long)q);
        return true;
    case CMP_DIAG_DECODE_STUCK:
        /* Every decode token lands in position P's slot; the slots of
         * P + 1 .. q were never written (in a ring: still hold what the
         * prefill left there, position - R). */
        if (a->P <= 0 || q <= a->P || (a->R > 0 && q - a->P >= a->R))
            return false;
        h->nsubst = 1;
        h->from[0] = a->P, h->to[0] = q;
        h->zero_lo = a->P + 1, h->zero_hi = q + 1, h->older = a->R;
        if (a->R > 0 && q - a->R >= 0)
            say(h->what, nw, "keys where position %lld's slot holds position %lld's key and "
                "the ring slots of positions %lld..%lld still hold what the prefill left there",
                (long long)a->P, (long long)q, (long long)(a->P + 1), (long long)q);
        else if (q == a->P + 1)
            say(h->what, nw, "keys where position %lld's slot holds position %lld's key and "
                "position %lld's slot was never written", (long long)a->P, (long long)q,
                (long long)q);
        else
            say(h->what, nw, "keys where position %lld's slot holds position %lld's key and "
                "the slots of positions %lld..%lld were never written", (long long)a->P,
                (long long)q, (long long)(a->P + 1), (long long)q);
        return true;
    case CMP_DIAG_RING_NO_WRAP: {
        /* Writes stop at R: positions R.. read slots still holding 0... */
        const int64_t R = a->R > 0 ? a->R : a->R_guess;
        if (R <= 0 || q < R || q >= 2 * R)
            return false;
        h->zero_lo = R, h->zero_hi = q + 1, h->older = R;
        say(h->what, nw, "the config's keys, positions %lld..%lld read from ring slots still "
            "holding positions %lld..%lld", (long long)R, (long long)q, 0LL,
            (long long)(q - R));
        return true;
    }
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY:
        /* The key at position at (n_window carries it) while the window
         * still holds it. */
        if (n_window < h->lo || n_window > q || (k == CMP_DIAG_MISSING_KEY && n_window == q))
            return false;
        if (k == CMP_DIAG_MISSING_KEY)
            h->skip_one = true, h->skip_pos = n_window;
        else
            h->dup_one = true, h->dup_pos = n_window;
        say(h->what, nw, "the config's keys %lld..%lld with key %lld %s", (long long)h->lo,
            (long long)q, (long long)n_window, k == CMP_DIAG_MISSING_KEY ? "left out"
                                                                          : "read twice");
        return true;
    case CMP_DIAG_STALE_CACHE:
        if (a->W <= 0 || a->C <= 0)
            return false;
        {
            const int64_t cs = chunk_start(q, a);
            if (cs > 0) {
                const int64_t prev = prev_chunk_start(cs, a);
                h->zero_lo = prev > h->lo ? prev : h->lo;
                h->zero_hi = cs;
                h->older = a->R;
            }
            if (h->zero_lo < h->zero_hi)
                say(h->what, nw, "the config's keys with the previous chunk's (%lld..%lld) "
                    "read %s", (long long)h->zero_lo, (long long)(cs - 1),
                    a->R > 0 ? "as the ring held them before it wrote" : "as never written");
            else
                say(h->what, nw, "the config's keys %lld..%lld (no earlier chunk in reach)",
                    (long long)h->lo, (long long)q);
        }
        return true;
    default:
        return false;
    }
}

/* Candidates that change how many keys are read: one extra, only the
 * chunk's own, a window of another size. */
static int count_hyps(const cmp_ctx *c, const attn_case *a, cmp_hyp *hs)
{
    const int64_t p = c->d->pos;
    const int nr = c->ev->nkeys_ref, nt = c->ev->nkeys_test;
    int n = 0;
    if ((nt < 0 || (nt == nr + 1 && nr >= 0)) && hyp_of(a, CMP_DIAG_EXTRA_KEY, p, 0, &hs[n]))
        n++;
    if (a->C > 0 && chunk_start(p, a) > a->lo_ref &&
        hyp_of(a, CMP_DIAG_CHUNK_ISOLATED, p, 0, &hs[n]))
        n++;
    /* A window of N diverges first at min(N, W): row N is the first to
     * read N keys where the config reads N + 1 (N < W), row W the first
     * to read W + 1 (N > W). Elsewhere the rows before p refute it. */
    const bool window_first = (nt < a->W && p == nt) || (nt > a->W && p == a->W);
    if (a->W > 0 && nt > 0 && nt != nr && nt <= p + 1 && window_first &&
        hyp_of(a, CMP_DIAG_WINDOW, p, nt, &hs[n]))
        n++;
    /* The test's count unrecorded (another runtime): the windows that
     * diverge first here, N = p keys below the config's, or all p + 1
     * keys at p = W (a window larger than the config's). */
    if (a->W > 0 && nt < 0 && p > 0 && (p < a->W || p == a->W) &&
        hyp_of(a, CMP_DIAG_WINDOW, p, p < a->W ? p : p + 1, &hs[n]))
        n++;
    return n;
}

/* Candidates that read as many keys as the config but from wrong slots:
 * a stuck decode index, a ring that does not wrap, a stale snapshot. */
static int slot_hyps(const cmp_ctx *c, const attn_case *a, cmp_hyp *hs)
{
    const int64_t p = c->d->pos;
    int n = 0;
    if (a->P > 0 && p == a->P + 1 && hyp_of(a, CMP_DIAG_DECODE_STUCK, p, 0, &hs[n]))
        n++;
    if (((a->R > 0 && p >= a->R) || a->R_guess > 0) &&
        hyp_of(a, CMP_DIAG_RING_NO_WRAP, p, 0, &hs[n]))
        n++;
    if (a->W > 0 && a->C > 0 && is_chunk_start(p, a) &&
        hyp_of(a, CMP_DIAG_STALE_CACHE, p, 0, &hs[n]))
        n++;
    return n;
}

/* The candidate key sets worth testing at (p, l), given the counts. */
static int build_hyps(const cmp_ctx *c, const attn_case *a, cmp_hyp *hs)
{
    const int nr = c->ev->nkeys_ref, nt = c->ev->nkeys_test;
    int n = count_hyps(c, a, hs);
    if (nr < 0 || nt < 0 || nr == nt)
        n += slot_hyps(c, a, hs + n);
    return n;
}

/* One key too few or one too many: every key of the config's set is a
 * candidate to leave out or to read twice; a scan over them picks the
 * closest of each (recompute_hyps then verifies it as any other). Only
 * where the count is unknown or says one key off. Appends to hs (room
 * for 8 in all). Returns 0, -1 on error. */
static int scan_hyps(cmp_ctx *c, attn_case *a, cmp_hyp *hs, int *n, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const int nr = c->ev->nkeys_ref, nt = c->ev->nkeys_test;
    const int64_t nref = d->pos - a->lo_ref + 1;
    const bool fewer = nt < 0 || nt == (nr >= 0 ? nr : nref) - 1;
    const bool more = nt < 0 || nt == (nr >= 0 ? nr : nref) + 1;
    const float *q = a->q_test ? a->q_test : a->q_ref;
    const cmp_source *src = a->q_test ? c->test : c->ref;
    if ((!fewer && !more) || !q || *n > 6)
        return 0;
    int64_t skip, dup;
    double skip_err, dup_err;
    int rc = cmp_keyset_scan(src, c->cfg, d->layer, q, a->lo_ref, d->pos, c->ev->lse_test,
                             a->out_test, &skip, &skip_err, &dup, &dup_err, e);
    if (rc < 0)
        return -1;
    if (rc == 0 && fewer && skip >= 0 && skip_err <= c->attn_tol &&
        hyp_of(a, CMP_DIAG_MISSING_KEY, d->pos, skip, &hs[*n]))
        (*n)++;
    if (rc == 0 && more && dup >= 0 && dup_err <= c->attn_tol &&
        hyp_of(a, CMP_DIAG_DUP_KEY, d->pos, dup, &hs[*n]))
        (*n)++;
    return 0;
}

/* A candidate that reproduces the test at p. */
typedef struct {
    cmp_hyp h;
    double err;                  /* at p */
    double later_err;            /* at the last later position tried; NaN none; +inf
                                  * when its key count is not the test's recorded one: */
    int64_t later_nkeys, later_test_nkeys;   /* those counts (-1 unknown) */
    bool alive;                  /* still reproduces every position tried */
    int64_t dropped_at;          /* the position it failed (when !alive) */
} diag_match;

/* Tests every candidate at p; keeps in ms the best match of each kind
 * (error <= c->attn_tol), most accurate first, and fills ev->recompute.
 * Returns the number of matches, or -1 on error. */
static int recompute_hyps(cmp_ctx *c, attn_case *a, const cmp_hyp *hs, int n, diag_match *ms,
                          kv_err *e)
{
    cmp_evidence *ev = c->ev;
    cmp_hyp ref = hyp_ref(c->d, a);
    int nm = 0;
    if (hyp_err(c, a, &ref, true, &ev->ref_check_err, e) < 0)
        return -1;
    if (!(ev->ref_check_err <= c->attn_tol))
        return 0;   /* our attention does not reproduce the reference: no basis */
    ev->recompute = 0;
    for (int i = 0; i < n; i++) {
        double err;
        if (ev->nkeys_test >= 0 && cmp_hyp_nkeys(&hs[i]) != ev->nkeys_test)
            continue;
        if (hyp_err(c, a, &hs[i], false, &err, e) < 0)
            return -1;
        if (!(err <= c->attn_tol))
            continue;
        int j = 0;
        while (j < nm && ms[j].h.kind != hs[i].kind)
            j++;
        if (j < nm && ms[j].err <= err)
            continue;
        ms[j] = (diag_match){.h = hs[i], .err = err, .later_err = NAN, .alive = true,
                             .later_nkeys = -1, .later_test_nkeys = -1};
        nm += j == nm;
    }
    for (int i = 1; i < nm; i++)   /* insertion sort by error: a handful */
        for (int j = i; j > 0 && ms[j].err < ms[j - 1].err; j--) {
            diag_match t = ms[j];
            ms[j] = ms[j - 1];
            ms[j - 1] = t;
        }
    if (nm > 0)
        ev->recompute = 1;
    return nm;
}

/* Error of h at a later position q of the divergent layer against the
 * test's own recorded attention there, from the test's own q, k, v (the
 * reference's differ after p). A recorded key count other than h's is a
 * mismatch. Returns 0 with *err set, 1 when the test did not record what
 * it takes, -1 on error. */
static int later_err(cmp_ctx *c, const cmp_hyp *h, int64_t q, double *err, int64_t *test_n,
                     kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int layer = c->d->layer, H = cfg->n_heads, D = cfg->head_dim;
    int rc = 0;
    float *qr = row_of(c, c->test, layer, STAGE_Q, q, &rc, e);
    float *lse = row_of(c, c->test, layer, STAGE_ATTN_LSE, q, &rc, e);
    float *out = row_of(c, c->test, layer, STAGE_ATTN_OUT, q, &rc, e);
    float *nk = row_of(c, c->test, layer, STAGE_ATTN_NKEYS, q, &rc, e);
    double *l = malloc((size_t)H * sizeof(double)), *o = malloc((size_t)H * D * sizeof(double));
    if (rc == 0 && (!l || !o))
        rc = kv_errf(e, "compare: out of memory");
    if (rc == 0 && (!qr || (!lse && !out)))
        rc = 1;
    *err = INFINITY;
    *test_n = nk ? (int64_t)nk[0] : -1;
    if (rc == 0 && (!nk || (int64_t)nk[0] == cmp_hyp_nkeys(h))) {
        rc = cmp_recompute_attention(c->test, cfg, layer, qr, h, l, o, e);
        if (rc == 0)
            *err = cmp_attention_err(cfg, l, o, lse, out, c->rms_weight);
    }
    free(qr);
    free(lse);
    free(out);
    free(nk);
    free(l);
    free(o);
    return rc < 0 ? -1 : rc;
}

static int alive_count(const diag_match *ms, int nm)
{
    int n = 0;
    for (int i = 0; i < nm; i++)
        n += ms[i].alive;
    return n;
}

/* Why candidates that all reproduce p were or were not told apart. */
typedef enum {
    SEP_DECIDED,                 /* one still reproduces the test, the others do not */
    SEP_UNRECORDED,              /* the next position is not recorded in the test */
    SEP_NONE_FIT,                /* at the next position no candidate fits */
    SEP_ALIKE                    /* every position tried fits all of them */
} sep_outcome;

/* Several bugs can read the same keys at p in other slots (a stuck decode
 * index and a stale cache at the second decode step read the same pairs
 * (k, v)): attention cannot tell them apart there. They read different
 * keys later, so each candidate's prediction is tested at p + 1, p + 2,
 * ... against the test's own recording, and those that stop reproducing
 * it are dropped. *last: the last position that all survivors fit. */
static int separate(cmp_ctx *c, const attn_case *a, diag_match *ms, int nm, int64_t *last,
                    sep_outcome *why, kv_err *e)
{
    const int64_t p = c->d->pos;
    *last = p;
    *why = SEP_ALIKE;
    for (int64_t q = p + 1; q <= p + CMP_DIAG_LOOKAHEAD && alive_count(ms, nm) > 1; q++) {
        bool fits[8];
        int tried = 0, fit = 0;
        for (int i = 0; i < nm; i++) {
            fits[i] = ms[i].alive;
            cmp_hyp h;
            const int64_t nwin = ms[i].h.kind == CMP_DIAG_MISSING_KEY ? ms[i].h.skip_pos
                                 : ms[i].h.kind == CMP_DIAG_DUP_KEY   ? ms[i].h.dup_pos
                                                                      : ms[i].h.hi - ms[i].h.lo + 1;
            if (!ms[i].alive || !hyp_of(a, ms[i].h.kind, q, nwin, &h))
                continue;   /* predicts nothing there: it stays */
            double err;
            int64_t test_n;
            int rc = later_err(c, &h, q, &err, &test_n, e);
            if (rc < 0)
                return -1;
            if (rc == 1) {
                *why = SEP_UNRECORDED;
                return 0;
            }
            ms[i].later_err = err;
            ms[i].later_nkeys = cmp_hyp_nkeys(&h);
            ms[i].later_test_nkeys = test_n;
            fits[i] = err <= c->attn_tol;
            tried++;
            fit += fits[i];
        }
        if (tried > 0 && fit == 0) {   /* something else happens there: no verdict from it */
            *why = SEP_NONE_FIT;
            return 0;
        }
        for (int i = 0; i < nm; i++) {
            if (ms[i].alive && !fits[i])
                ms[i].dropped_at = q;
            ms[i].alive = fits[i];
        }
        *last = q;
    }
    if (alive_count(ms, nm) == 1)
        *why = SEP_DECIDED;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Rules                                                                */

static void rule_nonfinite(cmp_ctx *c)
{
    const cmp_divergence *d = c->d;
    const char *side = !isfinite(d->test) || isfinite(d->ref) ? "test" : "reference";
    set_diag(c, CMP_DIAG_NONFINITE, CMP_BASIS_EXACT_CHECK,
             "non-finite values: NaN or Inf on one side only");
    say(c->g->detail, sizeof c->g->detail,
        "(%s has %g where the other has %g: overflow, 0/0, a log/sqrt of a bad value or "
        "uninitialised memory)", side, !isfinite(d->test) ? d->test : d->ref,
        !isfinite(d->test) ? d->ref : d->test);
}

/* Per-head L2 norms equal: what a rotation (RoPE at another position)
 * preserves and most other bugs do not. */
static bool head_norms_equal(const float *a, const float *b, int nh, int D, double tol)
{
    for (int h = 0; h < nh; h++) {
        double na = 0, nb = 0;
        for (int i = 0; i < D; i++) {
            na += (double)a[h * D + i] * a[h * D + i];
            nb += (double)b[h * D + i] * b[h * D + i];
        }
        na = sqrt(na), nb = sqrt(nb);
        if (fabs(na - nb) > tol * fmax(na, 1e-30))
            return false;
    }
    return true;
}

/* ------------------------------------------------------------------ */
/* Another RoPE convention                                              */

/* Bases common in released models (Gemma's local 1e4 and global 1e6,
 * Llama 3's 5e5, ...): a runtime that drops the config's often falls back
 * to one of these. */
static const double common_bases[] = {1e4, 1e5, 5e5, 1e6, 1e7};

#define MAX_CONVS 24

static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
{
    for (int i = 0; i < n; i++)   /* the first wording of a convention wins */
        if (cv[i].theta == theta && cv[i].interleaved == interleaved && cv[i].rows == rows &&
            !memcmp(&cv[i].scaling, sc, sizeof *sc))
            return n;
    if (n >= MAX_CONVS || !(theta > 0))
        return n;
    cv[n] = (cmp_rope_conv){.theta = theta, .scaling = *sc, .interleaved = interleaved,
                            .rows = rows};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cv[n].what, sizeof cv[n].what, fmt, ap);
    va_end(ap);
    return n + 1;
}

/* Linear factors a wrong or stray scaling setting often has. */
static const double common_linear[] = {2, 4, 8};

static const char *scale_name(kv_rope_scale t)
{
    return t == ROPE_SCALE_LINEAR ? "linear" : t == ROPE_SCALE_LLAMA3 ? "llama3" : "none";
}

/* The conventions a runtime may use instead of the config's on layer l:
 * the other layer type's base, common bases, scaling missing, of the
 * other type or applied where it does not belong, and the interleaved
 * layout. The config's own is never among them. */
static int rope_convs(const kv_config *cfg, int layer, cmp_rope_conv *cv)
{
    const bool sliding = config_layer_window(cfg, layer) > 0;
    const bool two_bases = cfg->rope_local_theta > 0 && cfg->rope_local_theta != cfg->rope_theta;
    const double theta = sliding && cfg->rope_local_theta > 0 ? cfg->rope_local_theta
                                                              : cfg->rope_theta;
    const kv_rope_scaling none = {.type = ROPE_SCALE_NONE};
    const kv_rope_scaling *gs = &cfg->rope_scaling, *own = sliding ? &none : gs;
    const char *type = sliding ? "sliding" : two_bases ? "global" : "";
    int n = 0;
    /* The config's own: added first so that nothing equal to it follows. */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_SAME, "the config's");
    if (two_bases && sliding)
        n = add_conv(cv, n, cfg->rope_theta, own, false, CMP_ROWS_SAME, "theta %g, the global "
                     "layers' base, on a sliding layer; the config says %g", cfg->rope_theta,
                     theta);
    if (two_bases && !sliding)
        n = add_conv(cv, n, cfg->rope_local_theta, own, false, CMP_ROWS_SAME, "theta %g, the "
                     "sliding layers' base, on a global layer; the config says %g",
                     cfg->rope_local_theta, theta);
    for (size_t i = 0; i < sizeof common_bases / sizeof common_bases[0]; i++)
        n = add_conv(cv, n, common_bases[i], own, false, CMP_ROWS_SAME, "theta %g on a%s%s "
                     "layer; the config says %g", common_bases[i], type[0] ? " " : "",
                     type[0] ? type : "", theta);
    if (own->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, &none, false, CMP_ROWS_SAME, "no RoPE scaling; the config "
                     "says %s scaling by %g", scale_name(own->type), own->factor);
        if (own->type == ROPE_SCALE_LLAMA3) {
            const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = own->factor};
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says llama3 scaling", own->factor);
        }
    } else if (gs->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, gs, false, CMP_ROWS_SAME, "the global layers' %s RoPE "
                     "scaling by %g on a sliding layer, where the config has none",
                     scale_name(gs->type), gs->factor);
    }
    n = add_conv(cv, n, theta, own, true, CMP_ROWS_SAME, "interleaved RoPE pairs (2i, 2i + 1) "
                 "where the config rotates halves (i, i + %d)", cfg->head_dim / 2);
    /* The same mix-up seen through a recorder that maps an interleaved
     * runtime's rows back to halves (kvdiff-llama on llama.cpp's Llama). */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_UNPERMUTED, "interleaved RoPE pairs (2i, 2i + "
                 "1) rotated on rows laid out for halves (i, i + %d): q/k weights without the "
                 "row permutation an interleaved runtime needs (a converter that skipped "
                 "Llama's permute)", cfg->head_dim / 2);
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_PERMUTED, "halves (i, i + %d) rotated on "
                 "rows laid out for interleaved pairs (2i, 2i + 1): q/k weights permuted for "
                 "an interleaved runtime where this one rotates halves, or permuted twice",
                 cfg->head_dim / 2);
    for (size_t i = 0; i < sizeof common_linear / sizeof common_linear[0]; i++) {
        const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = common_linear[i]};
        if (own->type == ROPE_SCALE_LINEAR && own->factor == lin.factor)
            continue;
        if (own->type == ROPE_SCALE_NONE)
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g "
                         "where the config has none", lin.factor);
        else
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says %s scaling by %g", lin.factor, scale_name(own->type),
                         own->factor);
    }
    /* Drop the config's own. */
    memmove(cv, cv + 1, (size_t)(n - 1) * sizeof *cv);
    return n - 1;
}

/* Conventions that reproduce the test at pos (and at pos2 when >= 0). */
typedef struct {
    cmp_rope_conv cv;
    double err, err2;
} conv_fit;

/* The rows of (layer, stage) at p on both sides; 0 with both set, 1 when
 * either is missing, -1 on error. */
static int row_pair(cmp_ctx *c, int layer, kv_stage st, int64_t p, float **a, float **b,
                    kv_err *e)
{
    int rc = 0;
    *a = row_of(c, c->ref, layer, st, p, &rc, e);
    *b = row_of(c, c->test, layer, st, p, &rc, e);
    if (*a && *b)
        return 0;
    free(*a);
    free(*b);
    *a = *b = NULL;
    return rc < 0 ? -1 : 1;
}

/* Tries every other convention at the step's position and at the last
 * compared position of the row (where bases far apart at p part). Fills
 * fits (MAX_CONVS) and *p2 (-1 when only p was tried); returns how many
 * fit, -1 on error. */
static int rope_conv_fits(cmp_ctx *c, const float *a, const float *b, int nh, conv_fit *fits,
                          int64_t *p2, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_rope_conv cv[MAX_CONVS];
    const int n = rope_convs(c->cfg, d->layer, cv);
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    *p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && *p2 >= c->pos_limit)
        *p2 = c->pos_limit - 1;
    float *a2 = NULL, *b2 = NULL;
    if (*p2 > d->pos) {
        const int rc = row_pair(c, d->layer, d->stage, *p2, &a2, &b2, e);
        if (rc < 0)
            return -1;
        if (rc)
            *p2 = -1;
    } else {
        *p2 = -1;
    }
    int nf = 0;
    for (int i = 0; i < n; i++) {
        const double err = cmp_rope_conv_err(c->cfg, d->layer, &cv[i], d->pos, a, b, nh);
        if (!(err <= c->row_tol))
            continue;
        const double err2 = *p2 < 0 ? NAN
                                    : cmp_rope_conv_err(c->cfg, d->layer, &cv[i], *p2, a2, b2, nh);
        if (*p2 >= 0 && !(err2 <= c->row_tol))
            continue;
        fits[nf++] = (conv_fit){.cv = cv[i], .err = err, .err2 = err2};
    }
    free(a2);
    free(b2);
    return nf;
}

/* The rotation-like step explained by another convention. */
static void rope_conv_text(cmp_ctx *c, const conv_fit *fits, int nf, int64_t p2)
{
    const cmp_divergence *d = c->d;
    cmp_diagnosis *g = c->g;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    g->kind = CMP_DIAG_ROPE_CONVENTION;
    g->basis = CMP_BASIS_RECOMPUTED;
    if (nf == 1) {
        say(g->summary, sizeof g->summary, "RoPE convention: the test's %s match %s", what,
            fits[0].cv.what);
        c->ev->rope_err = fits[0].err;
    } else {
        say(g->summary, sizeof g->summary, "RoPE convention: the test's %s match any of %d "
            "conventions other than the config's, and nothing recorded tells them apart", what,
            nf);
    }
    if (nf > 1)
        say(g->detail, sizeof g->detail, "(");
    say(g->evidence, sizeof g->evidence, "rotating the reference's %s under ", what);
    for (int i = 0; i < nf; i++) {
        if (nf > 1)
            append(g->detail, sizeof g->detail, "%s%s", i ? "; " : "", fits[i].cv.what);
        append(g->evidence, sizeof g->evidence, "%s%s", i ? (i == nf - 1 ? " or " : ", ") : "",
               nf > 1 ? fits[i].cv.what : "it");
    }
    if (nf == 1 && fits[0].cv.rows != CMP_ROWS_SAME)
        say(g->detail, sizeof g->detail, "(the rows of each head are rotated in another order "
            "from position %lld on, where RoPE %s; per-head norms equal within %s)",
            (long long)d->pos, d->pos == 0 ? "turns nothing yet" : "first shows it",
            c->r->xrt.on ? "drift" : "1e-5");
    else if (nf == 1)
        say(g->detail, sizeof g->detail, "(position %lld is the first rotated; per-head norms "
            "equal within %s)", (long long)d->pos, c->r->xrt.on ? "drift" : "1e-5");
    else
        append(g->detail, sizeof g->detail, ")");
    append(g->evidence, sizeof g->evidence, " reproduces the test's at position %lld (error "
           "%.2g)", (long long)d->pos, fits[0].err);
    if (p2 >= 0)
        append(g->evidence, sizeof g->evidence, " and at position %lld (%.2g)", (long long)p2,
               fits[0].err2);
    append(g->evidence, sizeof g->evidence, "; errors up to %.2g count as reproducing (%s)",
           c->row_tol, c->r->xrt.on ? "the step's drift threshold" : "exact mode");
}

/* q (or k) rotated for another position: norms equal, an integer offset
 * maps the reference row onto the test row. */
static int rule_rope(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int D = c->cfg->head_dim;
    const int nh = d->stage == STAGE_Q ? c->cfg->n_heads : c->cfg->n_kv_heads;
    int rc = 0;
    float *a = row_of(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    float *b = row_of(c, c->test, d->layer, d->stage, d->pos, &rc, e);
    if (!a || !b) {
        free(a);
        free(b);
        return rc;
    }
    ev->norms_equal = head_norms_equal(a, b, nh, D, c->r->xrt.on ? c->row_tol : CMP_NORM_TOL);
    if (ev->norms_equal) {
        conv_fit fits[MAX_CONVS];
        int64_t p2 = -1;
        const int nf = rope_conv_fits(c, a, b, nh, fits, &p2, e);
        if (nf != 0) {
            free(a);
            free(b);
            if (nf > 0)
                rope_conv_text(c, fits, nf, p2);
            return nf < 0 ? -1 : 1;
        }
        ev->rope_err = cmp_rope_solve(c->cfg, d->layer, a, b, nh, &ev->rope_delta);
        ev->rope_found = ev->rope_err <= c->row_tol;
    }
    free(a);
    free(b);
    if (!ev->norms_equal)
        return 0;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    const long long at = (long long)(d->pos + ev->rope_delta);
    if (!ev->rope_found) {
        set_diag(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_HEURISTIC,
                 "a rotation-like difference: per-head norms are preserved");
        if (isfinite(ev->rope_err))
            say(c->g->detail, sizeof c->g->detail, "(but no RoPE offset reproduces the test: "
                "the rotation angles suggest %+lld, which leaves an error of %.2g; a different "
                "RoPE base, scaling or layout?)", (long long)ev->rope_delta, ev->rope_err);
        else
            say(c->g->detail, sizeof c->g->detail, "(but no RoPE offset reproduces the test: "
                "no offset fits the rotation angle of every frequency pair; a different RoPE "
                "base, scaling or layout?)");
        return 1;
    }
    char s[256];
    say(s, sizeof s, "%s rotated as if at position %lld: RoPE position offset of %+lld", what, at,
        (long long)ev->rope_delta);
    set_diag(c, CMP_DIAG_ROPE_OFFSET, CMP_BASIS_RECOMPUTED, s);
    if (at == 0)
        say(c->g->detail, sizeof c->g->detail, "(positions restart at 0 at position %lld: "
            "RoPE positions restart per chunk, as if each chunk were a new sequence)",
            (long long)d->pos);
    say(c->g->evidence, sizeof c->g->evidence, "rotating the reference's %s by %+lld "
        "positions reproduces the test's (error %.2g); per-head norms equal", what,
        (long long)ev->rope_delta, ev->rope_err);
    return 1;
}

/* ------------------------------------------------------------------ */
/* A query or key scaled as a whole                                     */

/* q (or k) equal to the reference's times one factor, within the match
 * tolerance: a scale folded into q, or a norm weight scaled, where the
 * config says otherwise. With Gemma's query_pre_attn_scalar, a factor of
 * sqrt(query_pre_attn_scalar / head_dim) is the attention scale
 * 1/sqrt(head_dim) used in place of the config's (recorders map a
 * runtime's q back to the config's scale). */
static int rule_scaled(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    float *a, *b;
    int rc = row_pair(c, d->layer, d->stage, d->pos, &a, &b, e);
    if (rc)
        return rc < 0 ? -1 : 0;
    double ab = 0, aa = 0;
    for (int i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
    }
    const double f = aa > 0 ? ab / aa : NAN;
    double worst = 0, bmax = 0;
    for (int i = 0; i < n && isfinite(f); i++) {
        worst = fmax(worst, fabs(f * a[i] - b[i]));
        bmax = fmax(bmax, fabs((double)b[i]));
    }
    free(a);
    free(b);
    const double err = bmax > 0 ? worst / bmax : INFINITY;
    if (!isfinite(f) || !(err <= c->row_tol) || fabs(f - 1) <= c->row_tol || f <= 0)
        return 0;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    /* The config's score scale, and the factor that turns it into
     * 1/sqrt(head_dim) on q (1 when they agree). */
    const double D = c->cfg->head_dim;
    const double cfg_scale = c->cfg->attn_scale > 0 ? c->cfg->attn_scale
                             : c->cfg->query_pre_attn_scalar > 0
                                 ? 1.0 / sqrt(c->cfg->query_pre_attn_scalar)
                                 : 1.0 / sqrt(D);
    const double qpas = 1.0 / (cfg_scale * cfg_scale);
    const double to_plain = 1.0 / (sqrt(D) * cfg_scale);
    const double gemma = fabs(to_plain - 1) > 1e-6 ? to_plain : NAN;
    cmp_diagnosis *g = c->g;
    g->basis = CMP_BASIS_RECOMPUTED;
    if (d->stage == STAGE_Q && isfinite(gemma) && fabs(f / gemma - 1) <= c->row_tol) {
        g->kind = CMP_DIAG_ATTN_SCALE;
        say(g->summary, sizeof g->summary, "attention scale: the test scales scores by "
            "1/sqrt(head_dim) = 1/sqrt(%g), the config by %.6g = 1/sqrt(%.6g) "
            "(query_pre_attn_scalar)", D, cfg_scale, qpas);
        say(g->detail, sizeof g->detail, "(its queries are the reference's times %.6g = "
            "sqrt(%.6g/%g), which scores them by 1/sqrt(%g): the ratio of the two scales is not "
            "folded into q (a converter's q_norm weights), or the runtime ignores "
            "query_pre_attn_scalar)", f, qpas, D, D);
    } else {
        g->kind = CMP_DIAG_UNCLASSIFIED;
        say(g->summary, sizeof g->summary, "the test's %s are the reference's times %.6g: a "
            "scale or norm weight applied where the config has none (or missing)", what, f);
        say(g->detail, sizeof g->detail, "(the same factor on every element: a scaled "
            "projection or %s-norm weight, or an attention scale folded into %s)",
            d->stage == STAGE_Q ? "q" : "k", d->stage == STAGE_Q ? "q" : "k");
    }
    say(g->evidence, sizeof g->evidence, "the reference's %s at position %lld times %.6g "
        "reproduce the test's (error %.2g; errors up to %.2g count as reproducing)", what,
        (long long)d->pos, f, err, c->row_tol);
    return 1;
}

/* ------------------------------------------------------------------ */
/* A norm weight applied as w where (1 + w) is due                      */

/* Gemma's RMSNorm multiplies the normalised input n = x / rms(x) by
 * (1 + w); llama.cpp multiplies by the stored weight, so a converter must
 * store 1 + w. Stored as w, the test computes n * w where the reference
 * computes n * (1 + w): the reference minus the test is n itself, a
 * vector of RMS 1 (per head for the q/k norms), whatever w is. The
 * other way round (a runtime adding 1 where the config has w) the test
 * minus the reference is n. */

/* The family's norms: a dump's model_config names the model type, from
 * which the reader sets arch only, not the flags that follow from it. */
static bool cfg_gemma(const kv_config *cfg)
{
    return cfg->arch == ARCH_GEMMA3;
}

/* The norm whose output stage st is, by its Hugging Face name; NULL when
 * the stage is no norm's output in this config. */
static const char *norm_of_stage(const kv_config *cfg, kv_stage st)
{
    const bool qk = cfg->qk_norm || cfg_gemma(cfg);
    const bool sandwich = cfg->sandwich_norms || cfg_gemma(cfg);
    switch (st) {
    case STAGE_ATTN_NORM: return "input_layernorm";
    case STAGE_Q: return qk ? "q_norm" : NULL;
    case STAGE_K: return qk ? "k_norm" : NULL;
    case STAGE_ATTN_PROJ: return sandwich ? "post_attention_layernorm" : NULL;
    case STAGE_FFN_NORM:
        return sandwich ? "pre_feedforward_layernorm" : "post_attention_layernorm";
    case STAGE_FFN_OUT: return sandwich ? "post_feedforward_layernorm" : NULL;
    case STAGE_FINAL_NORM: return "norm";
    default: return NULL;
    }
}

/* The recorded input of the norm whose output is st, where one is. */
static bool norm_input(const kv_config *cfg, kv_stage st, int layer, int *in_layer,
                       kv_stage *in)
{
    *in_layer = layer;
    switch (st) {
    case STAGE_ATTN_NORM: *in = STAGE_X_IN; return true;
    case STAGE_FFN_NORM: *in = STAGE_H_MID; return true;
    case STAGE_FINAL_NORM: *in = STAGE_X_OUT, *in_layer = cfg->n_layers - 1; return true;
    default: return false;
    }
}

/* How far the difference diff = sign * (ref - test) at one position is
 * from a normalised vector, relative to max |ref|: with the norm's input
 * x recorded, max |diff - x / rms(x)|; else, per group of g columns (a
 * head), | rms(diff) - 1 |, the largest. */
static double unit_norm_err(const float *ref, const float *test, const float *x, int n, int g,
                            double sign, double eps)
{
    double rmax = 0, worst = 0, ms = 0;
    for (int i = 0; i < n; i++)
        rmax = fmax(rmax, fabs((double)ref[i]));
    if (!(rmax > 0))
        return INFINITY;
    if (x) {
        for (int i = 0; i < n; i++)
            ms += (double)x[i] * x[i];
        const double inv = 1.0 / sqrt(ms / n + eps);
        for (int i = 0; i < n; i++)
            worst = fmax(worst, fabs(sign * ((double)ref[i] - test[i]) - x[i] * inv));
        return worst / rmax;
    }
    for (int h = 0; h < n / g; h++) {
        double s = 0;
        for (int i = h * g; i < (h + 1) * g; i++) {
            const double d = (double)ref[i] - test[i];
            s += d * d;
        }
        worst = fmax(worst, fabs(sqrt(s / g) - 1));
    }
    return worst / rmax;
}

/* unit_norm_err of (layer, stage) at p; +inf when a row is missing. */
static int norm_err_at(cmp_ctx *c, int64_t p, double sign, double *err, bool *with_input,
                       kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    const int n = cmp_stage_cols(cfg, d->layer, d->stage);
    const int g = d->stage == STAGE_Q || d->stage == STAGE_K ? cfg->head_dim : n;
    float *a, *b, *x = NULL;
    *err = INFINITY;
    int rc = row_pair(c, d->layer, d->stage, p, &a, &b, e);
    if (rc)
        return rc < 0 ? -1 : 0;
    int il;
    kv_stage in;
    if (norm_input(cfg, d->stage, d->layer, &il, &in) && cmp_stage_cols(cfg, il, in) == n)
        x = row_of(c, c->ref, il, in, p, &rc, e);
    *with_input = x != NULL;
    if (rc == 0)
        *err = unit_norm_err(a, b, x, n, g, sign, cfg->rms_eps);
    free(a);
    free(b);
    free(x);
    return rc < 0 ? -1 : 0;
}

static int rule_norm_convention(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const char *norm = norm_of_stage(c->cfg, d->stage);
    if (!norm || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    /* The config's convention says which way the test erred. */
    const bool plus_one = c->cfg->norm_plus_one || cfg_gemma(c->cfg);
    const double sign = plus_one ? 1.0 : -1.0;
    double err = INFINITY, err2 = NAN;
    bool with_input = false, with_input2 = false;
    if (norm_err_at(c, d->pos, sign, &err, &with_input, e) < 0)
        return -1;
    if (!(err <= c->row_tol))
        return 0;
    /* And at the row's last compared position: a second, independent
     * normalised vector (the norm's input there is another). */
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    int64_t p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && p2 >= c->pos_limit)
        p2 = c->pos_limit - 1;
    if (p2 > d->pos) {
        if (norm_err_at(c, p2, sign, &err2, &with_input2, e) < 0)
            return -1;
        if (!(err2 <= c->row_tol))
            return 0;
    }
    cmp_diagnosis *g = c->g;
    g->kind = CMP_DIAG_NORM_CONVENTION;
    g->basis = CMP_BASIS_RECOMPUTED;
    const bool qk = d->stage == STAGE_Q || d->stage == STAGE_K;
    if (plus_one)
        say(g->summary, sizeof g->summary, "norm convention: the test's %s multiplies by w in "
            "place of (1 + w) (Gemma's RMSNorm weight stored without its + 1)", norm);
    else
        say(g->summary, sizeof g->summary, "norm convention: the test's %s multiplies by "
            "(1 + w) where the config multiplies by w (a + 1 added that the model does not "
            "have)", norm);
    say(g->detail, sizeof g->detail, "(%s of layer %d%s: the %s's weight, at every position; "
        "a converter that %s, or a runtime that %s)", stage_name(d->stage), d->layer,
        qk ? ", after RoPE" : "", norm,
        plus_one ? "did not add 1 to the norm weights" : "added 1 to the norm weights",
        plus_one ? "does not apply Gemma's (1 + w)" : "applies Gemma's (1 + w) to this model");
    say(g->evidence, sizeof g->evidence, "the %s's %s minus the %s's is the normalised input "
        "%s (error %.2g at position %lld", plus_one ? "reference" : "test", stage_name(d->stage),
        plus_one ? "test" : "reference",
        with_input ? "x / rms(x) recomputed from the recorded input"
                   : qk ? "(RMS 1 in every head)" : "(RMS 1)",
        err, (long long)d->pos);
    if (p2 > d->pos)
        append(g->evidence, sizeof g->evidence, " and %.2g at position %lld", err2,
               (long long)p2);
    append(g->evidence, sizeof g->evidence, ", relative to the row's largest value): n * w "
           "against n * (1 + w), whatever w is; errors up to %.2g count as reproducing (%s)",
           c->row_tol, c->r->xrt.on ? "the step's drift threshold" : "exact mode");
    return 1;
}

/* ------------------------------------------------------------------ */
/* A q/k norm not applied                                               */

/* Gemma 3 and Qwen3 normalise each head of q and k (RMSNorm over D, one
 * weight per dim) before RoPE. A runtime that skips it (a converter that
 * exports the model as an architecture without q/k norms) hands RoPE the
 * raw projection r_h: unrotated, the reference's head is n_h * w with
 * n_h = r_h / rms(r_h), the test's is r_h. So the test's heads, each
 * divided by its own RMS, times ONE weight vector w (fitted) must give
 * the reference's, at every head and position, while the heads' RMS
 * differ (not a norm applied without its weight). */

/* Unrotated (ref, test) rows of (layer, stage) at p, appended to ra, ta
 * (nh x D doubles each). 0, 1 when missing, -1 on error. */
static int unrotated_pair(cmp_ctx *c, int64_t p, int nh, double *ra, double *ta, kv_err *e)
{
    const cmp_divergence *d = c->d;
    float *a, *b;
    int rc = row_pair(c, d->layer, d->stage, p, &a, &b, e);
    if (rc)
        return rc;
    cmp_rope_unrotate(c->cfg, d->layer, p, a, nh, ra);
    cmp_rope_unrotate(c->cfg, d->layer, p, b, nh, ta);
    free(a);
    free(b);
    return 0;
}

/* Whether the config normalises q and k per head. From the family too:
 * a dump's model_config sets arch alone, and Qwen3's qk_norm follows
 * from it as Gemma 3's does. */
static bool cfg_qk_norm(const kv_config *cfg)
{
    return cfg->qk_norm || cfg_gemma(cfg) || cfg->arch == ARCH_QWEN3;
}

static int rule_qk_norm_missing(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL ||
        !cfg_qk_norm(cfg))
        return 0;
    const int D = cfg->head_dim, nh = d->stage == STAGE_Q ? cfg->n_heads : cfg->n_kv_heads;
    const size_t n = (size_t)nh * D;
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    int64_t p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && p2 >= c->pos_limit)
        p2 = c->pos_limit - 1;
    double *ra = malloc(2 * n * sizeof(double)), *ta = malloc(2 * n * sizeof(double));
    double *w = calloc((size_t)D, sizeof(double)), *den = calloc((size_t)D, sizeof(double));
    double *rms = malloc(2 * (size_t)nh * sizeof(double));
    int rc = (!ra || !ta || !w || !den || !rms) ? kv_errf(e, "compare: out of memory") : 0;
    int npos = 0;
    if (rc == 0) {
        rc = unrotated_pair(c, d->pos, nh, ra, ta, e);
        npos = rc == 0;
    }
    if (rc == 0 && p2 > d->pos) {
        rc = unrotated_pair(c, p2, nh, ra + n, ta + n, e);
        npos += rc == 0;
        rc = rc < 0 ? -1 : 0;
    }
    double err = INFINITY, rms_lo = INFINITY, rms_hi = 0;
    if (rc == 0 && npos > 0) {
        /* Each test head over its own RMS: the normalised input n_h. */
        for (int g = 0; g < npos * nh; g++) {
            double s = 0;
            for (int i = 0; i < D; i++)
                s += ta[(size_t)g * D + i] * ta[(size_t)g * D + i];
            rms[g] = sqrt(s / D + cfg->rms_eps);
            rms_lo = fmin(rms_lo, rms[g]);
            rms_hi = fmax(rms_hi, rms[g]);
            for (int i = 0; i < D; i++) {
                const double nn = ta[(size_t)g * D + i] / rms[g];
                w[i] += ra[(size_t)g * D + i] * nn;
                den[i] += nn * nn;
            }
        }
        /* One weight per dim, least squares over every head and position. */
        for (int i = 0; i < D; i++)
            w[i] = den[i] > 0 ? w[i] / den[i] : 0;
        double worst = 0, rmax = 0;
        for (int g = 0; g < npos * nh; g++)
            for (int i = 0; i < D; i++) {
                const double r = ra[(size_t)g * D + i];
                worst = fmax(worst, fabs(w[i] * ta[(size_t)g * D + i] / rms[g] - r));
                rmax = fmax(rmax, fabs(r));
            }
        err = rmax > 0 ? worst / rmax : INFINITY;
    }
    free(ra);
    free(ta);
    free(w);
    free(den);
    free(rms);
    /* Fewer than two heads' worth of rows fit any w: no evidence. */
    if (rc < 0 || npos * nh < 2 || !(err <= c->row_tol))
        return rc < 0 ? -1 : 0;
    const char *norm = d->stage == STAGE_Q ? "q_norm" : "k_norm";
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    cmp_diagnosis *g = c->g;
    g->basis = CMP_BASIS_RECOMPUTED;
    /* Heads of RMS 1 everywhere were normalised: only the weight is off. */
    const bool unit = fabs(rms_lo - 1) <= c->row_tol && fabs(rms_hi - 1) <= c->row_tol;
    if (unit) {
        g->kind = CMP_DIAG_UNCLASSIFIED;
        say(g->summary, sizeof g->summary, "the test's %s are normalised per head but not "
            "multiplied by %s's weight", what, norm);
        say(g->detail, sizeof g->detail, "(%s of layer %d: every head has RMS 1 before RoPE; "
            "the weight is missing or all ones)", stage_name(d->stage), d->layer);
    } else {
        g->kind = CMP_DIAG_QK_NORM_MISSING;
        say(g->summary, sizeof g->summary, "%s missing: the test's %s are not normalised per "
            "head (RMSNorm over head_dim) before RoPE", norm, what);
        say(g->detail, sizeof g->detail, "(%s of layer %d: each head is the raw projection, of "
            "RMS %.3g to %.3g, where the config normalises it and multiplies by %s's weight: a "
            "runtime, or a converter's architecture, without q/k norms, e.g. Qwen3 or Gemma 3 "
            "run as Qwen2 or Llama)", stage_name(d->stage), d->layer, rms_lo, rms_hi, norm);
    }
    say(g->evidence, sizeof g->evidence, "rotated back, each head of the test's %s divided by "
        "its own RMS and multiplied by one weight vector (fitted over %d heads at position "
        "%lld%s) reproduces the reference's (error %.2g; errors up to %.2g count as "
        "reproducing, %s)", what, nh, (long long)d->pos, npos > 1 ? " and at the last compared "
        "position" : "", err, c->row_tol, c->r->xrt.on ? "the step's drift threshold"
                                                      : "exact mode");
    return 1;
}

/* lse = log(n) on every head: n keys all scoring 0. */
static bool lse_is_log_n(const float *lse, int H, int n)
{
    const double lg = log((double)n);
    bool yes = lse != NULL && n >= 1;
    for (int h = 0; yes && h < H; h++)
        yes = fabs((double)lse[h] - lg) <= 1e-6 * fmax(1.0, lg);
    return yes;
}

static bool all_zero(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (x[i] != 0.0f)
            return false;
    return true;
}

/* Every score 0 (lse = log(n)) and, where attn_out is recorded, every
 * head's output exactly zero: n keys with K = V = 0. Without attn_out the
 * scores alone say K = 0 (V unchecked); without q, a zero query would
 * give the same scores, and the text says so. */
static int rule_zero_kv(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    const int H = c->cfg->n_heads, n = H * c->cfg->head_dim;
    if (!is_attn_stage(d->stage) || !ev->lse_test || ev->nkeys_test < 1 ||
        !lse_is_log_n(ev->lse_test, H, ev->nkeys_test))
        return 0;
    int rc = 0;
    float *out = row_of(c, c->test, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *ref = row_of(c, c->ref, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *q = row_of(c, c->test, d->layer, STAGE_Q, d->pos, &rc, e);
    const bool zero = !out || all_zero(out, n);
    /* The reference must not show the same: its output is not zero, or
     * (output unrecorded) its scores are not all 0. */
    const bool ref_same = ref ? all_zero(ref, n)
                              : !ev->lse_ref || lse_is_log_n(ev->lse_ref, H, ev->nkeys_ref >= 1
                                                              ? ev->nkeys_ref : ev->nkeys_test);
    const bool q_zero = q && all_zero(q, n);
    const bool have_out = out != NULL, have_q = q != NULL;
    free(out);
    free(ref);
    free(q);
    if (rc < 0 || !zero || ref_same || q_zero)
        return rc;
    const int owner = c->cfg->kv_owner[d->layer];
    const int nt = ev->nkeys_test;
    const double lg = log((double)nt);
    char s[256];
    if (have_out)
        say(s, sizeof s, "attention read K = V = 0 (an empty or unwired cache%s)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else if (have_q)
        say(s, sizeof s, "attention read zero keys: every score was 0 (an empty or unwired "
            "cache%s)", owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else
        say(s, sizeof s, "every attention score was 0: zero keys read (an empty or unwired "
            "cache%s), or a zero query (q not recorded)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    set_diag(c, CMP_DIAG_ZERO_KV, CMP_BASIS_EXACT_CHECK, s);
    if (owner != d->layer)
        say(c->g->detail, sizeof c->g->detail, "(layer %d reads layer %d's cache: %s)",
            d->layer, owner, have_out ? "it got nothing from it" : "what it read scored 0");
    say(c->g->evidence, sizeof c->g->evidence, "%sattn_lse = log(%d) = %.6g on every head, "
        "what %d key%s scoring 0 give%s%s", have_out ? "the test's attn_out is exactly 0 for "
        "every head and " : "the test's ", nt, lg, nt, nt == 1 ? "" : "s", nt == 1 ? "s" : "",
        have_out ? "" : "; attn_out not recorded, so V = 0 is not checked");
    return 1;
}

/* Is the point consistent with rounding drift? At an attention stage:
 * attention over the config's keys, recomputed from each run's own q, k,
 * v, reproduces both. Returns 1 yes (how says so), 0 cannot tell (not an
 * attention stage, rows missing), -1 no (the key set itself differs), -2
 * on error. */
static int drift_consistent(cmp_ctx *c, attn_case *a, char *how, size_t n, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    if (!a || d->layer < 0 || !is_attn_stage(d->stage))
        return 0;
    cmp_hyp ref = hyp_ref(d, a);
    double err_t;
    if (hyp_err(c, a, &ref, true, &ev->ref_check_err, e) < 0 ||
        hyp_err(c, a, &ref, false, &err_t, e) < 0)
        return -2;
    if (!(ev->ref_check_err <= c->attn_tol) || !isfinite(err_t))
        return 0;
    if (err_t > c->attn_tol)
        return -1;
    ev->recompute = 1;
    ev->hyp_err = err_t;
    say(ev->hypothesis, sizeof ev->hypothesis, "%s", ref.what);
    say(how, n, "; recomputing attention over the config's keys reproduces both runs (errors "
        "%.2g and %.2g)", ev->ref_check_err, err_t);
    return 1;
}

static void drift_text(cmp_ctx *c, cmp_basis basis, const char *how)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    char grow[160] = "";
    set_diag(c, CMP_DIAG_NUMERIC_DRIFT, basis, c->beyond
             ? "numeric drift (a different rounding order, e.g. cascade attention): no cache "
               "bug up to here"
             : "numeric drift (a different rounding order, e.g. cascade attention): not a "
               "cache bug");
    if (ev->growth_layer_last >= 0)
        say(grow, sizeof grow, ", %.2g at layer %d's x_out", ev->growth_last,
            ev->growth_layer_last);
    if (c->beyond)
        say(c->g->detail, sizeof c->g->detail, "(it grew past %.0e here%s; later positions were "
            "not checked: compare with a tolerance or a noise floor for those)", CMP_DRIFT_BOUND,
            grow);
    else
        say(c->g->detail, sizeof c->g->detail, "(relative error %.2g at the first divergence%s; "
            "never above %.0e, and keys attended identical at every position and layer%s)",
            d->row_rel, grow, CMP_DRIFT_BOUND,
            cmp_settings_is(c->test, "attention", "cascade") ? "; the test ran cascade attention"
                                                              : "");
    say(c->g->evidence, sizeof c->g->evidence, "%s%s", c->beyond
        ? "attention at this point reads the config's keys"
        : "tiny relative error (<= 1e-04) that stays small, no key-count difference anywhere",
        how);
}

/* A tiny first divergence (or, beyond it, a larger one) that rounding
 * explains. Returns 1 when it is drift, 2 when this point is drift but a
 * larger difference follows (diagnose that one), 0 not drift, -1 error. */
static int rule_drift(cmp_ctx *c, attn_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    if (d->nonfinite || (ev->nkeys_ref >= 0 && ev->nkeys_test >= 0 &&
                         ev->nkeys_ref != ev->nkeys_test))
        return 0;
    if (!c->beyond && !(d->row_rel <= CMP_DRIFT_REL))
        return 0;
    char how[256] = "";
    const int cons = drift_consistent(c, a, how, sizeof how, e);
    if (cons == -2)
        return -1;
    if (cons < 0 || (c->beyond && cons == 0))
        return 0;
    if (!c->beyond && c->r->beyond.found)
        return 2;
    /* A count that differs anywhere is a row larger than drift: `beyond`
     * would hold it. Checked again since "not a cache bug" rests on it. */
    if (!c->beyond && ev->nkeys_diff_pos >= 0)
        return 0;
    if (growth_evidence(c, e) < 0)
        return -1;
    drift_text(c, cons == 1 ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC, how);
    return 1;
}

/* ------------------------------------------------------------------ */
/* The key-set rule                                                     */

/* "keys attended 12 in both", "keys attended 8 vs 1", never a -1. */
static void counts_phrase(const cmp_ctx *c, char *buf, size_t n)
{
    const int nr = c->ev->nkeys_ref, nt = c->ev->nkeys_test;
    char r[32] = "unknown", t[32] = "unknown";
    if (nr >= 0 && nr == nt) {
        say(buf, n, "keys attended %d in both", nr);
        return;
    }
    if (nr >= 0)
        say(r, sizeof r, "%d", nr);
    if (nt >= 0)
        say(t, sizeof t, "%d", nt);
    say(buf, n, "keys attended %s vs %s", r, t);
}

/* What the positions and counts alone suggest. An unrecorded reference
 * count is the config's (the reference reads the config's keys); with
 * the test's count unknown, positions alone suggest nothing. */
static cmp_diag_kind keyset_heuristic(const cmp_ctx *c, const attn_case *a)
{
    const int64_t p = c->d->pos;
    const int nt = c->ev->nkeys_test;
    const int64_t nr = c->ev->nkeys_ref >= 0 ? c->ev->nkeys_ref : p - a->lo_ref + 1;
    if (nt < 0)
        return CMP_DIAG_KEY_SET;
    if (nr != nt) {
        if (p == a->P && nt == nr + 1)
            return CMP_DIAG_EXTRA_KEY;
        if (a->C > 0 && !a->C_inferred && is_chunk_start(p, a) && nt < nr && nt == 1)
            return CMP_DIAG_CHUNK_ISOLATED;
        if (a->W > 0 && nt <= p + 1)
            return CMP_DIAG_WINDOW;
        return CMP_DIAG_KEY_SET;
    }
    if (a->P > 0 && p == a->P + 1)
        return CMP_DIAG_DECODE_STUCK;
    if (a->W > 0 && a->R > 0 && p == a->R)
        return CMP_DIAG_RING_NO_WRAP;
    /* An inferred chunk size rests on a verified recomputation; a guess
     * from positions alone needs the recorded one. */
    if (a->W > 0 && a->C > 0 && !a->C_inferred && is_chunk_start(p, a) && p <= a->P)
        return CMP_DIAG_STALE_CACHE;
    return CMP_DIAG_KEY_SET;
}

static void keyset_text(cmp_ctx *c, const attn_case *a, cmp_diag_kind k, int64_t n_hyp)
{
    const int64_t p = c->d->pos;
    /* Unrecorded, the count of the key set that reproduced the test. */
    const int nt = c->ev->nkeys_test >= 0 ? c->ev->nkeys_test : (int)n_hyp;
    char *s = c->g->summary, *t = c->g->detail, keys[64];
    const size_t ns = sizeof c->g->summary, nd = sizeof c->g->detail;
    counts_phrase(c, keys, sizeof keys);
    c->g->kind = k;
    switch (k) {
    case CMP_DIAG_WINDOW:
        say(s, ns, "attention read a different key set at the sliding-window boundary");
        if (nt == p + 1 && nt > a->W)
            say(t, nd, "(window in test appears to be at least %d: it read all %d keys; config "
                "says %d)", nt, nt, a->W);
        else
            say(t, nd, "(window in test appears to be %d, config says %d)", nt, a->W);
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        say(s, ns, "attention read a different key set at a chunk boundary: chunks attend only "
            "to themselves");
        if (p >= a->P)
            say(t, nd, "(%s at decode position %lld: each step saw only its own token)", keys,
                (long long)p);
        else if (a->C_inferred)
            say(t, nd, "(%s at position %lld, where a chunk starts; the engine settings do not "
                "give the chunk size)", keys, (long long)p);
        else
            say(t, nd, "(%s at position %lld, the first of a chunk of %lld)", keys, (long long)p,
                (long long)a->C);
        break;
    case CMP_DIAG_EXTRA_KEY:
        if (p == a->P) {
            say(s, ns, "at the first decode step: one extra key (off-by-one in the prefill/decode "
                "mask)");
            say(t, nd, "(%s at position %lld = prompt length)", keys, (long long)p);
        } else {
            say(s, ns, "one extra key: an unwritten (zero) slot attended as a key (an off-by-one "
                "in a mask)");
            say(t, nd, "(%s at position %lld)", keys, (long long)p);
        }
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY: {
        const bool miss = k == CMP_DIAG_MISSING_KEY;
        const long long j = (long long)n_hyp;
        say(s, ns, "attention read one key %s: the key at position %lld %s", miss ? "too few"
            : "too many", j, miss ? "is not read (removed from the cache, or masked out)"
            : "is read twice (written to the cache twice, or a stray cell of the sequence)");
        say(t, nd, "(%s at position %lld; the config's key set is %lld..%lld)", keys,
            (long long)p, (long long)a->lo_ref, (long long)p);
        break;
    }
    case CMP_DIAG_DECODE_STUCK:   /* only ever at P + 1 (slot_hyps, keyset_heuristic) */
        say(s, ns, "at the second decode step: the new key overwrote the previous one (decode "
            "index not advancing)");
        say(t, nd, "(%s at position %lld = prompt length + 1)", keys, (long long)p);
        break;
    case CMP_DIAG_RING_NO_WRAP:
        say(s, ns, "keys read from a slot the ring did not overwrite (ring buffer not wrapping)");
        if (a->R == 0)
            say(t, nd, "(%s at position %lld, the first position the ring did not store: a ring "
                "of %lld slots; the engine settings do not give its size)", keys, (long long)p,
                (long long)a->R_guess);
        else if (p == a->R)
            say(t, nd, "(%s at position %lld = ring size: window %d + chunk %lld)", keys,
                (long long)p, a->W, (long long)a->C);
        else
            say(t, nd, "(%s at position %lld, past the ring size %lld: window %d + chunk %lld)",
                keys, (long long)p, (long long)a->R, a->W, (long long)a->C);
        break;
    case CMP_DIAG_STALE_CACHE:
        say(s, ns, "stale values: the sliding cache read is from an earlier state (state not "
            "synced between chunk calls)");
        if (p == a->P)
            say(t, nd, "(%s at position %lld, the first decode step after the prompt's last "
                "chunk)", keys, (long long)p);
        else if (p > a->P)
            say(t, nd, "(%s at position %lld, a decode step after the first (each decode step "
                "is a chunk of one))", keys, (long long)p);
        else if (a->C_inferred)
            say(t, nd, "(%s at position %lld, where a chunk starts; the engine settings do not "
                "give the chunk size)", keys, (long long)p);
        else
            say(t, nd, "(%s at position %lld, the first of a chunk of %lld)", keys, (long long)p,
                (long long)a->C);
        break;
    default:
        c->g->kind = CMP_DIAG_KEY_SET;
        if (c->ev->qkv == -1)   /* without q, k, v, attention's inputs may be what differs */
            say(s, ns, "attention differs: a different key set, or different q, k, v (not all "
                "recorded)");
        else
            say(s, ns, "attention read a different key set");
        say(t, nd, "(%s)", keys);
        break;
    }
}

/* A few words for a kind, to name candidates side by side. */
static const char *kind_phrase(cmp_diag_kind k)
{
    switch (k) {
    case CMP_DIAG_WINDOW: return "a sliding window of another size";
    case CMP_DIAG_CHUNK_ISOLATED: return "chunks attending only to themselves";
    case CMP_DIAG_EXTRA_KEY: return "an unwritten slot attended as a key";
    case CMP_DIAG_DECODE_STUCK: return "a decode index not advancing";
    case CMP_DIAG_RING_NO_WRAP: return "a ring buffer not wrapping";
    case CMP_DIAG_STALE_CACHE: return "a sliding cache read from an earlier state";
    case CMP_DIAG_MISSING_KEY: return "one key left out";
    case CMP_DIAG_DUP_KEY: return "one key read twice";
    default: return "another key set";
    }
}

/* Several candidates reproduce the test and nothing recorded tells them
 * apart: name them all, claim none. */
static void ambiguous_text(cmp_ctx *c, const diag_match *ms, int nm, int64_t last,
                           sep_outcome why)
{
    const int64_t p = c->d->pos;
    cmp_diagnosis *g = c->g;
    char keys[64];
    counts_phrase(c, keys, sizeof keys);
    g->kind = CMP_DIAG_KEY_SET;
    g->basis = CMP_BASIS_RECOMPUTED;
    say(g->summary, sizeof g->summary, "attention read a different key set: ");
    say(g->detail, sizeof g->detail, "(%s at position %lld; each of these reproduces the test "
        "there:", keys, (long long)p);
    say(g->evidence, sizeof g->evidence, "recomputing attention from the recorded q, k, v "
        "reproduces the test's attention at position %lld over each key set (errors", (long long)p);
    int k = 0;
    for (int i = 0; i < nm; i++) {
        if (!ms[i].alive)
            continue;
        const int n_alive = alive_count(ms, nm);
        append(g->summary, sizeof g->summary, "%s%s (%s)",
               k == 0 ? (n_alive == 2 ? "either " : "one of ") : k == n_alive - 1 ? " or " : ", ",
               kind_phrase(ms[i].h.kind), cmp_diag_name(ms[i].h.kind));
        append(g->detail, sizeof g->detail, "%s %s", k ? ";" : "", ms[i].h.what);
        append(g->evidence, sizeof g->evidence, "%s %.2g", k ? "," : "", ms[i].err);
        k++;
    }
    append(g->detail, sizeof g->detail, ")");
    if (why == SEP_UNRECORDED)
        append(g->evidence, sizeof g->evidence, "); the test did not record position %lld of "
               "layer %d (q, k, v and attention), where they would read different keys: record "
               "it to tell them apart", (long long)(last + 1), c->d->layer);
    else if (why == SEP_NONE_FIT)
        append(g->evidence, sizeof g->evidence, "); at position %lld none of them reproduces "
               "the test (something else happens there), so later positions do not decide",
               (long long)(last + 1));
    else if (last > p)
        append(g->evidence, sizeof g->evidence, "); positions %lld..%lld fit all of them alike",
               (long long)(p + 1), (long long)last);
    else
        append(g->evidence, sizeof g->evidence, "); later positions predict nothing that "
               "tells them apart");
}

/* Same q, k, v up to p; attn_lse or the key count differs. */
static int rule_keyset(cmp_ctx *c, attn_case *a, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    /* q, k, v up to p precede (p, l, s) in dataflow order: they are within
     * the rule (bit-identical in exact mode), or the divergence would be
     * earlier. */
    if (!is_attn_stage(d->stage))
        return 0;
    bool lse_differs = ev->lse_ref && ev->lse_test &&
                       memcmp(ev->lse_ref, ev->lse_test, (size_t)ev->n_heads * sizeof(float));
    bool nkeys_differ = ev->nkeys_ref >= 0 && ev->nkeys_test >= 0 &&
                        ev->nkeys_ref != ev->nkeys_test;
    /* A runtime that records neither (llama.cpp): attn_out alone, and
     * only recomputation can say the key set is what differs. */
    const bool counts_unknown = !ev->lse_test && ev->nkeys_test < 0;
    if (!lse_differs && !nkeys_differ && !counts_unknown)
        return 0;
    /* The test read the config's key set and the reference did not: no
     * key set of the test's is to blame, and "window in test appears to
     * be 5, config says 12" would contradict itself. */
    const int64_t n_cfg = d->pos - a->lo_ref + 1;
    if (nkeys_differ && ev->nkeys_test == n_cfg && ev->nkeys_ref != n_cfg) {
        set_diag(c, CMP_DIAG_KEY_SET, CMP_BASIS_HEURISTIC, "attention read a different key set");
        say(c->g->detail, sizeof c->g->detail, "(the reference read %d keys at position %lld "
            "where the config's key set holds %lld, and the test reads those %lld: it is the "
            "reference that is not the config's; were the recordings given the wrong way "
            "round? the reference goes first)", ev->nkeys_ref, (long long)d->pos,
            (long long)n_cfg, (long long)n_cfg);
        return 1;
    }
    double cfg_err = NAN;
    if (counts_unknown) {
        cmp_hyp ref = hyp_ref(d, a);
        if (hyp_err(c, a, &ref, false, &cfg_err, e) < 0)
            return -1;
        if (!(cfg_err > c->attn_tol))
            return 0;   /* the config's keys reproduce the test (or cannot be tried) */
    }
    cmp_hyp hs[8];
    diag_match ms[8];
    int n = build_hyps(c, a, hs);
    if (scan_hyps(c, a, hs, &n, e) < 0)
        return -1;
    const int nm = recompute_hyps(c, a, hs, n, ms, e);
    if (nm < 0)
        return -1;
    if (counts_unknown && nm == 0)
        return 0;   /* no key set explains it: leave it to the rules after this one */
    int64_t last = d->pos;
    sep_outcome why = SEP_DECIDED;
    if (nm > 1 && separate(c, a, ms, nm, &last, &why, e) < 0)
        return -1;
    const cmp_diag_kind guess = keyset_heuristic(c, a);
    if (nm > 0 && alive_count(ms, nm) > 1) {
        ambiguous_text(c, ms, nm, last, why);
        return 1;
    }
    if (nm > 0) {
        const diag_match *m = &ms[0];
        while (!m->alive)
            m++;
        ev->hyp_err = m->err;
        say(ev->hypothesis, sizeof ev->hypothesis, "%s", m->h.what);
        keyset_text(c, a, m->h.kind, m->h.kind == CMP_DIAG_MISSING_KEY ? m->h.skip_pos
                                     : m->h.kind == CMP_DIAG_DUP_KEY   ? m->h.dup_pos
                                                                       : cmp_hyp_nkeys(&m->h));
        c->g->basis = CMP_BASIS_RECOMPUTED;
        say(c->g->evidence, sizeof c->g->evidence, "recomputing attention from the recorded "
            "q, k, v%s over %s reproduces the test's %s (error %.2g); the config's key set "
            "reproduces the reference (%.2g)",
            a->ref_rows_used ? " (the reference's: the test did not record them)"
            : c->attn_checked ? " (rounded as the test holds them, as the attention "
                                     "check does)"
                                   : "",
            ev->hypothesis, ev->lse_test ? "attn_lse and attn_out" : "attn_out", ev->hyp_err,
            ev->ref_check_err);
        if (counts_unknown)
            append(c->g->evidence, sizeof c->g->evidence, " and not the test's (%.2g)", cfg_err);
        if (c->r->xrt.on)
            append(c->g->evidence, sizeof c->g->evidence, "; errors up to %.2g count as "
                   "reproducing: %s (KV cache %s)", c->attn_tol, c->attn_checked
                   ? "the attention check's threshold" : "the drift model's floor at attn_out",
                   c->r->xrt.kv_precision);
        for (int i = 0; i < nm; i++) {
            if (ms[i].alive)
                continue;
            append(c->g->evidence, sizeof c->g->evidence, "; %s (%s) reproduces position "
                   "%lld too (%.2g), but not position %lld where the test reads other keys ",
                   kind_phrase(ms[i].h.kind), cmp_diag_name(ms[i].h.kind), (long long)d->pos,
                   ms[i].err, (long long)ms[i].dropped_at);
            /* +inf: not recomputed, the counts alone rule it out */
            if (isinf(ms[i].later_err) && ms[i].later_test_nkeys >= 0)
                append(c->g->evidence, sizeof c->g->evidence, "(it would read %lld keys there, "
                       "the test read %lld)", (long long)ms[i].later_nkeys,
                       (long long)ms[i].later_test_nkeys);
            else
                append(c->g->evidence, sizeof c->g->evidence, "(error %.2g)",
                       ms[i].later_err);
        }
        if (last > d->pos)
            append(c->g->evidence, sizeof c->g->evidence, "; this one reproduces every position "
                   "up to %lld", (long long)last);
        return 1;
    }
    if (ev->recompute == 0) {
        keyset_text(c, a, CMP_DIAG_KEY_SET, -1);
        c->g->basis = CMP_BASIS_HEURISTIC;
        say(c->g->evidence, sizeof c->g->evidence, "none of the %d key sets tried "
            "reproduces the test's attention%s%s", n,
            guess != CMP_DIAG_KEY_SET ? "; the positions alone suggest " : "",
            guess != CMP_DIAG_KEY_SET ? cmp_diag_name(guess) : "");
        return 1;
    }
    keyset_text(c, a, guess, -1);
    c->g->basis = CMP_BASIS_HEURISTIC;
    say(c->g->evidence, sizeof c->g->evidence, "from positions and key counts only: "
        "attention could not be recomputed from the recordings (%s)",
        ev->ref_check_err > c->attn_tol && isfinite(ev->ref_check_err)
            ? "our recomputation does not reproduce the reference"
            : "q, k or v not recorded");
    return 1;
}

/* ------------------------------------------------------------------ */
/* A split cache whose decode steps do not read the prefill cache       */

/* At the first decode step P such a runtime reads only the new token's
 * key, exactly what isolated chunks read when the prompt fits in one
 * chunk. One step later they part: the decode cache so far (P, P + 1)
 * against P + 1 alone. So this rule reads position P + 1 of the same
 * layer before it names either; where that row is missing it names both. */

typedef struct {
    int64_t p1;                  /* P + 1 */
    int nkeys;                   /* the test's keys attended there (head 0); -1 unknown */
    double err_blind, err_iso;   /* recomputed over P..P+1, over P+1 alone; inf: not done */
} blind_next;

/* The test's attention at (p1, layer) recomputed over h from the test's
 * own q, k, v. After P the reference's rows have other inputs (the test's
 * own hidden state, perhaps another token), so they cannot stand in. */
static int blind_err_at(cmp_ctx *c, int64_t p1, const cmp_hyp *h, double *err, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int layer = c->d->layer, H = cfg->n_heads, D = cfg->head_dim;
    int rc = 0;
    *err = INFINITY;
    float *q = row_of(c, c->test, layer, STAGE_Q, p1, &rc, e);
    float *lse_rec = row_of(c, c->test, layer, STAGE_ATTN_LSE, p1, &rc, e);
    float *out_rec = row_of(c, c->test, layer, STAGE_ATTN_OUT, p1, &rc, e);
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    if (rc == 0 && (!lse || !out))
        rc = kv_errf(e, "compare: out of memory");
    if (rc == 0 && q && (lse_rec || out_rec)) {
        const int r = cmp_recompute_attention(c->test, cfg, layer, q, h, lse, out, e);
        if (r < 0)
            rc = -1;
        else if (r == 0)
            *err = cmp_attention_err(cfg, lse, out, lse_rec, out_rec, c->rms_weight);
    }
    free(q);
    free(lse_rec);
    free(out_rec);
    free(lse);
    free(out);
    return rc;
}

/* What the test read at P + 1: nkeys, and the two key sets recomputed
 * (only when our attention reproduces the reference at P). */
static int blind_next_read(cmp_ctx *c, const attn_case *a, bool trusted, blind_next *nx,
                           kv_err *e)
{
    int rc = 0;
    nx->p1 = a->P + 1;
    nx->err_blind = nx->err_iso = INFINITY;
    float *nk = row_of(c, c->test, c->d->layer, STAGE_ATTN_NKEYS, nx->p1, &rc, e);
    nx->nkeys = nk ? (int)nk[0] : -1;
    free(nk);
    if (rc < 0 || !trusted)
        return rc;
    cmp_hyp blind = {.lo = a->P, .hi = nx->p1}, iso = {.lo = nx->p1, .hi = nx->p1};
    if (blind_err_at(c, nx->p1, &blind, &nx->err_blind, e) < 0 ||
        blind_err_at(c, nx->p1, &iso, &nx->err_iso, e) < 0)
        return -1;
    return 0;
}

/* The decode-blind diagnosis proper: P + 1 read the decode cache so far. */
/* The test's attention rows a recomputation is matched against. */
static const char *recorded_attn(const cmp_ctx *c)
{
    return c->ev->lse_test ? "attn_lse and attn_out" : "attn_out";
}

static void blind_text(cmp_ctx *c, const attn_case *a, const blind_next *nx, bool recomputed,
                       double own_err)
{
    const cmp_evidence *ev = c->ev;
    const long long P = (long long)a->P, p1 = (long long)nx->p1;
    char keys[64];
    counts_phrase(c, keys, sizeof keys);
    const char *rows = recorded_attn(c);
    set_diag(c, CMP_DIAG_DECODE_BLIND, recomputed ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC,
             "split prefill/decode cache: decode steps attend only to the decode cache, "
             "never to the prefill cache");
    say(c->g->detail, sizeof c->g->detail, "(%s at position %lld = prompt "
        "length; at %lld the test read positions %lld..%lld, the decode cache so far, not %lld "
        "alone as isolated chunks would; the prefill cache's %lld keys (positions 0..%lld) are "
        "not read)", keys, P, p1, P, p1, p1, P, P - 1);
    if (recomputed)
        say(c->g->evidence, sizeof c->g->evidence, "recomputing attention from the test's q, "
            "k, v%s reproduces its %s over key %lld alone at position %lld "
            "(error %.2g) and over keys %lld..%lld at %lld (error %.2g), where key %lld alone "
            "does not (error %.2g); the config's key set reproduces the reference (%.2g)",
            a->ref_rows_used ? " (at the first decode step the reference's: the test did not "
                               "record them)" : "", rows,
            P, P, own_err, P, p1, p1, nx->err_blind, p1, nx->err_iso, ev->ref_check_err);
    else
        say(c->g->evidence, sizeof c->g->evidence, "from key counts only: the test read %d key "
            "at position %lld and %d at %lld (attention could not be recomputed from the "
            "recordings)", ev->nkeys_test, P, nx->nkeys, p1);
}

/* Only the new token's key at P, and P + 1 cannot tell which bug: name
 * both. why says what P + 1 showed. */
static void blind_both_text(cmp_ctx *c, const attn_case *a, const blind_next *nx, bool own_shown,
                            double own_err)
{
    const cmp_evidence *ev = c->ev;
    const long long P = (long long)a->P, p1 = (long long)nx->p1;
    char keys[64];
    counts_phrase(c, keys, sizeof keys);
    const char *rows = recorded_attn(c);
    set_diag(c, CMP_DIAG_KEY_SET, own_shown ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC,
             "attention read only the new token's key at the first decode step: chunks attend "
             "only to themselves, or decode steps read only the decode cache of a split "
             "prefill/decode cache");
    if (isfinite(nx->err_blind) && nx->err_blind <= c->attn_tol && nx->err_iso <= c->attn_tol)
        say(c->g->detail, sizeof c->g->detail, "(%s at position %lld = "
            "prompt length; at %lld key %lld alone (isolated chunks) and keys %lld..%lld (a "
            "decode-blind split cache) both reproduce the test: key %lld weighs nothing there)",
            keys, P, p1, p1, P, p1, P);
    else
        say(c->g->detail, sizeof c->g->detail, "(%s at position %lld = "
            "prompt length; position %lld would tell them apart, isolated chunks reading 1 key "
            "there and a decode-blind split cache 2, but the test has no attention row there: run "
            "or record at least one more decode step)", keys, P, p1);
    if (own_shown)
        say(c->g->evidence, sizeof c->g->evidence, "recomputing attention from the recorded "
            "q, k, v%s over key %lld alone reproduces the test's %s (error "
            "%.2g); the config's key set reproduces the reference (%.2g)",
            a->ref_rows_used ? " (the reference's: the test did not record them)" : "", P, rows,
            own_err, ev->ref_check_err);
    else
        say(c->g->evidence, sizeof c->g->evidence, "from key counts only: the test read 1 key "
            "at position %lld (attention could not be recomputed from the recordings)", P);
}

/* Only the new token's key at P, and at P + 1 neither pattern. */
static void blind_neither_text(cmp_ctx *c, const attn_case *a, const blind_next *nx)
{
    const long long P = (long long)a->P, p1 = (long long)nx->p1;
    char keys[64];
    counts_phrase(c, keys, sizeof keys);
    const char *rows = recorded_attn(c);
    const bool rec = isfinite(nx->err_blind);
    set_diag(c, CMP_DIAG_KEY_SET, rec ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC,
             "attention read a different key set: only the new token's key at the first "
             "decode step, and at the next a set that neither isolated chunks nor a "
             "decode-blind split cache explains");
    char next[32] = "unknown";
    if (nx->nkeys >= 0)
        say(next, sizeof next, "%d", nx->nkeys);
    say(c->g->detail, sizeof c->g->detail, "(%s at position %lld = prompt "
        "length; %s at %lld, where isolated chunks read key %lld alone and a decode-blind split "
        "cache keys %lld..%lld)", keys, P, next, p1, p1, P, p1);
    if (rec)
        say(c->g->evidence, sizeof c->g->evidence, "at position %lld, attention recomputed from "
            "the test's q, k, v misses its %s over key %lld alone (error "
            "%.2g) and over keys %lld..%lld (error %.2g)", p1, rows, p1, nx->err_iso, P, p1,
            nx->err_blind);
    else
        say(c->g->evidence, sizeof c->g->evidence, "from key counts only (attention could not "
            "be recomputed from the recordings)");
}

/* The first divergence at P, where the test read the new token's key
 * alone: decide between a decode-blind split cache and isolated chunks
 * from P + 1. Returns 1 when it names the point, 0 to leave it to the
 * key-set rule (isolated chunks, or another pattern at P), -1 on error. */
static int rule_decode_blind(cmp_ctx *c, attn_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    /* With a window of 1 both read P + 1 alone: nothing to tell apart. */
    if (a->P <= 0 || d->pos != a->P || !is_attn_stage(d->stage) || a->W == 1)
        return 0;
    if (ev->nkeys_test >= 0 && (ev->nkeys_test != 1 || ev->nkeys_ref == 1))
        return 0;
    cmp_hyp ref = hyp_ref(d, a), own = ref;
    own.lo = a->P;
    say(own.what, sizeof own.what, "only its own key %lld..%lld", (long long)a->P,
        (long long)a->P);
    double own_err = INFINITY;
    if (hyp_err(c, a, &ref, true, &ev->ref_check_err, e) < 0)
        return -1;
    const bool trusted = ev->ref_check_err <= c->attn_tol;
    if (trusted && hyp_err(c, a, &own, false, &own_err, e) < 0)
        return -1;
    const bool own_shown = own_err <= c->attn_tol;
    if (isfinite(own_err) ? !own_shown : ev->nkeys_test != 1)
        return 0;   /* the test read more than its own key */
    blind_next nx;
    if (blind_next_read(c, a, trusted, &nx, e) < 0)
        return -1;
    const bool rec = isfinite(nx.err_blind) && isfinite(nx.err_iso);
    const bool blind = (nx.nkeys < 0 || nx.nkeys == 2) &&
                       (rec ? nx.err_blind <= c->attn_tol : nx.nkeys == 2);
    const bool iso = (nx.nkeys < 0 || nx.nkeys == 1) &&
                     (rec ? nx.err_iso <= c->attn_tol : nx.nkeys == 1);
    const bool neither = !blind && !iso && (rec || nx.nkeys >= 0);
    /* Where P + 1 says nothing, a cache the settings name as not split has
     * no decode cache to be blind with. */
    const cmp_source *run = cmp_settings_int(c->test, "chunk", 0) > 0 ? c->test : c->ref;
    const bool unsplit = cmp_settings_is(run, "cache", "dense") ||
                         cmp_settings_is(run, "cache", "ring");
    if ((iso && !blind) || (blind == iso && !neither && unsplit))
        return 0;   /* isolated chunks: the key-set rule names them */
    if (own_shown) {
        ev->recompute = 1;
        ev->hyp_err = own_err;
        say(ev->hypothesis, sizeof ev->hypothesis, "%s", own.what);
    }
    if (blind && !iso)
        blind_text(c, a, &nx, own_shown && rec, own_err);
    else if (neither)
        blind_neither_text(c, a, &nx);
    else
        blind_both_text(c, a, &nx, own_shown, own_err);
    return 1;
}

/* ------------------------------------------------------------------ */
/* Unclassified                                                         */

static const char *stage_hint(kv_stage s)
{
    switch (s) {
    case STAGE_EMBED: return "the embedding differs: other weights, token ids or embedding scale";
    case STAGE_X_IN: return "the residual stream entering the layer differs";
    case STAGE_ATTN_NORM_STATS:
    case STAGE_ATTN_NORM:
    case STAGE_FFN_NORM_STATS:
    case STAGE_FFN_NORM:
    case STAGE_FINAL_NORM: return "a normalisation differs (eps, the (1 + w) convention, weights)";
    case STAGE_Q:
    case STAGE_K:
    case STAGE_V: return "a projection differs (weights, bias, q/k norm or RoPE)";
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
    case STAGE_ATTN_OUT: return "attention differs";
    case STAGE_ATTN_PROJ: return "the output projection differs (o_proj or its norm)";
    case STAGE_H_MID:
    case STAGE_X_OUT: return "the residual addition differs";
    case STAGE_FFN_OUT: return "the MLP differs (weights or activation)";
    case STAGE_LOGITS: return "the LM head differs (weights or softcap)";
    default: return "";
    }
}

static void rule_unclassified(cmp_ctx *c)
{
    const cmp_divergence *d = c->d;
    set_diag(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "unclassified");
    if (c->beyond) {
        say(c->g->detail, sizeof c->g->detail, "(after numeric drift from position %lld: a "
            "relative error of %.2g at %s, drift grown past %.0e or a bug; compare with a "
            "tolerance or a noise floor to tell)", (long long)c->r->first.pos, d->row_rel,
            stage_name(d->stage), CMP_DRIFT_BOUND);
        return;
    }
    if (d->hashed) {
        say(c->g->detail, sizeof c->g->detail, "(fingerprints locate the row only: record "
            "position %lld of layer %d in full to see the element and a diagnosis)",
            (long long)d->pos, d->layer);
        return;
    }
    if (is_attn_stage(d->stage) && c->ev->qkv == 1 && c->ev->nkeys_ref == c->ev->nkeys_test &&
        c->ev->lse_ref && c->ev->lse_test &&
        !memcmp(c->ev->lse_ref, c->ev->lse_test, (size_t)c->ev->n_heads * sizeof(float))) {
        say(c->g->detail, sizeof c->g->detail, "(attn_out differs with identical q, k, v, "
            "scores and key counts: the values read differ)");
        return;
    }
    say(c->g->detail, sizeof c->g->detail, "(first difference at %s: %s; relative error "
        "%.2g)", stage_name(d->stage), stage_hint(d->stage), d->row_rel);
}

/* ------------------------------------------------------------------ */
/* Entry                                                                */

static int run_rules(cmp_ctx *c, attn_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    int rc;
    if (d->nonfinite) {
        rule_nonfinite(c);
        return 0;
    }
    if (d->layer >= 0 && (rc = rule_rope(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_scaled(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if ((rc = rule_norm_convention(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_qk_norm_missing(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_zero_kv(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if ((rc = rule_drift(c, d->layer >= 0 ? a : NULL, e)) != 0)
        return rc < 0 ? -1 : rc == 2 ? 2 : 0;
    if (d->layer >= 0 && (rc = rule_decode_blind(c, a, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_keyset(c, a, e)) != 0)
        return rc < 0 ? -1 : 0;
    rule_unclassified(c);
    return 0;
}

/* Evidence and rules at the point c->d. Returns 0, 2 (drift here, a
 * larger difference follows), -1 on error. */
static int diagnose_point(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    ev->recompute = -1;
    ev->nkeys_ref = ev->nkeys_test = -1;
    ev->qkv = -1;
    ev->nkeys_diff_pos = -1;
    ev->nkeys_diff_layer = -1;
    ev->growth_first = ev->growth_last = NAN;
    ev->growth_layer_last = -1;
    ev->ref_check_err = ev->hyp_err = ev->rope_err = NAN;
    if (d->hashed) {
        rule_unclassified(c);
        return 0;
    }
    attn_case a;
    memset(&a, 0, sizeof a);
    int rc = 0;
    if (d->layer >= 0) {
        qkv_evidence(c);
        rc = attn_stats_evidence(c, e);
        if (rc == 0)
            rc = attn_case_init(c, &a, e);
    }
    if (rc == 0 && !c->beyond)
        rc = nkeys_scan(c, e);
    if (rc == 0)
        rc = run_rules(c, &a, e);
    attn_case_free(&a);
    return rc;
}

/* A divergence found in /output alone: every recorded stage at its
 * position is identical, so what differs comes after them. */
static void diagnose_output(cmp_ctx *c)
{
    set_diag(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "unclassified");
    say(c->g->detail, sizeof c->g->detail, "(/output differs at position %lld, %d of its "
        "entries, while every recorded stage there is identical: the final norm, the LM head "
        "or the logits' softcap differs, or /output was written otherwise; record final_norm "
        "and logits to see which)", (long long)c->d->pos, c->d->n_bad);
}

int cmp_diagnose(cmp_ctx *c, kv_err *e)
{
    cmp_result *r = c->r;
    c->d = &r->first;
    c->ev = &r->ev;
    c->g = &r->diag;
    c->beyond = false;
    c->attn_tol = c->row_tol = CMP_MATCH_TOL;
    if (r->first.from_output) {
        diagnose_output(c);
        return 0;
    }
    /* Where the attention check ran, the runtime's attention is modelled
     * (its q, k, v rounded as it holds them, its compute precision): a
     * hypothesis must reproduce the test as closely as the check's own
     * recomputation does, not merely within the drift floor against the
     * reference (16 unit roundoffs of a bf16 cache, 6.65%, would let a
     * wrong key set pass for a right one). */
    c->attn_checked = r->xrt.on && !r->xrt.audit_skip[0] && r->xrt.audit_layers > 0;
    c->rms_weight = c->attn_checked ? r->xrt.audit_rms_weight : 0;
    if (r->xrt.on) {
        c->attn_tol = c->attn_checked ? r->xrt.audit_threshold : cmp_xrt_attn_floor(&r->xrt);
        c->row_tol = r->xrt.step_threshold > 0 ? r->xrt.step_threshold : c->attn_tol;
    }
    /* Hypotheses recomputed from the test's q, k, v as the check
     * recomputes them, rounded as the runtime holds them. */
    cmp_source modelled;
    void *handle = NULL;
    const cmp_source *test = c->test;
    if (c->attn_checked) {
        handle = cmp_xrt_modelled_source(c->test, &r->xrt, &modelled);
        if (!handle)
            return kv_errf(e, "compare: out of memory");
        c->test = &modelled;
    }
    int rc = diagnose_point(c, e);
    c->test = test;
    free(handle);
    if (rc != 2) {
        r->beyond.found = false;   /* not drift first: nothing is "beyond" it */
        return rc;
    }
    /* Drift first, then something larger: name that one. */
    memset(&r->diag, 0, sizeof r->diag);
    c->d = &r->beyond;
    c->ev = &r->beyond_ev;
    c->beyond = true;
    c->ev->nkeys_diff_pos = r->ev.nkeys_diff_pos;
    c->ev->nkeys_diff_layer = r->ev.nkeys_diff_layer;
    rc = diagnose_point(c, e);
    return rc == 2 ? 0 : rc;
}
