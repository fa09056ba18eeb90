//! Output: per-unit result and metrics files, commit markers, and the finalize step.
//!
//! Layout under the output URL (`../shared/DESIGN.md`, section 5):
//! ```text
//! OUT/_plan.json                                  create-once: input snapshot, units, job fingerprint
//! OUT/data/shard=S/u<unit>-a<attempt>.parquet     a unit's result rows, in input order (schemas/results.json)
//! OUT/metrics/shard=S/u<unit>-a<attempt>.parquet  a unit's figures, one row (schemas/metrics.json)
//! OUT/_commits/shard=S/u<unit>.json               create-once marker: the unit is committed, by these two files
//! OUT/_report.html                               by finalize, before the manifest that lists it: the job report
//! OUT/_manifest.json                              create-once, by finalize: every committed file, and totals
//! OUT/_SUCCESS                                    create-once, written last
//! ```
//! Data file names are unique per attempt and never overwritten, so two attempts at one unit (a zombie, a
//! requeued pod, two processes started by mistake) cannot replace each other's bytes; the create-once marker
//! decides which attempt's files count, and the loser deletes its own. A unit's rows are buffered until the unit
//! is complete and then uploaded as whole files, so a killed process leaves at most an orphan file that no
//! marker names, which finalize removes. Readers use `_manifest.json`. `S` is the unit's shard in the plan: a unit
//! has one shard for the life of the output, so its marker has one name.
//!
//! This file holds the commit protocol and finalize; `schema.rs` the Arrow schemas of the files (checked against
//! `schemas/`), `batches.rs` the record batches written into them, `status.rs` what `nightshift status` reads
//! back and `report.rs` what the job report (`crate::report`) reads.

mod batches;
pub mod export;
mod report;
pub mod reuse;
pub mod schema;
mod status;

pub use schema::{embeddings_schema, metrics_schema, results_schema};
pub use status::{OutputStatus, ShardStatus};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::{Schema, SchemaRef};
use futures::TryStreamExt;
use object_store::buffered::BufWriter;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use parquet::arrow::AsyncArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use crate::metrics::{JobMetrics, MetricsRow};
use crate::plan::{Plan, Unit};
use crate::source::{store, Location, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("output `{url}` is not writable")]
    NotWritable { url: String, #[source] source: object_store::Error },
    #[error("cannot write `{url}`")]
    Write { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    /// Rows that cannot be laid out in the results schema: a bug, never a store's fault (exit 1, not 75).
    #[error("cannot encode the rows of `{url}` (a bug)")]
    Encode { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error("cannot read `{url}`")]
    Read { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    /// An object of the output's own metadata (plan, commit marker, manifest) that does not parse: damaged, not a
    /// transient fault, so retrying cannot help (exit 5, not 75).
    #[error("`{url}` is damaged: it is not the JSON nightshift wrote; move the output aside (or repair the file) and run again")]
    Damaged { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error(
        "output `{url}` belongs to a different job ({differences}); resuming into it would mix results, so \
         write to a new output, or remove this one to start over"
    )]
    DifferentJob { url: String, differences: String },
    #[error("output `{url}` has no `_plan.json`: it was not written by a run of this nightshift")]
    NoPlan { url: String },
    #[error("output `{url}` is not complete (no `_SUCCESS`): run the job (or `nightshift finalize`) to finish it, then export it")]
    NotComplete { url: String },
    #[error("output `{url}` cannot be exported: {why}")]
    NotExportable { url: String, why: String },
    #[error(
        "output `{url}` is incomplete: {missing} of {total} units are not committed, in {shards} (first: {first}); \
         run the job (or those shards) again to finish them"
    )]
    Incomplete { url: String, missing: usize, total: usize, shards: String, first: String },
    #[error(
        "output `{url}` has a plan cut into {planned} shard(s), but this process was asked for {asked}; every \
         process of a job must use the plan's shard count (or run `--shard all`)"
    )]
    ShardCount { url: String, planned: u32, asked: String },
    #[error(
        "output `{url}`: unit u{unit:06} is committed by `{file}`, which is missing (deleted since); run the job \
         again to compute the unit anew"
    )]
    MissingFile { url: String, unit: u32, file: String },
}

