//! Generation parameters, declared once. The table below names each parameter with its type, default, per-row
//! column type, check and job-file type, and `generation_parameters!` (in `declare.rs`) generates from it
//! [`GenerationParams`], [`RowParams`], [`set_row_param`], the job file's `[generation]` section and
//! [`PARAMETERS`], from which the source checks per-row columns and the sink builds the results' `params` column.
//!
//! A new parameter takes three edits: its entry in the table, its type in the `params` column of
//! `schemas/results.json` (a test in `sink` checks that file against [`PARAMETERS`];
//! `NIGHTSHIFT_BLESS_SCHEMAS=1 cargo test --lib sink::schema` rewrites it), and its row in docs/job-file.md's table of
//! generation parameters (a test here checks that every parameter has one). Using it is the engine's
//! business; so is adding it to [`SEQ2SEQ_UNSUPPORTED`] when the seq2seq engine does not implement it.

use super::{JobError, JobKind};

generation_parameters! {
    /// 1 to [`MAX_NEW_TOKENS_LIMIT`]; required in the job file, except for scoring jobs.
    max_new_tokens: u32 = 16, from Integer(check_max_new_tokens), file Option<i64>;
    /// End tokens and stop strings are ignored until this many tokens were generated.
    min_new_tokens: u32 = 0, from Integer(check_min_new_tokens), file Option<i64>;
    /// 0 means greedy.
    temperature: f32 = 0.0, from Number(check_temperature), file Option<f64>;
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    top_p: f32 = 1.0, from Number(check_top_p), file Option<f64>;
    /// Keep the k most likely tokens; 0 disables it.
    top_k: u32 = 0, from Integer(check_top_k), file Option<i64>;
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables it.
    min_p: f32 = 0.0, from Number(check_min_p), file Option<f64>;
    /// Divides positive logits (multiplies negative ones) of tokens in the prompt or the output; 1 disables it.
    repetition_penalty: f32 = 1.0, from Number(check_repetition_penalty), file Option<f64>;
    /// Subtracted from the logit of every token already in the output.
    presence_penalty: f32 = 0.0, from Number(check_penalty), file Option<f64>;
    /// Subtracted from a token's logit once per time it is already in the output.
    frequency_penalty: f32 = 0.0, from Number(check_penalty), file Option<f64>;
    /// Strings that end generation.
    stop: Vec<String> = Vec::new(), from TextList(check_stop), file Vec<String>;
    /// Token ids that end generation (beside the model's end tokens).
    stop_token_ids: Vec<u32> = Vec::new(), from IntegerList(check_token_ids), file Vec<i64>;
    /// Keep the stop string that ended generation at the end of the text.
    include_stop_str_in_output: bool = false, from Bool(any_value), file Option<bool>;
    /// Go on past the model's end tokens (until `max_new_tokens`, a stop string or a stop token id).
    ignore_eos: bool = false, from Bool(any_value), file Option<bool>;
    /// Job seed; each row's seed derives from (seed, row id), so a row's sample does not depend on its batch.
    seed: u64 = 0, from Integer(check_seed), file Option<u64>;
    /// Choices generated per prompt, all from one prefill of it.
    n: u32 = 1, from Integer(check_n), file Option<i64>;
    /// Report each output token's log-probability and this many most likely alternatives (0: the chosen token
    /// only); `None` reports none.
    logprobs: Option<u32> = None, from Integer(check_logprobs), file Option<i64>;
    /// A JSON Schema (as JSON text) that every output must satisfy.
    json_schema: Option<String> = None, from Text(check_json_schema), file Option<JsonSchemaSource>;
}

/// One generation parameter, as the table declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parameter {
    pub name: &'static str,
    /// `generation.<name>`: the job file's key, as errors name it.
    pub file_key: &'static str,
    /// The type an input column that overrides it must have.
    pub column: ParamType,
    /// How the results' `params` column stores it, and whether it may be null there.
    pub stored: StoredAs,
    pub nullable: bool,
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

