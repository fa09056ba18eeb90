//! Prompts -> validated token sequences.
//!
//! The [`Preprocessor`] applies the chat template and the tokenizer to each [`SourceRow`] and checks the result
//! against the model's context, so a row reaches the engine only as a [`PreparedRow`] with tokens that fit; every
//! other row becomes an error row here and skips the engine. Rows are processed in parallel on rayon.

pub mod gguf;
pub mod template;
pub mod vocab;

use rayon::prelude::*;

use crate::job::{ChatTemplateChoice, InputSpec, Truncate};
use crate::row::{ErrorCode, Message, Prompt, RowError, RowParams, RowTag};
use crate::source::{Completion, SourceRow};
pub use template::ChatTemplate;
pub use vocab::{TextStream, Tokenizer, VocabMetadata};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("the model's tokenizer is invalid: {0}")]
    Invalid(String),
    #[error("the model's chat template is invalid: {0}")]
    Template(String),
    #[error("the model has no chat template; set `model.chat_template = \"none\"` to tokenize prompts as they are")]
    NoTemplate,
}

/// A row ready for the engine, or the reason it is not.
#[derive(Clone, Debug)]
pub struct PreparedRow {
    pub id: String,
    pub tag: RowTag,
    pub params: RowParams,
    pub tokens: Result<Vec<u32>, RowError>,
    /// A scoring job's completion, tokenized on its own (no special tokens), to follow the prompt's tokens.
    pub completion: Option<Vec<u32>>,
}

/// How many bytes of text one token may cover at most, over its longest token's spelling (`longest_token`
/// bytes): normalizers may shrink text before it is cut into tokens, NFKC by up to 4 bytes to 1 (`𝐀` to `A`).
const NORMALIZED_SHRINK: usize = 4;

/// The most bytes a prompt's text (its messages' contents, or its text) may have for a tokenizer whose longest
/// token is spelt in `longest_token` bytes to fit `context` tokens: past it, every tokenization has more tokens
/// than the context (each token covers at most `longest_token` bytes of normalized text), so the row is
/// `prompt_too_long` before any template or tokenizer runs on it, or, with `input.truncate`, is cut to it first.
/// This bounds the memory and time one cell can take (a 50 MB cell took 10.7 GB to tokenize). A token's spelling
/// over-counts the bytes it covers (byte-level BPE's `Ġ` spells one byte in two; SentencePiece's `▁` one in three),
/// which only widens the bound. Only a normalizer that deletes text (BERT's accent stripping, given nothing but
/// combining marks) could fit more, and such a row is then reported too long instead of empty.
///
/// The bound holds only for a tokenizer that never emits an unknown token for text it cannot spell (byte-level BPE,
/// or byte fallback): an unknown token covers any run of text (WordPiece's `[UNK]` for a word over 100 characters,
/// SentencePiece's `<unk>` for a run of characters outside its vocabulary). For the others (`bytes_only` false) the
/// limit is [`MAX_PROMPT_BYTES`] or the bound, whichever is larger: memory stays bounded, and a prompt under it is
/// tokenized and judged by its tokens.
pub fn prompt_byte_limit(context: usize, longest_token: usize, bytes_only: bool) -> usize {
    let bound = context.saturating_mul(longest_token.max(1)).saturating_mul(NORMALIZED_SHRINK);
    if bytes_only {
        bound
    } else {
        bound.max(MAX_PROMPT_BYTES)
    }
}

/// The most bytes of text a prompt may have for a tokenizer whose unknown token could cover any of it: JSONL's
/// longest line.
pub const MAX_PROMPT_BYTES: usize = 16 << 20;

/// The longest spelling of any token of a vocabulary, in bytes.
pub fn longest_token<'a>(tokens: impl Iterator<Item = &'a str>) -> usize {
    tokens.map(str::len).max().unwrap_or(1)
}

