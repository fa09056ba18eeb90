//! Helpers for the end-to-end tests: run the real binary, write input Parquet, read the results back.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, UInt32Type};
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_path() -> PathBuf {
    let path = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/fetch-models.sh", path.display());
    path
}

/// A fresh directory under the target directory, removed first if a previous run left it.
pub fn scratch(name: &str) -> PathBuf {
    let dir = repo().join("target/test-scratch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn assert_ok(&self) -> &Self {
        assert_eq!(self.code, 0, "nightshift failed\nstdout:\n{}\nstderr:\n{}", self.stdout, self.stderr);
        self
    }
}

pub fn nightshift(args: &[&str], envs: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nightshift"));
    cmd.args(args).current_dir(repo()).env("RUST_LOG", "warn");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let Output { status, stdout, stderr } = cmd.output().expect("nightshift runs");
    Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

/// Writes a job file; `extra_generation` and `extra` are appended to the [generation] section and the end.
pub fn job_file(dir: &Path, input: &str, output: &str, generation: &str, extra: &str) -> PathBuf {
    let path = dir.join("job.toml");
    let text = format!(
        "[input]\nurl = {input:?}\nid_column = \"id\"\n\n[model]\npath = {:?}\n\n[generation]\n{generation}\n\n[output]\nurl = {output:?}\n\n{extra}\n",
        model_path().to_string_lossy()
    );
    std::fs::write(&path, text).unwrap();
    path
}

pub fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>) {
    write_parquet_groups(path, columns, None)
}

/// Writes Parquet with row groups of at most `group_rows` rows (the writer's default when `None`).
pub fn write_parquet_groups(path: &Path, columns: Vec<(&str, ArrayRef)>, group_rows: Option<usize>) {
    let fields: Vec<Field> = columns.iter().map(|(n, a)| Field::new(*n, a.data_type().clone(), true)).collect();
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns.into_iter().map(|(_, a)| a).collect()).unwrap();
    let props = parquet::file::properties::WriterProperties::builder().set_max_row_group_row_count(group_rows).build();
    let mut writer = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

pub fn strings(values: &[Option<&str>]) -> ArrayRef {
    Arc::new(arrow::array::StringArray::from(values.to_vec()))
}

pub fn prompts(ids: &[String], prompts: &[&str]) -> Vec<(&'static str, ArrayRef)> {
    vec![
        ("id", strings(&ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())),
        ("prompt", strings(&prompts.iter().map(|s| Some(*s)).collect::<Vec<_>>())),
    ]
}

#[derive(Clone, Debug, PartialEq)]
pub struct ResultRow {
    pub id: String,
    pub status: String,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub text: Option<String>,
    pub finish_reason: String,
    pub prompt_tokens: Option<u32>,
    pub completion_tokens: u32,
}

/// Reads result rows from Parquet bytes, keyed by id (asserting ids are unique).
pub fn parse_results(bytes: bytes::Bytes) -> BTreeMap<String, ResultRow> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap().build().unwrap();
    let mut rows = BTreeMap::new();
    for batch in reader {
        let batch = batch.unwrap();
        let s = |name: &str| batch.column_by_name(name).unwrap().as_string::<i32>().clone();
        let (id, status, text, finish) = (s("id"), s("status"), s("text"), s("finish_reason"));
        let error = batch.column_by_name("error").unwrap().as_struct().clone();
        let code = error.column_by_name("code").unwrap().as_string::<i32>().clone();
        let message = error.column_by_name("message").unwrap().as_string::<i32>().clone();
        let prompt_tokens = batch.column_by_name("prompt_tokens").unwrap().as_primitive::<UInt32Type>().clone();
        let completion_tokens = batch.column_by_name("completion_tokens").unwrap().as_primitive::<UInt32Type>().clone();
        for i in 0..batch.num_rows() {
            let opt = |a: &arrow::array::StringArray| (!a.is_null(i)).then(|| a.value(i).to_string());
            let row = ResultRow {
                id: id.value(i).to_string(),
                status: status.value(i).to_string(),
                error_code: (!error.is_null(i)).then(|| code.value(i).to_string()),
                error_message: (!error.is_null(i)).then(|| message.value(i).to_string()),
                text: opt(&text),
                finish_reason: finish.value(i).to_string(),
                prompt_tokens: (!prompt_tokens.is_null(i)).then(|| prompt_tokens.value(i)),
                completion_tokens: completion_tokens.value(i),
            };
            assert!(rows.insert(row.id.clone(), row).is_none(), "duplicate id in results");
        }
    }
    rows
}

