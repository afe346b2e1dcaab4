/* check_follow.c — `kvdiff run --follow TEST.h5`: the engine teacher-forced
 * on another run's tokens.
 *
 * A followed run's /tokens are the test's byte for byte; before the first
 * token where the test parted from the reference, every row and /output
 * row is the plain reference run's, bit for bit; from there on it is what
 * the engine computes on the test's tokens: following a reference run of
 * its own (sampled) reproduces that run entirely, and the chunked engine
 * followed is the reference followed. Bad files and options conflicting
 * with --follow are one line, exit 2, and leave no dump. A suite case
 * whose outside side generated other tokens re-runs its kvdiff side with
 * --follow and takes that pair's verdict (no-bug only); one whose outside
 * side's router took another expert at a near tie is re-run following
 * its routing too. */
#include <check.h>
#include <jansson.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dump/dump.h"
#include "gguf_patch.h"
#include "h5edit.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Helpers                                                              */

static void run_ok(const char *args)
{
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "kvdiff %s\n%s", args, out);
}

static void copy_file(const char *from, const char *to)
{
    ck_assert_msg(test_copy_file(from, to) == 0, "copying %s to %s", from, to);
}

/* The tokens of a dump (malloc'd) and their count. */
static int32_t *tokens_of(const char *path, int64_t *n, int64_t *prompt)
{
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    *n = dump_n_tokens(f);
    *prompt = dump_prompt_length(f);
    int32_t *ids = malloc((size_t)*n * sizeof *ids);
    ck_assert(ids && dump_read_tokens(f, ids, &e) == 0);
    dump_file_close(f);
    return ids;
}

/* The first position where two dumps' tokens differ (-1: none). */
static int64_t first_token_difference(const char *a, const char *b)
{
    int64_t na, nb, pa, pb;
    int32_t *x = tokens_of(a, &na, &pa), *y = tokens_of(b, &nb, &pb);
    ck_assert_int_eq(na, nb);
    ck_assert_int_eq(pa, pb);
    int64_t at = -1;
    for (int64_t i = 0; i < na && at < 0; i++)
        if (x[i] != y[i])
            at = i;
    free(x);
    free(y);
    return at;
}

/* Rows [0, upto) of every stage both dumps hold, every layer and the
 * model-level ones, and of /output: bit-identical. Returns rows compared. */
static int64_t same_rows_before(const char *a, const char *b, int64_t upto)
{
    kv_err e = {{0}};
    dump_file *fa = dump_open(a, &e), *fb = fa ? dump_open(b, &e) : NULL;
    ck_assert_msg(fa && fb, "%s", e.msg);
    int64_t compared = 0;
    for (int layer = -1; layer < dump_n_layers(fa); layer++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info ia = dump_stage_info(fa, layer, (kv_stage)st);
            dump_dataset_info ib = dump_stage_info(fb, layer, (kv_stage)st);
            ck_assert_int_eq(ia.present, ib.present);
            if (!ia.present)
                continue;
            ck_assert_int_eq(ia.first_position, ib.first_position);
            ck_assert_int_eq(ia.cols, ib.cols);
            int64_t lo = ia.first_position, hi = upto;
            if (hi > lo + ia.rows)
                hi = lo + ia.rows;
            if (hi <= lo)
                continue;
            size_t bytes = (size_t)(hi - lo) * (size_t)ia.cols * sizeof(float);
            float *ra = malloc(bytes), *rb = malloc(bytes);
            ck_assert(ra && rb);
            ck_assert_msg(dump_read_rows(fa, layer, (kv_stage)st, 0, hi - lo, ra, &e) == 0 &&
                          dump_read_rows(fb, layer, (kv_stage)st, 0, hi - lo, rb, &e) == 0,
                          "%s", e.msg);
            ck_assert_msg(!memcmp(ra, rb, bytes), "layer %d stage %s differs before position "
                          "%lld", layer, stage_name((kv_stage)st), (long long)upto);
            compared += hi - lo;
            free(ra);
            free(rb);
        }
    dump_dataset_info oa = dump_output_info(fa), ob = dump_output_info(fb);
    ck_assert(oa.present && ob.present && oa.first_position == ob.first_position);
    int k = dump_output_k(fa);
    int64_t n = upto - oa.first_position;
    ck_assert_int_gt(n, 0);
    float *lse = malloc(2 * (size_t)n * sizeof *lse), *vals = malloc(2 * (size_t)n * k * sizeof *vals);
    int32_t *ids = malloc(2 * (size_t)n * k * sizeof *ids);
    ck_assert(lse && vals && ids);
    ck_assert(dump_read_output(fa, 0, n, lse, ids, vals, &e) == 0 &&
              dump_read_output(fb, 0, n, lse + n, ids + n * k, vals + n * k, &e) == 0);
    ck_assert(!memcmp(lse, lse + n, (size_t)n * sizeof *lse) &&
              !memcmp(ids, ids + n * k, (size_t)n * k * sizeof *ids) &&
              !memcmp(vals, vals + n * k, (size_t)n * k * sizeof *vals));
    free(lse);
    free(vals);
    free(ids);
    dump_file_close(fa);
    dump_file_close(fb);
    return compared;
}

