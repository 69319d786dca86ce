#!/usr/bin/env bash
# build-fake-cuda.sh OUTDIR: builds the fake CUDA driver and runtime and the test programs.
#
#   OUTDIR/lib/libcuda.so.1    fake driver (tests/fake_cuda/fake_cuda.c), + libcuda.so symlink
#   OUTDIR/lib/libcudart.so.13 fake runtime (tests/fake_cuda/fake_cudart.c), + libcudart.so symlink
#   OUTDIR/bin/<program>       tests/programs/*.c (and py_alloc.py, copied)
#   OUTDIR/bin/static_rt_stripped  static_rt without symbols
#   OUTDIR/lib/libroute_probe.so   a minimal counting interposer (tests/programs/route_probe.c)
#   OUTDIR/torch/lib/libc10_cuda.so  the PyTorch 2.11 stand-in (tests/fake_torch), unstripped,
#                                    linked against libcudart.so.13
#   OUTDIR/torch/version.py          __version__ = '2.11.0+standin'
#
# Programs carry no rpath: run them with LD_LIBRARY_PATH=OUTDIR/lib. Uses ${CC:-cc} and, for
# the stand-in, ${CXX:-c++}.
# Safe to run concurrently: callers serialize on OUTDIR/.build.lock, everything is built in a
# temporary directory and renamed into place file by file; a stamp of the inputs skips rebuilds.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
CC=${CC:-cc}
CXX=${CXX:-c++}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FAKE=$ROOT/tests/fake_cuda
PROGS=$ROOT/tests/programs
TORCH=$ROOT/tests/fake_torch
mkdir -p "$1"
OUT=$(cd "$1" && pwd)

STATIC_RT_PROGRAMS="static_rt oom threads handoff fork fork_signal signal sigchain crash closefds demo steps wait load top explain_steps explain_oom exec iter_leak"
SHARED_RT_PROGRAMS="shared_rt multi_device expandable torch_standin"
DRIVER_PROGRAMS="driver_direct"
DLOPEN_PROGRAMS="jax_dlsym driver_checks"
PLAIN_PROGRAMS="nocuda"
# Built with -rdynamic: their own symbols are what dlsym(RTLD_DEFAULT) finds.
RDYNAMIC_PROGRAMS="old_python"
PY_PROGRAMS="py_alloc.py py_helper.py py_steps.py py_signals.py py_callbacks.py torch_leak.py py_exec.py py_optimizer_steps.py py_frames_kept.py"

exec 9>"$OUT/.build.lock"
flock 9

