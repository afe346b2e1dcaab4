/* validate.c — dump_validate: checks a file against schema v1
 * (docs/dump-format.md) and reports every violation, one sentence each,
 * naming the object. It reads the file with HDF5 directly rather than
 * through dump_open, which refuses a file at its first problem.
 *
 * NaN and infinities in the data are allowed (they are what a debugging
 * dump is for); each dataset holding some gets one line starting with
 * "note: ", passed to the same callback and not counted as a violation.
 * Engine settings that lack what the diagnosis reads get a line starting
 * with "warning: ", not counted either. */
#include "dump_internal.h"
#include "settings.h"
#include "model/text.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#define SCAN_BLOCK_ELEMS (1 << 16)   /* floats read at a time by the NaN scan */

typedef struct {
    const char *path;
    hid_t file;
    void (*report)(void *ctx, const char *line);
    void *ctx;
    int violations;
    kv_config cfg;
    bool cfg_ok;
    bool partial;                /* status "partial: ...": hashes may stop short of rows */
    bool fingerprint;
    bool row_hashes;      /* full mode with row_hashes = 1 */
    bool have_tokens;
    int64_t n_tokens;
    /* Bytes the data scans may still read: a file that claims far more
     * data than it holds (unallocated chunks read as fill) is not scanned
     * whole. Generous for real dumps: 64 x the file size. */
    int64_t scan_budget;
} vstate;

typedef enum { ELEM_F32, ELEM_I32, ELEM_U64 } elem_kind;

/* What a dataset must be. cols: -1 unknown (not checked), 0 for 1-D. */
typedef struct {
    elem_kind kind;
    int64_t cols;
} expect;

/* What a dataset is, as far as the checks got. */
typedef struct {
    bool ok;              /* type and shape as expected: its data may be read */
    bool have_first;
    int64_t rows, cols, first;
} found;

/* ------------------------------------------------------------------ */
/* Reporting                                                            */

static void say(vstate *v, const char *prefix, const char *fmt, va_list ap)
{
    char line[1024];
    size_t n = (size_t)snprintf(line, sizeof line, "%s", prefix);
    vsnprintf(line + n, sizeof line - n, fmt, ap);
    if (v->report)
        v->report(v->ctx, line);
}

