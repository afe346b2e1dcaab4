/* check_crossrt.c — cross-runtime verdicts, with the real llama.cpp: a
 * correct tiny-gemma3 GGUF under legitimate settings (f32 KV; f16 KV with
 * ubatch 7, flash attention off and on) is drift, exit 0; GGUF files
 * whose metadata carries a bug (sliding window 4 where the config says 12,
 * the local RoPE base set to the global one), written by patching one
 * value of an exported GGUF, are found at their exact first (position,
 * layer, stage), exit 1, with no false alarm before. --exact still
 * compares bit for bit. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "testutil.h"

static char out[1 << 16];

/* Runs KVDIFF_LLAMA_BIN (or ./kvdiff-llama) with args; output into buf. */
static int run_rec(const char *args, char *buf, size_t n)
{
    const char *bin = getenv("KVDIFF_LLAMA_BIN");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", bin ? bin : "./kvdiff-llama", args);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t len = fread(buf, 1, n - 1, p);
    buf[len] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* ------------------------------------------------------------------ */
/* One GGUF metadata value rewritten in place                           */

enum { G_U32 = 4, G_F32 = 6, G_STR = 8, G_ARR = 9 };

static size_t gguf_scalar_size(uint32_t t)
{
    static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < sizeof sz / sizeof sz[0] ? sz[t] : 0;
}

/* Offset just past the value of type t at off, or 0 when malformed. */
static size_t gguf_skip(const unsigned char *b, size_t n, size_t off, uint32_t t)
{
    if (t == G_STR) {
        uint64_t len;
        if (off + 8 > n)
            return 0;
        memcpy(&len, b + off, 8);
        return off + 8 + len <= n ? off + 8 + (size_t)len : 0;
    }
    if (t == G_ARR) {
        uint32_t at;
        uint64_t cnt;
        if (off + 12 > n)
            return 0;
        memcpy(&at, b + off, 4);
        memcpy(&cnt, b + off + 4, 8);
        off += 12;
        for (uint64_t i = 0; i < cnt && off; i++)
            off = gguf_skip(b, n, off, at);
        return off;
    }
    size_t sz = gguf_scalar_size(t);
    return sz && off + sz <= n ? off + sz : 0;
}

/* Copies the GGUF `in` to `out` with the value of `key` (a u32 or f32)
 * replaced by v. Returns 0, -1 when the key is absent or the file bad. */
static int gguf_patch(const char *in, const char *outp, const char *key, double v)
{
    FILE *f = fopen(in, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n);
    int rc = b && fread(b, 1, (size_t)n, f) == (size_t)n ? 0 : -1;
    fclose(f);
    uint64_t nkv = 0;
    if (rc == 0 && n >= 24 && !memcmp(b, "GGUF", 4))
        memcpy(&nkv, b + 16, 8);
    size_t off = 24;
    bool done = false;
    for (uint64_t i = 0; rc == 0 && i < nkv && off && !done; i++) {
        uint64_t klen;
        uint32_t t;
        memcpy(&klen, b + off, 8);
        const bool hit = klen == strlen(key) && !memcmp(b + off + 8, key, klen);
        off += 8 + (size_t)klen;
        memcpy(&t, b + off, 4);
        off += 4;
        if (hit && t == G_U32) {
            uint32_t u = (uint32_t)v;
            memcpy(b + off, &u, 4);
            done = true;
        } else if (hit && t == G_F32) {
            float x = (float)v;
            memcpy(b + off, &x, 4);
            done = true;
        }
        off = gguf_skip(b, (size_t)n, off, t);
    }
    if (rc == 0 && done) {
        FILE *o = fopen(outp, "wb");
        rc = o && fwrite(b, 1, (size_t)n, o) == (size_t)n ? 0 : -1;
        if (o && fclose(o) != 0)
            rc = -1;
    }
    free(b);
    return rc == 0 && done ? 0 : -1;
}

/* ------------------------------------------------------------------ */
/* Runs                                                                 */

/* tiny-gemma3 (window 12) exported as GGUF, and the reference on a
 * 100-token prompt past the window. */
static void setup_model(const char *dir)
{
    char args[1024];
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 100 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

/* Records gguf with llama.cpp (the config from the HF folder) and
 * compares it with the reference; returns the exit code, JSON in *j. */
static int record_compare(const char *dir, const char *gguf, const char *rec_opts,
                          const char *cmp_opts, json_t **j)
{
    char args[2048];
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 2 --ignore-eos "
             "--threads 1 %s --dump %s/llama.h5", gguf, dir, dir, rec_opts, dir);
    ck_assert_msg(run_rec(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json %s", dir, dir, cmp_opts);
    int rc = test_run_cli(args, out, sizeof out);
    json_error_t je;
    *j = json_loads(out, 0, &je);
    ck_assert_msg(*j, "%s\n%s", je.text, out);
    return rc;
}

static json_t *xrt_of(json_t *j)
{
    return json_object_get(json_object_get(j, "mode"), "cross_runtime");
}

/* A correct runtime under a legitimate setting: drift, exit 0. */
static void expect_drift(const char *dir, const char *rec_opts)
{
    char gguf[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    json_t *j;
    int rc = record_compare(dir, gguf, rec_opts, "", &j);
    ck_assert_msg(rc == 0, "%s: exit %d\n%.3000s", rec_opts, rc, out);
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "within_tolerance");
    json_t *x = xrt_of(j);
    ck_assert_msg(json_is_object(x), "%s", out);
    ck_assert_str_eq(json_string_value(json_object_get(x, "model")), "drift-step");
    ck_assert(json_is_false(json_object_get(x, "step")));
    ck_assert(json_is_null(json_object_get(j, "first_divergence")));
    /* Every stage has its figures; drift stays below its threshold. */
    json_t *st = json_object_get(x, "stages"), *s;
    size_t i;
    ck_assert_int_gt(json_array_size(st), 60);
    json_array_foreach(st, i, s) {
        const double err = json_number_value(json_object_get(s, "error"));
        const double thr = json_number_value(json_object_get(s, "threshold"));
        ck_assert_msg(thr > 0 && err <= thr, "%s: stage %zu error %g threshold %g", rec_opts, i,
                      err, thr);
    }
    json_decref(j);
}

/* A bug: the step at exactly (pos, layer, stage), exit 1. */
static void expect_step(const char *dir, const char *gguf, const char *rec_opts, long pos,
                        int layer, const char *stage, const char *stage2)
{
    json_t *j;
    int rc = record_compare(dir, gguf, rec_opts, "", &j);
    ck_assert_msg(rc == 1, "%s: exit %d\n%.3000s", rec_opts, rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_is_object(d), "%s", out);
    const char *st = json_string_value(json_object_get(d, "stage"));
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == pos &&
                  json_integer_value(json_object_get(d, "layer")) == layer &&
                  (!strcmp(st, stage) || (stage2 && !strcmp(st, stage2))),
                  "%s %s: expected position %ld layer %d %s\n%.3000s", gguf, rec_opts, pos, layer,
                  stage, out);
    json_t *x = xrt_of(j);
    ck_assert(json_is_true(json_object_get(x, "step")));
    ck_assert(json_number_value(json_object_get(x, "step_error")) >
              json_number_value(json_object_get(x, "step_threshold")));
    json_decref(j);
}

START_TEST(xrt_llama_drift)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    expect_drift(dir, "--cache-type f32");
    expect_drift(dir, "--cache-type f16 --ubatch 7");
    expect_drift(dir, "--cache-type f16 --ubatch 7 --flash-attn on");
    /* --exact: bit for bit, as before (llama.cpp's rounding differs). */
    char gguf[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    json_t *j;
    ck_assert_int_eq(record_compare(dir, gguf, "--cache-type f32", "--exact", &j), 1);
    ck_assert(json_is_null(xrt_of(j)));
    ck_assert(json_is_true(json_object_get(json_object_get(j, "mode"), "exact")));
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

START_TEST(xrt_llama_window)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/w4.gguf", dir);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma3.attention.sliding_window", 4), 0);
    /* Window 4 first drops a key at position 4, on layer 0 (sliding). */
    expect_step(dir, bad, "--cache-type f32", 4, 0, "attn_out", NULL);
    expect_step(dir, bad, "--cache-type f16 --ubatch 7", 4, 0, "attn_out", NULL);
    test_rmtree(dir);
}
END_TEST

