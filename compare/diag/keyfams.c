/* keyfams.c — the key-set families (docs/diagnosis.md, "The hypothesis
 * engine"): what each proposes at the first divergence, the key set each
 * of its candidates predicts at every (layer, position), and the words
 * for it. Windows and layer types, isolated chunks, decode blind to the
 * prefill, one key left out or read twice, the own key masked, unwritten
 * (zero) slots, a stuck write index, a ring that does not wrap, a stale
 * sliding cache. keysets.c scores them. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keysets.h"

int64_t ks_window_lo(int W, int64_t q)
{
    return W > 0 && q - W + 1 > 0 ? q - W + 1 : 0;
}

/* Prefill runs in chunks of C; each decode step is a chunk of one. */
int64_t ks_chunk_start(int64_t p, int64_t P, int64_t C)
{
    return p >= P ? p : (p / C) * C;
}

static int64_t prev_chunk_start(int64_t s, int64_t P, int64_t C)
{
    return s > P ? s - 1 : ((s - 1) / C) * C;
}

/* The key set candidate k predicts at (layer, q): the config's where it
 * changes nothing there. False where it predicts nothing at all (a ring
 * past twice its size). */
bool ks_keys(const cmp_ctx *c, const dg_case *a, const ks_cand *k, int layer, int64_t q,
                    cmp_hyp *h)
{
    const int W = config_layer_window(c->cfg, layer);
    const int64_t lo = ks_window_lo(W, q), P = a->P;
    memset(h, 0, sizeof *h);
    h->lo = lo;
    h->hi = q;
    h->kind = k->kind;
    if ((k->scope == SCOPE_LAYER && layer != c->d->layer) ||
        (k->scope == SCOPE_KIND && W != a->W) || q < k->from)
        return true;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        h->lo = k->n == KS_ALL || q - k->n + 1 < 0 ? 0 : q - k->n + 1;
        break;
    case CMP_DIAG_CHUNK_ISOLATED: {
        const int64_t cs = ks_chunk_start(q, P > 0 ? P : INT64_MAX, k->n);
        h->lo = cs > lo ? cs : lo;
        break;
    }
    case CMP_DIAG_DECODE_BLIND:
        if (P > 0 && q >= P && P > lo)
            h->lo = P;
        break;
    case CMP_DIAG_MISSING_KEY:
        if (k->n >= lo && k->n <= q)
            h->skip_one = true, h->skip_pos = k->n;
        break;
    case CMP_DIAG_DUP_KEY:
        if (k->n >= lo && k->n <= q)
            h->dup_one = true, h->dup_pos = k->n;
        break;
    case CMP_DIAG_OWN_KEY_MASKED:
        h->hi = q - 1;
        break;
    case CMP_DIAG_FUTURE_KEYS:
        /* No causal mask inside a prefill chunk of n: the chunk's later
         * keys are read too (a decode step is alone in its chunk). */
        if (P > 0 && q < P) {
            const int64_t end = (q / k->n) * k->n + k->n - 1;
            h->hi = end < P - 1 ? end : P - 1;
        }
        break;
    case CMP_DIAG_EXTRA_KEY:
    case CMP_DIAG_PADDED_SLOTS:
        h->extra_zero = (int)(k->variant == 0 ? k->n : k->n - 1 - q > 0 ? k->n - 1 - q : 0);
        /* No slot past the cache's last: a mask off by one reads none there. */
        if (a->ctx > 0 && q + h->extra_zero >= a->ctx)
            h->extra_zero = (int)(a->ctx - 1 - q > 0 ? a->ctx - 1 - q : 0);
        break;
    case CMP_DIAG_DECODE_STUCK:
        /* Every decode token lands in slot n; the slots of the decode
         * positions were never written. */
        if (P <= 0 || q < P || (k->n == P && q == P))
            break;
        h->nsubst = 1;
        h->from[0] = k->n, h->to[0] = q;
        h->zero_lo = k->n == P ? P + 1 : P, h->zero_hi = q + 1;
        if (a->R > 0 && W > 0 && W == a->W) {
            if (q - P >= a->R)
                return false;
            h->older = a->R;
        }
        break;
    case CMP_DIAG_RING_NO_WRAP: {
        /* Writes stop at R: positions R.. read slots still holding 0... */
        const int64_t R = k->n;
        if (q < R || q >= 2 * R)
            return false;
        h->zero_lo = R, h->zero_hi = q + 1, h->older = R;
        break;
    }
    case CMP_DIAG_STALE_CACHE: {
        if (a->W <= 0 || a->C <= 0)
            return false;
        const int64_t cs = ks_chunk_start(q, P, a->C);
        if (cs > 0) {
            const int64_t prev = prev_chunk_start(cs, P, a->C);
            h->zero_lo = prev > lo ? prev : lo;
            h->zero_hi = cs;
            h->older = k->variant == 1 ? k->n : a->R;
        }
        break;
    }
    default:
        break;
    }
    return true;
}

