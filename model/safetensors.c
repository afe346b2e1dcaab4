/* safetensors.c — the safetensors format: a read-only mapped reader that
 * checks every header field before handing out views, a sharded-folder
 * loader (model.safetensors.index.json), and a streaming writer that goes
 * through a temporary file renamed into place only when complete.
 *
 * Layout: 8-byte little-endian header length N, N bytes of JSON header,
 * then the data area; data_offsets count from the first byte after the
 * header. */
/* sync_file_range (Linux) starts a big file's writeback early. */
#define _GNU_SOURCE
#include "safetensors.h"
#include "infile.h"
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation's limit: a header is JSON text of a few
 * hundred bytes per tensor, so anything larger is a corrupt length. */
#define ST_MAX_HEADER 100000000u

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

/* ------------------------------------------------------------ errors */

/* kv_errf, except that control characters (a tensor name may hold "\n")
 * show as '?', so that every message stays on one line. */
__attribute__((format(printf, 2, 3)))
static int st_errf(kv_err *e, const char *fmt, ...)
{
    if (!e)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    kv_err_words(e);
    for (char *c = e->msg; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    return -1;
}

/* ------------------------------------------------------------ dtypes */

static const char *const dtype_names[ST_DTYPE_COUNT] = {
    [ST_F32] = "F32",   [ST_F16] = "F16",   [ST_BF16] = "BF16",
    [ST_F64] = "F64",   [ST_I64] = "I64",   [ST_I32] = "I32",
    [ST_I16] = "I16",   [ST_I8] = "I8",     [ST_U8] = "U8",
    [ST_BOOL] = "BOOL", [ST_F8_E4M3] = "F8_E4M3", [ST_F8_E5M2] = "F8_E5M2",
    [ST_U16] = "U16",   [ST_U32] = "U32",   [ST_U64] = "U64",
};

static const unsigned char dtype_sizes[ST_DTYPE_COUNT] = {
    [ST_F32] = 4, [ST_F16] = 2, [ST_BF16] = 2, [ST_F64] = 8, [ST_I64] = 8,
    [ST_I32] = 4, [ST_I16] = 2, [ST_I8] = 1,   [ST_U8] = 1,  [ST_BOOL] = 1,
    [ST_F8_E4M3] = 1, [ST_F8_E5M2] = 1, [ST_U16] = 2, [ST_U32] = 4, [ST_U64] = 8,
};

static bool dtype_valid(st_dtype d)
{
    return (unsigned)d < ST_DTYPE_COUNT;
}

const char *st_dtype_name(st_dtype d)
{
    return dtype_valid(d) ? dtype_names[d] : "?";
}

size_t st_dtype_size(st_dtype d)
{
    return dtype_valid(d) ? dtype_sizes[d] : 0;
}

static int dtype_from_name(const char *s, st_dtype *out)
{
    for (int d = 0; d < ST_DTYPE_COUNT; d++)
        if (strcmp(s, dtype_names[d]) == 0) {
            *out = (st_dtype)d;
            return 0;
        }
    return -1;
}

static bool dtype_is_float(st_dtype d)
{
    return d == ST_F32 || d == ST_F16 || d == ST_BF16;
}

/* ------------------------------------------------------------ conversions */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float st_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t st_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)      /* NaN: keep sign, force quiet bit */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);           /* round to nearest even; may carry to inf */
    return (uint16_t)(u >> 16);
}

static uint16_t bf16_select(uint32_t u)
{
    uint32_t nan = (u >> 16) | 0x0040u;
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t is_nan = 0u - (uint32_t)((u & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((nan & is_nan) | (rounded & ~is_nan));
}

void st_f32_to_bf16_n(const float *restrict src, size_t n, uint16_t *restrict dst)
{
    /* st_f32_to_bf16 with a mask for its branch, in blocks of 16 the
     * compiler vectorises: a 1B model is a billion of these. */
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (size_t k = 0; k < 16; k++)
            dst[i + k] = bf16_select(f32_bits(src[i + k]));
    for (; i < n; i++)
        dst[i] = bf16_select(f32_bits(src[i]));
}

float st_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f)                            /* inf, or NaN with its payload */
        return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0)
            return f32_from_bits(sign);
        int e = 1;                              /* subnormal: normalize */
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        mant &= 0x3ffu;
        exp = (uint32_t)(e + 127 - 15);
        return f32_from_bits(sign | (exp << 23) | (mant << 13));
    }
    return f32_from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

/* m >> shift rounded to nearest, ties to even (1 <= shift <= 31). */
static uint32_t shift_round_even(uint32_t m, int shift)
{
    uint32_t kept = m >> shift;
    uint32_t rest = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (kept & 1u)))
        kept++;
    return kept;
}

uint16_t st_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xffu;
    uint32_t mant = u & 0x7fffffu;
    if (exp == 0xff)                            /* inf; NaN stays a (quiet) NaN */
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
    int e = (int)exp - 127 + 15;                /* f16 biased exponent */
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        /* Subnormal result: value = (mant | 1<<23) * 2^(e-14-24) in f16 units
         * of 2^-24; below half the smallest subnormal it rounds to zero. */
        if (e < -10)
            return sign;
        return (uint16_t)(sign | shift_round_even(mant | 0x800000u, 14 - e));
    }
    /* Carry out of the mantissa correctly bumps the exponent, up to inf. */
    uint32_t h = ((uint32_t)e << 10) + shift_round_even(mant, 13);
    return (uint16_t)(sign | h);
}

