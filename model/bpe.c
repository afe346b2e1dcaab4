/* bpe.c — encodes text with a Hugging Face BPE tokenizer.json (bpe.h).
 *
 * Unicode comes from Debian libraries, not tables of our own: PCRE2 (UTF +
 * UCP) runs the pre-tokenizer's split pattern with its \p{L} / \p{N}
 * classes, utf8proc does normalization forms and validates UTF-8. The
 * vocabulary is an open-addressing map from token bytes to id; merges are a
 * map from an adjacent id pair to (rank, merged id), so a word is merged by
 * popping the lowest (rank, position) pair from a heap, never by rescanning
 * it. */
#include "bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>
#include <xxhash.h>

/* The normalized text may be at most this many times the input, plus
 * NORM_SLACK bytes: Replace normalizers chained in a tokenizer.json
 * ("a" -> "aa", forty times) would otherwise grow it without bound. Real
 * normalizers grow text by a small factor (NFKD, a "\u2581" for a
 * space: 3 bytes for 1). */
#define NORM_GROWTH 16
#define NORM_SLACK 4096

/* ---- growable buffers --------------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const void *src, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
    b->p[b->len] = '\0';
}

typedef struct {
    int32_t *v;
    size_t n, cap;
    bool oom;
    size_t max;   /* the most ids wanted (0: any number) */
} ibuf;

static void ib_put(ibuf *b, int32_t id)
{
    if (b->oom)
        return;
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        int32_t *q = realloc(b->v, cap * sizeof *q);
        if (!q) {
            b->oom = true;
            return;
        }
        b->v = q;
        b->cap = cap;
    }
    b->v[b->n++] = id;
}

/* Text cut into pieces: piece i is buf.p[off[i] .. off[i] + len[i]). */
typedef struct {
    sbuf buf;
    size_t *off, *len;
    size_t n, cap;
    bool oom;
} pieces;

static void pc_add(pieces *p, const char *s, size_t n)
{
    if (n == 0 || p->oom)
        return;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        size_t *o = realloc(p->off, cap * sizeof *o);
        if (o)
            p->off = o;
        size_t *l = o ? realloc(p->len, cap * sizeof *l) : NULL;
        if (!o || !l) {
            p->oom = true;
            return;
        }
        p->len = l;
        p->cap = cap;
    }
    p->off[p->n] = p->buf.len;
    p->len[p->n++] = n;
    sb_put(&p->buf, s, n);
    p->oom = p->oom || p->buf.oom;
}

static void pc_clear(pieces *p)
{
    p->n = 0;
    p->buf.len = 0;
}

static void pc_free(pieces *p)
{
    free(p->buf.p);
    free(p->off);
    free(p->len);
}

/* ---- maps --------------------------------------------------------------- */

/* Token bytes -> id. Keys live in one arena. */
typedef struct {
    uint64_t *off;    /* (cap) key offset in keys, UINT64_MAX when empty */
    uint32_t *klen;   /* (cap) */
    int32_t *id;      /* (cap) */
    size_t cap, n;
    sbuf keys;
} str_map;

static int sm_init(str_map *m, size_t n)
{
    m->cap = 16;
    while (m->cap < n * 2)
        m->cap *= 2;
    m->off = malloc(m->cap * sizeof *m->off);
    m->klen = malloc(m->cap * sizeof *m->klen);
    m->id = malloc(m->cap * sizeof *m->id);
    if (!m->off || !m->klen || !m->id)
        return -1;
    memset(m->off, 0xff, m->cap * sizeof *m->off);
    return 0;
}

static size_t sm_slot(const str_map *m, const char *s, size_t n)
{
    size_t i = (size_t)XXH3_64bits(s, n) & (m->cap - 1);
    while (m->off[i] != UINT64_MAX &&
           !(m->klen[i] == n && memcmp(m->keys.p + m->off[i], s, n) == 0))
        i = (i + 1) & (m->cap - 1);
    return i;
}

static int32_t sm_get(const str_map *m, const char *s, size_t n)
{
    if (!m->cap)
        return -1;
    size_t i = sm_slot(m, s, n);
    return m->off[i] == UINT64_MAX ? -1 : m->id[i];
}

/* Sets s -> id (a later key wins); the map was sized for every key. */
static int sm_set(str_map *m, const char *s, size_t n, int32_t id)
{
    if (m->n * 2 >= m->cap || n > UINT32_MAX)
        return -1;
    size_t i = sm_slot(m, s, n);
    if (m->off[i] == UINT64_MAX) {
        m->off[i] = m->keys.len;
        m->klen[i] = (uint32_t)n;
        sb_put(&m->keys, s, n);
        if (m->keys.oom)
            return -1;
        m->n++;
    }
    m->id[i] = id;
    return 0;
}

static void sm_free(str_map *m)
{
    free(m->off);
    free(m->klen);
    free(m->id);
    free(m->keys.p);
}

/* (left id, right id) -> (rank, merged id). */
typedef struct {
    uint64_t *key;    /* UINT64_MAX when empty */
    int32_t *rank, *merged;
    size_t cap;
} pair_map;

static uint64_t pair_key(int32_t a, int32_t b)
{
    return (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
}

static size_t pm_slot(const pair_map *m, uint64_t k)
{
    size_t i = (size_t)XXH3_64bits(&k, sizeof k) & (m->cap - 1);
    while (m->key[i] != UINT64_MAX && m->key[i] != k)
        i = (i + 1) & (m->cap - 1);
    return i;
}

/* ---- the encoder -------------------------------------------------------- */

enum { NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD, NORM_REPLACE, NORM_PREPEND, NORM_LOWER };

typedef struct {
    int kind;
    char *from, *to;     /* Replace: from -> to; Prepend: to */
    size_t from_len, to_len;
} norm_op;

enum { SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_PREV, SPLIT_NEXT, SPLIT_CONTIGUOUS };
enum { PRE_SPLIT, PRE_BYTE_LEVEL, PRE_METASPACE };
enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };

typedef struct {
    int kind;
    pcre2_code *re;      /* Split (Regex), ByteLevel with use_regex */
    char *str;           /* Split (String); Metaspace replacement */
    size_t str_len;
    int behavior;
    bool invert;
    bool prefix_space;   /* ByteLevel */
    int prepend;         /* Metaspace */
    bool split;          /* Metaspace */
} pre_op;

typedef struct {
    char *content;
    size_t len;
    int32_t id;
    bool lstrip, rstrip, single_word;
} added_tok;

/* Byte trie over added-token contents: first child / next sibling. */
typedef struct {
    int32_t child, sibling, tok;
    unsigned char byte;
} trie_node;

typedef struct {
    trie_node *v;
    size_t n, cap;
} trie;

