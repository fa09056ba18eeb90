//! The `[runtime]` section: where and how wide the engine runs, and how much memory its KV cache may take.

use serde::Deserialize;

use super::{Invalid, JobError, Overrides};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RuntimeSection {
    device: Option<String>,
    max_seqs: Option<i64>,
    max_batch_tokens: Option<i64>,
    threads: Option<i64>,
    drain_grace_s: Option<f64>,
    kv_cache_memory: Option<MemoryValue>,
    cpu_weights: Option<String>,
    kv_cache_dtype: Option<String>,
    prefix_cache: Option<bool>,
    model_cache: Option<std::path::PathBuf>,
    attention: Option<String>,
    dtype: Option<String>,
    cpu_kernels: Option<String>,
    tensor_parallel: Option<i64>,
}

/// A size in a job file: bytes as an integer, or a string such as `"4GiB"`, `"512MB"` or `"40%"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MemoryValue {
    Bytes(i64),
    Text(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceChoice {
    /// `auto`, `cpu`, `cuda` (cuda:0) or `cuda:N`, as `runtime.device` and `--device` take it.
    pub fn parse(text: &str) -> Result<DeviceChoice, String> {
        match text {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => Ok(DeviceChoice::Cuda(n)),
                None => Err(format!("must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {other:?}")),
            },
        }
    }
}

/// How a decoder's weights are laid out on the CPU (`runtime.cpu_weights`): a GGUF file's, and a Hugging Face
/// checkpoint's 16-bit matrices (`AsStored` or `F32`; `Fast` and `Q8_0` are a GGUF file's only). Other devices and
/// encoders always compute the weights as stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuWeights {
    /// Every matrix as the file stores it: the model the user chose. The default. A Hugging Face checkpoint's bf16
    /// or f16 matrices stay in 16 bits on nightshift's kernels, each weight widened exactly as it is read, the
    /// activations in f32 (in f32 compute, `runtime.dtype = "auto"` on the CPU).
    #[default]
    AsStored,
    /// Requantized for candle's fast CPU kernels: widths zero-padded to a multiple of 256, the layers in Q4_K and
    /// the output projection in Q6_K (Q8_0 for Q4_0/Q4_1 matrices of models too narrow for padding to pay). Lower
    /// precision than most files store, only when the job asks for it.
    Fast,
    /// Padded like `Fast`, every matrix requantized to Q8_0: closer to the stored weights, slower.
    Q8_0,
    /// A Hugging Face decoder's bf16 or f16 matrices widened to f32 at load, for candle's f32 products: twice the
    /// memory of `AsStored`, which keeps them in 16 bits on nightshift's kernels (the same weights either way).
    F32,
}

