/* rows.c — families read off the recorded rows themselves
 * (docs/diagnosis.md, "The hypothesis engine"): K/V rows written as zero
 * (the K = V = 0 of KV-shared ports, or K or V alone), K/V rows written N
 * positions off (a write index off by N), k and v projections swapped,
 * and an RMSNorm epsilon other than the config's. Each predicts the test's rows
 * from the reference's and is checked at every position after p that
 * shares the reference's input there. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"

#define ROWS_MAX_POS 8           /* positions a row family is checked at */

static bool all_zero(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (x[i] != 0.0f)
            return false;
    return true;
}

/* The last position the test holds of (layer, st), -1 none. */
static int64_t last_held(const cmp_ctx *c, int layer, kv_stage st)
{
    int64_t lo, hi;
    const int cols = cmp_stage_cols(c->cfg, layer, st);
    return cols > 0 && cmp_source_held(c->test, layer, st, cols, &lo, &hi) == 0 ? hi : -1;
}

/* Positions q >= p (up to ROWS_MAX_POS) where the layer's input is the
 * reference's in the test too (its x_in rows within the match tolerance,
 * or p alone when x_in is not recorded): there a row family's prediction
 * from the reference's rows is the test's. */
static int same_input_positions(cmp_ctx *c, int layer, int64_t *pos, kv_err *e)
{
    const int64_t p = c->d->pos, last = last_held(c, layer, c->d->stage);
    const int E = c->cfg->hidden;
    int n = 0;
    pos[n++] = p;
    for (int64_t q = p + 1; q <= last && n < ROWS_MAX_POS; q++) {
        int rc = 0;
        float *a = dg_row(c, c->ref, layer, STAGE_X_IN, q, &rc, e);
        float *b = dg_row(c, c->test, layer, STAGE_X_IN, q, &rc, e);
        const bool same = a && b && cmp_row_rel_err(b, a, E) <= c->row_tol;
        free(a);
        free(b);
        if (rc < 0)
            return -1;
        if (!same)
            break;
        pos[n++] = q;
    }
    return n;
}

/* ------------------------------------------------------------------ */
/* K / V rows zero                                                      */

static int rule_zero_rows(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if (d->stage != STAGE_K && d->stage != STAGE_V)
        return 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, STAGE_K);
    int rc = 0;
    float *t = dg_row(c, dg_test_rows(c), d->layer, d->stage, d->pos, &rc, e);
    float *r = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    const bool zero = t && r && all_zero(t, n) && !all_zero(r, n);
    free(t);
    free(r);
    if (rc < 0 || !zero)
        return rc;
    /* How far it goes: positions p.. of this layer, and every KV layer. */
    bool kz = true, vz = true;
    int64_t end = d->pos;
    const int64_t last = last_held(c, d->layer, STAGE_K);
    for (int64_t q = d->pos; q <= last && rc == 0; q++) {
        float *k = dg_row(c, dg_test_rows(c), d->layer, STAGE_K, q, &rc, e);
        float *v = dg_row(c, dg_test_rows(c), d->layer, STAGE_V, q, &rc, e);
        const bool kq = k && all_zero(k, n), vq = v && all_zero(v, n);
        free(k);
        free(v);
        if (!(q == d->pos ? (d->stage == STAGE_K ? kq : vq) : (kq || vq)))
            break;
        if (q == d->pos || kq == kz || vq == vz) {
            kz &= kq;
            vz &= vq;
            end = q;
        }
    }
    char layers[192] = "";
    int nl = 0;
    for (int L = 0; L < c->cfg->n_layers && rc == 0; L++) {
        if (c->cfg->kv_owner[L] != L)
            continue;
        float *k = dg_row(c, dg_test_rows(c), L, d->stage, d->pos, &rc, e);
        if (k && all_zero(k, n))
            dg_append(layers, sizeof layers, "%s%d", nl++ ? ", " : "", L);
        free(k);
    }
    if (rc < 0)
        return -1;
    char s[256];
    if (kz && vz)
        dg_say(s, sizeof s, "K and V rows written as zero from position %lld on: the cache "
               "holds nothing there (K = V = 0, as KV-shared ports that never fill the shared "
               "cache show)", (long long)d->pos);
    else
        dg_say(s, sizeof s, "%s rows written as zero from position %lld on, the %s rows as the "
               "reference's: the %s never reach the cache there (a write of one skipped, or "
               "one read from a buffer never filled)", kz ? "K" : "V", (long long)d->pos,
               kz ? "V" : "K", kz ? "keys" : "values");
    dg_set(c, CMP_DIAG_ZERO_KV, CMP_BASIS_EXACT_CHECK, s);
    dg_say(c->g->detail, sizeof c->g->detail, "(every position %lld..%lld of layer %d is zero "
           "in the test%s; zero at position %lld in layer%s %s)", (long long)d->pos,
           (long long)end, d->layer, end == last ? ", to the last recorded" : "",
           (long long)d->pos, nl == 1 ? "" : "s", layers);
    dg_say(c->g->evidence, sizeof c->g->evidence, "the test's %s rows are exactly 0 at every "
           "position %lld..%lld; the reference's are not", stage_name(d->stage),
           (long long)d->pos, (long long)end);
    return 1;
}

