/* tokens.h — token-id lists from the command line or a file.
 *
 * Format: decimal ids separated by commas and/or whitespace, e.g.
 * "5,17,42" or the conformance prompt.txt "76 253 34 ...". */
#ifndef KV_TOKENS_H
#define KV_TOKENS_H

#include <stddef.h>
#include <stdint.h>
#include "err.h"

/* Parses len bytes of text. `name` (a file name or "--prompt-tokens") goes
 * into messages, and so does the offending item (at most 24 bytes: the text
 * is the user's own). vocab > 0 rejects ids >= vocab. On success *ids is a
 * malloc'ed array of *n >= 1 ids (caller frees). On error nothing is
 * allocated. */
int tokens_parse(const char *text, size_t len, const char *name, int vocab, int32_t **ids,
                 int *n, kv_err *e);

/* Reads and parses a file (at most 64 MiB). Unlike tokens_parse, an error
 * never quotes the file: it names the line and byte of the bad item (a
 * file named by mistake may hold anything). */
int tokens_load(const char *path, int vocab, int32_t **ids, int *n, kv_err *e);

#endif
