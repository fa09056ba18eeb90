//! The engine: the model, its KV cache, sampling and the batching loop. The only module that knows candle.
//!
//! [`Engine`] is the interface the rest of the job sees: admit requests while there is room, call
//! [`Engine::step`], collect the [`Completion`]s. [`BatchEngine`] implements it with continuous batching: every
//! step packs the prompts of newly admitted sequences (under a prefill token budget) together with one decode
//! token of every running sequence into a single forward pass, and a finished sequence's place is free for the
//! next request in the very next step.

pub mod constraint;
pub mod model;
pub mod sampling;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use tokenizers::Tokenizer;

use crate::job::{DeviceChoice, GenerationParams};
use crate::row::{ErrorCode, FinishReason, RowError, RowParams, RowTag};
use crate::schedule::{Scheduler, SeqId};
use crate::tokenize::TextStream;
pub use model::{KvCache, KV_BLOCK_TOKENS, Layout, Model, ModelConfig, ModelInfo, Segment, StepLogits};
use sampling::Rng;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open model file `{path}`")]
    Open { path: PathBuf, #[source] source: std::io::Error },
    #[error("`{path}` is not a valid GGUF model file: {message}")]
    Format { path: PathBuf, message: String },
    #[error("model architecture `{name}` is not supported (supported: {supported})")]
    Architecture { name: String, supported: &'static str },
    #[error("the model's metadata is invalid: {0}")]
    Metadata(String),
    #[error("model file `{path}` has sha256 {actual}, but the job expects {expected}")]
    Checksum { path: PathBuf, expected: String, actual: String },
    #[error("device `{0}` is not available: this nightshift was built without CUDA support")]
    NoCuda(String),
    /// The build has CUDA, but the device did not open (no driver, no such GPU, a stub library). `message` is
    /// candle's error or the text of a panic inside cudarc, which has no error type to keep as a source.
    #[error("CUDA device `{device}` cannot be opened: {message}")]
    Cuda { device: String, message: String },
}

#[derive(Debug, thiserror::Error)]
#[error("forward pass failed: {0}")]
pub struct EngineError(String);

impl EngineError {
    pub fn new(message: impl Into<String>) -> Self {
        EngineError(message.into())
    }
}

/// The device a job runs on. Without the `cuda` feature `auto` is the CPU and `cuda:N` an error. With it,
/// `cuda:N` must open, and `auto` is cuda:0 when it opens and otherwise the CPU: the job still runs, only slower,
/// and the log says which device was chosen and why.
pub fn select_device(choice: &DeviceChoice) -> Result<Device, ModelError> {
    #[cfg(not(feature = "cuda"))]
    match choice {
        DeviceChoice::Auto | DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda(n) => Err(ModelError::NoCuda(format!("cuda:{n}"))),
    }

    #[cfg(feature = "cuda")]
    {
        /// cudarc panics instead of returning an error in some cases (a driver library that is missing or lacks
        /// a symbol), so the panic is caught and becomes a [`ModelError::Cuda`]. The default hook still prints it.
        fn open_cuda(ordinal: usize) -> Result<Device, ModelError> {
            let error = |message: String| ModelError::Cuda { device: format!("cuda:{ordinal}"), message };
            match std::panic::catch_unwind(|| Device::new_cuda(ordinal)) {
                Ok(Ok(device)) => Ok(device),
                // candle appends a backtrace to its errors' text when RUST_BACKTRACE is set: the first line says it.
                Ok(Err(e)) => Err(error(e.to_string().lines().next().unwrap_or_default().to_string())),
                Err(panic) => {
                    let text = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
                    Err(error(format!("panicked: {}", text.as_deref().unwrap_or("(no message)"))))
                }
            }
        }

        match choice {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(*n),
            DeviceChoice::Auto => match open_cuda(0) {
                Ok(device) => {
                    tracing::info!(device = "cuda:0", "runtime.device = auto: running on cuda:0");
                    Ok(device)
                }
                Err(e) => {
                    tracing::info!(device = "cpu", reason = %e, "runtime.device = auto: running on the CPU");
                    Ok(Device::Cpu)
                }
            },
        }
    }
}

/// The KV cache budget in bytes: a size as given, or a fraction of the memory available now on the device the
/// cache lives on (host memory for the CPU, the GPU's free memory for CUDA; call it after the model has loaded,
/// so the weights are not counted twice).
pub fn kv_cache_bytes(budget: crate::job::MemoryBudget, device: &Device) -> u64 {
    budget.resolve(device_memory_available(device).unwrap_or(4 << 30))
}

/// A GPU's free and total memory now, from the driver; `None` for the CPU.
fn gpu_memory(device: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().mem_get_info().ok().map(|(free, total)| (free as u64, total as u64));
    }
    let _ = device;
    None
}

