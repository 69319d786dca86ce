/* torch_standin.c (shared runtime): drives the PyTorch 2.11 stand-in (tests/fake_torch) the way
 * a PyTorch program drives its caching allocator.
 *
 *   torch_standin SCENARIO TRUTH_JSON [LIBC10_CUDA]
 *
 * First one unrelated cudaMalloc + cudaFree through libcudart.so.13 (an interposer starts on
 * it, before the stand-in is loaded; with STANDIN_FIRST=async a cudaMallocAsync +
 * cudaFreeAsync instead, and after the stand-in is loaded a snapshot "loaded" when the
 * preload is there and a second's pause, so that an interposer whose writer thread looks at
 * the loaded libraries every 100 ms sees the library before the stand-in allocates); then dlopen(RTLD_NOW | RTLD_LOCAL) of the stand-in:
 * argv[3], else $STANDIN_DIR/torch/lib/libc10_cuda.so, else ../torch/lib/libc10_cuda.so
 * beside this executable's folder (the fake-CUDA OUTDIR layout). standin_init(2), then:
 *
 *   mixed    small and large blocks on devices 0 and 1: best fit, splits, a large block that
 *            keeps an unsplit tail, frees that merge, empty_cache releasing a whole free
 *            segment, a free completed later by standin_process_events (its segment stays
 *            cached, fully free), and a free left pending on another stream.
 *   threads  one block kept per device on the main thread, then 4 threads (thread t on
 *            device t % 2, its own stream) x 1500 random malloc/free of 512 B - 4 MiB, each
 *            keeping up to 24 blocks and ending with every third of them still live.
 *   graphs   CUDA graphs' private pools: default-pool blocks on device 0, then a capture into
 *            pool (0, 1) on device 0 (a small,  a 3 MiB and an 18 MiB block: three segments of
 *            its own although the default small segment has room; the 18 MiB one freed), a
 *            capture into pool (2, 0) on device 1 (one small block: one segment), a
 *            default-pool block on device 0 after the capture (back in the default
 *            segment), and empty_cache, which keeps the private pools' segments.
 *   oom      run with FAKE_CUDA_CAPACITY=64M: 3 MiB blocks on device 0 until the stand-in
 *            returns NULL (3 segments of 20 MiB, each with an unused 2 MiB tail: 6 MiB
 *            reserved but unallocated). Prints result oom_at=, oom_size=.
 *
 * Nothing is freed afterwards. Then the allocator's own state goes to TRUTH_JSON
 * (standin_write_truth), memsnap_dump("standin") is called when the preload is there
 * (result dump_rc=, -2 without it), and it prints result allocated_bytes_D=,
 * reserved_bytes_D=, attach_calls=, tracker_calls=, allocator=, then the fake driver's truth.
 * Allocation sites: standin_alloc (main thread) and thread_alloc (workers). */
#include "prog_common.h"
#include "../fake_torch/standin_api.h"

#include <pthread.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define KIB (1ull << 10)
#define MIB (1ull << 20)

static standin_init_fn s_init;
static standin_malloc_fn s_malloc;
static standin_free_fn s_free;
static standin_record_stream_fn s_record_stream;
static standin_process_events_fn s_process_events;
static standin_empty_cache_fn s_empty_cache;
static standin_bytes_fn s_allocated, s_reserved;
static standin_write_truth_fn s_write_truth;
static standin_count_fn s_attach_calls, s_tracker_calls;
static standin_pool_fn s_begin_pool, s_end_pool;

static void *must(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (!fn) {
        fprintf(stderr, "torch_standin: the stand-in has no %s\n", name);
        exit(1);
    }
    return fn;
}

static void *load_standin(int argc, char **argv) {
    char path[4096];
    const char *dir = getenv("STANDIN_DIR");
    int len;
    if (argc > 3) {
        len = snprintf(path, sizeof path, "%s", argv[3]);
    } else if (dir && *dir) {
        len = snprintf(path, sizeof path, "%s/torch/lib/libc10_cuda.so", dir);
    } else {
        char exe[4096];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) {
            perror("readlink /proc/self/exe");
            exit(1);
        }
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        len = snprintf(path, sizeof path, "%s/../torch/lib/libc10_cuda.so", exe);
    }
    if (len < 0 || len >= (int)sizeof path) {
        fprintf(stderr, "torch_standin: the stand-in's path is too long\n");
        exit(1);
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "torch_standin: cannot load %s: %s\n", path, dlerror());
        exit(1);
    }
    s_init = (standin_init_fn)must(lib, "standin_init");
    s_malloc = (standin_malloc_fn)must(lib, "standin_malloc");
    s_free = (standin_free_fn)must(lib, "standin_free");
    s_record_stream = (standin_record_stream_fn)must(lib, "standin_record_stream");
    s_process_events = (standin_process_events_fn)must(lib, "standin_process_events");
    s_empty_cache = (standin_empty_cache_fn)must(lib, "standin_empty_cache");
    s_allocated = (standin_bytes_fn)must(lib, "standin_allocated_bytes");
    s_reserved = (standin_bytes_fn)must(lib, "standin_reserved_bytes");
    s_write_truth = (standin_write_truth_fn)must(lib, "standin_write_truth");
    s_attach_calls = (standin_count_fn)must(lib, "standin_attach_calls");
    s_tracker_calls = (standin_count_fn)must(lib, "standin_tracker_calls");
    s_begin_pool = (standin_pool_fn)must(lib, "standin_begin_allocate_to_pool");
    s_end_pool = (standin_pool_fn)must(lib, "standin_end_allocate_to_pool");
    return lib;
}

