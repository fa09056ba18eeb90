//! The per-row types every stage shares: what a row asks for, and how a row can fail.
//!
//! A bad row is data, not a crash: it carries a [`RowError`] to the sink and the job goes on.

use std::fmt;

/// Stable, machine-readable codes for rows that could not be processed. Written to the `error.code` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The prompt (or messages) value is null.
    NullPrompt,
    /// The prompt is empty, or the conversation has no message with content.
    EmptyPrompt,
    /// A messages value is malformed (e.g. a null role).
    InvalidMessages,
    /// The chat template failed to render for this row.
    TemplateError,
    /// The prompt has more tokens than the model's context allows (and `input.truncate` is not set).
    PromptTooLong,
    /// A per-row generation parameter (from an `[input.parameters]` column) is out of range.
    InvalidParameters,
    /// A scoring job's completion is null or empty.
    InvalidCompletion,
    /// An OpenAI Batch input line that is not a request this job can run: not JSON, a wrong method or url, an
    /// unknown or ill-typed body field.
    InvalidRequest,
    /// An OpenAI Batch input line whose `body.model` is not the job's model.
    ModelMismatch,
    /// The engine failed on this row.
    EngineError,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NullPrompt => "null_prompt",
            ErrorCode::EmptyPrompt => "empty_prompt",
            ErrorCode::InvalidMessages => "invalid_messages",
            ErrorCode::TemplateError => "template_error",
            ErrorCode::PromptTooLong => "prompt_too_long",
            ErrorCode::InvalidParameters => "invalid_parameters",
            ErrorCode::InvalidCompletion => "invalid_completion",
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::ModelMismatch => "model_mismatch",
            ErrorCode::EngineError => "engine_error",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowError {
    pub code: ErrorCode,
    pub message: String,
}

impl RowError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        RowError { code, message: message.into() }
    }
}

/// Where a row belongs in the output: its unit of the plan and its position in that unit. Travels with the row
/// through every stage so the sink can put results back in input order and commit a unit once all its rows are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowTag {
    pub unit: u32,
    pub offset: u32,
}

/// Generation parameters a row sets for itself; declared with the generation parameters, in one table.
pub use crate::job::RowParams;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What a row asks the model, before the chat template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
}

impl Prompt {
    /// The prompt, or `empty_prompt` when it holds no text to answer: a blank text, no messages, or messages whose
    /// contents are all blank. Every input format checks with this one rule (Parquet text and messages columns,
    /// JSONL prompts, messages and embedding inputs).
    pub fn non_empty(self) -> Result<Prompt, RowError> {
        match &self {
            Prompt::Text(text) if text.trim().is_empty() => Err(RowError::new(ErrorCode::EmptyPrompt, "the prompt is empty")),
            Prompt::Messages(m) if m.iter().all(|m| m.content.trim().is_empty()) => {
                Err(RowError::new(ErrorCode::EmptyPrompt, "the conversation has no message with content"))
            }
            _ => Ok(self),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_new_tokens`, or the end of the model's context.
    Length,
    /// A row with a JSON Schema reached `max_new_tokens` (or the context's end) before its JSON was complete.
    IncompleteJson,
    /// A prompt-scoring row: its completion was scored, nothing was generated.
    Scored,
    /// The row failed; see its error.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::IncompleteJson => "incomplete_json",
            FinishReason::Scored => "scored",
            FinishReason::Error => "error",
        }
    }
}

/// Characters of a row id shown in full; a longer id is cut to its first [`ID_SHOWN`].
const ID_LONGEST: usize = 80;
const ID_SHOWN: usize = 64;

/// The first [`ID_SHOWN`] characters of an id longer than [`ID_LONGEST`] characters.
fn long_id_head(id: &str) -> Option<&str> {
    id.char_indices().nth(ID_LONGEST)?;
    Some(&id[..id.char_indices().nth(ID_SHOWN).map_or(id.len(), |(i, _)| i)])
}

/// A row id as messages and logs show it: quoted, and cut to its first 64 characters (with its length in bytes)
/// when it is longer than 80, so that an id of any size cannot flood a message.
pub fn id_for_message(id: &str) -> String {
    match long_id_head(id) {
        None => format!("{id:?}"),
        Some(head) => format!("{head:?}... ({} bytes)", id.len()),
    }
}

/// [`id_for_message`] unquoted, for lists of ids in reports.
pub fn id_cut(id: &str) -> String {
    match long_id_head(id) {
        None => id.to_string(),
        Some(head) => format!("{head}... ({} bytes)", id.len()),
    }
}

#[cfg(test)]
mod id_tests {
    use super::id_for_message;

    #[test]
    fn long_ids_are_cut_in_messages_and_short_ones_kept() {
        assert_eq!(id_for_message("row-7"), "\"row-7\"");
        let long = "x".repeat(260_000);
        let shown = id_for_message(&long);
        assert!(shown.len() < 100 && shown.ends_with("... (260000 bytes)"), "{shown}");
        // Cut at a character, not a byte, boundary.
        let wide = "é".repeat(100);
        assert_eq!(id_for_message(&wide), format!("{:?}... (200 bytes)", "é".repeat(64)));
        assert_eq!(super::id_cut(&wide), format!("{}... (200 bytes)", "é".repeat(64)));
        assert_eq!(super::id_cut("p006"), "p006");
    }
}
