/* dump_internal.h — helpers the dump module's files share (writer.c,
 * reader.c, validate.c, all over dump.c). Not a public header: nothing
 * outside dump/ includes it. */
#ifndef KV_DUMP_INTERNAL_H
#define KV_DUMP_INTERNAL_H

#include <hdf5.h>
#include <stdbool.h>
#include <stdint.h>
#include "dump.h"

/* HDF5 prints its error stack on every failure unless told not to; our
 * messages say what failed, so printing is turned off, process-wide, once.
 * The same call makes every external link fail to open (dump.c says why). */
void dump_h5_quiet(void);

/* The links of a group, sorted by name, each with its type (hard, soft,
 * external): listed without the code path of libhdf5 1.10 that frees
 * memory it never allocated on some damaged groups. 0, or -1 when the
 * group cannot be listed (nothing to free then). */
typedef struct {
    char *name;
    H5L_type_t type;
} dump_link;
int dump_h5_list(hid_t group, dump_link **out, size_t *n);
void dump_links_free(dump_link *links, size_t n);

/* The most telling line of the current HDF5 error stack ("No such file or
 * directory" when a system call failed, else the innermost description),
 * then clears the stack. *errno_out (may be NULL) gets the errno, or 0. */
void dump_h5_detail(char *buf, size_t n, int *errno_out);

/* Closes any HDF5 id (file, group, dataset, attribute, dataspace,
 * datatype, property list); ignores invalid ones. Keeps the error stack of
 * a failure just seen, so cleanup can run before the message is made. */
void dump_h5_close(hid_t id);

/* Fills e with "<path>: <what>: <HDF5 detail>" and returns -1. */
int dump_h5_fail(kv_err *e, const char *path, const char *what);

/* Opens path read-only; a file still flagged by a SWMR writer (killed
 * mid-run) is opened again with H5F_ACC_SWMR_READ. Errors say: no such
 * file, a folder, empty, not an HDF5 file, truncated, or HDF5's reason. */
hid_t dump_h5_open_read(const char *path, kv_err *e);
/* As dump_h5_open_read, for a reader that lists the members of every
 * group (validate): the child process lists each group under /layers and
 * /model first, so a crash of libhdf5 there makes the file "damaged". */
hid_t dump_h5_open_walk(const char *path, kv_err *e);

/* First call of a child process forked to read a file: the parent's hang
 * alarm is not the child's to take, and what it prints (libhdf5 dying,
 * say) goes to /dev/null. */
void dump_child_begin(void);
/* A pipe to a child process: both ends above the standard descriptors
 * (with those closed, an end could be 1 or 2, and dump_child_begin would
 * close it) and closed on exec. 0, or -1 with errno set. */
int dump_child_pipe(int p[2]);

/* The row hash index (docs/dump-format.md): one row of DUMP_INDEX_COLS
 * uint64 per stage dataset with row hashes. */
#define DUMP_INDEX "/row_hash_index"
#define DUMP_INDEX_COLS 9

/* Why a row of the index cannot be right (NULL when it can); fills the
 * layer (-1: /model) and stage it names. */
const char *dump_index_row_problem(const uint64_t *row, int *layer, kv_stage *stage);

/* A dataset's rows as byte ranges of the file (direct.c): read with
 * pread(), past libhdf5, and so from several threads at once. */
typedef struct {
    int64_t rows;
    size_t row_bytes;
    int64_t chunk_rows;       /* rows per chunk; 0: one contiguous block */
    int64_t n_off;
    int64_t *off;             /* file offset of each chunk (or of the block) */
} dump_rowmap;

/* Datasets of more chunks are read through libhdf5. libhdf5 1.10 finds a
 * chunk's offset by walking the chunk index from its start, so mapping c
 * chunks costs in c^2: at 250 chunks of narrow rows the map took longer
 * than reading everything through libhdf5; at 64 it is under 0.5 ms. */
#define DUMP_DIRECT_MAX_CHUNKS 64

