//! The caching allocator's settings as `PYTORCH_CUDA_ALLOC_CONF` writes them, and the
//! PyTorch release a file was recorded with. Parsing follows PyTorch's own parser
//! (`c10/core/AllocatorConfig.cpp`, `c10/cuda/CUDAAllocatorConfig.cpp`): tokens split at
//! `,` `:` `[` `]`, each key followed by `:` and its value; the rules are docs/WHATIF.md,
//! "Settings". Cold code.

use std::fmt;

pub const MIB: u64 = 1 << 20;
/// Every size is rounded up to a multiple of this, and no block is smaller (`kMinBlockSize`).
pub const MIN_BLOCK: u64 = 512;
/// The largest request served from the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = MIB;
/// The size of a small-pool segment, and an expandable small segment's page (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Requests below this get a segment of `large_segment_size` (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Larger requests get a segment of their size rounded up to this (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 * MIB;
/// The default large segment (`kLargeBuffer`), and the default of `max_non_split_rounding`.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// `roundup_power2_divisions` has one entry per power of two from 1 MiB to 64 GiB.
pub const ROUNDUP_INTERVALS: usize = 16;

/// Which allocator PyTorch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The caching allocator (`backend:native`, the default).
    Native,
    /// `backend:cudaMallocAsync`: each tensor is a CUDA stream-ordered allocation.
    CudaMallocAsync,
}

