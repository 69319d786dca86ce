//! Thread-locals that a hooked call reaches from the thread pointer, without a call: the
//! initial-exec model of ELF thread-local storage, which `thread_local!` does not offer
//! on stable Rust.
//!
//! Hot: every hooked call reads its thread's hook state through one of these. In a shared
//! library `thread_local!` uses the general-dynamic model: each access is a call to glibc's
//! `__tls_get_addr` (through the procedure linkage table), which reads the thread's table
//! of modules and the loader's generation count, lines that the program's own work pushes
//! out between two events. The initial-exec model places the variable in the static block
//! every thread gets at its start: its address is the thread pointer (`fs:0`) plus an
//! offset the loader wrote once into the library's global offset table. Counted: 13
//! instructions and one cache line less an event (docs/HOT-PATH.md, "The thread pointer").
//!
//! The price: the library is marked `STATIC_TLS`, so its whole thread-local block (about
//! 350 bytes with the standard library's) is placed at load: with the program's when
//! preloaded (as memsnap is), else in glibc's spare static block when opened later with
//! `dlopen` (512 bytes by default, `glibc.rtld.optional_static_tls`). Only x86-64 Linux
//! uses the model; elsewhere the same declaration is a `thread_local!`.

use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

/// A type whose all-zero bytes are a valid value: an initial-exec variable starts as zero
/// bytes (the loader zeroes each thread's block), like a `.bss` static.
///
/// # Safety
/// All-zero bytes must be a valid value of the type, and the value its users expect first.
pub unsafe trait ZeroIsValid {}

// SAFETY: zero is a valid integer.
unsafe impl ZeroIsValid for u64 {}
// SAFETY: zero is the null pointer, a valid raw pointer.
unsafe impl<T> ZeroIsValid for *mut T {}
// SAFETY: a `Cell` has the layout and valid values of what it holds.
unsafe impl<T: ZeroIsValid> ZeroIsValid for Cell<T> {}
// SAFETY: a tuple of two types each valid as zero bytes (padding may hold anything).
unsafe impl<A: ZeroIsValid, B: ZeroIsValid> ZeroIsValid for (A, B) {}

/// Compile-time checks of a declared type: valid as zero bytes, and without a destructor
/// (none would run: the storage is the thread's own, freed with it).
pub const fn check<T: ZeroIsValid>() {
    assert!(!std::mem::needs_drop::<T>());
}

/// A per-thread `T`, declared with [`initial_exec_thread_local!`]. Like a
/// `std::thread::LocalKey`: each thread sees its own value, valid for the thread's whole
/// life (during its exit as well; there is no destructor).
pub struct ThreadLocal<T: 'static> {
    /// The calling thread's copy (the declaration's accessor; a constant of the static, so
    /// the call is inlined).
    address: fn() -> *const T,
    /// The variable's offset from the thread pointer, read from the global offset table
    /// (never 0: the static block lies below the thread pointer).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    offset: fn() -> isize,
}

impl<T: 'static> ThreadLocal<T> {
    /// # Safety
    /// `address` must return the calling thread's copy of the variable: memory holding a
    /// valid `T` for the thread's whole life, used by no other thread; `offset`, that
    /// copy's distance from the thread pointer.
    #[doc(hidden)]
    pub const unsafe fn new(
        address: fn() -> *const T,
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))] offset: fn() -> isize,
    ) -> ThreadLocal<T> {
        ThreadLocal {
            address,
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            offset,
        }
    }

    /// Runs `f` with the calling thread's value.
    #[inline(always)]
    pub fn with<R>(&'static self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: the thread's own copy, alive for the thread's whole life (`new`'s
        // contract), which outlives this call.
        f(unsafe { &*(self.address)() })
    }

    /// The calling thread's copy: valid on this thread for its whole life, never on
    /// another.
    #[inline(always)]
    pub fn as_ptr(&'static self) -> *const T {
        (self.address)()
    }

    /// [`ThreadLocal::as_ptr`] without reading the global offset table: the variable's
    /// offset from the thread pointer (the same for every thread of the process) is read
    /// from the table once and kept in `offset`, which its caller places on a cache line
    /// it reads anyway (0: not read yet). Elsewhere than x86-64 Linux, `as_ptr`.
    ///
    /// # Safety
    /// `offset` must be this variable's keeper alone: 0, or what this function stored there
    /// for this variable.
    #[inline(always)]
    pub unsafe fn as_ptr_through(&'static self, offset: &AtomicIsize) -> *const T {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let mut at = offset.load(Relaxed);
            if at == 0 {
                at = (self.offset)();
                offset.store(at, Relaxed);
            }
            thread_pointer().wrapping_offset(at) as *const T
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            let _ = offset;
            self.as_ptr()
        }
    }
}

