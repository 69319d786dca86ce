// Known allocations from known functions, for checking memsnap's snapshot against ground truth.
//
// Built twice by validate.sh: plain `nvcc` (cudart linked statically: allocations reach the
// driver through cuGetProcAddress) and `nvcc -cudart shared` (cudaMalloc through the PLT).
// Usage: alloc_test MANIFEST.json   (MEMSNAP_FOLDER names the folder to watch for the signal file)
// Writes MANIFEST.json: every pointer, size, function, stream, the OOM request and the free memory
// cudaMemGetInfo reported just before it, and whether the SIGUSR1 dump appeared.
#include <cuda_runtime.h>

#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <string>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        cudaError_t err_ = (call);                                                       \
        if (err_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call,             \
                    cudaGetErrorString(err_));                                           \
            exit(2);                                                                     \
        }                                                                                \
    } while (0)

static const size_t kMiB = 1ull << 20;
static const size_t kOneMiB = kMiB;
static const size_t kOddSize = 3 * kMiB + 17;
static const size_t kBig = 64 * kMiB;
static const size_t kFreed = 2 * kMiB;
static const size_t kAsyncLive = 5 * kMiB + 3;
static const size_t kAsyncFreed = 7 * kMiB;

// Each allocation comes from its own non-inlined function, so its name must show up in the
// native frames memsnap records for that allocation.
__attribute__((noinline)) void* memsnap_test_alloc_one_mib() {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, kOneMiB));
    CHECK(cudaMemset(p, 1, kOneMiB));
    return p;
}

__attribute__((noinline)) void* memsnap_test_alloc_odd_size() {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, kOddSize));
    CHECK(cudaMemset(p, 2, kOddSize));
    return p;
}

__attribute__((noinline)) void* memsnap_test_alloc_big() {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, kBig));
    CHECK(cudaMemset(p, 3, kBig));
    return p;
}

__attribute__((noinline)) void* memsnap_test_alloc_then_free() {
    void* p = nullptr;
    CHECK(cudaMalloc(&p, kFreed));
    CHECK(cudaMemset(p, 4, kFreed));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaFree(p));
    return p;  // the freed address, for the manifest
}

__attribute__((noinline)) void* memsnap_test_alloc_async(cudaStream_t s) {
    void* p = nullptr;
    CHECK(cudaMallocAsync(&p, kAsyncLive, s));
    CHECK(cudaMemsetAsync(p, 5, kAsyncLive, s));
    return p;
}

__attribute__((noinline)) void* memsnap_test_alloc_free_async(cudaStream_t s) {
    void* p = nullptr;
    CHECK(cudaMallocAsync(&p, kAsyncFreed, s));
    CHECK(cudaMemsetAsync(p, 6, kAsyncFreed, s));
    CHECK(cudaFreeAsync(p, s));
    return p;
}

__attribute__((noinline)) cudaError_t memsnap_test_oom(size_t bytes, void** out) {
    *out = nullptr;
    return cudaMalloc(out, bytes);
}

static double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Name of a finished snapshot file whose name holds `-signal-`, or "" after `timeout_s`.
static std::string wait_for_signal_file(const char* folder, double timeout_s, double* waited) {
    double t0 = now_s();
    for (;;) {
        DIR* d = opendir(folder);
        if (d) {
            struct dirent* e;
            while ((e = readdir(d)) != nullptr) {
                size_t n = strlen(e->d_name);
                if (strstr(e->d_name, "-signal-") && n > 7 && strcmp(e->d_name + n - 7, ".pickle") == 0) {
                    std::string name = e->d_name;
                    closedir(d);
                    *waited = now_s() - t0;
                    return name;
                }
            }
            closedir(d);
        }
        *waited = now_s() - t0;
        if (*waited > timeout_s) return "";
        usleep(2000);
    }
}

