//! Sampling controls, n choices, log-probabilities, prompt scoring and JSON-Schema extraction, end to end with the
//! real SmolLM2 model: each parameter is checked against its definition, not against recorded outputs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, Float64Array, Int64Array, ListBuilder, StringBuilder};
use serde_json::Value;

use crate::support::*;

/// Writes `columns` (an `id` column first) as the input, a job with `generation` and `[input.parameters]`
/// `parameters`, runs it with `args`, and returns the output directory and its rows as JSON.
fn run_job(name: &str, columns: Vec<(&str, ArrayRef)>, generation: &str, input_extra: &str, args: &[&str]) -> (PathBuf, BTreeMap<String, Value>) {
    let dir = scratch(name);
    let input = dir.join("in.parquet");
    write_parquet(&input, columns);
    let out = dir.join("out");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), generation, "");
    let text = std::fs::read_to_string(&job).unwrap().replace("[model]", &format!("{input_extra}\n[model]"));
    std::fs::write(&job, text).unwrap();
    let mut all = vec!["run", job.to_str().unwrap()];
    all.extend_from_slice(args);
    nightshift(&all, &[]).assert_ok();
    let rows = read_results_json(&out);
    (out, rows)
}

fn ints(values: &[Option<i64>]) -> ArrayRef {
    Arc::new(Int64Array::from(values.to_vec()))
}

fn floats(values: &[Option<f64>]) -> ArrayRef {
    Arc::new(Float64Array::from(values.to_vec()))
}

fn bools(values: &[Option<bool>]) -> ArrayRef {
    Arc::new(BooleanArray::from(values.to_vec()))
}

fn string_lists(values: &[Option<Vec<&str>>]) -> ArrayRef {
    let mut b = ListBuilder::new(StringBuilder::new());
    for v in values {
        match v {
            Some(items) => {
                for item in items {
                    b.values().append_value(item);
                }
                b.append(true);
            }
            None => b.append(false),
        }
    }
    Arc::new(b.finish())
}

fn id_column(ids: &[&str]) -> (&'static str, ArrayRef) {
    ("id", strings(&ids.iter().map(|s| Some(*s)).collect::<Vec<_>>()))
}

fn prompt_column(prompts: &[&str]) -> (&'static str, ArrayRef) {
    ("prompt", strings(&prompts.iter().map(|s| Some(*s)).collect::<Vec<_>>()))
}

fn text(row: &Value) -> &str {
    row["text"].as_str().unwrap_or_else(|| panic!("no text: {row}"))
}

fn tokens(row: &Value) -> u64 {
    row["completion_tokens"].as_u64().unwrap()
}

/// One output token: (token id, logprob, [(alternative id, logprob)]).
type Logprob = (u64, f64, Vec<(u64, f64)>);

fn logprobs(row: &Value) -> Vec<Logprob> {
    row["logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {row}"))
        .iter()
        .map(|t| {
            let top = t["top"].as_array().unwrap().iter().map(|a| (a["token_id"].as_u64().unwrap(), a["logprob"].as_f64().unwrap())).collect();
            (t["token_id"].as_u64().unwrap(), t["logprob"].as_f64().unwrap(), top)
        })
        .collect()
}

const FRANCE: &str = "What is the capital of France?";
/// A question the sample model answers in a few tokens, then ends (as stored, the bare `FRANCE` question runs on).
const PARIS: &str = "What is the capital of France? Answer in one word.";
const SEA: &str = "Write two sentences about the sea.";
const HELLO: &str = "List the numbers from 1 to 25 separated by commas.";

