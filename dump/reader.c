/* reader.c — reading a schema-v1 dump (dump.h): ours or another
 * program's, complete or cut short by a crash. Root attributes are read
 * once at open; rows are read as hyperslabs of the asked range only, so
 * memory stays bounded whatever the file's size. */
#include "dump_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A root attribute, read when first asked for: a string, an integer, or
 * neither (absent or of another type; remembered too). */
typedef struct {
    char *name;
    char *str;        /* NULL when not a string */
    bool is_int;
    int64_t ival;
} root_attr;

/* Filled lazily through a const dump_file: it lives behind a pointer.
 * Entries are allocated one by one so pointers to them stay valid. */
typedef struct {
    root_attr **items;
    int n;
} attr_cache;

/* Datasets kept open between reads: a comparer reads the same few
 * datasets block after block, and opening one costs more than reading a
 * block of hashes. Replaced round-robin; closed with the file. */
#define DSET_CACHE 32
typedef struct {
    char path[96];
    hid_t id;
} dset_entry;

typedef struct {
    dset_entry e[DSET_CACHE];
    int next;
} dset_cache;

struct dump_file {
    char *path;
    hid_t file;
    attr_cache *attrs;
    dset_cache *dsets;
    bool fingerprint;
    bool row_hashes;     /* full mode with <stage>.hash / .stats beside the rows */
    kv_config cfg;
    bool cfg_ok;
    char cfg_err[512];   /* the first model_config problem */
    int64_t n_tokens, prompt_length;
    int out_k;
};

/* ------------------------------------------------------------------ */
/* Root attributes                                                      */

/* Attributes are read by name, never by iterating: libhdf5 1.10.8 crashes
 * in H5Aiterate2's cleanup on some malformed attribute tables (found by
 * fuzz/fuzz_dump.c) where reading by name fails cleanly. */
static const root_attr *find_attr(const dump_file *f, const char *name)
{
    attr_cache *c = f->attrs;
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->items[i]->name, name))
            return c->items[i];
    root_attr **grown = realloc(c->items, (size_t)(c->n + 1) * sizeof *grown);
    if (!grown)
        return NULL;
    c->items = grown;
    root_attr *a = calloc(1, sizeof *a);
    if (!a || !(a->name = strdup(name))) {
        free(a);
        return NULL;
    }
    c->items[c->n++] = a;
    H5T_class_t cls = dump_h5_attr_class(f->file, name);
    if (cls == H5T_STRING && dump_h5_attr_str(f->file, name, &a->str) < 0)
        a->str = NULL;
    if (cls == H5T_INTEGER)
        a->is_int = dump_h5_attr_i64(f->file, name, &a->ival) == 0;
    return a;
}

const char *dump_attr(const dump_file *f, const char *name)
{
    const root_attr *a = f && name ? find_attr(f, name) : NULL;
    return a ? a->str : NULL;
}

int64_t dump_attr_int(const dump_file *f, const char *name, int64_t dflt)
{
    const root_attr *a = f && name ? find_attr(f, name) : NULL;
    return a && a->is_int ? a->ival : dflt;
}

/* Format and version first (another file entirely, or another schema),
 * then every required attribute, named together. */