/* ------------------------------------------------------------ st_file */

struct st_file {
    st_tensor *tensors;          /* (count) header order; shard order first */
    size_t count;
    const st_tensor **by_name;   /* (count) sorted by name, for st_find */
    json_t *header;              /* parsed header; tensor names point into it */
    const json_t *metadata;      /* __metadata__ of the (first) file, or NULL */
    char *path;                  /* name used in messages; st_tensor.file */
    void *map;                   /* the mapping st_open made, or NULL */
    size_t map_len;
    st_file **shards;            /* (nshards) owned members of a sharded set */
    size_t nshards;
};

void st_close(st_file *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->nshards; i++)
        st_close(f->shards[i]);
    free(f->shards);
    free(f->tensors);
    free(f->by_name);
    json_decref(f->header);
    free(f->path);
    if (f->map)
        munmap(f->map, f->map_len);
    free(f);
}

size_t st_count(const st_file *f)
{
    return f ? f->count : 0;
}

const st_tensor *st_at(const st_file *f, size_t i)
{
    return f && i < f->count ? &f->tensors[i] : NULL;
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    size_t lo = 0, hi = f->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, f->by_name[mid]->name);
        if (c == 0)
            return f->by_name[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *st_metadata(const st_file *f, const char *key)
{
    if (!f || !f->metadata || !key)
        return NULL;
    return json_string_value(json_object_get(f->metadata, key));
}

static st_file *file_new(const char *name, kv_err *e)
{
    st_file *f = calloc(1, sizeof *f);
    if (f)
        f->path = strdup(name);
    if (!f || !f->path) {
        free(f);
        st_errf(e, "%s: out of memory", name);
        return NULL;
    }
    return f;
}

/* Equal names (only across shards) keep their shard order, so a message
 * about them is the same on every run. */
static int by_name_cmp(const void *a, const void *b)
{
    const st_tensor *ta = *(const st_tensor *const *)a, *tb = *(const st_tensor *const *)b;
    int c = strcmp(ta->name, tb->name);
    return c ? c : (ta > tb) - (ta < tb);
}

/* Sorts the name index; with shards, two tensors of one name are an error. */
static int build_index(st_file *f, kv_err *e)
{
    f->by_name = malloc((f->count ? f->count : 1) * sizeof *f->by_name);
    if (!f->by_name)
        return st_errf(e, "%s: out of memory", f->path);
    for (size_t i = 0; i < f->count; i++)
        f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, f->count, sizeof *f->by_name, by_name_cmp);
    for (size_t i = 1; i < f->count; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return st_errf(e, "%s: tensor '%s' is in both %s and %s", f->path,
                           f->by_name[i]->name, f->by_name[i - 1]->file,
                           f->by_name[i]->file);
    return 0;
}

/* ------------------------------------------------------------ header parsing */

static const char *json_kind(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "real";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    }
    return "value";
}

static uint64_t read_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int read_header_len(const char *path, const unsigned char *buf, size_t len,
                           uint64_t *hlen, kv_err *e)
{
    if (len == 0)
        return st_errf(e, "%s: empty file", path);
    if (len < 8)
        return st_errf(e, "%s: file has %zu bytes, too short for the 8-byte header length",
                       path, len);
    *hlen = read_le64(buf);
    if (*hlen > len - 8)
        return st_errf(e, "%s: header length %llu runs past the end of the file (%zu bytes)",
                       path, (unsigned long long)*hlen, len);
    if (*hlen > ST_MAX_HEADER)
        return st_errf(e, "%s: header length %llu is over the %u-byte limit", path,
                       (unsigned long long)*hlen, ST_MAX_HEADER);
    const void *nul = memchr(buf + 8, '\0', (size_t)*hlen);
    if (nul)
        return st_errf(e, "%s: header contains a NUL byte at offset %td", path,
                       (const unsigned char *)nul - buf);
    return 0;
}

static const json_t *tensor_field(const st_tensor *t, const json_t *obj, const char *key,
                                  kv_err *e)
{
    const json_t *v = json_object_get(obj, key);
    if (!v)
        st_errf(e, "%s: tensor '%s' has no %s", t->file, t->name, key);
    return v;
}

/* Element idx of a JSON array named `what` as a non-negative integer. */
static int tensor_uint(const st_tensor *t, const json_t *arr, const char *what, size_t idx,
                       uint64_t *out, kv_err *e)
{
    const json_t *v = json_array_get(arr, idx);
    if (!json_is_integer(v))
        return st_errf(e, "%s: tensor '%s': %s[%zu] is a JSON %s, not an integer",
                       t->file, t->name, what, idx, json_kind(v));
    long long x = json_integer_value(v);
    if (x < 0)
        return st_errf(e, "%s: tensor '%s': %s[%zu] is %lld, negative", t->file, t->name,
                       what, idx, x);
    *out = (uint64_t)x;
    return 0;
}

static int parse_dtype(st_tensor *t, const json_t *obj, kv_err *e)
{
    const json_t *v = tensor_field(t, obj, "dtype", e);
    if (!v)
        return -1;
    if (!json_is_string(v))
        return st_errf(e, "%s: tensor '%s': dtype is a JSON %s, not a string", t->file,
                       t->name, json_kind(v));
    if (dtype_from_name(json_string_value(v), &t->dtype) < 0)
        return st_errf(e, "%s: tensor '%s' has unknown dtype '%s'", t->file, t->name,
                       json_string_value(v));
    return 0;
}

