//! Output: per-unit result and metrics files, commit markers, and the finalize step.
//!
//! Layout under the output URL (`../shared/DESIGN.md`, section 5):
//! ```text
//! OUT/_plan.json                                  create-once: input snapshot, units, job fingerprint
//! OUT/data/shard=S/u<unit>-a<attempt>.parquet     a unit's result rows, in input order (schemas/results.json)
//! OUT/metrics/shard=S/u<unit>-a<attempt>.parquet  a unit's figures, one row (schemas/metrics.json)
//! OUT/_commits/shard=S/u<unit>.json               create-once marker: the unit is committed, by these two files
//! OUT/_manifest.json                              create-once, by finalize: every committed file, and totals
//! OUT/_SUCCESS                                    create-once, written last
//! ```
//! Data file names are unique per attempt and never overwritten, so two attempts at one unit (a zombie, a
//! requeued pod, two processes started by mistake) cannot replace each other's bytes; the create-once marker
//! decides which attempt's files count, and the loser deletes its own. A unit's rows are buffered until the unit
//! is complete and then uploaded as whole files, so a killed process leaves at most an orphan file that no
//! marker names, which finalize removes. Readers use `_manifest.json`. `S` is the unit's shard in the plan: a unit
//! has one shard for the life of the output, so its marker has one name.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, Float64Builder, RecordBatch, StringBuilder, StructArray, UInt32Builder};
use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use futures::TryStreamExt;
use object_store::buffered::BufWriter;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use parquet::arrow::AsyncArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use crate::outcome::Completion;
use crate::metrics::JobMetrics;
use crate::plan::{Plan, Unit};
use crate::row::{FinishReason, RowError};
use crate::source::{store, Location, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("output `{url}` is not writable")]
    NotWritable { url: String, #[source] source: object_store::Error },
    #[error("cannot write `{url}`")]
    Write { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error("cannot read `{url}`")]
    Read { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error(
        "output `{url}` belongs to a different job ({differences}); resuming into it would mix results, so \
         write to a new output, or remove this one to start over"
    )]
    DifferentJob { url: String, differences: String },
    #[error("output `{url}` has no `_plan.json`: it was not written by a run of this nightshift")]
    NoPlan { url: String },
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
}

pub const PLAN_FILE: &str = "_plan.json";
pub const MANIFEST_FILE: &str = "_manifest.json";
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

/// What `nightshift status` shows: the output's progress, per shard.
#[derive(Clone, Debug, Serialize)]
pub struct OutputStatus {
    pub url: String,
    /// `_SUCCESS` is written.
    pub complete: bool,
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

/// A metrics file's `job_s`: the attempt's age when it committed the unit.
fn metrics_job_s(bytes: bytes::Bytes) -> Result<f64, Box<dyn std::error::Error + Send + Sync>> {
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

fn error_fields() -> Fields {
    Fields::from(vec![Field::new("code", DataType::Utf8, false), Field::new("message", DataType::Utf8, false)])
}

/// The Arrow schema of the result files, described field by field in `schemas/results.json`.
pub fn results_schema() -> Schema {
    Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("status", DataType::Utf8, false),
        Field::new("error", DataType::Struct(error_fields()), true),
        Field::new("text", DataType::Utf8, true),
        Field::new("finish_reason", DataType::Utf8, false),
        Field::new("prompt_tokens", DataType::UInt32, true),
        Field::new("completion_tokens", DataType::UInt32, false),
        Field::new("queue_s", DataType::Float64, true),
        Field::new("ttft_s", DataType::Float64, true),
        Field::new("e2e_s", DataType::Float64, true),
        Field::new("tpot_s", DataType::Float64, true),
        Field::new("logprobs", logprobs_type(), true),
        Field::new("cumulative_logprob", DataType::Float64, true),
        Field::new("choices", DataType::List(Arc::new(Field::new("item", DataType::Struct(choice_fields()), false))), true),
        Field::new("params", DataType::Struct(params_fields()), true),
    ])
}

