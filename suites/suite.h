/* suite.h — release-gating suites: the INI suite format
 * (docs/suite-format.md), its parser (suite.c) and the runner that executes
 * every case as kvdiff child processes and checks its expectation
 * (suite_run.c).
 *
 * A case runs side A and side B on the same model and prompt, records
 * both (`kvdiff run --dump`, the llama.cpp recorder, any program, or a
 * recording made elsewhere), compares them (`kvdiff compare --json`) and
 * checks the verdict against what the suite file expects: identical, within
 * a tolerance, drift only across runtimes (no-bug), or a given injected bug located at an exact (layer,
 * position, stage) with its diagnosis. Nothing here prints: the caller
 * renders results. */
#ifndef KV_SUITE_H
#define KV_SUITE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include "../model/err.h"

/* ------------------------------------------------------------------ */
/* Parsed form                                                          */

/* no-bug: the cross-runtime verdict (docs/cross-runtime.md) says drift
 * only: compare exits 0 having judged the pair by the drift model. */
typedef enum {
    SUITE_EXPECT_IDENTICAL,
    SUITE_EXPECT_WITHIN,
    SUITE_EXPECT_DETECTS,
    SUITE_EXPECT_NO_BUG
} suite_expect_kind;

typedef struct {
    suite_expect_kind kind;
    double atol, rtol;           /* within: 0 = not given */
    uint64_t ulp;                /* within: 0 = not given */
    int injection;               /* detects: a chk_injection */
    int layer;                   /* detects: the first divergence expected */
    int64_t pos;
    int stage;                   /* detects: a kv_stage */
} suite_expect;

typedef enum {
    SUITE_PROMPT_RANDOM,
    SUITE_PROMPT_TOKENS,
    SUITE_PROMPT_FILE,
    SUITE_PROMPT_TEXT,           /* text:..., encoded by the model folder's tokenizer */
    SUITE_PROMPT_TEXT_FILE       /* text-file:PATH, the same for a file's bytes */
} suite_prompt_kind;

typedef struct {
    suite_prompt_kind kind;
    long random_len;             /* random: that many ids ... */
    uint64_t seed;               /* ... drawn with this seed */
    char *text;                  /* tokens: the id list; text: the text itself;
                                  * file and text-file: the path resolved against
                                  * the suite file's folder (owned) */
} suite_prompt;

/* What records one side of a case (docs/suite-format.md, "Sides"):
 * KVDIFF: kvdiff's engines, argv = `kvdiff run` options;
 * LLAMA: the llama.cpp recorder (kvdiff-llama), argv = its options;
 * EXEC: any program, argv = the command, placeholders still in it;
 * DUMP: a recording made elsewhere, argv[0] = its path, resolved against
 * the suite file's folder. */
typedef enum { SUITE_SIDE_KVDIFF, SUITE_SIDE_LLAMA, SUITE_SIDE_EXEC, SUITE_SIDE_DUMP } suite_side_kind;

typedef struct {
    char *name;                  /* the section name: also the case's folder name */
    int line;                    /* line of its [section] header */
    char *model;                 /* preset name or Hugging Face folder */
    uint64_t weights_seed;
    bool weights_seed_given;     /* the case (or [defaults]) sets weights_seed */
    suite_prompt prompt;
    long max_new;
    char **a, **b;               /* side settings split into words, NULL-terminated */
    int na, nb;
    suite_side_kind ka, kb;      /* what a and b are */
    char *gguf;                  /* llama.cpp sides: the GGUF to run, resolved against
                                  * the suite file's folder; NULL: exported from model */
    char *expect_text;           /* the expectation as written */
    suite_expect expect;
} suite_case;

typedef struct {
    char *path;                  /* the file as given (messages) */
    char *name;                  /* its base name without ".suite" (JUnit suite name) */
    suite_case *cases;           /* in file order */
    int n_cases;
} suite;

/* ------------------------------------------------------------------ */
/* Parsing                                                              */

/* Reads and parses a suite file. Returns 0 with *s filled (at least one
 * case, every case complete) or -1 with e = "PATH:LINE: problem" (LINE
 * omitted when the file cannot be read) and *s empty. `file:` prompts are
 * resolved against the file's folder and must be readable token lists;
 * `text-file:` prompts likewise, readable text files; a text prompt on a
 * preset (no tokenizer) is refused. The text is encoded when the case
 * runs, by the model folder's tokenizer.json. */
int suite_load(const char *path, suite *s, kv_err *e);

/* The same on text already in memory (len bytes, NUL bytes refused); path
 * names it in messages and anchors relative `file:` prompts. */
int suite_parse(const char *text, size_t len, const char *path, suite *s, kv_err *e);

void suite_free(suite *s);   /* accepts NULL and an emptied suite; leaves it empty */

/* The pieces, for tests and the fuzz target. Messages carry no file:line. */

/* "identical" | "no-bug" | "within atol=X rtol=Y ulp=N" (any non-empty subset, each at
 * most once) | "detects INJ at layer L position P stage S" (the three
 * "key value" pairs in any order, each once; INJ an injection name as
 * `--inject` takes it, without its =VALUE). */
