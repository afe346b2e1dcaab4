/* injections.c — the catalogue of cache bugs the chunked engine can
 * reproduce: names, help, parsing, and whether one applies to a model.
 * docs/injections.md explains each and where its first divergence lands. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunked.h"

typedef struct {
    const char *name;
    bool takes_value;
    const char *help;
} inj_info;

static const inj_info catalogue[INJ_COUNT] = {
    [INJ_ISOLATED_CHUNKS] = {"isolated-chunks", false,
        "each chunk attends only to itself (earlier chunks' keys are not read)"},
    [INJ_ISOLATED_CHUNKS_POS] = {"isolated-chunks-pos", false,
        "isolated-chunks, and RoPE positions restart at 0 in each chunk"},
    [INJ_WINDOW] = {"window", true,
        "window=N: sliding window hard-coded to N instead of the config's value"},
    [INJ_STALE_LOCAL] = {"stale-local", false,
        "sliding layers read a copy of their cache taken before the previous chunk wrote "
        "(stale-local@L: sliding layer L alone)"},
    [INJ_ZERO_SHARED_KV] = {"zero-shared-kv", false,
        "KV-shared layers read K = V = 0 instead of their owner's cache"},
    [INJ_SPLIT_MASK_OFF_BY_ONE] = {"split-mask-off-by-one", false,
        "split cache: the prefill validity mask uses <= instead of <"},
    [INJ_DECODE_INDEX_STUCK] = {"decode-index-stuck", false,
        "the decode write index does not advance after the first decode step"},
    [INJ_ROPE_OFFSET] = {"rope-offset", true,
        "rope-offset=N: decode tokens are rotated at position + N"},
    [INJ_RING_NO_WRAP] = {"ring-no-wrap", false,
        "ring cache: writes stop once the ring is full instead of overwriting the oldest slot "
        "(ring-no-wrap@L: sliding layer L alone)"},
    [INJ_SPLIT_DECODE_BLIND] = {"split-decode-blind", false,
        "split cache: decode steps attend only to the decode cache, never to the prefill cache"},
    [INJ_DROP_KEY] = {"drop-key", true,
        "drop-key=K[@L]: key K is read by no later query (on layer L alone with @L)"},
    [INJ_ISOLATED_LAYER] = {"isolated-layer", true,
        "isolated-layer=L: on layer L alone, each chunk attends only to itself"},
    [INJ_SINK_DROPPED] = {"sink-dropped", false,
        "attention sinks: the sink logit is left out of every softmax (sink-dropped@L: layer L "
        "alone)"},
    [INJ_SINK_PREFILL_ONLY] = {"sink-prefill-only", false,
        "attention sinks: applied in prefill chunks, left out of decode steps"},
    [INJ_SINK_WINDOWED] = {"sink-windowed", false,
        "attention sinks: the sink is masked like the key at position 0, so sliding layers "
        "lose it once their window has passed position 0"},
    [INJ_MLA_ROPE_TWICE] = {"mla-rope-twice", false,
        "latent cache: the shared key tail is rotated a second time as it is written"},
    [INJ_MLA_ROPE_UNCACHED] = {"mla-rope-uncached", false,
        "latent cache: the key tail is not cached (zeros), so keys of earlier chunks lose "
        "their position; a chunk's own keys keep theirs"},
    [INJ_MLA_NO_MSCALE] = {"mla-no-mscale", false,
        "latent cache: decode runs absorbed with q.k scaled by qk_head_dim^-1/2 alone, "
        "without YaRN's mscale_all_dim correction"},
    [INJ_MLA_MIXED_FORMS] = {"mla-mixed-forms", false,
        "latent cache: prefill attends its expanded keys and never fills the latent cache; "
        "decode runs absorbed over it and reads zeros at every prompt position"},
    [INJ_OWN_KEY_MASKED] = {"own-key-masked", true,
        "own-key-masked=F[@L]: queries from position F on skip their own key, a strict mask "
        "(on layer L alone with @L)"},
};

const char *chk_injection_name(chk_injection i)
{
    return (i >= 0 && i < INJ_COUNT) ? catalogue[i].name : "?";
}

const char *chk_injection_help(chk_injection i)
{
    return (i >= 0 && i < INJ_COUNT) ? catalogue[i].help : "";
}

static int parse_count(const char *name, const char *val, long lo, int *out, kv_err *e)
{
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (errno || end == val || *end || v < lo || v > (1L << 30))
        return kv_errf(e, "--inject %s: '%s' is not an integer >= %ld", name, val, lo);
    *out = (int)v;
    return 0;
}

/* "N" or "N@L": a count >= lo, and a layer (-1 when none is given). The
 * layer is checked against the model by chk_opts_check. */
