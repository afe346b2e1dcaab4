/* outfile.h — writing an output file whole or not at all, safely.
 *
 * The text goes to a fresh temporary file that mkstemp creates in the
 * target's own folder (O_EXCL: a name nobody can have planted a symlink at,
 * unlike a predictable "NAME.tmp"), and is renamed over the target when it
 * is complete. rename replaces a symlink at the target itself, never the
 * file it points to. */
#ifndef KV_OUTFILE_H
#define KV_OUTFILE_H

#include <stdbool.h>
#include <stdio.h>
#include "err.h"

typedef struct {
    FILE *f;          /* write here between open and commit/abort */
    char *path;       /* the target (owned copy) */
    char *tmp;        /* the temporary file (owned) */
} outfile;

/* Creates the temporary file beside path (".NAME.XXXXXX" in path's folder,
 * mode 0666 less the umask). Returns 0 with o->f open, or -1 with e =
 * "PATH: cannot write: why" and o empty. */
int outfile_open(outfile *o, const char *path, kv_err *e);

/* Closes o->f and renames the temporary file to the target. On a write,
 * close or rename error the temporary file is removed, the target is left
 * as it was, and e = "PATH: write failed: why". o is empty afterwards
 * either way. */
int outfile_commit(outfile *o, kv_err *e);

/* Closes and removes the temporary file; accepts an empty o. */
void outfile_abort(outfile *o);

/* Whether paths a and b name the same file: the same device and inode
 * when both exist, else the same path once each one's folder is resolved
 * (realpath) - two outputs not yet written can still collide. An output
 * checked against the inputs it must not overwrite. */
bool outfile_same(const char *a, const char *b);

/* A word for what a stat mode says a path is ("a device", "a FIFO", "a
 * directory", ...): for refusals of inputs and outputs that are not regular
 * files (infile.c's and the dump writer's alike). */
const char *outfile_kind(unsigned mode);

#endif
