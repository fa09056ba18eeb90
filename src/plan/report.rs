//! What `nightshift plan` works out from a job's tokenized rows, before anything runs: the prompt-length histogram,
//! the schedule the engine's scheduler would make (simulated with the scheduler itself), and a duration estimate
//! from a short calibration run. Pure code over integers and measured rates.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::Serialize;

use crate::engine::KV_BLOCK_TOKENS;
use crate::schedule::{Config, Prefix, Scheduler};

/// How many prompt tokens a prefix cache could serve, from the job's real prompts: each prompt's whole blocks of
/// [`KV_BLOCK_TOKENS`] (all but the positions whose logits the row needs: its last token, a scoring row's
/// completion), each block keyed by its tokens and every token before them, as a content-addressed KV cache keys
/// them. A block some earlier row already has would not be computed again; the count assumes a cache that keeps
/// every block it has seen (no eviction), so it is what a cache could save at best.
///
/// The blocks seen form a tree (each block's parent is the block before it), and each row's [`Chain`] names its
/// path, so that [`simulate`] can run the scheduler with the rows' real prefixes, evictions and all.
#[derive(Debug, Default)]
pub struct PrefixShare {
    /// Every block remembered: its key, and its node in the tree.
    nodes: HashMap<u64, u32>,
    /// Each node's parent ([`Chain::ROOT`] for a first block).
    parents: Vec<u32>,
    blocks: u64,
    hits: u64,
    /// Whether some block went uncounted because the set of blocks seen was full ([`PrefixShare::MAX_BLOCKS`]):
    /// the count is then a lower bound.
    full: bool,
}

impl PrefixShare {
    /// Distinct blocks remembered: 4 Mi blocks (64 Mi prompt tokens) in about 40 MiB. Past it, blocks are looked
    /// up but no longer remembered.
    pub const MAX_BLOCKS: usize = 1 << 22;

    /// One row's prefilled tokens (prompt, and a scoring row's completion), in job order, of which the last
    /// `outputs` are always computed (1, or a scoring row's completion and one); returns the row's chain.
    pub fn add(&mut self, tokens: &[u32], outputs: usize) -> Chain {
        let mut key = 0u64;
        let mut chain = Chain { last: Chain::ROOT, blocks: 0 };
        let mut remembered = true;
        for block in tokens[..tokens.len().saturating_sub(outputs.max(1))].chunks_exact(KV_BLOCK_TOKENS) {
            let mut h = std::hash::DefaultHasher::new();
            key.hash(&mut h);
            block.hash(&mut h);
            key = h.finish();
            self.blocks += 1;
            let node = match self.nodes.get(&key) {
                Some(&node) => {
                    self.hits += 1;
                    Some(node)
                }
                None if self.nodes.len() < Self::MAX_BLOCKS => {
                    let node = self.parents.len() as u32;
                    self.parents.push(chain.last);
                    self.nodes.insert(key, node);
                    Some(node)
                }
                None => {
                    self.full = true;
                    None
                }
            };
            // The chain goes as far as its blocks are remembered, one after the other.
            match node {
                Some(node) if remembered => chain = Chain { last: node, blocks: chain.blocks + 1 },
                _ => remembered = false,
            }
        }
        chain
    }

    /// The keys of a chain's blocks, first to last (node numbers: distinct for distinct blocks).
    pub fn keys(&self, chain: Chain) -> Vec<u128> {
        let mut keys = Vec::with_capacity(chain.blocks as usize);
        let mut node = chain.last;
        while node != Chain::ROOT {
            keys.push(node as u128);
            node = self.parents[node as usize];
        }
        keys.reverse();
        keys
    }

    /// Prompt tokens in blocks an earlier row already had.
    pub fn cached_tokens(&self) -> u64 {
        self.hits * KV_BLOCK_TOKENS as u64
    }

    /// Whether [`PrefixShare::cached_tokens`] counted every block (false: it is a lower bound).
    pub fn exact(&self) -> bool {
        !self.full
    }
}

