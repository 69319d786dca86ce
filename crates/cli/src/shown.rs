//! Strings from snapshot files, and paths from the command line, in the text reports
//! (`summary`, `diff`, `ranks`, `explain`, `check`, and what `view` and `flamegraph` say
//! they wrote): a frame name, file name or metadata value is whatever the file says, so
//! each is printed through [`shown`], and each of the four reports as a whole through
//! [`write_escaped`]. Error messages go through [`shown`] (the reading commands': one line
//! each, naming files and quoting them) or [`shown_lines`] (the launchers', which have
//! lines of their own). JSON output has serde's escaping instead. Cold code.

pub use memsnap_format::text::escape_controls as shown;
use std::io::Write;

/// `text` with every control character other than its line ends written out
/// ([`shown`]): for messages and reports whose own lines are kept.
pub fn shown_lines(text: &str) -> String {
    text.split('\n').map(shown).collect::<Vec<_>>().join("\n")
}

/// Renders a report into memory, then writes it to `out` through [`shown_lines`]: a string
/// that reached the report without [`shown`] still cannot move the cursor, clear the
/// screen or write the clipboard. Reports are a few screens long, so holding one costs
/// little.
pub fn write_escaped(
    out: &mut dyn Write,
    render: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut text = Vec::new();
    render(&mut text)?;
    out.write_all(shown_lines(&String::from_utf8_lossy(&text)).as_bytes())
}
