//! Wires the stages of a job together.
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
//! commits a unit as soon as its last row is in. A rerun of the same job skips committed units.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span, warn};

use crate::engine::{self, BatchConfig, BatchEngine, Engine, EngineStats, Model, ModelError, Request, StopRules};
use crate::error::{Error, Exit};
use crate::encoder::Encoder;
use crate::job::{ChatTemplateChoice, Job, JobKind, Overrides, PromptColumn};
use crate::metrics::{Collector, JobMetrics};
use crate::plan::shard::{self, Assignment, ShardArg};
use crate::plan::{Fingerprint, Plan, Unit, OUTPUT_FORMAT_VERSION};
use crate::sink::{self, Commit, Embedded, Finalized, Manifest, Outcome, Output, ResultsLayout, RunMetadata};
use crate::source::{Input, SourceRow};
use crate::tokenize::{EncoderPreprocessor, Prepare, Preprocessor};

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
/// tokens/s. Called at start-up, before any thread exists.
pub fn tune_cpu_threads() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        // Sound: called first thing in `main`, while the process has one thread.
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "100");
    }
}

/// sha256 of a file, lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String, ModelError> {
    let open = |source| ModelError::Open { path: path.into(), source };
    let mut file = std::fs::File::open(path).map_err(open)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(open)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
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

/// SIGTERM / SIGINT handling. The first signal asks the job to drain: no new rows are admitted, running sequences
/// may finish until the grace deadline, complete units are committed, and the process exits "partial, resumable".
/// A second signal exits at once.
#[derive(Default)]
pub struct Drain {
    requested: AtomicBool,
    deadline: std::sync::Mutex<Option<Instant>>,
}

impl Drain {
    pub fn start(&self, grace: Duration) {
        *self.deadline.lock().expect("not poisoned") = Some(Instant::now() + grace);
        self.requested.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    pub fn past_deadline(&self) -> bool {
        self.requested() && self.deadline.lock().expect("not poisoned").is_some_and(|d| Instant::now() >= d)
    }
}

fn watch_signals(rt: &tokio::runtime::Runtime, drain: Arc<Drain>, grace: Duration) -> Result<(), Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let _guard = rt.enter();
    let cannot = |e: std::io::Error| Error::Internal(format!("cannot install signal handlers: {e}"));
    let mut term = signal(SignalKind::terminate()).map_err(cannot)?;
    let mut int = signal(SignalKind::interrupt()).map_err(cannot)?;
    rt.spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        warn!(grace_s = grace.as_secs_f64(), "signal received: admitting no more rows; finishing running sequences and committing complete units (a second signal exits at once)");
        drain.start(grace);
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        eprintln!("error: second signal: exiting at once; committed units are kept, rerun the job to resume");
        std::process::exit(Exit::Partial as i32);
    });
    Ok(())
}

/// A unit's rows as they arrive, in input order once complete.
struct UnitBuffer {
    rows: Vec<Option<Outcome>>,
    filled: u32,
    collector: Collector,
    /// When the unit's earliest row was ready for the engine.
    first_ready: Option<Instant>,
}

impl UnitBuffer {
    /// Notes a row that just finished, `e2e_s` after it was ready.
    fn row_took(&mut self, e2e_s: f64) {
        let now = Instant::now();
        let ready = now.checked_sub(Duration::from_secs_f64(e2e_s)).unwrap_or(now);
        self.first_ready = Some(self.first_ready.map_or(ready, |r| r.min(ready)));
    }
}

