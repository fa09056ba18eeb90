//! The model families, each the forward pass of its architecture over weights it loads and checks: decoders
//! ([`llama`]), encoder-decoders ([`t5`]) and encoders ([`bert`]).

pub mod bert;
pub mod llama;
pub mod t5;
