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
