//! Medians, quantiles and ratios, printed as one Markdown table.

use std::time::Duration;

use crate::fanout::Fanout;
use crate::queue::Queue;
use crate::{Results, Settings};

/// The value at quantile `q` (nearest rank) of `samples`, sorted here.
fn quantile<T: Copy + PartialOrd>(samples: &[T], q: f64) -> T {
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn median_ms(samples: &[Duration]) -> f64 {
    quantile(samples, 0.5).as_secs_f64() * 1e3
}

fn us_to_ms(us: u64) -> f64 {
    us as f64 / 1e3
}

impl Results {
    pub fn table(&self, s: &Settings) -> String {
        let mut rows: Vec<[String; 4]> = Vec::new();
        let base_ttfb = median_ms(&self.ttfb_baseline);
        let ttfb_base_label = format!("{base_ttfb:.3} ms (bare axum SSE handler)");
        for (label, samples) in [
            ("new stream, replays the log", &self.ttfb_fresh),
            ("resumed at its end, heartbeat first", &self.ttfb_resumed),
        ] {
            let ms = median_ms(samples);
            rows.push([
                format!(
                    "Time to first SSE frame, idle session, {label} (median of {})",
                    s.ttfb_samples
                ),
                format!("{ms:.3} ms"),
                ttfb_base_label.clone(),
                ratio(ms, base_ttfb),
            ]);
        }
        let n = s.subscribers;
        let (f, b) = (&self.fanout, &self.fanout_baseline);
        for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
            let ours = us_to_ms(quantile(&f.latencies_us, q));
            let theirs = us_to_ms(quantile(&b.latencies_us, q));
            rows.push([
                format!(
                    "Event delivery latency {label}, {n} subscribers ({} samples)",
                    f.latencies_us.len()
                ),
                format!("{ours:.2} ms"),
                format!(
                    "{theirs:.2} ms (axum SSE + tokio broadcast, {} samples)",
                    b.latencies_us.len()
                ),
                ratio(ours, theirs),
            ]);
        }
        let per_sub = |f: &Fanout, rss: u64| rss.saturating_sub(f.rss_idle) as f64 / n as f64;
        for (label, ours, theirs) in [
            (
                "open, before any event",
                per_sub(f, f.rss_open),
                per_sub(b, b.rss_open),
            ),
            (
                "after the rounds",
                per_sub(f, f.rss_after),
                per_sub(b, b.rss_after),
            ),
        ] {
            rows.push([
                format!("Server memory per subscriber, {label} (RSS delta / {n})"),
                format!("{ours:.1} KiB"),
                format!("{theirs:.1} KiB (axum SSE + tokio broadcast)"),
                ratio(ours, theirs),
            ]);
        }
        let turns = format!(
            "median of {} × {} sessions × {} turns",
            s.reps, s.queue_sessions, s.queue_turns
        );
        let sqlite = queue_rows(&mut rows, "SQLite", &self.sqlite, &turns);
        match &self.postgres {
            Ok(pg) => {
                let pg_rate = queue_rows(&mut rows, "PostgreSQL", pg, &turns);
                rows.push([
                    "Submissions per second, PostgreSQL against SQLite".into(),
                    format!("{pg_rate:.1}/s"),
                    format!("{sqlite:.1}/s (SQLite)"),
                    ratio(pg_rate, sqlite),
                ]);
            }
            Err(reason) => rows.push([
                "Submissions per second through the queue, PostgreSQL".into(),
                format!("not measured: {reason}"),
                "not measured".into(),
                "n/a".into(),
            ]),
        }

        let mut out = String::new();
        out.push_str(&format!(
            "| Benchmark ({} run) | sandspec | Baseline | Ratio |\n|---|---:|---:|---:|\n",
            s.mode
        ));
        for row in rows {
            out.push_str(&format!("| {} |\n", row.join(" | ")));
        }
        out.push_str(&format!(
            "\nEvents in the idle session's log: {}. Events per subscriber over the rounds: {} \
             (sandspec), {} (baseline). Server RSS, KiB, before / with {n} subscribers / after \
             the rounds: sandspec {} / {} / {}, baseline {} / {} / {}.\n",
            self.idle_events,
            f.events_per_subscriber,
            b.events_per_subscriber,
            f.rss_idle,
            f.rss_open,
            f.rss_after,
            b.rss_idle,
            b.rss_open,
            b.rss_after,
        ));
        let rates = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!(
            "Per repetition, submissions/s and GET/s: SQLite [{}] and [{}]",
            rates(&self.sqlite.submissions),
            rates(&self.sqlite.gets)
        ));
        if let Ok(pg) = &self.postgres {
            out.push_str(&format!(
                "; PostgreSQL [{}] and [{}]",
                rates(&pg.submissions),
                rates(&pg.gets)
            ));
        }
        out.push_str(".\n");
        let ms = |v: &[f64], q: f64| {
            if v.is_empty() {
                "n/a".to_owned()
            } else {
                format!("{:.2} ms", quantile(v, q) / 1000.0)
            }
        };
        let stages = |store: &str, q: &Queue| {
            format!(
                "{store}: a turn, `submission.started` to `submission.completed`, median {} \
                 (p90 {}, {} turns); from a turn's completion to the start of the next one \
                 queued behind it, median {} (p90 {})",
                ms(&q.turn_us, 0.5),
                ms(&q.turn_us, 0.9),
                q.turn_us.len(),
                ms(&q.handoff_us, 0.5),
                ms(&q.handoff_us, 0.9),
            )
        };
        out.push_str(&format!(
            "Where a turn's time goes (the server's `created_at` of its events): {}",
            stages("SQLite", &self.sqlite)
        ));
        if let Ok(pg) = &self.postgres {
            out.push_str(&format!("; {}", stages("PostgreSQL", pg)));
        }
        out.push_str(".\n");
        out
    }
}

/// Adds the submissions row of one store; returns its median rate.
fn queue_rows(rows: &mut Vec<[String; 4]>, store: &str, q: &Queue, turns: &str) -> f64 {
    let subs = quantile(&q.submissions, 0.5);
    let gets = quantile(&q.gets, 0.5);
    rows.push([
        format!("Submissions per second through the queue, {store} ({turns})"),
        format!("{subs:.1}/s"),
        format!("{gets:.0}/s (GET /v1/sessions/{{id}}, same server)"),
        ratio(subs, gets),
    ]);
    subs
}

fn ratio(ours: f64, theirs: f64) -> String {
    if theirs > 0.0 {
        let r = ours / theirs;
        if r >= 10.0 {
            format!("{r:.0}×")
        } else if r >= 0.1 {
            format!("{r:.2}×")
        } else {
            format!("{r:.4}×")
        }
    } else {
        "n/a".into()
    }
}
