//! Raw Python frames to `{name, filename, line}`: code objects read safely, line tables decoded.
//!
//! Cold (writer thread), called as the writer drains the event, while the code objects the
//! hook named are still alive: CPython frees none before the writer has read the events
//! published until then (`channel::keep`). Every read of interpreter memory goes through
//! `process_vm_readv` on our own pid, so a code object gone all the same (that wait timed
//! out) cannot crash the host: the read fails. A code object is trusted only if its type
//! pointer is `PyCode_Type` and its first line and name/file pointers give the check value
//! the hook computed; decoded objects are cached per (address, check value). A frame that
//! cannot be read is kept as [`UNRESOLVED_FILE`] (or its file and function with line 0 when
//! only the line could not be decoded) and counted, never dropped.

use crate::channel::event::PyFrameRaw;
use crate::channel::keep;
use crate::process::cpython::{BytesLayout, FLAG_ENTRY, Layout, StrLayout, check_value, fold};
use crate::process::python;
use crate::snapshot::model::Frame;
use rustc_hash::FxHashMap;
use std::sync::Arc as Rc;

/// What the writer keeps of one code object.
#[derive(Debug)]
pub struct CodeInfo {
    pub filename: String,
    pub name: String,
    pub firstlineno: i32,
    pub linetable: Vec<u8>,
    /// 3.11+: offset (code units) of the first traceable instruction; earlier = frame not
    /// started yet (CPython's "incomplete" frame).
    pub firsttraceable: i64,
    /// 3.11+: address of the first instruction (`co_code_adaptive`).
    pub code_start: u64,
    /// The object's `co_filename`, `co_name` and `co_linetable` pointers when it was read:
    /// a cache hit is re-checked against them, so a different code object that reuses the
    /// address (and happens to start on the same line) is read afresh.
    identity: [u64; 3],
    /// Whether the object has a serial (3.12+ `co_version`), which the check value holds;
    /// else the count of code objects freed before it was read ([`keep::code_frees`]): a
    /// hit with another count is read afresh (another object may have the address, the
    /// names' addresses and the first line of this one).
    serial: bool,
    frees: u64,
}

/// Copies `len` bytes of our own memory at `addr`; `None` if any of it is unmapped.
pub fn read_mem(addr: u64, len: usize) -> Option<Vec<u8>> {
    if addr == 0 {
        return None;
    }
    let mut buf = vec![0u8; len];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: reads our own address space through the kernel, which checks the mapping and
    // fails with EFAULT instead of faulting; writes only into `buf`.
    let got = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (got == len as isize).then_some(buf)
}