bool ks_hyp_same(const cmp_hyp *x, const cmp_hyp *y)
{
    if (x->lo != y->lo || x->hi != y->hi || x->extra_zero != y->extra_zero ||
        x->nsubst != y->nsubst || x->skip_one != y->skip_one || x->dup_one != y->dup_one)
        return false;
    if ((x->zero_lo < x->zero_hi || y->zero_lo < y->zero_hi) &&
        (x->zero_lo != y->zero_lo || x->zero_hi != y->zero_hi || x->older != y->older))
        return false;
    for (int i = 0; i < x->nsubst; i++)
        if (x->from[i] != y->from[i] || x->to[i] != y->to[i])
            return false;
    return (!x->skip_one || x->skip_pos == y->skip_pos) && (!x->dup_one || x->dup_pos == y->dup_pos);
}

/* The candidate's key set at p, in words. */
void ks_describe(const cmp_ctx *c, const dg_case *a, ks_cand *k)
{
    const int64_t p = c->d->pos;
    cmp_hyp h;
    ks_keys(c, a, k, c->d->layer, p, &h);
    char *w = k->what;
    const size_t n = sizeof k->what;
    const long long lo = (long long)h.lo, hi = (long long)h.hi;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(w, n, "every key 0..%lld (a global layer)", hi);
        else
            dg_say(w, n, "a window of %lld key%s (%lld..%lld)", (long long)k->n,
                   k->n == 1 ? "" : "s", lo, hi);
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        dg_say(w, n, "only its own chunk's keys %lld..%lld", lo, hi);
        break;
    case CMP_DIAG_DECODE_BLIND:
        dg_say(w, n, "the decode steps' keys %lld..%lld alone", lo, hi);
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY:
        dg_say(w, n, "the config's keys %lld..%lld with key %lld %s", lo, hi, (long long)k->n,
               k->kind == CMP_DIAG_MISSING_KEY ? "left out" : "read twice");
        break;
    case CMP_DIAG_FUTURE_KEYS:
        dg_say(w, n, "keys %lld..%lld, the %lld after it in its chunk too", lo, hi,
               hi - (long long)p);
        break;
    case CMP_DIAG_OWN_KEY_MASKED:
        if (hi >= lo)
            dg_say(w, n, "keys %lld..%lld, its own key %lld masked out", lo, hi, (long long)p);
        else
            dg_say(w, n, "no key at all: its own key %lld masked out", (long long)p);
        break;
    case CMP_DIAG_EXTRA_KEY:
        dg_say(w, n, "the config's keys %lld..%lld plus one unwritten (zero) slot", lo, hi);
        break;
    case CMP_DIAG_PADDED_SLOTS:
        dg_say(w, n, "the config's keys %lld..%lld plus %d unwritten (zero) slots", lo, hi,
               h.extra_zero);
        break;
    case CMP_DIAG_DECODE_STUCK:
        if (p == a->P && k->n != a->P)
            dg_say(w, n, "keys where slot %lld holds position %lld's key and position %lld's "
                   "slot was never written", (long long)k->n, (long long)p, (long long)p);
        else
            dg_say(w, n, "keys where slot %lld holds position %lld's key and the slots of "
                   "positions %lld..%lld were never written", (long long)k->n, (long long)p,
                   (long long)h.zero_lo, (long long)p);
        break;
    case CMP_DIAG_RING_NO_WRAP:
        dg_say(w, n, "the config's keys, positions %lld..%lld read from ring slots still "
               "holding positions %lld..%lld", (long long)k->n, hi, 0LL, (long long)(p - k->n));
        break;
    case CMP_DIAG_STALE_CACHE:
        if (h.zero_lo < h.zero_hi)
            dg_say(w, n, "the config's keys with the previous chunk's (%lld..%lld) read %s",
                   (long long)h.zero_lo, (long long)(h.zero_hi - 1),
                   h.older > 0 ? "as the ring held them before it wrote" : "as never written");
        else
            dg_say(w, n, "the config's keys %lld..%lld (no earlier chunk in reach)", lo, hi);
        break;
    default:
        dg_say(w, n, "another key set");
        break;
    }
}

