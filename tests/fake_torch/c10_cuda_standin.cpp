// c10_cuda_standin.cpp: a stand-in for PyTorch 2.11's libc10_cuda.so, built into
// OUTDIR/torch/lib/libc10_cuda.so by scripts/build-fake-cuda.sh. See README.md beside it for
// what is mirrored exactly (names, layouts, the allocator's rules) and what is left out.
//
// Built with -fvisibility=hidden and kept unstripped: like PyTorch's own library, only the
// `allocator` pointer (and here the C test API) is exported, while the allocator class's
// vtable and methods are LOCAL symbols in .symtab.

#include "../fake_cuda/cuda_fake.h"
#include "standin_api.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#define STANDIN_EXPORT __attribute__((visibility("default")))

namespace c10 {

using DeviceIndex = int8_t;
using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
using approx_time_t = uint64_t;

// PyTorch's captured Python/C++ stack; never created here (context_ stays null).
struct GatheredContext {
    virtual ~GatheredContext() = default;
};

union trace_time_ {
    time_t t_;
    approx_time_t approx_t_;
};
static_assert(sizeof(trace_time_) == 8, "trace_time_ is one word");

namespace CachingDeviceAllocator {

// PyTorch 2.11's TraceEntry (c10/core/CachingDeviceAllocator.h): same members, same order,
// same types, so that a reader of the object sees the same bytes.
struct TraceEntry {
    enum Action {
        ALLOC,
        FREE_REQUESTED,
        FREE_COMPLETED,
        SEGMENT_ALLOC,
        SEGMENT_FREE,
        SEGMENT_MAP,
        SEGMENT_UNMAP,
        SNAPSHOT,
        OOM
    };
    TraceEntry(Action action, DeviceIndex device, size_t addr, size_t size, void *stream,
               MempoolId_t mempool, approx_time_t time)
        : action_(action), device_(device), addr_(addr), stream_(stream), size_(size),
          mempool_(mempool) {
        time_.approx_t_ = time;
    }
    Action action_;
    DeviceIndex device_;
    // An address for every action but OOM, where it is the device's free bytes.
    size_t addr_;
    std::shared_ptr<GatheredContext> context_;
    void *stream_{};
    size_t size_;
    MempoolId_t mempool_;
    trace_time_ time_{};
    std::string compile_context_;
    std::string user_metadata_;
};

static_assert(sizeof(TraceEntry::Action) == 4, "Action is int-sized");
static_assert(offsetof(TraceEntry, action_) == 0, "TraceEntry::action_");
static_assert(offsetof(TraceEntry, device_) == 4, "TraceEntry::device_");
static_assert(offsetof(TraceEntry, addr_) == 8, "TraceEntry::addr_");
static_assert(offsetof(TraceEntry, context_) == 16, "TraceEntry::context_");
static_assert(sizeof(std::shared_ptr<GatheredContext>) == 16, "shared_ptr is two words");
static_assert(offsetof(TraceEntry, stream_) == 32, "TraceEntry::stream_");
static_assert(offsetof(TraceEntry, size_) == 40, "TraceEntry::size_");
static_assert(offsetof(TraceEntry, mempool_) == 48, "TraceEntry::mempool_");
static_assert(offsetof(TraceEntry, time_) == 64, "TraceEntry::time_");
static_assert(offsetof(TraceEntry, compile_context_) == 72, "TraceEntry::compile_context_");
static_assert(offsetof(TraceEntry, user_metadata_) == 104, "TraceEntry::user_metadata_");
static_assert(sizeof(TraceEntry) == 136, "TraceEntry size");

} // namespace CachingDeviceAllocator

namespace cuda {
namespace CUDACachingAllocator {

using c10::CachingDeviceAllocator::TraceEntry;
using AllocatorTraceTracker = std::function<void(const TraceEntry &)>;

// The abstract allocator. PyTorch's has many more methods and puts
// attachAllocatorTraceTracker past slot 20; here it sits at a different, early slot, so a
// reader that hard-codes PyTorch's slot instead of finding it calls the wrong method.
class CUDAAllocator {
  public:
    virtual ~CUDAAllocator();
    virtual void *raw_alloc_with_stream(size_t nbytes, int device, uintptr_t stream) = 0;
    virtual void raw_delete(void *ptr) = 0;
    virtual void init(int device_count) = 0;
    virtual void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) = 0;
    virtual void recordStream(void *ptr, uintptr_t stream) = 0;
    virtual bool initialized() = 0;
    virtual void emptyCache() = 0;
    virtual void processEvents() = 0;
    virtual unsigned long long allocatedBytes(int device) = 0;
    virtual unsigned long long reservedBytes(int device) = 0;
    virtual bool writeTruth(FILE *out) = 0;
    virtual std::string name() = 0;
    // PyTorch's CUDA-graph capture (CUDAGraph::capture_begin / capture_end): the device's
    // allocations go to the private pool `id` (created at its first use) until the matching
    // end. Here every allocation of the device goes there, whatever its stream.
    virtual void beginAllocateToPool(int device, MempoolId_t id) = 0;
    virtual void endAllocateToPool(int device, MempoolId_t id) = 0;
};

CUDAAllocator::~CUDAAllocator() = default;

// The one exported data symbol memsnap starts from (PyTorch's is the same type and name).
STANDIN_EXPORT std::atomic<CUDAAllocator *> allocator;

namespace {
std::atomic<unsigned long long> g_attach_calls{0};
std::atomic<unsigned long long> g_tracker_calls{0};

// The runtime's current device is per thread; allocate on `device` and put the previous one
// back, as PyTorch's device guard does.
struct DeviceGuard {
    int previous = 0;
    explicit DeviceGuard(int device) {
        cudaGetDevice(&previous);
        if (previous != device) cudaSetDevice(device);
    }
    ~DeviceGuard() {
        int now = 0;
        cudaGetDevice(&now);
        if (now != previous) cudaSetDevice(previous);
    }
};
} // namespace

namespace Native {

constexpr size_t kMinBlockSize = 512;        // every size is rounded to a multiple of this
constexpr size_t kSmallSize = 1048576;       // the largest "small" request: 1 MiB
constexpr size_t kSmallBuffer = 2097152;     // small requests share 2 MiB segments
constexpr size_t kLargeBuffer = 20971520;    // requests of 1-10 MiB share 20 MiB segments
constexpr size_t kMinLargeAlloc = 10485760;  // from 10 MiB a request gets its own segment
constexpr size_t kRoundLarge = 2097152;      // ... rounded up to 2 MiB

namespace {

struct BlockPool;

struct Block {
    int device;
    uintptr_t stream;           // the stream it was allocated on
    std::set<uintptr_t> stream_uses;  // other streams it was used on (recordStream)
    size_t size;
    size_t requested_size = 0;
    BlockPool *pool;
    uintptr_t ptr;
    bool allocated = false;
    Block *prev = nullptr;      // neighbours inside the same segment
    Block *next = nullptr;
    int event_count = 0;        // outstanding "events": a pending free

