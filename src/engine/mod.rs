//! The engine: the model, its KV cache, sampling and the batching loop. The only module that knows candle.
//!
//! [`Engine`] is the interface the rest of the job sees: admit requests while there is room, call
//! [`Engine::step`], collect the [`Completion`]s. [`BatchEngine`] implements it with continuous batching: every
//! step packs the prompts of newly admitted sequences (under a prefill token budget) together with one decode
//! token of every running sequence into a single forward pass, and a finished sequence's place is free for the
//! next request in the very next step.

pub mod model;
pub mod sampling;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use tokenizers::Tokenizer;

use crate::job::{DeviceChoice, GenerationParams};
use crate::row::{FinishReason, RowParams, RowTag};
use crate::tokenize::TextStream;
pub use model::{KvCache, Layout, Model, ModelConfig, ModelInfo, Segment};
use sampling::Rng;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open model file `{path}`")]
    Open { path: PathBuf, #[source] source: std::io::Error },
    #[error("`{path}` is not a valid GGUF model file: {message}")]
    Format { path: PathBuf, message: String },
    #[error("model architecture `{0}` is not supported (supported: llama)")]
    Architecture(String),
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
}

/// What a continuous-batching engine offers the job loop.
pub trait Engine {
    /// Requests that can be admitted now.
    fn free_places(&self) -> usize;
    /// Admits a request; it is prefilled in a coming step. Callers respect [`Engine::free_places`].
    fn admit(&mut self, request: Request);
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
}

/// Answer tokens a sequence's KV cache is reserved for at admission.
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
        let mut end_tokens: HashSet<u32> = [vocab.eos, vocab.eot].into_iter().flatten().collect();
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
    admitted: Instant,
    first_token: Option<Instant>,
}

pub struct BatchEngine {
    model: Model,
    tokenizer: Tokenizer,
    params: GenerationParams,
    stop: StopRules,
    config: BatchConfig,
    running: Vec<Sequence>,
    stats: EngineStats,
}

impl BatchEngine {
    pub fn new(model: Model, tokenizer: Tokenizer, params: GenerationParams, stop: StopRules, config: BatchConfig) -> Self {
        BatchEngine { model, tokenizer, params, stop, config, running: Vec::new(), stats: EngineStats::default() }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Applies a sampled token to a sequence; returns why it finished, if it did.
    fn advance(&mut self, index: usize, token: u32, now: Instant) -> Option<FinishReason> {
        let context = self.model.config.context_length;
        let seq = &mut self.running[index];
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
        if seq.generated.len() >= seq.max_new_tokens || seq.cache.len() + 1 > context {
            return Some(FinishReason::Length);
        }
        seq.pending = vec![token];
        None
    }

    fn finish(&mut self, index: usize, reason: FinishReason, now: Instant) -> Completion {
        let seq = self.running.swap_remove(index);
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
            queue_s: (seq.admitted - arrival).as_secs_f64(),
            ttft_s: (first - arrival).as_secs_f64(),
            e2e_s: (now - arrival).as_secs_f64(),
            tpot_s,
        }
    }
}

impl Engine for BatchEngine {
    fn free_places(&self) -> usize {
        self.config.max_seqs.saturating_sub(self.running.len())
    }

    fn admit(&mut self, request: Request) {
        let cfg = &self.model.config;
        let params = self.params.for_row(&request.params);
        let max_new_tokens = (params.max_new_tokens as usize).min(cfg.context_length.saturating_sub(request.tokens.len()));
        // Reserve for the prompt and a typical answer; a longer answer grows the cache. Reserving for the full
        // `max_new_tokens` of every sequence would hold memory most rows never use.
        let cache = KvCache::new(cfg, request.tokens.len() + max_new_tokens.min(INITIAL_ANSWER_TOKENS));
        let rng = Rng::new(sampling::row_seed(params.seed, &request.id));
        self.running.push(Sequence {
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
            admitted: Instant::now(),
            first_token: None,
        });
        self.stats.peak_running = self.stats.peak_running.max(self.running.len());
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty()
    }

    fn step(&mut self) -> Result<Vec<Completion>, EngineError> {
        // Every running sequence decodes one token; waiting prompts join while the prefill budget allows (the
        // first always does, so a prompt longer than the budget still runs, alone).
        let mut chosen = Vec::new();
        let mut prefill_tokens = 0;
        let mut decode_tokens = 0;
        for (i, seq) in self.running.iter().enumerate() {
            if !seq.cache.is_empty() {
                decode_tokens += 1;
                chosen.push(i);
            } else if prefill_tokens == 0 || prefill_tokens + seq.pending.len() <= self.config.max_batch_tokens {
                prefill_tokens += seq.pending.len();
                chosen.push(i);
            }
        }
        if chosen.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let logits = {
            let chosen_set: HashSet<usize> = chosen.iter().copied().collect();
            let mut segments: Vec<Segment<'_>> = self
                .running
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| chosen_set.contains(i))
                .map(|(_, s)| Segment { tokens: &s.pending, cache: &mut s.cache })
                .collect();
            self.model.forward(&mut segments).map_err(|e| EngineError(e.to_string()))?
        };
        let now = Instant::now();
        let took = (now - started).as_secs_f64();
        if prefill_tokens > 0 {
            self.stats.prefill_s += took;
        } else {
            self.stats.decode_s += took;
            self.stats.decode_only_tokens += decode_tokens as u64;
        }
        let kv: usize = self.running.iter().map(|s| s.cache.bytes()).sum();
        self.stats.peak_kv_bytes = self.stats.peak_kv_bytes.max(kv);
        self.stats.steps += 1;
        self.stats.prefill_tokens += prefill_tokens as u64;
        self.stats.decode_tokens += decode_tokens as u64;

        let mut finished = Vec::new();
        for (&index, row) in chosen.iter().zip(&logits) {
            let seq = &mut self.running[index];
            let token = sampling::sample(row, &seq.params, &mut seq.rng);
            if let Some(reason) = self.advance(index, token, now) {
                finished.push((index, reason));
            }
        }
        // Remove from the back so the remaining indices stay valid.
        finished.sort_by(|a, b| b.0.cmp(&a.0));
        Ok(finished.into_iter().map(|(index, reason)| self.finish(index, reason, now)).collect())
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }
}
