/* suite_run.c — selecting, running and reporting suite cases (suite.h).
 *
 * Each case runs in a forked worker, so --jobs N runs N cases at once and a
 * crash stays inside its case. The worker executes the kvdiff binary itself
 * for every step (run A, run B, compare --json; for a no-bug case whose
 * outside side generated other tokens, the kvdiff side again on those
 * tokens and its compare; report on failure) with
 * output going to the case's log.txt, reads compare.json with jansson,
 * judges the expectation and sends its suite_result back through a pipe.
 * The parent only waits on those pipes (poll), never on a stranger's child. */
/* nftw */
#define _XOPEN_SOURCE 700
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <poll.h>
#include <regex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <limits.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "suite.h"
#include "../model/config.h"
#include "../model/observer.h"
#include "../model/pcg32.h"
#include "../model/tokenizer.h"
#include "../model/tokens.h"
#include "../model/outfile.h"

/* snprintf that cuts silently: messages and paths here are bounded on
 * purpose (a cut message is still one line). */
static void put(char *dst, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void put(char *dst, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, n, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------ */
/* Selection                                                            */

int suite_parse_shard(const char *text, int *shard_i, int *shard_n, kv_err *e)
{
    char *end;
    errno = 0;
    long i = strtol(text, &end, 10);
    if (errno || end == text || *end != '/')
        return kv_errf(e, "--shard: '%s' is not I/N (e.g. 1/4)", text);
    const char *rest = end + 1;
    long n = strtol(rest, &end, 10);
    if (errno || end == rest || *end)
        return kv_errf(e, "--shard: '%s' is not I/N (e.g. 1/4)", text);
    /* Say what is wrong with the numbers given, not with "I" and "N". */
    if (n < 1 || n > 100000)
        return kv_errf(e, "--shard %s: the shard count %ld must be between 1 and 100000", text,
                       n);
    if (i < 1 || i > n)
        return kv_errf(e, "--shard %s: shards are numbered 1..%ld, not %ld", text, n, i);
    *shard_i = (int)i;
    *shard_n = (int)n;
    return 0;
}

int suite_select(const suite *s, const char *filter, int shard_i, int shard_n, int **sel, int *n,
                 kv_err *e)
{
    regex_t re;
    *sel = NULL;
    *n = 0;
    if (shard_n < 1 || shard_i < 1 || shard_i > shard_n)
        return kv_errf(e, "--shard %d/%d: shards are numbered 1..N with N at least 1",
                       shard_i, shard_n);
    if (filter) {
        int rc = regcomp(&re, filter, REG_EXTENDED | REG_NOSUB);
        if (rc) {
            char why[256];
            regerror(rc, &re, why, sizeof why);
            return kv_errf(e, "--filter: '%s' is not a regular expression: %s", filter, why);
        }
    }
    int *out = malloc((size_t)(s->n_cases + 1) * sizeof *out);
    if (!out) {
        if (filter)
            regfree(&re);
        return kv_errf(e, "out of memory");
    }
    int matched = 0;
    for (int i = 0; i < s->n_cases; i++) {
        if (filter && regexec(&re, s->cases[i].name, 0, NULL, 0) != 0)
            continue;
        if (matched++ % shard_n == shard_i - 1)
            out[(*n)++] = i;
    }
    if (filter)
        regfree(&re);
    *sel = out;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Files                                                                */

/* A case folder is the suite's own only when it is a real folder (not a
 * link to one) holding SUITE_CASE_MARK, which the runner writes when it
 * makes the folder: a folder that merely has a case's name (the model
 * folder a case reads, a user's work in --keep DIR) is never emptied or
 * removed, and nothing is followed out of one. The mark is removed last,
 * so a removal cut short leaves a folder the next run still knows. */

/* 0: nothing at folder; 1: a case folder the suite made; -1 (e): else. */
static int case_folder_state(const char *folder, kv_err *e)
{
    struct stat st;
    char mark[PATH_MAX];
    if (lstat(folder, &st) < 0)
        return errno == ENOENT ? 0 : kv_errf(e, "%s: %s", folder, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return kv_errf(e, "%s: is %s where the suite keeps a case's folder; it is left alone "
                       "(remove it, or choose another --keep folder)", folder,
                       outfile_kind(st.st_mode));
    if ((size_t)snprintf(mark, sizeof mark, "%s/%s", folder, SUITE_CASE_MARK) >= sizeof mark)
        return kv_errf(e, "%s: path too long", folder);
    if (lstat(mark, &st) < 0 || !S_ISREG(st.st_mode))
        return kv_errf(e, "%s: exists and is no case folder kvdiff suite made (it has no %s); "
                       "it is left alone (move it, or choose another --keep folder)", folder,
                       SUITE_CASE_MARK);
    return 1;
}

/* nftw hands its callbacks no context: the walks run one at a time. */
static kv_err *walk_err;
static const char *walk_root;

static int input_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    kv_err ignored = {{0}};
    (void)ftw;
    if (flag != FTW_F || !S_ISREG(st->st_mode) || outfile_check_target(path, &ignored) == 0)
        return 0;
    kv_errf(walk_err, "%s: holds %s, one of this run's inputs, and the suite empties the "
            "folder; it is left alone (move the file out, or choose another --keep folder)",
            walk_root, path);
    return 1;
}

static int clear_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    if (ftw->level == 0 || (ftw->level == 1 && !strcmp(path + ftw->base, SUITE_CASE_MARK)))
        return 0;
    if ((flag == FTW_DP ? rmdir(path) : unlink(path)) == 0)
        return 0;
    kv_errf(walk_err, "%s: cannot remove: %s", path, strerror(errno));
    return 1;
}

/* nftw over folder (FTW_PHYS: links are entries, never followed). */
static int walk(const char *folder, int (*fn)(const char *, const struct stat *, int,
                                              struct FTW *), int flags, kv_err *e)
{
    walk_err = e;
    walk_root = folder;
    int rc = nftw(folder, fn, 16, flags | FTW_PHYS);
    walk_err = NULL;
    if (rc == 0 || rc == 1)
        return rc ? -1 : 0;
    return kv_errf(e, "%s: %s", folder, strerror(errno));
}

int suite_case_folder_check(const char *folder, kv_err *e)
{
    int st = case_folder_state(folder, e);
    return st <= 0 ? st : walk(folder, input_entry, 0, e);
}

int suite_case_folder_remove(const char *folder, kv_err *e)
{
    char mark[PATH_MAX];
    int st = case_folder_state(folder, e);
    if (st <= 0)
        return st;
    snprintf(mark, sizeof mark, "%s/%s", folder, SUITE_CASE_MARK);
    if (walk(folder, clear_entry, FTW_DEPTH, e) < 0)
        return -1;
    if (unlink(mark) < 0 || rmdir(folder) < 0)
        return kv_errf(e, "%s: cannot remove: %s", folder, strerror(errno));
    return 0;
}

/* Makes the folder a case works in, empty but for its mark: a new one, or
 * one the suite made before, emptied. In the runner, before the worker
 * starts, so that no folder it made is ever left without its mark. */
static int case_folder_make(const char *folder, kv_err *e)
{
    char mark[PATH_MAX];
    if ((size_t)snprintf(mark, sizeof mark, "%s/%s", folder, SUITE_CASE_MARK) >= sizeof mark)
        return kv_errf(e, "%s: path too long", folder);
    int st = case_folder_state(folder, e);
    if (st < 0 || (st == 1 && walk(folder, input_entry, 0, e) < 0))
        return -1;
    if (st == 1)
        return walk(folder, clear_entry, FTW_DEPTH, e);
    bool created = false;
    if (outfile_tool_dir(folder, &created, e) < 0)
        return -1;
    if (!created)
        return kv_errf(e, "%s: appeared while the suite was making it; it is left alone",
                       folder);
    /* An empty file, new in a folder this call just made: it takes no
     * room, so a full disk still lets the case run and say why it fails. */
    int fd = open(mark, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        rmdir(folder);
        return kv_errf(e, "%s: cannot create: %s", mark, strerror(err));
    }
    close(fd);
    return 0;
}

/* The last non-empty line of text (modified: trailing blanks cut). */
static void last_line_of(char *buf, char *out, size_t n)
{
    size_t len = strlen(buf);
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' '))
        buf[--len] = 0;
    char *start = strrchr(buf, '\n');
    put(out, n, "%s", start ? start + 1 : buf);
}

