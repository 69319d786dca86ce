/* nocuda.c: never touches CUDA. With the interposer preloaded it must still start no thread,
 * write no file and print nothing of its own: the only output is "hello".
 * argv[1] == "threads": also prints "threads=N", the number of threads in this process at the
 * end of main (from /proc/self/task). */
#include <dirent.h>
#include <stdio.h>
#include <string.h>

static int count_threads(void) {
    DIR *dir = opendir("/proc/self/task");
    if (!dir) return -1;
    int n = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL)
        if (entry->d_name[0] != '.') n++;
    closedir(dir);
    return n;
}

int main(int argc, char **argv) {
    puts("hello");
    if (argc > 1 && strcmp(argv[1], "threads") == 0) printf("threads=%d\n", count_threads());
    return 0;
}
