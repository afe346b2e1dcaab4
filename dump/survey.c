/* survey.c — dump_survey (dump.h): the per-dataset libhdf5 work of a
 * reader of several files, done for each file in a child process of its
 * own. libhdf5 runs one call at a time in a process, so this is how two
 * files' metadata are read at once. A child runs the same reader calls the
 * parent would (reader.c), then sends back what they filled in: every
 * dataset entry (shape, element type, first position, chunk map) and
 * every index row it checked. The parent takes in what it does not know
 * yet; entries come without a libhdf5 handle, and reader.c opens one if a
 * read through libhdf5 ever needs it.
 *
 * The children are forked after the files were opened, so each reads its
 * file through the same open descriptors (libhdf5 and the direct reads
 * both use pread: no shared offset), never through a path that could name
 * another file by now. */
#include "reader_internal.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static bool survey_on = true;
static void (*child_hook)(int out_fd);

void dump_set_survey(bool on)
{
    survey_on = on;
}

void dump_survey_child_hook(void (*fn)(int out_fd))
{
    child_hook = fn;
}

#define SURVEY_MAX_FILES 8
/* A child slower than this is killed and its file read as usual. */
#define SURVEY_LIMIT_MS 60000
#define SURVEY_MAGIC 0x4b565356u   /* the first 4 bytes of a report */

typedef struct {
    unsigned char *p;
    size_t n, cap;
    bool bad;                      /* out of memory */
} buf;

/* Room for n more bytes. */
static bool reserve(buf *b, size_t n)
{
    if (b->bad)
        return false;
    if (b->n + n <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->n + n)
        cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p)
        return !(b->bad = true);
    b->p = p;
    b->cap = cap;
    return true;
}

static void put(buf *b, const void *v, size_t n)
{
    if (n == 0 || !reserve(b, n))
        return;
    memcpy(b->p + b->n, v, n);
    b->n += n;
}

#define PUT(b, v) put((b), &(v), sizeof(v))

/* ------------------------------------------------------------------ */
/* The child                                                            */

static void do_items(const dump_file *f, const dump_survey_item *it, int n)
{
    for (int i = 0; i < n; i++) {
        const int l = it[i].layer;
        const kv_stage st = it[i].stage;
        const unsigned w = it[i].what;
        if (w & DUMP_SURVEY_STAGE)
            (void)dump_stage_info(f, l, st);
        if (w & DUMP_SURVEY_MAP_ROWS)
            (void)dump_rows_parallel(f, l, st);
        if (w & DUMP_SURVEY_HASHES)
            (void)dump_hash_info(f, l, st);
        if (w & (DUMP_SURVEY_MAP_HASHES | DUMP_SURVEY_MAP_STATS))
            dump_map_hashes(f, l, st, w & DUMP_SURVEY_MAP_HASHES, w & DUMP_SURVEY_MAP_STATS);
        if (w & DUMP_SURVEY_DIGEST)
            (void)dump_digest(f, l, st, true);
        if (w & DUMP_SURVEY_CHECK)
            (void)dump_check_stage(f, l, st, NULL);
    }
}

/* 'M' entries, 'X' checked index rows, 'E'. Both ends are this program. */
static void put_state(buf *b, const dump_file *f)
{
    const uint32_t magic = SURVEY_MAGIC;
    PUT(b, magic);
    for (int h = 0; h < META_BUCKETS; h++)
        for (const dset_meta *m = atomic_load(&f->meta->b[h]); m; m = m->next) {
            if (strlen(m->path) > 255)
                continue;   /* not a path the reader makes */
            const uint8_t tag = 'M', present = m->present;
            const uint16_t len = (uint16_t)strlen(m->path);
            const int32_t rank = m->rank, kind = m->kind, mapped = m->mapped;
            const int32_t problem = m->problem, filter = m->filter;
            const uint8_t has_first = m->has_first;
            PUT(b, tag);
            PUT(b, len);
            put(b, m->path, len);
            PUT(b, present);
            PUT(b, rank);
            PUT(b, m->dims[0]);
            PUT(b, m->dims[1]);
            PUT(b, kind);
            PUT(b, m->first_position);
            PUT(b, has_first);
            PUT(b, problem);
            PUT(b, filter);
            PUT(b, mapped);
            if (mapped == 1) {
                const uint64_t row_bytes = m->map.row_bytes;
                PUT(b, m->map.rows);
                PUT(b, row_bytes);
                PUT(b, m->map.chunk_rows);
                PUT(b, m->map.n_off);
                put(b, m->map.off, (size_t)m->map.n_off * sizeof *m->map.off);
            }
        }
    for (int l = 0; f->index && l <= KV_MAX_LAYERS; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            const int8_t checked = (int8_t)f->index[l][st].checked;
            if (!checked)
                continue;
            const uint8_t tag = 'X';
            const int16_t layer = (int16_t)(l - 1);
            const uint8_t stage = (uint8_t)st;
            PUT(b, tag);
            PUT(b, layer);
            PUT(b, stage);
            PUT(b, checked);
        }
    const uint8_t end = 'E';
    PUT(b, end);
}

