//! Hostile or mistaken `MEMSNAP_*` values and environments, end to end on the fake CUDA
//! driver: none may crash the program, each refused value is one message naming the
//! variable, and no placeholder value, link or umask can put a file anywhere but where it
//! belongs or make it readable by others. (`memsnap run` and `memsnap dump` with the same
//! values: tests/steps.rs.)

mod common;

use common::{label_of, num, run_program, snapshot_files};
use std::path::Path;
use std::process::Command;

/// The stderr lines that mention `needle`.
fn lines_with<'a>(stderr: &'a str, needle: &str) -> Vec<&'a str> {
    stderr.lines().filter(|l| l.contains(needle)).collect()
}

/// Asserts the run printed exactly one "ignoring NAME=..." line, and returns it.
fn one_refusal<'a>(stderr: &'a str, name: &str) -> &'a str {
    let refusals = lines_with(stderr, "ignoring");
    assert_eq!(refusals.len(), 1, "{stderr}");
    assert!(
        refusals[0].contains(&format!("{name}=")) && refusals[0].contains("expected"),
        "{stderr}"
    );
    refusals[0]
}

#[test]
fn a_period_too_large_for_a_duration_is_one_message_not_an_abort() {
    for period in ["99999999999999999999", "5124095576030431h"] {
        let run = run_program("demo", &[], &[("MEMSNAP_PERIOD", period)], true);
        run.assert_success();
        assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
        let line = one_refusal(&run.stderr, "MEMSNAP_PERIOD");
        assert!(line.contains("from 1s to 30d"), "{line}");
        // Recording carried on with the default (no period): the exit snapshot only.
        let reasons: Vec<_> = snapshot_files(run.dir.path())
            .iter()
            .filter_map(|p| label_of(p))
            .collect();
        assert_eq!(reasons, ["exit"], "{}", run.stderr);
    }
}

#[test]
fn a_period_below_one_second_is_refused() {
    let run = run_program(
        "demo",
        &[],
        &[("MEMSNAP_PERIOD", "1ms"), ("MEMSNAP_AT_EXIT", "0")],
        true,
    );
    run.assert_success();
    one_refusal(&run.stderr, "MEMSNAP_PERIOD");
    assert!(snapshot_files(run.dir.path()).is_empty());
}

#[test]
fn signals_memsnap_must_not_borrow_are_refused() {
    for signal in [
        "11",
        "SEGV",
        "RTMIN+-23",
        "9",
        "32",
        "33",
        "RTMIN+2147483647",
        "HUP",
    ] {
        let run = run_program("demo", &[], &[("MEMSNAP_SIGNAL", signal)], true);
        run.assert_success();
        let line = one_refusal(&run.stderr, "MEMSNAP_SIGNAL");
        assert!(
            line.contains("USR1 or USR2") && line.contains("RTMIN+"),
            "{line}"
        );
    }
}

#[test]
fn the_stats_file_is_never_reached_through_a_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let link = dir.path().join("stats.csv");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let run = run_program(
        "steps",
        &["2"],
        &[
            ("MEMSNAP_STATS", link.to_str().unwrap()),
            ("MEMSNAP_AT_EXIT", "0"),
        ],
        true,
    );
    run.assert_success();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    let warnings = lines_with(&run.stderr, "MEMSNAP_STATS");
    assert_eq!(warnings.len(), 1, "{}", run.stderr);
    assert!(warnings[0].contains("symbolic link"), "{}", warnings[0]);
}

/// A new stats file is 0600 even when the program runs under `umask 000`.
#[test]
fn the_stats_file_is_private_under_any_umask() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.csv");
    let program = common::program_path("steps");
    let out = Command::new("sh")
        .args(["-c", "umask 000 && exec \"$0\" 2"])
        .arg(&program)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LD_LIBRARY_PATH", common::fake_lib_dir())
        .env("LD_PRELOAD", common::preload_lib())
        .env("MEMSNAP_FOLDER", dir.path())
        .env("MEMSNAP_AT_EXIT", "0")
        .env("MEMSNAP_STATS", &stats)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&stats).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{:o}", mode);
}

/// Reads a CSV file with Python's `csv` module (an independent RFC 4180 reader); returns
/// its rows as lists of fields.
fn python_csv(path: &Path) -> Vec<Vec<String>> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import csv, json, sys; print(json.dumps(list(csv.reader(open(sys.argv[1], newline='')))))",
        ])
        .arg(path)
        .output()
        .expect("run python3");
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_rank_with_line_breaks_commas_and_quotes_stays_one_csv_field() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats-{rank}.csv");
    let rank = "3\nx,\"y\"\r";
    let run = run_program(
        "steps",
        &["4"],
        &[
            ("MEMSNAP_STATS", stats.to_str().unwrap()),
            ("MEMSNAP_AT_EXIT", "0"),
            ("RANK", rank),
        ],
        true,
    );
    run.assert_success();
    // The file name gets the sanitized rank; the row gets the rank as it is.
    let rows = python_csv(&dir.path().join("stats-3_x__y__.csv"));
    assert_eq!(rows.len(), 1 + 4 + 1, "header, 4 steps, exit: {rows:?}");
    assert_eq!(rows[0][1], "rank");
    for row in &rows[1..] {
        assert_eq!(row.len(), rows[0].len(), "{row:?}");
        assert_eq!(row[1], rank);
    }
    let steps: Vec<u64> = rows[1..]
        .iter()
        .map(|row| row[2].parse().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 4]);
    let r = run.results();
    assert_eq!(
        rows[4][5].parse::<u64>().unwrap(),
        num(&r, "step4_live_bytes")
    );
}

