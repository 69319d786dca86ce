/* steps.c (static runtime): a training loop that marks its steps with memsnap_step().
 * argv[1]: number of steps (default 6). argv[2] == "dumps": also calls memsnap_dump("before")
 * after step 1 and memsnap_dump("after") after the last step (printing result before_rc=,
 * after_rc=; -2 when the symbol is absent).
 * Step k (1-based): allocates keep_k = k MiB + 4 KiB (kept two steps, freed during step k+2)
 * and a temporary temp_k = k * 64 KiB + 512 (freed within the step); sizes are unique per step
 * so a snapshot's history shows which steps it covers. Order within step k: alloc keep_k,
 * alloc temp_k, free temp_k, free keep_{k-2}; then step_marker().
 * Prints, per step, the program's own count of live bytes and the peak within the step
 * (result stepK_live_bytes=, stepK_peak_bytes=), the fake driver's count
 * (result stepK_driver_live_bytes=), and each size (result stepK_keep=, stepK_temp=). */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)
#define MAX_STEPS 64

static void *keep[MAX_STEPS + 1];
static unsigned long long keep_size[MAX_STEPS + 1];

NOINLINE void *steps_alloc(unsigned long long bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

typedef int (*dump_fn)(const char *);

static int maybe_dump(const char *tag) {
    dump_fn dump = (dump_fn)dlsym(RTLD_DEFAULT, "memsnap_dump");
    return dump ? dump(tag) : -2;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 6;
    int dumps = argc > 2 && strcmp(argv[2], "dumps") == 0;
    if (steps < 1 || steps > MAX_STEPS) {
        fprintf(stderr, "steps: 1..%d steps\n", MAX_STEPS);
        return 2;
    }
    unsigned long long live = 0;
    for (int k = 1; k <= steps; k++) {
        unsigned long long peak = live;
        keep_size[k] = (unsigned long long)k * MIB + 4096;
        unsigned long long temp_size = (unsigned long long)k * 65536 + 512;
        keep[k] = steps_alloc(keep_size[k]);
        live += keep_size[k];
        void *temp = steps_alloc(temp_size);
        live += temp_size;
        if (live > peak) peak = live;
        CHECK_RT(cudaFree(temp));
        live -= temp_size;
        if (k >= 3) {
            CHECK_RT(cudaFree(keep[k - 2]));
            live -= keep_size[k - 2];
            keep[k - 2] = NULL;
        }
        CHECK_RT(cudaDeviceSynchronize());
        step_marker();
        printf("result step%d_keep=%llu\n", k, keep_size[k]);
        printf("result step%d_temp=%llu\n", k, temp_size);
        printf("result step%d_live_bytes=%llu\n", k, live);
        printf("result step%d_peak_bytes=%llu\n", k, peak);
        printf("result step%d_driver_live_bytes=%llu\n", k, fake_live_bytes(0));
        if (dumps && k == 1) printf("result before_rc=%d\n", maybe_dump("before"));
    }
    if (dumps) printf("result after_rc=%d\n", maybe_dump("after"));
    printf("result steps=%d\n", steps);
    printf("result expected_live_bytes=%llu\n", live);
    print_truth();
    return 0;
}