/* ------------------------------------------------------------------ */
/* K / V rows written N positions off                                  */

#define SHIFT_MAX 4              /* offsets tried: -SHIFT_MAX .. SHIFT_MAX */

/* The test's k (or v) row at q is the reference's at q - N, from p on,
 * at every position checked (up to ROWS_MAX_POS, before the token cut):
 * what a cache write index off by N leaves in a recording of the cache
 * (the row of q - N in slot q). The rows are copies: RoPE came with them. */
static int rule_shifted_rows(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if ((d->stage != STAGE_K && d->stage != STAGE_V) || d->pos < 1)
        return 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    int64_t last = last_held(c, d->layer, d->stage);
    if (c->pos_limit >= 0 && last >= c->pos_limit)
        last = c->pos_limit - 1;
    const double tol = fmax(c->row_tol, CMP_MATCH_TOL);
    /* The rows read once: the test's at p .. p + ROWS_MAX_POS - 1, the
     * reference's SHIFT_MAX further either way (NULL: not held). */
    enum { NT = ROWS_MAX_POS, NR = ROWS_MAX_POS + 2 * SHIFT_MAX };
    float *tr[NT] = {0}, *rr[NR] = {0};
    const int64_t r0 = d->pos - SHIFT_MAX;
    int rc = 0;
    for (int k = 0; k < NR && rc == 0; k++)
        if (r0 + k >= 0 && r0 + k <= last)
            rr[k] = dg_row(c, c->ref, d->layer, d->stage, r0 + k, &rc, e);
    for (int k = 0; k < NT && rc == 0 && d->pos + k <= last; k++)
        tr[k] = dg_row(c, dg_test_rows(c), d->layer, d->stage, d->pos + k, &rc, e);
    int sh = 0, checked = 0;
    double worst = 0;
    for (int N = 1; N <= 2 * SHIFT_MAX && rc == 0 && checked < 2; N++) {
        sh = N <= SHIFT_MAX ? N : SHIFT_MAX - N;   /* 1..4, then -1..-4 */
        checked = 0;
        worst = 0;
        bool holds = true;
        for (int k = 0; k < NT && tr[k] && holds; k++) {
            const float *r = rr[k + SHIFT_MAX - sh], *own = rr[k + SHIFT_MAX];
            if (!r || !own)
                break;
            const double err = cmp_row_rel_err(tr[k], r, n);
            /* the row is the other position's, and not its own */
            holds = err <= tol && cmp_row_rel_err(tr[k], own, n) > 4 * tol;
            worst = fmax(worst, err);
            checked++;
        }
        if (!holds)
            checked = 0;
    }
    for (int k = 0; k < NR; k++)
        free(rr[k]);
    for (int k = 0; k < NT; k++)
        free(tr[k]);
    if (rc < 0)
        return -1;
    if (checked >= 2) {
        const char *what = d->stage == STAGE_K ? "K" : "V";
        char s[256];
        dg_say(s, sizeof s, "%s rows written %d position%s off from position %lld on: the test's "
               "row at q is the reference's at q %s %d (a cache write index off by %d)", what,
               abs(sh), abs(sh) == 1 ? "" : "s", (long long)d->pos, sh > 0 ? "-" : "+", abs(sh),
               sh);
        dg_set(c, CMP_DIAG_ROWS_SHIFTED, CMP_BASIS_EXACT_CHECK, s);
        dg_say(c->g->detail, sizeof c->g->detail, "(layer %d: each row the %s of position q %s "
               "%d%s, where the config writes q's own)", d->layer,
               d->stage == STAGE_K ? "key" : "value", sh > 0 ? "-" : "+", abs(sh),
               d->stage == STAGE_K ? ", rotated for that position" : "");
        dg_say(c->g->evidence, sizeof c->g->evidence, "at %d positions from %lld the test's %s "
               "row equals the reference's %d position%s %s (to %.2g), and differs from the "
               "reference's own (errors up to %.2g count as equal)", checked, (long long)d->pos,
               stage_name(d->stage), abs(sh), abs(sh) == 1 ? "" : "s", sh > 0 ? "earlier"
               : "later", worst, tol);
        return 1;
    }
    return rc;
}

