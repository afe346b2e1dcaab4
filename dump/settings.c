/* settings.c — the engine_settings values kvdiff knows (settings.h). */
#include "settings.h"

#include <string.h>

static const set_type TYPES[] = {
    {"f32", "f32", 0x1p-24, SET_FOR_BOTH},      {"float32", "f32", 0x1p-24, SET_FOR_BOTH},
    {"tf32", "tf32", 0x1p-11, SET_FOR_COMPUTE}, {"f16", "f16", 0x1p-11, SET_FOR_BOTH},
    {"float16", "f16", 0x1p-11, SET_FOR_BOTH},  {"bf16", "bf16", 0x1p-8, SET_FOR_BOTH},
    {"bfloat16", "bf16", 0x1p-8, SET_FOR_BOTH}, {"q8_0", "q8_0", 0x1p-8, SET_FOR_CACHE},
    /* q4_0: blocks of 32 on 16 levels, max |x| / 8 a step: half a step is
     * 2^-4 of the block's largest value */
    {"q4_0", "q4_0", 0x1p-4, SET_FOR_CACHE}};

static const char *const CACHES[] = {"dense", "split", "ring"};

const set_type *set_type_find(const char *name, set_type_use use)
{
    for (size_t i = 0; name && i < sizeof TYPES / sizeof TYPES[0]; i++)
        if ((TYPES[i].use & use) && !strcmp(TYPES[i].name, name))
            return &TYPES[i];
    return NULL;
}

bool set_cache_known(const char *name)
{
    for (size_t i = 0; name && i < sizeof CACHES / sizeof CACHES[0]; i++)
        if (!strcmp(CACHES[i], name))
            return true;
    return false;
}

/* Joins the names of list (n entries, stride bytes apart, the name first
 * in each) that keep(i) admits into buf. */
static const char *join(char *buf, size_t cap, const char *const *first, size_t n, size_t stride,
                        set_type_use use)
{
    buf[0] = 0;
    for (size_t i = 0; i < n; i++) {
        if (use && !(TYPES[i].use & use))
            continue;
        const char *name = *(const char *const *)((const char *)first + i * stride);
        if (buf[0])
            strncat(buf, ", ", cap - strlen(buf) - 1);
        strncat(buf, name, cap - strlen(buf) - 1);
    }
    return buf;
}

const char *set_type_names(set_type_use use)
{
    static char cache[128], compute[128];
    char *buf = use == SET_FOR_CACHE ? cache : compute;
    return join(buf, sizeof cache, &TYPES[0].name, sizeof TYPES / sizeof TYPES[0], sizeof TYPES[0],
                use);
}

const char *set_cache_names(void)
{
    static char buf[64];
    return join(buf, sizeof buf, CACHES, sizeof CACHES / sizeof CACHES[0], sizeof CACHES[0], 0);
}
