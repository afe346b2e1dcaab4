/* check_compare_paths.c — the comparer's fast paths change nothing it
 * reports: datasets readied by a child process per file or as they are
 * met, rows read at their chunks' offsets on two threads or through
 * libhdf5 on one, weighed with AVX2 or the scalar loop, the verdict, the
 * first divergence, its diagnosis and every per-stage figure are the same,
 * bit for bit. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "dump/dump.h"
#include "testutil.h"

static char out[1 << 16];

/* A longer prompt than the other compare tests: several blocks of 16. */
static void record(const char *dir, const char *name, const char *engine_args)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 90 --seed 9 "
             "--max-new 6 --ignore-eos %s --dump %s/%s", engine_args, dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

static void compare_files(const char *a, const char *b, const cmp_opts *o, cmp_result *r)
{
    kv_err e = {{0}};
    cmp_source sa, sb;
    cmp_dump_source *da = cmp_dump_source_open(a, &sa, &e);
    ck_assert_msg(da != NULL, "%s", e.msg);
    cmp_dump_source *db = cmp_dump_source_open(b, &sb, &e);
    ck_assert_msg(db != NULL, "%s", e.msg);
    ck_assert_msg(cmp_compare(&sa, &sb, o, r, &e) == 0, "%s", e.msg);
    cmp_dump_source_close(da);
    cmp_dump_source_close(db);
}

static void same_stats(const cmp_stats *x, const cmp_stats *y, const char *what)
{
    ck_assert_msg(x->rows == y->rows && x->bitequal_rows == y->bitequal_rows &&
                  x->violating_rows == y->violating_rows && x->nonfinite == y->nonfinite &&
                  x->first_bitdiff_pos == y->first_bitdiff_pos, "%s: counts differ", what);
    ck_assert_msg(memcmp(&x->max_abs, &y->max_abs, sizeof x->max_abs) == 0 &&
                  memcmp(&x->max_rel, &y->max_rel, sizeof x->max_rel) == 0 &&
                  x->max_ulp == y->max_ulp, "%s: maxima differ", what);
    ck_assert_msg(memcmp(&x->dot, &y->dot, sizeof x->dot) == 0 &&
                  memcmp(&x->ref_sq, &y->ref_sq, sizeof x->ref_sq) == 0 &&
                  memcmp(&x->test_sq, &y->test_sq, sizeof x->test_sq) == 0 &&
                  memcmp(&x->err_sq, &y->err_sq, sizeof x->err_sq) == 0,
                  "%s: sums differ", what);
}

static void same_result(const cmp_result *x, const cmp_result *y)
{
    ck_assert_int_eq(x->verdict, y->verdict);
    ck_assert(x->first.found == y->first.found);
    ck_assert_int_eq(x->first.pos, y->first.pos);
    ck_assert_int_eq(x->first.layer, y->first.layer);
    ck_assert_int_eq(x->first.stage, y->first.stage);
    ck_assert_int_eq(x->first.col, y->first.col);
    ck_assert_int_eq(x->first.n_bad, y->first.n_bad);
    ck_assert(x->beyond.found == y->beyond.found);
    ck_assert_int_eq(x->beyond.pos, y->beyond.pos);
    ck_assert_int_eq(x->diag.kind, y->diag.kind);
    ck_assert_str_eq(x->diag.detail, y->diag.detail);
    ck_assert_int_eq(x->compared.walked_to, y->compared.walked_to);
    ck_assert_int_eq(x->n_stages, y->n_stages);
    for (int i = 0; i < x->n_stages; i++) {
        char what[96];
        snprintf(what, sizeof what, "%s of layer %d", stage_name(x->stages[i].stage),
                 x->stages[i].layer);
        ck_assert_int_eq(x->stages[i].rows_by_hash, y->stages[i].rows_by_hash);
        same_stats(&x->stages[i].all, &y->stages[i].all, what);
        same_stats(&x->stages[i].upto, &y->stages[i].upto, what);
    }
    ck_assert(x->compared.by_index == y->compared.by_index);
    char *tx = cmp_render_text(x, 0), *ty = cmp_render_text(y, 0);
    ck_assert_str_eq(tx, ty);
    free(tx);
    free(ty);
}

