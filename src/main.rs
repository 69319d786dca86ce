//! The `memsnap` command line.
#![forbid(unsafe_code)]

mod cli;
#[allow(dead_code)]
mod config;
#[allow(dead_code)]
mod snapshot;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memsnap",
    version,
    about = "GPU memory snapshots of any CUDA program"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a command with libmemsnap.so preloaded
    Run(cli::run::RunArgs),
    /// Ask running processes for a snapshot now
    Dump(cli::dump::DumpArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Run(args) => cli::run::run(args),
        Command::Dump(args) => cli::dump::dump(args),
    };
    result.unwrap_or_else(|e| {
        eprintln!("memsnap: {e:#}");
        ExitCode::from(2)
    })
}
