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
    completion_column: Option<String>,
    /// Per-row overrides of generation parameters: generation key = input column.
    #[serde(default)]
    parameters: std::collections::BTreeMap<String, String>,
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationSection {
    /// Required for generation; scoring jobs (`input.completion_column`) generate nothing.
    max_new_tokens: Option<i64>,
    min_new_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    seed: Option<u64>,
    #[serde(default)]
    stop: Vec<String>,
    #[serde(default)]
    stop_token_ids: Vec<i64>,
    include_stop_str_in_output: Option<bool>,
    ignore_eos: Option<bool>,
    n: Option<i64>,
    logprobs: Option<i64>,
    /// A JSON Schema: a path, JSON text, or a TOML table.
    json_schema: Option<toml::Value>,
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
    /// A prompt-scoring job: the column whose text is scored as the completion of each row's prompt (its
    /// log-likelihood), and nothing is generated.
    pub completion_column: Option<String>,
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

/// The Arrow type an input column of a per-row parameter must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    Integer,
    /// An integer or floating-point column.
    Number,
    Bool,
    Text,
    /// A list of strings, or one string.
    TextList,
    /// A list of integers.
    IntegerList,
}

/// Every generation parameter a row may set from an input column, in documentation order.
pub const ROW_PARAMETERS: &[(&str, ParamType)] = &[
    ("max_new_tokens", ParamType::Integer),
    ("min_new_tokens", ParamType::Integer),
    ("temperature", ParamType::Number),
    ("top_p", ParamType::Number),
    ("top_k", ParamType::Integer),
    ("min_p", ParamType::Number),
    ("repetition_penalty", ParamType::Number),
    ("presence_penalty", ParamType::Number),
    ("frequency_penalty", ParamType::Number),
    ("stop", ParamType::TextList),
    ("stop_token_ids", ParamType::IntegerList),
    ("include_stop_str_in_output", ParamType::Bool),
    ("ignore_eos", ParamType::Bool),
    ("seed", ParamType::Integer),
    ("n", ParamType::Integer),
    ("logprobs", ParamType::Integer),
    ("json_schema", ParamType::Text),
];

/// One per-row parameter value as read from its column, before its range check.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamValue {
    Integer(i64),
    Number(f64),
    Bool(bool),
    Text(String),
    TextList(Vec<String>),
    IntegerList(Vec<i64>),
}

