/* pool.h — a small persistent thread pool.
 *
 * Kernels split work into tasks (output panels, query rows); the pool runs
 * fn(ctx, task) for every task in [0, ntasks). Which thread runs a task
 * never changes the result: a task owns its outputs and never shares a
 * reduction. Threads are created once in pool_create, not per call. */
#ifndef KV_POOL_H
#define KV_POOL_H

typedef struct kern_pool kern_pool;

typedef void (*pool_fn)(void *ctx, int task);

/* nthreads >= 1 (1 runs everything on the caller). NULL on failure. */
kern_pool *pool_create(int nthreads);
void pool_free(kern_pool *p);           /* accepts NULL; joins the threads */
int pool_threads(const kern_pool *p);   /* 1 for NULL */

/* Runs fn(ctx, t) for t in [0, ntasks) and returns when all are done.
 * p may be NULL (runs serially). Tasks are handed out in contiguous blocks. */
void pool_run(kern_pool *p, pool_fn fn, void *ctx, int ntasks);

#endif