void ks_add_from(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope,
                     int64_t from)
{
    for (int i = 0; i < run->n; i++)
        if (run->k[i].kind == kind && run->k[i].n == n && run->k[i].variant == variant &&
            run->k[i].scope == scope && run->k[i].from == from)
            return;
    if (run->n >= KS_MAX)
        return;
    run->k[run->n++] = (ks_cand){.kind = kind, .n = n, .variant = variant, .scope = scope,
                                  .from = from, .alive = true, .fail_pos = -1, .miss_pos = -1,
                                  .fail_layer = -1, .err_p = INFINITY, .last_pos = -1,
                                  .act_pos = -1, .act_layer = -1};
}

void ks_add(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope)
{
    ks_add_from(run, kind, n, variant, scope, 0);
}

/* Zero slots added to the config's keys that the test's attention at p
 * shows: attention over n more keys scoring 0 (K = V = 0) has a sum of
 * weights Z + n where the config's has Z; solved per head from attn_lse,
 * or attn_out's shrinkage where lse is not recorded. 0 when none. */
static int64_t solve_zero_slots(cmp_ctx *c, dg_case *a, kv_err *e, int *rc)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, c->d->layer);
    const float *q = a->q_test ? a->q_test : a->q_ref;
    const float *lse_rec = c->ev->lse_test, *out_rec = a->out_test;
    if (!q || (!lse_rec && !out_rec))
        return 0;
    cmp_hyp h = dg_hyp_config(c->d, a);
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    int r = (!lse || !out) ? kv_errf(e, "compare: out of memory") : 1;
    if (r == 1 && a->q_test)
        r = cmp_recompute_attention(c->test, cfg, c->d->layer, q, &h, lse, out, e);
    if (r == 1)
        r = cmp_recompute_attention(c->ref, cfg, c->d->layer, q, &h, lse, out, e);
    double sum = 0;
    int used = 0;
    for (int i = 0; r == 0 && i < H; i++) {
        if (!isfinite(lse[i]) || lse[i] > 30)
            continue;   /* zero slots weigh nothing beside exp(30) */
        double nz;
        if (lse_rec) {
            nz = exp(lse[i]) * expm1((double)lse_rec[i] - lse[i]);
        } else {
            double dot = 0, sq = 0;
            for (int d = 0; d < D; d++) {
                dot += (double)out_rec[(size_t)i * D + d] * out[(size_t)i * D + d];
                sq += out[(size_t)i * D + d] * out[(size_t)i * D + d];
            }
            if (!(sq > 0) || !(dot > 0))
                continue;
            nz = exp(lse[i]) * (sq / dot - 1);
        }
        if (isfinite(nz)) {
            sum += nz;
            used++;
        }
    }
    free(lse);
    free(out);
    if (r < 0)
        *rc = -1;
    const double n = used > 0 ? round(sum / used) : 0;
    return n >= 1 && n <= 1 << 20 ? (int64_t)n : 0;
}

