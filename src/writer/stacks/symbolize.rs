//! Native return addresses to frames: addr2line + object, demangled, cached per address.
//!
//! Cold (writer thread). Per module: one `addr2line::Loader` on the file (DWARF file:line with
//! inlined frames; `.symtab`, else `.dynsym` names), plus one on its separate debug file when
//! the module names one (`/usr/lib/debug/.build-id/xx/yyyy.debug`, or `.gnu_debuglink` next to
//! the file, in its `.debug/` folder, or under `/usr/lib/debug`). Frames follow PyTorch's
//! shape: `name` = demangled function, `filename` = source path or `"??"`, `line` = 0 when
//! unknown; an address with no symbol at all gives `{"??", <module path>, 0}`.

use crate::capture::modules::{self, ModuleInfo};
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc as Rc;

struct ModuleSymbols {
    main: Option<addr2line::Loader>,
    debug: Option<addr2line::Loader>,
}

#[derive(Default)]
pub struct Symbolizer {
    /// Keyed by module path.
    modules: FxHashMap<String, ModuleSymbols>,
    /// Keyed by return address.
    cache: FxHashMap<u64, Rc<[Frame]>>,
}

impl Symbolizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// The frames (innermost first; several when inlined) of the call that returns to `pc`.
    pub fn symbolize(&mut self, pc: u64) -> Rc<[Frame]> {
        if let Some(f) = self.cache.get(&pc) {
            return f.clone();
        }
        let frames: Rc<[Frame]> = self.lookup(pc).into();
        self.cache.insert(pc, frames.clone());
        frames
    }

    fn lookup(&mut self, pc: u64) -> Vec<Frame> {
        let table = modules::ensure();
        let Some(m) = table.find(pc).and_then(|i| table.modules.get(i)) else {
            return vec![unknown("??")];
        };
        let path = module_path(m);
        let syms = self
            .modules
            .entry(path.clone())
            .or_insert_with(|| load_module(&path));
        // The call instruction ends just before the return address.
        let probe = pc.wrapping_sub(1).wrapping_sub(m.base);
        let mut out = Vec::new();
        for loader in [&syms.debug, &syms.main].into_iter().flatten() {
            if let Ok(mut iter) = loader.find_frames(probe) {
                while let Ok(Some(f)) = iter.next() {
                    let name = f
                        .function
                        .as_ref()
                        .and_then(|func| func.demangle().ok().map(|n| n.into_owned()));
                    let (filename, line) = match &f.location {
                        Some(loc) => (
                            loc.file.map_or_else(|| "??".to_string(), str::to_string),
                            loc.line.map_or(0, i64::from),
                        ),
                        None => ("??".to_string(), 0),
                    };
                    out.push(Frame {
                        name: name.unwrap_or_else(|| "??".to_string()),
                        filename,
                        line,
                    });
                }
            }
            if !out.is_empty() {
                break;
            }
        }
        // No DWARF function name: fall back to the symbol tables.
        if out.iter().all(|f| f.name == "??") {
            let sym = [&syms.main, &syms.debug]
                .into_iter()
                .flatten()
                .find_map(|l| l.find_symbol(probe).map(demangle));
            match (sym, out.last_mut()) {
                (Some(name), Some(last)) => last.name = name,
                (Some(name), None) => out.push(Frame {
                    name,
                    filename: "??".to_string(),
                    line: 0,
                }),
                (None, None) => out.push(unknown(&path)),
                (None, Some(_)) => {}
            }
        }
        out
    }
}

fn load_module(path: &str) -> ModuleSymbols {
    let main = addr2line::Loader::new(path).ok();
    let debug = debug_file(Path::new(path)).and_then(|p| addr2line::Loader::new(p).ok());
    ModuleSymbols { main, debug }
}

fn unknown(filename: &str) -> Frame {
    Frame {
        name: "??".to_string(),
        filename: filename.to_string(),
        line: 0,
    }
}

fn module_path(m: &ModuleInfo) -> String {
    if m.path.is_empty() {
        std::fs::read_link("/proc/self/exe")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "/proc/self/exe".to_string())
    } else {
        m.path.clone()
    }
}

/// Demangles a C++ or Rust symbol; other names are returned as they are.
pub fn demangle(name: &str) -> String {
    if let Ok(sym) = rustc_demangle::try_demangle(name) {
        return format!("{sym:#}");
    }
    if name.starts_with("_Z")
        && let Ok(sym) = cpp_demangle::Symbol::new(name)
        && let Ok(s) = sym.demangle()
    {
        return s;
    }
    name.to_string()
}

/// A separate debug file for `path`, by build id or `.gnu_debuglink`, if one exists.
fn debug_file(path: &Path) -> Option<PathBuf> {
    use object::Object;
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping; a file changing under us gives wrong symbols at
    // worst, which is what any symbolizer risks.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let obj = object::File::parse(&*map).ok()?;
    if obj.section_by_name(".debug_info").is_some() {
        return None; // the file has its own DWARF
    }
    if let Ok(Some(id)) = obj.build_id()
        && id.len() >= 2
    {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let p = PathBuf::from(format!(
            "/usr/lib/debug/.build-id/{}/{}.debug",
            &hex[..2],
            &hex[2..]
        ));
        if p.is_file() {
            return Some(p);
        }
    }
    if let Ok(Some((name, _crc))) = obj.gnu_debuglink() {
        let name = std::str::from_utf8(name).ok()?;
        let dir = path.parent()?;
        let candidates = [
            dir.join(name),
            dir.join(".debug").join(name),
            Path::new("/usr/lib/debug")
                .join(dir.strip_prefix("/").unwrap_or(dir))
                .join(name),
        ];
        return candidates.into_iter().find(|p| p.is_file() && p != path);
    }
    None
}
