//! The tokenizer built from the GGUF metadata against llama.cpp's `llama-tokenize` on the same model file
//! (ids recorded in tests/data/tokenizer_smollm2_llamacpp.json), and the chat template against the text llama.cpp
//! tokenized.

use nightshift::job::{ChatTemplateChoice, InputSpec, PromptColumn};
use nightshift::row::{Message, Prompt};
use nightshift::tokenize::Preprocessor;

use crate::support::{model_path, repo};

fn preprocessor(system_prompt: Option<&str>) -> Preprocessor {
    let info = nightshift::engine::models::llama::inspect(&model_path()).unwrap();
    let input = InputSpec {
        url: "unused".into(),
        id_column: None,
        prompt: PromptColumn::Text("prompt".into()),
        system_prompt: system_prompt.map(Into::into),
        truncate: nightshift::job::Truncate::None,
        parameters: Default::default(),
        completion_column: None,
        openai_batch: None,
    };
    Preprocessor::new(&info.vocab, &ChatTemplateChoice::Auto, &input, info.config.context_length, 16).unwrap()
}

fn reference() -> Vec<(String, bool, Vec<u32>)> {
    let path = repo().join("tests/data/tokenizer_smollm2_llamacpp.json");
    let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(data["add_bos"], false);
    data["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect();
            (c["text"].as_str().unwrap().to_string(), c["parse_special"].as_bool().unwrap(), ids)
        })
        .collect()
}

#[test]
fn token_ids_match_llama_cpp() {
    let pre = preprocessor(None);
    let cases = reference();
    assert!(cases.len() >= 20);
    let mut checked = 0;
    for (text, parse_special, ids) in &cases {
        // nightshift always parses special tokens in the text it tokenizes (the rendered chat template), so the
        // cases tokenized without special-token parsing are checked where that makes no difference.
        if !parse_special && text.contains("<|") {
            continue;
        }
        assert_eq!(&pre.encode(text).unwrap(), ids, "token ids differ from llama.cpp for {text:?}");
        checked += 1;
    }
    assert!(checked >= 19, "only {checked} cases checked");
    // The digits rule of the `smollm` pre-tokenizer: every digit is its own token.
    let digits = pre.encode("1234567890").unwrap();
    assert_eq!(digits.len(), 10);
}

