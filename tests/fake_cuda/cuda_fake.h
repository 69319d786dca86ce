/* cuda_fake.h: the subset of NVIDIA's cuda.h and cuda_runtime_api.h that the fake driver
 * (fake_cuda.c), the fake runtime (fake_cudart.c) and the test programs use.
 *
 * Types, enum values and struct layouts are identical to NVIDIA's headers (CUDA 13.0) for
 * every field used; the static asserts at the end pin the layouts. No API macros such as
 * `#define cuMemAlloc cuMemAlloc_v2`: callers name the versioned symbol explicitly, which is
 * what the binaries built against NVIDIA's headers end up calling anyway.
 */
#ifndef MEMSNAP_CUDA_FAKE_H
#define MEMSNAP_CUDA_FAKE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- driver API types */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
};

/* CUmemLocationType */
typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    CU_MEM_LOCATION_TYPE_HOST = 0x2,
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3,
    CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 0x4,
} CUmemLocationType;

typedef enum CUmemAllocationType_enum {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType_enum {
    CU_MEM_HANDLE_TYPE_NONE = 0x0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
} CUmemAllocationHandleType;

typedef enum CUmemAccess_flags_enum {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags_enum {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CUmemAllocationGranularity_flags;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc;

/* cuGetProcAddress flags */
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

typedef enum CUdriverProcAddressQueryResult_enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
} CUdriverProcAddressQueryResult;

#define CU_MEM_ATTACH_GLOBAL 0x1

/* ---------------------------------------------------------------- driver API functions */

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxGetDevice(CUdevice *device);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuGetErrorName(CUresult error, const char **pStr);

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option);

/* The exported symbol `cuGetProcAddress` keeps the CUDA 11.3 four-argument ABI; NVIDIA's
 * CUDA 12+ header maps the name cuGetProcAddress to cuGetProcAddress_v2 (five arguments). */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);

/* Function-pointer types of the entry points (NVIDIA's cudaTypedefs.h names them
 * PFN_cuMemAlloc_v3020 and so on). */
typedef CUresult (*PFN_cuGetProcAddress_v11030)(const char *, void **, int, cuuint64_t);
typedef CUresult (*PFN_cuGetProcAddress_v12000)(const char *, void **, int, cuuint64_t,
                                                CUdriverProcAddressQueryResult *);
typedef CUresult (*PFN_cuInit_v2000)(unsigned int);
typedef CUresult (*PFN_cuDriverGetVersion_v2020)(int *);
typedef CUresult (*PFN_cuDeviceGetCount_v2000)(int *);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain_v7000)(CUcontext *, CUdevice);
typedef CUresult (*PFN_cuCtxSetCurrent_v4000)(CUcontext);
typedef CUresult (*PFN_cuCtxGetCurrent_v4000)(CUcontext *);
typedef CUresult (*PFN_cuMemGetInfo_v3020)(size_t *, size_t *);
typedef CUresult (*PFN_cuMemAlloc_v3020)(CUdeviceptr *, size_t);
typedef CUresult (*PFN_cuMemFree_v3020)(CUdeviceptr);
typedef CUresult (*PFN_cuMemAllocPitch_v3020)(CUdeviceptr *, size_t *, size_t, size_t,
                                              unsigned int);
typedef CUresult (*PFN_cuMemAllocManaged_v6000)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*PFN_cuMemAllocAsync_v11020)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*PFN_cuMemAllocFromPoolAsync_v11020)(CUdeviceptr *, size_t, CUmemoryPool,
                                                       CUstream);
typedef CUresult (*PFN_cuMemFreeAsync_v11020)(CUdeviceptr, CUstream);
typedef CUresult (*PFN_cuMemCreate_v10020)(CUmemGenericAllocationHandle *, size_t,
                                           const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*PFN_cuMemRelease_v10020)(CUmemGenericAllocationHandle);
