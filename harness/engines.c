/* engines.c — choosing the engine of a run (engines.h). */
#include "engines.h"

#include <string.h>

#include "../reference/reference.h"

bool engine_known(const char *name)
{
    return name && (!strcmp(name, "reference") || !strcmp(name, "chunked"));
}

static bool is_chunked(const engine_spec *s)
{
    return s->name && !strcmp(s->name, "chunked");
}

chk_opts engine_chunked_opts(const engine_spec *s, long ctx)
{
    chk_opts co = s->chunked;
    co.max_ctx = (int)ctx;
    if (co.chunk > ctx)
        co.chunk = (int)ctx;
    return co;
}

int engine_check(const engine_spec *s, const kv_config *c, long ctx, kv_err *e)
{
    if (!engine_known(s->name))
        return kv_errf(e, "unknown engine '%s' (reference or chunked)", s->name ? s->name : "");
    if (!is_chunked(s))
        return 0;
    chk_opts co = engine_chunked_opts(s, ctx);
    return chk_opts_check(&co, c, e);
}

kv_engine *engine_create(const engine_spec *s, const kv_model *m, const kern_ctx *kc, long ctx,
                         kv_observer *obs, kv_err *e)
{
    if (!engine_known(s->name)) {
        kv_errf(e, "unknown engine '%s' (reference or chunked)", s->name ? s->name : "");
        return NULL;
    }
    if (is_chunked(s)) {
        chk_opts co = engine_chunked_opts(s, ctx);
        return chk_create(m, kc, &co, obs, e);
    }
    ref_opts ro = {.max_ctx = (int)ctx, .prefill_step = s->prefill_step};
    return ref_create(m, kc, &ro, obs, e);
}