/// Reads a local output through its manifest: every committed result file, in unit order.
pub fn read_results(out: &Path) -> BTreeMap<String, ResultRow> {
    OutputStore::local(out).results()
}

/// Result rows of a local output as JSON objects (nested columns included; nulls left out), keyed by id.
pub fn read_results_json(out: &Path) -> BTreeMap<String, serde_json::Value> {
    OutputStore::local(out).results_json()
}

/// The metrics row of a local output that has exactly one unit, as (column, value as f64).
pub fn read_metrics(out: &Path) -> BTreeMap<String, Option<f64>> {
    let mut rows = OutputStore::local(out).metrics();
    assert_eq!(rows.len(), 1, "expected one unit");
    rows.remove(0)
}

fn metrics_rows(bytes: bytes::Bytes) -> Vec<BTreeMap<String, Option<f64>>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap().build().unwrap();
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.unwrap();
        for i in 0..batch.num_rows() {
            let mut out = BTreeMap::new();
            for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
                let value = match column.data_type() {
                    DataType::UInt64 => Some(column.as_primitive::<arrow::datatypes::UInt64Type>().value(i) as f64),
                    DataType::Float64 => {
                        let a = column.as_primitive::<arrow::datatypes::Float64Type>();
                        (!a.is_null(i)).then(|| a.value(i))
                    }
                    DataType::Utf8 => continue,
                    other => panic!("unexpected metrics type {other}"),
                };
                out.insert(field.name().clone(), value);
            }
            rows.push(out);
        }
    }
    rows
}

/// An output location read back with object_store, the same way for a local directory and for S3.
pub struct OutputStore {
    store: Arc<dyn ObjectStore>,
    root: ObjectPath,
    rt: tokio::runtime::Runtime,
}

impl OutputStore {
    pub fn local(dir: &Path) -> OutputStore {
        let absolute = std::path::absolute(dir).unwrap();
        OutputStore::new(Arc::new(object_store::local::LocalFileSystem::new()), ObjectPath::from_absolute_path(&absolute).unwrap())
    }

