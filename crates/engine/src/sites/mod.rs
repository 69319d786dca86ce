//! Allocation sites and owning libraries: which frame of a stack is the site, how a frame
//! is named, which library owns a stack, and `--ignore` / `--callers` / `--at-helpers`
//! ([`Attribution`]). The same rules serve every command, `memsnap top`'s live samples
//! included (docs/EXPLAIN.md#sites).
//!
//! Cold code. Definitions (also printed by `memsnap summary --help`):
//! - *site*: the innermost frame in user code: a Python `file:line` when the stack has a
//!   Python frame (library files under site-packages/dist-packages/the stdlib are skipped
//!   unless nothing else is there), else the first native frame outside the CUDA runtime,
//!   the allocator and PyTorch's filtered plumbing (docs/FORMAT.md#frames, filtering).
//!   `--ignore PATTERN` skips frames whose file or function contains PATTERN when choosing
//!   it; `--callers N` shows the N frames above it (the site's text then names them too,
//!   so sites are grouped by the whole chain).
//! - *helper*: a site frame that allocates for several calling lines ([`helpers`]); its
//!   stacks' site is then the calling line, `caller via helper`.
//! - *library*: the owner of the innermost meaningful frame (torch, nccl, cublas, ...).

mod helpers;

use helpers::Facts;
pub use helpers::{Helpers, StackBytes};
use memsnap_format::model::{Frame, Snapshot, StackId};
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
    /// The helper the allocations went through, where the site is its calling line
    /// (`train.py:88 (step) via cache.py:12 (get)`: `cache.py:12 (get)`).
    pub via: Option<String>,
}

/// How the allocation site is chosen and shown: `--ignore`, `--callers` and
/// `--at-helpers`, the same for every command.
#[derive(Clone, Debug, Default)]
pub struct Attribution {
    /// Frames whose file or function contains one of these are never the site.
    pub ignore: Vec<String>,
    /// Callers shown above each site (`site <- caller <- ...`); sites are then grouped by
    /// the whole chain, and helpers are not looked for (the chain names the callers).
    pub callers: Option<usize>,
    pub helpers: HelperRule,
}

/// Which helpers' allocations are shown at their calling lines.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HelperRule {
    /// Those found in the file itself (the default).
    #[default]
    Find,
    /// These: found over several files read together, so that each names its sites alike.
    Given(Helpers),
    /// None: every site is the helper's own line (`--at-helpers`).
    Off,
}

impl Attribution {
    /// Whether `--ignore` names this frame (by a substring of its file or function).
    pub fn ignores(&self, f: &Frame) -> bool {
        self.ignore
            .iter()
            .any(|p| f.filename.contains(p.as_str()) || f.name.contains(p.as_str()))
    }

    /// The helpers these rules apply to stacks that allocated `bytes` (by index into
    /// `stacks`).
    pub fn helpers_of(&self, frames: &[Frame], stacks: &[Vec<u32>], bytes: &StackBytes) -> Helpers {
        let chosen = chosen_sites(frames, stacks, self);
        self.helpers_chosen(stacks, &chosen, &mut Facts::new(frames, self), bytes)
    }

    fn helpers_chosen(
        &self,
        stacks: &[Vec<u32>],
        chosen: &[Option<(usize, SiteKind)>],
        facts: &mut Facts,
        bytes: &StackBytes,
    ) -> Helpers {
        match &self.helpers {
            _ if self.callers.is_some() => Helpers::default(),
            HelperRule::Find => Helpers::find(stacks, chosen, facts, bytes),
            HelperRule::Given(h) => h.clone(),
            HelperRule::Off => Helpers::default(),
        }
    }

    /// The same rules with `helpers` applied instead of those each file would find (off
    /// stays off).
    pub fn with_helpers(&self, helpers: Helpers) -> Attribution {
        let mut a = self.clone();
        if a.helpers != HelperRule::Off {
            a.helpers = HelperRule::Given(helpers);
        }
        a
    }

    /// The rules for several files compared site by site (`diff`'s two): the helpers
    /// found in any of them, applied to each, so that each names its sites alike.
    pub fn shared<'s>(
        &self,
        files: impl IntoIterator<Item = (&'s Snapshot, &'s StackBytes)>,
    ) -> Attribution {
        if self.helpers != HelperRule::Find {
            return self.clone();
        }
        let mut all = Helpers::default();
        for (snap, bytes) in files {
            all.union(&self.helpers_of(&snap.frames, &snap.stacks, bytes));
        }
        self.with_helpers(all)
    }
}

/// Between a site and its callers in a site's text.
pub const CALLER_SEPARATOR: &str = " <- ";
/// Between a helper's calling line and the helper in a site's text.
pub const VIA: &str = " via ";

/// Sites and owners of every stack of one snapshot, computed once.
pub struct Sites {
    pub sites: Vec<Site>,
    site_of_stack: Vec<u32>,
    lib_of_stack: Vec<Library>,
    no_stack: u32,
    /// PyTorch's recorder sees only its caching allocator: every block there is torch's.
    all_torch: bool,
    /// The helpers whose allocations are shown at their calling lines.
    helpers: Helpers,
}

impl Sites {
    /// The sites of a file whose stacks allocated `bytes` (what its helpers are found from).
    pub fn new(snap: &Snapshot, attr: &Attribution, bytes: &StackBytes) -> Self {
        Self::of_stacks(
            &snap.frames,
            &snap.stacks,
            snap.memsnap.is_empty(),
            attr,
            bytes,
        )
    }

