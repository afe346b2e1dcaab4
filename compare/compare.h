/* compare.h — the comparer: align two recordings, find the first divergence
 * in dataflow order, say what kind of bug it looks like.
 *
 * A recording is seen through a cmp_source (an HDF5 dump, an in-memory
 * recording made by cmp_memrec, anything that can hand out rows by absolute
 * position). cmp_compare walks both in dataflow order — positions
 * ascending; at each position the embedding, layers 0..L-1 with their
 * stages in kv_stage order, then final_norm and logits — reading blocks of
 * positions per (layer, stage), never a whole recording, and stops at the
 * first element that differs (exact mode) or violates the tolerance — or,
 * when that one is rounding drift, at the first difference larger than
 * drift, so a bug behind drift is still found. It then gathers evidence
 * at that point (which earlier stages are bitwise
 * identical, the attention statistics, a recomputation of attention under
 * each candidate key set, a RoPE offset estimate) and names the bug class
 * (docs/diagnosis.md lists every rule). Tokens are compared up to the first
 * differing one, with each run's logit margin there.
 *
 * Nothing here prints: renderers return text or JSON for the caller. */
#ifndef KV_COMPARE_H
#define KV_COMPARE_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include "../model/observer.h"
#include "../model/config.h"
#include "../model/err.h"

/* ------------------------------------------------------------------ */
/* Sources                                                              */

/* One recording, as the comparer reads it. Every position is ABSOLUTE (the
 * token index), never a dataset row. The struct and everything it points
 * to are owned by whoever filled it and must stay valid and unchanged for
 * the duration of a cmp_compare call. */
/* All the row hashes of one (layer, stage) in one figure. */
typedef struct {
    int64_t first_pos, rows;
    int cols;
    uint64_t digest[2];          /* XXH3-128 of the rows' XXH3-64 hashes, in order */
    double sum_sq;               /* sum over rows, in order, of (L2 norm)^2 */
    bool usable;                 /* a hash for every row, every statistic finite */
} cmp_digest;

/* What the comparer will ask of a stage (cmp_source.prefetch). */
enum {
    CMP_PREFETCH_INFO = 1,         /* info */
    CMP_PREFETCH_ROWS = 2,         /* prepare_parallel, then rows */
    CMP_PREFETCH_HASH_INFO = 4,    /* which positions have hashes */
    CMP_PREFETCH_HASHES = 8,       /* read_hash */
    CMP_PREFETCH_STATS = 16,       /* read_stats */
    CMP_PREFETCH_DIGEST = 32       /* digest, checked */
};
typedef struct cmp_prefetch_item {
    int layer;
    kv_stage stage;
    unsigned what[2];              /* CMP_PREFETCH_* of the source called, of the other */
} cmp_prefetch_item;

typedef struct cmp_source {
    void *ctx;                   /* passed back to every callback */
    const char *label;           /* for messages: "reference", a file path */
    kv_config cfg;               /* the resolved model config of the recording */
    const char *engine;          /* "reference", "chunked", "pytorch"; may be NULL */
    const char *settings_json;   /* engine settings (JSON object) or NULL; the
                                  * comparer reads "chunk", "cache", "attention",
                                  * "max_ctx" when present */
    const char *weights;         /* weight fingerprint (hex) or NULL / "" unknown */
    int64_t n_tokens;            /* tokens known (prompt then generated); 0 if none */
    int64_t prompt_length;
    const int32_t *tokens;       /* n_tokens ids, token at absolute position p */
    bool complete;               /* false: the run stopped early (partial dump) */
    bool stopped_on_purpose;     /* run --compare stopped it past its first
                                  * divergence: where it ends is no finding */
    const char *status;          /* the recording's own words ("complete", "partial:
                                  * interrupted by SIGTERM"); may be NULL */

    /* Which positions of (layer, stage) are recorded: first_pos and rows
     * (rows = 0 when absent) and floats per row (ignored for fingerprint-
     * only sources: the comparer uses the config's width). layer = -1 for
     * model-level stages (embed, final_norm, logits). Returns 0, or
     * non-zero for "absent". Required. */
    int (*info)(void *ctx, int layer, kv_stage st, int64_t *first_pos, int64_t *rows,
                int *cols);
    /* Reads positions pos0 .. pos0 + n - 1 (inside what info reported) into
     * out (n x cols floats, row-major). Returns 0 or -1 with e filled. NULL
     * for a fingerprint-only source (then read_hash is required). */
    int (*read)(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                kv_err *e);
    /* Optional: XXH3-64 (seed 0) of each row's float32 bytes (the dump
     * format's fingerprint). Only used when read is NULL. */
    int (*read_hash)(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                     uint64_t *hash, kv_err *e);
    /* Optional, with read and read_hash: the L2 norm and absmax of each row
     * (n x 2 floats). A source with all three hashes its rows; the comparer
     * then reads hashes first and skips the rows of blocks whose hashes all
     * agree (their statistics come from here). Such a source's read_hash and
     * read_stats return 1 for rows without a hash (then the rows are read). */
    int (*read_stats)(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                      float *l2_absmax, kv_err *e);
    /* Optional, with read: reads from several threads at once. prepare_
     * parallel is called from one thread before any parallel read of
     * (layer, st) and returns 1 when read_parallel may then be called for
     * it from any thread, alongside other such calls; 0 when not (read is
     * used). read_parallel takes the same arguments as read. */
    int (*prepare_parallel)(void *ctx, int layer, kv_stage st);
    int (*read_parallel)(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                         float *out, kv_err *e);
    /* Optional, with read_hash and read_stats: what the source knows of all
     * the row hashes of (layer, st) at once (a dump's /row_hash_index).
     * Returns 0 with *out filled, non-zero when it knows nothing. checked =
     * false: as recorded, cheap, possibly stale; true: only when found to
     * agree with the row hashes as they are now. When every stage both
     * sides record has equal digests, checked on both sides, over exactly
     * the compared positions, the comparer settles the walk from them. */
    int (*digest)(void *ctx, int layer, kv_stage st, bool checked, cmp_digest *out);
    /* Optional /output: positions first_pos .. first_pos + rows - 1 carry the
     * log-sum-exp of the logits and the top k (k >= 1) logits, descending,
     * ties by lower id. output_info returns non-zero (or rows 0) when there
     * is none; output reads n positions (lse n, ids and vals n x k). */
    int (*output_info)(void *ctx, int64_t *first_pos, int64_t *rows, int *k);
    int (*output)(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *topk_ids,
                  float *topk_vals, kv_err *e);
    /* Optional: readies the source, and the other one (other_ctx, a source
     * with the same prefetch), for what the comparer is about to ask of
     * the stages listed, doing the two at once where it can (dump files:
     * one child process per file, dump_survey). Called once, before any
     * read and before the comparer starts threads. */
    void (*prefetch)(void *ctx, void *other_ctx, const cmp_prefetch_item *items, int n);
    /* Optional: is every recorded stage what its format says (type, shape,
     * positions, readable from the source itself)? Called after prefetch,
     * before anything recorded is believed (a digest, a hash, a row); -1
     * with e filled (one line naming the source and what is wrong) makes
     * the compare fail. */
    int (*check)(void *ctx, kv_err *e);
    /* The attention sinks' logits (n_layers x H) a recomputation of
     * attention adds to each head's softmax (cfg.attn_sinks), or NULL.
     * Left NULL by a source's maker: the comparer recovers them from the
     * reference's attn_lse and attn_sink (docs/diagnosis.md). */
    const float *sink_logits;
} cmp_source;

