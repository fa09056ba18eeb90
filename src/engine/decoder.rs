//! The decoder engine: continuous batching over any decoder family's model ([`DecoderModel`]) and one of the
//! attention backends.
//!
//! Every step packs the prompts of newly admitted sequences (under a prefill token budget) together with one
//! decode token of every running sequence into a single forward pass, and a finished sequence's place is free for
//! the next request in the very next step. The [`Scheduler`] decides what runs; a row with `n` choices is prefilled
//! once and forked.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use candle_core::DType;
use crate::tokenize::Tokenizer;

use super::choice::{self, token_logprob, ChoiceState, RowTiming, Rules, StopRules};
use super::constraint::{self, Grammar};
use super::attention::{Attention, AttentionPlan, Backend, HostAttention, KvCache, PagedAttention, Segment, KV_BLOCK_TOKENS};
use super::models::{StepLogits, StepModel};
use super::attention::AttentionModel;
use super::parallel::{TpAttention, TpModel};
use super::{Engine, EngineError, EngineStats, Request};
use crate::job::GenerationParams;
use crate::outcome::{Choice, Outcome, RowFailure, TokenLogprob};
use crate::row::{ErrorCode, FinishReason, RowError};
use crate::schedule::{BlockKey, Prefix, Scheduler, SeqId};

#[derive(Clone, Debug)]
pub struct BatchConfig {
    /// Sequences decoded together.
    pub max_seqs: usize,
    /// Prompt tokens prefilled in one step; a longer prompt is prefilled alone.
    pub max_batch_tokens: usize,
    /// KV cache blocks of [`KV_BLOCK_TOKENS`] positions, shared by all sequences.
    pub kv_blocks: usize,
    /// Keep prefilled blocks and serve them to later prompts with the same beginning (`runtime.prefix_cache`).
    pub prefix_cache: bool,
    /// The window every layer of the model slides over, where every layer's does
    /// ([`AttentionShape::window_of_every_layer`](crate::engine::attention::AttentionShape::window_of_every_layer)):
    /// a running sequence's blocks before it are given back.
    pub window: Option<usize>,
}

impl BatchConfig {
    /// The configuration for a KV cache budget of `kv_bytes`, in blocks of `block_bytes` ([`Attention::block_bytes`], [`Backend::block_bytes`]).
    pub fn new(max_seqs: usize, max_batch_tokens: usize, kv_bytes: u64, block_bytes: usize) -> BatchConfig {
        let kv_blocks = (kv_bytes / block_bytes.max(1) as u64).min(u32::MAX as u64) as usize;
        BatchConfig { max_seqs, max_batch_tokens, kv_blocks: kv_blocks.max(1), prefix_cache: true, window: None }
    }

    /// Tokens the KV cache budget holds, all sequences together.
    pub fn kv_tokens(&self) -> usize {
        self.kv_blocks * KV_BLOCK_TOKENS
    }

    /// The longest sequence (prompt and output) that can run: the model's context, or less when the KV cache
    /// budget holds less.
    pub fn max_sequence_tokens(&self, context_length: usize) -> usize {
        context_length.min(self.kv_tokens())
    }

    /// The scheduler's configuration.
    pub fn schedule(&self) -> crate::schedule::Config {
        crate::schedule::Config {
            max_seqs: self.max_seqs,
            max_batch_tokens: self.max_batch_tokens,
            block_tokens: KV_BLOCK_TOKENS,
            kv_blocks: self.kv_blocks,
            // Prefill as soon as a place is free: on these kernels a step's cost grows with its tokens, so
            // holding places empty to gather prefills only loses decode throughput.
            min_prefill_places: 1,
            max_decode_steps_between_prefills: 8,
            prefix_cache: self.prefix_cache,
            window: self.window,
        }
    }
}

/// Answer tokens a sequence's block table is sized for at admission (blocks themselves are taken as it grows).
const INITIAL_ANSWER_TOKENS: usize = 256;

