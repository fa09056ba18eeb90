//! The command line: one subcommand per verb. Printing to stdout happens here and nowhere else.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::job::Overrides;

mod print;
mod tokenize;
pub use tokenize::{peer_header, peer_line, tokenize};
pub use print::*;

#[derive(Debug, Parser)]
#[command(name = "nightshift", version, about = "Offline batch LLM jobs: Parquet prompts in, Parquet results out")]
pub struct Cli {
    /// Log format on stderr. Levels come from RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a job: read the input, generate, write results and metrics.
    Run(RunArgs),
    /// Check a job file, the input's columns and the model's metadata, without generating or writing.
    Validate(JobArgs),
    /// Plan a generate job without running it: tokenize every row, show the prompt-length histogram and
    /// over-length rows, the schedule the engine would make (length buckets, prefill steps, KV cache fit,
    /// preemptions) and a duration estimate from a short calibration run. Nothing touches the output.
    Plan(PlanArgs),
    /// Complete an output whose units are all committed: remove uncommitted attempts' files, write
    /// `_manifest.json` and `_SUCCESS`. Safe to run repeatedly and concurrently; exits 75 while units are missing.
    Finalize(FinalizeArgs),
    /// Show an output's progress per shard: committed and missing units, rows done, throughput (from the metrics
    /// files). Reads only.
    Status(StatusArgs),
    /// Render an output's job report, complete or not: one self-contained HTML page (inline SVG charts, no
    /// scripts, nothing fetched) with the job, its outcome, throughput over time per shard and attempt, length and
    /// latency distributions, KV cache and memory, and the slowest units. Reads only. (Finalize writes the same
    /// page into every completed output as `_report.html`.)
    Report(ReportArgs),
    /// Write a completed output in another format: `--format openai-batch` writes `results.jsonl` and
    /// `errors.jsonl` under `--to` (a path or an object-store URL), the two files OpenAI's Batch API returns, a
    /// line per row in input order. Reads the output; streams.
    Export(ExportArgs),
    /// Measure throughput on a synthetic workload (in-process, no object-store I/O).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Tokenize texts with a model's tokenizer as a job does (a GGUF file's vocabulary exactly as llama.cpp reads
    /// it; a vocabulary-only GGUF is enough): one text per line of standard input, or `--text`; one JSON line out
    /// per text, `{"ids": [...], "text": "..."}`, the text detokenized from the ids.
    Tokenize(TokenizeArgs),
    /// Write a random-weight decoder (llama, qwen2, qwen3, gemma2, gemma3, phi3) of a published model's shape as a Hugging Face directory
    /// (safetensors, config, byte-level tokenizer, ChatML template): real shapes where real weights cannot go.
    SynthModel(SynthModelArgs),
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// A GGUF file or a Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The text to tokenize, instead of standard input's lines.
    #[arg(long)]
    pub text: Option<String>,
    /// Input lines are hex-encoded bytes (any bytes, malformed UTF-8 included; a newline is `0a`).
    #[arg(long)]
    pub hex: bool,
    /// Read special tokens' texts (`<|im_start|>`) as text, not as those tokens.
    #[arg(long)]
    pub no_parse_special: bool,
    /// Add the BOS and EOS tokens the model asks for (llama.cpp's `add_special`).
    #[arg(long)]
    pub add_special: bool,
    /// `json`, or `peer`: for `scripts/compare-tokenizers.py`, the tab-separated fields `scripts/llama-peer.cpp`
    /// writes for llama.cpp, from hex lines (or `#` and token ids to detokenize); the other flags are ignored.
    #[arg(long, value_enum, default_value_t = TokenizeFormat::Json)]
    pub format: TokenizeFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenizeFormat {
    Json,
    Peer,
}

#[derive(Debug, Args)]
pub struct SynthModelArgs {
    /// The directory to write (created if needed).
    pub dir: PathBuf,
    /// The shape: `llama-3.2-1b`, `smollm2-135m`, `qwen2.5-0.5b`, `qwen3-0.6b`, `gemma-3-1b`, `gemma-2-2b`, `phi-3-mini`,
    /// `phi-4-mini`, `qwen3-moe-reduced`, `mixtral-reduced`, `qwen2-moe-reduced`, `olmoe-reduced` or `tiny`; or an
    /// encoder-decoder:
    /// `t5-small`, `flan-t5-small`, `flan-t5-base`.
    #[arg(long, default_value = "llama-3.2-1b")]
    pub shape: String,
    /// Weight type: `bf16`, `f16` or `f32`.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the weights as a GGUF file of this quantization beside them (`model-<type>.gguf`): `q4_0`,
    /// `q4_1`, `q8_0`, `q4k`, `q6k`, ... (candle's names), for the GGUF path's kernels.
    #[arg(long)]
    pub gguf: Option<String>,
    /// The context length, instead of the shape's (`tiny` has 1,024 positions; long prompts on a small model).
    #[arg(long)]
    pub context: Option<usize>,
    /// Fewer layers than the shape's (its attention, norms and vocabulary kept): a check of a family's kernels
    /// that needs no multi-gigabyte model.
    #[arg(long)]
    pub layers: Option<usize>,
    /// A shorter sliding window than the shape's, for a shape that has one: windowed attention at short prompts.
    #[arg(long)]
    pub window: Option<usize>,
    /// The GGUF's tokenizer from this GGUF file (a model's, or one of llama.cpp's `ggml-vocab-*.gguf`), with its
    /// size as the embedding's rows: a real vocabulary both nightshift and llama.cpp load (Qwen2's, SentencePiece's,
    /// ...). The directory's tokenizer.json stays the byte-level one.
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// How weights are drawn: `hf` (Hugging Face's initialisation; for speed, where only shapes matter), `peaked`
    /// (every weight shows in the logits, as the tests' models) or `fidelity` (peaked logits whose top token still
    /// depends on the context: for fidelity against llama.cpp, scripts/fidelity-llama.py).
    #[arg(long, default_value = "hf")]
    pub init: String,
}

impl SynthModelArgs {
    /// The GGUF quantization asked for, if any.
    pub fn gguf_type(&self) -> Result<Option<candle_core::quantized::GgmlDType>, crate::error::Error> {
        use candle_core::quantized::GgmlDType::*;
        let Some(name) = self.gguf.as_deref() else { return Ok(None) };
        let all = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, F16, F32];
        all.into_iter()
            .find(|t| format!("{t:?}").eq_ignore_ascii_case(name))
            .map(Some)
            .ok_or_else(|| crate::error::Error::Internal(format!("--gguf must be one of q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k, f16, f32; got {name:?}")))
    }

