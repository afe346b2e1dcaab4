/* tokenizer.c — a Hugging Face tokenizer.json: token ids back into text,
 * and text into ids through model/bpe (see tokenizer.h).
 *
 * At load every token is decoded once into one byte arena, so tok_decode is
 * a copy. The JSON is read with jansson and dropped after loading. */
#include "tokenizer.h"
#include "bpe.h"
#include "infile.h"

#include <errno.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK_MAX_IDS   (1 << 24)
/* tokenizer.json size bound (documented in README): real ones are tens of
 * MB (Gemma 3's: 33 MB). */
#define TOK_MAX_BYTES (256L << 20)

struct kv_tokenizer {
    int n;               /* ids 0..n-1 */
    uint32_t *off;       /* (n + 1): token i is text[off[i] .. off[i+1]) */
    unsigned char *has;  /* (n): HAS_VOCAB or HAS_ADDED when id i has a token */
    char *text;          /* decoded bytes of every token, back to back */
    bpe_encoder *enc;    /* NULL when the file cannot encode: why says why */
    kv_err why;
    char *name;          /* the file, for messages */
};

enum { HAS_NONE, HAS_VOCAB, HAS_ADDED };

/* ---- how tokens are spelled --------------------------------------------- */

typedef struct {
    bool byte_level;     /* GPT-2 bytes_to_unicode characters */
    bool metaspace;      /* "▁" is a space */
    bool byte_fallback;  /* "<0xNN>" is a raw byte */
} spelling;

/* GPT-2's bytes_to_unicode, reversed: code point -> byte, -1 for others.
 * Printable Latin-1 bytes stand for themselves; the other 68 bytes are
 * numbered from U+0100 in byte order. */
#define BYTE_LEVEL_CPS 324

static void byte_level_table(int16_t rev[BYTE_LEVEL_CPS])
{
    int next = 256;
    for (int cp = 0; cp < BYTE_LEVEL_CPS; cp++)
        rev[cp] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC)
                         || (b >= 0xAE && b <= 0xFF);
        rev[printable ? b : next++] = (int16_t)b;
    }
}

static const char *type_of(const json_t *o)
{
    const json_t *t = json_is_object(o) ? json_object_get(o, "type") : NULL;
    return json_is_string(t) ? json_string_value(t) : "";
}

static bool replace_is_metaspace(const json_t *d)
{
    const json_t *pat = json_object_get(d, "pattern");
    const json_t *s = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
    const json_t *content = json_object_get(d, "content");
    return json_is_string(s) && !strcmp(json_string_value(s), "\xE2\x96\x81")
           && json_is_string(content) && !strcmp(json_string_value(content), " ");
}

/* Reads a decoder (or pre_tokenizer) and the Sequence steps inside it. */
static void scan_steps(const json_t *d, const char *list_key, spelling *sp)
{
    const char *t = type_of(d);
    if (!strcmp(t, "ByteLevel"))
        sp->byte_level = true;
    else if (!strcmp(t, "Metaspace"))
        sp->metaspace = true;
    else if (!strcmp(t, "ByteFallback"))
        sp->byte_fallback = true;
    else if (!strcmp(t, "Replace") && replace_is_metaspace(d))
        sp->metaspace = true;
    else if (!strcmp(t, "Sequence")) {
        const json_t *steps = json_object_get(d, list_key);
        for (size_t i = 0; json_is_array(steps) && i < json_array_size(steps); i++)
            scan_steps(json_array_get(steps, i), list_key, sp);
    }
}

/* The decoder says how tokens are spelled; without one, the pre-tokenizer
 * and the model's byte_fallback flag tell. */
static spelling detect_spelling(const json_t *root, const json_t *model)
{
    spelling sp = { false, false, false };
    const json_t *dec = json_object_get(root, "decoder");
    if (json_is_object(dec)) {
        scan_steps(dec, "decoders", &sp);
    } else {
        scan_steps(json_object_get(root, "pre_tokenizer"), "pretokenizers", &sp);
        sp.byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    }
    if (sp.byte_level)
        sp.metaspace = sp.byte_fallback = false;
    return sp;
}

/* ---- the byte arena ----------------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} arena;

static void put(arena *a, const void *src, size_t n)
{
    if (a->oom)
        return;
    if (a->len + n > a->cap) {
        size_t cap = a->cap ? a->cap : 4096;
        while (cap < a->len + n)
            cap *= 2;
        char *q = cap <= (size_t)TOK_MAX_BYTES ? realloc(a->p, cap) : NULL;
        if (!q) {
            a->oom = true;
            return;
        }
        a->p = q;
        a->cap = cap;
    }
    memcpy(a->p + a->len, src, n);
    a->len += n;
}

/* One decoded byte; NUL would end the caller's string, so it is spelled. */
static void put_byte(arena *a, int b)
{
    unsigned char c = (unsigned char)b;
    if (c == 0)
        put(a, "<0x00>", 6);
    else
        put(a, &c, 1);
}

