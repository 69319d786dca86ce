//! The `memsnap` subcommands: one file per command. The readers (summary, diff, ranks,
//! view, flamegraph, check) share loading and analysis and write to a `Write`, so a closed
//! pipe is an error the dispatcher turns into exit 0 instead of a panic; the launchers
//! (run, dump) manage their own output. Cold code, no unsafe.

pub mod analysis;
pub mod check;
pub mod diff;
pub mod dump;
pub mod flamegraph;
pub mod ranks;
pub mod run;
pub mod summary;
pub mod view;

use crate::snapshot::model::Snapshot;
use crate::snapshot::pickle_read;
use anyhow::{Context, Result};
use std::io::IsTerminal;
use std::path::Path;

/// Files at least this large get a progress bar (when stderr is a terminal).
const PROGRESS_MIN_BYTES: usize = 64 << 20;

/// Reads and decodes one snapshot; errors name the file and the problem.
///
/// The file is streamed through the decoder a chunk at a time rather than read whole or
/// memory-mapped: the pickle is decoded front to back once, so holding the whole file
/// would only add its size to the peak memory, while a file truncated by a writer during
/// the read stays a clear error (a map would turn it into SIGBUS, and mapping needs
/// `unsafe` in code that otherwise forbids it).
pub fn load(path: &Path) -> Result<Snapshot> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot read {}", path.display()))?
        .len() as usize;
    let bar = (len >= PROGRESS_MIN_BYTES && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(len as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(format!("reading {}", path.display()));
        b
    });
    let mut reader = file;
    let snap = pickle_read::read_snapshot_from(&mut reader, &mut |done| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    snap.with_context(|| format!("{} is not a readable memory snapshot", path.display()))
}

/// The file name for messages and tables (the full path is in JSON).
pub fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