    Block(int device_, uintptr_t stream_, size_t size_, BlockPool *pool_, uintptr_t ptr_)
        : device(device_), stream(stream_), size(size_), pool(pool_), ptr(ptr_) {}
    bool is_split() const { return prev != nullptr || next != nullptr; }
};

// Free blocks ordered by (stream, size, address): lower_bound finds the best fit, the
// smallest free block of the stream that is large enough, the lowest address among equals.
struct BySize {
    bool operator()(const Block *a, const Block *b) const {
        if (a->stream != b->stream) return a->stream < b->stream;
        if (a->size != b->size) return a->size < b->size;
        return a->ptr < b->ptr;
    }
};

struct BlockPool {
    std::set<Block *, BySize> blocks;
    bool is_small;
    MempoolId_t owner;  // the private pool that owns it; {0, 0} for the default pools
    explicit BlockPool(bool small, MempoolId_t owner_ = {0, 0})
        : is_small(small), owner(owner_) {}
    // PyTorch's BlockPool::owner_MempoolId(): what its segment entries carry.
    MempoolId_t owner_MempoolId() const { return owner; }
};

// A CUDA graph's private pool (PyTorch's PrivatePool): its own small and large blocks, never
// shared with the default pools or another graph's.
struct PrivatePool {
    explicit PrivatePool(MempoolId_t id) : large_blocks(false, id), small_blocks(true, id) {}
    BlockPool large_blocks;
    BlockPool small_blocks;
};

size_t round_size(size_t size) {
    if (size < kMinBlockSize) return kMinBlockSize;
    return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

size_t get_allocation_size(size_t size) {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

// PyTorch's approximate clock: the time-stamp counter on x86-64 (its record_trace executes
// rdtsc), a monotonic clock elsewhere.
approx_time_t now_approx() {
#if defined(__x86_64__)
    return approx_time_t(__rdtsc());
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return approx_time_t(ts.tv_sec) * 1000000000ull + approx_time_t(ts.tv_nsec);
#endif
}

} // namespace

// One device's caching allocator (PyTorch's DeviceCachingAllocator).
class DeviceCachingAllocator {
  public:
    explicit DeviceCachingAllocator(int device)
        : device_(device), large_blocks_(false), small_blocks_(true) {}

    Block *malloc(size_t orig_size, uintptr_t stream) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        DeviceGuard guard(device_);
        const size_t size = round_size(orig_size);
        BlockPool &pool = get_pool(size);
        const size_t alloc_size = get_allocation_size(size);
        Block *block = get_free_block(pool, stream, size);
        if (!block) block = alloc_block(pool, stream, alloc_size);
        if (!block && release_cached_blocks()) block = alloc_block(pool, stream, alloc_size);
        if (!block) {
            size_t device_free = 0, device_total = 0;
            cudaMemGetInfo(&device_free, &device_total);
            record_trace(TraceEntry::OOM, device_free, size, stream, pool.owner_MempoolId());
            return nullptr;
        }
        return alloc_found_block(block, orig_size, size);
    }

    void free(Block *block) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        block->allocated = false;
        record_trace(TraceEntry::FREE_REQUESTED, block->ptr, block->requested_size,
                     block->stream, block->pool->owner_MempoolId());
        if (!block->stream_uses.empty()) {
            // One event per other stream; the block stays active until they complete.
            block->event_count += int(block->stream_uses.size());
            block->stream_uses.clear();
            pending_.push_back(block);
        } else {
            free_block(block);
        }
    }