static int parse_shape(st_tensor *t, const json_t *obj, kv_err *e)
{
    const json_t *v = tensor_field(t, obj, "shape", e);
    if (!v)
        return -1;
    if (!json_is_array(v))
        return st_errf(e, "%s: tensor '%s': shape is a JSON %s, not an array", t->file,
                       t->name, json_kind(v));
    if (json_array_size(v) > ST_MAX_DIMS)
        return st_errf(e, "%s: tensor '%s': shape has %zu dimensions, more than %d",
                       t->file, t->name, json_array_size(v), ST_MAX_DIMS);
    t->ndim = (int)json_array_size(v);
    t->nelem = 1;
    for (int i = 0; i < t->ndim; i++) {
        uint64_t dim;
        if (tensor_uint(t, v, "shape", (size_t)i, &dim, e) < 0)
            return -1;
        t->shape[i] = (int64_t)dim;
        if (__builtin_mul_overflow(t->nelem, dim, &t->nelem))
            return st_errf(e, "%s: tensor '%s': shape product overflows 64 bits", t->file,
                           t->name);
    }
    if (__builtin_mul_overflow(t->nelem, (uint64_t)st_dtype_size(t->dtype), &t->nbytes))
        return st_errf(e, "%s: tensor '%s': byte size (%llu elements of %s) overflows 64 bits",
                       t->file, t->name, (unsigned long long)t->nelem,
                       st_dtype_name(t->dtype));
    return 0;
}

static void format_shape(const st_tensor *t, char *buf, size_t size)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < t->ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "",
                                 (long long)t->shape[i]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
}

static int parse_offsets(st_tensor *t, const json_t *obj, const unsigned char *data,
                         uint64_t data_len, kv_err *e)
{
    const json_t *v = tensor_field(t, obj, "data_offsets", e);
    if (!v)
        return -1;
    if (!json_is_array(v) || json_array_size(v) != 2)
        return st_errf(e, "%s: tensor '%s': data_offsets is not a [begin, end] pair",
                       t->file, t->name);
    uint64_t begin, end;
    if (tensor_uint(t, v, "data_offsets", 0, &begin, e) < 0 ||
        tensor_uint(t, v, "data_offsets", 1, &end, e) < 0)
        return -1;
    if (begin > end)
        return st_errf(e, "%s: tensor '%s': data_offsets [%llu, %llu] are reversed",
                       t->file, t->name, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_len)
        return st_errf(e, "%s: tensor '%s' ends at byte %llu but the data area has %llu bytes",
                       t->file, t->name, (unsigned long long)end,
                       (unsigned long long)data_len);
    if (end - begin != t->nbytes) {
        char shape[256];
        format_shape(t, shape, sizeof shape);
        return st_errf(e, "%s: tensor '%s' has %llu bytes (data_offsets [%llu, %llu]) but "
                       "shape %s of %s needs %llu", t->file, t->name,
                       (unsigned long long)(end - begin), (unsigned long long)begin,
                       (unsigned long long)end, shape, st_dtype_name(t->dtype),
                       (unsigned long long)t->nbytes);
    }
    t->data = data + begin;
    return 0;
}

static int parse_tensor(st_tensor *t, const json_t *obj, const unsigned char *data,
                        uint64_t data_len, kv_err *e)
{
    if (!json_is_object(obj))
        return st_errf(e, "%s: tensor '%s' is a JSON %s, not an object", t->file, t->name,
                       json_kind(obj));
    if (parse_dtype(t, obj, e) < 0 || parse_shape(t, obj, e) < 0)
        return -1;
    return parse_offsets(t, obj, data, data_len, e);
}

static int check_metadata(const char *path, const json_t *meta, kv_err *e)
{
    if (!json_is_object(meta))
        return st_errf(e, "%s: __metadata__ is a JSON %s, not an object", path,
                       json_kind(meta));
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)meta, key, value)
        if (!json_is_string(value))
            return st_errf(e, "%s: __metadata__ key '%s' has a JSON %s value, not a string",
                           path, key, json_kind(value));
    return 0;
}

/* Tensors sharing bytes would alias each other's data: a writer's bug,
 * or a file made to look like more weights than it holds. */
typedef struct {
    uint64_t begin, end;
    const char *name;
} st_span;

