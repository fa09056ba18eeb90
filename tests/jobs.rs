//! Generate jobs end to end through the `nightshift` binary (run, validate, plan, bench generate), with the real
//! SmolLM2-135M-Instruct model, real Parquet files, and a real S3 server (moto) on 127.0.0.1.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, ListBuilder, StringBuilder, StructBuilder};
use arrow::datatypes::{DataType, Field};

use crate::support::{self, *};

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:03}")).collect()
}

const QUESTIONS: &[&str] = &[
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 plus 30?",
    "Give a synonym for happy.",
    "Why do leaves fall in autumn?",
];

/// Runs a job over `prompts` and returns its results.
fn run_prompts(name: &str, prompts: &[&str], generation: &str, args: &[&str]) -> BTreeMap<String, ResultRow> {
    let dir = scratch(name);
    let input = dir.join("in.parquet");
    write_parquet(&input, support::prompts(&ids("q", prompts.len()), prompts));
    let out = dir.join("out");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), generation, "");
    let mut all = vec!["run", job.to_str().unwrap()];
    all.extend_from_slice(args);
    nightshift(&all, &[]).assert_ok();
    read_results(&out)
}

/// A scratch directory holding an input of the first two questions: `(dir, dir/in.parquet)`.
fn two_questions(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = scratch(name);
    let input = dir.join("in.parquet");
    write_parquet(&input, support::prompts(&ids("q", 2), &QUESTIONS[..2]));
    (dir, input)
}

fn texts(rows: &BTreeMap<String, ResultRow>) -> BTreeMap<String, (Option<String>, u32, String)> {
    rows.iter().map(|(id, r)| (id.clone(), (r.text.clone(), r.completion_tokens, r.finish_reason.clone()))).collect()
}

#[test]
fn sample_job_writes_sensible_summaries() {
    let dir = scratch("sample");
    let out = dir.join("out");
    let run = nightshift(&["run", "jobs/summarise.toml", "--output", out.to_str().unwrap(), "--show", "3"], &[("RUST_LOG", "info")]);
    run.assert_ok();
    assert!(run.stdout.contains("manifest: ") && run.stdout.contains("_manifest.json"), "{}", run.stdout);
    assert!(run.stdout.contains("[ticket-"), "the run prints a few results: {}", run.stdout);
    let rows = read_results(&out);
    assert_eq!(rows.len(), 12);
    // Each summary is English about its own ticket: it shares a content word with it.
    let keywords = [
        ("ticket-001", &["print", "jam", "queue"][..]),
        ("ticket-002", &["charge", "refund", "payment", "subscription", "twice", "duplicate"]),
        ("ticket-003", &["app", "crash", "settings", "android", "update"]),
        ("ticket-004", &["drive", "network", "access"]),
        ("ticket-005", &["address", "order", "deliver"]),
        ("ticket-006", &["password", "email", "reset"]),
        ("ticket-007", &["projector", "hdmi", "signal", "laptop"]),
        ("ticket-008", &["trial", "extend", "week"]),
        ("ticket-009", &["invoice", "pdf", "blank", "billing"]),
        ("ticket-010", &["laptop", "hire", "account", "employee"]),
        ("ticket-011", &["checkout", "slow", "payment", "website"]),
        ("ticket-012", &["cancel", "subscription"]),
    ];
    let mut on_topic = 0;
    for (id, words) in keywords {
        let row = &rows[id];
        assert_eq!(row.status, "succeeded", "{row:?}");
        let text = row.text.as_deref().unwrap().to_lowercase();
        let letters = text.chars().filter(|c| c.is_ascii_alphabetic()).count();
        assert!(letters >= 15, "{id}: too short to be a summary: {text:?}");
        assert!(letters * 10 >= text.chars().count() * 7, "{id}: not English prose: {text:?}");
        if words.iter().any(|w| text.contains(w)) {
            on_topic += 1;
        }
    }
    assert!(on_topic >= 9, "only {on_topic} of 12 summaries mention their ticket's subject");
    let meta = kv_metadata_of(OutputStore::local(&out).first_results_file());
    assert_eq!(meta["nightshift.model_sha256"], "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53");
    assert_eq!(meta["nightshift.version"], env!("CARGO_PKG_VERSION"));
    let metrics = read_metrics(&out);
    assert_eq!(metrics["rows"], Some(12.0));
    let completion: u32 = rows.values().map(|r| r.completion_tokens).sum();
    assert_eq!(metrics["completion_tokens"], Some(completion as f64));
    assert!(metrics["output_tokens_per_s"].unwrap() > 0.0);
    assert!(metrics["peak_rss_bytes"].unwrap() > metrics["weights_bytes"].unwrap());
    // By default the model runs as stored (runtime.cpu_weights = "as-stored"), and the metrics and the log say so.
    assert_eq!(read_metrics_text(&out)["weights_layout"], "as-stored");
    assert!(run.stderr.contains("weights=\"as-stored\" cpu_weights=as-stored"), "{}", run.stderr);
    // Its KV cache holds f32, the dtype the CPU computes in (runtime.kv_cache_dtype = "auto").
    assert_eq!(read_metrics_text(&out)["kv_cache_dtype"], "f32");
    assert!(run.stderr.contains("kv_cache_dtype=\"f32\""), "{}", run.stderr);

    // The job report, listed in the manifest, as Chromium lays it out: the job, its outcome and its figures agree
    // with the results.
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("_manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["report"], "_report.html");
    assert!(run.stdout.contains("_report.html"), "the run says where the report is: {}", run.stdout);
    let html = std::fs::read_to_string(out.join("_report.html")).unwrap();
    let page = browser::render(&html, "sample-job");
    page.assert_well_formed();
    assert_eq!(page.probe["state"], "complete");
    assert!(page.text().contains("summarise.toml") && page.text().contains("SmolLM2-135M-Instruct.Q4_1.gguf"), "the job and model are named");
    assert!(page.text().contains("b179c9523d0e"), "the model's sha256");
    assert_eq!((page.card("rows"), page.card("succeeded"), page.card("errored")), ("12", "12", "0"));
    assert_eq!(page.card("output-tokens"), completion.to_string());
    assert_eq!(page.marks("outcome"), 1, "one outcome bar: every row succeeded");
    let reasons: std::collections::BTreeSet<&str> = rows.values().map(|r| r.finish_reason.as_str()).collect();
    assert_eq!(page.marks("finish-reasons"), reasons.len() as u64, "a bar per finish reason: {reasons:?}");
    for reason in &reasons {
        assert!(page.section("outcome").contains(reason), "{reason}");
    }
    assert_eq!(page.marks("timeline"), 2, "one attempt: its start-up and its generation");
    assert_eq!(page.marks("throughput"), 1);
    for chart in ["prompt-lengths", "output-lengths", "ttft", "tpot"] {
        assert!(page.marks(chart) >= 1, "{chart} has bars");
    }
    let longest = rows.values().map(|r| r.completion_tokens).max().unwrap();
    assert!(page.chart("output-lengths")["caption"].as_str().unwrap().contains(&format!("max {longest}.")), "{}", page.chart("output-lengths")["caption"]);
    assert_eq!(page.probe["tables"]["slowest-units"], 2, "a header and the one unit");
    assert!(page.section("job").contains("max_new_tokens") && page.section("job").contains("48"), "the job's parameters");
}

/// The CPU kernels' levels compute the same bits (src/engine/kernels), so a job's results, log-probabilities
/// included, do not depend on the CPU it ran on: forced to the portable kernels (`NIGHTSHIFT_CPU_KERNELS`), the
/// job writes what the default level writes (AVX2 or VNNI on CI's x86-64), and so do AVX2 (`--cpu-kernels`), AVX-512
/// BF16 and AMX (`runtime.cpu_kernels`) forced (a level the CPU lacks runs the default one, with a warning; the
/// model has no bf16 matrices, whose products those two levels compute otherwise). A name that is no level is
/// refused, naming the variable.
#[test]
fn every_cpu_kernel_level_writes_the_same_results() {
    let (dir, input) = two_questions("kernel-levels");
    let mut results = Vec::new();
    for level in ["portable", "avx2", "amx", "avx512-bf16", ""] {
        let out = dir.join(if level.is_empty() { "best" } else { level });
        let runtime = if matches!(level, "amx" | "avx512-bf16") { format!("[runtime]\ncpu_kernels = \"{level}\"") } else { String::new() };
        let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 6\nlogprobs = 2", &runtime);
        let run = match level {
            "portable" => nightshift(&["run", job.to_str().unwrap()], &[("NIGHTSHIFT_CPU_KERNELS", level), ("RUST_LOG", "info")]),
            "avx2" => nightshift(&["run", job.to_str().unwrap(), "--cpu-kernels", level], &[("RUST_LOG", "info")]),
            _ => nightshift(&["run", job.to_str().unwrap()], &[("RUST_LOG", "info")]),
        };
        run.assert_ok();
        if !level.is_empty() && nightshift::engine::kernels::Level::available().iter().any(|l| l.name() == level) {
            assert!(run.stderr.contains(&format!("cpu_kernels=\"{level}\"")), "{}", run.stderr);
        }
        let mut rows = read_results_json(&out);
        for row in rows.values_mut() {
            // Timings differ run to run; everything else is the model's.
            let row = row.as_object_mut().expect("a result row is an object");
            for timing in ["queue_s", "ttft_s", "e2e_s", "tpot_s"] {
                assert!(row.remove(timing).is_some(), "no `{timing}` column");
            }
        }
        results.push(rows);
    }
    assert!(results[0].values().all(|r| r["text"].as_str().is_some_and(|t| !t.is_empty())), "{:?}", results[0]);
    assert_eq!(results[0], results[4], "portable and the default level differ");
    assert_eq!(results[1], results[4], "avx2 and the default level differ");
    assert_eq!(results[2], results[4], "amx and the default level differ");
    assert_eq!(results[3], results[4], "avx512-bf16 and the default level differ");
    // `runtime.attention = "host-amx"` (SmolLM2's heads are 64 wide): its prefills on the tile unit's split bf16
    // products, not the same bits, so named in the log and the numerics; the greedy texts the default's. Where the
    // CPU or Linux gives no AMX-BF16, `host` runs, with a warning.
    let out = dir.join("host-amx");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 6\nlogprobs = 2", "[runtime]\nattention = \"host-amx\"");
    let run = nightshift(&["run", job.to_str().unwrap()], &[("RUST_LOG", "info")]);
    run.assert_ok();
    let numerics = |out: &std::path::Path| kv_metadata_of(OutputStore::local(out).first_results_file())["nightshift.numerics"].clone();
    let texts = |rows: &BTreeMap<String, serde_json::Value>| rows.iter().map(|(id, row)| (id.clone(), row["text"].clone())).collect::<BTreeMap<_, _>>();
    if nightshift::engine::attention::host::tiles_available(64) {
        assert!(run.stderr.contains("attention=\"host-amx\""), "{}", run.stderr);
        assert!(numerics(&out).ends_with(";attention=host-amx"), "{}", numerics(&out));
        assert_eq!(texts(&read_results_json(&out)), texts(&results[4]), "host-amx's greedy texts differ from host's");
    } else {
        assert!(run.stderr.contains("attention=\"host\"") && run.stderr.contains("host-amx"), "{}", run.stderr);
        assert_eq!(numerics(&out), numerics(&dir.join("best")));
    }
    let job = job_file(&dir, input.to_str().unwrap(), dir.join("bad").to_str().unwrap(), "max_new_tokens = 6", "");
    let refused = nightshift(&["run", job.to_str().unwrap()], &[("NIGHTSHIFT_CPU_KERNELS", "avx512")]);
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("avx512") && refused.stderr.contains("cpu-kernels") && refused.stderr.contains("\"vnni\""), "{}", refused.stderr);
}

