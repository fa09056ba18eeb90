//! The engine: the models, their KV caches, sampling and the batching loops. The only module that knows candle.
//!
//! [`Engine`] is the interface the rest of the job sees, the same for every job kind: admit requests while there
//! is room, call [`Engine::step`], collect the [`Outcome`]s. Three engines implement it:
//! - [`decoder::BatchEngine`], for decoders (any [`models::DecoderModel`]; today the llama family,
//!   [`models::llama`]), with continuous batching (generate and scoring jobs), over an attention backend ([`attention`]): the host
//!   backend on the CPU, the paged pool on accelerators;
//! - [`seq2seq::Seq2SeqEngine`]: T5 encoder-decoders ([`models::t5`]), with the same continuous batching;
//! - [`embed::EmbedEngine`]: BERT-family encoders ([`models::bert`]), length-sorted batches of one forward pass.
//!
//! Every generating engine keeps each choice's decode state in a [`choice::ChoiceState`] (sampling, stops,
//! log-probabilities) and makes its rows' results with the same arithmetic.

pub mod attention;
pub mod choice;
pub mod constraint;
pub mod decoder;
pub mod device;
pub mod embed;
pub mod kernels;
pub mod models;
pub mod parallel;
pub mod sampling;
pub mod seq2seq;

use std::path::PathBuf;
use std::time::Instant;

use crate::outcome::{Outcome, RowFailure};
use crate::row::{RowError, RowParams, RowTag};
pub use choice::{StopRules, StopScan};
pub use decoder::{check_params, decoder_engine, grammars, BatchConfig, BatchEngine, DecoderSetup};
pub use device::{device_memory_available, device_memory_in_use, device_name, kv_cache_bytes, select_device};
pub use attention::{Attention, AttentionModel, AttentionPlan, AttentionShape, Backend, HostAttention, KvCache, PagedAttention, Segment, KV_BLOCK_TOKENS};
pub use models::llama::{Layout, Model, ModelConfig, ModelInfo};
pub use models::{DecoderModel, StepLogits, StepModel};

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
    /// A GGUF file's tokenizer that llama.cpp would refuse, or of a kind nightshift does not run.
    #[error(transparent)]
    Vocab(#[from] crate::tokenize::gguf::VocabError),
    /// [`ModelError::Vocab`] with the model's path ([`ModelError::at`]).
    #[error("`{path}`: {message}")]
    VocabAt { path: PathBuf, message: String },
    /// [`ModelError::Metadata`] with the model's path ([`ModelError::at`]).
    #[error("the model's metadata in `{path}` is invalid: {message}")]
    MetadataAt { path: PathBuf, message: String },
    /// A JSON or tokenizer file of a model directory that does not parse.
    #[error("`{path}` is not valid: {message}")]
    File { path: PathBuf, message: String },
    #[error("`{path}` is not a regular file or directory: a model is read from files")]
    NotAFile { path: PathBuf },
    /// A model in object storage that cannot be fetched into the local cache.
    #[error("cannot fetch the model `{url}`: {message}")]
    Fetch { url: String, message: String },
    /// The model's store did not answer, or failed, past its retries: a rerun may succeed (exit 75).
    #[error("cannot fetch the model `{url}`: the store did not answer, past its retries ({message}); run the job again")]
    Unreachable { url: String, message: String },
    #[error("model file `{path}` has sha256 {actual}, but the job expects {expected}")]
    Checksum { path: PathBuf, expected: String, actual: String },
    /// The model's weights, as stored, need more memory than the device has available (exit 4).
    #[error("`{path}` does not fit in memory: {message}")]
    DoesNotFit { path: PathBuf, message: String },
    #[error("device `{0}` is not available: this nightshift was built without CUDA support")]
    NoCuda(String),
    /// The build has CUDA, but the device did not open (no driver, no such GPU, a stub library). `message` is
    /// candle's error or the text of a panic inside cudarc, which has no error type to keep as a source.
    #[error("CUDA device `{device}` cannot be opened: {message}")]
    Cuda { device: String, message: String },
}

impl ModelError {
    /// Names the model's path in a metadata error, which is made where the path is not known.
    pub fn at(self, path: &std::path::Path) -> ModelError {
        match self {
            ModelError::Metadata(message) => ModelError::MetadataAt { path: path.into(), message },
            ModelError::Vocab(e) => ModelError::VocabAt { path: path.into(), message: e.to_string() },
            e => e,
        }
    }
}

