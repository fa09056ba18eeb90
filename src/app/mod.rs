//! Wires the stages of a job together, one file per verb and stage:
//!
//! - [`run`] (here): the job's stages on their threads, with bounded channels between them;
//!   [`load`]: the model checked (the same checks for `validate`) and loaded into its engine;
//!   [`drive`]: the one loop every engine runs under (`run`, `bench`, `plan`'s calibration);
//!   [`collect`]: output rows put back in order and committed a unit at a time;
//!   [`signals`]: SIGTERM / SIGINT draining;
//! - [`validate`] and [`plan`]: the dry-run verbs.
//!
//! ```text
//! source (tokio task) -> tokenize (thread, rayon) -> engine (its own thread) -> sink (tokio task)
//!                                  \----------------- error rows ----------------^
//! ```
//! Stages talk through bounded channels, so memory stays bounded for any input size. When a stage fails, it drops
//! its channel ends; the stages before it see a closed channel and stop, and the job returns the first error
//! without writing `_SUCCESS`.
//!
//! The source reads the plan's uncommitted units in order; every row carries its unit and position, and the sink
//! commits a unit as soon as its last row is in. A rerun of the same job skips committed units. The tokenizer
//! thread keys each row ([`crate::reuse`]): a row a reuse source holds, or one an identical request of the run
//! serves, goes to the sink without the engine, and the sink fills it in.

mod collect;
pub mod drive;
mod load;
pub mod parallel;
mod plan;
pub mod signals;
mod validate;

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::Path;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span, warn};

use crate::engine::{self, EngineError, EngineStats, Request};
use crate::error::Error;
use crate::job::{ChatTemplateChoice, Job, JobKind, Overrides, PromptColumn};
use crate::metrics::JobMetrics;
use crate::outcome::Outcome;
use crate::plan::shard::{self, Assignment, ShardArg};
use crate::plan::{Fingerprint, Plan, Unit, OUTPUT_FORMAT_VERSION};
use crate::sink::{self, Finalized, Manifest, Output, RunMetadata};
use crate::metrics::prometheus::Exporter;
use crate::source::{Input, SourceRow};
use crate::reuse::dedup::{Admit, Dedup};
use crate::reuse::sources::Sources;
use crate::reuse::KeyContext;
use crate::tokenize::Prepare;
use collect::{Collect, Collected, RunFigures};
pub use load::{bytes_text, check_model, ModelCheck, ModelSummary};
pub use plan::{plan_job, JobPlanReport};
pub use signals::Drain;
pub use validate::{validate, ValidateReport};

/// Source batches in flight between the reader and the tokenizer.
const SOURCE_DEPTH: usize = 4;


pub struct RunOptions {
    pub job: std::path::PathBuf,
    pub overrides: Overrides,
    /// Draw a progress bar (only ever on a terminal).
    pub progress: bool,
    /// Result rows to keep for the caller to show.
    pub show: usize,
    /// `--shard`: which units this process runs (default: all).
    pub shard: Option<ShardArg>,
    /// Where the run's progress goes for Prometheus (`--metrics-textfile`, `--pushgateway`).
    pub prometheus: crate::metrics::prometheus::Targets,
}

/// How a run ended, when it did not fail.
#[derive(Debug, PartialEq, Eq)]
pub enum RunStatus {
    /// This run committed the last units and finalized the output.
    Complete,
    /// The output was complete before this run started; nothing was done.
    AlreadyComplete,
    /// This process's shard is committed; other shards are not yet, so the output is not finalized (the last
    /// shard to finish, or `nightshift finalize`, does it).
    ShardDone { missing: String },
}

/// What a finished run reports to the command line.
#[derive(Debug)]
pub struct RunReport {
    pub status: RunStatus,
    pub output_url: String,
    pub manifest_url: String,
    /// The output's manifest, once it is complete.
    pub manifest: Option<Manifest>,
    /// Which units this process ran.
    pub assignment: Assignment,
    /// Units this run committed, and units committed before it (by earlier or concurrent attempts).
    pub units_committed: usize,
    pub units_skipped: usize,
    /// This run's figures (all rows it generated, across units).
    pub metrics: JobMetrics,
    pub sample: Vec<Outcome>,
}