/* Direct reads on two threads with AVX2 against libhdf5 with the scalar
 * loop, on identical dumps (settled by the row hash indexes, against the
 * hash walk; and rows read anyway), numeric drift under a tolerance and in
 * exact mode, and a planted bug. */
START_TEST(test_paths_agree)
{
    char dir[64], ref[128], ok[128], casc[128], bad[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "ok.h5", "--engine chunked --chunk 7 --cache ring");
    record(dir, "casc.h5", "--engine chunked --chunk 7 --attn cascade");
    record(dir, "bad.h5", "--engine chunked --chunk 7 --inject window=4");
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(ok, sizeof ok, "%s/ok.h5", dir);
    snprintf(casc, sizeof casc, "%s/casc.h5", dir);
    snprintf(bad, sizeof bad, "%s/bad.h5", dir);
    struct {
        const char *test;
        double atol, rtol;
        bool no_hashes, full;
        cmp_verdict want;
    } cases[] = {
        {ok, 0, 0, false, false, CMP_IDENTICAL},
        {ok, 0, 0, true, false, CMP_IDENTICAL},
        {casc, 0, 1e-5, false, true, CMP_WITHIN_TOLERANCE},
        {casc, 1e-7, 0, true, true, CMP_DIVERGED},
        {casc, 0, 0, false, false, CMP_DIVERGED},
        {bad, 0, 0, false, false, CMP_DIVERGED},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        cmp_opts o;
        cmp_opts_default(&o);
        o.block_rows = 16;
        o.atol = cases[k].atol;
        o.rtol = cases[k].rtol;
        o.no_hashes = cases[k].no_hashes;
        o.full = cases[k].full;
        cmp_result fast, slow;
        dump_set_direct_reads(true);
        cmp_rows_use_simd(true);
        compare_files(ref, cases[k].test, &o, &fast);
        dump_set_direct_reads(false);
        dump_set_survey(false);
        cmp_rows_use_simd(false);
        compare_files(ref, cases[k].test, &o, &slow);
        dump_set_direct_reads(true);
        dump_set_survey(true);
        cmp_rows_use_simd(true);
        ck_assert_msg(fast.verdict == cases[k].want, "case %zu: verdict %s", k,
                      cmp_verdict_name(fast.verdict));
        /* the row hash indexes settle identical dumps, read either way */
        ck_assert(fast.compared.by_index == (k == 0));
        ck_assert(slow.compared.by_index == (k == 0));
        same_result(&fast, &slow);
        cmp_result_free(&fast);
        cmp_result_free(&slow);
    }
    /* fingerprint dumps: hashes only, read ahead by the survey or not */
    char fa[128], fb[128];
    record(dir, "fa.h5", "--fingerprint");
    record(dir, "fb.h5", "--engine chunked --chunk 7 --inject window=4 --fingerprint");
    snprintf(fa, sizeof fa, "%s/fa.h5", dir);
    snprintf(fb, sizeof fb, "%s/fb.h5", dir);
    for (int k = 0; k < 2; k++) {
        cmp_opts o;
        cmp_opts_default(&o);
        o.block_rows = 16;
        cmp_result fast, slow;
        compare_files(fa, k ? fb : fa, &o, &fast);
        dump_set_survey(false);
        dump_set_direct_reads(false);
        compare_files(fa, k ? fb : fa, &o, &slow);
        dump_set_survey(true);
        dump_set_direct_reads(true);
        ck_assert_int_eq(fast.verdict, k ? CMP_DIVERGED : CMP_IDENTICAL);
        same_result(&fast, &slow);
        cmp_result_free(&fast);
        cmp_result_free(&slow);
    }
    test_rmtree(dir);
}
END_TEST

Suite *compare_paths_suite(void)
{
    Suite *s = suite_create("compare_paths");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_paths_agree);
    suite_add_tcase(s, tc);
    return s;
}
