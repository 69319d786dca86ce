//! Writing one snapshot: built from the state (`dump`), named and written atomically
//! (`files`), handed to the uploader when `MEMSNAP_REMOTE` is set; a failure is a warning on
//! stderr (the first few), never the program's problem.
//!
//! Cold (writer thread).

use super::files::{self, NameFields, Reason};
use super::{Writer, absolute, dump};
use crate::snapshot::pickle_write;
use std::path::PathBuf;

/// Write-failure warnings printed before going quiet.
const MAX_WRITE_WARNINGS: u32 = 3;

impl Writer {
    /// Writes one snapshot of the whole history; returns its path, or why it could not be
    /// written.
    pub(super) fn dump(&mut self, reason: Reason, tag: &str) -> Result<PathBuf, String> {
        self.dump_from(reason, tag, None)
    }

    /// [`Writer::dump`], the history cut to each device's events from `history_from` on
    /// when given (a recording window).
    pub(super) fn dump_from(
        &mut self,
        reason: Reason,
        tag: &str,
        history_from: Option<&[u64]>,
    ) -> Result<PathBuf, String> {
        self.hold_if_starved();
        let mut snap = dump::build(
            &self.state,
            &mut self.stacks,
            &mut self.interner,
            history_from,
        );
        self.seq += 1;
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let fields = NameFields {
            reason,
            seq: self.seq,
            step: self.window.step(),
            tag,
            time_s: now_s,
        };
        snap.allocator_settings = self.allocator_settings();
        snap.memsnap = self.metadata(reason, tag);
        self.hold_if_starved();
        let bytes = pickle_write::to_bytes(&snap);
        // Encoded: the threads a request held need not wait for the file to be written.
        self.end_serving();
        let name = files::expand(&self.cfg.filename, &self.id, &fields);
        let result = files::folder(&self.cfg, &self.id, &fields).and_then(|dir| {
            if dir.created {
                self.created_folders.push(absolute(&dir.path));
            }
            let held = self.folders.open(&dir.path)?;
            files::write_atomic(&held, &name, &bytes, self.cfg.overwrite)
        });
        match result {
            Ok(path) => {
                if let (Some(uploader), Some(remote)) = (&mut self.uploader, &self.cfg.remote) {
                    uploader.send(&path, &files::expand(remote, &self.id, &fields));
                }
                self.written.push(path.clone());
                Ok(path)
            }
            Err(e) => {
                self.write_warnings += 1;
                if self.write_warnings <= MAX_WRITE_WARNINGS {
                    eprintln!(
                        "memsnap: could not write the {} snapshot {name} in {}: {e}{}",
                        reason.as_str(),
                        self.cfg.folder,
                        if self.write_warnings == MAX_WRITE_WARNINGS {
                            " (further failures are silent)"
                        } else {
                            ""
                        }
                    );
                }
                Err(format!(
                    "could not write {name} in {}: {e}",
                    self.cfg.folder
                ))
            }
        }
    }
}