#[test]
fn a_rank_of_dot_dot_stays_inside_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("snaps").join("{rank}");
    for (rank, component) in [("..", "_."), (".", "_"), ("../..", "_._..")] {
        let run = run_program(
            "demo",
            &[],
            &[("MEMSNAP_FOLDER", folder.to_str().unwrap()), ("RANK", rank)],
            true,
        );
        run.assert_success();
        let written = snapshot_files(&dir.path().join("snaps").join(component));
        assert_eq!(written.len(), 1, "RANK={rank}: {}", run.stderr);
        let name = written[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.contains(&format!("-r{component}-")), "{name}");
        std::fs::remove_file(&written[0]).unwrap();
    }
    // Nothing landed above the folder.
    assert!(snapshot_files(dir.path()).is_empty());
    assert!(snapshot_files(&dir.path().join("snaps")).is_empty());
}

#[test]
fn file_names_that_would_be_hidden_or_dots_are_refused() {
    for filename in ["..", ".", ".snap-{pid}.pickle"] {
        let run = run_program("demo", &[], &[("MEMSNAP_FILENAME", filename)], true);
        run.assert_success();
        let line = one_refusal(&run.stderr, "MEMSNAP_FILENAME");
        assert!(line.contains("does not start with '.'"), "{line}");
        // The default name was used: one visible exit snapshot.
        let all: Vec<_> = std::fs::read_dir(run.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(all[0].starts_with("memsnap-"), "{all:?}");
    }
}

#[test]
fn a_folder_that_is_a_link_to_a_file_or_nowhere_is_named_in_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let to_file = dir.path().join("to-file");
    std::os::unix::fs::symlink(&file, &to_file).unwrap();
    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("gone"), &dangling).unwrap();
    for (folder, what) in [
        (&to_file, "a symbolic link to a file"),
        (&dangling, "a dangling symbolic link"),
    ] {
        let run = run_program(
            "demo",
            &[],
            &[("MEMSNAP_FOLDER", folder.to_str().unwrap())],
            true,
        );
        run.assert_success();
        let warnings = lines_with(&run.stderr, "could not write");
        assert_eq!(warnings.len(), 1, "{}", run.stderr);
        assert!(
            warnings[0].contains(&format!(
                "{} is {what}; memsnap needs a directory there",
                folder.display()
            )),
            "{}",
            warnings[0]
        );
        assert!(!warnings[0].contains("os error"), "{}", warnings[0]);
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    assert!(!dir.path().join("gone").exists());
}

/// A folder others can write to is used (the job goes on) with one warning, however many
/// snapshots go there; a folder of the user's own gets none.
#[test]
fn a_folder_others_can_write_is_named_in_one_warning() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let folder = shared.to_str().unwrap();
    let run = run_program(
        "steps",
        &["4"],
        &[("MEMSNAP_FOLDER", folder), ("MEMSNAP_EVERY", "1")],
        true,
    );
    run.assert_success();
    assert!(snapshot_files(&shared).len() > 1, "{}", run.stderr);
    let warnings = lines_with(&run.stderr, "can be written by");
    assert_eq!(warnings.len(), 1, "{}", run.stderr);
    assert!(
        warnings[0].starts_with(&format!(
            "memsnap: the snapshot folder {folder} can be written by its group and by everyone"
        )),
        "{}",
        warnings[0]
    );
    let private = run_program("demo", &[], &[], true);
    private.assert_success();
    assert!(
        !private.stderr.contains("can be written by"),
        "{}",
        private.stderr
    );
}

#[test]
fn unknown_placeholders_in_the_folder_and_stats_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [
        (
            "MEMSNAP_FOLDER",
            format!("{}/{{rnak}}", dir.path().display()),
        ),
        (
            "MEMSNAP_STATS",
            format!("{}/{{rnak}}.csv", dir.path().display()),
        ),
        (
            "MEMSNAP_STATS",
            format!("{}/mem-{{step}}.csv", dir.path().display()),
        ),
    ] {
        // No exit snapshot: a refused folder falls back to the working directory.
        let run = run_program(
            "demo",
            &[],
            &[(name, value.as_str()), ("MEMSNAP_AT_EXIT", "0")],
            true,
        );
        run.assert_success();
        let line = one_refusal(&run.stderr, name);
        assert!(line.contains("unknown placeholder"), "{line}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}

/// A newline (or any control character) in a path setting would split the exit line and
/// forge lines for whoever reads it: refused, in one message naming the variable.
#[test]
fn control_characters_in_paths_are_refused() {
    for (name, value) in [
        ("MEMSNAP_FILENAME", "snap\nforged: a line of its own.pickle"),
        ("MEMSNAP_FOLDER", "/tmp/a\rb"),
        ("MEMSNAP_STATS", "/tmp/stats\t.csv"),
        ("MEMSNAP_REMOTE", "file:///tmp/r/\u{1b}[2J{seq}.pickle"),
    ] {
        let run = run_program("demo", &[], &[(name, value)], true);
        run.assert_success();
        let line = one_refusal(&run.stderr, name);
        assert!(line.contains("without control characters"), "{line}");
        // The exit line is one line, in the run's own folder; nothing forged a line.
        let wrote: Vec<&str> = run
            .stderr
            .lines()
            .filter(|l| l.starts_with("memsnap: wrote"))
            .collect();
        assert_eq!(wrote.len(), 1, "{}", run.stderr);
        assert!(!wrote[0].contains('\r'), "{}", run.stderr);
        assert!(
            !run.stderr.lines().any(|l| l.starts_with("forged")),
            "{}",
            run.stderr
        );
    }
}
