/* prog_common.h: helpers shared by the fake-CUDA test programs (header-only, static functions).
 *
 * Output protocol on stdout, one record per line:
 *   result KEY=VALUE           program-specific facts
 *   truth device=D k=v ...     the fake driver's own bookkeeping (fake_cuda_print_truth)
 *   truth managed_bytes=N
 */
#ifndef MEMSNAP_PROG_COMMON_H
#define MEMSNAP_PROG_COMMON_H

#define _GNU_SOURCE
#include "../fake_cuda/cuda_fake.h"

#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROG_HELPER static __attribute__((unused))

#define CHECK_RT(call)                                                                             \
    do {                                                                                           \
        cudaError_t check_rt_err_ = (call);                                                        \
        if (check_rt_err_ != cudaSuccess) {                                                        \
            fprintf(stderr, "%s:%d: %s failed: %d (%s)\n", __FILE__, __LINE__, #call,              \
                    check_rt_err_, cudaGetErrorString(check_rt_err_));                             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_CU(call)                                                                             \
    do {                                                                                           \
        CUresult check_cu_err_ = (call);                                                           \
        if (check_cu_err_ != CUDA_SUCCESS) {                                                       \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, check_cu_err_);   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Sleeps `ms` milliseconds, through interruptions by signals. */
PROG_HELPER void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
}

/* The visible files in MEMSNAP_FOLDER whose names contain `needle`. */
PROG_HELPER int count_files(const char *needle) {
    const char *folder = getenv("MEMSNAP_FOLDER");
    DIR *dir = folder ? opendir(folder) : NULL;
    if (!dir) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL)
        if (e->d_name[0] != '.' && strstr(e->d_name, needle)) n++;
    closedir(dir);
    return n;
}

/* The fake driver's handle. Static-runtime programs load libcuda.so.1 RTLD_LOCAL through the
 * runtime, so RTLD_DEFAULT would not find its symbols: ask dlopen for the loaded copy. */
PROG_HELPER void *fake_driver(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "cannot load libcuda.so.1: %s\n", dlerror());
        exit(1);
    }
    return h;
}

PROG_HELPER void *fake_symbol(const char *name) {
    void *fn = dlsym(fake_driver(), name);
    if (!fn) {
        fprintf(stderr, "libcuda.so.1 has no %s: not the fake driver?\n", name);
        exit(1);
    }
    return fn;
}

PROG_HELPER void print_truth(void) {
    fflush(stdout);
    void (*print)(FILE *) = (void (*)(FILE *))fake_symbol("fake_cuda_print_truth");
    print(stdout);
    fflush(stdout);
}

PROG_HELPER unsigned long long fake_calls(const char *name) {
    unsigned long long (*calls)(const char *) =
        (unsigned long long (*)(const char *))fake_symbol("fake_cuda_calls");
    return calls(name);
}

PROG_HELPER unsigned long long fake_live_bytes(int device) {
    unsigned long long (*live)(int) = (unsigned long long (*)(int))fake_symbol("fake_cuda_live_bytes");
    return live(device);
}

/* 1 when a file whose name contains `needle` exists in $MEMSNAP_FOLDER, else 0. */
PROG_HELPER int folder_has_file(const char *needle) {
    const char *folder = getenv("MEMSNAP_FOLDER");
    if (!folder || !*folder) return 0;
    DIR *dir = opendir(folder);
    if (!dir) return 0;
    int found = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL)
        if (strstr(entry->d_name, needle)) found = 1;
    closedir(dir);
    return found;
}

/* memsnap's step API when the preload is there; a no-op otherwise. */
PROG_HELPER void step_marker(void) {
    void (*step)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memsnap_step");
    if (step) step();
}

#endif /* MEMSNAP_PROG_COMMON_H */