/* Layer 0's x_in at position p differs between the dumps (the token fed
 * there differs). */
static bool x_in_differs_at(const char *a, const char *b, int64_t p)
{
    kv_err e = {{0}};
    dump_file *fa = dump_open(a, &e), *fb = fa ? dump_open(b, &e) : NULL;
    ck_assert_msg(fa && fb, "%s", e.msg);
    dump_dataset_info i = dump_stage_info(fa, 0, STAGE_X_IN);
    float *ra = malloc((size_t)i.cols * sizeof *ra), *rb = malloc((size_t)i.cols * sizeof *rb);
    ck_assert(ra && rb && dump_read_rows(fa, 0, STAGE_X_IN, p - i.first_position, 1, ra, &e) == 0 &&
              dump_read_rows(fb, 0, STAGE_X_IN, p - i.first_position, 1, rb, &e) == 0);
    bool d = memcmp(ra, rb, (size_t)i.cols * sizeof *ra) != 0;
    free(ra);
    free(rb);
    dump_file_close(fa);
    dump_file_close(fb);
    return d;
}

static void set_prompt_length(const char *path, long long v)
{
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = H5Dopen2(h, "/tokens", H5P_DEFAULT);
    ck_assert(h >= 0 && d >= 0);
    ck_assert(H5Adelete(d, "prompt_length") >= 0);
    hid_t s = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(d, "prompt_length", H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &v) >= 0);
    H5Aclose(a);
    H5Sclose(s);
    H5Dclose(d);
    H5Fclose(h);
}

static void set_token(const char *path, int at, int32_t id)
{
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = H5Dopen2(h, "/tokens", H5P_DEFAULT);
    ck_assert(h >= 0 && d >= 0);
    int32_t ids[256];
    hid_t s = H5Dget_space(d);
    ck_assert(H5Sget_simple_extent_npoints(s) <= 256);
    ck_assert(H5Dread(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids) >= 0);
    ids[at] = id;
    ck_assert(H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids) >= 0);
    H5Sclose(s);
    H5Dclose(d);
    H5Fclose(h);
}

static void rename_engine(const char *path, const char *engine)
{
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(h >= 0);
    test_set_str_attr(h, "engine", engine);
    H5Fclose(h);
}

/* One line naming what, exit 2, and no dump at dump. */
static void refused(const char *args, const char *what, const char *dump)
{
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "kvdiff %s\n%s", args, out);
    ck_assert_msg(strchr(out, '\n') == out + strlen(out) - 1, "not one line: %s", out);
    ck_assert_msg(strstr(out, what), "kvdiff %s: no '%s' in: %s", args, what, out);
    ck_assert_msg(!dump || access(dump, F_OK) != 0, "kvdiff %s left %s", args, dump);
}

/* ------------------------------------------------------------------ */
/* Following                                                            */

/* The chunked engine with a window bug generates other tokens from the
 * first one on: the reference following them reproduces its tokens, its
 * rows before that token are the plain reference's bit for bit, and the
 * token it was fed changes the row at that position. */
