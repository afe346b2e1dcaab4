/* source_dump.c — a dump file (docs/dump-format.md) read as a cmp_source,
 * so `kvdiff compare` walks files the same way it walks in-memory runs.
 * Reads go straight to hyperslabs: nothing is loaded whole. */
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "../dump/dump.h"

struct cmp_dump_source {
    dump_file *f;
    int32_t *tokens;
    /* first_position of each stage dataset, looked up once: [layer + 1][stage] */
    int64_t first[KV_MAX_LAYERS + 1][STAGE_COUNT];
    bool known[KV_MAX_LAYERS + 1][STAGE_COUNT];
    /* full mode with row hashes: the positions the hashes cover */
    int64_t hash_lo[KV_MAX_LAYERS + 1][STAGE_COUNT], hash_hi[KV_MAX_LAYERS + 1][STAGE_COUNT];
    bool hash_known[KV_MAX_LAYERS + 1][STAGE_COUNT];
};

/* Do the row hashes of a full dump cover positions pos0 .. pos0 + n - 1?
 * (A dump cut short can hold fewer hashes than rows.) */
static bool hashes_cover(cmp_dump_source *d, int layer, kv_stage st, int64_t pos0, int64_t n)
{
    if (layer < -1 || layer >= KV_MAX_LAYERS || (int)st < 0 || st >= STAGE_COUNT)
        return false;
    const int l = layer + 1;
    if (!d->hash_known[l][st]) {
        dump_dataset_info h = dump_hash_info(d->f, layer, st);
        d->hash_lo[l][st] = h.present ? h.first_position : 0;
        d->hash_hi[l][st] = h.present ? h.first_position + h.rows - 1 : -1;
        d->hash_known[l][st] = true;
    }
    return pos0 >= d->hash_lo[l][st] && pos0 + n - 1 <= d->hash_hi[l][st];
}

static int ds_info(void *ctx, int layer, kv_stage st, int64_t *first, int64_t *rows, int *cols)
{
    cmp_dump_source *d = ctx;
    /* From the row dataset itself, never from the row hash index: rows
     * added without hashes, or another width, must show. */
    dump_dataset_info di = dump_stage_info(d->f, layer, st);
    if (!di.present)
        return 1;
    *first = di.first_position;
    *rows = di.rows;
    *cols = di.cols;
    return 0;
}

/* Positions are absolute; datasets count rows from their first_position. */
static int64_t row_of(cmp_dump_source *d, int layer, kv_stage st, int64_t pos)
{
    if (layer < -1 || layer >= KV_MAX_LAYERS || (int)st < 0 || st >= STAGE_COUNT)
        return -1;
    if (!d->known[layer + 1][st]) {
        d->first[layer + 1][st] = dump_stage_info(d->f, layer, st).first_position;
        d->known[layer + 1][st] = true;
    }
    return pos - d->first[layer + 1][st];
}

static int ds_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                   kv_err *e)
{
    cmp_dump_source *d = ctx;
    return dump_read_rows(d->f, layer, st, row_of(d, layer, st, pos0), n, out, e);
}

static int ds_digest(void *ctx, int layer, kv_stage st, bool checked, cmp_digest *out)
{
    cmp_dump_source *d = ctx;
    dump_stage_digest g = dump_digest(d->f, layer, st, checked);
    if (!g.present)
        return 1;
    *out = (cmp_digest){.first_pos = g.first_position, .rows = g.rows, .cols = g.cols,
                        .digest = {g.digest[0], g.digest[1]}, .sum_sq = g.sum_sq,
                        .usable = g.finite && g.all_hashed};
    return 0;
}

static int ds_prepare_parallel(void *ctx, int layer, kv_stage st)
{
    cmp_dump_source *d = ctx;
    /* row_of looks first_position up once; done here so that parallel
     * reads only read it */
    (void)row_of(d, layer, st, 0);
    return dump_rows_parallel(d->f, layer, st);
}

static int ds_read_parallel(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                            float *out, kv_err *e)
{
    cmp_dump_source *d = ctx;
    return dump_read_rows_parallel(d->f, layer, st, row_of(d, layer, st, pos0), n, out, e);
}

static int ds_read_hash(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                        uint64_t *hash, kv_err *e)
{
    cmp_dump_source *d = ctx;
    if (!dump_is_fingerprint(d->f) && !hashes_cover(d, layer, st, pos0, n))
        return 1;
    return dump_read_hashes(d->f, layer, st, row_of(d, layer, st, pos0), n, hash, NULL, e);
}

static int ds_read_stats(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n,
                         float *stats, kv_err *e)
{
    cmp_dump_source *d = ctx;
    if (!hashes_cover(d, layer, st, pos0, n))
        return 1;
    return dump_read_hashes(d->f, layer, st, row_of(d, layer, st, pos0), n, NULL, stats, e);
}

static int ds_output_info(void *ctx, int64_t *first, int64_t *rows, int *k)
{
    cmp_dump_source *d = ctx;
    dump_dataset_info di = dump_output_info(d->f);
    if (!di.present || di.rows == 0)
        return 1;
    *first = di.first_position;
    *rows = di.rows;
    *k = dump_output_k(d->f);
    return 0;
}

