//! The decode state of one choice (one generated answer of a row), shared by every generating engine: its
//! tokens, its sampling (penalties, masks, the RNG), its stop conditions, its log-probabilities and its timing;
//! and the arithmetic that turns finished choices into a row's [`Completion`].

use std::collections::{HashMap, HashSet};
use std::time::Instant;


use super::constraint::{Constraint, Grammar};
use super::models::StepLogits;
use super::sampling::{self, Rng};
use crate::job::GenerationParams;
use crate::outcome::{Choice, Completion, TokenLogprob, TopLogprob};
use super::Request;
use crate::row::FinishReason;
use crate::tokenize::{TextStream, Tokenizer};

/// Token texts that end a turn in common chat formats; a control token with one of these names stops generation
/// even when the model's metadata names a different EOS token.
const END_OF_TURN_TOKENS: &[&str] = &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"];

/// A row's error when the model computes a NaN logit (for the token it would choose or score).
pub const NAN_LOGITS: &str = "the model computed a NaN logit: the file's weights or metadata, or an engine bug (no token is chosen from NaN)";

/// How generation ends, from the model's vocabulary and the job's parameters.
#[derive(Clone, Debug)]
pub struct StopRules {
    pub end_tokens: HashSet<u32>,
    /// The model's EOS token, when it names one.
    pub eos: Option<u32>,
}

impl StopRules {
    pub fn new(vocab: &crate::tokenize::VocabMetadata) -> StopRules {
        let mut end_tokens: HashSet<u32> = [vocab.eos, vocab.eot].into_iter().flatten().chain(vocab.more_ends.iter().copied()).collect();
        for (id, token) in vocab.tokens.iter().enumerate() {
            if vocab.token_types.get(id) == Some(&crate::tokenize::vocab::TOKEN_TYPE_CONTROL) && END_OF_TURN_TOKENS.contains(&token.as_str()) {
                end_tokens.insert(id as u32);
            }
        }
        StopRules { end_tokens, eos: vocab.eos }
    }
}

/// Watches a sequence's generated text for stop strings. Text is detokenized incrementally, and each new piece is
/// searched together with the tail of the earlier text that a stop string could straddle, so a step costs the
/// same however long the output already is.
#[derive(Debug, Default)]
pub struct StopScan {
    stream: TextStream,
    text: String,
}

impl StopScan {
    /// Adds a generated token; when a stop string is now complete (and `active`: `min_new_tokens` are out),
    /// returns the output cut before it, or after it when `include` asks to keep it.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32, stops: &[String], active: bool, include: bool) -> Option<String> {
        let longest = stops.iter().map(String::len).max()?;
        let before = self.text.len();
        self.text.push_str(&self.stream.push(tokenizer, token));
        if !active {
            return None;
        }
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let (at, stop) = stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, s))).min_by_key(|m| m.0)?;
        Some(self.text[..if include { at + stop.len() } else { at }].to_string())
    }
}

/// What a choice's decisions read, the same for every choice of a row.
pub struct Rules<'a> {
    /// The row's parameters (the job's, with the row's own values).
    pub params: &'a GenerationParams,
    pub tokenizer: &'a Tokenizer,
    /// Tokens that end the output: the model's end-of-turn tokens (a T5 model's EOS).
    pub end_tokens: &'a HashSet<u32>,
    /// The prompt's distinct tokens, for a repetition penalty (empty without one).
    pub penalty_prompt: &'a [u32],
}

/// One choice being generated.
pub struct ChoiceState {
    index: u32,
    generated: Vec<u32>,
    /// Tokens sampled, the end token included; for a scoring row, the completion's tokens scored.
    sampled: u32,
    max_new_tokens: usize,
    stop_scan: StopScan,
    /// The output, when a stop string ended it.
    cut_text: Option<String>,
    rng: Rng,
    /// How often each token occurs in the output; kept only when a penalty needs it.
    counts: HashMap<u32, u32>,
    logprobs: Option<Vec<TokenLogprob>>,
    constraint: Option<Constraint>,
}

