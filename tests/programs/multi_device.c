/* multi_device.c: allocations on devices 0 and 1 through the shared runtime (cudaSetDevice
 * switches the calling thread's current device). One device-0 pointer is freed while device 1
 * is current (unified addressing: the free belongs to device 0 by its address).
 * Live at the end: device 0: 1 MiB + 4 MiB (2 allocations, 5242880 bytes);
 * device 1: 8 MiB + 512 KiB (2 allocations, 8912896 bytes). */
#include "prog_common.h"

#define NOINLINE __attribute__((noinline))
#define MIB (1u << 20)

NOINLINE void *alloc_on_device(int device, size_t bytes) {
    void *p = NULL;
    CHECK_RT(cudaSetDevice(device));
    CHECK_RT(cudaMalloc(&p, bytes));
    return p;
}

int main(void) {
    int count = 0;
    CHECK_RT(cudaGetDeviceCount(&count));
    if (count < 2) {
        fprintf(stderr, "multi_device needs 2 devices, found %d (FAKE_CUDA_DEVICES)\n", count);
        return 1;
    }
    void *d0_keep1 = alloc_on_device(0, 1 * MIB);
    void *d0_temp = alloc_on_device(0, 2 * MIB);
    void *d0_keep2 = alloc_on_device(0, 4 * MIB);
    void *d1_keep1 = alloc_on_device(1, 8 * MIB);
    void *d1_temp = alloc_on_device(1, 16 * MIB);
    void *d1_keep2 = alloc_on_device(1, MIB / 2);

    CHECK_RT(cudaSetDevice(1));
    CHECK_RT(cudaFree(d1_temp));
    CHECK_RT(cudaFree(d0_temp)); /* device 0's pointer, freed with device 1 current */
    int current = -1;
    CHECK_RT(cudaGetDevice(&current));

    size_t free1 = 0, total1 = 0;
    CHECK_RT(cudaMemGetInfo(&free1, &total1));

    printf("result device_count=%d\n", count);
    printf("result current_device=%d\n", current);
    printf("result expected_live_bytes_dev0=%u\n", 5 * MIB);
    printf("result expected_live_count_dev0=2\n");
    printf("result expected_live_bytes_dev1=%u\n", 8 * MIB + MIB / 2);
    printf("result expected_live_count_dev1=2\n");
    printf("result dev1_mem_used=%zu\n", total1 - free1);
    printf("result d0_ptrs=%p,%p\n", d0_keep1, d0_keep2);
    printf("result d1_ptrs=%p,%p\n", d1_keep1, d1_keep2);
    print_truth();
    return 0;
}
