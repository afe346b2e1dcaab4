/* check_compare_cli.c — `kvdiff compare` on dumps as a user runs it:
 * identical strategies say so (exit 0), an injected bug is located and
 * diagnosed (exit 1), bad input is refused (exit 2). */
#include <check.h>
#include <hdf5.h>
#include <math.h>
#include <xxhash.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 16];

static void set_attr(const char *path, const char *obj, const char *name, const char *text,
                     int64_t value);

static void record(const char *dir, const char *name, const char *engine_args)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 4 "
             "--max-new 16 --ignore-eos %s --dump %s/%s", engine_args, dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

START_TEST(test_compare_verdicts)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "ok.h5", "--engine chunked --chunk 5 --cache ring");
    record(dir, "bad.h5", "--engine chunked --chunk 5 --cache ring --inject window=4");
    record(dir, "casc.h5", "--engine chunked --chunk 5 --attn cascade");
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/ok.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "identical: 6 layers"));
    ck_assert_ptr_nonnull(strstr(out, "tokens byte-identical"));
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/bad.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 4, layer 0 (sliding, window 12), "
                              "stage attn_lse"), "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "keys attended 5 vs 4"));
    ck_assert_ptr_nonnull(strstr(out, "window in test appears to be 4, config says 12"));
    snprintf(args, sizeof args, "compare --json %s/ref.h5 %s/bad.h5 2>/dev/null", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_error_t jerr;
    json_t *j = json_loads(out, 0, &jerr);
    ck_assert_msg(j != NULL, "not JSON: %s", jerr.text);
    json_decref(j);
    /* Cascade is drift, not a bug; within a tolerance it is the same. */
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/casc.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "numeric drift"), "%s", out);
    snprintf(args, sizeof args, "compare --rtol 1e-5 %s/ref.h5 %s/casc.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_compare_refusals)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 9 "
             "--max-new 4 --dump %s/other.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/other.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "prompt"), "%s", out);
    snprintf(path, sizeof path, "%s/junk.h5", dir);
    FILE *f = fopen(path, "w");
    fputs("junk", f);
    fclose(f);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "junk.h5"));
    ck_assert_int_eq(test_run_cli("compare only-one.h5", out, sizeof out), 2);
    test_rmtree(dir);
}
END_TEST

/* Overwrites one element of dataset dset at row `row`; with rehash, also
 * the row's hash in dset.hash, as a writer would have written it. */
static void poke(const char *path, const char *dset, hsize_t row, hsize_t col, float v,
                 bool rehash)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t d = H5Dopen2(f, dset, H5P_DEFAULT);
    ck_assert_int_ge(d, 0);
    hid_t fs = H5Dget_space(d);
    hsize_t dims[2];
    H5Sget_simple_extent_dims(fs, dims, NULL);
    hsize_t start[2] = {row, col}, count[2] = {1, 1};
    ck_assert_int_ge(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL), 0);
    hid_t ms = H5Screate_simple(2, count, NULL);
    ck_assert_int_ge(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, &v), 0);
    H5Sclose(ms);
    if (rehash) {
        float buf[4096];
        ck_assert(dims[1] <= 4096);
        hsize_t rstart[2] = {row, 0}, rcount[2] = {1, dims[1]};
        H5Sselect_hyperslab(fs, H5S_SELECT_SET, rstart, NULL, rcount, NULL);
        ms = H5Screate_simple(2, rcount, NULL);
        ck_assert_int_ge(H5Dread(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, buf), 0);
        H5Sclose(ms);
        uint64_t h = XXH3_64bits(buf, dims[1] * sizeof(float));
        char hpath[256];
        snprintf(hpath, sizeof hpath, "%s.hash", dset);
        hid_t dh = H5Dopen2(f, hpath, H5P_DEFAULT);
        ck_assert_int_ge(dh, 0);
        hid_t hs = H5Dget_space(dh);
        hsize_t hstart[1] = {row}, hcount[1] = {1};
        H5Sselect_hyperslab(hs, H5S_SELECT_SET, hstart, NULL, hcount, NULL);
        ms = H5Screate_simple(1, hcount, NULL);
        ck_assert_int_ge(H5Dwrite(dh, H5T_NATIVE_UINT64, ms, hs, H5P_DEFAULT, &h), 0);
        H5Sclose(ms);
        H5Sclose(hs);
        H5Dclose(dh);
    }
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

