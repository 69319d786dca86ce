//! The newcomer's scripts: `scripts/test-tally.py` (the closing lines of scripts/test.sh)
//! and `scripts/try-simulated.sh` (your own C or Python file on the simulated driver); and
//! the stand-ins `scripts/real-torch/stubs.py` writes for the libraries a PyTorch wheel
//! links (benches/real-torch.sh: the real PyTorch on the simulated driver), tried on a
//! wheel-shaped folder built here.
//!
//! The try-simulated test builds the release profile (what the script does), so plain
//! `cargo test` ignores it; scripts/test.sh runs it after the wheel's release build.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn test_tally_counts_each_test_once_and_says_what_did_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("test.log");
    std::fs::write(
        &main,
        "     Running tests/cli.rs (target/debug/deps/cli-0123456789abcdef)\n\
         test chromium_page_loads ... ignored, needs chromium\n\
         test summary_json ... ok\n\
         \x20    Running unittests src/main.rs (target/debug/deps/memsnap-0123456789abcdef)\n\
         test top::model::tests::header ... ok\n\
         test top::model::tests::broken ... FAILED\n\
         \x20    Running tests/remote.rs (target/debug/deps/remote-0123456789abcdef)\n\
         test azure_upload ... ignored, needs Azurite\n\
         test s3_upload ... ignored, needs moto\n\
         \x20  Doc-tests memsnap_format\n\
         test crates/format/src/lib.rs - x (line 3) ... ok\n\
         test result: FAILED. 3 passed; 1 failed; 3 ignored\n",
    )
    .unwrap();
    // The ignored tests the script ran afterwards, with their tools.
    let later = dir.path().join("s3_.log");
    std::fs::write(
        &later,
        "     Running tests/remote.rs (target/debug/deps/remote-fedcba9876543210)\n\
         test s3_upload ... ok\n\
         \x20    Running tests/cli.rs (target/debug/deps/cli-fedcba9876543210)\n\
         test chromium_page_loads ... ok\n",
    )
    .unwrap();
    let out = Command::new("python3")
        .arg(root().join("scripts/test-tally.py"))
        .args(["--why", "azure_=Azurite missing"])
        .arg(&main)
        .arg(&later)
        .output()
        .expect("python3 scripts/test-tally.py");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text,
        "FAILED: memsnap: top::model::tests::broken\n\
         not run: 1 (Azurite missing): remote::azure_upload\n\
         5 passed, 1 failed, 1 skipped\n"
    );
}

/// A test that found its tool missing reports "ok" to cargo and leaves a record: the tally
/// counts it as skipped, with the record's reason, not as passed.
#[test]
fn the_tally_counts_a_test_that_found_its_tool_missing_as_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("test.log");
    std::fs::write(
        &log,
        "     Running tests/cli.rs (target/debug/deps/cli-0123456789abcdef)\n\
         test view_of_a_large_generated_snapshot_is_written ... ok\n\
         test summary_of_a_file ... ok\n",
    )
    .unwrap();
    let skips = dir.path().join("test-skips");
    std::fs::create_dir(&skips).unwrap();
    std::fs::write(
        skips.join("cli::view_of_a_large_generated_snapshot_is_written"),
        "python3 missing",
    )
    .unwrap();
    let out = Command::new("python3")
        .arg(root().join("scripts/test-tally.py"))
        .arg("--skips")
        .arg(&skips)
        .arg(&log)
        .output()
        .expect("python3 scripts/test-tally.py");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "not run: 1 (python3 missing): cli::view_of_a_large_generated_snapshot_is_written\n\
         1 passed, 0 failed, 1 skipped\n"
    );
}

