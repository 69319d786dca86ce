//! Tests of the paths of frames (`super`: paths.rs).

use super::super::node::{Kind, NONE, Node, State};
use super::super::take::word_at;
use super::*;

fn empty_paths() -> Box<Paths> {
    // SAFETY: all-zero bytes are valid `Paths` (no table yet, no nodes; see
    // `thread_unwind`).
    let mut paths = unsafe { Box::<Paths>::new_zeroed().assume_init() };
    paths.use_table(1);
    paths
}

/// A node to be of a clean rule's step from (pc, sp, bp) to a caller at `next_sp`.
fn rule_step(pc: u64, sp: u64, bp: u64, next_sp: u64, reads_bp: bool) -> Node {
    Node {
        state: State { pc, sp, bp },
        next_sp,
        lowest_read: next_sp - 8,
        emits: true,
        reads_bp,
        ..Node::default()
    }
}

fn end_step(pc: u64, sp: u64, bp: u64) -> Node {
    Node {
        state: State { pc, sp, bp },
        kind: Kind::End,
        emits: true,
        ..Node::default()
    }
}

/// Checks are kept as 32-bit offsets from the first word checked: a piece with a
/// read beyond their reach gets none (its nodes are followed step by step, the
/// stack they give the same), one just within it gets its checks.
#[test]
fn a_piece_reading_beyond_the_offsets_reach_is_made_without_checks() {
    let mut paths = empty_paths();
    let first = [
        rule_step(0x1000, 0x100, 0xdead, 0x120, false),
        end_step(0x3000, 0x120, 0x300),
    ];
    let id = paths.link(&first, NONE).expect("room");
    assert!(paths.views[id as usize].whole);
    assert_eq!(paths.anchor, 0x118, "the first word checked");
    // A path whose step reads the return address at `anchor + offset`.
    let path_reading_at = |offset: u64, pc: u64| {
        let next_sp = 0x118 + offset + 8;
        [
            rule_step(pc, next_sp - 0x20, 0xdead, next_sp, false),
            end_step(pc + 0x10, next_sp, 0x300),
        ]
    };
    let within = path_reading_at(i32::MAX as u64 - 7, 0x5000);
    let id = paths.link(&within, NONE).expect("room");
    let view = paths.views[id as usize];
    assert!(view.whole, "just within reach: checked");
    assert_eq!(
        word_at(paths.anchor, paths.checks[view.checks_from as usize].at) as u64,
        within[0].next_sp - 8
    );
    let beyond = path_reading_at(i32::MAX as u64 + 1, 0x6000);
    let id = paths.link(&beyond, NONE).expect("room");
    assert!(!paths.views[id as usize].whole, "beyond reach: no checks");
    assert!(!paths.views[paths.node(id).caller as usize].whole);
}