/// A GPU's memory in use now (all processes); `None` for the CPU.
pub fn device_memory_in_use(device: &Device) -> Option<u64> {
    gpu_memory(device).map(|(free, total)| total - free)
}

/// Memory available now on a device: the GPU's free memory for CUDA, the host's for the CPU.
pub fn device_memory_available(device: &Device) -> Option<u64> {
    match device {
        Device::Cpu => crate::metrics::available_memory_bytes(),
        _ => gpu_memory(device).map(|(free, _)| free),
    }
}

/// `cpu` or `cuda:N`, as `runtime.device` names it.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// A tokenized row for the engine.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: String,
    pub tag: RowTag,
    /// The row's own generation parameters, over the job's.
    pub params: RowParams,
    pub tokens: Vec<u32>,
    /// A scoring row: the completion's tokens, scored after the prompt; nothing is generated.
    pub completion: Option<Vec<u32>>,
    /// When the row was ready for the engine; queue time and TTFT are measured from here.
    pub arrival: Instant,
}

impl Request {
    /// A tokenized row, ready now; or its id, tag and error when it could not be tokenized.
    pub fn ready(row: crate::tokenize::PreparedRow) -> Result<Request, (String, RowTag, RowError)> {
        match row.tokens {
            Ok(tokens) => Ok(Request { id: row.id, tag: row.tag, params: row.params, tokens, completion: row.completion, arrival: Instant::now() }),
            Err(error) => Err((row.id, row.tag, error)),
        }
    }
}

/// The log-probability of one token, with the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// The token's text (a piece of a multi-byte character decodes as U+FFFD).
    pub token: String,
    pub logprob: f32,
    /// Most likely first; empty when no alternatives were asked for.
    pub top: Vec<TopLogprob>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TopLogprob {
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
}

/// One generated answer of a row (a row with `n` > 1 has several).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Choice {
    pub index: u32,
    /// The text; empty for a scoring row.
    pub text: String,
    #[serde(serialize_with = "finish_reason_str")]
    pub finish_reason: FinishReason,
    /// Tokens generated (the end token included), or the tokens of the completion scored.
    pub completion_tokens: u32,
    /// Per output token, when asked for (`logprobs`), and always for a scoring row.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The sum of the output tokens' log-probabilities, when they were computed.
    pub cumulative_logprob: Option<f64>,
}

fn finish_reason_str<S: serde::Serializer>(r: &FinishReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

/// What one step of the engine produced for a row: its result, or the error that failed it.
pub type RowResult = Result<Completion, RowFailure>;

/// A row that failed in the engine.
#[derive(Clone, Debug)]
pub struct RowFailure {
    pub id: String,
    pub tag: RowTag,
    pub error: RowError,
}

/// A finished row: every choice done.
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: String,
    pub tag: RowTag,
    /// At least one, by index.
    pub choices: Vec<Choice>,
    /// The parameters the row ran with (the job's, with the row's own values).
    pub params: GenerationParams,
    pub prompt_tokens: u32,
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Mean time per output token after the first; `None` for a single-token output.
    pub tpot_s: Option<f64>,
}

impl Completion {
    /// Tokens generated for the row, all choices together.
    pub fn completion_tokens(&self) -> u32 {
        self.choices.iter().map(|c| c.completion_tokens).sum()
    }
}

#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub peak_running: usize,
    pub peak_kv_bytes: usize,
    /// Seconds in steps that prefilled prompt tokens (some may also have decoded), and in decode-only steps.
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Tokens of the decode-only steps (`decode_s`).
    pub decode_only_tokens: u64,
    /// Sequences preempted when the KV cache ran short, and the tokens prefilled again for them.
    pub preemptions: u64,
    pub recomputed_tokens: u64,
    /// KV cache blocks in the budget, the most in use at once, and the mean in use per step.
    pub kv_blocks: usize,
    pub peak_kv_blocks: usize,
    pub mean_kv_blocks: f64,
}

impl EngineStats {
    /// Useful tokens over tokens computed: prompt tokens prefilled again after preemption are computed twice.
    /// `None` for engines without a block KV cache (embed, seq2seq), which do not count them.
    pub fn packing_efficiency(&self) -> Option<f64> {
        let computed = self.prefill_tokens + self.decode_tokens;
        (computed > 0 && self.kv_blocks > 0).then(|| (computed - self.recomputed_tokens.min(computed)) as f64 / computed as f64)
    }

