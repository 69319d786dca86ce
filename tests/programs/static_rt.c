/* static_rt.c: the runtime scenario (rt_scenario.h) with the runtime linked into the program,
 * like nvcc's default static cudart: no cudaMalloc call goes through the dynamic linker; the
 * driver is reached only through dlsym + cuGetProcAddress_v2 + the nested lookup. */
#define PROGRAM_NAME "static_rt"
#include "rt_scenario.h"
