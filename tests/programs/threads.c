/* threads.c (static runtime): argv[1] threads (default 8, at most 64), each doing argv[2]
 * random operations (default 2000; cudaMalloc/cudaFree, one in four
 * cudaMallocAsync/cudaFreeAsync) with sizes from 512 B to 4 MiB; thread t works on device
 * t % device_count. Each thread keeps what is live at its end. Prints per device the
 * expected live bytes and count, whether all live pointers are distinct, how many allocations got
 * an address this thread had freed before, then the truth. Deterministic (fixed seeds). */
#include "prog_common.h"

#include <pthread.h>
#include <stdint.h>

#define NOINLINE __attribute__((noinline))
#define MAX_THREADS 64
static int THREADS = 8;
static int OPS = 2000;
#define MAX_LIVE 64
#define RECENT 32

struct worker {
    int index;
    int device;
    unsigned seed;
    void *live[MAX_LIVE];
    size_t live_size[MAX_LIVE];
    int live_async[MAX_LIVE];
    int live_count;
    unsigned long long live_bytes;
    int reused;
    void *recent_freed[RECENT];
    int failed;
};

NOINLINE void *worker_alloc(size_t size, int async, cudaStream_t stream) {
    void *p = NULL;
    cudaError_t e = async ? cudaMallocAsync(&p, size, stream) : cudaMalloc(&p, size);
    return e == cudaSuccess ? p : NULL;
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    cudaStream_t stream = NULL;
    if (cudaSetDevice(w->device) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) {
        w->failed = 1;
        return NULL;
    }
    int recent_at = 0;
    for (int op = 0; op < OPS; op++) {
        int do_alloc = w->live_count == 0 ||
                       (w->live_count < MAX_LIVE && rand_r(&w->seed) % 100 < 55);
        int async = rand_r(&w->seed) % 4 == 0;
        if (do_alloc) {
            size_t size = 512 + (size_t)rand_r(&w->seed) % ((4u << 20) - 512 + 1);
            void *p = worker_alloc(size, async, stream);
            if (!p) {
                w->failed = 1;
                return NULL;
            }
            for (int r = 0; r < RECENT; r++)
                if (w->recent_freed[r] == p) {
                    w->reused++;
                    break;
                }
            w->live[w->live_count] = p;
            w->live_size[w->live_count] = size;
            w->live_async[w->live_count] = async;
            w->live_count++;
            w->live_bytes += size;
        } else {
            int victim = rand_r(&w->seed) % w->live_count;
            void *p = w->live[victim];
            cudaError_t e = w->live_async[victim] ? cudaFreeAsync(p, stream) : cudaFree(p);
            if (e != cudaSuccess) {
                w->failed = 1;
                return NULL;
            }
            w->recent_freed[recent_at++ % RECENT] = p;
            w->live_bytes -= w->live_size[victim];
            w->live_count--;
            w->live[victim] = w->live[w->live_count];
            w->live_size[victim] = w->live_size[w->live_count];
            w->live_async[victim] = w->live_async[w->live_count];
        }
    }
    cudaStreamDestroy(stream);
    return NULL;
}

static int compare_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc > 1) THREADS = atoi(argv[1]);
    if (argc > 2) OPS = atoi(argv[2]);
    if (THREADS < 1 || THREADS > MAX_THREADS || OPS < 1) {
        fprintf(stderr, "usage: threads [THREADS (1-%d)] [OPS]\n", MAX_THREADS);
        return 2;
    }
    int devices = 0;
    CHECK_RT(cudaGetDeviceCount(&devices));
    if (devices < 1) return 1;
    static struct worker workers[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    for (int t = 0; t < THREADS; t++) {
        workers[t].index = t;
        workers[t].device = t % devices;
        workers[t].seed = 12345u + 977u * (unsigned)t;
        if (pthread_create(&tids[t], NULL, worker_main, &workers[t]) != 0) return 1;
    }
    for (int t = 0; t < THREADS; t++) pthread_join(tids[t], NULL);

    static void *all[MAX_THREADS * MAX_LIVE];
    int n = 0, failed = 0, reused = 0;
    for (int d = 0; d < devices && d < 16; d++) {
        unsigned long long bytes = 0, count = 0;
        for (int t = 0; t < THREADS; t++) {
            if (workers[t].device != d) continue;
            bytes += workers[t].live_bytes;
            count += (unsigned long long)workers[t].live_count;
        }
        printf("result expected_live_bytes_dev%d=%llu\n", d, bytes);
        printf("result expected_live_count_dev%d=%llu\n", d, count);
    }
    for (int t = 0; t < THREADS; t++) {
        failed |= workers[t].failed;
        reused += workers[t].reused;
        for (int i = 0; i < workers[t].live_count; i++) all[n++] = workers[t].live[i];
    }
    qsort(all, (size_t)n, sizeof all[0], compare_ptr);
    int distinct = 1;
    for (int i = 1; i < n; i++)
        if (all[i] == all[i - 1]) distinct = 0;
    printf("result threads=%d\n", THREADS);
    printf("result ops_per_thread=%d\n", OPS);
    printf("result failed=%d\n", failed);
    printf("result live_ptrs_distinct=%d\n", distinct);
    printf("result reused_addresses=%d\n", reused);
    printf("result cuMemAlloc_v2_calls=%llu\n", fake_calls("cuMemAlloc_v2"));
    printf("result cuMemAllocAsync_calls=%llu\n", fake_calls("cuMemAllocAsync"));
    printf("result cuMemFree_v2_calls=%llu\n", fake_calls("cuMemFree_v2"));
    printf("result cuMemFreeAsync_calls=%llu\n", fake_calls("cuMemFreeAsync"));
    print_truth();
    return failed;
}
