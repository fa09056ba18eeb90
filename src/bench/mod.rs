//! `nightshift bench`: throughput on a synthetic workload, measured in-process (no object-store I/O), reported as
//! the figures users compare: [`generate`] for decoders, [`embed`] for embedding models; and [`parity`], the
//! accelerator path's logits against the CPU's.

mod generate;
mod kernels;
mod parity;
pub use generate::{generate, GenerateBenchOptions, GenerateBenchReport, Workload};
pub use kernels::{attention, kernels, AttentionMeasurement, KernelBenchOptions, KernelMeasurement};
pub use parity::{parity, Comparison, ParityOptions, ParityReport};

use std::path::PathBuf;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::app::drive::{drive, Ready};
use crate::engine::embed::EmbedEngine;
use crate::engine::models::bert::{self, Encoder};
use crate::engine::{EngineError, Request};
use crate::outcome::Outcome;
use crate::row::{RowParams, RowTag};
use crate::engine::ModelError;
use crate::error::Error;

/// Words the synthetic rows are made of: support-ticket English, so the tokenizer sees realistic text.
pub(crate) const WORDS: &[&str] = &[
    "the", "printer", "on", "third", "floor", "jams", "every", "time", "someone", "prints", "more", "than", "ten", "pages",
    "I", "was", "charged", "twice", "for", "my", "subscription", "please", "refund", "duplicate", "payment", "after",
    "latest", "update", "mobile", "app", "crashes", "as", "soon", "open", "settings", "screen", "our", "team", "cannot",
    "access", "shared", "drive", "since", "this", "morning", "error", "says", "network", "path", "not", "found",
    "password", "reset", "email", "never", "arrives", "checked", "spam", "folder", "invoice", "is", "blank", "when",
    "download", "it", "from", "billing", "page", "website", "checkout", "very", "slow", "today", "customers", "gave",
    "up", "laptop", "account", "order", "delivery", "address", "office", "street", "projector", "shows", "no", "signal",
    "meeting", "room", "week", "worked", "last", "cancel", "end", "of", "current", "period", "confirm", "by", "and",
];

#[derive(Clone, Debug)]
pub struct EmbedBenchOptions {
    pub model: PathBuf,
    pub rows: usize,
    /// Row lengths are drawn uniformly from this range, in tokens (special tokens included, approximately).
    pub min_tokens: usize,
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct EmbedBenchReport {
    pub model: String,
    pub dimensions: usize,
    pub rows: usize,
    /// Tokens of the rows, special tokens included.
    pub tokens: u64,
    /// Tokens computed, padding included.
    pub padded_tokens: u64,
    pub batches: usize,
    pub tokenize_s: f64,
    pub embed_s: f64,
    pub rows_per_s: f64,
    pub tokens_per_s: f64,
    /// `tokens / padded_tokens`.
    pub packing_efficiency: f64,
    pub peak_rss_bytes: u64,
}

pub fn embed(options: &EmbedBenchOptions) -> Result<EmbedBenchReport, Error> {
    if options.rows == 0 || options.min_tokens == 0 || options.min_tokens > options.max_tokens {
        return Err(Error::Usage("bench needs --rows >= 1 and 1 <= --min-tokens <= --max-tokens".into()));
    }
    let device = candle_core::Device::Cpu;
    let encoder = Encoder::load(&options.model, &device)?;
    let tokenizer = bert::tokenizer(&options.model)?;
    let limit = encoder.info.max_tokens;

    // Synthetic rows: words drawn at random, as many as the target length needs at the tokenizer's rate.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(options.seed);
    let sample: Vec<&str> = (0..2000).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect();
    let per_word = tokenizer.encode(sample.join(" "), false).map_err(|e| ModelError::Metadata(e.to_string()))?.len() as f64 / 2000.0;
    let texts: Vec<String> = (0..options.rows)
        .map(|_| {
            let target = rng.random_range(options.min_tokens..=options.max_tokens).min(limit);
            let words = ((target.saturating_sub(2)) as f64 / per_word).round().max(1.0) as usize;
            (0..words).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" ")
        })
        .collect();

    let started = Instant::now();
    let mut rows: Vec<Vec<u32>> = Vec::with_capacity(texts.len());
    for text in &texts {
        let mut ids = tokenizer.encode(text.as_str(), true).map_err(|e| ModelError::Metadata(e.to_string()))?.get_ids().to_vec();
        if ids.len() > limit {
            // Keep the closing special token, as truncation would.
            let last = *ids.last().expect("not empty");
            ids.truncate(limit);
            ids[limit - 1] = last;
        }
        rows.push(ids);
    }
    let tokenize_s = started.elapsed().as_secs_f64();

    let dimensions = encoder.info.dimensions;
    let mut engine = EmbedEngine::new(encoder, options.max_seqs, options.max_batch_tokens);
    let requests = rows.iter().enumerate().map(|(i, tokens)| Request {
        id: format!("bench-{i}"),
        tag: RowTag { unit: 0, offset: i as u32 },
        params: RowParams::default(),
        tokens: tokens.clone(),
        completion: None,
        arrival: Instant::now(),
    });
    let started = Instant::now();
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(rows.len());
    let stats = drive(&mut engine, &mut Ready(requests), &mut outcomes, None).map_err(Error::Engine)?;
    if let Some(Outcome::Failed(f)) = outcomes.iter().find(|o| matches!(o, Outcome::Failed(_))) {
        return Err(Error::Engine(EngineError::Row { id: f.id.clone(), message: f.error.message.clone() }));
    }
    let (padded_tokens, batches) = (stats.prefill_tokens, stats.steps as usize);
    let embed_s = started.elapsed().as_secs_f64();
    let tokens: u64 = rows.iter().map(|r| r.len() as u64).sum();
    Ok(EmbedBenchReport {
        model: options.model.display().to_string(),
        dimensions,
        rows: rows.len(),
        tokens,
        padded_tokens,
        batches,
        tokenize_s,
        embed_s,
        rows_per_s: rows.len() as f64 / embed_s,
        tokens_per_s: tokens as f64 / embed_s,
        packing_efficiency: tokens as f64 / padded_tokens.max(1) as f64,
        peak_rss_bytes: crate::host::peak_rss_bytes().unwrap_or(0),
    })
}
