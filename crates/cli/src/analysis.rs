//! What the commands compute from a [`Snapshot`]: allocation sites, owning libraries,
//! per-device live/reserved/peak figures, and the state at an OOM.
//!
//! Cold code. Definitions (also printed by `memsnap summary --help`):
//! - *live*: blocks in state `active_allocated` (block sizes); *reserved*: Σ segment sizes.
//! - *peak*: the history is followed forward and anchored to the final state, in the units
//!   the trace uses (requested bytes: `alloc` carries the requested size), so a history
//!   capped by a ring buffer starts from the live state it implies instead of from zero
//!   (see `history.rs`).
//! - *site*: the innermost frame in user code: a Python `file:line` when the stack has a
//!   Python frame (library files under site-packages/dist-packages/the stdlib are skipped
//!   unless nothing else is there), else the first native frame outside the CUDA runtime,
//!   the allocator and PyTorch's filtered plumbing (docs/FORMAT.md#frames, filtering).
//!   `--ignore PATTERN` skips frames whose file or function contains PATTERN when choosing
//!   it; `--callers N` shows the N frames above it (the site's text then names them too,
//!   so sites are grouped by the whole chain).
//! - *at a moment* (`--at`): the live set then, from the history (`history.rs`), in
//!   requested bytes, beside the same figures at the end.

use crate::at::Resolved;
use crate::history::{EndBlock, History};
use crate::tally::{Tally, sorted};
use memsnap_format::model::{BlockState, Frame, Snapshot, StackId};
use rustc_hash::FxHashMap;
use serde::Serialize;

/// Who owns an allocation, from the innermost meaningful frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Library {
    Torch,
    Nccl,
    Cublas,
    Cudnn,
    Xla,
    Cupy,
    Cudart,
    Python,
    App,
    Unknown,
}

impl Library {
    pub fn as_str(self) -> &'static str {
        match self {
            Library::Torch => "torch",
            Library::Nccl => "nccl",
            Library::Cublas => "cublas",
            Library::Cudnn => "cudnn",
            Library::Xla => "xla",
            Library::Cupy => "cupy",
            Library::Cudart => "cudart",
            Library::Python => "python",
            Library::App => "app",
            Library::Unknown => "unknown",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SiteKind {
    Python,
    Native,
    None,
}

#[derive(Clone, Debug)]
pub struct Site {
    pub text: String,
    pub kind: SiteKind,
}

/// How the allocation site is chosen and shown: `--ignore` and `--callers`, the same for
/// every command.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Attribution {
    /// Skip frames whose file or function contains PATTERN when choosing the allocation
    /// site (repeatable): `--ignore pyalloc.py` blames the caller of a helper in pyalloc.py.
    #[arg(long = "ignore", value_name = "PATTERN")]
    pub ignore: Vec<String>,
    /// Show N frames above each allocation site (its callers), as `site <- caller <- ...`;
    /// sites are then grouped by the whole chain.
    #[arg(long, value_name = "N")]
    pub callers: Option<usize>,
}

impl Attribution {
    /// Whether `--ignore` names this frame (by a substring of its file or function).
    pub fn ignores(&self, f: &Frame) -> bool {
        self.ignore
            .iter()
            .any(|p| f.filename.contains(p.as_str()) || f.name.contains(p.as_str()))
    }
}

/// Between a site and its callers in a site's text.
pub const CALLER_SEPARATOR: &str = " <- ";

/// Sites and owners of every stack of one snapshot, computed once.
pub struct Sites {
    pub sites: Vec<Site>,
    site_of_stack: Vec<u32>,
    lib_of_stack: Vec<Library>,
    no_stack: u32,
    /// PyTorch's recorder sees only its caching allocator: every block there is torch's.
    all_torch: bool,
}

impl Sites {
    pub fn new(snap: &Snapshot, attr: &Attribution) -> Self {
        Self::of_stacks(&snap.frames, &snap.stacks, snap.memsnap.is_empty(), attr)
    }

