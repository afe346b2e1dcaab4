/* dump.c — what the writer, reader and validator share: HDF5 error
 * messages, opening a file for reading (SWMR-flagged ones too), attribute
 * readers, stage widths and the model_config parser (dump_internal.h). */
#include "dump_internal.h"
#include "../model/family.h"
#include "../model/outfile.h"

#include <errno.h>
#include <poll.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>

/* ------------------------------------------------------------------ */
/* Errors                                                               */

/* An external link is followed into the file it names, by any call that
 * walks a path (H5Dopen, H5Gopen, H5Oopen): a dump would read another
 * file's bytes (a system file's, printed as floats) and hide it. libhdf5
 * lets a program replace a link class's callbacks, the built-in external
 * class's too, so the class is replaced, process-wide, by one whose
 * traversal fails: such a link still lists and says where it points
 * (H5Lget_info), but no path through it opens. kvdiff writes none. */
static hid_t refuse_external(const char *name, hid_t cur_group, const void *val, size_t size,
                             hid_t lapl, hid_t dxpl)
{
    (void)name, (void)cur_group, (void)val, (void)size, (void)lapl, (void)dxpl;
    return H5I_INVALID_HID;
}

void dump_h5_quiet(void)
{
    static bool done;
    if (!done) {
        H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
        static const H5L_class_t no_external = {
            .version = H5L_LINK_CLASS_T_VERS, .id = H5L_TYPE_EXTERNAL,
            .comment = "external link (kvdiff follows none)", .trav_func = refuse_external};
        H5Lregister(&no_external);
        /* A filter libhdf5 does not know is looked for as a plugin in
         * HDF5_PLUGIN_PATH: a dump would make kvdiff load and run code. */
        H5PLset_loading_state(0);
        H5Eclear2(H5E_DEFAULT);
        done = true;
    }
}

/* ------------------------------------------------------------------ */
/* Listing a group                                                      */

typedef struct {
    dump_link *links;
    size_t n, cap;
    bool bad;
} link_list;

static herr_t collect_link(hid_t g, const char *name, const H5L_info_t *info, void *data)
{
    link_list *l = data;
    (void)g;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        dump_link *p = realloc(l->links, cap * sizeof *p);
        if (!p)
            return l->bad = true, -1;
        l->links = p;
        l->cap = cap;
    }
    if (!(l->links[l->n].name = strdup(name)))
        return l->bad = true, -1;
    l->links[l->n++].type = info->type;
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const dump_link *)a)->name, ((const dump_link *)b)->name);
}

int dump_h5_list(hid_t g, dump_link **out, size_t *n)
{
    link_list l = {0};
    /* Native order walks the name index itself. In name order, libhdf5
     * 1.10 first copies every link of a large group into a table and, when
     * a damaged file has fewer links than it says, frees entries of that
     * table it never filled (H5G__link_release_table: an invalid free,
     * heap corruption in a release build). */
    const herr_t rc = H5Literate(g, H5_INDEX_NAME, H5_ITER_NATIVE, NULL, collect_link, &l);
    H5Eclear2(H5E_DEFAULT);
    if (rc < 0 || l.bad) {
        dump_links_free(l.links, l.n);
        *out = NULL;
        *n = 0;
        return -1;
    }
    if (l.n > 1)
        qsort(l.links, l.n, sizeof *l.links, by_name);
    *out = l.links;
    *n = l.n;
    return 0;
}

void dump_links_free(dump_link *links, size_t n)
{
    for (size_t i = 0; links && i < n; i++)
        free(links[i].name);
    free(links);
}

typedef struct {
    char innermost[512];
    int err_no;
} stack_walk;

/* Walked upward: entry 0 is where the error was first detected. A system
 * call failure shows up as "errno = N" in the description of some entry. */
static herr_t walk_entry(unsigned n, const H5E_error2_t *err, void *data)
{
    stack_walk *w = data;
    const char *d = err->desc ? err->desc : "";
    if (n == 0)
        snprintf(w->innermost, sizeof w->innermost, "%s", d);
    const char *en = strstr(d, "errno = ");
    if (en && w->err_no == 0)
        w->err_no = atoi(en + 8);
    return 0;
}

void dump_h5_detail(char *buf, size_t n, int *errno_out)
{
    stack_walk w = {.innermost = "", .err_no = 0};
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, walk_entry, &w);
    H5Eclear2(H5E_DEFAULT);
    if (w.err_no > 0)
        snprintf(buf, n, "%s", strerror(w.err_no));
    else
        snprintf(buf, n, "%s", w.innermost[0] ? w.innermost : "HDF5 error (no detail)");
    if (errno_out)
        *errno_out = w.err_no;
}

void dump_h5_close(hid_t id)
{
    if (id < 0)
        return;
    hid_t saved = H5Eget_num(H5E_DEFAULT) > 0 ? H5Eget_current_stack() : H5I_INVALID_HID;
    H5E_BEGIN_TRY {
        switch (H5Iget_type(id)) {
        case H5I_FILE: H5Fclose(id); break;
        case H5I_GROUP: H5Gclose(id); break;
        case H5I_DATASET: H5Dclose(id); break;
        case H5I_ATTR: H5Aclose(id); break;
        case H5I_DATASPACE: H5Sclose(id); break;
        case H5I_DATATYPE: H5Tclose(id); break;
        case H5I_GENPROP_LST: H5Pclose(id); break;
        default: break;
        }
    } H5E_END_TRY;
    if (saved >= 0)
        H5Eset_current_stack(saved);
}

