//! Encoder-only models (the BERT family) for embedding jobs: bidirectional attention, one forward pass per batch,
//! no generation loop.
//!
//! A model is a Hugging Face directory: `config.json`, `model.safetensors` (f32, f16 or bf16; computed in f32),
//! `tokenizer.json`, and the sentence-transformers files when present (`modules.json`, `1_Pooling/config.json`,
//! `sentence_bert_config.json`) for pooling (mean, CLS or max), normalisation and the maximum sequence length.
//!
//! A batch is padded to its longest row with an attention mask: padded keys get a score of minus infinity, so
//! their softmax weight is exactly zero and a row's vector does not depend on its batch or its padding. Batches
//! are cut from rows sorted by length, so little padding is computed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::engine::ModelError;

/// `config.json` of a BERT-family model: the keys this encoder reads.
#[derive(Clone, Debug, Deserialize)]
pub struct EncoderConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_positions() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}

/// How token vectors become one vector per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The mean of the row's token vectors (padding excluded).
    Mean,
    /// The first token's vector (`[CLS]`).
    Cls,
    /// The element-wise maximum over the row's tokens.
    Max,
}

#[derive(Clone, Copy, Debug)]
enum Activation {
    GeluErf,
    GeluTanh,
    Relu,
}

struct Linear {
    /// `[out, in]`, as stored.
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    /// `x`: `[rows, in]` -> `[rows, out]`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.weight.t()?)?.broadcast_add(&self.bias)
    }
}

struct Norm {
    weight: Tensor,
    bias: Tensor,
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_out: Linear,
    attention_norm: Norm,
    intermediate: Linear,
    output: Linear,
    output_norm: Norm,
}

/// What `validate` shows and the job records about an encoder.
#[derive(Clone, Debug)]
pub struct EncoderInfo {
    pub dir: PathBuf,
    pub config: EncoderConfig,
    pub pooling: Pooling,
    pub normalize: bool,
    /// The longest row, in tokens, special tokens included.
    pub max_tokens: usize,
    /// The embedding's length.
    pub dimensions: usize,
}

pub struct Encoder {
    pub info: EncoderInfo,
    device: Device,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embedding_norm: Norm,
    layers: Vec<Layer>,
    activation: Activation,
    eps: f32,
}

fn format_err(path: &Path, message: impl std::fmt::Display) -> ModelError {
    ModelError::File { path: path.into(), message: crate::engine::first_line(&message) }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, ModelError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| format_err(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ModelError::Open { path: path.into(), source }),
    }
}

/// The model files of a directory that decide its outputs, in a fixed order (for the job's fingerprint): an
/// encoder's, a seq2seq model's or a decoder's (whose tokenizer_config.json and chat_template.jinja set its
/// special tokens and template, and whose weights may be shards named by an index).
pub fn model_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "modules.json",
        "1_Pooling/config.json",
        "sentence_bert_config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ]
        .iter()
        .map(|f| dir.join(f))
        .filter(|p| p.exists())
        .collect();
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors") && p.file_name().is_some_and(|n| n != "model.safetensors"))
        .collect();
    shards.sort();
    files.extend(shards);
    files
}

/// Reads the configuration, pooling and limits of an encoder directory, without its weights.
pub fn inspect(dir: &Path) -> Result<EncoderInfo, ModelError> {
    if !dir.is_dir() {
        return Err(ModelError::Open {
            path: dir.into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "an embedding model is a directory with config.json"),
        });
    }
    let config: EncoderConfig = read_json(&dir.join("config.json"))?
        .ok_or_else(|| ModelError::Open { path: dir.join("config.json"), source: std::io::ErrorKind::NotFound.into() })?;
    match config.model_type.as_deref() {
        None | Some("bert") => {}
        Some(other) => return Err(ModelError::Architecture { name: other.to_string(), supported: "bert for embedding jobs" }),
    }
    if let Some(kind) = config.position_embedding_type.as_deref().filter(|k| *k != "absolute") {
        return Err(ModelError::Metadata(format!("position_embedding_type `{kind}` is not supported (absolute only)")));
    }
    let c = &config;
    if c.num_attention_heads == 0
        || !c.hidden_size.is_multiple_of(c.num_attention_heads)
        || c.num_hidden_layers == 0
        || c.num_hidden_layers > 256
        || c.max_position_embeddings == 0
        || c.max_position_embeddings > 1 << 16
    {
        return Err(ModelError::Metadata(format!(
            "inconsistent shape: hidden size {}, {} heads, {} layers, {} positions",
            c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.max_position_embeddings
        )));
    }
    #[derive(Deserialize)]
    struct PoolingFile {
        #[serde(default)]
        pooling_mode_cls_token: bool,
        #[serde(default)]
        pooling_mode_mean_tokens: bool,
        #[serde(default)]
        pooling_mode_max_tokens: bool,
    }
    #[derive(Deserialize)]
    struct Module {
        #[serde(rename = "type")]
        kind: String,
    }
    #[derive(Deserialize)]
    struct SentenceConfig {
        max_seq_length: Option<usize>,
    }
    let pooling = match read_json::<PoolingFile>(&dir.join("1_Pooling/config.json"))? {
        None => Pooling::Mean,
        Some(p) => match (p.pooling_mode_mean_tokens, p.pooling_mode_cls_token, p.pooling_mode_max_tokens) {
            (true, false, false) => Pooling::Mean,
            (false, true, false) => Pooling::Cls,
            (false, false, true) => Pooling::Max,
            _ => return Err(ModelError::Metadata("1_Pooling/config.json must select exactly one of mean, CLS or max pooling".into())),
        },
    };
    let normalize = read_json::<Vec<Module>>(&dir.join("modules.json"))?
        .is_some_and(|modules| modules.iter().any(|m| m.kind.ends_with(".Normalize")));
    let max_seq_length = read_json::<SentenceConfig>(&dir.join("sentence_bert_config.json"))?.and_then(|s| s.max_seq_length);
    if max_seq_length == Some(0) {
        return Err(ModelError::Metadata("sentence_bert_config.json: max_seq_length must be at least 1, got 0".into()));
    }
    let max_tokens = max_seq_length.unwrap_or(config.max_position_embeddings).min(config.max_position_embeddings);
    Ok(EncoderInfo { dir: dir.into(), dimensions: config.hidden_size, config, pooling, normalize, max_tokens })
}

