/* sigaction_log.c: a preloaded shim that logs every sigaction() call on SIGUSR1 (the dump
 * signal) with the library that made it and the action it sets, then passes the call on.
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

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);

static const char *library_of(const void *address) {
    Dl_info info;
    if (address && dladdr(address, &info) && info.dli_fname) return info.dli_fname;
    return "?";
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
        int n = snprintf(line, sizeof line, "sigaction_log: SIGUSR1 set to %s by %s\n",
                         action_name(act), library_of(__builtin_return_address(0)));
        if (n > 0) {
            ssize_t w = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
            (void)w;
        }
    }
    return next(sig, act, old);
}