/// The thread pointer: the address the thread control block holds in its first word (the
/// x86-64 ELF TLS ABI), from which every static thread-local is at a fixed offset.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline(always)]
fn thread_pointer() -> *const u8 {
    let at: *const u8;
    // SAFETY: reads the first word of the thread control block, which `fs` addresses on
    // every x86-64 Linux thread. Reads only; no stack, no flags.
    unsafe {
        std::arch::asm!(
            "mov {at}, qword ptr fs:[0]",
            at = out(reg) at,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
    at
}

/// Declares a per-thread `static NAME: ThreadLocal<TYPE>`, zero bytes at each thread's
/// start, with the assembler symbol that holds it (unique in the library; hidden, never
/// exported): `initial_exec_thread_local!(static NAME: TYPE, symbol "memsnap_...";)`.
/// `TYPE` must be [`ZeroIsValid`] and have no destructor.
macro_rules! initial_exec_thread_local {
    ($(#[$attr:meta])* $vis:vis static $name:ident: $ty:ty, symbol $sym:literal;) => {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        ::core::arch::global_asm!(
            concat!(".pushsection .tbss.", $sym, ",\"awT\",@nobits"),
            concat!(".globl ", $sym),
            concat!(".hidden ", $sym),
            concat!(".type ", $sym, ",@object"),
            concat!(".size ", $sym, ", {size}"),
            ".balign {align}",
            concat!($sym, ":"),
            ".zero {size}",
            ".popsection",
            size = const ::core::mem::size_of::<$ty>(),
            align = const ::core::mem::align_of::<$ty>(),
        );

        $(#[$attr])*
        $vis static $name: $crate::initial_exec::ThreadLocal<$ty> = {
            const _: () = $crate::initial_exec::check::<$ty>();

            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            #[inline(always)]
            fn offset() -> isize {
                let at: isize;
                // SAFETY: reads the variable's offset from the thread pointer, which the
                // loader wrote into the global offset table (a `R_X86_64_TPOFF64`
                // relocation). Reads only; no stack, no flags.
                unsafe {
                    ::core::arch::asm!(
                        concat!("mov {at}, qword ptr [rip + ", $sym, "@GOTTPOFF]"),
                        at = out(reg) at,
                        options(pure, readonly, nostack, preserves_flags),
                    )
                };
                at
            }

            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            #[inline(always)]
            fn address() -> *const $ty {
                let at: *const $ty;
                // SAFETY: reads the thread pointer's first word (the thread control block
                // points to itself there, as the x86-64 ELF TLS ABI requires) and the
                // variable's offset from it (see `offset`); their sum is this thread's
                // copy in its static TLS block. Reads only; no stack, no other register.
                unsafe {
                    ::core::arch::asm!(
                        "mov {at}, qword ptr fs:[0]",
                        concat!("add {at}, qword ptr [rip + ", $sym, "@GOTTPOFF]"),
                        at = out(reg) at,
                        options(pure, readonly, nostack),
                    )
                };
                at
            }

            #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
            #[inline(always)]
            fn address() -> *const $ty {
                ::std::thread_local! {
                    // SAFETY: the type is valid as zero bytes (`check` above).
                    static STORAGE: $ty = const { unsafe { ::core::mem::zeroed() } };
                }
                STORAGE.with(|value| value as *const $ty)
            }

            // SAFETY: `address` gives the calling thread's own copy, zero bytes at the
            // thread's start (a valid value: `check`), for the thread's whole life, and
            // `offset` its distance from the thread pointer.
            unsafe {
                $crate::initial_exec::ThreadLocal::new(
                    address,
                    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                    offset,
                )
            }
        };
    };
}
pub(crate) use initial_exec_thread_local;

#[cfg(test)]
mod tests {
    use super::*;

    initial_exec_thread_local! {
        static COUNTER: Cell<u64>, symbol "memsnap_test_counter";
    }

    initial_exec_thread_local! {
        static PAIR: Cell<(u64, u64)>, symbol "memsnap_test_pair";
    }

    #[test]
    fn each_thread_starts_at_zero_and_keeps_its_own_value() {
        COUNTER.with(|c| c.set(7));
        PAIR.with(|p| p.set((1, 2)));
        let other = std::thread::spawn(|| {
            let seen = (COUNTER.with(|c| c.get()), PAIR.with(|p| p.get()));
            COUNTER.with(|c| c.set(99));
            (seen, COUNTER.as_ptr() as usize)
        })
        .join()
        .unwrap();
        assert_eq!(other.0, (0, (0, 0)), "a new thread starts from zero bytes");
        assert_eq!(
            COUNTER.with(|c| c.get()),
            7,
            "another thread wrote this one's"
        );
        assert_eq!(PAIR.with(|p| p.get()), (1, 2));
        assert_ne!(
            other.1,
            COUNTER.as_ptr() as usize,
            "two threads, one address"
        );
        assert_ne!(COUNTER.as_ptr() as usize, PAIR.as_ptr() as usize);
    }

    #[test]
    fn the_address_through_a_kept_offset_is_each_threads_own() {
        static OFFSET: AtomicIsize = AtomicIsize::new(0);
        // SAFETY: OFFSET keeps COUNTER's offset alone (here and below).
        let here = unsafe { COUNTER.as_ptr_through(&OFFSET) };
        assert_eq!(here, COUNTER.as_ptr());
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        assert_ne!(OFFSET.load(Relaxed), 0, "the offset was kept");
        let kept = OFFSET.load(Relaxed);
        let other = std::thread::spawn(|| {
            (
                // SAFETY: as above.
                unsafe { COUNTER.as_ptr_through(&OFFSET) } as usize,
                COUNTER.as_ptr() as usize,
            )
        })
        .join()
        .unwrap();
        assert_eq!(
            other.0, other.1,
            "another thread's copy, through the kept offset"
        );
        assert_ne!(other.0, here as usize);
        assert_eq!(OFFSET.load(Relaxed), kept, "read from the table once");
    }

    #[repr(C, align(64))]
    struct Line(Cell<u64>);
    // SAFETY: a `Cell<u64>` is valid as zero bytes.
    unsafe impl ZeroIsValid for Line {}

    initial_exec_thread_local! {
        static LINE: Line, symbol "memsnap_test_line";
    }

    #[test]
    fn the_address_is_aligned_for_its_type() {
        for _ in 0..2 {
            let at = std::thread::spawn(|| LINE.as_ptr() as usize)
                .join()
                .unwrap();
            assert_eq!(at % 64, 0);
        }
        assert_eq!(LINE.as_ptr() as usize % 64, 0);
    }
}