/// The directory's tokenizer, with its own padding and truncation turned off: batches are padded here, and
/// over-long rows follow the job's `input.truncate`.
pub fn tokenizer(dir: &Path) -> Result<Tokenizer, ModelError> {
    let path = dir.join("tokenizer.json");
    let mut tokenizer = crate::tokenize::vocab::from_file(&path).map_err(|e| format_err(&path, e))?;
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).map_err(|e| format_err(&path, e))?;
    Ok(tokenizer)
}

impl Encoder {
    pub fn load(dir: &Path, device: &Device) -> Result<Encoder, ModelError> {
        let info = inspect(dir)?;
        let path = dir.join("model.safetensors");
        if !path.exists() {
            return Err(ModelError::Open { path, source: std::io::ErrorKind::NotFound.into() });
        }
        let fmt = |e: candle_core::Error| format_err(&path, e);
        let mut tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&path, device).map_err(fmt)?;
        // Some exports prefix every name with the model's kind (`bert.embeddings...`).
        if !tensors.contains_key("embeddings.word_embeddings.weight") {
            tensors = tensors.into_iter().map(|(k, v)| (k.strip_prefix("bert.").map(String::from).unwrap_or(k), v)).collect();
        }
        let c = info.config.clone();
        let (d, ff) = (c.hidden_size, c.intermediate_size);
        let word = take_outside(&mut tensors, "embeddings.word_embeddings.weight", &[c.vocab_size, d], &path)?;
        let position = take_outside(&mut tensors, "embeddings.position_embeddings.weight", &[c.max_position_embeddings, d], &path)?;
        let token_type = take_outside(&mut tensors, "embeddings.token_type_embeddings.weight", &[c.type_vocab_size, d], &path)?;
        let embedding_norm = Norm {
            weight: take_outside(&mut tensors, "embeddings.LayerNorm.weight", &[d], &path)?,
            bias: take_outside(&mut tensors, "embeddings.LayerNorm.bias", &[d], &path)?,
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let mut norm = |name: &str| -> Result<Norm, ModelError> {
                Ok(Norm {
                    weight: take_outside(&mut tensors, &format!("{p}.{name}.weight"), &[d], &path)?,
                    bias: take_outside(&mut tensors, &format!("{p}.{name}.bias"), &[d], &path)?,
                })
            };
            let attention_norm = norm("attention.output.LayerNorm")?;
            let output_norm = norm("output.LayerNorm")?;
            let mut lin = |name: &str, out: usize, inp: usize| -> Result<Linear, ModelError> {
                Ok(Linear {
                    weight: take_outside(&mut tensors, &format!("{p}.{name}.weight"), &[out, inp], &path)?,
                    bias: take_outside(&mut tensors, &format!("{p}.{name}.bias"), &[out], &path)?,
                })
            };
            layers.push(Layer {
                query: lin("attention.self.query", d, d)?,
                key: lin("attention.self.key", d, d)?,
                value: lin("attention.self.value", d, d)?,
                attention_out: lin("attention.output.dense", d, d)?,
                attention_norm,
                intermediate: lin("intermediate.dense", ff, d)?,
                output: lin("output.dense", d, ff)?,
                output_norm,
            });
        }
        let activation = match c.hidden_act.as_str() {
            "gelu" => Activation::GeluErf,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => return Err(ModelError::Metadata(format!("hidden_act `{other}` is not supported"))),
        };
        let eps = c.layer_norm_eps as f32;
        Ok(Encoder { info, device: device.clone(), word, position, token_type, embedding_norm, layers, activation, eps })
    }

    /// Bytes of weights held (f32).
    pub fn weight_bytes(&self) -> usize {
        let t = |t: &Tensor| t.elem_count() * 4;
        let lin = |l: &Linear| t(&l.weight) + t(&l.bias);
        t(&self.word)
            + t(&self.position)
            + t(&self.token_type)
            + self
                .layers
                .iter()
                .map(|l| lin(&l.query) + lin(&l.key) + lin(&l.value) + lin(&l.attention_out) + lin(&l.intermediate) + lin(&l.output))
                .sum::<usize>()
    }

    fn norm(&self, x: &Tensor, n: &Norm) -> candle_core::Result<Tensor> {
        candle_nn::ops::layer_norm(x, &n.weight, &n.bias, self.eps)
    }

    /// The last hidden states of a batch, `[batch, length, hidden]`, and its mask `[batch, length]` (1 for tokens,
    /// 0 for padding). Every row must be non-empty and at most `max_position_embeddings` long.
    pub fn hidden_states(&self, rows: &[&[u32]]) -> candle_core::Result<(Tensor, Tensor)> {
        let c = &self.info.config;
        let (b, l, d, h) = (rows.len(), rows.iter().map(|r| r.len()).max().unwrap_or(0), c.hidden_size, c.num_attention_heads);
        let hd = d / h;
        let mut ids = Vec::with_capacity(b * l);
        let mut mask = Vec::with_capacity(b * l);
        for row in rows {
            ids.extend_from_slice(row);
            ids.extend(std::iter::repeat_n(0u32, l - row.len()));
            mask.extend(std::iter::repeat_n(1f32, row.len()));
            mask.extend(std::iter::repeat_n(0f32, l - row.len()));
        }
        if ids.iter().any(|&id| id as usize >= c.vocab_size) {
            candle_core::bail!("a token id is outside the vocabulary of {}", c.vocab_size);
        }
        let ids = Tensor::from_vec(ids, b * l, &self.device)?;
        let mask = Tensor::from_vec(mask, (b, l), &self.device)?;
        let positions = Tensor::arange(0u32, l as u32, &self.device)?;
        let words = self.word.index_select(&ids, 0)?.reshape((b, l, d))?;
        let pos = self.position.index_select(&positions, 0)?;
        let types = self.token_type.get(0)?;
        let x = words.broadcast_add(&pos)?.broadcast_add(&types)?;
        let mut x = self.norm(&x, &self.embedding_norm)?.reshape((b * l, d))?;
        // 0 for tokens, minus infinity for padding: a padded key's softmax weight is exactly zero.
        let padding = mask.eq(0f32)?;
        let bias = padding
            .where_cond(&Tensor::full(f32::NEG_INFINITY, (b, l), &self.device)?, &Tensor::zeros((b, l), DType::F32, &self.device)?)?
            .reshape((b, 1, 1, l))?;
        let scale = 1.0 / (hd as f64).sqrt();
        for layer in &self.layers {
            let heads = |t: Tensor| t.reshape((b, l, h, hd))?.transpose(1, 2)?.contiguous();
            let q = heads(layer.query.forward(&x)?)?;
            let k = heads(layer.key.forward(&x)?)?;
            let v = heads(layer.value.forward(&x)?)?;
            let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&bias)?;
            let weights = candle_nn::ops::softmax_last_dim(&scores)?;
            let context = weights.matmul(&v)?.transpose(1, 2)?.reshape((b * l, d))?;
            let attended = self.norm(&(layer.attention_out.forward(&context)? + &x)?, &layer.attention_norm)?;
            let inner = layer.intermediate.forward(&attended)?;
            let inner = match self.activation {
                Activation::GeluErf => inner.gelu_erf()?,
                Activation::GeluTanh => inner.gelu()?,
                Activation::Relu => inner.relu()?,
            };
            x = self.norm(&(layer.output.forward(&inner)? + &attended)?, &layer.output_norm)?;
        }
        Ok((x.reshape((b, l, d))?, mask))
    }

    /// One pooled (and, when the model asks for it, unit-length) vector per row.
    pub fn embed(&self, rows: &[&[u32]]) -> candle_core::Result<Vec<Vec<f32>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let (hidden, mask) = self.hidden_states(rows)?;
        let pooled = match self.info.pooling {
            Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?,
            Pooling::Mean => {
                let m = mask.unsqueeze(D::Minus1)?;
                hidden.broadcast_mul(&m)?.sum(1)?.broadcast_div(&m.sum(1)?)?
            }
            Pooling::Max => {
                let penalty = mask.affine(1e9, -1e9)?.unsqueeze(D::Minus1)?;
                hidden.broadcast_add(&penalty)?.max(1)?
            }
        };
        let pooled = if self.info.normalize {
            let norm = pooled.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
            pooled.broadcast_div(&norm)?
        } else {
            pooled
        };
        pooled.to_vec2()
    }
}

fn take_outside(tensors: &mut HashMap<String, Tensor>, name: &str, dims: &[usize], path: &Path) -> Result<Tensor, ModelError> {
    let t = tensors.remove(name).ok_or_else(|| ModelError::Metadata(format!("tensor `{name}` is missing")))?;
    if t.dims() != dims {
        return Err(ModelError::Metadata(format!("tensor `{name}` has shape {:?}, expected {dims:?}", t.dims())));
    }
    t.to_dtype(DType::F32).map_err(|e| format_err(path, e))
}