/* Every cause worth trying at p. */
int ks_propose(cmp_ctx *c, dg_case *a, ks_run *run, kv_err *e)
{
    const int64_t p = c->d->pos, P = a->P;
    const int W = a->W;
    const int nt = c->ev->nkeys_test, nr = c->ev->nkeys_ref;
    const int64_t ncfg = p - a->lo_ref + 1;
    /* Windows: one of N < W first differs at p = N, reading N keys; a
     * larger one (or none) at p = W, reading W + 1; a global layer read
     * through a window of N at p = N. */
    /* Each in two scopes: every layer of the kind (a window hard-coded,
     * a cache shared by the kind) or this layer alone (layer types off). */
    for (int s = SCOPE_LAYER; s <= SCOPE_KIND; s++) {
        if (W > 0 && p >= 1 && p < W)
            ks_add(run, CMP_DIAG_WINDOW, nt > 0 && nt < p + 1 ? nt : p, 0, (ks_scope)s);
        if (W > 0 && p == W)
            ks_add(run, CMP_DIAG_LAYER_TYPE, KS_ALL, 0, (ks_scope)s);
        if (W > 0 && nt > 0 && nt != ncfg && nt <= p + 1)
            ks_add(run, nt == p + 1 ? CMP_DIAG_LAYER_TYPE : CMP_DIAG_WINDOW,
                nt == p + 1 ? KS_ALL : nt, 0, (ks_scope)s);
        if (W == 0 && p >= 1)
            ks_add(run, CMP_DIAG_LAYER_TYPE, nt > 0 && nt < p + 1 ? nt : p, 0, (ks_scope)s);
    }
    /* Chunks attending only to themselves; decode steps isolated whatever
     * the prefill's chunks (a chunk >= P); decode blind to the prefill:
     * every layer, then the layer alone (a first-layer special case). Not
     * one kind: chunks of one isolated on the sliding layers read what a
     * window of one does there, everywhere, and the window is the bug
     * that happens. */
    int64_t C = a->C;
    for (int s = SCOPE_ALL; s >= SCOPE_LAYER; s -= SCOPE_ALL - SCOPE_LAYER) {
        if (C > 0 && ks_chunk_start(p, P > 0 ? P : INT64_MAX, C) > a->lo_ref)
            ks_add(run, CMP_DIAG_CHUNK_ISOLATED, C, 0, (ks_scope)s);
        if (P > 0 && p >= P && P > a->lo_ref)
            ks_add(run, CMP_DIAG_CHUNK_ISOLATED, P, 0, (ks_scope)s);
        if (P > 0 && p >= P && P > a->lo_ref)
            ks_add(run, CMP_DIAG_DECODE_BLIND, 0, 0, (ks_scope)s);
    }
    /* From the decode path's first step, or from the start; a bug of one
     * layer's code may begin anywhere (a special case from position p):
     * from p too. Every layer first, then the kind, then the layer alone
     * (merged into the wider where they predict alike). */
    const int64_t dec = P > 0 && p >= P ? P : 0;
    for (int s = SCOPE_ALL; s >= SCOPE_LAYER; s--) {
        ks_add_from(run, CMP_DIAG_OWN_KEY_MASKED, 0, 0, (ks_scope)s, dec);
        if (p > dec)
            ks_add_from(run, CMP_DIAG_OWN_KEY_MASKED, 0, 0, (ks_scope)s, p);
    }
    /* The causal mask missing in the prefill: chunks of the settings' size,
     * of the keys the test read at p, or the whole prompt. */
    for (int s = SCOPE_ALL; s >= SCOPE_LAYER && P > 0 && p < P; s -= SCOPE_ALL - SCOPE_LAYER) {
        if (a->C > 0 && !a->C_inferred)
            ks_add(run, CMP_DIAG_FUTURE_KEYS, a->C, 0, (ks_scope)s);
        if (nt > 0 && p == 0)
            ks_add(run, CMP_DIAG_FUTURE_KEYS, nt, 0, (ks_scope)s);
        ks_add(run, CMP_DIAG_FUTURE_KEYS, P, 0, (ks_scope)s);
    }
    if (P > 0 && p < P) {
        /* The count unrecorded: how far past p the test read, scanned key by
         * key; p first in its chunk (the first divergence of this bug is at
         * a chunk's start), keys p..hi are the chunk. */
        const float *qq = a->q_test ? a->q_test : a->q_ref;
        if (nt < 0 && qq && p + 1 < P) {
            int64_t hi;
            double err;
            const int rc = cmp_extend_scan(a->q_test ? c->test : c->ref, c->cfg, c->d->layer,
                                           qq, a->lo_ref, p, P - 1, c->ev->lse_test, a->out_test,
                                           c->rms_weight, &hi, &err, e);
            if (rc < 0)
                return -1;
            if (rc == 0 && err <= c->attn_tol && hi > p)
                ks_add(run, CMP_DIAG_FUTURE_KEYS, hi - p + 1, 0, SCOPE_ALL);
        }
    }
    /* Unwritten slots read as keys. */
    if (nt < 0 || (nr >= 0 && nt > nr) || (nr < 0 && nt > ncfg)) {
        int rc = 0;
        const int64_t z = solve_zero_slots(c, a, e, &rc);
        if (rc < 0)
            return -1;
        const int64_t from = dec > 0 ? dec : p;
        /* every layer, or the layer alone (one layer's cache padded) */
        for (int s = SCOPE_ALL; s >= SCOPE_LAYER; s -= SCOPE_ALL - SCOPE_LAYER) {
            if (z == 1)
                ks_add_from(run, CMP_DIAG_EXTRA_KEY, 1, 0, (ks_scope)s, from);
            if (z > 1)
                ks_add_from(run, CMP_DIAG_PADDED_SLOTS, z, 0, (ks_scope)s, from);
            if (z >= 1)
                ks_add_from(run, CMP_DIAG_PADDED_SLOTS, p + 1 + z, 1, (ks_scope)s, from);
        }
    }
    /* A decode write index stuck at one slot: every layer, or the layer
     * alone. */
    for (int s = SCOPE_ALL; s >= SCOPE_LAYER; s -= SCOPE_ALL - SCOPE_LAYER) {
        if (P > 0 && p > P)
            ks_add(run, CMP_DIAG_DECODE_STUCK, P, 0, (ks_scope)s);
        if (P > 1 && p >= P) {
            ks_add(run, CMP_DIAG_DECODE_STUCK, 0, 0, (ks_scope)s);
            ks_add(run, CMP_DIAG_DECODE_STUCK, P - 1, 0, (ks_scope)s);
        }
    }
    /* A ring that does not wrap, a stale sliding cache: on every sliding
     * layer (the sliding kind's cache code), or on this one alone (one
     * layer's cache handled apart). */
    const int64_t R = a->R > 0 ? a->R : a->R_guess;
    for (int s = SCOPE_KIND; s >= SCOPE_LAYER; s--) {
        if (W > 0 && R > 0 && p >= R && p < 2 * R)
            ks_add(run, CMP_DIAG_RING_NO_WRAP, R, 0, (ks_scope)s);
        if (W > 0 && a->C > 0 && p > 0 && ks_chunk_start(p, P, a->C) == p) {
            ks_add(run, CMP_DIAG_STALE_CACHE, 0, 0, (ks_scope)s);
            /* The cache unnamed: a ring of W + C slots holds older keys
             * where a dense cache holds none. They part once the ring
             * wraps. */
            if (a->R == 0 && !ks_cache_named(c))
                ks_add(run, CMP_DIAG_STALE_CACHE, W + a->C, 1, (ks_scope)s);
            /* Synced through the prefill, not between decode steps. */
            if (dec > 0)
                ks_add_from(run, CMP_DIAG_STALE_CACHE, 0, 0, (ks_scope)s, dec);
        }
    }
    /* One key left out or read twice: a scan picks the closest of each. */
    const bool fewer = nt < 0 || nt == (nr >= 0 ? nr : ncfg) - 1;
    const bool more = nt < 0 || nt == (nr >= 0 ? nr : ncfg) + 1;
    const float *q = a->q_test ? a->q_test : a->q_ref;
    if ((fewer || more) && q) {
        int64_t skip, dup;
        double skip_err, dup_err;
        int rc = cmp_keyset_scan(a->q_test ? c->test : c->ref, c->cfg, c->d->layer, q, a->lo_ref,
                                 p, c->ev->lse_test, a->out_test, &skip, &skip_err, &dup,
                                 &dup_err, e);
        if (rc < 0)
            return -1;
        for (int s = SCOPE_ALL; s >= SCOPE_LAYER; s--) {
            if (rc == 0 && fewer && skip >= 0 && skip < p && skip_err <= c->attn_tol)
                ks_add_from(run, CMP_DIAG_MISSING_KEY, skip, 0, (ks_scope)s, p);
            if (rc == 0 && more && dup >= 0 && dup_err <= c->attn_tol)
                ks_add_from(run, CMP_DIAG_DUP_KEY, dup, 0, (ks_scope)s, p);
        }
    }
    return 0;
}