/* NaN or infinity on one side is a divergence, located and named. */
START_TEST(test_compare_nonfinite)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "nan.h5", "--engine chunked --chunk 5");
    snprintf(path, sizeof path, "%s/nan.h5", dir);
    const float bad = _i == 0 ? NAN : INFINITY;
    poke(path, "/layers/3/h_mid", 17, 9, bad, true);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 17, layer 3"), "%s", out);
    ck_assert_msg(strstr(out, "stage h_mid"), "%s", out);
    ck_assert_msg(strstr(out, _i == 0 ? "nan" : "inf"), "%s", out);
    ck_assert_msg(strstr(out, "NaN") || strstr(out, "non-finite"), "%s", out);
    /* the row's figures skip the non-finite pair: never "max abs 0" for it */
    ck_assert_msg(strstr(out, "row: 1 element differs, the finite ones are equal)"), "%s", out);
    ck_assert_msg(!strstr(out, "max abs 0,"), "%s", out);
    /* No tolerance excuses it. */
    snprintf(args, sizeof args, "compare --atol 1e30 %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    /* NaN on both sides, bit for bit, is no difference. */
    snprintf(args, sizeof args, "%s/ref.h5", dir);
    poke(args, "/layers/3/h_mid", 17, 9, bad, true);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A row changed behind its hash (a dump edited by hand, a writer with a
 * bug): validate names it, and --no-hashes finds the difference the hashes
 * hide. */
START_TEST(test_compare_stale_hash)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "--engine chunked --chunk 5");
    snprintf(path, sizeof path, "%s/t.h5", dir);
    poke(path, "/layers/2/v", 30, 4, 7.0f, false);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "/layers/2/v.hash: the hash of row 30"), "%s", out);
    snprintf(args, sizeof args, "compare --no-hashes %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 30, layer 2"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Recreates dataset path (2-D float32 rows, or 1-D uint64 hashes) of f
 * with the given contents: the new chunks land elsewhere and the old bytes
 * stay in the file, as when a tool deletes and writes a dataset again. */
static void recreate(hid_t f, const char *path, hid_t type, hsize_t rows, hsize_t cols,
                     const void *data)
{
    int64_t first = 0;
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    hid_t a = H5Aopen(d, "first_position", H5P_DEFAULT);
    ck_assert(a >= 0 && H5Aread(a, H5T_NATIVE_INT64, &first) >= 0);
    H5Aclose(a);
    H5Dclose(d);
    ck_assert(H5Ldelete(f, path, H5P_DEFAULT) >= 0);
    hsize_t dims[2] = {rows, cols};
    hid_t sp = H5Screate_simple(cols ? 2 : 1, dims, NULL), as = H5Screate(H5S_SCALAR);
    d = H5Dcreate2(f, path, type, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(d >= 0 && H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
    a = H5Acreate2(d, "first_position", H5T_STD_I64LE, as, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_INT64, &first) >= 0);
    H5Aclose(a);
    H5Sclose(as);
    H5Sclose(sp);
    H5Dclose(d);
}

/* Identical dumps are settled by their row hash indexes, each checked
 * against the hashes as they are now: an index left stale by an edit in
 * place, or by a tool that wrote a stage's rows and hashes again elsewhere
 * (the old hashes still in the file), is not believed, and the walk finds
 * what changed; rows added past the hashes are compared, and a width the
 * index misstates is not used. A user block ahead of the file changes
 * nothing. */
START_TEST(test_compare_index)
{
    char dir[64], args[768], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "--engine chunked --chunk 5");
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/t.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "settled by the row hash indexes of both files"), "%s", out);
    snprintf(args, sizeof args, "compare --json %s/ref.h5 %s/t.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "\"by_index\": true"), "%s", out);
    snprintf(args, sizeof args, "echo user block > %s/ub.txt && h5jam -i %s/t.h5 -u %s/ub.txt "
             "-o %s/jam.h5", dir, dir, dir, dir);
    ck_assert_msg(system(args) == 0, "%s failed (hdf5-tools is a build dependency)", args);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/jam.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "settled by the row hash indexes of both files"), "%s", out);

    /* layer 2's k written again elsewhere, one element changed, hashes true */
    snprintf(path, sizeof path, "%s/jam.h5", dir);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t d = H5Dopen2(f, "/layers/2/k", H5P_DEFAULT), sp = H5Dget_space(d);
    hsize_t dims[2];
    H5Sget_simple_extent_dims(sp, dims, NULL);
    H5Sclose(sp);
    float *rows = malloc(dims[0] * dims[1] * sizeof *rows);
    uint64_t *hash = malloc(dims[0] * sizeof *hash);
    ck_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows) >= 0);
    H5Dclose(d);
    rows[23 * dims[1] + 5] += 0.25f;
    for (hsize_t r = 0; r < dims[0]; r++)
        hash[r] = XXH3_64bits(rows + r * dims[1], dims[1] * sizeof *rows);
    recreate(f, "/layers/2/k", H5T_NATIVE_FLOAT, dims[0], dims[1], rows);
    recreate(f, "/layers/2/k.hash", H5T_NATIVE_UINT64, dims[0], 0, hash);
    H5Fclose(f);
    free(rows);
    free(hash);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 23, layer 2"), "%s", out);

    /* rows added past the hashes (and the index): compared, not settled */
    snprintf(args, sizeof args, "cp %s/ref.h5 %s/ref2.h5 && cp %s/t.h5 %s/t2.h5", dir, dir, dir,
             dir);
    ck_assert(system(args) == 0);
    for (int side = 0; side < 2; side++) {
        snprintf(path, sizeof path, "%s/%s", dir, side ? "t2.h5" : "ref2.h5");
        hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
        hid_t x = H5Dopen2(h, "/layers/1/x_out", H5P_DEFAULT), xs = H5Dget_space(x);
        hsize_t xd[2], start[2], count[2];
        H5Sget_simple_extent_dims(xs, xd, NULL);
        H5Sclose(xs);
        start[0] = xd[0], start[1] = 0, count[0] = 1, count[1] = xd[1];
        xd[0]++;
        ck_assert(H5Dset_extent(x, xd) >= 0);
        float *row = malloc(xd[1] * sizeof *row);
        for (hsize_t c = 0; c < xd[1]; c++)
            row[c] = side ? 2.0f : 1.0f;
        xs = H5Dget_space(x);
        hid_t ms = H5Screate_simple(2, count, NULL);
        H5Sselect_hyperslab(xs, H5S_SELECT_SET, start, NULL, count, NULL);
        ck_assert(H5Dwrite(x, H5T_NATIVE_FLOAT, ms, xs, H5P_DEFAULT, row) >= 0);
        free(row);
        H5Sclose(ms);
        H5Sclose(xs);
        H5Dclose(x);
        /* and an index that says every stage is one float wide */
        hid_t ix = H5Dopen2(h, "/row_hash_index", H5P_DEFAULT), is = H5Dget_space(ix);
        hsize_t id[2];
        H5Sget_simple_extent_dims(is, id, NULL);
        uint64_t *cells = malloc(id[0] * id[1] * sizeof *cells);
        ck_assert(H5Dread(ix, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, cells) >= 0);
        for (hsize_t r = 0; r < id[0]; r++)
            cells[r * id[1] + 4] = 1;
        ck_assert(H5Dwrite(ix, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, cells) >= 0);
        free(cells);
        H5Sclose(is);
        H5Dclose(ix);
        H5Fclose(h);
    }
    /* a complete dump hashes every row: validate and compare refuse it */
    snprintf(args, sizeof args, "compare %s/ref2.h5 %s/t2.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "ref2.h5: /layers/1/x_out (56 rows from position 0) and "
                              "/layers/1/x_out.hash (55 rows"), "%s", out);
    snprintf(args, sizeof args, "validate %s/t2.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    /* one cut short may hold rows its hashes did not reach: those are compared */
    for (int side = 0; side < 2; side++) {
        snprintf(path, sizeof path, "%s/%s", dir, side ? "t2.h5" : "ref2.h5");
        set_attr(path, "/", "status", "partial: running", 0);
    }
    snprintf(args, sizeof args, "compare %s/ref2.h5 %s/t2.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "layer 1 ("), "%s", out);
    ck_assert_msg(strstr(out, "stage x_out"), "%s", out);

    /* a row and its hash rewritten in place, the index not */
    snprintf(path, sizeof path, "%s/t.h5", dir);
    poke(path, "/layers/3/attn_out", 17, 2, 0.5f, true);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 17, layer 3"), "%s", out);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "the digest of /layers/3/attn_out.hash does not match its hashes"),
                  "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A dump cut short by a full disk (test_record_cut_short): what it holds
 * is compared and the output says it is partial; no divergence over part
 * of a run is not a pass (exit 2). */
START_TEST(test_compare_partial)
{
    char dir[64], args[768];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    ck_assert_int_eq(test_record_cut_short(dir), 0);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/part.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "identical over what both hold: 6 layers x 60 positions"), "%s",
                  out);
    ck_assert_msg(strstr(out, "INCOMPLETE: no divergence over what both hold, but "), "%s", out);
    ck_assert_msg(strstr(out, "part.h5 is partial"), "%s", out);
    ck_assert_msg(strstr(out, "compared the overlap only"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Selections: disjoint ones are refused, overlapping ones compared on the
 * overlap, and the output says which. */
START_TEST(test_compare_selections)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "l01.h5", "--dump-layers 0:1");
    record(dir, "l34.h5", "--engine chunked --chunk 5 --dump-layers 3:4");
    record(dir, "late.h5", "--engine chunked --chunk 5 --dump-positions 45: --dump-stages k,v");
    snprintf(args, sizeof args, "compare %s/l01.h5 %s/l34.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "kvdiff compare: ") && strstr(out, "nothing to compare"), "%s", out);
    ck_assert_msg(strstr(out, "l01.h5") && strstr(out, "l34.h5"), "%s", out);
    snprintf(args, sizeof args, "compare %s/l01.h5 %s/late.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "identical: 2 layers x 10 positions x 2 stages"), "%s", out);
    ck_assert_msg(strstr(out, "positions 45..54"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Sets a scalar attribute of obj in path: a string (text) or an int64. */
static void set_attr(const char *path, const char *obj, const char *name, const char *text,
                     int64_t value)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t o = H5Oopen(f, obj, H5P_DEFAULT);
    ck_assert_int_ge(o, 0);
    if (H5Aexists(o, name) > 0)
        ck_assert_int_ge(H5Adelete(o, name), 0);
    hid_t sp = H5Screate(H5S_SCALAR), t = text ? H5Tcopy(H5T_C_S1) : H5Tcopy(H5T_STD_I64LE);
    if (text)
        H5Tset_size(t, strlen(text) + 1);
    hid_t a = H5Acreate2(o, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert_int_ge(a, 0);
    ck_assert_int_ge(text ? H5Awrite(a, t, text) : H5Awrite(a, H5T_NATIVE_INT64, &value), 0);
    H5Aclose(a);
    H5Tclose(t);
    H5Sclose(sp);
    H5Oclose(o);
    H5Fclose(f);
}

static json_t *compare_json(const char *dir, const char *a, const char *b, int want)
{
    char args[512];
    snprintf(args, sizeof args, "compare --json %s/%s %s/%s", dir, a, dir, b);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == want, "%s", out);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_msg(j != NULL, "%s", out);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "exit_code")), want);
    return j;
}

/* Runs of different lengths are not identical, whichever is longer: text,
 * JSON and the report agree (exit 1). */
START_TEST(test_compare_token_count_differs)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 4 "
             "--max-new 4 --ignore-eos --dump %s/short.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args, "compare %s/%s %s/%s", dir, k ? "short.h5" : "ref.h5", dir,
                 k ? "ref.h5" : "short.h5");
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
        ck_assert_msg(strstr(out, "the runs generated different numbers of tokens"), "%s", out);
        ck_assert_msg(!strstr(out, "identical:"), "%s", out);
    }
    json_t *j = compare_json(dir, "ref.h5", "short.h5", 1);
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "diverged");
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "tokens"), "verdict")),
                     "length_differs");
    json_decref(j);
    snprintf(args, sizeof args, "report %s/ref.h5 %s/short.h5 -o %s/rep", dir, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "token counts do (reference 56, test 44)"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A prompt_length larger than the tokens recorded: validate rejects the
 * file, and so does compare (exit 2, naming it). */
START_TEST(test_compare_tokens_shorter_than_prompt)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "");
    /* both sides alike, so no prompt mismatch refuses the pair first */
    snprintf(path, sizeof path, "%s/ref.h5", dir);
    set_attr(path, "/tokens", "prompt_length", NULL, 60);
    snprintf(path, sizeof path, "%s/t.h5", dir);
    set_attr(path, "/tokens", "prompt_length", NULL, 60);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "ref.h5: /tokens: prompt_length 60 is larger than the 56 tokens"),
                  "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Two partial dumps with nothing between them: identical over what both
 * hold, said so, and exit 2 (a gate must not pass on part of a run); a
 * divergence in what they hold is still exit 1. */