/* Can the chunk offsets libhdf5 gives for file be read at as they are?
 * No user block (offsets would be relative to it), not opened for SWMR
 * reading (a live writer may move things), a little-endian host. */
bool dump_file_plain(hid_t file);
/* Maps dataset d (of a file dump_file_plain accepted, opened read-only on
 * fd too, file_size bytes) when its stored type equals std_type (a
 * little-endian H5T_STD_* or H5T_IEEE_* type) and its storage is plain:
 * 1 mapped, 0 not (m zeroed; read through libhdf5 instead). Never fails
 * otherwise. */
int dump_rowmap_build(hid_t d, hid_t std_type, int fd, int64_t file_size, dump_rowmap *m);
/* Rows [row0, row0 + n) into out. Touches no libhdf5 state: safe from
 * any thread. path names the file in errors. */
int dump_rowmap_read(const dump_rowmap *m, int fd, const char *path, int64_t row0, int64_t n,
                     void *out, kv_err *e);
void dump_rowmap_free(dump_rowmap *m);
/* Is m a map dump_rowmap_build could have made of a dataset of `rows`
 * rows of row_bytes bytes in a file of file_size bytes (chunk count,
 * count cap, every chunk inside the file)? For maps made elsewhere
 * (survey.c's children). */
bool dump_rowmap_sound(const dump_rowmap *m, uint64_t rows, size_t row_bytes,
                       int64_t file_size);
/* Reads exactly n bytes at off (retrying short reads); -1 on error or at
 * the end of the file. */
int dump_pread(int fd, void *buf, size_t n, int64_t off);

/* Storage a dump's data may not have: data in another file (external
 * storage or a virtual dataset: reading it would read that file), or a
 * filter other than the deflate and shuffle kvdiff writes (another would
 * be a plugin's code, or fail every read). dump_h5_storage returns the problem
 * (*filter: the missing filter's id, -1 unknown); dump_storage_words says
 * it ("keeps its data in another file ..."), after the dataset's name;
 * dump_h5_storage_problem does both, false when there is none. */
enum { DUMP_STORAGE_OK, DUMP_STORAGE_EXTERNAL, DUMP_STORAGE_FILTER, DUMP_STORAGE_VIRTUAL };
int dump_h5_storage(hid_t d, int *filter);
const char *dump_storage_words(int problem, int filter, char *buf, size_t n);
bool dump_h5_storage_problem(hid_t d, char *why, size_t n);

/* Variable-length UTF-8 string type (caller closes). */
hid_t dump_h5_vlstr(void);

/* Attribute readers. 0 on success; -1 when absent, not of that class, not
 * a single value, or unreadable. Strings (variable or fixed length) are
 * returned malloc'd. Integers of any width and sign; a uint64 above
 * INT64_MAX comes back with its bits (two's complement). Numbers: integer
 * or float attributes as double. */
int dump_h5_attr_str(hid_t obj, const char *name, char **out);
int dump_h5_attr_i64(hid_t obj, const char *name, int64_t *out);
int dump_h5_attr_f64(hid_t obj, const char *name, double *out);
/* The attribute's type class, or H5T_NO_CLASS when absent or unreadable. */
H5T_class_t dump_h5_attr_class(hid_t obj, const char *name);

/* Columns of a stage for a model: E, 3, H*D, KV*D, H or V. */
int dump_stage_cols(const kv_config *c, kv_stage st, int layer);

/* Parses model_config JSON (docs/dump-format.md). Every problem is passed
 * to problem(ctx, sentence); returns their number. *out is filled when the
 * text is a JSON object: whole when there are no problems, otherwise with
 * the fields that parsed and 0 where one did not (validate still checks the
 * widths those give); untouched otherwise. */
typedef void (*dump_problem_fn)(void *ctx, const char *msg);
int dump_config_parse(const char *text, kv_config *out, dump_problem_fn problem, void *ctx);

/* A layer group's name as its index: a canonical non-negative decimal
 * ("3", not "03" or "+3"); -1 otherwise. Reader and validator alike. */
int dump_layer_index(const char *name);

#endif