/// One per-row parameter value as read from its column (or from the job file), before its check.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamValue {
    Integer(i64),
    Number(f64),
    Bool(bool),
    Text(String),
    TextList(Vec<String>),
    IntegerList(Vec<i64>),
}

/// How the results' `params` column stores a parameter's value (the sink maps it to an Arrow type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredAs {
    UInt32,
    UInt64,
    Float32,
    Boolean,
    Utf8,
    Utf8List,
    UInt32List,
}

/// The types parameters have, each with how the `params` column stores it; an `Option` is stored nullable.
pub trait Stored {
    const AS: StoredAs;
    const NULLABLE: bool = false;
}

impl Stored for u32 {
    const AS: StoredAs = StoredAs::UInt32;
}

impl Stored for u64 {
    const AS: StoredAs = StoredAs::UInt64;
}

impl Stored for f32 {
    const AS: StoredAs = StoredAs::Float32;
}

impl Stored for bool {
    const AS: StoredAs = StoredAs::Boolean;
}

impl Stored for String {
    const AS: StoredAs = StoredAs::Utf8;
}

impl Stored for Vec<String> {
    const AS: StoredAs = StoredAs::Utf8List;
}

impl Stored for Vec<u32> {
    const AS: StoredAs = StoredAs::UInt32List;
}

impl<T: Stored> Stored for Option<T> {
    const AS: StoredAs = T::AS;
    const NULLABLE: bool = true;
}

/// The type of a `[generation]` key in the job file: whether the file sets it, and its value as a per-row column
/// would give it, so that one check serves both.
pub(super) trait FileValue {
    fn is_given(&self) -> bool;
    fn into_value(self) -> Result<Option<ParamValue>, String>;
}

impl FileValue for Option<i64> {
    fn is_given(&self) -> bool {
        self.is_some()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        Ok(self.map(ParamValue::Integer))
    }
}

impl FileValue for Option<u64> {
    fn is_given(&self) -> bool {
        self.is_some()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        self.map(|v| i64::try_from(v).map(ParamValue::Integer).map_err(|_| format!("must be at most {}, got {v}", i64::MAX)))
            .transpose()
    }
}

impl FileValue for Option<f64> {
    fn is_given(&self) -> bool {
        self.is_some()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        Ok(self.map(ParamValue::Number))
    }
}

impl FileValue for Option<bool> {
    fn is_given(&self) -> bool {
        self.is_some()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        Ok(self.map(ParamValue::Bool))
    }
}

/// An empty list sets nothing: it is the default.
impl FileValue for Vec<String> {
    fn is_given(&self) -> bool {
        !self.is_empty()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        Ok(self.is_given().then_some(ParamValue::TextList(self)))
    }
}

impl FileValue for Vec<i64> {
    fn is_given(&self) -> bool {
        !self.is_empty()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        Ok(self.is_given().then_some(ParamValue::IntegerList(self)))
    }
}

/// `generation.json_schema`: a TOML table, JSON text, or the path of a JSON file (relative to the current
/// directory, as every path in a job file).
#[derive(Debug, serde::Deserialize)]
#[serde(transparent)]
pub(super) struct JsonSchemaSource(toml::Value);

impl FileValue for Option<JsonSchemaSource> {
    fn is_given(&self) -> bool {
        self.is_some()
    }

    fn into_value(self) -> Result<Option<ParamValue>, String> {
        let Some(JsonSchemaSource(value)) = self else { return Ok(None) };
        let text = match value {
            toml::Value::Table(t) => {
                let json = serde_json::to_string(&t).map_err(|e| format!("cannot be written as JSON: {e}"))?;
                compact_json_schema(&json)?
            }
            toml::Value::String(s) if s.trim_start().starts_with('{') => compact_json_schema(&s)?,
            toml::Value::String(s) => {
                let path = std::path::Path::new(&s);
                let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
                compact_json_schema(&text).map_err(|p| format!("`{}` {p}", path.display()))?
            }
            other => return Err(format!("must be a table, JSON text or a file path, got a {}", other.type_str())),
        };
        Ok(Some(ParamValue::Text(text)))
    }
}