    void record_stream(Block *block, uintptr_t stream) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        if (stream == block->stream) return;  // its own stream needs no event
        block->stream_uses.insert(stream);
    }

    void process_events() {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        std::vector<Block *> done;
        done.swap(pending_);
        for (Block *block : done) {
            block->event_count = 0;
            free_block(block);
        }
    }

    void empty_cache() {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        release_cached_blocks();
    }

    void begin_allocate_to_pool(MempoolId_t id) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        if (!graph_pools_.count(id)) graph_pools_[id].reset(new PrivatePool(id));
        captures_underway_.push_back(id);
    }

    void end_allocate_to_pool(MempoolId_t id) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        for (auto it = captures_underway_.begin(); it != captures_underway_.end(); ++it) {
            if (*it == id) {
                captures_underway_.erase(it);
                return;
            }
        }
    }

    void attach(const AllocatorTraceTracker &tracker) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        trackers_.push_back(tracker);
    }

    unsigned long long allocated_bytes() {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        unsigned long long sum = 0;
        for (auto &entry : by_address_)
            if (entry.second->allocated) sum += entry.second->size;
        return sum;
    }

    unsigned long long reserved_bytes() {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        unsigned long long sum = 0;
        for (auto &segment : segments_) sum += segment.second;
        return sum;
    }

    // Writes this device's segments as JSON objects (comma-separated after `*first`).
    void write_truth(FILE *out, bool *first) {
        std::lock_guard<std::recursive_mutex> lock(mutex_);
        for (auto &segment : segments_) {
            // The first block of a segment starts at its address and is in its pool.
            const MempoolId_t pool = by_address_.at(segment.first)->pool->owner_MempoolId();
            fprintf(out,
                    "%s\n{\"device\":%d,\"address\":%llu,\"total_size\":%llu,"
                    "\"segment_pool_id\":[%llu,%llu],\"blocks\":[",
                    *first ? "" : ",", device_, (unsigned long long)segment.first,
                    (unsigned long long)segment.second, pool.first, pool.second);
            *first = false;
            auto it = by_address_.lower_bound(segment.first);
            const uintptr_t end = segment.first + segment.second;
            bool first_block = true;
            for (; it != by_address_.end() && it->first < end; ++it) {
                const Block *b = it->second;
                const char *state = b->allocated ? "active_allocated"
                                    : b->event_count > 0 ? "active_pending_free"
                                                         : "inactive";
                fprintf(out,
                        "%s{\"address\":%llu,\"size\":%llu,\"requested_size\":%llu,"
                        "\"state\":\"%s\"}",
                        first_block ? "" : ",", (unsigned long long)b->ptr,
                        (unsigned long long)b->size,
                        (unsigned long long)(b->allocated || b->event_count > 0
                                                 ? b->requested_size
                                                 : 0),
                        state);
                first_block = false;
            }
            fprintf(out, "]}");
        }
    }

  private:
    // PyTorch's get_pool: the private pool of the capture under way, else a default pool.
    BlockPool &get_pool(size_t size) {
        if (!captures_underway_.empty()) {
            PrivatePool &private_pool = *graph_pools_.at(captures_underway_.back());
            return size <= kSmallSize ? private_pool.small_blocks : private_pool.large_blocks;
        }
        return size <= kSmallSize ? small_blocks_ : large_blocks_;
    }

    Block *get_free_block(BlockPool &pool, uintptr_t stream, size_t size) {
        Block key(device_, stream, size, &pool, 0);
        auto it = pool.blocks.lower_bound(&key);
        if (it == pool.blocks.end() || (*it)->stream != stream) return nullptr;
        Block *block = *it;
        pool.blocks.erase(it);
        return block;
    }

    // A new segment from cudaMalloc; nullptr when the runtime is out of memory.
    Block *alloc_block(BlockPool &pool, uintptr_t stream, size_t alloc_size) {
        void *ptr = nullptr;
        if (cudaMalloc(&ptr, alloc_size) != cudaSuccess || !ptr) {
            cudaGetLastError();
            return nullptr;
        }
        Block *block = new Block(device_, stream, alloc_size, &pool, uintptr_t(ptr));
        segments_[block->ptr] = alloc_size;
        by_address_[block->ptr] = block;
        record_trace(TraceEntry::SEGMENT_ALLOC, block->ptr, alloc_size, stream,
                     pool.owner_MempoolId());
        return block;
    }

    static bool should_split(const Block *block, size_t size) {
        const size_t remaining = block->size - size;
        if (block->pool->is_small) return remaining >= kMinBlockSize;
        return remaining > kSmallSize;
    }

    // The request takes the start of `block`; the rest stays free when it is worth a block.
    Block *alloc_found_block(Block *block, size_t orig_size, size_t size) {
        if (should_split(block, size)) {
            Block *remaining = block;
            block = new Block(device_, remaining->stream, size, remaining->pool, remaining->ptr);
            block->prev = remaining->prev;
            if (block->prev) block->prev->next = block;
            block->next = remaining;
            remaining->prev = block;
            remaining->ptr += size;
            remaining->size -= size;
            by_address_[block->ptr] = block;
            by_address_[remaining->ptr] = remaining;
            remaining->pool->blocks.insert(remaining);
        }
        block->allocated = true;
        block->requested_size = orig_size;
        record_trace(TraceEntry::ALLOC, block->ptr, orig_size, block->stream,
                     block->pool->owner_MempoolId());
        return block;
    }

    // The free is complete: merge with free neighbours, back into the pool.
    void free_block(Block *block) {
        record_trace(TraceEntry::FREE_COMPLETED, block->ptr, block->requested_size,
                     block->stream, block->pool->owner_MempoolId());
        BlockPool &pool = *block->pool;
        try_merge(block, block->prev, pool);
        try_merge(block, block->next, pool);
        block->requested_size = 0;
        pool.blocks.insert(block);
    }

    void try_merge(Block *dst, Block *src, BlockPool &pool) {
        if (!src || src->allocated || src->event_count > 0 || !src->stream_uses.empty()) return;
        by_address_.erase(src->ptr);
        by_address_.erase(dst->ptr);
        if (dst->prev == src) {
            dst->ptr = src->ptr;
            dst->prev = src->prev;
            if (dst->prev) dst->prev->next = dst;
        } else {
            dst->next = src->next;
            if (dst->next) dst->next->prev = dst;
        }
        by_address_[dst->ptr] = dst;
        dst->size += src->size;
        pool.blocks.erase(src);
        delete src;
    }

    // Completes pending frees, then cudaFrees every free block that is a whole segment of the
    // default pools (a private pool keeps its segments while its graphs live, and the
    // stand-in never releases a graph).
    bool release_cached_blocks() {
        process_events();
        release_blocks(large_blocks_);
        release_blocks(small_blocks_);
        return true;
    }

    void release_blocks(BlockPool &pool) {
        for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
            Block *block = *it;
            ++it;
            if (!block->is_split()) release_block(block);
        }
    }

    void release_block(Block *block) {
        record_trace(TraceEntry::SEGMENT_FREE, block->ptr, block->size, block->stream,
                     block->pool->owner_MempoolId());
        cudaFree(reinterpret_cast<void *>(block->ptr));
        segments_.erase(block->ptr);
        by_address_.erase(block->ptr);
        block->pool->blocks.erase(block);
        delete block;
    }

    // `pool`: the owner of the block or segment, as PyTorch passes it in every entry.
    void record_trace(TraceEntry::Action action, size_t addr, size_t size, uintptr_t stream,
                      MempoolId_t pool) {
        if (trackers_.empty()) return;
        TraceEntry entry(action, DeviceIndex(device_), addr, size,
                         reinterpret_cast<void *>(stream), pool, now_approx());
        for (const auto &tracker : trackers_) {
            g_tracker_calls.fetch_add(1, std::memory_order_relaxed);
            tracker(entry);
        }
    }

    const int device_;
    std::recursive_mutex mutex_;
    BlockPool large_blocks_;
    BlockPool small_blocks_;
    std::map<uintptr_t, size_t> segments_;     // segment address -> size
    std::map<uintptr_t, Block *> by_address_;  // every block of every segment
    std::vector<Block *> pending_;             // frees waiting for their events
    std::vector<AllocatorTraceTracker> trackers_;
    std::map<MempoolId_t, std::unique_ptr<PrivatePool>> graph_pools_;
    std::vector<MempoolId_t> captures_underway_;  // the last one gets the allocations
};

