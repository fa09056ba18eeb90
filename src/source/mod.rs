//! Input: the files an input URL names, listed from object storage, each pinned to the version listed, read a unit
//! of the plan at a time.
//!
//! Two formats, a closed set ([`Format`]) behind one interface ([`InputFormat`]): Parquet files
//! ([`parquet_input`]: footers read and columns checked when the input is opened, one projected row group at a time
//! decoded) and OpenAI Batch JSONL request files ([`jsonl`]: scanned once for line counts and checkpoints, read from
//! the checkpoint before a unit). Either way, rows go downstream in batches through a bounded channel, so memory
//! is bounded by a batch and the channel depth, not by the dataset.

mod jsonl;
pub mod model;
pub mod openai_batch;
mod parquet_input;
pub mod store;

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use parquet::errors::ParquetError;
use tokio::sync::mpsc;

use crate::job::InputSpec;
use crate::plan::{PlannedFile, Unit};
use crate::row::{Prompt, RowError, RowParams, RowTag};
pub(crate) use parquet_input::PinnedReader;
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
    #[error("cannot read `{url}`")]
    Fetch { url: String, #[source] source: object_store::Error },
    #[error(
        "input file `{url}` changed during the run (it no longer matches the version in the plan); units already \
         committed are kept, but this output cannot be completed: write the new input's results to a new output"
    )]
    Changed { url: String },
    #[error("column `{column}` has duplicate ids ({count} in all), e.g. {examples}; ids must be unique")]
    DuplicateIds { column: String, count: u64, examples: String },
    #[error(
        "no request line names the model this job runs ({expected:?}, `input.model`): {named}; every row would be a \
         model_mismatch row. Set `input.model = {most:?}` (or \"*\" to accept any name)"
    )]
    OtherModel { expected: String, named: String, most: String },
}

/// One input row, as read: an id and either a prompt or the reason the row cannot be used.
#[derive(Clone, Debug)]
pub struct SourceRow {
    pub id: String,
    pub tag: RowTag,
    /// The prompt, or why the row cannot be used (bad prompt or bad per-row parameters).
    pub prompt: Result<Prompt, RowError>,
    pub params: RowParams,
    /// A scoring job's completion (checked: a null or empty one makes `prompt` an error).
    pub completion: Option<Completion>,
}

/// What a scoring row scores after its prompt: a text, tokenized as the prompt is, or the token ids themselves (a
/// `list<integer>` column), scored exactly, for sequences that tokenizing their text would not give back (a
/// model's own sampled tokens).
#[derive(Clone, Debug, PartialEq)]
pub enum Completion {
    Text(String),
    Tokens(Vec<i64>),
}

impl Completion {
    pub fn is_empty(&self) -> bool {
        match self {
            Completion::Text(t) => t.is_empty(),
            Completion::Tokens(t) => t.is_empty(),
        }
    }
}

/// Rows decoded per batch sent downstream.
const BATCH_ROWS: usize = 256;

/// What every input format does for [`Input`]. Files are numbered in reading order; a unit names its file by that
/// number.
trait InputFormat {
    /// The files as they are now: path, size, e_tag and rows. Compared with the plan on every run.
    fn snapshot(&self) -> Vec<PlannedFile>;

    /// The files' URLs, in reading order.
    fn file_urls(&self) -> Vec<String>;

    /// Rows in all files, as counted when the input was opened.
    fn total_rows(&self) -> u64;

    /// The checks over the whole input that a new plan (and `validate`) makes: ids unique over every file (ids key
    /// the results and the per-row seeds, so a duplicate would make two rows indistinguishable), and whatever else
    /// the format can only know by reading everything.
    async fn check_whole(&self, store: &Arc<dyn ObjectStore>) -> Result<(), SourceError>;

    /// The prompts' bytes in rows `first_row..first_row + rows` of file `file`, estimated cheaply (no rows read):
    /// used to balance shards.
    fn prompt_bytes(&self, file: usize, first_row: u64, rows: u32) -> u64;

    /// Streams the rows of one unit of the plan, in order, into `tx`, tagged with their unit and position.
    /// Returns `false` (without error) when the receiver is gone.
    async fn stream_unit(&self, store: &Arc<dyn ObjectStore>, unit: &Unit, tx: &mpsc::Sender<Vec<SourceRow>>) -> Result<bool, SourceError>;
}