struct bpe_encoder {
    str_map vocab;
    pair_map merges;
    int32_t byte_id[256];   /* "<0xNN>" ids for byte fallback, -1 if none */
    bool byte_fallback, ignore_merges;
    int32_t unk;
    added_tok *added;
    size_t n_added;
    trie raw, normed;       /* added tokens matched before / after normalizing */
    norm_op *norm;
    size_t n_norm;
    pre_op *pre;
    size_t n_pre;
    int32_t *prefix, *suffix;   /* post-processor's special tokens */
    size_t n_prefix, n_suffix;
    size_t longest;             /* bytes of the longest vocabulary entry */
};

static const char *type_of(const json_t *o)
{
    const json_t *t = json_is_object(o) ? json_object_get(o, "type") : NULL;
    return json_is_string(t) ? json_string_value(t) : "";
}

/* "Cannot encode" is not malformed: the file may be fine to decode with. */
#define UNSUPPORTED 1

typedef struct {
    const char *name;
    char *why;
    size_t why_n;
    kv_err *e;
} build_ctx;

static int unsupported(build_ctx *c, const char *fmt, const char *what)
{
    snprintf(c->why, c->why_n, fmt, what);
    return UNSUPPORTED;
}

static int oom(build_ctx *c)
{
    return kv_errf(c->e, "%s: out of memory", c->name);
}

static char *dup_bytes(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = '\0';
    }
    return p;
}

/* ---- building: model ---------------------------------------------------- */

static int build_vocab(bpe_encoder *b, const json_t *model, build_ctx *c)
{
    const json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab))
        return kv_errf(c->e, "%s: model.vocab of a BPE model is not an object", c->name);
    if (sm_init(&b->vocab, json_object_size(vocab)) < 0)
        return oom(c);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > INT32_MAX)
            return kv_errf(c->e, "%s: model.vocab[\"%.40s\"] is not a non-negative id", c->name,
                           key);
        size_t n = json_object_iter_key_len(json_object_key_to_iter(key));
        if (sm_set(&b->vocab, key, n, (int32_t)json_integer_value(v)) < 0)
            return oom(c);
        /* an id covers a vocabulary entry, or one character (unk): 4 bytes */
        b->longest = n > b->longest ? n : b->longest < 4 ? 4 : b->longest;
    }
    for (int i = 0; i < 256; i++) {
        char tok[8];
        snprintf(tok, sizeof tok, "<0x%02X>", i);
        b->byte_id[i] = sm_get(&b->vocab, tok, 6);
    }
    return 0;
}

/* One merge as (left, right): ["a", "b"] or the older "a b". */
static int merge_parts(const json_t *m, const char **a, size_t *alen, const char **bb,
                       size_t *blen)
{
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0));
        *alen = json_string_length(json_array_get(m, 0));
        *bb = json_string_value(json_array_get(m, 1));
        *blen = json_string_length(json_array_get(m, 1));
        return 0;
    }
    if (!json_is_string(m))
        return -1;
    const char *s = json_string_value(m);
    size_t n = json_string_length(m);
    const char *sp = memchr(s, ' ', n);
    if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
        return -1;
    *a = s;
    *alen = (size_t)(sp - s);
    *bb = sp + 1;
    *blen = n - *alen - 1;
    return 0;
}

static int build_merges(bpe_encoder *b, const json_t *model, build_ctx *c)
{
    const json_t *merges = json_object_get(model, "merges");
    if (!merges || json_is_null(merges))
        merges = NULL;
    else if (!json_is_array(merges))
        return kv_errf(c->e, "%s: model.merges is not an array", c->name);
    size_t n = merges ? json_array_size(merges) : 0;
    pair_map *m = &b->merges;
    m->cap = 16;
    while (m->cap < n * 2)
        m->cap *= 2;
    m->key = malloc(m->cap * sizeof *m->key);
    m->rank = malloc(m->cap * sizeof *m->rank);
    m->merged = malloc(m->cap * sizeof *m->merged);
    if (!m->key || !m->rank || !m->merged)
        return oom(c);
    memset(m->key, 0xff, m->cap * sizeof *m->key);
    sbuf joined = { NULL, 0, 0, false };
    for (size_t i = 0; i < n; i++) {
        const char *a, *bb;
        size_t alen, blen;
        if (merge_parts(json_array_get(merges, i), &a, &alen, &bb, &blen) < 0) {
            free(joined.p);
            return kv_errf(c->e, "%s: model.merges[%zu] is neither [\"a\", \"b\"] nor \"a b\"",
                           c->name, i);
        }
        joined.len = 0;
        sb_put(&joined, a, alen);
        sb_put(&joined, bb, blen);
        if (joined.oom)
            return oom(c);
        int32_t ia = sm_get(&b->vocab, a, alen), ib = sm_get(&b->vocab, bb, blen);
        int32_t im = sm_get(&b->vocab, joined.p, joined.len);
        if (ia < 0 || ib < 0 || im < 0) {
            free(joined.p);
            return kv_errf(c->e, "%s: model.merges[%zu] (\"%.*s\" + \"%.*s\") uses or makes a "
                           "token not in model.vocab", c->name, i, (int)(alen > 40 ? 40 : alen),
                           a, (int)(blen > 40 ? 40 : blen), bb);
        }
        /* A repeated pair takes its last rank, as Hugging Face's loader does. */
        size_t s = pm_slot(m, pair_key(ia, ib));
        m->key[s] = pair_key(ia, ib);
        m->rank[s] = (int32_t)i;
        m->merged[s] = im;
    }
    free(joined.p);
    return 0;
}

static bool nonempty_string(const json_t *v)
{
    return json_is_string(v) && json_string_length(v) > 0;
}

static int build_model(bpe_encoder *b, const json_t *model, build_ctx *c)
{
    const json_t *unk = json_object_get(model, "unk_token");
    const char *t = type_of(model);
    if (strcmp(t, "BPE") != 0 && !(t[0] == 0 && json_object_get(model, "merges")))
        return unsupported(c, "model type '%s' (kvdiff encodes with BPE models only)", t);
    if (nonempty_string(json_object_get(model, "continuing_subword_prefix")) ||
        nonempty_string(json_object_get(model, "end_of_word_suffix")))
        return unsupported(c, "%s: BPE with continuing_subword_prefix or end_of_word_suffix",
                           "model");
    const json_t *drop = json_object_get(model, "dropout");
    if (json_is_number(drop) && json_number_value(drop) > 0)
        return unsupported(c, "%s: BPE dropout (random merges)", "model");
    b->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    b->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    int rc = build_vocab(b, model, c);
    if (rc == 0)
        rc = build_merges(b, model, c);
    b->unk = json_is_string(unk)
                 ? sm_get(&b->vocab, json_string_value(unk), json_string_length(unk)) : -1;
    return rc;
}

/* ---- building: added tokens --------------------------------------------- */

