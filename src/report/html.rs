//! The report page: a header that says what ran and how it ended, figures in cards, then a section per question
//! (outcome, throughput over time, lengths, latency, KV cache and memory, slowest units) and the job's full
//! description last. Self-contained: inline CSS and SVG, no script, no link to anything.

use std::fmt::Write;

use super::svg::{self, count, escape, seconds, Lane, Steps, PALETTE};
use super::{AttemptSummary, ReportData};

/// 1234567 as "1,234,567".
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 { "–".into() } else { format!("{:.1} %", 100.0 * part as f64 / whole as f64) }
}

fn bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", n / (1024.0 * 1024.0 * 1024.0))
    } else if n >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", n / (1024.0 * 1024.0))
    } else {
        format!("{:.1} KiB", n / 1024.0)
    }
}

/// A Unix time as `2026-12-01 22:45:17 UTC` (the proleptic Gregorian calendar, from the days since 1970).
pub fn utc(unix_s: f64) -> String {
    let secs = unix_s.max(0.0).floor() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem / 60 % 60, rem % 60)
}

fn short(s: &str, n: usize) -> &str {
    s.get(..n).unwrap_or(s)
}

fn shards_label(shards: &[u32], of: u32) -> String {
    match shards {
        [one] if of > 1 => format!("shard {one}"),
        [_] => "the job".into(),
        many if many.len() == of as usize && of > 1 => "all shards".into(),
        many => format!("shards {}", many.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")),
    }
}

/// An attempt's name in legends: its shard(s) and the start of its id.
fn attempt_label(a: &AttemptSummary, shards: u32) -> String {
    format!("{} · {}", shards_label(&a.shards, shards), short(&a.attempt, 8))
}

/// Where each attempt sits on the report's time axis: seconds from the earliest start, when starts are known;
/// otherwise attempts are laid end to end in the order they are listed.
fn offsets(attempts: &[AttemptSummary]) -> (Vec<f64>, Option<f64>) {
    let starts: Option<Vec<f64>> = attempts.iter().map(|a| a.started_unix_s).collect();
    match starts {
        Some(starts) if !starts.is_empty() => {
            let first = starts.iter().copied().fold(f64::INFINITY, f64::min);
            (starts.iter().map(|s| s - first).collect(), Some(first))
        }
        _ => {
            let mut at = 0.0;
            let offsets = attempts
                .iter()
                .map(|a| {
                    let o = at;
                    at += a.last_commit_s;
                    o
                })
                .collect();
            (offsets, None)
        }
    }
}

fn figure(out: &mut String, name: &str, caption: &str, svg: &str) {
    let _ = write!(out, r#"<figure class="chart" data-chart="{}">{svg}<figcaption>{}</figcaption></figure>"#, escape(name), escape(caption));
}

fn card(out: &mut String, name: &str, label: &str, value: &str, note: &str) {
    let bad = if name == "errored" && value != "0" { " bad" } else { "" };
    let _ = write!(
        out,
        r#"<div class="card{bad}" data-card="{}"><div class="label">{}</div><div class="value">{}</div><div class="note">{}</div></div>"#,
        escape(name),
        escape(label),
        escape(value),
        escape(note)
    );
}

const STYLE: &str = r#"
:root { color-scheme: light; --ink: #1f2328; --muted: #59636e; --line: #d1d9e0; --ok: #3ca951; --bad: #d1432f; --warn: #b7791f; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: var(--ink); background: #f6f8fa; }
main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 40px; }
header h1 { font-size: 22px; margin: 0 0 4px; }
.state { display: inline-block; padding: 2px 10px; border-radius: 12px; font-weight: 600; color: #fff; margin-right: 8px; }
.state.complete { background: var(--ok); } .state.incomplete { background: var(--warn); }
.facts { color: var(--muted); margin: 6px 0 0; overflow-wrap: anywhere; }
.facts code { color: var(--ink); }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 10px; margin: 16px 0; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.card .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .value { font-size: 22px; font-weight: 600; }
.card .note { color: var(--muted); font-size: 12px; }
.card.bad .value { color: var(--bad); }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px; margin: 14px 0; }
section h2 { font-size: 16px; margin: 0 0 8px; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 16px; }
figure { margin: 0; min-width: 0; }
figure svg { width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 4px; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
svg .bar-label, svg .bar-value { fill: var(--ink); font-size: 12px; }
svg .axis-title { font-size: 12px; fill: var(--ink); }
svg .grid { stroke: #eaeef2; } svg .axis, svg .tick-line { stroke: #8c959f; }
svg .bar { fill: #4269d0; } svg .line { fill: none; stroke-width: 2.5; }
svg .marker { stroke: var(--bad); stroke-dasharray: 4 3; } svg .marker-label { fill: var(--bad); }
svg .startup { opacity: .35; } svg .commit { stroke: #1f2328; stroke-width: 1; opacity: .55; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eaeef2; vertical-align: top; }
td.n, th.n { text-align: right; }
.wide { overflow-x: auto; }
.meter { display: inline-block; width: 80px; height: 8px; background: #eaeef2; border-radius: 4px; margin-right: 6px; vertical-align: middle; }
.meter > span { display: block; height: 100%; background: #4269d0; border-radius: 4px; }
.empty { color: var(--muted); font-style: italic; }
code { font: 12px ui-monospace, SFMono-Regular, Menlo, monospace; overflow-wrap: anywhere; }
footer { color: var(--muted); font-size: 12px; margin-top: 18px; }
"#;

/// The report page.
pub fn render(data: &ReportData) -> String {
    let attempts = data.attempts();
    let mut out = String::with_capacity(64 * 1024);
    let job = data.job_name.clone().unwrap_or_else(|| "job".into());
    let _ = write!(
        out,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>nightshift report: {}</title><style>{STYLE}</style></head><body><main>"#,
        escape(&job)
    );
    header(&mut out, data, &job);
    cards(&mut out, data, &attempts);
    outcome(&mut out, data);
    throughput(&mut out, data, &attempts);
    lengths(&mut out, data);
    latency(&mut out, data);
    memory(&mut out, data, &attempts);
    slowest(&mut out, data);
    job_section(&mut out, data);
    let _ = write!(
        out,
        r#"<footer>Made by nightshift {} (<code>nightshift report {}</code>) at {}. Row counts, lengths and their percentiles are exact; time percentiles are read off logarithmic bins (within 3 %). Engine figures are each attempt's, from the metrics of its last committed unit.</footer></main></body></html>"#,
        escape(env!("CARGO_PKG_VERSION")),
        escape(&data.url),
        escape(&utc(data.generated_unix_s)),
    );
    out
}

fn header(out: &mut String, data: &ReportData, job: &str) {
    let committed = data.units.len();
    let total = data.plan.units.len();
    let _ = write!(out, r#"<header><h1>{}</h1><p>"#, escape(job));
    if data.complete {
        let _ = write!(out, r#"<span class="state complete" data-state="complete">Complete</span>every one of {} units is committed"#, thousands(total as u64));
    } else {
        let _ = write!(
            out,
            r#"<span class="state incomplete" data-state="incomplete">Incomplete</span>{} of {} units committed; a rerun of the job finishes it"#,
            thousands(committed as u64),
            thousands(total as u64)
        );
    }
    if !data.damaged_units.is_empty() {
        let _ = write!(out, "; {} committed unit(s) lost a file and will be computed again", data.damaged_units.len());
    }
    let fp = &data.plan.fingerprint;
    let _ = write!(
        out,
        r#"</p><p class="facts">output <code>{}</code> · model <code>{}</code> (sha256 <code>{}</code>) · fingerprint <code>{}</code> · input {} file(s), {} rows · report made {}</p></header>"#,
        escape(&data.url),
        escape(data.model.as_deref().unwrap_or("?")),
        escape(short(&fp.model_sha256, 12)),
        escape(&fp.digest()),
        fp.input.len(),
        thousands(data.plan.total_rows()),
        escape(&utc(data.generated_unix_s)),
    );
}

/// Wall time from the first attempt's start to the last commit (attempts end to end when starts are unknown).
fn wall_s(attempts: &[AttemptSummary]) -> f64 {
    let (offsets, _) = offsets(attempts);
    attempts.iter().zip(&offsets).map(|(a, o)| o + a.last_commit_s).fold(0.0, f64::max)
}

fn cards(out: &mut String, data: &ReportData, attempts: &[AttemptSummary]) {
    let r = &data.rows;
    let planned = data.plan.total_rows();
    out.push_str(r#"<div class="cards" id="summary">"#);
    let rows_note = if r.rows == planned { "every input row".to_string() } else { format!("of {} planned", thousands(planned)) };
    card(out, "rows", "Rows", &thousands(r.rows), &rows_note);
    let succeeded_note = match r.reused + r.deduplicated {
        0 => percent(r.succeeded, r.rows),
        _ => format!("{}; {} computed, {} reused, {} deduplicated", percent(r.succeeded, r.rows), thousands(r.succeeded - r.reused - r.deduplicated), thousands(r.reused), thousands(r.deduplicated)),
    };
    card(out, "succeeded", "Succeeded", &thousands(r.succeeded), &succeeded_note);
    card(out, "errored", "Errored", &thousands(r.errored), &percent(r.errored, r.rows));
    let output_tokens = r.completion_tokens.sum();
    card(out, "output-tokens", "Output tokens", &count(output_tokens as f64), &format!("{} prompt tokens", count(r.prompt_tokens.sum() as f64)));
    let wall = wall_s(attempts);
    let rate = |n: u64| if wall > 0.0 { format!("{}/s", count(n as f64 / wall)) } else { "–".into() };
    let tokens = if output_tokens > 0 { output_tokens } else { r.prompt_tokens.sum() };
    card(out, "throughput", if output_tokens > 0 { "Output tokens/s" } else { "Tokens/s" }, &rate(tokens), &format!("{} rows/s over the wall time", rate(r.rows).trim_end_matches("/s")));
    card(out, "wall-time", "Wall time", &seconds(wall), "first start to last commit");
    let shards = data.plan.shards;
    card(out, "attempts", "Attempts", &attempts.len().to_string(), &format!("{shards} shard(s), {} units", thousands(data.plan.units.len() as u64)));
    out.push_str("</div>");
}

fn outcome(out: &mut String, data: &ReportData) {
    let r = &data.rows;
    out.push_str(r#"<section id="outcome"><h2>Outcome</h2><div class="charts">"#);
    let mut items: Vec<(String, u64, &str)> = vec![("succeeded".into(), r.succeeded, "#3ca951")];
    let mut errors: Vec<(&String, &u64)> = r.errors.iter().collect();
    errors.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    items.extend(errors.iter().map(|(code, n)| ((*code).clone(), **n, "#d1432f")));
    let caption = if r.errored == 0 {
        "Rows by outcome: no row errored.".to_string()
    } else {
        format!("Rows by outcome: {} errored rows by error code (their messages are in the result files).", thousands(r.errored))
    };
    figure(out, "outcome", &caption, &svg::bars(&items));
    if r.finish_reasons.is_empty() {
        out.push_str(r#"<p class="empty">No finish reasons: no row generated text (an embedding job, or none succeeded).</p>"#);
    } else {
        let mut reasons: Vec<(String, u64, &str)> = r.finish_reasons.iter().map(|(k, v)| (k.clone(), *v, PALETTE[0])).collect();
        reasons.sort_by_key(|r| std::cmp::Reverse(r.1));
        figure(out, "finish-reasons", "Succeeded rows by finish reason: stop (an end token or stop string), length (max_new_tokens), and others.", &svg::bars(&reasons));
    }
    out.push_str("</div></section>");
}

fn throughput(out: &mut String, data: &ReportData, attempts: &[AttemptSummary]) {
    out.push_str(r#"<section id="throughput"><h2>Throughput over time</h2>"#);
    if attempts.is_empty() {
        out.push_str(r#"<p class="empty">No unit is committed yet.</p></section>"#);
        return;
    }
    let (offsets, first) = offsets(attempts);
    let x_title = match first {
        Some(first) => format!("time since the first attempt started ({})", utc(first)),
        None => "time, attempts end to end (their start times were not recorded)".into(),
    };
    let generated = attempts.iter().any(|a| a.completion_tokens > 0);
    let shards = data.plan.shards;
    // Many attempts (a job of many shards) would make a lane or a line each unreadable: past MAX_LANES, the lanes
    // shown are the reruns' (shards with more than one attempt) and then the last to finish; past MAX_LINES, one
    // line sums every attempt.
    const MAX_LANES: usize = 40;
    const MAX_LINES: usize = 8;
    let end = |i: usize| offsets[i] + attempts[i].last_commit_s;
    let mut shown: Vec<usize> = (0..attempts.len()).collect();
    if attempts.len() > MAX_LANES {
        let reruns = |i: &usize| attempts.iter().filter(|a| a.shards == attempts[*i].shards).count() > 1;
        shown.sort_by(|a, b| reruns(b).cmp(&reruns(a)).then(end(*b).total_cmp(&end(*a))));
        shown.truncate(MAX_LANES);
        shown.sort_unstable();
    }
    let lanes: Vec<Lane> = shown
        .iter()
        .map(|&i| {
            let (a, o) = (&attempts[i], offsets[i]);
            Lane {
                label: attempt_label(a, shards),
                colour: PALETTE[i % PALETTE.len()],
                spans: vec![(o, o + a.model_load_s.min(a.last_commit_s), true), (o + a.model_load_s.min(a.last_commit_s), o + a.last_commit_s, false)],
                ticks: a.commits.iter().map(|c| o + c.at_s).collect(),
            }
        })
        .collect();
    out.push_str(r#"<div class="charts">"#);
    let mut caption = "When each attempt (process start) ran: start-up and model load lighter, then a tick at each unit it committed. An attempt that stops early was killed or drained; its rerun is a later lane of the same shard.".to_string();
    if shown.len() < attempts.len() {
        caption.push_str(&format!(" {} of {} attempts are shown: the reruns first, then those that finished last.", shown.len(), attempts.len()));
    }
    figure(out, "timeline", &caption, &svg::timeline(&lanes, &seconds, &x_title));
    let series: Vec<Steps> = if attempts.len() <= MAX_LINES {
        attempts
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(i, (a, o))| {
                let from = a.model_load_s.min(a.last_commit_s);
                let steps = a.rate_over_time(from, 40, generated).into_iter().map(|(x0, x1, rate)| (o + x0, o + x1, rate)).collect();
                Steps { label: attempt_label(a, shards), colour: PALETTE[i % PALETTE.len()], steps }
            })
            .collect()
    } else {
        let (lo, hi) = (0.0, (0..attempts.len()).map(end).fold(0.0, f64::max));
        let buckets = 60;
        let width = (hi - lo) / buckets as f64;
        let steps = (0..buckets)
            .filter(|_| width > 0.0)
            .map(|b| {
                let (t0, t1) = (lo + b as f64 * width, lo + (b + 1) as f64 * width);
                let tokens: f64 = attempts.iter().zip(&offsets).map(|(a, o)| a.tokens_between(t0 - o, if b + 1 == buckets { f64::INFINITY } else { t1 - o }, generated)).sum();
                (t0, t1, tokens / width)
            })
            .collect();
        vec![Steps { label: format!("all {} attempts", attempts.len()), colour: PALETTE[0], steps }]
    };
    let y_title = if generated { "output tokens/s" } else { "tokens/s" };
    figure(
        out,
        "throughput",
        &format!(
            "{} {}: each unit's tokens spread over its generation window (its first row ready to its last result), summed over the units in flight.",
            if generated { "Generated tokens per second" } else { "Tokens per second" },
            if attempts.len() <= MAX_LINES { "per attempt, from the end of its model load to its last commit" } else { "of all attempts together" }
        ),
        &svg::step_lines(&series, &seconds, &count, &x_title, y_title),
    );
    out.push_str("</div>");
    let missing = data.missing_units();
    if !missing.is_empty() {
        out.push_str(r#"<p id="missing">Not committed yet: "#);
        let parts: Vec<String> = missing
            .iter()
            .map(|(shard, units)| {
                let first: Vec<String> = units.iter().take(5).map(|u| format!("u{u:06}")).collect();
                format!("shard {shard}: {} unit(s) ({}{})", units.len(), first.join(", "), if units.len() > 5 { ", …" } else { "" })
            })
            .collect();
        out.push_str(&escape(&parts.join("; ")));
        out.push_str("</p>");
    }
    out.push_str("</section>");
}

fn length_figure(out: &mut String, name: &str, what: &str, lengths: &super::Lengths) {
    let marks: Vec<(&str, f64)> = [("p50", 50.0), ("p90", 90.0), ("p99", 99.0)].iter().filter_map(|(l, p)| Some((*l, f64::from(lengths.percentile(*p)?)))).collect();
    let n = lengths.count();
    let caption = if n == 0 {
        format!("{what}: no succeeded rows.")
    } else {
        format!(
            "{what} per succeeded row: mean {:.1}, p50 {}, p90 {}, p99 {}, max {}.",
            lengths.sum() as f64 / n as f64,
            lengths.percentile(50.0).unwrap_or(0),
            lengths.percentile(90.0).unwrap_or(0),
            lengths.percentile(99.0).unwrap_or(0),
            lengths.max().unwrap_or(0)
        )
    };
    figure(out, name, &caption, &svg::histogram(&lengths.bins(30), false, &count, "tokens", &marks));
}

fn lengths(out: &mut String, data: &ReportData) {
    out.push_str(r#"<section id="lengths"><h2>Prompt and output lengths</h2><div class="charts">"#);
    length_figure(out, "prompt-lengths", "Prompt tokens (after the chat template)", &data.rows.prompt_tokens);
    if data.rows.completion_tokens.count() > 0 || data.rows.succeeded == 0 {
        length_figure(out, "output-lengths", "Generated tokens", &data.rows.completion_tokens);
        out.push_str("</div>");
    } else {
        out.push_str(r#"</div><p class="empty">No generated tokens: the rows were embedded (or scored), not generated.</p>"#);
    }
    let prompt = data.rows.prompt_tokens.sum();
    if data.rows.cached_tokens > 0 {
        let _ = write!(
            out,
            r#"<p id="cached">{} of {} prompt tokens ({}) were served from the prefix cache instead of computed.</p>"#,
            thousands(data.rows.cached_tokens),
            thousands(prompt),
            percent(data.rows.cached_tokens, prompt)
        );
    }
    out.push_str("</section>");
}

fn latency(out: &mut String, data: &ReportData) {
    let r = &data.rows;
    let title = if r.ttft_s.count() > 0 { "Time to first token and time per output token" } else { "Row latency" };
    let _ = write!(out, r#"<section id="latency"><h2>{title}</h2>"#);
    if r.ttft_s.count() == 0 && r.e2e_s.count() == 0 {
        out.push_str(r#"<p class="empty">No succeeded rows yet.</p></section>"#);
        return;
    }
    out.push_str(r#"<div class="charts">"#);
    let marks = |h: &super::LogHistogram| -> Vec<(&'static str, f64)> {
        [("p50", 50.0), ("p90", 90.0), ("p99", 99.0)].into_iter().filter_map(|(l, p)| Some((l, h.percentile(p)?))).collect()
    };
    if r.ttft_s.count() > 0 {
        figure(out, "ttft", "Time to first token: from a row being ready (tokenized) to its first generated token; queueing included.", &svg::histogram(&r.ttft_s.bins(30), true, &seconds, "time to first token", &marks(&r.ttft_s)));
    }
    if r.tpot_s.count() > 0 {
        figure(out, "tpot", "Time per output token after the first, per row (its mean).", &svg::histogram(&r.tpot_s.bins(30), true, &seconds, "time per output token", &marks(&r.tpot_s)));
    }
    if r.ttft_s.count() == 0 {
        figure(out, "e2e", "Row latency: from ready to its result.", &svg::histogram(&r.e2e_s.bins(30), true, &seconds, "row latency", &marks(&r.e2e_s)));
    }
    out.push_str(r#"</div><div class="wide"><table id="percentiles"><tr><th></th><th class="n">p50</th><th class="n">p90</th><th class="n">p99</th><th class="n">max</th><th class="n">rows</th></tr>"#);
    for (name, h) in [("time to first token", &r.ttft_s), ("time per output token", &r.tpot_s), ("row latency (ready to result)", &r.e2e_s)] {
        if h.count() == 0 {
            continue;
        }
        let p = |q: f64| h.percentile(q).map_or("–".into(), seconds);
        let _ = write!(out, r#"<tr><td>{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td></tr>"#, escape(name), p(50.0), p(90.0), p(99.0), p(100.0), thousands(h.count()));
    }
    out.push_str("</table></div></section>");
}

fn meter(fraction: Option<f64>) -> String {
    match fraction {
        Some(f) => format!(r#"<span class="meter"><span style="width:{:.1}%"></span></span>{:.1} %"#, (f * 100.0).clamp(0.0, 100.0), f * 100.0),
        None => "–".into(),
    }
}

fn memory(out: &mut String, data: &ReportData, attempts: &[AttemptSummary]) {
    out.push_str(r#"<section id="memory"><h2>KV cache and memory</h2>"#);
    if attempts.is_empty() {
        out.push_str(r#"<p class="empty">No unit is committed yet.</p></section>"#);
        return;
    }
    let preemptions: u64 = attempts.iter().map(|a| a.engine.preemptions).sum();
    let _ = write!(
        out,
        r#"<p>{} preemption(s) in all{}. The KV cache budget is in blocks of 16 positions; utilisation is blocks in use over the budget.</p>"#,
        thousands(preemptions),
        if preemptions > 0 { ": a preempted sequence is recomputed later and its output is unchanged, but the recomputed tokens are lost time" } else { "" }
    );
    out.push_str(r#"<div class="wide"><table id="attempts"><tr><th>attempt</th><th>weights</th><th class="n">KV blocks</th><th>KV peak</th><th>KV mean</th><th class="n">preemptions</th><th class="n">recomputed tokens</th><th class="n">prefix-cache tokens</th><th class="n">peak memory</th><th class="n">model load</th></tr>"#);
    for a in attempts {
        let _ = write!(
            out,
            r#"<tr><td>{}</td><td>{} ({}; KV {})</td><td class="n">{}</td><td>{}</td><td>{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td></tr>"#,
            escape(&attempt_label(a, data.plan.shards)),
            bytes(a.engine.weights_bytes),
            escape(&a.engine.weights_layout),
            escape(&a.engine.kv_cache_dtype),
            thousands(a.engine.kv_cache_blocks),
            meter(a.engine.kv_utilisation_peak),
            meter(a.engine.kv_utilisation_mean),
            thousands(a.engine.preemptions),
            thousands(a.engine.recomputed_tokens),
            thousands(a.engine.cached_prompt_tokens),
            bytes(a.engine.peak_rss_bytes),
            seconds(a.model_load_s),
        );
    }
    out.push_str("</table></div></section>");
}

fn slowest(out: &mut String, data: &ReportData) {
    out.push_str(r#"<section id="slowest"><h2>Slowest units</h2>"#);
    if data.units.is_empty() {
        out.push_str(r#"<p class="empty">No unit is committed yet.</p></section>"#);
        return;
    }
    let mut units: Vec<&super::UnitFigures> = data.units.iter().collect();
    units.sort_by(|a, b| b.generation_s.total_cmp(&a.generation_s).then(a.unit.cmp(&b.unit)));
    let _ = write!(out, "<p>The {} slowest of {} committed unit(s), by the time from their first row ready to their last result.</p>", units.len().min(10), data.units.len());
    out.push_str(r#"<div class="wide"><table id="slowest-units"><tr><th>unit</th><th>shard</th><th>attempt</th><th class="n">rows</th><th class="n">errored</th><th class="n">prompt tokens</th><th class="n">output tokens</th><th class="n">time</th><th class="n">output tokens/s</th></tr>"#);
    for u in units.iter().take(10) {
        let _ = write!(
            out,
            r#"<tr><td>u{:06}</td><td class="n">{}</td><td><code>{}</code></td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{}</td><td class="n">{:.1}</td></tr>"#,
            u.unit,
            u.shard,
            escape(short(&u.attempt, 8)),
            thousands(u.rows),
            thousands(u.errored_rows),
            thousands(u.prompt_tokens),
            thousands(u.completion_tokens),
            seconds(u.generation_s),
            u.output_tokens_per_s,
        );
    }
    out.push_str("</table></div></section>");
}

/// A JSON object's members as table rows (values as compact JSON; strings as they are).
fn settings_rows(out: &mut String, value: &serde_json::Value) {
    let Some(object) = value.as_object() else {
        if !value.is_null() {
            let _ = write!(out, "<tr><td colspan=2><code>{}</code></td></tr>", escape(&value.to_string()));
        }
        return;
    };
    for (key, v) in object {
        let shown = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let _ = write!(out, "<tr><td><code>{}</code></td><td><code>{}</code></td></tr>", escape(key), escape(&shown));
    }
}

fn job_section(out: &mut String, data: &ReportData) {
    let fp = &data.plan.fingerprint;
    out.push_str(r#"<section id="job"><h2>The job</h2><div class="charts"><div><table>"#);
    let input_bytes: u64 = fp.input.iter().map(|f| f.size).sum();
    let facts = [
        ("job file", data.job_name.clone().unwrap_or_else(|| "?".into())),
        ("model", data.model.clone().unwrap_or_else(|| "?".into())),
        ("model sha256", fp.model_sha256.clone()),
        ("fingerprint", fp.digest()),
        ("written by", format!("nightshift {}", data.written_by.as_deref().unwrap_or("?"))),
        ("input", format!("{} file(s), {} rows, {}", fp.input.len(), thousands(data.plan.total_rows()), bytes(input_bytes))),
        ("units", format!("{} of up to {} rows, in {} shard(s)", thousands(data.plan.units.len() as u64), thousands(data.plan.unit_rows.into()), data.plan.shards)),
    ];
    for (k, v) in facts {
        let _ = write!(out, "<tr><th>{}</th><td><code>{}</code></td></tr>", escape(k), escape(&v));
    }
    out.push_str(r#"</table><h3>Input files</h3><table id="input-files"><tr><th>file</th><th class="n">rows</th><th class="n">size</th></tr>"#);
    for f in fp.input.iter().take(20) {
        let _ = write!(out, r#"<tr><td><code>{}</code></td><td class="n">{}</td><td class="n">{}</td></tr>"#, escape(&f.path), thousands(f.rows), bytes(f.size));
    }
    if fp.input.len() > 20 {
        let _ = write!(out, r#"<tr><td colspan=3>and {} more</td></tr>"#, fp.input.len() - 20);
    }
    out.push_str("</table></div><div>");
    if !fp.generation.is_null() {
        out.push_str(r#"<h3>Generation parameters</h3><table id="generation">"#);
        settings_rows(out, &fp.generation);
        out.push_str("</table>");
    }
    out.push_str(r#"<h3>Prompts</h3><table id="prompt">"#);
    settings_rows(out, &fp.prompt);
    out.push_str("</table></div></div></section>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Fingerprint, PlannedFile, Plan, Unit};
    use crate::report::{RowStats, UnitFigures};

    fn data(units: Vec<UnitFigures>, planned: u32) -> ReportData {
        let fingerprint = Fingerprint {
            format_version: 1,
            model_sha256: "ab".repeat(32),
            prompt: serde_json::json!({"column": "prompt"}),
            generation: serde_json::json!({"max_new_tokens": 12, "temperature": 0.0}),
            input: vec![PlannedFile { path: "in/<x>.parquet".into(), size: 2048, e_tag: None, rows: planned as u64 * 10 }],
        };
        let plan = Plan {
            nightshift_version: "0.1.0".into(),
            fingerprint,
            unit_rows: 10,
            shards: 2,
            units: (0..planned).map(|id| Unit { id, file: 0, first_row: id as u64 * 10, rows: 10, shard: u32::from(id >= planned / 2), estimated_tokens: 100 }).collect(),
        };
        let mut rows = RowStats::default();
        for (i, _) in units.iter().enumerate() {
            rows.rows += 10;
            rows.succeeded += 9;
            rows.errored += 1;
            *rows.errors.entry("prompt_too_long".into()).or_default() += 1;
            *rows.finish_reasons.entry("length".into()).or_default() += 9;
            for j in 0..9 {
                rows.prompt_tokens.add(20 + j);
                rows.completion_tokens.add(12);
                rows.ttft_s.add(0.05 * (i + 1) as f64);
                rows.tpot_s.add(0.01);
                rows.e2e_s.add(0.2);
            }
        }
        ReportData {
            url: "s3://bucket/out".into(),
            generated_unix_s: 1_764_629_117.0,
            complete: units.len() == planned as usize,
            plan,
            damaged_units: vec![],
            job_name: Some("<script>alert(1)</script>.toml".into()),
            model: Some("model.gguf".into()),
            written_by: Some("0.1.0".into()),
            rows,
            units,
        }
    }

    fn unit(unit: u32, shard: u32, attempt: &str, job_s: f64, start: Option<f64>) -> UnitFigures {
        UnitFigures {
            unit,
            shard,
            attempt: attempt.into(),
            rows: 10,
            errored_rows: 1,
            prompt_tokens: 200,
            completion_tokens: 108,
            job_s,
            started_unix_s: start,
            model_load_s: 0.5,
            generation_s: job_s / 2.0,
            output_tokens_per_s: 50.0,
            engine: crate::report::EngineFigures { kv_cache_blocks: 64, kv_utilisation_peak: Some(0.5), kv_utilisation_mean: Some(0.25), ..Default::default() },
        }
    }

    #[test]
    fn a_report_shows_every_section_and_escapes_what_users_named() {
        let units = vec![unit(0, 0, "aaaaaaaa11", 1.0, Some(1000.0)), unit(1, 0, "aaaaaaaa11", 2.0, Some(1000.0)), unit(2, 1, "bbbbbbbb22", 1.5, Some(1000.4)), unit(3, 1, "cccccccc33", 1.0, Some(1010.0))];
        let html = render(&data(units, 4));
        assert!(html.starts_with("<!doctype html>") && html.ends_with("</html>"));
        for id in ["summary", "outcome", "throughput", "lengths", "latency", "memory", "slowest", "job"] {
            assert!(html.contains(&format!(r#"id="{id}""#)), "section {id}");
        }
        for chart in ["outcome", "finish-reasons", "timeline", "throughput", "prompt-lengths", "output-lengths", "ttft", "tpot"] {
            assert!(html.contains(&format!(r#"data-chart="{chart}""#)), "chart {chart}");
        }
        assert!(!html.contains("<script") && html.contains("&lt;script&gt;alert(1)&lt;/script&gt;.toml"));
        assert!(html.contains("in/&lt;x&gt;.parquet"));
        assert!(!html.contains("NaN") && !html.contains("inf<") && !html.contains("http"), "no NaN, nothing fetched");
        assert!(html.contains(r#"data-state="complete""#));
        // Three attempts: three lanes and three lines.
        assert_eq!(html.matches(r#"class="mark line""#).count(), 3);
        assert_eq!(html.matches(r#"class="commit""#).count(), 4);
        assert!(html.contains("shard 1 · cccccccc"), "an attempt is named by its shard and id");
    }

    #[test]
    fn an_incomplete_output_names_its_missing_units_and_an_empty_one_renders() {
        let html = render(&data(vec![unit(0, 0, "aaaaaaaa", 1.0, None)], 4));
        assert!(html.contains(r#"data-state="incomplete""#) && html.contains("1 of 4 units committed"));
        assert!(html.contains("shard 0: 1 unit(s) (u000001)") && html.contains("shard 1: 2 unit(s) (u000002, u000003)"), "{html}");
        assert!(html.contains("attempts end to end"), "no start times: a relative axis");
        let empty = render(&data(vec![], 2));
        assert!(empty.contains("No unit is committed yet") && !empty.contains("NaN"));
    }

    #[test]
    fn a_job_of_many_shards_shows_its_reruns_and_one_line_for_all() {
        // 50 shards of one unit each; shards 0 to 9 were killed after their unit and rerun (a unit of their own
        // in the rerun, for the test), so 60 attempts.
        let mut units = Vec::new();
        for shard in 0..50u32 {
            units.push(unit(shard, shard, &format!("first{shard:03}"), 2.0, Some(1000.0)));
            if shard < 10 {
                units.push(unit(100 + shard, shard, &format!("rerun{shard:03}"), 1.0, Some(1010.0)));
            }
        }
        let mut report = data(units, 0);
        report.plan.shards = 50;
        let html = render(&report);
        assert_eq!(html.matches("class=\"mark startup\"").count(), 40, "40 lanes of 60 attempts");
        assert!(html.contains("40 of 60 attempts are shown"));
        for shard in 0..10 {
            assert!(html.contains(&format!("shard {shard} · rerun{shard:03}")), "shard {shard}: its rerun has a lane");
        }
        assert_eq!(html.matches(r#"class="mark line""#).count(), 1);
        assert!(html.contains("all 60 attempts"));
        // The summed line's area is every attempt's generated tokens.
        let attempts = report.attempts();
        let total: f64 = attempts.iter().map(|a| a.completion_tokens as f64).sum();
        let (offsets, _) = offsets(&attempts);
        let area: f64 = (0..60).map(|b| attempts.iter().zip(&offsets).map(|(a, o)| a.tokens_between(b as f64 * 0.2 - o, if b == 59 { f64::INFINITY } else { (b + 1) as f64 * 0.2 - o }, true)).sum::<f64>()).sum();
        assert!((area - total).abs() < 1e-6, "{area} vs {total}");
    }

    #[test]
    fn utc_dates_are_the_calendar_s() {
        assert_eq!(utc(0.0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400.0), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_764_629_117.0), "2025-12-01 22:45:17 UTC");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(12), "12");
    }
}
