//! `memsnap run [options] -- CMD ...`: runs a command with `libmemsnap.so` preloaded.
//!
//! Cold, no unsafe. Finds the library that came with the `memsnap` binary (a cargo build, a
//! prefix install or a pip installation), prepends it to `LD_PRELOAD`, turns options into
//! `MEMSNAP_*` variables (checked with the library's own parser before anything runs), runs
//! the command, exits with its status (128+N when a signal killed it, as a shell does), then
//! lists the snapshots the run wrote.
//!
//! Everything reaches the program through the environment, so launchers (`torchrun`,
//! `srun`, `mpirun`) pass it on to every rank, and each rank names its own files.
//!
//! Signals: the CLI has no unsafe code, so it installs no signal handler. A terminal's
//! Ctrl-C reaches the whole foreground process group: the command gets it directly (and
//! writes its exit snapshot if it exits through `exit`), and `memsnap run` ends at once
//! without listing the files.

use anyhow::{Context as _, Result, bail};
use memsnap_format::config::{Config, var};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::SystemTime;

/// Options of `memsnap run`. Each sets the `MEMSNAP_*` variable named in its help; values
/// are checked by the same parser the library uses.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  memsnap run -- python train.py\n  memsnap run --folder snaps --skip 10 --interval 3 -- torchrun --nproc-per-node 8 train.py\n  memsnap run --stats mem.csv --every 100 -- ./app\n\nThe command gets LD_PRELOAD=libmemsnap.so and the MEMSNAP_* variables; options override variables already set."
)]
pub struct RunArgs {
    /// Folder for snapshots (MEMSNAP_FOLDER; placeholders like {rank} allowed)
    #[arg(long, value_name = "DIR")]
    pub folder: Option<String>,
    /// File name template (MEMSNAP_FILENAME), e.g. 'rank{rank}.{step}.pickle'
    #[arg(long, value_name = "TEMPLATE")]
    pub filename: Option<String>,
    /// History entries kept per device (MEMSNAP_MAX_ENTRIES)
    #[arg(long, value_name = "N")]
    pub max_entries: Option<String>,
    /// Stacks to record: none, python, native, all (MEMSNAP_STACKS)
    #[arg(long, value_name = "KIND")]
    pub stacks: Option<String>,
    /// Stacks for frees: alloc or all (MEMSNAP_CONTEXT)
    #[arg(long, value_name = "KIND")]
    pub context: Option<String>,
    /// Signal that asks for a snapshot: USR1, USR2, RTMIN+N, or none (MEMSNAP_SIGNAL)
    #[arg(long, value_name = "SIG")]
    pub signal: Option<String>,
    /// Steps before the recording window opens (MEMSNAP_SKIP, default 1)
    #[arg(long, value_name = "N")]
    pub skip: Option<String>,
    /// Steps in the recording window; one snapshot when it closes (MEMSNAP_INTERVAL)
    #[arg(long, value_name = "N")]
    pub interval: Option<String>,
    /// A snapshot every N steps (MEMSNAP_EVERY)
    #[arg(long, value_name = "N")]
    pub every: Option<String>,
    /// Where steps come from: auto (PyTorch's optimizer steps until the program marks its
    /// own), program, off (MEMSNAP_STEPS)
    #[arg(long, value_name = "FROM")]
    pub steps: Option<String>,
    /// A snapshot every duration from 1s to 30d, e.g. 30s, 5m (MEMSNAP_PERIOD)
    #[arg(long, value_name = "DURATION")]
    pub period: Option<String>,
    /// CSV file for per-step memory figures (MEMSNAP_STATS)
    #[arg(long, value_name = "PATH")]
    pub stats: Option<String>,
    /// Also copy each snapshot to this URL template: file:///path, s3://bucket/key,
    /// gs://bucket/key or az://container/key, e.g.
    /// 's3://bucket/snaps/r{rank}/{reason}-{seq}.pickle' (MEMSNAP_REMOTE)
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// No snapshot at exit (MEMSNAP_AT_EXIT=0)
    #[arg(long)]
    pub no_at_exit: bool,
    /// No summary line from each process at exit (MEMSNAP_QUIET=1). The default under
    /// `memsnap run`, which lists the files itself; `MEMSNAP_QUIET=0` keeps the line
    #[arg(long)]
    pub quiet: bool,
    /// Replace files with the same name instead of numbering them (MEMSNAP_OVERWRITE=1)
    #[arg(long)]
    pub overwrite: bool,
    /// Switch PyTorch, JAX and TensorFlow to allocate each tensor from CUDA (where unset)
    #[arg(long)]
    pub tensors: bool,
    /// The libmemsnap.so to preload (default: beside this binary, ../lib/, or the memsnap
    /// Python package pip installed with this binary)
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    /// The command and its arguments
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Framework settings `--tensors` makes, each only when the user has not set it.
pub const TENSOR_SETTINGS: &[(&str, &str)] = &[
    ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync"),
    ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform"),
    ("TF_GPU_ALLOCATOR", "cuda_malloc_async"),
];

/// Set by `python -m memsnap run` (python/memsnap/__main__.py): the library of the package
/// that started this command, used when `--lib` is not given. Not passed on to the command.
pub const PACKAGE_LIB_VAR: &str = "MEMSNAP_RUN_LIB";

pub fn run(args: RunArgs) -> Result<ExitCode> {
    let from_package = std::env::var_os(PACKAGE_LIB_VAR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    if let (None, Some(p)) = (&args.lib, &from_package)
        && !p.is_file()
    {
        bail!("{PACKAGE_LIB_VAR}={}: no such file", p.display());
    }
    let lib = find_library(args.lib.as_deref().or(from_package.as_deref()))?;

    // The variables the options set, in option order.
    let mut set: Vec<(&'static str, String, &'static str)> = Vec::new();
    let mut opt = |name: &'static str, option: &'static str, value: &Option<String>| {
        if let Some(v) = value {
            set.push((name, v.clone(), option));
        }
    };
    opt(var::FOLDER, "--folder", &args.folder);
    opt(var::FILENAME, "--filename", &args.filename);
    opt(var::MAX_ENTRIES, "--max-entries", &args.max_entries);
    opt(var::STACKS, "--stacks", &args.stacks);
    opt(var::CONTEXT, "--context", &args.context);
    opt(var::SIGNAL, "--signal", &args.signal);
    opt(var::SKIP, "--skip", &args.skip);
    opt(var::INTERVAL, "--interval", &args.interval);
    opt(var::EVERY, "--every", &args.every);
    opt(var::STEPS, "--steps", &args.steps);
    opt(var::PERIOD, "--period", &args.period);
    opt(var::STATS, "--stats", &args.stats);
    opt(var::REMOTE, "--remote", &args.remote);
    if args.no_at_exit {
        set.push((var::AT_EXIT, "0".into(), "--no-at-exit"));
    }
    // The launcher lists the files itself at the end, so each process's own exit line
    // would repeat it (once per rank); keep it only if the user asked for it explicitly.
    if args.quiet || std::env::var_os(var::QUIET).is_none() {
        set.push((var::QUIET, "1".into(), "--quiet"));
    }
    if args.overwrite {
        set.push((var::OVERWRITE, "1".into(), "--overwrite"));
    }

    // What the library will see: the inherited MEMSNAP_* variables, overridden by options.
    // Raw values: one that is not UTF-8 is refused by the parser, as the library does.
    let mut seen: HashMap<OsString, OsString> = std::env::vars_os()
        .filter(|(k, _)| k.as_encoded_bytes().starts_with(b"MEMSNAP_"))
        .collect();
    for (name, value, _) in &set {
        seen.insert(name.into(), value.into());
    }
    let (cfg, invalid) = Config::from_os_lookup(|k| seen.get(OsStr::new(k)).cloned());
    if !invalid.is_empty() {
        // One message: each refused value with where it came from and what it accepts.
        let lines: Vec<String> = invalid
            .iter()
            .map(|e| {
                let origin = set
                    .iter()
                    .find(|(name, _, _)| *name == e.name)
                    .map(|(_, _, option)| format!("set by {option}"))
                    .unwrap_or_else(|| "from the environment".to_string());
                format!(
                    "{}={:?} ({origin}): expected {}",
                    e.name, e.value, e.expected
                )
            })
            .collect();
        let command = args.command[0].to_string_lossy();
        match lines.as_slice() {
            [one] => bail!("not running {command}: {one}"),
            _ => bail!(
                "not running {command}: {} invalid values:\n  {}",
                lines.len(),
                lines.join("\n  ")
            ),
        }
    }
    if cfg.disabled {
        eprintln!("memsnap: MEMSNAP_DISABLE is set: the command runs without recording");
    }

    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    for (name, value, _) in &set {
        cmd.env(name, value);
    }
    cmd.env(
        "LD_PRELOAD",
        prepend_preload(&lib, std::env::var_os("LD_PRELOAD")),
    );
    cmd.env_remove(PACKAGE_LIB_VAR);
    // The `memsnap` Python package that came with the library, for `import memsnap` in the
    // command (steps, dumps, callbacks) whichever Python it runs: the same for a cargo build
    // and a pip installation (docs/launcher.md).
    if let Some(package) = python_package(&lib) {
        match package_path_entry(&package) {
            Ok(dir) => {
                cmd.env(
                    "PYTHONPATH",
                    prepend_path(&dir, std::env::var_os("PYTHONPATH")),
                );
            }
            Err(e) => eprintln!(
                "memsnap: the Python package {} is not put on PYTHONPATH ({e:#}); \
                 `import memsnap` works only in the Python that installed it",
                package.display()
            ),
        }
    }
    if args.tensors {
        for (name, value) in TENSOR_SETTINGS {
            match std::env::var_os(name) {
                Some(current) if !current.is_empty() => eprintln!(
                    "memsnap: --tensors: keeping {name}={} (already set)",
                    current.to_string_lossy()
                ),
                _ => {
                    cmd.env(name, value);
                    eprintln!("memsnap: --tensors: set {name}={value}");
                }
            }
        }
    }

    let folder = SnapshotFolder::new(&cfg.folder);
    let before = folder.list();
    let started = SystemTime::now();
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {}", args.command[0].to_string_lossy()))?;

    let written = new_snapshots(&folder, &before, &cfg.filename, started);
    report(&written, &cfg, started);

    if let Some(code) = status.code() {
        return Ok(ExitCode::from(code.clamp(0, 255) as u8));
    }
    let signal = status.signal().unwrap_or(0);
    eprintln!(
        "memsnap: {} was killed by signal {signal}{}",
        args.command[0].to_string_lossy(),
        signal_name(signal)
            .map(|n| format!(" (SIG{n})"))
            .unwrap_or_default()
    );
    Ok(ExitCode::from((128 + signal).clamp(0, 255) as u8))
}

fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        1 => "HUP",
        2 => "INT",
        3 => "QUIT",
        4 => "ILL",
        6 => "ABRT",
        7 => "BUS",
        8 => "FPE",
        9 => "KILL",
        10 => "USR1",
        11 => "SEGV",
        12 => "USR2",
        13 => "PIPE",
        14 => "ALRM",
        15 => "TERM",
        _ => return None,
    })
}

