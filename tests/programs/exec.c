/* exec.c (static runtime): a program that records and then replaces its image, as Python's
 * os.execv* and job wrappers that re-exec themselves do.
 *
 *   exec.c execv|execve|execvp|execvpe|fexecve|execveat|execl|execlp|execle
 *                       allocates 2 x 1 MiB, then execs itself with "after" through that
 *                       function (the new image allocates nothing); the variadic ones pass
 *                       eight arguments, so that some travel on the stack, and execle adds
 *                       EXEC_MARK=le to the environment
 *   exec.c missing [execv|execle]
 *                       allocates 1 MiB, execs a path that does not exist (must fail with
 *                       ENOENT), then allocates 2 MiB more and exits normally
 *   exec.c ignored [missing]
 *                       allocates 1 MiB, ignores SIGUSR1 (memsnap's dump signal), execs itself
 *                       with "after", or with "missing" a path that does not exist, then
 *                       sends itself SIGUSR1 and waits (at most 10 s) for a signal snapshot
 *   exec.c fork         allocates 1 MiB, fork()s; the child (which never allocated) execs
 *                       itself with "after"; the parent times the child from fork to its end
 *   exec.c vfork        the same with vfork(): the child shares the parent's memory
 *   exec.c reexec       as execv, and the new image allocates 1 MiB of its own ("after alloc")
 *   exec.c after        what the new image runs: reports its pid, arguments, EXEC_MARK,
 *                       whether it inherited SIGUSR1 ignored, and its descriptors above 2
 *
 * Results: unsupported (execveat where glibc has none), before_pid, after_pid, after_argc, after_last, after_mark, after_usr1_ignored,
 * after_open_fds,
 * exec_rc, exec_enoent, signal_snapshot, child_ms, child_exit_ok. */
#include "prog_common.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB (1u << 20)

extern char **environ;

static void *alloc(size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static char self_path[4096];

static void find_self(void) {
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n <= 0) {
        perror("readlink /proc/self/exe");
        exit(1);
    }
    self_path[n] = 0;
}

