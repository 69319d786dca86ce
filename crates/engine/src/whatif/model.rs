//! A model of one device's PyTorch CUDA caching allocator (`DeviceCachingAllocator` in
//! PyTorch's `c10/cuda/CUDACachingAllocator.cpp`): blocks carved from segments, the small
//! and large pools per stream, best fit, splitting and merging, `max_split_size`,
//! expandable segments, garbage collection under a memory fraction, and the release and
//! retry when CUDA runs out. Each rule is in docs/WHATIF.md, "The allocator's rules", under
//! the PyTorch function it comes from; the functions here carry the same names.
//!
//! The model holds no memory: CUDA is a [`Driver`] that hands out addresses and says when
//! the device is full. Cold code (`memsnap whatif`), but its inner loop: a replay calls it
//! once per allocation and free of the file, for every scenario.

use super::settings::{MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Settings};
use std::collections::BTreeSet;

/// No block (a null link).
pub const NONE: u32 = u32::MAX;

/// What the allocator asks of CUDA. Sizes are bytes; `held` is what the allocator holds
/// from CUDA at the moment of the call (its reserved bytes).
pub trait Driver {
    /// `cudaMalloc`: the address, or `None` when the device is full.
    fn malloc(&mut self, size: u64, held: u64) -> Option<u64>;
    /// `cudaFree` of a whole segment.
    fn free(&mut self, addr: u64, size: u64);
    /// `cuMemAddressReserve`: address space for an expandable segment.
    fn reserve(&mut self, size: u64) -> u64;
    /// `cuMemAddressFree`.
    fn release(&mut self, addr: u64, size: u64);
    /// `cuMemCreate` + `cuMemMap` of the pages `[addr, addr + size)`: false when full.
    fn map(&mut self, addr: u64, size: u64, held: u64) -> bool;
    /// `cuMemUnmap` + `cuMemRelease`.
    fn unmap(&mut self, addr: u64, size: u64);
    /// Whether `size` more bytes would fit now (the model asks before a request to tell an
    /// `empty_cache()` from the release a full device forces).
    fn has_room(&self, size: u64, held: u64) -> bool;
}

/// A block: a piece of a segment, handed out or free (PyTorch's `Block`).
#[derive(Clone, Debug)]
pub struct Block {
    pub addr: u64,
    pub size: u64,
    pub requested: u64,
    pub stream: u64,
    pub prev: u32,
    pub next: u32,
    pub pool: u32,
    pub allocated: bool,
    /// Backed by device pages (always, outside expandable segments).
    pub mapped: bool,
    /// Freed by the program but still in use on another stream (`event_count > 0`).
    pub waiting: bool,
    /// Its expandable segment, or [`NONE`].
    pub exp: u32,
    /// The pool's `get_free_block` calls when the block became free (`gc_count_base`).
    gc_base: i64,
    /// Merged away or released: the slot waits for reuse.
    dead: bool,
    /// Who holds it (the replay's request number), while handed out or waiting.
    pub tag: u32,
}

/// Free blocks of one pool (PyTorch's `BlockPool`): by (stream, size, address) for best
/// fit, and the unmapped ranges of expandable segments by (stream, address).
#[derive(Clone, Debug, Default)]
struct Pool {
    small: bool,
    blocks: BTreeSet<(u64, u64, u64, u32)>,
    unmapped: BTreeSet<(u64, u64, u32)>,
    gc_calls: i64,
}

/// One expandable segment: address space of `pages` pages, some mapped.
#[derive(Clone, Debug)]
struct Expandable {
    base: u64,
    page: u64,
    mapped: Vec<bool>,
    /// Maximal runs of mapped pages: PyTorch's snapshot shows each as a segment.
    runs: u64,
}

/// A block as a snapshot shows it: (address, size, handed out or waiting).
pub type BlockView = (u64, u64, bool);

/// A request the allocator could not serve: PyTorch raises `OutOfMemoryError`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfMemory;

/// Something PyTorch would do that the model does not follow: the scenario is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unmodelled(pub String);