/// `List<Struct<token_id, token, logprob, top: List<Struct<token_id, token, logprob>>>>`: per output token.
fn logprobs_type() -> DataType {
    let alternative = Fields::from(vec![
        Field::new("token_id", DataType::UInt32, false),
        Field::new("token", DataType::Utf8, false),
        Field::new("logprob", DataType::Float32, false),
    ]);
    let mut token: Vec<Field> = alternative.iter().map(|f| f.as_ref().clone()).collect();
    token.push(Field::new("top", DataType::List(Arc::new(Field::new("item", DataType::Struct(alternative), false))), false));
    DataType::List(Arc::new(Field::new("item", DataType::Struct(Fields::from(token)), false)))
}

fn choice_fields() -> Fields {
    Fields::from(vec![
        Field::new("index", DataType::UInt32, false),
        Field::new("text", DataType::Utf8, false),
        Field::new("finish_reason", DataType::Utf8, false),
        Field::new("completion_tokens", DataType::UInt32, false),
        Field::new("logprobs", logprobs_type(), true),
        Field::new("cumulative_logprob", DataType::Float64, true),
    ])
}

/// The effective generation parameters of a row, every one of them.
fn params_fields() -> Fields {
    let list = |item: DataType| DataType::List(Arc::new(Field::new("item", item, false)));
    Fields::from(vec![
        Field::new("max_new_tokens", DataType::UInt32, false),
        Field::new("min_new_tokens", DataType::UInt32, false),
        Field::new("temperature", DataType::Float32, false),
        Field::new("top_p", DataType::Float32, false),
        Field::new("top_k", DataType::UInt32, false),
        Field::new("min_p", DataType::Float32, false),
        Field::new("repetition_penalty", DataType::Float32, false),
        Field::new("presence_penalty", DataType::Float32, false),
        Field::new("frequency_penalty", DataType::Float32, false),
        Field::new("stop", list(DataType::Utf8), false),
        Field::new("stop_token_ids", list(DataType::UInt32), false),
        Field::new("include_stop_str_in_output", DataType::Boolean, false),
        Field::new("ignore_eos", DataType::Boolean, false),
        Field::new("seed", DataType::UInt64, false),
        Field::new("n", DataType::UInt32, false),
        Field::new("logprobs", DataType::UInt32, true),
        Field::new("json_schema", DataType::Utf8, true),
    ])
}

/// The nested columns of one row, as JSON for arrow's JSON decoder: choices, log-probabilities, parameters.
fn nested_json(c: Option<&Completion>) -> serde_json::Value {
    let Some(c) = c else { return serde_json::json!({}) };
    let first = &c.choices[0];
    let p = &c.params;
    serde_json::json!({
        "logprobs": first.logprobs,
        "cumulative_logprob": first.cumulative_logprob,
        "choices": (c.choices.len() > 1).then_some(&c.choices),
        "params": {
            "max_new_tokens": p.max_new_tokens, "min_new_tokens": p.min_new_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty, "stop": p.stop,
            "stop_token_ids": p.stop_token_ids, "include_stop_str_in_output": p.include_stop_str_in_output,
            "ignore_eos": p.ignore_eos, "seed": p.seed, "n": p.n, "logprobs": p.logprobs, "json_schema": p.json_schema,
        },
    })
}

/// The Arrow schema of an embedding job's result files, described field by field in `schemas/embeddings.json`.
pub fn embeddings_schema(dimensions: usize) -> Schema {
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("status", DataType::Utf8, false),
        Field::new("error", DataType::Struct(error_fields()), true),
        Field::new("embedding", DataType::FixedSizeList(item, dimensions as i32), true),
        Field::new("prompt_tokens", DataType::UInt32, true),
        Field::new("e2e_s", DataType::Float64, true),
    ])
}

