//! The job file: TOML parsed strictly (unknown keys are errors), checked, and resolved into one [`Job`] that
//! every stage receives. Defaults live here and nowhere else.
//!
//! This file holds the resolved job; `file.rs` the job file's sections and their resolution; `generation.rs` the
//! generation parameters, declared once in a table (`declare.rs` holds the macro that reads it); `runtime.rs`
//! the `[runtime]` section: device, batch sizes and memory budgets.

use std::path::PathBuf;

#[macro_use]
mod declare;
mod file;
mod generation;
mod runtime;

pub use generation::{
    set_row_param, GenerationParams, ParamType, ParamValue, Parameter, RowParams, Stored, StoredAs, MAX_LOGPROBS, MAX_N,
    MAX_NEW_TOKENS_LIMIT, PARAMETERS, ROW_PARAMETERS,
};
pub use runtime::{default_model_cache, AttentionChoice, ComputeDtype, CpuKernels, CpuWeights, DeviceChoice, KvCacheDtype, MemoryBudget, RuntimeSpec};

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("cannot read job file `{path}`")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid job file `{path}`: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid job file `{path}`: `{key}` {problem}")]
    Invalid { path: PathBuf, key: &'static str, problem: String },
}

/// Values given on the command line that take precedence over the job file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub input_url: Option<String>,
    pub output_url: Option<String>,
    pub model_path: Option<String>,
    pub max_seqs: Option<usize>,
    /// Overrides `output.shards`.
    pub shards: Option<u32>,
    /// Added to `reuse.from`.
    pub reuse: Vec<String>,
    /// Sets `reuse.allow_incomplete`.
    pub reuse_incomplete: bool,
    /// Override `runtime.attention`, `runtime.dtype` and `runtime.cpu_kernels`.
    pub attention: Option<AttentionChoice>,
    pub dtype: Option<ComputeDtype>,
    pub cpu_kernels: Option<CpuKernels>,
    /// Overrides `runtime.tensor_parallel`.
    pub tensor_parallel: Option<usize>,
}

/// Makes the error for a key of the job file at hand.
type Invalid<'a> = &'a dyn Fn(&'static str, String) -> JobError;

/// What a job does: generate text with a decoder, embed rows with an encoder, or generate with an
/// encoder-decoder.
#[derive(Clone, Copy, Debug, Default, serde::Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    #[default]
    Generate,
    /// One vector per row from an encoder-only model (BERT family); no generation.
    Embed,
    /// Generation with an encoder-decoder model (T5 family): the row is the source text, no chat template.
    Seq2seq,
}

/// Where prompts come from and how a row becomes a conversation.
#[derive(Clone, Debug)]
pub struct InputSpec {
    /// A local path, `file://`, `s3://`, `gs://` or `az://` URL: one file, a prefix ending in `/`, or a glob.
    pub url: String,
    /// Unique row id column; when absent (or null), ids are `<file>:<row number>`, the file by its path below the input's prefix.
    pub id_column: Option<String>,
    pub prompt: PromptColumn,
    pub system_prompt: Option<String>,
    /// What to do with a prompt longer than the context allows.
    pub truncate: Truncate,
    /// Input columns that override generation parameters row by row.
    pub parameters: ParameterColumns,
    /// A prompt-scoring job: the column whose text is scored as the completion of each row's prompt (its
    /// log-likelihood), and nothing is generated.
    pub completion_column: Option<String>,
    /// OpenAI Batch input (JSONL request lines): the endpoint and model lines must name.
    pub openai_batch: Option<LineRules>,
}

/// Prompts longer than the model's context: an error row (the default), or cut to fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncate {
    None,
    /// Drop the start of the last user message (keep its end).
    Left,
    /// Drop the end of the last user message (keep its start).
    Right,
}

/// Optional input columns holding per-row generation parameters; a null value means the job's value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParameterColumns(std::collections::BTreeMap<&'static str, String>);