/// Whether a `tokenizers` tokenizer spells every text without an unknown token: a BPE without one or with byte
/// fallback, a Unigram with byte fallback (WordPiece and WordLevel always have one).
fn hf_bytes_only(tokenizer: &tokenizers::Tokenizer) -> bool {
    use tokenizers::ModelWrapper;
    match tokenizer.get_model() {
        ModelWrapper::BPE(bpe) => bpe.unk_token.is_none() || bpe.byte_fallback,
        ModelWrapper::Unigram(unigram) => unigram.byte_fallback(),
        ModelWrapper::WordPiece(_) | ModelWrapper::WordLevel(_) => false,
    }
}

/// [`hf_bytes_only`] for a vocabulary: a GGUF one is byte-level BPE (`gpt2`, no unknown token) or has byte tokens
/// (SentencePiece's byte fallback); a Hugging Face one is asked.
fn vocab_bytes_only(vocab: &VocabMetadata) -> bool {
    match &vocab.tokenizer {
        Some(hf) => hf_bytes_only(hf),
        None => vocab.kind == "gpt2" || vocab.token_types.contains(&vocab::TOKEN_TYPE_BYTE),
    }
}

/// `prompt` within `limit` bytes of text (system prompt, messages' contents): as it is when it fits; else, with
/// `truncate`, its last user message (or text) cut on a character boundary from the side `truncate` drops, by
/// what is over; else `prompt_too_long`, naming the bytes, before anything tokenizes it.
fn within_bytes(mut prompt: Prompt, extra: usize, limit: usize, truncate: Truncate) -> Result<Prompt, RowError> {
    let total = extra
        + match &prompt {
            Prompt::Text(text) => text.len(),
            Prompt::Messages(messages) => messages.iter().map(|m| m.content.len() + m.role.len()).sum(),
        };
    if total <= limit {
        return Ok(prompt);
    }
    let too_long = || {
        RowError::new(
            ErrorCode::PromptTooLong,
            format!("the prompt has {total} bytes of text; more than {limit} bytes cannot fit the model's context (not tokenized)"),
        )
    };
    let content = match (&mut prompt, truncate) {
        (_, Truncate::None) => return Err(too_long()),
        (Prompt::Text(text), _) => text,
        (Prompt::Messages(messages), _) => match messages.iter_mut().rev().find(|m| m.role == "user") {
            Some(m) => &mut m.content,
            None => return Err(too_long()),
        },
    };
    let over = total - limit;
    if over >= content.len() {
        return Err(too_long());
    }
    let keep = content.len() - over;
    if truncate == Truncate::Left {
        let mut start = content.len() - keep;
        while !content.is_char_boundary(start) {
            start += 1;
        }
        content.drain(..start);
    } else {
        let mut end = keep;
        while !content.is_char_boundary(end) {
            end -= 1;
        }
        content.truncate(end);
    }
    Ok(prompt)
}

/// Everything needed to turn a row into tokens: tokenizer, template, limits.
pub struct Preprocessor {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    system_prompt: Option<String>,
    bos: Option<u32>,
    /// The EOS token a prompt ends with, for the rare vocabularies that ask for one (llama.cpp's `add_eos`).
    eos: Option<u32>,
    context_length: usize,
    truncate: Truncate,
    /// The job's `max_new_tokens`, for rows that do not set their own: truncation leaves room for the answer.
    max_new_tokens: u32,
    /// [`prompt_byte_limit`] of this vocabulary and context.
    max_prompt_bytes: usize,
}

