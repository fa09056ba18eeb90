//! Output: the results and metrics Parquet files and the completion marker.
//!
//! Layout under the output URL:
//! ```text
//! OUT/results.parquet   one row per input row (schemas/results.json)
//! OUT/metrics.parquet   one row of job figures (schemas/metrics.json)
//! OUT/_SUCCESS          written last, create-once: its presence means the two files above are complete
//! ```
//! Files are uploaded as a whole (a single PUT, or a multipart upload completed only at the end; locally a staging
//! file renamed at the end), so a killed job never leaves a file that looks complete. Readers wait for `_SUCCESS`.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Builder, RecordBatch, StringBuilder, StructArray, UInt32Builder};
use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use object_store::buffered::BufWriter;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use parquet::arrow::AsyncArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::engine::Completion;
use crate::metrics::JobMetrics;
use crate::row::{FinishReason, RowError};
use crate::source::{store, Location, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("output `{url}` already holds a completed job (`_SUCCESS` exists); choose another output or remove it")]
    AlreadyComplete { url: String },
    #[error("output `{url}` is not writable")]
    NotWritable { url: String, #[source] source: object_store::Error },
    #[error("cannot write `{url}`")]
    Write { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
}

pub const RESULTS_FILE: &str = "results.parquet";
pub const METRICS_FILE: &str = "metrics.parquet";
pub const SUCCESS_FILE: &str = "_SUCCESS";

/// Rows buffered before they are encoded; bounds the writer's memory along with the row group size.
const ROWS_PER_BATCH: usize = 512;
const ROWS_PER_ROW_GROUP: usize = 8192;

/// Facts about the run stored in each file's key/value metadata.
#[derive(Clone, Debug)]
pub struct RunMetadata {
    pub model_sha256: String,
    pub model: String,
    pub job: String,
}

impl RunMetadata {
    fn pairs(&self) -> Vec<(String, String)> {
        vec![
            ("nightshift.version".into(), env!("CARGO_PKG_VERSION").into()),
            ("nightshift.model_sha256".into(), self.model_sha256.clone()),
            ("nightshift.model".into(), self.model.clone()),
            ("nightshift.job".into(), self.job.clone()),
        ]
    }
}

/// One output row: a completion, or a row that failed before or in the engine.
#[derive(Clone, Debug)]
pub enum Outcome {
    Completed(Completion),
    Failed { id: String, error: RowError },
}

fn error_fields() -> Fields {
    Fields::from(vec![Field::new("code", DataType::Utf8, false), Field::new("message", DataType::Utf8, false)])
}

/// The Arrow schema of `results.parquet`, described field by field in `schemas/results.json`.
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
    ])
}

