/* wait.c (static runtime): a long-running process for `memsnap dump` and MEMSNAP_PERIOD tests.
 * Unless argv[1] == "noalloc", allocates 3 MiB + 5 MiB (kept) and frees 1 MiB; then prints
 * "result ready=1" (flushed) and blocks reading stdin until end of file, so the test decides
 * when it ends (no timing). Then prints the fake driver's truth and exits 0. An alarm ends it
 * after 120 s if nobody closes stdin. "noalloc" makes no CUDA call at all: memsnap is loaded
 * but never starts (no writer thread, no signal handler). "sleep N": after the allocations
 * and the ready line, sleep(N) instead of reading stdin, then print "result slept_full=1"
 * when the sleep ran to its end (0 when a signal cut it short) and exit. */
#include "prog_common.h"

#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1u << 20)

NOINLINE void *wait_alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

int main(int argc, char **argv) {
    int noalloc = argc > 1 && strcmp(argv[1], "noalloc") == 0;
    int sleep_s = argc > 2 && strcmp(argv[1], "sleep") == 0 ? atoi(argv[2]) : -1;
    alarm(120);
    if (!noalloc) {
        void *a = wait_alloc(3 * MIB);
        void *b = wait_alloc(5 * MIB);
        void *c = wait_alloc(1 * MIB);
        CHECK_RT(cudaFree(c));
        (void)a;
        (void)b;
    }
    printf("result ready=1\n");
    fflush(stdout);
    if (sleep_s >= 0) {
        unsigned left = sleep((unsigned)sleep_s);
        printf("result slept_full=%d\n", left == 0);
        return 0;
    }
    char buf[256];
    while (read(0, buf, sizeof buf) > 0) {
    }
    printf("result expected_live_bytes=%u\n", noalloc ? 0 : 8 * MIB);
    if (!noalloc) print_truth();
    return 0;
}
