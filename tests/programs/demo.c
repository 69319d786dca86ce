/* demo.c (static runtime): a tiny "training loop" to show memsnap at work.
 * 5 steps; step 0 allocates the weights (2 x 8 MiB); every step allocates activations
 * (4 MiB + 6 MiB + 1 MiB) and frees them at the end of the step, and "leaks" one 256 KiB
 * buffer that is kept forever. memsnap_step() is called at the end of each step when an
 * interposer provides it. At the end: 16 MiB of weights + 5 x 256 KiB leaked (7 allocations). */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define MIB (1u << 20)
#define STEPS 5

static void *weights[2];
static void *leaked[STEPS];

NOINLINE void init_weights(void) {
    for (int i = 0; i < 2; i++) CHECK_RT(cudaMalloc(&weights[i], 8 * MIB));
}

NOINLINE void *alloc_activation(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

/* The bug this demo is about: a per-step cache entry that nobody frees. */
NOINLINE void *leaky_cache_entry(void) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, 256u << 10));
    return p;
}

NOINLINE void train_step(int step) {
    if (step == 0) init_weights();
    void *acts[3] = {alloc_activation(4 * MIB), alloc_activation(6 * MIB), alloc_activation(MIB)};
    leaked[step] = leaky_cache_entry();
    CHECK_RT(cudaDeviceSynchronize());
    for (int i = 0; i < 3; i++) CHECK_RT(cudaFree(acts[i]));
}

int main(void) {
    printf("demo: a %d-step training loop on a (fake) GPU\n", STEPS);
    printf("demo: step 0 allocates 2 x 8 MiB of weights\n");
    printf("demo: each step allocates 4 + 6 + 1 MiB of activations and frees them\n");
    printf("demo: each step also leaks 256 KiB in leaky_cache_entry()\n");
    for (int step = 0; step < STEPS; step++) {
        train_step(step);
        step_marker();
        printf("demo: step %d done\n", step);
    }
    printf("demo: done; %d x 256 KiB leaked, weights still live\n", STEPS);
    printf("result expected_live_bytes=%u\n", 16 * MIB + STEPS * (256u << 10));
    printf("result expected_live_count=%d\n", 2 + STEPS);
    print_truth();
    return 0;
}
