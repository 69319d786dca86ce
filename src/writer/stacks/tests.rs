use super::*;

fn f(name: &str) -> Frame {
    Frame {
        name: name.to_string(),
        filename: "??".to_string(),
        line: 0,
    }
}

#[test]
fn merge_places_groups_at_eval_frames() {
    let native = vec![
        f("cuMemAlloc"),
        f("_PyEval_EvalFrameDefault"),
        f("_PyEval_EvalFrame"),
        f("_PyEval_Vector"),
        f("_PyEval_EvalFrameDefault"),
        f("main"),
    ];
    let python = vec![
        vec![f("inner"), f("middle")],
        vec![f("outer")],
        vec![f("extra")],
    ];
    let names: Vec<String> = merge(native, &python).into_iter().map(|f| f.name).collect();
    assert_eq!(
        names,
        [
            "cuMemAlloc",
            "inner",
            "middle",
            "_PyEval_EvalFrameDefault",
            "_PyEval_EvalFrame",
            "_PyEval_Vector",
            "outer",
            "_PyEval_EvalFrameDefault",
            "main",
            "extra"
        ]
    );
}

#[test]
fn merge_python_only_appends() {
    let python = vec![vec![f("a")], vec![f("b")]];
    let names: Vec<String> = merge(Vec::new(), &python)
        .into_iter()
        .map(|f| f.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
}

#[test]
fn line_table_311_short_and_long_forms() {
    // firstlineno 10: entry 1 = one-line form (code 11: +1 line), 2 units;
    // entry 2 = no-column form (code 13) with svarint +4 (encoded 8), 1 unit;
    // entry 3 = no location (code 15), 1 unit; entry 4 = long form (14), -2 lines (5), 1 unit.
    let table = [
        0x80 | (11 << 3) | 1,
        0,
        5,
        0x80 | (13 << 3),
        8,
        0x80 | (15 << 3),
        0x80 | (14 << 3),
        5,
        0,
        1,
        1,
    ];
    assert_eq!(line_311(&table, 10, 0), Some(11));
    assert_eq!(line_311(&table, 10, 1), Some(11));
    assert_eq!(line_311(&table, 10, 2), Some(15));
    assert_eq!(line_311(&table, 10, 3), None);
    assert_eq!(line_311(&table, 10, 4), Some(13));
    assert_eq!(line_311(&table, 10, 5), None);
}

#[test]
fn line_table_310_pairs() {
    // 6 bytes at line +1, 4 bytes with no line, 2 bytes at line +2 more.
    let table = [6u8, 1, 4, 0x80, 2, 2];
    assert_eq!(line_310(&table, 20, 0), Some(21));
    assert_eq!(line_310(&table, 20, 5), Some(21));
    assert_eq!(line_310(&table, 20, 6), None);
    assert_eq!(line_310(&table, 20, 10), Some(23));
    assert_eq!(line_310(&table, 20, 12), None);
}

#[test]
fn demangles_cpp_and_rust() {
    assert_eq!(demangle("_ZN3foo3barEv"), "foo::bar()");
    assert_eq!(
        demangle("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"),
        "core::ptr::drop_in_place"
    );
    assert_eq!(demangle("plain_c"), "plain_c");
}

#[test]
fn read_mem_fails_cleanly_on_unmapped_memory() {
    assert_eq!(read_mem(8, 16), None);
    let x: u64 = 0x1122334455667788;
    assert_eq!(
        read_mem(&x as *const u64 as u64, 8),
        Some(x.to_le_bytes().to_vec())
    );
}

fn native_slot(pcs: &[u64]) -> StackSlot {
    let mut slot = StackSlot::EMPTY;
    slot.native[..pcs.len()].copy_from_slice(pcs);
    slot.n_native = pcs.len() as u16;
    slot
}

#[test]
fn stacks_are_told_apart_by_content_even_when_their_hashes_collide() {
    let mut table = StackTable::new(&Config::default());
    let (a, b, c) = (
        native_slot(&[0x10, 0x20, 0x30]),
        native_slot(&[0x11, 0x20, 0x30]),
        native_slot(&[0x10, 0x20]),
    );
    // Three different stacks, all given the same hash.
    let ia = table.intern_hashed(&a, 7).unwrap();
    let ib = table.intern_hashed(&b, 7).unwrap();
    let ic = table.intern_hashed(&c, 7).unwrap();
    assert!(ia != ib && ib != ic && ia != ic);
    // Seen again: the same ids, nothing new interned.
    assert_eq!(table.intern_hashed(&b, 7), Some(ib));
    assert_eq!(table.intern_hashed(&c, 7), Some(ic));
    assert_eq!(table.intern_hashed(&a, 7), Some(ia));
    assert_eq!(table.len(), 3);
    assert_eq!(
        table.intern(&StackSlot::EMPTY),
        None,
        "an empty stack is no stack"
    );
    // With real hashes: one id per distinct stack, found again by content.
    let mut table = StackTable::new(&Config::default());
    let ids: Vec<_> = [&a, &b, &c, &a, &b, &c]
        .iter()
        .map(|s| table.intern(s))
        .collect();
    assert_eq!(ids[..3], ids[3..]);
    assert_eq!(table.len(), 3);
}

/// A library of one function `func` built in `dir` as `name`, loaded; its handle and the
/// function's address.
fn load_library(dir: &std::path::Path, name: &str, func: &str) -> (*mut libc::c_void, u64) {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, format!("int {func}(int x) {{ return x * 3 + 1; }}\n")).unwrap();
    let lib = dir.join(name);
    crate::stack_tests::build_c_library(&src, &lib, &["-g", "-O1"]);
    let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
    let func = std::ffi::CString::new(func).unwrap();
    // SAFETY: loading a library of our own; only its address is taken, nothing is called.
    unsafe {
        let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!handle.is_null(), "dlopen {}", lib.display());
        let at = libc::dlsym(handle, func.as_ptr());
        assert!(!at.is_null());
        (handle, at as u64)
    }
}

