//! OpenAI Batch input lines (`{"custom_id", "method", "url", "body"}`): a line's request as a nightshift row, or
//! the row error that says what is wrong with it. A bad line is a row error, never a failed job.

use serde_json::{Map, Value};

use crate::job::{set_row_param, LineRules, ParamValue};
use crate::row::{ErrorCode, Message, Prompt, RowError, RowParams};

/// A line read: its `custom_id` (when it has one) and its request or error.
pub struct ParsedLine {
    pub custom_id: Option<String>,
    pub request: Result<(Prompt, RowParams), RowError>,
}

fn invalid(message: impl Into<String>) -> RowError {
    RowError::new(ErrorCode::InvalidRequest, message)
}

/// Only the `custom_id` and `body.model`, for the checks over the whole file (duplicate ids, model names).
pub fn id_and_model(line: &str) -> (Option<String>, Option<String>) {
    #[derive(serde::Deserialize)]
    struct Body {
        model: Option<Value>,
    }
    #[derive(serde::Deserialize)]
    struct Line {
        custom_id: Option<Value>,
        body: Option<Body>,
    }
    let Ok(line) = serde_json::from_str::<Line>(line) else { return (None, None) };
    let text = |v: Option<Value>| v.and_then(|v| v.as_str().map(str::to_string));
    (text(line.custom_id), text(line.body.and_then(|b| b.model)))
}

pub fn parse_line(line: &str, rules: &LineRules) -> ParsedLine {
    let value: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return ParsedLine { custom_id: None, request: Err(invalid(format!("the line is not JSON: {e}"))) },
    };
    let Some(object) = value.as_object() else {
        return ParsedLine { custom_id: None, request: Err(invalid("the line is not a JSON object")) };
    };
    let custom_id = object.get("custom_id").and_then(Value::as_str).map(str::to_string);
    ParsedLine { request: request(object, custom_id.is_some(), rules), custom_id }
}

