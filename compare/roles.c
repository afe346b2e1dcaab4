/* roles.c — which recording is the reference and which the run under
 * test, when the recordings themselves say so.
 *
 * Every verdict reads "the test differs from the reference": a pair given
 * the wrong way round turns a missing window into "the test attends to
 * more keys", a dropped key into an extra one, and sets the drift model
 * from the wrong runtime's settings. Three facts a recording carries make
 * its role evident, and only those are used (never the data):
 *   - kvdiff's reference engine is the reference; its chunked engine is
 *     compared against it;
 *   - kvdiff's own engines are the reference of an outside runtime
 *     (llama.cpp, PyTorch, a port);
 *   - a run that carries a planted bug (kvdiff's "inject", a recorder's
 *     "fault" in engine_settings) is the run under test. */
#include <stdio.h>
#include <string.h>

#include "cmp_internal.h"

static bool is_engine(const cmp_source *s, const char *name)
{
    return s->engine && !strcmp(s->engine, name);
}

static bool ours(const cmp_source *s)
{
    return is_engine(s, "reference") || is_engine(s, "chunked");
}

/* The planted bug a recording's settings name ("window=4"), or false. */
static bool planted(const cmp_source *s, char *what, size_t n)
{
    static const char *const keys[] = {"inject", "fault"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (cmp_settings_str(s, keys[i], what, n) && what[0] && strcmp(what, "none"))
            return true;
    return false;
}

bool cmp_roles_swapped(const cmp_source *ref, const cmp_source *test, char *why, size_t n)
{
    char bug[96], other[96];
    if (is_engine(ref, "chunked") && is_engine(test, "reference")) {
        snprintf(why, n, "the first recording is kvdiff's chunked engine and the second its "
                 "reference");
        return true;
    }
    if (ours(test) && ref->engine && ref->engine[0] && !ours(ref)) {
        snprintf(why, n, "the first recording is %s's and the second kvdiff's %s", ref->engine,
                 test->engine);
        return true;
    }
    if (planted(ref, bug, sizeof bug) && !planted(test, other, sizeof other)) {
        snprintf(why, n, "the first recording carries a planted bug (%s) and the second none",
                 bug);
        return true;
    }
    return false;
}
