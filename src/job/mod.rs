//! The job file: TOML parsed strictly (unknown keys are errors), checked, and resolved into one [`Job`] that
//! every stage receives. Defaults live here and nowhere else.

use std::path::{Path, PathBuf};

use serde::Deserialize;

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

/// What a job does: generate text with a decoder, embed rows with an encoder, or generate with an
/// encoder-decoder.
#[derive(Clone, Copy, Debug, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    #[default]
    Generate,
    /// One vector per row from an encoder-only model (BERT family); no generation.
    Embed,
    /// Generation with an encoder-decoder model (T5 family): the row is the source text, no chat template.
    Seq2seq,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    #[serde(default)]
    kind: JobKind,
    input: InputSection,
    model: ModelSection,
    generation: Option<GenerationSection>,
    output: OutputSection,
    #[serde(default)]
    runtime: RuntimeSection,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputSection {
    url: String,
    id_column: Option<String>,
    prompt_column: Option<String>,
    messages_column: Option<String>,
    system_prompt: Option<String>,
    truncate: Option<String>,
    #[serde(default)]
    parameters: ParametersSection,
}

/// Per-row overrides of generation parameters: generation key = input column.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ParametersSection {
    max_new_tokens: Option<String>,
    temperature: Option<String>,
    top_p: Option<String>,
    top_k: Option<String>,
    seed: Option<String>,
}

