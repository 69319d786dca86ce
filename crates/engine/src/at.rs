//! `--at`: the moment of a snapshot a command answers for (the peak, the OOM, the end, an
//! event number or a time into the history), parsed from the command line, and how a
//! resolved moment is described in text and JSON. Cold code.

use serde::Serialize;

/// The moment asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The first OOM when the device has one, else the peak (summary's and flamegraph's
    /// default, the question a person brings: what held the memory when it ran out, or
    /// when it was highest).
    Auto,
    /// The most live bytes within the recorded history (ties: the latest).
    Peak,
    /// The first OOM event.
    Oom,
    /// The snapshot itself: the state after the last event.
    End,
    /// The state after this event (0-based, as the reports number events).
    Event(usize),
    /// The state after the last event at most this many microseconds after the first one.
    Time(i64),
}

/// The values `--at` accepts, for `--help` and error messages.
pub const HELP: &str = "peak, oom, end, an event number (1234) or a time since the first \
recorded event (250ms, 12.5s, 3m, 1h)";

/// Parses an `--at` value: `peak`, `oom`, `end`, `1234` (event), `12.5s` (time).
pub fn parse(s: &str) -> Result<At, String> {
    let t = s.trim();
    match t.to_ascii_lowercase().as_str() {
        "peak" => return Ok(At::Peak),
        "oom" => return Ok(At::Oom),
        "end" => return Ok(At::End),
        _ => {}
    }
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse()
            .map(At::Event)
            .map_err(|_| format!("{s:?}: event number too large"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let micros_per_unit = match unit.trim() {
        "us" | "µs" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" | "min" => 60e6,
        "h" => 3600e6,
        _ => return Err(format!("{s:?} is not a moment: use {HELP}")),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a moment: use {HELP}"))?;
    let us = v * micros_per_unit;
    if !us.is_finite() || us > i64::MAX as f64 {
        return Err(format!("{s:?}: time too large"));
    }
    Ok(At::Time(us.round() as i64))
}

/// What a resolved moment turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Peak,
    Oom,
    Event,
    Time,
    End,
}

/// Where a resolved moment stands in a device's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pos {
    /// Before the first recorded event (the state the history starts from).
    BeforeFirst,
    /// After this event.
    After(usize),
    /// After the last event: the snapshot's own blocks.
    End,
}

/// A moment resolved on one device.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub kind: Kind,
    pub pos: Pos,
    /// The time of the event the moment is after, and how long after the first event.
    pub time_us: Option<i64>,
    pub since_first_us: Option<i64>,
    /// Why the moment asked for could not be reached on this device (the end is used).
    pub unreached: Option<String>,
}

impl Resolved {
    pub fn end() -> Self {
        Resolved {
            kind: Kind::End,
            pos: Pos::End,
            time_us: None,
            since_first_us: None,
            unreached: None,
        }
    }

    /// `the peak (after event 8, +1.234 s)`, `the OOM (event 8, +0.500 s)`, `event 3,
    /// +0.001 s` (the state after it), `+12.500 s (after event 1234)`, `the end (...)`.
    pub fn describe(&self) -> String {
        let when = |what: String| match self.since_first_us {
            Some(us) => format!("{what}, {}", fmt_since(us)),
            None => what,
        };
        let after = match self.pos {
            Pos::BeforeFirst => "before the first event".to_string(),
            Pos::After(i) => format!("after event {i}"),
            Pos::End => "after the last event".to_string(),
        };
        match (self.kind, self.pos) {
            (Kind::End, _) => "the end (the snapshot's own blocks)".to_string(),
            (Kind::Peak, _) => format!("the peak ({})", when(after)),
            (Kind::Oom, Pos::After(i)) => format!("the OOM ({})", when(format!("event {i}"))),
            (Kind::Oom, _) => format!("the OOM ({after})"),
            (Kind::Event, Pos::After(i)) => when(format!("event {i}")),
            (Kind::Event, _) => when(after),
            (Kind::Time, _) => match self.since_first_us {
                Some(us) => format!("{} ({after})", fmt_since(us)),
                None => after,
            },
        }
    }

