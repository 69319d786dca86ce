//! The table of loaded modules: executable ranges and unwind sections, from `dl_iterate_phdr`.
//!
//! Process-wide state: the hooks' native walker reads it, the writer symbolizes with it and
//! rebuilds it. Mostly cold. The hot path only does [`current`] (one atomic load) and range lookups in the
//! immutable table it returns. A table is built once, by the first call to [`ensure`] (the
//! first capture, or earlier through `capture::prepare`), and rebuilt by the writer thread
//! through [`refresh_if_stale`] after a hook saw a return address in no known module. Old
//! tables are leaked, never freed: a hook on another thread may still be walking one.
//!
//! Unwind sections are slices of the loader's own mapping of each module (`PT_GNU_EH_FRAME`
//! gives `.eh_frame_hdr`, whose header points at `.eh_frame`). They stay valid while the
//! module is loaded; a module `dlclose`d while a stale table still names it is not read
//! unless a return address on some stack points into its old range.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// One loaded module as the writer needs it for symbolization.
#[derive(Clone, Debug)]
pub struct ModuleInfo {
    /// Path as the loader knows it; `""` for the main executable (use `/proc/self/exe`).
    pub path: String,
    /// `dlpi_addr`: actual address minus the address stated in the ELF file.
    pub base: u64,
    /// Executable range `[start, end)` in this process.
    pub start: u64,
    pub end: u64,
}

#[cfg(target_arch = "x86_64")]
pub type Unwinder =
    framehop::x86_64::UnwinderX86_64<&'static [u8], framehop::MustNotAllocateDuringUnwind>;

/// An immutable snapshot of the loaded modules.
pub struct ModuleTable {
    /// Sorted by `start`, non-overlapping.
    pub modules: Vec<ModuleInfo>,
    /// Index in `modules` of memsnap's own library (frames there are dropped).
    pub own: Option<usize>,
    #[cfg(target_arch = "x86_64")]
    pub unwinder: Unwinder,
    adds: u64,
    subs: u64,
}

impl ModuleTable {
    /// The module whose executable range contains `pc`.
    #[inline]
    pub fn find(&self, pc: u64) -> Option<usize> {
        let idx = self.modules.partition_point(|m| m.start <= pc);
        let i = idx.checked_sub(1)?;
        let m = self.modules.get(i)?;
        (pc < m.end).then_some(i)
    }

    /// Like [`find`](Self::find), trying `hint` (the previous frame's module) first:
    /// consecutive frames are usually in the same module.
    #[inline]
    pub fn find_near(&self, pc: u64, hint: usize) -> Option<usize> {
        match self.modules.get(hint) {
            Some(m) if m.start <= pc && pc < m.end => Some(hint),
            _ => self.find(pc),
        }
    }

    /// `pc` lies in memsnap's own text.
    #[inline]
    pub fn is_own(&self, module: usize) -> bool {
        self.own == Some(module)
    }
}

static TABLE: AtomicPtr<ModuleTable> = AtomicPtr::new(std::ptr::null_mut());
static STALE: AtomicBool = AtomicBool::new(false);

/// The current table, if one was built. One atomic load.
#[inline]
pub fn current() -> Option<&'static ModuleTable> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: a published table is leaked (never freed or mutated), so it lives forever.
    unsafe { p.as_ref() }
}

/// The current table, building the first one if needed (allocates once per process).
pub fn ensure() -> &'static ModuleTable {
    if let Some(t) = current() {
        return t;
    }
    publish(build())
}

/// Called by a hook that met an address in no known module: the writer rebuilds later.
#[inline]
pub fn mark_stale() {
    if !STALE.load(Ordering::Relaxed) {
        STALE.store(true, Ordering::Relaxed);
    }
}

/// Whether a hook asked for a rebuild since the last [`refresh_if_stale`].
pub fn is_stale() -> bool {
    STALE.load(Ordering::Relaxed)
}

/// Writer thread: rebuilds the table when a hook marked it stale and the loader's
/// load/unload counters moved since it was built. Returns true when a new table was
/// published. Cheap when nothing changed (one `dl_iterate_phdr` pass that reads two counters).
pub fn refresh_if_stale() -> bool {
    if !STALE.swap(false, Ordering::Relaxed) {
        return false;
    }
    refresh()
}

/// Rebuilds the table if the loader's counters moved (whether or not a hook asked).
pub fn refresh() -> bool {
    let Some(old) = current() else {
        ensure();
        return true;
    };
    let (adds, subs) = loader_counters();
    if adds == old.adds && subs == old.subs {
        return false;
    }
    let new = build();
    let p = Box::into_raw(Box::new(new));
    TABLE.store(p, Ordering::Release);
    true
}