/// `libmemsnap.so`, absolute (so children that change directory still find it): the first
/// of `--lib` (or, without it, [`PACKAGE_LIB_VAR`]);
/// beside the `memsnap` binary; `../lib/` (a `prefix/bin` + `prefix/lib` install); the
/// `memsnap` Python package of the environment the binary was installed into by pip
/// (`../lib/pythonX.Y/site-packages/memsnap/`, also `lib64` and `dist-packages`; the newest
/// when there are several); what `import memsnap` finds in the Python beside the binary
/// (`pip install -e`, whose package stays in the clone). The error names every place.
fn find_library(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("--lib {}: no such file", p.display());
        }
        return std::path::absolute(p).context("cannot make the --lib path absolute");
    }
    let exe = std::env::current_exe().context("cannot find the memsnap binary's path")?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let resolve = |c: &Path| c.canonicalize().unwrap_or_else(|_| c.to_path_buf());
    let beside = dir.join(LIBRARY);
    if beside.is_file() {
        return Ok(resolve(&beside));
    }
    let mut looked = vec![beside.display().to_string()];
    let prefix = dir.parent().unwrap_or(dir);
    let prefix_lib = prefix.join("lib").join(LIBRARY);
    if prefix_lib.is_file() {
        return Ok(resolve(&prefix_lib));
    }
    looked.push(prefix_lib.display().to_string());
    if let Some(found) = newest(python_packages(prefix)) {
        return Ok(resolve(&found));
    }
    looked.push(format!(
        "{}/lib*/python*/{{site,dist}}-packages/memsnap/{LIBRARY}",
        prefix.display()
    ));
    let beside_python = ["python3", "python"]
        .map(|p| dir.join(p))
        .into_iter()
        .find(|p| p.is_file());
    if let Some(python) = beside_python {
        match ask_python(&python) {
            Ok(found) => return Ok(resolve(&found)),
            Err(why) => looked.push(format!("`import memsnap` in {} ({why})", python.display())),
        }
    }
    bail!(
        "cannot find {LIBRARY}; looked in:\n  {}\nPass --lib PATH, install memsnap with pip \
         (the wheel holds the library and this command), or build both in a clone \
         (cargo build --workspace)",
        looked.join("\n  ")
    )
}

