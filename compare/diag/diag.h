/* diag.h — what the diagnosis's files share (docs/diagnosis.md, "The
 * hypothesis engine"): the evidence interface every family reads through,
 * the attention case at the point under diagnosis, and the text helpers.
 *
 * Layout: core.c (this interface) at the bottom; one file per family
 * over it — keysets.c (the key-set hypothesis engine and its families),
 * rows.c (rows written as zero, k and v swapped, a norm epsilon, attention
 * that read zeros), rope.c (rotations and scales), norms.c (norm
 * conventions), sharing.c (another layer's KV cache), sinks.c (attention
 * sinks left out), mla.c (latent caches) —; diagnose.c on top: the evidence at the point, drift,
 * and the driver that runs the families in order. */
#ifndef KV_DIAG_H
#define KV_DIAG_H

#include "../cmp_internal.h"

/* printf into buf (size n) / appended to what buf holds, truncating. */
void dg_say(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void dg_append(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The diagnosis's kind, basis and one-line summary. */
void dg_set(cmp_ctx *c, cmp_diag_kind k, cmp_basis b, const char *summary);
bool dg_is_attn_stage(kv_stage s);

/* A row of (layer, stage) at pos from src, malloc'd, or NULL (not
 * recorded, another width than the reference config's, or *rc = -1 on
 * error). */
float *dg_row(const cmp_ctx *c, const cmp_source *src, int layer, kv_stage st, int64_t pos,
              int *rc, kv_err *e);
/* The test's rows as recorded (cmp_ctx.test_rows), for the families that
 * compare rows rather than recompute attention. */
const cmp_source *dg_test_rows(const cmp_ctx *c);

/* The positions lo..hi of layer's attention rows the test holds (its
 * attn_out, else attn_lse, else its key counts): 0, or 1 when none. */
int dg_attn_held(const cmp_ctx *c, int layer, int64_t *lo, int64_t *hi);

/* Attention at the point (p, l) under diagnosis. */
typedef struct {
    float *q_ref, *q_test, *out_ref, *out_test;
    int64_t P, C, R;             /* prompt length, chunk (0 unknown), ring size (0 none) */
    int64_t ctx;                 /* the cache's positions (max_ctx; 0 unknown) */
    bool C_inferred;             /* no chunk in the settings: C is the divergence's */
    int64_t R_guess;             /* no cache kind in the settings: the ring size a ring
                                  * that stopped storing at p would have (0 none) */
    int W;                       /* the layer's window (0 global) */
    int64_t lo_ref;              /* first key the config's window allows */
    bool ref_rows_used;          /* the test lacked q or k/v: the reference's stood in */
} dg_case;

int dg_case_init(cmp_ctx *c, dg_case *a, kv_err *e);
void dg_case_free(dg_case *a);

/* A value as configs write it, 1, 2 or 5 times a power of ten (that of
 * the middle of lo..hi), the first within lo..hi; dflt when none is. */
double dg_config_value(double lo, double hi, double dflt);

/* The config's key set at the point. */
cmp_hyp dg_hyp_config(const cmp_divergence *d, const dg_case *a);

/* Error of h against the recorded attention at the point, from the
 * test's own q, k, v (the reference's when the test lacks them; on_ref:
 * the reference's against the reference). +inf when it cannot be
 * recomputed. 0, or -1 on error. */
int dg_hyp_err(cmp_ctx *c, dg_case *a, const cmp_hyp *h, bool on_ref, double *err, kv_err *e);

/* Error of h at (layer, q) against the test's own recorded attention
 * there, from the test's own q, k, v. A recorded key count other than
 * h's is a mismatch (*err = +inf; *test_n: the test's count, -1
 * unrecorded). 0 with *err set; 2 when only the key count could be
 * compared (counts_only, or q, k, v, attention not recorded there: *err
 * 0 when it is h's, else +inf); 1 when the test recorded nothing of it;
 * -1 on error. */
int dg_attn_err_at(cmp_ctx *c, int layer, int64_t q, const cmp_hyp *h, bool counts_only,
                   double *err, int64_t *test_n, kv_err *e);

/* "keys attended 12 in both", "keys attended 8 vs 1", never a -1. */
void dg_counts_phrase(const cmp_ctx *c, char *buf, size_t n);
/* The test's attention rows a recomputation is matched against. */
const char *dg_recorded_attn(const cmp_ctx *c);

/* The rows of (layer, stage) at p on both sides: 0 with both set, 1 when
 * either is missing, -1 on error. */
int dg_row_pair(cmp_ctx *c, int layer, kv_stage st, int64_t p, float **a, float **b,
                kv_err *e);

/* Each family's rule: 1 when it names the point (c->g filled), 0 when it
 * does not apply, -1 on error. In the order the driver (diagnose.c) tries
 * them after the row families: */
int dg_rule_rope(cmp_ctx *c, kv_err *e);              /* rope.c: another position */
int dg_rule_scaled(cmp_ctx *c, kv_err *e);            /* rope.c: q or k scaled as a whole */
/* rope.c: attention whose scores are scaled by another factor than the
 * config's (q, k, v right): the factor fitted, tried after the key sets */
int dg_rule_scores_scaled(cmp_ctx *c, kv_err *e);
int dg_rule_norm_convention(cmp_ctx *c, kv_err *e);   /* norms.c: w vs (1 + w) */
int dg_rule_qk_norm_missing(cmp_ctx *c, kv_err *e);   /* norms.c */
int dg_rule_zero_read(cmp_ctx *c, kv_err *e);         /* rows.c: attention read K = V = 0 */
int dg_rule_kv_owner(cmp_ctx *c, kv_err *e);          /* sharing.c: another layer's cache */
int dg_rule_sinks(cmp_ctx *c, kv_err *e);             /* sinks.c: a sink left out */
/* mla.c: an MLA latent cache's key tail, scale or mixed forms */
int dg_rule_mla(cmp_ctx *c, dg_case *a, kv_err *e);
int dg_rule_maps(cmp_ctx *c, kv_err *e);              /* maps.c: a row or channel scale, a bias */
/* maps.c: f32 stated, a coarser type seen: exact (the rows hold only its
 * values; tried first) or not (an error of its size at the first stage
 * that errs, no map explaining it; tried last) */
int dg_rule_stated_precision(cmp_ctx *c, kv_err *e, bool exact);
/* maps.c: /output's step is a map of the logits (softcap, scale): names it. */
bool dg_rule_logit_map(cmp_ctx *c);

/* The key-set families (keysets.c): a different set of keys read at the
 * point, named by scoring every candidate cause at every position and
 * layer where it predicts something its rivals do not. 1 when it names
 * the point, 0 to leave it to the rules after it, -1 on error. */
int dg_rule_keyset(cmp_ctx *c, dg_case *a, kv_err *e);

/* Which layers read otherwise than the config at position q: each layer's
 * attention recomputed from the test's own rows over the config's keys,
 * every key, each window the config has and n_found (KS: INT64_MAX none).
 * buf: "4 global, 5 window 12"; *n_other: how many. 0, -1 on error. */
int dg_layer_survey(cmp_ctx *c, int64_t q, int64_t n_found, char *buf, size_t n, int *n_other,
                    kv_err *e);

/* The row families (rows.c): K/V rows written as zero, k and v
 * projections swapped, an RMSNorm epsilon other than the config's. 1 when
 * one names the point, 0 otherwise, -1 on error. */
int dg_rule_rows(cmp_ctx *c, kv_err *e);

/* Whether recorded attention (either row may be NULL) is what a softmax
 * over no key leaves: NaN, or -inf and zeros. */
bool dg_attn_empty(const float *lse, const float *out, int H, int n);

#endif