/* A dump file as a source (source_dump.c). Fills *out; the returned handle
 * owns the open file and must outlive every use of *out. NULL with e
 * filled (naming the file) when it cannot be read as a dump. */
typedef struct cmp_dump_source cmp_dump_source;
cmp_dump_source *cmp_dump_source_open(const char *path, cmp_source *out, kv_err *e);
void cmp_dump_source_close(cmp_dump_source *d);   /* accepts NULL */

/* ------------------------------------------------------------------ */
/* In-memory recorder                                                   */

/* A kv_observer sink that keeps every emitted row (grown as needed) and
 * every announced token, and reads back as a cmp_source. For tests, the
 * lockstep mode and small runs: memory grows with the run. */
typedef struct cmp_memrec cmp_memrec;

typedef struct {
    int layer_lo, layer_hi;      /* inclusive layer range kept (model-level
                                  * stages are kept whatever the range) */
    int64_t pos_lo, pos_hi;      /* inclusive position range kept */
    bool stages[STAGE_COUNT];    /* stages kept */
    int topk;                    /* k of the /output (lse + top-k) derived from every
                                  * logits row, kept even when full logits are not
                                  * (stages[STAGE_LOGITS] off), as in a dump */
} cmp_memrec_opts;

/* Everything: all layers, positions, stages (full logits too), top-8. */
void cmp_memrec_opts_default(cmp_memrec_opts *o);

/* cfg is copied; engine and settings_json (may be NULL) are copied. o may
 * be NULL (defaults). Returns NULL with e filled on a bad argument or when
 * out of memory. */
cmp_memrec *cmp_memrec_new(const kv_config *cfg, const char *engine, const char *settings_json,
                           const cmp_memrec_opts *o, kv_err *e);
void cmp_memrec_free(cmp_memrec *m);   /* accepts NULL */

/* The sink to hand to an engine and generate(); valid until cmp_memrec_free.
 * Rows of one (layer, stage) must arrive in position order without gaps
 * (re-emitting a recorded position overwrites it); otherwise, or when out
 * of memory, the observer asks the engine to stop and cmp_memrec_error
 * says why. */
kv_observer *cmp_memrec_observer(cmp_memrec *m);
const char *cmp_memrec_error(const cmp_memrec *m);  /* NULL when none */

/* Marks the recording partial (a run that stopped early); default complete. */
void cmp_memrec_set_complete(cmp_memrec *m, bool complete);

/* Fills *out with a view of m. The view (its tokens pointer in particular)
 * is invalidated by further emits: take it after the run. */
void cmp_memrec_source(cmp_memrec *m, cmp_source *out);

/* The stored row of (layer, stage) at pos, writable (tests plant
 * differences through it), or NULL when not recorded. *cols (may be NULL)
 * receives the row's width. */
float *cmp_memrec_row(cmp_memrec *m, int layer, kv_stage st, int64_t pos, int *cols);

/* Bytes of rows held. */
size_t cmp_memrec_bytes(const cmp_memrec *m);

/* ------------------------------------------------------------------ */
/* Options                                                              */

