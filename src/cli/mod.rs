//! The `memsnap` subcommands. Cold, no unsafe.

pub mod dump;
pub mod run;