class NativeCachingAllocator : public CUDAAllocator {
  public:
    ~NativeCachingAllocator() override;
    void *raw_alloc_with_stream(size_t nbytes, int device, uintptr_t stream) override;
    void raw_delete(void *ptr) override;
    void init(int device_count) override;
    void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override;
    void recordStream(void *ptr, uintptr_t stream) override;
    bool initialized() override;
    void emptyCache() override;
    void processEvents() override;
    unsigned long long allocatedBytes(int device) override;
    unsigned long long reservedBytes(int device) override;
    bool writeTruth(FILE *out) override;
    std::string name() override;
    void beginAllocateToPool(int device, MempoolId_t id) override;
    void endAllocateToPool(int device, MempoolId_t id) override;

  private:
    Block *find(void *ptr, bool remove);
    std::vector<std::unique_ptr<DeviceCachingAllocator>> device_allocator;
    std::mutex blocks_mutex_;
    std::unordered_map<uintptr_t, Block *> allocated_blocks_;
};

NativeCachingAllocator::~NativeCachingAllocator() = default;

void *NativeCachingAllocator::raw_alloc_with_stream(size_t nbytes, int device,
                                                    uintptr_t stream) {
    if (nbytes == 0) return nullptr;
    if (device < 0 || size_t(device) >= device_allocator.size()) {
        fprintf(stderr, "standin: device %d is not initialized\n", device);
        abort();
    }
    Block *block = device_allocator[device]->malloc(nbytes, stream);
    if (!block) return nullptr;
    std::lock_guard<std::mutex> lock(blocks_mutex_);
    allocated_blocks_[block->ptr] = block;
    return reinterpret_cast<void *>(block->ptr);
}

