/* crash.c (static runtime): a job that ends by a signal after its allocations. The test runs
 * it with and without memsnap and compares how it ended, and reads the last snapshot.
 *
 * Modes (argv[1]), the program's handler (if any) installed AFTER the first CUDA allocation:
 *   term           SIGTERM, no handler: dies of SIGTERM
 *   term-handler   a SIGTERM handler that says so and calls _exit(7)
 *   abort          abort() in crash_here(): dies of SIGABRT
 *   abort-handler  a SIGABRT handler that says so and returns (abort then kills)
 *   segv           a null write in crash_here(): dies of SIGSEGV
 *   segv-handler   a SIGSEGV handler that says so, restores the default and returns (the
 *                  write faults again and kills), as faulthandler does
 *   bus            SIGBUS sent to itself in crash_here()
 *   double-term    5,000 more blocks kept live (a snapshot that takes a while), four idle
 *                  threads, then SIGTERM sent twice, 10 ms apart: dies of SIGTERM
 *   two-faults     as double-term, but two threads fault (null writes) at the same moment
 *   int            SIGINT (Ctrl-C), no handler: dies of SIGINT
 *   int-handler    a SIGINT handler that says so and returns: the program lives on
 *   hup            SIGHUP (the terminal closed), no handler: dies of SIGHUP
 *   hup-ignored    SIGHUP ignored, as under nohup: the program lives on
 *   quit           SIGQUIT (Ctrl-\), no handler: dies of SIGQUIT (no core: its limit is 0)
 * Prints `result KEY=VALUE` lines; the handler writes `result handler=N`. */
#include "prog_common.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#define MIB (1u << 20)
#define NOINLINE __attribute__((noinline))

static void say(const char *s) {
    ssize_t n = write(1, s, strlen(s));
    (void)n;
}

static void term_handler(int sig) {
    (void)sig;
    say("result handler=15\n");
    _exit(7);
}

static void int_handler(int sig) {
    (void)sig;
    say("result handler=2\n");
}

static void abort_handler(int sig) {
    (void)sig;
    say("result handler=6\n");
}

static void segv_handler(int sig) {
    (void)sig;
    say("result handler=11\n");
    signal(SIGSEGV, SIG_DFL);
}

static volatile int *volatile nowhere;
static pthread_barrier_t both_ready;

static void *idle_thread(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

static void *faulting_thread(void *arg) {
    (void)arg;
    pthread_barrier_wait(&both_ready);
    *nowhere = 2;
    for (;;) pause();
    return NULL;
}

/* Many live blocks: the snapshot then takes long enough for a second signal to land while
 * it is being written. */
static void many_blocks(void) {
    for (int i = 0; i < 5000; i++) {
        void *p = NULL;
        CHECK_RT(cudaMalloc(&p, 4096));
    }
}

NOINLINE void crash_here(const char *mode) {
    if (!strncmp(mode, "abort", 5)) abort();
    if (!strncmp(mode, "segv", 4)) *nowhere = 1;
    if (!strcmp(mode, "bus")) kill(getpid(), SIGBUS);
    if (!strncmp(mode, "term", 4)) kill(getpid(), SIGTERM);
    if (!strncmp(mode, "int", 3)) kill(getpid(), SIGINT);
    if (!strncmp(mode, "hup", 3)) kill(getpid(), SIGHUP);
    if (!strcmp(mode, "quit")) kill(getpid(), SIGQUIT);
    __asm__ volatile("" ::: "memory");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "segv";
    void *a = NULL, *b = NULL;
    /* A command a non-interactive shell starts in the background inherits SIGINT and SIGQUIT
     * ignored (as CI runners may start the tests): this program's default actions are its own. */
    signal(SIGINT, SIG_DFL);
    signal(SIGQUIT, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    CHECK_RT(cudaMalloc(&a, 3 * MIB));
    CHECK_RT(cudaMalloc(&b, 5 * MIB));
    CHECK_RT(cudaFree(a));
    if (!strcmp(mode, "term-handler")) signal(SIGTERM, term_handler);
    if (!strcmp(mode, "abort-handler")) signal(SIGABRT, abort_handler);
    if (!strcmp(mode, "segv-handler")) signal(SIGSEGV, segv_handler);
    if (!strcmp(mode, "int-handler")) signal(SIGINT, int_handler);
    if (!strcmp(mode, "hup-ignored")) signal(SIGHUP, SIG_IGN);
    if (!strcmp(mode, "quit")) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
    }
    int twice = !strcmp(mode, "double-term"), two_faults = !strcmp(mode, "two-faults");
    if (twice || two_faults) {
        many_blocks();
        pthread_t t;
        for (int i = 0; i < 4; i++) pthread_create(&t, NULL, idle_thread, NULL);
        pthread_barrier_init(&both_ready, NULL, 2);
        if (two_faults)
            for (int i = 0; i < 2; i++) pthread_create(&t, NULL, faulting_thread, NULL);
    }
    printf("result ready=1\n");
    fflush(stdout);
    if (twice) {
        /* Blocked here, so both land on the idle threads; the second once the first one's
         * handler runs (two signals still pending at once would merge into one). */
        sigset_t term;
        sigemptyset(&term);
        sigaddset(&term, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &term, NULL);
        kill(getpid(), SIGTERM);
        struct timespec ten_ms = {0, 10 * 1000 * 1000};
        nanosleep(&ten_ms, NULL);
        kill(getpid(), SIGTERM);
    }
    crash_here(mode);
    if (strcmp(mode, "int-handler") != 0 && strcmp(mode, "hup-ignored") != 0) sleep(5);
    printf("result survived=1\n");
    return 0;
}