START_TEST(xrt_llama_rope_base)
{
    char dir[64], gguf[512], bad[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    setup_model(dir);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/rope.gguf", dir);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma3.rope.freq_base_swa", 1e6), 0);
    /* Position 0 is not rotated: the first rotation differs at 1. */
    expect_step(dir, bad, "--cache-type f32", 1, 0, "q", "k");
    expect_step(dir, bad, "--cache-type f16 --ubatch 7", 1, 0, "q", "k");
    test_rmtree(dir);
}
END_TEST

/* --cross-runtime with a tolerance is refused in one line. */
START_TEST(xrt_cli_conflict)
{
    int rc = test_run_cli("compare a.h5 b.h5 --cross-runtime --atol 1e-3", out, sizeof out);
    ck_assert_int_eq(rc, 2);
    ck_assert_msg(strstr(out, "sets its own thresholds"), "%s", out);
    rc = test_run_cli("compare a.h5 b.h5 --exact --cross-runtime", out, sizeof out);
    ck_assert_int_eq(rc, 2);
    ck_assert_msg(strstr(out, "sets its own thresholds"), "%s", out);
}
END_TEST

Suite *crossrt_suite(void)
{
    Suite *s = suite_create("crossrt");
    TCase *tc = tcase_create("llama");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, xrt_llama_drift);
    tcase_add_test(tc, xrt_llama_window);
    tcase_add_test(tc, xrt_llama_rope_base);
    suite_add_tcase(s, tc);
    TCase *cli = tcase_create("cli");
    tcase_add_test(cli, xrt_cli_conflict);
    suite_add_tcase(s, cli);
    return s;
}
