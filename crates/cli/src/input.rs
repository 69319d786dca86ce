//! Opening snapshot files for the commands: local paths, `file://` URLs and object-store
//! URLs ([`crate::remote`]), with progress bars on large files; the engine
//! ([`memsnap_engine::input`]) decodes the bytes. Also: several files at once, the files of
//! a ranks folder, display names. The readers (summary, diff, ranks, view, flamegraph,
//! check) write to a `Write`, so a closed pipe is an error the dispatcher turns into exit 0
//! instead of a panic; the launchers (run, dump) manage their own output. Cold code, no
//! unsafe.

use anyhow::{Context, Result};
use memsnap_engine::at::At;
use memsnap_engine::input as engine;
pub use memsnap_engine::input::{FinalState, Summarized};
use memsnap_engine::sites::StackBytes;
use memsnap_format::model::Snapshot;
use memsnap_format::pickle_read;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// Reads and decodes one snapshot, history included (for `view`, `check`); errors name
/// the file and the problem.
///
/// The file is streamed through the decoder rather than read whole or memory-mapped: a
/// file truncated by a writer during the read stays a clear error (a map would turn it
/// into SIGBUS, and mapping needs `unsafe` in code that otherwise forbids it).
pub fn load(path: &Path) -> Result<Snapshot> {
    decode(path, engine::read_whole)
}

/// [`load`], and how many bytes of the file were read (what `view` bounds its page by).
pub fn load_counted(path: &Path) -> Result<(Snapshot, u64)> {
    decode(path, |file, progress| {
        let mut read = 0;
        let snap = engine::read_whole(file, &mut |done| {
            read = done;
            progress(done)
        })?;
        Ok((snap, read as u64))
    })
}

/// Reads and decodes one snapshot whole, with what the model does not keep of the file
/// (its encoding and malformed frames), for `check`.
pub fn load_for_check(path: &Path) -> Result<(Snapshot, pickle_read::Encoding)> {
    decode(path, pickle_read::read_snapshot_encoding_from)
}

/// Reads a snapshot for `summary`, `ranks`, and the commands asked for a moment (`--at`),
/// folding each device's entries into its history as they are decoded
/// ([`engine::read_summarized`]).
pub fn load_summarized(path: &Path, at: At) -> Result<Summarized> {
    match decode(path, |file, progress| {
        engine::read_summarized(file, progress, at)
    })? {
        Some(s) => Ok(s),
        // A file that refers back to an entry (no known writer): read it whole.
        None => Ok(Summarized::of_whole(load(path)?, at)),
    }
}

/// Reads a snapshot for `explain`: histories following `at` and the log of live-byte
/// changes beside them, in one pass ([`memsnap_engine::explain::read`]).
pub fn load_explained(path: &Path, at: At) -> Result<memsnap_engine::explain::Read> {
    use memsnap_engine::explain;
    match decode(path, |file, progress| explain::read(file, progress, at))? {
        Some(r) => Ok(r),
        None => Ok(explain::Read::of_whole(load(path)?, at)),
    }
}

/// Reads a snapshot for commands that only need its final state (`diff`, `flamegraph`).
pub fn load_final_state(path: &Path) -> Result<FinalState> {
    match decode(path, engine::read_final_state)? {
        Some(s) => Ok(s),
        None => {
            let snap = load(path)?;
            Ok(FinalState {
                bytes: StackBytes::of_whole(&snap),
                snap,
            })
        }
    }
}

/// Files at least this large get a progress bar (when stderr is a terminal).
const PROGRESS_MIN_BYTES: usize = 64 << 20;

/// At most this many files are read at once: each reader holds its own model (about a
/// tenth of its file's size when streaming), and reading is one core per file.
const MAX_PARALLEL_READS: usize = 8;

