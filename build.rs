//! With the `cuda` feature: compiles the paged decode kernel (src/engine/attention/paged_decode.cu) to PTX with
//! nvcc, for the compute capability candle's own kernels are built for (`CUDA_COMPUTE_CAP`, 80 when unset; the
//! PTX runs on that capability and any later one). Without the feature it does nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let source = "src/engine/attention/paged_decode.cu";
    println!("cargo::rerun-if-changed={source}");
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let nvcc = match (std::env::var_os("NVCC"), std::env::var_os("CUDA_HOME")) {
        (Some(nvcc), _) => PathBuf::from(nvcc),
        (None, Some(home)) => PathBuf::from(home).join("bin/nvcc"),
        (None, None) => PathBuf::from("nvcc"),
    };
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_string());
    let cap = cap.trim().trim_start_matches("sm_").replace('.', "");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("paged_decode.ptx");
    let status = Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}"), "-o"])
        .arg(&out)
        .arg(source)
        .status()
        .unwrap_or_else(|e| panic!("running {} (the CUDA compiler; set NVCC or CUDA_HOME): {e}", nvcc.display()));
    assert!(status.success(), "{} failed on {source}: {status}", nvcc.display());
}
