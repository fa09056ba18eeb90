//! The Arrow schemas of the output files, each described field by field in `schemas/`; the tests below check
//! every file there against the code (and can rewrite it from the code: see `check`).

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema};

use crate::job::{StoredAs, PARAMETERS};
use crate::metrics::{metrics_columns, MetricType};

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
        Field::new("cached_tokens", DataType::UInt32, true),
        Field::new("completion_tokens", DataType::UInt32, false),
        Field::new("queue_s", DataType::Float64, true),
        Field::new("ttft_s", DataType::Float64, true),
        Field::new("e2e_s", DataType::Float64, true),
        Field::new("tpot_s", DataType::Float64, true),
        Field::new("logprobs", logprobs_type(), true),
        Field::new("cumulative_logprob", DataType::Float64, true),
        Field::new("choices", list(DataType::Struct(choice_fields())), true),
        Field::new("params", DataType::Struct(params_fields()), true),
        reuse_fields()[0].clone(),
        reuse_fields()[1].clone(),
        reuse_fields()[2].clone(),
    ])
}

/// The columns every results schema ends with: the row's request key and where its result came from.
pub(super) fn reuse_fields() -> [Field; 3] {
    let f64 = |name: &str| Field::new(name, DataType::Float64, true);
    let reused = Fields::from(vec![
        Field::new("url", DataType::Utf8, false),
        Field::new("id", DataType::Utf8, false),
        f64("queue_s"),
        f64("ttft_s"),
        f64("e2e_s"),
        f64("tpot_s"),
    ]);
    [
        Field::new("request_key", DataType::Utf8, true),
        Field::new("duplicate_of", DataType::Utf8, true),
        Field::new("reused_from", DataType::Struct(reused), true),
    ]
}

/// The columns of a reused row that are this run's own, not copied from its source.
pub(super) const OWN_COLUMNS: &[&str] = &["id", "queue_s", "ttft_s", "e2e_s", "tpot_s", "request_key", "duplicate_of", "reused_from"];

/// `List<item>`, its items never null.
fn list(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, false)))
}

/// `List<Struct<token_id, token, logprob, top: List<Struct<token_id, token, logprob>>>>`: per output token.
fn logprobs_type() -> DataType {
    let alternative = Fields::from(vec![
        Field::new("token_id", DataType::UInt32, false),
        Field::new("token", DataType::Utf8, false),
        Field::new("logprob", DataType::Float32, false),
    ]);
    let mut token: Vec<Field> = alternative.iter().map(|f| f.as_ref().clone()).collect();
    token.push(Field::new("top", list(DataType::Struct(alternative)), false));
    list(DataType::Struct(Fields::from(token)))
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
        reuse_fields()[0].clone(),
        reuse_fields()[1].clone(),
        reuse_fields()[2].clone(),
    ])
}

/// The Arrow schema of the metrics files: a field per column of [`metrics_columns`], which
/// `schemas/metrics.json` describes.
pub fn metrics_schema() -> Schema {
    Schema::new(
        metrics_columns()
            .map(|c| match c.ty {
                MetricType::UInt64 => Field::new(c.name, DataType::UInt64, false),
                MetricType::Float64 => Field::new(c.name, DataType::Float64, false),
                MetricType::NullableFloat64 => Field::new(c.name, DataType::Float64, true),
                MetricType::Utf8 => Field::new(c.name, DataType::Utf8, false),
            })
            .collect::<Vec<_>>(),
    )
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

    /// A documented field of `schemas/`: name, type, nullability, description.
    type Documented = (String, String, bool, String);

    /// Fails when the code's schema and the documented one in `schemas/` disagree in names, types or
    /// nullability, or when a field has no description. `descriptions` gives the ones the code declares, which
    /// the file must have word for word. With `NIGHTSHIFT_BLESS_SCHEMAS=1`, rewrites the file from the code first
    /// (keeping the file's descriptions where the code declares none).
    fn check(schema: &Schema, file: &str, descriptions: &dyn Fn(&str) -> Option<String>) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas").join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        let documented: Vec<Documented> = doc["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let description = f["description"].as_str().unwrap_or_default().to_string();
                (f["name"].as_str().unwrap().into(), f["type"].as_str().unwrap().into(), f["nullable"].as_bool().unwrap(), description)
            })
            .collect();
        let actual: Vec<Documented> = schema
            .fields()
            .iter()
            .map(|f| {
                let name = f.name().clone();
                let kept = documented.iter().find(|d| d.0 == name).map(|d| d.3.clone()).unwrap_or_default();
                let description = descriptions(&name).unwrap_or(kept);
                (name, type_name(f.data_type()), f.is_nullable(), description)
            })
            .collect();
        let rendered = render(&doc, &actual);
        if std::env::var_os("NIGHTSHIFT_BLESS_SCHEMAS").is_some() && rendered != text {
            std::fs::write(&path, &rendered).unwrap();
        } else {
            assert_eq!(actual, documented, "schemas/{file} and the code disagree (NIGHTSHIFT_BLESS_SCHEMAS=1 rewrites it)");
            assert_eq!(rendered, text, "schemas/{file} is not laid out as the code writes it (NIGHTSHIFT_BLESS_SCHEMAS=1)");
        }
        for (name, _, _, description) in &actual {
            assert!(!description.is_empty(), "schemas/{file}: `{name}` has no description");
        }
    }

    /// A schema file as the code writes it: the file's own `file` and `description`, then a field a line.
    fn render(doc: &serde_json::Value, fields: &[Documented]) -> String {
        let string = |s: &str| serde_json::to_string(s).unwrap();
        let lines: Vec<String> = fields
            .iter()
            .map(|(name, ty, nullable, description)| {
                format!(
                    "    {{\"name\": {}, \"type\": {}, \"nullable\": {nullable}, \"description\": {}}}",
                    string(name),
                    string(ty),
                    string(description)
                )
            })
            .collect();
        format!(
            "{{\n  \"file\": {},\n  \"description\": {},\n  \"fields\": [\n{}\n  ]\n}}\n",
            string(doc["file"].as_str().unwrap()),
            string(doc["description"].as_str().unwrap()),
            lines.join(",\n")
        )
    }

    #[test]
    fn results_schema_matches_schemas_dir() {
        check(&results_schema(), "results.json", &|_| None);
    }

    #[test]
    fn embeddings_schema_matches_schemas_dir() {
        check(&embeddings_schema(384), "embeddings.json", &|_| None);
    }

    /// The metrics columns' descriptions are their declarations' doc comments.
    #[test]
    fn metrics_schema_matches_schemas_dir() {
        check(&metrics_schema(), "metrics.json", &|name| metrics_columns().find(|c| c.name == name).map(|c| c.description()));
    }
}