    pub fn run(&self) -> Result<crate::synth::SynthReport, crate::error::Error> {
        let dtype = match self.dtype.as_str() {
            "bf16" => candle_core::DType::BF16,
            "f16" => candle_core::DType::F16,
            "f32" => candle_core::DType::F32,
            other => return Err(crate::error::Error::Internal(format!("--dtype must be bf16, f16 or f32, got {other:?}"))),
        };
        let mut shape = crate::synth::Shape::named(&self.shape)?;
        if let Some(context) = self.context {
            if context == 0 {
                return Err(crate::error::Error::Usage("--context must be at least 1".into()));
            }
            shape.context = context;
        }
        if let Some(layers) = self.layers {
            if layers == 0 || layers > shape.layers {
                return Err(crate::error::Error::Usage(format!("--layers must be 1 to the shape's {}, got {layers}", shape.layers)));
            }
            shape.layers = layers;
        }
        if let Some(window) = self.window {
            match shape.sliding_window {
                Some(_) if window > 0 => shape.sliding_window = Some(window),
                Some(_) => return Err(crate::error::Error::Usage("--window must be at least 1".into())),
                None => return Err(crate::error::Error::Usage(format!("--window: the shape {} has no sliding window", self.shape))),
            }
        }
        if let Some(tokenizer) = self.tokenizer()? {
            shape.vocab = tokenizer.size();
        }
        let init = match self.init.as_str() {
            "hf" => crate::synth::Init::Hf,
            "peaked" => crate::synth::Init::Peaked,
            "fidelity" => crate::synth::Init::Fidelity,
            other => return Err(crate::error::Error::Usage(format!("--init must be hf, peaked or fidelity, got {other:?}"))),
        };
        crate::synth::synth_model(&self.dir, &shape, dtype, self.seed, init)
    }

