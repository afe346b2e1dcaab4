/* check_safetensors.c — tests of model/safetensors: writer/reader round
 * trips, float16/bfloat16 conversions against known bit patterns and
 * exhaustive sweeps, sharded folders, and one bad-input test for each way a
 * file or an index can be wrong (the message must name the file and the
 * problem). Every test works in its own mkdtemp folder, removed afterwards. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/safetensors.h"

/* ------------------------------------------------------------ temp folder */

/* base_dir is made once per TCase in the runner process (unchecked
 * fixture), so it is removed even when a forked test fails or crashes;
 * each test makes its own tmp_dir inside it (checked fixture). */
static char base_dir[64];
static char tmp_dir[128];

static void remove_tree(const char *path)
{
    struct stat sb;
    if (lstat(path, &sb) != 0)
        return;
    if (!S_ISDIR(sb.st_mode)) {
        unlink(path);
        return;
    }
    DIR *d = opendir(path);
    struct dirent *ent;
    while (d && (ent = readdir(d)) != NULL) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0)
            continue;
        char child[PATH_MAX];
        snprintf(child, sizeof child, "%s/%s", path, ent->d_name);
        remove_tree(child);
    }
    if (d)
        closedir(d);
    rmdir(path);
}

static void base_setup(void)
{
    snprintf(base_dir, sizeof base_dir, "/tmp/kvdiff_st_XXXXXX");
    if (!mkdtemp(base_dir)) {
        perror("mkdtemp");
        abort();
    }
}

static void base_teardown(void)
{
    remove_tree(base_dir);
}

static void dir_setup(void)
{
    snprintf(tmp_dir, sizeof tmp_dir, "%s/XXXXXX", base_dir);
    ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
}

static void dir_teardown(void)
{
    remove_tree(tmp_dir);
}

static void path_in(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", tmp_dir, name);
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL)
        n += strcmp(ent->d_name, ".") != 0 && strcmp(ent->d_name, "..") != 0;
    closedir(d);
    return n;
}

static void write_file(const char *path, const void *bytes, size_t len)
{
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    ck_assert_uint_eq(fwrite(bytes, 1, len, fp), len);
    ck_assert_int_eq(fclose(fp), 0);
}

static void write_text(const char *path, const char *text)
{
    write_file(path, text, strlen(text));
}

/* A safetensors image: length, header text as given, data_len zero bytes. */
static unsigned char *st_bytes(const char *header, size_t data_len, size_t *len)
{
    size_t hlen = strlen(header);
    *len = 8 + hlen + data_len;
    unsigned char *b = calloc(1, *len);
    ck_assert_ptr_nonnull(b);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    memcpy(b + 8, header, hlen);
    return b;
}

/* The message is one line that starts with "<file>: " and names the problem. */
static void expect_msg(const kv_err *e, const char *file, const char *needle)
{
    size_t n = strlen(file);
    ck_assert_msg(strncmp(e->msg, file, n) == 0 && e->msg[n] == ':',
                  "message does not start with '%s:': %s", file, e->msg);
    ck_assert_msg(strstr(e->msg, needle) != NULL, "expected '%s' in: %s", needle, e->msg);
    ck_assert_msg(strchr(e->msg, '\n') == NULL, "message is not one line: %s", e->msg);
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------ conversions */

START_TEST(test_bf16_known_patterns)
{
    static const struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1.0 */
        {0x3f808000u, 0x3f80}, /* tie, 0x3f80 even: down */
        {0x3f818000u, 0x3f82}, /* tie, 0x3f81 odd: up */
        {0x3f808001u, 0x3f81}, /* just over the tie */
        {0x3f807fffu, 0x3f80}, /* just under the tie */
        {0xbf818000u, 0xbf82}, /* negative tie */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x7f800000u, 0x7f80}, /* inf */
        {0xff800000u, 0xff80}, /* -inf */
        {0x80000000u, 0x8000}, /* -0 */
        {0x00008000u, 0x0000}, /* subnormal tie to even (0) */
        {0x00018000u, 0x0002}, /* subnormal tie to even (2) */
        {0x7f800001u, 0x7fc0}, /* NaN with only low payload bits stays NaN */
        {0xffc00000u, 0xffc0}, /* -NaN keeps its sign */
        {0x7fffffffu, 0x7fff},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ck_assert_msg(st_f32_to_bf16(float_of(cases[i].in)) == cases[i].out,
                      "bf16(0x%08x) = 0x%04x, want 0x%04x", (unsigned)cases[i].in,
                      (unsigned)st_f32_to_bf16(float_of(cases[i].in)), (unsigned)cases[i].out);
    ck_assert(st_bf16_to_f32(0x3f80) == 1.0f);
    ck_assert(st_bf16_to_f32(0xc040) == -3.0f);
    ck_assert(isinf(st_bf16_to_f32(0xff80)) && st_bf16_to_f32(0xff80) < 0);
    ck_assert(isnan(st_bf16_to_f32(0x7fc1)));
}
END_TEST

/* Every finite bf16 h: widening is exact, the midpoint to h+1 ties to even,
 * and one float ulp either side of it rounds to the nearer neighbour. */
START_TEST(test_bf16_sweep)
{
    for (uint32_t h = 0; h <= 0xffffu; h++) {
        ck_assert_uint_eq(bits_of(st_bf16_to_f32((uint16_t)h)), h << 16);
        if ((h & 0x7f80u) == 0x7f80u)
            continue;                          /* inf and NaN */
        uint32_t mid = (h << 16) | 0x8000u;    /* away from zero from h */
        uint16_t even = (h & 1u) ? (uint16_t)(h + 1) : (uint16_t)h;
        ck_assert_uint_eq(st_f32_to_bf16(float_of(mid)), even);
        ck_assert_uint_eq(st_f32_to_bf16(float_of(mid - 1)), h);
        ck_assert_uint_eq(st_f32_to_bf16(float_of(mid + 1)), h + 1);
        ck_assert_uint_eq(st_f32_to_bf16(st_bf16_to_f32((uint16_t)h)), h);
    }
}
END_TEST

