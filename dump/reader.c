/* reader.c — reading a schema-v1 dump (dump.h): ours or another
 * program's, complete or cut short by a crash. Root attributes are read
 * once at open; rows are read as hyperslabs of the asked range only, so
 * memory stays bounded whatever the file's size. */
#define _GNU_SOURCE   /* F_OFD_GETLK: is the writer's lock still held? */
#include "reader_internal.h"

#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

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

/* A missing dataset (or group on its way) just fails, silently on any
 * thread (a thread-safe libhdf5 keeps the printing switch per thread), and
 * the stack is cleared. */
static hid_t open_dataset(const dump_file *f, const char *path)
{
    hid_t d = H5I_INVALID_HID;
    H5E_BEGIN_TRY {
        d = H5Dopen2(f->file, path, f->dapl >= 0 ? f->dapl : H5P_DEFAULT);
    } H5E_END_TRY;
    ((dump_file *)f)->opened++;   /* the object is the caller's, never const */
    if (d < 0)
        H5Eclear2(H5E_DEFAULT);
    return d;
}

/* No chunk cache: plain rows are read past libhdf5, and the rest in whole
 * blocks, so a cache would only copy each chunk once more (and hold up to
 * 1 MiB per open dataset). One list for every dataset of the file. */
static hid_t no_cache_dapl(void)
{
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl >= 0 && H5Pset_chunk_cache(dapl, H5D_CHUNK_CACHE_NSLOTS_DEFAULT, 0,
                                        H5D_CHUNK_CACHE_W0_DEFAULT) < 0) {
        dump_h5_close(dapl);
        dapl = H5I_INVALID_HID;
    }
    H5Eclear2(H5E_DEFAULT);
    return dapl;
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

static int kind_of(hid_t d)
{
    hid_t t = H5Dget_type(d);
    int k = -1;
    if (t >= 0) {
        H5T_class_t cls = H5Tget_class(t);
        size_t size = H5Tget_size(t);
        if (cls == H5T_FLOAT && size == 4)
            k = ELEM_F32;
        else if (cls == H5T_INTEGER && size == 4 && H5Tget_sign(t) == H5T_SGN_2)
            k = ELEM_I32;
        else if (cls == H5T_INTEGER && size == 8 && H5Tget_sign(t) == H5T_SGN_NONE)
            k = ELEM_U64;
    }
    dump_h5_close(t);
    return k;
}

static unsigned path_hash(const char *s)
{
    unsigned h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h % META_BUCKETS;
}

dset_meta *dump_meta_find(const dump_file *f, const char *path)
{
    for (dset_meta *m = atomic_load_explicit(&f->meta->b[path_hash(path)], memory_order_acquire);
         m; m = m->next)
        if (!strcmp(m->path, path))
            return m;
    return NULL;
}

/* A dataset that did not open: absent (0), or a link of that name that
 * leads nowhere (dangling, a loop of soft links) or to another file. */
static int link_problem(const dump_file *f, const char *path)
{
    H5L_info_t li;
    htri_t there = -1;
    herr_t got = -1;
    H5E_BEGIN_TRY {
        there = H5Lexists(f->file, path, H5P_DEFAULT);
        if (there > 0)
            got = H5Lget_info(f->file, path, &li, H5P_DEFAULT);
    } H5E_END_TRY;
    H5Eclear2(H5E_DEFAULT);
    if (there <= 0)
        return 0;
    return got >= 0 && li.type == H5L_TYPE_EXTERNAL ? META_EXTERNAL_LINK : META_UNOPENABLE;
}

/* The entry of path, looked up now if needed; NULL only when out of
 * memory. An absent dataset gets an entry too (present false). */
static dset_meta *meta_of(const dump_file *f, const char *path)
{
    dset_meta *m = dump_meta_find(f, path);
    if (m)
        return m;
    if (!(m = calloc(1, sizeof *m)) || !(m->path = strdup(path))) {
        free(m);
        return NULL;
    }
    m->mapped = -1;
    m->kind = -1;
    /* Kept open: opening costs more than reading a block of hashes. */
    hid_t d = m->id = open_dataset(f, path);
    if (d >= 0) {
        m->present = true;
        /* the storage first: the extent of a virtual dataset is its
         * source files' */
        m->problem = dump_h5_storage(d, &m->filter);
        m->rank = m->problem == DUMP_STORAGE_OK ? shape_of(d, m->dims) : -1;
        /* Past what a reader indexes: read as no shape (dims stay as the
         * file says them, for past_limits to name). */
        if (m->rank > 0 && (m->dims[0] > INT64_MAX || m->dims[1] > INT32_MAX))
            m->rank = -1;
        m->kind = kind_of(d);
        m->has_first = dump_h5_attr_i64(d, "first_position", &m->first_position) == 0;
        if (!m->has_first)
            m->first_position = 0;
    } else {
        m->problem = link_problem(f, path);
    }
    dump_meta_publish(f, m);
    return m;
}

