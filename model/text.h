/* text.h — text from files, shown where a terminal or a viewer would act
 * on control characters: ESC, CR, LF inside a file name or a dump's
 * string would move the cursor, rewrite a line or forge one. Control
 * bytes print as \xNN, C1 controls (U+0080..U+009F) as \u00NN, bytes that
 * are not UTF-8 as \xNN; tabs (and newlines when kept) stay. */
#ifndef KV_TEXT_H
#define KV_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* s escaped into dst (n bytes, always NUL-terminated; cut at a whole
 * piece when it does not fit); returns dst. */
char *kv_escape(char *dst, size_t n, const char *s, bool keep_newlines);

/* s escaped, written to f. */
void kv_fputs_escaped(const char *s, FILE *f, bool keep_newlines);

#endif