Block *NativeCachingAllocator::find(void *ptr, bool remove) {
    std::lock_guard<std::mutex> lock(blocks_mutex_);
    auto it = allocated_blocks_.find(uintptr_t(ptr));
    if (it == allocated_blocks_.end()) {
        fprintf(stderr, "standin: invalid device pointer %p\n", ptr);
        abort();
    }
    Block *block = it->second;
    if (remove) allocated_blocks_.erase(it);
    return block;
}

void NativeCachingAllocator::raw_delete(void *ptr) {
    if (!ptr) return;
    Block *block = find(ptr, true);
    device_allocator[block->device]->free(block);
}

void NativeCachingAllocator::init(int device_count) {
    const int before = int(device_allocator.size());
    for (int d = before; d < device_count; d++)
        device_allocator.emplace_back(new DeviceCachingAllocator(d));
}

// Like PyTorch: the tracker goes to the devices that exist now; before init() there are
// none and the tracker is dropped.
void NativeCachingAllocator::attachAllocatorTraceTracker(AllocatorTraceTracker tracker) {
    g_attach_calls.fetch_add(1, std::memory_order_relaxed);
    for (auto &device : device_allocator) device->attach(tracker);
}

void NativeCachingAllocator::recordStream(void *ptr, uintptr_t stream) {
    if (!ptr) return;
    Block *block = find(ptr, false);
    device_allocator[block->device]->record_stream(block, stream);
}