#[test]
fn chat_template_renders_as_the_model_expects() {
    let cases = reference();
    let (expected, _, ids) = cases.iter().find(|(t, p, _)| *p && t.starts_with("<|im_start|>system")).unwrap();
    let pre = preprocessor(None);
    let rendered = pre.render(&Prompt::Text("Summarise: the printer on floor 3 is jammed again.".into())).unwrap();
    assert_eq!(&rendered, expected);
    assert_eq!(&pre.encode(&rendered).unwrap(), ids);

    // A system prompt from the job replaces the template's default one; a conversation's own system message wins.
    let pre = preprocessor(Some("Be brief."));
    let rendered = pre.render(&Prompt::Text("Hi".into())).unwrap();
    assert_eq!(rendered, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    let conversation = vec![
        Message { role: "system".into(), content: "Own.".into() },
        Message { role: "user".into(), content: "Hi".into() },
    ];
    let rendered = pre.render(&Prompt::Messages(conversation)).unwrap();
    assert!(rendered.starts_with("<|im_start|>system\nOwn.<|im_end|>"), "{rendered}");
    assert!(!rendered.contains("Be brief."), "{rendered}");
}

#[test]
fn decoding_round_trips_text() {
    let pre = preprocessor(None);
    for (text, _, _) in reference() {
        if text.contains("<|") {
            continue;
        }
        let ids = pre.encode(&text).unwrap();
        assert_eq!(pre.tokenizer().decode(&ids, true), text);
    }
}

#[test]
fn generation_ends_at_the_models_end_of_turn_tokens() {
    let info = nightshift::engine::models::llama::inspect(&model_path()).unwrap();
    let rules = nightshift::engine::StopRules::new(&info.vocab);
    // llama.cpp's end-of-generation set for this model: 0 <|endoftext|>, 2 <|im_end|> and 4 <reponame> (a
    // fill-in-the-middle token, an end token wherever llama.cpp finds one).
    let mut ends: Vec<u32> = rules.end_tokens.into_iter().collect();
    ends.sort();
    assert_eq!(ends, vec![0, 2, 4]);
}

// Hostile chat templates (a template is a program from the model file): bounded work, output and memory.

/// A tiny Hugging Face model directory whose tokenizer_config.json carries `template`, and a job over `prompts`.
pub(crate) fn model_with_template(name: &str, template: &str, texts: &[&str], runtime: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use crate::support::*;
    let dir = scratch(name);
    let model = dir.join("model");
    write_tiny_hf_model(&model, HfVariant::SmolLm);
    let config = model.join("tokenizer_config.json");
    let mut value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    value["chat_template"] = serde_json::Value::String(template.into());
    std::fs::write(&config, value.to_string()).unwrap();
    let ids: Vec<String> = (0..texts.len()).map(|i| format!("r{i}")).collect();
    write_parquet(&dir.join("in.parquet"), prompts(&ids, texts));
    let out = dir.join("out");
    let job = dir.join("job.toml");
    std::fs::write(
        &job,
        format!(
            "[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 4\n[output]\nurl = {:?}\n[runtime]\n{runtime}\n",
            dir.join("in.parquet").to_str().unwrap(),
            model.to_str().unwrap(),
            out.to_str().unwrap()
        ),
    )
    .unwrap();
    (job, out)
}

pub(crate) const CHATML_TURNS: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n";

#[test]
fn a_chat_template_past_its_limits_stops_validate_and_run_with_exit_4_naming_it() {
    use crate::support::*;
    let cases = [
        // Nested loops: 8.1e9 iterations; fuel ends it.
        ("spin", "{% for i in range(90000) %}{% for j in range(90000) %}{% endfor %}{% endfor %}", "instructions"),
        // A string doubled forty times, kept across iterations in a namespace: the memory limit ends it.
        ("double", "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", "memory"),
        // A hundred million bytes written: the output limit ends it.
        ("write", "{% for i in range(10) %}{{ 'x' * 10000000 }}{% endfor %}", "output"),
    ];
    for (name, template, limit) in cases {
        let (job, out) = model_with_template(&format!("template-{name}"), template, &["hello"], "");
        for verb in ["validate", "run"] {
            let run = nightshift(&[verb, job.to_str().unwrap()], &[]);
            assert_eq!(run.code, 4, "{name}: {verb}\n{}", run.stderr);
            assert!(run.stderr.contains("chat template") && run.stderr.contains(limit) && run.stderr.contains("model"), "{name}: {verb}: {}", run.stderr);
            assert!(!out.join("_SUCCESS").exists());
        }
    }
}

#[test]
fn a_chat_template_past_its_limits_on_one_row_fails_that_row_and_the_job_goes_on() {
    use crate::support::*;
    // Fuel: only the row that says `spin` loops.
    let template = format!("{{% if messages[-1]['content'] == 'spin' %}}{{% for i in range(90000) %}}{{% for j in range(90000) %}}{{% endfor %}}{{% endfor %}}{{% endif %}}{CHATML_TURNS}");
    let (job, out) = model_with_template("template-row-spin", &template, &["hello", "spin", "world"], "");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows["r0"].status, "succeeded");
    assert_eq!(rows["r1"].error_code.as_deref(), Some("template_error"));
    assert!(rows["r1"].error_message.as_deref().unwrap().contains("instructions"), "{:?}", rows["r1"]);
    assert_eq!(rows["r2"].status, "succeeded");

    // Memory: the row that says `double` doubles a string forty times. The process survives it; the template is
    // not run again, so rows prepared after it fail too, and the job still completes.
    let template = format!("{{% if messages[-1]['content'] == 'double' %}}{{% set ns = namespace(s='abcdefgh') %}}{{% for i in range(40) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{{{ ns.s|length }}}}{{% endif %}}{CHATML_TURNS}");
    let (job, out) = model_with_template("template-row-double", &template, &["hello", "double"], "");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows["r1"].error_code.as_deref(), Some("template_error"));
    assert!(rows["r1"].error_message.as_deref().unwrap().contains("memory limit"), "{:?}", rows["r1"]);
    assert!(out.join("_SUCCESS").exists());
}

