// fuzz-sources: model/err.c model/infile.c model/outfile.c model/safetensors.c
// fuzz-pkgs: jansson
/* fuzz_safetensors.c — libFuzzer target for the safetensors reader: parses
 * arbitrary bytes as a whole file; when the header is accepted, reads every
 * F32/F16/BF16 tensor in small pieces (the sanitizers catch any read
 * outside the buffer), looks every tensor up by name, and checks that
 * out-of-range reads are refused. A refusal is one line naming the file. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { PIECE = 7 };              /* odd, so pieces straddle every alignment */

static void read_tensor(const st_tensor *t)
{
    float out[PIECE];
    kv_err e;
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16) {
        if (st_read_f32(t, 0, 0, out, &e) == 0)
            abort();
        return;
    }
    for (uint64_t i = 0; i < t->nelem; i += PIECE) {
        uint64_t n = t->nelem - i < PIECE ? t->nelem - i : PIECE;
        if (st_read_f32(t, i, n, out, &e) != 0)
            abort();
    }
    if (st_read_f32(t, t->nelem, 1, out, &e) == 0 ||
        st_read_f32(t, 1, UINT64_MAX, out, &e) == 0)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_err e;
    st_file *f = st_parse(data, size, "fuzz.safetensors", &e);
    if (!f) {
        if (strncmp(e.msg, "fuzz.safetensors: ", 18) != 0 || strchr(e.msg, '\n'))
            abort();
        return 0;
    }
    for (size_t i = 0; i < st_count(f); i++) {
        const st_tensor *t = st_at(f, i);
        if (st_find(f, t->name) != t || t->nbytes != t->nelem * st_dtype_size(t->dtype))
            abort();
        read_tensor(t);
    }
    (void)st_metadata(f, "format");
    st_close(f);
    return 0;
}
