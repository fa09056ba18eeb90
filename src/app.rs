//! Wires the stages of a job together.
//!
//! ```text
//! source (tokio task) -> tokenize (thread, rayon) -> engine (its own thread) -> sink (tokio task)
//!                                  \----------------- error rows ----------------^
//! ```
//! Stages talk through bounded channels, so memory stays bounded for any input size. When a stage fails, it drops
//! its channel ends; the stages before it see a closed channel and stop, and the job returns the first error
//! without writing `_SUCCESS`.

use std::io::IsTerminal;
use std::io::Read;
use std::path::Path;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tracing::{debug, info, info_span};

use crate::engine::{self, BatchConfig, BatchEngine, Engine, Model, ModelError, Request, StopRules};
use crate::error::Error;
use crate::job::{Job, Overrides};
use crate::metrics::{Collector, JobMetrics};
use crate::sink::{self, Outcome, Output, RunMetadata};
use crate::source::{Input, SourceRow};
use crate::tokenize::Preprocessor;

/// Source batches in flight between the reader and the tokenizer.
const SOURCE_DEPTH: usize = 4;

pub struct RunOptions {
    pub job: std::path::PathBuf,
    pub overrides: Overrides,
    /// Draw a progress bar (only ever on a terminal).
    pub progress: bool,
    /// Result rows to keep for the caller to show.
    pub show: usize,
}