fn publish(table: ModuleTable) -> &'static ModuleTable {
    let p = Box::into_raw(Box::new(table));
    match TABLE.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `p` is now the published, leaked table.
        Ok(_) => unsafe { &*p },
        Err(winner) => {
            // SAFETY: `p` was never published; `winner` is a leaked published table.
            unsafe {
                drop(Box::from_raw(p));
                &*winner
            }
        }
    }
}

/// The number of libraries ever loaded in this process (glibc's `dlpi_adds`): a look for
/// something a library brings is repeated only when it changed. Takes the loader's lock:
/// never on an event's path.
pub fn libraries_loaded() -> u64 {
    loader_counters().0
}

fn loader_counters() -> (u64, u64) {
    let mut counts = (0u64, 0u64);
    each_loaded_object(|info| {
        counts = (info.dlpi_adds, info.dlpi_subs);
        // The counters are the same in every record: the first one is enough.
        ControlFlow::Break(())
    });
    counts
}

/// Calls `visit` on each object the loader has loaded (the executable, the libraries, the
/// loader itself), in the loader's order, until `visit` breaks: one `dl_iterate_phdr` walk,
/// under the loader's lock. Visits nothing when the loader's records are smaller than
/// `libc::dl_phdr_info` (an older loader: every record has that size).
fn each_loaded_object<F: FnMut(&libc::dl_phdr_info) -> ControlFlow<()>>(mut visit: F) {
    unsafe extern "C" fn cb<F: FnMut(&libc::dl_phdr_info) -> ControlFlow<()>>(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        if size < std::mem::size_of::<libc::dl_phdr_info>() {
            return 1;
        }
        // SAFETY: the loader passes a valid info for the duration of the call; `data` is
        // the `visit` that `each_loaded_object` passed, borrowed for the walk.
        let (visit, info) = unsafe { (&mut *(data as *mut F), &*info) };
        match visit(info) {
            ControlFlow::Continue(()) => 0,
            ControlFlow::Break(()) => 1,
        }
    }
    // SAFETY: `cb::<F>` matches the callback type and only calls `visit`, which outlives
    // the walk.
    unsafe { libc::dl_iterate_phdr(Some(cb::<F>), &mut visit as *mut F as *mut libc::c_void) };
}

/// Raw facts about one module, collected inside the loader's callback.
struct Collected {
    path: String,
    base: u64,
    exec: Option<(u64, u64)>,
    eh_frame_hdr: Option<(u64, u64)>,
    /// Loaded segments `[start, end)` in memory, to bound `.eh_frame`.
    loads: Vec<(u64, u64)>,
}

/// One loaded object's path, ranges and unwind header, from its loader record; `None`
/// when it has no executable segment.
fn collect(info: &libc::dl_phdr_info) -> Option<Collected> {
    let path = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: the loader's record names the object with a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) }
            .to_string_lossy()
            .into_owned()
    };
    let base = info.dlpi_addr;
    let mut c = Collected {
        path,
        base,
        exec: None,
        eh_frame_hdr: None,
        loads: Vec::new(),
    };
    let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() {
        &[]
    } else {
        // SAFETY: program headers are `dlpi_phnum` entries at `dlpi_phdr`, valid while the
        // record is.
        unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) }
    };
    for ph in phdrs {
        let start = base.wrapping_add(ph.p_vaddr);
        let end = start.wrapping_add(ph.p_memsz);
        match ph.p_type {
            libc::PT_LOAD => {
                c.loads.push((start, end));
                if ph.p_flags & libc::PF_X != 0 {
                    c.exec = Some(match c.exec {
                        None => (start, end),
                        Some((s, e)) => (s.min(start), e.max(end)),
                    });
                }
            }
            libc::PT_GNU_EH_FRAME => c.eh_frame_hdr = Some((start, end)),
            _ => {}
        }
    }
    c.exec.is_some().then_some(c)
}