#[test]
#[ignore = "builds the release profile: scripts/test.sh runs it after the wheel's release build"]
fn try_simulated_runs_a_c_and_a_python_file_and_says_where_the_snapshots_are() {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("mine.c");
    std::fs::write(
        &c,
        "#define _GNU_SOURCE\n#include <cuda_runtime.h>\n#include <dlfcn.h>\n#include \"memsnap.h\"\n\
         static void *grab(size_t n) { void *p = 0; cudaMalloc(&p, n); return p; }\n\
         int main(void) {\n\
         \x20   void *a = grab(1 << 20), *b = grab(3 << 20);\n\
         \x20   int (*step)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, \"memsnap_step\");\n\
         \x20   if (step) step();\n\
         \x20   cudaFree(a);\n\
         \x20   return b ? 0 : 1;\n\
         }\n",
    )
    .unwrap();
    let py = dir.path().join("mine.py");
    std::fs::write(
        &py,
        "import ctypes, sys\nimport memsnap\n\
         rt = ctypes.CDLL('libcudart.so.13')\np = ctypes.c_void_p()\n\
         def grab(n):\n    rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))\n\
         grab(1 << 20)\nprint('argv', sys.argv[1:])\nprint('dumped', memsnap.dump('mine'))\n",
    )
    .unwrap();
    // One folder for both: the simulated driver is built once.
    let out_dir = dir.path().join("try");
    for (file, args, files) in [(&c, &[][..], 1), (&py, &["x", "y"][..], 2)] {
        let mut script = Command::new("bash");
        script
            .arg(root().join("scripts/try-simulated.sh"))
            .arg(file)
            .args(args)
            .env("MEMSNAP_TRY_DIR", &out_dir)
            .env_remove("LD_PRELOAD");
        // Run as from a user's shell, without what cargo sets for this test (its package's
        // name and folder, OUT_DIR): build scripts that watch those variables (ring's) would
        // otherwise run again, and the release build the wheel's build made be compiled anew.
        const SET_BY_CARGO: [&str; 7] = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_",
            "CARGO_TARGET_TMPDIR",
            "OUT_DIR",
        ];
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if SET_BY_CARGO.iter().any(|set| name.starts_with(set)) {
                script.env_remove(&*name);
            }
        }
        let out = script.output().expect("bash scripts/try-simulated.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let snaps = out_dir.join("snapshots");
        let written: Vec<_> = std::fs::read_dir(&snaps)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
            .collect();
        assert_eq!(written.len(), files, "{written:?}\n{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("Snapshots in {}/", snaps.display())),
            "{stdout}"
        );
        if file == &py {
            assert!(stdout.contains("argv ['x', 'y']"), "{stdout}");
        }
    }
    // Not a .c or .py file: the usage, status 2.
    let out = Command::new("bash")
        .arg(root().join("scripts/try-simulated.sh"))
        .arg("notes.txt")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FILE.c"));
}

/// Runs `cc ARGS` in `dir`, which must succeed.
fn cc(dir: &Path, args: &[&str]) {
    let status = Command::new("cc")
        .current_dir(dir)
        .args(args)
        .status()
        .expect("cc");
    assert!(status.success(), "cc {args:?}");
}

