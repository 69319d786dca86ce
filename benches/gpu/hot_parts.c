/* hot_parts.c: what each piece a recording hook may use costs on this machine, in ns per
 * call, so that the hot path spends its budget where it is cheap (docs/HOT-PATH.md,
 * "Where the nanoseconds go").
 *
 *   cc -O2 -o hot_parts benches/gpu/hot_parts.c -ldl -lpthread && ./hot_parts [rounds=7]
 *
 * Pieces: the wall clock through the vDSO (CLOCK_REALTIME, CLOCK_MONOTONIC, the coarse
 * clock), the time-stamp counter (rdtsc), the driver's cuCtxGetDevice and cuCtxGetCurrent
 * with a current primary context (libcuda.so.1, opened with dlopen; skipped without one),
 * an uncontended atomic add, and a 64-byte store into a ring that another thread reads
 * (the queue's cache-line traffic, with the reader polling all the time and with the
 * reader reading in bursts). Each piece runs 1,000,000 times per round; the line gives the
 * median and the range over the rounds. Also printed: the kernel's clock source and
 * whether the processor says its TSC is invariant (constant_tsc, nonstop_tsc).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <x86intrin.h>

#define N 1000000
#define MAX_ROUNDS 31

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void report(const char *what, double *v, int rounds) {
    qsort(v, rounds, sizeof v[0], cmp);
    printf("| %s | %.1f | %.1f–%.1f |\n", what, v[rounds / 2], v[0], v[rounds - 1]);
}

static volatile uint64_t sink;

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_get_dev_fn)(int *, int);
typedef int (*cu_primary_fn)(void **, int);
typedef int (*cu_set_fn)(void *);
typedef int (*cu_ctx_dev_fn)(int *);
typedef int (*cu_ctx_cur_fn)(void **);

/* The ring: 4096 slots of 64 bytes, a writer (this thread) and a reader thread. */
#define SLOTS 4096
struct slot {
    _Alignas(64) _Atomic uint64_t seq;
    uint64_t words[7];
};
static struct slot ring[SLOTS];
static _Atomic uint64_t stop_reader;
static _Atomic int reader_bursts; /* 0: poll all the time; 1: sleep 200 us between reads */

static void *reader(void *arg) {
    (void)arg;
    uint64_t next = 1, got = 0;
    while (!atomic_load_explicit(&stop_reader, memory_order_relaxed)) {
        struct slot *s = &ring[(next - 1) % SLOTS];
        if (atomic_load_explicit(&s->seq, memory_order_acquire) >= next) {
            got += s->words[0];
            next++;
        } else if (atomic_load_explicit(&reader_bursts, memory_order_relaxed)) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, 0);
        }
    }
    sink = got;
    return 0;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 7;
    double v[MAX_ROUNDS];
    char line[256] = "?";
    FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (f) {
        if (fgets(line, sizeof line, f)) line[strcspn(line, "\n")] = 0;
        fclose(f);
    }
    int constant = 0, nonstop = 0;
    FILE *c = fopen("/proc/cpuinfo", "r");
    static char buf[1 << 16];
    if (c) {
        while (fgets(buf, sizeof buf, c)) {
            if (strncmp(buf, "flags", 5) == 0) {
                constant = strstr(buf, " constant_tsc") != 0;
                nonstop = strstr(buf, " nonstop_tsc") != 0;
                break;
            }
        }
        fclose(c);
    }
    printf("clock source: %s; constant_tsc %d, nonstop_tsc %d\n\n", line, constant, nonstop);
    printf("| piece | ns per call, median | range over %d rounds |\n|---|---|---|\n", rounds);

#define TIME(label, body)                                                                  \
    do {                                                                                   \
        for (int r = 0; r < rounds; r++) {                                                 \
            double t0 = now_ns();                                                          \
            for (int i = 0; i < N; i++) { body; }                                          \
            v[r] = (now_ns() - t0) / N;                                                    \
        }                                                                                  \
        report(label, v, rounds);                                                          \
    } while (0)

    struct timespec ts;
    TIME("clock_gettime(CLOCK_REALTIME)", clock_gettime(CLOCK_REALTIME, &ts); sink += ts.tv_nsec);
    TIME("clock_gettime(CLOCK_MONOTONIC)", clock_gettime(CLOCK_MONOTONIC, &ts); sink += ts.tv_nsec);
    TIME("clock_gettime(CLOCK_REALTIME_COARSE)", clock_gettime(CLOCK_REALTIME_COARSE, &ts); sink += ts.tv_nsec);
    TIME("rdtsc", sink += __rdtsc());
    unsigned aux;
    TIME("rdtscp", sink += __rdtscp(&aux));
    static _Atomic uint64_t counter;
    TIME("atomic add (uncontended)", atomic_fetch_add_explicit(&counter, 1, memory_order_relaxed));
    TIME("empty loop", sink += i);

    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda) {
        cu_init_fn init = (cu_init_fn)dlsym(cuda, "cuInit");
        cu_get_dev_fn get_dev = (cu_get_dev_fn)dlsym(cuda, "cuDeviceGet");
        cu_primary_fn retain = (cu_primary_fn)dlsym(cuda, "cuDevicePrimaryCtxRetain");
        cu_set_fn set = (cu_set_fn)dlsym(cuda, "cuCtxSetCurrent");
        cu_ctx_dev_fn ctx_dev = (cu_ctx_dev_fn)dlsym(cuda, "cuCtxGetDevice");
        cu_ctx_cur_fn ctx_cur = (cu_ctx_cur_fn)dlsym(cuda, "cuCtxGetCurrent");
        int dev = 0;
        void *ctx = 0;
        if (init && get_dev && retain && set && ctx_dev && ctx_cur && init(0) == 0 &&
            get_dev(&dev, 0) == 0 && retain(&ctx, dev) == 0 && set(ctx) == 0) {
            int d;
            void *cur;
            TIME("cuCtxGetDevice", ctx_dev(&d); sink += d);
            TIME("cuCtxGetCurrent", ctx_cur(&cur); sink += (uintptr_t)cur);
        } else {
            printf("| cuCtxGetDevice | no context | |\n");
        }
    } else {
        printf("| cuCtxGetDevice | no libcuda.so.1 | |\n");
    }

    for (int bursts = 0; bursts < 2; bursts++) {
        atomic_store(&reader_bursts, bursts);
        atomic_store(&stop_reader, 0);
        memset(ring, 0, sizeof ring);
        pthread_t t;
        pthread_create(&t, 0, reader, 0);
        uint64_t seq = 0;
        const char *label = bursts ? "64-byte store into a ring read in bursts (200 us sleeps)"
                                   : "64-byte store into a ring read all the time";
        /* The writer does not wait for the reader (a slot it has not read yet is
         * overwritten): the figure is the stores' cost with a reader pulling the lines. */
        for (int r = 0; r < rounds; r++) {
            double t0 = now_ns();
            for (int i = 0; i < N; i++) {
                seq++;
                struct slot *s = &ring[(seq - 1) % SLOTS];
                s->words[0] = 1;
                s->words[1] = seq;
                s->words[2] = seq;
                s->words[3] = seq;
                s->words[4] = seq;
                s->words[5] = seq;
                s->words[6] = seq;
                atomic_store_explicit(&s->seq, seq, memory_order_release);
            }
            v[r] = (now_ns() - t0) / N;
        }
        atomic_store(&stop_reader, 1);
        pthread_join(t, 0);
        report(label, v, rounds);
    }
    return 0;
}
