//! Cache hints: ask for the line holding an address before it is read or written, so that
//! the wait for it overlaps other work. Hot: the capture's walks, the send and the lanes'
//! push use them. A hint changes no register, flag or memory the program sees and never
//! faults, whatever the address (`capture::python`'s test
//! `a_prefetch_of_memory_gone_or_never_mapped_does_nothing`).

/// Brings the line holding `addr` into the cache, to be read.
#[inline(always)]
pub fn prefetch_line(addr: u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it changes no register or memory the program sees and
    // does not fault, whatever the address (docs/HOT-PATH.md, "The Python walk's cache
    // misses").
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as above (`PRFM` is a hint; it does not fault).
    unsafe {
        std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) addr, options(nostack, readonly, preserves_flags))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = addr;
}

/// Brings the line holding `addr` into the cache ready to be written (`prefetchw`; a no-op
/// where the processor lacks it, and on other architectures a read prefetch).
#[inline(always)]
pub fn prefetch_for_write(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a hint: no register, flag or memory the program sees changes, and it does not
    // fault whatever the address (x86's PREFETCHW; older processors run it as a no-op).
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) addr, options(nostack, readonly, preserves_flags))
    };
    #[cfg(not(target_arch = "x86_64"))]
    prefetch_line(addr as u64);
}