impl Preprocessor {
    pub fn new(
        vocab: &VocabMetadata,
        choice: &ChatTemplateChoice,
        input: &InputSpec,
        context_length: usize,
        max_new_tokens: u32,
    ) -> Result<Preprocessor, TokenizerError> {
        let tokenizer = vocab::build(vocab)?;
        let token = |id: Option<u32>| id.and_then(|id| vocab.tokens.get(id as usize).cloned()).unwrap_or_default();
        let template = match choice {
            ChatTemplateChoice::Auto => {
                let source = vocab.chat_template.as_deref().ok_or(TokenizerError::NoTemplate)?;
                Some(ChatTemplate::new(source, token(vocab.bos), token(vocab.eos))?)
            }
            // A job without a template has neither a system prompt nor a messages column (`Job::parse`).
            ChatTemplateChoice::None => None,
        };
        Ok(Preprocessor {
            tokenizer,
            template,
            system_prompt: input.system_prompt.clone(),
            bos: vocab.bos.filter(|_| vocab.add_bos),
            eos: vocab.eos.filter(|_| vocab.add_eos),
            context_length,
            truncate: input.truncate,
            max_new_tokens,
            max_prompt_bytes: prompt_byte_limit(context_length, longest_token(vocab.tokens.iter().map(String::as_str)), vocab_bytes_only(vocab)),
        })
    }

    /// The most bytes of text a prompt may have ([`prompt_byte_limit`]).
    pub fn max_prompt_bytes(&self) -> usize {
        self.max_prompt_bytes
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The text the model sees for a prompt: the rendered chat template, or the prompt itself.
    pub fn render(&self, prompt: &Prompt) -> Result<String, RowError> {
        let Some(template) = &self.template else {
            return match prompt {
                Prompt::Text(text) => Ok(text.clone()),
                Prompt::Messages(_) => {
                    Err(RowError::new(ErrorCode::TemplateError, "a conversation needs a chat template; the job disables it"))
                }
            };
        };
        let mut messages = Vec::new();
        let has_system = matches!(prompt, Prompt::Messages(m) if m.first().is_some_and(|m| m.role == "system"));
        if let (Some(system), false) = (&self.system_prompt, has_system) {
            messages.push(Message { role: "system".into(), content: system.clone() });
        }
        match prompt {
            Prompt::Text(text) => messages.push(Message { role: "user".into(), content: text.clone() }),
            Prompt::Messages(m) => messages.extend(m.iter().cloned()),
        }
        template.render(&messages)
    }

    /// Token ids of a text, special tokens (`<|im_start|>`, ...) parsed, BOS added when the model asks for it (and
    /// the text does not start with it already, as a chat template that writes its BOS does), EOS likewise.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RowError> {
        let ids = self.tokenizer.encode(text, true).map_err(|e| RowError::new(ErrorCode::TemplateError, format!("tokenization failed: {e}")))?;
        let mut tokens = Vec::with_capacity(ids.len() + 2);
        if let Some(bos) = self.bos {
            if ids.first() != Some(&bos) {
                tokens.push(bos);
            }
        }
        tokens.extend_from_slice(&ids);
        if let Some(eos) = self.eos {
            tokens.push(eos);
        }
        Ok(tokens)
    }

