//! Shards: which of the plan's units one process runs.
//!
//! nightshift is not a cluster manager. A scheduler the user already runs (a Kubernetes Indexed Job, a Slurm
//! array, an AWS Batch or Google Cloud Batch array job) starts N processes and gives each an index; each process
//! runs "shard i of n" of the one plan stored at the output. The scheduler provides placement, retries and
//! parallelism; the plan's create-once units make retries, duplicates and zombies harmless.
//!
//! The split is made once, when the plan is written, and stored in it: contiguous runs of units balanced by
//! estimated tokens (prompt plus output). Every process reads the same split, so a unit belongs to one shard for
//! the life of the output.

use std::fmt;
use std::str::FromStr;

/// What `--shard` asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardArg {
    /// Every unit of every shard, one after another (the default; finishes a sharded output on one machine).
    All,
    /// Shard `index`, of `count` shards if given (else from `--shards` or `output.shards`).
    Index { index: u32, count: Option<u32> },
    /// The index and count from the scheduler's environment.
    Auto,
}

impl FromStr for ShardArg {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<ShardArg, ShardError> {
        let bad = || ShardError::Syntax(s.to_string());
        match s {
            "all" => Ok(ShardArg::All),
            "auto" => Ok(ShardArg::Auto),
            _ => match s.split_once('/') {
                Some((i, n)) => Ok(ShardArg::Index { index: i.parse().map_err(|_| bad())?, count: Some(n.parse().map_err(|_| bad())?) }),
                None => Ok(ShardArg::Index { index: s.parse().map_err(|_| bad())?, count: None }),
            },
        }
    }
}

/// The units one process runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Assignment {
    /// Every unit.
    All,
    /// One shard of `count`; `from` says where the numbers came from (a flag or a scheduler's variables).
    One { index: u32, count: u32, from: String },
}

impl Assignment {
    pub fn includes(&self, shard: u32) -> bool {
        match self {
            Assignment::All => true,
            Assignment::One { index, .. } => *index == shard,
        }
    }
}

impl fmt::Display for Assignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Assignment::All => write!(f, "all shards"),
            Assignment::One { index, count, .. } => write!(f, "shard {index}/{count}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("--shard {0:?}: expected `i/n` (e.g. `3/8`), `i` with --shards n, `auto` or `all`")]
    Syntax(String),
    #[error("shard {index}/{count}: the index must be below the count (indices start at 0)")]
    OutOfRange { index: u32, count: u32 },
    #[error("shard count 0: a plan has at least one shard")]
    ZeroCount,
    #[error("shard {index}: the shard count is unknown; give `--shard {index}/N`, `--shards N` or `output.shards` in the job file")]
    NoCount { index: u32 },
    #[error(
        "--shard auto: {from} gives index {index} but no shard count; pass `--shards N` (N = the job's completions \
         or array size) or set `output.shards` in the job file"
    )]
    AutoNoCount { from: String, index: u32 },
    #[error("--shard auto: {from} says {env} shards, but {flag} was given; they must agree")]
    CountMismatch { from: String, env: u32, flag: u32 },
    #[error("--shard auto: {name}={value:?} is not a number")]
    NotANumber { name: &'static str, value: String },
    #[error(
        "--shard auto: SLURM_ARRAY_TASK_ID {id} is not in an evenly stepped array from {min} ({count} tasks, step \
         {step}); submit the array as `--array=0-{last}` (optionally with %limit)"
    )]
    SlurmIndex { id: u32, min: u32, step: u32, count: u32, last: u32 },
    #[error(
        "--shard auto: none of JOB_COMPLETION_INDEX (Kubernetes Indexed Job), SLURM_ARRAY_TASK_ID (Slurm array), \
         AWS_BATCH_JOB_ARRAY_INDEX (AWS Batch array) or BATCH_TASK_INDEX (Google Cloud Batch) is set"
    )]
    NoScheduler,
}