int dump_h5_fail(kv_err *e, const char *path, const char *what)
{
    char detail[512];
    dump_h5_detail(detail, sizeof detail, NULL);
    return kv_errf(e, "%s: %s: %s", path, what, detail);
}

/* ------------------------------------------------------------------ */
/* Opening for reading                                                  */

/* Turns HDF5's "truncated file: eof = A, sblock->base_addr = B,
 * stored_eof = C" into words; other details pass through. */
static int open_error(kv_err *e, const char *path, const char *detail)
{
    long long eof, base, stored;
    const char *t = strstr(detail, "truncated file");
    if (t && sscanf(t, "truncated file: eof = %lld, sblock->base_addr = %lld, stored_eof = %lld",
                    &eof, &base, &stored) == 3)
        return kv_errf(e, "%s: truncated file (%lld bytes; its HDF5 superblock says %lld)", path,
                       eof, stored);
    if (t)
        return kv_errf(e, "%s: truncated file (%s)", path, detail);
    return kv_errf(e, "%s: cannot open as HDF5: %s", path, detail);
}

/* ------------------------------------------------------------------ */
/* Hang guard                                                           */

static hid_t open_read(const char *path, kv_err *e);

static void (*preflight_hook)(void);

void dump_preflight_child_hook(void (*fn)(void))
{
    preflight_hook = fn;
}

static unsigned guard_seconds;
static int (*guard_hook)(const char *path);
static char guard_path[1024];

void dump_child_begin(void)
{
    alarm(0);
    struct itimerval off;
    memset(&off, 0, sizeof off);
    setitimer(ITIMER_PROF, &off, NULL);
    guard_seconds = 0;
    /* Whatever it says as it dies is not the user's business. */
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
        if (null > STDERR_FILENO)
            close(null);
    }
}

