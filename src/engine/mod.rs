//! The engine: the model, its KV cache, sampling and the batching loop. The only module that knows candle.
//!
//! [`Engine`] is the interface the rest of the job sees: admit requests while there is room, call
//! [`Engine::step`], collect the [`Completion`]s. [`BatchEngine`] implements it with continuous batching: every
//! step packs the prompts of newly admitted sequences (under a prefill token budget) together with one decode
//! token of every running sequence into a single forward pass, and a finished sequence's place is free for the
//! next request in the very next step.

pub mod model;
pub mod sampling;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use tokenizers::Tokenizer;

use crate::job::{DeviceChoice, GenerationParams};
use crate::row::{ErrorCode, FinishReason, RowError, RowParams, RowTag};
use crate::schedule::{Scheduler, SeqId};
use crate::tokenize::TextStream;
pub use model::{KvCache, KV_BLOCK_TOKENS, Layout, Model, ModelConfig, ModelInfo, Segment};
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
}

#[derive(Debug, thiserror::Error)]
#[error("forward pass failed: {0}")]
pub struct EngineError(String);

impl EngineError {
    pub fn new(message: impl Into<String>) -> Self {
        EngineError(message.into())
    }
}

pub fn select_device(choice: &DeviceChoice) -> Result<Device, ModelError> {
    match choice {
        DeviceChoice::Auto | DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Cuda(n) => Err(ModelError::NoCuda(format!("cuda:{n}"))),
    }
}

/// The KV cache budget in bytes: a size as given, or a fraction of the memory available now (call it after the
/// model has loaded, so the weights are not counted twice).
pub fn kv_cache_bytes(budget: crate::job::MemoryBudget) -> u64 {
    budget.resolve(crate::metrics::available_memory_bytes().unwrap_or(4 << 30))
}

/// A tokenized row for the engine.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: String,
    pub tag: RowTag,
    /// The row's own generation parameters, over the job's.
    pub params: RowParams,
    pub tokens: Vec<u32>,
    /// When the row was ready for the engine; queue time and TTFT are measured from here.
    pub arrival: Instant,
}

/// A finished sequence.
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: String,
    pub tag: RowTag,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Mean time per output token after the first; `None` for a single-token output.
    pub tpot_s: Option<f64>,
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
    /// Runs one forward pass and returns the sequences that finished in it.
    fn step(&mut self) -> Result<Vec<Completion>, EngineError>;
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
    /// The configuration for a KV cache budget of `kv_bytes`.
    pub fn new(max_seqs: usize, max_batch_tokens: usize, kv_bytes: u64, model: &ModelConfig) -> BatchConfig {
        let kv_blocks = (kv_bytes / KvCache::block_bytes(model).max(1) as u64).min(u32::MAX as u64) as usize;
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
    pub strings: Vec<String>,
}

impl StopRules {
    pub fn new(vocab: &crate::tokenize::VocabMetadata, params: &GenerationParams) -> StopRules {
        let mut end_tokens: HashSet<u32> = [vocab.eos, vocab.eot].into_iter().flatten().chain(vocab.more_ends.iter().copied()).collect();
        for (id, token) in vocab.tokens.iter().enumerate() {
            if vocab.token_types.get(id) == Some(&crate::tokenize::vocab::TOKEN_TYPE_CONTROL) && END_OF_TURN_TOKENS.contains(&token.as_str()) {
                end_tokens.insert(id as u32);
            }
        }
        StopRules { end_tokens, strings: params.stop.clone() }
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
    /// Adds a generated token; when a stop string is now complete, returns the output cut before it.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32, stops: &[String]) -> Option<String> {
        let longest = stops.iter().map(String::len).max()?;
        let before = self.text.len();
        self.text.push_str(&self.stream.push(tokenizer, token));
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let at = stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min()?;
        Some(self.text[..at].to_string())
    }
}

struct Sequence {
    request: Request,
    /// Tokens to feed in the next step: the prompt before prefill, then the last sampled token.
    pending: Vec<u32>,
    cache: KvCache,
    generated: Vec<u32>,
    sampled: u32,
    max_new_tokens: usize,
    stop_scan: StopScan,
    /// The output, when a stop string ended it.
    cut_text: Option<String>,
    params: GenerationParams,
    rng: Rng,
    /// When its prefill began (the end of its queue time).
    admitted: Option<Instant>,
    first_token: Option<Instant>,
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
    next_id: SeqId,
    stats: EngineStats,
}

