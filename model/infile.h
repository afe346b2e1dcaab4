/* infile.h — opening a small input file (config.json, tokenizer.json)
 * without trusting what the name points to: a FIFO would block the open or
 * the read for ever, a character device (/dev/zero) would be read until a
 * size limit, a huge file would be read whole before being refused. */
#ifndef KV_INFILE_H
#define KV_INFILE_H

#include <stddef.h>
#include <stdio.h>
#include "err.h"

/* Opens path for reading after checking, on the opened file (fstat; the
 * open itself is non-blocking), that it is a regular file of at most
 * max_bytes bytes. Returns the stream, or NULL with e = "PATH: why"; a
 * missing file leaves errno == ENOENT (callers that treat it as optional
 * test that). */
FILE *infile_open(const char *path, long long max_bytes, kv_err *e);

/* Reads a whole file opened by infile_open into *text (malloc'd, with a
 * NUL after its *len bytes, which may hold NULs of their own). Returns 0,
 * or -1 with e = "PATH: why" and *text NULL. */
int infile_read_all(const char *path, long long max_bytes, char **text, size_t *len, kv_err *e);

#endif