static int span_cmp(const void *a, const void *b)
{
    const st_span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int check_overlaps(const st_file *f, const unsigned char *data, kv_err *e)
{
    st_span *s = malloc((f->count ? f->count : 1) * sizeof *s);
    if (!s)
        return st_errf(e, "%s: out of memory", f->path);
    size_t n = 0;
    for (size_t i = 0; i < f->count; i++) {
        const st_tensor *t = &f->tensors[i];
        if (t->nbytes == 0)
            continue;   /* holds no byte: overlaps nothing */
        uint64_t begin = (uint64_t)((const unsigned char *)t->data - data);
        s[n++] = (st_span){begin, begin + t->nbytes, t->name};
    }
    qsort(s, n, sizeof *s, span_cmp);
    int rc = 0;
    /* Sorted by start: a tensor overlapping any earlier one overlaps the
     * one of them that reaches furthest. */
    size_t far = 0;
    for (size_t i = 1; i < n && rc == 0; i++) {
        if (s[i].begin < s[far].end)
            rc = st_errf(e, "%s: tensors '%s' (data_offsets [%llu, %llu]) and '%s' "
                            "(data_offsets [%llu, %llu]) overlap", f->path, s[far].name,
                         (unsigned long long)s[far].begin, (unsigned long long)s[far].end,
                         s[i].name, (unsigned long long)s[i].begin,
                         (unsigned long long)s[i].end);
        else if (s[i].end > s[far].end)
            far = i;
    }
    free(s);
    return rc;
}

static int parse_entries(st_file *f, const unsigned char *data, uint64_t data_len, kv_err *e)
{
    size_t n = json_object_size(f->header);
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    if (!f->tensors)
        return st_errf(e, "%s: out of memory", f->path);
    const char *key;
    json_t *value;
    json_object_foreach(f->header, key, value) {
        if (strcmp(key, "__metadata__") == 0) {
            if (check_metadata(f->path, value, e) < 0)
                return -1;
            f->metadata = value;
            continue;
        }
        st_tensor *t = &f->tensors[f->count];
        t->name = key;
        t->file = f->path;
        if (parse_tensor(t, value, data, data_len, e) < 0)
            return -1;
        f->count++;
    }
    return check_overlaps(f, data, e);
}

static int parse_header(st_file *f, const unsigned char *buf, size_t len, kv_err *e)
{
    uint64_t hlen = 0;
    if (read_header_len(f->path, buf, len, &hlen, e) < 0)
        return -1;
    json_error_t jerr;
    f->header = json_loadb((const char *)buf + 8, (size_t)hlen,
                           JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
    if (!f->header)
        return st_errf(e, "%s: header is not valid JSON: %s (header byte %d)", f->path,
                       jerr.text, jerr.position);
    if (!json_is_object(f->header))
        return st_errf(e, "%s: header is a JSON %s, not an object", f->path,
                       json_kind(f->header));
    return parse_entries(f, buf + 8 + hlen, len - 8 - hlen, e);
}

st_file *st_parse(const void *buf, size_t len, const char *name, kv_err *e)
{
    if (!name)
        name = "(memory)";
    if (!buf && len > 0) {
        st_errf(e, "%s: no buffer", name);
        return NULL;
    }
    st_file *f = file_new(name, e);
    if (!f)
        return NULL;
    if (parse_header(f, buf, len, e) < 0 || build_index(f, e) < 0) {
        st_close(f);
        return NULL;
    }
    return f;
}

/* ------------------------------------------------------------ st_open */

static int map_file(const char *path, void **map, size_t *len, kv_err *e)
{
    /* O_NONBLOCK: opening a FIFO must not hang; it is refused below. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return st_errf(e, "%s: %s", path, strerror(errno));
    struct stat sb;
    int rc = -1;
    if (fstat(fd, &sb) != 0)
        st_errf(e, "%s: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st_errf(e, "%s: not a regular file", path);
    else if (sb.st_size == 0)
        st_errf(e, "%s: empty file", path);
    else if ((unsigned long long)sb.st_size > SIZE_MAX)
        st_errf(e, "%s: file too large to map", path);
    else {
        outfile_note_input_fd(fd);   /* no output of this run may replace it */
        *len = (size_t)sb.st_size;
        *map = mmap(NULL, *len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (*map == MAP_FAILED)
            st_errf(e, "%s: mmap: %s", path, strerror(errno));
        else
            rc = 0;
    }
    close(fd);
    return rc;
}

st_file *st_open(const char *path, kv_err *e)
{
    if (!path) {
        st_errf(e, "st_open: no path");
        return NULL;
    }
    void *map = NULL;
    size_t len = 0;
    if (map_file(path, &map, &len, e) < 0)
        return NULL;
    st_file *f = st_parse(map, len, path, e);
    if (!f) {
        munmap(map, len);
        return NULL;
    }
    f->map = map;
    f->map_len = len;
    return f;
}

/* ------------------------------------------------------------ sharded folders */

static char *join_path(const char *dir, const char *name)
{
    size_t n = strlen(dir);
    const char *sep = (n > 0 && dir[n - 1] == '/') ? "" : "/";
    size_t size = n + strlen(sep) + strlen(name) + 1;
    char *p = malloc(size);
    if (p)
        snprintf(p, size, "%s%s%s", dir, sep, name);
    return p;
}

static bool shard_name_safe(const char *s)
{
    return s[0] != '\0' && strcmp(s, ".") != 0 && !strchr(s, '/') && !strstr(s, "..");
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* An index of a large checkpoint names every tensor: a few MB at most. */
#define INDEX_MAX_BYTES (64LL << 20)

static json_t *load_weight_map(const char *index, json_t **root, kv_err *e)
{
    json_error_t jerr;
    /* Read through infile (a regular file of bounded size, opened without
     * blocking): a FIFO at the index's name hung the load for ever. */
    char *text = NULL;
    size_t len = 0;
    *root = NULL;
    if (infile_read_all(index, INDEX_MAX_BYTES, &text, &len, e) < 0)
        return NULL;
    *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!*root) {
        if (jerr.line < 1)    /* could not read it */
            st_errf(e, "%s: %s", index, jerr.text);
        else
            st_errf(e, "%s: not valid JSON: %s (line %d, column %d)", index, jerr.text,
                    jerr.line, jerr.column);
        return NULL;
    }
    json_t *wm = json_object_get(*root, "weight_map");
    if (!json_is_object(*root))
        st_errf(e, "%s: top level is a JSON %s, not an object", index, json_kind(*root));
    else if (!wm)
        st_errf(e, "%s: no weight_map", index);
    else if (!json_is_object(wm))
        st_errf(e, "%s: weight_map is a JSON %s, not an object", index, json_kind(wm));
    else if (json_object_size(wm) == 0)
        st_errf(e, "%s: weight_map is empty", index);
    else
        return wm;
    return NULL;
}

/* The distinct shard names of weight_map, sorted (file names, checked). */
static const char **shard_names(const char *index, json_t *wm, size_t *n, kv_err *e)
{
    const char **names = malloc(json_object_size(wm) * sizeof *names);
    if (!names) {
        st_errf(e, "%s: out of memory", index);
        return NULL;
    }
    *n = 0;
    const char *key;
    json_t *value;
    json_object_foreach(wm, key, value) {
        const char *s = json_string_value(value);
        if (!s) {
            st_errf(e, "%s: weight_map entry '%s' is a JSON %s, not a file name", index, key,
                    json_kind(value));
            free(names);
            return NULL;
        }
        if (!shard_name_safe(s)) {
            st_errf(e, "%s: weight_map entry '%s' names shard '%s', which is not a plain "
                    "file name in the folder", index, key, s);
            free(names);
            return NULL;
        }
        names[(*n)++] = s;
    }
    qsort(names, *n, sizeof *names, cmp_str);
    size_t distinct = 0;
    for (size_t i = 0; i < *n; i++)
        if (distinct == 0 || strcmp(names[distinct - 1], names[i]) != 0)
            names[distinct++] = names[i];
    *n = distinct;
    return names;
}

static int open_shards(st_file *set, const char *dir, const char **names, size_t n, kv_err *e)
{
    set->shards = calloc(n, sizeof *set->shards);
    if (!set->shards)
        return st_errf(e, "%s: out of memory", set->path);
    for (size_t i = 0; i < n; i++) {
        char *path = join_path(dir, names[i]);
        if (!path)
            return st_errf(e, "%s: out of memory", set->path);
        set->shards[i] = st_open(path, e);
        free(path);
        if (!set->shards[i])
            return -1;
        set->nshards++;
    }
    return 0;
}

static int merge_shards(st_file *set, kv_err *e)
{
    size_t total = 0;
    for (size_t i = 0; i < set->nshards; i++)
        total += set->shards[i]->count;
    set->tensors = calloc(total ? total : 1, sizeof *set->tensors);
    if (!set->tensors)
        return st_errf(e, "%s: out of memory", set->path);
    for (size_t i = 0; i < set->nshards; i++) {
        const st_file *s = set->shards[i];
        memcpy(set->tensors + set->count, s->tensors, s->count * sizeof *s->tensors);
        set->count += s->count;
    }
    set->metadata = set->shards[0]->metadata;
    return build_index(set, e);
}

static const st_file *shard_named(const st_file *set, const char **names, const char *s)
{
    const char **hit = bsearch(&s, names, set->nshards, sizeof *names, cmp_str);
    return hit ? set->shards[hit - names] : NULL;
}

/* weight_map and the shards' headers must agree in both directions. */
static int check_weight_map(const st_file *set, json_t *wm, const char **names, kv_err *e)
{
    const char *key;
    json_t *value;
    json_object_foreach(wm, key, value) {
        const st_file *shard = shard_named(set, names, json_string_value(value));
        if (!st_find(shard, key))
            return st_errf(e, "%s: tensor '%s' is mapped to %s but missing from it",
                           set->path, key, shard->path);
    }
    for (size_t i = 0; i < set->count; i++)
        if (!json_object_get(wm, set->tensors[i].name))
            return st_errf(e, "%s: tensor '%s' in %s is not in the weight_map", set->path,
                           set->tensors[i].name, set->tensors[i].file);
    return 0;
}

static st_file *open_index(const char *dir, const char *index, kv_err *e)
{
    json_t *root = NULL;
    const char **names = NULL;
    size_t n = 0;
    st_file *set = NULL;
    json_t *wm = load_weight_map(index, &root, e);
    if (wm)
        names = shard_names(index, wm, &n, e);
    if (names)
        set = file_new(index, e);
    if (set && (open_shards(set, dir, names, n, e) < 0 || merge_shards(set, e) < 0 ||
                check_weight_map(set, wm, names, e) < 0)) {
        st_close(set);
        set = NULL;
    }
    free(names);
    json_decref(root);
    return set;
}

static st_file *open_dir_paths(const char *dir, const char *index, const char *single,
                               kv_err *e)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        st_errf(e, "%s: %s", dir, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(sb.st_mode)) {
        st_errf(e, "%s: not a directory", dir);
        return NULL;
    }
    if (stat(index, &sb) == 0)
        return open_index(dir, index, e);
    if (errno != ENOENT) {
        st_errf(e, "%s: %s", index, strerror(errno));
        return NULL;
    }
    if (stat(single, &sb) == 0 || errno != ENOENT)
        return st_open(single, e);
    st_errf(e, "%s: no " SINGLE_NAME " or " INDEX_NAME, dir);
    return NULL;
}

st_file *st_open_dir(const char *dir, kv_err *e)
{
    if (!dir) {
        st_errf(e, "st_open_dir: no folder");
        return NULL;
    }
    char *index = join_path(dir, INDEX_NAME);
    char *single = join_path(dir, SINGLE_NAME);
    st_file *f = NULL;
    if (!index || !single)
        st_errf(e, "%s: out of memory", dir);
    else
        f = open_dir_paths(dir, index, single, e);
    free(index);
    free(single);
    return f;
}

/* ------------------------------------------------------------ st_read_f32 */

static uint16_t read_le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* The bulk of a bf16 checkpoint's load: blocks of 16 shifts with no
 * aliasing, which the compiler vectorises (a call per element, as for F16,
 * cost seconds on a 1B model). The data is little endian, as is the host. */
static void widen_bf16(const unsigned char *restrict src, uint64_t n, float *restrict out)
{
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) {
            uint16_t h;
            memcpy(&h, src + 2 * (i + (uint64_t)k), sizeof h);
            out[i + (uint64_t)k] = f32_from_bits((uint32_t)h << 16);
        }
    for (; i < n; i++)
        out[i] = f32_from_bits((uint32_t)read_le16(src + 2 * i) << 16);
}

