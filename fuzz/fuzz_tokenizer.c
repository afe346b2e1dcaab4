// fuzz-sources: model/err.c model/tokenizer.c
/* fuzz_tokenizer.c — libFuzzer target for tok_parse: any input either fails
 * with a message or yields a vocabulary every id of which (and some that are
 * out of range) decodes into a small buffer, terminated. */
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
    tok_free(t);
    return 0;
}