#[test]
fn each_sampling_parameter_changes_outputs_as_defined() {
    // One job, each row setting its own parameters through columns: the row's effective parameters are checked in
    // its `params` column, and its output against its definition.
    let ids = ["greedy", "topk1", "minp1", "topp", "minnew", "ignoreeos", "hello", "hellofreq", "hellorep", "seapres"];
    let prompts = [SEA, SEA, SEA, SEA, PARIS, PARIS, HELLO, HELLO, HELLO, SEA];
    let n = ids.len();
    let mut temperature = vec![None; n];
    let (mut top_k, mut min_new, mut max_new) = (vec![None; n], vec![None; n], vec![None; n]);
    let (mut min_p, mut top_p, mut freq, mut rep, mut pres) = (vec![None; n], vec![None; n], vec![None; n], vec![None; n], vec![None; n]);
    let mut ignore_eos = vec![None; n];
    temperature[1] = Some(1.5);
    top_k[1] = Some(1);
    temperature[2] = Some(1.5);
    min_p[2] = Some(1.0);
    temperature[3] = Some(1.0);
    top_p[3] = Some(0.001);
    min_new[4] = Some(30);
    max_new[4] = Some(40);
    ignore_eos[5] = Some(true);
    max_new[5] = Some(25);
    freq[7] = Some(2.0);
    rep[8] = Some(2.0);
    pres[9] = Some(2.0);
    let columns = vec![
        id_column(&ids),
        prompt_column(&prompts),
        ("temp", floats(&temperature)),
        ("k", ints(&top_k)),
        ("minp", floats(&min_p)),
        ("topp", floats(&top_p)),
        ("min_new", ints(&min_new)),
        ("max_new", ints(&max_new)),
        ("ignore", bools(&ignore_eos)),
        ("freq", floats(&freq)),
        ("rep", floats(&rep)),
        ("pres", floats(&pres)),
    ];
    let parameters = "[input.parameters]\ntemperature = \"temp\"\ntop_k = \"k\"\nmin_p = \"minp\"\ntop_p = \"topp\"\nmin_new_tokens = \"min_new\"\n\
                      max_new_tokens = \"max_new\"\nignore_eos = \"ignore\"\nfrequency_penalty = \"freq\"\nrepetition_penalty = \"rep\"\n\
                      presence_penalty = \"pres\"\n";
    let (_, rows) = run_job("sampling-each", columns, "max_new_tokens = 48\nseed = 3\nlogprobs = 0", parameters, &["--max-seqs", "4"]);
    for id in ids {
        assert_eq!(rows[id]["status"], "succeeded", "{id}: {}", rows[id]);
    }
    // The effective parameters are recorded.
    assert_eq!((rows["topk1"]["params"]["temperature"].as_f64(), rows["topk1"]["params"]["top_k"].as_u64()), (Some(1.5), Some(1)));
    assert_eq!(rows["greedy"]["params"]["seed"], 3);
    assert_eq!(rows["greedy"]["params"]["logprobs"], 0);
    // top_k = 1, min_p = 1 and a tiny top_p keep only the most likely token: greedy, at any temperature.
    let greedy = text(&rows["greedy"]);
    assert!(!greedy.is_empty());
    for id in ["topk1", "minp1", "topp"] {
        assert_eq!(text(&rows[id]), greedy, "{id}");
    }
    // min_new_tokens: a short answer is forced on past its natural end.
    let natural = logprobs(&rows["ignoreeos"]).iter().position(|t| t.0 == 2 || t.0 == 0).expect("the answer ends with an end token");
    assert!(natural < 30, "the France answer ends after {natural} tokens, too late to test min_new_tokens");
    assert!(tokens(&rows["minnew"]) >= 30, "{}", rows["minnew"]);
    assert!(logprobs(&rows["minnew"])[..30].iter().all(|t| t.0 != 2 && t.0 != 0), "no end token before min_new_tokens");
    // ignore_eos: exactly max_new_tokens, through the end token.
    assert_eq!((tokens(&rows["ignoreeos"]), rows["ignoreeos"]["finish_reason"].as_str()), (25, Some("length")));
    // Penalties: the most repeated token of the repetitive answer is repeated less.
    let most_repeated = |id: &str| {
        let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
        for t in logprobs(&rows[id]) {
            *counts.entry(t.0).or_default() += 1;
        }
        counts.into_values().max().unwrap()
    };
    let base = most_repeated("hello");
    assert!(base >= 10, "the base answer is not repetitive enough to test penalties ({base}): {}", text(&rows["hello"]));
    for id in ["hellofreq", "hellorep"] {
        assert!(most_repeated(id) < base, "{id}: {} vs {base}: {}", most_repeated(id), text(&rows[id]));
    }
    // The presence penalty (a constant per token present) is too weak for that answer's confident commas; on
    // free text it steers greedy decoding away from the words already used.
    assert_ne!(text(&rows["seapres"]), greedy);
    assert!(most_repeated("seapres") <= most_repeated("greedy"), "{}", text(&rows["seapres"]));
}