pub fn run(options: RunOptions) -> Result<RunReport, Error> {
    let started = Instant::now();
    let job = Job::load(&options.job, &options.overrides)?;
    let assignment = shard::resolve(options.shard.as_ref(), job.output.shards, |name| std::env::var(name).ok())?;
    let _span = info_span!("job", file = %job.file.display(), shard = %assignment).entered();
    if let Assignment::One { from, .. } = &assignment {
        info!(from = %from, "running {assignment}");
    }
    if let Some(threads) = job.runtime.threads {
        limit_threads(threads);
    }
    let rt = runtime()?;
    let drain = Arc::new(Drain::default());
    watch_signals(&rt, drain.clone(), job.runtime.drain_grace)?;

    let (input, output) = rt.block_on(async { Ok::<_, Error>((Input::open(&job.input).await?, Output::open(&job.output.url).await?)) })?;
    info!(url = input.url(), files = input.file_urls().len(), rows = input.total_rows(), "input opened");

    // Everything that can fail on the model or its tokenizer fails before a plan is written: a plan made by a run
    // that could never start would refuse the corrected job.
    let device = engine::select_device(&job.runtime.device)?;
    let load_started = Instant::now();
    let loaded = load_worker(&job, &device)?;
    let model_load_s = load_started.elapsed().as_secs_f64();
    info!(path = %job.model.path.display(), weights_mib = loaded.weights_bytes >> 20, seconds = format!("{model_load_s:.2}"), "model loaded");
    let Loaded { worker, prepare, model_sha256, template, weights_bytes, layout } = loaded;
    let weights_bytes = weights_bytes as u64;

    // The plan: this job's fingerprint against the one stored at the output, if any.
    let ours = fingerprint(&job, &model_sha256, template.as_deref(), &input);
    let plan = rt.block_on(async {
        let plan = match output.read_plan().await? {
            Some(stored) => stored,
            None => {
                // Only a new plan reads every id: a stored plan was checked when it was made.
                input.check_unique_ids().await?;
                let shards = match &assignment {
                    Assignment::One { count, .. } => *count,
                    Assignment::All => job.output.shards.unwrap_or(1),
                };
                let new = Plan::new(ours.clone(), job.output.unit_rows, shards, |file, first_row, rows| {
                    estimated_tokens(&job, input.prompt_bytes(file, first_row, rows), rows)
                });
                if new.units.len() < shards as usize {
                    warn!(units = new.units.len(), shards, "fewer units than shards: the last shards have nothing to do (lower output.unit_rows)");
                }
                output.create_plan(&new).await?
            }
        };
        output.check_same_job(&plan, &ours)?;
        if let Assignment::One { count, .. } = &assignment {
            if *count != plan.shards {
                return Err(sink::SinkError::ShardCount { url: output.url().into(), planned: plan.shards, asked: assignment.to_string() }.into());
            }
        }
        if plan.unit_rows != job.output.unit_rows {
            warn!(planned = plan.unit_rows, asked = job.output.unit_rows, "output.unit_rows differs from the stored plan's; the plan's units are kept");
        }
        Ok::<_, Error>(plan)
    })?;
    let run = RunMetadata {
        layout,
        model_sha256,
        model: job.model.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        job: job.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        fingerprint: plan.fingerprint.digest(),
        attempt: sink::new_attempt(),
    };
    let report = |status, manifest: Option<Manifest>, units_committed, units_skipped, metrics, sample| RunReport {
        status,
        output_url: output.url().into(),
        manifest_url: output.display(sink::MANIFEST_FILE),
        manifest,
        assignment: assignment.clone(),
        units_committed,
        units_skipped,
        metrics,
        sample,
    };
    if rt.block_on(output.is_complete())? {
        let manifest = match rt.block_on(output.finalize())? {
            Finalized::AlreadyComplete(m) | Finalized::Done(m) => m,
        };
        info!(output = output.url(), "the output is complete already; nothing to do");
        return Ok(report(RunStatus::AlreadyComplete, Some(manifest), 0, plan.units.len(), JobMetrics::default(), Vec::new()));
    }
    let committed = rt.block_on(output.committed_units())?;
    let ours_units: Vec<&Unit> = plan.units.iter().filter(|u| assignment.includes(u.shard)).collect();
    let pending: Vec<Unit> = ours_units.iter().filter(|u| !committed.contains(&u.id)).map(|u| (*u).clone()).collect();
    let units_skipped = ours_units.len() - pending.len();
    info!(
        units = plan.units.len(), shards = plan.shards, ours = ours_units.len(), committed = units_skipped, pending = pending.len(),
        attempt = %run.attempt, fingerprint = %run.fingerprint, "plan"
    );

    let runtime = job.runtime.clone();
    let engine_stats = Arc::new(std::sync::Mutex::new(EngineStats::default()));

    let pending_rows: u64 = pending.iter().map(|u| u.rows as u64).sum();
    let progress = progress_bar(options.progress, pending_rows);

    // Channels: source -> tokenize -> engine -> sink, and tokenize -> sink for rows that fail before the engine.
    let (source_tx, mut source_rx) = mpsc::channel::<Vec<SourceRow>>(SOURCE_DEPTH);
    // An encoder sorts a window of queued rows by length before batching them, so it gets a deeper queue.
    let queue = match worker {
        Worker::Generate(_) | Worker::Seq2seq(_) => runtime.max_seqs * 2,
        Worker::Embed(_) => EMBED_WINDOW,
    };
    let (request_tx, request_rx) = std_mpsc::sync_channel::<Request>(queue);
    let (sink_tx, mut sink_rx) = mpsc::channel::<Outcome>(runtime.max_seqs * 4);

    let source_units = pending.clone();
    let source_output = output.clone();
    let source_drain = drain.clone();
    let source_task = rt.spawn(async move {
        for unit in &source_units {
            if source_drain.requested() {
                break;
            }
            // Another attempt may have committed it since the run started.
            if source_output.is_committed(unit).await? {
                debug!(unit = unit.id, "committed by another attempt meanwhile; skipped");
                continue;
            }
            if !input.stream_unit(unit, &source_tx).await? {
                break;
            }
        }
        Ok::<_, Error>(())
    });
    let tokenize_sink = sink_tx.clone();
    let tokenize_drain = drain.clone();
    let tokenize_thread = std::thread::Builder::new()
        .name("nightshift-tokenize".into())
        .spawn(move || {
            while let Some(rows) = source_rx.blocking_recv() {
                if tokenize_drain.requested() {
                    return;
                }
                for row in prepare.prepare_all(rows) {
                    let sent = match Request::ready(row) {
                        Ok(request) => request_tx.send(request).is_ok(),
                        Err((id, tag, error)) => tokenize_sink.blocking_send(Outcome::Failed { id, tag, error }).is_ok(),
                    };
                    if !sent {
                        return;
                    }
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start the tokenizer thread: {e}")))?;
    let generation_started = Instant::now();
    let engine_drain = drain.clone();
    let shared_stats = engine_stats.clone();
    let engine_thread = std::thread::Builder::new()
        .name("nightshift-engine".into())
        .spawn(move || match worker {
            Worker::Generate(engine) => {
                // Every GPU operation of a run happens on this thread from here on.
                engine.model().bind_to_thread().map_err(|e| engine::EngineError::new(e.to_string()))?;
                drive(*engine, request_rx, sink_tx, &engine_drain, &shared_stats)
            }
            Worker::Embed(encoder) => drive_encoder(&encoder, &runtime, request_rx, sink_tx, &engine_drain, &shared_stats),
            Worker::Seq2seq(engine) => drive(engine, request_rx, sink_tx, &engine_drain, &shared_stats),
        })
        .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;

    let show = options.show;
    let units_by_id: HashMap<u32, Unit> = pending.iter().map(|u| (u.id, u.clone())).collect();
    let sink_result = rt.block_on(async {
        let mut total = Collector::default();
        let mut sample = Vec::new();
        let mut open: HashMap<u32, UnitBuffer> = HashMap::new();
        let mut committed_units = 0usize;
        while let Some(outcome) = sink_rx.recv().await {
            let tag = outcome.tag();
            let unit = units_by_id.get(&tag.unit).ok_or_else(|| Error::Internal(format!("a row of unit {} that is not pending (a bug)", tag.unit)))?;
            let buffer = open.entry(tag.unit).or_insert_with(|| UnitBuffer {
                rows: vec![None; unit.rows as usize],
                filled: 0,
                collector: Collector::default(),
                first_ready: None,
            });
            match &outcome {
                Outcome::Completed(c) => {
                    total.completed(c);
                    buffer.collector.completed(c);
                    buffer.row_took(c.e2e_s);
                }
                Outcome::Embedded(e) => {
                    total.embedded(e.prompt_tokens, e.e2e_s);
                    buffer.collector.embedded(e.prompt_tokens, e.e2e_s);
                    buffer.row_took(e.e2e_s);
                }
                Outcome::Failed { id, error, .. } => {
                    debug!(id = %id, code = %error.code, "row errored");
                    total.errored();
                    buffer.collector.errored();
                }
            }
            if sample.len() < show {
                sample.push(outcome.clone());
            }
            let slot = buffer.rows.get_mut(tag.offset as usize).ok_or_else(|| Error::Internal(format!("row {tag:?} is outside its unit (a bug)")))?;
            if slot.replace(outcome).is_some() {
                return Err(Error::Internal(format!("row {tag:?} arrived twice (a bug)")));
            }
            buffer.filled += 1;
            progress.inc(1);
            let elapsed = generation_started.elapsed().as_secs_f64();
            if elapsed > 0.0 {
                progress.set_message(format!("{:.1} output tok/s", total.completion_tokens as f64 / elapsed));
            }
            if buffer.filled == unit.rows {
                let buffer = open.remove(&tag.unit).expect("the buffer is open");
                let rows: Vec<Outcome> = buffer.rows.into_iter().map(|r| r.expect("every row is filled")).collect();
                let generation_s = buffer.first_ready.map_or(0.0, |t| t.elapsed().as_secs_f64());
                let stats = engine_stats.lock().expect("not poisoned").clone();
                let mut metrics = JobMetrics::summarise(&buffer.collector, &stats, generation_s);
                metrics.model_load_s = model_load_s;
                metrics.weights_bytes = weights_bytes;
                metrics.job_s = started.elapsed().as_secs_f64();
                match output.commit_unit(unit, &run, &rows, &metrics).await? {
                    Commit::Won => {
                        committed_units += 1;
                        info!(unit = unit.id, rows = unit.rows, "unit committed");
                    }
                    Commit::Lost => warn!(unit = unit.id, "another attempt committed this unit first; this attempt's copy was discarded"),
                }
            }
        }
        Ok::<_, Error>((total, sample, committed_units, open.len()))
    });
    // Whatever happened, the engine and tokenizer threads end once their channels close.
    drop(sink_rx);
    let engine_result = engine_thread.join().map_err(|_| Error::Internal("the engine thread panicked (a bug)".into()))?;
    let _ = tokenize_thread.join();
    let source_result = rt.block_on(source_task).map_err(|e| Error::Internal(format!("the source task failed: {e}")))?;
    // The output was writable when the run started (the probe), so a read or write of it failing now, after
    // object_store's retries, is an outage: what is committed stays, and the job can be resumed.
    let units_total = ours_units.len();
    let resumable = |e: Error, committed_now: usize| match e {
        Error::Sink(source @ (sink::SinkError::Read { .. } | sink::SinkError::Write { .. })) => {
            Error::StoreFailed { committed: units_skipped + committed_now, total: units_total, source }
        }
        other => other,
    };
    // The first real cause wins: a source error explains a short engine run, an engine error a short sink run.
    let committed_by_sink = sink_result.as_ref().map(|r| r.2).unwrap_or(0);
    source_result.map_err(|e| resumable(e, committed_by_sink))?;
    let final_stats = engine_result.map_err(Error::Engine)?;
    let (collector, sample, units_committed, unfinished) = sink_result.map_err(|e| resumable(e, 0))?;
    let generation_s = generation_started.elapsed().as_secs_f64();
    progress.finish_and_clear();

    let mut metrics = JobMetrics::summarise(&collector, &final_stats, generation_s);
    metrics.model_load_s = model_load_s;
    metrics.weights_bytes = weights_bytes;
    metrics.job_s = started.elapsed().as_secs_f64();
    if drain.requested() {
        let committed = rt.block_on(output.committed_units())?;
        let done = ours_units.iter().filter(|u| committed.contains(&u.id)).count();
        if done < ours_units.len() {
            return Err(Error::Interrupted { committed: done, total: ours_units.len(), what: assignment.to_string(), unfinished });
        }
    }
    // Every unit of ours is committed. A shard finalizes the output when it is the last to finish; otherwise
    // the others (or `nightshift finalize`) will.
    match rt.block_on(output.finalize()) {
        Ok(Finalized::Done(manifest) | Finalized::AlreadyComplete(manifest)) => {
            info!(
                rows = manifest.rows, errored = manifest.errored_rows, output_tokens_per_s = format!("{:.1}", metrics.output_tokens_per_s),
                seconds = format!("{:.1}", metrics.job_s), "job complete"
            );
            Ok(report(RunStatus::Complete, Some(manifest), units_committed, units_skipped, metrics, sample))
        }
        Err(sink::SinkError::Incomplete { missing, shards, .. }) if matches!(assignment, Assignment::One { .. }) => {
            let missing = format!("{missing} unit(s) of {shards} are not committed yet");
            info!(waiting_for = %missing, "{assignment} is committed; the output is finalized when the other shards are");
            Ok(report(RunStatus::ShardDone { missing }, None, units_committed, units_skipped, metrics, sample))
        }
        Err(e) => Err(resumable(e.into(), units_committed)),
    }
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

/// The model side of a job: a decoder's batching engine or an encoder.
// One per process, built once: the size of its largest variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Worker {
    Generate(Box<BatchEngine>),
    Embed(Encoder),
    Seq2seq(crate::seq2seq::Seq2SeqEngine),
}

struct Loaded {
    worker: Worker,
    prepare: Box<dyn Prepare>,
    model_sha256: String,
    /// The chat template, for the fingerprint.
    template: Option<String>,
    weights_bytes: usize,
    layout: ResultsLayout,
}

/// Rows an encoder sorts by length at a time before cutting them into batches.
const EMBED_WINDOW: usize = 512;

/// sha256 over an encoder directory's files (name and content), for the fingerprint. `model.sha256`, when set,
/// is checked against `model.safetensors`.
fn check_model_dir(job: &Job) -> Result<String, ModelError> {
    let mut hasher = Sha256::new();
    for file in crate::encoder::model_files(&job.model.path) {
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

fn load_worker(job: &Job, device: &candle_core::Device) -> Result<Loaded, Error> {
    match job.kind {
        JobKind::Generate => {
            // A Hugging Face directory is fingerprinted by its files, like the encoders' directories.
            let model_sha256 = if job.model.path.is_dir() { check_model_dir(job)? } else { check_model_file(job)? };
            let (model, info) = Model::load(&job.model.path, device)?;
            let cfg = &info.config;
            info!(architecture = %cfg.architecture, layers = cfg.layers, hidden = cfg.hidden_size, context = cfg.context_length,
                kv_bytes_per_token = model.kv_block_bytes() / engine::KV_BLOCK_TOKENS, "decoder");
            let kv_bytes = engine::kv_cache_bytes(job.runtime.kv_cache_memory, device);
            let batch = BatchConfig::new(job.runtime.max_seqs, job.runtime.max_batch_tokens, kv_bytes, model.kv_block_bytes());
            let longest = batch.max_sequence_tokens(cfg);
            info!(
                max_seqs = batch.max_seqs, max_batch_tokens = batch.max_batch_tokens,
                kv_cache_mib = (batch.kv_blocks * model.kv_block_bytes()) >> 20, kv_tokens = batch.kv_tokens(),
                tokens_per_seq_at_max_seqs = batch.kv_tokens() / batch.max_seqs, longest_sequence = longest,
                "engine configured: {} sequences fit at {} tokens each, before preemption",
                batch.kv_tokens() / longest.max(1), longest
            );
            if longest < cfg.context_length {
                warn!(context = cfg.context_length, longest, "the KV cache budget holds less than the model's context; longer rows fail with prompt_too_long (raise runtime.kv_cache_memory)");
            }
            // Prompts are checked against the longest sequence the engine can run, so one that can never fit is an
            // error row at tokenization, not a stall.
            let preprocessor =
                Preprocessor::new(&info.vocab, &job.model.chat_template, &job.input, longest, job.generation.max_new_tokens)?;
            let stop = StopRules::new(&info.vocab);
            let weights_bytes = model.weight_bytes();
            let mut engine = BatchEngine::new(model, preprocessor.tokenizer().clone(), job.generation.clone(), stop, batch).map_err(Error::Engine)?;
            // The job's own parameters against the model: its stop token ids, its n, its JSON Schema compiled.
            engine.check_params(&job.generation).map_err(|(key, problem)| crate::job::JobError::Invalid { path: job.file.clone(), key, problem })?;
            Ok(Loaded {
                worker: Worker::Generate(Box::new(engine)),
                prepare: Box::new(preprocessor),
                model_sha256,
                template: info.vocab.chat_template.clone(),
                weights_bytes,
                layout: ResultsLayout::Generate,
            })
        }
        JobKind::Seq2seq => {
            let model_sha256 = check_model_dir(job)?;
            let model = crate::seq2seq::T5::load(&job.model.path, device)?;
            let c = &model.config;
            info!(layers = c.num_layers, decoder_layers = c.decoder_layers(), d_model = c.d_model, heads = c.num_heads, "encoder-decoder");
            let tokenizer = crate::encoder::tokenizer(&job.model.path)?;
            let prepare = EncoderPreprocessor::new(tokenizer.clone(), crate::seq2seq::MAX_SOURCE_TOKENS, job.input.truncate)?;
            let weights_bytes = model.weight_bytes();
            let engine = crate::seq2seq::Seq2SeqEngine::new(model, tokenizer, job.generation.clone(), job.runtime.max_seqs);
            Ok(Loaded {
                worker: Worker::Seq2seq(engine),
                prepare: Box::new(prepare),
                model_sha256,
                template: None,
                weights_bytes,
                layout: ResultsLayout::Generate,
            })
        }
        JobKind::Embed => {
            let model_sha256 = check_model_dir(job)?;
            let encoder = Encoder::load(&job.model.path, device)?;
            let info = &encoder.info;
            info!(layers = info.config.num_hidden_layers, dimensions = info.dimensions, pooling = ?info.pooling,
                normalize = info.normalize, max_tokens = info.max_tokens, "encoder");
            let tokenizer = crate::encoder::tokenizer(&job.model.path)?;
            let prepare = EncoderPreprocessor::new(tokenizer, info.max_tokens, job.input.truncate)?;
            Ok(Loaded {
                layout: ResultsLayout::Embed { dimensions: info.dimensions },
                weights_bytes: encoder.weight_bytes(),
                worker: Worker::Embed(encoder),
                prepare: Box::new(prepare),
                model_sha256,
                template: None,
            })
        }
    }
}

/// The encoder thread's loop: take a window of queued rows, sort it by length, cut it into batches of at most
/// `max_seqs` rows and `max_batch_tokens` padded tokens, embed each batch, send the vectors.
fn drive_encoder(
    encoder: &Encoder,
    config: &crate::job::RuntimeSpec,
    requests: std_mpsc::Receiver<Request>,
    sink: mpsc::Sender<Outcome>,
    drain: &Drain,
    shared: &std::sync::Mutex<EngineStats>,
) -> Result<EngineStats, engine::EngineError> {
    let mut stats = EngineStats::default();
    loop {
        if drain.requested() {
            return Ok(stats);
        }
        let first = match requests.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => r,
            Err(std_mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return Ok(stats),
        };
        let mut window = vec![first];
        while window.len() < EMBED_WINDOW {
            match requests.try_recv() {
                Ok(r) => window.push(r),
                Err(_) => break,
            }
        }
        window.sort_by_key(|r| r.tokens.len());
        let lengths: Vec<usize> = window.iter().map(|r| r.tokens.len()).collect();
        for range in crate::encoder::length_batches(&lengths, config.max_seqs, config.max_batch_tokens) {
            let batch = &window[range];
            let rows: Vec<&[u32]> = batch.iter().map(|r| r.tokens.as_slice()).collect();
            let vectors = encoder.embed(&rows).map_err(|e| engine::EngineError::new(e.to_string()))?;
            let now = Instant::now();
            stats.steps += 1;
            stats.prefill_tokens += (batch.len() * batch[batch.len() - 1].tokens.len()) as u64;
            stats.peak_running = stats.peak_running.max(batch.len());
            *shared.lock().expect("not poisoned") = stats.clone();
            for (request, vector) in batch.iter().zip(vectors) {
                let embedded = Embedded {
                    id: request.id.clone(),
                    tag: request.tag,
                    vector,
                    prompt_tokens: request.tokens.len() as u32,
                    e2e_s: (now - request.arrival).as_secs_f64(),
                };
                if sink.blocking_send(Outcome::Embedded(embedded)).is_err() {
                    return Ok(stats);
                }
            }
        }
    }
}

/// `nightshift finalize`: completes an output whose units are all committed.
pub fn finalize(url: &str) -> Result<(Finalized, String), Error> {
    let rt = runtime()?;
    let output = Output::resolve(url)?;
    let finalized = rt.block_on(output.finalize())?;
    Ok((finalized, output.display(sink::MANIFEST_FILE)))
}

/// The engine thread's loop: admit while there is room, step, send completions. Blocks for input only when idle.
/// On a drain request it admits nothing more and stops at the grace deadline, dropping unfinished sequences
/// (their units are not committed, and a rerun redoes them).
fn drive<E: Engine>(
    mut engine: E,
    requests: std_mpsc::Receiver<Request>,
    sink: mpsc::Sender<Outcome>,
    drain: &Drain,
    shared: &std::sync::Mutex<EngineStats>,
) -> Result<EngineStats, engine::EngineError> {
    let mut open = true;
    loop {
        if drain.requested() {
            open = false;
            if drain.past_deadline() {
                return Ok(engine.stats().clone());
            }
        }
        while open && engine.free_places() > 0 {
            let next = if engine.has_work() {
                match requests.try_recv() {
                    Ok(r) => Some(r),
                    Err(std_mpsc::TryRecvError::Empty) => None,
                    Err(std_mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            } else {
                // Idle: wait for input, waking up now and then to notice a drain request.
                match requests.recv_timeout(Duration::from_millis(100)) {
                    Ok(r) => Some(r),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            };
            match next {
                Some(request) => {
                    let (id, tag) = (request.id.clone(), request.tag);
                    if let Err(error) = engine.admit(request) {
                        if sink.blocking_send(Outcome::Failed { id, tag, error }).is_err() {
                            return Ok(engine.stats().clone());
                        }
                    }
                }
                None => break,
            }
        }
        if !engine.has_work() {
            if open {
                continue;
            }
            return Ok(engine.stats().clone());
        }
        let results = engine.step()?;
        *shared.lock().expect("not poisoned") = engine.stats().clone();
        for result in results {
            let outcome = match result {
                Ok(completion) => Outcome::Completed(completion),
                Err(f) => Outcome::Failed { id: f.id, tag: f.tag, error: f.error },
            };
            if sink.blocking_send(outcome).is_err() {
                // The sink failed; its error is the one reported.
                return Ok(engine.stats().clone());
            }
        }
    }
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

/// What `validate` found.
#[derive(Debug)]
pub struct ValidateReport {
    pub input_files: Vec<String>,
    pub rows: u64,
    pub model: ModelSummary,
    pub output_url: String,
    /// `new`, resumable (how far), or complete; a different job's output is an error instead.
    pub output_state: String,
}

/// The model as `validate` found it.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per `validate`
pub enum ModelSummary {
    Decoder(engine::ModelInfo),
    Encoder(crate::encoder::EncoderInfo),
    Seq2seq(crate::seq2seq::T5Config),
}

/// Checks the job file, the input's files and columns, the model's metadata, tokenizer and chat template, and
/// whether the output holds this job's plan (or a different job's), without loading weights, generating or writing
/// anything.
pub fn validate(job_path: &Path, overrides: &Overrides) -> Result<ValidateReport, Error> {
    let job = Job::load(job_path, overrides)?;
    let rt = runtime()?;
    let input = rt.block_on(Input::open(&job.input))?;
    let output = Output::resolve(&job.output.url)?;
    let (model, model_sha256, template) = match job.kind {
        JobKind::Generate => {
            let model = engine::model::inspect(&job.model.path)?;
            let sha = if job.model.path.is_dir() { check_model_dir(&job)? } else { check_model_file(&job)? };
            let pre = Preprocessor::new(&model.vocab, &job.model.chat_template, &job.input, model.config.context_length, job.generation.max_new_tokens)?;
            // The generation parameters against the model, as a run checks them at start.
            let invalid = |(key, problem): (&'static str, String)| crate::job::JobError::Invalid { path: job.file.clone(), key, problem };
            engine::check_params(&job.generation, model.config.vocab_size, job.runtime.max_seqs).map_err(invalid)?;
            if let Some(schema) = &job.generation.json_schema {
                engine::grammars(pre.tokenizer(), model.config.vocab_size, &StopRules::new(&model.vocab))
                    .and_then(|mut g| g.compile(schema).map(drop))
                    .map_err(|e| invalid(("generation.json_schema", format!("cannot be used: {e}"))))?;
            }
            let template = model.vocab.chat_template.clone();
            (ModelSummary::Decoder(model), sha, template)
        }
        JobKind::Seq2seq => {
            let sha = check_model_dir(&job)?;
            let config: crate::seq2seq::T5Config = serde_json::from_slice(
                &std::fs::read(job.model.path.join("config.json"))
                    .map_err(|source| ModelError::Open { path: job.model.path.join("config.json"), source })?,
            )
            .map_err(|e| ModelError::Format { path: job.model.path.join("config.json"), message: e.to_string() })?;
            EncoderPreprocessor::new(crate::encoder::tokenizer(&job.model.path)?, crate::seq2seq::MAX_SOURCE_TOKENS, job.input.truncate)?;
            (ModelSummary::Seq2seq(config), sha, None)
        }
        JobKind::Embed => {
            let info = crate::encoder::inspect(&job.model.path)?;
            let sha = check_model_dir(&job)?;
            EncoderPreprocessor::new(crate::encoder::tokenizer(&job.model.path)?, info.max_tokens, job.input.truncate)?;
            (ModelSummary::Encoder(info), sha, None)
        }
    };
    // What a run would do with the output: start it, resume it, find it complete, or refuse it.
    let ours = fingerprint(&job, &model_sha256, template.as_deref(), &input);
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
    Ok(ValidateReport { input_files: input.file_urls(), rows: input.total_rows(), model, output_url: job.output.url, output_state })
}

/// What `nightshift plan` found.
#[derive(Debug, serde::Serialize)]
pub struct JobPlanReport {
    pub rows: u64,
    /// Rows that tokenized, and their prompt tokens (chat template included).
    pub ok_rows: u64,
    pub prompt_tokens: u64,
    /// Output tokens if every row generated its `max_new_tokens`.
    pub max_output_tokens: u64,
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
    pub longest_sequence: usize,
    /// Sequences of the job's mean length (prompt and all its output) the KV cache holds at once.
    pub sequences_fit: usize,
    pub weights_bytes: usize,
    pub simulation: crate::plan::report::Simulation,
    pub calibration: Option<crate::plan::report::Calibration>,
    pub estimated_seconds: Option<f64>,
}

/// `nightshift plan`: tokenizes every row (in parallel), reports the lengths, the schedule the engine would make
/// and its KV cache fit, and times a short calibration run on the job's first rows. Writes nothing anywhere.
pub fn plan_job(job_path: &Path, overrides: &Overrides, calibration_rows: usize) -> Result<JobPlanReport, Error> {
    use crate::plan::report;
    let job = Job::load(job_path, overrides)?;
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
    let input = rt.block_on(Input::open(&job.input))?;
    let device = engine::select_device(&job.runtime.device)?;
    let Loaded { worker, prepare, weights_bytes, .. } = load_worker(&job, &device)?;
    let Worker::Generate(engine) = worker else { unreachable!("a generate job loads a decoder") };
    let mut engine = *engine;
    let batch = engine.config().clone();
    let model_config = engine.model().config.clone();
    let longest = batch.max_sequence_tokens(&model_config);

    // Every row, a unit per file at a time, tokenized in parallel.
    let mut lengths: Vec<(usize, usize)> = Vec::new();
    let mut calibration_requests: Vec<Request> = Vec::new();
    let (mut rows, mut over_length_rows, mut over_length_ids) = (0u64, 0u64, Vec::new());
    let mut other_errors: std::collections::BTreeMap<String, u64> = Default::default();
    let (tx, mut rx) = mpsc::channel::<Vec<SourceRow>>(SOURCE_DEPTH);
    let files = input.snapshot();
    let reader = {
        let input = &input;
        async move {
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
        }
    };
    let consume = async {
        while let Some(batch_rows) = rx.recv().await {
            for row in prepare.prepare_all(batch_rows) {
                rows += 1;
                match row.tokens {
                    Ok(tokens) => {
                        let Ok(params) = job.generation.for_row(&row.params) else {
                            *other_errors.entry(crate::row::ErrorCode::InvalidParameters.as_str().to_string()).or_default() += 1;
                            continue;
                        };
                        // A scoring row's completion is prefilled with its prompt; nothing is generated.
                        let (prompt, max_new) = match &row.completion {
                            Some(c) => (tokens.len() + c.len(), 0),
                            None => (tokens.len(), params.max_new_tokens as usize),
                        };
                        lengths.push((prompt, max_new.min(longest.saturating_sub(prompt))));
                        if calibration_requests.len() < calibration_rows {
                            let row = crate::tokenize::PreparedRow { tokens: Ok(tokens), ..row };
                            calibration_requests.extend(Request::ready(row).ok());
                        }
                    }
                    Err(e) if e.code == crate::row::ErrorCode::PromptTooLong => {
                        over_length_rows += 1;
                        if over_length_ids.len() < 5 {
                            over_length_ids.push(row.id);
                        }
                    }
                    Err(e) => *other_errors.entry(e.code.as_str().to_string()).or_default() += 1,
                }
            }
        }
    };
    let (read, ()) = rt.block_on(async { tokio::join!(reader, consume) });
    read?;

    let histogram = report::Histogram::new(&lengths.iter().map(|l| l.0).collect::<Vec<_>>());
    let prompt_tokens: u64 = lengths.iter().map(|l| l.0 as u64).sum();
    let max_output_tokens: u64 = lengths.iter().map(|l| l.1 as u64).sum();
    let mean_sequence = (prompt_tokens + max_output_tokens).div_ceil(lengths.len().max(1) as u64).max(1) as usize;
    let schedule = batch.schedule();
    let simulation = report::simulate(&lengths, &schedule);

    // Calibration: the first rows, at most 32 new tokens each, through the real engine.
    let calibration = (!calibration_requests.is_empty()).then(|| {
        let started = Instant::now();
        let n = calibration_requests.len();
        for mut request in calibration_requests {
            let max_new = job.generation.for_row(&request.params).map_or(1, |p| p.max_new_tokens);
            request.params.max_new_tokens = Some(max_new.min(32));
            request.params.min_new_tokens = request.params.min_new_tokens.map(|m| m.min(32));
            request.arrival = Instant::now();
            engine.admit(request).map_err(|e| Error::Internal(format!("calibration row refused: {}", e.message)))?;
        }
        while engine.has_work() {
            engine.step().map_err(Error::Engine)?;
        }
        let s = engine.stats();
        Ok::<_, Error>(report::Calibration {
            rows: n,
            prefill_tokens_per_s: s.prefill_tokens_per_s(),
            decode_tokens_per_s: s.decode_tokens_per_s(),
            seconds: started.elapsed().as_secs_f64(),
        })
    });
    let calibration = calibration.transpose()?;
    let estimated_seconds = calibration.as_ref().and_then(|c| report::estimate_seconds(&simulation, c));
    Ok(JobPlanReport {
        rows,
        ok_rows: lengths.len() as u64,
        prompt_tokens,
        max_output_tokens,
        histogram,
        over_length_rows,
        over_length_ids,
        other_errors: other_errors.into_iter().collect(),
        max_seqs: batch.max_seqs,
        max_batch_tokens: batch.max_batch_tokens,
        kv_cache_bytes: (batch.kv_blocks * engine.model().kv_block_bytes()) as u64,
        kv_tokens: batch.kv_tokens(),
        longest_sequence: longest,
        sequences_fit: batch.kv_tokens() / mean_sequence,
        weights_bytes,
        simulation,
        calibration,
        estimated_seconds,
    })
}
