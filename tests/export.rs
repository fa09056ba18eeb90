//! `nightshift export --format openai-batch`: the Batch API's two files from a completed output, checked field by
//! field against examples written from OpenAI's documentation (`tests/data/openai-batch/`), one line per row
//! across the two files, in input order; locally and on S3.

use std::path::Path;

use serde_json::Value;

use crate::support::*;

fn example(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(repo().join("tests/data/openai-batch").join(name)).unwrap()).unwrap()
}

/// Every field of `documented` is in `ours` with the same JSON type, recursively (lists by their first element);
/// a documented null admits any value (the field is there).
fn agrees(documented: &Value, ours: &Value, at: &str) {
    match (documented, ours) {
        (Value::Null, _) => {}
        (Value::Object(d), Value::Object(o)) => {
            for (key, value) in d {
                let field = format!("{at}.{key}");
                let ours = o.get(key).unwrap_or_else(|| panic!("`{field}` is documented but missing: {ours}"));
                agrees(value, ours, &field);
            }
        }
        (Value::Array(d), Value::Array(o)) => {
            if let (Some(d), Some(o)) = (d.first(), o.first()) {
                agrees(d, o, &format!("{at}[0]"));
            }
        }
        (Value::Number(_), Value::Number(_)) | (Value::String(_), Value::String(_)) | (Value::Bool(_), Value::Bool(_)) => {}
        (d, o) => panic!("`{at}` is {d} in the documentation but {o} here"),
    }
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn custom_ids(lines: &[Value]) -> Vec<String> {
    lines.iter().map(|l| l["custom_id"].as_str().unwrap().to_string()).collect()
}

/// A job over the tiny model: 6 rows, two of them bad (a null and an empty prompt), with logprobs and, for one
/// row, two choices.
fn tiny_job(dir: &Path, template: &str) -> (std::path::PathBuf, Vec<String>) {
    let model = dir.join("tiny.gguf");
    write_tiny_model(&model);
    let input = dir.join("in.parquet");
    let ids: Vec<String> = (0..6).map(|i| format!("req-{i}")).collect();
    let id_refs: Vec<Option<&str>> = ids.iter().map(|i| Some(i.as_str())).collect();
    let prompts = [Some("hello there"), None, Some("what is a printer"), Some(""), Some("refund please"), Some("again")];
    let n: Vec<Option<i64>> = vec![None, None, Some(2), None, None, None];
    write_parquet(&input, vec![("id", strings(&id_refs)), ("prompt", strings(&prompts)), ("n", std::sync::Arc::new(arrow::array::Int64Array::from(n)))]);
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        format!(
            "[input]\nurl = {:?}\nid_column = \"id\"\n[input.parameters]\nn = \"n\"\n[model]\npath = {:?}\nchat_template = {template:?}\n\
             [generation]\nmax_new_tokens = 5\nlogprobs = 2\n[output]\nurl = {:?}\n",
            input.to_string_lossy(),
            model.to_string_lossy(),
            dir.join("out").to_string_lossy()
        ),
    )
    .unwrap();
    (path, ids)
}