#[test]
fn stop_strings_and_stop_token_ids_end_generation_where_they_say() {
    // The greedy answer and its tokens first; then stops chosen from them.
    let columns = || vec![id_column(&["sea"]), prompt_column(&[SEA])];
    let (_, base) = run_job("stop-base", columns(), "max_new_tokens = 40\nlogprobs = 0", "", &[]);
    let greedy = text(&base["sea"]).to_string();
    let words: Vec<&str> = greedy.split_whitespace().collect();
    assert!(words.len() > 6, "{greedy}");
    let stop = format!(" {}", words[4]);
    let cut = greedy.find(&stop).unwrap();
    let ids = logprobs(&base["sea"]).iter().map(|t| t.0).collect::<Vec<_>>();
    // A token whose first occurrence is its fifth position.
    let (at, stop_id) = ids.iter().enumerate().skip(4).find(|(i, t)| !ids[..*i].contains(t)).map(|(i, t)| (i, *t)).unwrap();

    let rows = vec![
        id_column(&["cut", "kept", "by_id"]),
        prompt_column(&[SEA, SEA, SEA]),
        ("stops", string_lists(&[Some(vec![stop.as_str(), "zzzz"]), Some(vec![stop.as_str()]), None])),
        ("include", bools(&[None, Some(true), None])),
        ("stop_ids", {
            let mut b = ListBuilder::new(arrow::array::Int64Builder::new());
            b.append(false);
            b.append(false);
            b.values().append_value(stop_id as i64);
            b.append(true);
            Arc::new(b.finish()) as ArrayRef
        }),
    ];
    let parameters = "[input.parameters]\nstop = \"stops\"\ninclude_stop_str_in_output = \"include\"\nstop_token_ids = \"stop_ids\"\n";
    let (_, out) = run_job("stop-rows", rows, "max_new_tokens = 40", parameters, &[]);
    assert_eq!(text(&out["cut"]), &greedy[..cut], "cut before the stop string");
    assert!(!text(&out["cut"]).contains(&stop));
    assert_eq!(text(&out["kept"]), &greedy[..cut + stop.len()], "the stop string kept");
    assert_eq!(out["cut"]["finish_reason"], "stop");
    // The stop token is counted, not written.
    assert_eq!(tokens(&out["by_id"]), at as u64 + 1, "{}", out["by_id"]);
    assert!(greedy.starts_with(text(&out["by_id"])), "{} / {greedy}", text(&out["by_id"]));
    assert_eq!(out["by_id"]["params"]["stop_token_ids"], serde_json::json!([stop_id]));
}

