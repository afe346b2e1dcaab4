/* writer.c — the dump writer (dump.h, docs/dump-format.md).
 *
 * dump_create makes every group, dataset and attribute the selection
 * implies, then switches the file to SWMR mode: from there on only raw
 * data is appended, which SWMR allows. Rows are buffered per dataset and
 * go out a block (a chunk) at a time, whole blocks straight from the
 * engine's memory; the file is flushed at the end of every forward batch
 * and every FLUSH_BYTES within one; at the end of a batch the rows still
 * waiting for their block to fill (a decode step's) are written where they
 * belong too. So a crash (kill -9 included) leaves a coherent file holding
 * every row of every batch before the last, its status still "partial:
 * running". Attributes cannot change under SWMR,
 * so dump_close closes the file, reopens it normally and rewrites status
 * and /tokens' prompt_length.
 *
 * Compressed dumps (shuffle + deflate) are written in SWMR mode too: HDF5
 * 1.10.8 accepts filtered chunked datasets under SWMR (tests cover a crash
 * in the middle of a compressed dump).
 *
 * Object timestamps are off and every chunk has a defined fill value, so
 * two identical runs give identical files, byte for byte.
 *
 * Two writers of one path would corrupt each other: libhdf5 drops its own
 * file lock when SWMR writing starts, so a second H5Fcreate truncates a
 * file still being written. The writer therefore takes a lock of its own
 * (an open-file-description lock on the file, which does not meet
 * libhdf5's flock()) before anything touches the path, and holds it until
 * the final status is written; a second writer fails at once. */
#define _GNU_SOURCE   /* F_OFD_SETLK: a lock owned by our descriptor, not the process */
#include "dump_internal.h"
#include "../model/outfile.h"
#include "../model/pool.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <sys/stat.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#define MAX_BLOCK_ROWS (1 << 20)
#define MAX_CHUNK_BYTES ((size_t)1 << 31)  /* HDF5 allows < 4 GiB; stay far below */
/* Within a forward batch the file is flushed whenever this much was
 * appended since the last flush: what a crash in a long prefill can lose. */
#define FLUSH_BYTES ((size_t)64 << 20)
/* Disk space reserved ahead of HDF5's allocations before a flush. */
#define RESERVE ((size_t)1 << 20)

/* One extendible dataset being appended to, a block of rows at a time. */
typedef struct {
    hid_t dset;
    hid_t mtype;          /* memory type of the buffered elements (predefined: never closed) */
    size_t row_bytes;     /* bytes of one row */
    int cols;             /* 0 for a 1-D dataset */
    int64_t first;        /* position of row 0: the first_position attribute */
    int64_t written;      /* rows in the file */
    bool cached;          /* written through HDF5's chunk cache since the last flush */
    bool dirty;           /* buffered rows not yet in the file (nbuf > pending) */
    int nbuf;             /* rows buffered */
    int pending;          /* of them, those already in the file (step_out) */
    unsigned char *buf;   /* (block_rows, row_bytes), allocated at the first row */
    char *name;           /* "/layers/3/q", for messages */
} appender;

/* One recorded stage of one layer, or of the model. */
typedef struct {
    appender rows;        /* full mode: the rows; fingerprint mode: <stage>.hash */
    appender stats;       /* fingerprint mode, full mode with row hashes: <stage>.stats */
    appender hash;        /* full mode with row hashes: <stage>.hash */
    int cols;             /* floats per row the engine emits */
    /* For /row_hash_index, over every row hashed so far in position order:
     * a running XXH3-128 of the hashes, the sum of the squared L2 norms,
     * and whether every statistic was finite. NULL without row hashes. */
    XXH3_state_t *digest;
    double sum_sq;
    bool finite;
} stage_sink;

struct dump_writer {
    kv_observer obs;      /* first member: the callbacks cast self back */
    char *path;
    hid_t file;
    dump_opts o;
    kv_config cfg;
    int max_positions;
    int meta_prompt;      /* prompt length given at creation (0 unknown) */
    int64_t first;        /* first_position of every stage dataset */
    int64_t out_first;    /* first_position of /output: pos_lo, or the last prompt
                             position when only generation's logits are computed */
    stage_sink *sinks[STAGE_COUNT][KV_MAX_LAYERS + 1];  /* [stage][layer + 1]; NULL: not recorded */
    appender tokens, lse, topk_ids, topk_vals;
    int64_t n_prompt;
    int32_t *top_ids;     /* (topk) scratch for one row */
    float *top_vals;
    uint64_t *fp_hash;    /* fingerprint mode: (fp_cap) hashes and (fp_cap, 2) stats */
    float *fp_stats;      /* of the event being appended */
    int fp_cap;
    volatile sig_atomic_t *flag;
    int lock_fd;          /* open on path, holding the write lock; -1 none */
    dev_t dev;            /* the file the lock is on */
    ino_t ino;
    appender **cached;    /* (capacity: every appender) those with cached set */
    int ncached;
    appender **dirty;     /* (same capacity) those with dirty set */
    int ndirty;
    size_t cached_bytes;  /* bytes written to them since */
    size_t unflushed;     /* bytes appended since the last file flush */
    int64_t batch_pos0;   /* first position of the forward batch being emitted */
    bool failed;          /* err holds the first error; the observer now says stop */
    bool io_failed;       /* an HDF5 call failed: the file is not reopened */
    kv_err err;
};

static void abandon_file(const dump_writer *w);

/* ------------------------------------------------------------------ */
/* Errors                                                               */

/* "<path>: <what>: <HDF5 detail>" into e. Call right after the failing
 * HDF5 call: the next API call clears the error stack. */