static int ds_output(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *ids, float *vals,
                     kv_err *e)
{
    cmp_dump_source *d = ctx;
    int64_t row0 = pos0 - dump_output_info(d->f).first_position;
    return dump_read_output(d->f, row0, n, lse, ids, vals, e);
}

/* Every stage of the file's own config, recorded or not: a broken stage
 * outside what both sides hold is refused too (validate rejects it). */
static int ds_check(void *ctx, kv_err *e)
{
    cmp_dump_source *d = ctx;
    for (int l = -1; l < dump_n_layers(d->f); l++)
        for (int st = 0; st < STAGE_COUNT; st++)
            if ((st >= STAGE_LAYER_COUNT) == (l == -1) &&
                dump_check_stage(d->f, l, (kv_stage)st, e) < 0)
                return -1;
    return 0;
}

static unsigned survey_what(unsigned w)
{
    return DUMP_SURVEY_CHECK |   /* what ds_check asks, for every stage listed */
           (w & CMP_PREFETCH_INFO ? DUMP_SURVEY_STAGE : 0) |
           (w & CMP_PREFETCH_ROWS ? DUMP_SURVEY_MAP_ROWS : 0) |
           (w & CMP_PREFETCH_HASH_INFO ? DUMP_SURVEY_HASHES : 0) |
           (w & CMP_PREFETCH_HASHES ? DUMP_SURVEY_MAP_HASHES : 0) |
           (w & CMP_PREFETCH_STATS ? DUMP_SURVEY_MAP_STATS : 0) |
           (w & CMP_PREFETCH_DIGEST ? DUMP_SURVEY_DIGEST : 0);
}

static void ds_prefetch(void *ctx, void *other_ctx, const cmp_prefetch_item *items, int n)
{
    cmp_dump_source *a = ctx, *b = other_ctx;
    const int files = a == b ? 1 : 2;
    dump_survey_item *s = malloc((size_t)(n > 0 ? n : 1) * (size_t)files * sizeof *s);
    if (!s)
        return;   /* each file is read as usual */
    for (int k = 0; k < files; k++)
        for (int i = 0; i < n; i++)
            s[(size_t)k * (size_t)n + (size_t)i] =
                (dump_survey_item){.layer = items[i].layer, .stage = items[i].stage,
                                   .what = survey_what(items[i].what[k])};
    dump_file *f[2] = {a->f, b->f};
    dump_survey(f, files, s, n);
    free(s);
}

cmp_dump_source *cmp_dump_source_open(const char *path, cmp_source *out, kv_err *e)
{
    cmp_dump_source *d = calloc(1, sizeof *d);
    if (!d) {
        kv_errf(e, "%s: out of memory", path);
        return NULL;
    }
    d->f = dump_open(path, e);
    memset(out, 0, sizeof *out);
    if (!d->f || dump_model_config(d->f, &out->cfg, e) < 0) {
        if (d->f)
            kv_err_prefix(e, path);
        cmp_dump_source_close(d);
        return NULL;
    }
    if (dump_check_file(d->f, e) < 0) {
        cmp_dump_source_close(d);
        return NULL;
    }
    int64_t n = dump_n_tokens(d->f);
    if (n > 0) {
        d->tokens = malloc((size_t)n * sizeof *d->tokens);
        if (!d->tokens || dump_read_tokens(d->f, d->tokens, e) < 0) {
            if (!d->tokens)
                kv_errf(e, "%s: out of memory for %lld tokens", path, (long long)n);
            cmp_dump_source_close(d);
            return NULL;
        }
        for (int64_t i = 0; i < n; i++)
            if (d->tokens[i] < 0 || d->tokens[i] >= out->cfg.vocab) {
                kv_errf(e, "%s: /tokens holds ids outside 0..%d (%d at position %lld)", path,
                        out->cfg.vocab - 1, d->tokens[i], (long long)i);
                cmp_dump_source_close(d);
                return NULL;
            }
    }
    out->ctx = d;
    out->label = dump_path(d->f);
    out->engine = dump_attr(d->f, "engine");
    out->settings_json = dump_attr(d->f, "engine_settings");
    out->weights = dump_attr(d->f, "weight_fingerprint");
    out->n_tokens = n;
    out->prompt_length = dump_prompt_length(d->f);
    out->tokens = d->tokens;
    out->complete = dump_is_complete(d->f);
    out->status = dump_attr(d->f, "status");
    out->info = ds_info;
    out->read = dump_is_fingerprint(d->f) ? NULL : ds_read;
    out->prepare_parallel = out->read ? ds_prepare_parallel : NULL;
    out->read_parallel = out->read ? ds_read_parallel : NULL;
    out->read_hash = dump_has_row_hashes(d->f) ? ds_read_hash : NULL;
    out->read_stats = dump_has_row_hashes(d->f) && out->read ? ds_read_stats : NULL;
    out->digest = out->read_stats ? ds_digest : NULL;
    out->output_info = ds_output_info;
    out->output = ds_output;
    out->prefetch = ds_prefetch;
    out->check = ds_check;
    return d;
}

void cmp_dump_source_close(cmp_dump_source *d)
{
    if (!d)
        return;
    dump_file_close(d->f);
    free(d->tokens);
    free(d);
}
