/* rotations.c — the RoPE conventions a runtime may use in place of the
 * config's on one layer (docs/diagnosis.md, "another RoPE convention"),
 * and the partial rotations (pairs turned) in the layouts runtimes use:
 * the candidates the diagnosis names (diag/rope.c) and the structure test
 * of the cross-runtime walk tries (crossrt.c), each judged by
 * cmp_rope_conv_err (recompute.c). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cmp_internal.h"

/* Bases common in released models (Gemma's local 1e4 and global 1e6,
 * Llama 3's 5e5, ...): a runtime that drops the config's often falls back
 * to one of these. */
static const double common_bases[] = {1e4, 1e5, 5e5, 1e6, 1e7};

/* Adds the convention proto (its words from fmt) to cv[0..n), unless one
 * equal to it is there already; returns the new count. */
static int add_conv_v(cmp_rope_conv *cv, int n, const cmp_rope_conv *proto, const char *fmt,
                      va_list ap)
{
    for (int i = 0; i < n; i++)   /* the first wording of a convention wins */
        if (cv[i].theta == proto->theta && cv[i].interleaved == proto->interleaved &&
            cv[i].rows == proto->rows && !memcmp(&cv[i].scaling, &proto->scaling,
                                                 sizeof proto->scaling) &&
            cv[i].pairs == proto->pairs && cv[i].freq_dims == proto->freq_dims &&
            cv[i].gap == proto->gap)
            return n;
    if (n >= CMP_ROPE_MAX_CONVS || !(proto->theta > 0))
        return n;
    cv[n] = *proto;
    vsnprintf(cv[n].what, sizeof cv[n].what, fmt, ap);
    return n + 1;
}

static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
{
    const cmp_rope_conv p = {.theta = theta, .scaling = *sc, .interleaved = interleaved,
                             .rows = rows};
    va_list ap;
    va_start(ap, fmt);
    n = add_conv_v(cv, n, &p, fmt, ap);
    va_end(ap);
    return n;
}

/* The same with `pairs` of the head rotated (frequencies theta^(-2j/fd),
 * pairs (j, j + gap)). */
static int add_partial(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                       int pairs, int fd, int gap, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
static int add_partial(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                       int pairs, int fd, int gap, const char *fmt, ...)
{
    const cmp_rope_conv p = {.theta = theta, .scaling = *sc, .rows = CMP_ROWS_SAME,
                             .pairs = pairs, .freq_dims = fd, .gap = gap};
    va_list ap;
    va_start(ap, fmt);
    n = add_conv_v(cv, n, &p, fmt, ap);
    va_end(ap);
    return n;
}

/* Linear factors a wrong or stray scaling setting often has. */
static const double common_linear[] = {2, 4, 8};

static const char *scale_name(kv_rope_scale t)
{
    return t == ROPE_SCALE_LINEAR ? "linear" : t == ROPE_SCALE_LLAMA3 ? "llama3"
         : t == ROPE_SCALE_YARN ? "yarn" : "none";
}

/* The conventions a runtime may use instead of the config's on layer l:
 * the other layer type's base, common bases, scaling missing, of the
 * other type or applied where it does not belong, and the interleaved
 * layout. The config's own is never among them. */
int cmp_rope_convs(const kv_config *cfg, int layer, cmp_rope_conv *cv)
{
    const bool sliding = config_layer_window(cfg, layer) > 0;
    const bool two_bases = cfg->rope_local_theta > 0 && cfg->rope_local_theta != cfg->rope_theta;
    const double theta = sliding && cfg->rope_local_theta > 0 ? cfg->rope_local_theta
                                                              : cfg->rope_theta;
    const kv_rope_scaling none = {.type = ROPE_SCALE_NONE};
    const kv_rope_scaling *gs = &cfg->rope_scaling;
    const kv_rope_scaling *own = config_rope_scaled(cfg, sliding) ? gs : &none;
    const char *type = sliding ? "sliding" : two_bases ? "global" : "";
    int n = 0;
    /* The config's own: added first so that nothing equal to it follows. */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_SAME, "the config's");
    if (two_bases && sliding)
        n = add_conv(cv, n, cfg->rope_theta, own, false, CMP_ROWS_SAME, "theta %g, the global "
                     "layers' base, on a sliding layer; the config says %g", cfg->rope_theta,
                     theta);
    /* Gemma 4: a sliding layer rotated as a full one (the global base on
     * the full layers' share of its pairs, at their frequencies). */
    if (two_bases && sliding && cfg->rope_partial_full > 0 && n < CMP_ROPE_MAX_CONVS) {
        const int D = config_layer_head_dim(cfg, layer);
        const int k = (int)(cfg->rope_partial_full * D / 2);
        if (k >= 1 && k < D / 2) {
            n = add_partial(cv, n, cfg->rope_theta, gs, k, D, D / 2, "theta %g, the global "
                            "layers' base, on a sliding layer, rotating %d of its %d pairs as "
                            "the full layers' partial factor %g does; the config says theta %g "
                            "on every pair", cfg->rope_theta, k, D / 2, cfg->rope_partial_full,
                            theta);
        }
    }
    if (two_bases && !sliding)
        n = add_conv(cv, n, cfg->rope_local_theta, own, false, CMP_ROWS_SAME, "theta %g, the "
                     "sliding layers' base, on a global layer; the config says %g",
                     cfg->rope_local_theta, theta);
    for (size_t i = 0; i < sizeof common_bases / sizeof common_bases[0]; i++)
        n = add_conv(cv, n, common_bases[i], own, false, CMP_ROWS_SAME, "theta %g on a%s%s "
                     "layer; the config says %g", common_bases[i], type[0] ? " " : "",
                     type[0] ? type : "", theta);
    if (own->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, &none, false, CMP_ROWS_SAME, "no RoPE scaling; the config "
                     "says %s scaling by %g", scale_name(own->type), own->factor);
        if (own->type == ROPE_SCALE_LLAMA3) {
            const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = own->factor};
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says llama3 scaling", own->factor);
        }
    }
    /* YaRN's ramp ends rounded to whole dims or not: llama.cpp always
     * rounds them (ggml_rope_yarn_corr_dims); gpt-oss's configs say not. */
    if (own->type == ROPE_SCALE_YARN) {
        kv_rope_scaling t = *own;
        t.truncate = !own->truncate;
        n = add_conv(cv, n, theta, &t, false, CMP_ROWS_SAME, "YaRN with the ramp's ends %s "
                     "(truncate %s%s); the config says truncate %s",
                     t.truncate ? "rounded to whole dims" : "not rounded",
                     t.truncate ? "true" : "false",
                     t.truncate ? ", which llama.cpp always computes, having no key for it" : "",
                     own->truncate ? "true" : "false");
    }
    if (own->type == ROPE_SCALE_NONE && gs->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, gs, false, CMP_ROWS_SAME, "the global layers' %s RoPE "
                     "scaling by %g on a sliding layer, where the config has none",
                     scale_name(gs->type), gs->factor);
    }
    n = add_conv(cv, n, theta, own, true, CMP_ROWS_SAME, "interleaved RoPE pairs (2i, 2i + 1) "
                 "where the config rotates halves (i, i + %d)", config_layer_head_dim(cfg, layer) / 2);
    /* The same mix-up seen through a recorder that maps an interleaved
     * runtime's rows back to halves (kvdiff-llama on llama.cpp's Llama). */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_UNPERMUTED, "interleaved RoPE pairs (2i, 2i + "
                 "1) rotated on rows laid out for halves (i, i + %d): q/k weights without the "
                 "row permutation an interleaved runtime needs (a converter that skipped "
                 "Llama's permute)", config_layer_head_dim(cfg, layer) / 2);
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_PERMUTED, "halves (i, i + %d) rotated on "
                 "rows laid out for interleaved pairs (2i, 2i + 1): q/k weights permuted for "
                 "an interleaved runtime where this one rotates halves, or permuted twice",
                 config_layer_head_dim(cfg, layer) / 2);
    for (size_t i = 0; i < sizeof common_linear / sizeof common_linear[0]; i++) {
        const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = common_linear[i]};
        if (own->type == ROPE_SCALE_LINEAR && own->factor == lin.factor)
            continue;
        if (own->type == ROPE_SCALE_NONE)
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g "
                         "where the config has none", lin.factor);
        else
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says %s scaling by %g", lin.factor, scale_name(own->type),
                         own->factor);
    }
    /* Drop the config's own. */
    memmove(cv, cv + 1, (size_t)(n - 1) * sizeof *cv);
    return n - 1;
}

