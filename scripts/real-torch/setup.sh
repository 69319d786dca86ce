#!/usr/bin/env bash
# scripts/real-torch/setup.sh DIR [VERSION]: the real PyTorch on the simulated CUDA driver, no GPU.
#
# Downloads PyTorch's Linux wheel (VERSION, default 2.11.0: about 530 MB, once; the CUDA
# build, the same library PyTorch's GPU machines load), unpacks it into DIR/site-packages
# (the folder name a pip install gives it: memsnap's reports tell a library's Python files
# from the program's by it), installs its pure-Python requirements into DIR/deps, and builds
# into DIR/lib what the wheel needs of NVIDIA's: the simulated driver
# (tests/fake_cuda/fake_cuda.c, with scripts/real-torch/driver.c) as libcuda.so.1, the simulated runtime
# (tests/fake_cuda/fake_cudart.c with scripts/real-torch/runtime.c) as libcudart.so.13 (.12
# for a wheel built for CUDA 12), and stand-ins for cuBLAS, cuDNN, NCCL and the others
# (scripts/real-torch/stubs.py; cuBLASLt's with scripts/real-torch/cublaslt.c). Then
# `torch.empty(..., device="cuda")` runs PyTorch's own caching allocator at the simulated
# driver's addresses, and a model's forward and backward passes allocate and free as on a
# GPU: kernel launches and cuBLAS calls succeed and compute nothing.
#
# Also installs Lightning and Hugging Face's Trainer into DIR/frameworks (not on env.sh's
# PYTHONPATH; REAL_TORCH_FRAMEWORKS=0: not at all).
#
# Writes DIR/env.sh (PYTHONPATH, LD_LIBRARY_PATH, FAKE_CUDA_DEVICES=1) and checks that a
# tensor allocated through the caching allocator is counted by it. Safe to run again: the
# wheel, its unpacked files and its requirements are kept; the libraries are built again.
# Uses ${PYTHON:-python3}, pip, cc, readelf, nm, unzip.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 DIR [VERSION]" >&2
    exit 2
fi
VERSION=${2:-2.11.0}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
for tool in cc readelf nm unzip; do
    command -v "$tool" >/dev/null || { echo "real-torch/setup.sh: needs $tool" >&2; exit 2; }
done

