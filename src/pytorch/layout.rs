//! Where PyTorch's `TraceEntry` keeps the fields memsnap reads, per PyTorch release.
//!
//! Cold to look up (once, at attach), hot to use (every trace entry). The table is the
//! only version knowledge the route needs: the allocator's methods are found by their
//! symbols at run time (docs/PYTORCH.md, "Finding the allocator"). How a release is
//! checked and added: docs/PYTORCH.md, "Adding a PyTorch release".

/// What the allocator reports, in the order of PyTorch's `TraceEntry::Action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
    /// A value this table does not name (ignored).
    Other,
}

/// Byte offsets of the fields memsnap reads in one `TraceEntry`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntryLayout {
    /// `Action action_` (a 4-byte enum).
    pub action: usize,
    /// `c10::DeviceIndex device_` (int8).
    pub device: usize,
    /// `size_t addr_` (free device bytes for `OOM`).
    pub addr: usize,
    /// `cudaStream_t stream_`.
    pub stream: usize,
    /// `size_t size_`: the requested size for block events, the segment's for segment
    /// events.
    pub size: usize,
    /// `MempoolId_t mempool_`: two 64-bit ids, the pool that owns the block or segment
    /// (`(0, 0)`: the default pool; a CUDA graph's private pool or a `torch.cuda.MemPool`
    /// otherwise). Read for segment entries only (`SEGMENT_ALLOC`, `SEGMENT_MAP`), where
    /// PyTorch passes the segment's `pool->owner_MempoolId()`. `None` where the entry has no
    /// pool (2.4 to 2.7): every segment is then the default pool's.
    pub mempool: Option<usize>,
    /// `trace_time_ time_`: when PyTorch made the entry, on its approximate clock, which on
    /// x86-64 is the time-stamp counter (`rdtsc` in `record_trace` of every release from
    /// 2.4 to 2.15, read from the wheels' `libc10_cuda.so`): the event clock's own reading
    /// when that is the counter too (`process::clock`), so the tracker reads no clock.
    pub time: usize,
}

impl TraceEntryLayout {
    /// The action of `code`, `TraceEntry::Action`'s value (the same from 2.1 on;
    /// `USER_DEFINED`, added later, comes last and is not read). Comparisons for the three
    /// actions of nearly every entry, the others out of line: an array of actions, and the
    /// jump table the tracker's `match` on its result became, were two cache lines every
    /// entry read (docs/HOT-PATH.md, "The tracker's lines").
    #[inline(always)]
    pub fn action(&self, code: u32) -> Action {
        match code {
            0 => Action::Alloc,
            1 => Action::FreeRequested,
            2 => Action::FreeCompleted,
            _ => rare_action(code),
        }
    }
}

/// `action_, device_, addr_, context_ (shared_ptr, 16 bytes), stream_, size_, mempool_ (two
/// 64-bit ids), time_`: the order of every release from 2.8 to 2.15 (checked from each
/// release's headers by scripts/check-torch-release.py).
const FROM_2_8: TraceEntryLayout = TraceEntryLayout {
    action: 0,
    device: 4,
    addr: 8,
    stream: 32,
    size: 40,
    mempool: Some(48),
    time: 64,
};

/// `action_, device_, addr_, context_ (shared_ptr, 16 bytes), stream_, size_, time_`: the
/// order of every release from 2.4 to 2.7, the same as 2.8's without `mempool_` (which 2.8
/// put before `time_`), so only the time moves (checked from each release's headers by
/// scripts/check-torch-release.py; the offsets by compiling the struct).
const FROM_2_4: TraceEntryLayout = TraceEntryLayout {
    action: 0,
    device: 4,
    addr: 8,
    stream: 32,
    size: 40,
    mempool: None,
    time: 48,
};

/// [`TraceEntryLayout::action`] past the three actions of nearly every entry.
#[cold]
#[inline(never)]
fn rare_action(code: u32) -> Action {
    match code {
        3 => Action::SegmentAlloc,
        4 => Action::SegmentFree,
        5 => Action::SegmentMap,
        6 => Action::SegmentUnmap,
        7 => Action::Snapshot,
        8 => Action::Oom,
        _ => Action::Other,
    }
}

