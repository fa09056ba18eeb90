//! What a row comes out of the job as: a completion, an embedding, or a failure with its row error. The engines
//! make these, the sink writes them, the metrics count them; this module depends on none of them.

use crate::job::GenerationParams;
use crate::reuse::RequestKey;
use crate::row::{FinishReason, RowError, RowTag};

/// One output row.
#[derive(Clone, Debug)]
pub enum Outcome {
    Completed(Completion),
    Embedded(Embedded),
    /// A row that failed, before the engine (tokenization, validation) or in it.
    Failed(RowFailure),
    /// A row copied from an earlier run's output instead of computed (`[reuse]`).
    Reused(Reused),
}

impl Outcome {
    pub fn tag(&self) -> RowTag {
        match self {
            Outcome::Completed(c) => c.tag,
            Outcome::Embedded(e) => e.tag,
            Outcome::Failed(f) => f.tag,
            Outcome::Reused(r) => r.tag,
        }
    }

    pub fn id(&self) -> &str {
        match self {
            Outcome::Completed(c) => &c.id,
            Outcome::Embedded(e) => &e.id,
            Outcome::Failed(f) => &f.id,
            Outcome::Reused(r) => &r.id,
        }
    }

    /// The same result for another row of the run with the same request key (`leader` computed it).
    pub fn copy_for(&self, leader: &str, id: &str, tag: RowTag) -> Outcome {
        match self {
            Outcome::Completed(c) => {
                Outcome::Completed(Completion { id: id.into(), tag, duplicate_of: Some(leader.into()), ..c.clone() })
            }
            Outcome::Embedded(e) => Outcome::Embedded(Embedded { id: id.into(), tag, duplicate_of: Some(leader.into()), ..e.clone() }),
            Outcome::Failed(f) => Outcome::Failed(RowFailure { id: id.into(), tag, ..f.clone() }),
            Outcome::Reused(r) => Outcome::Reused(Reused { id: id.into(), tag, ..r.clone() }),
        }
    }

    /// Sets the request key of a computed row (the collector knows it, the engine does not).
    pub fn set_request_key(&mut self, key: RequestKey) {
        match self {
            Outcome::Completed(c) => c.request_key = Some(key),
            Outcome::Embedded(e) => e.request_key = Some(key),
            Outcome::Failed(_) | Outcome::Reused(_) => {}
        }
    }
}

/// A row served by an earlier output: where its result is, and once the collector has read it, the result.
#[derive(Clone, Debug)]
pub struct Reused {
    pub id: String,
    pub tag: RowTag,
    pub key: RequestKey,
    /// The source's result file (an index into the run's reuse sources) and the row in it.
    pub file: u32,
    pub row: u32,
    /// Filled in before the unit is written.
    pub data: Option<std::sync::Arc<ReusedData>>,
}

/// A reused row's result as its source holds it.
#[derive(Clone, Debug)]
pub struct ReusedData {
    /// The source's output URL.
    pub url: String,
    /// The row's id in the source.
    pub source_id: String,
    /// The one row of the source's result file.
    pub row: arrow::array::RecordBatch,
    /// When the row was computed: queue_s, ttft_s, e2e_s and tpot_s of the run that computed it.
    pub timings: [Option<f64>; 4],
}

/// A failed row: its id and place, and the error its output row carries.
#[derive(Clone, Debug)]
pub struct RowFailure {
    pub id: String,
    pub tag: RowTag,
    pub error: RowError,
}

/// A row's embedding.
#[derive(Clone, Debug)]
pub struct Embedded {
    pub id: String,
    pub tag: RowTag,
    pub vector: Vec<f32>,
    pub prompt_tokens: u32,
    /// From the row being ready for the encoder to its vector.
    pub e2e_s: f64,
    /// Set by the collector, not the engine.
    pub request_key: Option<RequestKey>,
    /// The id of the row of this run whose computation this row shares.
    pub duplicate_of: Option<String>,
}

/// The log-probability of one token, with the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// The token's text (a piece of a multi-byte character decodes as U+FFFD).
    pub token: String,
    pub logprob: f32,
    /// Most likely first; empty when no alternatives were asked for.
    pub top: Vec<TopLogprob>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TopLogprob {
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
}

/// One generated answer of a row (a row with `n` > 1 has several).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Choice {
    pub index: u32,
    /// The text; empty for a scoring row.
    pub text: String,
    #[serde(serialize_with = "finish_reason_str")]
    pub finish_reason: FinishReason,
    /// Tokens generated (the end token included), or the tokens of the completion scored.
    pub completion_tokens: u32,
    /// Per output token, when asked for (`logprobs`), and always for a scoring row.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The sum of the output tokens' log-probabilities, when they were computed.
    pub cumulative_logprob: Option<f64>,
}

fn finish_reason_str<S: serde::Serializer>(r: &FinishReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

/// A finished row: every choice done.
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: String,
    pub tag: RowTag,
    /// At least one, by index.
    pub choices: Vec<Choice>,
    /// The parameters the row ran with (the job's, with the row's own values).
    pub params: GenerationParams,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (OpenAI's `cached_tokens`).
    pub cached_tokens: u32,
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Mean time per output token after the first; `None` for a single-token output.
    pub tpot_s: Option<f64>,
    /// Set by the collector, not the engine.
    pub request_key: Option<RequestKey>,
    /// The id of the row of this run whose computation this row shares.
    pub duplicate_of: Option<String>,
}

impl Completion {
    /// Tokens generated for the row, all choices together.
    pub fn completion_tokens(&self) -> u32 {
        self.choices.iter().map(|c| c.completion_tokens).sum()
    }
}