/// The input formats: one per input, chosen by `input.format`.
#[derive(Debug)]
enum Format {
    Parquet(parquet_input::ParquetInput),
    /// OpenAI Batch request lines.
    Jsonl(jsonl::JsonlInput),
}

/// `$body` with `$f` bound to the input's format, whichever it is.
macro_rules! each_format {
    ($format:expr, $f:ident => $body:expr) => {
        match $format {
            Format::Parquet($f) => $body,
            Format::Jsonl($f) => $body,
        }
    };
}

/// An opened input: its files listed, pinned and checked as far as their headers go.
#[derive(Debug)]
pub struct Input {
    location: Location,
    format: Format,
    total_rows: u64,
}

impl Input {
    pub async fn open(spec: &InputSpec) -> Result<Input, SourceError> {
        let (location, format) = match &spec.openai_batch {
            Some(rules) => {
                let (location, metas) = list(&spec.url, ".jsonl").await?;
                let format = Format::Jsonl(jsonl::JsonlInput::open(&location, metas, rules).await?);
                (location, format)
            }
            None => {
                let (location, metas) = list(&spec.url, ".parquet").await?;
                let format = Format::Parquet(parquet_input::ParquetInput::open(&location, metas, spec).await?);
                (location, format)
            }
        };
        let total_rows = each_format!(&format, f => f.total_rows());
        Ok(Input { location, format, total_rows })
    }

    /// The files as they are now: path, size, e_tag and rows. Compared with the plan on every run.
    pub fn snapshot(&self) -> Vec<PlannedFile> {
        each_format!(&self.format, f => f.snapshot())
    }

    /// The checks over the whole input that a new plan (and `validate`) makes ([`InputFormat::check_whole`]):
    /// duplicate ids refused, naming the first few; a request file's lines checked for the model they name.
    pub async fn check_whole(&self) -> Result<(), SourceError> {
        each_format!(&self.format, f => f.check_whole(&self.location.store).await)
    }

    /// The prompts' bytes in rows `first_row..first_row + rows` of file `file`, estimated without reading rows.
    pub fn prompt_bytes(&self, file: usize, first_row: u64, rows: u32) -> u64 {
        each_format!(&self.format, f => f.prompt_bytes(file, first_row, rows))
    }

    /// Rows in all input files.
    pub fn total_rows(&self) -> u64 {
        self.total_rows
    }

    /// The input files' URLs, in reading order.
    pub fn file_urls(&self) -> Vec<String> {
        each_format!(&self.format, f => f.file_urls())
    }

    pub fn url(&self) -> &str {
        &self.location.url
    }

    /// Streams the rows of one unit of the plan, in order, into `tx`, tagged with their unit and position.
    /// Returns `false` (without error) when the receiver is gone.
    pub async fn stream_unit(&self, unit: &Unit, tx: &mpsc::Sender<Vec<SourceRow>>) -> Result<bool, SourceError> {
        each_format!(&self.format, f => f.stream_unit(&self.location.store, unit, tx).await)
    }
}

/// A file's name for default ids: its path below the input's prefix (its name for an input of one file).
fn id_name(path: &Path, prefix: &Path) -> String {
    match relative_parts(path, prefix) {
        parts if parts.is_empty() => path.filename().unwrap_or_default().to_string(),
        parts => parts.join("/"),
    }
}

/// Lists the files an input URL names (under a prefix, those ending in `extension`), sorted by path.
async fn list(url: &str, extension: &str) -> Result<(Location, Vec<ObjectMeta>), SourceError> {
    let list_err = |source| SourceError::List { url: url.into(), source };
    if store::is_glob(url) {
        let (prefix_url, pattern) = url.split_at(store::glob_prefix(url).len());
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
            let keep = m.location.as_ref().ends_with(extension) && !hidden(&relative_parts(&m.location, &prefix));
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

/// The id of a row with none: its file (relative to the input's prefix) and its row number in that file.
fn default_id(file: &str, row: u64) -> String {
    format!("{file}:{row}")
}

/// The path segments of `path` below `prefix`.
fn relative_parts(path: &Path, prefix: &Path) -> Vec<String> {
    path.prefix_match(prefix).map(|parts| parts.map(|p| p.as_ref().to_string()).collect()).unwrap_or_default()
}

/// Hive/Spark convention: names starting with `_` or `.` (`_SUCCESS`, `_temporary/`, `.crc`) are not data.
fn hidden(relative: &[String]) -> bool {
    relative.iter().any(|p| p.starts_with(['_', '.']))
}
