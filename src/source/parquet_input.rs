//! Parquet input files: each footer read once when the input is opened and its columns checked, before any
//! generation starts; then one projected row group at a time decoded into batches of [`SourceRow`]s, so memory is
//! bounded by a row group and the channel depth, not by the dataset. Every read is pinned to the version listed
//! ([`PinnedReader`]).

use std::ops::Range;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Schema};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use object_store::{GetOptions, ObjectMeta, ObjectStore};
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector};
use parquet::arrow::async_reader::AsyncFileReader;
use parquet::arrow::async_reader::ParquetRecordBatchStream;
use parquet::arrow::{ParquetRecordBatchStreamBuilder, ProjectionMask};
use parquet::errors::ParquetError;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use tokio::sync::mpsc;

use super::{default_id, id_name, Completion, InputFormat, Location, SourceError, SourceRow, BATCH_ROWS};
use crate::job::{self, InputSpec, PromptColumn};
use crate::plan::{PlannedFile, Unit};
use crate::row::{ErrorCode, Message, Prompt, RowError, RowParams, RowTag};

/// Footer bytes fetched in the first request; most footers fit, so opening a file is one round trip.
const FOOTER_PREFETCH: usize = 64 * 1024;

/// Whether a read failed because the object no longer matches its pinned e_tag (`If-Match` precondition).
fn is_changed(e: &ParquetError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if matches!(err.downcast_ref::<object_store::Error>(), Some(object_store::Error::Precondition { .. })) {
            return true;
        }
        source = err.source();
    }
    false
}

#[derive(Debug)]
struct ParquetFile {
    meta: ObjectMeta,
    url: String,
    /// The file's path relative to the input's prefix (its name for an input of one file): a row without an id
    /// gets `<this>:<row>`, unique over the whole input (`a/x.parquet` and `b/x.parquet` differ).
    id_name: String,
    metadata: ArrowReaderMetadata,
    id_index: Option<usize>,
    prompt_index: usize,
    /// (generation key, its type, column index) of the per-row parameter columns.
    param_indices: Vec<(&'static str, job::ParamType, usize)>,
    /// The completion column of a scoring job.
    completion_index: Option<usize>,
}


/// A Parquet input: its files, and the columns the job reads.
#[derive(Debug)]
pub(super) struct ParquetInput {
    files: Vec<ParquetFile>,
    prompt: PromptColumn,
    id_column: Option<String>,
}

impl ParquetFile {
    fn rows(&self) -> u64 {
        self.metadata.metadata().file_metadata().num_rows().max(0) as u64
    }

    fn read_error(&self, source: ParquetError) -> SourceError {
        if is_changed(&source) {
            SourceError::Changed { url: self.url.clone() }
        } else {
            SourceError::Read { url: self.url.clone(), source }
        }
    }
}

impl ParquetInput {
    /// Reads and checks the footers of the listed files.
    pub(super) async fn open(location: &Location, metas: Vec<ObjectMeta>, spec: &InputSpec) -> Result<ParquetInput, SourceError> {
        let mut files = Vec::with_capacity(metas.len());
        for meta in metas {
            let url = location.display(&meta.location);
            let id_name = id_name(&meta.location, &location.path);
            let mut reader = PinnedReader { store: location.store.clone(), meta: meta.clone() };
            let metadata = crate::panics::catch_panic_async(ArrowReaderMetadata::load_async(&mut reader, ArrowReaderOptions::new()))
                .await
                .unwrap_or_else(|panic| Err(ParquetError::General(format!("the footer does not decode: {panic}"))))
                .map_err(|source| SourceError::Parquet { url: url.clone(), source })?;
            check_chunks(&metadata, meta.size).map_err(|problem| SourceError::Parquet { url: url.clone(), source: ParquetError::General(problem) })?;
            let schema = metadata.schema().clone();
            let prompt_index = check_column(&url, &schema, spec.prompt.name(), match &spec.prompt {
                PromptColumn::Text(_) => ColumnKind::Text,
                PromptColumn::Messages(_) => ColumnKind::Messages,
            })?;
            let id_index = match &spec.id_column {
                Some(name) => Some(check_column(&url, &schema, name, ColumnKind::Id)?),
                None => None,
            };
            let mut param_indices = Vec::new();
            for (key, column) in spec.parameters.columns() {
                let ty = job::ROW_PARAMETERS.iter().find(|(k, _)| *k == key).expect("columns are known parameters").1;
                param_indices.push((key, ty, check_column(&url, &schema, column, ColumnKind::Param(ty))?));
            }
            let completion_index = match &spec.completion_column {
                Some(name) => Some(check_column(&url, &schema, name, ColumnKind::Completion)?),
                None => None,
            };
            files.push(ParquetFile { meta, url, id_name, metadata, id_index, prompt_index, param_indices, completion_index });
        }
        Ok(ParquetInput { files, prompt: spec.prompt.clone(), id_column: spec.id_column.clone() })
    }
}

impl InputFormat for ParquetInput {
    fn snapshot(&self) -> Vec<PlannedFile> {
        self.files
            .iter()
            .map(|f| PlannedFile { path: f.meta.location.to_string(), size: f.meta.size, e_tag: f.meta.e_tag.clone(), rows: f.rows() })
            .collect()
    }