int dump_child_pipe(int p[2])
{
    int raw[2];
    if (pipe(raw) != 0)
        return -1;
    p[0] = fcntl(raw[0], F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
    p[1] = fcntl(raw[1], F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
    close(raw[0]);
    close(raw[1]);
    if (p[0] >= 0 && p[1] >= 0)
        return 0;
    if (p[0] >= 0)
        close(p[0]);
    if (p[1] >= 0)
        close(p[1]);
    return -1;
}

static void on_guard_alarm(int sig)
{
    (void)sig;
    _exit(guard_hook ? guard_hook(guard_path) : 2);
}

/* The guard counts the process's CPU time (ITIMER_PROF), not the clock:
 * a loop inside libhdf5 burns CPU, a busy machine only slows a sound
 * read down, and no verdict may depend on how busy the machine is. */
void dump_hang_guard(unsigned seconds, int (*on_hang)(const char *path))
{
    guard_seconds = seconds;
    guard_hook = on_hang;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = seconds ? on_guard_alarm : SIG_DFL;
    sigaction(SIGPROF, &sa, NULL);
}

static void guard_set(unsigned seconds)
{
    struct itimerval it;
    memset(&it, 0, sizeof it);
    it.it_value.tv_sec = seconds;
    setitimer(ITIMER_PROF, &it, NULL);
}

static void guard_begin(void)
{
    if (guard_seconds)
        guard_set(guard_seconds);
}

static void guard_end(void)
{
    if (guard_seconds)
        guard_set(0);
}

static char *read_vlstr(hid_t a, hid_t ftype);

/* The preflight child's verdicts besides a crash or a loop: its exit
 * status, with a line on its pipe saying which string. */
enum { PF_EXIT_LONG = 3 };

/* In the preflight child: a string attribute past DUMP_MAX_STR_ATTR ends
 * the child at once (before it is read again), telling the parent which
 * one on the pipe. where: "the root" or "/layers/3". */
static void pf_length(int out, const char *where, const char *name, unsigned long long len)
{
    if (len <= (unsigned long long)DUMP_MAX_STR_ATTR)
        return;
    char line[512];
    int n = snprintf(line, sizeof line, "%s attribute %s is a string of %llu bytes, past the "
                     "limit of %lld bytes (%lld MiB) kvdiff reads", where, name, len,
                     DUMP_MAX_STR_ATTR, DUMP_MAX_STR_ATTR >> 20);
    if (n > 0 && write(out, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1) < 0)
        _exit(2);
    _exit(PF_EXIT_LONG);
}

typedef struct {
    const char *where;   /* "the root", "/layers/3" */
    int out;             /* the pipe to the parent */
} pf_ctx;

/* The string attributes kvdiff reads besides the root's (those are read
 * by name first): a layer group's "attention". Only these are held to
 * DUMP_MAX_STR_ATTR; another program's own attributes may be longer. */
static bool pf_read_by_kvdiff(const char *name)
{
    return !strcmp(name, "attention");
}

/* Preflight, in a child process: variable-length string attributes read
 * as the reader would. */
static herr_t pf_attr(hid_t loc, const char *name, const H5A_info_t *ai, void *op)
{
    (void)ai;
    const pf_ctx *ctx = op;
    hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
    hid_t t = a >= 0 ? H5Aget_type(a) : H5I_INVALID_HID;
    hid_t sp = a >= 0 ? H5Aget_space(a) : H5I_INVALID_HID;
    if (t >= 0 && sp >= 0 && H5Tget_class(t) == H5T_STRING &&
        H5Sget_simple_extent_npoints(sp) == 1) {
        const bool limited = ctx && pf_read_by_kvdiff(name);
        if (H5Tis_variable_str(t) > 0) {
            char *v = read_vlstr(a, t);
            if (v && limited)
                pf_length(ctx->out, ctx->where, name, strlen(v));
            free(v);
        } else if (limited) {
            pf_length(ctx->out, ctx->where, name, H5Tget_size(t));
        }
    }
    H5E_BEGIN_TRY {
        H5Sclose(sp);
        H5Tclose(t);
        H5Aclose(a);
    } H5E_END_TRY;
    return 0;
}

/* A member of /layers: its own attributes (the reader reads "attention"),
 * and with walk, its members listed as validate lists them. */
static void pf_member(hid_t loc, const char *where, const char *name, bool walk, int out)
{
    hid_t o = H5Oopen(loc, name, H5P_DEFAULT);
    if (o >= 0) {
        char path[300];
        snprintf(path, sizeof path, "%s/%s", where, name);
        pf_ctx ctx = {path, out};
        H5Aiterate2(o, H5_INDEX_NAME, H5_ITER_INC, NULL, pf_attr, &ctx);
        dump_link *links;
        size_t n;
        if (walk && H5Iget_type(o) == H5I_GROUP && dump_h5_list(o, &links, &n) == 0)
            dump_links_free(links, n);
        H5Oclose(o);
    }
}

/* libhdf5 crashes or loops forever on some damaged files (corrupt global
 * heaps under variable-length strings: HDFGroup/hdf5 issue 1707, and a
 * memcpy of a corrupt length in H5HG_read). Every such string kvdiff reads
 * (the root's, and those of the groups under /layers) is read once in a
 * child process first; a child that crashes, or spends 5 s of CPU time
 * (or the guard's time, if shorter) on it, marks the file damaged, and
 * the reads that follow are safe because they read the same bytes.
 *
 * Nothing here depends on how busy the machine is: the limit is CPU time
 * (RLIMIT_CPU: reading a sound file's strings takes milliseconds of it),
 * and a child killed from outside (no verdict on the file) is tried again
 * before anything is said. A child blocked without using CPU (no damage
 * seen does that) is stopped after a minute as a backstop. */
enum { PF_SOUND, PF_CRASH, PF_LOOP, PF_STUCK, PF_UNSURE, PF_LONG };

/* why: the child's line for PF_LONG (which string, how long). */
static int preflight_once(const char *path, bool walk, unsigned cpu_limit, char *why,
                          size_t why_n)
{
    fflush(NULL);
    /* The child holds the pipe's write end until it exits: the parent
     * wakes when it does, not on a timer. */
    int done[2];
    if (dump_child_pipe(done) != 0)
        return PF_SOUND;   /* cannot check: read as usual */
    pid_t pid = fork();
    if (pid < 0) {
        close(done[0]);
        close(done[1]);
        return PF_SOUND;
    }
    if (pid == 0) {
        close(done[0]);
        dump_child_begin();
        struct rlimit cpu = {cpu_limit, cpu_limit + 1};
        setrlimit(RLIMIT_CPU, &cpu);   /* past it: SIGXCPU */
        signal(SIGXCPU, SIG_DFL);
        if (preflight_hook)
            preflight_hook();
        kv_err ignored;
        hid_t f = open_read(path, &ignored);   /* as the parent opened it */
        if (f >= 0) {
            /* The root's strings by name first, as the reader asks for them:
             * an iteration can stop early on damage elsewhere. */
            static const char *const names[] = {"format", "mode", "engine", "engine_settings",
                                                "model_config", "weight_fingerprint",
                                                "status", "tool_version"};
            for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
                char *v = NULL;
                if (dump_h5_attr_str(f, names[i], &v) == 0) {
                    pf_length(done[1], "the root", names[i], strlen(v));
                    free(v);
                }
            }
            H5Aiterate2(f, H5_INDEX_NAME, H5_ITER_INC, NULL, pf_attr, NULL);
            /* Then the groups under /layers, whose string attributes are the
             * only others kvdiff reads (datasets carry integers). */
            dump_link *links;
            size_t n;
            if (H5Lexists(f, "layers", H5P_DEFAULT) > 0) {
                hid_t g = H5Gopen2(f, "layers", H5P_DEFAULT);
                if (g >= 0 && dump_h5_list(g, &links, &n) == 0) {
                    for (size_t i = 0; i < n; i++)
                        pf_member(g, "/layers", links[i].name, walk, done[1]);
                    dump_links_free(links, n);
                }
                if (g >= 0)
                    H5Gclose(g);
            }
            if (walk && H5Lexists(f, "model", H5P_DEFAULT) > 0)
                pf_member(f, "", "model", walk, done[1]);
        }
        _exit(0);
    }
    close(done[1]);
    /* A backstop only: the CPU limit decides. */
    const int wall_ms = 60000;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        const long waited = (t.tv_sec - t0.tv_sec) * 1000L + (t.tv_nsec - t0.tv_nsec) / 1000000L;
        struct pollfd p = {.fd = done[0], .events = POLLIN};
        const int r = waited < wall_ms ? poll(&p, 1, (int)(wall_ms - waited)) : 0;
        if (r < 0 && errno == EINTR)
            continue;
        if (r > 0)
            break;   /* closed: the child is gone (or its line came first) */
        close(done[0]);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return r < 0 ? PF_SOUND : PF_STUCK;
    }
    /* The child's line, if any: it exits right after writing it. */
    size_t got = 0;
    for (;;) {
        ssize_t k = got + 1 < why_n ? read(done[0], why + got, why_n - 1 - got) : 0;
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    if (why_n)
        why[got] = 0;
    close(done[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) {
        if (errno != EINTR)
            return PF_SOUND;
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == PF_EXIT_LONG && got > 0)
        return PF_LONG;
    if (WIFEXITED(st))
        return WEXITSTATUS(st) == 0 ? PF_SOUND : PF_CRASH;
    if (!WIFSIGNALED(st))
        return PF_SOUND;
    switch (WTERMSIG(st)) {
    case SIGXCPU: return PF_LOOP;
    case SIGSEGV: case SIGBUS: case SIGABRT: case SIGFPE: case SIGILL: case SIGTRAP:
        return PF_CRASH;
    default: return PF_UNSURE;   /* SIGKILL from outside (the OOM killer), ... */
    }
}

static int preflight(const char *path, bool walk, kv_err *e)
{
    const unsigned limit = guard_seconds && guard_seconds < 5 ? guard_seconds : 5;
    int v = PF_UNSURE;
    char why[512] = "";
    for (int attempt = 0; attempt < 3 && v == PF_UNSURE; attempt++)
        v = preflight_once(path, walk, limit, why, sizeof why);
    if (v == PF_LONG)
        return kv_errf(e, "%s: %s", path, why);
    if (v == PF_CRASH)
        return kv_errf(e, "%s: the HDF5 library crashes reading this file's metadata (a "
                          "damaged file)", path);
    if (v == PF_LOOP)
        return kv_errf(e, "%s: the HDF5 library does not return from reading this file's "
                          "metadata (a damaged file: libhdf5 loops on some corrupt "
                          "variable-length strings)", path);
    if (v == PF_STUCK)
        return kv_errf(e, "%s: the HDF5 library does not return from reading this file's "
                          "metadata (a damaged file: blocked for a minute without using CPU)",
                       path);
    if (v == PF_UNSURE)
        return kv_errf(e, "%s: reading this file's metadata was killed from outside three "
                          "times; its strings were not checked and it is not read", path);
    return 0;
}

static hid_t open_checked(const char *path, bool walk, kv_err *e)
{
    snprintf(guard_path, sizeof guard_path, "%s", path);
    guard_begin();
    hid_t f = open_read(path, e);
    guard_end();
    if (f >= 0 && preflight(path, walk, e) < 0) {
        H5Fclose(f);
        return H5I_INVALID_HID;
    }
    return f;
}

hid_t dump_h5_open_read(const char *path, kv_err *e)
{
    return open_checked(path, false, e);
}

hid_t dump_h5_open_walk(const char *path, kv_err *e)
{
    return open_checked(path, true, e);
}

static hid_t open_read(const char *path, kv_err *e)
{
    struct stat st;
    char first[512], second[512];
    dump_h5_quiet();
    if (stat(path, &st) != 0)
        return kv_errf(e, "%s: %s", path, strerror(errno)), H5I_INVALID_HID;
    outfile_note_input(path);   /* a dump read is never an output of the run */
    if (S_ISDIR(st.st_mode))
        return kv_errf(e, "%s: is a folder, not a dump", path), H5I_INVALID_HID;
    /* Before the size: a FIFO or a device has none, and is not "empty". */
    if (!S_ISREG(st.st_mode))
        return kv_errf(e, "%s: is %s, not a regular file (a dump is an HDF5 file on disk)",
                       path, outfile_kind(st.st_mode)), H5I_INVALID_HID;
    if (st.st_size == 0)
        return kv_errf(e, "%s: empty file (not an HDF5 file)", path), H5I_INVALID_HID;
    htri_t is = H5Fis_hdf5(path);
    if (is == 0)
        return kv_errf(e, "%s: not an HDF5 file", path), H5I_INVALID_HID;
    if (is < 0)
        return dump_h5_fail(e, path, "cannot read"), H5I_INVALID_HID;
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f >= 0)
        return f;
    dump_h5_detail(first, sizeof first, NULL);
    /* A writer killed in SWMR mode leaves the superblock marked "open for
     * writing"; a SWMR reader may still open it, and sees every flushed row.
     * One read attempt: a SWMR reader retries bad checksums (a live writer
     * may be mid-write) for seconds, and our writer is dead or done. */
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl >= 0 && H5Pset_metadata_read_attempts(fapl, 1) >= 0)
        f = H5Fopen(path, H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, fapl);
    dump_h5_close(fapl);
    if (f >= 0)
        return f;
    dump_h5_detail(second, sizeof second, NULL);
    bool flags_refused = strstr(first, "already open") || strstr(first, "consistency flags");
    open_error(e, path, flags_refused ? second : first);
    return H5I_INVALID_HID;
}

