//! Arrow record batches of the output files: result rows (generated text or embeddings) and the metrics row.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Builder, RecordBatch, StringBuilder, StructArray, UInt32Builder};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use super::schema::{error_fields, OWN_COLUMNS};
use super::Outcome;
use crate::outcome::{Completion, Reused, RowFailure};
use crate::metrics::{metrics_columns, MetricValue, MetricsRow};
use crate::row::{FinishReason, RowError};

/// The nested columns of one row, as JSON for arrow's JSON decoder: choices, log-probabilities, parameters.
fn nested_json(c: Option<&Completion>) -> serde_json::Value {
    let Some(c) = c else { return serde_json::json!({}) };
    let first = &c.choices[0];
    serde_json::json!({
        "logprobs": first.logprobs,
        "cumulative_logprob": first.cumulative_logprob,
        "choices": (c.choices.len() > 1).then_some(&c.choices),
        "params": c.params.to_json_object(),
    })
}

/// The reuse columns of one row ([`reuse_fields`]), as JSON.
fn reuse_json(row: &Outcome) -> serde_json::Value {
    let (key, duplicate_of) = match row {
        Outcome::Completed(c) => (c.request_key.map(|k| k.hex()), c.duplicate_of.as_deref()),
        Outcome::Embedded(e) => (e.request_key.map(|k| k.hex()), e.duplicate_of.as_deref()),
        Outcome::Reused(r) => (Some(r.key.hex()), None),
        Outcome::Failed(_) => (None, None),
    };
    let reused_from = match row {
        Outcome::Reused(Reused { data: Some(d), .. }) => {
            let [queue_s, ttft_s, e2e_s, tpot_s] = d.timings;
            serde_json::json!({"url": d.url, "id": d.source_id, "queue_s": queue_s, "ttft_s": ttft_s, "e2e_s": e2e_s, "tpot_s": tpot_s})
        }
        _ => serde_json::Value::Null,
    };
    serde_json::json!({"request_key": key, "duplicate_of": duplicate_of, "reused_from": reused_from})
}

/// Columns `fields` of `rows` through arrow's JSON decoder, which builds nested columns from serde values.
fn json_columns(rows: &[Outcome], fields: Vec<arrow::datatypes::FieldRef>, json: impl Fn(&Outcome) -> serde_json::Value) -> Result<Vec<ArrayRef>, arrow::error::ArrowError> {
    let schema = Arc::new(Schema::new(fields));
    let mut decoder = arrow::json::ReaderBuilder::new(schema.clone()).with_batch_size(rows.len().max(1)).build_decoder()?;
    let values: Vec<serde_json::Value> = rows.iter().map(json).collect();
    decoder.serialize(&values)?;
    Ok(match decoder.flush()? {
        Some(batch) => batch.columns().to_vec(),
        None => schema.fields().iter().map(|f| arrow::array::new_empty_array(f.data_type())).collect(),
    })
}

/// A batch whose reused rows (placeholders as built) take every column from their source's row except this
/// run's own ([`OWN_COLUMNS`]).
fn with_reused_rows(batch: RecordBatch, rows: &[Outcome]) -> Result<RecordBatch, arrow::error::ArrowError> {
    let reused: Vec<(usize, &RecordBatch)> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, row)| match row {
            Outcome::Reused(r) => Some(r.data.as_ref().map(|d| (i, &d.row)).ok_or_else(|| wrong_kind(&r.id, "a reused row whose result was not read"))),
            _ => None,
        })
        .collect::<Result<_, _>>()?;
    if reused.is_empty() {
        return Ok(batch);
    }
    let schema = batch.schema();
    let mut columns = batch.columns().to_vec();
    for (c, field) in schema.fields().iter().enumerate() {
        if OWN_COLUMNS.contains(&field.name().as_str()) {
            continue;
        }
        let mut arrays: Vec<&dyn arrow::array::Array> = vec![columns[c].as_ref()];
        let mut indices: Vec<(usize, usize)> = (0..batch.num_rows()).map(|i| (0, i)).collect();
        for (k, (i, source)) in reused.iter().enumerate() {
            let column = source.column_by_name(field.name()).ok_or_else(|| wrong_kind(rows[*i].id(), &format!("reused from a file without a `{}` column", field.name())))?;
            if column.data_type() != field.data_type() {
                return Err(wrong_kind(rows[*i].id(), &format!("reused from a file whose `{}` column has another type", field.name())));
            }
            arrays.push(column.as_ref());
            indices[*i] = (k + 1, 0);
        }
        columns[c] = arrow::compute::interleave(&arrays, &indices)?;
    }
    RecordBatch::try_new(schema, columns)
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

