//! `nightshift plan`: a generate job's rows tokenized and measured, the schedule the engine would make, its KV
//! cache fit, and a short calibration run through the real engine. Writes nothing anywhere.

use std::path::Path;
use std::time::Instant;

use tokio::sync::mpsc;

use super::drive::{drive, Ready};
use super::{limit_threads, load, runtime, SOURCE_DEPTH};
use crate::engine::Request;
use crate::error::Error;
use crate::job::{Job, JobKind, Overrides};
use crate::outcome::Outcome;
use crate::plan::report;
use crate::plan::Unit;
use crate::reuse::sources::Sources;
use crate::reuse::KeyContext;
use crate::row::ErrorCode;
use crate::source::{Input, SourceRow};
use crate::tokenize::Prepare;

/// What `nightshift plan` found.
#[derive(Debug, serde::Serialize)]
pub struct JobPlanReport {
    pub rows: u64,
    /// Rows that tokenized, and their prompt tokens (chat template included).
    pub ok_rows: u64,
    pub prompt_tokens: u64,
    /// Output tokens if every row generated its `max_new_tokens`.
    pub max_output_tokens: u64,
    /// Prompt tokens (a scoring row's completion included) in whole KV blocks that repeat the start of an earlier
    /// row's prompt, token for token: work a prefix cache keeping every block could skip ([`report::PrefixShare`]).
    /// What the cache serves within the job's budget and schedule is `simulation.cached_tokens`.
    pub shared_prefix_tokens: u64,
    /// Whether every block was counted (false past [`report::PrefixShare::MAX_BLOCKS`]: a lower bound).
    pub shared_prefix_exact: bool,
    pub histogram: crate::plan::report::Histogram,
    /// Prompts too long for the context and the KV cache budget: count and the first few ids.
    pub over_length_rows: u64,
    pub over_length_ids: Vec<String>,
    /// Other rows that fail before the engine, by error code.
    pub other_errors: Vec<(String, u64)>,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    pub kv_cache_bytes: u64,
    pub kv_tokens: usize,
    /// KV cache bytes a token holds (every layer's keys and values, every rank's) in `kv_cache_dtype`.
    pub kv_bytes_per_token: usize,
    pub kv_cache_dtype: &'static str,
    /// The window every layer slides over, where every layer slides: a sequence then holds at most its blocks.
    pub sliding_window: Option<usize>,
    pub longest_sequence: usize,
    /// Sequences of the job's mean length (prompt and all its output) the KV cache holds at once.
    pub sequences_fit: usize,
    pub weights_bytes: usize,
    /// The routed experts' bytes as the file stores them (0 for a dense model).
    pub expert_weights_stored_bytes: u64,
    /// How the weights are computed ([`Layout::name`](crate::engine::Layout::name)).
    pub weights_layout: &'static str,
    /// Each tensor-parallel rank's share (`runtime.tensor_parallel`; empty for a whole model).
    pub tensor_parallel: Vec<RankPlan>,
    /// Rows a reuse source (`reuse.from`, `--reuse`) serves and rows that repeat an earlier row's request: the
    /// run copies these instead of computing them, and the figures above and below count only the rest.
    pub reuse: Option<ReusePlan>,
    pub duplicate_rows: u64,
    pub simulation: crate::plan::report::Simulation,
    pub calibration: Option<crate::plan::report::Calibration>,
    pub estimated_seconds: Option<f64>,
}

/// One tensor-parallel rank in the plan: its heads, weights, activations and KV cache.
#[derive(Debug, serde::Serialize)]
pub struct RankPlan {
    #[serde(flatten)]
    pub memory: crate::engine::parallel::RankMemory,
    pub kv_cache_bytes: u64,
}

/// What the job's reuse sources would serve.
#[derive(Debug, serde::Serialize)]
pub struct ReusePlan {
    pub sources: usize,
    /// Sources of another job, which serve nothing, with why.
    pub refused: Vec<(String, String)>,
    pub source_files: usize,
    pub source_keys: usize,
    /// Seconds to read the sources' keys.
    pub index_seconds: f64,
    pub reused_rows: u64,
}

/// The rows of a job as `plan` counts them.
#[derive(Default)]
struct Tokenized {
    rows: u64,
    reused_rows: u64,
    duplicate_rows: u64,
    /// (prompt tokens, output tokens at most) of each row that tokenized.
    lengths: Vec<(usize, usize)>,
    prefix: report::PrefixShare,
    /// Each row's blocks in `prefix`, in the order of `lengths`.
    chains: Vec<report::Chain>,
    /// The first rows, for the calibration run.
    calibration: Vec<Request>,
    over_length_rows: u64,
    over_length_ids: Vec<String>,
    other_errors: std::collections::BTreeMap<String, u64>,
}

