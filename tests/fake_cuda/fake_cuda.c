/* fake_cuda.c: a fake CUDA driver (libcuda.so.1) for memsnap's GPU-less tests.
 *
 * It keeps the bookkeeping of a real driver (devices, per-thread current context, device
 * allocations, managed memory, the VMM family, cuGetProcAddress with the real versioning and
 * per-thread-stream rules) but hands out fake addresses that are never backed by memory and
 * must never be dereferenced. It also exports a "truth" API (fake_cuda_*) that tests compare
 * with what memsnap recorded. See README.md for the deliberate differences from the real driver.
 *
 * Thread safety: one mutex guards all allocator state; call counters are relaxed atomics.
 */
#define _GNU_SOURCE
#include "cuda_fake.h"

#include <ctype.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FAKE_MAX_DEVICES 16
#define FAKE_DRIVER_VERSION 13000
#define ALLOC_ALIGN 512ull
#define VMM_GRANULARITY (2ull << 20)
#define TIB (1ull << 40)

/* Address layout (all inside the x86-64 user half, like real UVA addresses):
 * device d: [DEVICE_BASE + d*1TiB, +1TiB); managed: 1 TiB; VMM reservations: 16 TiB. */
#define DEVICE_BASE 0x100000000000ull
#define MANAGED_BASE 0x300000000000ull
#define RESERVE_BASE 0x400000000000ull
#define RESERVE_SPAN (16ull * TIB)

/* ------------------------------------------------------------------ call counters */

#define FAKE_EXPORTS(X)                                                                          \
    X(cuInit)                                                                                    \
    X(cuDriverGetVersion)                                                                        \
    X(cuDeviceGet)                                                                               \
    X(cuDeviceGetCount)                                                                          \
    X(cuDevicePrimaryCtxRetain)                                                                  \
    X(cuDevicePrimaryCtxGetState)                                                                \
    X(cuDevicePrimaryCtxRelease)                                                                 \
    X(cuDevicePrimaryCtxRelease_v2)                                                              \
    X(cuCtxSetCurrent)                                                                           \
    X(cuCtxGetCurrent)                                                                           \
    X(cuCtxGetDevice)                                                                            \
    X(cuMemGetInfo_v2)                                                                           \
    X(cuGetErrorString)                                                                          \
    X(cuGetErrorName)                                                                            \
    X(cuMemAlloc_v2)                                                                             \
    X(cuMemFree_v2)                                                                              \
    X(cuMemAllocPitch_v2)                                                                        \
    X(cuMemAllocManaged)                                                                         \
    X(cuMemAllocAsync)                                                                           \
    X(cuMemAllocAsync_ptsz)                                                                      \
    X(cuMemAllocFromPoolAsync)                                                                   \
    X(cuMemAllocFromPoolAsync_ptsz)                                                              \
    X(cuMemFreeAsync)                                                                            \
    X(cuMemFreeAsync_ptsz)                                                                       \
    X(cuMemCreate)                                                                               \
    X(cuMemRelease)                                                                              \
    X(cuMemAddressReserve)                                                                       \
    X(cuMemAddressFree)                                                                          \
    X(cuMemMap)                                                                                  \
    X(cuMemUnmap)                                                                                \
    X(cuMemSetAccess)                                                                            \
    X(cuMemGetAllocationGranularity)                                                             \
    X(cuGetProcAddress)                                                                          \
    X(cuGetProcAddress_v2)

#define AS_INDEX(name) IDX_##name,
enum { FAKE_EXPORTS(AS_INDEX) N_EXPORTS };

#define AS_ENTRY(name) {#name, (void *)name},
static const struct {
    const char *name;
    void *fn;
} g_exports[N_EXPORTS] = {FAKE_EXPORTS(AS_ENTRY)};

static unsigned long long g_calls[N_EXPORTS];
static unsigned long long g_exact_lookups[N_EXPORTS];

#define COUNT(name) __atomic_fetch_add(&g_calls[IDX_##name], 1, __ATOMIC_RELAXED)

/* ------------------------------------------------------------------ configuration */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_device_count = 2;
static unsigned long long g_capacity = 80ull << 30;

