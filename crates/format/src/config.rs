//! Every `MEMSNAP_*` variable, parsed once, with its default in one place.
//!
//! Cold code. The preload library parses the environment once, on the first CUDA event
//! (a process that never touches CUDA never reads or prints anything); `memsnap run`
//! uses the same names to turn its options into variables. A bad value is one [`Invalid`]
//! naming the variable and what it accepts: the library prints it and uses the default,
//! `memsnap run` refuses to start. No value, however long or odd, makes the parser panic.

use std::ffi::OsString;
use std::time::Duration;

/// Names of every variable memsnap reads. docs/SETTINGS.md documents each of them
/// (`tests/doc_paths.rs` checks it).
pub mod var {
    pub const DISABLE: &str = "MEMSNAP_DISABLE";
    pub const FOLDER: &str = "MEMSNAP_FOLDER";
    pub const FILENAME: &str = "MEMSNAP_FILENAME";
    pub const OVERWRITE: &str = "MEMSNAP_OVERWRITE";
    pub const MAX_ENTRIES: &str = "MEMSNAP_MAX_ENTRIES";
    pub const AT_EXIT: &str = "MEMSNAP_AT_EXIT";
    pub const ON_OOM: &str = "MEMSNAP_ON_OOM";
    pub const SIGNAL: &str = "MEMSNAP_SIGNAL";
    pub const STACKS: &str = "MEMSNAP_STACKS";
    pub const CONTEXT: &str = "MEMSNAP_CONTEXT";
    pub const MAX_FRAMES: &str = "MEMSNAP_MAX_FRAMES";
    pub const QUEUE_CAPACITY: &str = "MEMSNAP_QUEUE_CAPACITY";
    pub const QUIET: &str = "MEMSNAP_QUIET";
    pub const SKIP: &str = "MEMSNAP_SKIP";
    pub const INTERVAL: &str = "MEMSNAP_INTERVAL";
    pub const EVERY: &str = "MEMSNAP_EVERY";
    pub const STEPS: &str = "MEMSNAP_STEPS";
    pub const PERIOD: &str = "MEMSNAP_PERIOD";
    pub const STATS: &str = "MEMSNAP_STATS";
    pub const AT_CRASH: &str = "MEMSNAP_AT_CRASH";
    pub const CRASH_WAIT: &str = "MEMSNAP_CRASH_WAIT";
    pub const REMOTE: &str = "MEMSNAP_REMOTE";
    pub const REMOTE_ONLY: &str = "MEMSNAP_REMOTE_ONLY";
    pub const REMOTE_WAIT: &str = "MEMSNAP_REMOTE_WAIT";
}

/// The longest `MEMSNAP_REMOTE_WAIT`: an exiting job should not hang on its uploads.
pub const MAX_REMOTE_WAIT: Duration = Duration::from_secs(60);

/// The longest `MEMSNAP_CRASH_WAIT`: a dying job should not hang on its snapshot.
pub const MAX_CRASH_WAIT: Duration = Duration::from_secs(60);

/// Hard upper bound on captured frames per stack (native and Python each); the event
/// slots are sized for it, `MEMSNAP_MAX_FRAMES` can only lower it.
pub const FRAME_CAPACITY: usize = 64;

/// Which stacks to capture, in PyTorch's words (`_record_memory_history(stacks=...)`).
///
/// Each value is its kinds of stack as bits (Python 1, native 2), so that the hooks test a
/// bit where a `match` on four values would read a jump table: one more cache line an event
/// with cold caches (docs/HOT-PATH.md, "The tracker's lines").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Stacks {
    None = 0,
    Python = Stacks::PYTHON_BIT,
    Native = Stacks::NATIVE_BIT,
    All = Stacks::PYTHON_BIT | Stacks::NATIVE_BIT,
}

impl Stacks {
    const PYTHON_BIT: u8 = 1;
    const NATIVE_BIT: u8 = 2;

    #[inline(always)]
    pub fn python(self) -> bool {
        self as u8 & Stacks::PYTHON_BIT != 0
    }
    #[inline(always)]
    pub fn native(self) -> bool {
        self as u8 & Stacks::NATIVE_BIT != 0
    }

    /// The value whose bits are the low two of `bits` (the inverse of `as u8`).
    #[inline(always)]
    pub fn from_bits(bits: u8) -> Stacks {
        match bits & (Stacks::PYTHON_BIT | Stacks::NATIVE_BIT) {
            Stacks::PYTHON_BIT => Stacks::Python,
            Stacks::NATIVE_BIT => Stacks::Native,
            0 => Stacks::None,
            _ => Stacks::All,
        }
    }
}

/// Where step boundaries come from (`MEMSNAP_STEPS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StepMarks {
    /// PyTorch's optimizer steps, until the program marks steps itself; the program's marks
    /// from then on.
    Auto = 1,
    /// Only the program's own marks (`memsnap_step()`, `memsnap.step()`, the callbacks).
    Program = 2,
    /// No step boundaries at all: the program's marks are refused too.
    Off = 3,
}

impl StepMarks {
    /// The inverse of `as u8`.
    pub fn from_u8(v: u8) -> Option<StepMarks> {
        match v {
            1 => Some(StepMarks::Auto),
            2 => Some(StepMarks::Program),
            3 => Some(StepMarks::Off),
            _ => None,
        }
    }
}