/* Length of the UTF-8 sequence starting at s (1 for a stray byte). */
static size_t utf8_len(const unsigned char *s, size_t left)
{
    size_t n = s[0] < 0x80 ? 1 : (s[0] >> 5) == 6 ? 2 : (s[0] >> 4) == 14 ? 3
             : (s[0] >> 3) == 30 ? 4 : 1;
    return n <= left ? n : 1;
}

static int utf8_cp(const unsigned char *s, size_t n)
{
    static const unsigned char lead_mask[5] = { 0, 0x7F, 0x1F, 0x0F, 0x07 };
    int cp = s[0] & lead_mask[n];
    for (size_t i = 1; i < n; i++)
        cp = (cp << 6) | (s[i] & 0x3F);
    return cp;
}

static void put_byte_level(arena *a, const unsigned char *s, size_t n,
                           const int16_t rev[BYTE_LEVEL_CPS])
{
    for (size_t i = 0; i < n;) {
        size_t k = utf8_len(s + i, n - i);
        int cp = utf8_cp(s + i, k);
        if (cp < BYTE_LEVEL_CPS && rev[cp] >= 0)
            put_byte(a, rev[cp]);
        else
            put(a, s + i, k);
        i += k;
    }
}

static int hex_digit(unsigned char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
         : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* "<0xNN>" -> NN, else -1. */
static int byte_token(const unsigned char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static void put_sentencepiece(arena *a, const unsigned char *s, size_t n, const spelling *sp)
{
    int b = sp->byte_fallback ? byte_token(s, n) : -1;
    if (b >= 0) {
        put_byte(a, b);
        return;
    }
    for (size_t i = 0; i < n;) {
        if (sp->metaspace && n - i >= 3 && !memcmp(s + i, "\xE2\x96\x81", 3)) {
            put(a, " ", 1);
            i += 3;
        } else {
            put_byte(a, s[i++]);
        }
    }
}

/* ---- reading the vocabulary --------------------------------------------- */

typedef struct {
    int id;
    const char *s;
    size_t len;
    bool special;
    bool added;   /* from added_tokens */
} entry;

typedef struct {
    entry *v;
    size_t n, cap;
    int max_id;
} entries;

static int add_entry(entries *es, int id, const char *s, size_t len, bool special, bool added)
{
    if (es->n == es->cap) {
        size_t cap = es->cap ? es->cap * 2 : 1024;
        entry *q = realloc(es->v, cap * sizeof *q);
        if (!q)
            return -1;
        es->v = q;
        es->cap = cap;
    }
    es->v[es->n++] = (entry){ id, s, len, special, added };
    if (id > es->max_id)
        es->max_id = id;
    return 0;
}

static bool id_ok(const json_t *v)
{
    return json_is_integer(v) && json_integer_value(v) >= 0
           && json_integer_value(v) < TOK_MAX_IDS;
}

static int oom(const char *name, kv_err *e)
{
    return kv_errf(e, "%s: out of memory", name);
}

/* BPE / WordPiece / WordLevel: {"token": id, ...}. */
static int read_vocab_object(const json_t *vocab, const char *name, entries *es, kv_err *e)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!id_ok(v))
            return kv_errf(e, "%s: model.vocab[\"%.40s\"] is not an id in 0..%d", name,
                           key, TOK_MAX_IDS - 1);
        if (add_entry(es, (int)json_integer_value(v), key,
                      json_object_iter_key_len(json_object_key_to_iter(key)), false, false))
            return oom(name, e);
    }
    return 0;
}

/* Unigram: [["piece", score], ...]; the id is the position. */
static int read_vocab_array(const json_t *vocab, const char *name, entries *es, kv_err *e)
{
    size_t n = json_array_size(vocab);
    if (n > TOK_MAX_IDS)
        return kv_errf(e, "%s: model.vocab has %zu entries; at most %d", name, n, TOK_MAX_IDS);
    for (size_t i = 0; i < n; i++) {
        const json_t *p = json_array_get(vocab, i);
        const json_t *s = json_is_array(p) ? json_array_get(p, 0) : NULL;
        if (!json_is_string(s))
            return kv_errf(e, "%s: model.vocab[%zu] is not [\"piece\", score]", name, i);
        if (add_entry(es, (int)i, json_string_value(s), json_string_length(s), false, false))
            return oom(name, e);
    }
    return 0;
}

