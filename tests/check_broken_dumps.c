/* check_broken_dumps.c — `kvdiff compare` refuses what `kvdiff validate`
 * rejects. A dump identical to the reference is broken in one way per
 * case (a row dataset rewritten with another type, shape or row count,
 * made unreadable, or pointed at another file; a bad first_position,
 * /tokens, /output or engine_settings; a layer group that is no layer):
 * validate must reject it, and compare must refuse it (exit 2, one line
 * naming the file and the dataset) both when the row hash index could
 * settle the compare and with --no-hashes. Before this, the index and the
 * hashes settled such a pair as "identical" (exit 0). */
#include <check.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "h5edit.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Files                                                                */

static void copy_file(const char *from, const char *to)
{
    ck_assert_msg(test_copy_file(from, to) == 0, "copying %s to %s", from, to);
}

static void record(const char *dir, const char *name)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 24 --seed 4 "
             "--max-new 4 --ignore-eos --dump %s/%s", dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

static void set_int_attr(hid_t obj, const char *name, long long v)
{
    if (H5Aexists(obj, name) > 0)
        ck_assert(H5Adelete(obj, name) >= 0);
    hid_t s = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &v) >= 0);
    H5Aclose(a);
    H5Sclose(s);
}

static void set_first(hid_t h, const char *path, long long first)
{
    hid_t d = H5Dopen2(h, path, H5P_DEFAULT);
    ck_assert(d >= 0);
    set_int_attr(d, "first_position", first);
    H5Dclose(d);
}

/* Rows and columns of a dataset. */
static void dims_of(hid_t h, const char *path, hsize_t dims[2])
{
    hid_t d = H5Dopen2(h, path, H5P_DEFAULT), s = H5Dget_space(d);
    dims[1] = 1;
    ck_assert(H5Sget_simple_extent_dims(s, dims, NULL) >= 1);
    H5Sclose(s);
    H5Dclose(d);
}

/* Replaces dataset path: type, rank dimensions, the dcpl given (or the
 * default), filled with zeros (write true) or left to the fill value, and
 * first_position 0. */
static void replace(hid_t h, const char *path, hid_t type, int rank, const hsize_t *dims,
                    hid_t dcpl, bool write)
{
    if (H5Lexists(h, path, H5P_DEFAULT) > 0)
        ck_assert(H5Ldelete(h, path, H5P_DEFAULT) >= 0);
    hid_t s = H5Screate_simple(rank, dims, NULL);
    hid_t d = H5Dcreate2(h, path, type, s, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ck_assert(d >= 0);
    if (write) {
        size_t n = H5Tget_size(type);
        for (int i = 0; i < rank; i++)
            n *= dims[i];
        void *zeros = calloc(1, n);
        ck_assert(zeros && H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros) >= 0);
        free(zeros);
    }
    set_int_attr(d, "first_position", 0);
    H5Dclose(d);
    H5Sclose(s);
}

/* A filter this test registers, writes with and forgets: kvdiff, another
 * process, does not have it, as a reader lacks a plugin (LZF, Blosc). */
#define TEST_FILTER 32123

static size_t pass_through(unsigned flags, size_t cd_nelmts, const unsigned cd_values[],
                           size_t nbytes, size_t *buf_size, void **buf)
{
    (void)flags, (void)cd_nelmts, (void)cd_values, (void)buf_size, (void)buf;
    return nbytes;
}

/* ------------------------------------------------------------------ */
/* Breakages                                                            */

typedef enum {
    B_INT32, B_FLOAT16, B_FLOAT64, B_3D, B_1D, B_WIDTH, B_FIVE_ROWS, B_FILTER, B_LINK_LOOP,
    B_EXT_STORAGE, B_EXT_LINK, B_HASH_TYPE, B_STATS_WIDTH, B_FIRST_NEG, B_FIRST_2_31,
    B_FIRST_2_62, B_NO_TOKENS, B_TOPK_IDS, B_K0, B_K_HUGE, B_SETTINGS, B_LAYER_NAME,
    B_LAYER_EXT_LINK, B_VIRTUAL, B_FLETCHER, B_COUNT
} breakage;