static int h5err(const dump_writer *w, kv_err *e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int h5err(const dump_writer *w, kv_err *e, const char *fmt, ...)
{
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return dump_h5_fail(e, w->path, what);
}

/* Records the first run-time error; the observer then asks to stop. */
static int fail(dump_writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(dump_writer *w, const char *fmt, ...)
{
    if (!w->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->err.msg, sizeof w->err.msg, fmt, ap);
        va_end(ap);
        kv_err_words(&w->err);
        w->failed = true;
    }
    return -1;
}

/* A run-time HDF5 failure: recorded, and the file is left alone after. */
static int fail_h5(dump_writer *w, const char *what, const char *object)
{
    kv_err e;
    char msg[700];
    snprintf(msg, sizeof msg, "%s %s", what, object);
    h5err(w, &e, "%s", msg);
    w->io_failed = true;
    return fail(w, "%s", e.msg);
}

/* ------------------------------------------------------------------ */
/* Attributes and objects                                               */

static int write_attr(hid_t obj, const char *name, hid_t ftype, hid_t mtype, const void *value)
{
    hid_t s = H5Screate(H5S_SCALAR), a = H5I_INVALID_HID;
    int rc = s >= 0 && (a = H5Acreate2(obj, name, ftype, s, H5P_DEFAULT, H5P_DEFAULT)) >= 0 &&
                     H5Awrite(a, mtype, value) >= 0 ? 0 : -1;
    dump_h5_close(a);
    dump_h5_close(s);
    return rc;
}

static int write_str_attr(hid_t obj, const char *name, const char *value)
{
    hid_t t = dump_h5_vlstr();
    if (t < 0)
        return -1;
    int rc = write_attr(obj, name, t, t, &value);
    dump_h5_close(t);
    return rc;
}

static int write_i64_attr(hid_t obj, const char *name, int64_t v)
{
    return write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

/* Group without timestamps, so identical runs give identical bytes. */
static hid_t make_group(hid_t parent, const char *name)
{
    hid_t gcpl = H5Pcreate(H5P_GROUP_CREATE), g = H5I_INVALID_HID;
    if (gcpl >= 0 && H5Pset_obj_track_times(gcpl, 0) >= 0)
        g = H5Gcreate2(parent, name, H5P_DEFAULT, gcpl, H5P_DEFAULT);
    dump_h5_close(gcpl);
    return g;
}

static void app_init(appender *a)
{
    memset(a, 0, sizeof *a);
    a->dset = H5I_INVALID_HID;
}

/* Chunks of (block_rows, cols), no timestamps, fill value 0 so a partly
 * written chunk holds defined bytes; shuffle + deflate(4) when asked. */
static hid_t make_dcpl(const dump_writer *w, int rank, const hsize_t *chunk, hid_t mtype)
{
    static const unsigned char zero[16];
    hid_t p = H5Pcreate(H5P_DATASET_CREATE);
    if (p < 0)
        return H5I_INVALID_HID;
    if (H5Pset_chunk(p, rank, chunk) < 0 || H5Pset_obj_track_times(p, 0) < 0 ||
        H5Pset_fill_value(p, mtype, zero) < 0 || H5Pset_fill_time(p, H5D_FILL_TIME_ALLOC) < 0 ||
        (w->o.compress && (H5Pset_shuffle(p) < 0 || H5Pset_deflate(p, 4) < 0))) {
        dump_h5_close(p);
        return H5I_INVALID_HID;
    }
    return p;
}

/* Uncompressed datasets get no chunk cache: rows written through a
 * selection (each decode step's, a short block's) then go straight to
 * their place in the file, a row's bytes, not a whole chunk rewritten at
 * every flush. Compressed chunks must pass through the cache. */
static hid_t make_dapl(const dump_writer *w)
{
    hid_t p = H5Pcreate(H5P_DATASET_ACCESS);
    if (p >= 0 && !w->o.compress && H5Pset_chunk_cache(p, 0, 0, 1.0) < 0) {
        dump_h5_close(p);
        return H5I_INVALID_HID;
    }
    return p;
}

/* Creates an empty extendible dataset group/name of `cols` columns (0:
 * 1-D) with its first_position attribute. */
static int app_create(dump_writer *w, appender *a, hid_t group, const char *gpath,
                      const char *name, hid_t ftype, hid_t mtype, int cols, int64_t first,
                      kv_err *e)
{
    const int rank = cols > 0 ? 2 : 1;
    hsize_t dims[2] = {0, (hsize_t)cols}, maxd[2] = {H5S_UNLIMITED, (hsize_t)cols};
    hsize_t chunk[2] = {(hsize_t)w->o.block_rows, (hsize_t)cols};
    hid_t space = H5I_INVALID_HID, dcpl = H5I_INVALID_HID, dapl = H5I_INVALID_HID;
    a->mtype = mtype;
    a->cols = cols;
    a->row_bytes = H5Tget_size(mtype) * (size_t)(cols > 0 ? cols : 1);
    a->first = first;
    size_t n = strlen(gpath) + strlen(name) + 2;
    if (!(a->name = malloc(n)))
        return kv_errf(e, "%s: out of memory", w->path);
    snprintf(a->name, n, "%s/%s", gpath, name);
    int rc = (space = H5Screate_simple(rank, dims, maxd)) >= 0 &&
                     (dcpl = make_dcpl(w, rank, chunk, mtype)) >= 0 &&
                     (dapl = make_dapl(w)) >= 0 &&
                     (a->dset = H5Dcreate2(group, name, ftype, space, H5P_DEFAULT, dcpl,
                                           dapl)) >= 0 &&
                     write_i64_attr(a->dset, "first_position", first) >= 0 ? 0 : -1;
    dump_h5_close(dapl);
    dump_h5_close(dcpl);
    dump_h5_close(space);
    return rc < 0 ? h5err(w, e, "cannot create %s", a->name) : 0;
}

static void app_free(appender *a)
{
    dump_h5_close(a->dset);
    free(a->buf);
    free(a->name);
    app_init(a);
}

/* ------------------------------------------------------------------ */
/* Appending                                                            */

/* Writes one chunk (block_rows rows) at row0 straight to the file. */
static int write_chunk(dump_writer *w, appender *a, int64_t row0, const unsigned char *chunk)
{
    const size_t chunk_bytes = (size_t)w->o.block_rows * a->row_bytes;
    hsize_t offset[2] = {(hsize_t)row0, 0};
    if (H5Dwrite_chunk(a->dset, H5P_DEFAULT, 0, offset, chunk_bytes, chunk) >= 0)
        return 0;
    /* HDF5 allocated the chunk's space but could not write it: it would
     * try to fill that space when closing, which fails on the descriptor
     * abandon_file leaves it. Written again there, the chunk vanishes and
     * the close works (as it does for a cached chunk whose write failed).
     * The message is the first failure's. */
    fail_h5(w, "cannot append to", a->name);
    abandon_file(w);
    H5E_BEGIN_TRY
    {
        H5Dwrite_chunk(a->dset, H5P_DEFAULT, 0, offset, chunk_bytes, chunk);
    }
    H5E_END_TRY
    return -1;
}

/* Whole blocks starting on a block boundary of an uncompressed dataset go
 * to the file as chunks, straight from src: no selection, no copy into the
 * chunk cache, no fill of a chunk about to be overwritten, and the data is
 * in the file when the call returns. */
static int write_chunks(dump_writer *w, appender *a, const unsigned char *src, int n)
{
    const int block = w->o.block_rows;
    for (int r = 0; r < n; r += block)
        if (write_chunk(w, a, a->written + r, src + (size_t)r * a->row_bytes) < 0)
            return -1;
    return 0;
}

/* Rows anywhere (tokens, a last short block, compressed data): through a
 * selection and HDF5's chunk cache; flush_cached writes them out. */
static int write_selection(appender *a, int64_t row0, const void *src, int n)
{
    const int rank = a->cols > 0 ? 2 : 1;
    hsize_t start[2] = {(hsize_t)row0, 0}, count[2] = {(hsize_t)n, (hsize_t)a->cols};
    hid_t fspace = H5I_INVALID_HID, mspace = H5I_INVALID_HID;
    int rc = (fspace = H5Dget_space(a->dset)) >= 0 &&
                     H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL) >= 0 &&
                     (mspace = H5Screate_simple(rank, count, NULL)) >= 0 &&
                     H5Dwrite(a->dset, a->mtype, mspace, fspace, H5P_DEFAULT, src) >= 0 ? 0 : -1;
    dump_h5_close(mspace);
    dump_h5_close(fspace);
    return rc;
}

/* Appends rows [written, written + n) from src (n x row_bytes). padded:
 * src holds whole blocks, zeros after the n rows. */
static int app_write_rows(dump_writer *w, appender *a, const void *src, int n, bool padded)
{
    if (n == 0)
        return 0;
    if (w->io_failed)
        return -1;
    const int block = w->o.block_rows;
    hsize_t extent[2] = {(hsize_t)(a->written + n), (hsize_t)a->cols};
    bool whole = !w->o.compress && a->written % block == 0 && (n % block == 0 || padded);
    if (H5Dset_extent(a->dset, extent) < 0)
        return fail_h5(w, "cannot append to", a->name);
    if (whole && write_chunks(w, a, src, n) < 0)
        return -1;
    if (!whole && write_selection(a, a->written, src, n) < 0)
        return fail_h5(w, "cannot append to", a->name);
    a->written += n;
    w->unflushed += (size_t)n * a->row_bytes;
    if (!whole)
        w->cached_bytes += (size_t)n * a->row_bytes;
    if (!whole && !a->cached) {
        a->cached = true;
        w->cached[w->ncached++] = a;
    }
    return 0;
}

/* Before any flush: disk space is reserved up to HDF5's end of allocation
 * plus what the flush may still allocate (the cached bytes, and RESERVE
 * for metadata), so a full disk or a file size limit is found here, not by
 * a write of metadata inside the flush, after which libhdf5 1.10.8 can no
 * longer close the file. The space beyond what HDF5 uses is cut off when
 * dump_close reopens the file. File systems that cannot reserve space are
 * flushed regardless. */
static int reserve_space(dump_writer *w, size_t pending)
{
    haddr_t eoa = 0;
    int *fd = NULL;
    struct stat sb;
    if (H5Fget_eoa(w->file, &eoa) < 0 || H5Fget_vfd_handle(w->file, H5P_DEFAULT, (void **)&fd) < 0 ||
        !fd || fstat(*fd, &sb) < 0)
        return fail_h5(w, "cannot flush", "the appended rows");
    off_t want = (off_t)(eoa + pending + RESERVE);
    if (sb.st_size >= want - (off_t)RESERVE / 2)
        return 0;
    int err = posix_fallocate(*fd, sb.st_size, want - sb.st_size);
    if (err == ENOSPC || err == EFBIG || err == EDQUOT || err == EIO) {
        w->io_failed = true;
        return fail(w, "%s: cannot append to the file: %s", w->path, strerror(err));
    }
    return 0;
}

/* Flushes the datasets written through the chunk cache: their chunks, then
 * their metadata. */
static int flush_cached(dump_writer *w)
{
    if (w->ncached > 0 && reserve_space(w, w->cached_bytes) < 0) {
        w->ncached = 0;
        return -1;
    }
    w->cached_bytes = 0;
    for (int i = 0; i < w->ncached; i++) {
        appender *a = w->cached[i];
        a->cached = false;
        if (H5Dflush(a->dset) < 0) {
            w->ncached = 0;
            return fail_h5(w, "cannot append to", a->name);
        }
    }
    w->ncached = 0;
    return 0;
}

/* Tokens go out, flushed on their own, before any block of rows, so a
 * file cut short never holds a row whose token it lacks. */
static int tokens_out(dump_writer *w)
{
    appender *t = &w->tokens;
    if (t->nbuf == 0)
        return 0;
    if (app_write_rows(w, t, t->buf, t->nbuf, false) < 0)
        return -1;
    t->nbuf = 0;
    return flush_cached(w);
}

/* Writes n rows of a (tokens first), from the block buffer or straight
 * from the caller's rows. */
static int app_write(dump_writer *w, appender *a, const void *src, int n, bool padded)
{
    if (n > 0 && a != &w->tokens && tokens_out(w) < 0)
        return -1;
    return app_write_rows(w, a, src, n, padded);
}

static int write_tail(dump_writer *w, appender *a);

/* Writes the buffered rows: a whole block, or a short one when the run
 * ends. A short block of an uncompressed dataset (not /tokens, written at
 * any row) goes out as a whole chunk too, zero-padded: the bytes a fill
 * value of 0 gives, without a cached chunk left to flush. When the first
 * rows of an uncompressed block are in the file already (step_out), its
 * chunk is too: only the rest go out, not the whole chunk again. */
static int app_write_buffered(dump_writer *w, appender *a)
{
    if (a->nbuf == 0)
        return 0;
    if (a->pending > 0 && !w->o.compress) {
        if (tokens_out(w) < 0 || write_tail(w, a) < 0)
            return -1;
        a->written += a->nbuf;
        a->nbuf = 0;
        a->pending = 0;
        return 0;
    }
    const int block = w->o.block_rows, n = a->nbuf;
    bool padded = n < block && a != &w->tokens;
    if (padded)
        memset(a->buf + (size_t)n * a->row_bytes, 0, (size_t)(block - n) * a->row_bytes);
    if (app_write(w, a, a->buf, n, padded) < 0)
        return -1;
    a->nbuf = 0;
    a->pending = 0;
    return 0;
}

/* Buffered rows wait for their block to fill (64 decode steps, by
 * default); a crash must not lose them. So at the end of each forward
 * batch the rows the file lacks are written where they belong, the
 * dataset extended over them, and kept in the buffer: once the block is
 * full the rest follow (app_write_buffered; a compressed block goes out
 * whole again). */
static void mark_dirty(dump_writer *w, appender *a)
{
    if (a->nbuf > a->pending && !a->dirty) {
        a->dirty = true;
        w->dirty[w->ndirty++] = a;
    }
}

/* Rows [pending, nbuf) of the buffer to their place in the file, the
 * dataset extended over them. No flush per dataset here: that walks
 * libhdf5's whole metadata cache each time; the file flush that ends the
 * batch (settle) writes them. */
static int write_tail(dump_writer *w, appender *a)
{
    const int n = a->nbuf - a->pending;
    if (n <= 0)
        return 0;
    if (w->io_failed)
        return -1;
    hsize_t extent[2] = {(hsize_t)(a->written + a->nbuf), (hsize_t)a->cols};
    if (H5Dset_extent(a->dset, extent) < 0 ||
        write_selection(a, a->written + a->pending, a->buf + (size_t)a->pending * a->row_bytes,
                        n) < 0)
        return fail_h5(w, "cannot append to", a->name);
    a->pending = a->nbuf;
    w->unflushed += (size_t)n * a->row_bytes;
    return 0;
}

static int app_write_pending(dump_writer *w, appender *a)
{
    a->dirty = false;
    return write_tail(w, a);
}

/* Every row emitted so far into the file: tokens first (tokens_out
 * empties their buffer, so they are never pending), then the rest, with
 * disk space reserved first for what they may allocate (a whole chunk
 * for a block's first rows: reserve_space says why). */
static int step_out(dump_writer *w)
{
    int rc = w->ndirty > 0 ? tokens_out(w) : 0;
    size_t need = 0;
    for (int i = 0; i < w->ndirty && rc == 0; i++) {
        const appender *a = w->dirty[i];
        if (a->nbuf > a->pending)
            need += a->pending > 0 ? (size_t)(a->nbuf - a->pending) * a->row_bytes
                                   : (size_t)w->o.block_rows * a->row_bytes;
    }
    if (rc == 0 && need > 0)
        rc = reserve_space(w, need);
    for (int i = 0; i < w->ndirty; i++)
        if (rc == 0)
            rc = app_write_pending(w, w->dirty[i]);
        else
            w->dirty[i]->dirty = false;
    w->ndirty = 0;
    return rc;
}

/* Called at the end of every observer call. Rows written through the
 * chunk cache are flushed at once; the file as a whole (the metadata
 * saying which rows exist) at the end of each forward batch (step_end: a
 * token, logits, or the first event of the next batch came), rows still
 * buffered included, and within a batch every FLUSH_BYTES appended. So
 * every row of a batch is on disk when the next one starts, at one file
 * flush per batch: each flush walks HDF5's whole metadata cache, and a
 * flush per dataset per block of 64 rows was most of what fingerprint
 * recording cost. */
static int settle(dump_writer *w, bool step_end)
{
    if (w->io_failed)
        return -1;
    if (step_end && step_out(w) < 0)
        return -1;
    if (flush_cached(w) < 0)
        return -1;
    if (w->unflushed == 0 || (!step_end && w->unflushed < FLUSH_BYTES))
        return 0;
    if (reserve_space(w, 0) < 0)
        return -1;
    if (H5Fflush(w->file, H5F_SCOPE_LOCAL) < 0)
        return fail_h5(w, "cannot flush", "the appended rows");
    w->unflushed = 0;
    return 0;
}

/* Appends n rows (n x row_bytes) for positions pos.. (consecutive; the
 * first must be the next one due). Rows completing the buffered block are
 * copied to it; whole blocks after that go to the file straight from the
 * caller's memory in one write; the rest waits in the buffer. Blocks land
 * on the same row boundaries whatever the events' sizes. */
static int app_append(dump_writer *w, appender *a, int64_t pos, const void *rows, int n)
{
    int64_t next = a->first + a->written + a->nbuf;
    if (pos != next)
        return fail(w, "%s: %s: the row for position %lld came when position %lld was due "
                       "(rows must arrive in order, without gaps or repeats)",
                    w->path, a->name, (long long)pos, (long long)next);
    if (!a->buf && !(a->buf = malloc((size_t)w->o.block_rows * a->row_bytes)))
        return fail(w, "%s: out of memory for a block of %s", w->path, a->name);
    const int block = w->o.block_rows;
    const unsigned char *src = rows;
    if (a->nbuf > 0) {
        int take = n < block - a->nbuf ? n : block - a->nbuf;
        memcpy(a->buf + (size_t)a->nbuf * a->row_bytes, src, (size_t)take * a->row_bytes);
        a->nbuf += take;
        src += (size_t)take * a->row_bytes;
        n -= take;
        if (a->nbuf < block) {
            mark_dirty(w, a);
            return 0;  /* all taken, the block still open */
        }
        if (app_write_buffered(w, a) < 0)
            return -1;
    }
    int whole = n / block * block;
    if (app_write(w, a, src, whole, false) < 0)
        return -1;
    src += (size_t)whole * a->row_bytes;
    n -= whole;
    memcpy(a->buf, src, (size_t)n * a->row_bytes);
    a->nbuf = n;
    a->pending = 0;
    mark_dirty(w, a);
    return 0;
}

/* L2 norm and max |x| of one row. Eight double partial sums, lane k
 * taking elements k, k+8, k+16, ..., added pairwise at the end in a fixed
 * order: the same bits every run, and a loop the compiler turns into
 * vector code; on x86-64 an AVX2 copy is also built and picked at load
 * time (same operations in the same order, so the same bits: contraction
 * into FMA is off). Squares of floats are exact in double. NaN never wins
 * the max (the comparison is false) and makes the sum NaN. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define ROW_STATS_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef ROW_STATS_CLONES
#define ROW_STATS_CLONES
#endif
ROW_STATS_CLONES
static void row_stats(const float *x, int n, float out[2])
{
    double ss[8] = {0};
    float mx[8] = {0};
    int j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) {
            double d = (double)x[j + k];
            float a = fabsf(x[j + k]);
            ss[k] += d * d;
            mx[k] = a > mx[k] ? a : mx[k];
        }
    for (int k = 0; k < n - j; k++) {
        double d = (double)x[j + k];
        float a = fabsf(x[j + k]);
        ss[k] += d * d;
        mx[k] = a > mx[k] ? a : mx[k];
    }
    double sum = ((ss[0] + ss[4]) + (ss[2] + ss[6])) + ((ss[1] + ss[5]) + (ss[3] + ss[7]));
    float m = 0;
    for (int k = 0; k < 8; k++)
        m = mx[k] > m ? mx[k] : m;
    out[0] = (float)sqrt(sum);
    out[1] = m;
}

/* Fingerprints of an event's rows, split across the pool's threads: each
 * task owns a range of rows, so the values are those of one thread. */
typedef struct {
    dump_writer *w;
    const float *rows;
    int cols, n, tasks;
} fp_job;

static void fp_task(void *ctx, int task)
{
    const fp_job *j = ctx;
    const int lo = (int)((int64_t)j->n * task / j->tasks);
    const int hi = (int)((int64_t)j->n * (task + 1) / j->tasks);
    for (int r = lo; r < hi; r++) {
        const float *row = j->rows + (size_t)r * j->cols;
        j->w->fp_hash[r] = XXH3_64bits(row, (size_t)j->cols * sizeof(float));
        row_stats(row, j->cols, j->w->fp_stats + 2 * r);
    }
}

/* Full mode: the rows, and with row hashes their fingerprints beside them.
 * Fingerprint mode: the fingerprints alone. A fingerprint is per row the
 * XXH3-64 of its bytes (little-endian floats: every host we build for) and
 * (L2 norm, max |x|), computed for the whole event, then appended. */
static int sink_append(dump_writer *w, stage_sink *s, int64_t pos, const float *rows, int n)
{
    if (!w->o.fingerprint && !w->o.row_hashes)
        return app_append(w, &s->rows, pos, rows, n);
    if (n > w->fp_cap) {
        uint64_t *h = realloc(w->fp_hash, (size_t)n * sizeof *h);
        if (h)
            w->fp_hash = h;
        float *st = realloc(w->fp_stats, (size_t)n * 2 * sizeof *st);
        if (st)
            w->fp_stats = st;
        if (!h || !st)
            return fail(w, "%s: out of memory for the fingerprints of %s", w->path, s->rows.name);
        w->fp_cap = n;
    }
    fp_job job = {w, rows, s->cols, n, 1};
    /* Small events are not worth waking a thread for. */
    if (w->o.pool && (int64_t)n * s->cols >= 2048)
        job.tasks = pool_threads(w->o.pool) < n ? pool_threads(w->o.pool) : n;
    if (job.tasks > 1)
        pool_run(w->o.pool, fp_task, &job, job.tasks);
    else
        fp_task(&job, 0);
    if (s->digest) {
        XXH3_128bits_update(s->digest, w->fp_hash, (size_t)n * sizeof *w->fp_hash);
        for (int r = 0; r < n; r++) {
            const double l2 = w->fp_stats[2 * r];
            s->finite &= isfinite(w->fp_stats[2 * r]) && isfinite(w->fp_stats[2 * r + 1]);
            s->sum_sq += l2 * l2;
        }
    }
    if (!w->o.fingerprint && app_append(w, &s->rows, pos, rows, n) < 0)
        return -1;
    if (app_append(w, w->o.fingerprint ? &s->rows : &s->hash, pos, w->fp_hash, n) < 0)
        return -1;
    return app_append(w, &s->stats, pos, w->fp_stats, n);
}

/* ------------------------------------------------------------------ */
/* /output: log-sum-exp and top-k of each logits row                    */

/* Natural log-sum-exp, terms summed in double in index order (the same
 * bits every run); NaN in, NaN out; all -inf gives -inf. Each term is a
 * float expf: exact enough for a float32 result, and a vocabulary-wide
 * exp() in double per row was most of what /output cost. */
static float row_lse(const float *x, int n)
{
    float m = -INFINITY;
    double s = 0;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i]))
            return NAN;
        if (x[i] > m)
            m = x[i];
    }
    if (isinf(m))
        return m;
    /* Terms below e^-104 are 0 in float: skipping them skips expf's slow
     * underflow path, which a wide vocabulary hits for most entries. */
    for (int i = 0; i < n; i++)
        if (x[i] - m > -104.0f)
            s += (double)expf(x[i] - m);
    return (float)((double)m + log(s));
}

