//! `nightshift bench generate`: the decoder engine on a synthetic offline workload, reporting what vLLM's and
//! SGLang's offline throughput benchmarks report (requests/s, total and output tokens/s) plus time to first token,
//! time per output token and peak memory.
//!
//! Every request is ready at the start, as in an offline batch job. Prompts are support-ticket English wrapped in
//! the model's chat template, with lengths drawn uniformly from a range; each row's output length is drawn too.
//! In the `fixed` workload the end-of-sequence token and stop strings are ignored, so every row generates exactly
//! its drawn length (the figures then depend only on the engine); in the `natural` workload rows stop as a job's
//! would, at the drawn length at most.

use std::path::PathBuf;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::WORDS;
use crate::app::drive::{drive, Ready};
use crate::engine::parallel::Decoder;
use crate::engine::{self, BatchConfig, DecoderSetup, Engine, EngineError, Request, StopRules};
use crate::error::Error;
use crate::job::{ChatTemplateChoice, GenerationParams, InputSpec, ParameterColumns, PromptColumn, Truncate};
use crate::metrics::percentile;
use crate::outcome::{Completion, Outcome};
use crate::row::{Prompt, RowParams, RowTag};
use crate::tokenize::Preprocessor;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// End-of-sequence and stop strings ignored: every row generates its drawn length.
    Fixed,
    /// Rows stop at the model's end of turn, at their drawn length at most.
    Natural,
}

