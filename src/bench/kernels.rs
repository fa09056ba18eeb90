//! `nightshift bench kernels`: the CPU kernels' throughput on a GGUF file's own matrices (one layer's, and the
//! output projection), at each instruction-set level this CPU has and a few row counts: where the time of a
//! forward pass goes, and what each level buys.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::quantized::gguf_file::Content;
use serde::Serialize;

use crate::engine::kernels::{Level, Packed};
use crate::engine::ModelError;
use crate::error::Error;

#[derive(Clone, Debug)]
pub struct KernelBenchOptions {
    pub model: PathBuf,
    /// Activation rows per product: 1 is a lone decode step, hundreds a prefill.
    pub rows: Vec<usize>,
    /// Levels to measure (default: every one this CPU has).
    pub levels: Vec<Level>,
}

#[derive(Clone, Debug, Serialize)]
pub struct KernelMeasurement {
    pub tensor: String,
    pub dtype: String,
    /// `[n, k]`.
    pub shape: [usize; 2],
    pub level: &'static str,
    pub rows: usize,
    /// Median seconds of one product.
    pub seconds: f64,
    /// `2 * rows * n * k / seconds / 1e9`.
    pub gflops: f64,
}

pub fn kernels(options: &KernelBenchOptions) -> Result<Vec<KernelMeasurement>, Error> {
    let path = &options.model;
    let fmt = |e: candle_core::Error| Error::Model(ModelError::Format { path: path.clone(), message: e.to_string() });
    let mut file = std::fs::File::open(path).map_err(|source| Error::Model(ModelError::Open { path: path.clone(), source }))?;
    let content = Content::read(&mut file).map_err(fmt)?;
    let mut names: Vec<String> = content.tensor_infos.keys().filter(|n| n.starts_with("blk.0.") && content.tensor_infos[*n].shape.dims().len() == 2).cloned().collect();
    names.sort();
    names.push(if content.tensor_infos.contains_key("output.weight") { "output.weight" } else { "token_embd.weight" }.to_string());
    let levels = if options.levels.is_empty() { Level::available() } else { options.levels.clone() };
    // As the engine's drive loop does: this thread runs products with the pool, not through it.
    crate::engine::device::join_cpu_pool();
    let mut out = Vec::new();
    for name in names {
        let t = content.tensor(&mut file, &name, &candle_core::Device::Cpu).map_err(fmt)?;
        let Some(packed) = Packed::from_qtensor(&t).map_err(fmt)? else { continue };
        let (n, k) = (packed.rows(), packed.columns());
        for &rows in &options.rows {
            let x: Vec<f32> = (0..rows * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            for &level in &levels {
                // Repeated until a sample takes 20 ms, after a warm-up; the median of five samples.
                let _ = packed.matmul_at(level, &x, rows);
                let once = Instant::now();
                let _ = packed.matmul_at(level, &x, rows);
                let reps = ((0.02 / once.elapsed().as_secs_f64().max(1e-7)) as usize).clamp(1, 10_000);
                let mut samples: Vec<f64> = (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..reps {
                            std::hint::black_box(packed.matmul_at(level, &x, rows));
                        }
                        t.elapsed().as_secs_f64() / reps as f64
                    })
                    .collect();
                samples.sort_by(f64::total_cmp);
                let seconds = samples[2];
                out.push(KernelMeasurement {
                    tensor: name.clone(),
                    dtype: format!("{:?}", packed.stored_dtype()).to_lowercase(),
                    shape: [n, k],
                    level: level.name(),
                    rows,
                    seconds,
                    gflops: 2.0 * (rows * n * k) as f64 / seconds / 1e9,
                });
            }
        }
    }
    Ok(out)
}
