/* closefds.c (static runtime): a program that, once recording has started, closes every
 * descriptor above 2 (as daemonizing code and `close_range` do) and opens its own files,
 * which get the numbers memsnap's descriptors had. It then keeps memsnap busy (allocations,
 * dump signals) while it writes and reads its own data, and checks that nothing of memsnap's
 * went into or out of its files, and that memsnap's live socket answers again.
 *
 * Prints `result KEY=VALUE` lines:
 *   data_bytes          the size of its data file at the end (64 when nothing was injected)
 *   stream_intact       its socket pair carried exactly the bytes it sent
 *   live_socket         connecting to memsnap's live socket works again after the close
 *   signal_files        snapshots written for its dump signals */
#include "prog_common.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>


static int live_socket_answers(void) {
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "/tmp/memsnap-%u/%d.sock", (unsigned)getuid(),
             (int)getpid());
    for (int tries = 0; tries < 300; tries++) {
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s < 0) return 0;
        int ok = connect(s, (struct sockaddr *)&addr, sizeof addr) == 0;
        close(s);
        if (ok) return 1;
        sleep_ms(10);
    }
    return 0;
}

int main(void) {
    void *first = NULL;
    CHECK_RT(cudaMalloc(&first, 1 << 20));
    /* A first snapshot: the writer is up, with its socket, and has read the names of the
     * libraries on this stack. It holds only its long-lived descriptors now; while it reads
     * a library's debug information it holds that file open too, and a program closing
     * descriptors it did not open at that moment races memsnap as it would race any thread
     * of its own libraries (docs/SIGNALS.md, "Descriptors"). */
    kill(getpid(), SIGUSR1);
    for (int waited = 0; waited < 5000 && count_files("-signal-") < 1; waited += 10) sleep_ms(10);
    /* The writer's last word on that signal is its acknowledgement file's "served" line;
     * then it is idle. */
    char ack_path[256], ack[512];
    snprintf(ack_path, sizeof ack_path, "/tmp/memsnap-%u/%d.ack", (unsigned)getuid(), (int)getpid());
    for (int waited = 0; waited < 5000; waited += 10) {
        FILE *f = fopen(ack_path, "r");
        size_t n = f ? fread(ack, 1, sizeof ack - 1, f) : 0;
        if (f) fclose(f);
        ack[n] = 0;
        if (strstr(ack, "served 1")) break;
        sleep_ms(10);
    }
    sleep_ms(100);

    for (int fd = 3; fd < 4096; fd++) close(fd);

    const char *folder = getenv("MEMSNAP_FOLDER");
    char data_path[4096];
    snprintf(data_path, sizeof data_path, "%s/program-data.bin", folder ? folder : ".");
    int data = open(data_path, O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0600);
    int pair[2];
    if (data < 0 || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        perror("program files");
        return 1;
    }
    char block[64];
    memset(block, 'p', sizeof block);
    if (write(data, block, sizeof block) != (ssize_t)sizeof block) return 1;

    long sent = 0, received = 0, mismatched = 0;
    for (int round = 0; round < 200; round++) {
        void *p = NULL;
        CHECK_RT(cudaMalloc(&p, (size_t)(round % 5 + 1) << 12));
        CHECK_RT(cudaFree(p));
        if (round % 50 == 0) kill(getpid(), SIGUSR1);
        char out[32], in[32];
        memset(out, 'a' + round % 26, sizeof out);
        if (write(pair[0], out, sizeof out) != (ssize_t)sizeof out) return 1;
        sent += sizeof out;
        ssize_t got = 0;
        while (got < (ssize_t)sizeof in) {
            ssize_t n = read(pair[1], in + got, sizeof in - got);
            if (n <= 0) break;
            got += n;
        }
        received += got;
        if (got != (ssize_t)sizeof in || memcmp(in, out, sizeof in) != 0) mismatched++;
        sleep_ms(1);
    }
    /* Nothing else may be waiting in the program's stream. */
    fcntl(pair[1], F_SETFL, O_NONBLOCK);
    char extra[64];
    ssize_t leftover = read(pair[1], extra, sizeof extra);
    int nothing_left = leftover < 0 && errno == EAGAIN;

    for (int waited = 0; waited < 5000 && count_files("-signal-") < 1; waited += 10) sleep_ms(10);
    struct stat st;
    fstat(data, &st);
    printf("result data_bytes=%ld\n", (long)st.st_size);
    printf("result stream_intact=%d\n",
           sent == received && mismatched == 0 && nothing_left);
    printf("result live_socket=%d\n", live_socket_answers());
    printf("result signal_files=%d\n", count_files("-signal-"));
    CHECK_RT(cudaFree(first));
    return 0;
}
