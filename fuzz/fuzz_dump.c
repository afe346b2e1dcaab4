// fuzz-sources: model/err.c model/observer.c model/config.c model/outfile.c model/infile.c dump/dump.c dump/reader.c dump/direct.c dump/validate.c dump/settings.c model/text.c model/families/*.c model/kernels.c model/kernels_x86.c model/pool.c
// fuzz-pkgs: hdf5 libxxhash
/* fuzz_dump.c — libFuzzer target for the dump reader and validator: the
 * input is written to a temporary file, validated (every violation is a
 * sentence; -1 only with a message naming the file), opened, and every
 * dataset the reader reports is read back. Reads are skipped when the
 * file claims far more data than its size could hold (unallocated chunks
 * read as fill values), so a 4 KiB input cannot ask for gigabytes.
 *
 * libhdf5 1.10.8 leaks on some error paths while decoding malformed
 * metadata (found by this target: H5Fopen of a corrupt root object header
 * leaks what H5C_protect allocated). Those leaks are libhdf5's, so they
 * are suppressed by the name of its function; ours are still reported.
 * libhdf5 has no frame pointers, so stacks are taken the slow way, or the
 * suppression would never see the function name.
 *
 * libhdf5 also loops forever on some corrupt variable-length strings
 * (HDFGroup/hdf5 issue 1707); kvdiff guards its reads with a time limit
 * (dump_hang_guard) and reports such a file as damaged. Here the guard
 * saves the input as build-fuzz/dump-libhdf5-hang.h5 and ends the run
 * quietly: libhdf5's state after such a loop is not worth fuzzing on, and
 * tests/data/damaged/ keeps one such file as a regression test. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "dump/dump.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
const char *__lsan_default_suppressions(void);
const char *__asan_default_options(void);

const char *__asan_default_options(void)
{
    return "fast_unwind_on_malloc=0";
}

const char *__lsan_default_suppressions(void)
{
    return "leak:H5C_protect\n";
}

/* SIGALRM context: open/read/write only. */
static int on_hang(const char *path)
{
    static const char note[] = "fuzz_dump: libhdf5 loops on this input (an upstream bug); "
                               "saved as build-fuzz/dump-libhdf5-hang.h5, stopping\n";
    int in = open(path, O_RDONLY), out = open("build-fuzz/dump-libhdf5-hang.h5",
                                               O_WRONLY | O_CREAT | O_TRUNC, 0644);
    char buf[4096];
    ssize_t n;
    while (in >= 0 && out >= 0 && (n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)n) != n)
            break;
    if (write(STDERR_FILENO, note, sizeof note - 1) < 0)
        return 0;
    return 0;
}

/* In the child that pre-reads a file's strings (dump.h): libhdf5 crashing
 * there is the expected outcome on some damaged files, so the child dies
 * by the signal itself, and a sanitizer report ends it without libFuzzer
 * saving the input as our crash. */
void __sanitizer_set_death_callback(void (*callback)(void));

static void child_dies_quietly(void)
{
    _exit(3);
}

static void preflight_child(void)
{
    static const int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++)
        signal(sigs[i], SIG_DFL);
    __sanitizer_set_death_callback(child_dies_quietly);
}

static void check_line(void *ctx, const char *line)
{
    (void)ctx;
    if (!line[0])
        abort();  /* every report says something */
}

/* Bytes a read of rows x cols elements of esize may take. */
static bool affordable(int64_t rows, int64_t cols, size_t esize, size_t file_size)
{
    double bytes = (double)rows * (double)cols * (double)esize;
    return rows >= 0 && cols >= 1 && bytes <= 64.0 * (double)file_size + 65536.0;
}