static int parse_at_layer(const char *name, const char *val, long lo, int *n, int *layer,
                          kv_err *e)
{
    char buf[64];
    const char *at = strchr(val, '@');
    const size_t len = at ? (size_t)(at - val) : strlen(val);
    if (len >= sizeof buf)
        return kv_errf(e, "--inject %s: '%s' is not N or N@LAYER", name, val);
    memcpy(buf, val, len);
    buf[len] = '\0';
    *layer = -1;
    if (parse_count(name, buf, lo, n, e) < 0)
        return -1;
    return at ? parse_count(name, at + 1, 0, layer, e) : 0;
}

/* Where injection i, which takes no value, keeps the one layer it may
 * name (NAME@L), or NULL. */
static const int *layer_of(const chk_injections *inj, int i)
{
    return i == INJ_STALE_LOCAL ? &inj->stale_layer : i == INJ_RING_NO_WRAP ? &inj->ring_layer
         : i == INJ_SINK_DROPPED ? &inj->sink_layer : NULL;
}

int chk_injection_parse(const char *spec, chk_injections *inj, kv_err *e)
{
    const char *eq = strchr(spec, '=');
    const char *at = eq ? NULL : strchr(spec, '@');
    size_t nlen = eq ? (size_t)(eq - spec) : at ? (size_t)(at - spec) : strlen(spec);
    for (int i = 0; i < INJ_COUNT; i++) {
        const inj_info *in = &catalogue[i];
        if (strlen(in->name) != nlen || strncmp(in->name, spec, nlen) != 0)
            continue;
        if (in->takes_value && !eq)
            return kv_errf(e, "--inject %s needs a value (%s=N)", in->name, in->name);
        if (!in->takes_value && eq)
            return kv_errf(e, "--inject %s takes no value", in->name);
        int *layer = (int *)layer_of(inj, i);   /* inj is the caller's, writable */
        if (at && !layer)
            return kv_errf(e, "--inject %s takes no layer", in->name);
        if (layer) {
            *layer = -1;
            if (at && parse_count(in->name, at + 1, 0, layer, e) < 0)
                return -1;
        }
        if (i == INJ_WINDOW && parse_count(in->name, eq + 1, 1, &inj->window, e) < 0)
            return -1;
        if (i == INJ_ROPE_OFFSET && parse_count(in->name, eq + 1, 1, &inj->rope_offset, e) < 0)
            return -1;
        if ((i == INJ_DROP_KEY || i == INJ_OWN_KEY_MASKED) &&
            parse_at_layer(in->name, eq + 1, i == INJ_DROP_KEY ? 0 : 1,
                           i == INJ_DROP_KEY ? &inj->drop_key : &inj->own_from,
                           i == INJ_DROP_KEY ? &inj->drop_layer : &inj->own_layer, e) < 0)
            return -1;
        if (i == INJ_ISOLATED_LAYER && parse_count(in->name, eq + 1, 0, &inj->iso_layer, e) < 0)
            return -1;
        inj->on[i] = true;
        return 0;
    }
    return kv_errf(e, "--inject: unknown injection '%.*s' (kvdiff run --list-injections)",
                   (int)nlen, spec);
}

