//! JSONL input files (OpenAI Batch request lines): scanned once when the input is opened (line count and a byte
//! offset every [`CHECKPOINT_LINES`] lines, the whole file streamed, never held), then read a unit at a time from
//! the checkpoint before the unit's first line. Every read is pinned to the e_tag the scan saw, as Parquet files
//! are. A line is parsed by [`super::openai_batch`]; a bad one is a row error.

use futures::StreamExt;
use object_store::{GetOptions, ObjectMeta, ObjectStore};
use std::sync::Arc;
use tokio::sync::mpsc;

use super::openai_batch;
use super::{default_id, id_name, InputFormat, Location, SourceError, SourceRow, BATCH_ROWS};
use crate::job::LineRules;
use crate::plan::{PlannedFile, Unit};
use crate::row::{ErrorCode, RowError, RowTag};

/// Lines between two remembered byte offsets: a unit's read starts at most this many lines before it.
pub(super) const CHECKPOINT_LINES: u64 = 1024;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The longest line kept; a longer one is an error row (OpenAI's own limit on a whole request file is 200 MB).
const MAX_LINE_BYTES: usize = 16 << 20;

#[derive(Debug)]
struct JsonlFile {
    pub meta: ObjectMeta,
    pub url: String,
    pub id_name: String,
    pub lines: u64,
    /// The byte offset of line `k * CHECKPOINT_LINES`, for every k.
    pub checkpoints: Vec<u64>,
}

/// An OpenAI Batch input: its request files, and which lines the job runs.
#[derive(Debug)]
pub(super) struct JsonlInput {
    files: Vec<JsonlFile>,
    rules: LineRules,
}

impl JsonlInput {
    /// Scans the listed files ([`scan`]).
    pub(super) async fn open(location: &Location, metas: Vec<ObjectMeta>, rules: &LineRules) -> Result<JsonlInput, SourceError> {
        let mut files = Vec::with_capacity(metas.len());
        for meta in metas {
            let url = location.display(&meta.location);
            let id_name = id_name(&meta.location, &location.path);
            files.push(scan(&location.store, meta, url, id_name).await?);
        }
        Ok(JsonlInput { files, rules: rules.clone() })
    }
}

impl InputFormat for JsonlInput {
    fn snapshot(&self) -> Vec<PlannedFile> {
        self.files.iter().map(|f| PlannedFile { path: f.meta.location.to_string(), size: f.meta.size, e_tag: f.meta.e_tag.clone(), rows: f.lines }).collect()
    }

    fn file_urls(&self) -> Vec<String> {
        self.files.iter().map(|f| f.url.clone()).collect()
    }

    fn total_rows(&self) -> u64 {
        self.files.iter().map(|f| f.lines).sum()
    }

    async fn check_whole(&self, store: &Arc<dyn ObjectStore>) -> Result<(), SourceError> {
        check_lines(store, &self.files, &self.rules).await
    }

    /// A request line is mostly its prompt: the file's bytes shared evenly among its lines.
    fn prompt_bytes(&self, file: usize, _first_row: u64, rows: u32) -> u64 {
        self.files.get(file).map_or(0, |f| f.meta.size * rows as u64 / f.lines.max(1))
    }

    async fn stream_unit(&self, store: &Arc<dyn ObjectStore>, unit: &Unit, tx: &mpsc::Sender<Vec<SourceRow>>) -> Result<bool, SourceError> {
        let file = self.files.get(unit.file).ok_or_else(|| SourceError::NotFound { url: format!("input file {} of the plan", unit.file) })?;
        stream_unit(store, file, &self.rules, unit, tx).await
    }
}

fn fetch_err(url: &str, e: object_store::Error) -> SourceError {
    match e {
        object_store::Error::Precondition { .. } => SourceError::Changed { url: url.into() },
        source => SourceError::Fetch { url: url.into(), source },
    }
}

async fn bytes_from(store: &Arc<dyn ObjectStore>, meta: &ObjectMeta, url: &str, start: u64) -> Result<futures::stream::BoxStream<'static, object_store::Result<bytes::Bytes>>, SourceError> {
    if start >= meta.size {
        return Ok(futures::stream::empty().boxed());
    }
    let options = GetOptions::new().with_range(Some(start..meta.size)).with_if_match(meta.e_tag.clone());
    let got = store.get_opts(&meta.location, options).await.map_err(|e| fetch_err(url, e))?;
    Ok(got.into_stream())
}

