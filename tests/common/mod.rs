//! Shared support for integration tests that run CUDA programs on the fake CUDA driver
//! (`tests/fake_cuda`, built by `scripts/build-fake-cuda.sh`). Include it with `mod common;`.
//!
//! - [`fake_cuda`] builds the fake driver, runtime and test programs once per test process.
//! - [`run_program`] runs one of them, with or without `libmemsnap.so` preloaded, in a fresh
//!   `MEMSNAP_FOLDER`, and returns its outputs.
//! - [`truth`] and [`results`] parse the programs' `truth ...` and `result k=v` lines;
//!   [`snapshot_files`] and [`python_load_json`] look at what was written.
//!
//! Each test binary uses a subset of these items.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long a test program may run before it is killed and the test fails.
pub const PROGRAM_TIMEOUT: Duration = Duration::from_secs(60);

/// The fake CUDA build directory (`lib/` and `bin/`), built on first use. Safe when several
/// test binaries call it at once: the script serializes on a lock file and renames finished
/// files into place; an input stamp makes later calls cheap.
pub fn fake_cuda() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-cuda");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-fake-cuda.sh");
        let output = Command::new("bash")
            .arg(&script)
            .arg(&out)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            output.status.success(),
            "{} failed ({}):\n{}{}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        out
    })
}

/// `OUTDIR/lib`, the directory holding the fake libcuda.so.1 and libcudart.so.13.
pub fn fake_lib_dir() -> PathBuf {
    fake_cuda().join("lib")
}

/// `OUTDIR/bin/<program>`.
pub fn program_path(program: &str) -> PathBuf {
    fake_cuda().join("bin").join(program)
}

