/* sigchain.c (static runtime): a program that sets up SIGUSR1 (the dump signal) its own way
 * AFTER its first CUDA allocation, the moment memsnap takes the signal over, then sends itself
 * the signal. The test asserts both what the program saw (its handler's arguments, the old
 * action it was told) and the snapshot memsnap wrote.
 *
 * Modes (argv[1]):
 *   siginfo    sigaction with SA_SIGINFO; the handler records sig, si_code, si_pid, ctx != NULL
 *   signal     signal(); the handler records sig
 *   bsd        bsd_signal()
 *   sysv       sysv_signal(): one-shot; the second signal finds the default action, which
 *              for the dump signal means memsnap's alone: the program lives on
 *   resethand  sigaction with SA_RESETHAND: one call, then the default action is reported
 *   ignore     SIG_IGN: the program ignores it, the snapshot is still written
 *   default    an explicit SIG_DFL: the snapshot is written, the program lives on
 *   restored   a library's way (LLVM's signal handlers, installed by Triton's compiler):
 *              install a handler keeping the old action it was told, later put that old
 *              action back, then the signal arrives: the program lives on
 *   reraise    the other half of that way: the handler puts the old action back and raises
 *              the signal again: called once, the program lives on
 *   mask       sa_mask = {SIGUSR2}: inside the handler SIGUSR2 and SIGUSR1 are blocked
 *   nodefer    SA_NODEFER: inside the handler SIGUSR1 is not blocked
 *   blocked    no handler; the program blocks SIGUSR1 with sigprocmask, sends it, waits:
 *              no snapshot while blocked; one after it unblocks
 *   storm      a counting handler; 5000 signals in a tight loop while allocating
 *   flood      a counting handler; a thread of its own sends 2000 signals, one a millisecond,
 *              while the main thread allocates and frees; prints how long the flood took
 *              (flood_ms) and its own count of allocations (allocs), and exits with 3
 * Prints `result KEY=VALUE` lines. */
#include "prog_common.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#define MIB (1u << 20)

extern __sighandler_t bsd_signal(int, __sighandler_t);
extern __sighandler_t sysv_signal(int, __sighandler_t);

static volatile sig_atomic_t calls, last_sig, last_code, last_pid, had_ctx, usr2_blocked,
    usr1_blocked;

static void note_mask(void) {
    sigset_t now;
    pthread_sigmask(SIG_BLOCK, NULL, &now);
    usr2_blocked = sigismember(&now, SIGUSR2);
    usr1_blocked = sigismember(&now, SIGUSR1);
}

static void plain_handler(int sig) {
    calls++;
    last_sig = sig;
    note_mask();
}

static void info_handler(int sig, siginfo_t *info, void *ctx) {
    calls++;
    last_sig = sig;
    last_code = info ? info->si_code : -999;
    last_pid = info ? info->si_pid : -1;
    had_ctx = ctx != NULL;
    note_mask();
}

static struct sigaction library_old;

/* What a library's crash handler does: put back what was there before it, raise again. */
static void reraising_handler(int sig) {
    calls++;
    last_sig = sig;
    sigaction(SIGUSR1, &library_old, NULL);
    raise(sig);
}

static void install_library_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = reraising_handler;
    sa.sa_flags = SA_NODEFER | SA_RESETHAND | SA_ONSTACK;
    if (sigaction(SIGUSR1, &sa, &library_old) != 0) {
        perror("sigaction");
        exit(1);
    }
    printf("result old_was_default=%d\n",
           !(library_old.sa_flags & SA_SIGINFO) && library_old.sa_handler == SIG_DFL);
}


/* Waits up to 5 s for at least `n` snapshot files of the signal. */
static int wait_for_files(int n) {
    for (int waited = 0; waited < 5000; waited += 5) {
        if (count_files("-signal-") >= n) return 1;
        sleep_ms(5);
    }
    return 0;
}

static void *alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

static volatile int flood_done;

static void *flood_sender(void *arg) {
    (void)arg;
    for (int i = 0; i < 2000; i++) {
        kill(getpid(), SIGUSR1);
        sleep_ms(1);
    }
    flood_done = 1;
    return NULL;
}

static long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

static void set_action(void (*fn)(int, siginfo_t *, void *), void (*plain)(int),
                       sighandler_t disposition, int flags, int mask_usr2) {
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    if (mask_usr2) sigaddset(&sa.sa_mask, SIGUSR2);
    if (fn) {
        sa.sa_sigaction = fn;
        flags |= SA_SIGINFO;
    } else {
        sa.sa_handler = plain ? plain : disposition;
    }
    sa.sa_flags = flags;
    if (sigaction(SIGUSR1, &sa, &old) != 0) {
        perror("sigaction");
        exit(1);
    }
    printf("result old_was_default=%d\n", !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL);
}