/// Whether frees carry their own stack (`all`) or reuse the allocation's (`alloc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    Alloc,
    All,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `MEMSNAP_DISABLE=1`: every hook passes straight through, nothing is recorded.
    pub disabled: bool,
    pub folder: String,
    pub filename: String,
    pub overwrite: bool,
    /// Newest trace entries kept per device.
    pub max_entries: usize,
    pub at_exit: bool,
    pub on_oom: bool,
    /// Signal number that requests a dump; `None` when disabled.
    pub signal: Option<i32>,
    pub stacks: Stacks,
    pub context: Context,
    pub max_frames: usize,
    /// Events the hook-to-writer queue holds before new ones are dropped (and counted).
    pub queue_capacity: usize,
    /// No stderr line at exit (warnings are still printed).
    pub quiet: bool,
    /// Steps before the recording window starts (Composer's `skip_batches`).
    pub skip: u64,
    /// Steps in the recording window; one snapshot when it ends. 0 = no window.
    pub interval: u64,
    /// A snapshot every N steps. 0 = off.
    pub every: u64,
    /// Where step boundaries come from.
    pub steps: StepMarks,
    /// A snapshot every given duration. `None` = off.
    pub period: Option<Duration>,
    /// CSV file for per-step memory figures. `None` = off.
    pub stats: Option<String>,
    /// Borrow SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGABRT, SIGSEGV and SIGBUS for a last snapshot.
    pub at_crash: bool,
    /// How long a terminating signal waits for its snapshot before the program goes on.
    pub crash_wait: Duration,
    /// Where each published snapshot is also copied: a `file://`, `s3://`, `gs://` or `az://`
    /// URL template.
    /// `None` = off.
    pub remote: Option<String>,
    /// Remove the local file once its copy is confirmed.
    pub remote_only: bool,
    /// How long exit waits for copies still under way.
    pub remote_wait: Duration,
}

pub const DEFAULT_FILENAME: &str = "memsnap-{exe}-{host}-r{rank}-p{pid}-{label}-{seq}.pickle";

impl Default for Config {
    fn default() -> Self {
        Config {
            disabled: false,
            folder: ".".to_string(),
            filename: DEFAULT_FILENAME.to_string(),
            overwrite: false,
            max_entries: 100_000,
            at_exit: true,
            on_oom: true,
            signal: Some(libc::SIGUSR1),
            stacks: Stacks::All,
            context: Context::Alloc,
            max_frames: FRAME_CAPACITY,
            queue_capacity: 1 << 16,
            quiet: false,
            skip: 1,
            interval: 0,
            every: 0,
            steps: StepMarks::Auto,
            period: None,
            stats: None,
            at_crash: true,
            crash_wait: Duration::from_secs(5),
            remote: None,
            remote_only: false,
            remote_wait: Duration::from_secs(5),
        }
    }
}

/// A variable whose value was refused: its name, the value, and what it accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: expected {expected}")]
pub struct Invalid {
    pub name: &'static str,
    pub value: String,
    pub expected: String,
}

impl Invalid {
    /// The line the library prints: it carries on with the variable's default.
    pub fn ignored_message(&self) -> String {
        format!("memsnap: ignoring {self}; using the default")
    }
}

impl Config {
    /// Reads the process environment. Returns the configuration and one message per
    /// invalid variable (the caller prints them; the default was used for each).
    pub fn from_env() -> (Config, Vec<String>) {
        let (cfg, invalid) = Self::from_os_lookup(|name| std::env::var_os(name));
        (cfg, invalid.iter().map(Invalid::ignored_message).collect())
    }