/* The last non-empty line of a file (at most its last 4 KiB), or "". */
static void last_line(const char *path, char *out, size_t n)
{
    char buf[4096];
    out[0] = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return;
    long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (size > (long)sizeof buf - 1)
        fseek(f, size - (long)sizeof buf + 1, SEEK_SET);
    else
        fseek(f, 0, SEEK_SET);
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    last_line_of(buf, out, n);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ */
/* Steps                                                                */

/* Seconds a step may take (suite_run_opts.step_timeout; 0: no limit). */
static int step_timeout;

/* The running step's process group (0 none): each step runs in a group of
 * its own, so that a timeout, or the worker stopped, kills the programs it
 * started as well. */
static volatile sig_atomic_t step_pgid;

/* The worker's SIGTERM (an interrupted run): the step's group with it. */
static void worker_term(int sig)
{
    if (step_pgid > 0)
        kill(-(pid_t)step_pgid, SIGKILL);
    _exit(128 + sig);
}

/* The kvdiff binary: the log shows it as "kvdiff", other programs by name. */
static const char *step_kvdiff;

#define STEP_TIMED_OUT 1000

/* The end of the last step's stderr, kept in memory as well as in the
 * log: on a full disk the log cannot hold the line that says so. */
static char step_tail[1024];
static size_t step_tail_len;

static void tail_add(const char *buf, size_t n)
{
    if (n >= sizeof step_tail) {
        buf += n - (sizeof step_tail - 1);
        n = sizeof step_tail - 1;
    }
    if (step_tail_len + n >= sizeof step_tail) {
        size_t drop = step_tail_len + n - (sizeof step_tail - 1);
        memmove(step_tail, step_tail + drop, step_tail_len - drop);
        step_tail_len -= drop;
    }
    memcpy(step_tail + step_tail_len, buf, n);
    step_tail_len += n;
    step_tail[step_tail_len] = 0;
}

/* Moves what the step wrote to its stderr pipe into err_fd and the tail;
 * returns false at end of file. */
static bool pump(int from, int err_fd)
{
    char buf[4096];
    for (;;) {
        ssize_t k = read(from, buf, sizeof buf);
        if (k > 0) {
            tail_add(buf, (size_t)k);
            if (write(err_fd, buf, (size_t)k) < 0) {
                /* the log is full or gone: the tail still has it */
            }
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        return k < 0;   /* EAGAIN: open, nothing yet; 0: end of file */
    }
}

/* Runs argv with stdout to out_fd and stderr to err_fd (through a pipe,
 * so its end is kept in step_tail); the command line goes to err_fd first.
 * Returns the exit code, 128 + signal, -1, or STEP_TIMED_OUT when it ran
 * past step_timeout and was killed. */
static int run_step(char *const argv[], int out_fd, int err_fd)
{
    step_tail_len = 0;
    step_tail[0] = 0;
    dprintf(err_fd, "$ %s", step_kvdiff && !strcmp(argv[0], step_kvdiff) ? "kvdiff" : argv[0]);
    for (int i = 1; argv[i]; i++)
        dprintf(err_fd, " %s", argv[i]);
    dprintf(err_fd, "\n");
    int errp[2];
    if (pipe(errp) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(errp[0]);
        close(errp[1]);
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0);
        signal(SIGTERM, SIG_DFL);
        int null_in = open("/dev/null", O_RDONLY);
        if (null_in >= 0)
            dup2(null_in, 0);
        /* stdout shares the pipe when it goes to the log too, so the log
         * keeps the order in which the lines came */
        dup2(out_fd == err_fd ? errp[1] : out_fd, 1);
        dup2(errp[1], 2);
        close(errp[0]);
        close(errp[1]);
        /* PATH is searched for an exec: side's bare program name */
        execvp(argv[0], argv);
        dprintf(2, "cannot execute %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    setpgid(pid, pid);   /* as the child does: whichever runs first */
    step_pgid = pid;
    close(errp[1]);
    fcntl(errp[0], F_SETFL, fcntl(errp[0], F_GETFL) | O_NONBLOCK);
    bool open_pipe = true;
    int st;
    const double deadline = now_s() + (step_timeout > 0 ? step_timeout : 1e18);
    for (;;) {
        if (open_pipe)
            open_pipe = pump(errp[0], err_fd);
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            break;
        if (w < 0 && errno != EINTR) {
            close(errp[0]);
            return -1;
        }
        if (now_s() > deadline) {
            kill(-pid, SIGKILL);   /* the step and whatever it started */
            while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
            }
            step_pgid = 0;
            close(errp[0]);
            dprintf(err_fd, "killed: it ran past the step time limit of %d s\n", step_timeout);
            return STEP_TIMED_OUT;
        }
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    step_pgid = 0;
    /* what it wrote last, unless a grandchild still holds the pipe open */
    if (open_pipe)
        pump(errp[0], err_fd);
    close(errp[0]);
    return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
}

typedef struct {
    char *v[96];
    int n;
    char num[4][32];
} argbuf;

static void arg(argbuf *b, const char *s)
{
    if (b->n < (int)(sizeof b->v / sizeof *b->v) - 1)
        b->v[b->n++] = (char *)s;
    b->v[b->n] = NULL;
}

/* kvdiff run's arguments for a side with settings eng; follow (NULL but
 * for the followed re-run) is a dump whose tokens the run is fed in place
 * of the case's prompt and sampled tokens. */
static void run_args(argbuf *b, const char *bin, const suite_case *c, char **eng, int neng,
                     const char *dump, const char *follow)
{
    b->n = 0;
    arg(b, bin);
    arg(b, "run");
    arg(b, "--model");
    arg(b, c->model);
    if (c->weights_seed_given) {   /* run refuses it for a folder */
        put(b->num[0], sizeof b->num[0], "%llu", (unsigned long long)c->weights_seed);
        arg(b, "--weights-seed");
        arg(b, b->num[0]);
    }
    if (follow) {   /* its prompt, its length, no EOS stop: the file's */
        arg(b, "--follow");
        arg(b, follow);
    } else if (c->prompt.kind == SUITE_PROMPT_RANDOM) {
        put(b->num[1], sizeof b->num[1], "%ld", c->prompt.random_len);
        put(b->num[2], sizeof b->num[2], "%llu", (unsigned long long)c->prompt.seed);
        arg(b, "--prompt-random");
        arg(b, b->num[1]);
        arg(b, "--seed");
        arg(b, b->num[2]);
    } else {
        static const char *const opt[] = {
            [SUITE_PROMPT_TOKENS] = "--prompt-tokens", [SUITE_PROMPT_FILE] = "--prompt-ids-file",
            [SUITE_PROMPT_TEXT] = "--prompt-text", [SUITE_PROMPT_TEXT_FILE] = "--prompt-file"};
        arg(b, opt[c->prompt.kind]);
        arg(b, c->prompt.text);
    }
    /* Every case generates max_new tokens, so positions are predictable; the
     * cases run in parallel processes, so one thread each unless a/b say. */
    if (!follow) {
        put(b->num[3], sizeof b->num[3], "%ld", c->max_new);
        arg(b, "--max-new");
        arg(b, b->num[3]);
        arg(b, "--ignore-eos");
    }
    arg(b, "--threads");
    arg(b, "1");
    for (int i = 0; i < neng; i++)
        arg(b, eng[i]);
    arg(b, "--dump");
    arg(b, dump);
}

/* ------------------------------------------------------------------ */
/* Judging compare --json                                               */

static const char *jstr(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "";
}

static void judge(const suite_case *c, json_t *j, int code, suite_result *r)
{
    const suite_expect *x = &c->expect;
    const char *verdict = jstr(j, "verdict");
    json_t *tok = json_object_get(j, "tokens");
    bool tokens_same = !strcmp(jstr(tok, "verdict"), "identical");
    json_t *fd = json_object_get(j, "first_divergence");
    const char *diag = jstr(json_object_get(j, "diagnosis"), "kind");
    long long pos = -1, layer = -2;
    const char *stage = "";
    if (json_is_object(fd)) {
        pos = json_integer_value(json_object_get(fd, "position"));
        layer = json_integer_value(json_object_get(fd, "layer"));
        stage = jstr(fd, "stage");
        put(r->where, sizeof r->where, "layer %lld position %lld %s", layer, pos, stage);
        put(r->got, sizeof r->got, "diverged: %s at layer %lld position %lld stage %s", diag, layer,
                 pos, stage);
    } else {
        put(r->where, sizeof r->where, "-");
        put(r->got, sizeof r->got, "%s",
                 !strcmp(verdict, "within_tolerance") ? "within tolerance" : verdict);
    }
    if (!tokens_same) {
        size_t used = strlen(r->got);
        json_t *p = json_object_get(tok, "position");
        if (json_is_integer(p))
            put(r->got + used, sizeof r->got - used, ", tokens differ at position %lld",
                     (long long)json_integer_value(p));
        else
            put(r->got + used, sizeof r->got - used, ", tokens %s", jstr(tok, "verdict"));
    }
    json_t *xrt = json_object_get(json_object_get(j, "mode"), "cross_runtime");
    if (x->kind == SUITE_EXPECT_NO_BUG && !json_is_object(xrt)) {
        size_t used = strlen(r->got);
        put(r->got + used, sizeof r->got - used, " (not judged by the cross-runtime drift "
            "model: the dumps come from one runtime)");
    }
    bool pass;
    if (json_is_true(json_object_get(j, "incomplete")))
        pass = false;   /* over part of a run only (compare exits 2 for it) */
    else if (x->kind == SUITE_EXPECT_IDENTICAL)
        pass = !strcmp(verdict, "identical") && tokens_same;
    else if (x->kind == SUITE_EXPECT_WITHIN)
        pass = (!strcmp(verdict, "identical") || !strcmp(verdict, "within_tolerance")) &&
               tokens_same;
    else if (x->kind == SUITE_EXPECT_NO_BUG)
        /* compare's exit 0 already weighs tokens and partial dumps across
         * runtimes (docs/cross-runtime.md); no-bug asks that the drift
         * model, not the bitwise compare, said so */
        pass = code == 0 && json_is_object(xrt) &&
               (!strcmp(verdict, "identical") || !strcmp(verdict, "within_tolerance"));
    else
        pass = !strcmp(verdict, "diverged") && pos == x->pos && layer == x->layer &&
               !strcmp(stage, stage_name((kv_stage)x->stage)) &&
               !strcmp(diag, suite_injection_diagnosis(x->injection));
    r->outcome = pass ? SUITE_PASS : SUITE_FAIL;
    if (!pass) {
        char want[256];
        suite_expect_describe(x, want, sizeof want);
        if (x->kind == SUITE_EXPECT_DETECTS)
            put(r->message, sizeof r->message, "expected %s (diagnosis %s); got %s", want,
                     suite_injection_diagnosis(x->injection), r->got);
        else
            put(r->message, sizeof r->message, "expected %s; got %s", want, r->got);
    }
}

/* ------------------------------------------------------------------ */
/* One case (in the worker)                                             */

static void step_error(suite_result *r, const char *log, const char *step, int code)
{
    r->outcome = SUITE_ERROR;
    if (code < 0)
        put(r->message, sizeof r->message, "%s could not be started", step);
    else if (code == STEP_TIMED_OUT)
        put(r->message, sizeof r->message, "%s ran past the step time limit (%d s) and was "
            "killed", step, step_timeout);
    else if (code >= 128)
        put(r->message, sizeof r->message, "%s was killed by signal %d", step, code - 128);
    else
        put(r->message, sizeof r->message, "%s exited with %d", step, code);
    /* the step's own last line, kept in memory: on a full disk the log
     * lacks it (and then says why, e.g. "No space left on device") */
    last_line_of(step_tail, r->last_line, sizeof r->last_line);
    if (!r->last_line[0])
        last_line(log, r->last_line, sizeof r->last_line);
    put(r->got, sizeof r->got, "error");
    put(r->where, sizeof r->where, "-");
}

/* ------------------------------------------------------------------ */
/* Outside sides                                                        */

/* A text prompt's ids, encoded as `kvdiff run --prompt-text/--prompt-file`
 * encodes them for kvdiff's side (tok_encode_prompt with the folder's
 * tokenizer.json), so both sides get the same ids. */
static int encode_text_prompt(const suite_case *c, int32_t **ids, int *n, kv_err *e)
{
    bool file = c->prompt.kind == SUITE_PROMPT_TEXT_FILE;
    const char *what = file ? "the text-file prompt" : "the text prompt";
    kv_config cfg;
    char cj[1100];
    put(cj, sizeof cj, "%s/config.json", c->model);
    if (config_load_json(cj, &cfg, e) < 0)
        return kv_err_prefix(e, what);
    kv_tokenizer *tok = NULL;
    if (tok_load(c->model, &tok, e) < 0)
        return kv_err_prefix(e, what);
    if (!tok)
        return kv_errf(e, "%s needs %s/tokenizer.json, and there is none", what, c->model);
    char note[1024];
    char *text = c->prompt.text;
    size_t len = strlen(text);
    int rc = tok_check_vocab(tok, cfg.vocab, note, sizeof note, e);
    if (rc == 0 && file)
        rc = tok_read_text(c->prompt.text, &text, &len, e);
    if (rc == 0)
        rc = tok_encode_prompt(tok, text, len, cfg.vocab, cfg.max_positions, ids, n, e);
    if (file && text != c->prompt.text)
        free(text);
    tok_free(tok);
    return rc < 0 ? kv_err_prefix(e, what) : 0;
}

/* Writes the case's prompt ids to path, one line separated by blanks,
 * drawn exactly as `kvdiff run` draws --prompt-random (the prompt's PCG32
 * stream, bounded by the model's vocabulary). */
static int write_prompt(const suite_case *c, const char *path, kv_err *e)
{
    int32_t *ids = NULL;
    int n = 0;
    if (c->prompt.kind == SUITE_PROMPT_TOKENS) {
        if (tokens_parse(c->prompt.text, strlen(c->prompt.text), "prompt", 0, &ids, &n, e) < 0)
            return -1;
    } else if (c->prompt.kind == SUITE_PROMPT_FILE) {
        if (tokens_load(c->prompt.text, 0, &ids, &n, e) < 0)
            return -1;
    } else if (c->prompt.kind == SUITE_PROMPT_TEXT || c->prompt.kind == SUITE_PROMPT_TEXT_FILE) {
        if (encode_text_prompt(c, &ids, &n, e) < 0)
            return -1;
    } else {
        kv_config cfg;
        char cj[1100];
        put(cj, sizeof cj, "%s/config.json", c->model);
        if (config_preset(c->model, &cfg, NULL) < 0 && config_load_json(cj, &cfg, e) < 0)
            return kv_err_prefix(e, "the vocabulary for the random prompt");
        n = (int)c->prompt.random_len;
        if (!(ids = malloc((size_t)n * sizeof *ids)))
            return kv_errf(e, "out of memory");
        pcg32 rng;
        pcg32_seed(&rng, c->prompt.seed, 0x70);   /* as cli_make_prompt */
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)pcg32_bounded(&rng, (uint32_t)cfg.vocab);
    }
    outfile o;
    if (outfile_open(&o, path, e) < 0) {
        free(ids);
        return -1;
    }
    for (int i = 0; i < n; i++)
        fprintf(o.f, i ? " %d" : "%d", ids[i]);
    fputc('\n', o.f);
    free(ids);
    return outfile_commit(&o, e);
}

/* What a case's outside sides share, made once when first needed. */
typedef struct {
    const suite_case *c;
    const char *bin, *folder;
    int log_fd;
    const char *log;
    char tokens[1100];           /* prompt ids file ("" until written) */
    char model[1100];            /* model folder ("" until known) */
    char gguf[1100];             /* GGUF file ("" until known) */
} side_ctx;

static void side_fail(suite_result *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void side_fail(suite_result *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->message, sizeof r->message, fmt, ap);
    va_end(ap);
    r->outcome = SUITE_ERROR;
    put(r->got, sizeof r->got, "error");
    put(r->where, sizeof r->where, "-");
}

static int need_tokens(side_ctx *x, suite_result *r)
{
    kv_err e = {{0}};
    if (x->tokens[0])
        return 0;
    put(x->tokens, sizeof x->tokens, "%s/prompt.txt", x->folder);
    if (write_prompt(x->c, x->tokens, &e) < 0) {
        side_fail(r, "cannot write the prompt's ids: %s", e.msg);
        return -1;
    }
    return 0;
}

static int need_model(side_ctx *x, suite_result *r)
{
    kv_config cfg;
    if (x->model[0])
        return 0;
    if (config_preset(x->c->model, &cfg, NULL) < 0) {
        put(x->model, sizeof x->model, "%s", x->c->model);   /* a folder already */
        return 0;
    }
    put(x->model, sizeof x->model, "%s/model", x->folder);
    argbuf b = {.n = 0};
    arg(&b, x->bin);
    arg(&b, "gen");
    arg(&b, "--preset");
    arg(&b, x->c->model);
    put(b.num[0], sizeof b.num[0], "%llu", (unsigned long long)x->c->weights_seed);
    arg(&b, "--weights-seed");
    arg(&b, b.num[0]);
    arg(&b, "-o");
    arg(&b, x->model);
    int code = run_step(b.v, x->log_fd, x->log_fd);
    if (code != 0) {
        step_error(r, x->log, "exporting the model folder (kvdiff gen)", code);
        return -1;
    }
    return 0;
}

static int need_gguf(side_ctx *x, suite_result *r)
{
    kv_config cfg;
    if (x->gguf[0])
        return 0;
    if (x->c->gguf) {
        put(x->gguf, sizeof x->gguf, "%s", x->c->gguf);
        return 0;
    }
    put(x->gguf, sizeof x->gguf, "%s/model.gguf", x->folder);
    argbuf b = {.n = 0};
    arg(&b, x->bin);
    arg(&b, "gen");
    if (config_preset(x->c->model, &cfg, NULL) == 0) {
        put(b.num[0], sizeof b.num[0], "%llu", (unsigned long long)x->c->weights_seed);
        arg(&b, "--preset");
        arg(&b, x->c->model);
        arg(&b, "--weights-seed");
        arg(&b, b.num[0]);
    } else {
        arg(&b, "--from");
        arg(&b, x->c->model);
    }
    arg(&b, "--gguf");
    arg(&b, x->gguf);
    int code = run_step(b.v, x->log_fd, x->log_fd);
    if (code != 0) {
        step_error(r, x->log, "exporting the GGUF (kvdiff gen --gguf)", code);
        return -1;
    }
    return 0;
}

/* The llama.cpp recorder: KVDIFF_LLAMA_BIN, else kvdiff-llama next to the
 * kvdiff binary the suite runs ("" when neither is there). */
static void llama_bin(const char *kvdiff, char *out, size_t n)
{
    const char *env = getenv("KVDIFF_LLAMA_BIN");
    if (env && *env) {
        put(out, n, "%s", env);
        return;
    }
    const char *slash = strrchr(kvdiff, '/');
    if (slash)
        put(out, n, "%.*s/kvdiff-llama", (int)(slash - kvdiff), kvdiff);
    else
        put(out, n, "kvdiff-llama");
}

/* Checks an outside side's dump with `kvdiff validate`. */
static int validate_side(side_ctx *x, const char *step, const char *dump, suite_result *r)
{
    if (access(dump, R_OK) != 0) {
        side_fail(r, "%s wrote no dump at %s", step, dump);
        return -1;
    }
    argbuf b = {.n = 0};
    arg(&b, x->bin);
    arg(&b, "validate");
    arg(&b, dump);
    int code = run_step(b.v, x->log_fd, x->log_fd);
    if (code != 0) {
        char what[200];
        put(what, sizeof what, "its dump: kvdiff validate");
        step_error(r, x->log, what, code);
        char msg[sizeof r->message];
        put(msg, sizeof msg, "%s: %s is not a valid kvdiff dump (%s)", step, dump, r->message);
        put(r->message, sizeof r->message, "%s", msg);
        return -1;
    }
    return 0;
}

/* Records one side into dump (or checks the recording a dump: side names).
 * 0, or -1 with r an ERROR naming the step. */
static int run_side(side_ctx *x, const char *label, suite_side_kind kind, char **argv, int argc,
                    const char *dump, suite_result *r)
{
    char step[160];
    const suite_case *c = x->c;
    put(step, sizeof step, "%s (%s)", label,
        kind == SUITE_SIDE_KVDIFF ? "kvdiff run" : kind == SUITE_SIDE_LLAMA ? "llama.cpp"
        : kind == SUITE_SIDE_EXEC ? "exec" : "dump");
    if (kind == SUITE_SIDE_KVDIFF) {
        argbuf b;
        run_args(&b, x->bin, c, argv, argc, dump, NULL);
        int code = run_step(b.v, x->log_fd, x->log_fd);
        if (code != 0) {
            step_error(r, x->log, step, code);
            return -1;
        }
        return 0;
    }
    if (kind == SUITE_SIDE_DUMP) {
        if (access(dump, R_OK) != 0) {
            side_fail(r, "%s: cannot read %s: %s", step, dump, strerror(errno));
            return -1;
        }
        return validate_side(x, step, dump, r);
    }
    if (need_tokens(x, r) < 0)
        return -1;
    char maxn[32];
    put(maxn, sizeof maxn, "%ld", c->max_new);
    if (kind == SUITE_SIDE_LLAMA) {
        char rec[1100];
        llama_bin(x->bin, rec, sizeof rec);
        if (access(rec, X_OK) != 0) {
            side_fail(r, "%s: no llama.cpp recorder at %s (build it with `make recorders`, "
                      "or set KVDIFF_LLAMA_BIN)", step, rec);
            return -1;
        }
        if (need_gguf(x, r) < 0)
            return -1;
        argbuf b = {.n = 0};
        arg(&b, rec);
        arg(&b, x->gguf);
        arg(&b, "--max-new");
        arg(&b, maxn);
        arg(&b, "--ignore-eos");
        /* one thread unless the options say more: cases run side by side,
         * and llama.cpp's spinning threads starve each other on few cores */
        arg(&b, "--threads");
        arg(&b, "1");
        for (int i = 0; i < argc; i++)
            arg(&b, argv[i]);
        arg(&b, "--prompt-ids-file");
        arg(&b, x->tokens);
        arg(&b, "--dump");
        arg(&b, dump);
        int code = run_step(b.v, x->log_fd, x->log_fd);
        if (code != 0) {
            step_error(r, x->log, step, code);
            return -1;
        }
        return validate_side(x, step, dump, r);
    }
    bool wants_model = false;
    for (int i = 0; i < argc; i++)
        wants_model |= strstr(argv[i], "{model}") != NULL;
    if (wants_model && need_model(x, r) < 0)
        return -1;
    /* each value put in as the word's programs read it: quoted in a
     * POSIX shell's code (the parser refused every other place a value
     * would be parsed) */
    const char *const vals[4] = {x->model, x->tokens, maxn, dump};
    char **v = calloc((size_t)argc + 1, sizeof *v);
    unsigned char *kinds = malloc((size_t)argc + 1);
    kv_err we = {{0}};
    bool ok = v && kinds && suite_exec_words(argv, argc, kinds, &we) == 0;
    for (int i = 0; ok && i < argc; i++)
        ok = (v[i] = suite_exec_fill(argv[i], (suite_word_kind)kinds[i], vals)) != NULL;
    free(kinds);
    if (!ok) {
        suite_argv_free(v);
        side_fail(r, "%s: %s", step, we.msg[0] ? we.msg : "out of memory");
        return -1;
    }
    int code = run_step(v, x->log_fd, x->log_fd);
    suite_argv_free(v);
    if (code != 0) {
        step_error(r, x->log, step, code);
        if (code == 127 && r->last_line[0])
            put(r->message + strlen(r->message), sizeof r->message - strlen(r->message),
                " (%s)", r->last_line);
        return -1;
    }
    return validate_side(x, step, dump, r);
}

/* `kvdiff compare ref test --json` (with a within's tolerances) into js.
 * Returns the parsed result and *code (0 or 1), or NULL with r an ERROR
 * (compare failed, wrote no JSON, or judged only part of a run). A js
 * left empty (compare crashed or was killed) is removed. */
static json_t *compare_pair(const suite_case *c, const char *bin, const char *ref,
                            const char *test, const char *js, const char *log, int log_fd,
                            int *code, suite_result *r)
{
    argbuf args = {.n = 0};
    arg(&args, bin);
    arg(&args, "compare");
    arg(&args, ref);
    arg(&args, test);
    arg(&args, "--json");
    const suite_expect *x = &c->expect;
    if (x->kind == SUITE_EXPECT_WITHIN) {
        const char *names[3] = {"--atol", "--rtol", "--ulp"};
        for (int i = 0; i < 3; i++) {
            if ((i == 0 && !(x->atol > 0)) || (i == 1 && !(x->rtol > 0)) || (i == 2 && !x->ulp))
                continue;
            if (i < 2)
                put(args.num[i], sizeof args.num[i], "%.17g", i ? x->rtol : x->atol);
            else
                put(args.num[i], sizeof args.num[i], "%llu", (unsigned long long)x->ulp);
            arg(&args, names[i]);
            arg(&args, args.num[i]);
        }
    }
    outfile jo;
    kv_err je = {{0}};
    int js_fd;
    if (outfile_open_fd(&jo, js, &js_fd, &je) < 0) {
        r->outcome = SUITE_ERROR;
        put(r->message, sizeof r->message, "cannot write %s", je.msg);
        return NULL;
    }
    *code = run_step(args.v, js_fd, log_fd);
    /* compare that wrote nothing (crashed, killed) leaves no empty
     * compare.json for a user to open */
    struct stat st;
    if (fstat(js_fd, &st) == 0 && st.st_size == 0)
        outfile_abort(&jo);
    else if (outfile_commit(&jo, &je) < 0) {
        r->outcome = SUITE_ERROR;
        put(r->message, sizeof r->message, "cannot write %s", je.msg);
        return NULL;
    }
    json_error_t jerr;
    json_t *j = *code == 0 || *code == 2 || *code == 1 ? json_load_file(js, 0, &jerr) : NULL;
    if (*code == 2 && json_is_true(json_object_get(j, "incomplete"))) {
        /* no divergence, but over part of a run: no pass rests on it */
        r->outcome = SUITE_ERROR;
        put(r->message, sizeof r->message, "incomplete: %s",
            jstr(j, "incomplete_why"));
        put(r->got, sizeof r->got, "incomplete");
        put(r->where, sizeof r->where, "-");
        json_decref(j);
        return NULL;
    }
    if (*code != 0 && *code != 1) {
        json_decref(j);
        step_error(r, log, "kvdiff compare", *code);
        return NULL;
    }
    if (!json_is_object(j)) {
        r->outcome = SUITE_ERROR;
        put(r->message, sizeof r->message, "%s: not the JSON of kvdiff compare: %s", js,
                 jerr.text);
        json_decref(j);
        return NULL;
    }
    return j;
}

/* Following. An outside runtime that flips a generated token at a near
 * tie feeds itself another token than kvdiff's side from there on, and
 * every later position compares two different contexts: uncompared. A
 * no-bug case whose kvdiff side (one side only) and outside side generated
 * different tokens, where the compare judged that flip drift by the
 * evidence at its position (tokens.flip_drift, with exit 0), therefore
 * re-runs the kvdiff side on the outside side's tokens (`kvdiff run
 * --follow`, teacher forcing) and takes the verdict of that pair, where
 * every position is compared. A flip the evidence does not explain keeps
 * the first compare's failure: following it would compare past a bug.
 * Likewise a router that took another expert at a near tie (the compare
 * stopped there: compared.routing_flip): the followed run routes as the
 * outside side did at every recorded router row (and feeds its tokens),
 * so its compare judges every position, the flip's and all after it, on
 * the same experts, whatever the first compare made of what it saw.
 * Other expectations ask for the tokens themselves (identical, within) or
 * for an injection's divergence: they judge the pair as run. Returns the
 * kvdiff side (0 A, 1 B) to re-run, or -1. */
static int side_to_follow(const suite_case *c, json_t *j, int code, long long *pos,
                          bool *routing)
{
    json_t *tok = json_object_get(j, "tokens");
    json_t *cut = json_object_get(json_object_get(j, "compared"), "routing_flip");
    *routing = json_is_integer(cut);
    if (c->expect.kind != SUITE_EXPECT_NO_BUG || (c->ka == SUITE_SIDE_KVDIFF) ==
        (c->kb == SUITE_SIDE_KVDIFF))
        return -1;
    if (*routing)
        *pos = json_integer_value(cut);
    else if (strcmp(jstr(tok, "verdict"), "differ") ||
             !json_is_true(json_object_get(tok, "flip_drift")) || code != 0)
        return -1;
    else
        *pos = json_integer_value(json_object_get(tok, "position"));
    return c->ka == SUITE_SIDE_KVDIFF ? 0 : 1;
}

/* Runs the steps of c in folder (existing, empty); fills r but for time. */
static void run_steps(const suite_case *c, const char *bin, const char *folder, bool report,
                      suite_result *r)
{
    char log[1100], a[1100], b[1100], js[1100], rep[1100];
    put(log, sizeof log, "%s/log.txt", folder);
    put(a, sizeof a, "%s", c->ka == SUITE_SIDE_DUMP ? c->a[0] : "");
    if (!a[0])
        put(a, sizeof a, "%s/a.h5", folder);
    put(b, sizeof b, "%s", c->kb == SUITE_SIDE_DUMP ? c->b[0] : "");
    if (!b[0])
        put(b, sizeof b, "%s/b.h5", folder);
    put(js, sizeof js, "%s/compare.json", folder);
    put(rep, sizeof rep, "%s/report", folder);
    argbuf args;
    int code;
    json_t *j = NULL;
    /* the folder is new or emptied: nothing is there to follow or replace */
    int log_fd = open(log, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_APPEND | O_CLOEXEC, 0666);
    if (log_fd < 0) {
        r->outcome = SUITE_ERROR;
        put(r->message, sizeof r->message, "cannot write in %s: %s", folder, strerror(errno));
        goto done;
    }
    side_ctx sx = {.c = c, .bin = bin, .folder = folder, .log_fd = log_fd, .log = log};
    step_kvdiff = bin;
    if (run_side(&sx, "engine A", c->ka, c->a, c->na, a, r) < 0 ||
        run_side(&sx, "engine B", c->kb, c->b, c->nb, b, r) < 0)
        goto done;
    if (!(j = compare_pair(c, bin, a, b, js, log, log_fd, &code, r)))
        goto done;
    long long flip = -1;
    bool routing = false;
    int side = side_to_follow(c, j, code, &flip, &routing);
    if (side >= 0) {
        /* the kvdiff side again, on the other side's tokens; its dump and
         * the compare of the pair take the place of the first ones (the
         * report on a FAIL explains this pair) */
        char *ours = side ? b : a;
        const char *theirs = side ? a : b;
        char step[64];
        put(step, sizeof step, "engine %c followed (kvdiff run --follow)", side ? 'B' : 'A');
        put(ours, sizeof a, "%s/%c-followed.h5", folder, side ? 'b' : 'a');
        put(js, sizeof js, "%s/compare-followed.json", folder);
        json_decref(j);
        j = NULL;
        run_args(&args, bin, c, side ? c->b : c->a, side ? c->nb : c->na, ours, theirs);
        int rc = run_step(args.v, log_fd, log_fd);
        if (rc != 0) {
            step_error(r, log, step, rc);
            goto done;
        }
        if (!(j = compare_pair(c, bin, a, b, js, log, log_fd, &code, r)))
            goto done;
    }
    judge(c, j, code, r);
    if (side >= 0) {
        /* say so wherever the case is shown: its row, its message */
        char was[sizeof r->where];
        put(was, sizeof was, "%s", r->where);
        put(r->where, sizeof r->where, "%s (followed from position %lld)", was, flip);
        size_t used = strlen(r->got);
        if (routing)
            put(r->got + used, sizeof r->got - used, "; engine %c re-run on engine %c's "
                "tokens and routing (kvdiff run --follow), whose router took another expert "
                "at a near tie at position %lld", side ? 'B' : 'A', side ? 'A' : 'B', flip);
        else
            put(r->got + used, sizeof r->got - used, "; engine %c re-run on engine %c's "
                "tokens (kvdiff run --follow), which differed from position %lld",
                side ? 'B' : 'A', side ? 'A' : 'B', flip);
        if (r->outcome == SUITE_FAIL) {   /* the message quotes got: refresh it */
            char want[256];
            suite_expect_describe(&c->expect, want, sizeof want);
            put(r->message, sizeof r->message, "expected %s; got %s", want, r->got);
        }
    }
done:
    json_decref(j);
    /* A report explains a comparison that ran and missed its expectation;
     * after an ERROR the dumps may be partial or absent, and a report of
     * them would only mislead. The report says what the case expected. */
    if (r->outcome == SUITE_FAIL && report && log_fd >= 0 && access(a, R_OK) == 0 &&
        access(b, R_OK) == 0) {
        char want[256], note[512];
        suite_expect_describe(&c->expect, want, sizeof want);
        if (c->expect.kind == SUITE_EXPECT_DETECTS)
            put(note, sizeof note, "suite case %s expected: %s (diagnosis %s)", c->name, want,
                suite_injection_diagnosis(c->expect.injection));
        else
            put(note, sizeof note, "suite case %s expected: %s", c->name, want);
        args.n = 0;
        arg(&args, bin);
        arg(&args, "report");
        arg(&args, a);
        arg(&args, b);
        arg(&args, "-o");
        arg(&args, rep);
        arg(&args, "--note");
        arg(&args, note);
        run_step(args.v, log_fd, log_fd);
    }
    if (log_fd >= 0)
        close(log_fd);
}

/* Runs case c in its folder, which the runner made (folder_error: why it
 * could not, and the case is an ERROR without one). */
static void run_case(const suite_case *c, const suite_run_opts *o, const char *folder_error,
                     suite_result *r)
{
    kv_err e = {{0}};
    double t0 = now_s();
    memset(r, 0, sizeof *r);
    put(r->folder, sizeof r->folder, "%s/%s", o->workdir, c->name);
    put(r->where, sizeof r->where, "-");
    if (folder_error) {
        r->outcome = SUITE_ERROR;
        put(r->got, sizeof r->got, "error");
        put(r->message, sizeof r->message, "%s", folder_error);
        r->folder[0] = 0;   /* not the suite's: nothing of it is shown as kept */
    } else {
        run_steps(c, o->kvdiff, r->folder, o->report, r);
    }
    if (r->outcome == SUITE_PASS) {
        if (suite_case_folder_remove(r->folder, &e) < 0) {
            r->outcome = SUITE_ERROR;
            put(r->message, sizeof r->message, "passed, but %s", e.msg);
        } else {
            r->folder[0] = 0;
        }
    }
    r->seconds = now_s() - t0;
}

/* ------------------------------------------------------------------ */
/* Inputs                                                               */

/* The file execvp runs for name: name itself when it holds a '/', else
 * the first executable regular file name in PATH (unset: /bin:/usr/bin;
 * an empty entry: the current folder). False when there is none. */
static bool find_program(const char *name, char *out, size_t n)
{
    struct stat st;
    if (strchr(name, '/')) {
        put(out, n, "%s", name);
        return true;
    }
    const char *path = getenv("PATH");
    for (const char *p = path ? path : "/bin:/usr/bin";;) {
        const char *colon = strchr(p, ':');
        int len = colon ? (int)(colon - p) : (int)strlen(p);
        put(out, n, "%.*s%s%s", len, p, len ? "/" : "", name);
        if (stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0)
            return true;
        if (!colon)
            return false;
        p = colon + 1;
    }
}

static bool has_placeholder(const char *w)
{
    return strstr(w, "{model}") || strstr(w, "{tokens}") || strstr(w, "{max_new}") ||
           strstr(w, "{dump}");
}

/* An exec: side's programs and the files its words name. */
static void note_exec(char **argv, int argc)
{
    char path[PATH_MAX];
    kv_err e = {{0}};
    unsigned char *kinds = malloc((size_t)argc + 1);
    if (!kinds || suite_exec_words(argv, argc, kinds, &e) < 0) {
        free(kinds);
        return;
    }
    for (int i = 0; i < argc; i++) {
        if (has_placeholder(argv[i]) || kinds[i] == SUITE_WORD_SHELL)
            continue;
        if (kinds[i] == SUITE_WORD_PROGRAM) {
            if (find_program(argv[i], path, sizeof path))
                outfile_note_input(path);
            continue;
        }
        outfile_note_input(argv[i]);
        const char *eq = strchr(argv[i], '=');
        if (eq && eq[1])
            outfile_note_input(eq + 1);
    }
    free(kinds);
}

/* Every file of a model folder (a preset has none). */
static void note_model(const char *model)
{
    DIR *d = opendir(model);
    if (!d)
        return;
    char path[PATH_MAX];
    for (struct dirent *de; (de = readdir(d));)
        if ((size_t)snprintf(path, sizeof path, "%s/%s", model, de->d_name) < sizeof path)
            outfile_note_input(path);
    closedir(d);
}

void suite_note_inputs(const suite *s, const int *sel, int n, const char *kvdiff)
{
    bool llama = false;
    outfile_note_input(s->path);
    outfile_note_input(kvdiff);
    for (int i = 0; i < n; i++) {
        const suite_case *c = &s->cases[sel[i]];
        if (c->prompt.kind == SUITE_PROMPT_FILE || c->prompt.kind == SUITE_PROMPT_TEXT_FILE)
            outfile_note_input(c->prompt.text);
        outfile_note_input(c->gguf);
        note_model(c->model);
        for (int side = 0; side < 2; side++) {
            char **argv = side ? c->b : c->a;
            const suite_side_kind k = side ? c->kb : c->ka;
            if (k == SUITE_SIDE_DUMP && argv)
                outfile_note_input(argv[0]);
            else if (k == SUITE_SIDE_EXEC && argv)
                note_exec(argv, side ? c->nb : c->na);
            llama |= k == SUITE_SIDE_LLAMA;
        }
    }
    if (llama) {
        char rec[1100], path[PATH_MAX];
        llama_bin(kvdiff, rec, sizeof rec);
        if (find_program(rec, path, sizeof path))
            outfile_note_input(path);
    }
}

/* ------------------------------------------------------------------ */
/* Workers                                                              */

typedef struct {
    pid_t pid;
    int fd;                      /* read end of the worker's result pipe; -1 free */
    int idx;                     /* into sel / results */
    size_t got;
    suite_result r;
} slot;

static int start_worker(const suite *s, const int *sel, int idx, const suite_run_opts *o,
                        slot *sl, kv_err *e)
{
    int fds[2];
    /* the case's folder, made here in the runner: a worker killed by a
     * stop cannot leave one behind without its mark */
    char folder[sizeof ((suite_result *)0)->folder];
    kv_err ferr = {{0}};
    int frc;
    if ((size_t)snprintf(folder, sizeof folder, "%s/%s", o->workdir, s->cases[sel[idx]].name) >=
        sizeof folder)
        frc = kv_errf(&ferr, "%s/%s: path too long", o->workdir, s->cases[sel[idx]].name);
    else
        frc = case_folder_make(folder, &ferr);
    if (pipe(fds) < 0)
        return kv_errf(e, "cannot make a pipe: %s", strerror(errno));
    fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    fcntl(fds[1], F_SETFD, FD_CLOEXEC);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return kv_errf(e, "cannot start a worker: %s", strerror(errno));
    }
    if (pid == 0) {
        close(fds[0]);
        /* A process group of its own, so an interrupted run kills the
         * worker with its steps (and a terminal's Ctrl-C reaches the runner
         * alone, which then does that); the runner's stop handlers are not
         * the worker's. */
        setpgid(0, 0);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, worker_term);
        step_timeout = o->step_timeout;
        /* A file size limit makes writes fail (EFBIG) with a reason the
         * case reports, instead of killing the worker without one. */
        signal(SIGXFSZ, SIG_IGN);
        suite_result r;
        run_case(&s->cases[sel[idx]], o, frc < 0 ? ferr.msg : NULL, &r);
        const char *p = (const char *)&r;
        size_t left = sizeof r;
        while (left > 0) {
            ssize_t w = write(fds[1], p, left);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                _exit(1);
            p += w;
            left -= (size_t)w;
        }
        _exit(0);
    }
    close(fds[1]);
    setpgid(pid, pid);   /* as the child does: whichever runs first */
    memset(sl, 0, sizeof *sl);
    sl->pid = pid;
    sl->fd = fds[0];
    sl->idx = idx;
    return 0;
}