const char *ks_phrase(cmp_diag_kind k)
{
    switch (k) {
    case CMP_DIAG_WINDOW: return "a sliding window of another size";
    case CMP_DIAG_LAYER_TYPE: return "the layer read as the other type";
    case CMP_DIAG_CHUNK_ISOLATED: return "chunks attending only to themselves";
    case CMP_DIAG_DECODE_BLIND: return "decode steps blind to the prefill";
    case CMP_DIAG_EXTRA_KEY: return "an unwritten slot attended as a key";
    case CMP_DIAG_PADDED_SLOTS: return "unwritten slots read as keys";
    case CMP_DIAG_DECODE_STUCK: return "a decode write index stuck";
    case CMP_DIAG_RING_NO_WRAP: return "a ring buffer not wrapping";
    case CMP_DIAG_STALE_CACHE: return "a sliding cache read from an earlier state";
    case CMP_DIAG_MISSING_KEY: return "one key left out";
    case CMP_DIAG_DUP_KEY: return "one key read twice";
    case CMP_DIAG_OWN_KEY_MASKED: return "the query's own key masked";
    case CMP_DIAG_FUTURE_KEYS: return "the causal mask missing";
    default: return "another key set";
    }
}

const char *ks_cache_named(const cmp_ctx *c)
{
    const cmp_source *run = cmp_settings_int(c->test, "chunk", 0) > 0 ? c->test : c->ref;
    return cmp_settings_is(run, "cache", "split") ? "split" : cmp_settings_is(run, "cache", "dense")
                                                                ? "dense"
                                                            : cmp_settings_is(run, "cache", "ring")
                                                                ? "ring" : NULL;
}

