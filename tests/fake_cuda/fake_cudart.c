/* fake_cudart.c: a fake CUDA runtime that reaches the driver the way NVIDIA's libcudart does.
 *
 * It never links libcuda. On first use it dlopen()s libcuda.so.1, dlsym()s
 * "cuGetProcAddress_v2", asks that function for "cuGetProcAddress" itself (the nested lookup)
 * and fetches every other driver entry point through the answer. An interposer therefore sees
 * this runtime's driver calls only through its dlsym and cuGetProcAddress hooks (and its
 * exported cuda* symbols when this runtime is the shared libcudart.so.13).
 *
 * Built twice: as libcudart.so.13, and with -DFAKE_CUDART_STATIC -fvisibility=hidden as an
 * object linked into "static runtime" programs (nvcc's default), whose cudaMalloc calls are
 * then internal calls that no preload can interpose.
 */
#define _GNU_SOURCE
#include "cuda_fake.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define FAKE_CUDART_VERSION 13000
#define MAX_RUNTIME_DEVICES 64

struct driver_table {
    PFN_cuGetProcAddress_v12000 getProcAddress;
    PFN_cuInit_v2000 init;
    PFN_cuDriverGetVersion_v2020 driverGetVersion;
    PFN_cuDeviceGetCount_v2000 deviceGetCount;
    PFN_cuDevicePrimaryCtxRetain_v7000 primaryCtxRetain;
    PFN_cuCtxSetCurrent_v4000 ctxSetCurrent;
    PFN_cuCtxGetCurrent_v4000 ctxGetCurrent;
    PFN_cuMemGetInfo_v3020 memGetInfo;
    PFN_cuMemAlloc_v3020 memAlloc;
    PFN_cuMemFree_v3020 memFree;
    PFN_cuMemAllocPitch_v3020 memAllocPitch;
    PFN_cuMemAllocManaged_v6000 memAllocManaged;
    PFN_cuMemAllocAsync_v11020 memAllocAsync;
    PFN_cuMemAllocAsync_v11020 memAllocAsync_ptsz;
    PFN_cuMemAllocFromPoolAsync_v11020 memAllocFromPoolAsync;
    PFN_cuMemAllocFromPoolAsync_v11020 memAllocFromPoolAsync_ptsz;
    PFN_cuMemFreeAsync_v11020 memFreeAsync;
    PFN_cuMemFreeAsync_v11020 memFreeAsync_ptsz;
};

static struct driver_table g_driver;
static cudaError_t g_init_error = cudaSuccess;
static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static CUcontext g_primary[MAX_RUNTIME_DEVICES];

static __thread int t_device;
static __thread int t_bound; /* this thread's current context is t_device's primary context */
static __thread cudaError_t t_last_error;

static int lookup(const char *symbol, void **slot, cuuint64_t flags) {
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = g_driver.getProcAddress(symbol, slot, FAKE_CUDART_VERSION, flags, &status);
    return r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *slot != NULL;
}

static void load_driver(void) {
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!libcuda) {
        g_init_error = cudaErrorInsufficientDriver;
        return;
    }
    PFN_cuGetProcAddress_v12000 bootstrap =
        (PFN_cuGetProcAddress_v12000)dlsym(libcuda, "cuGetProcAddress_v2");
    if (!bootstrap) {
        g_init_error = cudaErrorInsufficientDriver;
        return;
    }
    /* The nested lookup: from here on, the driver's own answer for "cuGetProcAddress" is used. */
    void *nested = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (bootstrap("cuGetProcAddress", &nested, FAKE_CUDART_VERSION, CU_GET_PROC_ADDRESS_DEFAULT,
                  &status) != CUDA_SUCCESS ||
        status != CU_GET_PROC_ADDRESS_SUCCESS || !nested) {
        g_init_error = cudaErrorInsufficientDriver;
        return;
    }
    g_driver.getProcAddress = (PFN_cuGetProcAddress_v12000)nested;

    const cuuint64_t dflt = CU_GET_PROC_ADDRESS_DEFAULT;
    const cuuint64_t ptsz = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    int ok = 1;
    ok &= lookup("cuInit", (void **)&g_driver.init, dflt);
    ok &= lookup("cuDriverGetVersion", (void **)&g_driver.driverGetVersion, dflt);
    ok &= lookup("cuDeviceGetCount", (void **)&g_driver.deviceGetCount, dflt);
    ok &= lookup("cuDevicePrimaryCtxRetain", (void **)&g_driver.primaryCtxRetain, dflt);
    ok &= lookup("cuCtxSetCurrent", (void **)&g_driver.ctxSetCurrent, dflt);
    ok &= lookup("cuCtxGetCurrent", (void **)&g_driver.ctxGetCurrent, dflt);
    ok &= lookup("cuMemGetInfo", (void **)&g_driver.memGetInfo, dflt);
    ok &= lookup("cuMemAlloc", (void **)&g_driver.memAlloc, dflt);
    ok &= lookup("cuMemFree", (void **)&g_driver.memFree, dflt);
    ok &= lookup("cuMemAllocPitch", (void **)&g_driver.memAllocPitch, dflt);
    ok &= lookup("cuMemAllocManaged", (void **)&g_driver.memAllocManaged, dflt);
    ok &= lookup("cuMemAllocAsync", (void **)&g_driver.memAllocAsync, dflt);
    ok &= lookup("cuMemAllocAsync", (void **)&g_driver.memAllocAsync_ptsz, ptsz);
    ok &= lookup("cuMemAllocFromPoolAsync", (void **)&g_driver.memAllocFromPoolAsync, dflt);
    ok &= lookup("cuMemAllocFromPoolAsync", (void **)&g_driver.memAllocFromPoolAsync_ptsz, ptsz);
    ok &= lookup("cuMemFreeAsync", (void **)&g_driver.memFreeAsync, dflt);
    ok &= lookup("cuMemFreeAsync", (void **)&g_driver.memFreeAsync_ptsz, ptsz);
    if (!ok || g_driver.init(0) != CUDA_SUCCESS) g_init_error = cudaErrorInsufficientDriver;
}

