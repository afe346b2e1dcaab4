/* settings.h — the vocabulary of engine_settings that kvdiff reads.
 *
 * engine_settings is free-form JSON (docs/dump-format.md), but a few of
 * its keys steer the diagnosis and the cross-runtime drift model: the
 * numeric types a recording names for its cache and its activations, the
 * cache kinds, the prefill chunk. Both the comparer (which reads them) and
 * validate (which warns about a value the comparer would ignore) take them
 * from here, so the two never disagree about what a value means. */
#ifndef KV_DUMP_SETTINGS_H
#define KV_DUMP_SETTINGS_H

#include <stdbool.h>

/* What a numeric type may describe: a KV cache, activations, or both. */
typedef enum { SET_FOR_CACHE = 1, SET_FOR_COMPUTE = 2, SET_FOR_BOTH = 3 } set_type_use;

typedef struct {
    const char *name;    /* as a recording spells it: "bf16", "bfloat16" */
    const char *canon;   /* kvdiff's name: "bf16" */
    double eps;          /* unit roundoff */
    set_type_use use;
} set_type;

/* The type called name that may describe use, or NULL. */
const set_type *set_type_find(const char *name, set_type_use use);

/* Is name a cache kind the diagnosis knows ("dense", "split", "ring")? */
bool set_cache_known(const char *name);

/* The names set_type_find accepts for use, and the cache kinds, as one
 * comma-separated list (static), for messages. */
const char *set_type_names(set_type_use use);
const char *set_cache_names(void);

#endif
