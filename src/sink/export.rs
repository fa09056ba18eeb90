//! `nightshift export`: a completed output's result files streamed, a batch of rows at a time, into the files of
//! another format ([`crate::export`]), uploaded as they are written (multipart on object stores: visible only
//! whole).

use object_store::ObjectStoreExt;
use futures::TryStreamExt;
use object_store::buffered::BufWriter;
use tokio::io::AsyncWriteExt;

use super::{Output, SinkError};
use crate::export::{Endpoint, Line, Lines};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Rows converted to lines at a time.
const EXPORT_BATCH_ROWS: usize = 1024;

/// The files an OpenAI Batch export writes under its destination.
pub const RESULTS_JSONL: &str = "results.jsonl";
pub const ERRORS_JSONL: &str = "errors.jsonl";

/// What an export wrote.
#[derive(Debug)]
pub struct Exported {
    pub endpoint: Endpoint,
    pub results: u64,
    pub errors: u64,
    pub results_url: String,
    pub errors_url: String,
}

/// One of the export's two files, uploaded as it is written.
struct Upload {
    writer: BufWriter,
    url: String,
    lines: u64,
}

impl Upload {
    fn new(to: &Output, name: &str) -> Upload {
        Upload { writer: BufWriter::new(to.store().clone(), to.path(name)), url: to.display(name), lines: 0 }
    }

    async fn write(&mut self, line: &str) -> Result<(), SinkError> {
        let err = |e: std::io::Error| SinkError::Write { url: self.url.clone(), source: e.into() };
        self.writer.write_all(line.as_bytes()).await.map_err(err)?;
        self.writer.write_all(b"\n").await.map_err(err)?;
        self.lines += 1;
        Ok(())
    }

    async fn finish(mut self) -> Result<u64, SinkError> {
        self.writer.shutdown().await.map_err(|e| SinkError::Write { url: self.url.clone(), source: e.into() })?;
        Ok(self.lines)
    }
}

impl Output {
    /// Whether both export files are under this location. Each appears whole or not at all (an upload is
    /// completed, or a local file renamed, at its end), so both there means a finished export.
    pub async fn has_openai_batch(&self) -> Result<bool, SinkError> {
        for name in [RESULTS_JSONL, ERRORS_JSONL] {
            match self.store().head(&self.path(name)).await {
                Ok(_) => {}
                Err(object_store::Error::NotFound { .. }) => return Ok(false),
                Err(e) => return Err(SinkError::Read { url: self.display(name), source: e.into() }),
            }
        }
        Ok(true)
    }

    /// Writes `results.jsonl` and `errors.jsonl` under `to`, as OpenAI's Batch API returns them, from this
    /// completed output, in input order. `model` names the model in the bodies (default: the model file's name).
    pub async fn export_openai_batch(&self, to: &Output, model: Option<&str>) -> Result<Exported, SinkError> {
        if !self.is_complete().await? {
            // Not an output at all (no plan): nothing a retry changes (exit 5). An output still being written: 75.
            if self.read_plan().await?.is_none() {
                return Err(SinkError::NoPlan { url: self.url().into() });
            }
            return Err(SinkError::NotComplete { url: self.url().into() });
        }
        let manifest = self.read_manifest().await?.ok_or_else(|| SinkError::NotComplete { url: self.url().into() })?;
        let plan = self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })?;
        let prompt = &plan.fingerprint.prompt;
        if !prompt["completion_column"].is_null() {
            return Err(SinkError::NotExportable {
                url: self.url().into(),
                why: "it is a scoring job's (`input.completion_column`): its rows hold the completions' log-probabilities, no answers for the OpenAI Batch format".into(),
            });
        }
        let endpoint = if prompt["kind"] == "embed" {
            Endpoint::Embeddings
        } else if prompt["chat_template_sha256"].is_null() {
            Endpoint::Completions
        } else {
            Endpoint::ChatCompletions
        };
        let (mut results, mut errors) = (Upload::new(to, RESULTS_JSONL), Upload::new(to, ERRORS_JSONL));
        let mut lines: Option<Lines> = None;
        let written = async {
            for file in &manifest.results {
                let read_err = |source: BoxError| SinkError::Read { url: self.display(file), source };
                let (builder, created) = self.open_parquet(file).await?;
                let lines = lines.get_or_insert_with(|| {
                    let kv = builder.metadata().file_metadata().key_value_metadata();
                    let stored = kv.and_then(|kv| kv.iter().find(|kv| kv.key == "nightshift.model").and_then(|kv| kv.value.clone()));
                    Lines { endpoint, model: model.map(str::to_string).or(stored).unwrap_or_default(), fingerprint: plan.fingerprint.digest() }
                });
                let mut stream = builder.with_batch_size(EXPORT_BATCH_ROWS).build().map_err(|e| read_err(e.into()))?;
                while let Some(batch) = stream.try_next().await.map_err(|e| read_err(e.into()))? {
                    let mut json = arrow::json::ArrayWriter::new(Vec::new());
                    json.write(&batch).and_then(|()| json.finish()).map_err(|e| read_err(e.into()))?;
                    let rows: Vec<serde_json::Value> = serde_json::from_slice(&json.into_inner()).map_err(|e| read_err(e.into()))?;
                    for row in &rows {
                        match lines.line(row, created) {
                            Line::Result(line) => results.write(&line).await?,
                            Line::Error(line) => errors.write(&line).await?,
                        }
                    }
                }
            }
            Ok::<_, SinkError>(())
        }
        .await;
        if let Err(e) = written {
            // Abort the uploads: nothing half-written is left to look complete.
            let _ = results.writer.abort().await;
            let _ = errors.writer.abort().await;
            return Err(e);
        }
        let (results_url, errors_url) = (results.url.clone(), errors.url.clone());
        let results = results.finish().await?;
        let errors = errors.finish().await?;
        Ok(Exported { endpoint, results, errors, results_url, errors_url })
    }
}