/* Orders values for top-k: larger first, NaN after every number. */
static bool ranks_above(float x, float y)
{
    return x > y || (isnan(y) && !isnan(x));
}

/* The k largest of x (descending; on ties the lower id first). */
static void row_topk(const float *x, int n, int k, int32_t *ids, float *vals)
{
    int have = 0;
    for (int i = 0; i < n; i++) {
        if (have == k && !ranks_above(x[i], vals[k - 1]))
            continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && ranks_above(x[i], vals[j - 1])) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = x[i];
        ids[j] = i;
    }
}

static bool position_recorded(const dump_writer *w, int64_t p)
{
    return p >= w->o.pos_lo && p <= w->o.pos_hi;
}

static int on_logits(dump_writer *w, const kv_event *ev)
{
    const int V = w->cfg.vocab, K = w->o.topk;
    stage_sink *s = w->sinks[STAGE_LOGITS][0];
    if (ev->layer != -1 || ev->ncols != V)
        return fail(w, "%s: logits event of layer %d with %d columns (expected layer -1, vocab %d)",
                    w->path, ev->layer, ev->ncols, V);
    for (int r = 0; r < ev->nrows; r++) {
        const int64_t p = ev->pos0 + r;
        const float *row = ev->data + (size_t)r * V;
        /* Rows before /output's first position come when another sink
         * sharing the engine asked for every row's logits. */
        if (!position_recorded(w, p) || p < w->out_first)
            continue;
        float lse = row_lse(row, V);
        row_topk(row, V, K, w->top_ids, w->top_vals);
        if (app_append(w, &w->lse, p, &lse, 1) < 0 ||
            app_append(w, &w->topk_ids, p, w->top_ids, 1) < 0 ||
            app_append(w, &w->topk_vals, p, w->top_vals, 1) < 0 ||
            (s && sink_append(w, s, p, row, 1) < 0))
            return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* The observer                                                         */

static bool must_stop(const dump_writer *w)
{
    return w->failed || (w->flag && *w->flag);
}

/* The rows of one event that the selection keeps, appended in one go.
 * A row past the run's positions is an error; the rows before it stay. */
static int on_rows(dump_writer *w, const kv_event *ev)
{
    if (ev->stage < 0 || ev->stage >= STAGE_COUNT || ev->layer < -1 || ev->layer >= KV_MAX_LAYERS)
        return 0;
    /* A new forward batch: the last one's rows go to disk first. */
    if (ev->pos0 != w->batch_pos0) {
        w->batch_pos0 = ev->pos0;
        if (settle(w, true) < 0)
            return -1;
    }
    stage_sink *s = w->sinks[ev->stage][ev->layer + 1];
    if (!s || ev->nrows <= 0)
        return 0;
    if (ev->ncols != s->cols)
        return fail(w, "%s: %s: the engine emitted %d columns, the model config says %d", w->path,
                    s->rows.name, ev->ncols, s->cols);
    const int64_t end = ev->pos0 + ev->nrows;  /* one past the event's last position */
    int64_t past = w->max_positions > 0 && end > w->max_positions ? w->max_positions : end;
    if (past < ev->pos0)
        past = ev->pos0;
    int64_t lo = ev->pos0 > w->o.pos_lo ? ev->pos0 : w->o.pos_lo;
    int64_t hi = past - 1 < w->o.pos_hi ? past - 1 : w->o.pos_hi;
    if (lo <= hi && sink_append(w, s, lo, ev->data + (size_t)(lo - ev->pos0) * s->cols,
                                (int)(hi - lo + 1)) < 0)
        return -1;
    if (past < end)
        return fail(w, "%s: %s: position %lld is past the run's %d positions", w->path,
                    s->rows.name, (long long)past, w->max_positions);
    return 0;
}

static int writer_emit(kv_observer *self, const kv_event *ev)
{
    dump_writer *w = (dump_writer *)self;
    if (must_stop(w))
        return 1;
    bool logits = ev->stage == STAGE_LOGITS;
    int rc = logits ? on_logits(w, ev) : on_rows(w, ev);
    if (settle(w, logits || rc < 0) < 0)
        rc = -1;
    return rc < 0;
}

static int writer_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    dump_writer *w = (dump_writer *)self;
    if (must_stop(w))
        return 1;
    int rc = app_append(w, &w->tokens, pos, &id, 1);
    if (settle(w, true) < 0)
        rc = -1;
    if (rc < 0)
        return 1;
    if (is_prompt)
        w->n_prompt++;
    return 0;
}

/* Logits always: /output is computed from them, and engines compute the
 * logits of every row only when someone wants them. */
static int writer_wants(kv_observer *self, kv_stage st, int layer)
{
    dump_writer *w = (dump_writer *)self;
    if (st == STAGE_LOGITS)
        return 1;
    if (st < 0 || st >= STAGE_COUNT || layer < -1 || layer >= KV_MAX_LAYERS)
        return 0;
    return w->sinks[st][layer + 1] != NULL;
}

/* ------------------------------------------------------------------ */
/* Creation                                                             */

/* model_config in the order of docs/dump-format.md. */
static char *config_json(const kv_config *c)
{
    json_t *o = json_object(), *types = json_array(), *owners = json_array();
    char *text = NULL;
    if (!o || !types || !owners)
        goto done;
    json_object_set_new(o, "model_type", json_string(c->model_type));
    json_object_set_new(o, "hidden_size", json_integer(c->hidden));
    json_object_set_new(o, "num_hidden_layers", json_integer(c->n_layers));
    json_object_set_new(o, "num_attention_heads", json_integer(c->n_heads));
    json_object_set_new(o, "num_key_value_heads", json_integer(c->n_kv_heads));
    json_object_set_new(o, "head_dim", json_integer(c->head_dim));
    json_object_set_new(o, "intermediate_size", json_integer(c->intermediate));
    json_object_set_new(o, "vocab_size", json_integer(c->vocab));
    json_object_set_new(o, "sliding_window", json_integer(c->sliding_window));
    for (int l = 0; l < c->n_layers; l++) {
        json_array_append_new(types, json_string(c->layer_type[l] == ATTN_SLIDING
                                                     ? "sliding_attention" : "full_attention"));
        json_array_append_new(owners, json_integer(c->kv_owner[l]));
    }
    json_object_set(o, "layer_types", types);
    json_object_set(o, "kv_owner", owners);
    json_object_set_new(o, "rms_norm_eps", json_real(c->rms_eps));
    json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
    json_object_set_new(o, "rope_local_base_freq", json_real(c->rope_local_theta));
    json_object_set_new(o, "attn_scale", json_real(c->attn_scale));
    /* RoPE scaling of the global layers, as config.json writes it; absent
     * when there is none. The comparer's RoPE checks need it. */
    const kv_rope_scaling *rs = &c->rope_scaling;
    if (rs->type != ROPE_SCALE_NONE) {
        json_t *s = json_object();
        if (s) {
            bool l3 = rs->type == ROPE_SCALE_LLAMA3;
            json_object_set_new(s, "rope_type", json_string(l3 ? "llama3"
                                : rs->type == ROPE_SCALE_YARN ? "yarn" : "linear"));
            json_object_set_new(s, "factor", json_real(rs->factor));
            if (rs->type == ROPE_SCALE_YARN) {
                json_object_set_new(s, "beta_fast", json_real(rs->beta_fast));
                json_object_set_new(s, "beta_slow", json_real(rs->beta_slow));
                json_object_set_new(s, "truncate", json_boolean(rs->truncate));
                json_object_set_new(s, "attention_factor", json_real(rs->attn_factor));
                json_object_set_new(s, "original_max_position_embeddings",
                                    json_integer(rs->original_max_position));
            }
            if (l3) {
                json_object_set_new(s, "low_freq_factor", json_real(rs->low_freq_factor));
                json_object_set_new(s, "high_freq_factor", json_real(rs->high_freq_factor));
                json_object_set_new(s, "original_max_position_embeddings",
                                    json_integer(rs->original_max_position));
            }
            json_object_set_new(o, "rope_scaling", s);
        }
    }
    if (c->arch == ARCH_GEMMA4) {
        /* Gemma 4: full layers' widths, K=V, partial RoPE, MLP widths and
         * per-layer inputs (docs/dump-format.md). */
        json_object_set_new(o, "global_head_dim", json_integer(c->head_dim_full));
        json_object_set_new(o, "num_global_key_value_heads", json_integer(c->n_kv_heads_full));
        json_object_set_new(o, "partial_rotary_factor_full",
                            json_real(c->rope_partial_full > 0 ? c->rope_partial_full : 1.0));
        json_object_set_new(o, "attention_k_eq_v", json_boolean(c->k_eq_v));
        json_object_set_new(o, "use_double_wide_mlp", json_boolean(c->double_wide_mlp));
        json_object_set_new(o, "hidden_size_per_layer_input", json_integer(c->per_layer_dim));
        json_object_set_new(o, "vocab_size_per_layer_input", json_integer(c->per_layer_vocab));
    }
    if (c->n_experts > 0) {
        json_object_set_new(o, "num_local_experts", json_integer(c->n_experts));
        json_object_set_new(o, "num_experts_per_tok", json_integer(c->n_experts_used));
        if (c->first_dense > 0 || c->moe_every > 1) {
            json_object_set_new(o, "first_k_dense_replace", json_integer(c->first_dense));
            json_object_set_new(o, "moe_layer_freq", json_integer(c->moe_every));
        }
        /* How router_logits choose (the comparer's routing flips): sigmoid
         * scores with a correction bias, within the best groups. */
        if (c->route == ROUTE_SIGMOID)
            json_object_set_new(o, "scoring_func", json_string("sigmoid"));
        if (c->n_group > 0) {
            json_object_set_new(o, "n_group", json_integer(c->n_group));
            json_object_set_new(o, "topk_group", json_integer(c->topk_group));
        }
    }
    if (config_mla(c)) {
        /* MLA: the cache row's widths and the values' (docs/dump-format.md). */
        json_object_set_new(o, "kv_lora_rank", json_integer(c->kv_lora_rank));
        json_object_set_new(o, "qk_rope_head_dim", json_integer(c->qk_rope_dim));
        json_object_set_new(o, "v_head_dim", json_integer(c->v_head_dim));
    }
    /* Gemma's final logit softcap: the comparer fits /output as a map of
     * the reference's logits, and must undo the cap the reference applied. */
    if (c->final_softcap > 0)
        json_object_set_new(o, "final_logit_softcapping", json_real(c->final_softcap));
    text = json_dumps(o, JSON_COMPACT);
done:
    json_decref(types);
    json_decref(owners);
    json_decref(o);
    return text;
}

static int root_attrs(dump_writer *w, const dump_meta *m, kv_err *e)
{
    char *config = config_json(&w->cfg);
    char fp[17] = "";
    if (!config)
        return kv_errf(e, "%s: out of memory for the model config", w->path);
    /* 0 stands for "unknown": an xxh3 of real weights is never 0 in practice. */
    if (m->weight_fingerprint)
        snprintf(fp, sizeof fp, "%016llx", (unsigned long long)m->weight_fingerprint);
    int64_t version = DUMP_VERSION, row_hashes = w->o.row_hashes ? 1 : 0;
    uint64_t seed = m->seed;
    int rc = -1;
    hid_t f = w->file;
    if (write_str_attr(f, "format", DUMP_FORMAT) >= 0 &&
        write_attr(f, "format_version", H5T_STD_I64LE, H5T_NATIVE_INT64, &version) >= 0 &&
        write_str_attr(f, "mode", w->o.fingerprint ? "fingerprint" : "full") >= 0 &&
        (w->o.fingerprint || write_attr(f, "row_hashes", H5T_STD_I64LE, H5T_NATIVE_INT64,
                                        &row_hashes) >= 0) &&
        write_str_attr(f, "engine", m->engine ? m->engine : "") >= 0 &&
        write_str_attr(f, "engine_settings", m->engine_settings ? m->engine_settings : "{}") >= 0 &&
        write_str_attr(f, "model_config", config) >= 0 &&
        write_str_attr(f, "weight_fingerprint", fp) >= 0 &&
        write_attr(f, "seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, &seed) >= 0 &&
        write_str_attr(f, "status", "partial: running") >= 0 &&
        write_str_attr(f, "tool_version", m->tool_version ? m->tool_version : "") >= 0)
        rc = 0;
    else
        h5err(w, e, "cannot write the root attributes");
    free(config);
    return rc;
}

static int tokens_create(dump_writer *w, kv_err *e)
{
    if (app_create(w, &w->tokens, w->file, "", "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, 0, 0,
                   e) < 0)
        return -1;
    /* Known up front when the caller says so, so a killed file has it. */
    if (write_i64_attr(w->tokens.dset, "prompt_length", w->meta_prompt) < 0)
        return h5err(w, e, "cannot write /tokens prompt_length");
    return 0;
}

/* What the columns of a stage's datasets mean, as a "columns" string
 * attribute on each (and "units" where there are any), so a person reading
 * a dump with h5dump or h5py needs no doc for the common questions. Optional for readers: dumps
 * written before these attributes lack them (docs/dump-format.md). */
static int describe_stage_datasets(const dump_writer *w, const stage_sink *s, kv_stage st,
                                   int layer)
{
    const kv_config *c = &w->cfg;
    const int D = config_layer_head_dim(c, layer), KV = config_layer_kv_heads(c, layer);
    char cols[96];
    const char *units = NULL;
    switch (st) {
    case STAGE_ATTN_NORM_STATS:
    case STAGE_FFN_NORM_STATS:
        snprintf(cols, sizeof cols, "mean,rms,absmax of the norm's input");
        break;
    case STAGE_Q:
    case STAGE_ATTN_OUT:
        snprintf(cols, sizeof cols, "%d heads x %d, head-major%s", c->n_heads,
                 st == STAGE_Q ? D : config_layer_v_head_dim(c, layer),
                 st == STAGE_Q ? "; after RoPE" : "");
        break;
    case STAGE_K:
    case STAGE_V:
        snprintf(cols, sizeof cols, "%d KV heads x %d, head-major%s", KV,
                 st == STAGE_K ? D : config_layer_v_head_dim(c, layer),
                 st == STAGE_K ? "; after RoPE" : "");
        break;
    case STAGE_KV_LATENT:
        snprintf(cols, sizeof cols, "normed latent x %d, then the rotated key tail x %d",
                 c->kv_lora_rank, c->qk_rope_dim);
        break;
    case STAGE_ATTN_LSE:
        snprintf(cols, sizeof cols, "one per head");
        units = "nats (natural log)";
        break;
    case STAGE_ATTN_NKEYS:
        snprintf(cols, sizeof cols, "one per head");
        units = "keys attended";
        break;
    case STAGE_ATTN_SINK:
        snprintf(cols, sizeof cols, "one per head");
        units = "share of the softmax (0..1)";
        break;
    case STAGE_ROUTER_LOGITS:
        snprintf(cols, sizeof cols, "one per expert");
        units = "logits (before top-k)";
        break;
    case STAGE_LOGITS:
        snprintf(cols, sizeof cols, "one per token id");
        break;
    case STAGE_PLE_IN:
        snprintf(cols, sizeof cols, "%d per-layer input dims", c->per_layer_dim);
        break;
    default:
        snprintf(cols, sizeof cols, "%d hidden dims", c->hidden);
        break;
    }
    /* Short texts: every dataset carries them, and a small model's dump is
     * mostly metadata. (Rows are positions from first_position on.) */
    hid_t full = w->o.fingerprint ? H5I_INVALID_HID : s->rows.dset;
    hid_t hash = w->o.fingerprint ? s->rows.dset : s->hash.dset;
    if (full >= 0 && (write_str_attr(full, "columns", cols) < 0 ||
                      (units && write_str_attr(full, "units", units) < 0)))
        return -1;
    if (hash >= 0 && write_str_attr(hash, "columns", "XXH3-64 of the row's float32 bytes") < 0)
        return -1;
    if (s->stats.dset >= 0 && write_str_attr(s->stats.dset, "columns", "l2,absmax") < 0)
        return -1;
    return 0;
}

static int sink_create(dump_writer *w, kv_stage st, int layer, hid_t group, const char *gpath,
                       kv_err *e)
{
    stage_sink *s = calloc(1, sizeof *s);
    char name[64];
    if (!s)
        return kv_errf(e, "%s: out of memory", w->path);
    w->sinks[st][layer + 1] = s;
    app_init(&s->rows);
    app_init(&s->stats);
    app_init(&s->hash);
    s->cols = dump_stage_cols(&w->cfg, st, layer);
    if (!w->o.fingerprint &&
        app_create(w, &s->rows, group, gpath, stage_name(st), H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                   s->cols, w->first, e) < 0)
        return -1;
    if (!w->o.fingerprint && !w->o.row_hashes)
        return describe_stage_datasets(w, s, st, layer) < 0
                   ? h5err(w, e, "cannot describe the datasets of %s/%s", gpath, stage_name(st))
                   : 0;
    if (!(s->digest = XXH3_createState()) || XXH3_128bits_reset(s->digest) != XXH_OK)
        return kv_errf(e, "%s: out of memory", w->path);
    s->finite = true;
    snprintf(name, sizeof name, "%s.hash", stage_name(st));
    if (app_create(w, w->o.fingerprint ? &s->rows : &s->hash, group, gpath, name, H5T_STD_U64LE,
                   H5T_NATIVE_UINT64, 0, w->first, e) < 0)
        return -1;
    snprintf(name, sizeof name, "%s.stats", stage_name(st));
    if (app_create(w, &s->stats, group, gpath, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 2,
                   w->first, e) < 0)
        return -1;
    if (describe_stage_datasets(w, s, st, layer) < 0)
        return h5err(w, e, "cannot describe the datasets of %s/%s", gpath, stage_name(st));
    return 0;
}

static int layer_attrs(dump_writer *w, hid_t g, int l, const char *gpath, kv_err *e)
{
    const kv_config *c = &w->cfg;
    double theta = config_layer_theta(c, l);
    if (write_str_attr(g, "attention", c->layer_type[l] == ATTN_SLIDING ? "sliding" : "global") < 0 ||
        write_i64_attr(g, "window", config_layer_window(c, l)) < 0 ||
        write_attr(g, "rope_theta", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &theta) < 0 ||
        write_i64_attr(g, "kv_owner", c->kv_owner[l]) < 0)
        return h5err(w, e, "cannot write the attributes of %s", gpath);
    return 0;
}

static int layer_create(dump_writer *w, hid_t layers, int l, kv_err *e)
{
    char name[16], gpath[32];
    snprintf(name, sizeof name, "%d", l);
    snprintf(gpath, sizeof gpath, "/layers/%d", l);
    hid_t g = make_group(layers, name);
    if (g < 0)
        return h5err(w, e, "cannot create %s", gpath);
    int rc = layer_attrs(w, g, l, gpath, e);
    for (int st = 0; st < STAGE_LAYER_COUNT && rc == 0; st++) {
        /* KV-shared followers compute no K/V of their own. */
        bool follower_kv = !config_layer_has_stage(&w->cfg, l, (kv_stage)st);
        if (w->o.stages[st] && !follower_kv)
            rc = sink_create(w, (kv_stage)st, l, g, gpath, e);
    }
    dump_h5_close(g);
    return rc;
}

static int layers_create(dump_writer *w, kv_err *e)
{
    hid_t g = make_group(w->file, "layers");
    if (g < 0)
        return h5err(w, e, "cannot create /layers");
    int hi = w->o.layer_hi < w->cfg.n_layers - 1 ? w->o.layer_hi : w->cfg.n_layers - 1;
    bool any = false;
    for (int st = 0; st < STAGE_LAYER_COUNT; st++)
        any = any || w->o.stages[st];
    int rc = 0;
    for (int l = w->o.layer_lo; any && l <= hi && rc == 0; l++)
        rc = layer_create(w, g, l, e);
    dump_h5_close(g);
    return rc;
}

static int model_create(dump_writer *w, kv_err *e)
{
    hid_t g = make_group(w->file, "model");
    if (g < 0)
        return h5err(w, e, "cannot create /model");
    int rc = 0;
    if (w->o.stages[STAGE_EMBED])
        rc = sink_create(w, STAGE_EMBED, -1, g, "/model", e);
    if (rc == 0 && w->o.stages[STAGE_FINAL_NORM])
        rc = sink_create(w, STAGE_FINAL_NORM, -1, g, "/model", e);
    if (rc == 0 && (w->o.full_logits || w->o.stages[STAGE_LOGITS]))
        rc = sink_create(w, STAGE_LOGITS, -1, g, "/model", e);
    dump_h5_close(g);
    return rc;
}

static int output_create(dump_writer *w, kv_err *e)
{
    hid_t g = make_group(w->file, "output");
    if (g < 0)
        return h5err(w, e, "cannot create /output");
    int rc = -1;
    if (write_i64_attr(g, "k", w->o.topk) < 0)
        h5err(w, e, "cannot write /output k");
    else if (app_create(w, &w->lse, g, "/output", "lse", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 0,
                        w->out_first, e) == 0 &&
             app_create(w, &w->topk_ids, g, "/output", "topk_ids", H5T_STD_I32LE,
                        H5T_NATIVE_INT32, w->o.topk, w->out_first, e) == 0 &&
             app_create(w, &w->topk_vals, g, "/output", "topk_values", H5T_IEEE_F32LE,
                        H5T_NATIVE_FLOAT, w->o.topk, w->out_first, e) == 0)
        rc = 0;
    dump_h5_close(g);
    return rc;
}

/* The lock: a write lock on the whole file, owned by the open file
 * description (F_OFD_SETLK), so that neither libhdf5 opening and closing
 * the file in this process nor its flock() releases or meets it; where
 * OFD locks do not exist, a process lock (released early if libhdf5
 * closes a descriptor of the file, still enough against a second run
 * starting). The path is opened without truncating: a file another run is
 * writing is left as it is. *created says whether the open made it. */
static int lock_target(dump_writer *w, bool *created, kv_err *e)
{
    *created = false;
    struct stat sb;
    /* O_EXCL: a new file, never through a link (outfile.h). */
    int fd = open(w->path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0)
        *created = true;
    else if (errno == EEXIST) {
        /* A link, a device, a FIFO, a socket or one of the run's inputs is
         * no place for a dump: refused before it is opened (opening a
         * device can act on it), and never truncated or removed. */
        if (outfile_check_target(w->path, e) < 0)
            return -1;
        fd = open(w->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0)
        return kv_errf(e, "%s: cannot create the dump: %s", w->path, strerror(errno));
    w->lock_fd = fd;
    if (fstat(fd, &sb) < 0)
        return kv_errf(e, "%s: cannot create the dump: %s", w->path, strerror(errno));
    w->dev = sb.st_dev;
    w->ino = sb.st_ino;
    if (!S_ISREG(sb.st_mode))   /* replaced between the stat and the open */
        return kv_errf(e, "%s: not a regular file (%s); a dump is written to a regular file or "
                          "a new path", w->path, outfile_kind(sb.st_mode));
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;   /* start 0, length 0: the whole file, however long */
#ifdef F_OFD_SETLK
    int rc = fcntl(fd, F_OFD_SETLK, &fl);
#else
    int rc = fcntl(fd, F_SETLK, &fl);
#endif
    if (rc == 0)
        return 0;
    if (errno == EAGAIN || errno == EACCES)
        return kv_errf(e, "%s: another kvdiff is writing this file; two runs cannot record "
                          "to one dump (choose another path, or wait for that run to end)",
                       w->path);
    if (errno == ENOLCK || errno == EINVAL || errno == EOPNOTSUPP)
        return 0;   /* a file system without locks: write unguarded, as before */
    return kv_errf(e, "%s: cannot lock the dump: %s", w->path, strerror(errno));
}

/* Is the path still the file this writer locked and wrote? Not when
 * something replaced or removed it meanwhile: its status is then not
 * ours to set. */
static bool still_ours(dump_writer *w)
{
    struct stat sb;
    if (w->lock_fd < 0)
        return true;
    if (stat(w->path, &sb) < 0) {
        fail(w, "%s: the dump was removed while this run wrote it", w->path);
        return false;
    }
    if (sb.st_dev != w->dev || sb.st_ino != w->ino) {
        fail(w, "%s: the dump was replaced by another file while this run wrote it; that file "
                "is left as it is", w->path);
        return false;
    }
    return true;
}

static int create_file(dump_writer *w, const dump_meta *m, kv_err *e)
{
    /* The root group takes its timestamp setting from the file creation
     * properties: off there too, or it records the second it was made. */
    /* No sieve buffer: a decode step's row written straight into its
     * chunk would otherwise cost a read and a write of the 64 KiB around
     * it, per dataset, per step. */
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), fcpl = H5Pcreate(H5P_FILE_CREATE);
    if (fapl >= 0 && fcpl >= 0 && H5Pset_obj_track_times(fcpl, 0) >= 0 &&
        H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST) >= 0 &&
        H5Pset_sieve_buf_size(fapl, 0) >= 0)
        w->file = H5Fcreate(w->path, H5F_ACC_TRUNC, fcpl, fapl);
    dump_h5_close(fcpl);
    dump_h5_close(fapl);
    if (w->file < 0)
        return h5err(w, e, "cannot create the dump");
    if (root_attrs(w, m, e) < 0 || tokens_create(w, e) < 0 || layers_create(w, e) < 0 ||
        model_create(w, e) < 0 || output_create(w, e) < 0)
        return -1;
    /* From here on only raw data changes: what SWMR allows. */
    if (H5Fstart_swmr_write(w->file) < 0)
        return h5err(w, e, "cannot switch to SWMR mode");
    return 0;
}

/* ------------------------------------------------------------------ */
/* Arguments                                                            */

static int check_settings(const char *path, const char *text, kv_err *e)
{
    json_error_t jerr;
    json_t *j = json_loads(text, 0, &jerr);
    bool ok = json_is_object(j);
    json_decref(j);
    if (ok)
        return 0;
    if (!j)
        return kv_errf(e, "%s: engine_settings is not valid JSON (%s)", path, jerr.text);
    return kv_errf(e, "%s: engine_settings must be a JSON object", path);
}

static int check_args(const char *path, const dump_meta *m, const dump_opts *o, kv_err *e)
{
    if (!path || !*path)
        return kv_errf(e, "dump: no file name");
    if (!m || !m->cfg || !o)
        return kv_errf(e, "%s: no model config or options given", path);
    if (config_validate(m->cfg, e) < 0)
        return kv_err_prefix(e, path);
    const kv_config *c = m->cfg;
    if (m->engine_settings && check_settings(path, m->engine_settings, e) < 0)
        return -1;
    if (o->block_rows < 1 || o->block_rows > MAX_BLOCK_ROWS)
        return kv_errf(e, "%s: block_rows %d is outside 1..%d", path, o->block_rows, MAX_BLOCK_ROWS);
    if (o->topk < 1 || o->topk > c->vocab)
        return kv_errf(e, "%s: top-k %d is outside 1..%d (the vocabulary)", path, o->topk, c->vocab);
    int widest = c->vocab > config_max_q_width(c) ? c->vocab : config_max_q_width(c);
    if ((size_t)o->block_rows * (size_t)widest * sizeof(float) > MAX_CHUNK_BYTES)
        return kv_errf(e, "%s: blocks of %d rows of %d floats exceed HDF5's chunk size limit",
                       path, o->block_rows, widest);
    if (o->layer_lo < 0 || o->layer_hi < o->layer_lo)
        return kv_errf(e, "%s: layer range %d..%d is empty or negative", path, o->layer_lo,
                       o->layer_hi);
    if (o->layer_lo >= c->n_layers)
        return kv_errf(e, "%s: layers from %d selected, but the model has %d (0..%d)", path,
                       o->layer_lo, c->n_layers, c->n_layers - 1);
    if (o->pos_lo < 0 || o->pos_hi < o->pos_lo)
        return kv_errf(e, "%s: position range %lld..%lld is empty or negative", path,
                       (long long)o->pos_lo, (long long)o->pos_hi);
    if (m->max_positions > 0 && o->pos_lo >= m->max_positions)
        return kv_errf(e, "%s: positions from %lld selected, but the run reaches %d", path,
                       (long long)o->pos_lo, m->max_positions);
    return 0;
}

size_t dump_position_bytes(const kv_config *c, const dump_opts *o)
{
    size_t floats = 0;
    const int hi = o->layer_hi < c->n_layers - 1 ? o->layer_hi : c->n_layers - 1;
    for (int l = o->layer_lo < 0 ? 0 : o->layer_lo; l <= hi; l++)
        for (int st = 0; st < STAGE_LAYER_COUNT; st++) {
            bool follower_kv = !config_layer_has_stage(c, l, (kv_stage)st);
            if (o->stages[st] && !follower_kv)
                floats += (size_t)dump_stage_cols(c, (kv_stage)st, l);
        }
    if (o->stages[STAGE_EMBED])
        floats += (size_t)dump_stage_cols(c, STAGE_EMBED, -1);
    if (o->stages[STAGE_FINAL_NORM])
        floats += (size_t)dump_stage_cols(c, STAGE_FINAL_NORM, -1);
    if (o->full_logits || o->stages[STAGE_LOGITS])
        floats += (size_t)c->vocab;
    return floats * sizeof(float);
}

/* ------------------------------------------------------------------ */
/* Lifetime                                                             */

static void writer_free(dump_writer *w)
{
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = 0; l <= KV_MAX_LAYERS; l++) {
            stage_sink *s = w->sinks[st][l];
            if (s) {
                app_free(&s->rows);
                app_free(&s->stats);
                app_free(&s->hash);
                XXH3_freeState(s->digest);
                free(s);
            }
        }
    app_free(&w->tokens);
    app_free(&w->lse);
    app_free(&w->topk_ids);
    app_free(&w->topk_vals);
    dump_h5_close(w->file);
    free(w->top_ids);
    free(w->top_vals);
    free(w->fp_hash);
    free(w->fp_stats);
    free(w->cached);
    free(w->dirty);
    free(w->path);
    if (w->lock_fd >= 0)
        close(w->lock_fd);   /* releases the lock: last, after the final status */
    free(w);
}