/* The worker's pipe reached end of file: reap it and take its result. */
static void finish_worker(const suite *s, const int *sel, slot *sl, suite_result *out)
{
    int st = 0;
    close(sl->fd);
    sl->fd = -1;
    while (waitpid(sl->pid, &st, 0) < 0 && errno == EINTR) {
    }
    if (sl->got == sizeof sl->r) {
        *out = sl->r;
        return;
    }
    memset(out, 0, sizeof *out);
    out->outcome = SUITE_ERROR;
    put(out->got, sizeof out->got, "error");
    put(out->where, sizeof out->where, "-");
    if (WIFSIGNALED(st))
        put(out->message, sizeof out->message, "the worker of case '%s' died (signal %d: %s)",
            s->cases[sel[sl->idx]].name, WTERMSIG(st), strsignal(WTERMSIG(st)));
    else
        put(out->message, sizeof out->message, "the worker of case '%s' died (exit status %d)",
            s->cases[sel[sl->idx]].name, WEXITSTATUS(st));
}

static bool stopped(const suite_run_opts *o)
{
    return o->stop && *o->stop;
}

static void skipped(suite_result *r, const char *why)
{
    memset(r, 0, sizeof *r);
    r->outcome = SUITE_SKIPPED;
    put(r->got, sizeof r->got, "skipped");
    put(r->where, sizeof r->where, "-");
    put(r->message, sizeof r->message, "%s", why);
}