static void write_all(int fd, const unsigned char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            _exit(1);
        p += k;
        n -= (size_t)k;
    }
}

static void child(const dump_file *f, const dump_survey_item *items, int n_items, int out)
{
    dump_child_begin();
    do_items(f, items, n_items);
    if (child_hook) {
        child_hook(out);
        _exit(0);
    }
    buf b = {0};
    put_state(&b, f);
    if (b.bad)
        _exit(1);
    write_all(out, b.p, b.n);
    _exit(0);
}

/* ------------------------------------------------------------------ */
/* The parent                                                           */

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* Reads what the children write, all at once, until each has closed its
 * pipe (done[i] true) or the deadline passes. */
static void read_children(const int *in, buf *out, bool *done, int n, double deadline)
{
    for (;;) {
        struct pollfd p[SURVEY_MAX_FILES];
        int map[SURVEY_MAX_FILES], k = 0;
        for (int i = 0; i < n; i++)
            if (in[i] >= 0 && !done[i] && !out[i].bad) {
                p[k] = (struct pollfd){.fd = in[i], .events = POLLIN};
                map[k++] = i;
            }
        const double left = deadline - now_ms();
        if (k == 0 || left <= 0)
            return;
        const int r = poll(p, (nfds_t)k, (int)left + 1);
        if (r < 0 && errno != EINTR)
            return;
        for (int j = 0; r > 0 && j < k; j++) {
            if (!p[j].revents)
                continue;
            buf *b = &out[map[j]];
            if (!reserve(b, 65536))
                continue;   /* out of memory: that child's report is dropped */
            const ssize_t got = read(in[map[j]], b->p + b->n, b->cap - b->n);
            if (got > 0)
                b->n += (size_t)got;
            else if (got == 0)
                done[map[j]] = true;
            else if (errno != EINTR && errno != EAGAIN)
                b->bad = true;
        }
    }
}

typedef struct {
    const unsigned char *p, *end;
    bool bad;
} reader;

static void get(reader *r, void *v, size_t n)
{
    if (n == 0)
        return;
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = true;
        memset(v, 0, n);
        return;
    }
    memcpy(v, r->p, n);
    r->p += n;
}

#define GET(r, v) get((r), &(v), sizeof(v))

/* One entry of the stream; NULL (r->bad set) when malformed. */
static dset_meta *get_entry(reader *r, const dump_file *f)
{
    uint16_t len;
    GET(r, len);
    char path[256];
    if (r->bad || len == 0 || len > 255)
        return r->bad = true, NULL;
    get(r, path, len);
    path[len] = 0;
    uint8_t present, has_first;
    int32_t rank, kind, mapped, problem, filter;
    dset_meta *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        return r->bad = true, NULL;
    }
    m->id = H5I_INVALID_HID;
    GET(r, present);
    GET(r, rank);
    GET(r, m->dims[0]);
    GET(r, m->dims[1]);
    GET(r, kind);
    GET(r, m->first_position);
    GET(r, has_first);
    GET(r, problem);
    GET(r, filter);
    GET(r, mapped);
    m->present = present == 1;
    m->has_first = has_first == 1;
    m->problem = problem;
    m->filter = filter;
    m->rank = rank;
    m->kind = kind;
    m->mapped = mapped;
    const bool known_problem = problem == DUMP_STORAGE_OK || problem == DUMP_STORAGE_EXTERNAL ||
                               problem == DUMP_STORAGE_FILTER || problem == DUMP_STORAGE_VIRTUAL ||
                               problem == META_UNOPENABLE ||
                               problem == META_EXTERNAL_LINK;
    if (present > 1 || has_first > 1 || !known_problem || rank < -1 || rank > 2 || kind < -1 ||
        kind > 2 || mapped < -1 || mapped > 1)
        r->bad = true;
    if (!r->bad && mapped == 1) {
        uint64_t row_bytes;
        GET(r, m->map.rows);
        GET(r, row_bytes);
        GET(r, m->map.chunk_rows);
        GET(r, m->map.n_off);
        m->map.row_bytes = (size_t)row_bytes;
        if (r->bad || m->map.n_off < 0 || m->map.n_off > DUMP_DIRECT_MAX_CHUNKS)
            r->bad = true;
        else if (m->map.n_off > 0 && !(m->map.off = malloc((size_t)m->map.n_off *
                                                            sizeof *m->map.off)))
            r->bad = true;
        else
            get(r, m->map.off, (size_t)m->map.n_off * sizeof *m->map.off);
        const size_t elem = m->kind == ELEM_U64 ? 8 : 4;
        if (!r->bad && (m->rank < 1 || m->kind < 0 ||
                        !dump_rowmap_sound(&m->map, m->dims[0], (size_t)m->dims[1] * elem,
                                           f->size)))
            r->bad = true;
    }
    if (r->bad) {
        dump_meta_free(m);
        return NULL;
    }
    return m;
}