impl ParametersSection {
    /// True when no column is mapped.
    fn is_empty(&self) -> bool {
        [&self.max_new_tokens, &self.temperature, &self.top_p, &self.top_k, &self.seed].iter().all(|c| c.is_none())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    path: String,
    sha256: Option<String>,
    #[serde(default = "default_chat_template")]
    chat_template: String,
}

fn default_chat_template() -> String {
    "auto".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationSection {
    max_new_tokens: i64,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<u64>,
    #[serde(default)]
    stop: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputSection {
    url: String,
    unit_rows: Option<i64>,
    shards: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuntimeSection {
    device: Option<String>,
    max_seqs: Option<i64>,
    max_batch_tokens: Option<i64>,
    threads: Option<i64>,
    drain_grace_s: Option<f64>,
    kv_cache_memory: Option<MemoryValue>,
}

/// A size in a job file: bytes as an integer, or a string such as `"4GiB"`, `"512MB"` or `"40%"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MemoryValue {
    Bytes(i64),
    Text(String),
}

/// Where prompts come from and how a row becomes a conversation.
#[derive(Clone, Debug)]
pub struct InputSpec {
    /// A local path, `file://`, `s3://`, `gs://` or `az://` URL: one file, a prefix ending in `/`, or a glob.
    pub url: String,
    /// Unique row id column; when absent, ids are `<file name>:<row number>`.
    pub id_column: Option<String>,
    pub prompt: PromptColumn,
    pub system_prompt: Option<String>,
    /// What to do with a prompt longer than the context allows.
    pub truncate: Truncate,
    /// Input columns that override generation parameters row by row.
    pub parameters: ParameterColumns,
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
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ParameterColumns {
    pub max_new_tokens: Option<String>,
    pub temperature: Option<String>,
    pub top_p: Option<String>,
    pub top_k: Option<String>,
    pub seed: Option<String>,
}

impl ParameterColumns {
    /// (generation key, column) for every mapped parameter.
    pub fn columns(&self) -> Vec<(&'static str, &str)> {
        [
            ("max_new_tokens", &self.max_new_tokens),
            ("temperature", &self.temperature),
            ("top_p", &self.top_p),
            ("top_k", &self.top_k),
            ("seed", &self.seed),
        ]
        .into_iter()
        .filter_map(|(k, c)| c.as_deref().map(|c| (k, c)))
        .collect()
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

/// Sampling and stopping parameters, valid by construction.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GenerationParams {
    pub max_new_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: u32,
    /// Job seed; each row's seed derives from (seed, row id), so a row's sample does not depend on its batch.
    pub seed: u64,
    pub stop: Vec<String>,
}

impl GenerationParams {
    /// The parameters for one row: the job's, with the row's own values where it sets them.
    pub fn for_row(&self, row: &crate::row::RowParams) -> GenerationParams {
        GenerationParams {
            max_new_tokens: row.max_new_tokens.unwrap_or(self.max_new_tokens),
            temperature: row.temperature.unwrap_or(self.temperature),
            top_p: row.top_p.unwrap_or(self.top_p),
            top_k: row.top_k.unwrap_or(self.top_k),
            seed: row.seed.unwrap_or(self.seed),
            stop: self.stop.clone(),
        }
    }
}

/// Range checks shared by the job file and per-row parameter columns, so both give the same message.
pub fn check_max_new_tokens(n: i64) -> Result<u32, String> {
    if n >= 1 && n <= MAX_NEW_TOKENS_LIMIT as i64 {
        Ok(n as u32)
    } else {
        Err(format!("must be in 1..={MAX_NEW_TOKENS_LIMIT}, got {n}"))
    }
}

pub fn check_temperature(t: f64) -> Result<f32, String> {
    if t.is_finite() && t >= 0.0 {
        Ok(t as f32)
    } else {
        Err(format!("must be a number >= 0, got {t}"))
    }
}

pub fn check_top_p(p: f64) -> Result<f32, String> {
    if p > 0.0 && p <= 1.0 {
        Ok(p as f32)
    } else {
        Err(format!("must be in (0, 1], got {p}"))
    }
}

pub fn check_top_k(k: i64) -> Result<u32, String> {
    if (0..=u32::MAX as i64).contains(&k) {
        Ok(k as u32)
    } else {
        Err(format!("must be >= 0 (0 disables it), got {k}"))
    }
}

/// The largest `max_new_tokens` accepted: far beyond any context this runner supports, small enough that a typo
/// (an extra zero or three) is caught.
pub const MAX_NEW_TOKENS_LIMIT: u32 = 1 << 17;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
}

#[derive(Clone, Debug)]
pub struct RuntimeSpec {
    pub device: DeviceChoice,
    /// Sequences decoded together in one step.
    pub max_seqs: usize,
    /// Prompt tokens prefilled in one step (several short prompts are packed together).
    pub max_batch_tokens: usize,
    /// CPU threads for the engine; `None` uses every core.
    pub threads: Option<usize>,
    /// After SIGTERM or SIGINT, how long running sequences may go on to finish their units.
    pub drain_grace: std::time::Duration,
    /// Memory for the KV cache: it bounds how many tokens all running sequences hold together.
    pub kv_cache_memory: MemoryBudget,
}

/// How much memory a job may use for something.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    Bytes(u64),
    /// A fraction of the memory available when the model has loaded (the cgroup's limit counts).
    Fraction(f64),
}

impl MemoryBudget {
    /// The KV cache's default: half of the memory available after the model has loaded.
    pub const DEFAULT_KV: MemoryBudget = MemoryBudget::Fraction(0.5);

    /// Parses `"4GiB"`, `"512 MiB"`, `"2GB"`, `"1000000"`, `"40%"` or `"auto"` (the KV cache's default).
    pub fn parse(text: &str) -> Result<MemoryBudget, String> {
        let t = text.trim();
        if t == "auto" {
            return Ok(MemoryBudget::DEFAULT_KV);
        }
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(p) if p > 0.0 && p <= 100.0 => Ok(MemoryBudget::Fraction(p / 100.0)),
                _ => Err(format!("must be a percentage in (0, 100], got {text:?}")),
            };
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let scale: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(format!("has an unknown unit in {text:?} (use B, KB, MB, GB, KiB, MiB, GiB or a percentage)")),
        };
        match number.parse::<f64>() {
            Ok(n) if n > 0.0 && (n * scale).is_finite() && n * scale >= 1.0 => Ok(MemoryBudget::Bytes((n * scale) as u64)),
            _ => Err(format!("must be \"auto\", a positive size such as \"4GiB\" or a percentage such as \"40%\", got {text:?}")),
        }
    }

    /// Bytes, given the memory available.
    pub fn resolve(self, available: u64) -> u64 {
        match self {
            MemoryBudget::Bytes(b) => b,
            MemoryBudget::Fraction(f) => (available as f64 * f) as u64,
        }
    }
}

impl Default for RuntimeSpec {
    fn default() -> Self {
        RuntimeSpec {
            device: DeviceChoice::Auto,
            max_seqs: 32,
            max_batch_tokens: 2048,
            threads: None,
            drain_grace: std::time::Duration::from_secs(30),
            kv_cache_memory: MemoryBudget::DEFAULT_KV,
        }
    }
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
}

impl Job {
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Job, JobError> {
        let text = std::fs::read_to_string(path).map_err(|source| JobError::Read { path: path.into(), source })?;
        Job::parse(&text, path, overrides)
    }

