/* check_kvowner_prefill.c — KV sharing wired otherwise, named from the
 * prefill rows alone. Gemma 4 with shared_kv_layers 8 where
 * the config says 4 runs layers 4..7 on layers 2 and 3's caches; a pair
 * of recordings holding decode steps was named kv_owner, a prefill-only
 * pair (`--max-new 0`: no differing generated token, so no position cut)
 * was "unclassified", the check of every position having read none (and
 * a reference prefill-only against a test with decode steps failed at
 * the decode positions the reference holds no keys for). Two
 * ways: llama.cpp on the GGUF with the count patched, and the reference's
 * recording edited (layers 4..7's attention recomputed over their wrong
 * owners' k, v), each prefill-only and with decode steps. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "gguf_patch.h"
#include "plants.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* The reference's recording edited                                     */

/* Layers 4..7 read the caches of the last sliding (2) and full (3)
 * layers before them, as llama.cpp wires 8 shared layers of 12. */
static bool owners_of_eight(void *ctx, const kv_config *cfg, int layer, int64_t q, cmp_hyp *h)
{
    (void)ctx;
    (void)cfg;
    (void)q;
    (void)h;
    return layer >= 4 && layer < 8;
}

static void planted_pair(int nnew, bool counts)
{
    kv_model m;
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset("tiny-gemma4", 0, &mo, &m, &e) == 0, "%s", e.msg);
    cmp_memrec *ref = plant_record(&m, 30, nnew, 5, NULL, "{\"engine\":\"reference\"}", true,
                                   &e);
    cmp_memrec *test = plant_record(&m, 30, nnew, 5, NULL, "{\"engine\":\"outside\"}", counts,
                                    &e);
    ck_assert_msg(ref && test, "%s", e.msg);
    kv_config wired = m.cfg;
    for (int l = 4; l < 8; l++)
        wired.kv_owner[l] = (int16_t)(wired.layer_type[l] == ATTN_SLIDING ? 2 : 3);
    ck_assert_int_eq(wired.layer_type[4], ATTN_SLIDING);
    ck_assert_msg(cmp_memrec_plant_attention(test, &wired, owners_of_eight, NULL, &e) == 0,
                  "%s", e.msg);
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(test, &sb);
    cmp_result r;
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, &r, &e) == 0, "%s", e.msg);
    char *t = cmp_render_text(&r, 0);
    ck_assert_msg(r.first.found && r.first.layer == 4 && r.first.pos == 0 &&
                      r.diag.kind == CMP_DIAG_KV_OWNER && r.diag.basis == CMP_BASIS_RECOMPUTED &&
                      strstr(r.diag.summary, "layer 4 read layer 2's KV cache"),
                  "max-new %d, %s: %s\n%s", nnew, counts ? "counts" : "attn_out alone",
                  cmp_diag_name(r.diag.kind), t);
    /* every prefill position of layer 4 checked, not none */
    ck_assert_msg(strstr(r.diag.evidence, nnew ? "at 30 positions" : "at 30 positions") ||
                      strstr(r.diag.evidence, "positions of layer 4"), "%s", t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(test);
    model_free(&m);
}

START_TEST(test_planted_owner_prefill_only)
{
    planted_pair(0, _i == 0);
}
END_TEST

START_TEST(test_planted_owner_with_decode)
{
    planted_pair(4, true);
}
END_TEST

/* ------------------------------------------------------------------ */
/* llama.cpp                                                            */

/* The GGUF with shared_kv_layers 8, recorded by llama.cpp with max_new
 * new tokens (the reference too), compared: kv_owner at layer 4. */
static void llama_pair(const char *dir, int max_new)
{
    char args[2048];
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 40 --seed 3 --max-new %d "
             "--ignore-eos --dump %s/ref%d.h5", dir, max_new, dir, max_new);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "%s/bad.gguf --prompt-from %s/ref%d.h5 --max-new %d "
             "--ignore-eos --cache-type f32 --threads 1 --dump %s/bad%d.h5", dir, dir, max_new,
             max_new, dir, max_new);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref%d.h5 %s/bad%d.h5", dir, max_new, dir, max_new);
    test_run_cli(args, out, sizeof out);
    ck_assert_msg(strstr(out, "position 0, layer 4") &&
                      strstr(out, "layer 4 read layer 2's KV cache where the config has it "
                                  "compute its own") &&
                      strstr(out, "shares the last 8 layers' caches, the reference's 4") &&
                      strstr(out, "at 40 positions of layer 4"),
                  "max-new %d: %s", max_new, out);
}

START_TEST(test_llama_owner_prefill_only)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/hf --gguf %s/m.gguf", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    char gguf[512], bad[512];
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    ck_assert_int_eq(gguf_patch(gguf, bad, "gemma4.attention.shared_kv_layers", 8), 0);
    llama_pair(dir, 0);
    llama_pair(dir, 2);
    /* one side prefill-only, the other with decode steps: either way */
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "compare %s/ref%d.h5 %s/bad%d.h5", dir, i ? 2 : 0, dir,
                 i ? 0 : 2);
        test_run_cli(args, out, sizeof out);
        ck_assert_msg(strstr(out, "layer 4 read layer 2's KV cache where the config has it "
                                  "compute its own") &&
                          strstr(out, "at 40 positions of layer 4"), "%s: %s", args, out);
    }
    test_rmtree(dir);
}
END_TEST

Suite *kvowner_prefill_suite(void)
{
    Suite *s = suite_create("kvowner_prefill");
    TCase *tc = tcase_create("kvowner_prefill");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, test_planted_owner_prefill_only, 0, 2);
    tcase_add_test(tc, test_planted_owner_with_decode);
    tcase_add_test(tc, test_llama_owner_prefill_only);
    suite_add_tcase(s, tc);
    return s;
}