START_TEST(test_follow_injected_tokens)
{
    char dir[64], args[768], ref[128], bug[128], fol[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(bug, sizeof bug, "%s/bug.h5", dir);
    snprintf(fol, sizeof fol, "%s/followed.h5", dir);
    const char *common = "--model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 12 "
                         "--ignore-eos";
    snprintf(args, sizeof args, "run %s --dump %s", common, ref);
    run_ok(args);
    snprintf(args, sizeof args, "run %s --engine chunked --chunk 5 --cache ring --inject "
             "window=4 --dump %s", common, bug);
    run_ok(args);
    int64_t flip = first_token_difference(ref, bug);
    ck_assert_msg(flip >= 40, "the injection changed no generated token");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --follow %s --dump %s", bug, fol);
    run_ok(args);
    ck_assert_msg(strstr(out, "followed  ") && strstr(out, "its prompt and its 12 generated "
                  "tokens, fed as given"), "%s", out);
    ck_assert_int_eq(first_token_difference(fol, bug), -1);
    ck_assert_int_gt(same_rows_before(fol, ref, flip), 0);
    ck_assert(x_in_differs_at(fol, ref, flip));
    /* the settings say it followed, and claim no sampling */
    snprintf(args, sizeof args, "inspect %s", fol);
    run_ok(args);
    ck_assert_msg(strstr(out, "\"follow\":\"") && strstr(out, "bug.h5\"") &&
                  !strstr(out, "temperature"), "%s", out);
    /* compared with the test, every position is compared: the window bug
     * at position 4, not the tokens, is what differs */
    snprintf(args, sizeof args, "compare %s %s -q", fol, bug);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "position 4") && !strstr(out, "tokens differ"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A sampled reference run parts from the greedy one at a decode step
 * (position 8): following it reproduces it whole, bit for bit, with
 * either engine, and matches the greedy run before position 8. */
START_TEST(test_follow_sampled_run)
{
    char dir[64], args[768], greedy[128], sampled[128], fol[128], folc[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(greedy, sizeof greedy, "%s/greedy.h5", dir);
    snprintf(sampled, sizeof sampled, "%s/sampled.h5", dir);
    snprintf(fol, sizeof fol, "%s/followed.h5", dir);
    snprintf(folc, sizeof folc, "%s/followed-chunked.h5", dir);
    const char *common = "--model tiny-llama --prompt-tokens 5,17,42,7,99,3 --max-new 4 "
                         "--ignore-eos";
    snprintf(args, sizeof args, "run %s --dump %s", common, greedy);
    run_ok(args);
    snprintf(args, sizeof args, "run %s --temperature 1.5 --seed 1 --dump %s", common, sampled);
    run_ok(args);
    int64_t flip = first_token_difference(greedy, sampled);
    ck_assert_int_eq(flip, 8);
    /* an agreeing --max-new and a redundant --ignore-eos are accepted */
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --max-new 4 --ignore-eos "
             "--dump %s", sampled, fol);
    run_ok(args);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --engine chunked --chunk 2 "
             "--cache ring --dump %s", sampled, folc);
    run_ok(args);
    ck_assert_int_eq(first_token_difference(fol, sampled), -1);
    ck_assert_int_gt(same_rows_before(fol, greedy, flip), 0);
    ck_assert(x_in_differs_at(fol, greedy, flip));
    snprintf(args, sizeof args, "compare %s %s", sampled, fol);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0 && strstr(out, "identical: "),
                  "%s", out);
    snprintf(args, sizeof args, "compare %s %s", fol, folc);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0 && strstr(out, "identical: "),
                  "%s", out);
    /* in memory: both engines follow */
    snprintf(args, sizeof args, "run --compare --model tiny-llama --follow %s --engine chunked "
             "--chunk 3 -q", sampled);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0 && strstr(out, "identical"), "%s",
                  out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Refusals                                                             */

/* Each bad TEST.h5: exit 2, one line naming the file and the problem, and
 * no dump left behind. */
