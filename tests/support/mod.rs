//! Helpers for the integration tests, by concern: running the binary and scratch directories (here), input
//! Parquet ([`parquet`]), reading outputs back ([`output`]), the S3 server and a proxy that takes it down ([`s3`]),
//! the tiny random-weight models ([`models`]), and headless Chromium rendering reports ([`browser`]). Everything is re-exported, so a test says `use crate::support::*`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod azure;
pub mod browser;
mod models;
mod output;
mod parquet;
mod s3;

// `self::`: `parquet` alone would also name the parquet crate.
pub use self::{azure::*, models::*, output::*, parquet::*, s3::*};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_path() -> PathBuf {
    let path = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/fetch-models.sh", path.display());
    path
}

/// A fresh directory under the target directory, removed first if a previous run left it.
/// A port on 127.0.0.1 free a moment ago, for a server a test starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits until the server `child` (`what`, for messages) accepts connections on 127.0.0.1:`port`; panics if it
/// exits first or takes over 60 s.
pub fn wait_until_listening(child: &mut std::process::Child, port: u16, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited with {status}");
        }
        assert!(std::time::Instant::now() < deadline, "{what} did not start within 60 s");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A test dependency scripts/test.sh installs and names in environment variable `var`: its value, or `None` (after
/// printing that the test skipped, and why) where the script set `skip: REASON` because it could not install it.
/// The variable missing altogether is a broken set-up, and panics: a test must not skip because a step was left out.
pub fn installed(var: &str, what: &str) -> Option<String> {
    let value = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set: scripts/test.sh installs {what} and sets it, or sets `skip: REASON`"));
    match value.strip_prefix("skip:") {
        Some(reason) => {
            eprintln!("skipped: {what} is not installed ({})", reason.trim());
            None
        }
        None => Some(value),
    }
}

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

/// Writes `dir/job.toml` over the sample model; `generation` is the [generation] section's lines, `extra` follows
/// the [output] section's `url` (more of its keys, then other sections).
pub fn job_file(dir: &Path, input: &str, output: &str, generation: &str, extra: &str) -> PathBuf {
    job_file_for(&dir.join("job.toml"), &model_path(), input, output, generation, extra)
}

/// [`job_file`] at `path` over the model at `model`.
pub fn job_file_for(path: &Path, model: &Path, input: &str, output: &str, generation: &str, extra: &str) -> PathBuf {
    let text = format!(
        "[input]\nurl = {input:?}\nid_column = \"id\"\n\n[model]\npath = {:?}\n\n[generation]\n{generation}\n\n[output]\nurl = {output:?}\n\n{extra}\n",
        model.to_string_lossy()
    );
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}