bool NativeCachingAllocator::initialized() { return !device_allocator.empty(); }

void NativeCachingAllocator::emptyCache() {
    for (auto &device : device_allocator) device->empty_cache();
}

void NativeCachingAllocator::processEvents() {
    for (auto &device : device_allocator) device->process_events();
}

unsigned long long NativeCachingAllocator::allocatedBytes(int device) {
    if (device < 0 || size_t(device) >= device_allocator.size()) return 0;
    return device_allocator[device]->allocated_bytes();
}

unsigned long long NativeCachingAllocator::reservedBytes(int device) {
    if (device < 0 || size_t(device) >= device_allocator.size()) return 0;
    return device_allocator[device]->reserved_bytes();
}

bool NativeCachingAllocator::writeTruth(FILE *out) {
    fprintf(out, "{\"allocator\":\"native\",\"segments\":[");
    bool first = true;
    for (auto &device : device_allocator) device->write_truth(out, &first);
    fprintf(out, "\n]}\n");
    return true;
}

std::string NativeCachingAllocator::name() { return "native"; }

void NativeCachingAllocator::beginAllocateToPool(int device, MempoolId_t id) {
    if (device >= 0 && size_t(device) < device_allocator.size())
        device_allocator[device]->begin_allocate_to_pool(id);
}