impl From<Unmodelled> for Fail {
    fn from(u: Unmodelled) -> Self {
        Fail::Unmodelled(u)
    }
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fail {
    Oom(OutOfMemory),
    Unmodelled(Unmodelled),
}

/// What one request looks for (`AllocParams`).
#[derive(Clone, Copy, Debug)]
struct Params {
    size: u64,
    stream: u64,
    pool: u32,
    alloc_size: u64,
    expandable: bool,
}

/// The default pools' places in [`Allocator::pools`]; private pools follow in pairs.
const SMALL: u32 = 0;
const LARGE: u32 = 1;

/// One device's allocator.
#[derive(Clone, Debug)]
pub struct Allocator {
    pub settings: Settings,
    /// The device's memory, for an expandable segment's address space
    /// (`totalGlobalMem`) and the memory fraction.
    device_total: u64,
    blocks: Vec<Block>,
    spare: Vec<u32>,
    pools: Vec<Pool>,
    /// Private pools: (owner id, the first of its two pools).
    private: Vec<((i64, i64), u32)>,
    exps: Vec<Expandable>,
    /// Blocks freed but waiting for other streams.
    waiting: Vec<u32>,
    /// Bytes held from CUDA (`total_allocated_memory`, PyTorch's reserved bytes).
    pub reserved: u64,
    /// Bytes of handed-out blocks (PyTorch's allocated bytes).
    pub allocated: u64,
    /// `cudaMalloc` segments held.
    pub segments: u64,
}

impl Allocator {
    pub fn new(settings: Settings, device_total: u64) -> Self {
        Allocator {
            settings,
            device_total,
            blocks: Vec::new(),
            spare: Vec::new(),
            pools: vec![
                Pool {
                    small: true,
                    ..Pool::default()
                },
                Pool::default(),
            ],
            private: Vec::new(),
            exps: Vec::new(),
            waiting: Vec::new(),
            reserved: 0,
            allocated: 0,
            segments: 0,
        }
    }

    pub fn block(&self, b: u32) -> &Block {
        &self.blocks[b as usize]
    }

    /// The pair of pools of the private pool `id` (a CUDA graph's or a `MemPool`'s), made
    /// on first use.
    pub fn private_pool(&mut self, id: (i64, i64)) -> u32 {
        if let Some(&(_, p)) = self.private.iter().find(|(i, _)| *i == id) {
            return p;
        }
        let p = self.pools.len() as u32;
        self.pools.push(Pool {
            small: true,
            ..Pool::default()
        });
        self.pools.push(Pool::default());
        self.private.push((id, p));
        p
    }

    /// The pools of the private pool `id`, if it has been used.
    pub fn find_private_pool(&self, id: (i64, i64)) -> Option<u32> {
        self.private.iter().find(|(i, _)| *i == id).map(|&(_, p)| p)
    }

