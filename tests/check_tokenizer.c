/* check_tokenizer.c — tests of model/tokenizer: byte-level BPE and
 * SentencePiece-style vocabularies decode to the right bytes, special
 * tokens to their content, unknown ids to "<unk:ID>"; a folder without
 * tokenizer.json has no vocabulary; malformed files are refused naming the
 * file. Each test writes its tokenizer.json into its own temporary folder. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/tokenizer.h"

/* ---- helpers ------------------------------------------------------------ */

typedef struct {
    char dir[64];
    char path[128];
} tmp_folder;

static void folder_make(tmp_folder *t)
{
    snprintf(t->dir, sizeof t->dir, "/tmp/kvdiff-tok-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(t->dir));
    snprintf(t->path, sizeof t->path, "%s/tokenizer.json", t->dir);
}

static void folder_remove(const tmp_folder *t)
{
    unlink(t->path);
    rmdir(t->dir);
}

/* Writes text as <tmp>/tokenizer.json and loads it. */
static kv_tokenizer *load_text(const char *text)
{
    tmp_folder t;
    kv_tokenizer *tok = NULL;
    kv_err e = { "" };
    folder_make(&t);
    FILE *f = fopen(t.path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
    int rc = tok_load(t.dir, &tok, &e);
    folder_remove(&t);
    ck_assert_msg(rc == 0, "%s", e.msg);
    ck_assert_ptr_nonnull(tok);
    return tok;
}

/* The text of a sequence of ids, decoded into a fresh buffer. */
static const char *decode_ids(const kv_tokenizer *tok, const int *ids, int n)
{
    static char buf[256];
    buf[0] = '\0';
    for (int i = 0; i < n; i++)
        tok_decode(tok, ids[i], buf, sizeof buf);
    return buf;
}

static const char *decode1(const kv_tokenizer *tok, int id)
{
    return decode_ids(tok, &id, 1);
}

/* ---- byte-level BPE (GPT-2, Llama 3, Qwen2) ----------------------------- */

/* "Ġ" is U+0120 (a space), "Ċ" U+010A (a newline), "Ã©" the two bytes of
 * "é", "Ā" U+0100 (byte 0). */
static const char BYTE_LEVEL[] =
    "{\"version\": \"1.0\", \"added_tokens\": ["
    "  {\"id\": 6, \"content\": \"<|endoftext|>\", \"single_word\": false, \"lstrip\": false,"
    "   \"rstrip\": false, \"normalized\": false, \"special\": true}],"
    " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false},"
    " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true},"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"byte_fallback\": false,"
    "   \"vocab\": {\"Hello\": 0, \"\\u0120world\": 1, \"\\u010a\": 2, \"\\u00c3\\u00a9\": 3,"
    "              \"\\u00c3\": 4, \"\\u0100\": 5, \"\\u00a9\": 8},"
    "   \"merges\": [\"H e\"]}}";

START_TEST(byte_level_tokens)
{
    kv_tokenizer *tok = load_text(BYTE_LEVEL);
    ck_assert_int_eq(tok_count(tok), 9);
    ck_assert_str_eq(decode1(tok, 0), "Hello");
    ck_assert_str_eq(decode1(tok, 1), " world");
    ck_assert_str_eq(decode1(tok, 2), "\n");
    ck_assert_str_eq(decode1(tok, 3), "\xC3\xA9");
    ck_assert_str_eq(decode1(tok, 5), "<0x00>");
    ck_assert_str_eq(decode1(tok, 6), "<|endoftext|>");
    /* half a character, completed by the next token */
    int seq[] = { 0, 1, 4, 8, 2, 6 };
    ck_assert_str_eq(decode_ids(tok, seq, 6), "Hello world\xC3\xA9\n<|endoftext|>");
    tok_free(tok);
}
END_TEST

/* ---- SentencePiece style (Gemma, Llama 2) ------------------------------- */

static const char SENTENCEPIECE[] =
    "{\"added_tokens\": ["
    "  {\"id\": 0, \"content\": \"<pad>\", \"special\": true},"
    "  {\"id\": 9, \"content\": \"<start_of_turn>\", \"special\": true},"
    "  {\"id\": 10, \"content\": \"\\u2581keep\", \"special\": false}],"
    " \"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"},"
    "   \"content\": \"\\u2581\"},"
    " \"decoder\": {\"type\": \"Sequence\", \"decoders\": ["
    "   {\"type\": \"Replace\", \"pattern\": {\"String\": \"\\u2581\"}, \"content\": \" \"},"
    "   {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}]},"
    " \"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {"
    "   \"<pad>\": 0, \"<unk>\": 1, \"<0x41>\": 2, \"\\u2581hello\": 3, \"<0xE2>\": 4,"
    "   \"<0x82>\": 5, \"<0xAC>\": 6, \"a\\u2581b\": 7, \"<0x00>\": 8}, \"merges\": []}}";

START_TEST(sentencepiece_tokens)
{
    kv_tokenizer *tok = load_text(SENTENCEPIECE);
    ck_assert_int_eq(tok_count(tok), 11);
    ck_assert_str_eq(decode1(tok, 3), " hello");
    ck_assert_str_eq(decode1(tok, 2), "A");
    ck_assert_str_eq(decode1(tok, 7), "a b");
    ck_assert_str_eq(decode1(tok, 8), "<0x00>");
    ck_assert_str_eq(decode1(tok, 9), "<start_of_turn>");
    ck_assert_str_eq(decode1(tok, 0), "<pad>");
    ck_assert_str_eq(decode1(tok, 10), " keep");   /* not special: through the decoder */
    int euro[] = { 3, 4, 5, 6 };
    ck_assert_str_eq(decode_ids(tok, euro, 4), " hello\xE2\x82\xAC");
    tok_free(tok);
}
END_TEST

/* Without a decoder: Metaspace pre-tokenizer spelling is not assumed, byte
 * tokens follow the model's byte_fallback flag. */
START_TEST(plain_and_metaspace)
{
    kv_tokenizer *tok = load_text(
        "{\"decoder\": null, \"model\": {\"type\": \"BPE\", \"byte_fallback\": true,"
        " \"vocab\": {\"x\\u2581y\": 0, \"<0x41>\": 1}}}");
    ck_assert_str_eq(decode1(tok, 0), "x\xE2\x96\x81y");
    ck_assert_str_eq(decode1(tok, 1), "A");
    tok_free(tok);
    tok = load_text("{\"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\"},"
                    " \"model\": {\"type\": \"Unigram\", \"vocab\": [[\"<unk>\", 0.0],"
                    " [\"\\u2581the\", -1.5], [\"<0x41>\", -2.0]]}}");
    ck_assert_int_eq(tok_count(tok), 3);
    ck_assert_str_eq(decode1(tok, 1), " the");
    ck_assert_str_eq(decode1(tok, 2), "<0x41>");   /* no ByteFallback decoder */
    tok_free(tok);
}
END_TEST

/* ---- unknown ids, truncation, no vocabulary ----------------------------- */

START_TEST(unknown_ids)
{
    kv_tokenizer *tok = load_text(BYTE_LEVEL);
    ck_assert_str_eq(decode1(tok, 7), "<unk:7>");     /* a gap */
    ck_assert_str_eq(decode1(tok, 9), "<unk:9>");     /* past the end */
    ck_assert_str_eq(decode1(tok, -1), "<unk:-1>");
    ck_assert_str_eq(decode1(NULL, 42), "<unk:42>");
    ck_assert_int_eq(tok_count(NULL), 0);
    tok_free(tok);
    tok_free(NULL);
}
END_TEST

START_TEST(truncation)
{
    kv_tokenizer *tok = load_text(BYTE_LEVEL);
    char buf[8] = "ab";
    ck_assert_uint_eq(tok_decode(tok, 0, buf, sizeof buf), 5);
    ck_assert_str_eq(buf, "abHello");
    ck_assert_uint_eq(tok_decode(tok, 1, buf, sizeof buf), 6);
    ck_assert_str_eq(buf, "abHello");                /* full: nothing more fits */
    char tiny[4] = "";
    ck_assert_uint_eq(tok_decode(tok, 6, tiny, sizeof tiny), 13);
    ck_assert_str_eq(tiny, "<|e");
    char unterminated[3] = { 'x', 'y', 'z' };
    tok_decode(tok, 0, unterminated, sizeof unterminated);
    ck_assert_int_eq(unterminated[2], '\0');
    ck_assert_uint_eq(tok_decode(tok, 0, NULL, 0), 5);
    tok_free(tok);
}
END_TEST

START_TEST(absent_file_is_no_vocabulary)
{
    tmp_folder t;
    kv_tokenizer *tok = (kv_tokenizer *)&t;  /* must be overwritten with NULL */
    kv_err e;
    folder_make(&t);
    ck_assert_int_eq(tok_load(t.dir, &tok, &e), 0);
    ck_assert_ptr_null(tok);
    folder_remove(&t);
}
END_TEST

/* ---- malformed files ---------------------------------------------------- */

static const struct {
    const char *json;
    const char *expect;
} BAD_TOKENIZERS[] = {
    { "{not json", "not valid JSON" },
    { "[]", "model is missing" },
    { "{\"model\": {\"type\": \"BPE\"}}", "model.vocab is missing" },
    { "{\"model\": {\"vocab\": {\"a\": \"1\"}}}", "model.vocab[\"a\"] is not an id" },
    { "{\"model\": {\"vocab\": {\"a\": -3}}}", "model.vocab[\"a\"] is not an id" },
    { "{\"model\": {\"vocab\": {\"a\": 99999999999}}}", "model.vocab[\"a\"] is not an id" },
    { "{\"model\": {\"vocab\": [[1, 0.0]]}}", "model.vocab[0] is not [\"piece\", score]" },
    { "{\"model\": {\"vocab\": {}}, \"added_tokens\": {}}", "added_tokens is not an array" },
    { "{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"content\": \"x\"}]}",
      "added_tokens[0] needs an id" },
    { "{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"id\": 1, \"content\": 5}]}",
      "added_tokens[0] needs an id" },
    { "{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"id\": 1, \"content\": \"x\","
      " \"special\": \"yes\"}]}", "added_tokens[0] needs an id" },
    /* lax before: a type or an unknown token of any JSON kind */
    { "{\"model\": {\"type\": 7, \"vocab\": {\"a\": 0}, \"merges\": []}}",
      "model.type is not a string" },
    { "{\"model\": {\"type\": \"BPE\", \"unk_token\": 0, \"vocab\": {\"a\": 0},"
      " \"merges\": []}}", "model.unk_token is not a string (or null)" },
};

START_TEST(malformed_is_refused)
{
    tmp_folder t;
    kv_tokenizer *tok = NULL;
    kv_err e = { "" };
    char want[256];
    folder_make(&t);
    FILE *f = fopen(t.path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(BAD_TOKENIZERS[_i].json, f);
    ck_assert_int_eq(fclose(f), 0);
    snprintf(want, sizeof want, "%s: %s", t.path, BAD_TOKENIZERS[_i].expect);
    ck_assert_int_eq(tok_load(t.dir, &tok, &e), -1);
    ck_assert_ptr_null(tok);
    ck_assert_msg(strstr(e.msg, want) != NULL, "case %d: '%s' lacks '%s'", _i, e.msg, want);
    folder_remove(&t);
}
END_TEST

START_TEST(parse_from_memory)
{
    kv_tokenizer *tok = NULL;
    kv_err e;
    size_t n = strlen(SENTENCEPIECE);
    char *copy = malloc(n);  /* not NUL-terminated */
    ck_assert_ptr_nonnull(copy);
    memcpy(copy, SENTENCEPIECE, n);
    ck_assert_msg(tok_parse(copy, n, "mem", &tok, &e) == 0, "%s", e.msg);
    free(copy);
    ck_assert_str_eq(decode1(tok, 3), " hello");
    tok_free(tok);
    ck_assert_int_eq(tok_parse("{}", 2, "mem", &tok, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "mem: model"));
    ck_assert_ptr_null(tok);
}
END_TEST

Suite *tokenizer_suite(void)
{
    Suite *s = suite_create("tokenizer");
    TCase *t = tcase_create("decode");
    tcase_add_test(t, byte_level_tokens);
    tcase_add_test(t, sentencepiece_tokens);
    tcase_add_test(t, plain_and_metaspace);
    tcase_add_test(t, unknown_ids);
    tcase_add_test(t, truncation);
    tcase_add_test(t, absent_file_is_no_vocabulary);
    tcase_add_test(t, parse_from_memory);
    tcase_add_loop_test(t, malformed_is_refused, 0,
                        (int)(sizeof BAD_TOKENIZERS / sizeof BAD_TOKENIZERS[0]));
    suite_add_tcase(s, t);
    return s;
}
