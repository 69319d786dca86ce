/* sigaction_log.c: a preloaded shim that logs every sigaction(), signal() (and its family),
 * raise() and kill()
 * call on SIGUSR1 (the dump signal) with the library that made it, the action it sets and
 * its one-shot and stack flags, then passes the call on.
 * Preloaded before libmemsnap.so by scripts/gpu/signals.py's torch.compile case, to show
 * which library changes SIGUSR1 during a cold compile and what it puts there.
 *
 *   cc -O2 -shared -fPIC -o sigaction_log.so sigaction_log.c -ldl
 *   LD_PRELOAD=sigaction_log.so:libmemsnap.so python train.py   (log on stderr) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

static const char *library_of(const void *address) {
    Dl_info info;
    if (address && dladdr(address, &info) && info.dli_fname) return info.dli_fname;
    return "?";
}

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
typedef sighandler_t (*signal_fn)(int, sighandler_t);
typedef int (*raise_fn)(int);

static void say(const char *what, const char *action, const void *caller) {
    char line[1024];
    int n = snprintf(line, sizeof line, "sigaction_log: SIGUSR1 %s%s by %s\n", what, action,
                     library_of(caller));
    if (n > 0) {
        ssize_t w = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)w;
    }
}

static const char *action_name(const struct sigaction *sa) {
    if (!(sa->sa_flags & SA_SIGINFO) && sa->sa_handler == SIG_DFL) return "SIG_DFL";
    if (!(sa->sa_flags & SA_SIGINFO) && sa->sa_handler == SIG_IGN) return "SIG_IGN";
    return library_of((const void *)sa->sa_handler);
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    static sigaction_fn next;
    if (!next) next = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    if (sig == SIGUSR1 && act) {
        char line[1024];
        int n = snprintf(line, sizeof line,
                         "sigaction_log: SIGUSR1 set to %s (flags%s%s%s) by %s\n",
                         action_name(act), act->sa_flags & SA_RESETHAND ? " SA_RESETHAND" : "",
                         act->sa_flags & SA_NODEFER ? " SA_NODEFER" : "",
                         act->sa_flags & SA_ONSTACK ? " SA_ONSTACK" : "",
                         library_of(__builtin_return_address(0)));
        if (n > 0) {
            ssize_t w = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
            (void)w;
        }
    }
    return next(sig, act, old);
}

sighandler_t signal(int sig, sighandler_t handler) {
    static signal_fn next;
    if (!next) next = (signal_fn)dlsym(RTLD_NEXT, "signal");
    if (sig == SIGUSR1) {
        const char *action = handler == SIG_DFL   ? "SIG_DFL"
                             : handler == SIG_IGN ? "SIG_IGN"
                                                  : library_of((const void *)handler);
        say("signal() to ", action, __builtin_return_address(0));
    }
    return next(sig, handler);
}

int raise(int sig) {
    static raise_fn next;
    if (!next) next = (raise_fn)dlsym(RTLD_NEXT, "raise");
    if (sig == SIGUSR1) say("raised", "", __builtin_return_address(0));
    return next(sig);
}

typedef int (*kill_fn)(pid_t, int);

int kill(pid_t pid, int sig) {
    static kill_fn next;
    if (!next) next = (kill_fn)dlsym(RTLD_NEXT, "kill");
    if (sig == SIGUSR1 && pid == getpid()) say("sent to itself", "", __builtin_return_address(0));
    return next(pid, sig);
}

/* The rest of the signal() family, which memsnap answers too. */
#define LOG_SIGNAL_FAMILY(name)                                                                    \
    sighandler_t name(int sig, sighandler_t handler) {                                             \
        static signal_fn next;                                                                     \
        if (!next) next = (signal_fn)dlsym(RTLD_NEXT, #name);                                      \
        if (sig == SIGUSR1)                                                                        \
            say(#name "() to ",                                                                    \
                handler == SIG_DFL ? "SIG_DFL" : library_of((const void *)handler),               \
                __builtin_return_address(0));                                                      \
        return next(sig, handler);                                                                 \
    }
LOG_SIGNAL_FAMILY(bsd_signal)
LOG_SIGNAL_FAMILY(sysv_signal)
LOG_SIGNAL_FAMILY(__sysv_signal)
LOG_SIGNAL_FAMILY(ssignal)