/// Checks one per-row value with the job file's rule for its key and sets it; the error says what is wrong.
pub fn set_row_param(params: &mut crate::row::RowParams, key: &str, value: ParamValue) -> Result<(), String> {
    use ParamValue as V;
    match (key, value) {
        ("max_new_tokens", V::Integer(v)) => params.max_new_tokens = Some(check_max_new_tokens(v)?),
        ("min_new_tokens", V::Integer(v)) => params.min_new_tokens = Some(check_min_new_tokens(v)?),
        ("temperature", V::Number(v)) => params.temperature = Some(check_temperature(v)?),
        ("top_p", V::Number(v)) => params.top_p = Some(check_top_p(v)?),
        ("top_k", V::Integer(v)) => params.top_k = Some(check_top_k(v)?),
        ("min_p", V::Number(v)) => params.min_p = Some(check_min_p(v)?),
        ("repetition_penalty", V::Number(v)) => params.repetition_penalty = Some(check_repetition_penalty(v)?),
        ("presence_penalty", V::Number(v)) => params.presence_penalty = Some(check_penalty(v)?),
        ("frequency_penalty", V::Number(v)) => params.frequency_penalty = Some(check_penalty(v)?),
        ("stop", V::TextList(v)) => params.stop = Some(check_stop(v)?),
        ("stop_token_ids", V::IntegerList(v)) => params.stop_token_ids = Some(check_token_ids(&v)?),
        ("include_stop_str_in_output", V::Bool(v)) => params.include_stop_str_in_output = Some(v),
        ("ignore_eos", V::Bool(v)) => params.ignore_eos = Some(v),
        ("seed", V::Integer(v)) if v >= 0 => params.seed = Some(v as u64),
        ("seed", V::Integer(v)) => return Err(format!("must be >= 0, got {v}")),
        ("n", V::Integer(v)) => params.n = Some(check_n(v)?),
        ("logprobs", V::Integer(v)) => params.logprobs = Some(check_logprobs(v)?),
        ("json_schema", V::Text(v)) => params.json_schema = Some(check_json_schema(&v)?),
        (key, value) => return Err(format!("cannot take {value:?} (not a per-row parameter of this type: {key})")),
    }
    Ok(())
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

/// Sampling and stopping parameters, valid by construction. The names and meanings follow vLLM's
/// `SamplingParams`. Parameters at their defaults are left out of the serialized form (the job fingerprint and the
/// manifest), so adding a parameter never changes the fingerprint of a job that does not use it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GenerationParams {
    pub max_new_tokens: u32,
    /// End tokens and stop strings are ignored until this many tokens were generated.
    #[serde(skip_serializing_if = "is_zero")]
    pub min_new_tokens: u32,
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables it.
    #[serde(skip_serializing_if = "is_zero_f32")]
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of tokens in the prompt or the output; 1 disables it.
    #[serde(skip_serializing_if = "is_one")]
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token already in the output.
    #[serde(skip_serializing_if = "is_zero_f32")]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it is already in the output.
    #[serde(skip_serializing_if = "is_zero_f32")]
    pub frequency_penalty: f32,
    /// Job seed; each row's seed derives from (seed, row id), so a row's sample does not depend on its batch.
    pub seed: u64,
    pub stop: Vec<String>,
    /// Token ids that end generation (beside the model's end tokens).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Keep the stop string that ended generation at the end of the text.
    #[serde(skip_serializing_if = "is_false")]
    pub include_stop_str_in_output: bool,
    /// Go on past the model's end tokens (until `max_new_tokens`, a stop string or a stop token id).
    #[serde(skip_serializing_if = "is_false")]
    pub ignore_eos: bool,
    /// Choices generated per prompt, all from one prefill of it.
    #[serde(skip_serializing_if = "is_one_u32")]
    pub n: u32,
    /// Report each output token's log-probability and this many most likely alternatives (0: the chosen token
    /// only); `None` reports none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// A JSON Schema (as JSON text) that every output must satisfy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<String>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn is_one_u32(v: &u32) -> bool {
    *v == 1
}

fn is_zero_f32(v: &f32) -> bool {
    *v == 0.0
}

fn is_one(v: &f32) -> bool {
    *v == 1.0
}

fn is_false(v: &bool) -> bool {
    !*v
}

impl Default for GenerationParams {
    /// Greedy decoding of up to 16 tokens, every other parameter off.
    fn default() -> Self {
        GenerationParams {
            max_new_tokens: 16,
            min_new_tokens: 0,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            ignore_eos: false,
            n: 1,
            logprobs: None,
            json_schema: None,
        }
    }
}

impl GenerationParams {
    /// The parameters for one row: the job's, with the row's own values where it sets them. Err when the
    /// combination is invalid (a `min_new_tokens` above `max_new_tokens`).
    pub fn for_row(&self, row: &crate::row::RowParams) -> Result<GenerationParams, String> {
        let p = GenerationParams {
            max_new_tokens: row.max_new_tokens.unwrap_or(self.max_new_tokens),
            min_new_tokens: row.min_new_tokens.unwrap_or(self.min_new_tokens),
            temperature: row.temperature.unwrap_or(self.temperature),
            top_p: row.top_p.unwrap_or(self.top_p),
            top_k: row.top_k.unwrap_or(self.top_k),
            min_p: row.min_p.unwrap_or(self.min_p),
            repetition_penalty: row.repetition_penalty.unwrap_or(self.repetition_penalty),
            presence_penalty: row.presence_penalty.unwrap_or(self.presence_penalty),
            frequency_penalty: row.frequency_penalty.unwrap_or(self.frequency_penalty),
            seed: row.seed.unwrap_or(self.seed),
            stop: row.stop.clone().unwrap_or_else(|| self.stop.clone()),
            stop_token_ids: row.stop_token_ids.clone().unwrap_or_else(|| self.stop_token_ids.clone()),
            include_stop_str_in_output: row.include_stop_str_in_output.unwrap_or(self.include_stop_str_in_output),
            ignore_eos: row.ignore_eos.unwrap_or(self.ignore_eos),
            n: row.n.unwrap_or(self.n),
            logprobs: row.logprobs.or(self.logprobs),
            json_schema: row.json_schema.clone().or_else(|| self.json_schema.clone()),
        };
        p.check()?;
        Ok(p)
    }