/* An element of the test matches the reference's when:
 *   exact mode (atol = rtol = 0, ulp = 0, no noise source): the float32
 *     bits are equal (so NaN equals NaN only bit for bit, and -0 != +0);
 *   otherwise: bits equal, or both NaN, or
 *     |test - ref| <= atol + rtol_eff * max|ref row|, or ulp distance <= ulp,
 *     where max|ref row| is the largest finite |ref| of that row (rtol is
 *     scale-aware, as the reported relative errors are, so an element near
 *     zero in a row of O(1) values does not need an atol: numpy's
 *     element-wise rtol would flag every rounding difference there), and
 *     rtol_eff = rtol + noise_factor * floor(layer, stage).
 * The floor (row-relative, 0 without a noise source) models the drift the
 * noise recording shows against the reference, over every position both
 * hold (not only the test's): drift is born at the first (layer, stage) in
 * dataflow order where the noise differs, every stage before it keeps
 * floor 0 (exact); from there floor(l, s) is the largest row-relative
 * |ref - noise| of any stage from the birth through layer l + 1 (model
 * stages after the last layer: of all), so a stage the noise run happened
 * to reproduce exactly, or does not hold, is not exact once drift runs
 * upstream of it; attn_nkeys (integer counts) stays exact.
 * cmp_stage_result shows each stage's sample and floor.
 * A NaN or infinity against anything but its own kind is always a
 * divergence. Fingerprint sources compare by hash: exact mode only. */
typedef struct {
    double atol;                 /* absolute; 0 = off */
    double rtol;                 /* relative to the row's largest |ref|; 0 = off */
    uint64_t ulp;                /* 0 = off */
    const cmp_source *noise;     /* optional third recording of the same prompt
                                  * (e.g. a cascade run) defining the noise floor */
    double noise_factor;         /* default 4 (docs/diagnosis.md says why) */
    bool force;                  /* compare despite a model / prompt mismatch */
    bool full;                   /* keep walking after the divergence, so the
                                  * per-stage `all` metrics cover everything */
    int block_rows;              /* positions per read (default 64, at most 4096) */
    bool no_hashes;              /* read every row even where both sides' row
                                  * hashes agree */
    int64_t hash_audit_whole;    /* rows settled by hash are all hashed again up to
                                  * this many floats a side (0: the default, 2^26;
                                  * -1: a sample always) */
    /* Cross-runtime mode (docs/cross-runtime.md): rows judged by a drift
     * model of another runtime's rounding instead of the rule above.
     * AUTO (the default): when both recordings name their engine and the
     * names differ, and no atol, rtol, ulp or noise source is given; OFF:
     * never (--exact); ON: always (both sources must hold rows). */
    int cross_runtime;           /* CMP_XRT_AUTO, CMP_XRT_OFF, CMP_XRT_ON */
    /* Optional, cross-runtime mode: called for each row the drift model
     * judges (positions ascending, stages in dataflow order; the step's
     * row last) with its row-relative error and its threshold, so a
     * report can draw error / threshold (reports/). */
    void (*xrt_row)(void *ctx, int layer, kv_stage st, int64_t pos, double err,
                    double threshold);
    void *xrt_row_ctx;
    /* Optional: called after each block of positions with the last position
     * walked and the last there is (for a progress bar). */
    void (*progress)(void *ctx, int64_t pos, int64_t last);
    void *progress_ctx;
} cmp_opts;

enum { CMP_XRT_AUTO = 0, CMP_XRT_OFF = 1, CMP_XRT_ON = 2 };

void cmp_opts_default(cmp_opts *o);

/* ------------------------------------------------------------------ */
/* Result                                                               */

typedef enum { CMP_IDENTICAL, CMP_WITHIN_TOLERANCE, CMP_DIVERGED } cmp_verdict;

/* Metrics over a set of compared rows of one (layer, stage). Relative
 * errors are row-relative: max|test - ref| over a row divided by max|ref|
 * over that row (scale-aware, no blow-up at zero crossings). Sums skip
 * elements where either side is NaN or infinite. */
typedef struct {
    int64_t rows;                /* rows compared */
    int64_t bitequal_rows;       /* rows whose bits are all equal */
    int64_t violating_rows;      /* rows with an element outside the tolerance */
    int64_t nonfinite;           /* elements where only one side is NaN/Inf
                                  * (or NaN against an infinity) */
    double max_abs, max_rel;
    uint64_t max_ulp;
    double dot, ref_sq, test_sq, err_sq;   /* for cosine and NMSE */
    int64_t first_bitdiff_pos;   /* -1: every row bitwise equal */
} cmp_stats;

double cmp_stats_cosine(const cmp_stats *s);  /* 1 when both sides are all zero */
double cmp_stats_nmse(const cmp_stats *s);    /* err_sq / ref_sq (0 when no error) */

typedef struct {
    int layer;                   /* -1: model level */
    kv_stage stage;
    int cols;
    int64_t pos_lo, pos_hi;      /* positions both recordings hold (inclusive) */
    bool hashed;                 /* compared by fingerprint (row hashes) */
    int64_t rows_by_hash;        /* rows found bit-equal by their hashes alone
                                  * (full dumps with row hashes), not read */
    /* With a noise source (all 0 without one; docs/diagnosis.md): */
    bool noise_held;             /* the noise recording holds this (layer, stage) */
    double noise_abs;            /* max |ref - noise| over the positions both hold */
    double noise_rel;            /* max row-relative |ref - noise| there: this stage's
                                  * own sample of the drift */
    double noise_floor;          /* the drift floor modelled for this stage, row-relative
                                  * (0: compared without one; see cmp_opts) */
    double atol_eff;             /* the absolute tolerance applied (atol) */
    double rtol_eff;             /* the relative tolerance applied:
                                  * rtol + noise_factor * noise_floor */
    cmp_stats upto;              /* rows before the first divergence (dataflow order) */
    cmp_stats all;               /* every row the walk visited (all of them with opts.full) */
    /* Cross-runtime mode (cmp_xrt; all 0 otherwise), row-relative errors: */
    double xrt_scale;            /* learned: the largest error of this stage at the
                                  * positions judged drift (before the step) */
    double xrt_threshold;        /* the threshold at the last position judged */
    double xrt_err;              /* the largest error observed, the step's row included */
    double xrt_ratio;            /* the largest error / threshold over drift rows (< 1) */
    /* The structure test (structure.c): the largest row scale |a - 1| of
     * the rows judged (the step's included), and the largest of it over
     * its threshold among rows judged drift. */
    double xrt_sys, xrt_sys_ratio;
} cmp_stage_result;