/// A row's blocks in a [`PrefixShare`]: its last block's node and how many blocks lead to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chain {
    last: u32,
    blocks: u32,
}

impl Chain {
    const ROOT: u32 = u32::MAX;
    /// No blocks (a row shorter than a block, or the cache off).
    pub const NONE: Chain = Chain { last: Chain::ROOT, blocks: 0 };
}

/// Prompt lengths in power-of-two buckets: `1..=16`, `17..=32`, `33..=64`, ...
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Histogram {
    /// (lowest length, highest length, rows, tokens), for the buckets between the shortest and longest prompt.
    pub buckets: Vec<(usize, usize, u64, u64)>,
}

impl Histogram {
    pub fn new(lengths: &[usize]) -> Histogram {
        let bucket = |len: usize| (usize::BITS - len.max(1).saturating_sub(1).leading_zeros()).max(4) as usize;
        let (Some(lo), Some(hi)) = (lengths.iter().map(|&l| bucket(l)).min(), lengths.iter().map(|&l| bucket(l)).max()) else {
            return Histogram::default();
        };
        let mut buckets: Vec<(usize, usize, u64, u64)> =
            (lo..=hi).map(|b| (if b == 4 { 1 } else { (1 << (b - 1)) + 1 }, 1 << b, 0, 0)).collect();
        for &l in lengths {
            let slot = &mut buckets[bucket(l) - lo];
            slot.2 += 1;
            slot.3 += l as u64;
        }
        Histogram { buckets }
    }
}

/// The schedule the engine would run, if every row generated its `max_new_tokens` (an upper bound: rows that
/// stop early free their places sooner).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Simulation {
    pub steps: u64,
    /// Steps that prefill at least one prompt.
    pub prefill_steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub preemptions: u64,
    pub recomputed_tokens: u64,
    /// Prompt tokens the prefix cache serves (with `runtime.prefix_cache`; not in `prefill_tokens`), and the
    /// cached blocks evicted to make room.
    pub cached_tokens: u64,
    pub prefix_evictions: u64,
    pub peak_kv_blocks: usize,
    /// Mean sequences decoding per step.
    pub mean_running: f64,
}

/// Runs the scheduler over rows of (prompt tokens, new tokens), each generating exactly its new tokens. Rows are
/// fed as the engine takes them: at most `max_seqs` wait beside the running ones. With `prefixes` (the rows'
/// chains, in row order), the scheduler sees each row's blocks as the engine's prefix cache keys them.
pub fn simulate(rows: &[(usize, usize)], prefixes: Option<(&PrefixShare, &[Chain])>, config: &Config) -> Simulation {
    let mut scheduler = Scheduler::new(config.clone());
    let mut remaining = vec![0usize; rows.len()];
    let mut next = 0;
    let mut sim = Simulation::default();
    let mut running_sum = 0u64;
    loop {
        while next < rows.len() && scheduler.waiting() + scheduler.running() < 2 * config.max_seqs {
            let (prompt, new) = rows[next];
            let prefix = match prefixes {
                Some((share, chains)) => {
                    let keys = share.keys(chains[next]);
                    Prefix { reusable: keys.len(), keys: Arc::from(keys) }
                }
                None => Prefix::default(),
            };
            // Rows too long for the budget are error rows in a run: they never reach the scheduler.
            if scheduler.push_group(next as u64, prompt, new.max(1), 1, prefix).is_ok() {
                remaining[next] = new.max(1);
            }
            next += 1;
        }
        if scheduler.waiting() + scheduler.running() == 0 {
            break;
        }
        let step = scheduler.next_step();
        sim.steps += 1;
        if !step.prefill.is_empty() {
            sim.prefill_steps += 1;
        }
        sim.prefill_tokens += step.prefill_tokens() as u64;
        sim.decode_tokens += step.decode.len() as u64;
        running_sum += step.decode.len() as u64;
        for id in step.decode.iter().chain(step.prefill.iter().map(|p| &p.0)) {
            let left = &mut remaining[*id as usize];
            *left -= 1;
            if *left == 0 {
                scheduler.finish(*id);
            }
        }
    }
    let stats = scheduler.stats();
    sim.preemptions = stats.preemptions;
    sim.recomputed_tokens = stats.recomputed_tokens;
    sim.cached_tokens = stats.cached_tokens;
    sim.prefix_evictions = stats.evictions;
    sim.peak_kv_blocks = stats.peak_blocks;
    sim.mean_running = running_sum as f64 / sim.steps.max(1) as f64;
    sim
}