static int check_root(const dump_file *f, kv_err *e)
{
    static const char *const strings[] = {"mode", "engine", "engine_settings", "model_config",
                                          "weight_fingerprint", "status", "tool_version"};
    const root_attr *fmt = find_attr(f, "format"), *ver = find_attr(f, "format_version");
    if (!fmt)
        return kv_errf(e, "%s: not a kvdiff dump (no format attribute)", f->path);
    if (!fmt->str)
        return kv_errf(e, "%s: not a kvdiff dump (its format attribute is not a string)", f->path);
    if (strcmp(fmt->str, DUMP_FORMAT))
        return kv_errf(e, "%s: not a kvdiff dump (format attribute is '%s')", f->path, fmt->str);
    if (!ver || !ver->is_int)
        return kv_errf(e, "%s: no integer format_version attribute (a kvdiff dump has one)", f->path);
    if (ver->ival != DUMP_VERSION)
        return kv_errf(e, "%s: schema version %lld; this kvdiff reads version %d", f->path,
                       (long long)ver->ival, DUMP_VERSION);
    char missing[512] = "";
    for (size_t i = 0; i < sizeof strings / sizeof *strings; i++)
        if (!dump_attr(f, strings[i]))
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%s (string)",
                     missing[0] ? ", " : "", strings[i]);
    const root_attr *seed = find_attr(f, "seed");
    if (!seed || !seed->is_int)
        snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%sseed (integer)",
                 missing[0] ? ", " : "");
    if (missing[0])
        return kv_errf(e, "%s: missing or mistyped root attributes: %s", f->path, missing);
    const char *mode = dump_attr(f, "mode");
    if (strcmp(mode, "full") && strcmp(mode, "fingerprint"))
        return kv_errf(e, "%s: unknown mode '%s' (full or fingerprint)", f->path, mode);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Datasets                                                             */

/* H5Dopen2 of a/b/c fails noisily when a/b is missing: check each link. */
static hid_t open_dataset(const dump_file *f, const char *path)
{
    char prefix[256];
    size_t n = strlen(path);
    if (n >= sizeof prefix)
        return H5I_INVALID_HID;
    for (size_t i = 1; i <= n; i++)
        if (path[i] == '/' || path[i] == 0) {
            memcpy(prefix, path, i);
            prefix[i] = 0;
            if (H5Lexists(f->file, prefix, H5P_DEFAULT) <= 0) {
                H5Eclear2(H5E_DEFAULT);
                return H5I_INVALID_HID;
            }
        }
    hid_t d = H5Dopen2(f->file, path, H5P_DEFAULT);
    if (d < 0)
        H5Eclear2(H5E_DEFAULT);
    return d;
}

/* An open handle of path owned by the cache (not to be closed), or
 * H5I_INVALID_HID when absent. */
static hid_t cached_dataset(const dump_file *f, const char *path)
{
    dset_cache *c = f->dsets;
    if (!c || strlen(path) >= sizeof c->e[0].path)
        return H5I_INVALID_HID;
    for (int i = 0; i < DSET_CACHE; i++)
        if (c->e[i].id > 0 && !strcmp(c->e[i].path, path))
            return c->e[i].id;
    hid_t d = open_dataset(f, path);
    if (d < 0)
        return d;
    dset_entry *slot = &c->e[c->next];
    c->next = (c->next + 1) % DSET_CACHE;
    if (slot->id > 0)
        H5Dclose(slot->id);
    snprintf(slot->path, sizeof slot->path, "%s", path);
    slot->id = d;
    return d;
}

/* Rank (1 or 2) and dims of a dataset; -1 for anything else. */
static int shape_of(hid_t d, hsize_t dims[2])
{
    hid_t s = H5Dget_space(d);
    int rank = s >= 0 ? H5Sget_simple_extent_ndims(s) : -1;
    if (rank < 1 || rank > 2 || H5Sget_simple_extent_dims(s, dims, NULL) < 0)
        rank = -1;
    dump_h5_close(s);
    if (rank == 1)
        dims[1] = 1;
    return rank;
}

static dump_dataset_info info_at(const dump_file *f, const char *path)
{
    dump_dataset_info di = {.present = false};
    hsize_t dims[2];
    hid_t d = open_dataset(f, path);
    if (d < 0)
        return di;
    if (shape_of(d, dims) > 0 && dims[0] <= INT64_MAX && dims[1] <= INT32_MAX) {
        di.present = true;
        di.rows = (int64_t)dims[0];
        di.cols = (int)dims[1];
        if (dump_h5_attr_i64(d, "first_position", &di.first_position) < 0)
            di.first_position = 0;
    }
    dump_h5_close(d);
    return di;
}