pub const PLAN_FILE: &str = "_plan.json";
pub const MANIFEST_FILE: &str = "_manifest.json";
pub const REPORT_FILE: &str = "_report.html";
pub const SUCCESS_FILE: &str = "_SUCCESS";
const COMMITS_DIR: &str = "_commits";
const DATA_DIR: &str = "data";
const METRICS_DIR: &str = "metrics";

/// Rows encoded per Arrow batch when a unit is written.
const ROWS_PER_BATCH: usize = 512;
const ROWS_PER_ROW_GROUP: usize = 8192;
/// Attempts at a commit marker's conditional put after transient errors (object_store does not retry
/// conditional puts itself: they are not idempotent).
const COMMIT_TRIES: u32 = 6;

/// What result rows hold: generated text, or embeddings of a fixed length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResultsLayout {
    Generate,
    Embed { dimensions: usize },
}

/// Facts about the run stored in each file's key/value metadata.
#[derive(Clone, Debug)]
pub struct RunMetadata {
    pub layout: ResultsLayout,
    pub model_sha256: String,
    pub model: String,
    pub job: String,
    /// The plan's fingerprint digest: every file of one output carries the same one.
    pub fingerprint: String,
    pub attempt: String,
    /// The arithmetic the rows were computed with (`reuse::numerics`).
    pub numerics: String,
}

impl RunMetadata {
    fn pairs(&self) -> Vec<(String, String)> {
        vec![
            ("nightshift.version".into(), env!("CARGO_PKG_VERSION").into()),
            ("nightshift.model_sha256".into(), self.model_sha256.clone()),
            ("nightshift.model".into(), self.model.clone()),
            ("nightshift.job".into(), self.job.clone()),
            ("nightshift.fingerprint".into(), self.fingerprint.clone()),
            ("nightshift.attempt".into(), self.attempt.clone()),
            (reuse::NUMERICS_KEY.into(), self.numerics.clone()),
        ]
    }
}

pub use crate::outcome::{Embedded, Outcome};

/// `_commits/shard=S/u<unit>.json`: which attempt's files hold a unit, and its counts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    pub unit: u32,
    pub shard: u32,
    pub attempt: String,
    /// Paths relative to the output root.
    pub results: String,
    pub metrics: String,
    pub rows: u64,
    pub succeeded_rows: u64,
    pub errored_rows: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Marker {
    /// The marker's own path, relative to the output root.
    pub fn path(&self) -> String {
        format!("{COMMITS_DIR}/shard={}/u{:06}.json", self.shard, self.unit)
    }

    /// Whether the marker read from `relative` is one nightshift wrote: named for its unit and shard, naming the
    /// files [`Output::commit_unit`] writes for its attempt (never another file of the output: a forged marker must
    /// not make a resume delete `_plan.json`), with counts that add up. Valid JSON that says otherwise is damage,
    /// which no retry repairs (exit 5).
    fn check(&self, relative: &str) -> Result<(), String> {
        if relative != self.path() {
            return Err(format!("it says unit {} of shard {}, which is committed at `{}`", self.unit, self.shard, self.path()));
        }
        if self.attempt.is_empty() || !self.attempt.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(format!("its attempt {:?} is not an attempt id", self.attempt));
        }
        let stem = format!("shard={}/u{:06}-a{}.parquet", self.shard, self.unit, self.attempt);
        for (file, dir) in [(&self.results, DATA_DIR), (&self.metrics, METRICS_DIR)] {
            if *file != format!("{dir}/{stem}") {
                return Err(format!("it names `{file}`, not the unit's `{dir}/{stem}`"));
            }
        }
        if self.succeeded_rows.checked_add(self.errored_rows) != Some(self.rows) {
            return Err(format!("its {} succeeded and {} errored rows are not its {} rows", self.succeeded_rows, self.errored_rows, self.rows));
        }
        Ok(())
    }
}

/// `_manifest.json`: the committed output, for readers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub nightshift_version: String,
    pub fingerprint: String,
    pub rows: u64,
    pub succeeded_rows: u64,
    pub errored_rows: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Result files in unit order (input order), relative to the output root.
    pub results: Vec<String>,
    pub metrics: Vec<String>,
    /// The job report (`_report.html`), when finalize could make it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<String>,
    pub units: Vec<Marker>,
}

/// How a unit's commit ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Commit {
    /// This attempt's files are the unit's.
    Won,
    /// Another attempt committed the unit first; this attempt's files were deleted.
    Lost,
}

