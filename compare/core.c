/* core.c — the bottom of compare/: the names of verdicts, diagnoses and
 * bases, the rows and engine settings of a source, notes and the result's
 * lifetime. Everything above it (the walks in compare.c and crossrt.c,
 * the diagnosis in diag/, tokens.c) reads sources through these; nothing
 * here calls up. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cmp_internal.h"

/* ------------------------------------------------------------------ */
/* Names and small helpers                                              */

const char *cmp_verdict_name(cmp_verdict v)
{
    static const char *const names[] = {"identical", "within_tolerance", "diverged"};
    return (v >= 0 && v <= CMP_DIVERGED) ? names[v] : "?";
}

int64_t cmp_diag_span(const kv_config *cfg)
{
    int64_t w = 0;
    for (int l = 0; l < cfg->n_layers; l++)
        w = config_layer_window(cfg, l) > w ? config_layer_window(cfg, l) : w;
    return 2 * w + 8 > CMP_DIAG_LOOKAHEAD ? 2 * w + 8 : CMP_DIAG_LOOKAHEAD;
}

const char *cmp_diag_name(cmp_diag_kind k)
{
    static const char *const names[CMP_DIAG_COUNT] = {
        [CMP_DIAG_NONE] = "none",
        [CMP_DIAG_ZERO_KV] = "zero_kv",
        [CMP_DIAG_ROPE_OFFSET] = "rope_offset",
        [CMP_DIAG_WINDOW] = "window",
        [CMP_DIAG_CHUNK_ISOLATED] = "chunk_isolated",
        [CMP_DIAG_EXTRA_KEY] = "extra_key",
        [CMP_DIAG_DECODE_STUCK] = "decode_index_stuck",
        [CMP_DIAG_RING_NO_WRAP] = "ring_no_wrap",
        [CMP_DIAG_STALE_CACHE] = "stale_cache",
        [CMP_DIAG_KEY_SET] = "key_set",
        [CMP_DIAG_NUMERIC_DRIFT] = "numeric_drift",
        [CMP_DIAG_NONFINITE] = "nonfinite",
        [CMP_DIAG_UNCLASSIFIED] = "unclassified",
        [CMP_DIAG_DECODE_BLIND] = "split_decode_blind",
        [CMP_DIAG_ROPE_CONVENTION] = "rope_convention",
        [CMP_DIAG_ATTN_SCALE] = "attn_scale",
        [CMP_DIAG_NORM_CONVENTION] = "norm_convention",
        [CMP_DIAG_MISSING_KEY] = "missing_key",
        [CMP_DIAG_DUP_KEY] = "duplicate_key",
        [CMP_DIAG_QK_NORM_MISSING] = "qk_norm_missing",
        [CMP_DIAG_LAYER_TYPE] = "layer_type",
        [CMP_DIAG_OWN_KEY_MASKED] = "own_key_masked",
        [CMP_DIAG_PADDED_SLOTS] = "padded_slots",
        [CMP_DIAG_KV_SWAPPED] = "kv_swapped",
        [CMP_DIAG_NORM_EPS] = "norm_eps",
        [CMP_DIAG_FUTURE_KEYS] = "future_keys",
        [CMP_DIAG_KV_OWNER] = "kv_owner",
        [CMP_DIAG_ROW_SCALE] = "row_scale",
        [CMP_DIAG_CHANNEL_SCALE] = "channel_scale",
        [CMP_DIAG_BIAS] = "bias",
        [CMP_DIAG_LOGIT_MAP] = "logit_map",
        [CMP_DIAG_STATED_PRECISION] = "stated_precision",
        [CMP_DIAG_ROWS_SHIFTED] = "rows_shifted",
        [CMP_DIAG_SINK] = "attention_sink",
        [CMP_DIAG_LATENT_CACHE] = "latent_cache",
    };
    return (k >= 0 && k < CMP_DIAG_COUNT) ? names[k] : "?";
}

const char *cmp_basis_name(cmp_basis b)
{
    static const char *const names[] = {"none", "recomputed", "exact_check", "heuristic"};
    return (b >= 0 && b <= CMP_BASIS_HEURISTIC) ? names[b] : "?";
}

int cmp_exit_code(int rc, const cmp_result *r)
{
    if (rc < 0 || !r)
        return 2;
    if (r->verdict == CMP_DIVERGED)
        return 1;
    return r->incomplete ? 2 : 0;
}

void cmp_note(cmp_result *r, const char *fmt, ...)
{
    if (r->n_notes >= CMP_MAX_NOTES)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->notes[r->n_notes++], sizeof r->notes[0], fmt, ap);
    va_end(ap);
}

