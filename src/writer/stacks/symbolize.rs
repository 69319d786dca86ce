//! Native return addresses to frames: addr2line + object, demangled, cached per address.
//!
//! Cold (writer thread). Each address comes with the module it was in when its stack was
//! interned (`super::ModuleIds`), so a library unloaded since is still named from its file,
//! and another mapped at its addresses later gets its own names. Per module: one
//! `addr2line::Loader` on the file (DWARF file:line with
//! inlined frames), plus one on its separate debug file when the module names one
//! (`/usr/lib/debug/.build-id/xx/yyyy.debug`, or `.gnu_debuglink` next to the file, in its
//! `.debug/` folder, or under `/usr/lib/debug`); and the symbol tables of both
//! ([`super::symtab`]). Frames follow PyTorch's shape: `name` = demangled function,
//! `filename` = source path, `line` = 0 when unknown.
//!
//! A frame is given a function's name only where something proves the address is in it:
//! DWARF, or a symbol whose stated size holds it (`start <= address < start + size`). Without
//! DWARF a frame is `{"symbol+0xOFF", <module path>, 0}` when such a symbol holds the address,
//! else `{"libname.so+0xOFF", <module path>, 0}`: past a symbol's end the address belongs to
//! code the tables do not name (cuBLAS's internal functions after a 5-byte export), and the
//! nearest symbol before it would be a wrong name. OFF is the return address's distance from
//! the symbol's start, or from the module's base (its ELF virtual address). Only an address
//! that was in no module stays unnamed: `{"0x7f..", "??", 0}` (counted by `super`).

use super::symtab::SymbolTable;
use crate::process::modules::ModuleInfo;
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc as Rc;

struct ModuleSymbols {
    main: Option<addr2line::Loader>,
    debug: Option<addr2line::Loader>,
    debug_path: Option<PathBuf>,
    /// The symbol tables of the file and its debug file, for addresses DWARF does not name;
    /// read on first need.
    symbols: Option<SymbolTable>,
}

#[derive(Default)]
pub struct Symbolizer {
    /// Keyed by module path.
    modules: FxHashMap<String, ModuleSymbols>,
    /// Keyed by module (`super::ModuleId`) and return address.
    cache: FxHashMap<(u32, u64), Rc<[Frame]>>,
}

impl Symbolizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// The frames (innermost first; several when inlined) of the call that returns to `pc`,
    /// in `module` (its id and what it was), or in none.
    pub fn symbolize(&mut self, pc: u64, module: Option<(u32, &ModuleInfo)>) -> Rc<[Frame]> {
        let key = (module.map_or(u32::MAX, |(id, _)| id), pc);
        if let Some(f) = self.cache.get(&key) {
            return f.clone();
        }
        let frames: Rc<[Frame]> = self.lookup(pc, module.map(|(_, m)| m)).into();
        self.cache.insert(key, frames.clone());
        frames
    }

    /// Whether `module` is PyTorch's CUDA allocator library (`libc10_cuda.so`): the
    /// innermost frames of a stack there are the allocator's own (its tracker call, its
    /// `malloc`), not where the program allocated.
    pub fn is_allocator_library(module: &ModuleInfo) -> bool {
        Path::new(&module.path).file_name() == Some("libc10_cuda.so".as_ref())
    }

    fn lookup(&mut self, pc: u64, module: Option<&ModuleInfo>) -> Vec<Frame> {
        let Some(m) = module else {
            return vec![Frame {
                name: format!("{pc:#x}"),
                filename: "??".to_string(),
                line: 0,
            }];
        };
        let path = module_path(m);
        let syms = self
            .modules
            .entry(path.clone())
            .or_insert_with(|| load_module(&path));
        // The call instruction ends just before the return address.
        let offset = pc.wrapping_sub(m.base);
        let probe = offset.wrapping_sub(1);
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
        if out.iter().any(|f| f.name != "??") {
            return out;
        }
        // No DWARF function name: a symbol that holds the address, else the module.
        let sym = syms.symbol(&path, probe);
        let name = match &sym {
            Some((name, start)) => format!("{name}+{:#x}", offset.wrapping_sub(*start)),
            None => format!(
                "{}+{offset:#x}",
                path.rsplit('/').next().unwrap_or(path.as_str())
            ),
        };
        match out.last_mut() {
            // DWARF knew the line but not the function: the symbol names it, without the
            // offset (the line says where), or the module with it.
            Some(last) if last.filename != "??" => {
                last.name = sym.map_or(name, |(name, _)| name);
            }
            _ => {
                out = vec![Frame {
                    name,
                    filename: path,
                    line: 0,
                }];
            }
        }
        out
    }
}

impl ModuleSymbols {
    /// The demangled symbol whose stated size holds `probe`, and its start.
    fn symbol(&mut self, path: &str, probe: u64) -> Option<(String, u64)> {
        let debug = self.debug_path.as_deref().and_then(Path::to_str);
        let table = self
            .symbols
            .get_or_insert_with(|| SymbolTable::load(std::iter::once(path).chain(debug)));
        let (name, start) = table.holding(probe)?;
        Some((demangle(name), start))
    }
}

fn load_module(path: &str) -> ModuleSymbols {
    let main = addr2line::Loader::new(path).ok();
    let debug_path = debug_file(Path::new(path));
    let debug = debug_path
        .as_ref()
        .and_then(|p| addr2line::Loader::new(p).ok());
    ModuleSymbols {
        main,
        debug,
        debug_path,
        symbols: None,
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
