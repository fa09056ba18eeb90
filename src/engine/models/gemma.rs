//! Gemma 2 and Gemma 3 (text): llama's weights plus a norm after attention and after the feed-forward network, a
//! GeGLU feed-forward network (tanh GELU), embeddings scaled by `sqrt(hidden)`, queries scaled by
//! `1 / sqrt(query_pre_attn_scalar)`, sliding-window layers interleaved with global ones (Gemma 3's with a RoPE base
//! of their own), soft-capped attention scores (Gemma 2) and final logits (Gemma 2; Gemma 3 where configured), and
//! per-head q/k norms (Gemma 3). Gemma's RMSNorm multiplies by `1 + w`: GGUF files store `1 + w` (llama.cpp's
//! converter adds the one), Hugging Face checkpoints `w`, to which the loader adds it.
//!
//! The family shares the decoder's [`Model`](super::llama::Model) (embedding, head, the batch engine's step):
//! its own are the layers' post-norms ([`PostNorms`]), the layer loop ([`run`]) and the configuration
//! ([`GemmaConfig`]), read from GGUF metadata ([`GemmaConfig::of_gguf`]) as llama.cpp reads it.

use crate::engine::attention::{Attention, AttentionShape, Segment};
use crate::engine::models::Sliding;
use crate::engine::models::lanes::{Activation, Lane, Vector};
use crate::engine::models::llama::layers::{attention_block, Layer};
use crate::engine::ModelError;

/// What Gemma adds to the llama shape.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaConfig {
    /// 2 or 3.
    pub version: u8,
    /// Queries are scaled by `1 / sqrt(query_pre_attn_scalar)` (the head size, but for the 27B models).
    pub query_pre_attn_scalar: f32,
    /// Soft-capping of attention scores (Gemma 2: 50).
    pub attn_softcap: Option<f32>,
    /// Soft-capping of the final logits (Gemma 2: 30).
    pub final_softcap: Option<f32>,
}

impl GemmaConfig {
    /// The embedding's scale, `sqrt(hidden)` in f32 (as llama.cpp and Hugging Face compute it in f32).
    pub fn embedding_scale(hidden: usize) -> f32 {
        (hidden as f32).sqrt()
    }

    /// A GGUF file's Gemma keys, as llama.cpp reads them (`llama_model_gemma2/3::load_arch_hparams`): the window
    /// (Gemma 2: 4,096 when absent; Gemma 3: no sliding layers when absent), the pattern (every 2nd layer global in
    /// Gemma 2, every 6th in Gemma 3, or `attention.sliding_window_pattern`), the local layers' RoPE base
    /// (`rope.freq_base_swa`: 10,000 in Gemma 3, the global base in Gemma 2), the soft-caps (Gemma 2: 50 and 30
    /// when absent), and the query scale, which GGUF does not store: `hidden / heads` for the 27B models (by their
    /// layer count), the head size otherwise. Returns the sliding layers beside the rest.
    pub(crate) fn of_gguf(
        version: u8,
        layers: usize,
        (hidden, heads, head_dim): (usize, usize, usize),
        rope_base: f32,
        number: impl Fn(&str) -> Option<f64>,
        pattern: Option<Vec<bool>>,
    ) -> Result<(GemmaConfig, Option<Sliding>), ModelError> {
        let positive = |key: &str| -> Result<Option<f64>, ModelError> {
            match number(key) {
                Some(v) if !(v.is_finite() && v > 0.0) => Err(ModelError::Metadata(format!("`gemma{version}.{key}` is {v}: it must be positive"))),
                other => Ok(other),
            }
        };
        let window = positive("attention.sliding_window")?.map(|w| w as usize).or((version == 2).then_some(4096));
        let period = positive("attention.sliding_window_pattern")?.map(|p| p as usize).unwrap_or(if version == 2 { 2 } else { 6 });
        let sliding = match window {
            None => None,
            Some(window) => {
                // llama.cpp's `set_swa_pattern`: within each period, all layers but the last slide.
                let layers = match pattern {
                    Some(p) if p.len() == layers => p,
                    Some(p) => return Err(ModelError::Metadata(format!("`gemma{version}.attention.sliding_window_pattern` has {} entries for {layers} layers", p.len()))),
                    None => (0..layers).map(|l| l % period < period - 1).collect(),
                };
                let local_base = positive("rope.freq_base_swa")?.map_or(if version == 2 { rope_base } else { 10_000.0 }, |b| b as f32);
                Some(Sliding { window, layers, rope_base: local_base })
            }
        };
        let big = (version == 2 && layers == 46) || (version == 3 && layers == 62);
        let query_pre_attn_scalar = if big { (hidden / heads) as f32 } else { head_dim as f32 };
        let softcap = |key: &str, default: f32| -> Result<Option<f32>, ModelError> {
            Ok(match (positive(key)?, version) {
                (Some(v), _) => Some(v as f32),
                (None, 2) => Some(default),
                (None, _) => None,
            })
        };
        let config = GemmaConfig {
            version,
            query_pre_attn_scalar,
            attn_softcap: if version == 2 { softcap("attn_logit_softcapping", 50.0)? } else { None },
            final_softcap: softcap("final_logit_softcapping", 30.0)?,
        };
        Ok((config, sliding))
    }

