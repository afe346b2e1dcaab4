// fuzz-sources: model/err.c model/infile.c model/config.c model/outfile.c model/families/*.c model/kernels.c model/kernels_x86.c model/pool.c
/* fuzz_config.c — libFuzzer target for config_parse_json: any input either
 * fails with a message or yields a config that config_validate accepts,
 * whose description and config.json text can be produced. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kv_config c;
    kv_err e;
    char line[256];
    e.msg[0] = '\0';
    if (config_parse_json((const char *)data, size, "fuzz.json", &c, &e) != 0) {
        if (strncmp(e.msg, "fuzz.json: ", 11) != 0) {
            fprintf(stderr, "error without the file name: %s\n", e.msg);
            abort();
        }
        return 0;
    }
    if (config_validate(&c, &e) != 0) {
        fprintf(stderr, "parsed but invalid: %s\n", e.msg);
        abort();
    }
    config_describe(&c, line, sizeof line);
    for (int i = 0; i < c.n_layers; i++)
        if (config_layer_window(&c, i) < 0 || config_layer_theta(&c, i) <= 0)
            abort();
    return 0;
}