/// `nightshift plan`: tokenizes every row (in parallel), reports the lengths, the schedule the engine would make
/// and its KV cache fit, and times a short calibration run on the job's first rows. Writes nothing anywhere.
pub fn plan_job(job_path: &Path, overrides: &Overrides, calibration_rows: usize) -> Result<JobPlanReport, Error> {
    let mut job = Job::load(job_path, overrides)?;
    if job.kind != JobKind::Generate {
        return Err(Error::Job(crate::job::JobError::Invalid {
            path: job.file.clone(),
            key: "kind",
            problem: "`nightshift plan` plans generate jobs; embed and seq2seq jobs have no decode schedule to plan".into(),
        }));
    }
    if let Some(threads) = job.runtime.threads {
        limit_threads(threads);
    }
    let rt = runtime()?;
    super::local_model(&mut job, &rt)?;
    let input = rt.block_on(Input::open(&job.input))?;
    let device = crate::engine::select_device(&job.runtime.device)?;
    let loaded = load::load(&job, &device)?;
    let numerics = super::run_numerics(&job, &device, &loaded);
    let load::Loaded { mut engine, prepare, weights_bytes, weights_layout, decoder, check, kv_cache_dtype, .. } = loaded;
    let expert_weights_stored_bytes = match &check.summary {
        load::ModelSummary::Decoder(info) => info.weights.experts,
        _ => 0,
    };
    let load::DecoderPlan { model, batch, block_bytes, ranks } = decoder.expect("a generate job loads a decoder");
    let tensor_parallel = match ranks.len() > 1 {
        true => ranks.into_iter().map(|r| RankPlan { kv_cache_bytes: (batch.kv_blocks * r.block_bytes) as u64, memory: r }).collect(),
        false => Vec::new(),
    };
    let longest = batch.max_sequence_tokens(model.context_length);
    let keys = KeyContext::new(&check.sha256, job.kind, &numerics, &job.generation);
    let sources = match job.reuse.from.is_empty() {
        true => None,
        false => {
            let ours = super::fingerprint(&job, &check.sha256, check.template.as_deref(), &input);
            Some(rt.block_on(Sources::open(&job.reuse.from, job.reuse.allow_incomplete, &ours, &numerics, crate::sink::ResultsLayout::Generate))?)
        }
    };

    let t = rt.block_on(tokenize_all(&job, &input, prepare.as_ref(), longest, calibration_rows, &keys, sources.as_ref()))?;
    let reuse = sources.map(|s| ReusePlan {
        sources: s.summary.sources,
        refused: s.summary.refused.clone(),
        source_files: s.summary.files,
        source_keys: s.summary.keys,
        index_seconds: s.summary.seconds,
        reused_rows: t.reused_rows,
    });
    let histogram = report::Histogram::new(&t.lengths.iter().map(|l| l.0).collect::<Vec<_>>());
    let prompt_tokens: u64 = t.lengths.iter().map(|l| l.0 as u64).sum();
    let max_output_tokens: u64 = t.lengths.iter().map(|l| l.1 as u64).sum();
    let mean_sequence = (prompt_tokens + max_output_tokens).div_ceil(t.lengths.len().max(1) as u64).max(1) as usize;
    let simulation = report::simulate(&t.lengths, Some((&t.prefix, &t.chains)), &batch.schedule());

    // Calibration: the first rows, at most 32 new tokens each, through the real engine.
    let calibration = match t.calibration.is_empty() {
        true => None,
        false => calibrate(&job, engine.as_mut(), t.calibration)?,
    };
    let estimated_seconds = calibration.as_ref().and_then(|c| report::estimate_seconds(&simulation, c));
    Ok(JobPlanReport {
        rows: t.rows,
        ok_rows: t.lengths.len() as u64,
        prompt_tokens,
        max_output_tokens,
        shared_prefix_tokens: t.prefix.cached_tokens(),
        shared_prefix_exact: t.prefix.exact(),
        histogram,
        over_length_rows: t.over_length_rows,
        over_length_ids: t.over_length_ids,
        other_errors: t.other_errors.into_iter().collect(),
        reuse,
        duplicate_rows: t.duplicate_rows,
        max_seqs: batch.max_seqs,
        max_batch_tokens: batch.max_batch_tokens,
        kv_cache_bytes: (batch.kv_blocks * block_bytes) as u64,
        kv_tokens: batch.kv_tokens(),
        kv_bytes_per_token: block_bytes / crate::engine::KV_BLOCK_TOKENS,
        kv_cache_dtype,
        sliding_window: batch.window,
        longest_sequence: longest,
        sequences_fit: batch.kv_tokens() / mean_sequence,
        weights_bytes,
        expert_weights_stored_bytes,
        weights_layout,
        tensor_parallel,
        simulation,
        calibration,
        estimated_seconds,
    })
}

