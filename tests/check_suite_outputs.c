/* check_suite_outputs.c — what `kvdiff suite` writes, removes and runs.
 *
 * exec: commands: the words a shell reads as code are found behind
 * wrappers (env, timeout, nice, stdbuf, nohup, setsid, xargs, time,
 * ionice, chrt, taskset, busybox ...), values are quoted there so that a
 * hostile folder name runs nothing and reaches the program whole, and a
 * value that something else would parse (a shell inside shell code,
 * eval, python -c, an unknown wrapper before a shell) refuses the file
 * with FILE:LINE. Case folders: only a folder the suite made (a real
 * folder holding .kvdiff-case) is emptied, reused or removed. JUnit and
 * case folders refuse a FIFO, a link, a device or an input of the run at
 * their path before any case runs (exit 2), leaving it as it was. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "suites/suite.h"
#include "testutil.h"

static char out[1 << 16];

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
}

/* The file's text ("" when it cannot be read). */
static const char *read_text(const char *path)
{
    static char buf[4096];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
    return buf;
}

static bool exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* No temporary file (".NAME.XXXXXXXXXX", outfile.c) left in folder. */
static void assert_no_temp(const char *folder)
{
    DIR *d = opendir(folder);
    ck_assert_ptr_nonnull(d);
    for (struct dirent *de; (de = readdir(d));)
        ck_assert_msg(de->d_name[0] != '.' || !strcmp(de->d_name, ".") ||
                      !strcmp(de->d_name, ".."), "a temporary file %s/%s was left", folder,
                      de->d_name);
    closedir(d);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* Runs kvdiff with argv (no shell between) in folder cwd, PATH set to
 * path when not NULL; stdout and stderr into out. Returns the exit code. */
static int run_in(const char *cwd, const char *path, const char *const *args)
{
    char bin[PATH_MAX];
    const char *env = getenv("KVDIFF_BIN");
    ck_assert_ptr_nonnull(realpath(env ? env : "./kvdiff", bin));
    const char *argv[32] = {bin};
    int n = 1;
    for (; args[n - 1] && n < 31; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        if (chdir(cwd) != 0)
            _exit(126);
        if (path)
            setenv("PATH", path, 1);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t r;
    while ((r = read(fds[0], out + got, sizeof out - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = 0;
    close(fds[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* dir/ref.h5: tiny-llama on 5,17,42, two tokens, as the cases below run
 * their kvdiff side, so a side that copies it to {dump} is identical. */
static void make_ref(const char *dir)
{
    char ref[256];
    snprintf(ref, sizeof ref, "%s/ref.h5", dir);
    const char *args[] = {"run", "--model", "tiny-llama", "--prompt-tokens", "5,17,42",
                          "--max-new", "2", "--ignore-eos", "--threads", "1", "--dump", ref,
                          NULL};
    ck_assert_msg(run_in(dir, NULL, args) == 0, "%s", out);
}

static const char *defaults =
    "[defaults]\nmodel = tiny-llama\nprompt = 5,17,42\nmax_new = 2\na = --engine reference\n"
    "expect = identical\n";

/* A folder name a shell would act on in every way it can. */
static const char *hostile = "k a'$(touch pwned)'b;touch pwned;\"$(touch pwned)\"`touch pwned`";

/* No "pwned" in dir or in dir/sub. */
static void assert_nothing_ran(const char *dir, const char *sub)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/pwned", dir);
    ck_assert_msg(!exists(p), "a command in a folder's name ran (%s)", p);
    if (sub) {
        snprintf(p, sizeof p, "%s/%s/pwned", dir, sub);
        ck_assert_msg(!exists(p), "a command in a folder's name ran (%s)", p);
    }
}

/* ------------------------------------------------------------------ */
/* Reading exec: commands                                               */

static const struct {
    const char *cmd;
    bool shell;                  /* the first word with a blank in it is shell code */
    const char *program;         /* the program the wrappers run (NULL: argv[0] only) */
} accepted[] = {
    {"sh -c 'cp x {dump}'", true, NULL},
    {"sh -c 'cp x \"$0\"' {dump}", true, NULL},
    {"sh -c 'cp x \"$1\"' sh {dump}", true, NULL},
    {"bash -ec 'exec python3 rec.py \"$@\"' bash --dump {dump}", true, NULL},
    {"/bin/sh -e -c 'cp x {dump}'", true, NULL},
    {"sh -c -e 'cp x {dump}'", true, NULL},
    {"bash -o pipefail -c 'cp x {dump}'", true, NULL},
    {"bash -ec 'cp x {dump}'", true, NULL},
    {"dash -xc 'cp x {dump}'", true, NULL},
    {"zsh -c 'cp x {dump}'", true, NULL},
    {"ksh -c 'cp x {dump}'", true, NULL},
    {"mksh -c 'cp x {dump}'", true, NULL},
    {"busybox sh -c 'cp x {dump}'", true, NULL},
    {"env sh -c 'cp x {dump}'", true, "sh"},
    {"env -i A=1 sh -c 'cp x {dump}'", true, "sh"},
    {"env -u HOME A=1 B=2 bash -c 'cp x {dump}'", true, "bash"},
    {"env - -- sh -c 'cp x {dump}'", true, "sh"},
    {"/usr/bin/env --unset HOME sh -c 'cp x {dump}'", true, "sh"},
    {"timeout 50 sh -c 'cp x {dump}'", true, "sh"},
    {"timeout -k 5 -s TERM 50 bash -ec 'cp x {dump}'", true, "bash"},
    {"timeout --signal=KILL --preserve-status 5 sh -c 'cp x {dump}'", true, "sh"},
    {"timeout --kill-after 5 50 sh -c 'cp x {dump}'", true, "sh"},
    {"nice sh -c 'cp x {dump}'", true, "sh"},
    {"nice -n 5 dash -c 'cp x {dump}'", true, "dash"},
    {"nice -5 sh -c 'cp x {dump}'", true, "sh"},
    {"stdbuf -oL sh -c 'cp x {dump}'", true, "sh"},
    {"stdbuf -o L -e 0 sh -c 'cp x {dump}'", true, "sh"},
    {"nohup sh -c 'cp x {dump}'", true, "sh"},
    {"setsid -w sh -c 'cp x {dump}'", true, "sh"},
    {"setsid -c sh -c 'cp x {dump}'", true, "sh"},
    {"xargs sh -c 'cp x {dump}'", true, "sh"},
    {"xargs -0 -n 1 -P 2 sh -c 'cp x {dump}'", true, "sh"},
    {"time sh -c 'cp x {dump}'", true, "sh"},
    {"/usr/bin/time -f %e -o t.txt sh -c 'cp x {dump}'", true, "sh"},
    {"command sh -c 'cp x {dump}'", true, "sh"},
    {"command -p bash -c 'cp x {dump}'", true, "bash"},
    {"exec sh -c 'cp x {dump}'", true, "sh"},
    {"exec -a name sh -c 'cp x {dump}'", true, "sh"},
    {"ionice -c 3 sh -c 'cp x {dump}'", true, "sh"},
    {"ionice -c3 -t sh -c 'cp x {dump}'", true, "sh"},
    {"chrt -o 0 sh -c 'cp x {dump}'", true, "sh"},
    {"chrt --batch 0 sh -c 'cp x {dump}'", true, "sh"},
    {"taskset -c 0 sh -c 'cp x {dump}'", true, "sh"},
    {"taskset 0x1 sh -c 'cp x {dump}'", true, "sh"},
    {"env A=1 timeout 50 nice -n 1 stdbuf -oL setsid -w bash -ec 'cp x {dump}'", true, "bash"},
    {"sudo -u me sh -c 'cp x {dump}'", true, "sh"},
    /* values reach these as plain arguments */
    {"./rec.sh --dump {dump}", false, NULL},
    {"env A={dump} ./rec.sh", false, "./rec.sh"},
    {"timeout 50 python3 rec.py --dump {dump}", false, "python3"},
    {"python3 -c 'import sys; open(sys.argv[1])' {dump}", false, NULL},
    {"python3 -m rec --dump {dump}", false, NULL},
    {"perl -le 'print $ARGV[0]' {dump}", false, NULL},
    {"bash rec.sh {dump}", false, NULL},
    {"sed -n p {tokens}", false, NULL},
    {"find . -name {dump}", false, NULL},
    /* shell code whose values stay arguments inside */
    {"sh -c 'f=$(cat {tokens}) && cp \"$f\" {dump}'", true, NULL},
    {"sh -c 'bash -c \"echo hi\" && exec cp x {dump}'", true, NULL},
    {"sh -c 'bash rec.sh {dump} && python3 rec.py \"{dump}\" 2>/dev/null'", true, NULL},
    {"sh -c '(cd /tmp && command cp x {dump}) || true'", true, NULL},
    {"sh -c 'test {max_new} -eq $(( {max_new} + 0 )) && cp x {dump}'", true, NULL},
    {"sh -c 'for f in {tokens}; do cat \"$f\"; done > {dump}'", true, NULL},
    {"sh -c 'diff <(cat {tokens}) x; cp x {dump}'", true, NULL},
};

START_TEST(test_exec_words_accepted)
{
    char **argv = NULL;
    int argc = 0;
    kv_err e = {{0}};
    ck_assert_msg(suite_split_command(accepted[_i].cmd, &argv, &argc, &e) == 0, "%s", e.msg);
    unsigned char kinds[64];
    ck_assert_msg(suite_exec_words(argv, argc, kinds, &e) == 0, "%s: refused: %s",
                  accepted[_i].cmd, e.msg);
    int code = -1, program = 0;
    for (int i = 1; i < argc; i++) {
        if (code < 0 && strchr(argv[i], ' '))
            code = i;
        if (program == 0 && accepted[_i].program && !strcmp(argv[i], accepted[_i].program))
            program = i;
    }
    ck_assert_msg(!accepted[_i].shell || code > 0, "%s: no code", accepted[_i].cmd);
    ck_assert_msg(!accepted[_i].program || program > 0, "%s: no program", accepted[_i].cmd);
    for (int i = 0; i < argc; i++) {
        /* argv[0] and the wrappers up to the program are programs */
        bool prog = i == 0 || i == program || (kinds[i] == SUITE_WORD_PROGRAM && i < program);
        suite_word_kind want = accepted[_i].shell && i == code ? SUITE_WORD_SHELL
                             : prog ? SUITE_WORD_PROGRAM : SUITE_WORD_ARG;
        ck_assert_msg(kinds[i] == want, "%s: word %d '%s' is %d, not %d", accepted[_i].cmd, i,
                      argv[i], kinds[i], want);
    }
    suite_argv_free(argv);
}
END_TEST

static const struct {
    const char *cmd;
    const char *why;             /* in the message */
} refused[] = {
    {"./wrap sh -c 'cp x {dump}'", "no wrapper the suite knows"},
    {"timeout 5 ./wrap bash -c 'cp x {dump}'", "no wrapper the suite knows"},
    {"env A=1 mywrap sh -c 'cp x {dump}'", "no wrapper the suite knows"},
    {"find . -exec sh -c 'cp x {dump}' ;", "no wrapper the suite knows"},
    {"./wrap python3 -c 'open(\"{dump}\")'", "Python code"},
    {"sh -c 'eval cp x {dump}'", "'eval'"},
    {"env eval {dump}", "'eval'"},
    {"sh -c 'trap \"rm {dump}\" EXIT'", "'trap'"},
    {"sh -c 'bash -c \"cp x {dump}\"'", "inside shell code"},
    {"sh -c 'timeout 5 sh -c \"cp x {dump}\"'", "inside shell code"},
    {"sh -c 'bash -c \"$(echo {dump})\"'", "inside shell code"},
    {"sh -c 'X=1 exec dash -ec \"cp x {tokens}\"'", "inside shell code"},
    {"bash rec.sh -c 'cp x {dump}'", "argument of the script"},
    {"python3 -c 'open(\"{dump}\")'", "Python code"},
    {"python3.11 -Bc 'open(\"{dump}\")'", "Python code"},
    {"perl -e 'print \"{dump}\"'", "Perl code"},
    {"perl -le 'print \"{dump}\"'", "Perl code"},
    {"ruby -e 'File.write(\"{dump}\")'", "Ruby code"},
    {"node --eval 'x(\"{dump}\")'", "JavaScript code"},
    {"sed -n 's/x/{dump}/p' f", "sed code"},
    {"env -S 'sh -c {dump}'", "splits it itself"},
    {"env -vS 'cp x {dump}'", "splits it itself"},
    {"sudo -s cp x {dump}", "splits it itself"},
    {"fish -c 'cp x {dump}'", "POSIX shells"},
    {"csh -c 'cp x {dump}'", "POSIX shells"},
    {"sh -c 'cp x `echo {dump}`'", "inside `...`"},
    {"sh -c 'cp x \"`echo {dump}`\"'", "inside `...`"},
    {"sh -c 'cp x ${dump}'", "right after '$'"},
    {"bash -c \"cp x $'{dump}'\"", "inside $'...'"},
    {"sh -c 'true # {dump}'", "in a comment"},
    {"sh -c 'echo $(( {dump} ))'", "inside $((...))"},
    {"sh -c '$SHELL -c {dump}'", "comes from an expansion"},
    {"ssh host cp x {dump}", "'ssh'"},
    {"watch cp x {dump}", "'watch'"},
    {"su -c 'cp x {dump}' me", "'su -c'"},
    {"flock f -c 'cp x {dump}'", "'flock -c'"},
    {"sh -c 'case {dump} in *) cp x {dump};; esac'", "'case'"},
    {"sh -c 'exec \"$@\"' x sh -c 'cp x {dump}'", "no wrapper the suite knows"},
    {"python3 rec.py bash -c 'cp x {dump}'", "no wrapper the suite knows"},
    {"bash rec.sh perl -e 'print \"{dump}\"'", "Perl code"},
};

START_TEST(test_exec_words_refused)
{
    char **argv = NULL;
    int argc = 0;
    kv_err e = {{0}};
    ck_assert_msg(suite_split_command(refused[_i].cmd, &argv, &argc, &e) == 0, "%s", e.msg);
    ck_assert_msg(suite_exec_words(argv, argc, NULL, &e) < 0, "accepted: %s", refused[_i].cmd);
    ck_assert_msg(strstr(e.msg, refused[_i].why), "%s: %s", refused[_i].cmd, e.msg);
    ck_assert_msg(strstr(e.msg, "{dump}") || strstr(e.msg, "{tokens}"), "%s", e.msg);
    ck_assert_msg(!strchr(e.msg, '\n'), "two lines: %s", e.msg);
    suite_argv_free(argv);
    /* in a file: one line naming the file, the line and the key */
    char text[512], want[64];
    snprintf(text, sizeof text, "[c]\nmodel = tiny-llama\na =\nb = exec: %s\nexpect = no-bug\n",
             refused[_i].cmd);
    suite s;
    ck_assert_int_lt(suite_parse(text, strlen(text), "dir/t.suite", &s, &e), 0);
    snprintf(want, sizeof want, "dir/t.suite:4: b: '");
    ck_assert_msg(!strncmp(e.msg, want, strlen(want)) && strstr(e.msg, refused[_i].why), "%s",
                  e.msg);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Values in shell code, run by real shells                             */

static const char *const values[] = {
    "a'$(touch pwned)'b",
    ";touch pwned;",
    "\"$(touch pwned)\"",
    "`touch pwned`",
    "x\\'y\\\"z\\\\ $HOME",
    "two  words\tand\ttabs",
    "line1\nline2",
    "it's \"quoted\" $( ) ${x} `",
};

static const struct {
    const char *code;            /* prints pre, the value, post */
    const char *pre, *post;
} codes[] = {
    {"printf '%s|' {dump}", "", "|"},
    {"printf '%s|' \"{dump}\"", "", "|"},
    {"printf '%s|' '{dump}'", "", "|"},
    {"printf '%s|' x{dump}\"{dump}\"", "x", NULL},   /* post: the value again */
    {"printf '%s|' \"$(printf '%s' {dump})\"", "", "|"},
    {"printf '%s|' \"a$(printf '%s' \"{dump}\")b\"", "a", "b|"},
    {"printf '%s|' \"$(printf '%s' \"$(printf '%s' '{dump}')\")\"", "", "|"},
    {"v={dump}; printf '%s|' \"$v\"", "", "|"},
    {"(printf '%s|' {dump}) 2>/dev/null", "", "|"},
    {"test {max_new} -eq $(( {max_new} + 0 )) && printf '%s|' {dump}", "", "|"},
    {"exec printf '%s|' {dump}", "", "|"},
    {"command printf '%s|' {dump}", "", "|"},
};

/* Runs shell -c code (filled) in dir; its stdout into buf. */
static int run_shell(const char *shell, const char *code, const char *dir, char *buf, size_t n)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        if (chdir(dir) != 0)
            _exit(126);
        execl(shell, shell, "-c", code, "sh", (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t r;
    while ((r = read(fds[0], buf + got, n - 1 - got)) > 0)
        got += (size_t)r;
    buf[got] = 0;
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

START_TEST(test_fill_runs_nothing)
{
    static const char *const shells[] = {"/bin/sh", "/bin/bash", "/bin/dash", "/bin/zsh",
                                         "/bin/ksh", "/bin/mksh", "/usr/bin/zsh",
                                         "/usr/bin/ksh"};
    char dir[64], got[4096], want[4096];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    int ran = 0;
    for (size_t s = 0; s < sizeof shells / sizeof *shells; s++) {
        if (access(shells[s], X_OK) != 0)
            continue;
        for (size_t c = 0; c < sizeof codes / sizeof *codes; c++) {
            kv_err e = {{0}};
            /* the code as an exec: word: sh -c CODE, read by suite_exec_words */
            char *word_argv[] = {"sh", "-c", (char *)codes[c].code, NULL};
            unsigned char kinds[3];
            ck_assert_msg(suite_exec_words(word_argv, 3, kinds, &e) == 0, "%s: %s",
                          codes[c].code, e.msg);
            ck_assert_int_eq(kinds[2], SUITE_WORD_SHELL);
            for (size_t v = 0; v < sizeof values / sizeof *values; v++) {
                const char *const vals[4] = {"M", "T", "2", values[v]};
                char *filled = suite_exec_fill(codes[c].code, SUITE_WORD_SHELL, vals);
                ck_assert_ptr_nonnull(filled);
                int rc = run_shell(shells[s], filled, dir, got, sizeof got);
                snprintf(want, sizeof want, "%s%s%s", codes[c].pre, values[v],
                         codes[c].post ? codes[c].post : values[v]);
                if (!codes[c].post)
                    strcat(want, "|");
                ck_assert_msg(rc == 0 && !strcmp(got, want),
                              "%s -c %s\nwith %s\nprinted '%s' (exit %d), not '%s'", shells[s],
                              filled, values[v], got, rc, want);
                assert_nothing_ran(dir, NULL);
                free(filled);
                ran++;
            }
        }
    }
    ck_assert_int_gt(ran, 0);
    /* not shell code: the value as it is, {max_new} too */
    const char *const vals[4] = {"M", "T", "16", "a'b"};
    char *plain = suite_exec_fill("--out={dump}:{max_new}", SUITE_WORD_ARG, vals);
    ck_assert_str_eq(plain, "--out=a'b:16");
    free(plain);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Through the binary: wrappers and a hostile --keep folder             */

static const char *const prefixes[] = {
    "", "env ", "env -i A=1 ", "env -u HOME B=2 ", "timeout 50 ", "timeout -k 5 -s TERM 50 ",
    "nice -n 5 ", "stdbuf -oL ", "nohup ", "setsid -w ", "xargs ", "time -p ", "ionice -c 3 ",
    "chrt -o 0 ", "taskset -c 0 ", "busybox ", "env A=1 timeout 50 nice -n 1 stdbuf -oL ",
};

START_TEST(test_wrappers_hostile_folder)
{
    char dir[64], path[256], keep[512], text[8192], cmd[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    make_ref(dir);
    snprintf(text, sizeof text, "%s", defaults);
    int n = 0;
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++) {
        /* a wrapper this machine lacks (or may not use) is skipped */
        snprintf(cmd, sizeof cmd, "env %strue </dev/null >/dev/null 2>&1", prefixes[i]);
        if (system(cmd) != 0)
            continue;
        const char *shell = i % 3 == 0 ? "sh -c" : i % 3 == 1 ? "bash -ec" : "sh -e -c";
        size_t used = strlen(text);
        /* bare, in "...", in '...' and in $(...): each must be the path */
        snprintf(text + used, sizeof text - used,
                 "[w%zu-bare]\nb = exec: %s%s 'test -f {tokens} && cp %s/ref.h5 {dump}'\n"
                 "[w%zu-quoted]\nb = exec: %s%s 'test -f \"{tokens}\" && cp %s/ref.h5 "
                 "\"$(printf %%s \"{dump}\")\"'\n"
                 "[w%zu-single]\nb = exec: %s%s \"cp %s/ref.h5 '{dump}'\"\n",
                 i, prefixes[i], shell, dir, i, prefixes[i], shell, dir, i, prefixes[i], shell,
                 dir);
        n += 3;
    }
    size_t used = strlen(text);
    snprintf(text + used, sizeof text - used,
             "[builtins]\nb = exec: sh -c 'command test -f {tokens} && exec cp %s/ref.h5 {dump}'\n",
             dir);
    n++;
    snprintf(path, sizeof path, "%s/w.suite", dir);
    write_file(path, text);
    snprintf(keep, sizeof keep, "%s/%s", dir, hostile);
    const char *args[] = {"suite", path, "--jobs", "2", "--keep", keep, NULL};
    int rc = run_in(dir, NULL, args);
    char want[64];
    snprintf(want, sizeof want, "%d cases: %d passed", n, n);
    /* passing means the program wrote the dump where the case reads it */
    ck_assert_msg(rc == 0 && strstr(out, want), "exit %d:\n%.3000s", rc, out);
    assert_nothing_ran(dir, hostile);
    test_rmtree(dir);
}
END_TEST

/* A refused exec: stops the suite before anything runs. */
START_TEST(test_refused_exec_runs_nothing)
{
    char dir[64], path[256], keep[256], text[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/r.suite", dir);
    snprintf(keep, sizeof keep, "%s/work", dir);
    snprintf(text, sizeof text, "%s[ok]\nb = --engine chunked\n"
             "[wrapped]\nb = exec: ./wrap sh -c 'cp x {dump}'\n", defaults);
    write_file(path, text);
    const char *args[] = {"suite", path, "--keep", keep, NULL};
    ck_assert_int_eq(run_in(dir, NULL, args), 2);
    char want[400];
    snprintf(want, sizeof want, "kvdiff suite: %s:10: b: '{dump}' comes after 'sh'", path);
    ck_assert_msg(strstr(out, want) && count_lines(out) == 1, "%s", out);
    ck_assert_msg(!exists(keep), "%s made for a refused file", keep);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Case folders                                                         */

/* What may stand at --keep DIR/CASE. */
enum { AT_FOLDER, AT_LINK_DIR, AT_LINK_FILE, AT_FIFO, AT_DEVICE, AT_SUITE, AT_PROGRAM,
       AT_MARKED_WITH_INPUT, AT_COUNT };

/* Plants kind at work/c; returns false when this machine cannot make it. */
static bool plant(int kind, const char *dir, const char *work, const char *victim,
                  const char *suite_path, const char *program)
{
    char at[512], p[600];
    snprintf(at, sizeof at, "%s/c", work);
    ck_assert_int_eq(mkdir(work, 0755), 0);
    switch (kind) {
    case AT_FOLDER:   /* a user's folder that has the case's name: a model folder */
        ck_assert_int_eq(mkdir(at, 0755), 0);
        snprintf(p, sizeof p, "%s/config.json", at);
        write_file(p, "{\"precious\": true}\n");
        return true;
    case AT_LINK_DIR:
        ck_assert_int_eq(symlink(dir, at), 0);
        return true;
    case AT_LINK_FILE:
        ck_assert_int_eq(symlink(victim, at), 0);
        return true;
    case AT_FIFO:
        ck_assert_int_eq(mkfifo(at, 0600), 0);
        return true;
    case AT_DEVICE:
        return mknod(at, S_IFCHR | 0600, makedev(1, 3)) == 0;
    case AT_SUITE:
        ck_assert_int_eq(rename(suite_path, at), 0);
        return true;
    case AT_PROGRAM:
        ck_assert_int_eq(rename(program, at), 0);
        return true;
    default:   /* a folder the suite made, now holding the exec: program */
        ck_assert_int_eq(mkdir(at, 0755), 0);
        snprintf(p, sizeof p, "%s/%s", at, SUITE_CASE_MARK);
        write_file(p, "");
        snprintf(p, sizeof p, "%s/rec.sh", at);
        ck_assert_int_eq(rename(program, p), 0);
        return true;
    }
}

START_TEST(test_case_folder_refused)
{
    char dir[64], path[256], work[256], victim[256], prog[256], at[300], text[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/s.suite", dir);
    snprintf(work, sizeof work, "%s/work", dir);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    snprintf(prog, sizeof prog, "%s/rec.sh", dir);
    snprintf(at, sizeof at, "%s/c", work);
    write_file(victim, "precious\n");
    write_file(prog, "#!/bin/sh\ncp \"$REF\" \"$1\"\n");
    chmod(prog, 0755);
    /* the program the case runs is where the plant says */
    const char *run = _i == AT_PROGRAM ? at : _i == AT_MARKED_WITH_INPUT ? "work/c/rec.sh" : prog;
    snprintf(text, sizeof text, "%s[first]\nb = --engine chunked\n[c]\nb = exec: %s {dump}\n",
             defaults, run);
    write_file(path, text);
    if (!plant(_i, dir, work, victim, path, prog)) {
        test_rmtree(dir);
        return;   /* no device nodes here */
    }
    struct stat before, after;
    ck_assert_int_eq(lstat(at, &before), 0);
    const char *suite_file = _i == AT_SUITE ? at : path;
    const char *args[] = {"suite", suite_file, "--keep", work, NULL};
    const int rc = run_in(dir, NULL, args);
    ck_assert_msg(rc == 2 && count_lines(out) == 1, "exit %d: %s", rc, out);
    ck_assert_msg(strstr(out, "kvdiff suite: --keep: ") && strstr(out, "left alone") &&
                  strstr(out, at), "%s", out);
    /* untouched: the same inode, the same kind, the same bytes */
    ck_assert_int_eq(lstat(at, &after), 0);
    ck_assert_int_eq(before.st_ino, after.st_ino);
    ck_assert_int_eq(before.st_mode, after.st_mode);
    snprintf(text, sizeof text, "%s/config.json", at);
    if (_i == AT_FOLDER)
        ck_assert_str_eq(read_text(text), "{\"precious\": true}\n");
    ck_assert_str_eq(read_text(victim), "precious\n");
    snprintf(text, sizeof text, "%s/rec.sh", at);
    if (_i == AT_MARKED_WITH_INPUT)
        ck_assert_str_eq(read_text(text), "#!/bin/sh\ncp \"$REF\" \"$1\"\n");
    /* nothing ran: not even the case before it */
    snprintf(text, sizeof text, "%s/first", work);
    ck_assert_msg(!exists(text), "a case ran before the refusal");
    assert_no_temp(work);
    test_rmtree(dir);
}
END_TEST

/* A folder the suite made is reused: what was planted in it is removed,
 * never followed, and its victims keep their bytes. */
START_TEST(test_marked_folder_reused)
{
    char dir[64], path[256], work[256], victim[256], p[512], text[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    make_ref(dir);
    snprintf(path, sizeof path, "%s/s.suite", dir);
    snprintf(work, sizeof work, "%s/work", dir);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    write_file(victim, "precious\n");
    snprintf(text, sizeof text, "%s[c]\nb = exec: sh -c 'cp %s/ref.h5 {dump}'\n"
             "[bad]\nb = exec: sh -c 'echo junk > {dump}'\n", defaults, dir);
    write_file(path, text);
    ck_assert_int_eq(mkdir(work, 0755), 0);
    const char *names[] = {"c", "bad"};
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/%s", work, names[k]);
        ck_assert_int_eq(mkdir(p, 0755), 0);
        snprintf(p, sizeof p, "%s/%s/%s", work, names[k], SUITE_CASE_MARK);
        write_file(p, "");
        const char *links[] = {"log.txt", "prompt.txt", "compare.json", "a.h5", "b.h5"};
        for (int i = 0; i < 5; i++) {
            snprintf(p, sizeof p, "%s/%s/%s", work, names[k], links[i]);
            ck_assert_int_eq(symlink(victim, p), 0);
        }
        snprintf(p, sizeof p, "%s/%s/model", work, names[k]);
        ck_assert_int_eq(symlink(dir, p), 0);
        snprintf(p, sizeof p, "%s/%s/fifo", work, names[k]);
        ck_assert_int_eq(mkfifo(p, 0600), 0);
    }
    const char *args[] = {"suite", path, "--keep", work, NULL};
    const int rc = run_in(dir, NULL, args);
    /* 'bad' writes junk (an ERROR, its folder kept); 'c' passes */
    ck_assert_msg(rc == 1 && strstr(out, "2 cases: 1 passed, 0 failed, 1 error"), "exit %d: %s",
                  rc, out);
    ck_assert_str_eq(read_text(victim), "precious\n");
    snprintf(p, sizeof p, "%s/ref.h5", dir);
    ck_assert(exists(p));
    snprintf(p, sizeof p, "%s/c", work);
    ck_assert_msg(!exists(p), "the passing case's folder stayed");
    snprintf(p, sizeof p, "%s/bad/%s", work, SUITE_CASE_MARK);
    ck_assert_msg(exists(p), "the kept folder lost its mark");
    snprintf(p, sizeof p, "%s/bad/log.txt", work);
    struct stat st;
    ck_assert(lstat(p, &st) == 0 && S_ISREG(st.st_mode));
    snprintf(p, sizeof p, "%s/bad/fifo", work);
    ck_assert(!exists(p));
    /* a third run reuses the kept folder again */
    ck_assert_msg(run_in(dir, NULL, args) == 1, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* JUnit                                                                */

enum { J_FIFO, J_LINK, J_DEVICE, J_SUITE, J_PROGRAM, J_WRAPPED_PROGRAM, J_PATH_PROGRAM,
       J_ARGUMENT, J_COUNT };

START_TEST(test_junit_refused)
{
    char dir[64], path[256], work[256], victim[256], junit[320], prog[320], text[1024], bin[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/s.suite", dir);
    snprintf(work, sizeof work, "%s/work", dir);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    snprintf(junit, sizeof junit, "%s/j.xml", dir);
    snprintf(bin, sizeof bin, "%s/bin", dir);
    snprintf(prog, sizeof prog, "%s/myrec.sh", bin);
    ck_assert_int_eq(mkdir(bin, 0755), 0);
    write_file(victim, "precious\n");
    write_file(prog, "#!/bin/sh\nexit 3\n");
    chmod(prog, 0755);
    const char *side = _i == J_WRAPPED_PROGRAM ? "env A=1 timeout 50 myrec.sh"
                     : _i == J_PATH_PROGRAM ? "myrec.sh"
                     : _i == J_ARGUMENT ? "sh bin/myrec.sh" : "bin/myrec.sh";
    snprintf(text, sizeof text, "%s[c]\nb = exec: %s {dump}\n", defaults, side);
    write_file(path, text);
    bool made = true;
    switch (_i) {
    case J_FIFO: ck_assert_int_eq(mkfifo(junit, 0600), 0); break;
    case J_LINK: ck_assert_int_eq(symlink(victim, junit), 0); break;
    case J_DEVICE: made = mknod(junit, S_IFCHR | 0600, makedev(1, 3)) == 0; break;
    case J_SUITE: snprintf(junit, sizeof junit, "%s", path); break;
    default: snprintf(junit, sizeof junit, "%s", prog); break;
    }
    if (!made) {
        test_rmtree(dir);
        return;   /* no device nodes here */
    }
    struct stat before, after;
    ck_assert_int_eq(lstat(junit, &before), 0);
    char path_env[PATH_MAX + 64];
    snprintf(path_env, sizeof path_env, "%s:%s", bin, getenv("PATH") ? getenv("PATH") : "/bin");
    const char *args[] = {"suite", path, "--keep", work, "--junit", junit, NULL};
    const int rc = run_in(dir, path_env, args);
    ck_assert_msg(rc == 2 && count_lines(out) == 1 && strstr(out, "kvdiff suite: ") &&
                  strstr(out, junit), "exit %d: %s", rc, out);
    assert_no_temp(dir);
    /* refused before any case ran */
    snprintf(text, sizeof text, "%s/c", work);
    ck_assert_msg(!exists(text), "the case ran before the refusal: %s", out);
    ck_assert_int_eq(lstat(junit, &after), 0);
    ck_assert_int_eq(before.st_ino, after.st_ino);
    ck_assert_int_eq(before.st_mode, after.st_mode);
    ck_assert_int_eq(before.st_size, after.st_size);
    ck_assert_str_eq(read_text(victim), "precious\n");
    if (_i >= J_PROGRAM)
        ck_assert_str_eq(read_text(prog), "#!/bin/sh\nexit 3\n");
    test_rmtree(dir);
}
END_TEST

/* --junit inside a case's folder would be emptied away: refused first. */
START_TEST(test_junit_in_case_folder)
{
    char dir[64], path[256], work[256], p[512], text[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/s.suite", dir);
    snprintf(work, sizeof work, "%s/work", dir);
    snprintf(text, sizeof text, "%s[c]\nb = --engine chunked\n", defaults);
    write_file(path, text);
    ck_assert_int_eq(mkdir(work, 0755), 0);
    snprintf(p, sizeof p, "%s/c", work);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/c/%s", work, SUITE_CASE_MARK);
    write_file(p, "");
    snprintf(p, sizeof p, "%s/c/j.xml", work);
    const char *args[] = {"suite", path, "--keep", work, "--junit", p, NULL};
    ck_assert_int_eq(run_in(dir, NULL, args), 2);
    ck_assert_msg(strstr(out, "is inside case c's folder") && count_lines(out) == 1, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* The help says what --keep keeps: a failed case's files, in a marked
 * folder; a passing case's folder is deleted. */
START_TEST(test_help_keep)
{
    const char *args[] = {"suite", "--help", NULL};
    ck_assert_int_eq(run_in("/", NULL, args), 0);
    ck_assert_msg(!strstr(out, "keep every case's files"), "%s", out);
    ck_assert_msg(strstr(out, ".kvdiff-case") && strstr(out, "a passing case's folder is deleted")
                  && strstr(out, "(exit 2) and is left alone"), "%s", out);
}
END_TEST

Suite *suite_outputs_suite(void)
{
    Suite *s = suite_create("suite_outputs");
    TCase *tc = tcase_create("exec");
    tcase_add_loop_test(tc, test_exec_words_accepted, 0,
                        (int)(sizeof accepted / sizeof *accepted));
    tcase_add_loop_test(tc, test_exec_words_refused, 0, (int)(sizeof refused / sizeof *refused));
    tcase_add_test(tc, test_fill_runs_nothing);
    suite_add_tcase(s, tc);
    tc = tcase_create("binary");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_wrappers_hostile_folder);
    tcase_add_test(tc, test_refused_exec_runs_nothing);
    tcase_add_loop_test(tc, test_case_folder_refused, 0, AT_COUNT);
    tcase_add_test(tc, test_marked_folder_reused);
    tcase_add_loop_test(tc, test_junit_refused, 0, J_COUNT);
    tcase_add_test(tc, test_junit_in_case_folder);
    tcase_add_test(tc, test_help_keep);
    suite_add_tcase(s, tc);
    return s;
}