static int read_added(const json_t *added, const char *name, entries *es, kv_err *e)
{
    if (!added || json_is_null(added))
        return 0;
    if (!json_is_array(added))
        return kv_errf(e, "%s: added_tokens is not an array", name);
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *t = json_array_get(added, i);
        const json_t *id = json_object_get(t, "id"), *c = json_object_get(t, "content");
        const json_t *sp = json_object_get(t, "special");
        if (!id_ok(id) || !json_is_string(c) || (sp && !json_is_boolean(sp)))
            return kv_errf(e, "%s: added_tokens[%zu] needs an id in 0..%d, a string "
                           "content and a boolean special", name, i, TOK_MAX_IDS - 1);
        if (add_entry(es, (int)json_integer_value(id), json_string_value(c),
                      json_string_length(c), json_is_true(sp), true))
            return oom(name, e);
    }
    return 0;
}

static int read_entries(const json_t *root, const json_t *model, const char *name,
                        entries *es, kv_err *e)
{
    const json_t *vocab = json_object_get(model, "vocab");
    int rc;
    if (json_is_object(vocab))
        rc = read_vocab_object(vocab, name, es, e);
    else if (json_is_array(vocab))
        rc = read_vocab_array(vocab, name, es, e);
    else
        return kv_errf(e, "%s: model.vocab is missing or neither an object nor an array",
                       name);
    return rc ? rc : read_added(json_object_get(root, "added_tokens"), name, es, e);
}

/* ---- building ----------------------------------------------------------- */

static void decode_entry(arena *a, const entry *en, const spelling *sp,
                         const int16_t rev[BYTE_LEVEL_CPS])
{
    const unsigned char *s = (const unsigned char *)en->s;
    if (en->special) {
        for (size_t i = 0; i < en->len; i++)
            put_byte(a, s[i]);
    } else if (sp->byte_level) {
        put_byte_level(a, s, en->len, rev);
    } else {
        put_sentencepiece(a, s, en->len, sp);
    }
}

/* Later entries win: added_tokens come after the vocabulary. */
static int build(const entries *es, const spelling *sp, const char *name,
                 kv_tokenizer *t, kv_err *e)
{
    int16_t rev[BYTE_LEVEL_CPS];
    arena a = { NULL, 0, 0, false };
    t->n = es->max_id + 1;
    int32_t *slot = malloc(((size_t)t->n + 1) * sizeof *slot);
    t->off = malloc(((size_t)t->n + 1) * sizeof *t->off);
    t->has = calloc((size_t)t->n + 1, 1);
    if (!slot || !t->off || !t->has) {
        free(slot);
        return oom(name, e);
    }
    byte_level_table(rev);
    for (int i = 0; i < t->n; i++)
        slot[i] = -1;
    for (size_t k = 0; k < es->n; k++)
        slot[es->v[k].id] = (int32_t)k;
    for (int i = 0; i < t->n && !a.oom; i++) {
        t->off[i] = (uint32_t)a.len;
        t->has[i] = slot[i] < 0 ? HAS_NONE : es->v[slot[i]].added ? HAS_ADDED : HAS_VOCAB;
        if (slot[i] >= 0)
            decode_entry(&a, &es->v[slot[i]], sp, rev);
    }
    t->off[t->n] = (uint32_t)a.len;
    if (!a.p && !a.oom)   /* every token empty: keep text a valid pointer */
        a.p = malloc(1);
    a.oom = a.oom || !a.p;
    t->text = a.p;
    free(slot);
    return a.oom ? kv_errf(e, "%s: decoded vocabulary too large", name) : 0;
}

/* A file kvdiff cannot encode with (an unknown pipeline step, or a broken
 * part only encoding reads, such as a merge of unknown tokens) still
 * decodes: the problem is kept for tok_encode to report. */
static int build_encoder(const json_t *root, kv_tokenizer *t, kv_err *e)
{
    char why[256];
    kv_err be = {{0}};
    if (bpe_build(root, t->name, &t->enc, why, sizeof why, &be) < 0) {
        if (strstr(be.msg, "out of memory"))
            return kv_errf(e, "%s", be.msg);
        kv_errf(&t->why, "%s (so it cannot encode text)", be.msg);
    } else if (!t->enc) {
        kv_errf(&t->why, "%s: cannot encode text: %s is not supported", t->name, why);
    }
    return 0;
}