static void report_current(void) {
    struct sigaction cur;
    sigaction(SIGUSR1, NULL, &cur);
    const char *what = "function";
    if (!(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == SIG_DFL) what = "default";
    if (!(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == SIG_IGN) what = "ignore";
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == info_handler) what = "own-siginfo";
    if (!(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == plain_handler) what = "own-plain";
    printf("result current=%s\n", what);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "siginfo";
    void *a = alloc(1 * MIB);
    printf("result pid=%d\n", (int)getpid());

    if (!strcmp(mode, "siginfo")) {
        set_action(info_handler, NULL, 0, SA_RESTART, 0);
    } else if (!strcmp(mode, "signal") || !strcmp(mode, "bsd")) {
        sighandler_t old = !strcmp(mode, "signal") ? signal(SIGUSR1, plain_handler)
                                                   : bsd_signal(SIGUSR1, plain_handler);
        printf("result old_was_default=%d\n", old == SIG_DFL);
    } else if (!strcmp(mode, "sysv")) {
        sighandler_t old = sysv_signal(SIGUSR1, plain_handler);
        printf("result old_was_default=%d\n", old == SIG_DFL);
    } else if (!strcmp(mode, "resethand")) {
        set_action(NULL, plain_handler, 0, SA_RESETHAND, 0);
    } else if (!strcmp(mode, "ignore")) {
        set_action(NULL, NULL, SIG_IGN, 0, 0);
    } else if (!strcmp(mode, "default")) {
        set_action(NULL, NULL, SIG_DFL, 0, 0);
    } else if (!strcmp(mode, "mask")) {
        set_action(NULL, plain_handler, 0, 0, 1);
    } else if (!strcmp(mode, "nodefer")) {
        set_action(NULL, plain_handler, 0, SA_NODEFER, 0);
    } else if (!strcmp(mode, "storm") || !strcmp(mode, "flood")) {
        set_action(info_handler, NULL, 0, SA_RESTART, 0);
    } else if (!strcmp(mode, "restored")) {
        install_library_handler();
        sigaction(SIGUSR1, &library_old, NULL);
    } else if (!strcmp(mode, "reraise")) {
        install_library_handler();
    } else if (strcmp(mode, "blocked") != 0) {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    report_current();
    fflush(stdout);

    if (!strcmp(mode, "blocked")) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGUSR1);
        sigprocmask(SIG_BLOCK, &set, NULL);
        kill(getpid(), SIGUSR1);
        sleep_ms(300);
        printf("result files_while_blocked=%d\n", count_files("-signal-"));
        sigprocmask(SIG_UNBLOCK, &set, NULL);
    } else if (!strcmp(mode, "storm")) {
        for (int i = 0; i < 5000; i++) {
            kill(getpid(), SIGUSR1);
            void *p = alloc((size_t)(i % 7 + 1) * 4096);
            CHECK_RT(cudaFree(p));
        }
    } else if (!strcmp(mode, "flood")) {
        long start = now_ms();
        pthread_t sender;
        pthread_create(&sender, NULL, flood_sender, NULL);
        long allocs = 0;
        while (!flood_done) {
            void *p = alloc((size_t)(allocs % 7 + 1) * 4096);
            CHECK_RT(cudaFree(p));
            allocs++;
        }
        pthread_join(sender, NULL);
        printf("result flood_ms=%ld\n", now_ms() - start);
        printf("result allocs=%ld\n", allocs);
    } else {
        kill(getpid(), SIGUSR1);
    }
    printf("result signal_file=%d\n", wait_for_files(1));
    fflush(stdout);

    if (!strcmp(mode, "sysv") || !strcmp(mode, "resethand")) {
        report_current();
        printf("result calls_before_second=%d\n", (int)calls);
        fflush(stdout);
        kill(getpid(), SIGUSR1); /* the default action now: memsnap's alone */
        printf("result second_signal_file=%d\n", wait_for_files(2));
    }
    /* A handler that ended the process would have done so inside kill(). */
    printf("result survived=1\n");

    void *b = alloc(2 * MIB);
    printf("result calls=%d\n", (int)calls);
    printf("result last_sig=%d\n", (int)last_sig);
    printf("result last_code=%d\n", (int)last_code);
    printf("result last_pid_is_self=%d\n", (int)(last_pid == getpid()));
    printf("result had_ctx=%d\n", (int)had_ctx);
    printf("result usr2_blocked=%d\n", (int)usr2_blocked);
    printf("result usr1_blocked=%d\n", (int)usr1_blocked);
    printf("result signal_files=%d\n", count_files("-signal-"));
    CHECK_RT(cudaFree(a));
    (void)b;
    return !strcmp(mode, "flood") ? 3 : 0;
}
