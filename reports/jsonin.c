/* jsonin.c — the JSON of `kvdiff compare --json` read back into a
 * cmp_result, so a saved result renders exactly as a fresh one. Outside
 * input: every key is checked for presence and type, and the first
 * problem is reported as one line naming the file and the key. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "report.h"
#include "../model/infile.h"

/* A saved result with every stage's figures: a few MB; far below this. */
#define REPORT_JSON_MAX_BYTES (1LL << 30)

/* No recording holds a position past this (the config caps a model's
 * positions far below it); a larger one is a damaged or forged file. */
#define JR_MAX_POS ((int64_t)INT32_MAX)

typedef struct {
    const char *path;
    kv_err *e;
    int failed;
} jr;

static int bad(jr *c, const char *where, const char *key, const char *what)
{
    if (!c->failed)
        kv_errf(c->e, "%s: %s%s%s %s", c->path, where, where[0] ? "." : "", key, what);
    c->failed = 1;
    return -1;
}

static json_t *need(jr *c, json_t *o, const char *where, const char *key)
{
    json_t *v = json_object_get(o, key);
    if (!v)
        bad(c, where, key, "is missing");
    return v;
}

/* Numbers: JSON numbers, or the strings "nan", "inf", "-inf" the writer
 * uses for those; null when allowed (a quantity not computed) is NaN. */
static double num(jr *c, json_t *o, const char *where, const char *key, bool nullable)
{
    json_t *v = need(c, o, where, key);
    if (!v)
        return NAN;
    if (json_is_number(v))
        return json_number_value(v);
    if (json_is_null(v) && nullable)
        return NAN;
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        if (!strcmp(s, "nan"))
            return NAN;
        if (!strcmp(s, "inf"))
            return INFINITY;
        if (!strcmp(s, "-inf"))
            return -INFINITY;
    }
    bad(c, where, key, "is not a number");
    return NAN;
}

static int64_t integer(jr *c, json_t *o, const char *where, const char *key, int64_t lo,
                       int64_t hi, int64_t if_null)
{
    json_t *v = need(c, o, where, key);
    if (!v)
        return 0;
    if (json_is_null(v) && if_null != INT64_MIN)
        return if_null;
    if (!json_is_integer(v)) {
        bad(c, where, key, "is not an integer");
        return 0;
    }
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        char msg[96];
        snprintf(msg, sizeof msg, "is out of range (%lld)", (long long)x);
        bad(c, where, key, msg);
        return 0;
    }
    return x;
}

static bool boolean(jr *c, json_t *o, const char *where, const char *key)
{
    json_t *v = need(c, o, where, key);
    if (v && !json_is_boolean(v))
        bad(c, where, key, "is not true or false");
    return v && json_is_true(v);
}

static const char *string(jr *c, json_t *o, const char *where, const char *key)
{
    json_t *v = need(c, o, where, key);
    if (v && !json_is_string(v)) {
        bad(c, where, key, "is not a string");
        return "";
    }
    return v ? json_string_value(v) : "";
}

static void copy(char *dst, size_t n, const char *src)
{
    snprintf(dst, n, "%s", src);
}

static json_t *object(jr *c, json_t *o, const char *where, const char *key, bool nullable)
{
    json_t *v = need(c, o, where, key);
    if (!v || (nullable && json_is_null(v)))
        return NULL;
    if (!json_is_object(v)) {
        bad(c, where, key, "is not an object");
        return NULL;
    }
    return v;
}

static kv_stage stage_of(jr *c, json_t *o, const char *where, const char *key)
{
    const char *s = string(c, o, where, key);
    int st = stage_parse(s);
    if (st < 0 && !c->failed)
        bad(c, where, key, "names no known stage");
    return st < 0 ? STAGE_X_IN : (kv_stage)st;
}

/* ------------------------------------------------------------------ */
/* Parts                                                                */

static void read_mode(jr *c, json_t *root, cmp_result *r)
{
    json_t *m = object(c, root, "", "mode", false);
    if (!m)
        return;
    r->exact = boolean(c, m, "mode", "exact");
    r->atol = num(c, m, "mode", "atol", false);
    r->rtol = num(c, m, "mode", "rtol", false);
    r->ulp = (uint64_t)integer(c, m, "mode", "ulp", 0, INT64_MAX, INT64_MIN);
    r->noise = boolean(c, m, "mode", "noise_floor");
    r->noise_factor = num(c, m, "mode", "noise_factor", false);
}

/* mode.cross_runtime.structure.logit_map (null: not fitted). */
static void read_logit_map(jr *c, json_t *s, cmp_xrt *o)
{
    const char *w = "mode.cross_runtime.structure.logit_map";
    json_t *m = c->failed ? NULL : object(c, s, "mode.cross_runtime.structure", "logit_map",
                                          true);
    if (!m)
        return;
    o->map_fitted = true;
    const char *k = string(c, m, w, "kind");
    o->map_kind = !k ? CMP_MAP_NONE : !strcmp(k, "softcap") ? CMP_MAP_SOFTCAP
                : !strcmp(k, "scale") ? CMP_MAP_SCALE : CMP_MAP_NONE;
    if (k && !c->failed && o->map_kind == CMP_MAP_NONE && strcmp(k, "none"))
        bad(c, w, "kind", "is not softcap, scale or none");
    o->map_param = num(c, m, w, "value", true);
    if (isnan(o->map_param))   /* null: a softcap of none */
        o->map_param = INFINITY;
    o->map_config_cap = num(c, m, w, "config_cap", false);
    o->map_gain = num(c, m, w, "gain", true);
    if (isnan(o->map_gain))
        o->map_gain = INFINITY;
    /* (absent in results older than the F test) */
    if (json_object_get(m, "positions")) {
        o->map_positions = integer(c, m, w, "positions", 0, JR_MAX_POS, INT64_MIN);
        o->map_F = num(c, m, w, "F", true);
        o->map_F_crit = num(c, m, w, "F_critical", true);
        if (isnan(o->map_F_crit))
            o->map_F_crit = INFINITY;
        o->map_significant = boolean(c, m, w, "significant");
    }
    o->map_step = boolean(c, m, w, "step");
    o->map_part = num(c, m, w, "part", true);
    o->map_noise = num(c, m, w, "noise", true);
    if (!c->failed && o->map_step != isfinite(o->map_part))
        bad(c, w, "part", "does not agree with step");
}