/// A range of releases, `(major, minor)` to `(major, minor)` inclusive, with one layout.
struct Releases {
    from: (u32, u32),
    to: (u32, u32),
    layout: TraceEntryLayout,
}

/// Releases whose layout is known. A layout's number is its place here plus one
/// ([`number_for_version`]); [`by_number`] names each place.
const KNOWN: [Releases; 2] = [
    Releases {
        from: (2, 8),
        to: (2, 15),
        layout: FROM_2_8,
    },
    Releases {
        from: (2, 4),
        to: (2, 7),
        layout: FROM_2_4,
    },
];

/// The number of the layout for PyTorch `version` (`"2.11.0+cu130"`, `"2.12.0a0+git..."`),
/// if known: its place in the table of known layouts plus one, so that 0 is "none". The
/// tracker's line keeps this number (`process::hook_line`), and [`by_number`] gives the
/// layout back with its offsets as constants (no table read while there is one layout).
pub fn number_for_version(version: &str) -> Option<u8> {
    let release = major_minor(version)?;
    let at = KNOWN
        .iter()
        .position(|r| r.from <= release && release <= r.to)?;
    u8::try_from(at + 1).ok()
}

/// The layout numbered `number` ([`number_for_version`]); `None` for 0. A `match` on
/// constants, not an index into [`KNOWN`]: the offsets stay constants in the tracker's code
/// (the layouts differ only in `time`, which becomes a choice between two numbers) and no
/// table is read on an entry.
#[inline(always)]
pub fn by_number(number: u8) -> Option<TraceEntryLayout> {
    match number {
        1 => Some(KNOWN[0].layout),
        2 => Some(KNOWN[1].layout),
        _ => None,
    }
}

/// `(major, minor)` of a version string.
pub fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    Some((major, minor.parse().ok()?))
}