impl CpuWeights {
    pub fn parse(text: &str) -> Result<CpuWeights, String> {
        match text {
            "as-stored" => Ok(CpuWeights::AsStored),
            "fast" => Ok(CpuWeights::Fast),
            "q8_0" => Ok(CpuWeights::Q8_0),
            "f32" => Ok(CpuWeights::F32),
            other => Err(format!("must be \"as-stored\", \"fast\", \"q8_0\" or \"f32\", got {other:?}")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CpuWeights::AsStored => "as-stored",
            CpuWeights::Fast => "fast",
            CpuWeights::Q8_0 => "q8_0",
            CpuWeights::F32 => "f32",
        }
    }
}

/// How a decoder's KV cache holds keys and values (`runtime.kv_cache_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The dtype the activations are computed in: f32 on the CPU, the model's dtype on an accelerator.
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl KvCacheDtype {
    pub fn parse(text: &str) -> Result<KvCacheDtype, String> {
        match text {
            "auto" => Ok(KvCacheDtype::Auto),
            "f32" => Ok(KvCacheDtype::F32),
            "f16" => Ok(KvCacheDtype::F16),
            "bf16" => Ok(KvCacheDtype::Bf16),
            other => Err(format!("must be \"auto\", \"f32\", \"f16\" or \"bf16\", got {other:?}")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::F32 => "f32",
            KvCacheDtype::F16 => "f16",
            KvCacheDtype::Bf16 => "bf16",
        }
    }
}

/// Parses one of a key's names.
fn named<T: Copy>(text: &str, table: &[(&'static str, T)]) -> Result<T, String> {
    match table.iter().find(|(name, _)| *name == text) {
        Some(&(_, value)) => Ok(value),
        None => {
            let names: Vec<String> = table.iter().map(|(name, _)| format!("{name:?}")).collect();
            Err(format!("must be one of {}, got {text:?}", names.join(", ")))
        }
    }
}

/// The name of a value in its key's table.
fn name_of<T: Copy + PartialEq>(value: T, table: &[(&'static str, T)]) -> &'static str {
    table.iter().find(|(_, v)| *v == value).map_or("?", |(name, _)| name)
}

/// Which attention a decoder runs (`runtime.attention`, `--attention`, `NIGHTSHIFT_ATTENTION`). Each is named
/// in the results' numerics where it is not the CPU's own, so reuse never serves a row computed by another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionChoice {
    /// The host backend for an f32 model on the CPU; on an accelerator (or in another dtype) the paged backend,
    /// with flash-attention's kernel where the build has it (CUDA, f16 or bf16), the tiled one otherwise.
    #[default]
    Auto,
    /// The CPU's own backend: f32 models on the CPU only.
    Host,
    /// The CPU's own backend with its prefills' scores and weighted values on Intel's tile unit (AMX-BF16), each
    /// operand split into two bf16 parts: within about 2^-16 of the f32 products, not the same bits. Where the CPU
    /// or Linux gives no AMX-BF16, or heads are not a multiple of 64 wide, `host` runs, with a warning.
    HostAmx,
    /// The paged backend with its tiled kernel, on any device: on the CPU, the code an accelerator runs.
    PagedTiled,
    /// The paged backend with nightshift's decode kernel for decodes (prefills in tiles): on CUDA the kernel, on the
    /// CPU its reference in Rust.
    PagedDecode,
    /// The paged backend with flash-attention's kernel: builds with `flash-attn`, CUDA, f16 or bf16.
    PagedFlash,
}

impl AttentionChoice {
    const NAMES: [(&'static str, AttentionChoice); 6] = [
        ("auto", AttentionChoice::Auto),
        ("host", AttentionChoice::Host),
        ("host-amx", AttentionChoice::HostAmx),
        ("paged-tiled", AttentionChoice::PagedTiled),
        ("paged-decode", AttentionChoice::PagedDecode),
        ("paged-flash", AttentionChoice::PagedFlash),
    ];

    pub fn parse(text: &str) -> Result<AttentionChoice, String> {
        named(text, &Self::NAMES)
    }

    pub fn name(self) -> &'static str {
        name_of(self, &Self::NAMES)
    }
}

/// The dtype a Hugging Face decoder's weights and activations are computed in (`runtime.dtype`, `--dtype`,
/// `NIGHTSHIFT_DTYPE`). A GGUF file computes its weights as stored (`runtime.cpu_weights` chooses a CPU layout)
/// and the encoders in f32: for those only `auto` is taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDtype {
    /// f32 on the CPU, bf16 on an accelerator (an f16 checkpoint is converted, as its range fits).
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    const NAMES: [(&'static str, ComputeDtype); 4] =
        [("auto", ComputeDtype::Auto), ("f32", ComputeDtype::F32), ("bf16", ComputeDtype::Bf16), ("f16", ComputeDtype::F16)];

    pub fn parse(text: &str) -> Result<ComputeDtype, String> {
        named(text, &Self::NAMES)
    }

    pub fn name(self) -> &'static str {
        name_of(self, &Self::NAMES)
    }
}

/// The instruction set of the CPU's own kernels (`runtime.cpu_kernels`, `--cpu-kernels`,
/// `NIGHTSHIFT_CPU_KERNELS`). Every level computes the same bits but for bf16 matrices at `avx512-bf16` and `amx`
/// and F16 matrices at `amx` (docs/engine.md); a level the CPU lacks is not taken (`auto` is, with a warning), so
/// one job file runs on every machine of a fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuKernels {
    /// The best this CPU runs, short of AMX (which is taken only when named: see docs/engine.md).
    #[default]
    Auto,
    Portable,
    Avx2,
    Vnni,
    Avx512Bf16,
    Amx,
}

impl CpuKernels {
    const NAMES: [(&'static str, CpuKernels); 6] = [
        ("auto", CpuKernels::Auto),
        ("portable", CpuKernels::Portable),
        ("avx2", CpuKernels::Avx2),
        ("vnni", CpuKernels::Vnni),
        ("avx512-bf16", CpuKernels::Avx512Bf16),
        ("amx", CpuKernels::Amx),
    ];

    pub fn parse(text: &str) -> Result<CpuKernels, String> {
        named(text, &Self::NAMES)
    }

    pub fn name(self) -> &'static str {
        name_of(self, &Self::NAMES)
    }
}

#[derive(Clone, Debug)]
pub struct RuntimeSpec {
    pub device: DeviceChoice,
    /// Sequences decoded together in one step.
    pub max_seqs: usize,
    /// Prompt tokens prefilled in one step (several short prompts are packed together).
    pub max_batch_tokens: usize,
    /// CPU threads for the engine; `None` uses every core.
    pub threads: Option<usize>,
    /// After SIGTERM or SIGINT, how long running sequences may go on to finish their units.
    pub drain_grace: std::time::Duration,
    /// Memory for the KV cache: it bounds how many tokens all running sequences hold together.
    pub kv_cache_memory: MemoryBudget,
    /// How a decoder's weights are laid out on the CPU (a GGUF file's, or a Hugging Face checkpoint's 16-bit ones).
    pub cpu_weights: CpuWeights,
    /// How a decoder's KV cache holds keys and values.
    pub kv_cache_dtype: KvCacheDtype,
    /// Whether a decoder keeps prefilled KV blocks and serves them to later prompts with the same beginning.
    pub prefix_cache: bool,
    /// Where models fetched from object storage are kept (`runtime.model_cache`); `None`: the default,
    /// [`default_model_cache`].
    pub model_cache: Option<std::path::PathBuf>,
    /// Which attention a decoder runs.
    pub attention: AttentionChoice,
    /// The dtype a Hugging Face decoder computes in.
    pub dtype: ComputeDtype,
    /// The CPU kernels' instruction set.
    pub cpu_kernels: CpuKernels,
    /// Ranks a decoder's layers are split over ([`crate::engine::parallel`]); 1: no split.
    pub tensor_parallel: usize,
}

/// `$XDG_CACHE_HOME/nightshift`, or `~/.cache/nightshift`.
pub fn default_model_cache() -> std::path::PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir).join(".cache")
    });
    base.join("nightshift")
}

/// How much memory a job may use for something.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    Bytes(u64),
    /// A fraction of the memory available when the model has loaded (the cgroup's limit counts).
    Fraction(f64),
}

