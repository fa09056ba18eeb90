//! The job report: one self-contained HTML page (inline CSS and SVG, no scripts, nothing fetched) that a person
//! reads the morning after: the job, its outcome, throughput over time per shard and attempt, length and latency
//! distributions, KV cache and memory, and the slowest units. Finalize writes it into every completed output as
//! `_report.html`; `nightshift report OUTPUT` renders it for any output, complete or not.
//!
//! This file holds what a report is made of and the histograms that summarise rows without keeping them (an
//! output may hold hundreds of millions); `sink::report` reads an output into a [`ReportData`], `html` renders it
//! and `svg` draws its charts.

mod html;
mod svg;

use std::collections::BTreeMap;

pub use html::render;

use crate::plan::Plan;

/// Everything a report shows, read from an output's plan, commit markers, metrics and result files.
#[derive(Clone, Debug)]
pub struct ReportData {
    pub url: String,
    /// When the report was made, seconds since the Unix epoch.
    pub generated_unix_s: f64,
    /// Every unit is committed with its files (and, for a finished output, `_SUCCESS` is written).
    pub complete: bool,
    pub plan: Plan,
    /// Units whose commit names a file that is missing: not counted as committed.
    pub damaged_units: Vec<u32>,
    /// From the committed files' metadata (the first unit's): job file, model file and nightshift version.
    pub job_name: Option<String>,
    pub model: Option<String>,
    pub written_by: Option<String>,
    pub rows: RowStats,
    /// The committed units' figures, in unit order.
    pub units: Vec<UnitFigures>,
}

impl ReportData {
    /// Uncommitted units per shard, in order: what a rerun still has to do.
    pub fn missing_units(&self) -> BTreeMap<u32, Vec<u32>> {
        let committed: std::collections::HashSet<u32> = self.units.iter().map(|u| u.unit).collect();
        let mut missing: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for unit in self.plan.units.iter().filter(|u| !committed.contains(&u.id)) {
            missing.entry(unit.shard).or_default().push(unit.id);
        }
        missing
    }

    /// The attempts (process starts) whose units are committed, in order of their start.
    pub fn attempts(&self) -> Vec<AttemptSummary> {
        let mut by_attempt: BTreeMap<&str, Vec<&UnitFigures>> = BTreeMap::new();
        for unit in &self.units {
            by_attempt.entry(unit.attempt.as_str()).or_default().push(unit);
        }
        let mut attempts: Vec<AttemptSummary> = by_attempt
            .into_iter()
            .map(|(attempt, mut units)| {
                units.sort_by(|a, b| a.job_s.total_cmp(&b.job_s));
                // The metrics files carry the attempt's running figures: the last commit's are the attempt's.
                let last = *units.last().expect("an attempt has units");
                let mut shards: Vec<u32> = units.iter().map(|u| u.shard).collect();
                shards.sort_unstable();
                shards.dedup();
                AttemptSummary {
                    attempt: attempt.to_string(),
                    shards,
                    started_unix_s: last.started_unix_s,
                    model_load_s: last.model_load_s,
                    last_commit_s: last.job_s,
                    completion_tokens: units.iter().map(|u| u.completion_tokens).sum(),
                    commits: units.iter().map(|u| Commit { at_s: u.job_s, generation_s: u.generation_s, prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens }).collect(),
                    engine: EngineFigures {
                        kv_utilisation_peak: units.iter().filter_map(|u| u.engine.kv_utilisation_peak).reduce(f64::max),
                        peak_rss_bytes: units.iter().map(|u| u.engine.peak_rss_bytes).max().unwrap_or(0),
                        ..last.engine.clone()
                    },
                }
            })
            .collect();
        attempts.sort_by(|a, b| {
            let start = |x: &AttemptSummary| x.started_unix_s.unwrap_or(f64::INFINITY);
            start(a).total_cmp(&start(b)).then_with(|| a.shards.cmp(&b.shards))
        });
        attempts
    }
}

/// What the engine of an attempt held and did, from the metrics files (the attempt's running figures).
#[derive(Clone, Debug, Default)]
pub struct EngineFigures {
    pub kv_cache_blocks: u64,
    pub kv_utilisation_peak: Option<f64>,
    pub kv_utilisation_mean: Option<f64>,
    pub preemptions: u64,
    pub recomputed_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub peak_rss_bytes: u64,
    pub weights_bytes: u64,
    pub weights_layout: String,
    pub kv_cache_dtype: String,
}