impl BatchEngine {
    pub fn new(model: Model, tokenizer: Tokenizer, params: GenerationParams, stop: StopRules, config: BatchConfig) -> Self {
        let scheduler = Scheduler::new(config.schedule());
        let stats = EngineStats { kv_blocks: config.kv_blocks, ..EngineStats::default() };
        BatchEngine { model, tokenizer, params, stop, config, scheduler, seqs: HashMap::new(), next_id: 0, stats }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// Applies a sampled token to a sequence; returns why it finished, if it did.
    fn advance(&mut self, id: SeqId, token: u32, now: Instant) -> Option<FinishReason> {
        let limit = self.config.max_sequence_tokens(&self.model.config);
        let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
        seq.sampled += 1;
        seq.first_token.get_or_insert(now);
        if self.stop.end_tokens.contains(&token) {
            return Some(FinishReason::Stop);
        }
        seq.generated.push(token);
        if let Some(text) = seq.stop_scan.push(&self.tokenizer, token, &self.stop.strings) {
            seq.cut_text = Some(text);
            return Some(FinishReason::Stop);
        }
        if seq.generated.len() >= seq.max_new_tokens || seq.cache.len() + 1 > limit {
            return Some(FinishReason::Length);
        }
        seq.pending = vec![token];
        None
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason, now: Instant) -> Completion {
        self.scheduler.finish(id);
        let seq = self.seqs.remove(&id).expect("a finished sequence exists");
        let text = seq.cut_text.unwrap_or_else(|| self.tokenizer.decode(&seq.generated, true).unwrap_or_default());
        let arrival = seq.request.arrival;
        let first = seq.first_token.unwrap_or(now);
        let tpot_s = (seq.sampled > 1).then(|| (now - first).as_secs_f64() / (seq.sampled - 1) as f64);
        Completion {
            tag: seq.request.tag,
            id: seq.request.id,
            text,
            finish_reason: reason,
            prompt_tokens: seq.request.tokens.len() as u32,
            completion_tokens: seq.sampled,
            queue_s: (seq.admitted.unwrap_or(now) - arrival).as_secs_f64(),
            ttft_s: (first - arrival).as_secs_f64(),
            e2e_s: (now - arrival).as_secs_f64(),
            tpot_s,
        }
    }
}

impl Engine for BatchEngine {
    fn free_places(&self) -> usize {
        // Up to `max_seqs` wait beside the running ones, so the scheduler can pick prompts of similar lengths
        // and refill a place the moment it frees.
        (2 * self.config.max_seqs).saturating_sub(self.seqs.len())
    }

    fn admit(&mut self, request: Request) -> Result<(), RowError> {
        let limit = self.config.max_sequence_tokens(&self.model.config);
        let params = self.params.for_row(&request.params);
        let prompt = request.tokens.len();
        let max_new_tokens = (params.max_new_tokens as usize).min(limit.saturating_sub(prompt));
        if prompt == 0 || prompt >= limit {
            return Err(RowError::new(
                ErrorCode::PromptTooLong,
                format!("the prompt has {prompt} tokens; the model's context and the KV cache budget allow {}", limit.saturating_sub(1)),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.scheduler.push(id, prompt, max_new_tokens).map_err(|e| RowError::new(ErrorCode::PromptTooLong, e.to_string()))?;
        let cache = KvCache::new(&self.model.config, prompt + max_new_tokens.min(INITIAL_ANSWER_TOKENS));
        let rng = Rng::new(sampling::row_seed(params.seed, &request.id));
        self.seqs.insert(
            id,
            Sequence {
                pending: request.tokens.clone(),
                request,
                cache,
                generated: Vec::new(),
                sampled: 0,
                max_new_tokens,
                stop_scan: StopScan::default(),
                cut_text: None,
                params,
                rng,
                admitted: None,
                first_token: None,
            },
        );
        Ok(())
    }

    fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    fn step(&mut self) -> Result<Vec<Completion>, EngineError> {
        let plan = self.scheduler.next_step();
        for id in &plan.preempted {
            // Dropped, to be prefilled again with its prompt and everything it generated (the last sampled token
            // included: it was not fed yet).
            let seq = self.seqs.get_mut(id).expect("a preempted sequence exists");
            seq.cache = KvCache::new(&self.model.config, 0);
            seq.pending = seq.request.tokens.iter().chain(&seq.generated).copied().collect();
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
            seq.admitted.get_or_insert(started);
        }
        let order: Vec<SeqId> = plan.decode.iter().copied().chain(plan.prefill.iter().map(|p| p.0)).collect();
        let logits = {
            let wanted: HashMap<SeqId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
            let mut chosen: Vec<(usize, &mut Sequence)> =
                self.seqs.iter_mut().filter_map(|(id, s)| wanted.get(id).map(|&i| (i, s))).collect();
            chosen.sort_by_key(|c| c.0);
            let mut segments: Vec<Segment<'_>> =
                chosen.into_iter().map(|(_, s)| Segment { tokens: &s.pending, cache: &mut s.cache }).collect();
            self.model.forward(&mut segments).map_err(|e| EngineError(e.to_string()))?
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
        let running = self.scheduler.running();
        self.stats.peak_running = self.stats.peak_running.max(running);
        let s = self.scheduler.stats();
        self.stats.preemptions = s.preemptions;
        self.stats.recomputed_tokens = s.recomputed_tokens;
        self.stats.peak_kv_blocks = s.peak_blocks;
        // After a step, the sequences hold exactly the blocks booked for it: the scheduler books the positions the
        // step writes, and a block is allocated when its first position is written.
        debug_assert_eq!(self.seqs.values().map(|s| s.cache.blocks()).sum::<usize>(), self.scheduler.used_blocks());
        self.stats.peak_kv_bytes = s.peak_blocks * KvCache::block_bytes(&self.model.config);
        self.stats.mean_kv_blocks = s.block_steps as f64 / s.steps.max(1) as f64;

        let mut finished = Vec::new();
        for (&id, row) in order.iter().zip(&logits) {
            let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
            let token = sampling::sample(row, &seq.params, &mut seq.rng);
            if let Some(reason) = self.advance(id, token, now) {
                finished.push((id, reason));
            }
        }
        Ok(finished.into_iter().map(|(id, reason)| self.finish(id, reason, now)).collect())
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }
}
