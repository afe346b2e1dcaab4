/* chunked.h — the chunked / cascade engine: what real runtimes do.
 *
 * The prompt is prefilled in chunks of C tokens (the last may be short),
 * then tokens are decoded one at a time. The KV cache is one of:
 *   dense  one preallocated buffer per layer sized for the whole context;
 *          attention runs over every slot with a validity mask (fixed
 *          shapes, the MaxText/JAX style);
 *   split  a preallocated prefill cache and a separate decode cache per
 *          layer, read together under "position < prefill length" and
 *          "decode slot < decode index" masks;
 *   ring   sliding layers keep window + C slots written modulo their size
 *          (memory independent of the context); global layers are dense.
 * KV-shared layers compute no K/V and read their owner's (see chk_share_kind).
 *
 * With exact attention keys are visited in ascending absolute position
 * whatever the layout, so every strategy and chunk size gives the
 * reference's bits. Cascade attention merges a prefix and a chunk partial
 * softmax by log-sum-exp: close, not identical, on purpose.
 *
 * Fault injections reproduce cache bugs seen in real ports; the catalogue
 * (names, one-line help, applicability) is in this module too. */
#ifndef KV_CHUNKED_H
#define KV_CHUNKED_H

#include <stdbool.h>
#include "../model/observer.h"
#include "../model/engine.h"
#include "../model/kernels.h"
#include "../model/model.h"

typedef enum { CACHE_DENSE, CACHE_SPLIT, CACHE_RING, CACHE_KIND_COUNT } chk_cache_kind;
typedef enum { CHK_ATTN_EXACT, CHK_ATTN_CASCADE } chk_attn_kind;
/* How KV-shared layers get their owner's K/V:
 *   plain            each follower keeps its own cache, written with the
 *                    owner's K/V whenever the owner writes;
 *   padded           followers read the owner's cache, stored with head_dim
 *                    padded to a multiple of share_pad and sliced back;
 *   owner-read-only  followers have no storage: they read the owner's
 *                    accumulated history through the key list the owner
 *                    built for the chunk, and never write. */
typedef enum { SHARE_PLAIN, SHARE_PADDED, SHARE_OWNER_READ_ONLY, SHARE_KIND_COUNT } chk_share_kind;

typedef enum {
    INJ_ISOLATED_CHUNKS,
    INJ_ISOLATED_CHUNKS_POS,
    INJ_WINDOW,
    INJ_STALE_LOCAL,
    INJ_ZERO_SHARED_KV,
    INJ_SPLIT_MASK_OFF_BY_ONE,
    INJ_DECODE_INDEX_STUCK,
    INJ_ROPE_OFFSET,
    INJ_RING_NO_WRAP,
    INJ_SPLIT_DECODE_BLIND,
    INJ_DROP_KEY,
    INJ_OWN_KEY_MASKED,
    INJ_ISOLATED_LAYER,
    INJ_SINK_DROPPED,
    INJ_SINK_PREFILL_ONLY,
    INJ_SINK_WINDOWED,
    INJ_MLA_ROPE_TWICE,
    INJ_MLA_ROPE_UNCACHED,
    INJ_MLA_NO_MSCALE,
    INJ_MLA_MIXED_FORMS,
    INJ_COUNT
} chk_injection;

typedef struct {
    bool on[INJ_COUNT];
    int window;         /* window=N */
    int rope_offset;    /* rope-offset=N */
    int drop_key;       /* drop-key=K[@L]: key K, read by no query after it */
    int drop_layer;     /*   ... on layer L alone (-1: every layer) */
    int own_from;       /* own-key-masked=F[@L]: queries from F on skip their own key */
    int own_layer;      /*   ... on layer L alone (-1: every layer) */
    int iso_layer;      /* isolated-layer=L: chunks attend only to themselves on L alone */
    int stale_layer;    /* stale-local[@L]: on sliding layer L alone (-1: every sliding one) */
    int ring_layer;     /* ring-no-wrap[@L]: on sliding layer L alone (-1: every sliding one) */
    int sink_layer;     /* sink-dropped[@L]: on layer L alone (-1: every layer) */
} chk_injections;

typedef struct {
    int chunk;              /* C >= 1 prompt tokens per prefill step */
    chk_cache_kind cache;
    chk_attn_kind attn;
    chk_share_kind share;
    int share_pad;          /* SHARE_PADDED: head_dim rounded up to a multiple of this */
    int max_ctx;            /* positions the caches are sized for */
    bool mla_absorbed;      /* MLA: decode steps run the absorbed form (model/mla.h); else
                               every step expands the cached latents (bit-identical to the
                               reference) */
    chk_injections inj;
} chk_opts;

/* Defaults: chunk 16, dense, exact, plain sharing, pad 64, no injection. */
void chk_opts_default(chk_opts *o);

/* Checks options against the model (chunk range, injections that apply).
 * Errors say what does not apply and why. */
int chk_opts_check(const chk_opts *o, const kv_config *c, kv_err *e);

/* The model, context and observer must outlive the engine. */
kv_engine *chk_create(const kv_model *m, const kern_ctx *kc, const chk_opts *o,
                      kv_observer *obs, kv_err *e);

/* Cache bytes held for layers of one attention type (ATTN_SLIDING or
 * ATTN_GLOBAL), every layer that has storage, snapshots included. */
size_t chk_cache_bytes_of(const kv_engine *eng, kv_attn_type type);

/* --- the injection catalogue --- */
const char *chk_injection_name(chk_injection i);
const char *chk_injection_help(chk_injection i);
/* Parses "NAME" or "NAME=VALUE" into inj (several calls accumulate). */
int chk_injection_parse(const char *spec, chk_injections *inj, kv_err *e);
/* "isolated-chunks,window=512" for reports; "none" when empty. */
void chk_injections_describe(const chk_injections *inj, char *buf, size_t n);

const char *chk_cache_name(chk_cache_kind k);
int chk_cache_parse(const char *s, chk_cache_kind *out);
const char *chk_share_name(chk_share_kind k);
int chk_share_parse(const char *s, chk_share_kind *out);

#endif