/* What any reader of the file would take for the model's kind or its
 * unknown token, of the wrong JSON kind. */
static bool malformed_model(const json_t *model, const char *name, kv_err *e)
{
    const json_t *type = json_object_get(model, "type"), *unk = json_object_get(model, "unk_token");
    if (type && !json_is_string(type))
        return kv_errf(e, "%s: model.type is not a string", name), true;
    if (unk && !json_is_null(unk) && !json_is_string(unk))
        return kv_errf(e, "%s: model.unk_token is not a string (or null)", name), true;
    return false;
}

int tok_parse(const char *text, size_t len, const char *name, kv_tokenizer **out, kv_err *e)
{
    json_error_t je;
    entries es = { NULL, 0, 0, -1 };
    if (!name)
        name = "tokenizer.json";
    if (!out)
        return kv_errf(e, "%s: nowhere to put the tokenizer", name);
    *out = NULL;
    if (!text)
        return kv_errf(e, "%s: no text to parse", name);
    json_t *root = json_loadb(text, len, JSON_ALLOW_NUL, &je);
    if (!root)
        return kv_errf(e, "%s: not valid JSON: %s (line %d, column %d)", name, je.text,
                       je.line, je.column);
    const json_t *model = json_object_get(root, "model");
    kv_tokenizer *t = calloc(1, sizeof *t);
    int rc = !t ? oom(name, e)
           : !json_is_object(model) ? kv_errf(e, "%s: model is missing or not an object", name)
           : malformed_model(model, name, e) ? -1
           : read_entries(root, model, name, &es, e);
    if (rc == 0) {
        spelling sp = detect_spelling(root, model);
        rc = build(&es, &sp, name, t, e);
    }
    if (rc == 0 && !(t->name = strdup(name)))
        rc = oom(name, e);
    if (rc == 0)
        rc = build_encoder(root, t, e);
    free(es.v);
    json_decref(root);
    if (rc) {
        tok_free(t);
        return -1;
    }
    *out = t;
    return 0;
}

/* ---- loading ------------------------------------------------------------ */

static int read_file(FILE *f, const char *path, char **buf, size_t *len, kv_err *e)
{
    size_t cap = 0, n = 0;
    char *p = NULL;
    for (;;) {
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 1 << 16;
            char *q = ncap <= (size_t)TOK_MAX_BYTES ? realloc(p, ncap) : NULL;
            if (!q) {
                free(p);
                return kv_errf(e, "%s: too large (or out of memory)", path);
            }
            p = q;
            cap = ncap;
        }
        size_t got = fread(p + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f)) {
        free(p);
        return kv_errf(e, "%s: cannot read: %s", path, strerror(errno));
    }
    *buf = p;
    *len = n;
    return 0;
}

int tok_load(const char *dir, kv_tokenizer **out, kv_err *e)
{
    if (!out)
        return kv_errf(e, "tok_load: nowhere to put the tokenizer");
    *out = NULL;
    if (!dir)
        return kv_errf(e, "tok_load: no folder");
    size_t n = strlen(dir) + sizeof "/tokenizer.json";
    char *path = malloc(n);
    if (!path)
        return kv_errf(e, "%s: out of memory", dir);
    snprintf(path, n, "%s/tokenizer.json", dir);
    kv_err oe = {{0}};
    FILE *f = infile_open(path, TOK_MAX_BYTES, &oe);
    int rc = 0;
    if (!f) {
        if (errno != ENOENT)
            rc = kv_errf(e, "%s", oe.msg);
    } else {
        char *text = NULL;
        size_t len = 0;
        rc = read_file(f, path, &text, &len, e);
        fclose(f);
        if (rc == 0)
            rc = tok_parse(text, len, path, out, e);
        free(text);
    }
    free(path);
    return rc;
}

/* ---- decoding ----------------------------------------------------------- */

int tok_count(const kv_tokenizer *t)
{
    return t ? t->n : 0;
}

static size_t append(char *buf, size_t n, const char *s, size_t len)
{
    if (!buf || n == 0)
        return len;
    size_t used = strnlen(buf, n);
    if (used == n) {
        buf[n - 1] = '\0';
        return len;
    }
    size_t room = n - 1 - used;
    size_t k = len < room ? len : room;
    memcpy(buf + used, s, k);
    buf[used + k] = '\0';
    return len;
}

size_t tok_decode(const kv_tokenizer *t, int id, char *buf, size_t n)
{
    if (t && id >= 0 && id < t->n && t->has[id])
        return append(buf, n, t->text + t->off[id], t->off[id + 1] - t->off[id]);
    char unk[32];
    int len = snprintf(unk, sizeof unk, "<unk:%d>", id);
    return append(buf, n, unk, (size_t)len);
}