static int trie_add(trie *t, const char *s, size_t n, int32_t tok)
{
    if (!t->v) {
        t->v = malloc(64 * sizeof *t->v);
        if (!t->v)
            return -1;
        t->cap = 64;
        t->v[0] = (trie_node){ -1, -1, -1, 0 };
        t->n = 1;
    }
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        int32_t k = t->v[node].child;
        while (k >= 0 && t->v[k].byte != ch)
            k = t->v[k].sibling;
        if (k < 0) {
            if (t->n == t->cap) {
                trie_node *q = realloc(t->v, 2 * t->cap * sizeof *q);
                if (!q)
                    return -1;
                t->v = q;
                t->cap *= 2;
            }
            k = (int32_t)t->n++;
            t->v[k] = (trie_node){ -1, t->v[node].child, -1, ch };
            t->v[node].child = k;
        }
        node = k;
    }
    if (node > 0)
        t->v[node].tok = tok;   /* a later duplicate wins */
    return 0;
}

static int normalize(const bpe_encoder *b, const char *s, size_t n, sbuf *out);

static int build_added(bpe_encoder *b, const json_t *root, build_ctx *c)
{
    const json_t *added = json_object_get(root, "added_tokens");
    if (!added || json_is_null(added))
        return 0;
    if (!json_is_array(added))
        return kv_errf(c->e, "%s: added_tokens is not an array", c->name);
    b->added = calloc(json_array_size(added) + 1, sizeof *b->added);
    if (!b->added)
        return oom(c);
    sbuf normed = { NULL, 0, 0, false };
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *t = json_array_get(added, i);
        const json_t *id = json_object_get(t, "id"), *content = json_object_get(t, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) > INT32_MAX || !json_is_string(content) ||
            json_string_length(content) == 0) {
            free(normed.p);
            return kv_errf(c->e, "%s: added_tokens[%zu] needs an id and a non-empty content",
                           c->name, i);
        }
        added_tok *a = &b->added[b->n_added];
        a->len = json_string_length(content);
        a->content = dup_bytes(json_string_value(content), a->len);
        a->id = (int32_t)json_integer_value(id);
        a->lstrip = json_is_true(json_object_get(t, "lstrip"));
        a->rstrip = json_is_true(json_object_get(t, "rstrip"));
        a->single_word = json_is_true(json_object_get(t, "single_word"));
        bool special = json_is_true(json_object_get(t, "special"));
        bool normalized = json_is_true(json_object_get(t, "normalized"));
        if (!a->content)
            return oom(c);
        int32_t k = (int32_t)b->n_added++;
        int rc;
        /* A normalized (non-special) token is looked for in normalized text,
         * spelled as the normalizer spells it. */
        if (normalized && !special) {
            normed.len = 0;
            const int nr = normalize(b, a->content, a->len, &normed);
            if (nr < 0 || normed.oom) {
                free(normed.p);
                if (nr == -2)
                    return kv_errf(c->e, "%s: its normalizer makes added token %d more than %d "
                                   "times longer (chained Replace normalizers?)", c->name, k,
                                   NORM_GROWTH);
                return oom(c);
            }
            rc = normed.len ? trie_add(&b->normed, normed.p, normed.len, k) : 0;
        } else {
            rc = trie_add(&b->raw, a->content, a->len, k);
        }
        if (rc < 0) {
            free(normed.p);
            return oom(c);
        }
    }
    free(normed.p);
    return 0;
}

/* The unknown token, when the model names one: in the vocabulary or an
 * added token. One that is neither would drop text no token spells, where
 * the tokenizers library refuses to encode it. */
static int resolve_unk(bpe_encoder *b, const json_t *root, build_ctx *c)
{
    const json_t *unk = json_object_get(json_object_get(root, "model"), "unk_token");
    for (size_t i = 0; b->unk < 0 && json_is_string(unk) && i < b->n_added; i++)
        if (b->added[i].len == json_string_length(unk) &&
            !memcmp(b->added[i].content, json_string_value(unk), b->added[i].len))
            b->unk = b->added[i].id;
    if (json_is_string(unk) && b->unk < 0)
        return kv_errf(c->e, "%s: model.unk_token \"%.40s\" is neither in model.vocab nor an "
                       "added token", c->name, json_string_value(unk));
    return 0;
}

/* ---- building: normalizer ----------------------------------------------- */

static int add_norm(bpe_encoder *b, norm_op op, build_ctx *c)
{
    norm_op *q = realloc(b->norm, (b->n_norm + 1) * sizeof *q);
    if (!q) {
        free(op.from);
        free(op.to);
        return oom(c);
    }
    b->norm = q;
    b->norm[b->n_norm++] = op;
    return 0;
}

static int build_normalizer(bpe_encoder *b, const json_t *n, build_ctx *c)
{
    if (!n || json_is_null(n))
        return 0;
    const char *t = type_of(n);
    norm_op op = { 0, NULL, NULL, 0, 0 };
    if (!strcmp(t, "Sequence")) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return kv_errf(c->e, "%s: normalizer Sequence has no normalizers array", c->name);
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = build_normalizer(b, json_array_get(list, i), c);
            if (rc)
                return rc;
        }
        return 0;
    }
    if (!strcmp(t, "NFC") || !strcmp(t, "NFD") || !strcmp(t, "NFKC") || !strcmp(t, "NFKD")) {
        op.kind = !strcmp(t, "NFC") ? NORM_NFC : !strcmp(t, "NFD") ? NORM_NFD
                : !strcmp(t, "NFKC") ? NORM_NFKC : NORM_NFKD;
        return add_norm(b, op, c);
    }
    if (!strcmp(t, "Lowercase")) {
        op.kind = NORM_LOWER;
        return add_norm(b, op, c);
    }
    if (!strcmp(t, "Prepend")) {
        const json_t *p = json_object_get(n, "prepend");
        if (!json_is_string(p))
            return kv_errf(c->e, "%s: normalizer Prepend has no prepend string", c->name);
        op.kind = NORM_PREPEND;
        op.to_len = json_string_length(p);
        op.to = dup_bytes(json_string_value(p), op.to_len);
        return op.to ? add_norm(b, op, c) : oom(c);
    }
    if (!strcmp(t, "Replace")) {
        const json_t *pat = json_object_get(n, "pattern");
        const json_t *from = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
        const json_t *to = json_object_get(n, "content");
        if (json_is_object(pat) && json_object_get(pat, "Regex"))
            return unsupported(c, "normalizer %s with a Regex pattern", "Replace");
        if (!json_is_string(from) || json_string_length(from) == 0 || !json_is_string(to))
            return kv_errf(c->e, "%s: normalizer Replace needs pattern.String and content",
                           c->name);
        op.kind = NORM_REPLACE;
        op.from_len = json_string_length(from);
        op.to_len = json_string_length(to);
        op.from = dup_bytes(json_string_value(from), op.from_len);
        op.to = dup_bytes(json_string_value(to), op.to_len);
        if (!op.from || !op.to) {
            free(op.from);
            free(op.to);
            return oom(c);
        }
        return add_norm(b, op, c);
    }
    return unsupported(c, "normalizer '%s'", t);
}