const LIBRARY: &str = "libmemsnap.so";

/// `prefix/lib*/python*/{site,dist}-packages/memsnap/libmemsnap.so`, where pip puts the
/// wheel's package (venvs, `--user`, `--prefix`, distributions' system Pythons).
fn python_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for lib in read_dir_names(prefix).filter(|n| n.starts_with("lib")) {
        for python in read_dir_names(&prefix.join(&lib)).filter(|n| n.starts_with("python")) {
            for packages in ["site-packages", "dist-packages"] {
                let candidate = prefix
                    .join(&lib)
                    .join(&python)
                    .join(packages)
                    .join("memsnap")
                    .join(LIBRARY);
                if candidate.is_file() {
                    found.push(candidate);
                }
            }
        }
    }
    found
}

fn read_dir_names(dir: &Path) -> impl Iterator<Item = String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
}

/// The most recently written of `paths`: the last installation, the one that also wrote
/// the `memsnap` binary.
fn newest(paths: Vec<PathBuf>) -> Option<PathBuf> {
    paths.into_iter().max_by_key(|p| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    })
}

/// What `memsnap.library_path()` says in `python` (isolated mode: the working directory
/// and PYTHONPATH cannot shadow the installed package).
fn ask_python(python: &Path) -> std::result::Result<PathBuf, String> {
    let out = Command::new(python)
        .args(["-I", "-c", "import memsnap; print(memsnap.library_path())"])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run it: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(last.unwrap_or("failed").trim().to_string());
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("it named {}, which is not a file", path.display()))
    }
}