fn u64_at(b: &[u8], off: u64) -> Option<u64> {
    let off = off as usize;
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: u64) -> Option<u32> {
    let off = off as usize;
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn i32_at(b: &[u8], off: u64) -> Option<i32> {
    let off = off as usize;
    Some(i32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

/// The file of a Python frame whose code object could not be read: `{"??", this, 0}`.
pub const UNRESOLVED_FILE: &str = "<Python code freed>";

/// One raw frame, decoded.
enum Decoded {
    Frame(Frame),
    /// A frame not started yet: CPython hides these too.
    Hidden,
    /// Kept with what is known, and counted.
    Unresolved(Frame),
}

pub struct PyResolver {
    layout: Option<Layout>,
    code_type: u64,
    cache: FxHashMap<(u64, u32), Rc<CodeInfo>>,
}

impl PyResolver {
    pub fn new() -> Self {
        PyResolver {
            layout: None,
            code_type: 0,
            cache: FxHashMap::default(),
        }
    }

    /// Picks up the interpreter the hooks found (cheap; call before resolving).
    fn ensure_layout(&mut self) -> Option<Layout> {
        if self.layout.is_none()
            && let python::Interpreter::Supported(l, _, _) = python::interpreter()
        {
            let t = python::lookup(c"PyCode_Type");
            if t != 0 {
                self.layout = Some(l);
                self.code_type = t as u64;
            }
        }
        self.layout
    }

    /// Resolves raw frames (innermost first) into eval-call groups: each group holds the
    /// frames one `_PyEval_EvalFrameDefault` call ran, innermost first, and the groups come
    /// innermost call first. Frames not started yet are left out (their group still ends
    /// where it did); frames that cannot be resolved are kept as far as known. Returns the
    /// groups and how many frames could not be resolved.
    pub fn resolve(&mut self, raw: &[PyFrameRaw]) -> (Vec<Vec<Frame>>, u64) {
        let layout = self.ensure_layout();
        let mut groups: Vec<Vec<Frame>> = Vec::new();
        let mut group: Vec<Frame> = Vec::new();
        let mut unresolved = 0;
        for r in raw {
            let entry = r.flags & FLAG_ENTRY != 0;
            match layout.map_or_else(
                || Decoded::Unresolved(unresolved_frame()),
                |l| self.frame(l, r),
            ) {
                Decoded::Frame(frame) => group.push(frame),
                Decoded::Hidden => {}
                Decoded::Unresolved(frame) => {
                    unresolved += 1;
                    group.push(frame);
                }
            }
            if entry {
                groups.push(std::mem::take(&mut group));
            }
        }
        if !group.is_empty() {
            groups.push(group);
        }
        (groups, unresolved)
    }

    fn frame(&mut self, layout: Layout, r: &PyFrameRaw) -> Decoded {
        let Some(info) = self.code(layout, r.code, r.check) else {
            return Decoded::Unresolved(unresolved_frame());
        };
        let line = match layout {
            Layout::Py310 => {
                let lasti = r.instr as i64;
                if lasti < 0 {
                    Some(info.firstlineno as i64)
                } else {
                    line_310(&info.linetable, info.firstlineno, lasti * 2)
                }
            }
            _ => {
                let units = (r.instr as i64).wrapping_sub(info.code_start as i64) / 2;
                if units < info.firsttraceable {
                    return Decoded::Hidden; // incomplete frame: CPython hides these too
                }
                if units < 0 {
                    Some(info.firstlineno as i64)
                } else {
                    line_311(&info.linetable, info.firstlineno, units)
                }
            }
        };
        let frame = Frame {
            name: info.name.clone(),
            filename: info.filename.clone(),
            line: line.unwrap_or(0),
        };
        match line {
            Some(_) => Decoded::Frame(frame),
            None => Decoded::Unresolved(frame), // no line for the instruction: 0, counted
        }
    }

    fn code(&mut self, layout: Layout, addr: u64, check: u32) -> Option<Rc<CodeInfo>> {
        // Before the object: a free after this moves the count.
        let frees = keep::code_frees();
        let head = self.read_head(layout, addr, check)?;
        let identity = identity(layout, &head)?;
        if let Some(c) = self.cache.get(&(addr, check))
            && c.identity == identity
            && (c.serial || c.frees == frees)
        {
            return Some(c.clone());
        }
        // Only successes are cached: a failed read (object gone) is retried next time.
        let mut info = self.read_code(layout, addr, &head, identity)?;
        info.frees = frees;
        let info = Rc::new(info);
        self.cache.insert((addr, check), info.clone());
        Some(info)
    }

    /// The code object's header, if `addr` still holds a code object with `check` as
    /// its first line.
    fn read_head(&self, layout: Layout, addr: u64, check: u32) -> Option<Vec<u8>> {
        let t = layout.table();
        let o = &t.code;
        let head = read_mem(addr, (o.linetable.max(o.firsttraceable) + 8) as usize)?;
        if u64_at(&head, t.object.ob_type)? != self.code_type {
            return None;
        }
        let ident = identity(layout, &head)?;
        let serial = match o.version {
            0 => 0, // 3.10/3.11: none
            off => u32_at(&head, off)?,
        };
        let names = || {
            let name_serial = match o.version {
                // 3.10/3.11: the hook used the name's cached hash instead.
                0 => fold(u64_at(
                    &read_mem(ident[1].wrapping_add(t.str_.hash), 8)?,
                    0,
                )?),
                _ => 0,
            };
            Some((ident[0], ident[1], name_serial))
        };
        if check_value(i32_at(&head, o.firstlineno)?, serial, names)? != check {
            return None;
        }
        Some(head)
    }

    fn read_code(
        &self,
        layout: Layout,
        addr: u64,
        head: &[u8],
        identity: [u64; 3],
    ) -> Option<CodeInfo> {
        let t = layout.table();
        let o = &t.code;
        let firstlineno = i32_at(head, o.firstlineno)?;
        let filename = read_str(&t.str_, identity[0])?;
        let name = read_str(&t.str_, identity[1])?;
        let linetable = read_bytes(&t.bytes, identity[2])?;
        let (firsttraceable, code_start) = match layout {
            Layout::Py310 => (0, 0),
            _ => (
                i32_at(head, o.firsttraceable)? as i64,
                addr.wrapping_add(o.code_adaptive),
            ),
        };
        let serial = o.version != 0 && u32_at(head, o.version)? != 0;
        Some(CodeInfo {
            filename,
            name,
            firstlineno,
            linetable,
            firsttraceable,
            code_start,
            identity,
            serial,
            frees: 0,
        })
    }
}

/// A frame whose code object could not be read (see [`UNRESOLVED_FILE`]).
fn unresolved_frame() -> Frame {
    Frame {
        name: "??".to_string(),
        filename: UNRESOLVED_FILE.to_string(),
        line: 0,
    }
}

fn identity(layout: Layout, head: &[u8]) -> Option<[u64; 3]> {
    let o = &layout.table().code;
    Some([
        u64_at(head, o.filename)?,
        u64_at(head, o.name)?,
        u64_at(head, o.linetable)?,
    ])
}

impl Default for PyResolver {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads a `bytes` object's contents (capped at 1 MiB).
fn read_bytes(b: &BytesLayout, addr: u64) -> Option<Vec<u8>> {
    let head = read_mem(addr, b.sval as usize)?;
    let size = u64_at(&head, b.size)?;
    if size > 1 << 20 {
        return None;
    }
    read_mem(addr.wrapping_add(b.sval), size as usize)
}

/// Reads a compact `str` object (the only kind code objects hold) as UTF-8.
fn read_str(o: &StrLayout, addr: u64) -> Option<String> {
    // The header up to and including `state`, read as a word.
    let head = read_mem(addr, (o.state + 8) as usize)?;
    let length = u64_at(&head, o.length)?;
    if length > 1 << 16 {
        return None;
    }
    let state = u32_at(&head, o.state)?;
    let kind = (state >> o.state_kind_shift) & 7;
    let compact = (state >> o.state_compact_bit) & 1 == 1;
    let ascii = (state >> o.state_ascii_bit) & 1 == 1;
    if !compact {
        return None;
    }
    let data = if ascii {
        addr.wrapping_add(o.ascii_size)
    } else {
        addr.wrapping_add(o.compact_size)
    };
    let width = match kind {
        1 | 2 | 4 => kind as usize,
        _ => return None,
    };
    let raw = read_mem(data, length as usize * width)?;
    Some(match width {
        1 => raw.iter().map(|&b| b as char).collect(), // latin-1 (ASCII is a subset)
        2 => raw
            .chunks_exact(2)
            .map(|c| char::from_u32(u16::from_le_bytes([c[0], c[1]]) as u32).unwrap_or('\u{fffd}'))
            .collect(),
        _ => raw
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('\u{fffd}')
            })
            .collect(),
    })
}

/// 3.10 `co_linetable`: (byte-offset delta, line delta) pairs; `addr` in bytes.
pub fn line_310(table: &[u8], firstlineno: i32, addr: i64) -> Option<i64> {
    let mut line = firstlineno as i64;
    let mut end: i64 = 0;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += pair[0] as i64;
        let ldelta = pair[1] as i8;
        let this = if ldelta == -128 {
            None
        } else {
            line += ldelta as i64;
            Some(line)
        };
        if start <= addr && addr < end {
            return this;
        }
    }
    None
}

/// 3.11+ location table (Objects/locations.md); `units` in code units.
pub fn line_311(table: &[u8], firstlineno: i32, units: i64) -> Option<i64> {
    let mut line = firstlineno as i64;
    let mut addr: i64 = 0;
    let mut i = 0usize;
    let varint = |i: &mut usize| -> Option<u64> {
        let mut val: u64 = 0;
        let mut shift = 0;
        loop {
            let b = *table.get(*i)?;
            *i += 1;
            val |= ((b & 63) as u64) << shift;
            shift += 6;
            if b & 64 == 0 || shift > 60 {
                return Some(val);
            }
        }
    };
    let svarint = |i: &mut usize| -> Option<i64> {
        let v = varint(i)?;
        Some(if v & 1 == 1 {
            -((v >> 1) as i64)
        } else {
            (v >> 1) as i64
        })
    };
    while i < table.len() {
        let first = *table.get(i)?;
        i += 1;
        if first & 0x80 == 0 {
            return None; // lost sync: not an entry start
        }
        let code = (first >> 3) & 15;
        let length = (first & 7) as i64 + 1;
        let this = match code {
            15 => None,
            14 => {
                line += svarint(&mut i)?;
                varint(&mut i)?; // end line delta
                varint(&mut i)?; // column
                varint(&mut i)?; // end column
                Some(line)
            }
            13 => {
                line += svarint(&mut i)?;
                Some(line)
            }
            10..=12 => {
                line += (code - 10) as i64;
                i += 2;
                Some(line)
            }
            _ => {
                i += 1;
                Some(line)
            }
        };
        if addr <= units && units < addr + length {
            return this;
        }
        addr += length;
    }
    None
}