static void stage_path(int layer, kv_stage st, const char *suffix, char *buf, size_t n)
{
    if (layer >= 0)
        snprintf(buf, n, "/layers/%d/%s%s", layer, stage_name(st), suffix);
    else
        snprintf(buf, n, "/model/%s%s", stage_name(st), suffix);
}

/* Model stages live in /model (layer -1), the others in /layers/<i>. */
static bool stage_fits(kv_stage st, int layer)
{
    if (st < 0 || st >= STAGE_COUNT || layer < -1 || layer >= KV_MAX_LAYERS)
        return false;
    return (st >= STAGE_LAYER_COUNT) == (layer == -1);
}

dump_dataset_info dump_hash_info(const dump_file *f, int layer, kv_stage stage)
{
    dump_dataset_info none = {.present = false};
    char path[128];
    if (!dump_has_row_hashes(f) || !stage_fits(stage, layer))
        return none;
    stage_path(layer, stage, ".hash", path, sizeof path);
    return info_at(f, path);
}

dump_dataset_info dump_stage_info(const dump_file *f, int layer, kv_stage stage)
{
    dump_dataset_info none = {.present = false};
    char path[128];
    if (!f || !stage_fits(stage, layer))
        return none;
    stage_path(layer, stage, f->fingerprint ? ".hash" : "", path, sizeof path);
    return info_at(f, path);
}

/* The element type a reader expects, checked before HDF5 would convert. */
typedef enum { ELEM_F32, ELEM_I32, ELEM_U64 } elem_kind;

static bool type_is(hid_t d, elem_kind k)
{
    hid_t t = H5Dget_type(d);
    bool ok = false;
    if (t >= 0) {
        H5T_class_t cls = H5Tget_class(t);
        size_t size = H5Tget_size(t);
        if (k == ELEM_F32)
            ok = cls == H5T_FLOAT && size == 4;
        else
            ok = cls == H5T_INTEGER && size == (k == ELEM_I32 ? 4u : 8u) &&
                 H5Tget_sign(t) == (k == ELEM_I32 ? H5T_SGN_2 : H5T_SGN_NONE);
    }
    dump_h5_close(t);
    return ok;
}

static const char *elem_name(elem_kind k)
{
    return k == ELEM_F32 ? "float32" : k == ELEM_I32 ? "int32" : "uint64";
}

/* Reads rows [row0, row0 + n) of path into out. cols: 0 for a 1-D
 * dataset, k > 0 for exactly k columns, -1 for any 2-D width. */
static int read_rows_at(const dump_file *f, const char *path, elem_kind k, int cols, int64_t row0,
                        int64_t n, void *out, kv_err *e)
{
    hid_t mtype = k == ELEM_F32   ? H5T_NATIVE_FLOAT
                  : k == ELEM_I32 ? H5T_NATIVE_INT32
                                  : H5T_NATIVE_UINT64;
    hsize_t dims[2];
    const bool cached = strlen(path) < sizeof f->dsets->e[0].path;
    hid_t d = cached ? cached_dataset(f, path) : open_dataset(f, path);
    hid_t fspace = H5I_INVALID_HID, mspace = H5I_INVALID_HID;
    int rc = -1, rank;
    if (d < 0)
        return kv_errf(e, "%s: no dataset %s", f->path, path);
    if ((rank = shape_of(d, dims)) < 0 || (cols == 0) != (rank == 1) ||
        (cols > 0 && dims[1] != (hsize_t)cols)) {
        kv_errf(e, "%s: %s has the wrong shape (expected %s)", f->path, path,
                cols == 0 ? "1-D" : "2-D of the right width");
        goto done;
    }
    if (!type_is(d, k)) {
        kv_errf(e, "%s: %s is not %s", f->path, path, elem_name(k));
        goto done;
    }
    if (row0 < 0 || n < 0 || (hsize_t)row0 > dims[0] || (hsize_t)n > dims[0] - (hsize_t)row0) {
        kv_errf(e, "%s: %s has %llu rows; rows %lld..%lld asked for", f->path, path,
                (unsigned long long)dims[0], (long long)row0, (long long)(row0 + n - 1));
        goto done;
    }
    rc = 0;
    if (n == 0)
        goto done;
    hsize_t start[2] = {(hsize_t)row0, 0}, count[2] = {(hsize_t)n, dims[1]};
    if ((fspace = H5Dget_space(d)) < 0 ||
        H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL) < 0 ||
        (mspace = H5Screate_simple(rank, count, NULL)) < 0 ||
        H5Dread(d, mtype, mspace, fspace, H5P_DEFAULT, out) < 0) {
        char what[300];
        snprintf(what, sizeof what, "cannot read %s", path);
        rc = dump_h5_fail(e, f->path, what);
    }