fn request(line: &Map<String, Value>, has_id: bool, rules: &LineRules) -> Result<(Prompt, RowParams), RowError> {
    if !has_id {
        return Err(invalid("`custom_id` is missing or not a string"));
    }
    if let Some(key) = line.keys().find(|k| !matches!(k.as_str(), "custom_id" | "method" | "url" | "body")) {
        return Err(invalid(format!("unknown field `{key}` (a line has custom_id, method, url and body)")));
    }
    match line.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        other => return Err(invalid(format!("`method` must be \"POST\", got {}", show(other)))),
    }
    let url = line.get("url").and_then(Value::as_str);
    if url != Some(rules.url) {
        return Err(invalid(format!("`url` must be {:?} for this job, got {}", rules.url, show(url))));
    }
    let Some(body) = line.get("body").and_then(Value::as_object) else { return Err(invalid("`body` is missing or not an object")) };
    if let Some(expected) = &rules.model {
        match body.get("model") {
            Some(Value::String(m)) if m == expected => {}
            Some(Value::String(m)) => return Err(RowError::new(ErrorCode::ModelMismatch, format!("`body.model` is {m:?}, but this job runs {expected:?}"))),
            Some(other) => return Err(invalid(format!("`body.model` must be a string, got {other}"))),
            None => return Err(invalid("`body.model` is missing")),
        }
    }
    let mut params = RowParams::default();
    let mut prompt = None;
    let mut logprobs: Option<bool> = None;
    let mut top_logprobs: Option<i64> = None;
    for (key, value) in body {
        let param = |params: &mut RowParams, name: &str, v: ParamValue| {
            set_row_param(params, name, v).map_err(|p| RowError::new(ErrorCode::InvalidParameters, format!("`body.{key}` {p}")))
        };
        let wrong = |what: &str| invalid(format!("`body.{key}` must be {what}, got {value}"));
        // An integer, or why not: one past i64 (a seed of 2^63 and up) is a value out of range, not a non-integer.
        let integer = || match (value.as_i64(), value.as_u64()) {
            (Some(v), _) => Ok(v),
            (None, Some(v)) => Err(RowError::new(ErrorCode::InvalidParameters, format!("`body.{key}` is {v}, beyond the largest integer taken (2^63 - 1)"))),
            (None, None) => Err(wrong("an integer")),
        };
        match (rules.url, key.as_str()) {
            (_, "model") | (_, "user") | (_, "metadata") | (_, "store") => {}
            ("/v1/chat/completions", "messages") => prompt = Some(Prompt::Messages(messages(value)?)),
            ("/v1/completions", "prompt") | ("/v1/embeddings", "input") => match value {
                Value::String(s) => prompt = Some(Prompt::Text(s.clone())),
                Value::Array(items) if items.len() == 1 && items[0].is_string() => prompt = Some(Prompt::Text(items[0].as_str().unwrap_or_default().into())),
                _ => return Err(wrong("a string (one prompt per line)")),
            },
            ("/v1/embeddings", "encoding_format") => {
                if value != "float" {
                    return Err(wrong("\"float\""));
                }
            }
            ("/v1/embeddings", _) => return Err(invalid(format!("unknown or unsupported field `body.{key}`"))),
            (_, "max_tokens") | (_, "max_completion_tokens") => param(&mut params, "max_new_tokens", ParamValue::Integer(integer()?))?,
            (_, "min_tokens") => param(&mut params, "min_new_tokens", ParamValue::Integer(integer()?))?,
            (_, name @ ("temperature" | "top_p" | "min_p" | "repetition_penalty" | "presence_penalty" | "frequency_penalty")) => {
                param(&mut params, name, ParamValue::Number(value.as_f64().ok_or_else(|| wrong("a number"))?))?
            }
            (_, name @ ("n" | "seed" | "top_k")) => {
                // vLLM's top_k takes -1 for "off", OpenAI's has none: -1 is 0 here.
                let v = integer()?;
                param(&mut params, name, ParamValue::Integer(if name == "top_k" && v == -1 { 0 } else { v }))?
            }
            (_, "stop") => match value {
                Value::String(s) => param(&mut params, "stop", ParamValue::TextList(vec![s.clone()]))?,
                Value::Array(items) => {
                    let stops: Option<Vec<String>> = items.iter().map(|i| i.as_str().map(str::to_string)).collect();
                    param(&mut params, "stop", ParamValue::TextList(stops.ok_or_else(|| wrong("a string or a list of strings"))?))?
                }
                Value::Null => {}
                _ => return Err(wrong("a string or a list of strings")),
            },
            ("/v1/chat/completions", "logprobs") => logprobs = Some(value.as_bool().ok_or_else(|| wrong("a boolean"))?),
            ("/v1/chat/completions", "top_logprobs") => top_logprobs = Some(integer()?),
            ("/v1/completions", "logprobs") => {
                if !value.is_null() {
                    param(&mut params, "logprobs", ParamValue::Integer(integer()?))?
                }
            }
            (_, "response_format") => {
                if let Some(schema) = response_format(value)? {
                    param(&mut params, "json_schema", ParamValue::Text(schema))?
                }
            }
            _ => return Err(invalid(format!("unknown or unsupported field `body.{key}`"))),
        }
    }
    match (logprobs, top_logprobs) {
        (Some(true), top) => set_row_param(&mut params, "logprobs", ParamValue::Integer(top.unwrap_or(0)))
            .map_err(|p| RowError::new(ErrorCode::InvalidParameters, format!("`body.top_logprobs` {p}")))?,
        (_, Some(_)) => return Err(invalid("`body.top_logprobs` needs `body.logprobs = true`")),
        _ => {}
    }
    let what = match rules.url {
        "/v1/chat/completions" => "`body.messages`",
        "/v1/completions" => "`body.prompt`",
        _ => "`body.input`",
    };
    let prompt = prompt.ok_or_else(|| invalid(format!("{what} is missing")))?.non_empty()?;
    Ok((prompt, params))
}

fn show(v: Option<&str>) -> String {
    v.map_or("nothing".into(), |s| format!("{s:?}"))
}

