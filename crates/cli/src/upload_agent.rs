//! `memsnap upload-agent`: the helper process that copies published snapshots to
//! `MEMSNAP_REMOTE` for the preload library.
//!
//! Cold. Started by libmemsnap.so's writer with a socket as stdin and stdout; not meant to
//! be run by hand. Reads `LOCAL\tURL` lines, copies each file, answers `ok\tLOCAL` or
//! `failed\tLOCAL\tREASON` per line (`s3://`, `gs://`, `az://` through [`crate::remote`], with its retries
//! and backoff), and exits when its input ends (the host has exited
//! or died), after finishing the lines it already read. A local file is removed only
//! with `--remove-local` and only after its copy is complete and renamed into place.
//! SIGTERM, SIGINT or SIGHUP end it at once (their local copies stay).
//!
//! Its stderr is /dev/null (the library gives it none of the program's descriptors), so
//! what it could not send goes into the file `--unsent` names, beside the snapshots: one
//! line per file, `LOCAL<TAB>URL<TAB>REASON`, rewritten on each failure, and on a stop by
//! a signal with every file handed over and not sent yet.

use anyhow::{Context, Result, bail};
use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Remove each local file once its copy is confirmed (MEMSNAP_REMOTE_ONLY=1).
    #[arg(long)]
    remove_local: bool,
    /// Where to list the files not uploaded, with the reason
    #[arg(long, value_name = "FILE")]
    unsent: Option<PathBuf>,
}

/// What was handed over and not uploaded.
#[derive(Default)]
struct Ledger {
    /// Handed over and not finished yet (`LOCAL`, `URL`), oldest first.
    handed: Vec<(String, String)>,
    /// Given up on: `LOCAL`, `URL`, the reason.
    failed: Vec<(String, String, String)>,
    /// The list's path (`--unsent`).
    unsent: Option<PathBuf>,
}

impl Ledger {
    /// Rewrites the list with the failures, and `stopped` as the reason of each file
    /// still handed over (when a signal stops the helper). No list while nothing failed.
    fn write(&self, stopped: Option<&str>) {
        let Some(path) = &self.unsent else { return };
        let mut text = String::new();
        for (local, url, reason) in &self.failed {
            text += &format!("{local}\t{url}\t{reason}\n");
        }
        if let Some(reason) = stopped {
            for (local, url) in &self.handed {
                text += &format!("{local}\t{url}\t{reason}\n");
            }
        }
        if text.is_empty() {
            return;
        }
        // Never through a link put in its place.
        let written = if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
            Err(std::io::Error::other("a symbolic link is in its place"))
        } else {
            fs::write(path, text.as_bytes())
        };
        if let Err(e) = written {
            eprintln!("memsnap upload-agent: cannot write {}: {e}", path.display());
        }
    }
}

type Shared = Arc<Mutex<Ledger>>;