/* An interrupted run: kills the running workers with their steps, removes
 * their half-done folders, and marks them and the cases never started
 * SKIPPED. */
static void stop_run(const suite *s, const int *sel, int n, const suite_run_opts *o, slot *slots,
                     int jobs, int next, suite_result *results)
{
    for (int i = 0; i < jobs; i++) {
        if (slots[i].fd < 0)
            continue;
        /* SIGTERM first: the worker kills its step's group, then itself */
        kill(-slots[i].pid, SIGTERM);
        for (int t = 0; t < 100 && waitpid(slots[i].pid, NULL, WNOHANG) == 0; t++) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
        kill(-slots[i].pid, SIGKILL);
        close(slots[i].fd);
        slots[i].fd = -1;
        while (waitpid(slots[i].pid, NULL, 0) < 0 && errno == EINTR) {
        }
        const int idx = slots[i].idx;
        char folder[PATH_MAX];
        kv_err ignored = {{0}};
        if ((size_t)snprintf(folder, sizeof folder, "%s/%s", o->workdir,
                             s->cases[sel[idx]].name) < sizeof folder)
            suite_case_folder_remove(folder, &ignored);   /* only one the suite made */
        skipped(&results[idx], "interrupted while running (its files were removed)");
    }
    for (int k = next; k < n; k++)
        skipped(&results[k], "not run: the suite was interrupted");
}

