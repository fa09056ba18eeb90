//! The Arrow schemas of the output files, each described field by field in `schemas/`; the tests below check
//! every file there against the code.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema};

use crate::job::{StoredAs, PARAMETERS};

pub(super) fn error_fields() -> Fields {
    Fields::from(vec![Field::new("code", DataType::Utf8, false), Field::new("message", DataType::Utf8, false)])
}

/// The Arrow schema of the result files, described field by field in `schemas/results.json`.
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
        Field::new("logprobs", logprobs_type(), true),
        Field::new("cumulative_logprob", DataType::Float64, true),
        Field::new("choices", DataType::List(Arc::new(Field::new("item", DataType::Struct(choice_fields()), false))), true),
        Field::new("params", DataType::Struct(params_fields()), true),
    ])
}

/// `List<Struct<token_id, token, logprob, top: List<Struct<token_id, token, logprob>>>>`: per output token.
fn logprobs_type() -> DataType {
    let alternative = Fields::from(vec![
        Field::new("token_id", DataType::UInt32, false),
        Field::new("token", DataType::Utf8, false),
        Field::new("logprob", DataType::Float32, false),
    ]);
    let mut token: Vec<Field> = alternative.iter().map(|f| f.as_ref().clone()).collect();
    token.push(Field::new("top", DataType::List(Arc::new(Field::new("item", DataType::Struct(alternative), false))), false));
    DataType::List(Arc::new(Field::new("item", DataType::Struct(Fields::from(token)), false)))
}

fn choice_fields() -> Fields {
    Fields::from(vec![
        Field::new("index", DataType::UInt32, false),
        Field::new("text", DataType::Utf8, false),
        Field::new("finish_reason", DataType::Utf8, false),
        Field::new("completion_tokens", DataType::UInt32, false),
        Field::new("logprobs", logprobs_type(), true),
        Field::new("cumulative_logprob", DataType::Float64, true),
    ])
}

/// The effective generation parameters of a row, every one of them, as the table in `job` declares them.
fn params_fields() -> Fields {
    PARAMETERS.iter().map(|p| Field::new(p.name, stored_type(p.stored), p.nullable)).collect()
}

fn stored_type(stored: StoredAs) -> DataType {
    let list = |item: DataType| DataType::List(Arc::new(Field::new("item", item, false)));
    match stored {
        StoredAs::UInt32 => DataType::UInt32,
        StoredAs::UInt64 => DataType::UInt64,
        StoredAs::Float32 => DataType::Float32,
        StoredAs::Boolean => DataType::Boolean,
        StoredAs::Utf8 => DataType::Utf8,
        StoredAs::Utf8List => list(DataType::Utf8),
        StoredAs::UInt32List => list(DataType::UInt32),
    }
}

/// The Arrow schema of an embedding job's result files, described field by field in `schemas/embeddings.json`.
pub fn embeddings_schema(dimensions: usize) -> Schema {
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("status", DataType::Utf8, false),
        Field::new("error", DataType::Struct(error_fields()), true),
        Field::new("embedding", DataType::FixedSizeList(item, dimensions as i32), true),
        Field::new("prompt_tokens", DataType::UInt32, true),
        Field::new("e2e_s", DataType::Float64, true),
    ])
}

/// The Arrow schema of the metrics files, described field by field in `schemas/metrics.json`.
pub fn metrics_schema() -> Schema {
    let u = |name: &str| Field::new(name, DataType::UInt64, false);
    let f = |name: &str| Field::new(name, DataType::Float64, false);
    let o = |name: &str| Field::new(name, DataType::Float64, true);
    Schema::new(vec![
        u("unit"),
        Field::new("attempt", DataType::Utf8, false),
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
        f("prefill_s"),
        f("decode_s"),
        o("packing_efficiency"),
        u("kv_cache_blocks"),
        o("kv_utilisation_peak"),
        o("kv_utilisation_mean"),
        u("preemptions"),
        u("recomputed_tokens"),
        u("weights_bytes"),
        u("peak_rss_bytes"),
    ])
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
            DataType::FixedSizeList(item, _) => format!("FixedSizeList<{}, dimensions>", type_name(item.data_type())),
            DataType::List(item) => format!("List<{}>", type_name(item.data_type())),
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
    fn embeddings_schema_matches_schemas_dir() {
        check(&embeddings_schema(384), "embeddings.json");
    }

    #[test]
    fn metrics_schema_matches_schemas_dir() {
        check(&metrics_schema(), "metrics.json");
    }
}