    /// One line for `validate` and the load log: what the family computes beyond llama's layers.
    pub fn describe(&self) -> String {
        let cap = |c: Option<f32>| c.map_or("none".to_string(), |c| c.to_string());
        format!(
            "gemma {}: queries scaled by 1/sqrt({}), attention soft-cap {}, final soft-cap {}",
            self.version,
            self.query_pre_attn_scalar,
            cap(self.attn_softcap),
            cap(self.final_softcap)
        )
    }

    /// The attention's scale and soft-cap, applied to the llama shape's `shape`.
    pub(crate) fn shape_attention(&self, shape: &mut AttentionShape) {
        shape.scale = 1.0 / self.query_pre_attn_scalar.sqrt();
        shape.softcap = self.attn_softcap;
    }
}

/// A Gemma layer's norms after attention and after the feed-forward network, `[hidden]` each (as `1 + w`).
pub struct PostNorms {
    pub attn: Vector,
    pub ffn: Vector,
}

impl PostNorms {
    pub fn vectors_mut(&mut self) -> [&mut Vector; 2] {
        [&mut self.attn, &mut self.ffn]
    }

    pub fn bytes(&self) -> usize {
        self.attn.bytes() + self.ffn.bytes()
    }
}

/// Gemma's layers over `x`, the scaled embeddings (in `lane`'s form): the last hidden states. Per layer: RMSNorm,
/// q/k/v, q/k per-head norms (Gemma 3), attention, output projection, post-attention norm, residual add; RMSNorm,
/// GeGLU, post-feed-forward norm, residual add. `eps`: RMSNorm's epsilon over the laid-out width; `head_eps` the
/// per-head norms'.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<L: Lane, A: Attention>(
    lane: &L,
    layers: &[Layer],
    post: &[PostNorms],
    attention: &A,
    step: &A::Step,
    segments: &mut [Segment<'_, A::Cache>],
    mut x: L::X,
    (eps, head_eps): (f32, f32),
) -> candle_core::Result<L::X> {
    if layers.len() != post.len() {
        candle_core::bail!("{} layers with {} layers' post-norms (a bug)", layers.len(), post.len());
    }
    for (li, (layer, post)) in layers.iter().zip(post).enumerate() {
        let out = attention_block(lane, layer, li, attention, step, segments, &x, (eps, head_eps))?;
        x = lane.add(x, &lane.rms_norm(&out, &post.attn, eps)?)?;
        let h = lane.rms_norm(&x, &layer.ffn_norm, eps)?;
        let y = lane.reduce(layer.ffn.run(lane, &h, Activation::GeluTanh)?)?;
        x = lane.add(x, &lane.rms_norm(&y, &post.ffn, eps)?)?;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(version: u8, layers: usize, keys: &[(&str, f64)]) -> (GemmaConfig, Option<Sliding>) {
        let keys: Vec<(String, f64)> = keys.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        GemmaConfig::of_gguf(version, layers, (1152, 4, 256), 1e6, |k| keys.iter().find(|(n, _)| n == k).map(|(_, v)| *v), None).unwrap()
    }

    /// llama.cpp's defaults and patterns: Gemma 3 1B (26 layers, window 512: layers 5, 11, 17 and 23 global, local
    /// RoPE base 10,000); Gemma 2 (every other layer global, window 4,096 and soft-caps 50 and 30 unless given);
    /// the 27B models' query scale.
    #[test]
    fn gguf_keys_give_llama_cpps_configuration() {
        let (g3, sliding) = config(3, 26, &[("attention.sliding_window", 512.0)]);
        let sliding = sliding.unwrap();
        assert_eq!(sliding.window, 512);
        let global: Vec<usize> = (0..26).filter(|&l| !sliding.layers[l]).collect();
        assert_eq!(global, [5, 11, 17, 23]);
        assert_eq!(sliding.rope_base, 10_000.0);
        assert_eq!((g3.attn_softcap, g3.final_softcap, g3.query_pre_attn_scalar), (None, None, 256.0));
        assert_eq!(config(3, 26, &[]).1, None);
        let (g2, sliding) = config(2, 26, &[]);
        let sliding = sliding.unwrap();
        assert_eq!((sliding.window, sliding.rope_base), (4096, 1e6));
        assert_eq!(sliding.layers[..4], [true, false, true, false]);
        assert_eq!((g2.attn_softcap, g2.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(config(2, 46, &[]).0.query_pre_attn_scalar, 288.0);
        assert_eq!(config(3, 62, &[("final_logit_softcapping", 20.0)]).0.final_softcap, Some(20.0));
        let keys = |k: &str| (k == "attention.sliding_window").then_some(-1.0);
        assert!(GemmaConfig::of_gguf(3, 26, (1152, 4, 256), 1e6, keys, None).is_err());
    }
}
