/* driver_direct.c: calls the driver API directly through the PLT (linked with -lcuda), the way
 * hand-written driver-API code does. Live at the end on device 0: 2 MiB (cuMemAlloc_v2),
 * 1 MiB (cuMemAllocAsync) and 2048*64 (cuMemAllocPitch_v2, pitch 2048): 3 allocations,
 * 3276800 bytes; managed: 1 MiB. */
#include "prog_common.h"

#include <stdint.h>

#define NOINLINE __attribute__((noinline))

NOINLINE CUdeviceptr driver_alloc(size_t bytes) {
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAlloc_v2(&p, bytes));
    return p;
}

NOINLINE CUdeviceptr driver_alloc_async(size_t bytes, CUstream stream) {
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAllocAsync(&p, bytes, stream));
    return p;
}

NOINLINE CUdeviceptr driver_alloc_pitch(size_t *pitch) {
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAllocPitch_v2(&p, pitch, 2000, 64, 16));
    return p;
}

NOINLINE CUdeviceptr driver_alloc_managed(size_t bytes) {
    CUdeviceptr p = 0;
    CHECK_CU(cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL));
    return p;
}

int main(void) {
    CUcontext ctx = NULL;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK_CU(cuCtxSetCurrent(ctx));
    CUstream stream = (CUstream)(uintptr_t)0x5010;

    CUdeviceptr keep = driver_alloc(2u << 20);
    CUdeviceptr temp = driver_alloc(4096);
    CHECK_CU(cuMemFree_v2(temp));
    CUdeviceptr again = driver_alloc(4096); /* first fit: lands where `temp` was */
    CHECK_CU(cuMemFree_v2(again));
    CHECK_CU(cuMemFree_v2(0)); /* a no-op that succeeds, as in the real driver */

    CUdeviceptr async_keep = driver_alloc_async(1u << 20, stream);
    CUdeviceptr async_temp = driver_alloc_async(8192, stream);
    CHECK_CU(cuMemFreeAsync(async_temp, stream));

    size_t pitch = 0;
    CUdeviceptr pitched = driver_alloc_pitch(&pitch);
    CUdeviceptr managed = driver_alloc_managed(1u << 20);

    CUdeviceptr never = 0x1234;
    CUresult bad_free = cuMemFree_v2(never + 1); /* unknown pointer */
    CUresult zero_alloc = cuMemAlloc_v2(&never, 0);

    size_t free_bytes = 0, total_bytes = 0;
    CHECK_CU(cuMemGetInfo_v2(&free_bytes, &total_bytes));
    CHECK_CU(cuMemGetInfo_v2(NULL, &total_bytes)); /* NULL out-params are tolerated */

    printf("result expected_live_bytes=%llu\n", (2ull << 20) + (1ull << 20) + pitch * 64);
    printf("result expected_live_count=3\n");
    printf("result expected_managed_bytes=%u\n", 1u << 20);
    printf("result pitch=%zu\n", pitch);
    printf("result keep_ptr=0x%llx\n", keep);
    printf("result async_keep_ptr=0x%llx\n", async_keep);
    printf("result pitched_ptr=0x%llx\n", pitched);
    printf("result managed_ptr=0x%llx\n", managed);
    printf("result address_reused=%d\n", again == temp);
    printf("result bad_free_error=%d\n", bad_free);
    printf("result zero_alloc_error=%d\n", zero_alloc);
    printf("result untouched_out_param=%d\n", never == 0x1234);
    printf("result mem_free=%zu\n", free_bytes);
    printf("result mem_total=%zu\n", total_bytes);
    printf("result cuMemAlloc_v2_calls=%llu\n", fake_calls("cuMemAlloc_v2"));
    printf("result cuMemFree_v2_calls=%llu\n", fake_calls("cuMemFree_v2"));
    printf("result cuCtxGetDevice_calls=%llu\n", fake_calls("cuCtxGetDevice"));
    print_truth();
    return 0;
}