/* Takes in a child's stream whole, or nothing of it. */
static void take_in(dump_file *f, const buf *b)
{
    reader r = {.p = b->p, .end = b->p + b->n};
    uint32_t magic;
    GET(&r, magic);
    if (r.bad || magic != SURVEY_MAGIC)
        return;
    dset_meta *head = NULL;
    struct {
        int16_t layer;
        uint8_t stage;
        int8_t checked;
    } *marks = NULL;
    size_t n_marks = 0, cap_marks = 0;
    bool ended = false;
    while (!r.bad && !ended) {
        uint8_t tag;
        GET(&r, tag);
        if (tag == 'M') {
            dset_meta *m = get_entry(&r, f);
            if (m) {
                m->next = head;
                head = m;
            }
        } else if (tag == 'X') {
            if (n_marks == cap_marks) {
                cap_marks = cap_marks ? 2 * cap_marks : 64;
                void *p = realloc(marks, cap_marks * sizeof *marks);
                if (!p) {
                    r.bad = true;
                    break;
                }
                marks = p;
            }
            GET(&r, marks[n_marks].layer);
            GET(&r, marks[n_marks].stage);
            GET(&r, marks[n_marks].checked);
            const bool ok = marks[n_marks].layer >= -1 && marks[n_marks].layer < KV_MAX_LAYERS &&
                            marks[n_marks].stage < STAGE_COUNT &&
                            (marks[n_marks].checked == 1 || marks[n_marks].checked == -1);
            r.bad |= !ok;
            n_marks++;
        } else {
            ended = tag == 'E';
            r.bad |= !ended;
        }
    }
    r.bad |= r.p != r.end;
    for (dset_meta *m = head, *next; m; m = next) {
        next = m->next;
        m->next = NULL;
        if (r.bad || dump_meta_find(f, m->path))
            dump_meta_free(m);
        else
            dump_meta_publish(f, m);
    }
    for (size_t i = 0; !r.bad && f->index && i < n_marks; i++) {
        struct index_entry *x = &f->index[marks[i].layer + 1][marks[i].stage];
        if (x->d.present && x->checked == 0)
            x->checked = marks[i].checked;
    }
    free(marks);
}

void dump_survey(dump_file *const *files, int n_files, const dump_survey_item *items,
                 int n_items)
{
    if (!survey_on || n_files < 1 || n_files > SURVEY_MAX_FILES || n_items < 1)
        return;
    pid_t pid[SURVEY_MAX_FILES];
    int in[SURVEY_MAX_FILES];
    fflush(NULL);
    const pid_t parent = getpid();
    for (int i = 0; i < n_files; i++) {
        int p[2] = {-1, -1};
        pid[i] = -1;
        in[i] = -1;
        if (!files[i] || dump_child_pipe(p) != 0)
            continue;
        pid[i] = fork();
        if (pid[i] == 0) {
            /* A compare killed (SIGTERM, SIGKILL, Ctrl-C sent to it alone)
             * takes its children with it, not seconds later. The thread
             * that forked waits for the child, so it outlives it. */
            if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
                _exit(1);
            close(p[0]);
            for (int j = 0; j < i; j++)
                if (in[j] >= 0)
                    close(in[j]);
            child(files[i], items + (size_t)i * (size_t)n_items, n_items, p[1]);
        }
        close(p[1]);
        if (pid[i] < 0)
            close(p[0]);
        else
            in[i] = p[0];
    }
    buf out[SURVEY_MAX_FILES] = {{0}};
    bool done[SURVEY_MAX_FILES] = {false};
    read_children(in, out, done, n_files, now_ms() + SURVEY_LIMIT_MS);
    for (int i = 0; i < n_files; i++) {
        if (pid[i] <= 0)
            continue;
        close(in[i]);
        if (!done[i])
            kill(pid[i], SIGKILL);
        int st = 0;
        while (waitpid(pid[i], &st, 0) < 0 && errno == EINTR)
            ;
        if (done[i] && !out[i].bad && WIFEXITED(st) && WEXITSTATUS(st) == 0)
            take_in(files[i], &out[i]);
        free(out[i].p);
    }
}
