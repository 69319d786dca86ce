/* fork.c (static runtime): a parent that forks a short-lived child, like a DataLoader worker.
 * Default mode: the parent allocates 4 x 1 MiB, forks; the child allocates 3 x 512 KiB, frees one
 * and _exit(0)s; the parent waits, allocates 2 x 2 MiB, frees one of them.
 * argv[1] == "early": the fork happens before the parent's first CUDA call (the child is then
 * the first to touch CUDA) and the parent's 4 x 1 MiB come after the wait.
 * Parent at the end: 5 allocations, 6 MiB. The child reports what it saw (result child_*). */
#include "prog_common.h"

#include <sys/wait.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1u << 20)

NOINLINE void *parent_alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

NOINLINE void *child_alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

NOINLINE void run_child(int early) {
    void *a = child_alloc(MIB / 2);
    void *b = child_alloc(MIB / 2);
    void *c = child_alloc(MIB / 2);
    CHECK_RT(cudaFree(b));
    (void)a;
    (void)c;
    unsigned long long expected = (early ? 0ull : 4ull * MIB) + MIB;
    printf("result child_pid=%d\n", (int)getpid());
    printf("result child_expected_live_bytes=%llu\n", expected);
    printf("result child_live_bytes=%llu\n", fake_live_bytes(0));
    fflush(stdout);
    _exit(0);
}

static void parent_first_four(void *out[4]) {
    for (int i = 0; i < 4; i++) out[i] = parent_alloc(MIB);
}

int main(int argc, char **argv) {
    int early = argc > 1 && strcmp(argv[1], "early") == 0;
    void *first[4] = {0};
    if (!early) parent_first_four(first);

    fflush(stdout); /* nothing buffered may be written twice */
    pid_t child = fork();
    if (child < 0) {
        perror("fork");
        return 1;
    }
    if (child == 0) run_child(early);

    int status = 0;
    if (waitpid(child, &status, 0) != child) {
        perror("waitpid");
        return 1;
    }
    if (early) parent_first_four(first);
    void *more1 = parent_alloc(2 * MIB);
    void *more2 = parent_alloc(2 * MIB);
    CHECK_RT(cudaFree(more1));
    (void)more2;

    printf("result mode=%s\n", early ? "early" : "late");
    printf("result child_exit_ok=%d\n", WIFEXITED(status) && WEXITSTATUS(status) == 0);
    printf("result parent_pid=%d\n", (int)getpid());
    printf("result expected_live_bytes=%u\n", 6 * MIB);
    printf("result expected_live_count=5\n");
    print_truth();
    return 0;
}