int st_read_f32(const st_tensor *t, uint64_t first, uint64_t n, float *out, kv_err *e)
{
    if (!t)
        return st_errf(e, "st_read_f32: no tensor");
    if (!dtype_is_float(t->dtype))
        return st_errf(e, "%s: tensor '%s' has dtype %s; only F32, F16 and BF16 read as float",
                       t->file, t->name, st_dtype_name(t->dtype));
    if (first > t->nelem || n > t->nelem - first)
        return st_errf(e, "%s: tensor '%s': %llu elements from element %llu are outside its "
                       "%llu elements", t->file, t->name, (unsigned long long)n,
                       (unsigned long long)first, (unsigned long long)t->nelem);
    if (n == 0)
        return 0;
    if (!out)
        return st_errf(e, "%s: tensor '%s': no output buffer", t->file, t->name);
    const unsigned char *src = (const unsigned char *)t->data + first * st_dtype_size(t->dtype);
    if (t->dtype == ST_F32) {
        memcpy(out, src, n * sizeof *out);    /* the data is little endian, as is the host */
        return 0;
    }
    if (t->dtype == ST_BF16) {
        widen_bf16(src, n, out);
        return 0;
    }
    for (uint64_t i = 0; i < n; i++)
        out[i] = st_f16_to_f32(read_le16(src + 2 * i));
    return 0;
}

