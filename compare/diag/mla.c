/* mla.c — latent (MLA) caches gone wrong: the shared RoPE key tail rotated
 * twice or not cached, decode's absorbed form without YaRN's mscale
 * correction, and decode reading a latent cache that prefill never filled.
 *
 * Each is a hypothesis about the keys or the scale the test's attention
 * used, recomputed from the test's own q, k, v (recompute.c: cmp_hyp's
 * tail and scale fields, and the zero-key range): where exactly one
 * reproduces the test's attention at the point and the config's does not,
 * it names the point. The keys are the expanded ones an MLA recording
 * holds (stage k: each head's nope part and the shared rotated tail). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
#include "../../model/kernels.h"

#define TAIL_SCAN_MAX 512   /* chunk starts tried for an uncached tail, at most */

/* Error of h at the point from the test's rows (dg_hyp_err's), +inf when
 * it cannot be recomputed. */
static double err_of(cmp_ctx *c, dg_case *a, const cmp_hyp *h, kv_err *e, int *rc)
{
    double err = INFINITY;
    if (*rc == 0 && dg_hyp_err(c, a, h, false, &err, e) < 0)
        *rc = -1;
    return err;
}

/* Whose rows a recomputation read: the test's own, or its q with the
 * reference's k and v where the test records none (llama.cpp's absorbed
 * graph never forms them). Valid after the errors were computed. */
static const char *rows_used(const dg_case *a)
{
    return a->ref_rows_used ? "the test's q and the reference's k, v (the test records none)"
                            : "the test's q, k, v";
}

/* m(mscale_all_dim)^2: what DeepSeek's YaRN multiplies q.k by (1: none). */
static double softmax_mscale2(const kv_config *cfg)
{
    const double plain = 1.0 / sqrt((double)cfg->head_dim);
    return cfg->attn_scale > 0 ? cfg->attn_scale / plain : 1.0;
}

/* Relative error of n values of b against a (max abs over a's max abs). */
static double rel_err(const float *a, const float *b, int n)
{
    double d = 0, s = 0;
    for (int i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)a[i]));
    }
    return s > 0 ? d / s : d;
}

/* The cache row itself (kv_latent) first differs: the latent as the
 * reference's and the tail rotated once more, not rotated, or zero. Read
 * from the two rows at the point: the test's tail against the reference's
 * turned by the position's angle either way. */