/* What compare's one line must say (beside the file's name). */
static const char *const says[B_COUNT] = {
    [B_INT32] = "/layers/0/x_in is not float32",
    [B_FLOAT16] = "/layers/0/x_in is not float32",
    [B_FLOAT64] = "/layers/0/x_in is not float32",
    [B_3D] = "/layers/0/x_in is not 2-D",
    [B_1D] = "/layers/0/x_in is not 2-D",
    [B_WIDTH] = "/layers/0/x_in has 5 columns; the model config says 64",
    [B_FIVE_ROWS] = "/layers/0/x_in (5 rows from position 0) and /layers/0/x_in.hash (27 rows",
    [B_FILTER] = "/layers/0/x_in needs HDF5 filter 32123",
    [B_LINK_LOOP] = "/layers/0/x_in cannot be opened",
    [B_EXT_STORAGE] = "/layers/0/x_in keeps its data in another file (external storage)",
    [B_EXT_LINK] = "/layers/0/x_in is an external link",
    [B_HASH_TYPE] = "/layers/0/x_in.hash is not uint64",
    [B_STATS_WIDTH] = "/layers/0/x_in.stats has 3 columns",
    [B_FIRST_NEG] = "/layers/0/x_in: first_position -1 is negative",
    [B_FIRST_2_31] = "/layers/0/x_in covers positions 2147483647 and on (27 rows)",
    [B_FIRST_2_62] = "/layers/0/x_in covers positions 4611686018427387904 and on",
    [B_NO_TOKENS] = "/tokens is missing",
    [B_TOPK_IDS] = "/output/topk_ids holds ids outside 0..255",
    [B_K0] = "/output: attribute k is 0",
    [B_K_HUGE] = "/output: attribute k is 1000000000",
    [B_SETTINGS] = "engine_settings is not a JSON object",
    [B_LAYER_NAME] = "/layers/abc: the group name is not a layer index",
    [B_LAYER_EXT_LINK] = "/layers/1 is an external link",
    [B_VIRTUAL] = "/layers/0/x_in is a virtual dataset (its rows live in other files)",
    [B_FLETCHER] = "/layers/0/x_in needs HDF5 filter 3: kvdiff reads only deflate and shuffle",
};