pub(super) fn embeddings_batch(rows: &[Outcome], schema: SchemaRef, dimensions: usize) -> Result<RecordBatch, arrow::error::ArrowError> {
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
            Outcome::Failed(RowFailure { id, error, .. }) => {
                base.errored(id, error);
                vectors.values().append_slice(&vec![0.0; dimensions]);
                vectors.append(false);
                tokens.append_null();
                e2e.append_null();
            }
            Outcome::Reused(r) => {
                // Filled from the source's row.
                base.succeeded(&r.id);
                vectors.values().append_slice(&vec![0.0; dimensions]);
                vectors.append(false);
                tokens.append_null();
                e2e.append_null();
            }
            Outcome::Completed(c) => return Err(wrong_kind(&c.id, "a completion in an embedding job")),
        }
    }
    let mut columns = base.finish(vec![Arc::new(vectors.finish()), Arc::new(tokens.finish()), Arc::new(e2e.finish())])?;
    let reuse_fields: Vec<_> = schema.fields().iter().skip(columns.len()).cloned().collect();
    columns.extend(json_columns(rows, reuse_fields, reuse_json)?);
    with_reused_rows(RecordBatch::try_new(schema, columns)?, rows)
}

pub(super) fn results_batch(rows: &[Outcome], schema: SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
    let n = rows.len();
    let mut base = RowColumns::with_capacity(n);
    let mut text = StringBuilder::new();
    let mut finish = StringBuilder::with_capacity(n, n * 6);
    let mut prompt_tokens = UInt32Builder::with_capacity(n);
    let mut cached_tokens = UInt32Builder::with_capacity(n);
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
                cached_tokens.append_value(c.cached_tokens);
                completion_tokens.append_value(c.completion_tokens());
                queue.append_value(c.queue_s);
                ttft.append_value(c.ttft_s);
                e2e.append_value(c.e2e_s);
                tpot.append_option(c.tpot_s);
            }
            Outcome::Failed(_) | Outcome::Reused(_) => {
                // An errored row has no result; a reused row's comes from its source's row (`with_reused_rows`).
                match row {
                    Outcome::Failed(RowFailure { id, error, .. }) => {
                        base.errored(id, error);
                        finish.append_value(FinishReason::Error.as_str());
                    }
                    _ => {
                        base.succeeded(row.id());
                        finish.append_value(FinishReason::Stop.as_str());
                    }
                }
                text.append_null();
                prompt_tokens.append_null();
                cached_tokens.append_null();
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
        Arc::new(cached_tokens.finish()),
        Arc::new(completion_tokens.finish()),
        Arc::new(queue.finish()),
        Arc::new(ttft.finish()),
        Arc::new(e2e.finish()),
        Arc::new(tpot.finish()),
    ])?;
    // The nested columns through arrow's JSON decoder, which builds lists of structs from serde values.
    let nested_fields: Vec<_> = schema.fields().iter().skip(columns.len()).cloned().collect();
    let mut columns = columns;
    columns.extend(json_columns(rows, nested_fields, |row| {
        let mut value = nested_json(match row {
            Outcome::Completed(c) => Some(c),
            _ => None,
        });
        if let (Some(object), serde_json::Value::Object(reuse)) = (value.as_object_mut(), reuse_json(row)) {
            object.extend(reuse);
        }
        value
    })?);
    with_reused_rows(RecordBatch::try_new(schema, columns)?, rows)
}

/// The one row of a metrics file: a column per entry of [`metrics_columns`], in order.
pub(super) fn metrics_batch(row: &MetricsRow<'_>, schema: SchemaRef) -> Result<RecordBatch, arrow::error::ArrowError> {
    use arrow::array::{Float64Array, StringArray, UInt64Array};
    let columns = metrics_columns()
        .map(|column| match (column.read)(row) {
            MetricValue::UInt64(v) => Arc::new(UInt64Array::from(vec![v])) as ArrayRef,
            MetricValue::Float64(v) => Arc::new(Float64Array::from(vec![v])),
            MetricValue::NullableFloat64(v) => Arc::new(Float64Array::from(vec![v])),
            MetricValue::Utf8(v) => Arc::new(StringArray::from(vec![v])),
        })
        .collect();
    RecordBatch::try_new(schema, columns)
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Float64Type, UInt64Type};

    use super::*;
    use crate::metrics::JobMetrics;

    /// Each column's value has its declared type (the batch would not build otherwise) and comes from its field.
    #[test]
    fn the_metrics_row_is_read_from_its_declaration() {
        let metrics = JobMetrics { rows: 3, job_s: 1.5, ttft_p50_s: Some(0.25), peak_rss_bytes: 9, ..JobMetrics::default() };
        let row = MetricsRow { unit: 7, attempt: "a1", metrics: &metrics };
        let batch = metrics_batch(&row, Arc::new(super::super::metrics_schema())).unwrap();
        let column = |name: &str| batch.column_by_name(name).unwrap().clone();
        assert_eq!(column("unit").as_primitive::<UInt64Type>().value(0), 7);
        assert_eq!(column("attempt").as_string::<i32>().value(0), "a1");
        assert_eq!(column("rows").as_primitive::<UInt64Type>().value(0), 3);
        assert_eq!(column("job_s").as_primitive::<Float64Type>().value(0), 1.5);
        assert_eq!(column("ttft_p50_s").as_primitive::<Float64Type>().value(0), 0.25);
        assert!(column("ttft_p90_s").is_null(0));
        assert_eq!(column("peak_rss_bytes").as_primitive::<UInt64Type>().value(0), 9);
    }
}