/* ------------------------------------------------------------------ */
/* Storage                                                              */

int dump_h5_storage(hid_t d, int *filter)
{
    hid_t dcpl = H5Dget_create_plist(d);
    int problem = DUMP_STORAGE_OK;
    *filter = 0;
    if (dcpl < 0) {
        H5Eclear2(H5E_DEFAULT);
        return DUMP_STORAGE_OK;   /* what cannot be read says so when read */
    }
    const int nf = H5Pget_nfilters(dcpl);
    if (H5Pget_layout(dcpl) == H5D_VIRTUAL)
        problem = DUMP_STORAGE_VIRTUAL;
    else if (H5Pget_external_count(dcpl) > 0)
        problem = DUMP_STORAGE_EXTERNAL;
    for (int i = 0; problem == DUMP_STORAGE_OK && i < nf; i++) {
        unsigned flags = 0, config = 0;
        size_t n = 0;
        const H5Z_filter_t id = H5Pget_filter2(dcpl, (unsigned)i, &flags, &n, NULL, 0, NULL,
                                               &config);
        /* Only the filters kvdiff writes: another one is code of the
         * program that wrote the file (a plugin), which kvdiff never runs.
         * Its id is not even asked of libhdf5 (asking may load it). */
        if (id != H5Z_FILTER_DEFLATE && id != H5Z_FILTER_SHUFFLE) {
            problem = DUMP_STORAGE_FILTER;
            *filter = id < 0 ? -1 : (int)id;
        }
    }
    dump_h5_close(dcpl);
    H5Eclear2(H5E_DEFAULT);
    return problem;
}