void NativeCachingAllocator::endAllocateToPool(int device, MempoolId_t id) {
    if (device >= 0 && size_t(device) < device_allocator.size())
        device_allocator[device]->end_allocate_to_pool(id);
}

} // namespace Native

namespace CudaMallocAsync {

// A second allocator class with its own vtable, standing for PyTorch's
// backend:cudaMallocAsync allocator. As the real one, each allocation is its own
// cudaMallocAsync and each free its own cudaFreeAsync, on the stream asked for: no
// segment-level allocation ever comes. Its attachAllocatorTraceTracker throws: a reader
// that does not check the object's vtable would call it and die.
class CudaMallocAsyncAllocator : public CUDAAllocator {
  public:
    ~CudaMallocAsyncAllocator() override;
    void *raw_alloc_with_stream(size_t nbytes, int device, uintptr_t stream) override;
    void raw_delete(void *ptr) override;
    void init(int device_count) override;
    void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) override;
    void recordStream(void *ptr, uintptr_t stream) override;
    bool initialized() override;
    void emptyCache() override;
    void processEvents() override;
    unsigned long long allocatedBytes(int device) override;
    unsigned long long reservedBytes(int device) override;
    bool writeTruth(FILE *out) override;
    std::string name() override;
    void beginAllocateToPool(int device, MempoolId_t id) override;
    void endAllocateToPool(int device, MempoolId_t id) override;

  private:
    struct Allocation {
        int device;
        size_t size;
        uintptr_t stream;
    };
    std::mutex mutex_;
    int devices_ = 0;
    std::map<uintptr_t, Allocation> live_;
};

CudaMallocAsyncAllocator::~CudaMallocAsyncAllocator() = default;

void *CudaMallocAsyncAllocator::raw_alloc_with_stream(size_t nbytes, int device, uintptr_t stream) {
    if (nbytes == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceGuard guard(device);
    void *ptr = nullptr;
    if (cudaMallocAsync(&ptr, nbytes, reinterpret_cast<cudaStream_t>(stream)) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    live_[uintptr_t(ptr)] = Allocation{device, nbytes, stream};
    return ptr;
}

void CudaMallocAsyncAllocator::raw_delete(void *ptr) {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(uintptr_t(ptr));
    if (it == live_.end()) return;
    DeviceGuard guard(it->second.device);
    cudaFreeAsync(ptr, reinterpret_cast<cudaStream_t>(it->second.stream));
    live_.erase(it);
}

void CudaMallocAsyncAllocator::init(int device_count) { devices_ = device_count; }

void CudaMallocAsyncAllocator::attachAllocatorTraceTracker(AllocatorTraceTracker) {
    g_attach_calls.fetch_add(1, std::memory_order_relaxed);
    throw std::runtime_error("attachAllocatorTraceTracker is not supported by cudaMallocAsync");
}

void CudaMallocAsyncAllocator::recordStream(void *, uintptr_t) {}
bool CudaMallocAsyncAllocator::initialized() { return devices_ > 0; }
void CudaMallocAsyncAllocator::emptyCache() {}
void CudaMallocAsyncAllocator::processEvents() {}

unsigned long long CudaMallocAsyncAllocator::allocatedBytes(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    unsigned long long sum = 0;
    for (auto &a : live_)
        if (a.second.device == device) sum += a.second.size;
    return sum;
}

unsigned long long CudaMallocAsyncAllocator::reservedBytes(int device) {
    return allocatedBytes(device);
}

// One segment and one allocated block per allocation, the shape memsnap writes for plain
// cudaMalloc calls.
bool CudaMallocAsyncAllocator::writeTruth(FILE *out) {
    std::lock_guard<std::mutex> lock(mutex_);
    fprintf(out, "{\"allocator\":\"cudaMallocAsync\",\"segments\":[");
    bool first = true;
    for (auto &a : live_) {
        const unsigned long long p = a.first, n = a.second.size;
        fprintf(out,
                "%s\n{\"device\":%d,\"address\":%llu,\"total_size\":%llu,"
                "\"segment_pool_id\":[0,0],\"blocks\":["
                "{\"address\":%llu,\"size\":%llu,\"requested_size\":%llu,"
                "\"state\":\"active_allocated\"}]}",
                first ? "" : ",", a.second.device, p, n, p, n, n);
        first = false;
    }
    fprintf(out, "\n]}\n");
    return true;
}

std::string CudaMallocAsyncAllocator::name() { return "cudaMallocAsync"; }

// (PyTorch's cudaMallocAsync backend captures graphs with the driver's own pools.)
void CudaMallocAsyncAllocator::beginAllocateToPool(int, MempoolId_t) {}
void CudaMallocAsyncAllocator::endAllocateToPool(int, MempoolId_t) {}

} // namespace CudaMallocAsync

namespace {
// PyTorch picks its allocator once, when the library is loaded; STANDIN_ALLOCATOR=async
// picks the second class here. Both objects live until the process ends (never destroyed,
// so nothing runs on them during exit).
struct SelectAllocator {
    SelectAllocator() {
        const char *which = getenv("STANDIN_ALLOCATOR");
        if (which && strcmp(which, "async") == 0)
            allocator.store(new CudaMallocAsync::CudaMallocAsyncAllocator());
        else
            allocator.store(new Native::NativeCachingAllocator());
    }
};
SelectAllocator select_allocator;
} // namespace

} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

