/* chunked.c — the chunked / cascade engine and its cache strategies
 * (chunked.h). The layer math is model/forward.c, shared with the
 * reference; this file owns only where K/V live and which keys each query
 * reads — which is exactly where real runtimes go wrong. */
#include "chunked.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/forward.h"
#include "../model/mla.h"

/* One cache buffer: live storage, and for stale-local the two copies. */
typedef struct {
    float *k, *v;            /* (nslots, stride) live storage */
    float *snap_k, *snap_v;  /* stale-local: live state before the previous chunk wrote */
    float *read_k, *read_v;  /* what attention reads: k, v, or the stale copy */
    int nslots;
} kv_buf;

typedef struct {
    kv_buf main;             /* dense / ring: the cache; split: the prefill cache */
    kv_buf dec;              /* split: the decode cache */
    bool ring;               /* slot = position % main.nslots */
    bool stale;              /* stale-local applies to this layer */
} layer_cache;

/* The keys a layer may read in the current chunk, in ascending believed
 * position, as contiguous rows of KV*D floats. */
typedef struct {
    int n, cap;
    int64_t *pos;
    uint8_t *valid;
    const float **k, **v;
    float *unpad;            /* (2 cap, KV*D) padded rows sliced back to D */
} cand_list;

typedef struct {
    kv_engine base;
    const kv_model *m;
    const kern_ctx *kc;
    kv_observer *obs;
    chk_opts o;
    int pad;                 /* heads are stored padded to a multiple of pad (1: none) */
    int64_t pos;             /* next absolute position */
    int64_t prefill_len;     /* tokens of the first forward() call; -1 before it */
    int decode_count;        /* decode tokens written so far */
    layer_cache *caches;     /* (L); owners, and followers under SHARE_PLAIN */
    cand_list *cands;        /* (L) */
    float *zero_row;         /* (KV*D) zero-shared-kv */
    fw_state fw;
    int64_t *rope_pos;       /* (chunk) */
    uint8_t *mask;           /* (chunk, cand cap) */
    int mask_cap;
    int *nkeys;              /* (chunk) */
    float *att2, *lse2;      /* cascade: the chunk's own partial */
    float *logits;           /* (chunk, V) */
    /* MLA: the candidates' expanded keys and values, or the absorbed
     * queries and outputs (model/mla.h) */
    int mla_cap, mla_rows;   /* candidates / rows the buffers hold */
    float *mla_k, *mla_v;    /* (mla_cap, H*D) */
    const float **mla_kp, **mla_vp; /* (mla_cap) */
    const float **mla_lat;   /* (mla_cap) the latent rows attention reads */
    float *mla_scratch;
    float *mla_qa, *mla_o, *mla_o2, *mla_lse2; /* (rows, H*(R+dr)), (rows, H) */
    float *mla_zero;         /* (R+dr) */
    float *mla_tmp_row;      /* (R+dr) */
} chk_engine;

/* Layer l's cached heads as stored: KV heads of D (Gemma 4's full and
 * sliding layers differ; MLA: one row of the latent and the key tail),
 * floats per head as stored (padded under --kv-share padded) and per
 * stored row. */
static bool mla(const chk_engine *c) { return config_mla(&c->m->cfg); }
static int head_dim(const chk_engine *c, int l)
{
    return mla(c) ? config_mla_row(&c->m->cfg) : config_layer_head_dim(&c->m->cfg, l);
}
static int kv_heads(const chk_engine *c, int l)
{
    return mla(c) ? 1 : config_layer_kv_heads(&c->m->cfg, l);
}
static int kv_floats(const chk_engine *c, int l) { return kv_heads(c, l) * head_dim(c, l); }
static int head_stored(const chk_engine *c, int l)
{
    return (head_dim(c, l) + c->pad - 1) / c->pad * c->pad;
}
static int row_stride(const chk_engine *c, int l) { return kv_heads(c, l) * head_stored(c, l); }

/* ------------------------------------------------------------------ */
/* Windows and phases                                                   */

static int eff_window(const chk_engine *c, int layer)
{
    int w = config_layer_window(&c->m->cfg, layer);
    if (w > 0 && c->o.inj.on[INJ_WINDOW])
        w = c->o.inj.window;
    return w;
}

static bool in_decode(const chk_engine *c, int64_t p) { return p >= c->prefill_len; }

/* Rows of layer l (positions s .. s + n - 1) whose softmax an injected
 * sink bug leaves the sink out of. */