#[test]
fn a_prompt_the_template_renders_to_nothing_is_an_empty_prompt_row() {
    use crate::support::*;
    let template = format!("{{% if messages[-1]['content'] != 'nothing' %}}{CHATML_TURNS}{{% endif %}}");
    let (job, out) = model_with_template("template-empty", &template, &["hello", "nothing"], "");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows["r0"].status, "succeeded");
    assert_eq!(rows["r1"].error_code.as_deref(), Some("empty_prompt"), "{:?}", rows["r1"]);
}

// Every GGUF tokenizer against llama.cpp: the texts and token id sequences `scripts/compare-tokenizers.py` kept
// with llama.cpp's answers (tests/data/tokenizers/), and llama.cpp's own test texts and ids (its `.inp`/`.out`
// files, fetched with its vocabularies by scripts/fetch-models.sh).

fn llama_vocab_dir() -> std::path::PathBuf {
    repo().join("models/llama.cpp/models")
}

/// The vocabulary a test data file names: a file of llama.cpp's, a model of ours, or a relabelled copy of one of
/// llama.cpp's (its `tokenizer.ggml.pre` replaced), built from the same keys as the peer's copy.
fn vocabulary_of(data: &serde_json::Value) -> nightshift::tokenize::gguf::Vocab {
    use nightshift::engine::models::llama::gguf::read_tokenizer;
    let path = match (data["file"].as_str(), data["base"].as_str()) {
        (Some(file), _) if file.starts_with("ggml-vocab-") => llama_vocab_dir().join(file),
        (Some(file), _) => repo().join("models").join(file),
        (None, Some(base)) => llama_vocab_dir().join(format!("ggml-vocab-{base}.gguf")),
        _ => panic!("test data names no vocabulary: {}", data["vocabulary"]),
    };
    let (mut meta, _) = read_tokenizer(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if let Some(pre) = data["pre"].as_str() {
        meta.pre = Some(pre.to_string());
    }
    nightshift::tokenize::gguf::Vocab::new(&meta).unwrap()
}

/// Two vocabulary headers (scripts/llama-peer.cpp's first line) agree: size, BOS, EOS and the end-of-generation
/// tokens exactly; the EOT ids may be two different candidates, both ending generation (llama.cpp takes the first
/// its hash map visits of `<|eot_id|>`, `<|im_end|>`, `<|endoftext|>`, ...; see `tokenize::gguf`).
pub(crate) fn same_header(ours: &str, theirs: &str) -> bool {
    let (o, t): (Vec<&str>, Vec<&str>) = (ours.split('\t').collect(), theirs.split('\t').collect());
    let eog: Vec<&str> = t[4].split(' ').collect();
    o[..3] == t[..3] && o[4] == t[4] && (o[3] == t[3] || (eog.contains(&o[3]) && eog.contains(&t[3])))
}

#[test]
fn gguf_tokenizers_match_llama_cpp_token_for_token_and_byte_for_byte() {
    let dir = repo().join("tests/data/tokenizers");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let (mut vocabularies, mut lines) = (0, 0);
    let mut kinds = std::collections::BTreeSet::new();
    for file in files {
        let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = data["vocabulary"].as_str().unwrap();
        let vocab = vocabulary_of(&data);
        kinds.insert(format!("{:?}", vocab.kind()));
        let header = nightshift::cli::peer_header(&vocab);
        assert!(same_header(&header, data["header"].as_str().unwrap()), "{name}: size, BOS, EOS, EOT, end-of-generation tokens: {header:?}, llama.cpp {}", data["header"]);
        for line in data["lines"].as_array().unwrap() {
            let (input, expected) = (line["in"].as_str().unwrap(), line["out"].as_str().unwrap());
            let ours = nightshift::cli::peer_line(&vocab, input).unwrap();
            assert_eq!(ours, expected, "{name}: input {input} (ids, ids with specials, text, text with specials, pieces; see scripts/llama-peer.cpp)");
            lines += 1;
        }
        vocabularies += 1;
    }
    // llama.cpp's 19 vocabulary files, SmolLM2's, and the relabelled ones; every tokenizer kind.
    assert!(vocabularies >= 40 && lines >= 40 * 50, "{vocabularies} vocabularies, {lines} lines");
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), ["Bpe", "Spm", "Ugm", "Wpm"]);
}

