/* testutil.h — helpers shared by the tests: an observer that captures
 * every emitted row, temporary folders, running the kvdiff binary. */
#ifndef KV_TESTUTIL_H
#define KV_TESTUTIL_H

#include <stdint.h>
#include <sys/types.h>
#include "model/observer.h"
#include "model/config.h"

/* Captures rows of every (stage, layer) for positions 0..T-1. */
typedef struct {
    kv_observer base;
    int T;
    float *rows[STAGE_COUNT][KV_MAX_LAYERS + 1]; /* [stage][layer + 1] (T, ncols) */
    int ncols[STAGE_COUNT][KV_MAX_LAYERS + 1];
    int32_t tokens[1 << 14];
    int n_tokens;
} capture;

capture *capture_new(int T);
void capture_free(capture *c);
/* Captured (T, ncols) rows or NULL when nothing was emitted. */
const float *capture_get(const capture *c, kv_stage st, int layer, int *ncols);

/* mkdtemp under /tmp; returns a static-lifetime copy in buf. */
char *test_tmpdir(char *buf, size_t n);
/* rm -rf of a test's temp folder. */
void test_rmtree(const char *dir);
/* Copies the file from to to (created or replaced): 0, -1 on any error. */
int test_copy_file(const char *from, const char *to);

/* Runs the kvdiff binary (KVDIFF_BIN or ./kvdiff) with the given
 * arguments (a shell-quoted string); captures stdout+stderr into out
 * (NUL-terminated, truncated to n) and returns the exit code. */
int test_run_cli(const char *args, char *out, size_t n);
/* The same for any program bin (a path). */
int test_run_program(const char *bin, const char *args, char *out, size_t n);

/* Records dir/ref.h5, a whole reference run of tiny-gemma3 on a 200-token
 * prompt, and dir/part.h5, the chunked engine on the same prompt cut short
 * by a 3 MB file size limit (the run is 6 MB; its first 12 prefill chunks
 * of 5, positions 0..59, reach the file). Returns 0, or -1 when a run did
 * not go that way. */
int test_record_cut_short(const char *dir);

/* Starts `kvdiff run` of tiny-gemma3 (a 96-token prompt, 4000 decode
 * steps) writing the dump path, and returns its pid once the file holds
 * more than 4 MB (the writer locks the path before writing anything).
 * Nothing is timed: it waits for the file or for the run's end, so a busy
 * machine only makes it slower. Returns -1 when the run ended first. */
pid_t test_start_long_run(const char *path);

/* max |a - b| / max |b| over n values. */
double test_rel_err(const float *a, const float *b, size_t n);

/* The stages one layer of a model of config c has (the per-layer input
 * stages only with per-layer inputs; k and v counted). */
int test_layer_stages(const kv_config *c);

#endif