    /// A prefix in a bucket of a moto server.
    pub fn s3(moto: &Moto, bucket: &str, prefix: &str) -> OutputStore {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&moto.endpoint)
            .with_allow_http(true)
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .with_region("us-east-1")
            .with_bucket_name(bucket)
            .build()
            .unwrap();
        OutputStore::new(Arc::new(store), ObjectPath::from(prefix))
    }

    fn new(store: Arc<dyn ObjectStore>, root: ObjectPath) -> OutputStore {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        OutputStore { store, root, rt }
    }

    fn path(&self, relative: &str) -> ObjectPath {
        relative.split('/').fold(self.root.clone(), |p, part| p.join(part))
    }

    pub fn get(&self, relative: &str) -> Option<bytes::Bytes> {
        self.rt.block_on(async {
            match self.store.get(&self.path(relative)).await {
                Ok(r) => Some(r.bytes().await.unwrap()),
                Err(object_store::Error::NotFound { .. }) => None,
                Err(e) => panic!("cannot read {relative}: {e}"),
            }
        })
    }

    pub fn put(&self, relative: &str, bytes: Vec<u8>) {
        self.rt.block_on(self.store.put(&self.path(relative), bytes.into())).unwrap();
    }

    pub fn delete(&self, relative: &str) {
        self.rt.block_on(self.store.delete(&self.path(relative))).unwrap();
    }

    pub fn exists(&self, relative: &str) -> bool {
        self.get(relative).is_some()
    }

    /// Paths (relative to the root) of the visible objects under `relative`, sorted.
    pub fn list(&self, relative: &str) -> Vec<String> {
        let prefix = self.path(relative);
        let mut names: Vec<String> = self.rt.block_on(async {
            self.store
                .list(Some(&prefix))
                .map_ok(|m| m.location.prefix_match(&self.root).unwrap().map(|p| p.as_ref().to_string()).collect::<Vec<_>>().join("/"))
                .try_collect()
                .await
                .unwrap_or_default()
        });
        names.sort();
        names
    }

    pub fn manifest(&self) -> serde_json::Value {
        assert!(self.exists("_SUCCESS"), "the output has no _SUCCESS");
        serde_json::from_slice(&self.get("_manifest.json").expect("_SUCCESS without _manifest.json")).unwrap()
    }

    /// Every result row named by the manifest, asserting ids are unique across files.
    pub fn results(&self) -> BTreeMap<String, ResultRow> {
        let manifest = self.manifest();
        let mut rows = BTreeMap::new();
        for file in manifest["results"].as_array().unwrap() {
            for (id, row) in parse_results(self.get(file.as_str().unwrap()).expect("a manifest file is missing")) {
                assert!(rows.insert(id.clone(), row).is_none(), "id {id} appears in two result files");
            }
        }
        assert_eq!(rows.len() as u64, manifest["rows"].as_u64().unwrap());
        rows
    }

    /// The ids in the order the manifest's files hold them.
    pub fn ids_in_order(&self) -> Vec<String> {
        let manifest = self.manifest();
        let mut ids = Vec::new();
        for file in manifest["results"].as_array().unwrap() {
            let reader = ParquetRecordBatchReaderBuilder::try_new(self.get(file.as_str().unwrap()).unwrap()).unwrap().build().unwrap();
            for batch in reader {
                let batch = batch.unwrap();
                let id = batch.column_by_name("id").unwrap().as_string::<i32>().clone();
                ids.extend((0..batch.num_rows()).map(|i| id.value(i).to_string()));
            }
        }
        ids
    }

    pub fn metrics(&self) -> Vec<BTreeMap<String, Option<f64>>> {
        let manifest = self.manifest();
        manifest["metrics"].as_array().unwrap().iter().flat_map(|f| metrics_rows(self.get(f.as_str().unwrap()).unwrap())).collect()
    }

    /// Every result row named by the manifest as JSON (nested columns included), keyed by id.
    pub fn results_json(&self) -> BTreeMap<String, serde_json::Value> {
        let manifest = self.manifest();
        let mut rows = BTreeMap::new();
        for file in manifest["results"].as_array().unwrap() {
            let reader = ParquetRecordBatchReaderBuilder::try_new(self.get(file.as_str().unwrap()).unwrap()).unwrap().build().unwrap();
            for batch in reader {
                let mut writer = arrow::json::ArrayWriter::new(Vec::new());
                writer.write(&batch.unwrap()).unwrap();
                writer.finish().unwrap();
                let values: Vec<serde_json::Value> = serde_json::from_slice(&writer.into_inner()).unwrap();
                for v in values {
                    rows.insert(v["id"].as_str().unwrap().to_string(), v);
                }
            }
        }
        rows
    }

    /// The first result file named by the manifest (for its metadata).
    pub fn first_results_file(&self) -> bytes::Bytes {
        let manifest = self.manifest();
        self.get(manifest["results"][0].as_str().unwrap()).unwrap()
    }
}

/// Key/value metadata of Parquet bytes.
pub fn kv_metadata_of(bytes: bytes::Bytes) -> BTreeMap<String, String> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
    builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .into_iter()
        .flatten()
        .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
        .collect()
}

/// Deterministic pseudo-random tensors (xorshift64), uniform in `[-scale, scale]`, for random-weight test models.
pub struct RandomTensors(u64);

impl RandomTensors {
    pub fn new(seed: u64) -> Self {
        RandomTensors(seed | 1)
    }

    pub fn tensor(&mut self, dims: &[usize], scale: f32) -> candle_core::Tensor {
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        candle_core::Tensor::from_vec(values, dims, &candle_core::Device::Cpu).unwrap()
    }
}

impl OutputStore {
    /// Every result batch of a committed output, in manifest order.
    pub fn result_batches(&self) -> Vec<RecordBatch> {
        let manifest = self.manifest();
        let mut batches = Vec::new();
        for file in manifest["results"].as_array().unwrap() {
            let bytes = self.get(file.as_str().unwrap()).expect("a manifest file is missing");
            batches.extend(ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap().build().unwrap().map(|b| b.unwrap()));
        }
        batches
    }
}

