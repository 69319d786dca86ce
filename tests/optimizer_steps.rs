//! Steps without code (docs/PYTORCH.md, "Steps without code"): a training loop with no
//! memsnap code gets a step boundary at each optimizer step, with the library preloaded and
//! nothing else. Run on the simulated driver against a stand-in of PyTorch's optimizer module
//! (tests/programs/py_optimizer_steps.py), under every installed CPython 3.10–3.14; the real
//! PyTorch's are in tests/real_torch.rs.

mod common;

use common::{run_program, run_program_under, written};
use serde_json::Value;
use std::path::Path;

/// Runs the program in `mode` under `python` with the library preloaded and `env`; checks
/// that it printed what it prints without the library. Returns the files' labels, the exit
/// file's metadata and the program's results.
fn run(
    python: &Path,
    mode: &str,
    env: &[(&str, &str)],
) -> (
    Vec<String>,
    Value,
    std::collections::HashMap<String, String>,
) {
    let program = "py_optimizer_steps.py";
    let run = run_program_under(Some(python), program, &[mode], env, true);
    run.assert_success();
    let plain = run_program_under(Some(python), program, &[mode], env, false);
    plain.assert_success();
    // The program's own output is the same with memsnap (its hook handles keep their
    // numbers: memsnap registers through no function of PyTorch's); `memsnap_step()` is the
    // only difference, absent without the library.
    if mode != "program" {
        assert_eq!(run.stdout, plain.stdout, "{mode}");
    }
    let (labels, meta) = written(run.dir.path());
    (labels, meta, run.results())
}

#[test]
fn each_optimizer_step_is_a_step_under_each_cpython() {
    for (name, python) in common::interpreters() {
        let (labels, meta, r) = run(&python, "plain", &[("MEMSNAP_EVERY", "5")]);
        assert_eq!(r["steps"], "20", "Python {name}");
        assert_eq!(r["hooks"], "0,1", "Python {name}");
        common::assert_optimizer_steps(&labels, &meta, &format!("Python {name}"));
        // The program marks its steps too: counted once, the program's from then on.
        let (labels, meta, r) = run(&python, "program", &[("MEMSNAP_EVERY", "5")]);
        assert_eq!(r["marks"], ["0"; 20].join(","), "Python {name}");
        assert_eq!(labels, common::steps_every_5(), "Python {name}");
        assert_eq!(meta["step"], 20, "Python {name}");
        assert_eq!(
            meta["step_source"], "optimizer, then program from step 1",
            "Python {name}"
        );
        assert_eq!(
            meta["optimizer_step_hook"], "attached; unused since the program marks its own steps",
            "Python {name}"
        );
        eprintln!("Python {name}: ok");
    }
}

#[test]
fn gradient_accumulation_marks_one_step_per_optimizer_step() {
    let program = "py_optimizer_steps.py";
    let python = Path::new("python3");
    let run = run_program_under(Some(python), program, &["accumulate"], &[], true);
    run.assert_success();
    assert_eq!(run.results()["steps"], "20");
    let (labels, meta) = written(run.dir.path());
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 20);
    // summary says where the steps came from.
    let exit = common::snapshot_files(run.dir.path())
        .pop()
        .expect("the exit file");
    let out = std::process::Command::new(common::memsnap_bin())
        .arg("summary")
        .arg(&exit)
        .output()
        .expect("run memsnap");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("\nSteps: 20 (from: optimizer; optimizer step hook: attached)\n"),
        "{text}"
    );
}

#[test]
fn two_optimizers_mark_one_step_an_iteration() {
    let (labels, meta, r) = run(Path::new("python3"), "two", &[("MEMSNAP_EVERY", "5")]);
    assert_eq!(r["steps"], "40");
    assert_eq!(labels, common::steps_every_5());
    assert_eq!(meta["step"], 20);
}

#[test]
fn memsnap_steps_off_marks_nothing_and_program_only_the_programs() {
    let python = Path::new("python3");
    let off = [("MEMSNAP_STEPS", "off"), ("MEMSNAP_EVERY", "5")];
    let (labels, meta, r) = run(python, "program", &off);
    assert_eq!(r["marks"], ["-1"; 20].join(","));
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 0);
    assert_eq!(meta["step_source"], "none");
    assert_eq!(meta["optimizer_step_hook"], "off (MEMSNAP_STEPS=off)");
    let program = [("MEMSNAP_STEPS", "program"), ("MEMSNAP_EVERY", "5")];
    let (labels, meta, _) = run(python, "plain", &program);
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 0);
    assert_eq!(meta["optimizer_step_hook"], "off (MEMSNAP_STEPS=program)");
    let (labels, meta, _) = run(python, "program", &program);
    assert_eq!(labels, common::steps_every_5());
    assert_eq!(meta["step_source"], "program");
}

#[test]
fn a_program_with_global_step_hooks_of_its_own_gets_no_automatic_steps() {
    // memsnap adds nothing to a table a step of the program may be iterating.
    let (labels, meta, r) = run(Path::new("python3"), "own_hooks", &[("MEMSNAP_EVERY", "5")]);
    assert_eq!(r["hooks"], "0,1,2");
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 0);
    assert_eq!(
        meta["optimizer_step_hook"],
        "not attached: the program has global optimizer step hooks of its own"
    );
}

#[test]
fn a_program_without_torch_gets_no_steps_and_no_import() {
    let (labels, meta, r) = run(Path::new("python3"), "none", &[("MEMSNAP_EVERY", "5")]);
    assert_eq!(r["torch_imported"], "False");
    assert_eq!(labels, ["exit"]);
    assert_eq!(meta["step"], 0);
    assert_eq!(meta["step_source"], "none");
    assert_eq!(
        meta["optimizer_step_hook"],
        "not attached: torch.optim not imported"
    );
}

#[test]
fn a_c_program_says_there_is_no_python() {
    let run = run_program("threads", &["2", "100"], &[], true);
    run.assert_success();
    let (_, meta) = written(run.dir.path());
    assert_eq!(meta["step_source"], "none");
    assert_eq!(
        meta["optimizer_step_hook"],
        "not attached: no supported CPython in the process"
    );
}
