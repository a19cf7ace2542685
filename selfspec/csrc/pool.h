/* The kernels' own thread pool (csrc/pool.c): one team of worker threads for the whole
 * process, whichever thread calls a kernel.
 *
 * Why not OpenMP: libgomp keeps one pool per calling thread, and once the process holds more
 * pool threads than CPUs (torch's pool on the main thread from loading, plus a server's engine
 * thread, plus any thread a user generates from) every pool's workers stop spinning and sleep
 * between parallel regions, so each of a decode step's ~75 regions paid a futex wake-up:
 * generation from any thread but the main one ran at ~0.7x. Here the same workers serve every
 * caller and spin a while for the next region before they sleep.
 *
 *   ss_parallel(nt, fn, ctx)   fn(ctx, tid, nt) on nt threads, tid 0 the caller; returns when
 *                              all are done. Runs inline (nt = 1) when nt <= 1, when called
 *                              from inside a region, or when another thread's region holds
 *                              the team: the kernels' results never depend on nt.
 *   ss_barrier()               inside a region: wait for all its threads
 *   ss_share(n, tid, nt, ...)  thread tid's contiguous share of n items
 *   ss_next(counter, chunk)    dynamic scheduling: the next chunk's first item (>= n: done)
 */
#ifndef SELFSPEC_POOL_H
#define SELFSPEC_POOL_H

typedef void (*ss_task)(void *ctx, int tid, int nt);

int ss_threads(int requested);  /* requested <= 0: the CPUs this process may run on */
void ss_parallel(int nt, ss_task fn, void *ctx);
void ss_barrier(void);

static inline void ss_share(long n, int tid, int nt, long *lo, long *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

static inline long ss_next(long *counter, long chunk) {
    return __atomic_fetch_add(counter, chunk, __ATOMIC_RELAXED);
}

#endif