/// A job whose `model.path` is an object store URL reads the model from the local cache, fetching it first.
fn local_model(job: &mut Job, rt: &tokio::runtime::Runtime) -> Result<(), Error> {
    if crate::source::model::is_remote(&job.model.path) {
        let url = job.model.path.to_string_lossy().into_owned();
        let cache = job.runtime.model_cache.clone().unwrap_or_else(crate::job::default_model_cache);
        job.model.path = rt.block_on(crate::source::model::fetch(&url, &cache))?;
        info!(url = %crate::redact::redact_urls(&url), path = %job.model.path.display(), "model from the local cache");
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nightshift-io")
        .enable_all()
        .build()
        .map_err(|e| Error::Internal(format!("cannot start the I/O runtime: {e}")))
}

/// Limits the engine's CPU threads: rayon's global pool (attention, tokenization) and candle's kernels, which
/// size their pool from `RAYON_NUM_THREADS`. Called before any thread pool exists.
pub fn limit_threads(threads: usize) {
    // `set_var` is sound only while no other thread reads the environment; this runs on the main thread
    // before the I/O runtime, the engine or any pool is started.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    if rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().is_err() {
        tracing::warn!(threads, "the thread pool was already started; runtime.threads not applied to it");
    }
}

/// How long candle's matmul threads spin for the next operation before they park, unless the environment says
/// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`). candle's default (25,000 spins, about a millisecond) keeps its threads
/// busy-waiting while nightshift's own threads run attention between matmuls, and on a machine with few cores they
/// take each other's time: measured on 2 cores, 100 spins took the generation benchmark from 210 to 242 total
/// tokens/s.
///
/// And the thread count candle's CPU matmul asks for at every call, fixed once: without `RAYON_NUM_THREADS`, candle
/// 0.11 counts the physical cores by reading and parsing `/proc/cpuinfo` at every matrix product (about 15 reads a
/// step on the tiny model; on a many-core GPU host the file is hundreds of KiB). The count is the same: candle's own,
/// computed once. Called at start-up, before any thread exists.
pub fn tune_cpu_threads() {
    // Sound: called first thing in `main`, while the process has one thread.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "100");
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", candle_core::utils::get_num_threads().to_string());
    }
}

fn sha256_hex(text: &str) -> String {
    format!("{:x}", Sha256::digest(text.as_bytes()))
}

/// What makes this run's results what they are: model, prompt construction, parameters, input snapshot.
fn fingerprint(job: &Job, model_sha256: &str, template: Option<&str>, input: &Input) -> Fingerprint {
    let prompt = serde_json::json!({
        "kind": job.kind,
        "id_column": job.input.id_column,
        "prompt_column": match &job.input.prompt { PromptColumn::Text(c) => Some(c), PromptColumn::Messages(_) => None },
        "messages_column": match &job.input.prompt { PromptColumn::Messages(c) => Some(c), PromptColumn::Text(_) => None },
        "chat_template_sha256": match job.model.chat_template {
            ChatTemplateChoice::Auto => template.map(sha256_hex),
            ChatTemplateChoice::None => None,
        },
        "system_prompt_sha256": job.input.system_prompt.as_deref().map(sha256_hex),
        "truncate": job.input.truncate,
        "parameters": job.input.parameters,
    });
    let mut prompt = prompt;
    // Only where set, so that the fingerprints of outputs written before it was recorded stay the same.
    if let Some(column) = &job.input.completion_column {
        prompt["completion_column"] = column.as_str().into();
    }
    if let Some(rules) = &job.input.openai_batch {
        prompt["openai_batch"] = serde_json::json!({"url": rules.url, "model": rules.model});
    }
    Fingerprint {
        format_version: OUTPUT_FORMAT_VERSION,
        model_sha256: model_sha256.into(),
        prompt,
        generation: match job.kind {
            JobKind::Generate | JobKind::Seq2seq => serde_json::to_value(&job.generation).expect("parameters serialise"),
            JobKind::Embed => serde_json::Value::Null,
        },
        input: input.snapshot(),
    }
}
/// The arithmetic a job's rows are computed with ([`crate::reuse::numerics`]).
fn run_numerics(job: &Job, device: &candle_core::Device, loaded: &load::Loaded) -> String {
    let prefix_cache = job.kind == JobKind::Generate && job.runtime.prefix_cache;
    crate::reuse::numerics(!device.is_cpu(), loaded.weights_layout, loaded.kv_cache_dtype, prefix_cache, loaded.attention, loaded.compute_dtype, loaded.tensor_parallel)
}

