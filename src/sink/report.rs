//! What a report reads from an output: the plan, the commit markers, each committed unit's metrics file (one row)
//! and the columns of its result file that the report summarises (status, error code, finish reason, token counts
//! and timings; never the text). Result files are read column by column with ranged reads (pinned to the version
//! a HEAD found), 8 units at a time, and
//! summarised as they come, so memory does not grow with the output.

use std::collections::HashMap;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, UInt32Type, UInt64Type};
use futures::{StreamExt, TryStreamExt};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::{Marker, Output, SinkError};
use crate::report::{EngineFigures, ReportData, RowStats, UnitFigures};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The result columns a report reads.
const RESULT_COLUMNS: &[&str] =
    &["status", "error", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_s", "tpot_s", "e2e_s", "duplicate_of", "reused_from"];

/// A metrics file's row, by column name: numbers as f64 (null as absent), text as text.
#[derive(Default)]
struct MetricsRow {
    numbers: HashMap<String, f64>,
    text: HashMap<String, String>,
    /// The footer's key/value metadata (`nightshift.job`, `nightshift.model`, `nightshift.version`, ...).
    metadata: HashMap<String, String>,
}

impl MetricsRow {
    fn number(&self, name: &str) -> f64 {
        self.numbers.get(name).copied().unwrap_or(0.0)
    }

    fn count(&self, name: &str) -> u64 {
        self.number(name).max(0.0) as u64
    }
}

fn read_metrics(bytes: bytes::Bytes) -> Result<MetricsRow, BoxError> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)?;
    let mut row = MetricsRow::default();
    if let Some(kv) = builder.metadata().file_metadata().key_value_metadata() {
        row.metadata = kv.iter().filter_map(|kv| Some((kv.key.clone(), kv.value.clone()?))).collect();
    }
    let batch = builder.build()?.next().ok_or("the metrics file has no rows")??;
    if batch.num_rows() == 0 {
        return Err("the metrics file has no rows".into());
    }
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        if column.is_null(0) {
            continue;
        }
        let name = field.name().clone();
        match column.data_type() {
            DataType::UInt64 => _ = row.numbers.insert(name, column.as_primitive::<UInt64Type>().value(0) as f64),
            DataType::Float64 => _ = row.numbers.insert(name, column.as_primitive::<Float64Type>().value(0)),
            DataType::Utf8 => _ = row.text.insert(name, column.as_string::<i32>().value(0).to_string()),
            _ => {}
        }
    }
    Ok(row)
}

fn unit_figures(marker: &Marker, m: &MetricsRow) -> UnitFigures {
    let optional = |name: &str| m.numbers.get(name).copied();
    UnitFigures {
        unit: marker.unit,
        shard: marker.shard,
        attempt: marker.attempt.clone(),
        rows: marker.rows,
        errored_rows: marker.errored_rows,
        prompt_tokens: marker.prompt_tokens,
        completion_tokens: marker.completion_tokens,
        job_s: m.number("job_s"),
        started_unix_s: optional("started_unix_s").filter(|s| *s > 0.0),
        model_load_s: m.number("model_load_s"),
        generation_s: m.number("generation_s"),
        output_tokens_per_s: m.number("output_tokens_per_s"),
        engine: EngineFigures {
            kv_cache_blocks: m.count("kv_cache_blocks"),
            kv_utilisation_peak: optional("kv_utilisation_peak"),
            kv_utilisation_mean: optional("kv_utilisation_mean"),
            preemptions: m.count("preemptions"),
            recomputed_tokens: m.count("recomputed_tokens"),
            cached_prompt_tokens: m.count("cached_prompt_tokens"),
            peak_rss_bytes: m.count("peak_rss_bytes"),
            weights_bytes: m.count("weights_bytes"),
            weights_layout: m.text.get("weights_layout").cloned().unwrap_or_default(),
            kv_cache_dtype: m.text.get("kv_cache_dtype").cloned().unwrap_or_default(),
        },
    }
}

