/* bench_dump.c — what recording costs.
 *
 * A 1024-token prompt (plus a few decode steps) through the reference
 * engine on qwen2.5-0.5b-shape, three ways: no dump, --fingerprint, and a
 * full dump; next to the disk's raw write rate measured here with plain
 * write() calls of 1 MiB. Targets: fingerprint overhead <= 5%; full dump >=
 * 70% of the raw write rate.
 *
 * Other people share the machine, so one run of each says little: the
 * configurations run in interleaved rounds (none, fingerprint, full, raw;
 * none, fingerprint, full, raw; ...) and the figures come from the fastest
 * run of each. The spread (slowest over fastest) and the load average
 * before and after are printed so a reader can tell how noisy it was.
 * The raw rate is that of the write right after the full dump's file is
 * deleted, the reference the targets were set against; a second write
 * straight after it usually runs several times faster (on the VMs we use,
 * memory freed a moment ago is cheap to fill again, memory freed a while
 * ago is not), and is printed and recorded too, as the page cache's best.
 * Under load the difference of two whole runs is mostly noise, so the
 * time spent inside the recorder (observer calls and dump_close, the
 * least over the rounds) is reported beside it.
 * Prints a table and appends rows to the TSV named on the command line.
 * Decode steps are flushed one by one (a crash keeps every finished
 * position): a short PROMPT with many NEW decode steps measures what
 * that costs. On qwen2.5-0.5b-shape (24 layers, 720 datasets in
 * fingerprint mode, 1080 in a full dump) a decode step costs the recorder
 * about 8 ms of CPU for a fingerprint and 30 ms for a full dump, where
 * rows waiting for their block of 64 cost nothing before; with 8 decode
 * steps after a 1024-token prompt (the default run) the fingerprint
 * overhead stayed under 5%.
 * Usage: bench_dump OUT.tsv [DIR] [PRESET] [PROMPT] [ROUNDS] [NEW] */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dump/dump.h"
#include "bench/bench_common.h"
#include "model/generate.h"
#include "reference/reference.h"

/* MB/s of writing `mib` MiB to a fresh file, through the page cache as
 * the dump is (then removed). */
static double raw_write_rate(const char *dir, int mib)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/bench_raw.bin", dir);
    char *buf = malloc(1 << 20);
    memset(buf, 0x5a, 1 << 20);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || !buf) {
        free(buf);
        return 0;
    }
    double t0 = now_s();
    for (int i = 0; i < mib; i++)
        if (write(fd, buf, 1 << 20) != 1 << 20)
            break;
    close(fd);
    double t = now_s() - t0;
    unlink(path);
    free(buf);
    return mib * 1.048576 / t;
}

typedef struct {
    double seconds;
    double bytes;
    double recorder;   /* seconds inside the dump's observer calls and dump_close */
} run_cost;

/* Passes events on to the dump's observer, timing each call: the engine
 * waits for the recorder during them, so their sum is the recording's own
 * cost, which the load of other people's work inflates far less than the
 * difference of two whole runs. */
typedef struct {
    kv_observer base;
    kv_observer *inner;
    double seconds;
} timed_observer;

static int timed_emit(kv_observer *self, const kv_event *ev)
{
    timed_observer *t = (timed_observer *)self;
    double t0 = now_s();
    int rc = t->inner->emit(t->inner, ev);
    t->seconds += now_s() - t0;
    return rc;
}

static int timed_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    timed_observer *t = (timed_observer *)self;
    double t0 = now_s();
    int rc = t->inner->token(t->inner, pos, id, is_prompt);
    t->seconds += now_s() - t0;
    return rc;
}

static int timed_wants(kv_observer *self, kv_stage st, int layer)
{
    timed_observer *t = (timed_observer *)self;
    return t->inner->wants(t->inner, st, layer);
}