#[test]
fn a_seed_gives_the_same_samples_whatever_the_batch() {
    let prompts = [SEA, FRANCE, HELLO, "Name a colour.", "Describe a cat in one sentence.", "What is rain?"];
    let ids = ["a", "b", "c", "d", "e", "f"];
    let generation = "max_new_tokens = 24\ntemperature = 1.0\ntop_p = 0.95\nseed = 11";
    let (_, alone) = run_job("seed-alone", vec![id_column(&ids), prompt_column(&prompts)], generation, "", &["--max-seqs", "1"]);
    // Other rows around them, in another order, many at once.
    let mut more_ids = vec!["x", "f", "y", "c", "a", "e", "z", "b", "d"];
    let mut more_prompts = vec![HELLO, prompts[5], FRANCE, prompts[2], prompts[0], prompts[4], SEA, prompts[1], prompts[3]];
    more_ids.reverse();
    more_prompts.reverse();
    let (_, batched) = run_job("seed-batched", vec![id_column(&more_ids), prompt_column(&more_prompts)], generation, "", &["--max-seqs", "8"]);
    for id in ids {
        assert_eq!(text(&alone[id]), text(&batched[id]), "{id}");
    }
    let (_, other_seed) = run_job("seed-other", vec![id_column(&ids), prompt_column(&prompts)], &generation.replace("seed = 11", "seed = 12"), "", &[]);
    assert!(ids.iter().any(|&id| text(&alone[id]) != text(&other_seed[id])), "another seed changes some sample");
}

#[test]
fn n_choices_share_one_prefill_and_are_reproducible() {
    let columns = || vec![id_column(&["sea", "france"]), prompt_column(&[SEA, FRANCE])];
    let generation = "max_new_tokens = 20\ntemperature = 1.0\nseed = 5\nn = 4";
    let (out, first) = run_job("n-first", columns(), generation, "", &[]);
    let (_, second) = run_job("n-second", columns(), generation, "", &[]);
    for id in ["sea", "france"] {
        let choices = first[id]["choices"].as_array().unwrap_or_else(|| panic!("no choices: {}", first[id]));
        assert_eq!(choices.len(), 4);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i as u64);
            assert!(c["finish_reason"] == "stop" || c["finish_reason"] == "length", "{c}");
        }
        assert_eq!(first[id]["text"], choices[0]["text"], "the top-level columns are the first choice");
        assert_eq!(tokens(&first[id]), choices.iter().map(|c| c["completion_tokens"].as_u64().unwrap()).sum::<u64>());
        let distinct: std::collections::BTreeSet<&str> = choices.iter().map(|c| c["text"].as_str().unwrap()).collect();
        assert!(distinct.len() >= 2, "four samples at temperature 1 are not all the same: {distinct:?}");
        assert_eq!(first[id]["choices"], second[id]["choices"], "the same seed, the same choices");
    }
    // Prefilled once per prompt: the engine prefilled exactly the prompts' tokens, less those the prefix cache
    // served (the chat template's opening, for the second), and nothing was preempted.
    let metrics = read_metrics(&out);
    assert_eq!(metrics["preemptions"], Some(0.0));
    let prompt_tokens: u64 = first.values().map(|r| r["prompt_tokens"].as_u64().unwrap()).sum();
    let cached: u64 = first.values().map(|r| r["cached_tokens"].as_u64().unwrap()).sum();
    assert_eq!(metrics["cached_prompt_tokens"], Some(cached as f64), "{metrics:?}");
    assert_eq!(metrics["prefill_tokens"], Some((prompt_tokens - cached) as f64), "{metrics:?}");
}

