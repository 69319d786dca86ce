//! Cost of stack capture per event (not a timed test; figures go to docs/BENCHMARKS.md).
//!
//! `cargo bench --bench stacks` builds the release `libmemsnap.so`, a small C library, and runs
//! a CPython (`BENCH_PYTHON`, default: pyenv 3.12, else `python3`) that builds a
//! 10-frame Python stack, calls through ctypes (GIL released, as PyTorch's CUDA calls) into
//! the C library, which recurses to make the native stack about 30 frames deep and calls
//! `memsnap_debug_bench_capture`: N captures in a loop at that depth, timed inside the
//! library. Reports ns per capture for stacks = python, native, all; plus the writer's
//! per-event interning cost and its first symbolization of that stack.

use std::path::PathBuf;
use std::process::Command;

mod support;

const C_SOURCE: &str = r#"
#include <stdint.h>
typedef uint64_t (*bench_t)(int, int, uint64_t, uint64_t *);
__attribute__((noinline)) uint64_t bench_deep(int n, bench_t f, int stacks, int max,
                                              uint64_t iters, uint64_t *out) {
    if (n <= 0) return f(stacks, max, iters, out);
    uint64_t r = bench_deep(n - 1, f, stacks, max, iters, out);
    __asm__ volatile("" ::: "memory");
    return r;
}
"#;

const SCRIPT: &str = r#"
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
deep = ctypes.CDLL(sys.argv[2]).bench_deep
deep.restype = ctypes.c_uint64
deep.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                 ctypes.POINTER(ctypes.c_uint64)]
bench = ctypes.cast(lib.memsnap_debug_bench_capture, ctypes.c_void_p)
c_depth, iters = int(sys.argv[3]), int(sys.argv[4])
RUNS = 25

def run(mode):
    out = (ctypes.c_uint64 * 4)()
    best = None
    for _ in range(RUNS):
        ns = deep(c_depth, bench, mode, 0, iters, out)
        best = ns if best is None else min(best, ns)
    return best / iters, out[0], out[1], out[2] / iters, out[3] / 1e6

def py(n, mode):
    if n <= 1:
        return run(mode)
    return py(n - 1, mode)

for name, mode in [("none", 0), ("python", 1), ("native", 2), ("all", 3)]:
    ns, nat, pyf, intern, sym = py(10, mode)
    print(f"stacks={name:<7} {ns:8.1f} ns/capture  native={nat:2d} python={pyf:2d}  "
          f"writer intern {intern:6.1f} ns/event, first symbolization {sym:7.2f} ms")
"#;

fn main() {
    if !support::benchmarking("stacks") {
        return;
    }
    let so = support::release_library();
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("benchdeep.c");
    let clib = dir.path().join("libbenchdeep.so");
    std::fs::write(&src, C_SOURCE).expect("write");
    let st = Command::new("cc")
        .args(["-O2", "-fPIC", "-shared", "-o"])
        .arg(&clib)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(st.success());
    let script = dir.path().join("bench.py");
    std::fs::write(&script, SCRIPT).expect("write");
    let python = std::env::var("BENCH_PYTHON").unwrap_or_else(|_| {
        // pyenv's 3.12.1: `$PYENV_ROOT`, else `$HOME/.pyenv`.
        let root = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".pyenv")
            });
        let p = root.join("versions/3.12.1/bin/python3");
        if p.is_file() {
            p.to_string_lossy().into_owned()
        } else {
            "python3".to_string()
        }
    });
    let c_depth = std::env::var("BENCH_C_DEPTH").unwrap_or_else(|_| "8".to_string());
    let iters = std::env::var("BENCH_ITERS").unwrap_or_else(|_| "20000".to_string());
    let out = Command::new(&python)
        .arg(&script)
        .arg(&so)
        .arg(&clib)
        .arg(&c_depth)
        .arg(&iters)
        .output()
        .expect("run python");
    let v = Command::new(&python)
        .arg("--version")
        .output()
        .expect("python --version");
    println!(
        "{} ({}), C depth {c_depth}, {iters} captures per run, best of 25",
        python,
        String::from_utf8_lossy(&v.stdout).trim()
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());

    // Without Python or libffi: this binary calls the C recursion directly.
    let depth: i32 = support::setting("BENCH_NATIVE_DEPTH", 24);
    let iters: u64 = iters.parse().unwrap_or(100_000);
    type Bench = unsafe extern "C" fn(i32, i32, u64, *mut u64) -> u64;
    type Deep = unsafe extern "C" fn(i32, Bench, i32, i32, u64, *mut u64) -> u64;
    let b = support::symbol_in(&so, c"memsnap_debug_bench_capture");
    let d = support::symbol_in(&clib, c"bench_deep");
    // SAFETY: the symbols of the libraries built above have these C signatures.
    let (bench, deep) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, Bench>(b),
            std::mem::transmute::<*mut libc::c_void, Deep>(d),
        )
    };
    println!("no Python, no libffi: this binary -> C recursion {depth} deep -> capture");
    for (name, mode) in [("native", 2), ("all", 3)] {
        let mut out = [0u64; 4];
        let best = (0..25)
            // SAFETY: valid function pointers and a four-element output array.
            .map(|_| unsafe { deep(depth, bench, mode, 0, iters, out.as_mut_ptr()) })
            .min()
            .unwrap_or(0);
        println!(
            "stacks={name:<7} {:8.1} ns/capture  native={:2} python={:2}",
            best as f64 / iters as f64,
            out[0],
            out[1]
        );
    }
}
