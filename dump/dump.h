/* dump.h — writing and reading kvdiff dumps (docs/dump-format.md).
 *
 * The writer is an observer sink: engines emit rows to the kv_observer it
 * hands out and know nothing of HDF5. Rows are buffered per dataset and
 * appended in blocks of block_rows to chunked, extendible datasets; the
 * file is written in SWMR mode and flushed after every forward batch (and
 * every 64 MiB within one), rows of a block not yet full included, so a
 * crash leaves a coherent file marked `partial: running` holding every row
 * of every batch (prefill chunk, decode step) before the one that was
 * running. dump_close sets the final status.
 *
 * The reader opens any schema-v1 file (ours or another program's, SWMR-
 * flagged or not) and reads hyperslabs, so memory stays bounded. */
#ifndef KV_DUMP_H
#define KV_DUMP_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include "../model/config.h"
#include "../model/err.h"
#include "../model/observer.h"

#define DUMP_FORMAT "kvdiff-dump"
#define DUMP_VERSION 1

/* The most positions (/tokens entries) a dump may hold: readers load
 * /tokens whole, and validate refuses what a reader would not read.
 * 2^26, far past any context a model is run at. */
#define DUMP_MAX_POSITIONS (1LL << 26)

/* The longest string attribute (in bytes) kvdiff reads: the longest it
 * writes, a model_config or engine_settings, is a few kilobytes. A longer
 * one is refused by name and size before it is read again (a file of
 * another program's, or a damaged one). 1 MiB. */
#define DUMP_MAX_STR_ATTR (1LL << 20)

/* ---------------------------------------------------------------- */
/* Selection                                                          */

typedef struct {
    int layer_lo, layer_hi;        /* inclusive; default 0 .. INT32_MAX */
    int64_t pos_lo, pos_hi;        /* inclusive; default 0 .. INT64_MAX */
    bool stages[STAGE_COUNT];      /* default: all but final_norm and logits */
    bool full_logits;              /* also store /model/logits */
    bool compress;                 /* shuffle + deflate */
    bool fingerprint;              /* hashes and statistics instead of rows */
    bool row_hashes;               /* full mode: hashes and statistics beside the rows
                                    * (default on: comparers skip identical rows) */
    int topk;                      /* /output top-k (default 8) */
    int block_rows;                /* rows buffered per dataset (default 64) */
    struct kern_pool *pool;        /* optional (model/pool.h): rows are hashed and
                                    * measured on its threads, which sit idle while
                                    * the engine hands rows over; NULL: serially.
                                    * The values do not depend on it. */
} dump_opts;

void dump_opts_default(dump_opts *o);
/* "10:23" (inclusive), "10:", ":23", "7". */
int dump_parse_layers(const char *s, dump_opts *o, kv_err *e);
int dump_parse_positions(const char *s, dump_opts *o, kv_err *e);
/* Comma list of stage names (observer.h), e.g. "k,v,x_out"; replaces the set. */
int dump_parse_stages(const char *s, dump_opts *o, kv_err *e);

/* libhdf5 (1.10 to 1.14) loops forever on some damaged files: reading a
 * variable-length string whose global heap is corrupt never returns
 * (HDFGroup/hdf5 issue 1707). With a guard, opening a dump for reading and
 * each attribute read must return within `seconds`, or the process ends:
 * on_hang(path) runs in the SIGALRM handler (async-signal-safe calls only)
 * and its result is the exit status. 0 seconds: no guard (the default). */
void dump_hang_guard(unsigned seconds, int (*on_hang)(const char *path));

/* Every file opened for reading is first read by a child process that
 * touches each variable-length string through libhdf5; a child that
 * crashes or hangs makes the open fail with "damaged file". fn (may be
 * NULL) runs first in that child: a fuzzing harness uses it to let the
 * child die quietly instead of reporting libhdf5's crash as its own. */
void dump_preflight_child_hook(void (*fn)(void));

/* ---------------------------------------------------------------- */
/* Writer                                                             */

typedef struct {
    const char *engine;            /* "reference", "chunked" */
    const char *engine_settings;   /* JSON object text */
    const kv_config *cfg;
    uint64_t weight_fingerprint;
    uint64_t seed;
    const char *tool_version;      /* "kvdiff 0.1.0" */
    int max_positions;             /* positions the run can reach (sizes nothing; a bound for checks) */
    int prompt_length;             /* known before the run; 0 = unknown (then logits of every row) */
} dump_meta;

typedef struct dump_writer dump_writer;

/* Bytes of float rows one position adds to a recording of c with
 * selection o: the selected stages of the selected layers (no K/V on
 * KV-shared followers), the model-level ones, full logits when selected.
 * Not /output, hashes, statistics or HDF5's overhead: what an in-memory
 * recording of the same selection holds per position. */
size_t dump_position_bytes(const kv_config *c, const dump_opts *o);

/* Creates path (truncating) with every group and dataset the selection
 * implies, status "partial: running", then switches to SWMR. Errors name
 * the path (unwritable, exists as a folder, ...). */
