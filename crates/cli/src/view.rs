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
//! the timeline and the live set by site then in the side panel. Cold code.

use crate::args::Attribution;
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

pub fn run(a: &Args, out: &mut dyn Write) -> Result<i32> {
    let snap = crate::input::load(&a.snap)?;
    let html = render(
        &snap,
        &crate::input::display_name(&a.snap),
        a.top,
        a.at.unwrap_or(At::Auto),
        &a.attr.rules(),
    )?;
    std::fs::write(&a.output, &html)
        .with_context(|| format!("cannot write {}", a.output.display()))?;
    writeln!(
        out,
        "wrote {} ({}, one self-contained page, no network needed)",
        a.output.display(),
        fmt_bytes(html.len() as i64)
    )?;
    writeln!(
        out,
        "open it in a web browser: {}",
        crate::flamegraph::file_url(&a.output)
    )?;
    Ok(0)
}
