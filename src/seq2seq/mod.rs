//! Encoder-decoder generation (`kind = "seq2seq"`, the T5 family): the encoder runs once per request, the decoder
//! generates with cross-attention over that request's cached encoder output and its own KV cache.
//!
//! [`Seq2SeqEngine`] implements the same [`Engine`] interface as the decoder-only engine, so jobs get the same
//! continuous batching loop, sampling, stopping, output schema, commits and resuming: every step first encodes
//! the newly admitted requests together, then decodes one token of every running sequence in one batched pass,
//! and a finished sequence's place is free for the next request at once.

pub mod model;

use std::time::Instant;

use tokenizers::Tokenizer;

use crate::engine::sampling::{self, Rng};
use crate::engine::{Choice, Completion, Engine, EngineError, EngineStats, Request, RowResult, StopScan};
use crate::job::GenerationParams;
use crate::row::FinishReason;
pub use model::{DecoderState, T5Config, T5};

/// The longest source a request may have, in tokens (T5's training length; relative positions have no hard limit,
/// but the encoder's attention grows with its square).
pub const MAX_SOURCE_TOKENS: usize = 512;

struct Sequence {
    request: Request,
    state: DecoderState,
    /// The decoder's next input: the start token, then each sampled token.
    next: u32,
    generated: Vec<u32>,
    /// Tokens sampled, the end-of-sequence token included.
    sampled: u32,
    stop_scan: StopScan,
    /// The output, when a stop string ended it.
    cut_text: Option<String>,
    params: GenerationParams,
    rng: Rng,
    /// Output token counts, for the penalties.
    counts: std::collections::HashMap<u32, u32>,
    admitted: Instant,
    first_token: Option<Instant>,
}

pub struct Seq2SeqEngine {
    model: T5,
    tokenizer: Tokenizer,
    params: GenerationParams,
    max_seqs: usize,
    waiting: Vec<(Request, Instant)>,
    running: Vec<Sequence>,
    stats: EngineStats,
}

impl Seq2SeqEngine {
    pub fn new(model: T5, tokenizer: Tokenizer, params: GenerationParams, max_seqs: usize) -> Self {
        Seq2SeqEngine { model, tokenizer, params, max_seqs, waiting: Vec::new(), running: Vec::new(), stats: EngineStats::default() }
    }

    pub fn model(&self) -> &T5 {
        &self.model
    }

    fn encode_waiting(&mut self) -> Result<(), EngineError> {
        let waiting = std::mem::take(&mut self.waiting);
        let rows: Vec<&[u32]> = waiting.iter().map(|(r, _)| r.tokens.as_slice()).collect();
        let outputs = self.model.encode(&rows).map_err(|e| EngineError::new(e.to_string()))?;
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        self.stats.prefill_tokens += (rows.len() * longest) as u64;
        for ((request, admitted), output) in waiting.into_iter().zip(outputs) {
            let state = self.model.start(&output).map_err(|e| EngineError::new(e.to_string()))?;
            let params = self.params.for_row(&request.params).expect("checked at admission");
            let rng = Rng::new(sampling::row_seed(params.seed, &request.id));
            self.running.push(Sequence {
                next: self.model.config.decoder_start(),
                request,
                state,
                generated: Vec::new(),
                sampled: 0,
                stop_scan: StopScan::default(),
                cut_text: None,
                params,
                rng,
                counts: Default::default(),
                admitted,
                first_token: None,
            });
        }
        Ok(())
    }

    /// Applies a sampled token; returns why the sequence finished, if it did.
    fn advance(&mut self, index: usize, token: u32, now: Instant) -> Option<FinishReason> {
        let eos = self.model.config.eos_token_id as u32;
        let seq = &mut self.running[index];
        seq.sampled += 1;
        seq.first_token.get_or_insert(now);
        if token == eos {
            return Some(FinishReason::Stop);
        }
        seq.generated.push(token);
        if seq.params.has_penalties() {
            *seq.counts.entry(token).or_insert(0) += 1;
        }
        if let Some(text) = seq.stop_scan.push(&self.tokenizer, token, &seq.params.stop, true, seq.params.include_stop_str_in_output) {
            seq.cut_text = Some(text);
            return Some(FinishReason::Stop);
        }
        if seq.generated.len() >= seq.params.max_new_tokens as usize {
            return Some(FinishReason::Length);
        }
        seq.next = token;
        None
    }

    fn finish(&mut self, index: usize, reason: FinishReason, now: Instant) -> Completion {
        let seq = self.running.swap_remove(index);
        let sampled = seq.sampled;
        let text = seq.cut_text.unwrap_or_else(|| self.tokenizer.decode(&seq.generated, true).unwrap_or_default());
        let arrival = seq.request.arrival;
        let first = seq.first_token.unwrap_or(now);
        Completion {
            tag: seq.request.tag,
            id: seq.request.id,
            choices: vec![Choice { index: 0, text, finish_reason: reason, completion_tokens: sampled, logprobs: None, cumulative_logprob: None }],
            params: seq.params,
            prompt_tokens: seq.request.tokens.len() as u32,
            queue_s: (seq.admitted - arrival).as_secs_f64(),
            ttft_s: (first - arrival).as_secs_f64(),
            e2e_s: (now - arrival).as_secs_f64(),
            tpot_s: (sampled > 1).then(|| (now - first).as_secs_f64() / (sampled - 1) as f64),
        }
    }
}

impl Engine for Seq2SeqEngine {
    fn free_places(&self) -> usize {
        self.max_seqs.saturating_sub(self.running.len() + self.waiting.len())
    }

    fn admit(&mut self, request: Request) -> Result<(), crate::row::RowError> {
        self.params.for_row(&request.params).map_err(|m| crate::row::RowError::new(crate::row::ErrorCode::InvalidParameters, m))?;
        self.waiting.push((request, Instant::now()));
        Ok(())
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn step(&mut self) -> Result<Vec<RowResult>, EngineError> {
        if !self.waiting.is_empty() {
            self.encode_waiting()?;
        }
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<u32> = self.running.iter().map(|s| s.next).collect();
        let logits = {
            let mut states: Vec<&mut DecoderState> = self.running.iter_mut().map(|s| &mut s.state).collect();
            self.model.decode_step(&tokens, &mut states).map_err(|e| EngineError::new(e.to_string()))?
        };
        let now = Instant::now();
        self.stats.steps += 1;
        self.stats.decode_tokens += tokens.len() as u64;
        self.stats.peak_running = self.stats.peak_running.max(self.running.len());
        let bytes: usize = self.running.iter().map(|s| s.state.bytes()).sum();
        self.stats.peak_kv_bytes = self.stats.peak_kv_bytes.max(bytes);
        let mut finished = Vec::new();
        for (index, mut row) in logits.into_iter().enumerate() {
            let seq = &mut self.running[index];
            if seq.params.has_penalties() {
                sampling::apply_penalties(&mut row, &seq.params, &[], &seq.counts);
            }
            let token = sampling::sample(&row, &seq.params, &mut seq.rng);
            if let Some(reason) = self.advance(index, token, now) {
                finished.push((index, reason));
            }
        }
        finished.sort_by(|a, b| b.0.cmp(&a.0));
        Ok(finished.into_iter().map(|(index, reason)| Ok(self.finish(index, reason, now))).collect())
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }
}