void dump_meta_publish(const dump_file *f, dset_meta *m)
{
    const unsigned h = path_hash(m->path);
    m->next = atomic_load_explicit(&f->meta->b[h], memory_order_relaxed);
    atomic_store_explicit(&f->meta->b[h], m, memory_order_release);
}

/* The entry's dataset, opened again if an entry filled in elsewhere
 * (survey.c) or mapped once (its handle closed) is read through libhdf5. */
static hid_t handle_of(const dump_file *f, dset_meta *m)
{
    if (m->id < 0 && m->present)
        m->id = open_dataset(f, m->path);
    return m->id;
}

void dump_meta_free(dset_meta *m)
{
    if (!m)
        return;
    dump_h5_close(m->id);
    dump_rowmap_free(&m->map);
    free(m->path);
    free(m);
}

static void meta_free(meta_table *t)
{
    for (int i = 0; t && i < META_BUCKETS; i++)
        for (dset_meta *m = atomic_load(&t->b[i]), *next; m; m = next) {
            next = m->next;
            dump_meta_free(m);
        }
    free(t);
}

/* Direct reads on (the default) or off: tests read everything through
 * libhdf5 too and compare. Set before files are opened. */
static bool direct_reads = true;

void dump_set_direct_reads(bool on)
{
    direct_reads = on;
}

/* Tries once to map the dataset's rows for direct reads. */
static void try_map(const dump_file *f, dset_meta *m)
{
    if (m->mapped >= 0)
        return;
    if (!f->direct) {
        m->mapped = 0;
        return;
    }
    m->mapped = 0;
    hid_t std = m->kind == ELEM_F32   ? H5T_IEEE_F32LE
                : m->kind == ELEM_I32 ? H5T_STD_I32LE
                                      : H5T_STD_U64LE;
    if (m->kind >= 0 && handle_of(f, m) >= 0)
        m->mapped = dump_rowmap_build(m->id, std, f->fd, f->size, &m->map);
    if (m->mapped == 1) {
        dump_h5_close(m->id);
        m->id = H5I_INVALID_HID;
    }
}

