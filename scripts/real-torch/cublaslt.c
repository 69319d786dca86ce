/* What the real PyTorch needs of cuBLASLt beyond "success" for a matrix product on the simulated
 * driver, for scripts/real-torch/setup.sh: linked into the cuBLASLt stand-in, whose other
 * functions scripts/real-torch/stubs.py generates (they return success and write nothing).
 *
 * PyTorch asks cuBLASLt's heuristic for one algorithm and fails the product when none is
 * returned (2.7; 2.11 falls back to cuBLAS, which takes another route through the allocator
 * than the GPU does). This one returns a single algorithm that needs no workspace: the
 * product then runs its allocations as on a GPU and computes nothing. */
#include <string.h>

/* cublasLtMatmulHeuristicResult_t: the algorithm (8 words), the workspace it needs, its
 * status, waves, reserved words. */
struct heuristic_result {
    unsigned long long algo[8];
    size_t workspace_size;
    int state;
    float waves_count;
    int reserved[4];
};

int cublasLtMatmulAlgoGetHeuristic(void *handle, void *operation, void *a, void *b, void *c,
                                   void *d, void *preference, int requested,
                                   struct heuristic_result *results, int *returned) {
    (void)handle, (void)operation, (void)a, (void)b, (void)c, (void)d, (void)preference;
    if (requested < 1 || !results || !returned)
        return 7; /* CUBLAS_STATUS_INVALID_VALUE */
    memset(results, 0, sizeof *results);
    results->waves_count = 1.0f;
    *returned = 1;
    return 0;
}
