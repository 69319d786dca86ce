/* standin_api.h: the C API of the PyTorch stand-in (libc10_cuda.so built from
 * c10_cuda_standin.cpp). Test programs dlopen the library and dlsym these names; the typedefs
 * below are the pointer types to cast to. Every call goes through the exported
 * c10::cuda::CUDACachingAllocator::allocator, as PyTorch's own entry points do. */
#ifndef MEMSNAP_STANDIN_API_H
#define MEMSNAP_STANDIN_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Creates the per-device allocators (PyTorch's init(device_count)); before it the allocator
 * reports initialized() == false. */
typedef void (*standin_init_fn)(int devices);
/* A block of `size` bytes on `device` for `stream` (0: the default stream); NULL for size 0
 * and on out-of-memory (PyTorch throws instead). */
typedef void *(*standin_malloc_fn)(size_t size, int device, uintptr_t stream);
/* Frees a block; with streams recorded on it the free stays pending until
 * standin_process_events(). */
typedef void (*standin_free_fn)(void *ptr);
/* PyTorch's recordStream: the block is also used on `stream`. */
typedef void (*standin_record_stream_fn)(void *ptr, uintptr_t stream);
/* Completes every pending free (all events are treated as done). */
typedef void (*standin_process_events_fn)(void);
/* PyTorch's emptyCache: completes pending frees, then cudaFrees every fully free segment. */
typedef void (*standin_empty_cache_fn)(void);
/* memory_allocated (sum of allocated block sizes) and memory_reserved (sum of segment
 * sizes) of one device. */
typedef unsigned long long (*standin_bytes_fn)(int device);
/* Writes the allocator's own state as JSON (see tests/fake_torch/README.md); 0 on success. */
typedef int (*standin_write_truth_fn)(const char *path);
/* PyTorch's CUDA-graph capture (capture_begin / capture_end): from begin to the matching end
 * every allocation on `device` comes from the private pool (first, second), created at its
 * first use, with its own segments; its segments are never released. */
typedef void (*standin_pool_fn)(int device, unsigned long long first, unsigned long long second);
/* How many times attachAllocatorTraceTracker was called on any allocator, and how many
 * trace entries were handed to trackers. */
typedef unsigned long long (*standin_count_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMSNAP_STANDIN_API_H */