#[test]
fn openai_batch_files_agree_with_the_documentation_one_line_per_row() {
    let dir = scratch("export-chat");
    let (job, ids) = tiny_job(&dir, "auto");
    let out = dir.join("out");
    // An incomplete output is not exported (exit 75, as for finalize).
    std::fs::create_dir_all(&out).unwrap();
    let to = dir.join("batch");
    let run = nightshift(&["export", out.to_str().unwrap(), "--format", "openai-batch", "--to", to.to_str().unwrap()], &[]);
    assert_eq!(run.code, 75, "{}", run.stderr);
    assert!(run.stderr.contains("not complete"), "{}", run.stderr);

    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let run = nightshift(&["export", out.to_str().unwrap(), "--format", "openai-batch", "--to", to.to_str().unwrap(), "--model", "smol-tiny"], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("4 lines of /v1/chat/completions responses") && run.stdout.contains("2 error lines"), "{}", run.stdout);
    let (results, errors) = (lines(&to.join("results.jsonl")), lines(&to.join("errors.jsonl")));
    // One line per row across the two files, each file in input order.
    assert_eq!(custom_ids(&results), ["req-0", "req-2", "req-4", "req-5"]);
    assert_eq!(custom_ids(&errors), ["req-1", "req-3"]);
    let mut all: Vec<String> = custom_ids(&results).into_iter().chain(custom_ids(&errors)).collect();
    all.sort();
    assert_eq!(all, ids);
    let rows = read_results_json(&out);
    for line in &results {
        agrees(&example("batch_guide_output_line.json"), line, "line");
        agrees(&example("chat_completion_object.json"), &line["response"]["body"], "body");
        let body = &line["response"]["body"];
        assert_eq!(body["model"], "smol-tiny");
        for choice in body["choices"].as_array().unwrap() {
            agrees(&example("chat_completion_logprobs.json"), &choice["logprobs"], "logprobs");
        }
        let row = &rows[line["custom_id"].as_str().unwrap()];
        assert_eq!(body["choices"][0]["message"]["content"], row["text"]);
        assert_eq!(body["usage"]["prompt_tokens"], row["prompt_tokens"]);
        assert_eq!(body["usage"]["completion_tokens"], row["completion_tokens"]);
        assert!(line["error"].is_null() && line["response"]["status_code"] == 200);
    }
    assert_eq!(results[1]["response"]["body"]["choices"].as_array().unwrap().len(), 2, "n = 2: two choices");
    for line in &errors {
        agrees(&example("batch_expired_error_line.json"), line, "error line");
        assert!(line["response"].is_null());
    }
    assert_eq!(errors[0]["error"]["code"], "null_prompt");
    assert_eq!(errors[1]["error"]["code"], "empty_prompt");
    // Exporting again writes the same lines (ids are the output's, not the export's).
    nightshift(&["export", out.to_str().unwrap(), "--format", "openai-batch", "--to", to.to_str().unwrap()], &[]).assert_ok();
    assert_eq!(custom_ids(&lines(&to.join("results.jsonl"))), custom_ids(&results));
    assert_eq!(lines(&to.join("results.jsonl"))[0]["id"], results[0]["id"]);
}

#[test]
fn raw_prompts_export_as_text_completions_and_s3_works_both_ways() {
    let dir = scratch("export-text");
    let (job, _) = tiny_job(&dir, "none");
    // The run that completes the output exports it too (`output.export`, the last section of the job file).
    let text = std::fs::read_to_string(&job).unwrap() + "export = \"openai-batch\"\n";
    std::fs::write(&job, text).unwrap();
    let moto = Moto::start();
    moto.create_bucket("batches");
    let env = moto.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let run = nightshift(&["run", job.to_str().unwrap(), "--output", "s3://batches/out/"], &env);
    run.assert_ok();
    let run = nightshift(&["export", "s3://batches/out/", "--format", "openai-batch", "--to", "s3://batches/export/"], &env);
    run.assert_ok();
    assert!(run.stdout.contains("/v1/completions"), "{}", run.stdout);
    let store = OutputStore::s3(&moto, "batches", "export");
    let text = String::from_utf8(store.get("results.jsonl").unwrap().to_vec()).unwrap();
    let results: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(custom_ids(&results), ["req-0", "req-2", "req-4", "req-5"]);
    for line in &results {
        agrees(&example("completion_object.json"), &line["response"]["body"], "body");
        let logprobs = &line["response"]["body"]["choices"][0]["logprobs"];
        let tokens = logprobs["tokens"].as_array().unwrap();
        assert_eq!((logprobs["token_logprobs"].as_array().unwrap().len(), logprobs["text_offset"].as_array().unwrap().len()), (tokens.len(), tokens.len()));
    }
    assert_eq!(String::from_utf8(store.get("errors.jsonl").unwrap().to_vec()).unwrap().lines().count(), 2);
    let by_run = OutputStore::s3(&moto, "batches", "out/openai-batch");
    assert_eq!(by_run.get("results.jsonl").unwrap(), store.get("results.jsonl").unwrap(), "the run's export and `nightshift export` agree");
}
