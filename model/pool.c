/* pool.c — the persistent thread pool behind pool.h.
 *
 * A decode step calls pool_run a few hundred times per token, each job
 * lasting tens of microseconds, so a hand-off must cost well under a
 * microsecond while threads are busy, and nothing while they are idle.
 *
 * Hand-off: the caller publishes a job word (generation, ntasks). Workers
 * spin on it for a while (the next job usually follows within
 * microseconds), then sleep on a condition variable. Completion is the
 * mirror image: a count of unfinished tasks that the caller spins on, then
 * sleeps on.
 *
 * Work split: thread t (the caller is thread 0) owns the contiguous block
 * of tasks [t*n/T, (t+1)*n/T) and runs it in order. A thread that is done
 * then takes still-unclaimed tasks from the other blocks. Normally every
 * thread runs exactly its own block; the stealing matters when the machine
 * is oversubscribed and a worker is not scheduled: the caller then does the
 * work itself instead of waiting a whole time slice for it. Results never
 * depend on which thread runs a task (pool.h), so this is safe.
 *
 * Claims are compare-and-swaps on per-block words that carry the job's
 * generation, so a worker that wakes up late, after its job is over, fails
 * its claims and touches nothing of a newer job. The job's fn and ctx are
 * read only after a successful claim: the caller cannot publish a new job
 * until that claimed task has finished.
 *
 * pool_run is not reentrant: one caller at a time, and a task must not call
 * pool_run on the same pool. */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* ~100 us of spinning (a pause is ~25 ns on the Zen 4 we run on, 10-140
 * elsewhere): long enough to bridge the serial gaps between the kernels of
 * one layer, short enough that an idle pool costs nothing. */
#define POOL_SPIN 4096

/* Per-thread block of tasks: (generation << 32) | next unclaimed task.
 * One cache line each, so owners do not contend. */
typedef struct {
    _Alignas(64) atomic_ullong word;
} pool_block;

struct kern_pool {
    int nthreads;                 /* including the caller */
    pthread_t *threads;           /* nthreads - 1 workers */
    pool_block *blocks;           /* nthreads */
    pthread_mutex_t mu;
    pthread_cond_t wake;          /* workers wait here for a new job word */
    pthread_cond_t done;          /* the caller waits here for remaining == 0 */
    atomic_ullong job;            /* (generation << 32) | ntasks */
    atomic_int remaining;         /* tasks of the current job not finished */
    atomic_bool quit;
    /* Written by the caller before the job word (release); read by a
     * worker only after it has claimed a task of that job. */
    pool_fn fn;
    void *ctx;
};

typedef struct {
    kern_pool *pool;
    int index;                    /* 1 .. nthreads-1 */
} pool_worker_arg;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int block_begin(int b, int ntasks, int nthreads)
{
    return (int)((int64_t)b * ntasks / nthreads);
}

/* Claims the next task of block b for generation gen; -1 when the block is
 * exhausted or belongs to another job. */
static int claim(kern_pool *p, int b, uint32_t gen, int ntasks)
{
    int end = block_begin(b + 1, ntasks, p->nthreads);
    unsigned long long v = atomic_load_explicit(&p->blocks[b].word, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen || (int)(uint32_t)v >= end)
            return -1;
        if (atomic_compare_exchange_weak_explicit(&p->blocks[b].word, &v, v + 1,
                                                  memory_order_acq_rel, memory_order_acquire))
            return (int)(uint32_t)v;
    }
}