impl ParameterColumns {
    /// (generation key, column) for every mapped parameter, in [`ROW_PARAMETERS`] order.
    pub fn columns(&self) -> Vec<(&'static str, &str)> {
        ROW_PARAMETERS.iter().filter_map(|(k, _)| self.0.get(k).map(|c| (*k, c.as_str()))).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl serde::Serialize for ParameterColumns {
    /// The first five keys always (null when unmapped), the others only when mapped: job fingerprints from
    /// before the other keys existed stay the same.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        for (key, _) in ROW_PARAMETERS {
            let column = self.0.get(key);
            if column.is_some() || matches!(*key, "max_new_tokens" | "temperature" | "top_p" | "top_k" | "seed") {
                map.serialize_entry(key, &column)?;
            }
        }
        map.end()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptColumn {
    /// A string column holding the user's message.
    Text(String),
    /// A `list<struct<role: string, content: string>>` column holding a whole conversation.
    Messages(String),
}

impl PromptColumn {
    pub fn name(&self) -> &str {
        match self {
            PromptColumn::Text(name) | PromptColumn::Messages(name) => name,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub path: PathBuf,
    /// Expected sha256 of the model file, lower-case hex; checked before loading when given.
    pub sha256: Option<String>,
    pub chat_template: ChatTemplateChoice,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplateChoice {
    /// The template in the model's metadata.
    Auto,
    /// No template: the prompt text is tokenized as it is.
    None,
}

#[derive(Clone, Debug)]
pub struct OutputSpec {
    /// A directory-like location: a local path, `file://`, `s3://`, `gs://` or `az://` URL.
    pub url: String,
    /// Rows per unit: the granule of commits and of resuming after a kill.
    pub unit_rows: u32,
    /// Shards the plan is split into, when the command line does not say (`--shard i/n`, or a scheduler's
    /// array size under `--shard auto`).
    pub shards: Option<u32>,
    /// Written by the run that completes the output, under `OUT/<format>/` (`output.export`).
    pub export: Option<ExportFormat>,
}

/// Formats an output is exported in (`nightshift export`, `output.export`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// OpenAI's Batch API output and error files: `results.jsonl`, `errors.jsonl`.
    OpenaiBatch,
}

impl ExportFormat {
    pub fn name(self) -> &'static str {
        match self {
            ExportFormat::OpenaiBatch => "openai-batch",
        }
    }
}

impl OutputSpec {
    pub const DEFAULT_UNIT_ROWS: u32 = 2048;
}

/// A checked job, ready for the stages.
#[derive(Clone, Debug)]
pub struct Job {
    pub file: PathBuf,
    pub kind: JobKind,
    pub input: InputSpec,
    pub model: ModelSpec,
    pub generation: GenerationParams,
    pub output: OutputSpec,
    pub runtime: RuntimeSpec,
    pub reuse: ReuseSpec,
}

/// `[reuse]`: earlier runs' outputs that serve this run's rows with equal request keys (see `crate::reuse`).
#[derive(Clone, Debug, Default)]
pub struct ReuseSpec {
    pub from: Vec<String>,
    /// Serve from sources without `_SUCCESS` (their committed units).
    pub allow_incomplete: bool,
}

/// Job files for the tests of this module's files.
#[cfg(test)]
mod testing {
    use super::{Job, JobError, Overrides};

    pub(super) const MINIMAL: &str = r#"
[input]
url = "data/in.parquet"
[model]
path = "models/m.gguf"
[generation]
max_new_tokens = 16
[output]
url = "out/"
"#;

    pub(super) fn parse(text: &str) -> Result<Job, JobError> {
        Job::parse(text, std::path::Path::new("job.toml"), &Overrides::default())
    }

    pub(super) fn message(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }
}

/// Which lines of an OpenAI Batch request file (`input.format = "openai-batch"`) a job runs.
#[derive(Clone, Debug)]
pub struct LineRules {
    /// The endpoint every line must name: `/v1/chat/completions` (a job with a chat template),
    /// `/v1/completions` (`chat_template = "none"`) or `/v1/embeddings` (an embed job).
    pub url: &'static str,
    /// The model name lines must give in `body.model`; `None` accepts any.
    pub model: Option<String>,
}
