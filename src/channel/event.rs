//! The fixed-size records that travel from a hook to the writer thread.
//!
//! Hot: built on the host's CUDA call path, so everything here is `Copy`, heap-free and
//! written in place. An [`Event`] is small; its stack, if any, travels as a [`StackRef`]:
//! in full in a [`StackSlot`] borrowed from a fixed pool the first time a thread sends it,
//! by its [`StackSlot::identity_hash`] afterwards (see [`sent`](super::sent)).

use crate::config::FRAME_CAPACITY;
use crate::process::clock::Stamp;

/// What happened. `#[repr(u8)]` and `Copy`: written by hooks, read by the writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Device allocation at `addr` of `size` bytes on `device`; payload: the stream.
    Alloc,
    /// Free of `addr` (size unknown to the hook); payload: the stream. Recorded before the
    /// real free so a recycled address can never appear allocated twice.
    Free,
    /// Managed (unified) allocation: kept out of `device_traces` (docs/FORMAT.md, managed
    /// memory).
    AllocManaged,
    /// `cuMemCreate`: physical memory of `size` bytes; payload: the handle. `device` < 0
    /// when the location is not a device (host NUMA memory, as NCCL makes).
    MemCreate,
    /// `cuMemRelease`; payload: the handle.
    MemRelease,
    /// `cuMemMap` of `[addr, addr+size)`; payload: the handle mapped there.
    Map,
    /// `cuMemUnmap` of `[addr, addr+size)`; recorded before the real call.
    Unmap,
    /// `cuMemAddressReserve` of `[addr, addr+size)` (virtual only, no memory).
    Reserve,
    /// `cuMemAddressFree` of `[addr, addr+size)`.
    ReserveFree,
    /// An allocation of `size` bytes failed with out-of-memory; payload: [`Payload::Oom`].
    Oom,
    /// PyTorch's caching allocator handed out a block of `size` requested bytes at `addr`
    /// inside one of its segments (no CUDA call: reported by its trace tracker).
    BlockAlloc,
    /// The program freed the block at `addr` (`size`: its requested bytes); it stays
    /// reserved until [`Kind::BlockFreeCompleted`] (streams that used it may still run).
    BlockFreeRequested,
    /// The block at `addr` went back to the allocator's free space.
    BlockFreeCompleted,
    /// The caching allocator took `[addr, addr+size)`, just allocated through CUDA (an
    /// [`Kind::Alloc`] before it), as one of its segments.
    CacheSegment,
    /// The caching allocator mapped `[addr, addr+size)` into one of its expandable
    /// segments (the [`Kind::Map`]s before it).
    CacheSegmentMap,
    /// The segment (or mapping) `[addr, addr+size)` that the same thread's
    /// [`Kind::CacheSegment`] or [`Kind::CacheSegmentMap`] just before it reported belongs
    /// to a private memory pool (a CUDA graph's, or a `torch.cuda.MemPool`); payload:
    /// [`Payload::Pool`]. Not sent for the default pool.
    CachePool,
    /// A step boundary (`memsnap_step()`, or PyTorch's optimizer step: [`Payload::Step`]
    /// says which): carried as an event so that it is ordered with the allocations around
    /// it. (Dump and exit requests do not wait in the queue: see
    /// [`handshake`](super::handshake).)
    Step,
}

/// What an event carries beyond address, size and device, by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    None,
    /// The stream of an allocation or free (0: the legacy default stream).
    Stream(u64),
    /// The physical-memory handle of a VMM call.
    Handle(u64),
    Oom {
        /// Free bytes on the device from cuMemGetInfo, when the driver answered.
        free_bytes: Option<u64>,
        stream: u64,
        /// Non-zero: the failing call waits for this out-of-memory snapshot ticket (at
        /// most [`MAX_OOM_DUMPS`]).
        dump_ticket: u8,
    },
    /// The private pool a [`Kind::CachePool`] names.
    Pool(PoolId),
    /// Who marked a [`Kind::Step`].
    Step(StepOrigin),
}