/* ------------------------------------------------------------------ */
/* k and v swapped                                                      */

/* Max |u - n g| / max |u| over rows, where n is each head of the other
 * row RMS-normalised (qk-norm: k = norm(W x) w) or as it is (no norm), and
 * g the per-dimension gain fitted over all rows and heads (1 without a
 * norm). u: unrotated rows (rows x heads x D). */
static double gain_fit_err(const double *u, const float *o, int rows, int nh, int D, bool norm)
{
    double *g = calloc((size_t)D, sizeof(double)), *den = calloc((size_t)D, sizeof(double));
    double *nv = malloc((size_t)rows * nh * D * sizeof(double));
    double err = INFINITY;
    if (!g || !den || !nv)
        goto out;
    for (int r = 0; r < rows * nh; r++) {
        double ms = 0;
        for (int i = 0; i < D; i++)
            ms += (double)o[(size_t)r * D + i] * o[(size_t)r * D + i];
        const double inv = norm && ms > 0 ? 1.0 / sqrt(ms / D) : 1.0;
        for (int i = 0; i < D; i++) {
            nv[(size_t)r * D + i] = o[(size_t)r * D + i] * inv;
            g[i] += u[(size_t)r * D + i] * nv[(size_t)r * D + i];
            den[i] += nv[(size_t)r * D + i] * nv[(size_t)r * D + i];
        }
    }
    for (int i = 0; i < D; i++)
        g[i] = norm ? (den[i] > 0 ? g[i] / den[i] : 0) : 1.0;
    double num = 0, mx = 0;
    for (int r = 0; r < rows * nh; r++)
        for (int i = 0; i < D; i++) {
            num = fmax(num, fabs(u[(size_t)r * D + i] - nv[(size_t)r * D + i] * g[i]));
            mx = fmax(mx, fabs(u[(size_t)r * D + i]));
        }
    err = mx > 0 ? num / mx : INFINITY;
out:
    free(g);
    free(den);
    free(nv);
    return err;
}

/* Max |u - o - c| / max |u| over rows, c the per-column mean of u - o
 * (n columns): u the other row plus one offset per channel. c: out. */
static double offset_fit_err(const double *u, const float *o, int rows, int n, double *c)
{
    for (int i = 0; i < n; i++) {
        c[i] = 0;
        for (int r = 0; r < rows; r++)
            c[i] += (u[(size_t)r * n + i] - o[(size_t)r * n + i]) / rows;
    }
    double num = 0, mx = 0;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++) {
            num = fmax(num, fabs(u[(size_t)r * n + i] - o[(size_t)r * n + i] - c[i]));
            mx = fmax(mx, fabs(u[(size_t)r * n + i]));
        }
    return mx > 0 ? num / mx : INFINITY;
}

