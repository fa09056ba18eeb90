//! The model families, each the forward pass of its architecture over weights it loads and checks: decoders
//! ([`llama`]), encoder-decoders ([`t5`]) and encoders ([`bert`]).

pub mod bert;
pub mod gemma;
pub mod lanes;
pub mod llama;
pub mod moe;
pub mod t5;

use crate::engine::attention::{Attention, Segment};

/// A decoder family's model as the batch engine drives it ([`crate::engine::BatchEngine`]): what the engine asks
/// of any model, whatever attention backend runs it. The forward pass itself is [`StepModel`]'s, per backend.
pub trait DecoderModel: Send + 'static {
    fn vocab_size(&self) -> usize;

    /// The most positions a sequence may hold.
    fn context_length(&self) -> usize;

    /// Makes the model's device context current on the calling thread (the engine thread, before its first step);
    /// a no-op on the CPU.
    fn bind_to_thread(&self) -> candle_core::Result<()>;

    /// A mixture of experts' tokens per expert (summed over layers) and seconds spent routing, gathering and
    /// combining since the last call; `None` for a dense model.
    fn take_routing(&self) -> Option<(Vec<u64>, f64)> {
        None
    }
}

/// A decoder's forward pass per step over new tokens of several sequences, on the attention backend `A`, each
/// layer's attention the backend's (which sees the model through
/// [`AttentionModel`](crate::engine::attention::AttentionModel)). A family's model runs on
/// every single-device backend; a tensor-parallel model ([`crate::engine::parallel::TpModel`]) on its ranks'
/// backends together ([`crate::engine::parallel::TpAttention`]). The engine, the scheduler, sampling and the
/// backends are shared.
pub trait StepModel<A: Attention>: DecoderModel {
    /// Runs every segment's new tokens through the model, appending their keys and values to each segment's
    /// cache; returns the outputs of the last `outputs[i]` positions of segment `i` (where `greedy[i]`, given, says
    /// segment `i` needs only its argmax, which a backend that chooses on the device returns as
    /// [`StepLogits::Argmax`]), and how long building the step's inputs took on the host.
    fn forward_step_timed(
        &self,
        attention: &A,
        segments: &mut [Segment<'_, A::Cache>],
        outputs: &[usize],
        greedy: &[bool],
    ) -> candle_core::Result<(Vec<Vec<StepLogits>>, std::time::Duration)>;
}

/// A decoder's sliding-window layers (Gemma 2 and 3, Phi-3): the window (positions a query sees, its own
/// included), which layers slide, and their RoPE base (Gemma 3's local 10,000; the global base elsewhere, whose
/// frequencies, scaling included, the local layers then share).
#[derive(Clone, Debug, PartialEq)]
pub struct Sliding {
    pub window: usize,
    pub layers: Vec<bool>,
    pub rope_base: f32,
}

impl Sliding {
    /// Every one of `layers` layers sliding over `window` positions, rotating as the global ones.
    pub fn every_layer(window: usize, layers: usize, rope_base: f32) -> Sliding {
        Sliding { window, layers: vec![true; layers], rope_base }
    }

    /// One line for `validate` and the load log.
    pub fn describe(&self) -> String {
        let n = self.layers.iter().filter(|&&l| l).count();
        let given_back = if n == self.layers.len() { "; each sequence's KV blocks behind it are given back" } else { "" };
        format!("sliding window of {} positions in {n} of {} layers (RoPE base {}){given_back}", self.window, self.layers.len(), self.rope_base)
    }
}

/// What one output row of a step comes back as.
#[derive(Clone, Debug, PartialEq)]
pub enum StepLogits {
    /// The logits, f32.
    Full(Vec<f32>),
    /// The greedy token (argmax where the logits are).
    Argmax(u32),
}