START_TEST(test_f16_known_patterns)
{
    static const struct { float in; uint16_t out; } cases[] = {
        {1.0f, 0x3c00}, {-2.0f, 0xc000}, {0.5f, 0x3800},
        {65504.0f, 0x7bff},                 /* largest finite */
        {65519.99f, 0x7bff},                /* below the tie with 65536 */
        {65520.0f, 0x7c00},                 /* tie: to even, which is inf */
        {1e10f, 0x7c00}, {-1e10f, 0xfc00},
        {0x1p-24f, 0x0001},                 /* smallest subnormal */
        {0x1p-25f, 0x0000},                 /* tie with 0: to even */
        {0x1.8p-25f, 0x0001},
        {0x1p-26f, 0x0000},
        {0x1.8p-24f, 0x0002},               /* tie between 1 and 2: to 2 */
        {0x1.4p-23f, 0x0002},               /* 2.5 units: tie, to 2 */
        {1023 * 0x1p-24f, 0x03ff},          /* largest subnormal */
        {0x1p-14f - 0x1p-25f, 0x0400},      /* tie with smallest normal: to even */
        {0x1p-14f, 0x0400},
        {1.0f + 0x1p-11f, 0x3c00},          /* tie: even down */
        {1.0f + 3 * 0x1p-11f, 0x3c02},      /* tie: even up */
        {0.1f, 0x2e66}, {1.0f / 3.0f, 0x3555},
        {-0.0f, 0x8000}, {1e-40f, 0x0000}, {-1e-40f, 0x8000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        ck_assert_msg(st_f32_to_f16(cases[i].in) == cases[i].out,
                      "f16(%a) = 0x%04x, want 0x%04x", (double)cases[i].in,
                      (unsigned)st_f32_to_f16(cases[i].in), (unsigned)cases[i].out);
    ck_assert_uint_eq(st_f32_to_f16(INFINITY), 0x7c00);
    ck_assert_uint_eq(st_f32_to_f16(-INFINITY), 0xfc00);
    uint16_t nan = st_f32_to_f16(NAN);
    ck_assert((nan & 0x7c00u) == 0x7c00u && (nan & 0x3ffu) != 0);
    uint16_t snan = st_f32_to_f16(float_of(0x7f800001u));   /* payload below f16 bits */
    ck_assert((snan & 0x7c00u) == 0x7c00u && (snan & 0x3ffu) != 0);

    ck_assert(st_f16_to_f32(0x0001) == 0x1p-24f);
    ck_assert(st_f16_to_f32(0x8001) == -0x1p-24f);
    ck_assert(st_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
    ck_assert(st_f16_to_f32(0x0400) == 0x1p-14f);
    ck_assert(st_f16_to_f32(0x7bff) == 65504.0f);
    ck_assert(st_f16_to_f32(0x3555) == 0.333251953125f);
    ck_assert(st_f16_to_f32(0x2e66) == 0.0999755859375f);
    ck_assert(isinf(st_f16_to_f32(0x7c00)) && st_f16_to_f32(0x7c00) > 0);
    ck_assert(isinf(st_f16_to_f32(0xfc00)) && st_f16_to_f32(0xfc00) < 0);
    ck_assert(isnan(st_f16_to_f32(0x7e00)) && isnan(st_f16_to_f32(0x7c01)));
    ck_assert(st_f16_to_f32(0x8000) == 0.0f && signbit(st_f16_to_f32(0x8000)));
}
END_TEST

/* The value of an f16 bit pattern computed independently, in double. */
static double f16_reference(uint16_t h)
{
    int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v = exp == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, exp - 25);
    return (h & 0x8000u) ? -v : v;
}

/* Every f16: widening matches the reference and narrows back to itself;
 * every midpoint between neighbours ties to even, +-1 float ulp does not. */
START_TEST(test_f16_sweep)
{
    for (uint32_t h = 0; h <= 0xffffu; h++) {
        float f = st_f16_to_f32((uint16_t)h);
        if ((h & 0x7c00u) == 0x7c00u) {
            ck_assert(((h & 0x3ffu) != 0) == (isnan(f) != 0));
            ck_assert(isnan(f) || st_f32_to_f16(f) == h);
            continue;
        }
        ck_assert_msg((double)f == f16_reference((uint16_t)h), "f16 0x%04x", (unsigned)h);
        ck_assert_uint_eq(st_f32_to_f16(f), h);
        if (h & 0x8000u)
            continue;
        double upper = h == 0x7bffu ? 65536.0 : f16_reference((uint16_t)(h + 1));
        float mid = (float)(((double)f + upper) / 2);   /* exact in float */
        uint16_t even = (h & 1u) ? (uint16_t)(h + 1) : (uint16_t)h;
        ck_assert_msg(st_f32_to_f16(mid) == even, "tie above 0x%04x", (unsigned)h);
        ck_assert_uint_eq(st_f32_to_f16(nextafterf(mid, 0.0f)), h);
        ck_assert_uint_eq(st_f32_to_f16(nextafterf(mid, INFINITY)), h + 1);
        ck_assert_uint_eq(st_f32_to_f16(-mid), even | 0x8000u);
    }
}
END_TEST

/* ------------------------------------------------------------ round trips */

START_TEST(test_roundtrip_f32)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "rt.safetensors");
    const float a[6] = {1.0f, -2.5f, 3e-30f, INFINITY, -0.0f, 0x1p-140f};
    const float s = 42.0f;
    const st_decl decls[] = {
        {"w.a", ST_F32, 2, {2, 3}},
        {"scalar", ST_F32, 0, {0}},
        {"empty", ST_F32, 2, {0, 4}},
    };
    const char *const meta[] = {"case", "llama", "tokens", "1 2 3", NULL};
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, decls, 3, meta, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, a, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, &s, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, NULL, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(count_entries(tmp_dir), 1);            /* no temp file left */

    st_file *f = st_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_uint_eq(st_count(f), 3);
    const st_tensor *t = st_at(f, 0);
    ck_assert_str_eq(t->name, "w.a");
    ck_assert_str_eq(t->file, path);
    ck_assert_int_eq(t->dtype, ST_F32);
    ck_assert_int_eq(t->ndim, 2);
    ck_assert_int_eq(t->shape[0], 2);
    ck_assert_int_eq(t->shape[1], 3);
    ck_assert_uint_eq(t->nelem, 6);
    ck_assert_uint_eq(t->nbytes, 24);
    float out[6];
    ck_assert_msg(st_read_f32(t, 0, 6, out, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(memcmp(out, a, sizeof a), 0);

    ck_assert_ptr_eq(st_find(f, "scalar"), st_at(f, 1));
    ck_assert_int_eq(st_at(f, 1)->ndim, 0);
    ck_assert_uint_eq(st_at(f, 1)->nelem, 1);
    ck_assert_msg(st_read_f32(st_find(f, "scalar"), 0, 1, out, &e) == 0, "%s", e.msg);
    ck_assert(out[0] == 42.0f);
    ck_assert_uint_eq(st_find(f, "empty")->nelem, 0);
    ck_assert_uint_eq(st_find(f, "empty")->nbytes, 0);
    ck_assert_ptr_null(st_find(f, "absent"));
    ck_assert_ptr_null(st_at(f, 3));
    ck_assert_str_eq(st_metadata(f, "case"), "llama");
    ck_assert_str_eq(st_metadata(f, "tokens"), "1 2 3");
    ck_assert_ptr_null(st_metadata(f, "absent"));
    st_close(f);

    /* The header is padded with spaces so the data starts 8-aligned. */
    FILE *fp = fopen(path, "rb");
    ck_assert_ptr_nonnull(fp);
    unsigned char len_bytes[8];
    ck_assert_uint_eq(fread(len_bytes, 1, 8, fp), 8);
    fclose(fp);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | len_bytes[i];
    ck_assert_uint_eq((8 + hlen) % 8, 0);
    struct stat sb;
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_uint_eq((uint64_t)sb.st_size, 8 + hlen + 24 + 4);
}
END_TEST

START_TEST(test_roundtrip_bf16_f16)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "half.safetensors");
    enum { BIG = 40000 };                       /* more than one write block */
    const float v[5] = {1.0f, 1.0f + 0x1p-8f, -3.0f, NAN, 70000.0f};
    float *big = malloc(BIG * sizeof *big);
    ck_assert_ptr_nonnull(big);
    for (int i = 0; i < BIG; i++)
        big[i] = (float)(i - BIG / 2) * 0.37f;
    const st_decl decls[] = {
        {"b", ST_BF16, 1, {5}},
        {"h", ST_F16, 1, {5}},
        {"big", ST_F16, 2, {BIG / 8, 8}},
    };
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, decls, 3, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, v, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, v, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, big, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);

    st_file *f = st_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_ptr_null(st_metadata(f, "anything"));
    const st_tensor *b = st_find(f, "b"), *h = st_find(f, "h");
    ck_assert_int_eq(b->dtype, ST_BF16);
    ck_assert_uint_eq(b->nbytes, 10);
    const unsigned char *raw = b->data;         /* little endian on disk */
    ck_assert(raw[0] == 0x80 && raw[1] == 0x3f);
    float out[5];
    ck_assert_msg(st_read_f32(b, 0, 5, out, &e) == 0, "%s", e.msg);
    ck_assert(out[0] == 1.0f && out[1] == 1.0f && out[2] == -3.0f);   /* 1+2^-8 ties down */
    ck_assert(isnan(out[3]));
    ck_assert(out[4] == 70144.0f);              /* nearest bf16 of 70000 */
    ck_assert_msg(st_read_f32(h, 0, 5, out, &e) == 0, "%s", e.msg);
    ck_assert(out[0] == 1.0f && out[1] == 1.0f + 0x1p-8f && out[2] == -3.0f);  /* exact in f16 */
    ck_assert(isnan(out[3]));
    ck_assert(isinf(out[4]));                   /* over the f16 range */

    const st_tensor *bt = st_find(f, "big");
    ck_assert_uint_eq(bt->nelem, BIG);
    float *back = malloc(BIG * sizeof *back);
    ck_assert_ptr_nonnull(back);
    ck_assert_msg(st_read_f32(bt, 0, BIG, back, &e) == 0, "%s", e.msg);
    for (int i = 0; i < BIG; i++)
        ck_assert_msg(bits_of(back[i]) == bits_of(st_f16_to_f32(st_f32_to_f16(big[i]))),
                      "element %d", i);
    ck_assert_msg(st_read_f32(bt, 12345, 3, out, &e) == 0, "%s", e.msg);
    ck_assert(bits_of(out[2]) == bits_of(back[12347]));
    free(back);
    free(big);
    st_close(f);
}
END_TEST