int suite_parse_expect(const char *text, suite_expect *x, kv_err *e);

/* "random:N[:SEED]" | an id list "5,17,42" | "file:PATH" (PATH relative to
 * base_dir unless absolute; base_dir NULL: the current folder). Fills *p;
 * p->text is malloc'd (suite_prompt_free). */
int suite_parse_prompt(const char *text, const char *base_dir, suite_prompt *p, kv_err *e);
void suite_prompt_free(suite_prompt *p);

/* One side (`a` or `b`): kvdiff run options (suite_parse_engine),
 * "llama.cpp: OPTIONS" (split on blanks; --dump, --prompt-*, -o and a
 * model are the runner's and refused), "exec: COMMAND" (suite_split_command,
 * placeholders checked, then suite_exec_words) or "dump: PATH" (PATH relative to base_dir unless
 * absolute). Fills *kind and a NULL-terminated argv. */
int suite_parse_side(const char *text, const char *base_dir, suite_side_kind *kind,
                     char ***argv, int *argc, kv_err *e);

/* Splits an exec: command into words: blanks separate words; '...' and
 * "..." group blanks into a word and are removed (no escapes inside;
 * quotes may sit inside a word: --x='a b'); an unterminated quote is an
 * error. Every {NAME} must be one of {model}, {tokens}, {max_new}, {dump};
 * a '{' without a closing '}' is an error. */
int suite_split_command(const char *text, char ***argv, int *argc, kv_err *e);

/* How the programs of an exec: command read each of its words
 * (docs/suite-format.md, "Shell code"). */
typedef enum {
    SUITE_WORD_ARG,              /* an argument: placeholders go in as they are */
    SUITE_WORD_PROGRAM,          /* a program the side runs, or a wrapper before it runs
                                  * (env, timeout, ...): looked up in PATH as execvp does */
    SUITE_WORD_SHELL             /* the code of a POSIX shell (sh -c CODE, after any
                                  * wrappers): each value is quoted as the shell reads
                                  * it where it stands */
} suite_word_kind;

/* Reads an exec: command (placeholders still in it) as its programs will:
 * known wrappers (env, timeout, nice, stdbuf, nohup, setsid, xargs, time,
 * command, exec, ionice, chrt, taskset, sudo, busybox) by their own option
 * grammar, shells (sh, bash, dash, zsh, ksh, ...) up to their -c code, and
 * that code down to its simple commands. Fills kinds[0..argc) when kinds
 * is not NULL. Returns 0, or -1 with e = why (no file:line) when a
 * {model}, {tokens} or {dump} sits where something re-parses it that the
 * suite cannot quote for: a shell inside shell code, eval, python -c,
 * perl -e, awk and sed programs, a non-POSIX shell's code, a program the
 * suite does not know followed by a shell, a script given -c after it,
 * `...`, ${...}, $'...' or a comment in shell code. ({max_new} is digits:
 * it may stand anywhere.) */
int suite_exec_words(char *const *argv, int argc, unsigned char *kinds, kv_err *e);

/* word with its placeholders replaced by vals (the values of {model},
 * {tokens}, {max_new}, {dump}, in that order), quoted where kind is
 * SUITE_WORD_SHELL; malloc'd, NULL when out of memory. */
char *suite_exec_fill(const char *word, suite_word_kind kind, const char *const vals[4]);

/* "llama.cpp", "exec", "dump" or "kvdiff". */
const char *suite_side_name(suite_side_kind k);

/* Splits engine settings on whitespace into a NULL-terminated argv (caller
 * frees with suite_argv_free) after checking them: only the whitelisted
 * `kvdiff run` options (engine, prefill, chunk, cache, attn, kv-share,
 * kv-pad, inject, max-ctx, dtype, threads), each with a valid value, as
 * "--opt VALUE" or "--opt=VALUE", and chunked-only options only with
 * "--engine chunked". */
int suite_parse_engine(const char *text, char ***argv, int *argc, kv_err *e);
void suite_argv_free(char **argv);

/* The comparer's diagnosis name (cmp_diag_name) an injection must produce:
 * "window" for INJ_WINDOW, "rope_offset" for INJ_ISOLATED_CHUNKS_POS, ... */
const char *suite_injection_diagnosis(int injection);

/* The expectation in the file's syntax, normalized ("detects window at
 * layer 0 position 4 stage attn_lse", "within rtol=1e-05"). */
void suite_expect_describe(const suite_expect *x, char *buf, size_t n);

/* ------------------------------------------------------------------ */
/* Selection                                                            */

/* Indices (file order) of the cases whose name matches the POSIX extended
 * regex filter (NULL: all), then every shard_n-th of those starting at the
 * 1-based shard_i (shard_n = 1: all). *sel is malloc'd (may be NULL when
 * *n = 0). -1 with e filled on a bad regex or shard. */
int suite_select(const suite *s, const char *filter, int shard_i, int shard_n, int **sel, int *n,
                 kv_err *e);