/// Checks what the job file's rules cannot know: stop token ids against the model's vocabulary and `n` against
/// the places (`max_seqs`). Err: (job file key, problem).
pub fn check_params(params: &GenerationParams, vocab_size: usize, max_seqs: usize) -> Result<(), (&'static str, String)> {
    if let Some(bad) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(("generation.stop_token_ids", format!("has {bad}, outside the model's vocabulary of {vocab_size} tokens")));
    }
    if params.n as usize > max_seqs {
        return Err(("generation.n", format!("is {}, more than runtime.max_seqs = {max_seqs} (the choices of a row run together)", params.n)));
    }
    Ok(())
}

/// The grammar vocabulary of a model: its tokens, with its end tokens (the EOS first) allowed once a value is
/// complete.
pub fn grammars(tokenizer: &Tokenizer, vocab_size: usize, stop: &StopRules) -> Result<constraint::Grammars, String> {
    let mut ends: Vec<u32> = stop.end_tokens.iter().copied().collect();
    ends.sort_unstable();
    if let Some(eos) = stop.eos.filter(|e| ends.contains(e)) {
        ends.retain(|&e| e != eos);
        ends.insert(0, eos);
    }
    constraint::Grammars::new(tokenizer, vocab_size, &ends)
}

/// What a decoder engine is built from, apart from the model and its backend.
pub struct DecoderSetup {
    pub tokenizer: Tokenizer,
    /// The job's generation parameters; rows override them.
    pub params: GenerationParams,
    pub stop: StopRules,
    pub config: BatchConfig,
    /// How the KV cache holds keys and values ([`Backend::kv_dtype`]; the paged backend's is the activations').
    pub kv_dtype: DType,
    /// The attention it runs ([`AttentionPlan::choose`]).
    pub attention: AttentionPlan,
}

/// A decoder engine for a loaded model on the attention `setup` names: the host backend, or the paged pool (sized
/// to `setup.config.kv_blocks`) with the kernel `setup.attention` names.
pub fn decoder_engine<M>(model: M, setup: DecoderSetup) -> Result<Box<dyn Engine>, EngineError>
where
    M: AttentionModel + StepModel<HostAttention> + StepModel<PagedAttention>,
{
    let setting_up = |source| EngineError::Device { what: "setting up the attention backend", source };
    Ok(match setup.attention.backend {
        Backend::Host => Box::new(BatchEngine::new(HostAttention::new(&model, setup.kv_dtype).map_err(setting_up)?.with_tiles(setup.attention.host_tiles), model, setup)),
        Backend::Paged => {
            let attention = PagedAttention::with_kernel(&model, setup.config.kv_blocks, setup.attention.kernel).map_err(setting_up)?;
            Box::new(BatchEngine::new(attention, model, setup))
        }
    })
}

/// A decoder engine for a tensor-parallel model ([`crate::engine::parallel`]): each rank's attention backend over
/// its own heads (every rank's paged pool sized to `setup.config.kv_blocks`), driven together.
pub fn tp_decoder_engine<M>(model: TpModel<M>, setup: DecoderSetup) -> Result<Box<dyn Engine>, EngineError>
where
    M: AttentionModel + StepModel<HostAttention> + StepModel<PagedAttention> + Sync,
{
    let setting_up = |source| EngineError::Device { what: "setting up the attention backend", source };
    Ok(match setup.attention.backend {
        Backend::Host => {
            let ranks = model.ranks().iter().map(|m| HostAttention::new(m, setup.kv_dtype).map(|h| h.with_tiles(setup.attention.host_tiles))).collect::<candle_core::Result<_>>().map_err(setting_up)?;
            Box::new(BatchEngine::new(TpAttention::new(ranks), model, setup))
        }
        Backend::Paged => {
            let ranks = model.ranks().iter().map(|m| PagedAttention::with_kernel(m, setup.config.kv_blocks, setup.attention.kernel)).collect::<candle_core::Result<_>>().map_err(setting_up)?;
            Box::new(BatchEngine::new(TpAttention::new(ranks), model, setup))
        }
    })
}