    pub fn parse(text: &str, path: &Path, overrides: &Overrides) -> Result<Job, JobError> {
        let file: JobFile = toml::from_str(text)
            .map_err(|e| JobError::Parse { path: path.into(), message: e.to_string().trim_end().to_string() })?;
        let invalid = |key: &'static str, problem: String| JobError::Invalid { path: path.into(), key, problem };

        let input_url = overrides.input_url.clone().unwrap_or(file.input.url);
        if input_url.trim().is_empty() {
            return Err(invalid("input.url", "must not be empty".into()));
        }
        let prompt = match (file.input.prompt_column, file.input.messages_column) {
            (Some(_), Some(_)) => {
                return Err(invalid("input.messages_column", "cannot be set together with `input.prompt_column`".into()))
            }
            (None, Some(name)) => PromptColumn::Messages(name),
            (Some(name), None) => PromptColumn::Text(name),
            (None, None) => PromptColumn::Text("prompt".into()),
        };
        if prompt.name().is_empty() {
            return Err(invalid("input.prompt_column", "must not be empty".into()));
        }

        let model_path = overrides.model_path.clone().unwrap_or(file.model.path);
        if model_path.trim().is_empty() {
            return Err(invalid("model.path", "must not be empty".into()));
        }
        let sha256 = match file.model.sha256 {
            Some(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => Some(s.to_ascii_lowercase()),
            Some(s) => return Err(invalid("model.sha256", format!("must be 64 hex digits, got {s:?}"))),
            None => None,
        };
        let chat_template = match file.model.chat_template.as_str() {
            "auto" => ChatTemplateChoice::Auto,
            "none" => ChatTemplateChoice::None,
            other => return Err(invalid("model.chat_template", format!("must be \"auto\" or \"none\", got {other:?}"))),
        };

        if chat_template == ChatTemplateChoice::None {
            if file.input.system_prompt.is_some() {
                return Err(invalid("input.system_prompt", "needs a chat template, but `model.chat_template` is \"none\"".into()));
            }
            if matches!(prompt, PromptColumn::Messages(_)) {
                return Err(invalid("input.messages_column", "needs a chat template, but `model.chat_template` is \"none\"".into()));
            }
        }

        if file.kind == JobKind::Seq2seq {
            for (set, key) in [
                (matches!(prompt, PromptColumn::Messages(_)), "input.messages_column"),
                (file.input.system_prompt.is_some(), "input.system_prompt"),
            ] {
                if set {
                    return Err(invalid(key, "has no meaning for `kind = \"seq2seq\"` jobs (no chat template)".into()));
                }
            }
        }
        let g = match (file.kind, file.generation) {
            (JobKind::Generate | JobKind::Seq2seq, Some(g)) => g,
            (JobKind::Generate | JobKind::Seq2seq, None) => {
                return Err(invalid("generation", "is required: a `[generation]` section with `max_new_tokens`".into()))
            }
            (JobKind::Embed, Some(_)) => return Err(invalid("generation", "has no meaning for `kind = \"embed\"` jobs".into())),
            (JobKind::Embed, None) => {
                for (set, key) in [
                    (matches!(prompt, PromptColumn::Messages(_)), "input.messages_column"),
                    (file.input.system_prompt.is_some(), "input.system_prompt"),
                    (!file.input.parameters.is_empty(), "input.parameters"),
                ] {
                    if set {
                        return Err(invalid(key, "has no meaning for `kind = \"embed\"` jobs".into()));
                    }
                }
                GenerationSection { max_new_tokens: 1, temperature: None, top_p: None, top_k: None, seed: None, stop: Vec::new() }
            }
        };
        let max_new_tokens = check_max_new_tokens(g.max_new_tokens).map_err(|p| invalid("generation.max_new_tokens", p))?;
        let temperature = check_temperature(g.temperature.unwrap_or(0.0)).map_err(|p| invalid("generation.temperature", p))?;
        let top_p = check_top_p(g.top_p.unwrap_or(1.0)).map_err(|p| invalid("generation.top_p", p))?;
        let top_k = check_top_k(g.top_k.unwrap_or(0)).map_err(|p| invalid("generation.top_k", p))?;
        if let Some(i) = g.stop.iter().position(|s| s.is_empty()) {
            return Err(invalid("generation.stop", format!("entry {i} is an empty string")));
        }

        let output_url = overrides.output_url.clone().unwrap_or(file.output.url);
        if output_url.trim().is_empty() {
            return Err(invalid("output.url", "must not be empty".into()));
        }
        let unit_rows = match file.output.unit_rows {
            None => OutputSpec::DEFAULT_UNIT_ROWS,
            Some(n) if (1..=1 << 24).contains(&n) => n as u32,
            Some(n) => return Err(invalid("output.unit_rows", format!("must be in 1..={}, got {n}", 1 << 24))),
        };
        let shards = match overrides.shards.map(i64::from).or(file.output.shards) {
            None => None,
            Some(n) if (1..=100_000).contains(&n) => Some(n as u32),
            Some(n) => return Err(invalid("output.shards", format!("must be in 1..=100000, got {n}"))),
        };
        let truncate = match file.input.truncate.as_deref().unwrap_or("none") {
            "none" => Truncate::None,
            "left" => Truncate::Left,
            "right" => Truncate::Right,
            other => return Err(invalid("input.truncate", format!("must be \"none\", \"left\" or \"right\", got {other:?}"))),
        };
        let p = file.input.parameters;
        let parameters = ParameterColumns {
            max_new_tokens: p.max_new_tokens,
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            seed: p.seed,
        };
        if parameters.columns().iter().any(|(_, c)| c.is_empty()) {
            return Err(invalid("input.parameters", "column names must not be empty".into()));
        }

        let defaults = RuntimeSpec::default();
        let r = file.runtime;
        let device = match r.device.as_deref().unwrap_or("auto") {
            "auto" => DeviceChoice::Auto,
            "cpu" => DeviceChoice::Cpu,
            "cuda" => DeviceChoice::Cuda(0),
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => DeviceChoice::Cuda(n),
                None => return Err(invalid("runtime.device", format!("must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {other:?}"))),
            },
        };
        let positive = |key: &'static str, v: Option<i64>, default: usize| -> Result<usize, JobError> {
            match v {
                None => Ok(default),
                Some(n) if n >= 1 && n <= 1 << 20 => Ok(n as usize),
                Some(n) => Err(invalid(key, format!("must be in 1..={}, got {n}", 1 << 20))),
            }
        };
        let max_seqs = match overrides.max_seqs {
            Some(0) => return Err(invalid("runtime.max_seqs", "must be at least 1, got 0".into())),
            Some(n) => n,
            None => positive("runtime.max_seqs", r.max_seqs, defaults.max_seqs)?,
        };
        let runtime = RuntimeSpec {
            device,
            max_seqs,
            max_batch_tokens: positive("runtime.max_batch_tokens", r.max_batch_tokens, defaults.max_batch_tokens)?,
            threads: match r.threads {
                None => None,
                Some(n) => Some(positive("runtime.threads", Some(n), 1)?),
            },
            drain_grace: match r.drain_grace_s {
                None => defaults.drain_grace,
                Some(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => std::time::Duration::from_secs_f64(s),
                Some(s) => return Err(invalid("runtime.drain_grace_s", format!("must be in 0..=86400 seconds, got {s}"))),
            },
            kv_cache_memory: match &r.kv_cache_memory {
                None => defaults.kv_cache_memory,
                Some(MemoryValue::Bytes(n)) if *n > 0 => MemoryBudget::Bytes(*n as u64),
                Some(MemoryValue::Bytes(n)) => return Err(invalid("runtime.kv_cache_memory", format!("must be positive, got {n}"))),
                Some(MemoryValue::Text(t)) => MemoryBudget::parse(t).map_err(|m| invalid("runtime.kv_cache_memory", m))?,
            },
        };

        Ok(Job {
            file: path.into(),
            kind: file.kind,
            input: InputSpec {
                url: input_url,
                id_column: file.input.id_column,
                prompt,
                system_prompt: file.input.system_prompt,
                truncate,
                parameters,
            },
            model: ModelSpec { path: PathBuf::from(model_path), sha256, chat_template },
            generation: GenerationParams {
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed: g.seed.unwrap_or(0),
                stop: g.stop,
            },
            output: OutputSpec { url: output_url, unit_rows, shards },
            runtime,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[input]
url = "data/in.parquet"
[model]
path = "models/m.gguf"
[generation]
max_new_tokens = 16
[output]
url = "out/"
"#;

    fn parse(text: &str) -> Result<Job, JobError> {
        Job::parse(text, Path::new("job.toml"), &Overrides::default())
    }

    fn message(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn minimal_job_gets_documented_defaults() {
        let job = parse(MINIMAL).unwrap();
        assert_eq!(job.kind, JobKind::Generate);
        assert_eq!(job.input.prompt, PromptColumn::Text("prompt".into()));
        assert_eq!(job.generation.temperature, 0.0);
        assert_eq!(job.generation.top_p, 1.0);
        assert_eq!(job.generation.top_k, 0);
        assert_eq!(job.model.chat_template, ChatTemplateChoice::Auto);
        assert_eq!(job.runtime.max_seqs, RuntimeSpec::default().max_seqs);
    }

    #[test]
    fn unknown_key_is_rejected_by_name() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", "max_new_tokens = 16\ntemprature = 0.5"));
        assert!(m.contains("temprature"), "{m}");
    }

    #[test]
    fn missing_max_new_tokens_is_rejected() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", ""));
        assert!(m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (from, to, key) in [
            ("max_new_tokens = 16", "max_new_tokens = 0", "generation.max_new_tokens"),
            ("max_new_tokens = 16", "max_new_tokens = 16\ntemperature = -1.0", "generation.temperature"),
            ("max_new_tokens = 16", "max_new_tokens = 16\ntop_p = 0.0", "generation.top_p"),
            ("max_new_tokens = 16", "max_new_tokens = 16\nstop = [\"\"]", "generation.stop"),
            ("path = \"models/m.gguf\"", "path = \"m\"\nchat_template = \"chatml\"", "model.chat_template"),
            ("path = \"models/m.gguf\"", "path = \"m\"\nsha256 = \"abc\"", "model.sha256"),
        ] {
            let m = message(&MINIMAL.replace(from, to));
            assert!(m.contains(key), "expected {key} in: {m}");
        }
        let m = message(&format!("{MINIMAL}\n[runtime]\ndevice = \"tpu\""));
        assert!(m.contains("runtime.device"), "{m}");
        let m = message(&format!("{MINIMAL}\n[runtime]\nmax_seqs = 0"));
        assert!(m.contains("runtime.max_seqs"), "{m}");
    }

    #[test]
    fn wrong_type_is_rejected_with_its_location() {
        let m = message(&MINIMAL.replace("max_new_tokens = 16", "max_new_tokens = \"many\""));
        assert!(m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn system_prompt_and_messages_need_a_chat_template() {
        let none = MINIMAL.replace("path = \"models/m.gguf\"", "path = \"m\"\nchat_template = \"none\"");
        parse(&none).unwrap();
        let m = message(&none.replace("url = \"data/in.parquet\"", "url = \"x\"\nsystem_prompt = \"Be brief.\""));
        assert!(m.contains("input.system_prompt") && m.contains("chat template"), "{m}");
        let m = message(&none.replace("url = \"data/in.parquet\"", "url = \"x\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column") && m.contains("chat template"), "{m}");
    }

    #[test]
    fn prompt_and_messages_columns_are_exclusive() {
        let m = message(&MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\nprompt_column = \"p\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column"), "{m}");
    }

    #[test]
    fn reliability_keys_have_defaults_and_are_checked() {
        let job = parse(MINIMAL).unwrap();
        assert_eq!(job.output.unit_rows, OutputSpec::DEFAULT_UNIT_ROWS);
        assert_eq!(job.runtime.drain_grace, std::time::Duration::from_secs(30));
        assert_eq!(job.input.truncate, Truncate::None);
        assert!(job.input.parameters.columns().is_empty());
        let text = MINIMAL
            .replace("url = \"out/\"", "url = \"out/\"\nunit_rows = 100")
            .replace("url = \"data/in.parquet\"", "url = \"x\"\ntruncate = \"left\"\n[input.parameters]\ntemperature = \"t\"\nmax_new_tokens = \"n\"");
        let job = parse(&format!("{text}\n[runtime]\ndrain_grace_s = 2.5")).unwrap();
        assert_eq!(job.output.unit_rows, 100);
        assert_eq!(job.output.shards, None);
        let sharded = parse(&MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 8")).unwrap();
        assert_eq!(sharded.output.shards, Some(8));
        assert_eq!(job.input.truncate, Truncate::Left);
        assert_eq!(job.input.parameters.columns(), vec![("max_new_tokens", "n"), ("temperature", "t")]);
        assert_eq!(job.runtime.drain_grace, std::time::Duration::from_millis(2500));
        for (text, key) in [
            (MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nunit_rows = 0"), "output.unit_rows"),
            (MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 0"), "output.shards"),
            (MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\ntruncate = \"middle\""), "input.truncate"),
            (format!("{MINIMAL}\n[runtime]\ndrain_grace_s = -1.0"), "runtime.drain_grace_s"),
            (MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\n[input.parameters]\nmin_p = \"p\""), "min_p"),
        ] {
            let m = message(&text);
            assert!(m.contains(key), "expected {key} in: {m}");
        }
    }

    #[test]
    fn embed_and_seq2seq_jobs_are_checked_for_what_they_cannot_use() {
        let embed = format!("kind = \"embed\"\n{}", MINIMAL.replace("[generation]\nmax_new_tokens = 16\n", ""));
        assert_eq!(parse(&embed).unwrap().kind, JobKind::Embed);
        let m = message(&format!("kind = \"embed\"\n{MINIMAL}"));
        assert!(m.contains("`generation`") && m.contains("embed"), "{m}");
        let m = message(&embed.replace("url = \"data/in.parquet\"", "url = \"x\"\nmessages_column = \"m\""));
        assert!(m.contains("input.messages_column"), "{m}");
        let m = message(&embed.replace("url = \"data/in.parquet\"", "url = \"x\"\n[input.parameters]\ntemperature = \"t\""));
        assert!(m.contains("input.parameters"), "{m}");
        // A seq2seq job generates, so it needs `[generation]`, but it has no chat template.
        let seq2seq = format!("kind = \"seq2seq\"\n{MINIMAL}");
        assert_eq!(parse(&seq2seq).unwrap().kind, JobKind::Seq2seq);
        let m = message(&seq2seq.replace("url = \"data/in.parquet\"", "url = \"x\"\nsystem_prompt = \"Be brief.\""));
        assert!(m.contains("input.system_prompt") && m.contains("seq2seq"), "{m}");
        // A generation job without `[generation]` is told what is missing.
        let m = message(&MINIMAL.replace("[generation]\nmax_new_tokens = 16\n", ""));
        assert!(m.contains("generation") && m.contains("max_new_tokens"), "{m}");
    }

    #[test]
    fn row_parameters_override_only_what_they_set() {
        let job = parse(MINIMAL).unwrap();
        let row = crate::row::RowParams { temperature: Some(0.5), max_new_tokens: Some(3), ..Default::default() };
        let p = job.generation.for_row(&row);
        assert_eq!((p.temperature, p.max_new_tokens, p.top_p, p.seed), (0.5, 3, job.generation.top_p, job.generation.seed));
        assert_eq!(job.generation.for_row(&Default::default()), job.generation);
    }

    #[test]
    fn overrides_take_precedence() {
        let o = Overrides {
            input_url: Some("s3://b/in.parquet".into()),
            output_url: Some("s3://b/out/".into()),
            model_path: Some("other.gguf".into()),
            max_seqs: Some(3),
            shards: Some(6),
        };
        let job = Job::parse(&MINIMAL.replace("url = \"out/\"", "url = \"out/\"\nshards = 8"), Path::new("job.toml"), &o).unwrap();
        assert_eq!(job.output.shards, Some(6));
        assert_eq!(job.input.url, "s3://b/in.parquet");
        assert_eq!(job.output.url, "s3://b/out/");
        assert_eq!(job.model.path, PathBuf::from("other.gguf"));
        assert_eq!(job.runtime.max_seqs, 3);
    }

    #[test]
    fn kv_cache_memory_takes_sizes_and_percentages() {
        assert_eq!(MemoryBudget::parse("4GiB"), Ok(MemoryBudget::Bytes(4 << 30)));
        assert_eq!(MemoryBudget::parse("512 MiB"), Ok(MemoryBudget::Bytes(512 << 20)));
        assert_eq!(MemoryBudget::parse("1.5GB"), Ok(MemoryBudget::Bytes(1_500_000_000)));
        assert_eq!(MemoryBudget::parse("40%"), Ok(MemoryBudget::Fraction(0.4)));
        assert_eq!(MemoryBudget::parse("1000"), Ok(MemoryBudget::Bytes(1000)));
        assert_eq!(MemoryBudget::parse("auto"), Ok(MemoryBudget::DEFAULT_KV));
        for bad in ["", "0", "-3GB", "4 parsecs", "0%", "150%", "GiB"] {
            assert!(MemoryBudget::parse(bad).is_err(), "{bad}");
        }
        let job = Job::parse(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = \"2GiB\""), Path::new("j.toml"), &Overrides::default()).unwrap();
        assert_eq!(job.runtime.kv_cache_memory, MemoryBudget::Bytes(2 << 30));
        let job = Job::parse(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = 123456"), Path::new("j.toml"), &Overrides::default()).unwrap();
        assert_eq!(job.runtime.kv_cache_memory, MemoryBudget::Bytes(123456));
        let m = message(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = \"lots\""));
        assert!(m.contains("runtime.kv_cache_memory"), "{m}");
        assert_eq!(MemoryBudget::Fraction(0.5).resolve(1000), 500);
    }
}