/// Who marked a step boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StepOrigin {
    /// The program: `memsnap_step()` (`memsnap.step()`, the framework callbacks).
    Program = 0,
    /// PyTorch's optimizer step, through the hook memsnap attached (`pytorch::optimizer`).
    Optimizer = 1,
}

/// A memory pool of PyTorch's caching allocator: its `MempoolId_t`, two 64-bit ids (a
/// CUDA graph's own pool has the first set, a pool from `torch.cuda.graph_pool_handle()` or
/// `torch.cuda.MemPool` the second). `(0, 0)` is the default pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId {
    pub first: u64,
    pub second: u64,
}

impl PoolId {
    /// The default pool, where every allocation outside a private pool goes.
    pub const DEFAULT: PoolId = PoolId {
        first: 0,
        second: 0,
    };

    /// Whether this is a private pool (not the default one).
    pub fn is_private(self) -> bool {
        self != PoolId::DEFAULT
    }
}

/// A program that runs out of memory in a loop gets at most this many out-of-memory
/// snapshots (`record`): the tickets are 1 to this, and travel in a byte.
pub const MAX_OOM_DUMPS: u8 = 16;

impl Payload {
    /// The stream of an allocation, free or failed allocation (0 for other payloads).
    pub fn stream(self) -> u64 {
        match self {
            Payload::Stream(s) | Payload::Oom { stream: s, .. } => s,
            _ => 0,
        }
    }
    /// The VMM handle (0 for other payloads).
    pub fn handle(self) -> u64 {
        match self {
            Payload::Handle(h) => h,
            _ => 0,
        }
    }
}

/// Which CUDA entry point produced an event (written as `user_metadata`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Api {
    CuMemAlloc,
    CuMemAllocPitch,
    CuMemAllocManaged,
    CuMemAllocAsync,
    CuMemAllocFromPoolAsync,
    CuMemFree,
    CuMemFreeAsync,
    CuMemCreate,
    CuMemRelease,
    CuMemAddressReserve,
    CuMemAddressFree,
    CuMemMap,
    CuMemUnmap,
    CudaMalloc,
    CudaMallocAsync,
    CudaMallocFromPoolAsync,
    CudaMallocManaged,
    CudaMallocPitch,
    CudaMalloc3D,
    CudaFree,
    CudaFreeAsync,
    /// Not a CUDA call: `memsnap_step`.
    Memsnap,
    /// Not a CUDA call: PyTorch's caching allocator, through its trace tracker.
    CachingAllocator,
}

impl Api {
    /// Every variant, in discriminant order (`ALL[a as usize] == a`).
    pub const ALL: [Api; 23] = [
        Api::CuMemAlloc,
        Api::CuMemAllocPitch,
        Api::CuMemAllocManaged,
        Api::CuMemAllocAsync,
        Api::CuMemAllocFromPoolAsync,
        Api::CuMemFree,
        Api::CuMemFreeAsync,
        Api::CuMemCreate,
        Api::CuMemRelease,
        Api::CuMemAddressReserve,
        Api::CuMemAddressFree,
        Api::CuMemMap,
        Api::CuMemUnmap,
        Api::CudaMalloc,
        Api::CudaMallocAsync,
        Api::CudaMallocFromPoolAsync,
        Api::CudaMallocManaged,
        Api::CudaMallocPitch,
        Api::CudaMalloc3D,
        Api::CudaFree,
        Api::CudaFreeAsync,
        Api::Memsnap,
        Api::CachingAllocator,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Api::CuMemAlloc => "cuMemAlloc",
            Api::CuMemAllocPitch => "cuMemAllocPitch",
            Api::CuMemAllocManaged => "cuMemAllocManaged",
            Api::CuMemAllocAsync => "cuMemAllocAsync",
            Api::CuMemAllocFromPoolAsync => "cuMemAllocFromPoolAsync",
            Api::CuMemFree => "cuMemFree",
            Api::CuMemFreeAsync => "cuMemFreeAsync",
            Api::CuMemCreate => "cuMemCreate",
            Api::CuMemRelease => "cuMemRelease",
            Api::CuMemAddressReserve => "cuMemAddressReserve",
            Api::CuMemAddressFree => "cuMemAddressFree",
            Api::CuMemMap => "cuMemMap",
            Api::CuMemUnmap => "cuMemUnmap",
            Api::CudaMalloc => "cudaMalloc",
            Api::CudaMallocAsync => "cudaMallocAsync",
            Api::CudaMallocFromPoolAsync => "cudaMallocFromPoolAsync",
            Api::CudaMallocManaged => "cudaMallocManaged",
            Api::CudaMallocPitch => "cudaMallocPitch",
            Api::CudaMalloc3D => "cudaMalloc3D",
            Api::CudaFree => "cudaFree",
            Api::CudaFreeAsync => "cudaFreeAsync",
            Api::Memsnap => "memsnap",
            Api::CachingAllocator => "CUDACachingAllocator",
        }
    }
}