dump_writer *dump_create(const char *path, const dump_meta *meta, const dump_opts *o,
                         kv_err *e);

/* The sink to hand to an engine / generate(); valid until dump_close. */
kv_observer *dump_observer(dump_writer *w);

/* When *flag becomes non-zero (set by a signal handler), the observer asks
 * the engine to stop at its next event. flag may be NULL. */
void dump_watch_flag(dump_writer *w, volatile sig_atomic_t *flag);

/* First write error seen by the observer (the engine only sees "stop"). */
const char *dump_error(const dump_writer *w);

/* Writes buffered rows, leaves SWMR, sets status "complete" (why == NULL)
 * or "partial: <why>", closes. Frees w. Returns -1 (e filled) if anything
 * failed, in which case the status is never "complete". */
int dump_close(dump_writer *w, const char *why, kv_err *e);

/* ---------------------------------------------------------------- */
/* Reader                                                             */

typedef struct dump_file dump_file;

typedef struct {
    bool present;
    int64_t first_position;
    int64_t rows;
    int cols;                      /* 1 for 1-D datasets */
} dump_dataset_info;

/* Opens for reading (SWMR-flagged files too). Errors: not HDF5, not a
 * kvdiff dump, another format version, missing root attributes. */
dump_file *dump_open(const char *path, kv_err *e);
void dump_file_close(dump_file *f);   /* accepts NULL */

const char *dump_path(const dump_file *f);
const char *dump_attr(const dump_file *f, const char *name);  /* string root attribute or NULL */
int64_t dump_attr_int(const dump_file *f, const char *name, int64_t dflt);
bool dump_is_fingerprint(const dump_file *f);
/* Fingerprint mode, or full mode with row_hashes = 1: every stage dataset
 * has its <stage>.hash and <stage>.stats. */
bool dump_has_row_hashes(const dump_file *f);
bool dump_is_complete(const dump_file *f);

/* The parsed model_config (only the fields listed in the format; others
 * zero). Returns -1 with e filled when missing or malformed. */
int dump_model_config(const dump_file *f, kv_config *out, kv_err *e);

int dump_n_layers(const dump_file *f);         /* num_hidden_layers of model_config */
int64_t dump_n_tokens(const dump_file *f);
int64_t dump_prompt_length(const dump_file *f);
int dump_read_tokens(const dump_file *f, int32_t *out, kv_err *e);  /* n_tokens ids */

/* Stage dataset of a layer (layer -1: /model). In fingerprint mode the
 * info describes <stage>.hash. */
dump_dataset_info dump_stage_info(const dump_file *f, int layer, kv_stage stage);

/* The <stage>.hash dataset (fingerprint mode, or full mode with row
 * hashes: a dump cut short may hold fewer hashes than rows). */
dump_dataset_info dump_hash_info(const dump_file *f, int layer, kv_stage stage);

/* What /row_hash_index says of a stage dataset: written when the file was
 * closed (absent after a killed writer, in other programs' files), it
 * spares a reader that only wants to know whether two dumps are identical
 * from reading rows, statistics or row datasets at all. */
typedef struct {
    bool present;
    int64_t first_position, rows;
    int cols;
    uint64_t digest[2];            /* XXH3-128 of the rows' hashes, in order */
    double sum_sq;                 /* sum over rows of (L2 norm)^2, in order */
    bool finite;                   /* every row's statistics finite */
    bool all_hashed;               /* a hash for every row */
} dump_stage_digest;

/* The index row of a stage. checked = false: as written (an edit since
 * may have left it stale); true: only once its digest has been found
 * equal to that of the stage's .hash dataset as it is now (read once;
 * present false when not). */
dump_stage_digest dump_digest(const dump_file *f, int layer, kv_stage stage, bool checked);
/* Rows of the file's /row_hash_index (0: none, or not used). */
int64_t dump_index_rows(const dump_file *f);
/* NULL, or why the file's /row_hash_index was not used (malformed). */
const char *dump_index_problem(const dump_file *f);

/* Reads rows [row0, row0 + n) of a full-mode stage into out (n x cols). */
int dump_read_rows(const dump_file *f, int layer, kv_stage stage, int64_t row0, int64_t n,
                   float *out, kv_err *e);
/* Readies a full-mode stage for dump_read_rows_parallel: 1 when its rows
 * lie plain in the file (no filters, little-endian float32, every chunk
 * stored) and so may be read from several threads at once; 0 when not
 * (use dump_read_rows). Call from one thread, before the parallel reads. */
int dump_rows_parallel(const dump_file *f, int layer, kv_stage stage);
/* As dump_read_rows, for a stage dump_rows_parallel said 1 of: makes no
 * libhdf5 call, so it may run on any thread, alongside itself. */
int dump_read_rows_parallel(const dump_file *f, int layer, kv_stage stage, int64_t row0,
                            int64_t n, float *out, kv_err *e);
/* Tests: false reads every dataset of files opened from now on through
 * libhdf5 (no direct reads, no parallel ones); true is the default. */
