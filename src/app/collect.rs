//! The sink side of a run: output rows arrive in any order, are put back in their unit's input order, and a unit
//! is committed (results and metrics, create-once) as soon as its last row is in.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::engine::EngineStats;
use crate::error::Error;
use crate::metrics::{Collector, JobMetrics};
use crate::outcome::Outcome;
use crate::plan::Unit;
use crate::reuse::dedup::Dedup;
use crate::reuse::sources::Sources;
use crate::sink::{Commit, Output, RunMetadata};

/// Figures of the run that every metrics row carries, beside the rows' own.
pub struct RunFigures {
    pub started: Instant,
    /// `started` as seconds since the Unix epoch.
    pub started_unix_s: f64,
    pub model_load_s: f64,
    pub weights_bytes: u64,
    pub weights_layout: &'static str,
    pub kv_cache_dtype: &'static str,
    pub tensor_parallel: u64,
}

impl RunFigures {
    /// A metrics row: the rows' figures, the engine's, and the run's.
    pub fn metrics(&self, rows: &Collector, engine: &EngineStats, generation_s: f64) -> JobMetrics {
        let mut metrics = JobMetrics::summarise(rows, engine, generation_s);
        metrics.model_load_s = self.model_load_s;
        metrics.weights_bytes = self.weights_bytes;
        metrics.weights_layout = self.weights_layout;
        metrics.kv_cache_dtype = self.kv_cache_dtype;
        metrics.tensor_parallel = self.tensor_parallel;
        metrics.job_s = self.started.elapsed().as_secs_f64();
        metrics.started_unix_s = self.started_unix_s;
        metrics
    }
}

/// What the collector needs besides the rows.
pub struct Collect<'a> {
    pub output: &'a Output,
    pub run: &'a RunMetadata,
    pub units: HashMap<u32, Unit>,
    /// The engine's figures so far (the engine thread updates them after each step).
    pub engine_stats: Arc<Mutex<EngineStats>>,
    pub figures: &'a RunFigures,
    pub progress: &'a ProgressBar,
    /// Result rows to keep for the caller to show.
    pub show: usize,
    /// When generation started, for the progress bar's rate.
    pub generation_started: Instant,
    /// Where progress goes for Prometheus, told of every commit, with the units committed before this run.
    pub exporter: Option<Arc<crate::metrics::prometheus::Exporter>>,
    pub committed_before: usize,
    /// Identical requests computed once: gives each computed row its key and copies for the rows that waited.
    pub dedup: Arc<Dedup>,
    /// Where reused rows are read from.
    pub sources: Option<Arc<Sources>>,
}

/// What the collector did.
pub struct Collected {
    pub rows: Collector,
    pub sample: Vec<Outcome>,
    pub units_committed: usize,
    /// Units with some rows in but not all (when the run stopped early).
    pub unfinished: usize,
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
    fn new(unit: &Unit) -> UnitBuffer {
        UnitBuffer { rows: vec![None; unit.rows as usize], filled: 0, collector: Collector::default(), first_ready: None }
    }

    /// Notes a row that just finished, `e2e_s` after it was ready.
    fn row_took(&mut self, e2e_s: f64) {
        let now = Instant::now();
        let ready = now.checked_sub(Duration::from_secs_f64(e2e_s)).unwrap_or(now);
        self.first_ready = Some(self.first_ready.map_or(ready, |r| r.min(ready)));
    }
}

/// Counts an outcome in the job's and its unit's figures.
fn count(outcome: &Outcome, total: &mut Collector, buffer: &mut UnitBuffer) {
    match outcome {
        Outcome::Completed(c) => {
            total.completed(c);
            buffer.collector.completed(c);
            buffer.row_took(c.e2e_s);
        }
        Outcome::Embedded(e) => {
            let duplicate = e.duplicate_of.is_some();
            total.embedded(e.prompt_tokens, e.e2e_s, duplicate);
            buffer.collector.embedded(e.prompt_tokens, e.e2e_s, duplicate);
            buffer.row_took(e.e2e_s);
        }
        Outcome::Reused(_) => {
            total.reused();
            buffer.collector.reused();
        }
        Outcome::Failed(f) => {
            debug!(id = %f.id, code = %f.error.code, "row errored");
            total.errored();
            buffer.collector.errored();
        }
    }
}