static unsigned long long u(const void* p) { return (unsigned long long)(uintptr_t)p; }

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MANIFEST.json\n", argv[0]);
        return 2;
    }
    const char* folder = getenv("MEMSNAP_FOLDER");
    if (!folder) folder = ".";

    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(nullptr));  // create the context

    void* a = memsnap_test_alloc_one_mib();
    void* b = memsnap_test_alloc_odd_size();
    void* c = memsnap_test_alloc_big();
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void* e = memsnap_test_alloc_async(s);
    void* f = memsnap_test_alloc_free_async(s);
    CHECK(cudaStreamSynchronize(s));
    void* d = memsnap_test_alloc_then_free();  // last, so no later allocation can reuse its address

    size_t free_before = 0, total = 0;
    CHECK(cudaMemGetInfo(&free_before, &total));
    size_t oom_request = free_before + (1ull << 30);
    void* oom_ptr = nullptr;
    cudaError_t oom_err = memsnap_test_oom(oom_request, &oom_ptr);
    cudaGetLastError();  // clear the error state
    if (oom_err == cudaSuccess) cudaFree(oom_ptr);

    // SIGUSR1 kills a process with no handler: raise it only if memsnap installed one.
    struct sigaction old;
    memset(&old, 0, sizeof old);
    sigaction(SIGUSR1, nullptr, &old);
    bool handler = old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN;
    std::string signal_file;
    double waited = -1;
    if (handler) {
        raise(SIGUSR1);
        signal_file = wait_for_signal_file(folder, 30.0, &waited);
    }

    FILE* m = fopen(argv[1], "w");
    if (!m) {
        perror("manifest");
        return 2;
    }
    fprintf(m, "{\n \"pid\": %d,\n", (int)getpid());
    fprintf(m, " \"live\": [\n");
    fprintf(m, "  {\"name\": \"one_mib\", \"fn\": \"memsnap_test_alloc_one_mib\", \"addr\": %llu, \"size\": %zu, \"stream\": 0, \"api\": \"cudaMalloc\"},\n", u(a), kOneMiB);
    fprintf(m, "  {\"name\": \"odd_size\", \"fn\": \"memsnap_test_alloc_odd_size\", \"addr\": %llu, \"size\": %zu, \"stream\": 0, \"api\": \"cudaMalloc\"},\n", u(b), kOddSize);
    fprintf(m, "  {\"name\": \"big\", \"fn\": \"memsnap_test_alloc_big\", \"addr\": %llu, \"size\": %zu, \"stream\": 0, \"api\": \"cudaMalloc\"},\n", u(c), kBig);
    fprintf(m, "  {\"name\": \"async_live\", \"fn\": \"memsnap_test_alloc_async\", \"addr\": %llu, \"size\": %zu, \"stream\": %llu, \"api\": \"cudaMallocAsync\"}\n", u(e), kAsyncLive, u(s));
    fprintf(m, " ],\n \"freed\": [\n");
    fprintf(m, "  {\"name\": \"freed\", \"fn\": \"memsnap_test_alloc_then_free\", \"addr\": %llu, \"size\": %zu, \"stream\": 0, \"api\": \"cudaMalloc\"},\n", u(d), kFreed);
    fprintf(m, "  {\"name\": \"async_freed\", \"fn\": \"memsnap_test_alloc_free_async\", \"addr\": %llu, \"size\": %zu, \"stream\": %llu, \"api\": \"cudaMallocAsync\"}\n", u(f), kAsyncFreed, u(s));
    fprintf(m, " ],\n");
    fprintf(m, " \"oom\": {\"request\": %zu, \"free_before\": %zu, \"total\": %zu, \"error\": %d, \"error_name\": \"%s\"},\n",
            oom_request, free_before, total, (int)oom_err, cudaGetErrorName(oom_err));
    fprintf(m, " \"signal\": {\"handler_installed\": %s, \"file\": \"%s\", \"wait_s\": %.6f}\n}\n",
            handler ? "true" : "false", signal_file.c_str(), waited);
    fclose(m);
    printf("alloc_test: done (signal file: %s)\n", signal_file.empty() ? "<none>" : signal_file.c_str());
    // a, b, c and e stay allocated until exit on purpose: the exit snapshot must hold them too.
    return 0;
}
