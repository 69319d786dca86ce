//! Finding PyTorch's caching allocator in a loaded `libc10_cuda.so`: the allocator object,
//! the two methods memsnap calls and their places in the object's virtual table.
//!
//! Cold: runs at most once per change in the set of loaded libraries, on a thread making a
//! segment-level CUDA allocation. Reads the library's own file (its `.symtab`, which
//! PyTorch's wheels keep) because the methods are hidden from the dynamic symbol table;
//! the slots are found by comparing the virtual table's entries with the methods'
//! addresses, so no slot number is written down anywhere (docs/PYTORCH.md).

use crate::process::dlsym::real_dlsym;
use std::ffi::{CStr, c_void};
use std::path::{Path, PathBuf};

/// The exported `std::atomic<CUDAAllocator*> c10::cuda::CUDACachingAllocator::allocator`.
const ALLOCATOR: &CStr = c"_ZN3c104cuda20CUDACachingAllocator9allocatorE";
/// `NativeCachingAllocator`: the default caching allocator's class.
const NATIVE: &str = "N3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator";

/// What was found, as addresses in this process.
#[derive(Clone, Debug)]
pub struct Allocator {
    /// The `std::atomic<CUDAAllocator*>` itself (its value is read at each probe).
    pub pointer: *const *mut c_void,
    /// `vtable for NativeCachingAllocator` + 16: what the object's first word holds when
    /// the allocator is the native caching allocator.
    pub native_vptr: usize,
    /// Entries in that virtual table.
    pub vtable_len: usize,
    /// `NativeCachingAllocator::initialized()`.
    pub initialized: usize,
    /// `NativeCachingAllocator::attachAllocatorTraceTracker(std::function<...>)`.
    pub attach: usize,
    /// The library's file.
    pub path: PathBuf,
    /// PyTorch's version (`version.py` beside the library), read once with the symbols:
    /// the probe repeats until the allocator is initialized and must not read files again.
    pub version: String,
}

// SAFETY: plain addresses into a library that is never unloaded while PyTorch runs.
unsafe impl Send for Allocator {}
// SAFETY: as above; nothing here is written after construction.
unsafe impl Sync for Allocator {}

/// Why the allocator could not be found (each becomes the snapshot's note).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// No `libc10_cuda.so` in the process (yet).
    NotLoaded,
    /// Loaded, but something memsnap needs is not where it looks.
    Unusable(String),
}

/// Finds the allocator in a loaded `libc10_cuda.so`.
pub fn find() -> Result<Allocator, Missing> {
    // SAFETY: NOLOAD only looks the name up among loaded libraries (by soname too).
    let handle = unsafe {
        libc::dlopen(
            c"libc10_cuda.so".as_ptr(),
            libc::RTLD_NOLOAD | libc::RTLD_LAZY,
        )
    };
    if handle.is_null() {
        return Err(Missing::NotLoaded);
    }
    // SAFETY: `handle` is live (NOLOAD took a reference, released below).
    let pointer = unsafe { real_dlsym(handle, ALLOCATOR) };
    // SAFETY: balances the NOLOAD dlopen; the library stays loaded (PyTorch holds it).
    unsafe { crate::process::dlsym::real_dlclose(handle) };
    if pointer.is_null() {
        return Err(Missing::Unusable(
            "libc10_cuda.so exports no CUDACachingAllocator::allocator".into(),
        ));
    }
    // SAFETY: Dl_info is plain pointers and integers: all zeros is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr fills `info` for an address inside a loaded library.
    if unsafe { libc::dladdr(pointer, &mut info) } == 0 || info.dli_fname.is_null() {
        return Err(Missing::Unusable("libc10_cuda.so has no file name".into()));
    }
    let path = PathBuf::from(
        // SAFETY: dladdr's file name is a NUL-terminated string owned by the loader.
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    );
    let symbols = read_symbols(&path)?;
    // The load address: where the exported variable is, minus where the file says it is.
    let base = (pointer as usize).wrapping_sub(symbols.allocator as usize);
    let allocator = Allocator {
        pointer: pointer as *const *mut c_void,
        native_vptr: base + symbols.vtable as usize + 16,
        vtable_len: (symbols.vtable_size as usize / 8).saturating_sub(2),
        initialized: base + symbols.initialized as usize,
        attach: base + symbols.attach as usize,
        version: torch_version(&path).unwrap_or_else(|| "(unknown)".into()),
        path,
    };
    Ok(allocator)
}