static void violation(vstate *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void violation(vstate *v, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say(v, "", fmt, ap);
    va_end(ap);
    v->violations++;
}

static void note(vstate *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(vstate *v, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say(v, "note: ", fmt, ap);
    va_end(ap);
}

static void config_problem(void *ctx, const char *msg)
{
    violation(ctx, "%s", msg);
}

static const char *class_name(H5T_class_t c)
{
    switch (c) {
    case H5T_INTEGER: return "an integer";
    case H5T_FLOAT: return "a float";
    case H5T_STRING: return "a string";
    case H5T_COMPOUND: return "a compound";
    case H5T_ARRAY: return "an array";
    case H5T_VLEN: return "a variable-length sequence";
    case H5T_ENUM: return "an enum";
    default: return "an unusual type";
    }
}

static void type_desc(hid_t t, char *buf, size_t n)
{
    H5T_class_t c = H5Tget_class(t);
    size_t bits = H5Tget_size(t) * 8;
    if (c == H5T_INTEGER)
        snprintf(buf, n, "%s%zu", H5Tget_sign(t) == H5T_SGN_NONE ? "uint" : "int", bits);
    else if (c == H5T_FLOAT)
        snprintf(buf, n, "float%zu", bits);
    else
        snprintf(buf, n, "%s", class_name(c));
}

/* ------------------------------------------------------------------ */
/* Attributes                                                           */

/* Present, of the class wanted (integers count as numbers) and a single
 * value; reports otherwise. obj_desc: "The root attribute", "/layers/3". */
static bool attr_ok(vstate *v, hid_t obj, const char *where, const char *name, H5T_class_t want)
{
    H5T_class_t c = dump_h5_attr_class(obj, name);
    const char *want_name = want == H5T_FLOAT ? "a number" : class_name(want);
    if (c == H5T_NO_CLASS) {
        violation(v, "%s has no attribute %s (%s).", where, name, want_name);
        return false;
    }
    if (c != want && !(want == H5T_FLOAT && c == H5T_INTEGER)) {
        violation(v, "%s: attribute %s is %s, not %s.", where, name, class_name(c), want_name);
        return false;
    }
    return true;
}

static char *str_attr(vstate *v, hid_t obj, const char *where, const char *name)
{
    char *s = NULL;
    if (attr_ok(v, obj, where, name, H5T_STRING) && dump_h5_attr_str(obj, name, &s) < 0) {
        violation(v, "%s: attribute %s is not a single readable string.", where, name);
        s = NULL;
    }
    return s;
}

static bool int_attr(vstate *v, hid_t obj, const char *where, const char *name, int64_t *out)
{
    if (!attr_ok(v, obj, where, name, H5T_INTEGER))
        return false;
    if (dump_h5_attr_i64(obj, name, out) < 0) {
        violation(v, "%s: attribute %s is not a single integer.", where, name);
        return false;
    }
    return true;
}

/* ------------------------------------------------------------------ */
/* Root                                                                 */

/* Returns false when the file is not a v1 kvdiff dump: nothing further
 * would mean anything. */
static bool check_format(vstate *v)
{
    const char *root = "The root group";
    char *fmt = str_attr(v, v->file, root, "format");
    int64_t ver = DUMP_VERSION;
    bool ok = fmt && !strcmp(fmt, DUMP_FORMAT);
    if (fmt && !ok)
        violation(v, "The root attribute format is '%s', not '%s': this is not a kvdiff dump.",
                  fmt, DUMP_FORMAT);
    free(fmt);
    if (!ok)
        return false;
    if (int_attr(v, v->file, root, "format_version", &ver) && ver != DUMP_VERSION) {
        violation(v, "The root attribute format_version is %lld: schema version %lld; this kvdiff "
                     "checks version %d.", (long long)ver, (long long)ver, DUMP_VERSION);
        return false;
    }
    return true;
}

static void warning(vstate *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warning(vstate *v, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say(v, "warning: ", fmt, ap);
    va_end(ap);
}

/* A value the comparer reads that it would ignore (dump/settings.h): the
 * writer meant something, and the diagnosis or the drift model falls back
 * to a guess without saying why. Warnings, as engine_settings is free
 * form. */
/* A settings value as a message shows it: JSON, escaped, cut at n. */
static const char *shown(json_t *x, char *buf, size_t n)
{
    char *text = json_dumps(x, JSON_ENCODE_ANY | JSON_COMPACT);
    kv_escape(buf, n, text ? text : "?", false);
    free(text);
    return buf;
}

static void check_setting_values(vstate *v, json_t *j)
{
    char val[48];
    static const struct {
        const char *key;
        set_type_use use;
    } types[] = {{"compute_dtype", SET_FOR_COMPUTE},
                 {"cache_type", SET_FOR_CACHE},
                 {"kv_dtype", SET_FOR_CACHE}};
    json_t *chunk = json_object_get(j, "chunk");
    if (chunk && !(json_is_integer(chunk) && json_integer_value(chunk) > 0))
        warning(v, "The root attribute engine_settings gives chunk %s; the diagnosis reads only "
                "a positive integer (prompt tokens per prefill step) and ignores it.",
                shown(chunk, val, sizeof val));
    json_t *cache = json_object_get(j, "cache");
    if (cache && !(json_is_string(cache) && set_cache_known(json_string_value(cache))))
        warning(v, "The root attribute engine_settings gives cache %s, which the diagnosis "
                "does not know (it reads %s), and ignores it.", shown(cache, val, sizeof val),
                set_cache_names());
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        json_t *t = json_object_get(j, types[i].key);
        if (t && !(json_is_string(t) && set_type_find(json_string_value(t), types[i].use)))
            warning(v, "The root attribute engine_settings gives %s %s, which the drift model "
                    "does not know (it reads %s); it assumes the coarsest common type.",
                    types[i].key, shown(t, val, sizeof val), set_type_names(types[i].use));
    }
}

/* A JSON object, and (not a violation) the keys the diagnosis reads from
 * a test recording (docs/dump-format.md): a recording without them gets a
 * weaker diagnosis, which its writer may want to know. */
static void check_settings(vstate *v, const char *engine)
{
    char *s = str_attr(v, v->file, "The root group", "engine_settings");
    json_t *j = s ? json_loads(s, 0, NULL) : NULL;
    if (s && !json_is_object(j))
        violation(v, "The root attribute engine_settings is not a JSON object.");
    if (json_is_object(j) && engine && strcmp(engine, "reference")) {
        /* present; a value it cannot use is check_setting_values' */
        const bool chunk = json_object_get(j, "chunk") != NULL;
        const bool cache = json_object_get(j, "cache") != NULL;
        if (!chunk || !cache)
            warning(v, "The root attribute engine_settings gives no %s: the diagnosis infers "
                    "the chunk size and a ring's size from the data where it can, and cannot "
                    "tell a stuck decode index in a ring buffer (docs/dump-format.md says "
                    "which diagnosis uses which setting).",
                    !chunk && !cache ? "chunk and no cache" : !chunk ? "chunk" : "cache");
    }
    if (json_is_object(j))
        check_setting_values(v, j);
    json_decref(j);
    free(s);
}

static bool is_hex16(const char *s)
{
    if (strlen(s) != 16)
        return false;
    for (int i = 0; i < 16; i++)
        if (!strchr("0123456789abcdefABCDEF", s[i]))
            return false;
    return true;
}

static void check_root(vstate *v)
{
    const char *root = "The root group";
    int64_t seed;
    char *mode = str_attr(v, v->file, root, "mode");
    if (mode && strcmp(mode, "full") && strcmp(mode, "fingerprint"))
        violation(v, "The root attribute mode is '%s'; it must be 'full' or 'fingerprint'.", mode);
    v->fingerprint = mode && !strcmp(mode, "fingerprint");
    free(mode);
    if (!v->fingerprint && H5Aexists(v->file, "row_hashes") > 0) {
        int64_t rh;
        if (int_attr(v, v->file, root, "row_hashes", &rh)) {
            if (rh != 0 && rh != 1)
                violation(v, "The root attribute row_hashes is %lld; it must be 0 or 1.",
                          (long long)rh);
            v->row_hashes = rh != 0;   /* a bad value is one violation, not one per dataset */
        }
    }
    H5Eclear2(H5E_DEFAULT);
    char *engine = str_attr(v, v->file, root, "engine");
    free(str_attr(v, v->file, root, "tool_version"));
    check_settings(v, engine);
    free(engine);
    char *cfg = str_attr(v, v->file, root, "model_config");
    if (cfg)
        v->cfg_ok = dump_config_parse(cfg, &v->cfg, config_problem, v) == 0;
    free(cfg);
    char *fp = str_attr(v, v->file, root, "weight_fingerprint");
    if (fp && fp[0] && !is_hex16(fp))
        violation(v, "The root attribute weight_fingerprint is '%s'; it must be 16 hex digits "
                     "or empty.", fp);
    free(fp);
    int_attr(v, v->file, root, "seed", &seed);
    char *st = str_attr(v, v->file, root, "status");
    v->partial = st && !strncmp(st, "partial: ", 9);
    if (st && strcmp(st, "complete") && strncmp(st, "partial: ", 9))
        violation(v, "The root attribute status is '%s'; it must be 'complete' or "
                     "'partial: <why>'.", st);
    free(st);
}

/* ------------------------------------------------------------------ */
/* Datasets                                                             */

/* Opens a member that must be an object of the given type; reports. */
static hid_t open_member(vstate *v, hid_t loc, const char *name, const char *path, H5I_type_t want)
{
    hid_t o = H5Oopen(loc, name, H5P_DEFAULT);
    if (o < 0) {
        H5Eclear2(H5E_DEFAULT);
        violation(v, "%s cannot be opened (a dangling or external link?).", path);
        return H5I_INVALID_HID;
    }
    if (H5Iget_type(o) != want) {
        violation(v, "%s is not a %s.", path, want == H5I_GROUP ? "group" : "dataset");
        dump_h5_close(o);
        return H5I_INVALID_HID;
    }
    char why[160];
    if (want == H5I_DATASET && dump_h5_storage_problem(o, why, sizeof why)) {
        /* not read, not even its extent: that would read another file, run
         * a plugin, or fail */
        violation(v, "%s %s.", path, why);
        dump_h5_close(o);
        return H5I_INVALID_HID;
    }
    return o;
}

static bool type_matches(hid_t t, elem_kind k)
{
    H5T_class_t c = H5Tget_class(t);
    size_t size = H5Tget_size(t);
    if (k == ELEM_F32)
        return c == H5T_FLOAT && size == 4;
    return c == H5T_INTEGER && size == (k == ELEM_I32 ? 4u : 8u) &&
           H5Tget_sign(t) == (k == ELEM_I32 ? H5T_SGN_2 : H5T_SGN_NONE);
}

static const char *kind_name(elem_kind k)
{
    return k == ELEM_F32 ? "float32" : k == ELEM_I32 ? "int32" : "uint64";
}

/* Type, rank, width, first_position and the position range. */
static found check_dataset(vstate *v, hid_t d, const char *path, expect x)
{
    found f = {.ok = true};
    hid_t t = H5Dget_type(d), s = H5Dget_space(d);
    hsize_t dims[2] = {0, 1};
    int rank = s >= 0 ? H5Sget_simple_extent_ndims(s) : -1;
    const int want_rank = x.cols == 0 ? 1 : 2;
    if (t >= 0 && !type_matches(t, x.kind)) {
        char desc[64];
        type_desc(t, desc, sizeof desc);
        violation(v, "%s is %s; it must be %s.", path, desc, kind_name(x.kind));
        f.ok = false;
    }
    if (rank != want_rank || H5Sget_simple_extent_dims(s, dims, NULL) < 0) {
        violation(v, "%s has %d dimensions; it must be %s.", path, rank < 0 ? 0 : rank,
                  want_rank == 1 ? "1-D [rows]" : "2-D [rows, cols]");
        f.ok = false;
    } else {
        f.rows = (int64_t)(dims[0] > (hsize_t)INT64_MAX ? (hsize_t)INT64_MAX : dims[0]);
        f.cols = rank == 2 ? (int64_t)dims[1] : 1;
        if (x.cols > 0 && f.cols != x.cols) {
            violation(v, "%s has %lld columns; the model config says %lld.", path,
                      (long long)f.cols, (long long)x.cols);
            f.ok = false;
        }
    }
    dump_h5_close(t);
    dump_h5_close(s);
    if (int_attr(v, d, path, "first_position", &f.first)) {
        f.have_first = true;
        if (f.first < 0)
            violation(v, "%s: first_position %lld is negative.", path, (long long)f.first);
        else if (v->have_tokens && f.rows > v->n_tokens - f.first)
            violation(v, "%s covers positions %lld..%lld, but /tokens holds only %lld tokens.", path,
                      (long long)f.first, (long long)(f.first + f.rows - 1), (long long)v->n_tokens);
    }
    return f;
}

/* Takes n bytes from the scan budget; false when they are not there. */
static bool scan_allowed(vstate *v, const char *path, int64_t rows, int64_t cols, size_t esize)
{
    double bytes = (double)rows * (double)cols * (double)esize;
    if (bytes > (double)v->scan_budget) {
        note(v, "%s was not scanned: it claims %.0f bytes of data, far more than the file holds.",
             path, bytes);
        return false;
    }
    v->scan_budget -= (int64_t)bytes;
    return true;
}

/* Reads rows [r0, r0 + n) of a float32 or int32 dataset as such. */
static int read_block(hid_t d, elem_kind k, int64_t r0, int64_t n, int64_t cols, int rank, void *buf)
{
    hsize_t start[2] = {(hsize_t)r0, 0}, count[2] = {(hsize_t)n, (hsize_t)cols};
    hid_t fs = H5Dget_space(d), ms = H5Screate_simple(rank, count, NULL);
    int rc = fs >= 0 && ms >= 0 &&
                     H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0 &&
                     H5Dread(d, k == ELEM_F32 ? H5T_NATIVE_FLOAT : H5T_NATIVE_INT32, ms, fs,
                             H5P_DEFAULT, buf) >= 0 ? 0 : -1;
    dump_h5_close(ms);
    dump_h5_close(fs);
    return rc;
}

/* Reads n hashes of a 1-D uint64 dataset from row r0. */
static int read_hashes(hid_t d, int64_t r0, int64_t n, uint64_t *out)
{
    hsize_t start[1] = {(hsize_t)r0}, count[1] = {(hsize_t)n};
    hid_t fs = H5Dget_space(d), ms = H5Screate_simple(1, count, NULL);
    int rc = fs >= 0 && ms >= 0 &&
                     H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0 &&
                     H5Dread(d, H5T_NATIVE_UINT64, ms, fs, H5P_DEFAULT, out) >= 0 ? 0 : -1;
    dump_h5_close(ms);
    dump_h5_close(fs);
    return rc;
}

/* Counts NaN and infinities (floats) or ids outside [0, limit) (ints). With
 * hashes (a full dump's <stage>.hash of as many rows, or -1), each float
 * row is checked against its hash in the same pass. counts: the floats are
 * key counts (attn_nkeys): each a whole number >= 0. */
static void scan_values(vstate *v, hid_t d, const char *path, const found *f, elem_kind k,
                        int64_t limit, hid_t hashes, bool counts)
{
    if (!f->ok || f->rows == 0 || f->cols < 1 || !scan_allowed(v, path, f->rows, f->cols, 4))
        return;
    hid_t s = H5Dget_space(d);
    const int rank = s >= 0 ? H5Sget_simple_extent_ndims(s) : -1;
    dump_h5_close(s);
    int64_t per = f->cols >= SCAN_BLOCK_ELEMS ? 1 : SCAN_BLOCK_ELEMS / f->cols;
    void *buf = rank > 0 ? malloc((size_t)per * (size_t)f->cols * 4) : NULL;
    uint64_t *hash = hashes >= 0 && k == ELEM_F32 ? malloc((size_t)per * sizeof *hash) : NULL;
    long long nan = 0, inf = 0, bad = 0, frac = 0;
    for (int64_t r0 = 0; buf && r0 < f->rows; r0 += per) {
        int64_t n = f->rows - r0 < per ? f->rows - r0 : per;
        if (read_block(d, k, r0, n, f->cols, rank, buf) < 0 ||
            (hash && read_hashes(hashes, r0, n, hash) < 0)) {
            H5Eclear2(H5E_DEFAULT);
            violation(v, "%s: rows %lld..%lld%s cannot be read.", path, (long long)r0,
                      (long long)(r0 + n - 1), hash ? " or their hashes" : "");
            break;
        }
        for (int64_t r = 0; hash && r < n; r++)
            if (XXH3_64bits((float *)buf + (size_t)r * (size_t)f->cols,
                            (size_t)f->cols * sizeof(float)) != hash[r]) {
                violation(v, "%s.hash: the hash of row %lld (position %lld) is not the "
                             "XXH3-64 of that row's bytes.", path, (long long)(r0 + r),
                          (long long)(r0 + r + (f->have_first ? f->first : 0)));
                free(hash);   /* one is enough: the rest of this dataset is not checked */
                hash = NULL;
            }
        for (size_t i = 0; i < (size_t)(n * f->cols); i++) {
            if (k == ELEM_F32) {
                float x = ((float *)buf)[i];
                nan += isnan(x) != 0;
                inf += isinf(x) != 0;
                frac += counts && isfinite(x) && (x < 0 || x != floorf(x));
            } else {
                int32_t id = ((int32_t *)buf)[i];
                bad += id < 0 || (int64_t)id >= limit;
            }
        }
    }
    free(buf);
    free(hash);
    if (nan || inf)
        note(v, "%s holds %lld NaN and %lld infinite values (allowed).", path, nan, inf);
    if (bad)
        violation(v, "%s holds %lld ids outside 0..%lld.", path, bad, (long long)(limit - 1));
    if (frac)
        violation(v, "%s holds %lld values that are not key counts (whole numbers >= 0).", path,
                  frac);
}

/* ------------------------------------------------------------------ */
/* /tokens                                                              */

static void check_tokens(vstate *v)
{
    int64_t pl;
    if (H5Lexists(v->file, "tokens", H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        violation(v, "/tokens is missing (int32 [n], the prompt then the generated tokens).");
        return;
    }
    hid_t d = open_member(v, v->file, "tokens", "/tokens", H5I_DATASET);
    if (d < 0)
        return;
    hid_t t = H5Dget_type(d), s = H5Dget_space(d);
    hsize_t n = 0;
    bool int32 = t >= 0 && type_matches(t, ELEM_I32);
    if (!int32)
        violation(v, "/tokens is not int32.");
    if (s < 0 || H5Sget_simple_extent_ndims(s) != 1 || H5Sget_simple_extent_dims(s, &n, NULL) < 0)
        violation(v, "/tokens is not 1-D.");
    else if (n > (hsize_t)DUMP_MAX_POSITIONS)
        /* what every reader refuses: it loads /tokens whole */
        violation(v, "/tokens claims %llu positions; a dump holds at most %lld, and no reader "
                     "reads more.", (unsigned long long)n, DUMP_MAX_POSITIONS);
    else
        v->have_tokens = true, v->n_tokens = (int64_t)n;
    dump_h5_close(t);
    dump_h5_close(s);
    if (int_attr(v, d, "/tokens", "prompt_length", &pl) &&
        (pl < 0 || (v->have_tokens && pl > v->n_tokens)))
        violation(v, "/tokens: prompt_length %lld is outside 0..%lld (the number of tokens).",
                  (long long)pl, (long long)v->n_tokens);
    if (int32 && v->have_tokens && v->cfg_ok) {
        found f = {.ok = true, .rows = v->n_tokens, .cols = 1};
        scan_values(v, d, "/tokens", &f, ELEM_I32, v->cfg.vocab, H5I_INVALID_HID, false);
    }
    dump_h5_close(d);
}

/* ------------------------------------------------------------------ */
/* Stage groups: /layers/<i> and /model                                 */

typedef enum { PART_ROWS, PART_HASH, PART_STATS } part;

typedef struct {
    vstate *v;
    const char *gpath;
    int layer;                    /* -1: /model */
    bool seen[STAGE_COUNT][3];    /* [stage][part] */
    found got[STAGE_COUNT][3];
} group_walk;

/* "q" (full mode), "q.hash" / "q.stats" (fingerprint mode, and full mode
 * with row hashes) of a stage that belongs in this group; -1 otherwise. */
static int parse_member(const group_walk *g, const char *name, part *p)
{
    char stage[64];
    const char *dot = strrchr(name, '.');
    size_t len = dot ? (size_t)(dot - name) : strlen(name);
    if (len >= sizeof stage)
        return -1;
    memcpy(stage, name, len);
    stage[len] = 0;
    if (!g->v->fingerprint && !g->v->row_hashes && dot)
        return -1;
    if (g->v->fingerprint || dot) {
        if (!dot || (strcmp(dot, ".hash") && strcmp(dot, ".stats")))
            return -1;
        *p = !strcmp(dot, ".hash") ? PART_HASH : PART_STATS;
    } else {
        *p = PART_ROWS;
    }
    int st = stage_parse(stage);
    if (st < 0 || (st >= STAGE_LAYER_COUNT) != (g->layer < 0))
        return -1;
    return st;
}

static expect expect_of(const vstate *v, kv_stage st, int layer, part p)
{
    expect x = {ELEM_F32, -1};
    if (p == PART_HASH)
        x = (expect){ELEM_U64, 0};
    else if (p == PART_STATS)
        x.cols = 2;
    else if (dump_stage_cols(&v->cfg, st, layer) > 0)
        /* from the fields that parsed, even when another did not: every
         * width the config still gives is checked */
        x.cols = dump_stage_cols(&v->cfg, st, layer);
    return x;
}

static herr_t check_member(hid_t gid, const char *name, const H5L_info_t *info, void *data)
{
    group_walk *g = data;
    vstate *v = g->v;
    char path[512];
    part p = PART_ROWS;
    snprintf(path, sizeof path, "%s/%s", g->gpath, name);
    int st = parse_member(g, name, &p);
    if (st < 0) {
        violation(v, "%s: unknown stage dataset name for a %s-mode dump (%s%s).", path,
                  v->fingerprint ? "fingerprint" : "full",
                  v->fingerprint ? "<stage>.hash or <stage>.stats"
                                 : g->layer >= 0 ? "a layer stage such as x_in, q, k, x_out"
                                                 : "embed, final_norm or logits",
                  v->row_hashes ? ", and their .hash and .stats" : "");
        return 0;
    }
    if (info->type == H5L_TYPE_EXTERNAL) {
        violation(v, "%s is an external link (to another file): a dump holds its own data.",
                  path);
        return 0;
    }
    if (g->layer >= 0 && v->cfg_ok && (st == STAGE_K || st == STAGE_V) &&
        v->cfg.kv_owner[g->layer] != g->layer)
        violation(v, "%s: layer %d reads layer %d's cache (kv_owner), so it records no %s.", path,
                  g->layer, v->cfg.kv_owner[g->layer], stage_name((kv_stage)st));
    if (g->layer >= 0 && v->cfg_ok && (st == STAGE_PLE_IN || st == STAGE_PLE_OUT) &&
        v->cfg.per_layer_dim <= 0)
        violation(v, "%s: the model has no per-layer inputs (hidden_size_per_layer_input), so "
                  "it records no %s.", path, stage_name((kv_stage)st));
    hid_t d = open_member(v, gid, name, path, H5I_DATASET);
    if (d < 0)
        return 0;
    expect x = expect_of(v, (kv_stage)st, g->layer, p);
    found f = check_dataset(v, d, path, x);
    g->seen[st][p] = true;
    g->got[st][p] = f;
    if (x.kind == ELEM_F32) {
        /* Rows of a full dump with row hashes: their hashes in the same
         * pass, when the hash dataset is a 1-D uint64 of as many rows (if
         * not, check_row_hashes says so). */
        hid_t h = H5I_INVALID_HID;
        char hname[128];
        snprintf(hname, sizeof hname, "%s.hash", name);
        if (v->row_hashes && p == PART_ROWS && f.ok && H5Lexists(gid, hname, H5P_DEFAULT) > 0 &&
            (h = H5Dopen2(gid, hname, H5P_DEFAULT)) >= 0) {
            hid_t t = H5Dget_type(h), sp = H5Dget_space(h);
            hsize_t dims[2];
            char why[160];
            if (dump_h5_storage_problem(h, why, sizeof why) || !type_matches(t, ELEM_U64) || H5Sget_simple_extent_ndims(sp) != 1 ||
                H5Sget_simple_extent_dims(sp, dims, NULL) < 0 || (int64_t)dims[0] != f.rows) {
                dump_h5_close(h);
                h = H5I_INVALID_HID;
            }
            dump_h5_close(t);
            dump_h5_close(sp);
        }
        H5Eclear2(H5E_DEFAULT);
        scan_values(v, d, path, &f, ELEM_F32, 0, h, st == STAGE_ATTN_NKEYS && p == PART_ROWS);
        dump_h5_close(h);
    }
    dump_h5_close(d);
    return 0;
}

/* Fingerprint mode: every .hash has its .stats, covering the same rows. */
static void check_pairs(vstate *v, const group_walk *g)
{
    for (int st = 0; st < STAGE_COUNT; st++) {
        const bool h = g->seen[st][PART_HASH], s = g->seen[st][PART_STATS];
        const found *a = &g->got[st][PART_HASH], *b = &g->got[st][PART_STATS];
        const char *name = stage_name((kv_stage)st);
        if (h != s)
            violation(v, "%s/%s.%s has no matching %s.%s.", g->gpath, name, h ? "hash" : "stats",
                      name, h ? "stats" : "hash");
        else if (h && (a->rows != b->rows || a->first != b->first))
            violation(v, "%s: %s.hash (%lld rows from %lld) and %s.stats (%lld rows from %lld) differ.",
                      g->gpath, name, (long long)a->rows, (long long)a->first, name,
                      (long long)b->rows, (long long)b->first);
    }
}

/* Row hashes of a full dump: every row dataset has its .hash and .stats
 * over the same positions (each hash is checked against its row as the
 * rows are scanned, in check_member). */
static void check_row_hashes(vstate *v, const group_walk *g)
{
    for (int st = 0; st < STAGE_COUNT; st++) {
        const char *name = stage_name((kv_stage)st);
        const found *rows = &g->got[st][PART_ROWS], *h = &g->got[st][PART_HASH];
        if (g->seen[st][PART_ROWS] != g->seen[st][PART_HASH]) {
            violation(v, "%s/%s%s has no %s%s (the dump says row_hashes = 1).", g->gpath, name,
                      g->seen[st][PART_HASH] ? ".hash" : "", name,
                      g->seen[st][PART_HASH] ? " rows" : ".hash");
            continue;
        }
        if (!g->seen[st][PART_ROWS] || !rows->ok || !h->ok)
            continue;
        /* a dump cut short may hold fewer hashes than rows (dump-format.md) */
        const bool short_ok = v->partial && h->rows < rows->rows;
        if ((rows->rows != h->rows && !short_ok) || rows->first != h->first)
            violation(v, "%s: %s (%lld rows from %lld) and %s.hash (%lld rows from %lld) differ.",
                      g->gpath, name, (long long)rows->rows, (long long)rows->first, name,
                      (long long)h->rows, (long long)h->first);
    }
}

static void check_stage_group(vstate *v, hid_t gid, const char *gpath, int layer)
{
    group_walk *g = calloc(1, sizeof *g);
    if (!g)
        return;
    g->v = v;
    g->gpath = gpath;
    g->layer = layer;
    dump_link *links;
    size_t n;
    if (dump_h5_list(gid, &links, &n) < 0) {
        violation(v, "%s: its members cannot be listed.", gpath);
    } else {
        for (size_t i = 0; i < n; i++) {
            const H5L_info_t info = {.type = links[i].type};
            check_member(gid, links[i].name, &info, g);
        }
        dump_links_free(links, n);
    }
    if (v->fingerprint || v->row_hashes)
        check_pairs(v, g);
    if (v->row_hashes)
        check_row_hashes(v, g);
    free(g);
}


static void check_layer_attrs(vstate *v, hid_t g, const char *gpath, int l)
{
    char *att = str_attr(v, g, gpath, "attention");
    int64_t window, owner;
    double theta;
    bool sliding = v->cfg_ok && v->cfg.layer_type[l] == ATTN_SLIDING;
    if (att && strcmp(att, "sliding") && strcmp(att, "global"))
        violation(v, "%s: attribute attention is '%s'; it must be 'sliding' or 'global'.", gpath, att);
    else if (att && v->cfg_ok && strcmp(att, sliding ? "sliding" : "global"))
        violation(v, "%s: attribute attention is '%s', but model_config layer_types says %s.", gpath,
                  att, sliding ? "sliding_attention" : "full_attention");
    free(att);
    if (int_attr(v, g, gpath, "window", &window) && v->cfg_ok &&
        window != (sliding ? v->cfg.sliding_window : 0))
        violation(v, "%s: attribute window is %lld; model_config says %d.", gpath,
                  (long long)window, sliding ? v->cfg.sliding_window : 0);
    if (attr_ok(v, g, gpath, "rope_theta", H5T_FLOAT)) {
        double want = sliding ? v->cfg.rope_local_theta : v->cfg.rope_theta;
        if (dump_h5_attr_f64(g, "rope_theta", &theta) < 0)
            violation(v, "%s: attribute rope_theta is not a single number.", gpath);
        else if (v->cfg_ok && theta != want)
            violation(v, "%s: attribute rope_theta is %g; model_config says %g.", gpath, theta, want);
    }
    if (int_attr(v, g, gpath, "kv_owner", &owner) && v->cfg_ok && owner != v->cfg.kv_owner[l])
        violation(v, "%s: attribute kv_owner is %lld; model_config says %d.", gpath,
                  (long long)owner, v->cfg.kv_owner[l]);
}

static herr_t check_layer(hid_t layers, const char *name, const H5L_info_t *info, void *data)
{
    vstate *v = data;
    char gpath[300];
    snprintf(gpath, sizeof gpath, "/layers/%s", name);
    int l = dump_layer_index(name);
    if (l < 0) {
        violation(v, "%s: the group name is not a layer index (a non-negative integer).", gpath);
        return 0;
    }
    if (v->cfg_ok && l >= v->cfg.n_layers) {
        violation(v, "%s: layer %d is not below num_hidden_layers (%d).", gpath, l, v->cfg.n_layers);
        return 0;
    }
    if (!v->cfg_ok && l >= KV_MAX_LAYERS)
        return 0;
    if (info->type == H5L_TYPE_EXTERNAL) {
        violation(v, "%s is an external link (to another file): a dump holds its own data.",
                  gpath);
        return 0;
    }
    hid_t g = open_member(v, layers, name, gpath, H5I_GROUP);
    if (g < 0)
        return 0;
    check_layer_attrs(v, g, gpath, l);
    check_stage_group(v, g, gpath, l);
    dump_h5_close(g);
    return 0;
}

static void check_layers_and_model(vstate *v)
{
    if (H5Lexists(v->file, "layers", H5P_DEFAULT) > 0) {
        hid_t g = open_member(v, v->file, "layers", "/layers", H5I_GROUP);
        dump_link *links;
        size_t n;
        if (g >= 0 && dump_h5_list(g, &links, &n) < 0)
            violation(v, "/layers: its members cannot be listed.");
        else if (g >= 0) {
            for (size_t i = 0; i < n; i++) {
                const H5L_info_t info = {.type = links[i].type};
                check_layer(g, links[i].name, &info, v);
            }
            dump_links_free(links, n);
        }
        dump_h5_close(g);
    }
    if (H5Lexists(v->file, "model", H5P_DEFAULT) > 0) {
        hid_t g = open_member(v, v->file, "model", "/model", H5I_GROUP);
        if (g >= 0)
            check_stage_group(v, g, "/model", -1);
        dump_h5_close(g);
    }
    H5Eclear2(H5E_DEFAULT);
}

/* ------------------------------------------------------------------ */
/* /output                                                              */

static found check_output_dataset(vstate *v, hid_t g, const char *name, expect x)
{
    char path[64];
    found none = {.ok = false};
    snprintf(path, sizeof path, "/output/%s", name);
    if (H5Lexists(g, name, H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        violation(v, "%s is missing (the /output group holds lse, topk_ids and topk_values).", path);
        return none;
    }
    hid_t d = open_member(v, g, name, path, H5I_DATASET);
    if (d < 0)
        return none;
    found f = check_dataset(v, d, path, x);
    if (x.kind == ELEM_F32)
        scan_values(v, d, path, &f, ELEM_F32, 0, H5I_INVALID_HID, false);
    else if (v->cfg_ok)
        scan_values(v, d, path, &f, ELEM_I32, v->cfg.vocab, H5I_INVALID_HID, false);
    dump_h5_close(d);
    return f;
}

static void check_output(vstate *v)
{
    int64_t k = -1;
    if (H5Lexists(v->file, "output", H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return;  /* optional: a writer may record no logits at all */
    }
    hid_t g = open_member(v, v->file, "output", "/output", H5I_GROUP);
    if (g < 0)
        return;
    if (int_attr(v, g, "/output", "k", &k) && k < 1) {
        violation(v, "/output: attribute k is %lld; it must be at least 1.", (long long)k);
        k = -1;
    }
    found lse = check_output_dataset(v, g, "lse", (expect){ELEM_F32, 0});
    found ids = check_output_dataset(v, g, "topk_ids", (expect){ELEM_I32, k});
    found val = check_output_dataset(v, g, "topk_values", (expect){ELEM_F32, k});
    const found *all[3] = {&lse, &ids, &val};
    for (int i = 1; i < 3; i++)
        if (all[0]->have_first && all[i]->have_first &&
            (all[i]->rows != all[0]->rows || all[i]->first != all[0]->first))
            violation(v, "/output: lse (%lld rows from position %lld) and %s (%lld rows from "
                         "position %lld) disagree.", (long long)lse.rows, (long long)lse.first,
                      i == 1 ? "topk_ids" : "topk_values", (long long)all[i]->rows,
                      (long long)all[i]->first);
    dump_h5_close(g);
}

/* ------------------------------------------------------------------ */
/* /row_hash_index                                                      */

/* Type, shape and first_position of a dataset the group checks have
 * already judged (so nothing is said here): false when not as wanted. */
static bool quiet_shape(hid_t d, elem_kind k, int rank, found *f)
{
    int filter;
    if (dump_h5_storage(d, &filter) != DUMP_STORAGE_OK) {
        f->ok = false;   /* the group checks say why; nothing of it is read */
        return false;
    }
    hid_t t = H5Dget_type(d), s = H5Dget_space(d);
    hsize_t dims[2] = {0, 1};
    bool ok = t >= 0 && type_matches(t, k) && s >= 0 && H5Sget_simple_extent_ndims(s) == rank &&
              H5Sget_simple_extent_dims(s, dims, NULL) >= 0 && dims[0] <= (hsize_t)INT64_MAX / 2;
    dump_h5_close(t);
    dump_h5_close(s);
    f->rows = (int64_t)dims[0];
    f->cols = rank == 2 ? (int64_t)dims[1] : 1;
    f->have_first = dump_h5_attr_i64(d, "first_position", &f->first) == 0;
    H5Eclear2(H5E_DEFAULT);
    f->ok = ok && f->have_first;
    return f->ok;
}

/* One index row against the datasets it summarizes: positions and width
 * as the rows, the digest of the hashes, the sum of squares and the flags
 * as the .hash and .stats datasets give them. */
static void check_index_row(vstate *v, const uint64_t *r, int64_t i)
{
    int layer;
    kv_stage st;
    const char *why = dump_index_row_problem(r, &layer, &st);
    if (why) {
        violation(v, "%s row %lld: %s.", DUMP_INDEX, (long long)i, why);
        return;
    }
    char base[96], hp[112], sp[112];
    if (layer >= 0)
        snprintf(base, sizeof base, "/layers/%d/%s", layer, stage_name(st));
    else
        snprintf(base, sizeof base, "/model/%s", stage_name(st));
    snprintf(hp, sizeof hp, "%s.hash", base);
    snprintf(sp, sizeof sp, "%s.stats", base);
    hid_t h = H5Lexists(v->file, hp, H5P_DEFAULT) > 0 ? H5Dopen2(v->file, hp, H5P_DEFAULT) : -1;
    hid_t s = H5Lexists(v->file, sp, H5P_DEFAULT) > 0 ? H5Dopen2(v->file, sp, H5P_DEFAULT) : -1;
    hid_t d = v->fingerprint ? H5I_INVALID_HID
              : H5Lexists(v->file, base, H5P_DEFAULT) > 0 ? H5Dopen2(v->file, base, H5P_DEFAULT)
                                                          : -1;
    H5Eclear2(H5E_DEFAULT);
    const hid_t rows_d = v->fingerprint ? h : d;
    found fr = {.ok = false}, fh = fr, fs = fr;
    if (rows_d < 0) {
        violation(v, "%s row %lld names %s, which the file does not hold.", DUMP_INDEX,
                  (long long)i, v->fingerprint ? hp : base);
        goto done;
    }
    if (h < 0 || s < 0)
        goto done;   /* a missing .hash or .stats: the group checks say so */
    if (!quiet_shape(h, ELEM_U64, 1, &fh) || !quiet_shape(s, ELEM_F32, 2, &fs) || fs.cols != 2 ||
        (!v->fingerprint && !quiet_shape(d, ELEM_F32, 2, &fr)))
        goto done;   /* the group checks say what is wrong */
    if (v->fingerprint)
        fr = fh;
    else if (v->cfg_ok && fr.cols != dump_stage_cols(&v->cfg, st, layer))
        goto done;   /* a width the config does not have: said by the group checks */
    const int64_t cols = v->fingerprint ? (v->cfg_ok ? dump_stage_cols(&v->cfg, st, layer) : -1) : fr.cols;
    /* positions as the hashes (whether they match the rows is the group
     * checks' to say), rows as many as the rows */
    if ((int64_t)r[2] != fh.first || (int64_t)r[3] != fr.rows || (cols >= 0 && (int64_t)r[4] != cols)) {
        char width[32] = "";
        if (cols >= 0)
            snprintf(width, sizeof width, " of %lld", (long long)cols);
        violation(v, "%s row %lld says %s holds %lld rows of %lld from position %lld; it holds "
                  "%lld%s from %lld.", DUMP_INDEX, (long long)i, base, (long long)r[3],
                  (long long)r[4], (long long)r[2], (long long)fr.rows, width,
                  (long long)fh.first);
        goto done;
    }
    const int64_t n = fh.rows < fs.rows ? fh.rows : fs.rows;
    if (!scan_allowed(v, hp, n, 3, 8))
        goto done;
    uint64_t *hash = malloc((size_t)(n ? n : 1) * sizeof *hash);
    float *stat = malloc((size_t)(n ? n : 1) * 2 * sizeof *stat);
    if (!hash || !stat || (n && (read_hashes(h, 0, n, hash) < 0 ||
                                 read_block(s, ELEM_F32, 0, n, 2, 2, stat) < 0))) {
        violation(v, "%s or %s cannot be read.", hp, sp);
    } else {
        const XXH128_hash_t want = XXH3_128bits(hash, (size_t)n * sizeof *hash);
        double sum = 0, isum;
        bool finite = true;
        for (int64_t k = 0; k < n; k++) {
            const double l2 = stat[2 * k];
            finite &= isfinite(stat[2 * k]) && isfinite(stat[2 * k + 1]);
            sum += l2 * l2;
        }
        memcpy(&isum, &r[7], sizeof isum);
        const uint64_t flags = (uint64_t)finite | (uint64_t)(fh.rows == fr.rows) << 1;
        if (want.low64 != r[5] || want.high64 != r[6])
            violation(v, "%s row %lld: the digest of %s does not match its hashes (they changed "
                      "after the index was written; compare reads the hashes instead).",
                      DUMP_INDEX, (long long)i, hp);
        else if (fh.rows != fs.rows || !(sum == isum || (isnan(sum) && isnan(isum))) ||
                 flags != r[8])
            violation(v, "%s row %lld: the sum of squares or flags of %s do not match %s.",
                      DUMP_INDEX, (long long)i, base, sp);
    }
    free(hash);
    free(stat);
done:
    dump_h5_close(h);
    dump_h5_close(s);
    dump_h5_close(d);
}

/* Optional: written by kvdiff when it closes a dump with row hashes. */
static void check_index(vstate *v)
{
    if (H5Lexists(v->file, DUMP_INDEX, H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return;
    }
    hid_t d = open_member(v, v->file, DUMP_INDEX, DUMP_INDEX, H5I_DATASET);
    if (d < 0)
        return;

    found f = {.ok = false};
    hid_t t = H5Dget_type(d), sp = H5Dget_space(d);
    hsize_t dims[2] = {0, 0};
    if (t >= 0 && type_matches(t, ELEM_U64) && sp >= 0 && H5Sget_simple_extent_ndims(sp) == 2 &&
        H5Sget_simple_extent_dims(sp, dims, NULL) >= 0 && dims[1] == DUMP_INDEX_COLS &&
        dims[0] <= (hsize_t)INT64_MAX / 2) {
        f.ok = true;
        f.rows = (int64_t)dims[0];
    } else
        violation(v, "%s must be a 2-D uint64 dataset of %d columns.", DUMP_INDEX,
                  DUMP_INDEX_COLS);
    dump_h5_close(t);
    dump_h5_close(sp);
    H5Eclear2(H5E_DEFAULT);
    const int64_t max = (int64_t)(KV_MAX_LAYERS + 1) * STAGE_COUNT;
    if (f.ok && f.rows > max)
        violation(v, "%s has %lld rows; a dump has at most %lld stage datasets.", DUMP_INDEX,
                  (long long)f.rows, (long long)max);
    else if (f.ok && f.rows > 0) {
        uint64_t *rows = malloc((size_t)f.rows * DUMP_INDEX_COLS * sizeof *rows);
        bool seen[KV_MAX_LAYERS + 1][STAGE_COUNT] = {{false}};
        if (!rows || H5Dread(d, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows) < 0) {
            H5Eclear2(H5E_DEFAULT);
            violation(v, "%s cannot be read.", DUMP_INDEX);
        } else
            for (int64_t i = 0; i < f.rows; i++) {
                const uint64_t *r = rows + i * DUMP_INDEX_COLS;
                int layer;
                kv_stage st;
                if (!dump_index_row_problem(r, &layer, &st)) {
                    if (seen[layer + 1][st]) {
                        violation(v, "%s row %lld: a stage listed twice.", DUMP_INDEX,
                                  (long long)i);
                        continue;
                    }
                    seen[layer + 1][st] = true;
                }
                check_index_row(v, r, i);
            }
        free(rows);
    }
    dump_h5_close(d);
}

/* ------------------------------------------------------------------ */
/* Entry                                                                */

int dump_validate(const char *path, void (*report)(void *ctx, const char *line), void *ctx,
                  kv_err *e)
{
    vstate v = {.path = path, .report = report, .ctx = ctx};
    struct stat st;
    v.file = dump_h5_open_walk(path, e);
    if (v.file < 0)
        return -1;
    v.scan_budget = (stat(path, &st) == 0 ? (int64_t)st.st_size : 0) * 64 + (16 << 20);
    if (check_format(&v)) {
        check_root(&v);
        check_tokens(&v);
        check_layers_and_model(&v);
        check_output(&v);
        check_index(&v);
    }
    dump_h5_close(v.file);
    return v.violations;
}