NOINLINE void *standin_alloc(size_t size, int device, uintptr_t stream) {
    void *p = s_malloc(size, device, stream);
    if (!p) {
        fprintf(stderr, "torch_standin: standin_malloc(%zu, %d) failed\n", size, device);
        exit(1);
    }
    return p;
}

#define S0 ((uintptr_t)0)      /* the default stream */
#define S1 ((uintptr_t)0x7001) /* side streams */
#define S2 ((uintptr_t)0x7002)

static void scenario_mixed(void) {
    /* Device 0, small pool: one 2 MiB segment. */
    void *a = standin_alloc(100, 0, S0);             /* 512 */
    void *b = standin_alloc(600 * KIB, 0, S0);       /* 614400 */
    void *c = standin_alloc(1000 * KIB, 0, S0);      /* 1024000; tail 458240 stays free */
    s_free(b);                                       /* a hole between a and c */
    void *d = standin_alloc(300000, 0, S0);          /* best fit: the tail, not the hole */
    (void)a, (void)c, (void)d;
    /* Device 0, large pool: a 20 MiB segment split 3 MiB + 17 MiB; the 17 MiB piece is
     * taken whole by 16 MiB + 1000 (the 1 MiB - 512 left is not worth a split). */
    void *e = standin_alloc(3 * MIB, 0, S0);
    void *f = standin_alloc(16 * MIB + 1000, 0, S0);
    (void)e, (void)f;
    /* >= 10 MiB: its own segment rounded to 2 MiB (14 MiB), split, freed, merged whole,
     * and released by empty_cache. */
    void *g = standin_alloc(12 * MIB + 3000, 0, S0);
    s_free(g);
    s_empty_cache();
    /* A free used on another stream: pending until process_events, then merged; its
     * 20 MiB segment stays cached and fully free. */
    void *i = standin_alloc(2 * MIB, 0, S0);
    s_record_stream(i, S1);
    s_free(i);
    s_process_events();
    /* A block of stream S1 (its own segment) freed while used on S2: left pending. */
    void *h = standin_alloc(5 * MIB, 0, S1);
    s_record_stream(h, S2);
    s_record_stream(h, S1); /* its own stream: no event */
    s_free(h);
    void *h2 = standin_alloc(1 * MIB + 512, 0, S1); /* after h in the same segment */
    (void)h2;

    /* Device 1: small blocks freed so that they merge; a large block freed at the start. */
    void *x1 = standin_alloc(1000, 1, S0);
    void *x2 = standin_alloc(2000, 1, S0);
    void *x3 = standin_alloc(3000, 1, S0);
    s_free(x2);
    s_free(x1); /* merges with x2's hole */
    (void)x3;
    void *y1 = standin_alloc(8 * MIB, 1, S0);
    void *y2 = standin_alloc(11 * MIB + 1, 1, S0); /* keeps the 12 MiB rest unsplit */
    s_free(y1);
    void *y3 = standin_alloc(2 * MIB, 1, S0); /* best fit inside y1's hole: split */
    (void)y2, (void)y3;
}

struct worker {
    int index;
    int device;
    uintptr_t stream;
};

NOINLINE void *thread_alloc(size_t size, int device, uintptr_t stream) {
    return standin_alloc(size, device, stream);
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    unsigned seed = 12345u + (unsigned)w->index * 7919u;
    void *live[24] = {0};
    for (int iter = 0; iter < 1500; iter++) {
        int slot = rand_r(&seed) % 24;
        if (live[slot]) {
            s_free(live[slot]);
            live[slot] = NULL;
        } else {
            size_t size;
            switch (rand_r(&seed) % 3) {
            case 0: size = 512 + (size_t)(rand_r(&seed) % (64 * 1024)); break;
            case 1: size = 64 * 1024 + (size_t)(rand_r(&seed) % (960 * 1024)); break;
            default: size = 1 * MIB + (size_t)(rand_r(&seed) % (3 * MIB)); break;
            }
            live[slot] = thread_alloc(size, w->device, w->stream);
        }
    }
    for (int slot = 0; slot < 24; slot++)
        if (live[slot] && slot % 3 != 0) s_free(live[slot]);
    return NULL;
}