/// How an event's stack travels to the writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackRef {
    /// No stack: none asked for, an empty walk, or the writer gone.
    None,
    /// In full, in stack slot `index`; `hash` is its [`StackSlot::identity_hash`], by which
    /// the same thread may refer to it later.
    Slot { index: StackSlotIndex, hash: u64 },
    /// The same stack as one this thread sent earlier in a [`StackRef::Slot`] with this
    /// hash: the writer has it already (a thread's events reach it in the thread's order).
    Sent { hash: u64 },
}

/// The number of a stack slot (`channel::queue::MAX_STACK_SLOTS` of them at most).
pub type StackSlotIndex = u16;

/// Which [`StackRef`] an event holds (its compact form's tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum StackForm {
    None,
    Slot,
    Sent,
}

/// One event, as it travels through a thread's lane: 56 bytes, so that with the lane's
/// 8-byte publication mark an event fills one cache line of its own (an event of 88 bytes
/// wrote one and a half: docs/HOT-PATH.md, "One line an event"). The stack reference and
/// the payload are kept in a compact form of their own, written by [`Event::stackless`]
/// (and [`Event::set_stack`], [`Event::set_addr`]) and read through [`Event::stack`],
/// [`Event::payload`] and [`Event::addr`]: an
/// out-of-memory event has no address, and its payload's free memory is kept in the
/// address's place (`u64::MAX`: the driver did not answer). A pool event
/// ([`Kind::CachePool`]), which never carries a stack, keeps its pool's second id in the
/// stack hash's place. Those are the only fields two kinds use differently.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub kind: Kind,
    pub api: Api,
    stack_form: StackForm,
    /// [`Payload::Oom`]'s ticket (0 for every other payload).
    oom_dump_ticket: u8,
    stack_slot: StackSlotIndex,
    pub device: i32,
    /// Kernel thread id of the caller.
    pub tid: u32,
    /// The stack's hash, or a pool event's second id (see the type's text).
    stack_hash: u64,
    /// The address, or an out-of-memory event's free memory (see the type's text).
    addr_or_free: u64,
    pub size: u64,
    /// [`Payload::Stream`], [`Payload::Handle`], [`Payload::Oom`]'s stream,
    /// [`Payload::Pool`]'s first id or [`Payload::Step`]'s origin (0 for [`Payload::None`]:
    /// [`Event::payload`] tells them apart by the kind).
    payload_word: u64,
    /// When it happened, on the event clock (the writer converts it to microseconds since
    /// the Unix epoch).
    pub time: Stamp,
}

/// Which payload each kind carries: what `record` and the tracker send with it (the
/// virtual-memory calls a handle, 0 where the call has none; the allocator's segments the
/// stream its trace entry named).
#[derive(Clone, Copy, PartialEq, Eq)]
enum PayloadForm {
    Stream,
    Handle,
    Oom,
    Pool,
    Step,
}

impl Kind {
    #[inline(always)]
    const fn payload_form(self) -> PayloadForm {
        match self {
            Kind::Alloc
            | Kind::Free
            | Kind::AllocManaged
            | Kind::BlockAlloc
            | Kind::BlockFreeRequested
            | Kind::BlockFreeCompleted
            | Kind::CacheSegment
            | Kind::CacheSegmentMap => PayloadForm::Stream,
            Kind::MemCreate
            | Kind::MemRelease
            | Kind::Map
            | Kind::Unmap
            | Kind::Reserve
            | Kind::ReserveFree => PayloadForm::Handle,
            Kind::Oom => PayloadForm::Oom,
            Kind::CachePool => PayloadForm::Pool,
            Kind::Step => PayloadForm::Step,
        }
    }
}

