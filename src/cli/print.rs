//! What the verbs print: a human summary on stdout, or JSON where the verb offers `--json`.

use crate::app::{ModelSummary, RunReport, RunStatus, ValidateReport};
use crate::redact::redact_urls;
use crate::outcome::Outcome;
use crate::sink::{Finalized, Manifest, OutputStatus};

/// `println!`, except that a closed standard output (`nightshift status | head -1`) ends the printing quietly: what
/// the reader did not want is not an error, and the verb's exit code stands. Any other write error panics, as
/// `println!` does.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                panic!("failed printing to stdout: {e}");
            }
        }
    }};
}

/// `synth-model --gguf`: the GGUF written.
pub fn print_written(path: &std::path::Path, bytes: u64) {
    out!("wrote {} ({:.1} MB)", path.display(), bytes as f64 / 1e6);
}

pub fn print_synth(r: &crate::synth::SynthReport, dir: &std::path::Path) {
    let s = &r.shape;
    out!(
        "wrote {}: {} shape ({} layers, hidden {}, {} heads / {} kv heads, {}, vocab {}), {:.1} M parameters, {} weights, {:.1} MB in {:.1} s",
        dir.display(),
        s.name,
        s.layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        match s.moe {
            Some(m) => {
                let shared = m.shared.map(|w| format!(", a shared expert of {w}")).unwrap_or_default();
                format!("{} experts of {}, {} per token{shared}", m.experts, m.intermediate, m.used)
            }
            None => format!("ffn {}", s.intermediate),
        },
        s.vocab,
        r.parameters as f64 / 1e6,
        r.dtype,
        r.bytes as f64 / 1e6,
        r.seconds
    );
}

/// Prints a parity report; an error when a comparison is outside its tolerance.
pub fn print_parity(r: &crate::bench::ParityReport, json: bool) -> Result<(), crate::error::Error> {
    if json {
        out!("{}", serde_json::to_string(r).expect("plain data serialises"));
    } else {
        out!("model: {} on {} ({}), prompts {:?} + {} greedy steps", r.model, r.device, r.dtype, r.prompt_lengths, r.steps);
        for c in &r.comparisons {
            out!(
                "{:<34} max |diff| {:.2e} of the largest logit (allowed {:.0e}), argmax agrees at {}/{} (min {:.0} %): {}",
                c.name,
                c.max_rel_diff,
                c.max_rel_diff_allowed,
                c.argmax_agree,
                c.positions,
                c.argmax_agree_min * 100.0,
                if c.pass { "ok" } else { "OUT OF TOLERANCE" }
            );
        }
    }
    match r.pass {
        true => Ok(()),
        false => Err(crate::error::Error::Internal("parity: a comparison is outside its tolerance".into())),
    }
}