static int latent_row(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    const int R = cfg->kv_lora_rank, dr = cfg->qk_rope_dim, half = dr / 2;
    float *a = NULL, *b = NULL;
    int rc = dg_row_pair(c, d->layer, STAGE_KV_LATENT, d->pos, &a, &b, e);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    const double tol = fmax(c->row_tol, 1e-6);
    double inv[KV_MAX_HEAD_DIM / 2];
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2], neg[KV_MAX_HEAD_DIM / 2];
    float fwd[KV_MAX_HEAD_DIM], back[KV_MAX_HEAD_DIM], zero[KV_MAX_HEAD_DIM] = {0};
    const float *ta = a + R, *tb = b + R;
    const double lat = rel_err(a, b, R), scale_a = rel_err(zero, ta, dr);
    int found = 0;
    char sum[320], detail[320], ev[320];
    if (dr > KV_MAX_HEAD_DIM || lat > tol || d->pos < 1 || scale_a <= 0)
        goto out;
    config_rope_inv_freq(cfg, false, inv);
    /* YaRN's cos/sin factor m: a second turn multiplies by it again, an
     * unturned tail lacks it */
    const double m = config_rope_mscale(cfg, false);
    kern_rope_table_scaled((double)d->pos, inv, dr, m, cs, sn);
    float ics[KV_MAX_HEAD_DIM / 2];
    for (int i = 0; i < half; i++) {
        ics[i] = (float)(cs[i] / (m * m));
        neg[i] = (float)(-sn[i] / (m * m));
    }
    memcpy(fwd, ta, (size_t)dr * sizeof(float));
    memcpy(back, ta, (size_t)dr * sizeof(float));
    kern_rope_apply_pairs(fwd, 1, dr, half, cs, sn);
    kern_rope_apply_pairs(back, 1, dr, half, ics, neg);
    const double e_fwd = rel_err(fwd, tb, dr), e_back = rel_err(back, tb, dr);
    const bool tail_zero = rel_err(zero, tb, dr) <= tol * scale_a;   /* max |tb| vs max |ta| */
    if (e_fwd <= tol) {
        dg_say(sum, sizeof sum, "the latent cache's RoPE key tail is rotated twice: the "
               "cached row's shared %d-wide tail is turned by its position once more", dr);
        dg_say(detail, sizeof detail, "(the tail is rotated when kv_a_proj_with_mqa's output is "
               "split and again before it is cached)");
        dg_say(ev, sizeof ev, "the test's kv_latent row at position %lld holds the "
               "reference's latent (error %.2g) and its tail turned once more by position "
               "%lld's angles (error %.2g; the tails as recorded differ by %.2g)",
               (long long)d->pos, lat, (long long)d->pos, e_fwd, rel_err(ta, tb, dr));
        found = 1;
    } else if (e_back <= tol) {
        dg_say(sum, sizeof sum, "the latent cache's RoPE key tail is not rotated: the cached "
               "row holds the shared %d-wide tail as projected", dr);
        dg_say(detail, sizeof detail, "(kv_a_proj_with_mqa's last qk_rope_head_dim values "
               "are cached before RoPE turns them)");
        dg_say(ev, sizeof ev, "the test's kv_latent row at position %lld holds the "
               "reference's latent (error %.2g) and its tail turned back by position %lld's "
               "angles (error %.2g)", (long long)d->pos, lat, (long long)d->pos, e_back);
        found = 1;
    } else if (tail_zero) {
        dg_say(sum, sizeof sum, "the latent cache holds no RoPE key tail: the cached row's "
               "shared %d-wide tail is zero", dr);
        dg_say(detail, sizeof detail, "(the cache keeps the latent of kv_lora_rank %d alone)",
               R);
        dg_say(ev, sizeof ev, "the test's kv_latent row at position %lld holds the "
               "reference's latent (error %.2g) and a zero tail", (long long)d->pos, lat);
        found = 1;
    }
    if (found) {
        dg_set(c, CMP_DIAG_LATENT_CACHE, CMP_BASIS_RECOMPUTED, sum);
        dg_say(c->g->detail, sizeof c->g->detail, "%s", detail);
        dg_say(c->g->evidence, sizeof c->g->evidence, "%s", ev);
    }
out:
    free(a);
    free(b);
    return found;
}

