//! `memsnap view SNAP -o page.html`: the arguments and the HTML renderer of the engine's
//! page data ([`memsnap_engine::view`]): one self-contained HTML page (no network: inline
//! JS/CSS, data as an inline JSON island) with a live-memory timeline stacked by allocation
//! site, a segment map, the stack under the pointer, search by frame text, and zoom.
//!
//! The page gets per-event (site, delta) arrays and builds a max-envelope pyramid of
//! 256-event buckets on load; views finer than a bucket per pixel replay from checkpoints.
//! That keeps drawing proportional to the canvas width, not to the number of events.
//!
//! The page opens at a moment (`--at`; default the first OOM, else the peak): a marker on
//! the timeline and the live set by site then in the side panel. The page's script formats
//! bytes with a port of [`fmt_bytes`]; the tests below hold the two to the same strings.
//! Cold code.

use crate::args::Attribution;
use crate::shown::shown;
use anyhow::{Context, Result};
use memsnap_engine::at::{self, At};
use memsnap_engine::bytes::fmt_bytes;
use memsnap_engine::sites;
use memsnap_format::model::Snapshot;
use std::io::Write;
use std::path::PathBuf;

const TEMPLATE: &str = include_str!("view.html");

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Snapshot file.
    pub snap: PathBuf,
    /// Output HTML file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Sites drawn separately in the timeline (the rest are "other").
    #[arg(long, default_value_t = 12)]
    pub top: usize,
    /// The moment the page opens at (a marker, and the live set then in the side panel):
    /// peak, oom, end, an event number or a time since the first recorded event (12.5s).
    /// Default: the first OOM when the device has one, else the peak.
    #[arg(long, value_name = "MOMENT", value_parser = at::parse)]
    pub at: Option<At>,
    #[command(flatten)]
    pub attr: Attribution,
}

/// The whole page as a string.
pub fn render(
    snap: &Snapshot,
    title: &str,
    top: usize,
    at: At,
    attr: &sites::Attribution,
) -> Result<String> {
    let page = memsnap_engine::view::page(snap, title, top, at, attr);
    // `<` only occurs inside JSON strings, where \u003c is the same character: this keeps
    // `</script>` and `<!--` in frame names from ending the island.
    let json = serde_json::to_string(&page)?.replace('<', "\\u003c");
    let title_html = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    // Split first, so neither value can be mistaken for the other placeholder.
    let (head, tail) = TEMPLATE
        .split_once("@@VIEW_DATA@@")
        .context("view template lost its data placeholder")?;
    Ok(format!(
        "{}{json}{}",
        head.replace("@@VIEW_TITLE@@", &title_html),
        tail.replace("@@VIEW_TITLE@@", &title_html)
    ))
}

/// A page may hold this many times the file's bytes, plus [`PAGE_FLOOR_BYTES`]. Real
/// files' pages are a fraction of the file; one whose history or block list is shared
/// through the memo would make a page several times its size (415 MB from 83 MB).
const PAGE_PER_FILE_BYTE: u64 = 2;
const PAGE_FLOOR_BYTES: u64 = 64 << 20;

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let (snap, file_bytes) = crate::input::load_counted(&a.snap)?;
    let page_bytes = memsnap_engine::view::page_bytes_estimate(&snap);
    if page_bytes > file_bytes * PAGE_PER_FILE_BYTE + PAGE_FLOOR_BYTES {
        anyhow::bail!(
            "{}: not writing a page of about {} for a file of {}: more than \
             {PAGE_PER_FILE_BYTE} times its size plus {} (its history or segments repeat \
             through shared references); `memsnap summary` and `memsnap check` read it",
            a.snap.display(),
            fmt_bytes(page_bytes as i64),
            fmt_bytes(file_bytes as i64),
            fmt_bytes(PAGE_FLOOR_BYTES as i64)
        );
    }
    if let Some(at) = a.at
        && let Some(why) = memsnap_engine::view::unreached(&snap, at)
    {
        anyhow::bail!("{}: --at: {why}", a.snap.display());
    }
    let html = render(
        &snap,
        &crate::input::display_name(&a.snap),
        a.top,
        a.at.unwrap_or(At::Auto),
        &a.attr.rules(),
    )?;
    std::fs::write(&a.output, &html)
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    // The output path is the command line's, shown as the reports show strings.
    writeln!(
        out,
        "wrote {} ({}, one self-contained page, no network needed)",
        shown(&a.output.display().to_string()),
        fmt_bytes(html.len() as i64)
    )?;
    writeln!(
        out,
        "open it in a web browser: {}",
        shown(&crate::flamegraph::file_url(&a.output))
    )?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::TEMPLATE;
    use memsnap_engine::bytes::fmt_bytes;

    /// The page's `fmt` (its script's byte formatter), cut out of the template.
    fn page_fmt() -> &'static str {
        let start = TEMPLATE
            .find("function fmt(b) {")
            .expect("the page has a fmt function");
        let len = TEMPLATE[start..]
            .find("\n  }\n")
            .expect("fmt ends at its indentation");
        &TEMPLATE[start..start + len + 4]
    }

    #[test]
    fn the_page_formats_bytes_as_the_text_reports_do() {
        // 29,622,272 bytes is 28.25 MiB exactly: the page's old toFixed(1) printed 28.3 MiB
        // where the text printed 28.2 MiB.
        let mut numbers: Vec<i64> = vec![
            0,
            512,
            -512,
            1023,
            1024,
            1536,
            29_569_843,
            29_622_272,
            -29_622_272,
            30_146_560,
            (1 << 20) - 1,
            3 << 30,
            5 << 40,
            7 << 50,
        ];
        let mut n: i64 = 1000;
        while n < 1 << 50 {
            numbers.extend([n, n * 41 / 16, n + 51, -(n * 3 / 2)]);
            n = n * 5 / 3 + 7;
        }
        let list: Vec<String> = numbers.iter().map(i64::to_string).collect();
        let script = format!(
            "{}\nfor (const b of [{}]) console.log(fmt(b));",
            page_fmt(),
            list.join(",")
        );
        // node is required (scripts/test.sh checks for it): a formatter that was not run
        // must not pass.
        let out = std::process::Command::new("node")
            .args(["-e", &script])
            .output()
            .unwrap_or_else(|e| panic!("node is needed to run the page's formatter: {e}"));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let page: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        let text: Vec<String> = numbers.iter().map(|&b| fmt_bytes(b)).collect();
        assert_eq!(page, text);
        assert_eq!(text[7], "28.2 MiB");
    }
}