static void finish_task(kern_pool *p)
{
    /* The last task out wakes the caller in case it sleeps; the mutex
     * orders the signal after the caller's check-then-wait. */
    if (atomic_fetch_sub_explicit(&p->remaining, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
}

/* Own block first, in order, then whatever the others left. */
static void work(kern_pool *p, int self, uint32_t gen, int ntasks)
{
    for (int k = 0; k < p->nthreads; k++) {
        int b = (self + k) % p->nthreads;
        int t;
        while ((t = claim(p, b, gen, ntasks)) >= 0) {
            p->fn(p->ctx, t);
            finish_task(p);
        }
    }
}

/* Waits until the job word differs from seen; returns the new one. */
static unsigned long long wait_job(kern_pool *p, unsigned long long seen)
{
    unsigned long long j;
    for (int i = 0; i < POOL_SPIN; i++) {
        j = atomic_load_explicit(&p->job, memory_order_acquire);
        if (j != seen)
            return j;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while ((j = atomic_load_explicit(&p->job, memory_order_acquire)) == seen)
        pthread_cond_wait(&p->wake, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return j;
}

static void *worker_main(void *argp)
{
    pool_worker_arg *arg = argp;
    kern_pool *p = arg->pool;
    int index = arg->index;
    free(arg);
    unsigned long long seen = 0;
    for (;;) {
        seen = wait_job(p, seen);
        if (atomic_load_explicit(&p->quit, memory_order_acquire))
            break;
        work(p, index, (uint32_t)(seen >> 32), (int)(uint32_t)seen);
    }
    return NULL;
}

/* Stores a new job word and wakes sleeping workers. Under the mutex so a
 * worker between its check and its wait cannot miss it. */
static void publish(kern_pool *p, unsigned long long word)
{
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->job, word, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

static unsigned long long next_job_word(kern_pool *p, int ntasks)
{
    unsigned long long old = atomic_load_explicit(&p->job, memory_order_relaxed);
    uint32_t gen = (uint32_t)(old >> 32) + 1u;
    return ((unsigned long long)gen << 32) | (uint32_t)ntasks;
}

static void stop_workers(kern_pool *p, int started)
{
    atomic_store_explicit(&p->quit, true, memory_order_release);
    publish(p, next_job_word(p, 0));
    for (int i = 0; i < started; i++)
        pthread_join(p->threads[i], NULL);
}

static void destroy(kern_pool *p)
{
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p->blocks);
    free(p);
}

kern_pool *pool_create(int nthreads)
{
    if (nthreads < 1)
        return NULL;
    kern_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->nthreads = nthreads;
    atomic_init(&p->job, 0);
    atomic_init(&p->remaining, 0);
    atomic_init(&p->quit, false);
    size_t bbytes = ((size_t)nthreads * sizeof(pool_block) + 63) & ~(size_t)63;
    p->blocks = aligned_alloc(64, bbytes);
    p->threads = nthreads > 1 ? calloc((size_t)nthreads - 1, sizeof *p->threads) : NULL;
    if (!p->blocks || (nthreads > 1 && !p->threads)) {
        free(p->blocks);
        free(p->threads);
        free(p);
        return NULL;
    }
    for (int b = 0; b < nthreads; b++)
        atomic_init(&p->blocks[b].word, 0);
    if (pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p->blocks);
        free(p->threads);
        free(p);
        return NULL;
    }
    if (pthread_cond_init(&p->wake, NULL) != 0) {
        pthread_mutex_destroy(&p->mu);
        free(p->blocks);
        free(p->threads);
        free(p);
        return NULL;
    }
    if (pthread_cond_init(&p->done, NULL) != 0) {
        pthread_cond_destroy(&p->wake);
        pthread_mutex_destroy(&p->mu);
        free(p->blocks);
        free(p->threads);
        free(p);
        return NULL;
    }
    for (int i = 0; i < nthreads - 1; i++) {
        pool_worker_arg *arg = malloc(sizeof *arg);
        if (arg) {
            arg->pool = p;
            arg->index = i + 1;
        }
        if (!arg || pthread_create(&p->threads[i], NULL, worker_main, arg) != 0) {
            free(arg);
            stop_workers(p, i);
            destroy(p);
            return NULL;
        }
    }
    return p;
}

void pool_free(kern_pool *p)
{
    if (!p)
        return;
    if (p->nthreads > 1)
        stop_workers(p, p->nthreads - 1);
    destroy(p);
}

int pool_threads(const kern_pool *p)
{
    return p ? p->nthreads : 1;
}

void pool_run(kern_pool *p, pool_fn fn, void *ctx, int ntasks)
{
    if (ntasks <= 0)
        return;
    if (!p || p->nthreads == 1 || ntasks == 1) {
        for (int i = 0; i < ntasks; i++)
            fn(ctx, i);
        return;
    }
    /* No task of the previous job is running (remaining reached 0), so no
     * worker reads fn/ctx now; stale workers only fail claims. */
    unsigned long long word = next_job_word(p, ntasks);
    uint32_t gen = (uint32_t)(word >> 32);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->remaining, ntasks, memory_order_relaxed);
    for (int b = 0; b < p->nthreads; b++)
        atomic_store_explicit(&p->blocks[b].word,
                              ((unsigned long long)gen << 32) |
                                  (uint32_t)block_begin(b, ntasks, p->nthreads),
                              memory_order_relaxed);
    publish(p, word);
    work(p, 0, gen, ntasks);
    for (int i = 0; i < POOL_SPIN; i++) {
        if (atomic_load_explicit(&p->remaining, memory_order_acquire) == 0)
            return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while (atomic_load_explicit(&p->remaining, memory_order_acquire) != 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