    /// The same from frames and stacks alone (a live sample from `memsnap top`);
    /// `all_torch` for PyTorch's own files, whose every block is torch's.
    pub fn of_stacks(
        frames: &[Frame],
        stacks: &[Vec<u32>],
        all_torch: bool,
        attr: &Attribution,
    ) -> Self {
        let mut sites = Vec::new();
        let mut by_text: FxHashMap<String, u32> = FxHashMap::default();
        let mut intern = |s: Site| -> u32 {
            if let Some(&i) = by_text.get(&s.text) {
                return i;
            }
            let i = sites.len() as u32;
            by_text.insert(s.text.clone(), i);
            sites.push(s);
            i
        };
        let no_stack = intern(Site {
            text: "<no frames recorded>".into(),
            kind: SiteKind::None,
        });
        let mut site_of_stack = Vec::with_capacity(stacks.len());
        let mut lib_of_stack = Vec::with_capacity(stacks.len());
        for st in stacks {
            let frames: Vec<&Frame> = st.iter().filter_map(|&f| frames.get(f as usize)).collect();
            site_of_stack.push(intern(site_of(&frames, attr)));
            lib_of_stack.push(library_of(&frames));
        }
        Sites {
            sites,
            site_of_stack,
            lib_of_stack,
            no_stack,
            all_torch,
        }
    }
    pub fn site(&self, stack: Option<StackId>) -> u32 {
        stack
            .and_then(|s| self.site_of_stack.get(s as usize).copied())
            .unwrap_or(self.no_stack)
    }
    pub fn library(&self, stack: Option<StackId>) -> Library {
        if self.all_torch {
            return Library::Torch;
        }
        stack
            .and_then(|s| self.lib_of_stack.get(s as usize).copied())
            .unwrap_or(Library::Unknown)
    }
    pub fn text(&self, site: u32) -> &str {
        &self.sites[site as usize].text
    }
}

pub fn is_python_frame(f: &Frame) -> bool {
    f.filename.ends_with(".py") || (f.filename.starts_with('<') && f.filename.ends_with('>'))
}

/// PyTorch's frame filter (`_memory_viz._frame_filter`, docs/FORMAT.md#frames).
pub fn is_hidden(f: &Frame) -> bool {
    const NAMES: &[&str] = &[
        "unwind::unwind",
        "CapturedTraceback::gather",
        "gather_with_cpp",
        "_start",
        "__libc_start_main",
        "PyEval_",
        "PyObject_",
        "PyFunction_",
    ];
    const FILES: &[&str] = &[
        "core/boxing",
        "/Register",
        "/Redispatch",
        "pythonrun.c",
        "Modules/main.c",
        "Objects/call.c",
        "Objects/methodobject.c",
        "pycore_ceval.h",
        "ceval.c",
        "cpython/abstract.h",
    ];
    NAMES.iter().any(|n| f.name.contains(n)) || FILES.iter().any(|n| f.filename.contains(n))
}

fn is_library_python_file(path: &str) -> bool {
    path.contains("/site-packages/")
        || path.contains("/dist-packages/")
        || path.contains("/lib/python3")
        || path.starts_with("<frozen")
}

/// CUDA runtime/driver entry points and memsnap's own hooks: never the interesting frame.
fn is_runtime(f: &Frame) -> bool {
    let file = f.filename.as_str();
    let n = f.name.as_str();
    let cuda_api = |p: &str| {
        n.strip_prefix(p)
            .and_then(|r| r.chars().next())
            .is_some_and(|c| c.is_ascii_uppercase())
    };
    file.contains("libcudart")
        || file.contains("libcuda.so")
        || file.contains("libmemsnap")
        || n.starts_with("memsnap::")
        || cuda_api("cuda")
        || cuda_api("cu")
}

/// Allocation plumbing inside PyTorch (the allocator, empty_* factories, dispatch glue).
fn is_allocator_plumbing(f: &Frame) -> bool {
    const P: &[&str] = &[
        "CachingAllocator",
        "at::detail::empty",
        "at::native::empty",
        "at::empty",
        "create_out",
        "set_output_raw_strided",
        "wrap_kernel_functor",
        "redispatch",
        "c10::Dispatcher",
        "c10::impl::",
        "at::_ops::empty",
        "AllocatorWrapper",
        "wrapper_CUDA",
        "TensorIteratorBase::",
        "resize_reduction",
        "resize_output",
    ];
    P.iter().any(|p| f.name.contains(p))
}

/// The site of a stack: the chosen frame's text, then its callers'.
fn site_of(frames: &[&Frame], attr: &Attribution) -> Site {
    match site_chain(frames, attr) {
        Some((chain, kind)) => Site {
            text: chain.join(CALLER_SEPARATOR),
            kind,
        },
        None => Site {
            text: if frames.is_empty() {
                "<no frames recorded>".into()
            } else {
                "<every frame matched --ignore>".into()
            },
            kind: SiteKind::None,
        },
    }
}

/// The site frame's text and its callers' (`--callers`, outward), or `None` when no frame
/// can be the site.
pub fn site_chain(frames: &[&Frame], attr: &Attribution) -> Option<(Vec<String>, SiteKind)> {
    let (at, kind) = choose_site(frames, attr)?;
    let mut chain = vec![frame_text(frames[at])];
    let callers = frames[at + 1..]
        .iter()
        .filter(|f| !is_hidden(f) && !attr.ignores(f))
        .filter(|f| kind != SiteKind::Python || is_python_frame(f))
        .take(attr.callers.unwrap_or(0));
    chain.extend(callers.map(|f| frame_text(f)));
    Some((chain, kind))
}

/// The index of the site frame: the innermost user Python frame, else the first native
/// frame outside the runtime and the allocator; frames `attr` ignores are never chosen.
fn choose_site(frames: &[&Frame], attr: &Attribution) -> Option<(usize, SiteKind)> {
    let usable = |f: &Frame| !attr.ignores(f);
    let py: Vec<usize> = (0..frames.len())
        .filter(|&i| is_python_frame(frames[i]) && usable(frames[i]))
        .collect();
    if let Some(&i) = py
        .iter()
        .find(|&&i| !is_library_python_file(&frames[i].filename))
        .or_else(|| py.first())
    {
        return Some((i, SiteKind::Python));
    }
    let first = |ok: &dyn Fn(&Frame) -> bool| frames.iter().position(|f| usable(f) && ok(f));
    first(&|f| !is_hidden(f) && !is_runtime(f) && !is_allocator_plumbing(f))
        .or_else(|| first(&|f| !is_hidden(f)))
        .or_else(|| first(&|_| true))
        .map(|i| (i, SiteKind::Native))
}

/// One frame as a site names it: `file:line (function)` for Python, else [`native_text`].
pub fn frame_text(f: &Frame) -> String {
    if is_python_frame(f) {
        format!("{}:{} ({})", short_path(&f.filename), f.line, f.name)
    } else {
        native_text(f)
    }
}

/// Drops the part of a path up to site-packages/dist-packages: `torch/nn/modules/linear.py`.
pub fn short_path(path: &str) -> &str {
    for m in ["/site-packages/", "/dist-packages/"] {
        if let Some(i) = path.rfind(m) {
            return &path[i + m.len()..];
        }
    }
    path
}

/// A native frame as one short line: the function without arguments or template
/// parameters (and the `+0x..` offset when it was named from a symbol table), then the file
/// (base name) and line when known. A frame named `library+0x..` (no symbol) is not
/// followed by its library again.
pub fn native_text(f: &Frame) -> String {
    let (name, offset) = split_offset(&f.name);
    let mut s = simplify_cpp(name);
    s.push_str(offset);
    let file = f.filename.rsplit('/').next().unwrap_or("");
    if !file.is_empty()
        && file != "??"
        && !(s.starts_with(file) && s[file.len()..].starts_with("+0x"))
    {
        if f.line > 0 {
            s.push_str(&format!(" ({file}:{})", f.line));
        } else {
            s.push_str(&format!(" ({file})"));
        }
    }
    s
}

/// `foo(int)+0x1a` → (`foo(int)`, `+0x1a`); a name without such an offset is returned whole.
fn split_offset(name: &str) -> (&str, &str) {
    match name.rfind("+0x") {
        Some(i) if name.len() > i + 3 && name[i + 3..].bytes().all(|b| b.is_ascii_hexdigit()) => {
            name.split_at(i)
        }
        _ => (name, ""),
    }
}

/// `void at::native::f<float, 4>(at::Tensor const&)` → `at::native::f`.
pub fn simplify_cpp(name: &str) -> String {
    let n = name.replace("(anonymous namespace)", "{anon}");
    let mut out = String::with_capacity(n.len());
    let mut depth = 0usize;
    for c in n.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth = depth.saturating_sub(1),
            '(' if depth == 0 && !out.ends_with("operator") => break,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    // A leading return type (`void `, `at::Tensor `) is separated by a space at depth 0.
    let out = match out.rsplit_once(' ') {
        Some((_, last)) if !last.is_empty() && !out.contains("operator") => last.to_string(),
        _ => out,
    };
    if out.is_empty() {
        name.to_string()
    } else {
        out
    }
}

fn frame_library(f: &Frame) -> Option<Library> {
    let file = f.filename.to_ascii_lowercase();
    let n = f.name.as_str();
    let nl = n.to_ascii_lowercase();
    let has = |s: &str| file.contains(s) || nl.contains(s);
    if is_python_frame(f) {
        return Some(if file.contains("/torch/") {
            Library::Torch
        } else if file.contains("/cupy/") || file.contains("/cupy_backends/") {
            Library::Cupy
        } else if file.contains("/jax/") || file.contains("/jaxlib/") {
            Library::Xla
        } else if is_library_python_file(&f.filename) {
            Library::Python
        } else {
            Library::App
        });
    }
    Some(if has("nccl") {
        Library::Nccl
    } else if has("cublas") {
        Library::Cublas
    } else if has("cudnn") {
        Library::Cudnn
    } else if has("xla")
        || has("jaxlib")
        || n.starts_with("stream_executor::")
        || n.starts_with("tsl::")
    {
        Library::Xla
    } else if has("cupy") {
        Library::Cupy
    } else if file.contains("libtorch")
        || file.contains("libc10")
        || file.contains("/torch/")
        || [
            "c10::",
            "at::",
            "torch::",
            "caffe2::",
            "void at::",
            "void c10::",
        ]
        .iter()
        .any(|p| n.starts_with(p))
    {
        Library::Torch
    } else if file.contains("libpython") || n.starts_with("Py") || n.starts_with("_Py") {
        Library::Python
    } else if (file.is_empty() || file == "??")
        && (n == "??" || n.starts_with("0x") || n.starts_with('<'))
    {
        return None;
    } else {
        Library::App
    })
}

fn library_of(frames: &[&Frame]) -> Library {
    if frames.is_empty() {
        return Library::Unknown;
    }
    let mut saw_runtime = false;
    for f in frames {
        if is_runtime(f) {
            saw_runtime = true;
            continue;
        }
        if is_hidden(f) {
            continue;
        }
        if let Some(l) = frame_library(f) {
            return l;
        }
    }
    if saw_runtime {
        Library::Cudart
    } else {
        Library::Unknown
    }
}

pub struct OomInfo {
    pub event: usize,
    pub requested: i64,
    pub device_free: Option<i64>,
    pub time_us: i64,
    pub site: u32,
    pub library: Library,
    /// Live (requested bytes, allocations) at that moment, and reserved bytes.
    pub live: Tally,
    pub reserved: i64,
    pub holders: Vec<(u32, Tally)>,
}

pub struct DeviceStats {
    pub device: i64,
    pub live: Tally,
    pub live_requested: i64,
    pub pending_free: Tally,
    pub reserved: Tally,
    pub events: usize,
    pub start_live_requested: i64,
    pub peak_live_requested: i64,
    /// Index of the event after which the peak was reached; `None` = before the first.
    pub peak_after_event: Option<usize>,
    pub start_reserved: i64,
    pub peak_reserved: i64,
    pub by_site: FxHashMap<u32, Tally>,
    pub by_library: FxHashMap<Library, Tally>,
    pub ooms: Vec<OomInfo>,
    /// The live set at the moment `--at` asked for, with the end beside it.
    pub at: AtInfo,
}

/// The live set at one moment, by site and library, in requested bytes; the end's in the
/// same units beside it.
pub struct AtInfo {
    pub moment: Resolved,
    pub live: Tally,
    pub reserved: i64,
    pub by_site: FxHashMap<u32, Tally>,
    pub by_library: FxHashMap<Library, Tally>,
    pub end_by_site: FxHashMap<u32, Tally>,
    pub end_by_library: FxHashMap<Library, Tally>,
}

impl AtInfo {
    fn new(sites: &Sites, at: crate::history::AtState, end: &[EndBlock]) -> Self {
        let mut info = AtInfo {
            moment: at.moment,
            live: Tally::default(),
            reserved: at.reserved,
            by_site: FxHashMap::default(),
            by_library: FxHashMap::default(),
            end_by_site: FxHashMap::default(),
            end_by_library: FxHashMap::default(),
        };
        for (stack, t) in &at.holders {
            info.live.merge(*t);
            info.by_site
                .entry(sites.site(*stack))
                .or_default()
                .merge(*t);
            info.by_library
                .entry(sites.library(*stack))
                .or_default()
                .merge(*t);
        }
        for b in end {
            info.end_by_site
                .entry(sites.site(b.stack))
                .or_default()
                .add(b.requested);
            info.end_by_library
                .entry(sites.library(b.stack))
                .or_default()
                .add(b.requested);
        }
        info
    }
}

/// Every active block of `device` in the snapshot (what is live after the last event).
pub fn end_blocks(snap: &Snapshot, device: i64) -> Vec<EndBlock> {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.state.is_active())
        .map(|b| EndBlock {
            address: b.address,
            requested: b.requested_size,
            stack: b.stack,
        })
        .collect()
}

