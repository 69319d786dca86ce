//! The wheel as a GPU user gets it: target/wheels/memsnap-*.whl (built by
//! scripts/build-wheel.sh) installed with pip into a fresh virtual environment, then used
//! from a folder outside the clone, on the simulated CUDA driver: the installed `memsnap
//! run`, `python -m memsnap run`, the Python API and the framework callbacks.
//!
//! #[ignore]d for plain `cargo test`, which has no wheel; scripts/test.sh builds the wheel and
//! runs these with `--ignored`.

mod common;

use common::{assert_callback_results, csv, env_lines, label_of, num, python_load_json, results};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

const NEEDS_WHEEL: &str =
    "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)";

/// A virtual environment with the wheel installed, shared by the tests of this file. It
/// lives in a static, which is never dropped: so it is made in target/tmp (replaced by the
/// next run), never in /tmp, where each run would leave ~90 MB behind.
struct Installed {
    wheel: PathBuf,
    venv: PathBuf,
}

impl Installed {
    fn bin(&self, name: &str) -> PathBuf {
        self.venv.join("bin").join(name)
    }

    /// The installed package's folder, from the environment's own Python.
    fn package_dir(&self) -> PathBuf {
        let out = Command::new(self.bin("python"))
            .args([
                "-c",
                "import sysconfig; print(sysconfig.get_path('platlib'))",
            ])
            .output()
            .expect("run the environment's python");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            .join("memsnap")
            .canonicalize()
            .expect("the memsnap package is installed")
    }
}

fn installed() -> &'static Installed {
    static INSTALLED: OnceLock<Installed> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let wheels = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/wheels");
        let found: Vec<PathBuf> = std::fs::read_dir(&wheels)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let found: Vec<PathBuf> = found
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "whl"))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "expected one wheel in {} ({NEEDS_WHEEL}): {found:?}",
            wheels.display()
        );
        let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wheel-venv");
        if venv.exists() {
            std::fs::remove_dir_all(&venv).expect("remove the previous run's environment");
        }
        std::fs::create_dir_all(venv.parent().unwrap()).unwrap();
        check(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            "python3 -m venv",
        );
        check(
            Command::new(venv.join("bin/python"))
                .args(["-m", "pip", "install", "--quiet", "--no-index", "--no-deps"])
                .arg("--disable-pip-version-check")
                .arg(&found[0]),
            "pip install the wheel",
        );
        Installed {
            wheel: found[0].clone(),
            venv: venv.canonicalize().unwrap(),
        }
    })
}

fn check(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A folder outside the clone to run in, with the Python test programs copied into it.
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("memsnap-wheel-run-")
        .tempdir()
        .unwrap();
    for program in ["py_steps.py", "py_callbacks.py"] {
        std::fs::copy(common::program_path(program), dir.path().join(program)).unwrap();
    }
    dir
}

/// `program args...` in `cwd` with the simulated driver on the library path and nothing of
/// the clone or of the calling environment's memsnap settings in the environment.
fn run_in(cwd: &Path, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args).current_dir(cwd);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("MEMSNAP_")
            || key.starts_with("FAKE_CUDA")
            || [
                "LD_PRELOAD",
                "PYTHONPATH",
                "VIRTUAL_ENV",
                "CARGO_TARGET_DIR",
            ]
            .contains(&&*key)
        {
            cmd.env_remove(key.as_ref());
        }
    }
    cmd.env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env(
            "FAKE_CUDART",
            common::fake_lib_dir().join("libcudart.so.13"),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    check(
        cmd.stdin(Stdio::null()),
        &format!("{} {args:?}", program.display()),
    )
}