START_TEST(test_raw_and_read_errors)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "raw.safetensors");
    const int64_t ids[3] = {7, -1, 1LL << 40};
    const float x[2] = {0.25f, 0.5f};
    const st_decl decls[] = {{"ids", ST_I64, 1, {3}}, {"x", ST_F32, 1, {2}}};
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, decls, 2, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_int_eq(st_writer_put_f32(w, x, &e), -1);   /* I64 is not float */
    ck_assert_msg(strstr(e.msg, "'ids'") != NULL, "%s", e.msg);
    ck_assert_int_eq(st_writer_put_raw(w, ids, 16, &e), -1);   /* wrong size */
    expect_msg(&e, path, "needs 24 bytes, got 16");
    ck_assert_msg(st_writer_put_raw(w, ids, sizeof ids, &e) == 0, "%s", e.msg);
    ck_assert_msg(st_writer_put_f32(w, x, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(st_writer_put_f32(w, x, &e), -1);   /* nothing left */
    expect_msg(&e, path, "already written");
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);

    st_file *f = st_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    const st_tensor *t = st_find(f, "ids");
    ck_assert_int_eq(t->dtype, ST_I64);
    ck_assert_int_eq(memcmp(t->data, ids, sizeof ids), 0);
    float out[4];
    ck_assert_int_eq(st_read_f32(t, 0, 1, out, &e), -1);
    expect_msg(&e, path, "tensor 'ids' has dtype I64");

    const st_tensor *xt = st_find(f, "x");
    ck_assert_int_eq(st_read_f32(xt, 2, 0, out, &e), 0);          /* empty range at the end */
    ck_assert_int_eq(st_read_f32(xt, 1, 2, out, &e), -1);
    expect_msg(&e, path, "tensor 'x'");
    ck_assert_int_eq(st_read_f32(xt, 3, 0, out, &e), -1);
    ck_assert_int_eq(st_read_f32(xt, UINT64_MAX, 2, out, &e), -1);  /* no wrap-around */
    ck_assert_int_eq(st_read_f32(xt, 1, UINT64_MAX, out, &e), -1);
    ck_assert_int_eq(st_read_f32(xt, 1, 1, out, &e), 0);
    ck_assert(out[0] == 0.5f);
    st_close(f);
}
END_TEST