/// The Arrow schema of `metrics.parquet`, described field by field in `schemas/metrics.json`.
pub fn metrics_schema() -> Schema {
    let u = |name: &str| Field::new(name, DataType::UInt64, false);
    let f = |name: &str| Field::new(name, DataType::Float64, false);
    let o = |name: &str| Field::new(name, DataType::Float64, true);
    Schema::new(vec![
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

/// An output location, checked before any work starts.
pub struct Output {
    location: Location,
}

impl Output {
    /// Resolves the output URL, refuses one that already holds a completed job, and proves it is writable with a
    /// small probe object, so a bad location fails in seconds rather than after hours of generation.
    pub async fn open(url: &str) -> Result<Output, SinkError> {
        let location = store::resolve(url)?;
        let output = Output { location };
        match output.location.store.head(&output.path(SUCCESS_FILE)).await {
            Ok(_) => return Err(SinkError::AlreadyComplete { url: url.into() }),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => return Err(SinkError::NotWritable { url: url.into(), source }),
        }
        let probe = output.path(&format!("_nightshift_probe_{}", std::process::id()));
        let not_writable = |source| SinkError::NotWritable { url: url.into(), source };
        output.location.store.put(&probe, PutPayload::from_static(b"probe")).await.map_err(not_writable)?;
        output.location.store.delete(&probe).await.map_err(not_writable)?;
        Ok(output)
    }

    pub fn url(&self) -> &str {
        &self.location.url
    }

    fn path(&self, name: &str) -> Path {
        self.location.path.clone().join(name)
    }

    /// The user-facing URL of a file under the output.
    pub fn display(&self, name: &str) -> String {
        self.location.display(&self.path(name))
    }

    fn write_err<E: std::error::Error + Send + Sync + 'static>(&self, name: &str) -> impl Fn(E) -> SinkError + '_ {
        let url = self.display(name);
        move |e| SinkError::Write { url: url.clone(), source: Box::new(e) }
    }

    pub fn results_writer(&self, run: &RunMetadata) -> Result<ResultsWriter, SinkError> {
        let upload = BufWriter::new(self.location.store.clone(), self.path(RESULTS_FILE));
        let schema = with_metadata(results_schema(), run);
        let writer = AsyncArrowWriter::try_new(upload, schema.clone(), Some(properties(run))).map_err(self.write_err(RESULTS_FILE))?;
        Ok(ResultsWriter { writer, schema, pending: Vec::with_capacity(ROWS_PER_BATCH), url: self.display(RESULTS_FILE), rows: 0 })
    }

    pub async fn write_metrics(&self, m: &JobMetrics, run: &RunMetadata) -> Result<(), SinkError> {
        let schema = with_metadata(metrics_schema(), run);
        let u = |v: u64| Arc::new(arrow::array::UInt64Array::from(vec![v])) as ArrayRef;
        let f = |v: f64| Arc::new(arrow::array::Float64Array::from(vec![v])) as ArrayRef;
        let o = |v: Option<f64>| Arc::new(arrow::array::Float64Array::from(vec![v])) as ArrayRef;
        let columns = vec![
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
            u(m.weights_bytes),
            u(m.peak_rss_bytes),
        ];
        let batch = RecordBatch::try_new(schema.clone(), columns).map_err(self.write_err(METRICS_FILE))?;
        let upload = BufWriter::new(self.location.store.clone(), self.path(METRICS_FILE));
        let mut writer = AsyncArrowWriter::try_new(upload, schema, Some(properties(run))).map_err(self.write_err(METRICS_FILE))?;
        writer.write(&batch).await.map_err(self.write_err(METRICS_FILE))?;
        writer.close().await.map_err(self.write_err(METRICS_FILE))?;
        Ok(())
    }

    /// Writes `_SUCCESS` (create-once), marking the output complete.
    pub async fn commit(&self, summary: &serde_json::Value) -> Result<(), SinkError> {
        let payload = PutPayload::from(serde_json::to_vec_pretty(summary).expect("JSON values serialise"));
        let options = PutOptions { mode: PutMode::Create, ..Default::default() };
        self.location
            .store
            .put_opts(&self.path(SUCCESS_FILE), payload, options)
            .await
            .map_err(self.write_err(SUCCESS_FILE))?;
        Ok(())
    }
}

/// Streams result rows into `results.parquet`.
pub struct ResultsWriter {
    writer: AsyncArrowWriter<BufWriter>,
    schema: SchemaRef,
    pending: Vec<Outcome>,
    url: String,
    rows: u64,
}

impl ResultsWriter {
    pub async fn push(&mut self, outcome: Outcome) -> Result<(), SinkError> {
        self.pending.push(outcome);
        self.rows += 1;
        if self.pending.len() >= ROWS_PER_BATCH {
            self.flush().await?;
        }
        Ok(())
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = results_batch(&self.pending, self.schema.clone())
            .map_err(|e| SinkError::Write { url: self.url.clone(), source: Box::new(e) })?;
        self.pending.clear();
        self.writer.write(&batch).await.map_err(|e| SinkError::Write { url: self.url.clone(), source: Box::new(e) })
    }

    /// Writes the remaining rows and completes the upload; only now does the file appear.
    pub async fn close(mut self) -> Result<u64, SinkError> {
        self.flush().await?;
        self.writer.close().await.map_err(|e| SinkError::Write { url: self.url.clone(), source: Box::new(e) })?;
        Ok(self.rows)
    }
}

fn results_batch(rows: &[Outcome], schema: SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
    let n = rows.len();
    let mut id = StringBuilder::with_capacity(n, n * 16);
    let mut status = StringBuilder::with_capacity(n, n * 9);
    let mut code = StringBuilder::new();
    let mut message = StringBuilder::new();
    let mut error_valid = Vec::with_capacity(n);
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
                id.append_value(&c.id);
                status.append_value("succeeded");
                code.append_value("");
                message.append_value("");
                error_valid.push(false);
                text.append_value(&c.text);
                finish.append_value(c.finish_reason.as_str());
                prompt_tokens.append_value(c.prompt_tokens);
                completion_tokens.append_value(c.completion_tokens);
                queue.append_value(c.queue_s);
                ttft.append_value(c.ttft_s);
                e2e.append_value(c.e2e_s);
                tpot.append_option(c.tpot_s);
            }
            Outcome::Failed { id: row_id, error } => {
                id.append_value(row_id);
                status.append_value("errored");
                code.append_value(error.code.as_str());
                message.append_value(&error.message);
                error_valid.push(true);
                text.append_null();
                finish.append_value(FinishReason::Error.as_str());
                prompt_tokens.append_null();
                completion_tokens.append_value(0);
                queue.append_null();
                ttft.append_null();
                e2e.append_null();
                tpot.append_null();
            }
        }
    }
    let error = StructArray::try_new(
        error_fields(),
        vec![Arc::new(code.finish()) as ArrayRef, Arc::new(message.finish())],
        Some(error_valid.into()),
    )?;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(id.finish()),
        Arc::new(status.finish()),
        Arc::new(error),
        Arc::new(text.finish()),
        Arc::new(finish.finish()),
        Arc::new(prompt_tokens.finish()),
        Arc::new(completion_tokens.finish()),
        Arc::new(queue.finish()),
        Arc::new(ttft.finish()),
        Arc::new(e2e.finish()),
        Arc::new(tpot.finish()),
    ];
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
    fn metrics_schema_matches_schemas_dir() {
        check(&metrics_schema(), "metrics.json");
    }
}
