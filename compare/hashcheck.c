/* hashcheck.c — row hashes are believed only while a sample of them holds.
 *
 * A walk that skips rows because both sides' hashes agree (or settles
 * every stage from the hash indexes) trusts that each hash is its row's;
 * a tool that edits rows without rewriting their hashes breaks that, and
 * the compare would call edited rows identical. So after such a walk a
 * fixed fraction of every stage's rows is read and hashed again: each
 * stage checks one run of CMP_AUDIT_SEGMENTS-th of its positions, at an
 * offset that moves from stage to stage (so the stages together cover
 * every position range), and every row within CMP_AUDIT_NEAR positions
 * before a divergence is checked whole. Where the rows settled by hash
 * are few (CMP_AUDIT_WHOLE floats a side: a second or so to read and
 * hash), every one is checked: a sample of 1/32 can miss a stage edited
 * past the run it checks, and a false "identical" is the one verdict
 * that must not happen. One stale hash is enough to distrust them all:
 * cmp_compare then reads every row. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cmp_internal.h"

#define CMP_AUDIT_SEGMENTS 32   /* a stage checks 1/32 of its positions */
#define CMP_AUDIT_NEAR 8        /* positions before a divergence checked whole */
#define CMP_AUDIT_READ 64       /* rows per read */
#define CMP_AUDIT_WHOLE ((int64_t)1 << 26)   /* floats settled by hash, a side, checked
                                              * whole (256 MB) */

typedef struct {
    float *rows;
    uint64_t *hash;
    size_t cap_floats;
} audit_buf;

static int grow(audit_buf *b, size_t floats, kv_err *e)
{
    if (floats <= b->cap_floats)
        return 0;
    float *r = realloc(b->rows, floats * sizeof *r);
    if (!r)
        return kv_errf(e, "compare: out of memory checking row hashes");
    b->rows = r;
    b->cap_floats = floats;
    return 0;
}

/* Checks one side's rows p0 .. p1 of a stage against its hashes; fills
 * r->hashcheck at the first stale one. */
static int check_side(const cmp_source *s, const cmp_stage_result *sr, int64_t p0, int64_t p1,
                      audit_buf *b, cmp_result *r, kv_err *e)
{
    if (!s->read || !s->read_hash)
        return 0;
    for (int64_t q = p0; q <= p1 && !r->hashcheck.stale; q += CMP_AUDIT_READ) {
        const int64_t n = p1 - q + 1 < CMP_AUDIT_READ ? p1 - q + 1 : CMP_AUDIT_READ;
        if (grow(b, (size_t)n * (size_t)sr->cols, e) < 0)
            return -1;
        int rc = s->read_hash(s->ctx, sr->layer, sr->stage, q, n, b->hash, e);
        if (rc < 0)
            return -1;
        if (rc > 0)   /* no hashes here: nothing was settled by them */
            continue;
        if (s->read(s->ctx, sr->layer, sr->stage, q, n, b->rows, e) < 0)
            return -1;
        r->hashcheck.rows_checked += n;
        for (int64_t k = 0; k < n; k++) {
            const float *row = b->rows + (size_t)k * (size_t)sr->cols;
            if (XXH3_64bits(row, (size_t)sr->cols * sizeof(float)) == b->hash[k])
                continue;
            cmp_hash_check *h = &r->hashcheck;
            h->stale = true;
            snprintf(h->file, sizeof h->file, "%s", s->label ? s->label : "?");
            h->layer = sr->layer;
            h->stage = sr->stage;
            h->pos = q + k;
            break;
        }
    }
    return 0;
}

static int check_range(const cmp_source *ref, const cmp_source *test,
                       const cmp_stage_result *sr, int64_t p0, int64_t p1, audit_buf *b,
                       cmp_result *r, kv_err *e)
{
    if (p0 < sr->pos_lo)
        p0 = sr->pos_lo;
    if (p1 > sr->pos_hi)
        p1 = sr->pos_hi;
    if (p0 > p1)
        return 0;
    if (check_side(test, sr, p0, p1, b, r, e) < 0)
        return -1;
    return r->hashcheck.stale ? 0 : check_side(ref, sr, p0, p1, b, r, e);
}

/* The rows before a divergence, whatever stage: the one reported must
 * not hide an earlier row whose stale hash made it look equal. */
static int check_near(const cmp_source *ref, const cmp_source *test, const cmp_divergence *d,
                      const cmp_stage_result *sr, audit_buf *b, cmp_result *r, kv_err *e)
{
    if (!d->found)
        return 0;
    return check_range(ref, test, sr, d->pos - CMP_AUDIT_NEAR, d->pos, b, r, e);
}

int cmp_hash_audit(const cmp_source *ref, const cmp_source *test, cmp_result *r,
                   int64_t whole_limit, kv_err *e)
{
    audit_buf b = {0};
    memset(&r->hashcheck, 0, sizeof r->hashcheck);
    int rc = 0;
    const int64_t walked = r->compared.walked_to;
    int64_t settled = 0;
    for (int i = 0; i < r->n_stages; i++)
        if (!r->stages[i].hashed && r->stages[i].rows_by_hash > 0 && r->stages[i].cols > 0)
            settled += r->stages[i].rows_by_hash * (int64_t)r->stages[i].cols;
    const bool whole = whole_limit >= 0 && settled <= (whole_limit ? whole_limit : CMP_AUDIT_WHOLE);
    for (int i = 0; i < r->n_stages && rc == 0 && !r->hashcheck.stale; i++) {
        const cmp_stage_result *sr = &r->stages[i];
        if (sr->hashed || sr->rows_by_hash <= 0 || sr->cols <= 0)
            continue;
        if (!(b.hash = b.hash ? b.hash : malloc(CMP_AUDIT_READ * sizeof *b.hash))) {
            rc = kv_errf(e, "compare: out of memory checking row hashes");
            break;
        }
        const int64_t hi = sr->pos_hi < walked ? sr->pos_hi : walked;
        const int64_t n = hi - sr->pos_lo + 1;
        if (n <= 0)
            continue;
        /* Stage i takes segment 7i mod 32: 7 and 32 are coprime, so 32
         * consecutive stages cover every segment once. */
        const int64_t seg = (int64_t)((7u * (unsigned)i) % CMP_AUDIT_SEGMENTS);
        const int64_t p0 = whole ? sr->pos_lo : sr->pos_lo + n * seg / CMP_AUDIT_SEGMENTS;
        int64_t p1 = whole ? hi : sr->pos_lo + n * (seg + 1) / CMP_AUDIT_SEGMENTS - 1;
        p1 = p1 < p0 ? p0 : p1;
        rc = check_range(ref, test, sr, p0, p1, &b, r, e);
        if (rc == 0)
            rc = check_near(ref, test, &r->first, sr, &b, r, e);
        if (rc == 0)
            rc = check_near(ref, test, &r->beyond, sr, &b, r, e);
    }
    free(b.rows);
    free(b.hash);
    return rc;
}