typedef struct {
    bool found;
    int64_t pos;
    int layer;                   /* -1: model level */
    kv_stage stage;
    bool hashed;                 /* located from fingerprints: row only, no element */
    int col;                     /* lowest violating column; -1 unknown */
    int head, dim;               /* per-head stages (q, attn_out: query head; k, v:
                                  * KV head; attn_lse, attn_nkeys: head, dim -1);
                                  * -1 elsewhere */
    float ref, test;             /* the values there */
    double abs_err;              /* |test - ref| (NaN when one is non-finite) */
    uint64_t ulp;                /* ulp distance (0 when non-finite) */
    bool nonfinite;              /* one side NaN/Inf and the other not the same */
    int n_bad;                   /* violating elements in that row */
    double row_max_abs, row_rel; /* over the row: max |diff|, max |diff| / max |ref| */
    bool layer_sliding;          /* the layer's attention (layer >= 0) */
    int layer_window;
    int kv_owner;
    bool from_output;            /* found in /output (lse, top-k), not in logits rows:
                                  * col is the reference's token id (-1: the
                                  * log-sum-exp), head its rank in the top-k (from 0),
                                  * dim the test's id at that rank where the ids
                                  * differ (else -1) */
} cmp_divergence;

typedef enum {
    CMP_DIAG_NONE,               /* no divergence */
    CMP_DIAG_ZERO_KV,            /* attention read K = V = 0 */
    CMP_DIAG_ROPE_OFFSET,        /* q (or k) rotated for another position */
    CMP_DIAG_WINDOW,             /* sliding window of another size */
    CMP_DIAG_CHUNK_ISOLATED,     /* a chunk attended only to itself */
    CMP_DIAG_EXTRA_KEY,          /* one extra (unwritten) key at the first decode step */
    CMP_DIAG_DECODE_STUCK,       /* decode write index not advancing */
    CMP_DIAG_RING_NO_WRAP,       /* ring buffer not overwriting its oldest slot */
    CMP_DIAG_STALE_CACHE,        /* sliding cache read from an earlier state */
    CMP_DIAG_KEY_SET,            /* a different key set, no finer pattern */
    CMP_DIAG_NUMERIC_DRIFT,      /* rounding-order differences, not a cache bug */
    CMP_DIAG_NONFINITE,          /* NaN / Inf on one side */
    CMP_DIAG_UNCLASSIFIED,
    CMP_DIAG_DECODE_BLIND,       /* split cache: decode steps read only the decode cache */
    CMP_DIAG_ROPE_CONVENTION,    /* q/k rotated with another RoPE base, scaling or layout */
    CMP_DIAG_ATTN_SCALE,         /* attention scores scaled by another factor */
    CMP_DIAG_NORM_CONVENTION,    /* an RMSNorm weight applied as w where (1 + w) is due, or back */
    CMP_DIAG_MISSING_KEY,        /* one key of the config's set not read */
    CMP_DIAG_DUP_KEY,            /* one key of the config's set read twice */
    CMP_DIAG_QK_NORM_MISSING,    /* q/k per-head RMSNorm not applied */
    CMP_DIAG_LAYER_TYPE,         /* a sliding layer read as global, or a global one through a window */
    CMP_DIAG_OWN_KEY_MASKED,     /* the query's own key masked out (j < p) */
    CMP_DIAG_PADDED_SLOTS,       /* unwritten (zero) slots read as keys: padding, a fixed-size cache */
    CMP_DIAG_KV_SWAPPED,         /* k and v projections swapped */
    CMP_DIAG_NORM_EPS,           /* an RMSNorm epsilon other than the config's */
    CMP_DIAG_FUTURE_KEYS,        /* the causal mask missing: keys after the query read */
    CMP_DIAG_KV_OWNER,           /* a layer read another layer's KV cache than the config's */
    CMP_DIAG_ROW_SCALE,          /* each row scaled by a factor (one, or its own) */
    CMP_DIAG_CHANNEL_SCALE,      /* channels scaled, the same at every position */
    CMP_DIAG_BIAS,               /* a per-channel offset: a bias missing or another */
    CMP_DIAG_LOGIT_MAP,          /* the logits through another softcap or scale */
    CMP_DIAG_STATED_PRECISION,   /* the test states f32 but its rows are coarser */
    CMP_DIAG_ROWS_SHIFTED,       /* K/V rows written N positions off: a write index off */
    CMP_DIAG_SINK,               /* an attention sink left out of a softmax */
    CMP_DIAG_LATENT_CACHE,       /* an MLA latent cache: its RoPE tail, scale or forms */
    CMP_DIAG_COUNT
} cmp_diag_kind;