#[test]
fn logprobs_report_the_chosen_token_and_scoring_agrees_with_generation() {
    let prompts = [SEA, FRANCE, "Give one tip for learning to cook."];
    let ids = ["sea", "france", "cook"];
    let (_, generated) = run_job("logprobs", vec![id_column(&ids), prompt_column(&prompts)], "max_new_tokens = 24\nlogprobs = 5", "", &[]);
    for id in ids {
        let lps = logprobs(&generated[id]);
        assert_eq!(lps.len() as u64, tokens(&generated[id]));
        for (token, lp, top) in &lps {
            assert_eq!(top.len(), 5);
            // Greedy: the chosen token is the most likely, so its logprob is the maximum of the alternatives.
            assert_eq!(top[0].0, *token);
            assert_eq!(top[0].1, *lp);
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "alternatives most likely first");
            assert!(*lp <= 0.0 && top.iter().map(|a| a.1.exp()).sum::<f64>() <= 1.0 + 1e-4);
        }
        let sum: f64 = lps.iter().map(|t| t.1).sum();
        assert!((generated[id]["cumulative_logprob"].as_f64().unwrap() - sum).abs() < 1e-3);
    }
    // Score each generated text (without its end token) as the completion of its prompt: the log-likelihood of
    // the same tokens, computed in one prefill instead of step by step.
    let completions: Vec<String> = ids.iter().map(|&id| text(&generated[id]).to_string()).collect();
    let columns = vec![
        id_column(&ids),
        prompt_column(&prompts),
        ("label", strings(&completions.iter().map(|c| Some(c.as_str())).collect::<Vec<_>>())),
    ];
    let dir = scratch("scoring");
    let input = dir.join("in.parquet");
    write_parquet(&input, columns);
    let out = dir.join("out");
    let job = dir.join("score.toml");
    std::fs::write(
        &job,
        format!(
            "[input]\nurl = {:?}\nid_column = \"id\"\ncompletion_column = \"label\"\n\n[model]\npath = {:?}\n\n[generation]\nlogprobs = 2\n\n[output]\nurl = {:?}\n",
            input.to_str().unwrap(),
            model_path().to_str().unwrap(),
            out.to_str().unwrap()
        ),
    )
    .unwrap();
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let scored = read_results_json(&out);
    for id in ids {
        let row = &scored[id];
        assert_eq!((row["status"].as_str(), row["finish_reason"].as_str()), (Some("succeeded"), Some("scored")), "{row}");
        assert!(row.get("text").is_none(), "a scoring row generates no text");
        let gen_lps = logprobs(&generated[id]);
        let score_lps = logprobs(row);
        assert_eq!(tokens(row), score_lps.len() as u64);
        // The generated tokens without the end token, re-tokenized from the text, are the scored tokens.
        let generated_ids: Vec<u64> = gen_lps.iter().map(|t| t.0).filter(|&t| t != 0 && t != 2).collect();
        assert_eq!(score_lps.iter().map(|t| t.0).collect::<Vec<_>>(), generated_ids, "{id}");
        let mut sum = 0.0;
        for ((_, g, _), (_, s, top)) in gen_lps.iter().zip(&score_lps) {
            assert!((g - s).abs() < 0.05, "{id}: generated {g} vs scored {s}");
            assert_eq!(top.len(), 2);
            sum += s;
        }
        assert!((row["cumulative_logprob"].as_f64().unwrap() - sum).abs() < 1e-3);
        let gen_sum: f64 = gen_lps.iter().take(score_lps.len()).map(|t| t.1).sum();
        assert!((gen_sum - sum).abs() < 0.1, "{id}: log-likelihood {sum} scored vs {gen_sum} generated");
    }
    // A scoring output has no answers for the OpenAI Batch format: `export` says so (exit 2) instead of writing
    // empty answers that "stop" (issue #41, class 10), and `output.export` in a scoring job is refused.
    let run = nightshift(&["export", out.to_str().unwrap(), "--format", "openai-batch", "--to", dir.join("batch").to_str().unwrap()], &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("scoring job"), "{}", run.stderr);
    assert!(!dir.join("batch").exists());
    std::fs::write(&job, std::fs::read_to_string(&job).unwrap() + "export = \"openai-batch\"\n").unwrap();
    let run = nightshift(&["validate", job.to_str().unwrap()], &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("output.export") && run.stderr.contains("scoring job"), "{}", run.stderr);
}

/// Validates `instance` against the JSON Schema `schema` with Python's `jsonschema` (an independent validator);
/// returns the error messages, one per invalid instance.
fn validate_with_python(schema: &Value, instances: &[Value]) -> Vec<String> {
    let script = "import json, sys, jsonschema\n\
                  d = json.load(sys.stdin)\n\
                  v = jsonschema.Draft202012Validator(d['schema'])\n\
                  print(json.dumps([[e.message for e in v.iter_errors(i)] for i in d['instances']]))\n";
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(serde_json::json!({"schema": schema, "instances": instances}).to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "jsonschema failed: {}", String::from_utf8_lossy(&out.stdout));
    let errors: Vec<Vec<String>> = serde_json::from_slice(&out.stdout).unwrap();
    errors.into_iter().flatten().collect()
}