impl MemoryBudget {
    /// The KV cache's default: half of the memory available after the model has loaded.
    pub const DEFAULT_KV: MemoryBudget = MemoryBudget::Fraction(0.5);

    /// Parses `"4GiB"`, `"512 MiB"`, `"2GB"`, `"1000000"`, `"40%"` or `"auto"` (the KV cache's default).
    pub fn parse(text: &str) -> Result<MemoryBudget, String> {
        let t = text.trim();
        if t == "auto" {
            return Ok(MemoryBudget::DEFAULT_KV);
        }
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(p) if p > 0.0 && p <= 100.0 => Ok(MemoryBudget::Fraction(p / 100.0)),
                _ => Err(format!("must be a percentage in (0, 100], got {text:?}")),
            };
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let scale: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(format!("has an unknown unit in {text:?} (use B, KB, MB, GB, KiB, MiB, GiB or a percentage)")),
        };
        match number.parse::<f64>() {
            Ok(n) if n > 0.0 && (n * scale).is_finite() && n * scale >= 1.0 => Ok(MemoryBudget::Bytes((n * scale) as u64)),
            _ => Err(format!("must be \"auto\", a positive size such as \"4GiB\" or a percentage such as \"40%\", got {text:?}")),
        }
    }

    /// Bytes, given the memory available.
    pub fn resolve(self, available: u64) -> u64 {
        match self {
            MemoryBudget::Bytes(b) => b,
            MemoryBudget::Fraction(f) => (available as f64 * f) as u64,
        }
    }
}

impl Default for RuntimeSpec {
    fn default() -> Self {
        RuntimeSpec {
            device: DeviceChoice::Auto,
            max_seqs: 32,
            max_batch_tokens: 2048,
            threads: None,
            drain_grace: std::time::Duration::from_secs(30),
            kv_cache_memory: MemoryBudget::DEFAULT_KV,
            cpu_weights: CpuWeights::default(),
            kv_cache_dtype: KvCacheDtype::default(),
            prefix_cache: true,
            model_cache: None,
            attention: AttentionChoice::Auto,
            dtype: ComputeDtype::Auto,
            cpu_kernels: CpuKernels::Auto,
            tensor_parallel: 1,
        }
    }
}

