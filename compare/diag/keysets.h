/* keysets.h — the key-set hypothesis engine (keysets.c) and its families
 * (keyfams.c) share these: a candidate cause, the run that scores them,
 * and what each family says of its candidates. Nothing outside diag/
 * sees them. */
#ifndef KV_DIAG_KEYSETS_H
#define KV_DIAG_KEYSETS_H

#include "diag.h"

#define KS_MAX 64                /* candidates at once */
#define KS_NEAR 8                /* positions after p tried one by one */
#define KS_LAYERS 5              /* layers scored: l, the next of its kind, one of each other */
#define KS_ALL INT64_MAX         /* a window of every key */

/* Layers a candidate changes: the divergent one, every layer of its
 * window kind (every sliding layer, or every global one), every layer.
 * The families of one key (left out, read twice) and of the own key are
 * tried in all three (a bug of one layer's code: a first-layer special
 * case, a shared layer); a narrower scope predicts the config's keys on
 * the layers it leaves out, so the scoring verifies it there too, and a
 * wide cause that holds refutes it on them. */
typedef enum { SCOPE_LAYER, SCOPE_KIND, SCOPE_ALL } ks_scope;

typedef struct {
    cmp_diag_kind kind;
    int64_t n;                   /* WINDOW, LAYER_TYPE: keys read (KS_ALL: every key);
                                  * MISSING_KEY, DUP_KEY: the key; PADDED_SLOTS,
                                  * EXTRA_KEY: zero slots (variant 1: the cache's size);
                                  * DECODE_STUCK: the slot decode writes;
                                  * CHUNK_ISOLATED, FUTURE_KEYS: the chunk */
    int variant;
    ks_scope scope;
    int64_t from;                /* the first position it changes (a bug of the decode
                                  * path, or one that began at p) */
    double err_p;
    bool alive;
    int places;                  /* places it reproduced */
    int misses;                  /* places on the divergent layer it did not reproduce,
                                  * where nothing tried did */
    int misses_other;            /* the same on other layers (their cause may lie
                                  * beyond what the recordings hold) */
    int64_t miss_pos;            /* the first of them on the divergent layer (-1 none) */
    int64_t last_pos;            /* the last position it reproduced */
    int fail_layer;
    int64_t fail_pos, fail_n, fail_test_n;
    double fail_err;             /* -1: refuted by the positions before p */
    bool merged;                 /* the same predictions as an earlier candidate */
    /* Across runtimes, the first place before p (walk order) where its
     * keys differ from the config's and reproduce the test's rows, drift
     * though the config's keys left there: where the bug first acts
     * (act_pos -1 none); act_err what its keys leave there, act_cfg_err
     * what the config's do. */
    int64_t act_pos;
    int act_layer;
    double act_err, act_cfg_err;
    char what[160];              /* its key set at p */
} ks_cand;

typedef struct {
    ks_cand k[KS_MAX];
    int n;
    int layers[KS_LAYERS];       /* layers scored, l first */
    int nl;
    int64_t last[KS_LAYERS];     /* the last position each holds (-1 none) */
    int64_t unrec_pos;           /* a place that would separate survivors, not recorded */
    int unrec_layer;
    int none_fit;                /* places where no candidate fit */
    int64_t none_pos;            /* the first of them (-1 none) */
    int64_t alike_pos;           /* the first place where survivors read different keys
                                  * and fit alike (-1 none) */
    int alike_layer;
    int none_layer;
    bool counts_only;            /* attention cannot be recomputed: key counts alone */
    bool used_counts;            /* some place was judged by its key count alone */
    bool trace;                  /* KVDIFF_DIAG_TRACE: every place scored, to stderr */
    char scope_open[128];        /* a narrower scope folded into a wider one that no
                                  * place tried tells apart: its words ("" none) */
    int nscored;                 /* places scored, so that none is scored twice */
    int scored_layer[256];
    int64_t scored_pos[256];
} ks_run;

/* --- keyfams.c: the families --- */

/* First key a window of W allows at q (W <= 0: none, 0). */
int64_t ks_window_lo(int W, int64_t q);
/* First position of q's chunk: prefill chunks of C, decode steps of one. */
int64_t ks_chunk_start(int64_t p, int64_t P, int64_t C);
/* The key set candidate k predicts at (layer, q): the config's where it
 * changes nothing there. False where it predicts nothing at all. */
bool ks_keys(const cmp_ctx *c, const dg_case *a, const ks_cand *k, int layer, int64_t q,
             cmp_hyp *h);
/* Whether two key sets read the same keys. */
bool ks_hyp_same(const cmp_hyp *x, const cmp_hyp *y);
/* k->what: its key set at p, in words. */
void ks_describe(const cmp_ctx *c, const dg_case *a, ks_cand *k);
/* Adds a candidate (changing positions from `from` on) unless one alike is
 * there. */
void ks_add_from(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope,
                 int64_t from);
void ks_add(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope);
/* Every cause worth trying at p, from the evidence there. 0, -1 on error. */
int ks_propose(cmp_ctx *c, dg_case *a, ks_run *run, kv_err *e);
/* A few words for a kind, to name candidates side by side. */
const char *ks_phrase(cmp_diag_kind k);
/* The cache the test's settings name ("split", "dense", "ring"), or NULL. */
const char *ks_cache_named(const cmp_ctx *c);
/* The cause (summary) and parameters (detail) of the one survivor; layers:
 * those read otherwise than the config (n_other of them). */
void ks_survivor_text(cmp_ctx *c, const dg_case *a, const ks_cand *k, const char *layers,
                      int n_other);
/* Whether candidates of kind k are proposed in every scope (every layer,
 * the layer's kind, the layer alone) and named with theirs: a cause that
 * may live in one layer's code (one key left out or read twice, the own
 * key masked, chunks isolated, decode blind to the prefill, the causal
 * mask missing, a stale sliding cache, a ring that does not wrap). */
bool ks_scoped_kind(cmp_diag_kind k);
/* Whether kind k lives on the sliding layers by its nature (a stale
 * sliding cache, a ring): its widest scope is every sliding layer, and
 * its phrase says so. */
bool ks_sliding_kind(cmp_diag_kind k);
/* " on layer 0 only", " on the sliding layers only", or "" (every layer,
 * or a kind the model alone has): the scope of a scoped kind's candidate,
 * in words. */
void ks_scope_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n);
/* ", 7 keys on every sliding layer": what tells k from others of its kind. */
void ks_param_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n);

#endif
