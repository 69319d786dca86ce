/* rt_scenario.h: the runtime-API scenario shared by static_rt.c (runtime linked into the
 * program, like nvcc's default) and shared_rt.c (libcudart.so.13). The allocation sites are in
 * named, non-inlined, non-static functions so stack tests can look for their names; each site
 * records its own line number (printed as `result <function>_line=N`).
 *
 * Live at the end on device 0: 1 MiB + 3 MiB (alloc_weights), 512 KiB (run_async_steps),
 * pitch*100 (alloc_pitched, pitch 1024) and pitch*20*10 (alloc_volume, pitch 3072):
 * 5 allocations, 5435392 bytes; managed: 2 MiB.
 */
#include "prog_common.h"

#include <stdint.h>

#define NOINLINE __attribute__((noinline))

#define WEIGHTS1_BYTES (1u << 20)
#define WEIGHTS2_BYTES (3u << 20)
#define ACTIVATION_BYTES 12345u
#define MANAGED_BYTES (2u << 20)
#define PITCH_WIDTH 1000u
#define PITCH_HEIGHT 100u
#define VOLUME_WIDTH 3000u
#define VOLUME_HEIGHT 20u
#define VOLUME_DEPTH 10u

static const size_t async_sizes[4] = {8192, 65536, 262144, 524288};

int alloc_weights_line, alloc_activations_line, run_async_steps_line, alloc_managed_line,
    alloc_pitched_line, alloc_volume_line;

NOINLINE void alloc_weights(void **first, void **second) {
    CHECK_RT(cudaMalloc(first, WEIGHTS1_BYTES)); alloc_weights_line = __LINE__;
    CHECK_RT(cudaMalloc(second, WEIGHTS2_BYTES));
}

NOINLINE void *alloc_activations(void) {
    void *activations = NULL;
    CHECK_RT(cudaMalloc(&activations, ACTIVATION_BYTES)); alloc_activations_line = __LINE__;
    return activations;
}

NOINLINE void free_activations(void *activations) { CHECK_RT(cudaFree(activations)); }

/* Four stream-ordered allocations; the first three are freed again. */
NOINLINE void run_async_steps(cudaStream_t stream, void *out[4]) {
    for (int i = 0; i < 4; i++) {
        CHECK_RT(cudaMallocAsync(&out[i], async_sizes[i], stream)); run_async_steps_line = __LINE__;
    }
    for (int i = 0; i < 3; i++) CHECK_RT(cudaFreeAsync(out[i], stream));
    /* The per-thread-default-stream and pool variants, freed at once (net zero). */
    void *ptsz = NULL, *pooled = NULL;
    CHECK_RT(cudaMallocAsync_ptsz(&ptsz, 4096, stream));
    CHECK_RT(cudaFreeAsync_ptsz(ptsz, stream));
    CHECK_RT(cudaMallocFromPoolAsync(&pooled, 4096, (cudaMemPool_t)(uintptr_t)0x6000, stream));
    CHECK_RT(cudaFreeAsync(pooled, stream));
}

NOINLINE void *alloc_managed(void) {
    void *managed = NULL;
    CHECK_RT(cudaMallocManaged(&managed, MANAGED_BYTES, cudaMemAttachGlobal)); alloc_managed_line = __LINE__;
    return managed;
}

NOINLINE void *alloc_pitched(size_t *pitch) {
    void *pitched = NULL;
    CHECK_RT(cudaMallocPitch(&pitched, pitch, PITCH_WIDTH, PITCH_HEIGHT)); alloc_pitched_line = __LINE__;
    return pitched;
}

NOINLINE struct cudaPitchedPtr alloc_volume(void) {
    struct cudaPitchedPtr volume = {0};
    struct cudaExtent extent = {VOLUME_WIDTH, VOLUME_HEIGHT, VOLUME_DEPTH};
    CHECK_RT(cudaMalloc3D(&volume, extent)); alloc_volume_line = __LINE__;
    return volume;
}

int main(void) {
    void *w1 = NULL, *w2 = NULL, *async_bufs[4] = {0};
    alloc_weights(&w1, &w2);
    void *activations = alloc_activations();
    free_activations(activations);

    cudaStream_t stream = NULL;
    CHECK_RT(cudaStreamCreate(&stream));
    run_async_steps(stream, async_bufs);

    void *managed = alloc_managed();
    size_t pitch = 0;
    void *pitched = alloc_pitched(&pitch);
    struct cudaPitchedPtr volume = alloc_volume();
    CHECK_RT(cudaDeviceSynchronize());
    CHECK_RT(cudaStreamDestroy(stream));

    size_t free_bytes = 0, total_bytes = 0;
    CHECK_RT(cudaMemGetInfo(&free_bytes, &total_bytes));

    unsigned long long expected = WEIGHTS1_BYTES + WEIGHTS2_BYTES + async_sizes[3] +
                                  pitch * PITCH_HEIGHT +
                                  volume.pitch * VOLUME_HEIGHT * VOLUME_DEPTH;
    printf("result program=%s\n", PROGRAM_NAME);
    printf("result expected_live_bytes=%llu\n", expected);
    printf("result expected_live_count=5\n");
    printf("result expected_managed_bytes=%u\n", MANAGED_BYTES);
    printf("result pitch=%zu\n", pitch);
    printf("result volume_pitch=%zu\n", volume.pitch);
    printf("result mem_free=%zu\n", free_bytes);
    printf("result mem_total=%zu\n", total_bytes);
    printf("result activations_ptr=%p\n", activations);
    printf("result async_first_ptr=%p\n", async_bufs[0]);
    /* First fit: the 8 KiB async allocation lands where the freed 12345-byte one was. */
    printf("result address_reused=%d\n", async_bufs[0] == activations);
    printf("result weights_ptr=%p\n", w1);
    printf("result managed_ptr=%p\n", managed);
    printf("result pitched_ptr=%p\n", pitched);
    printf("result source_file=%s\n", __FILE__);
    printf("result alloc_weights_line=%d\n", alloc_weights_line);
    printf("result alloc_activations_line=%d\n", alloc_activations_line);
    printf("result run_async_steps_line=%d\n", run_async_steps_line);
    printf("result alloc_managed_line=%d\n", alloc_managed_line);
    printf("result alloc_pitched_line=%d\n", alloc_pitched_line);
    printf("result alloc_volume_line=%d\n", alloc_volume_line);
    printf("result getproc_v2_calls=%llu\n", fake_calls("cuGetProcAddress_v2"));
    printf("result nested_getproc_lookups=%llu\n", fake_calls("getproc:cuGetProcAddress"));
    printf("result cuMemAlloc_v2_calls=%llu\n", fake_calls("cuMemAlloc_v2"));
    printf("result cuMemAllocAsync_calls=%llu\n", fake_calls("cuMemAllocAsync"));
    printf("result cuMemAllocAsync_ptsz_calls=%llu\n", fake_calls("cuMemAllocAsync_ptsz"));
    printf("result cuMemAllocFromPoolAsync_calls=%llu\n", fake_calls("cuMemAllocFromPoolAsync"));
    printf("result cuMemFreeAsync_calls=%llu\n", fake_calls("cuMemFreeAsync"));
    printf("result cuMemFreeAsync_ptsz_calls=%llu\n", fake_calls("cuMemFreeAsync_ptsz"));
    printf("result cuMemAllocPitch_v2_calls=%llu\n", fake_calls("cuMemAllocPitch_v2"));
    printf("result cuMemAllocManaged_calls=%llu\n", fake_calls("cuMemAllocManaged"));
    print_truth();
    return 0;
}