/// The `memsnap` Python package folder that goes with `lib`: the folder holding `lib` when
/// it is that package (a wheel installed by pip, `pip install -e`), else, for a cargo build
/// of a clone, the clone's `python/memsnap` (`target/<profile>/../../python`; cargo marks
/// `target/` with a CACHEDIR.TAG).
fn python_package(lib: &Path) -> Option<PathBuf> {
    let beside = lib.parent()?;
    if beside.file_name() == Some(OsStr::new("memsnap")) && beside.join("__init__.py").is_file() {
        return Some(beside.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    let profile = exe.parent()?;
    let dir = profile.join("../../python/memsnap");
    (profile.join("../CACHEDIR.TAG").is_file() && dir.join("__init__.py").is_file())
        .then(|| dir.canonicalize().unwrap_or(dir))
}

/// A `PYTHONPATH` entry that holds `package` (a folder named `memsnap`) and nothing else:
/// a folder in the user's cache (`$XDG_CACHE_HOME`, else `~/.cache`:
/// `memsnap/pythonpath-HASH/`) with one link, `memsnap`, to it, made once per package
/// folder and reused. Not the folder above the package: for a pip installation that is a
/// whole `site-packages`, whose compiled modules another Python must not import.
fn package_path_entry(package: &Path) -> Result<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| Path::new(v).is_absolute())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set")?;
    // FNV-1a of the package's path: one stable folder per installation.
    let hash = package
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    let dir = cache
        .join("memsnap")
        .join(format!("pythonpath-{hash:016x}"));
    let link = dir.join("memsnap");
    if std::fs::read_link(&link).is_ok_and(|target| target == package) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Made beside and renamed into place: runs starting at once (ranks) never see a half.
    let tmp = dir.join(format!(".memsnap.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(package, &tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("cannot create {}", link.display()))?;
    Ok(dir)
}

/// `lib` first, then the existing entries (space- or colon-separated), without other
/// copies of libmemsnap.so.
pub fn prepend_preload(lib: &Path, existing: Option<OsString>) -> OsString {
    let mut out = OsString::from(lib.as_os_str());
    if let Some(existing) = existing {
        let existing = existing.to_string_lossy().into_owned();
        for entry in existing.split([' ', ':']).filter(|e| !e.is_empty()) {
            if Path::new(entry).file_name() == Some(OsStr::new("libmemsnap.so")) {
                continue;
            }
            out.push(":");
            out.push(entry);
        }
    }
    out
}

fn prepend_path(dir: &Path, existing: Option<OsString>) -> OsString {
    let mut out = OsString::from(dir.as_os_str());
    if let Some(existing) = existing.filter(|e| !e.is_empty()) {
        out.push(":");
        out.push(existing);
    }
    out
}

/// Where the run's snapshots land: the folder, or, when it has placeholders (`{rank}`),
/// the deepest fixed folder above them, searched a few levels down.
struct SnapshotFolder {
    root: PathBuf,
    depth: usize,
}

impl SnapshotFolder {
    fn new(folder: &str) -> SnapshotFolder {
        let path = Path::new(folder);
        let mut root = PathBuf::new();
        let mut depth = 0;
        for part in path.components() {
            if depth > 0 || part.as_os_str().to_string_lossy().contains('{') {
                depth += 1;
            } else {
                root.push(part);
            }
        }
        if root.as_os_str().is_empty() {
            root.push(".");
        }
        SnapshotFolder { root, depth }
    }

    /// Every visible regular file with its modification time.
    fn list(&self) -> BTreeMap<PathBuf, SystemTime> {
        let mut out = BTreeMap::new();
        walk(&self.root, self.depth, &mut out);
        out
    }
}

fn walk(dir: &Path, depth: usize, out: &mut BTreeMap<PathBuf, SystemTime>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() && depth > 0 {
            walk(&entry.path(), depth - 1, out);
        } else if meta.is_file() && depth == 0 {
            out.insert(
                entry.path(),
                meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            );
        }
    }
}

/// Files that appeared or changed during the run and whose names fit the template, oldest
/// first.
fn new_snapshots(
    folder: &SnapshotFolder,
    before: &BTreeMap<PathBuf, SystemTime>,
    template: &str,
    started: SystemTime,
) -> Vec<PathBuf> {
    let mut found: Vec<(SystemTime, PathBuf)> = folder
        .list()
        .into_iter()
        .filter(|(path, mtime)| before.get(path).is_none_or(|old| old != mtime))
        .filter(|(path, _)| {
            path.file_name()
                .is_some_and(|n| template_matches(template, &[], &n.to_string_lossy()))
        })
        .map(|(path, mtime)| (mtime, path))
        .collect();
    // Files from before the run were excluded above; `started` only orders ties sensibly.
    found.sort_by_key(|(mtime, path)| (mtime.duration_since(started).ok(), path.clone()));
    found.into_iter().map(|(_, p)| p).collect()
}

fn report(written: &[PathBuf], cfg: &Config, started: SystemTime) {
    if let Some(stats) = &cfg.stats {
        // Only a file that is there: a stats file that could not be made is not announced
        // (the library said why).
        let rows = stats_files(stats, started);
        if rows.is_empty() {
            eprintln!(
                "memsnap: no per-step figures were written to {stats} (memsnap's warning above says why, if it started recording)"
            );
        } else {
            let rows: Vec<String> = rows.iter().map(|p| p.display().to_string()).collect();
            eprintln!("memsnap: per-step figures: {}", rows.join(", "));
        }
    }
    let Some(newest) = written.last() else {
        eprintln!(
            "memsnap: the run wrote no snapshot in {}: {}",
            cfg.folder,
            why_no_snapshot(cfg)
        );
        return;
    };
    eprintln!(
        "memsnap: the run wrote {} snapshot{}:",
        written.len(),
        if written.len() == 1 { "" } else { "s" }
    );
    for p in written {
        eprintln!("  {}", p.display());
    }
    eprintln!("memsnap: next: memsnap summary {}", newest.display());
}

/// The likeliest reason a run left no snapshot, from the settings and the folder.
fn why_no_snapshot(cfg: &Config) -> String {
    if cfg.disabled {
        return format!("recording was disabled ({}=1)", var::DISABLE);
    }
    let folder = SnapshotFolder::new(&cfg.folder);
    if let Some(blocker) = folder
        .root
        .ancestors()
        .find(|p| !p.as_os_str().is_empty() && p.symlink_metadata().is_ok())
        && !blocker.is_dir()
    {
        return format!(
            "{} is not a folder, so no snapshot could be written there (memsnap's warning above says more)",
            blocker.display()
        );
    }
    let other_triggers = cfg.every > 0 || cfg.interval > 0 || cfg.period.is_some();
    if !cfg.at_exit && !other_triggers {
        return format!(
            "snapshots at exit were turned off ({}=0, --no-at-exit) and nothing else asked for one (no --every, --interval, --period, dump or out-of-memory error)",
            var::AT_EXIT
        );
    }
    "the program made no CUDA allocation (memsnap records from the first one), or writing failed (memsnap's warning above says why)".to_string()
}

/// The stats files `template` names that the run wrote (its placeholders, fixed per
/// process, match any value).
fn stats_files(template: &str, started: SystemTime) -> Vec<PathBuf> {
    let path = Path::new(template);
    let (dir, name) = match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => (dir.to_string_lossy().into_owned(), name.to_string_lossy()),
        _ => return Vec::new(),
    };
    let dir = if dir.is_empty() { ".".to_string() } else { dir };
    SnapshotFolder::new(&dir)
        .list()
        .into_iter()
        .filter(|(p, mtime)| {
            *mtime
                >= started
                    .checked_sub(std::time::Duration::from_secs(1))
                    .unwrap_or(started)
                && p.file_name()
                    .is_some_and(|n| template_matches(&name, &[], &n.to_string_lossy()))
        })
        .map(|(p, _)| p)
        .collect()
}