    /// Prompt tokens per second of steps that prefilled; 0 before any.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        if self.prefill_s > 0.0 { self.prefill_tokens as f64 / self.prefill_s } else { 0.0 }
    }

    /// Tokens per second of decode-only steps; 0 before any.
    pub fn decode_tokens_per_s(&self) -> f64 {
        if self.decode_s > 0.0 { self.decode_only_tokens as f64 / self.decode_s } else { 0.0 }
    }

    /// Peak and mean KV cache blocks in use over the budget.
    pub fn kv_utilisation(&self) -> Option<(f64, f64)> {
        (self.kv_blocks > 0).then(|| (self.peak_kv_blocks as f64 / self.kv_blocks as f64, self.mean_kv_blocks / self.kv_blocks as f64))
    }
}

/// What a continuous-batching engine offers the job loop.
pub trait Engine {
    /// Requests that can be admitted now.
    fn free_places(&self) -> usize;
    /// Admits a request; it is prefilled in a coming step. Callers respect [`Engine::free_places`]. A request the
    /// engine can never run (its prompt does not fit the KV cache budget) is refused with a row error.
    fn admit(&mut self, request: Request) -> Result<(), RowError>;
    /// Whether any admitted sequence is unfinished.
    fn has_work(&self) -> bool;
    /// Runs one forward pass and returns the rows that finished in it (or failed: a row error, with its request).
    fn step(&mut self) -> Result<Vec<RowResult>, EngineError>;
    fn stats(&self) -> &EngineStats;
}

#[derive(Clone, Debug)]
pub struct BatchConfig {
    /// Sequences decoded together.
    pub max_seqs: usize,
    /// Prompt tokens prefilled in one step; a longer prompt is prefilled alone.
    pub max_batch_tokens: usize,
    /// KV cache blocks of [`KV_BLOCK_TOKENS`] positions, shared by all sequences.
    pub kv_blocks: usize,
}

impl BatchConfig {
    /// The configuration for a KV cache budget of `kv_bytes`, in blocks of `block_bytes` ([`Model::kv_block_bytes`]).
    pub fn new(max_seqs: usize, max_batch_tokens: usize, kv_bytes: u64, block_bytes: usize) -> BatchConfig {
        let kv_blocks = (kv_bytes / block_bytes.max(1) as u64).min(u32::MAX as u64) as usize;
        BatchConfig { max_seqs, max_batch_tokens, kv_blocks: kv_blocks.max(1) }
    }

    /// Tokens the KV cache budget holds, all sequences together.
    pub fn kv_tokens(&self) -> usize {
        self.kv_blocks * KV_BLOCK_TOKENS
    }

    /// The longest sequence (prompt and output) that can run: the model's context, or less when the KV cache
    /// budget holds less.
    pub fn max_sequence_tokens(&self, model: &ModelConfig) -> usize {
        model.context_length.min(self.kv_tokens())
    }

    /// The scheduler's configuration.
    pub fn schedule(&self) -> crate::schedule::Config {
        crate::schedule::Config {
            max_seqs: self.max_seqs,
            max_batch_tokens: self.max_batch_tokens,
            block_tokens: KV_BLOCK_TOKENS,
            kv_blocks: self.kv_blocks,
            // Prefill as soon as a place is free: on these kernels a step's cost grows with its tokens, so
            // holding places empty to gather prefills only loses decode throughput.
            min_prefill_places: 1,
            max_decode_steps_between_prefills: 8,
        }
    }
}

/// Answer tokens a sequence's block table is sized for at admission (blocks themselves are taken as it grows).
const INITIAL_ANSWER_TOKENS: usize = 256;

/// Token texts that end a turn in common chat formats; a control token with one of these names stops generation
/// even when the model's metadata names a different EOS token.
const END_OF_TURN_TOKENS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"];

/// How generation ends, from the model's vocabulary and the job's parameters.
#[derive(Clone, Debug)]
pub struct StopRules {
    pub end_tokens: HashSet<u32>,
    /// The model's EOS token, when it names one.
    pub eos: Option<u32>,
}

impl StopRules {
    pub fn new(vocab: &crate::tokenize::VocabMetadata) -> StopRules {
        let mut end_tokens: HashSet<u32> = [vocab.eos, vocab.eot].into_iter().flatten().chain(vocab.more_ends.iter().copied()).collect();
        for (id, token) in vocab.tokens.iter().enumerate() {
            if vocab.token_types.get(id) == Some(&crate::tokenize::vocab::TOKEN_TYPE_CONTROL) && END_OF_TURN_TOKENS.contains(&token.as_str()) {
                end_tokens.insert(id as u32);
            }
        }
        StopRules { end_tokens, eos: vocab.eos }
    }
}

/// Watches a sequence's generated text for stop strings. Text is detokenized incrementally, and each new piece is
/// searched together with the tail of the earlier text that a stop string could straddle, so a step costs the
/// same however long the output already is.
#[derive(Debug, Default)]
pub struct StopScan {
    stream: TextStream,
    text: String,
}