int cmp_stage_cols(const kv_config *c, int layer, kv_stage st)
{
    const int E = c->hidden, H = c->n_heads, KV = config_layer_kv_heads(c, layer);
    const int D = config_layer_head_dim(c, layer);
    switch (st) {
    case STAGE_PLE_IN:
        return c->per_layer_dim;
    case STAGE_PLE_OUT:
        return c->per_layer_dim > 0 ? E : 0;
    case STAGE_ATTN_NORM_STATS:
    case STAGE_FFN_NORM_STATS:
        return 3;
    case STAGE_Q:
        return H * D;
    case STAGE_ATTN_OUT:
        return H * config_layer_v_head_dim(c, layer);
    case STAGE_K:
    case STAGE_V:
        return (layer >= 0 && layer < KV_MAX_LAYERS && c->kv_owner[layer] != layer) ? 0
               : KV * (st == STAGE_K ? D : config_layer_v_head_dim(c, layer));
    case STAGE_KV_LATENT:
        return config_mla_row(c);
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
        return H;
    case STAGE_ATTN_SINK:
        return c->attn_sinks ? H : 0;
    case STAGE_ROUTER_LOGITS:
        return config_layer_moe(c, layer) ? c->n_experts : 0;
    case STAGE_LOGITS:
        return c->vocab;
    default:
        return E;
    }
}

/* Is pos recorded, with rows of exactly `cols` floats? */
static bool src_has(const cmp_source *s, int layer, kv_stage st, int64_t pos, int cols)
{
    int64_t first = 0, rows = 0;
    int c = 0;
    if (s->info(s->ctx, layer, st, &first, &rows, &c) != 0 || rows <= 0 || c != cols)
        return false;
    return pos >= first && pos < first + rows;
}

int cmp_read_row(const cmp_source *s, int layer, kv_stage st, int64_t pos, int cols, float *out,
                 kv_err *e)
{
    if (!s->read || !src_has(s, layer, st, pos, cols))
        return 1;
    return s->read(s->ctx, layer, st, pos, 1, out, e) < 0 ? -1 : 0;
}

int cmp_source_held(const cmp_source *src, int layer, kv_stage st, int cols, int64_t *lo,
                    int64_t *hi)
{
    int64_t first, rows;
    int w;
    if (src->info(src->ctx, layer, st, &first, &rows, &w) != 0 || rows <= 0 || w != cols)
        return 1;
    *lo = first;
    *hi = first + rows - 1;
    return 0;
}

void cmp_set_element(cmp_divergence *d, const kv_config *c, int col)
{
    const int D = config_layer_head_dim(c, d->layer), Dv = config_layer_v_head_dim(c, d->layer);
    d->col = col;
    d->head = d->dim = -1;
    switch (d->stage) {
    case STAGE_Q:
    case STAGE_K:
        d->head = col / D;
        d->dim = col % D;
        break;
    case STAGE_ATTN_OUT:
    case STAGE_V:
        d->head = col / Dv;
        d->dim = col % Dv;
        break;
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
    case STAGE_ATTN_SINK:
        d->head = col;
        break;
    default:
        break;
    }
}

static json_t *settings_of(const cmp_source *s)
{
    if (!s->settings_json)
        return NULL;
    json_t *j = json_loads(s->settings_json, 0, NULL);
    if (j && !json_is_object(j)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

long cmp_settings_int(const cmp_source *s, const char *key, long dflt)
{
    json_t *j = settings_of(s);
    json_t *v = j ? json_object_get(j, key) : NULL;
    long out = json_is_integer(v) ? (long)json_integer_value(v) : dflt;
    json_decref(j);
    return out;
}

bool cmp_settings_str(const cmp_source *s, const char *key, char *buf, size_t n)
{
    json_t *j = settings_of(s);
    json_t *v = j ? json_object_get(j, key) : NULL;
    bool out = json_is_string(v) && strlen(json_string_value(v)) < n;
    if (out)
        memcpy(buf, json_string_value(v), strlen(json_string_value(v)) + 1);
    json_decref(j);
    return out;
}

bool cmp_settings_is(const cmp_source *s, const char *key, const char *value)
{
    json_t *j = settings_of(s);
    json_t *v = j ? json_object_get(j, key) : NULL;
    bool out = json_is_string(v) && strcmp(json_string_value(v), value) == 0;
    json_decref(j);
    return out;
}

/* ------------------------------------------------------------------ */
/* Result lifetime                                                      */

void cmp_result_free(cmp_result *r)
{
    if (!r)
        return;
    free(r->stages);
    free(r->ev.lse_ref);
    free(r->ev.lse_test);
    free(r->beyond_ev.lse_ref);
    free(r->beyond_ev.lse_test);
    memset(r, 0, sizeof *r);
}

const cmp_stage_result *cmp_result_stage(const cmp_result *r, int layer, kv_stage st)
{
    for (int i = 0; i < r->n_stages; i++)
        if (r->stages[i].layer == layer && r->stages[i].stage == st)
            return &r->stages[i];
    return NULL;
}