dump_writer *dump_create(const char *path, const dump_meta *meta, const dump_opts *o, kv_err *e)
{
    if (check_args(path, meta, o, e) < 0)
        return NULL;
    dump_h5_quiet();
    dump_writer *w = calloc(1, sizeof *w);
    if (!w)
        return kv_errf(e, "%s: out of memory", path), NULL;
    w->file = H5I_INVALID_HID;
    w->lock_fd = -1;
    app_init(&w->tokens);
    app_init(&w->lse);
    app_init(&w->topk_ids);
    app_init(&w->topk_vals);
    w->o = *o;
    w->cfg = *meta->cfg;
    w->max_positions = meta->max_positions;
    w->meta_prompt = meta->prompt_length > 0 ? meta->prompt_length : 0;
    w->first = o->pos_lo;
    /* Logits of every prompt row cost a vocabulary-sized matmul per row:
     * only when stored in full or when final_norm rows are asked for. */
    w->obs.all_logits = o->full_logits || o->stages[STAGE_LOGITS] ||
                        o->stages[STAGE_FINAL_NORM] || meta->prompt_length <= 0;
    w->out_first = o->pos_lo;
    if (!w->obs.all_logits && meta->prompt_length - 1 > o->pos_lo)
        w->out_first = meta->prompt_length - 1;
    w->path = strdup(path);
    w->top_ids = malloc((size_t)o->topk * sizeof *w->top_ids);
    w->top_vals = malloc((size_t)o->topk * sizeof *w->top_vals);
    /* tokens, lse, topk_ids, topk_values, and three per stage sink */
    const size_t appenders = (size_t)4 + 3 * STAGE_COUNT * (KV_MAX_LAYERS + 1);
    w->cached = malloc(appenders * sizeof *w->cached);
    w->dirty = malloc(appenders * sizeof *w->dirty);
    if (!w->path || !w->top_ids || !w->top_vals || !w->cached || !w->dirty) {
        kv_errf(e, "%s: out of memory", path);
        writer_free(w);
        return NULL;
    }
    bool created = false;
    if (lock_target(w, &created, e) < 0) {
        /* Not unlinked even when this call created it: between the create
         * and the lock another run may have opened it and taken the lock,
         * and the file is now that run's. */
        writer_free(w);
        return NULL;
    }
    if (create_file(w, meta, e) < 0) {
        abandon_file(w);
        /* Half made, and nobody has seen it yet; removed while still
         * locked, so no other run's new file is removed instead. Only a
         * path this run created: never what was there before it. */
        if (created)
            unlink(path);
        writer_free(w);
        return NULL;
    }
    w->obs.emit = writer_emit;
    w->obs.token = writer_token;
    w->obs.wants = writer_wants;
    return w;
}

