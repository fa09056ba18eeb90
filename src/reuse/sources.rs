//! Reuse sources: completed outputs of earlier runs whose rows a run copies instead of computing.
//!
//! # The lookup
//! When a run starts, each source's result files are read for two columns only (`status` and `request_key`,
//! with ranged reads, 8 files at a time), and the first 16 bytes of every succeeded row's key go into one sorted
//! array with the row's place (file, row): 24 bytes per source row, no slack, looked up by binary search; the
//! full key is checked again when the row is read. The keys are hashes, so a shard cannot tell which of them it
//! needs without tokenizing its rows first: every shard reads every source key once (64 hex digits per row on
//! the wire, zstd-compressed to about 34 bytes), which for 10 million source rows is about 330 MB read and
//! 240 MB of memory per shard (`BENCHMARKS.md` has the measured figures). A row the index finds is checked in
//! full before it is served ([`Sources::holds`]: its result file read, the last [`CACHED_FILES`] kept, so the rows
//! of one source unit cost one read): a source row whose key shares only the first 16 bytes with the request's (a
//! forged or damaged source) is not served, and the request is computed. Rows are copied out when a unit that
//! reuses them is committed, from the same cached files.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arrow::array::{Array, AsArray, RecordBatch, StructArray};
use arrow::datatypes::Float64Type;
use futures::{StreamExt, TryStreamExt};
use tracing::{info, warn};

use super::RequestKey;
use crate::outcome::{Outcome, ReusedData};
use crate::plan::Fingerprint;
use crate::sink::reuse::ReuseFiles;
use crate::sink::{Output, ResultsLayout, SinkError};

/// Result files of the sources kept decoded for the rows of the next units.
pub const CACHED_FILES: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ReuseError {
    #[error(
        "reuse source `{url}` is incomplete (no `_SUCCESS`): finish it (`nightshift finalize`, or run its job \
         again), or allow it with `reuse.allow_incomplete = true` (`--reuse-incomplete`), which serves its \
         committed units"
    )]
    Incomplete { url: String },
    #[error("reuse source `{url}` has no `_plan.json`: it is not an output of nightshift")]
    NotAnOutput { url: String },
    #[error("reuse source `{url}` cannot be read")]
    Read { url: String, #[source] source: Box<SinkError> },
    #[error("reuse source `{url}`: row {row} of `{file}` does not hold the request key it was indexed with (the file changed mid-run)")]
    Changed { url: String, file: String, row: u32 },
}

/// What the sources hold, for the log and the plan.
#[derive(Clone, Debug, Default)]
pub struct SourcesSummary {
    pub sources: usize,
    /// Sources that serve nothing (another model, template or parameters), with why.
    pub refused: Vec<(String, String)>,
    pub files: usize,
    pub keys: usize,
    /// Files computed with other numerics, which serve nothing.
    pub other_numerics_files: usize,
    pub seconds: f64,
}

pub struct Sources {
    outputs: Vec<Output>,
    /// (output, result file relative to it).
    files: Vec<(usize, String)>,
    /// Sorted by key, one entry per key.
    index: Vec<Entry>,
    cache: Mutex<VecDeque<(u32, Arc<RecordBatch>)>>,
    /// Rows the index found whose full key or status did not match ([`Sources::holds`]).
    mismatched: std::sync::atomic::AtomicU64,
    /// The result columns this run writes: a source file's columns are read as these types.
    schema: arrow::datatypes::SchemaRef,
    pub summary: SourcesSummary,
}

/// A key's first 16 bytes (as two words, so an entry is 24 bytes) and where its row is.
#[derive(Clone, Copy)]
struct Entry {
    key: [u64; 2],
    file: u32,
    row: u32,
}

/// Where a reusable row is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub file: u32,
    pub row: u32,
}