#[derive(Clone, Debug)]
pub struct GenerateBenchOptions {
    pub model: PathBuf,
    pub workload: Workload,
    pub rows: usize,
    /// Prompt lengths, in tokens with the chat template, drawn uniformly from this range.
    pub min_prompt: usize,
    pub max_prompt: usize,
    /// Output lengths (`max_new_tokens` of each row), drawn uniformly from this range.
    pub min_new: usize,
    pub max_new: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    pub kv_cache_memory: crate::job::MemoryBudget,
    pub temperature: f32,
    pub seed: u64,
    /// Where to write the workload (one JSON object per row: `prompt` token ids, `max_new`, `ignore_eos`), so a
    /// peer can be run on exactly the same requests.
    pub save_workload: Option<PathBuf>,
    pub device: crate::job::DeviceChoice,
    /// Rows run (8 new tokens each) before the timed run, on the same engine configuration: a GPU loads its
    /// kernels and sets up cuBLAS on first use.
    pub warmup_rows: usize,
    pub cpu_weights: crate::job::CpuWeights,
    pub kv_cache_dtype: crate::job::KvCacheDtype,
    /// Tokens of an instruction every prompt starts with (before its own text, whose length the prompt range
    /// draws); 0 for none.
    pub shared_prefix: usize,
    pub prefix_cache: bool,
    pub attention: crate::job::AttentionChoice,
    pub dtype: crate::job::ComputeDtype,
    pub cpu_kernels: crate::job::CpuKernels,
    /// Tensor-parallel ranks (`--tensor-parallel`; 1: the whole model on one).
    pub tensor_parallel: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateBenchReport {
    pub model: String,
    pub workload: Workload,
    pub rows: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub seconds: f64,
    pub requests_per_s: f64,
    pub total_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Prompt tokens over the seconds of steps that prefilled, and output tokens over decode-only steps.
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub steps: u64,
    /// Per step, the model's forward pass, and everything else of the run: the engine's scheduling, the step's
    /// inputs, sampling, stop checks and bookkeeping, and the driver's admission and collection (the run's
    /// seconds less the forward passes', over the steps).
    pub forward_ms_per_step: f64,
    pub host_ms_per_step: f64,
    /// A mixture of experts' share of the forward passes spent routing, gathering and combining (its experts'
    /// networks excluded); `None` for dense models.
    pub routing_share: Option<f64>,
    /// Its busiest expert's tokens over the mean expert's.
    pub expert_load_max_over_mean: Option<f64>,
    /// From a row's entering the engine's queue (up to `max_seqs` rows wait beside the running ones) to its first token.
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub tpot_p50_s: f64,
    pub tpot_p90_s: f64,
    pub tpot_p99_s: f64,
    pub peak_running: usize,
    pub peak_kv_cache_bytes: usize,
    /// The KV cache budget in blocks of 16 positions, and the most in use at once.
    pub kv_blocks: usize,
    pub peak_kv_blocks: usize,
    pub preemptions: u64,
    /// Whether the prefix cache was on, the prompt tokens it served and the prompt tokens computed.
    pub prefix_cache: bool,
    pub cached_prompt_tokens: u64,
    pub computed_prompt_tokens: u64,
    /// Useful tokens over tokens computed (recomputation after preemption is the waste).
    pub packing_efficiency: f64,
    pub weights_bytes: usize,
    pub peak_rss_bytes: u64,
    /// Where and how it ran: `cpu` or `cuda:N`, the activations' dtype, whether on the paged path.
    pub device: String,
    pub dtype: String,
    /// How the weights were computed ([`Layout::name`](crate::engine::Layout::name)).
    pub weights_layout: String,
    /// The KV cache's dtype ([`Backend::kv_dtype`]).
    pub kv_cache_dtype: String,
    pub paged: bool,
    /// Which attention ran: `host` (the CPU's backend), `host-amx` (its prefills on the tile unit), `paged-tiled`, `paged-decode` or `paged-flash` (the paged backend's kernels).
    pub attention: String,
    /// A GPU's memory in use at the end (weights, the KV pool, the allocator's cache), from the driver.
    pub device_memory_in_use_bytes: Option<u64>,
}

/// Prompt and output lengths drawn from the ranges, and the prompts' text: a fixed instruction (with
/// `--shared-prefix`, a long one of ticket words, the same in every row) and ticket words.
fn workload(options: &GenerateBenchOptions, pre: &Preprocessor, limit: usize) -> Result<Vec<(Vec<u32>, u32)>, Error> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(options.seed);
    let mut instruction = String::new();
    let render = |instruction: &str, words: &[&str]| -> Result<Vec<u32>, Error> {
        let text = format!("{instruction}Summarise this support ticket in two sentences.\n\n{}", words.join(" "));
        pre.render(&Prompt::Text(text)).and_then(|t| pre.encode(&t)).map_err(|e| Error::Internal(format!("bench prompt: {}", e.message)))
    };
    // The template's own tokens, and the tokenizer's rate on these words.
    let sample: Vec<&str> = (0..2000).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
    let per_word = (render("", &sample)?.len() - render("", &[])?.len()) as f64 / 2000.0;
    if options.shared_prefix > 0 {
        let words = (options.shared_prefix as f64 / per_word).round().max(1.0) as usize;
        let words: Vec<&str> = (0..words).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
        instruction = format!("Read these guidelines first. {}\n\n", words.join(" "));
    }
    let render = |words: &[&str]| render(&instruction, words);
    let overhead = render(&[])?.len();
    let mut rows = Vec::with_capacity(options.rows);
    for _ in 0..options.rows {
        let new = rng.random_range(options.min_new..=options.max_new);
        let own = rng.random_range(options.min_prompt..=options.max_prompt);
        // With a shared instruction, the range is the row's own text; without, the whole prompt.
        let target = if options.shared_prefix > 0 { overhead + own } else { own };
        let target = target.min(limit.saturating_sub(new)).max(overhead + 1);
        let words = ((target - overhead) as f64 / per_word).round().max(1.0) as usize;
        let words: Vec<&str> = (0..words).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
        let mut tokens = render(&words)?;
        // The word rate is an average, so a prompt lands near its target, not on it; it always fits the context.
        tokens.truncate(limit.saturating_sub(new).max(1));
        rows.push((tokens, new as u32));
    }
    Ok(rows)
}