/* Positions past the first divergence the diagnosis reads from the test
 * recording: two bugs can read the same keys at the divergence and differ
 * only later (docs/diagnosis.md). At least CMP_DIAG_LOOKAHEAD, and twice
 * the largest sliding window of cfg (a window one key off, or a layer of
 * the other type, shows over a window's length). A run stopped early
 * keeps these, so that its diagnosis is the one two whole dumps give. */
#define CMP_DIAG_LOOKAHEAD 8
int64_t cmp_diag_span(const kv_config *cfg);

/* How the diagnosis was established, most trustworthy first. */
typedef enum {
    CMP_BASIS_NONE,
    CMP_BASIS_RECOMPUTED,        /* recomputing from recorded rows reproduces the test */
    CMP_BASIS_EXACT_CHECK,       /* an exact property of the recorded values */
    CMP_BASIS_HEURISTIC          /* pattern of positions and counts only */
} cmp_basis;

/* One candidate cause the key-set engine scored (docs/diagnosis.md, "The
 * hypothesis engine"). */
typedef enum { CMP_HYP_VERIFIED, CMP_HYP_REMAINS, CMP_HYP_REFUTED } cmp_hyp_status;
#define CMP_MAX_HYPS 16
typedef struct {
    cmp_diag_kind kind;
    char keys[160];              /* its key set at the first divergence, in words */
    cmp_hyp_status status;
    double err;                  /* at the first divergence */
    int places;                  /* (position, layer) places it reproduced */
    int64_t refuted_pos;         /* where it failed (-1 none) */
    int refuted_layer;
    double refuted_err;          /* +inf: its key count is not the test's there */
} cmp_hyp_score;

typedef struct {
    cmp_diag_kind kind;
    cmp_basis basis;
    bool undecided;              /* several causes remain: none is named as verified */
    int n_hyps;
    cmp_hyp_score hyps[CMP_MAX_HYPS];
    char summary[256];           /* one line: "attention read a different key set ..." */
    char detail[512];            /* the refinement: "(window in test appears to be 4, ...)" */
    char evidence[1024];         /* how it was established, in words */
} cmp_diagnosis;

/* Facts gathered at the first divergence (p, l, s) of a layer stage. */
typedef struct {
    uint32_t earlier_compared;   /* bit st: stage st at (p, l) compared */
    uint32_t earlier_identical;  /* bit st: ... and bitwise identical */
    int qkv;                     /* 1: q of layer l and k, v of its KV owner are bitwise
                                  * identical at every recorded position qkv_from ..
                                  * qkv_to; 0: not all bitwise (tolerance mode: they are
                                  * within it, since they precede the divergence);
                                  * -1: not all recorded */
    int64_t qkv_from, qkv_to;    /* the positions that claim covers: qkv_to is p, or
                                  * p - 1 when the divergence is at q, k or v itself */
    int n_heads;                 /* entries in lse_ref / lse_test */
    float *lse_ref, *lse_test;   /* attn_lse at (p, l), or NULL when not recorded */
    int nkeys_ref, nkeys_test;   /* keys attended at (p, l), head 0; -1 unknown */
    bool norms_equal;            /* stage q/k: per-head L2 norms equal (rotation-like) */
    bool rope_found;
    int64_t rope_delta;          /* best RoPE offset when rope_found */
    double rope_err;             /* its row-relative error */
    int recompute;               /* -1 not attempted, 0 no hypothesis matched, 1 one did */
    char hypothesis[160];        /* the key set that reproduced the test */
    double hyp_err;              /* its error against the test */
    double ref_check_err;        /* the config's key set against the reference */
    int64_t nkeys_diff_pos;      /* first position where any layer's key count differs; -1 none */
    int nkeys_diff_layer;
    double growth_first, growth_last;  /* row-relative error of x_out at p: layer l, last layer */
    int growth_layer_last;
} cmp_evidence;

typedef enum {
    CMP_TOKENS_NONE,             /* a side has no tokens */
    CMP_TOKENS_IDENTICAL,        /* same count, same ids */
    CMP_TOKENS_DIFFER,           /* a generated token differs */
    CMP_TOKENS_LENGTH            /* common prefix identical, counts differ */
} cmp_tokens_kind;

typedef struct {
    cmp_tokens_kind kind;
    int64_t n_ref, n_test, prompt_length;
    int64_t pos;                 /* first differing position (CMP_TOKENS_DIFFER) */
    int64_t step;                /* pos - prompt_length: 0 = first generated token */
    int32_t ref_id, test_id;
    double ref_margin, test_margin;  /* top-1 minus top-2 logit at pos - 1; NaN unknown */
    bool near_tie;               /* both margins known and small (< 0.05 * max(1, |top-1|)
                                  * or < 1e-3): a flip a rounding difference can cause */
    /* A greedy run (settings "temperature": 0) whose token at p + 1 is not
     * the top-1 of its own /output at p (a tie at the top excepted): the
     * recording contradicts itself. First such p of each side, -1 none or
     * not checkable (not greedy, no /output); the id chosen and the top-1. */
    int64_t self_pos[2];         /* [0] reference, [1] test */
    int32_t self_token[2], self_top1[2];
    /* Across runtimes: the pair's own logit error at pos - 1 (the largest
     * |test - ref| over the ids both /output top-k lists hold; NaN unknown),
     * and whether it explains the flip: the reference's top-2 margin is
     * at most twice it, nothing stepped above drift before, and the test
     * chose its own top-1. Such a flip is drift: the verdict passes. */
    double logit_err;
    bool flip_drift;
    bool test_stopped;           /* the test was stopped on purpose past its first
                                  * divergence (run --compare): a shorter token
                                  * list there is no finding */
} cmp_tokens;