static void scenario_threads(void) {
    (void)standin_alloc(4096, 0, S0);
    (void)standin_alloc(4096, 1, S0);
    pthread_t threads[4];
    struct worker workers[4];
    for (int t = 0; t < 4; t++) {
        workers[t] = (struct worker){t, t % 2, (uintptr_t)(0x7100 + t)};
        if (pthread_create(&threads[t], NULL, worker_main, &workers[t]) != 0) {
            perror("pthread_create");
            exit(1);
        }
    }
    for (int t = 0; t < 4; t++) pthread_join(threads[t], NULL);
}

static void scenario_graphs(void) {
    void *before = standin_alloc(1000, 0, S0); /* the default small segment */
    void *eager = standin_alloc(4 * MIB, 0, S0);
    (void)before, (void)eager;
    s_begin_pool(0, 0, 1); /* as torch.cuda.graph_pool_handle() names a pool */
    void *p_small = standin_alloc(2000, 0, S0);
    void *p_mid = standin_alloc(3 * MIB, 0, S0);
    void *p_big = standin_alloc(18 * MIB, 0, S0); /* more than the 17 MiB left: its own */
    s_free(p_big); /* its segment stays in the pool, fully free */
    s_end_pool(0, 0, 1);
    (void)p_small, (void)p_mid;
    s_begin_pool(1, 2, 0); /* as a graph names its own pool */
    void *q = standin_alloc(700, 1, S0);
    s_end_pool(1, 2, 0);
    (void)q;
    void *after = standin_alloc(3000, 0, S0); /* the default pool again */
    (void)after;
    s_empty_cache();
}

static void scenario_oom(void) {
    const size_t size = 3 * MIB;
    int n = 0;
    for (;;) {
        void *p = s_malloc(size, 0, S0);
        if (!p) break;
        if (++n > 10000) {
            fprintf(stderr, "torch_standin: no OOM (is FAKE_CUDA_CAPACITY set?)\n");
            exit(1);
        }
    }
    printf("result oom_at=%d\n", n);
    printf("result oom_size=%zu\n", size);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s mixed|threads|graphs|oom TRUTH_JSON [LIBC10_CUDA]\n", argv[0]);
        return 2;
    }
    const char *scenario = argv[1];
    void *first = NULL;
    const char *first_kind = getenv("STANDIN_FIRST");
    int first_async = first_kind && strcmp(first_kind, "async") == 0;
    if (first_async) {
        CHECK_RT(cudaMallocAsync(&first, 4096, 0));
        CHECK_RT(cudaFreeAsync(first, 0));
    } else {
        CHECK_RT(cudaMalloc(&first, 4096));
        CHECK_RT(cudaFree(first));
    }

    load_standin(argc, argv);
    int (*dump)(const char *) = (int (*)(const char *))dlsym(RTLD_DEFAULT, "memsnap_dump");
    if (first_async) {
        /* A snapshot is written by memsnap's writer thread: once it returns, that thread
         * runs, and a second is ten of its 100 ms looks at the loaded libraries. */
        if (dump) dump("loaded");
        sleep(1);
    }
    s_init(2);
    if (strcmp(scenario, "mixed") == 0) {
        scenario_mixed();
    } else if (strcmp(scenario, "threads") == 0) {
        scenario_threads();
    } else if (strcmp(scenario, "graphs") == 0) {
        scenario_graphs();
    } else if (strcmp(scenario, "oom") == 0) {
        scenario_oom();
    } else {
        fprintf(stderr, "torch_standin: unknown scenario %s\n", scenario);
        return 2;
    }
    if (s_write_truth(argv[2]) != 0) {
        fprintf(stderr, "torch_standin: cannot write %s\n", argv[2]);
        return 1;
    }
    printf("result dump_rc=%d\n", dump ? dump("standin") : -2);
    for (int d = 0; d < 2; d++) {
        printf("result allocated_bytes_%d=%llu\n", d, s_allocated(d));
        printf("result reserved_bytes_%d=%llu\n", d, s_reserved(d));
    }
    const char *which = getenv("STANDIN_ALLOCATOR");
    printf("result allocator=%s\n", which && strcmp(which, "async") == 0 ? "async" : "native");
    printf("result attach_calls=%llu\n", s_attach_calls());
    printf("result tracker_calls=%llu\n", s_tracker_calls());
    printf("result scenario=%s\n", scenario);
    print_truth();
    return 0;
}
