// fuzz-sources: model/err.c model/tokens.c model/infile.c model/outfile.c
/* fuzz_tokens.c — token-id list parser on arbitrary bytes: must never
 * crash, and on success every id is inside the vocabulary. */
#include <stdint.h>
#include <stdlib.h>

#include "model/tokens.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int32_t *ids = NULL;
    int n = 0;
    kv_err e;
    if (tokens_parse((const char *)data, size, "fuzz", 1000, &ids, &n, &e) == 0) {
        if (n < 1)
            abort();
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= 1000)
                abort();
        free(ids);
    }
    return 0;
}
