/* signal.c (static runtime): asks for a snapshot with SIGUSR1 in the middle of a run.
 * Allocates, sends itself SIGUSR1, polls up to 5 s (FAKE_SIGNAL_WAIT_MS overrides) for a file
 * with "signal" in its name in $MEMSNAP_FOLDER, prints result signal_file=1/0, allocates more.
 * Without a SIGUSR1 handler in the kernel at that point (no interposer) the signal would kill
 * the process, so it is then not sent: result sigusr1_handled=0. The kernel's view
 * (/proc/self/status, SigCgt) is asked, not sigaction(): an interposer reports the program's
 * own action there.
 * argv[1] == "own-handler": installs its own handler with sigaction BEFORE the first CUDA call;
 *   an interposer must chain to it (result own_handler_calls=1).
 * argv[1] == "late-handler": installs its handler AFTER the first CUDA call, when an
 *   interposer has its own in place; the interposer must keep both working. */
#include "prog_common.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1u << 20)

static volatile sig_atomic_t own_handler_calls;

static void own_handler(int sig) {
    (void)sig;
    own_handler_calls++;
}

static void install_own_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = own_handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGUSR1, &sa, NULL) != 0) {
        perror("sigaction");
        exit(1);
    }
}

NOINLINE void *signal_alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

static int sigusr1_has_handler(void) {
    FILE *status = fopen("/proc/self/status", "r");
    if (!status) return 0;
    char line[256];
    unsigned long long caught = 0;
    while (fgets(line, sizeof line, status))
        if (sscanf(line, "SigCgt: %llx", &caught) == 1) break;
    fclose(status);
    return (caught >> (SIGUSR1 - 1)) & 1;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "plain";
    int own = strcmp(mode, "own-handler") == 0;
    int late = strcmp(mode, "late-handler") == 0;
    if (own) install_own_handler();

    void *a = signal_alloc(1 * MIB);
    void *b = signal_alloc(2 * MIB);
    if (late) install_own_handler();

    int handled = sigusr1_has_handler();
    printf("result sigusr1_handled=%d\n", handled);
    int found = 0;
    if (handled) {
        kill(getpid(), SIGUSR1);
        const char *wait_env = getenv("FAKE_SIGNAL_WAIT_MS");
        long wait_ms = wait_env ? atol(wait_env) : 5000;
        for (long waited = 0; !(found = folder_has_file("signal")) && waited < wait_ms; waited += 10) {
            struct timespec ten_ms = {0, 10 * 1000 * 1000};
            nanosleep(&ten_ms, NULL);
        }
    }
    printf("result signal_file=%d\n", found);

    void *c = signal_alloc(4 * MIB);
    CHECK_RT(cudaFree(a));
    (void)b;
    (void)c;
    printf("result mode=%s\n", mode);
    printf("result own_handler_calls=%d\n", (int)own_handler_calls);
    printf("result expected_live_bytes=%u\n", 6 * MIB);
    printf("result expected_live_count=2\n");
    print_truth();
    return 0;
}
