//! Every `MEMSNAP_*` variable, parsed once, with its default in one place.
//!
//! Cold code. The preload library parses the environment once, on the first CUDA event
//! (a process that never touches CUDA never reads or prints anything); `memsnap run`
//! uses the same names to turn its options into variables. A bad value produces one
//! message naming the variable and what it accepts, and the default is used instead.

use std::time::Duration;

/// Names of every variable memsnap reads. The README documents each of them.
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
    pub const PERIOD: &str = "MEMSNAP_PERIOD";
    pub const STATS: &str = "MEMSNAP_STATS";
    pub const AT_CRASH: &str = "MEMSNAP_AT_CRASH";
    pub const CRASH_WAIT: &str = "MEMSNAP_CRASH_WAIT";
}

/// The longest `MEMSNAP_CRASH_WAIT`: a dying job should not hang on its snapshot.
pub const MAX_CRASH_WAIT: Duration = Duration::from_secs(60);

/// Hard upper bound on captured frames per stack (native and Python each); the event
/// slots are sized for it, `MEMSNAP_MAX_FRAMES` can only lower it.
pub const FRAME_CAPACITY: usize = 64;

/// Which stacks to capture, in PyTorch's words (`_record_memory_history(stacks=...)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stacks {
    None,
    Python,
    Native,
    All,
}

impl Stacks {
    pub fn python(self) -> bool {
        matches!(self, Stacks::Python | Stacks::All)
    }
    pub fn native(self) -> bool {
        matches!(self, Stacks::Native | Stacks::All)
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
    /// A snapshot every given duration. `None` = off.
    pub period: Option<Duration>,
    /// CSV file for per-step memory figures. `None` = off.
    pub stats: Option<String>,
    /// Borrow SIGTERM, SIGABRT, SIGSEGV and SIGBUS for a last snapshot.
    pub at_crash: bool,
    /// How long a terminating signal waits for its snapshot before the program goes on.
    pub crash_wait: Duration,
}

pub const DEFAULT_FILENAME: &str = "memsnap-{exe}-{host}-r{rank}-p{pid}-{reason}-{seq}.pickle";

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
            period: None,
            stats: None,
            at_crash: true,
            crash_wait: Duration::from_secs(5),
        }
    }
}