static dump_dataset_info info_at(const dump_file *f, const char *path)
{
    dump_dataset_info di = {.present = false};
    const dset_meta *m = meta_of(f, path);
    if (m && m->present && m->rank > 0) {
        di.present = true;
        di.rows = (int64_t)m->dims[0];
        di.cols = (int)m->dims[1];
        di.first_position = m->first_position;
    }
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

static const char *elem_name(elem_kind k)
{
    return k == ELEM_F32 ? "float32" : k == ELEM_I32 ? "int32" : "uint64";
}

/* A dataset whose extent is past what a reader indexes (meta_of read its
 * shape as none, keeping the dims): said as such, not as a wrong rank. */
static int past_limits(const dump_file *f, const dset_meta *m, kv_err *e)
{
    if (m->rank >= 0)
        return 0;
    if (m->dims[1] > INT32_MAX)
        return kv_errf(e, "%s: %s is %llu columns wide, past the limit of %d (2^31 - 1) columns "
                       "a dataset may have", f->path, m->path, (unsigned long long)m->dims[1],
                       INT32_MAX);
    if (m->dims[0] > INT64_MAX)
        return kv_errf(e, "%s: %s has %llu rows, past the limit of %lld (2^63 - 1)", f->path,
                       m->path, (unsigned long long)m->dims[0], (long long)INT64_MAX);
    return 0;
}

/* Shape, type and range of a read, checked against what the file says. */
static int check_read(const dump_file *f, const dset_meta *m, elem_kind k, int cols, int64_t row0,
                      int64_t n, kv_err *e)
{
    if (!m)
        return kv_errf(e, "%s: out of memory", f->path);
    if (!m->present)
        return kv_errf(e, "%s: no dataset %s", f->path, m->path);
    if (past_limits(f, m, e) < 0)
        return -1;
    if (m->rank < 0 || (cols == 0) != (m->rank == 1) ||
        (cols > 0 && m->dims[1] != (hsize_t)cols))
        return kv_errf(e, "%s: %s has the wrong shape (expected %s)", f->path, m->path,
                       cols == 0 ? "1-D" : "2-D of the right width");
    if (m->kind != (int)k)
        return kv_errf(e, "%s: %s is not %s", f->path, m->path, elem_name(k));
    if (row0 < 0 || n < 0 || (hsize_t)row0 > m->dims[0] || (hsize_t)n > m->dims[0] - (hsize_t)row0)
        return kv_errf(e, "%s: %s has %llu rows; rows %lld..%lld asked for", f->path, m->path,
                       (unsigned long long)m->dims[0], (long long)row0, (long long)(row0 + n - 1));
    return 0;
}

static int read_h5(const dump_file *f, dset_meta *m, elem_kind k, int64_t row0, int64_t n,
                   void *out, kv_err *e);

/* Reads rows [row0, row0 + n) of path into out. cols: 0 for a 1-D
 * dataset, k > 0 for exactly k columns, -1 for any 2-D width. Plain
 * storage is read straight from the file; anything else via libhdf5. */
static int read_rows_at(const dump_file *f, const char *path, elem_kind k, int cols, int64_t row0,
                        int64_t n, void *out, kv_err *e)
{
    dset_meta *m = meta_of(f, path);
    if (check_read(f, m, k, cols, row0, n, e) < 0)
        return -1;
    if (n == 0)
        return 0;
    try_map(f, m);
    if (m->mapped == 1)
        return dump_rowmap_read(&m->map, f->fd, f->path, row0, n, out, e);
    return read_h5(f, m, k, row0, n, out, e);
}

/* Rows [row0, row0 + n) of an open dataset through libhdf5. */
static int read_h5(const dump_file *f, dset_meta *m, elem_kind k, int64_t row0, int64_t n,
                   void *out, kv_err *e)
{
    const char *path = m->path;
    hid_t mtype = k == ELEM_F32   ? H5T_NATIVE_FLOAT
                  : k == ELEM_I32 ? H5T_NATIVE_INT32
                                  : H5T_NATIVE_UINT64;
    const hid_t d = handle_of(f, m);
    hid_t fspace = H5I_INVALID_HID, mspace = H5I_INVALID_HID;
    int rc = 0;
    if (d < 0)
        return kv_errf(e, "%s: no dataset %s", f->path, path);
    hsize_t start[2] = {(hsize_t)row0, 0}, count[2] = {(hsize_t)n, m->dims[1]};
    if ((fspace = H5Dget_space(d)) < 0 ||
        H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL) < 0 ||
        (mspace = H5Screate_simple(m->rank, count, NULL)) < 0 ||
        H5Dread(d, mtype, mspace, fspace, H5P_DEFAULT, out) < 0) {
        char what[300];
        snprintf(what, sizeof what, "cannot read %s", path);
        rc = dump_h5_fail(e, f->path, what);
    }
    dump_h5_close(mspace);
    dump_h5_close(fspace);
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

int dump_rows_parallel(const dump_file *f, int layer, kv_stage stage)
{
    char path[128];
    if (!f || f->fingerprint || !stage_fits(stage, layer))
        return 0;
    stage_path(layer, stage, "", path, sizeof path);
    dset_meta *m = meta_of(f, path);
    if (!m || check_read(f, m, ELEM_F32, -1, 0, 0, NULL) < 0)
        return 0;
    try_map(f, m);
    return m->mapped == 1;
}

int dump_read_rows_parallel(const dump_file *f, int layer, kv_stage stage, int64_t row0,
                            int64_t n, float *out, kv_err *e)
{
    char path[128];
    if (!f || !stage_fits(stage, layer))
        return kv_errf(e, "%s: no stage %s in layer %d", f ? f->path : "dump", stage_name(stage),
                       layer);
    stage_path(layer, stage, "", path, sizeof path);
    const dset_meta *m = dump_meta_find(f, path);
    if (!m || m->mapped != 1)
        return kv_errf(e, "%s: %s was not prepared for parallel reads", f->path, path);
    return dump_rowmap_read(&m->map, f->fd, f->path, row0, n, out, e);
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

void dump_map_hashes(const dump_file *f, int layer, kv_stage stage, bool hash, bool stats)
{
    char path[128];
    if (!f || !stage_fits(stage, layer) || (!f->fingerprint && !f->row_hashes))
        return;
    static const char *const suffix[] = {".hash", ".stats"};
    for (int i = 0; i < 2; i++) {
        if (!(i == 0 ? hash : stats))
            continue;
        stage_path(layer, stage, suffix[i], path, sizeof path);
        dset_meta *m = meta_of(f, path);
        if (m && m->present)
            try_map(f, m);
    }
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
    f->has_prompt_length = d >= 0 && dump_h5_attr_i64(d, "prompt_length", &f->prompt_length) == 0;
    if (!f->has_prompt_length)
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

const char *dump_index_row_problem(const uint64_t *r, int *layer, kv_stage *stage)
{
    double sum;
    memcpy(&sum, &r[7], sizeof sum);
    *layer = r[0] <= KV_MAX_LAYERS ? (int)r[0] - 1 : -2;
    *stage = stage_from_wire(r[1]);
    if (*layer < -1 || *stage == STAGE_COUNT || !stage_fits(*stage, *layer))
        return "no such layer and stage";
    if (r[2] > INT64_MAX / 2 || r[3] > INT64_MAX / 2)
        return "positions out of range";
    if (r[4] < 1 || r[4] > INT32_MAX)
        return "width out of range";
    /* NaN or infinite rows make the sum so; flag bit 0 clear says the
     * stage has such rows (compare then does not take the index's word). */
    if (sum < 0 || ((r[8] & 1) && !isfinite(sum)))
        return "sum of squares not a finite number >= 0";
    return r[8] > 3 ? "unknown flags" : NULL;
}

/* /row_hash_index: every row checked before any is believed; a malformed
 * index is set aside (the datasets still read), and said why. */
static void load_index(dump_file *f)
{
    if (H5Lexists(f->file, DUMP_INDEX, H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return;
    }
    kv_err e = {{0}};
    const dset_meta *m = meta_of(f, DUMP_INDEX);
    const hsize_t max = (hsize_t)(KV_MAX_LAYERS + 1) * STAGE_COUNT;
    if (!m || !m->present || m->rank != 2 || m->dims[1] != DUMP_INDEX_COLS ||
        m->kind != ELEM_U64 || m->dims[0] > max) {
        snprintf(f->index_problem, sizeof f->index_problem,
                 "%s is not a 2-D uint64 dataset of %d columns and at most %llu rows",
                 DUMP_INDEX, DUMP_INDEX_COLS, (unsigned long long)max);
        return;
    }
    const int64_t n = (int64_t)m->dims[0];
    uint64_t *rows = malloc((size_t)(n ? n : 1) * DUMP_INDEX_COLS * sizeof *rows);
    f->index = calloc(KV_MAX_LAYERS + 1, sizeof *f->index);
    if (!rows || !f->index ||
        read_rows_at(f, DUMP_INDEX, ELEM_U64, DUMP_INDEX_COLS, 0, n, rows, &e) < 0) {
        snprintf(f->index_problem, sizeof f->index_problem, "%s", rows && f->index ? e.msg
                                                                                  : "out of memory");
        goto bad;
    }
    for (int64_t i = 0; i < n; i++) {
        const uint64_t *r = rows + i * DUMP_INDEX_COLS;
        int layer;
        kv_stage st;
        double sum;
        const char *why = dump_index_row_problem(r, &layer, &st);
        if (!why && f->index[layer + 1][st].d.present)
            why = "a stage listed twice";
        memcpy(&sum, &r[7], sizeof sum);
        if (why) {
            snprintf(f->index_problem, sizeof f->index_problem, "%s row %lld: %s", DUMP_INDEX,
                     (long long)i, why);
            goto bad;
        }
        f->index[layer + 1][st] = (struct index_entry){
            .d = {.present = true, .first_position = (int64_t)r[2], .rows = (int64_t)r[3],
                  .cols = (int)r[4], .digest = {r[5], r[6]}, .sum_sq = sum,
                  .finite = r[8] & 1, .all_hashed = (r[8] >> 1) & 1}};
    }
    free(rows);
    f->index_rows = n;
    return;
bad:
    free(rows);
    free(f->index);
    f->index = NULL;
}

/* Reads the hashes an index row summarizes, from the live .hash dataset
 * (never from bytes the index points at: a dataset rewritten elsewhere
 * leaves its old bytes behind), and checks the row's digest against them:
 * an index left stale by an edit fails here. */
static bool check_entry(const dump_file *f, int layer, kv_stage stage, struct index_entry *x)
{
    const int64_t n = x->d.rows;
    char path[128];
    if (!x->d.all_hashed)
        return false;
    stage_path(layer, stage, ".hash", path, sizeof path);
    dset_meta *m = meta_of(f, path);
    if (!m || !m->present || m->rank != 1 || (int64_t)m->dims[0] != n ||
        m->first_position != x->d.first_position)
        return false;
    /* Real hashes take room in the file: a dataset claiming more (its
     * chunks never written) is not read. Read a span at a time. */
    if (m->kind != ELEM_U64 || (double)n * 8.0 > (double)f->size + 65536.0)
        return false;
    enum { SPAN = 1 << 16 };
    uint64_t *h = malloc((size_t)(n < SPAN ? (n ? n : 1) : SPAN) * sizeof *h);
    XXH3_state_t *st = XXH3_createState();
    kv_err e = {{0}};
    bool ok = h && st && XXH3_128bits_reset(st) == XXH_OK;
    for (int64_t r0 = 0; ok && r0 < n; r0 += SPAN) {
        const int64_t k = n - r0 < SPAN ? n - r0 : SPAN;
        /* through libhdf5 while not mapped: one pass does not pay for a map */
        ok = (m->mapped != 1 ? read_h5(f, m, ELEM_U64, r0, k, h, &e)
                             : read_rows_at(f, path, ELEM_U64, 0, r0, k, h, &e)) == 0 &&
             XXH3_128bits_update(st, h, (size_t)k * sizeof *h) == XXH_OK;
    }
    if (ok) {
        const XXH128_hash_t d = XXH3_128bits_digest(st);
        ok = d.low64 == x->d.digest[0] && d.high64 == x->d.digest[1];
    }
    XXH3_freeState(st);
    free(h);
    return ok;
}

dump_stage_digest dump_digest(const dump_file *f, int layer, kv_stage stage, bool checked)
{
    dump_stage_digest none = {.present = false};
    if (!f || !f->index || !stage_fits(stage, layer))
        return none;
    struct index_entry *x = &f->index[layer + 1][stage];
    if (!x->d.present || !checked)
        return x->d;
    if (!x->checked)
        x->checked = check_entry(f, layer, stage, x) ? 1 : -1;
    return x->checked > 0 ? x->d : none;
}

int64_t dump_datasets_opened(const dump_file *f)
{
    return f ? f->opened : 0;
}

int64_t dump_index_rows(const dump_file *f)
{
    return f && f->index ? f->index_rows : 0;
}

const char *dump_index_problem(const dump_file *f)
{
    return f && f->index_problem[0] ? f->index_problem : NULL;
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
/* Checks before anything is believed                                   */

/* Why an entry's dataset cannot be read as the dump's own; 0 when it can. */
static int check_openable(const dump_file *f, const dset_meta *m, kv_err *e)
{
    char why[200];
    if (!m)
        return kv_errf(e, "%s: out of memory", f->path);
    switch (m->problem) {
    case DUMP_STORAGE_OK:
        return 0;
    case META_UNOPENABLE:
        return kv_errf(e, "%s: %s cannot be opened (a dangling link, or soft links in a loop)",
                       f->path, m->path);
    case META_EXTERNAL_LINK:
        return kv_errf(e, "%s: %s is an external link (to another file): a dump holds its own "
                       "data", f->path, m->path);
    default:
        return kv_errf(e, "%s: %s %s", f->path, m->path,
                       dump_storage_words(m->problem, m->filter, why, sizeof why));
    }
}

/* A dataset of the schema: element kind, rank (cols 0: 1-D), width
 * (cols > 0; -1 any), first_position from 0, rows inside the tokens. */
static int check_shape(const dump_file *f, const dset_meta *m, elem_kind k, int cols,
                       const char *width_says, kv_err *e)
{
    if (check_openable(f, m, e) < 0 || past_limits(f, m, e) < 0)
        return -1;
    if (m->rank != (cols == 0 ? 1 : 2))
        return kv_errf(e, "%s: %s is not %s", f->path, m->path,
                       cols == 0 ? "1-D [rows]" : "2-D [rows, cols]");
    if (m->kind != (int)k)
        return kv_errf(e, "%s: %s is not %s", f->path, m->path, elem_name(k));
    if (cols > 0 && m->dims[1] != (hsize_t)cols)
        return kv_errf(e, "%s: %s has %llu columns; %s %d", f->path, m->path,
                       (unsigned long long)m->dims[1], width_says, cols);
    if (!m->has_first)
        return kv_errf(e, "%s: %s has no integer first_position attribute", f->path, m->path);
    if (m->first_position < 0)
        return kv_errf(e, "%s: %s: first_position %lld is negative", f->path, m->path,
                       (long long)m->first_position);
    if ((int64_t)m->dims[0] > f->n_tokens - m->first_position)
        return kv_errf(e, "%s: %s covers positions %lld and on (%llu rows), but /tokens holds "
                       "only %lld tokens", f->path, m->path, (long long)m->first_position,
                       (unsigned long long)m->dims[0], (long long)f->n_tokens);
    return 0;
}

static bool exists(const dset_meta *m)
{
    return m && (m->present || m->problem);
}

/* Two datasets over the same positions (hashes and their statistics), or
 * with fewer_ok, b over the first positions of a at most (a full dump's
 * hashes: one cut short may hold fewer than its rows, never more). */
static int check_same_rows(const dump_file *f, const dset_meta *a, const dset_meta *b,
                           bool fewer_ok, kv_err *e)
{
    if (a->first_position == b->first_position &&
        (a->dims[0] == b->dims[0] || (fewer_ok && b->dims[0] < a->dims[0])))
        return 0;
    return kv_errf(e, "%s: %s (%llu rows from position %lld) and %s (%llu rows from position "
                   "%lld) differ", f->path, a->path, (unsigned long long)a->dims[0],
                   (long long)a->first_position, b->path, (unsigned long long)b->dims[0],
                   (long long)b->first_position);
}

int dump_check_stage(const dump_file *f, int layer, kv_stage st, kv_err *e)
{
    char rp[128], hp[128], sp[128];
    if (!f || !stage_fits(st, layer))
        return 0;
    stage_path(layer, st, "", rp, sizeof rp);
    stage_path(layer, st, ".hash", hp, sizeof hp);
    stage_path(layer, st, ".stats", sp, sizeof sp);
    const bool hashes = f->fingerprint || f->row_hashes;
    const dset_meta *r = f->fingerprint ? NULL : meta_of(f, rp);
    const dset_meta *h = hashes ? meta_of(f, hp) : NULL, *s = hashes ? meta_of(f, sp) : NULL;
    if ((!f->fingerprint && !r) || (hashes && (!h || !s)))
        return kv_errf(e, "%s: out of memory", f->path);
    const bool any = exists(r) || exists(h) || exists(s);
    if (!any)
        return 0;
    if (layer >= 0 && f->cfg_ok && (st == STAGE_K || st == STAGE_V) &&
        f->cfg.kv_owner[layer] != layer)
        return kv_errf(e, "%s: %s: layer %d reads layer %d's cache (kv_owner), so it records "
                       "no %s", f->path, exists(r) ? rp : exists(h) ? hp : sp, layer,
                       f->cfg.kv_owner[layer], stage_name(st));
    if (layer >= 0 && f->cfg_ok && (st == STAGE_PLE_IN || st == STAGE_PLE_OUT) &&
        f->cfg.per_layer_dim <= 0)
        return kv_errf(e, "%s: %s: the model has no per-layer inputs "
                       "(hidden_size_per_layer_input), so it records no %s", f->path,
                       exists(r) ? rp : exists(h) ? hp : sp, stage_name(st));
    const int width = f->cfg_ok ? dump_stage_cols(&f->cfg, st, layer) : -1;
    if (exists(r) && check_shape(f, r, ELEM_F32, width, "the model config says", e) < 0)
        return -1;
    if (exists(h) && check_shape(f, h, ELEM_U64, 0, "", e) < 0)
        return -1;
    if (exists(s) && check_shape(f, s, ELEM_F32, 2, "statistics have", e) < 0)
        return -1;
    if (hashes && exists(h) != exists(s))
        return kv_errf(e, "%s: %s has no matching %s", f->path, exists(h) ? hp : sp,
                       exists(h) ? sp : hp);
    if (hashes && check_same_rows(f, h, s, false, e) < 0)
        return -1;
    if (!f->fingerprint && hashes) {
        if (exists(r) != exists(h))
            return kv_errf(e, "%s: %s has no %s (the dump says row_hashes = 1)", f->path,
                           exists(r) ? rp : hp, exists(r) ? hp : "rows");
        /* a dump cut short may have written rows its hashes did not
         * reach; a complete one hashes every row (validate says the same) */
        if (check_same_rows(f, r, h, !dump_is_complete(f), e) < 0)
            return -1;
    }
    return 0;
}


/* Is the link name of loc a group (opened through no external link)? */
static bool is_group(hid_t loc, const char *name)
{
    hid_t o = H5I_INVALID_HID;
    H5E_BEGIN_TRY {
        o = H5Oopen(loc, name, H5P_DEFAULT);
    } H5E_END_TRY;
    const bool group = o >= 0 && H5Iget_type(o) == H5I_GROUP;
    dump_h5_close(o);
    H5Eclear2(H5E_DEFAULT);
    return group;
}

/* Do the members of group name of loc list? A group whose link index is
 * damaged opens, but none of its members does: its stages would read as
 * "not recorded", where validate says the file is corrupt. */
static bool lists(hid_t loc, const char *name)
{
    hid_t g = H5Gopen2(loc, name, H5P_DEFAULT);
    dump_link *links = NULL;
    size_t n = 0;
    const bool ok = g >= 0 && dump_h5_list(g, &links, &n) == 0;
    dump_links_free(links, n);
    dump_h5_close(g);
    H5Eclear2(H5E_DEFAULT);
    return ok;
}

static int check_layer_groups(const dump_file *f, kv_err *e)
{
    if (H5Lexists(f->file, "layers", H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return 0;
    }
    if (!is_group(f->file, "layers"))
        return kv_errf(e, "%s: /layers is not a group that opens", f->path);
    hid_t g = H5Gopen2(f->file, "layers", H5P_DEFAULT);
    dump_link *links = NULL;
    size_t n = 0;
    int rc = 0;
    if (g < 0 || dump_h5_list(g, &links, &n) < 0)
        rc = kv_errf(e, "%s: the members of /layers cannot be listed", f->path);
    for (size_t i = 0; rc == 0 && i < n; i++) {
        const int l = dump_layer_index(links[i].name);
        if (l < 0)
            rc = kv_errf(e, "%s: /layers/%s: the group name is not a layer index (a "
                         "non-negative integer)", f->path, links[i].name);
        else if (l >= f->cfg.n_layers)
            rc = kv_errf(e, "%s: /layers/%d: layer %d is not below num_hidden_layers (%d)",
                         f->path, l, l, f->cfg.n_layers);
        else if (links[i].type == H5L_TYPE_EXTERNAL)
            rc = kv_errf(e, "%s: /layers/%d is an external link (to another file): a dump "
                         "holds its own data", f->path, l);
        else if (!is_group(g, links[i].name))
            rc = kv_errf(e, "%s: /layers/%d is not a group that opens", f->path, l);
        else if (!lists(g, links[i].name))
            rc = kv_errf(e, "%s: /layers/%d is damaged: its members cannot be listed", f->path,
                         l);
    }
    dump_links_free(links, n);
    dump_h5_close(g);
    H5Eclear2(H5E_DEFAULT);
    return rc;
}

/* /model and /output list their members (what is not there is checked
 * where it is read). */
static int check_top_groups(const dump_file *f, kv_err *e)
{
    static const char *const names[] = {"model", "output"};
    for (int i = 0; i < 2; i++) {
        const bool damaged = H5Lexists(f->file, names[i], H5P_DEFAULT) > 0 &&
                             is_group(f->file, names[i]) && !lists(f->file, names[i]);
        H5Eclear2(H5E_DEFAULT);
        if (damaged)
            return kv_errf(e, "%s: /%s is damaged: its members cannot be listed", f->path,
                           names[i]);
    }
    return 0;
}

/* /output, when there: k, the three datasets, and the ids (read in spans). */
static int check_output(const dump_file *f, kv_err *e)
{
    if (H5Lexists(f->file, "output", H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return 0;
    }
    int64_t k = 0;
    hid_t g = is_group(f->file, "output") ? H5Gopen2(f->file, "output", H5P_DEFAULT)
                                           : H5I_INVALID_HID;
    const bool have_k = g >= 0 && dump_h5_attr_i64(g, "k", &k) == 0;
    dump_h5_close(g);
    H5Eclear2(H5E_DEFAULT);
    if (g < 0)
        return kv_errf(e, "%s: /output is not a group that opens", f->path);
    if (!have_k)
        return kv_errf(e, "%s: /output has no integer attribute k", f->path);
    /* checked before anything of that size is allocated */
    if (k < 1 || k > f->cfg.vocab)
        return kv_errf(e, "%s: /output: attribute k is %lld; it must be from 1 to vocab_size "
                       "(%d)", f->path, (long long)k, f->cfg.vocab);
    static const char *const names[] = {"/output/lse", "/output/topk_ids", "/output/topk_values"};
    const dset_meta *m[3];
    for (int i = 0; i < 3; i++) {
        m[i] = meta_of(f, names[i]);
        if (m[i] && !exists(m[i]))
            return kv_errf(e, "%s: %s is missing (the /output group holds lse, topk_ids and "
                           "topk_values)", f->path, names[i]);
        if (check_shape(f, m[i], i == 1 ? ELEM_I32 : ELEM_F32, i == 0 ? 0 : (int)k,
                        "attribute k says", e) < 0 ||
            (i > 0 && check_same_rows(f, m[0], m[i], false, e) < 0))
            return -1;
    }
    /* The ids: as many as the rows (a few per position); a file claiming far
     * more than it holds is not read (validate does not scan it either). */
    const int64_t rows = (int64_t)m[1]->dims[0];
    if ((double)rows * (double)k * 4.0 > 64.0 * (double)f->size + (16 << 20))
        return 0;
    enum { SPAN = 4096 };
    int32_t *ids = malloc((size_t)SPAN * (size_t)k * sizeof *ids);
    if (!ids)
        return kv_errf(e, "%s: out of memory for /output/topk_ids", f->path);
    int rc = 0;
    for (int64_t r0 = 0; rc == 0 && r0 < rows; r0 += SPAN) {
        const int64_t n = rows - r0 < SPAN ? rows - r0 : SPAN;
        rc = read_rows_at(f, "/output/topk_ids", ELEM_I32, (int)k, r0, n, ids, e);
        for (int64_t i = 0; rc == 0 && i < n * k; i++)
            if (ids[i] < 0 || ids[i] >= f->cfg.vocab)
                rc = kv_errf(e, "%s: /output/topk_ids holds ids outside 0..%d (%d at position "
                             "%lld)", f->path, f->cfg.vocab - 1, ids[i],
                             (long long)(m[1]->first_position + r0 + i / k));
    }
    free(ids);
    return rc;
}

/* Whether a writer holds its lock on fd's file (writer.c lock_target: a
 * write lock on the whole file from create to the final status): 1 held,
 * 0 free, -1 cannot tell (no OFD locks, or the query failed). */
static int writer_lock_state(int fd)
{
#ifdef F_OFD_GETLK
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0)
        return -1;
    return fl.l_type != F_UNLCK;
#else
    (void)fd;
    return -1;
#endif
}

static int being_written(const char *path, kv_err *e)
{
    return kv_errf(e, "%s: is being written by another process now (status \"partial: "
                      "running\", its writer holds the file's lock): wait for that run to "
                      "finish, then read it", path);
}

int dump_check_not_written(const char *path, kv_err *e)
{
    /* O_NONBLOCK: a FIFO at path does not hang the open (the read that
     * follows names it). */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        return 0;   /* the read that follows says why */
    const bool live = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && writer_lock_state(fd) == 1;
    close(fd);
    return live ? being_written(path, e) : 0;
}

int dump_check_file(const dump_file *f, kv_err *e)
{
    if (!f)
        return kv_errf(e, "dump: no file");
    /* First: a file still growing fails the checks below by a few rows
     * (rows land before /tokens grows), which would read as damage. */
    if (f->fd >= 0 && writer_lock_state(f->fd) == 1)
        return being_written(f->path, e);
    if (!f->cfg_ok)
        return kv_errf(e, "%s: %s", f->path, f->cfg_err);
    json_t *j = json_loads(dump_attr(f, "engine_settings"), 0, NULL);
    const bool object = json_is_object(j);
    json_decref(j);
    if (!object)
        return kv_errf(e, "%s: the root attribute engine_settings is not a JSON object",
                       f->path);
    const dset_meta *t = meta_of(f, "/tokens");
    if (t && !exists(t))
        return kv_errf(e, "%s: /tokens is missing (int32 [n], the prompt then the generated "
                       "tokens)", f->path);
    if (check_openable(f, t, e) < 0)
        return -1;
    if (t->rank != 1 || t->kind != ELEM_I32)
        return kv_errf(e, "%s: /tokens is not a 1-D int32 dataset", f->path);
    if (f->n_tokens > DUMP_MAX_POSITIONS)
        return kv_errf(e, "%s: /tokens claims %lld positions; a dump holds at most %lld (a "
                          "damaged or hand-made extent)", f->path, (long long)f->n_tokens,
                       DUMP_MAX_POSITIONS);
    if (!f->has_prompt_length)
        return kv_errf(e, "%s: /tokens has no integer prompt_length attribute", f->path);
    if (H5Lexists(f->file, "model", H5P_DEFAULT) > 0 && !is_group(f->file, "model"))
        return kv_errf(e, "%s: /model is not a group that opens", f->path);
    H5Eclear2(H5E_DEFAULT);
    return check_layer_groups(f, e) < 0 || check_top_groups(f, e) < 0 || check_output(f, e) < 0
               ? -1 : 0;
}

/* ------------------------------------------------------------------ */
/* Open and close                                                       */

void dump_file_close(dump_file *f)
{
    if (!f)
        return;
    free(f->index);
    meta_free(f->meta);
    if (f->fd >= 0)
        close(f->fd);
    dump_h5_close(f->dapl);
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

/* "partial: running" is what a writer leaves while it writes, and all a
 * writer leaves that was killed, or whose last words found the disk full
 * or the file-size limit reached. A live writer holds its lock on the file
 * (writer.c); with no lock held, nobody is running: said so. */
static void settle_running(dump_file *f)
{
    root_attr *a = (root_attr *)find_attr(f, "status");
    if (!a || !a->str || strcmp(a->str, "partial: running") != 0 || f->fd < 0)
        return;
    if (writer_lock_state(f->fd) != 0)
        return;
    char *words = strdup("partial: its writer ended without closing it (killed, or out of "
                         "disk space or file size)");
    if (words) {
        free(a->str);
        a->str = words;
    }
}

dump_file *dump_open(const char *path, kv_err *e)
{
    hid_t fid = dump_h5_open_read(path, e);
    if (fid < 0)
        return NULL;
    dump_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path)) || !(f->attrs = calloc(1, sizeof *f->attrs)) ||
        !(f->meta = calloc(1, sizeof *f->meta))) {
        if (f) {
            free(f->path);
            free(f->attrs);
        }
        free(f);
        dump_h5_close(fid);
        return kv_errf(e, "%s: out of memory", path), NULL;
    }
    f->file = fid;
    f->dapl = no_cache_dapl();
    /* A second descriptor for direct reads; without one, libhdf5 reads all. */
    struct stat st;
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd >= 0 && (fstat(f->fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        close(f->fd);
        f->fd = -1;
    }
    f->size = f->fd >= 0 ? (int64_t)st.st_size : 0;
    f->direct = direct_reads && f->fd >= 0 && dump_file_plain(fid);
    if (check_root(f, e) < 0) {
        dump_file_close(f);
        return NULL;
    }
    settle_running(f);
    f->fingerprint = !strcmp(dump_attr(f, "mode"), "fingerprint");
    f->row_hashes = !f->fingerprint && dump_attr_int(f, "row_hashes", 0) == 1;
    f->cfg_ok =
        dump_config_parse(dump_attr(f, "model_config"), &f->cfg, keep_first_problem, f) == 0;
    load_tokens(f);
    load_output_k(f);
    load_index(f);
    return f;
}
