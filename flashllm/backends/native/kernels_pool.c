/* The native kernels' thread pool, the library's own pthreads (no second OpenMP runtime beside torch's): a job
 * is a count of chunks taken from a shared counter by the caller and by the workers that wake while it is
 * open; the caller never waits for a worker that has not joined (on a busy machine a late worker simply finds
 * no chunk left). */
#include "kernels.h"

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;  /* one caller uses the workers at a time */
static pthread_cond_t pool_start = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_workers;       /* started worker threads, slots 1..pool_workers */
static pid_t pool_pid;         /* the process the workers belong to (a forked child has none) */
static long pool_gen;          /* incremented per job */
static long start_gen[MAX_THREADS];  /* the generation a worker was started in: it waits for the next one */
static int pool_open, pool_active, pool_slots;
static chunk_fn pool_fn;
static void *pool_arg;
static int64_t pool_chunks, pool_next;  /* pool_next: the next chunk, taken atomically */

static void take_chunks(chunk_fn fn, void *arg, int64_t chunks, int slot) {
    int64_t c;
    while ((c = __atomic_fetch_add(&pool_next, 1, __ATOMIC_RELAXED)) < chunks) fn(arg, c, slot);
}

static void *worker(void *p) {
    int slot = (int)(intptr_t)p;
    pthread_mutex_lock(&pool_mu);
    long seen = start_gen[slot];
    for (;;) {
        while (pool_gen == seen) pthread_cond_wait(&pool_start, &pool_mu);
        seen = pool_gen;
        if (!pool_open || slot > pool_slots) continue;
        pool_active++;
        chunk_fn fn = pool_fn;
        void *arg = pool_arg;
        int64_t chunks = pool_chunks;
        pthread_mutex_unlock(&pool_mu);
        take_chunks(fn, arg, chunks, slot);
        pthread_mutex_lock(&pool_mu);
        if (--pool_active == 0) pthread_cond_signal(&pool_done);
    }
    return NULL;
}

void run_chunks(chunk_fn fn, void *arg, int64_t chunks, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&pool_busy) != 0) {  /* or another caller has the pool */
        for (int64_t c = 0; c < chunks; c++) fn(arg, c, 0);
        return;
    }
    pthread_mutex_lock(&pool_mu);
    if (pool_pid != getpid()) { pool_workers = 0; pool_pid = getpid(); }  /* after fork: start afresh */
    while (pool_workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[pool_workers + 1] = pool_gen;  /* the new worker joins jobs from the next one on */
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool_workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_workers++;
    }
    pool_fn = fn;
    pool_arg = arg;
    pool_chunks = chunks;
    __atomic_store_n(&pool_next, 0, __ATOMIC_RELAXED);
    pool_slots = threads - 1;
    pool_open = 1;
    pool_gen++;
    pthread_cond_broadcast(&pool_start);
    pthread_mutex_unlock(&pool_mu);
    take_chunks(fn, arg, chunks, 0);
    pthread_mutex_lock(&pool_mu);
    pool_open = 0;  /* no worker joins from now on; wait for those inside */
    while (pool_active > 0) pthread_cond_wait(&pool_done, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_busy);
}