kv_observer *dump_observer(dump_writer *w)
{
    return w ? &w->obs : NULL;
}

void dump_watch_flag(dump_writer *w, volatile sig_atomic_t *flag)
{
    if (w)
        w->flag = flag;
}

const char *dump_error(const dump_writer *w)
{
    return w && w->failed ? w->err.msg : NULL;
}

/* ------------------------------------------------------------------ */
/* Closing                                                              */

static void flush_all(dump_writer *w)
{
    app_write_buffered(w, &w->tokens);
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = 0; l <= KV_MAX_LAYERS; l++)
            if (w->sinks[st][l]) {
                app_write_buffered(w, &w->sinks[st][l]->rows);
                app_write_buffered(w, &w->sinks[st][l]->stats);
                app_write_buffered(w, &w->sinks[st][l]->hash);
            }
    app_write_buffered(w, &w->lse);
    app_write_buffered(w, &w->topk_ids);
    app_write_buffered(w, &w->topk_vals);
    settle(w, true);
}

static void close_dataset(dump_writer *w, appender *a)
{
    if (a->dset >= 0 && H5Dclose(a->dset) < 0)
        fail_h5(w, "cannot close", a->name);
    a->dset = H5I_INVALID_HID;
}

/* After a write failed (disk full, file size limit), libhdf5 1.10.8 cannot
 * close the file: H5Fclose fails, leaves it half destroyed, and the library
 * crashes at exit (H5F__close_cb from its atexit handler). Nothing more can
 * reach the disk anyway, so the file's descriptor is pointed at /dev/null:
 * the closing writes then succeed and vanish, and the file on disk stays
 * as the failure left it. Called again (closing) it changes nothing. */
