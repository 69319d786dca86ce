/* old_python.c (static runtime): a process that looks like an embedded CPython 3.8 to
 * memsnap (it exports Py_Version, Py_IsInitialized, PyGILState_GetThisThreadState and
 * _PyRuntime, built with -rdynamic), then allocates and exits. memsnap has no layout for
 * 3.8: it must say so once, and record native frames as usual. */
#include "prog_common.h"

const unsigned long Py_Version = 0x030812f0; /* 3.8.18 final */
char _PyRuntime[64];

int Py_IsInitialized(void) { return 0; }
void *PyGILState_GetThisThreadState(void) { return NULL; }

int main(void) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, 1u << 20));
    CHECK_RT(cudaFree(p));
    printf("result done=1\n");
    return 0;
}