impl StopScan {
    /// Adds a generated token; when a stop string is now complete (and `active`: `min_new_tokens` are out),
    /// returns the output cut before it, or after it when `include` asks to keep it.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32, stops: &[String], active: bool, include: bool) -> Option<String> {
        let longest = stops.iter().map(String::len).max()?;
        let before = self.text.len();
        self.text.push_str(&self.stream.push(tokenizer, token));
        if !active {
            return None;
        }
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let (at, stop) = stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, s))).min_by_key(|m| m.0)?;
        Some(self.text[..if include { at + stop.len() } else { at }].to_string())
    }
}

/// One choice of one row, running or waiting in the scheduler.
struct Sequence {
    /// The row it belongs to (the id of the row's first sequence).
    group: SeqId,
    index: u32,
    /// Tokens to feed in the next step: the prompt before prefill, then the last sampled token.
    pending: Vec<u32>,
    cache: KvCache,
    generated: Vec<u32>,
    sampled: u32,
    max_new_tokens: usize,
    stop_scan: StopScan,
    /// The output, when a stop string ended it.
    cut_text: Option<String>,
    rng: Rng,
    /// How often each token occurs in the output; kept only when a penalty needs it.
    counts: HashMap<u32, u32>,
    logprobs: Option<Vec<TokenLogprob>>,
    constraint: Option<constraint::Constraint>,
    /// Choices still to fork from this sequence right after its prefill (`n - 1` for a row's first sequence).
    forks: u32,
}

/// A row in the engine: its request, its parameters and its finished choices.
struct Group {
    request: Request,
    params: GenerationParams,
    /// The prompt's distinct tokens, for a repetition penalty (empty without one).
    penalty_prompt: Vec<u32>,
    grammar: Option<Arc<constraint::Grammar>>,
    choices: Vec<Option<Choice>>,
    /// Choices not finished yet.
    live: usize,
    /// When its prefill began (the end of its queue time), and its first token.
    admitted: Option<Instant>,
    first_token: Option<Instant>,
}

/// Whether a sequence's next token is the plain argmax of its logits: greedy with nothing that reads or changes
/// the logits (penalties, logprobs, a grammar), and `min_new_tokens` reached.
fn takes_argmax(p: &GenerationParams, seq: &Sequence) -> bool {
    p.is_plain_greedy() && seq.sampled >= p.min_new_tokens
}

/// Checks what the job file's rules cannot know: stop token ids against the model's vocabulary and `n` against
/// the places (`max_seqs`). Err: (job file key, problem).
pub fn check_params(params: &GenerationParams, vocab_size: usize, max_seqs: usize) -> Result<(), (&'static str, String)> {
    if let Some(bad) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(("generation.stop_token_ids", format!("has {bad}, outside the model's vocabulary of {vocab_size} tokens")));
    }
    if params.n as usize > max_seqs {
        return Err(("generation.n", format!("is {}, more than runtime.max_seqs = {max_seqs} (the choices of a row run together)", params.n)));
    }
    Ok(())
}

/// The grammar vocabulary of a model: its tokens, with its end tokens (the EOS first) allowed once a value is
/// complete.
pub fn grammars(tokenizer: &Tokenizer, vocab_size: usize, stop: &StopRules) -> Result<constraint::Grammars, String> {
    let mut ends: Vec<u32> = stop.end_tokens.iter().copied().collect();
    ends.sort_unstable();
    if let Some(eos) = stop.eos.filter(|e| ends.contains(e)) {
        ends.retain(|&e| e != eos);
        ends.insert(0, eos);
    }
    constraint::Grammars::new(tokenizer, vocab_size, &ends)
}

pub struct BatchEngine {
    model: Model,
    tokenizer: Tokenizer,
    params: GenerationParams,
    stop: StopRules,
    config: BatchConfig,
    scheduler: Scheduler,
    /// Admitted sequences, running or waiting (a waiting one has an empty cache).
    seqs: HashMap<SeqId, Sequence>,
    groups: HashMap<SeqId, Group>,
    /// Grammars of JSON Schemas, built on first use.
    grammars: Option<constraint::Grammars>,
    next_id: SeqId,
    stats: EngineStats,
}

