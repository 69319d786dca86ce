/* explain_oom.c (static runtime; run with FAKE_CUDA_CAPACITY=64M): one site holds most of
 * the memory when an allocation fails, for `memsnap explain`'s OOM verdict.
 * hold_big keeps 3 x 12 MiB, hold_small 2 x 1 MiB; then ask_more asks for 32 MiB
 * (argv[1] == "oom", the default: it fails, 64 - 38 < 32) or 8 MiB ("fit": it succeeds).
 * Prints result big_line= (the source line of hold_big's allocation), ask_rc=, and the truth. */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)

static int big_line;

NOINLINE void *hold_big(void) {
    void *p = NULL;
    big_line = __LINE__ + 1;
    CHECK_RT(cudaMalloc(&p, 12 * MIB));
    return p;
}

NOINLINE void *hold_small(void) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, MIB));
    return p;
}

NOINLINE cudaError_t ask_more(unsigned long long bytes) {
    void *p = NULL;
    return cudaMalloc(&p, bytes);
}

int main(int argc, char **argv) {
    int fit = argc > 1 && strcmp(argv[1], "fit") == 0;
    for (int i = 0; i < 3; i++) (void)hold_big();
    for (int i = 0; i < 2; i++) (void)hold_small();
    cudaError_t rc = ask_more(fit ? 8 * MIB : 32 * MIB);
    printf("result big_line=%d\n", big_line);
    printf("result ask_rc=%d\n", rc);
    print_truth();
    return 0;
}
