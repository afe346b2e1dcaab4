/* bpe.h — text to token ids with a Hugging Face tokenizer.json whose model
 * is BPE: the encoding half of model/tokenizer (which owns one of these).
 *
 * The pipeline is the one tokenizer.json describes, in its order:
 *   1. added tokens are split out of the raw text first (leftmost, longest;
 *      lstrip / rstrip / single_word honoured; "normalized": true tokens are
 *      matched in the normalized text instead);
 *   2. the normalizer (NFC/NFD/NFKC/NFKD, Replace, Prepend, Sequence);
 *   3. the pre-tokenizer (Split with a PCRE2 regex or a string, ByteLevel,
 *      Metaspace, Sequence);
 *   4. BPE merges by rank over adjacent pairs (a priority queue, so a long
 *      word costs n log n), then byte fallback ("<0xNN>") or unk_token;
 *   5. the post-processor (TemplateProcessing: BOS and the like; ByteLevel
 *      and none add nothing).
 * Files using anything else build no encoder and say why (bpe_build), so
 * decoding still works for them. */
#ifndef KV_BPE_H
#define KV_BPE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include "err.h"

typedef struct bpe_encoder bpe_encoder;

/* Builds the encoder of a parsed tokenizer.json (root); name is used in
 * messages. Returns 0 with *out owned by the caller (free with bpe_free);
 * 0 with *out = NULL and why filled (one line) when the file uses a
 * component kvdiff cannot encode with; -1 with e filled ("NAME: problem")
 * when the parts it needs are malformed. */
int bpe_build(const json_t *root, const char *name, bpe_encoder **out, char *why,
              size_t why_n, kv_err *e);

/* Encodes len bytes of UTF-8 text (no NUL needed) into *ids (malloc'd,
 * caller frees) and *n, with the post-processor's special tokens when
 * add_special is nonzero. Returns -1 with e filled when the text is not
 * valid UTF-8 or a piece has no token (no byte fallback and no unk_token).
 * max_ids > 0: a text that makes more ids is refused ("the text makes
 * more than N tokens"), as early as the work done shows it, before the
 * memory a long text's pieces would take. */
int bpe_encode(const bpe_encoder *b, const char *text, size_t len, int add_special,
               size_t max_ids, int32_t **ids, size_t *n, kv_err *e);

/* Frees b (NULL is fine). */
void bpe_free(bpe_encoder *b);

#endif
