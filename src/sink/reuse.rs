//! What a reuse source (an earlier run's output) is read for: its plan, the result files it serves from, each
//! file's request keys (one column, with ranged reads) and, for the rows a run reuses, whole result files.

use arrow::array::{Array, AsArray, RecordBatch};
use futures::TryStreamExt;

use super::{Output, SinkError};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The metadata key of the arithmetic a result file was computed with (`reuse::numerics`).
pub const NUMERICS_KEY: &str = "nightshift.numerics";

/// The request keys of one result file's succeeded rows.
pub struct FileKeys {
    /// The file's `nightshift.numerics`; `None` in files written before request keys.
    pub numerics: Option<String>,
    /// (row in the file, the first 16 bytes of its request key as two words: [`crate::reuse::RequestKey::words`]).
    pub keys: Vec<(u32, [u64; 2])>,
}

/// The result files an output serves reuse from, with their succeeded rows (to size the index once).
pub enum ReuseFiles {
    /// `_SUCCESS` and the manifest: the manifest's files.
    Complete(Vec<(String, u64)>),
    /// No `_SUCCESS`: the committed units' files, whose markers name files that are there.
    Incomplete(Vec<(String, u64)>),
}

impl Output {
    pub async fn reuse_files(&self) -> Result<ReuseFiles, SinkError> {
        if self.is_complete().await? {
            if let Some(manifest) = self.read_manifest().await? {
                let rows: std::collections::HashMap<&str, u64> = manifest.units.iter().map(|m| (m.results.as_str(), m.succeeded_rows)).collect();
                let files = manifest.results.iter().map(|f| (f.clone(), rows.get(f.as_str()).copied().unwrap_or(0))).collect();
                return Ok(ReuseFiles::Complete(files));
            }
        }
        let (markers, _damaged) = self.whole_markers().await?;
        Ok(ReuseFiles::Incomplete(markers.into_values().map(|m| (m.results, m.succeeded_rows)).collect()))
    }

    /// The request keys of a result file's succeeded rows, reading only the `status` and `request_key` columns.
    pub async fn read_keys(&self, relative: &str) -> Result<FileKeys, SinkError> {
        let read_err = |source: BoxError| SinkError::Read { url: self.display(relative), source };
        let (builder, _) = self.open_parquet(relative).await?;
        let numerics = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|kv| kv.key == NUMERICS_KEY).and_then(|kv| kv.value.clone()));
        let mut keys = Vec::new();
        if builder.schema().field_with_name("request_key").is_err() {
            return Ok(FileKeys { numerics: None, keys });
        }
        let mask = super::status::columns(&builder, &["status", "request_key"]);
        let mut stream = builder.with_projection(mask).with_batch_size(8192).build().map_err(|e| read_err(e.into()))?;
        let mut row = 0u32;
        while let Some(batch) = stream.try_next().await.map_err(|e| read_err(e.into()))? {
            let (Some(status), Some(key)) = (
                batch.column_by_name("status").and_then(|c| c.as_string_opt::<i32>()),
                batch.column_by_name("request_key").and_then(|c| c.as_string_opt::<i32>()),
            ) else {
                return Err(read_err("the `status` or `request_key` column is not text".into()));
            };
            for i in 0..batch.num_rows() {
                if status.is_valid(i) && status.value(i) == "succeeded" && key.is_valid(i) {
                    if let Some(key) = crate::reuse::RequestKey::parse(key.value(i)) {
                        keys.push((row + i as u32, key.words()));
                    }
                }
            }
            row += batch.num_rows() as u32;
        }
        Ok(FileKeys { numerics, keys })
    }

    /// A whole result file, as one batch.
    pub async fn read_result_file(&self, relative: &str) -> Result<RecordBatch, SinkError> {
        let read_err = |source: BoxError| SinkError::Read { url: self.display(relative), source };
        let (builder, _) = self.open_parquet(relative).await?;
        let schema = builder.schema().clone();
        let batches: Vec<RecordBatch> = builder.build().map_err(|e| read_err(e.into()))?.try_collect().await.map_err(|e| read_err(e.into()))?;
        arrow::compute::concat_batches(&schema, &batches).map_err(|e| read_err(e.into()))
    }
}