impl RuntimeSpec {
    /// The `[runtime]` section, each key checked, with `--max-seqs`, `--attention`, `--dtype` and `--cpu-kernels`
    /// (or their environment variables) taking precedence.
    pub(super) fn from_section(r: RuntimeSection, overrides: &Overrides, invalid: Invalid) -> Result<RuntimeSpec, JobError> {
        let defaults = RuntimeSpec::default();
        let device = DeviceChoice::parse(r.device.as_deref().unwrap_or("auto")).map_err(|e| invalid("runtime.device", e))?;
        let positive = |key: &'static str, v: Option<i64>, default: usize| -> Result<usize, JobError> {
            match v {
                None => Ok(default),
                Some(n) if (1..=1 << 20).contains(&n) => Ok(n as usize),
                Some(n) => Err(invalid(key, format!("must be in 1..={}, got {n}", 1 << 20))),
            }
        };
        let max_seqs = match overrides.max_seqs {
            Some(0) => return Err(invalid("runtime.max_seqs", "must be at least 1, got 0".into())),
            Some(n) => n,
            None => positive("runtime.max_seqs", r.max_seqs, defaults.max_seqs)?,
        };
        RuntimeSpec {
            device,
            max_seqs,
            max_batch_tokens: positive("runtime.max_batch_tokens", r.max_batch_tokens, defaults.max_batch_tokens)?,
            threads: match r.threads {
                None => None,
                Some(n) => Some(positive("runtime.threads", Some(n), 1)?),
            },
            drain_grace: match r.drain_grace_s {
                None => defaults.drain_grace,
                Some(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => std::time::Duration::from_secs_f64(s),
                Some(s) => return Err(invalid("runtime.drain_grace_s", format!("must be in 0..=86400 seconds, got {s}"))),
            },
            kv_cache_memory: match &r.kv_cache_memory {
                None => defaults.kv_cache_memory,
                Some(MemoryValue::Bytes(n)) if *n > 0 => MemoryBudget::Bytes(*n as u64),
                Some(MemoryValue::Bytes(n)) => return Err(invalid("runtime.kv_cache_memory", format!("must be positive, got {n}"))),
                Some(MemoryValue::Text(t)) => MemoryBudget::parse(t).map_err(|m| invalid("runtime.kv_cache_memory", m))?,
            },
            cpu_weights: match r.cpu_weights.as_deref() {
                None => defaults.cpu_weights,
                Some(t) => CpuWeights::parse(t).map_err(|m| invalid("runtime.cpu_weights", m))?,
            },
            kv_cache_dtype: match r.kv_cache_dtype.as_deref() {
                None => defaults.kv_cache_dtype,
                Some(t) => KvCacheDtype::parse(t).map_err(|m| invalid("runtime.kv_cache_dtype", m))?,
            },
            prefix_cache: r.prefix_cache.unwrap_or(defaults.prefix_cache),
            model_cache: r.model_cache.clone(),
            attention: match (overrides.attention, r.attention.as_deref()) {
                (Some(asked), _) => asked,
                (None, None) => defaults.attention,
                (None, Some(t)) => AttentionChoice::parse(t).map_err(|m| invalid("runtime.attention", m))?,
            },
            dtype: match (overrides.dtype, r.dtype.as_deref()) {
                (Some(asked), _) => asked,
                (None, None) => defaults.dtype,
                (None, Some(t)) => ComputeDtype::parse(t).map_err(|m| invalid("runtime.dtype", m))?,
            },
            cpu_kernels: match (overrides.cpu_kernels, r.cpu_kernels.as_deref()) {
                (Some(asked), _) => asked,
                (None, None) => defaults.cpu_kernels,
                (None, Some(t)) => CpuKernels::parse(t).map_err(|m| invalid("runtime.cpu_kernels", m))?,
            },
            tensor_parallel: match (overrides.tensor_parallel, r.tensor_parallel) {
                (Some(n), _) => n,
                (None, None) => defaults.tensor_parallel,
                (None, Some(n)) if (1..=64).contains(&n) => n as usize,
                (None, Some(n)) => return Err(invalid("runtime.tensor_parallel", format!("must be in 1..=64, got {n}"))),
            },
        }
        .checked(invalid)
    }