impl Event {
    pub const fn new(kind: Kind, api: Api) -> Event {
        Event {
            kind,
            api,
            stack_form: StackForm::None,
            oom_dump_ticket: 0,
            stack_slot: 0,
            device: 0,
            tid: 0,
            stack_hash: 0,
            addr_or_free: 0,
            size: 0,
            payload_word: 0,
            time: Stamp(0),
        }
    }

    /// An event without a stack, every field given: each is written once (an event made
    /// with [`Event::new`] and then set is written twice where the hooks build it).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub fn stackless(
        kind: Kind,
        api: Api,
        device: i32,
        tid: u32,
        addr: u64,
        size: u64,
        payload: Payload,
        time: Stamp,
    ) -> Event {
        let (payload_word, free, oom_dump_ticket, pool_second) = match payload {
            Payload::None => (0, None, 0, 0),
            Payload::Stream(word) | Payload::Handle(word) => (word, None, 0, 0),
            Payload::Oom {
                free_bytes,
                stream,
                dump_ticket,
            } => (stream, free_bytes, dump_ticket, 0),
            Payload::Pool(pool) => (pool.first, None, 0, pool.second),
            Payload::Step(origin) => (origin as u64, None, 0, 0),
        };
        let oom = kind == Kind::Oom;
        Event {
            kind,
            api,
            stack_form: StackForm::None,
            oom_dump_ticket: if oom { oom_dump_ticket } else { 0 },
            stack_slot: 0,
            device,
            tid,
            stack_hash: pool_second,
            addr_or_free: if oom { free.unwrap_or(u64::MAX) } else { addr },
            size,
            payload_word,
            time,
        }
    }

    /// The address (0 for an out-of-memory event, which has none).
    #[inline(always)]
    pub fn addr(&self) -> u64 {
        if self.kind == Kind::Oom {
            0
        } else {
            self.addr_or_free
        }
    }

    /// Sets the address (ignored for an out-of-memory event, whose payload holds its
    /// place).
    #[inline(always)]
    pub fn set_addr(&mut self, addr: u64) {
        if self.kind != Kind::Oom {
            self.addr_or_free = addr;
        }
    }

    #[inline(always)]
    pub fn stack(&self) -> StackRef {
        match self.stack_form {
            StackForm::None => StackRef::None,
            StackForm::Slot => StackRef::Slot {
                index: self.stack_slot,
                hash: self.stack_hash,
            },
            StackForm::Sent => StackRef::Sent {
                hash: self.stack_hash,
            },
        }
    }

    #[inline(always)]
    pub fn set_stack(&mut self, stack: StackRef) {
        (self.stack_form, self.stack_slot, self.stack_hash) = match stack {
            StackRef::None => (StackForm::None, 0, 0),
            StackRef::Slot { index, hash } => (StackForm::Slot, index, hash),
            StackRef::Sent { hash } => (StackForm::Sent, 0, hash),
        };
    }

    /// The payload, as the kind says it is kept.
    #[inline]
    pub fn payload(&self) -> Payload {
        match self.kind.payload_form() {
            PayloadForm::Stream => Payload::Stream(self.payload_word),
            PayloadForm::Handle => Payload::Handle(self.payload_word),
            PayloadForm::Oom => Payload::Oom {
                free_bytes: (self.addr_or_free != u64::MAX).then_some(self.addr_or_free),
                stream: self.payload_word,
                dump_ticket: self.oom_dump_ticket,
            },
            PayloadForm::Pool => Payload::Pool(PoolId {
                first: self.payload_word,
                second: self.stack_hash,
            }),
            PayloadForm::Step => Payload::Step(match self.payload_word {
                1 => StepOrigin::Optimizer,
                _ => StepOrigin::Program,
            }),
        }
    }
}