fn build() -> ModuleTable {
    let mut collected = Vec::new();
    let (mut adds, mut subs) = (0, 0);
    each_loaded_object(|info| {
        (adds, subs) = (info.dlpi_adds, info.dlpi_subs);
        collected.extend(collect(info));
        ControlFlow::Continue(())
    });

    let own_pc = own_marker as *const () as usize as u64;
    collected.sort_by_key(|c| c.exec.map_or(0, |e| e.0));
    // Drop overlaps (should not happen) so that lookups stay unambiguous.
    let mut last_end = 0u64;
    collected.retain(|c| {
        let Some((s, e)) = c.exec else { return false };
        if s < last_end {
            return false;
        }
        last_end = e;
        true
    });

    let mut modules = Vec::with_capacity(collected.len());
    #[cfg(target_arch = "x86_64")]
    let mut unwinder = Unwinder::new();
    let mut own = None;
    for c in &collected {
        let Some((start, end)) = c.exec else { continue };
        if (start..end).contains(&own_pc) {
            own = Some(modules.len());
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(m) = framehop_module(c, start, end) {
            use framehop::Unwinder as _;
            unwinder.add_module(m);
        }
        modules.push(ModuleInfo {
            path: c.path.clone(),
            base: c.base,
            start,
            end,
        });
    }
    ModuleTable {
        modules,
        own,
        #[cfg(target_arch = "x86_64")]
        unwinder,
        adds,
        subs,
    }
}

/// A function in memsnap's own text: the module containing it is "ours".
#[inline(never)]
fn own_marker() {}

#[cfg(target_arch = "x86_64")]
fn framehop_module(c: &Collected, start: u64, end: u64) -> Option<framehop::Module<&'static [u8]>> {
    let (hdr_start, hdr_end) = c.eh_frame_hdr?;
    let hdr_len = usize::try_from(hdr_end.checked_sub(hdr_start)?).ok()?;
    if hdr_len < 8 {
        return None;
    }
    // SAFETY: PT_GNU_EH_FRAME lies inside a loaded segment of a module the loader just
    // listed; it stays mapped while the module is loaded.
    let hdr: &'static [u8] = unsafe { std::slice::from_raw_parts(hdr_start as *const u8, hdr_len) };
    let eh_frame_start = decode_eh_frame_ptr(hdr, hdr_start, c.base)?;
    // `.eh_frame` runs at most to the end of the loaded segment that holds it.
    let seg_end = c
        .loads
        .iter()
        .find(|(s, e)| (*s..*e).contains(&eh_frame_start))?
        .1;
    let eh_len = usize::try_from(seg_end.checked_sub(eh_frame_start)?).ok()?;
    let eh_frame: &'static [u8] =
        // SAFETY: `[eh_frame_start, seg_end)` is inside one loaded segment of this module.
        unsafe { std::slice::from_raw_parts(eh_frame_start as *const u8, eh_len) };
    let svma = |a: u64| a.wrapping_sub(c.base);
    let info = framehop::ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: Some(svma(start)..svma(end)),
        eh_frame_svma: Some(svma(eh_frame_start)..svma(seg_end)),
        eh_frame: Some(eh_frame),
        eh_frame_hdr_svma: Some(svma(hdr_start)..svma(hdr_end)),
        eh_frame_hdr: Some(hdr),
        ..Default::default()
    };
    Some(framehop::Module::new(
        c.path.clone(),
        start..end,
        c.base,
        info,
    ))
}

/// The address of `.eh_frame` from an `.eh_frame_hdr` (version 1) header.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn decode_eh_frame_ptr(hdr: &[u8], hdr_addr: u64, base: u64) -> Option<u64> {
    if *hdr.first()? != 1 {
        return None;
    }
    let enc = *hdr.get(1)?;
    let field = hdr_addr + 4;
    let b4 = |i: usize| -> Option<[u8; 4]> { hdr.get(i..i + 4)?.try_into().ok() };
    let b8 = |i: usize| -> Option<[u8; 8]> { hdr.get(i..i + 8)?.try_into().ok() };
    let value: u64 = match enc & 0x0f {
        0x03 => u32::from_le_bytes(b4(4)?) as u64,
        0x0b => i32::from_le_bytes(b4(4)?) as i64 as u64,
        0x00 | 0x04 | 0x0c => u64::from_le_bytes(b8(4)?),
        _ => return None,
    };
    match enc & 0x70 {
        0x10 => Some(field.wrapping_add(value)),    // pc-relative
        0x00 => Some(base.wrapping_add(value)),     // absolute (stated address)
        0x30 => Some(hdr_addr.wrapping_add(value)), // data-relative (to the header)
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_loaded_counts_the_loaded_ones() {
        // At least the test binary, libc and the loader itself.
        assert!(libraries_loaded() >= 3);
    }

    #[test]
    fn table_contains_own_text_and_libc() {
        let t = ensure();
        let own = t
            .find(own_marker as *const () as usize as u64)
            .expect("own code is in a module");
        assert!(t.is_own(own));
        let libc_pc = libc::malloc as *const () as usize as u64;
        let m = t.find(libc_pc).expect("malloc is in a module");
        assert!(!t.is_own(m));
        assert!(t.modules[m].path.contains("libc"), "{}", t.modules[m].path);
        assert_eq!(t.find(0x10), None);
    }

    #[test]
    fn eh_frame_ptr_pcrel_sdata4() {
        // version 1, eh_frame_ptr_enc 0x1b, fde_count_enc, table_enc, then -0x100 as i32.
        let mut hdr = vec![1u8, 0x1b, 0x03, 0x3b];
        hdr.extend_from_slice(&(-0x100i32).to_le_bytes());
        assert_eq!(decode_eh_frame_ptr(&hdr, 0x5000, 0), Some(0x5004 - 0x100));
        hdr[0] = 2;
        assert_eq!(decode_eh_frame_ptr(&hdr, 0x5000, 0), None);
    }
}
