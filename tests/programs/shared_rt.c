/* shared_rt.c: the runtime scenario (rt_scenario.h) linked against libcudart.so.13, like
 * `nvcc -cudart shared` and PyTorch: cudaMalloc & co. resolve through the PLT. */
#define PROGRAM_NAME "shared_rt"
#include "rt_scenario.h"