impl Sources {
    /// Opens the sources and reads their keys. A source of another job (model, template, prompt settings or
    /// generation parameters) serves nothing and is named once in the log; so are files of other numerics.
    pub async fn open(urls: &[String], allow_incomplete: bool, ours: &Fingerprint, numerics: &str, layout: ResultsLayout) -> Result<Sources, ReuseError> {
        let started = Instant::now();
        let schema = Arc::new(match layout {
            ResultsLayout::Generate => crate::sink::schema::results_schema(),
            ResultsLayout::Embed { dimensions } => crate::sink::schema::embeddings_schema(dimensions),
        });
        let mut sources = Sources { outputs: Vec::new(), files: Vec::new(), index: Vec::new(), cache: Mutex::default(), mismatched: Default::default(), schema, summary: SourcesSummary::default() };
        sources.summary.sources = urls.len();
        for url in urls {
            let read = |source| ReuseError::Read { url: url.clone(), source: Box::new(source) };
            let output = Output::resolve(url).map_err(read)?;
            let plan = output.read_plan().await.map_err(read)?.ok_or_else(|| ReuseError::NotAnOutput { url: url.clone() })?;
            let files = match output.reuse_files().await.map_err(read)? {
                ReuseFiles::Complete(files) => files,
                ReuseFiles::Incomplete(_) if !allow_incomplete => return Err(ReuseError::Incomplete { url: url.clone() }),
                ReuseFiles::Incomplete(files) => {
                    warn!(source = %url, units = files.len(), "reuse source is incomplete; its committed units serve");
                    files
                }
            };
            // The input snapshot differs from night to night by design; everything else must be the same job.
            let strip = |f: &Fingerprint| Fingerprint { input: Vec::new(), ..f.clone() };
            let differences = strip(&plan.fingerprint).differences(&strip(ours));
            if !differences.is_empty() {
                let why = differences.join("; ");
                warn!(source = %url, differences = %why, "reuse source is of another job; it serves nothing");
                sources.summary.refused.push((url.clone(), why));
                continue;
            }
            // One allocation for the index, sized from the commit markers' counts.
            sources.index.reserve_exact(files.iter().map(|(_, rows)| *rows as usize).sum());
            let files: Vec<String> = files.into_iter().map(|(file, _)| file).collect();
            let o = sources.outputs.len();
            sources.outputs.push(output);
            let first = sources.files.len();
            sources.files.extend(files.into_iter().map(|f| (o, f)));
            let output = &sources.outputs[o];
            let mut read = futures::stream::iter(first..sources.files.len())
                .map(|f| {
                    let relative = sources.files[f].1.clone();
                    async move { output.read_keys(&relative).await.map(|keys| (f, keys)) }
                })
                .buffer_unordered(8);
            let mut other_numerics = 0usize;
            while let Some((f, keys)) = read.try_next().await.map_err(read_err(url))? {
                if keys.numerics.as_deref() != Some(numerics) {
                    other_numerics += 1;
                    continue;
                }
                sources.summary.keys += keys.keys.len();
                sources.index.extend(keys.keys.into_iter().map(|(row, key)| Entry { key, file: f as u32, row }));
            }
            if other_numerics > 0 {
                warn!(source = %url, files = other_numerics, ours = numerics, "result files of the reuse source were computed with other numerics (or before request keys); they serve nothing");
            }
            sources.summary.other_numerics_files += other_numerics;
        }
        // The first source, and the first file of a source, that holds a key serves it.
        sources.index.sort_by_key(|e| (e.key, e.file, e.row));
        sources.index.dedup_by_key(|e| e.key);
        sources.index.shrink_to_fit();
        sources.summary.files = sources.files.len();
        sources.summary.seconds = started.elapsed().as_secs_f64();
        let s = &sources.summary;
        info!(sources = s.sources, refused = s.refused.len(), files = s.files, keys = s.keys, distinct = sources.index.len(),
            seconds = format!("{:.2}", s.seconds), "reuse sources indexed");
        Ok(sources)
    }

    pub fn lookup(&self, key: &RequestKey) -> Option<Found> {
        let key = key.words();
        let i = self.index.binary_search_by_key(&key, |e| e.key).ok()?;
        let e = self.index[i];
        Some(Found { file: e.file, row: e.row })
    }

