/* driver_checks.c: checks the fake driver's contract (what the real driver does) through
 * dlopen + dlsym, one `result check_<name>=1/0` line per rule and `result all_ok=1/0`.
 * Run with FAKE_CUDA_CAPACITY=64M. Rules covered: cuGetProcAddress version and
 * per-thread-stream selection, the nested "cuGetProcAddress" answer, unknown symbols, too-low
 * versions, exact versioned names, bad flags; error codes and untouched out-params on OOM;
 * VMM rules (mapping inside a reservation, unmap of whole mappings only, release semantics).
 * With an interposer preloaded the pointer-identity checks compare the interposer's answers
 * with each other, so they must still hold. */
#include "prog_common.h"

#include <stdint.h>

#define MIB (1ull << 20)

static void *libcuda;
static int all_ok = 1;

static void check(const char *name, int ok) {
    printf("result check_%s=%d\n", name, ok ? 1 : 0);
    if (!ok) all_ok = 0;
}

static void *sym(const char *name) {
    void *fn = dlsym(libcuda, name);
    if (!fn) {
        fprintf(stderr, "dlsym(libcuda, %s) failed\n", name);
        exit(1);
    }
    return fn;
}

int main(void) {
    libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!libcuda) {
        fprintf(stderr, "dlopen(libcuda.so.1): %s\n", dlerror());
        return 1;
    }
    PFN_cuGetProcAddress_v12000 gpa2 = (PFN_cuGetProcAddress_v12000)sym("cuGetProcAddress_v2");
    PFN_cuGetProcAddress_v11030 gpa1 = (PFN_cuGetProcAddress_v11030)sym("cuGetProcAddress");
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    void *fn = NULL;

    check("init", ((PFN_cuInit_v2000)sym("cuInit"))(0) == CUDA_SUCCESS);

    /* Base names pick the ABI by version. */
    check("getproc_alloc_v2", gpa2("cuMemAlloc", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                  st == CU_GET_PROC_ADDRESS_SUCCESS && fn == sym("cuMemAlloc_v2"));
    check("getproc_free_v2", gpa2("cuMemFree", &fn, 12030, 0, &st) == CUDA_SUCCESS &&
                                 fn == sym("cuMemFree_v2"));
    check("getproc_meminfo_v2", gpa2("cuMemGetInfo", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                    fn == sym("cuMemGetInfo_v2"));
    check("getproc_pitch_v2", gpa2("cuMemAllocPitch", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                  fn == sym("cuMemAllocPitch_v2"));
    check("getproc_ctxrelease_v2",
          gpa2("cuDevicePrimaryCtxRelease", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
              fn == sym("cuDevicePrimaryCtxRelease_v2"));
    /* The nested lookup: "cuGetProcAddress" itself, by version. */
    check("getproc_nested_v2", gpa2("cuGetProcAddress", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                   fn == (void *)gpa2);
    check("getproc_nested_v1", gpa2("cuGetProcAddress", &fn, 11080, 0, &st) == CUDA_SUCCESS &&
                                   fn == (void *)gpa1);
    /* Per-thread default stream flag picks _ptsz where one exists. */
    check("getproc_async_ptsz",
          gpa2("cuMemAllocAsync", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
               &st) == CUDA_SUCCESS &&
              fn == sym("cuMemAllocAsync_ptsz"));
    check("getproc_async_legacy",
          gpa2("cuMemAllocAsync", &fn, 13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st) ==
                  CUDA_SUCCESS &&
              fn == sym("cuMemAllocAsync"));
    check("getproc_async_default", gpa2("cuMemAllocAsync", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                       fn == sym("cuMemAllocAsync"));
    check("getproc_pool_ptsz",
          gpa2("cuMemAllocFromPoolAsync", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
               &st) == CUDA_SUCCESS &&
              fn == sym("cuMemAllocFromPoolAsync_ptsz"));
    check("getproc_freeasync_ptsz",
          gpa2("cuMemFreeAsync", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
               &st) == CUDA_SUCCESS &&
              fn == sym("cuMemFreeAsync_ptsz"));
    check("getproc_ptsz_flag_ignored_without_variant",
          gpa2("cuMemCreate", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) ==
                  CUDA_SUCCESS &&
              fn == sym("cuMemCreate"));
    /* The four-argument ABI answers the same way. */
    check("getproc_v1_abi", gpa1("cuMemFree", &fn, 13000, 0) == CUDA_SUCCESS &&
                                fn == sym("cuMemFree_v2"));
    /* Exact versioned names are accepted. */
    check("getproc_exact_name", gpa2("cuMemAlloc_v2", &fn, 13000, 0, &st) == CUDA_SUCCESS &&
                                    fn == sym("cuMemAlloc_v2"));
    /* Failures. */
    fn = (void *)1;
    check("getproc_unknown", gpa2("cuNoSuchFunction", &fn, 13000, 0, &st) == CUDA_ERROR_NOT_FOUND &&
                                 st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && fn == NULL);
    fn = (void *)1;
    check("getproc_version_too_low",
          gpa2("cuMemAllocAsync", &fn, 11000, 0, &st) == CUDA_ERROR_NOT_FOUND &&
              st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && fn == NULL);
    check("getproc_bad_flags", gpa2("cuMemAlloc", &fn, 13000, 4, &st) == CUDA_ERROR_INVALID_VALUE);
    check("getproc_null_status", gpa2("cuMemAlloc", &fn, 13000, 0, NULL) == CUDA_SUCCESS);

    /* Allocation errors (capacity 64 MiB expected). */
    PFN_cuMemAlloc_v3020 alloc = (PFN_cuMemAlloc_v3020)sym("cuMemAlloc_v2");
    PFN_cuMemFree_v3020 mfree = (PFN_cuMemFree_v3020)sym("cuMemFree_v2");
    PFN_cuMemGetInfo_v3020 info = (PFN_cuMemGetInfo_v3020)sym("cuMemGetInfo_v2");
    size_t free_bytes = 0, total = 0;
    check("meminfo", info(&free_bytes, &total) == CUDA_SUCCESS && free_bytes == total);
    check("meminfo_null_free", info(NULL, &total) == CUDA_SUCCESS);
    CUdeviceptr p = 0xdead;
    check("alloc_oom", alloc(&p, total + 1) == CUDA_ERROR_OUT_OF_MEMORY && p == 0xdead);
    check("alloc_zero", alloc(&p, 0) == CUDA_ERROR_INVALID_VALUE && p == 0xdead);
    CUdeviceptr a = 0, b = 0;
    check("alloc_exact_capacity", alloc(&a, total) == CUDA_SUCCESS);
    check("alloc_when_full", alloc(&b, 512) == CUDA_ERROR_OUT_OF_MEMORY && b == 0);
    check("free_full", mfree(a) == CUDA_SUCCESS);
    check("free_twice", mfree(a) == CUDA_ERROR_INVALID_VALUE);
    check("free_unknown", mfree(0x1234) == CUDA_ERROR_INVALID_VALUE);
    check("free_null", mfree(0) == CUDA_SUCCESS);
    check("alloc_reuses_address", alloc(&b, 4096) == CUDA_SUCCESS && b == a);
    check("alloc_aligned", alloc(&a, 1) == CUDA_SUCCESS && a % 512 == 0 && a == b + 4096);
    mfree(a);
    mfree(b);

    /* The truth API remembers what each live allocation was made with. */
    int (*lookup)(unsigned long long, unsigned long long *, int *, int *, void **) =
        (int (*)(unsigned long long, unsigned long long *, int *, int *, void **))sym(
            "fake_cuda_lookup");
    PFN_cuMemAllocAsync_v11020 alloc_async = (PFN_cuMemAllocAsync_v11020)sym("cuMemAllocAsync_ptsz");
    PFN_cuMemFreeAsync_v11020 free_async = (PFN_cuMemFreeAsync_v11020)sym("cuMemFreeAsync");
    CUstream stream = (CUstream)(uintptr_t)0xabc0;
    unsigned long long got_size = 0;
    int got_device = -1, got_kind = -1;
    void *got_stream = NULL;
    check("async_alloc", alloc_async(&a, 1000, stream) == CUDA_SUCCESS);
    check("lookup_async", lookup(a, &got_size, &got_device, &got_kind, &got_stream) == 1 &&
                              got_size == 1000 && got_device == 0 && got_kind == 2 &&
                              got_stream == (void *)stream);
    check("async_free_other_variant", free_async(a, NULL) == CUDA_SUCCESS &&
                                          lookup(a, NULL, NULL, NULL, NULL) == 0);

    /* VMM. */
    PFN_cuMemCreate_v10020 create = (PFN_cuMemCreate_v10020)sym("cuMemCreate");
    PFN_cuMemRelease_v10020 release = (PFN_cuMemRelease_v10020)sym("cuMemRelease");
    PFN_cuMemAddressReserve_v10020 reserve = (PFN_cuMemAddressReserve_v10020)sym("cuMemAddressReserve");
    PFN_cuMemAddressFree_v10020 addrfree = (PFN_cuMemAddressFree_v10020)sym("cuMemAddressFree");
    PFN_cuMemMap_v10020 map = (PFN_cuMemMap_v10020)sym("cuMemMap");
    PFN_cuMemUnmap_v10020 unmap = (PFN_cuMemUnmap_v10020)sym("cuMemUnmap");
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h1 = 0, h2 = 0, h3 = 0, hbig = 0x77;
    check("create_unaligned", create(&h1, MIB, &prop, 0) == CUDA_ERROR_INVALID_VALUE);
    check("create_over_capacity",
          create(&hbig, total + 2 * MIB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY && hbig == 0x77);
    prop.location.id = 99;
    check("create_bad_device", create(&h1, 2 * MIB, &prop, 0) == CUDA_ERROR_INVALID_DEVICE);
    prop.location.id = 0;
    check("create", create(&h1, 2 * MIB, &prop, 0) == CUDA_SUCCESS &&
                        create(&h2, 4 * MIB, &prop, 0) == CUDA_SUCCESS &&
                        create(&h3, 2 * MIB, &prop, 0) == CUDA_SUCCESS);
    check("meminfo_counts_physical",
          info(&free_bytes, &total) == CUDA_SUCCESS && free_bytes == total - 8 * MIB);
    CUdeviceptr va = 0, va2 = 0;
    check("reserve_unaligned", reserve(&va, MIB, 0, 0, 0) == CUDA_ERROR_INVALID_VALUE);
    check("reserve_aligned", reserve(&va, 64 * MIB, 64 * MIB, 0, 0) == CUDA_SUCCESS &&
                                 va % (64 * MIB) == 0);
    check("reserve_second", reserve(&va2, 2 * MIB, 0, 0, 0) == CUDA_SUCCESS && va2 != va);
    check("map_outside_reservation", map(0x7000000000ull, 2 * MIB, 0, h1, 0) == CUDA_ERROR_INVALID_VALUE);
    check("map_past_reservation_end", map(va2, 4 * MIB, 0, h2, 0) == CUDA_ERROR_INVALID_VALUE);
    check("map_beyond_handle", map(va, 4 * MIB, 0, h1, 0) == CUDA_ERROR_INVALID_VALUE);
    check("map", map(va, 2 * MIB, 0, h1, 0) == CUDA_SUCCESS &&
                     map(va + 2 * MIB, 4 * MIB, 0, h2, 0) == CUDA_SUCCESS &&
                     map(va + 6 * MIB, 2 * MIB, 0, h3, 0) == CUDA_SUCCESS);
    check("map_overlap", map(va, 2 * MIB, 0, h3, 0) == CUDA_ERROR_INVALID_VALUE);
    check("unmap_cuts_mapping", unmap(va + 2 * MIB, 2 * MIB) == CUDA_ERROR_INVALID_VALUE);
    check("unmap_nothing", unmap(va + 32 * MIB, 2 * MIB) == CUDA_ERROR_INVALID_VALUE);
    check("release_mapped_keeps_memory",
          release(h1) == CUDA_SUCCESS && info(&free_bytes, &total) == CUDA_SUCCESS &&
              free_bytes == total - 8 * MIB);
    check("release_twice", release(h1) == CUDA_ERROR_INVALID_VALUE);
    check("addressfree_while_mapped", addrfree(va, 64 * MIB) == CUDA_ERROR_INVALID_VALUE);
    /* One unmap covering two whole mappings (h1 released: its memory goes now). */
    check("unmap_two_mappings", unmap(va, 6 * MIB) == CUDA_SUCCESS &&
                                    info(&free_bytes, &total) == CUDA_SUCCESS &&
                                    free_bytes == total - 6 * MIB);
    check("map_after_unmap", map(va, 4 * MIB, 0, h2, 0) == CUDA_SUCCESS);
    check("unmap_rest", unmap(va, 8 * MIB) == CUDA_SUCCESS);
    check("release_unmapped", release(h2) == CUDA_SUCCESS && release(h3) == CUDA_SUCCESS &&
                                  info(&free_bytes, &total) == CUDA_SUCCESS && free_bytes == total);
    check("map_released_handle", map(va, 2 * MIB, 0, h2, 0) == CUDA_ERROR_INVALID_VALUE);
    check("addressfree_wrong_size", addrfree(va, 2 * MIB) == CUDA_ERROR_INVALID_VALUE);
    check("addressfree", addrfree(va, 64 * MIB) == CUDA_SUCCESS && addrfree(va2, 2 * MIB) == CUDA_SUCCESS);
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    prop.location.id = 0;
    check("create_host_over_capacity_ok",
          create(&h1, total + 2 * MIB, &prop, 0) == CUDA_SUCCESS && release(h1) == CUDA_SUCCESS);

    /* Contexts. */
    PFN_cuDevicePrimaryCtxRetain_v7000 retain = (PFN_cuDevicePrimaryCtxRetain_v7000)sym("cuDevicePrimaryCtxRetain");
    PFN_cuCtxSetCurrent_v4000 set_current = (PFN_cuCtxSetCurrent_v4000)sym("cuCtxSetCurrent");
    CUresult (*get_device)(CUdevice *) = (CUresult(*)(CUdevice *))sym("cuCtxGetDevice");
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    check("ctx_device1", retain(&ctx, 1) == CUDA_SUCCESS && ctx == (CUcontext)(uintptr_t)2 &&
                             set_current(ctx) == CUDA_SUCCESS && get_device(&dev) == CUDA_SUCCESS &&
                             dev == 1);
    check("alloc_on_device1", alloc(&a, 4096) == CUDA_SUCCESS &&
                                  fake_live_bytes(1) == 4096 && fake_live_bytes(0) == 0);
    check("retain_bad_device", retain(&ctx, 99) == CUDA_ERROR_INVALID_DEVICE);
    set_current((CUcontext)(uintptr_t)1);
    check("free_other_device", mfree(a) == CUDA_SUCCESS && fake_live_bytes(1) == 0);
    const char *text = NULL;
    check("error_string", ((CUresult(*)(CUresult, const char **))sym("cuGetErrorString"))(
                              CUDA_ERROR_OUT_OF_MEMORY, &text) == CUDA_SUCCESS &&
                              text && strcmp(text, "out of memory") == 0);
    check("calls_counted", fake_calls("cuMemAlloc_v2") >= 6 && fake_calls("cuNoSuchFunction") == 0);

    printf("result all_ok=%d\n", all_ok);
    print_truth();
    return 0;
}
