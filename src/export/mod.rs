//! `nightshift export`: a completed output in another format. `openai-batch` writes the two files OpenAI's (and
//! Azure OpenAI's) Batch API returns, so a job moved off a hosted batch API gives its users the files they read:
//! `results.jsonl` (a `BatchRequestOutput` line per succeeded row, `response.body` shaped as the endpoint's
//! response) and `errors.jsonl` (a line per errored row, `error` with `code` and `message`), in input order.
//!
//! The lines are made here from result rows as JSON (arrow's JSON writer); [`crate::sink`] streams the output's
//! files through it a batch at a time and uploads the two files, so memory does not grow with the output.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// The endpoint whose response body a line carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: a `chat.completion` (jobs with a chat template).
    ChatCompletions,
    /// `/v1/completions`: a `text_completion` (jobs whose prompts are tokenized as they are).
    Completions,
    /// `/v1/embeddings`: a list of one embedding (embed jobs).
    Embeddings,
}

impl Endpoint {
    pub fn url(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }
}

/// What every line of one export shares.
pub struct Lines {
    pub endpoint: Endpoint,
    /// The model name the bodies carry.
    pub model: String,
    /// The job's fingerprint digest, as `system_fingerprint`, and the seed of the lines' ids.
    pub fingerprint: String,
}

/// Which file a line goes to.
pub enum Line {
    Result(String),
    Error(String),
}

impl Lines {
    /// The export line of one result row (as arrow's JSON writer makes it: null columns left out), with the
    /// Unix time its unit was written.
    pub fn line(&self, row: &Value, created: i64) -> Line {
        let custom_id = row["id"].as_str().unwrap_or_default();
        let hash = format!("{:x}", Sha256::digest(format!("{}\0{custom_id}", self.fingerprint).as_bytes()));
        let id = format!("batch_req_{}", &hash[..32]);
        if row["status"] != "succeeded" {
            let error = &row["error"];
            let line = json!({
                "id": id,
                "custom_id": custom_id,
                "response": null,
                "error": {"code": error["code"].as_str().unwrap_or("engine_error"), "message": error["message"].as_str().unwrap_or_default()},
            });
            return Line::Error(line.to_string());
        }
        let body = match self.endpoint {
            Endpoint::ChatCompletions => self.chat_completion(row, created, &hash),
            Endpoint::Completions => self.text_completion(row, created, &hash),
            Endpoint::Embeddings => self.embeddings(row),
        };
        let line = json!({
            "id": id,
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": format!("req_{}", &hash[32..64]), "body": body},
            "error": null,
        });
        Line::Result(line.to_string())
    }

    fn usage(row: &Value) -> Value {
        let prompt = row["prompt_tokens"].as_u64().unwrap_or(0);
        let completion = row["completion_tokens"].as_u64().unwrap_or(0);
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": row["cached_tokens"].as_u64().unwrap_or(0), "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
        })
    }

    fn chat_completion(&self, row: &Value, created: i64, hash: &str) -> Value {
        let choices: Vec<Value> = choices(row)
            .into_iter()
            .map(|c| {
                json!({
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": null, "annotations": []},
                    "logprobs": c.logprobs.map(|tokens| json!({"content": tokens.iter().map(chat_logprob).collect::<Vec<_>>(), "refusal": null})),
                    "finish_reason": c.finish_reason,
                })
            })
            .collect();
        json!({
            "id": format!("chatcmpl-{}", &hash[..24]),
            "object": "chat.completion",
            "created": created,
            "model": self.model,
            "choices": choices,
            "usage": Lines::usage(row),
            "service_tier": "default",
            "system_fingerprint": format!("fp_{}", self.fingerprint),
        })
    }

    fn text_completion(&self, row: &Value, created: i64, hash: &str) -> Value {
        let choices: Vec<Value> = choices(row)
            .into_iter()
            .map(|c| {
                json!({
                    "text": c.text,
                    "index": c.index,
                    "logprobs": c.logprobs.map(|tokens| completion_logprobs(&tokens)),
                    "finish_reason": c.finish_reason,
                })
            })
            .collect();
        let mut usage = Lines::usage(row);
        usage.as_object_mut().expect("an object").retain(|k, _| matches!(k.as_str(), "prompt_tokens" | "completion_tokens" | "total_tokens"));
        json!({
            "id": format!("cmpl-{}", &hash[..24]),
            "object": "text_completion",
            "created": created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": format!("fp_{}", self.fingerprint),
        })
    }

    fn embeddings(&self, row: &Value) -> Value {
        let tokens = row["prompt_tokens"].as_u64().unwrap_or(0);
        json!({
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })
    }
}