/// The Arrow schema of the metrics files, described field by field in `schemas/metrics.json`.
pub fn metrics_schema() -> Schema {
    let u = |name: &str| Field::new(name, DataType::UInt64, false);
    let f = |name: &str| Field::new(name, DataType::Float64, false);
    let o = |name: &str| Field::new(name, DataType::Float64, true);
    Schema::new(vec![
        u("unit"),
        Field::new("attempt", DataType::Utf8, false),
        u("rows"),
        u("succeeded_rows"),
        u("errored_rows"),
        u("prompt_tokens"),
        u("completion_tokens"),
        f("job_s"),
        f("model_load_s"),
        f("generation_s"),
        f("requests_per_s"),
        f("total_tokens_per_s"),
        f("output_tokens_per_s"),
        o("ttft_p50_s"),
        o("ttft_p90_s"),
        o("ttft_p99_s"),
        o("e2e_p50_s"),
        o("e2e_p90_s"),
        o("e2e_p99_s"),
        o("tpot_p50_s"),
        o("tpot_p90_s"),
        u("engine_steps"),
        u("prefill_tokens"),
        u("decode_tokens"),
        u("max_running_seqs"),
        u("peak_kv_cache_bytes"),
        f("prefill_s"),
        f("decode_s"),
        o("packing_efficiency"),
        u("kv_cache_blocks"),
        o("kv_utilisation_peak"),
        o("kv_utilisation_mean"),
        u("preemptions"),
        u("recomputed_tokens"),
        u("weights_bytes"),
        u("peak_rss_bytes"),
    ])
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
        serde_json::from_slice(&bytes).map(Some).map_err(|e| read_err(e.into()))
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

    /// Every commit marker, by unit.
    pub async fn markers(&self) -> Result<BTreeMap<u32, Marker>, SinkError> {
        let dir = self.path(COMMITS_DIR);
        let read_err = |e: object_store::Error| SinkError::Read { url: self.display(COMMITS_DIR), source: e.into() };
        let listed: Vec<_> = self.store().list(Some(&dir)).try_collect().await.map_err(read_err)?;
        let mut markers = BTreeMap::new();
        for meta in listed {
            let name = meta.location.filename().unwrap_or_default();
            if !name.ends_with(".json") {
                continue;
            }
            let relative = meta.location.prefix_match(&self.location.path).map(|p| p.map(|s| s.as_ref().to_string()).collect::<Vec<_>>().join("/"));
            let Some(relative) = relative else { continue };
            if let Some(marker) = self.read_json::<Marker>(&relative).await? {
                markers.insert(marker.unit, marker);
            }
        }
        Ok(markers)
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
                ResultsLayout::Generate => results_batch(chunk, schema.clone()),
                ResultsLayout::Embed { dimensions } => embeddings_batch(chunk, schema.clone(), dimensions),
            }
            .map_err(|e| self.write_error(relative, e))?;
            if let Err(e) = writer.write(&batch).await {
                // Abort a started multipart upload instead of leaving its parts behind.
                let _ = writer.into_inner().abort().await;
                return Err(self.write_error(relative, e));
            }
        }
        writer.close().await.map_err(|e| self.write_error(relative, e))?;
        Ok(())
    }

    async fn write_metrics(&self, relative: &str, unit: u32, m: &JobMetrics, run: &RunMetadata) -> Result<(), SinkError> {
        let schema = with_metadata(metrics_schema(), run);
        let u = |v: u64| Arc::new(arrow::array::UInt64Array::from(vec![v])) as ArrayRef;
        let f = |v: f64| Arc::new(arrow::array::Float64Array::from(vec![v])) as ArrayRef;
        let o = |v: Option<f64>| Arc::new(arrow::array::Float64Array::from(vec![v])) as ArrayRef;
        let columns = vec![
            u(unit as u64),
            Arc::new(arrow::array::StringArray::from(vec![run.attempt.as_str()])) as ArrayRef,
            u(m.rows),
            u(m.succeeded_rows),
            u(m.errored_rows),
            u(m.prompt_tokens),
            u(m.completion_tokens),
            f(m.job_s),
            f(m.model_load_s),
            f(m.generation_s),
            f(m.requests_per_s),
            f(m.total_tokens_per_s),
            f(m.output_tokens_per_s),
            o(m.ttft_p50_s),
            o(m.ttft_p90_s),
            o(m.ttft_p99_s),
            o(m.e2e_p50_s),
            o(m.e2e_p90_s),
            o(m.e2e_p99_s),
            o(m.tpot_p50_s),
            o(m.tpot_p90_s),
            u(m.engine_steps),
            u(m.prefill_tokens),
            u(m.decode_tokens),
            u(m.max_running_seqs),
            u(m.peak_kv_cache_bytes),
            f(m.prefill_s),
            f(m.decode_s),
            o(m.packing_efficiency),
            u(m.kv_cache_blocks),
            o(m.kv_utilisation_peak),
            o(m.kv_utilisation_mean),
            u(m.preemptions),
            u(m.recomputed_tokens),
            u(m.weights_bytes),
            u(m.peak_rss_bytes),
        ];
        let batch = RecordBatch::try_new(schema.clone(), columns).map_err(|e| self.write_error(relative, e))?;
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
        if self.is_complete().await? {
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
        let rows: u64 = units.iter().map(|m| m.rows).sum();
        if rows != plan.total_rows() {
            return Err(SinkError::Write {
                url: self.display(COMMITS_DIR),
                source: format!("the commits hold {rows} rows but the plan has {} (a bug)", plan.total_rows()).into(),
            });
        }
        self.remove_orphans(&units).await?;
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

    /// Deletes files under `data/` and `metrics/` that no marker names.
    async fn remove_orphans(&self, units: &[Marker]) -> Result<(), SinkError> {
        let keep: std::collections::HashSet<Path> =
            units.iter().flat_map(|m| [self.path(&m.results), self.path(&m.metrics)]).collect();
        for dir in [DATA_DIR, METRICS_DIR] {
            let read_err = |e: object_store::Error| SinkError::Read { url: self.display(dir), source: e.into() };
            let listed: Vec<_> = self.store().list(Some(&self.path(dir))).try_collect().await.map_err(read_err)?;
            for meta in listed {
                if !keep.contains(&meta.location) {
                    tracing::info!(file = %self.location.display(&meta.location), "removing an uncommitted attempt's file");
                    match self.store().delete(&meta.location).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err(SinkError::Write { url: self.location.display(&meta.location), source: e.into() }),
                    }
                }
            }
        }
        Ok(())
    }

    /// Progress per shard, from the plan, the commit markers and the committed units' metrics files (nothing is
    /// written). Throughput is rows and tokens over busy time: each attempt's time from its start to its last
    /// commit, shared among its units by commit order (each unit gets the time since the attempt's previous
    /// commit), so start-up and model loading count against the first unit.
    pub async fn status(&self) -> Result<OutputStatus, SinkError> {
        use futures::StreamExt;
        let plan = self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })?;
        let complete = self.is_complete().await?;
        let markers = self.markers().await?;
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
            fingerprint: plan.fingerprint.digest(),
            units: plan.units.len(),
            committed_units: markers.len(),
            rows: plan.total_rows(),
            committed_rows: markers.values().map(|m| m.rows).sum(),
            shards,
        })
    }

    async fn read_bytes(&self, relative: &str) -> Result<bytes::Bytes, SinkError> {
        let read_err = |e: object_store::Error| SinkError::Read { url: self.display(relative), source: e.into() };
        self.store().get(&self.path(relative)).await.map_err(read_err)?.bytes().await.map_err(read_err)
    }

    pub async fn read_manifest(&self) -> Result<Option<Manifest>, SinkError> {
        self.read_json(MANIFEST_FILE).await
    }
}