impl BatchEngine {
    /// An engine over a loaded model. Sizes the paged path's KV pool to the budget (`config.kv_blocks`): fails
    /// only if the pool was already allocated at another size.
    pub fn new(model: Model, tokenizer: Tokenizer, params: GenerationParams, stop: StopRules, config: BatchConfig) -> Result<Self, EngineError> {
        model.set_kv_blocks(config.kv_blocks).map_err(|e| EngineError(e.to_string()))?;
        let scheduler = Scheduler::new(config.schedule());
        let stats = EngineStats { kv_blocks: config.kv_blocks, ..EngineStats::default() };
        Ok(BatchEngine {
            model,
            tokenizer,
            params,
            stop,
            config,
            scheduler,
            seqs: HashMap::new(),
            groups: HashMap::new(),
            grammars: None,
            next_id: 0,
            stats,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model back, for another engine (a benchmark's timed run after its warm-up). Its KV pool keeps its
    /// size: the next engine must be configured alike.
    pub fn into_model(self) -> Model {
        self.model
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// The compiled grammar of a JSON Schema (cached by its text). Err: why the schema cannot be used.
    pub fn grammar(&mut self, schema: &str) -> Result<Arc<constraint::Grammar>, String> {
        if self.grammars.is_none() {
            self.grammars = Some(grammars(&self.tokenizer, self.model.config.vocab_size, &self.stop)?);
        }
        self.grammars.as_mut().expect("built above").compile(schema)
    }

    /// [`check_params`], and the JSON Schema compiled (once per distinct schema).
    pub fn check_params(&mut self, params: &GenerationParams) -> Result<Option<Arc<constraint::Grammar>>, (&'static str, String)> {
        check_params(params, self.model.config.vocab_size, self.config.max_seqs)?;
        match &params.json_schema {
            None => Ok(None),
            Some(schema) => self.grammar(schema).map(Some).map_err(|e| ("generation.json_schema", format!("cannot be used: {e}"))),
        }
    }

    fn new_sequence(&self, group: SeqId, index: u32, pending: Vec<u32>, cache: KvCache, max_new_tokens: usize) -> Result<Sequence, String> {
        let g = &self.groups[&group];
        let constraint = g.grammar.as_deref().map(constraint::Constraint::new).transpose()?;
        Ok(Sequence {
            group,
            index,
            pending,
            cache,
            generated: Vec::new(),
            sampled: 0,
            max_new_tokens,
            stop_scan: StopScan::default(),
            cut_text: None,
            rng: Rng::new(sampling::choice_seed(g.params.seed, &g.request.id, index)),
            counts: HashMap::new(),
            logprobs: g.params.logprobs.map(|_| Vec::new()),
            constraint,
            forks: 0,
        })
    }

    /// Reported log-probabilities of `token` at a position with these (raw) logits.
    fn token_logprob(&self, logits: &[f32], token: u32, top: u32) -> TokenLogprob {
        let (logprob, alternatives) = sampling::logprobs(logits, token, top as usize);
        let text = |t: u32| self.tokenizer.decode(&[t], false).unwrap_or_default();
        TokenLogprob {
            token_id: token,
            token: text(token),
            logprob,
            top: alternatives.into_iter().map(|(t, lp)| TopLogprob { token_id: t, token: text(t), logprob: lp }).collect(),
        }
    }

    /// Chooses a sequence's next token from its logits: penalties, masks (`min_new_tokens`, the JSON grammar),
    /// then greedy or sampling; records its log-probability when asked.
    fn choose(&mut self, id: SeqId, logits: StepLogits) -> Result<u32, String> {
        let seq = self.seqs.get(&id).expect("a scheduled sequence exists");
        let group = &self.groups[&seq.group];
        let p = &group.params;
        let min_active = (seq.sampled as usize) < p.min_new_tokens as usize;
        let mut logits = match logits {
            // The device chose it: asked for only where the fast path below applies ([`takes_argmax`]).
            StepLogits::Argmax(token) => return Ok(token),
            StepLogits::Full(logits) => logits,
        };
        if takes_argmax(p, seq) {
            // The fast path: no copy, no pass over the logits beyond the argmax.
            return Ok(sampling::argmax(&logits));
        }
        let raw = p.logprobs.map(|k| (k, logits.clone()));
        sampling::apply_penalties(&mut logits, p, &group.penalty_prompt, &seq.counts);
        let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
        if let Some(c) = &mut seq.constraint {
            c.mask(&mut logits)?;
        }
        if min_active {
            // End tokens and stop token ids are held back until `min_new_tokens`, unless nothing else is allowed.
            let ends = self.stop.end_tokens.iter().filter(|_| !p.ignore_eos).chain(&p.stop_token_ids);
            let held: Vec<(usize, f32)> = ends.filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l))).collect();
            for &(t, _) in &held {
                logits[t] = f32::NEG_INFINITY;
            }
            if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
                for (t, l) in held {
                    logits[t] = l;
                }
            }
        }
        let token = sampling::sample(&logits, p, &mut seq.rng);
        if let Some((k, raw)) = raw {
            let lp = self.token_logprob(&raw, token, k);
            let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
            seq.logprobs.as_mut().expect("logprobs were asked for").push(lp);
        }
        Ok(token)
    }

    /// Applies a sampled token to a sequence; returns why it finished, if it did.
    fn advance(&mut self, id: SeqId, token: u32, now: Instant) -> Result<Option<FinishReason>, String> {
        let limit = self.config.max_sequence_tokens(&self.model.config);
        let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
        let group = self.groups.get_mut(&seq.group).expect("a sequence's group exists");
        let p = &group.params;
        seq.sampled += 1;
        group.first_token.get_or_insert(now);
        // `choose` lets an end token through only after `min_new_tokens`, or when nothing else was allowed.
        if (!p.ignore_eos && self.stop.end_tokens.contains(&token)) || p.stop_token_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        // Stop strings count from the token that completes `min_new_tokens` (as vLLM).
        let min_done = seq.sampled >= p.min_new_tokens;
        seq.generated.push(token);
        if p.has_penalties() {
            *seq.counts.entry(token).or_insert(0) += 1;
        }
        if let Some(c) = &mut seq.constraint {
            c.consume(token)?;
        }
        if let Some(text) = seq.stop_scan.push(&self.tokenizer, token, &p.stop, min_done, p.include_stop_str_in_output) {
            seq.cut_text = Some(text);
            return Ok(Some(FinishReason::Stop));
        }
        if seq.constraint.as_ref().is_some_and(|c| c.is_stopped()) {
            return Ok(Some(FinishReason::Stop));
        }
        if seq.generated.len() >= seq.max_new_tokens || seq.cache.len() + 1 > limit {
            let complete = seq.constraint.as_mut().is_none_or(|c| c.is_accepting());
            return Ok(Some(if complete { FinishReason::Length } else { FinishReason::IncompleteJson }));
        }
        seq.pending = vec![token];
        Ok(None)
    }

    /// Finishes one choice; returns the row's result when it was the last.
    fn finish(&mut self, id: SeqId, reason: FinishReason, now: Instant) -> Option<RowResult> {
        self.scheduler.finish(id);
        let seq = self.seqs.remove(&id).expect("a finished sequence exists");
        let group = self.groups.get_mut(&seq.group).expect("a sequence's group exists");
        let text = match (reason, seq.cut_text) {
            (FinishReason::Scored, _) => String::new(),
            (_, Some(text)) => text,
            (_, None) => self.tokenizer.decode(&seq.generated, true).unwrap_or_default(),
        };
        group.choices[seq.index as usize] = Some(Choice {
            index: seq.index,
            text,
            finish_reason: reason,
            completion_tokens: seq.sampled,
            cumulative_logprob: seq.logprobs.as_ref().map(|l| l.iter().map(|t| t.logprob as f64).sum()),
            logprobs: seq.logprobs,
        });
        group.live -= 1;
        if group.live > 0 {
            return None;
        }
        let group = self.groups.remove(&seq.group).expect("checked above");
        Some(self.complete(group, now))
    }

    /// The row's result from its finished choices; a choice that failed fails the row.
    fn complete(&self, group: Group, now: Instant) -> RowResult {
        let arrival = group.request.arrival;
        let first = group.first_token.unwrap_or(now);
        let choices: Vec<Choice> = group.choices.into_iter().map(|c| c.expect("every choice finished")).collect();
        let most_sampled = choices.iter().map(|c| c.completion_tokens).max().unwrap_or(0);
        Ok(Completion {
            tag: group.request.tag,
            prompt_tokens: group.request.tokens.len() as u32,
            id: group.request.id,
            choices,
            params: group.params,
            queue_s: (group.admitted.unwrap_or(now) - arrival).as_secs_f64(),
            ttft_s: (first - arrival).as_secs_f64(),
            e2e_s: (now - arrival).as_secs_f64(),
            tpot_s: (most_sampled > 1).then(|| (now - first).as_secs_f64() / (most_sampled - 1) as f64),
        })
    }

    /// Fails a whole row (every choice) with an error found while it ran.
    fn fail(&mut self, group: SeqId, message: String) -> RowFailure {
        let ids: Vec<SeqId> = self.seqs.iter().filter(|(_, s)| s.group == group).map(|(&id, _)| id).collect();
        for id in ids {
            self.scheduler.finish(id);
            self.seqs.remove(&id);
        }
        let g = self.groups.remove(&group).expect("a failing row's group exists");
        RowFailure { id: g.request.id, tag: g.request.tag, error: RowError::new(ErrorCode::EngineError, message) }
    }
}

impl Engine for BatchEngine {
    fn free_places(&self) -> usize {
        // Up to `max_seqs` wait beside the running ones, so the scheduler can pick prompts of similar lengths
        // and refill a place the moment it frees. A row's choices take a place each.
        let booked: usize = self.groups.values().map(|g| g.live).sum();
        (2 * self.config.max_seqs).saturating_sub(booked)
    }

