//! The `memsnap` command line: a thin dispatcher over one module per command. Each reading
//! command parses its arguments (clap), opens its files ([`input`]), asks the engine
//! (`memsnap_engine`) for its model and renders it (text, JSON, HTML, SVG); the launchers
//! (`run`, `dump`, `top`, `upload-agent`) talk to processes and stores; `mcp` serves the
//! reading commands to an agent. Cold code.
//!
//! Exit status: 0 ok; 1 only for `diff --fail-above` when growth passes the limit and
//! `explain --fail-on-leak` when a leak is found;
//! 2 for every error (bad arguments, unreadable or invalid files). A closed stdout
//! (`memsnap summary x | head`) is not an error: exit 0.
#![forbid(unsafe_code)]

mod args;
mod check;
mod diff;
mod dump;
mod explain;
mod flamegraph;
mod input;
mod mcp;
mod ranks;
mod reach;
mod remote;
mod run;
mod shown;
mod summary;
mod top;
mod upload_agent;
mod view;
mod whatif;

use clap::{CommandFactory, Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "memsnap",
    version,
    about = "Read GPU memory snapshots (memsnap's and PyTorch's) and answer what holds the memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// What held the memory at the moment that matters (the OOM, else the peak, or --at),
    /// beside the end, per device: sites, libraries, OOMs.
    Summary(summary::Args),
    /// What grew between two snapshots (at their ends, or --at), by allocation site (exit 1
    /// past --fail-above).
    Diff(diff::Args),
    /// One row per rank file in a folder; marks the ranks that stand out.
    Ranks(ranks::Args),
    /// Why it ran out of memory, leaks across steps, who owns every byte and what for, the
    /// ranks side by side: a few short paragraphs over files, folders of a run or prefixes.
    Explain(explain::Args),
    /// Replay the recorded run through PyTorch's caching allocator under other settings
    /// (--set), backends or larger requests (--scale): would it have fitted?
    Whatif(whatif::Args),
    /// Write one self-contained HTML page: timeline, segments, stacks, search, zoom; it opens
    /// at the OOM, else the peak (--at).
    View(view::Args),
    /// Write a flame graph (SVG) of live bytes by stack at the OOM, else the peak (--at).
    Flamegraph(flamegraph::Args),
    /// Check each snapshot against the rules PyTorch's viewer relies on: protocol 2-4, its
    /// opcodes, batches <= 1000, frames {name, filename, line}, integers, tiling, each
    /// device's history (exit 1 if any file breaks one, 2 if any cannot be read).
    Check(check::Args),
    /// Run a command with libmemsnap.so preloaded; list the snapshots it wrote.
    Run(Box<run::RunArgs>),
    /// Ask running processes (with memsnap loaded) for a snapshot now.
    Dump(dump::DumpArgs),
    /// The helper libmemsnap.so starts to copy snapshots to MEMSNAP_REMOTE (not run by hand).
    #[command(hide = true)]
    UploadAgent(upload_agent::Args),
    /// Watch running processes' GPU memory by allocation site, live (no file written).
    Top(top::TopArgs),
    /// Serve summary, diff, ranks, explain and whatif (five tools) to an agent: a Model Context
    /// Protocol server on stdin/stdout whose tools return the commands' --json output
    /// (docs/MCP.md).
    Mcp(mcp::Args),
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<serde_json::Error>()
                .and_then(|j| j.io_error_kind())
                .is_some_and(|k| k == std::io::ErrorKind::BrokenPipe)
    })
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            if e.kind() == clap::error::ErrorKind::UnknownArgument
                && let Some(list) = std::env::args().nth(1).and_then(|s| accepted_options(&s))
            {
                eprintln!("{list}");
            }
            return ExitCode::from(code);
        }
    };
    match cli.cmd {
        Cmd::Summary(a) => report(|out| summary::run(&a, out)),
        Cmd::Diff(a) => report(|out| diff::run(&a, out)),
        Cmd::Ranks(a) => report(|out| ranks::run(&a, out)),
        Cmd::Explain(a) => report(|out| explain::run(&a, out)),
        Cmd::Whatif(a) => report(|out| whatif::run(&a, out)),
        Cmd::View(a) => report(|out| view::run(&a, out)),
        Cmd::Flamegraph(a) => report(|out| flamegraph::run(&a, out)),
        Cmd::Check(a) => report(|out| check::run(&a, out)),
        // The launchers manage their own output and exit status.
        Cmd::Run(a) => launch(run::run(*a)),
        Cmd::Dump(a) => launch(dump::dump(a)),
        Cmd::UploadAgent(a) => launch(upload_agent::run(&a)),
        Cmd::Top(a) => launch(top::top(a)),
        Cmd::Mcp(a) => launch(mcp::serve(&a)),
    }
}

/// The options `memsnap SUBCOMMAND` takes, as a line for after clap's message on one it
/// does not: a misplaced or misspelt option (`memsnap run --bogus python train.py`) is
/// answered with the list, not only a pointer to --help.
fn accepted_options(subcommand: &str) -> Option<String> {
    let mut cli = Cli::command();
    cli.build();
    let sub = cli.find_subcommand(subcommand)?;
    let options: Vec<String> = sub
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long())
        .map(|long| format!("--{long}"))
        .collect();
    (!options.is_empty()).then(|| {
        format!(
            "the options of `memsnap {}`: {}",
            sub.get_name(),
            options.join(", ")
        )
    })
}

/// Runs a command that reads snapshots and prints a report to (buffered) stdout.
fn report(command: impl FnOnce(&mut dyn Write) -> anyhow::Result<i32>) -> ExitCode {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = command(&mut out).and_then(|code| {
        out.flush()?;
        Ok(code)
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            drop(out);
            eprintln!("memsnap: {}", shown::shown(&format!("{e:#}")));
            ExitCode::from(2)
        }
    }
}

fn launch(result: anyhow::Result<ExitCode>) -> ExitCode {
    result.unwrap_or_else(|e| {
        // The launchers' messages have lines of their own (each refused value, each folder
        // looked in).
        eprintln!("memsnap: {}", shown::shown_lines(&format!("{e:#}")));
        ExitCode::from(2)
    })
}

#[cfg(test)]
mod tests {
    use super::{Cli, Cmd, accepted_options};
    use clap::Parser;

    fn run_command(argv: &[&str]) -> Vec<String> {
        match Cli::try_parse_from(argv).map(|c| c.cmd) {
            Ok(Cmd::Run(a)) => a
                .command
                .iter()
                .map(|w| w.to_string_lossy().into_owned())
                .collect(),
            other => panic!("{argv:?}: {other:?}"),
        }
    }

    #[test]
    fn run_takes_options_before_the_command_and_passes_the_rest_on() {
        let cmd = run_command(&[
            "memsnap", "run", "--every", "2", "python", "-u", "--every", "x",
        ]);
        assert_eq!(cmd, ["python", "-u", "--every", "x"]);
        assert_eq!(
            run_command(&["memsnap", "run", "--", "--weird", "-x"]),
            ["--weird", "-x"]
        );
        // An option run does not know, before the command, is refused, not run.
        let e = Cli::try_parse_from(["memsnap", "run", "--bogus", "python", "x.py"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
        assert!(e.to_string().contains("'--bogus'"), "{e}");
        let list = accepted_options("run").unwrap();
        assert!(
            list.starts_with("the options of `memsnap run`: --folder, "),
            "{list}"
        );
        assert!(list.contains("--lib") && list.contains("--help"), "{list}");
        assert_eq!(accepted_options("nope"), None);
    }
}