/// `nightshift run`: the job's uncommitted units (of this process's shard) through the stages, committed a unit at
/// a time; the output finalized when every unit is in.
pub fn run(options: RunOptions) -> Result<RunReport, Error> {
    let started = Instant::now();
    options.prometheus.check().map_err(Error::Usage)?;
    let mut job = Job::load(&options.job, &options.overrides)?;
    if let Some(textfile) = &options.prometheus.textfile {
        side_file(textfile, "--metrics-textfile", &job.output.url)?;
    }
    let assignment = shard::resolve(options.shard.as_ref(), job.output.shards, |name| std::env::var(name).ok())?;
    let _span = info_span!("job", file = %job.file.display(), shard = %assignment).entered();
    if let Assignment::One { from, .. } = &assignment {
        info!(from = %from, "running {assignment}");
    }
    if let Some(threads) = job.runtime.threads {
        limit_threads(threads);
    }
    let rt = runtime()?;
    local_model(&mut job, &rt)?;
    let exporter = options.prometheus.any().then(|| {
        let name = job.file.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let shard = match &assignment {
            Assignment::One { index, count, .. } => format!("{index}-of-{count}"),
            _ => "all".to_string(),
        };
        Arc::new(Exporter::new(options.prometheus.clone(), &name, &shard))
    });
    let result = run_job(&options, &job, &assignment, &rt, started, exporter.clone());
    if let Some(exporter) = &exporter {
        exporter.finish(&rt, result.as_ref().map_or_else(|e| e.exit() as i32, |_| 0));
    }
    result
}

