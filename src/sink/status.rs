//! `nightshift status`: an output's progress per shard, read from its plan, commit markers and metrics files.

use std::collections::BTreeMap;

use futures::TryStreamExt;
use object_store::ObjectStoreExt;
use serde::Serialize;

use super::{Output, SinkError};

/// What `nightshift status` shows: the output's progress, per shard.
#[derive(Clone, Debug, Serialize)]
pub struct OutputStatus {
    pub url: String,
    /// `_SUCCESS` is written, and every file the commits name is there.
    pub complete: bool,
    /// Units whose commit names a file that is missing (deleted since): not counted as committed; a run computes
    /// them again.
    pub damaged_units: Vec<u32>,
    pub fingerprint: String,
    pub units: usize,
    pub committed_units: usize,
    pub rows: u64,
    pub committed_rows: u64,
    pub shards: Vec<ShardStatus>,
}

/// One shard's progress.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub units: usize,
    pub committed_units: usize,
    /// Uncommitted units, in order.
    pub missing_units: Vec<u32>,
    pub rows: u64,
    pub committed_rows: u64,
    pub errored_rows: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The plan's estimate for the whole shard (prompt and output tokens).
    pub estimated_tokens: u64,
    /// The attempts (processes) whose units are committed.
    pub attempts: Vec<String>,
    /// Seconds of those attempts' time, up to their last commit, that went to this shard's committed units.
    pub busy_s: f64,
    pub rows_per_s: Option<f64>,
    pub total_tokens_per_s: Option<f64>,
    pub output_tokens_per_s: Option<f64>,
}

/// A metrics file's `job_s`: the attempt's age when it committed the unit. A damaged file is an error: the parquet
/// crate's panics on a footer it cannot trust (chunk offsets out of range) are caught.
fn metrics_job_s(bytes: bytes::Bytes) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
    crate::panics::catch_panic(|| read_job_s(bytes)).unwrap_or_else(|panic| Err(format!("the file does not decode: {panic}").into()))
}

fn read_job_s(bytes: bytes::Bytes) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
    use arrow::array::{Array, AsArray};
    let mut reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)?.build()?;
    let batch = reader.next().ok_or("the metrics file has no rows")??;
    let job_s = batch.column_by_name("job_s").ok_or("the metrics file has no `job_s` column")?;
    let job_s = job_s.as_primitive_opt::<arrow::datatypes::Float64Type>().ok_or("`job_s` is not a float column")?;
    if batch.num_rows() == 0 || job_s.is_null(0) {
        return Err("the metrics file's row is empty".into());
    }
    Ok(job_s.value(0))
}