    fn admit(&mut self, request: Request) -> Result<(), RowError> {
        let bad = |m: String| RowError::new(ErrorCode::InvalidParameters, m);
        let params = self.params.for_row(&request.params).map_err(bad)?;
        let grammar = self.check_params(&params).map_err(|(key, problem)| bad(format!("{} {problem}", key.trim_start_matches("generation."))))?;
        let limit = self.config.max_sequence_tokens(&self.model.config);
        let completion = request.completion.as_deref().unwrap_or(&[]);
        let prompt = request.tokens.len() + completion.len();
        let scoring = request.completion.is_some();
        let max_new_tokens = if scoring { 0 } else { (params.max_new_tokens as usize).min(limit.saturating_sub(prompt)) };
        // A generating row needs a position left for its first token; a scoring row only its own tokens.
        let fits = if scoring { prompt <= limit } else { prompt < limit };
        if request.tokens.is_empty() || !fits {
            return Err(RowError::new(
                ErrorCode::PromptTooLong,
                format!("the prompt has {prompt} tokens; the model's context and the KV cache budget allow {}", limit.saturating_sub(1)),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        let n = if scoring { 1 } else { params.n };
        self.scheduler
            .push_group(id, prompt, max_new_tokens, n as usize)
            .map_err(|e| RowError::new(ErrorCode::PromptTooLong, e.to_string()))?;
        let pending: Vec<u32> = request.tokens.iter().chain(completion).copied().collect();
        let mut penalty_prompt = Vec::new();
        if params.repetition_penalty != 1.0 {
            penalty_prompt = request.tokens.clone();
            penalty_prompt.sort_unstable();
            penalty_prompt.dedup();
        }
        self.groups.insert(
            id,
            Group {
                request,
                params,
                penalty_prompt,
                grammar,
                choices: vec![None; n as usize],
                live: n as usize,
                admitted: None,
                first_token: None,
            },
        );
        let cache = self.model.new_cache(prompt + max_new_tokens.min(INITIAL_ANSWER_TOKENS));
        let mut seq = self.new_sequence(id, 0, pending, cache, max_new_tokens).map_err(bad)?;
        seq.forks = n - 1;
        self.seqs.insert(id, seq);
        Ok(())
    }

    fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    fn step(&mut self) -> Result<Vec<RowResult>, EngineError> {
        let plan = self.scheduler.next_step();
        for id in &plan.preempted {
            // Dropped, to be prefilled again with its prompt and everything it generated (the last sampled token
            // included: it was not fed yet).
            let seq = self.seqs.get_mut(id).expect("a preempted sequence exists");
            seq.cache = self.model.new_cache(0);
            seq.pending = self.groups[&seq.group].request.tokens.iter().chain(&seq.generated).copied().collect();
        }
        if plan.is_empty() {
            if self.seqs.is_empty() {
                return Ok(Vec::new());
            }
            // The scheduler always runs something while sequences wait (a lone one always fits the budget it was
            // admitted under); failing loudly beats spinning.
            return Err(EngineError(format!("the scheduler made no progress with {} sequences waiting (a bug)", self.seqs.len())));
        }
        let started = Instant::now();
        for (id, tokens) in &plan.prefill {
            let seq = self.seqs.get_mut(id).expect("a scheduled sequence exists");
            debug_assert_eq!(seq.pending.len(), *tokens);
            self.groups.get_mut(&seq.group).expect("a sequence's group exists").admitted.get_or_insert(started);
        }
        let order: Vec<SeqId> = plan.decode.iter().copied().chain(plan.prefill.iter().map(|p| p.0)).collect();
        // A scoring row needs the logits after each completion token: its last `completion + 1` positions.
        let outputs: Vec<usize> = order
            .iter()
            .map(|id| {
                let seq = &self.seqs[id];
                match &self.groups[&seq.group].request.completion {
                    Some(c) if seq.cache.is_empty() => c.len() + 1,
                    _ => 1,
                }
            })
            .collect();
        // Sequences whose next token is the plain argmax: the device may choose it and send back only the token.
        let greedy: Vec<bool> = order
            .iter()
            .zip(&outputs)
            .map(|(id, &o)| {
                let seq = &self.seqs[id];
                let g = &self.groups[&seq.group];
                o == 1 && g.request.completion.is_none() && takes_argmax(&g.params, seq)
            })
            .collect();
        let logits = {
            let wanted: HashMap<SeqId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
            let mut chosen: Vec<(usize, &mut Sequence)> =
                self.seqs.iter_mut().filter_map(|(id, s)| wanted.get(id).map(|&i| (i, s))).collect();
            chosen.sort_by_key(|c| c.0);
            let mut segments: Vec<Segment<'_>> =
                chosen.into_iter().map(|(_, s)| Segment { tokens: &s.pending, cache: &mut s.cache }).collect();
            self.model.forward_step(&mut segments, &outputs, &greedy).map_err(|e| EngineError(e.to_string()))?
        };
        let now = Instant::now();
        let took = (now - started).as_secs_f64();
        let (prefill_tokens, decode_tokens) = (plan.prefill_tokens(), plan.decode.len());
        if prefill_tokens > 0 {
            self.stats.prefill_s += took;
        } else {
            self.stats.decode_s += took;
            self.stats.decode_only_tokens += decode_tokens as u64;
        }
        self.stats.steps += 1;
        self.stats.prefill_tokens += prefill_tokens as u64;
        self.stats.decode_tokens += decode_tokens as u64;

        let mut results = Vec::new();
        let mut finished = Vec::new();
        let mut failed: Vec<(SeqId, String)> = Vec::new();
        for (&id, mut rows) in order.iter().zip(logits) {
            let group = self.seqs[&id].group;
            if failed.iter().any(|f| f.0 == group) {
                continue;
            }
            let g = &self.groups[&group];
            if let Some(completion) = &g.request.completion {
                // Scoring: the log-probability of each completion token after the tokens before it.
                let top = g.params.logprobs.unwrap_or(0);
                let scored: Vec<TokenLogprob> = completion
                    .iter()
                    .zip(&rows)
                    .map(|(&t, row)| match row {
                        StepLogits::Full(l) => self.token_logprob(l, t, top),
                        StepLogits::Argmax(_) => unreachable!("scoring rows ask for their logits"),
                    })
                    .collect();
                let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
                seq.sampled = scored.len() as u32;
                seq.logprobs = Some(scored);
                self.groups.get_mut(&group).expect("checked above").first_token.get_or_insert(now);
                finished.push((id, FinishReason::Scored));
                continue;
            }
            let mut row = rows.pop().expect("one row of logits per sequence");
            // A row's first prefill forks its other choices: copies of its cache, each sampling on its own.
            let mut ids = vec![id];
            let forks = std::mem::take(&mut self.seqs.get_mut(&id).expect("a scheduled sequence exists").forks);
            for index in 1..=forks {
                let child = self.next_id;
                self.next_id += 1;
                let parent = &self.seqs[&id];
                let max_new = parent.max_new_tokens;
                let cache = match self.model.fork_cache(&parent.cache) {
                    Ok(cache) => cache,
                    Err(e) => {
                        failed.push((group, format!("cannot fork the KV cache: {e}")));
                        break;
                    }
                };
                match self.new_sequence(group, index, Vec::new(), cache, max_new) {
                    Ok(seq) => {
                        self.scheduler.fork(id, child);
                        self.seqs.insert(child, seq);
                        ids.push(child);
                    }
                    Err(e) => failed.push((group, e)),
                }
            }
            let last = ids.len() - 1;
            for (k, seq_id) in ids.into_iter().enumerate() {
                let logits = if k == last { std::mem::replace(&mut row, StepLogits::Full(Vec::new())) } else { row.clone() };
                let step = self.choose(seq_id, logits).and_then(|token| self.advance(seq_id, token, now));
                match step {
                    Ok(Some(reason)) => finished.push((seq_id, reason)),
                    Ok(None) => {}
                    Err(e) => failed.push((group, e)),
                }
            }
        }
        // After a step, the sequences hold exactly the blocks booked for it: the scheduler books the positions the
        // step writes, and a block is allocated when its first position is written.
        debug_assert_eq!(self.seqs.values().map(|s| s.cache.blocks()).sum::<usize>(), self.scheduler.cached_blocks());
        let running = self.scheduler.running();
        self.stats.peak_running = self.stats.peak_running.max(running);
        let s = self.scheduler.stats();
        self.stats.preemptions = s.preemptions;
        self.stats.recomputed_tokens = s.recomputed_tokens;
        self.stats.peak_kv_blocks = s.peak_blocks;
        self.stats.peak_kv_bytes = s.peak_blocks * self.model.kv_block_bytes();
        self.stats.mean_kv_blocks = s.block_steps as f64 / s.steps.max(1) as f64;

        for (group, message) in failed {
            if self.groups.contains_key(&group) {
                results.push(Err(self.fail(group, message)));
            }
        }
        for (id, reason) in finished {
            if self.seqs.contains_key(&id) {
                results.extend(self.finish(id, reason, now));
            }
        }
        Ok(results)
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }
}