/* Cause (summary) and parameters (detail) of the one survivor. */
/* "(keys attended 6 vs 1 at position 5, the first of a chunk of 5)". */
static void chunk_where(const dg_case *a, const char *keys, long long pp, char *t, size_t nd)
{
    if (a->C_inferred)
        dg_say(t, nd, "(%s at position %lld, where a chunk starts; the engine settings do not "
               "give the chunk size)", keys, pp);
    else
        dg_say(t, nd, "(%s at position %lld, the first of a chunk of %lld)", keys, pp,
               (long long)a->C);
}

void ks_survivor_text(cmp_ctx *c, const dg_case *a, const ks_cand *k, const char *layers,
                          int n_other)
{
    const int64_t p = c->d->pos;
    const int l = c->d->layer;
    char *s = c->g->summary, *t = c->g->detail, keys[64], scope[64];
    const size_t ns = sizeof c->g->summary, nd = sizeof c->g->detail;
    dg_counts_phrase(c, keys, sizeof keys);
    ks_scope_text(c, k, scope, sizeof scope);
    c->g->kind = k->kind;
    const long long pp = (long long)p, last = (long long)k->last_pos;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
        dg_say(s, ns, "attention read a different key set at the sliding-window boundary");
        dg_say(t, nd, "(window in test appears to be %lld, config says %d%s)", (long long)k->n,
               a->W, k->scope == SCOPE_LAYER ? "; on this layer alone: the other sliding layers "
                                               "read as the config says" : "");
        break;
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(s, ns, "layer %d attends every key at every position checked (%lld..%lld): "
                   "it is global in the test; the config says sliding (window %d)", l, pp, last,
                   a->W);
        else
            dg_say(s, ns, "layer %d, global in the config, read through a window of %lld keys%s",
                   l, (long long)k->n, a->W == 0 && config_layer_window(c->cfg, 0) ==
                   (int)k->n ? "" : "");
        if (n_other > 0)
            dg_say(t, nd, "(layers read otherwise than the config at position %lld: %s; %s)",
                   last, layers, keys);
        else
            dg_say(t, nd, "(%s at position %lld; every other layer reads as the config says)",
                   keys, pp);
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        dg_say(s, ns, "attention read a different key set at a chunk boundary: chunks attend "
               "only to themselves%s", scope);
        if (p >= a->P && a->P > 0)
            dg_say(t, nd, "(%s at decode position %lld: each step saw only its own token)",
                   keys, pp);
        else
            chunk_where(a, keys, pp, t, nd);
        break;
    case CMP_DIAG_DECODE_BLIND: {
        const char *cache = ks_cache_named(c);
        if (last <= pp) {
            dg_say(s, ns, "decode steps attend only to the decode cache, never to the prefill's "
                   "keys%s", scope);
            dg_say(t, nd, "(%s at position %lld = prompt length)", keys, pp);
            break;
        }
        dg_say(s, ns, "decode steps attend only to the decode cache, never to the prefill's "
               "keys%s%s", scope, cache && strcmp(cache, "split") ? " (though the settings call "
               "the cache one piece)" : cache ? " (a split prefill/decode cache)" : "");
        dg_say(t, nd, "(%s at position %lld = prompt length; at %lld the test read positions "
               "%lld..%lld, the decode steps so far, and so on up to %lld: the prefill's %lld "
               "keys (positions 0..%lld) are never read)", keys, pp, pp + 1, (long long)a->P,
               pp + 1, last, (long long)a->P, (long long)a->P - 1);
        break;
    }
    case CMP_DIAG_EXTRA_KEY:
    case CMP_DIAG_PADDED_SLOTS:
        if (k->variant == 1)
            dg_say(s, ns, "attention read unwritten (zero) slots as keys%s: a cache of %lld "
                   "slots read whole (its padding not masked)", scope, (long long)k->n);
        else if (k->n == 1 && p == a->P)
            dg_say(s, ns, "at the first decode step: one extra key%s (off-by-one in the "
                   "prefill/decode mask)", scope);
        else if (k->n == 1)
            dg_say(s, ns, "one extra key%s: an unwritten (zero) slot attended as a key (an "
                   "off-by-one in a mask)", scope);
        else
            dg_say(s, ns, "attention read %lld unwritten (zero) slots as keys at every step%s "
                   "(padded slots of a fixed-size cache not masked)", (long long)k->n, scope);
        dg_say(t, nd, "(%s at position %lld%s)", keys, pp, p == a->P ? " = prompt length" : "");
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY: {
        const bool miss = k->kind == CMP_DIAG_MISSING_KEY;
        dg_say(s, ns, "attention read one key %s%s: the key at position %lld %s",
               miss ? "too few" : "too many", scope, (long long)k->n, miss
               ? "is not read (removed from the cache, or masked out)"
               : "is read twice (written to the cache twice, or a stray cell of the sequence)");
        dg_say(t, nd, "(%s at position %lld; the config's key set is %lld..%lld%s)", keys, pp,
               (long long)a->lo_ref, pp, scope[0] ? "; the layers left out read it as the "
               "config says: the bug lives in the code of the layers named" : "");
        break;
    }
    case CMP_DIAG_FUTURE_KEYS:
        dg_say(s, ns, "the causal mask is missing%s: position q reads the keys after it in its "
               "prefill chunk of %lld (up to position %lld at %lld)", scope, (long long)k->n,
               (long long)(((p / k->n) * k->n + k->n - 1) < a->P - 1 ? (p / k->n) * k->n + k->n - 1
                                                                     : a->P - 1), pp);
        dg_say(t, nd, "(%s at position %lld)", keys, pp);
        break;
    case CMP_DIAG_OWN_KEY_MASKED:
        dg_say(s, ns, "the query's own key is masked out%s: position q reads keys up to q - 1 "
               "(a strict mask, j < q, where j <= q is due)", scope);
        if (k->from > 0)
            dg_say(t, nd, "(%s at position %lld; from position %lld on%s)", keys, pp,
                   (long long)k->from, scope[0] ? ", the layers left out reading their own key "
                   "as the config says" : "");
        else
            dg_say(t, nd, "(%s at position %lld%s)", keys, pp, scope[0] ? "; the layers left "
                   "out read their own key as the config says" : "");
        break;
    case CMP_DIAG_DECODE_STUCK:
        dg_say(s, ns, "decode write index stuck at slot %lld%s: every decode step overwrites it",
               (long long)k->n, scope);
        dg_say(t, nd, "(%s at position %lld; the prompt is %lld tokens)", keys, pp,
               (long long)a->P);
        break;
    case CMP_DIAG_RING_NO_WRAP:
        dg_say(s, ns, "keys read from a slot the ring did not overwrite%s (ring buffer not "
               "wrapping)", scope);
        if (a->R == 0)
            dg_say(t, nd, "(%s at position %lld, the first position the ring did not store: a "
                   "ring of %lld slots; the engine settings do not give its size)", keys, pp,
                   (long long)k->n);
        else if (p == a->R)
            dg_say(t, nd, "(%s at position %lld = ring size: window %d + chunk %lld)", keys, pp,
                   a->W, (long long)a->C);
        else
            dg_say(t, nd, "(%s at position %lld, past the ring size %lld: window %d + chunk "
                   "%lld)", keys, pp, (long long)a->R, a->W, (long long)a->C);
        break;
    case CMP_DIAG_STALE_CACHE:
        dg_say(s, ns, "stale values%s: the sliding cache read is from an earlier state (state "
               "not synced between chunk calls)", scope);
        if (p >= a->P)
            dg_say(t, nd, "(%s at position %lld, a decode step)", keys, pp);
        else
            chunk_where(a, keys, pp, t, nd);
        break;
    default:
        break;
    }
}