/// [`run`] once the job, its shard and the runtime are known.
fn run_job(
    options: &RunOptions,
    job: &Job,
    assignment: &Assignment,
    rt: &tokio::runtime::Runtime,
    started: Instant,
    exporter: Option<Arc<Exporter>>,
) -> Result<RunReport, Error> {
    let drain = Arc::new(Drain::default());
    signals::watch_signals(rt, drain.clone(), job.runtime.drain_grace)?;

    let (input, output) = rt.block_on(async { Ok::<_, Error>((Input::open(&job.input).await?, Output::open(&job.output.url).await?)) })?;
    info!(url = input.url(), files = input.file_urls().len(), rows = input.total_rows(), "input opened");

    // Everything that can fail on the model or its tokenizer fails before a plan is written: a plan made by a run
    // that could never start would refuse the corrected job.
    let device = engine::select_device(&job.runtime.device)?;
    let load_started = Instant::now();
    let loaded = load::load(job, &device)?;
    let model_load_s = load_started.elapsed().as_secs_f64();
    info!(path = %job.model.path.display(), weights_mib = loaded.weights_bytes >> 20, seconds = format!("{model_load_s:.2}"), "model loaded");
    let started_unix_s = crate::host::unix_s() - started.elapsed().as_secs_f64();
    let figures = RunFigures { started, started_unix_s, model_load_s, weights_bytes: loaded.weights_bytes as u64, weights_layout: loaded.weights_layout, kv_cache_dtype: loaded.kv_cache_dtype, tensor_parallel: loaded.tensor_parallel as u64 };

    // The plan: this job's fingerprint against the one stored at the output, if any.
    let ours = fingerprint(job, &loaded.check.sha256, loaded.check.template.as_deref(), &input);
    let plan = rt.block_on(stored_plan(job, &input, &output, assignment, &ours))?;
    let numerics = run_numerics(job, &device, &loaded);
    let keys = KeyContext::new(&loaded.check.sha256, job.kind, &numerics, &job.generation);
    let run = RunMetadata {
        numerics: numerics.clone(),
        layout: loaded.layout,
        model_sha256: loaded.check.sha256.clone(),
        model: job.model.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        job: job.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        fingerprint: plan.fingerprint.digest(),
        attempt: sink::new_attempt(),
    };
    let report = Report { output: &output, assignment };
    if rt.block_on(output.is_complete_and_whole())? {
        let manifest = match rt.block_on(output.finalize())? {
            Finalized::AlreadyComplete(m) | Finalized::Done(m) => m,
        };
        // A run killed while it exported (after `_SUCCESS`) left no export: this one writes it.
        if let Some(format) = job.output.export {
            export_after_run(rt, &output, format, true)?;
        }
        info!(output = output.url(), "the output is complete already; nothing to do");
        return Ok(report.of(RunStatus::AlreadyComplete, Some(manifest), 0, plan.units.len(), JobMetrics::default(), Vec::new()));
    }
    // A unit counts as committed only with its files there (one deleted since is computed again).
    let committed = rt.block_on(output.verified_committed_units())?;
    let ours_units: Vec<&Unit> = plan.units.iter().filter(|u| assignment.includes(u.shard)).collect();
    let pending: Vec<Unit> = ours_units.iter().filter(|u| !committed.contains(&u.id)).map(|u| (*u).clone()).collect();
    let units_skipped = ours_units.len() - pending.len();
    if let Some(exporter) = &exporter {
        exporter.planned(rt, ours_units.len(), units_skipped);
    }
    info!(
        units = plan.units.len(), shards = plan.shards, ours = ours_units.len(), committed = units_skipped, pending = pending.len(),
        attempt = %run.attempt, fingerprint = %run.fingerprint, "plan"
    );

    let sources = match job.reuse.from.is_empty() || pending.is_empty() {
        true => None,
        false => Some(Arc::new(rt.block_on(Sources::open(&job.reuse.from, job.reuse.allow_incomplete, &plan.fingerprint, &numerics, loaded.layout))?)),
    };
    let progress = progress_bar(options.progress, pending.iter().map(|u| u.rows as u64).sum());
    let reuse = sources.clone();
    let stages = Stages {
        rt, input, output: &output, run: &run, drain: &drain, figures: &figures, progress: &progress, show: options.show, exporter,
        committed_before: units_skipped, keys, sources,
    };
    let ended = stages.run(job, loaded, pending);
    // The output was writable when the run started (the probe), so a read or write of it failing now, after
    // object_store's retries, is an outage: what is committed stays, and the job can be resumed.
    let units_total = ours_units.len();
    let resumable = |e: Error, committed_now: usize| match e {
        Error::Sink(source @ (sink::SinkError::Read { .. } | sink::SinkError::Write { .. })) => {
            Error::StoreFailed { committed: units_skipped + committed_now, total: units_total, source: Box::new(source) }
        }
        other => other,
    };
    let (collected, final_stats, generation_s) = ended.map_err(|(e, committed_now)| resumable(e, committed_now))?;
    progress.finish_and_clear();
    if let Some(mismatched) = reuse.map(|s| s.mismatched()).filter(|&n| n > 0) {
        warn!(rows = mismatched, "reuse source rows indexed under this run's request keys held other keys; they were not served, and their requests were computed");
    }

    let metrics = figures.metrics(&collected.rows, &final_stats, generation_s);
    if drain.requested() {
        let committed = rt.block_on(output.committed_units())?;
        let done = ours_units.iter().filter(|u| committed.contains(&u.id)).count();
        if done < ours_units.len() {
            return Err(Error::Interrupted { committed: done, total: ours_units.len(), what: assignment.to_string(), unfinished: collected.unfinished });
        }
    }
    // Every unit of ours is committed. A shard finalizes the output when it is the last to finish; otherwise
    // the others (or `nightshift finalize`) will.
    let Collected { sample, units_committed, .. } = collected;
    match rt.block_on(output.finalize()) {
        Ok(Finalized::Done(manifest) | Finalized::AlreadyComplete(manifest)) => {
            if let Some(format) = job.output.export {
                export_after_run(rt, &output, format, false)?;
            }
            info!(
                rows = manifest.rows, errored = manifest.errored_rows, output_tokens_per_s = format!("{:.1}", metrics.output_tokens_per_s),
                seconds = format!("{:.1}", metrics.job_s), "job complete"
            );
            Ok(report.of(RunStatus::Complete, Some(manifest), units_committed, units_skipped, metrics, sample))
        }
        Err(sink::SinkError::Incomplete { missing, shards, .. }) if matches!(assignment, Assignment::One { .. }) => {
            let missing = format!("{missing} unit(s) of {shards} are not committed yet");
            info!(waiting_for = %missing, "{assignment} is committed; the output is finalized when the other shards are");
            Ok(report.of(RunStatus::ShardDone { missing }, None, units_committed, units_skipped, metrics, sample))
        }
        Err(e) => Err(resumable(e.into(), units_committed)),
    }
}