/// One Python frame as seen by the hook: the code object's address and the instruction
/// position, decoded into a line by the writer (docs/DESIGN.md, decision 2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct PyFrameRaw {
    /// Address of the `PyCodeObject`.
    pub code: u64,
    /// Version-specific instruction position (`f_lasti` or the instruction pointer).
    pub instr: u64,
    /// A value read from the code object in the hook (e.g. `co_firstlineno`) that the
    /// writer checks before trusting the object is still the same code.
    pub check: u32,
    /// Bit 0: this frame is the first one its `_PyEval_EvalFrameDefault` call ran
    /// (an "entry" frame); used to place Python frames among native ones.
    pub flags: u32,
}

/// A captured stack: raw return addresses and raw Python frames, innermost first.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct StackSlot {
    pub n_native: u16,
    pub n_python: u16,
    /// The walk stopped at the frame limit (the stack is deeper).
    pub truncated: bool,
    pub native: [u64; FRAME_CAPACITY],
    pub python: [PyFrameRaw; FRAME_CAPACITY],
}

impl StackSlot {
    pub const EMPTY: StackSlot = StackSlot {
        n_native: 0,
        n_python: 0,
        truncated: false,
        native: [0; FRAME_CAPACITY],
        python: [PyFrameRaw {
            code: 0,
            instr: 0,
            check: 0,
            flags: 0,
        }; FRAME_CAPACITY],
    };

    pub fn native(&self) -> &[u64] {
        &self.native[..(self.n_native as usize).min(FRAME_CAPACITY)]
    }
    pub fn python(&self) -> &[PyFrameRaw] {
        &self.python[..(self.n_python as usize).min(FRAME_CAPACITY)]
    }

    /// Whether the walk found nothing at all.
    pub fn is_empty(&self) -> bool {
        self.n_native == 0 && self.n_python == 0
    }

    /// Copies the stack in `from` (its records only, not the unused capacity).
    #[inline]
    pub fn copy_from(&mut self, from: &StackSlot) {
        let (native, python) = (from.native(), from.python());
        self.native[..native.len()].copy_from_slice(native);
        self.python[..python.len()].copy_from_slice(python);
        self.n_native = native.len() as u16;
        self.n_python = python.len() as u16;
        self.truncated = from.truncated;
    }

    /// A 64-bit hash of everything that identifies the stack: the return addresses, each
    /// Python record, the counts and the truncation mark. Hooks compute it to send a
    /// repeated stack by reference; the writer interns by it. Two different stacks share a
    /// hash with a probability of about 2^-64 per pair (docs/HOT-PATH.md).
    #[inline]
    pub fn identity_hash(&self) -> u64 {
        self.identity_hash_from(native_chain(self.native()), python_sum(self.python()))
    }

    /// [`Self::identity_hash`] from its two parts as the capture kept them up: the
    /// [`native_chain`] of `self.native()` (a walk that reused the previous one's outer
    /// frames took their chain along) and the [`python_sum`] of `self.python()`.
    #[inline]
    pub fn identity_hash_from(&self, native_chain: u64, python_sum: u64) -> u64 {
        let shape = u64::from(self.n_native)
            | (u64::from(self.n_python) << 16)
            | (u64::from(self.truncated) << 32);
        fold_multiply(
            native_chain ^ python_sum.rotate_left(29) ^ shape,
            FINAL_MULTIPLIER,
        )
    }
}

/// The Python part of a stack's hash: a sum of independent terms, one per word of each
/// record, each word multiplied by an odd constant of its own position (mod 2^64). The
/// multiplications do not wait for each other. A change of one word always changes the sum
/// (an odd multiplier is invertible mod 2^64); the final mix of
/// [`StackSlot::identity_hash_from`] spreads every bit of it, with the counts. (No seed is
/// xored into the words: the sum is linear in them either way, so a seed would separate no
/// two stacks more, and it cost three instructions a frame.)
#[inline]
pub fn python_sum(python: &[PyFrameRaw]) -> u64 {
    python
        .iter()
        .zip(PYTHON_MULTIPLIERS.chunks_exact(3))
        .fold(0u64, |sum, (p, m)| {
            // The two 32-bit fields as the one word they make in memory: one load.
            let check_flags = u64::from(p.check) | (u64::from(p.flags) << 32);
            sum.wrapping_add(p.code.wrapping_mul(m[0]))
                .wrapping_add(p.instr.wrapping_mul(m[1]))
                .wrapping_add(check_flags.wrapping_mul(m[2]))
        })
}

