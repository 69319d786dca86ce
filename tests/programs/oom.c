/* oom.c (static runtime; run with FAKE_CUDA_CAPACITY=64M): allocates 16 MiB buffers until
 * cudaMalloc fails with cudaErrorMemoryAllocation. Right after the failing call returns it looks
 * for a file with "oom" in its name in $MEMSNAP_FOLDER (did the interposer write the OOM snapshot
 * before the call returned?). Then, like PyTorch's free-cache-and-retry, it frees one buffer and
 * retries once. Prints result oom_file_before_return, oom_size, oom_at (index of the failing
 * call = number of buffers that fit), oom_error, retry_ok, then the truth. */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define BUFFER_BYTES (16u << 20)
#define MAX_BUFFERS 4096

static void *buffers[MAX_BUFFERS];

NOINLINE cudaError_t allocate_buffer(void **out) { return cudaMalloc(out, BUFFER_BYTES); }

int main(void) {
    int count = 0;
    cudaError_t err = cudaSuccess;
    while (count < MAX_BUFFERS) {
        void *p = (void *)0x1;
        err = allocate_buffer(&p);
        if (err != cudaSuccess) {
            int file_before_return = folder_has_file("oom");
            printf("result oom_file_before_return=%d\n", file_before_return);
            printf("result oom_untouched_out_param=%d\n", p == (void *)0x1);
            break;
        }
        buffers[count++] = p;
    }
    if (err != cudaErrorMemoryAllocation) {
        fprintf(stderr, "expected cudaErrorMemoryAllocation, got %d after %d buffers\n", err, count);
        return 1;
    }
    printf("result oom_error=%d\n", err);
    printf("result oom_size=%u\n", BUFFER_BYTES);
    printf("result oom_at=%d\n", count);
    printf("result last_error=%d\n", cudaGetLastError());

    CHECK_RT(cudaFree(buffers[--count]));
    void *retry = NULL;
    cudaError_t retry_err = allocate_buffer(&retry);
    printf("result retry_ok=%d\n", retry_err == cudaSuccess);
    if (retry_err == cudaSuccess) buffers[count++] = retry;
    printf("result expected_live_bytes=%llu\n", (unsigned long long)count * BUFFER_BYTES);
    printf("result expected_live_count=%d\n", count);
    printf("result oom_file_at_end=%d\n", folder_has_file("oom"));
    print_truth();
    return 0;
}