/// The settings the model follows.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub backend: Backend,
    /// Blocks at least this large are never split (`max_split_size_mb`; `u64::MAX`: unlimited).
    pub max_split_size: u64,
    /// How much larger than the request an oversize cached block may be
    /// (`max_non_split_rounding_mb`).
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval (`roundup_power2_divisions`; 0 or 1: none).
    pub roundup_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold` (0: off).
    pub garbage_collection_threshold: f64,
    pub expandable_segments: bool,
    /// The segment of a request between 1 and 10 MiB, and an expandable large segment's page
    /// (`large_segment_size_mb`).
    pub large_segment_size: u64,
    /// `per_process_memory_fraction` (1: no limit of PyTorch's own).
    pub memory_fraction: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            backend: Backend::Native,
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_segment_size: LARGE_BUFFER,
            memory_fraction: 1.0,
        }
    }
}

/// A PyTorch release, `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Release {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for Release {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The releases whose allocator the model follows (the ones memsnap records blocks of).
pub const OLDEST: Release = Release { major: 2, minor: 4 };
pub const NEWEST: Release = Release {
    major: 2,
    minor: 15,
};
/// The first release known to take `large_segment_size_mb`, `max_non_split_rounding_mb`
/// and `per_process_memory_fraction` (their keys are in its headers).
pub const NEWER_KEYS: Release = Release {
    major: 2,
    minor: 11,
};

impl Release {
    /// `2.11.0+cu130` → 2.11.
    pub fn parse(text: &str) -> Option<Release> {
        let mut it = text.trim().split(['.', '+']);
        let major = it.next()?.parse().ok()?;
        let minor = it.next()?.parse().ok()?;
        Some(Release { major, minor })
    }
    pub fn modelled(self) -> bool {
        (OLDEST..=NEWEST).contains(&self)
    }
}

/// PyTorch's tokens: `,` `:` `[` `]` alone, runs of anything else, spaces dropped.
fn tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if matches!(c, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(c.to_string());
        } else if !c.is_whitespace() {
            word.push(c);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

struct Cursor {
    toks: Vec<String>,
    i: usize,
}

impl Cursor {
    fn next(&mut self) -> Option<&str> {
        let t = self.toks.get(self.i)?;
        self.i += 1;
        Some(t)
    }
    fn expect(&mut self, want: &str, key: &str) -> Result<(), String> {
        match self.next() {
            Some(t) if t == want => Ok(()),
            other => Err(format!(
                "{key}: expected `{want}`, found {}",
                other.map_or("the end".to_string(), |t| format!("`{t}`"))
            )),
        }
    }
    fn value(&mut self, key: &str) -> Result<String, String> {
        self.expect(":", key)?;
        self.next()
            .map(str::to_string)
            .ok_or_else(|| format!("{key}: no value"))
    }
}

fn number(key: &str, v: &str) -> Result<u64, String> {
    v.parse()
        .map_err(|_| format!("{key}: `{v}` is not a whole number"))
}

/// `key`'s value, a whole number of MiB, in bytes; refused below `min_mb`.
fn mib_at_least(key: &str, v: &str, min_mb: u64) -> Result<u64, String> {
    let mb = number(key, v)?;
    if mb < min_mb {
        return Err(format!("{key} must be >= {min_mb}"));
    }
    Ok(mb.saturating_mul(MIB))
}

fn boolean(key: &str, v: &str) -> Result<bool, String> {
    match v {
        "True" | "true" => Ok(true),
        "False" | "false" => Ok(false),
        _ => Err(format!("{key}: `{v}` is not True or False")),
    }
}

/// Keys that change nothing the model follows (host memory, locking, IPC).
const NO_EFFECT: &[&str] = &[
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_register_threads",
];

impl Settings {
    /// The settings after `text` (a `PYTORCH_CUDA_ALLOC_CONF` value) is applied on top of
    /// these: the keys it names change, the others stay. Notes go to `notes`; a key the
    /// model does not follow, or a value PyTorch refuses, is an error naming it.
    pub fn with(
        &self,
        text: &str,
        release: Release,
        notes: &mut Vec<String>,
    ) -> Result<Settings, String> {
        let mut s = self.clone();
        let mut c = Cursor {
            toks: tokens(text),
            i: 0,
        };
        let newer = |key: &str| -> Result<(), String> {
            if release < NEWER_KEYS {
                Err(format!(
                    "{key} is not known to exist in PyTorch {release} (it is in {NEWER_KEYS})"
                ))
            } else {
                Ok(())
            }
        };
        while let Some(key) = c.next().map(str::to_string) {
            if key == "," {
                continue;
            }
            match key.as_str() {
                "backend" => {
                    s.backend = match c.value(&key)?.as_str() {
                        "native" => Backend::Native,
                        "cudaMallocAsync" => Backend::CudaMallocAsync,
                        v => {
                            return Err(format!("backend: `{v}` is not native or cudaMallocAsync"));
                        }
                    }
                }
                "max_split_size_mb" => {
                    s.max_split_size = mib_at_least(&key, &c.value(&key)?, LARGE_BUFFER / MIB)?;
                }
                "max_non_split_rounding_mb" => {
                    newer(&key)?;
                    s.max_non_split_rounding =
                        mib_at_least(&key, &c.value(&key)?, LARGE_BUFFER / MIB)?;
                }
                "large_segment_size_mb" => {
                    newer(&key)?;
                    let mb = number(&key, &c.value(&key)?)?;
                    if mb <= MIN_LARGE_ALLOC / MIB {
                        return Err(format!(
                            "large_segment_size_mb must be > {}",
                            MIN_LARGE_ALLOC / MIB
                        ));
                    }
                    s.large_segment_size = mb.saturating_mul(MIB);
                }
                "garbage_collection_threshold" => {
                    let v = c.value(&key)?;
                    let t: f64 = v
                        .parse()
                        .map_err(|_| format!("{key}: `{v}` is not a number"))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err("garbage_collection_threshold must be in (0.0, 1.0)".into());
                    }
                    s.garbage_collection_threshold = t;
                }
                "per_process_memory_fraction" => {
                    newer(&key)?;
                    let v = c.value(&key)?;
                    let f: f64 = v
                        .parse()
                        .map_err(|_| format!("{key}: `{v}` is not a number"))?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err("per_process_memory_fraction must be in [0.0, 1.0]".into());
                    }
                    s.memory_fraction = f;
                }
                "expandable_segments" => {
                    s.expandable_segments = boolean(&key, &c.value(&key)?)?;
                }
                "roundup_power2_divisions" => {
                    s.roundup_divisions = roundup(&mut c)?;
                }
                k if NO_EFFECT.contains(&k) => {
                    let _ = c.value(&key)?;
                    notes.push(format!(
                        "{k} changes nothing the model follows (device memory)"
                    ));
                }
                k => {
                    return Err(format!(
                        "{k} is not a setting the model follows (docs/WHATIF.md, \"Settings\")"
                    ));
                }
            }
        }
        if s.garbage_collection_threshold > 0.0 && s.memory_fraction >= 1.0 {
            notes.push(
                "garbage_collection_threshold acts only under a memory fraction \
                 (per_process_memory_fraction or torch.cuda.set_per_process_memory_fraction): \
                 without one it changes nothing"
                    .into(),
            );
        }
        Ok(s)
    }

    /// The settings a file recorded: `allocator_settings` (PyTorch's own keys, or the
    /// `PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` text memsnap copies from the
    /// environment).
    pub fn recorded(
        conf: &str,
        release: Release,
        notes: &mut Vec<String>,
    ) -> Result<Settings, String> {
        Settings::default().with(conf, release, notes)
    }

    /// `round_size`: the block size a request of `size` bytes gets.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        let divisions = self.divisions_for(size);
        if divisions > 1 && size > MIN_BLOCK * divisions {
            roundup_power2_next_division(size, divisions)
        } else {
            size.div_ceil(MIN_BLOCK) * MIN_BLOCK
        }
    }

    /// The divisions for `size`'s interval: one per power of two from 1 MiB, the last one
    /// for everything from 32 GiB on.
    fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - u64::from(size.leading_zeros());
        let start = 20; // log2(1 MiB)
        let index = (log.saturating_sub(start) as usize).min(ROUNDUP_INTERVALS - 1);
        self.roundup_divisions[index]
    }

    /// `get_allocation_size`: the segment a request of (rounded) `size` asks CUDA for.
    pub fn allocation_size(&self, size: u64) -> u64 {
        if size <= SMALL_SIZE {
            SMALL_BUFFER
        } else if size < MIN_LARGE_ALLOC {
            self.large_segment_size
        } else {
            size.div_ceil(ROUND_LARGE) * ROUND_LARGE
        }
    }
}