cmp_rope_conv cmp_rope_partial(const kv_config *cfg, int layer, cmp_part_kind k, int n)
{
    const int D = config_layer_head_dim(cfg, layer);
    const bool sliding = config_layer_window(cfg, layer) > 0;
    const kv_rope_scaling none = {.type = ROPE_SCALE_NONE};
    cmp_rope_conv cv = {.theta = sliding && cfg->rope_local_theta > 0 ? cfg->rope_local_theta
                                                                       : cfg->rope_theta,
                        .scaling = sliding ? none : cfg->rope_scaling, .pairs = n};
    cv.freq_dims = k == CMP_PART_PROPORTIONAL ? D : 2 * n;
    cv.gap = k == CMP_PART_NEOX ? n : D / 2;
    return cv;
}

bool cmp_rope_partial_is_own(const kv_config *cfg, int layer, cmp_part_kind k, int n)
{
    const int half = config_layer_head_dim(cfg, layer) / 2;
    if (k != CMP_PART_PROPORTIONAL && n == half)
        return true;   /* all pairs at the head's frequencies: PROPORTIONAL's */
    return k == CMP_PART_PROPORTIONAL && n == config_layer_rope_pairs(cfg, layer);
}

double cmp_rope_best_fit(const kv_config *cfg, int layer, int64_t pos, const float *ref,
                         const float *test, int nheads, cmp_rope_conv *best)
{
    double lo = INFINITY;
    cmp_rope_conv cv[CMP_ROPE_MAX_CONVS];
    const int n = cmp_rope_convs(cfg, layer, cv);
    for (int i = 0; i < n; i++) {
        const double err = cmp_rope_conv_err(cfg, layer, &cv[i], pos, ref, test, nheads);
        if (err < lo) {
            lo = err;
            *best = cv[i];
        }
    }
    const int half = config_layer_head_dim(cfg, layer) / 2;
    for (int k = 0; k < CMP_PART_KINDS; k++)
        for (int np = 1; np <= half; np++) {
            if (cmp_rope_partial_is_own(cfg, layer, (cmp_part_kind)k, np))
                continue;
            cmp_rope_conv p = cmp_rope_partial(cfg, layer, (cmp_part_kind)k, np);
            const double err = cmp_rope_conv_err(cfg, layer, &p, pos, ref, test, nheads);
            if (err < lo) {
                lo = err;
                snprintf(p.what, sizeof p.what, "%d of the %d pairs turned (%s)", np, half,
                         k == CMP_PART_PROPORTIONAL ? "at the head's frequencies"
                         : k == CMP_PART_NEOX ? "a rope dimension count of 2n"
                                              : "that count on rows laid out for halves");
                *best = p;
            }
        }
    return lo;
}