    /// Parses with an arbitrary lookup, so tests need not touch the real environment.
    /// Each refused variable keeps its default and is reported once.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (Config, Vec<Invalid>) {
        Self::from_os_lookup(|name| get(name).map(OsString::from))
    }

    /// As [`Config::from_lookup`], for raw environment values: one that is not UTF-8 is
    /// refused like any other bad value (never a panic, never silently dropped).
    pub fn from_os_lookup(get: impl Fn(&str) -> Option<OsString>) -> (Config, Vec<Invalid>) {
        let mut cfg = Config::default();
        let mut errors = Vec::new();
        let mut p = Parser {
            get: &get,
            errors: &mut errors,
        };

        cfg.disabled = p.flag(var::DISABLE, cfg.disabled);
        if let Some(v) = p.checked_text(var::FOLDER, validate_folder) {
            cfg.folder = v;
        }
        if let Some(v) = p.checked_text(var::FILENAME, validate_filename) {
            cfg.filename = v;
        }
        cfg.overwrite = p.flag(var::OVERWRITE, cfg.overwrite);
        cfg.max_entries = p.count(var::MAX_ENTRIES, cfg.max_entries as u64, 1, 1 << 40) as usize;
        cfg.at_exit = p.flag(var::AT_EXIT, cfg.at_exit);
        cfg.on_oom = p.flag(var::ON_OOM, cfg.on_oom);
        if let Some(v) = p.text(var::SIGNAL) {
            match parse_signal(&v) {
                Some(s) => cfg.signal = s,
                None => p.bad(var::SIGNAL, &v, &signal_choices()),
            }
        }
        if let Some(v) = p.text(var::STACKS) {
            match v.to_ascii_lowercase().as_str() {
                "none" => cfg.stacks = Stacks::None,
                "python" => cfg.stacks = Stacks::Python,
                "native" | "cpp" => cfg.stacks = Stacks::Native,
                "all" => cfg.stacks = Stacks::All,
                _ => p.bad(var::STACKS, &v, "one of none, python, native, all"),
            }
        }
        if let Some(v) = p.text(var::CONTEXT) {
            match v.to_ascii_lowercase().as_str() {
                "alloc" => cfg.context = Context::Alloc,
                "all" => cfg.context = Context::All,
                _ => p.bad(var::CONTEXT, &v, "one of alloc, all"),
            }
        }
        cfg.max_frames = p.count(
            var::MAX_FRAMES,
            cfg.max_frames as u64,
            1,
            FRAME_CAPACITY as u64,
        ) as usize;
        cfg.queue_capacity =
            p.count(var::QUEUE_CAPACITY, cfg.queue_capacity as u64, 16, 1 << 24) as usize;
        cfg.quiet = p.flag(var::QUIET, cfg.quiet);
        cfg.skip = p.count(var::SKIP, cfg.skip, 0, MAX_STEPS);
        cfg.interval = p.count(var::INTERVAL, cfg.interval, 0, MAX_STEPS);
        cfg.every = p.count(var::EVERY, cfg.every, 0, MAX_STEPS);
        if let Some(v) = p.text(var::STEPS) {
            match v.to_ascii_lowercase().as_str() {
                "auto" => cfg.steps = StepMarks::Auto,
                "program" => cfg.steps = StepMarks::Program,
                "off" => cfg.steps = StepMarks::Off,
                _ => p.bad(var::STEPS, &v, "one of auto, program, off"),
            }
        }
        if let Some(v) = p.text(var::PERIOD) {
            match parse_duration(&v) {
                Some(d) if d.is_zero() => cfg.period = None,
                Some(d) if (MIN_PERIOD..=MAX_PERIOD).contains(&d) => cfg.period = Some(d),
                _ => p.bad(
                    var::PERIOD,
                    &v,
                    "a duration from 1s to 30d such as 30s, 5m, 1h or 1d (0 = off)",
                ),
            }
        }
        if let Some(v) = p.checked_text(var::STATS, validate_stats_path) {
            cfg.stats = Some(v);
        }
        cfg.at_crash = p.flag(var::AT_CRASH, cfg.at_crash);
        cfg.crash_wait = p.wait(var::CRASH_WAIT, cfg.crash_wait, MAX_CRASH_WAIT);
        if let Some(v) = p.checked_text(var::REMOTE, validate_remote) {
            cfg.remote = Some(v);
        }
        cfg.remote_only = p.flag(var::REMOTE_ONLY, cfg.remote_only);
        cfg.remote_wait = p.wait(var::REMOTE_WAIT, cfg.remote_wait, MAX_REMOTE_WAIT);
        (cfg, errors)
    }
}

/// Largest `MEMSNAP_SKIP`, `MEMSNAP_INTERVAL` and `MEMSNAP_EVERY`: a trillion steps, far
/// beyond any run, and small enough that step arithmetic never overflows.
pub const MAX_STEPS: u64 = 1_000_000_000_000;
/// Shortest `MEMSNAP_PERIOD`: each period writes a whole snapshot, so a period of
/// milliseconds floods the folder with files and keeps the writer busy encoding.
pub const MIN_PERIOD: Duration = Duration::from_secs(1);
/// Longest `MEMSNAP_PERIOD`: 30 days.
pub const MAX_PERIOD: Duration = Duration::from_secs(30 * 24 * 3600);

struct Parser<'a, F: Fn(&str) -> Option<OsString>> {
    get: &'a F,
    errors: &'a mut Vec<Invalid>,
}

impl<F: Fn(&str) -> Option<OsString>> Parser<'_, F> {
    /// The variable's value, or `None` when unset or empty (empty means "default") or not
    /// UTF-8 (refused).
    fn text(&mut self, name: &'static str) -> Option<String> {
        let value = match (self.get)(name)?.into_string() {
            Ok(v) => v,
            Err(raw) => {
                self.bad(name, &raw.to_string_lossy(), "UTF-8 text");
                return None;
            }
        };
        Some(value.trim().to_string()).filter(|v| !v.is_empty())
    }

    /// The variable's value (as [`text`](Self::text)) when `validate` accepts it; a refused
    /// one is reported with `validate`'s message and gives `None`.
    fn checked_text(
        &mut self,
        name: &'static str,
        validate: fn(&str) -> Result<(), String>,
    ) -> Option<String> {
        let v = self.text(name)?;
        match validate(&v) {
            Ok(()) => Some(v),
            Err(msg) => {
                self.bad(name, &v, &msg);
                None
            }
        }
    }

    fn bad(&mut self, name: &'static str, value: &str, accepted: &str) {
        self.errors.push(Invalid {
            name,
            value: value.to_string(),
            expected: accepted.to_string(),
        });
    }

    fn flag(&mut self, name: &'static str, default: bool) -> bool {
        let Some(v) = self.text(name) else {
            return default;
        };
        match v.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => {
                self.bad(name, &v, "1/true/yes/on or 0/false/no/off");
                default
            }
        }
    }

    /// A bounded wait: a duration from 0 to `max` (whole seconds).
    fn wait(&mut self, name: &'static str, default: Duration, max: Duration) -> Duration {
        let Some(v) = self.text(name) else {
            return default;
        };
        match parse_duration(&v) {
            Some(d) if d <= max => d,
            _ => {
                let accepted = format!(
                    "a duration from 0s to {}s, such as 500ms or 5s",
                    max.as_secs()
                );
                self.bad(name, &v, &accepted);
                default
            }
        }
    }

    fn count(&mut self, name: &'static str, default: u64, min: u64, max: u64) -> u64 {
        let Some(v) = self.text(name) else {
            return default;
        };
        match v.replace('_', "").parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => n,
            _ => {
                let accepted = if max == u64::MAX {
                    format!("a whole number >= {min}")
                } else {
                    format!("a whole number from {min} to {max}")
                };
                self.bad(name, &v, &accepted);
                default
            }
        }
    }
}

