/* config_json.h — config.json reading and writing helpers, shared by
 * config.c and the architecture files (model/families/). Internal to the
 * model layer: nothing outside model/ includes it.
 *
 * Every reader takes a cfg_jctx naming the file and the scope ("" or
 * "text_config.") so that a message says "<file>: <scope><key> <problem>";
 * every one returns 0 or fills the context's error and returns -1. */
#ifndef KV_CONFIG_JSON_H
#define KV_CONFIG_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>

#include "config.h"

/* Limits shared by the families (config.c has the rest). */
#define CFG_MAX_FACTOR 1e6
#define CFG_MAX_SCALAR 1e9

typedef struct {
    const char *file;
    const char *scope;
    kv_err *e;
} cfg_jctx;

int cj_fail(const cfg_jctx *cx, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Shortest text that reads back as exactly v. */
void cj_fmt_double(char *buf, size_t n, double v);
/* A short description of a JSON value for messages. */
const char *cj_desc(const json_t *v, char *buf, size_t n);
/* "path.key" into buf. */
const char *cj_subkey(char *buf, size_t n, const char *path, const char *key);
/* Present and not null. */
bool cj_present(const json_t *v);
int cj_want_int(const cfg_jctx *cx, const char *key, const json_t *v, long long lo,
                long long hi, int *out);
/* Absent: def unless required. null is an error. */
int cj_get_int(const cfg_jctx *cx, const json_t *obj, const char *key, bool required,
               int def, long long lo, long long hi, int *out);
/* A number in (lo, hi] (lo_open) or [lo, hi]. */
int cj_want_num(const cfg_jctx *cx, const char *key, const json_t *v, double lo,
                bool lo_open, double hi, double *out);
int cj_get_num(const cfg_jctx *cx, const json_t *obj, const char *key, double def,
               double lo, bool lo_open, double hi, double *out);
int cj_get_bool(const cfg_jctx *cx, const json_t *obj, const char *key, bool def, bool *out);
/* Absent: def (NULL def: required). */
int cj_get_str(const cfg_jctx *cx, const json_t *obj, const char *key, const char *def,
               const char **out);
/* Refuses a feature switch that is true, saying why. */
int cj_refuse_true(const cfg_jctx *cx, const json_t *obj, const char *key, const char *why);
/* A rope_scaling object (linear, llama3, yarn) or null. */
int cj_parse_scaling(const cfg_jctx *cx, const char *path, const json_t *v,
                     bool type_required, kv_rope_scaling *s);
/* "sliding_attention" / "full_attention". */
const char *cj_type_name(int t);
/* Layer i slides iff (i + 1) % pattern != 0. */
void cfg_layers_from_pattern(kv_config *c, int pattern);
/* YaRN as a preset states it: factor, original positions, betas 32 and 1,
 * truncate, and transformers' default cos/sin factor 0.1 ln factor + 1
 * (a family with its own, DeepSeek's, sets it after). */
void cfg_yarn(kv_config *c, double factor, int original_max, bool truncate);

/* A member-by-member JSON object writer: two-space indent, one member a line. */
typedef struct {
    FILE *f;
    int n;
} cfg_writer;

void cw_key(cfg_writer *w, const char *key);
void cw_num(cfg_writer *w, const char *key, double v);
void cw_int(cfg_writer *w, const char *key, long long v);
void cw_raw(cfg_writer *w, const char *key, const char *text);
void cw_str(cfg_writer *w, const char *key, const char *s);
void cw_bool(cfg_writer *w, const char *key, bool b);
/* sliding_window (null when no layer slides) and layer_types. */
void cw_window(cfg_writer *w, const kv_config *c);
void cw_layer_types(cfg_writer *w, const kv_config *c);
/* Gemma's softcaps of a model without attention biases. */
void cw_softcaps_unbiased(cfg_writer *w, const kv_config *c);

#endif