/// The run's report, from what it found and did.
struct Report<'a> {
    output: &'a Output,
    assignment: &'a Assignment,
}

impl Report<'_> {
    fn of(&self, status: RunStatus, manifest: Option<Manifest>, units_committed: usize, units_skipped: usize, metrics: JobMetrics, sample: Vec<Outcome>) -> RunReport {
        RunReport {
            status,
            output_url: self.output.url().into(),
            manifest_url: self.output.display(sink::MANIFEST_FILE),
            manifest,
            assignment: self.assignment.clone(),
            units_committed,
            units_skipped,
            metrics,
            sample,
        }
    }
}

/// The plan stored at the output, or a new one made and stored (create-once) when there is none; checked against
/// this job's fingerprint and shard count.
async fn stored_plan(job: &Job, input: &Input, output: &Output, assignment: &Assignment, ours: &Fingerprint) -> Result<Plan, Error> {
    let plan = match output.read_plan().await? {
        Some(stored) => stored,
        None => {
            // Only a new plan reads every id: a stored plan was checked when it was made.
            input.check_whole().await?;
            let shards = match assignment {
                Assignment::One { count, .. } => *count,
                Assignment::All => job.output.shards.unwrap_or(1),
            };
            let new = Plan::new(ours.clone(), job.output.unit_rows, shards, |file, first_row, rows| {
                estimated_tokens(job, input.prompt_bytes(file, first_row, rows), rows)
            });
            if new.units.len() < shards as usize {
                warn!(units = new.units.len(), shards, "fewer units than shards: the last shards have nothing to do (lower output.unit_rows)");
            }
            output.create_plan(&new).await?
        }
    };
    output.check_same_job(&plan, ours)?;
    if let Assignment::One { count, .. } = assignment {
        if *count != plan.shards {
            return Err(sink::SinkError::ShardCount { url: output.url().into(), planned: plan.shards, asked: assignment.to_string() }.into());
        }
    }
    if plan.unit_rows != job.output.unit_rows {
        warn!(planned = plan.unit_rows, asked = job.output.unit_rows, "output.unit_rows differs from the stored plan's; the plan's units are kept");
    }
    Ok(plan)
}

/// What the stages of a run share.
struct Stages<'a> {
    rt: &'a tokio::runtime::Runtime,
    input: Input,
    output: &'a Output,
    run: &'a RunMetadata,
    drain: &'a Arc<Drain>,
    figures: &'a RunFigures,
    progress: &'a ProgressBar,
    show: usize,
    /// Where progress goes for Prometheus, with the units committed before this run.
    exporter: Option<Arc<Exporter>>,
    committed_before: usize,
    /// Request keys, and the earlier outputs that serve rows by them.
    keys: KeyContext,
    sources: Option<Arc<Sources>>,
}

