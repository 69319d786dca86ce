//! Byte counts as people read them: [`fmt_bytes`] (the one formatter of every report: the
//! text commands, `memsnap top`, and the HTML page, whose script carries a line-for-line
//! port of it that the CLI's tests hold to the same strings) and [`parse_bytes`] (sizes
//! on the command line). Cold code.

/// `1.5 GiB`, `512 B`: binary units, one decimal, rounded to the nearest tenth with exact
/// ties to the even tenth (28.25 MiB, an exact tie, is `28.2 MiB`; 28.75 MiB is `28.8 MiB`).
///
/// Computed on integers: the tenths are `|b| * 10 / 1024^k`, an exact fraction, so the
/// result does not depend on how a language prints floats (the HTML page computes the
/// same tenths the same way).
pub fn fmt_bytes(b: i64) -> String {
    const U: &[&str] = &["KiB", "MiB", "GiB", "TiB", "PiB"];
    let a = b.unsigned_abs();
    if a < 1024 {
        return format!("{b} B");
    }
    let sign = if b < 0 { "-" } else { "" };
    // The unit: the largest whose value is at least 1 (values of 1024 and more stay in
    // PiB), chosen before rounding, as the page does.
    let mut shift = 10u32;
    let mut u = 0;
    while u < U.len() - 1 && a >> shift >= 1024 {
        shift += 10;
        u += 1;
    }
    let scaled = u128::from(a) * 10;
    let whole = scaled >> shift;
    let rest = scaled - (whole << shift);
    let half = 1u128 << (shift - 1);
    let tenths = if rest > half || (rest == half && whole % 2 == 1) {
        whole + 1
    } else {
        whole
    };
    format!("{sign}{}.{} {}", tenths / 10, tenths % 10, U[u])
}

/// Parses a size: `1000`, `64MB` (10^6 bytes each), `64MiB` (2^20), `1.5GB`, `2GiB`,
/// `512kB`, `1TiB`. A bare `64M` is refused as ambiguous.
pub fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 1000, 64MB, 64MiB, 2GiB)"))?;
    let unit = unit.trim();
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "k" | "m" | "g" | "t" => {
            return Err(format!(
                "{s:?} is ambiguous: write {num}{u}B ({}) or {num}{u}iB ({})",
                match unit.to_ascii_lowercase().as_str() {
                    "k" => "10^3 bytes",
                    "m" => "10^6 bytes",
                    "g" => "10^9 bytes",
                    _ => "10^12 bytes",
                },
                match unit.to_ascii_lowercase().as_str() {
                    "k" => "2^10 bytes",
                    "m" => "2^20 bytes",
                    "g" => "2^30 bytes",
                    _ => "2^40 bytes",
                },
                u = unit.to_ascii_uppercase(),
            ));
        }
        _ => {
            return Err(format!(
                "{s:?}: unknown unit (use B, kB, MB, GB, TB for powers of 1000, or KiB, MiB, GiB, TiB for powers of 1024)"
            ));
        }
    };
    let bytes = v * mult;
    if !bytes.is_finite() || bytes > i64::MAX as f64 {
        return Err(format!("{s:?}: too large"));
    }
    Ok(bytes.round() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_format_and_parse() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 20), "3.0 MiB");
        assert_eq!(fmt_bytes(-(3 << 30)), "-3.0 GiB");
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        // MB is 10^6 bytes, MiB 2^20: what the units say.
        assert_eq!(parse_bytes("64MB"), Ok(64_000_000));
        assert_eq!(parse_bytes("64mb"), Ok(64_000_000));
        assert_eq!(parse_bytes("512kB"), Ok(512_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("2TiB"), Ok(2 << 40));
        let err = parse_bytes("1.5G").unwrap_err();
        assert!(
            err.contains("ambiguous") && err.contains("1.5GB") && err.contains("1.5GiB"),
            "{err}"
        );
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    /// The float formatting this replaced (`{:.1}` of `|b| / 1024^k`), for comparison.
    fn by_float(b: i64) -> String {
        let sign = if b < 0 { "-" } else { "" };
        let mut v = b.unsigned_abs() as f64;
        if v < 1024.0 {
            return format!("{b} B");
        }
        let units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut u = 0;
        v /= 1024.0;
        while v >= 1024.0 && u < units.len() - 1 {
            v /= 1024.0;
            u += 1;
        }
        format!("{sign}{v:.1} {}", units[u])
    }

    #[test]
    fn ties_round_to_the_even_tenth_as_the_text_reports_always_did() {
        // 28.25 MiB exactly: the text reports printed 28.2 MiB, the page's script 28.3.
        assert_eq!(fmt_bytes(29_622_272), "28.2 MiB");
        assert_eq!(fmt_bytes(-29_622_272), "-28.2 MiB");
        // 28.35 MiB is not a tie in binary (just above): up.
        assert_eq!(fmt_bytes(29_727_130), "28.4 MiB");
        assert_eq!(fmt_bytes(29_569_843), "28.2 MiB");
        assert_eq!(fmt_bytes(30_146_560), "28.8 MiB");
        assert_eq!(fmt_bytes(1536), "1.5 KiB");
        assert_eq!(fmt_bytes(1024 * 1024 - 1), "1024.0 KiB");
        assert_eq!(fmt_bytes(i64::MIN), "-8192.0 PiB");
        // The integer rounding is the float formatting's, over units and ties.
        let mut n: i64 = 1;
        while n < 1 << 53 {
            for b in [n, n + 51, n * 3 / 2, n * 41 / 16, n * 5 / 64 + 1023, -n] {
                assert_eq!(fmt_bytes(b), by_float(b), "{b}");
            }
            n = n * 5 / 3 + 7;
        }
    }
}
