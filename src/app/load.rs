//! The job's model: checked without loading weights (the same checks for `validate` and `run`), then loaded into
//! the engine its kind runs on, with the preprocessor that turns its rows into requests.


use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::engine::models::bert::{self, Encoder, EncoderInfo};
use crate::engine::attention::AttentionPlan;
use crate::engine::models::llama::{self, ModelConfig, ModelInfo};
use crate::engine::parallel::Decoder;
use crate::engine::models::t5::{T5Config, T5};
use crate::engine::seq2seq::{Seq2SeqEngine, MAX_SOURCE_TOKENS};
use crate::engine::{self, BatchConfig, DecoderSetup, Engine, ModelError, StopRules};
use crate::error::Error;
use crate::job::{AttentionChoice, ComputeDtype, Job, JobError, JobKind};
use crate::source::model::sha256_file;
use crate::sink::ResultsLayout;
use crate::tokenize::{EncoderPreprocessor, Prepare, Preprocessor, TokenizerError};

/// A decoder job's memory against the memory available, as `validate` reports it before any weight is read and
/// `run` and `plan` check it: the weights as stored (the routed experts' share named), the KV cache's bytes per
/// token for the job's `kv_cache_dtype` and the budget `runtime.kv_cache_memory` gives it, and how many tokens
/// that holds.
#[derive(Clone, Debug)]
pub struct MemoryFit {
    pub weights: llama::StoredWeights,
    /// Memory available on the device when checked (before the weights are read).
    pub available: u64,
    pub kv_dtype: &'static str,
    pub kv_bytes_per_token: u64,
    pub kv_budget: u64,
    pub kv_tokens: u64,
    /// The window every layer slides over, where every layer slides: a running sequence gives back its KV blocks
    /// behind it.
    pub window: Option<usize>,
}

impl MemoryFit {
    /// One line for `validate`.
    pub fn describe(&self, cfg: &ModelConfig) -> String {
        let experts = match self.weights.experts {
            0 => String::new(),
            e => format!(" (routed experts {})", bytes_text(e)),
        };
        let window = match self.window {
            Some(w) => format!("; every layer slides over {w} positions, so a sequence holds at most {} tokens' blocks", (w.div_ceil(engine::KV_BLOCK_TOKENS) + 1) * engine::KV_BLOCK_TOKENS),
            None => String::new(),
        };
        format!(
            "memory: weights {} as stored{experts}; KV cache {} bytes a token ({} keys and values, {} layers x {} kv heads x {}), budget {} = {} tokens{window}; {} available",
            bytes_text(self.weights.bytes), self.kv_bytes_per_token, self.kv_dtype, cfg.layers, cfg.kv_heads, cfg.head_dim,
            bytes_text(self.kv_budget), self.kv_tokens, bytes_text(self.available)
        )
    }
}

/// `n` bytes in KiB below 1 MiB, MiB, or GiB from 10 GiB on, for messages.
pub fn bytes_text(n: u64) -> String {
    match n {
        n if n >= 10 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n => format!("{} KiB", n >> 10),
    }
}

/// Refuses a model whose weights, as stored, exceed the memory `available` on its device (exit 4): loading it
/// would end in the kernel's out-of-memory kill, not a message. The stored size is a lower bound of what loading
/// holds (the CPU kernels hold most types in the file's bits a weight or up to 3 % more; Q5_1 and Q5_K a byte per code,
/// up to twice the file's), so nothing that fits is refused.
pub fn check_weights_fit(path: &std::path::Path, weights: llama::StoredWeights, available: u64) -> Result<(), ModelError> {
    if weights.bytes <= available {
        return Ok(());
    }
    let experts = match weights.experts {
        0 => String::new(),
        e => format!(", of which the routed experts {}", bytes_text(e)),
    };
    Err(ModelError::DoesNotFit {
        path: path.into(),
        message: format!("its weights take {} as stored{experts}, more than the {} of memory available", bytes_text(weights.bytes), bytes_text(available)),
    })
}

