/* kept_lib.c: a library that allocates through the CUDA runtime, for tests/frames_kept.rs
 * (built there, loaded by tests/programs/py_frames_kept.py, which may unload it right after
 * it allocated). The allocation's line is marked ALLOC_LINE for the test to find. */
#include <stddef.h>

int cudaMalloc(void **p, size_t n);

__attribute__((noinline)) void *kept_alloc(size_t n) {
    void *p = 0;
    if (cudaMalloc(&p, n) != 0) /* ALLOC_LINE */
        return 0;
    __asm__ volatile("" ::: "memory");
    return p;
}