stamp=$({
    cat "${BASH_SOURCE[0]}" "$FAKE"/*.h "$FAKE"/*.c "$PROGS"/*.h "$PROGS"/*.c "$PROGS"/*.py
    cat "$TORCH"/*.h "$TORCH"/*.cpp
    command -v "$CC"
    "$CC" --version | head -n 1
    command -v "$CXX"
    "$CXX" --version | head -n 1
} | sha256sum | cut -d' ' -f1)

up_to_date() {
    [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$stamp" ] || return 1
    for f in lib/libcuda.so.1 lib/libcudart.so.13 lib/libroute_probe.so bin/static_rt_stripped \
        torch/lib/libc10_cuda.so torch/version.py; do
        [ -e "$OUT/$f" ] || return 1
    done
    for p in $STATIC_RT_PROGRAMS $SHARED_RT_PROGRAMS $DRIVER_PROGRAMS $DLOPEN_PROGRAMS \
        $PLAIN_PROGRAMS $RDYNAMIC_PROGRAMS $PY_PROGRAMS; do
        [ -e "$OUT/bin/$p" ] || return 1
    done
}
if up_to_date; then
    exit 0
fi

TMP=$(mktemp -d "$OUT/.tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/lib" "$TMP/bin" "$TMP/obj" "$TMP/torch/lib"

CFLAGS="-std=gnu11 -g -O2 -Wall -Wextra -Werror"

# The driver. -Bsymbolic: like NVIDIA's libraries, the pointers the driver hands out (and its
# calls to itself) are its own functions, never an interposer's same-named exports; without it
# cuGetProcAddress would return a preloaded library's hooks and hide the substitution step.
"$CC" $CFLAGS -fPIC -shared -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o "$TMP/lib/libcuda.so.1" \
    "$FAKE/fake_cuda.c" -lpthread
ln -s libcuda.so.1 "$TMP/lib/libcuda.so"

# The runtime, shared and static. Neither may link or reference libcuda.
"$CC" $CFLAGS -fPIC -shared -Wl,-Bsymbolic -Wl,-soname,libcudart.so.13 -Wl,--no-undefined \
    -o "$TMP/lib/libcudart.so.13" "$FAKE/fake_cudart.c" -ldl -lpthread
ln -s libcudart.so.13 "$TMP/lib/libcudart.so"
"$CC" $CFLAGS -DFAKE_CUDART_STATIC -fvisibility=hidden -c -o "$TMP/obj/fake_cudart_static.o" \
    "$FAKE/fake_cudart.c"
if readelf -d "$TMP/lib/libcudart.so.13" | grep -q 'NEEDED.*libcuda'; then
    echo "build-fake-cuda: libcudart.so.13 must not link libcuda" >&2
    exit 1
fi
if nm -u "$TMP/obj/fake_cudart_static.o" | grep -Eq ' cu[A-Z]'; then
    echo "build-fake-cuda: the static runtime references driver symbols directly" >&2
    exit 1
fi

# The reference interposer (tests/programs/route_probe.c).
"$CC" $CFLAGS -fPIC -shared -o "$TMP/lib/libroute_probe.so" "$PROGS/route_probe.c" -ldl -lpthread

# The PyTorch 2.11 stand-in (tests/fake_torch/README.md). Hidden visibility and not stripped:
# the allocator's vtable and methods are LOCAL symbols in .symtab, as in PyTorch's library,
# and only `allocator` (and the C test API) is exported. cudaMalloc/cudaFree/cudaMemGetInfo
# go through the PLT into libcudart.so.13, where a preloaded library sees them.
"$CXX" -std=c++17 -g -O2 -Wall -Wextra -Werror -fvisibility=hidden -fPIC -shared \
    -Wl,-soname,libc10_cuda.so -Wl,--no-undefined -o "$TMP/torch/lib/libc10_cuda.so" \
    "$TORCH/c10_cuda_standin.cpp" -L"$TMP/lib" -lcudart -lpthread
printf "__version__ = '2.11.0+standin'\n" >"$TMP/torch/version.py"
standin_symbols=$(nm "$TMP/torch/lib/libc10_cuda.so")
for sym in \
    _ZTVN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocatorE \
    _ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator11initializedEv \
    _ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator27attachAllocatorTraceTrackerESt8functionIFvRKNS_22CachingDeviceAllocator10TraceEntryEEE; do
    if ! grep -Eq "^[0-9a-f]+ [drt] $sym\$" <<<"$standin_symbols"; then
        echo "build-fake-cuda: libc10_cuda.so lacks the local symbol $sym" >&2
        exit 1
    fi
done
if ! nm -D --defined-only "$TMP/torch/lib/libc10_cuda.so" |
    grep -Eq ' [BD] _ZN3c104cuda20CUDACachingAllocator9allocatorE$'; then
    echo "build-fake-cuda: libc10_cuda.so does not export c10::cuda::CUDACachingAllocator::allocator" >&2
    exit 1
fi
for f in cudaMalloc cudaFree cudaMemGetInfo; do
    if ! nm -D --undefined-only "$TMP/torch/lib/libc10_cuda.so" | grep -Eq " U $f\$"; then
        echo "build-fake-cuda: libc10_cuda.so does not import $f from libcudart.so.13" >&2
        exit 1
    fi
done

for p in $STATIC_RT_PROGRAMS; do
    "$CC" $CFLAGS -o "$TMP/bin/$p" "$PROGS/$p.c" "$TMP/obj/fake_cudart_static.o" -ldl -lpthread
    if nm -D "$TMP/bin/$p" | grep -q ' cudaMalloc'; then
        echo "build-fake-cuda: $p exports or imports cudaMalloc: the runtime is not internal" >&2
        exit 1
    fi
done
for p in $RDYNAMIC_PROGRAMS; do
    "$CC" $CFLAGS -rdynamic -o "$TMP/bin/$p" "$PROGS/$p.c" "$TMP/obj/fake_cudart_static.o" -ldl -lpthread
done
for p in $SHARED_RT_PROGRAMS; do
    "$CC" $CFLAGS -o "$TMP/bin/$p" "$PROGS/$p.c" -L"$TMP/lib" -lcudart -ldl -lpthread
done
for p in $DRIVER_PROGRAMS; do
    "$CC" $CFLAGS -o "$TMP/bin/$p" "$PROGS/$p.c" -L"$TMP/lib" -lcuda -ldl -lpthread
done
for p in $DLOPEN_PROGRAMS $PLAIN_PROGRAMS; do
    "$CC" $CFLAGS -o "$TMP/bin/$p" "$PROGS/$p.c" -ldl -lpthread
done
for p in $PY_PROGRAMS; do
    cp "$PROGS/$p" "$TMP/bin/$p"
done
strip --strip-all -o "$TMP/bin/static_rt_stripped" "$TMP/bin/static_rt"

# Rename into place one file at a time: a concurrent reader sees the old or the new file.
mkdir -p "$OUT/lib" "$OUT/bin" "$OUT/torch/lib"
for dir in lib bin torch/lib torch; do
    for f in "$TMP/$dir"/* "$TMP/$dir"/.[!.]*; do
        [ -e "$f" ] || [ -L "$f" ] || continue
        if [ -d "$f" ] && [ ! -L "$f" ]; then continue; fi # torch/lib: moved on its own
        mv -fT "$f" "$OUT/$dir/$(basename "$f")"
    done
done
echo "$stamp" >"$TMP/stamp"
mv -fT "$TMP/stamp" "$OUT/.stamp"