int suite_run(const suite *s, const int *sel, int n, const suite_run_opts *o,
              suite_result *results, kv_err *e)
{
    int jobs = o->jobs < 1 ? 1 : o->jobs > 64 ? 64 : o->jobs;
    slot slots[64];
    struct pollfd pfd[64];
    int next = 0, done = 0, running = 0, rc = 0;
    for (int i = 0; i < jobs; i++)
        slots[i].fd = -1;
    while (done < n) {
        if (stopped(o)) {
            stop_run(s, sel, n, o, slots, jobs, next, results);
            return 0;
        }
        for (int i = 0; i < jobs && next < n && rc == 0; i++)
            if (slots[i].fd < 0) {
                if (start_worker(s, sel, next, o, &slots[i], e) < 0)
                    rc = -1;
                else
                    next++, running++;
            }
        if (running == 0)
            break;   /* could not start anything */
        int np = 0, map[64];
        for (int i = 0; i < jobs; i++)
            if (slots[i].fd >= 0) {
                pfd[np].fd = slots[i].fd;
                pfd[np].events = POLLIN;
                pfd[np].revents = 0;
                map[np++] = i;
            }
        /* A stop signal landing between the check above and poll would
         * wait for a case to finish: wake at least every 200 ms. */
        if (poll(pfd, (nfds_t)np, o->stop ? 200 : -1) < 0) {
            if (errno == EINTR)
                continue;
            rc = kv_errf(e, "poll: %s", strerror(errno));
            break;
        }
        for (int k = 0; k < np; k++) {
            if (!pfd[k].revents)
                continue;
            slot *sl = &slots[map[k]];
            char *dst = (char *)&sl->r + sl->got;
            size_t room = sizeof sl->r - sl->got;
            char sink[256];
            ssize_t got = read(sl->fd, room ? dst : sink, room ? room : sizeof sink);
            if (got < 0 && errno == EINTR)
                continue;
            if (got > 0) {
                if (room)
                    sl->got += (size_t)got;
                continue;
            }
            finish_worker(s, sel, sl, &results[sl->idx]);
            running--;
            done++;
            if (o->on_done)
                o->on_done(o->ctx, done, n, &s->cases[sel[sl->idx]], &results[sl->idx]);
        }
    }
    /* After a start failure: let the running ones finish, unreported. */
    for (int i = 0; i < jobs; i++)
        if (slots[i].fd >= 0) {
            close(slots[i].fd);
            waitpid(slots[i].pid, NULL, 0);
        }
    return rc;
}