#[test]
fn a_path_taken_again_finds_its_nodes_and_its_chain_is_that_of_its_frames() {
    let mut paths = empty_paths();
    // Innermost first: a frame without frame pointer (bp is data), one whose rule
    // reads bp, the root.
    let walk = [
        rule_step(0x1000, 0x100, 0xdead, 0x120, false),
        rule_step(0x2000, 0x120, 0x300, 0x140, true),
        end_step(0x3000, 0x140, 0x300),
    ];
    let inner = paths.link(&walk, NONE).expect("room");
    assert_eq!(paths.used, 4, "three nodes made");
    assert_eq!(
        paths.node(inner).chain,
        crate::channel::event::native_chain(&[0x1000, 0x2000, 0x3000]),
        "the innermost node's chain is the chain of the path's frames"
    );
    // Its piece: the return addresses each step read, with the frames' addresses,
    // and the frames, innermost first.
    let piece = |paths: &Paths, id: u32| {
        let view = paths.views[id as usize];
        let range = view.checks_from as usize..view.checks_end as usize;
        let checks: Vec<(u64, u64)> = paths.checks[range]
            .iter()
            .map(|c| (word_at(paths.anchor, c.at) as u64, c.value))
            .collect();
        let frames = paths.frames[view.frames_from as usize..view.frames_end as usize].to_vec();
        (view.whole, view.steps, view.lowest_read, checks, frames)
    };
    assert_eq!(
        piece(&paths, inner),
        (
            true,
            3,
            0x118,
            vec![(0x118, 0x2000), (0x138, 0x3000)],
            vec![0x1000, 0x2000, 0x3000]
        )
    );
    assert_eq!(paths.link(&walk, NONE), Some(inner), "the same path again");
    assert_eq!(paths.used, 4, "no node made for a path already made");
    // The innermost frame's step leaves bp as it was and the next step reads it: its
    // bp matters, the root's does not.
    assert_eq!(paths.find_all(walk[0].state).next(), Some(inner));
    assert_eq!(
        paths
            .find_all(State {
                bp: 0x1234,
                ..walk[0].state
            })
            .next(),
        None,
        "the next step reads bp, so this frame's bp matters"
    );
    let outer = paths.node(inner).caller;
    assert!(!paths.node(paths.node(outer).caller).bp_matters);
    // Another inner frame under the same outer part: one node more, linked to it.
    let other = [rule_step(0x1100, 0x100, 0x300, 0x120, false)];
    let id = paths.link(&other, outer).expect("room");
    assert_eq!(paths.used, 5);
    assert_eq!(
        paths.node(id).chain,
        crate::channel::event::native_chain(&[0x1100, 0x2000, 0x3000])
    );
    // An inner frame whose own step loads bp from the stack: its path does not
    // depend on the bp it was reached with.
    let loads_bp = [Node {
        bp_read_at: 0x110,
        lowest_read: 0x110,
        ..rule_step(0x1200, 0x100, 0x5555, 0x120, false)
    }];
    let id = paths.link(&loads_bp, outer).expect("room");
    assert_eq!(
        piece(&paths, id),
        (
            true,
            3,
            0x110,
            // The next frame's step reads bp: the bp loaded is checked too. The
            // outer part is copied from the path this one hangs on.
            vec![(0x118, 0x2000), (0x110, 0x300), (0x138, 0x3000)],
            vec![0x1200, 0x2000, 0x3000]
        )
    );
    assert_eq!(
        paths
            .find_all(State {
                bp: 0x7777,
                ..loads_bp[0].state
            })
            .next(),
        Some(id)
    );
}

#[test]
fn a_state_keeps_the_nodes_of_each_of_its_paths_newest_first() {
    let mut paths = empty_paths();
    // One frame (same state) called from two places: two paths from one state.
    let root_a = paths
        .link(&[end_step(0x3000, 0x140, 0)], NONE)
        .expect("room");
    let root_b = paths
        .link(&[end_step(0x3100, 0x140, 0)], NONE)
        .expect("room");
    let inner = rule_step(0x1000, 0x100, 0, 0x140, false);
    let via_a = paths.link(&[inner], root_a).expect("room");
    let via_b = paths.link(&[inner], root_b).expect("room");
    assert_ne!(via_a, via_b);
    let found: Vec<u32> = paths.find_all(inner.state).collect();
    assert_eq!(found, [via_b, via_a], "both paths, the newest first");
    // Taking path a again makes it the newest, and makes no node.
    let used = paths.used;
    assert_eq!(paths.link(&[inner], root_a), Some(via_a));
    assert_eq!(paths.used, used);
    let found: Vec<u32> = paths.find_all(inner.state).collect();
    assert_eq!(found, [via_a, via_b]);
}

#[test]
fn paths_that_do_not_fit_are_forgotten_and_so_is_every_node_of_another_table() {
    let mut paths = empty_paths();
    let walk = [end_step(0x3000, 0x140, 0)];
    let id = paths.link(&walk, NONE).expect("room");
    paths.use_table(1);
    assert_eq!(
        paths.find_all(walk[0].state).next(),
        Some(id),
        "the same table keeps them"
    );
    paths.use_table(2);
    assert_eq!(
        paths.find_all(walk[0].state).next(),
        None,
        "another table forgets them"
    );
    let id = paths.link(&walk, NONE).expect("room");
    paths.used = NODES as u32;
    assert_eq!(
        paths.link(&[rule_step(0x1000, 0x100, 0, 0x140, false)], id),
        None
    );
    assert_eq!(paths.used, 1, "all forgotten");
    assert_eq!(paths.find_all(walk[0].state).next(), None);
}
