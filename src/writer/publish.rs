//! Writing one snapshot: built from the state (`dump`), named and written atomically
//! (`files`), handed to the uploader when `MEMSNAP_REMOTE` is set; a failure is a warning on
//! stderr (the first few), never the program's problem. [`SnapshotFiles`] holds where the
//! files go and what was written.
//!
//! Cold (writer thread).

use super::files::{self, Identity, NameFields, Reason};
use super::folder::Folders;
use super::{Writer, absolute, dump};
use crate::snapshot::pickle_write;
use std::path::PathBuf;

/// Write-failure warnings printed before going quiet.
const MAX_WRITE_WARNINGS: u32 = 3;

/// The snapshot files: where they go (`MEMSNAP_FOLDER`, `MEMSNAP_FILENAME`,
/// `MEMSNAP_OVERWRITE`), those written, and the folders they went to.
pub(super) struct SnapshotFiles {
    /// The folder's template.
    folder: String,
    /// The file name's template.
    filename: String,
    overwrite: bool,
    /// Snapshots numbered so far (`{seq}`), written or not.
    seq: u64,
    written: Vec<PathBuf>,
    /// Folders memsnap created (absolute), named in the exit line.
    created_folders: Vec<PathBuf>,
    /// The folders written into, held by descriptor.
    folders: Folders,
    write_warnings: u32,
}

impl SnapshotFiles {
    pub fn new(folder: String, filename: String, overwrite: bool) -> SnapshotFiles {
        SnapshotFiles {
            folder,
            filename,
            overwrite,
            seq: 0,
            written: Vec::new(),
            created_folders: Vec::new(),
            folders: Folders::new(),
            write_warnings: 0,
        }
    }

    /// Numbers the next snapshot; returns its `{seq}`.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// The last snapshot's number.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The files written, in order.
    pub fn written(&self) -> &[PathBuf] {
        &self.written
    }

    /// The folders memsnap created (absolute).
    pub fn created_folders(&self) -> &[PathBuf] {
        &self.created_folders
    }

    /// Writes `bytes` as the snapshot `fields` name; returns its path, or why it could not
    /// be written (the first few failures also a warning on stderr).
    pub fn write(
        &mut self,
        id: &Identity,
        fields: &NameFields,
        bytes: &[u8],
    ) -> Result<PathBuf, String> {
        let name = files::expand(&self.filename, id, fields);
        let result = files::folder(&self.folder, id, fields).and_then(|dir| {
            if dir.created {
                self.created_folders.push(absolute(&dir.path));
            }
            let held = self.folders.open(&dir.path)?;
            files::write_atomic(&held, &name, bytes, self.overwrite)
        });
        match result {
            Ok(path) => {
                self.written.push(path.clone());
                Ok(path)
            }
            Err(e) => {
                self.write_warnings += 1;
                if self.write_warnings <= MAX_WRITE_WARNINGS {
                    eprintln!(
                        "memsnap: could not write the {} snapshot {name} in {}: {e}{}",
                        fields.reason.as_str(),
                        self.folder,
                        if self.write_warnings == MAX_WRITE_WARNINGS {
                            " (further failures are silent)"
                        } else {
                            ""
                        }
                    );
                }
                Err(format!("could not write {name} in {}: {e}", self.folder))
            }
        }
    }
}

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
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let fields = NameFields {
            reason,
            seq: self.files.next_seq(),
            step: self.window.step(),
            tag,
            time_s: now_s,
        };
        snap.allocator_settings = self.allocator_settings();
        snap.memsnap = self.metadata(reason, tag);
        self.hold_if_starved();
        let bytes = pickle_write::to_bytes(&snap);
        let path = self.files.write(&self.id, &fields, &bytes)?;
        if let Some(uploader) = &mut self.uploader {
            let url = files::expand(uploader.remote(), &self.id, &fields);
            uploader.send(&path, &url);
        }
        Ok(path)
    }
}