    fn file_urls(&self) -> Vec<String> {
        self.files.iter().map(|f| f.url.clone()).collect()
    }

    fn total_rows(&self) -> u64 {
        self.files.iter().map(|f| f.rows()).sum()
    }

    /// Reads the id column of every file and refuses duplicates, naming the first few. A null id is the row's
    /// default id, `<file>:<row>`, checked with the others (a real id may be the same text). Inputs without an id
    /// column get default ids only, unique by construction, and pass at once.
    async fn check_whole(&self, store: &Arc<dyn ObjectStore>) -> Result<(), SourceError> {
        let Some(column) = &self.id_column else { return Ok(()) };
        let mut seen: std::collections::HashMap<String, (usize, u64)> = std::collections::HashMap::new();
        let mut examples = Vec::new();
        let mut count = 0u64;
        for (index, file) in self.files.iter().enumerate() {
            let id_index = file.id_index.expect("files of an input with an id column have its index");
            let read_err = |source| SourceError::Read { url: file.url.clone(), source };
            let reader = PinnedReader { store: store.clone(), meta: file.meta.clone() };
            let descr = file.metadata.metadata().file_metadata().schema_descr_ptr();
            let mut stream = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, file.metadata.clone())
                .with_projection(ProjectionMask::roots(&descr, [id_index]))
                .with_batch_size(8192)
                .build()
                .map_err(read_err)?;
            let mut row = 0u64;
            while let Some(batch) = next_batch(&mut stream).await {
                let batch = batch.map_err(|e| file.read_error(e))?;
                let ids = to_strings(batch.column(0)).map_err(read_err)?;
                for i in 0..ids.len() {
                    let default;
                    let id = if ids.is_null(i) {
                        default = default_id(&file.id_name, row + i as u64);
                        default.as_str()
                    } else {
                        ids.value(i)
                    };
                    if let Some(&(first_file, first_row)) = seen.get(id) {
                        count += 1;
                        if examples.len() < 5 {
                            examples.push(format!(
                                "{} (row {first_row} of `{}` and row {} of `{}`)",
                                crate::row::id_for_message(id),
                                self.files[first_file].url,
                                row + i as u64,
                                file.url
                            ));
                        }
                    } else {
                        seen.insert(id.to_string(), (index, row + i as u64));
                    }
                }
                row += batch.num_rows() as u64;
            }
        }
        if count > 0 {
            return Err(SourceError::DuplicateIds { column: column.clone(), count, examples: examples.join(", ") });
        }
        Ok(())
    }

    /// The prompt column's uncompressed bytes, estimated from the footer alone: each row group's column-chunk
    /// size, shared evenly among its rows.
    fn prompt_bytes(&self, file: usize, first_row: u64, rows: u32) -> u64 {
        let Some(f) = self.files.get(file) else { return 0 };
        let name = self.prompt.name();
        let end = first_row + rows as u64;
        let mut start = 0u64;
        let mut bytes = 0f64;
        for rg in f.metadata.metadata().row_groups() {
            let n = rg.num_rows().max(0) as u64;
            let overlap = end.min(start + n).saturating_sub(first_row.max(start));
            if overlap > 0 {
                // A messages column is several leaf columns under one root.
                let size: i64 = rg.columns().iter().filter(|c| c.column_path().parts().first().is_some_and(|p| p == name)).map(|c| c.uncompressed_size()).sum();
                bytes += size.max(0) as f64 * overlap as f64 / n as f64;
            }
            start += n;
        }
        bytes.round() as u64
    }