int dg_rule_mla(cmp_ctx *c, dg_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if (config_mla(cfg) && d->layer >= 0 && d->stage == STAGE_KV_LATENT)
        return latent_row(c, e);
    if (!config_mla(cfg) || d->layer < 0 || !dg_is_attn_stage(d->stage) || !a->q_test)
        return 0;
    const double tol = fmax(c->attn_tol, c->row_tol);
    const int64_t p = d->pos, P = c->ref->prompt_length;
    int rc = 0;
    const cmp_hyp base = dg_hyp_config(d, a);
    const double e_cfg = err_of(c, a, &base, e, &rc);
    if (rc < 0)
        return -1;
    if (e_cfg <= tol)
        return 0;   /* the config's keys reproduce it: not the attention's inputs */

    char sum[320], detail[320] = "", ev[320];
    /* The tail rotated once more. */
    cmp_hyp h = base;
    h.tail_twice = true;
    double err = err_of(c, a, &h, e, &rc);
    if (rc == 0 && err <= tol) {
        dg_say(sum, sizeof sum, "the latent cache's RoPE key tail is rotated twice: attention "
               "reads every cached key with its shared %d-wide tail turned by its position "
               "once more", cfg->qk_rope_dim);
        dg_say(detail, sizeof detail, "(the tail is rotated when kv_a_proj_with_mqa's output is "
               "split and again when it is written to or read from the cache)");
        dg_say(ev, sizeof ev, "recomputing attention from %s with each key's tail rotated "
               "again by its own position reproduces its %s (error %.2g; the config's keys: "
               "%.2g)", rows_used(a), dg_recorded_attn(c), err, e_cfg);
        goto named;
    }
    /* The tail not cached: keys before the chunk the query is in read a
     * zero tail. The chunk's start is not recorded: each is tried. */
    h = base;
    h.tail_zero = true;
    int64_t best_lo = -1;
    double best = INFINITY;
    const int64_t step = p > TAIL_SCAN_MAX ? p / TAIL_SCAN_MAX + 1 : 1;
    for (int64_t lo = p; rc == 0 && lo >= 1; lo -= step) {
        h.tail_lo = lo;
        err = err_of(c, a, &h, e, &rc);
        if (err < best) {
            best = err;
            best_lo = lo;
        }
    }
    if (rc == 0 && best <= tol) {
        dg_say(sum, sizeof sum, "the latent cache holds no RoPE key tail: keys before position "
               "%lld are read with a zero tail (keys of the query's own chunk keep theirs)",
               (long long)best_lo);
        dg_say(detail, sizeof detail, "(the cache keeps the latent of kv_lora_rank %d alone; "
               "the shared rotated key of qk_rope_head_dim %d is dropped when a chunk ends)",
               cfg->kv_lora_rank, cfg->qk_rope_dim);
        dg_say(ev, sizeof ev, "recomputing attention from %s with the tails of keys 0..%lld "
               "zeroed reproduces its %s (error %.2g; the config's keys: %.2g)", rows_used(a),
               (long long)best_lo - 1, dg_recorded_attn(c), best, e_cfg);
        goto named;
    }
    /* q.k without YaRN's mscale_all_dim correction. */
    const double m2 = softmax_mscale2(cfg);
    if (rc == 0 && fabs(m2 - 1.0) > 1e-6) {
        h = base;
        h.scale_mul = 1.0 / m2;
        err = err_of(c, a, &h, e, &rc);
        if (rc == 0 && err <= tol) {
            const bool decode = P > 0 && p >= P;
            dg_say(sum, sizeof sum, "the softmax scale lacks YaRN's mscale_all_dim correction%s: "
                   "q.k times qk_head_dim^-1/2 alone instead of times m^2 = %.4g",
                   decode ? " in decode" : "", m2);
            dg_say(detail, sizeof detail, "(DeepSeek's attention multiplies its softmax scale "
                   "by (0.1 mscale_all_dim ln factor + 1)^2; %s)",
                   decode ? "the decode path, absorbed in most runtimes, computes its scale "
                            "apart from prefill's" : "the scale is computed without it");
            dg_say(ev, sizeof ev, "recomputing attention from %s with q.k scaled by 1/%.4g of "
                   "the config's reproduces its %s (error %.2g; the config's scale: %.2g)",
                   rows_used(a), m2, dg_recorded_attn(c), err, e_cfg);
            goto named;
        }
    }
    /* Decode reading an empty latent cache at every prompt position. */
    if (rc == 0 && P > 0 && p >= P) {
        h = base;
        h.zero_lo = 0;
        h.zero_hi = P;
        err = err_of(c, a, &h, e, &rc);
        if (rc == 0 && err <= tol) {
            dg_say(sum, sizeof sum, "decode reads the latent cache empty at every prompt "
                   "position: keys 0..%lld read as zero latents (K = V = 0), the decode "
                   "steps' own keys right", (long long)P - 1);
            dg_say(detail, sizeof detail, "(prefill ran the expanded form and never wrote the "
                   "latent cache that decode's absorbed form reads: the two forms mixed across "
                   "chunks)");
            dg_say(ev, sizeof ev, "recomputing attention from %s with keys 0..%lld zero "
                   "reproduces its %s (error %.2g; the config's keys: %.2g)", rows_used(a),
                   (long long)P - 1, dg_recorded_attn(c), err, e_cfg);
            goto named;
        }
    }
    return rc < 0 ? -1 : 0;
named:
    dg_set(c, CMP_DIAG_LATENT_CACHE, CMP_BASIS_RECOMPUTED, sum);
    dg_say(c->g->detail, sizeof c->g->detail, "%s", detail);
    dg_say(c->g->evidence, sizeof c->g->evidence, "%s", ev);
    return 1;
}
