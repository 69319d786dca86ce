/* The least a Python stack kept by the interpreter costs: a frame-evaluation function (PEP
 * 523) that pushes each frame the interpreter evaluates on a per-thread stack, evaluates it
 * with CPython's own function, and pops it. No memsnap: benches/python/real_torch_step.py's
 * `frame-eval` mode installs it before the step runs (INTERPRETER_HOOKS=1 bash
 * benches/real-torch-step.sh), to count what such a hook costs every Python call. Built
 * against the running interpreter's headers (CPython 3.11 and later: frames are
 * `_PyInterpreterFrame`s). */
#include <Python.h>

#define DEPTH 4096

static __thread struct _PyInterpreterFrame *frames[DEPTH];
static __thread int depth;

static PyObject *evaluate(PyThreadState *thread, struct _PyInterpreterFrame *frame, int throw_flag)
{
    int d = depth;
    if (d < DEPTH)
        frames[d] = frame;
    depth = d + 1;
    PyObject *result = _PyEval_EvalFrameDefault(thread, frame, throw_flag);
    depth = d;
    return result;
}

/* Called from Python through ctypes.PyDLL (the GIL held). */
void install(void)
{
    _PyInterpreterState_SetEvalFrameFunc(PyInterpreterState_Get(), evaluate);
}