    async fn stream_unit(&self, store: &Arc<dyn ObjectStore>, unit: &Unit, tx: &mpsc::Sender<Vec<SourceRow>>) -> Result<bool, SourceError> {
        let file = self.files.get(unit.file).ok_or_else(|| SourceError::NotFound { url: format!("input file {} of the plan", unit.file) })?;
        let read_err = |source| SourceError::Read { url: file.url.clone(), source };
        // The row groups the unit overlaps, and the unit's rows within them.
        let (mut groups, mut first_group_start, mut start) = (Vec::new(), None, 0u64);
        let end_row = unit.first_row + unit.rows as u64;
        for (i, rg) in file.metadata.metadata().row_groups().iter().enumerate() {
            let rows = rg.num_rows().max(0) as u64;
            if start < end_row && start + rows > unit.first_row {
                groups.push(i);
                first_group_start.get_or_insert(start);
            }
            start += rows;
        }
        let Some(group_start) = first_group_start else { return Ok(true) };
        let skip = (unit.first_row - group_start) as usize;
        let selection = RowSelection::from(vec![RowSelector::skip(skip), RowSelector::select(unit.rows as usize)]);
        let reader = PinnedReader { store: store.clone(), meta: file.meta.clone() };
        let descr = file.metadata.metadata().file_metadata().schema_descr_ptr();
        let mut roots = vec![file.prompt_index];
        roots.extend(file.id_index);
        roots.extend(file.param_indices.iter().map(|p| p.2));
        roots.extend(file.completion_index);
        let mut stream = ParquetRecordBatchStreamBuilder::new_with_metadata(reader, file.metadata.clone())
            .with_projection(ProjectionMask::roots(&descr, roots))
            .with_row_groups(groups)
            .with_row_selection(selection)
            .with_batch_size(BATCH_ROWS)
            .build()
            .map_err(read_err)?;
        let mut offset = 0u32;
        while let Some(batch) = next_batch(&mut stream).await {
            let batch = batch.map_err(|e| file.read_error(e))?;
            let rows = rows_of(&batch, &self.prompt, file, unit, offset).map_err(read_err)?;
            offset += batch.num_rows() as u32;
            if tx.send(rows).await.is_err() {
                return Ok(false);
            }
        }
        if offset != unit.rows {
            return Err(read_err(ParquetError::General(format!(
                "unit {} should have {} rows from row {}, but {offset} were read",
                unit.id, unit.rows, unit.first_row
            ))));
        }
        Ok(true)
    }
}

/// The next batch of a Parquet stream. The parquet and arrow crates assert on some damaged data instead of
/// returning an error; such a file is an error like any other unreadable one.
async fn next_batch(stream: &mut ParquetRecordBatchStream<PinnedReader>) -> Option<Result<RecordBatch, ParquetError>> {
    crate::panics::catch_panic_async(stream.next())
        .await
        .unwrap_or_else(|panic| Some(Err(ParquetError::General(format!("the data does not decode: {panic}")))))
}