START_TEST(test_compare_both_partial)
{
    char dir[64], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "a.h5", "");
    record(dir, "b.h5", "--engine chunked --chunk 5");
    record(dir, "bad.h5", "--engine chunked --chunk 5 --inject window=4");
    snprintf(path, sizeof path, "%s/a.h5", dir);
    set_attr(path, "/", "status", "partial: interrupted by SIGTERM", 0);
    snprintf(path, sizeof path, "%s/b.h5", dir);
    set_attr(path, "/", "status", "partial: running", 0);
    snprintf(path, sizeof path, "%s/bad.h5", dir);
    set_attr(path, "/", "status", "partial: running", 0);
    char args[512];
    snprintf(args, sizeof args, "compare %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "identical over what both hold: ") &&
                      strstr(out, "both partial (") &&
                      strstr(out, "a.h5: partial: interrupted by SIGTERM; ") &&
                      strstr(out, "b.h5: partial: its writer ended without closing it"), "%s",
                  out);
    json_t *j = compare_json(dir, "a.h5", "b.h5", 2);
    ck_assert(json_is_true(json_object_get(j, "incomplete")));
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "identical");
    json_decref(j);
    snprintf(args, sizeof args, "compare %s/a.h5 %s/bad.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Rows changed behind their hashes are caught without --no-hashes: a
 * stage edited throughout (the sample reads part of every stage), and one
 * row just before a divergence (read whole), each with a NaN or a value;
 * the compare then reads every row and finds the first divergence there. */
START_TEST(test_compare_hash_sample)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "--engine chunked --chunk 5");
    record(dir, "bad.h5", "--engine chunked --chunk 5 --inject window=4");
    snprintf(path, sizeof path, "%s/t.h5", dir);
    for (hsize_t p = 0; p < 55; p++)
        poke(path, "/layers/2/k", p, 3, p == 20 ? NAN : 1.5f, false);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 0, layer 2"), "%s", out);
    ck_assert_msg(strstr(out, "t.h5: the row hash of k, layer 2, position ") &&
                      strstr(out, "is stale"), "%s", out);
    json_t *j = compare_json(dir, "ref.h5", "t.h5", 1);
    json_t *st = json_object_get(json_object_get(j, "hash_check"), "stale");
    ck_assert_str_eq(json_string_value(json_object_get(st, "stage")), "k");
    json_decref(j);
    /* window=4 first diverges at position 4 (attn_lse of layer 0); a stale
     * q row of the reference at position 3 is the earlier divergence */
    snprintf(path, sizeof path, "%s/ref.h5", dir);
    poke(path, "/layers/0/q", 3, 5, 2.0f, false);
    snprintf(args, sizeof args, "compare %s %s/bad.h5", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 3, layer 0 (sliding, window 12), "
                              "stage q"), "%s", out);
    ck_assert_msg(strstr(out, "the row hash of q, layer 0, position 3 is stale"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A stage one side lacks (a model-level one too) is named in the note on
 * the overlap, with the exit code of what both hold. */
START_TEST(test_compare_missing_stage_named)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "--engine chunked --chunk 5");
    snprintf(path, sizeof path, "%s/t.h5", dir);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0 && H5Ldelete(f, "/model/embed", H5P_DEFAULT) >= 0);
    H5Ldelete(f, "/model/embed.hash", H5P_DEFAULT);
    H5Ldelete(f, "/model/embed.stats", H5P_DEFAULT);
    H5Fclose(f);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "compared the overlap only (layers 0-5, positions 0..54): ") &&
                      strstr(out, "ref.h5 alone holds embed"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Greedy runs whose token is not their own top-1: the test contradicting
 * itself is a divergence; the reference doing so is said. */
static void swap_top2(const char *path, hsize_t row)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "/output/topk_ids", H5P_DEFAULT);
    ck_assert(f >= 0 && d >= 0);
    hid_t fs = H5Dget_space(d);
    hsize_t dims[2];
    H5Sget_simple_extent_dims(fs, dims, NULL);
    int32_t ids[64];
    ck_assert(dims[1] >= 2 && dims[1] <= 64);
    hsize_t start[2] = {row, 0}, count[2] = {1, dims[1]};
    H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL);
    hid_t ms = H5Screate_simple(2, count, NULL);
    ck_assert_int_ge(H5Dread(d, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, ids), 0);
    int32_t t = ids[0];
    ids[0] = ids[1];
    ids[1] = t;
    ck_assert_int_ge(H5Dwrite(d, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, ids), 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

START_TEST(test_compare_greedy_contradiction)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "t.h5", "--engine chunked --chunk 5");
    snprintf(path, sizeof path, "%s/t.h5", dir);
    swap_top2(path, 6);   /* /output starts at the last prompt position, 39 */
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "the test contradicts itself: greedy, its token at position 46 "),
                  "%s", out);
    json_t *j = compare_json(dir, "ref.h5", "t.h5", 1);
    json_t *c = json_object_get(json_object_get(json_object_get(j, "tokens"),
                                                "contradicts_own_topk"), "test");
    ck_assert_int_eq(json_integer_value(json_object_get(c, "position")), 45);
    json_decref(j);
    /* The other way round: the reference contradicts itself; the two
     * /output differ (the top two swapped), which is a divergence. */
    snprintf(args, sizeof args, "compare %s %s/ref.h5", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "the reference contradicts itself") &&
                  strstr(out, "the test has token id"), "%s", out);
    /* NaN logits (NaN weights) rank nothing: the token that is the top-1 id,
     * or any token under a NaN top value, is no contradiction */
    snprintf(path, sizeof path, "%s/ref.h5", dir);
    poke(path, "/output/topk_values", 3, 0, NAN, false);
    poke(path, "/output/topk_values", 3, 1, NAN, false);
    snprintf(args, sizeof args, "compare %s %s", path, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(!strstr(out, "contradicts itself"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* /output                                                              */

/* Element (row, col) of /output's float dataset name (lse: col 0) in
 * path, nudged by one ulp upward (factor 0) or scaled by factor. */
static void edit_output(const char *path, const char *name, hsize_t row, hsize_t col,
                        float factor)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = f >= 0 ? H5Dopen2(f, name, H5P_DEFAULT) : -1;
    ck_assert(f >= 0 && d >= 0);
    hid_t fs = H5Dget_space(d);
    hsize_t dims[2] = {0, 1};
    const int nd = H5Sget_simple_extent_dims(fs, dims, NULL);
    ck_assert(nd >= 1 && row < dims[0] && (nd == 1 || col < dims[1]));
    const hsize_t cols = nd == 2 ? dims[1] : 1;
    float *buf = malloc(dims[0] * cols * sizeof *buf);
    ck_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    float *x = &buf[row * cols + col];
    *x = factor == 0 ? nextafterf(*x, INFINITY) : *x * factor;
    ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    free(buf);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

/* Between kvdiff's own engines /output is compared bit for bit like any
 * stage: a top-k value one ulp off, or the log-sum-exp scaled by 0.9,
 * with every recorded stage and every token identical (a final-norm or
 * LM-head bug that keeps the argmax) was "identical", exit 0. Now the
 * first divergence, at its position, from /output, exit 1; and the JSON
 * says so and reads back. */
START_TEST(test_compare_output_bits)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 30 --max-new 4 --dump "
             "%s/a.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    static const struct {
        const char *dset;
        hsize_t row, col;
        float factor;
        long pos;
        const char *where;
    } edits[] = {{"/output/topk_values", 2, 1, 0, 31, "rank 2 of /output's top-k, token id"},
                 {"/output/lse", 1, 0, 0.9f, 30, "the log-sum-exp in /output"}};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "run --model tiny-gemma3 --engine chunked --chunk 7 "
                 "--prompt-random 30 --max-new 4 --dump %s/b.h5", dir);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        snprintf(args, sizeof args, "compare %s/a.h5 %s/b.h5", dir, dir);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0 && strstr(out, "identical"), "%s",
                      out);
        snprintf(args, sizeof args, "%s/b.h5", dir);
        edit_output(args, edits[i].dset, edits[i].row, edits[i].col, edits[i].factor);
        snprintf(args, sizeof args, "compare %s/a.h5 %s/b.h5", dir, dir);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
        char want[128];
        snprintf(want, sizeof want, "FIRST DIVERGENCE  position %ld, model level, stage logits",
                 edits[i].pos);
        ck_assert_msg(strstr(out, want) && strstr(out, edits[i].where) &&
                      strstr(out, "/output differs at position"), "%s", out);
        snprintf(args, sizeof args, "compare %s/a.h5 %s/b.h5 --json", dir, dir);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
        json_t *j = json_loads(out, 0, NULL);
        ck_assert_ptr_nonnull(j);
        json_t *d = json_object_get(j, "first_divergence");
        ck_assert(json_is_true(json_object_get(d, "from_output")));
        ck_assert_int_eq(json_integer_value(json_object_get(d, "position")), edits[i].pos);
        char json[160];
        snprintf(json, sizeof json, "%s/r.json", dir);
        ck_assert_int_eq(json_dump_file(j, json, 0), 0);
        json_decref(j);
        snprintf(args, sizeof args, "report %s -o %s/rep%d", json, dir, i);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    }
    test_rmtree(dir);
}
END_TEST

