//! CPython's structure layouts: the one table of byte offsets memsnap reads interpreter
//! memory with.
//!
//! Owns every offset into CPython's structures (thread state, frames, code objects, `str`
//! and `bytes` objects, the code type's `tp_dealloc`) and the few CPython constants read alongside them, one `const`
//! table per supported version (3.10–3.14; 64-bit, not free-threaded), measured from that
//! version's headers, and the check value that ties a frame record to its code object
//! ([`check_value`]). Process-wide, read by both sides: the hook (`capture::python`) walks
//! the frame chain with it; the writer (`writer::stacks::pyframes`) reads code objects and
//! strings with it and recomputes the check value. No other module holds an offset into
//! CPython memory.
//!
//! Read on the hot path: constants only. No state, no allocation, no lookups;
//! [`Layout::table`] is a `match` that returns a `&'static` table.
//!
//! A member a version does not have is 0 in its table and is never read there: the readers
//! branch on the [`Layout`] (or, for [`CodeLayout::version`], on the 0) before using it.

/// Frame and code object layouts memsnap knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Layout {
    Py310 = 1,
    Py311 = 2,
    Py312 = 3,
    Py313 = 4,
    Py314 = 5,
}

impl Layout {
    /// Every supported version's layout, oldest first.
    pub const ALL: [Layout; 5] = [
        Layout::Py310,
        Layout::Py311,
        Layout::Py312,
        Layout::Py313,
        Layout::Py314,
    ];

    pub fn from_version(major: u32, minor: u32) -> Option<Layout> {
        match (major, minor) {
            (3, 10) => Some(Layout::Py310),
            (3, 11) => Some(Layout::Py311),
            (3, 12) => Some(Layout::Py312),
            (3, 13) => Some(Layout::Py313),
            (3, 14) => Some(Layout::Py314),
            _ => None,
        }
    }

    /// The inverse of `layout as u8` (the hook keeps the layout in an atomic byte).
    pub(crate) fn from_u8(v: u8) -> Option<Layout> {
        match v {
            1 => Some(Layout::Py310),
            2 => Some(Layout::Py311),
            3 => Some(Layout::Py312),
            4 => Some(Layout::Py313),
            5 => Some(Layout::Py314),
            _ => None,
        }
    }

    /// This version's offsets.
    #[inline(always)]
    pub fn table(self) -> &'static CpythonLayout {
        match self {
            Layout::Py310 => &PY310,
            Layout::Py311 => &PY311,
            Layout::Py312 => &PY312,
            Layout::Py313 => &PY313,
            Layout::Py314 => &PY314,
        }
    }
}

/// Byte offsets (and a few bit positions) in one CPython version's structures.
#[derive(Debug)]
pub struct CpythonLayout {
    pub thread: ThreadLayout,
    pub frame: FrameLayout,
    pub code: CodeLayout,
    pub object: ObjectLayout,
    pub str_: StrLayout,
    pub bytes: BytesLayout,
}

/// `PyThreadState`, and the `_PyCFrame` between it and the frames on 3.11/3.12.
#[derive(Debug)]
pub struct ThreadLayout {
    /// Where the frame chain starts: 3.10 `PyThreadState.frame` (`PyFrameObject *`);
    /// 3.11/3.12 `PyThreadState.cframe` (`_PyCFrame *`); 3.13/3.14
    /// `PyThreadState.current_frame` (`_PyInterpreterFrame *`).
    pub frame: u64,
    /// `_PyCFrame.current_frame` (3.11/3.12); 0 on 3.10/3.13/3.14 (no `_PyCFrame`; never
    /// read).
    /// Note 3.12's is a real 0: the member is first there.
    pub cframe_current: u64,
}

/// One frame: `PyFrameObject` (3.10) or `_PyInterpreterFrame` (3.11+).
#[derive(Debug)]
pub struct FrameLayout {
    /// 3.10 `PyFrameObject.f_code`; 3.11/3.12 `_PyInterpreterFrame.f_code`; 3.13
    /// `_PyInterpreterFrame.f_executable` (a `PyObject *`); 3.14
    /// `_PyInterpreterFrame.f_executable` (a `_PyStackRef`: clear [`STACKREF_TAG_BITS_314`]).
    pub code: u64,
    /// 3.10 `PyFrameObject.f_back`; 3.11+ `_PyInterpreterFrame.previous`.
    pub back: u64,
    /// 3.10 `PyFrameObject.f_lasti` (an `int`); 3.11/3.12 `_PyInterpreterFrame.prev_instr`;
    /// 3.13/3.14 `_PyInterpreterFrame.instr_ptr` (pointers into `co_code_adaptive`).
    pub instr: u64,
    /// 3.11+ `_PyInterpreterFrame.owner` (a `char`); 0 on 3.10 (never read).
    pub owner: u64,
    /// 3.11 `_PyInterpreterFrame.is_entry` (a `bool`); 0 elsewhere (never read).
    pub is_entry: u64,
}

