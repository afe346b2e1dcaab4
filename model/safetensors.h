/* safetensors.h — reading and writing the safetensors format.
 *
 * Reader: maps the file read-only; every header field is checked against
 * the file size (offsets inside the data area, byte length equal to the
 * shape product times the dtype size, no overlap is required but no
 * overflow is possible). Views returned point into the mapping and live
 * until st_close. A sharded folder (model.safetensors.index.json) opens
 * every shard named in its weight_map.
 *
 * Writer: streams tensors in the declared order to a temporary file and
 * renames it into place on st_writer_finish, so an interrupted write never
 * leaves a file that looks whole. */
#ifndef KV_SAFETENSORS_H
#define KV_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "err.h"

#define ST_MAX_DIMS 8

typedef enum {
    ST_F32, ST_F16, ST_BF16,               /* readable as float */
    ST_F64, ST_I64, ST_I32, ST_I16, ST_I8, ST_U8, ST_BOOL,
    ST_F8_E4M3, ST_F8_E5M2, ST_U16, ST_U32, ST_U64,
    ST_DTYPE_COUNT
} st_dtype;

typedef struct {
    const char *name;            /* owned by the st_file */
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t nelem;              /* product of shape */
    const void *data;            /* into the mapping; nbytes long */
    uint64_t nbytes;
    const char *file;            /* path of the file holding it */
} st_tensor;

typedef struct st_file st_file;  /* opaque: one file or a sharded set */

/* Opens a single .safetensors file. */
st_file *st_open(const char *path, kv_err *e);

/* Opens the weights of a model folder: model.safetensors.index.json when
 * present (every shard), else model.safetensors. */
st_file *st_open_dir(const char *dir, kv_err *e);

/* Parses a header from memory (buf holds the whole file, len bytes);
 * `name` is used in messages. The st_file does not own buf; buf must
 * outlive it. Used by st_open and by the fuzzer. */
st_file *st_parse(const void *buf, size_t len, const char *name, kv_err *e);

void st_close(st_file *f);   /* accepts NULL; invalidates every view */

size_t st_count(const st_file *f);
const st_tensor *st_at(const st_file *f, size_t i);        /* in header order */
const st_tensor *st_find(const st_file *f, const char *name); /* NULL when absent */

/* Metadata value of key in __metadata__ (first file), NULL when absent. */
const char *st_metadata(const st_file *f, const char *key);

const char *st_dtype_name(st_dtype d);
size_t st_dtype_size(st_dtype d);

/* Converts element i.. of a F32/F16/BF16 tensor to float: n values from
 * element `first` into out. Returns -1 (with e naming file and tensor) for
 * other dtypes or a range outside the tensor. */
int st_read_f32(const st_tensor *t, uint64_t first, uint64_t n, float *out, kv_err *e);

/* --- writer --- */
typedef struct st_writer st_writer;

typedef struct {
    const char *name;
    st_dtype dtype;              /* F32 or BF16 (written from float data) or F16 */
    int ndim;
    int64_t shape[ST_MAX_DIMS];
} st_decl;

/* Declares all tensors up front (the header is written first); metadata is
 * a NULL-terminated key, value, key, value, ... list or NULL. */
st_writer *st_writer_open(const char *path, const st_decl *decls, size_t n,
                          const char *const *metadata, kv_err *e);

/* Writes the data of the next declared tensor (in declaration order) from
 * float values, converting to its dtype (round to nearest even). */
int st_writer_put_f32(st_writer *w, const float *values, kv_err *e);

/* Writes the next tensor from raw bytes already in its dtype. */
int st_writer_put_raw(st_writer *w, const void *bytes, uint64_t nbytes, kv_err *e);

/* Checks every tensor was written, syncs, renames into place. Frees w. */
int st_writer_finish(st_writer *w, kv_err *e);

/* Drops the temporary file. Frees w; accepts NULL. */
void st_writer_abort(st_writer *w);

/* bfloat16 / float16 conversions (exact widening, round-to-nearest-even narrowing). */
float st_bf16_to_f32(uint16_t h);
uint16_t st_f32_to_bf16(float f);
float st_f16_to_f32(uint16_t h);
/* st_f32_to_bf16 over n values (src and dst must not overlap). */
void st_f32_to_bf16_n(const float *src, size_t n, uint16_t *dst);
uint16_t st_f32_to_f16(float f);

#endif