#[test]
fn the_sample_extraction_job_writes_json_that_validates_against_its_schema() {
    let dir = scratch("extract");
    let out = dir.join("out");
    let run = nightshift(&["run", "jobs/extract.toml", "--output", out.to_str().unwrap(), "--show", "2"], &[]);
    run.assert_ok();
    let rows = read_results_json(&out);
    assert_eq!(rows.len(), 12);
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(repo().join("jobs/ticket.schema.json")).unwrap()).unwrap();
    let mut values = Vec::new();
    for (id, row) in &rows {
        assert_eq!((row["status"].as_str(), row["finish_reason"].as_str()), (Some("succeeded"), Some("stop")), "{id}: {row}");
        let value: Value = serde_json::from_str(text(row)).unwrap_or_else(|e| panic!("{id}: not JSON ({e}): {}", text(row)));
        values.push(value);
    }
    let errors = validate_with_python(&schema, &values);
    assert!(errors.is_empty(), "{errors:?}");
    // The validator is not lenient: a value the schema forbids is reported.
    let mut wrong = values[0].clone();
    wrong["urgency"] = "urgent".into();
    assert_eq!(validate_with_python(&schema, &[wrong]).len(), 1);
}

#[test]
fn per_row_schemas_are_compiled_once_and_bad_ones_fail_only_their_row() {
    let schema = r#"{"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}, "confidence": {"type": "integer", "minimum": 0, "maximum": 10}}, "required": ["answer", "confidence"], "additionalProperties": false}"#;
    let list = r#"{"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}"#;
    let columns = vec![
        id_column(&["obj", "list", "bad", "short", "free"]),
        prompt_column(&[FRANCE, "Name some colours.", FRANCE, FRANCE, FRANCE]),
        ("schema", strings(&[Some(schema), Some(list), Some("{\"type\": \"object\", \"required\": 5}"), Some(schema), None])),
        ("max_new", ints(&[None, None, None, Some(3), None])),
    ];
    let parameters = "[input.parameters]\njson_schema = \"schema\"\nmax_new_tokens = \"max_new\"\n";
    let (_, rows) = run_job("row-schemas", columns, "max_new_tokens = 64", parameters, &[]);
    let obj: Value = serde_json::from_str(text(&rows["obj"])).unwrap();
    assert!(obj["answer"].is_string() && obj["confidence"].is_i64(), "{obj}");
    let list_value: Value = serde_json::from_str(text(&rows["list"])).unwrap();
    assert!(validate_with_python(&serde_json::from_str(list).unwrap(), std::slice::from_ref(&list_value)).is_empty(), "{list_value}");
    assert!(validate_with_python(&serde_json::from_str(schema).unwrap(), &[obj]).is_empty());
    assert_eq!(rows["bad"]["error"]["code"], "invalid_parameters", "{}", rows["bad"]);
    assert!(rows["bad"]["error"]["message"].as_str().unwrap().contains("json_schema"), "{}", rows["bad"]);
    // Three tokens cannot close the object.
    assert_eq!(rows["short"]["finish_reason"], "incomplete_json");
    assert_eq!(rows["free"]["status"], "succeeded");
    assert!(rows["free"]["params"].get("json_schema").is_none(), "a null column keeps the job's (no schema)");
    // A job-level schema llguidance cannot use is refused before generation, naming the key.
    let dir = scratch("bad-job-schema");
    let input = dir.join("in.parquet");
    write_parquet(&input, vec![id_column(&["a"]), prompt_column(&[FRANCE])]);
    let job = job_file(&dir, input.to_str().unwrap(), dir.join("out").to_str().unwrap(), "max_new_tokens = 8\njson_schema = '{\"type\": \"object\", \"required\": 5}'", "");
    for command in ["validate", "run"] {
        let run = nightshift(&[command, job.to_str().unwrap()], &[]);
        assert_eq!(run.code, 2, "{command}: {}", run.stderr);
        assert!(run.stderr.contains("generation.json_schema"), "{command}: {}", run.stderr);
    }
}