const char *dump_storage_words(int problem, int filter, char *buf, size_t n)
{
    if (problem == DUMP_STORAGE_EXTERNAL)
        snprintf(buf, n, "keeps its data in another file (external storage): kvdiff reads "
                 "only the dump's own bytes");
    else if (problem == DUMP_STORAGE_VIRTUAL)
        snprintf(buf, n, "is a virtual dataset (its rows live in other files): kvdiff reads "
                 "only the dump's own bytes");
    else if (filter < 0)
        snprintf(buf, n, "needs an HDF5 filter its creation properties do not name");
    else
        snprintf(buf, n, "needs HDF5 filter %d: kvdiff reads only deflate and shuffle (the "
                 "filters it writes) and loads no plugin", filter);
    return buf;
}

bool dump_h5_storage_problem(hid_t d, char *why, size_t n)
{
    int filter, p = dump_h5_storage(d, &filter);
    if (p != DUMP_STORAGE_OK)
        dump_storage_words(p, filter, why, n);
    return p != DUMP_STORAGE_OK;
}

/* ------------------------------------------------------------------ */
/* Attributes                                                           */

hid_t dump_h5_vlstr(void)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    if (t < 0)
        return H5I_INVALID_HID;
    if (H5Tset_size(t, H5T_VARIABLE) < 0 || H5Tset_cset(t, H5T_CSET_UTF8) < 0) {
        H5Tclose(t);
        return H5I_INVALID_HID;
    }
    return t;
}

/* Opens a single-valued attribute of the given class; fills *type. */
static hid_t open_scalar_attr(hid_t obj, const char *name, H5T_class_t want, hid_t *type)
{
    hid_t a = H5I_INVALID_HID, s = H5I_INVALID_HID;
    *type = H5I_INVALID_HID;
    if (H5Aexists(obj, name) <= 0)
        return H5I_INVALID_HID;
    if ((a = H5Aopen(obj, name, H5P_DEFAULT)) < 0 || (*type = H5Aget_type(a)) < 0 ||
        (s = H5Aget_space(a)) < 0)
        goto error;
    H5T_class_t cls = H5Tget_class(*type);
    bool ok_class = cls == want || (want == H5T_FLOAT && cls == H5T_INTEGER);
    if (!ok_class || H5Sget_simple_extent_npoints(s) != 1)
        goto error;
    H5Sclose(s);
    return a;
error:
    H5E_BEGIN_TRY {
        H5Sclose(s);
        H5Tclose(*type);
        H5Aclose(a);
    } H5E_END_TRY;
    *type = H5I_INVALID_HID;
    H5Eclear2(H5E_DEFAULT);
    return H5I_INVALID_HID;
}

static char *read_vlstr(hid_t a, hid_t ftype)
{
    hid_t mt = H5Tcopy(H5T_C_S1);
    char *v = NULL, *out = NULL;
    if (mt >= 0 && H5Tset_size(mt, H5T_VARIABLE) >= 0 &&
        H5Tset_cset(mt, H5Tget_cset(ftype)) >= 0 && H5Aread(a, mt, &v) >= 0) {
        out = strdup(v ? v : "");
        H5free_memory(v);
    }
    if (mt >= 0)
        H5Tclose(mt);
    return out;
}

static char *read_fixed_str(hid_t a, hid_t ftype)
{
    size_t size = H5Tget_size(ftype);
    hid_t mt = H5Tcopy(ftype);
    char *out = size ? calloc(1, size + 1) : NULL;
    if (mt < 0 || !out || H5Tset_strpad(mt, H5T_STR_NULLTERM) < 0 ||
        H5Tset_size(mt, size + 1) < 0 || H5Aread(a, mt, out) < 0) {
        free(out);
        out = NULL;
    }
    if (mt >= 0)
        H5Tclose(mt);
    return out;
}

int dump_h5_attr_str(hid_t obj, const char *name, char **out)
{
    guard_begin();
    hid_t t, a = open_scalar_attr(obj, name, H5T_STRING, &t);
    if (a < 0) {
        guard_end();
        return -1;
    }
    *out = H5Tis_variable_str(t) > 0 ? read_vlstr(a, t) : read_fixed_str(a, t);
    guard_end();
    H5Tclose(t);
    H5Aclose(a);
    H5Eclear2(H5E_DEFAULT);
    return *out ? 0 : -1;
}

int dump_h5_attr_i64(hid_t obj, const char *name, int64_t *out)
{
    hid_t t, a = open_scalar_attr(obj, name, H5T_INTEGER, &t);
    if (a < 0)
        return -1;
    int rc;
    /* Read unsigned 64-bit as such so a large seed keeps its bits instead
     * of being clipped by the conversion to int64. */
    if (H5Tget_sign(t) == H5T_SGN_NONE && H5Tget_size(t) == 8) {
        uint64_t u;
        rc = H5Aread(a, H5T_NATIVE_UINT64, &u) < 0 ? -1 : 0;
        *out = (int64_t)u;
    } else {
        rc = H5Aread(a, H5T_NATIVE_INT64, out) < 0 ? -1 : 0;
    }
    H5Tclose(t);
    H5Aclose(a);
    H5Eclear2(H5E_DEFAULT);
    return rc;
}