#[test]
fn an_unloaded_librarys_frames_keep_its_names_with_another_library_at_its_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let mut table = StackTable::new(&Config::default());
    let (first, at_first) = load_library(dir.path(), "libfirst.so", "first_fn");
    // A return address just inside the function, interned while its library is loaded.
    let in_first = table.intern(&native_slot(&[at_first + 1])).unwrap();
    // SAFETY: our handle; nothing of the library is used after this.
    assert_eq!(unsafe { libc::dlclose(first) }, 0);
    // What memsnap's `dlclose` does after the library is gone.
    modules::mark_stale();
    // Usually mapped where the first one was: the same addresses, another library.
    let (second, at_second) = load_library(dir.path(), "libsecond.so", "second_fn");
    let in_second = table
        .intern(&native_slot(&[at_second + 1, at_second + 2]))
        .unwrap();
    let name = |table: &mut StackTable, id| table.frames(id)[0].name.clone();
    assert_eq!(name(&mut table, in_first), "first_fn");
    assert_eq!(name(&mut table, in_second), "second_fn");
    assert_eq!(table.frames_unresolved, 0);
    // SAFETY: our handle.
    assert_eq!(unsafe { libc::dlclose(second) }, 0);
}

#[test]
fn frames_that_cannot_be_resolved_are_kept_and_counted() {
    let mut table = StackTable::new(&Config::default());
    // An address in no module, and two Python records whose code objects cannot be read
    // (this test process has no interpreter): each kept, each counted.
    let mut slot = native_slot(&[0x10]);
    slot.python[0] = PyFrameRaw {
        code: 8,
        instr: 0,
        check: 1,
        flags: 0,
    };
    slot.python[1] = PyFrameRaw {
        code: 16,
        instr: 0,
        check: 2,
        flags: crate::process::cpython::FLAG_ENTRY,
    };
    slot.n_python = 2;
    let id = table.intern(&slot).unwrap();
    assert_eq!(table.frames_unresolved, 3);
    let frames: Vec<(String, String, i64)> = table
        .frames(id)
        .iter()
        .map(|f| (f.name.clone(), f.filename.clone(), f.line))
        .collect();
    let python = ("??".to_string(), UNRESOLVED_FILE.to_string(), 0);
    assert_eq!(
        frames,
        [
            ("0x10".to_string(), "??".to_string(), 0),
            python.clone(),
            python
        ]
    );
    // The same stack again: counted once, as the one distinct stack it is.
    assert_eq!(table.intern(&slot), Some(id));
    assert_eq!(table.frames_unresolved, 3);
}