/// Rates measured by a short run of the job's own rows.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Calibration {
    pub rows: usize,
    /// Prompt tokens per second of steps that prefilled.
    pub prefill_tokens_per_s: f64,
    /// Tokens per second of decode-only steps, at the calibration's batch.
    pub decode_tokens_per_s: f64,
    pub seconds: f64,
}

/// Seconds the simulated schedule takes at the calibrated rates.
pub fn estimate_seconds(sim: &Simulation, calibration: &Calibration) -> Option<f64> {
    if calibration.prefill_tokens_per_s <= 0.0 || calibration.decode_tokens_per_s <= 0.0 {
        return None;
    }
    Some(sim.prefill_tokens as f64 / calibration.prefill_tokens_per_s + sim.decode_tokens as f64 / calibration.decode_tokens_per_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_whole_blocks_count_once_and_the_last_token_is_always_computed() {
        let b = KV_BLOCK_TOKENS as u32;
        let shared: Vec<u32> = (0..3 * b).collect();
        let row = |tail: &[u32]| shared.iter().chain(tail).copied().collect::<Vec<u32>>();
        let mut p = PrefixShare::default();
        // The first row computes everything; the second finds the three shared blocks; its own tail block is new.
        p.add(&row(&(1000..1000 + b + 1).collect::<Vec<_>>()), 1);
        assert_eq!(p.cached_tokens(), 0);
        p.add(&row(&(2000..2000 + b + 1).collect::<Vec<_>>()), 1);
        assert_eq!(p.cached_tokens(), 3 * b as u64);
        // A prompt that is exactly the shared blocks keeps its last block to compute (its last token's logits).
        p.add(&shared, 1);
        assert_eq!(p.cached_tokens(), 5 * b as u64);
        // The same block after a different prefix is a different key: nothing shared.
        let moved: Vec<u32> = std::iter::once(7).chain(shared.iter().copied()).chain([1, 2]).collect();
        p.add(&moved, 1);
        assert_eq!(p.cached_tokens(), 5 * b as u64);
        // Shorter than a block plus one: nothing to share.
        p.add(&shared[..b as usize], 1);
        assert_eq!(p.cached_tokens(), 5 * b as u64);
        assert!(p.exact());
    }

    #[test]
    fn the_simulation_serves_shared_prefixes_from_the_cache_and_evicts_under_a_small_budget() {
        let b = KV_BLOCK_TOKENS;
        // Ten rows of a 10-block instruction and 2 blocks of their own, then one row of another instruction.
        let instruction: Vec<u32> = (0..10 * b as u32).collect();
        let mut share = PrefixShare::default();
        let mut rows = Vec::new();
        let mut chains = Vec::new();
        for i in 0..10u32 {
            let tokens: Vec<u32> = instruction.iter().copied().chain((0..2 * b as u32).map(|t| 10_000 + 100 * i + t)).collect();
            chains.push(share.add(&tokens, 1));
            rows.push((tokens.len(), 4));
        }
        assert_eq!(share.keys(chains[3]).len(), 11, "the instruction's blocks, then the row's own whole one");
        assert_eq!(share.keys(chains[3])[..10], share.keys(chains[7])[..10]);
        assert_ne!(share.keys(chains[3])[10], share.keys(chains[7])[10]);
        let total: usize = rows.iter().map(|r| r.0).sum();
        let ample = Config { prefix_cache: true, ..config(1000) };
        let sim = simulate(&rows, Some((&share, &chains)), &ample);
        // The first row computes everything; the nine others find the instruction.
        assert_eq!(sim.cached_tokens, 9 * 10 * b as u64);
        assert_eq!(sim.prefill_tokens, total as u64 - sim.cached_tokens);
        assert_eq!(simulate(&rows, None, &ample).cached_tokens, 0);
        assert_eq!(simulate(&rows, Some((&share, &chains)), &config(1000)).cached_tokens, 0, "the cache off");
        // A budget of 14 blocks holds one row at a time, and its idle own blocks go to make room for the next.
        let tight = Config { max_seqs: 1, prefix_cache: true, ..config(14) };
        let sim = simulate(&rows, Some((&share, &chains)), &tight);
        assert!(sim.prefix_evictions > 0 && sim.cached_tokens == 9 * 10 * b as u64, "{sim:?}");
    }

    #[test]
    fn histogram_buckets_are_powers_of_two_from_sixteen() {
        let h = Histogram::new(&[1, 16, 17, 100, 128, 129]);
        assert_eq!(h.buckets, vec![(1, 16, 2, 17), (17, 32, 1, 17), (33, 64, 0, 0), (65, 128, 2, 228), (129, 256, 1, 129)]);
        assert_eq!(Histogram::new(&[]).buckets, vec![]);
    }

    fn config(kv_blocks: usize) -> Config {
        Config { max_seqs: 4, max_batch_tokens: 64, block_tokens: 16, kv_blocks, min_prefill_places: 1, max_decode_steps_between_prefills: 8, prefix_cache: false, window: None }
    }

    #[test]
    fn simulation_counts_every_token_once_without_preemption() {
        let rows = vec![(30, 5), (10, 1), (40, 8), (20, 3), (5, 2)];
        let sim = simulate(&rows, None, &config(1000));
        assert_eq!(sim.prefill_tokens, 105);
        // Each row's first token comes from its prefill; the rest are decode steps.
        assert_eq!(sim.decode_tokens, (5 - 1) + (8 - 1) + (3 - 1) + (2 - 1));
        assert_eq!(sim.preemptions, 0);
        assert!(sim.peak_kv_blocks >= 4);
    }

    #[test]
    fn a_tight_budget_shows_preemptions_and_recomputation() {
        // Four rows of 40 + 60 tokens = 7 blocks each at the end; 16 blocks hold two at most.
        let rows = vec![(40, 60); 4];
        let sim = simulate(&rows, None, &config(16));
        assert!(sim.preemptions > 0, "{sim:?}");
        assert_eq!(sim.prefill_tokens, 160 + sim.recomputed_tokens);
        assert!(sim.peak_kv_blocks <= 16);
    }

    #[test]
    fn a_large_job_goes_through_the_engines_window() {
        // Rows are fed as the engine takes them (2 x max_seqs admitted at once), so each step's work stays small
        // however many rows the job has, and no row is lost on the way.
        let rows: Vec<(usize, usize)> = (0..100_000).map(|i| (50 + i % 500, 16 + i % 48)).collect();
        let sim = simulate(&rows, None, &Config { max_seqs: 32, max_batch_tokens: 2048, ..config(1 << 20) });
        assert_eq!(sim.prefill_tokens, rows.iter().map(|r| r.0 as u64).sum::<u64>());
        assert_eq!(sim.decode_tokens, rows.iter().map(|r| r.1 as u64 - 1).sum::<u64>());
        assert!(sim.mean_running <= 32.0);
    }

    #[test]
    fn the_estimate_adds_prefill_and_decode_time() {
        let sim = Simulation { prefill_tokens: 1000, decode_tokens: 300, ..Default::default() };
        let cal = Calibration { rows: 1, prefill_tokens_per_s: 500.0, decode_tokens_per_s: 100.0, seconds: 1.0 };
        assert_eq!(estimate_seconds(&sim, &cal), Some(5.0));
        assert_eq!(estimate_seconds(&sim, &Calibration::default()), None);
    }
}