static void sink_injections(chk_engine *c, int l, int64_t s, int n)
{
    const chk_injections *inj = &c->o.inj;
    fw_state *fs = &c->fw;
    fs->sink_off_any = false;
    if (!c->m->cfg.attn_sinks)
        return;
    const int W = config_layer_window(&c->m->cfg, l);
    for (int r = 0; r < n; r++) {
        const int64_t p = s + r;
        const bool off = (inj->on[INJ_SINK_DROPPED] && (inj->sink_layer < 0 || inj->sink_layer == l))
                      || (inj->on[INJ_SINK_PREFILL_ONLY] && in_decode(c, p))
                      || (inj->on[INJ_SINK_WINDOWED] && W > 0 && p >= W);
        fs->sink_off[r] = off;
        fs->sink_off_any |= off;
    }
}

static bool isolated(const chk_engine *c)
{
    return c->o.inj.on[INJ_ISOLATED_CHUNKS] || c->o.inj.on[INJ_ISOLATED_CHUNKS_POS];
}

/* ------------------------------------------------------------------ */
/* Buffers                                                              */

/* with_v false: keys only (MLA's latent rows are keys and values alike). */
static int buf_init(kv_buf *b, int nslots, int stride, bool stale, bool with_v)
{
    size_t n = (size_t)nslots * (size_t)stride;
    b->nslots = nslots;
    b->k = calloc(n, sizeof(float));
    b->v = with_v ? calloc(n, sizeof(float)) : NULL;
    if (!b->k || (with_v && !b->v))
        return -1;
    b->read_k = b->k;
    b->read_v = b->v;
    if (stale) {
        b->snap_k = calloc(n, sizeof(float));
        b->read_k = calloc(n, sizeof(float));
        if (with_v) {
            b->snap_v = calloc(n, sizeof(float));
            b->read_v = calloc(n, sizeof(float));
        }
        if (!b->snap_k || !b->read_k || (with_v && (!b->snap_v || !b->read_v)))
            return -1;
    }
    return 0;
}

static void buf_free(kv_buf *b)
{
    if (b->read_k != b->k) {
        free(b->read_k);
        free(b->read_v);
    }
    free(b->k);
    free(b->v);
    free(b->snap_k);
    free(b->snap_v);
    memset(b, 0, sizeof *b);
}

static size_t buf_bytes(const kv_buf *b, int stride)
{
    size_t copies = b->snap_k ? 3 : 1, kinds = b->v ? 2 : 1;
    return copies * kinds * (size_t)b->nslots * (size_t)stride * sizeof(float);
}

/* stale-local: attention in this chunk reads the state from before the
 * previous chunk wrote; remember the state from before this one writes. */
static void buf_begin_chunk(kv_buf *b, int stride)
{
    if (!b->snap_k || !b->nslots)
        return;
    size_t bytes = (size_t)b->nslots * (size_t)stride * sizeof(float);
    memcpy(b->read_k, b->snap_k, bytes);
    memcpy(b->snap_k, b->k, bytes);
    if (b->v) {
        memcpy(b->read_v, b->snap_v, bytes);
        memcpy(b->snap_v, b->v, bytes);
    }
}

/* Stores one K/V row (KV heads of D floats) at slot, padding each head to
 * dp floats; the stale read copy sees the chunk's own writes. */