    /// A short column heading: `peak`, `OOM`, `event 12`, `+1.500 s`, `end`.
    pub fn column(&self) -> String {
        match (self.kind, self.pos) {
            (Kind::Peak, _) => "at peak".into(),
            (Kind::Oom, _) => "at OOM".into(),
            (Kind::End, _) => "at end".into(),
            (Kind::Event, Pos::After(i)) => format!("event {i}"),
            (Kind::Time, _) => self
                .since_first_us
                .map_or_else(|| "at time".into(), fmt_since),
            _ => "then".into(),
        }
    }
}

/// `at the peak (after event 8, +1.234 s)`, or each device's when there are several;
/// `at the end (...)` when no device was followed.
pub fn describe_devices(moments: &[(i64, Resolved)]) -> String {
    match moments {
        [] => format!("at {}", Resolved::end().describe()),
        [(_, m)] => format!("at {}", m.describe()),
        many => many
            .iter()
            .map(|(d, m)| format!("device {d} at {}", m.describe()))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// `+1.234 s` after the first event.
pub fn fmt_since(us: i64) -> String {
    format!("+{:.3} s", us as f64 / 1e6)
}

/// The `at` object of the JSON reports.
#[derive(Serialize, Clone, Debug)]
pub struct AtJson {
    /// "peak", "oom", "event", "time" or "end".
    pub moment: Kind,
    /// The event the state is taken after; null before the first event and at the end.
    pub after_event: Option<usize>,
    pub before_first_event: bool,
    pub time_us: Option<i64>,
    pub since_first_event_us: Option<i64>,
    /// Why the moment asked for is not in this device's history (the end is shown instead).
    pub unreached: Option<String>,
}

impl From<&Resolved> for AtJson {
    fn from(r: &Resolved) -> Self {
        AtJson {
            moment: r.kind,
            after_event: match r.pos {
                Pos::After(i) => Some(i),
                _ => None,
            },
            before_first_event: r.pos == Pos::BeforeFirst,
            time_us: r.time_us,
            since_first_event_us: r.since_first_us,
            unreached: r.unreached.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_parse() {
        assert_eq!(parse("peak"), Ok(At::Peak));
        assert_eq!(parse("OOM"), Ok(At::Oom));
        assert_eq!(parse("end"), Ok(At::End));
        assert_eq!(parse("1234"), Ok(At::Event(1234)));
        assert_eq!(parse("12.5s"), Ok(At::Time(12_500_000)));
        assert_eq!(parse("250ms"), Ok(At::Time(250_000)));
        assert_eq!(parse("3m"), Ok(At::Time(180_000_000)));
        assert_eq!(parse("7us"), Ok(At::Time(7)));
        assert!(parse("soon").unwrap_err().contains("peak, oom, end"));
        assert!(parse("-3s").is_err());
        assert!(parse("").is_err());
    }

    #[test]
    fn moments_describe_themselves() {
        let r = Resolved {
            kind: Kind::Peak,
            pos: Pos::After(8),
            time_us: Some(1_001_234_000),
            since_first_us: Some(1_234_000),
            unreached: None,
        };
        assert_eq!(r.describe(), "the peak (after event 8, +1.234 s)");
        assert_eq!(r.column(), "at peak");
        let r = Resolved {
            kind: Kind::Oom,
            ..r
        };
        assert_eq!(r.describe(), "the OOM (event 8, +1.234 s)");
        let r = Resolved {
            kind: Kind::Peak,
            pos: Pos::BeforeFirst,
            time_us: None,
            since_first_us: None,
            unreached: None,
        };
        assert_eq!(r.describe(), "the peak (before the first event)");
        assert_eq!(
            Resolved::end().describe(),
            "the end (the snapshot's own blocks)"
        );
    }
}
