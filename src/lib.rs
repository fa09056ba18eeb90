//! nightshift: an offline batch LLM job runner.
//!
//! One binary reads prompts from Parquet on object storage, runs a model over them with a KV-cached, batched
//! decoder, and writes one result row per input row back as Parquet, with metrics beside it.
//!
//! # Layout
//! The modules follow the data flow of a job, in order:
//!
//! 1. [`job`]: the TOML job file, parsed strictly and resolved into one [`job::Job`] every stage receives.
//! 2. [`source`]: object-store URLs, listing, and streamed Parquet reading (memory bounded by a row group).
//! 3. [`tokenize`]: the tokenizer and chat template from the model's metadata; prompts become validated token
//!    sequences or error rows.
//! 4. [`engine`]: the decoder (candle), its KV cache, sampling and the batching loop; [`encoder`]: the BERT-family
//!    encoder of embedding jobs; [`seq2seq`]: the T5 encoder-decoder and its engine. The only places that know
//!    candle.
//! 5. [`sink`]: per-unit result and metrics Parquet files, create-once commit markers, and finalize (manifest
//!    and `_SUCCESS`).
//!
//! [`plan`] is the run's plan (input snapshot, units, job fingerprint) stored at the output, which makes reruns
//! resume instead of starting over.
//!
//! [`row`] holds the per-row types every stage shares (prompts, row errors, finish reasons); [`metrics`] the plain
//! structs filled as the job runs; [`bench`] the synthetic throughput benchmarks; [`app`] wires the stages together
//! with bounded channels and threads; [`cli`] is the command line; [`error`] maps failures to documented exit
//! codes.

pub mod app;
pub mod bench;
pub mod cli;
pub mod encoder;
pub mod engine;
pub mod error;
pub mod job;
pub mod metrics;
pub mod plan;
pub mod row;
pub mod schedule;
pub mod seq2seq;
pub mod sink;
pub mod source;
pub mod synth;
pub mod tokenize;