impl Output {
    /// Progress per shard, from the plan, the commit markers and the committed units' metrics files (nothing is
    /// written). Throughput is rows and tokens over busy time: each attempt's time from its start to its last
    /// commit, shared among its units by commit order (each unit gets the time since the attempt's previous
    /// commit), so start-up and model loading count against the first unit.
    pub async fn status(&self) -> Result<OutputStatus, SinkError> {
        use futures::StreamExt;
        let plan = self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })?;
        let success = self.is_complete().await?;
        if success {
            // A complete output's manifest is what readers go by: a damaged one is an error here too.
            self.read_manifest().await?;
        }
        let (markers, damaged_units) = self.whole_markers().await?;
        let complete = success && damaged_units.is_empty();
        // (unit, attempt, job_s at commit) for every committed unit.
        let timings: Vec<(u32, String, f64)> = futures::stream::iter(markers.values().cloned())
            .map(|m| async move {
                let bytes = self.read_bytes(&m.metrics).await?;
                let job_s = metrics_job_s(bytes).map_err(|e| SinkError::Read { url: self.display(&m.metrics), source: e })?;
                // The marker names the attempt whose files these are.
                Ok::<_, SinkError>((m.unit, m.attempt, job_s))
            })
            .buffer_unordered(16)
            .try_collect()
            .await?;
        let mut by_attempt: BTreeMap<&str, Vec<(f64, u32)>> = BTreeMap::new();
        for (unit, attempt, job_s) in &timings {
            by_attempt.entry(attempt.as_str()).or_default().push((*job_s, *unit));
        }
        let mut busy: BTreeMap<u32, f64> = BTreeMap::new();
        for commits in by_attempt.values_mut() {
            commits.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut before = 0.0;
            for (job_s, unit) in commits.iter() {
                busy.insert(*unit, (job_s - before).max(0.0));
                before = *job_s;
            }
        }
        let mut shards: Vec<ShardStatus> = (0..plan.shards).map(|shard| ShardStatus { shard, ..Default::default() }).collect();
        for unit in &plan.units {
            let Some(s) = shards.get_mut(unit.shard as usize) else { continue };
            s.units += 1;
            s.rows += unit.rows as u64;
            s.estimated_tokens += unit.estimated_tokens;
            match markers.get(&unit.id) {
                Some(m) => {
                    s.committed_units += 1;
                    s.committed_rows += m.rows;
                    s.errored_rows += m.errored_rows;
                    s.prompt_tokens += m.prompt_tokens;
                    s.completion_tokens += m.completion_tokens;
                    s.busy_s += busy.get(&unit.id).copied().unwrap_or(0.0);
                    if !s.attempts.contains(&m.attempt) {
                        s.attempts.push(m.attempt.clone());
                    }
                }
                None => s.missing_units.push(unit.id),
            }
        }
        for s in &mut shards {
            if s.busy_s > 0.0 {
                s.rows_per_s = Some(s.committed_rows as f64 / s.busy_s);
                s.total_tokens_per_s = Some((s.prompt_tokens + s.completion_tokens) as f64 / s.busy_s);
                s.output_tokens_per_s = Some(s.completion_tokens as f64 / s.busy_s);
            }
        }
        Ok(OutputStatus {
            url: self.url().into(),
            complete,
            damaged_units,
            fingerprint: plan.fingerprint.digest(),
            units: plan.units.len(),
            committed_units: markers.len(),
            rows: plan.total_rows(),
            committed_rows: markers.values().map(|m| m.rows).sum(),
            shards,
        })
    }

    /// The commit markers whose files are all there, and the units whose markers name a missing file (deleted
    /// since their commit: not counted as committed). Reads only.
    pub(super) async fn whole_markers(&self) -> Result<(BTreeMap<u32, super::Marker>, Vec<u32>), SinkError> {
        let mut markers = self.markers().await?;
        let files = self.unit_files().await?;
        let mut damaged_units = Vec::new();
        for marker in markers.values() {
            if self.missing_file(marker, &files).await?.is_some() {
                damaged_units.push(marker.unit);
            }
        }
        markers.retain(|unit, _| !damaged_units.contains(unit));
        Ok((markers, damaged_units))
    }

    pub(super) async fn read_bytes(&self, relative: &str) -> Result<bytes::Bytes, SinkError> {
        let read_err = |e: object_store::Error| SinkError::Read { url: self.display(relative), source: e.into() };
        self.store().get(&self.path(relative)).await.map_err(read_err)?.bytes().await.map_err(read_err)
    }

    /// A Parquet file of the output opened for streaming (ranged reads pinned to the version a HEAD found), with
    /// that version's last modification time (Unix seconds).
    pub(super) async fn open_parquet(&self, relative: &str) -> Result<(ParquetFile, i64), SinkError> {
        let read_err = |source: Box<dyn std::error::Error + Send + Sync>| SinkError::Read { url: self.display(relative), source };
        let meta = self.store().head(&self.path(relative)).await.map_err(|e| read_err(e.into()))?;
        let modified = meta.last_modified.timestamp();
        let reader = crate::source::PinnedReader::new(self.store().clone(), meta);
        Ok((ParquetFile::new(reader).await.map_err(|e| read_err(e.into()))?, modified))
    }

}

/// An output's Parquet file, ready to stream.
pub(super) type ParquetFile = parquet::arrow::ParquetRecordBatchStreamBuilder<crate::source::PinnedReader>;

/// The projection of `file` onto its top-level columns named in `names`.
pub(super) fn columns(file: &ParquetFile, names: &[&str]) -> parquet::arrow::ProjectionMask {
    let roots: Vec<usize> = file.schema().fields().iter().enumerate().filter(|(_, f)| names.contains(&f.name().as_str())).map(|(i, _)| i).collect();
    parquet::arrow::ProjectionMask::roots(file.parquet_schema(), roots)
}