    pub fn prepare(&self, row: SourceRow) -> PreparedRow {
        let vocab_size = self.tokenizer.vocab_size();
        let completion = match &row.completion {
            None => None,
            Some(Completion::Text(text)) => match self.tokenizer.encode(text, true) {
                Ok(ids) => Some(ids),
                Err(e) => {
                    let error = RowError::new(ErrorCode::TemplateError, format!("tokenization of the completion failed: {e}"));
                    return PreparedRow { id: row.id, tag: row.tag, params: row.params, tokens: Err(error), completion: None };
                }
            },
            Some(Completion::Tokens(ids)) => match ids.iter().find(|&&id| !(0..vocab_size as i64).contains(&id)) {
                None => Some(ids.iter().map(|&id| id as u32).collect()),
                Some(bad) => {
                    let error = RowError::new(ErrorCode::InvalidCompletion, format!("the completion's token id {bad} is outside the vocabulary of {vocab_size} tokens"));
                    return PreparedRow { id: row.id, tag: row.tag, params: row.params, tokens: Err(error), completion: None };
                }
            },
        };
        let max_new_tokens = match &completion {
            Some(c) => c.len(),
            None => row.params.max_new_tokens.unwrap_or(self.max_new_tokens) as usize,
        };
        let system_bytes = self.system_prompt.as_ref().map_or(0, String::len);
        let tokens = row.prompt.and_then(|prompt| {
            let prompt = within_bytes(prompt, system_bytes, self.max_prompt_bytes, self.truncate)?;
            let tokens = self.encode(&self.render(&prompt)?)?;
            if tokens.is_empty() {
                return Err(RowError::new(ErrorCode::EmptyPrompt, "the prompt, with the chat template, is no tokens at all"));
            }
            // At least one position must remain for the first generated token (or all of the completion to score).
            if tokens.len() + completion.as_ref().map_or(0, |c| c.len().saturating_sub(1)) < self.context_length {
                return Ok(tokens);
            }
            if completion.as_ref().is_some_and(|c| c.len() >= self.context_length / 2) {
                return Err(RowError::new(
                    ErrorCode::PromptTooLong,
                    format!("the completion to score has {} tokens; the model's context is {} tokens", max_new_tokens, self.context_length),
                ));
            }
            if self.truncate == Truncate::None {
                return Err(RowError::new(
                    ErrorCode::PromptTooLong,
                    format!(
                        "the prompt has {} tokens; the model's context is {} tokens (set `input.truncate` to cut long prompts)",
                        tokens.len(),
                        self.context_length
                    ),
                ));
            }
            // Leave room for the answer: its full length, up to half the context.
            let limit = self.context_length - max_new_tokens.min(self.context_length / 2).max(1);
            self.truncated(prompt, tokens.len(), limit)
        });
        PreparedRow { id: row.id, tag: row.tag, params: row.params, tokens, completion }
    }

    /// Cuts the last user message (the text a summarisation or extraction row carries) from the left or the right
    /// until the rendered prompt has at most `limit` tokens; the chat template's own tokens are never cut.
    fn truncated(&self, mut prompt: Prompt, mut total: usize, limit: usize) -> Result<Vec<u32>, RowError> {
        for _ in 0..4 {
            let content = match &mut prompt {
                Prompt::Text(text) => text,
                Prompt::Messages(messages) => match messages.iter_mut().rev().find(|m| m.role == "user") {
                    Some(m) => &mut m.content,
                    None => break,
                },
            };
            let ids = self
                .tokenizer
                .encode(content.as_str(), false)
                .map_err(|e| RowError::new(ErrorCode::TemplateError, format!("tokenization failed: {e}")))?;
            // Two tokens of slack: a cut can change how the text next to it merges.
            let keep = ids.len().saturating_sub(total.saturating_sub(limit) + 2);
            if keep == 0 {
                break;
            }
            let kept = match self.truncate {
                Truncate::Left => &ids[ids.len() - keep..],
                _ => &ids[..keep],
            };
            *content = self.tokenizer.decode(kept, false);
            let tokens = self.encode(&self.render(&prompt)?)?;
            if tokens.len() <= limit {
                return Ok(tokens);
            }
            total = tokens.len();
        }
        Err(RowError::new(
            ErrorCode::PromptTooLong,
            format!("the prompt cannot be cut to fit the context of {} tokens: the rest of it is too long", self.context_length),
        ))
    }

}

/// Turns source rows into prepared rows; the tokenizer thread runs one of these for either job kind.
pub trait Prepare: Send + Sync {
    fn prepare(&self, row: SourceRow) -> PreparedRow;

    /// Prepares a batch of rows in parallel, keeping their order.
    fn prepare_all(&self, rows: Vec<SourceRow>) -> Vec<PreparedRow> {
        rows.into_par_iter().map(|row| self.prepare(row)).collect()
    }
}

impl Prepare for Preprocessor {
    fn prepare(&self, row: SourceRow) -> PreparedRow {
        Preprocessor::prepare(self, row)
    }
}