/// The `id`, `status` and `error` columns every results schema starts with.
struct RowColumns {
    id: StringBuilder,
    status: StringBuilder,
    code: StringBuilder,
    message: StringBuilder,
    error_valid: Vec<bool>,
}

impl RowColumns {
    fn with_capacity(n: usize) -> Self {
        RowColumns {
            id: StringBuilder::with_capacity(n, n * 16),
            status: StringBuilder::with_capacity(n, n * 9),
            code: StringBuilder::new(),
            message: StringBuilder::new(),
            error_valid: Vec::with_capacity(n),
        }
    }

    fn succeeded(&mut self, id: &str) {
        self.id.append_value(id);
        self.status.append_value("succeeded");
        self.code.append_value("");
        self.message.append_value("");
        self.error_valid.push(false);
    }

    fn errored(&mut self, id: &str, error: &RowError) {
        self.id.append_value(id);
        self.status.append_value("errored");
        self.code.append_value(error.code.as_str());
        self.message.append_value(&error.message);
        self.error_valid.push(true);
    }

    /// The three columns, followed by `rest`.
    fn finish(mut self, rest: Vec<ArrayRef>) -> Result<Vec<ArrayRef>, arrow::error::ArrowError> {
        let error = StructArray::try_new(
            error_fields(),
            vec![Arc::new(self.code.finish()) as ArrayRef, Arc::new(self.message.finish())],
            Some(self.error_valid.into()),
        )?;
        let mut columns: Vec<ArrayRef> = vec![Arc::new(self.id.finish()), Arc::new(self.status.finish()), Arc::new(error)];
        columns.extend(rest);
        Ok(columns)
    }
}

