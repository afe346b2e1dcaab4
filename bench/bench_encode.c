/* bench_encode.c — how long encoding 100 KB of text takes with the real
 * Gemma 3, Qwen3 and Llama 3 tokenizers (scripts/fetch-tokenizers puts
 * them in build/tokdata, or $KVDIFF_TOKDATA). The text is the test
 * sentences repeated: prose, code, CJK, emoji, digit runs. Gemma 3 has no
 * pre-tokenizer split, so all of it is one word for the merges: the case
 * a quadratic merge loop would not survive. Prints one line per family. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "model/tokenizer.h"

int main(void)
{
    const char *data = getenv("KVDIFF_TOKDATA");
    data = data && *data ? data : "build/tokdata";
    FILE *f = fopen("tests/data/tokenizer/sentences.jsonl", "r");
    if (!f) {
        fprintf(stderr, "bench_encode: run from the repository root\n");
        return 2;
    }
    /* The JSON lines as they are (quotes and escapes included): text enough. */
    static char src[1 << 16];
    size_t n_src = fread(src, 1, sizeof src, f);
    fclose(f);
    size_t len = 100 * 1000;
    char *text = malloc(len);
    for (size_t i = 0; i < len; i++)
        text[i] = src[i % n_src];
    while (len > 0 && ((unsigned char)text[len - 1] & 0xC0) == 0x80)
        len--;                         /* do not end inside a character */
    if (len > 0 && (unsigned char)text[len - 1] >= 0xC0)
        len--;
    static const char *const families[] = { "gemma3", "qwen3", "llama3" };
    for (int k = 0; k < 3; k++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", data, families[k]);
        kv_tokenizer *t = NULL;
        kv_err e = {{0}};
        double t0 = now_s();
        if (tok_load(dir, &t, &e) < 0 || !t) {
            fprintf(stderr, "bench_encode: %s: %s (run scripts/fetch-tokenizers)\n", dir,
                    t ? e.msg : "no tokenizer.json");
            return 2;
        }
        double t1 = now_s();
        int32_t *ids = NULL;
        int n = 0;
        if (tok_encode(t, text, len, 1, &ids, &n, &e) < 0) {
            fprintf(stderr, "bench_encode: %s\n", e.msg);
            return 2;
        }
        double t2 = now_s();
        printf("encode %-7s %zu bytes -> %d tokens in %.3f s (tokenizer.json load %.2f s)\n",
               families[k], len, n, t2 - t1, t1 - t0);
        free(ids);
        tok_free(t);
    }
    free(text);
    return 0;
}
