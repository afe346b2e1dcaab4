/* check_doc_claims.c — what the help texts and docs claim, checked
 * against what the tools do (help and docs that were wrong):
 * the `run --help` example of a text prompt names a folder that has a
 * tokenizer; README.md's list of what `gen --from` exports is what it
 * exports, KV sharing included; `suite --help` says what --keep keeps;
 * docs/python-recorder.md opens with the one call a transformers user
 * wants. */
#include <check.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#define OUT_MAX (1 << 16)

/* The source tree (README.md): the working folder of `make test`, else the
 * one above the binary's build folder. */
static void find_root(char *root, size_t n)
{
    char path[PATH_MAX + 16];
    if (getcwd(root, n)) {
        snprintf(path, sizeof path, "%s/README.md", root);
        if (access(path, R_OK) == 0)
            return;
    }
    const char *bin = getenv("KVDIFF_BIN");
    ck_assert_msg(bin && strrchr(bin, '/'), "KVDIFF_BIN is not set");
    snprintf(root, n, "%.*s/..", (int)(strrchr(bin, '/') - bin), bin);
    snprintf(path, sizeof path, "%s/README.md", root);
    ck_assert_msg(access(path, R_OK) == 0, "README.md not found");
}

/* root/rel, whole, NUL-terminated (malloc'd). */
static char *read_doc(const char *rel)
{
    char root[PATH_MAX], path[PATH_MAX + 64];
    find_root(root, sizeof root);
    snprintf(path, sizeof path, "%s/%s", root, rel);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s: cannot read", rel);
    ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    ck_assert(n >= 0);
    rewind(f);
    char *text = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(text);
    ck_assert_int_eq(fread(text, 1, (size_t)n, f), (size_t)n);
    text[n] = 0;
    fclose(f);
    return text;
}

/* The word after `flag ` in line (up to a blank), without a final '/'. */
static void word_after(const char *line, const char *flag, char *dst, size_t n)
{
    dst[0] = 0;
    const char *p = strstr(line, flag);
    if (!p)
        return;
    p += strlen(flag);
    while (*p == ' ')
        p++;
    size_t len = strcspn(p, " \n\\");
    if (len > 0 && p[len - 1] == '/')
        len--;
    snprintf(dst, n, "%.*s", (int)len, p);
}

/* Does text hold a line `kvdiff gen ... -o NAME` (or --out) writing name? */
static bool gen_writes(const char *text, const char *name)
{
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        size_t len = strcspn(l, "\n");
        char line[1024], out[256];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), l);
        if (!strstr(line, "kvdiff gen "))
            continue;
        word_after(line, " -o ", out, sizeof out);
        if (!out[0])
            word_after(line, " --out ", out, sizeof out);
        if (out[0] && !strcmp(out, name))
            return true;
    }
    return false;
}

START_TEST(test_run_help_text_prompt_example_has_a_tokenizer)
{
    static char help[OUT_MAX], gen_help[OUT_MAX], out[OUT_MAX];
    ck_assert_int_eq(test_run_cli("run --help", help, sizeof help), 0);
    ck_assert_int_eq(test_run_cli("gen --help", gen_help, sizeof gen_help), 0);
    const char *ex = strstr(help, "Examples:");
    ck_assert_ptr_nonnull(ex);
    const char *line = strstr(ex, "--prompt-text");
    ck_assert_msg(line != NULL, "run --help has no --prompt-text example");
    while (line > ex && line[-1] != '\n')
        line--;
    char model[256];
    word_after(line, "--model", model, sizeof model);
    ck_assert_msg(model[0], "run --help's --prompt-text example gives no --model");
    /* what makes the rule: a folder gen writes has no tokenizer, and a
     * text prompt on it is refused */
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/g3", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    char path[128];
    snprintf(path, sizeof path, "%s/g3/tokenizer.json", dir);
    ck_assert_int_ne(access(path, F_OK), 0);
    snprintf(args, sizeof args, "run --model %s/g3 --prompt-text 'The capital of France is'", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "tokenizer") != NULL, "%s", out);
    test_rmtree(dir);
    /* so the example's folder is not one the help or the README has gen write */
    char *readme = read_doc("README.md");
    ck_assert_msg(!gen_writes(gen_help, model) && !gen_writes(readme, model),
                  "run --help encodes text with --model %s, a folder `kvdiff gen` writes "
                  "(no tokenizer.json):\n%.*s", model, (int)strcspn(line, "\n"), line);
    free(readme);
}
END_TEST

/* The sentence of text (". " to ". ") holding needle; "" when none. */
static void sentence_with(const char *text, const char *needle, char *dst, size_t n)
{
    dst[0] = 0;
    const char *hit = strstr(text, needle);
    if (!hit)
        return;
    const char *start = hit;
    while (start > text && !(start[-1] == ' ' && start - 1 > text && start[-2] == '.'))
        start--;
    const char *end = strstr(hit, ". ");
    size_t len = end ? (size_t)(end - start) : strlen(start);
    snprintf(dst, n, "%.*s", (int)len, start);
}

