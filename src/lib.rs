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
//! 4. [`engine`]: the models (llama-family decoders, T5 encoder-decoders, BERT-family encoders), their KV caches,
//!    sampling and the engines every job kind runs through one interface. The only place that knows candle.
//! 5. [`sink`]: per-unit result and metrics Parquet files, create-once commit markers, and finalize (manifest
//!    and `_SUCCESS`).
//!
//! [`plan`] is the run's plan (input snapshot, units, job fingerprint) stored at the output, which makes reruns
//! resume instead of starting over. [`reuse`] gives every row a request key, copies rows of earlier outputs with
//! equal keys instead of computing them, and computes identical requests of a run once.
//!
//! [`row`] holds the per-row types every stage shares (prompts, row errors, finish reasons) and [`outcome`] what
//! a row comes out as (a completion, an embedding, a failure); [`host`] probes the machine's memory; [`metrics`]
//! the plain structs filled as the job runs; [`bench`] the synthetic throughput benchmarks; [`app`] wires the
//! stages together with bounded channels and threads, one file per verb and stage; [`cli`] is the command line;
//! [`error`] maps failures to documented exit codes; [`synth`] writes random-weight models of published shapes;
//! [`alloc`] is the allocator, which bounds the memory of untrusted programs (chat templates). Three leaves any
//! stage may use: [`redact`] keeps credentials out of messages and logs, [`panics`] turns libraries' panics on
//! untrusted files into errors, and [`files`] writes the files named beside an output without replacing what
//! is not a file.

pub mod alloc;
pub mod app;
pub mod bench;
pub mod cli;
pub mod engine;
pub mod error;
pub mod export;
pub mod files;
pub mod host;
pub mod job;
pub mod metrics;
pub mod outcome;
pub mod panics;
pub mod plan;
pub mod redact;
pub mod report;
pub mod reuse;
pub mod row;
pub mod schedule;
pub mod sink;
pub mod source;
pub mod synth;
pub mod tokenize;