static run_cost timed_run(const kv_model *m, const kern_ctx *kc, const int32_t *prompt, int n,
                          int nnew, const char *path, bool fingerprint)
{
    kv_err e = {{0}};
    dump_writer *w = NULL;
    if (path) {
        dump_opts o;
        dump_opts_default(&o);
        o.fingerprint = fingerprint;
        o.pool = kc->pool;   /* as kvdiff run does */
        dump_meta meta = {.engine = "reference", .engine_settings = "{}", .cfg = &m->cfg,
                          .weight_fingerprint = m->fingerprint, .tool_version = "kvdiff bench",
                          .max_positions = n + nnew, .prompt_length = n};
        w = dump_create(path, &meta, &o, &e);
        if (!w) {
            fprintf(stderr, "bench: %s\n", e.msg);
            exit(1);
        }
    }
    timed_observer timed = {.base = {.emit = timed_emit, .token = timed_token, .wants = timed_wants}};
    kv_observer *obs = NULL;
    if (w) {
        timed.inner = dump_observer(w);
        timed.base.all_logits = timed.inner->all_logits;
        obs = &timed.base;
    }
    ref_opts ro = {.max_ctx = n + nnew, .prefill_step = 0};
    double t0 = now_s();
    kv_engine *eng = ref_create(m, kc, &ro, obs, &e);
    gen_opts go = {.max_new = nnew, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    if (!eng || generate(eng, &m->cfg, prompt, n, &go, obs, &res, &e) != 0) {
        fprintf(stderr, "bench: %s\n", e.msg);
        exit(1);
    }
    double t_close = now_s();
    if (w && dump_close(w, NULL, &e) < 0) {
        fprintf(stderr, "bench: %s\n", e.msg);
        exit(1);
    }
    double t1 = now_s();
    run_cost rc = {.seconds = t1 - t0, .bytes = 0, .recorder = timed.seconds + (t1 - t_close)};
    struct stat sb;
    if (path && stat(path, &sb) == 0)
        rc.bytes = (double)sb.st_size;
    gen_result_free(&res);
    engine_free(eng);
    return rc;
}

/* Fastest and slowest of one configuration over the rounds. */
typedef struct {
    double best, worst, bytes, recorder;   /* recorder: the least over the rounds */
} best_of;

static void best_add(best_of *b, run_cost rc)
{
    if (b->best == 0 || rc.seconds < b->best)
        b->best = rc.seconds;
    if (rc.seconds > b->worst)
        b->worst = rc.seconds;
    b->bytes = rc.bytes;
    if (b->recorder == 0 || rc.recorder < b->recorder)
        b->recorder = rc.recorder;
}

static double spread_pct(const best_of *b)
{
    return b->best > 0 ? 100.0 * (b->worst - b->best) / b->best : 0;
}

static double load1(void)
{
    double l[1] = {0};
    return getloadavg(l, 1) == 1 ? l[0] : -1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_dump OUT.tsv [DIR] [PRESET] [PROMPT] [ROUNDS] [NEW]\n");
        return 2;
    }
    const char *dir = argc > 2 ? argv[2] : "/tmp";
    const char *preset = argc > 3 ? argv[3] : "qwen2.5-0.5b-shape";
    int n = argc > 4 ? atoi(argv[4]) : 1024;
    int rounds = argc > 5 ? atoi(argv[5]) : 4;
    int nnew = argc > 6 ? atoi(argv[6]) : 8;
    if (n < 1 || rounds < 1 || nnew < 0) {
        fprintf(stderr, "bench: PROMPT and ROUNDS must be positive\n");
        return 2;
    }
    kv_err e = {{0}};
    kv_model m;
    model_opts mo = {.wtype = KERN_F32};
    if (model_from_preset(preset, 0, &mo, &m, &e) < 0) {
        fprintf(stderr, "bench: %s\n", e.msg);
        return 1;
    }
    kern_ctx kc = {.isa = kern_isa_best(), .pool = pool_create(2)};
    int32_t *prompt = malloc((size_t)n * sizeof *prompt);
    for (int i = 0; i < n; i++)
        prompt[i] = (int32_t)((i * 7919 + 13) % m.cfg.vocab);
    char fp_path[4096], full_path[4096];
    snprintf(fp_path, sizeof fp_path, "%s/bench_fp.h5", dir);
    snprintf(full_path, sizeof full_path, "%s/bench_full.h5", dir);

    double load_before = load1();
    best_of none = {0}, fp = {0}, full = {0};
    double raw = 0, raw_worst = 0, warm = 0;
    /* Per round, the full dump's rate over the raw write that follows it:
     * both write a fresh file right after a big one was deleted, so a round
     * compares like with like even when the page cache's mood swings 4x
     * between rounds (it does on this kind of VM). */
    double *ratio = calloc((size_t)rounds, sizeof *ratio);
    for (int r = 0; r < rounds; r++) {
        run_cost rn = timed_run(&m, &kc, prompt, n, nnew, NULL, false);
        best_add(&none, rn);
        best_add(&fp, timed_run(&m, &kc, prompt, n, nnew, fp_path, true));
        unlink(fp_path);
        run_cost rf = timed_run(&m, &kc, prompt, n, nnew, full_path, false);
        best_add(&full, rf);
        unlink(full_path);
        double rate = raw_write_rate(dir, (int)(full.bytes / (1 << 20)) + 1);
        if (ratio && rf.seconds > rn.seconds && rate > 0)
            ratio[r] = rf.bytes / 1e6 / (rf.seconds - rn.seconds) / rate;
        if (rate > raw)
            raw = rate;
        if (raw_worst == 0 || rate < raw_worst)
            raw_worst = rate;
        double again = raw_write_rate(dir, (int)(full.bytes / (1 << 20)) + 1);
        if (again > warm)
            warm = again;
        fprintf(stderr, "round %d/%d: none %.2f s, fingerprint %.2f s, full %.2f s, raw %.0f MB/s\n",
                r + 1, rounds, none.best, fp.best, full.best, rate);
    }
    double load_after = load1();
    /* Median of the per-round ratios (insertion sort: a handful). */
    for (int i = 1; ratio && i < rounds; i++)
        for (int j = i; j > 0 && ratio[j] < ratio[j - 1]; j--) {
            double t = ratio[j];
            ratio[j] = ratio[j - 1];
            ratio[j - 1] = t;
        }
    double ratio_median = !ratio ? 0
                          : rounds % 2 ? ratio[rounds / 2]
                                       : 0.5 * (ratio[rounds / 2 - 1] + ratio[rounds / 2]);
    double extra = full.best - none.best;
    double dump_rate = extra > 0 ? full.bytes / 1e6 / extra : 0;
    double fp_over = 100.0 * (fp.best - none.best) / none.best;

    printf("fastest of %d interleaved rounds (spread: slowest over fastest); load %.2f -> %.2f\n",
           rounds, load_before, load_after);
    printf("%-28s %10s %8s %12s\n", "run", "seconds", "spread", "file MB");
    printf("%-28s %10.2f %7.1f%% %12s\n", "no dump", none.best, spread_pct(&none), "-");
    printf("%-28s %10.2f %7.1f%% %12.3f   overhead %+.1f%%\n", "fingerprint", fp.best,
           spread_pct(&fp), fp.bytes / 1e6, fp_over);
    printf("%-28s %10.2f %7.1f%% %12.1f   written at %.0f MB/s (raw disk %.0f MB/s, %.0f%%)\n",
           "full dump", full.best, spread_pct(&full), full.bytes / 1e6, dump_rate, raw,
           100.0 * dump_rate / raw);
    printf("full dump over the raw write of the same round: median %.0f%% (rounds %.0f%% .. %.0f%%)\n",
           100.0 * ratio_median, ratio ? 100.0 * ratio[0] : 0,
           ratio ? 100.0 * ratio[rounds - 1] : 0);
    printf("%-28s %10s %7.1f%%\n", "raw write", "-", raw > 0 ? 100.0 * (raw - raw_worst) / raw : 0);
    printf("%-28s %10s %8s %12s   %.0f MB/s (full dump at %.0f%% of it)\n", "raw write, again", "-", "",
           "", warm, warm > 0 ? 100.0 * dump_rate / warm : 0);
    /* The same figures from the time spent inside the recorder alone. */
    double fp_rec = 100.0 * fp.recorder / none.best;
    double full_rec_rate = full.recorder > 0 ? full.bytes / 1e6 / full.recorder : 0;
    printf("recorder time alone: fingerprint %.3f s (%.1f%% of no dump), full %.3f s (%.0f MB/s, "
           "%.0f%% of raw, %.0f%% of raw again)\n", fp.recorder, fp_rec, full.recorder,
           full_rec_rate, raw > 0 ? 100.0 * full_rec_rate / raw : 0,
           warm > 0 ? 100.0 * full_rec_rate / warm : 0);
    FILE *tsv = fopen(argv[1], "a");
    if (tsv) {
        char date[32], head[64];
        time_t t = time(NULL);
        strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", gmtime(&t));
        git_head(head, sizeof head);
        const char *row = "%s\t%s\tdump\t%s\tf32\t2\t%s\t%.*f\n";
        fprintf(tsv, row, date, head, preset, "fingerprint_overhead_pct", 1, fp_over);
        fprintf(tsv, row, date, head, preset, "full_dump_MB_s", 0, dump_rate);
        fprintf(tsv, row, date, head, preset, "raw_write_MB_s", 0, raw);
        fprintf(tsv, row, date, head, preset, "full_dump_pct_of_raw", 1, 100.0 * dump_rate / raw);
        fprintf(tsv, row, date, head, preset, "full_dump_pct_of_raw_same_round_median", 1,
                100.0 * ratio_median);
        fprintf(tsv, row, date, head, preset, "raw_write_again_MB_s", 0, warm);
        fprintf(tsv, row, date, head, preset, "fingerprint_recorder_pct", 1, fp_rec);
        fprintf(tsv, row, date, head, preset, "full_recorder_MB_s", 0, full_rec_rate);
        fprintf(tsv, row, date, head, preset, "rounds", 0, (double)rounds);
        fprintf(tsv, row, date, head, preset, "load1_before", 2, load_before);
        fprintf(tsv, row, date, head, preset, "load1_after", 2, load_after);
        fclose(tsv);
    }
    free(ratio);
    free(prompt);
    pool_free(kc.pool);
    model_free(&m);
    return 0;
}