    /// The keys against each other: an attention the other keys rule out.
    fn checked(self, invalid: Invalid) -> Result<RuntimeSpec, JobError> {
        let problem = match self.attention {
            AttentionChoice::Host | AttentionChoice::HostAmx if matches!(self.dtype, ComputeDtype::Bf16 | ComputeDtype::F16) => {
                Some(format!("is \"{}\", which computes f32 models, and runtime.dtype is \"{}\"", self.attention.name(), self.dtype.name()))
            }
            AttentionChoice::Host | AttentionChoice::HostAmx if matches!(self.device, DeviceChoice::Cuda(_)) => {
                Some(format!("is \"{}\", the CPU's attention, and runtime.device is a GPU", self.attention.name()))
            }
            AttentionChoice::PagedFlash if !cfg!(feature = "flash-attn") => {
                Some("is \"paged-flash\", flash-attention's kernel, and this build has no `flash-attn` (scripts/build-cuda.sh --flash-attn)".to_string())
            }
            AttentionChoice::PagedFlash if self.device == DeviceChoice::Cpu => {
                Some("is \"paged-flash\", flash-attention's kernel, which runs on CUDA, and runtime.device is the CPU".to_string())
            }
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(invalid("runtime.attention", format!("{problem}: use \"auto\" or \"paged-tiled\"")));
        }
        if self.tensor_parallel > 1 && matches!(self.device, DeviceChoice::Cuda(_)) {
            return Err(invalid(
                "runtime.tensor_parallel",
                format!("is {}, and runtime.device is a GPU: this build splits a model over CPU threads only (NCCL ranks are planned: BENCHMARKS.md); on GPUs use --data-parallel, or runtime.device = \"cpu\"", self.tensor_parallel),
            ));
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{message, parse, MINIMAL};
    use super::*;

    #[test]
    fn kv_cache_memory_takes_sizes_and_percentages() {
        assert_eq!(MemoryBudget::parse("4GiB"), Ok(MemoryBudget::Bytes(4 << 30)));
        assert_eq!(MemoryBudget::parse("512 MiB"), Ok(MemoryBudget::Bytes(512 << 20)));
        assert_eq!(MemoryBudget::parse("1.5GB"), Ok(MemoryBudget::Bytes(1_500_000_000)));
        assert_eq!(MemoryBudget::parse("40%"), Ok(MemoryBudget::Fraction(0.4)));
        assert_eq!(MemoryBudget::parse("1000"), Ok(MemoryBudget::Bytes(1000)));
        assert_eq!(MemoryBudget::parse("auto"), Ok(MemoryBudget::DEFAULT_KV));
        for bad in ["", "0", "-3GB", "4 parsecs", "0%", "150%", "GiB"] {
            assert!(MemoryBudget::parse(bad).is_err(), "{bad}");
        }
        let job = parse(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = \"2GiB\"")).unwrap();
        assert_eq!(job.runtime.kv_cache_memory, MemoryBudget::Bytes(2 << 30));
        let job = parse(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = 123456")).unwrap();
        assert_eq!(job.runtime.kv_cache_memory, MemoryBudget::Bytes(123456));
        let m = message(&format!("{MINIMAL}\n[runtime]\nkv_cache_memory = \"lots\""));
        assert!(m.contains("runtime.kv_cache_memory"), "{m}");
        assert_eq!(MemoryBudget::Fraction(0.5).resolve(1000), 500);
    }

    #[test]
    fn the_prefix_cache_is_on_unless_the_job_turns_it_off() {
        assert!(parse(MINIMAL).unwrap().runtime.prefix_cache);
        assert!(!parse(&format!("{MINIMAL}\n[runtime]\nprefix_cache = false")).unwrap().runtime.prefix_cache);
        let m = message(&format!("{MINIMAL}\n[runtime]\nprefix_cache = \"off\""));
        assert!(m.contains("prefix_cache"), "{m}");
    }

    #[test]
    fn kv_cache_dtype_names_a_dtype() {
        assert_eq!(parse(MINIMAL).unwrap().runtime.kv_cache_dtype, KvCacheDtype::Auto);
        for dtype in [KvCacheDtype::Auto, KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Bf16] {
            let job = parse(&format!("{MINIMAL}\n[runtime]\nkv_cache_dtype = \"{}\"", dtype.name())).unwrap();
            assert_eq!(job.runtime.kv_cache_dtype, dtype);
        }
        let m = message(&format!("{MINIMAL}\n[runtime]\nkv_cache_dtype = \"fp8\""));
        assert!(m.contains("runtime.kv_cache_dtype") && m.contains("\"f16\"") && m.contains("fp8"), "{m}");
    }

    #[test]
    fn cpu_weights_names_a_layout() {
        assert_eq!(parse(MINIMAL).unwrap().runtime.cpu_weights, CpuWeights::AsStored);
        for (name, weights) in [("as-stored", CpuWeights::AsStored), ("fast", CpuWeights::Fast), ("q8_0", CpuWeights::Q8_0)] {
            let job = parse(&format!("{MINIMAL}\n[runtime]\ncpu_weights = \"{name}\"")).unwrap();
            assert_eq!(job.runtime.cpu_weights, weights);
            assert_eq!(weights.name(), name);
        }
        let m = message(&format!("{MINIMAL}\n[runtime]\ncpu_weights = \"q4\""));
        assert!(m.contains("runtime.cpu_weights") && m.contains("as-stored"), "{m}");
    }

    #[test]
    fn attention_dtype_and_kernels_name_a_choice_and_flags_win() {
        let job = parse(MINIMAL).unwrap();
        assert_eq!((job.runtime.attention, job.runtime.dtype, job.runtime.cpu_kernels), (AttentionChoice::Auto, ComputeDtype::Auto, CpuKernels::Auto));
        let text = format!("{MINIMAL}\n[runtime]\nattention = \"paged-tiled\"\ndtype = \"f16\"\ncpu_kernels = \"avx2\"");
        let job = parse(&text).unwrap();
        assert_eq!((job.runtime.attention, job.runtime.dtype, job.runtime.cpu_kernels), (AttentionChoice::PagedTiled, ComputeDtype::F16, CpuKernels::Avx2));
        let overrides = Overrides { attention: Some(AttentionChoice::Host), dtype: Some(ComputeDtype::Auto), cpu_kernels: Some(CpuKernels::Portable), ..Overrides::default() };
        let job = crate::job::Job::parse(&text, std::path::Path::new("job.toml"), &overrides).unwrap();
        assert_eq!((job.runtime.attention, job.runtime.dtype, job.runtime.cpu_kernels), (AttentionChoice::Host, ComputeDtype::Auto, CpuKernels::Portable));
        for (key, bad) in [("attention", "flash"), ("dtype", "fp8"), ("cpu_kernels", "avx512")] {
            let m = message(&format!("{MINIMAL}\n[runtime]\n{key} = \"{bad}\""));
            assert!(m.contains(&format!("runtime.{key}")) && m.contains(bad) && m.contains("\"auto\""), "{m}");
        }
        for (runtime, why) in [
            ("attention = \"host\"\ndtype = \"f16\"", "runtime.dtype is \"f16\""),
            ("attention = \"host\"\ndevice = \"cuda:1\"", "runtime.device is a GPU"),
            ("attention = \"host-amx\"\ndtype = \"bf16\"", "is \"host-amx\", which computes f32 models, and runtime.dtype is \"bf16\""),
            ("attention = \"host-amx\"\ndevice = \"cuda:0\"", "runtime.device is a GPU"),
            ("attention = \"host-amx\"\ndevice = \"cpu\"", ""),
            ("attention = \"paged-flash\"", if cfg!(feature = "flash-attn") { "" } else { "no `flash-attn`" }),
            ("attention = \"paged-flash\"\ndevice = \"cpu\"", if cfg!(feature = "flash-attn") { "the CPU" } else { "no `flash-attn`" }),
            ("attention = \"paged-decode\"\ndevice = \"cpu\"", ""),
        ] {
            let text = format!("{MINIMAL}\n[runtime]\n{runtime}");
            if why.is_empty() {
                assert!(parse(&text).is_ok(), "{runtime}");
                continue;
            }
            let m = message(&text);
            assert!(m.contains("runtime.attention") && m.contains(why) && m.contains("paged-tiled"), "{runtime}: {m}");
        }
        assert!(parse(&format!("{MINIMAL}\n[runtime]\nattention = \"host\"\ndtype = \"f32\"\ndevice = \"cpu\"")).is_ok());
        for (name, choice) in AttentionChoice::NAMES {
            assert_eq!((AttentionChoice::parse(name), choice.name()), (Ok(choice), name));
        }
        for (name, choice) in ComputeDtype::NAMES {
            assert_eq!((ComputeDtype::parse(name), choice.name()), (Ok(choice), name));
        }
        for (name, choice) in CpuKernels::NAMES {
            assert_eq!((CpuKernels::parse(name), choice.name()), (Ok(choice), name));
        }
    }
}