/// Counts a file's lines and remembers its checkpoints, streaming it once.
async fn scan(store: &Arc<dyn ObjectStore>, meta: ObjectMeta, url: String, id_name: String) -> Result<JsonlFile, SourceError> {
    let mut stream = bytes_from(store, &meta, &url, 0).await?;
    let (mut lines, mut checkpoints, mut position) = (0u64, vec![0u64], 0u64);
    let mut last = b'\n';
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| fetch_err(&url, e))?;
        for (i, &b) in chunk.iter().enumerate() {
            if b == b'\n' {
                lines += 1;
                if lines % CHECKPOINT_LINES == 0 {
                    checkpoints.push(position + i as u64 + 1);
                }
            }
        }
        position += chunk.len() as u64;
        last = chunk.last().copied().unwrap_or(last);
    }
    if last != b'\n' {
        // A last line without its newline.
        lines += 1;
    }
    Ok(JsonlFile { meta, url, id_name, lines, checkpoints })
}

/// Lines of a byte stream, the last one even without its newline; a line past [`MAX_LINE_BYTES`] comes as `None`.
struct Lines {
    buffer: Vec<u8>,
    too_long: bool,
}

impl Lines {
    fn new() -> Lines {
        Lines { buffer: Vec::new(), too_long: false }
    }

    fn push(&mut self, chunk: &[u8], out: &mut Vec<Option<Vec<u8>>>) {
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.take(&rest[..end], out);
            rest = &rest[end + 1..];
        }
        self.append(rest);
    }

    fn append(&mut self, bytes: &[u8]) {
        if self.too_long || self.buffer.len() + bytes.len() > MAX_LINE_BYTES {
            self.too_long = true;
            self.buffer.clear();
        } else {
            self.buffer.extend_from_slice(bytes);
        }
    }

    fn take(&mut self, tail: &[u8], out: &mut Vec<Option<Vec<u8>>>) {
        self.append(tail);
        let line = std::mem::take(&mut self.buffer);
        out.push((!std::mem::replace(&mut self.too_long, false)).then_some(line));
    }

    /// The last line, if the stream did not end with a newline.
    fn finish(mut self, out: &mut Vec<Option<Vec<u8>>>) {
        if !self.buffer.is_empty() || self.too_long {
            self.take(&[], out);
        }
    }
}

/// A file's lines from a line on, read from the checkpoint before it.
struct LineStream {
    stream: futures::stream::BoxStream<'static, object_store::Result<bytes::Bytes>>,
    lines: Option<Lines>,
    ready: std::collections::VecDeque<Option<Vec<u8>>>,
    /// The number of the next line `ready` or the stream gives.
    number: u64,
    first_line: u64,
    url: String,
}

impl LineStream {
    async fn open(store: &Arc<dyn ObjectStore>, file: &JsonlFile, first_line: u64) -> Result<LineStream, SourceError> {
        let checkpoint = (first_line / CHECKPOINT_LINES) as usize;
        let start = *file.checkpoints.get(checkpoint).ok_or_else(|| SourceError::Changed { url: file.url.clone() })?;
        let stream = bytes_from(store, &file.meta, &file.url, start).await?;
        let number = checkpoint as u64 * CHECKPOINT_LINES;
        Ok(LineStream { stream, lines: Some(Lines::new()), ready: Default::default(), number, first_line, url: file.url.clone() })
    }

    /// The next line at or after the first asked for, with its number; `None` at the end of the file.
    async fn next(&mut self) -> Result<Option<(u64, Option<Vec<u8>>)>, SourceError> {
        loop {
            while let Some(mut line) = self.ready.pop_front() {
                let n = self.number;
                self.number += 1;
                // A UTF-8 byte-order mark (Windows editors write one) is not part of the first line's JSON.
                if let (0, Some(bytes)) = (n, line.as_mut()) {
                    if bytes.starts_with(UTF8_BOM) {
                        bytes.drain(..UTF8_BOM.len());
                    }
                }
                if n >= self.first_line {
                    return Ok(Some((n, line)));
                }
            }
            let Some(lines) = self.lines.as_mut() else { return Ok(None) };
            let mut out = Vec::new();
            match self.stream.next().await {
                Some(chunk) => lines.push(&chunk.map_err(|e| fetch_err(&self.url, e))?, &mut out),
                None => self.lines.take().expect("open").finish(&mut out),
            }
            self.ready.extend(out);
        }
    }
}

