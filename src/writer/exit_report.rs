//! The one line a user sees at exit: which snapshots were written, where, and what to run
//! next (`MEMSNAP_QUIET` silences it). Also printed before an exec replaces the image.
//! [`AtExit`]: what exit and exec write.
//!
//! Cold (writer thread, once per image).

use super::{Writer, absolute};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;

/// What exit (and an exec, which ends the image) writes besides the last stats row.
#[derive(Clone, Copy)]
pub(super) struct AtExit {
    /// A snapshot (`MEMSNAP_AT_EXIT`).
    pub snapshot: bool,
    /// The exit line (off with `MEMSNAP_QUIET`).
    pub line: bool,
}

impl Writer {
    /// The written files the upload helper moved away (`MEMSNAP_REMOTE_ONLY=1`).
    fn moved_files<'a>(&'a self, files: &'a [PathBuf]) -> impl Iterator<Item = &'a PathBuf> {
        files.iter().filter(|p| {
            self.uploader
                .as_ref()
                .is_some_and(|u| u.moved_to(p).is_some())
        })
    }

    /// The one line a user sees at exit: which files, and what to run next.
    pub(super) fn report_at_exit(&self) {
        if !self.at_exit.line {
            return;
        }
        let mut err = io::stderr().lock();
        match self.files.written() {
            [] => {
                let _ = writeln!(
                    err,
                    "memsnap: recorded {} events; no snapshot was written",
                    self.rec.counters.applied.load(Relaxed)
                );
            }
            files if self.moved_files(files).next().is_some() => {
                // MEMSNAP_REMOTE_ONLY=1: the files the helper confirmed are no longer
                // here; they are named where they are now.
                let shown: Vec<String> = files
                    .iter()
                    .map(
                        |p| match self.uploader.as_ref().and_then(|u| u.moved_to(p)) {
                            Some(url) => url.to_string(),
                            None => absolute(p).display().to_string(),
                        },
                    )
                    .collect();
                let moved = self.moved_files(files).count();
                let last = shown.last().cloned().unwrap_or_default();
                let listed = &shown[shown.len().saturating_sub(5)..];
                let more = if shown.len() > 5 {
                    format!(" (and {} more)", shown.len() - 5)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    err,
                    "memsnap: wrote {} snapshot{} ({moved} uploaded to MEMSNAP_REMOTE and removed here): {}{more}. Look at it with: memsnap summary {last}",
                    files.len(),
                    if files.len() == 1 { "" } else { "s" },
                    listed.join(", "),
                );
            }
            files => {
                let files: Vec<PathBuf> = files.iter().map(|p| absolute(p)).collect();
                let folders: std::collections::BTreeSet<&std::path::Path> =
                    files.iter().filter_map(|p| p.parent()).collect();
                // One folder: named once, files by name; several: whole paths.
                let (place, shown): (String, Vec<String>) = match folders.iter().next() {
                    Some(dir) if folders.len() == 1 => {
                        let created = if self.files.created_folders().iter().any(|c| c == dir) {
                            ", a folder memsnap created"
                        } else {
                            ""
                        };
                        (
                            format!(" in {}{created}", dir.display()),
                            files
                                .iter()
                                .filter_map(|p| p.file_name())
                                .map(|n| n.to_string_lossy().into_owned())
                                .collect(),
                        )
                    }
                    _ => {
                        let created: Vec<String> = self
                            .files
                            .created_folders()
                            .iter()
                            .map(|c| c.display().to_string())
                            .collect();
                        let note = if created.is_empty() {
                            String::new()
                        } else {
                            format!(" (memsnap created {})", created.join(", "))
                        };
                        (
                            note,
                            files.iter().map(|p| p.display().to_string()).collect(),
                        )
                    }
                };
                let last = files
                    .last()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                let listed = &shown[shown.len().saturating_sub(5)..];
                let more = if files.len() > 5 {
                    format!(" (and {} more)", files.len() - 5)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    err,
                    "memsnap: wrote {} snapshot{}{place}: {}{more}. Look at it with: memsnap summary {last} (or open it at https://pytorch.org/memory_viz)",
                    files.len(),
                    if files.len() == 1 { "" } else { "s" },
                    listed.join(", "),
                );
            }
        }
    }
}