/// Receives every output row until the channel closes, committing each unit as it completes. An error comes with
/// the units this run committed before it (what a resumable failure reports).
pub async fn collect(rows: mpsc::Receiver<Outcome>, c: Collect<'_>) -> Result<Collected, (Error, usize)> {
    let mut units_committed = 0usize;
    let collected = collect_counting(rows, c, &mut units_committed).await;
    collected.map_err(|e| (e, units_committed))
}

async fn collect_counting(mut rows: mpsc::Receiver<Outcome>, c: Collect<'_>, units_committed: &mut usize) -> Result<Collected, Error> {
    let mut total = Collector::default();
    let mut sample = Vec::new();
    let mut open: HashMap<u32, UnitBuffer> = HashMap::new();
    let mut units_done = 0;
    let mut copies = VecDeque::new();
    loop {
        let outcome = match copies.pop_front() {
            Some(copy) => copy,
            None => match rows.recv().await {
                Some(mut outcome) => {
                    copies.extend(c.dedup.finished(&mut outcome));
                    outcome
                }
                None => break,
            },
        };
        let tag = outcome.tag();
        let unit = c.units.get(&tag.unit).ok_or_else(|| Error::Internal(format!("a row of unit {} that is not pending (a bug)", tag.unit)))?;
        let buffer = open.entry(tag.unit).or_insert_with(|| UnitBuffer::new(unit));
        count(&outcome, &mut total, buffer);
        if sample.len() < c.show {
            sample.push(outcome.clone());
        }
        let slot = buffer.rows.get_mut(tag.offset as usize).ok_or_else(|| Error::Internal(format!("row {tag:?} is outside its unit (a bug)")))?;
        if slot.replace(outcome).is_some() {
            return Err(Error::Internal(format!("row {tag:?} arrived twice (a bug)")));
        }
        buffer.filled += 1;
        c.progress.inc(1);
        let elapsed = c.generation_started.elapsed().as_secs_f64();
        if elapsed > 0.0 {
            c.progress.set_message(format!("{:.1} output tok/s", total.completion_tokens as f64 / elapsed));
        }
        if buffer.filled == unit.rows {
            let buffer = open.remove(&tag.unit).expect("the buffer is open");
            if commit(unit, buffer, &c).await? {
                *units_committed += 1;
            }
            // Committed either way: by this attempt or by another first.
            units_done += 1;
            if let Some(exporter) = &c.exporter {
                exporter.progress(&total, c.committed_before + units_done);
            }
        }
    }
    Ok(Collected { rows: total, sample, units_committed: *units_committed, unfinished: open.len() })
}

/// Commits a complete unit; whether this attempt's copy won.
async fn commit(unit: &Unit, buffer: UnitBuffer, c: &Collect<'_>) -> Result<bool, Error> {
    let mut rows: Vec<Outcome> = buffer.rows.into_iter().map(|r| r.expect("every row is filled")).collect();
    if let Some(sources) = &c.sources {
        sources.resolve(&mut rows).await?;
    }
    let generation_s = buffer.first_ready.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let stats = c.engine_stats.lock().expect("not poisoned").clone();
    let metrics = c.figures.metrics(&buffer.collector, &stats, generation_s);
    match c.output.commit_unit(unit, c.run, &rows, &metrics).await? {
        Commit::Won => {
            info!(unit = unit.id, rows = unit.rows, "unit committed");
            Ok(true)
        }
        Commit::Lost => {
            warn!(unit = unit.id, "another attempt committed this unit first; this attempt's copy was discarded");
            Ok(false)
        }
    }
}
