//! The fixed-size records that travel from a hook to the writer thread.
//!
//! Hot: built on the host's CUDA call path, so everything here is `Copy`, heap-free and
//! written in place. An [`Event`] is small (the queue of them rarely fills); its stack, if
//! any, lives in a [`StackSlot`] borrowed from a fixed pool and referred to by index, so
//! that under back-pressure memsnap degrades stacks first and keeps the alloc/free.

use crate::config::FRAME_CAPACITY;

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
    /// `memsnap_step()`: carried as an event so that it is ordered with the allocations
    /// around it. (Dump and exit requests do not wait in the queue: see
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
        /// Non-zero: the failing call waits for this out-of-memory snapshot ticket.
        dump_ticket: u64,
    },
}

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
}

impl Api {
    /// Every variant, in discriminant order (`ALL[a as usize] == a`).
    pub const ALL: [Api; 22] = [
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
        }
    }
}

/// No stack slot attached.
pub const NO_STACK: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Event {
    pub kind: Kind,
    pub api: Api,
    pub device: i32,
    /// Kernel thread id of the caller.
    pub tid: u32,
    /// Index of the [`StackSlot`] holding this event's stack, or [`NO_STACK`].
    pub stack: u32,
    pub addr: u64,
    pub size: u64,
    pub payload: Payload,
    /// Microseconds since the Unix epoch (vDSO clock read, no syscall).
    pub time_us: u64,
}

impl Event {
    pub const fn new(kind: Kind, api: Api) -> Event {
        Event {
            kind,
            api,
            device: 0,
            tid: 0,
            stack: NO_STACK,
            addr: 0,
            size: 0,
            payload: Payload::None,
            time_us: 0,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_stay_small() {
        // The queue holds MEMSNAP_QUEUE_CAPACITY of these; stacks live in separate slots.
        assert_eq!(size_of::<Event>(), 72);
    }

    #[test]
    fn api_all_is_in_discriminant_order_and_complete() {
        for (i, api) in Api::ALL.iter().enumerate() {
            assert_eq!(*api as usize, i, "{api:?}");
        }
        assert_eq!(Api::ALL.len(), Api::Memsnap as usize + 1);
    }
}