/* softmax(ref) vs softmax(test) over the compared positions. */
typedef struct {
    bool present;
    bool from_topk;              /* only /output top-k: KL is approximate (a lower bound
                                  * over the reference's top-k ids) */
    int64_t positions;
    int64_t top1_agree;
    double kl_mean, kl_max;
    int64_t kl_max_pos;
    /* Positions left out of the KL and the top-1 count: a side's logits
     * (or, from top-k, its log-sum-exp or a top-k value) there are NaN or
     * infinite, which no KL measures. nonfinite_what says the first:
     * "b.h5's log-sum-exp is nan" (and a note of the result says it; the
     * JSON has the note only). present stays false when no position is
     * left. */
    int64_t nonfinite;
    int64_t nonfinite_pos;       /* the first such position; -1 none */
    char nonfinite_what[200];
} cmp_logit_stats;

typedef struct {
    int n_layers;                /* distinct layers with a compared stage */
    int n_stages;                /* distinct layer stages compared */
    int n_model_stages;          /* embed, final_norm, logits compared */
    int64_t pos_lo, pos_hi;      /* positions compared (inclusive; lo > hi: none) */
    int64_t rows;                /* rows in the overlap (all (layer, stage, position)) */
    bool partial;                /* the overlap is smaller than either recording */
    bool hashed;                 /* some stage compared by fingerprint */
    int64_t pos_cut;             /* first position whose input token differs (walk
                                  * stops before it); -1 none */
    int64_t routing_flip;        /* the position where the test's router took another
                                  * expert at a near tie, the compare stopping at or
                                  * after it (compare.c); -1 none */
    int routing_flip_layer;      /* and its layer */
    int64_t walked_to;           /* last position the walk read */
    bool by_index;               /* settled by both sides' digests (row hash indexes) */
    char lacks[320];             /* the (layer, stage) pairs one side records and the
                                  * other does not: "b.h5 lacks q, k of every layer";
                                  * "" when none */
} cmp_coverage;

/* Row hashes found true or stale (hashcheck.c): after a walk that let
 * hashes settle rows, a fixed fraction of every such stage's rows and
 * every row near the divergence are read and hashed again. */
typedef struct {
    int64_t rows_checked;        /* rows read and hashed again, both sides together */
    bool stale;                  /* a row differs from its recorded hash: every row
                                  * was then read (the walk ran as --no-hashes) */
    char file[256];              /* the recording holding it */
    int layer;                   /* -1 model level */
    kv_stage stage;
    int64_t pos;
} cmp_hash_check;

/* A map of the reference's logits onto the test's (structure.c). */
typedef enum { CMP_MAP_NONE, CMP_MAP_SOFTCAP, CMP_MAP_SCALE } cmp_map_kind;

/* Which model judged a cross-runtime compare and with what figures
 * (docs/cross-runtime.md). A row (layer l, stage s, position p) with
 * row-relative error err is drift while
 *   err <= threshold = max(floor(s), gain * upstream, history * scale)
 * upstream: the largest error of any stage before it in dataflow (every
 * earlier layer, the earlier stages of layer l; positions <= p); scale:
 * the largest error of (l, s) itself at positions < p; floor: floor_base
 * plus compute_factor * compute_eps (the runtime's activation precision),
 * plus kv_factor * kv_eps at attention outputs (the KV cache's rounding). */