fn wrong_kind(id: &str, what: &str) -> arrow::error::ArrowError {
    arrow::error::ArrowError::InvalidArgumentError(format!("row {id} is {what} (a bug)"))
}

fn embeddings_batch(rows: &[Outcome], schema: SchemaRef, dimensions: usize) -> Result<RecordBatch, arrow::error::ArrowError> {
    use arrow::array::{FixedSizeListBuilder, Float32Builder};
    let n = rows.len();
    let mut base = RowColumns::with_capacity(n);
    let item = Field::new("item", DataType::Float32, false);
    let mut vectors = FixedSizeListBuilder::with_capacity(Float32Builder::with_capacity(n * dimensions), dimensions as i32, n)
        .with_field(Arc::new(item));
    let mut tokens = UInt32Builder::with_capacity(n);
    let mut e2e = Float64Builder::with_capacity(n);
    for row in rows {
        match row {
            Outcome::Embedded(e) => {
                if e.vector.len() != dimensions {
                    return Err(wrong_kind(&e.id, &format!("a vector of {} dimensions, not {dimensions},", e.vector.len())));
                }
                base.succeeded(&e.id);
                vectors.values().append_slice(&e.vector);
                vectors.append(true);
                tokens.append_value(e.prompt_tokens);
                e2e.append_value(e.e2e_s);
            }
            Outcome::Failed(crate::outcome::RowFailure { id, error, .. }) => {
                base.errored(id, error);
                vectors.values().append_slice(&vec![0.0; dimensions]);
                vectors.append(false);
                tokens.append_null();
                e2e.append_null();
            }
            Outcome::Completed(c) => return Err(wrong_kind(&c.id, "a completion in an embedding job")),
        }
    }
    let columns = base.finish(vec![Arc::new(vectors.finish()), Arc::new(tokens.finish()), Arc::new(e2e.finish())])?;
    RecordBatch::try_new(schema, columns)
}