/// The dump signal: only signals a program does not already rely on for something else and
/// whose default action memsnap's handler may replace. `USR1`/`SIGUSR1`/`usr2`, their numbers
/// (`10`, `12`), `RTMIN+n` for `n` in `0..=SIGRTMAX-SIGRTMIN` (glibc's `SIGRTMIN` already
/// leaves out the real-time signals it reserves), and `none`/`off`/`0`. Returns `Some(None)`
/// for `none`, `None` for anything else: `SEGV` would turn a crash into an endless loop of
/// snapshots, `KILL` cannot be caught, `HUP`/`CONT`/`WINCH`/`URG`/`PWR` have meanings of
/// their own.
pub fn parse_signal(v: &str) -> Option<Option<i32>> {
    let up = v.trim().to_ascii_uppercase();
    if matches!(up.as_str(), "NONE" | "OFF" | "0") {
        return Some(None);
    }
    if up.bytes().all(|b| b.is_ascii_digit()) {
        let n = up.parse::<i32>().ok()?;
        return [libc::SIGUSR1, libc::SIGUSR2]
            .contains(&n)
            .then_some(Some(n));
    }
    let name = up.strip_prefix("SIG").unwrap_or(&up);
    match name {
        "USR1" => Some(Some(libc::SIGUSR1)),
        "USR2" => Some(Some(libc::SIGUSR2)),
        _ => {
            let offset = match name.strip_prefix("RTMIN")? {
                "" => 0,
                rest => {
                    let digits = rest.strip_prefix('+')?;
                    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                        return None;
                    }
                    digits.parse::<i32>().ok()?
                }
            };
            (0..=max_rt_offset())
                .contains(&offset)
                .then(|| Some(libc::SIGRTMIN() + offset))
        }
    }
}

/// The largest `n` in `RTMIN+n`.
fn max_rt_offset() -> i32 {
    libc::SIGRTMAX() - libc::SIGRTMIN()
}

/// What `MEMSNAP_SIGNAL` accepts, for messages.
pub fn signal_choices() -> String {
    format!(
        "USR1 or USR2 (also SIGUSR1, SIGUSR2, {}, {}), RTMIN+0 to RTMIN+{}, or none",
        libc::SIGUSR1,
        libc::SIGUSR2,
        max_rt_offset()
    )
}

/// `500ms`, `30s`, `5m`, `1h`, `1d`, or a bare number of seconds. `None` for anything
/// else, including values too large for a `Duration` (never a panic).
pub fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let num: f64 = num.parse().ok()?;
    if !num.is_finite() || num < 0.0 {
        return None;
    }
    let secs = match unit.trim() {
        "" | "s" | "sec" => num,
        "ms" => num / 1000.0,
        "m" | "min" => num * 60.0,
        "h" => num * 3600.0,
        "d" => num * 86_400.0,
        _ => return None,
    };
    Duration::try_from_secs_f64(secs).ok()
}

/// Placeholders a file name or folder template may use.
pub const TEMPLATE_KEYS: &[&str] = &[
    "rank",
    "local_rank",
    "pid",
    "host",
    "exe",
    "reason",
    "seq",
    "step",
    "tag",
    "label",
    "time",
];

/// Placeholders a `MEMSNAP_STATS` path may use: the file is opened once per process, so
/// only what is fixed for a process.
pub const STATS_KEYS: &[&str] = &["rank", "local_rank", "pid", "host", "exe"];

/// Checks `MEMSNAP_FILENAME`: known placeholders, no `/`, and a visible name. Placeholder
/// values never start with `.` ([`sanitize`]), so a template that does not start with one
/// cannot expand to `.`, `..` or a hidden name.
pub fn validate_filename(t: &str) -> Result<(), String> {
    no_control_characters(t, "a file name")?;
    check_placeholders(t, TEMPLATE_KEYS)?;
    if t.contains('/') {
        return Err("a file name without '/' (put directories in MEMSNAP_FOLDER)".to_string());
    }
    if t.starts_with('.') {
        return Err(
            "a file name that does not start with '.' (such a name is `.`, `..` or a hidden file)"
                .to_string(),
        );
    }
    Ok(())
}

/// Checks `MEMSNAP_FOLDER`: known placeholders. Its values are sanitized when expanded, so
/// none can add a `/`, `.` or `..` component.
pub fn validate_folder(t: &str) -> Result<(), String> {
    no_control_characters(t, "a folder")?;
    check_placeholders(t, TEMPLATE_KEYS)
}

/// Paths and URLs are printed one per line (the exit line, `memsnap dump`, the upload
/// helper's protocol): a newline, tab or other control character in one would split or
/// forge a line.
fn no_control_characters(t: &str, what: &str) -> Result<(), String> {
    if t.chars().any(char::is_control) {
        return Err(format!(
            "{what} without control characters (newline, tab, escape, ...)"
        ));
    }
    Ok(())
}