/// Where a native chain starts (a stack without native frames has this chain).
pub const NATIVE_CHAIN_SEED: u64 = 0x243F_6A88_85A3_08D3;

/// One step of the native chain: the chain over a stack's return addresses, from the
/// outermost inwards, so that the chain of a stack's outer part is a prefix state that a
/// walk reusing those frames carries over.
#[inline(always)]
pub fn native_chain_step(chain: u64, pc: u64) -> u64 {
    fold_multiply(chain ^ pc, CHAIN_MULTIPLIER)
}

/// The native chain of `native` (innermost first), computed in full.
pub fn native_chain(native: &[u64]) -> u64 {
    native
        .iter()
        .rev()
        .fold(NATIVE_CHAIN_SEED, |chain, &pc| native_chain_step(chain, pc))
}

/// Words the Python part of a stack hash covers: three per frame.
const PYTHON_WORDS: usize = FRAME_CAPACITY * 3;
const FINAL_MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;
const CHAIN_MULTIPLIER: u64 = 0xD6E8_FEB8_6659_FD93;

/// One odd multiplier per word position (splitmix64 outputs), computed at compile time.
static PYTHON_MULTIPLIERS: [u64; PYTHON_WORDS] = {
    let mut out = [0u64; PYTHON_WORDS];
    let mut state = 0xA409_3822_299F_31D0u64;
    let mut i = 0;
    while i < PYTHON_WORDS {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out[i] = (z ^ (z >> 31)) | 1;
        i += 1;
    }
    out
};

