//! Incremental runs: a request key per row, rows copied from earlier outputs instead of computed again
//! ([`sources`]), and identical requests of a run computed once ([`dedup`]).
//!
//! # Which rows are reusable
//! A row's output is decided by the model's bytes, the tokens the engine sees (after chat template, system prompt
//! and truncation; a scoring row's completion tokens too), the row's effective generation parameters, the job kind
//! and the engine's arithmetic. Every one of these goes into the row's [`RequestKey`]. Greedy rows
//! (`temperature = 0` or `top_k = 1`) do not depend on the seed, which is left out of their key. A sampling row's
//! seed derives from (seed, row id) (`engine::sampling::row_seed`), so its key also holds the row id: it is
//! reused only by the same row id with the same seed. Sampling is batch-invariant (a row's draws do not depend on
//! what it was batched with), so with these rules every row is deterministic given its key, and equal keys give
//! equal outputs. Only succeeded rows are copied from a source; errored ones are computed again.
//!
//! The arithmetic is named by [`numerics`]: a version bumped whenever a kernel or the engine's arithmetic
//! changes, the device kind, how the weights are computed, the KV cache's dtype, the attention kernel where it
//! is not the CPU's own and a Hugging Face decoder's dtype where the job named one other than the device's. The CPU kernels' levels
//! (portable, AVX2, VNNI) and the prefix cache compute bit-identical results on the CPU (both tested), so neither
//! is part of it there; on an accelerator, where that is not established, the prefix cache is.

pub mod dedup;
pub mod sources;

use sha2::{Digest, Sha256};

use crate::job::{GenerationParams, JobKind, RowParams};

/// Bumped whenever the engine's arithmetic changes (a kernel, an accumulation order, a sampling detail), so that
/// results computed before never serve a run after.
pub const NUMERICS_VERSION: u32 = 1;

/// The arithmetic a run computes with, as written in every result file's `nightshift.numerics` metadata.
/// `attention`: the attention backend and kernel (`host`, `paged-tiled`, `paged-flash`; `none` for an encoder),
/// named unless it is the CPU's own (`host`), so that a row computed by another kernel (`runtime.attention`) never
/// serves a run of this one, and the CPU's default strings stay as they were. `dtype`: the dtype a Hugging Face
/// decoder computes in, where the job named one other than the device's default (`runtime.dtype`).
pub fn numerics(accelerator: bool, weights_layout: &str, kv_cache_dtype: &str, prefix_cache: bool, attention: &str, dtype: Option<&str>, tensor_parallel: usize) -> String {
    let device = if accelerator { "accelerator" } else { "cpu" };
    let mut out = format!("v{NUMERICS_VERSION};device={device};weights={weights_layout};kv={kv_cache_dtype}");
    // Where the prefix cache can change a row's last bits: on an accelerator, and under `host-amx`, whose prefills
    // run on the tile unit but whose one-token steps (a cache hit one token short of the prompt) do not.
    if accelerator || attention == "host-amx" {
        out.push_str(&format!(";prefix_cache={prefix_cache}"));
    }
    if accelerator || !matches!(attention, "host" | "none") {
        out.push_str(&format!(";attention={attention}"));
    }
    if let Some(dtype) = dtype {
        out.push_str(&format!(";dtype={dtype}"));
    }
    // Ranks sum their partial products in another order than one model does: the same greedy tokens, other bits.
    if tensor_parallel > 1 {
        out.push_str(&format!(";tensor_parallel={tensor_parallel}"));
    }
    out
}

/// The sha256 of everything that decides a row's output (see the module's rules).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestKey(pub [u8; 32]);

impl RequestKey {
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A key from its 64 hex digits.
    pub fn parse(hex: &str) -> Option<RequestKey> {
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut key = [0u8; 32];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(RequestKey(key))
    }

    /// The first 16 bytes as two words, as a reuse source's index and `plan`'s set of requests hold them.
    pub fn words(&self) -> [u64; 2] {
        [u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes")), u64::from_le_bytes(self.0[8..16].try_into().expect("8 bytes"))]
    }
}

impl std::fmt::Debug for RequestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RequestKey({})", &self.hex()[..16])
    }
}