    /// Rules between parameters.
    fn check(&self) -> Result<(), String> {
        if self.min_new_tokens > self.max_new_tokens {
            return Err(format!("min_new_tokens ({}) is above max_new_tokens ({})", self.min_new_tokens, self.max_new_tokens));
        }
        Ok(())
    }

    /// Whether a penalty needs the output's token counts.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether a row's next token is simply the most likely one: no sampling, penalties, constraint or
    /// log-probabilities to compute (the engine's fast path).
    pub fn is_plain_greedy(&self) -> bool {
        (self.temperature == 0.0 || self.top_k == 1) && !self.has_penalties() && self.logprobs.is_none()
            && self.json_schema.is_none()
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

pub fn check_min_new_tokens(n: i64) -> Result<u32, String> {
    if (0..=MAX_NEW_TOKENS_LIMIT as i64).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!("must be in 0..={MAX_NEW_TOKENS_LIMIT}, got {n}"))
    }
}

pub fn check_min_p(p: f64) -> Result<f32, String> {
    if (0.0..=1.0).contains(&p) {
        Ok(p as f32)
    } else {
        Err(format!("must be in [0, 1], got {p}"))
    }
}

pub fn check_repetition_penalty(p: f64) -> Result<f32, String> {
    if p.is_finite() && p > 0.0 {
        Ok(p as f32)
    } else {
        Err(format!("must be a number > 0 (1 disables it), got {p}"))
    }
}

/// Presence and frequency penalties, in OpenAI's and vLLM's range.
pub fn check_penalty(p: f64) -> Result<f32, String> {
    if (-2.0..=2.0).contains(&p) {
        Ok(p as f32)
    } else {
        Err(format!("must be in [-2, 2], got {p}"))
    }
}

pub fn check_stop(stop: Vec<String>) -> Result<Vec<String>, String> {
    match stop.iter().position(|s| s.is_empty()) {
        Some(i) => Err(format!("entry {i} is an empty string")),
        None => Ok(stop),
    }
}

/// Token ids are checked against the model's vocabulary when the model is loaded.
pub fn check_token_ids(ids: &[i64]) -> Result<Vec<u32>, String> {
    ids.iter().map(|&id| u32::try_from(id).map_err(|_| format!("must be token ids (>= 0), got {id}"))).collect()
}

/// Choices per prompt; the engine also needs `n <= runtime.max_seqs`.
pub const MAX_N: u32 = 128;

pub fn check_n(n: i64) -> Result<u32, String> {
    if (1..=MAX_N as i64).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!("must be in 1..={MAX_N}, got {n}"))
    }
}

/// Alternatives reported per token, as OpenAI's `top_logprobs` and vLLM's default `max_logprobs`.
pub const MAX_LOGPROBS: u32 = 20;

pub fn check_logprobs(n: i64) -> Result<u32, String> {
    if (0..=MAX_LOGPROBS as i64).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!("must be in 0..={MAX_LOGPROBS}, got {n}"))
    }
}

/// A JSON Schema given as text: it must be a JSON object (whether the grammar engine supports it is checked
/// when it is compiled). Returns it compact, so equal schemas share one compiled grammar.
pub fn check_json_schema(text: &str) -> Result<String, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v.to_string()),
        Ok(_) => Err("must be a JSON object (a JSON Schema)".into()),
        Err(e) => Err(format!("is not valid JSON: {e}")),
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

impl DeviceChoice {
    /// `auto`, `cpu`, `cuda` (cuda:0) or `cuda:N`, as `runtime.device` and `--device` take it.
    pub fn parse(text: &str) -> Result<DeviceChoice, String> {
        match text {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => Ok(DeviceChoice::Cuda(n)),
                None => Err(format!("must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {other:?}")),
            },
        }
    }
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