/// `target/<profile>/NAME`: the workspace's build outputs sit one folder above the test
/// executable (`target/<profile>/deps/`). `cargo build --workspace` builds them
/// (scripts/test.sh does, before `cargo test`).
pub fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable has a path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executables live in target/<profile>/deps")
        .join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace` first (scripts/test.sh does)",
        path.display()
    );
    path
}

/// Where [`skip`] leaves its records: `target/tmp/test-skips/`, emptied by scripts/test.sh
/// before the tests run and read by scripts/test-tally.py after.
pub fn skip_records() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("test-skips")
}

/// Marks the calling test as not run because `reason` (a tool it needs is missing); the test
/// returns right after. `cargo test` can only say "ok" for it, so the mark is a file named
/// `BINARY::TEST` holding the reason, and scripts/test.sh's tally counts the test as skipped
/// with that reason, never as passed.
pub fn skip(reason: &str) {
    let exe = std::env::current_exe().expect("the test executable has a path");
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // `cli-0123456789abcdef`: the binary's name without cargo's hash.
    let binary = match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => stem,
    };
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let dir = skip_records();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join(format!("{binary}::{test}")), reason);
    eprintln!("skipped: {reason}");
}

/// Builds the C file `src` into the shared library `out` with `$CC` (else `cc`), `flags` and
/// `-fPIC -shared`, linked against the simulated runtime (`-lcudart`); the test fails if it
/// does not build.
pub fn build_cuda_library(src: &Path, out: &Path, flags: &[&str]) {
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(flags)
        .args(["-fPIC", "-shared", "-o"])
        .arg(out)
        .arg(src)
        .arg(format!("-L{}", fake_lib_dir().display()))
        .arg("-lcudart")
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed on {}", src.display());
}

/// The `libmemsnap.so` of this build.
pub fn preload_lib() -> PathBuf {
    built("libmemsnap.so")
}

/// The `memsnap` binary of this build.
pub fn memsnap_bin() -> PathBuf {
    built("memsnap")
}

/// What a program run produced. `dir` is the run's temporary `MEMSNAP_FOLDER` (kept alive as
/// long as the `Run` is, even when the caller passed its own `MEMSNAP_FOLDER`).
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub dir: tempfile::TempDir,
}

impl Run {
    /// Panics with both outputs unless the program exited with status 0.
    pub fn assert_success(&self) -> &Self {
        assert!(
            self.status.success(),
            "program failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }

    pub fn results(&self) -> HashMap<String, String> {
        results(&self.stdout)
    }

    pub fn truth(&self) -> Vec<HashMap<String, String>> {
        truth(&self.stdout)
    }

    /// The `truth device=<device> ...` line as a map; panics when absent.
    pub fn truth_device(&self, device: u32) -> HashMap<String, String> {
        truth_device(&self.stdout, device)
    }
}

/// Runs `OUTDIR/bin/<program>` (`*.py` programs with the interpreter `python`) with
/// `LD_LIBRARY_PATH=OUTDIR/lib`, `FAKE_CUDART=OUTDIR/lib/libcudart.so.13`, a fresh temporary
/// `MEMSNAP_FOLDER` (also its working directory) and, when `preload`, `LD_PRELOAD=libmemsnap.so`. Inherited `MEMSNAP_*`,
/// `FAKE_CUDA_*` and `LD_PRELOAD` variables are removed first; `env` is applied last and wins.
/// Kills the program and panics after [`PROGRAM_TIMEOUT`].
pub fn run_program(program: &str, args: &[&str], env: &[(&str, &str)], preload: bool) -> Run {
    let python = program.ends_with(".py").then_some(Path::new("python3"));
    run_program_under(python, program, args, env, preload)
}

/// [`run_program`], a `*.py` program run by the interpreter `python` (a program that is
/// none by itself when `None`).
pub fn run_program_under(
    python: Option<&Path>,
    program: &str,
    args: &[&str],
    env: &[(&str, &str)],
    preload: bool,
) -> Run {
    let dir = tempfile::Builder::new()
        .prefix("memsnap-run-")
        .tempdir()
        .expect("create a temporary MEMSNAP_FOLDER");
    let path = program_path(program);
    assert!(path.exists(), "no test program {}", path.display());
    let mut cmd = match python {
        Some(python) => {
            let mut c = Command::new(python);
            c.arg(&path);
            c
        }
        None => Command::new(&path),
    };
    cmd.args(args);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_") || key.starts_with("FAKE_CUDA") || key == "LD_PRELOAD" {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.env("LD_LIBRARY_PATH", fake_lib_dir())
        .env("FAKE_CUDART", fake_lib_dir().join("libcudart.so.13"))
        .env("MEMSNAP_FOLDER", dir.path())
        .env("PYTHONDONTWRITEBYTECODE", "1");
    if preload {
        cmd.env("LD_PRELOAD", preload_lib());
    }
    for (key, value) in env {
        cmd.env(key, value);
    }
    // The run's folder is also its working directory: a setting memsnap refuses falls back
    // to `.`, which must never be the repository.
    cmd.current_dir(dir.path());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());

    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", path.display()));
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the test program") {
            break status;
        }
        if started.elapsed() > PROGRAM_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{program} {args:?} still running after {PROGRAM_TIMEOUT:?}: killed\n\
                 --- stdout\n{}\n--- stderr\n{}",
                stdout.join().unwrap_or_default(),
                stderr.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Run {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
        dir,
    }
}

/// Reads a pipe to its end on its own thread, so a chatty program never blocks on a full pipe.
fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn parse_pairs<'a>(fields: impl Iterator<Item = &'a str>) -> HashMap<String, String> {
    fields
        .filter_map(|field| field.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Every `truth k=v k=v ...` line, in order, as a map.
pub fn truth(stdout: &str) -> Vec<HashMap<String, String>> {
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("truth "))
        .map(|rest| parse_pairs(rest.split_whitespace()))
        .collect()
}

/// The `truth device=<device> ...` line; panics when absent.
pub fn truth_device(stdout: &str, device: u32) -> HashMap<String, String> {
    let wanted = device.to_string();
    truth(stdout)
        .into_iter()
        .find(|t| t.get("device") == Some(&wanted))
        .unwrap_or_else(|| panic!("no truth line for device {device} in:\n{stdout}"))
}

/// All `result key=value` lines (the value is the rest of the line); later lines win.
pub fn results(stdout: &str) -> HashMap<String, String> {
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("result "))
        .filter_map(|rest| rest.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
        .collect()
}

/// A numeric field of a parsed line; panics with the key when absent or not a number.
pub fn num(map: &HashMap<String, String>, key: &str) -> u64 {
    let value = map
        .get(key)
        .unwrap_or_else(|| panic!("no `{key}` in {map:?}"));
    value
        .parse()
        .unwrap_or_else(|e| panic!("`{key}={value}` is not a number: {e}"))
}

/// The `{label}` of a default snapshot name (`...-{label}-{seq}.pickle`: the reason, a
/// dump's tag, or `step<N>`), read from the right so a program called "oom" or "signal"
/// does not confuse it.
pub fn label_of(path: &Path) -> Option<String> {
    let name = path.file_name()?.to_string_lossy().into_owned();
    name.rsplit('-').nth(1).map(str::to_string)
}

/// The labels of the files a run wrote (`step5`, `exit`, ...), in order of their sequence
/// numbers, and the exit file's `memsnap` metadata.
pub fn written(dir: &Path) -> (Vec<String>, serde_json::Value) {
    let mut files: Vec<(u64, PathBuf)> = snapshot_files(dir)
        .into_iter()
        .map(|path| {
            let seq = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.rsplit('-').next())
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no sequence number in {}", path.display()));
            (seq, path)
        })
        .collect();
    files.sort();
    let labels: Vec<String> = files
        .iter()
        .map(|(_, p)| label_of(p).expect("a default name"))
        .collect();
    let exit = &files.last().expect("an exit snapshot").1;
    assert_eq!(
        labels.last().map(String::as_str),
        Some("exit"),
        "{labels:?}"
    );
    (labels, python_load_json(exit)["memsnap"].clone())
}

/// What [`written`] gives for 20 steps with `MEMSNAP_EVERY=5`.
pub fn steps_every_5() -> Vec<String> {
    ["step5", "step10", "step15", "step20", "exit"]
        .map(String::from)
        .to_vec()
}

/// A run of 20 optimizer steps with `MEMSNAP_EVERY=5` and nothing else marking steps: the
/// labels and the exit file's metadata [`written`] gave (`what`: the run, for messages).
pub fn assert_optimizer_steps(labels: &[String], meta: &serde_json::Value, what: &str) {
    assert_eq!(labels, steps_every_5(), "{what}");
    assert_eq!(meta["step"], 20, "{what}");
    assert_eq!(meta["step_source"], "optimizer", "{what}");
    assert_eq!(meta["optimizer_step_hook"], "attached", "{what}");
    assert_eq!(meta["optimizer_hook_python_errors"], 0, "{what}");
    assert_eq!(meta["dropped_events"], 0, "{what}");
}

/// The regular files directly inside `dir`, sorted by path.
pub fn snapshot_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .filter(|path| path.is_file() && unsent_list(path).is_none())
        .collect();
    files.sort();
    files
}

/// For the upload helper's list of files it could not send (`memsnap-unsent-HOST-PID.txt`,
/// beside the snapshots): the pid in its name.
pub fn unsent_list(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("memsnap-unsent-")?.strip_suffix(".txt")?;
    rest.rsplit_once('-')?.1.parse().ok()
}

// The collector off (loading makes millions of containers, none of them cyclic) and the JSON
// written in one piece: `json.dump` to a pipe wrote it in thousands of small pieces, and took
// 9 s for a 5 MB snapshot (60 MB of JSON) where this takes 2 s, the same bytes.
const PICKLE_TO_JSON: &str = r#"
import gc, json, math, pickle, sys

gc.disable()

def plain(o):
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain(v) for v in o]
    if isinstance(o, (bytes, bytearray)):
        return o.decode("utf-8", "replace")
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return o

with open(sys.argv[1], "rb") as f:
    data = pickle.load(f)
sys.stdout.write(json.dumps(plain(data)))
"#;

/// Runs the repository's Python script `script` (a path from the repository root) on
/// `file`; panics with its output unless it succeeds, else returns its stdout.
pub fn python_script(script: &str, file: &Path) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new("python3")
        .arg(&path)
        .arg(file)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{script} {}:\n{}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `memsnap ARGS...` (with `--json` among them), parsed; the test fails when it fails.
pub fn memsnap_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(memsnap_bin())
        .args(args)
        .output()
        .expect("run memsnap");
    assert!(
        out.status.success(),
        "memsnap {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("memsnap --json prints JSON")
}

/// Loads a pickle with Python's own `pickle` module and returns it as JSON: ints stay ints,
/// tuples become lists, dict keys become strings. Panics when Python cannot read the file,
/// which is itself a format check.
pub fn python_load_json(path: &Path) -> serde_json::Value {
    let output = Command::new("python3")
        .arg("-c")
        .arg(PICKLE_TO_JSON)
        .arg(path)
        .output()
        .expect("run python3");
    assert!(
        output.status.success(),
        "python3 cannot load {}:\n{}",
        path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("python's JSON for {} does not parse: {e}", path.display()))
}

/// The CSV as maps, one per row.
pub fn csv(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    lines
        .map(|l| {
            header
                .iter()
                .map(|h| h.to_string())
                .zip(l.split(',').map(str::to_string))
                .collect()
        })
        .collect()
}

/// What tests/programs/py_callbacks.py must print, wherever the package comes from.
pub fn assert_callback_results(r: &HashMap<String, String>) {
    assert!(
        r["missing_lightning"].starts_with("memsnap.lightning needs PyTorch Lightning"),
        "{r:?}"
    );
    assert!(
        r["missing_transformers"]
            .starts_with("memsnap.transformers needs Hugging Face transformers"),
        "{r:?}"
    );
    assert_eq!(
        r["broken_lightning"],
        "ModuleNotFoundError:lightning_utilities_missing"
    );
    assert_eq!(
        r["broken_transformers"],
        "ModuleNotFoundError:tokenizers_missing"
    );
    assert_eq!(r["fallback_base"], "pytorch_lightning.Callback");
    assert_eq!(r["lightning_pulls_transformers"], "False");
    assert_eq!(r["transformers_pulls_lightning"], "False");
    assert_eq!(r["lightning_base"], "lightning.pytorch.Callback");
    assert_eq!(r["transformers_base"], "transformers.TrainerCallback");
}

/// `KEY=VALUE` lines (the output of `env`) as a map.
pub fn env_lines(stdout: &[u8]) -> HashMap<String, String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// pyenv's root: `$PYENV_ROOT`, else `$HOME/.pyenv`.
pub fn pyenv_root() -> PathBuf {
    std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".pyenv")
        })
}

/// CPython interpreters to test: pyenv's 3.10–3.14 and `MEMSNAP_TEST_PYTHONS`, else
/// `python3` if it is one of the supported versions.
pub fn interpreters() -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = ["3.10", "3.11", "3.12", "3.13", "3.14"]
        .into_iter()
        .filter_map(|minor| Some((minor.to_string(), pyenv_python(minor)?)))
        .collect();
    if let Some(extra) = std::env::var_os("MEMSNAP_TEST_PYTHONS") {
        for py in std::env::split_paths(&extra).filter(|p| !p.as_os_str().is_empty()) {
            found.push((py.display().to_string(), py));
        }
    }
    if found.is_empty() {
        found.push(("python3".to_string(), PathBuf::from("python3")));
    }
    found
}

/// pyenv's newest CPython `minor` (`"3.12"`), if installed.
pub fn pyenv_python(minor: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir(pyenv_root().join("versions")).ok()?;
    let mut versions: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.strip_prefix(minor)
                    .is_some_and(|rest| rest.starts_with('.'))
            })
        })
        .collect();
    // By patch number: 3.12.10 after 3.12.9.
    versions.sort_by_key(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.rsplit('.').next())
            .and_then(|patch| patch.parse::<u32>().ok())
    });
    versions
        .into_iter()
        .rev()
        .map(|v| v.join("bin/python3"))
        .find(|py| py.is_file())
}

/// A CPython `minor` (`"3.12"`) to run programs with: pyenv's newest, else one named in
/// `MEMSNAP_TEST_PYTHONS` (paths separated by `:`) of that version, else `python3.X` on
/// `PATH` (not a pyenv shim, which may stand for no installed version).
pub fn python(minor: &str) -> Option<PathBuf> {
    if let Some(py) = pyenv_python(minor) {
        return Some(py);
    }
    let listed = std::env::var_os("MEMSNAP_TEST_PYTHONS").unwrap_or_default();
    let on_path = std::env::var_os("PATH").unwrap_or_default();
    let named = std::env::split_paths(&listed).filter(|p| !p.as_os_str().is_empty());
    let found = std::env::split_paths(&on_path)
        .filter(|dir| !dir.ends_with("shims"))
        .map(|dir| dir.join(format!("python{minor}")))
        .filter(|p| p.is_file());
    named.chain(found).find(|py| {
        Command::new(py)
            .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
            .output()
            .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == minor)
    })
}
