//! The symbol tables of one module (its file, and its separate debug file when it has one):
//! which symbol holds an address, by the sizes the tables state. Cold (writer thread), built
//! once per module on first need.
//!
//! A symbol holds an address when `start <= address < start + size`; nothing is guessed past
//! a symbol's end. A symbol of size 0 (an assembly label, an entry point written without
//! `.size`) states no extent and holds only its first byte, which no call instruction ends
//! just after, so in practice it names no frame. Every function and untyped symbol of
//! `.symtab` and `.dynsym` alike counts (a file stripped with `--strip-unneeded` may keep a
//! `.symtab` with no functions in it while `.dynsym` still names its exports). Names are
//! read from the mapped files when asked for, not copied.

use memmap2::Mmap;

/// One symbol: its extent in the module's addresses (ELF virtual addresses, the same terms as
/// DWARF's), and where its name starts in its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sym {
    start: u64,
    size: u64,
    /// The largest end of this symbol and every one before it in the table, so that a lookup
    /// stops walking back as soon as no earlier symbol can reach the address.
    reach: u64,
    /// Offset of the NUL-terminated name in `files[file]`.
    name: u64,
    file: u32,
    /// Lower is better among symbols that start at the same address: sized, then exported.
    rank: u32,
}

impl Sym {
    fn end(&self) -> u64 {
        self.start.saturating_add(self.size.max(1))
    }
}

/// The symbols of a module, sorted by start.
#[derive(Default)]
pub struct SymbolTable {
    files: Vec<Mmap>,
    syms: Vec<Sym>,
}

impl SymbolTable {
    /// The function symbols of the files at `paths` (a module and its debug file, which share
    /// addresses); a file that cannot be read adds nothing.
    pub fn load<'a>(paths: impl IntoIterator<Item = &'a str>) -> Self {
        let mut table = SymbolTable::default();
        for path in paths {
            let Ok(file) = std::fs::File::open(path) else {
                continue;
            };
            // SAFETY: a read-only private mapping; a file changing under us gives wrong
            // symbols at worst, which is what any symbolizer risks.
            let Ok(map) = (unsafe { Mmap::map(&file) }) else {
                continue;
            };
            let index = table.files.len() as u32;
            table.syms.extend(read_symbols(&map, index));
            table.files.push(map);
        }
        table.finish();
        table
    }

    /// Sorts the symbols and fills in their reach.
    fn finish(&mut self) {
        self.syms
            .sort_unstable_by_key(|s| (s.start, std::cmp::Reverse(s.rank)));
        let mut reach = 0;
        for s in &mut self.syms {
            reach = reach.max(s.end());
            s.reach = reach;
        }
    }

    /// The innermost symbol holding `address` (the one that starts last; among those starting
    /// there, the best ranked), as its raw name and start.
    pub fn holding(&self, address: u64) -> Option<(&str, u64)> {
        let s = self.holding_sym(address)?;
        let map = self.files.get(s.file as usize)?;
        let bytes = map.get(usize::try_from(s.name).ok()?..)?;
        let name = bytes.split(|&b| b == 0).next()?;
        Some((std::str::from_utf8(name).ok()?, s.start))
    }

    fn holding_sym(&self, address: u64) -> Option<&Sym> {
        let after = self.syms.partition_point(|s| s.start <= address);
        self.syms[..after]
            .iter()
            .rev()
            .take_while(|s| s.reach > address)
            .find(|s| address < s.end())
    }
}