/// Refuses duplicate `custom_id`s over every file, naming the first few (lines without one get default ids); and
/// a request file none of whose lines names the model the job runs (`rules.model`), every row of which would be a
/// `model_mismatch` row, with the counts per model name and the key to set. Lines of other models beside lines of
/// this one are counted in a warning.
async fn check_lines(store: &Arc<dyn ObjectStore>, files: &[JsonlFile], rules: &LineRules) -> Result<(), SourceError> {
    let mut seen: std::collections::HashMap<String, (usize, u64)> = std::collections::HashMap::new();
    let (mut count, mut examples) = (0u64, Vec::new());
    let (mut ours, mut others) = (0u64, std::collections::BTreeMap::<String, u64>::new());
    for (index, file) in files.iter().enumerate() {
        let mut lines = LineStream::open(store, file, 0).await?;
        while let Some((n, line)) = lines.next().await? {
            let (id, model) = line.map_or((None, None), |l| openai_batch::id_and_model(&String::from_utf8_lossy(&l)));
            match (&rules.model, model) {
                (Some(expected), Some(m)) if &m != expected => *others.entry(m).or_default() += 1,
                (Some(_), Some(_)) => ours += 1,
                _ => {}
            }
            let id = id.unwrap_or_else(|| default_id(&file.id_name, n));
            match seen.get(&id) {
                Some(&(first_file, first_line)) => {
                    count += 1;
                    if examples.len() < 5 {
                        examples.push(format!("{} (line {} of `{}` and line {} of `{}`)", crate::row::id_for_message(&id), first_line + 1, files[first_file].url, n + 1, file.url));
                    }
                }
                None => _ = seen.insert(id, (index, n)),
            }
        }
    }
    if count > 0 {
        return Err(SourceError::DuplicateIds { column: "custom_id".into(), count, examples: examples.join(", ") });
    }
    if let (Some(expected), false) = (&rules.model, others.is_empty()) {
        let named = others.iter().map(|(m, n)| format!("{n} name {m:?}")).collect::<Vec<_>>().join(", ");
        let most = others.iter().max_by_key(|(_, n)| **n).map(|(m, _)| m.clone()).unwrap_or_default();
        if ours == 0 {
            return Err(SourceError::OtherModel { expected: expected.clone(), named, most });
        }
        tracing::warn!(expected = %expected, lines = ours, others = %named, "request lines name another model than `input.model`: they will be model_mismatch rows");
    }
    Ok(())
}

/// Streams one unit's lines as rows: its requests, or row errors for the lines that are not. Returns `false`
/// when the receiver is gone.
async fn stream_unit(store: &Arc<dyn ObjectStore>, file: &JsonlFile, rules: &LineRules, unit: &Unit, tx: &mpsc::Sender<Vec<SourceRow>>) -> Result<bool, SourceError> {
    let end = unit.first_row + unit.rows as u64;
    let mut lines = LineStream::open(store, file, unit.first_row).await?;
    let mut batch = Vec::with_capacity(BATCH_ROWS);
    let mut read = 0u32;
    while read < unit.rows {
        let Some((n, line)) = lines.next().await? else { break };
        if n >= end {
            break;
        }
        batch.push(row(file, rules, n, RowTag { unit: unit.id, offset: (n - unit.first_row) as u32 }, line));
        read += 1;
        if batch.len() == BATCH_ROWS && tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH_ROWS))).await.is_err() {
            return Ok(false);
        }
    }
    if read != unit.rows {
        // The plan counted more lines than the file has now: it changed (the e_tag pin catches most changes).
        return Err(SourceError::Changed { url: file.url.clone() });
    }
    if !batch.is_empty() && tx.send(batch).await.is_err() {
        return Ok(false);
    }
    Ok(true)
}

/// One line as a row.
fn row(file: &JsonlFile, rules: &LineRules, n: u64, tag: RowTag, line: Option<Vec<u8>>) -> SourceRow {
    let fallback = || default_id(&file.id_name, n);
    let (id, request) = match line {
        None => (fallback(), Err(RowError::new(ErrorCode::InvalidRequest, format!("line {} is longer than {} MiB", n + 1, MAX_LINE_BYTES >> 20)))),
        Some(bytes) => match std::str::from_utf8(&bytes) {
            Err(_) => (fallback(), Err(RowError::new(ErrorCode::InvalidRequest, format!("line {} is not UTF-8", n + 1)))),
            Ok(text) => {
                let parsed = openai_batch::parse_line(text.trim_end_matches('\r'), rules);
                (parsed.custom_id.unwrap_or_else(fallback), parsed.request)
            }
        },
    };
    match request {
        Ok((prompt, params)) => SourceRow { id, tag, prompt: Ok(prompt), params, completion: None },
        Err(error) => SourceRow { id, tag, prompt: Err(error), params: Default::default(), completion: None },
    }
}