/// `runtime.dtype` and `runtime.attention` apply to some models only: a job that names one for a model it does
/// not apply to, or one the device cannot run, is refused by `validate` and `run` alike (exit 2, naming the key);
/// a Hugging Face decoder computed in bf16 on the CPU runs (on the paged backend, as an accelerator would) and its
/// results say so in their numerics, so reuse never serves them to an f32 run.
#[test]
fn runtime_dtype_and_attention_apply_where_they_can() {
    let (dir, input) = two_questions("runtime-choices");
    let out = dir.join("out");
    for (runtime, key, why) in [
        ("dtype = \"f16\"", "runtime.dtype", "GGUF"),
        ("attention = \"host\"\ndtype = \"bf16\"", "runtime.attention", "runtime.dtype is \"bf16\""),
        ("attention = \"paged-flash\"", "runtime.attention", "flash-attn"),
        ("attention = \"host\"\ndevice = \"cuda\"", "runtime.attention", "GPU"),
        ("cpu_weights = \"f32\"", "runtime.cpu_weights", "Hugging Face"),
    ] {
        let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 4", &format!("[runtime]\n{runtime}"));
        for command in ["validate", "run"] {
            let refused = nightshift(&[command, job.to_str().unwrap()], &[]);
            assert_eq!(refused.code, 2, "{command} {runtime}: {}", refused.stderr);
            assert!(refused.stderr.contains(key) && refused.stderr.contains(why), "{command} {runtime}: {}", refused.stderr);
        }
    }
    assert!(!out.join("_plan.json").exists() && !out.join("_SUCCESS").exists(), "no plan written by a refused run");
    // The variables of earlier versions are named, not silently ignored.
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 4", "");
    let checked = nightshift(&["validate", job.to_str().unwrap()], &[("NIGHTSHIFT_PAGED", "1")]);
    checked.assert_ok();
    assert!(checked.stderr.contains("NIGHTSHIFT_PAGED is no longer read") && checked.stderr.contains("NIGHTSHIFT_ATTENTION=paged-tiled"), "{}", checked.stderr);

    let model = dir.join("hf");
    support::write_tiny_hf_model(&model, support::HfVariant::Qwen3);
    let hf_job = |name: &str, runtime: &str| {
        let path = dir.join(format!("{name}.toml"));
        let text = format!(
            "[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 4\n[output]\nurl = {:?}\n[runtime]\n{runtime}\n",
            input.to_string_lossy(),
            model.to_string_lossy(),
            dir.join(name).to_string_lossy()
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let refused = nightshift(&["validate", hf_job("host-bf16", "attention = \"host\"\ndtype = \"bf16\"").to_str().unwrap()], &[]);
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("runtime.attention") && refused.stderr.contains("paged-tiled"), "{}", refused.stderr);
    let numerics = |name: &str| kv_metadata_of(OutputStore::local(&dir.join(name)).first_results_file())["nightshift.numerics"].clone();
    nightshift(&["run", hf_job("f32", "").to_str().unwrap()], &[]).assert_ok();
    nightshift(&["run", hf_job("bf16", "dtype = \"bf16\"").to_str().unwrap()], &[]).assert_ok();
    nightshift(&["run", hf_job("bf16-flag", "").to_str().unwrap(), "--dtype", "bf16"], &[]).assert_ok();
    // The bf16 checkpoint's matrices in 16 bits on the CPU kernels (the default) or widened at load: the same
    // greedy tokens, half the weight bytes, and numerics that say which ran.
    nightshift(&["run", hf_job("f32-widened", "cpu_weights = \"f32\"").to_str().unwrap()], &[]).assert_ok();
    let texts = |name: &str| read_results_json(&dir.join(name)).into_iter().map(|(id, row)| (id, row["text"].clone())).collect::<BTreeMap<_, _>>();
    assert_eq!(texts("f32"), texts("f32-widened"));
    assert!(numerics("f32").contains("bf16 as stored, on the CPU kernels"), "{}", numerics("f32"));
    assert_ne!(numerics("f32"), numerics("f32-widened"));
    assert_eq!(read_metrics_text(&dir.join("f32"))["weights_layout"], "bf16 as stored, on the CPU kernels");
    assert_eq!(read_metrics_text(&dir.join("f32-widened"))["weights_layout"], "as-stored");
    let bytes = |name: &str| read_metrics(&dir.join(name))["weights_bytes"].unwrap();
    assert!(bytes("f32") < 0.75 * bytes("f32-widened"), "{} vs {}", bytes("f32"), bytes("f32-widened"));
    // At the AVX-512 BF16 and AMX levels (where the CPU has them) the bf16 matrices' products round their
    // activations to bf16: the metrics and the numerics say so, and the default run's results serve nothing to
    // them.
    let rounds_activations = |level: &str, layout: &str| {
        nightshift(&["run", hf_job(level, &format!("cpu_kernels = \"{level}\"")).to_str().unwrap(), "--reuse", dir.join("f32").to_str().unwrap()], &[]).assert_ok();
        assert_eq!(read_metrics_text(&dir.join(level))["weights_layout"], layout);
        assert_ne!(numerics(level), numerics("f32"));
        assert_eq!(read_metrics(&dir.join(level))["reused_rows"], Some(0.0));
        assert_eq!(read_results_json(&dir.join(level)).len(), 2);
    };
    use nightshift::engine::kernels::Level;
    if Level::available().contains(&Level::Avx512Bf16) {
        rounds_activations("avx512-bf16", "bf16 as stored, on AVX-512 BF16 dot products (activations rounded to bf16)");
    } else {
        eprintln!("this CPU has no AVX-512 BF16 level: its bf16 products' job check is skipped here");
    }
    if Level::available().contains(&Level::Amx) {
        rounds_activations("amx", "bf16 as stored, on AMX bf16 tiles (activations rounded to bf16)");
        // An f16 checkpoint (the tiny Mistral) at the AMX level: its products of 24 rows and more split weights and
        // activations into bf16 parts, each product within 2^-15 + 2^-16 of the exact one. The metrics say so, and the
        // greedy texts are the VNNI level's.
        let model = dir.join("hf-f16");
        support::write_tiny_hf_model(&model, support::HfVariant::Mistral);
        let f16_job = |name: &str, level: &str| {
            let output = dir.join(name);
            support::job_file_for(&dir.join(format!("{name}.toml")), &model, input.to_str().unwrap(), output.to_str().unwrap(), "max_new_tokens = 8", &format!("[runtime]\ncpu_kernels = \"{level}\""))
        };
        for (name, level) in [("f16-vnni", "vnni"), ("f16-amx", "amx")] {
            nightshift(&["run", f16_job(name, level).to_str().unwrap()], &[]).assert_ok();
        }
        assert_eq!(read_metrics_text(&dir.join("f16-vnni"))["weights_layout"], "f16 as stored, on the CPU kernels");
        assert_eq!(read_metrics_text(&dir.join("f16-amx"))["weights_layout"], "f16 as stored, on AMX bf16 tiles (weights and activations as two bf16 parts each)");
        assert_ne!(numerics("f16-amx"), numerics("f16-vnni"));
        assert_eq!(texts("f16-amx"), texts("f16-vnni"));
    } else {
        eprintln!("this CPU has no AMX level: the bf16 tiles' job check is skipped here");
    }
    assert!(!numerics("f32").contains("dtype="), "{}", numerics("f32"));
    assert!(numerics("bf16").ends_with(";attention=paged-tiled;dtype=bf16"), "{}", numerics("bf16"));
    assert_eq!(numerics("bf16"), numerics("bf16-flag"));
    assert_eq!(read_results_json(&dir.join("bf16")).len(), 2);
    // The f32 output serves an f32 run and nothing to a bf16 one.
    for (name, runtime, reused) in [("f32-reuse", "", 2.0), ("bf16-reuse", "dtype = \"bf16\"", 0.0)] {
        nightshift(&["run", hf_job(name, runtime).to_str().unwrap(), "--reuse", dir.join("f32").to_str().unwrap()], &[]).assert_ok();
        let metrics = read_metrics(&dir.join(name));
        assert_eq!(metrics["reused_rows"], Some(reused), "{name}: {metrics:?}");
    }
}

/// `runtime.cpu_weights = "as-stored"` computes the GGUF's own matrices (Q4_1 layers, the Q8_0 embedding as the
/// output projection): fewer weight bytes than the padded layout, and the metrics and the log say which ran. So
/// does the KV cache's dtype, asked for with `runtime.kv_cache_dtype` beside the requantized layout.
#[test]
fn cpu_weights_as_stored_runs_the_file_as_stored_and_says_so() {
    let (dir, input) = two_questions("cpu-weights");
    let mut weights = BTreeMap::new();
    for layout in ["as-stored", "fast"] {
        let out = dir.join(layout);
        let kv = if layout == "fast" { "\nkv_cache_dtype = \"f16\"" } else { "" };
        let runtime = format!("[runtime]\ncpu_weights = \"{layout}\"{kv}");
        let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 4", &runtime);
        let run = nightshift(&["run", job.to_str().unwrap()], &[("RUST_LOG", "info")]);
        run.assert_ok();
        assert_eq!(read_results(&out).len(), 2);
        let named = read_metrics_text(&out)["weights_layout"].clone();
        assert!(run.stderr.contains(&format!("cpu_weights={layout}")), "{}", run.stderr);
        // The log names the CPU kernels' level only where they run: the weights as stored.
        assert_eq!(run.stderr.contains("cpu_kernels="), layout == "as-stored", "{}", run.stderr);
        weights.insert(layout, (named, read_metrics(&out)["weights_bytes"].unwrap()));
        let kv_dtype = if layout == "fast" { "f16" } else { "f32" };
        assert_eq!(read_metrics_text(&out)["kv_cache_dtype"], kv_dtype);
        assert!(run.stderr.contains(&format!("kv_cache_dtype=\"{kv_dtype}\"")), "{}", run.stderr);
    }
    assert_eq!(weights["as-stored"].0, "as-stored");
    assert_eq!(weights["fast"].0, "requantized to q4_k, output q6_k, padded");
    assert!(weights["as-stored"].1 < weights["fast"].1, "{weights:?}");
}

#[test]
fn greedy_outputs_are_identical_across_runs_and_batch_sizes() {
    let generation = "max_new_tokens = 24";
    let one = run_prompts("greedy-1", QUESTIONS, generation, &["--max-seqs", "1"]);
    let six = run_prompts("greedy-6", QUESTIONS, generation, &["--max-seqs", "6"]);
    let again = run_prompts("greedy-6-again", QUESTIONS, generation, &["--max-seqs", "6"]);
    let three = run_prompts("greedy-3", QUESTIONS, generation, &["--max-seqs", "3"]);
    // The prefix cache (on in the runs above: the prompts share the chat template's opening) changes nothing.
    let off = run_prompts("greedy-no-prefix-cache", QUESTIONS, &format!("{generation}\n[runtime]\nprefix_cache = false"), &["--max-seqs", "6"]);
    assert_eq!(texts(&one), texts(&six));
    assert_eq!(texts(&six), texts(&again));
    assert_eq!(texts(&six), texts(&three));
    assert_eq!(texts(&six), texts(&off));
    assert!(one.values().all(|r| r.status == "succeeded" && r.completion_tokens > 0));
}

#[test]
fn seeded_sampling_is_reproducible_whatever_the_batch() {
    let generation = "max_new_tokens = 16\ntemperature = 0.9\ntop_p = 0.95\ntop_k = 50\nseed = 7";
    let one = run_prompts("sampled-1", QUESTIONS, generation, &["--max-seqs", "1"]);
    let four = run_prompts("sampled-4", QUESTIONS, generation, &["--max-seqs", "4"]);
    assert_eq!(texts(&one), texts(&four));
    let other = run_prompts("sampled-seed", QUESTIONS, &generation.replace("seed = 7", "seed = 8"), &[]);
    assert_ne!(texts(&one), texts(&other), "a different job seed changes the samples");
}

#[test]
fn stop_strings_and_max_new_tokens_end_generation() {
    let free = run_prompts("stop-free", QUESTIONS, "max_new_tokens = 32", &[]);
    let stopped = run_prompts("stop-dot", QUESTIONS, "max_new_tokens = 32\nstop = [\".\"]", &[]);
    let mut cut = 0;
    for (id, row) in &free {
        let full = row.text.as_deref().unwrap();
        let s = &stopped[id];
        match full.find('.') {
            Some(at) => {
                cut += 1;
                assert_eq!(s.text.as_deref().unwrap(), &full[..at], "{id}");
                assert_eq!(s.finish_reason, "stop", "{id}");
            }
            None => assert_eq!(s.text, row.text, "{id}"),
        }
    }
    assert!(cut >= 3, "the stop string was hit in only {cut} rows");

    let short = run_prompts("stop-length", QUESTIONS, "max_new_tokens = 5", &[]);
    for (id, row) in &short {
        assert!(row.completion_tokens <= 5, "{row:?}");
        if row.completion_tokens == 5 && free[id].completion_tokens > 5 {
            assert_eq!(row.finish_reason, "length", "{row:?}");
            let full = free[id].text.as_deref().unwrap();
            assert!(full.starts_with(row.text.as_deref().unwrap()), "{row:?} vs {full:?}");
        }
    }
    assert!(short.values().any(|r| r.finish_reason == "length"));
}

#[test]
fn every_input_row_appears_exactly_once_and_bad_rows_become_error_rows() {
    // A dot-directory above the input must not hide it (only names below the listed prefix are skipped).
    let dir = scratch("rows").join(".nightly");
    std::fs::create_dir_all(&dir).unwrap();
    let long_prompt = "lorem ipsum ".repeat(5000);
    let a_ids = ids("a", 7);
    write_parquet(
        &dir.join("part-0.parquet"),
        vec![
            ("id", strings(&a_ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())),
            ("prompt", strings(&[Some("Say hi."), Some("Say bye."), None, Some("   "), Some("Count to three."), Some("Name a fruit."), Some("Name a tree.")])),
        ],
    );
    let b_ids = ids("b", 3);
    write_parquet(
        &dir.join("part-1.parquet"),
        vec![
            ("id", strings(&b_ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())),
            ("prompt", strings(&[Some("Name a river."), Some(&long_prompt), Some("Name a city.")])),
        ],
    );
    std::fs::write(dir.join("notes.txt"), "not an input").unwrap();
    let out = dir.join("out");
    let glob = format!("{}/part-*.parquet", dir.display());
    let job = job_file(&dir, &glob, out.to_str().unwrap(), "max_new_tokens = 6", "[runtime]\nmax_seqs = 4");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    let expected: Vec<String> = a_ids.iter().chain(&b_ids).cloned().collect();
    assert_eq!(rows.keys().cloned().collect::<Vec<_>>(), { let mut e = expected.clone(); e.sort(); e });
    let code = |id: &str| rows[id].error_code.as_deref();
    assert_eq!(code("a002"), Some("null_prompt"));
    assert_eq!(code("a003"), Some("empty_prompt"));
    assert_eq!(code("b001"), Some("prompt_too_long"));
    assert!(rows["b001"].error_message.as_deref().unwrap().contains("8192"), "{:?}", rows["b001"]);
    for id in ["a002", "a003", "b001"] {
        assert_eq!(rows[id].status, "errored");
        assert_eq!(rows[id].finish_reason, "error");
        assert_eq!(rows[id].text, None);
    }
    let succeeded = rows.values().filter(|r| r.status == "succeeded").count();
    assert_eq!(succeeded, 7);
    // One unit per input file; results come back in input order.
    let output = OutputStore::local(&out);
    assert_eq!(output.ids_in_order(), expected);
    let metrics = output.metrics();
    assert_eq!(metrics.len(), 2);
    assert_eq!(metrics.iter().map(|m| m["rows"].unwrap()).sum::<f64>(), 10.0);
    assert_eq!(metrics.iter().map(|m| m["errored_rows"].unwrap()).sum::<f64>(), 3.0);
}

#[test]
fn rows_without_an_id_column_get_file_and_row_number_ids() {
    let dir = scratch("no-id");
    write_parquet(&dir.join("in.parquet"), vec![("prompt", strings(&[Some("Say hi."), Some("Say bye.")]))]);
    // Under a prefix, `_`-prefixed names are not data (Hive/Spark convention), nor are non-Parquet files.
    std::fs::create_dir_all(dir.join("_staging")).unwrap();
    write_parquet(&dir.join("_staging/partial.parquet"), vec![("prompt", strings(&[Some("Not data.")]))]);
    std::fs::write(dir.join("README.txt"), "not data").unwrap();
    // The output outside the input's prefix: inside it, a rerun would read the results as input (refused).
    let out = scratch("no-id-out").join("out");
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        format!(
            "[input]\nurl = {:?}\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 4\n[output]\nurl = {:?}\n",
            format!("file://{}/", dir.display()),
            model_path().to_str().unwrap(),
            out.to_str().unwrap()
        ),
    )
    .unwrap();
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows.keys().cloned().collect::<Vec<_>>(), vec!["in.parquet:0", "in.parquet:1"]);

    // Files of the same name in different directories (Hive-style partitions) get different ids: the path below
    // the input's prefix names the file.
    std::fs::remove_file(dir.join("in.parquet")).unwrap();
    for day in ["dt=2026-11-29", "dt=2026-11-30"] {
        std::fs::create_dir_all(dir.join(day)).unwrap();
        write_parquet(&dir.join(day).join("part-0.parquet"), vec![("prompt", strings(&[Some("Say hi."), Some("Say bye.")]))]);
    }
    let out = scratch("no-id-out-hive").join("out");
    std::fs::write(&job, std::fs::read_to_string(&job).unwrap().replace("no-id-out/out", "no-id-out-hive/out")).unwrap();
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let ids: Vec<String> = read_results(&out).keys().cloned().collect();
    assert_eq!(ids, ["dt=2026-11-29/part-0.parquet:0", "dt=2026-11-29/part-0.parquet:1", "dt=2026-11-30/part-0.parquet:0", "dt=2026-11-30/part-0.parquet:1"]);
}

