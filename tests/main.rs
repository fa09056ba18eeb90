//! The integration tests: one binary (`cargo test --test integration`), a module for each part of the system, in
//! the order data flows through it, then jobs end to end and their reliability. `support` holds what they share.

mod support;

mod tokenizer;
mod engine;
mod sampling;
mod embed;
mod seq2seq;
mod jobs;
mod export;
mod reliability;
mod fuzz;
