//! Stacks end to end, through the preloaded library: the frames in the written snapshot name
//! the C function and file:line (or the Python line) that made each allocation, in
//! PyTorch's frame format, innermost first, with memsnap's own frames removed.

mod common;

use common::{
    Run, fake_lib_dir, label_of, num, preload_lib, python_load_json, run_program, snapshot_files,
};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

fn exit_snapshot(run: &Run) -> Value {
    run.assert_success();
    let files: Vec<PathBuf> = snapshot_files(run.dir.path())
        .into_iter()
        .filter(|p| label_of(p).as_deref() == Some("exit"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}\n{}", run.stderr);
    python_load_json(&files[0])
}

/// Frames of the first live block of exactly `size` bytes.
fn frames_of_block(snap: &Value, size: u64) -> Vec<Value> {
    for seg in snap["segments"].as_array().unwrap() {
        for b in seg["blocks"].as_array().unwrap() {
            if b["size"].as_u64() == Some(size) {
                return b["frames"].as_array().unwrap().clone();
            }
        }
    }
    panic!("no live block of {size} bytes");
}

fn names(frames: &[Value]) -> Vec<String> {
    frames
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect()
}

/// Source files of the code that runs inside the host process (the hooks and what they call).
const HOOK_SOURCES: &[&str] = &[
    "/src/interpose/",
    "/src/capture/",
    "/src/channel/",
    "/src/lifecycle/",
    "/src/record.rs",
    "/src/guard.rs",
];

fn assert_no_memsnap_frames(frames: &[Value]) {
    for f in frames {
        let name = f["name"].as_str().unwrap();
        let file = f["filename"].as_str().unwrap();
        assert!(
            !name.contains("memsnap::")
                && !file.contains("libmemsnap")
                && !HOOK_SOURCES.iter().any(|s| file.contains(s)),
            "memsnap's own frame leaked into a stack: {f}"
        );
    }
}

#[test]
fn c_frames_name_the_function_and_line_that_allocated() {
    let run = run_program("static_rt", &[], &[], true);
    let snap = exit_snapshot(&run);
    let r = run.results();
    let frames = frames_of_block(&snap, 1 << 20); // WEIGHTS1: alloc_weights' first cudaMalloc
    assert_no_memsnap_frames(&frames);
    let site = frames
        .iter()
        .find(|f| f["name"] == "alloc_weights")
        .unwrap_or_else(|| panic!("no alloc_weights frame in {:?}", names(&frames)));
    assert!(
        site["filename"]
            .as_str()
            .unwrap()
            .ends_with("rt_scenario.h"),
        "{site}"
    );
    assert_eq!(
        site["line"].as_u64().unwrap(),
        num(&r, "alloc_weights_line")
    );
    // Innermost first: the allocating function comes before its caller, main.
    let pos = |n: &str| names(&frames).iter().position(|x| x == n);
    assert!(pos("alloc_weights") < pos("main"), "{:?}", names(&frames));
    // Every frame has PyTorch's three keys with the right types.
    for f in &frames {
        assert!(
            f["name"].is_string() && f["filename"].is_string() && f["line"].is_i64(),
            "{f}"
        );
    }
}

#[test]
fn a_stripped_library_is_named_from_its_dynamic_symbols() {
    // Like libtorch_cuda.so: no DWARF, no .symtab, only .dynsym. A stripped copy of the
    // runtime, found first on the library path.
    let dir = tempfile::tempdir().unwrap();
    let stripped = dir.path().join("libcudart.so.13");
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&stripped)
        .arg(fake_lib_dir().join("libcudart.so.13"))
        .status()
        .expect("run strip");
    assert!(status.success());
    // Through ctypes the runtime's own cudaMalloc runs (and reaches the driver through our
    // hooked pointer), so the stripped library is on the recorded stack.
    let run = run_program(
        "py_alloc.py",
        &["main"],
        &[
            ("FAKE_CUDART", stripped.to_str().unwrap()),
            ("MEMSNAP_STACKS", "all"),
        ],
        true,
    );
    let snap = exit_snapshot(&run);
    let frames = frames_of_block(&snap, 1024);
    assert_no_memsnap_frames(&frames);
    // Named `symbol+offset`, the library as its file.
    let runtime = frames
        .iter()
        .find(|f| f["name"].as_str().unwrap().starts_with("cudaMalloc+0x"))
        .unwrap_or_else(|| panic!("no cudaMalloc frame from .dynsym: {:?}", names(&frames)));
    assert_eq!(runtime["line"], 0, "no line without debug info: {runtime}");
    assert_eq!(
        runtime["filename"].as_str().unwrap(),
        stripped.to_str().unwrap(),
        "{runtime}"
    );
    // Python frames above it are unaffected.
    assert!(
        names(&frames).iter().any(|n| n == "make_tensor"),
        "{:?}",
        names(&frames)
    );
}