/// Whether a row with these parameters samples (its output depends on its seed, hence on its id).
pub fn samples(params: &GenerationParams) -> bool {
    params.temperature > 0.0 && params.top_k != 1
}

/// What every key of a run shares: model, kind, arithmetic and the job's parameters.
#[derive(Clone)]
pub struct KeyContext {
    /// Hash state over the run's shared parts, cloned per row.
    base: Sha256,
    kind: JobKind,
    generation: GenerationParams,
}

impl KeyContext {
    pub fn new(model_sha256: &str, kind: JobKind, numerics: &str, generation: &GenerationParams) -> KeyContext {
        let mut base = Sha256::new();
        base.update(b"nightshift.request_key.v1\0");
        for part in [model_sha256, kind_name(kind), numerics] {
            field(&mut base, part.as_bytes());
        }
        KeyContext { base, kind, generation: generation.clone() }
    }

    /// The key of a tokenized row; `None` when its parameters are invalid (the engine refuses the row).
    pub fn key(&self, id: &str, params: &RowParams, tokens: &[u32], completion: Option<&[u32]>) -> Option<RequestKey> {
        let mut h = self.base.clone();
        tokens_field(&mut h, tokens);
        match completion {
            Some(completion) => {
                h.update([1u8]);
                tokens_field(&mut h, completion);
            }
            None => h.update([0u8]),
        }
        if self.kind != JobKind::Embed {
            let mut effective = self.generation.for_row(params).ok()?;
            let sampled = samples(&effective);
            if !sampled {
                // A greedy row's output does not depend on its seed.
                effective.seed = 0;
            }
            let json = serde_json::to_vec(&effective.to_json_object()).expect("parameters serialise");
            field(&mut h, &json);
            if sampled {
                h.update([1u8]);
                field(&mut h, id.as_bytes());
            } else {
                h.update([0u8]);
            }
        }
        Some(RequestKey(h.finalize().into()))
    }
}

fn kind_name(kind: JobKind) -> &'static str {
    match kind {
        JobKind::Generate => "generate",
        JobKind::Embed => "embed",
        JobKind::Seq2seq => "seq2seq",
    }
}

/// A length-prefixed part, so that no two different sequences of parts hash the same bytes.
fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