/// One committed unit's figures, from its marker and metrics file. Its engine figures (KV, preemptions, memory)
/// are the attempt's up to the unit's commit, as the metrics files hold them.
#[derive(Clone, Debug)]
pub struct UnitFigures {
    pub unit: u32,
    pub shard: u32,
    pub attempt: String,
    pub rows: u64,
    pub errored_rows: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Seconds from the attempt's start to the unit's commit.
    pub job_s: f64,
    /// When the attempt started (absent in metrics files written before it was recorded).
    pub started_unix_s: Option<f64>,
    pub model_load_s: f64,
    pub generation_s: f64,
    pub output_tokens_per_s: f64,
    pub engine: EngineFigures,
}

/// One attempt (process start), summarised over its committed units.
#[derive(Clone, Debug)]
pub struct AttemptSummary {
    pub attempt: String,
    pub shards: Vec<u32>,
    pub started_unix_s: Option<f64>,
    pub model_load_s: f64,
    /// Seconds from the start to the attempt's last commit.
    pub last_commit_s: f64,
    pub completion_tokens: u64,
    /// Its committed units, in commit order.
    pub commits: Vec<Commit>,
    pub engine: EngineFigures,
}

/// One unit's commit by an attempt.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Commit {
    /// Seconds from the attempt's start.
    pub at_s: f64,
    /// Seconds from the unit's first row ready to its last result: the window its tokens were made in.
    pub generation_s: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl AttemptSummary {
    /// The tokens (generated ones, or all when `generated` is false) the attempt made between `lo` and `hi`
    /// seconds from its start: each unit's tokens spread evenly over its generation window (its first row ready to
    /// its commit); a unit with no window counts at its commit.
    pub fn tokens_between(&self, lo: f64, hi: f64, generated: bool) -> f64 {
        self.commits
            .iter()
            .map(|c| {
                let n = if generated { c.completion_tokens } else { c.prompt_tokens + c.completion_tokens } as f64;
                let (start, end) = (c.at_s - c.generation_s.max(0.0), c.at_s);
                if end - start <= 0.0 {
                    return if lo <= end && end < hi { n } else { 0.0 };
                }
                n * (end.min(hi) - start.max(lo)).max(0.0) / (end - start)
            })
            .sum()
    }

    /// Tokens per second over time, in `buckets` equal steps from `from` to the last commit (seconds from the
    /// attempt's start), from [`tokens_between`](Self::tokens_between): the units' rates summed where their windows
    /// overlap (units run concurrently). Tokens made before `from` count in the first step, so the steps' areas add
    /// up to the attempt's tokens.
    pub fn rate_over_time(&self, from: f64, buckets: usize, generated: bool) -> Vec<(f64, f64, f64)> {
        let to = self.last_commit_s;
        if buckets == 0 || to <= from {
            return Vec::new();
        }
        let width = (to - from) / buckets as f64;
        (0..buckets)
            .map(|b| {
                let (lo, hi) = (from + b as f64 * width, from + (b + 1) as f64 * width);
                // The first step takes what came before `from`; the last, what came at `to` itself.
                let (lo_in, hi_in) = (if b == 0 { f64::NEG_INFINITY } else { lo }, if b + 1 == buckets { f64::INFINITY } else { hi });
                (lo, hi, self.tokens_between(lo_in, hi_in, generated) / width)
            })
            .collect()
    }
}

/// What the committed result rows hold, summarised: counts by outcome, and distributions of succeeded rows.
#[derive(Clone, Debug, Default)]
pub struct RowStats {
    pub rows: u64,
    pub succeeded: u64,
    pub errored: u64,
    /// Succeeded rows copied from a reuse source, and copied from an identical request of their run.
    pub reused: u64,
    pub deduplicated: u64,
    /// Errored rows by error code.
    pub errors: BTreeMap<String, u64>,
    /// Succeeded rows by (first choice's) finish reason.
    pub finish_reasons: BTreeMap<String, u64>,
    pub prompt_tokens: Lengths,
    pub completion_tokens: Lengths,
    /// Prompt tokens the prefix cache served, over all succeeded rows.
    pub cached_tokens: u64,
    pub ttft_s: LogHistogram,
    pub tpot_s: LogHistogram,
    pub e2e_s: LogHistogram,
}

impl RowStats {
    pub fn merge(&mut self, other: RowStats) {
        self.rows += other.rows;
        self.succeeded += other.succeeded;
        self.errored += other.errored;
        self.reused += other.reused;
        self.deduplicated += other.deduplicated;
        for (code, n) in other.errors {
            *self.errors.entry(code).or_default() += n;
        }
        for (reason, n) in other.finish_reasons {
            *self.finish_reasons.entry(reason).or_default() += n;
        }
        self.prompt_tokens.merge(&other.prompt_tokens);
        self.completion_tokens.merge(&other.completion_tokens);
        self.cached_tokens += other.cached_tokens;
        self.ttft_s.merge(&other.ttft_s);
        self.tpot_s.merge(&other.tpot_s);
        self.e2e_s.merge(&other.e2e_s);
    }
}