pub fn generate(options: &GenerateBenchOptions) -> Result<GenerateBenchReport, Error> {
    if options.rows == 0 || options.min_prompt == 0 || options.min_prompt > options.max_prompt || options.min_new == 0 || options.min_new > options.max_new {
        return Err(Error::Usage("bench generate needs --rows >= 1, 1 <= --min-prompt <= --max-prompt and 1 <= --min-new <= --max-new".into()));
    }
    let device = engine::select_device(&options.device)?;
    if device.is_cpu() {
        crate::engine::kernels::Level::choose(options.cpu_kernels);
    }
    let (decoder, info) = Decoder::load(&options.model, &device, options.cpu_weights, options.dtype, options.tensor_parallel)?;
    let model = decoder.first();
    let context = model.config.context_length;
    let input = InputSpec {
        url: String::new(),
        id_column: None,
        prompt: PromptColumn::Text("prompt".into()),
        system_prompt: None,
        truncate: Truncate::None,
        parameters: ParameterColumns::default(),
        completion_column: None,
        openai_batch: None,
    };
    let pre = Preprocessor::new(&info.vocab, &ChatTemplateChoice::Auto, &input, context, options.max_new as u32)?;
    let rows = workload(options, &pre, context)?;
    if let Some(path) = &options.save_workload {
        let lines: Vec<String> = rows
            .iter()
            .map(|(prompt, new)| {
                serde_json::json!({"prompt": prompt, "max_new": new, "ignore_eos": options.workload == Workload::Fixed}).to_string()
            })
            .collect();
        std::fs::write(path, lines.join("\n") + "\n").map_err(|e| Error::Internal(format!("cannot write {}: {e}", path.display())))?;
    }
    let params = GenerationParams {
        max_new_tokens: options.max_new as u32,
        temperature: options.temperature,
        seed: options.seed,
        ignore_eos: options.workload == Workload::Fixed,
        ..GenerationParams::default()
    };
    let (weights_bytes, model_layout) = (decoder.weight_bytes(), model.weights_name());
    let plan = engine::AttentionPlan::choose(model, options.attention).map_err(|m| Error::Usage(format!("--attention {m}")))?;
    let (backend, attention) = (plan.backend, plan.name());
    let kv_bytes = crate::engine::kv_cache_bytes(options.kv_cache_memory, &device);
    let kv_dtype = backend.kv_dtype(model, options.kv_cache_dtype).map_err(|m| Error::Usage(format!("--kv-cache-dtype: {m}")))?;
    let mut config = BatchConfig::new(options.max_seqs, options.max_batch_tokens, kv_bytes, decoder.block_bytes(backend, kv_dtype));
    config.prefix_cache = options.prefix_cache;
    config.window = crate::engine::attention::AttentionModel::attention_shape(model).window_of_every_layer();
    let (device_name, dtype) = (engine::device_name(&device), format!("{:?}", model.dtype()).to_lowercase());
    let setup = DecoderSetup { tokenizer: pre.tokenizer().clone(), params, stop: StopRules::new(&info.vocab), config, kv_dtype, attention: plan };
    let mut engine = decoder.engine(setup).map_err(Error::Engine)?;
    if options.warmup_rows > 0 {
        let warmup: Vec<(Vec<u32>, u32)> = rows.iter().take(options.warmup_rows).map(|(p, _)| (p.clone(), 8)).collect();
        run_rows(engine.as_mut(), &warmup)?;
        engine.reset_stats();
    }
    let started = Instant::now();
    let done = run_rows(engine.as_mut(), &rows)?;
    let seconds = started.elapsed().as_secs_f64();
    let stats = engine.stats().clone();
    let prompt_tokens: u64 = done.iter().map(|c| c.prompt_tokens as u64).sum();
    let output_tokens: u64 = done.iter().map(|c| c.completion_tokens() as u64).sum();
    let ttft: Vec<f64> = done.iter().map(|c| c.ttft_s).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|c| c.tpot_s).collect();
    let p = |v: &[f64], q: f64| percentile(v, q).unwrap_or(0.0);
    let per_step = |s: f64| 1000.0 * s / stats.steps.max(1) as f64;
    Ok(GenerateBenchReport {
        model: options.model.display().to_string(),
        workload: options.workload,
        rows: done.len(),
        max_seqs: options.max_seqs,
        max_batch_tokens: options.max_batch_tokens,
        prompt_tokens,
        output_tokens,
        seconds,
        requests_per_s: done.len() as f64 / seconds,
        total_tokens_per_s: (prompt_tokens + output_tokens) as f64 / seconds,
        output_tokens_per_s: output_tokens as f64 / seconds,
        prefill_tokens_per_s: stats.prefill_tokens_per_s(),
        decode_tokens_per_s: stats.decode_tokens_per_s(),
        prefill_s: stats.prefill_s,
        decode_s: stats.decode_s,
        steps: stats.steps,
        forward_ms_per_step: per_step(stats.forward_s),
        host_ms_per_step: per_step((seconds - stats.forward_s).max(0.0)),
        routing_share: (!stats.expert_tokens.is_empty() && stats.forward_s > 0.0).then(|| stats.routing_s / stats.forward_s),
        expert_load_max_over_mean: stats.expert_load_max_over_mean(),
        ttft_p50_s: p(&ttft, 50.0),
        ttft_p90_s: p(&ttft, 90.0),
        ttft_p99_s: p(&ttft, 99.0),
        tpot_p50_s: p(&tpot, 50.0),
        tpot_p90_s: p(&tpot, 90.0),
        tpot_p99_s: p(&tpot, 99.0),
        peak_running: stats.peak_running,
        peak_kv_cache_bytes: stats.peak_kv_bytes,
        kv_blocks: stats.kv_blocks,
        peak_kv_blocks: stats.peak_kv_blocks,
        preemptions: stats.preemptions,
        prefix_cache: options.prefix_cache,
        cached_prompt_tokens: stats.cached_prompt_tokens,
        computed_prompt_tokens: stats.prefill_tokens,
        packing_efficiency: stats.packing_efficiency().unwrap_or(1.0),
        weights_bytes,
        peak_rss_bytes: crate::host::peak_rss_bytes().unwrap_or(0),
        device: device_name,
        dtype,
        weights_layout: model_layout.to_string(),
        kv_cache_dtype: kv_dtype.as_str().to_string(),
        paged: backend.is_paged(),
        attention: attention.to_string(),
        device_memory_in_use_bytes: crate::engine::device_memory_in_use(&device),
    })
}