/* Tensor data at odd addresses must read correctly (memcpy, no float *). */
START_TEST(test_unaligned_data)
{
    const char *header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1,9]},"
                         "\"b\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[9,11]},"
                         "\"c\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[11,13]}}";
    size_t len;
    unsigned char *buf = st_bytes(header, 13, &len);
    unsigned char *data = buf + 8 + strlen(header);
    const float a[2] = {1.5f, -7.25f};
    memcpy(data + 1, a, sizeof a);
    data[9] = 0x40, data[10] = 0xc0;            /* bf16 -3 */
    data[11] = 0x00, data[12] = 0x3c;           /* f16 1 */
    char path[PATH_MAX];
    path_in(path, sizeof path, "odd.safetensors");
    write_file(path, buf, len);
    kv_err e = {{0}};
    for (int pass = 0; pass < 2; pass++) {
        st_file *f = pass ? st_open(path, &e) : st_parse(buf, len, "mem", &e);
        ck_assert_msg(f != NULL, "%s", e.msg);
        float out[2];
        const st_tensor *t = st_find(f, "a");
        ck_assert((uintptr_t)t->data % 4 != 0);    /* the point of the test */
        ck_assert_msg(st_read_f32(t, 0, 2, out, &e) == 0, "%s", e.msg);
        ck_assert(out[0] == 1.5f && out[1] == -7.25f);
        ck_assert_msg(st_read_f32(t, 1, 1, out, &e) == 0, "%s", e.msg);
        ck_assert(out[0] == -7.25f);
        ck_assert_msg(st_read_f32(st_find(f, "b"), 0, 1, out, &e) == 0, "%s", e.msg);
        ck_assert(out[0] == -3.0f);
        ck_assert_msg(st_read_f32(st_find(f, "c"), 0, 1, out, &e) == 0, "%s", e.msg);
        ck_assert(out[0] == 1.0f);
        st_close(f);
    }
    free(buf);
}
END_TEST

START_TEST(test_many_tensors_find)
{
    enum { N = 3000 };
    char path[PATH_MAX];
    path_in(path, sizeof path, "many.safetensors");
    st_decl *decls = calloc(N, sizeof *decls);
    char (*names)[32] = calloc(N, sizeof *names);
    ck_assert(decls && names);
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "model.layers.%d.w", (i * 7919) % N);
        decls[i] = (st_decl){names[i], ST_BF16, 1, {1}};
    }
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, decls, N, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    for (int i = 0; i < N; i++) {
        float v = (float)i;
        ck_assert_msg(st_writer_put_f32(w, &v, &e) == 0, "%s", e.msg);
    }
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);
    st_file *f = st_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_uint_eq(st_count(f), N);
    for (int i = 0; i < N; i++) {
        ck_assert_str_eq(st_at(f, (size_t)i)->name, names[i]);   /* header order */
        ck_assert_ptr_eq(st_find(f, names[i]), st_at(f, (size_t)i));
    }
    ck_assert_ptr_null(st_find(f, "model.layers.3000.w"));
    st_close(f);
    free(names);
    free(decls);
}
END_TEST

START_TEST(test_null_arguments)
{
    st_close(NULL);
    st_writer_abort(NULL);
    ck_assert_uint_eq(st_count(NULL), 0);
    ck_assert_ptr_null(st_at(NULL, 0));
    ck_assert_ptr_null(st_find(NULL, "a"));
    ck_assert_ptr_null(st_metadata(NULL, "a"));
    kv_err e = {{0}};
    ck_assert_int_eq(st_read_f32(NULL, 0, 0, NULL, &e), -1);
    ck_assert_int_eq(st_writer_finish(NULL, &e), -1);
    ck_assert_str_eq(st_dtype_name(ST_BF16), "BF16");
    ck_assert_str_eq(st_dtype_name(ST_F8_E5M2), "F8_E5M2");
    ck_assert_uint_eq(st_dtype_size(ST_U64), 8);
    ck_assert_uint_eq(st_dtype_size(ST_BOOL), 1);
    ck_assert_uint_eq(st_dtype_size(ST_DTYPE_COUNT), 0);
}
END_TEST