    /// The same from frames and stacks alone (a live sample from `memsnap top`);
    /// `all_torch` for PyTorch's own files, whose every block is torch's; `bytes` by index
    /// into `stacks`.
    pub fn of_stacks(
        frames: &[Frame],
        stacks: &[Vec<u32>],
        all_torch: bool,
        attr: &Attribution,
        bytes: &StackBytes,
    ) -> Self {
        // Each stack's site frame, and each frame's facts, found once for both passes.
        let chosen = chosen_sites(frames, stacks, attr);
        let mut facts = Facts::new(frames, attr);
        let helpers = attr.helpers_chosen(stacks, &chosen, &mut facts, bytes);
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
            via: None,
        });
        let mut site_of_stack = Vec::with_capacity(stacks.len());
        let mut lib_of_stack = Vec::with_capacity(stacks.len());
        for (st, &chosen) in stacks.iter().zip(&chosen) {
            let ids = frame_ids(frames, st);
            let fs: Vec<&Frame> = ids.iter().map(|&i| &frames[i as usize]).collect();
            let site = at_caller(&ids, chosen, &helpers, &mut facts)
                .unwrap_or_else(|| site_at(&fs, chosen, attr));
            site_of_stack.push(intern(site));
            lib_of_stack.push(library_of(&fs));
        }
        Sites {
            sites,
            site_of_stack,
            lib_of_stack,
            no_stack,
            all_torch,
            helpers,
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
    /// The helper a site's allocations went through, where it is the helper's caller.
    pub fn via(&self, site: u32) -> Option<&str> {
        self.sites[site as usize].via.as_deref()
    }
    /// The helpers applied (those found in the file, unless given).
    pub fn helpers(&self) -> &Helpers {
        &self.helpers
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

/// The indices of a stack's frames that `frames` holds.
fn frame_ids(frames: &[Frame], stack: &[u32]) -> Vec<u32> {
    stack
        .iter()
        .copied()
        .filter(|&f| (f as usize) < frames.len())
        .collect()
}

/// Each stack's site frame ([`choose_site`]): its position among the stack's frames.
fn chosen_sites(
    frames: &[Frame],
    stacks: &[Vec<u32>],
    attr: &Attribution,
) -> Vec<Option<(usize, SiteKind)>> {
    stacks
        .iter()
        .map(|st| {
            let fs: Vec<&Frame> = frame_ids(frames, st)
                .iter()
                .map(|&i| &frames[i as usize])
                .collect();
            choose_site(&fs, attr)
        })
        .collect()
}

/// The site of a stack without helpers: the chosen frame's text, then its callers'.
#[cfg(test)]
fn site_of(frames: &[&Frame], attr: &Attribution) -> Site {
    site_at(frames, choose_site(frames, attr), attr)
}

/// The site of a stack whose site frame is `chosen`, shown at its own line: its text,
/// then its callers' (`--callers`).
fn site_at(frames: &[&Frame], chosen: Option<(usize, SiteKind)>, attr: &Attribution) -> Site {
    match chosen.map(|(at, kind)| (chain_at(frames, at, kind, attr), kind)) {
        Some((chain, kind)) => Site {
            text: chain.join(CALLER_SEPARATOR),
            kind,
            via: None,
        },
        None => Site {
            text: if frames.is_empty() {
                "<no frames recorded>".into()
            } else {
                "<every frame matched --ignore>".into()
            },
            kind: SiteKind::None,
            via: None,
        },
    }
}

/// The site of a stack (its frames' indices, `ids`) through a helper: its calling line
/// `via` the helper (the line the calling line called; the site frame itself for the
/// nearest calling lines).
fn at_caller(
    ids: &[u32],
    chosen: Option<(usize, SiteKind)>,
    helpers: &Helpers,
    facts: &mut Facts,
) -> Option<Site> {
    let (at, kind) = chosen?;
    if helpers.is_empty() || !facts.may_be_helper(ids[at], kind) {
        return None;
    }
    let depth = helpers.depth(&facts.text(ids[at]))?;
    let lines = facts.calling_lines(ids, at, kind, depth + 1);
    let caller = *lines.get(depth)?;
    let via = match depth {
        0 => ids[at],
        d => lines[d - 1],
    };
    let via = facts.text(via).to_string();
    Some(Site {
        text: format!("{}{VIA}{via}", facts.text(caller)),
        kind,
        via: Some(via),
    })
}

/// The site frame's text and its callers' (`--callers`, outward), or `None` when no frame
/// can be the site.
pub fn site_chain(frames: &[&Frame], attr: &Attribution) -> Option<(Vec<String>, SiteKind)> {
    let (at, kind) = choose_site(frames, attr)?;
    Some((chain_at(frames, at, kind, attr), kind))
}

/// The text of the site frame at `at`, then its callers' (`--callers`).
fn chain_at(frames: &[&Frame], at: usize, kind: SiteKind, attr: &Attribution) -> Vec<String> {
    let mut chain = vec![frame_text(frames[at])];
    let callers = frames[at + 1..]
        .iter()
        .filter(|f| !is_hidden(f) && !attr.ignores(f))
        .filter(|f| kind != SiteKind::Python || is_python_frame(f))
        .take(attr.callers.unwrap_or(0));
    chain.extend(callers.map(|f| frame_text(f)));
    chain
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

/// One frame of a shown stack (the page's hover, the flame graph): `function (file:line)`
/// for Python, else [`native_text`].
pub fn stack_frame_text(f: &Frame) -> String {
    if is_python_frame(f) {
        format!("{} ({}:{})", f.name, short_path(&f.filename), f.line)
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

#[cfg(test)]
mod tests;
