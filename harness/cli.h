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

/* --exact means no tolerance, so it contradicts --atol, --rtol and --ulp
 * (before or after it). Call with every comparison option name as parsed
 * ("exact", "atol", ...); *state remembers what came (start it at NULL).
 * Returns 0, or -1 with e = "--exact and --atol: ..." naming both. */
int cli_tolerance_conflict(const char *name, const char **state, kv_err *e);

/* What the model options select. */
typedef struct {
    const char *model;      /* preset name or folder; default "tiny-gemma3" */
    char model_dir[4096];   /* a folder given as "dir/": "dir", which model
                             * points to (so no message prints "dir//x") */
    uint64_t weights_seed;  /* synthetic presets */
    bool weights_seed_given; /* --weights-seed came: an error with a folder */
    int wtype;              /* -1 from file, else kern_wtype */
    int threads;
    kern_isa isa;
} cli_model_opts;

void cli_model_defaults(cli_model_opts *o);
/* Handles --model, --weights-seed, --dtype, --threads, --isa; returns 1 if
 * the option was one of these, 0 if not, -1 on a bad value. */
int cli_model_option(cli_model_opts *o, const char *name, const char *val, kv_err *e);

/* A model_progress_fn drawing on the progress bar ctx (a progress *), in
 * millions of weights (thousands for a model under ten million). */
void cli_model_progress(void *ctx, int64_t done, int64_t total, const char *tensor);

/* Opens the model and the kernel context (pool) the options name; on a
 * terminal, stderr shows a bar over the tensors meanwhile. A folder model
 * with --weights-seed is refused: its weights are its files, and a seed
 * that changes nothing must not pass for one that took effect. */
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

/* Prints "kvdiff VERB: message" to stderr, the message on one line with
 * control bytes escaped (cli_escape). */
void cli_error(const char *verb, const kv_err *e);

/* cli_error for a mistake in the command line itself: the same line ending
 * in "; see kvdiff VERB --help" (one line, never the whole usage). */
void cli_usage_error(const char *verb, const kv_err *e);

/* For --json: the error as a JSON object on stdout, {"schema":
 * "kvdiff-error/1", "verb": VERB, "error": MESSAGE, "exit_code": CODE}, so a
 * program reading stdout always gets JSON (cli_error still tells stderr). */
void cli_json_error(const char *verb, const kv_err *e, int code);

/* The message for getopt_long's answer ch ('?' or ':') once it found a bad
 * option: "unknown option '--x'" or "option '--x' needs a value". Verbs
 * parse with opterr = 0 and an optstring starting with ':', so getopt
 * prints nothing under its own name. Returns -1. */
int cli_getopt_error(int ch, char **argv, kv_err *e);

/* dir and name joined with exactly one '/' between them (a dir given as
 * "out/" does not print as "out//x"), into buf of n bytes. Returns buf. */
char *cli_join(char *buf, size_t n, const char *dir, const char *name);

/* dir without its trailing slashes ("out/" -> "out", "/" stays), into buf
 * of n bytes, so paths printed under it have no "//". Returns buf. */
char *cli_dir(char *buf, size_t n, const char *dir);

/* Prints n ids separated by spaces (wrapping is left to the terminal). */
void cli_print_ids(FILE *f, const int32_t *ids, int n);

/* ------------------------------------------------------------------ */
/* Text from files, to a terminal                                       */

/* Copies s into dst (n bytes, always NUL-terminated, cut at a whole
 * escape) with every control byte but tab, and DEL, written as \xNN, so
 * a dump attribute, suite value or tokenizer token cannot move the cursor,
 * recolour the terminal or fake an output line. keep_newlines: '\n' stays
 * (multi-line text the program itself laid out). Returns dst. */
char *cli_escape(char *dst, size_t n, const char *s, bool keep_newlines);

/* cli_escape without a length bound, straight to f. */
void cli_fputs_escaped(const char *s, FILE *f, bool keep_newlines);

/* ------------------------------------------------------------------ */
/* Outputs that must not be inputs                                     */

/* (Whether two paths name one file: outfile_same, model/outfile.h.) */

/* 0 when writing out (given as out_opt) cannot overwrite in (in_opt);
 * else -1 with e = "OUT_OPT OUT: is the same file as IN_OPT IN; refusing
 * to overwrite it". in may be NULL (nothing to check). */
/* The folder of path, whose last '/' is slash (NULL: none): ".", "/" or
 * the part before it. */
void cli_parent_dir(const char *path, const char *slash, char *dir, size_t n);

int cli_output_not_input(const char *out_opt, const char *out, const char *in_opt,
                         const char *in, kv_err *e);

/* The same against every model file (*.json, *.safetensors) of the model
 * folder dir; a preset name (no such folder) has none. */
int cli_output_not_model_file(const char *out_opt, const char *out, const char *dir,
                              kv_err *e);

/* 0 when a file can be created at path: its folder exists and path is not
 * a folder; else -1 with e = "OPT PATH: why". Checked before any work, so
 * an output that cannot be written fails at once, not after the run. */
int cli_output_writable(const char *opt, const char *path, kv_err *e);

#endif
