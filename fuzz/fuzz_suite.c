// fuzz-sources: model/err.c model/tokens.c chunked/injections.c model/observer.c suites/suite.c model/config.c model/outfile.c model/infile.c model/tokenizer.c model/bpe.c model/families/*.c model/kernels.c model/kernels_x86.c model/pool.c
// fuzz-pkgs: inih libxxhash libpcre2-8 libutf8proc
/* fuzz_suite.c — the suite file parser on arbitrary bytes: it must never
 * crash, refuse with one line "t.suite:LINE: ..." or nothing but a file
 * name, and on success hand back only complete cases (a name, a model, an
 * argv ending in NULL, an expectation it can describe and parse again). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "suites/suite.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    suite s;
    kv_err e;
    memset(&e, 0, sizeof e);
    if (suite_parse((const char *)data, size, "fuzz/t.suite", &s, &e) < 0) {
        if (strncmp(e.msg, "fuzz/t.suite:", 13) || strchr(e.msg, '\n') || s.n_cases || s.cases)
            abort();
        return 0;
    }
    if (s.n_cases < 1)
        abort();
    for (int i = 0; i < s.n_cases; i++) {
        const suite_case *c = &s.cases[i];
        if (!c->name || !*c->name || !c->model || !*c->model || !c->expect_text || c->line < 1)
            abort();
        if (!c->a || c->a[c->na] || !c->b || c->b[c->nb])
            abort();
        /* kvdiff's own sides are option/value pairs; outside sides are a
         * command or a path */
        if ((c->ka == SUITE_SIDE_KVDIFF && c->na % 2) || (c->kb == SUITE_SIDE_KVDIFF && c->nb % 2))
            abort();
        char buf[256];
        suite_expect x;
        suite_expect_describe(&c->expect, buf, sizeof buf);
        if (suite_parse_expect(buf, &x, &e) < 0 || x.kind != c->expect.kind)
            abort();
    }
    suite_free(&s);
    return 0;
}