/// Exact counts of token lengths (there are at most as many distinct lengths as the model's context).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Lengths {
    counts: BTreeMap<u32, u64>,
}

impl Lengths {
    pub fn add(&mut self, length: u32) {
        *self.counts.entry(length).or_default() += 1;
    }

    pub fn merge(&mut self, other: &Lengths) {
        for (&length, &n) in &other.counts {
            *self.counts.entry(length).or_default() += n;
        }
    }

    pub fn count(&self) -> u64 {
        self.counts.values().sum()
    }

    pub fn sum(&self) -> u64 {
        self.counts.iter().map(|(&l, &n)| l as u64 * n).sum()
    }

    pub fn max(&self) -> Option<u32> {
        self.counts.keys().next_back().copied()
    }

    /// The nearest-rank percentile (`p` in 0..=100), as `metrics::percentile` computes it.
    pub fn percentile(&self, p: f64) -> Option<u32> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((p / 100.0) * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (&length, &n) in &self.counts {
            seen += n;
            if seen >= rank {
                return Some(length);
            }
        }
        self.max()
    }

    /// About `bins` equal-width bins from 0 to the longest length, as (low, high, count) with `low <= length <
    /// high`; empty when there are no lengths.
    pub fn bins(&self, bins: u32) -> Vec<(f64, f64, u64)> {
        let Some(max) = self.max() else { return Vec::new() };
        let width = (max / bins.max(1) + 1).max(1);
        let mut out: Vec<(f64, f64, u64)> = (0..=max / width).map(|i| ((i * width) as f64, ((i + 1) * width) as f64, 0)).collect();
        for (&length, &n) in &self.counts {
            out[(length / width) as usize].2 += n;
        }
        out
    }
}

/// Seconds in logarithmic bins, [`PER_DECADE`](LogHistogram::PER_DECADE) to a decade from 10 µs to 100,000 s: a
/// percentile read off it is within 3 % of the exact one, in constant memory however many rows there are.
#[derive(Clone, Debug, PartialEq)]
pub struct LogHistogram {
    counts: Vec<u64>,
    /// Samples at or below the first bin's low edge (zero durations included).
    under: u64,
    over: u64,
    min: f64,
    max: f64,
}

impl Default for LogHistogram {
    fn default() -> Self {
        LogHistogram { counts: vec![0; (LogHistogram::DECADES * LogHistogram::PER_DECADE) as usize], under: 0, over: 0, min: f64::INFINITY, max: 0.0 }
    }
}

impl LogHistogram {
    const PER_DECADE: i32 = 40;
    const LOW_EXP: i32 = -5;
    const DECADES: i32 = 10;

    fn edge(index: i32) -> f64 {
        10f64.powf(Self::LOW_EXP as f64 + index as f64 / Self::PER_DECADE as f64)
    }

    pub fn add(&mut self, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.min = self.min.min(seconds);
        self.max = self.max.max(seconds);
        if seconds <= Self::edge(0) {
            self.under += 1;
            return;
        }
        let index = ((seconds.log10() - Self::LOW_EXP as f64) * Self::PER_DECADE as f64).floor() as i64;
        match usize::try_from(index) {
            Ok(i) if i < self.counts.len() => self.counts[i] += 1,
            _ => self.over += 1,
        }
    }

    pub fn merge(&mut self, other: &LogHistogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.under += other.under;
        self.over += other.over;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.under + self.over + self.counts.iter().sum::<u64>()
    }