bool suite_has_verb(const char *kvdiff, const char *verb)
{
    char *argv[] = {(char *)kvdiff, (char *)verb, "--help", NULL};
    int null_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null_fd < 0)
        return false;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(null_fd, 1);
        dup2(null_fd, 2);
        execv(kvdiff, argv);
        _exit(127);
    }
    close(null_fd);
    int st;
    if (pid < 0)
        return false;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return false;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

const char *suite_outcome_name(suite_outcome o)
{
    return o == SUITE_PASS ? "pass" : o == SUITE_FAIL ? "FAIL" : o == SUITE_ERROR ? "ERROR"
                                                                               : "skipped";
}

/* ------------------------------------------------------------------ */
/* JUnit XML                                                            */

/* Escapes text for XML attributes and content; bytes outside printable
 * ASCII (but tab and newline) become '?', so the file is always valid. */
static void xml_text(FILE *f, const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '&') fputs("&amp;", f);
        else if (*p == '<') fputs("&lt;", f);
        else if (*p == '>') fputs("&gt;", f);
        else if (*p == '"') fputs("&quot;", f);
        else if (*p == '\'') fputs("&apos;", f);
        else if (*p == '\n') fputs("&#10;", f);
        else if (*p == '\t' || (*p >= 0x20 && *p < 0x7f)) fputc(*p, f);
        else fputc('?', f);
    }
}