pub fn print_generate_bench(r: &crate::bench::GenerateBenchReport, json: bool) {
    if json {
        out!("{}", serde_json::to_string(r).expect("plain data serialises"));
        return;
    }
    out!(
        "model: {} ({:?} workload, {} rows, max_seqs {}, max_batch_tokens {}) on {} ({}, weights {}, {} KV cache{})",
        r.model,
        r.workload,
        r.rows,
        r.max_seqs,
        r.max_batch_tokens,
        r.device,
        r.dtype,
        r.weights_layout,
        r.kv_cache_dtype,
        if r.paged { format!(", paged KV cache, {} attention", r.attention) } else { String::new() }
    );
    out!(
        "tokens: {} prompt ({:.0} per row), {} output ({:.0} per row)",
        r.prompt_tokens,
        r.prompt_tokens as f64 / r.rows.max(1) as f64,
        r.output_tokens,
        r.output_tokens as f64 / r.rows.max(1) as f64
    );
    out!(
        "throughput: {:.2} requests/s, {:.1} total tokens/s, {:.1} output tokens/s over {:.1} s ({} steps)",
        r.requests_per_s, r.total_tokens_per_s, r.output_tokens_per_s, r.seconds, r.steps
    );
    out!(
        "steps: prefill {:.1} s ({:.1} prompt tok/s, decode tokens riding along), decode-only {:.1} s ({:.1} tok/s)",
        r.prefill_s, r.prefill_tokens_per_s, r.decode_s, r.decode_tokens_per_s
    );
    out!("per step: {:.2} ms in the model's forward pass, {:.2} ms of host time (the engine and driver)", r.forward_ms_per_step, r.host_ms_per_step);
    if let (Some(share), Some(load)) = (r.routing_share, r.expert_load_max_over_mean) {
        out!("mixture of experts: {:.1} % of the forward passes routing, gathering and combining; busiest expert {load:.2}x the mean load", 100.0 * share);
    }
    out!(
        "latency: TTFT p50 {:.3} s, p90 {:.3} s, p99 {:.3} s (from entering the engine's queue); TPOT p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms",
        r.ttft_p50_s,
        r.ttft_p90_s,
        r.ttft_p99_s,
        r.tpot_p50_s * 1e3,
        r.tpot_p90_s * 1e3,
        r.tpot_p99_s * 1e3
    );
    out!(
        "memory: peak RSS {} MiB, weights {} MiB, peak KV cache {} MiB, at most {} sequences at once",
        r.peak_rss_bytes >> 20,
        r.weights_bytes >> 20,
        r.peak_kv_cache_bytes >> 20,
        r.peak_running
    );
    out!(
        "kv cache: {} of {} blocks at peak, {} preemptions, packing efficiency {:.1} %",
        r.peak_kv_blocks,
        r.kv_blocks,
        r.preemptions,
        r.packing_efficiency * 100.0
    );
    out!(
        "prefix cache: {}, {} prompt tokens served from it, {} computed ({:.1} % of prompt tokens)",
        if r.prefix_cache { "on" } else { "off" },
        r.cached_prompt_tokens,
        r.computed_prompt_tokens,
        100.0 * r.computed_prompt_tokens as f64 / r.prompt_tokens.max(1) as f64
    );
}

pub fn print_embed_bench(report: &crate::bench::EmbedBenchReport, json: bool) {
    if json {
        out!("{}", serde_json::to_string(report).expect("plain data serialises"));
        return;
    }
    out!("model: {} ({} dimensions)", report.model, report.dimensions);
    out!(
        "workload: {} rows, {} tokens ({:.1} per row), {} batches, packing efficiency {:.1} %",
        report.rows,
        report.tokens,
        report.tokens as f64 / report.rows as f64,
        report.batches,
        report.packing_efficiency * 100.0
    );
    out!(
        "throughput: {:.1} rows/s, {:.0} tokens/s over {:.2} s (tokenization {:.2} s, not included); peak RSS {} MiB",
        report.rows_per_s,
        report.tokens_per_s,
        report.embed_s,
        report.tokenize_s,
        report.peak_rss_bytes >> 20
    );
}