/* Parses "123", "64M", "8G", "512k", "1TiB", "2GB" (binary multipliers). 0 on error. */
static unsigned long long parse_bytes(const char *text) {
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (end == text) return 0;
    unsigned long long mult = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K': mult = 1ull << 10; end++; break;
    case 'M': mult = 1ull << 20; end++; break;
    case 'G': mult = 1ull << 30; end++; break;
    case 'T': mult = 1ull << 40; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end != '\0') return 0;
    return value * mult;
}

/* A fork while another thread holds the lock must not leave the child's copy locked. */
static void lock_for_fork(void) { pthread_mutex_lock(&g_lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&g_lock); }

static void init_config(void) {
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
    const char *devices = getenv("FAKE_CUDA_DEVICES");
    if (devices && *devices) {
        int n = atoi(devices);
        if (n < 0) n = 0;
        if (n > FAKE_MAX_DEVICES) n = FAKE_MAX_DEVICES;
        g_device_count = n;
    }
    const char *capacity = getenv("FAKE_CUDA_CAPACITY");
    if (capacity && *capacity) {
        unsigned long long bytes = parse_bytes(capacity);
        if (bytes > 0 && bytes <= TIB) g_capacity = bytes;
        else fprintf(stderr, "fake_cuda: ignoring FAKE_CUDA_CAPACITY=%s\n", capacity);
    }
}

static void ensure_init(void) { pthread_once(&g_once, init_config); }

/* ------------------------------------------------------------------ first-fit regions */

enum block_kind {
    KIND_ALLOC,
    KIND_PITCH,
    KIND_ASYNC,
    KIND_POOL,
    KIND_MANAGED,
    KIND_RESERVATION,
};

struct block {
    CUdeviceptr start;
    unsigned long long span; /* bytes of address space taken (rounded) */
    unsigned long long size; /* bytes requested */
    int device;
    enum block_kind kind;
    void *stream;
};

/* A sorted array of used blocks; the gaps between them are the free ranges, so freed
 * addresses are handed out again by the next allocation that fits (first fit). */
struct region {
    CUdeviceptr base;
    CUdeviceptr limit;
    struct block *blocks;
    size_t len;
    size_t cap;
};

static struct region g_device_regions[FAKE_MAX_DEVICES];
static struct region g_managed_region;
static struct region g_reserve_region;

static unsigned long long g_live_bytes[FAKE_MAX_DEVICES];
static unsigned long long g_live_count[FAKE_MAX_DEVICES];
static unsigned long long g_physical_bytes[FAKE_MAX_DEVICES];
static unsigned long long g_mapped_bytes[FAKE_MAX_DEVICES];
static unsigned long long g_managed_bytes;

static unsigned long long align_up(unsigned long long value, unsigned long long align) {
    return (value + align - 1) / align * align;
}

static void region_setup(struct region *r, CUdeviceptr base, unsigned long long span) {
    if (r->base == 0) {
        r->base = base;
        r->limit = base + span;
    }
}

/* Finds room for `span` bytes at `align`; inserts the block. Returns 0 when the region is full
 * or memory for the bookkeeping cannot be had. Caller holds g_lock. */
static int region_alloc(struct region *r, unsigned long long span, unsigned long long align,
                        const struct block *proto, CUdeviceptr *out) {
    CUdeviceptr candidate = align_up(r->base, align);
    size_t at = 0;
    for (; at < r->len; at++) {
        if (candidate + span <= r->blocks[at].start) break;
        CUdeviceptr after = r->blocks[at].start + r->blocks[at].span;
        if (after > candidate) candidate = align_up(after, align);
    }
    if (candidate + span > r->limit || candidate + span < candidate) return 0;
    if (r->len == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        struct block *grown = realloc(r->blocks, cap * sizeof *grown);
        if (!grown) return 0;
        r->blocks = grown;
        r->cap = cap;
    }
    memmove(&r->blocks[at + 1], &r->blocks[at], (r->len - at) * sizeof *r->blocks);
    r->blocks[at] = *proto;
    r->blocks[at].start = candidate;
    r->blocks[at].span = span;
    r->len++;
    *out = candidate;
    return 1;
}

