/* route_probe.c -> OUTDIR/lib/libroute_probe.so: a minimal reference interposer that shows which
 * route each test program takes to the driver. Not memsnap: a test of the fake and the programs.
 *
 * LD_PRELOAD it; at exit it prints to stderr `probe <key>=<count>` lines:
 *   plt_cudaMalloc            calls of its exported cudaMalloc (shared runtime via the PLT)
 *   dlsym_<name>              times its dlsym hook handed out its own <name> hook
 *   getproc_<name>            times its cuGetProcAddress(_v2) hook substituted its <name> hook
 *                             (by pointer identity, as docs/CUDA.md#routing-by-pointer prescribes)
 *   calls_<name>              calls of its <name> hook, however they were reached
 * The hooks pass every call through unchanged. */
#define _GNU_SOURCE
#include "../fake_cuda/cuda_fake.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define HOOKED(X)                                                                                  \
    X(cuGetProcAddress)                                                                            \
    X(cuGetProcAddress_v2)                                                                         \
    X(cuMemAlloc_v2)                                                                               \
    X(cuMemFree_v2)                                                                                \
    X(cuMemAllocAsync)                                                                             \
    X(cuMemAllocAsync_ptsz)                                                                        \
    X(cuMemCreate)                                                                                 \
    X(cuMemMap)

#define AS_INDEX(name) H_##name,
enum { HOOKED(AS_INDEX) N_HOOKED };
#define AS_NAME(name) #name,
static const char *const hooked_names[N_HOOKED] = {HOOKED(AS_NAME)};
#define AS_HOOK(name) (void *)name,
static void *const hooks[N_HOOKED] = {HOOKED(AS_HOOK)};

static unsigned long long calls[N_HOOKED], via_dlsym[N_HOOKED], via_getproc[N_HOOKED];
static unsigned long long plt_cudaMalloc;

static void *(*real_dlsym)(void *, const char *);
static void *real_fn[N_HOOKED];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) {
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    void *libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!libcuda) libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    for (int i = 0; i < N_HOOKED && libcuda; i++) real_fn[i] = real_dlsym(libcuda, hooked_names[i]);
}

#define BUMP(counter) __atomic_fetch_add(&(counter), 1, __ATOMIC_RELAXED)
#define REAL(name) ((__typeof__(&name))(pthread_once(&once, init), real_fn[H_##name]))

/* Our hook for a pointer the driver handed out, or the pointer itself. */
static void *substitute(void *fn, unsigned long long *route) {
    for (int i = 0; i < N_HOOKED; i++)
        if (fn && fn == real_fn[i]) {
            BUMP(route[i]);
            return hooks[i];
        }
    return fn;
}

void *dlsym(void *handle, const char *name) {
    pthread_once(&once, init);
    return substitute(real_dlsym(handle, name), via_dlsym);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    BUMP(calls[H_cuGetProcAddress]);
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, version, flags);
    if (r == CUDA_SUCCESS && pfn) *pfn = substitute(*pfn, via_getproc);
    return r;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    BUMP(calls[H_cuGetProcAddress_v2]);
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, version, flags, status);
    if (r == CUDA_SUCCESS && pfn) *pfn = substitute(*pfn, via_getproc);
    return r;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    BUMP(calls[H_cuMemAlloc_v2]);
    return REAL(cuMemAlloc_v2)(p, n);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    BUMP(calls[H_cuMemFree_v2]);
    return REAL(cuMemFree_v2)(p);
}

CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    BUMP(calls[H_cuMemAllocAsync]);
    return REAL(cuMemAllocAsync)(p, n, s);
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    BUMP(calls[H_cuMemAllocAsync_ptsz]);
    return REAL(cuMemAllocAsync_ptsz)(p, n, s);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    BUMP(calls[H_cuMemCreate]);
    return REAL(cuMemCreate)(h, n, prop, flags);
}

CUresult cuMemMap(CUdeviceptr p, size_t n, size_t off, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
    BUMP(calls[H_cuMemMap]);
    return REAL(cuMemMap)(p, n, off, h, flags);
}

cudaError_t cudaMalloc(void **p, size_t n) {
    static cudaError_t (*next)(void **, size_t);
    BUMP(plt_cudaMalloc);
    pthread_once(&once, init);
    if (!next) next = (cudaError_t(*)(void **, size_t))real_dlsym(RTLD_NEXT, "cudaMalloc");
    return next ? next(p, n) : cudaErrorInsufficientDriver;
}

__attribute__((destructor)) static void report(void) {
    fprintf(stderr, "probe plt_cudaMalloc=%llu\n", plt_cudaMalloc);
    for (int i = 0; i < N_HOOKED; i++)
        fprintf(stderr, "probe calls_%s=%llu\nprobe dlsym_%s=%llu\nprobe getproc_%s=%llu\n",
                hooked_names[i], calls[i], hooked_names[i], via_dlsym[i], hooked_names[i],
                via_getproc[i]);
}