/// The engine thread's outcome consumer: output rows to the sink, and the engine's figures for the unit commits.
struct ToSink {
    sink: mpsc::Sender<Outcome>,
    stats: Arc<Mutex<EngineStats>>,
}

impl drive::Outcomes for ToSink {
    fn send(&mut self, outcome: Outcome) -> bool {
        self.sink.blocking_send(outcome).is_ok()
    }

    fn stepped(&mut self, stats: &EngineStats) {
        *self.stats.lock().expect("not poisoned") = stats.clone();
    }
}

impl Stages<'_> {
    /// Runs the pending units through source, tokenizer, engine and sink until every row is committed (or the
    /// run stops). Returns what the sink collected, the engine's figures and the generation time; or the first
    /// real cause of a failure with the units committed before it.
    #[allow(clippy::result_large_err)] // returned once per run
    fn run(self, job: &Job, loaded: load::Loaded, pending: Vec<Unit>) -> Result<(Collected, EngineStats, f64), (Error, usize)> {
        let fail = |e: Error| (e, 0);
        // Channels: source -> tokenize -> engine -> sink, and tokenize -> sink for rows that fail before the engine.
        let (source_tx, source_rx) = mpsc::channel::<Vec<SourceRow>>(SOURCE_DEPTH);
        // The engine's queue in chunks of prepared rows (`loaded.queue` requests, give or take a chunk).
        let (request_tx, request_rx) = std_mpsc::sync_channel::<Vec<Request>>(loaded.queue.div_ceil(PREPARE_CHUNK));
        let (sink_tx, sink_rx) = mpsc::channel::<Outcome>(job.runtime.max_seqs * 4);
        let engine_stats = Arc::new(Mutex::new(EngineStats::default()));

        let source_task = spawn_source(self.rt, self.input, self.output.clone(), self.drain.clone(), pending.clone(), source_tx);
        let dedup = Arc::new(Dedup::default());
        let rows = KeyedRows { keys: self.keys.clone(), dedup: dedup.clone(), sources: self.sources.clone(), rt: self.rt.handle().clone() };
        let tokenize_thread = spawn_tokenizer(loaded.prepare, rows, source_rx, request_tx, sink_tx.clone(), self.drain.clone()).map_err(fail)?;
        let generation_started = Instant::now();
        let (engine_drain, mut to_sink) = (self.drain.clone(), ToSink { sink: sink_tx, stats: engine_stats.clone() });
        let mut engine = loaded.engine;
        let engine_thread = std::thread::Builder::new()
            .name("nightshift-engine".into())
            .spawn(move || drive::drive(engine.as_mut(), &mut drive::Chunks::new(request_rx), &mut to_sink, Some(&engine_drain)))
            .map_err(|e| fail(Error::Internal(format!("cannot start the engine thread: {e}"))))?;

        let collect = Collect {
            output: self.output,
            run: self.run,
            units: pending.iter().map(|u| (u.id, u.clone())).collect::<HashMap<u32, Unit>>(),
            engine_stats,
            figures: self.figures,
            progress: self.progress,
            show: self.show,
            generation_started,
            exporter: self.exporter.clone(),
            committed_before: self.committed_before,
            dedup,
            sources: self.sources.clone(),
        };
        let sink_result = self.rt.block_on(collect::collect(sink_rx, collect));
        // Whatever happened, the engine and tokenizer threads end once their channels close.
        let engine_result = engine_thread.join().map_err(|_| fail(Error::Internal("the engine thread panicked (a bug)".into())))?;
        let _ = tokenize_thread.join();
        let source_result = self.rt.block_on(source_task).map_err(|e| fail(Error::Internal(format!("the source task failed: {e}"))))?;
        // The first real cause wins: a source error explains a short engine run, an engine error a short sink run.
        // The units committed before a failure (a store that fails mid-run reports them).
        let committed_by_sink = match &sink_result {
            Ok(collected) => collected.units_committed,
            Err((_, committed)) => *committed,
        };
        source_result.map_err(|e| (e, committed_by_sink))?;
        let final_stats = engine_result.map_err(|e: EngineError| fail(Error::Engine(e)))?;
        let collected = sink_result?;
        Ok((collected, final_stats, generation_started.elapsed().as_secs_f64()))
    }
}