/* ------------------------------------------------------------ writer */

#define WRITE_BLOCK 16384        /* elements converted per write() */

typedef struct {
    char *name;
    st_dtype dtype;
    uint64_t nelem;
    uint64_t nbytes;
} st_wtensor;

struct st_writer {
    char *path;                  /* final name */
    outfile out;                 /* the temporary file beside path (outfile.h) */
    int fd;                      /* out's descriptor; -1 once closed */
    bool failed;                 /* a write failed; the temp file is gone */
    st_wtensor *tensors;         /* (count) declaration order */
    size_t count;
    size_t next;                 /* the next tensor to write */
    uint64_t unflushed;          /* bytes written since writeback was last started */
    unsigned char block[2 * WRITE_BLOCK];
};

static void writer_free(st_writer *w)
{
    for (size_t i = 0; i < w->count; i++)
        free(w->tensors[i].name);
    free(w->tensors);
    outfile_abort(&w->out);
    free(w->path);
    free(w);
}

static void writer_discard(st_writer *w)
{
    outfile_abort(&w->out);   /* closes fd, removes the temporary file */
    w->fd = -1;
    w->failed = true;
}

/* Reports errno for `what` (an -ing verb) and drops the temp file. */
static int writer_fail(st_writer *w, const char *what, kv_err *e)
{
    int err = errno;
    writer_discard(w);
    return st_errf(e, "%s: %s: %s", w->path, what, strerror(err));
}

/* A checkpoint of gigabytes stays dirty in the page cache until the
 * final fsync, which then waits for all of it to reach the disk. Starting
 * the writeback every WRITEBACK_EVERY bytes lets the disk work while the
 * rest is produced; the fsync still decides durability. */
#define WRITEBACK_EVERY (64u << 20)

static void start_writeback(st_writer *w, uint64_t nbytes)
{
    w->unflushed += nbytes;
    if (w->unflushed < WRITEBACK_EVERY)
        return;
    w->unflushed = 0;
#ifdef SYNC_FILE_RANGE_WRITE
    (void)sync_file_range(w->fd, 0, 0, SYNC_FILE_RANGE_WRITE);   /* a hint: errors do not matter */
#endif
}

static int write_all(int fd, const void *buf, uint64_t len)
{
    const unsigned char *p = buf;
    while (len > 0) {
        size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
        ssize_t k = write(fd, p, chunk);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            if (k == 0)
                errno = EIO;
            return -1;
        }
        p += k;
        len -= (uint64_t)k;
    }
    return 0;
}