void chk_injections_describe(const chk_injections *inj, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < INJ_COUNT && len < n; i++) {
        if (!inj->on[i])
            continue;
        int w;
        if (i == INJ_WINDOW)
            w = snprintf(buf + len, n - len, "%swindow=%d", len ? "," : "", inj->window);
        else if (i == INJ_ROPE_OFFSET)
            w = snprintf(buf + len, n - len, "%srope-offset=%d", len ? "," : "",
                         inj->rope_offset);
        else if (i == INJ_ISOLATED_LAYER)
            w = snprintf(buf + len, n - len, "%sisolated-layer=%d", len ? "," : "",
                         inj->iso_layer);
        else if (i == INJ_DROP_KEY || i == INJ_OWN_KEY_MASKED) {
            const int v = i == INJ_DROP_KEY ? inj->drop_key : inj->own_from;
            const int l = i == INJ_DROP_KEY ? inj->drop_layer : inj->own_layer;
            w = l >= 0 ? snprintf(buf + len, n - len, "%s%s=%d@%d", len ? "," : "",
                                  catalogue[i].name, v, l)
                       : snprintf(buf + len, n - len, "%s%s=%d", len ? "," : "",
                                  catalogue[i].name, v);
        }
        else if (layer_of(inj, i) && *layer_of(inj, i) >= 0)
            w = snprintf(buf + len, n - len, "%s%s@%d", len ? "," : "", catalogue[i].name,
                         *layer_of(inj, i));
        else
            w = snprintf(buf + len, n - len, "%s%s", len ? "," : "", catalogue[i].name);
        if (w < 0)
            break;
        len += (size_t)w;
    }
    if (!len)
        snprintf(buf, n, "none");
}

static bool has_sliding(const kv_config *c)
{
    for (int l = 0; l < c->n_layers; l++)
        if (c->layer_type[l] == ATTN_SLIDING)
            return true;
    return false;
}

static bool has_shared(const kv_config *c)
{
    for (int l = 0; l < c->n_layers; l++)
        if (c->kv_owner[l] != l)
            return true;
    return false;
}

void chk_opts_default(chk_opts *o)
{
    memset(o, 0, sizeof *o);
    o->chunk = 16;
    o->cache = CACHE_DENSE;
    o->attn = CHK_ATTN_EXACT;
    o->share = SHARE_PLAIN;
    o->share_pad = 64;
}