static void abandon_file(const dump_writer *w)
{
    int *fd = NULL;
    if (w->file < 0 || H5Fget_vfd_handle(w->file, H5P_DEFAULT, (void **)&fd) < 0 || !fd)
        return;
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
        dup2(null, *fd);
        close(null);
    }
}

/* Closes the SWMR file; afterwards w->file is invalid whatever happened. */
static void close_file(dump_writer *w)
{
    if (w->io_failed)
        abandon_file(w);
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = 0; l <= KV_MAX_LAYERS; l++)
            if (w->sinks[st][l]) {
                close_dataset(w, &w->sinks[st][l]->rows);
                close_dataset(w, &w->sinks[st][l]->stats);
                close_dataset(w, &w->sinks[st][l]->hash);
            }
    close_dataset(w, &w->tokens);
    close_dataset(w, &w->lse);
    close_dataset(w, &w->topk_ids);
    close_dataset(w, &w->topk_vals);
    if (H5Fclose(w->file) < 0)
        fail_h5(w, "cannot close", "the file");
    w->file = H5I_INVALID_HID;
}

static int rewrite_attr(hid_t obj, const char *name, hid_t mtype, const void *value)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    int rc = a >= 0 && H5Awrite(a, mtype, value) >= 0 ? 0 : -1;
    dump_h5_close(a);
    return rc;
}