/// One choice of one row, running or waiting in the scheduler.
struct Sequence<C> {
    /// The row it belongs to (the id of the row's first sequence).
    group: SeqId,
    /// Tokens to feed in the next step: the prompt before prefill, then the last sampled token.
    pending: Vec<u32>,
    cache: C,
    choice: ChoiceState,
    /// Choices still to fork from this sequence right after its prefill (`n - 1` for a row's first sequence).
    forks: u32,
    /// Prefix cache keys of its prompt's full blocks (empty without the cache).
    keys: Arc<[BlockKey]>,
}

/// A row in the engine: its request, its parameters and its finished choices.
struct Group {
    request: Request,
    params: GenerationParams,
    /// The prompt's distinct tokens, for a repetition penalty (empty without one).
    penalty_prompt: Vec<u32>,
    grammar: Option<Arc<Grammar>>,
    choices: Vec<Option<Choice>>,
    /// Choices not finished yet.
    live: usize,
    timing: RowTiming,
    /// Prompt tokens its first prefill took from the prefix cache.
    cached_tokens: u32,
}

pub struct BatchEngine<A: Attention, M: StepModel<A>> {
    model: M,
    attention: A,
    tokenizer: Tokenizer,
    params: GenerationParams,
    stop: StopRules,
    config: BatchConfig,
    scheduler: Scheduler,
    /// Admitted sequences, running or waiting (a waiting one has an empty cache).
    seqs: HashMap<SeqId, Sequence<A::Cache>>,
    groups: HashMap<SeqId, Group>,
    /// Grammars of JSON Schemas, built on first use.
    grammars: Option<constraint::Grammars>,
    next_id: SeqId,
    stats: EngineStats,
    /// The prefix cache's blocks, by key (the scheduler decides what is kept; see [`crate::schedule`]).
    prefix_blocks: HashMap<BlockKey, A::Block>,
    /// Keys the chained block hashes (two SipHash keys, drawn per process).
    block_hash: [std::collections::hash_map::RandomState; 2],
}

/// What a step decided for one sequence after the forward pass.
enum Settled {
    Finished(SeqId, FinishReason),
    /// The row (a group id) failed with this message.
    Failed(SeqId, String),
}

impl<A: Attention, M: StepModel<A>> BatchEngine<A, M> {
    /// An engine over a loaded model and its attention backend (a paged backend's pool sized to
    /// `setup.config.kv_blocks`, the scheduler's budget).
    pub fn new(attention: A, model: M, setup: DecoderSetup) -> Self {
        let DecoderSetup { tokenizer, params, stop, config, .. } = setup;
        let scheduler = Scheduler::new(config.schedule());
        let stats = EngineStats { kv_blocks: config.kv_blocks, ..EngineStats::default() };
        BatchEngine {
            model,
            attention,
            tokenizer,
            params,
            stop,
            config,
            scheduler,
            seqs: HashMap::new(),
            groups: HashMap::new(),
            grammars: None,
            next_id: 0,
            stats,
            prefix_blocks: HashMap::new(),
            block_hash: Default::default(),
        }
    }