/* ---- building: pre-tokenizer -------------------------------------------- */

/* GPT-2's split pattern, which ByteLevel uses when use_regex is true. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static pcre2_code *compile(const char *pat, size_t len, build_ctx *c)
{
    int err;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        kv_errf(c->e, "%s: pre_tokenizer pattern does not compile (PCRE2, at offset %zu): %s",
                c->name, (size_t)at, (const char *)msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* faster if it works; fine if not */
    return re;
}

static int add_pre(bpe_encoder *b, pre_op op, build_ctx *c)
{
    pre_op *q = realloc(b->pre, (b->n_pre + 1) * sizeof *q);
    if (!q) {
        pcre2_code_free(op.re);
        free(op.str);
        return oom(c);
    }
    b->pre = q;
    b->pre[b->n_pre++] = op;
    return 0;
}

static int parse_behavior(const json_t *v, int *out)
{
    static const char *const names[] = { "Removed", "Isolated", "MergedWithPrevious",
                                         "MergedWithNext", "Contiguous" };
    for (int i = 0; json_is_string(v) && i < 5; i++)
        if (!strcmp(json_string_value(v), names[i])) {
            *out = i;
            return 0;
        }
    return -1;
}

static int build_split(bpe_encoder *b, const json_t *p, build_ctx *c)
{
    pre_op op;
    memset(&op, 0, sizeof op);
    op.kind = PRE_SPLIT;
    const json_t *pat = json_object_get(p, "pattern");
    const json_t *re = json_is_object(pat) ? json_object_get(pat, "Regex") : NULL;
    const json_t *str = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
    if (parse_behavior(json_object_get(p, "behavior"), &op.behavior) < 0)
        return kv_errf(c->e, "%s: pre_tokenizer Split has no known behavior", c->name);
    op.invert = json_is_true(json_object_get(p, "invert"));
    if (json_is_string(re)) {
        op.re = compile(json_string_value(re), json_string_length(re), c);
        if (!op.re)
            return -1;
    } else if (json_is_string(str) && json_string_length(str) > 0) {
        op.str_len = json_string_length(str);
        op.str = dup_bytes(json_string_value(str), op.str_len);
        if (!op.str)
            return oom(c);
    } else {
        return kv_errf(c->e, "%s: pre_tokenizer Split needs pattern.Regex or pattern.String",
                       c->name);
    }
    return add_pre(b, op, c);
}

static int build_pre(bpe_encoder *b, const json_t *p, build_ctx *c)
{
    if (!p || json_is_null(p))
        return 0;
    const char *t = type_of(p);
    pre_op op;
    memset(&op, 0, sizeof op);
    if (!strcmp(t, "Sequence")) {
        const json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return kv_errf(c->e, "%s: pre_tokenizer Sequence has no pretokenizers array",
                           c->name);
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = build_pre(b, json_array_get(list, i), c);
            if (rc)
                return rc;
        }
        return 0;
    }
    if (!strcmp(t, "Split"))
        return build_split(b, p, c);
    if (!strcmp(t, "ByteLevel")) {
        op.kind = PRE_BYTE_LEVEL;
        op.prefix_space = json_is_true(json_object_get(p, "add_prefix_space"));
        const json_t *use = json_object_get(p, "use_regex");
        if (!use || json_is_true(use)) {
            op.re = compile(GPT2_PATTERN, sizeof GPT2_PATTERN - 1, c);
            if (!op.re)
                return -1;
        }
        return add_pre(b, op, c);
    }
    if (!strcmp(t, "Metaspace")) {
        const json_t *r = json_object_get(p, "replacement");
        const json_t *scheme = json_object_get(p, "prepend_scheme");
        op.kind = PRE_METASPACE;
        op.str_len = json_is_string(r) ? json_string_length(r) : 3;
        op.str = dup_bytes(json_is_string(r) ? json_string_value(r) : "\xE2\x96\x81", op.str_len);
        if (!op.str)
            return oom(c);
        op.split = !json_is_false(json_object_get(p, "split"));
        if (json_is_string(scheme))
            op.prepend = !strcmp(json_string_value(scheme), "first") ? PREPEND_FIRST
                       : !strcmp(json_string_value(scheme), "never") ? PREPEND_NEVER
                       : PREPEND_ALWAYS;
        else   /* older files: add_prefix_space */
            op.prepend = json_is_false(json_object_get(p, "add_prefix_space")) ? PREPEND_NEVER
                                                                              : PREPEND_ALWAYS;
        return add_pre(b, op, c);
    }
    return unsupported(c, "pre_tokenizer '%s'", t);
}

/* ---- building: post-processor ------------------------------------------- */

static int special_ids(const json_t *specials, const char *key, ibuf *out, build_ctx *c)
{
    const json_t *s = json_object_get(specials, key);
    const json_t *ids = json_is_object(s) ? json_object_get(s, "ids") : NULL;
    if (!json_is_array(ids))
        return kv_errf(c->e, "%s: post_processor.special_tokens has no ids for '%.40s'",
                       c->name, key);
    for (size_t i = 0; i < json_array_size(ids); i++) {
        const json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return kv_errf(c->e, "%s: post_processor.special_tokens['%.40s'].ids[%zu] is not an "
                           "id", c->name, key, i);
        ib_put(out, (int32_t)json_integer_value(v));
    }
    return out->oom ? oom(c) : 0;
}

static int build_template(bpe_encoder *b, const json_t *p, build_ctx *c)
{
    const json_t *single = json_object_get(p, "single");
    const json_t *specials = json_object_get(p, "special_tokens");
    if (!json_is_array(single))
        return kv_errf(c->e, "%s: post_processor TemplateProcessing has no single template",
                       c->name);
    ibuf pre = { NULL, 0, 0, false, 0 }, post = { NULL, 0, 0, false, 0 };
    bool seen_a = false;
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < json_array_size(single); i++) {
        const json_t *item = json_array_get(single, i);
        const json_t *sp = json_object_get(item, "SpecialToken");
        const json_t *seq = json_object_get(item, "Sequence");
        const json_t *id = json_object_get(sp ? sp : seq, "id");
        if (!json_is_string(id))
            rc = kv_errf(c->e, "%s: post_processor.single[%zu] is neither a SpecialToken nor a "
                         "Sequence with an id", c->name, i);
        else if (seq && (strcmp(json_string_value(id), "A") || seen_a))
            rc = kv_errf(c->e, "%s: post_processor.single[%zu]: a single template holds "
                         "sequence A once", c->name, i);
        else if (seq)
            seen_a = true;
        else
            rc = special_ids(specials, json_string_value(id), seen_a ? &post : &pre, c);
    }
    b->prefix = pre.v;
    b->n_prefix = pre.n;
    b->suffix = post.v;
    b->n_suffix = post.n;
    return rc;
}