/// Adds a batch of result rows to `stats`: every row to the counts, succeeded rows to the distributions.
fn add_rows(stats: &mut RowStats, batch: &RecordBatch) -> Result<(), BoxError> {
    let text = |name: &str| batch.column_by_name(name).and_then(|c| c.as_string_opt::<i32>());
    let u32s = |name: &str| batch.column_by_name(name).and_then(|c| c.as_primitive_opt::<UInt32Type>());
    let f64s = |name: &str| batch.column_by_name(name).and_then(|c| c.as_primitive_opt::<Float64Type>());
    let status = text("status").ok_or("the result file has no text `status` column")?;
    let code = batch.column_by_name("error").and_then(|c| c.as_struct_opt()).and_then(|s| s.column_by_name("code")).and_then(|c| c.as_string_opt::<i32>());
    let (finish, prompt, cached, completion) = (text("finish_reason"), u32s("prompt_tokens"), u32s("cached_tokens"), u32s("completion_tokens"));
    let (ttft, tpot, e2e) = (f64s("ttft_s"), f64s("tpot_s"), f64s("e2e_s"));
    let (duplicate, reused) = (text("duplicate_of"), batch.column_by_name("reused_from"));
    let value_u32 = |a: Option<&arrow::array::UInt32Array>, i: usize| a.filter(|a| a.is_valid(i)).map(|a| a.value(i));
    let value_f64 = |a: Option<&arrow::array::Float64Array>, i: usize| a.filter(|a| a.is_valid(i)).map(|a| a.value(i));
    for i in 0..batch.num_rows() {
        stats.rows += 1;
        if status.is_valid(i) && status.value(i) == "errored" {
            stats.errored += 1;
            let code = code.filter(|c| c.is_valid(i)).map_or("unknown", |c| c.value(i));
            *stats.errors.entry(code.to_string()).or_default() += 1;
            continue;
        }
        stats.succeeded += 1;
        if reused.is_some_and(|r| r.is_valid(i)) {
            stats.reused += 1;
        }
        // A copy's timings are its original's, counted once.
        let copy = duplicate.is_some_and(|d| d.is_valid(i));
        if copy {
            stats.deduplicated += 1;
        }
        if let Some(reason) = finish.filter(|f| f.is_valid(i)) {
            *stats.finish_reasons.entry(reason.value(i).to_string()).or_default() += 1;
        }
        if let Some(n) = value_u32(prompt, i) {
            stats.prompt_tokens.add(n);
        }
        if let Some(n) = value_u32(completion, i) {
            stats.completion_tokens.add(n);
        }
        stats.cached_tokens += u64::from(value_u32(cached, i).unwrap_or(0));
        if copy {
            continue;
        }
        if let Some(s) = value_f64(ttft, i) {
            stats.ttft_s.add(s);
        }
        if let Some(s) = value_f64(tpot, i) {
            stats.tpot_s.add(s);
        }
        if let Some(s) = value_f64(e2e, i) {
            stats.e2e_s.add(s);
        }
    }
    Ok(())
}

impl Output {
    /// Reads what a report shows. `finalizing`: every unit is committed with its files and the manifest is being
    /// written, so the output reads as complete (otherwise it is complete when `_SUCCESS` is there and no commit
    /// names a missing file). Nothing is written.
    pub async fn report_data(&self, finalizing: bool) -> Result<ReportData, SinkError> {
        let plan = self.read_plan().await?.ok_or_else(|| SinkError::NoPlan { url: self.url().into() })?;
        let success = finalizing || self.is_complete().await?;
        let (markers, damaged_units) = self.whole_markers().await?;
        let mut read = futures::stream::iter(markers.into_values())
            .map(|marker| async move {
                let unit = crate::panics::catch_panic_async(self.read_unit(&marker)).await;
                unit.unwrap_or_else(|panic| Err(SinkError::Read { url: self.display(&marker.results), source: format!("the file does not decode: {panic}").into() }))
            })
            .buffer_unordered(8);
        // The metadata shown is the first unit's.
        let (mut rows, mut units, mut metadata) = (RowStats::default(), Vec::new(), None::<(u32, HashMap<String, String>)>);
        while let Some((figures, stats, kv)) = read.try_next().await? {
            rows.merge(stats);
            if metadata.as_ref().is_none_or(|(first, _)| figures.unit < *first) {
                metadata = Some((figures.unit, kv));
            }
            units.push(figures);
        }
        units.sort_by_key(|u| u.unit);
        let metadata = metadata.map(|(_, kv)| kv).unwrap_or_default();
        Ok(ReportData {
            url: self.url().into(),
            generated_unix_s: crate::host::unix_s(),
            complete: success && damaged_units.is_empty() && units.len() == plan.units.len(),
            damaged_units,
            job_name: metadata.get("nightshift.job").cloned(),
            model: metadata.get("nightshift.model").cloned(),
            written_by: metadata.get("nightshift.version").cloned(),
            plan,
            rows,
            units,
        })
    }

    /// One committed unit: its figures, its rows summarised, and its files' key/value metadata.
    async fn read_unit(&self, marker: &Marker) -> Result<(UnitFigures, RowStats, HashMap<String, String>), SinkError> {
        let metrics = self.read_bytes(&marker.metrics).await?;
        let metrics = read_metrics(metrics).map_err(|source| SinkError::Read { url: self.display(&marker.metrics), source })?;
        let figures = unit_figures(marker, &metrics);
        let read_err = |source: BoxError| SinkError::Read { url: self.display(&marker.results), source };
        let (builder, _) = self.open_parquet(&marker.results).await?;
        let mask = super::status::columns(&builder, RESULT_COLUMNS);
        let mut stream = builder.with_projection(mask).with_batch_size(8192).build().map_err(|e| read_err(e.into()))?;
        let mut stats = RowStats::default();
        while let Some(batch) = stream.try_next().await.map_err(|e| read_err(e.into()))? {
            add_rows(&mut stats, &batch).map_err(read_err)?;
        }
        Ok((figures, stats, metrics.metadata))
    }
}
