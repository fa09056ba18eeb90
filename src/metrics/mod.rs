//! Plain structs filled as the job runs, and the figures users compare (requests/s, tokens/s, TTFT and latency
//! percentiles, peak memory). Written as a one-row Parquet file by the sink.

use crate::engine::EngineStats;
use crate::outcome::Completion;

/// Per-row timings collected as rows finish, summarised at the end.
#[derive(Clone, Debug, Default)]
pub struct Collector {
    pub rows: u64,
    pub succeeded: u64,
    pub errored: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    ttft_s: Vec<f64>,
    e2e_s: Vec<f64>,
    tpot_s: Vec<f64>,
}

impl Collector {
    pub fn completed(&mut self, c: &Completion) {
        self.rows += 1;
        self.succeeded += 1;
        // A scoring row's completion is read, not generated: its tokens count as prompt tokens.
        if c.choices[0].finish_reason == crate::row::FinishReason::Scored {
            self.prompt_tokens += (c.prompt_tokens + c.completion_tokens()) as u64;
        } else {
            self.prompt_tokens += c.prompt_tokens as u64;
            self.completion_tokens += c.completion_tokens() as u64;
        }
        self.ttft_s.push(c.ttft_s);
        self.e2e_s.push(c.e2e_s);
        self.tpot_s.extend(c.tpot_s);
    }

    /// A row embedded: its tokens count as prompt tokens; it has no time to first token.
    pub fn embedded(&mut self, prompt_tokens: u32, e2e_s: f64) {
        self.rows += 1;
        self.succeeded += 1;
        self.prompt_tokens += prompt_tokens as u64;
        self.e2e_s.push(e2e_s);
    }

    pub fn errored(&mut self) {
        self.rows += 1;
        self.errored += 1;
    }
}

/// The nearest-rank percentile (`p` in 0..=100) of unsorted samples; `None` when there are none.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

/// The job's summary: one row of the metrics file. Field names carry their unit.
#[derive(Clone, Debug, Default)]
pub struct JobMetrics {
    pub rows: u64,
    pub succeeded_rows: u64,
    pub errored_rows: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// From the engine's start to the last result.
    pub generation_s: f64,
    /// From the process start to the results being written.
    pub job_s: f64,
    pub model_load_s: f64,
    pub requests_per_s: f64,
    pub total_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub e2e_p50_s: Option<f64>,
    pub e2e_p90_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    pub tpot_p50_s: Option<f64>,
    pub tpot_p90_s: Option<f64>,
    pub engine_steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub max_running_seqs: u64,
    pub peak_kv_cache_bytes: u64,
    /// Seconds of steps that prefilled (decode tokens may ride along) and of decode-only steps.
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Useful tokens over tokens computed; `None` for engines that do not count them.
    pub packing_efficiency: Option<f64>,
    /// The KV cache budget in blocks of 16 positions, and the peak and mean share in use.
    pub kv_cache_blocks: u64,
    pub kv_utilisation_peak: Option<f64>,
    pub kv_utilisation_mean: Option<f64>,
    pub preemptions: u64,
    pub recomputed_tokens: u64,
    pub weights_bytes: u64,
    pub peak_rss_bytes: u64,
}

impl JobMetrics {
    pub fn summarise(c: &Collector, engine: &EngineStats, generation_s: f64) -> JobMetrics {
        let per_s = |x: f64| if generation_s > 0.0 { x / generation_s } else { 0.0 };
        JobMetrics {
            rows: c.rows,
            succeeded_rows: c.succeeded,
            errored_rows: c.errored,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            generation_s,
            requests_per_s: per_s(c.succeeded as f64),
            total_tokens_per_s: per_s((c.prompt_tokens + c.completion_tokens) as f64),
            output_tokens_per_s: per_s(c.completion_tokens as f64),
            ttft_p50_s: percentile(&c.ttft_s, 50.0),
            ttft_p90_s: percentile(&c.ttft_s, 90.0),
            ttft_p99_s: percentile(&c.ttft_s, 99.0),
            e2e_p50_s: percentile(&c.e2e_s, 50.0),
            e2e_p90_s: percentile(&c.e2e_s, 90.0),
            e2e_p99_s: percentile(&c.e2e_s, 99.0),
            tpot_p50_s: percentile(&c.tpot_s, 50.0),
            tpot_p90_s: percentile(&c.tpot_s, 90.0),
            engine_steps: engine.steps,
            prefill_tokens: engine.prefill_tokens,
            decode_tokens: engine.decode_tokens,
            max_running_seqs: engine.peak_running as u64,
            peak_kv_cache_bytes: engine.peak_kv_bytes as u64,
            prefill_s: engine.prefill_s,
            decode_s: engine.decode_s,
            packing_efficiency: engine.packing_efficiency(),
            kv_cache_blocks: engine.kv_blocks as u64,
            kv_utilisation_peak: engine.kv_utilisation().map(|u| u.0),
            kv_utilisation_mean: engine.kv_utilisation().map(|u| u.1),
            preemptions: engine.preemptions,
            recomputed_tokens: engine.recomputed_tokens,
            peak_rss_bytes: crate::host::peak_rss_bytes().unwrap_or(0),
            ..JobMetrics::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), Some(5.0));
        assert_eq!(percentile(&xs, 90.0), Some(9.0));
        assert_eq!(percentile(&xs, 99.0), Some(10.0));
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
