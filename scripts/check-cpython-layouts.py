#!/usr/bin/env python3
"""Check memsnap's CPython layout constants against the headers of installed interpreters.

src/process/cpython.rs holds one table of byte offsets per CPython version (thread state,
frames, code objects, str and bytes objects, the code type's tp_dealloc). For each CPython 3.X found on this machine,
this script compiles a small C program against that interpreter's own headers (the folders
`python3.X-config --includes` names, with `Py_BUILD_CORE` defined for the internal ones),
prints offsetof() / sizeof() of every field memsnap reads, and compares them with the
constants parsed from the Rust source. docs/CPYTHON.md explains the fields.

Usage:
    python3 scripts/check-cpython-layouts.py [PYTHON ...]

Without arguments it looks for python3.10 ... python3.19 and python3 on PATH, and for the
interpreters of pyenv ($PYENV_ROOT, else ~/.pyenv). With arguments it checks exactly those
interpreters. The C compiler is $CC, else cc.

Exit status: 0 when every interpreter that could be checked matches (and at least one could);
1 when a constant differs from the headers, a header fails to compile, or memsnap has a
layout this script has no field list for; 77 (skipped, not passed) when no interpreter could
be checked: none found, no compiler, or no internal headers (the `-dev` package of a
distribution may lack them; a source build or pyenv has them).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ROOT / "src" / "process" / "cpython.rs"
SKIPPED = 77

# A member memsnap keeps at 0 and never reads in that version.
UNUSED = None

STR_COMMON = {
    "str_.length": "offsetof(PyASCIIObject, length)",
    "str_.hash": "offsetof(PyASCIIObject, hash)",
    "str_.state": "offsetof(PyASCIIObject, state)",
    "str_.state_kind_shift": "BIT(kind)",
    "str_.state_compact_bit": "BIT(compact)",
    "str_.state_ascii_bit": "BIT(ascii)",
    "str_.ascii_size": "sizeof(PyASCIIObject)",
    "str_.compact_size": "sizeof(PyCompactUnicodeObject)",
}
OBJECTS = {
    "object.ob_type": "offsetof(PyObject, ob_type)",
    "object.type_dealloc": "offsetof(PyTypeObject, tp_dealloc)",
    "bytes.size": "offsetof(PyVarObject, ob_size)",
    "bytes.sval": "offsetof(PyBytesObject, ob_sval)",
}
CODE_COMMON = {
    "code.firstlineno": "offsetof(PyCodeObject, co_firstlineno)",
    "code.filename": "offsetof(PyCodeObject, co_filename)",
    "code.name": "offsetof(PyCodeObject, co_name)",
    "code.linetable": "offsetof(PyCodeObject, co_linetable)",
}
CODE_311 = {
    "code.firsttraceable": "offsetof(PyCodeObject, _co_firsttraceable)",
    "code.code_adaptive": "offsetof(PyCodeObject, co_code_adaptive)",
}

# Per (major, minor): the C expression that gives each Rust field, or UNUSED. A new
# version needs its own entry (docs/CPYTHON.md, "Adding a version").
FIELDS = {
    (3, 10): {
        "thread.frame": "offsetof(PyThreadState, frame)",
        "thread.cframe_current": UNUSED,
        "frame.code": "offsetof(PyFrameObject, f_code)",
        "frame.back": "offsetof(PyFrameObject, f_back)",
        "frame.instr": "offsetof(PyFrameObject, f_lasti)",
        "frame.owner": UNUSED,
        "frame.is_entry": UNUSED,
        **CODE_COMMON,
        "code.version": UNUSED,
        "code.firsttraceable": UNUSED,
        "code.code_adaptive": UNUSED,
    },
    (3, 11): {
        "thread.frame": "offsetof(PyThreadState, cframe)",
        "thread.cframe_current": "offsetof(_PyCFrame, current_frame)",
        "frame.code": "offsetof(_PyInterpreterFrame, f_code)",
        "frame.back": "offsetof(_PyInterpreterFrame, previous)",
        "frame.instr": "offsetof(_PyInterpreterFrame, prev_instr)",
        "frame.owner": "offsetof(_PyInterpreterFrame, owner)",
        "frame.is_entry": "offsetof(_PyInterpreterFrame, is_entry)",
        **CODE_COMMON,
        "code.version": UNUSED,
        **CODE_311,
    },
    (3, 12): {
        "thread.frame": "offsetof(PyThreadState, cframe)",
        "thread.cframe_current": "offsetof(_PyCFrame, current_frame)",
        "frame.code": "offsetof(_PyInterpreterFrame, f_code)",
        "frame.back": "offsetof(_PyInterpreterFrame, previous)",
        "frame.instr": "offsetof(_PyInterpreterFrame, prev_instr)",
        "frame.owner": "offsetof(_PyInterpreterFrame, owner)",
        "frame.is_entry": UNUSED,
        **CODE_COMMON,
        "code.version": "offsetof(PyCodeObject, co_version)",
        **CODE_311,
    },
    (3, 13): {
        "thread.frame": "offsetof(PyThreadState, current_frame)",
        "thread.cframe_current": UNUSED,
        "frame.code": "offsetof(_PyInterpreterFrame, f_executable)",
        "frame.back": "offsetof(_PyInterpreterFrame, previous)",
        "frame.instr": "offsetof(_PyInterpreterFrame, instr_ptr)",
        "frame.owner": "offsetof(_PyInterpreterFrame, owner)",
        "frame.is_entry": UNUSED,
        **CODE_COMMON,
        "code.version": "offsetof(PyCodeObject, co_version)",
        **CODE_311,
    },
    # 3.14: the same members as 3.13; `f_executable` is a `_PyStackRef` now (a tagged
    # pointer: the tag bits are checked below as STACKREF_TAG_BITS_314) and the frame
    # structure lives in pycore_interpframe_structs.h (included by pycore_frame.h).
    (3, 14): {
        "thread.frame": "offsetof(PyThreadState, current_frame)",
        "thread.cframe_current": UNUSED,
        "frame.code": "offsetof(_PyInterpreterFrame, f_executable)",
        "frame.back": "offsetof(_PyInterpreterFrame, previous)",
        "frame.instr": "offsetof(_PyInterpreterFrame, instr_ptr)",
        "frame.owner": "offsetof(_PyInterpreterFrame, owner)",
        "frame.is_entry": UNUSED,
        **CODE_COMMON,
        "code.version": "offsetof(PyCodeObject, co_version)",
        **CODE_311,
    },
}
for table in FIELDS.values():
    table.update(STR_COMMON)
    table.update(OBJECTS)

# Headers beyond Python.h, per version: where the frame structures are declared.
HEADERS = {
    (3, 10): ["frameobject.h"],
}
INTERNAL_HEADERS = ["internal/pycore_frame.h"]  # 3.11 and later: required
# Included too where the interpreter has them (3.14 moved `_PyInterpreterFrame` out of
# pycore_frame.h into pycore_interpframe_structs.h; `_PyStackRef`'s tags are in
# pycore_stackref.h).
OPTIONAL_INTERNAL_HEADERS = ["internal/pycore_interpframe.h", "internal/pycore_stackref.h"]

# Constants checked besides the tables: (Rust name, C expression, first and last version it
# applies to; None: every later version too).
CONSTANTS = [
    ("FRAME_OWNED_BY_CSTACK", "FRAME_OWNED_BY_CSTACK", (3, 12), (3, 13)),
    ("FRAME_OWNED_BY_INTERPRETER_314", "FRAME_OWNED_BY_INTERPRETER", (3, 14), (3, 14)),
    ("FRAME_OWNED_BY_CSTACK_314", "FRAME_OWNED_BY_CSTACK", (3, 14), (3, 14)),
    ("STACKREF_TAG_BITS_314", "Py_TAG_BITS", (3, 14), (3, 14)),
]


def applies(version, since, until):
    return version >= since and (until is None or version <= until)


# ---- the Rust side -----------------------------------------------------------------------


def parse_rust(path):
    """Returns ({(major, minor): {field: value}}, {constant: value})."""
    src = path.read_text()
    src = re.sub(r"//[^\n]*", "", src)

    # (3, 10) => Some(Layout::Py310)  and  Layout::Py310 => &PY310
    versions = {
        variant: (int(a), int(b))
        for a, b, variant in re.findall(r"\((\d+),\s*(\d+)\)\s*=>\s*Some\(Layout::(\w+)\)", src)
    }
    tables = dict(re.findall(r"Layout::(\w+)\s*=>\s*&(\w+)", src))

    consts = {}
    for m in re.finditer(r"const\s+(\w+)\s*:\s*\w+\s*=\s*", src):
        name, rest = m.group(1), src[m.end():]
        num = re.match(r"(\d+)\s*;", rest)
        if num:
            consts[name] = int(num.group(1))
            continue
        lit = re.match(r"\w+\s*\{", rest)
        if not lit:
            continue
        depth, i = 0, 0
        for i, ch in enumerate(rest):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    break
        consts[name] = re.findall(r"[A-Za-z_]\w*|\d+|[{}:,]", rest[: i + 1])

    def value(tokens, pos):
        tok = tokens[pos]
        if tok.isdigit():
            return int(tok), pos + 1
        if pos + 1 < len(tokens) and tokens[pos + 1] == "{":
            fields, pos = {}, pos + 2
            while tokens[pos] != "}":
                key = tokens[pos]
                assert tokens[pos + 1] == ":", f"expected ':' after {key}"
                fields[key], pos = value(tokens, pos + 2)
                if tokens[pos] == ",":
                    pos += 1
            return fields, pos + 1
        return resolve(tok), pos + 1

    def resolve(name):
        c = consts[name]
        return c if isinstance(c, int) else value(c, 0)[0]

    def flatten(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flatten(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out

    layouts = {versions[v]: flatten(resolve(tables[v])) for v in versions}
    plain = {k: v for k, v in consts.items() if isinstance(v, int)}
    return layouts, plain


# ---- the interpreters --------------------------------------------------------------------

PROBE = r"""
import sys, sysconfig, os
p = sysconfig.get_paths()
print(sys.version_info[0], sys.version_info[1], sys.version.split()[0])
print(os.path.realpath(sys.executable))
print(p["include"])
print(p.get("platinclude") or p["include"])
print(sysconfig.get_config_var("Py_GIL_DISABLED") or 0)
print(sysconfig.get_config_var("Py_DEBUG") or 0)
print(sysconfig.get_config_var("SIZEOF_VOID_P") or 0)
"""


def candidates(args):
    if args:
        return args
    found = []
    for minor in range(10, 20):
        exe = shutil.which(f"python3.{minor}")
        if exe:
            found.append(exe)
    if shutil.which("python3"):
        found.append(shutil.which("python3"))
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    if pyenv.is_dir():
        for v in sorted(pyenv.iterdir()):
            exe = v / "bin" / "python3"
            if exe.is_file():
                found.append(str(exe))
    return found


def probe(exe):
    try:
        r = subprocess.run([exe, "-c", PROBE], capture_output=True, text=True, timeout=60)
    except OSError as e:
        return None, str(e)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[0]
    lines = r.stdout.splitlines()
    major, minor, full = lines[0].split()
    return {
        "version": (int(major), int(minor)),
        "full": full,
        "executable": lines[1],
        "include": lines[2],
        "platinclude": lines[3],
        "free_threaded": lines[4] not in ("0", "None"),
        "debug": lines[5] not in ("0", "None"),
        "pointer": int(lines[6]),
    }, None


def c_program(version, include_dir, fields, constants):
    includes = ["#define Py_BUILD_CORE 1", "#include <Python.h>", "#include <stddef.h>"]
    includes += [f"#include <{h}>" for h in HEADERS.get(version, [])]
    if version >= (3, 11):
        includes += [f'#include "{h}"' for h in INTERNAL_HEADERS]
        includes += [f'#include "{h}"' for h in OPTIONAL_INTERNAL_HEADERS
                     if (Path(include_dir) / h).is_file()]
    body = []
    for path, expr in fields.items():
        if expr is None:
            continue
        if expr.startswith("BIT("):
            member = expr[4:-1]
            body.append(f'    printf("{path} %u\\n", state_bit_{member}());')
        else:
            body.append(f'    printf("{path} %lu\\n", (unsigned long)({expr}));')
    for name, expr, since, until in constants:
        if applies(version, since, until):
            body.append(f'    printf("const.{name} %lu\\n", (unsigned long)({expr}));')
    bits = []
    for member in ("kind", "compact", "ascii"):
        bits.append(f"""