wheel=$(ls "$DIR"/wheel/torch-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "real-torch/setup.sh: downloading torch==$VERSION (no dependencies)" >&2
    "$PYTHON" -m pip download --quiet --no-deps --dest "$DIR/wheel" "torch==$VERSION"
    wheel=$(ls "$DIR"/wheel/torch-"$VERSION"-*.whl | head -n 1)
fi
if [ ! -f "$DIR/site-packages/.unpacked" ] || [ "$(cat "$DIR/site-packages/.unpacked")" != "$(basename "$wheel")" ]; then
    rm -rf "$DIR/site" "$DIR/site-packages" # (site: where this script unpacked it before)
    unzip -q "$wheel" -d "$DIR/site-packages"
    basename "$wheel" > "$DIR/site-packages/.unpacked"
fi
if [ ! -f "$DIR/deps/.installed" ]; then
    # The wheel's requirements without NVIDIA's libraries, Triton or the extras, with their
    # environment markers for pip to weigh (2.5.1 asks for one sympy on Python 3.8 and another
    # from 3.9: both at once cannot be installed).
    unzip -p "$wheel" "torch-$VERSION.dist-info/METADATA" | sed -n 's/^Requires-Dist: //p' \
        | grep -v -e 'extra ==' -e '^nvidia-' -e '^cuda-' -e '^triton' > "$DIR/requirements.txt"
    rm -rf "$DIR/deps" # (what an interrupted install left)
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$DIR/deps" \
        -r "$DIR/requirements.txt"
    touch "$DIR/deps/.installed"
fi

# Lightning and Hugging Face's Trainer (with accelerate), for the steps tests
# (tests/real_torch.rs; REAL_TORCH_FRAMEWORKS=0 leaves them out, and those tests skip). Into
# DIR/frameworks, with their requirements but PyTorch's: a wheel of PyTorch's name and
# version holding nothing stands for it (the unpacked wheel is on PYTHONPATH ahead of it).
FRAMEWORKS="lightning==2.6.6 transformers==5.24.0 accelerate==1.15.0"
if [ "${REAL_TORCH_FRAMEWORKS:-1}" != 0 ] && [ "$(cat "$DIR/frameworks/.installed" 2>/dev/null)" != "$FRAMEWORKS" ]; then
    rm -rf "$DIR/frameworks" "$DIR/torch-stand-in"
    mkdir -p "$DIR/torch-stand-in"
    "$PYTHON" - "$DIR/torch-stand-in" "$VERSION" <<'PY'
import base64, hashlib, sys, zipfile
folder, version = sys.argv[1], sys.argv[2] + "+stand.in"
info = f"torch-{version}.dist-info"
files = {
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: memsnap\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = "".join(
    f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text)}\n"
    for name, text in files.items()
) + f"{info}/RECORD,,\n"
with zipfile.ZipFile(f"{folder}/torch-{version}-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
    wheel.writestr(f"{info}/RECORD", record)
PY
    echo "torch==$VERSION+stand.in" > "$DIR/torch-stand-in/constraints.txt"
    echo "real-torch/setup.sh: installing $FRAMEWORKS" >&2
    # shellcheck disable=SC2086
    if "$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$DIR/frameworks" \
        --find-links "$DIR/torch-stand-in" -c "$DIR/torch-stand-in/constraints.txt" $FRAMEWORKS; then
        echo "$FRAMEWORKS" > "$DIR/frameworks/.installed"
    else
        echo "real-torch/setup.sh: could not install $FRAMEWORKS: the tests that need them skip" >&2
        rm -rf "$DIR/frameworks"
    fi
fi

rm -rf "$DIR/lib" "$DIR/stubs" "$DIR/fake" # (made again each time, from this wheel only; fake: where the driver was built before)
mkdir -p "$DIR/lib" "$DIR/stubs"
CFLAGS="-O2 -fPIC -w"
# The simulated driver with the driver functions it lacks that releases up to 2.7 look up in it
# by name (scripts/real-torch/driver.c); -Bsymbolic as scripts/build-fake-cuda.sh builds it.
cc $CFLAGS -shared -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o "$DIR/lib/libcuda.so.1" \
    "$ROOT/tests/fake_cuda/fake_cuda.c" "$ROOT/scripts/real-torch/driver.c" -ldl -lpthread
cc $CFLAGS -c -o "$DIR/stubs/fake_cudart.o" "$ROOT/tests/fake_cuda/fake_cudart.c"
cc $CFLAGS -c -o "$DIR/stubs/runtime.o" "$ROOT/scripts/real-torch/runtime.c"
cc $CFLAGS -c -o "$DIR/stubs/cublaslt.o" "$ROOT/scripts/real-torch/cublaslt.c"
{
    nm --defined-only -g "$DIR/stubs/fake_cudart.o" "$DIR/stubs/runtime.o" "$DIR/stubs/cublaslt.o"
    nm -D --defined-only "$DIR/lib/libcuda.so.1"
} | awk 'NF == 3 {print $3}' > "$DIR/stubs/simulated_defined"
"$PYTHON" "$ROOT/scripts/real-torch/stubs.py" "$DIR/site-packages" "$DIR/stubs/simulated_defined" "$DIR/stubs" \
    > "$DIR/stubs/generated.txt"
for c in "$DIR"/stubs/*.so*.c; do
    soname=$(basename "$c" .c)
    extra=()
    if [[ $soname == libcudart.so.* ]]; then
        extra=("$DIR/stubs/fake_cudart.o" "$DIR/stubs/runtime.o" -Wl,-Bsymbolic -ldl -lpthread)
    elif [[ $soname == libcublasLt.so.* ]]; then
        extra=("$DIR/stubs/cublaslt.o")
    fi
    cc $CFLAGS -shared -Wl,-soname,"$soname" -Wl,--version-script="$DIR/stubs/$soname.map" \
        -o "$DIR/lib/$soname" "$c" "${extra[@]}"
done

cat > "$DIR/env.sh" <<ENV
# The real PyTorch $VERSION on the simulated CUDA driver (scripts/real-torch/setup.sh).
export PYTHONPATH="$DIR/site-packages:$DIR/deps\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export FAKE_CUDA_DEVICES=1
ENV
# shellcheck disable=SC1091
( . "$DIR/env.sh" && "$PYTHON" -W ignore -c '
import torch
x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
assert torch.cuda.memory_allocated() == 1 << 20, torch.cuda.memory_allocated()
assert torch.cuda.get_allocator_backend() == "native"
print(f"real-torch/setup.sh: PyTorch {torch.__version__} on the simulated driver: a tensor of 1 MiB at {x.data_ptr():#x}, {torch.cuda.memory_reserved()} bytes reserved")
' )