/// The KV cache budget `runtime.kv_cache_memory` gives a decoder job, with `available` bytes left for it (the
/// weights already counted; `None` where the device does not say, a fraction then taken of 4 GiB), checked: a
/// size larger than what is left, or a budget that holds fewer tokens than a row's first token and its
/// `max_new_tokens`, is refused with the numbers (exit 2). Returns the budget in bytes and in tokens.
pub fn check_kv_budget(job: &Job, cfg: &ModelConfig, kv_dtype: candle_core::DType, block_bytes: u64, available: Option<u64>) -> Result<(u64, u64), JobError> {
    let invalid = |problem: String| JobError::Invalid { path: job.file.clone(), key: "runtime.kv_cache_memory", problem };
    let per_token = block_bytes / engine::KV_BLOCK_TOKENS as u64;
    let budget = match (job.runtime.kv_cache_memory, available) {
        (crate::job::MemoryBudget::Bytes(b), Some(available)) if b > available => {
            return Err(invalid(format!("is {}, more than the {} of memory left for the KV cache beside the model's weights", bytes_text(b), bytes_text(available))));
        }
        (budget, available) => budget.resolve(available.unwrap_or(4 << 30)),
    };
    let tokens = budget / block_bytes.max(1) * engine::KV_BLOCK_TOKENS as u64;
    let need = (1 + u64::from(job.generation.max_new_tokens)).min(cfg.context_length as u64);
    if tokens < need {
        return Err(invalid(format!(
            "gives the KV cache {} = {tokens} tokens at {per_token} bytes a token ({} keys and values of {} layers x {} kv heads x {}), fewer than a row's first token and its generation.max_new_tokens ({}): raise it, or lower max_new_tokens",
            bytes_text(budget), kv_dtype.as_str(), cfg.layers, cfg.kv_heads, cfg.head_dim, job.generation.max_new_tokens
        )));
    }
    Ok((budget, tokens))
}

/// The model as `validate` reports it.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per job
pub enum ModelSummary {
    Decoder(ModelInfo),
    Encoder(EncoderInfo),
    Seq2seq(T5Config),
}

/// The job's model checked without its weights: its metadata, tokenizer and chat template, and the job's
/// generation parameters against it.
#[derive(Debug)]
pub struct ModelCheck {
    pub summary: ModelSummary,
    /// The model file's sha256, or a directory's (over its files' names and hashes), for the fingerprint.
    pub sha256: String,
    /// The chat template, for the fingerprint.
    pub template: Option<String>,
}

/// Checks the job's model as `validate` and `run` both do, before anything is written: what can fail on the model,
/// its tokenizer or the job's parameters against it fails here.
pub fn check_model(job: &Job) -> Result<ModelCheck, Error> {
    let path = &job.model.path;
    check_runtime(job)?;
    Ok(match job.kind {
        JobKind::Generate => {
            let info = llama::inspect(path).map_err(|e| e.at(path))?;
            // A Hugging Face directory is fingerprinted by its files, like the encoders' directories.
            let sha256 = if path.is_dir() { check_model_dir(job)? } else { check_model_file(job)? };
            let pre = Preprocessor::new(&info.vocab, &job.model.chat_template, &job.input, info.config.context_length, job.generation.max_new_tokens)
                .map_err(|e| match e {
                    TokenizerError::Template(problem) => TokenizerError::Template(format!("`{}`: {problem}", path.display())),
                    e => e,
                })?;
            check_generation(job, &info, pre.tokenizer())?;
            ModelCheck { template: info.vocab.chat_template.clone(), summary: ModelSummary::Decoder(info), sha256 }
        }
        JobKind::Seq2seq => {
            let config = T5::inspect(path).map_err(|e| e.at(path))?;
            let sha256 = if path.is_dir() { check_model_dir(job)? } else { check_model_file(job)? };
            seq2seq_tokenizer(job)?;
            ModelCheck { summary: ModelSummary::Seq2seq(config), sha256, template: None }
        }
        JobKind::Embed => {
            let info = bert::inspect(path).map_err(|e| e.at(path))?;
            let sha256 = check_model_dir(job)?;
            EncoderPreprocessor::new(bert::tokenizer(path)?, info.max_tokens, job.input.truncate)?;
            ModelCheck { summary: ModelSummary::Encoder(info), sha256, template: None }
        }
    })
}