/// Parameters the seq2seq engine does not implement (it samples with temperature, top-k, top-p and the penalties).
pub(super) const SEQ2SEQ_UNSUPPORTED: &[&str] = &["n", "logprobs", "json_schema", "stop_token_ids", "ignore_eos", "min_new_tokens"];

/// `[generation]` keys a scoring job (`input.completion_column`) refuses: it generates nothing.
const SCORING_REFUSED: &[&str] = &["max_new_tokens", "n", "json_schema", "temperature", "stop"];

/// Parameters always in the serialized form, even at their defaults: they were before the rule that leaves
/// defaults out, and job fingerprints from then must stay the same.
pub(super) const ALWAYS_SERIALIZED: &[&str] = &["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop"];

/// The `generation.<name>` key of a declared parameter.
pub(super) fn file_key(name: &str) -> &'static str {
    PARAMETERS.iter().find(|p| p.name == name).map(|p| p.file_key).expect("a declared parameter (a bug otherwise)")
}

impl GenerationParams {
    /// The job file's `[generation]` section, checked key by key with the rules of per-row columns.
    pub(super) fn from_section(
        g: GenerationSection,
        scoring: bool,
        kind: JobKind,
        invalid: &dyn Fn(&'static str, String) -> JobError,
    ) -> Result<GenerationParams, JobError> {
        let refuse = |names: &[&str], problem: &str| match names.iter().find(|name| g.is_given(name)) {
            Some(name) => Err(invalid(file_key(name), problem.into())),
            None => Ok(()),
        };
        if scoring {
            refuse(SCORING_REFUSED, "has no meaning for a scoring job (`input.completion_column`): nothing is generated")?;
        }
        if kind == JobKind::Seq2seq {
            refuse(SEQ2SEQ_UNSUPPORTED, "is not supported for `kind = \"seq2seq\"` jobs")?;
        }
        let mut given = RowParams::default();
        if !g.is_given("max_new_tokens") {
            if !scoring {
                return Err(invalid("generation.max_new_tokens", "is required".into()));
            }
            given.max_new_tokens = Some(1);
        }
        for (name, value) in g.into_values() {
            let key = file_key(name);
            if let Some(value) = value.map_err(|p| invalid(key, p))? {
                set_row_param(&mut given, name, value).map_err(|p| invalid(key, p))?;
            }
        }
        GenerationParams::default().for_row(&given).map_err(|p| invalid("generation.min_new_tokens", p))
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

impl serde::Serialize for GenerationParams {
    /// The job fingerprint's form: parameters in table order, at their defaults left out (except
    /// [`ALWAYS_SERIALIZED`]), with one exception to the order: `seed` comes right after `frequency_penalty`,
    /// where it was before the parameters were one table, since a fingerprint's digest hashes this form.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let defaults = GenerationParams::default();
        let mut s = serializer.serialize_struct("GenerationParams", PARAMETERS.len())?;
        for p in PARAMETERS.iter().filter(|p| p.name != "seed") {
            self.serialize_field(p.name, &defaults, &mut s)?;
            if p.name == "frequency_penalty" {
                self.serialize_field("seed", &defaults, &mut s)?;
            }
        }
        s.end()
    }
}

/// The largest `max_new_tokens` accepted: far beyond any context this runner supports, small enough that a typo
/// (an extra zero or three) is caught.
pub const MAX_NEW_TOKENS_LIMIT: u32 = 1 << 17;

/// Choices per prompt; the engine also needs `n <= runtime.max_seqs`.
pub const MAX_N: u32 = 128;

/// Alternatives reported per token, as OpenAI's `top_logprobs` and vLLM's default `max_logprobs`.
pub const MAX_LOGPROBS: u32 = 20;

// The checks of the table, shared by the job file and per-row parameter columns, so both give the same message.

fn check_max_new_tokens(n: i64) -> Result<u32, String> {
    if n >= 1 && n <= MAX_NEW_TOKENS_LIMIT as i64 {
        Ok(n as u32)
    } else {
        Err(format!("must be in 1..={MAX_NEW_TOKENS_LIMIT}, got {n}"))
    }
}

fn check_min_new_tokens(n: i64) -> Result<u32, String> {
    if (0..=MAX_NEW_TOKENS_LIMIT as i64).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!("must be in 0..={MAX_NEW_TOKENS_LIMIT}, got {n}"))
    }
}