static void read_stage(const dump_file *f, int layer, kv_stage st, size_t file_size)
{
    kv_err e;
    dump_dataset_info di = dump_stage_info(f, layer, st);
    if (!di.present || !affordable(di.rows, di.cols, 8, file_size))
        return;
    size_t n = (size_t)di.rows * (size_t)di.cols;
    if (!dump_is_fingerprint(f)) {
        float *rows = malloc(n * 4 + 4);
        if (rows)
            dump_read_rows(f, layer, st, 0, di.rows, rows, &e);
        free(rows);
    }
    /* the row hash index, as written and checked against the hashes */
    dump_stage_digest g = dump_digest(f, layer, st, false);
    if (g.present)
        dump_digest(f, layer, st, true);
    dump_dataset_info hi = dump_hash_info(f, layer, st);
    if (hi.present && affordable(hi.rows, 2, 8, file_size)) {
        uint64_t *h = malloc((size_t)hi.rows * 8 + 8);
        float *s = malloc((size_t)hi.rows * 8 + 8);
        if (h && s)
            dump_read_hashes(f, layer, st, 0, hi.rows, h, s, &e);
        free(h);
        free(s);
    }
}

/* The checks a comparer makes first: every refusal names the file. */
static void check_refusal(const dump_file *f, int rc, const kv_err *e)
{
    if (rc < 0 && !strstr(e->msg, dump_path(f))) {
        fprintf(stderr, "check error without the file name: %s\n", e->msg);
        abort();
    }
}

static void read_everything(const dump_file *f, size_t file_size)
{
    kv_err e;
    kv_config c;
    dump_model_config(f, &c, &e);
    check_refusal(f, dump_check_file(f, &e), &e);
    for (int l = -1; l < dump_n_layers(f); l++)
        for (int st = 0; st < STAGE_COUNT; st++)
            if ((st >= STAGE_LAYER_COUNT) == (l == -1))
                check_refusal(f, dump_check_stage(f, l, (kv_stage)st, &e), &e);
    int64_t nt = dump_n_tokens(f);
    if (affordable(nt, 1, 4, file_size)) {
        int32_t *tok = malloc((size_t)nt * 4 + 4);
        if (tok)
            dump_read_tokens(f, tok, &e);
        free(tok);
    }
    for (int l = -1; l < dump_n_layers(f); l++)
        for (int st = 0; st < STAGE_COUNT; st++)
            if ((st >= STAGE_LAYER_COUNT) == (l == -1))
                read_stage(f, l, (kv_stage)st, file_size);
    dump_dataset_info oi = dump_output_info(f);
    int k = dump_output_k(f);
    if (oi.present && k > 0 && affordable(oi.rows, k, 4, file_size)) {
        size_t n = (size_t)oi.rows * (size_t)k;
        float *lse = malloc((size_t)oi.rows * 4 + 4), *vals = malloc(n * 4 + 4);
        int32_t *ids = malloc(n * 4 + 4);
        if (lse && vals && ids)
            dump_read_output(f, 0, oi.rows, lse, ids, vals, &e);
        free(lse);
        free(vals);
        free(ids);
    }
    (void)dump_is_complete(f);
    (void)dump_attr_int(f, "seed", 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    kv_err e;
    snprintf(path, sizeof path, "/tmp/fuzz_dump_%ld.h5", (long)getpid());
    dump_hang_guard(1, on_hang);
    dump_preflight_child_hook(preflight_child);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(data, 1, size, fp) != size) {
        if (fp)
            fclose(fp);
        return 0;
    }
    fclose(fp);
    e.msg[0] = 0;
    if (dump_validate(path, check_line, NULL, &e) < 0 && !strstr(e.msg, path)) {
        fprintf(stderr, "validate error without the file name: %s\n", e.msg);
        abort();
    }
    dump_file *f = dump_open(path, &e);
    if (!f && !strstr(e.msg, path)) {
        fprintf(stderr, "open error without the file name: %s\n", e.msg);
        abort();
    }
    if (f)
        read_everything(f, size);
    dump_file_close(f);
    unlink(path);
    return 0;
}
