//! Plain structs filled as the job runs, and the figures users compare (requests/s, tokens/s, TTFT and latency
//! percentiles, peak memory). Written as a one-row Parquet file by the sink; [`prometheus`] publishes a run's
//! progress for monitoring.

use crate::engine::EngineStats;
use crate::outcome::Completion;

#[macro_use]
mod columns;
pub mod prometheus;

pub use columns::{metrics_columns, MetricField, MetricType, MetricValue, MetricsColumn, MetricsRow};

/// Per-row timings collected as rows finish, summarised at the end.
#[derive(Clone, Debug, Default)]
pub struct Collector {
    pub rows: u64,
    pub succeeded: u64,
    pub errored: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Succeeded rows copied from a reuse source, and copied from an identical request of this run; the other
    /// succeeded rows were computed.
    pub reused: u64,
    pub deduplicated: u64,
    ttft_s: Vec<f64>,
    e2e_s: Vec<f64>,
    tpot_s: Vec<f64>,
}

impl Collector {
    pub fn completed(&mut self, c: &Completion) {
        self.rows += 1;
        self.succeeded += 1;
        // A copy of another row's computation: its tokens and timings are that row's, counted once.
        if c.duplicate_of.is_some() {
            self.deduplicated += 1;
            return;
        }
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
    pub fn embedded(&mut self, prompt_tokens: u32, e2e_s: f64, duplicate: bool) {
        self.rows += 1;
        self.succeeded += 1;
        if duplicate {
            self.deduplicated += 1;
            return;
        }
        self.prompt_tokens += prompt_tokens as u64;
        self.e2e_s.push(e2e_s);
    }

    /// A row copied from a reuse source: this run computed nothing for it.
    pub fn reused(&mut self) {
        self.rows += 1;
        self.succeeded += 1;
        self.reused += 1;
    }

    /// Succeeded rows this run computed.
    pub fn computed(&self) -> u64 {
        self.succeeded - self.reused - self.deduplicated
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

job_metrics! {
    /// The job's summary: one row of the metrics file (a unit's figures; at the end, the run's). Field names carry
    /// their unit. Each field is a column of the metrics files, in this order after `unit` and `attempt`, and its
    /// doc comment is the column's description in `schemas/metrics.json`, which a test in `sink` checks.
    #[derive(Clone, Debug, Default)]
    pub struct JobMetrics {
        /// Result rows of the unit (equals the unit's input rows).
        pub rows: u64,
        /// Rows with status succeeded.
        pub succeeded_rows: u64,
        /// Rows with status errored.
        pub errored_rows: u64,
        /// Succeeded rows this run computed (not reused, not deduplicated).
        pub computed_rows: u64,
        /// Succeeded rows copied from a reuse source (`[reuse]`, `--reuse`) instead of computed.
        pub reused_rows: u64,
        /// Succeeded rows that shared the computation of an identical request of this run (`duplicate_of`).
        pub deduplicated_rows: u64,
        /// Prompt tokens of the succeeded rows this run computed.
        pub prompt_tokens: u64,
        /// Generated tokens of the succeeded rows this run computed.
        pub completion_tokens: u64,
        /// Seconds from the process start to this unit's commit.
        pub job_s: f64,
        /// When the attempt (process) started, in seconds since the Unix epoch (UTC); the unit was committed at
        /// started_unix_s + job_s.
        pub started_unix_s: f64,
        /// Seconds to hash and load the model.
        pub model_load_s: f64,
        /// Seconds from the unit's first row being ready for the engine to its last result.
        pub generation_s: f64,
        /// Succeeded rows this run computed, per second of generation.
        pub requests_per_s: f64,
        /// Prompt plus generated tokens per second of generation.
        pub total_tokens_per_s: f64,
        /// Generated tokens per second of generation.
        pub output_tokens_per_s: f64,
        /// Median time to first token (nearest rank); null without succeeded rows.
        pub ttft_p50_s: Option<f64>,
        /// 90th percentile time to first token.
        pub ttft_p90_s: Option<f64>,
        /// 99th percentile time to first token.
        pub ttft_p99_s: Option<f64>,
        /// Median end-to-end row latency.
        pub e2e_p50_s: Option<f64>,
        /// 90th percentile end-to-end row latency.
        pub e2e_p90_s: Option<f64>,
        /// 99th percentile end-to-end row latency.
        pub e2e_p99_s: Option<f64>,
        /// Median time per output token after the first.
        pub tpot_p50_s: Option<f64>,
        /// 90th percentile time per output token after the first.
        pub tpot_p90_s: Option<f64>,
        /// Forward passes run.
        pub engine_steps: u64,
        /// Prompt tokens run through the model.
        pub prefill_tokens: u64,
        /// Decode tokens run through the model.
        pub decode_tokens: u64,
        /// Most sequences in the engine at once.
        pub max_running_seqs: u64,
        /// Largest KV cache reservation at once.
        pub peak_kv_cache_bytes: u64,
        /// Seconds of engine steps that prefilled prompt tokens (running sequences decode in the same steps).
        pub prefill_s: f64,
        /// Seconds of decode-only engine steps.
        pub decode_s: f64,
        /// Useful tokens over tokens run through the model: prompt tokens prefilled again after a preemption are
        /// the waste (prefill is packed without padding). Null for embed and seq2seq jobs.
        pub packing_efficiency: Option<f64>,
        /// KV cache budget (runtime.kv_cache_memory) in blocks of 16 positions; 0 for embed and seq2seq jobs.
        pub kv_cache_blocks: u64,
        /// Most KV cache blocks in use at once over the budget.
        pub kv_utilisation_peak: Option<f64>,
        /// Mean over engine steps of the KV cache blocks in use, over the budget.
        pub kv_utilisation_mean: Option<f64>,
        /// Sequences preempted when the KV cache ran short (each is recomputed later; its output is unchanged).
        pub preemptions: u64,
        /// Tokens prefilled again for preempted sequences.
        pub recomputed_tokens: u64,
        /// Prompt tokens served from the prefix cache (runtime.prefix_cache) instead of computed; prefill_tokens
        /// counts only the computed ones.
        pub cached_prompt_tokens: u64,
        /// Cached prefix blocks dropped to make room for others.
        pub prefix_cache_evictions: u64,
        /// KV cache blocks running sequences gave back as every layer's sliding window passed them (models whose
        /// every layer slides: Mistral v0.1, Phi-3); 0 for other models.
        pub kv_blocks_released: u64,
        /// Bytes of model weights held in memory.
        pub weights_bytes: u64,
        /// How the weights were computed: "as-stored", or how a GGUF decoder's were requantized for the CPU
        /// (runtime.cpu_weights), e.g. "requantized to q4_k, output q6_k, padded".
        pub weights_layout: &'static str,
        /// How a decoder's KV cache held keys and values (runtime.kv_cache_dtype resolved): "f32", "f16" or
        /// "bf16"; "none" for embed jobs.
        pub kv_cache_dtype: &'static str,
        /// Ranks a decoder's layers were split over (runtime.tensor_parallel); 1 for a whole model and for embed
        /// and seq2seq jobs.
        pub tensor_parallel: u64,
        /// Peak resident memory of the process (VmHWM).
        pub peak_rss_bytes: u64,
        /// A mixture-of-experts model's tokens per expert, a JSON array indexed by expert (each index summed over
        /// the model's layers: a token counts once per layer); empty for dense models.
        pub expert_tokens: String,
        /// The busiest expert's tokens over the mean expert's (1 is perfectly balanced); null for dense models.
        pub expert_load_max_over_mean: Option<f64>,
        /// Seconds a mixture of experts spent routing, gathering rows and combining the experts' outputs (their
        /// networks excluded); 0 for dense models.
        pub routing_s: f64,
    }
}

impl JobMetrics {
    pub fn summarise(c: &Collector, engine: &EngineStats, generation_s: f64) -> JobMetrics {
        let per_s = |x: f64| if generation_s > 0.0 { x / generation_s } else { 0.0 };
        JobMetrics {
            rows: c.rows,
            succeeded_rows: c.succeeded,
            errored_rows: c.errored,
            computed_rows: c.computed(),
            reused_rows: c.reused,
            deduplicated_rows: c.deduplicated,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            generation_s,
            requests_per_s: per_s(c.computed() as f64),
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
            cached_prompt_tokens: engine.cached_prompt_tokens,
            prefix_cache_evictions: engine.prefix_evictions,
            kv_blocks_released: engine.released_kv_blocks,
            peak_rss_bytes: crate::host::peak_rss_bytes().unwrap_or(0),
            expert_tokens: match engine.expert_tokens.is_empty() {
                true => String::new(),
                false => format!("[{}]", engine.expert_tokens.iter().map(u64::to_string).collect::<Vec<_>>().join(",")),
            },
            expert_load_max_over_mean: engine.expert_load_max_over_mean(),
            routing_s: engine.routing_s,
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