static unsigned state_bit_{member}(void) {{
    PyASCIIObject o;
    unsigned int word, bit = 0;
    memset(&o, 0, sizeof o);
    o.state.{member} = 1;
    memcpy(&word, (char *)&o + offsetof(PyASCIIObject, state), sizeof word);
    while (word && !(word & 1u)) {{ word >>= 1; bit++; }}
    return bit;
}}""")
    return "\n".join(
        includes + ["#include <stdio.h>", "#include <string.h>"] + bits
        + ["", "int main(void) {"] + body + ["    return 0;", "}", ""]
    )


def measure(info, fields, constants, cc, work):
    src = Path(work) / "layout.c"
    exe = Path(work) / "layout"
    src.write_text(c_program(info["version"], info["include"], fields, constants))
    incs = ["-I" + info["include"]]
    if info["platinclude"] != info["include"]:
        incs.append("-I" + info["platinclude"])
    # Debian's pyconfig.h includes <x86_64-linux-gnu/python3.X/pyconfig.h> from the folder
    # above: searched last, so that headers unpacked from a .deb outside /usr work too.
    incs.append("-idirafter" + str(Path(info["include"]).parent))
    r = subprocess.run([cc, "-std=c11", "-w", *incs, "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        # gnu11 for headers that use extensions
        r = subprocess.run([cc, "-std=gnu11", "-w", *incs, "-o", str(exe), str(src)],
                           capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip()
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}, None


def main(argv):
    layouts, rust_consts = parse_rust(LAYOUTS)
    print(f"memsnap has layouts for: {', '.join('%d.%d' % v for v in sorted(layouts))}")
    failures, checked, skipped = [], [], []

    for v, table in sorted(layouts.items()):
        known = FIELDS.get(v)
        if known is None:
            failures.append(f"{v[0]}.{v[1]}: memsnap has a layout but this script has no "
                            "field list for it (add one to FIELDS)")
            continue
        missing = sorted(set(table) - set(known))
        if missing:
            failures.append(f"{v[0]}.{v[1]}: this script does not know the field(s) "
                            f"{', '.join(missing)} (add them to FIELDS)")

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    seen = set()
    with tempfile.TemporaryDirectory() as work:
        for exe in candidates(argv):
            info, err = probe(exe)
            if info is None:
                skipped.append(f"{exe}: does not run ({err})")
                continue
            key = (info["version"], info["include"], info["platinclude"])
            if key in seen:
                continue
            seen.add(key)
            v = info["version"]
            name = f"{info['full']} ({info['executable']}, headers in {info['include']})"
            if v not in layouts:
                skipped.append(f"{name}: memsnap has no layout for {v[0]}.{v[1]} "
                               "(Python frames are off there)")
                continue
            if info["free_threaded"]:
                skipped.append(f"{name}: free-threaded build (memsnap reads no Python "
                               "frames there)")
                continue
            if info["pointer"] != 8:
                skipped.append(f"{name}: not a 64-bit build")
                continue
            if v not in FIELDS:
                continue  # already a failure above
            inc = Path(info["include"])
            if not (inc / "Python.h").is_file():
                skipped.append(f"{name}: no Python.h (install the interpreter's -dev package)")
                continue
            if v >= (3, 11) and not all((inc / h).is_file() for h in INTERNAL_HEADERS):
                skipped.append(f"{name}: internal headers missing "
                               f"({', '.join(INTERNAL_HEADERS)})")
                continue
            if cc is None:
                skipped.append(f"{name}: no C compiler (set CC)")
                continue
            got, err = measure(info, FIELDS[v], CONSTANTS, cc, work)
            if got is None:
                failures.append(f"{name}: the probe does not compile:\n{err}")
                continue
            bad = []
            for path, expr in FIELDS[v].items():
                want = layouts[v].get(path)
                if expr is None:
                    if want not in (0, None):
                        bad.append(f"{path}: memsnap has {want}, expected 0 (unused in {v[0]}.{v[1]})")
                elif got.get(path) != want:
                    bad.append(f"{path} = {expr}: headers say {got.get(path)}, "
                               f"src/process/cpython.rs says {want}")
            for cname, _, since, until in CONSTANTS:
                if applies(v, since, until) and got.get(f"const.{cname}") != rust_consts.get(cname):
                    bad.append(f"{cname}: headers say {got.get('const.' + cname)}, "
                               f"src/process/cpython.rs says {rust_consts.get(cname)}")
            note = " (debug build)" if info["debug"] else ""
            if bad:
                failures.append(f"{name}{note}: {len(bad)} difference(s):\n    "
                                + "\n    ".join(bad))
            else:
                n = sum(e is not None for e in FIELDS[v].values())
                checked.append(f"{name}{note}: {n} fields match")

    for line in checked:
        print("ok      " + line)
    for line in skipped:
        print("skipped " + line)
    for line in failures:
        print("FAILED  " + line)
    if failures:
        return 1
    if not checked:
        print("SKIPPED: no interpreter could be checked (not a pass)")
        return SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
