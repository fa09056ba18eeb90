//! `nightshift validate`: the job file, the input, the model and the output checked without loading weights,
//! generating or writing anything.

use std::path::Path;

use super::load::{check_kv_budget, check_model, check_weights_fit, MemoryFit, ModelSummary};
use super::{fingerprint, runtime};
use crate::error::Error;
use crate::engine::models::llama::ModelInfo;
use crate::job::{DeviceChoice, Job, KvCacheDtype, Overrides};
use crate::sink::Output;
use crate::source::Input;

/// What `validate` found.
#[derive(Debug)]
pub struct ValidateReport {
    pub input_files: Vec<String>,
    pub rows: u64,
    pub model: ModelSummary,
    pub output_url: String,
    /// `new`, resumable (how far), or complete; a different job's output is an error instead.
    pub output_state: String,
    /// A decoder's memory against the host's, where the job runs on the CPU ([`memory`]).
    pub memory: Option<MemoryFit>,
}

/// A decoder job's memory where it runs on the CPU (`runtime.device = "cpu"`, or `"auto"` in a build without
/// CUDA), checked as a run checks it before reading weights: the weights as stored against the memory available
/// now, then the KV cache budget against what is left (a run takes its budget once the weights are in, from the
/// same remainder). `None` on a GPU, whose memory a run checks once the device is open.
fn memory(job: &Job, info: &ModelInfo) -> Result<Option<MemoryFit>, Error> {
    let cpu = match job.runtime.device {
        DeviceChoice::Cpu => true,
        DeviceChoice::Auto => !cfg!(feature = "cuda"),
        DeviceChoice::Cuda(_) => false,
    };
    let Some(available) = crate::host::available_memory_bytes().filter(|_| cpu) else { return Ok(None) };
    check_weights_fit(&job.model.path, info.weights, available)?;
    let cfg = &info.config;
    // The CPU's host backend holds f32 unless the job asks for 16 bits (the paged backend there computes in f32).
    let kv_dtype = match job.runtime.kv_cache_dtype {
        KvCacheDtype::F16 => candle_core::DType::F16,
        KvCacheDtype::Bf16 => candle_core::DType::BF16,
        KvCacheDtype::Auto | KvCacheDtype::F32 => candle_core::DType::F32,
    };
    let block_bytes = crate::engine::attention::kv_block_bytes(cfg.layers, cfg.kv_heads, cfg.head_dim, kv_dtype) as u64;
    let (kv_budget, kv_tokens) = check_kv_budget(job, cfg, kv_dtype, block_bytes, Some(available - info.weights.bytes))?;
    let window = cfg.sliding.as_ref().filter(|s| s.layers.len() == cfg.layers && s.layers.iter().all(|&l| l)).map(|s| s.window);
    Ok(Some(MemoryFit {
        weights: info.weights,
        available,
        kv_dtype: kv_dtype.as_str(),
        kv_bytes_per_token: block_bytes / crate::engine::KV_BLOCK_TOKENS as u64,
        kv_budget,
        kv_tokens,
        window,
    }))
}

/// Checks the job file, the input's files and columns, the model's metadata, tokenizer and chat template and the
/// job's parameters against it (as a run does, [`check_model`]), and whether the output holds this job's plan (or a
/// different job's).
pub fn validate(job_path: &Path, overrides: &Overrides) -> Result<ValidateReport, Error> {
    let mut job = Job::load(job_path, overrides)?;
    let rt = runtime()?;
    super::local_model(&mut job, &rt)?;
    let input = rt.block_on(Input::open(&job.input))?;
    // What a run checks over the whole input before it plans: unique ids (and a request file's model names).
    rt.block_on(input.check_whole())?;
    let output = Output::resolve(&job.output.url)?;
    let check = check_model(&job)?;
    let memory = match &check.summary {
        ModelSummary::Decoder(info) => memory(&job, info)?,
        _ => None,
    };
    // What a run would do with the output: start it, resume it, find it complete, or refuse it.
    let ours = fingerprint(&job, &check.sha256, check.template.as_deref(), &input);
    let output_state = rt.block_on(async {
        let Some(plan) = output.read_plan().await? else { return Ok::<_, Error>("new".to_string()) };
        output.check_same_job(&plan, &ours)?;
        if output.is_complete().await? {
            return Ok("complete: a run does nothing".to_string());
        }
        let committed = output.committed_units().await?.len();
        let shards = if plan.shards > 1 { format!(", in {} shards", plan.shards) } else { String::new() };
        Ok(format!("a run resumes it: {committed} of {} units committed{shards}", plan.units.len()))
    })?;
    Ok(ValidateReport { input_files: input.file_urls(), rows: input.total_rows(), model: check.summary, output_url: job.output.url, output_state, memory })
}
