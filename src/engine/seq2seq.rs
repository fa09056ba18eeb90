//! Encoder-decoder generation (`kind = "seq2seq"`, the T5 family): the encoder runs once per request, the decoder
//! generates with cross-attention over that request's cached encoder output and its own KV cache.
//!
//! [`Seq2SeqEngine`] implements the same [`Engine`] interface as the decoder-only engine, so jobs get the same
//! drive loop, per-choice decode state (sampling, stopping, log-probabilities), output schema, commits and
//! resuming: every step first encodes the newly admitted requests together, then decodes one token of every
//! running sequence in one batched pass, and a finished sequence's place is free for the next request at once.

use std::collections::HashSet;
use std::time::Instant;

use crate::tokenize::Tokenizer;

use super::choice::{self, ChoiceState, RowTiming, Rules};
use super::models::StepLogits;
use super::models::t5::{DecoderState, T5};
use super::{Engine, EngineError, EngineStats, Request};
use crate::job::GenerationParams;
use crate::outcome::{Outcome, RowFailure};
use crate::row::{ErrorCode, FinishReason, RowError};

/// The longest source a request may have, in tokens (T5's training length; relative positions have no hard limit,
/// but the encoder's attention grows with its square).
pub const MAX_SOURCE_TOKENS: usize = 512;

struct Sequence {
    request: Request,
    params: GenerationParams,
    state: DecoderState,
    /// The decoder's next input: the start token, then each sampled token.
    next: u32,
    choice: ChoiceState,
    timing: RowTiming,
}

pub struct Seq2SeqEngine {
    model: T5,
    tokenizer: Tokenizer,
    params: GenerationParams,
    /// The model's end-of-sequence token: T5 ends its output with it.
    end_tokens: HashSet<u32>,
    max_seqs: usize,
    waiting: Vec<(Request, GenerationParams, Instant)>,
    running: Vec<Sequence>,
    stats: EngineStats,
}

impl Seq2SeqEngine {
    pub fn new(model: T5, tokenizer: Tokenizer, params: GenerationParams, max_seqs: usize) -> Self {
        let end_tokens = HashSet::from([model.config.eos_token_id as u32]);
        Seq2SeqEngine { model, tokenizer, params, end_tokens, max_seqs, waiting: Vec::new(), running: Vec::new(), stats: EngineStats::default() }
    }

    pub fn model(&self) -> &T5 {
        &self.model
    }

    fn encode_waiting(&mut self) -> Result<Vec<Outcome>, EngineError> {
        let waiting = std::mem::take(&mut self.waiting);
        let rows: Vec<&[u32]> = waiting.iter().map(|(r, ..)| r.tokens.as_slice()).collect();
        let outputs = self.model.encode(&rows)?;
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        self.stats.prefill_tokens += (rows.len() * longest) as u64;
        let mut failed = Vec::new();
        for ((request, params, admitted), output) in waiting.into_iter().zip(outputs) {
            let state = self.model.start(&output)?;
            let choice = match ChoiceState::new(0, &request.id, &params, params.max_new_tokens as usize, None) {
                Ok(choice) => choice,
                Err(e) => {
                    failed.push(Outcome::Failed(request.fail(RowError::new(ErrorCode::EngineError, e))));
                    continue;
                }
            };
            let timing = RowTiming { admitted: Some(admitted), ..RowTiming::new(request.arrival) };
            self.running.push(Sequence { next: self.model.config.decoder_start(), request, params, state, choice, timing });
        }
        Ok(failed)
    }

    /// Chooses a sequence's next token and applies it; returns why it finished, if it did.
    fn decide(&mut self, index: usize, logits: Vec<f32>, now: Instant) -> Result<Option<FinishReason>, String> {
        let seq = &mut self.running[index];
        let rules = Rules { params: &seq.params, tokenizer: &self.tokenizer, end_tokens: &self.end_tokens, penalty_prompt: &[] };
        let token = seq.choice.choose(StepLogits::Full(logits), &rules)?;
        seq.timing.first_token.get_or_insert(now);
        let finished = seq.choice.advance(token, &rules, false)?;
        seq.next = token;
        Ok(finished)
    }

    fn finish(&mut self, index: usize, reason: FinishReason, now: Instant) -> Outcome {
        let seq = self.running.swap_remove(index);
        let finished = seq.choice.finish(reason, &self.tokenizer);
        Outcome::Completed(choice::complete(seq.request, seq.params, seq.timing, vec![finished], now))
    }
}

impl Engine for Seq2SeqEngine {
    fn free_places(&self) -> usize {
        self.max_seqs.saturating_sub(self.running.len() + self.waiting.len())
    }

    fn admit(&mut self, request: Request) -> Result<(), RowFailure> {
        match self.params.for_row(&request.params) {
            Ok(params) => {
                self.waiting.push((request, params, Instant::now()));
                Ok(())
            }
            Err(m) => Err(request.fail(RowError::new(ErrorCode::InvalidParameters, m))),
        }
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn step(&mut self) -> Result<Vec<Outcome>, EngineError> {
        let mut results = if self.waiting.is_empty() { Vec::new() } else { self.encode_waiting()? };
        if self.running.is_empty() {
            return Ok(results);
        }
        let tokens: Vec<u32> = self.running.iter().map(|s| s.next).collect();
        let logits = {
            let mut states: Vec<&mut DecoderState> = self.running.iter_mut().map(|s| &mut s.state).collect();
            self.model.decode_step(&tokens, &mut states)?
        };
        let now = Instant::now();
        self.stats.steps += 1;
        self.stats.decode_tokens += tokens.len() as u64;
        self.stats.peak_running = self.stats.peak_running.max(self.running.len());
        let bytes: usize = self.running.iter().map(|s| s.state.bytes()).sum();
        self.stats.peak_kv_bytes = self.stats.peak_kv_bytes.max(bytes);
        let mut settled = Vec::new();
        for (index, row) in logits.into_iter().enumerate() {
            match self.decide(index, row, now) {
                Ok(Some(reason)) => settled.push((index, Ok(reason))),
                Ok(None) => {}
                Err(e) => settled.push((index, Err(e))),
            }
        }
        // Highest index first: `swap_remove` moves only sequences past the ones still to remove.
        settled.sort_by_key(|s| std::cmp::Reverse(s.0));
        for (index, result) in settled {
            results.push(match result {
                Ok(reason) => self.finish(index, reason, now),
                Err(e) => Outcome::Failed(self.running.swap_remove(index).request.fail(RowError::new(ErrorCode::EngineError, e))),
            });
        }
        Ok(results)
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = EngineStats::default();
    }
}
