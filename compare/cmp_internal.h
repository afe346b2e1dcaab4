/* cmp_internal.h — what the files of compare/ share and nobody else sees:
 * the element rule, per-row records, the walk context, and the entry
 * points of the diagnosis, recomputation and token modules. */
#ifndef KV_CMP_INTERNAL_H
#define KV_CMP_INTERNAL_H

#include <math.h>

#include "compare.h"
#include "../model/pool.h"

/* Thresholds, named once (docs/diagnosis.md quotes them). */
#define CMP_DRIFT_REL 1e-4      /* row-relative error below which a first divergence is "tiny" */
#define CMP_DRIFT_BOUND 1e-3    /* row-relative error drift is not expected to pass */
#define CMP_MATCH_TOL 1e-4      /* recomputation / rotation error that counts as reproducing */
#define CMP_NORM_TOL 1e-5       /* relative per-head L2 norm difference for "rotation-like" */
#define CMP_ROW_BUDGET (1 << 20)/* floats per read buffer: caps rows of wide stages (logits) */

/* The element rule of one (layer, stage) (compare.h, cmp_opts). */
typedef struct {
    bool exact;
    double atol, rtol;
    uint64_t ulp;
} cmp_tol;

/* What one row comparison found. */
typedef struct {
    bool bitequal, bad;
    int first_bad;               /* lowest violating column, -1 none */
    int n_bad;
    int nonfinite;
    double max_abs, ref_absmax;
    uint64_t max_ulp;
    double dot, ref_sq, test_sq, err_sq;
} cmp_rowrec;

/* ref_rowmax: the largest finite |ref| of the row (rtol's scale). */
bool cmp_elem_ok(float test, float ref, double ref_rowmax, const cmp_tol *t);
bool cmp_elem_nonfinite_mismatch(float test, float ref);
void cmp_row_compare(const float *test, const float *ref, int n, const cmp_tol *t,
                     cmp_rowrec *rec);
void cmp_row_hashed(bool equal, cmp_rowrec *rec);
/* Rows are weighed with AVX2 where the CPU has it (the same bits as the
 * scalar loop). on = false forces the scalar loop; returns whether AVX2 is
 * now in use. For tests. */
bool cmp_rows_use_simd(bool on);
double cmp_rowrec_rel(const cmp_rowrec *rec);
/* max |a - b| / max |b| over n values (non-finite pairs give +inf). */
double cmp_row_rel_err(const float *a, const float *b, int n);
void cmp_stats_init(cmp_stats *s);
void cmp_stats_add(cmp_stats *s, const cmp_rowrec *rec, int64_t pos);

/* --- core.c: the bottom of compare/, which calls nothing above it --- */

/* Floats per row the config implies for (layer, stage); 0 when the stage
 * does not exist there (k, v of KV-shared layers). */
int cmp_stage_cols(const kv_config *c, int layer, kv_stage st);

/* Reads the row of (layer, stage) at pos into out (cols floats). Returns
 * 0, 1 when not recorded there (or with another width, or no full rows),
 * -1 on error. */
int cmp_read_row(const cmp_source *s, int layer, kv_stage st, int64_t pos, int cols, float *out,
                 kv_err *e);

/* The rows of (layer, st) that src holds at width cols: 0 with *lo, *hi
 * (inclusive) set, or 1 when it holds none at that width. */
int cmp_source_held(const cmp_source *src, int layer, kv_stage st, int cols, int64_t *lo,
                    int64_t *hi);

/* Column, head and dim of d's element col, by its stage's layout. */
void cmp_set_element(cmp_divergence *d, const kv_config *c, int col);

/* Settings of a source: an integer / string key of its settings JSON. */
long cmp_settings_int(const cmp_source *s, const char *key, long dflt);
bool cmp_settings_is(const cmp_source *s, const char *key, const char *value);
/* Do the recordings say they were given the wrong way round (the run
 * under test first, its reference second)? why (n bytes) then says how
 * they show it (roles.c). */
bool cmp_roles_swapped(const cmp_source *ref, const cmp_source *test, char *why, size_t n);

/* The string under key copied into buf (n bytes); false when it is
 * absent, not a string or longer than n - 1. */
bool cmp_settings_str(const cmp_source *s, const char *key, char *buf, size_t n);

/* --- hashcheck.c --- */

