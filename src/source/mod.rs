//! Input: object-store listing and streamed Parquet reading.
//!
//! Opening an input lists the files (one file, every `.parquet` under a prefix ending in `/`, or a glob), reads
//! each footer once and checks the columns, before any generation starts. Streaming then decodes one projected
//! row group at a time into batches of [`SourceRow`]s sent through a bounded channel, so memory is bounded by a
//! row group and the channel depth, not by the dataset.

pub mod store;

use std::ops::Range;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Schema};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use tokio::sync::mpsc;

use crate::job::{InputSpec, PromptColumn};
use crate::row::{ErrorCode, Message, Prompt, RowError};
pub use store::{Location, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("no input found at `{url}`")]
    NotFound { url: String },
    #[error("cannot list `{url}`")]
    List { url: String, #[source] source: object_store::Error },
    #[error("`{url}` is not a readable Parquet file")]
    Parquet { url: String, #[source] source: ParquetError },
    #[error("`{url}` has no column `{column}` (its columns: {available})")]
    MissingColumn { url: String, column: String, available: String },
    #[error("column `{column}` of `{url}` has type {actual}, expected {expected}")]
    ColumnType { url: String, column: String, actual: String, expected: &'static str },
    #[error("cannot read `{url}`")]
    Read { url: String, #[source] source: ParquetError },
}

/// One input row, as read: an id and either a prompt or the reason the row cannot be used.
#[derive(Clone, Debug)]
pub struct SourceRow {
    pub id: String,
    pub prompt: Result<Prompt, RowError>,
}

/// Rows decoded per batch sent downstream.
const BATCH_ROWS: usize = 256;

/// Footer bytes fetched in the first request; most footers fit, so opening a file is one round trip.
const FOOTER_PREFETCH: usize = 64 * 1024;

#[derive(Debug)]
struct InputFile {
    meta: ObjectMeta,
    url: String,
    metadata: ArrowReaderMetadata,
    id_index: Option<usize>,
    prompt_index: usize,
}

/// An opened input: its files listed and their footers read and checked.
#[derive(Debug)]
pub struct Input {
    location: Location,
    files: Vec<InputFile>,
    prompt: PromptColumn,
    total_rows: u64,
}

impl Input {
    pub async fn open(spec: &InputSpec) -> Result<Input, SourceError> {
        let (location, metas) = list(&spec.url).await?;
        let mut files = Vec::with_capacity(metas.len());
        for meta in metas {
            let url = location.display(&meta.location);
            let mut reader = PinnedReader { store: location.store.clone(), meta: meta.clone() };
            let metadata = ArrowReaderMetadata::load_async(&mut reader, ArrowReaderOptions::new())
                .await
                .map_err(|source| SourceError::Parquet { url: url.clone(), source })?;
            let schema = metadata.schema().clone();
            let prompt_index = check_column(&url, &schema, spec.prompt.name(), match &spec.prompt {
                PromptColumn::Text(_) => ColumnKind::Text,
                PromptColumn::Messages(_) => ColumnKind::Messages,
            })?;
            let id_index = match &spec.id_column {
                Some(name) => Some(check_column(&url, &schema, name, ColumnKind::Id)?),
                None => None,
            };
            files.push(InputFile { meta, url, metadata, id_index, prompt_index });
        }
        let total_rows = files.iter().map(|f| f.metadata.metadata().file_metadata().num_rows().max(0) as u64).sum();
        Ok(Input { location, files, prompt: spec.prompt.clone(), total_rows })
    }

    /// Rows in all input files, from their footers.
    pub fn total_rows(&self) -> u64 {
        self.total_rows
    }

    /// The input files' URLs, in reading order.
    pub fn file_urls(&self) -> Vec<String> {
        self.files.iter().map(|f| f.url.clone()).collect()
    }

    pub fn url(&self) -> &str {
        &self.location.url
    }

    /// Streams every row of every file, in order, into `tx`. Returns when all rows are sent, or early (without
    /// error) when the receiver is gone.
    pub async fn stream(self, tx: mpsc::Sender<Vec<SourceRow>>) -> Result<(), SourceError> {
        for file in &self.files {
            let reader = PinnedReader { store: self.location.store.clone(), meta: file.meta.clone() };
            let descr = file.metadata.metadata().file_metadata().schema_descr_ptr();
            let mut roots = vec![file.prompt_index];
            roots.extend(file.id_index);
            let read_err = |source| SourceError::Read { url: file.url.clone(), source };
            let mut stream = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, file.metadata.clone())
                .with_projection(ProjectionMask::roots(&descr, roots))
                .with_batch_size(BATCH_ROWS)
                .build()
                .map_err(read_err)?;
            let file_name = file.meta.location.filename().unwrap_or_default().to_string();
            let mut row_number = 0u64;
            while let Some(batch) = stream.next().await {
                let batch = batch.map_err(read_err)?;
                let rows = rows_of(&batch, &self.prompt, file, &file_name, row_number).map_err(read_err)?;
                row_number += batch.num_rows() as u64;
                if tx.send(rows).await.is_err() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// Lists the files an input URL names, sorted by path.
async fn list(url: &str) -> Result<(Location, Vec<ObjectMeta>), SourceError> {
    let list_err = |source| SourceError::List { url: url.into(), source };
    if store::is_glob(url) {
        let first = url.find(['*', '?', '[']).expect("is_glob");
        let split = url[..first].rfind('/').map(|i| i + 1).unwrap_or(0);
        let (prefix_url, pattern) = url.split_at(split);
        let location = store::resolve(if prefix_url.is_empty() { "." } else { prefix_url })?;
        let pattern = glob::Pattern::new(pattern)
            .map_err(|e| SourceError::Store(StoreError::BadUrl { url: url.into(), source: e.into() }))?;
        let options = glob::MatchOptions { require_literal_separator: true, ..Default::default() };
        let prefix = location.path.clone();
        let mut metas: Vec<ObjectMeta> = location
            .store
            .list(Some(&prefix))
            .try_filter(|m| {
                let relative = relative_parts(&m.location, &prefix);
                let keep = !relative.is_empty()
                    && !hidden(&relative)
                    && pattern.matches_with(&relative.join("/"), options);
                std::future::ready(keep)
            })
            .try_collect()
            .await
            .map_err(list_err)?;
        if metas.is_empty() {
            return Err(SourceError::NotFound { url: url.into() });
        }
        metas.sort_by(|a, b| a.location.cmp(&b.location));
        return Ok((location, metas));
    }
    let location = store::resolve(url)?;
    if !url.ends_with('/') {
        match location.store.head(&location.path).await {
            Ok(meta) => return Ok((location, vec![meta])),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => return Err(list_err(source)),
        }
    }
    // A prefix: every Parquet file under it, skipping `_SUCCESS`-style and hidden names below the prefix.
    let prefix = location.path.clone();
    let mut metas: Vec<ObjectMeta> = location
        .store
        .list(Some(&prefix))
        .try_filter(|m| {
            let keep = m.location.as_ref().ends_with(".parquet") && !hidden(&relative_parts(&m.location, &prefix));
            std::future::ready(keep)
        })
        .try_collect()
        .await
        .or_else(|e| match e {
            object_store::Error::NotFound { .. } => Ok(Vec::new()),
            e => Err(list_err(e)),
        })?;
    if metas.is_empty() {
        return Err(SourceError::NotFound { url: url.into() });
    }
    metas.sort_by(|a, b| a.location.cmp(&b.location));
    Ok((location, metas))
}

/// The path segments of `path` below `prefix`.
fn relative_parts(path: &Path, prefix: &Path) -> Vec<String> {
    path.prefix_match(prefix).map(|parts| parts.map(|p| p.as_ref().to_string()).collect()).unwrap_or_default()
}

/// Hive/Spark convention: names starting with `_` or `.` (`_SUCCESS`, `_temporary/`, `.crc`) are not data.
fn hidden(relative: &[String]) -> bool {
    relative.iter().any(|p| p.starts_with(['_', '.']))
}

#[derive(Clone, Copy)]
enum ColumnKind {
    Text,
    Messages,
    Id,
}

fn is_string(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

fn check_column(url: &str, schema: &Schema, name: &str, kind: ColumnKind) -> Result<usize, SourceError> {
    let Ok(index) = schema.index_of(name) else {
        let available = schema.fields().iter().map(|f| format!("`{}`", f.name())).collect::<Vec<_>>().join(", ");
        return Err(SourceError::MissingColumn { url: url.into(), column: name.into(), available });
    };
    let actual = schema.field(index).data_type();
    let (ok, expected) = match kind {
        ColumnKind::Text => (is_string(actual), "a string"),
        ColumnKind::Id => (is_string(actual) || actual.is_integer(), "a string or an integer"),
        ColumnKind::Messages => (messages_item(actual).is_some(), "list<struct<role: string, content: string>>"),
    };
    if !ok {
        return Err(SourceError::ColumnType { url: url.into(), column: name.into(), actual: actual.to_string(), expected });
    }
    Ok(index)
}

/// The struct type of a messages column's items, if the column has the expected shape.
fn messages_item(t: &DataType) -> Option<&arrow::datatypes::Fields> {
    let item = match t {
        DataType::List(f) | DataType::LargeList(f) => f.data_type(),
        _ => return None,
    };
    match item {
        DataType::Struct(fields) => {
            let has = |n: &str| fields.iter().any(|f| f.name() == n && is_string(f.data_type()));
            (has("role") && has("content")).then_some(fields)
        }
        _ => None,
    }
}

fn to_strings(array: &ArrayRef) -> Result<StringArray, ParquetError> {
    let cast = arrow::compute::cast(array, &DataType::Utf8).map_err(|e| ParquetError::General(e.to_string()))?;
    Ok(cast.as_string::<i32>().clone())
}

fn rows_of(
    batch: &RecordBatch,
    prompt: &PromptColumn,
    file: &InputFile,
    file_name: &str,
    first_row: u64,
) -> Result<Vec<SourceRow>, ParquetError> {
    let schema = batch.schema();
    let column = |index: usize| {
        let name = file.metadata.schema().field(index).name();
        schema.index_of(name).map(|i| batch.column(i).clone()).map_err(|e| ParquetError::General(e.to_string()))
    };
    let ids = match file.id_index {
        Some(index) => Some(to_strings(&column(index)?)?),
        None => None,
    };
    let prompt_array = column(file.prompt_index)?;
    let prompts: Vec<Result<Prompt, RowError>> = match prompt {
        PromptColumn::Text(_) => {
            let texts = to_strings(&prompt_array)?;
            (0..batch.num_rows())
                .map(|i| {
                    if texts.is_null(i) {
                        Err(RowError::new(ErrorCode::NullPrompt, "the prompt is null"))
                    } else if texts.value(i).trim().is_empty() {
                        Err(RowError::new(ErrorCode::EmptyPrompt, "the prompt is empty"))
                    } else {
                        Ok(Prompt::Text(texts.value(i).to_string()))
                    }
                })
                .collect()
        }
        PromptColumn::Messages(_) => messages_of(&prompt_array)?,
    };
    Ok(prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            let id = match &ids {
                Some(ids) if !ids.is_null(i) => ids.value(i).to_string(),
                _ => format!("{file_name}:{}", first_row + i as u64),
            };
            SourceRow { id, prompt }
        })
        .collect())
}

fn messages_of(array: &ArrayRef) -> Result<Vec<Result<Prompt, RowError>>, ParquetError> {
    let (offsets, values, nulls): (Vec<usize>, _, _) = match array.data_type() {
        DataType::List(_) => {
            let list = array.as_list::<i32>();
            (list.offsets().iter().map(|&o| o as usize).collect(), list.values().clone(), list.logical_nulls())
        }
        DataType::LargeList(_) => {
            let list = array.as_list::<i64>();
            (list.offsets().iter().map(|&o| o as usize).collect(), list.values().clone(), list.logical_nulls())
        }
        other => return Err(ParquetError::General(format!("unexpected messages type {other}"))),
    };
    let items = values.as_struct();
    let field = |name: &str| {
        items.column_by_name(name).ok_or_else(|| ParquetError::General(format!("messages have no `{name}` field")))
    };
    let roles = to_strings(field("role")?)?;
    let contents = to_strings(field("content")?)?;
    let item_nulls = items.logical_nulls();
    Ok((0..array.len())
        .map(|row| {
            if nulls.as_ref().is_some_and(|n| n.is_null(row)) {
                return Err(RowError::new(ErrorCode::NullPrompt, "the messages value is null"));
            }
            let mut messages = Vec::with_capacity(offsets[row + 1] - offsets[row]);
            for j in offsets[row]..offsets[row + 1] {
                if item_nulls.as_ref().is_some_and(|n| n.is_null(j)) || roles.is_null(j) {
                    return Err(RowError::new(ErrorCode::InvalidMessages, format!("message {} has no role", j - offsets[row])));
                }
                let content = if contents.is_null(j) { "" } else { contents.value(j) };
                messages.push(Message { role: roles.value(j).to_string(), content: content.to_string() });
            }
            if messages.iter().all(|m| m.content.trim().is_empty()) {
                return Err(RowError::new(ErrorCode::EmptyPrompt, "the conversation has no message with content"));
            }
            Ok(Prompt::Messages(messages))
        })
        .collect())
}

fn object_err(e: object_store::Error) -> ParquetError {
    ParquetError::External(Box::new(e))
}

/// An [`AsyncFileReader`] over an object store, pinned to the version listed when the input was opened: every
/// range request carries `If-Match: <e_tag>`, so a file rewritten during the run fails loudly instead of mixing
/// versions. The known size means the footer is read with bounded ranges, never a suffix request.
#[derive(Clone, Debug)]
struct PinnedReader {
    store: Arc<dyn ObjectStore>,
    meta: ObjectMeta,
}

impl PinnedReader {
    fn options(&self, range: Range<u64>) -> GetOptions {
        GetOptions::new().with_range(Some(range)).with_if_match(self.meta.e_tag.clone())
    }
}

impl AsyncFileReader for PinnedReader {
    fn get_bytes(&mut self, range: Range<u64>) -> BoxFuture<'_, parquet::errors::Result<Bytes>> {
        let options = self.options(range);
        async move { self.store.get_opts(&self.meta.location, options).await.map_err(object_err)?.bytes().await.map_err(object_err) }
            .boxed()
    }

    fn get_byte_ranges(&mut self, ranges: Vec<Range<u64>>) -> BoxFuture<'_, parquet::errors::Result<Vec<Bytes>>> {
        async move {
            let this = &*self;
            object_store::coalesce_ranges(
                &ranges,
                |r| async move { this.store.get_opts(&this.meta.location, this.options(r)).await?.bytes().await },
                object_store::OBJECT_STORE_COALESCE_DEFAULT,
            )
            .await
            .map_err(object_err)
        }
        .boxed()
    }

    fn get_metadata<'a>(
        &'a mut self,
        options: Option<&'a ArrowReaderOptions>,
    ) -> BoxFuture<'a, parquet::errors::Result<Arc<ParquetMetaData>>> {
        async move {
            let size = self.meta.size;
            let reader = ParquetMetaDataReader::new()
                .with_metadata_options(options.map(|o| o.metadata_options().clone()))
                .with_prefetch_hint(Some(FOOTER_PREFETCH));
            Ok(Arc::new(reader.load_and_finish(self, size).await?))
        }
        .boxed()
    }
}