// Sampling parameters are computed in f32: each is checked as the f32 it becomes (1e39 is finite in f64, infinite in
// f32), so a row that passes its check cannot fail later (in the engine, or writing its `params` column).

fn check_temperature(t: f64) -> Result<f32, String> {
    let v = t as f32;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a number >= 0 within f32's range, got {t}"))
    }
}

fn check_top_p(p: f64) -> Result<f32, String> {
    if p > 0.0 && p <= 1.0 {
        Ok(p as f32)
    } else {
        Err(format!("must be in (0, 1], got {p}"))
    }
}

fn check_top_k(k: i64) -> Result<u32, String> {
    if (0..=u32::MAX as i64).contains(&k) {
        Ok(k as u32)
    } else {
        Err(format!("must be from 0 (which disables it) to {}, got {k}", u32::MAX))
    }
}

fn check_min_p(p: f64) -> Result<f32, String> {
    if (0.0..=1.0).contains(&p) {
        Ok(p as f32)
    } else {
        Err(format!("must be in [0, 1], got {p}"))
    }
}

fn check_repetition_penalty(p: f64) -> Result<f32, String> {
    let v = p as f32;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a number > 0 within f32's range (1 disables it), got {p}"))
    }
}

/// Presence and frequency penalties, in OpenAI's and vLLM's range.
fn check_penalty(p: f64) -> Result<f32, String> {
    if (-2.0..=2.0).contains(&p) {
        Ok(p as f32)
    } else {
        Err(format!("must be in [-2, 2], got {p}"))
    }
}

fn check_stop(stop: Vec<String>) -> Result<Vec<String>, String> {
    match stop.iter().position(|s| s.is_empty()) {
        Some(i) => Err(format!("entry {i} is an empty string")),
        None => Ok(stop),
    }
}

/// Token ids are checked against the model's vocabulary when the model is loaded.
fn check_token_ids(ids: Vec<i64>) -> Result<Vec<u32>, String> {
    ids.into_iter().map(|id| u32::try_from(id).map_err(|_| format!("must be token ids (>= 0), got {id}"))).collect()
}

/// Every value of its type is valid.
fn any_value<T>(value: T) -> Result<T, String> {
    Ok(value)
}

fn check_seed(seed: i64) -> Result<u64, String> {
    u64::try_from(seed).map_err(|_| format!("must be >= 0, got {seed}"))
}

fn check_n(n: i64) -> Result<u32, String> {
    if (1..=MAX_N as i64).contains(&n) {
        Ok(n as u32)
    } else {
        Err(format!("must be in 1..={MAX_N}, got {n}"))
    }
}

fn check_logprobs(n: i64) -> Result<Option<u32>, String> {
    if (0..=MAX_LOGPROBS as i64).contains(&n) {
        Ok(Some(n as u32))
    } else {
        Err(format!("must be in 0..={MAX_LOGPROBS}, got {n}"))
    }
}

fn check_json_schema(text: String) -> Result<Option<String>, String> {
    compact_json_schema(&text).map(Some)
}

