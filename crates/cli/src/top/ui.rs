//! The full-screen view of `memsnap top` (ratatui on crossterm): devices with a sparkline
//! of live bytes, the site table, OOM events, and the keys.
//!
//! Cold. [`draw`] renders from `model` alone (tests render it into ratatui's
//! `TestBackend`); [`run`] owns the terminal and the key loop.

use super::model::{Baseline, SortBy, Watched, signed_bytes, site_rows};
use anyhow::Result;
use memsnap_engine::bytes::fmt_bytes;
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Event lines kept (OOMs, processes gone, snapshots written).
const EVENT_LINES: usize = 4;

/// What the user chose with the keys, and the messages shown.
pub struct View {
    pub sort: SortBy,
    pub baseline: Baseline,
    pub frozen: bool,
    pub events: VecDeque<String>,
}

impl Default for View {
    fn default() -> View {
        View {
            sort: SortBy::Live,
            baseline: Baseline::Start,
            frozen: false,
            events: VecDeque::new(),
        }
    }
}

impl View {
    pub fn event(&mut self, line: String) {
        self.events.push_back(line);
        while self.events.len() > EVENT_LINES {
            self.events.pop_front();
        }
    }
}

pub fn draw(frame: &mut Frame, watched: &[Watched], view: &View) {
    let devices: Vec<_> = watched
        .iter()
        .filter(|w| w.gone.is_none())
        .flat_map(|w| w.devices().into_iter().map(move |d| (w, d)))
        .collect();
    let events = view.events.len() as u16;
    let [header, dev_area, table_area, event_area, keys] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(devices.len() as u16 + 2),
        Constraint::Min(3),
        Constraint::Length(if events > 0 { events + 2 } else { 0 }),
        Constraint::Length(1),
    ])
    .areas(frame.area());

    let alive = watched.iter().filter(|w| w.gone.is_none()).count();
    let steps = watched
        .iter()
        .filter(|w| w.gone.is_none())
        .map(|w| {
            let rate = w
                .steps_per_s()
                .map(|r| format!(" {r:.2}/s"))
                .unwrap_or_default();
            format!("pid {} step {}{rate}", w.pid, w.last.step)
        })
        .collect::<Vec<_>>()
        .join(" · ");
    let title = format!(
        "memsnap top — {alive} process{} — {steps} — sort: {} — growth since {}{}",
        if alive == 1 { "" } else { "es" },
        view.sort.as_str(),
        match view.baseline {
            Baseline::Start => "start",
            Baseline::LastStep => "the last step",
        },
        if view.frozen { " — FROZEN" } else { "" }
    );
    frame.render_widget(
        Paragraph::new(title).style(Style::default().add_modifier(Modifier::BOLD)),
        header,
    );

    let block = Block::default().borders(Borders::ALL).title("devices");
    let inner = block.inner(dev_area);
    frame.render_widget(block, dev_area);
    for (i, (w, d)) in devices.iter().enumerate() {
        let row = Rect {
            y: inner.y + i as u16,
            height: 1,
            ..inner
        };
        if row.y >= inner.y + inner.height {
            break;
        }
        let [text, spark] =
            Layout::horizontal([Constraint::Min(64), Constraint::Percentage(30)]).areas(row);
        frame.render_widget(
            Paragraph::new(format!(
                "pid {} cuda:{}  live {:>10}  reserved {:>10}  peak {:>10}{}",
                w.pid,
                d.now.device,
                fmt_bytes(d.now.live_bytes as i64),
                fmt_bytes(d.now.reserved_bytes as i64),
                fmt_bytes(d.now.peak_bytes as i64),
                if d.now.ooms > 0 {
                    format!("  OOM {}", d.now.ooms)
                } else {
                    String::new()
                }
            )),
            text,
        );
        // The newest samples that fit, right-aligned like a strip chart.
        let shown = &d.history[d.history.len().saturating_sub(spark.width as usize)..];
        frame.render_widget(Sparkline::default().data(shown), spark);
    }

    let rows = site_rows(watched, view.sort, view.baseline);
    let table = Table::new(
        rows.iter().map(|r| {
            // Numbers right-aligned, so magnitudes line up.
            Row::new(vec![
                Line::from(fmt_bytes(r.bytes as i64)).right_aligned(),
                Line::from(r.count.to_string()).right_aligned(),
                Line::from(signed_bytes(r.growth)).right_aligned(),
                Line::from(r.site.clone()),
            ])
        }),
        [
            Constraint::Length(11),
            Constraint::Length(8),
            Constraint::Length(12),
            Constraint::Fill(1),
        ],
    )
    .header(
        Row::new(vec![
            Line::from("live").right_aligned(),
            Line::from("count").right_aligned(),
            Line::from("growth").right_aligned(),
            Line::from("site"),
        ])
        .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title("live bytes by allocation site"),
    );
    frame.render_widget(table, table_area);

    if events > 0 {
        let lines: Vec<Line> = view.events.iter().map(|e| Line::from(e.as_str())).collect();
        frame.render_widget(
            Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title("events")),
            event_area,
        );
    }
    frame.render_widget(
        Paragraph::new("s sort · g growth since start/step · f freeze · d dump now · q quit"),
        keys,
    );
}