/// `f` over every item, several at once (one thread per core, up to
/// [`MAX_PARALLEL_READS`]), results in the items' order. The pickle format is read front to
/// back, so a file is one core's work; `diff` and `ranks` read several files.
pub fn map_files<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_PARALLEL_READS)
        .min(items.len());
    if workers <= 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break mine };
                        mine.push((i, f(item)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| match w.join() {
                Ok(v) => v,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// Progress bars of files read at the same time, drawn together.
fn bars() -> &'static indicatif::MultiProgress {
    static BARS: std::sync::OnceLock<indicatif::MultiProgress> = std::sync::OnceLock::new();
    BARS.get_or_init(indicatif::MultiProgress::new)
}

/// Opens `path` and runs `read` on it with a progress bar on large files.
fn decode<T>(
    path: &Path,
    read: impl FnOnce(
        &mut dyn std::io::Read,
        &mut dyn FnMut(usize),
    ) -> std::result::Result<T, pickle_read::ReadError>,
) -> Result<T> {
    let (mut file, len): (Box<dyn std::io::Read + Send>, u64) = if crate::remote::is_remote(path) {
        crate::remote::Stores::default().open(&path.to_string_lossy())?
    } else {
        let file = std::fs::File::open(local_path(path))
            .with_context(|| format!("cannot read {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        (Box::new(file), len)
    };
    let len = len as usize;
    let bar = (len >= PROGRESS_MIN_BYTES && std::io::stderr().is_terminal()).then(|| {
        let b = bars().add(indicatif::ProgressBar::new(len as u64));
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(format!("reading {}", path.display()));
        b
    });
    let out = read(&mut *file, &mut |done| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    out.with_context(|| format!("{} is not a readable memory snapshot", path.display()))
}

/// The snapshot files of `memsnap ranks DIR`: `*.pickle` and `*.pkl` directly in a folder
/// (or a `file://` URL of one), or under an `s3://`, `gs://` or `az://` bucket prefix; sorted.
pub fn rank_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if crate::remote::is_remote(dir) {
        let urls = crate::remote::Stores::default().list(&dir.to_string_lossy())?;
        return Ok(urls.into_iter().map(PathBuf::from).collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(local_path(dir))
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "pickle" || e == "pkl"))
        .collect();
    files.sort();
    Ok(files)
}

/// The snapshot files of `memsnap explain PATH...`: a file or URL as given; a folder's
/// `*.pickle` and `*.pkl` files, in it and in its subfolders (a run's rank folders), at
/// most [`FOLDER_DEPTH`] levels down; an object-store prefix's objects ([`rank_files`]).
/// Sorted, each once.
pub fn run_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if crate::remote::is_remote(p) {
            let url = p.to_string_lossy();
            if url.ends_with(".pickle") || url.ends_with(".pkl") {
                files.push(p.clone());
            } else {
                let listed = rank_files(p)?;
                if listed.is_empty() {
                    anyhow::bail!("{url}: no *.pickle or *.pkl objects under this prefix");
                }
                files.extend(listed);
            }
            continue;
        }
        let local = local_path(p);
        if !local.is_dir() {
            files.push(p.clone());
            continue;
        }
        let before = files.len();
        walk(&local, 0, &mut files).with_context(|| format!("cannot list {}", p.display()))?;
        if files.len() == before {
            anyhow::bail!("{}: no *.pickle or *.pkl files", p.display());
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// Subfolder levels `explain` looks into.
pub const FOLDER_DEPTH: usize = 3;

fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        if path.is_dir() {
            if depth < FOLDER_DEPTH {
                walk(&path, depth + 1, out)?;
            }
        } else if path.is_file()
            && path
                .extension()
                .is_some_and(|e| e == "pickle" || e == "pkl")
        {
            out.push(path);
        }
    }
    Ok(())
}

/// The file a `file://` URL names (what `MEMSNAP_REMOTE` writes), or `path` itself. Other
/// URLs are read by [`crate::remote`].
pub fn local_path(path: &Path) -> PathBuf {
    match path.to_str().and_then(|s| s.strip_prefix("file://")) {
        Some(rest) => PathBuf::from(rest),
        None => path.to_path_buf(),
    }
}

/// The file name for messages and tables (the full path is in JSON).
pub fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn map_files_keeps_the_order_of_items_whatever_finishes_first() {
        let items: Vec<u64> = (0..40).collect();
        // Early items take longest, so workers finish out of order.
        let out = super::map_files(&items, |&i| {
            std::thread::sleep(std::time::Duration::from_millis(40 - i));
            i * 10
        });
        assert_eq!(out, items.iter().map(|i| i * 10).collect::<Vec<_>>());
        assert!(super::map_files(&[] as &[u64], |&i| i).is_empty());
    }

    #[test]
    fn file_urls_name_local_files() {
        use std::path::Path;
        assert_eq!(
            super::local_path(Path::new("file:///snaps/r0/exit-1.pickle")),
            Path::new("/snaps/r0/exit-1.pickle")
        );
        assert_eq!(
            super::local_path(Path::new("a/b.pickle")),
            Path::new("a/b.pickle")
        );
    }
}