static void buf_store(kv_buf *b, int slot, const chk_engine *c, int layer, const float *k,
                      const float *v)
{
    const int KV = kv_heads(c, layer), D = head_dim(c, layer), dp = head_stored(c, layer);
    const int stride = row_stride(c, layer);
    float *dst[4] = {b->k, b->v, b->read_k != b->k ? b->read_k : NULL,
                     b->read_v != b->v ? b->read_v : NULL};   /* v NULL: keys only */
    const float *src[4] = {k, v, k, v};
    for (int t = 0; t < 4; t++) {
        if (!dst[t])
            continue;
        float *row = dst[t] + (size_t)slot * stride;
        for (int h = 0; h < KV; h++) {
            memcpy(row + (size_t)h * dp, src[t] + (size_t)h * D, (size_t)D * sizeof(float));
            memset(row + (size_t)h * dp + D, 0, (size_t)(dp - D) * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------ */
/* Writing a chunk's K/V                                                */

static bool has_storage(const chk_engine *c, int layer)
{
    return c->caches[layer].main.nslots > 0;
}

static void store_row(chk_engine *c, int layer, int64_t p, const float *k, const float *v)
{
    layer_cache *lc = &c->caches[layer];
    const bool decode = in_decode(c, p);
    const bool stuck = decode && c->o.inj.on[INJ_DECODE_INDEX_STUCK];
    /* A stuck decode index keeps writing where the first decode token went. */
    int64_t pw = stuck ? c->prefill_len : p;

    if (c->o.cache == CACHE_SPLIT) {
        if (!decode)
            buf_store(&lc->main, (int)p, c, layer, k, v);
        else
            buf_store(&lc->dec, stuck ? 0 : (int)(p - c->prefill_len), c, layer, k, v);
        return;
    }
    if (lc->ring) {
        if (c->o.inj.on[INJ_RING_NO_WRAP] && pw >= lc->main.nslots &&
            (c->o.inj.ring_layer < 0 || c->o.inj.ring_layer == layer))
            return; /* the bug: a full ring stops taking writes */
        buf_store(&lc->main, (int)(pw % lc->main.nslots), c, layer, k, v);
        return;
    }
    buf_store(&lc->main, (int)pw, c, layer, k, v);
}

/* ------------------------------------------------------------------ */
/* Building the key list                                                */

static int cand_reserve(cand_list *cl, int n)
{
    if (cl->cap >= n)
        return 0;
    free(cl->pos);
    free(cl->valid);
    free(cl->k);
    free(cl->v);
    cl->cap = n;
    cl->pos = malloc((size_t)n * sizeof *cl->pos);
    cl->valid = malloc((size_t)n);
    cl->k = malloc((size_t)n * sizeof *cl->k);
    cl->v = malloc((size_t)n * sizeof *cl->v);
    return (cl->pos && cl->valid && cl->k && cl->v) ? 0 : -1;
}

static void cand_add(cand_list *cl, int64_t pos, bool valid, const float *k, const float *v)
{
    cl->pos[cl->n] = pos;
    cl->valid[cl->n] = valid;
    cl->k[cl->n] = k;
    cl->v[cl->n] = v;
    cl->n++;
}

static const float *slot_row(const float *base, int slot, int stride)
{
    return base + (size_t)slot * stride;
}

/* Candidates of `layer` for a chunk ending before position hi, read from
 * the cache of its owner. */
static void cand_build(chk_engine *c, int layer, int64_t s, int64_t hi, cand_list *cl)
{
    /* A follower with a cache of its own reads it; else its owner's. */
    const int src = has_storage(c, layer) ? layer : c->m->cfg.kv_owner[layer];
    const layer_cache *lc = &c->caches[src];
    const kv_buf *b = &lc->main;
    const int st = row_stride(c, src);
    /* A keys-only cache (MLA) gives its rows as values too. */
    const float *bv = b->read_v ? b->read_v : b->read_k;
    const float *dv = lc->dec.read_v ? lc->dec.read_v : lc->dec.read_k;
    cl->n = 0;
    if (c->o.cache == CACHE_DENSE) {
        /* Fixed shape: every slot, valid once written. */
        for (int j = 0; j < b->nslots; j++)
            cand_add(cl, j, j < hi, slot_row(b->read_k, j, st), slot_row(bv, j, st));
    } else if (c->o.cache == CACHE_SPLIT) {
        int64_t lim = c->prefill_len + (c->o.inj.on[INJ_SPLIT_MASK_OFF_BY_ONE] ? 1 : 0);
        /* The bug: decode builds its key list from the decode cache alone. */
        if (c->o.inj.on[INJ_SPLIT_DECODE_BLIND] && in_decode(c, s))
            lim = 0;
        for (int j = 0; j < b->nslots; j++)
            cand_add(cl, j, j < lim, slot_row(b->read_k, j, st), slot_row(bv, j, st));
        const kv_buf *d = &lc->dec;
        for (int j = 0; j < d->nslots; j++)
            cand_add(cl, c->prefill_len + j, j < c->decode_count,
                     slot_row(d->read_k, j, st), slot_row(dv, j, st));
    } else if (lc->ring) {
        int w = eff_window(c, layer);
        int64_t lo = s - w + 1 > 0 ? s - w + 1 : 0;
        for (int64_t p = lo; p < hi; p++) {
            int slot = (int)(p % b->nslots);
            cand_add(cl, p, true, slot_row(b->read_k, slot, st), slot_row(bv, slot, st));
        }
    } else {
        for (int64_t p = 0; p < hi; p++)
            cand_add(cl, p, true, slot_row(b->read_k, (int)p, st), slot_row(bv, (int)p, st));
    }
}

/* Rows stored with padded heads are sliced back to D floats per head. */
static int cand_unpad(chk_engine *c, int layer, cand_list *cl, kv_err *e)
{
    const int KV = kv_heads(c, layer), D = head_dim(c, layer), kvf = kv_floats(c, layer);
    const int dp = head_stored(c, layer);
    if (dp == D)
        return 0;
    if (!cl->unpad) {
        cl->unpad = malloc((size_t)2 * cl->cap * kvf * sizeof(float));
        if (!cl->unpad)
            return kv_errf(e, "out of memory for %d padded keys", cl->cap);
    }
    for (int j = 0; j < cl->n; j++) {
        float *kd = cl->unpad + (size_t)(2 * j) * kvf, *vd = kd + kvf;
        for (int h = 0; h < KV; h++) {
            memcpy(kd + h * D, cl->k[j] + (size_t)h * dp, (size_t)D * sizeof(float));
            memcpy(vd + h * D, cl->v[j] + (size_t)h * dp, (size_t)D * sizeof(float));
        }
        cl->k[j] = kd;
        cl->v[j] = vd;
    }
    return 0;
}

/* Which candidates row r (position s + r) reads; part selects cascade's
 * prefix (-1: positions < s), chunk (+1: >= s) or all (0). */
static void build_mask(chk_engine *c, int layer, const cand_list *cl, int64_t s, int n,
                       int part)
{
    const int w = eff_window(c, layer);
    const bool iso = isolated(c) ||
                     (c->o.inj.on[INJ_ISOLATED_LAYER] && c->o.inj.iso_layer == layer);
    for (int r = 0; r < n; r++) {
        const int64_t i = s + r;
        uint8_t *mr = c->mask + (size_t)r * cl->n;
        for (int j = 0; j < cl->n; j++) {
            int64_t p = cl->pos[j];
            bool ok = cl->valid[j] && p <= i;
            if (w > 0)
                ok = ok && p > i - w;
            if (iso)
                ok = ok && p >= s;
            if (c->o.inj.on[INJ_DROP_KEY] && p == c->o.inj.drop_key && i > p &&
                (c->o.inj.drop_layer < 0 || c->o.inj.drop_layer == layer))
                ok = false;
            if (c->o.inj.on[INJ_OWN_KEY_MASKED] && p == i && i >= c->o.inj.own_from &&
                (c->o.inj.own_layer < 0 || c->o.inj.own_layer == layer))
                ok = false;
            if (part < 0)
                ok = ok && p < s;
            else if (part > 0)
                ok = ok && p >= s;
            mr[j] = ok;
        }
    }
}

static int count_keys(const chk_engine *c, const cand_list *cl, int r)
{
    const uint8_t *mr = c->mask + (size_t)r * cl->n;
    int k = 0;
    for (int j = 0; j < cl->n; j++)
        k += mr[j];
    return k;
}

/* ------------------------------------------------------------------ */
/* Attention of one layer over one chunk                                */

static int ensure_mask(chk_engine *c, int n, int ncand, kv_err *e)
{
    if (c->mask_cap >= n * ncand)
        return 0;
    free(c->mask);
    c->mask_cap = n * ncand;
    c->mask = malloc((size_t)c->mask_cap);
    return c->mask ? 0 : kv_errf(e, "out of memory for the attention mask");
}

/* Exact attention, or cascade's two partials (the cached prefix, the
 * chunk itself) merged, of n query rows over the candidates cl (whose rows
 * are kr, vr) into out, lse; out2, lse2: cascade's scratch. */
static int run_attention(chk_engine *c, int layer, const cand_list *cl, int64_t s, int n,
                         const float *q, int H, int KV, int D, float scale,
                         const float *const *kr, const float *const *vr, float *out,
                         float *lse, float *out2, float *lse2, kv_err *e)
{
    const kern_ctx *kc = c->kc;
    if (c->o.attn == CHK_ATTN_EXACT) {
        build_mask(c, layer, cl, s, n, 0);
        if (kern_attention_masked(kc, n, q, H, KV, D, scale, kr, vr, cl->n, c->mask, out,
                                  lse) < 0)
            return kv_errf(e, "out of memory in attention");
        for (int r = 0; r < n; r++)
            c->nkeys[r] = count_keys(c, cl, r);
        return 0;
    }
    build_mask(c, layer, cl, s, n, -1);
    for (int r = 0; r < n; r++)
        c->nkeys[r] = count_keys(c, cl, r);
    if (kern_attention_masked(kc, n, q, H, KV, D, scale, kr, vr, cl->n, c->mask, out, lse) < 0)
        return kv_errf(e, "out of memory in attention");
    build_mask(c, layer, cl, s, n, +1);
    for (int r = 0; r < n; r++)
        c->nkeys[r] += count_keys(c, cl, r);
    if (kern_attention_masked(kc, n, q, H, KV, D, scale, kr, vr, cl->n, c->mask, out2,
                              lse2) < 0)
        return kv_errf(e, "out of memory in attention");
    kern_lse_merge(n, H, D, out, lse, out2, lse2);
    return 0;
}

/* ------------------------------------------------------------------ */
/* MLA: the latent cache                                                */

/* What the cache keeps of the row computed at position p: the row itself,
 * or (injected bugs) its key tail rotated a second time, or zeroed. */
static const float *mla_cache_row(chk_engine *c, int64_t p, const float *row)
{
    const kv_config *cfg = &c->m->cfg;
    const int R = cfg->kv_lora_rank, dr = cfg->qk_rope_dim, W = R + dr;
    if (!c->o.inj.on[INJ_MLA_ROPE_TWICE] && !c->o.inj.on[INJ_MLA_ROPE_UNCACHED])
        return row;
    float *t = c->mla_tmp_row;
    memcpy(t, row, (size_t)W * sizeof(float));
    if (c->o.inj.on[INJ_MLA_ROPE_UNCACHED]) {
        memset(t + R, 0, (size_t)dr * sizeof(float));
        return t;
    }
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2];
    const fw_state *fs = &c->fw;
    /* The rotation of set_rope_positions' position p, once more. */
    int64_t rp = p;
    if (c->o.inj.on[INJ_ROPE_OFFSET] && in_decode(c, p))
        rp += c->o.inj.rope_offset;
    if (fs->rope_mscale_global == 1.0)
        kern_rope_table((double)rp, fs->inv_freq_global, dr, cs, sn);
    else
        kern_rope_table_scaled((double)rp, fs->inv_freq_global, dr, fs->rope_mscale_global, cs,
                               sn);
    kern_rope_apply_pairs(t + R, 1, W, dr / 2, cs, sn);
    return t;
}

static int mla_reserve(chk_engine *c, int ncand, int n, kv_err *e)
{
    const kv_config *cfg = &c->m->cfg;
    const size_t HD = (size_t)cfg->n_heads * cfg->head_dim;
    const size_t HW = (size_t)cfg->n_heads * config_mla_row(cfg);
    if (ncand > c->mla_cap) {
        free(c->mla_k);
        free(c->mla_v);
        free(c->mla_kp);
        free(c->mla_vp);
        free(c->mla_lat);
        c->mla_cap = ncand;
        c->mla_k = malloc((size_t)ncand * HD * sizeof(float));
        c->mla_v = malloc((size_t)ncand * HD * sizeof(float));
        c->mla_kp = malloc((size_t)ncand * sizeof *c->mla_kp);
        c->mla_vp = malloc((size_t)ncand * sizeof *c->mla_vp);
        c->mla_lat = malloc((size_t)ncand * sizeof *c->mla_lat);
        free(c->mla_scratch);
        c->mla_scratch = NULL;
    }
    if (n > c->mla_rows) {
        free(c->mla_qa);
        free(c->mla_o);
        free(c->mla_o2);
        free(c->mla_lse2);
        free(c->mla_scratch);
        c->mla_scratch = NULL;
        c->mla_rows = n;
        c->mla_qa = malloc((size_t)n * HW * sizeof(float));
        c->mla_o = malloc((size_t)n * HW * sizeof(float));
        c->mla_o2 = malloc((size_t)n * HW * sizeof(float));
        c->mla_lse2 = malloc((size_t)n * cfg->n_heads * sizeof(float));
    }
    if (!c->mla_scratch) {
        size_t a = mla_expand_scratch(cfg, c->mla_cap), b = mla_absorb_scratch(cfg, c->mla_rows);
        c->mla_scratch = malloc((a > b ? a : b) * sizeof(float));
    }
    if (!c->mla_k || !c->mla_v || !c->mla_kp || !c->mla_vp || !c->mla_lat || !c->mla_qa ||
        !c->mla_o || !c->mla_o2 || !c->mla_lse2 || !c->mla_scratch)
        return kv_errf(e, "out of memory for the latent attention of %d keys", ncand);
    return 0;
}

/* MLA attention of one layer over one chunk (model/mla.h). The latent
 * rows are the candidates' keys; expanded, each goes through kv_b_proj
 * (the reference's bits), absorbed the query and the output do. */
static int mla_attention(chk_engine *c, int layer, int64_t s, int n, const cand_list *cl,
                         kv_err *e)
{
    const kv_config *cfg = &c->m->cfg;
    const chk_injections *inj = &c->o.inj;
    fw_state *fs = &c->fw;
    const int H = cfg->n_heads, D = cfg->head_dim, W = config_mla_row(cfg);
    const bool decode = in_decode(c, s);
    const bool absorbed = decode && (c->o.mla_absorbed || inj->on[INJ_MLA_NO_MSCALE] ||
                                     inj->on[INJ_MLA_MIXED_FORMS]);
    if (mla_reserve(c, cl->n, n, e) < 0)
        return -1;
    for (int j = 0; j < cl->n; j++) {
        const int64_t p = cl->pos[j];
        c->mla_lat[j] = cl->k[j];
        /* The bug: the tail is not cached; this chunk's own keys still
         * carry theirs (computed, not read back). */
        if (inj->on[INJ_MLA_ROPE_UNCACHED] && p >= s && p < s + n)
            c->mla_lat[j] = fs->lat + (size_t)(p - s) * W;
        /* The bug: prefill never filled the latent cache decode reads. */
        if (inj->on[INJ_MLA_MIXED_FORMS] && decode && p < c->prefill_len)
            c->mla_lat[j] = c->mla_zero;
    }
    if (!absorbed) {
        mla_expand(c->kc, c->m, layer, c->mla_lat, cl->n, c->mla_k, c->mla_v, c->mla_scratch);
        for (int j = 0; j < cl->n; j++) {
            c->mla_kp[j] = c->mla_k + (size_t)j * H * D;
            c->mla_vp[j] = c->mla_v + (size_t)j * H * D;
        }
        return run_attention(c, layer, cl, s, n, fs->q, H, H, D, (float)cfg->attn_scale,
                             c->mla_kp, c->mla_vp, fs->att, fs->lse, c->att2, c->lse2, e);
    }
    /* The bug: absorbed decode without YaRN's mscale_all_dim correction. */
    const float scale = inj->on[INJ_MLA_NO_MSCALE] ? (float)(1.0 / sqrt((double)D))
                                                  : (float)cfg->attn_scale;
    mla_absorb_q(c->kc, c->m, layer, fs->q, n, c->mla_qa, c->mla_scratch);
    if (run_attention(c, layer, cl, s, n, c->mla_qa, H, 1, W, scale, c->mla_lat, c->mla_lat,
                      c->mla_o, fs->lse, c->mla_o2, c->mla_lse2, e) < 0)
        return -1;
    mla_absorb_out(c->kc, c->m, layer, c->mla_o, n, fs->att, c->mla_scratch);
    return 0;
}

static int layer_attention(chk_engine *c, int layer, int64_t s, int n, kv_err *e)
{
    const kv_config *cfg = &c->m->cfg;
    const int owner = cfg->kv_owner[layer];
    const bool follower = owner != layer;
    fw_state *fs = &c->fw;
    cand_list *cl = &c->cands[layer];

    if (follower && c->o.share == SHARE_OWNER_READ_ONLY && !c->o.inj.on[INJ_ZERO_SHARED_KV]) {
        /* Reuse the list the owner built in this chunk (already unpadded). */
        cl = &c->cands[owner];
    } else {
        cand_build(c, layer, s, s + n, cl);
        if (cand_unpad(c, layer, cl, e) < 0)
            return -1;
        if (follower && c->o.inj.on[INJ_ZERO_SHARED_KV])
            for (int j = 0; j < cl->n; j++)
                cl->k[j] = cl->v[j] = c->zero_row;
    }
    if (ensure_mask(c, n, cl->n, e) < 0)
        return -1;
    if (mla(c))
        return mla_attention(c, layer, s, n, cl, e);
    return run_attention(c, layer, cl, s, n, fs->q, cfg->n_heads, kv_heads(c, layer),
                         head_dim(c, layer), (float)cfg->attn_scale,
                         (const float *const *)cl->k, (const float *const *)cl->v, fs->att,
                         fs->lse, c->att2, c->lse2, e);
}

/* ------------------------------------------------------------------ */
/* One chunk through every layer                                        */

/* The per-chunk buffers, sized for fw.cap rows. */
static void rows_free(chk_engine *c)
{
    fw_state_free(&c->fw);
    free(c->rope_pos);
    free(c->nkeys);
    free(c->att2);
    free(c->lse2);
    free(c->logits);
}

static int ensure_rows(chk_engine *c, int n, kv_err *e)
{
    if (c->fw.cap >= n)
        return 0;
    const kv_config *cfg = &c->m->cfg;
    rows_free(c);
    c->rope_pos = malloc((size_t)n * sizeof *c->rope_pos);
    c->nkeys = malloc((size_t)n * sizeof *c->nkeys);
    c->att2 = malloc((size_t)n * config_max_q_width(cfg) * sizeof(float));
    c->lse2 = malloc((size_t)n * cfg->n_heads * sizeof(float));
    c->logits = malloc((size_t)n * cfg->vocab * sizeof(float));
    if (!c->rope_pos || !c->nkeys || !c->att2 || !c->lse2 || !c->logits)
        return kv_errf(e, "out of memory for a chunk of %d rows", n);
    return fw_state_init(&c->fw, c->m, n, e);
}

static void set_rope_positions(chk_engine *c, int64_t s, int n)
{
    for (int r = 0; r < n; r++) {
        int64_t p = s + r, rp = p;
        if (c->o.inj.on[INJ_ISOLATED_CHUNKS_POS])
            rp = p - s;
        if (c->o.inj.on[INJ_ROPE_OFFSET] && in_decode(c, p))
            rp += c->o.inj.rope_offset;
        c->rope_pos[r] = rp;
    }
}

static int chunk_forward(chk_engine *c, const int32_t *tokens, int n, bool last, float *logits,
                     kv_err *e)
{
    const kv_config *cfg = &c->m->cfg;
    const int64_t s = c->pos;
    kv_observer *obs = c->obs;
    fw_state *fs = &c->fw;

    if (ensure_rows(c, n, e) < 0)
        return -1;
    set_rope_positions(c, s, n);
    for (int l = 0; l < cfg->n_layers; l++) {
        buf_begin_chunk(&c->caches[l].main, row_stride(c, l));
        buf_begin_chunk(&c->caches[l].dec, row_stride(c, l));
    }
    if (in_decode(c, s))
        c->decode_count += n;
    if (fw_embed(c->kc, c->m, fs, tokens, n, s, obs))
        goto stopped;
    for (int l = 0; l < cfg->n_layers; l++) {
        const int kvf = kv_floats(c, l);
        if (fw_attn_inputs(c->kc, c->m, l, fs, n, s, c->rope_pos, obs))
            goto stopped;
        /* The owner writes its rows, and under plain sharing so does every
         * follower's own copy. */
        if (mla(c))
            for (int r = 0; r < n; r++)
                store_row(c, l, s + r, mla_cache_row(c, s + r, fs->lat + (size_t)r * kvf), NULL);
        for (int l2 = l; !mla(c) && cfg->kv_owner[l] == l && l2 < cfg->n_layers; l2++)
            if (cfg->kv_owner[l2] == l && has_storage(c, l2))
                for (int r = 0; r < n; r++)
                    store_row(c, l2, s + r, fs->k + (size_t)r * kvf, fs->v + (size_t)r * kvf);
        if (layer_attention(c, l, s, n, e) < 0)
            return -1;
        sink_injections(c, l, s, n);
        if (fw_attn_emit(c->m, l, fs, n, s, c->nkeys, obs) ||
            fw_layer_finish(c->kc, c->m, l, fs, n, s, obs))
            goto stopped;
    }
    c->pos += n;
    bool all = obs && obs->all_logits;
    if (all || (last && logits)) {
        int row0 = all ? 0 : n - 1, rows = all ? n : 1;
        if (fw_logits(c->kc, c->m, fs, row0, rows, s + row0, c->logits, obs))
            goto stopped;
        if (last && logits)
            memcpy(logits, c->logits + (size_t)(rows - 1) * cfg->vocab,
                   (size_t)cfg->vocab * sizeof(float));
    }
    return 0;
stopped:
    kv_errf(e, "stopped by the observer at position %lld", (long long)s);
    return 1;
}

static int chk_forward(kv_engine *self, const int32_t *tokens, int n, float *logits, kv_err *e)
{
    chk_engine *c = (chk_engine *)self;
    const kv_config *cfg = &c->m->cfg;
    if (n <= 0)
        return kv_errf(e, "chunked: nothing to run (0 tokens)");
    if (c->pos + n > c->o.max_ctx)
        return kv_errf(e, "chunked: %lld tokens exceed the context of %d positions",
                       (long long)(c->pos + n), c->o.max_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= cfg->vocab)
            return kv_errf(e, "token id %d at position %lld is outside the vocabulary (0..%d)",
                           tokens[i], (long long)(c->pos + i), cfg->vocab - 1);
    /* The first call is the prompt, prefilled in chunks; later calls decode
     * one token per step. */
    int step = c->prefill_len < 0 ? c->o.chunk : 1;
    if (c->prefill_len < 0)
        c->prefill_len = n;
    for (int i = 0; i < n; i += step) {
        int k = n - i < step ? n - i : step;
        int rc = chunk_forward(c, tokens + i, k, i + k == n, logits, e);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Life cycle and reporting                                             */

static int64_t chk_position(const kv_engine *self) { return ((const chk_engine *)self)->pos; }

static void chk_describe(const kv_engine *self, char *buf, size_t n)
{
    const chk_engine *c = (const chk_engine *)self;
    char inj[256];
    chk_injections_describe(&c->o.inj, inj, sizeof inj);
    snprintf(buf, n, "chunked (chunk %d, cache %s, attention %s, kv-share %s, inject %s)",
             c->o.chunk, chk_cache_name(c->o.cache),
             c->o.attn == CHK_ATTN_EXACT ? "exact" : "cascade", chk_share_name(c->o.share),
             inj);
}

size_t chk_cache_bytes_of(const kv_engine *self, kv_attn_type type)
{
    const chk_engine *c = (const chk_engine *)self;
    const kv_config *cfg = &c->m->cfg;
    size_t total = 0;
    for (int l = 0; l < cfg->n_layers; l++)
        if (cfg->layer_type[l] == type)
            total += buf_bytes(&c->caches[l].main, row_stride(c, l)) +
                     buf_bytes(&c->caches[l].dec, row_stride(c, l));
    return total;
}

static size_t chk_cache_bytes(const kv_engine *self)
{
    return chk_cache_bytes_of(self, ATTN_SLIDING) + chk_cache_bytes_of(self, ATTN_GLOBAL);
}

static void chk_destroy(kv_engine *self)
{
    chk_engine *c = (chk_engine *)self;
    if (!c)
        return;
    for (int l = 0; c->caches && l < c->m->cfg.n_layers; l++) {
        buf_free(&c->caches[l].main);
        buf_free(&c->caches[l].dec);
    }
    for (int l = 0; c->cands && l < c->m->cfg.n_layers; l++) {
        free(c->cands[l].pos);
        free(c->cands[l].valid);
        free(c->cands[l].k);
        free(c->cands[l].v);
        free(c->cands[l].unpad);
    }
    free(c->caches);
    free(c->cands);
    free(c->zero_row);
    free(c->mla_k);
    free(c->mla_v);
    free(c->mla_kp);
    free(c->mla_vp);
    free(c->mla_lat);
    free(c->mla_scratch);
    free(c->mla_qa);
    free(c->mla_o);
    free(c->mla_o2);
    free(c->mla_lse2);
    free(c->mla_zero);
    free(c->mla_tmp_row);
    rows_free(c);
    free(c->mask);
    free(c);
}

/* Sizes the buffers of every layer that has storage for the strategy. */
static int alloc_caches(chk_engine *c, kv_err *e)
{
    const kv_config *cfg = &c->m->cfg;
    const int T = c->o.max_ctx;
    for (int l = 0; l < cfg->n_layers; l++) {
        if (cfg->kv_owner[l] != l && c->o.share != SHARE_PLAIN)
            continue;
        layer_cache *lc = &c->caches[l];
        const bool sliding = cfg->layer_type[l] == ATTN_SLIDING;
        lc->stale = sliding && c->o.inj.on[INJ_STALE_LOCAL] &&
                    (c->o.inj.stale_layer < 0 || c->o.inj.stale_layer == l);
        lc->ring = c->o.cache == CACHE_RING && sliding;
        int slots = lc->ring ? eff_window(c, l) + c->o.chunk : T;
        if (lc->ring && slots > T)
            slots = T; /* a ring larger than the context never wraps */
        int rc = buf_init(&lc->main, slots, row_stride(c, l), lc->stale, !mla(c));
        if (rc == 0 && c->o.cache == CACHE_SPLIT)
            rc = buf_init(&lc->dec, T, row_stride(c, l), lc->stale, !mla(c));
        if (rc < 0)
            return kv_errf(e, "out of memory for the KV cache of layer %d", l);
    }
    /* Candidate lists: at most every slot of the largest layout. */
    int cap = c->o.cache == CACHE_SPLIT ? 2 * T : T;
    for (int l = 0; l < cfg->n_layers; l++)
        if (cand_reserve(&c->cands[l], cap) < 0)
            return kv_errf(e, "out of memory for key lists");
    return 0;
}

kv_engine *chk_create(const kv_model *m, const kern_ctx *kc, const chk_opts *o,
                      kv_observer *obs, kv_err *e)
{
    if (chk_opts_check(o, &m->cfg, e) < 0)
        return NULL;
    chk_engine *c = calloc(1, sizeof *c);
    if (!c) {
        kv_errf(e, "out of memory");
        return NULL;
    }
    c->base = (kv_engine){.name = "chunked", .forward = chk_forward, .position = chk_position,
                          .describe = chk_describe, .cache_bytes = chk_cache_bytes,
                          .destroy = chk_destroy};
    c->m = m;
    c->kc = kc;
    c->obs = obs;
    c->o = *o;
    c->prefill_len = -1;
    c->pad = o->share == SHARE_PADDED ? o->share_pad : 1;
    c->caches = calloc((size_t)m->cfg.n_layers, sizeof *c->caches);
    c->cands = calloc((size_t)m->cfg.n_layers, sizeof *c->cands);
    c->zero_row = calloc((size_t)config_max_kv_width(&m->cfg), sizeof(float));
    if (config_mla(&m->cfg)) {
        c->mla_zero = calloc((size_t)config_mla_row(&m->cfg), sizeof(float));
        c->mla_tmp_row = calloc((size_t)config_mla_row(&m->cfg), sizeof(float));
    }
    if (!c->caches || !c->cands || !c->zero_row ||
        (config_mla(&m->cfg) && (!c->mla_zero || !c->mla_tmp_row))) {
        kv_errf(e, "out of memory");
        chk_destroy(&c->base);
        return NULL;
    }
    if (alloc_caches(c, e) < 0) {
        chk_destroy(&c->base);
        return NULL;
    }
    return &c->base;
}