pub fn run(args: &Args) -> Result<ExitCode> {
    let ledger: Shared = Arc::new(Mutex::new(Ledger {
        unsent: args.unsent.clone(),
        ..Ledger::default()
    }));
    stop_on_signals(ledger.clone())?;
    // Lines are read as they arrive, on a thread of their own, so that a signal while a
    // copy is under way names every file handed over, not only the one being copied.
    let (lines, requests) = std::sync::mpsc::channel::<String>();
    {
        let ledger = ledger.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if let Some((local, url)) = line.split_once('\t')
                    && let Ok(mut ledger) = ledger.lock()
                {
                    ledger.handed.push((local.to_string(), url.to_string()));
                }
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let mut stores = crate::remote::Stores::default();
    let mut out = std::io::stdout().lock();
    for line in requests {
        let Some((local, url)) = line.split_once('\t') else {
            continue;
        };
        let result = if url.starts_with("file://") {
            copy(Path::new(local), url)
        } else {
            stores.upload(Path::new(local), url)
        };
        let answer = match result {
            Ok(()) => {
                if args.remove_local {
                    // The copy is in place: losing the local file now loses nothing.
                    let _ = fs::remove_file(local);
                }
                format!("ok\t{local}\n")
            }
            Err(e) => format!("failed\t{local}\t{}\n", one_line(&format!("{e:#}"))),
        };
        if let Ok(mut ledger) = ledger.lock() {
            if let Some(at) = ledger.handed.iter().position(|(l, _)| l == local) {
                ledger.handed.remove(at);
            }
            if let Some(reason) = answer.strip_prefix(&format!("failed\t{local}\t")) {
                let reason = reason.trim_end().to_string();
                ledger
                    .failed
                    .push((local.to_string(), url.to_string(), reason));
                // Listed before the library hears of it: the file its exit line names
                // already holds every failure it counts.
                ledger.write(None);
            }
        }
        if out
            .write_all(answer.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            // The host is gone; copies still go on until the input ends.
            continue;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// On SIGTERM, SIGINT or SIGHUP: the list of what was not uploaded (the failures and every
/// file handed over and not sent yet) and one line saying so, then the exit status of a
/// process the signal ended (128 + N).
fn stop_on_signals(ledger: Shared) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing the upload helper's signal handlers")?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            let left: Vec<String> = match ledger.lock() {
                Ok(ledger) => {
                    ledger.write(Some(&format!(
                        "not sent: the upload helper was stopped by signal {signal}"
                    )));
                    let failed = ledger.failed.iter().map(|(l, _, _)| l.clone());
                    failed
                        .chain(ledger.handed.iter().map(|(l, _)| l.clone()))
                        .collect()
                }
                Err(_) => Vec::new(),
            };
            if left.is_empty() {
                eprintln!(
                    "memsnap upload-agent: stopped by signal {signal}; nothing was left to upload"
                );
            } else {
                eprintln!(
                    "memsnap upload-agent: stopped by signal {signal}; not uploaded to MEMSNAP_REMOTE ({} file{}, the local copies stay): {}",
                    left.len(),
                    if left.len() == 1 { "" } else { "s" },
                    left.join(", ")
                );
            }
            std::process::exit(128 + signal);
        }
    });
    Ok(())
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\t'], " ")
}

/// Copies `local` to `url`: written to a hidden temporary beside the destination, synced,
/// then renamed, so a reader never sees a partial file. A failure names the side that
/// failed: the local source when it cannot be read, else the destination.
fn copy(local: &Path, url: &str) -> Result<()> {
    let Some(dest) = url.strip_prefix("file://") else {
        bail!("unsupported URL {url} (only file:// is built in)");
    };
    let dest = PathBuf::from(dest);
    let (Some(dir), Some(name)) = (dest.parent(), dest.file_name()) else {
        bail!("{url} does not name a file");
    };
    let mut source =
        fs::File::open(local).with_context(|| format!("reading {}", local.display()))?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.upload.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        let mut target = fs::File::create(&tmp)
            .with_context(|| format!("writing {} (as {})", dest.display(), tmp.display()))?;
        std::io::copy(&mut source, &mut target)
            .with_context(|| format!("writing {}", dest.display()))?;
        target
            .sync_all()
            .with_context(|| format!("syncing {}", dest.display()))?;
        fs::rename(&tmp, &dest).with_context(|| format!("renaming into {}", dest.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_holds_every_failure_and_on_a_stop_every_file_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memsnap-unsent-h-1.txt");
        let mut ledger = Ledger {
            unsent: Some(path.clone()),
            ..Ledger::default()
        };
        ledger.write(None);
        assert!(!path.exists(), "no list while nothing failed");
        for i in 0..22 {
            let (local, url) = (format!("/s/{i}.pickle"), format!("gs://b/{i}.pickle"));
            if i < 20 {
                ledger.failed.push((local, url, "timed out".into()));
            } else {
                ledger.handed.push((local, url));
            }
        }
        ledger.write(None);
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 20);
        ledger.write(Some("stopped by signal 15"));
        let listed = fs::read_to_string(&path).unwrap();
        assert_eq!(listed.lines().count(), 22, "{listed}");
        assert!(listed.contains("/s/0.pickle\tgs://b/0.pickle\ttimed out\n"));
        assert!(listed.ends_with("/s/21.pickle\tgs://b/21.pickle\tstopped by signal 15\n"));
    }
}
