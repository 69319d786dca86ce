/* jax_dlsym.c: JAX/XLA's route: dlopen("libcuda.so.1") + dlsym of each driver function, never
 * linking libcuda. Every VMM allocation is its own reservation + cuMemCreate + cuMemMap (XLA's
 * platform allocator); frees are cuMemUnmap + cuMemRelease + cuMemAddressFree.
 * Left at the end on device 0: VMM chunks of 4, 2 and 16 MiB (23068672 bytes mapped and
 * physical) and one 3 MiB cuMemAlloc_v2 allocation. Also: a handle released before it is
 * unmapped, and a host-NUMA cuMemCreate whose location id is not a device (no device memory). */
#include "prog_common.h"

#include <stdint.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)

static PFN_cuInit_v2000 p_cuInit;
static PFN_cuDevicePrimaryCtxRetain_v7000 p_cuDevicePrimaryCtxRetain;
static PFN_cuCtxSetCurrent_v4000 p_cuCtxSetCurrent;
static PFN_cuMemAddressReserve_v10020 p_cuMemAddressReserve;
static PFN_cuMemAddressFree_v10020 p_cuMemAddressFree;
static PFN_cuMemCreate_v10020 p_cuMemCreate;
static PFN_cuMemMap_v10020 p_cuMemMap;
static PFN_cuMemSetAccess_v10020 p_cuMemSetAccess;
static PFN_cuMemUnmap_v10020 p_cuMemUnmap;
static PFN_cuMemRelease_v10020 p_cuMemRelease;
static PFN_cuMemAlloc_v3020 p_cuMemAlloc_v2;
static PFN_cuMemFree_v3020 p_cuMemFree_v2;

struct vmm_buffer {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle handle;
};

static void *need(void *libcuda, const char *name) {
    void *fn = dlsym(libcuda, name);
    if (!fn) {
        fprintf(stderr, "dlsym(libcuda, %s) failed\n", name);
        exit(1);
    }
    return fn;
}

NOINLINE struct vmm_buffer xla_vmm_alloc(size_t size) {
    struct vmm_buffer b = {0, size, 0};
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CHECK_CU(p_cuMemAddressReserve(&b.va, size, 0, 0, 0));
    CHECK_CU(p_cuMemCreate(&b.handle, size, &prop, 0));
    CHECK_CU(p_cuMemMap(b.va, size, 0, b.handle, 0));
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK_CU(p_cuMemSetAccess(b.va, size, &access, 1));
    return b;
}

NOINLINE void xla_vmm_free(struct vmm_buffer b) {
    CHECK_CU(p_cuMemUnmap(b.va, b.size));
    CHECK_CU(p_cuMemRelease(b.handle));
    CHECK_CU(p_cuMemAddressFree(b.va, b.size));
}

NOINLINE CUdeviceptr xla_plain_alloc(size_t size) {
    CUdeviceptr p = 0;
    CHECK_CU(p_cuMemAlloc_v2(&p, size));
    return p;
}

int main(void) {
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!libcuda) {
        fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
        return 1;
    }
    p_cuInit = (PFN_cuInit_v2000)need(libcuda, "cuInit");
    p_cuDevicePrimaryCtxRetain = (PFN_cuDevicePrimaryCtxRetain_v7000)need(libcuda, "cuDevicePrimaryCtxRetain");
    p_cuCtxSetCurrent = (PFN_cuCtxSetCurrent_v4000)need(libcuda, "cuCtxSetCurrent");
    p_cuMemAddressReserve = (PFN_cuMemAddressReserve_v10020)need(libcuda, "cuMemAddressReserve");
    p_cuMemAddressFree = (PFN_cuMemAddressFree_v10020)need(libcuda, "cuMemAddressFree");
    p_cuMemCreate = (PFN_cuMemCreate_v10020)need(libcuda, "cuMemCreate");
    p_cuMemMap = (PFN_cuMemMap_v10020)need(libcuda, "cuMemMap");
    p_cuMemSetAccess = (PFN_cuMemSetAccess_v10020)need(libcuda, "cuMemSetAccess");
    p_cuMemUnmap = (PFN_cuMemUnmap_v10020)need(libcuda, "cuMemUnmap");
    p_cuMemRelease = (PFN_cuMemRelease_v10020)need(libcuda, "cuMemRelease");
    p_cuMemAlloc_v2 = (PFN_cuMemAlloc_v3020)need(libcuda, "cuMemAlloc_v2");
    p_cuMemFree_v2 = (PFN_cuMemFree_v3020)need(libcuda, "cuMemFree_v2");

    CUcontext ctx = NULL;
    CHECK_CU(p_cuInit(0));
    CHECK_CU(p_cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK_CU(p_cuCtxSetCurrent(ctx));

    const size_t sizes[5] = {4 * MIB, 64 * MIB, 2 * MIB, 8 * MIB, 16 * MIB};
    struct vmm_buffer bufs[5];
    for (int i = 0; i < 5; i++) bufs[i] = xla_vmm_alloc(sizes[i]);
    xla_vmm_free(bufs[1]);
    xla_vmm_free(bufs[3]);

    /* Released first, unmapped later: the memory goes away at the unmap. */
    struct vmm_buffer early = xla_vmm_alloc(6 * MIB);
    CHECK_CU(p_cuMemRelease(early.handle));
    unsigned long long (*physical)(int) =
        (unsigned long long (*)(int))dlsym(libcuda, "fake_cuda_vmm_physical_bytes");
    unsigned long long physical_while_mapped = physical ? physical(0) : 0;
    CHECK_CU(p_cuMemUnmap(early.va, early.size));
    CHECK_CU(p_cuMemAddressFree(early.va, early.size));

    /* Host NUMA memory (NCCL's cuMem host allocations): location.id is a NUMA node. */
    CUmemAllocationProp host = {0};
    host.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    host.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    host.location.id = 7;
    CUmemGenericAllocationHandle host_handle = 0;
    CHECK_CU(p_cuMemCreate(&host_handle, 2 * MIB, &host, 0));
    unsigned long long physical_with_host = physical ? physical(0) : 0;
    CHECK_CU(p_cuMemRelease(host_handle));

    CUdeviceptr keep = xla_plain_alloc(3 * MIB);
    CUdeviceptr temp = xla_plain_alloc(1 * MIB);
    CHECK_CU(p_cuMemFree_v2(temp));

    printf("result expected_mapped_bytes=%llu\n", 22 * MIB);
    printf("result expected_physical_bytes=%llu\n", 22 * MIB);
    printf("result expected_live_bytes=%llu\n", 3 * MIB);
    printf("result expected_live_count=1\n");
    printf("result physical_while_released_but_mapped=%llu\n", physical_while_mapped);
    printf("result physical_with_host_handle=%llu\n", physical_with_host);
    printf("result keep_ptr=0x%llx\n", keep);
    for (int i = 0; i < 5; i++) printf("result vmm%d_ptr=0x%llx\n", i, bufs[i].va);
    printf("result early_ptr=0x%llx\n", early.va);
    printf("result address_reused=%d\n", early.va == bufs[1].va);
    print_truth();
    return 0;
}