    fn new_block(&mut self, addr: u64, size: u64, stream: u64, pool: u32, exp: u32) -> u32 {
        let b = Block {
            addr,
            size,
            requested: 0,
            stream,
            prev: NONE,
            next: NONE,
            pool,
            allocated: false,
            mapped: true,
            waiting: false,
            exp,
            gc_base: 0,
            dead: false,
            tag: NONE,
        };
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    fn kill(&mut self, b: u32) {
        self.blocks[b as usize].dead = true;
        self.spare.push(b);
    }

    fn b(&mut self, b: u32) -> &mut Block {
        &mut self.blocks[b as usize]
    }

    fn key(&self, b: u32) -> (u64, u64, u64, u32) {
        let k = &self.blocks[b as usize];
        (k.stream, k.size, k.addr, b)
    }

    fn ukey(&self, b: u32) -> (u64, u64, u32) {
        let k = &self.blocks[b as usize];
        (k.stream, k.addr, b)
    }

    /// `insert_into_blocks`: a free block joins its pool.
    fn insert_free(&mut self, b: u32) {
        let pool = self.blocks[b as usize].pool as usize;
        self.blocks[b as usize].gc_base = self.pools[pool].gc_calls;
        let k = self.key(b);
        self.pools[pool].blocks.insert(k);
    }

    fn remove_free(&mut self, b: u32) {
        let k = self.key(b);
        let pool = self.blocks[b as usize].pool as usize;
        self.pools[pool].blocks.remove(&k);
    }

    fn is_split(&self, b: u32) -> bool {
        let k = &self.blocks[b as usize];
        k.prev != NONE || k.next != NONE
    }

    fn gc_enabled(&self) -> bool {
        self.settings.memory_fraction < 1.0 && self.settings.garbage_collection_threshold > 0.0
    }

    /// `allowed_memory_maximum`: set only under a memory fraction.
    fn allowed_max(&self) -> Option<u64> {
        (self.settings.memory_fraction < 1.0)
            .then_some((self.settings.memory_fraction * self.device_total as f64) as u64)
    }

    /// `get_pool`: the small or large pool of the default pools or of a private pool.
    fn pool_for(&self, size: u64, private: Option<u32>) -> u32 {
        let first = private.unwrap_or(SMALL);
        if size <= SMALL_SIZE { first } else { first + 1 }
    }

    fn params(&self, requested: u64, stream: u64, private: Option<u32>) -> Params {
        let size = self.settings.round_size(requested);
        Params {
            size,
            stream,
            pool: self.pool_for(size, private),
            alloc_size: self.settings.allocation_size(size),
            expandable: self.settings.expandable_segments,
        }
    }

    /// `malloc`: a block for `requested` bytes on `stream`, from the default pools or the
    /// private pool `private` (from [`Allocator::private_pool`]).
    pub fn malloc(
        &mut self,
        drv: &mut dyn Driver,
        requested: u64,
        stream: u64,
        private: Option<u32>,
        tag: u32,
    ) -> Result<u32, Fail> {
        let p = self.params(requested, stream, private);
        let mut found = self.get_free_block(&p);
        if found.is_none() {
            if self.gc_enabled() {
                self.garbage_collect_cached_blocks(drv);
            }
            found = self.alloc_block(drv, &p);
            if found.is_none() && self.release_available_cached_blocks(drv, &p)? {
                found = self.alloc_block(drv, &p);
            }
            if found.is_none() {
                self.release_cached_blocks(drv);
                found = self.alloc_block(drv, &p);
            }
        }
        let Some(b) = found else {
            return Err(Fail::Oom(OutOfMemory));
        };
        let split = self.should_split(b, p.size, p.expandable);
        let b = self.alloc_found_block(b, &p, requested, split);
        self.b(b).tag = tag;
        Ok(b)
    }

    /// Whether a request would have to release cached memory first (garbage collection, or
    /// CUDA being full): what tells a release inside a request from an `empty_cache()`.
    pub fn would_release(
        &self,
        drv: &dyn Driver,
        requested: u64,
        stream: u64,
        private: Option<u32>,
    ) -> bool {
        let p = self.params(requested, stream, private);
        if self.find_free_block(&p).is_some() {
            return false;
        }
        if self.gc_enabled() {
            return true;
        }
        if let Some(max) = self.allowed_max()
            && self.reserved + p.alloc_size > max
        {
            return true;
        }
        let need = if p.expandable {
            let page = if self.pools[p.pool as usize].small {
                SMALL_BUFFER
            } else {
                self.settings.large_segment_size
            };
            p.size.div_ceil(page) * page
        } else {
            p.alloc_size
        };
        !drv.has_room(need, self.reserved)
    }

    /// `get_free_block`.
    fn get_free_block(&mut self, p: &Params) -> Option<u32> {
        if self.gc_enabled() {
            self.pools[p.pool as usize].gc_calls += 1;
        }
        let b = self.find_free_block(p)?;
        self.remove_free(b);
        Some(b)
    }

    /// `expandable_size` in `get_free_block`: a block at the end of an expandable segment's
    /// mapped pages counts the unmapped space after it.
    fn expandable_size(&self, b: u32) -> u64 {
        let k = &self.blocks[b as usize];
        let tail = if k.next != NONE && !self.blocks[k.next as usize].mapped {
            self.blocks[k.next as usize].size
        } else {
            0
        };
        k.size + tail
    }

    /// The block `get_free_block` would take, left in its pool.
    fn find_free_block(&self, p: &Params) -> Option<u32> {
        let pool = &self.pools[p.pool as usize];
        let mut it = pool.blocks.range((p.stream, p.size, 0, 0)..);
        let mut cur = *it.next()?;
        if cur.0 != p.stream {
            return None;
        }
        if self.blocks[cur.3 as usize].exp != NONE {
            if p.expandable {
                // Best fit by the size a block can grow to.
                while self.blocks[cur.3 as usize].exp != NONE {
                    match it.next() {
                        Some(n)
                            if n.0 == p.stream
                                && self.expandable_size(n.3) < self.expandable_size(cur.3) =>
                        {
                            cur = *n
                        }
                        _ => break,
                    }
                }
            } else {
                // Expandable segments turned off: only blocks outside them.
                loop {
                    cur = *it.next()?;
                    if cur.0 != p.stream {
                        return None;
                    }
                    if self.blocks[cur.3 as usize].exp == NONE {
                        break;
                    }
                }
            }
        }
        let size = self.blocks[cur.3 as usize].size;
        let max_split = self.settings.max_split_size;
        // An oversize block is not handed out for a request below the limit, nor for one
        // far below its size.
        if p.size < max_split && size >= max_split {
            return None;
        }
        if p.size >= max_split
            && size >= p.size.saturating_add(self.settings.max_non_split_rounding)
        {
            return None;
        }
        Some(cur.3)
    }

    /// `should_split`: whether the rest of the block becomes a free block of its own.
    fn should_split(&self, b: u32, size: u64, expandable: bool) -> bool {
        let k = &self.blocks[b as usize];
        let remaining = k.size - size;
        if self.pools[k.pool as usize].small || expandable {
            remaining >= MIN_BLOCK
        } else {
            size < self.settings.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// `alloc_found_block`: hands out `b`, split off its front when `split`.
    fn alloc_found_block(&mut self, b: u32, p: &Params, requested: u64, split: bool) -> u32 {
        let mut block = b;
        if split {
            let remaining = b;
            let (addr, exp, prev) = {
                let r = &self.blocks[remaining as usize];
                (r.addr, r.exp, r.prev)
            };
            block = self.new_block(addr, p.size, p.stream, p.pool, exp);
            self.b(block).prev = prev;
            if prev != NONE {
                self.b(prev).next = block;
            }
            self.b(block).next = remaining;
            let r = self.b(remaining);
            r.prev = block;
            r.addr += p.size;
            r.size -= p.size;
            self.insert_free(remaining);
        }
        let k = self.b(block);
        k.allocated = true;
        k.requested = requested;
        let size = k.size;
        self.allocated += size;
        block
    }

    /// `free`: the program frees `b`. A block used on other streams (`record_stream`)
    /// waits for them (`waits`) until [`Allocator::complete`].
    pub fn free(&mut self, b: u32, waits: bool) {
        let k = self.b(b);
        if !k.allocated {
            return;
        }
        k.allocated = false;
        let size = k.size;
        self.allocated -= size;
        if waits {
            self.b(b).waiting = true;
            self.waiting.push(b);
        } else {
            self.free_block(b);
        }
    }

    /// The other streams are done with `b` (the recorded `free_completed`).
    pub fn complete(&mut self, b: u32) {
        if self.blocks[b as usize].waiting {
            self.b(b).waiting = false;
            self.free_block(b);
        }
    }

    /// Whether `b` is still handed out or waiting (not free yet).
    pub fn is_active(&self, b: u32) -> bool {
        let k = &self.blocks[b as usize];
        k.allocated || k.waiting
    }

    /// `free_block`: `b` becomes free space, merged with free neighbours.
    fn free_block(&mut self, b: u32) {
        let (prev, next) = (self.blocks[b as usize].prev, self.blocks[b as usize].next);
        self.try_merge_blocks(b, prev);
        self.try_merge_blocks(b, next);
        self.insert_free(b);
    }

    /// `try_merge_blocks`: `src`, a free neighbour in the same mapped state, joins `dst`.
    fn try_merge_blocks(&mut self, dst: u32, src: u32) -> u64 {
        if src == NONE {
            return 0;
        }
        {
            let s = &self.blocks[src as usize];
            if s.allocated || s.waiting || s.mapped != self.blocks[dst as usize].mapped {
                return 0;
            }
        }
        let s = self.blocks[src as usize].clone();
        if s.mapped {
            self.remove_free(src);
        } else {
            let k = self.ukey(src);
            self.pools[s.pool as usize].unmapped.remove(&k);
        }
        if self.blocks[dst as usize].prev == src {
            let d = self.b(dst);
            d.addr = s.addr;
            d.prev = s.prev;
            if s.prev != NONE {
                self.b(s.prev).next = dst;
            }
        } else {
            self.b(dst).next = s.next;
            if s.next != NONE {
                self.b(s.next).prev = dst;
            }
        }
        self.b(dst).size += s.size;
        self.kill(src);
        s.size
    }

    /// `alloc_block`: a new segment (or more pages of an expandable one) for `p`.
    fn alloc_block(&mut self, drv: &mut dyn Driver, p: &Params) -> Option<u32> {
        if let Some(max) = self.allowed_max()
            && self.reserved + p.alloc_size > max
        {
            return None;
        }
        if p.expandable {
            return self.try_allocate_expandable_block(drv, p);
        }
        let addr = drv.malloc(p.alloc_size, self.reserved)?;
        self.reserved += p.alloc_size;
        self.segments += 1;
        Some(self.new_block(addr, p.alloc_size, p.stream, p.pool, NONE))
    }

    /// `release_block`: a whole segment goes back to CUDA.
    fn release_block(&mut self, drv: &mut dyn Driver, b: u32) {
        let (addr, size) = (self.blocks[b as usize].addr, self.blocks[b as usize].size);
        self.remove_free(b);
        drv.free(addr, size);
        self.reserved -= size;
        self.segments -= 1;
        self.kill(b);
    }

    /// `release_available_cached_blocks` (only under `max_split_size`): frees the smallest
    /// oversize cached block that covers the request, else the largest ones until they do.
    fn release_available_cached_blocks(
        &mut self,
        drv: &mut dyn Driver,
        p: &Params,
    ) -> Result<bool, Unmodelled> {
        let max_split = self.settings.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let want = p.size.max(max_split);
        let pool = p.pool as usize;
        let at = self.pools[pool]
            .blocks
            .range((p.stream, want, 0, 0)..)
            .next()
            .copied();
        let single = at.filter(|k| k.0 == p.stream && self.blocks[k.3 as usize].exp == NONE);
        if let Some(k) = single {
            self.release_whole(drv, k.3)?;
            return Ok(true);
        }
        // From the block before that place down, largest first, while oversize.
        let below: Vec<(u64, u64, u64, u32)> = match at {
            Some(k) => self.pools[pool].blocks.range(..k).rev().copied().collect(),
            None => self.pools[pool].blocks.iter().rev().copied().collect(),
        };
        let mut released = 0u64;
        for k in below {
            if released >= want || k.1 < max_split || k.0 != p.stream {
                break;
            }
            if self.blocks[k.3 as usize].exp == NONE {
                released += k.1;
                self.release_whole(drv, k.3)?;
            }
        }
        Ok(released >= want)
    }

    /// `release_block` of a block that must be a whole segment.
    fn release_whole(&mut self, drv: &mut dyn Driver, b: u32) -> Result<(), Unmodelled> {
        if self.is_split(b) {
            return Err(Unmodelled(
                "PyTorch would hand part of a segment back to CUDA (an oversize cached block \
                 that does not fill its segment, released under max_split_size_mb)"
                    .into(),
            ));
        }
        self.release_block(drv, b);
        Ok(())
    }

    /// `release_cached_blocks` (`empty_cache()`, and the last retry when CUDA is full):
    /// waiting blocks are freed, then every free whole segment and free page goes back.
    pub fn release_cached_blocks(&mut self, drv: &mut dyn Driver) {
        for b in std::mem::take(&mut self.waiting) {
            if self.blocks[b as usize].waiting {
                self.b(b).waiting = false;
                self.free_block(b);
            }
        }
        // A private pool's segments go back only once its graphs are released
        // (`releasePool`), which no file records: they stay.
        self.release_blocks(drv, LARGE);
        self.release_blocks(drv, SMALL);
    }

    /// `release_blocks`: whole free segments go back; free pages of expandable segments are
    /// unmapped, and an expandable segment left with nothing mapped is released.
    fn release_blocks(&mut self, drv: &mut dyn Driver, pool: u32) {
        let list: Vec<u32> = self.pools[pool as usize]
            .blocks
            .iter()
            .map(|k| k.3)
            .collect();
        let mut to_unmap = Vec::new();
        for b in list {
            if self.blocks[b as usize].exp != NONE {
                to_unmap.push(b);
            } else if !self.is_split(b) {
                self.release_block(drv, b);
            }
        }
        for b in to_unmap {
            self.unmap_block(drv, b);
            if !self.is_split(b) && !self.blocks[b as usize].mapped {
                self.release_expandable_segment(drv, b);
            }
        }
    }

    /// `garbage_collect_cached_blocks`: above the threshold of the memory fraction, whole
    /// free large segments that waited longest (in `get_free_block` calls) go back.
    fn garbage_collect_cached_blocks(&mut self, drv: &mut dyn Driver) {
        let Some(max) = self.allowed_max() else {
            return;
        };
        let threshold = (self.settings.garbage_collection_threshold * max as f64) as u64;
        if self.reserved <= threshold {
            return;
        }
        let target = self.reserved - threshold;
        let calls = self.pools[LARGE as usize].gc_calls;
        let age = |a: &Allocator, b: u32| (calls - a.blocks[b as usize].gc_base).max(0) as u64;
        let mut total_age = 0u64;
        let mut count = 0u64;
        for k in &self.pools[LARGE as usize].blocks {
            if !self.is_split(k.3) {
                total_age += age(self, k.3);
                count += 1;
            }
        }
        let mut reclaimed = 0u64;
        let mut freed_one = true;
        while reclaimed < target && freed_one && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed_one = false;
            let list: Vec<u32> = self.pools[LARGE as usize]
                .blocks
                .iter()
                .map(|k| k.3)
                .collect();
            for b in list {
                if !self.is_split(b)
                    && self.blocks[b as usize].exp == NONE
                    && age(self, b) as f64 >= threshold_age
                {
                    freed_one = true;
                    reclaimed += self.blocks[b as usize].size;
                    total_age -= age(self, b);
                    count -= 1;
                    self.release_block(drv, b);
                }
            }
        }
    }

    /// `find_expandable_block`: the lowest place in this stream's expandable segments where
    /// free and unmapped space add up to `size`, else a new expandable segment.
    fn find_expandable_block(&mut self, drv: &mut dyn Driver, p: &Params) -> u32 {
        let allocatable = |a: &Allocator, b: u32| {
            b != NONE && !a.blocks[b as usize].allocated && !a.blocks[b as usize].waiting
        };
        let pool = p.pool as usize;
        let candidates: Vec<u32> = self.pools[pool]
            .unmapped
            .range((p.stream, 0, 0)..)
            .take_while(|k| k.0 == p.stream)
            .map(|k| k.2)
            .collect();
        for c in candidates {
            let mut c = c;
            let prev = self.blocks[c as usize].prev;
            if allocatable(self, prev) {
                c = prev;
            }
            let mut bytes = 0;
            let mut b = c;
            while bytes < p.size && allocatable(self, b) {
                bytes += self.blocks[b as usize].size;
                b = self.blocks[b as usize].next;
            }
            if bytes >= p.size {
                return c;
            }
        }
        let page = if self.pools[pool].small {
            SMALL_BUFFER
        } else {
            self.settings.large_segment_size
        };
        // Address space for 1 1/8 of the device's memory.
        let pages = (self.device_total + self.device_total / 8)
            .div_ceil(page)
            .max(1);
        let base = drv.reserve(pages * page);
        self.exps.push(Expandable {
            base,
            page,
            mapped: vec![false; pages as usize],
            runs: 0,
        });
        let e = (self.exps.len() - 1) as u32;
        let b = self.new_block(base, pages * page, p.stream, p.pool, e);
        self.b(b).mapped = false;
        let k = self.ukey(b);
        self.pools[pool].unmapped.insert(k);
        b
    }

    /// Marks pages `[from, to)` of expandable segment `e` mapped or not, keeping its runs.
    fn set_pages(&mut self, e: u32, from: u64, to: u64, mapped: bool) {
        let x = &mut self.exps[e as usize];
        let left = from > 0 && x.mapped[from as usize - 1];
        let right = (to as usize) < x.mapped.len() && x.mapped[to as usize];
        for m in &mut x.mapped[from as usize..to as usize] {
            *m = mapped;
        }
        let joined = u64::from(left) + u64::from(right);
        if mapped {
            x.runs = x.runs + 1 - joined;
        } else {
            x.runs = x.runs + joined - 1;
        }
    }

    /// `map_block`: maps the pages under the first `size` bytes of the unmapped block `b`
    /// and merges them with free neighbours. False when CUDA is full.
    fn map_block(&mut self, drv: &mut dyn Driver, b: u32, size: u64) -> bool {
        let k = self.blocks[b as usize].clone();
        let x = &self.exps[k.exp as usize];
        let (base, page) = (x.base, x.page);
        let begin = (k.addr - base) / page;
        let end = (k.addr + size - base).div_ceil(page);
        if begin == end {
            return false;
        }
        let mapped = (end - begin) * page;
        if !drv.map(base + begin * page, mapped, self.reserved) {
            return false;
        }
        let uk = self.ukey(b);
        self.pools[k.pool as usize].unmapped.remove(&uk);
        self.b(b).mapped = true;
        if mapped < k.size {
            let rest = self.new_block(k.addr + mapped, k.size - mapped, k.stream, k.pool, k.exp);
            self.b(rest).mapped = false;
            self.splice(rest, b, k.next);
            let rk = self.ukey(rest);
            self.pools[k.pool as usize].unmapped.insert(rk);
            self.b(b).size = mapped;
        }
        let prev = self.blocks[b as usize].prev;
        self.try_merge_blocks(b, prev);
        let next = self.blocks[b as usize].next;
        self.try_merge_blocks(b, next);
        self.insert_free(b);
        self.reserved += mapped;
        self.set_pages(k.exp, begin, end, true);
        true
    }

    /// `Block::splice`: `b` goes between `before` and `after`.
    fn splice(&mut self, b: u32, before: u32, after: u32) {
        if before != NONE {
            self.b(before).next = b;
        }
        self.b(b).prev = before;
        if after != NONE {
            self.b(after).prev = b;
        }
        self.b(b).next = after;
    }

    /// `try_allocate_expandable_block`: maps what `p` needs and returns the free block that
    /// holds it (out of its pool).
    fn try_allocate_expandable_block(&mut self, drv: &mut dyn Driver, p: &Params) -> Option<u32> {
        let mut c = self.find_expandable_block(drv, p);
        if !self.blocks[c as usize].mapped {
            let size = self.blocks[c as usize].size.min(p.size);
            if !self.map_block(drv, c, size) {
                return None;
            }
        }
        while self.blocks[c as usize].size < p.size {
            let next = self.blocks[c as usize].next;
            if next == NONE {
                return None;
            }
            let size = (p.size - self.blocks[c as usize].size).min(self.blocks[next as usize].size);
            if !self.map_block(drv, next, size) {
                return None;
            }
            c = next;
        }
        self.remove_free(c);
        Some(c)
    }

    /// `unmap_block`: the whole pages inside free block `b` go back to CUDA; the free rest
    /// before and after them stays as free blocks.
    fn unmap_block(&mut self, drv: &mut dyn Driver, b: u32) {
        let k = self.blocks[b as usize].clone();
        let x = &self.exps[k.exp as usize];
        let (base, page) = (x.base, x.page);
        let begin = (k.addr - base).div_ceil(page);
        let end = (k.addr + k.size - base) / page;
        if begin >= end {
            return;
        }
        self.remove_free(b);
        let u_addr = base + begin * page;
        let u_size = (end - begin) * page;
        let before = u_addr - k.addr;
        if before > 0 {
            let f = self.new_block(k.addr, before, k.stream, k.pool, k.exp);
            self.splice(f, k.prev, b);
            self.insert_free(f);
        }
        let after = k.size - before - u_size;
        if after > 0 {
            let f = self.new_block(u_addr + u_size, after, k.stream, k.pool, k.exp);
            let next = self.blocks[b as usize].next;
            self.splice(f, b, next);
            self.insert_free(f);
        }
        {
            let m = self.b(b);
            m.addr = u_addr;
            m.size = u_size;
            m.mapped = false;
        }
        let prev = self.blocks[b as usize].prev;
        self.try_merge_blocks(b, prev);
        let next = self.blocks[b as usize].next;
        self.try_merge_blocks(b, next);
        let uk = self.ukey(b);
        self.pools[k.pool as usize].unmapped.insert(uk);
        self.reserved -= u_size;
        self.set_pages(k.exp, begin, end, false);
        drv.unmap(u_addr, u_size);
    }

    /// `release_expandable_segment`: an expandable segment with nothing mapped is freed.
    fn release_expandable_segment(&mut self, drv: &mut dyn Driver, b: u32) {
        let k = self.blocks[b as usize].clone();
        let uk = self.ukey(b);
        self.pools[k.pool as usize].unmapped.remove(&uk);
        self.kill(b);
        let x = &self.exps[k.exp as usize];
        drv.release(x.base, x.page * x.mapped.len() as u64);
    }

    /// A segment that existed before the recorded history began (a history that starts
    /// mid-run), with its live blocks `(address, size, requested)` in address order; the
    /// space between them is free. Returns the live blocks' handles, in that order.
    pub fn add_segment(
        &mut self,
        addr: u64,
        size: u64,
        stream: u64,
        small: bool,
        private: Option<u32>,
        live: &[(u64, u64, u64, u32)],
    ) -> Vec<u32> {
        let pool = private.unwrap_or(SMALL) + u32::from(!small);
        self.reserved += size;
        self.segments += 1;
        // (address, size, for a live block its requested bytes and tag)
        type Piece = (u64, u64, Option<(u64, u32)>);
        let mut pieces: Vec<Piece> = Vec::new();
        let mut at = addr;
        for &(a, s, r, tag) in live {
            if a > at {
                pieces.push((at, a - at, None));
            }
            pieces.push((a, s, Some((r, tag))));
            at = a + s;
        }
        if at < addr + size {
            pieces.push((at, addr + size - at, None));
        }
        let mut handles = Vec::new();
        let mut prev = NONE;
        let mut made = Vec::new();
        for (a, s, r) in pieces {
            let b = self.new_block(a, s, stream, pool, NONE);
            self.b(b).prev = prev;
            if prev != NONE {
                self.b(prev).next = b;
            }
            prev = b;
            made.push((b, r));
        }
        for (b, r) in made {
            match r {
                Some((req, tag)) => {
                    let k = self.b(b);
                    k.allocated = true;
                    k.requested = req;
                    k.tag = tag;
                    let s = k.size;
                    self.allocated += s;
                    handles.push(b);
                }
                None => self.insert_free(b),
            }
        }
        handles
    }

    /// Segments as PyTorch's snapshot counts them: `cudaMalloc` segments, and each run of
    /// mapped pages of an expandable segment.
    pub fn segment_count(&self) -> u64 {
        self.segments + self.exps.iter().map(|x| x.runs).sum::<u64>()
    }

    /// The largest free (mapped) block of any pool.
    pub fn largest_free_block(&self) -> u64 {
        let mut best = 0;
        for pool in &self.pools {
            // The set is ordered by stream first: the last block of each stream is its
            // largest.
            let mut from = (0u64, 0u64, 0u64, 0u32);
            while let Some(first) = pool.blocks.range(from..).next() {
                let stream = first.0;
                let last = pool
                    .blocks
                    .range(..(stream.saturating_add(1), 0, 0, 0))
                    .next_back()
                    .map_or(0, |k| k.1);
                best = best.max(last);
                if stream == u64::MAX {
                    break;
                }
                from = (stream + 1, 0, 0, 0);
            }
        }
        best
    }

    /// Every segment as `(address, size)` in address order, expandable ones by run of
    /// mapped pages (to set against a snapshot's segments).
    pub fn segment_list(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut heads: Vec<u32> = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            if b.exp == NONE && b.prev == NONE && !b.dead {
                heads.push(i as u32);
            }
        }
        for h in heads {
            let mut size = 0;
            let mut b = h;
            while b != NONE {
                size += self.blocks[b as usize].size;
                b = self.blocks[b as usize].next;
            }
            out.push((self.blocks[h as usize].addr, size));
        }
        for x in &self.exps {
            let mut i = 0;
            while i < x.mapped.len() {
                if x.mapped[i] {
                    let start = i;
                    while i < x.mapped.len() && x.mapped[i] {
                        i += 1;
                    }
                    out.push((x.base + start as u64 * x.page, (i - start) as u64 * x.page));
                } else {
                    i += 1;
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Every segment (an expandable one by run of mapped pages) with its blocks, in
    /// address order.
    pub fn segments_with_blocks(&self) -> Vec<(u64, u64, Vec<BlockView>)> {
        let mut blocks: Vec<BlockView> = self
            .blocks
            .iter()
            .filter(|b| b.mapped && !b.dead)
            .map(|b| (b.addr, b.size, b.allocated || b.waiting))
            .collect();
        blocks.sort_unstable();
        let mut i = 0;
        self.segment_list()
            .into_iter()
            .map(|(addr, size)| {
                while i < blocks.len() && blocks[i].0 < addr {
                    i += 1;
                }
                let from = i;
                while i < blocks.len() && blocks[i].0 < addr + size {
                    i += 1;
                }
                (addr, size, blocks[from..i].to_vec())
            })
            .collect()
    }
}