/// Rows -> token ids for an encoder: the text as it is (no chat template), with the model's special tokens
/// (`[CLS] ... [SEP]`), checked against the model's maximum length.
pub struct EncoderPreprocessor {
    tokenizer: EncoderTokenizer,
    max_tokens: usize,
    truncate: Truncate,
    /// [`prompt_byte_limit`] of this vocabulary and `max_tokens`.
    max_bytes: usize,
}

enum EncoderTokenizer {
    /// A `tokenizer.json`, and the same tokenizer cutting rows to `max_tokens` from the side `input.truncate`
    /// names.
    Hf { tokenizer: Box<tokenizers::Tokenizer>, truncating: Option<Box<tokenizers::Tokenizer>> },
    /// A GGUF file's vocabulary (a T5 file's): special tokens added as llama.cpp adds them (T5's `</s>` at the end),
    /// and kept when a row is cut.
    Gguf(std::sync::Arc<gguf::Vocab>),
}

impl EncoderPreprocessor {
    pub fn new(tokenizer: tokenizers::Tokenizer, max_tokens: usize, truncate: Truncate) -> Result<Self, TokenizerError> {
        use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};
        let truncating = match truncate {
            Truncate::None => None,
            side => {
                let mut t = tokenizer.clone();
                let direction = if side == Truncate::Left { TruncationDirection::Left } else { TruncationDirection::Right };
                t.with_truncation(Some(TruncationParams { max_length: max_tokens, direction, strategy: TruncationStrategy::LongestFirst, stride: 0 }))
                    .map_err(|e| TokenizerError::Invalid(e.to_string()))?;
                Some(Box::new(t))
            }
        };
        let max_bytes = prompt_byte_limit(max_tokens, longest_token(tokenizer.get_vocab(true).keys().map(String::as_str)), hf_bytes_only(&tokenizer));
        Ok(EncoderPreprocessor { tokenizer: EncoderTokenizer::Hf { tokenizer: Box::new(tokenizer), truncating }, max_tokens, truncate, max_bytes })
    }

    /// Rows tokenized by a GGUF file's vocabulary. Only the memory cap bounds a row's bytes before tokenizing: an
    /// unknown token may stand for any run of text.
    pub fn gguf(vocab: std::sync::Arc<gguf::Vocab>, max_tokens: usize, truncate: Truncate) -> Result<Self, TokenizerError> {
        let specials = usize::from(vocab.add_bos) + usize::from(vocab.add_eos);
        if max_tokens <= specials {
            return Err(TokenizerError::Invalid(format!("{max_tokens} tokens leave no room for text beside the vocabulary's special tokens")));
        }
        Ok(EncoderPreprocessor { tokenizer: EncoderTokenizer::Gguf(vocab), max_tokens, truncate, max_bytes: MAX_PROMPT_BYTES })
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, RowError> {
        let failed = |e: &dyn std::fmt::Display| RowError::new(ErrorCode::TemplateError, format!("tokenization failed: {e}"));
        match &self.tokenizer {
            EncoderTokenizer::Hf { tokenizer, truncating } => {
                let tokenizer = truncating.as_deref().unwrap_or(tokenizer);
                tokenizer.encode_fast(text, true).map(|e| e.get_ids().to_vec()).map_err(|e| failed(&e))
            }
            EncoderTokenizer::Gguf(vocab) => {
                // Control tokens' texts (T5's sentinels, `<extra_id_0>`) are those tokens, as a tokenizer.json
                // parses its added tokens.
                let ids = vocab.tokenize(text.as_bytes(), true, true).map_err(|e| failed(&e))?;
                if ids.len() <= self.max_tokens || self.truncate == Truncate::None {
                    return Ok(ids);
                }
                let (front, back) = (usize::from(vocab.add_bos), usize::from(vocab.add_eos));
                let keep = self.max_tokens - front - back;
                let body = &ids[front..ids.len() - back];
                let body = if self.truncate == Truncate::Left { &body[body.len() - keep..] } else { &body[..keep] };
                Ok([&ids[..front], body, &ids[ids.len() - back..]].concat())
            }
        }
    }
}