#[test]
fn a_fully_stripped_executable_gives_module_paths_not_made_up_names() {
    let run = run_program("static_rt_stripped", &[], &[], true);
    let snap = exit_snapshot(&run);
    let frames = frames_of_block(&snap, 1 << 20);
    assert_no_memsnap_frames(&frames);
    // No .symtab and no exported function holding them: the program's frames are named
    // `module+offset`, never `??`; libc's frames still have names.
    let own: Vec<&Value> = frames
        .iter()
        .filter(|f| {
            f["filename"]
                .as_str()
                .unwrap()
                .ends_with("static_rt_stripped")
        })
        .collect();
    assert!(!own.is_empty(), "{frames:?}");
    assert!(
        own.iter().all(|f| {
            let name = f["name"].as_str().unwrap();
            name.strip_prefix("static_rt_stripped+0x")
                .is_some_and(|hex| u64::from_str_radix(hex, 16).is_ok())
                && f["line"] == 0
        }),
        "{own:?}"
    );
    assert!(frames.iter().all(|f| f["name"] != "??"), "{frames:?}");
    assert!(
        names(&frames).iter().any(|n| n.contains("libc_start")),
        "{:?}",
        names(&frames)
    );
}

/// A library without debug info (as cuBLAS ships): a 4-byte export, then a large static
/// function that allocates, then the export that calls it. Built here and called through
/// ctypes.
const HELPER_C: &str = r#"
#include <stddef.h>
int cudaMalloc(void **p, size_t n);
int tiny_export(int x) { return x + 1; }
#define W4(i) sink = n + i; sink = n ^ i; sink = n - i; sink = n * i;
__attribute__((noinline)) static void *big_static(size_t n) {
    static volatile size_t sink;
    W4(1) W4(2) W4(3) W4(4) W4(5) W4(6) W4(7) W4(8) W4(9) W4(10) W4(11) W4(12)
    void *p = 0;
    if (cudaMalloc(&p, n) != 0) return 0;
    __asm__ volatile("" ::: "memory");
    return p;
}
void *entry_alloc(size_t n) {
    void *p = big_static(n);
    __asm__ volatile("" ::: "memory");
    return p;
}
"#;

const HELPER_PY: &str = r#"
import ctypes, sys
# Global, as PyTorch loads its CUDA libraries: the preloaded hooks forward a runtime call
# to the runtime in the global scope.
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
lib.entry_alloc.restype = ctypes.c_void_p
lib.entry_alloc.argtypes = [ctypes.c_size_t]
assert lib.tiny_export(1) == 2
assert lib.entry_alloc(12345)
"#;

/// Start and size of each named function in the `.symtab` of the file at `path`.
fn functions(path: &std::path::Path) -> std::collections::HashMap<String, (u64, u64)> {
    use object::{Object, ObjectSymbol, SymbolKind};
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).expect("an ELF file");
    file.symbols()
        .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0)
        .map(|s| (s.name().unwrap().to_string(), (s.address(), s.size())))
        .collect()
}