START_TEST(test_follow_bad_files)
{
    char dir[64], args[768], good[128], path[128], o[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(good, sizeof good, "%s/good.h5", dir);
    snprintf(o, sizeof o, "%s/o.h5", dir);
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-tokens 5,17,42 --max-new 3 "
             "--ignore-eos --dump %s", good);
    run_ok(args);
    /* missing */
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s/none.h5 --dump %s", dir, o);
    refused(args, "none.h5: No such file or directory", o);
    /* not a dump */
    snprintf(path, sizeof path, "%s/junk.h5", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("not a dump\n", f);
    fclose(f);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", path, o);
    refused(args, "junk.h5: not an HDF5 file", o);
    /* without /tokens */
    snprintf(path, sizeof path, "%s/notokens.h5", dir);
    copy_file(good, path);
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(h >= 0 && H5Ldelete(h, "/tokens", H5P_DEFAULT) >= 0);
    H5Fclose(h);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", path, o);
    refused(args, "notokens.h5: /tokens is missing", o);
    /* prompt_length 0, and past the tokens */
    snprintf(path, sizeof path, "%s/prompt0.h5", dir);
    copy_file(good, path);
    set_prompt_length(path, 0);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", path, o);
    refused(args, "prompt0.h5: prompt_length 0 is not within its 6 tokens", o);
    snprintf(path, sizeof path, "%s/prompt7.h5", dir);
    copy_file(good, path);
    set_prompt_length(path, 7);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", path, o);
    refused(args, "prompt7.h5: prompt_length 7 is not within its 6 tokens", o);
    /* an id past the vocabulary (tiny-llama: 256), in the prompt and in the
     * generated part, and a negative one */
    const struct { int at; int32_t id; const char *what; } oov[] = {
        {1, 256, "token 256 at position 1 is outside the model's vocabulary (0..255)"},
        {4, 1000, "token 1000 at position 4 is outside the model's vocabulary (0..255)"},
        {5, -1, "token -1 at position 5 is outside the model's vocabulary (0..255)"}};
    for (size_t i = 0; i < sizeof oov / sizeof *oov; i++) {
        snprintf(path, sizeof path, "%s/oov%zu.h5", dir, i);
        copy_file(good, path);
        set_token(path, oov[i].at, oov[i].id);
        snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", path, o);
        char what[256];
        snprintf(what, sizeof what, "oov%zu.h5: %s", i, oov[i].what);
        refused(args, what, o);
    }
    /* another model */
    snprintf(args, sizeof args, "run --model tiny-gemma3 --follow %s --dump %s", good, o);
    refused(args, "good.h5: recorded with another model than --model tiny-gemma3: model_type "
                  "'llama' vs 'gemma3_text' (the file's first)", o);
    /* other weights (compare would refuse the pair) */
    snprintf(args, sizeof args, "run --model tiny-llama --weights-seed 7 --follow %s --dump %s",
             good, o);
    refused(args, "good.h5: recorded with other weights: its weight_fingerprint is ", o);
    /* the dump may not be the file followed */
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --dump %s", good, good);
    refused(args, "is the same file as --follow", NULL);
    ck_assert_int_eq(first_token_difference(good, good), -1);   /* still whole */
    test_rmtree(dir);
}
END_TEST

/* Options that would choose the prompt, the length or the sampling are
 * refused with --follow, as is --follow outside `run`. */
START_TEST(test_follow_conflicting_options)
{
    char dir[64], args[768], good[128], o[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(good, sizeof good, "%s/good.h5", dir);
    snprintf(o, sizeof o, "%s/o.h5", dir);
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-tokens 5,17,42 --max-new 3 "
             "--ignore-eos --dump %s", good);
    run_ok(args);
    snprintf(args, sizeof args, "run --model tiny-llama --follow %s --max-new 2 --dump %s", good,
             o);
    refused(args, "--max-new 2 and --follow ", o);
    ck_assert_msg(strstr(out, "it generated 3 tokens"), "%s", out);
    static const char *const prompt[] = {"--prompt-tokens 1,2", "--prompt-random 4",
                                         "--prompt-text hello", "--prompt-file p.txt",
                                         "--prompt-ids-file ids.txt"};
    for (size_t i = 0; i < sizeof prompt / sizeof *prompt; i++) {
        snprintf(args, sizeof args, "run --model tiny-llama --follow %s %s --dump %s", good,
                 prompt[i], o);
        char what[128];
        snprintf(what, sizeof what, "and %.*s: the prompt is ",
                 (int)strcspn(prompt[i], " "), prompt[i]);
        refused(args, what, o);
    }
    static const char *const sampling[] = {"--temperature 0.7", "--top-k 5", "--top-p 0.9",
                                           "--seed 3"};
    for (size_t i = 0; i < sizeof sampling / sizeof *sampling; i++) {
        snprintf(args, sizeof args, "run --model tiny-llama %s --follow %s --dump %s",
                 sampling[i], good, o);
        char what[128];
        snprintf(what, sizeof what, "and %.*s: a followed run samples nothing",
                 (int)strcspn(sampling[i], " "), sampling[i]);
        refused(args, what, o);
    }
    snprintf(args, sizeof args, "bisect --model tiny-llama --follow %s -o %s/b", good, dir);
    refused(args, "--follow is an option of kvdiff run", NULL);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Suites                                                               */

/* Outside recordings (a dump: side whose engine is not kvdiff's) that
 * generated other tokens than the reference for a reason the evidence at
 * the flip does not explain (a sampled run: its own logits rank the
 * reference's token first; a real window bug before the flip) are judged
 * as run, never followed: following would compare past the bug. */
START_TEST(test_suite_does_not_follow_unexplained)
{
    char dir[64], args[768], path[128], text[2048];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-tokens 5,17,42,7,99,3 "
             "--max-new 4 --ignore-eos --temperature 1.5 --seed 1 --dump %s/sampled.h5", dir);
    run_ok(args);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-tokens "
             "5,17,42,7,99,3,8,1,9,10,11,12 --max-new 6 --ignore-eos --engine chunked --chunk 5 "
             "--inject window=4 --dump %s/bug.h5", dir);
    run_ok(args);
    snprintf(path, sizeof path, "%s/sampled.h5", dir);
    rename_engine(path, "pytorch");
    snprintf(path, sizeof path, "%s/bug.h5", dir);
    rename_engine(path, "pytorch");
    snprintf(path, sizeof path, "%s/f.suite", dir);
    snprintf(text, sizeof text,
             "[defaults]\nmodel = tiny-llama\nprompt = 5,17,42,7,99,3\nmax_new = 4\n"
             "a = --engine reference\n"
             "[flip]\nb = dump: sampled.h5\nexpect = no-bug\n"
             "[flip-within]\nb = dump: sampled.h5\nexpect = within atol=1\n"
             "[bug]\nmodel = tiny-gemma3\nprompt = 5,17,42,7,99,3,8,1,9,10,11,12\nmax_new = 6\n"
             "b = dump: bug.h5\nexpect = no-bug\n");
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "3 cases: 0 passed, 3 failed"), "%s", out);
    ck_assert_msg(strstr(out, "FAIL flip: expected no-bug; got diverged, tokens differ at "
                              "position 8\n"), "%s", out);
    ck_assert_msg(strstr(out, "FAIL flip-within: expected within atol=1; got diverged, tokens "
                              "differ at position 8\n"), "%s", out);
    ck_assert_msg(strstr(out, "FAIL bug: expected no-bug; got diverged: window at layer 0 "
                              "position 4 stage attn_lse"), "%s", out);
    ck_assert_msg(!strstr(out, "followed"), "%s", out);
    static const char *const cases[] = {"flip", "flip-within", "bug"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/work/%s/a-followed.h5", dir, cases[i]);
        ck_assert_msg(access(path, F_OK) != 0, "%s followed", cases[i]);
    }
    test_rmtree(dir);
}
END_TEST