static int build_post(bpe_encoder *b, const json_t *p, build_ctx *c)
{
    if (!p || json_is_null(p))
        return 0;
    const char *t = type_of(p);
    if (!strcmp(t, "ByteLevel"))   /* only moves offsets */
        return 0;
    if (!strcmp(t, "TemplateProcessing")) {
        if (b->prefix || b->suffix)
            return unsupported(c, "post_processor with two %s steps", t);
        return build_template(b, p, c);
    }
    if (!strcmp(t, "Sequence")) {
        const json_t *list = json_object_get(p, "processors");
        if (!json_is_array(list))
            return kv_errf(c->e, "%s: post_processor Sequence has no processors array", c->name);
        for (size_t i = 0; i < json_array_size(list); i++) {
            int rc = build_post(b, json_array_get(list, i), c);
            if (rc)
                return rc;
        }
        return 0;
    }
    return unsupported(c, "post_processor '%s'", t);
}

/* ---- building ----------------------------------------------------------- */

int bpe_build(const json_t *root, const char *name, bpe_encoder **out, char *why, size_t why_n,
              kv_err *e)
{
    build_ctx c = { name ? name : "tokenizer.json", why, why_n, e };
    *out = NULL;
    if (why_n)
        why[0] = '\0';
    bpe_encoder *b = calloc(1, sizeof *b);
    if (!b)
        return oom(&c);
    int rc = build_model(b, json_object_get(root, "model"), &c);
    if (rc == 0)
        rc = build_normalizer(b, json_object_get(root, "normalizer"), &c);
    if (rc == 0)   /* after the normalizer: normalized added tokens use it */
        rc = build_added(b, root, &c);
    if (rc == 0)
        rc = resolve_unk(b, root, &c);
    if (rc == 0)
        rc = build_pre(b, json_object_get(root, "pre_tokenizer"), &c);
    if (rc == 0)
        rc = build_post(b, json_object_get(root, "post_processor"), &c);
    if (rc != 0) {
        bpe_free(b);
        return rc == UNSUPPORTED ? 0 : -1;
    }
    *out = b;
    return 0;
}

void bpe_free(bpe_encoder *b)
{
    if (!b)
        return;
    sm_free(&b->vocab);
    free(b->merges.key);
    free(b->merges.rank);
    free(b->merges.merged);
    for (size_t i = 0; i < b->n_added; i++)
        free(b->added[i].content);
    free(b->added);
    free(b->raw.v);
    free(b->normed.v);
    for (size_t i = 0; i < b->n_norm; i++) {
        free(b->norm[i].from);
        free(b->norm[i].to);
    }
    free(b->norm);
    for (size_t i = 0; i < b->n_pre; i++) {
        pcre2_code_free(b->pre[i].re);
        free(b->pre[i].str);
    }
    free(b->pre);
    free(b->prefix);
    free(b->suffix);
    free(b);
}

/* ---- encoding: Unicode helpers ------------------------------------------ */

/* Code point at s (n bytes left, valid UTF-8) and its length. */
static size_t cp_at(const char *s, size_t n, int32_t *cp)
{
    utf8proc_int32_t c;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &c);
    *cp = k > 0 ? c : 0xFFFD;
    return k > 0 ? (size_t)k : 1;
}

static bool is_space(int32_t cp)
{
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D))
        return true;
    utf8proc_category_t cat = utf8proc_category(cp);
    return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL ||
           cat == UTF8PROC_CATEGORY_ZP;
}

static bool is_word(int32_t cp)
{
    utf8proc_category_t cat = utf8proc_category(cp);
    return cp == '_' || (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
           (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO) ||
           (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ME);
}

/* Code point ending at s + end (start bounds the search), or -1; *at gets
 * where it starts. */
static int32_t cp_before(const char *s, size_t start, size_t end, size_t *at)
{
    if (end <= start)
        return -1;
    size_t i = end - 1;
    while (i > start && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    int32_t cp;
    cp_at(s + i, end - i, &cp);
    if (at)
        *at = i;
    return cp;
}

/* Byte offset of the first invalid UTF-8 sequence, or n when valid. */
static size_t utf8_invalid_at(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                              (utf8proc_ssize_t)(n - i), &c);
        if (k <= 0)
            return i;
        i += (size_t)k;
    }
    return n;
}

/* ---- encoding: normalizer ----------------------------------------------- */


static int norm_form(int kind, const char *s, size_t n, sbuf *out)
{
    static const int flags[] = { UTF8PROC_COMPOSE, UTF8PROC_DECOMPOSE,
                                 UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
                                 UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT };
    if (n == 0)
        return 0;
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      (utf8proc_option_t)(UTF8PROC_STABLE | flags[kind]));
    if (k < 0)
        return -1;
    sb_put(out, dst, (size_t)k);
    free(dst);
    return 0;
}

/* One normalizer step on s into out; -2 when out passes limit bytes. */
static int norm_step(const norm_op *op, const char *s, size_t n, sbuf *out, size_t limit)
{
    switch (op->kind) {
    case NORM_REPLACE:
        for (size_t i = 0; i < n;) {
            if (n - i >= op->from_len && !memcmp(s + i, op->from, op->from_len)) {
                sb_put(out, op->to, op->to_len);
                i += op->from_len;
            } else {
                sb_put(out, s + i++, 1);
            }
            if (out->len > limit)
                return -2;
        }
        return 0;
    case NORM_PREPEND:
        if (n)
            sb_put(out, op->to, op->to_len);
        sb_put(out, s, n);
        return 0;
    case NORM_LOWER:
        for (size_t i = 0; i < n;) {
            int32_t cp;
            size_t k = cp_at(s + i, n - i, &cp);
            utf8proc_uint8_t enc[4];
            utf8proc_ssize_t m = utf8proc_encode_char(utf8proc_tolower(cp), enc);
            sb_put(out, enc, (size_t)m);
            i += k;
        }
        return 0;
    default:
        return norm_form(op->kind, s, n, out);
    }
}

/* Runs every normalizer step on s into out (appended). -1 out of memory,
 * -2 when the text grows past NORM_GROWTH x n + NORM_SLACK bytes. */
