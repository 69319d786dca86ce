//! Allocation sites and owning libraries: which frame of a stack is the site, how a frame
//! is named, which library owns a stack, and `--ignore` / `--callers` ([`Attribution`]).
//! The same rules serve every command, `memsnap top`'s live samples included.
//!
//! Cold code. Definitions (also printed by `memsnap summary --help`):
//! - *site*: the innermost frame in user code: a Python `file:line` when the stack has a
//!   Python frame (library files under site-packages/dist-packages/the stdlib are skipped
//!   unless nothing else is there), else the first native frame outside the CUDA runtime,
//!   the allocator and PyTorch's filtered plumbing (docs/FORMAT.md#frames, filtering).
//!   `--ignore PATTERN` skips frames whose file or function contains PATTERN when choosing
//!   it; `--callers N` shows the N frames above it (the site's text then names them too,
//!   so sites are grouped by the whole chain).
//! - *library*: the owner of the innermost meaningful frame (torch, nccl, cublas, ...).

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
}

/// How the allocation site is chosen and shown: `--ignore` and `--callers`, the same for
/// every command.
#[derive(Clone, Debug, Default)]
pub struct Attribution {
    /// Frames whose file or function contains one of these are never the site.
    pub ignore: Vec<String>,
    /// Callers shown above each site (`site <- caller <- ...`); sites are then grouped by
    /// the whole chain.
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

/// The frame a stack's site names (`None` when no frame can be the site).
pub fn site_frame<'f>(frames: &[&'f Frame], attr: &Attribution) -> Option<&'f Frame> {
    choose_site(frames, attr).map(|(i, _)| frames[i])
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
mod tests {
    use super::*;

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
}