/// One choice of a row, as the export needs it.
struct Choice {
    index: u64,
    text: String,
    finish_reason: &'static str,
    logprobs: Option<Vec<Value>>,
}

/// A row's choices: the `choices` column for rows with `n` > 1, the row's own columns otherwise.
fn choices(row: &Value) -> Vec<Choice> {
    let one = |c: &Value, index: u64| Choice {
        index,
        text: c["text"].as_str().unwrap_or_default().to_string(),
        finish_reason: finish_reason(c["finish_reason"].as_str().unwrap_or_default()),
        logprobs: c["logprobs"].as_array().cloned(),
    };
    match row["choices"].as_array() {
        Some(choices) if !choices.is_empty() => choices.iter().enumerate().map(|(i, c)| one(c, c["index"].as_u64().unwrap_or(i as u64))).collect(),
        _ => vec![one(row, 0)],
    }
}

/// OpenAI's finish reasons: a JSON value cut off by the token budget is `length` there too.
fn finish_reason(ours: &str) -> &'static str {
    match ours {
        "length" | "incomplete_json" => "length",
        _ => "stop",
    }
}

/// A token's text, its log-probability and its UTF-8 bytes, as OpenAI's chat logprobs hold them.
fn token_logprob(t: &Value) -> Map<String, Value> {
    let token = t["token"].as_str().unwrap_or_default();
    let mut m = Map::new();
    m.insert("token".into(), json!(token));
    m.insert("logprob".into(), t["logprob"].clone());
    m.insert("bytes".into(), json!(token.as_bytes()));
    m
}

fn chat_logprob(t: &Value) -> Value {
    let mut m = token_logprob(t);
    let top: Vec<Value> = t["top"].as_array().map(|top| top.iter().map(|a| Value::Object(token_logprob(a))).collect()).unwrap_or_default();
    m.insert("top_logprobs".into(), Value::Array(top));
    Value::Object(m)
}