/// The `[runtime]` keys that apply to some models only, against the job's: `runtime.dtype` for a Hugging Face
/// decoder, `runtime.attention` for decoders (the keys against each other are checked with the job file, what a
/// device then runs when the model is on it).
fn check_runtime(job: &Job) -> Result<(), JobError> {
    let invalid = |key: &'static str, problem: String| JobError::Invalid { path: job.file.clone(), key, problem };
    let runtime = &job.runtime;
    let decoder = job.kind == JobKind::Generate;
    if runtime.dtype != ComputeDtype::Auto && !(decoder && job.model.path.is_dir()) {
        let model = match job.kind {
            JobKind::Generate => "a GGUF file computes its weights as stored (`runtime.cpu_weights` chooses a CPU layout)",
            _ => "an encoder computes in f32",
        };
        return Err(invalid("runtime.dtype", format!("is \"{}\", which applies to Hugging Face decoders; {model}: remove it or set \"auto\"", runtime.dtype.name())));
    }
    if runtime.cpu_weights == crate::job::CpuWeights::F32 && !(decoder && job.model.path.is_dir()) {
        return Err(invalid("runtime.cpu_weights", "is \"f32\", which widens a Hugging Face decoder's 16-bit matrices; a GGUF file's are \"as-stored\", \"fast\" or \"q8_0\"".into()));
    }
    if runtime.attention != AttentionChoice::Auto && !decoder {
        return Err(invalid("runtime.attention", format!("is \"{}\", which applies to decoders (kind = \"generate\"): remove it or set \"auto\"", runtime.attention.name())));
    }
    Ok(())
}