/* Across runtimes /output is the last step of the drift walk at each
 * position: a top-k value or the log-sum-exp scaled by 0.9 in another
 * runtime's recording passed as "no bug" (only the stages were walked);
 * one ulp stays drift. The test is kvdiff's own recording said to be
 * PyTorch's, so that every stage agrees and /output alone differs. */
START_TEST(test_compare_output_drift)
{
    char dir[64], args[1024], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 30 --max-new 4 --dump "
             "%s/a.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(path, sizeof path, "%s/b.h5", dir);
    static const struct {
        const char *dset;
        hsize_t row, col;
        float factor;
        int rc;
        const char *says;
    } edits[] = {{NULL, 0, 0, 0, 0, "identical: "},
                 {"/output/topk_values", 2, 1, 0, 0, "/output within drift (max rel"},
                 {"/output/lse", 1, 0, 0, 0, "/output within drift (max rel"},
                 {"/output/topk_values", 2, 1, 0.9f, 1,
                  "FIRST STEP ABOVE DRIFT  position 31, model level, stage logits, rank 2"},
                 {"/output/lse", 1, 0, 0.9f, 1, "the log-sum-exp in /output"}};
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        snprintf(args, sizeof args, "cp %s/a.h5 %s", dir, path);
        ck_assert_int_eq(system(args), 0);
        set_attr(path, "/", "engine", "pytorch", 0);
        set_attr(path, "/", "engine_settings", "{\"compute_dtype\": \"f32\"}", 0);
        if (edits[i].dset)
            edit_output(path, edits[i].dset, edits[i].row, edits[i].col, edits[i].factor);
        snprintf(args, sizeof args, "compare %s/a.h5 %s", dir, path);
        const int rc = test_run_cli(args, out, sizeof out);
        ck_assert_msg(rc == edits[i].rc && strstr(out, edits[i].says) &&
                          (i == 0 || strstr(out, "cross-runtime")),
                      "edit %zu: exit %d:\n%s", i, rc, out);
    }
    test_rmtree(dir);
}
END_TEST

