/* explain_steps.c (static runtime): a training loop for `memsnap explain`'s leak rules.
 * argv[1]: "leak", "noleak" or "warmup"; argv[2]: number of steps (default 25).
 * Before the loop: model_weights (16 MiB, kept). Every step: forward_temp (4 MiB) and
 * backward_temp (2 MiB), both freed within the step; then memsnap_step().
 * leak: leak_keep keeps 1 MiB more every step. warmup: warm_cache keeps 4 MiB more in each
 * of the first 3 steps, then nothing. Prints result leak_line= and warm_line= (the source
 * lines of the kept allocations), steps=, and the truth. */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)
#define MAX_STEPS 256

static int leak_line, warm_line;

NOINLINE static void *alloc_or_die(unsigned long long bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

NOINLINE void *model_weights(void) { return alloc_or_die(16 * MIB); }

NOINLINE void forward_temp(void) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, 4 * MIB));
    CHECK_RT(cudaFree(p));
}

NOINLINE void backward_temp(void) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, 2 * MIB));
    CHECK_RT(cudaFree(p));
}

NOINLINE void *leak_keep(void) {
    void *p = NULL;
    leak_line = __LINE__ + 1;
    CHECK_RT(cudaMalloc(&p, MIB));
    return p;
}

NOINLINE void *warm_cache(void) {
    void *p = NULL;
    warm_line = __LINE__ + 1;
    CHECK_RT(cudaMalloc(&p, 4 * MIB));
    return p;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "leak";
    int steps = argc > 2 ? atoi(argv[2]) : 25;
    if (steps < 1 || steps > MAX_STEPS) {
        fprintf(stderr, "explain_steps: 1..%d steps\n", MAX_STEPS);
        return 2;
    }
    int leak = strcmp(mode, "leak") == 0, warmup = strcmp(mode, "warmup") == 0;
    if (!leak && !warmup && strcmp(mode, "noleak") != 0) {
        fprintf(stderr, "explain_steps: leak, noleak or warmup\n");
        return 2;
    }
    void *weights = model_weights();
    for (int k = 1; k <= steps; k++) {
        forward_temp();
        backward_temp();
        if (leak) (void)leak_keep();
        if (warmup && k <= 3) (void)warm_cache();
        CHECK_RT(cudaDeviceSynchronize());
        step_marker();
    }
    (void)weights;
    printf("result leak_line=%d\n", leak_line);
    printf("result warm_line=%d\n", warm_line);
    printf("result steps=%d\n", steps);
    print_truth();
    return 0;
}