void dump_set_direct_reads(bool on);
/* The per-dataset work a reader of several files does first, done for
 * each file in a child process of its own, all at once: libhdf5 runs one
 * call at a time in a process, and opening, mapping and checking the
 * index of a few hundred datasets per file is most of what a compare of
 * identical dumps costs. What the children learn (shapes, first
 * positions, chunk maps, which index rows match their hashes) is taken
 * in, so the calls that ask for it later find it done. Never fails: what
 * a child could not do (no fork, a child that died or took over a
 * minute) is done as usual when asked for. Call before any thread reads
 * the files, and while no other thread is inside libhdf5 (it forks: a
 * child would inherit the library's lock held). */
enum {
    DUMP_SURVEY_STAGE = 1,         /* dump_stage_info */
    DUMP_SURVEY_MAP_ROWS = 2,      /* dump_rows_parallel */
    DUMP_SURVEY_HASHES = 4,        /* dump_hash_info */
    DUMP_SURVEY_MAP_HASHES = 8,    /* .hash, for dump_read_hashes */
    DUMP_SURVEY_MAP_STATS = 16,    /* .stats, for dump_read_hashes */
    DUMP_SURVEY_DIGEST = 32,       /* dump_digest(checked = true) */
    DUMP_SURVEY_CHECK = 64         /* dump_check_stage */
};
typedef struct {
    int layer;
    kv_stage stage;
    unsigned what;                 /* DUMP_SURVEY_* */
} dump_survey_item;
/* items: n_items for files[0], then n_items for files[1], ... */
void dump_survey(dump_file *const *files, int n_files, const dump_survey_item *items,
                 int n_items);
/* Tests: how many datasets of f this process has opened through libhdf5
 * (a survey's child opens them in its stead). */
int64_t dump_datasets_opened(const dump_file *f);
/* Tests: false makes dump_survey do nothing (every file read as usual);
 * true is the default. */
void dump_set_survey(bool on);
/* Tests: fn runs in each survey child instead of its own report, with the
 * pipe to the parent (it may write anything, or die). NULL: none. */
void dump_survey_child_hook(void (*fn)(int out_fd));

/* Hashes (n) and stats (n x 2: L2 norm, absmax) of fingerprint mode, or of
 * a full dump with row hashes. Either pointer may be NULL. */
int dump_read_hashes(const dump_file *f, int layer, kv_stage stage, int64_t row0, int64_t n,
                     uint64_t *hash, float *stats, kv_err *e);
/* /output: lse (n) and top-k ids/values (n x k); k from dump_output_k. */
dump_dataset_info dump_output_info(const dump_file *f);
int dump_output_k(const dump_file *f);
int dump_read_output(const dump_file *f, int64_t row0, int64_t n, float *lse, int32_t *ids,
                     float *vals, kv_err *e);

/* What a comparer checks before it believes anything of a file (a hash,
 * the row hash index, a row): what kvdiff validate would reject in the
 * metadata, so that a broken file is refused, never settled. Each returns
 * 0, or -1 with e naming the file and the object (one line).
 *
 * dump_check_file: the parts outside the stage datasets: engine_settings
 * a JSON object; /tokens an int32 1-D dataset with prompt_length; every
 * member of /layers a group named by a layer index below
 * num_hidden_layers; /output (when there) with k from 1 to vocab_size,
 * lse, topk_ids and topk_values of that shape over the same positions
 * inside the tokens, and every id below vocab_size (the one read of data:
 * top-k ids, small). A file whose model_config does not parse fails here,
 * and so, first, does one a run is still writing (dump_check_not_written).
 *
 * dump_check_stage: the datasets of one stage (rows; .hash and .stats in
 * fingerprint mode and with row hashes): each opens (not a dangling or
 * looping link, nor an external one), keeps its data in this file and
 * needs no filter this libhdf5 lacks, has the type, rank and width of the
 * schema and the config, a first_position from 0 whose rows stay inside
 * the tokens, and rows, hashes and statistics cover the same positions.
 * A stage not recorded passes. Only metadata: what dump_stage_info and
 * dump_hash_info look up, so a survey's children (DUMP_SURVEY_CHECK) do
 * the libhdf5 calls for it. */
int dump_check_file(const dump_file *f, kv_err *e);
int dump_check_stage(const dump_file *f, int layer, kv_stage stage, kv_err *e);

/* 0 unless a writer (a kvdiff run recording to path, in this process or
 * another) holds its lock on the file now; then -1 with e = "PATH: is
 * being written by another process now ...: wait for that run to
 * finish". dump_check_file does the same on an open file. */
int dump_check_not_written(const char *path, kv_err *e);

/* Checks the file against schema v1; calls report(ctx, line) once per
 * violation (each a sentence naming the object). Returns the number of
 * violations, or -1 when the file cannot be opened at all (e filled). */
int dump_validate(const char *path, void (*report)(void *ctx, const char *line), void *ctx,
                  kv_err *e);

#endif