static int rule_kv_swapped(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if ((d->stage != STAGE_K && d->stage != STAGE_V) || cfg->kv_owner[d->layer] != d->layer)
        return 0;
    const int KV = config_layer_kv_heads(cfg, d->layer);
    const int D = config_layer_head_dim(cfg, d->layer), n = KV * D;
    int64_t pos[ROWS_MAX_POS];
    const int np = same_input_positions(c, d->layer, pos, e);
    if (np < 0)
        return -1;
    /* With a single row a per-dimension gain fits anything: a norm's
     * gain needs several. */
    const bool norm = cfg->qk_norm || cfg->arch == ARCH_GEMMA3 || cfg->arch == ARCH_GEMMA4;
    if (norm && np * KV < 4)
        return 0;
    double *ku = malloc((size_t)np * n * sizeof(double)), *ru = malloc((size_t)np * n * sizeof(double));
    float *vr = malloc((size_t)np * n * sizeof(float)), *vt = malloc((size_t)np * n * sizeof(float));
    int rc = (!ku || !ru || !vr || !vt) ? kv_errf(e, "compare: out of memory") : 0;
    int got = 0;
    for (int i = 0; i < np && rc == 0; i++) {
        float *kt = dg_row(c, dg_test_rows(c), d->layer, STAGE_K, pos[i], &rc, e);
        float *kr = dg_row(c, c->ref, d->layer, STAGE_K, pos[i], &rc, e);
        float *a = dg_row(c, c->ref, d->layer, STAGE_V, pos[i], &rc, e);
        float *b = dg_row(c, dg_test_rows(c), d->layer, STAGE_V, pos[i], &rc, e);
        if (kt && kr && a && b) {
            cmp_rope_unrotate(cfg, d->layer, pos[i], kt, KV, ku + (size_t)got * n);
            cmp_rope_unrotate(cfg, d->layer, pos[i], kr, KV, ru + (size_t)got * n);
            memcpy(vr + (size_t)got * n, a, (size_t)n * sizeof(float));
            memcpy(vt + (size_t)got * n, b, (size_t)n * sizeof(float));
            got++;
        }
        free(kt);
        free(kr);
        free(a);
        free(b);
    }
    double ek = INFINITY, ev = INFINITY, same = INFINITY;
    if (rc == 0 && got > 0 && (!norm || got * KV >= 4)) {
        ek = gain_fit_err(ku, vr, got, KV, D, norm);   /* the test's k from the v projection */
        ev = gain_fit_err(ru, vt, got, KV, D, norm);   /* the reference's k from the test's v */
        same = gain_fit_err(ru, vr, got, KV, D, norm); /* the reference's k from its own v */
    }
    const double tol = fmax(c->row_tol, CMP_MATCH_TOL) * (norm ? 4 : 1);
    /* Where the reference's own k is its v the same way (Gemma 4's full
     * layers take v from k's projection), a swap changes nothing and the
     * fits above hold of any rows near the reference's: not told apart. */
    if (rc == 0 && same <= tol)
        ek = ev = INFINITY;
    /* The weights swapped, each projection keeping its own bias: the
     * test's k is the reference's v plus b_k - b_v, and the reference's k
     * the test's v plus the same offset. One offset per channel fitted
     * over the rows (several: one row fits any offset) must hold both. */
    bool biased = false;
    double off_gap = 0, off_rms = 0;
    if (rc == 0 && !(ek <= tol && ev <= tol) && !norm && c->cfg->qkv_bias && got >= 4) {
        double *ck = malloc((size_t)n * 2 * sizeof *ck);
        if (!ck) {
            rc = kv_errf(e, "compare: out of memory");
        } else {
            double *cv = ck + n;
            const double fk = offset_fit_err(ku, vr, got, n, ck);
            const double fv = offset_fit_err(ru, vt, got, n, cv);
            double scale = 0;
            for (int i = 0; i < got * n; i++)
                scale = fmax(scale, fabs(ru[i]));
            for (int i = 0; i < n; i++) {
                off_gap = fmax(off_gap, fabs(ck[i] - cv[i]));
                off_rms += ck[i] * ck[i] / n;
            }
            off_rms = sqrt(off_rms);
            biased = fk <= tol && fv <= tol && scale > 0 && off_gap <= tol * scale;
            if (biased) {
                ek = fk;
                ev = fv;
                off_rms /= scale;
            }
            free(ck);
        }
    }
    free(ku);
    free(ru);
    free(vr);
    free(vt);
    if (rc < 0 || !(ek <= tol && ev <= tol))
        return rc < 0 ? -1 : 0;
    if (biased)
        dg_set(c, CMP_DIAG_KV_SWAPPED, CMP_BASIS_RECOMPUTED, "k and v projection weights "
               "swapped, each keeping its own bias: the test's keys are the values' projection "
               "and its values the keys'");
    else
        dg_set(c, CMP_DIAG_KV_SWAPPED, CMP_BASIS_RECOMPUTED, "k and v projections swapped: "
               "the test's keys are the values' projection and its values the keys'");
    if (biased)
        dg_say(c->g->detail, sizeof c->g->detail, "(layer %d from position %lld: the test's k, "
               "rotated back, is the reference's v plus one offset per channel (b_k - b_v, RMS "
               "%.3g of the rows' scale), and its v the reference's k before RoPE minus the "
               "same offset: the weights traded places, the biases did not)", d->layer,
               (long long)d->pos, off_rms);
    else
        dg_say(c->g->detail, sizeof c->g->detail, "(layer %d from position %lld: the test's k, "
               "rotated back, is the reference's v%s, and its v the reference's k before %s)",
               d->layer, (long long)d->pos, norm ? " normalised by the k norm" : "",
               norm ? "the k norm and RoPE" : "RoPE");
    dg_say(c->g->evidence, sizeof c->g->evidence, "at %d position%s %lld..%lld the test's k "
           "(RoPE undone) matches the reference's v%s to %.2g, and the reference's k the "
           "test's v to %.2g", got, got == 1 ? "" : "s", (long long)pos[0],
           (long long)pos[got - 1], norm ? " under one fitted per-dimension norm gain"
           : biased ? " plus one fitted offset per channel" : "", ek, ev);
    if (biased)
        dg_append(c->g->evidence, sizeof c->g->evidence, "; the two offsets agree to %.2g "
                  "(each is b_k - b_v)", off_gap);
    return 1;
}