/// Whether `name` is what `template` expands to, with the placeholders in `fixed` replaced
/// by their values and every other placeholder matching anything. Also accepts the `-N`
/// suffix the library adds before the extension when a name is taken.
pub fn template_matches(template: &str, fixed: &[(&str, &str)], name: &str) -> bool {
    let pattern = compile(template, fixed);
    if glob(&pattern, name.as_bytes()) {
        return true;
    }
    let (stem, ext) = match name.rfind('.') {
        Some(i) if i > 0 => (&name[..i], &name[i..]),
        _ => (name, ""),
    };
    match stem.rsplit_once('-') {
        Some((base, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            glob(&pattern, format!("{base}{ext}").as_bytes())
        }
        _ => false,
    }
}

enum Piece {
    Text(Vec<u8>),
    Any,
}

fn compile(template: &str, fixed: &[(&str, &str)]) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push(Piece::Text(rest.as_bytes()[..open].to_vec()));
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            out.push(Piece::Text(rest.as_bytes()[open..].to_vec()));
            return out;
        };
        let key = &after[..close];
        match fixed.iter().find(|(k, _)| *k == key) {
            Some((_, value)) => out.push(Piece::Text(value.as_bytes().to_vec())),
            None => out.push(Piece::Any),
        }
        rest = &after[close + 1..];
    }
    out.push(Piece::Text(rest.as_bytes().to_vec()));
    out
}