/// `42 s`, `17 min 5 s`, `3 h 12 min`.
fn duration(seconds: f64) -> String {
    let s = seconds.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

pub fn print_plan(r: &crate::app::JobPlanReport, json: bool) {
    if json {
        out!("{}", serde_json::to_string(r).expect("plain data serialises"));
        return;
    }
    let mean = |tokens: u64, rows: u64| if rows > 0 { tokens as f64 / rows as f64 } else { 0.0 };
    if let Some(reuse) = &r.reuse {
        out!(
            "reuse: {} rows served by {} source(s) ({} files, {} request keys, read in {:.2} s)",
            reuse.reused_rows, reuse.sources, reuse.source_files, reuse.source_keys, reuse.index_seconds
        );
        for (url, why) in &reuse.refused {
            out!("  `{}` serves nothing: another job ({why})", redact_urls(url));
        }
    }
    if r.duplicate_rows > 0 {
        out!("duplicates: {} rows repeat an earlier row's request and are computed once", r.duplicate_rows);
    }
    let copied = r.reuse.as_ref().map_or(0, |u| u.reused_rows) + r.duplicate_rows;
    match copied {
        0 => out!("rows: {} ({} ready for the engine)", r.rows, r.ok_rows),
        _ => out!("rows: {} ({} to compute; the figures below are theirs)", r.rows, r.ok_rows),
    }
    out!(
        "prompt tokens: {} ({:.0} per row); output tokens: at most {} ({:.0} per row)",
        r.prompt_tokens,
        mean(r.prompt_tokens, r.ok_rows),
        r.max_output_tokens,
        mean(r.max_output_tokens, r.ok_rows)
    );
    out!(
        "shared prefixes: {}{} prompt tokens ({:.1} %) repeat the start of an earlier row's prompt, in whole blocks of {} tokens: work a prefix cache could skip",
        if r.shared_prefix_exact { "" } else { "at least " },
        r.shared_prefix_tokens,
        100.0 * r.shared_prefix_tokens as f64 / r.prompt_tokens.max(1) as f64,
        crate::engine::KV_BLOCK_TOKENS
    );
    out!("prompt lengths (tokens, chat template included):");
    let widest = r.histogram.buckets.iter().map(|b| b.2).max().unwrap_or(1).max(1);
    for &(lo, hi, rows, tokens) in &r.histogram.buckets {
        let bar = "#".repeat(((rows * 40).div_ceil(widest)) as usize);
        out!("  {lo:>6} - {hi:<6} {rows:>8} rows {tokens:>10} tokens  {bar}");
    }
    if r.over_length_rows > 0 {
        out!(
            "over-length: {} rows longer than {} tokens (error rows, prompt_too_long); first: {}",
            r.over_length_rows,
            r.longest_sequence.saturating_sub(1),
            r.over_length_ids.join(", ")
        );
    } else {
        out!("over-length: none (longest allowed prompt {} tokens)", r.longest_sequence.saturating_sub(1));
    }
    for (code, n) in &r.other_errors {
        out!("other errors: {n} rows {code}");
    }
    let window = match r.sliding_window {
        Some(w) => format!(", every layer sliding over {w} positions (a sequence's blocks behind it given back)"),
        None => String::new(),
    };
    let experts = match r.expert_weights_stored_bytes {
        0 => String::new(),
        e => format!("; routed experts {} as stored", crate::app::bytes_text(e)),
    };
    out!(
        "kv cache: {} MiB = {} tokens at {} bytes a token ({}){window}; {} sequences of the mean length fit at once (max_seqs {}); weights {} MiB ({}{experts})",
        r.kv_cache_bytes >> 20,
        r.kv_tokens,
        r.kv_bytes_per_token,
        r.kv_cache_dtype,
        r.sequences_fit,
        r.max_seqs,
        r.weights_bytes >> 20,
        r.weights_layout
    );
    for t in &r.tensor_parallel {
        let m = &t.memory;
        out!(
            "tensor-parallel rank {}: {} heads, {} kv heads, {} feed-forward columns; weights {} MiB, kv cache {} MiB, activations {} MiB (estimate, one step of max_batch_tokens)",
            m.rank, m.heads, m.kv_heads, m.ffn_columns, m.weights_bytes >> 20, t.kv_cache_bytes >> 20, m.activations_bytes >> 20
        );
    }
    let s = &r.simulation;
    out!(
        "schedule (every row generating max_new_tokens): {} steps, {} with prefills (max_batch_tokens {}), {:.1} sequences decoding per step, peak {} KV blocks, {} preemptions ({} tokens recomputed)",
        s.steps, s.prefill_steps, r.max_batch_tokens, s.mean_running, s.peak_kv_blocks, s.preemptions, s.recomputed_tokens
    );
    out!(
        "prefix cache in that schedule: {} prompt tokens served ({:.1} %), {} computed, {} cached blocks evicted",
        s.cached_tokens,
        100.0 * s.cached_tokens as f64 / r.prompt_tokens.max(1) as f64,
        s.prefill_tokens,
        s.prefix_evictions
    );
    match (&r.calibration, r.estimated_seconds) {
        (Some(c), Some(secs)) => out!(
            "estimate: at most {}, from {} calibration rows in {:.1} s: prefill {:.0} tokens/s, decode {:.0} tokens/s",
            duration(secs),
            c.rows,
            c.seconds,
            c.prefill_tokens_per_s,
            c.decode_tokens_per_s
        ),
        (Some(c), None) => out!("estimate: none (the {} calibration rows gave no decode-only steps to time)", c.rows),
        (None, _) => out!("estimate: none (no calibration run)"),
    }
}

fn shorten(text: &str, max_chars: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(max_chars) {
        Some((i, _)) => format!("{}...", &flat[..i]),
        None => flat,
    }
}

fn print_manifest(m: &Manifest, manifest_url: &str) {
    out!("manifest: {}", redact_urls(manifest_url));
    out!(
        "rows: {} ({} succeeded, {} errored) in {} unit(s)  prompt tokens: {}  output tokens: {}",
        m.rows,
        m.succeeded_rows,
        m.errored_rows,
        m.units.len(),
        m.prompt_tokens,
        m.completion_tokens
    );
    if let (Some(report), Some(root)) = (&m.report, manifest_url.strip_suffix(crate::sink::MANIFEST_FILE)) {
        out!("report: {}{report}", redact_urls(root));
    }
}

pub fn print_run(report: &RunReport) {
    let m = &report.metrics;
    out!("output: {}", redact_urls(&report.output_url));
    if report.status == RunStatus::AlreadyComplete {
        out!("the output is complete already: nothing to do");
        if let Some(manifest) = &report.manifest {
            print_manifest(manifest, &report.manifest_url);
        }
        return;
    }
    match (&report.status, &report.manifest) {
        (RunStatus::ShardDone { missing }, _) if report.units_committed + report.units_skipped == 0 => {
            out!("{} has no units (the plan has fewer units than shards); the output is not finalized yet: {missing}", report.assignment)
        }
        (RunStatus::ShardDone { missing }, _) => {
            out!("{} is committed; the output is not finalized yet: {missing}", report.assignment)
        }
        (_, Some(manifest)) => print_manifest(manifest, &report.manifest_url),
        _ => {}
    }
    out!("units: {} committed by this run, {} before it ({})", report.units_committed, report.units_skipped, report.assignment);
    out!(
        "this run: {} rows ({} computed, {} reused, {} deduplicated, {} errored), {:.2} requests/s, {:.1} total tokens/s, {:.1} output tokens/s over {:.1} s (model load {:.1} s)",
        m.rows, m.computed_rows, m.reused_rows, m.deduplicated_rows, m.errored_rows, m.requests_per_s, m.total_tokens_per_s, m.output_tokens_per_s, m.generation_s, m.model_load_s
    );
    for outcome in &report.sample {
        match outcome {
            Outcome::Completed(c) => {
                for choice in &c.choices {
                    let index = if c.choices.len() > 1 { format!("#{} ", choice.index) } else { String::new() };
                    let text = match choice.cumulative_logprob {
                        Some(lp) if choice.finish_reason == crate::row::FinishReason::Scored => format!("logprob {lp:.4}"),
                        _ => shorten(&choice.text, 160),
                    };
                    out!("  [{}] {index}({}) {text}", c.id, choice.finish_reason.as_str());
                }
            }
            Outcome::Embedded(e) => {
                let head: Vec<String> = e.vector.iter().take(4).map(|v| format!("{v:.4}")).collect();
                out!("  [{}] {} tokens -> [{}, ...] ({} dimensions)", e.id, e.prompt_tokens, head.join(", "), e.vector.len())
            }
            Outcome::Failed(f) => out!("  [{}] error {}: {}", f.id, f.error.code, f.error.message),
            Outcome::Reused(r) => out!("  [{}] reused", r.id),
        }
    }
}

pub fn print_data_parallel(report: &crate::app::parallel::ParallelReport) {
    for w in &report.workers {
        let gpu = w.worker.gpu.as_deref().map_or_else(|| format!("{} CPU threads", w.worker.threads), |g| format!("GPU {g}"));
        let how = match w.signal {
            Some(sig) if w.code == crate::error::Exit::Partial as i32 => format!(" (stopped by the signal passed on to it, {sig}, before it could drain)"),
            Some(sig) => format!(" (killed by signal {sig})"),
            None => String::new(),
        };
        out!("worker {} (shard {} of {}, {gpu}): exit {}{how}", w.worker.shard, w.worker.shard, report.workers.len(), w.code);
    }
    match (report.code, report.finalized) {
        (0, true) => out!("every shard is committed; the output is finalized"),
        (code, _) => out!("exit {code}: the worst worker's (rerun the same command to resume; committed units are kept)"),
    }
}

pub fn print_finalize(finalized: &Finalized, manifest_url: &str) {
    match finalized {
        Finalized::Done(m) => {
            out!("finalized: every unit is committed");
            print_manifest(m, manifest_url);
        }
        Finalized::AlreadyComplete(m) => {
            out!("the output is complete already");
            print_manifest(m, manifest_url);
        }
    }
}

pub fn print_validate(report: &ValidateReport) {
    out!("job is valid");
    out!("input: {} file(s), {} rows", report.input_files.len(), report.rows);
    for f in report.input_files.iter().take(5) {
        out!("  {f}");
    }
    if report.input_files.len() > 5 {
        out!("  ... and {} more", report.input_files.len() - 5);
    }
    match &report.model {
        ModelSummary::Decoder(model) => {
            let c = &model.config;
            out!(
                "model: {} ({}), {} layers, hidden {}, {} heads ({} kv), context {}, vocabulary {}",
                c.name.as_deref().unwrap_or("unnamed"),
                c.architecture,
                c.layers,
                c.hidden_size,
                c.heads,
                c.kv_heads,
                c.context_length,
                c.vocab_size
            );
            if let Some(gemma) = &c.gemma {
                out!("{}", gemma.describe());
            }
            if let Some(sliding) = &c.sliding {
                out!("{}", sliding.describe());
            }
            if let Some(l) = &c.long_rope {
                out!("{}", l.describe());
            }
            if let Some(partial) = c.partial_rotary() {
                out!("{partial}");
            }
            if let Some(moe) = &c.moe {
                out!("{}, each {} wide", moe.describe(), c.ffn_size);
            }
            let types: Vec<String> = model.tensor_types.iter().map(|(t, n)| format!("{t} x{n}")).collect();
            out!("tensors: {}", types.join(", "));
            if let Some(memory) = &report.memory {
                out!("{}", memory.describe(c));
            }
            out!(
                "tokenizer: {} / {}, chat template: {}",
                model.vocab.kind,
                model.vocab.pre.as_deref().unwrap_or("default"),
                if model.vocab.chat_template.is_some() { "yes" } else { "no" }
            );
        }
        ModelSummary::Seq2seq(c) => out!(
            "model: encoder-decoder (t5), {} encoder and {} decoder layers, d_model {}, {} heads, vocabulary {}",
            c.num_layers,
            c.decoder_layers(),
            c.d_model,
            c.num_heads,
            c.vocab_size
        ),
        ModelSummary::Encoder(info) => {
            let c = &info.config;
            out!(
                "model: encoder ({}), {} layers, hidden {}, {} heads, vocabulary {}",
                c.model_type.as_deref().unwrap_or("bert"),
                c.num_hidden_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.vocab_size
            );
            out!(
                "embedding: {} dimensions, {:?} pooling{}, at most {} tokens per row",
                info.dimensions,
                info.pooling,
                if info.normalize { ", normalised" } else { "" },
                info.max_tokens
            );
        }
    }
    out!("output: {} ({})", redact_urls(&report.output_url), report.output_state);
}

fn rate(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())
}