/// The source: reads the pending units' rows in order, skipping units another attempt committed meanwhile.
fn spawn_source(
    rt: &tokio::runtime::Runtime,
    input: Input,
    output: Output,
    drain: Arc<Drain>,
    units: Vec<Unit>,
    rows: mpsc::Sender<Vec<SourceRow>>,
) -> tokio::task::JoinHandle<Result<(), Error>> {
    rt.spawn(async move {
        for unit in &units {
            if drain.requested() {
                break;
            }
            // Another attempt may have committed it since the run started.
            if output.is_committed(unit).await? {
                debug!(unit = unit.id, "committed by another attempt meanwhile; skipped");
                continue;
            }
            if !input.stream_unit(unit, &rows).await? {
                break;
            }
        }
        Ok::<_, Error>(())
    })
}

/// Rows the tokenizer thread prepares between checks for a drain.
const PREPARE_CHUNK: usize = 16;

/// What the tokenizer thread decides for each tokenized row by its request key: copied from a reuse source,
/// waiting on (or copied from) an identical request of this run, or computed.
struct KeyedRows {
    keys: KeyContext,
    dedup: Arc<Dedup>,
    sources: Option<Arc<Sources>>,
    /// For reading reuse sources from the tokenizer thread.
    rt: tokio::runtime::Handle,
}

/// Where a tokenized row goes.
#[allow(clippy::large_enum_variant)] // moved straight on, never stored
enum Route {
    Engine(Request),
    /// An identical request is being computed; the sink copies its outcome.
    Wait,
    Sink(Outcome),
}

impl KeyedRows {
    fn route(&self, request: Request) -> Route {
        let Some(key) = self.keys.key(&request.id, &request.params, &request.tokens, request.completion.as_deref()) else { return Route::Engine(request) };
        if let Some((sources, found)) = self.sources.as_ref().and_then(|s| s.lookup(&key).map(|found| (s, found))) {
            // A source that cannot be read is served anyway: the commit reads it again and fails the run with the
            // reason.
            if self.rt.block_on(sources.holds(&key, found)).unwrap_or(true) {
                return Route::Sink(Outcome::Reused(crate::outcome::Reused { id: request.id, tag: request.tag, key, file: found.file, row: found.row, data: None }));
            }
        }
        match self.dedup.admit(key, &request.id, request.tag) {
            Admit::Compute => Route::Engine(request),
            Admit::Wait => Route::Wait,
            Admit::Copy(outcome) => Route::Sink(*outcome),
        }
    }
}