    /// A T5 shape (`t5-small`, `flan-t5-small`, `flan-t5-base`): writes it (and its GGUF with `--gguf`) and returns
    /// what was written; `None` for a decoder's shape. `--vocab` gives the GGUF its vocabulary (a `t5` one) and the
    /// model its size; `--layers` cuts the encoder's and the decoder's layers alike. T5's weights are always drawn
    /// peaked (crate::synth::t5).
    pub fn run_t5(&self, quant: Option<candle_core::quantized::GgmlDType>) -> Result<Option<crate::synth::t5::T5Report>, crate::error::Error> {
        let Some(mut shape) = crate::synth::t5::T5Shape::named(&self.shape) else { return Ok(None) };
        if self.dtype != "f32" && self.dtype != "bf16" || self.context.is_some() || self.window.is_some() || !matches!(self.init.as_str(), "hf" | "peaked" | "fidelity") {
            return Err(crate::error::Error::Usage(format!("{}: a T5 is written in f32, peaked, at its own context; --dtype, --context, --window and --init do not apply", self.shape)));
        }
        if let Some(layers) = self.layers {
            if layers == 0 || layers > shape.layers {
                return Err(crate::error::Error::Usage(format!("--layers must be 1 to the shape's {}, got {layers}", shape.layers)));
            }
            (shape.layers, shape.decoder_layers) = (layers, layers);
        }
        let tokenizer = self.tokenizer()?;
        if let Some(t) = &tokenizer {
            shape.vocab = t.size();
        }
        let report = crate::synth::t5::write_t5(&self.dir, &shape, self.seed, tokenizer.is_none())?;
        if let Some(quant) = quant {
            let (path, bytes) = crate::synth::t5::t5_gguf(&self.dir, quant, tokenizer.as_ref())?;
            crate::cli::print_written(&path, bytes);
        }
        Ok(Some(report))
    }

    /// The GGUF's tokenizer `--vocab` names, if any.
    pub fn tokenizer(&self) -> Result<Option<crate::synth::GgufTokenizer>, crate::error::Error> {
        self.vocab.as_deref().map(crate::synth::GgufTokenizer::from_file).transpose()
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// A decoder: requests/s, total and output tokens/s, TTFT and TPOT percentiles and peak memory on an offline
    /// workload of synthetic prompts (every request ready at the start).
    Generate(GenerateBenchArgs),
    /// An embedding model: rows/s and tokens/s over rows of random lengths, batched as embedding jobs batch them.
    Embed(EmbedBenchArgs),
    /// The device's forward pass (the paged path GPUs run) against the CPU's in f32 on the same weights, and
    /// batched against one sequence at a time: logit differences and argmax agreement, within stated
    /// tolerances (exit 1 outside them).
    Parity(ParityBenchArgs),
    /// The CPU kernels on a GGUF file's own matrices (one layer's and the output projection): GFLOP/s per
    /// instruction-set level and row count.
    Kernels(KernelBenchArgs),
}

#[derive(Debug, Args)]
pub struct KernelBenchArgs {
    /// A GGUF decoder.
    #[arg(long)]
    pub model: PathBuf,
    /// Activation rows per product.
    #[arg(long, value_delimiter = ',', value_parser = at_least_one, default_value = "1,16,128")]
    pub rows: Vec<usize>,
    /// Levels to measure: portable, avx2, vnni, avx512-bf16, amx (default: every one this CPU has).
    #[arg(long, value_delimiter = ',', value_parser = parse_level)]
    pub levels: Vec<crate::engine::kernels::Level>,
    /// CPU threads (default: one per core).
    #[arg(long, value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// Cache lengths at which to measure a decode step's attention, every layer (f32 and f16 caches, at the
    /// active kernel level); `--contexts 0` for none.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    pub contexts: Vec<usize>,
    /// Sequences in that decode step.
    #[arg(long, value_parser = at_least_one, default_value = "16")]
    pub seqs: usize,
    /// Positions at the start of those sequences' caches that all of them hold in common, the same blocks (as a
    /// prefix cache hit holds a shared instruction); 0 for none.
    #[arg(long, default_value = "0")]
    pub shared_prefix: usize,
    /// Prefills whose attention to measure, every layer, as CACHED+NEW (positions already in the cache, tokens in
    /// the chunk): one sequence's prefill over a cached prefix; `--prefills none` for none.
    #[arg(long, value_delimiter = ',', value_parser = parse_prefill, default_value = "600+150")]
    pub prefills: Vec<Option<(usize, usize)>>,
    /// Print one JSON object per measurement.
    #[arg(long)]
    pub json: bool,
}

/// A count that must be at least one (rows, tokens, sequences, threads): zero is a bad command line (exit 2), not
/// a panic later.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}")),
    }
}