typedef CUresult (*PFN_cuMemAddressReserve_v10020)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                                   unsigned long long);
typedef CUresult (*PFN_cuMemAddressFree_v10020)(CUdeviceptr, size_t);
typedef CUresult (*PFN_cuMemMap_v10020)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                        unsigned long long);
typedef CUresult (*PFN_cuMemUnmap_v10020)(CUdeviceptr, size_t);
typedef CUresult (*PFN_cuMemSetAccess_v10020)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*PFN_cuMemGetAllocationGranularity_v10020)(size_t *, const CUmemAllocationProp *,
                                                             CUmemAllocationGranularity_flags);

/* ---------------------------------------------------------------- fake-only truth API */

unsigned long long fake_cuda_live_bytes(int device);
unsigned long long fake_cuda_live_count(int device);
unsigned long long fake_cuda_vmm_mapped_bytes(int device);
unsigned long long fake_cuda_vmm_physical_bytes(int device);
unsigned long long fake_cuda_managed_bytes(void);
unsigned long long fake_cuda_calls(const char *name);
int fake_cuda_lookup(unsigned long long ptr, unsigned long long *size, int *device, int *kind,
                     void **stream);
void fake_cuda_print_truth(FILE *out);
void fake_cuda_print_truth_fd(int fd);

/* ---------------------------------------------------------------- runtime API types */

typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUmemPoolHandle_st *cudaMemPool_t;

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInsufficientDriver = 35,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorSymbolNotFound = 500,
    cudaErrorUnknown = 999,
};

/* cudaGetDriverEntryPoint flags (same values as the CU_GET_PROC_ADDRESS_* flags) */
enum {
    cudaEnableDefault = 0x0,
    cudaEnableLegacyStream = 0x1,
    cudaEnablePerThreadDefaultStream = 0x2,
};

typedef enum cudaDriverEntryPointQueryResult {
    cudaDriverEntryPointSuccess = 0,
    cudaDriverEntryPointSymbolNotFound = 1,
    cudaDriverEntryPointVersionNotSufficent = 2,
} cudaDriverEntryPointQueryResult;

#define cudaMemAttachGlobal 0x01

struct cudaPitchedPtr {
    void *ptr;
    size_t pitch;
    size_t xsize;
    size_t ysize;
};

struct cudaExtent {
    size_t width;
    size_t height;
    size_t depth;
};

/* ---------------------------------------------------------------- runtime API functions */

cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream);
cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t hStream);
cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t memPool,
                                    cudaStream_t stream);
cudaError_t cudaMallocFromPoolAsync_ptsz(void **ptr, size_t size, cudaMemPool_t memPool,
                                         cudaStream_t stream);
cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags);
cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height);
cudaError_t cudaMalloc3D(struct cudaPitchedPtr *pitchedDevPtr, struct cudaExtent extent);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
const char *cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError(void);
cudaError_t cudaDriverGetVersion(int *driverVersion);
cudaError_t cudaRuntimeGetVersion(int *runtimeVersion);
cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long flags,
                                    cudaDriverEntryPointQueryResult *driverStatus);
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **funcPtr,
                                             unsigned int cudaVersion, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult *driverStatus);

/* ---------------------------------------------------------------- layout pins */

#ifdef __cplusplus
#define FAKE_CUDA_STATIC_ASSERT static_assert
#else
#define FAKE_CUDA_STATIC_ASSERT _Static_assert
#endif

FAKE_CUDA_STATIC_ASSERT(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
FAKE_CUDA_STATIC_ASSERT(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
FAKE_CUDA_STATIC_ASSERT(offsetof(CUmemAllocationProp, location) == 8,
                        "CUmemAllocationProp.location");
FAKE_CUDA_STATIC_ASSERT(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16,
                        "CUmemAllocationProp.win32HandleMetaData");
FAKE_CUDA_STATIC_ASSERT(offsetof(CUmemAllocationProp, allocFlags) == 24,
                        "CUmemAllocationProp.allocFlags");
FAKE_CUDA_STATIC_ASSERT(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
FAKE_CUDA_STATIC_ASSERT(sizeof(struct cudaPitchedPtr) == 32, "cudaPitchedPtr layout");
FAKE_CUDA_STATIC_ASSERT(sizeof(struct cudaExtent) == 24, "cudaExtent layout");

#ifdef __cplusplus
}
#endif

#endif /* MEMSNAP_CUDA_FAKE_H */
