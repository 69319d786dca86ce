/* handoff.c (static runtime): two threads hand one address back and forth, argv[1] rounds
 * (default 20000). Thread A frees its block and lets thread B go; B allocates the same size,
 * which the fake driver (first fit) places at the address A just freed, frees it and lets A
 * go; A allocates it again. Each free is recorded before the real free and each allocation
 * after the real one, each on its own thread: a record that puts one thread's allocation
 * before the other thread's free of the same address is out of order. B makes its first call
 * before A, so that where threads have event lanes of their own, B's is the first.
 *
 * Prints the rounds, how many of B's allocations got the address A had just freed, failures
 * and the driver's call counts ("result" lines), then the truth. */
#include "prog_common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define SIZE (1u << 20)
static int ROUNDS = 20000;
/* Whose turn it is: 0 thread A, 1 thread B, 2 done. */
static atomic_int turn = 1;
static void *handed;
static int same_address, failed;

static void wait_for(int who) {
    while (atomic_load_explicit(&turn, memory_order_acquire) != who) sched_yield();
}

static void *thread_b(void *arg) {
    (void)arg;
    /* B's first call, before A's: its lane is claimed first. */
    void *p = NULL;
    if (cudaMalloc(&p, SIZE) != cudaSuccess || cudaFree(p) != cudaSuccess) failed = 1;
    atomic_store_explicit(&turn, 0, memory_order_release);
    for (;;) {
        wait_for(1);
        if (handed == NULL) break;
        void *q = NULL;
        if (cudaMalloc(&q, SIZE) != cudaSuccess) failed = 1;
        same_address += q == handed;
        if (cudaFree(q) != cudaSuccess) failed = 1;
        atomic_store_explicit(&turn, 0, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) ROUNDS = atoi(argv[1]);
    if (ROUNDS < 1) {
        fprintf(stderr, "usage: handoff [ROUNDS]\n");
        return 2;
    }
    pthread_t b;
    if (pthread_create(&b, NULL, thread_b, NULL) != 0) return 1;
    wait_for(0);
    for (int r = 0; r < ROUNDS; r++) {
        void *p = NULL;
        if (cudaMalloc(&p, SIZE) != cudaSuccess) failed = 1;
        handed = p;
        if (cudaFree(p) != cudaSuccess) failed = 1;
        atomic_store_explicit(&turn, 1, memory_order_release);
        wait_for(0);
    }
    handed = NULL;
    atomic_store_explicit(&turn, 1, memory_order_release);
    pthread_join(b, NULL);
    printf("result rounds=%d\n", ROUNDS);
    printf("result same_address=%d\n", same_address);
    printf("result failed=%d\n", failed);
    printf("result cuMemAlloc_v2_calls=%llu\n", fake_calls("cuMemAlloc_v2"));
    printf("result cuMemFree_v2_calls=%llu\n", fake_calls("cuMemFree_v2"));
    print_truth();
    return failed;
}