impl Prepare for EncoderPreprocessor {
    fn prepare(&self, row: SourceRow) -> PreparedRow {
        let tokens = row.prompt.and_then(|prompt| {
            let Prompt::Text(text) = within_bytes(prompt, 0, self.max_bytes, self.truncate)? else {
                return Err(RowError::new(ErrorCode::InvalidMessages, "an embedding row is a text, not a conversation"));
            };
            let ids = self.tokenize(&text)?;
            if ids.len() > self.max_tokens {
                return Err(RowError::new(
                    ErrorCode::PromptTooLong,
                    format!(
                        "the row has {} tokens; the model takes at most {} (set `input.truncate` to cut long rows)",
                        ids.len(),
                        self.max_tokens
                    ),
                ));
            }
            Ok(ids)
        });
        PreparedRow { id: row.id, tag: row.tag, params: row.params, tokens, completion: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Prompt {
        Prompt::Messages(vec![Message { role: "system".into(), content: "be brief".into() }, Message { role: "user".into(), content: text.into() }])
    }

    #[test]
    fn a_prompt_over_the_byte_limit_is_too_long_or_cut_on_a_character_boundary() {
        // 2 tokens of at most 3 bytes, normalized text shrinking up to 4 to 1: 24 bytes.
        let limit = prompt_byte_limit(2, longest_token(["a", "abc", "ab"].into_iter()), true);
        assert_eq!(limit, 24);
        // A vocabulary with an unknown token, which may cover any run of text: only the memory cap.
        assert_eq!(prompt_byte_limit(2, 3, false), MAX_PROMPT_BYTES);
        let fits = "x".repeat(limit);
        assert!(matches!(within_bytes(Prompt::Text(fits.clone()), 0, limit, Truncate::None), Ok(Prompt::Text(t)) if t == fits));
        let err = within_bytes(Prompt::Text(format!("{fits}y")), 0, limit, Truncate::None).unwrap_err();
        assert_eq!(err.code, ErrorCode::PromptTooLong);
        assert!(err.message.contains("25 bytes") && err.message.contains("not tokenized"), "{}", err.message);
        // The system prompt counts; the roles too.
        assert!(within_bytes(Prompt::Text(fits.clone()), 1, limit, Truncate::None).is_err());
        // Cut from the right, keeping the start, never inside a character (é is two bytes).
        let text = format!("{}é{}", "a".repeat(23), "z".repeat(10));
        let Ok(Prompt::Text(right)) = within_bytes(Prompt::Text(text.clone()), 0, limit, Truncate::Right) else { panic!() };
        assert_eq!(right, "a".repeat(23), "the é straddles byte 24: dropped whole");
        let Ok(Prompt::Text(left)) = within_bytes(Prompt::Text(text), 0, limit, Truncate::Left) else { panic!() };
        assert_eq!(left, format!("{}é{}", "a".repeat(12), "z".repeat(10)));
        // In a conversation, the last user message is cut and the rest kept.
        let Ok(Prompt::Messages(m)) = within_bytes(user(&"q".repeat(100)), 0, limit, Truncate::Right) else { panic!() };
        assert_eq!((m[0].content.as_str(), m[1].content.len()), ("be brief", limit - "be brief".len() - "system".len() - "user".len()));
        // What the last user message cannot absorb is too long.
        let huge_system = Prompt::Messages(vec![Message { role: "system".into(), content: "s".repeat(100) }, Message { role: "user".into(), content: "q".into() }]);
        assert_eq!(within_bytes(huge_system, 0, limit, Truncate::Right).unwrap_err().code, ErrorCode::PromptTooLong);
    }
}