static int write_u64(hid_t f, const char *name, int rank, const hsize_t *dims, const uint64_t *v)
{
    hid_t sp = H5Screate_simple(rank, dims, NULL), d = H5I_INVALID_HID;
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);   /* no times: identical runs, identical files */
    int rc = sp >= 0 && dcpl >= 0 && H5Pset_obj_track_times(dcpl, 0) >= 0 &&
                     (d = H5Dcreate2(f, name, H5T_STD_U64LE, sp, H5P_DEFAULT, dcpl,
                                     H5P_DEFAULT)) >= 0 &&
                     H5Dwrite(d, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0
                 ? 0
                 : -1;
    dump_h5_close(d);
    dump_h5_close(dcpl);
    dump_h5_close(sp);
    return rc;
}

/* /row_hash_index (docs/dump-format.md): per stage dataset its positions,
 * width, the XXH3-128 of its row hashes and the sum of its squared row
 * norms, so that two identical dumps compare by reading their hashes once
 * each, without opening a row. */
static int write_index(dump_writer *w, hid_t f)
{
    int n = 0;
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = 0; l <= KV_MAX_LAYERS; l++)
            n += w->sinks[st][l] && w->sinks[st][l]->digest;
    if (n == 0)
        return 0;
    uint64_t *rows = calloc((size_t)n * DUMP_INDEX_COLS, sizeof *rows);
    if (!rows)
        return -1;
    int k = 0;
    for (int l = 0; l <= KV_MAX_LAYERS; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            const stage_sink *s = w->sinks[st][l];
            if (!s || !s->digest)
                continue;
            const appender *h = w->o.fingerprint ? &s->rows : &s->hash;
            const XXH128_hash_t d = XXH3_128bits_digest(s->digest);
            uint64_t *r = rows + (size_t)k++ * DUMP_INDEX_COLS, sum;
            memcpy(&sum, &s->sum_sq, sizeof sum);
            r[0] = (uint64_t)l;   /* layer + 1: 0 is the model */
            r[1] = (uint64_t)stage_wire_id((kv_stage)st);
            r[2] = (uint64_t)s->rows.first;
            r[3] = (uint64_t)s->rows.written;
            r[4] = (uint64_t)s->cols;
            r[5] = d.low64;
            r[6] = d.high64;
            r[7] = sum;
            /* bit 0: every statistic finite; bit 1: as many hashes as rows */
            r[8] = (uint64_t)s->finite | (uint64_t)(h->written == s->rows.written) << 1;
        }
    hsize_t dims[2] = {(hsize_t)n, DUMP_INDEX_COLS};
    int rc = write_u64(f, DUMP_INDEX, 2, dims, rows);
    free(rows);
    return rc;
}