/// Every row of the input, a file at a time, tokenized in parallel and counted.
async fn tokenize_all(
    job: &Job,
    input: &Input,
    prepare: &dyn Prepare,
    longest: usize,
    calibration_rows: usize,
    keys: &KeyContext,
    sources: Option<&Sources>,
) -> Result<Tokenized, Error> {
    // The requests seen, by the first 16 bytes of their keys (as a reuse source's index holds them).
    let mut seen = std::collections::HashSet::<[u64; 2]>::new();
    let (tx, mut rx) = mpsc::channel::<Vec<SourceRow>>(SOURCE_DEPTH);
    let files = input.snapshot();
    let reader = async move {
        for (file, f) in files.iter().enumerate() {
            let mut first_row = 0;
            while first_row < f.rows {
                let n = (f.rows - first_row).min(1 << 16) as u32;
                let unit = Unit { id: 0, file, first_row, rows: n, shard: 0, estimated_tokens: 0 };
                if !input.stream_unit(&unit, &tx).await? {
                    return Ok(());
                }
                first_row += n as u64;
            }
        }
        drop(tx);
        Ok::<_, Error>(())
    };
    let mut t = Tokenized::default();
    let consume = async {
        while let Some(batch_rows) = rx.recv().await {
            for row in prepare.prepare_all(batch_rows) {
                t.rows += 1;
                match row.tokens {
                    Ok(tokens) => {
                        let Ok(params) = job.generation.for_row(&row.params) else {
                            *t.other_errors.entry(ErrorCode::InvalidParameters.as_str().to_string()).or_default() += 1;
                            continue;
                        };
                        if let Some(key) = keys.key(&row.id, &row.params, &tokens, row.completion.as_deref()) {
                            if sources.is_some_and(|s| s.lookup(&key).is_some()) {
                                t.reused_rows += 1;
                                continue;
                            }
                            if !seen.insert(key.words()) {
                                t.duplicate_rows += 1;
                                continue;
                            }
                        }
                        // A scoring row's completion is prefilled with its prompt; nothing is generated.
                        let (prompt, max_new) = match &row.completion {
                            Some(c) => {
                                t.chains.push(t.prefix.add(&[tokens.as_slice(), c].concat(), c.len() + 1));
                                (tokens.len() + c.len(), 0)
                            }
                            None => {
                                t.chains.push(t.prefix.add(&tokens, 1));
                                (tokens.len(), params.max_new_tokens as usize)
                            }
                        };
                        t.lengths.push((prompt, max_new.min(longest.saturating_sub(prompt))));
                        if t.calibration.len() < calibration_rows {
                            let row = crate::tokenize::PreparedRow { tokens: Ok(tokens), ..row };
                            t.calibration.extend(Request::ready(row).ok());
                        }
                    }
                    Err(e) if e.code == ErrorCode::PromptTooLong => {
                        t.over_length_rows += 1;
                        if t.over_length_ids.len() < 5 {
                            t.over_length_ids.push(crate::row::id_cut(&row.id));
                        }
                    }
                    Err(e) => *t.other_errors.entry(e.code.as_str().to_string()).or_default() += 1,
                }
            }
        }
    };
    let (read, ()) = tokio::join!(reader, consume);
    read?;
    Ok(t)
}

/// Runs the calibration rows (at most 32 new tokens each) through the engine, under the run's drive loop.
fn calibrate(job: &Job, engine: &mut dyn crate::engine::Engine, requests: Vec<Request>) -> Result<Option<report::Calibration>, Error> {
    let started = Instant::now();
    let n = requests.len();
    let requests = requests.into_iter().map(|mut request| {
        let max_new = job.generation.for_row(&request.params).map_or(1, |p| p.max_new_tokens);
        request.params.max_new_tokens = Some(max_new.min(32));
        request.params.min_new_tokens = request.params.min_new_tokens.map(|m| m.min(32));
        request.arrival = Instant::now();
        request
    });
    let mut outcomes: Vec<Outcome> = Vec::new();
    let stats = drive(engine, &mut Ready(requests), &mut outcomes, None).map_err(Error::Engine)?;
    // A row the engine refuses (a per-row parameter it cannot run) is an error row in `run`, never a failed run:
    // here it is left out of the timing, and the plan goes on.
    let failed: Vec<&str> = outcomes.iter().filter_map(|o| if let Outcome::Failed(f) = o { Some(f.error.code.as_str()) } else { None }).collect();
    if !failed.is_empty() {
        tracing::warn!(rows = failed.len(), first_code = failed[0], "calibration rows the engine refused (error rows in a run) are left out of the estimate");
    }
    if failed.len() == n {
        return Ok(None);
    }
    Ok(Some(report::Calibration {
        rows: n - failed.len(),
        prefill_tokens_per_s: stats.prefill_tokens_per_s(),
        decode_tokens_per_s: stats.decode_tokens_per_s(),
        seconds: started.elapsed().as_secs_f64(),
    }))
}