/// Reserved bytes of `device` in the snapshot.
pub fn end_reserved(snap: &Snapshot, device: i64) -> i64 {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .map(|s| s.total_size)
        .sum()
}

/// Every device that appears in segments or has trace entries (`events[d]` of them), in
/// order.
pub fn devices(snap: &Snapshot, events: impl IntoIterator<Item = usize>) -> Vec<i64> {
    let mut d: Vec<i64> = snap.segments.iter().map(|s| s.device).collect();
    d.extend(
        events
            .into_iter()
            .zip(0i64..)
            .filter(|&(n, _)| n > 0)
            .map(|(_, i)| i),
    );
    d.sort_unstable();
    d.dedup();
    d
}

/// The history of `device` (an empty one for a device without entries).
pub fn history_of(histories: &[History], device: i64) -> std::borrow::Cow<'_, History> {
    usize::try_from(device)
        .ok()
        .and_then(|d| histories.get(d))
        .map_or_else(Default::default, std::borrow::Cow::Borrowed)
}

pub fn device_stats(snap: &Snapshot, sites: &Sites, device: i64, hist: &History) -> DeviceStats {
    let mut st = DeviceStats {
        device,
        live: Tally::default(),
        live_requested: 0,
        pending_free: Tally::default(),
        reserved: Tally::default(),
        events: hist.events,
        start_live_requested: 0,
        peak_live_requested: 0,
        peak_after_event: None,
        start_reserved: 0,
        peak_reserved: 0,
        by_site: FxHashMap::default(),
        by_library: FxHashMap::default(),
        ooms: Vec::new(),
        at: AtInfo::new(sites, crate::history::AtState::empty(), &[]),
    };
    let mut active_requested = 0i64;
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        st.reserved.add(seg.total_size);
        for b in &seg.blocks {
            match b.state {
                BlockState::ActiveAllocated => {
                    st.live.add(b.size);
                    st.live_requested += b.requested_size;
                    active_requested += b.requested_size;
                    st.by_site
                        .entry(sites.site(b.stack))
                        .or_default()
                        .add(b.size);
                    st.by_library
                        .entry(sites.library(b.stack))
                        .or_default()
                        .add(b.size);
                }
                BlockState::ActivePendingFree => {
                    st.pending_free.add(b.size);
                    active_requested += b.requested_size;
                }
                BlockState::Inactive => {}
            }
        }
    }
    let end_blocks = end_blocks(snap, device);
    st.at = AtInfo::new(
        sites,
        hist.at_with_end(&end_blocks, st.reserved.bytes),
        &end_blocks,
    );
    // The state after the last entry is the snapshot itself.
    st.start_live_requested = hist.start_live(active_requested);
    (st.peak_live_requested, st.peak_after_event) = hist.peak_live(active_requested);
    st.start_reserved = hist.start_reserved(st.reserved.bytes);
    st.peak_reserved = hist.peak_reserved(st.reserved.bytes);
    st.ooms = hist
        .ooms_with_end(&end_blocks, st.reserved.bytes)
        .into_iter()
        .map(|o| {
            let mut by_site: FxHashMap<u32, Tally> = FxHashMap::default();
            let mut total = Tally::default();
            for (stack, t) in &o.holders {
                by_site.entry(sites.site(*stack)).or_default().merge(*t);
                total.merge(*t);
            }
            OomInfo {
                event: o.oom.event,
                requested: o.oom.requested,
                device_free: o.oom.device_free,
                time_us: o.oom.time_us,
                site: sites.site(o.oom.stack),
                library: sites.library(o.oom.stack),
                live: total,
                reserved: o.reserved,
                holders: sorted(&by_site),
            }
        })
        .collect();
    st
}

