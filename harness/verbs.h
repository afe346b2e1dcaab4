/* verbs.h — the kvdiff verbs; each returns the process exit code. */
#ifndef KV_VERBS_H
#define KV_VERBS_H

int cmd_gen(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_compare(int argc, char **argv);
int cmd_validate(int argc, char **argv);
int cmd_bisect(int argc, char **argv);
int cmd_report(int argc, char **argv);
int cmd_suite(int argc, char **argv);

#endif