/// The interactive view until `q`. Snapshots written with `d` are printed once the
/// terminal is restored, so their names stay on screen.
pub fn run(uid: u32, watched: &mut [Watched], interval: Duration) -> Result<()> {
    let mut terminal = ratatui::init();
    let mut view = View::default();
    let mut written = Vec::new();
    let result = (|| -> Result<()> {
        let mut next = Instant::now() + interval;
        loop {
            terminal.draw(|f| draw(f, watched, &view))?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()?
                    && k.kind == KeyEventKind::Press
                {
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                            return Ok(());
                        }
                        KeyCode::Char('s') => view.sort = view.sort.next(),
                        KeyCode::Char('g') => {
                            view.baseline = match view.baseline {
                                Baseline::Start => Baseline::LastStep,
                                Baseline::LastStep => Baseline::Start,
                            }
                        }
                        KeyCode::Char('f') | KeyCode::Char(' ') => view.frozen = !view.frozen,
                        KeyCode::Char('d') => {
                            for w in watched.iter().filter(|w| w.gone.is_none()) {
                                match super::dump_now(uid, w.pid) {
                                    Ok(path) => {
                                        view.event(format!("pid {}: wrote {path}", w.pid));
                                        written.push(path);
                                    }
                                    Err(e) => view.event(format!("{e:#}")),
                                }
                            }
                        }
                        _ => {}
                    }
                }
                continue;
            }
            next = Instant::now() + interval;
            if !view.frozen {
                for line in super::refresh(uid, watched) {
                    view.event(line);
                }
            }
        }
    })();
    ratatui::restore();
    for path in written {
        println!("{path}");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::top::model::tests::sample;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn screen(watched: &[Watched], view: &View) -> Vec<String> {
        let mut terminal = Terminal::new(TestBackend::new(120, 20)).unwrap();
        terminal.draw(|f| draw(f, watched, view)).unwrap();
        let buf = terminal.backend().buffer().clone();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol())
                    .collect::<String>()
            })
            .collect()
    }

    fn row_with<'a>(lines: &'a [String], text: &str) -> &'a str {
        lines
            .iter()
            .find(|l| l.contains(text))
            .unwrap_or_else(|| panic!("no row with {text:?}:\n{}", lines.join("\n")))
    }

    #[test]
    fn shows_devices_sites_sorted_and_growth() {
        let mut w = Watched::new(
            sample(42, 3, 0, 3 << 20, 1 << 20),
            memsnap_engine::sites::Attribution::default(),
        );
        w.update(sample(42, 5, 1, 3 << 20, 6 << 20));
        let watched = [w];
        let mut view = View::default();
        let lines = screen(&watched, &view);
        assert!(lines[0].contains("pid 42 step 5 2.00/s"), "{}", lines[0]);
        let dev = row_with(&lines, "cuda:0");
        assert!(
            dev.contains("live    9.0 MiB") && dev.contains("peak    9.0 MiB"),
            "{dev}"
        );
        let cache = row_with(&lines, "kv_cache_alloc (cache.cc:40)");
        assert!(
            cache.contains("6.0 MiB") && cache.contains("+5.0 MiB"),
            "{cache}"
        );
        let weights = row_with(&lines, "proj/train.py:12 (build)");
        assert!(
            weights.contains("3.0 MiB") && weights.contains(" 2 "),
            "{weights}"
        );
        let pos = |t: &str| lines.iter().position(|l| l.contains(t)).unwrap();
        assert!(pos("kv_cache_alloc") < pos("train.py:12"), "largest first");

        view.sort = SortBy::Count;
        view.frozen = true;
        view.event("pid 42: OOM: device 0 could not allocate 2.0 GiB".into());
        let lines = screen(&watched, &view);
        assert!(pos_in(&lines, "train.py:12") < pos_in(&lines, "kv_cache_alloc"));
        assert!(lines[0].contains("sort: count") && lines[0].contains("FROZEN"));
        row_with(&lines, "OOM: device 0 could not allocate 2.0 GiB");
    }

    fn pos_in(lines: &[String], t: &str) -> usize {
        lines.iter().position(|l| l.contains(t)).unwrap()
    }
}