/* ------------------------------------------------------------------ */
/* RMSNorm epsilon                                                      */

static int rule_norm_eps(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    kv_stage in;
    int il = d->layer;
    switch (d->stage) {
    case STAGE_ATTN_NORM: in = STAGE_X_IN; break;
    case STAGE_FFN_NORM: in = STAGE_H_MID; break;
    default: return 0;
    }
    const int E = cfg->hidden;
    int64_t pos[ROWS_MAX_POS];
    const int np = same_input_positions(c, il, pos, e);
    if (np < 0)
        return -1;
    double eps_t[ROWS_MAX_POS], fit = 0;
    int got = 0, rc = 0;
    for (int i = 0; i < np && rc == 0; i++) {
        float *x = dg_row(c, c->ref, il, in, pos[i], &rc, e);
        float *a = dg_row(c, c->ref, d->layer, d->stage, pos[i], &rc, e);
        float *b = dg_row(c, dg_test_rows(c), d->layer, d->stage, pos[i], &rc, e);
        if (x && a && b) {
            double ms = 0, ab = 0, aa = 0;
            for (int j = 0; j < E; j++) {
                ms += (double)x[j] * x[j];
                ab += (double)a[j] * b[j];
                aa += (double)a[j] * a[j];
            }
            ms /= E;
            const double r = aa > 0 ? ab / aa : NAN;   /* test = r ref */
            double worst = 0, mx = 0;
            for (int j = 0; j < E; j++) {
                worst = fmax(worst, fabs((double)b[j] - r * a[j]));
                mx = fmax(mx, fabs((double)b[j]));
            }
            fit = fmax(fit, mx > 0 ? worst / mx : INFINITY);
            eps_t[got++] = r > 0 ? (ms + cfg->rms_eps) / (r * r) - ms : NAN;
        }
        free(x);
        free(a);
        free(b);
    }
    if (rc < 0)
        return -1;
    const double tol = fmax(c->row_tol, CMP_MATCH_TOL);
    if (got == 0 || !(fit <= tol) || !(eps_t[0] > 0))
        return 0;
    /* One epsilon at every position: their spread within what the rows'
     * own rounding leaves. */
    double lo = eps_t[0], hi = eps_t[0];
    for (int i = 1; i < got; i++) {
        lo = fmin(lo, eps_t[i]);
        hi = fmax(hi, eps_t[i]);
    }
    if (!(lo > 0) || hi > lo * 1.05 || fabs(eps_t[0] - cfg->rms_eps) <= 0.05 * cfg->rms_eps)
        return 0;
    /* A round value where the estimates allow it, their middle otherwise. */
    const double eps = dg_config_value(lo * 0.99, hi * 1.01, 0.5 * (lo + hi));
    char s[256];
    dg_say(s, sizeof s, "RMSNorm epsilon: the test normalises %s with eps %.3g where the config "
           "says %.3g", stage_name(d->stage), eps, cfg->rms_eps);
    dg_set(c, CMP_DIAG_NORM_EPS, got > 1 ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC, s);
    dg_say(c->g->detail, sizeof c->g->detail, "(layer %d, position %lld: the test's row is the "
           "reference's times sqrt((ms + %.3g) / (ms + %.3g)), ms the mean square of its input)",
           d->layer, (long long)d->pos, cfg->rms_eps, eps);
    dg_say(c->g->evidence, sizeof c->g->evidence, "at %d position%s %lld..%lld sharing the "
           "reference's input the test's %s is the reference's scaled by one factor (to %.2g), "
           "and each factor gives eps %.4g..%.4g", got, got == 1 ? "" : "s", (long long)pos[0],
           (long long)pos[got - 1], stage_name(d->stage), fit, lo, hi);
    return 1;
}

