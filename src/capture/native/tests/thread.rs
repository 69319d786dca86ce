//! Tests of a thread's unwind state (`super`: thread.rs).

use super::*;
use crate::channel::event::StackSlot;

/// Bytes of `[start, start + len)` resident in memory (`mincore`).
fn resident_bytes(start: usize, len: usize) -> usize {
    let page = 4096;
    let (first, end) = (start / page * page, (start + len).div_ceil(page) * page);
    let mut flags = vec![0u8; (end - first) / page];
    // SAFETY: `first` is page-aligned, the range is one live mapping (the thread's
    // state), and `flags` has a byte for each of its pages.
    let rc = unsafe { libc::mincore(first as *mut libc::c_void, end - first, flags.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    flags.iter().filter(|&&f| f & 1 != 0).count() * page
}

#[test]
fn a_threads_first_walk_makes_resident_only_the_pages_it_writes() {
    let (size, resident) = std::thread::spawn(|| {
        let (mut slot, mut trail) = (StackSlot::EMPTY, crate::capture::Trail::EMPTY);
        let stacks = crate::config::Stacks::Native;
        crate::capture::capture(&mut slot, &mut trail, stacks, 64);
        assert!(slot.n_native > 0, "the walk found frames");
        let state = UNWIND.with(|c| c.get());
        assert!(
            !state.is_null() && state != STATE_GONE,
            "the thread has its state"
        );
        let size = std::mem::size_of::<ThreadUnwind>();
        (size, resident_bytes(state as usize, size))
    })
    .join()
    .expect("the capturing thread");
    assert!(
        size > 8 << 20,
        "the state is {size} bytes: the tables changed size"
    );
    // Zeroing the state at allocation (what the allocator does for a type aligned
    // above 16 bytes) would make all of it resident.
    assert!(
        resident < 1 << 20,
        "{resident} of {size} bytes resident after one walk"
    );
}