/* ------------------------------------------------------------ bad input */

typedef struct {
    const char *header;          /* JSON header text; NULL: use raw */
    size_t data_len;             /* zero bytes after the header */
    const char *raw;             /* the whole file, when header is NULL */
    size_t raw_len;
    const char *needle;          /* the problem, as the message must name it */
} bad_case;

#define T(body) "{\"model.layers.3.k\":{" body "}}"
#define F32_4 "\"dtype\":\"F32\",\"shape\":[4]"

static const bad_case bad_cases[] = {
    {NULL, 0, "", 0, "empty file"},
    {NULL, 0, "\x02\0\0", 3, "3 bytes, too short for the 8-byte header length"},
    {NULL, 0, "\xe8\x03\0\0\0\0\0\0{}", 10, "header length 1000 runs past the end of the file"},
    {NULL, 0, "\xff\xff\xff\xff\xff\xff\xff\xff{}", 10, "header length 18446744073709551615"},
    {NULL, 0, "\x04\0\0\0\0\0\0\0{\0} ", 12, "NUL byte at offset 9"},
    {"{\"a\": ", 0, NULL, 0, "header is not valid JSON"},
    {"{} x", 0, NULL, 0, "header is not valid JSON"},
    {"[1, 2]", 0, NULL, 0, "header is a JSON array, not an object"},
    {"\"text\"", 0, NULL, 0, "header is a JSON string, not an object"},
    {"{\"model.layers.3.k\": 5}", 0, NULL, 0, "tensor 'model.layers.3.k' is a JSON integer, not an object"},
    {T("\"shape\":[1],\"data_offsets\":[0,4]"), 4, NULL, 0, "tensor 'model.layers.3.k' has no dtype"},
    {T("\"dtype\":\"F32\",\"data_offsets\":[0,4]"), 4, NULL, 0, "tensor 'model.layers.3.k' has no shape"},
    {T(F32_4), 16, NULL, 0, "tensor 'model.layers.3.k' has no data_offsets"},
    {T("\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]"), 4, NULL, 0, "tensor 'model.layers.3.k' has unknown dtype 'F33'"},
    {T("\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]"), 4, NULL, 0, "dtype is a JSON integer, not a string"},
    {T("\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,0]"), 0, NULL, 0, "tensor 'model.layers.3.k': shape[1] is -1, negative"},
    {T("\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]"), 4, NULL, 0, "shape[0] is a JSON real, not an integer"},
    {T("\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]"), 16, NULL, 0, "shape is a JSON integer, not an array"},
    {T("\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]"), 4, NULL, 0, "shape has 9 dimensions, more than 8"},
    {T("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,0]"), 0, NULL, 0, "tensor 'model.layers.3.k': shape product overflows 64 bits"},
    {T("\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]"), 0, NULL, 0, "byte size (4611686018427387904 elements of F64) overflows 64 bits"},
    {T(F32_4 ",\"data_offsets\":[16,0]"), 16, NULL, 0, "tensor 'model.layers.3.k': data_offsets [16, 0] are reversed"},
    {T(F32_4 ",\"data_offsets\":[-16,0]"), 16, NULL, 0, "data_offsets[0] is -16, negative"},
    {T(F32_4 ",\"data_offsets\":[0]"), 16, NULL, 0, "data_offsets is not a [begin, end] pair"},
    {T(F32_4 ",\"data_offsets\":[4000,4016]"), 16, NULL, 0, "tensor 'model.layers.3.k' ends at byte 4016 but the data area has 16 bytes"},
    {T(F32_4 ",\"data_offsets\":[0,12]"), 16, NULL, 0, "tensor 'model.layers.3.k' has 12 bytes (data_offsets [0, 12]) but shape [4] of F32 needs 16"},
    {T(F32_4 ",\"data_offsets\":[0,16]"), 10, NULL, 0, "tensor 'model.layers.3.k' ends at byte 16 but the data area has 10 bytes"},
    {"{\"two\\nlines\":{\"dtype\":\"X\",\"shape\":[],\"data_offsets\":[0,0]}}", 0, NULL, 0, "tensor 'two?lines' has unknown dtype 'X'"},
    {"{\"__metadata__\":{\"ok\":\"x\",\"k\":1}}", 0, NULL, 0, "__metadata__ key 'k' has a JSON integer value, not a string"},
    {"{\"__metadata__\":[\"x\"]}", 0, NULL, 0, "__metadata__ is a JSON array, not an object"},
    {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
     "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, NULL, 0, "duplicate object key"},
    /* Tensors sharing bytes: in part, wholly, one inside a longer one. */
    {"{\"b\":{" F32_4 ",\"data_offsets\":[8,24]},\"a\":{" F32_4 ",\"data_offsets\":[0,16]}}", 24,
     NULL, 0, "tensors 'a' (data_offsets [0, 16]) and 'b' (data_offsets [8, 24]) overlap"},
    {"{\"y\":{" F32_4 ",\"data_offsets\":[0,16]},\"x\":{" F32_4 ",\"data_offsets\":[0,16]}}", 16,
     NULL, 0, "tensors 'x' (data_offsets [0, 16]) and 'y' (data_offsets [0, 16]) overlap"},
    {"{\"long\":{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,32]},"
     "\"mid\":{" F32_4 ",\"data_offsets\":[32,48]},"
     "\"in\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[20,24]}}", 48,
     NULL, 0, "tensors 'long' (data_offsets [0, 32]) and 'in' (data_offsets [20, 24]) overlap"},
};

#undef T
#undef F32_4

START_TEST(test_bad_input)
{
    const bad_case *c = &bad_cases[_i];
    size_t len = c->raw_len;
    unsigned char *buf = c->header ? st_bytes(c->header, c->data_len, &len) : NULL;
    const void *bytes = buf ? (const void *)buf : (const void *)c->raw;
    char path[PATH_MAX];
    path_in(path, sizeof path, "bad.safetensors");
    write_file(path, bytes, len);
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open(path, &e));
    expect_msg(&e, path, c->needle);

    /* The same bytes from memory, in an exactly sized buffer. */
    unsigned char *copy = malloc(len ? len : 1);
    ck_assert_ptr_nonnull(copy);
    memcpy(copy, bytes, len);
    ck_assert_ptr_null(st_parse(copy, len, "mem.safetensors", &e));
    expect_msg(&e, "mem.safetensors", c->needle);
    free(copy);
    free(buf);
}
END_TEST