/* Real llama.cpp with a q8_0 cache, flash attention and ubatch 1 on
 * tiny-gemma4 flips the token at 102 where the reference's margin is
 * within the logit error this pair shows (a rounding flip): the compare
 * passes, and the no-bug case re-runs the reference on llama.cpp's tokens
 * and compares every decode position. */
START_TEST(test_suite_follows_near_tie)
{
    char dir[64], args[768], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/f.suite", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("[flip]\nmodel = tiny-gemma4\nprompt = random:100:5\nmax_new = 8\n"
          "a = --engine reference\n"
          "b = llama.cpp: --cache-type q8_0 --flash-attn on --ubatch 1\nexpect = no-bug\n", f);
    fclose(f);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "- (followed from position 102)"), "%s", out);
    /* by hand, what the case did: the flip judged drift, then followed */
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/hf --gguf %s/m.gguf", dir, dir);
    run_ok(args);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 5 --max-new 8 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    run_ok(args);
    snprintf(args, sizeof args, "%s/m.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 8 "
             "--ignore-eos --threads 1 --cache-type q8_0 --flash-attn on --ubatch 1 "
             "--dump %s/ll.h5", dir, dir, dir, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/ll.h5 --json", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    json_t *j = json_loads(out, 0, NULL), *tok = json_object_get(j, "tokens");
    ck_assert_msg(j && !strcmp(json_string_value(json_object_get(tok, "verdict")), "differ") &&
                  json_integer_value(json_object_get(tok, "position")) == 102 &&
                  json_is_true(json_object_get(tok, "flip_drift")), "%s", out);
    json_decref(j);
    snprintf(args, sizeof args, "run --model %s/hf --follow %s/ll.h5 --dump %s/followed.h5", dir,
             dir, dir);
    run_ok(args);
    snprintf(args, sizeof args, "compare %s/followed.h5 %s/ll.h5 --json", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    j = json_loads(out, 0, NULL);
    ck_assert_msg(j && !strcmp(json_string_value(json_object_get(json_object_get(j, "tokens"),
                                                                 "verdict")), "identical"),
                  "%s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* Real llama.cpp on tiny-deepseek-v3 with a q8_0 cache: its router keeps
 * other expert groups at position 2, their scores within this pair's
 * error (a rounding flip), and the compare stops there. The no-bug case
 * re-runs the reference on llama.cpp's tokens and routing and compares
 * every position; by hand, the followed run says what it followed and
 * its compare has no flip left. */
START_TEST(test_suite_follows_routing)
{
    char dir[64], args[768], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/f.suite", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("[route]\nmodel = tiny-deepseek-v3\nprompt = random:40:3\nmax_new = 6\n"
          "a = --engine reference\n"
          "b = llama.cpp: --cache-type q8_0 --flash-attn on --ubatch 16\nexpect = no-bug\n", f);
    fclose(f);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "- (followed from position "), "%s", out);
    snprintf(args, sizeof args, "gen --preset tiny-deepseek-v3 -o %s/hf --gguf %s/m.gguf", dir,
             dir);
    run_ok(args);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 40 --seed 3 --max-new 6 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    run_ok(args);
    snprintf(args, sizeof args, "%s/m.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 6 "
             "--ignore-eos --threads 1 --cache-type q8_0 --flash-attn on --ubatch 16 "
             "--dump %s/ll.h5", dir, dir, dir, dir);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/ll.h5 --json", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    json_t *j = json_loads(out, 0, NULL), *cv = json_object_get(j, "compared");
    ck_assert_msg(j && json_is_integer(json_object_get(cv, "routing_flip")), "%s", out);
    const json_int_t flip = json_integer_value(json_object_get(cv, "routing_flip"));
    ck_assert_msg(json_integer_value(json_object_get(cv, "position_hi")) <= flip, "%s", out);
    json_decref(j);
    snprintf(args, sizeof args, "run --model %s/hf --follow %s/ll.h5 --dump %s/followed.h5", dir,
             dir, dir);
    run_ok(args);
    snprintf(args, sizeof args, "inspect %s/followed.h5", dir);
    run_ok(args);
    ck_assert_msg(strstr(out, "\"follow_routing\":"), "%s", out);
    snprintf(args, sizeof args, "compare %s/followed.h5 %s/ll.h5 --json", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    j = json_loads(out, 0, NULL);
    cv = json_object_get(j, "compared");
    ck_assert_msg(j && json_is_null(json_object_get(cv, "routing_flip")) &&
                  json_integer_value(json_object_get(cv, "position_hi")) == 44, "%s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

Suite *follow_suite(void)
{
    Suite *s = suite_create("follow");
    TCase *tc = tcase_create("run");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_follow_injected_tokens);
    tcase_add_test(tc, test_follow_sampled_run);
    tcase_add_test(tc, test_follow_bad_files);
    tcase_add_test(tc, test_follow_conflicting_options);
    suite_add_tcase(s, tc);
    tc = tcase_create("suite");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_suite_does_not_follow_unexplained);
    tcase_add_test(tc, test_suite_follows_near_tie);
    tcase_add_test(tc, test_suite_follows_routing);
    suite_add_tcase(s, tc);
    return s;
}