/// Trace events of `device` the file's history cap dropped (memsnap's per-device
/// `history_dropped`); `None` when the file does not say (PyTorch's files).
pub fn history_dropped(snap: &Snapshot, device: i64) -> Option<i64> {
    use memsnap_format::model::Meta;
    let Some(Meta::List(devices)) = snap.meta("devices") else {
        return None;
    };
    devices.iter().find_map(|d| {
        let Meta::Dict(kv) = d else { return None };
        let get = |key: &str| {
            kv.iter().find_map(|(k, v)| match v {
                Meta::Int(i) if k == key => Some(*i),
                _ => None,
            })
        };
        (get("device") == Some(device)).then(|| get("history_dropped"))?
    })
}

/// `history capped: kept N of M events` when the cap dropped any, else `None`.
pub fn capped_label(kept: usize, dropped: Option<i64>) -> Option<String> {
    let dropped = dropped.filter(|&d| d > 0)?;
    Some(format!(
        "history capped: kept {kept} of {} events",
        kept as i64 + dropped
    ))
}

/// Live bytes by site over all devices (for diff and ranks).
pub fn live_by_site(snap: &Snapshot, sites: &Sites) -> FxHashMap<u32, Tally> {
    let mut m: FxHashMap<u32, Tally> = FxHashMap::default();
    for seg in &snap.segments {
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
        {
            m.entry(sites.site(b.stack)).or_default().add(b.size);
        }
    }
    m
}