impl ChoiceState {
    /// Choice `index` of row `row_id`: its RNG seeded from the job's seed, the row's id and the index, its
    /// constraint from the row's grammar. Err: the grammar cannot start.
    pub fn new(index: u32, row_id: &str, params: &GenerationParams, max_new_tokens: usize, grammar: Option<&Grammar>) -> Result<ChoiceState, String> {
        Ok(ChoiceState {
            index,
            generated: Vec::new(),
            sampled: 0,
            max_new_tokens,
            stop_scan: StopScan::default(),
            cut_text: None,
            rng: Rng::new(sampling::choice_seed(params.seed, row_id, index)),
            counts: HashMap::new(),
            logprobs: params.logprobs.map(|_| Vec::new()),
            constraint: grammar.map(Constraint::new).transpose()?,
        })
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    pub fn sampled(&self) -> u32 {
        self.sampled
    }

    /// The most tokens it may generate (the row's `max_new_tokens`, less where the context is shorter).
    pub fn max_new_tokens(&self) -> usize {
        self.max_new_tokens
    }

    /// The tokens generated so far (a preempted sequence is prefilled again with them).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Whether the next token is the plain argmax of the logits: greedy with nothing that reads or changes the
    /// logits (penalties, logprobs, a grammar), and `min_new_tokens` reached. The device may then choose it.
    pub fn takes_argmax(&self, p: &GenerationParams) -> bool {
        p.is_plain_greedy() && self.sampled >= p.min_new_tokens
    }

    /// Chooses the next token from its logits: penalties, masks (`min_new_tokens`, the JSON grammar), then greedy
    /// or sampling; records its log-probability when asked.
    pub fn choose(&mut self, logits: StepLogits, rules: &Rules<'_>) -> Result<u32, String> {
        let p = rules.params;
        let mut logits = match logits {
            // The device chose it: asked for only where the fast path below applies ([`Self::takes_argmax`]).
            StepLogits::Argmax(token) => return Ok(token),
            StepLogits::Full(logits) => logits,
        };
        // A NaN logit is the model's (or the engine's) failure, never a token: the row fails, naming it.
        if sampling::has_nan(&logits) {
            return Err(NAN_LOGITS.into());
        }
        if self.takes_argmax(p) {
            // The fast path: no copy, no pass over the logits beyond the argmax.
            return Ok(sampling::argmax(&logits));
        }
        let raw = p.logprobs.map(|k| (k, logits.clone()));
        sampling::apply_penalties(&mut logits, p, rules.penalty_prompt, &self.counts);
        if let Some(c) = &mut self.constraint {
            c.mask(&mut logits)?;
        }
        if self.sampled < p.min_new_tokens {
            // End tokens and stop token ids are held back until `min_new_tokens`, unless nothing else is allowed.
            let ends = rules.end_tokens.iter().filter(|_| !p.ignore_eos).chain(&p.stop_token_ids);
            let held: Vec<(usize, f32)> = ends.filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l))).collect();
            for &(t, _) in &held {
                logits[t] = f32::NEG_INFINITY;
            }
            if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
                for (t, l) in held {
                    logits[t] = l;
                }
            }
        }
        let token = sampling::sample(&logits, p, &mut self.rng);
        if let Some((k, raw)) = raw {
            let lp = token_logprob(rules.tokenizer, &raw, token, k);
            self.logprobs.as_mut().expect("logprobs were asked for").push(lp);
        }
        Ok(token)
    }

    /// Applies a chosen token; returns why the choice finished, if it did. `at_limit`: the sequence has no room
    /// for another position (the context or the KV cache budget).
    pub fn advance(&mut self, token: u32, rules: &Rules<'_>, at_limit: bool) -> Result<Option<FinishReason>, String> {
        let p = rules.params;
        self.sampled += 1;
        // `choose` lets an end token through only after `min_new_tokens`, or when nothing else was allowed.
        if (!p.ignore_eos && rules.end_tokens.contains(&token)) || p.stop_token_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        // Stop strings count from the token that completes `min_new_tokens` (as vLLM).
        let min_done = self.sampled >= p.min_new_tokens;
        self.generated.push(token);
        if p.has_penalties() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        if let Some(c) = &mut self.constraint {
            c.consume(token)?;
        }
        if let Some(text) = self.stop_scan.push(rules.tokenizer, token, &p.stop, min_done, p.include_stop_str_in_output) {
            self.cut_text = Some(text);
            return Ok(Some(FinishReason::Stop));
        }
        if self.constraint.as_ref().is_some_and(|c| c.is_stopped()) {
            return Ok(Some(FinishReason::Stop));
        }
        if self.generated.len() >= self.max_new_tokens || at_limit {
            let complete = self.constraint.as_mut().is_none_or(|c| c.is_accepting());
            return Ok(Some(if complete { FinishReason::Length } else { FinishReason::IncompleteJson }));
        }
        Ok(None)
    }

    /// A scoring row's result: the log-probability of each completion token.
    pub fn scored(&mut self, logprobs: Vec<TokenLogprob>) {
        self.sampled = logprobs.len() as u32;
        self.logprobs = Some(logprobs);
    }

    /// The finished choice.
    pub fn finish(self, reason: FinishReason, tokenizer: &Tokenizer) -> Choice {
        let text = match (reason, self.cut_text) {
            (FinishReason::Scored, _) => String::new(),
            (_, Some(text)) => text,
            (_, None) => tokenizer.decode(&self.generated, true),
        };
        Choice {
            index: self.index,
            text,
            finish_reason: reason,
            completion_tokens: self.sampled,
            cumulative_logprob: self.logprobs.as_ref().map(|l| l.iter().map(|t| t.logprob as f64).sum()),
            logprobs: self.logprobs,
        }
    }
}