/// `PyCodeObject`.
#[derive(Debug)]
pub struct CodeLayout {
    /// `PyCodeObject.co_firstlineno` (an `int`).
    pub firstlineno: u64,
    /// `PyCodeObject.co_filename` (`str`).
    pub filename: u64,
    /// `PyCodeObject.co_name` (`str`).
    pub name: u64,
    /// `PyCodeObject.co_linetable` (`bytes`).
    pub linetable: u64,
    /// 3.12+ `PyCodeObject.co_version` (a `uint32_t`: a per-process serial given to each new
    /// code object); 0 on 3.10/3.11, which have none (the readers use the name's hash).
    pub version: u64,
    /// 3.11+ `PyCodeObject._co_firsttraceable` (an `int`, in code units); 0 on 3.10.
    pub firsttraceable: u64,
    /// 3.11+ `PyCodeObject.co_code_adaptive` (the first instruction); 0 on 3.10.
    pub code_adaptive: u64,
}

/// Every object's header.
#[derive(Debug)]
pub struct ObjectLayout {
    /// `PyObject.ob_type`.
    pub ob_type: u64,
    /// `PyTypeObject.tp_dealloc` (of `PyCode_Type`: wrapped by `channel::keep`).
    pub type_dealloc: u64,
}

/// Compact `str` objects (`PyASCIIObject`, `PyCompactUnicodeObject`).
#[derive(Debug)]
pub struct StrLayout {
    /// `PyASCIIObject.length` (code points).
    pub length: u64,
    /// `PyASCIIObject.hash` (the cached hash; -1 until computed).
    pub hash: u64,
    /// `PyASCIIObject.state` (a bit field in an `unsigned int`).
    pub state: u64,
    /// `PyASCIIObject.state.kind`: first bit (3 bits wide; 1, 2 or 4 bytes per code point).
    pub state_kind_shift: u32,
    /// `PyASCIIObject.state.compact`: bit.
    pub state_compact_bit: u32,
    /// `PyASCIIObject.state.ascii`: bit.
    pub state_ascii_bit: u32,
    /// `sizeof(PyASCIIObject)`: where an ASCII compact string's characters start.
    pub ascii_size: u64,
    /// `sizeof(PyCompactUnicodeObject)`: where another compact string's characters start.
    pub compact_size: u64,
}

/// `bytes` objects (`PyBytesObject`).
#[derive(Debug)]
pub struct BytesLayout {
    /// `PyBytesObject.ob_base.ob_size` (`PyVarObject.ob_size`: the length).
    pub size: u64,
    /// `PyBytesObject.ob_sval`: the contents.
    pub sval: u64,
}

/// `FRAME_OWNED_BY_CSTACK` (3.12/3.13 `enum _frameowner`): the `owner` of the shim frame an
/// eval call pushes below its first frame.
pub const FRAME_OWNED_BY_CSTACK: u8 = 3;

/// 3.14 `enum _frameowner`: `FRAME_OWNED_BY_INTERPRETER`, the `owner` of the shim frame an
/// eval call pushes below its first frame (3.13's `FRAME_OWNED_BY_CSTACK`, renumbered).
pub const FRAME_OWNED_BY_INTERPRETER_314: u8 = 3;

/// 3.14 `enum _frameowner`: `FRAME_OWNED_BY_CSTACK`, a frame CPython keeps on the C stack
/// that is no Python function either. The 3.14 walk skips every frame whose `owner` is
/// [`FRAME_OWNED_BY_INTERPRETER_314`] or more, as CPython's own `_PyFrame_IsIncomplete` does.
pub const FRAME_OWNED_BY_CSTACK_314: u8 = 4;

/// 3.14 (with the GIL) `Py_TAG_BITS`: the low bits of a `_PyStackRef` that are a tag, not
/// part of the object's address (`Py_TAG_REFCNT` marks a borrowed or immortal reference).
/// Cleared from `_PyInterpreterFrame.f_executable` before it is used as an address.
pub const STACKREF_TAG_BITS_314: u64 = 3;

/// `PyFrameRaw::flags` bit: the first frame its `_PyEval_EvalFrameDefault` call ran.
pub const FLAG_ENTRY: u32 = 1;

