//! Helpers for the end-to-end tests: run the real binary, write input Parquet, read the results back.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, UInt32Type};
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
    let fields: Vec<Field> = columns.iter().map(|(n, a)| Field::new(*n, a.data_type().clone(), true)).collect();
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns.into_iter().map(|(_, a)| a).collect()).unwrap();
    let mut writer = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), None).unwrap();
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

pub fn read_results(out: &Path) -> BTreeMap<String, ResultRow> {
    assert!(out.join("_SUCCESS").exists(), "no _SUCCESS in {}", out.display());
    parse_results(std::fs::read(out.join("results.parquet")).unwrap().into())
}

/// Key/value metadata of a Parquet file.
pub fn kv_metadata(path: &Path) -> BTreeMap<String, String> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap()).unwrap();
    builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .into_iter()
        .flatten()
        .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
        .collect()
}

/// The first row of the metrics file as (column, value as f64).
pub fn read_metrics(out: &Path) -> BTreeMap<String, Option<f64>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(out.join("metrics.parquet")).unwrap()).unwrap().build().unwrap();
    let batch = reader.into_iter().next().unwrap().unwrap();
    let mut out = BTreeMap::new();
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        let value = match column.data_type() {
            DataType::UInt64 => Some(column.as_primitive::<arrow::datatypes::UInt64Type>().value(0) as f64),
            DataType::Float64 => {
                let a = column.as_primitive::<arrow::datatypes::Float64Type>();
                (!a.is_null(0)).then(|| a.value(0))
            }
            other => panic!("unexpected metrics type {other}"),
        };
        out.insert(field.name().clone(), value);
    }
    out
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