/// `1.5 GiB`, `512 B`: binary units, one decimal.
pub fn fmt_bytes(b: i64) -> String {
    let sign = if b < 0 { "-" } else { "" };
    let a = b.unsigned_abs() as f64;
    const U: &[&str] = &["KiB", "MiB", "GiB", "TiB", "PiB"];
    if a < 1024.0 {
        return format!("{b} B");
    }
    let mut v = a / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < U.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{sign}{v:.1} {}", U[u])
}

/// Parses a size: `1000`, `64MB` (10^6 bytes each), `64MiB` (2^20), `1.5GB`, `2GiB`,
/// `512kB`, `1TiB`. A bare `64M` is refused as ambiguous.
pub fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 1000, 64MB, 64MiB, 2GiB)"))?;
    let unit = unit.trim();
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "k" | "m" | "g" | "t" => {
            return Err(format!(
                "{s:?} is ambiguous: write {num}{u}B ({}) or {num}{u}iB ({})",
                match unit.to_ascii_lowercase().as_str() {
                    "k" => "10^3 bytes",
                    "m" => "10^6 bytes",
                    "g" => "10^9 bytes",
                    _ => "10^12 bytes",
                },
                match unit.to_ascii_lowercase().as_str() {
                    "k" => "2^10 bytes",
                    "m" => "2^20 bytes",
                    "g" => "2^30 bytes",
                    _ => "2^40 bytes",
                },
                u = unit.to_ascii_uppercase(),
            ));
        }
        _ => {
            return Err(format!(
                "{s:?}: unknown unit (use B, kB, MB, GB, TB for powers of 1000, or KiB, MiB, GiB, TiB for powers of 1024)"
            ));
        }
    };
    let bytes = v * mult;
    if !bytes.is_finite() || bytes > i64::MAX as f64 {
        return Err(format!("{s:?}: too large"));
    }
    Ok(bytes.round() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use memsnap_format::model::Action;

    fn fr(name: &str, file: &str, line: i64) -> Frame {
        Frame {
            name: name.into(),
            filename: file.into(),
            line,
        }
    }

    #[test]
    fn site_prefers_user_python_then_native_outside_runtime() {
        let none = Attribution::default();
        let torch = fr(
            "forward",
            "/x/site-packages/torch/nn/modules/linear.py",
            125,
        );
        let user = fr("<module>", "/srv/job/train.py", 36);
        let s = site_of(&[&torch, &user], &none);
        assert_eq!(s.text, "/srv/job/train.py:36 (<module>)");
        let s = site_of(&[&torch], &none);
        assert_eq!(s.text, "torch/nn/modules/linear.py:125 (forward)");
        let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.12", 0);
        let alloc = fr(
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long)",
            "??",
            0,
        );
        let nccl = fr("ncclMemAlloc", "/usr/lib/libnccl.so.2", 0);
        let op = fr(
            "void at::native::gpu_reduce_kernel<float, 4>(at::TensorIterator&)",
            "Reduce.cuh",
            10,
        );
        assert_eq!(
            site_of(&[&rt, &nccl], &none).text,
            "ncclMemAlloc (libnccl.so.2)"
        );
        assert_eq!(
            site_of(&[&rt, &alloc, &op], &none).text,
            "at::native::gpu_reduce_kernel (Reduce.cuh:10)"
        );
        assert_eq!(library_of(&[&rt, &nccl]), Library::Nccl);
        assert_eq!(library_of(&[&rt, &alloc, &op]), Library::Torch);
        assert_eq!(library_of(&[&rt]), Library::Cudart);
        assert_eq!(
            library_of(&[&rt, &fr("main", "/src/app.cpp", 7)]),
            Library::App
        );
        assert_eq!(
            library_of(&[&rt, &fr("cublasLtMatmul", "libcublasLt.so.12", 0)]),
            Library::Cublas
        );
        assert_eq!(library_of(&[]), Library::Unknown);
    }

    #[test]
    fn ignore_moves_the_site_to_the_caller_and_callers_are_shown() {
        // A helper that every allocation goes through, as pyalloc.py's cuda_alloc.
        let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.13", 0);
        let helper = fr("cuda_alloc", "/srv/app/pyalloc.py", 12);
        let keeper = fr("remember_me", "/srv/app/main.py", 30);
        let outer = fr("<module>", "/srv/app/main.py", 41);
        let stack = [&rt, &helper, &keeper, &outer];
        let none = Attribution::default();
        assert_eq!(
            site_of(&stack, &none).text,
            "/srv/app/pyalloc.py:12 (cuda_alloc)"
        );
        let skip = Attribution {
            ignore: vec!["pyalloc.py".into()],
            callers: None,
        };
        assert_eq!(
            site_of(&stack, &skip).text,
            "/srv/app/main.py:30 (remember_me)"
        );
        // A function name matches too.
        let skip_fn = Attribution {
            ignore: vec!["cuda_alloc".into()],
            callers: None,
        };
        assert_eq!(
            site_of(&stack, &skip_fn).text,
            "/srv/app/main.py:30 (remember_me)"
        );
        let callers = Attribution {
            ignore: Vec::new(),
            callers: Some(2),
        };
        assert_eq!(
            site_of(&stack, &callers).text,
            "/srv/app/pyalloc.py:12 (cuda_alloc) <- /srv/app/main.py:30 (remember_me) <- /srv/app/main.py:41 (<module>)"
        );
        let both = Attribution {
            ignore: vec!["pyalloc.py".into()],
            callers: Some(5),
        };
        assert_eq!(
            site_of(&stack, &both).text,
            "/srv/app/main.py:30 (remember_me) <- /srv/app/main.py:41 (<module>)"
        );
        // Everything ignored: said so.
        let all = Attribution {
            ignore: vec!["/".into()],
            callers: None,
        };
        let s = site_of(&stack, &all);
        assert_eq!(
            (s.text.as_str(), s.kind),
            ("<every frame matched --ignore>", SiteKind::None)
        );
        // Native sites: the first frame outside the runtime that is not ignored.
        let op = fr(
            "at::native::addmm_out_cuda_impl(at::Tensor&)+0x4c",
            "/t/libtorch_cuda.so",
            0,
        );
        let app = fr("main", "/src/app.cpp", 7);
        assert_eq!(
            site_of(&[&rt, &op, &app], &none).text,
            "at::native::addmm_out_cuda_impl+0x4c (libtorch_cuda.so)"
        );
        let skip_torch = Attribution {
            ignore: vec!["libtorch".into()],
            callers: None,
        };
        assert_eq!(
            site_of(&[&rt, &op, &app], &skip_torch).text,
            "main (app.cpp:7)"
        );
    }

    #[test]
    fn native_frames_keep_their_symbol_offset_and_name_the_library_once() {
        let f = fr("cublasLtMatmul+0x3a7b20", "/usr/lib/libcublasLt.so.13", 0);
        assert_eq!(
            native_text(&f),
            "cublasLtMatmul+0x3a7b20 (libcublasLt.so.13)"
        );
        let f = fr("libcublas.so.13+0x1a2b3c", "/usr/lib/libcublas.so.13", 0);
        assert_eq!(native_text(&f), "libcublas.so.13+0x1a2b3c");
        let f = fr(
            "void at::f<int>(at::Tensor const&)+0x10",
            "/t/libtorch_cuda.so",
            0,
        );
        assert_eq!(native_text(&f), "at::f+0x10 (libtorch_cuda.so)");
        // `+0x` not followed by hex only is part of the name.
        let f = fr("operator+0xyz", "??", 0);
        assert_eq!(native_text(&f), "operator+0xyz");
    }

    #[test]
    fn sizes_format_and_parse() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 20), "3.0 MiB");
        assert_eq!(fmt_bytes(-(3 << 30)), "-3.0 GiB");
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        // MB is 10^6 bytes, MiB 2^20: what the units say.
        assert_eq!(parse_bytes("64MB"), Ok(64_000_000));
        assert_eq!(parse_bytes("64mb"), Ok(64_000_000));
        assert_eq!(parse_bytes("512kB"), Ok(512_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("2TiB"), Ok(2 << 40));
        let err = parse_bytes("1.5G").unwrap_err();
        assert!(
            err.contains("ambiguous") && err.contains("1.5GB") && err.contains("1.5GiB"),
            "{err}"
        );
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    /// A memsnap-style snapshot: one segment per live block, stacks `x.py:1`, `y.py:2`...
    fn snap_with(
        events: &[(Action, i64, i64, Option<StackId>)],
        live: &[(i64, i64, StackId)],
    ) -> Snapshot {
        use memsnap_format::model::{Meta, Segment, TraceEntry};
        let frames: Vec<Frame> = (0..4)
            .map(|i| fr("f", &format!("/app/s{i}.py"), i + 1))
            .collect();
        let entry =
            |(action, addr, size, stack): &(Action, i64, i64, Option<StackId>)| TraceEntry {
                action: action.clone(),
                addr: *addr,
                size: *size,
                stream: 0,
                time_us: 0,
                stack: *stack,
                device_free: (*action == Action::Oom).then_some(7),
                user_metadata: None,
            };
        Snapshot {
            frames,
            stacks: (0..4).map(|i| vec![i]).collect(),
            segments: live
                .iter()
                .map(|&(addr, size, st)| Segment::one_allocation(0, addr, size, Some(st)))
                .collect(),
            device_traces: vec![events.iter().map(entry).collect()],
            allocator_settings: vec![],
            memsnap: vec![("dropped_events".into(), Meta::Int(0))],
        }
    }

    #[test]
    fn oom_holders_are_the_live_set_at_the_oom_not_at_the_end() {
        use Action::*;
        // A (s0) and B (s1) live; OOM asked by s2; then A freed and C (s3) allocated.
        let s = snap_with(
            &[
                (Alloc, 0x1000, 100, Some(0)),
                (Alloc, 0x2000, 200, Some(1)),
                (Oom, 0, 5000, Some(2)),
                (FreeCompleted, 0x1000, 100, None),
                (Alloc, 0x3000, 300, Some(3)),
            ],
            &[(0x2000, 200, 1), (0x3000, 300, 3)],
        );
        let sites = Sites::new(&s, &Attribution::default());
        let st = device_stats(
            &s,
            &sites,
            0,
            &History::of(&s.device_traces[0], crate::at::At::Auto),
        );
        assert_eq!(st.ooms.len(), 1);
        let o = &st.ooms[0];
        assert_eq!((o.event, o.requested, o.device_free), (2, 5000, Some(7)));
        assert_eq!(sites.text(o.site), "/app/s2.py:3 (f)");
        assert_eq!(
            o.live,
            Tally {
                bytes: 300,
                count: 2
            }
        );
        let held: Vec<(&str, i64)> = o
            .holders
            .iter()
            .map(|(s, t)| (sites.text(*s), t.bytes))
            .collect();
        // The free carried no stack: the holder is found through its alloc.
        assert_eq!(held, [("/app/s1.py:2 (f)", 200), ("/app/s0.py:1 (f)", 100)]);
        assert_eq!(
            st.live,
            Tally {
                bytes: 500,
                count: 2
            }
        );
        assert_eq!(st.peak_live_requested, 500);
        assert_eq!(st.start_live_requested, 0);
    }

    #[test]
    fn capped_history_starts_from_the_implied_live_state() {
        use Action::*;
        // 1000 bytes were live before the first kept event; then one freed, one allocated.
        let s = snap_with(
            &[
                (FreeCompleted, 0x9000, 400, Some(0)),
                (Alloc, 0x1000, 100, Some(1)),
            ],
            &[(0x1000, 100, 1), (0x5000, 600, 2)],
        );
        let sites = Sites::new(&s, &Attribution::default());
        let st = device_stats(
            &s,
            &sites,
            0,
            &History::of(&s.device_traces[0], crate::at::At::Auto),
        );
        assert_eq!(st.start_live_requested, 1000);
        assert_eq!(st.peak_live_requested, 1000);
        assert_eq!(st.peak_after_event, None);
        assert_eq!(st.live.bytes, 700);
    }
}