/// The check value of a code object, which ties a frame record to it: another code object
/// that reuses a freed one's address is told apart. The writer recomputes it from the object.
///
/// On 3.12+ it is the object's serial (`co_version`, given once to each new code object by a
/// counter of the interpreter) mixed with its first line: one field a frame reads from the
/// code object beside the first line, on the same cache line as it three times in four
/// (objects are 16-byte aligned, the two fields 24 bytes apart), where reading the
/// addresses of `co_filename` and `co_name` too touched a second line for most objects.
/// The counter stops at 0 after 2^32 code objects; from then on, and on 3.10/3.11 (no
/// serial), `names` gives the addresses of `co_filename` and `co_name` and a serial of their
/// own (3.10/3.11: the name's cached hash, which differs for different names even where a
/// freed name's address is recycled; else 0), mixed with the first line. `None` when
/// `names` could not read them.
#[inline(always)]
pub fn check_value(
    firstlineno: i32,
    serial: u32,
    names: impl FnOnce() -> Option<(u64, u64, u32)>,
) -> Option<u32> {
    let mix = |serial: u32| (firstlineno as u32) ^ serial.wrapping_mul(0x9e37_79b1);
    if serial != 0 {
        return Some(mix(serial));
    }
    let (filename, name, name_serial) = names()?;
    let h = (name ^ filename.rotate_left(32)) >> 4;
    Some(mix(name_serial) ^ (h as u32) ^ ((h >> 32) as u32))
}

#[inline(always)]
pub fn fold(v: u64) -> u32 {
    (v as u32) ^ ((v >> 32) as u32)
}

/// Object headers, the same in every supported version.
const OBJECT: ObjectLayout = ObjectLayout {
    ob_type: 8,
    type_dealloc: 48,
};

/// `bytes` objects, the same in every supported version.
const BYTES: BytesLayout = BytesLayout { size: 16, sval: 32 };

/// 3.10/3.11 strings: `PyASCIIObject` still has `wstr`.
const STR_310_311: StrLayout = StrLayout {
    length: 16,
    hash: 24,
    state: 32,
    state_kind_shift: 2,
    state_compact_bit: 5,
    state_ascii_bit: 6,
    ascii_size: 48,
    compact_size: 72,
};

/// 3.12+ strings: `wstr` and `wstr_length` are gone, so the characters start earlier.
const STR_312_314: StrLayout = StrLayout {
    ascii_size: 40,
    compact_size: 56,
    ..STR_310_311
};

const PY310: CpythonLayout = CpythonLayout {
    thread: ThreadLayout {
        frame: 24,
        cframe_current: 0,
    },
    frame: FrameLayout {
        code: 32,
        back: 24,
        instr: 96,
        owner: 0,
        is_entry: 0,
    },
    code: CodeLayout {
        firstlineno: 40,
        filename: 104,
        name: 112,
        linetable: 120,
        version: 0,
        firsttraceable: 0,
        code_adaptive: 0,
    },
    object: OBJECT,
    str_: STR_310_311,
    bytes: BYTES,
};

const PY311: CpythonLayout = CpythonLayout {
    thread: ThreadLayout {
        frame: 56,
        cframe_current: 8,
    },
    frame: FrameLayout {
        code: 32,
        back: 48,
        instr: 56,
        owner: 69,
        is_entry: 68,
    },
    code: CodeLayout {
        firstlineno: 72,
        filename: 112,
        name: 120,
        linetable: 136,
        version: 0,
        firsttraceable: 168,
        code_adaptive: 184,
    },
    object: OBJECT,
    str_: STR_310_311,
    bytes: BYTES,
};

const PY312: CpythonLayout = CpythonLayout {
    thread: ThreadLayout {
        frame: 56,
        cframe_current: 0,
    },
    frame: FrameLayout {
        code: 0,
        back: 8,
        instr: 56,
        owner: 70,
        is_entry: 0,
    },
    code: CodeLayout {
        firstlineno: 68,
        filename: 112,
        name: 120,
        linetable: 136,
        version: 92,
        firsttraceable: 176,
        code_adaptive: 192,
    },
    object: OBJECT,
    str_: STR_312_314,
    bytes: BYTES,
};

/// 3.13: 3.12's layout but for the thread state, where `current_frame` (a
/// `_PyInterpreterFrame *`) replaces `cframe` (no `_PyCFrame` any more), and the code
/// object's members from `_co_firsttraceable` on, which moved.
const PY313: CpythonLayout = CpythonLayout {
    thread: ThreadLayout {
        frame: 72,
        cframe_current: 0,
    },
    code: CodeLayout {
        firsttraceable: 184,
        code_adaptive: 200,
        ..PY312.code
    },
    ..PY312
};

/// 3.14: 3.13's layout but for the frame's `owner` and the code object's members from
/// `_co_firsttraceable` on, which moved.
const PY314: CpythonLayout = CpythonLayout {
    frame: FrameLayout {
        owner: 74,
        ..PY313.frame
    },
    code: CodeLayout {
        firsttraceable: 192,
        code_adaptive: 208,
        ..PY313.code
    },
    ..PY313
};