int chk_opts_check(const chk_opts *o, const kv_config *c, kv_err *e)
{
    const chk_injections *inj = &o->inj;
    if (o->max_ctx < 1 || o->max_ctx > c->max_positions)
        return kv_errf(e, "chunked: context %d outside 1..%d (max_position_embeddings)",
                       o->max_ctx, c->max_positions);
    if (o->chunk < 1 || o->chunk > o->max_ctx)
        return kv_errf(e, "--chunk %d must be between 1 and the context (%d)", o->chunk,
                       o->max_ctx);
    if (o->share == SHARE_PADDED && (o->share_pad < 1 || o->share_pad > 4096))
        return kv_errf(e, "--kv-pad %d must be between 1 and 4096", o->share_pad);
    if ((inj->on[INJ_WINDOW] || inj->on[INJ_STALE_LOCAL]) && !has_sliding(c))
        return kv_errf(e, "--inject %s: the model has no sliding-window layer",
                       inj->on[INJ_WINDOW] ? "window" : "stale-local");
    if (inj->on[INJ_ZERO_SHARED_KV] && !has_shared(c))
        return kv_errf(e, "--inject zero-shared-kv: the model has no KV-shared layer");
    if (inj->on[INJ_SPLIT_MASK_OFF_BY_ONE] && o->cache != CACHE_SPLIT)
        return kv_errf(e, "--inject split-mask-off-by-one needs --cache split");
    if (inj->on[INJ_SPLIT_DECODE_BLIND] && o->cache != CACHE_SPLIT)
        return kv_errf(e, "--inject split-decode-blind needs --cache split (only a split cache "
                          "has a decode cache apart from the prefill cache)");
    /* A decode step that reads no prefill slot cannot read one too many. */
    if (inj->on[INJ_SPLIT_DECODE_BLIND] && inj->on[INJ_SPLIT_MASK_OFF_BY_ONE])
        return kv_errf(e, "--inject split-decode-blind hides split-mask-off-by-one (decode "
                          "steps read no prefill slot): give one of them");
    for (int i = 0; i < INJ_COUNT; i++) {
        const int *l = layer_of(inj, i);
        if (inj->on[i] && l && *l >= c->n_layers)
            return kv_errf(e, "--inject %s@%d: the model has layers 0..%d", catalogue[i].name,
                           *l, c->n_layers - 1);
        if (inj->on[i] && l && *l >= 0 && i != INJ_SINK_DROPPED &&
            c->layer_type[*l] != ATTN_SLIDING)
            return kv_errf(e, "--inject %s@%d: layer %d is not a sliding-window layer",
                           catalogue[i].name, *l, *l);
        if (inj->on[i] && (i == INJ_SINK_DROPPED || i == INJ_SINK_PREFILL_ONLY ||
                           i == INJ_SINK_WINDOWED) && !c->attn_sinks)
            return kv_errf(e, "--inject %s: the model has no attention sinks", catalogue[i].name);
    }
    for (int i = INJ_MLA_ROPE_TWICE; i <= INJ_MLA_MIXED_FORMS; i++)
        if (inj->on[i] && !config_mla(c))
            return kv_errf(e, "--inject %s: the model has no latent (MLA) cache",
                           catalogue[i].name);
    if (inj->on[INJ_MLA_NO_MSCALE] && c->attn_scale == 1.0 / sqrt((double)c->head_dim))
        return kv_errf(e, "--inject mla-no-mscale: the config has no mscale_all_dim "
                          "correction to leave out");
    if (o->mla_absorbed && !config_mla(c))
        return kv_errf(e, "--mla absorbed: the model has no latent (MLA) cache");
    if (inj->on[INJ_SINK_WINDOWED] && !has_sliding(c))
        return kv_errf(e, "--inject sink-windowed: the model has no sliding-window layer");
    if (inj->on[INJ_RING_NO_WRAP] && o->cache != CACHE_RING)
        return kv_errf(e, "--inject ring-no-wrap needs --cache ring");
    if (inj->on[INJ_RING_NO_WRAP] && !has_sliding(c))
        return kv_errf(e, "--inject ring-no-wrap: the model has no sliding-window layer "
                          "(no ring buffer)");
    if (inj->on[INJ_DROP_KEY] && inj->drop_layer >= c->n_layers)
        return kv_errf(e, "--inject drop-key=%d@%d: the model has layers 0..%d", inj->drop_key,
                       inj->drop_layer, c->n_layers - 1);
    if (inj->on[INJ_ISOLATED_LAYER] && inj->iso_layer >= c->n_layers)
        return kv_errf(e, "--inject isolated-layer=%d: the model has layers 0..%d",
                       inj->iso_layer, c->n_layers - 1);
    if (inj->on[INJ_ISOLATED_LAYER] && (inj->on[INJ_ISOLATED_CHUNKS] ||
                                        inj->on[INJ_ISOLATED_CHUNKS_POS]))
        return kv_errf(e, "--inject isolated-layer: isolated-chunks already covers every layer");
    if (inj->on[INJ_OWN_KEY_MASKED] && inj->own_layer >= c->n_layers)
        return kv_errf(e, "--inject own-key-masked=%d@%d: the model has layers 0..%d",
                       inj->own_from, inj->own_layer, c->n_layers - 1);
    if (inj->on[INJ_ISOLATED_CHUNKS] && inj->on[INJ_ISOLATED_CHUNKS_POS])
        return kv_errf(e, "--inject isolated-chunks-pos already includes isolated-chunks");
    return 0;
}

static const char *const cache_names[CACHE_KIND_COUNT] = {"dense", "split", "ring"};
static const char *const share_names[SHARE_KIND_COUNT] = {"plain", "padded", "owner-read-only"};

const char *chk_cache_name(chk_cache_kind k)
{
    return (k >= 0 && k < CACHE_KIND_COUNT) ? cache_names[k] : "?";
}

int chk_cache_parse(const char *s, chk_cache_kind *out)
{
    for (int i = 0; i < CACHE_KIND_COUNT; i++)
        if (!strcmp(s, cache_names[i])) {
            *out = (chk_cache_kind)i;
            return 0;
        }
    return -1;
}

const char *chk_share_name(chk_share_kind k)
{
    return (k >= 0 && k < SHARE_KIND_COUNT) ? share_names[k] : "?";
}

int chk_share_parse(const char *s, chk_share_kind *out)
{
    for (int i = 0; i < SHARE_KIND_COUNT; i++)
        if (!strcmp(s, share_names[i])) {
            *out = (chk_share_kind)i;
            return 0;
        }
    return -1;
}