static void break_dump(hid_t h, breakage b, const char *dir, const char *ref)
{
    const char *x = "layers/0/x_in";
    hsize_t d[3];
    dims_of(h, x, d);
    const hsize_t rows = d[0], E = d[1];
    switch (b) {
    case B_INT32: replace(h, x, H5T_STD_I32LE, 2, d, H5P_DEFAULT, true); break;
    case B_FLOAT16: {
        hid_t t = H5Tcopy(H5T_IEEE_F32LE);
        ck_assert(H5Tset_fields(t, 15, 10, 5, 0, 10) >= 0 && H5Tset_precision(t, 16) >= 0 &&
                  H5Tset_size(t, 2) >= 0 && H5Tset_ebias(t, 15) >= 0);
        replace(h, x, t, 2, d, H5P_DEFAULT, false);
        H5Tclose(t);
        break;
    }
    case B_FLOAT64: replace(h, x, H5T_IEEE_F64LE, 2, d, H5P_DEFAULT, true); break;
    case B_3D: {
        hsize_t three[3] = {rows, E / 2, 2};
        replace(h, x, H5T_IEEE_F32LE, 3, three, H5P_DEFAULT, true);
        break;
    }
    case B_1D: {
        hsize_t one[1] = {rows};
        replace(h, x, H5T_IEEE_F32LE, 1, one, H5P_DEFAULT, true);
        break;
    }
    case B_WIDTH: {
        hsize_t five[2] = {rows, 5};
        replace(h, x, H5T_IEEE_F32LE, 2, five, H5P_DEFAULT, true);
        break;
    }
    case B_FIVE_ROWS: {
        hsize_t five[2] = {5, E};
        replace(h, x, H5T_IEEE_F32LE, 2, five, H5P_DEFAULT, true);
        break;
    }
    case B_FILTER: {
        const H5Z_class2_t cls = {H5Z_CLASS_T_VERS, TEST_FILTER, 1, 1, "test pass-through",
                                  NULL, NULL, pass_through};
        ck_assert(H5Zregister(&cls) >= 0);
        hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
        hsize_t chunk[2] = {8, E};
        ck_assert(H5Pset_chunk(dcpl, 2, chunk) >= 0 &&
                  H5Pset_filter(dcpl, TEST_FILTER, H5Z_FLAG_MANDATORY, 0, NULL) >= 0);
        replace(h, x, H5T_IEEE_F32LE, 2, d, dcpl, true);
        H5Pclose(dcpl);
        break;   /* unregistered after the file is closed */
    }
    case B_LINK_LOOP:
        ck_assert(H5Ldelete(h, x, H5P_DEFAULT) >= 0);
        ck_assert(H5Lcreate_soft("/layers/0/x_in", h, x, H5P_DEFAULT, H5P_DEFAULT) >= 0);
        break;
    case B_EXT_STORAGE: {
        /* the rows of the file it was copied from, so the values agree */
        hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
        ck_assert(H5Pset_external(dcpl, ref, 0, rows * E * 4) >= 0);
        replace(h, x, H5T_IEEE_F32LE, 2, d, dcpl, false);
        H5Pclose(dcpl);
        break;
    }
    case B_VIRTUAL: {
        /* the very same rows, mapped from the reference file */
        hid_t space = H5Screate_simple(2, d, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE);
        ck_assert(H5Pset_virtual(dcpl, space, ref, "/layers/0/x_in", space) >= 0);
        ck_assert(H5Ldelete(h, x, H5P_DEFAULT) >= 0);
        hid_t vd = H5Dcreate2(h, x, H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
        ck_assert(vd >= 0);
        set_int_attr(vd, "first_position", 0);
        H5Dclose(vd);
        H5Pclose(dcpl);
        H5Sclose(space);
        break;
    }
    case B_FLETCHER: {
        /* a filter libhdf5 has built in, but not one kvdiff writes */
        hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
        hsize_t chunk[2] = {8, E};
        ck_assert(H5Pset_chunk(dcpl, 2, chunk) >= 0 && H5Pset_fletcher32(dcpl) >= 0);
        replace(h, x, H5T_IEEE_F32LE, 2, d, dcpl, true);
        H5Pclose(dcpl);
        break;
    }
    case B_EXT_LINK:
        /* the very same rows, in the reference file */
        ck_assert(H5Ldelete(h, x, H5P_DEFAULT) >= 0);
        ck_assert(H5Lcreate_external(ref, "/layers/0/x_in", h, x, H5P_DEFAULT, H5P_DEFAULT) >= 0);
        break;
    case B_HASH_TYPE: {
        hsize_t one[1] = {rows};
        replace(h, "layers/0/x_in.hash", H5T_IEEE_F32LE, 1, one, H5P_DEFAULT, true);
        break;
    }
    case B_STATS_WIDTH: {
        hsize_t three[2] = {rows, 3};
        replace(h, "layers/0/x_in.stats", H5T_IEEE_F32LE, 2, three, H5P_DEFAULT, true);
        break;
    }
    case B_FIRST_NEG:
    case B_FIRST_2_31:
    case B_FIRST_2_62: {
        /* rows, hashes and statistics alike: only the position is wrong */
        const long long first = b == B_FIRST_NEG ? -1 : b == B_FIRST_2_31 ? 2147483647LL
                                                                          : 1LL << 62;
        set_first(h, x, first);
        set_first(h, "layers/0/x_in.hash", first);
        set_first(h, "layers/0/x_in.stats", first);
        break;
    }
    case B_NO_TOKENS: ck_assert(H5Ldelete(h, "tokens", H5P_DEFAULT) >= 0); break;
    case B_TOPK_IDS: {
        hid_t ds = H5Dopen2(h, "output/topk_ids", H5P_DEFAULT), fs = H5Dget_space(ds);
        hsize_t start[2] = {3, 1}, count[2] = {1, 1};
        ck_assert(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0);
        hid_t ms = H5Screate_simple(2, count, NULL);
        int32_t id = 99999;
        ck_assert(H5Dwrite(ds, H5T_NATIVE_INT32, ms, fs, H5P_DEFAULT, &id) >= 0);
        H5Sclose(ms);
        H5Sclose(fs);
        H5Dclose(ds);
        break;
    }
    case B_K0:
    case B_K_HUGE: {
        hid_t g = H5Gopen2(h, "output", H5P_DEFAULT);
        set_int_attr(g, "k", b == B_K0 ? 0 : 1000000000);
        H5Gclose(g);
        break;
    }
    case B_SETTINGS: test_set_str_attr(h, "engine_settings", "chunk=5"); break;
    case B_LAYER_NAME:
        ck_assert(H5Lcreate_hard(h, "layers/1", h, "layers/abc", H5P_DEFAULT, H5P_DEFAULT) >= 0);
        break;
    case B_LAYER_EXT_LINK:
        ck_assert(H5Ldelete(h, "layers/1", H5P_DEFAULT) >= 0);
        ck_assert(H5Lcreate_external(ref, "/layers/1", h, "layers/1", H5P_DEFAULT,
                                     H5P_DEFAULT) >= 0);
        break;
    default: break;
    }
    (void)dir;
}

/* Lines of text (a last line without its newline counts). */
static int count_lines(const char *s)
{
    int n = 0;
    for (const char *p = s; *p; p++)
        n += *p == '\n';
    return n + (s[0] && s[strlen(s) - 1] != '\n');
}

START_TEST(test_compare_refuses_broken_dumps)
{
    char dir[64], ref[128], same[128], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5");
    record(dir, "same.h5");
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(same, sizeof same, "%s/same.h5", dir);
    snprintf(path, sizeof path, "%s/broken.h5", dir);
    /* the pair as recorded: settled by the row hash indexes */
    snprintf(args, sizeof args, "compare %s %s", ref, same);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "identical") && strstr(out, "row hash index"), "%s", out);
    for (int b = 0; b < B_COUNT; b++) {
        copy_file(same, path);
        hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
        ck_assert(h >= 0);
        break_dump(h, (breakage)b, dir, ref);
        ck_assert(H5Fclose(h) >= 0);
        if (b == B_FILTER)
            ck_assert(H5Zunregister(TEST_FILTER) >= 0);
        snprintf(args, sizeof args, "validate %s", path);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 2,
                      "breakage %d: validate accepts it:\n%s", b, out);
        for (int no_hashes = 0; no_hashes < 2; no_hashes++) {
            snprintf(args, sizeof args, "compare %s%s %s", no_hashes ? "--no-hashes " : "", ref,
                     path);
            const int rc = test_run_cli(args, out, sizeof out);
            ck_assert_msg(rc == 2 && strstr(out, path) && strstr(out, says[b]) &&
                          count_lines(out) == 1,
                          "breakage %d%s: exit %d (want 2 and one line with '%s: ... %s'):\n%s",
                          b, no_hashes ? " with --no-hashes" : "", rc, path, says[b], out);
        }
    }
    test_rmtree(dir);
}
END_TEST

