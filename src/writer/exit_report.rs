//! The one line a user sees at exit: which snapshots were written, where, and what to run
//! next (`MEMSNAP_QUIET` silences it).
//!
//! Cold (writer thread, once).

use super::{Writer, absolute};
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering::*;

impl Writer {
    /// The one line a user sees at exit: which files, and what to run next.
    pub(super) fn report_at_exit(&self) {
        if self.cfg.quiet {
            return;
        }
        let mut err = io::stderr().lock();
        match self.written.as_slice() {
            [] => {
                let _ = writeln!(
                    err,
                    "memsnap: recorded {} events; no snapshot was written",
                    self.rec.counters.pushed.load(Relaxed)
                );
            }
            files => {
                let files: Vec<PathBuf> = files.iter().map(|p| absolute(p)).collect();
                let folders: std::collections::BTreeSet<&std::path::Path> =
                    files.iter().filter_map(|p| p.parent()).collect();
                // One folder: named once, files by name; several: whole paths.
                let (place, shown): (String, Vec<String>) = match folders.iter().next() {
                    Some(dir) if folders.len() == 1 => {
                        let created = if self.created_folders.iter().any(|c| c == dir) {
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
                            .created_folders
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