/* A length over the limit is refused before anything is parsed (sparse file). */
START_TEST(test_header_over_limit)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "huge.safetensors");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ck_assert_int_ge(fd, 0);
    const unsigned char len_bytes[8] = {0x01, 0xe1, 0xf5, 0x05, 0, 0, 0, 0};  /* 100000001 */
    ck_assert_int_eq(write(fd, len_bytes, 8), 8);
    ck_assert_int_eq(ftruncate(fd, 8 + 100000001 + 8), 0);
    close(fd);
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open(path, &e));
    expect_msg(&e, path, "header length 100000001 is over the 100000000-byte limit");
}
END_TEST

START_TEST(test_open_not_a_file)
{
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open(tmp_dir, &e));
    expect_msg(&e, tmp_dir, "not a regular file");
    char path[PATH_MAX];
    path_in(path, sizeof path, "missing.safetensors");
    ck_assert_ptr_null(st_open(path, &e));
    expect_msg(&e, path, strerror(ENOENT));
}
END_TEST

/* ------------------------------------------------------------ sharded folders */

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

/* Writes tmp_dir/file with F32 [2] tensors named in `names` (NULL-ended). */
static void write_shard(const char *file, const char *const *names, const char *const *meta)
{
    st_decl decls[8];
    size_t n = 0;
    for (; names[n]; n++)
        decls[n] = (st_decl){names[n], ST_F32, 1, {2}};
    char path[PATH_MAX];
    path_in(path, sizeof path, file);
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, decls, n, meta, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    for (size_t i = 0; i < n; i++) {
        const float v[2] = {(float)i, (float)strlen(names[i])};
        ck_assert_msg(st_writer_put_f32(w, v, &e) == 0, "%s", e.msg);
    }
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);
}

static void write_index(const char *weight_map)
{
    char path[PATH_MAX], text[4096];
    path_in(path, sizeof path, "model.safetensors.index.json");
    snprintf(text, sizeof text, "{\"metadata\":{\"total_size\":40},\"weight_map\":{%s}}",
             weight_map);
    write_text(path, text);
}

/* Two shards: a, b in the first, c in the second (plus `extra2` there). */
static void write_two_shards(const char *extra2)
{
    const char *const meta[] = {"format", "pt", NULL};
    const char *const names1[] = {"a", "b", NULL};
    const char *const names2[] = {"c", extra2, NULL};
    write_shard(SHARD1, names1, meta);
    write_shard(SHARD2, names2, NULL);
}

static void index_path(char *buf, size_t size)
{
    path_in(buf, size, "model.safetensors.index.json");
}