int dump_h5_attr_f64(hid_t obj, const char *name, double *out)
{
    hid_t t, a = open_scalar_attr(obj, name, H5T_FLOAT, &t);
    if (a < 0)
        return -1;
    int rc = H5Aread(a, H5T_NATIVE_DOUBLE, out) < 0 ? -1 : 0;
    H5Tclose(t);
    H5Aclose(a);
    H5Eclear2(H5E_DEFAULT);
    return rc;
}

H5T_class_t dump_h5_attr_class(hid_t obj, const char *name)
{
    H5T_class_t cls = H5T_NO_CLASS;
    if (H5Aexists(obj, name) > 0) {
        hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
        hid_t t = a >= 0 ? H5Aget_type(a) : H5I_INVALID_HID;
        if (t >= 0)
            cls = H5Tget_class(t);
        H5E_BEGIN_TRY {
            H5Tclose(t);
            H5Aclose(a);
        } H5E_END_TRY;
    }
    H5Eclear2(H5E_DEFAULT);
    return cls;
}

/* ------------------------------------------------------------------ */
/* Stages and the model config                                          */

int dump_stage_cols(const kv_config *c, kv_stage st, int layer)
{
    switch (st) {
    case STAGE_ATTN_NORM_STATS:
    case STAGE_FFN_NORM_STATS:
        return 3;
    case STAGE_Q:
        return c->n_heads * config_layer_head_dim(c, layer);
    case STAGE_ATTN_OUT:
        return c->n_heads * config_layer_v_head_dim(c, layer);
    case STAGE_K:
        return config_layer_kv_heads(c, layer) * config_layer_head_dim(c, layer);
    case STAGE_V:
        return config_layer_kv_heads(c, layer) * config_layer_v_head_dim(c, layer);
    case STAGE_KV_LATENT:
        return config_mla_row(c);
    case STAGE_PLE_IN:
        return c->per_layer_dim;
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
        return c->n_heads;
    case STAGE_ATTN_SINK:
        return c->attn_sinks ? c->n_heads : 0;
    case STAGE_ROUTER_LOGITS:
        return c->n_experts;
    case STAGE_LOGITS:
        return c->vocab;
    default:
        return c->hidden;
    }
}

typedef struct {
    dump_problem_fn fn;
    void *ctx;
    int n;
} problems;