void tok_free(kv_tokenizer *t)
{
    if (!t)
        return;
    bpe_free(t->enc);
    free(t->name);
    free(t->off);
    free(t->has);
    free(t->text);
    free(t);
}

/* ---- encoding ----------------------------------------------------------- */

static int encode_max(const kv_tokenizer *t, const char *text, size_t len, int add_special,
                      size_t max_ids, int32_t **ids, int *n, kv_err *e)
{
    if (!ids || !n)
        return kv_errf(e, "tok_encode: nowhere to put the ids");
    *ids = NULL;
    *n = 0;
    if (!t)
        return kv_errf(e, "no tokenizer.json to encode text with");
    if (!t->enc)
        return kv_errf(e, "%s", t->why.msg);
    if (!text && len)
        return kv_errf(e, "tok_encode: no text");
    int32_t *out = NULL;
    size_t count = 0;
    if (bpe_encode(t->enc, text ? text : "", len, add_special, max_ids, &out, &count, e) < 0)
        return kv_err_prefix(e, t->name);
    if (count > INT32_MAX) {
        free(out);
        return kv_errf(e, "%s: the text makes %zu tokens; at most %d", t->name, count,
                       INT32_MAX);
    }
    *ids = out;
    *n = (int)count;
    return 0;
}

int tok_encode(const kv_tokenizer *t, const char *text, size_t len, int add_special,
               int32_t **ids, int *n, kv_err *e)
{
    return encode_max(t, text, len, add_special, 0, ids, n, e);
}

int tok_check_vocab(const kv_tokenizer *t, int model_vocab, char *note, size_t note_n,
                    kv_err *e)
{
    if (note_n)
        note[0] = '\0';
    if (!t || t->n <= model_vocab)
        return 0;
    int first_vocab = -1, n_added = 0, first_added = -1;
    for (int i = model_vocab; i < t->n; i++) {
        if (t->has[i] == HAS_VOCAB && first_vocab < 0)
            first_vocab = i;
        if (t->has[i] == HAS_ADDED && n_added++ == 0)
            first_added = i;
    }
    if (first_vocab >= 0)
        return kv_errf(e, "%s: has %d ids but the model's vocabulary has %d (id %d is a "
                       "token of its vocabulary): not this model's tokenizer", t->name, t->n,
                       model_vocab, first_vocab);
    char tok[48] = "";
    tok_decode(t, first_added, tok, sizeof tok);
    snprintf(note, note_n, "%s: has %d ids, the model %d: the %d past it (%s%d \"%s\") %s added "
             "token%s the model has no embedding for (Gemma 3's image placeholder is one); "
             "prompts that use %s are refused", t->name, t->n, model_vocab, n_added,
             n_added > 1 ? "from " : "", first_added, tok, n_added > 1 ? "are" : "is an",
             n_added > 1 ? "s" : "", n_added > 1 ? "them" : "it");
    return 0;
}

int tok_encode_prompt(const kv_tokenizer *t, const char *text, size_t len, int model_vocab,
                      int max_ids, int32_t **ids, int *n, kv_err *e)
{
    *ids = NULL;
    *n = 0;
    if (encode_max(t, text, len, 1, max_ids > 0 ? (size_t)max_ids : 0, ids, n, e) < 0) {
        if (max_ids > 0 && strstr(e->msg, "the text makes more than"))
            kv_errf(e, "the text makes more than %d tokens, the most positions the model "
                       "runs (max_position_embeddings)", max_ids);
        return -1;
    }
    for (int i = 0; i < *n; i++) {
        if ((*ids)[i] >= model_vocab) {
            char piece[64] = "";
            tok_decode(t, (*ids)[i], piece, sizeof piece);
            kv_errf(e, "the text holds token %d \"%s\", past the model's %d ids", (*ids)[i],
                    piece, model_vocab);
            free(*ids);
            *ids = NULL;
            *n = 0;
            return -1;
        }
    }
    if (*n == 0) {
        free(*ids);
        *ids = NULL;
        return kv_errf(e, "the text makes no tokens; a prompt needs at least one");
    }
    return 0;
}

int tok_read_text(const char *path, char **text, size_t *len, kv_err *e)
{
    /* Through infile_open: a FIFO or a device given as a prompt file must
     * not hang or fill memory. */
    return infile_read_all(path, TOK_TEXT_MAX, text, len, e);
}