/// Runs a job over `columns` with `runtime` as its `[runtime]` section: its results (as JSON, by id) and metrics.
fn run_with_runtime(name: &str, columns: Vec<(&str, ArrayRef)>, generation: &str, input_extra: &str, runtime: &str) -> (BTreeMap<String, Value>, BTreeMap<String, Option<f64>>) {
    let dir = scratch(name);
    let input = dir.join("in.parquet");
    write_parquet(&input, columns);
    let out = dir.join("out");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), generation, &format!("[runtime]\n{runtime}"));
    let text = std::fs::read_to_string(&job).unwrap().replace("[model]", &format!("{input_extra}\n[model]"));
    std::fs::write(&job, text).unwrap();
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    (read_results_json(&out), read_metrics(&out))
}

/// A row's result without what may differ between runs of the same rows (timing) or with the cache (its use).
fn outputs(rows: &BTreeMap<String, Value>) -> BTreeMap<String, Value> {
    rows.iter()
        .map(|(id, row)| {
            let mut row = row.clone();
            for key in ["queue_s", "ttft_s", "e2e_s", "tpot_s", "cached_tokens"] {
                row.as_object_mut().unwrap().remove(key);
            }
            (id.clone(), row)
        })
        .collect()
}

/// Two long instructions, each in front of several questions, and questions alone: rows of different prefixes
/// mixed in one unit.
fn instruction_rows() -> (Vec<String>, Vec<String>) {
    let a = "You extract fields from support tickets. Read the ticket, then answer with the product, the customer's \
        problem in one sentence, its urgency (low, medium or high) and the team that should handle it. "
        .repeat(6);
    let b = "You are a careful copy editor. Rewrite the text below in plain English for a general reader, keep every \
        fact, remove jargon, and never add information that is not in the text. "
        .repeat(6);
    let (mut ids, mut prompts) = (Vec::new(), Vec::new());
    for (i, q) in ["What is the capital of France?", "Name three colours of the rainbow.", "What is 12 plus 30?", "Give a synonym for happy.", "Why do leaves fall in autumn?"].iter().enumerate() {
        for (family, instruction) in [("a", &a), ("b", &b)] {
            ids.push(format!("{family}{i}"));
            prompts.push(format!("{instruction}\n\n{q}"));
        }
        ids.push(format!("q{i}"));
        prompts.push(q.to_string());
    }
    (ids, prompts)
}

