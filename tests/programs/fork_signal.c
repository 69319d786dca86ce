/* fork_signal.c (static runtime): children forked from a recording parent end by a signal,
 * like DataLoader workers or multiprocessing.Pool workers stopped with terminate().
 * The parent allocates 1 MiB (recording starts), then forks argv[2] children (default 1,
 * at most 16), each doing argv[1]:
 *   term          waits in pause(); the parent sends it SIGTERM
 *   segv          a null write
 *   abort         abort()
 *   record-term   allocates 2 MiB first (the child records), then as term
 *   record-segv   allocates 2 MiB first, then as segv
 * Each child tells the parent it is ready through a pipe (after its allocation). The parent
 * then signals (term modes) every child at once and waits for all of them, and prints:
 *   result died_ms=MS        from the first signal (or the ready byte) to the last waitpid
 *   result child_signal=N    the signal that ended the last child (0: exited)
 *   result child_pids=P,P,...  */
#include "prog_common.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1u << 20)
#define NOINLINE __attribute__((noinline))
#define MAX_CHILDREN 16

static volatile int *volatile nowhere;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

NOINLINE void *fork_signal_alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

NOINLINE void child_crash_here(const char *mode) {
    if (strstr(mode, "segv")) *nowhere = 1;
    if (strstr(mode, "abort")) abort();
    for (;;) pause();
}

static void run_child(const char *mode, int ready_fd) {
    if (!strncmp(mode, "record-", 7)) fork_signal_alloc(2 * MIB);
    char one = 1;
    if (write(ready_fd, &one, 1) != 1) _exit(3);
    close(ready_fd);
    child_crash_here(mode);
    _exit(4);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "term";
    int children = argc > 2 ? atoi(argv[2]) : 1;
    if (children < 1 || children > MAX_CHILDREN) return 2;
    alarm(60);
    fork_signal_alloc(MIB);

    int ready[2];
    if (pipe(ready) != 0) return 1;
    pid_t pids[MAX_CHILDREN];
    fflush(stdout);
    for (int i = 0; i < children; i++) {
        pids[i] = fork();
        if (pids[i] < 0) return 1;
        if (pids[i] == 0) {
            close(ready[0]);
            run_child(mode, ready[1]);
        }
    }
    close(ready[1]);
    for (int i = 0; i < children; i++) {
        char byte;
        if (read(ready[0], &byte, 1) != 1) return 1;
    }
    double start = now_ms();
    if (strstr(mode, "term"))
        for (int i = 0; i < children; i++) kill(pids[i], SIGTERM);
    int status = 0;
    for (int i = 0; i < children; i++)
        if (waitpid(pids[i], &status, 0) != pids[i]) return 1;
    double died = now_ms() - start;
    printf("result died_ms=%.1f\n", died);
    printf("result child_signal=%d\n", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    printf("result child_pids=");
    for (int i = 0; i < children; i++) printf("%s%d", i ? "," : "", (int)pids[i]);
    printf("\n");
    return 0;
}