/* The index, or none at all: it is optional, so a failure to write it
 * (out of memory) leaves the dump without one rather than unfinished. */
static bool index_or_none(dump_writer *w, hid_t f)
{
    if (write_index(w, f) < 0 && H5Lexists(f, DUMP_INDEX, H5P_DEFAULT) > 0)
        H5Ldelete(f, DUMP_INDEX, H5P_DEFAULT);
    H5Eclear2(H5E_DEFAULT);
    return true;
}

/* Reopens the closed file normally (SWMR forbids changing attributes) and
 * writes the row hash index (when nothing failed), sets prompt_length,
 * then status: last, so it says "complete" only when everything before it
 * went to disk. */
static int set_final_attrs(dump_writer *w, const char *status)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), f = H5I_INVALID_HID, tok = H5I_INVALID_HID;
    hid_t str = dump_h5_vlstr();
    int64_t np = w->n_prompt;
    int rc = fapl >= 0 && str >= 0 &&
                     H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST) >= 0 &&
                     (f = H5Fopen(w->path, H5F_ACC_RDWR, fapl)) >= 0 &&
                     (w->failed || index_or_none(w, f)) &&
                     (tok = H5Dopen2(f, "/tokens", H5P_DEFAULT)) >= 0 &&
                     rewrite_attr(tok, "prompt_length", H5T_NATIVE_INT64, &np) >= 0 &&
                     rewrite_attr(f, "status", str, &status) >= 0 ? 0 : -1;
    dump_h5_close(str);
    dump_h5_close(fapl);
    dump_h5_close(tok);
    /* Closing writes the attributes out: its failure is a failure. */
    if (rc == 0 && H5Fclose(f) < 0)
        rc = -1;
    else if (rc < 0)
        dump_h5_close(f);
    if (rc < 0)
        fail_h5(w, "cannot set the final status of", "the file");
    return rc;
}

int dump_close(dump_writer *w, const char *why, kv_err *e)
{
    if (!w)
        return 0;
    /* Rows buffered before a non-I/O error (a gap, a bad width) are good. */
    if (!w->io_failed)
        flush_all(w);
    close_file(w);
    /* After an I/O error (disk full, size limit) the file is not touched
     * again: it keeps "partial: running". */
    if (!w->io_failed && still_ours(w)) {
        char status[1200];
        if (why)
            snprintf(status, sizeof status, "partial: %s", why);
        else if (w->failed)
            snprintf(status, sizeof status, "partial: writer error");
        else
            snprintf(status, sizeof status, "complete");
        set_final_attrs(w, status);
    }
    int rc = w->failed ? kv_errf(e, "%s", w->err.msg) : 0;
    writer_free(w);
    return rc;
}