/// Checks `MEMSNAP_STATS`: placeholders fixed for a process ([`STATS_KEYS`]), and a path
/// that ends in a visible file name.
pub fn validate_stats_path(t: &str) -> Result<(), String> {
    no_control_characters(t, "a file path")?;
    check_placeholders(t, STATS_KEYS)?;
    let name = t.rsplit('/').next().unwrap_or(t);
    if name.is_empty() || name.starts_with('.') {
        return Err(
            "a file path ending in a name that does not start with '.' (not a folder, `.`, `..` or a hidden file)"
                .to_string(),
        );
    }
    Ok(())
}

/// URL schemes `MEMSNAP_REMOTE` accepts: a shared file system, S3 or an S3-compatible
/// server (`AWS_ENDPOINT_URL`), Google Cloud Storage, Azure Blob Storage (`az://container`).
pub const REMOTE_SCHEMES: &[&str] = &["file", "s3", "gs", "az"];

/// Checks `MEMSNAP_REMOTE`: a `file:///absolute/path`, `s3://bucket/key`,
/// `gs://bucket/key` or `az://container/key` template with the placeholders of
/// `MEMSNAP_FILENAME`, no `.` or `..` component (placeholder values are sanitized like file
/// names, so none can add one), ending in a visible name.
pub fn validate_remote(t: &str) -> Result<(), String> {
    let accepted = "a file:///path, s3://bucket/key, gs://bucket/key or az://container/key URL template such as s3://bucket/snaps/r{rank}/{reason}-{seq}.pickle";
    let Some((scheme, rest)) = t.split_once("://") else {
        return Err(accepted.to_string());
    };
    if !REMOTE_SCHEMES.contains(&scheme) {
        return Err(accepted.to_string());
    }
    no_control_characters(t, "a URL template")?;
    check_placeholders(rest, TEMPLATE_KEYS)?;
    let components: Vec<&str> = rest.split('/').collect();
    let name = components.last().copied().unwrap_or("");
    let rooted = if scheme == "file" {
        rest.starts_with('/')
    } else {
        components.len() >= 2 && !components[0].is_empty() && !components[0].contains('{')
    };
    if !rooted
        || name.is_empty()
        || name.starts_with('.')
        || components.iter().any(|c| *c == "." || *c == "..")
    {
        return Err(format!(
            "{accepted}: an absolute path (file://) or a bucket or container and a key (s3://, gs://, az://; the bucket without placeholders), without `.` or `..` components, ending in a name that does not start with '.'"
        ));
    }
    Ok(())
}

/// Checks that braces are balanced and every `{...}` names one of `keys`.
fn check_placeholders(t: &str, keys: &[&str]) -> Result<(), String> {
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err("a template whose braces are balanced".to_string());
        };
        let key = &after[..close];
        if !keys.contains(&key) {
            return Err(format!(
                "a template using only {{{}}} (unknown placeholder {{{key}}})",
                keys.join("}, {")
            ));
        }
        rest = &after[close + 1..];
    }
    Ok(())
}

/// Where a process's `{rank}` comes from, in order (otherwise its pid).
pub const RANK_VARS: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
];
/// Where `{local_rank}` comes from, in order (otherwise the rank).
pub const LOCAL_RANK_VARS: &[&str] = &[
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
];

/// `(rank, local_rank)` of a process with environment `get` and id `pid`. Shared by the
/// library (its own names) and `memsnap dump` (another process's names), so they agree.
pub fn ranks(get: impl Fn(&str) -> Option<String>, pid: u32) -> (String, String) {
    let first = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| get(k).filter(|v| !v.trim().is_empty()))
    };
    let rank = first(RANK_VARS).unwrap_or_else(|| pid.to_string());
    let local_rank = first(LOCAL_RANK_VARS).unwrap_or_else(|| rank.clone());
    (rank, local_rank)
}