#[test]
fn real_torch_stubs_give_a_wheel_the_libraries_it_links_with_the_versions_it_asks_for() {
    let tmp = tempfile::tempdir().expect("temporary folder");
    let dir = tmp.path();
    let vendor = dir.join("vendor");
    let lib = dir.join("site/torch/lib");
    std::fs::create_dir_all(&vendor).unwrap();
    std::fs::create_dir_all(&lib).unwrap();
    // Two libraries the "wheel" links and nobody has here, each with versioned symbols as
    // NVIDIA's: the runtime (whose cudaMalloc the simulated runtime defines) and another
    // vendor's, with a function and a table (an object: resolved when the wheel loads).
    std::fs::write(
        vendor.join("rt.c"),
        "int cudaMalloc(void **p, unsigned long n) { return 7; }\nint cudaFancy(void) { return 7; }\n",
    )
    .unwrap();
    std::fs::write(vendor.join("rt.map"), "libcudart.so.13 { global: *; };\n").unwrap();
    std::fs::write(
        vendor.join("v.c"),
        "int vendorCall(void) { return 7; }\nint vendorNew(void) { return 7; }\nlong vendorTable[4] = {7};\n",
    )
    .unwrap();
    // Two versions, as a library that added a function later has.
    std::fs::write(
        vendor.join("v.map"),
        "VENDOR_7 { global: vendorCall; vendorTable; local: *; };\nVENDOR_7.1 { global: vendorNew; } VENDOR_7;\n",
    )
    .unwrap();
    std::fs::write(
        vendor.join("consumer.c"),
        "int cudaMalloc(void **p, unsigned long n); int cudaFancy(void); int vendorCall(void);\n\
         int vendorNew(void);\n\
         extern long vendorTable[4];\n\
         int use_malloc(void) { void *p; return cudaMalloc(&p, 1); }\n\
         int use_fancy(void) { return cudaFancy(); }\n\
         int use_vendor(void) { return vendorCall(); }\n\
         int use_new(void) { return vendorNew(); }\n\
         long *use_table(void) { return vendorTable; }\n",
    )
    .unwrap();
    let (shared, pic) = ("-shared", "-fPIC");
    cc(
        &vendor,
        &[
            shared,
            pic,
            "-Wl,-soname,libcudart.so.13",
            "-Wl,--version-script=rt.map",
            "-o",
            "libcudart.so.13",
            "rt.c",
        ],
    );
    cc(
        &vendor,
        &[
            shared,
            pic,
            "-Wl,-soname,libvendor.so.7",
            "-Wl,--version-script=v.map",
            "-o",
            "libvendor.so.7",
            "v.c",
        ],
    );
    let consumer = lib.join("libconsumer.so");
    cc(
        &vendor,
        &[
            shared,
            pic,
            "-o",
            consumer.to_str().unwrap(),
            "consumer.c",
            "-L.",
            "-l:libcudart.so.13",
            "-l:libvendor.so.7",
        ],
    );
    // The simulated runtime defines cudaMalloc; the stand-ins must not define it again.
    std::fs::write(dir.join("simulated_defined"), "cudaMalloc\n").unwrap();
    let stubs = dir.join("stubs");
    let out = Command::new("python3")
        .arg(root().join("scripts/real-torch/stubs.py"))
        .arg(dir.join("site"))
        .arg(dir.join("simulated_defined"))
        .arg(&stubs)
        .output()
        .expect("python3 scripts/real-torch/stubs.py");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        said.lines().collect::<Vec<_>>(),
        [
            "libcudart.so.13: 1 symbols, version libcudart.so.13",
            "libvendor.so.7: 3 symbols, version VENDOR_7, VENDOR_7.1"
        ]
    );
    let runtime = std::fs::read_to_string(stubs.join("libcudart.so.13.c")).unwrap();
    assert!(
        runtime.contains("long cudaFancy(void) { named(\"cudaFancy\"); return 0; }"),
        "{runtime}"
    );
    assert!(!runtime.contains("cudaMalloc"), "{runtime}");
    let other = std::fs::read_to_string(stubs.join("libvendor.so.7.c")).unwrap();
    assert!(
        other.contains("return 999;") && other.contains("char vendorTable[4096];"),
        "{other}"
    );

    // Built as the setup script builds them, the wheel loads on them: the simulated runtime's
    // cudaMalloc answers, the generated ones give their fixed results, the table is there.
    std::fs::write(
        stubs.join("simulated.c"),
        "int cudaMalloc(void **p, unsigned long n) { return 42; }\n",
    )
    .unwrap();
    cc(
        &stubs,
        &[
            shared,
            pic,
            "-Wl,-soname,libcudart.so.13",
            "-Wl,--version-script=libcudart.so.13.map",
            "-o",
            "libcudart.so.13",
            "libcudart.so.13.c",
            "simulated.c",
        ],
    );
    cc(
        &stubs,
        &[
            shared,
            pic,
            "-Wl,-soname,libvendor.so.7",
            "-Wl,--version-script=libvendor.so.7.map",
            "-o",
            "libvendor.so.7",
            "libvendor.so.7.c",
        ],
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import ctypes, sys\n\
             lib = ctypes.CDLL(sys.argv[1])\n\
             lib.use_table.restype = ctypes.c_void_p\n\
             print(lib.use_malloc(), lib.use_fancy(), lib.use_vendor(), lib.use_new(), lib.use_table() is not None)",
        )
        .arg(&consumer)
        .env("LD_LIBRARY_PATH", &stubs)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "42 0 999 999 True"
    );
}