static int decl_check(const char *path, const st_decl *d, st_wtensor *t, kv_err *e)
{
    if (!d->name)
        return st_errf(e, "%s: a declared tensor has no name", path);
    if (strcmp(d->name, "__metadata__") == 0)
        return st_errf(e, "%s: '__metadata__' is not a tensor name", path);
    if (!dtype_valid(d->dtype))
        return st_errf(e, "%s: tensor '%s' has an invalid dtype (%d)", path, d->name,
                       (int)d->dtype);
    if (d->ndim < 0 || d->ndim > ST_MAX_DIMS)
        return st_errf(e, "%s: tensor '%s' has %d dimensions (0..%d allowed)", path, d->name,
                       d->ndim, ST_MAX_DIMS);
    t->dtype = d->dtype;
    t->nelem = 1;
    for (int i = 0; i < d->ndim; i++) {
        if (d->shape[i] < 0)
            return st_errf(e, "%s: tensor '%s': shape[%d] is %lld, negative", path, d->name,
                           i, (long long)d->shape[i]);
        if (__builtin_mul_overflow(t->nelem, (uint64_t)d->shape[i], &t->nelem))
            return st_errf(e, "%s: tensor '%s': shape product overflows 64 bits", path,
                           d->name);
    }
    if (__builtin_mul_overflow(t->nelem, (uint64_t)st_dtype_size(d->dtype), &t->nbytes))
        return st_errf(e, "%s: tensor '%s': byte size overflows 64 bits", path, d->name);
    t->name = strdup(d->name);
    return t->name ? 0 : st_errf(e, "%s: out of memory", path);
}

static json_t *metadata_json(const char *path, const char *const *kv, kv_err *e)
{
    json_t *meta = json_object();
    for (size_t i = 0; meta && kv[i]; i += 2) {
        json_t *value = kv[i + 1] ? json_string(kv[i + 1]) : NULL;
        if (!value || json_object_set_new(meta, kv[i], value) != 0) {
            st_errf(e, "%s: metadata '%s' has no value or is not valid UTF-8", path, kv[i]);
            json_decref(meta);
            return NULL;
        }
    }
    if (!meta)
        st_errf(e, "%s: out of memory", path);
    return meta;
}

static json_t *tensor_json(const st_decl *d, uint64_t begin, uint64_t end)
{
    json_t *shape = json_array();
    for (int i = 0; shape && i < d->ndim; i++)
        if (json_array_append_new(shape, json_integer(d->shape[i])) != 0) {
            json_decref(shape);
            shape = NULL;
        }
    if (!shape)
        return NULL;
    return json_pack("{s:s, s:o, s:[I, I]}", "dtype", st_dtype_name(d->dtype), "shape", shape,
                     "data_offsets", (json_int_t)begin, (json_int_t)end);
}

static int add_tensors(st_writer *w, json_t *root, const st_decl *decls, kv_err *e)
{
    uint64_t offset = 0;
    for (size_t i = 0; i < w->count; i++) {
        st_wtensor *t = &w->tensors[i];
        if (decl_check(w->path, &decls[i], t, e) < 0)
            return -1;
        if (json_object_get(root, t->name))
            return st_errf(e, "%s: tensor '%s' is declared twice", w->path, t->name);
        uint64_t end;
        if (__builtin_add_overflow(offset, t->nbytes, &end) || end > INT64_MAX)
            return st_errf(e, "%s: tensor '%s': data area over 2^63 bytes", w->path, t->name);
        json_t *entry = tensor_json(&decls[i], offset, end);
        if (!entry || json_object_set_new(root, t->name, entry) != 0)
            return st_errf(e, "%s: tensor '%s': cannot build its header entry (name not "
                           "UTF-8?)", w->path, t->name);
        offset = end;
    }
    return 0;
}

static int add_metadata(st_writer *w, json_t *root, const char *const *kv, kv_err *e)
{
    if (!kv)
        return 0;
    json_t *meta = metadata_json(w->path, kv, e);
    if (!meta)
        return -1;
    if (json_object_set_new(root, "__metadata__", meta) != 0)
        return st_errf(e, "%s: out of memory", w->path);
    return 0;
}

/* The header JSON (not yet padded): __metadata__ first, then the tensors in
 * declaration order with back-to-back data_offsets. */
static char *header_text(st_writer *w, const st_decl *decls, const char *const *metadata,
                         size_t *hlen, kv_err *e)
{
    json_t *root = json_object();
    if (!root) {
        st_errf(e, "%s: out of memory", w->path);
        return NULL;
    }
    char *text = NULL;
    if (add_metadata(w, root, metadata, e) == 0 && add_tensors(w, root, decls, e) == 0) {
        text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (!text)
            st_errf(e, "%s: cannot format the header", w->path);
        else
            *hlen = strlen(text);
    }
    json_decref(root);
    return text;
}

/* Length, JSON, then spaces so that 8 + N is a multiple of 8. */
static int write_header(st_writer *w, const char *text, size_t len, kv_err *e)
{
    size_t padded = (len + 7) & ~(size_t)7;
    unsigned char *buf = malloc(8 + padded);
    if (!buf)
        return st_errf(e, "%s: out of memory", w->path);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, text, len);
    memset(buf + 8 + len, ' ', padded - len);
    int rc = write_all(w->fd, buf, 8 + padded);
    free(buf);
    return rc < 0 ? writer_fail(w, "writing", e) : 0;
}