/// What finalize found.
#[derive(Debug)]
pub enum Finalized {
    /// This call wrote (or completed) the manifest and `_SUCCESS`.
    Done(Manifest),
    /// `_SUCCESS` was there already.
    AlreadyComplete(Manifest),
}

fn with_metadata(schema: Schema, run: &RunMetadata) -> SchemaRef {
    Arc::new(schema.with_metadata(run.pairs().into_iter().collect::<std::collections::HashMap<_, _>>()))
}

/// Writer settings; the run's facts go in the Parquet footer's key/value metadata (and, through the Arrow
/// schema, into the Arrow schema's metadata for Arrow readers).
fn properties(run: &RunMetadata) -> WriterProperties {
    let kv = run.pairs().into_iter().map(|(k, v)| parquet::file::metadata::KeyValue::new(k, v)).collect();
    WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_max_row_group_row_count(Some(ROWS_PER_ROW_GROUP))
        .build()
}

fn create() -> PutOptions {
    PutOptions { mode: PutMode::Create, ..Default::default() }
}

/// A fresh attempt id: unique per process start, so attempts never share a file name.
pub fn new_attempt() -> String {
    use sha2::{Digest, Sha256};
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let seed = format!("{nanos}:{}:{:?}", std::process::id(), std::thread::current().id());
    format!("{:x}", Sha256::digest(seed.as_bytes()))[..16].to_string()
}

/// An output location.
#[derive(Clone)]
pub struct Output {
    location: Location,
}

impl Output {
    /// Resolves the output URL and proves it is writable with a small probe object, so a bad location fails in
    /// seconds rather than after hours of generation.
    pub async fn open(url: &str) -> Result<Output, SinkError> {
        let output = Output::resolve(url)?;
        let probe = output.path(&format!("_nightshift_probe_{}", new_attempt()));
        let not_writable = |source| SinkError::NotWritable { url: url.into(), source };
        output.store().put(&probe, PutPayload::from_static(b"probe")).await.map_err(not_writable)?;
        output.store().delete(&probe).await.map_err(not_writable)?;
        Ok(output)
    }

    /// Resolves the output URL without touching it.
    pub fn resolve(url: &str) -> Result<Output, SinkError> {
        Ok(Output { location: store::resolve(url)? })
    }

    pub fn url(&self) -> &str {
        &self.location.url
    }

    fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.location.store
    }

    fn path(&self, relative: &str) -> Path {
        let mut path = self.location.path.clone();
        for part in relative.split('/') {
            path = path.join(part);
        }
        path
    }

    /// The user-facing URL of a file under the output.
    pub fn display(&self, relative: &str) -> String {
        self.location.display(&self.path(relative))
    }

    fn write_err<E: std::error::Error + Send + Sync + 'static>(&self, relative: &str) -> impl Fn(E) -> SinkError + '_ {
        let url = self.display(relative);
        move |e| SinkError::Write { url: url.clone(), source: Box::new(e) }
    }

    fn write_error(&self, relative: &str, e: impl std::error::Error + Send + Sync + 'static) -> SinkError {
        SinkError::Write { url: self.display(relative), source: Box::new(e) }
    }

    /// Reads a small JSON object, `None` when it does not exist.
    async fn read_json<T: serde::de::DeserializeOwned>(&self, relative: &str) -> Result<Option<T>, SinkError> {
        let read_err = |e: Box<dyn std::error::Error + Send + Sync>| SinkError::Read { url: self.display(relative), source: e };
        let bytes = match self.store().get(&self.path(relative)).await {
            Ok(r) => r.bytes().await.map_err(|e| read_err(e.into()))?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(read_err(e.into())),
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|source| SinkError::Damaged { url: self.display(relative), source: source.into() })
    }

    /// Writes a small JSON object create-once. `Ok(false)` when it already exists.
    async fn create_json<T: Serialize>(&self, relative: &str, value: &T) -> Result<bool, SinkError> {
        let payload = PutPayload::from(serde_json::to_vec_pretty(value).expect("plain data serialises"));
        let mut delay = Duration::from_millis(200);
        let mut tries = 0;
        loop {
            tries += 1;
            match self.store().put_opts(&self.path(relative), payload.clone(), create()).await {
                Ok(_) => return Ok(true),
                Err(object_store::Error::AlreadyExists { .. }) => return Ok(false),
                Err(e) if tries >= COMMIT_TRIES => return Err(self.write_err(relative)(e)),
                Err(e) => {
                    tracing::warn!(file = %self.display(relative), error = %e, "create-once put failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
    }

    pub async fn read_plan(&self) -> Result<Option<Plan>, SinkError> {
        self.read_json(PLAN_FILE).await
    }

    /// Writes `plan` unless a plan is there already; returns the plan in force (the stored one if any), which the
    /// caller checks against its own fingerprint.
    pub async fn create_plan(&self, plan: &Plan) -> Result<Plan, SinkError> {
        if self.create_json(PLAN_FILE, plan).await? {
            return Ok(plan.clone());
        }
        self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })
    }

    /// Refuses a plan made by a different job.
    pub fn check_same_job(&self, stored: &Plan, ours: &crate::plan::Fingerprint) -> Result<(), SinkError> {
        let differences = stored.fingerprint.differences(ours);
        if differences.is_empty() {
            Ok(())
        } else {
            Err(SinkError::DifferentJob { url: self.url().into(), differences: differences.join("; ") })
        }
    }

    pub async fn is_complete(&self) -> Result<bool, SinkError> {
        match self.store().head(&self.path(SUCCESS_FILE)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(SinkError::Read { url: self.display(SUCCESS_FILE), source: e.into() }),
        }
    }

    fn marker_path(unit: &Unit) -> String {
        format!("{COMMITS_DIR}/shard={}/u{:06}.json", unit.shard, unit.id)
    }

    pub async fn is_committed(&self, unit: &Unit) -> Result<bool, SinkError> {
        let relative = Output::marker_path(unit);
        match self.store().head(&self.path(&relative)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(SinkError::Read { url: self.display(&relative), source: e.into() }),
        }
    }

    /// The ids of the committed units, from the markers' names alone (one listing, no reads).
    pub async fn committed_units(&self) -> Result<std::collections::BTreeSet<u32>, SinkError> {
        let dir = self.path(COMMITS_DIR);
        let read_err = |e: object_store::Error| SinkError::Read { url: self.display(COMMITS_DIR), source: e.into() };
        let listed: Vec<_> = self.store().list(Some(&dir)).try_collect().await.map_err(read_err)?;
        Ok(listed
            .iter()
            .filter_map(|m| m.location.filename()?.strip_prefix('u')?.strip_suffix(".json")?.parse().ok())
            .collect())
    }

    /// Every file under `data/` and `metrics/`.
    pub(super) async fn unit_files(&self) -> Result<std::collections::HashSet<Path>, SinkError> {
        let mut files = std::collections::HashSet::new();
        for dir in [DATA_DIR, METRICS_DIR] {
            let read_err = |e: object_store::Error| SinkError::Read { url: self.display(dir), source: e.into() };
            let listed: Vec<_> = self.store().list(Some(&self.path(dir))).try_collect().await.map_err(read_err)?;
            files.extend(listed.into_iter().map(|meta| meta.location));
        }
        Ok(files)
    }

    /// The first file a marker names that is not in the store. A file missing from the listing `files` is looked
    /// up on its own before it counts as missing: a listing may be stale (some stores and proxies list eventually),
    /// and a committed unit is not given up on the word of a listing.
    pub(super) async fn missing_file<'m>(&self, marker: &'m Marker, files: &std::collections::HashSet<Path>) -> Result<Option<&'m String>, SinkError> {
        for file in [&marker.results, &marker.metrics] {
            if files.contains(&self.path(file)) {
                continue;
            }
            match self.store().head(&self.path(file)).await {
                Ok(_) => tracing::debug!(file = %self.display(file), "a committed file missing from a listing is there (a stale listing)"),
                Err(object_store::Error::NotFound { .. }) => return Ok(Some(file)),
                Err(e) => return Err(SinkError::Read { url: self.display(file), source: e.into() }),
            }
        }
        Ok(None)
    }

    /// The units committed with their files: a marker naming a file that is gone (deleted since its commit) does
    /// not commit its unit. Such a marker is removed, with what is left of the unit's files, and logged, so that the
    /// unit is computed and committed again. (The files are listed after the markers: a unit's files are written
    /// before its marker, so every marker listed has its files listed, unless they were deleted.)
    pub async fn verified_committed_units(&self) -> Result<std::collections::BTreeSet<u32>, SinkError> {
        let markers = self.markers().await?;
        let files = self.unit_files().await?;
        let mut committed = std::collections::BTreeSet::new();
        for (unit, marker) in markers {
            let Some(missing) = self.missing_file(&marker, &files).await? else {
                committed.insert(unit);
                continue;
            };
            tracing::warn!(unit, missing = %self.display(missing), "a committed unit's file is missing: the unit is not committed, and runs again");
            let marker_path = marker.path();
            for file in [&marker.results, &marker.metrics, &marker_path] {
                match self.store().delete(&self.path(file)).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(SinkError::Write { url: self.display(file), source: e.into() }),
                }
            }
        }
        Ok(committed)
    }

    /// Whether `_SUCCESS` is there and every file its manifest names too. When a file is gone, `_SUCCESS` and the
    /// manifest no longer describe the output: both are removed (logged), so that a run recomputes what is missing
    /// and finalizes again.
    pub async fn is_complete_and_whole(&self) -> Result<bool, SinkError> {
        if !self.is_complete().await? {
            return Ok(false);
        }
        let Some(manifest) = self.read_manifest().await? else { return Ok(true) };
        let files = self.unit_files().await?;
        let mut first_missing = None;
        for marker in &manifest.units {
            if let Some(file) = self.missing_file(marker, &files).await? {
                first_missing = Some(file);
                break;
            }
        }
        let Some(missing) = first_missing else { return Ok(true) };
        tracing::warn!(missing = %self.display(missing), "a file the manifest names is missing: the output is no longer complete");
        for file in [SUCCESS_FILE, MANIFEST_FILE] {
            match self.store().delete(&self.path(file)).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(SinkError::Write { url: self.display(file), source: e.into() }),
            }
        }
        Ok(false)
    }

    /// Every commit marker, by unit (read 16 at a time: a resume reads them all).
    pub async fn markers(&self) -> Result<BTreeMap<u32, Marker>, SinkError> {
        use futures::StreamExt;
        let dir = self.path(COMMITS_DIR);
        let read_err = |e: object_store::Error| SinkError::Read { url: self.display(COMMITS_DIR), source: e.into() };
        let listed: Vec<_> = self.store().list(Some(&dir)).try_collect().await.map_err(read_err)?;
        let relatives = listed.iter().filter(|meta| meta.location.filename().unwrap_or_default().ends_with(".json")).filter_map(|meta| {
            meta.location.prefix_match(&self.location.path).map(|p| p.map(|s| s.as_ref().to_string()).collect::<Vec<_>>().join("/"))
        });
        let read: Vec<Option<Marker>> = futures::stream::iter(relatives)
            .map(|relative| async move {
                let marker = self.read_json::<Marker>(&relative).await?;
                if let Some(m) = &marker {
                    m.check(&relative).map_err(|e| SinkError::Damaged { url: self.display(&relative), source: e.into() })?;
                }
                Ok::<_, SinkError>(marker)
            })
            .buffer_unordered(16)
            .try_collect()
            .await?;
        Ok(read.into_iter().flatten().map(|marker| (marker.unit, marker)).collect())
    }

    /// Uploads a complete unit's results (in input order) and metrics under attempt-unique names, then commits it
    /// with a create-once marker. When another attempt committed the unit first, deletes this attempt's files.
    pub async fn commit_unit(
        &self,
        unit: &Unit,
        run: &RunMetadata,
        outcomes: &[Outcome],
        metrics: &JobMetrics,
    ) -> Result<Commit, SinkError> {
        let stem = format!("shard={}/u{:06}-a{}.parquet", unit.shard, unit.id, run.attempt);
        let results = format!("{DATA_DIR}/{stem}");
        let metrics_file = format!("{METRICS_DIR}/{stem}");
        self.write_results(&results, run, outcomes).await?;
        self.write_metrics(&metrics_file, unit.id, metrics, run).await?;
        let marker = Marker {
            unit: unit.id,
            shard: unit.shard,
            attempt: run.attempt.clone(),
            results: results.clone(),
            metrics: metrics_file.clone(),
            rows: metrics.rows,
            succeeded_rows: metrics.succeeded_rows,
            errored_rows: metrics.errored_rows,
            prompt_tokens: metrics.prompt_tokens,
            completion_tokens: metrics.completion_tokens,
        };
        let relative = Output::marker_path(unit);
        if self.create_json(&relative, &marker).await? {
            return Ok(Commit::Won);
        }
        // The marker exists. If it names this attempt, an earlier try whose response was lost did succeed.
        let stored: Option<Marker> = self.read_json(&relative).await?;
        if stored.as_ref().is_some_and(|m| m.attempt == run.attempt) {
            return Ok(Commit::Won);
        }
        for file in [&results, &metrics_file] {
            if let Err(e) = self.store().delete(&self.path(file)).await {
                tracing::warn!(file = %self.display(file), error = %e, "cannot delete a losing attempt's file; finalize removes it");
            }
        }
        Ok(Commit::Lost)
    }

    async fn write_results(&self, relative: &str, run: &RunMetadata, outcomes: &[Outcome]) -> Result<(), SinkError> {
        let schema = with_metadata(
            match run.layout {
                ResultsLayout::Generate => results_schema(),
                ResultsLayout::Embed { dimensions } => embeddings_schema(dimensions),
            },
            run,
        );
        let upload = BufWriter::new(self.store().clone(), self.path(relative));
        let mut writer = AsyncArrowWriter::try_new(upload, schema.clone(), Some(properties(run))).map_err(|e| self.write_error(relative, e))?;
        for chunk in outcomes.chunks(ROWS_PER_BATCH) {
            let batch = match run.layout {
                ResultsLayout::Generate => batches::results_batch(chunk, schema.clone()),
                ResultsLayout::Embed { dimensions } => batches::embeddings_batch(chunk, schema.clone(), dimensions),
            }
            .map_err(|e| SinkError::Encode { url: self.display(relative), source: e.into() })?;
            if let Err(e) = writer.write(&batch).await {
                // Abort a started multipart upload instead of leaving its parts behind.
                let _ = writer.into_inner().abort().await;
                return Err(self.write_error(relative, e));
            }
        }
        writer.close().await.map_err(|e| self.write_error(relative, e))?;
        Ok(())
    }

    async fn write_metrics(&self, relative: &str, unit: u32, metrics: &JobMetrics, run: &RunMetadata) -> Result<(), SinkError> {
        let schema = with_metadata(metrics_schema(), run);
        let row = MetricsRow { unit, attempt: &run.attempt, metrics };
        let batch = batches::metrics_batch(&row, schema.clone()).map_err(|e| SinkError::Encode { url: self.display(relative), source: e.into() })?;
        let upload = BufWriter::new(self.store().clone(), self.path(relative));
        let mut writer = AsyncArrowWriter::try_new(upload, schema, Some(properties(run))).map_err(|e| self.write_error(relative, e))?;
        writer.write(&batch).await.map_err(|e| self.write_error(relative, e))?;
        writer.close().await.map_err(|e| self.write_error(relative, e))?;
        Ok(())
    }

    /// Checks that every unit of the plan is committed, removes files no marker names (a killed attempt's, a
    /// losing attempt's), then writes `_manifest.json` and `_SUCCESS`, both create-once. Safe to run repeatedly
    /// and from several processes at once.
    pub async fn finalize(&self) -> Result<Finalized, SinkError> {
        let plan = self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })?;
        // Complete only while every file the manifest names is there: otherwise `_SUCCESS` goes, and the markers
        // below say which unit a run must compute again.
        if self.is_complete_and_whole().await? {
            if let Some(manifest) = self.read_json::<Manifest>(MANIFEST_FILE).await? {
                return Ok(Finalized::AlreadyComplete(manifest));
            }
        }
        let markers = self.markers().await?;
        let missing: Vec<&Unit> = plan.units.iter().filter(|u| !markers.contains_key(&u.id)).collect();
        if !missing.is_empty() {
            let first = missing.iter().take(5).map(|u| format!("u{:06}", u.id)).collect::<Vec<_>>().join(", ");
            let shards: std::collections::BTreeSet<u32> = missing.iter().map(|u| u.shard).collect();
            let shards = if plan.shards == 1 {
                "the job's one shard".to_string()
            } else {
                let list = shards.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ");
                format!("shard(s) {list} of {}", plan.shards)
            };
            return Err(SinkError::Incomplete { url: self.url().into(), missing: missing.len(), total: plan.units.len(), shards, first });
        }
        let units: Vec<Marker> = plan.units.iter().map(|u| markers[&u.id].clone()).collect();
        for (unit, marker) in plan.units.iter().zip(&units) {
            if (marker.shard, marker.rows) != (unit.shard, unit.rows as u64) {
                let why = format!("it commits {} rows of shard {}; the plan's unit has {} rows of shard {}", marker.rows, marker.shard, unit.rows, unit.shard);
                return Err(SinkError::Damaged { url: self.display(&marker.path()), source: why.into() });
            }
        }
        // A manifest never names a file that is not there.
        let files = self.unit_files().await?;
        for marker in &units {
            if let Some(missing) = self.missing_file(marker, &files).await? {
                return Err(SinkError::MissingFile { url: self.url().into(), unit: marker.unit, file: missing.clone() });
            }
        }
        let rows: u64 = units.iter().map(|m| m.rows).sum();
        if rows != plan.total_rows() {
            return Err(SinkError::Write {
                url: self.display(COMMITS_DIR),
                source: format!("the commits hold {rows} rows but the plan has {} (a bug)", plan.total_rows()).into(),
            });
        }
        self.remove_orphans(&units, files).await?;
        let report = self.write_report().await;
        let manifest = Manifest {
            nightshift_version: env!("CARGO_PKG_VERSION").into(),
            fingerprint: plan.fingerprint.digest(),
            rows,
            succeeded_rows: units.iter().map(|m| m.succeeded_rows).sum(),
            errored_rows: units.iter().map(|m| m.errored_rows).sum(),
            prompt_tokens: units.iter().map(|m| m.prompt_tokens).sum(),
            completion_tokens: units.iter().map(|m| m.completion_tokens).sum(),
            results: units.iter().map(|m| m.results.clone()).collect(),
            metrics: units.iter().map(|m| m.metrics.clone()).collect(),
            report,
            units,
        };
        if !self.create_json(MANIFEST_FILE, &manifest).await? {
            // Another finalize got there first; it must have seen the same commits, since markers never change.
            let stored: Option<Manifest> = self.read_json(MANIFEST_FILE).await?;
            if stored.as_ref().map(|m| (&m.results, m.rows)) != Some((&manifest.results, manifest.rows)) {
                return Err(SinkError::Write {
                    url: self.display(MANIFEST_FILE),
                    source: "an existing manifest names other files than the commit markers".into(),
                });
            }
        }
        let summary = serde_json::json!({
            "nightshift_version": env!("CARGO_PKG_VERSION"),
            "rows": manifest.rows,
            "succeeded_rows": manifest.succeeded_rows,
            "errored_rows": manifest.errored_rows,
            "manifest": MANIFEST_FILE,
        });
        self.create_json(SUCCESS_FILE, &summary).await?;
        Ok(Finalized::Done(manifest))
    }

    /// Writes `_report.html` for an output being finalized; `None`, logged, when it cannot be made: the report
    /// describes the output, and the output is complete without it.
    async fn write_report(&self) -> Option<String> {
        let made = async {
            let html = crate::report::render(&self.report_data(true).await?);
            let url = self.display(REPORT_FILE);
            self.store().put(&self.path(REPORT_FILE), PutPayload::from(html)).await.map_err(|e| SinkError::Write { url, source: e.into() })
        };
        match made.await {
            Ok(_) => Some(REPORT_FILE.to_string()),
            Err(e) => {
                tracing::warn!(error = %crate::redact::report(&e), "cannot write the job report; the output is finalized without it");
                None
            }
        }
    }

    /// Deletes the listed unit files (`files`, from [`Output::unit_files`]) that no marker names.
    async fn remove_orphans(&self, units: &[Marker], files: std::collections::HashSet<Path>) -> Result<(), SinkError> {
        let keep: std::collections::HashSet<Path> =
            units.iter().flat_map(|m| [self.path(&m.results), self.path(&m.metrics)]).collect();
        for location in files.into_iter().filter(|f| !keep.contains(f)) {
            tracing::info!(file = %self.location.display(&location), "removing an uncommitted attempt's file");
            match self.store().delete(&location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(SinkError::Write { url: self.location.display(&location), source: e.into() }),
            }
        }
        Ok(())
    }

    pub async fn read_manifest(&self) -> Result<Option<Manifest>, SinkError> {
        self.read_json(MANIFEST_FILE).await
    }
}