/// `roundup_power2_next_division`: `size` rounded up to the next of `divisions` equal steps
/// between the powers of two around it.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    // The divisions' own power of two floor divides the interval.
    let shift = 63 - divisions.leading_zeros();
    let step = floor >> shift;
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size { size } else { down + step }
}

/// `roundup_power2_divisions:N` (every interval) or `[256:4,512:2,>:1]` (per interval, in
/// MiB; the first value also fills the intervals below it, `>` the ones above the last).
fn roundup(c: &mut Cursor) -> Result<[u64; ROUNDUP_INTERVALS], String> {
    const KEY: &str = "roundup_power2_divisions";
    let mut out = [0u64; ROUNDUP_INTERVALS];
    c.expect(":", KEY)?;
    let first = c
        .next()
        .ok_or_else(|| format!("{KEY}: no value"))?
        .to_string();
    if first != "[" {
        let v = number(KEY, &first)?;
        if !v.is_power_of_two() {
            return Err(format!("{KEY}: the divisions must be a power of 2"));
        }
        return Ok([v; ROUNDUP_INTERVALS]);
    }
    let mut first_value = true;
    let mut last_index = 0usize;
    loop {
        let bound = c
            .next()
            .ok_or_else(|| format!("{KEY}: no closing `]`"))?
            .to_string();
        if bound == "]" {
            break;
        }
        if bound == "," {
            continue;
        }
        let v = number(KEY, &c.value(KEY)?)?;
        if v != 0 && !v.is_power_of_two() {
            return Err(format!("{KEY}: the divisions must be a power of 2 or 0"));
        }
        if bound == ">" {
            for slot in out.iter_mut().skip(last_index + 1) {
                *slot = v;
            }
        } else {
            let mb = number(KEY, &bound)?;
            if !mb.is_power_of_two() {
                return Err(format!("{KEY}: the intervals must be powers of 2"));
            }
            let index = (63 - mb.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if first_value {
                for slot in out.iter_mut().take(index) {
                    *slot = v;
                }
                first_value = false;
            }
            out[index] = v;
            last_index = index;
        }
    }
    Ok(out)
}

impl fmt::Display for Settings {
    /// The settings that differ from PyTorch's defaults, as `PYTORCH_CUDA_ALLOC_CONF`
    /// writes them (empty: all defaults).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = Settings::default();
        let mut parts: Vec<String> = Vec::new();
        if self.backend == Backend::CudaMallocAsync {
            parts.push("backend:cudaMallocAsync".into());
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        }
        if self.max_split_size != d.max_split_size {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size / MIB));
        }
        if self.max_non_split_rounding != d.max_non_split_rounding {
            parts.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding / MIB
            ));
        }
        if self.large_segment_size != d.large_segment_size {
            parts.push(format!(
                "large_segment_size_mb:{}",
                self.large_segment_size / MIB
            ));
        }
        if self.garbage_collection_threshold != 0.0 {
            parts.push(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        if self.memory_fraction < 1.0 {
            parts.push(format!(
                "per_process_memory_fraction:{}",
                self.memory_fraction
            ));
        }
        if self.roundup_divisions != d.roundup_divisions {
            let list: Vec<String> = self
                .roundup_divisions
                .iter()
                .enumerate()
                .map(|(i, v)| format!("{}:{v}", 1u64 << i))
                .collect();
            parts.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
        }
        write!(f, "{}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Release = Release {
        major: 2,
        minor: 11,
    };

    fn parse(text: &str) -> Result<Settings, String> {
        Settings::default().with(text, R, &mut Vec::new())
    }

    #[test]
    fn keys_combine_and_values_are_checked_as_pytorch_does() {
        let s = parse("expandable_segments:True, max_split_size_mb:128").unwrap();
        assert!(s.expandable_segments);
        assert_eq!(s.max_split_size, 128 * MIB);
        assert_eq!(parse("").unwrap(), Settings::default());
        assert!(parse("max_split_size_mb:10").unwrap_err().contains(">= 20"));
        assert!(parse("expandable_segments:yes").is_err());
        assert!(parse("garbage_collection_threshold:1.5").is_err());
        assert!(parse("nonsense:1").unwrap_err().contains("nonsense"));
        assert_eq!(
            parse("backend:cudaMallocAsync").unwrap().backend,
            Backend::CudaMallocAsync
        );
        // A key newer than the release is refused.
        let old = Release { major: 2, minor: 6 };
        assert!(
            Settings::default()
                .with("large_segment_size_mb:40", old, &mut Vec::new())
                .unwrap_err()
                .contains("2.6")
        );
        // On top of other settings: the keys named change, the others stay.
        let both = parse("expandable_segments:True")
            .unwrap()
            .with("max_split_size_mb:200", R, &mut Vec::new())
            .unwrap();
        assert!(both.expandable_segments && both.max_split_size == 200 * MIB);
        assert_eq!(
            both.to_string(),
            "expandable_segments:True,max_split_size_mb:200"
        );
    }

    #[test]
    fn rounding_follows_round_size() {
        let d = Settings::default();
        assert_eq!(d.round_size(1), 512);
        assert_eq!(d.round_size(512), 512);
        assert_eq!(d.round_size(513), 1024);
        // 4 divisions: 1200 → no rounding below 512 * 4 bytes; 5 MiB + 1 → 6 MiB.
        let s = parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(s.round_size(1200), 1536);
        assert_eq!(s.round_size(5 * MIB + 1), 6 * MIB);
        assert_eq!(s.round_size(4 * MIB), 4 * MIB);
        // The list form: 256 MiB and above in 2 steps, below it 4 (the first value fills
        // the intervals below), 1 GiB and above none.
        let l = parse("roundup_power2_divisions:[256:4,512:2,>:0]").unwrap();
        assert_eq!(l.roundup_divisions[0], 4);
        assert_eq!(l.roundup_divisions[8], 4);
        assert_eq!(l.roundup_divisions[9], 2);
        assert_eq!(l.roundup_divisions[10], 0);
        assert_eq!(l.round_size(600 * MIB), 768 * MIB);
        assert_eq!(l.round_size(3 * MIB), 3 * MIB);
        assert_eq!(d.allocation_size(MIB), 2 * MIB);
        assert_eq!(d.allocation_size(MIB + 512), 20 * MIB);
        assert_eq!(d.allocation_size(10 * MIB), 10 * MIB);
        assert_eq!(d.allocation_size(11 * MIB + 1), 12 * MIB);
        assert_eq!(Release::parse("2.11.0+cu130"), Some(R));
        // PyTorch's own example: each interval's divisions by the size it holds.
        let p = parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]").unwrap();
        let at = |mib: u64| p.divisions_for(mib * MIB);
        assert_eq!(
            [
                at(1),
                at(32),
                at(64),
                at(128),
                at(256),
                at(512),
                at(1024),
                at(4096)
            ],
            [8, 8, 8, 2, 4, 2, 4, 1]
        );
    }
}
