/* reader_internal.h — the reader's state (reader.c), shared with
 * survey.c, which fills it in from child processes. Nothing else
 * includes it. */
#ifndef KV_READER_INTERNAL_H
#define KV_READER_INTERNAL_H

#include <stdatomic.h>
#include "dump_internal.h"

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

/* The element type a reader expects, checked before HDF5 would convert. */
typedef enum { ELEM_F32, ELEM_I32, ELEM_U64 } elem_kind;

/* What the reader knows of one dataset, looked up once per path and kept
 * while the file is open (a comparer asks about hundreds of datasets, each
 * again for every block): shape, element type, first_position, and a map
 * of its rows in the file when its storage allows reads past libhdf5. */
typedef struct dset_meta {
    struct dset_meta *next;      /* hash chain */
    char *path;
    bool present;                /* the dataset exists */
    int rank;                    /* 1 or 2; -1 another shape, or one past the
                                  * limits (more than INT32_MAX columns) */
    hsize_t dims[2];             /* dims[1] = 1 for rank 1; kept as the file says
                                  * when past the limits, 0 for another shape */
    int kind;                    /* elem_kind of the stored type; -1 another */
    int64_t first_position;      /* 0 when the attribute is absent */
    bool has_first;              /* the attribute is there, an integer */
    int problem;                 /* DUMP_STORAGE_* (dump_internal.h), or a link of
                                  * that name that does not open: META_UNOPENABLE,
                                  * META_EXTERNAL_LINK (then present is false) */
    int filter;                  /* DUMP_STORAGE_FILTER: the filter it lacks */
    int mapped;                  /* -1 not tried yet; 0 read through libhdf5; 1 map */
    dump_rowmap map;
    hid_t id;                    /* open until mapped (a map needs no handle); -1 closed */
} dset_meta;

enum { META_UNOPENABLE = 16, META_EXTERNAL_LINK };

#define META_BUCKETS 1024
/* Bucket heads are atomic: parallel readers look entries up while the
 * thread that may call libhdf5 adds others. An entry is complete before it
 * is published (release) and never removed before the file is closed. */
typedef struct {
    _Atomic(dset_meta *) b[META_BUCKETS];
} meta_table;

/* A row of /row_hash_index, believed once its digest has been checked
 * against the hashes it summarizes. */
struct index_entry {
    dump_stage_digest d;
    int checked;                 /* 0 not yet; 1 the hashes match; -1 they do not */
};

struct dump_file {
    char *path;
    hid_t file;
    hid_t dapl;                  /* how datasets are opened (no chunk cache) */
    int fd;                      /* the same file, for direct reads; -1 none */
    bool direct;                 /* direct reads allowed (dump_set_direct_reads) */
    int64_t size;
    attr_cache *attrs;
    meta_table *meta;
    bool fingerprint;
    bool row_hashes;     /* full mode with <stage>.hash / .stats beside the rows */
    kv_config cfg;
    bool cfg_ok;
    char cfg_err[512];   /* the first model_config problem */
    int64_t n_tokens, prompt_length;
    bool has_prompt_length;
    int out_k;
    struct index_entry (*index)[STAGE_COUNT];  /* [layer + 1][stage]; NULL: none */
    char index_problem[sizeof(kv_err)];
    int64_t index_rows;
    int64_t opened;              /* datasets opened through libhdf5 (tests) */
};

/* The entry of path if already looked up, else NULL (no libhdf5 call:
 * safe from any thread once the entry exists). */
dset_meta *dump_meta_find(const dump_file *f, const char *path);
/* Publishes a complete entry no other entry has the path of (the caller
 * checked with dump_meta_find, on the one thread that adds entries). */
void dump_meta_publish(const dump_file *f, dset_meta *m);
/* Frees an entry (not published, or its table's last use). */
void dump_meta_free(dset_meta *m);
/* Maps the .hash and (or) .stats datasets of a stage for direct reads,
 * as their first read would. */
void dump_map_hashes(const dump_file *f, int layer, kv_stage stage, bool hash, bool stats);

#endif
