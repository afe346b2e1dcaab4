// fuzz-sources: model/err.c model/infile.c model/outfile.c model/tokenizer.c model/bpe.c
// fuzz-pkgs: libxxhash libpcre2-8 libutf8proc
/* fuzz_tokenizer.c — libFuzzer target for tok_parse and tok_encode: any
 * input either fails with a message or yields a vocabulary every id of
 * which (and some that are out of range) decodes into a small buffer,
 * terminated; and encoding text (fixed strings, and the input itself, valid
 * UTF-8 or not) either fails with a message naming the file or gives
 * non-negative ids. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_decode(const kv_tokenizer *t, int id)
{
    char buf[16];
    buf[0] = '\0';
    tok_decode(t, id, buf, sizeof buf);
    if (strnlen(buf, sizeof buf) == sizeof buf)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_tokenizer *t = NULL;
    kv_err e;
    e.msg[0] = '\0';
    if (tok_parse((const char *)data, size, "fuzz.json", &t, &e) != 0) {
        if (t != NULL || strncmp(e.msg, "fuzz.json: ", 11) != 0) {
            fprintf(stderr, "bad failure: %s\n", e.msg);
            abort();
        }
        return 0;
    }
    int n = tok_count(t);
    for (int id = -1; id <= n && id < 4096; id++)
        check_decode(t, id);
    check_decode(t, n);
    static const char *const texts[] = { "", "hello world", " a  b\t\n\n", "12345 x",
                                         "\xC3\xA9\xF0\xA0\x80\x80 \xE2\x96\x81<s>" };
    for (size_t k = 0; k <= sizeof texts / sizeof *texts; k++) {
        const char *text = k < sizeof texts / sizeof *texts ? texts[k] : (const char *)data;
        size_t len = k < sizeof texts / sizeof *texts ? strlen(text) : (size < 512 ? size : 512);
        int32_t *ids = NULL;
        int count = 0;
        if (tok_encode(t, text, len, 1, &ids, &count, &e) != 0) {
            if (ids != NULL || strncmp(e.msg, "fuzz.json: ", 11) != 0) {
                fprintf(stderr, "bad encode failure: %s\n", e.msg);
                abort();
            }
            continue;
        }
        for (int i = 0; i < count; i++)
            if (ids[i] < 0)
                abort();
        free(ids);
    }
    tok_free(t);
    return 0;
}