static int normalize(const bpe_encoder *b, const char *s, size_t n, sbuf *out)
{
    const size_t limit = n > (SIZE_MAX - NORM_SLACK) / NORM_GROWTH ? SIZE_MAX
                                                                   : n * NORM_GROWTH + NORM_SLACK;
    if (b->n_norm == 0) {
        sb_put(out, s, n);
        return out->oom ? -1 : 0;
    }
    sbuf cur = { NULL, 0, 0, false }, next = { NULL, 0, 0, false };
    sb_put(&cur, s, n);
    int rc = cur.oom ? -1 : 0;
    for (size_t i = 0; rc == 0 && i < b->n_norm; i++) {
        next.len = 0;
        rc = norm_step(&b->norm[i], cur.p, cur.len, &next, limit);
        sbuf t = cur;
        cur = next;
        next = t;
        rc = rc == -2 || cur.len > limit ? -2 : rc < 0 || cur.oom ? -1 : 0;
    }
    if (rc == 0)
        sb_put(out, cur.p, cur.len);
    free(cur.p);
    free(next.p);
    return rc < 0 ? rc : out->oom ? -1 : 0;
}

/* ---- encoding: pre-tokenizer -------------------------------------------- */

typedef struct {
    size_t start, end;
    bool match;
} span;

typedef struct {
    span *v;
    size_t n, cap;
    bool oom;
} spans;

static void sp_add(spans *s, size_t start, size_t end, bool match)
{
    if (s->oom)
        return;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        span *q = realloc(s->v, cap * sizeof *q);
        if (!q) {
            s->oom = true;
            return;
        }
        s->v = q;
        s->cap = cap;
    }
    s->v[s->n++] = (span){ start, end, match };
}

/* Matches of op's pattern in s and the gaps between them, in order. */
static int find_matches(const pre_op *op, const char *s, size_t n, spans *out,
                        pcre2_match_data *md)
{
    size_t prev = 0, at = 0;
    while (at <= n) {
        size_t ms, me;
        if (op->re) {
            int rc = pcre2_match(op->re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0)
                return -1;
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            ms = ov[0];
            me = ov[1];
        } else {
            const char *hit = NULL;
            for (size_t i = at; i + op->str_len <= n && !hit; i++)
                if (!memcmp(s + i, op->str, op->str_len))
                    hit = s + i;
            if (!hit)
                break;
            ms = (size_t)(hit - s);
            me = ms + op->str_len;
        }
        if (ms > prev)
            sp_add(out, prev, ms, false);
        if (me > ms)
            sp_add(out, ms, me, true);
        prev = me > prev ? me : prev;
        if (me == ms) {   /* an empty match: step over one character */
            int32_t cp;
            at = me < n ? me + cp_at(s + me, n - me, &cp) : n + 1;
        } else {
            at = me;
        }
    }
    if (prev < n)
        sp_add(out, prev, n, false);
    return out->oom ? -1 : 0;
}

/* Hugging Face's split behaviours over the spans, into dst. */
static void split_spans(const pre_op *op, const char *s, spans *sp, pieces *dst)
{
    if (op->invert)
        for (size_t i = 0; i < sp->n; i++)
            sp->v[i].match = !sp->v[i].match;
    size_t n = 0;
    bool prev_match = false;
    switch (op->behavior) {
    case SPLIT_REMOVED:
        for (size_t i = 0; i < sp->n; i++)
            if (!sp->v[i].match)
                sp->v[n++] = sp->v[i];
        break;
    case SPLIT_ISOLATED:
        n = sp->n;
        break;
    case SPLIT_PREV:
        for (size_t i = 0; i < sp->n; i++) {
            if (sp->v[i].match && !prev_match && n > 0)
                sp->v[n - 1].end = sp->v[i].end;
            else
                sp->v[n++] = sp->v[i];
            prev_match = sp->v[i].match;
        }
        break;
    case SPLIT_NEXT:
        /* Walk backwards: a match joins the piece after it. */
        for (size_t i = sp->n; i-- > 0;) {
            bool m = sp->v[i].match;
            if (m && !prev_match && n > 0)
                sp->v[sp->n - n].start = sp->v[i].start;
            else
                sp->v[sp->n - ++n] = sp->v[i];
            prev_match = m;
        }
        memmove(sp->v, sp->v + sp->n - n, n * sizeof *sp->v);
        break;
    case SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < sp->n; i++) {
            if (n > 0 && sp->v[n - 1].match == sp->v[i].match)
                sp->v[n - 1].end = sp->v[i].end;
            else
                sp->v[n++] = sp->v[i];
        }
        break;
    }
    for (size_t i = 0; i < n; i++)
        pc_add(dst, s + sp->v[i].start, sp->v[i].end - sp->v[i].start);
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
 * the other 68 are numbered from U+0100 in byte order. */
static void byte_level_chars(char out[256][3], unsigned char outlen[256])
{
    int next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) ||
                         (b >= 0xAE && b <= 0xFF);
        int cp = printable ? b : next++;
        outlen[b] = (unsigned char)utf8proc_encode_char(cp, (utf8proc_uint8_t *)out[b]);
    }
}

typedef struct {
    pieces a, b;
    sbuf tmp;
    spans sp;
    pcre2_match_data *md;
    char bl[256][3];
    unsigned char bl_len[256];
} pre_scratch;

/* One pre-tokenizer step over every piece of src into dst. first: src's
 * first piece starts the text (Metaspace's prepend_scheme "first"). */
static int pre_step(const pre_op *op, pre_scratch *ps, const pieces *src, pieces *dst,
                    bool first)
{
    for (size_t i = 0; i < src->n; i++) {
        const char *s = src->buf.p + src->off[i];
        size_t n = src->len[i];
        ps->tmp.len = 0;
        ps->sp.n = 0;
        if (op->kind == PRE_SPLIT) {
            if (find_matches(op, s, n, &ps->sp, ps->md) < 0)
                return -1;
            split_spans(op, s, &ps->sp, dst);
        } else if (op->kind == PRE_BYTE_LEVEL) {
            if (op->prefix_space && s[0] != ' ')
                sb_put(&ps->tmp, " ", 1);
            sb_put(&ps->tmp, s, n);
            if (ps->tmp.oom)
                return -1;
            pieces words = { { NULL, 0, 0, false }, NULL, NULL, 0, 0, false };
            if (op->re) {
                pre_op iso = *op;
                iso.behavior = SPLIT_ISOLATED;
                iso.invert = false;
                if (find_matches(&iso, ps->tmp.p, ps->tmp.len, &ps->sp, ps->md) < 0) {
                    pc_free(&words);
                    return -1;
                }
                split_spans(&iso, ps->tmp.p, &ps->sp, &words);
            } else {
                pc_add(&words, ps->tmp.p, ps->tmp.len);
            }
            sbuf mapped = { NULL, 0, 0, false };
            for (size_t w = 0; w < words.n; w++) {
                mapped.len = 0;
                for (size_t k = 0; k < words.len[w]; k++) {
                    unsigned char byte = (unsigned char)words.buf.p[words.off[w] + k];
                    sb_put(&mapped, ps->bl[byte], ps->bl_len[byte]);
                }
                pc_add(dst, mapped.p, mapped.len);
            }
            bool bad = words.oom || mapped.oom;
            free(mapped.p);
            pc_free(&words);
            if (bad)
                return -1;
        } else {   /* Metaspace */
            for (size_t k = 0; k < n; k++) {
                if (s[k] == ' ')
                    sb_put(&ps->tmp, op->str, op->str_len);
                else
                    sb_put(&ps->tmp, s + k, 1);
            }
            bool starts = ps->tmp.len >= op->str_len && !memcmp(ps->tmp.p, op->str, op->str_len);
            if (!starts && (op->prepend == PREPEND_ALWAYS ||
                            (op->prepend == PREPEND_FIRST && first && i == 0))) {
                sbuf t = { NULL, 0, 0, false };
                sb_put(&t, op->str, op->str_len);
                sb_put(&t, ps->tmp.p, ps->tmp.len);
                free(ps->tmp.p);
                ps->tmp = t;
            }
            if (ps->tmp.oom)
                return -1;
            if (op->split) {
                pre_op at = *op;
                at.re = NULL;
                at.behavior = SPLIT_NEXT;
                at.invert = false;
                if (find_matches(&at, ps->tmp.p, ps->tmp.len, &ps->sp, ps->md) < 0)
                    return -1;
                split_spans(&at, ps->tmp.p, &ps->sp, dst);
            } else {
                pc_add(dst, ps->tmp.p, ps->tmp.len);
            }
        }
        if (dst->oom)
            return -1;
    }
    return 0;
}