/// The tokenizer thread: source rows to requests for the engine, or to outcomes for the sink (failed rows, reused
/// rows, copies of identical requests).
fn spawn_tokenizer(
    prepare: Box<dyn Prepare>,
    keyed: KeyedRows,
    mut rows: mpsc::Receiver<Vec<SourceRow>>,
    requests: std_mpsc::SyncSender<Vec<Request>>,
    failed: mpsc::Sender<Outcome>,
    drain: Arc<Drain>,
) -> Result<std::thread::JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name("nightshift-tokenize".into())
        .spawn(move || {
            while let Some(batch) = rows.blocking_recv() {
                // Rows are prepared a few at a time, so a drain is seen soon even where a row's chat template runs
                // up to its limits: the rest of the unit is never prepared (its unit is not committed).
                let mut batch = batch.into_iter();
                loop {
                    if drain.requested() {
                        return;
                    }
                    let chunk: Vec<SourceRow> = batch.by_ref().take(PREPARE_CHUNK).collect();
                    if chunk.is_empty() {
                        break;
                    }
                    // The chunk's requests go to the engine together (`drive::Chunks`).
                    let mut ready = Vec::with_capacity(chunk.len());
                    for row in prepare.prepare_all(chunk) {
                        let route = match Request::ready(row) {
                            Ok(request) => keyed.route(request),
                            Err(failure) => Route::Sink(Outcome::Failed(failure)),
                        };
                        let sent = match route {
                            Route::Engine(request) => {
                                ready.push(request);
                                true
                            }
                            Route::Wait => true,
                            Route::Sink(outcome) => failed.blocking_send(outcome).is_ok(),
                        };
                        if !sent {
                            return;
                        }
                    }
                    if !ready.is_empty() && requests.send(ready).is_err() {
                        return;
                    }
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start the tokenizer thread: {e}")))
}

/// The tokens a run of rows is expected to cost, for balancing shards: prompt bytes at about four per token, and
/// every row's full output budget (decode steps cost far more than prompt tokens, so this errs towards them).
fn estimated_tokens(job: &Job, prompt_bytes: u64, rows: u32) -> u64 {
    let output = match job.kind {
        JobKind::Generate | JobKind::Seq2seq => job.generation.max_new_tokens as u64,
        JobKind::Embed => 0,
    };
    prompt_bytes.div_ceil(4) + rows as u64 * output
}

/// `nightshift status`: an output's progress per shard.
pub fn status(url: &str) -> Result<sink::OutputStatus, Error> {
    let rt = runtime()?;
    let output = Output::resolve(url)?;
    Ok(rt.block_on(output.status())?)
}

/// `nightshift report`: the job report of an output, complete or not, as an HTML page; `to`, where it will be
/// written, is checked first ([`side_file`]).
pub fn report(url: &str, to: Option<&Path>) -> Result<String, Error> {
    if let Some(to) = to {
        side_file(to, "--to", url)?;
    }
    let rt = runtime()?;
    let output = Output::resolve(url)?;
    Ok(crate::report::render(&rt.block_on(output.report_data(false))?))
}

/// A file the user named for writing beside the output at `output_url` (`--to`, `--metrics-textfile`): a file, a
/// link to one, a device or a FIFO, and never one of the output's own files (exit 2 otherwise).
fn side_file(path: &Path, what: &str, output_url: &str) -> Result<(), Error> {
    let output = crate::source::store::local_path(output_url).and_then(Result::ok);
    crate::files::check_writable(path, what, output.as_deref()).map(drop).map_err(Error::Usage)
}

/// `output.export`: the completed output written in `format` under `OUT/<format>/` too; with `if_missing`, only
/// when a whole export is not there already.
fn export_after_run(rt: &tokio::runtime::Runtime, output: &Output, format: crate::job::ExportFormat, if_missing: bool) -> Result<(), Error> {
    let to = Output::resolve(&format!("{}/{}/", output.url().trim_end_matches('/'), format.name()))?;
    if if_missing {
        let there = match format {
            crate::job::ExportFormat::OpenaiBatch => rt.block_on(to.has_openai_batch())?,
        };
        if there {
            return Ok(());
        }
    }
    let exported = match format {
        crate::job::ExportFormat::OpenaiBatch => rt.block_on(output.export_openai_batch(&to, None))?,
    };
    info!(results = %crate::redact::redact_urls(&exported.results_url), lines = exported.results, errors = exported.errors, "exported ({})", format.name());
    Ok(())
}

/// `nightshift export --format openai-batch`: a completed output as the Batch API's two files under `to`.
pub fn export_openai_batch(url: &str, to: &str, model: Option<&str>) -> Result<sink::export::Exported, Error> {
    let rt = runtime()?;
    let output = Output::resolve(url)?;
    let to = Output::resolve(to)?;
    Ok(rt.block_on(output.export_openai_batch(&to, model))?)
}

/// `nightshift finalize`: completes an output whose units are all committed.
pub fn finalize(url: &str) -> Result<(Finalized, String), Error> {
    let rt = runtime()?;
    let output = Output::resolve(url)?;
    let finalized = rt.block_on(output.finalize())?;
    Ok((finalized, output.display(sink::MANIFEST_FILE)))
}

fn progress_bar(enabled: bool, total: u64) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} rows  {msg}  ETA {eta}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    bar.set_message("starting");
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}