/* Parses "I/N" (1 <= I <= N). */
int suite_parse_shard(const char *text, int *shard_i, int *shard_n, kv_err *e);

/* ------------------------------------------------------------------ */
/* Running                                                              */

/* SKIPPED: not run to its end because the run was interrupted (stop). */
typedef enum { SUITE_PASS, SUITE_FAIL, SUITE_ERROR, SUITE_SKIPPED } suite_outcome;

typedef struct {
    suite_outcome outcome;       /* FAIL: the expectation was not met; ERROR: a
                                  * step could not run (exit 2, crash, bad output) */
    double seconds;              /* wall time of the case */
    char got[320];               /* what the comparison found, in the expectation's words */
    char where[96];              /* first divergence "position 4 layer 0 attn_lse", or "-" */
    char message[768];           /* FAIL / ERROR: expected vs got, or the failing step */
    char last_line[512];         /* ERROR: the last line the failing step printed */
    char folder[1024];           /* FAIL / ERROR: the kept case folder; "" when deleted */
} suite_result;

typedef struct {
    const char *kvdiff;          /* the binary each step executes */
    const char *workdir;         /* existing folder; case C works in workdir/C/ */
    int jobs;                    /* cases run at once (>= 1), one process each */
    bool report;                 /* on FAIL, also `kvdiff report ... -o C/report
                                  * --note "...expected: ..."` (not on ERROR: the
                                  * dumps may be partial or refused) */
    int step_timeout;            /* seconds a step (one kvdiff process) may take;
                                  * then it is killed and the case is an ERROR
                                  * (0: no limit) */
    /* Optional: set (by a signal handler) to stop the run: no case starts
     * any more, running ones are killed with their steps, and both kinds are
     * SKIPPED; what finished keeps its result. */
    volatile sig_atomic_t *stop;
    /* Called in the parent after each case, in completion order (may be NULL). */
    void (*on_done)(void *ctx, int done, int total, const suite_case *c, const suite_result *r);
    void *ctx;
} suite_run_opts;

/* Runs the n cases sel[] of s, results[i] for sel[i]. Each case runs in a
 * forked worker that executes `kvdiff run` for A and B and `kvdiff compare`
 * (files a.h5, b.h5, compare.json, log.txt in workdir/<case>/; a no-bug
 * case whose outside side generated other tokens also re-runs its kvdiff
 * side with --follow into a-followed.h5 or b-followed.h5 and is judged by
 * compare-followed.json); a passing case's folder is removed, a failing
 * one is kept. The runner makes each case folder (with its mark,
 * SUITE_CASE_MARK) before the worker starts; a folder already there is
 * emptied and reused only when it is one the suite made
 * (suite_case_folder_check), else the case is an ERROR and the folder is
 * left alone.
 * Returns 0 (whatever the outcomes) or -1 with e filled when the runner
 * itself cannot work (no processes, no pipes); results are then not all
 * filled. */
int suite_run(const suite *s, const int *sel, int n, const suite_run_opts *o,
              suite_result *results, kv_err *e);

/* Writes JUnit XML (one <testsuite>, a <testcase> per selected case, a
 * <failure> per FAIL, an <error> per ERROR) to path. */
int suite_write_junit(const char *path, const suite *s, const int *sel, int n,
                      const suite_result *results, kv_err *e);
void suite_junit_stream(FILE *f, const suite *s, const int *sel, int n,
                        const suite_result *results);

/* The file that marks a case folder as made by the suite: only a real
 * folder (not a link) holding it is ever emptied, reused or removed. */
#define SUITE_CASE_MARK ".kvdiff-case"

/* 0 when a case may work in folder: nothing is there, or a real folder
 * holding SUITE_CASE_MARK and none of the run's inputs
 * (outfile_note_input); else -1 with e = "FOLDER: why; it is left alone
 * ...". Checks only: changes nothing. */
int suite_case_folder_check(const char *folder, kv_err *e);

/* Removes a case folder the suite made (its mark last, so that a removal
 * cut short leaves a folder still marked); a folder without the mark, or
 * a link, is left as it is (-1 with e). Links inside are removed, never
 * followed. 0 also when nothing is there. */
int suite_case_folder_remove(const char *folder, kv_err *e);

/* Notes every file the selected cases read (outfile_note_input), so that
 * no output of the run (--junit) replaces one: the suite file, the kvdiff
 * binary, prompt files, GGUFs, dump: recordings, the files of a model
 * folder, the llama.cpp recorder, and for exec: sides every program
 * (argv[0] and what its wrappers run, found through PATH as execvp finds
 * it) and every argument word naming an existing file (also after
 * --opt=). */
void suite_note_inputs(const suite *s, const int *sel, int n, const char *kvdiff);

/* Whether `kvdiff VERB --help` exits 0 (the binary has that verb). */
bool suite_has_verb(const char *kvdiff, const char *verb);

const char *suite_outcome_name(suite_outcome o);  /* "pass", "FAIL", "ERROR", "skipped" */

#endif