typedef struct {
    bool on;                     /* the compare was judged this way */
    char model[24];              /* "drift-step" */
    char why[200];               /* "engines differ: reference vs llama.cpp" */
    char kv_precision[16];       /* the test's KV cache type as recorded ("f16"), or
                                  * "unknown" (then bf16's is assumed) */
    double kv_eps;               /* its unit roundoff */
    /* The precision the test computes its activations in (engine_settings
     * compute_dtype: f32, tf32, bf16, f16): every stage's floor holds
     * compute_factor of its unit roundoff. compute_stated: recorded; else
     * assumed, and compute_assumed_why says on what grounds. A result read
     * back from JSON older than this has compute_precision "". */
    char compute_precision[16];
    double compute_eps, compute_factor;
    bool compute_stated;
    char compute_assumed_why[96];
    double floor_base, kv_factor, gain, history;
    /* The floor at attention outputs: what the test's attention kernel and
     * KV cache type alone may leave (the diagnosis's tolerance there when
     * the attention check did not run). */
    double attn_floor;
    bool step;                   /* a row above its threshold: the bug, at `first` */
    bool output_drift;           /* /output differs (within drift, unless the step
                                  * is there): the verdict is then no "identical" */
    double output_max_rel;       /* its largest relative error (tokens.c) */
    double step_err, step_threshold;
    double worst_ratio;          /* the largest err / threshold of any drift row */
    int64_t worst_pos;           /* where (-1 none) */
    int worst_layer;
    kv_stage worst_stage;
    /* The attention check (attn_audit.c): the test's attn_out against
     * attention recomputed from its own q, k, v over the config's keys,
     * at every position and layer it records all four. A row whose
     * residual is above audit_threshold = 4e-3 + 4 * max(kv_eps,
     * compute_eps) is a step
     * too, when it comes before the drift model's (audit_step). */
    char audit_skip[120];        /* why the check did not run ("" when it did) */
    double audit_rms_weight;     /* the residual is also this x the RMS-relative one
                                  * (runtimes computing in bf16 or f16; else 0) */
    int audit_layers;            /* layers checked (0: the test records no attention) */
    double audit_threshold;
    double audit_worst;          /* largest residual / threshold below the step */
    double audit_worst_residual;
    int64_t audit_worst_pos;     /* where (-1 none) */
    int audit_worst_layer;
    bool audit_step;             /* the step is the check's: first is its row */
    double audit_drift_threshold;/* the drift model's threshold at the step's row */
    /* llama.cpp's f16 value accumulator (f16acc.c): under flash attention
     * with f16 values, rows it sums in f16 (decode steps, small ubatches)
     * get acc_factor times the modelled gap of that summation at attn_out,
     * where that is above the KV term. */
    bool acc_on;                 /* modelled */
    double acc_factor;
    int64_t acc_rows;            /* rows modelled */
    double acc_largest;          /* the largest modelled gap, at: */
    int64_t acc_pos;             /* (-1 none) */
    int acc_layer;
    /* The structure test (structure.c, docs/cross-runtime.md "Structure"):
     * a row's scale part |a - 1| is a step where it is above
     *   max(sys_noise_factor x its residual's noise,
     *       sys_compute_factor x compute_eps, gain x upstream)
     * and the stage's next rows show the same sign. */
    bool sys_on;
    double sys_noise_factor, sys_compute_factor;
    bool sys_step;               /* the step is a row scale the size walk let pass */
    double sys_dev, sys_noise;   /* at the step: a - 1, the residual's noise */
    double sys_threshold, sys_drift_threshold;  /* the structure's, the size walk's */
    /* ... or a per-channel offset over the stage's first positions
     * (structure.c): its part over the residual's noise, above the same
     * threshold (sys_threshold), with off_channels channels 8 standard
     * errors off or more. */
    bool off_step;
    double off_part, off_noise;
    int off_channels;
    /* ... or a rotation (crossrt.c): a q or k row the size walk let pass is
     * the reference's turned under another RoPE convention or count of
     * pairs, which leaves rot_resid (at rot_pos2 too, rot_resid2; -1 none)
     * where the row errs XRT_ROT_GAIN times more. */
    bool rot_step;
    int64_t rot_pos;             /* where the test found it, at stage rot_stage: */
    kv_stage rot_stage;
    double rot_err, rot_resid;   /* the row's error there, and the rotation's residual */
    double rot_err2, rot_resid2;
    int64_t rot_pos2;
    double rot_here_resid;       /* at the step, where it first shows (NaN: the same row) */
    double rot_threshold, rot_drift_threshold;  /* a fit's bound; the size walk's */
    char rot_what[200];          /* the candidate, in words */
    double sys_worst_ratio;      /* the largest |a - 1| / threshold below the step */
    int64_t sys_worst_pos;       /* where (-1 none) */
    int sys_worst_layer;
    kv_stage sys_worst_stage;
    /* /output as a map of the reference's logits (structure.c): fitted over
     * every position both hold; a step at /output when its part is above
     * the noise it leaves and what flowed in. */
    bool map_fitted;
    cmp_map_kind map_kind;
    double map_param, map_config_cap;
    double map_gain;             /* RMS residual without the map / with it */
    int64_t map_positions;       /* positions fitted (each holding matched pairs) */
    double map_zmax;             /* the largest |logit| fitted, the config's cap undone */
    double map_F, map_F_crit;    /* the fit's F statistic, positions as the units,
                                  * and its critical value (1 - CMP_MAP_ALPHA) */
    bool map_significant;        /* F above it, gain >= CMP_MAP_MIN_GAIN, and the
                                  * parameter another than the config's */
    bool map_step;               /* the step at /output is the map's */
    double map_part, map_noise;  /* at the step, row-relative */
} cmp_xrt;

#define CMP_MAX_NOTES 16

typedef struct {
    cmp_verdict verdict;
    bool exact;                  /* exact mode */
    double atol, rtol, noise_factor;
    uint64_t ulp;
    bool noise;                  /* a noise-floor source was used */
    int n_layers_model;          /* of the reference config */
    cmp_coverage compared;
    cmp_divergence first;        /* the first divergence */
    cmp_evidence ev;             /* evidence at it */
    /* When `first` is numeric drift (a tiny difference that attention over
     * the config's keys reproduces), the walk goes on to the first
     * difference larger than drift: a row-relative error above 1e-3, a
     * non-finite value or a key count that differs. A bug behind drift
     * shows here; found = false when the drift stays drift. */
    cmp_divergence beyond;
    cmp_evidence beyond_ev;
    /* What the divergence looks like: that of `beyond` when found (so a bug
     * behind drift is named, never "not a cache bug"), else of `first`. */
    cmp_diagnosis diag;
    cmp_tokens tokens;
    cmp_logit_stats logits;
    cmp_stage_result *stages;    /* n_stages entries, dataflow order */
    int n_stages;
    char notes[CMP_MAX_NOTES][512];  /* refusals overridden, partial overlap, ... */
    int n_notes;
    /* The verdict holds over what both recordings hold, not over whole runs:
     * a side is partial (its run stopped early) and no divergence was found.
     * Then `identical` and `within_tolerance` vouch for less than they say,
     * and the exit code is 2 (docs/diagnosis.md, "Exit codes"). */
    bool incomplete;
    char incomplete_why[256];
    /* Non-empty: the recordings say they were given the wrong way round
     * (the run under test first), and how; every reader says so before
     * anything else, the verdict line included (roles.c). */
    char swapped[256];
    /* Non-empty: the two recordings' own configs differ in what attention
     * reads (a layer's type or KV owner, the sliding window, the final
     * softcap), in words. The test then runs another model structure
     * than the reference's, and the pair diverges even where every row
     * stays within drift (a coarse cache's noise can hide it). */
    char config_diff[256];
    cmp_hash_check hashcheck;
    cmp_xrt xrt;                 /* cross-runtime mode (xrt.on) */
} cmp_result;