/// The first line of a candle error's text: with `RUST_BACKTRACE` set, candle appends a backtrace to it.
pub fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Why an engine stopped: the job cannot go on (a row's own problems are row errors, not these).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A forward pass or another device operation failed; candle's (or CUDA's) error is the source.
    #[error("{what} failed")]
    Device { what: &'static str, #[source] source: candle_core::Error },
    /// A broken invariant.
    #[error("{0} (a bug)")]
    Bug(String),
    /// A row that a benchmark or a calibration run needs failed.
    #[error("row `{id}` failed: {message}")]
    Row { id: String, message: String },
}

impl From<candle_core::Error> for EngineError {
    fn from(source: candle_core::Error) -> Self {
        EngineError::Device { what: "the forward pass", source }
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
    /// A tokenized row, ready now; or the failed row when it could not be tokenized.
    pub fn ready(row: crate::tokenize::PreparedRow) -> Result<Request, RowFailure> {
        match row.tokens {
            Ok(tokens) => Ok(Request { id: row.id, tag: row.tag, params: row.params, tokens, completion: row.completion, arrival: Instant::now() }),
            Err(error) => Err(RowFailure { id: row.id, tag: row.tag, error }),
        }
    }

    /// The request as a failed row.
    pub fn fail(self, error: RowError) -> RowFailure {
        RowFailure { id: self.id, tag: self.tag, error }
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
    /// Seconds in the model's forward passes (decoder engines), less the time they spend building the step's
    /// inputs on the host: the rest of a run is the engine's own time (scheduling, the step's inputs and attention
    /// tables, sampling, stop checks, bookkeeping) and the driver's.
    pub forward_s: f64,
    /// Sequences preempted when the KV cache ran short, and the tokens prefilled again for them.
    pub preemptions: u64,
    pub recomputed_tokens: u64,
    /// Prefilled tokens served from the prefix cache (not computed), and cached blocks evicted to make room.
    pub cached_prompt_tokens: u64,
    pub prefix_evictions: u64,
    /// KV cache blocks given back by running sequences as every layer's sliding window passed them.
    pub released_kv_blocks: u64,
    /// KV cache blocks in the budget, the most in use at once, and the mean in use per step.
    pub kv_blocks: usize,
    pub peak_kv_blocks: usize,
    pub mean_kv_blocks: f64,
    /// A mixture of experts' tokens per expert (each expert index summed over the layers), and the seconds its
    /// layers spent routing, gathering and combining (the experts' own networks excluded); empty and 0 for dense
    /// models.
    pub expert_tokens: Vec<u64>,
    pub routing_s: f64,
}

impl EngineStats {
    /// A mixture of experts' busiest expert's tokens over the mean expert's; `None` for a dense model.
    pub fn expert_load_max_over_mean(&self) -> Option<f64> {
        let total: u64 = self.expert_tokens.iter().sum();
        let max = self.expert_tokens.iter().copied().max().unwrap_or(0);
        (total > 0).then(|| max as f64 * self.expert_tokens.len() as f64 / total as f64)
    }

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

/// What every engine offers the drive loop: admit while there is room, step, collect the outcomes.
pub trait Engine: Send {
    /// Requests that can be admitted now.
    fn free_places(&self) -> usize;
    /// Admits a request; it runs in a coming step. Callers respect [`Engine::free_places`]. A request the engine
    /// can never run (its parameters are invalid, its prompt does not fit the KV cache budget) is refused as a
    /// failed row.
    fn admit(&mut self, request: Request) -> Result<(), RowFailure>;
    /// Whether any admitted request is unfinished.
    fn has_work(&self) -> bool;
    /// Runs one forward pass and returns the rows that finished in it (or failed, with their row errors).
    fn step(&mut self) -> Result<Vec<Outcome>, EngineError>;
    fn stats(&self) -> &EngineStats;
    /// Makes the calling thread the one the engine's device work runs on (binds a CUDA context); a no-op on the
    /// CPU. The drive loop calls it first.
    fn bind_to_thread(&self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Counts from zero again, as a new engine would (after a benchmark's warm-up); only with nothing admitted.
    fn reset_stats(&mut self);
}