/// The legacy completions' logprobs: parallel lists of tokens, log-probabilities, alternatives and offsets.
fn completion_logprobs(tokens: &[Value]) -> Value {
    let mut offset = 0usize;
    let (mut texts, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for t in tokens {
        let token = t["token"].as_str().unwrap_or_default();
        texts.push(json!(token));
        lps.push(t["logprob"].clone());
        let top: Map<String, Value> = t["top"].as_array().map(|top| top.iter().map(|a| (a["token"].as_str().unwrap_or_default().to_string(), a["logprob"].clone())).collect()).unwrap_or_default();
        tops.push(Value::Object(top));
        offsets.push(json!(offset));
        offset += token.len();
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(endpoint: Endpoint) -> Lines {
        Lines { endpoint, model: "smol".into(), fingerprint: "abc".into() }
    }

    fn parse(line: Line) -> (bool, Value) {
        match line {
            Line::Result(l) => (true, serde_json::from_str(&l).unwrap()),
            Line::Error(l) => (false, serde_json::from_str(&l).unwrap()),
        }
    }

    #[test]
    fn a_succeeded_row_is_a_chat_completion_with_usage_and_logprobs() {
        let row = json!({
            "id": "r1", "status": "succeeded", "text": "Hi.", "finish_reason": "incomplete_json", "prompt_tokens": 10,
            "cached_tokens": 4, "completion_tokens": 2,
            "logprobs": [{"token_id": 5, "token": "Hi", "logprob": -0.5, "top": [{"token_id": 5, "token": "Hi", "logprob": -0.5}]},
                         {"token_id": 6, "token": "é", "logprob": -1.0, "top": []}],
        });
        let (ok, line) = parse(lines(Endpoint::ChatCompletions).line(&row, 1_700_000_000));
        assert!(ok);
        assert_eq!(line["custom_id"], "r1");
        assert!(line["error"].is_null() && line["response"]["status_code"] == 200);
        let body = &line["response"]["body"];
        assert_eq!((body["object"].as_str(), body["created"].as_i64(), body["model"].as_str()), (Some("chat.completion"), Some(1_700_000_000), Some("smol")));
        let choice = &body["choices"][0];
        assert_eq!((choice["message"]["content"].as_str(), choice["finish_reason"].as_str()), (Some("Hi."), Some("length")));
        assert_eq!(choice["logprobs"]["content"][1]["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(choice["logprobs"]["content"][0]["top_logprobs"][0]["token"], "Hi");
        assert_eq!(body["usage"], json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}));
        // Ids are stable across exports of the output and differ between rows.
        let (_, again) = parse(lines(Endpoint::ChatCompletions).line(&row, 1));
        assert_eq!(again["id"], line["id"]);
        let (_, other) = parse(lines(Endpoint::ChatCompletions).line(&json!({"id": "r2", "status": "succeeded"}), 1));
        assert_ne!(other["id"], line["id"]);
        assert_ne!(other["response"]["request_id"], line["response"]["request_id"]);
    }

    #[test]
    fn rows_with_several_choices_and_text_completions() {
        let row = json!({"id": "r", "status": "succeeded", "text": "a", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 4,
            "choices": [{"index": 0, "text": "a", "finish_reason": "stop", "completion_tokens": 1},
                        {"index": 1, "text": "bc", "finish_reason": "length", "completion_tokens": 3,
                         "logprobs": [{"token": "b", "logprob": -0.1, "top": [{"token": "b", "logprob": -0.1}, {"token": "x", "logprob": -3.0}]},
                                      {"token": "c", "logprob": -0.2, "top": []}]}]});
        let (_, chat) = parse(lines(Endpoint::ChatCompletions).line(&row, 0));
        let choices = chat["response"]["body"]["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!((choices[1]["index"].as_u64(), choices[1]["message"]["content"].as_str()), (Some(1), Some("bc")));
        assert!(choices[0]["logprobs"].is_null());
        let (_, text) = parse(lines(Endpoint::Completions).line(&row, 0));
        let body = &text["response"]["body"];
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][1]["logprobs"], json!({"tokens": ["b", "c"], "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [{"b": -0.1, "x": -3.0}, {}], "text_offset": [0, 1]}));
        assert_eq!(body["usage"], json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
    }

    #[test]
    fn an_errored_row_is_an_error_line_and_an_embedding_a_list() {
        let row = json!({"id": "bad", "status": "errored", "error": {"code": "prompt_too_long", "message": "too long"}, "finish_reason": "error"});
        let (ok, line) = parse(lines(Endpoint::ChatCompletions).line(&row, 0));
        assert!(!ok);
        assert_eq!(line["error"], json!({"code": "prompt_too_long", "message": "too long"}));
        assert!(line["response"].is_null() && line["custom_id"] == "bad");
        let row = json!({"id": "e", "status": "succeeded", "embedding": [0.5, -0.25], "prompt_tokens": 7});
        let (_, line) = parse(lines(Endpoint::Embeddings).line(&row, 0));
        assert_eq!(line["response"]["body"], json!({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
            "model": "smol", "usage": {"prompt_tokens": 7, "total_tokens": 7}}));
    }
}
