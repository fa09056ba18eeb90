//! Seeded mutation fuzzing of every parser of untrusted bytes: GGUF files, a Hugging Face directory's
//! config.json, tokenizer.json, tokenizer_config.json and safetensors header, chat templates, Parquet inputs, and an
//! output's plan, commit markers and manifest. Each case mutates a valid file a few times (bit flips, interesting
//! integers over 1, 2, 4 or 8 bytes, truncation, deleted and repeated runs of bytes) and reads it as nightshift
//! does; a case passes if the read returns (an error or a value) without a panic, and in bounded time. Memory is
//! bounded by construction: a huge allocation would abort the whole test binary.
//!
//! The suite runs a few thousand cases in well under a minute; `NIGHTSHIFT_FUZZ_SCALE=N` runs N times as many
//! (with other seeds: `NIGHTSHIFT_FUZZ_SEED`), the documented longer run.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::Device;
use nightshift::engine::models::llama;
use nightshift::row::Message;
use nightshift::tokenize::ChatTemplate;

use crate::support::*;

/// splitmix64: small, seeded, the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 12] = [0, 1, 2, 0x7f, 0x80, 0xff, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff, 0x7fff_ffff_ffff_ffff, u64::MAX, 1 << 40];

/// One to four mutations of `bytes`, each inside `focus` (a byte range) with probability 3/4.
fn mutate(rng: &mut Rng, bytes: &[u8], focus: std::ops::Range<usize>) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for _ in 0..1 + rng.below(4) {
        if out.is_empty() {
            out.push(rng.next() as u8);
            continue;
        }
        let at = if rng.below(4) > 0 && focus.end.min(out.len()) > focus.start {
            focus.start + rng.below(focus.end.min(out.len()) - focus.start)
        } else {
            rng.below(out.len())
        };
        match rng.below(7) {
            0 => out[at] ^= 1 << rng.below(8),
            1 => out[at] = rng.next() as u8,
            2 => {
                let width = [1, 2, 4, 8][rng.below(4)];
                let value = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                for (i, b) in value.iter().take(width).enumerate() {
                    if let Some(slot) = out.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            3 => out.truncate(at),
            4 => {
                let end = (at + 1 + rng.below(64)).min(out.len());
                out.drain(at..end);
            }
            5 => {
                let end = (at + 1 + rng.below(64)).min(out.len());
                let run = out[at..end].to_vec();
                out.splice(at..at, run);
            }
            _ => {
                // A printable byte: JSON and templates stay text more often.
                out[at] = b" {}[]\":,0123456789aez%-"[rng.below(23)];
            }
        }
    }
    out
}

fn scale() -> usize {
    std::env::var("NIGHTSHIFT_FUZZ_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

fn seed(target: u64) -> u64 {
    let base = std::env::var("NIGHTSHIFT_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6e69_6768_7473_6869);
    base ^ target.wrapping_mul(0x100_0000_01b3)
}

/// Tallies of one target's cases.
#[derive(Default, Debug)]
struct Tally {
    cases: usize,
    accepted: usize,
    refused: usize,
    slowest: Duration,
}

/// Runs `cases` mutations of `base` through `read` (`Ok(true)`: the bytes were accepted), failing on a panic or a
/// case slower than a generous bound (a hang), naming the case so that it can be replayed.
fn fuzz(target: &str, id: u64, cases: usize, base: &[u8], focus: std::ops::Range<usize>, mut read: impl FnMut(&[u8]) -> bool) -> Tally {
    let mut rng = Rng(seed(id));
    let mut tally = Tally::default();
    for case in 0..cases * scale() {
        let bytes = mutate(&mut rng, base, focus.clone());
        let started = Instant::now();
        let accepted = std::panic::catch_unwind(AssertUnwindSafe(|| read(&bytes)));
        let took = started.elapsed();
        let accepted = accepted.unwrap_or_else(|_| {
            let path = repo().join(format!("target/fuzz-{target}-{case}.bin"));
            std::fs::write(&path, &bytes).unwrap();
            panic!("{target}: case {case} panicked; its bytes are in {}", path.display())
        });
        assert!(took < Duration::from_secs(20), "{target}: case {case} took {took:?}");
        tally.cases += 1;
        tally.slowest = tally.slowest.max(took);
        if accepted {
            tally.accepted += 1;
        } else {
            tally.refused += 1;
        }
    }
    eprintln!("fuzz {target}: {tally:?}");
    tally
}

/// The byte length of a GGUF file's header (metadata and tensor infos), where most mutations go.
fn gguf_header_len(path: &Path) -> usize {
    let mut file = std::fs::File::open(path).unwrap();
    candle_core::quantized::gguf_file::Content::read(&mut file).unwrap().tensor_data_offset as usize
}

#[test]
fn gguf_files() {
    let dir = scratch("fuzz-gguf");
    let pristine = dir.join("tiny.gguf");
    write_tiny_model(&pristine);
    let base = std::fs::read(&pristine).unwrap();
    let header = gguf_header_len(&pristine);
    let path = dir.join("case.gguf");
    let tally = fuzz("gguf", 1, 1500, &base, 0..header, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        // As `validate` and `run` read a model: its metadata, then its weights.
        llama::inspect(&path).is_ok() && llama::Model::load(&path, &Device::Cpu).is_ok()
    });
    // The mutations hit: most cases are refused, and some harmless ones (in tensor data or a name) still load.
    assert!(tally.refused > tally.cases / 4 && tally.accepted > 0, "{tally:?}");
}

#[test]
fn t5_gguf_files() {
    use nightshift::engine::models::t5::T5;
    let dir = scratch("fuzz-t5-gguf");
    let model = dir.join("t5");
    let shape = nightshift::synth::t5::T5Shape { name: "tiny", vocab: 40, d_model: 32, d_kv: 8, heads: 2, d_ff: 32, layers: 1, decoder_layers: 1, gated: true, buckets: 8 };
    nightshift::synth::t5::write_t5(&model, &shape, 3, false).unwrap();
    let (pristine, _) = nightshift::synth::t5::t5_gguf(&model, candle_core::quantized::GgmlDType::F32, None).unwrap();
    let base = std::fs::read(&pristine).unwrap();
    let header = gguf_header_len(&pristine);
    let path = dir.join("case.gguf");
    // As a seq2seq job reads it: the shape, the vocabulary, then the weights.
    let tally = fuzz("t5-gguf", 2, 600, &base, 0..header, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        T5::inspect(&path).is_ok() && llama::gguf::vocabulary(&path).is_ok() && T5::load(&path, &Device::Cpu).is_ok()
    });
    assert!(tally.refused > tally.cases / 4 && tally.accepted > 0, "{tally:?}");
}

#[test]
fn hugging_face_directories() {
    let dir = scratch("fuzz-hf");
    let model = dir.join("model");
    write_tiny_hf_model(&model, HfVariant::Qwen2);
    for (id, (file, cases)) in [("config.json", 300), ("tokenizer.json", 300), ("tokenizer_config.json", 200), ("model.safetensors", 400)].into_iter().enumerate() {
        let path = model.join(file);
        let base = std::fs::read(&path).unwrap();
        let focus = match file {
            // The safetensors header: its length, then its JSON.
            "model.safetensors" => 0..8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize,
            _ => 0..base.len(),
        };
        let tally = fuzz(file, 10 + id as u64, cases, &base, focus, |bytes| {
            std::fs::write(&path, bytes).unwrap();
            llama::inspect(&model).is_ok() && llama::Model::load(&model, &Device::Cpu).is_ok()
        });
        assert!(tally.refused > 0, "{file}: {tally:?}");
        std::fs::write(&path, &base).unwrap();
    }
    llama::inspect(&model).unwrap();
}

#[test]
fn chat_templates() {
    // The real model's template, and a ChatML one with the constructs templates use.
    let real = llama::inspect(&model_path()).unwrap().vocab.chat_template.unwrap();
    let chatml = "{% set ns = namespace(first=true) %}{% for message in messages %}{% if message['role'] == 'system' and ns.first %}{{ bos_token }}{% endif %}{% set ns.first = false %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ raise_exception('no') }}{% endif %}";
    let conversation = [
        Message { role: "system".into(), content: "Be brief.".into() },
        Message { role: "user".into(), content: "What is 2 + 2?".into() },
    ];
    for (id, source) in [real.as_str(), chatml].into_iter().enumerate() {
        fuzz(&format!("template-{id}"), 20 + id as u64, 400, source.as_bytes(), 0..source.len(), |bytes| {
            let source = String::from_utf8_lossy(bytes);
            match ChatTemplate::new(&source, "<s>".into(), "</s>".into()) {
                Ok(template) => template.render(&conversation).is_ok(),
                Err(_) => false,
            }
        });
    }
}

#[test]
fn parquet_inputs() {
    use nightshift::job::{InputSpec, PromptColumn, Truncate};
    use nightshift::plan::Unit;
    use nightshift::source::Input;
    let dir = scratch("fuzz-parquet");
    let pristine = dir.join("base.parquet");
    let ids: Vec<String> = (0..40).map(|i| format!("row-{i}")).collect();
    let texts: Vec<String> = (0..40).map(|i| format!("prompt number {i}: summarise this ticket")).collect();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    write_parquet_groups(&pristine, prompts(&ids, &texts), Some(16));
    let base = std::fs::read(&pristine).unwrap();
    let path = dir.join("case.parquet");
    let spec = InputSpec {
        url: path.to_str().unwrap().into(),
        id_column: Some("id".into()),
        prompt: PromptColumn::Text("prompt".into()),
        system_prompt: None,
        truncate: Truncate::None,
        parameters: Default::default(),
        completion_column: None,
        openai_batch: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // The footer (its metadata, then its length and magic) is where a reader trusts declared sizes.
    let footer = base.len() - 8 - u32::from_le_bytes(base[base.len() - 8..base.len() - 4].try_into().unwrap()) as usize;
    let tally = fuzz("parquet", 30, 600, &base, footer..base.len(), |bytes| {
        std::fs::write(&path, bytes).unwrap();
        rt.block_on(async {
            let Ok(input) = Input::open(&spec).await else { return false };
            if input.check_whole().await.is_err() {
                return false;
            }
            // Every row, as a run reads them: declared row counts are not trusted beyond what the file holds.
            let rows = input.total_rows().min(u32::MAX as u64) as u32;
            let unit = Unit { id: 0, file: 0, first_row: 0, rows, shard: 0, estimated_tokens: 0 };
            let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
            let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
            let read = input.stream_unit(&unit, &tx).await;
            drop(tx);
            drain.await.unwrap();
            read.is_ok()
        })
    });
    assert!(tally.refused > 0, "{tally:?}");
}

/// Every file under `dir`, relative path to bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

fn restore(dir: &Path, files: &BTreeMap<PathBuf, Vec<u8>>) {
    let _ = std::fs::remove_dir_all(dir);
    for (relative, bytes) in files {
        let path = dir.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

#[test]
fn output_metadata() {
    use nightshift::sink::Output;
    let dir = scratch("fuzz-output");
    let model = dir.join("tiny.gguf");
    write_tiny_model(&model);
    let input = dir.join("in.parquet");
    let ids: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
    write_parquet(&input, prompts(&ids, &["a", "b", "c", "d", "e", "f"]));
    let out = dir.join("out");
    let job = job_file(&dir, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 2", "");
    // Three units, so that there are several commit markers.
    let job_text = std::fs::read_to_string(&job).unwrap().replace("[output]\nurl", "[output]\nunit_rows = 2\nurl");
    std::fs::write(&job, job_text).unwrap();
    nightshift(&["run", job.to_str().unwrap(), "--model", model.to_str().unwrap()], &[]).assert_ok();
    let pristine = snapshot(&out);
    let first_under = |dir: &str| pristine.keys().find(|p| p.starts_with(dir)).unwrap_or_else(|| panic!("a file under {dir}")).clone();
    let (marker, metrics, results) = (first_under("_commits"), first_under("metrics"), first_under("data"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for (id, file) in [PathBuf::from("_plan.json"), marker, PathBuf::from("_manifest.json"), metrics, results].into_iter().enumerate() {
        let base = pristine[&file].clone();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let tally = fuzz(&format!("output {name}"), 40 + id as u64, 300, &base, 0..base.len(), |bytes| {
            restore(&out, &pristine);
            std::fs::write(out.join(&file), bytes).unwrap();
            rt.block_on(async {
                let output = Output::resolve(out.to_str().unwrap()).unwrap();
                // What run, status, report and finalize read.
                let plan = output.read_plan().await;
                let status = output.status().await;
                let report = output.report_data(false).await;
                let manifest = output.read_manifest().await;
                let units = output.verified_committed_units().await;
                let whole = output.is_complete_and_whole().await;
                plan.is_ok() && status.is_ok() && report.is_ok() && manifest.is_ok() && units.is_ok() && whole.is_ok()
            })
        });
        assert!(tally.refused > 0, "{name}: {tally:?}");
    }
}