/* Reads again a sample of the rows the walk of r let hashes settle (a
 * fixed fraction of every such stage, plus every row near the first
 * divergence and the one beyond drift) on each side with rows and hashes,
 * and hashes them; every such row where they hold whole_limit floats a
 * side or fewer (0: the default; -1: a sample always). Fills r->hashcheck
 * (rows_checked; stale and where at the first row whose hash is not its
 * own). 0, or -1 with e filled. */
int cmp_hash_audit(const cmp_source *ref, const cmp_source *test, cmp_result *r,
                   int64_t whole_limit, kv_err *e);

/* Adds a note to the result (silently dropped past CMP_MAX_NOTES). */
void cmp_note(cmp_result *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Everything the post-walk modules need. */
typedef struct {
    const cmp_source *ref, *test;
    /* The test's rows as recorded. While the diagnosis reads the test
     * through its precision model (attn_checked: q, k, v rounded as the
     * runtime's cache holds them, for recomputing its attention), the row
     * families compare rows with these: a runtime's q and its k, v before
     * the cache are what it computed, and rounding them again would add
     * the cache's rounding (0.4 % of a q8_0 block) to every fit. NULL:
     * test. */
    const cmp_source *test_rows;
    const cmp_opts *o;
    const kv_config *cfg;        /* the reference's */
    cmp_result *r;
    int64_t pos_limit;           /* positions >= this are not compared (token cut) */
    /* The point under diagnosis (diagnose.c): the first divergence, or the
     * first difference beyond drift, with its evidence and diagnosis. */
    const cmp_divergence *d;
    cmp_evidence *ev;
    cmp_diagnosis *g;
    bool beyond;                 /* after drift: its size alone says nothing */
    /* What counts as reproducing the test (diagnose.c sets them): between
     * our engines CMP_MATCH_TOL and CMP_NORM_TOL; against another runtime
     * (xrt.on) its drift, since its rows are never ours to the bit.
     * attn_tol: attention recomputed from the test's own q, k, v against
     * its attn_out (only its attention kernel's rounding: the drift
     * model's floor there); row_tol: a reference row transformed (rotated
     * under another RoPE convention) against the test's (the step's
     * threshold, drift upstream included). */
    double attn_tol, row_tol;
    bool attn_checked;           /* attn_tol is the attention check's threshold, the
                                  * test read through its precision model */
    double rms_weight;           /* cmp_attention_err's, as the attention check's */
    kern_pool *pool;             /* the walker's threads, idle after the walk (NULL: none) */
} cmp_ctx;

/* --- structure.c: errors judged by their structure --- */

#define CMP_FIT_MIN_COLS 16   /* narrower rows (per-head statistics) are not fitted */

/* One row's error split by a row scale: test = (1 + dev) * ref + residual. */
typedef struct {
    bool fitted;                 /* finite, wide enough, ref not all zero */
    double dev;                  /* a - 1: the scale's part, row-relative */
    double noise;                /* RMS(residual) / RMS(ref) */
    bool groups_agree;           /* four interleaved column groups each see the
                                  * scale (within half of dev): no single large
                                  * element's rounding passes for one */
} cmp_scalefit;

void cmp_row_scale_fit(const float *test, const float *ref, int n, cmp_scalefit *f);

/* Per channel over W rows (positions) of n columns: test = s_j ref + o_j,
 * and how the offsets o_j stand against the residual (a bias missing or
 * another; a scale alone, a weight rounded, leaves o_j near 0). */
#define CMP_OFFSET_MIN_ROWS 8
typedef struct {
    bool fitted;
    double part;                 /* RMS of o_j over RMS(ref): the offset's share */
    double noise;                /* RMS of the residual's sd over RMS(ref) */
    int channels;                /* channels fitted (a near-constant reference left out) */
    int significant;             /* channels whose o_j is 8 standard errors or more */
} cmp_offsetfit;

void cmp_channel_offset_fit(const float *test, const float *ref, int W, int n,
                            cmp_offsetfit *f);

/* A map of the reference's logits onto the test's (/output's top-k). */
typedef struct {
    cmp_map_kind kind;
    double param;                /* the softcap (+inf: none) or the scale */
    double config_cap;           /* the reference's cap (0 none), undone first */
    double ssr, ssr_identity;    /* squared residual under the map / under none */
    size_t pairs;
} cmp_logitmap;

double cmp_logit_map(const cmp_logitmap *m, double ref_value);
/* The map among the candidates (a softcap, a scale) leaving the least
 * residual over the n pairs (ref[i], test[i]); kind NONE when none beats
 * the identity. */
void cmp_logit_map_fit(const double *ref, const double *test, size_t n, double config_cap,
                       cmp_logitmap *best);
/* F(1, d)'s critical value at 1 - CMP_MAP_ALPHA (+inf for d < 1). */
#define CMP_MAP_ALPHA 1e-4
#define CMP_MAP_MIN_GAIN 1.2   /* and the map must leave 1/1.2 of the RMS residual or less
                                * (explain 30% of its square): no legitimate run of the
                                * sweep came above 1.13 at 9 positions, nor 1.01 at 107 */
double cmp_map_f_critical(int64_t d);

/* --- attn_audit.c --- */
/* The test's attention against its own q, k, v: for every layer whose q,
 * attn_out and KV owner's k, v the test records, attention over the
 * config's key set recomputed from them and compared with its attn_out,
 * over the positions the compare reaches. *pos, *stage_i: the first
 * (position, index of (layer, attn_out) in r->stages) in walk order whose
 * residual (*err) is above r->xrt.audit_threshold; -1 none. Fills
 * r->xrt.audit_*. 0, or -1 with e filled. */
int cmp_xrt_audit(cmp_ctx *c, int64_t *pos, int *stage_i, double *err, kv_err *e);
/* The test source as the attention check sees it: q, k and v read back
 * rounded as the runtime holds them (its cache type, llama.cpp's
 * rotations), everything else as it is; for diagnosing the check's own
 * step. *out is the source; the returned handle is freed with free().
 * NULL when out of memory. */
void *cmp_xrt_modelled_source(const cmp_source *test, const cmp_xrt *x, cmp_source *out);
/* --- f16acc.c --- */
/* Whether the test is llama.cpp summing attention values in f16 (flash
 * attention, values held as f16). */
bool cmp_xrt_f16acc_applies(const cmp_source *test, const cmp_xrt *m);
/* For every (layer, attn_out) row the test sums in f16, the row-relative
 * gap between that summation and an exact one over the recorded q, k, v,
 * into gap[(stage index) * P + position - base] (rows left alone keep
 * theirs). Fills r->xrt.acc_rows, acc_largest, acc_pos, acc_layer. 0, or
 * -1 with e filled. */
int cmp_xrt_f16acc(cmp_ctx *c, int64_t base, int64_t P, float *gap, kv_err *e);
/* Evidence and diagnosis at r->first (diagnose.c). */
int cmp_diagnose(cmp_ctx *c, kv_err *e);

/* Tokens verdict and margins (tokens.c). */
int cmp_tokens_compare(cmp_ctx *c, kv_err *e);
/* KL / top-1 over the compared positions (tokens.c). */
int cmp_logit_stats_compute(cmp_ctx *c, kv_err *e);

/* Between kvdiff's own engines, /output (each position's log-sum-exp and
 * top-k ids and values) must be bit-identical like every stage: the first
 * position where it is not, before any divergence the walk found, becomes
 * the first divergence (model level, stage logits, from_output). A final
 * norm or LM head bug that keeps every recorded stage and the argmax
 * would pass otherwise. Returns 0 or -1 (read error). */
int cmp_output_exact(cmp_ctx *c, kv_err *e);

/* Across runtimes /output is the walk's last step at each position
 * (crossrt.c): err[p - base] (P entries) is its largest difference, each
 * token's value matched by id across the two top-k lists (and the log-sum-
 * exp), over the reference's largest magnitude there; NaN where either
 * side holds none. cmp_output_step makes position p's /output the first
 * divergence, as cmp_output_exact does. Both 0, or -1 with e filled. */
int cmp_output_errors(cmp_ctx *c, int64_t base, int64_t P, double *err, kv_err *e);
int cmp_output_step(cmp_ctx *c, int64_t p, kv_err *e);
/* /output as a map of the reference's logits (structure.c's candidates),
 * fitted once over the first positions both hold from base: per position
 * (P of them) the map's part and the residual it leaves, row-relative as
 * cmp_output_errors' (NaN where not fitted). Fills r->xrt.map_*. */
int cmp_output_map(cmp_ctx *c, int64_t base, int64_t P, double *part, double *noise, kv_err *e);
/* Top-1 minus top-2 logit of src at pos, NaN when unknown (tokens.c). */
double cmp_logit_margin(const cmp_source *src, int64_t pos, kv_err *e, int *rc);

/* --- recompute.c --- */

/* A candidate key set for attention at one query position: reference
 * positions lo..hi, where positions in [zero_lo, zero_hi) read K = V = 0
 * (or, when older > 0, the key at position - older: a ring slot's earlier
 * occupant, zero when that is before 0), up to two substitutions (the key
 * at position from[i] read from position to[i], or zero when to[i] < 0)
 * and extra_zero more keys with K = V = 0. all_zero: every key K = V = 0. */
typedef struct {
    int64_t lo, hi;
    int64_t zero_lo, zero_hi;
    int64_t older;
    int nsubst;
    int64_t from[2], to[2];
    int extra_zero;
    bool all_zero;
    bool skip_one, dup_one;      /* the key at skip_pos not read; the one at dup_pos read twice */
    int64_t skip_pos, dup_pos;
    /* MLA (latent caches): each key's shared rotated tail (the last
     * qk_rope_dim of every head) rotated once more by its own position
     * (tail_twice), or zero for keys before tail_lo (tail_zero); q.k
     * times scale_mul times the config's scale (0: 1). */
    bool tail_twice, tail_zero;
    int64_t tail_lo;
    double scale_mul;
    cmp_diag_kind kind;          /* what it would mean */
    char what[160];              /* in words, for the evidence */
} cmp_hyp;

int64_t cmp_hyp_nkeys(const cmp_hyp *h);

/* Attention of the query row q (H*D) of layer `layer` over the key set h,
 * keys and values read from src (the KV owner's k and v), in double.
 * Returns 0, 1 when a needed row is not recorded, -1 on error. */
int cmp_recompute_attention(const cmp_source *src, const kv_config *cfg, int layer,
                            const float *q, const cmp_hyp *h, double *lse, double *out,
                            kv_err *e);

/* A sink model's sink logits (n_layers x H, malloc'd; NaN for a layer
 * without them) from src's own attn_lse and attn_sink; *out NULL when the
 * model has no sinks. 0, -1 on error (compare.c). */
int cmp_recover_sinks(const cmp_source *src, float **out, kv_err *e);

/* Rewrites rec's attention rows (attn_lse, attn_nkeys, attn_out, each
 * where recorded) at every (layer, q) where keys(ctx, layer, q, h) says
 * so, with attention recomputed over h from rec's own q, k, v (h comes
 * filled with the config's keys). A bug planted the way a port shows it,
 * for tests and bench/diag_sweep; an empty key set leaves NaN, as a
 * softmax over nothing does. 0, or -1 with e filled. */
typedef bool (*cmp_plant_fn)(void *ctx, const kv_config *cfg, int layer, int64_t q, cmp_hyp *h);
int cmp_memrec_plant_attention(cmp_memrec *rec, const kv_config *cfg, cmp_plant_fn keys,
                               void *ctx, kv_err *e);
/* The same for a model with attention sinks whose logits (n_layers x H)
 * the caller knows (the rec may not hold attn_lse to recover them from);
 * NULL: recovered from rec, as cmp_memrec_plant_attention does. */
int cmp_memrec_plant_attention_sinks(cmp_memrec *rec, const kv_config *cfg, cmp_plant_fn keys,
                                     void *ctx, const float *sink_logits, kv_err *e);

/* For the query row q of layer `layer` over keys lo..hi (read from src),
 * the one key whose absence (*skip) and the one whose reading twice
 * (*dup) come closest to the recorded attention (lse_rec may be NULL),
 * with those errors (+inf when none could be tried). A scan to choose a
 * candidate, which cmp_recompute_attention then verifies. Returns 0, 1
 * when a needed row is not recorded (or the range is too long to hold),
 * -1 on error. */
int cmp_keyset_scan(const cmp_source *src, const kv_config *cfg, int layer, const float *q,
                    int64_t lo, int64_t hi, const float *lse_rec, const float *out_rec,
                    int64_t *skip, double *skip_err, int64_t *dup, double *dup_err, kv_err *e);

/* For the query row q of `layer` over keys lo..p and then each later key
 * p + 1 .. hi_max added in turn (read from src), the last key *best_hi
 * whose attention comes closest to the recorded (lse_rec may be NULL),
 * with that error: the end of the keys a query read past itself (a
 * causal mask missing in a chunk). 0, 1 when a needed row is not
 * recorded, -1 on error. */
int cmp_extend_scan(const cmp_source *src, const kv_config *cfg, int layer, const float *q,
                    int64_t lo, int64_t p, int64_t hi_max, const float *lse_rec,
                    const float *out_rec, double rms_weight, int64_t *best_hi, double *best_err,
                    kv_err *e);

/* One attention row's residual, accumulated element by element: the
 * larger of max |a - b| / max(|a|, |b|) and, with rms_weight > 0,
 * rms_weight x |a - b|_2 / max(|a|_2, |b|_2). The attention check and
 * the diagnosis's hypotheses measure alike through it. */
typedef struct {
    double num, den, sq, sa, sb;
} cmp_residual;

static inline void cmp_residual_add(cmp_residual *r, double a, double b)
{
    const double d = a - b;
    r->num = fmax(r->num, fabs(d));
    r->den = fmax(r->den, fmax(fabs(a), fabs(b)));
    r->sq += d * d;
    r->sa += a * a;
    r->sb += b * b;
}

static inline double cmp_residual_value(const cmp_residual *r, double rms_weight)
{
    double v = r->num > 0 ? (r->den > 0 ? r->num / r->den : INFINITY) : 0;
    if (rms_weight > 0 && r->sq > 0)
        v = fmax(v, rms_weight * sqrt(r->sq / fmax(r->sa, r->sb)));
    return v;
}

/* Error of a recomputed (lse, out) against recorded rows: the larger of
 * max_h |dlse| / max(1, |lse|), max |dout| / max |out| and rms_weight x
 * |dout|_2 / |out|_2 (0: none; see cmp_xrt.audit_rms_weight). */
double cmp_attention_err(const kv_config *cfg, int layer, const double *lse, const double *out,
                         const float *lse_rec, const float *out_rec, double rms_weight);

/* Offsets the RoPE solver reaches: every one a 32-bit position counter
 * can be off by. */
#define CMP_ROPE_MAX_OFFSET 2147483648.0

/* The integer RoPE offset delta (0 excluded, |delta| < CMP_ROPE_MAX_OFFSET)
 * that maps the rotated rows ref (nheads x D) to test, solved from the
 * rotation angle of each frequency pair (the lowest frequency gives it up
 * to whole turns, the higher ones pick the turn and refine it), then
 * verified by rotating ref; returns that row-relative error (+inf when no
 * offset fits every frequency). Layer picks the RoPE base and scaling. */
double cmp_rope_solve(const kv_config *cfg, int layer, const float *ref, const float *test,
                      int nheads, int64_t *delta);

/* How the rows of each head reach the rotation, against the config's
 * layout. A runtime that rotates adjacent pairs (2i, 2i + 1) needs q/k
 * weights whose rows were reordered for it (Llama's permutation); its
 * recorder reorders them back. Rows that missed the reordering come
 * back, to the recorder's reader, as the unrotated row with row 2m + s
 * moved to s*D/2 + m, then rotated as the config rotates (UNPERMUTED);
 * rows reordered once too often, the other way (PERMUTED). */
typedef enum {
    CMP_ROWS_SAME,
    CMP_ROWS_UNPERMUTED,         /* y[s*D/2 + m] = x[2m + s] */
    CMP_ROWS_PERMUTED            /* y[2m + s] = x[s*D/2 + m] */
} cmp_rope_rows;

/* A RoPE convention other than the config's for one layer: base theta,
 * scaling (type ROPE_SCALE_NONE: none), pair layout (interleaved:
 * pairs (2i, 2i + 1), as GPT-J; else rotate-half (i, i + gap)), the rows'
 * order before the rotation, and how many pairs turn. The three counts
 * are 0 for the config's own: a partial rotation of n pairs is (pairs n,
 * freq_dims D, gap D/2) as Gemma 4's proportional RoPE, (n, 2n, n) as a
 * rope dimension count of 2n (GPT-NeoX's, llama.cpp's n_rot), (n, 2n,
 * D/2) the same on rows laid out for halves. Pairs past `pairs` stay. */
typedef struct {
    double theta;
    kv_rope_scaling scaling;
    bool interleaved;
    cmp_rope_rows rows;
    int pairs;                   /* pairs rotated (0: the config's for the layer) */
    int freq_dims;               /* inv_j = theta^(-2j / freq_dims) (0: the head size) */
    int gap;                     /* rotate-half pair j is (j, j + gap) (0: D/2) */
    char what[200];              /* in words, for the evidence */
} cmp_rope_conv;

/* Row-relative error (max |diff| / max |test|) of the reference's rotated
 * rows ref (nheads x D, at position pos, under the config's convention
 * for the layer) rotated instead under cv, against test. +inf on a bad
 * shape. */
double cmp_rope_conv_err(const kv_config *cfg, int layer, const cmp_rope_conv *cv, int64_t pos,
                         const float *ref, const float *test, int nheads);

/* --- rotations.c --- */

/* The cross-runtime walk's rotation test (crossrt.c): a q or k row drift
 * by its size is a step where a rotation leaves CMP_ROT_GAIN times less
 * than its error (rounding is no rotation); found, the rotation first
 * shows where it leaves CMP_ROT_BACK times less (one candidate, no
 * search: a smaller gain), and the diagnosis fits there to that gain. */
#define CMP_ROT_GAIN 8.0
#define CMP_ROT_BACK 2.0

#define CMP_ROPE_MAX_CONVS 24

/* The conventions a runtime may use instead of the config's on layer l,
 * each with its words: the other layer type's base, common bases,
 * scaling missing, of the other type or where it does not belong, the
 * interleaved layout and rows permuted for it, and on Gemma 4 a sliding
 * layer turned as a full one. The config's own is never among them.
 * Fills cv (CMP_ROPE_MAX_CONVS), returns how many. */
int cmp_rope_convs(const kv_config *cfg, int layer, cmp_rope_conv *cv);

/* How a runtime turns n pairs of a D-wide head: Gemma 4's proportional
 * RoPE (pairs (i, i + D/2) at the whole head's frequencies theta^(-2i/D),
 * llama.cpp's rope_freqs); a rope dimension count of 2n as GPT-NeoX and
 * llama.cpp's n_rot turn it (the first 2n dimensions, pairs (i, i + n),
 * frequencies theta^(-i/n)); that count on rows laid out for halves
 * (pairs (i, i + D/2), theta^(-i/n): an interleaved runtime's first 2n
 * rows, mapped back). */
typedef enum {
    CMP_PART_PROPORTIONAL,
    CMP_PART_NEOX,
    CMP_PART_HALVES,
    CMP_PART_KINDS
} cmp_part_kind;

/* Layer l's base and scaling with n pairs turned in layout k (no words). */
cmp_rope_conv cmp_rope_partial(const kv_config *cfg, int layer, cmp_part_kind k, int n);
/* Whether (k, n) is the config's own rotation, or another layout's n. */
bool cmp_rope_partial_is_own(const kv_config *cfg, int layer, cmp_part_kind k, int n);

/* The smallest row-relative error any convention or partial rotation of
 * layer l leaves between the reference's rows ref and the test's at pos
 * (+inf none); *best: that candidate. */
double cmp_rope_best_fit(const kv_config *cfg, int layer, int64_t pos, const float *ref,
                         const float *test, int nheads, cmp_rope_conv *best);

/* The rows (nheads x D) of layer `layer` at position pos rotated back
 * under the config's RoPE convention, into out (nheads x D doubles). */
void cmp_rope_unrotate(const kv_config *cfg, int layer, int64_t pos, const float *row, int nheads,
                       double *out);

/* --- crossrt.c --- */

/* Whether the compare of ref and test is judged by the cross-runtime
 * drift model (cmp_opts.cross_runtime); fills why (n bytes) with the
 * reason in words when it is. */
bool cmp_xrt_wanted(const cmp_source *ref, const cmp_source *test, const cmp_opts *o,
                    char *why, size_t n);

/* The cross-runtime walk: reads every row of the stages r->stages lists
 * (filled and clipped by the caller), judges each against the drift
 * model in dataflow order and fills r->first (the first row above its
 * threshold, when any), r->ev's earlier-stage bits, every stage's `all`
 * and `upto` metrics and xrt figures, r->compared.walked_to and r->xrt.
 * 0, or -1 with e filled. */
int cmp_xrt_walk(cmp_ctx *c, kv_err *e);

/* The drift model's allowance at every stage for the test's activation
 * precision: compute_factor x its unit roundoff. */
double cmp_xrt_compute_term(const cmp_xrt *m);


#endif