// ------------------------------------------------------------------ the C test API

using c10::cuda::CUDACachingAllocator::allocator;

extern "C" {

STANDIN_EXPORT void standin_init(int devices) { allocator.load()->init(devices); }

STANDIN_EXPORT void *standin_malloc(size_t size, int device, uintptr_t stream) {
    return allocator.load()->raw_alloc_with_stream(size, device, stream);
}

STANDIN_EXPORT void standin_free(void *ptr) { allocator.load()->raw_delete(ptr); }

STANDIN_EXPORT void standin_record_stream(void *ptr, uintptr_t stream) {
    allocator.load()->recordStream(ptr, stream);
}

STANDIN_EXPORT void standin_process_events(void) { allocator.load()->processEvents(); }

STANDIN_EXPORT void standin_empty_cache(void) { allocator.load()->emptyCache(); }

STANDIN_EXPORT unsigned long long standin_allocated_bytes(int device) {
    return allocator.load()->allocatedBytes(device);
}

STANDIN_EXPORT unsigned long long standin_reserved_bytes(int device) {
    return allocator.load()->reservedBytes(device);
}

STANDIN_EXPORT int standin_write_truth(const char *path) {
    FILE *out = fopen(path, "w");
    if (!out) return -1;
    allocator.load()->writeTruth(out);
    return fclose(out) == 0 ? 0 : -1;
}

STANDIN_EXPORT void standin_begin_allocate_to_pool(int device, unsigned long long first,
                                                   unsigned long long second) {
    allocator.load()->beginAllocateToPool(device, {first, second});
}

STANDIN_EXPORT void standin_end_allocate_to_pool(int device, unsigned long long first,
                                                 unsigned long long second) {
    allocator.load()->endAllocateToPool(device, {first, second});
}

STANDIN_EXPORT unsigned long long standin_attach_calls(void) {
    return c10::cuda::CUDACachingAllocator::g_attach_calls.load();
}

STANDIN_EXPORT unsigned long long standin_tracker_calls(void) {
    return c10::cuda::CUDACachingAllocator::g_tracker_calls.load();
}

} // extern "C"