fn parse_prefill(text: &str) -> Result<Option<(usize, usize)>, String> {
    if text == "none" {
        return Ok(None);
    }
    let parsed = text.split_once('+').and_then(|(c, n)| Some((c.trim().parse::<usize>().ok()?, n.trim().parse::<usize>().ok()?)));
    match parsed {
        Some((cached, new)) if new > 0 => Ok(Some((cached, new))),
        _ => Err(format!("must be CACHED+NEW (positions in the cache, new tokens at least 1) or none, got {text:?}")),
    }
}

fn parse_level(text: &str) -> Result<crate::engine::kernels::Level, String> {
    crate::engine::kernels::Level::parse(text).ok_or_else(|| format!("must be portable, avx2, vnni or amx, got {text:?}"))
}

impl KernelBenchArgs {
    pub fn options(&self) -> crate::bench::KernelBenchOptions {
        let contexts = self.contexts.iter().copied().filter(|&c| c > 0).collect();
        let prefills = self.prefills.iter().flatten().copied().collect();
        crate::bench::KernelBenchOptions { model: self.model.clone(), rows: self.rows.clone(), levels: self.levels.clone(), contexts, seqs: self.seqs, shared_prefix: self.shared_prefix, prefills }
    }
}

#[derive(Debug, Args)]
pub struct ParityBenchArgs {
    /// The decoder: a GGUF file or a Hugging Face directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The device to check: `auto`, `cpu` (the paged path on the CPU), `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = crate::job::DeviceChoice::parse)]
    pub device: crate::job::DeviceChoice,
    /// The device's dtype for a Hugging Face directory: `f32`, `bf16` or `f16` (default: bf16 on a GPU, f32 on
    /// the CPU).
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<candle_core::DType>,
    /// Prompt lengths in tokens, prefilled together.
    #[arg(long, value_delimiter = ',', default_value = "7,23,64,150")]
    pub prompt_lengths: Vec<usize>,
    /// Greedy decode steps after the prefill.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also compare the model split over N tensor-parallel ranks (threads on the CPU) with the reference.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: u32,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_dtype(text: &str) -> Result<candle_core::DType, String> {
    match text {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => Err(format!("must be f32, bf16 or f16, got {other:?}")),
    }
}

impl ParityBenchArgs {
    pub fn options(&self) -> crate::bench::ParityOptions {
        crate::bench::ParityOptions {
            model: self.model.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            prompt_lengths: self.prompt_lengths.clone(),
            steps: self.steps,
            seed: self.seed,
            tensor_parallel: self.tensor_parallel as usize,
        }
    }
}