START_TEST(test_sharded_ok)
{
    write_two_shards(NULL);
    write_index("\"c\":\"" SHARD2 "\",\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\"");
    kv_err e = {{0}};
    st_file *f = st_open_dir(tmp_dir, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_uint_eq(st_count(f), 3);
    ck_assert_str_eq(st_at(f, 0)->name, "a");   /* shard order, then header order */
    ck_assert_str_eq(st_at(f, 1)->name, "b");
    ck_assert_str_eq(st_at(f, 2)->name, "c");
    char s2[PATH_MAX];
    path_in(s2, sizeof s2, SHARD2);
    ck_assert_str_eq(st_find(f, "c")->file, s2);
    ck_assert_str_eq(st_metadata(f, "format"), "pt");
    float out[2];
    ck_assert_msg(st_read_f32(st_find(f, "b"), 0, 2, out, &e) == 0, "%s", e.msg);
    ck_assert(out[0] == 1.0f && out[1] == 1.0f);
    st_close(f);
}
END_TEST

START_TEST(test_dir_single_file)
{
    const char *const names[] = {"w", NULL};
    write_shard("model.safetensors", names, NULL);
    kv_err e = {{0}};
    st_file *f = st_open_dir(tmp_dir, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_uint_eq(st_count(f), 1);
    ck_assert_ptr_nonnull(st_find(f, "w"));
    st_close(f);
}
END_TEST

START_TEST(test_dir_empty)
{
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
    expect_msg(&e, tmp_dir, "no model.safetensors or model.safetensors.index.json");
    char missing[PATH_MAX];
    path_in(missing, sizeof missing, "nope");
    ck_assert_ptr_null(st_open_dir(missing, &e));
    expect_msg(&e, missing, strerror(ENOENT));
}
END_TEST

START_TEST(test_index_missing_shard)
{
    write_two_shards(NULL);
    write_index("\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD2 "\","
                "\"d\":\"model-00003-of-00003.safetensors\"");
    char s3[PATH_MAX];
    path_in(s3, sizeof s3, "model-00003-of-00003.safetensors");
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
    expect_msg(&e, s3, strerror(ENOENT));
}
END_TEST

START_TEST(test_index_path_traversal)
{
    static const char *const bad[] = {"sub/x.safetensors", "../x.safetensors", "..", ""};
    write_two_shards(NULL);
    char ipath[PATH_MAX];
    index_path(ipath, sizeof ipath);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char map[512], needle[128];
        snprintf(map, sizeof map, "\"a\":\"" SHARD1 "\",\"z\":\"%s\"", bad[i]);
        write_index(map);
        snprintf(needle, sizeof needle, "names shard '%s'", bad[i]);
        kv_err e = {{0}};
        ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
        expect_msg(&e, ipath, needle);
        ck_assert(strstr(e.msg, "'z'") != NULL);
    }
}
END_TEST

START_TEST(test_index_tensor_missing_from_shard)
{
    write_two_shards(NULL);
    write_index("\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD1 "\"");
    char ipath[PATH_MAX], s1[PATH_MAX], needle[PATH_MAX + 64];
    index_path(ipath, sizeof ipath);
    path_in(s1, sizeof s1, SHARD1);
    snprintf(needle, sizeof needle, "tensor 'c' is mapped to %s but missing from it", s1);
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
    expect_msg(&e, ipath, needle);
}
END_TEST

START_TEST(test_index_tensor_in_two_shards)
{
    write_two_shards("a");
    write_index("\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD2 "\"");
    char ipath[PATH_MAX], s1[PATH_MAX], s2[PATH_MAX], needle[2 * PATH_MAX + 64];
    index_path(ipath, sizeof ipath);
    path_in(s1, sizeof s1, SHARD1);
    path_in(s2, sizeof s2, SHARD2);
    snprintf(needle, sizeof needle, "tensor 'a' is in both %s and %s", s1, s2);
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
    expect_msg(&e, ipath, needle);
}
END_TEST

START_TEST(test_index_tensor_not_listed)
{
    write_two_shards("d");
    write_index("\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD2 "\"");
    char ipath[PATH_MAX];
    index_path(ipath, sizeof ipath);
    kv_err e = {{0}};
    ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
    expect_msg(&e, ipath, "tensor 'd' in");
    ck_assert(strstr(e.msg, "is not in the weight_map") != NULL);
}
END_TEST

START_TEST(test_index_malformed)
{
    static const struct { const char *text, *needle; } cases[] = {
        {"{\"weight_map\": ", "not valid JSON"},
        {"[]", "top level is a JSON array, not an object"},
        {"{\"metadata\":{}}", "no weight_map"},
        {"{\"weight_map\":[]}", "weight_map is a JSON array, not an object"},
        {"{\"weight_map\":{}}", "weight_map is empty"},
        {"{\"weight_map\":{\"a\":3}}", "weight_map entry 'a' is a JSON integer, not a file name"},
    };
    char ipath[PATH_MAX];
    index_path(ipath, sizeof ipath);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_text(ipath, cases[i].text);
        kv_err e = {{0}};
        ck_assert_ptr_null(st_open_dir(tmp_dir, &e));
        expect_msg(&e, ipath, cases[i].needle);
    }
}
END_TEST

/* ------------------------------------------------------------ writer errors */

START_TEST(test_writer_unwritable)
{
    static const char *const paths[] = {
        "/nonexistent-kvdiff-dir/out.safetensors",
        "/proc/kvdiff-test.safetensors",
    };
    const st_decl d = {"x", ST_F32, 1, {1}};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        kv_err e = {{0}};
        ck_assert_ptr_null(st_writer_open(paths[i], &d, 1, NULL, &e));
        expect_msg(&e, paths[i], "cannot write");
    }
    kv_err e = {{0}};
    ck_assert_ptr_null(st_writer_open(paths[0], &d, 1, NULL, &e));
    ck_assert(strstr(e.msg, strerror(ENOENT)) != NULL);
}
END_TEST

START_TEST(test_writer_bad_decls)
{
    static const struct { st_decl d[2]; size_t n; const char *needle; } cases[] = {
        {{{"x", ST_F32, 1, {2}}, {"x", ST_F16, 1, {2}}}, 2, "tensor 'x' is declared twice"},
        {{{"x", ST_F32, 2, {2, -3}}}, 1, "tensor 'x': shape[1] is -3, negative"},
        {{{"x", ST_F32, 9, {1}}}, 1, "tensor 'x' has 9 dimensions"},
        {{{"x", ST_F32, -1, {1}}}, 1, "tensor 'x' has -1 dimensions"},
        {{{"x", ST_DTYPE_COUNT, 1, {1}}}, 1, "tensor 'x' has an invalid dtype"},
        {{{"__metadata__", ST_F32, 1, {1}}}, 1, "'__metadata__' is not a tensor name"},
        {{{NULL, ST_F32, 1, {1}}}, 1, "a declared tensor has no name"},
        {{{"x", ST_F32, 3, {1LL << 32, 1LL << 32, 16}}}, 1, "shape product overflows"},
        {{{"x", ST_F64, 1, {1LL << 59}}, {"y", ST_F64, 1, {1LL << 59}}}, 2, "tensor 'y': data area over 2^63 bytes"},
        {{{"bad\xff", ST_F32, 1, {1}}}, 1, "not UTF-8"},
    };
    char path[PATH_MAX];
    path_in(path, sizeof path, "out.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kv_err e = {{0}};
        ck_assert_ptr_null(st_writer_open(path, cases[i].d, cases[i].n, NULL, &e));
        expect_msg(&e, path, cases[i].needle);
    }
    const st_decl ok = {"x", ST_F32, 1, {1}};
    const char *const meta[] = {"k", "bad\xff", NULL};
    kv_err e = {{0}};
    ck_assert_ptr_null(st_writer_open(path, &ok, 1, meta, &e));
    expect_msg(&e, path, "metadata 'k'");
    ck_assert_int_eq(count_entries(tmp_dir), 0);
}
END_TEST