    /// The nearest-rank percentile, as the geometric middle of its bin (clamped to the samples' range).
    pub fn percentile(&self, p: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((p / 100.0) * total as f64).ceil().max(1.0) as u64;
        if rank <= self.under {
            return Some(self.min);
        }
        let mut seen = self.under;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let middle = (Self::edge(i as i32) * Self::edge(i as i32 + 1)).sqrt();
                return Some(middle.clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    /// The occupied range in about `bins` display bins (low, high, count), equal in log space; samples under the
    /// lowest edge count in the first bin, over the highest in the last.
    pub fn bins(&self, bins: usize) -> Vec<(f64, f64, u64)> {
        if self.count() == 0 {
            return Vec::new();
        }
        let first = self.counts.iter().position(|&n| n > 0).unwrap_or(0);
        let last = self.counts.iter().rposition(|&n| n > 0).unwrap_or(first);
        let (first, last) = (if self.under > 0 { 0 } else { first }, if self.over > 0 { self.counts.len() - 1 } else { last });
        let span = last - first + 1;
        let group = span.div_ceil(bins.max(1)).max(1);
        let mut out = Vec::new();
        let mut i = first;
        while i <= last {
            let end = (i + group).min(last + 1);
            let mut n: u64 = self.counts[i..end].iter().sum();
            if i == first {
                n += self.under;
            }
            if end == last + 1 {
                n += self.over;
            }
            out.push((Self::edge(i as i32), Self::edge(end as i32), n));
            i = end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_percentiles_are_exact_and_bins_cover_every_length() {
        let mut lengths = Lengths::default();
        for l in 1..=100 {
            lengths.add(l);
        }
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        for p in [0.0, 50.0, 90.0, 99.0, 100.0] {
            assert_eq!(lengths.percentile(p).map(f64::from), crate::metrics::percentile(&samples, p), "p{p}");
        }
        let bins = lengths.bins(10);
        assert_eq!(bins.iter().map(|b| b.2).sum::<u64>(), 100);
        assert!(bins.iter().all(|b| b.0 < b.1) && bins.last().unwrap().1 > 100.0, "{bins:?}");
        assert_eq!((lengths.count(), lengths.sum(), lengths.max()), (100, 5050, Some(100)));
        assert!(Lengths::default().bins(10).is_empty() && Lengths::default().percentile(50.0).is_none());
    }

    #[test]
    fn log_histogram_percentiles_are_within_three_percent() {
        // Durations over six decades, uneven: the histogram's percentiles against the exact ones.
        let samples: Vec<f64> = (0..5000).map(|i| 1e-4 * 10f64.powf(6.0 * ((i * 7919) % 5000) as f64 / 5000.0)).collect();
        let mut h = LogHistogram::default();
        samples.iter().for_each(|&s| h.add(s));
        assert_eq!(h.count(), 5000);
        for p in [1.0, 50.0, 90.0, 99.0, 100.0] {
            let exact = crate::metrics::percentile(&samples, p).unwrap();
            let approx = h.percentile(p).unwrap();
            assert!((approx / exact - 1.0).abs() < 0.03, "p{p}: {approx} vs {exact}");
        }
        let bins = h.bins(30);
        assert!(bins.len() <= 30 && bins.len() >= 20, "{}", bins.len());
        assert_eq!(bins.iter().map(|b| b.2).sum::<u64>(), 5000);
    }

    #[test]
    fn the_rate_over_time_spreads_each_units_tokens_over_its_window_and_keeps_their_sum() {
        let commit = |at_s, generation_s, completion_tokens| Commit { at_s, generation_s, prompt_tokens: 10, completion_tokens };
        let attempt = AttemptSummary {
            attempt: "a".into(),
            shards: vec![0],
            started_unix_s: None,
            model_load_s: 1.0,
            last_commit_s: 5.0,
            completion_tokens: 700,
            // Two units made together over [1, 3] (100 tokens/s each), one alone over [3, 5], and one committed with no
            // window, whose 100 tokens land in the last step.
            commits: vec![commit(3.0, 2.0, 200), commit(3.0, 2.0, 200), commit(5.0, 2.0, 200), commit(5.0, 0.0, 100)],
            engine: EngineFigures::default(),
        };
        let steps = attempt.rate_over_time(1.0, 4, true);
        assert_eq!(steps.iter().map(|s| s.2).collect::<Vec<_>>(), vec![200.0, 200.0, 100.0, 200.0]);
        assert_eq!(steps.first().unwrap().0, 1.0);
        assert_eq!(steps.last().unwrap().1, 5.0);
        let area: f64 = attempt.rate_over_time(1.0, 7, false).iter().map(|(a, b, r)| (b - a) * r).sum();
        assert!((area - 740.0).abs() < 1e-9, "{area}");
        assert!(attempt.rate_over_time(5.0, 4, true).is_empty());
    }

    #[test]
    fn log_histogram_keeps_zero_huge_and_merged_samples() {
        let mut a = LogHistogram::default();
        a.add(0.0);
        a.add(1e9);
        a.add(f64::NAN);
        let mut b = LogHistogram::default();
        b.add(0.5);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.percentile(0.0), Some(0.0));
        assert_eq!(a.percentile(100.0), Some(1e9));
        assert!((a.percentile(50.0).unwrap() / 0.5 - 1.0).abs() < 0.03);
        assert_eq!(a.bins(10).iter().map(|b| b.2).sum::<u64>(), 3);
        assert!(LogHistogram::default().percentile(50.0).is_none() && LogHistogram::default().bins(10).is_empty());
    }
}
