/* load.c (static runtime): asks memsnap for a snapshot while other threads allocate at full
 * speed, and measures how long the request takes.
 * argv[1]: allocating threads (default 2); argv[2]: dump | oom | exit.
 * - dump: memsnap_dump("under_load") from the main thread; prints result dump_rc= and dump_ms=.
 * - oom: a cudaMalloc larger than the device from the main thread (memsnap writes the OOM
 *   snapshot before the call returns); prints result oom_rc= and oom_ms=.
 * - exit: prints result exit_at_ms= (CLOCK_BOOTTIME, the clock of /proc/uptime) and calls
 *   exit() while the threads still allocate; the test compares it with when the process ended.
 * - signal: sends itself the dump signal (SIGUSR1) and waits for its snapshot file in
 *   MEMSNAP_FOLDER; prints result signal_ms=.
 * - term: prints result term_at_ms= (CLOCK_BOOTTIME) and sends itself SIGTERM while the
 *   threads still allocate; the caller compares it with when the process ended.
 * - wait: prints result ready=1 and waits (the threads allocating) until a signal ends it
 *   (scripts/validate-host.sh sends the signals); an alarm ends it after 120 s.
 * The allocating threads keep 8 buffers each, freeing the oldest, sizes from 4 KiB to 1 MiB; a
 * request waits until each has allocated WARM_OPS times (and 20,000 in all). */
#include "prog_common.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define MAX_THREADS 64
#define KEEP 8

static atomic_int stop;
static atomic_llong ops;
/* Threads past their start-up (their stack, their first allocations and memsnap's per-thread
 * state are made): a request is measured against threads that allocate, not threads that
 * start. */
static atomic_int warmed;
#define WARM_OPS 64

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

NOINLINE static void *alloc_one(size_t size) {
    void *p = NULL;
    return cudaMalloc(&p, size) == cudaSuccess ? p : NULL;
}

static void *worker(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    void *live[KEEP] = {0};
    int at = 0;
    long done = 0;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        if (++done == WARM_OPS) atomic_fetch_add(&warmed, 1);
        if (live[at]) cudaFree(live[at]);
        live[at] = alloc_one(4096 + (size_t)rand_r(&seed) % (1u << 20));
        at = (at + 1) % KEEP;
        atomic_fetch_add_explicit(&ops, 1, memory_order_relaxed);
    }
    for (int i = 0; i < KEEP; i++)
        if (live[i]) cudaFree(live[i]);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const char *mode = argc > 2 ? argv[2] : "dump";
    if (threads < 1 || threads > MAX_THREADS) return 2;
    void *first = alloc_one(4096); /* recording starts before the threads do */
    pthread_t tids[MAX_THREADS];
    for (int t = 0; t < threads; t++)
        if (pthread_create(&tids[t], NULL, worker, (void *)(uintptr_t)(t + 1)) != 0) return 1;
    /* Let every thread reach full speed. */
    while (atomic_load(&warmed) < threads || atomic_load(&ops) < 20000) sched_yield();
    if (strcmp(mode, "wait") == 0) {
        alarm(120);
        printf("result ready=1\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (strcmp(mode, "exit") == 0) {
        printf("result exit_at_ms=%.3f\n", now_ms());
        fflush(stdout);
        exit(0); /* threads still allocating */
    }
    if (strcmp(mode, "term") == 0) {
        printf("result term_at_ms=%.3f\n", now_ms());
        fflush(stdout);
        kill(getpid(), SIGTERM); /* threads still allocating */
        for (;;) pause();
    }
    double t0 = now_ms();
    if (strcmp(mode, "dump") == 0) {
        typedef int (*dump_fn)(const char *);
        dump_fn dump = (dump_fn)dlsym(RTLD_DEFAULT, "memsnap_dump");
        int rc = dump ? dump("under_load") : -2;
        printf("result dump_rc=%d\n", rc);
    } else if (strcmp(mode, "signal") == 0) {
        kill(getpid(), SIGUSR1);
        while (count_files("-signal-") < 1) sleep_ms(1);
    } else if (strcmp(mode, "oom") == 0) {
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, (size_t)1 << 50);
        printf("result oom_rc=%d\n", (int)e);
    } else {
        return 2;
    }
    printf("result %s_ms=%.3f\n", mode, now_ms() - t0);
    atomic_store(&stop, 1);
    for (int t = 0; t < threads; t++) pthread_join(tids[t], NULL);
    cudaFree(first);
    printf("result ops=%lld\n", (long long)atomic_load(&ops));
    return 0;
}