/* Whether two configs are of different models, as compare refuses them
 * (model_type, then the shapes); why: "hidden_size 64 vs 128", x's value
 * first. */
bool cmp_model_mismatch(const kv_config *x, const kv_config *y, char *why, size_t n);

/* Compares test against ref. Returns 0 with *r filled (the verdict says
 * identical / within tolerance / diverged), or -1 with e filled: a read
 * error, nothing in common to compare, or a refusal (different model,
 * weights or prompt, unless o->force). *r is always safe to
 * cmp_result_free afterwards. o may be NULL (exact mode). */
int cmp_compare(const cmp_source *ref, const cmp_source *test, const cmp_opts *o,
                cmp_result *r, kv_err *e);
void cmp_result_free(cmp_result *r);   /* accepts NULL; leaves *r zeroed */

/* The (layer, stage) entry, or NULL when not compared. */
const cmp_stage_result *cmp_result_stage(const cmp_result *r, int layer, kv_stage st);

/* h5diff-like exit code for the CLI: 0 same (identical or within
 * tolerance, over whole runs), 1 diverged (a stage, a token or the token
 * count differs), 2 error (rc < 0 from cmp_compare) or incomplete (no
 * divergence over what both hold, but a side is partial). */
int cmp_exit_code(int rc, const cmp_result *r);

const char *cmp_verdict_name(cmp_verdict v);     /* "identical", "within_tolerance", "diverged" */
const char *cmp_diag_name(cmp_diag_kind k);      /* stable ids: "zero_kv", "rope_offset", ... */
const char *cmp_basis_name(cmp_basis b);         /* "recomputed", "exact_check", "heuristic" */

/* KL(ref || test) of one position from each side's /output: log-sum-exp
 * (lr, lt) and top-k ids and values, over the reference's top-k ids; a
 * test logit missing from its top-k is taken as its k-th value (the
 * largest it can be), so the result is approximate. Never negative; NaN
 * when a value it reads is not finite (not a KL of 0). */
double cmp_kl_topk(float lr, const int32_t *ir, const float *vr, float lt, const int32_t *it,
                   const float *vt, int k);

/* Distance between two floats in units in the last place (ordering of
 * float32 bit patterns; +0 and -0 are 0 apart). Non-finite: UINT64_MAX
 * unless the bits are equal. */
uint64_t cmp_ulp_distance(float a, float b);

/* ------------------------------------------------------------------ */
/* Rendering                                                            */

enum {
    CMP_RENDER_STAGES = 1        /* append the per-(layer, stage) metrics table / array */
};

/* Human-readable report (FIRST DIVERGENCE / DIAGNOSIS / TOKENS blocks).
 * Returns a malloc'd string the caller frees, NULL when out of memory. */
char *cmp_render_text(const cmp_result *r, unsigned flags);

/* What people read (this text, kvdiff report's Markdown and HTML) says in
 * words what JSON says with the stable ids of cmp_diag_name and
 * cmp_basis_name; the helpers below are shared by those readers. */

/* The largest ulp distance a text prints. Up to it two values are that
 * many roundings apart (1024 ulp is a relative error of about 1.2e-4, the
 * size the diagnosis calls tiny); beyond it (values far apart, or on both
 * sides of zero: 1 and -1 are 2130706432 ulp apart) the count tells a
 * reader nothing the relative error does not, and the text leaves it out
 * or writes ">1024". JSON keeps every count. */
#define CMP_ULP_SHOWN 1024

/* "17", or ">1024" above CMP_ULP_SHOWN, into buf (n bytes); returns buf. */
const char *cmp_ulp_text(uint64_t ulp, char *buf, size_t n);

/* The word before a diagnosis's evidence: "not decided" while rival
 * causes remain, else "verified" (recomputed), "exact check" or
 * "heuristic". A static string. */
const char *cmp_evidence_label(const cmp_diagnosis *g);

/* A diagnosis's evidence is clauses joined by "; " outside parentheses,
 * shown one a line. Given s inside the evidence, sets *len to the length
 * of the clause starting there and returns where the next one starts,
 * NULL after the last:
 *     for (const char *s = g->evidence, *next; s && *s; s = next) {
 *         size_t n;
 *         next = cmp_evidence_clause(s, &n);
 *         ... the clause is s[0..n) ...
 *     } */
const char *cmp_evidence_clause(const char *s, size_t *len);

/* The same content as JSON with stable keys (a new reference the caller
 * json_decref's; NULL when out of memory), and as compact text (malloc'd). */
/* The "schema" member every JSON result starts with; bumped when a member
 * changes meaning (reports/jsonin.c reads this and results without it). */
#define CMP_JSON_SCHEMA "kvdiff-compare/1"

json_t *cmp_result_json(const cmp_result *r, unsigned flags);
char *cmp_render_json(const cmp_result *r, unsigned flags);

#endif