fn results_batch(rows: &[Outcome], schema: SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
    let n = rows.len();
    let mut base = RowColumns::with_capacity(n);
    let mut text = StringBuilder::new();
    let mut finish = StringBuilder::with_capacity(n, n * 6);
    let mut prompt_tokens = UInt32Builder::with_capacity(n);
    let mut completion_tokens = UInt32Builder::with_capacity(n);
    let mut queue = Float64Builder::with_capacity(n);
    let mut ttft = Float64Builder::with_capacity(n);
    let mut e2e = Float64Builder::with_capacity(n);
    let mut tpot = Float64Builder::with_capacity(n);
    for row in rows {
        match row {
            Outcome::Completed(c) => {
                base.succeeded(&c.id);
                let first = &c.choices[0];
                // A scoring row generated no text.
                text.append_option((first.finish_reason != FinishReason::Scored).then_some(&first.text));
                finish.append_value(first.finish_reason.as_str());
                prompt_tokens.append_value(c.prompt_tokens);
                completion_tokens.append_value(c.completion_tokens());
                queue.append_value(c.queue_s);
                ttft.append_value(c.ttft_s);
                e2e.append_value(c.e2e_s);
                tpot.append_option(c.tpot_s);
            }
            Outcome::Failed(crate::outcome::RowFailure { id, error, .. }) => {
                base.errored(id, error);
                text.append_null();
                finish.append_value(FinishReason::Error.as_str());
                prompt_tokens.append_null();
                completion_tokens.append_value(0);
                queue.append_null();
                ttft.append_null();
                e2e.append_null();
                tpot.append_null();
            }
            Outcome::Embedded(e) => return Err(wrong_kind(&e.id, "an embedding in a generation job")),
        }
    }
    let columns = base.finish(vec![
        Arc::new(text.finish()),
        Arc::new(finish.finish()),
        Arc::new(prompt_tokens.finish()),
        Arc::new(completion_tokens.finish()),
        Arc::new(queue.finish()),
        Arc::new(ttft.finish()),
        Arc::new(e2e.finish()),
        Arc::new(tpot.finish()),
    ])?;
    // The nested columns through arrow's JSON decoder, which builds lists of structs from serde values.
    let nested_fields: Vec<_> = schema.fields().iter().skip(columns.len()).cloned().collect();
    let nested_schema = Arc::new(Schema::new(nested_fields));
    let mut decoder = arrow::json::ReaderBuilder::new(nested_schema).with_batch_size(n.max(1)).build_decoder()?;
    let values: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| nested_json(match row {
            Outcome::Completed(c) => Some(c),
            _ => None,
        }))
        .collect();
    decoder.serialize(&values)?;
    let mut columns = columns;
    match decoder.flush()? {
        Some(nested) => columns.extend(nested.columns().iter().cloned()),
        None => columns.extend(schema.fields().iter().skip(columns.len()).map(|f| arrow::array::new_empty_array(f.data_type()))),
    }
    RecordBatch::try_new(schema, columns)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn type_name(t: &DataType) -> String {
        match t {
            DataType::Struct(fields) => format!(
                "Struct<{}>",
                fields.iter().map(|f| format!("{}: {}", f.name(), type_name(f.data_type()))).collect::<Vec<_>>().join(", ")
            ),
            DataType::FixedSizeList(item, _) => format!("FixedSizeList<{}, dimensions>", type_name(item.data_type())),
            DataType::List(item) => format!("List<{}>", type_name(item.data_type())),
            other => format!("{other:?}"),
        }
    }

    /// Fails when the code's schema and the documented one in `schemas/` disagree in names, types or nullability.
    fn check(schema: &Schema, file: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas").join(file);
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let documented: Vec<(String, String, bool)> = doc["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                assert!(!f["description"].as_str().unwrap_or_default().is_empty(), "{file}: {f} has no description");
                (f["name"].as_str().unwrap().into(), f["type"].as_str().unwrap().into(), f["nullable"].as_bool().unwrap())
            })
            .collect();
        let actual: Vec<(String, String, bool)> =
            schema.fields().iter().map(|f| (f.name().clone(), type_name(f.data_type()), f.is_nullable())).collect();
        assert_eq!(actual, documented, "schemas/{file} and the code disagree");
    }

    #[test]
    fn results_schema_matches_schemas_dir() {
        check(&results_schema(), "results.json");
    }

    #[test]
    fn embeddings_schema_matches_schemas_dir() {
        check(&embeddings_schema(384), "embeddings.json");
    }

    #[test]
    fn metrics_schema_matches_schemas_dir() {
        check(&metrics_schema(), "metrics.json");
    }
}