START_TEST(test_writer_incomplete_and_abort)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "out.safetensors");
    const st_decl d[2] = {{"x", ST_F32, 1, {1}}, {"y", ST_F32, 1, {1}}};
    const float v = 1.0f;
    kv_err e = {{0}};
    st_writer *w = st_writer_open(path, d, 2, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_int_eq(count_entries(tmp_dir), 1);              /* the temp file */
    ck_assert_int_eq(st_writer_put_f32(w, &v, &e), 0);
    ck_assert_int_eq(st_writer_finish(w, &e), -1);
    expect_msg(&e, path, "only 1 of 2 declared tensors were written (next: 'y')");
    ck_assert_int_eq(count_entries(tmp_dir), 0);

    w = st_writer_open(path, d, 2, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    st_writer_abort(w);
    ck_assert_int_eq(count_entries(tmp_dir), 0);
}
END_TEST

/* The final name is taken by a folder: refused at the open; taken while
 * the file is written: refused at the rename, and the temp file goes. */
START_TEST(test_writer_rename_fails)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "taken");
    ck_assert_int_eq(mkdir(path, 0755), 0);
    const st_decl d = {"x", ST_F32, 1, {1}};
    const float v = 1.0f;
    kv_err e = {{0}};
    ck_assert_ptr_null(st_writer_open(path, &d, 1, NULL, &e));
    expect_msg(&e, path, "is a directory, not a regular file");
    ck_assert_int_eq(count_entries(tmp_dir), 1);              /* only the folder */
    ck_assert_int_eq(rmdir(path), 0);
    st_writer *w = st_writer_open(path, &d, 1, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_int_eq(mkdir(path, 0755), 0);
    ck_assert_int_eq(st_writer_put_f32(w, &v, &e), 0);
    ck_assert_int_eq(st_writer_finish(w, &e), -1);
    expect_msg(&e, path, "is a directory, not a regular file");
    ck_assert_int_eq(count_entries(tmp_dir), 1);              /* only the folder */
}
END_TEST

/* In a child limited to 4 KiB files (SIGXFSZ ignored, so write fails with
 * EFBIG): exit codes name the step that went wrong. */
static int file_size_child(const char *path)
{
    signal(SIGXFSZ, SIG_IGN);
    const struct rlimit limit = {4096, 4096};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0)
        return 10;
    enum { N = 100000 };
    const st_decl d[2] = {{"big", ST_F16, 1, {N}}, {"big32", ST_F32, 1, {N}}};
    float *v = calloc(N, sizeof *v);
    if (!v)
        return 11;
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        kv_err e = {{0}};
        st_writer *w = st_writer_open(path, &d[i], 1, NULL, &e);
        if (!w)
            rc = 12;
        else if (st_writer_put_f32(w, v, &e) == 0)
            rc = 13;
        else if (!strstr(e.msg, path) || !strstr(e.msg, "file size limit reached (ulimit -f)"))
            rc = 14;
        else if (st_writer_finish(w, &e) == 0)
            rc = 15;
        else if (access(path, F_OK) == 0)
            rc = 16;
        if (w && rc == 13)
            st_writer_abort(w);
    }
    free(v);
    return rc;
}

START_TEST(test_writer_file_size_limit)
{
    char path[PATH_MAX];
    path_in(path, sizeof path, "big.safetensors");
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(file_size_child(path));
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status), "child died (status %d)", status);
    ck_assert_msg(WEXITSTATUS(status) == 0, "child failed at step %d", WEXITSTATUS(status));
    ck_assert_int_eq(count_entries(tmp_dir), 0);              /* no final, no temp */
}
END_TEST

/* ------------------------------------------------------------ suite */

static TCase *tcase_in_dir(const char *name)
{
    TCase *tc = tcase_create(name);
    tcase_add_unchecked_fixture(tc, base_setup, base_teardown);
    tcase_add_checked_fixture(tc, dir_setup, dir_teardown);
    return tc;
}

Suite *safetensors_suite(void)
{
    Suite *s = suite_create("safetensors");

    TCase *tc = tcase_create("convert");
    tcase_add_test(tc, test_bf16_known_patterns);
    tcase_add_test(tc, test_bf16_sweep);
    tcase_add_test(tc, test_f16_known_patterns);
    tcase_add_test(tc, test_f16_sweep);
    tcase_add_test(tc, test_null_arguments);
    suite_add_tcase(s, tc);

    tc = tcase_in_dir("roundtrip");
    tcase_add_test(tc, test_roundtrip_f32);
    tcase_add_test(tc, test_roundtrip_bf16_f16);
    tcase_add_test(tc, test_raw_and_read_errors);
    tcase_add_test(tc, test_unaligned_data);
    tcase_add_test(tc, test_many_tensors_find);
    suite_add_tcase(s, tc);

    tc = tcase_in_dir("bad_input");
    tcase_add_loop_test(tc, test_bad_input, 0, (int)(sizeof bad_cases / sizeof bad_cases[0]));
    tcase_add_test(tc, test_header_over_limit);
    tcase_add_test(tc, test_open_not_a_file);
    suite_add_tcase(s, tc);

    tc = tcase_in_dir("sharded");
    tcase_add_test(tc, test_sharded_ok);
    tcase_add_test(tc, test_dir_single_file);
    tcase_add_test(tc, test_dir_empty);
    tcase_add_test(tc, test_index_missing_shard);
    tcase_add_test(tc, test_index_path_traversal);
    tcase_add_test(tc, test_index_tensor_missing_from_shard);
    tcase_add_test(tc, test_index_tensor_in_two_shards);
    tcase_add_test(tc, test_index_tensor_not_listed);
    tcase_add_test(tc, test_index_malformed);
    suite_add_tcase(s, tc);

    tc = tcase_in_dir("writer_errors");
    tcase_add_test(tc, test_writer_unwritable);
    tcase_add_test(tc, test_writer_bad_decls);
    tcase_add_test(tc, test_writer_incomplete_and_abort);
    tcase_add_test(tc, test_writer_rename_fails);
    tcase_add_test(tc, test_writer_file_size_limit);
    suite_add_tcase(s, tc);
    return s;
}