#[derive(Debug, Args)]
pub struct GenerateBenchArgs {
    /// The decoder: a GGUF file or a Hugging Face directory.
    #[arg(long)]
    pub model: PathBuf,
    /// `fixed`: end of sequence ignored, every row generates its drawn length; `natural`: rows stop at the end
    /// of turn.
    #[arg(long, value_enum, default_value_t = crate::bench::Workload::Fixed)]
    pub workload: crate::bench::Workload,
    #[arg(long, value_parser = at_least_one, default_value_t = 64)]
    pub rows: usize,
    /// Shortest prompt, in tokens with the chat template.
    #[arg(long, value_parser = at_least_one, default_value_t = 100)]
    pub min_prompt: usize,
    #[arg(long, value_parser = at_least_one, default_value_t = 1000)]
    pub max_prompt: usize,
    /// Fewest new tokens a row asks for.
    #[arg(long, value_parser = at_least_one, default_value_t = 32)]
    pub min_new: usize,
    #[arg(long, value_parser = at_least_one, default_value_t = 256)]
    pub max_new: usize,
    /// Sequences decoded together.
    #[arg(long, value_parser = at_least_one, default_value_t = 32)]
    pub max_seqs: usize,
    /// Prompt tokens prefilled in one step.
    #[arg(long, value_parser = at_least_one, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// KV cache budget: a size ("2GiB"), a share of the memory available after the model loads ("40%"), or
    /// "auto" (50 %), as `runtime.kv_cache_memory`.
    #[arg(long, default_value = "auto", value_parser = crate::job::MemoryBudget::parse)]
    pub kv_cache_memory: crate::job::MemoryBudget,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads (default: every core).
    #[arg(long, value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// `auto` (cuda:0 when this build has CUDA and a GPU, else the CPU), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = crate::job::DeviceChoice::parse)]
    pub device: crate::job::DeviceChoice,
    /// Rows (8 new tokens each) run before the timed run: a GPU loads its kernels on first use.
    #[arg(long, default_value_t = 0)]
    pub warmup_rows: usize,
    /// How a GGUF's weights are laid out on the CPU, as `runtime.cpu_weights`: `as-stored`, `fast` or `q8_0`.
    #[arg(long, default_value = "as-stored", value_parser = crate::job::CpuWeights::parse)]
    pub cpu_weights: crate::job::CpuWeights,
    /// How the KV cache holds keys and values, as `runtime.kv_cache_dtype`: `auto`, `f32`, `f16` or `bf16`.
    #[arg(long, default_value = "auto", value_parser = crate::job::KvCacheDtype::parse)]
    pub kv_cache_dtype: crate::job::KvCacheDtype,
    /// Every prompt starts with the same instruction of about this many tokens, before its own text (whose length
    /// --min-prompt and --max-prompt then draw): a workload for the prefix cache.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// The prefix cache, as `runtime.prefix_cache`: `true` or `false`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_cache: bool,
    /// Write the workload's requests (token ids, output lengths) to this file, one JSON object per line, for a
    /// peer to run the same requests (`scripts/bench-llama-server.py`).
    #[arg(long)]
    pub save_workload: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl GenerateBenchArgs {
    pub fn options(&self) -> crate::bench::GenerateBenchOptions {
        crate::bench::GenerateBenchOptions {
            model: self.model.clone(),
            workload: self.workload,
            rows: self.rows,
            min_prompt: self.min_prompt,
            max_prompt: self.max_prompt,
            min_new: self.min_new,
            max_new: self.max_new,
            max_seqs: self.max_seqs,
            max_batch_tokens: self.max_batch_tokens,
            kv_cache_memory: self.kv_cache_memory,
            temperature: self.temperature,
            seed: self.seed,
            save_workload: self.save_workload.clone(),
            device: self.device.clone(),
            warmup_rows: self.warmup_rows,
            cpu_weights: self.cpu_weights,
            kv_cache_dtype: self.kv_cache_dtype,
            shared_prefix: self.shared_prefix,
            prefix_cache: self.prefix_cache,
            attention: self.engine.attention.unwrap_or_default(),
            dtype: self.engine.dtype.unwrap_or_default(),
            cpu_kernels: self.engine.cpu_kernels.unwrap_or_default(),
            tensor_parallel: self.engine.tensor_parallel.unwrap_or(1) as usize,
        }
    }
}

#[derive(Debug, Args)]
pub struct EmbedBenchArgs {
    /// The encoder's Hugging Face directory.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, value_parser = at_least_one, default_value_t = 2000)]
    pub rows: usize,
    /// Shortest row, in tokens.
    #[arg(long, value_parser = at_least_one, default_value_t = 16)]
    pub min_tokens: usize,
    /// Longest row, in tokens (at most the model's limit).
    #[arg(long, value_parser = at_least_one, default_value_t = 256)]
    pub max_tokens: usize,
    /// Rows per batch.
    #[arg(long, value_parser = at_least_one, default_value_t = 32)]
    pub max_seqs: usize,
    /// Padded tokens per batch.
    #[arg(long, value_parser = at_least_one, default_value_t = 4096)]
    pub max_batch_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads (default: every core).
    #[arg(long, value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl EmbedBenchArgs {
    pub fn options(&self) -> crate::bench::EmbedBenchOptions {
        crate::bench::EmbedBenchOptions {
            model: self.model.clone(),
            rows: self.rows,
            min_tokens: self.min_tokens,
            max_tokens: self.max_tokens,
            max_seqs: self.max_seqs,
            max_batch_tokens: self.max_batch_tokens,
            seed: self.seed,
        }
    }
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The job's output URL or path.
    pub output: String,
    /// Print the status as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The job's output URL or path.
    pub output: String,
    /// Write the page to this file instead of standard output.
    #[arg(long)]
    pub to: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    /// OpenAI's (and Azure OpenAI's) Batch API output and error files.
    OpenaiBatch,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The job's output URL or path (complete: `_SUCCESS` written).
    pub output: String,
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// Where the files go: a directory or an object-store prefix.
    #[arg(long)]
    pub to: String,
    /// The model name the response bodies carry (default: the model file's name).
    #[arg(long)]
    pub model: Option<String>,
}

#[derive(Debug, Args)]
pub struct FinalizeArgs {
    /// The job's output URL or path.
    pub output: String,
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub job: JobArgs,
    /// Rows of the job run (32 new tokens at most each) to measure prefill and decode speed; 0 skips it.
    #[arg(long, default_value_t = 16)]
    pub calibration_rows: usize,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobArgs {
    /// The job file (TOML).
    pub job: PathBuf,
    /// Input URL or path; overrides `input.url`.
    #[arg(long)]
    pub input: Option<String>,
    /// Output URL or path; overrides `output.url`.
    #[arg(long)]
    pub output: Option<String>,
    /// Model file; overrides `model.path`.
    #[arg(long)]
    pub model: Option<String>,
    /// Sequences decoded together; overrides `runtime.max_seqs`.
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Shards the plan is cut into when this run writes it; overrides `output.shards`. With `--shard auto`, the
    /// count for schedulers that do not put it in the environment (a Kubernetes Indexed Job's `completions`).
    #[arg(long, env = "NIGHTSHIFT_SHARDS")]
    pub shards: Option<u32>,
    /// A completed output of an earlier run whose rows, where a row's request key matches, are copied instead of
    /// computed; repeatable, added to `reuse.from`.
    #[arg(long = "reuse", value_name = "OUTPUT_URL")]
    pub reuse: Vec<String>,
    /// Let `--reuse` sources without `_SUCCESS` serve their committed units (`reuse.allow_incomplete`).
    #[arg(long)]
    pub reuse_incomplete: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// How the engine computes, where a job (or a benchmark) wants other than the defaults. Each also reads an
/// environment variable, so a test or a script sets it for every command it runs.
#[derive(Clone, Debug, Default, Args)]
pub struct EngineArgs {
    /// Which attention a decoder runs; overrides `runtime.attention`: `auto`, `host` (f32 on the CPU), `host-amx`
    /// (`host` with its prefills on Intel's AMX-BF16 tiles, split bf16 products: not the same bits), `paged-tiled` (the paged backend's tiles, any device: on the CPU, what an accelerator runs), `paged-decode`
    /// (CUDA: decodes by nightshift's kernel, prefills in tiles) or `paged-flash`.
    #[arg(long, env = "NIGHTSHIFT_ATTENTION", value_parser = crate::job::AttentionChoice::parse)]
    pub attention: Option<crate::job::AttentionChoice>,
    /// The dtype a Hugging Face decoder computes in; overrides `runtime.dtype`: `auto` (f32 on the CPU, bf16 on an
    /// accelerator), `f32`, `bf16` or `f16`.
    #[arg(long, env = "NIGHTSHIFT_DTYPE", value_parser = crate::job::ComputeDtype::parse)]
    pub dtype: Option<crate::job::ComputeDtype>,
    /// The CPU kernels' instruction set; overrides `runtime.cpu_kernels`: `auto`, `portable`, `avx2`, `vnni`,
    /// `avx512-bf16` or `amx` (the same results at every level, but bf16 matrices' at `avx512-bf16` and `amx`, whose
    /// products round the activations to bf16, and F16 matrices' at `amx`: docs/engine.md).
    #[arg(long, env = "NIGHTSHIFT_CPU_KERNELS", value_parser = crate::job::CpuKernels::parse)]
    pub cpu_kernels: Option<crate::job::CpuKernels>,
    /// Ranks a decoder's layers are split over (attention heads and feed-forward columns, Megatron style);
    /// overrides `runtime.tensor_parallel`. On the CPU, threads of this process.
    #[arg(long, env = "NIGHTSHIFT_TENSOR_PARALLEL", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: Option<u32>,
}

impl JobArgs {
    pub fn overrides(&self) -> Overrides {
        Overrides {
            input_url: self.input.clone(),
            output_url: self.output.clone(),
            model_path: self.model.clone(),
            max_seqs: self.max_seqs,
            shards: self.shards,
            reuse: self.reuse.clone(),
            reuse_incomplete: self.reuse_incomplete,
            attention: self.engine.attention,
            dtype: self.engine.dtype,
            cpu_kernels: self.engine.cpu_kernels,
            tensor_parallel: self.engine.tensor_parallel.map(|n| n as usize),
        }
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub job: JobArgs,
    /// Print the first N results when the job is done (they are users' data: off by default).
    #[arg(long, default_value_t = 0)]
    pub show: usize,
    /// Never draw a progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// Run one shard of the plan: `i/n` (0-based), `i` (with --shards n), `auto` (the index and count from a
    /// Kubernetes Indexed Job, Slurm array, AWS Batch or Google Cloud Batch array) or `all` (every shard: the
    /// default).
    #[arg(long, env = "NIGHTSHIFT_SHARD")]
    pub shard: Option<crate::plan::shard::ShardArg>,
    /// Write the run's progress for node_exporter's textfile collector to this file (replaced atomically as units
    /// commit and when the run ends).
    #[arg(long, env = "NIGHTSHIFT_METRICS_TEXTFILE")]
    pub metrics_textfile: Option<std::path::PathBuf>,
    /// Push the same metrics to this Prometheus Pushgateway (`http://host:9091`), grouped by job and shard.
    #[arg(long, env = "NIGHTSHIFT_PUSHGATEWAY")]
    pub pushgateway: Option<String>,
    /// Run the job on every GPU of this machine: N workers (`auto`: one per visible GPU), each running shard i of
    /// N with only its GPU visible and 1/N of the cores; signals are passed on, the output finalized, and the exit
    /// code is the worst worker's. Without GPUs, N workers split the cores.
    #[arg(long, value_name = "N|auto")]
    pub data_parallel: Option<crate::app::parallel::DataParallel>,
}
