/* What the real PyTorch asks of the CUDA runtime beyond tests/fake_cuda/fake_cudart.c when it
 * initializes a device and runs its caching allocator, for scripts/bench/real_torch_setup.sh:
 * linked into the simulated libcudart.so.13 beside the fake runtime. The device it describes
 * is the simulated driver's: a name, the memory the driver reports, compute capability 9.0
 * (PyTorch warns about a device it was not built for; nothing here runs kernels). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void *cudaStream_t;

/* cudaDeviceProp of CUDA 13: the fields written here sit at the same offsets as in CUDA 12
 * (name[256], uuid, luid, luidDeviceNodeMask, then totalGlobalMem at 288, ..., major at 360,
 * minor at 364). PyTorch value-initializes the structure it passes; the rest stays zero. */
enum { PROP_TOTAL_GLOBAL_MEM = 288, PROP_WARP_SIZE = 308, PROP_MAJOR = 360, PROP_MINOR = 364 };

int cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
int cudaSetDevice(int device);
int cudaGetDevice(int *device);

int cudaGetDeviceProperties(char *prop, int device) {
    int previous = 0;
    size_t free_bytes = 0, total_bytes = 0;
    cudaGetDevice(&previous);
    if (cudaSetDevice(device) != 0)
        return 101; /* cudaErrorInvalidDevice */
    cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaSetDevice(previous);
    strcpy(prop, "simulated CUDA device");
    memcpy(prop + PROP_TOTAL_GLOBAL_MEM, &total_bytes, sizeof total_bytes);
    int warp = 32, major = 9, minor = 0;
    memcpy(prop + PROP_WARP_SIZE, &warp, sizeof warp);
    memcpy(prop + PROP_MAJOR, &major, sizeof major);
    memcpy(prop + PROP_MINOR, &minor, sizeof minor);
    return 0;
}

int cudaDeviceGetAttribute(int *value, int attribute, int device) {
    (void)attribute;
    (void)device;
    *value = 0;
    return 0;
}

/* No stream is ever captured into a graph here. */
int cudaStreamIsCapturing(cudaStream_t stream, int *status) {
    (void)stream;
    *status = 0; /* cudaStreamCaptureStatusNone */
    return 0;
}

int cudaStreamGetCaptureInfo(cudaStream_t stream, int *status, unsigned long long *id) {
    (void)stream;
    *status = 0;
    if (id)
        *id = 0;
    return 0;
}

int cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    if (least)
        *least = 0;
    if (greatest)
        *greatest = 0;
    return 0;
}

/* Streams and the default memory pool are handles the simulated driver only stores: any
 * distinct value will do (PyTorch's stream pools create a few dozen streams). */
int cudaStreamCreateWithPriority(cudaStream_t *stream, unsigned int flags, int priority) {
    static char handles[256];
    static unsigned next;
    (void)flags;
    (void)priority;
    *stream = &handles[__atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) % sizeof handles];
    return 0;
}

int cudaDeviceGetDefaultMemPool(void **pool, int device) {
    static char pools[64];
    *pool = &pools[device & 63];
    return 0;
}

int cudaPeekAtLastError(void) { return 0; }

const char *cudaGetErrorName(int error) {
    (void)error;
    return "cudaErrorUnknown";
}
