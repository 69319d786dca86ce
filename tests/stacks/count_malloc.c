/* LD_PRELOAD helper for tests/stacks_python.rs: counts malloc-family calls per thread. */
#include <stddef.h>
#include <stdint.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static __thread uint64_t allocs;
uint64_t count_malloc_get(void) { return allocs; }
void *malloc(size_t n) { allocs++; return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { allocs++; return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { allocs++; return __libc_realloc(p, n); }
void *memalign(size_t a, size_t n) { allocs++; return __libc_memalign(a, n); }
int posix_memalign(void **p, size_t a, size_t n) {
    allocs++;
    *p = __libc_memalign(a, n);
    return *p ? 0 : 12;
}
void *aligned_alloc(size_t a, size_t n) { allocs++; return __libc_memalign(a, n); }