/// The 128-bit product of `a` and `b`, its halves xored.
#[inline(always)]
fn fold_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_and_its_mark_fill_one_cache_line() {
        // The lanes and the queue hold MEMSNAP_QUEUE_CAPACITY of these each; stacks live in
        // separate slots.
        assert_eq!(size_of::<Event>(), 56);
    }

    #[test]
    fn every_stack_and_payload_comes_back_as_it_was_set() {
        let stacks = [
            StackRef::None,
            StackRef::Slot {
                index: 4095,
                hash: u64::MAX,
            },
            StackRef::Sent { hash: 7 },
        ];
        for stack in stacks {
            let mut ev = Event::new(Kind::BlockAlloc, Api::CachingAllocator);
            ev.set_stack(stack);
            assert_eq!(ev.stack(), stack);
        }
        let cases = [
            (Kind::Alloc, Payload::Stream(0x5010)),
            (Kind::BlockFreeCompleted, Payload::Stream(u64::MAX)),
            (Kind::Map, Payload::Handle(42)),
            (Kind::Unmap, Payload::Handle(0)),
            (Kind::CacheSegment, Payload::Stream(7)),
            (
                Kind::CachePool,
                Payload::Pool(PoolId {
                    first: 3,
                    second: u64::MAX,
                }),
            ),
            (Kind::Step, Payload::Step(StepOrigin::Program)),
            (Kind::Step, Payload::Step(StepOrigin::Optimizer)),
            (
                Kind::Oom,
                Payload::Oom {
                    free_bytes: Some(3 << 30),
                    stream: 9,
                    dump_ticket: MAX_OOM_DUMPS,
                },
            ),
            (
                Kind::Oom,
                Payload::Oom {
                    free_bytes: None,
                    stream: 0,
                    dump_ticket: 0,
                },
            ),
        ];
        for (kind, payload) in cases {
            let (device, tid, size, time) = (3, 77, 4096, Stamp(5));
            let mut ev = Event::stackless(
                kind,
                Api::CudaMalloc,
                device,
                tid,
                0x7000_0000,
                size,
                payload,
                time,
            );
            assert_eq!(ev.stack(), StackRef::None);
            assert_eq!(ev.payload(), payload, "{kind:?}");
            if kind != Kind::CachePool {
                // (A pool event is never sent with a stack: its second id is in the hash's
                // place.)
                ev.set_stack(StackRef::Sent { hash: 1 });
                assert_eq!(ev.payload(), payload, "{kind:?}");
                assert_eq!(ev.stack(), StackRef::Sent { hash: 1 });
            }
            let addr = if kind == Kind::Oom { 0 } else { 0x7000_0000 };
            assert_eq!(
                ev.addr(),
                addr,
                "{kind:?}: an out-of-memory event has no address"
            );
            assert_eq!(
                (ev.device, ev.tid, ev.size, ev.time),
                (device, tid, size, time)
            );
        }
    }

    fn stack(native: &[u64], python: &[(u64, u64)]) -> StackSlot {
        let mut s = StackSlot::EMPTY;
        s.native[..native.len()].copy_from_slice(native);
        s.n_native = native.len() as u16;
        for (dst, &(code, instr)) in s.python.iter_mut().zip(python) {
            *dst = PyFrameRaw {
                code,
                instr,
                check: 7,
                flags: 1,
            };
        }
        s.n_python = python.len() as u16;
        s
    }

    #[test]
    fn the_identity_hash_tells_apart_what_makes_stacks_differ() {
        let base = stack(&[0x1000, 0x2000, 0x3000], &[(0x7000, 10)]);
        let h = base.identity_hash();
        let variants = [
            stack(&[0x1000, 0x2000, 0x3008], &[(0x7000, 10)]),
            stack(&[0x2000, 0x1000, 0x3000], &[(0x7000, 10)]),
            stack(&[0x1000, 0x2000], &[(0x7000, 10)]),
            stack(&[0x1000, 0x2000, 0x3000, 0], &[(0x7000, 10)]),
            stack(&[0x1000, 0x2000, 0x3000], &[(0x7000, 12)]),
            stack(&[0x1000, 0x2000, 0x3000], &[]),
            stack(&[0x1000, 0x2000, 0x3000, 0x7000], &[]),
        ];
        for v in &variants {
            assert_ne!(v.identity_hash(), h);
        }
        let mut truncated = base;
        truncated.truncated = true;
        assert_ne!(truncated.identity_hash(), h);
        let mut check = base;
        check.python[0].check = 8;
        assert_ne!(check.identity_hash(), h);
        // Only the records count, not what lies beyond them.
        let mut stale = base;
        stale.native[3] = 0xdead;
        stale.python[1].code = 0xbeef;
        assert_eq!(stale.identity_hash(), h);
        let mut copy = StackSlot::EMPTY;
        copy.copy_from(&base);
        assert_eq!(copy.identity_hash(), h);
    }

    #[test]
    fn the_identity_hash_has_no_collisions_among_a_quarter_million_near_identical_stacks() {
        // Return addresses of real loops differ in few low bits: one varying frame at each
        // position over a shared outer part, and swapped neighbours.
        let mut seen = std::collections::HashSet::new();
        let outer: Vec<u64> = (0..40).map(|k| 0x7f12_3400_0000 + k * 0x1_0040).collect();
        let mut n = 0;
        for pos in 0..40 {
            for delta in 0..6_250u64 {
                let mut native = outer.clone();
                native[pos] = native[pos].wrapping_add(delta * 4 + 1);
                assert!(seen.insert(stack(&native, &[]).identity_hash()));
                n += 1;
            }
        }
        for i in 0..39 {
            let mut native = outer.clone();
            native.swap(i, i + 1);
            assert!(seen.insert(stack(&native, &[]).identity_hash()));
        }
        assert_eq!(seen.len(), n + 39);
    }

    #[test]
    fn api_all_is_in_discriminant_order_and_complete() {
        for (i, api) in Api::ALL.iter().enumerate() {
            assert_eq!(*api as usize, i, "{api:?}");
        }
        assert_eq!(Api::ALL.len(), Api::CachingAllocator as usize + 1);
    }
}
