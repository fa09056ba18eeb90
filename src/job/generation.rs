//! Generation parameters: the resolved [`GenerationParams`], the per-row values that override them, and the
//! job file's `[generation]` section, with the checks both share.

use std::path::Path;

use serde::Deserialize;

use super::{JobError, JobKind};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GenerationSection {
    /// Required for generation; scoring jobs (`input.completion_column`) generate nothing.
    pub(super) max_new_tokens: Option<i64>,
    pub(super) min_new_tokens: Option<i64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) top_k: Option<i64>,
    pub(super) min_p: Option<f64>,
    pub(super) repetition_penalty: Option<f64>,
    pub(super) presence_penalty: Option<f64>,
    pub(super) frequency_penalty: Option<f64>,
    pub(super) seed: Option<u64>,
    #[serde(default)]
    pub(super) stop: Vec<String>,
    #[serde(default)]
    pub(super) stop_token_ids: Vec<i64>,
    pub(super) include_stop_str_in_output: Option<bool>,
    pub(super) ignore_eos: Option<bool>,
    pub(super) n: Option<i64>,
    pub(super) logprobs: Option<i64>,
    /// A JSON Schema: a path, JSON text, or a TOML table.
    pub(super) json_schema: Option<toml::Value>,
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

/// Parameters the seq2seq engine does not implement (it samples with temperature, top-k, top-p and the penalties).
pub(super) const SEQ2SEQ_UNSUPPORTED: &[&str] = &["n", "logprobs", "json_schema", "stop_token_ids", "ignore_eos", "min_new_tokens"];

/// The `[generation]` section, checked key by key.
pub(super) fn generation_params(
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

#[cfg(test)]
mod tests {
    use super::super::testing::{message, parse, MINIMAL};
    use super::*;

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
}
