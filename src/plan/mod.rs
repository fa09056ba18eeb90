//! The plan of a run: which input files (pinned by size and e_tag), cut into which units, for which job.
//!
//! A unit is a run of consecutive rows of one input file, a few thousand rows: the granule of commits and of
//! resuming. The plan is written once to `OUT/_plan.json` (create-once, the first writer wins) and every later
//! attempt at the same output reads it back, so all attempts agree on the units even if the input prefix gains
//! files during the night. The [`Fingerprint`] stops a different job from mixing into an existing output.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub mod report;
pub mod shard;

/// Bumped when the output layout or the results schema changes incompatibly.
pub const OUTPUT_FORMAT_VERSION: u32 = 2;

/// One input file as planned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedFile {
    /// Path inside the input store.
    pub path: String,
    pub size: u64,
    pub e_tag: Option<String>,
    pub rows: u64,
}

/// A run of consecutive rows of one input file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unit {
    pub id: u32,
    /// Index into [`Plan::files`].
    pub file: usize,
    pub first_row: u64,
    pub rows: u32,
    /// The shard the unit belongs to (plans written before sharding have one shard, 0).
    #[serde(default)]
    pub shard: u32,
    /// Estimated prompt and output tokens, which the shards are balanced by.
    #[serde(default)]
    pub estimated_tokens: u64,
}

/// What makes two runs the same job: the same rows, prompts, model and parameters give the same results.
/// Throughput settings (threads, batch sizes, device) are not part of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub format_version: u32,
    pub model_sha256: String,
    /// How rows become prompts: columns, chat template and system prompt (as hashes), truncation, parameter columns.
    pub prompt: serde_json::Value,
    /// The job's generation parameters.
    pub generation: serde_json::Value,
    /// The input files as listed when the plan was made.
    pub input: Vec<PlannedFile>,
}

impl Fingerprint {
    /// A short hash of the whole fingerprint, for file metadata and logs.
    pub fn digest(&self) -> String {
        let bytes = serde_json::to_vec(self).expect("fingerprints serialise");
        format!("{:x}", Sha256::digest(&bytes))[..16].to_string()
    }

    /// The parts in which `self` (the stored plan's) and `other` (this run's) differ, described for a message.
    pub fn differences(&self, other: &Fingerprint) -> Vec<String> {
        let mut out = Vec::new();
        if self.format_version != other.format_version {
            out.push(format!("output format version {} vs {}", self.format_version, other.format_version));
        }
        if self.model_sha256 != other.model_sha256 {
            out.push(format!("model sha256 {} vs {}", short(&self.model_sha256), short(&other.model_sha256)));
        }
        for (name, a, b) in [("prompt", &self.prompt, &other.prompt), ("generation", &self.generation, &other.generation)] {
            let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
                if a != b {
                    out.push(format!("{name} settings"));
                }
                continue;
            };
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                if a.get(key) != b.get(key) {
                    let show = |v: Option<&serde_json::Value>| v.map(|v| v.to_string()).unwrap_or_else(|| "unset".into());
                    out.push(format!("{name}.{key} {} vs {}", show(a.get(key)), show(b.get(key))));
                }
            }
        }
        if self.input != other.input {
            let planned: Vec<&PlannedFile> = self.input.iter().filter(|f| !other.input.contains(f)).collect();
            let now: Vec<&PlannedFile> = other.input.iter().filter(|f| !self.input.contains(f)).collect();
            let names = |fs: &[&PlannedFile]| fs.iter().take(3).map(|f| format!("`{}`", f.path)).collect::<Vec<_>>().join(", ");
            out.push(format!(
                "input files: planned {} file(s), now {} (changed or new: {}; planned but gone or changed: {})",
                self.input.len(),
                other.input.len(),
                if now.is_empty() { "none".into() } else { names(&now) },
                if planned.is_empty() { "none".into() } else { names(&planned) },
            ));
        }
        out
    }
}

fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}

/// The contents of `_plan.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub nightshift_version: String,
    pub fingerprint: Fingerprint,
    pub unit_rows: u32,
    /// How many shards the units are split into (see [`shard`]); every process of the job agrees on it.
    #[serde(default = "one_shard")]
    pub shards: u32,
    pub units: Vec<Unit>,
}

fn one_shard() -> u32 {
    1
}

impl Plan {
    /// Cuts every file into units of at most `unit_rows` rows (units never span files) and the units into `shards`
    /// contiguous shards balanced by `estimate(file, first_row, rows)`, the estimated tokens of a run of rows.
    ///
    /// With several shards, a unit is also at most an equal share of the job's rows (`ceil(rows / shards)`): a
    /// job smaller than `shards x unit_rows` would otherwise be one or two units, all in the first shards, and the
    /// others would idle. `unit_rows` stays the ceiling (smaller units only commit more often and lose less to a
    /// kill); the plan records the `unit_rows` asked for.
    pub fn new(fingerprint: Fingerprint, unit_rows: u32, shards: u32, estimate: impl Fn(usize, u64, u32) -> u64) -> Plan {
        let shards = shards.max(1);
        let total: u64 = fingerprint.input.iter().map(|f| f.rows).sum();
        let unit = (unit_rows as u64).min(total.div_ceil(shards as u64)).max(1);
        let mut units = Vec::new();
        for (file, f) in fingerprint.input.iter().enumerate() {
            let mut first_row = 0;
            while first_row < f.rows {
                let rows = (f.rows - first_row).min(unit) as u32;
                let estimated_tokens = estimate(file, first_row, rows);
                units.push(Unit { id: units.len() as u32, file, first_row, rows, shard: 0, estimated_tokens });
                first_row += rows as u64;
            }
        }
        let weights: Vec<u64> = units.iter().map(|u| u.estimated_tokens).collect();
        for (unit, s) in units.iter_mut().zip(shard::split(&weights, shards)) {
            unit.shard = s;
        }
        Plan { nightshift_version: env!("CARGO_PKG_VERSION").into(), fingerprint, unit_rows, shards, units }
    }