/* Times a child from its creation to its end; reports it. */
static void wait_child(pid_t child, double started) {
    int status = 0;
    if (waitpid(child, &status, 0) != child) {
        perror("waitpid");
        exit(1);
    }
    printf("result child_ms=%.0f\n", now_ms() - started);
    printf("result child_exit_ok=%d\n", WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "execv";
    if (strcmp(mode, "after") == 0) {
        const char *mark = getenv("EXEC_MARK");
        printf("result after_pid=%d\n", (int)getpid());
        printf("result after_argc=%d\n", argc);
        printf("result after_last=%s\n", argv[argc - 1]);
        printf("result after_mark=%s\n", mark ? mark : "none");
        struct sigaction usr1;
        sigaction(SIGUSR1, NULL, &usr1);
        printf("result after_usr1_ignored=%d\n", usr1.sa_handler == SIG_IGN);
        /* Descriptors the new image inherited beyond 0, 1, 2 (the listing's own excepted). */
        int fds = 0;
        DIR *dir = opendir("/proc/self/fd");
        struct dirent *e;
        while (dir && (e = readdir(dir)) != NULL)
            if (e->d_name[0] != '.' && atoi(e->d_name) > 2 && atoi(e->d_name) != dirfd(dir)) fds++;
        if (dir) closedir(dir);
        printf("result after_open_fds=%d\n", fds);
        if (strcmp(argv[argc - 1], "alloc") == 0) {
            void *c = alloc(MIB);
            (void)c;
            print_truth();
        }
        return 0;
    }
    find_self();
    char *after[] = {self_path, "after", NULL};
    printf("result before_pid=%d\n", (int)getpid());
    fflush(stdout); /* the new image starts with empty buffers */

    if (strcmp(mode, "missing") == 0) {
        void *a = alloc(MIB);
        char *missing[] = {"/nonexistent/memsnap-exec-test", NULL};
        int listed = argc > 2 && strcmp(argv[2], "execle") == 0;
        errno = 0;
        int rc = listed ? execle(missing[0], missing[0], (char *)NULL, environ)
                        : execv(missing[0], missing);
        int enoent = errno == ENOENT;
        void *b = alloc(2 * MIB);
        (void)a;
        (void)b;
        printf("result exec_rc=%d\n", rc);
        printf("result exec_enoent=%d\n", enoent);
        print_truth();
        return 0;
    }
    if (strcmp(mode, "ignored") == 0) {
        void *a = alloc(MIB);
        (void)a;
        signal(SIGUSR1, SIG_IGN);
        if (argc > 2 && strcmp(argv[2], "missing") == 0) {
            char *missing[] = {"/nonexistent/memsnap-exec-test", NULL};
            printf("result exec_rc=%d\n", execv(missing[0], missing));
        } else {
            execv(self_path, after);
            perror("exec");
            return 1;
        }
        /* memsnap's handler is back: the dump signal still asks for a snapshot. */
        kill(getpid(), SIGUSR1);
        int found = 0;
        for (int i = 0; i < 1000 && !found; i++) {
            found = count_files("-signal-") > 0;
            if (!found) sleep_ms(10);
        }
        printf("result signal_snapshot=%d\n", found);
        return 0;
    }
    if (strcmp(mode, "fork") == 0 || strcmp(mode, "vfork") == 0) {
        void *a = alloc(MIB);
        (void)a;
        double started = now_ms();
        pid_t child = strcmp(mode, "fork") == 0 ? fork() : vfork();
        if (child < 0) {
            perror("fork");
            return 1;
        }
        if (child == 0) {
            execv(self_path, after);
            _exit(127);
        }
        wait_child(child, started);
        print_truth();
        return 0;
    }

    void *a = alloc(MIB);
    void *b = alloc(MIB);
    (void)a;
    (void)b;
    if (strcmp(mode, "execv") == 0) {
        execv(self_path, after);
    } else if (strcmp(mode, "reexec") == 0) {
        char *again[] = {self_path, "after", "alloc", NULL};
        execv(self_path, again);
    } else if (strcmp(mode, "execve") == 0) {
        execve(self_path, after, environ);
    } else if (strcmp(mode, "execvp") == 0) {
        execvp(self_path, after);
    } else if (strcmp(mode, "execvpe") == 0) {
        execvpe(self_path, after, environ);
    } else if (strcmp(mode, "execveat") == 0) {
        /* Looked up, as a call would bind it: glibc before 2.34 has no execveat. */
        int (*at)(int, const char *, char *const[], char *const[], int) =
            (int (*)(int, const char *, char *const[], char *const[], int))dlsym(RTLD_DEFAULT,
                                                                                "execveat");
        int fd = open(self_path, O_RDONLY | O_CLOEXEC);
        if (at && fd >= 0) at(fd, "", after, environ, AT_EMPTY_PATH);
        if (!at || errno == ENOSYS) {
            printf("result unsupported=1\n"); /* this glibc has no execveat */
            return 0;
        }
    } else if (strcmp(mode, "execl") == 0) {
        execl(self_path, self_path, "after", "a2", "a3", "a4", "a5", "a6", "a7", (char *)NULL);
    } else if (strcmp(mode, "execlp") == 0) {
        execlp(self_path, self_path, "after", "a2", "a3", "a4", "a5", "a6", "a7", (char *)NULL);
    } else if (strcmp(mode, "execle") == 0) {
        size_t n = 0;
        while (environ[n]) n++;
        char **env = calloc(n + 2, sizeof *env);
        memcpy(env, environ, n * sizeof *env);
        env[n] = "EXEC_MARK=le";
        execle(self_path, self_path, "after", "a2", "a3", "a4", "a5", "a6", "a7", (char *)NULL,
               env);
    } else if (strcmp(mode, "fexecve") == 0) {
        int fd = open(self_path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) fexecve(fd, after, environ);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    perror("exec");
    return 1;
}