impl Config {
    /// Reads the process environment. Returns the configuration and one message per
    /// invalid variable (the caller prints them; the default was used for each).
    pub fn from_env() -> (Config, Vec<String>) {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Parses with an arbitrary lookup, so tests need not touch the real environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> (Config, Vec<String>) {
        let mut cfg = Config::default();
        let mut errors = Vec::new();
        let mut p = Parser {
            get: &get,
            errors: &mut errors,
        };

        cfg.disabled = p.flag(var::DISABLE, cfg.disabled);
        if let Some(v) = p.text(var::FOLDER) {
            cfg.folder = v;
        }
        if let Some(v) = p.text(var::FILENAME) {
            match validate_template(&v) {
                Ok(()) => cfg.filename = v,
                Err(msg) => p.bad(var::FILENAME, &v, &msg),
            }
        }
        cfg.overwrite = p.flag(var::OVERWRITE, cfg.overwrite);
        cfg.max_entries = p.count(var::MAX_ENTRIES, cfg.max_entries as u64, 1, 1 << 40) as usize;
        cfg.at_exit = p.flag(var::AT_EXIT, cfg.at_exit);
        cfg.on_oom = p.flag(var::ON_OOM, cfg.on_oom);
        if let Some(v) = p.text(var::SIGNAL) {
            match parse_signal(&v) {
                Some(s) => cfg.signal = s,
                None => p.bad(
                    var::SIGNAL,
                    &v,
                    "a signal name (USR1, USR2, SIGUSR1, ...), a number, or `none`",
                ),
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
        cfg.skip = p.count(var::SKIP, cfg.skip, 0, u64::MAX);
        cfg.interval = p.count(var::INTERVAL, cfg.interval, 0, u64::MAX);
        cfg.every = p.count(var::EVERY, cfg.every, 0, u64::MAX);
        if let Some(v) = p.text(var::PERIOD) {
            match parse_duration(&v) {
                Some(d) if d.is_zero() => cfg.period = None,
                Some(d) => cfg.period = Some(d),
                None => p.bad(
                    var::PERIOD,
                    &v,
                    "a duration such as 500ms, 30s, 5m or 1h (0 = off)",
                ),
            }
        }
        if let Some(v) = p.text(var::STATS) {
            cfg.stats = Some(v);
        }
        cfg.at_crash = p.flag(var::AT_CRASH, cfg.at_crash);
        if let Some(v) = p.text(var::CRASH_WAIT) {
            match parse_duration(&v) {
                Some(d) if d <= MAX_CRASH_WAIT => cfg.crash_wait = d,
                _ => p.bad(
                    var::CRASH_WAIT,
                    &v,
                    "a duration from 0s to 60s, such as 500ms or 5s",
                ),
            }
        }
        (cfg, errors)
    }
}

struct Parser<'a, F: Fn(&str) -> Option<String>> {
    get: &'a F,
    errors: &'a mut Vec<String>,
}

impl<F: Fn(&str) -> Option<String>> Parser<'_, F> {
    /// The variable's value, or `None` when unset or empty (empty means "default").
    fn text(&mut self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    fn bad(&mut self, name: &str, value: &str, accepted: &str) {
        self.errors.push(format!(
            "memsnap: ignoring {name}={value:?}: expected {accepted}; using the default"
        ));
    }

    fn flag(&mut self, name: &str, default: bool) -> bool {
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

    fn count(&mut self, name: &str, default: u64, min: u64, max: u64) -> u64 {
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

/// `USR1`, `SIGUSR1`, `usr2`, `10`, `none`. Returns `Some(None)` for `none`.
pub fn parse_signal(v: &str) -> Option<Option<i32>> {
    let up = v.trim().to_ascii_uppercase();
    if up == "NONE" || up == "OFF" || up == "0" {
        return Some(None);
    }
    if let Ok(n) = up.parse::<i32>() {
        return (1..=64).contains(&n).then_some(Some(n));
    }
    let name = up.strip_prefix("SIG").unwrap_or(&up);
    let sig = match name {
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "HUP" => libc::SIGHUP,
        "CONT" => libc::SIGCONT,
        "WINCH" => libc::SIGWINCH,
        "PWR" => libc::SIGPWR,
        "URG" => libc::SIGURG,
        _ => {
            let rt = name
                .strip_prefix("RTMIN+")
                .and_then(|n| n.parse::<i32>().ok())?;
            let sig = libc::SIGRTMIN() + rt;
            if sig > libc::SIGRTMAX() {
                return None;
            }
            sig
        }
    };
    Some(Some(sig))
}

/// `500ms`, `30s`, `5m`, `1h`, or a bare number of seconds.
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
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
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
    "time",
];

/// Checks that every `{...}` in a template names a known placeholder.
pub fn validate_template(t: &str) -> Result<(), String> {
    let mut rest = t;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err("a template whose braces are balanced".to_string());
        };
        let key = &after[..close];
        if !TEMPLATE_KEYS.contains(&key) {
            return Err(format!(
                "a template using only {{{}}} (unknown placeholder {{{key}}})",
                TEMPLATE_KEYS.join("}, {")
            ));
        }
        rest = &after[close + 1..];
    }
    if t.contains('/') {
        return Err("a file name without '/' (put directories in MEMSNAP_FOLDER)".to_string());
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

/// Keeps file names portable: letters, digits, `.`, `_`, `-`; anything else becomes `_`.
pub fn sanitize(s: &str) -> String {
    let out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
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

    fn parse(pairs: &[(&str, &str)]) -> (Config, Vec<String>) {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
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
            ("MEMSNAP_OVERWRITE", "yes"),
            ("MEMSNAP_PERIOD", "250ms"),
            ("MEMSNAP_FILENAME", "rank{rank}.{step}.pickle"),
        ]);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(cfg.max_entries, 5000);
        assert_eq!(cfg.signal, Some(libc::SIGUSR2));
        assert_eq!(cfg.stacks, Stacks::Python);
        assert_eq!(cfg.context, Context::All);
        assert!(cfg.overwrite);
        assert_eq!(cfg.period, Some(Duration::from_millis(250)));
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
        for (e, name) in errors.iter().zip([
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
    fn signal_none_disables() {
        let (cfg, errors) = parse(&[("MEMSNAP_SIGNAL", "none")]);
        assert!(errors.is_empty());
        assert_eq!(cfg.signal, None);
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
    fn durations() {
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("3 weeks"), None);
    }
}