/// ChatML, as the tiny models' chat template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The tiny models' vocabulary: GPT-2's 256 byte tokens, three merges, then `<|endoftext|>`, `<|im_start|>` and
/// `<|im_end|>` as control tokens (ids 259 to 261).
pub struct TinyVocab {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    /// GGUF token types: 1 normal, 3 control.
    pub token_types: Vec<i32>,
}

pub fn tiny_vocab() -> TinyVocab {
    // GPT-2's byte-to-character mapping: printable bytes map to themselves, the others to U+0100 and up.
    let mut tokens = Vec::new();
    let mut next = 256u32;
    for b in 0u32..256 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        tokens.push(char::from_u32(if printable { b } else { let c = next; next += 1; c }).unwrap().to_string());
    }
    let merges = ["Ġ t", "h e", "Ġ a"];
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    tokens.extend(specials.iter().map(|s| s.to_string()));
    let mut token_types = vec![1i32; tokens.len() - specials.len()];
    token_types.extend([3, 3, 3]);
    TinyVocab { tokens, merges: merges.iter().map(|m| m.to_string()).collect(), token_types }
}

/// A tiny llama model with random weights, written as GGUF (Q8_0 matrices, the layout the real model runs in),
/// with a byte-level BPE vocabulary of the 256 byte tokens, a few merges, ChatML control tokens and a ChatML
/// template. Its outputs are noise, but deterministic: fast for tests of batching, commits and resuming.
pub fn write_tiny_model(path: &Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let (d, layers, heads, kv_heads, ff) = (64usize, 2usize, 4usize, 2usize, 128usize);
    let hd = d / heads;

    let TinyVocab { tokens, merges, token_types: types, .. } = tiny_vocab();
    let eos = tokens.len() as u32 - 3;
    let vocab = tokens.len();

    let mut rng = RandomTensors::new(0x9e3779b97f4a7c15);
    let mut random = |rows: usize, cols: usize, scale: f32| -> Tensor { rng.tensor(&[rows, cols], scale) };
    let q8 = |t: Tensor| QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
    let ones = || QTensor::quantize(&Tensor::ones(d, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    let mut tensors: Vec<(String, QTensor)> = vec![("token_embd.weight".into(), q8(random(vocab, d, 1.0)))];
    for i in 0..layers {
        let s = 1.0 / (d as f32).sqrt();
        tensors.push((format!("blk.{i}.attn_q.weight"), q8(random(heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_k.weight"), q8(random(kv_heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_v.weight"), q8(random(kv_heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_output.weight"), q8(random(d, heads * hd, s))));
        tensors.push((format!("blk.{i}.ffn_gate.weight"), q8(random(ff, d, s))));
        tensors.push((format!("blk.{i}.ffn_up.weight"), q8(random(ff, d, s))));
        tensors.push((format!("blk.{i}.ffn_down.weight"), q8(random(d, ff, 1.0 / (ff as f32).sqrt()))));
        tensors.push((format!("blk.{i}.attn_norm.weight"), ones()));
        tensors.push((format!("blk.{i}.ffn_norm.weight"), ones()));
    }
    tensors.push(("output_norm.weight".into(), ones()));
    tensors.push(("output.weight".into(), q8(random(vocab, d, 4.0 / (d as f32).sqrt()))));

    use gguf_file::Value;
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny-random".into())),
        ("llama.context_length", Value::U32(256)),
        ("llama.embedding_length", Value::U32(d as u32)),
        ("llama.block_count", Value::U32(layers as u32)),
        ("llama.feed_forward_length", Value::U32(ff as u32)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(kv_heads as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        ("tokenizer.ggml.merges", strings(&merges)),
        ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos + 2)),
        ("tokenizer.chat_template", Value::String(CHATML_TEMPLATE.into())),
    ];
    let metadata_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::io::BufWriter::new(File::create(path).unwrap());
    gguf_file::write(&mut file, &metadata_refs, &tensor_refs).unwrap();
}

/// The decoder variants of Hugging Face directories the tests write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfVariant {
    /// `llama` with Llama 3's RoPE scaling and a separate output projection; f32.
    Llama3,
    /// `llama` with tied embeddings, as SmolLM; bf16.
    SmolLm,
    /// `mistral` with `head_dim` (48) wider than hidden / heads (32), and a sliding window longer than the
    /// context; f16.
    Mistral,
    /// `qwen2`: q, k and v biases, tied embeddings, a vocabulary larger than the tokenizer's; f32.
    Qwen2,
    /// `qwen3`: per-head q and k RMSNorm, `head_dim` 40, tied embeddings; bf16.
    Qwen3,
}

impl HfVariant {
    pub const ALL: [HfVariant; 5] = [HfVariant::Llama3, HfVariant::SmolLm, HfVariant::Mistral, HfVariant::Qwen2, HfVariant::Qwen3];
}

/// Writes a tiny random-weight Hugging Face decoder directory of one variant: config.json, model.safetensors,
/// tokenizer.json (the byte-level BPE vocabulary of [`tiny_vocab`]), tokenizer_config.json with the ChatML
/// template and generation_config.json. Hidden size 128, 2 layers, 4 heads, 2 kv heads, context 512: every
/// matrix at least 64 wide, as in real models (candle's f32 matmul takes other kernels for narrower outputs).
pub fn write_tiny_hf_model(dir: &Path, variant: HfVariant) {
    use candle_core::{DType, Tensor};
    use std::collections::HashMap;
    std::fs::create_dir_all(dir).unwrap();
    let (d, layers, heads, kv_heads, ff) = (128usize, 2usize, 4usize, 2usize, 256usize);
    let vocab = tiny_vocab();
    let tokenizer_vocab = vocab.tokens.len();
    let vocab_size = if variant == HfVariant::Qwen2 { tokenizer_vocab + 26 } else { tokenizer_vocab };
    let (model_type, head_dim, tied, dtype) = match variant {
        HfVariant::Llama3 => ("llama", d / heads, false, DType::F32),
        HfVariant::SmolLm => ("llama", d / heads, true, DType::BF16),
        HfVariant::Mistral => ("mistral", 48, false, DType::F16),
        HfVariant::Qwen2 => ("qwen2", d / heads, true, DType::F32),
        HfVariant::Qwen3 => ("qwen3", 40, true, DType::BF16),
    };
    let mut config = serde_json::json!({
        "model_type": model_type, "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 512,
        "vocab_size": vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": tied, "bos_token_id": 259, "eos_token_id": 261,
        "torch_dtype": format!("{dtype:?}").to_lowercase(),
    });
    match variant {
        HfVariant::Llama3 => {
            config["rope_theta"] = 500000.0.into();
            // Wavelengths from 6 to 6e5 positions: some kept (< 16), some stretched (> 64), some interpolated.
            config["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
            config["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        }
        HfVariant::SmolLm => config["rope_theta"] = 100000.0.into(),
        HfVariant::Mistral => {
            config["head_dim"] = head_dim.into();
            config["sliding_window"] = 4096.into();
        }
        HfVariant::Qwen2 | HfVariant::Qwen3 => {
            config["sliding_window"] = 4096.into();
            config["use_sliding_window"] = false.into();
            config["max_window_layers"] = layers.into();
            if variant == HfVariant::Qwen3 {
                config["head_dim"] = head_dim.into();
                config["attention_bias"] = false.into();
            }
        }
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();

    let seed = 0x5eed_0000 + variant as u64;
    let mut rng = RandomTensors::new(seed);
    let mut random = |dims: &[usize], scale: f32| -> Tensor { rng.tensor(dims, scale) };
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let s = 1.0 / (d as f32).sqrt();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("model.embed_tokens.weight".into(), random(&[vocab_size, d], 1.0));
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
        tensors.insert(format!("{p}.post_attention_layernorm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
        tensors.insert(format!("{p}.self_attn.q_proj.weight"), random(&[q, d], s));
        tensors.insert(format!("{p}.self_attn.k_proj.weight"), random(&[kv, d], s));
        tensors.insert(format!("{p}.self_attn.v_proj.weight"), random(&[kv, d], s));
        tensors.insert(format!("{p}.self_attn.o_proj.weight"), random(&[d, q], 1.0 / (q as f32).sqrt()));
        if variant == HfVariant::Qwen2 {
            tensors.insert(format!("{p}.self_attn.q_proj.bias"), random(&[q], 0.5));
            tensors.insert(format!("{p}.self_attn.k_proj.bias"), random(&[kv], 0.5));
            tensors.insert(format!("{p}.self_attn.v_proj.bias"), random(&[kv], 0.5));
        }
        if variant == HfVariant::Qwen3 {
            tensors.insert(format!("{p}.self_attn.q_norm.weight"), random(&[head_dim], 0.5).affine(1.0, 1.0).unwrap());
            tensors.insert(format!("{p}.self_attn.k_norm.weight"), random(&[head_dim], 0.5).affine(1.0, 1.0).unwrap());
        }
        tensors.insert(format!("{p}.mlp.gate_proj.weight"), random(&[ff, d], s));
        tensors.insert(format!("{p}.mlp.up_proj.weight"), random(&[ff, d], s));
        tensors.insert(format!("{p}.mlp.down_proj.weight"), random(&[d, ff], 1.0 / (ff as f32).sqrt()));
    }
    tensors.insert("model.norm.weight".into(), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
    if !tied {
        tensors.insert("lm_head.weight".into(), random(&[vocab_size, d], 4.0 * s));
    }
    let tensors: HashMap<String, Tensor> = tensors.into_iter().map(|(k, t)| (k, t.to_dtype(dtype).unwrap())).collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();

    let metadata = nightshift::tokenize::VocabMetadata {
        kind: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens: vocab.tokens,
        token_types: vocab.token_types,
        merges: vocab.merges,
        ..Default::default()
    };
    nightshift::tokenize::vocab::build(&metadata).unwrap().save(dir.join("tokenizer.json"), false).unwrap();
    // Llama 3 style: a BOS added by the tokenizer config; the others start with the template's first token.
    let tokenizer_config = serde_json::json!({
        "bos_token": if variant == HfVariant::Llama3 { serde_json::json!("<|endoftext|>") } else { serde_json::Value::Null },
        "add_bos_token": variant == HfVariant::Llama3,
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": CHATML_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tokenizer_config).unwrap()).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [261, 259]}"#).unwrap();
}

/// A moto S3 server on 127.0.0.1, stopped when dropped.
pub struct Moto {
    child: Child,
    pub endpoint: String,
}

impl Moto {
    pub fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let python = std::env::var("NIGHTSHIFT_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let child = Command::new(&python)
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start moto with {python}: {e} (scripts/test.sh installs moto[server])"));
        let mut moto = Moto { child, endpoint: format!("http://127.0.0.1:{port}") };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto exited with {status}: is moto[server] installed? (scripts/test.sh installs it)");
            }
            assert!(std::time::Instant::now() < deadline, "moto did not start within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        moto
    }

    /// Creates a bucket with a plain (unsigned) S3 CreateBucket request, which moto accepts.
    pub fn create_bucket(&self, bucket: &str) {
        use std::io::{Read, Write};
        let addr = self.endpoint.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        write!(stream, "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "CreateBucket failed: {response}");
    }

    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on 127.0.0.1 in front of another port, which can be taken down (connections refused, open ones
/// cut) and brought back on the same port: a store outage as clients see it, while the server behind keeps its
/// state (moto keeps objects only in memory, so stopping moto itself would lose them).
pub struct Proxy {
    pub port: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub fn start(upstream: u16) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let (up2, stop2) = (up.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut listener = Some(listener);
            let open: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Default::default();
            while !stop2.load(Ordering::SeqCst) {
                if !up2.load(Ordering::SeqCst) {
                    listener = None;
                    for s in open.lock().unwrap().drain(..) {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    continue;
                }
                let l = listener.get_or_insert_with(|| std::net::TcpListener::bind(("127.0.0.1", port)).expect("the proxy port is free again"));
                l.set_nonblocking(true).unwrap();
                match l.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else { continue };
                        let mut guard = open.lock().unwrap();
                        guard.push(client.try_clone().unwrap());
                        guard.push(server.try_clone().unwrap());
                        for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)] {
                            std::thread::spawn(move || {
                                let _ = std::io::copy(&mut from, &mut to);
                                let _ = to.shutdown(std::net::Shutdown::Write);
                            });
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(2)),
                    Err(_) => {}
                }
            }
        });
        Proxy { port, up, stop }
    }

    pub fn set_up(&self, up: bool) {
        self.up.store(up, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