done:
    dump_h5_close(mspace);
    dump_h5_close(fspace);
    if (!cached)
        dump_h5_close(d);
    return rc;
}

int dump_read_rows(const dump_file *f, int layer, kv_stage stage, int64_t row0, int64_t n,
                   float *out, kv_err *e)
{
    char path[128];
    if (!f || !stage_fits(stage, layer))
        return kv_errf(e, "%s: no stage %s in layer %d", f ? f->path : "dump", stage_name(stage),
                       layer);
    if (f->fingerprint)
        return kv_errf(e, "%s: a fingerprint dump holds hashes, not rows", f->path);
    stage_path(layer, stage, "", path, sizeof path);
    return read_rows_at(f, path, ELEM_F32, -1, row0, n, out, e);
}

int dump_read_hashes(const dump_file *f, int layer, kv_stage stage, int64_t row0, int64_t n,
                     uint64_t *hash, float *stats, kv_err *e)
{
    char path[128];
    if (!f || !stage_fits(stage, layer))
        return kv_errf(e, "%s: no stage %s in layer %d", f ? f->path : "dump", stage_name(stage),
                       layer);
    if (!f->fingerprint && !f->row_hashes)
        return kv_errf(e, "%s: this full dump holds rows, not row hashes", f->path);
    stage_path(layer, stage, ".hash", path, sizeof path);
    if (hash && read_rows_at(f, path, ELEM_U64, 0, row0, n, hash, e) < 0)
        return -1;
    stage_path(layer, stage, ".stats", path, sizeof path);
    if (stats && read_rows_at(f, path, ELEM_F32, 2, row0, n, stats, e) < 0)
        return -1;
    return 0;
}

dump_dataset_info dump_output_info(const dump_file *f)
{
    dump_dataset_info none = {.present = false};
    return f ? info_at(f, "/output/lse") : none;
}

int dump_output_k(const dump_file *f)
{
    return f ? f->out_k : 0;
}

