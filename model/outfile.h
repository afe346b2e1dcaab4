/* outfile.h — the one discipline for every file kvdiff writes.
 *
 * Whole-file outputs (GGUF, safetensors, JUnit, reports, plots, configs):
 * the bytes go to a fresh temporary file created in the target's own
 * folder with O_CREAT | O_EXCL | O_NOFOLLOW (a name nobody can have planted
 * anything at), are written whole and fsync'd, and the temporary file is
 * renamed over the target only when the target is still absent or a
 * regular file that is not one of the run's inputs. A symlink, a device,
 * a FIFO, a socket or a folder at the target is refused, never replaced or
 * followed; so is a regular file the run read (noted with
 * outfile_note_input: a model, a dump, a prompt, a program a suite runs).
 *
 * Dumps are written in place (a crash leaves the file, marked partial,
 * where the user asked for it): their writer checks its target with
 * outfile_check_target and opens it with O_NOFOLLOW.
 *
 * Folders: a folder the user names (-o DIR) is taken as given, links and
 * all (outfile_user_dir); a folder the tool names inside it (plots/, a
 * suite case's folder) must be a real folder, never a link
 * (outfile_tool_dir), so that nothing planted in an output folder sends a
 * write elsewhere. A folder is only ever removed by the code that created
 * it. */
#ifndef KV_OUTFILE_H
#define KV_OUTFILE_H

#include <stdbool.h>
#include <stdio.h>
#include "err.h"

typedef struct {
    FILE *f;          /* write here between open and commit/abort */
    char *path;       /* the target (owned copy) */
    char *tmp;        /* the temporary file's name in its folder (owned) */
    int fd;           /* outfile_open_fd's descriptor (-1 otherwise) */
    int dirfd;        /* the target's folder, held open (-1 when empty) */
    const char *name; /* the target's name in that folder (inside path) */
    int live;         /* its slot among the files a signal removes (-1: none) */
} outfile;

/* Turns the record of inputs on: a program's main() does, as one process
 * is one run. Off (the default) for library users and tests, whose one
 * process reads and rewrites files across many runs. */
void outfile_track_inputs(bool on);

/* Notes a file this run reads (by device and inode, following links, as
 * the read did): no output may then replace it. A missing path is
 * ignored; nothing is noted while tracking is off. Thread-safe. */
void outfile_note_input(const char *path);
void outfile_note_input_fd(int fd);

/* Forgets every noted input (tests; a process running several runs). */
void outfile_forget_inputs(void);

/* Whether a file may be written at path: 0 when path is absent or a
 * regular file that is none of the noted inputs; else -1 with e =
 * "PATH: is a symlink; ..." / "PATH: is one of this run's inputs (...)".
 * Links are not followed (lstat). */
int outfile_check_target(const char *path, kv_err *e);

/* Creates the temporary file beside path (".NAME.XXXXXX" in path's
 * folder, mode 0666 less the umask) after outfile_check_target. Returns 0
 * with o->f open, or -1 with e = "PATH: ..." and o empty. */
int outfile_open(outfile *o, const char *path, kv_err *e);

/* The same with a raw descriptor (o->f stays NULL; write to *fd, do not
 * close it: commit and abort do): for writers that pwrite or fallocate. */
int outfile_open_fd(outfile *o, const char *path, int *fd, kv_err *e);

/* Flushes, fsyncs and closes the temporary file, checks the target again
 * and renames the temporary file over it. On any error the temporary file
 * is removed, the target is left as it was, and e = "PATH: why". o is
 * empty afterwards either way. */
int outfile_commit(outfile *o, kv_err *e);

/* Moves a finished file the run itself made (from, in a private scratch
 * folder on the same file system: a program's output) to the target
 * under the same rule as outfile_commit. On refusal from is removed and e
 * says why. */
int outfile_place(const char *from, const char *path, kv_err *e);

/* Closes and removes the temporary file; accepts an empty o. */
void outfile_abort(outfile *o);

/* The folder a user named for outputs: created when missing (its parent
 * must exist), else it must be a folder (a link to one is the user's
 * choice and is followed). *created (may be NULL) says whether this call
 * made it. */
int outfile_user_dir(const char *path, bool *created, kv_err *e);

/* A folder the tool names inside an output folder: created when missing;
 * when present it must be a real folder, not a link to one. */
int outfile_tool_dir(const char *path, bool *created, kv_err *e);

/* SIGINT, SIGTERM and SIGHUP (where they are at their default) remove
 * every temporary file still open here, then end the process as the
 * signal would (128 + the signal to the shell): an interrupted write
 * leaves nothing behind. Called once by main(). */
void outfile_clean_on_signal(void);

/* Whether paths a and b name the same file: the same device and inode
 * when both exist, else the same path once each one's folder is resolved
 * (realpath) - two outputs not yet written can still collide. */
bool outfile_same(const char *a, const char *b);

/* A word for what a stat mode says a path is ("a device", "a FIFO", "a
 * directory", ...): for refusals of inputs and outputs that are not regular
 * files (infile.c's and the dump writer's alike). */
const char *outfile_kind(unsigned mode);

#endif
