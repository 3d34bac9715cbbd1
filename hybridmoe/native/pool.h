/* A pool of worker threads for the kernels: one parallel region at a time, work handed out in units.

   hm_parallel(fn, arg, T) runs fn(arg, t, T) on T threads at once (the caller is thread 0) and returns when
   all have returned. Inside, threads take work units from shared atomic counters (next_unit), so a thread
   that the OS deschedules on a shared machine leaves its units to the others instead of holding everyone
   at a fixed split; a stage that depends on the one before waits for that stage's units to be done
   (stage_wait), never for the other threads, which may not have joined.

   The threads are made at first use and kept. Between regions a worker first spins for a while (a decode
   step opens a region every ~50-100 us: waking a sleeping thread through the kernel cost more than
   the second thread saved, and on a busy machine a woken thread may wait a whole time slice for a
   core), then sleeps on a condition variable; the caller likewise spins briefly for the workers to
   finish before it sleeps. A worker that had not started when the caller finished the region's
   work skips it (its seat is closed): on a machine whose other cores are busy a descheduled worker
   then costs nothing, where the caller used to wait a time slice for it to run a region with
   nothing left in it (docs/notes/2026-11-25-demo-decode-step.md); regions therefore hand out work
   from counters only, never by thread number. One region runs at a time: a second caller (another Python thread) that finds the pool busy runs its work alone on
   its own thread (T = 1), which gives the same results, since every output element is computed whole by
   one thread. After fork() the child makes its own threads. */

#ifndef HM_POOL_H
#define HM_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#define POOL_MAX 64

typedef void (*region_fn)(void *arg, int t, int T);

static struct {
    pthread_mutex_t busy;  /* held by the caller for the whole region */
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    pthread_t threads[POOL_MAX];
    int made;              /* threads made so far (thread t of a region is threads[t - 1]) */
    pid_t pid;             /* the process that made them */
    atomic_long generation; /* bumped per region; a worker runs each generation once */
    atomic_int running;     /* workers still inside the region */
    int seats;              /* workers that may still join the region (under mu) */
    int T;
    region_fn fn;
    void *arg;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER};

/* Waits until *done (units finished, counted by the threads that did them) reaches total: the next
   stage may start once every unit of this one is done, without waiting for a thread that took none
   (a barrier of all T threads waited for a worker the OS had not run yet: a time slice on a busy
   machine). Spins briefly (stages are short), then yields the core, which a descheduled thread may
   need. */
static void stage_wait(atomic_long *done, long total) {
    for (long spins = 0; atomic_load(done) < total; spins++) {
        if (spins < 4000) __builtin_ia32_pause();
        else sched_yield();
    }
}

/* Pause instructions a thread spins for before it sleeps: about half a millisecond on Zen 4. */
#define SPIN_WAIT 20000

static void *worker(void *p) {
    int t = (int)(long)p;
    long seen = 0;
    for (;;) {
        for (long spins = 0; atomic_load(&pool.generation) == seen && spins < SPIN_WAIT; spins++)
            __builtin_ia32_pause();
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.start, &pool.mu);
        seen = atomic_load(&pool.generation);
        region_fn fn = pool.fn;
        void *arg = pool.arg;
        int T = pool.T, seated = t < T && pool.seats > 0;
        pool.seats -= seated;
        pthread_mutex_unlock(&pool.mu);
        if (!seated) continue;  /* not in this region, or it is over */
        fn(arg, t, T);
        if (atomic_fetch_sub(&pool.running, 1) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

/* Make workers 1..T-1 (once per process); how many threads a region can have. */
static int pool_grow(int T) {
    if (T > POOL_MAX) T = POOL_MAX;
    if (pool.pid != getpid()) {  /* first use, or a child after fork(): the parent's threads are gone */
        pool.pid = getpid();
        pool.made = 0;
        atomic_store(&pool.generation, 0);
    }
    while (pool.made < T - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int bad = pthread_create(&pool.threads[pool.made], &attr, worker, (void *)(long)(pool.made + 1));
        pthread_attr_destroy(&attr);
        if (bad) break;
        pool.made++;
    }
    return pool.made + 1 < T ? pool.made + 1 : T;
}

/* One pool for every library that includes this header: each library has its own copy of the pool,
   and two pools' workers, each spinning after its own regions, took each other's cores on a 2-core
   machine. Python points all but one library at that one's hm_pool_parallel (hm_share_pool); their
   regions then run on its threads. */
typedef void (*parallel_fn)(region_fn fn, void *arg, int T);
static parallel_fn shared_parallel;

void hm_pool_parallel(region_fn fn, void *arg, int T);

void hm_share_pool(parallel_fn f) { shared_parallel = f == hm_pool_parallel ? NULL : f; }

static void hm_parallel(region_fn fn, void *arg, int T) {
    if (shared_parallel && T > 1) {
        shared_parallel(fn, arg, T);
        return;
    }
    hm_pool_parallel(fn, arg, T);
}

void hm_pool_parallel(region_fn fn, void *arg, int T) {
    if (T <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    T = pool_grow(T);
    if (T <= 1) {
        pthread_mutex_unlock(&pool.mu);
        pthread_mutex_unlock(&pool.busy);
        fn(arg, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    pool.T = T;
    pool.seats = T - 1;
    atomic_store(&pool.running, T - 1);
    atomic_fetch_add(&pool.generation, 1);
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.mu);
    fn(arg, 0, T);
    pthread_mutex_lock(&pool.mu);  /* the work is done: workers that have not joined need not */
    atomic_fetch_sub(&pool.running, pool.seats);
    pool.seats = 0;
    pthread_mutex_unlock(&pool.mu);
    for (long spins = 0; atomic_load(&pool.running) > 0 && spins < SPIN_WAIT; spins++) __builtin_ia32_pause();
    if (atomic_load(&pool.running) > 0) {
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.running) > 0) pthread_cond_wait(&pool.done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    pthread_mutex_unlock(&pool.busy);
}

static long min_l(long a, long b) { return a < b ? a : b; }

/* Which of n parts a stage's unit `u` is in, given the parts' first units `first` [n + 1] (empty parts
   allowed); u becomes its index within that part. */
static long part_of(const long *first, long n, long *u) {
    long lo = 0, hi = n - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (first[mid] <= *u) lo = mid; else hi = mid - 1;
    }
    *u -= first[lo];
    return lo;
}

/* The next unit of a stage's `total` for the calling thread, or -1 when all are taken. */
static long next_unit(atomic_long *counter, long total) {
    long u = atomic_fetch_add(counter, 1);
    return u < total ? u : -1;
}

#endif