int dump_read_output(const dump_file *f, int64_t row0, int64_t n, float *lse, int32_t *ids,
                     float *vals, kv_err *e)
{
    if (!f)
        return kv_errf(e, "dump: no file");
    if (f->out_k < 1 && (ids || vals))
        return kv_errf(e, "%s: /output has no valid k attribute", f->path);
    if (lse && read_rows_at(f, "/output/lse", ELEM_F32, 0, row0, n, lse, e) < 0)
        return -1;
    if (ids && read_rows_at(f, "/output/topk_ids", ELEM_I32, f->out_k, row0, n, ids, e) < 0)
        return -1;
    if (vals && read_rows_at(f, "/output/topk_values", ELEM_F32, f->out_k, row0, n, vals, e) < 0)
        return -1;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Tokens, config, small accessors                                      */

int64_t dump_n_tokens(const dump_file *f)
{
    return f ? f->n_tokens : 0;
}

int64_t dump_prompt_length(const dump_file *f)
{
    return f ? f->prompt_length : 0;
}

int dump_read_tokens(const dump_file *f, int32_t *out, kv_err *e)
{
    if (!f)
        return kv_errf(e, "dump: no file");
    return read_rows_at(f, "/tokens", ELEM_I32, 0, 0, f->n_tokens, out, e);
}

static void load_tokens(dump_file *f)
{
    dump_dataset_info di = info_at(f, "/tokens");
    hid_t d = di.present ? open_dataset(f, "/tokens") : H5I_INVALID_HID;
    f->n_tokens = di.present && di.cols == 1 ? di.rows : 0;
    if (d < 0 || dump_h5_attr_i64(d, "prompt_length", &f->prompt_length) < 0)
        f->prompt_length = 0;
    dump_h5_close(d);
}

static void load_output_k(dump_file *f)
{
    int64_t k = 0;
    hid_t g = H5I_INVALID_HID;
    if (H5Lexists(f->file, "output", H5P_DEFAULT) > 0)
        g = H5Gopen2(f->file, "output", H5P_DEFAULT);
    if (g >= 0 && dump_h5_attr_i64(g, "k", &k) == 0 && k >= 1 && k <= INT32_MAX)
        f->out_k = (int)k;
    dump_h5_close(g);
    H5Eclear2(H5E_DEFAULT);
}

static void keep_first_problem(void *ctx, const char *msg)
{
    dump_file *f = ctx;
    if (!f->cfg_err[0])
        snprintf(f->cfg_err, sizeof f->cfg_err, "%s", msg);
}

int dump_model_config(const dump_file *f, kv_config *out, kv_err *e)
{
    if (!f)
        return kv_errf(e, "dump: no file");
    if (!f->cfg_ok)
        return kv_errf(e, "%s: %s", f->path, f->cfg_err);
    *out = f->cfg;
    return 0;
}

int dump_n_layers(const dump_file *f)
{
    return f && f->cfg_ok ? f->cfg.n_layers : 0;
}

const char *dump_path(const dump_file *f)
{
    return f ? f->path : NULL;
}

bool dump_has_row_hashes(const dump_file *f)
{
    return f && (f->fingerprint || f->row_hashes);
}

bool dump_is_fingerprint(const dump_file *f)
{
    return f && f->fingerprint;
}

bool dump_is_complete(const dump_file *f)
{
    const char *st = dump_attr(f, "status");
    return st && !strcmp(st, "complete");
}

/* ------------------------------------------------------------------ */
/* Open and close                                                       */

void dump_file_close(dump_file *f)
{
    if (!f)
        return;
    for (int i = 0; f->dsets && i < DSET_CACHE; i++)
        if (f->dsets->e[i].id > 0)
            H5Dclose(f->dsets->e[i].id);
    free(f->dsets);
    dump_h5_close(f->file);
    for (int i = 0; f->attrs && i < f->attrs->n; i++) {
        free(f->attrs->items[i]->name);
        free(f->attrs->items[i]->str);
        free(f->attrs->items[i]);
    }
    if (f->attrs)
        free(f->attrs->items);
    free(f->attrs);
    free(f->path);
    free(f);
}

dump_file *dump_open(const char *path, kv_err *e)
{
    hid_t fid = dump_h5_open_read(path, e);
    if (fid < 0)
        return NULL;
    dump_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path)) || !(f->attrs = calloc(1, sizeof *f->attrs)) ||
        !(f->dsets = calloc(1, sizeof *f->dsets))) {
        if (f) {
            free(f->path);
            free(f->attrs);
        }
        free(f);
        dump_h5_close(fid);
        return kv_errf(e, "%s: out of memory", path), NULL;
    }
    f->file = fid;
    if (check_root(f, e) < 0) {
        dump_file_close(f);
        return NULL;
    }
    f->fingerprint = !strcmp(dump_attr(f, "mode"), "fingerprint");
    f->row_hashes = !f->fingerprint && dump_attr_int(f, "row_hashes", 0) == 1;
    f->cfg_ok =
        dump_config_parse(dump_attr(f, "model_config"), &f->cfg, keep_first_problem, f) == 0;
    load_tokens(f);
    load_output_k(f);
    return f;
}