fn glob(pattern: &[Piece], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((Piece::Text(t), rest)) => name.starts_with(t) && glob(rest, &name[t.len()..]),
        Some((Piece::Any, rest)) => (1..=name.len()).any(|i| glob(rest, &name[i..])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_template_matches_library_names() {
        let t = memsnap_format::config::DEFAULT_FILENAME;
        let name = "memsnap-demo-node1-r0-p123-signal-2.pickle";
        assert!(template_matches(t, &[], name));
        assert!(template_matches(
            t,
            &[("pid", "123"), ("label", "signal")],
            name
        ));
        assert!(!template_matches(t, &[("pid", "124")], name));
        assert!(!template_matches(t, &[("label", "exit")], name));
        assert!(template_matches(
            t,
            &[("label", "signal")],
            "memsnap-demo-node1-r0-p123-signal-2-1.pickle"
        ));
        assert!(!template_matches(t, &[], "notes.txt"));
        assert!(!template_matches(t, &[], "stats.csv"));
    }

    #[test]
    fn custom_templates() {
        assert!(template_matches(
            "rank{rank}.{step}.pickle",
            &[],
            "rank3.12.pickle"
        ));
        assert!(!template_matches(
            "rank{rank}.{step}.pickle",
            &[],
            "rank3.12.csv"
        ));
        assert!(template_matches("fixed.pickle", &[], "fixed-2.pickle"));
        assert!(!template_matches("fixed.pickle", &[], "fixed-x.pickle"));
    }

    #[test]
    fn preload_is_prepended_once() {
        let lib = Path::new("/opt/memsnap/lib/libmemsnap.so");
        assert_eq!(prepend_preload(lib, None), "/opt/memsnap/lib/libmemsnap.so");
        assert_eq!(
            prepend_preload(
                lib,
                Some("/old/libmemsnap.so /usr/lib/libfoo.so:libbar.so".into())
            ),
            "/opt/memsnap/lib/libmemsnap.so:/usr/lib/libfoo.so:libbar.so"
        );
    }

    #[test]
    fn placeholder_folders_are_searched_below_their_fixed_part() {
        let f = SnapshotFolder::new("out/run1/rank{rank}");
        assert_eq!(f.root, PathBuf::from("out/run1"));
        assert_eq!(f.depth, 1);
        let f = SnapshotFolder::new("snaps");
        assert_eq!((f.root, f.depth), (PathBuf::from("snaps"), 0));
    }
}