/// Unit ids as ranges: `u000003-u000005, u000009`.
fn unit_ranges(units: &[u32], max: usize) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &u in units {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == u => *end = u,
            _ => ranges.push((u, u)),
        }
    }
    let mut parts: Vec<String> =
        ranges.iter().take(max).map(|&(a, b)| if a == b { format!("u{a:06}") } else { format!("u{a:06}-u{b:06}") }).collect();
    if ranges.len() > max {
        parts.push(format!("... ({} more ranges)", ranges.len() - max));
    }
    parts.join(", ")
}

pub fn print_status(status: &OutputStatus, json: bool) {
    if json {
        out!("{}", serde_json::to_string(status).expect("plain data serialises"));
        return;
    }
    let state = if status.complete {
        "complete (_SUCCESS written)".to_string()
    } else if status.committed_units == status.units {
        "every unit is committed; not finalized yet (run `nightshift finalize`)".to_string()
    } else {
        format!("incomplete: {} of {} units committed", status.committed_units, status.units)
    };
    out!("output: {}", redact_urls(&status.url));
    out!("state: {state}");
    if !status.damaged_units.is_empty() {
        let first: Vec<String> = status.damaged_units.iter().take(5).map(|u| format!("u{u:06}")).collect();
        out!(
            "damaged: {} committed unit(s) name a file that is missing (first: {}); not counted as committed: running the job again computes them",
            status.damaged_units.len(),
            first.join(", ")
        );
    }
    out!(
        "plan: {} units in {} shard(s), {} rows ({} committed), fingerprint {}",
        status.units,
        status.shards.len(),
        status.rows,
        status.committed_rows,
        status.fingerprint
    );
    out!(
        "{:>5}  {:>11}  {:>17}  {:>13}  {:>8}  {:>9}  {:>10}  {:>8}  missing",
        "shard", "units", "rows", "output tok", "rows/s", "tok/s", "out tok/s", "attempts"
    );
    for s in &status.shards {
        out!(
            "{:>5}  {:>11}  {:>17}  {:>13}  {:>8}  {:>9}  {:>10}  {:>8}  {}",
            s.shard,
            format!("{}/{}", s.committed_units, s.units),
            format!("{}/{}", s.committed_rows, s.rows),
            s.completion_tokens,
            rate(s.rows_per_s),
            rate(s.total_tokens_per_s),
            rate(s.output_tokens_per_s),
            s.attempts.len(),
            if s.missing_units.is_empty() { "-".to_string() } else { unit_ranges(&s.missing_units, 4) }
        );
    }
}