/* Index of the last block starting at or below `ptr`, or -1. */
static long region_floor(const struct region *r, CUdeviceptr ptr) {
    long lo = 0, hi = (long)r->len - 1, found = -1;
    while (lo <= hi) {
        long mid = lo + (hi - lo) / 2;
        if (r->blocks[mid].start <= ptr) {
            found = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return found;
}

static long region_find_exact(const struct region *r, CUdeviceptr ptr) {
    long i = region_floor(r, ptr);
    return (i >= 0 && r->blocks[i].start == ptr) ? i : -1;
}

static void region_remove(struct region *r, long index) {
    memmove(&r->blocks[index], &r->blocks[index + 1],
            (r->len - (size_t)index - 1) * sizeof *r->blocks);
    r->len--;
}

/* ------------------------------------------------------------------ contexts */

static __thread CUcontext t_context; /* NULL until cuCtxSetCurrent */

static int current_device(void) {
    return t_context ? (int)((uintptr_t)t_context - 1) : 0;
}

static int valid_device(int device) { return device >= 0 && device < g_device_count; }

static unsigned long long device_used(int device) {
    return g_live_bytes[device] + g_physical_bytes[device];
}

CUresult cuInit(unsigned int flags) {
    COUNT(cuInit);
    ensure_init();
    return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    COUNT(cuDriverGetVersion);
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    COUNT(cuDeviceGet);
    ensure_init();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    COUNT(cuDeviceGetCount);
    ensure_init();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_device_count;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    COUNT(cuDevicePrimaryCtxRetain);
    ensure_init();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pctx = (CUcontext)(uintptr_t)(dev + 1);
    return CUDA_SUCCESS;
}

/* Every device's primary context counts as active once the driver is initialized. */
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    COUNT(cuDevicePrimaryCtxGetState);
    ensure_init();
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = 1;
    return CUDA_SUCCESS;
}

static CUresult primary_ctx_release(CUdevice dev) {
    ensure_init();
    return valid_device(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    COUNT(cuDevicePrimaryCtxRelease);
    return primary_ctx_release(dev);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    COUNT(cuDevicePrimaryCtxRelease_v2);
    return primary_ctx_release(dev);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    COUNT(cuCtxSetCurrent);
    ensure_init();
    if (ctx && !valid_device((int)((uintptr_t)ctx - 1))) return CUDA_ERROR_INVALID_CONTEXT;
    t_context = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    COUNT(cuCtxGetCurrent);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_context;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    COUNT(cuCtxGetDevice);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = current_device();
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    COUNT(cuMemGetInfo_v2);
    ensure_init();
    int device = current_device();
    if (!valid_device(device)) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    unsigned long long used = device_used(device);
    pthread_mutex_unlock(&g_lock);
    if (free_bytes) *free_bytes = used >= g_capacity ? 0 : g_capacity - used;
    if (total_bytes) *total_bytes = g_capacity;
    return CUDA_SUCCESS;
}

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
};

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    COUNT(cuGetErrorString);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    COUNT(cuGetErrorName);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == error) {
            *pStr = g_errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ device allocations */

static CUresult device_alloc(CUdeviceptr *dptr, size_t bytesize, enum block_kind kind,
                             void *stream) {
    ensure_init();
    if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    int device = current_device();
    if (!valid_device(device)) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    struct region *r = &g_device_regions[device];
    region_setup(r, DEVICE_BASE + (unsigned long long)device * TIB, TIB);
    if (device_used(device) + bytesize <= g_capacity) {
        struct block proto = {.size = bytesize, .device = device, .kind = kind, .stream = stream};
        CUdeviceptr ptr = 0;
        if (region_alloc(r, align_up(bytesize, ALLOC_ALIGN), ALLOC_ALIGN, &proto, &ptr)) {
            g_live_bytes[device] += bytesize;
            g_live_count[device]++;
            *dptr = ptr;
            result = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* Frees a cuMemAlloc*-family pointer of any device (unified addressing: the current context
 * does not have to be the owner's). */
static CUresult device_free(CUdeviceptr dptr) {
    ensure_init();
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (int d = 0; d < g_device_count; d++) {
        struct region *r = &g_device_regions[d];
        if (dptr < r->base || dptr >= r->limit) continue;
        long i = region_find_exact(r, dptr);
        if (i >= 0) {
            g_live_bytes[d] -= r->blocks[i].size;
            g_live_count[d]--;
            region_remove(r, i);
            result = CUDA_SUCCESS;
        }
        break;
    }
    if (result != CUDA_SUCCESS && dptr >= g_managed_region.base && dptr < g_managed_region.limit) {
        long i = region_find_exact(&g_managed_region, dptr);
        if (i >= 0) {
            g_managed_bytes -= g_managed_region.blocks[i].size;
            region_remove(&g_managed_region, i);
            result = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    COUNT(cuMemAlloc_v2);
    return device_alloc(dptr, bytesize, KIND_ALLOC, NULL);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    COUNT(cuMemFree_v2);
    if (dptr == 0) return CUDA_SUCCESS;
    return device_free(dptr);
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    COUNT(cuMemAllocPitch_v2);
    if (!dptr || !pPitch || WidthInBytes == 0 || Height == 0) return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16)
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = align_up(WidthInBytes, ALLOC_ALIGN);
    CUresult result = device_alloc(dptr, pitch * Height, KIND_PITCH, NULL);
    if (result == CUDA_SUCCESS) *pPitch = pitch;
    return result;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    COUNT(cuMemAllocManaged);
    ensure_init();
    if (!dptr || bytesize == 0 || (flags != 1 && flags != 2)) return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    region_setup(&g_managed_region, MANAGED_BASE, TIB);
    struct block proto = {.size = bytesize, .device = current_device(), .kind = KIND_MANAGED};
    CUdeviceptr ptr = 0;
    if (region_alloc(&g_managed_region, align_up(bytesize, ALLOC_ALIGN), ALLOC_ALIGN, &proto,
                     &ptr)) {
        g_managed_bytes += bytesize;
        *dptr = ptr;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    COUNT(cuMemAllocAsync);
    return device_alloc(dptr, bytesize, KIND_ASYNC, hStream);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    COUNT(cuMemAllocAsync_ptsz);
    return device_alloc(dptr, bytesize, KIND_ASYNC, hStream);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    COUNT(cuMemAllocFromPoolAsync);
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(dptr, bytesize, KIND_POOL, hStream);
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    COUNT(cuMemAllocFromPoolAsync_ptsz);
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(dptr, bytesize, KIND_POOL, hStream);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    COUNT(cuMemFreeAsync);
    (void)hStream;
    if (dptr == 0) return CUDA_SUCCESS;
    return device_free(dptr);
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    COUNT(cuMemFreeAsync_ptsz);
    (void)hStream;
    if (dptr == 0) return CUDA_SUCCESS;
    return device_free(dptr);
}

/* ------------------------------------------------------------------ virtual memory management */

struct vmm_handle {
    CUmemGenericAllocationHandle id;
    unsigned long long size;
    int device; /* -1: host memory (location types 2, 3, 4) */
    int released;
    int map_count;
};

struct vmm_mapping {
    CUdeviceptr va;
    unsigned long long size;
    CUmemGenericAllocationHandle handle;
};

static struct vmm_handle *g_handles;
static size_t g_handles_len, g_handles_cap;
static struct vmm_mapping *g_mappings;
static size_t g_mappings_len, g_mappings_cap;
static CUmemGenericAllocationHandle g_next_handle = 0x1000;

static int grow(void **items, size_t *cap, size_t len, size_t item_size) {
    if (len < *cap) return 1;
    size_t new_cap = *cap ? *cap * 2 : 64;
    void *grown = realloc(*items, new_cap * item_size);
    if (!grown) return 0;
    *items = grown;
    *cap = new_cap;
    return 1;
}

static struct vmm_handle *find_handle(CUmemGenericAllocationHandle id) {
    for (size_t i = 0; i < g_handles_len; i++)
        if (g_handles[i].id == id) return &g_handles[i];
    return NULL;
}

/* Drops the physical memory of a handle once it is released and unmapped. */
static void maybe_destroy_handle(struct vmm_handle *h) {
    if (!h->released || h->map_count > 0) return;
    if (h->device >= 0) g_physical_bytes[h->device] -= h->size;
    *h = g_handles[--g_handles_len];
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    COUNT(cuMemCreate);
    ensure_init();
    if (!handle || !prop || flags != 0 || size == 0 || size % VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    int device = -1;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (!valid_device(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
        device = prop->location.id;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    if ((device < 0 || device_used(device) + size <= g_capacity) &&
        grow((void **)&g_handles, &g_handles_cap, g_handles_len, sizeof *g_handles)) {
        struct vmm_handle *h = &g_handles[g_handles_len++];
        h->id = g_next_handle;
        g_next_handle += 0x10;
        h->size = size;
        h->device = device;
        h->released = 0;
        h->map_count = 0;
        if (device >= 0) g_physical_bytes[device] += size;
        *handle = h->id;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    COUNT(cuMemRelease);
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct vmm_handle *h = find_handle(handle);
    if (h && !h->released) {
        h->released = 1;
        maybe_destroy_handle(h);
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    COUNT(cuMemAddressReserve);
    (void)addr; /* a hint only; the real driver may ignore it too */
    ensure_init();
    if (!ptr || size == 0 || size % VMM_GRANULARITY != 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment == 0) alignment = VMM_GRANULARITY;
    if ((alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
    if (alignment < VMM_GRANULARITY) alignment = VMM_GRANULARITY;
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    region_setup(&g_reserve_region, RESERVE_BASE, RESERVE_SPAN);
    struct block proto = {.size = size, .device = -1, .kind = KIND_RESERVATION};
    CUdeviceptr va = 0;
    if (region_alloc(&g_reserve_region, size, alignment, &proto, &va)) {
        *ptr = va;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

static int overlaps(CUdeviceptr a, unsigned long long a_size, CUdeviceptr b,
                    unsigned long long b_size) {
    return a < b + b_size && b < a + a_size;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    COUNT(cuMemAddressFree);
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    long i = region_find_exact(&g_reserve_region, ptr);
    if (i >= 0 && g_reserve_region.blocks[i].size == size) {
        int still_mapped = 0;
        for (size_t m = 0; m < g_mappings_len; m++)
            if (overlaps(g_mappings[m].va, g_mappings[m].size, ptr, size)) still_mapped = 1;
        if (!still_mapped) {
            region_remove(&g_reserve_region, i);
            result = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    COUNT(cuMemMap);
    if (size == 0 || flags != 0 || ptr % VMM_GRANULARITY != 0 || size % VMM_GRANULARITY != 0 ||
        offset % VMM_GRANULARITY != 0)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    long r = region_floor(&g_reserve_region, ptr);
    struct vmm_handle *h = find_handle(handle);
    int inside = r >= 0 && ptr + size <= g_reserve_region.blocks[r].start +
                                              g_reserve_region.blocks[r].size;
    int free_range = 1;
    for (size_t m = 0; m < g_mappings_len; m++)
        if (overlaps(g_mappings[m].va, g_mappings[m].size, ptr, size)) free_range = 0;
    if (inside && free_range && h && !h->released && offset + size <= h->size &&
        grow((void **)&g_mappings, &g_mappings_cap, g_mappings_len, sizeof *g_mappings)) {
        g_mappings[g_mappings_len++] = (struct vmm_mapping){ptr, size, handle};
        h->map_count++;
        if (h->device >= 0) g_mapped_bytes[h->device] += size;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* Unmaps every mapping inside [ptr, ptr+size). Like the real driver, the range may span several
 * whole mappings but must not cut one. */
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    COUNT(cuMemUnmap);
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    size_t inside = 0;
    int cut = 0;
    for (size_t m = 0; m < g_mappings_len; m++) {
        const struct vmm_mapping *map = &g_mappings[m];
        if (!overlaps(map->va, map->size, ptr, size)) continue;
        if (map->va >= ptr && map->va + map->size <= ptr + size) inside++;
        else cut = 1;
    }
    if (inside > 0 && !cut) {
        size_t m = 0;
        while (m < g_mappings_len) {
            struct vmm_mapping map = g_mappings[m];
            if (!overlaps(map.va, map.size, ptr, size)) {
                m++;
                continue;
            }
            g_mappings[m] = g_mappings[--g_mappings_len];
            struct vmm_handle *h = find_handle(map.handle);
            if (h) {
                h->map_count--;
                if (h->device >= 0) g_mapped_bytes[h->device] -= map.size;
                maybe_destroy_handle(h);
            }
        }
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return result;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    COUNT(cuMemSetAccess);
    (void)ptr;
    (void)size;
    if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
    COUNT(cuMemGetAllocationGranularity);
    (void)option;
    if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ cuGetProcAddress */

/* How the real driver answers a base name: the ABI version is picked by cudaVersion
 * (`newer` from `newer_version` on), the per-thread-default-stream flag picks `ptsz`. */
struct proc_entry {
    const char *base;
    int min_version;
    const char *name;
    int newer_version;
    const char *newer;
    const char *ptsz;
};

static const struct proc_entry g_procs[] = {
    {"cuInit", 2000, "cuInit", 0, NULL, NULL},
    {"cuDriverGetVersion", 2020, "cuDriverGetVersion", 0, NULL, NULL},
    {"cuDeviceGet", 2000, "cuDeviceGet", 0, NULL, NULL},
    {"cuDeviceGetCount", 2000, "cuDeviceGetCount", 0, NULL, NULL},
    {"cuDevicePrimaryCtxRetain", 7000, "cuDevicePrimaryCtxRetain", 0, NULL, NULL},
    {"cuDevicePrimaryCtxRelease", 7000, "cuDevicePrimaryCtxRelease", 11000,
     "cuDevicePrimaryCtxRelease_v2", NULL},
    {"cuCtxSetCurrent", 4000, "cuCtxSetCurrent", 0, NULL, NULL},
    {"cuCtxGetCurrent", 4000, "cuCtxGetCurrent", 0, NULL, NULL},
    {"cuCtxGetDevice", 2000, "cuCtxGetDevice", 0, NULL, NULL},
    {"cuMemGetInfo", 3020, "cuMemGetInfo_v2", 0, NULL, NULL},
    {"cuGetErrorString", 6000, "cuGetErrorString", 0, NULL, NULL},
    {"cuGetErrorName", 6000, "cuGetErrorName", 0, NULL, NULL},
    {"cuMemAlloc", 3020, "cuMemAlloc_v2", 0, NULL, NULL},
    {"cuMemFree", 3020, "cuMemFree_v2", 0, NULL, NULL},
    {"cuMemAllocPitch", 3020, "cuMemAllocPitch_v2", 0, NULL, NULL},
    {"cuMemAllocManaged", 6000, "cuMemAllocManaged", 0, NULL, NULL},
    {"cuMemAllocAsync", 11020, "cuMemAllocAsync", 0, NULL, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 11020, "cuMemAllocFromPoolAsync", 0, NULL,
     "cuMemAllocFromPoolAsync_ptsz"},
    {"cuMemFreeAsync", 11020, "cuMemFreeAsync", 0, NULL, "cuMemFreeAsync_ptsz"},
    {"cuMemCreate", 10020, "cuMemCreate", 0, NULL, NULL},
    {"cuMemRelease", 10020, "cuMemRelease", 0, NULL, NULL},
    {"cuMemAddressReserve", 10020, "cuMemAddressReserve", 0, NULL, NULL},
    {"cuMemAddressFree", 10020, "cuMemAddressFree", 0, NULL, NULL},
    {"cuMemMap", 10020, "cuMemMap", 0, NULL, NULL},
    {"cuMemUnmap", 10020, "cuMemUnmap", 0, NULL, NULL},
    {"cuMemSetAccess", 10020, "cuMemSetAccess", 0, NULL, NULL},
    {"cuMemGetAllocationGranularity", 10020, "cuMemGetAllocationGranularity", 0, NULL, NULL},
    {"cuGetProcAddress", 11030, "cuGetProcAddress", 12000, "cuGetProcAddress_v2", NULL},
};

#define N_PROCS (sizeof g_procs / sizeof g_procs[0])
static unsigned long long g_base_lookups[N_PROCS];

static long export_index(const char *name) {
    for (long i = 0; i < N_EXPORTS; i++)
        if (strcmp(g_exports[i].name, name) == 0) return i;
    return -1;
}

static CUresult get_proc_address(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    ensure_init();
    if (!symbol || !pfn || (flags & ~(cuuint64_t)3) != 0) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < N_PROCS; i++) {
        const struct proc_entry *e = &g_procs[i];
        if (strcmp(e->base, symbol) != 0) continue;
        __atomic_fetch_add(&g_base_lookups[i], 1, __ATOMIC_RELAXED);
        if (cudaVersion < e->min_version) {
            if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        const char *name = e->name;
        if (e->newer && cudaVersion >= e->newer_version) name = e->newer;
        if (e->ptsz && (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) name = e->ptsz;
        *pfn = g_exports[export_index(name)].fn;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    long i = export_index(symbol); /* exact versioned names, for robustness */
    if (i >= 0) {
        __atomic_fetch_add(&g_exact_lookups[i], 1, __ATOMIC_RELAXED);
        *pfn = g_exports[i].fn;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    COUNT(cuGetProcAddress);
    return get_proc_address(symbol, pfn, cudaVersion, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    COUNT(cuGetProcAddress_v2);
    return get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}

/* ------------------------------------------------------------------ truth API */

unsigned long long fake_cuda_live_bytes(int device) {
    ensure_init();
    if (!valid_device(device)) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_live_bytes[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

unsigned long long fake_cuda_live_count(int device) {
    ensure_init();
    if (!valid_device(device)) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_live_count[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

unsigned long long fake_cuda_vmm_mapped_bytes(int device) {
    ensure_init();
    if (!valid_device(device)) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_mapped_bytes[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

unsigned long long fake_cuda_vmm_physical_bytes(int device) {
    ensure_init();
    if (!valid_device(device)) return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_physical_bytes[device];
    pthread_mutex_unlock(&g_lock);
    return v;
}

unsigned long long fake_cuda_managed_bytes(void) {
    pthread_mutex_lock(&g_lock);
    unsigned long long v = g_managed_bytes;
    pthread_mutex_unlock(&g_lock);
    return v;
}

/* Looks up a live cuMemAlloc-family or managed allocation starting at `ptr`. Returns 1 and fills
 * the non-NULL out-params (requested size, device, kind as in `enum block_kind`: 0 alloc,
 * 1 pitch, 2 async, 3 pool, 4 managed; the stream given at allocation), or 0 when none. */
int fake_cuda_lookup(unsigned long long ptr, unsigned long long *size, int *device, int *kind,
                     void **stream) {
    ensure_init();
    int found = 0;
    pthread_mutex_lock(&g_lock);
    struct region *regions[FAKE_MAX_DEVICES + 1];
    int n = 0;
    for (int d = 0; d < g_device_count; d++) regions[n++] = &g_device_regions[d];
    regions[n++] = &g_managed_region;
    for (int i = 0; i < n && !found; i++) {
        long at = region_find_exact(regions[i], ptr);
        if (at < 0) continue;
        const struct block *b = &regions[i]->blocks[at];
        if (size) *size = b->size;
        if (device) *device = b->device;
        if (kind) *kind = (int)b->kind;
        if (stream) *stream = b->stream;
        found = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Calls of an exported driver function by its exported name ("cuMemAlloc_v2"), or with the
 * prefix "getproc:" the cuGetProcAddress lookups of a symbol ("getproc:cuGetProcAddress"). */
unsigned long long fake_cuda_calls(const char *name) {
    if (!name) return 0;
    if (strncmp(name, "getproc:", 8) == 0) {
        const char *symbol = name + 8;
        for (size_t i = 0; i < N_PROCS; i++)
            if (strcmp(g_procs[i].base, symbol) == 0)
                return __atomic_load_n(&g_base_lookups[i], __ATOMIC_RELAXED);
        long i = export_index(symbol);
        return i >= 0 ? __atomic_load_n(&g_exact_lookups[i], __ATOMIC_RELAXED) : 0;
    }
    long i = export_index(name);
    return i >= 0 ? __atomic_load_n(&g_calls[i], __ATOMIC_RELAXED) : 0;
}

static int format_truth(char *buf, size_t cap) {
    ensure_init();
    size_t len = 0;
    pthread_mutex_lock(&g_lock);
    for (int d = 0; d < g_device_count && len < cap; d++) {
        len += (size_t)snprintf(buf + len, cap - len,
                                "truth device=%d live_bytes=%llu live_count=%llu mapped_bytes=%llu "
                                "physical_bytes=%llu capacity=%llu\n",
                                d, g_live_bytes[d], g_live_count[d], g_mapped_bytes[d],
                                g_physical_bytes[d], g_capacity);
    }
    if (len < cap)
        len += (size_t)snprintf(buf + len, cap - len, "truth managed_bytes=%llu\n",
                                g_managed_bytes);
    pthread_mutex_unlock(&g_lock);
    return len < cap ? (int)len : (int)cap - 1;
}

void fake_cuda_print_truth(FILE *out) {
    char buf[FAKE_MAX_DEVICES * 160 + 64];
    format_truth(buf, sizeof buf);
    fputs(buf, out);
    fflush(out);
}

void fake_cuda_print_truth_fd(int fd) {
    char buf[FAKE_MAX_DEVICES * 160 + 64];
    int len = format_truth(buf, sizeof buf);
    for (int done = 0; done < len;) {
        ssize_t n = write(fd, buf + done, (size_t)(len - done));
        if (n <= 0) break;
        done += (int)n;
    }
}