static st_writer *writer_new(const char *path, size_t n, kv_err *e)
{
    st_writer *w = calloc(1, sizeof *w);
    if (!w) {
        st_errf(e, "%s: out of memory", path);
        return NULL;
    }
    w->fd = -1;
    w->count = n;
    w->path = strdup(path);
    w->tensors = calloc(n ? n : 1, sizeof *w->tensors);
    if (!w->path || !w->tensors) {
        st_errf(e, "%s: out of memory", path);
        writer_free(w);
        return NULL;
    }
    return w;
}

st_writer *st_writer_open(const char *path, const st_decl *decls, size_t n,
                          const char *const *metadata, kv_err *e)
{
    if (!path || (!decls && n > 0)) {
        st_errf(e, "st_writer_open: no path or no declarations");
        return NULL;
    }
    st_writer *w = writer_new(path, n, e);
    if (!w)
        return NULL;
    size_t hlen = 0;
    char *text = header_text(w, decls, metadata, &hlen, e);
    if (!text) {
        writer_free(w);
        return NULL;
    }
    /* The output discipline (outfile.h): a fresh temporary file beside
     * path, renamed over it only if path is absent or a regular file that
     * is none of the run's inputs. */
    int rc = outfile_open_fd(&w->out, path, &w->fd, e) < 0 ? -1 : write_header(w, text, hlen, e);
    free(text);
    if (rc < 0) {
        if (w->fd >= 0)
            writer_discard(w);
        writer_free(w);
        return NULL;
    }
    return w;
}

/* The next declared tensor, or an error when none is left or w failed. */
static const st_wtensor *writer_next(st_writer *w, kv_err *e)
{
    if (!w) {
        st_errf(e, "st_writer: no writer");
        return NULL;
    }
    if (w->failed) {
        st_errf(e, "%s: an earlier write failed", w->path);
        return NULL;
    }
    if (w->next >= w->count) {
        st_errf(e, "%s: all %zu declared tensors are already written", w->path, w->count);
        return NULL;
    }
    return &w->tensors[w->next];
}

static size_t encode16(st_dtype dtype, const float *src, size_t n, unsigned char *dst)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t h = dtype == ST_F16 ? st_f32_to_f16(src[i]) : st_f32_to_bf16(src[i]);
        dst[2 * i] = (unsigned char)(h & 0xffu);
        dst[2 * i + 1] = (unsigned char)(h >> 8);
    }
    return 2 * n;
}

int st_writer_put_f32(st_writer *w, const float *values, kv_err *e)
{
    const st_wtensor *t = writer_next(w, e);
    if (!t)
        return -1;
    if (!dtype_is_float(t->dtype))
        return st_errf(e, "%s: tensor '%s' is %s; st_writer_put_f32 writes F32, F16 or BF16",
                       w->path, t->name, st_dtype_name(t->dtype));
    if (!values && t->nelem > 0)
        return st_errf(e, "%s: tensor '%s': no values", w->path, t->name);
    if (t->dtype == ST_F32) {               /* little endian on disk and in memory */
        if (write_all(w->fd, values, t->nbytes) < 0)
            return writer_fail(w, "writing", e);
    } else {
        for (uint64_t i = 0; i < t->nelem; i += WRITE_BLOCK) {
            size_t m = t->nelem - i < WRITE_BLOCK ? (size_t)(t->nelem - i) : WRITE_BLOCK;
            size_t nb = encode16(t->dtype, values + i, m, w->block);
            if (write_all(w->fd, w->block, nb) < 0)
                return writer_fail(w, "writing", e);
        }
    }
    start_writeback(w, t->nbytes);
    w->next++;
    return 0;
}

int st_writer_put_raw(st_writer *w, const void *bytes, uint64_t nbytes, kv_err *e)
{
    const st_wtensor *t = writer_next(w, e);
    if (!t)
        return -1;
    if (nbytes != t->nbytes)
        return st_errf(e, "%s: tensor '%s' needs %llu bytes, got %llu", w->path, t->name,
                       (unsigned long long)t->nbytes, (unsigned long long)nbytes);
    if (!bytes && nbytes > 0)
        return st_errf(e, "%s: tensor '%s': no bytes", w->path, t->name);
    if (write_all(w->fd, bytes, nbytes) < 0)
        return writer_fail(w, "writing", e);
    start_writeback(w, t->nbytes);
    w->next++;
    return 0;
}

static int writer_complete(st_writer *w, kv_err *e)
{
    if (w->failed)
        return st_errf(e, "%s: an earlier write failed; nothing was written", w->path);
    if (w->next < w->count) {
        writer_discard(w);
        return st_errf(e, "%s: only %zu of %zu declared tensors were written (next: '%s')",
                       w->path, w->next, w->count, w->tensors[w->next].name);
    }
    w->fd = -1;   /* outfile_commit fsyncs, closes and renames it */
    if (outfile_commit(&w->out, e) < 0) {
        w->failed = true;
        return -1;
    }
    return 0;
}

int st_writer_finish(st_writer *w, kv_err *e)
{
    if (!w)
        return st_errf(e, "st_writer_finish: no writer");
    int rc = writer_complete(w, e);
    writer_free(w);
    return rc;
}

void st_writer_abort(st_writer *w)
{
    if (!w)
        return;
    writer_discard(w);
    writer_free(w);
}