/// Resolves `--shard` into an assignment. `count` is `--shards` or the job file's `output.shards`; `env` reads an
/// environment variable (a parameter so the scheduler mappings are unit tested without touching the process's
/// environment).
pub fn resolve(arg: Option<&ShardArg>, count: Option<u32>, env: impl Fn(&str) -> Option<String>) -> Result<Assignment, ShardError> {
    if count == Some(0) {
        return Err(ShardError::ZeroCount);
    }
    let one = |index: u32, count: u32, from: String| {
        if count == 0 {
            Err(ShardError::ZeroCount)
        } else if index >= count {
            Err(ShardError::OutOfRange { index, count })
        } else {
            Ok(Assignment::One { index, count, from })
        }
    };
    match arg {
        None | Some(ShardArg::All) => Ok(Assignment::All),
        Some(ShardArg::Index { index, count: Some(n) }) => {
            if let Some(flag) = count.filter(|c| c != n) {
                return Err(ShardError::CountMismatch { from: format!("--shard {index}/{n}"), env: *n, flag });
            }
            one(*index, *n, "--shard".into())
        }
        Some(ShardArg::Index { index, count: None }) => one(*index, count.ok_or(ShardError::NoCount { index: *index })?, "--shard".into()),
        Some(ShardArg::Auto) => {
            let number = |name: &'static str| -> Result<Option<u32>, ShardError> {
                match env(name) {
                    None => Ok(None),
                    Some(v) if v.trim().is_empty() => Ok(None),
                    Some(v) => v.trim().parse().map(Some).map_err(|_| ShardError::NotANumber { name, value: v }),
                }
            };
            // The count the scheduler states, reconciled with the flag or job file.
            let agree = |from: &str, index: u32, stated: Option<u32>| -> Result<u32, ShardError> {
                match (stated, count) {
                    (Some(e), Some(f)) if e != f => Err(ShardError::CountMismatch { from: from.into(), env: e, flag: f }),
                    (Some(e), _) => Ok(e),
                    (None, Some(f)) => Ok(f),
                    (None, None) => Err(ShardError::AutoNoCount { from: from.into(), index }),
                }
            };
            if let Some(index) = number("JOB_COMPLETION_INDEX")? {
                // Kubernetes puts only the index in the environment; the count is the Job's `completions`.
                let from = "JOB_COMPLETION_INDEX (Kubernetes Indexed Job)";
                return one(index, agree(from, index, None)?, from.into());
            }
            if let Some(id) = number("SLURM_ARRAY_TASK_ID")? {
                // Array indices may start anywhere and step: `--array=1-8` or `--array=0-30:2`.
                let from = "SLURM_ARRAY_TASK_ID (Slurm array)";
                let min = number("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
                let step = number("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
                let stated = number("SLURM_ARRAY_TASK_COUNT")?;
                let n = agree(from, id, stated)?;
                if id < min || (id - min) % step != 0 || (id - min) / step >= n {
                    return Err(ShardError::SlurmIndex { id, min, step, count: n, last: n.saturating_sub(1) });
                }
                return one((id - min) / step, n, from.into());
            }
            if let Some(index) = number("AWS_BATCH_JOB_ARRAY_INDEX")? {
                let from = "AWS_BATCH_JOB_ARRAY_INDEX (AWS Batch array)";
                return one(index, agree(from, index, number("AWS_BATCH_JOB_ARRAY_SIZE")?)?, from.into());
            }
            if let Some(index) = number("BATCH_TASK_INDEX")? {
                let from = "BATCH_TASK_INDEX (Google Cloud Batch)";
                return one(index, agree(from, index, number("BATCH_TASK_COUNT")?)?, from.into());
            }
            Err(ShardError::NoScheduler)
        }
    }
}

/// Cuts units of the given weights (estimated tokens) into `count` contiguous shards of about equal weight and
/// returns each unit's shard. A unit goes to the shard its weight's midpoint falls in; when there are at least as
/// many units as shards, every shard gets one unit or more; with fewer units than shards, the last shards are
/// empty. Deterministic: the same weights always give the same split.
pub fn split(weights: &[u64], count: u32) -> Vec<u32> {
    let units = weights.len();
    let n = count.max(1) as usize;
    if units <= n {
        return (0..units as u32).collect();
    }
    // A unit weighs at least 1, so rows that estimate to nothing are still spread.
    let w: Vec<u128> = weights.iter().map(|&x| x.max(1) as u128).collect();
    let total: u128 = w.iter().sum();
    // bounds[s] = the first unit of shard s; bounds[n] = units.
    let mut bounds = vec![0usize; n + 1];
    bounds[n] = units;
    let mut before = 0u128;
    let mut unit = 0usize;
    for s in 1..n {
        // Units whose midpoint (2 x before + w, in half-units) lies below s/n of the total belong to shards < s.
        while unit < units && (2 * before + w[unit]) * n as u128 <= 2 * total * s as u128 {
            before += w[unit];
            unit += 1;
        }
        bounds[s] = unit.max(bounds[s - 1] + 1).min(units - (n - s));
        // Keep the scan in step with a bound the clamp moved.
        while unit < bounds[s] {
            before += w[unit];
            unit += 1;
        }
        while unit > bounds[s] {
            unit -= 1;
            before -= w[unit];
        }
    }
    let mut out = Vec::with_capacity(units);
    for s in 0..n {
        out.extend(std::iter::repeat_n(s as u32, bounds[s + 1] - bounds[s]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    fn auto(vars: &[(&str, &str)], count: Option<u32>) -> Result<(u32, u32), ShardError> {
        match resolve(Some(&ShardArg::Auto), count, env(vars))? {
            Assignment::One { index, count, .. } => Ok((index, count)),
            Assignment::All => panic!("auto resolved to all"),
        }
    }

    #[test]
    fn shard_flag_parses_index_over_count_auto_and_all() {
        assert_eq!("3/8".parse::<ShardArg>().unwrap(), ShardArg::Index { index: 3, count: Some(8) });
        assert_eq!("3".parse::<ShardArg>().unwrap(), ShardArg::Index { index: 3, count: None });
        assert_eq!("auto".parse::<ShardArg>().unwrap(), ShardArg::Auto);
        assert_eq!("all".parse::<ShardArg>().unwrap(), ShardArg::All);
        for bad in ["", "x", "1/", "/4", "-1/4", "1/4/2", "one/two"] {
            assert!(bad.parse::<ShardArg>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn explicit_shard_needs_an_index_below_a_known_count() {
        let none = env(&[]);
        let idx = |i, n| ShardArg::Index { index: i, count: n };
        assert!(matches!(resolve(Some(&idx(3, Some(8))), None, &none), Ok(Assignment::One { index: 3, count: 8, .. })));
        assert!(matches!(resolve(Some(&idx(3, None)), Some(8), &none), Ok(Assignment::One { index: 3, count: 8, .. })));
        assert!(matches!(resolve(Some(&idx(8, Some(8))), None, &none), Err(ShardError::OutOfRange { .. })));
        assert!(matches!(resolve(Some(&idx(0, Some(0))), None, &none), Err(ShardError::ZeroCount)));
        assert!(matches!(resolve(Some(&idx(3, None)), None, &none), Err(ShardError::NoCount { .. })));
        assert!(matches!(resolve(Some(&idx(3, Some(8))), Some(4), &none), Err(ShardError::CountMismatch { .. })));
        assert_eq!(resolve(None, Some(4), &none).unwrap(), Assignment::All);
        assert_eq!(resolve(Some(&ShardArg::All), None, &none).unwrap(), Assignment::All);
    }

    #[test]
    fn kubernetes_index_takes_its_count_from_the_flag_or_job_file() {
        assert_eq!(auto(&[("JOB_COMPLETION_INDEX", "5")], Some(8)).unwrap(), (5, 8));
        assert!(matches!(auto(&[("JOB_COMPLETION_INDEX", "5")], None), Err(ShardError::AutoNoCount { index: 5, .. })));
        assert!(matches!(auto(&[("JOB_COMPLETION_INDEX", "8")], Some(8)), Err(ShardError::OutOfRange { .. })));
        assert!(matches!(auto(&[("JOB_COMPLETION_INDEX", "five")], Some(8)), Err(ShardError::NotANumber { .. })));
    }

    #[test]
    fn slurm_array_ids_map_to_zero_based_shards_whatever_the_first_id_and_step() {
        let slurm = |id: &str, min: &str, step: &str, count: &str| {
            auto(&[("SLURM_ARRAY_TASK_ID", id), ("SLURM_ARRAY_TASK_MIN", min), ("SLURM_ARRAY_TASK_STEP", step), ("SLURM_ARRAY_TASK_COUNT", count)], None)
        };
        assert_eq!(slurm("0", "0", "1", "4").unwrap(), (0, 4));
        assert_eq!(slurm("3", "0", "1", "4").unwrap(), (3, 4));
        // --array=1-4
        assert_eq!(slurm("1", "1", "1", "4").unwrap(), (0, 4));
        assert_eq!(slurm("4", "1", "1", "4").unwrap(), (3, 4));
        // --array=0-6:2 is 0, 2, 4, 6
        assert_eq!(slurm("4", "0", "2", "4").unwrap(), (2, 4));
        assert!(matches!(slurm("3", "0", "2", "4"), Err(ShardError::SlurmIndex { .. })));
        // --array=1,5,9 (a list): Slurm states step 1, so id 5 is past the 3 tasks.
        assert!(matches!(slurm("5", "1", "1", "3"), Err(ShardError::SlurmIndex { .. })));
        // The count from the array, checked against a flag.
        assert_eq!(auto(&[("SLURM_ARRAY_TASK_ID", "2"), ("SLURM_ARRAY_TASK_COUNT", "4")], Some(4)).unwrap(), (2, 4));
        assert!(matches!(
            auto(&[("SLURM_ARRAY_TASK_ID", "2"), ("SLURM_ARRAY_TASK_COUNT", "4")], Some(8)),
            Err(ShardError::CountMismatch { env: 4, flag: 8, .. })
        ));
    }

    #[test]
    fn aws_batch_and_google_batch_indices_use_their_size_variables_or_the_flag() {
        assert_eq!(auto(&[("AWS_BATCH_JOB_ARRAY_INDEX", "7"), ("AWS_BATCH_JOB_ARRAY_SIZE", "10")], None).unwrap(), (7, 10));
        assert_eq!(auto(&[("AWS_BATCH_JOB_ARRAY_INDEX", "7")], Some(10)).unwrap(), (7, 10));
        assert!(matches!(auto(&[("AWS_BATCH_JOB_ARRAY_INDEX", "7")], None), Err(ShardError::AutoNoCount { .. })));
        assert_eq!(auto(&[("BATCH_TASK_INDEX", "0"), ("BATCH_TASK_COUNT", "3")], None).unwrap(), (0, 3));
        assert!(matches!(auto(&[("BATCH_TASK_INDEX", "3"), ("BATCH_TASK_COUNT", "3")], None), Err(ShardError::OutOfRange { .. })));
    }

    #[test]
    fn auto_without_a_scheduler_names_the_variables_it_looked_for() {
        let e = auto(&[("SLURM_JOB_ID", "12")], Some(4)).unwrap_err();
        assert!(matches!(e, ShardError::NoScheduler));
        let text = e.to_string();
        for name in ["JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "AWS_BATCH_JOB_ARRAY_INDEX", "BATCH_TASK_INDEX"] {
            assert!(text.contains(name), "{text}");
        }
    }

    fn loads(weights: &[u64], shards: &[u32], n: u32) -> Vec<u64> {
        let mut out = vec![0; n as usize];
        for (w, s) in weights.iter().zip(shards) {
            out[*s as usize] += w;
        }
        out
    }

    #[test]
    fn equal_units_split_into_equal_contiguous_shards() {
        let shards = split(&[10; 20], 4);
        assert_eq!(shards, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3]);
        assert_eq!(split(&[10; 3], 1), [0, 0, 0]);
        assert_eq!(split(&[], 4), Vec::<u32>::new());
    }

    #[test]
    fn fewer_units_than_shards_leaves_the_last_shards_empty() {
        assert_eq!(split(&[5, 500, 7], 8), [0, 1, 2]);
    }

    #[test]
    fn split_balances_estimated_tokens_not_unit_counts() {
        // Ten heavy units followed by thirty light ones of a third the weight.
        let mut w = vec![300u64; 10];
        w.extend([100u64; 30]);
        let shards = split(&w, 2);
        assert_eq!(loads(&w, &shards, 2), vec![3000, 3000]);
        assert_eq!(shards.iter().filter(|&&s| s == 0).count(), 10);
    }

    #[test]
    fn random_splits_are_contiguous_cover_every_unit_and_leave_no_shard_empty() {
        // A small xorshift, seeded and printed, so a failure can be replayed.
        let seed = 0x9e37_79b9_7f4a_7c15u64 ^ std::process::id() as u64;
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..500 {
            let units = (next() % 60) as usize;
            let n = 1 + (next() % 12) as u32;
            let weights: Vec<u64> = (0..units).map(|_| if next() % 5 == 0 { next() % 100_000 } else { next() % 1000 }).collect();
            let shards = split(&weights, n);
            assert_eq!(shards.len(), units, "seed {seed:#x}");
            assert!(shards.windows(2).all(|p| p[1] == p[0] || p[1] == p[0] + 1), "not contiguous: {shards:?} (seed {seed:#x})");
            assert!(shards.iter().all(|&s| s < n), "seed {seed:#x}");
            if units >= n as usize {
                assert_eq!(shards.first(), Some(&0));
                assert_eq!(shards.last(), Some(&(n - 1)), "a shard is empty: {shards:?} (seed {seed:#x})");
                // No shard carries more than its share plus its heaviest unit (midpoint rounding moves at most one).
                let total: u64 = weights.iter().map(|w| w.max(&1)).sum();
                let heaviest = weights.iter().copied().max().unwrap_or(0).max(1);
                let load = loads(&weights.iter().map(|w| *w.max(&1)).collect::<Vec<_>>(), &shards, n);
                for l in &load {
                    assert!(*l <= total / n as u64 + 2 * heaviest, "{load:?} from {weights:?} (seed {seed:#x})");
                }
            }
        }
    }
}
