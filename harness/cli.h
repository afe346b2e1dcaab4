/* cli.h — helpers shared by the kvdiff verbs: strict number parsing, the
 * model / threads / prompt options every engine-running verb takes. */
#ifndef KV_CLI_H
#define KV_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include "../model/err.h"
#include "../model/kernels.h"
#include "../model/model.h"
#include "../model/tokenizer.h"

enum { EXIT_OK = 0, EXIT_DIVERGED = 1, EXIT_USAGE = 2 };

#define KVDIFF_VERSION "0.1.0"

/* Strict parsers: the whole string must be a number in [lo, hi]. Return 0
 * or fill e with "--opt: 'text' is not ..." and return -1. */
int cli_int(const char *opt, const char *s, long lo, long hi, long *out, kv_err *e);
int cli_u64(const char *opt, const char *s, uint64_t *out, kv_err *e);
int cli_double(const char *opt, const char *s, double lo, double hi, double *out, kv_err *e);

/* What the model options select. */
typedef struct {
    const char *model;      /* preset name or folder; default "tiny-gemma3" */
    uint64_t weights_seed;  /* synthetic presets */
    int wtype;              /* -1 from file, else kern_wtype */
    int threads;
    kern_isa isa;
} cli_model_opts;

void cli_model_defaults(cli_model_opts *o);
/* Handles --model, --weights-seed, --dtype, --threads, --isa; returns 1 if
 * the option was one of these, 0 if not, -1 on a bad value. */
int cli_model_option(cli_model_opts *o, const char *name, const char *val, kv_err *e);

/* Opens the model and the kernel context (pool) the options name. */
int cli_open_model(const cli_model_opts *o, kv_model *m, kern_ctx *kc, kv_err *e);
void cli_close_model(kv_model *m, kern_ctx *kc);

/* Prompt selection: at most one of these (none: 32 random ids). */
typedef struct {
    const char *tokens;     /* --prompt-tokens "5,17,42" */
    const char *ids_file;   /* --prompt-ids-file: a token list file */
    const char *text;       /* --prompt-text: text, encoded with tokenizer.json */
    const char *text_file;  /* --prompt-file: a text file, byte for byte */
    long random_len;        /* > 0: that many ids drawn with seed */
    uint64_t seed;
} cli_prompt_opts;

/* Loads the tokenizer.json of a model folder into *tok (NULL for a preset
 * or a folder without one) and checks that it fits m's vocabulary (refused
 * if not); when ids past the model's are explained (tok_check_vocab), says
 * so on stderr as "kvdiff VERB: note: ...". Free *tok with tok_free. */
int cli_open_tokenizer(const char *verb, const cli_model_opts *mo, const kv_model *m,
                       kv_tokenizer **tok, kv_err *e);

/* The prompt the options select, as ids below m's vocabulary (*ids is
 * malloc'd, the caller frees). Text is encoded with tok (with its special
 * tokens, BOS included where the file adds one); without tok, text is an
 * error saying why (a preset has no tokenizer). */
int cli_make_prompt(const cli_prompt_opts *p, const cli_model_opts *mo, const kv_model *m,
                    const kv_tokenizer *tok, int32_t **ids, int *n, kv_err *e);

/* Prints "kvdiff VERB: message" to stderr. */
void cli_error(const char *verb, const kv_err *e);

/* Prints n ids separated by spaces (wrapping is left to the terminal). */
void cli_print_ids(FILE *f, const int32_t *ids, int n);

#endif