/// File addresses of the symbols memsnap needs.
#[derive(Debug, Default, PartialEq, Eq)]
struct Symbols {
    allocator: u64,
    vtable: u64,
    vtable_size: u64,
    initialized: u64,
    attach: u64,
}

fn read_symbols(path: &Path) -> Result<Symbols, Missing> {
    use object::{Object, ObjectSymbol};
    let unusable = |what: &str| Missing::Unusable(format!("{}: {what}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| unusable(&format!("cannot open ({e})")))?;
    // SAFETY: a read-only private mapping of a library file that is in use (and so not
    // rewritten in place).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| unusable(&e.to_string()))?;
    let obj = object::File::parse(&*map).map_err(|e| unusable(&e.to_string()))?;
    let vtable = format!("_ZTV{NATIVE}E");
    let initialized = format!("_Z{NATIVE}11initializedEv");
    let attach = format!("_Z{NATIVE}27attachAllocatorTraceTracker");
    let allocator = ALLOCATOR.to_str().unwrap_or_default();
    let mut found = Symbols::default();
    for sym in obj.symbols().chain(obj.dynamic_symbols()) {
        let Ok(name) = sym.name() else { continue };
        if name == vtable {
            found.vtable = sym.address();
            found.vtable_size = sym.size();
        } else if name == initialized {
            found.initialized = sym.address();
        } else if name.starts_with(&attach) {
            found.attach = sym.address();
        } else if name == allocator {
            found.allocator = sym.address();
        }
    }
    if found.vtable == 0 || found.initialized == 0 || found.attach == 0 {
        return Err(unusable(
            "no symbol table with NativeCachingAllocator's methods (a stripped build?)",
        ));
    }
    if found.allocator == 0 {
        return Err(unusable("CUDACachingAllocator::allocator has no address"));
    }
    Ok(found)
}

/// The slot of `method` in the virtual table at `vptr`, by comparing entries.
///
/// # Safety
/// `vptr` points at a virtual table of at least `len` entries.
pub unsafe fn slot_of(vptr: usize, len: usize, method: usize) -> Option<usize> {
    (0..len).find(|&i| {
        // SAFETY: within the table (caller's contract).
        unsafe { *(vptr as *const usize).add(i) == method }
    })
}

/// PyTorch's version from the `version.py` beside the library (`torch/lib/..`).
pub fn torch_version(library: &Path) -> Option<String> {
    let torch = library.parent()?.parent()?;
    let text = std::fs::read_to_string(torch.join("version.py")).ok()?;
    super::layout::version_from_py(&text).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_found_by_address() {
        let table = [0x10usize, 0x20, 0x30, 0x40];
        let vptr = table.as_ptr() as usize;
        // SAFETY: `table` has 4 entries.
        unsafe {
            assert_eq!(slot_of(vptr, 4, 0x30), Some(2));
            assert_eq!(slot_of(vptr, 4, 0x50), None);
            assert_eq!(
                slot_of(vptr, 2, 0x30),
                None,
                "only within the table's length"
            );
        }
    }

    #[test]
    fn a_file_without_the_symbols_is_unusable_not_a_crash() {
        let me = std::env::current_exe().unwrap();
        match read_symbols(&me) {
            Err(Missing::Unusable(why)) => assert!(why.contains("NativeCachingAllocator")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_symbols(Path::new("/nonexistent/libc10_cuda.so")),
            Err(Missing::Unusable(_))
        ));
    }
}