    /// Prefix cache keys of every full block of `tokens`: each a 128-bit hash of the block's tokens and the key
    /// before it, so it names everything up to the block's end. (Keyed hashes: a collision, under 2^-64 for 2^32
    /// distinct blocks, cannot be crafted by the rows.)
    fn block_keys(&self, tokens: &[u32]) -> Arc<[BlockKey]> {
        if !self.config.prefix_cache {
            return Arc::from(Vec::new());
        }
        let mut key: BlockKey = 0;
        tokens
            .chunks_exact(KV_BLOCK_TOKENS)
            .map(|block| {
                let [a, b] = self.block_hash.each_ref().map(|state| {
                    let mut h = state.build_hasher();
                    key.hash(&mut h);
                    block.hash(&mut h);
                    h.finish()
                });
                key = (a as u128) << 64 | b as u128;
                key
            })
            .collect()
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// [`check_params`] for a row, and its JSON Schema compiled (once per distinct schema, cached by its text).
    fn row_grammar(&mut self, params: &GenerationParams) -> Result<Option<Arc<Grammar>>, (&'static str, String)> {
        check_params(params, self.model.vocab_size(), self.config.max_seqs)?;
        let Some(schema) = &params.json_schema else { return Ok(None) };
        if self.grammars.is_none() {
            let built = grammars(&self.tokenizer, self.model.vocab_size(), &self.stop).map_err(|e| ("generation.json_schema", format!("cannot be used: {e}")))?;
            self.grammars = Some(built);
        }
        let compiled = self.grammars.as_mut().expect("built above").compile(schema);
        compiled.map(Some).map_err(|e| ("generation.json_schema", format!("cannot be used: {e}")))
    }

    fn new_sequence(&self, group: SeqId, index: u32, pending: Vec<u32>, cache: A::Cache, max_new_tokens: usize, keys: Arc<[BlockKey]>) -> Result<Sequence<A::Cache>, String> {
        let g = &self.groups[&group];
        let choice = ChoiceState::new(index, &g.request.id, &g.params, max_new_tokens, g.grammar.as_deref())?;
        Ok(Sequence { group, pending, cache, choice, forks: 0, keys })
    }

    /// Chooses a sequence's next token and applies it; returns why it finished, if it did.
    fn decide(&mut self, id: SeqId, logits: StepLogits, now: Instant) -> Result<Option<FinishReason>, String> {
        let limit = self.config.max_sequence_tokens(self.model.context_length());
        let seq = self.seqs.get_mut(&id).expect("a scheduled sequence exists");
        let group = self.groups.get_mut(&seq.group).expect("a sequence's group exists");
        let rules = Rules { params: &group.params, tokenizer: &self.tokenizer, end_tokens: &self.stop.end_tokens, penalty_prompt: &group.penalty_prompt };
        let token = seq.choice.choose(logits, &rules)?;
        group.timing.first_token.get_or_insert(now);
        let finished = seq.choice.advance(token, &rules, seq.cache.len() + 1 > limit)?;
        if finished.is_none() {
            // The prompt's buffer, reused: no allocation per sequence and step.
            seq.pending.clear();
            seq.pending.push(token);
        }
        Ok(finished)
    }

    /// Finishes one choice; returns the row's result when it was the last.
    fn finish(&mut self, id: SeqId, reason: FinishReason, now: Instant) -> Option<Outcome> {
        self.scheduler.finish(id);
        let seq = self.seqs.remove(&id).expect("a finished sequence exists");
        let group = self.groups.get_mut(&seq.group).expect("a sequence's group exists");
        let index = seq.choice.index() as usize;
        group.choices[index] = Some(seq.choice.finish(reason, &self.tokenizer));
        group.live -= 1;
        if group.live > 0 {
            return None;
        }
        let group = self.groups.remove(&seq.group).expect("checked above");
        let choices: Vec<Choice> = group.choices.into_iter().map(|c| c.expect("every choice finished")).collect();
        let mut completion = choice::complete(group.request, group.params, group.timing, choices, now);
        completion.cached_tokens = group.cached_tokens;
        Some(Outcome::Completed(completion))
    }

    /// Fails a whole row (every choice) with an error found while it ran.
    fn fail(&mut self, group: SeqId, message: String) -> RowFailure {
        let ids: Vec<SeqId> = self.seqs.iter().filter(|(_, s)| s.group == group).map(|(&id, _)| id).collect();
        for id in ids {
            self.scheduler.finish(id);
            self.seqs.remove(&id);
        }
        let g = self.groups.remove(&group).expect("a failing row's group exists");
        RowFailure { id: g.request.id, tag: g.request.tag, error: RowError::new(ErrorCode::EngineError, message) }
    }

    /// The forward pass of a step over `order`'s sequences, with the outputs each needs: a scoring row the logits
    /// after each completion token (its last `completion + 1` positions), a greedy row only its argmax.
    fn forward(&mut self, order: &[SeqId]) -> Result<Vec<Vec<StepLogits>>, EngineError> {
        let outputs: Vec<usize> = order
            .iter()
            .map(|id| {
                let seq = &self.seqs[id];
                // A scoring row is only ever prefilled (the prefix cache serves none of these positions).
                match &self.groups[&seq.group].request.completion {
                    Some(c) => c.len() + 1,
                    None => 1,
                }
            })
            .collect();
        let greedy: Vec<bool> = order
            .iter()
            .zip(&outputs)
            .map(|(id, &o)| {
                let seq = &self.seqs[id];
                let g = &self.groups[&seq.group];
                o == 1 && g.request.completion.is_none() && seq.choice.takes_argmax(&g.params)
            })
            .collect();
        let wanted: HashMap<SeqId, usize> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let mut chosen: Vec<(usize, &mut Sequence<A::Cache>)> = self.seqs.iter_mut().filter_map(|(id, s)| wanted.get(id).map(|&i| (i, s))).collect();
        chosen.sort_by_key(|c| c.0);
        let mut segments: Vec<Segment<'_, A::Cache>> = chosen.into_iter().map(|(_, s)| Segment { tokens: &s.pending, cache: &mut s.cache }).collect();
        // The forward pass's time, less the step's inputs it builds on the host first (host time).
        let started = Instant::now();
        let (logits, inputs) = self.model.forward_step_timed(&self.attention, &mut segments, &outputs, &greedy)?;
        self.stats.forward_s += (started.elapsed() - inputs).as_secs_f64();
        if let Some((tokens, seconds)) = self.model.take_routing() {
            self.stats.expert_tokens.resize(tokens.len(), 0);
            self.stats.expert_tokens.iter_mut().zip(tokens).for_each(|(a, t)| *a += t);
            self.stats.routing_s += seconds;
        }
        Ok(logits)
    }

    /// A scoring row's result: the log-probability of each completion token after the tokens before it.
    fn score(&mut self, id: SeqId, rows: &[StepLogits], now: Instant) -> Settled {
        let group = self.seqs[&id].group;
        let g = self.groups.get_mut(&group).expect("a sequence's group exists");
        let completion = g.request.completion.as_deref().unwrap_or(&[]);
        let top = g.params.logprobs.unwrap_or(0);
        let mut scored: Vec<TokenLogprob> = Vec::with_capacity(completion.len());
        for (&t, row) in completion.iter().zip(rows) {
            match row {
                StepLogits::Full(l) if super::sampling::has_nan(l) => return Settled::Failed(group, choice::NAN_LOGITS.into()),
                StepLogits::Full(l) => scored.push(token_logprob(&self.tokenizer, l, t, top)),
                StepLogits::Argmax(_) => return Settled::Failed(group, "a scoring row's logits were not computed (a bug)".into()),
            }
        }
        g.timing.first_token.get_or_insert(now);
        self.seqs.get_mut(&id).expect("a scheduled sequence exists").choice.scored(scored);
        Settled::Finished(id, FinishReason::Scored)
    }

    /// After a row's first prefill, its other choices: copies of its cache, each sampling on its own. Returns the
    /// sequences to choose a token for (the original first), or why the row failed.
    fn fork_choices(&mut self, id: SeqId) -> Result<Vec<SeqId>, String> {
        let group = self.seqs[&id].group;
        let forks = std::mem::take(&mut self.seqs.get_mut(&id).expect("a scheduled sequence exists").forks);
        let mut ids = vec![id];
        for index in 1..=forks {
            let child = self.next_id;
            self.next_id += 1;
            let parent = &self.seqs[&id];
            let max_new = parent.choice.max_new_tokens();
            let cache = self.attention.fork(&parent.cache).map_err(|e| format!("cannot fork the KV cache: {e}"))?;
            let seq = self.new_sequence(group, index, Vec::new(), cache, max_new, parent.keys.clone())?;
            self.scheduler.fork(id, child);
            self.seqs.insert(child, seq);
            ids.push(child);
        }
        Ok(ids)
    }

    /// Everything one sequence's output rows decide: a score, or a token for it and each of its forks.
    fn settle(&mut self, id: SeqId, mut rows: Vec<StepLogits>, now: Instant, settled: &mut Vec<Settled>) {
        let group = self.seqs[&id].group;
        if self.groups[&group].request.completion.is_some() {
            settled.push(self.score(id, &rows, now));
            return;
        }
        let mut row = rows.pop().expect("one row of logits per sequence");
        if self.seqs[&id].forks == 0 {
            // Every step of every sequence but a row's first prefill with `n` > 1: no forks, no list of them.
            match self.decide(id, row, now) {
                Ok(Some(reason)) => settled.push(Settled::Finished(id, reason)),
                Ok(None) => {}
                Err(e) => settled.push(Settled::Failed(group, e)),
            }
            return;
        }
        let ids = match self.fork_choices(id) {
            Ok(ids) => ids,
            Err(e) => return settled.push(Settled::Failed(group, e)),
        };
        let last = ids.len() - 1;
        for (k, seq_id) in ids.into_iter().enumerate() {
            let logits = if k == last { std::mem::replace(&mut row, StepLogits::Full(Vec::new())) } else { row.clone() };
            match self.decide(seq_id, logits, now) {
                Ok(Some(reason)) => settled.push(Settled::Finished(seq_id, reason)),
                Ok(None) => {}
                Err(e) => settled.push(Settled::Failed(group, e)),
            }
        }
    }

    /// A sequence about to be prefilled starts from the first `blocks` blocks of its prompt, from the prefix
    /// cache: it prefills only the tokens after them.
    fn reuse_prefix(&mut self, id: SeqId, blocks: usize) -> Result<(), EngineError> {
        let seq = self.seqs.get_mut(&id).expect("a prefilled sequence exists");
        let shared: Option<Vec<A::Block>> = seq.keys.get(..blocks).and_then(|keys| keys.iter().map(|k| self.prefix_blocks.get(k).cloned()).collect());
        let shared = shared.ok_or_else(|| EngineError::Bug(format!("a sequence reuses {blocks} blocks the prefix cache does not hold")))?;
        let capacity = seq.pending.len() + seq.choice.max_new_tokens().min(INITIAL_ANSWER_TOKENS);
        seq.cache = self.attention.cache_from_blocks(shared, capacity);
        seq.pending.drain(..blocks * KV_BLOCK_TOKENS);
        // A row's first prefill (a recomputation comes after a sampled token).
        if seq.choice.generated().is_empty() {
            self.groups.get_mut(&seq.group).expect("a sequence's group exists").cached_tokens = (blocks * KV_BLOCK_TOKENS) as u32;
        }
        Ok(())
    }

    fn record(&mut self, prefill_tokens: usize, decode_tokens: usize, took: f64) {
        if prefill_tokens > 0 {
            self.stats.prefill_s += took;
        } else {
            self.stats.decode_s += took;
            self.stats.decode_only_tokens += decode_tokens as u64;
        }
        self.stats.steps += 1;
        self.stats.prefill_tokens += prefill_tokens as u64;
        self.stats.decode_tokens += decode_tokens as u64;
        self.stats.peak_running = self.stats.peak_running.max(self.scheduler.running());
        let s = self.scheduler.stats();
        self.stats.preemptions = s.preemptions;
        self.stats.recomputed_tokens = s.recomputed_tokens;
        self.stats.cached_prompt_tokens = s.cached_tokens;
        self.stats.prefix_evictions = s.evictions;
        self.stats.released_kv_blocks = s.released_blocks;
        self.stats.peak_kv_blocks = s.peak_blocks;
        self.stats.peak_kv_bytes = s.peak_blocks * self.attention.block_bytes();
        self.stats.mean_kv_blocks = s.block_steps as f64 / s.steps.max(1) as f64;
    }
}

impl<A: Attention, M: StepModel<A>> Engine for BatchEngine<A, M>
where
    A: Send,
    A::Cache: Send,
{
    fn free_places(&self) -> usize {
        // Up to `max_seqs` wait beside the running ones, so the scheduler can pick prompts of similar lengths
        // and refill a place the moment it frees. A row's choices take a place each.
        let booked: usize = self.groups.values().map(|g| g.live).sum();
        (2 * self.config.max_seqs).saturating_sub(booked)
    }

    fn admit(&mut self, request: Request) -> Result<(), RowFailure> {
        let bad = |m: String| RowError::new(ErrorCode::InvalidParameters, m);
        let params = match self.params.for_row(&request.params) {
            Ok(params) => params,
            Err(e) => return Err(request.fail(bad(e))),
        };
        let grammar = match self.row_grammar(&params) {
            Ok(grammar) => grammar,
            Err((key, problem)) => return Err(request.fail(bad(format!("{} {problem}", key.trim_start_matches("generation."))))),
        };
        let limit = self.config.max_sequence_tokens(self.model.context_length());
        let completion = request.completion.as_deref().unwrap_or(&[]);
        let prompt = request.tokens.len() + completion.len();
        let scoring = request.completion.is_some();
        let max_new_tokens = if scoring { 0 } else { (params.max_new_tokens as usize).min(limit.saturating_sub(prompt)) };
        // A generating row needs a position left for its first token; a scoring row only its own tokens.
        let fits = if scoring { prompt <= limit } else { prompt < limit };
        if request.tokens.is_empty() || !fits {
            let message = format!("the prompt has {prompt} tokens; the model's context and the KV cache budget allow {}", limit.saturating_sub(1));
            return Err(request.fail(RowError::new(ErrorCode::PromptTooLong, message)));
        }
        let id = self.next_id;
        let n = if scoring { 1 } else { params.n as usize };
        let pending: Vec<u32> = request.tokens.iter().chain(completion).copied().collect();
        // The positions whose logits the row needs are computed, never served from the cache.
        let outputs = if scoring { completion.len() + 1 } else { 1 };
        let keys = self.block_keys(&pending);
        let prefix = Prefix { keys: keys.clone(), reusable: (prompt - outputs) / KV_BLOCK_TOKENS };
        if let Err(e) = self.scheduler.push_group(id, prompt, max_new_tokens, n, prefix) {
            return Err(request.fail(RowError::new(ErrorCode::PromptTooLong, e.to_string())));
        }
        self.next_id += 1;
        let mut penalty_prompt = Vec::new();
        if params.repetition_penalty != 1.0 {
            penalty_prompt = request.tokens.clone();
            penalty_prompt.sort_unstable();
            penalty_prompt.dedup();
        }
        let timing = RowTiming::new(request.arrival);
        self.groups.insert(id, Group { request, params, penalty_prompt, grammar, choices: vec![None; n], live: n, timing, cached_tokens: 0 });
        let cache = self.attention.new_cache(prompt + max_new_tokens.min(INITIAL_ANSWER_TOKENS));
        match self.new_sequence(id, 0, pending, cache, max_new_tokens, keys) {
            Ok(mut seq) => {
                seq.forks = n as u32 - 1;
                self.seqs.insert(id, seq);
                Ok(())
            }
            Err(e) => {
                self.scheduler.finish(id);
                let g = self.groups.remove(&id).expect("inserted above");
                Err(g.request.fail(bad(e)))
            }
        }
    }

    fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    fn step(&mut self) -> Result<Vec<Outcome>, EngineError> {
        let plan = self.scheduler.next_step();
        for key in &plan.evicted {
            self.prefix_blocks.remove(key);
        }
        for &(id, blocks) in &plan.released {
            let seq = self.seqs.get_mut(&id).expect("a running sequence exists");
            self.attention.release_before(&mut seq.cache, blocks);
        }
        for id in &plan.preempted {
            // Dropped, to be prefilled again with its prompt and everything it generated (the last sampled token
            // included: it was not fed yet).
            let fresh = self.attention.new_cache(0);
            let seq = self.seqs.get_mut(id).expect("a preempted sequence exists");
            seq.cache = fresh;
            seq.pending = self.groups[&seq.group].request.tokens.iter().chain(seq.choice.generated()).copied().collect();
        }
        if plan.is_empty() {
            if self.seqs.is_empty() {
                return Ok(Vec::new());
            }
            // The scheduler always runs something while sequences wait (a lone one always fits the budget it was
            // admitted under); failing loudly beats spinning.
            return Err(EngineError::Bug(format!("the scheduler made no progress with {} sequences waiting", self.seqs.len())));
        }
        for &(id, blocks) in &plan.reused {
            self.reuse_prefix(id, blocks)?;
        }
        let started = Instant::now();
        for (id, tokens) in &plan.prefill {
            let seq = &self.seqs[id];
            debug_assert_eq!(seq.pending.len(), *tokens);
            self.groups.get_mut(&seq.group).expect("a sequence's group exists").timing.admitted.get_or_insert(started);
        }
        let order: Vec<SeqId> = plan.decode.iter().copied().chain(plan.prefill.iter().map(|p| p.0)).collect();
        let logits = self.forward(&order)?;
        for &(id, index, key) in &plan.registered {
            let block = self.attention.share_block(&self.seqs[&id].cache, index);
            let block = block.ok_or_else(|| EngineError::Bug(format!("block {index} of a prefill to cache is missing")))?;
            self.prefix_blocks.insert(key, block);
        }
        let now = Instant::now();
        let mut settled = Vec::new();
        for (&id, rows) in order.iter().zip(logits) {
            let group = self.seqs[&id].group;
            if !settled.iter().any(|s| matches!(s, Settled::Failed(g, _) if *g == group)) {
                self.settle(id, rows, now, &mut settled);
            }
        }
        // After a step, the sequences hold exactly the blocks booked for it: the scheduler books the positions the
        // step writes, and a block is allocated when its first position is written.
        debug_assert_eq!(self.seqs.values().map(|s| s.cache.blocks()).sum::<usize>(), self.scheduler.sequence_blocks());
        debug_assert_eq!(self.prefix_blocks.len(), self.scheduler.prefix_blocks().0);
        self.record(plan.prefill_tokens(), plan.decode.len(), (now - started).as_secs_f64());

        let mut results = Vec::new();
        for s in &settled {
            if let Settled::Failed(group, message) = s {
                if self.groups.contains_key(group) {
                    results.push(Outcome::Failed(self.fail(*group, message.clone())));
                }
            }
        }
        for s in settled {
            if let Settled::Finished(id, reason) = s {
                if self.seqs.contains_key(&id) {
                    results.extend(self.finish(id, reason, now));
                }
            }
        }
        Ok(results)
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn bind_to_thread(&self) -> Result<(), EngineError> {
        self.model.bind_to_thread().map_err(|source| EngineError::Device { what: "binding the device to the engine thread", source })
    }

    fn reset_stats(&mut self) {
        debug_assert!(self.seqs.is_empty(), "stats are reset between runs");
        // The new scheduler starts with an empty prefix cache: so does the engine.
        self.prefix_blocks.clear();
        self.scheduler = Scheduler::new(self.config.schedule());
        self.stats = EngineStats { kv_blocks: self.config.kv_blocks, ..EngineStats::default() };
    }
}