/* mode.cross_runtime.structure (absent in results older than it). */
static void read_structure(jr *c, json_t *x, cmp_xrt *o)
{
    o->sys_worst_pos = -1;
    o->sys_worst_layer = -1;
    json_t *s = c->failed || !json_object_get(x, "structure")
                    ? NULL : object(c, x, "mode.cross_runtime", "structure", true);
    if (!s)
        return;
    const char *w = "mode.cross_runtime.structure";
    o->sys_on = true;
    o->sys_noise_factor = num(c, s, w, "noise_factor", false);
    o->sys_compute_factor = num(c, s, w, "compute_factor", false);
    json_t *st = c->failed ? NULL : object(c, s, w, "step", true);
    if (st) {
        const char *ws = "mode.cross_runtime.structure.step";
        o->sys_step = true;
        o->sys_dev = num(c, st, ws, "scale", false) - 1;
        o->sys_noise = num(c, st, ws, "noise", false);
        o->sys_threshold = num(c, st, ws, "threshold", false);
        o->sys_drift_threshold = num(c, st, ws, "drift_threshold", false);
        if (!c->failed && !o->step)
            bad(c, w, "step", "is set without a step");
    }
    /* (absent in results older than the offset test) */
    json_t *of = c->failed || !json_object_get(s, "offset_step")
                     ? NULL : object(c, s, w, "offset_step", true);
    if (of) {
        const char *wo = "mode.cross_runtime.structure.offset_step";
        o->off_step = true;
        o->off_part = num(c, of, wo, "part", false);
        o->off_noise = num(c, of, wo, "noise", false);
        o->off_channels = (int)integer(c, of, wo, "channels", 0, INT32_MAX, INT64_MIN);
        o->sys_threshold = num(c, of, wo, "threshold", false);
        o->sys_drift_threshold = num(c, of, wo, "drift_threshold", false);
        if (!c->failed && (!o->step || o->sys_step))
            bad(c, w, "offset_step", "is set without a step, or beside a row-scale step");
    }
    /* (absent in results older than the rotation test) */
    json_t *ro = c->failed || !json_object_get(s, "rotation_step")
                     ? NULL : object(c, s, w, "rotation_step", true);
    if (ro) {
        const char *wr = "mode.cross_runtime.structure.rotation_step";
        o->rot_step = true;
        copy(o->rot_what, sizeof o->rot_what, string(c, ro, wr, "candidate"));
        o->rot_pos = integer(c, ro, wr, "position", 0, JR_MAX_POS, INT64_MIN);
        o->rot_stage = stage_of(c, ro, wr, "stage");
        o->rot_err = num(c, ro, wr, "error", false);
        o->rot_resid = num(c, ro, wr, "residual", false);
        o->rot_pos2 = integer(c, ro, wr, "last_position", 0, JR_MAX_POS, -1);
        o->rot_err2 = num(c, ro, wr, "error_at_last", true);
        o->rot_resid2 = num(c, ro, wr, "residual_at_last", true);
        o->rot_here_resid = num(c, ro, wr, "residual_at_step", true);
        o->rot_threshold = num(c, ro, wr, "threshold", false);
        o->rot_drift_threshold = num(c, ro, wr, "drift_threshold", false);
        if (!c->failed && (!o->step || o->sys_step || o->off_step))
            bad(c, w, "rotation_step", "is set without a step, or beside another structure step");
    }
    json_t *cl = c->failed ? NULL : object(c, s, w, "closest", true);
    if (cl) {
        const char *wc = "mode.cross_runtime.structure.closest";
        o->sys_worst_pos = integer(c, cl, wc, "position", 0, JR_MAX_POS, INT64_MIN);
        o->sys_worst_layer = (int)integer(c, cl, wc, "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
        o->sys_worst_stage = stage_of(c, cl, wc, "stage");
        o->sys_worst_ratio = num(c, cl, wc, "ratio", false);
    }
    read_logit_map(c, s, o);
}

/* mode.cross_runtime: which drift model judged and with what figures
 * (null, or absent in results older than the model, when none did). */
static void read_xrt(jr *c, json_t *root, cmp_result *r)
{
    json_t *m = json_object_get(root, "mode");
    json_t *x = m && json_object_get(m, "cross_runtime")
                    ? object(c, m, "mode", "cross_runtime", true) : NULL;
    if (!x)
        return;
    const char *w = "mode.cross_runtime";
    cmp_xrt *o = &r->xrt;
    o->on = true;
    copy(o->model, sizeof o->model, string(c, x, w, "model"));
    copy(o->why, sizeof o->why, string(c, x, w, "why"));
    /* The compute precision (absent in results older than it). */
    json_t *cp = c->failed || !json_object_get(x, "compute")
                     ? NULL : object(c, x, w, "compute", true);
    if (cp) {
        const char *wc = "mode.cross_runtime.compute";
        copy(o->compute_precision, sizeof o->compute_precision, string(c, cp, wc, "precision"));
        o->compute_eps = num(c, cp, wc, "eps", false);
        o->compute_factor = num(c, cp, wc, "factor", false);
        o->compute_stated = boolean(c, cp, wc, "stated");
        json_t *aw = c->failed ? NULL : need(c, cp, wc, "assumed_why");
        if (aw && !json_is_null(aw))
            copy(o->compute_assumed_why, sizeof o->compute_assumed_why,
                 string(c, cp, wc, "assumed_why"));
        if (!c->failed && o->compute_stated != (aw && json_is_null(aw)))
            bad(c, wc, "assumed_why", "does not agree with stated");
        if (!c->failed && !o->compute_precision[0])
            bad(c, wc, "precision", "is empty");
    }
    copy(o->kv_precision, sizeof o->kv_precision, string(c, x, w, "kv_precision"));
    o->kv_eps = num(c, x, w, "kv_eps", false);
    o->floor_base = num(c, x, w, "floor", false);
    o->kv_factor = num(c, x, w, "kv_factor", false);
    o->gain = num(c, x, w, "gain", false);
    o->history = num(c, x, w, "history", false);
    o->step = boolean(c, x, w, "step");
    o->step_err = num(c, x, w, "step_error", true);
    o->step_threshold = num(c, x, w, "step_threshold", true);
    if (!c->failed && o->step != (isfinite(o->step_err) && isfinite(o->step_threshold)))
        bad(c, w, "step_error", "does not agree with step");
    /* /output's drift (absent in results older than it; null: bit-identical) */
    const json_t *om = json_object_get(x, "output_max_rel");
    if (om && !json_is_null(om)) {
        o->output_drift = true;
        o->output_max_rel = num(c, x, w, "output_max_rel", false);
    }
    o->worst_pos = -1;
    o->worst_layer = -1;
    json_t *dc = c->failed ? NULL : object(c, x, w, "drift_closest", true);
    if (dc) {
        const char *wd = "mode.cross_runtime.drift_closest";
        o->worst_pos = integer(c, dc, wd, "position", 0, JR_MAX_POS, INT64_MIN);
        o->worst_layer = (int)integer(c, dc, wd, "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
        o->worst_stage = stage_of(c, dc, wd, "stage");
        o->worst_ratio = num(c, dc, wd, "ratio", false);
    }
    /* The f16 accumulation model (absent in results older than it). */
    o->acc_pos = -1;
    o->acc_layer = -1;
    json_t *fa = c->failed || !json_object_get(x, "f16_accumulation")
                     ? NULL : object(c, x, w, "f16_accumulation", true);
    if (fa) {
        const char *wf = "mode.cross_runtime.f16_accumulation";
        o->acc_on = true;
        o->acc_rows = integer(c, fa, wf, "rows", 0, INT64_MAX, INT64_MIN);
        o->acc_factor = num(c, fa, wf, "factor", false);
        o->acc_largest = num(c, fa, wf, "largest", false);
        json_t *at = c->failed ? NULL : object(c, fa, wf, "at", true);
        if (at) {
            const char *wt = "mode.cross_runtime.f16_accumulation.at";
            o->acc_pos = integer(c, at, wt, "position", 0, JR_MAX_POS, INT64_MIN);
            o->acc_layer = (int)integer(c, at, wt, "layer", 0, KV_MAX_LAYERS - 1, INT64_MIN);
        }
        if (!c->failed && (o->acc_pos >= 0) != (o->acc_rows > 0))
            bad(c, wf, "at", "does not agree with rows");
    }
    read_structure(c, x, o);
    /* The attention check (absent in results older than it). */
    o->audit_worst_pos = -1;
    o->audit_worst_layer = -1;
    json_t *ac = c->failed || !json_object_get(x, "attention_check")
                     ? NULL : object(c, x, w, "attention_check", true);
    if (!ac)
        return;
    const char *wa = "mode.cross_runtime.attention_check";
    const bool ran = boolean(c, ac, wa, "ran");
    json_t *sk = c->failed ? NULL : need(c, ac, wa, "skipped");
    if (sk && !json_is_null(sk))
        copy(o->audit_skip, sizeof o->audit_skip, string(c, ac, wa, "skipped"));
    o->audit_layers = (int)integer(c, ac, wa, "layers", 0, KV_MAX_LAYERS, INT64_MIN);
    o->audit_threshold = num(c, ac, wa, "threshold", false);
    /* (absent in results older than it: 0, the max-relative residual alone) */
    if (!c->failed && json_object_get(ac, "rms_weight"))
        o->audit_rms_weight = num(c, ac, wa, "rms_weight", false);
    o->audit_step = boolean(c, ac, wa, "step");
    o->audit_drift_threshold = num(c, ac, wa, "drift_threshold", true);
    if (!c->failed && o->audit_step != isfinite(o->audit_drift_threshold))
        bad(c, wa, "drift_threshold", "does not agree with step");
    if (!c->failed && ran != (!o->audit_skip[0] && o->audit_layers > 0))
        bad(c, wa, "ran", "does not agree with skipped and layers");
    if (!c->failed && o->audit_step && !o->step)
        bad(c, wa, "step", "is true without a step");
    json_t *cl = c->failed ? NULL : object(c, ac, wa, "closest", true);
    if (cl) {
        const char *wc = "mode.cross_runtime.attention_check.closest";
        o->audit_worst_pos = integer(c, cl, wc, "position", 0, JR_MAX_POS, INT64_MIN);
        o->audit_worst_layer = (int)integer(c, cl, wc, "layer", 0, KV_MAX_LAYERS - 1,
                                            INT64_MIN);
        o->audit_worst_residual = num(c, cl, wc, "residual", false);
        o->audit_worst = num(c, cl, wc, "ratio", false);
    }
}

/* mode.cross_runtime.stages: each stage's figures, onto the stage
 * results (added where the result has no per-stage table). */
static void read_xrt_stages(jr *c, json_t *root, cmp_result *r)
{
    json_t *x = json_object_get(json_object_get(root, "mode"), "cross_runtime");
    if (!r->xrt.on || !x)
        return;
    json_t *st = need(c, x, "mode.cross_runtime", "stages");
    if (st && !json_is_array(st))
        bad(c, "mode.cross_runtime", "stages", "is not an array");
    if (!st || c->failed)
        return;
    const size_t n = json_array_size(st);
    cmp_stage_result *grown = n ? realloc(r->stages, ((size_t)r->n_stages + n) * sizeof *grown)
                                : r->stages;
    if (n && !grown) {
        kv_errf(c->e, "%s: out of memory", c->path);
        c->failed = 1;
        return;
    }
    r->stages = grown;
    for (size_t i = 0; i < n && !c->failed; i++) {
        char w[64];
        snprintf(w, sizeof w, "mode.cross_runtime.stages[%zu]", i);
        json_t *s = json_array_get(st, i);
        if (!json_is_object(s)) {
            bad(c, "", w, "is not an object");
            return;
        }
        const int layer = (int)integer(c, s, w, "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
        const kv_stage stage = stage_of(c, s, w, "stage");
        cmp_stage_result *o = NULL;
        for (int k = 0; k < r->n_stages && !o; k++)
            if (r->stages[k].layer == layer && r->stages[k].stage == stage)
                o = &r->stages[k];
        if (!o) {
            o = &r->stages[r->n_stages++];
            memset(o, 0, sizeof *o);
            o->layer = layer;
            o->stage = stage;
        }
        o->xrt_scale = num(c, s, w, "scale", false);
        o->xrt_threshold = num(c, s, w, "threshold", false);
        o->xrt_err = num(c, s, w, "error", false);
        o->xrt_ratio = num(c, s, w, "ratio", false);
        /* the structure test's (absent in results older than it) */
        if (json_object_get(s, "systematic")) {
            o->xrt_sys = num(c, s, w, "systematic", false);
            o->xrt_sys_ratio = num(c, s, w, "systematic_ratio", false);
        }
    }
}

static void read_compared(jr *c, json_t *root, cmp_result *r)
{
    json_t *m = object(c, root, "", "compared", false);
    if (!m)
        return;
    cmp_coverage *cv = &r->compared;
    cv->n_layers = (int)integer(c, m, "compared", "layers", 0, KV_MAX_LAYERS, INT64_MIN);
    cv->pos_lo = integer(c, m, "compared", "position_lo", INT64_MIN + 1, INT64_MAX, INT64_MIN);
    cv->pos_hi = integer(c, m, "compared", "position_hi", INT64_MIN + 1, INT64_MAX, INT64_MIN);
    cv->n_stages = (int)integer(c, m, "compared", "stages", 0, 1 << 24, INT64_MIN);
    cv->rows = integer(c, m, "compared", "rows", 0, INT64_MAX, INT64_MIN);
    cv->partial = boolean(c, m, "compared", "partial");
    cv->hashed = boolean(c, m, "compared", "fingerprint");
    cv->pos_cut = integer(c, m, "compared", "token_cut", 0, INT64_MAX, -1);
    /* optional: results saved before routing was followed lack it */
    cv->routing_flip = json_object_get(m, "routing_flip")
                           ? integer(c, m, "compared", "routing_flip", 0, INT64_MAX, -1) : -1;
    cv->walked_to = integer(c, m, "compared", "walked_to", -1, INT64_MAX, INT64_MIN);
    /* optional: results saved before the row hash index existed lack it */
    json_t *bi = json_object_get(m, "by_index");
    if (bi && !json_is_boolean(bi))
        bad(c, "compared", "by_index", "is not true or false");
    cv->by_index = bi && json_is_true(bi);
    json_t *ms = need(c, m, "compared", "model_stages");
    if (ms && !json_is_array(ms))
        bad(c, "compared", "model_stages", "is not an array");
}

static void read_div(jr *c, json_t *d, const char *where, cmp_divergence *o)
{
    o->found = true;
    o->pos = integer(c, d, where, "position", 0, JR_MAX_POS, INT64_MIN);
    o->layer = (int)integer(c, d, where, "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
    o->stage = stage_of(c, d, where, "stage");
    o->hashed = boolean(c, d, where, "fingerprint");
    o->col = (int)integer(c, d, where, "column", -1, INT32_MAX, -1);
    o->head = (int)integer(c, d, where, "head", -1, INT32_MAX, -1);
    o->dim = (int)integer(c, d, where, "dim", -1, INT32_MAX, -1);
    o->ref = (float)num(c, d, where, "ref", false);
    o->test = (float)num(c, d, where, "test", false);
    o->abs_err = num(c, d, where, "abs", false);
    o->ulp = (uint64_t)integer(c, d, where, "ulp", 0, INT64_MAX, INT64_MIN);
    o->nonfinite = boolean(c, d, where, "nonfinite");
    o->n_bad = (int)integer(c, d, where, "bad_elements", 0, INT32_MAX, INT64_MIN);
    o->row_max_abs = num(c, d, where, "row_max_abs", false);
    o->row_rel = num(c, d, where, "row_rel", false);
    /* (absent unless the divergence was found in /output) */
    if (!c->failed && json_object_get(d, "from_output")) {
        o->from_output = boolean(c, d, where, "from_output");
        if (!c->failed && o->from_output && (o->layer != -1 || o->stage != STAGE_LOGITS))
            bad(c, where, "from_output", "is true off the model-level logits stage");
    }
    if (o->layer >= 0 && !c->failed) {
        const char *a = string(c, d, where, "attention");
        if (strcmp(a, "sliding") && strcmp(a, "global") && !c->failed)
            bad(c, where, "attention", "is neither \"sliding\" nor \"global\"");
        o->layer_sliding = !strcmp(a, "sliding");
        o->layer_window = (int)integer(c, d, where, "window", 0, INT32_MAX, INT64_MIN);
        o->kv_owner = (int)integer(c, d, where, "kv_owner", 0, KV_MAX_LAYERS - 1, INT64_MIN);
    }
}

static uint32_t stage_bits(jr *c, json_t *o, const char *where, const char *key)
{
    json_t *a = need(c, o, where, key);
    uint32_t bits = 0;
    if (!a)
        return 0;
    if (!json_is_array(a)) {
        bad(c, where, key, "is not an array");
        return 0;
    }
    size_t i;
    json_t *v;
    json_array_foreach(a, i, v) {
        int st = json_is_string(v) ? stage_parse(json_string_value(v)) : -1;
        if (st < 0 || st >= STAGE_LAYER_COUNT) {
            bad(c, where, key, "holds something that is not a layer stage name");
            return 0;
        }
        bits |= 1u << st;
    }
    return bits;
}

static float *floats(jr *c, json_t *o, const char *where, const char *key, int *n)
{
    json_t *a = need(c, o, where, key);
    if (!a || json_is_null(a))
        return NULL;
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > 4096) {
        bad(c, where, key, "is not an array of 1 to 4096 numbers");
        return NULL;
    }
    if (*n && (size_t)*n != json_array_size(a)) {
        bad(c, where, key, "has another length than attn_lse_ref");
        return NULL;
    }
    *n = (int)json_array_size(a);
    float *x = malloc((size_t)*n * sizeof *x);
    if (!x) {
        kv_errf(c->e, "%s: out of memory", c->path);
        c->failed = 1;
        return NULL;
    }
    for (int i = 0; i < *n && !c->failed; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        const char *t = json_is_string(v) ? json_string_value(v) : "";
        if (json_is_number(v))
            x[i] = (float)json_number_value(v);
        else if (!strcmp(t, "nan") || !strcmp(t, "inf") || !strcmp(t, "-inf"))
            x[i] = !strcmp(t, "nan") ? NAN : t[0] == '-' ? -INFINITY : INFINITY;
        else
            bad(c, where, key, "holds something that is not a number");
    }
    if (c->failed) {
        free(x);
        return NULL;
    }
    return x;
}

static void read_evidence(jr *c, json_t *v, const char *where, cmp_evidence *ev)
{
    ev->earlier_compared = stage_bits(c, v, where, "earlier_compared");
    ev->earlier_identical = stage_bits(c, v, where, "earlier_identical");
    json_t *q = need(c, v, where, "qkv_identical_upto_position");
    if (q && !json_is_null(q) && !json_is_boolean(q))
        bad(c, where, "qkv_identical_upto_position", "is not true, false or null");
    ev->qkv = !q || json_is_null(q) ? -1 : json_is_true(q) ? 1 : 0;
    ev->qkv_from = integer(c, v, where, "qkv_from", INT64_MIN + 1, INT64_MAX, INT64_MIN);
    ev->qkv_to = integer(c, v, where, "qkv_to", INT64_MIN + 1, INT64_MAX, INT64_MIN);
    int n = 0;
    ev->lse_ref = floats(c, v, where, "attn_lse_ref", &n);
    ev->lse_test = floats(c, v, where, "attn_lse_test", &n);
    ev->n_heads = n;
    ev->nkeys_ref = (int)integer(c, v, where, "nkeys_ref", -1, INT32_MAX, -1);
    ev->nkeys_test = (int)integer(c, v, where, "nkeys_test", -1, INT32_MAX, -1);
    ev->norms_equal = boolean(c, v, where, "norms_equal");
    json_t *rd = need(c, v, where, "rope_delta");
    ev->rope_found = rd && json_is_integer(rd);
    if (rd && !json_is_null(rd) && !json_is_integer(rd))
        bad(c, where, "rope_delta", "is not an integer or null");
    ev->rope_delta = ev->rope_found ? json_integer_value(rd) : 0;
    ev->rope_err = num(c, v, where, "rope_error", true);
    json_t *rc = need(c, v, where, "recomputed");
    if (rc && !json_is_null(rc) && !json_is_boolean(rc))
        bad(c, where, "recomputed", "is not true, false or null");
    ev->recompute = !rc || json_is_null(rc) ? -1 : json_is_true(rc) ? 1 : 0;
    json_t *h = need(c, v, where, "hypothesis");
    if (h && !json_is_null(h) && !json_is_string(h))
        bad(c, where, "hypothesis", "is not a string or null");
    copy(ev->hypothesis, sizeof ev->hypothesis, json_is_string(h) ? json_string_value(h) : "");
    ev->hyp_err = num(c, v, where, "hypothesis_error", true);
    ev->ref_check_err = num(c, v, where, "reference_check_error", true);
    json_t *nd = object(c, v, where, "nkeys_differ_at", true);
    ev->nkeys_diff_pos = nd ? integer(c, nd, "nkeys_differ_at", "position", 0, JR_MAX_POS,
                                      INT64_MIN) : -1;
    ev->nkeys_diff_layer = nd ? (int)integer(c, nd, "nkeys_differ_at", "layer", -1,
                                             KV_MAX_LAYERS, INT64_MIN) : 0;
    ev->growth_first = num(c, v, where, "growth_first", true);
    ev->growth_last = num(c, v, where, "growth_last", true);
    ev->growth_layer_last = (int)integer(c, v, where, "growth_last_layer", -1, KV_MAX_LAYERS,
                                         INT64_MIN);
}

static int enum_of(const char *s, const char *(*name)(int), int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(s, name(i)))
            return i;
    return -1;
}

static const char *diag_name(int k) { return cmp_diag_name((cmp_diag_kind)k); }
static const char *basis_name(int b) { return cmp_basis_name((cmp_basis)b); }
static const char *verdict_name(int v) { return cmp_verdict_name((cmp_verdict)v); }

static void read_diag(jr *c, json_t *root, cmp_result *r)
{
    json_t *d = object(c, root, "", "diagnosis", true);
    if (!d)
        return;
    cmp_diagnosis *g = &r->diag;
    int k = enum_of(string(c, d, "diagnosis", "kind"), diag_name, CMP_DIAG_COUNT);
    int b = enum_of(string(c, d, "diagnosis", "basis"), basis_name, CMP_BASIS_HEURISTIC + 1);
    if ((k < 0 || b < 0) && !c->failed)
        bad(c, "diagnosis", k < 0 ? "kind" : "basis", "is not a known name");
    g->kind = k < 0 ? CMP_DIAG_NONE : (cmp_diag_kind)k;
    g->basis = b < 0 ? CMP_BASIS_NONE : (cmp_basis)b;
    copy(g->summary, sizeof g->summary, string(c, d, "diagnosis", "summary"));
    copy(g->detail, sizeof g->detail, string(c, d, "diagnosis", "detail"));
    copy(g->evidence, sizeof g->evidence, string(c, d, "diagnosis", "evidence"));
    /* "undecided" and "hypotheses" are optional (results saved before them
     * have none). */
    if (json_object_get(d, "undecided"))
        g->undecided = boolean(c, d, "diagnosis", "undecided");
    json_t *hs = json_object_get(d, "hypotheses");
    if (hs && !json_is_array(hs))
        bad(c, "diagnosis", "hypotheses", "is not a list");
    static const char *const status[] = {"verified", "remains", "refuted"};
    for (size_t i = 0; json_is_array(hs) && i < json_array_size(hs) && i < CMP_MAX_HYPS; i++) {
        json_t *h = json_array_get(hs, i);
        cmp_hyp_score *o = &g->hyps[g->n_hyps];
        if (!json_is_object(h)) {
            bad(c, "diagnosis", "hypotheses", "holds a non-object");
            break;
        }
        const char *st = string(c, h, "diagnosis.hypotheses", "status");
        int sk = -1;
        for (int s = 0; s < 3; s++)
            if (!strcmp(st, status[s]))
                sk = s;
        int hk = enum_of(string(c, h, "diagnosis.hypotheses", "kind"), diag_name, CMP_DIAG_COUNT);
        if ((sk < 0 || hk < 0) && !c->failed)
            bad(c, "diagnosis.hypotheses", sk < 0 ? "status" : "kind", "is not a known name");
        o->kind = hk < 0 ? CMP_DIAG_NONE : (cmp_diag_kind)hk;
        o->status = sk < 0 ? CMP_HYP_REFUTED : (cmp_hyp_status)sk;
        copy(o->keys, sizeof o->keys, string(c, h, "diagnosis.hypotheses", "keys"));
        o->err = num(c, h, "diagnosis.hypotheses", "error_at_first", true);
        o->places = (int)integer(c, h, "diagnosis.hypotheses", "places", 0, INT32_MAX, 0);
        o->refuted_pos = -1;
        o->refuted_layer = -1;
        o->refuted_err = NAN;
        json_t *at = json_object_get(h, "refuted_at");
        if (at && o->status == CMP_HYP_REFUTED && json_is_object(at)) {
            o->refuted_pos = integer(c, at, "diagnosis.hypotheses.refuted_at", "position", -1,
                                     INT64_MAX, INT64_MIN);
            o->refuted_layer = (int)integer(c, at, "diagnosis.hypotheses.refuted_at", "layer", -1,
                                            INT32_MAX, INT64_MIN);
            o->refuted_err = num(c, at, "diagnosis.hypotheses.refuted_at", "error", true);
        }
        g->n_hyps++;
    }
}

/* "contradicts_own_topk" is optional (results saved before it have none). */
static void read_self(jr *c, json_t *t, cmp_tokens *o)
{
    static const char *const side[2] = {"reference", "test"};
    json_t *s = json_object_get(t, "contradicts_own_topk");
    o->self_pos[0] = o->self_pos[1] = -1;
    if (!s)
        return;
    if (!json_is_object(s)) {
        bad(c, "tokens", "contradicts_own_topk", "is not an object");
        return;
    }
    for (int i = 0; i < 2; i++) {
        json_t *x = json_object_get(s, side[i]);
        if (!x || json_is_null(x))
            continue;
        if (!json_is_object(x)) {
            bad(c, "tokens.contradicts_own_topk", side[i], "is not an object or null");
            return;
        }
        o->self_pos[i] = integer(c, x, "tokens.contradicts_own_topk", "position", 0,
                                 JR_MAX_POS, INT64_MIN);
        o->self_token[i] = (int32_t)integer(c, x, "tokens.contradicts_own_topk", "token", 0,
                                            INT32_MAX, INT64_MIN);
        o->self_top1[i] = (int32_t)integer(c, x, "tokens.contradicts_own_topk", "top1", 0,
                                           INT32_MAX, INT64_MIN);
    }
}

static void read_tokens(jr *c, json_t *root, cmp_result *r)
{
    static const char *const kinds[] = {"none", "identical", "differ", "length_differs"};
    json_t *t = object(c, root, "", "tokens", false);
    if (!t)
        return;
    cmp_tokens *o = &r->tokens;
    const char *v = string(c, t, "tokens", "verdict");
    int k = -1;
    for (int i = 0; i < 4; i++)
        if (!strcmp(v, kinds[i]))
            k = i;
    if (k < 0 && !c->failed)
        bad(c, "tokens", "verdict", "is not a known name");
    o->kind = k < 0 ? CMP_TOKENS_NONE : (cmp_tokens_kind)k;
    o->n_ref = integer(c, t, "tokens", "n_ref", 0, JR_MAX_POS, INT64_MIN);
    o->n_test = integer(c, t, "tokens", "n_test", 0, JR_MAX_POS, INT64_MIN);
    o->prompt_length = integer(c, t, "tokens", "prompt_length", 0, JR_MAX_POS, INT64_MIN);
    o->pos = integer(c, t, "tokens", "position", 0, JR_MAX_POS, -1);
    o->step = integer(c, t, "tokens", "step", -JR_MAX_POS, JR_MAX_POS, 0);
    o->ref_id = (int32_t)integer(c, t, "tokens", "ref_id", 0, INT32_MAX, 0);
    o->test_id = (int32_t)integer(c, t, "tokens", "test_id", 0, INT32_MAX, 0);
    o->ref_margin = num(c, t, "tokens", "ref_margin", true);
    o->test_margin = num(c, t, "tokens", "test_margin", true);
    o->near_tie = boolean(c, t, "tokens", "near_tie");
    /* absent in results older than the flip rule */
    o->logit_err = json_object_get(t, "logit_error") ? num(c, t, "tokens", "logit_error", true)
                                                     : NAN;
    const json_t *fd = json_object_get(t, "flip_drift");
    if (fd && !json_is_boolean(fd))
        bad(c, "tokens", "flip_drift", "is not true or false");
    o->flip_drift = json_is_true(fd);
    /* written only when true (run --compare stopped the test) */
    const json_t *stopped = json_object_get(t, "test_stopped");
    if (stopped && !json_is_boolean(stopped))
        bad(c, "tokens", "test_stopped", "is not true or false");
    o->test_stopped = json_is_true(stopped);
    read_self(c, t, o);
}

static void read_logits(jr *c, json_t *root, cmp_result *r)
{
    json_t *l = object(c, root, "", "logits", true);
    if (!l)
        return;
    cmp_logit_stats *o = &r->logits;
    o->present = true;
    o->from_topk = boolean(c, l, "logits", "from_topk");
    o->positions = integer(c, l, "logits", "positions", 0, INT64_MAX, INT64_MIN);
    o->top1_agree = integer(c, l, "logits", "top1_agree", 0, INT64_MAX, INT64_MIN);
    o->kl_mean = num(c, l, "logits", "kl_mean", false);
    o->kl_max = num(c, l, "logits", "kl_max", false);
    o->kl_max_pos = integer(c, l, "logits", "kl_max_position", -1, JR_MAX_POS,
                            INT64_MIN);
}

static void read_notes(jr *c, json_t *root, cmp_result *r)
{
    json_t *n = need(c, root, "", "notes");
    if (!n)
        return;
    if (!json_is_array(n)) {
        bad(c, "", "notes", "is not an array");
        return;
    }
    size_t i;
    json_t *v;
    json_array_foreach(n, i, v) {
        if (!json_is_string(v)) {
            bad(c, "", "notes", "holds something that is not a string");
            return;
        }
        if (r->n_notes < CMP_MAX_NOTES)
            copy(r->notes[r->n_notes++], sizeof r->notes[0], json_string_value(v));
    }
}

/* "incomplete" is optional: results saved before it existed are whole. */
static void read_incomplete(jr *c, json_t *root, cmp_result *r)
{
    if (!json_object_get(root, "incomplete"))
        return;
    r->incomplete = boolean(c, root, "", "incomplete");
    json_t *why = json_object_get(root, "incomplete_why");
    if (r->incomplete && !json_is_string(why))
        bad(c, "", "incomplete_why", "is not a string although incomplete is true");
    else if (r->incomplete)
        copy(r->incomplete_why, sizeof r->incomplete_why, json_string_value(why));
}

/* "swapped" is optional (results saved before it have none): a string,
 * or null when the roles were as they should be. */
static void read_swapped(jr *c, json_t *root, cmp_result *r)
{
    json_t *why = json_object_get(root, "swapped");
    if (why && !json_is_null(why) && !json_is_string(why))
        bad(c, "", "swapped", "is neither a string nor null");
    else if (json_is_string(why))
        copy(r->swapped, sizeof r->swapped, json_string_value(why));
}

/* "config_differs" is optional (results saved before it have none): a
 * string, or null when the configs agree on what attention reads. */
static void read_config_differs(jr *c, json_t *root, cmp_result *r)
{
    json_t *why = json_object_get(root, "config_differs");
    if (why && !json_is_null(why) && !json_is_string(why))
        bad(c, "", "config_differs", "is neither a string nor null");
    else if (json_is_string(why))
        copy(r->config_diff, sizeof r->config_diff, json_string_value(why));
}

/* "hash_check" is optional (results saved before it have none). */
static void read_hash_check(jr *c, json_t *root, cmp_result *r)
{
    json_t *h = json_object_get(root, "hash_check");
    if (!h)
        return;
    if (!json_is_object(h)) {
        bad(c, "", "hash_check", "is not an object");
        return;
    }
    cmp_hash_check *o = &r->hashcheck;
    o->rows_checked = integer(c, h, "hash_check", "rows_checked", 0, INT64_MAX, INT64_MIN);
    json_t *st = object(c, h, "hash_check", "stale", true);
    if (!st)
        return;
    o->stale = true;
    copy(o->file, sizeof o->file, string(c, st, "hash_check.stale", "file"));
    o->layer = (int)integer(c, st, "hash_check.stale", "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
    o->stage = stage_of(c, st, "hash_check.stale", "stage");
    o->pos = integer(c, st, "hash_check.stale", "position", 0, JR_MAX_POS, INT64_MIN);
}

/* The JSON gives cosine and NMSE, not the sums behind them: these sums
 * give back the same two numbers through cmp_stats_cosine / _nmse. */
static void read_stats(jr *c, json_t *s, const char *where, cmp_stats *o)
{
    o->rows = integer(c, s, where, "rows", 0, INT64_MAX, INT64_MIN);
    o->bitequal_rows = integer(c, s, where, "bitequal_rows", 0, INT64_MAX, INT64_MIN);
    o->violating_rows = integer(c, s, where, "violating_rows", 0, INT64_MAX, INT64_MIN);
    o->nonfinite = integer(c, s, where, "nonfinite", 0, INT64_MAX, INT64_MIN);
    o->max_abs = num(c, s, where, "max_abs", false);
    o->max_rel = num(c, s, where, "max_rel", false);
    o->max_ulp = (uint64_t)integer(c, s, where, "max_ulp", 0, INT64_MAX, INT64_MIN);
    const double cosv = num(c, s, where, "cosine", false);
    const double nmse = num(c, s, where, "nmse", false);
    o->ref_sq = o->test_sq = 1;
    o->dot = cosv;
    o->err_sq = nmse;
    o->first_bitdiff_pos = integer(c, s, where, "first_bitdiff_position", -1, JR_MAX_POS,
                                   INT64_MIN);
}

static void read_stage(jr *c, json_t *s, int i, cmp_stage_result *o)
{
    char where[48];
    snprintf(where, sizeof where, "stages[%d]", i);
    if (!json_is_object(s)) {
        bad(c, "", where, "is not an object");
        return;
    }
    o->layer = (int)integer(c, s, where, "layer", -1, KV_MAX_LAYERS - 1, INT64_MIN);
    o->stage = stage_of(c, s, where, "stage");
    o->cols = (int)integer(c, s, where, "cols", 0, INT32_MAX, INT64_MIN);
    o->pos_lo = integer(c, s, where, "position_lo", 0, JR_MAX_POS, INT64_MIN);
    o->pos_hi = integer(c, s, where, "position_hi", -1, JR_MAX_POS, INT64_MIN);
    o->hashed = boolean(c, s, where, "fingerprint");
    o->rows_by_hash = integer(c, s, where, "rows_by_hash", 0, INT64_MAX, INT64_MIN);
    o->noise_floor = num(c, s, where, "noise_floor", false);
    o->atol_eff = num(c, s, where, "atol", false);
    /* Written since the floor became row-relative; absent from older
     * results, which applied no relative tolerance per stage. */
    if (json_object_get(s, "rtol"))
        o->rtol_eff = num(c, s, where, "rtol", false);
    json_t *nrel = json_object_get(s, "noise_rel");
    o->noise_held = nrel && !json_is_null(nrel);
    if (o->noise_held) {
        o->noise_rel = num(c, s, where, "noise_rel", false);
        o->noise_abs = num(c, s, where, "noise_abs", true);
    }
    char w2[64];
    json_t *u = object(c, s, where, "upto", false);
    snprintf(w2, sizeof w2, "%s.upto", where);
    if (u)
        read_stats(c, u, w2, &o->upto);
    json_t *a = object(c, s, where, "all", false);
    snprintf(w2, sizeof w2, "%s.all", where);
    if (a)
        read_stats(c, a, w2, &o->all);
    if (!c->failed && (o->layer < 0) != (o->stage >= STAGE_LAYER_COUNT))
        bad(c, where, "stage", "does not match its layer");
}

/* The per-stage table when present; else only the model-level stages the
 * coverage names (so the text's coverage line reads as compare's). */
static void read_stages(jr *c, json_t *root, report_json *j)
{
    cmp_result *r = &j->r;
    json_t *st = json_object_get(root, "stages");
    json_t *ms = json_object_get(json_object_get(root, "compared"), "model_stages");
    if (st && !json_is_array(st)) {
        bad(c, "", "stages", "is not an array");
        return;
    }
    j->has_stages = st != NULL;
    size_t n = st ? json_array_size(st) : json_array_size(ms);
    if (n == 0)
        return;
    r->stages = calloc(n, sizeof *r->stages);
    if (!r->stages) {
        kv_errf(c->e, "%s: out of memory", c->path);
        c->failed = 1;
        return;
    }
    for (size_t i = 0; i < n && !c->failed; i++) {
        cmp_stage_result *o = &r->stages[r->n_stages++];
        if (st) {
            read_stage(c, json_array_get(st, i), (int)i, o);
            continue;
        }
        json_t *v = json_array_get(ms, i);
        int s = json_is_string(v) ? stage_parse(json_string_value(v)) : -1;
        if (s < STAGE_LAYER_COUNT)
            bad(c, "compared", "model_stages", "holds something that is not a model stage");
        o->layer = -1;
        o->stage = s < 0 ? STAGE_EMBED : (kv_stage)s;
    }
}

static char *dup_path(jr *c, json_t *in, const char *key)
{
    json_t *v = json_object_get(in, key);
    if (!v || json_is_null(v))
        return NULL;
    if (!json_is_string(v)) {
        bad(c, "inputs", key, "is not a string");
        return NULL;
    }
    return strdup(json_string_value(v));
}

/* ------------------------------------------------------------------ */

int report_json_load(const char *path, report_json *j, kv_err *e)
{
    memset(j, 0, sizeof *j);
    json_error_t jerr;
    /* Through infile: a regular file of bounded size, opened without
     * blocking (a FIFO hung report for ever). */
    char *text = NULL;
    size_t len = 0;
    if (infile_read_all(path, REPORT_JSON_MAX_BYTES, &text, &len, e) < 0) {
        const size_t n = strlen(path);
        char why[sizeof e->msg];
        snprintf(why, sizeof why, "%s", !strncmp(e->msg, path, n) && e->msg[n] == ':'
                                            ? e->msg + n + 2 : e->msg);
        const char *cut = strstr(why, "cannot open: ");
        return kv_errf(e, "%s: cannot read it (%s)", path, cut ? cut + 13 : why);
    }
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root)
        return kv_errf(e, "%s: not JSON (line %d: %s)", path, jerr.line, jerr.text);
    jr c = {path, e, 0};
    if (!json_is_object(root))
        bad(&c, "", "(top level)", "is not an object");
    /* Results saved before the schema member existed have none. */
    json_t *schema = c.failed ? NULL : json_object_get(root, "schema");
    if (schema && (!json_is_string(schema) ||
                   strcmp(json_string_value(schema), CMP_JSON_SCHEMA) != 0))
        bad(&c, "", "schema", "is not \"" CMP_JSON_SCHEMA "\", the one this kvdiff reads");
    cmp_result *r = &j->r;
    int v = c.failed ? -1 : enum_of(string(&c, root, "", "verdict"), verdict_name,
                                    CMP_DIVERGED + 1);
    if (v < 0 && !c.failed)
        bad(&c, "", "verdict", "is not identical, within_tolerance or diverged");
    r->verdict = v < 0 ? CMP_IDENTICAL : (cmp_verdict)v;
    if (!c.failed) {
        read_mode(&c, root, r);
        read_xrt(&c, root, r);
        read_compared(&c, root, r);
    }
    json_t *fd = c.failed ? NULL : object(&c, root, "", "first_divergence", true);
    if (fd)
        read_div(&c, fd, "first_divergence", &r->first);
    json_t *ev = c.failed ? NULL : object(&c, root, "", "evidence", true);
    if (ev)
        read_evidence(&c, ev, "evidence", &r->ev);
    json_t *bd = c.failed ? NULL : object(&c, root, "", "beyond_drift", true);
    if (bd) {
        read_div(&c, bd, "beyond_drift", &r->beyond);
        json_t *bev = object(&c, bd, "beyond_drift", "evidence", true);
        if (bev)
            read_evidence(&c, bev, "beyond_drift.evidence", &r->beyond_ev);
    }
    if (!c.failed)
        read_diag(&c, root, r);
    if (!c.failed)
        read_tokens(&c, root, r);
    if (!c.failed)
        read_logits(&c, root, r);
    if (!c.failed)
        read_notes(&c, root, r);
    if (!c.failed)
        read_incomplete(&c, root, r);
    if (!c.failed)
        read_swapped(&c, root, r);
    if (!c.failed)
        read_config_differs(&c, root, r);
    if (!c.failed)
        read_hash_check(&c, root, r);
    if (!c.failed)
        read_stages(&c, root, j);
    if (!c.failed)
        read_xrt_stages(&c, root, r);
    /* exit_code restates the verdict (compare's exit status); one that
     * disagrees, or is none compare gives, marks a file not to trust. */
    if (!c.failed && json_object_get(root, "exit_code")) {
        int64_t x = integer(&c, root, "", "exit_code", 0, 2, INT64_MIN);
        if (!c.failed && x != cmp_exit_code(0, r)) {
            char msg[96];
            snprintf(msg, sizeof msg, "is %lld, but the verdict and incompleteness give %d",
                     (long long)x, cmp_exit_code(0, r));
            bad(&c, "", "exit_code", msg);
        }
    }
    /* "inputs" is optional: results saved before it existed have none */
    json_t *in = c.failed || !json_object_get(root, "inputs")
        ? NULL : object(&c, root, "", "inputs", true);
    if (in) {
        j->ref_path = dup_path(&c, in, "ref");
        j->test_path = dup_path(&c, in, "test");
    }
    json_decref(root);
    if (c.failed) {
        report_json_free(j);
        return -1;
    }
    return 0;
}

void report_json_free(report_json *j)
{
    if (!j)
        return;
    cmp_result_free(&j->r);
    free(j->ref_path);
    free(j->test_path);
    memset(j, 0, sizeof *j);
}
