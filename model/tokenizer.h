/* tokenizer.h — a Hugging Face tokenizer.json: text prompts into ids
 * (tok_encode, BPE models: model/bpe.h) and ids back into text for people
 * ("diverges at position 31, token ' Paris'"). For decoding, two families of
 * vocabularies are understood:
 *   - byte-level BPE (GPT-2, Llama 3, Qwen2): decoder "ByteLevel"; each
 *     character of a token stands for one byte (GPT-2's bytes_to_unicode);
 *   - SentencePiece style (Gemma, Llama 2): "▁" stands for a space and
 *     "<0xNN>" tokens for raw bytes (decoder Replace / ByteFallback, or
 *     Metaspace).
 * Anything else decodes to the token strings as written. Special tokens
 * decode to their content. Decoding is per token: whole-string decoder
 * steps (Llama 2's Strip of the first leading space) are not applied. */
#ifndef KV_TOKENIZER_H
#define KV_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "err.h"

typedef struct kv_tokenizer kv_tokenizer;

/* Loads <dir>/tokenizer.json. A folder without one is not an error: returns
 * 0 with *out = NULL (no vocabulary; tok_decode then writes "<unk:ID>").
 * A malformed file: -1 with e naming the file. Free *out with tok_free. */
int tok_load(const char *dir, kv_tokenizer **out, kv_err *e);

/* Parses tokenizer.json text (len bytes, need not be NUL-terminated); name
 * is used in messages. Used by tok_load and the fuzzer. Returns 0 with *out
 * owned by the caller, or -1 with e filled and *out = NULL. */
int tok_parse(const char *text, size_t len, const char *name,
              kv_tokenizer **out, kv_err *e);

/* Number of ids, i.e. the highest id + 1 (0 for NULL). Ids below it may
 * still have no token (gaps). */
int tok_count(const kv_tokenizer *t);

/* Appends the text of token `id` to the NUL-terminated string in buf (n
 * bytes in all), truncating to fit and always terminating when n > 0.
 * The text is raw bytes: a byte token can be half of a UTF-8 character that
 * the next token completes, so append a whole sequence before printing it.
 * A decoded NUL byte is written as "<0x00>". Ids without a token, and every
 * id when t is NULL, append "<unk:ID>". Returns the length of the token's
 * text, which may exceed what fit. */
size_t tok_decode(const kv_tokenizer *t, int id, char *buf, size_t n);

/* Encodes len bytes of UTF-8 text into *ids (malloc'd, the caller frees)
 * and *n, as the file's pipeline says (model/bpe.h); add_special adds the
 * post-processor's special tokens (BOS for Gemma). Returns -1 with e naming
 * the file when t is NULL, when the file uses something kvdiff cannot
 * encode with (it says what), or when the text is not valid UTF-8. */
int tok_encode(const kv_tokenizer *t, const char *text, size_t len, int add_special,
               int32_t **ids, int *n, kv_err *e);

/* Checks that t fits a model with model_vocab ids. Fits (returns 0, note
 * empty): t has at most model_vocab ids. Fits with a note (returns 0, note
 * filled, one line): the ids past the model's are all added tokens, e.g.
 * Gemma 3's "<image_soft_token>" at 262144 beside a 262144-id embedding;
 * the caller shows the note, and refuses prompts with such ids. Refused
 * (returns -1, e filled): a token of the vocabulary itself lies past the
 * model's ids, i.e. another model's tokenizer. NULL t fits. */
int tok_check_vocab(const kv_tokenizer *t, int model_vocab, char *note, size_t note_n,
                    kv_err *e);

/* A prompt's text into ids, as `kvdiff run --prompt-text` and a suite's
 * `text:` prompts encode it: tok_encode with the special tokens, then
 * refused (-1, e without a prefix: the caller names the option or file) when
 * an id lies past the model's model_vocab ids (an added token such as
 * Gemma 3's image placeholder) or when the text makes no tokens; max_ids
 * > 0 (the model's positions): a text making more is refused as soon as
 * that shows, before a long text takes its memory. */
int tok_encode_prompt(const kv_tokenizer *t, const char *text, size_t len, int model_vocab,
                      int max_ids, int32_t **ids, int *n, kv_err *e);

/* The largest prompt text file tok_read_text reads. */
#define TOK_TEXT_MAX (64 << 20)

/* Reads a prompt text file whole, byte for byte (a final newline is part of
 * the text), into *text (malloc'd, NUL-terminated; *len excludes the NUL).
 * A FIFO, a device or a file over TOK_TEXT_MAX bytes is refused: -1 with e
 * naming path. */
int tok_read_text(const char *path, char **text, size_t *len, kv_err *e);

/* Frees t (NULL is fine). */
void tok_free(kv_tokenizer *t);

#endif