/* Recordings given the wrong way round (the chunked engine's first):
 * a note says so, and the diagnosis never claims a window the config
 * already gives ("window in test appears to be 5, config says 12"). */
START_TEST(test_compare_wrong_way_round)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 30 --max-new 2 --dump "
             "%s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --engine chunked --chunk 5 --inject "
             "window=4 --prompt-random 30 --max-new 2 --dump %s/bug.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/bug.h5 %s/ref.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "the reference read 4 keys at position 4 where the config's key "
                              "set holds 5") &&
                  !strncmp(out, "SWAPPED?   the arguments look the wrong way round: the first "
                                "recording is kvdiff's chunked engine", 97) &&
                  !strstr(out, "window in test appears"), "%s", out);
    test_rmtree(dir);
}
END_TEST

Suite *compare_cli_suite(void)
{
    Suite *s = suite_create("compare_cli");
    TCase *tc = tcase_create("binary");
    tcase_add_test(tc, test_compare_verdicts);
    tcase_add_test(tc, test_compare_refusals);
    tcase_add_loop_test(tc, test_compare_nonfinite, 0, 2);
    tcase_add_test(tc, test_compare_partial);
    tcase_add_test(tc, test_compare_stale_hash);
    tcase_add_test(tc, test_compare_token_count_differs);
    tcase_add_test(tc, test_compare_tokens_shorter_than_prompt);
    tcase_add_test(tc, test_compare_both_partial);
    tcase_add_test(tc, test_compare_hash_sample);
    tcase_add_test(tc, test_compare_greedy_contradiction);
    tcase_add_test(tc, test_compare_missing_stage_named);
    tcase_add_test(tc, test_compare_index);
    tcase_add_test(tc, test_compare_selections);
    tcase_add_test(tc, test_compare_output_bits);
    tcase_add_test(tc, test_compare_output_drift);
    tcase_add_test(tc, test_compare_wrong_way_round);
    suite_add_tcase(s, tc);
    return s;
}