/// The footer's row groups and column chunks against the file: row counts that are not negative, and every chunk
/// inside the file. The parquet crate trusts these numbers (a negative offset is an assertion failure deep in its
/// reader), so a damaged footer is refused here, before any row is read.
fn check_chunks(metadata: &ArrowReaderMetadata, file_size: u64) -> Result<(), String> {
    for (g, rg) in metadata.metadata().row_groups().iter().enumerate() {
        if rg.num_rows() < 0 {
            return Err(format!("row group {g} has {} rows", rg.num_rows()));
        }
        for c in rg.columns() {
            let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
            let (start, length) = (u64::try_from(start), u64::try_from(c.compressed_size()));
            let inside = matches!((start, length), (Ok(s), Ok(l)) if s.checked_add(l).is_some_and(|end| end <= file_size));
            if !inside {
                return Err(format!("a column chunk of row group {g} ({}) lies outside the file", c.column_path()));
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum ColumnKind {
    Text,
    /// A string, or a list of integers (token ids).
    Completion,
    Messages,
    Id,
    Param(job::ParamType),
}

/// A text type: plain, large or view strings, or a dictionary of them (pandas' categoricals and pyarrow's
/// dictionary arrays are stored so, and read back as such), all read through one cast ([`to_strings`]).
fn is_string(t: &DataType) -> bool {
    match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(_, values) => is_string(values),
        _ => false,
    }
}

fn check_column(url: &str, schema: &Schema, name: &str, kind: ColumnKind) -> Result<usize, SourceError> {
    let Ok(index) = schema.index_of(name) else {
        let available = schema.fields().iter().map(|f| format!("`{}`", f.name())).collect::<Vec<_>>().join(", ");
        return Err(SourceError::MissingColumn { url: url.into(), column: name.into(), available });
    };
    let actual = schema.field(index).data_type();
    let (ok, expected) = match kind {
        ColumnKind::Text => (is_string(actual), "a string"),
        ColumnKind::Completion => (is_string(actual) || list_item(actual).is_some_and(|t| t.is_integer()), "a string, or a list of integer token ids"),
        ColumnKind::Id => (is_string(actual) || actual.is_integer(), "a string or an integer"),
        ColumnKind::Messages => (messages_item(actual).is_some(), "list<struct<role: string, content: string>>"),
        ColumnKind::Param(ty) => match ty {
            job::ParamType::Integer => (actual.is_integer(), "an integer"),
            job::ParamType::Number => (actual.is_integer() || actual.is_floating(), "a number"),
            job::ParamType::Bool => (*actual == DataType::Boolean, "a boolean"),
            job::ParamType::Text => (is_string(actual), "a string"),
            job::ParamType::TextList => (is_string(actual) || list_item(actual).is_some_and(is_string), "a list of strings, or a string"),
            job::ParamType::IntegerList => (list_item(actual).is_some_and(|t| t.is_integer()), "a list of integers"),
        },
    };
    if !ok {
        return Err(SourceError::ColumnType { url: url.into(), column: name.into(), actual: actual.to_string(), expected });
    }
    Ok(index)
}

/// The item type of a list column.
fn list_item(t: &DataType) -> Option<&DataType> {
    match t {
        DataType::List(f) | DataType::LargeList(f) => Some(f.data_type()),
        _ => None,
    }
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

/// Per-row parameters from the mapped columns, checked with the job file's range rules.
fn params_of(batch_column: impl Fn(usize) -> Result<ArrayRef, ParquetError>, file: &ParquetFile, rows: usize) -> Result<Vec<Result<RowParams, RowError>>, ParquetError> {
    use job::{ParamType, ParamValue};
    let mut out: Vec<Result<RowParams, RowError>> = vec![Ok(RowParams::default()); rows];
    let general = |e: arrow::error::ArrowError| ParquetError::General(e.to_string());
    for &(key, ty, index) in &file.param_indices {
        let column = batch_column(index)?;
        // Each column as a function from row to value (None for null), read with one cast per batch.
        let value: Box<dyn Fn(usize) -> Option<ParamValue>> = match ty {
            ParamType::Integer => {
                // A u64 value above i64::MAX (a seed of 2^63 and up) does not survive the cast: it reads as null,
                // which the loop below makes an error row instead of the job's value.
                let a = arrow::compute::cast(&column, &DataType::Int64).map_err(general)?;
                Box::new(move |i| a.is_valid(i).then(|| ParamValue::Integer(a.as_primitive::<arrow::datatypes::Int64Type>().value(i))))
            }
            ParamType::Number => {
                let a = arrow::compute::cast(&column, &DataType::Float64).map_err(general)?;
                Box::new(move |i| a.is_valid(i).then(|| ParamValue::Number(a.as_primitive::<arrow::datatypes::Float64Type>().value(i))))
            }
            ParamType::Bool => {
                let a = column.as_boolean().clone();
                Box::new(move |i| a.is_valid(i).then(|| ParamValue::Bool(a.value(i))))
            }
            ParamType::Text => {
                let a = to_strings(&column)?;
                Box::new(move |i| a.is_valid(i).then(|| ParamValue::Text(a.value(i).to_string())))
            }
            ParamType::TextList if is_string(column.data_type()) => {
                let a = to_strings(&column)?;
                Box::new(move |i| a.is_valid(i).then(|| ParamValue::TextList(vec![a.value(i).to_string()])))
            }
            ParamType::TextList | ParamType::IntegerList => {
                let item = if ty == ParamType::TextList { DataType::Utf8 } else { DataType::Int64 };
                let list = arrow::compute::cast(&column, &DataType::List(Arc::new(arrow::datatypes::Field::new("item", item, true))))
                    .map_err(general)?;
                Box::new(move |i| {
                    let list = list.as_list::<i32>();
                    if list.is_null(i) {
                        return None;
                    }
                    let values = list.value(i);
                    // A null item cannot be a stop string or a token id: it reads as an empty string or -1, which the
                    // range rule refuses.
                    Some(match ty {
                        ParamType::TextList => {
                            let v = values.as_string::<i32>();
                            ParamValue::TextList((0..v.len()).map(|j| if v.is_null(j) { String::new() } else { v.value(j).to_string() }).collect())
                        }
                        _ => {
                            let v = values.as_primitive::<arrow::datatypes::Int64Type>();
                            ParamValue::IntegerList((0..v.len()).map(|j| if v.is_null(j) { -1 } else { v.value(j) }).collect())
                        }
                    })
                })
            }
        };
        for (i, slot) in out.iter_mut().enumerate() {
            let Ok(params) = slot else { continue };
            let Some(v) = value(i) else {
                if ty == ParamType::Integer && column.is_valid(i) {
                    let shown = arrow::util::display::array_value_to_string(&column, i).unwrap_or_default();
                    *slot = Err(RowError::new(ErrorCode::InvalidParameters, format!("{key} is {shown}, beyond the largest integer taken (2^63 - 1)")));
                }
                continue;
            };
            if let Err(problem) = job::set_row_param(params, key, v) {
                *slot = Err(RowError::new(ErrorCode::InvalidParameters, format!("{key} {problem}")));
            }
        }
    }
    Ok(out)
}

fn rows_of(
    batch: &RecordBatch,
    prompt: &PromptColumn,
    file: &ParquetFile,
    unit: &Unit,
    first_offset: u32,
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
                    } else {
                        Prompt::Text(texts.value(i).to_string()).non_empty()
                    }
                })
                .collect()
        }
        PromptColumn::Messages(_) => messages_of(&prompt_array)?,
    };
    let params = params_of(column, file, batch.num_rows())?;
    let completions: Option<Box<dyn Fn(usize) -> Completion>> = match file.completion_index {
        Some(index) => {
            let array = column(index)?;
            if is_string(array.data_type()) {
                let texts = to_strings(&array)?;
                Some(Box::new(move |i| Completion::Text(if texts.is_null(i) { String::new() } else { texts.value(i).to_string() })))
            } else {
                let item = Arc::new(arrow::datatypes::Field::new("item", DataType::Int64, true));
                let list = arrow::compute::cast(&array, &DataType::List(item)).map_err(|e| ParquetError::General(e.to_string()))?;
                Some(Box::new(move |i| {
                    let list = list.as_list::<i32>();
                    if list.is_null(i) {
                        return Completion::Tokens(Vec::new());
                    }
                    let values = list.value(i);
                    let v = values.as_primitive::<arrow::datatypes::Int64Type>();
                    // A null id reads as -1, which the tokenizer's range check refuses.
                    Completion::Tokens((0..v.len()).map(|j| if v.is_null(j) { -1 } else { v.value(j) }).collect())
                }))
            }
        }
        None => None,
    };
    Ok(prompts
        .into_iter()
        .zip(params)
        .enumerate()
        .map(|(i, (prompt, params))| {
            let completion = completions.as_ref().map(|c| c(i));
            let prompt = match &completion {
                Some(c) if c.is_empty() => {
                    prompt.and(Err(RowError::new(ErrorCode::InvalidCompletion, "the completion to score is null or empty")))
                }
                _ => prompt,
            };
            let offset = first_offset + i as u32;
            let id = match &ids {
                Some(ids) if !ids.is_null(i) => ids.value(i).to_string(),
                _ => default_id(&file.id_name, unit.first_row + offset as u64),
            };
            let (prompt, params) = match params {
                Ok(params) => (prompt, params),
                Err(e) => (prompt.and(Err(e)), RowParams::default()),
            };
            SourceRow { id, tag: RowTag { unit: unit.id, offset }, prompt, params, completion }
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
            Prompt::Messages(messages).non_empty()
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
pub(crate) struct PinnedReader {
    store: Arc<dyn ObjectStore>,
    meta: ObjectMeta,
}

impl PinnedReader {
    /// A reader of the version of `meta.location` that `meta` describes (from a listing or a HEAD).
    pub(crate) fn new(store: Arc<dyn ObjectStore>, meta: ObjectMeta) -> PinnedReader {
        PinnedReader { store, meta }
    }

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