/// `bench kernels`: one line per tensor, level and row count.
pub fn print_kernel_bench(report: &[crate::bench::KernelMeasurement], attention: &[crate::bench::AttentionMeasurement], json: bool) {
    if json {
        for m in report {
            out!("{}", serde_json::to_string(m).expect("a measurement serializes"));
        }
        for m in attention {
            out!("{}", serde_json::to_string(m).expect("a measurement serializes"));
        }
        return;
    }
    out!("{:<26} {:<6} {:>13} {:<9} {:>5} {:>11} {:>8}", "tensor", "type", "[n, k]", "level", "rows", "us", "GFLOP/s");
    for m in report {
        let shape = format!("[{}, {}]", m.shape[0], m.shape[1]);
        out!("{:<26} {:<6} {:>13} {:<9} {:>5} {:>11.1} {:>8.1}", m.tensor, m.dtype, shape, m.level, m.rows, m.seconds * 1e6, m.gflops);
    }
    if attention.is_empty() {
        return;
    }
    out!();
    out!("{:<26} {:<6} {:>13} {:<9} {:>5} {:>11} {:>8} {:>8}", "attention, every layer", "kv", "context", "level", "seqs", "us", "GB/s", "GFLOP/s");
    for m in attention {
        let step = match (m.step, m.shared) {
            ("decode", 0) => "decode step".to_string(),
            ("decode", shared) => format!("decode step, {shared} shared"),
            _ => format!("prefill of {}", m.new_tokens),
        };
        out!("{:<26} {:<6} {:>13} {:<9} {:>5} {:>11.1} {:>8.1} {:>8.1}", step, m.kv_dtype, m.context, m.level, m.seqs, m.seconds * 1e6, m.gbps, m.gflops);
    }
}