/// Parameters the seq2seq engine does not implement (it samples with temperature, top-k, top-p and the penalties).
const SEQ2SEQ_UNSUPPORTED: &[&str] = &["n", "logprobs", "json_schema", "stop_token_ids", "ignore_eos", "min_new_tokens"];

/// The `[generation]` section, checked key by key.
fn generation_params(
    g: GenerationSection,
    scoring: bool,
    kind: JobKind,
    invalid: &dyn Fn(&'static str, String) -> JobError,
) -> Result<GenerationParams, JobError> {
    let d = GenerationParams::default();
    if scoring {
        for (set, key) in [
            (g.max_new_tokens.is_some(), "generation.max_new_tokens"),
            (g.n.is_some(), "generation.n"),
            (g.json_schema.is_some(), "generation.json_schema"),
            (g.temperature.is_some(), "generation.temperature"),
            (!g.stop.is_empty(), "generation.stop"),
        ] {
            if set {
                return Err(invalid(key, "has no meaning for a scoring job (`input.completion_column`): nothing is generated".into()));
            }
        }
    }
    if kind == JobKind::Seq2seq {
        for (set, key) in [
            (g.n.is_some(), "generation.n"),
            (g.logprobs.is_some(), "generation.logprobs"),
            (g.json_schema.is_some(), "generation.json_schema"),
            (!g.stop_token_ids.is_empty(), "generation.stop_token_ids"),
            (g.ignore_eos.is_some(), "generation.ignore_eos"),
            (g.min_new_tokens.is_some(), "generation.min_new_tokens"),
        ] {
            if set {
                return Err(invalid(key, "is not supported for `kind = \"seq2seq\"` jobs".into()));
            }
        }
    }
    let max_new_tokens = match g.max_new_tokens {
        Some(n) => check_max_new_tokens(n).map_err(|p| invalid("generation.max_new_tokens", p))?,
        None if scoring => 1,
        None => return Err(invalid("generation.max_new_tokens", "is required".into())),
    };
    let json_schema = match g.json_schema {
        None => None,
        Some(v) => Some(json_schema_of(v).map_err(|p| invalid("generation.json_schema", p))?),
    };
    let p = GenerationParams {
        max_new_tokens,
        min_new_tokens: check_min_new_tokens(g.min_new_tokens.unwrap_or(0)).map_err(|p| invalid("generation.min_new_tokens", p))?,
        temperature: check_temperature(g.temperature.unwrap_or(0.0)).map_err(|p| invalid("generation.temperature", p))?,
        top_p: check_top_p(g.top_p.unwrap_or(1.0)).map_err(|p| invalid("generation.top_p", p))?,
        top_k: check_top_k(g.top_k.unwrap_or(0)).map_err(|p| invalid("generation.top_k", p))?,
        min_p: check_min_p(g.min_p.unwrap_or(0.0)).map_err(|p| invalid("generation.min_p", p))?,
        repetition_penalty: check_repetition_penalty(g.repetition_penalty.unwrap_or(1.0))
            .map_err(|p| invalid("generation.repetition_penalty", p))?,
        presence_penalty: check_penalty(g.presence_penalty.unwrap_or(0.0)).map_err(|p| invalid("generation.presence_penalty", p))?,
        frequency_penalty: check_penalty(g.frequency_penalty.unwrap_or(0.0)).map_err(|p| invalid("generation.frequency_penalty", p))?,
        seed: g.seed.unwrap_or(d.seed),
        stop: check_stop(g.stop).map_err(|p| invalid("generation.stop", p))?,
        stop_token_ids: check_token_ids(&g.stop_token_ids).map_err(|p| invalid("generation.stop_token_ids", p))?,
        include_stop_str_in_output: g.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: g.ignore_eos.unwrap_or(false),
        n: check_n(g.n.unwrap_or(1)).map_err(|p| invalid("generation.n", p))?,
        logprobs: g.logprobs.map(check_logprobs).transpose().map_err(|p| invalid("generation.logprobs", p))?,
        json_schema,
    };
    p.check().map_err(|p| invalid("generation.min_new_tokens", p))?;
    Ok(p)
}

/// `generation.json_schema`: a TOML table, JSON text, or the path of a JSON file (relative to the current
/// directory, as every path in a job file).
fn json_schema_of(value: toml::Value) -> Result<String, String> {
    match value {
        toml::Value::Table(t) => {
            let json = serde_json::to_string(&t).map_err(|e| format!("cannot be written as JSON: {e}"))?;
            check_json_schema(&json)
        }
        toml::Value::String(s) if s.trim_start().starts_with('{') => check_json_schema(&s),
        toml::Value::String(s) => {
            let path = Path::new(&s);
            let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
            check_json_schema(&text).map_err(|p| format!("`{}` {p}", path.display()))
        }
        other => Err(format!("must be a table, JSON text or a file path, got a {}", other.type_str())),
    }
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
        let scoring = file.input.completion_column.is_some();
        if let Some(c) = &file.input.completion_column {
            if c.is_empty() {
                return Err(invalid("input.completion_column", "must not be empty".into()));
            }
            if file.kind != JobKind::Generate {
                return Err(invalid("input.completion_column", "needs `kind = \"generate\"` (a decoder scores completions)".into()));
            }
        }
        let g = match (file.kind, file.generation) {
            (JobKind::Generate | JobKind::Seq2seq, Some(g)) => g,
            (JobKind::Generate, None) if scoring => GenerationSection::default(),
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
                GenerationSection { max_new_tokens: Some(1), ..GenerationSection::default() }
            }
        };
        let generation = generation_params(g, scoring, file.kind, &invalid)?;

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
        let mut parameters = ParameterColumns::default();
        for (key, column) in file.input.parameters {
            let Some(&(key, _)) = ROW_PARAMETERS.iter().find(|(k, _)| *k == key) else {
                let known = ROW_PARAMETERS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ");
                return Err(invalid("input.parameters", format!("has an unknown parameter `{key}` (known: {known})")));
            };
            if column.is_empty() {
                return Err(invalid("input.parameters", format!("maps `{key}` to an empty column name")));
            }
            parameters.0.insert(key, column);
        }
        if scoring {
            if let Some((key, _)) = parameters.columns().into_iter().find(|(k, _)| !matches!(*k, "logprobs")) {
                return Err(invalid("input.parameters", format!("maps `{key}`, which has no meaning for a scoring job (`input.completion_column`)")));
            }
        }
        if file.kind == JobKind::Seq2seq {
            if let Some((key, _)) = parameters.columns().into_iter().find(|(k, _)| SEQ2SEQ_UNSUPPORTED.contains(k)) {
                return Err(invalid("input.parameters", format!("maps `{key}`, which `kind = \"seq2seq\"` jobs do not support")));
            }
        }

        let defaults = RuntimeSpec::default();
        let r = file.runtime;
        let device = DeviceChoice::parse(r.device.as_deref().unwrap_or("auto")).map_err(|e| invalid("runtime.device", e))?;
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
                completion_column: file.input.completion_column,
            },
            model: ModelSpec { path: PathBuf::from(model_path), sha256, chat_template },
            generation,
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
            (MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\n[input.parameters]\nmirostat = \"p\""), "mirostat"),
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
        let p = job.generation.for_row(&row).unwrap();
        assert_eq!((p.temperature, p.max_new_tokens, p.top_p, p.seed), (0.5, 3, job.generation.top_p, job.generation.seed));
        assert_eq!(job.generation.for_row(&Default::default()).unwrap(), job.generation);
        let row = crate::row::RowParams { min_new_tokens: Some(20), ..Default::default() };
        let m = job.generation.for_row(&row).unwrap_err();
        assert!(m.contains("min_new_tokens (20) is above max_new_tokens (16)"), "{m}");
    }

    #[test]
    fn every_sampling_parameter_is_read_and_checked() {
        let text = MINIMAL.replace(
            "max_new_tokens = 16",
            "max_new_tokens = 16\nmin_new_tokens = 2\nmin_p = 0.05\nrepetition_penalty = 1.1\npresence_penalty = 0.5\n\
             frequency_penalty = -0.5\nstop_token_ids = [7]\ninclude_stop_str_in_output = true\nignore_eos = true\nn = 4\n\
             logprobs = 3\njson_schema = { type = \"object\", required = [\"a\"] }",
        );
        let g = parse(&text).unwrap().generation;
        assert_eq!((g.min_new_tokens, g.min_p, g.repetition_penalty, g.presence_penalty, g.frequency_penalty), (2, 0.05, 1.1, 0.5, -0.5));
        assert_eq!((g.stop_token_ids, g.include_stop_str_in_output, g.ignore_eos, g.n, g.logprobs), (vec![7], true, true, 4, Some(3)));
        assert_eq!(g.json_schema.as_deref(), Some(r#"{"required":["a"],"type":"object"}"#));
        for (line, key) in [
            ("min_new_tokens = 17", "generation.min_new_tokens"),
            ("min_p = 1.5", "generation.min_p"),
            ("repetition_penalty = 0.0", "generation.repetition_penalty"),
            ("presence_penalty = 2.5", "generation.presence_penalty"),
            ("frequency_penalty = -3.0", "generation.frequency_penalty"),
            ("stop_token_ids = [-1]", "generation.stop_token_ids"),
            ("n = 0", "generation.n"),
            ("logprobs = 21", "generation.logprobs"),
            ("json_schema = \"{not json\"", "generation.json_schema"),
            ("json_schema = \"missing.json\"", "missing.json"),
            ("json_schema = 3", "generation.json_schema"),
        ] {
            let m = message(&MINIMAL.replace("max_new_tokens = 16", &format!("max_new_tokens = 16\n{line}")));
            assert!(m.contains(key), "expected {key} in: {m}");
        }
        // The defaults stay out of the fingerprint's form; a set parameter is in it.
        let plain = serde_json::to_value(&parse(MINIMAL).unwrap().generation).unwrap();
        let mut keys: Vec<String> = plain.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["max_new_tokens", "seed", "stop", "temperature", "top_k", "top_p"]);
        let with_n = serde_json::to_value(&parse(&MINIMAL.replace("max_new_tokens = 16", "max_new_tokens = 16\nn = 2")).unwrap().generation).unwrap();
        assert_eq!(with_n["n"], 2);
    }

    #[test]
    fn row_parameter_values_are_checked_by_the_job_file_rules() {
        use crate::row::RowParams;
        let mut p = RowParams::default();
        set_row_param(&mut p, "stop", ParamValue::TextList(vec!["END".into()])).unwrap();
        set_row_param(&mut p, "ignore_eos", ParamValue::Bool(true)).unwrap();
        set_row_param(&mut p, "json_schema", ParamValue::Text("{ \"type\": \"object\" }".into())).unwrap();
        assert_eq!((p.stop.as_deref(), p.ignore_eos, p.json_schema.as_deref()), (Some(&["END".to_string()][..]), Some(true), Some(r#"{"type":"object"}"#)));
        for (key, value, problem) in [
            ("stop", ParamValue::TextList(vec![String::new()]), "empty string"),
            ("n", ParamValue::Integer(0), "1..="),
            ("min_p", ParamValue::Number(-0.1), "[0, 1]"),
            ("json_schema", ParamValue::Text("[1]".into()), "JSON object"),
            ("stop_token_ids", ParamValue::IntegerList(vec![3, -2]), ">= 0"),
        ] {
            let m = set_row_param(&mut p, key, value).unwrap_err();
            assert!(m.contains(problem), "{key}: {m}");
        }
    }

    #[test]
    fn scoring_jobs_need_no_generation_section_and_refuse_generation_keys() {
        let scoring = MINIMAL.replace("url = \"data/in.parquet\"", "url = \"x\"\ncompletion_column = \"label\"");
        let m = message(&scoring);
        assert!(m.contains("generation.max_new_tokens") && m.contains("scoring"), "{m}");
        let job = parse(&scoring.replace("max_new_tokens = 16", "logprobs = 2")).unwrap();
        assert_eq!((job.input.completion_column.as_deref(), job.generation.logprobs), (Some("label"), Some(2)));
        parse(&scoring.replace("[generation]\nmax_new_tokens = 16\n", "")).unwrap();
        let m = message(&scoring.replace("max_new_tokens = 16", "n = 2"));
        assert!(m.contains("generation.n"), "{m}");
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