/// This machine's host name, the value of `{host}` (before [`sanitize`]); `localhost` when
/// the kernel names none.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A placeholder value made safe for file and folder names: letters, digits, `.`, `_`,
/// `-`, anything else becomes `_`, and so does a leading `.`. The result is never empty and
/// never starts with `.`, so whatever text surrounds it, a value cannot make a path
/// component `.` or `..`, a hidden name, or a new component.
pub fn sanitize(s: &str) -> String {
    let out: String = s
        .chars()
        .enumerate()
        .map(|(i, c)| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-') || (c == '.' && i > 0) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() { "_".to_string() } else { out }
}

/// Expands `{key}` placeholders with `value(key)`; the first key it has no value for is
/// the error. An unclosed `{` is kept as text.
pub fn expand_template(
    template: &str,
    value: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            out.push_str(&rest[open..]);
            return Ok(out);
        };
        let key = &after[..close];
        out.push_str(&value(key).ok_or_else(|| key.to_string())?);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> (Config, Vec<Invalid>) {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn each_stacks_value_names_its_kinds_of_stack() {
        let kinds = |s: Stacks| (s.python(), s.native());
        assert_eq!(kinds(Stacks::None), (false, false));
        assert_eq!(kinds(Stacks::Python), (true, false));
        assert_eq!(kinds(Stacks::Native), (false, true));
        assert_eq!(kinds(Stacks::All), (true, true));
        for s in [Stacks::None, Stacks::Python, Stacks::Native, Stacks::All] {
            assert_eq!(Stacks::from_bits(s as u8), s);
            // Bits above the two kinds are not the mode's.
            assert_eq!(Stacks::from_bits(s as u8 | 0xf0), s);
        }
    }

    #[test]
    fn defaults_when_unset() {
        let (cfg, errors) = parse(&[]);
        assert!(errors.is_empty());
        assert_eq!(cfg, Config::default());
        assert_eq!(cfg.max_entries, 100_000);
        assert_eq!(cfg.signal, Some(libc::SIGUSR1));
        assert_eq!(cfg.stacks, Stacks::All);
    }

    #[test]
    fn parses_valid_values() {
        let (cfg, errors) = parse(&[
            ("MEMSNAP_MAX_ENTRIES", "5_000"),
            ("MEMSNAP_SIGNAL", "usr2"),
            ("MEMSNAP_STACKS", "python"),
            ("MEMSNAP_CONTEXT", "all"),
            ("MEMSNAP_STEPS", "Program"),
            ("MEMSNAP_OVERWRITE", "yes"),
            ("MEMSNAP_PERIOD", "2500ms"),
            ("MEMSNAP_FILENAME", "rank{rank}.{step}.pickle"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(cfg.max_entries, 5000);
        assert_eq!(cfg.signal, Some(libc::SIGUSR2));
        assert_eq!(cfg.stacks, Stacks::Python);
        assert_eq!(cfg.context, Context::All);
        assert_eq!(cfg.steps, StepMarks::Program);
        assert!(cfg.overwrite);
        assert_eq!(cfg.period, Some(Duration::from_millis(2500)));
        assert_eq!(cfg.filename, "rank{rank}.{step}.pickle");
    }

    #[test]
    fn bad_values_name_the_variable_and_keep_the_default() {
        let (cfg, errors) = parse(&[
            ("MEMSNAP_MAX_ENTRIES", "lots"),
            ("MEMSNAP_SIGNAL", "SIGFOO"),
            ("MEMSNAP_STACKS", "some"),
            ("MEMSNAP_AT_EXIT", "maybe"),
            ("MEMSNAP_FILENAME", "x-{nope}.pickle"),
            ("MEMSNAP_PERIOD", "soon"),
        ]);
        assert_eq!(errors.len(), 6, "{errors:?}");
        for (e, name) in errors.iter().map(Invalid::ignored_message).zip([
            "MEMSNAP_FILENAME",
            "MEMSNAP_MAX_ENTRIES",
            "MEMSNAP_AT_EXIT",
            "MEMSNAP_SIGNAL",
            "MEMSNAP_STACKS",
            "MEMSNAP_PERIOD",
        ]) {
            assert!(e.contains(name), "{e} should name {name}");
            assert!(e.contains("expected"), "{e}");
        }
        assert_eq!(cfg.max_entries, 100_000);
        assert_eq!(cfg.signal, Some(libc::SIGUSR1));
        assert!(cfg.at_exit);
        assert_eq!(cfg.filename, DEFAULT_FILENAME);
    }

    #[test]
    fn steps_take_auto_program_or_off_and_refuse_the_rest() {
        assert_eq!(parse(&[]).0.steps, StepMarks::Auto);
        for (v, steps) in [
            ("auto", StepMarks::Auto),
            ("OFF", StepMarks::Off),
            (" program ", StepMarks::Program),
        ] {
            let (cfg, errors) = parse(&[("MEMSNAP_STEPS", v)]);
            assert!(errors.is_empty(), "{v}: {errors:?}");
            assert_eq!(cfg.steps, steps, "{v}");
            assert_eq!(StepMarks::from_u8(steps as u8), Some(steps));
        }
        for v in ["optimizer", "0", "none"] {
            let e = refused("MEMSNAP_STEPS", v);
            assert_eq!(e.expected, "one of auto, program, off");
        }
        assert_eq!(StepMarks::from_u8(0), None);
    }

    #[test]
    fn signal_none_disables() {
        let (cfg, errors) = parse(&[("MEMSNAP_SIGNAL", "none")]);
        assert!(errors.is_empty());
        assert_eq!(cfg.signal, None);
    }

    /// The one variable a value refused, with what it accepts.
    fn refused(name: &str, value: &str) -> Invalid {
        let (cfg, errors) = parse(&[(name, value)]);
        assert_eq!(errors.len(), 1, "{name}={value}: {errors:?}");
        assert_eq!(
            cfg,
            Config::default(),
            "{name}={value} changed the settings"
        );
        let e = errors.into_iter().next().unwrap();
        assert_eq!(e.name, name);
        e
    }

    #[test]
    fn values_that_are_not_utf8_are_refused() {
        use std::os::unix::ffi::OsStringExt;
        let (cfg, errors) = Config::from_os_lookup(|k| {
            (k == "MEMSNAP_FOLDER").then(|| OsString::from_vec(b"snaps-\xff".to_vec()))
        });
        assert_eq!(cfg, Config::default());
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].to_string(),
            "MEMSNAP_FOLDER=\"snaps-\u{fffd}\": expected UTF-8 text"
        );
    }

    #[test]
    fn huge_periods_are_refused_without_a_panic() {
        for v in [
            "99999999999999999999",
            "5124095576030431h",
            "1e400",
            "18446744073709551616s",
            "99999999999999999999999999999999999999d",
        ] {
            let e = refused("MEMSNAP_PERIOD", v);
            assert!(e.expected.contains("from 1s to 30d"), "{e}");
        }
        assert_eq!(parse_duration("99999999999999999999"), None);
        assert_eq!(parse_duration("5124095576030431h"), None);
    }

    #[test]
    fn periods_are_bounded_from_one_second_to_thirty_days() {
        for v in ["1ms", "999ms", "0.5", "31d", "721h"] {
            refused("MEMSNAP_PERIOD", v);
        }
        for (v, d) in [
            ("1s", MIN_PERIOD),
            ("1000ms", MIN_PERIOD),
            ("30d", MAX_PERIOD),
            ("720h", MAX_PERIOD),
            ("1.5", Duration::from_millis(1500)),
        ] {
            let (cfg, errors) = parse(&[("MEMSNAP_PERIOD", v)]);
            assert!(errors.is_empty(), "{v}: {errors:?}");
            assert_eq!(cfg.period, Some(d), "{v}");
        }
        let (cfg, errors) = parse(&[("MEMSNAP_PERIOD", "0")]);
        assert!(errors.is_empty());
        assert_eq!(cfg.period, None);
    }

    #[test]
    fn every_count_is_range_checked() {
        let huge = "184467440737095516160000";
        for name in [
            "MEMSNAP_MAX_ENTRIES",
            "MEMSNAP_MAX_FRAMES",
            "MEMSNAP_QUEUE_CAPACITY",
            "MEMSNAP_SKIP",
            "MEMSNAP_INTERVAL",
            "MEMSNAP_EVERY",
        ] {
            for v in [huge, "-1", "1.5", "0x10", "18446744073709551615"] {
                let e = refused(name, v);
                assert!(e.expected.starts_with("a whole number from"), "{e}");
            }
        }
        let e = refused("MEMSNAP_SKIP", "1000000000001");
        assert_eq!(e.expected, "a whole number from 0 to 1000000000000");
        // The history keeps at least one entry: the writer relies on this bound alone.
        let e = refused("MEMSNAP_MAX_ENTRIES", "0");
        assert_eq!(e.expected, "a whole number from 1 to 1099511627776");
        let (cfg, errors) = parse(&[
            ("MEMSNAP_SKIP", "1_000_000_000_000"),
            ("MEMSNAP_INTERVAL", "1000000000000"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(cfg.skip.checked_add(cfg.interval), Some(2 * MAX_STEPS));
    }

    #[test]
    fn only_signals_safe_to_borrow_are_accepted() {
        let rt = |n: i32| Some(Some(libc::SIGRTMIN() + n));
        let max = libc::SIGRTMAX() - libc::SIGRTMIN();
        for (v, want) in [
            ("USR1", Some(Some(libc::SIGUSR1))),
            ("sigusr2", Some(Some(libc::SIGUSR2))),
            ("10", Some(Some(libc::SIGUSR1))),
            ("12", Some(Some(libc::SIGUSR2))),
            ("RTMIN", rt(0)),
            ("rtmin+0", rt(0)),
            ("SIGRTMIN+3", rt(3)),
            (&format!("RTMIN+{max}"), rt(max)),
            ("none", Some(None)),
            ("off", Some(None)),
            ("0", Some(None)),
        ] {
            assert_eq!(parse_signal(v), want, "{v}");
        }
        for v in [
            "11",
            "SEGV",
            "SIGSEGV",
            "9",
            "KILL",
            "32",
            "33",
            "34",
            "64",
            "HUP",
            "CONT",
            "WINCH",
            "PWR",
            "URG",
            "TERM",
            "-10",
            "+10",
            "RTMIN+-23",
            "RTMIN-1",
            "RTMIN+",
            "RTMIN++1",
            "RTMIN+2147483647",
            "RTMIN+99999999999999999999",
            &format!("RTMIN+{}", max + 1),
            "RTMAX",
        ] {
            assert_eq!(parse_signal(v), None, "{v} must be refused");
            let e = refused("MEMSNAP_SIGNAL", v);
            assert!(
                e.to_string().contains("USR1 or USR2")
                    && e.to_string().contains(&format!("RTMIN+{max}")),
                "{e}"
            );
        }
    }

    #[test]
    fn names_that_would_be_hidden_or_dot_are_refused() {
        for v in [".", "..", ".x-{pid}.pickle", "...", "a/b.pickle", "../x"] {
            refused("MEMSNAP_FILENAME", v);
        }
        for v in ["stats/", ".", "..", "dir/.", "dir/..", "dir/.mem.csv"] {
            refused("MEMSNAP_STATS", v);
        }
        let (cfg, errors) = parse(&[
            ("MEMSNAP_FILENAME", "{rank}.pickle"),
            ("MEMSNAP_STATS", "../stats/mem-{rank}.csv"),
            ("MEMSNAP_FOLDER", "../snaps/{rank}/.cache"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(cfg.stats.as_deref(), Some("../stats/mem-{rank}.csv"));
        assert_eq!(cfg.folder, "../snaps/{rank}/.cache");
    }

    #[test]
    fn folder_and_stats_templates_are_validated_like_file_names() {
        let e = refused("MEMSNAP_FOLDER", "snaps/{rnak}");
        assert!(e.expected.contains("unknown placeholder {rnak}"), "{e}");
        refused("MEMSNAP_FOLDER", "snaps/{rank");
        let e = refused("MEMSNAP_STATS", "mem-{rnak}.csv");
        assert!(e.expected.contains("unknown placeholder {rnak}"), "{e}");
        // Per-file values mean nothing for a file opened once per process.
        let e = refused("MEMSNAP_STATS", "mem-{step}.csv");
        assert!(
            e.expected
                .contains("{rank}, {local_rank}, {pid}, {host}, {exe}"),
            "{e}"
        );
        let (cfg, errors) = parse(&[("MEMSNAP_FOLDER", "s/{host}/{rank}-{step}")]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(cfg.folder, "s/{host}/{rank}-{step}");
    }

    #[test]
    fn sanitized_values_never_make_dot_or_hidden_components() {
        for (raw, safe) in [
            ("..", "_."),
            (".", "_"),
            (".hidden", "_hidden"),
            ("../..", "_._.."),
            ("", "_"),
            ("a\nb,c", "a_b_c"),
            ("node1.cluster", "node1.cluster"),
            ("3", "3"),
        ] {
            assert_eq!(sanitize(raw), safe, "{raw:?}");
        }
        for raw in ["..", ".", "/", "../x", "", ".."] {
            for template in ["snaps/{rank}", "snaps/.{rank}", "snaps/{rank}.", "{rank}"] {
                let path = expand_template(template, |_| Some(sanitize(raw))).unwrap();
                assert!(
                    path.split('/')
                        .all(|c| c != "." && c != ".." && !c.is_empty()),
                    "{template} with {raw:?} gave {path}"
                );
            }
        }
    }

    #[test]
    fn ranks_follow_the_launchers_variables_in_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(ranks(env(&[]), 7), ("7".into(), "7".into()));
        assert_eq!(
            ranks(env(&[("SLURM_PROCID", "5"), ("SLURM_LOCALID", "1")]), 7),
            ("5".into(), "1".into())
        );
        assert_eq!(
            ranks(
                env(&[("RANK", "3"), ("PMI_RANK", "9"), ("LOCAL_RANK", " ")]),
                7
            ),
            ("3".into(), "3".into())
        );
    }

    #[test]
    fn templates_expand_and_name_the_missing_key() {
        let v = |k: &str| (k == "rank").then(|| "2".to_string());
        assert_eq!(expand_template("r{rank}-x", v), Ok("r2-x".to_string()));
        assert_eq!(
            expand_template("r{rank}-{step}", v),
            Err("step".to_string())
        );
        assert_eq!(expand_template("open{rank", v), Ok("open{rank".to_string()));
        assert_eq!(sanitize("node/7 a"), "node_7_a");
    }

    #[test]
    fn remote_templates_are_file_or_object_store_urls_with_known_placeholders() {
        let (cfg, errors) = parse(&[
            (
                "MEMSNAP_REMOTE",
                "file:///snaps/r{rank}/{reason}-{seq}.pickle",
            ),
            ("MEMSNAP_REMOTE_ONLY", "1"),
            ("MEMSNAP_REMOTE_WAIT", "2s"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            cfg.remote.as_deref(),
            Some("file:///snaps/r{rank}/{reason}-{seq}.pickle")
        );
        assert!(cfg.remote_only);
        assert_eq!(cfg.remote_wait, Duration::from_secs(2));
        for bad in [
            "/snaps/x.pickle",
            "gs://bucket",
            "az://{rank}/x.pickle",
            "gs://b/run/../x.pickle",
            "az://c/run/.hidden",
            "azure://c/x.pickle",
            "abfs://c/x.pickle",
            "s3://bucket",
            "s3://{rank}/x.pickle",
            "s3:///x.pickle",
            "ftp://host/x",
            "file://relative/x.pickle",
            "file:///snaps/../etc/x",
            "file:///snaps/",
            "file:///snaps/.hidden",
            "file:///snaps/{nope}.pickle",
        ] {
            let (cfg, errors) = parse(&[("MEMSNAP_REMOTE", bad)]);
            assert_eq!(cfg.remote, None, "{bad}");
            assert_eq!(errors.len(), 1, "{bad}");
            assert!(errors[0].to_string().contains("MEMSNAP_REMOTE"), "{bad}");
        }
        for good in [
            "s3://b/run/{rank}.pickle",
            "gs://my.bucket/run/r{rank}/{reason}-{seq}.pickle",
            "az://snaps/{host}/{rank}.pickle",
        ] {
            let (cfg, errors) = parse(&[("MEMSNAP_REMOTE", good)]);
            assert!(errors.is_empty(), "{good}: {errors:?}");
            assert_eq!(cfg.remote.as_deref(), Some(good));
        }
        let (_, errors) = parse(&[("MEMSNAP_REMOTE", "abfs://c/{rank}.pickle")]);
        let message = errors[0].to_string();
        assert!(
            message.contains("MEMSNAP_REMOTE")
                && message.contains("gs://bucket/key")
                && message.contains("az://container/key"),
            "{message}"
        );
        let (cfg, errors) = parse(&[("MEMSNAP_REMOTE_WAIT", "2m")]);
        assert_eq!(errors.len(), 1);
        assert_eq!(cfg.remote_wait, Duration::from_secs(5));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("3 weeks"), None);
        assert_eq!(parse_duration("2d"), Some(Duration::from_secs(2 * 86_400)));
    }
}