static cudaError_t from_driver(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUDA_ERROR_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case CUDA_ERROR_NOT_INITIALIZED: return cudaErrorInitializationError;
    case CUDA_ERROR_INVALID_DEVICE: return cudaErrorInvalidDevice;
    case CUDA_ERROR_NOT_FOUND: return cudaErrorSymbolNotFound;
    default: return cudaErrorUnknown;
    }
}

static cudaError_t record(cudaError_t e) {
    if (e != cudaSuccess) t_last_error = e;
    return e;
}

static cudaError_t driver_ready(void) {
    pthread_once(&g_init_once, load_driver);
    return g_init_error;
}

/* Makes this thread's current context the primary context of `device`, retaining it once. */
static cudaError_t bind_device(int device) {
    int count = 0;
    CUresult r = g_driver.deviceGetCount(&count);
    if (r != CUDA_SUCCESS) return from_driver(r);
    if (device < 0 || device >= count || device >= MAX_RUNTIME_DEVICES)
        return cudaErrorInvalidDevice;
    CUcontext ctx = __atomic_load_n(&g_primary[device], __ATOMIC_ACQUIRE);
    if (!ctx) {
        r = g_driver.primaryCtxRetain(&ctx, device);
        if (r != CUDA_SUCCESS) return from_driver(r);
        CUcontext expected = NULL;
        __atomic_compare_exchange_n(&g_primary[device], &expected, ctx, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
    }
    r = g_driver.ctxSetCurrent(ctx);
    if (r != CUDA_SUCCESS) return from_driver(r);
    t_device = device;
    t_bound = 1;
    return cudaSuccess;
}

/* Every device API starts here: driver loaded, the thread's device context current. */
static cudaError_t ready(void) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return e;
    return t_bound ? cudaSuccess : bind_device(t_device);
}

/* ------------------------------------------------------------------ allocation */

cudaError_t cudaMalloc(void **devPtr, size_t size) {
    if (!devPtr) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    if (size == 0) {
        *devPtr = NULL;
        return cudaSuccess;
    }
    CUdeviceptr p = 0;
    e = from_driver(g_driver.memAlloc(&p, size));
    if (e == cudaSuccess) *devPtr = (void *)(uintptr_t)p;
    return record(e);
}

cudaError_t cudaFree(void *devPtr) {
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    if (!devPtr) return cudaSuccess;
    return record(from_driver(g_driver.memFree((CUdeviceptr)(uintptr_t)devPtr)));
}

static cudaError_t malloc_async(PFN_cuMemAllocAsync_v11020 fn, void **devPtr, size_t size,
                                cudaStream_t stream) {
    if (!devPtr) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    if (size == 0) {
        *devPtr = NULL;
        return cudaSuccess;
    }
    CUdeviceptr p = 0;
    e = from_driver(fn(&p, size, stream));
    if (e == cudaSuccess) *devPtr = (void *)(uintptr_t)p;
    return record(e);
}

static cudaError_t free_async(PFN_cuMemFreeAsync_v11020 fn, void *devPtr, cudaStream_t stream) {
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    if (!devPtr) return cudaSuccess;
    return record(from_driver(fn((CUdeviceptr)(uintptr_t)devPtr, stream)));
}

static cudaError_t malloc_from_pool(PFN_cuMemAllocFromPoolAsync_v11020 fn, void **ptr,
                                    size_t size, cudaMemPool_t pool, cudaStream_t stream) {
    if (!ptr) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    CUdeviceptr p = 0;
    e = from_driver(fn(&p, size, pool, stream));
    if (e == cudaSuccess) *ptr = (void *)(uintptr_t)p;
    return record(e);
}

/* Resolve g_driver members only after ready() has run load_driver. */
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return malloc_async(g_driver.memAllocAsync, devPtr, size, hStream);
}

cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return malloc_async(g_driver.memAllocAsync_ptsz, devPtr, size, hStream);
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return free_async(g_driver.memFreeAsync, devPtr, hStream);
}

cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return free_async(g_driver.memFreeAsync_ptsz, devPtr, hStream);
}

cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t memPool,
                                    cudaStream_t stream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return malloc_from_pool(g_driver.memAllocFromPoolAsync, ptr, size, memPool, stream);
}

cudaError_t cudaMallocFromPoolAsync_ptsz(void **ptr, size_t size, cudaMemPool_t memPool,
                                         cudaStream_t stream) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return malloc_from_pool(g_driver.memAllocFromPoolAsync_ptsz, ptr, size, memPool, stream);
}

cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags) {
    if (!devPtr) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    CUdeviceptr p = 0;
    e = from_driver(g_driver.memAllocManaged(&p, size, flags));
    if (e == cudaSuccess) *devPtr = (void *)(uintptr_t)p;
    return record(e);
}

cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height) {
    if (!devPtr || !pitch) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    CUdeviceptr p = 0;
    size_t got_pitch = 0;
    e = from_driver(g_driver.memAllocPitch(&p, &got_pitch, width, height, 16));
    if (e == cudaSuccess) {
        *devPtr = (void *)(uintptr_t)p;
        *pitch = got_pitch;
    }
    return record(e);
}

cudaError_t cudaMalloc3D(struct cudaPitchedPtr *pitchedDevPtr, struct cudaExtent extent) {
    if (!pitchedDevPtr) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    CUdeviceptr p = 0;
    size_t pitch = 0;
    e = from_driver(
        g_driver.memAllocPitch(&p, &pitch, extent.width, extent.height * extent.depth, 16));
    if (e == cudaSuccess) {
        pitchedDevPtr->ptr = (void *)(uintptr_t)p;
        pitchedDevPtr->pitch = pitch;
        pitchedDevPtr->xsize = extent.width;
        pitchedDevPtr->ysize = extent.height;
    }
    return record(e);
}

/* ------------------------------------------------------------------ devices and misc */

cudaError_t cudaSetDevice(int device) {
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return record(bind_device(device));
}

cudaError_t cudaGetDevice(int *device) {
    if (!device) return record(cudaErrorInvalidValue);
    *device = t_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return record(cudaErrorInvalidValue);
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    return record(from_driver(g_driver.deviceGetCount(count)));
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    return record(from_driver(g_driver.memGetInfo(free_bytes, total_bytes)));
}

cudaError_t cudaDeviceSynchronize(void) { return record(ready()); }

cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
    static uintptr_t next_stream = 0x5000;
    if (!pStream) return record(cudaErrorInvalidValue);
    cudaError_t e = ready();
    if (e != cudaSuccess) return record(e);
    *pStream = (cudaStream_t)__atomic_add_fetch(&next_stream, 0x10, __ATOMIC_RELAXED);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream) return record(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

const char *cudaGetErrorString(cudaError_t error) {
    switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorSymbolNotFound: return "named symbol not found";
    case cudaErrorUnknown: return "unknown error";
    default: return "unrecognized error code";
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = t_last_error;
    t_last_error = cudaSuccess;
    return e;
}

cudaError_t cudaDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return record(cudaErrorInvalidValue);
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) {
        *driverVersion = 0;
        return cudaSuccess;
    }
    return record(from_driver(g_driver.driverGetVersion(driverVersion)));
}

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
    if (!runtimeVersion) return record(cudaErrorInvalidValue);
    *runtimeVersion = FAKE_CUDART_VERSION;
    return cudaSuccess;
}

/* A driver function the simulated driver does not have, answered by whatever this runtime is
 * linked with for a particular program (scripts/real-torch/runtime.c, for the real PyTorch,
 * which looks up dozens it never calls in most runs); by default none. */
__attribute__((weak)) void *fake_cudart_missing_driver_function(const char *symbol) {
    (void)symbol;
    return NULL;
}

/* Both entry-point APIs are answered by the driver's cuGetProcAddress that the nested lookup
 * returned, so an interposer sees the request in its cuGetProcAddress wrapper. */
static cudaError_t driver_entry_point(const char *symbol, void **funcPtr, int cudaVersion,
                                      unsigned long long flags,
                                      cudaDriverEntryPointQueryResult *driverStatus) {
    if (!symbol || !funcPtr) return record(cudaErrorInvalidValue);
    cudaError_t e = driver_ready();
    if (e != cudaSuccess) return record(e);
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = g_driver.getProcAddress(symbol, funcPtr, cudaVersion, flags, &status);
    if (status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND) {
        void *stand_in = fake_cudart_missing_driver_function(symbol);
        if (stand_in) {
            *funcPtr = stand_in;
            status = CU_GET_PROC_ADDRESS_SUCCESS;
            r = CUDA_SUCCESS;
        }
    }
    if (driverStatus) *driverStatus = (cudaDriverEntryPointQueryResult)status;
    return record(from_driver(r));
}

cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long flags,
                                    cudaDriverEntryPointQueryResult *driverStatus) {
    return driver_entry_point(symbol, funcPtr, FAKE_CUDART_VERSION, flags, driverStatus);
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr,
                                             unsigned int cudaVersion, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *driverStatus) {
    return driver_entry_point(symbol, funcPtr, (int)cudaVersion, flags, driverStatus);
}
