//! Strings from a snapshot file shown on a terminal. A frame name, file name or metadata
//! value is whatever the file says: an escape sequence in one would clear the screen or
//! write the clipboard (OSC 52), a carriage return or newline would forge a report line.
//! Every human-readable output shows such strings through [`escape_controls`]; JSON has
//! its own escaping.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` is a control character a terminal may act on: C0 (U+0000..U+001F, newline
/// and tab included), DEL and C1 (U+0080..U+009F, where a terminal reading 8-bit controls
/// finds CSI and OSC).
pub fn is_terminal_control(c: char) -> bool {
    c.is_control()
}

/// `s` with every [`is_terminal_control`] character written out: `\n`, `\r`, `\t`,
/// `\x1b` for the others below U+0080 (DEL: `\x7f`), `\u{9b}` for C1. Borrowed when there
/// is none, so the common case costs a scan.
pub fn escape_controls(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_terminal_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_terminal_control(c) && (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if is_terminal_control(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::escape_controls;

    #[test]
    fn controls_are_written_out_and_the_rest_is_kept() {
        assert_eq!(escape_controls("fwd (model.py:3)"), "fwd (model.py:3)");
        assert!(matches!(
            escape_controls("fwd"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            escape_controls("a\x1b[2Jb\x1b]52;c;aGk=\x07c\r\nd\te\x7f\u{9b}31m\u{85}é→"),
            "a\\x1b[2Jb\\x1b]52;c;aGk=\\x07c\\r\\nd\\te\\x7f\\u{9b}31m\\u{85}é→"
        );
        assert_eq!(escape_controls("\0"), "\\x00");
    }
}