/// `nightshift report`: the page to standard output, or written to `to` (whole or not at all: a temporary file
/// beside it, renamed) with one line saying where.
pub fn print_export(e: &crate::sink::export::Exported) {
    out!("{} lines of {} responses: {}", e.results, e.endpoint.url(), redact_urls(&e.results_url));
    out!("{} error lines: {}", e.errors, redact_urls(&e.errors_url));
}

pub fn print_report(html: &str, to: Option<&std::path::Path>) -> Result<(), crate::error::Error> {
    use std::io::Write;
    let Some(path) = to else {
        let mut stdout = std::io::stdout().lock();
        return stdout.write_all(html.as_bytes()).and_then(|()| stdout.flush()).map_err(|e| crate::error::Error::Internal(format!("cannot write the report to standard output: {e}")));
    };
    let cannot = |e: std::io::Error| crate::error::Error::Usage(format!("cannot write the report to `{}`: {e}", path.display()));
    let in_place = crate::files::target(path).map_err(|e| crate::error::Error::Usage(format!("--to: {e}")))? == crate::files::Target::InPlace;
    crate::files::replace(path, html.as_bytes(), |name| format!(".{name}.partial"), false).map_err(cannot)?;
    if !in_place {
        out!("report: {} ({} KiB)", path.display(), html.len().div_ceil(1024));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_units_print_as_ranges() {
        assert_eq!(unit_ranges(&[3, 4, 5, 9], 4), "u000003-u000005, u000009");
        assert_eq!(unit_ranges(&[1, 3, 5, 7], 2), "u000001, u000003, ... (2 more ranges)");
        assert_eq!(unit_ranges(&[], 4), "");
    }
}