/* Whether the model has layers of another window kind than layer L's. */
static bool other_kind(const kv_config *cfg, int L)
{
    for (int i = 0; i < cfg->n_layers; i++)
        if ((config_layer_window(cfg, i) > 0) != (config_layer_window(cfg, L) > 0))
            return true;
    return false;
}

/* How many layers have layer L's window. */
static int same_kind(const kv_config *cfg, int L)
{
    int n = 0;
    for (int i = 0; i < cfg->n_layers; i++)
        n += config_layer_window(cfg, i) == config_layer_window(cfg, L);
    return n;
}

bool ks_scoped_kind(cmp_diag_kind k)
{
    return k == CMP_DIAG_MISSING_KEY || k == CMP_DIAG_DUP_KEY || k == CMP_DIAG_OWN_KEY_MASKED ||
           k == CMP_DIAG_CHUNK_ISOLATED || k == CMP_DIAG_DECODE_BLIND ||
           k == CMP_DIAG_FUTURE_KEYS || k == CMP_DIAG_EXTRA_KEY || k == CMP_DIAG_PADDED_SLOTS ||
           k == CMP_DIAG_DECODE_STUCK || k == CMP_DIAG_RING_NO_WRAP ||
           k == CMP_DIAG_STALE_CACHE;
}

bool ks_sliding_kind(cmp_diag_kind k)
{
    return k == CMP_DIAG_RING_NO_WRAP || k == CMP_DIAG_STALE_CACHE;
}

