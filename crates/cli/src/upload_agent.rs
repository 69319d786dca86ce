//! `memsnap upload-agent`: the helper process that copies published snapshots to
//! `MEMSNAP_REMOTE` for the preload library.
//!
//! Cold. Started by libmemsnap.so's writer with a socket as stdin and stdout; not meant to
//! be run by hand. Reads `LOCAL\tURL` lines, copies each file, answers `ok\tLOCAL` or
//! `failed\tLOCAL\tREASON` per line (`s3://`, `gs://`, `az://` through [`crate::remote`], with its retries
//! and backoff), and exits when its input ends (the host has exited
//! or died), after finishing the lines it already read. A local file is removed only
//! with `--remove-local` and only after its copy is complete and renamed into place.
//! SIGTERM, SIGINT or SIGHUP end it at once, with one line naming the files it was handed
//! and did not upload (their local copies stay).

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
}

/// The local files handed over and not uploaded yet, oldest first.
type NotUploaded = Arc<Mutex<Vec<String>>>;

pub fn run(args: &Args) -> Result<ExitCode> {
    let not_uploaded: NotUploaded = Arc::default();
    stop_on_signals(not_uploaded.clone())?;
    // Lines are read as they arrive, on a thread of their own, so that a signal while a
    // copy is under way names every file handed over, not only the one being copied.
    let (lines, requests) = std::sync::mpsc::channel::<String>();
    {
        let not_uploaded = not_uploaded.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if let Some((local, _)) = line.split_once('\t')
                    && let Ok(mut list) = not_uploaded.lock()
                {
                    list.push(local.to_string());
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
        if let Ok(mut list) = not_uploaded.lock()
            && let Some(at) = list.iter().position(|l| l == local)
        {
            list.remove(at);
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

/// On SIGTERM, SIGINT or SIGHUP: one line naming what was not uploaded, then the exit
/// status of a process the signal ended (128 + N).
fn stop_on_signals(not_uploaded: NotUploaded) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing the upload helper's signal handlers")?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            let left = not_uploaded.lock().map(|l| l.clone()).unwrap_or_default();
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