void suite_junit_stream(FILE *f, const suite *s, const int *sel, int n,
                        const suite_result *results)
{
    int fails = 0, errors = 0, skips = 0;
    double total = 0;
    for (int i = 0; i < n; i++) {
        fails += results[i].outcome == SUITE_FAIL;
        errors += results[i].outcome == SUITE_ERROR;
        skips += results[i].outcome == SUITE_SKIPPED;
        total += results[i].seconds;
    }
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    fprintf(f, "<testsuites name=\"kvdiff suite\" tests=\"%d\" failures=\"%d\" errors=\"%d\" "
               "time=\"%.3f\">\n", n, fails, errors, total);
    fprintf(f, "  <testsuite name=\"");
    xml_text(f, s->name);
    fprintf(f, "\" tests=\"%d\" failures=\"%d\" errors=\"%d\" skipped=\"%d\" time=\"%.3f\">\n",
            n, fails, errors, skips, total);
    for (int i = 0; i < n; i++) {
        const suite_case *c = &s->cases[sel[i]];
        const suite_result *r = &results[i];
        char want[256];
        suite_expect_describe(&c->expect, want, sizeof want);
        fprintf(f, "    <testcase classname=\"kvdiff.");
        xml_text(f, s->name);
        fprintf(f, "\" name=\"");
        xml_text(f, c->name);
        fprintf(f, "\" time=\"%.3f\"", r->seconds);
        if (r->outcome == SUITE_PASS) {
            fprintf(f, "/>\n");
            continue;
        }
        if (r->outcome == SUITE_SKIPPED) {
            fprintf(f, ">\n      <skipped message=\"");
            xml_text(f, r->message);
            fprintf(f, "\"/>\n    </testcase>\n");
            continue;
        }
        const char *tag = r->outcome == SUITE_FAIL ? "failure" : "error";
        fprintf(f, ">\n      <%s type=\"%s\" message=\"", tag,
                r->outcome == SUITE_FAIL ? "expectation" : "step");
        xml_text(f, r->message);
        fprintf(f, "\">expected: ");
        xml_text(f, want);
        fprintf(f, "\ngot: ");
        xml_text(f, r->got);
        if (r->last_line[0]) {
            fprintf(f, "\nlast line: ");
            xml_text(f, r->last_line);
        }
        if (r->folder[0]) {
            fprintf(f, "\nkept: ");
            xml_text(f, r->folder);
        }
        fprintf(f, "</%s>\n    </testcase>\n", tag);
    }
    fprintf(f, "  </testsuite>\n</testsuites>\n");
}

int suite_write_junit(const char *path, const suite *s, const int *sel, int n,
                      const suite_result *results, kv_err *e)
{
    /* Written whole or not at all, through a fresh temporary name (no
     * predictable PATH.tmp a symlink could be planted at). */
    outfile o;
    if (outfile_open(&o, path, e) < 0)
        return -1;
    suite_junit_stream(o.f, s, sel, n, results);
    return outfile_commit(&o, e);
}