/// Chat messages: `role` and `content` (a string, or text parts, joined).
fn messages(value: &Value) -> Result<Vec<Message>, RowError> {
    let items = value.as_array().ok_or_else(|| invalid("`body.messages` must be a list"))?;
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| invalid(format!("`body.messages[{i}].role` is missing or not a string")))?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(text)) => Ok(text),
                        _ => Err(invalid(format!("`body.messages[{i}].content` has a part that is not text; only text is supported"))),
                    })
                    .collect::<Result<Vec<&str>, _>>()?
                    .join(""),
                Some(Value::Null) | None => String::new(),
                Some(_) => return Err(invalid(format!("`body.messages[{i}].content` must be a string or a list of text parts"))),
            };
            Ok(Message { role: role.to_string(), content })
        })
        .collect()
}

/// `response_format`: a JSON Schema as text, `{}`-like for `json_object`; `None` for `text`.
fn response_format(value: &Value) -> Result<Option<String>, RowError> {
    match value.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(r#"{"type":"object"}"#.into())),
        Some("json_schema") => {
            let schema = value.get("json_schema").and_then(|s| s.get("schema")).ok_or_else(|| invalid("`body.response_format.json_schema.schema` is missing"))?;
            Ok(Some(schema.to_string()))
        }
        _ => Err(invalid(format!("`body.response_format.type` must be \"text\", \"json_object\" or \"json_schema\", got {value}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(model: Option<&str>) -> LineRules {
        LineRules { url: "/v1/chat/completions", model: model.map(str::to_string) }
    }

    fn line(body: Value) -> String {
        json!({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}).to_string()
    }

    fn ok(body: Value) -> (Prompt, RowParams) {
        parse_line(&line(body), &chat(None)).request.unwrap()
    }

    fn err(text: &str, rules: &LineRules) -> RowError {
        parse_line(text, rules).request.unwrap_err()
    }

    #[test]
    fn every_body_field_maps_to_its_parameter() {
        let (prompt, p) = ok(json!({
            "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": "END", "seed": 7,
            "presence_penalty": 0.1, "frequency_penalty": 0.2, "logprobs": true, "top_logprobs": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
        }));
        assert_eq!(prompt, Prompt::Messages(vec![Message { role: "system".into(), content: "Be brief.".into() }, Message { role: "user".into(), content: "Hi there".into() }]));
        assert_eq!((p.max_new_tokens, p.temperature, p.top_p, p.n, p.seed), (Some(20), Some(0.5), Some(0.9), Some(2), Some(7)));
        assert_eq!((p.presence_penalty, p.frequency_penalty, p.logprobs), (Some(0.1), Some(0.2), Some(Some(3))));
        assert_eq!((p.top_k, p.min_p, p.repetition_penalty, p.min_new_tokens), (Some(40), Some(0.05), Some(1.1), Some(2)));
        assert_eq!(p.stop, Some(vec!["END".to_string()]));
        assert_eq!(p.json_schema, Some(Some(r#"{"type":"object"}"#.to_string())));
        // max_tokens is the older name; a list of stops; json_object; logprobs without alternatives.
        let (_, p) = ok(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stop": ["a", "b"], "response_format": {"type": "json_object"}, "logprobs": true}));
        assert_eq!((p.max_new_tokens, p.stop, p.logprobs), (Some(5), Some(vec!["a".into(), "b".into()]), Some(Some(0))));
        assert!(p.json_schema.is_some());
        // Text completions and embeddings take `prompt` and `input`.
        let text = LineRules { url: "/v1/completions", model: None };
        let l = json!({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "logprobs": 2, "max_tokens": 3}}).to_string();
        let (prompt, p) = parse_line(&l, &text).request.unwrap();
        assert_eq!((prompt, p.logprobs, p.max_new_tokens), (Prompt::Text("Once".into()), Some(Some(2)), Some(3)));
        let embed = LineRules { url: "/v1/embeddings", model: None };
        let l = json!({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello", "encoding_format": "float"}}).to_string();
        assert_eq!(parse_line(&l, &embed).request.unwrap().0, Prompt::Text("hello".into()));
    }

    /// Mutated lines (bytes flipped, cut, repeated) never panic: each is a request or a row error.
    #[test]
    fn mutated_lines_never_panic() {
        let good = line(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
            "stop": ["a"], "logprobs": true, "top_logprobs": 1, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}));
        let rules = chat(Some("m"));
        assert!(parse_line(&good, &rules).request.is_ok());
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        const ALPHABET: &[u8] = b" {}[]\":,0123456789tfnae.\\";
        let (mut requests, mut errors) = (0, 0);
        for _ in 0..3000 {
            let mut bytes = good.clone().into_bytes();
            for _ in 0..1 + next() % 4 {
                let at = (next() % bytes.len() as u64) as usize;
                match next() % 3 {
                    0 => bytes[at] = ALPHABET[(next() % ALPHABET.len() as u64) as usize],
                    1 => bytes.truncate(at.max(1)),
                    _ => bytes.insert(at, bytes[at]),
                }
            }
            match parse_line(&String::from_utf8_lossy(&bytes), &rules).request {
                Ok(_) => requests += 1,
                Err(_) => errors += 1,
            }
        }
        assert!(requests > 0 && errors > 0, "{requests} requests, {errors} errors");
    }

    #[test]
    fn every_bad_line_is_a_row_error_naming_what_is_wrong() {
        let rules = chat(Some("smol"));
        let base = |body: Value| line(body);
        let cases: Vec<(String, ErrorCode, &str)> = vec![
            ("{not json".into(), ErrorCode::InvalidRequest, "not JSON"),
            ("[1, 2]".into(), ErrorCode::InvalidRequest, "not a JSON object"),
            (json!({"method": "POST", "url": "/v1/chat/completions", "body": {}}).to_string(), ErrorCode::InvalidRequest, "custom_id"),
            (json!({"custom_id": "r", "method": "GET", "url": "/v1/chat/completions", "body": {}}).to_string(), ErrorCode::InvalidRequest, "`method`"),
            (json!({"custom_id": "r", "method": "POST", "url": "/v1/embeddings", "body": {}}).to_string(), ErrorCode::InvalidRequest, "`url`"),
            (json!({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {}, "extra": 1}).to_string(), ErrorCode::InvalidRequest, "unknown field `extra`"),
            (base(json!({"model": "gpt-4o", "messages": []})), ErrorCode::ModelMismatch, "gpt-4o"),
            (base(json!({"messages": []})), ErrorCode::InvalidRequest, "`body.model` is missing"),
            (base(json!({"model": "smol"})), ErrorCode::InvalidRequest, "`body.messages` is missing"),
            (base(json!({"model": "smol", "messages": [], "tools": []})), ErrorCode::InvalidRequest, "`body.tools`"),
            (base(json!({"model": "smol", "messages": [], "temperature": "hot"})), ErrorCode::InvalidRequest, "`body.temperature` must be a number"),
            (base(json!({"model": "smol", "messages": [], "temperature": -1})), ErrorCode::InvalidParameters, "`body.temperature`"),
            (base(json!({"model": "smol", "messages": [], "max_tokens": 0})), ErrorCode::InvalidParameters, "`body.max_tokens`"),
            (base(json!({"model": "smol", "messages": [], "stop": [1]})), ErrorCode::InvalidRequest, "`body.stop`"),
            (base(json!({"model": "smol", "messages": [], "top_logprobs": 2})), ErrorCode::InvalidRequest, "needs `body.logprobs = true`"),
            (base(json!({"model": "smol", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})), ErrorCode::InvalidRequest, "not text"),
            (base(json!({"model": "smol", "messages": [{"content": "x"}]})), ErrorCode::InvalidRequest, "role"),
            (base(json!({"model": "smol", "messages": [], "response_format": {"type": "xml"}})), ErrorCode::InvalidRequest, "response_format"),
        ];
        for (text, code, says) in cases {
            let e = err(&text, &rules);
            assert_eq!(e.code, code, "{text}: {}", e.message);
            assert!(e.message.contains(says), "{text}: {}", e.message);
        }
        // The custom_id of a bad line is kept when there is one.
        assert_eq!(parse_line(&base(json!({"temperature": 1})), &rules).custom_id.as_deref(), Some("r1"));
        assert_eq!(id_and_model(&base(json!({}))).0.as_deref(), Some("r1"));
        assert_eq!(id_and_model(&line(json!({"model": "gpt-4o-mini"}))), (Some("r1".into()), Some("gpt-4o-mini".into())));
        assert_eq!(id_and_model("{oops"), (None, None));
    }
}
