/* Driver functions the simulated driver (tests/fake_cuda/fake_cuda.c) lacks, built into the
 * libcuda.so.1 that scripts/real-torch/setup.sh makes for the real PyTorch. Releases up to 2.7
 * fill their table of driver functions (c10/cuda/driver_api.cpp) with dlsym on libcuda.so.1,
 * insisting on each name; later releases ask the runtime (cudaGetDriverEntryPoint), which
 * answers from scripts/real-torch/runtime.c. The same answers here: a device's attributes are
 * the runtime's (looked up when called: the runtime is loaded by then), every other function
 * is CUDA_ERROR_NOT_SUPPORTED (sharing memory between processes, multicast, stream memory
 * operations: nothing here uses them; the expandable route's own calls are the simulated
 * driver's). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_NOT_SUPPORTED 801

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    int (*runtime)(int *, int, int) =
        (int (*)(int *, int, int))dlsym(RTLD_DEFAULT, "cudaDeviceGetAttribute");
    if (runtime == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    return runtime(value, attribute, device) == 0 ? 0 : CUDA_ERROR_INVALID_DEVICE;
}

#define NOT_SUPPORTED(name) \
    int name(void) { return CUDA_ERROR_NOT_SUPPORTED; }
NOT_SUPPORTED(cuMemExportToShareableHandle)
NOT_SUPPORTED(cuMemImportFromShareableHandle)
NOT_SUPPORTED(cuMemsetD32Async)
NOT_SUPPORTED(cuMulticastAddDevice)
NOT_SUPPORTED(cuMulticastBindMem)
NOT_SUPPORTED(cuMulticastCreate)
NOT_SUPPORTED(cuStreamWriteValue32)