/* A dataset naming a filter libhdf5 lacks makes it look for a plugin in
 * HDF5_PLUGIN_PATH, and load (run) every library there. A plugin that
 * leaves a mark when loaded: libhdf5 as it comes loads it; kvdiff must not. */
static const char marker_plugin[] =
    "#include <fcntl.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
    "__attribute__((constructor)) static void loaded(void)\n"
    "{ const char *m = getenv(\"KVDIFF_TEST_PLUGIN_MARK\");\n"
    "  if (m) { int fd = open(m, O_CREAT | O_WRONLY, 0600); if (fd >= 0) close(fd); } }\n"
    "int H5PLget_plugin_type(void) { return 0; }\n"
    "const void *H5PLget_plugin_info(void) { return 0; }\n";

#define PLUGIN_FILTER 32124

START_TEST(test_no_plugin_is_loaded)
{
    char dir[64], src[128], plugins[128], mark[128], ref[128], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(src, sizeof src, "%s/mark.c", dir);
    snprintf(plugins, sizeof plugins, "%s/plugins", dir);
    snprintf(mark, sizeof mark, "%s/loaded", dir);
    FILE *f = fopen(src, "w");
    ck_assert(f && fputs(marker_plugin, f) >= 0 && fclose(f) == 0);
    ck_assert(mkdir(plugins, 0700) == 0);
    snprintf(args, sizeof args, "cc -shared -fPIC -o %s/libmark.so %s", plugins, src);
    ck_assert_msg(system(args) == 0, "%s", args);
    ck_assert(setenv("KVDIFF_TEST_PLUGIN_MARK", mark, 1) == 0);
    /* the plugin works: an unguarded libhdf5 asked for the filter loads it */
    ck_assert(H5PLset_loading_state(H5PL_ALL_PLUGIN) >= 0 && H5PLprepend(plugins) >= 0);
    H5E_BEGIN_TRY {
        (void)H5Zfilter_avail(PLUGIN_FILTER);
    } H5E_END_TRY;
    ck_assert_msg(access(mark, F_OK) == 0, "the test plugin was not loaded by libhdf5 itself");
    ck_assert(unlink(mark) == 0);

    record(dir, "ref.h5");
    record(dir, "broken.h5");
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(path, sizeof path, "%s/broken.h5", dir);
    const H5Z_class2_t cls = {H5Z_CLASS_T_VERS, PLUGIN_FILTER, 1, 1, "test pass-through", NULL,
                              NULL, pass_through};
    ck_assert(H5Zregister(&cls) >= 0);
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hsize_t d[2], chunk[2];
    dims_of(h, "layers/0/x_in", d);
    chunk[0] = 8, chunk[1] = d[1];
    ck_assert(H5Pset_chunk(dcpl, 2, chunk) >= 0 &&
              H5Pset_filter(dcpl, PLUGIN_FILTER, H5Z_FLAG_MANDATORY, 0, NULL) >= 0);
    replace(h, "layers/0/x_in", H5T_IEEE_F32LE, 2, d, dcpl, true);
    H5Pclose(dcpl);
    ck_assert(H5Fclose(h) >= 0 && H5Zunregister(PLUGIN_FILTER) >= 0);

    ck_assert(setenv("HDF5_PLUGIN_PATH", plugins, 1) == 0);
    const char *verbs[] = {"validate %s", "inspect %s", "compare %s %s", "compare --no-hashes %s %s"};
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
        snprintf(args, sizeof args, verbs[i], i < 2 ? path : ref, path);
        const int rc = test_run_cli(args, out, sizeof out);
        ck_assert_msg(access(mark, F_OK) != 0, "%s loaded the plugin:\n%s", args, out);
        if (i != 1)
            ck_assert_msg(rc == 2 && strstr(out, "needs HDF5 filter 32124"), "%s: exit %d:\n%s",
                          args, rc, out);
    }
    unsetenv("HDF5_PLUGIN_PATH");
    unsetenv("KVDIFF_TEST_PLUGIN_MARK");
    test_rmtree(dir);
}
END_TEST

