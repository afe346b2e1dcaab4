/* testutil.c — test helpers (testutil.h). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int capture_emit(kv_observer *self, const kv_event *ev)
{
    capture *c = (capture *)self;
    int li = ev->layer + 1;
    if (!c->rows[ev->stage][li]) {
        c->rows[ev->stage][li] = calloc((size_t)c->T * ev->ncols, sizeof(float));
        c->ncols[ev->stage][li] = ev->ncols;
    }
    if (ev->ncols != c->ncols[ev->stage][li])
        return 1;
    for (int r = 0; r < ev->nrows; r++) {
        int64_t p = ev->pos0 + r;
        if (p < 0 || p >= c->T)
            continue;
        memcpy(c->rows[ev->stage][li] + (size_t)p * ev->ncols,
               ev->data + (size_t)r * ev->ncols, (size_t)ev->ncols * sizeof(float));
    }
    return 0;
}

static int capture_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    capture *c = (capture *)self;
    (void)is_prompt;
    if (pos >= 0 && pos < (int64_t)(sizeof c->tokens / sizeof *c->tokens)) {
        c->tokens[pos] = id;
        if (pos + 1 > c->n_tokens)
            c->n_tokens = (int)pos + 1;
    }
    return 0;
}

capture *capture_new(int T)
{
    capture *c = calloc(1, sizeof *c);
    c->T = T;
    c->base.emit = capture_emit;
    c->base.token = capture_token;
    c->base.all_logits = 1;
    return c;
}

void capture_free(capture *c)
{
    if (!c)
        return;
    for (int s = 0; s < STAGE_COUNT; s++)
        for (int l = 0; l <= KV_MAX_LAYERS; l++)
            free(c->rows[s][l]);
    free(c);
}

const float *capture_get(const capture *c, kv_stage st, int layer, int *ncols)
{
    if (ncols)
        *ncols = c->ncols[st][layer + 1];
    return c->rows[st][layer + 1];
}

char *test_tmpdir(char *buf, size_t n)
{
    snprintf(buf, n, "/tmp/kvdiff-test-XXXXXX");
    return mkdtemp(buf);
}

void test_rmtree(const char *dir)
{
    char cmd[4200];
    if (!dir || strncmp(dir, "/tmp/kvdiff-test-", 17) != 0)
        return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int test_run_cli(const char *args, char *out, size_t n)
{
    const char *bin = getenv("KVDIFF_BIN");
    return test_run_program(bin ? bin : "./kvdiff", args, out, n);
}

int test_run_program(const char *bin, const char *args, char *out, size_t n)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", bin, args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t len = fread(out, 1, n - 1, p);
    out[len] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

double test_rel_err(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > md || isnan(d))
            md = isnan(d) ? INFINITY : d;
        if (fabs((double)b[i]) > mb)
            mb = fabs((double)b[i]);
    }
    return mb > 0 ? md / mb : md;
}

int test_record_cut_short(const char *dir)
{
    static const char run[] = "run --model tiny-gemma3 --prompt-random 200 --seed 4 "
                              "--max-new 16 --ignore-eos";
    char args[1024], out[4096];
    snprintf(args, sizeof args, "%s --dump %s/ref.h5", run, dir);
    if (test_run_cli(args, out, sizeof out) != 0)
        return -1;
    /* bash: its ulimit -f counts KiB (dash's counts 512-byte blocks). */
    const char *bin = getenv("KVDIFF_BIN");
    snprintf(args, sizeof args, "bash -c 'ulimit -f 3000; exec \"%s\" %s --engine chunked "
             "--chunk 5 --dump %s/part.h5 >/dev/null 2>&1'", bin ? bin : "./kvdiff", run, dir);
    return system(args) != 0 ? 0 : -1;   /* the limit must have stopped it */
}

int test_layer_stages(const kv_config *c)
{
    return STAGE_LAYER_COUNT - (c->per_layer_dim > 0 ? 0 : 2) - (c->attn_sinks ? 0 : 1) -
           (c->n_experts > 0 ? 0 : 1) - (config_mla(c) ? 0 : 1);
}

int test_copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    char buf[1 << 16];
    size_t n;
    int rc = a && b ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, a)) > 0)
        rc = fwrite(buf, 1, n, b) == n ? 0 : -1;
    if (a && ferror(a))
        rc = -1;
    if (a)
        fclose(a);
    if (b && fclose(b) != 0)
        rc = -1;
    return rc;
}

pid_t test_start_long_run(const char *path)
{
    const char *bin = getenv("KVDIFF_BIN");
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execl(bin ? bin : "./kvdiff", "kvdiff", "run", "--model", "tiny-gemma3", "--prompt-random",
              "96", "--max-new", "4000", "--ignore-eos", "--dump", path, (char *)NULL);
        _exit(127);
    }
    /* The prompt's rows are about 2 MB; past 4 MB it is decoding. */
    struct stat sb;
    while (stat(path, &sb) != 0 || sb.st_size <= (4 << 20)) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid)
            return -1;
        usleep(5000);
    }
    return pid;
}
