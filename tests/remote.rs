//! `MEMSNAP_REMOTE`: every published snapshot is also copied by the `memsnap upload-agent`
//! helper, end to end on the fake CUDA driver (no GPU). Needs `cargo build --workspace`
//! first (the tests preload target/<profile>/libmemsnap.so, which finds the `memsnap`
//! binary beside it).

mod common;

use common::{run_program, snapshot_files};
use std::collections::BTreeMap;
use std::path::Path;

/// File name -> bytes of the regular files directly inside `dir`.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    snapshot_files(dir)
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn remote_url(dir: &Path) -> String {
    format!(
        "file://{}/r{{rank}}/{{reason}}-{{seq}}.pickle",
        dir.display()
    )
}

/// stdout of a successful `memsnap` command.
fn memsnap(args: &[&str]) -> String {
    let out = std::process::Command::new(common::memsnap_bin())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn upload_lines(stderr: &str) -> usize {
    stderr.matches("could not upload").count()
}

#[test]
fn step_oom_and_exit_snapshots_are_uploaded_with_the_same_bytes() {
    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "steps",
        &["6"],
        &[
            ("MEMSNAP_EVERY", "2"),
            ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
            ("MEMSNAP_REMOTE", &url),
            ("RANK", "3"),
        ],
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    let names: Vec<&str> = local.keys().map(String::as_str).collect();
    assert!(names.contains(&"step-1.pickle"), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("exit-")), "{names:?}");
    assert_eq!(contents(&remote.path().join("r3")), local, "{}", run.stderr);
    assert_eq!(upload_lines(&run.stderr), 0, "{}", run.stderr);

    // The CLI reads the copies through their URLs: the same answers as the local files.
    let copies = format!("file://{}/r3/", remote.path().display());
    assert_eq!(
        memsnap(&["ranks", &copies]),
        memsnap(&["ranks", &run.dir.path().display().to_string()])
    );
    let exit = names.iter().find(|n| n.starts_with("exit-")).unwrap();
    assert_eq!(
        memsnap(&["summary", &format!("{copies}{exit}")]),
        memsnap(&["summary", &run.dir.path().join(exit).display().to_string()])
    );

    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "oom",
        &[],
        &[
            ("FAKE_CUDA_CAPACITY", "64M"),
            ("MEMSNAP_FILENAME", "{reason}-{seq}.pickle"),
            ("MEMSNAP_REMOTE", &url),
            ("RANK", "0"),
        ],
        true,
    );
    run.assert_success();
    let local = contents(run.dir.path());
    assert!(local.contains_key("oom-1.pickle"), "{:?}", local.keys());
    assert!(local.contains_key("exit-2.pickle"), "{:?}", local.keys());
    assert_eq!(contents(&remote.path().join("r0")), local, "{}", run.stderr);
}

#[test]
fn remote_only_removes_the_local_file_after_the_copy() {
    let remote = tempfile::tempdir().unwrap();
    let url = remote_url(remote.path());
    let run = run_program(
        "steps",
        &["3"],
        &[
            ("MEMSNAP_REMOTE", &url),
            ("MEMSNAP_REMOTE_ONLY", "1"),
            ("RANK", "1"),
        ],
        true,
    );
    run.assert_success();
    let copies = contents(&remote.path().join("r1"));
    assert_eq!(copies.keys().collect::<Vec<_>>(), ["exit-1.pickle"]);
    assert!(copies["exit-1.pickle"].len() > 100);
    assert!(
        snapshot_files(run.dir.path()).is_empty(),
        "{:?}",
        snapshot_files(run.dir.path())
    );
}

#[test]
fn a_failed_upload_is_one_line_and_keeps_the_local_files() {
    let run = run_program(
        "steps",
        &["6"],
        &[
            ("MEMSNAP_EVERY", "2"),
            (
                "MEMSNAP_REMOTE",
                "file:///proc/memsnap-cannot-write/{reason}-{seq}.pickle",
            ),
        ],
        true,
    );
    run.assert_success();
    let local = snapshot_files(run.dir.path());
    assert!(local.len() >= 4, "{local:?}");
    assert_eq!(upload_lines(&run.stderr), 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("the local file stays"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("uploads to MEMSNAP_REMOTE failed"),
        "{}",
        run.stderr
    );
}

#[test]
fn memsnap_run_refuses_an_object_store_url_it_cannot_reach() {
    let out = std::process::Command::new(common::memsnap_bin())
        .args(["run", "--remote", "s3://bucket/{rank}.pickle", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MEMSNAP_REMOTE"), "{stderr}");
    assert!(stderr.contains("s3:// uploads are not built"), "{stderr}");
}