fn messages_array(conversations: &[Option<&[(&str, &str)]>]) -> ArrayRef {
    let fields = vec![Field::new("role", DataType::Utf8, true), Field::new("content", DataType::Utf8, true)];
    let mut list = ListBuilder::new(StructBuilder::from_fields(fields.clone(), 4))
        .with_field(Arc::new(Field::new("item", DataType::Struct(fields.into()), true)));
    for conversation in conversations {
        match conversation {
            None => list.append_null(),
            Some(messages) => {
                for (role, content) in *messages {
                    let s = list.values();
                    s.field_builder::<StringBuilder>(0).unwrap().append_value(role);
                    s.field_builder::<StringBuilder>(1).unwrap().append_value(content);
                    s.append(true);
                }
                list.append(true);
            }
        }
    }
    Arc::new(list.finish())
}

#[test]
fn messages_column_is_rendered_with_the_chat_template() {
    let dir = scratch("messages");
    write_parquet(
        &dir.join("in.parquet"),
        vec![
            ("id", strings(&[Some("m0"), Some("m1"), Some("m2")])),
            (
                "conversation",
                messages_array(&[
                    Some(&[("system", "You answer with one word."), ("user", "What colour is the sky on a clear day?")]),
                    None,
                    Some(&[("user", "What is 12 plus 30?")]),
                ]),
            ),
        ],
    );
    let out = dir.join("out");
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        format!(
            "[input]\nurl = {:?}\nid_column = \"id\"\nmessages_column = \"conversation\"\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 16\n[output]\nurl = {:?}\n",
            dir.join("in.parquet").to_str().unwrap(),
            model_path().to_str().unwrap(),
            out.to_str().unwrap()
        ),
    )
    .unwrap();
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows["m0"].status, "succeeded");
    assert!(rows["m0"].text.as_deref().unwrap().to_lowercase().contains("blue"), "{:?}", rows["m0"]);
    assert_eq!(rows["m1"].error_code.as_deref(), Some("null_prompt"));
    assert_eq!(rows["m2"].status, "succeeded");
    assert!(rows["m2"].prompt_tokens.unwrap() > 10, "the template's default system prompt is part of the prompt");
}