/// A JSON Schema given as text: it must be a JSON object (whether the grammar engine supports it is checked
/// when it is compiled). Returns it compact, so equal schemas share one compiled grammar.
fn compact_json_schema(text: &str) -> Result<String, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v.to_string()),
        Ok(_) => Err("must be a JSON object (a JSON Schema)".into()),
        Err(e) => Err(format!("is not valid JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{message, parse, MINIMAL};
    use super::*;

    #[test]
    fn row_parameters_override_only_what_they_set() {
        let job = parse(MINIMAL).unwrap();
        let row = RowParams { temperature: Some(0.5), max_new_tokens: Some(3), ..Default::default() };
        let p = job.generation.for_row(&row).unwrap();
        assert_eq!((p.temperature, p.max_new_tokens, p.top_p, p.seed), (0.5, 3, job.generation.top_p, job.generation.seed));
        assert_eq!(job.generation.for_row(&Default::default()).unwrap(), job.generation);
        let row = RowParams { min_new_tokens: Some(20), ..Default::default() };
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
    fn the_fingerprint_form_keeps_the_order_it_had_before_the_table() {
        let p = GenerationParams {
            min_new_tokens: 1,
            min_p: 0.1,
            repetition_penalty: 1.1,
            presence_penalty: 0.1,
            frequency_penalty: 0.1,
            stop_token_ids: vec![1],
            include_stop_str_in_output: true,
            ignore_eos: true,
            n: 2,
            logprobs: Some(0),
            json_schema: Some("{}".into()),
            ..GenerationParams::default()
        };
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(
            text,
            r#"{"max_new_tokens":16,"min_new_tokens":1,"temperature":0.0,"top_p":1.0,"top_k":0,"min_p":0.1,"#.to_string()
                + r#""repetition_penalty":1.1,"presence_penalty":0.1,"frequency_penalty":0.1,"seed":0,"stop":[],"#
                + r#""stop_token_ids":[1],"include_stop_str_in_output":true,"ignore_eos":true,"n":2,"logprobs":0,"#
                + r#""json_schema":"{}"}"#
        );
    }

    #[test]
    fn row_parameter_values_are_checked_by_the_job_file_rules() {
        let mut p = RowParams::default();
        set_row_param(&mut p, "stop", ParamValue::TextList(vec!["END".into()])).unwrap();
        set_row_param(&mut p, "ignore_eos", ParamValue::Bool(true)).unwrap();
        set_row_param(&mut p, "json_schema", ParamValue::Text("{ \"type\": \"object\" }".into())).unwrap();
        assert_eq!(
            (p.stop.as_deref(), p.ignore_eos, p.json_schema.clone().flatten().as_deref()),
            (Some(&["END".to_string()][..]), Some(true), Some(r#"{"type":"object"}"#))
        );
        for (key, value, problem) in [
            ("stop", ParamValue::TextList(vec![String::new()]), "empty string"),
            ("n", ParamValue::Integer(0), "1..="),
            ("min_p", ParamValue::Number(-0.1), "[0, 1]"),
            ("json_schema", ParamValue::Text("[1]".into()), "JSON object"),
            ("stop_token_ids", ParamValue::IntegerList(vec![3, -2]), ">= 0"),
            ("seed", ParamValue::Integer(-1), "must be >= 0, got -1"),
            // Finite in f64, infinite (or zero) in the f32 they are computed in.
            ("temperature", ParamValue::Number(1e39), "f32"),
            ("repetition_penalty", ParamValue::Number(1e39), "f32"),
            ("repetition_penalty", ParamValue::Number(1e-50), "f32"),
            ("seed", ParamValue::Number(1.0), "not a per-row parameter of this type: seed"),
        ] {
            let m = set_row_param(&mut p, key, value).unwrap_err();
            assert!(m.contains(problem), "{key}: {m}");
        }
    }

    /// The documentation's table of generation parameters (docs/job-file.md) names each parameter of the table, and
    /// nothing else.
    #[test]
    fn every_parameter_is_in_the_readme() {
        let readme = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/job-file.md")).unwrap();
        let section = readme.split("### Generation parameters").nth(1).expect("a Generation parameters section");
        let section = section.split("\n#").next().unwrap();
        let mut documented: Vec<&str> =
            section.lines().filter_map(|l| l.strip_prefix("| `")?.split('`').next()).collect();
        let mut declared: Vec<&str> = PARAMETERS.iter().map(|p| p.name).collect();
        documented.sort();
        declared.sort();
        assert_eq!(documented, declared, "docs/job-file.md's table of generation parameters and the code disagree");
    }
}
