//! The embedding engine: BERT-family encoders ([`Encoder`]) through the same [`Engine`] interface as the
//! generating engines. Rows wait in a window of up to [`WINDOW`]; when a round begins, the window is sorted by
//! length and cut into batches of at most `max_seqs` rows and `max_batch_tokens` padded tokens, and each step
//! embeds one batch. Sorting first keeps padding small; a row's vector does not depend on its batch.

use std::collections::VecDeque;
use std::time::Instant;

use super::models::bert::Encoder;
use super::{Engine, EngineError, EngineStats, Request};
use crate::outcome::{Embedded, Outcome, RowFailure};

/// Rows an encoder sorts by length at a time before cutting them into batches.
pub const WINDOW: usize = 512;

pub struct EmbedEngine {
    encoder: Encoder,
    max_seqs: usize,
    max_batch_tokens: usize,
    /// Rows admitted since the current round was cut.
    waiting: Vec<Request>,
    /// The current round's batches, shortest rows first.
    round: VecDeque<Vec<Request>>,
    stats: EngineStats,
}

impl EmbedEngine {
    pub fn new(encoder: Encoder, max_seqs: usize, max_batch_tokens: usize) -> EmbedEngine {
        EmbedEngine { encoder, max_seqs, max_batch_tokens, waiting: Vec::new(), round: VecDeque::new(), stats: EngineStats::default() }
    }

    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// Sorts the waiting rows by length and cuts them into the next round's batches.
    fn cut_round(&mut self) {
        let mut window = std::mem::take(&mut self.waiting);
        window.sort_by_key(|r| r.tokens.len());
        let lengths: Vec<usize> = window.iter().map(|r| r.tokens.len()).collect();
        let mut rows = window.into_iter();
        for range in length_batches(&lengths, self.max_seqs, self.max_batch_tokens) {
            self.round.push_back(rows.by_ref().take(range.len()).collect());
        }
    }
}

impl Engine for EmbedEngine {
    fn free_places(&self) -> usize {
        let queued: usize = self.round.iter().map(Vec::len).sum();
        WINDOW.saturating_sub(self.waiting.len() + queued)
    }

    fn admit(&mut self, request: Request) -> Result<(), RowFailure> {
        self.waiting.push(request);
        Ok(())
    }

    fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.round.is_empty()
    }

    fn step(&mut self) -> Result<Vec<Outcome>, EngineError> {
        if self.round.is_empty() {
            self.cut_round();
        }
        let Some(batch) = self.round.pop_front() else { return Ok(Vec::new()) };
        let rows: Vec<&[u32]> = batch.iter().map(|r| r.tokens.as_slice()).collect();
        let vectors = self.encoder.embed(&rows)?;
        let now = Instant::now();
        self.stats.steps += 1;
        self.stats.prefill_tokens += (batch.len() * batch[batch.len() - 1].tokens.len()) as u64;
        self.stats.peak_running = self.stats.peak_running.max(batch.len());
        Ok(batch
            .into_iter()
            .zip(vectors)
            .map(|(request, vector)| {
                Outcome::Embedded(Embedded {
                    prompt_tokens: request.tokens.len() as u32,
                    e2e_s: (now - request.arrival).as_secs_f64(),
                    id: request.id,
                    tag: request.tag,
                    vector,
                    request_key: None,
                    duplicate_of: None,
                })
            })
            .collect())
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn reset_stats(&mut self) {
        self.stats = EngineStats::default();
    }
}

/// Cuts rows sorted by length (ascending) into batches: consecutive runs of at most `max_rows` rows whose padded
/// size (rows x the longest row, which is the last) stays within `max_tokens`. A row longer than `max_tokens` gets
/// a batch of its own. Returns the batches' index ranges, covering every row once, in order.
pub fn length_batches(sorted_lengths: &[usize], max_rows: usize, max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut batches = Vec::new();
    let mut start = 0;
    while start < sorted_lengths.len() {
        let mut end = start + 1;
        while end < sorted_lengths.len() && end - start < max_rows.max(1) && (end - start + 1) * sorted_lengths[end] <= max_tokens {
            end += 1;
        }
        batches.push(start..end);
        start = end;
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::length_batches;

    #[test]
    fn batches_cover_every_row_once_within_both_limits() {
        let lengths = [3, 3, 4, 5, 8, 8, 9, 20, 40];
        let batches = length_batches(&lengths, 3, 24);
        let covered: Vec<usize> = batches.iter().flat_map(|b| b.clone()).collect();
        assert_eq!(covered, (0..lengths.len()).collect::<Vec<_>>());
        for b in &batches {
            assert!(b.len() <= 3);
            let padded = b.len() * lengths[b.end - 1];
            assert!(padded <= 24 || b.len() == 1, "{b:?} pads to {padded}");
        }
        assert_eq!(batches, vec![0..3, 3..6, 6..7, 7..8, 8..9]);
    }

    #[test]
    fn a_row_longer_than_the_token_budget_runs_alone() {
        assert_eq!(length_batches(&[100, 200], 8, 50), vec![0..1, 1..2]);
        assert!(length_batches(&[], 8, 50).is_empty());
    }
}