/// Asserts a failed run: the exit code, a message naming `names`, and no output that looks complete.
fn assert_fails(run: &Run, code: i32, names: &[&str], out: &std::path::Path) {
    assert_eq!(run.code, code, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    for name in names {
        assert!(run.stderr.contains(name), "stderr does not name {name:?}:\n{}", run.stderr);
    }
    assert!(!out.join("_SUCCESS").exists(), "a failed run wrote _SUCCESS");
    assert!(!out.join("data").exists(), "a failed run wrote results");
    // A run that could never start writes no plan, which would otherwise refuse the corrected job.
    assert!(!out.join("_plan.json").exists(), "a run that failed before generating wrote a plan");
}

#[test]
fn bad_inputs_fail_with_a_clear_message_and_exit_code() {
    let dir = scratch("bad-inputs");
    let out = dir.join("out");
    let out_s = out.to_str().unwrap();
    let good = dir.join("good.parquet");
    write_parquet(&good, support::prompts(&ids("g", 2), &["Hi.", "Bye."]));

    // A missing input file: exit 3, naming it.
    let missing = dir.join("missing.parquet");
    let job = job_file(&dir, missing.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 3, &["missing.parquet", "no input found"], &out);

    // A file that is not Parquet, and a truncated Parquet file.
    let corrupt = dir.join("corrupt.parquet");
    std::fs::write(&corrupt, b"this is not a parquet file at all, just some bytes").unwrap();
    let job = job_file(&dir, corrupt.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 3, &["corrupt.parquet", "not a readable Parquet file"], &out);
    let truncated = dir.join("truncated.parquet");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let job = job_file(&dir, truncated.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 3, &["truncated.parquet"], &out);

    // A missing column, and a column of the wrong type.
    let no_prompt = dir.join("no-prompt.parquet");
    write_parquet(&no_prompt, vec![("id", strings(&[Some("x")])), ("question", strings(&[Some("Hi?")]))]);
    let job = job_file(&dir, no_prompt.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 3, &["no column `prompt`", "`question`"], &out);
    let int_prompt = dir.join("int-prompt.parquet");
    write_parquet(&int_prompt, vec![("id", strings(&[Some("x")])), ("prompt", Arc::new(Int64Array::from(vec![1])) as ArrayRef)]);
    let job = job_file(&dir, int_prompt.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 3, &["column `prompt`", "Int64", "expected a string"], &out);

    // A missing model file, and a file that is not a model: exit 4.
    let job = job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    let run = nightshift(&["run", job.to_str().unwrap(), "--model", "models/does-not-exist.gguf"], &[]);
    assert_fails(&run, 4, &["models/does-not-exist.gguf"], &out);
    let run = nightshift(&["run", job.to_str().unwrap(), "--model", corrupt.to_str().unwrap()], &[]);
    assert_fails(&run, 4, &["corrupt.parquet", "not a valid GGUF model file"], &out);

    // Malformed job files: exit 2, naming the problem.
    let bad_toml = dir.join("bad.toml");
    std::fs::write(&bad_toml, "[input\nurl = 1").unwrap();
    assert_fails(&nightshift(&["run", bad_toml.to_str().unwrap()], &[]), 2, &["bad.toml"], &out);
    let job = job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 4\ntemprature = 0.5", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 2, &["temprature"], &out);
    let job = job_file(&dir, good.to_str().unwrap(), out_s, "temperature = 0.5", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 2, &["max_new_tokens"], &out);
    let job = job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 4\ntop_p = 1.5", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 2, &["generation.top_p"], &out);
    assert_fails(&nightshift(&["run", dir.join("nope.toml").to_str().unwrap()], &[]), 2, &["nope.toml"], &out);
    let text = std::fs::read_to_string(job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 4", "")).unwrap();
    let job = dir.join("no-template.toml");
    std::fs::write(&job, text.replace("id_column = \"id\"", "id_column = \"id\"\nsystem_prompt = \"Be brief.\"").replace("[model]", "[model]\nchat_template = \"none\"")).unwrap();
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 2, &["input.system_prompt", "chat template"], &out);

    // An output location that cannot be written (a path through a regular file): exit 5.
    let blocker = dir.join("blocker");
    std::fs::write(&blocker, b"a file, not a directory").unwrap();
    let job = job_file(&dir, good.to_str().unwrap(), blocker.join("out").to_str().unwrap(), "max_new_tokens = 4", "");
    assert_fails(&nightshift(&["run", job.to_str().unwrap()], &[]), 5, &["blocker/out", "not writable"], &blocker.join("out"));

    // Running a completed job again does nothing and succeeds; a different job pointed at its output is refused
    // (exit 5, naming what differs), and the completed output is untouched.
    let job = job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 4", "");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let before = std::fs::read(out.join("_manifest.json")).unwrap();
    let rows = read_results(&out);
    let run = nightshift(&["run", job.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("complete already"), "{}", run.stdout);
    let run = nightshift(&["validate", job.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("(complete: a run does nothing)"), "{}", run.stdout);
    let other = job_file(&dir, good.to_str().unwrap(), out_s, "max_new_tokens = 5", "");
    // validate reports the clash before any run.
    let run = nightshift(&["validate", other.to_str().unwrap()], &[]);
    assert_eq!(run.code, 5, "{}", run.stderr);
    assert!(run.stderr.contains("different job"), "{}", run.stderr);
    let run = nightshift(&["run", other.to_str().unwrap()], &[]);
    assert_eq!(run.code, 5, "{}", run.stderr);
    assert!(run.stderr.contains("different job") && run.stderr.contains("generation.max_new_tokens 4 vs 5"), "{}", run.stderr);
    assert_eq!(std::fs::read(out.join("_manifest.json")).unwrap(), before);
    assert_eq!(read_results(&out), rows);
}

#[test]
fn validate_checks_job_input_and_model_without_writing() {
    let dir = scratch("validate");
    let out = dir.join("out");
    let run = nightshift(&["validate", "jobs/summarise.toml", "--output", out.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("job is valid"), "{}", run.stdout);
    assert!(run.stdout.contains("12 rows"), "{}", run.stdout);
    assert!(run.stdout.contains("context 8192"), "{}", run.stdout);
    assert!(run.stdout.contains("smollm"), "{}", run.stdout);
    assert!(run.stdout.contains("(new)"), "{}", run.stdout);
    assert!(!out.exists(), "validate wrote to the output");
    let run = nightshift(&["validate", "jobs/summarise.toml", "--input", "jobs/data/missing.parquet"], &[]);
    assert_eq!(run.code, 3, "{}", run.stderr);
}

#[test]
fn s3_round_trip_through_a_moto_server() {
    let moto = Moto::start();
    moto.create_bucket("nightly");
    let env = moto.env();
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for (k, v) in &env {
        std::env::set_var(k, v);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store = object_store::aws::AmazonS3Builder::from_env().with_bucket_name("nightly").build().unwrap();
    use object_store::ObjectStoreExt;
    let dir = scratch("s3");
    let local = dir.join("in.parquet");
    write_parquet(&local, support::prompts(&ids("s", 3), &QUESTIONS[..3]));
    rt.block_on(store.put(&"in/2026-11-29/part-0.parquet".into(), std::fs::read(&local).unwrap().into())).unwrap();

    let job = job_file(&dir, "s3://nightly/in/2026-11-29/*.parquet", "s3://nightly/out/2026-11-29/", "max_new_tokens = 8", "");
    nightshift(&["run", job.to_str().unwrap()], &env_refs).assert_ok();

    let output = OutputStore::s3(&moto, "nightly", "out/2026-11-29");
    let success: serde_json::Value = serde_json::from_slice(&output.get("_SUCCESS").unwrap()).unwrap();
    assert_eq!(success["rows"], 3);
    let rows = output.results();
    assert_eq!(rows.keys().cloned().collect::<Vec<_>>(), ids("s", 3));
    assert!(rows.values().all(|r| r.status == "succeeded" && r.completion_tokens > 0));
    assert_eq!(output.metrics().len(), 1);

    // A missing object on S3 is named in the error.
    let run = nightshift(&["run", job.to_str().unwrap(), "--input", "s3://nightly/in/absent.parquet", "--output", "s3://nightly/out2/"], &env_refs);
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("s3://nightly/in/absent.parquet"), "{}", run.stderr);
}

/// `bench generate` on the tiny model: in the fixed workload every row generates exactly the length it drew (the
/// saved workload says which), prompts land in the asked range, and the figures add up.
#[test]
fn bench_generate_fixed_workload_generates_every_drawn_token() {
    let dir = scratch("bench-generate");
    let model = dir.join("tiny.gguf");
    write_tiny_model(&model);
    let saved = dir.join("workload.jsonl");
    let run = nightshift(
        &[
            "bench", "generate", "--model", model.to_str().unwrap(), "--rows", "6", "--min-prompt", "100", "--max-prompt", "160",
            "--min-new", "4", "--max-new", "12", "--max-seqs", "4", "--json", "--save-workload", saved.to_str().unwrap(),
        ],
        &[],
    );
    run.assert_ok();
    let report: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&saved).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 6);
    let drawn: u64 = rows.iter().map(|r| r["max_new"].as_u64().unwrap()).sum();
    let prompt: u64 = rows.iter().map(|r| r["prompt"].as_array().unwrap().len() as u64).sum();
    for r in &rows {
        let len = r["prompt"].as_array().unwrap().len();
        // Words are drawn to a length at the tokenizer's average rate, so a prompt lands near its target.
        assert!((90..=176).contains(&len), "prompt of {len} tokens");
        assert_eq!(r["ignore_eos"], true);
    }
    assert_eq!(report["rows"], 6);
    assert_eq!(report["output_tokens"].as_u64(), Some(drawn), "{report}");
    assert_eq!(report["prompt_tokens"].as_u64(), Some(prompt));
    assert!(report["peak_running"].as_u64().unwrap() <= 4);
    let total = report["total_tokens_per_s"].as_f64().unwrap() * report["seconds"].as_f64().unwrap();
    assert!((total - (drawn + prompt) as f64).abs() < 1.0, "{report}");

    // Warm-up rows run first and are not counted: the same workload after a warm-up reports the same schedule.
    let warmed = nightshift(
        &[
            "bench", "generate", "--model", model.to_str().unwrap(), "--rows", "6", "--min-prompt", "100", "--max-prompt", "160",
            "--min-new", "4", "--max-new", "12", "--max-seqs", "4", "--json", "--warmup-rows", "3",
        ],
        &[],
    );
    warmed.assert_ok();
    let warmed: serde_json::Value = serde_json::from_str(warmed.stdout.trim()).unwrap();
    for figure in ["rows", "prompt_tokens", "output_tokens", "steps", "peak_running", "peak_kv_blocks", "preemptions"] {
        assert_eq!(warmed[figure], report[figure], "{figure}: {warmed}");
    }
}

/// SmolLM2-135M's KV cache per block of 16 positions: 30 layers x (keys + values) x 3 kv heads x 64 x 4 bytes x 16.
const SMOLLM2_KV_BLOCK_BYTES: u64 = 30 * 2 * 3 * 64 * 4 * 16;

const LONG_ANSWERS: &[&str] = &[
    "Write a long story about a dragon who learns to bake bread.",
    "Describe in detail how a bicycle works.",
    "Write a long letter to a friend about your summer holiday.",
    "Explain step by step how to plant a vegetable garden.",
    "Tell a long story about a lighthouse keeper and a storm.",
    "Describe a busy market in a big city in detail.",
];

#[test]
fn a_small_kv_cache_preempts_and_recomputes_with_the_same_greedy_outputs() {
    let dir = scratch("preempt");
    let input = dir.join("in.parquet");
    write_parquet(&input, support::prompts(&ids("l", LONG_ANSWERS.len()), LONG_ANSWERS));
    let run = |name: &str, kv: &str| {
        let out = dir.join(name);
        let sub = dir.join(format!("{name}-job"));
        std::fs::create_dir_all(&sub).unwrap();
        let extra = format!("[runtime]\nmax_seqs = 8\nkv_cache_memory = {kv}");
        let job = job_file(&sub, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 96\ntemperature = 0.0", &extra);
        nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
        (texts(&read_results(&out)), read_metrics(&out))
    };
    // Prompts of about 40 tokens (3 blocks) and answers of up to 96: 14 blocks admit three at once, and they
    // outgrow the budget as they decode.
    let (small, small_metrics) = run("small", &(14 * SMOLLM2_KV_BLOCK_BYTES).to_string());
    let (ample, ample_metrics) = run("ample", "\"1GiB\"");
    assert_eq!(small.len(), LONG_ANSWERS.len());
    assert!(small.values().all(|r| r.2 != "error"), "{small:?}");
    assert!(small_metrics["preemptions"].unwrap() > 0.0, "{small_metrics:?}");
    assert!(small_metrics["recomputed_tokens"].unwrap() > 0.0, "{small_metrics:?}");
    assert_eq!(small_metrics["kv_cache_blocks"], Some(14.0));
    assert!(small_metrics["kv_utilisation_peak"].unwrap() <= 1.0);
    assert!(small_metrics["packing_efficiency"].unwrap() < 1.0, "recomputation is waste");
    // The prefix cache (on by default) served the chat template's opening to later rows and to recomputations.
    assert!(small_metrics["cached_prompt_tokens"].unwrap() > 0.0, "{small_metrics:?}");
    assert_eq!(ample_metrics["preemptions"], Some(0.0));
    assert_eq!(ample_metrics["packing_efficiency"], Some(1.0));
    assert!(ample_metrics["prefill_s"].unwrap() > 0.0 && ample_metrics["decode_s"].unwrap() > 0.0, "{ample_metrics:?}");
    // A preempted sequence is prefilled again with what it generated, and goes on where it stopped.
    assert_eq!(small, ample);
}

#[test]
fn bench_arguments_that_cannot_run_are_a_bad_command_line() {
    let model = model_path();
    let model = model.to_str().unwrap();
    let zero = |flag: &'static str| vec!["bench", "generate", "--model", model, flag, "0"];
    // Zero counts are refused by the parser (they panicked in the scheduler before); values that contradict each
    // other, after it. Both exit 2, with the flag named, and nothing runs.
    for args in [zero("--max-seqs"), zero("--max-batch-tokens"), zero("--threads"), zero("--min-new"), zero("--rows")] {
        let run = nightshift(&args, &[]);
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains("must be at least 1") && run.stderr.contains(args[args.len() - 2]), "{args:?}: {}", run.stderr);
    }
    let run = nightshift(&["bench", "generate", "--model", model, "--rows", "2", "--min-prompt", "50", "--max-prompt", "10"], &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("--min-prompt <= --max-prompt"), "{}", run.stderr);
    let run = nightshift(&["bench", "kernels", "--model", model, "--rows", "1,0"], &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[test]
fn plan_counts_the_prompt_tokens_rows_share_with_an_earlier_rows_start() {
    let dir = scratch("plan-prefix");
    let instruction = "You extract fields from support tickets. Read the ticket, then answer with the product, the \
        customer's problem in one sentence, its urgency (low, medium or high) and the team that should handle it. "
        .repeat(6);
    let plan = |name: &str, prompts: Vec<String>| {
        std::fs::create_dir_all(dir.join(name)).unwrap();
        let input = dir.join(format!("{name}.parquet"));
        let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
        write_parquet(&input, support::prompts(&ids("p", refs.len()), &refs));
        let out = dir.join(format!("out-{name}"));
        let job = job_file(&dir.join(name), input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 8", "");
        let run = nightshift(&["plan", job.to_str().unwrap(), "--calibration-rows", "0", "--json"], &[]);
        run.assert_ok();
        let r: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
        assert_eq!(r["shared_prefix_exact"], true, "{r}");
        // The simulated schedule serves from the cache what an unbounded cache could, at most, and computes the rest.
        let (cached, computed) = (r["simulation"]["cached_tokens"].as_u64().unwrap(), r["simulation"]["prefill_tokens"].as_u64().unwrap());
        let (shared, total) = (r["shared_prefix_tokens"].as_u64().unwrap(), r["prompt_tokens"].as_u64().unwrap());
        assert!(cached <= shared && cached + computed == total, "{r}");
        (shared, total, cached)
    };
    // Six questions after one long instruction: rows two to six find the instruction's blocks (and the chat
    // template's) in row one.
    let first: Vec<String> = QUESTIONS.iter().take(6).map(|q| format!("{instruction}\n\n{q}")).collect();
    let (shared, total, cached) = plan("first", first);
    assert!(shared * 10 >= total * 6, "{shared} of {total} prompt tokens shared with the instruction first");
    // With the whole budget, the schedule serves all of it.
    assert_eq!(cached, shared);
    // The same instruction after each question: only the chat template's opening is common, a block or two.
    let last: Vec<String> = QUESTIONS.iter().take(6).map(|q| format!("{q}\n\n{instruction}")).collect();
    let (shared, total, _) = plan("last", last);
    assert!(shared <= 5 * 2 * 16 && total > 6 * 100, "{shared} of {total} prompt tokens shared with the instruction last");
}

#[test]
fn plan_reports_lengths_over_length_rows_schedule_and_estimate_without_touching_the_output() {
    let dir = scratch("plan");
    let input = dir.join("in.parquet");
    let mut prompts: Vec<String> = QUESTIONS.iter().map(|q| q.to_string()).collect();
    // Two prompts far longer than the KV cache below allows.
    prompts.push("Summarise: ".to_string() + &"the printer on floor three is jammed again and nobody knows why. ".repeat(40));
    prompts.push("Explain: ".to_string() + &"a cache holds recent data close to where it is used. ".repeat(40));
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let row_ids = ids("p", refs.len());
    write_parquet(&input, support::prompts(&row_ids, &refs));
    let out = dir.join("out");
    // 12 blocks: 192 tokens, so every question fits (with room to preempt) and the long prompts do not. (Without
    // the prefix cache, whose share of the schedule the prefix test checks, every prompt token is computed.)
    let extra = format!("[runtime]\nmax_seqs = 4\nprefix_cache = false\nkv_cache_memory = {}", 12 * SMOLLM2_KV_BLOCK_BYTES);
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 64", &extra);
    let run = nightshift(&["plan", job.to_str().unwrap(), "--calibration-rows", "2", "--json"], &[]);
    run.assert_ok();
    let r: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(r["rows"], 8, "{r}");
    assert_eq!(r["ok_rows"], 6, "{r}");
    assert_eq!(r["over_length_rows"], 2, "{r}");
    assert_eq!(r["over_length_ids"], serde_json::json!(["p006", "p007"]));
    assert_eq!(r["kv_tokens"], 192);
    let buckets = r["histogram"]["buckets"].as_array().unwrap();
    let rows: u64 = buckets.iter().map(|b| b[2].as_u64().unwrap()).sum();
    let tokens: u64 = buckets.iter().map(|b| b[3].as_u64().unwrap()).sum();
    assert_eq!(rows, 6);
    assert_eq!(tokens, r["prompt_tokens"].as_u64().unwrap());
    let sim = &r["simulation"];
    // Six rows of 64 new tokens: each row's first token comes from its prefill, and so does the next token of a
    // preempted row, from its second prefill.
    assert_eq!(sim["decode_tokens"].as_u64().unwrap() + sim["preemptions"].as_u64().unwrap(), 6 * 63, "{r}");
    assert_eq!(sim["prefill_tokens"].as_u64().unwrap(), tokens + sim["recomputed_tokens"].as_u64().unwrap());
    assert!(sim["preemptions"].as_u64().unwrap() > 0, "four sequences of ~100 tokens outgrow 192: {r}");
    assert!(sim["peak_kv_blocks"].as_u64().unwrap() <= 12);
    assert_eq!(r["calibration"]["rows"], 2);
    assert!(r["estimated_seconds"].as_f64().unwrap() > 0.0, "{r}");
    assert!(!out.exists(), "plan wrote to the output");
    // The text report names the same facts.
    let run = nightshift(&["plan", job.to_str().unwrap(), "--calibration-rows", "0"], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("over-length: 2 rows") && run.stdout.contains("p006, p007"), "{}", run.stdout);
    assert!(run.stdout.contains("estimate: none"), "{}", run.stdout);
}

/// Patches one tensor's entry in a GGUF header: its type (`dtype`) and its offset in the tensor data (`offset`).
fn patch_gguf_tensor(path: &std::path::Path, name: &str, dtype: Option<u32>, offset: impl FnOnce(u64) -> u64) {
    let mut bytes = std::fs::read(path).unwrap();
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key.as_slice()).expect("the tensor's entry") + key.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let type_at = at + 4 + 8 * n_dims;
    if let Some(dtype) = dtype {
        bytes[type_at..type_at + 4].copy_from_slice(&dtype.to_le_bytes());
    }
    let offset_at = type_at + 4;
    let old = u64::from_le_bytes(bytes[offset_at..offset_at + 8].try_into().unwrap());
    bytes[offset_at..offset_at + 8].copy_from_slice(&offset(old).to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_model_that_cannot_be_computed_as_stored_is_refused_at_validate_and_run_naming_the_file_and_field() {
    let dir = scratch("bad-models");
    let input = dir.join("in.parquet");
    write_parquet(&input, prompts(&ids("r", 2), &["one", "two"]));
    let out = dir.join("out");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 4", "");
    let fails = |model: &std::path::Path, names: &[&str]| {
        for verb in ["validate", "run"] {
            let run = nightshift(&[verb, job.to_str().unwrap(), "--model", model.to_str().unwrap()], &[]);
            assert_fails(&run, 4, names, &out);
            assert!(run.stderr.contains(model.to_str().unwrap()), "{verb} names the model: {}", run.stderr);
        }
    };

    // GGUF tensor data as llama.cpp checks it. The tiny model's tensors are written in order, 32-byte aligned.
    let gguf = dir.join("tiny.gguf");
    write_tiny_model(&gguf);
    nightshift(&["validate", job.to_str().unwrap(), "--model", gguf.to_str().unwrap()], &[]).assert_ok();
    let pristine = std::fs::read(&gguf).unwrap();
    patch_gguf_tensor(&gguf, "output_norm.weight", None, |o| o + 4);
    fails(&gguf, &["output_norm.weight", "not aligned"]);
    std::fs::write(&gguf, &pristine).unwrap();
    patch_gguf_tensor(&gguf, "output_norm.weight", None, |_| 0);
    fails(&gguf, &["output_norm.weight", "overlap"]);
    // A Q8_0 matrix that claims to be f32 needs 3.8 times its bytes: it overlaps the next tensor or runs past the end.
    std::fs::write(&gguf, &pristine).unwrap();
    patch_gguf_tensor(&gguf, "output.weight", Some(0), |o| o);
    let run = nightshift(&["validate", job.to_str().unwrap(), "--model", gguf.to_str().unwrap()], &[]);
    assert_eq!(run.code, 4, "{}", run.stderr);
    assert!(run.stderr.contains("output.weight") && (run.stderr.contains("overlap") || run.stderr.contains("past the end")), "{}", run.stderr);
    // Q4_K blocks hold 256 values: rows of 64 cannot be Q4_K.
    std::fs::write(&gguf, &pristine).unwrap();
    patch_gguf_tensor(&gguf, "output_norm.weight", Some(12), |o| o);
    fails(&gguf, &["output_norm.weight", "whole number"]);

    // A BOS token id outside the vocabulary (it failed the first row mid-job).
    std::fs::write(&gguf, &pristine).unwrap();
    let mut bytes = pristine.clone();
    let key = b"tokenizer.ggml.bos_token_id";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "a u32 value");
    bytes[at + 4..at + 8].copy_from_slice(&5000u32.to_le_bytes());
    std::fs::write(&gguf, &bytes).unwrap();
    fails(&gguf, &["BOS token id 5000", "outside the vocabulary of 262"]);

    // A device is not a model file (it would be read forever).
    fails(std::path::Path::new("/dev/zero"), &["not a regular file"]);

    // Special tokens outside the vocabulary, and an empty vocabulary, in a Hugging Face directory.
    let hf = dir.join("hf");
    write_tiny_hf_model(&hf, HfVariant::SmolLm);
    nightshift(&["validate", job.to_str().unwrap(), "--model", hf.to_str().unwrap()], &[]).assert_ok();
    std::fs::write(hf.join("generation_config.json"), r#"{"eos_token_id": [261, 70000]}"#).unwrap();
    fails(&hf, &["token id 70000", "outside the vocabulary of 262"]);
    std::fs::write(hf.join("generation_config.json"), r#"{"eos_token_id": [261]}"#).unwrap();
    let path = hf.join("tokenizer.json");
    let mut tokenizer: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer["model"]["vocab"] = serde_json::json!({});
    tokenizer["model"]["merges"] = serde_json::json!([]);
    tokenizer["added_tokens"] = serde_json::json!([]);
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    fails(&hf, &["vocabulary is empty"]);
}

#[test]
fn an_embedding_models_bad_pooling_config_is_named_as_the_json_file_it_is() {
    let dir = scratch("bad-pooling");
    let source = repo().join("models/all-MiniLM-L6-v2");
    let model = dir.join("model");
    std::fs::create_dir_all(model.join("1_Pooling")).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::os::unix::fs::symlink(entry.path(), model.join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(model.join("1_Pooling/config.json"), r#"{"word_embedding_dimension": 384, "pooling_mode_mean_tokens": "yes"}"#).unwrap();
    let input = dir.join("in.parquet");
    write_parquet(&input, prompts(&ids("r", 1), &["one"]));
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        format!(
            "kind = \"embed\"\n[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[output]\nurl = {:?}\n",
            input.to_str().unwrap(),
            model.to_str().unwrap(),
            dir.join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    let run = nightshift(&["validate", job.to_str().unwrap()], &[]);
    assert_eq!(run.code, 4, "{}", run.stderr);
    assert!(run.stderr.contains("1_Pooling/config.json") && run.stderr.contains("invalid type") && !run.stderr.contains("GGUF"), "{}", run.stderr);
}

#[test]
fn a_gguf_architecture_or_tokenizer_nightshift_does_not_run_stops_validate_and_run_with_exit_4_naming_it() {
    let dir = scratch("gguf-unsupported");
    let job = job_file(&dir, "jobs/data/tickets.parquet", dir.join("out").to_str().unwrap(), "max_new_tokens = 4", "");
    let refused = |model: &std::path::Path, wanted: &[&str]| {
        for verb in ["validate", "run"] {
            let run = nightshift(&[verb, job.to_str().unwrap(), "--model", model.to_str().unwrap()], &[]);
            assert_eq!(run.code, 4, "{verb}: {}", run.stderr);
            for w in wanted {
                assert!(run.stderr.contains(w), "{verb}: no `{w}` in {}", run.stderr);
            }
            assert!(!dir.join("out/_plan.json").exists(), "nothing is written");
        }
    };
    // llama.cpp's Gemma 4 vocabulary file: an architecture nightshift does not compute.
    refused(&repo().join("models/llama.cpp/models/ggml-vocab-gemma-4.gguf"), &["`gemma4`", "not supported", "llama", "qwen2", "qwen3"]);
    // A llama model whose tokenizer names a pre-tokenizer nightshift does not run, and one no program knows.
    let hf = dir.join("hf");
    write_tiny_hf_model(&hf, HfVariant::SmolLm);
    let tiny = dir.join("tiny.gguf");
    write_tiny_model(&tiny);
    let (meta, template) = nightshift::engine::models::llama::gguf::read_tokenizer(&tiny).unwrap();
    for (pre, wanted) in [("kimi-k2", ["`kimi-k2`", "llama-bpe"]), ("no-such-pre", ["`no-such-pre`", "tekken"])] {
        let mut meta = meta.clone();
        meta.pre = Some(pre.into());
        let tokenizer = nightshift::synth::GgufTokenizer::From(Box::new(meta), template.clone());
        let (path, _) = nightshift::synth::synth_gguf(&hf, candle_core::quantized::GgmlDType::Q8_0, Some(&tokenizer)).unwrap();
        refused(&path, &["pre-tokenizer", wanted[0], wanted[1]]);
    }
}

/// A copy of the GGUF at `src` with metadata values replaced and F32 tensors' values replaced (candle's writer).
fn rewrite_gguf(src: &std::path::Path, dst: &std::path::Path, metadata: &[(&str, candle_core::quantized::gguf_file::Value)], tensors: &[(&str, f32)]) {
    rewrite_gguf_without(src, dst, metadata, tensors, &[]);
}

/// [`rewrite_gguf`], leaving out the tensors named in `dropped`.
fn rewrite_gguf_without(src: &std::path::Path, dst: &std::path::Path, metadata: &[(&str, candle_core::quantized::gguf_file::Value)], tensors: &[(&str, f32)], dropped: &[&str]) {
    use candle_core::quantized::{gguf_file, QTensor};
    let mut file = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut meta = content.metadata.clone();
    for (key, value) in metadata {
        meta.insert(key.to_string(), value.clone());
    }
    let mut loaded: Vec<(String, QTensor)> = Vec::new();
    for name in content.tensor_infos.keys().filter(|n| !dropped.contains(&n.as_str())) {
        let mut t = content.tensor(&mut file, name, &candle_core::Device::Cpu).unwrap();
        if let Some((_, v)) = tensors.iter().find(|(n, _)| n == name) {
            let replaced = (t.dequantize(&candle_core::Device::Cpu).unwrap().ones_like().unwrap() * *v as f64).unwrap();
            t = QTensor::quantize(&replaced, t.dtype()).unwrap();
        }
        loaded.push((name.clone(), t));
    }
    let meta_refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = loaded.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(dst).unwrap(), &meta_refs, &tensor_refs).unwrap();
}

#[test]
fn a_rope_base_or_norm_epsilon_out_of_range_stops_validate_and_run_and_nan_logits_fail_rows_not_as_tokens() {
    use candle_core::quantized::gguf_file::Value;
    let dir = scratch("gguf-garbage-metadata");
    let job = job_file(&dir, "jobs/data/tickets.parquet", dir.join("out").to_str().unwrap(), "max_new_tokens = 4", "");
    let tiny = dir.join("tiny.gguf");
    write_tiny_model(&tiny);
    let cases = [
        ("llama.rope.freq_base", Value::F32(f32::NAN)),
        ("llama.rope.freq_base", Value::F32(f32::INFINITY)),
        ("llama.rope.freq_base", Value::F32(0.0)),
        ("llama.rope.freq_base", Value::F32(-10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(f32::NAN)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(0.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(-1e-5)),
    ];
    for (key, value) in cases {
        let path = dir.join("bad.gguf");
        rewrite_gguf(&tiny, &path, &[(key, value.clone())], &[]);
        for verb in ["validate", "run"] {
            let run = nightshift(&[verb, job.to_str().unwrap(), "--model", path.to_str().unwrap()], &[]);
            assert_eq!(run.code, 4, "{verb} {key} = {value:?}: {}", run.stderr);
            assert!(run.stderr.contains(&format!("`{key}`")), "{verb} {key} = {value:?}: {}", run.stderr);
            assert!(!dir.join("out/_plan.json").exists(), "nothing is written");
        }
    }
    // Metadata that contradicts the tensors' shapes, and a tensor the metadata needs left out: `validate` refuses
    // them with `run`'s message (issue #41, class 5: validate passed them).
    let shaped = dir.join("shape.gguf");
    rewrite_gguf(&tiny, &shaped, &[("llama.feed_forward_length", Value::U32(96))], &[]);
    let missing = dir.join("missing.gguf");
    rewrite_gguf_without(&tiny, &missing, &[], &[], &["blk.1.ffn_up.weight"]);
    for (path, needle) in [(&shaped, "tensor `blk.0.ffn_gate.weight` has shape"), (&missing, "no tensor `blk.1.ffn_up.weight`")] {
        for verb in ["validate", "run"] {
            let run = nightshift(&[verb, job.to_str().unwrap(), "--model", path.to_str().unwrap()], &[]);
            assert_eq!(run.code, 4, "{verb} {}: {}", path.display(), run.stderr);
            assert!(run.stderr.contains(needle), "{verb}: {}", run.stderr);
        }
    }
    // Weights that compute NaN (the final norm's): every row is an engine error naming it, none a token; the job
    // itself completes.
    let path = dir.join("nan.gguf");
    rewrite_gguf(&tiny, &path, &[], &[("output_norm.weight", f32::NAN)]);
    let run = nightshift(&["run", job.to_str().unwrap(), "--model", path.to_str().unwrap()], &[]);
    let rows = read_results(&dir.join("out"));
    assert!(!rows.is_empty(), "{}", run.stderr);
    for row in rows.values() {
        assert_eq!(row.status, "errored", "{row:?}");
        assert_eq!(row.error_code.as_deref(), Some("engine_error"), "{row:?}");
        assert!(row.error_message.as_deref().unwrap_or("").contains("NaN logit"), "{row:?}");
    }
}

#[test]
fn a_verb_whose_reader_stops_reading_keeps_its_exit_code_and_does_not_panic() {
    // `nightshift status OUT | head -1`: the reader is gone before the verb prints.
    let dir = scratch("closed-stdout");
    let out = dir.join("out");
    let job = job_file(&dir, "jobs/data/tickets.parquet", out.to_str().unwrap(), "max_new_tokens = 2", "");
    let tiny = dir.join("tiny.gguf");
    write_tiny_model(&tiny);
    let run = nightshift(&["run", job.to_str().unwrap(), "--model", tiny.to_str().unwrap()], &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let tokenize = vec!["tokenize", "--model", tiny.to_str().unwrap(), "--text", "hello there"];
    for args in [vec!["status", out.to_str().unwrap()], vec!["status", out.to_str().unwrap(), "--json"], vec!["validate", job.to_str().unwrap(), "--model", tiny.to_str().unwrap()], tokenize] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_nightshift"))
            .args(&args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&child.stderr);
        assert_eq!(child.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// A dictionary-encoded prompt column (how pandas' categoricals and pyarrow's dictionary arrays are stored) is read
/// as the text it holds, and relative paths with `..` are taken from the current directory for the input, the
/// output and the model alike (issue #41, class 7: the first was refused, the second refused for all but the
/// model).
#[test]
fn dictionary_prompts_and_dot_dot_paths_read_as_plain_ones() {
    let dir = scratch("dictionary");
    let ids: Vec<String> = ["t1", "t2", "t3"].map(String::from).to_vec();
    let texts = ["Summarise: the printer jams.", "Reset my password, please.", "Summarise: the printer jams."];
    let plain = dir.join("plain.parquet");
    write_parquet(&plain, prompts(&ids, &texts));
    let dictionary = dir.join("dictionary.parquet");
    let encoded: arrow::array::DictionaryArray<arrow::datatypes::Int32Type> = texts.iter().copied().collect();
    write_parquet(&dictionary, vec![prompts(&ids, &texts).remove(0), ("prompt", Arc::new(encoded) as ArrayRef)]);
    std::os::unix::fs::symlink(model_path(), dir.join("model.gguf")).unwrap();
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    // From the repository root (the tests' current directory): target/test-scratch/dictionary/sub/../...
    let relative = |name: &str| format!("target/test-scratch/dictionary/sub/../{name}");
    let run = |input: &str, output: &str, model: &str| {
        let job = job_file(&dir, input, output, "max_new_tokens = 6", "");
        let text = std::fs::read_to_string(&job).unwrap().replace(&format!("path = {:?}", model_path().to_string_lossy()), &format!("path = {model:?}"));
        std::fs::write(&job, text).unwrap();
        nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    };
    run(plain.to_str().unwrap(), dir.join("out-plain").to_str().unwrap(), model_path().to_str().unwrap());
    run(&relative("dictionary.parquet"), &relative("out-dictionary"), &relative("model.gguf"));
    let (plain, encoded) = (read_results(&dir.join("out-plain")), read_results(&dir.join("out-dictionary")));
    assert_eq!(encoded.len(), 3);
    for id in &ids {
        assert_eq!(encoded[id].status, "succeeded", "{id}: {:?}", encoded[id]);
        assert_eq!(encoded[id].text, plain[id].text, "{id}");
    }
}

/// `plan` goes on past a calibration row the engine refuses (a per-row `n` over `runtime.max_seqs`: an error row
/// in `run`), timing the others (issue #41, class 7: it exited 1).
#[test]
fn plan_leaves_a_refused_calibration_row_out_of_the_estimate() {
    let dir = scratch("plan-refused");
    let input = dir.join("in.parquet");
    let ids: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    let mut columns = support::prompts(&ids, &["What is a cache?", "What is a queue?", "What is a log?"]);
    columns.push(("n", Arc::new(Int64Array::from(vec![Some(99), None, None])) as ArrayRef));
    write_parquet(&input, columns);
    let extra = "[runtime]\nmax_seqs = 4\n";
    let job = job_file(&dir, input.to_str().unwrap(), dir.join("out").to_str().unwrap(), "max_new_tokens = 4", extra);
    let text = std::fs::read_to_string(&job).unwrap().replace("id_column = \"id\"", "id_column = \"id\"\n[input.parameters]\nn = \"n\"");
    std::fs::write(&job, text).unwrap();
    let run = nightshift(&["plan", job.to_str().unwrap(), "--calibration-rows", "3", "--json"], &[]);
    run.assert_ok();
    let r: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(r["ok_rows"], 3, "the row tokenizes: only the engine refuses it: {r}");
    assert_eq!(r["calibration"]["rows"], 2, "{r}");
    assert!(r["estimated_seconds"].as_f64().unwrap() > 0.0, "{r}");
    // `run` makes the same row an error row and completes.
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    assert_eq!(read_results(&dir.join("out"))["a"].error_code.as_deref(), Some("invalid_parameters"));
}

/// `validate`, `plan` and `run` know a decoder's memory: a mixture's routed experts' weights and the KV cache's
/// bytes a token in the job's dtype. A KV budget that cannot hold one row's first token and its `max_new_tokens`,
/// or that is larger than the memory left beside the weights, is refused by all three with the numbers (exit 2),
/// before anything is written.
#[test]
fn a_decoders_memory_is_reported_and_a_kv_budget_that_cannot_serve_is_refused_with_the_numbers() {
    use nightshift::synth::{self, Family};
    let dir = scratch("memory");
    let input = dir.join("in.parquet");
    write_parquet(&input, prompts(&ids("m", 2), &["one", "two"]));
    let out = dir.join("out");
    // A tiny Mixtral: 2 layers of 8 experts, each three Q8_0 matrices of 128 x 64 (8,192 values in 256 blocks of
    // 34 bytes: 8,704 bytes), so the routed experts take 2 x 8 x 3 x 8,704 = 417,792 bytes = 408 KiB; 2 kv heads of
    // 16, so a token's keys and values take 2 layers x 2 x 2 x 16 x 4 = 512 bytes in f32 and 256 in f16.
    let gguf = dir.join("mixtral.gguf");
    synth::write_gguf(&gguf, &crate::engine::llama_cpp::spec(Family::Mixtral, 16, false, 10000), candle_core::quantized::GgmlDType::Q8_0).unwrap();
    let job = |max_new: u32, runtime: &str| {
        job_file_for(&dir.join("job.toml"), &gguf, input.to_str().unwrap(), out.to_str().unwrap(), &format!("max_new_tokens = {max_new}"), &format!("[runtime]\ndevice = \"cpu\"\n{runtime}"))
    };

    let checked = nightshift(&["validate", job(8, "").to_str().unwrap()], &[]);
    checked.assert_ok();
    assert!(checked.stdout.contains("(routed experts 408 KiB)"), "{}", checked.stdout);
    assert!(checked.stdout.contains("KV cache 512 bytes a token (f32 keys and values, 2 layers x 2 kv heads x 16)"), "{}", checked.stdout);
    let checked = nightshift(&["validate", job(8, "kv_cache_dtype = \"f16\"\nkv_cache_memory = \"64KiB\"").to_str().unwrap()], &[]);
    checked.assert_ok();
    assert!(checked.stdout.contains("KV cache 256 bytes a token (f16 keys and values"), "{}", checked.stdout);
    assert!(checked.stdout.contains("budget 64 KiB = 256 tokens"), "{}", checked.stdout);
    let planned = nightshift(&["plan", job(8, "kv_cache_memory = \"64KiB\"").to_str().unwrap(), "--calibration-rows", "0"], &[]);
    planned.assert_ok();
    assert!(planned.stdout.contains("= 128 tokens at 512 bytes a token (f32)"), "{}", planned.stdout);
    assert!(planned.stdout.contains("routed experts 408 KiB as stored"), "{}", planned.stdout);

    // 8 KiB is one block of 16 positions in f32: a row of 15 new tokens fits beside its first prompt token, one of 16
    // does not.
    let fits = job(15, "kv_cache_memory = \"8KiB\"");
    nightshift(&["validate", fits.to_str().unwrap()], &[]).assert_ok();
    let tight = job(16, "kv_cache_memory = \"8KiB\"");
    for verb in ["validate", "plan", "run"] {
        let refused = nightshift(&[verb, tight.to_str().unwrap()], &[]);
        assert_fails(&refused, 2, &["runtime.kv_cache_memory", "16 tokens at 512 bytes a token", "max_new_tokens (16)"], &out);
    }
    // More than any machine has left beside the weights.
    let huge = job(8, "kv_cache_memory = \"1000000GiB\"");
    for verb in ["validate", "plan", "run"] {
        let refused = nightshift(&[verb, huge.to_str().unwrap()], &[]);
        assert_fails(&refused, 2, &["runtime.kv_cache_memory", "is 1000000.0 GiB, more than the", "left for the KV cache beside the model's weights"], &out);
    }
}
