//! The `memsnap` command line (stub: being written).
#![forbid(unsafe_code)]

#[allow(dead_code)]
mod config;
#[allow(dead_code)]
mod snapshot;

fn main() {
    eprintln!("memsnap: the CLI is being written");
    std::process::exit(2);
}
