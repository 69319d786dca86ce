/* iter_leak.c (static runtime): a training loop with no step marks, for `memsnap explain`'s
 * iterations found in the record and its snapshots of one process.
 * argv[1]: "leak" or "noleak"; argv[2]: iterations (default 30); argv[3...]: iterations after
 * which the program asks for a snapshot with SIGUSR1 and waits (up to 5 s) for its file.
 * Every allocation goes through one helper, device_alloc. Before the loop: model_weights
 * (16 MiB, kept). Every iteration: load_batch 3 MiB, forward 4 MiB (plus 0 to 2 pages, the
 * size varying from one iteration to the next), 2 MiB and 512 KiB, backward 2 MiB, all freed
 * within the iteration; leak: keep_batch keeps 1 MiB more.
 * Prints result helper_line=, keep_line=, weights_line=, iterations=, signal_files=, and the
 * truth. */
#include "prog_common.h"

#include <signal.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
/* After a call: no tail call, so the caller keeps its own frame in the stack. */
#define STAY(p) __asm__ volatile("" : : "r"(p) : "memory")
#define MIB (1ull << 20)
#define MAX_ITERATIONS 1000

static int helper_line, keep_line, weights_line;

NOINLINE static void *device_alloc(unsigned long long bytes) {
    void *p = NULL;
    helper_line = __LINE__ + 1;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

NOINLINE void *model_weights(void) {
    weights_line = __LINE__ + 1;
    void *p = device_alloc(16 * MIB);
    STAY(p);
    return p;
}

NOINLINE void *load_batch(void) {
    void *p = device_alloc(3 * MIB);
    STAY(p);
    return p;
}

NOINLINE void forward(void **out, int k) {
    out[0] = device_alloc(4 * MIB + (unsigned long long)(k % 3) * 4096);
    out[1] = device_alloc(2 * MIB);
    out[2] = device_alloc(MIB / 2);
    STAY(out[2]);
}

NOINLINE void *backward(void) {
    void *p = device_alloc(2 * MIB);
    STAY(p);
    return p;
}

NOINLINE void *keep_batch(void) {
    keep_line = __LINE__ + 1;
    void *p = device_alloc(MIB);
    STAY(p);
    return p;
}

/* Asks for a snapshot and waits until the `want`th signal file is there. */
static int dump_and_wait(int want) {
    kill(getpid(), SIGUSR1);
    for (int waited = 0; count_files("signal") < want && waited < 5000; waited += 10)
        sleep_ms(10);
    return count_files("signal");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "leak";
    int iterations = argc > 2 ? atoi(argv[2]) : 30;
    if (iterations < 1 || iterations > MAX_ITERATIONS) {
        fprintf(stderr, "iter_leak: 1..%d iterations\n", MAX_ITERATIONS);
        return 2;
    }
    int leak = strcmp(mode, "leak") == 0;
    if (!leak && strcmp(mode, "noleak") != 0) {
        fprintf(stderr, "iter_leak: leak or noleak\n");
        return 2;
    }
    void *weights = model_weights();
    int dumps = 0, files = 0;
    for (int k = 1; k <= iterations; k++) {
        void *batch = load_batch();
        void *act[3];
        forward(act, k);
        void *grad = backward();
        if (leak) (void)keep_batch();
        CHECK_RT(cudaFree(grad));
        for (int i = 2; i >= 0; i--) CHECK_RT(cudaFree(act[i]));
        CHECK_RT(cudaFree(batch));
        for (int a = 3; a < argc; a++)
            if (atoi(argv[a]) == k) files = dump_and_wait(++dumps);
    }
    (void)weights;
    printf("result helper_line=%d\n", helper_line);
    printf("result keep_line=%d\n", keep_line);
    printf("result weights_line=%d\n", weights_line);
    printf("result iterations=%d\n", iterations);
    printf("result signal_files=%d\n", files);
    print_truth();
    return 0;
}