    /// Whether the row the index `found` for `key` holds that key in full, as a succeeded row, so it may serve
    /// the request. The index compares keys' first 16 bytes; a row whose key shares only those is not served (the
    /// request is computed), counted and named in the log once.
    pub async fn holds(&self, key: &RequestKey, found: Found) -> Result<bool, ReuseError> {
        let batch = self.file(found.file).await?;
        let row = found.row as usize;
        let text = |name: &str| batch.column_by_name(name).and_then(|c| c.as_string_opt::<i32>()).filter(|c| row < c.len() && c.is_valid(row)).map(|c| c.value(row));
        let holds = text("request_key") == Some(key.hex().as_str()) && text("status") == Some("succeeded");
        if !holds && self.mismatched.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
            let (o, relative) = &self.files[found.file as usize];
            warn!(source = %self.outputs[*o].url(), file = %relative, row, "a reuse source row indexed under a request's key holds another key (a forged or damaged source); it is not served, and the request is computed (further ones are counted)");
        }
        Ok(holds)
    }

    /// Rows the index found that [`Sources::holds`] did not serve.
    pub fn mismatched(&self) -> u64 {
        self.mismatched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the results of a unit's reused rows from their sources, a source file at a time (cached). Each file's
    /// rows are copied out of it (`take`), so a unit holds only its own rows, never whole source files.
    pub async fn resolve(&self, rows: &mut [Outcome]) -> Result<(), ReuseError> {
        let mut by_file: std::collections::BTreeMap<u32, Vec<usize>> = std::collections::BTreeMap::new();
        for (i, row) in rows.iter().enumerate() {
            if let Outcome::Reused(r) = row {
                if r.data.is_none() {
                    by_file.entry(r.file).or_default().push(i);
                }
            }
        }
        for (file, places) in by_file {
            let batch = self.file(file).await?;
            let (o, relative) = &self.files[file as usize];
            let url = self.outputs[*o].url().to_string();
            let changed = |row: u32| ReuseError::Changed { url: url.clone(), file: relative.clone(), row };
            let wanted: Vec<u32> = places.iter().map(|&i| match &rows[i] {
                Outcome::Reused(r) => r.row,
                _ => unreachable!("grouped reused rows"),
            }).collect();
            if let Some(&row) = wanted.iter().find(|&&row| row as usize >= batch.num_rows()) {
                return Err(changed(row));
            }
            let taken = arrow::compute::take_record_batch(&batch, &arrow::array::UInt32Array::from(wanted.clone()))
                .map_err(|e| ReuseError::Read { url: url.clone(), source: Box::new(SinkError::Read { url: relative.clone(), source: e.into() }) })?;
            for (k, &i) in places.iter().enumerate() {
                let Outcome::Reused(r) = &mut rows[i] else { unreachable!("grouped reused rows") };
                let one = taken.slice(k, 1);
                let text = |name: &str| one.column_by_name(name).and_then(|c| c.as_string_opt::<i32>()).filter(|c| c.is_valid(0)).map(|c| c.value(0).to_string());
                if text("request_key").as_deref() != Some(r.key.hex().as_str()) || text("status").as_deref() != Some("succeeded") {
                    return Err(changed(wanted[k]));
                }
                let source_id = text("id").unwrap_or_default();
                r.data = Some(Arc::new(ReusedData { url: url.clone(), source_id, timings: timings(&one), row: one }));
            }
        }
        Ok(())
    }

    async fn file(&self, file: u32) -> Result<Arc<RecordBatch>, ReuseError> {
        if let Some((_, batch)) = self.cache.lock().expect("not poisoned").iter().find(|(f, _)| *f == file) {
            return Ok(batch.clone());
        }
        let (o, relative) = &self.files[file as usize];
        let output = &self.outputs[*o];
        let batch = output.read_result_file(relative).await.map_err(read_err(output.url()))?;
        let batch = Arc::new(conform(batch, &self.schema).map_err(|e| ReuseError::Read {
            url: output.url().to_string(),
            source: Box::new(SinkError::Read { url: output.display(relative), source: e.into() }),
        })?);
        let mut cache = self.cache.lock().expect("not poisoned");
        if cache.len() >= CACHED_FILES {
            cache.pop_front();
        }
        cache.push_back((file, batch.clone()));
        Ok(batch)
    }
}

fn read_err(url: &str) -> impl Fn(SinkError) -> ReuseError + '_ {
    move |source| ReuseError::Read { url: url.to_string(), source: Box::new(source) }
}

/// The timings of the run that computed a row: its own columns, or, for a row that was itself reused, those it
/// carried from its source.
fn timings(one: &RecordBatch) -> [Option<f64>; 4] {
    let carried = one.column_by_name("reused_from").and_then(|c| c.as_struct_opt()).filter(|s| s.is_valid(0));
    let value = |name: &str| -> Option<f64> {
        let column = match carried {
            Some(s) => StructArray::column_by_name(s, name),
            None => one.column_by_name(name),
        };
        column.and_then(|c| c.as_primitive_opt::<Float64Type>()).filter(|c| c.is_valid(0)).map(|c| c.value(0))
    };
    ["queue_s", "ttft_s", "e2e_s", "tpot_s"].map(value)
}

/// A source file's columns as this run writes them (`schema`): a column of the same name but another type is cast.
/// A file rewritten by another Parquet writer keeps its data but may spell types differently (pyarrow names a
/// list's items `element`, where arrow-rs says `item`); what cannot be cast is an error naming the column, never
/// a row copied with a type the output's other files do not have.
fn conform(batch: RecordBatch, schema: &arrow::datatypes::Schema) -> Result<RecordBatch, String> {
    let theirs = batch.schema();
    let mut fields = Vec::with_capacity(theirs.fields().len());
    let mut columns = Vec::with_capacity(theirs.fields().len());
    for (field, column) in theirs.fields().iter().zip(batch.columns()) {
        match schema.field_with_name(field.name()) {
            Ok(want) if want.data_type() != field.data_type() => {
                let cast = arrow::compute::cast(column, want.data_type())
                    .map_err(|e| format!("its `{}` column is {}, which cannot be read as this run's {}: {e}", field.name(), field.data_type(), want.data_type()))?;
                fields.push(Arc::new(field.as_ref().clone().with_data_type(want.data_type().clone()).with_nullable(true)));
                columns.push(cast);
            }
            _ => {
                fields.push(field.clone());
                columns.push(column.clone());
            }
        }
    }
    RecordBatch::try_new(Arc::new(arrow::datatypes::Schema::new(fields)), columns).map_err(|e| e.to_string())
}
