/* The team of one layers call (dense.h, moe_layers.h): a spin-then-sleep barrier its threads
 * meet at between phases. Included by experts.c. */
#include <sched.h>
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __SSE2__
#include <immintrin.h>
#endif

/* A sense-reversing barrier: a thread that arrives early spins a while (the partner is
 * working in this same call), then sleeps on a futex until the last one wakes it. Yielding
 * instead handed the core to a busy neighbour process for its whole slice (decode steps of
 * 13-66 ms where one thread took 11), and pure spinning burned the slice the preempted
 * partner needed (100-300 ms). */
typedef struct {
    _Atomic int count, sense, sleepers;
    int n;
} spin_barrier_t;

/* pauses, some 37 us here: longer phases than a decode step's; 10,000 (370 us) made two
 * threads' steps 137 ms beside one busy process (the spinner keeps the core its partner and
 * the neighbour share), 1,000 25 ms */
#define SPINS_BEFORE_SLEEP 1000

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only for _GNU_SOURCE */
static void sleep_while(_Atomic int *addr, int value) {
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void wake_all(_Atomic int *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static void sleep_while(_Atomic int *addr, int value) { (void)addr, (void)value, sched_yield(); }
static void wake_all(_Atomic int *addr) { (void)addr; }
#endif

static void spin_barrier(spin_barrier_t *b, int *local) {
    int s = !*local;
    *local = s;
    if (atomic_fetch_add(&b->count, 1) == b->n - 1) {
        atomic_store(&b->count, 0);
        atomic_store(&b->sense, s);
        /* seq_cst both sides: either a sleeper is counted here or it sees the new sense */
        if (atomic_load(&b->sleepers)) wake_all(&b->sense);
        return;
    }
    for (int i = 0; i < SPINS_BEFORE_SLEEP; i++) {
        if (atomic_load_explicit(&b->sense, memory_order_acquire) == s) return;
#ifdef __SSE2__
        _mm_pause();
#endif
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->sense) != s) sleep_while(&b->sense, !s);
    atomic_fetch_sub(&b->sleepers, 1);
}