/* A layer group whose link index (a v2 B-tree leaf, "BTLF") is damaged
 * opens, but no member of it does: compare read its stages as "not
 * recorded" and said identical (exit 0) where validate says the file is
 * corrupt. It must refuse, as validate does. */
START_TEST(test_compare_refuses_a_group_that_does_not_list)
{
    char dir[64], ref[128], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5");
    record(dir, "broken.h5");
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(path, sizeof path, "%s/broken.h5", dir);
    FILE *f = fopen(path, "r+b");
    ck_assert(f);
    static unsigned char bytes[8 << 20];
    const size_t n = fread(bytes, 1, sizeof bytes, f);
    ck_assert(n > 0 && n < sizeof bytes);
    long last = -1;
    for (size_t i = 0; i + 4 <= n; i++)
        if (memcmp(bytes + i, "BTLF", 4) == 0)
            last = (long)i;
    ck_assert_msg(last >= 0, "no v2 B-tree leaf: the dump's groups are no longer dense");
    bytes[last + 12] ^= 0xff;   /* past the signature: its checksum fails */
    ck_assert(fseek(f, last + 12, SEEK_SET) == 0 && fputc(bytes[last + 12], f) != EOF);
    ck_assert(fclose(f) == 0);

    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2 && strstr(out, "cannot be listed"),
                  "%s", out);
    for (int no_hashes = 0; no_hashes < 2; no_hashes++) {
        snprintf(args, sizeof args, "compare %s%s %s", no_hashes ? "--no-hashes " : "", ref, path);
        const int rc = test_run_cli(args, out, sizeof out);
        ck_assert_msg(rc == 2 && strstr(out, path) &&
                          strstr(out, "is damaged: its members cannot be listed") &&
                          count_lines(out) == 1,
                      "%s: exit %d (want 2, one line):\n%s", args, rc, out);
    }
    test_rmtree(dir);
}
END_TEST

