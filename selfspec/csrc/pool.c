/* The kernels' thread pool (see pool.h for the interface and why it exists).
 *
 * One team: workers 1..n-1 wait for a region by watching `gen` (a counter the caller bumps
 * after publishing fn, ctx and nt): they spin with pause for SPIN_NS, then sleep on a futex
 * on `gen`, so between the back-to-back regions of a decode step nobody sleeps, and an idle
 * process costs nothing after a few milliseconds. A region's threads are tid 0 (the caller)
 * and workers 1..nt-1; the caller waits for `pending` to reach 0 before it returns, so a
 * region's stack context outlives every use of it. One region at a time: `busy` is taken by
 * the caller for the region's duration; a second caller meanwhile runs its region inline
 * (nt = 1) rather than wait or oversubscribe. Linux (futex), x86-64 (pause). */
#define _GNU_SOURCE
#include "pool.h"
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
#define SPIN_NS 3000000L  /* how long an idle worker spins before it sleeps */

typedef struct { _Alignas(64) volatile int v; } line_int;  /* one per cache line: no false sharing */

static struct {
    line_int gen;       /* futex word: bumped once per region */
    line_int pending;   /* workers still running the current region */
    line_int sleepers;  /* workers asleep (or about to be) on gen */
    line_int busy;      /* a caller holds the team */
    line_int bar_count, bar_phase;
    ss_task fn;
    void *ctx;
    int nt;
    int nworkers;
} P;

static int start_gen[MAX_WORKERS + 1];  /* gen when worker i was made: regions after it are its own */
static __thread int tl_nt;  /* inside a region: its thread count (1 inline); 0 outside */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void futex_wait(volatile int *addr, int seen) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake_all(volatile int *addr) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    int seen = start_gen[id];  /* not gen now: the region that made this worker may have begun */
    for (;;) {
        int g;
        long t0 = now_ns();
        unsigned spins = 0;
        while ((g = __atomic_load_n(&P.gen.v, __ATOMIC_ACQUIRE)) == seen) {
            _mm_pause();
            if ((++spins & 1023) == 0 && now_ns() - t0 > SPIN_NS) {
                /* Dekker with ss_parallel: it bumps gen then reads sleepers; we raise sleepers,
                 * then the kernel compares gen with seen, so one of the two sees the other */
                __atomic_add_fetch(&P.sleepers.v, 1, __ATOMIC_SEQ_CST);
                futex_wait(&P.gen.v, seen);
                __atomic_sub_fetch(&P.sleepers.v, 1, __ATOMIC_SEQ_CST);
                t0 = now_ns();
            }
        }
        seen = g;
        const int nt = P.nt;  /* published before gen (release/acquire) */
        if (id < nt) {
            tl_nt = nt;
            P.fn(P.ctx, id, nt);
            tl_nt = 0;
            __atomic_sub_fetch(&P.pending.v, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void reset_after_fork(void) {  /* the child has none of the parent's workers */
    P.gen.v = P.pending.v = P.sleepers.v = P.busy.v = P.bar_count.v = P.bar_phase.v = 0;
    P.nworkers = 0;
}

static int ensure_workers(int n) {  /* called holding the team; returns how many exist */
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork_done = 1;
    }
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    while (P.nworkers < n) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[P.nworkers + 1] = P.gen.v;
        int rc = pthread_create(&th, &attr, worker, (void *)(intptr_t)(P.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        P.nworkers++;
    }
    return P.nworkers;
}

int ss_threads(int requested) {
    if (requested > 0) return requested;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void run_inline(ss_task fn, void *ctx) {
    int outer = tl_nt;
    tl_nt = 1;
    fn(ctx, 0, 1);
    tl_nt = outer;
}

void ss_parallel(int nt, ss_task fn, void *ctx) {
    int idle = 0;
    if (nt <= 1 || tl_nt != 0 || !__atomic_compare_exchange_n(&P.busy.v, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        run_inline(fn, ctx);
        return;
    }
    int have = ensure_workers(nt - 1);
    if (nt > have + 1) nt = have + 1;
    if (nt <= 1) {
        __atomic_store_n(&P.busy.v, 0, __ATOMIC_RELEASE);
        run_inline(fn, ctx);
        return;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.nt = nt;
    P.bar_count.v = 0;
    __atomic_store_n(&P.pending.v, nt - 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&P.gen.v, 1, __ATOMIC_SEQ_CST);  /* publishes the above */
    if (__atomic_load_n(&P.sleepers.v, __ATOMIC_SEQ_CST) > 0) futex_wake_all(&P.gen.v);
    tl_nt = nt;
    fn(ctx, 0, nt);
    tl_nt = 0;
    while (__atomic_load_n(&P.pending.v, __ATOMIC_ACQUIRE) > 0) _mm_pause();
    __atomic_store_n(&P.busy.v, 0, __ATOMIC_RELEASE);
}

void ss_barrier(void) {
    const int nt = tl_nt;
    if (nt <= 1) return;
    const int phase = __atomic_load_n(&P.bar_phase.v, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&P.bar_count.v, 1, __ATOMIC_ACQ_REL) == nt) {
        __atomic_store_n(&P.bar_count.v, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&P.bar_phase.v, 1, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&P.bar_phase.v, __ATOMIC_ACQUIRE) == phase) _mm_pause();
    }
}