START_TEST(test_readme_gen_from_list_is_what_exports)
{
    static const char *presets[] = {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3",
                                    "tiny-gemma3-kvshared", "tiny-gemma4"};
    char *readme = read_doc("README.md");
    const char *para = strstr(readme, "`kvdiff gen --gguf FILE` writes them");
    ck_assert_msg(para != NULL, "README.md: the paragraph on gen --gguf / --from is gone");
    const char *end = strstr(para, "\n\n");
    size_t plen = end ? (size_t)(end - para) : strlen(para);
    char text[4096];
    snprintf(text, sizeof text, "%.*s", (int)plen, para);
    for (char *p = text; *p; p++)
        if (*p == '\n')
            *p = ' ';
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    for (size_t i = 0; i < sizeof presets / sizeof *presets; i++) {
        static char out[OUT_MAX];
        char args[512], cfg_path[256], arch[64], quoted[80], sentence[2048];
        snprintf(args, sizeof args, "gen --preset %s -o %s/%s", presets[i], dir, presets[i]);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
        snprintf(cfg_path, sizeof cfg_path, "%s/%s/config.json", dir, presets[i]);
        FILE *f = fopen(cfg_path, "r");
        ck_assert_ptr_nonnull(f);
        static char cfg[1 << 16];
        cfg[fread(cfg, 1, sizeof cfg - 1, f)] = 0;
        fclose(f);
        const char *mt = strstr(cfg, "\"model_type\"");
        ck_assert_ptr_nonnull(mt);
        mt = strchr(mt + 12, '"');
        ck_assert_ptr_nonnull(mt);
        size_t alen = strcspn(mt + 1, "\"_");
        snprintf(arch, sizeof arch, "%.*s", (int)alen, mt + 1);
        const char *shared = strstr(cfg, "\"num_kv_shared_layers\"");
        bool shares = shared && atoi(strchr(shared + 22, ':') + 1) > 0;
        shares = shares || strstr(presets[i], "kvshared") != NULL;
        snprintf(args, sizeof args, "gen --from %s/%s --gguf %s/%s.gguf", dir, presets[i], dir,
                 presets[i]);
        int rc = test_run_cli(args, out, sizeof out);
        ck_assert_msg(rc == 0 || rc == 2, "%s: gen --from exited %d: %s", presets[i], rc, out);
        if (rc == 0)
            ck_assert_msg(strstr(text, arch) != NULL, "README.md: gen --from exports %s (%s), "
                          "the README's list does not name it:\n%s", arch, presets[i], text);
        if (!shares)
            continue;
        snprintf(quoted, sizeof quoted, "`%s`", presets[i]);
        sentence_with(text, quoted, sentence, sizeof sentence);
        ck_assert_msg(sentence[0], "README.md: gen --from %s %s a KV-shared model; the "
                      "paragraph does not say which (name %s):\n%s", rc == 0 ? "exports" :
                      "refuses", presets[i], quoted, text);
        if (rc == 0)
            ck_assert_msg(strstr(sentence, "export") && !strstr(sentence, "refused"),
                          "README.md: %s (KV-shared) exports, the README says:\n%s",
                          presets[i], sentence);
        else
            ck_assert_msg(strstr(sentence, "refused") != NULL, "README.md: %s (KV-shared) "
                          "is refused (%s), the README says:\n%s", presets[i], out, sentence);
    }
    test_rmtree(dir);
    free(readme);
}
END_TEST

START_TEST(test_suite_help_keep_says_what_stays)
{
    static char help[OUT_MAX], out[OUT_MAX];
    ck_assert_int_eq(test_run_cli("suite --help", help, sizeof help), 0);
    ck_assert_msg(strstr(help, "every case's files") == NULL, "suite --help:\n%s", help);
    const char *ex = strstr(help, "Examples:");
    ck_assert_ptr_nonnull(ex);
    const char *keep = strstr(ex, "--keep");
    ck_assert_ptr_nonnull(keep);
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)strcspn(keep, "\n"), keep);
    ck_assert_msg(strstr(line, "failed") != NULL, "suite --help's --keep example says what "
                  "stays without saying only failed cases' files do: %s", line);
    ck_assert_msg(strstr(help, "a passing case's folder is deleted") != NULL, "%s", help);
    /* and that is what it does */
    char dir[64], path[256], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/s.suite", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("[defaults]\nmodel = tiny-llama\nprompt = random:12:1\nmax_new = 2\n"
          "a = --engine reference\nexpect = identical\n\n"
          "[passes]\nb = --engine chunked --chunk 5\n\n"
          "[fails]\nb = --engine chunked --chunk 5 --inject isolated-chunks\n", f);
    ck_assert_int_eq(fclose(f), 0);
    snprintf(args, sizeof args, "suite %s/s.suite --keep %s/work", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    struct stat st;
    snprintf(path, sizeof path, "%s/work/passes", dir);
    ck_assert_msg(stat(path, &st) != 0, "a passing case's folder stayed:\n%s", out);
    snprintf(path, sizeof path, "%s/work/fails/a.h5", dir);
    ck_assert_msg(stat(path, &st) == 0, "a failed case's files are gone:\n%s", out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_python_recorder_doc_opens_with_record)
{
    char *doc = read_doc("docs/python-recorder.md");
    const char *block = strstr(doc, "```python");
    ck_assert_ptr_nonnull(block);
    const char *block_end = strstr(block + 9, "```");
    ck_assert_ptr_nonnull(block_end);
    const char *call = strstr(block, "record(model");
    ck_assert_msg(call && call < block_end, "docs/python-recorder.md: its first example is "
                  "not the one call, record(model, ...):\n%.*s", (int)(block_end - block),
                  block);
    const char *low = strstr(doc, "Recorder(");
    ck_assert_msg(!low || call < low, "docs/python-recorder.md shows Recorder( before "
                  "record(model, ...)");
    free(doc);
}
END_TEST

Suite *doc_claims_suite(void)
{
    Suite *s = suite_create("doc_claims");
    TCase *tc = tcase_create("claims");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_run_help_text_prompt_example_has_a_tokenizer);
    tcase_add_test(tc, test_readme_gen_from_list_is_what_exports);
    tcase_add_test(tc, test_suite_help_keep_says_what_stays);
    tcase_add_test(tc, test_python_recorder_doc_opens_with_record);
    suite_add_tcase(s, tc);
    return s;
}