/// The job's generation parameters against a decoder: its stop token ids, its `n` and its JSON Schema compiled.
fn check_generation(job: &Job, info: &ModelInfo, tokenizer: &crate::tokenize::Tokenizer) -> Result<(), JobError> {
    let invalid = |(key, problem): (&'static str, String)| JobError::Invalid { path: job.file.clone(), key, problem };
    engine::check_params(&job.generation, info.config.vocab_size, job.runtime.max_seqs).map_err(invalid)?;
    if let Some(schema) = &job.generation.json_schema {
        engine::grammars(tokenizer, info.config.vocab_size, &StopRules::new(&info.vocab))
            .and_then(|mut g| g.compile(schema).map(drop))
            .map_err(|e| invalid(("generation.json_schema", format!("cannot be used: {e}"))))?;
    }
    Ok(())
}

fn check_model_file(job: &Job) -> Result<String, ModelError> {
    let path = &job.model.path;
    let actual = sha256_file(path)?;
    if let Some(expected) = &job.model.sha256 {
        if *expected != actual {
            return Err(ModelError::Checksum { path: path.clone(), expected: expected.clone(), actual });
        }
    }
    Ok(actual)
}

/// sha256 over a model directory's files (name and content), for the fingerprint. `model.sha256`, when set, is
/// checked against `model.safetensors`.
fn check_model_dir(job: &Job) -> Result<String, ModelError> {
    let mut hasher = Sha256::new();
    for file in bert::model_files(&job.model.path) {
        let sha = sha256_file(&file)?;
        if file.file_name().is_some_and(|n| n == "model.safetensors") {
            if let Some(expected) = job.model.sha256.as_ref().filter(|e| **e != sha) {
                return Err(ModelError::Checksum { path: file, expected: expected.clone(), actual: sha });
            }
        }
        hasher.update(file.strip_prefix(&job.model.path).unwrap_or(&file).to_string_lossy().as_bytes());
        hasher.update(sha.as_bytes());
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// What a decoder's engine was configured with, for `plan`'s report.
pub struct DecoderPlan {
    pub model: ModelConfig,
    pub batch: BatchConfig,
    /// KV cache bytes of one block on the engine's backend (every tensor-parallel rank's together).
    pub block_bytes: usize,
    /// Each tensor-parallel rank's heads, weights and KV block (one entry for a whole model).
    pub ranks: Vec<engine::parallel::RankMemory>,
}

/// A job's model, loaded into its engine.
pub struct Loaded {
    pub engine: Box<dyn Engine>,
    pub prepare: Box<dyn Prepare>,
    pub check: ModelCheck,
    pub weights_bytes: usize,
    /// How the weights are computed ([`Layout::name`](crate::engine::Layout::name)).
    pub weights_layout: &'static str,
    /// How the KV cache holds keys and values: `f32`, `f16` or `bf16`; `none` for an encoder, which has none.
    pub kv_cache_dtype: &'static str,
    /// The attention backend and kernel: `host`, `paged-tiled` or `paged-flash`; `none` for an encoder.
    pub attention: &'static str,
    /// The dtype a Hugging Face decoder computes in, where the job named one other than the device's default
    /// (`runtime.dtype`): part of the numerics.
    pub compute_dtype: Option<&'static str>,
    pub layout: ResultsLayout,
    /// Requests queued for the engine: an encoder sorts a window of them by length, so it gets a deeper queue.
    pub queue: usize,
    /// A decoder's configuration; `None` for the other kinds.
    pub decoder: Option<DecoderPlan>,
    /// Ranks the decoder is split over (`runtime.tensor_parallel`; 1 for a whole model and the other kinds).
    pub tensor_parallel: usize,
}

/// A seq2seq model's tokenizer (a directory's `tokenizer.json`, a GGUF file's vocabulary) and the rows' preprocessor.
fn seq2seq_tokenizer(job: &Job) -> Result<(crate::tokenize::Tokenizer, Box<EncoderPreprocessor>), Error> {
    let path = &job.model.path;
    if path.is_dir() {
        let tokenizer = bert::tokenizer(path)?;
        let prepare = EncoderPreprocessor::new(tokenizer.clone(), MAX_SOURCE_TOKENS, job.input.truncate)?;
        return Ok((crate::tokenize::Tokenizer::Hf(std::sync::Arc::new(tokenizer)), Box::new(prepare)));
    }
    let vocab = llama::gguf::vocabulary(path).map_err(|e| e.at(path))?;
    let gguf = vocab.gguf.ok_or_else(|| crate::tokenize::TokenizerError::Invalid("a GGUF file without its vocabulary".into()))?;
    let prepare = EncoderPreprocessor::gguf(std::sync::Arc::clone(&gguf), MAX_SOURCE_TOKENS, job.input.truncate)?;
    Ok((crate::tokenize::Tokenizer::Gguf(gguf), Box::new(prepare)))
}

/// Checks the job's model ([`check_model`]) and loads it onto `device`.
pub fn load(job: &Job, device: &candle_core::Device) -> Result<Loaded, Error> {
    let check = check_model(job)?;
    if device.is_cpu() {
        engine::kernels::Level::choose(job.runtime.cpu_kernels);
    }
    match job.kind {
        JobKind::Generate => load_decoder(job, device, check),
        JobKind::Seq2seq => {
            let model = T5::load(&job.model.path, device).map_err(|e| e.at(&job.model.path))?;
            let c = &model.config;
            // It computes in f32: `weights` says whether the stored weights were widened to it.
            info!(layers = c.num_layers, decoder_layers = c.decoder_layers(), d_model = c.d_model, heads = c.num_heads, weights = model.weights_layout(), "encoder-decoder");
            let (tokenizer, prepare) = seq2seq_tokenizer(job)?;
            let weights_bytes = model.weight_bytes();
            let engine = Seq2SeqEngine::new(model, tokenizer, job.generation.clone(), job.runtime.max_seqs);
            let queue = job.runtime.max_seqs * 2;
            let weights_layout = engine.model().weights_layout();
            Ok(Loaded { engine: Box::new(engine), prepare, check, weights_bytes, weights_layout, kv_cache_dtype: "f32", attention: "none", compute_dtype: None, layout: ResultsLayout::Generate, queue, decoder: None, tensor_parallel: 1 })
        }
        JobKind::Embed => {
            let encoder = Encoder::load(&job.model.path, device).map_err(|e| e.at(&job.model.path))?;
            let info = &encoder.info;
            info!(layers = info.config.num_hidden_layers, dimensions = info.dimensions, pooling = ?info.pooling,
                normalize = info.normalize, max_tokens = info.max_tokens, "encoder");
            let prepare = EncoderPreprocessor::new(bert::tokenizer(&job.model.path)?, info.max_tokens, job.input.truncate)?;
            let (layout, weights_bytes) = (ResultsLayout::Embed { dimensions: info.dimensions }, encoder.weight_bytes());
            let engine = engine::embed::EmbedEngine::new(encoder, job.runtime.max_seqs, job.runtime.max_batch_tokens);
            let queue = engine::embed::WINDOW;
            Ok(Loaded { engine: Box::new(engine), prepare: Box::new(prepare), check, weights_bytes, weights_layout: llama::Layout::AsStored.name(), kv_cache_dtype: "none", attention: "none", compute_dtype: None, layout, queue, decoder: None, tensor_parallel: 1 })
        }
    }
}

fn load_decoder(job: &Job, device: &candle_core::Device, check: ModelCheck) -> Result<Loaded, Error> {
    let ranks = job.runtime.tensor_parallel;
    if ranks > 1 && !device.is_cpu() {
        return Err(Error::Job(JobError::Invalid {
            path: job.file.clone(),
            key: "runtime.tensor_parallel",
            problem: format!("is {ranks}, and the job runs on a GPU: this build splits a model over CPU threads only (NCCL ranks are planned); on GPUs use --data-parallel, or runtime.device = \"cpu\""),
        }));
    }
    // On the CPU, before any weight is read: there what loading holds is at least what the files store. (A GPU
    // may hold an f32 checkpoint in bf16; running out there is CUDA's error, not the kernel's kill.)
    if let (ModelSummary::Decoder(info), true) = (&check.summary, device.is_cpu()) {
        check_weights_fit(&job.model.path, info.weights, crate::host::available_memory_bytes().unwrap_or(u64::MAX))?;
    }
    let (decoder, info) = Decoder::load(&job.model.path, device, job.runtime.cpu_weights, job.runtime.dtype, ranks).map_err(|e| e.at(&job.model.path))?;
    let model = decoder.first();
    let cfg = &info.config;
    let invalid = |key: &'static str, problem: String| crate::job::JobError::Invalid { path: job.file.clone(), key, problem };
    let plan = AttentionPlan::choose(model, job.runtime.attention).map_err(|problem| invalid("runtime.attention", problem))?;
    let backend = plan.backend;
    let kv_dtype = backend
        .kv_dtype(model, job.runtime.kv_cache_dtype)
        .map_err(|problem| invalid("runtime.kv_cache_dtype", problem))?;
    let block_bytes = decoder.block_bytes(backend, kv_dtype);
    let step_tokens = job.runtime.max_batch_tokens.max(job.runtime.max_seqs);
    let rank_memory = decoder.memory(backend, kv_dtype, step_tokens, job.runtime.max_seqs);
    for r in rank_memory.iter().filter(|_| ranks > 1) {
        info!(rank = r.rank, heads = r.heads, kv_heads = r.kv_heads, ffn_columns = r.ffn_columns, weights_mib = r.weights_bytes >> 20,
            activations_mib = r.activations_bytes >> 20, kv_bytes_per_token = r.block_bytes / engine::KV_BLOCK_TOKENS, "tensor-parallel rank");
    }
    let attention = plan.name();
    let compute_dtype = (job.model.path.is_dir() && model.dtype() != llama::hf::compute_dtype(device, ComputeDtype::Auto)).then(|| model.dtype().as_str());
    let weights_layout = model.weights_name();
    info!(architecture = %cfg.architecture, layers = cfg.layers, hidden = cfg.hidden_size, context = cfg.context_length,
        dtype = ?model.dtype(), weights = weights_layout, cpu_weights = %job.runtime.cpu_weights.name(),
        cpu_kernels = (device.is_cpu() && model.layout().on_kernels()).then(engine::kernels::Level::active_name), attention, tensor_parallel = ranks,
        kv_cache_dtype = kv_dtype.as_str(), kv_bytes_per_token = block_bytes / engine::KV_BLOCK_TOKENS, "decoder");
    // The budget from what is left now that the weights are in memory.
    let (kv_bytes, _) = check_kv_budget(job, cfg, kv_dtype, block_bytes as u64, engine::device_memory_available(device))?;
    // The ranks share this process's memory: their activations and one sequence's KV blocks must fit beside the
    // weights they loaded.
    if ranks > 1 {
        let one_sequence = cfg.context_length.min(job.runtime.max_batch_tokens).div_ceil(engine::KV_BLOCK_TOKENS) * block_bytes;
        let available = engine::device_memory_available(device).unwrap_or(u64::MAX);
        engine::parallel::check_fits(&rank_memory, one_sequence, available).map_err(|problem| Error::Job(invalid("runtime.tensor_parallel", problem)))?;
    }
    let mut batch = BatchConfig::new(job.runtime.max_seqs, job.runtime.max_batch_tokens, kv_bytes, block_bytes);
    batch.prefix_cache = job.runtime.prefix_cache;
    batch.window = engine::attention::AttentionModel::attention_shape(model).window_of_every_layer();
    let longest = batch.max_sequence_tokens(cfg.context_length);
    info!(
        max_seqs = batch.max_seqs, max_batch_tokens = batch.max_batch_tokens, prefix_cache = batch.prefix_cache,
        kv_cache_mib = (batch.kv_blocks * block_bytes) >> 20, kv_tokens = batch.kv_tokens(),
        tokens_per_seq_at_max_seqs = batch.kv_tokens() / batch.max_seqs, longest_sequence = longest,
        "engine configured: {} sequences fit at {} tokens each, before preemption",
        batch.kv_tokens() / longest.max(1), longest
    );
    if longest < cfg.context_length {
        warn!(context = cfg.context_length, longest, "the KV cache budget holds less than the model's context; longer rows fail with prompt_too_long (raise runtime.kv_cache_memory)");
    }
    // Prompts are checked against the longest sequence the engine can run, so one that can never fit is an error
    // row at tokenization, not a stall.
    let preprocessor = Preprocessor::new(&info.vocab, &job.model.chat_template, &job.input, longest, job.generation.max_new_tokens)?;
    let weights_bytes = decoder.weight_bytes();
    let plan_report = DecoderPlan { model: cfg.clone(), batch: batch.clone(), block_bytes, ranks: rank_memory };
    let setup = DecoderSetup { tokenizer: preprocessor.tokenizer().clone(), params: job.generation.clone(), stop: StopRules::new(&info.vocab), config: batch, kv_dtype, attention: plan };
    let engine = decoder.engine(setup).map_err(Error::Engine)?;
    let decoder = plan_report;
    let queue = job.runtime.max_seqs * 2;
    let kv_cache_dtype = kv_dtype.as_str();
    Ok(Loaded { engine, prepare: Box::new(preprocessor), check, weights_bytes, weights_layout, kv_cache_dtype, attention, compute_dtype, layout: ResultsLayout::Generate, queue, decoder: Some(decoder), tensor_parallel: ranks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_larger_than_the_memory_available_are_refused_with_the_numbers() {
        let path = std::path::Path::new("models/big.gguf");
        let weights = llama::StoredWeights { bytes: 47 << 30, experts: 44 << 30 };
        let refused = check_weights_fit(path, weights, 31 << 30).unwrap_err();
        assert!(matches!(refused, ModelError::DoesNotFit { .. }));
        assert_eq!(
            refused.to_string(),
            "`models/big.gguf` does not fit in memory: its weights take 47.0 GiB as stored, of which the routed experts 44.0 GiB, more than the 31.0 GiB of memory available"
        );
        assert!(check_weights_fit(path, weights, 47 << 30).is_ok(), "exactly as much as available fits");
        let dense = llama::StoredWeights { bytes: 700 << 20, experts: 0 };
        assert_eq!(
            check_weights_fit(path, dense, 512 << 20).unwrap_err().to_string(),
            "`models/big.gguf` does not fit in memory: its weights take 700 MiB as stored, more than the 512 MiB of memory available"
        );
    }

    #[test]
    fn stored_weights_count_routed_experts_by_their_names_in_both_formats() {
        let mut w = llama::StoredWeights::default();
        for (name, bytes) in [
            ("blk.0.ffn_gate_exps.weight", 10),
            ("blk.0.ffn_gate_shexp.weight", 100),
            ("blk.0.ffn_gate_inp.weight", 1000),
            ("model.layers.0.block_sparse_moe.experts.3.w1.weight", 10_000),
            ("model.layers.0.mlp.shared_expert.gate_proj.weight", 100_000),
        ] {
            w.add(name, bytes);
        }
        assert_eq!(w, llama::StoredWeights { bytes: 111_110, experts: 10_010 });
    }
}