/// Runs HELPER_PY on `lib` under the preload; the frames of its 12345-byte block that are in
/// `lib`, innermost first, as (name, line).
fn helper_frames(lib: &std::path::Path) -> Vec<(String, i64)> {
    let script = lib.with_file_name("helper.py");
    std::fs::write(&script, HELPER_PY).unwrap();
    let folder = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("python3");
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
    let o = cmd
        .arg(&script)
        .arg(lib)
        .env("LD_LIBRARY_PATH", fake_lib_dir())
        .env("LD_PRELOAD", preload_lib())
        .env("MEMSNAP_FOLDER", folder.path())
        .env("MEMSNAP_STACKS", "all")
        .output()
        .expect("run python3");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let files = snapshot_files(folder.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let snap = python_load_json(&files[0]);
    for seg in snap["segments"].as_array().unwrap() {
        for b in seg["blocks"].as_array().unwrap() {
            for f in b["frames"].as_array().unwrap() {
                assert_ne!(f["name"], "??", "{f}");
            }
        }
    }
    frames_of_block(&snap, 12345)
        .iter()
        .filter(|f| f["filename"].as_str() == lib.to_str())
        .map(|f| {
            (
                f["name"].as_str().unwrap().to_string(),
                f["line"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// `prefix` followed by a hex offset: the offset.
fn offset_after(name: &str, prefix: &str) -> Option<u64> {
    u64::from_str_radix(name.strip_prefix(prefix)?.strip_prefix("0x")?, 16).ok()
}

#[test]
fn a_frame_past_a_symbols_end_is_named_by_its_library_not_the_symbol_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("helper.c");
    std::fs::write(&src, HELPER_C).unwrap();
    let built = dir.path().join("built.so");
    common::build_cuda_library(&src, &built, &["-O1", "-fno-toplevel-reorder"]);
    // Where the functions are, from the unstripped file (stripping moves nothing).
    let funcs = functions(&built);
    let (tiny, tiny_size) = funcs["tiny_export"];
    let (big, big_size) = funcs["big_static"];
    let (entry, entry_size) = funcs["entry_alloc"];
    assert!(
        tiny_size < 16 && tiny + tiny_size <= big && big_size > 0x100,
        "{funcs:?}"
    );

    // Stripped both ways, and not at all (its .symtab names the static function).
    for strip in ["--strip-unneeded", "--strip-all", ""] {
        let folder = dir.path().join(format!("case{}", strip.len()));
        std::fs::create_dir(&folder).unwrap();
        let lib = folder.join("libhelper.so");
        if strip.is_empty() {
            std::fs::copy(&built, &lib).unwrap();
        } else {
            let status = Command::new("strip")
                .arg(strip)
                .arg("-o")
                .arg(&lib)
                .arg(&built)
                .status()
                .expect("run strip");
            assert!(status.success());
        }
        let frames = helper_frames(&lib);
        let names: Vec<&str> = frames.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(frames.len(), 2, "[{strip}] {frames:?}");
        assert!(
            frames.iter().all(|(_, line)| *line == 0),
            "[{strip}] {frames:?}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("tiny_export")),
            "[{strip}] a frame named after the export before it: {names:?}"
        );
        // Innermost: big_static's call of cudaMalloc, its return address inside big_static.
        let pc = if strip.is_empty() {
            big + offset_after(names[0], "big_static+").unwrap_or_else(|| panic!("{names:?}"))
        } else {
            offset_after(names[0], "libhelper.so+").unwrap_or_else(|| panic!("[{strip}] {names:?}"))
        };
        assert!(
            big < pc && pc <= big + big_size,
            "[{strip}] {pc:#x} {funcs:?}"
        );
        // Then entry_alloc's call of big_static: inside an export, so named by it.
        let off = offset_after(names[1], "entry_alloc+").unwrap_or_else(|| panic!("{names:?}"));
        assert!(
            off > 0 && off <= entry_size,
            "[{strip}] {names:?} {funcs:?}"
        );
        assert!(entry > big, "{funcs:?}");
    }
}

#[test]
fn python_frames_name_the_line_through_ctypes() {
    for mode in ["main", "thread"] {
        let run = run_program(
            "py_alloc.py",
            &[mode],
            &[("MEMSNAP_STACKS", "python")],
            true,
        );
        let snap = exit_snapshot(&run);
        let r = run.results();
        let frames = frames_of_block(&snap, 1024); // forward(1)'s `out`: live at exit
        let file = r["file"].clone();
        assert_eq!(
            frames[0]["name"],
            "make_tensor",
            "{mode}: {:?}",
            names(&frames)
        );
        assert_eq!(frames[0]["filename"].as_str().unwrap(), file);
        assert_eq!(frames[0]["line"].as_u64().unwrap(), num(&r, "line"));
        assert_eq!(frames[1]["name"], "forward");
        assert_eq!(frames[2]["name"], "train");
        // stacks=python: nothing but Python frames.
        assert!(
            frames
                .iter()
                .all(|f| f["filename"] == file || f["filename"].as_str().unwrap().ends_with(".py"))
        );
    }
}

#[test]
fn all_stacks_place_python_frames_among_native_ones() {
    let run = run_program("py_alloc.py", &["main"], &[("MEMSNAP_STACKS", "all")], true);
    let snap = exit_snapshot(&run);
    let frames = frames_of_block(&snap, 1024);
    assert_no_memsnap_frames(&frames);
    let n = names(&frames);
    let make = n
        .iter()
        .position(|x| x == "make_tensor")
        .expect("python frame present");
    // Native frames (the runtime, ctypes/libffi) come before (inside) the Python caller.
    assert!(make > 0, "{n:?}");
    assert!(n[..make].iter().any(|x| x.contains("cudaMalloc")), "{n:?}");
    // The Python frames keep their order.
    let forward = n.iter().position(|x| x == "forward").unwrap();
    let train = n.iter().position(|x| x == "train").unwrap();
    assert!(make < forward && forward < train, "{n:?}");
}

#[test]
fn stacks_none_records_no_frames_and_context_all_gives_frees_their_own() {
    let run = run_program(
        "py_alloc.py",
        &["main"],
        &[("MEMSNAP_STACKS", "none")],
        true,
    );
    let snap = exit_snapshot(&run);
    for e in snap["device_traces"][0].as_array().unwrap() {
        assert_eq!(e["frames"].as_array().unwrap().len(), 0, "{e}");
    }

    let free_frames = |context: &str| -> Vec<String> {
        let run = run_program(
            "py_alloc.py",
            &["main"],
            &[("MEMSNAP_STACKS", "python"), ("MEMSNAP_CONTEXT", context)],
            true,
        );
        let snap = exit_snapshot(&run);
        let free = snap["device_traces"][0]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["action"] == "free_requested")
            .expect("a free")
            .clone();
        names(free["frames"].as_array().unwrap())
    };
    assert_eq!(
        free_frames("alloc")[0],
        "make_tensor",
        "frees reuse the allocation's stack"
    );
    assert_eq!(
        free_frames("all")[0],
        "free_tensor",
        "frees record their own stack"
    );
}

#[test]
fn deep_recursion_is_cut_at_max_frames() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("deep.py");
    std::fs::write(
        &script,
        "import ctypes, os\n\
         rt = ctypes.CDLL(os.environ['FAKE_CUDART'])\n\
         def down(n):\n\
         \x20   if n == 0:\n\
         \x20       p = ctypes.c_void_p(); rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(12345)); return\n\
         \x20   down(n - 1)\n\
         down(100)\n",
    )
    .unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .env("LD_PRELOAD", preload_lib())
        .env("LD_LIBRARY_PATH", fake_lib_dir())
        .env("FAKE_CUDART", fake_lib_dir().join("libcudart.so.13"))
        .env("MEMSNAP_FOLDER", dir.path())
        .env("MEMSNAP_STACKS", "all")
        .env("MEMSNAP_MAX_FRAMES", "4")
        .env("MEMSNAP_QUIET", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = snapshot_files(dir.path())
        .into_iter()
        .find(|p| p.extension().is_some_and(|e| e == "pickle"))
        .unwrap();
    let snap = python_load_json(&file);
    let frames = frames_of_block(&snap, 12345);
    let python: Vec<&Value> = frames
        .iter()
        .filter(|f| f["filename"].as_str().unwrap().ends_with("deep.py"))
        .collect();
    assert_eq!(
        python.len(),
        4,
        "Python frames capped at MEMSNAP_MAX_FRAMES"
    );
    assert!(python.iter().all(|f| f["name"] == "down"));
    // Native: the innermost return addresses are kept (symbolization may expand one into
    // several inlined frames), the outermost ones are dropped.
    let n = names(&frames);
    assert_eq!(n[0], "cudaMalloc", "{n:?}");
    assert!(
        !n.iter()
            .any(|x| x.contains("libc_start_main") || x == "Py_BytesMain"),
        "{n:?}"
    );
}

/// An embedded Python memsnap has no layout for is said once, with one `memsnap: ` prefix.
#[test]
fn an_unsupported_python_is_said_once_with_one_prefix() {
    let run = common::run_program("old_python", &[], &[], true);
    run.assert_success();
    let said: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| l.contains("is not supported"))
        .collect();
    assert_eq!(said.len(), 1, "{}", run.stderr);
    assert!(
        said[0].starts_with("memsnap: Python 3.8 is not supported"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("memsnap: memsnap:"), "{}", run.stderr);
}
