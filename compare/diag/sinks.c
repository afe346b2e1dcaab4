/* sinks.c — attention sinks (gpt-oss) left out of a softmax: dropped on
 * every layer or one, kept in prefill and lost in decode, or masked like
 * the key at position 0 so that a sliding layer loses its sink once the
 * window has moved past 0.
 *
 * The sinks' logits are the reference's, recovered from its attn_lse and
 * attn_sink (compare.c). At the point, the test's attention is recomputed
 * from its own q, k, v over the config's keys twice, with the sink and
 * without it; when only the second reproduces the test, every layer's
 * recorded rows are sorted the same way (sampled evenly), and the
 * positions that lost their sink name the cause: all of them, the
 * decode steps only, the sliding layers from their window on, or one
 * layer. */
#include <math.h>
#include <stdlib.h>

#include "diag.h"

#define SINK_CHECK_MAX 48   /* positions of each layer sorted, at most */

enum { READS_SINK = 1, READS_NO_SINK = 0, READS_NEITHER = -2, READS_UNRECORDED = -3 };

/* How the test's attention at (layer, p) reads the sink, under tol; the
 * errors of both recomputations into err_with / err_without (may be NULL).
 * -1 on error. */
static int sink_state(cmp_ctx *c, int layer, int64_t p, double tol, double *err_with,
                      double *err_without, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, layer);
    const int W = config_layer_window(cfg, layer);
    int rc = 0;
    float *q = dg_row(c, c->test, layer, STAGE_Q, p, &rc, e);
    float *out = dg_row(c, c->test, layer, STAGE_ATTN_OUT, p, &rc, e);
    float *lse = dg_row(c, c->test, layer, STAGE_ATTN_LSE, p, &rc, e);
    double *l = malloc((size_t)H * sizeof *l), *o = malloc((size_t)H * D * sizeof *o);
    int state = READS_UNRECORDED;
    if (rc == 0 && (!l || !o))
        rc = kv_errf(e, "compare: out of memory");
    if (rc == 0 && q && out) {
        cmp_hyp h = {.lo = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0, .hi = p};
        cmp_source bare = *c->test;
        bare.sink_logits = NULL;
        double ew = INFINITY, eo = INFINITY;
        int r1 = cmp_recompute_attention(c->test, cfg, layer, q, &h, l, o, e);
        if (r1 == 0)
            ew = cmp_attention_err(cfg, layer, l, o, lse, out, c->rms_weight);
        int r2 = r1 < 0 ? r1 : cmp_recompute_attention(&bare, cfg, layer, q, &h, l, o, e);
        if (r2 == 0)
            eo = cmp_attention_err(cfg, layer, l, o, lse, out, c->rms_weight);
        if (r1 < 0 || r2 < 0)
            rc = -1;
        else if (r1 == 0 && r2 == 0)
            state = ew <= tol ? READS_SINK : eo <= tol ? READS_NO_SINK : READS_NEITHER;
        if (err_with)
            *err_with = ew;
        if (err_without)
            *err_without = eo;
    }
    free(q);
    free(out);
    free(lse);
    free(l);
    free(o);
    return rc < 0 ? -1 : state;
}

/* What the rows of every layer show, sorted by where a sink was lost. */
typedef struct {
    int with[KV_MAX_LAYERS], without[KV_MAX_LAYERS];
    int lost_prefill, lost_decode, kept_prefill, kept_decode;
    int lost_in_window, lost_past_window, kept_past_window; /* sliding layers only */
    int kept_global;             /* rows of full layers that kept it */
    int neither;                 /* rows reproduced neither way */
} sink_survey;

/* Sorts the row of layer l at p into s. 0, -1 on error. */
static int visit(cmp_ctx *c, int l, int64_t p, double tol, sink_survey *s, kv_err *e)
{
    const int64_t P = c->ref->prompt_length;
    const int W = config_layer_window(c->cfg, l);
    const int st = sink_state(c, l, p, tol, NULL, NULL, e);
    if (st == -1)
        return -1;
    if (st == READS_UNRECORDED)
        return 0;
    if (st == READS_NEITHER) {
        s->neither++;
        return 0;
    }
    const bool kept = st == READS_SINK, decode = P > 0 && p >= P;
    (kept ? s->with : s->without)[l]++;
    if (decode)
        *(kept ? &s->kept_decode : &s->lost_decode) += 1;
    else
        *(kept ? &s->kept_prefill : &s->lost_prefill) += 1;
    if (W > 0 && p >= W)
        *(kept ? &s->kept_past_window : &s->lost_past_window) += 1;
    else if (W > 0 && !kept)
        s->lost_in_window++;
    if (W == 0 && kept)
        s->kept_global++;
    return 0;
}