/// `__version__` from the text of PyTorch's `version.py`.
pub fn version_from_py(text: &str) -> Option<&str> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("__version__")?.trim_start();
        let rest = rest.strip_prefix('=')?.trim();
        let quote = rest.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let inner = &rest[1..];
        Some(&inner[..inner.find(quote)?])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout for PyTorch `version`, if known.
    fn for_version(version: &str) -> Option<TraceEntryLayout> {
        by_number(number_for_version(version)?)
    }

    #[test]
    fn a_layouts_number_gives_it_back() {
        assert_eq!(number_for_version("2.11.0+cu130"), Some(1));
        assert_eq!(by_number(1), Some(FROM_2_8));
        assert_eq!(number_for_version("2.7.1+cu126"), Some(2));
        assert_eq!(by_number(2), Some(FROM_2_4));
        assert_eq!(by_number(0), None, "0 is no layout");
        assert_eq!(by_number(KNOWN.len() as u8 + 1), None);
        assert_eq!(number_for_version("2.3.1"), None);
        for (at, r) in KNOWN.iter().enumerate() {
            let number = u8::try_from(at + 1).unwrap();
            assert_eq!(
                by_number(number),
                Some(r.layout),
                "by_number names place {at}"
            );
            assert_eq!(
                number_for_version(&format!("{}.{}.0", r.from.0, r.from.1)),
                Some(number)
            );
        }
    }

    /// The offsets of 2.4 to 2.7 (`TraceEntry` in each wheel's
    /// `c10/cuda/CUDACachingAllocator.h`, the same text in 2.4.1, 2.5.1, 2.6.0 and 2.7.1;
    /// compiled with `offsetof`: action 0, device 4, addr 8, context 16, stream 32, size 40,
    /// time 48, 56 bytes) read back from an entry written in that layout.
    #[test]
    fn an_entry_of_2_4_to_2_7_is_read_at_its_offsets() {
        let mut e = [0u8; 56];
        e[0..4].copy_from_slice(&3u32.to_ne_bytes());
        e[4] = 2;
        e[8..16].copy_from_slice(&0x7f00_0020_0000u64.to_ne_bytes());
        e[16..32].fill(0xcc); // the context's shared_ptr
        e[32..40].copy_from_slice(&0x5eu64.to_ne_bytes());
        e[40..48].copy_from_slice(&(2u64 << 20).to_ne_bytes());
        e[48..56].copy_from_slice(&123_456_789u64.to_ne_bytes());
        let l = for_version("2.6.0+cu124").expect("2.6 is known");
        let u64_at = |at: usize| u64::from_ne_bytes(e[at..at + 8].try_into().unwrap());
        let code = u32::from_ne_bytes(e[l.action..l.action + 4].try_into().unwrap());
        assert_eq!(l.action(code), Action::SegmentAlloc);
        assert_eq!(e[l.device], 2);
        assert_eq!(u64_at(l.addr), 0x7f00_0020_0000);
        assert_eq!(u64_at(l.stream), 0x5e);
        assert_eq!(u64_at(l.size), 2 << 20);
        assert_eq!(u64_at(l.time), 123_456_789);
        assert!(
            l.time + 8 <= e.len(),
            "the time is inside the 56-byte entry"
        );
    }

    #[test]
    fn versions_map_to_layouts() {
        assert_eq!(major_minor("2.11.0+cu130"), Some((2, 11)));
        assert_eq!(major_minor("2.12.0a0+git1234"), Some((2, 12)));
        assert_eq!(major_minor("2.9"), Some((2, 9)));
        assert_eq!(major_minor("garbage"), None);
        assert_eq!(for_version("2.11.0+cu130"), Some(FROM_2_8));
        assert_eq!(for_version("2.8.0"), Some(FROM_2_8));
        assert_eq!(for_version("2.15.1"), Some(FROM_2_8));
        assert_eq!(for_version("2.7.1"), Some(FROM_2_4));
        assert_eq!(for_version("2.4.1+cu121"), Some(FROM_2_4));
        assert_eq!(for_version("2.5.1+cu124"), Some(FROM_2_4));
        assert_eq!(for_version("2.3.1"), None);
        assert_eq!(for_version("1.13.1"), None);
        assert_eq!(for_version("2.16.0"), None);
        assert_eq!(for_version("3.0.0"), None);
    }

    #[test]
    fn version_py_is_read() {
        let text = "from typing import Optional\n\n__all__ = ['__version__']\n\
                    __version__ = '2.11.0+cu130'\ndebug = False\n";
        assert_eq!(version_from_py(text), Some("2.11.0+cu130"));
        assert_eq!(version_from_py("__version__ = \"2.9.1\"\n"), Some("2.9.1"));
        assert_eq!(version_from_py("version = '1'\n"), None);
    }

    #[test]
    fn the_pool_id_sits_between_the_size_and_the_time() {
        // `size_t size_` ends at 48 and `trace_time_ time_` starts at 64: the two 64-bit
        // ids of `MempoolId_t` fill the gap exactly.
        let l = FROM_2_8;
        assert_eq!(l.mempool, Some(l.size + 8));
        assert_eq!(l.mempool.map(|at| at + 16), Some(l.time));
        // 2.4 to 2.7 have none: the time follows the size.
        assert_eq!((FROM_2_4.mempool, FROM_2_4.time), (None, FROM_2_4.size + 8));
    }

    #[test]
    fn actions_follow_pytorchs_order() {
        for l in [FROM_2_8, FROM_2_4] {
            actions_in_order(l);
        }
    }

    fn actions_in_order(l: TraceEntryLayout) {
        let order = [
            Action::Alloc,
            Action::FreeRequested,
            Action::FreeCompleted,
            Action::SegmentAlloc,
            Action::SegmentFree,
            Action::SegmentMap,
            Action::SegmentUnmap,
            Action::Snapshot,
            Action::Oom,
        ];
        for (code, action) in order.into_iter().enumerate() {
            assert_eq!(l.action(code as u32), action, "code {code}");
        }
        assert_eq!(l.action(9), Action::Other, "USER_DEFINED is not read");
        assert_eq!(l.action(u32::MAX), Action::Other);
    }
}