void ks_scope_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n)
{
    const int l = c->d->layer;
    buf[0] = '\0';
    if (!ks_scoped_kind(k->kind))
        return;   /* windows and layer types say their scope their own way */
    if ((k->scope == SCOPE_LAYER && c->cfg->n_layers > 1) ||
        (k->scope == SCOPE_KIND && other_kind(c->cfg, l) && same_kind(c->cfg, l) == 1))
        dg_say(buf, n, " on layer %d only", l);
    else if (k->scope == SCOPE_KIND && other_kind(c->cfg, l) && !ks_sliding_kind(k->kind))
        dg_say(buf, n, " on the %s layers only",
               config_layer_window(c->cfg, l) > 0 ? "sliding" : "global");
}

/* The parameter that tells apart candidates of one kind, in words. */
void ks_param_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n)
{
    buf[0] = '\0';
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(buf, n, ", every key");
        else
            dg_say(buf, n, ", %lld key%s", (long long)k->n, k->n == 1 ? "" : "s");
        if (k->scope == SCOPE_LAYER)
            dg_append(buf, n, " on layer %d alone", c->d->layer);
        else
            dg_append(buf, n, " on every %s layer",
                      config_layer_window(c->cfg, c->d->layer) > 0 ? "sliding" : "global");
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
    case CMP_DIAG_FUTURE_KEYS:
        dg_say(buf, n, ", chunk %lld", (long long)k->n);
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY:
        dg_say(buf, n, ", key %lld", (long long)k->n);
        break;
    case CMP_DIAG_DECODE_STUCK:
        dg_say(buf, n, ", slot %lld", (long long)k->n);
        break;
    case CMP_DIAG_PADDED_SLOTS:
        dg_say(buf, n, k->variant == 1 ? ", a cache of %lld" : ", %lld slots", (long long)k->n);
        break;
    default:
        break;
    }
    if (k->from > 0 && k->kind != CMP_DIAG_DECODE_BLIND && k->kind != CMP_DIAG_DECODE_STUCK)
        dg_append(buf, n, ", from position %lld", (long long)k->from);
    char scope[64];
    ks_scope_text(c, k, scope, sizeof scope);
    if (scope[0])
        dg_append(buf, n, ",%s", scope);
}