/* Every layer's recorded rows, sampled evenly, and always the last
 * prefill row and the first decode step (where a prefill-only sink is
 * lost) and the window's edges (where a masked one is). */
static int survey(cmp_ctx *c, double tol, sink_survey *s, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int64_t P = c->ref->prompt_length;
    for (int l = 0; l < cfg->n_layers; l++) {
        int64_t lo, hi;
        if (dg_attn_held(c, l, &lo, &hi))
            continue;
        if (c->pos_limit >= 0 && hi >= c->pos_limit)
            hi = c->pos_limit - 1;
        const int64_t W = config_layer_window(cfg, l);
        const int64_t n = hi - lo + 1, step = n > SINK_CHECK_MAX ? n / SINK_CHECK_MAX + 1 : 1;
        for (int64_t p = lo; p <= hi; p += step)
            if (visit(c, l, p, tol, s, e) < 0)
                return -1;
        const int64_t extra[4] = {P - 1, P, W - 1, W};
        for (int i = 0; i < 4; i++) {
            const int64_t p = extra[i];
            if ((i >= 2 && W == 0) || p < lo || p > hi || (p - lo) % step == 0)
                continue;
            if (visit(c, l, p, tol, s, e) < 0)
                return -1;
        }
    }
    return 0;
}

int dg_rule_sinks(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if (!cfg->attn_sinks || d->layer < 0 || !dg_is_attn_stage(d->stage) || !c->test->sink_logits)
        return 0;
    const double tol = fmax(c->attn_tol, c->row_tol);
    double ew, eo;
    int st = sink_state(c, d->layer, d->pos, tol, &ew, &eo, e);
    if (st != READS_NO_SINK)
        return st < 0 && st != READS_NEITHER && st != READS_UNRECORDED ? -1 : 0;
    sink_survey s = {0};
    if (survey(c, tol, &s, e) < 0)
        return -1;
    int layers_lost = 0, only = -1;
    for (int l = 0; l < cfg->n_layers; l++) {
        if (s.without[l] > 0) {
            layers_lost++;
            only = l;
        }
    }
    const int lost = s.lost_prefill + s.lost_decode;
    const int kept = s.kept_prefill + s.kept_decode;
    char sum[256];
    const char *detail = "";
    if (kept == 0) {
        dg_say(sum, sizeof sum, "the attention sinks are left out of the softmax: every "
               "attention reads its keys alone (the sink logit dropped)");
        detail = "(a port that never adds the sink's logit to the denominator, or loads no "
                 "self_attn.sinks / attn_sinks)";
    } else if (s.lost_prefill == 0 && s.lost_decode > 0 && s.kept_decode == 0) {
        dg_say(sum, sizeof sum, "the attention sinks are applied in prefill only: every decode "
               "step leaves the sink out of its softmax");
        detail = "(the decode path's attention, a kernel of its own in most runtimes, does not "
                 "take the sinks)";
    } else if (s.lost_in_window == 0 && s.lost_past_window == lost && s.kept_past_window == 0 &&
               layers_lost > 0 && s.kept_global > 0) {
        dg_say(sum, sizeof sum, "the attention sink is masked like the key at position 0: "
               "sliding layers lose it once their window has passed position 0 (full layers "
               "keep it)");
        detail = "(the sink is a logit of its own, never a key: it belongs to every softmax "
                 "whatever the window; applying the window mask after appending it as a key "
                 "column at position 0 leaves this)";
    } else if (layers_lost == 1 && s.with[only] == 0) {
        dg_say(sum, sizeof sum, "the attention sink is left out of the softmax on layer %d "
               "only (the other layers apply theirs)", only);
        detail = "(one layer's sinks not loaded or not passed to its attention)";
    } else {
        dg_say(sum, sizeof sum, "the attention sink is left out of the softmax at some rows: "
               "%d of the %d rows sorted lost it", lost, lost + kept);
    }
    dg_set(c, CMP_DIAG_SINK, CMP_BASIS_RECOMPUTED, sum);
    dg_say(c->g->detail, sizeof c->g->detail, "%s", detail);
    dg_say(c->g->evidence, sizeof c->g->evidence, "recomputing attention from the test's q, k, v "
           "over the config's keys without the sink reproduces its %s (error %.2g; with the "
           "reference's sink logits, recovered from its attn_lse and attn_sink: %.2g); over "
           "every layer, %d recorded rows read no sink and %d read it (%d prefill and %d decode "
           "rows lost it; %d reproduced neither way)", dg_recorded_attn(c), eo, ew, lost, kept,
           s.lost_prefill, s.lost_decode, s.neither);
    return 1;
}