/* ---- encoding: BPE ------------------------------------------------------ */

typedef struct {
    int32_t id;
    uint32_t start, len;
    int32_t prev, next;
} symbol;

typedef struct {
    int32_t rank;
    uint32_t pos;
    int32_t left, right;
    int32_t lid, rid;
} candidate;

typedef struct {
    symbol *sym;
    size_t sym_cap;
    candidate *heap;
    size_t heap_n, heap_cap;
    bool oom;
} bpe_scratch;

static bool cand_less(const candidate *a, const candidate *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(bpe_scratch *w, candidate c)
{
    if (w->heap_n == w->heap_cap) {
        size_t cap = w->heap_cap ? w->heap_cap * 2 : 256;
        candidate *q = realloc(w->heap, cap * sizeof *q);
        if (!q) {
            w->oom = true;
            return;
        }
        w->heap = q;
        w->heap_cap = cap;
    }
    size_t i = w->heap_n++;
    while (i > 0 && cand_less(&c, &w->heap[(i - 1) / 2])) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = c;
}

static candidate heap_pop(bpe_scratch *w)
{
    candidate top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0;
    for (;;) {
        size_t k = 2 * i + 1;
        if (k >= w->heap_n)
            break;
        if (k + 1 < w->heap_n && cand_less(&w->heap[k + 1], &w->heap[k]))
            k++;
        if (!cand_less(&w->heap[k], &last))
            break;
        w->heap[i] = w->heap[k];
        i = k;
    }
    if (w->heap_n > 0)
        w->heap[i] = last;
    return top;
}

static void try_pair(const bpe_encoder *b, bpe_scratch *w, int32_t left)
{
    int32_t right = w->sym[left].next;
    if (right < 0 || w->sym[left].id < 0 || w->sym[right].id < 0)
        return;
    uint64_t k = pair_key(w->sym[left].id, w->sym[right].id);
    size_t s = pm_slot(&b->merges, k);
    if (b->merges.key[s] == UINT64_MAX)
        return;
    heap_push(w, (candidate){ b->merges.rank[s], w->sym[left].start, left, right,
                              w->sym[left].id, w->sym[right].id });
}

/* Token ids of one pre-tokenized word. */
static int bpe_word(const bpe_encoder *b, bpe_scratch *w, const char *s, size_t n, ibuf *out,
                    kv_err *e)
{
    if (b->ignore_merges) {
        int32_t id = sm_get(&b->vocab, s, n);
        if (id >= 0) {
            ib_put(out, id);
            return 0;
        }
    }
    if (n > UINT32_MAX / 2)
        return kv_errf(e, "a %zu-byte word is too long to encode", n);
    if (w->sym_cap < n) {
        symbol *q = realloc(w->sym, n * sizeof *q);
        if (!q)
            return kv_errf(e, "out of memory encoding a %zu-byte word", n);
        w->sym = q;
        w->sym_cap = n;
    }
    int32_t count = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        size_t k = cp_at(s + i, n - i, &cp);
        w->sym[count] = (symbol){ sm_get(&b->vocab, s + i, k), (uint32_t)i, (uint32_t)k,
                                  count - 1, -1 };
        if (count > 0)
            w->sym[count - 1].next = count;
        count++;
        i += k;
    }
    w->heap_n = 0;
    for (int32_t i = 0; i + 1 < count; i++)
        try_pair(b, w, i);
    while (w->heap_n > 0 && !w->oom) {
        candidate c = heap_pop(w);
        symbol *l = &w->sym[c.left];
        /* Stale: one side was merged into something else since. */
        if (l->len == 0 || l->next != c.right || l->id != c.lid || w->sym[c.right].id != c.rid)
            continue;
        symbol *r = &w->sym[c.right];
        size_t s2 = pm_slot(&b->merges, pair_key(c.lid, c.rid));
        l->id = b->merges.merged[s2];
        l->len += r->len;
        l->next = r->next;
        if (r->next >= 0)
            w->sym[r->next].prev = c.left;
        r->len = 0;
        r->id = -1;
        if (l->prev >= 0)
            try_pair(b, w, l->prev);
        try_pair(b, w, c.left);
    }
    if (w->oom)
        return kv_errf(e, "out of memory encoding a %zu-byte word", n);
    for (int32_t i = count > 0 ? 0 : -1; i >= 0; i = w->sym[i].next) {
        const symbol *y = &w->sym[i];
        if (y->id >= 0) {
            ib_put(out, y->id);
            continue;
        }
        bool bytes_ok = b->byte_fallback;
        for (uint32_t k = 0; bytes_ok && k < y->len; k++)
            bytes_ok = b->byte_id[(unsigned char)s[y->start + k]] >= 0;
        if (bytes_ok) {
            for (uint32_t k = 0; k < y->len; k++)
                ib_put(out, b->byte_id[(unsigned char)s[y->start + k]]);
        } else if (b->unk >= 0) {
            ib_put(out, b->unk);
        } else {
            int32_t cp;
            cp_at(s + y->start, y->len, &cp);
            return kv_errf(e, "no token spells U+%04X and the tokenizer has neither byte "
                           "fallback nor unk_token", (unsigned)cp);
        }
    }
    return 0;
}

/* ---- encoding ----------------------------------------------------------- */

typedef struct {
    pre_scratch pre;
    bpe_scratch bpe;
    sbuf norm;
} scratch;