/// The demo's files: a `step` snapshot at steps 2 and 4 (`--every 2`, named `step2` and
/// `step4` after the program's step) and one at exit (step 5), each accepted by the
/// installed `memsnap check`.
fn assert_demo_snapshots(folder: &Path) {
    let files = common::snapshot_files(folder);
    let mut found: Vec<(String, u64)> = files
        .iter()
        .map(|f| {
            let snap = python_load_json(f);
            (
                label_of(f).unwrap(),
                snap["memsnap"]["step"].as_u64().unwrap(),
            )
        })
        .collect();
    found.sort();
    assert_eq!(
        found,
        [("exit".into(), 5), ("step2".into(), 2), ("step4".into(), 4)],
        "{files:?}"
    );
    let mut cmd = Command::new(installed().bin("memsnap"));
    cmd.arg("check").args(&files);
    check(&mut cmd, "the installed memsnap check");
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
#[ignore = "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)"]
fn the_wheel_is_for_any_python3_and_holds_library_cli_and_package() {
    let wheel = &installed().wheel;
    let name = wheel.file_name().unwrap().to_string_lossy();
    let prefix = format!(
        "memsnap-{}-py3-none-manylinux_2_",
        env!("CARGO_PKG_VERSION")
    );
    assert!(
        name.starts_with(&prefix) && name.ends_with("_x86_64.whl"),
        "{name}"
    );
    let listing = check(
        Command::new(installed().bin("python"))
            .args(["-m", "zipfile", "-l"])
            .arg(wheel),
        "list the wheel",
    );
    let listing = String::from_utf8_lossy(&listing.stdout);
    let version = env!("CARGO_PKG_VERSION");
    for file in [
        "memsnap/libmemsnap.so".to_string(),
        "memsnap/__init__.py".to_string(),
        "memsnap/__main__.py".to_string(),
        "memsnap/_locate.py".to_string(),
        "memsnap/lightning.py".to_string(),
        "memsnap/transformers.py".to_string(),
        format!("memsnap-{version}.data/scripts/memsnap"),
    ] {
        assert!(
            listing.lines().any(|l| l.starts_with(&format!("{file} "))),
            "no {file} in the wheel:\n{listing}"
        );
    }
}

/// Runs the demo with `launcher... run --folder snaps --every 2 -- demo` in a fresh folder
/// outside the clone and checks what it wrote; returns the folder.
fn record_the_demo(launcher: &[&str]) -> tempfile::TempDir {
    let dir = workdir();
    let demo = common::program_path("demo");
    let mut args = launcher[1..].to_vec();
    args.extend(["run", "--folder", "snaps", "--every", "2", "--"]);
    args.push(demo.to_str().unwrap());
    let o = run_in(dir.path(), Path::new(launcher[0]), &args, &[]);
    assert!(
        stderr(&o).contains("memsnap: the run wrote 3 snapshots:"),
        "{}",
        stderr(&o)
    );
    assert_demo_snapshots(&dir.path().join("snaps"));
    dir
}

#[test]
#[ignore = "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)"]
fn installed_memsnap_run_records_the_demo() {
    let memsnap = installed().bin("memsnap");
    let dir = record_the_demo(&[memsnap.to_str().unwrap()]);

    // The library it preloads is the installed package's; the package goes on PYTHONPATH
    // as a cargo build's does (a folder holding only it), so that a Python other than the
    // environment's imports it too.
    let o = run_in(dir.path(), &memsnap, &["run", "--", "env"], &[]);
    let env = env_lines(&o.stdout);
    let package = installed().package_dir();
    assert_eq!(Path::new(&env["LD_PRELOAD"]), package.join("libmemsnap.so"));
    let entry = Path::new(&env["PYTHONPATH"]);
    assert_eq!(std::fs::read_link(entry.join("memsnap")).unwrap(), package);
    let o = run_in(
        dir.path(),
        &memsnap,
        &[
            "run",
            "--no-at-exit",
            "--",
            "python3",
            "-c",
            "import memsnap, sys; print(sys.executable); print(memsnap.library_path())",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut lines = stdout.lines();
    let python = lines.next().unwrap_or_default();
    assert!(
        !Path::new(python).starts_with(&installed().venv),
        "not the venv's: {python}"
    );
    assert_eq!(
        lines.next().map(PathBuf::from),
        Some(package.join("libmemsnap.so"))
    );
}

#[test]
#[ignore = "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)"]
fn python_m_memsnap_run_records_the_demo() {
    let python = installed().bin("python");
    record_the_demo(&[python.to_str().unwrap(), "-m", "memsnap"]);
}

/// `python -m memsnap run OPTIONS --no-at-exit -- python PROGRAM` with the environment's
/// Python, in `dir`; the program's `result` lines.
fn run_python_program(dir: &Path, options: &[&str], program: &str) -> HashMap<String, String> {
    let python = installed().bin("python");
    let mut args = vec!["-m", "memsnap", "run"];
    args.extend(options);
    args.extend(["--no-at-exit", "--", python.to_str().unwrap(), program]);
    results(&String::from_utf8_lossy(
        &run_in(dir, &python, &args, &[]).stdout,
    ))
}

#[test]
#[ignore = "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)"]
fn the_installed_python_api_steps_dumps_and_names_its_library() {
    let dir = workdir();
    let python = installed().bin("python");
    let o = run_in(
        dir.path(),
        &python,
        &[
            "-c",
            "import memsnap, sys; print(memsnap.library_path()); \
             print(sorted(m for m in sys.modules if m.split('.')[0] in \
             ('torch', 'lightning', 'transformers', 'numpy')))",
        ],
        &[],
    );
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let package = installed().package_dir();
    assert_eq!(
        stdout,
        format!("{}\n[]\n", package.join("libmemsnap.so").display())
    );

    let r = run_python_program(
        dir.path(),
        &["--folder", "snaps", "--filename", "{tag}-{seq}.pickle"],
        "py_steps.py",
    );
    // Imported through the PYTHONPATH entry `memsnap run` adds: a link to that package.
    assert_eq!(
        Path::new(&r["module"]).canonicalize().unwrap(),
        package.join("__init__.py")
    );
    assert_eq!(r["frameworks"], "");
    assert_eq!(r["step_returns"], "True,True,True");
    assert_eq!(r["active"], "True");
    let snaps = dir.path().canonicalize().unwrap().join("snaps");
    assert_eq!(Path::new(&r["dump_return"]), snaps.join("mid-1.pickle"));
    assert_eq!(num(&r, "thread_steps"), 32);
    let snap = python_load_json(&snaps.join("mid-1.pickle"));
    assert_eq!(snap["memsnap"]["tag"], "mid");
    assert_eq!(snap["memsnap"]["step"], 3);
}

#[test]
#[ignore = "needs target/wheels/*.whl: scripts/build-wheel.sh (scripts/test.sh runs both)"]
fn the_installed_callbacks_mark_one_step_per_batch() {
    let dir = workdir();
    let r = run_python_program(dir.path(), &["--stats", "stats.csv"], "py_callbacks.py");
    assert_callback_results(&r);
    let steps: Vec<u64> = csv(&dir.path().join("stats.csv"))
        .iter()
        .map(|row| num(row, "step"))
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6, 6]);
}