/* ------------------------------------------------------------------ */
/* Attention that read K = V = 0                                        */

/* lse = log(n) on every head: n keys all scoring 0. */
static bool lse_is_log_n(const float *lse, int H, int n)
{
    const double lg = log((double)n);
    bool yes = lse != NULL && n >= 1;
    for (int h = 0; yes && h < H; h++)
        yes = fabs((double)lse[h] - lg) <= 1e-6 * fmax(1.0, lg);
    return yes;
}


/* Every score 0 (lse = log(n)) and, where attn_out is recorded, every
 * head's output exactly zero: n keys with K = V = 0. Without attn_out the
 * scores alone say K = 0 (V unchecked); without q, a zero query would
 * give the same scores, and the text says so. */
int dg_rule_zero_read(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    const int H = c->cfg->n_heads, n = H * config_layer_head_dim(c->cfg, c->d->layer);
    if (!dg_is_attn_stage(d->stage) || !ev->lse_test || ev->nkeys_test < 1 ||
        !lse_is_log_n(ev->lse_test, H, ev->nkeys_test))
        return 0;
    int rc = 0;
    float *out = dg_row(c, c->test, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *ref = dg_row(c, c->ref, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *q = dg_row(c, c->test, d->layer, STAGE_Q, d->pos, &rc, e);
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
        dg_say(s, sizeof s, "attention read K = V = 0 (an empty or unwired cache%s)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else if (have_q)
        dg_say(s, sizeof s, "attention read zero keys: every score was 0 (an empty or unwired "
            "cache%s)", owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else
        dg_say(s, sizeof s, "every attention score was 0: zero keys read (an empty or unwired "
            "cache%s), or a zero query (q not recorded)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    dg_set(c, CMP_DIAG_ZERO_KV, CMP_BASIS_EXACT_CHECK, s);
    if (owner != d->layer)
        dg_say(c->g->detail, sizeof c->g->detail, "(layer %d reads layer %d's cache: %s)",
            d->layer, owner, have_out ? "it got nothing from it" : "what it read scored 0");
    dg_say(c->g->evidence, sizeof c->g->evidence, "%sattn_lse = log(%d) = %.6g on every head, "
        "what %d key%s scoring 0 give%s%s", have_out ? "the test's attn_out is exactly 0 for "
        "every head and " : "the test's ", nt, lg, nt, nt == 1 ? "" : "s", nt == 1 ? "s" : "",
        have_out ? "" : "; attn_out not recorded, so V = 0 is not checked");
    return 1;
}

int dg_rule_rows(cmp_ctx *c, kv_err *e)
{
    int rc;
    if ((rc = rule_zero_rows(c, e)) != 0)
        return rc;
    if ((rc = rule_shifted_rows(c, e)) != 0)
        return rc;
    if ((rc = rule_kv_swapped(c, e)) != 0)
        return rc;
    return rule_norm_eps(c, e);
}
