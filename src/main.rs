//! The `memsnap` command line: a thin dispatcher over `src/cli/` (one file per command).
//!
//! Exit status: 0 ok; 1 only for `diff --fail-above` when growth passes the limit;
//! 2 for every error (bad arguments, unreadable or invalid files). A closed stdout
//! (`memsnap summary x | head`) is not an error: exit 0.
#![forbid(unsafe_code)]

mod cli;
#[allow(dead_code)]
mod config;
#[allow(dead_code)]
mod snapshot;

use clap::{Parser, Subcommand};
use std::io::Write;

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
    /// Per device: live, reserved and peak bytes, top allocation sites and libraries, OOMs.
    Summary(cli::summary::Args),
    /// What grew between two snapshots, by allocation site (exit 1 past --fail-above).
    Diff(cli::diff::Args),
    /// One row per rank file in a folder; marks the ranks that stand out.
    Ranks(cli::ranks::Args),
    /// Write one self-contained HTML page: timeline, segments, stacks, search, zoom.
    View(cli::view::Args),
    /// Write a flame graph (SVG) of live bytes by stack.
    Flamegraph(cli::flamegraph::Args),
    // `run`, `dump` and `check` are added here by the lead (their modules go in src/cli/).
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

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = match &cli.cmd {
        Cmd::Summary(a) => cli::summary::run(a, &mut out),
        Cmd::Diff(a) => cli::diff::run(a, &mut out),
        Cmd::Ranks(a) => cli::ranks::run(a, &mut out),
        Cmd::View(a) => cli::view::run(a, &mut out),
        Cmd::Flamegraph(a) => cli::flamegraph::run(a, &mut out),
    }
    .and_then(|code| {
        out.flush()?;
        Ok(code)
    });
    let code = match result {
        Ok(code) => code,
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            drop(out);
            eprintln!("memsnap: {e:#}");
            2
        }
    };
    std::process::exit(code);
}