/// Runs every row through the engine under the run's drive loop; the completions in finishing order. A row that
/// fails fails the benchmark.
fn run_rows(engine: &mut dyn Engine, rows: &[(Vec<u32>, u32)]) -> Result<Vec<Completion>, Error> {
    let requests = rows.iter().enumerate().map(|(i, (tokens, new))| Request {
        id: format!("bench-{i}"),
        tag: RowTag { unit: 0, offset: i as u32 },
        params: RowParams { max_new_tokens: Some(*new), ..Default::default() },
        tokens: tokens.clone(),
        completion: None,
        arrival: Instant::now(),
    });
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(rows.len());
    drive(engine, &mut Ready(requests), &mut outcomes, None).map_err(Error::Engine)?;
    outcomes
        .into_iter()
        .map(|o| match o {
            Outcome::Completed(c) => Ok(c),
            Outcome::Failed(f) => Err(Error::Engine(EngineError::Row { id: f.id, message: f.error.message })),
            Outcome::Embedded(e) => Err(Error::Engine(EngineError::Bug(format!("row `{}` was embedded by a decoder", e.id)))),
            Outcome::Reused(r) => Err(Error::Engine(EngineError::Bug(format!("row `{}` was reused in a benchmark", r.id)))),
        })
        .collect()
}