static void problem(problems *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(problems *p, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->n++;
    if (p->fn)
        p->fn(p->ctx, msg);
}

/* An integer field in [lo, hi]; JSON null reads as 0 when null_ok. */
static int int_field(const json_t *o, const char *key, long long lo, long long hi, bool null_ok,
                     problems *p)
{
    const json_t *v = json_object_get(o, key);
    if (!v) {
        problem(p, "model_config has no field \"%s\".", key);
        return 0;
    }
    if (null_ok && json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        problem(p, "model_config field \"%s\" must be an integer from %lld to %lld.", key, lo, hi);
        return 0;
    }
    return (int)json_integer_value(v);
}

static double num_field(const json_t *o, const char *key, problems *p)
{
    const json_t *v = json_object_get(o, key);
    if (!v || !json_is_number(v)) {
        problem(p, v ? "model_config field \"%s\" must be a number." :
                       "model_config has no field \"%s\".", key);
        return 0;
    }
    return json_number_value(v);
}

/* layer_types and kv_owner: arrays of one entry per layer. */
static void layer_fields(const json_t *o, kv_config *c, problems *p)
{
    const json_t *types = json_object_get(o, "layer_types"), *own = json_object_get(o, "kv_owner");
    const int L = c->n_layers;
    if (!json_is_array(types) || (int)json_array_size(types) != L)
        problem(p, "model_config field \"layer_types\" must be an array of num_hidden_layers "
                   "(%d) strings.", L);
    else
        for (int i = 0; i < L; i++) {
            const char *t = json_string_value(json_array_get(types, (size_t)i));
            if (t && !strcmp(t, "sliding_attention"))
                c->layer_type[i] = ATTN_SLIDING;
            else if (t && !strcmp(t, "full_attention"))
                c->layer_type[i] = ATTN_GLOBAL;
            else
                problem(p, "model_config layer_types[%d] must be \"sliding_attention\" or "
                           "\"full_attention\".", i);
        }
    if (!json_is_array(own) || (int)json_array_size(own) != L) {
        problem(p, "model_config field \"kv_owner\" must be an array of num_hidden_layers "
                   "(%d) integers.", L);
        return;
    }
    bool bad = false;
    for (int i = 0; i < L; i++) {
        const json_t *v = json_array_get(own, (size_t)i);
        long long k = json_is_integer(v) ? json_integer_value(v) : -1;
        if (k < 0 || k > i) {
            problem(p, "model_config kv_owner[%d] must be an integer from 0 to %d (an earlier "
                       "or the same layer).", i, i);
            bad = true;
        } else {
            c->kv_owner[i] = (int16_t)k;
        }
    }
    for (int i = 0; i < L && !bad; i++)
        if (c->kv_owner[c->kv_owner[i]] != c->kv_owner[i])
            problem(p, "model_config kv_owner[%d] is %d, which does not own a cache itself.", i,
                    c->kv_owner[i]);
}

/* Optional int: 0 when absent or null. */
static int opt_int(const json_t *o, const char *key, long long lo, long long hi, problems *p)
{
    const json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? int_field(o, key, lo, hi, false, p) : 0;
}

/* Gemma 4's fields, all optional: a recorder that leaves them out says
 * every layer has head_dim and num_key_value_heads, no K=V, whole-head
 * RoPE, one MLP width and no per-layer inputs. */
static void gemma4_fields(const json_t *o, kv_config *c, problems *p)
{
    c->head_dim_full = opt_int(o, "global_head_dim", 2, KV_MAX_HEAD_DIM, p);
    c->n_kv_heads_full = opt_int(o, "num_global_key_value_heads", 1, KV_MAX_HEADS, p);
    c->per_layer_dim = opt_int(o, "hidden_size_per_layer_input", 0, KV_MAX_HIDDEN, p);
    c->per_layer_vocab = opt_int(o, "vocab_size_per_layer_input", 0, KV_MAX_VOCAB, p);
    c->k_eq_v = json_is_true(json_object_get(o, "attention_k_eq_v"));
    c->double_wide_mlp = json_is_true(json_object_get(o, "use_double_wide_mlp"));
    const json_t *f = json_object_get(o, "partial_rotary_factor_full");
    if (f && !json_is_null(f)) {
        double v = json_is_number(f) ? json_number_value(f) : -1;
        if (!(v > 0 && v <= 1))
            problem(p, "model_config field \"partial_rotary_factor_full\" must be a number "
                       "in (0, 1].");
        else
            c->rope_partial_full = v < 1 ? v : 0;
    }
}

/* YaRN's fields (absent ones take config.json's defaults). */
static void yarn_fields(const json_t *sc, kv_rope_scaling *rs, problems *p)
{
    const json_t *v;
    rs->beta_fast = (v = json_object_get(sc, "beta_fast")) ? num_field(sc, "beta_fast", p) : 32.0;
    rs->beta_slow = (v = json_object_get(sc, "beta_slow")) ? num_field(sc, "beta_slow", p) : 1.0;
    v = json_object_get(sc, "truncate");
    rs->truncate = !v || json_is_true(v);
    v = json_object_get(sc, "attention_factor");
    rs->attn_factor = v ? num_field(sc, "attention_factor", p)
                        : rs->factor > 1 ? 0.1 * log(rs->factor) + 1.0 : 1.0;
    rs->original_max_position =
        int_field(sc, "original_max_position_embeddings", 1, INT32_MAX, false, p);
    if (!(rs->beta_fast > rs->beta_slow && rs->beta_slow > 0 && rs->attn_factor > 0))
        problem(p, "model_config rope_scaling: yarn needs beta_fast > beta_slow > 0 and "
                   "attention_factor > 0.");
}

/* Optional rope_scaling: null, absent, or {"rope_type": "linear" |
 * "llama3" | "yarn", "factor", and for llama3 low_freq_factor,
 * high_freq_factor, original_max_position_embeddings, for yarn
 * beta_fast, beta_slow, truncate, attention_factor,
 * original_max_position_embeddings}, as config.json has it. */
static void rope_scaling_field(const json_t *o, kv_config *c, problems *p)
{
    const json_t *sc = json_object_get(o, "rope_scaling");
    if (!sc || json_is_null(sc))
        return;
    const char *t = json_string_value(json_object_get(sc, "rope_type"));
    if (!json_is_object(sc) || !t || (strcmp(t, "linear") && strcmp(t, "llama3") &&
                                      strcmp(t, "yarn"))) {
        problem(p, "model_config field \"rope_scaling\" must be null or an object whose "
                   "rope_type is \"linear\", \"llama3\" or \"yarn\".");
        return;
    }
    kv_rope_scaling *rs = &c->rope_scaling;
    rs->type = !strcmp(t, "linear") ? ROPE_SCALE_LINEAR
             : !strcmp(t, "llama3") ? ROPE_SCALE_LLAMA3 : ROPE_SCALE_YARN;
    rs->factor = num_field(sc, "factor", p);
    if (rs->type == ROPE_SCALE_YARN) {
        yarn_fields(sc, rs, p);
        if (!(rs->factor > 0))
            problem(p, "model_config rope_scaling: factor must be > 0.");
        return;
    }
    if (rs->type == ROPE_SCALE_LLAMA3) {
        rs->low_freq_factor = num_field(sc, "low_freq_factor", p);
        rs->high_freq_factor = num_field(sc, "high_freq_factor", p);
        rs->original_max_position =
            int_field(sc, "original_max_position_embeddings", 1, INT32_MAX, false, p);
    }
    if (!(rs->factor > 0) || (rs->type == ROPE_SCALE_LLAMA3 &&
                              !(rs->high_freq_factor > rs->low_freq_factor &&
                                rs->low_freq_factor > 0)))
        problem(p, "model_config rope_scaling: factor must be > 0 (and high_freq_factor > "
                   "low_freq_factor > 0 for llama3).");
}

static void arch_of(kv_config *c)
{
    /* An unknown model_type reads as llama: the plainest family. */
    const kv_family *f = family_by_model_type(c->model_type);
    c->arch = f ? f->arch : ARCH_LLAMA;
    /* What the family implies (q/k norms, Gemma's 1 + w): the diagnoses
     * read it as they do from a config.json. */
    config_family_flags(c);
}

int dump_config_parse(const char *text, kv_config *out, dump_problem_fn fn, void *ctx)
{
    problems p = {fn, ctx, 0};
    json_error_t jerr;
    json_t *o = text ? json_loads(text, JSON_REJECT_DUPLICATES, &jerr) : NULL;
    if (!json_is_object(o)) {
        if (o)
            problem(&p, "model_config is not a JSON object.");
        else
            problem(&p, "model_config is not valid JSON (%s).", text ? jerr.text : "missing");
        json_decref(o);
        return p.n;
    }
    kv_config c;
    memset(&c, 0, sizeof c);
    const char *mt = json_string_value(json_object_get(o, "model_type"));
    if (!mt || strlen(mt) >= sizeof c.model_type)
        problem(&p, "model_config field \"model_type\" must be a string of at most %zu characters.",
                sizeof c.model_type - 1);
    else
        snprintf(c.model_type, sizeof c.model_type, "%s", mt);
    arch_of(&c);
    /* Bounds keep every product (H*D, rows*cols) far from overflow. */
    c.hidden = int_field(o, "hidden_size", 1, KV_MAX_HIDDEN, false, &p);
    c.n_layers = int_field(o, "num_hidden_layers", 1, KV_MAX_LAYERS, false, &p);
    c.n_heads = int_field(o, "num_attention_heads", 1, KV_MAX_HEADS, false, &p);
    c.n_kv_heads = int_field(o, "num_key_value_heads", 1, KV_MAX_HEADS, false, &p);
    c.head_dim = int_field(o, "head_dim", 1, KV_MAX_HEAD_DIM, false, &p);
    c.intermediate = int_field(o, "intermediate_size", 1, KV_MAX_INTERMEDIATE, false, &p);
    c.vocab = int_field(o, "vocab_size", 1, KV_MAX_VOCAB, false, &p);
    c.sliding_window = int_field(o, "sliding_window", 0, INT32_MAX, true, &p);
    c.rms_eps = num_field(o, "rms_norm_eps", &p);
    c.rope_theta = num_field(o, "rope_theta", &p);
    c.rope_local_theta = num_field(o, "rope_local_base_freq", &p);
    /* Optional: the multiplier of q.k (Gemma 3: query_pre_attn_scalar^-0.5);
     * 1/sqrt(head_dim) when a writer leaves it out. */
    json_t *scale = json_object_get(o, "attn_scale");
    if (json_is_number(scale) && json_number_value(scale) > 0)
        c.attn_scale = json_number_value(scale);
    else if (c.head_dim > 0)
        c.attn_scale = 1.0 / sqrt((double)c.head_dim);
    /* Optional: Gemma's final logit softcap (0 or absent: none). */
    json_t *cap = json_object_get(o, "final_logit_softcapping");
    if (cap && !json_is_null(cap)) {
        if (!json_is_number(cap) || !(json_number_value(cap) >= 0) ||
            !isfinite(json_number_value(cap)))
            problem(&p, "model_config field \"final_logit_softcapping\" must be a number >= 0.");
        else
            c.final_softcap = json_number_value(cap);
    }
    rope_scaling_field(o, &c, &p);
    if (c.n_layers > 0)
        layer_fields(o, &c, &p);
    if (c.arch == ARCH_GEMMA4)
        gemma4_fields(o, &c, &p);
    /* Experts (gpt-oss): optional, for the reader of the recording. */
    c.n_experts = opt_int(o, "num_local_experts", 0, 1 << 12, &p);
    c.n_experts_used = opt_int(o, "num_experts_per_tok", 0, 1 << 12, &p);
    c.first_dense = opt_int(o, "first_k_dense_replace", 0, KV_MAX_LAYERS, &p);
    c.moe_every = opt_int(o, "moe_layer_freq", 0, KV_MAX_LAYERS, &p);
    /* How router_logits choose: the family's routing (arch_of set it:
     * gpt-oss's top k of logits, DeepSeek's softmax), sigmoid scores with
     * a bias where scoring_func says so, within groups. */
    const char *scoring = json_string_value(json_object_get(o, "scoring_func"));
    if (scoring && !strcmp(scoring, "sigmoid"))
        c.route = ROUTE_SIGMOID;
    c.n_group = opt_int(o, "n_group", 0, 1 << 12, &p);
    c.topk_group = opt_int(o, "topk_group", 0, 1 << 12, &p);
    if (c.n_group > 0 && (c.n_experts % c.n_group || c.topk_group < 1 ||
                          c.topk_group > c.n_group))
        problem(&p, "model_config: n_group and topk_group must split num_local_experts into "
                "groups and keep 1..n_group of them.");
    /* MLA (DeepSeek): the latent's and the key tail's widths, the values'. */
    c.kv_lora_rank = opt_int(o, "kv_lora_rank", 0, KV_MAX_HEAD_DIM, &p);
    c.qk_rope_dim = opt_int(o, "qk_rope_head_dim", 0, KV_MAX_HEAD_DIM, &p);
    c.v_head_dim = opt_int(o, "v_head_dim", 0, KV_MAX_HEAD_DIM, &p);
    if (c.kv_lora_rank > 0 && (c.qk_rope_dim <= 0 || c.qk_rope_dim % 2 || c.v_head_dim <= 0 ||
                               c.qk_rope_dim >= c.head_dim))
        problem(&p, "model_config: an MLA model needs an even qk_rope_head_dim below head_dim "
                "and a v_head_dim.");
    json_decref(o);
    *out = c;
    return p.n;
}

int dump_layer_index(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > 6 || (n > 1 && name[0] == '0'))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (name[i] < '0' || name[i] > '9')
            return -1;
    return atoi(name);
}