#[test]
fn gguf_tokenizers_pass_llama_cpps_own_tokenizer_tests() {
    let mut checked = 0;
    for entry in std::fs::read_dir(llama_vocab_dir()).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".gguf.inp")) else { continue };
        let gguf = llama_vocab_dir().join(format!("{name}.gguf"));
        let vocab = nightshift::engine::models::llama::gguf::vocabulary(&gguf).unwrap();
        let vocab = vocab.gguf.as_deref().unwrap();
        let texts = std::fs::read_to_string(&path).unwrap();
        let texts: Vec<&str> = texts.split("\n__ggml_vocab_test__\n").collect();
        let ids = std::fs::read_to_string(llama_vocab_dir().join(format!("{name}.gguf.out"))).unwrap();
        let ids: Vec<&str> = ids.split('\n').collect();
        // test-tokenizer-0: add_special and parse_special off; one line of ids per text.
        for (text, expected) in texts.iter().zip(&ids).take(texts.len() - 1) {
            let ours: Vec<String> = vocab.tokenize(text.as_bytes(), false, false).unwrap().iter().map(u32::to_string).collect();
            let expected: Vec<&str> = expected.split_whitespace().collect();
            assert_eq!(ours, expected, "{name}: {text:?}");
            checked += 1;
        }
    }
    assert!(checked >= 16 * 40, "{checked} texts");
}

/// The llama.cpp peer (scripts/build-peer.sh; scripts/test.sh builds it and sets `NIGHTSHIFT_LLAMA_PEER`), or None
/// when the suite runs without it (then the tests that need it say so and pass).
pub(crate) fn llama_peer() -> Option<std::path::PathBuf> {
    match std::env::var_os("NIGHTSHIFT_LLAMA_PEER") {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            assert!(path.is_file(), "NIGHTSHIFT_LLAMA_PEER names {}, which is not there: run scripts/build-peer.sh", path.display());
            Some(path)
        }
        None => {
            eprintln!("skipped: NIGHTSHIFT_LLAMA_PEER is not set (scripts/build-peer.sh builds llama.cpp's peer; scripts/test.sh sets it)");
            None
        }
    }
}

#[test]
fn gguf_tokenizers_match_llama_cpp_on_a_fresh_corpus() {
    let Some(peer) = llama_peer() else { return };
    // Every vocabulary file of llama.cpp's, SmolLM2's, and three pre-tokenizers no published file carries on a real
    // vocabulary: 200 texts and 40 token id sequences each, drawn anew from the corpus generator.
    let out = std::process::Command::new("python3")
        .arg(repo().join("scripts/compare-tokenizers.py"))
        .args(["--peer", peer.to_str().unwrap(), "--nightshift", env!("CARGO_BIN_EXE_nightshift")])
        .args(["--vocab-dir", "models/llama.cpp/models", "--model", "models/SmolLM2-135M-Instruct.Q4_1.gguf"])
        .args(["--relabel", "--relabel-only", "tekken,gpt-4o,deepseek-v3", "--texts", "200", "--id-sequences", "40"])
        .env("PYTHONPATH", repo().join("models/llama.cpp/gguf-py"))
        .current_dir(repo())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "nightshift and llama.cpp differ:\n{stdout}\n{stderr}");
    let rows = stdout.lines().filter(|l| l.ends_with("| 40/40 |") && l.contains("| 200 | 200 | 200 | 200 | 200 | 200 |")).count();
    assert!(rows >= 23, "{rows} vocabularies compared identical:\n{stdout}");
}