/* A stage recorded on one side only is a selection (--dump-stages), not a
 * broken file: what both hold is compared (exit 0), and the verdict's own
 * line says what one side lacks, even where only one layer lacks it (the
 * overlap note names stages no layer of the other side holds). */
START_TEST(test_compare_names_what_a_side_lacks)
{
    char dir[64], ref[128], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5");
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    snprintf(path, sizeof path, "%s/lacks.h5", dir);
    copy_file(ref, path);
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(h >= 0);
    static const char *const gone[] = {"layers/0/q", "layers/0/q.hash", "layers/0/q.stats",
                                       "layers/2/q", "layers/2/q.hash", "layers/2/q.stats",
                                       "layers/2/k", "layers/2/k.hash", "layers/2/k.stats"};
    for (size_t i = 0; i < sizeof gone / sizeof *gone; i++)
        ck_assert(H5Ldelete(h, gone[i], H5P_DEFAULT) >= 0);
    ck_assert(H5Fclose(h) >= 0);
    char want[256];
    snprintf(want, sizeof want, "(%s lacks q of layers 0,2, k of layer 2)", path);
    for (int no_hashes = 0; no_hashes < 2; no_hashes++) {
        snprintf(args, sizeof args, "compare %s%s %s", no_hashes ? "--no-hashes " : "", ref, path);
        const int rc = test_run_cli(args, out, sizeof out);
        const char *verdict = strstr(out, "identical: 6 layers");
        const char *eol = verdict ? strchr(verdict, '\n') : NULL;
        const char *says_it = strstr(out, want);
        ck_assert_msg(rc == 0 && verdict && eol && says_it && says_it < eol,
                      "exit %d (want 0, '%s' on the verdict's line):\n%s", rc, want, out);
    }
    test_rmtree(dir);
}
END_TEST

/* A dump with flipped bits (found by fuzzing validate) on which libhdf5
 * 1.10, listing /layers/0 in name order, frees pointers of a table it
 * never filled (H5G__link_release_table under H5Literate). glibc takes
 * such garbage quietly unless allocations are filled with a pattern
 * (MALLOC_PERTURB_); then it crashed. Validate must say the group cannot
 * be listed, and end as on any other violation. */
START_TEST(test_validate_lists_a_damaged_group)
{
    const char *bad = "tests/data/damaged/link-table-free.h5";
    char args[256];
    setenv("MALLOC_PERTURB_", "165", 1);
    snprintf(args, sizeof args, "validate %s", bad);
    const int rc = test_run_cli(args, out, sizeof out);
    unsetenv("MALLOC_PERTURB_");
    ck_assert_msg(rc == 2 && strstr(out, "/layers/0: its members cannot be listed") &&
                      strstr(out, "violations of the dump schema"),
                  "exit %d: %s", rc, out);
}
END_TEST

Suite *broken_dumps_suite(void)
{
    Suite *s = suite_create("broken_dumps");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_compare_refuses_broken_dumps);
    tcase_add_test(tc, test_validate_lists_a_damaged_group);
    tcase_add_test(tc, test_compare_names_what_a_side_lacks);
    tcase_add_test(tc, test_no_plugin_is_loaded);
    tcase_add_test(tc, test_compare_refuses_a_group_that_does_not_list);
    suite_add_tcase(s, tc);
    return s;
}