fn tokens_field(h: &mut Sha256, tokens: &[u32]) {
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(generation: &GenerationParams) -> KeyContext {
        KeyContext::new("abc", JobKind::Generate, &numerics(false, "as-stored", "f32", true, "host", None, 1), generation)
    }

    #[test]
    fn keys_depend_on_what_decides_the_output_and_nothing_else() {
        let greedy = GenerationParams { max_new_tokens: 8, ..GenerationParams::default() };
        let c = context(&greedy);
        let none = RowParams::default();
        let k = c.key("a", &none, &[1, 2, 3], None).unwrap();
        // Same request under another id, or another job seed: the same key for a greedy row.
        assert_eq!(c.key("b", &none, &[1, 2, 3], None), Some(k));
        let seeded = RowParams { seed: Some(7), ..RowParams::default() };
        assert_eq!(c.key("a", &seeded, &[1, 2, 3], None), Some(k));
        // Tokens, the completion, a parameter, the model, the kind and the numerics all change it.
        assert_ne!(c.key("a", &none, &[1, 2, 4], None), Some(k));
        assert_ne!(c.key("a", &none, &[1, 2], Some(&[3][..])), Some(k));
        assert_ne!(c.key("a", &none, &[1, 2, 3], Some(&[][..])), Some(k));
        let longer = RowParams { max_new_tokens: Some(9), ..RowParams::default() };
        assert_ne!(c.key("a", &longer, &[1, 2, 3], None), Some(k));
        let others = [
            KeyContext::new("abd", JobKind::Generate, &numerics(false, "as-stored", "f32", true, "host", None, 1), &greedy),
            KeyContext::new("abc", JobKind::Seq2seq, &numerics(false, "as-stored", "f32", true, "host", None, 1), &greedy),
            KeyContext::new("abc", JobKind::Generate, &numerics(false, "as-stored", "f16", true, "host", None, 1), &greedy),
            KeyContext::new("abc", JobKind::Generate, &numerics(false, "q8_0", "f32", true, "host", None, 1), &greedy),
            KeyContext::new("abc", JobKind::Generate, &numerics(true, "as-stored", "f32", true, "host", None, 1), &greedy),
        ];
        for other in others {
            assert_ne!(other.key("a", &none, &[1, 2, 3], None), Some(k));
        }
        // The prefix cache is exact on the CPU, and named on an accelerator.
        assert_eq!(numerics(false, "as-stored", "f32", false, "host", None, 1), numerics(false, "as-stored", "f32", true, "host", None, 1));
        // The CPU's own attention is not named (the strings of earlier runs stay valid); another kernel is.
        assert_eq!(numerics(false, "as-stored", "f32", true, "host", None, 1), format!("v{NUMERICS_VERSION};device=cpu;weights=as-stored;kv=f32"));
        assert_ne!(numerics(false, "as-stored", "f32", true, "host", None, 1), numerics(false, "as-stored", "f32", true, "paged-tiled", None, 1));
        assert_ne!(numerics(true, "as-stored", "bf16", true, "paged-tiled", None, 1), numerics(true, "as-stored", "bf16", true, "paged-tiled", Some("f16"), 1));
        // Tensor parallelism is named where it ran.
        assert_eq!(numerics(false, "as-stored", "f32", true, "host", None, 2), format!("v{NUMERICS_VERSION};device=cpu;weights=as-stored;kv=f32;tensor_parallel=2"));
        assert_ne!(numerics(true, "as-stored", "f16", true, "paged-tiled", None, 1), numerics(true, "as-stored", "f16", true, "paged-flash", None, 1));
        assert_ne!(numerics(true, "as-stored", "f32", false, "host", None, 1), numerics(true, "as-stored", "f32", true, "host", None, 1));
        // `host-amx` is named, and so is the prefix cache under it (a hit one token short prefills that token in f32).
        assert_eq!(numerics(false, "as-stored", "f32", true, "host-amx", None, 1), format!("v{NUMERICS_VERSION};device=cpu;weights=as-stored;kv=f32;prefix_cache=true;attention=host-amx"));
        assert_ne!(numerics(false, "as-stored", "f32", false, "host-amx", None, 1), numerics(false, "as-stored", "f32", true, "host-amx", None, 1));
        // Invalid parameters: no key.
        let invalid = RowParams { min_new_tokens: Some(100), ..RowParams::default() };
        assert_eq!(c.key("a", &invalid, &[1], None), None);
    }

    #[test]
    fn a_sampling_rows_key_holds_its_id_and_seed() {
        let sampling = GenerationParams { max_new_tokens: 8, temperature: 0.7, ..GenerationParams::default() };
        let c = context(&sampling);
        let none = RowParams::default();
        let k = c.key("a", &none, &[1, 2, 3], None).unwrap();
        assert_eq!(c.key("a", &none, &[1, 2, 3], None), Some(k));
        assert_ne!(c.key("b", &none, &[1, 2, 3], None), Some(k));
        assert_ne!(c.key("a", &RowParams { seed: Some(7), ..RowParams::default() }, &[1, 2, 3], None), Some(k));
        // top_k = 1 is greedy whatever the temperature: the id is left out.
        let one = RowParams { top_k: Some(1), ..RowParams::default() };
        assert_eq!(c.key("a", &one, &[1, 2, 3], None), c.key("b", &one, &[1, 2, 3], None));
    }

    #[test]
    fn embedding_keys_ignore_generation_parameters_and_ids() {
        let c = KeyContext::new("abc", JobKind::Embed, "n", &GenerationParams::default());
        let sampling = RowParams { temperature: Some(1.0), ..RowParams::default() };
        assert_eq!(c.key("a", &RowParams::default(), &[5, 6], None), c.key("b", &sampling, &[5, 6], None));
    }

    #[test]
    fn hex_round_trips() {
        let key = RequestKey(std::array::from_fn(|i| (i * 37) as u8));
        assert_eq!(RequestKey::parse(&key.hex()), Some(key));
        assert_eq!(RequestKey::parse("zz"), None);
        assert_eq!(RequestKey::parse(&"g".repeat(64)), None);
    }
}