/// The named, defined function (and untyped) symbols of one ELF file's `.symtab` and
/// `.dynsym`; nothing when it cannot be parsed.
fn read_symbols(map: &[u8], file: u32) -> Vec<Sym> {
    use object::{Object, ObjectSymbol, SymbolKind, SymbolScope};
    let Ok(obj) = object::File::parse(map) else {
        return Vec::new();
    };
    let base = map.as_ptr() as usize;
    let mut out = Vec::new();
    for sym in obj.symbols().chain(obj.dynamic_symbols()) {
        if !sym.is_definition() || !matches!(sym.kind(), SymbolKind::Text | SymbolKind::Unknown) {
            continue;
        }
        let Ok(name) = sym.name_bytes() else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        // The name is a slice of the mapped file: its offset there.
        let Some(offset) = (name.as_ptr() as usize).checked_sub(base) else {
            continue;
        };
        let exported = matches!(sym.scope(), SymbolScope::Dynamic | SymbolScope::Linkage);
        let typed = sym.kind() == SymbolKind::Text;
        out.push(Sym {
            start: sym.address(),
            size: sym.size(),
            reach: 0,
            name: offset as u64,
            file,
            rank: u32::from(sym.size() == 0) * 4 + u32::from(!typed) * 2 + u32::from(!exported),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(syms: &[(u64, u64, u32)]) -> SymbolTable {
        let mut t = SymbolTable {
            files: Vec::new(),
            syms: syms
                .iter()
                .enumerate()
                .map(|(i, &(start, size, rank))| Sym {
                    start,
                    size,
                    reach: 0,
                    name: i as u64,
                    file: 0,
                    rank,
                })
                .collect(),
        };
        t.finish();
        t
    }

    /// The index (its name offset) of the symbol holding `address`.
    fn at(t: &SymbolTable, address: u64) -> Option<u64> {
        t.holding_sym(address).map(|s| s.name)
    }

    #[test]
    fn symbolize_only_inside_a_symbols_size() {
        // A 5-byte export at 0x100, then a long unnamed stretch, then a 0x20-byte one.
        let t = table(&[(0x100, 5, 0), (0x400, 0x20, 0)]);
        assert_eq!(at(&t, 0xff), None);
        assert_eq!(at(&t, 0x100), Some(0));
        assert_eq!(at(&t, 0x104), Some(0));
        assert_eq!(at(&t, 0x105), None, "one past the end is not the symbol's");
        assert_eq!(at(&t, 0x12d), None);
        assert_eq!(at(&t, 0x3ff), None);
        assert_eq!(at(&t, 0x41f), Some(1));
        assert_eq!(at(&t, 0x420), None);
        assert_eq!(at(&t, u64::MAX), None);
    }

    #[test]
    fn symbolize_size_zero_holds_only_its_start() {
        let t = table(&[(0x100, 0, 0), (0x200, 0x10, 0)]);
        assert_eq!(at(&t, 0x100), Some(0));
        assert_eq!(at(&t, 0x101), None);
        assert_eq!(at(&t, 0x1ff), None);
        assert_eq!(at(&t, 0x205), Some(1));
    }

    #[test]
    fn symbolize_nested_and_aliased_symbols() {
        // A large function holding a small one, and past the small one's end the large one
        // still holds the address. An alias without a size at the small one's start.
        let t = table(&[(0x1000, 0x400, 0), (0x1100, 0x10, 0), (0x1100, 0, 4)]);
        assert_eq!(at(&t, 0x1050), Some(0));
        assert_eq!(at(&t, 0x1100), Some(1), "sized before unsized at one start");
        assert_eq!(at(&t, 0x1108), Some(1));
        assert_eq!(
            at(&t, 0x1110),
            Some(0),
            "the outer one past the inner's end"
        );
        assert_eq!(at(&t, 0x13ff), Some(0));
        assert_eq!(at(&t, 0x1400), None);
    }

    #[inline(never)]
    fn a_function_of_this_binary(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(3)
    }

    #[test]
    fn symbolize_reads_names_from_a_real_file() {
        // This test binary's own `.symtab`: a function here is held by its own name, up to
        // its last byte and not past it.
        let table = crate::process::modules::ensure();
        let pc = a_function_of_this_binary as fn(u64) -> u64 as usize as u64;
        let m = &table.modules[table.find(pc).expect("in a module")];
        let exe = std::env::current_exe().unwrap();
        let t = SymbolTable::load([exe.to_str().unwrap()]);
        let (name, start) = t.holding(pc - m.base).expect("held by its symbol");
        assert!(name.contains("a_function_of_this_binary"), "{name}");
        assert_eq!(start, pc - m.base);
        let s = t.holding_sym(start).unwrap();
        assert!(s.size > 0);
        assert_eq!(t.holding(start + s.size - 1).map(|(n, _)| n), Some(name));
        assert_ne!(t.holding(start + s.size).map(|(n, _)| n), Some(name));
        assert!(std::hint::black_box(a_function_of_this_binary(2)) == 6);
    }
}
