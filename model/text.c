/* text.c — text from files (names, dump strings, suite values), made
 * safe to show on a terminal or in a Markdown or HTML page (text.h). */
#include "text.h"

#include <stdio.h>
#include <string.h>

static bool needs_escape(unsigned char c, bool keep_newlines)
{
    if (c == '\n')
        return !keep_newlines;
    return (c < 0x20 && c != '\t') || c == 0x7f;
}

/* Bytes of the valid UTF-8 sequence at p (2 to 4), or 0. */
static size_t utf8_len(const unsigned char *p)
{
    size_t n = p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : p[0] >= 0xe0 ? 3 : p[0] >= 0xc2 ? 2 : 0;
    if (p[0] >= 0xf5)
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    return n;
}

/* The next piece of s at p as the terminal may see it, into esc (room
 * for 8): control bytes as \xNN, C1 control characters (U+0080..U+009F:
 * U+009B is CSI, which starts an escape sequence as ESC [ does) as
 * \u00NN, bytes that are not UTF-8 as \xNN; returns the bytes of s
 * consumed and sets *len to those written. */
static size_t escape_piece(const unsigned char *p, bool keep_newlines, char *esc, size_t *len)
{
    if (p[0] < 0x80) {
        if (needs_escape(p[0], keep_newlines)) {
            *len = (size_t)snprintf(esc, 8, "\\x%02x", p[0]);
        } else {
            esc[0] = (char)p[0];
            *len = 1;
        }
        return 1;
    }
    const size_t n = utf8_len(p);
    if (n == 0) {
        *len = (size_t)snprintf(esc, 8, "\\x%02x", p[0]);
        return 1;
    }
    if (n == 2 && p[0] == 0xc2 && p[1] <= 0x9f) {
        *len = (size_t)snprintf(esc, 8, "\\u00%02x", p[1]);
        return 2;
    }
    memcpy(esc, p, n);
    *len = n;
    return n;
}

char *kv_escape(char *dst, size_t n, const char *s, bool keep_newlines)
{
    size_t used = 0;
    if (n == 0)
        return dst;
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        char esc[8];
        size_t len;
        const size_t took = escape_piece(p, keep_newlines, esc, &len);
        if (used + len >= n)
            break;
        memcpy(dst + used, esc, len);
        used += len;
        p += took;
    }
    dst[used] = 0;
    return dst;
}

void kv_fputs_escaped(const char *s, FILE *f, bool keep_newlines)
{
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        char esc[8];
        size_t len;
        p += escape_piece(p, keep_newlines, esc, &len);
        fwrite(esc, 1, len, f);
    }
}