/// The prefix cache (on by default) changes no result: the same rows give the same texts, choices and
/// log-probabilities (exact floats) with it on at several `max_seqs`, off, and on with a KV budget that holds only a
/// few prefixes (cached blocks are evicted to make room), with `n = 2` and JSON-schema rows among them. With
/// it on, rows after the first of their instruction take the instruction from the cache (`cached_tokens`), and the
/// metrics count exactly the tokens served and the tokens computed.
#[test]
fn the_prefix_cache_changes_no_result_and_serves_a_shared_instruction() {
    let (ids, prompts) = instruction_rows();
    let schema = r#"{"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}"#;
    let columns = || {
        let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let prompt_refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
        let n: Vec<Option<i64>> = ids.iter().map(|id| (id == "a3").then_some(2)).collect();
        let schemas: Vec<Option<&str>> = ids.iter().map(|id| (id == "b2").then_some(schema)).collect();
        vec![id_column(&id_refs), prompt_column(&prompt_refs), ("n", ints(&n)), ("schema", strings(&schemas))]
    };
    let generation = "max_new_tokens = 12\ntemperature = 0.8\nseed = 3\nlogprobs = 1";
    let parameters = "[input.parameters]\nn = \"n\"\njson_schema = \"schema\"\n";
    let run = |name: &str, runtime: &str| run_with_runtime(name, columns(), generation, parameters, runtime);
    let (off, off_metrics) = run("prefix-off", "max_seqs = 16\nprefix_cache = false");
    let (on, on_metrics) = run("prefix-on", "max_seqs = 16");
    let (one, one_metrics) = run("prefix-on-2", "max_seqs = 2");
    let (four, _) = run("prefix-on-4", "max_seqs = 4");
    // 40 blocks of 16 positions hold two of these prompts (about 290 tokens each) and their answers.
    let (tight, tight_metrics) = run("prefix-tight", &format!("max_seqs = 16\nkv_cache_memory = {}", 40 * 30 * 2 * 3 * 64 * 4 * 16));
    assert_eq!(off.len(), ids.len());
    assert!(off.values().all(|r| r["status"] == "succeeded"), "{off:?}");
    assert_eq!(off["a3"]["choices"].as_array().map(Vec::len), Some(2), "{}", off["a3"]);
    for (name, rows) in [("on", &on), ("max_seqs 2", &one), ("max_seqs 4", &four), ("tight", &tight)] {
        for (id, row) in outputs(rows) {
            assert_eq!(row, outputs(&off)[&id], "{id} differs with the cache {name}");
        }
    }
    let cached = |rows: &BTreeMap<String, Value>, id: &str| rows[id]["cached_tokens"].as_u64().unwrap();
    assert!(ids.iter().all(|id| cached(&off, id) == 0));
    assert_eq!(off_metrics["cached_prompt_tokens"], Some(0.0));
    for (rows, metrics) in [(&on, &on_metrics), (&one, &one_metrics)] {
        for id in ["a1", "a2", "a3", "a4", "b1", "b3", "b4"] {
            assert!(cached(rows, id) >= 224, "{id}: {}", rows[id]);
        }
        let served: u64 = ids.iter().map(|id| cached(rows, id)).sum();
        for id in &ids {
            assert!(cached(rows, id) % 16 == 0 && cached(rows, id) < rows[id]["prompt_tokens"].as_u64().unwrap(), "{}", rows[id]);
        }
        assert_eq!(metrics["cached_prompt_tokens"], Some(served as f64));
        assert_eq!(metrics["prefill_tokens"].unwrap() + served as f64, metrics["prompt_tokens"].unwrap(), "{metrics:?}");
    }
    // More than two thirds of the prompt tokens come from the cache.
    assert!(on_metrics["cached_prompt_tokens"].unwrap() * 3.0 > on_metrics["prompt_tokens"].unwrap() * 2.0, "{on_metrics:?}");
    assert!(tight_metrics["prefix_cache_evictions"].unwrap() > 0.0, "{tight_metrics:?}");
    assert!(tight_metrics["cached_prompt_tokens"].unwrap() > 0.0, "{tight_metrics:?}");

    // A scoring job: the log-probabilities of given completions are the same with the cache on and off.
    let labels: Vec<Option<&str>> = ids.iter().map(|_| Some(" Paris is the answer.")).collect();
    let scoring = |name: &str, runtime: &str| {
        let mut columns = columns();
        columns.truncate(2);
        columns.push(("label", strings(&labels)));
        run_with_runtime(name, columns, "logprobs = 2", "completion_column = \"label\"\n", runtime).0
    };
    let (scored_on, scored_off) = (scoring("prefix-score-on", "max_seqs = 8"), scoring("prefix-score-off", "prefix_cache = false"));
    assert!(scored_on.values().all(|r| r["finish_reason"] == "scored"), "{scored_on:?}");
    assert_eq!(outputs(&scored_on), outputs(&scored_off));
    assert!(cached(&scored_on, "a4") >= 224, "{}", scored_on["a4"]);
}