/// Reported log-probabilities of `token` at a position with these (raw) logits, with the `top` most likely.
pub fn token_logprob(tokenizer: &Tokenizer, logits: &[f32], token: u32, top: u32) -> TokenLogprob {
    let (logprob, alternatives) = sampling::logprobs(logits, token, top as usize);
    let text = |t: u32| tokenizer.token_text(t);
    TokenLogprob {
        token_id: token,
        token: text(token),
        logprob,
        top: alternatives.into_iter().map(|(t, lp)| TopLogprob { token_id: t, token: text(t), logprob: lp }).collect(),
    }
}

/// A row's timeline in an engine: when it was ready (its request's arrival), admitted (its prefill began, the end of
/// its queue time) and when its first token came.
#[derive(Clone, Copy, Debug)]
pub struct RowTiming {
    pub arrival: Instant,
    pub admitted: Option<Instant>,
    pub first_token: Option<Instant>,
}

impl RowTiming {
    pub fn new(arrival: Instant) -> RowTiming {
        RowTiming { arrival, admitted: None, first_token: None }
    }
}

/// A finished row's result: its request, the parameters it ran with, its timing and its finished choices (by
/// index), at `now`.
pub fn complete(request: Request, params: GenerationParams, timing: RowTiming, choices: Vec<Choice>, now: Instant) -> Completion {
    let RowTiming { arrival, admitted, first_token } = timing;
    let first = first_token.unwrap_or(now);
    let most_sampled = choices.iter().map(|c| c.completion_tokens).max().unwrap_or(0);
    Completion {
        prompt_tokens: request.tokens.len() as u32,
        cached_tokens: 0,
        id: request.id,
        tag: request.tag,
        choices,
        params,
        queue_s: (admitted.unwrap_or(now) - arrival).as_secs_f64(),
        ttft_s: (first - arrival).as_secs_f64(),
        e2e_s: (now - arrival).as_secs_f64(),
        tpot_s: (most_sampled > 1).then(|| (now - first).as_secs_f64() / (most_sampled - 1) as f64),
        request_key: None,
        duplicate_of: None,
    }
}
