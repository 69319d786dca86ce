/* expandable.c: PyTorch's expandable-segments route through the shared runtime.
 * The VMM entry points come from cudaGetDriverEntryPointByVersion(..., 12030,
 * cudaEnableDefault, &status) (c10/cuda/driver_api.cpp), or with argv[1] == "legacy" from
 * cudaGetDriverEntryPoint. 1 GiB of address space is reserved; chunks of 2, 20, 20 and 20 MiB
 * are created and mapped back to back; the last one is unmapped and released again.
 * The handle of chunk 1 is released right after mapping (its memory lives on while mapped).
 * Left at the end on device 0: 3 mappings, 44040192 bytes mapped and physical. */
#include "prog_common.h"

#include <stdint.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)

static PFN_cuMemCreate_v10020 p_cuMemCreate;
static PFN_cuMemAddressReserve_v10020 p_cuMemAddressReserve;
static PFN_cuMemMap_v10020 p_cuMemMap;
static PFN_cuMemSetAccess_v10020 p_cuMemSetAccess;
static PFN_cuMemUnmap_v10020 p_cuMemUnmap;
static PFN_cuMemRelease_v10020 p_cuMemRelease;
static PFN_cuMemAddressFree_v10020 p_cuMemAddressFree;
static PFN_cuMemGetAllocationGranularity_v10020 p_cuMemGetAllocationGranularity;
static int legacy;

static void *entry_point(const char *name) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (legacy)
        CHECK_RT(cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &status));
    else
        CHECK_RT(cudaGetDriverEntryPointByVersion(name, &fn, 12030, cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || !fn) {
        fprintf(stderr, "no driver entry point %s (status %d)\n", name, status);
        exit(1);
    }
    return fn;
}

/* Creates a chunk of physical memory and maps it at `va` (ExpandableSegment::map). */
NOINLINE CUmemGenericAllocationHandle map_chunk(CUdeviceptr va, size_t size) {
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle handle = 0;
    CHECK_CU(p_cuMemCreate(&handle, size, &prop, 0));
    CHECK_CU(p_cuMemMap(va, size, 0, handle, 0));
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK_CU(p_cuMemSetAccess(va, size, &access, 1));
    return handle;
}

NOINLINE void unmap_chunk(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle handle) {
    CHECK_CU(p_cuMemUnmap(va, size));
    CHECK_CU(p_cuMemRelease(handle));
}

int main(int argc, char **argv) {
    legacy = argc > 1 && strcmp(argv[1], "legacy") == 0;
    CHECK_RT(cudaSetDevice(0));
    p_cuMemCreate = (PFN_cuMemCreate_v10020)entry_point("cuMemCreate");
    p_cuMemAddressReserve = (PFN_cuMemAddressReserve_v10020)entry_point("cuMemAddressReserve");
    p_cuMemMap = (PFN_cuMemMap_v10020)entry_point("cuMemMap");
    p_cuMemSetAccess = (PFN_cuMemSetAccess_v10020)entry_point("cuMemSetAccess");
    p_cuMemUnmap = (PFN_cuMemUnmap_v10020)entry_point("cuMemUnmap");
    p_cuMemRelease = (PFN_cuMemRelease_v10020)entry_point("cuMemRelease");
    p_cuMemAddressFree = (PFN_cuMemAddressFree_v10020)entry_point("cuMemAddressFree");
    p_cuMemGetAllocationGranularity = (PFN_cuMemGetAllocationGranularity_v10020)entry_point(
        "cuMemGetAllocationGranularity");

    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    size_t granularity = 0;
    CHECK_CU(p_cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));

    /* Unknown names are answered with status "symbol not found". */
    void *missing = (void *)1;
    cudaDriverEntryPointQueryResult missing_status = cudaDriverEntryPointSuccess;
    cudaError_t missing_error =
        cudaGetDriverEntryPointByVersion("cuNoSuchFunction", &missing, 12030, cudaEnableDefault,
                                         &missing_status);

    CUdeviceptr base = 0;
    CHECK_CU(p_cuMemAddressReserve(&base, 1024 * MIB, 0, 0, 0));
    const size_t sizes[4] = {2 * MIB, 20 * MIB, 20 * MIB, 20 * MIB};
    CUmemGenericAllocationHandle handles[4];
    CUdeviceptr at = base;
    CUdeviceptr chunk_va[4];
    for (int i = 0; i < 4; i++) {
        chunk_va[i] = at;
        handles[i] = map_chunk(at, sizes[i]);
        at += sizes[i];
    }
    CHECK_CU(p_cuMemRelease(handles[1])); /* still mapped: the memory stays */
    unmap_chunk(chunk_va[3], sizes[3], handles[3]);

    /* The reservation cannot be freed while chunks are mapped. */
    CUresult early_address_free = p_cuMemAddressFree(base, 1024 * MIB);

    printf("result route=%s\n", legacy ? "cudaGetDriverEntryPoint" : "cudaGetDriverEntryPointByVersion");
    printf("result granularity=%zu\n", granularity);
    printf("result reserve_ptr=0x%llx\n", base);
    for (int i = 0; i < 4; i++) printf("result chunk%d_ptr=0x%llx\n", i, chunk_va[i]);
    printf("result expected_mapped_bytes=%llu\n", 42 * MIB);
    printf("result expected_physical_bytes=%llu\n", 42 * MIB);
    printf("result missing_error=%d\n", missing_error);
    printf("result missing_status=%d\n", missing_status);
    printf("result missing_is_null=%d\n", missing == NULL);
    printf("result early_address_free_error=%d\n", early_address_free);
    printf("result getproc_cuMemCreate=%llu\n", fake_calls("getproc:cuMemCreate"));
    printf("result cuMemCreate_calls=%llu\n", fake_calls("cuMemCreate"));
    printf("result cuMemMap_calls=%llu\n", fake_calls("cuMemMap"));
    printf("result cuMemUnmap_calls=%llu\n", fake_calls("cuMemUnmap"));
    printf("result cuMemRelease_calls=%llu\n", fake_calls("cuMemRelease"));
    print_truth();
    return 0;
}