/* Normalizes, pre-tokenizes and merges one stretch of text with no added
 * token in it. first: the stretch starts the text. */
static int too_many(const ibuf *out, kv_err *e)
{
    return kv_errf(e, "the text makes more than %zu tokens", out->max);
}

static int encode_plain(const bpe_encoder *b, scratch *w, const char *s, size_t n, bool first,
                        ibuf *out, kv_err *e)
{
    if (n == 0)
        return 0;
    /* One id covers at most the longest entry's bytes: a text that needs
     * more ids than are wanted is refused before it is split (a long
     * prompt through a normalizer that grows it must not take gigabytes
     * first). */
    const size_t room = out->max > out->n ? out->max - out->n : 0;
    if (out->max && b->longest && n / b->longest > room)
        return too_many(out, e);
    pieces *cur = &w->pre.a, *next = &w->pre.b;
    pc_clear(cur);
    pc_add(cur, s, n);
    for (size_t i = 0; i < b->n_pre; i++) {
        pc_clear(next);
        if (pre_step(&b->pre[i], &w->pre, cur, next, first) < 0)
            return kv_errf(e, "out of memory (or a regex failure) pre-tokenizing the text");
        pieces *t = cur;
        cur = next;
        next = t;
    }
    if (cur->oom)
        return kv_errf(e, "out of memory pre-tokenizing the text");
    /* every piece makes at least one id */
    if (out->max && cur->n > out->max - (out->n < out->max ? out->n : out->max))
        return too_many(out, e);
    for (size_t i = 0; i < cur->n; i++)
        if (bpe_word(b, &w->bpe, cur->buf.p + cur->off[i], cur->len[i], out, e) < 0)
            return -1;
    return 0;
}

/* The longest added token of t matching at s[i..n), honouring single_word;
 * -1 when none. */
static int32_t match_at(const bpe_encoder *b, const trie *t, const char *s, size_t i, size_t n,
                        size_t *mlen)
{
    int32_t best = -1, node = 0;
    for (size_t j = i; j < n; j++) {
        int32_t k = t->v[node].child;
        while (k >= 0 && t->v[k].byte != (unsigned char)s[j])
            k = t->v[k].sibling;
        if (k < 0)
            break;
        node = k;
        int32_t tok = t->v[node].tok;
        if (tok < 0)
            continue;
        if (b->added[tok].single_word) {
            int32_t before = cp_before(s, 0, i, NULL), after = -1;
            if (j + 1 < n)
                cp_at(s + j + 1, n - j - 1, &after);
            if ((before >= 0 && is_word(before)) || (after >= 0 && is_word(after)))
                continue;
        }
        best = tok;
        *mlen = j + 1 - i;
    }
    return best;
}

/* Splits s by the added tokens of t; text between them goes to plain (via
 * normalization when normalize_rest), tokens to out. */
static int split_added(const bpe_encoder *b, scratch *w, const trie *t, const char *s, size_t n,
                       bool normalize_rest, bool first, ibuf *out, kv_err *e);

static int encode_rest(const bpe_encoder *b, scratch *w, const char *s, size_t n,
                       bool normalize_rest, bool first, ibuf *out, kv_err *e)
{
    if (n == 0)
        return 0;
    if (!normalize_rest)
        return encode_plain(b, w, s, n, first, out, e);
    sbuf normed = { NULL, 0, 0, false };
    const int nr = normalize(b, s, n, &normed);
    if (nr < 0) {
        free(normed.p);
        if (nr == -2)
            return kv_errf(e, "its normalizer makes the text more than %d times longer "
                           "(chained Replace normalizers?): refused", NORM_GROWTH);
        return kv_errf(e, "out of memory normalizing the text");
    }
    int rc = normed.len == 0 ? 0
           : b->normed.v ? split_added(b, w, &b->normed, normed.p, normed.len, false, first, out, e)
           : encode_plain(b, w, normed.p, normed.len, first, out, e);
    free(normed.p);
    return rc;
}

static int split_added(const bpe_encoder *b, scratch *w, const trie *t, const char *s, size_t n,
                       bool normalize_rest, bool first, ibuf *out, kv_err *e)
{
    size_t start = 0, i = 0;
    while (i < n) {
        size_t mlen = 0;
        int32_t tok = t->v ? match_at(b, t, s, i, n, &mlen) : -1;
        if (tok < 0) {
            i++;
            continue;
        }
        const added_tok *a = &b->added[tok];
        size_t end = i;
        size_t at;
        if (a->lstrip)   /* the token takes the white space before it */
            for (int32_t cp; (cp = cp_before(s, start, end, &at)) >= 0 && is_space(cp);)
                end = at;
        if (encode_rest(b, w, s + start, end - start, normalize_rest, first && start == 0, out,
                        e) < 0)
            return -1;
        ib_put(out, a->id);
        i += mlen;
        for (int32_t cp; a->rstrip && i < n;) {   /* and after it */
            size_t k = cp_at(s + i, n - i, &cp);
            if (!is_space(cp))
                break;
            i += k;
        }
        start = i;
    }
    return encode_rest(b, w, s + start, n - start, normalize_rest, first && start == 0, out, e);
}

int bpe_encode(const bpe_encoder *b, const char *text, size_t len, int add_special,
               size_t max_ids, int32_t **ids, size_t *n, kv_err *e)
{
    *ids = NULL;
    *n = 0;
    size_t bad = utf8_invalid_at(text, len);
    if (bad < len)
        return kv_errf(e, "the text is not valid UTF-8 (byte %zu)", bad);
    scratch w;
    memset(&w, 0, sizeof w);
    w.pre.md = pcre2_match_data_create(1, NULL);
    byte_level_chars(w.pre.bl, w.pre.bl_len);
    ibuf out = { NULL, 0, 0, false, max_ids };
    int rc = w.pre.md ? 0 : kv_errf(e, "out of memory");
    for (size_t i = 0; rc == 0 && add_special && i < b->n_prefix; i++)
        ib_put(&out, b->prefix[i]);
    if (rc == 0)
        rc = split_added(b, &w, &b->raw, text, len, true, true, &out, e);
    for (size_t i = 0; rc == 0 && add_special && i < b->n_suffix; i++)
        ib_put(&out, b->suffix[i]);
    if (rc == 0 && out.oom)
        rc = kv_errf(e, "out of memory for the token ids");
    if (rc == 0 && max_ids && out.n > max_ids)
        rc = too_many(&out, e);
    pc_free(&w.pre.a);
    pc_free(&w.pre.b);
    free(w.pre.tmp.p);
    free(w.pre.sp.v);
    pcre2_match_data_free(w.pre.md);
    free(w.bpe.sym);
    free(w.bpe.heap);
    free(w.norm.p);
    if (rc < 0) {
        free(out.v);
        return -1;
    }
    *ids = out.v;
    *n = out.n;
    return 0;
}