/// What a finished run reports to the command line.
#[derive(Debug)]
pub struct RunReport {
    pub results_url: String,
    pub metrics_url: String,
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
fn limit_threads(threads: usize) {
    // `set_var` is sound only while no other thread reads the environment; this runs on the main thread
    // before the I/O runtime, the engine or any pool is started.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    if rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().is_err() {
        tracing::warn!(threads, "the thread pool was already started; runtime.threads not applied to it");
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

pub fn run(options: RunOptions) -> Result<RunReport, Error> {
    let started = Instant::now();
    let job = Job::load(&options.job, &options.overrides)?;
    let _span = info_span!("job", file = %job.file.display()).entered();
    if let Some(threads) = job.runtime.threads {
        limit_threads(threads);
    }
    let rt = runtime()?;

    let (input, output) = rt.block_on(async { Ok::<_, Error>((Input::open(&job.input).await?, Output::open(&job.output.url).await?)) })?;
    info!(url = input.url(), files = input.file_urls().len(), rows = input.total_rows(), "input opened");

    let device = engine::select_device(&job.runtime.device)?;
    let load_started = Instant::now();
    let model_sha256 = check_model_file(&job)?;
    let (model, model_info) = Model::load(&job.model.path, &device)?;
    let model_load_s = load_started.elapsed().as_secs_f64();
    let cfg = &model_info.config;
    info!(
        path = %job.model.path.display(), architecture = %cfg.architecture, layers = cfg.layers, hidden = cfg.hidden_size,
        context = cfg.context_length, weights_mib = model.weight_bytes() >> 20, seconds = format!("{model_load_s:.2}"),
        "model loaded"
    );
    let preprocessor = Preprocessor::new(&model_info.vocab, &job.model.chat_template, &job.input, cfg.context_length)?;
    let stop = StopRules::new(&model_info.vocab, &job.generation);
    let tokenizer = preprocessor.tokenizer().clone();
    let weights_bytes = model.weight_bytes() as u64;
    let kv_per_token = cfg.kv_bytes_per_token();
    let batch = BatchConfig { max_seqs: job.runtime.max_seqs, max_batch_tokens: job.runtime.max_batch_tokens };
    info!(max_seqs = batch.max_seqs, max_batch_tokens = batch.max_batch_tokens, kv_bytes_per_token = kv_per_token, "engine configured");
    let engine = BatchEngine::new(model, tokenizer, job.generation.clone(), stop, batch.clone());

    let run = RunMetadata {
        model_sha256,
        model: job.model.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        job: job.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    };
    let mut results = output.results_writer(&run)?;
    let total_rows = input.total_rows();
    let progress = progress_bar(options.progress, total_rows);

    // Channels: source -> tokenize -> engine -> sink, and tokenize -> sink for rows that fail before the engine.
    let (source_tx, mut source_rx) = mpsc::channel::<Vec<SourceRow>>(SOURCE_DEPTH);
    let (request_tx, request_rx) = std_mpsc::sync_channel::<Request>(batch.max_seqs * 2);
    let (sink_tx, mut sink_rx) = mpsc::channel::<Outcome>(batch.max_seqs * 4);

    let source_task = rt.spawn(input.stream(source_tx));
    let tokenize_sink = sink_tx.clone();
    let tokenize_thread = std::thread::Builder::new()
        .name("nightshift-tokenize".into())
        .spawn(move || {
            while let Some(rows) = source_rx.blocking_recv() {
                for row in preprocessor.prepare_batch(rows) {
                    let sent = match row.tokens {
                        Ok(tokens) => request_tx.send(Request { id: row.id, tokens, arrival: Instant::now() }).is_ok(),
                        Err(error) => tokenize_sink.blocking_send(Outcome::Failed { id: row.id, error }).is_ok(),
                    };
                    if !sent {
                        return;
                    }
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start the tokenizer thread: {e}")))?;
    let generation_started = Instant::now();
    let engine_thread = std::thread::Builder::new()
        .name("nightshift-engine".into())
        .spawn(move || drive(engine, request_rx, sink_tx))
        .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;

    let show = options.show;
    let sink_result = rt.block_on(async {
        let mut collector = Collector::default();
        let mut sample = Vec::new();
        while let Some(outcome) = sink_rx.recv().await {
            match &outcome {
                Outcome::Completed(c) => collector.completed(c),
                Outcome::Failed { id, error } => {
                    debug!(id = %id, code = %error.code, "row errored");
                    collector.errored();
                }
            }
            if sample.len() < show {
                sample.push(outcome.clone());
            }
            results.push(outcome).await?;
            progress.inc(1);
            let elapsed = generation_started.elapsed().as_secs_f64();
            if elapsed > 0.0 {
                progress.set_message(format!("{:.1} output tok/s", collector.completion_tokens as f64 / elapsed));
            }
        }
        Ok::<_, Error>((collector, sample))
    });
    // Whatever happened, the engine and tokenizer threads end once their channels close.
    drop(sink_rx);
    let engine_result = engine_thread.join().map_err(|_| Error::Internal("the engine thread panicked (a bug)".into()))?;
    let _ = tokenize_thread.join();
    let source_result = rt.block_on(source_task).map_err(|e| Error::Internal(format!("the source task failed: {e}")))?;
    // The first real cause wins: a source error explains a short engine run, an engine error a short sink run.
    source_result?;
    let engine_stats = engine_result.map_err(Error::Engine)?;
    let (collector, sample) = sink_result?;
    let generation_s = generation_started.elapsed().as_secs_f64();
    progress.finish_and_clear();

    if collector.rows != total_rows {
        return Err(Error::Internal(format!(
            "{} rows were written but the input has {total_rows} (a bug); the output was not committed",
            collector.rows
        )));
    }
    let mut metrics = JobMetrics::summarise(&collector, &engine_stats, generation_s);
    metrics.model_load_s = model_load_s;
    metrics.weights_bytes = weights_bytes;
    rt.block_on(async {
        results.close().await?;
        metrics.job_s = started.elapsed().as_secs_f64();
        output.write_metrics(&metrics, &run).await?;
        let summary = serde_json::json!({
            "nightshift_version": env!("CARGO_PKG_VERSION"),
            "rows": metrics.rows,
            "succeeded_rows": metrics.succeeded_rows,
            "errored_rows": metrics.errored_rows,
            "files": [sink::RESULTS_FILE, sink::METRICS_FILE],
            "model_sha256": run.model_sha256,
        });
        output.commit(&summary).await
    })?;
    info!(
        rows = metrics.rows, errored = metrics.errored_rows, output_tokens_per_s = format!("{:.1}", metrics.output_tokens_per_s),
        seconds = format!("{:.1}", metrics.job_s), "job complete"
    );
    Ok(RunReport {
        results_url: output.display(sink::RESULTS_FILE),
        metrics_url: output.display(sink::METRICS_FILE),
        metrics,
        sample,
    })
}

/// The engine thread's loop: admit while there is room, step, send completions. Blocks for input only when idle.
fn drive(
    mut engine: BatchEngine,
    requests: std_mpsc::Receiver<Request>,
    sink: mpsc::Sender<Outcome>,
) -> Result<engine::EngineStats, engine::EngineError> {
    let mut open = true;
    loop {
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
                requests.recv().map_err(|_| open = false).ok()
            };
            match next {
                Some(request) => engine.admit(request),
                None => break,
            }
        }
        if !engine.has_work() {
            if open {
                continue;
            }
            return Ok(engine.stats().clone());
        }
        for completion in engine.step()? {
            if sink.blocking_send(Outcome::Completed(completion)).is_err() {
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
    pub model: engine::ModelInfo,
    pub output_url: String,
}

/// Checks the job file, the input's files and columns, and the model's metadata, tokenizer and chat template,
/// without loading weights, generating or writing anything.
pub fn validate(job_path: &Path, overrides: &Overrides) -> Result<ValidateReport, Error> {
    let job = Job::load(job_path, overrides)?;
    let rt = runtime()?;
    let input = rt.block_on(Input::open(&job.input))?;
    crate::source::store::resolve(&job.output.url).map_err(|e| Error::Sink(e.into()))?;
    let model = engine::model::inspect(&job.model.path)?;
    if let Some(expected) = &job.model.sha256 {
        let actual = sha256_file(&job.model.path)?;
        if *expected != actual {
            return Err(ModelError::Checksum { path: job.model.path.clone(), expected: expected.clone(), actual }.into());
        }
    }
    Preprocessor::new(&model.vocab, &job.model.chat_template, &job.input, model.config.context_length)?;
    Ok(ValidateReport { input_files: input.file_urls(), rows: input.total_rows(), model, output_url: job.output.url })
}
