//! `memsnap upload-agent`: the helper process that copies published snapshots to
//! `MEMSNAP_REMOTE` for the preload library.
//!
//! Cold. Started by libmemsnap.so's writer with a socket as stdin and stdout; not meant to
//! be run by hand. Reads `LOCAL\tURL` lines, copies each file, answers `ok\tLOCAL` or
//! `failed\tLOCAL\tREASON` per line (`s3://`, `gs://`, `az://` through [`crate::remote`], with its retries
//! and backoff), and exits when its input ends (the host has exited
//! or died), after finishing the lines it already read. A local file is removed only
//! with `--remove-local` and only after its copy is complete and renamed into place.

use anyhow::{Context, Result, bail};
use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Remove each local file once its copy is confirmed (MEMSNAP_REMOTE_ONLY=1).
    #[arg(long)]
    remove_local: bool,
}

pub fn run(args: &Args) -> Result<ExitCode> {
    let mut stores = crate::remote::Stores::default();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line.context("reading the upload requests")?;
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

fn one_line(s: &str) -> String {
    s.replace(['\n', '\t'], " ")
}

/// Copies `local` to `url`: written to a hidden temporary beside the destination, synced,
/// then renamed, so a reader never sees a partial file.
fn copy(local: &Path, url: &str) -> Result<()> {
    let Some(dest) = url.strip_prefix("file://") else {
        bail!("unsupported URL {url} (only file:// is built in)");
    };
    let dest = PathBuf::from(dest);
    let (Some(dir), Some(name)) = (dest.parent(), dest.file_name()) else {
        bail!("{url} does not name a file");
    };
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.upload.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        fs::copy(local, &tmp).with_context(|| format!("copying {}", local.display()))?;
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", tmp.display()))?;
        fs::rename(&tmp, &dest).with_context(|| format!("renaming into {}", dest.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}