    pub fn total_rows(&self) -> u64 {
        self.units.iter().map(|u| u.rows as u64).sum()
    }

    /// The units of one shard, in order.
    pub fn shard_units(&self, shard: u32) -> impl Iterator<Item = &Unit> {
        self.units.iter().filter(move |u| u.shard == shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint(rows: &[u64]) -> Fingerprint {
        Fingerprint {
            format_version: OUTPUT_FORMAT_VERSION,
            model_sha256: "ab".repeat(32),
            prompt: serde_json::json!({"column": "prompt"}),
            generation: serde_json::json!({"max_new_tokens": 8, "temperature": 0.0}),
            input: rows
                .iter()
                .enumerate()
                .map(|(i, &rows)| PlannedFile { path: format!("in/{i}.parquet"), size: 100, e_tag: Some(format!("e{i}")), rows })
                .collect(),
        }
    }

    #[test]
    fn units_cover_every_row_once_and_never_span_files() {
        let plan = Plan::new(fingerprint(&[5, 0, 12]), 4, 1, |_, _, rows| rows as u64);
        let shape: Vec<(usize, u64, u32)> = plan.units.iter().map(|u| (u.file, u.first_row, u.rows)).collect();
        assert_eq!(shape, vec![(0, 0, 4), (0, 4, 1), (2, 0, 4), (2, 4, 4), (2, 8, 4)]);
        assert_eq!(plan.units.iter().map(|u| u.id).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(plan.total_rows(), 17);
    }

    #[test]
    fn shards_are_stored_per_unit_and_weigh_estimated_tokens() {
        // File 0's rows are four times as heavy as file 1's: its 2 units weigh what file 1's 8 do.
        let plan = Plan::new(fingerprint(&[8, 32]), 4, 2, |file, _, rows| rows as u64 * if file == 0 { 4 } else { 1 });
        assert_eq!(plan.shards, 2);
        let shards: Vec<u32> = plan.units.iter().map(|u| u.shard).collect();
        assert_eq!(shards, [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
        assert_eq!(plan.shard_units(0).map(|u| u.estimated_tokens).sum::<u64>(), 32);
        assert_eq!(plan.shard_units(1).map(|u| u.estimated_tokens).sum::<u64>(), 32);
    }

    #[test]
    fn a_small_job_over_several_shards_gives_every_shard_work() {
        // 60 rows at the default 2048 rows a unit were one unit: shard 0 did everything.
        let plan = Plan::new(fingerprint(&[60]), 2048, 3, |_, _, rows| rows as u64);
        assert_eq!(plan.units.iter().map(|u| u.rows).collect::<Vec<_>>(), [20, 20, 20]);
        assert_eq!(plan.units.iter().map(|u| u.shard).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(plan.unit_rows, 2048, "the plan records the unit size asked for");
        // Files of their own stay apart; every shard still gets rows.
        let plan = Plan::new(fingerprint(&[7, 50]), 2048, 4, |_, _, rows| rows as u64);
        assert_eq!(plan.total_rows(), 57);
        assert!((0..4).all(|s| plan.shard_units(s).count() > 0), "{:?}", plan.units);
        // unit_rows stays the ceiling for a big job, and one shard keeps its units whole.
        let plan = Plan::new(fingerprint(&[100_000]), 2048, 4, |_, _, rows| rows as u64);
        assert!(plan.units.iter().all(|u| u.rows <= 2048) && plan.units.len() == 49);
        assert_eq!(Plan::new(fingerprint(&[60]), 2048, 1, |_, _, rows| rows as u64).units.len(), 1);
    }

    #[test]
    fn a_plan_written_before_sharding_reads_as_one_shard() {
        let old = r#"{"nightshift_version":"0.1.0","fingerprint":{"format_version":1,"model_sha256":"ab","prompt":{},
            "generation":{},"input":[]},"unit_rows":4,"units":[{"id":0,"file":0,"first_row":0,"rows":4}]}"#;
        let plan: Plan = serde_json::from_str(old).unwrap();
        assert_eq!((plan.shards, plan.units[0].shard), (1, 0));
    }

    #[test]
    fn differences_name_the_changed_parts() {
        let a = fingerprint(&[5]);
        assert!(a.differences(&a.clone()).is_empty());
        let mut b = a.clone();
        b.generation = serde_json::json!({"max_new_tokens": 8, "temperature": 0.7});
        b.input[0].e_tag = Some("changed".into());
        let d = b.differences(&a).join("; ");
        assert!(d.contains("generation.temperature 0.7") && d.contains("input files") && d.contains("in/0.parquet"), "{d}");
        assert_ne!(a.digest(), b.digest());
    }

    #[test]
    fn plan_round_trips_through_json() {
        let plan = Plan::new(fingerprint(&[3, 7]), 4, 2, |_, _, rows| rows as u64);
        let back: Plan = serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
        assert_eq!(back, plan);
    }
}
