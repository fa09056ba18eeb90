//! Reading an output back as the job wrote it: the manifest, result rows (typed, or as JSON), metrics rows and
//! Parquet metadata, the same way from a local directory and from S3.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, UInt32Type};
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::azure::{Azurite, AZURITE_ACCOUNT, AZURITE_KEY};
use super::s3::Moto;

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

/// The text columns of the metrics row of a local output that has exactly one unit.
pub fn read_metrics_text(out: &Path) -> BTreeMap<String, String> {
    let store = OutputStore::local(out);
    let manifest = store.manifest();
    let files = manifest["metrics"].as_array().unwrap();
    assert_eq!(files.len(), 1, "expected one unit");
    let reader = ParquetRecordBatchReaderBuilder::try_new(store.get(files[0].as_str().unwrap()).unwrap()).unwrap().build().unwrap();
    let batch = reader.into_iter().next().unwrap().unwrap();
    let schema = batch.schema();
    schema
        .fields()
        .iter()
        .zip(batch.columns())
        .filter(|(_, column)| column.data_type() == &DataType::Utf8)
        .map(|(field, column)| (field.name().clone(), column.as_string::<i32>().value(0).to_string()))
        .collect()
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

    /// A prefix in a container of an Azurite server, reached as any Azure endpoint is (object_store's emulator
    /// mode reads the emulator's address from the process environment, which tests running at once cannot share).
    pub fn azure(azurite: &Azurite, container: &str, prefix: &str) -> OutputStore {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = object_store::azure::MicrosoftAzureBuilder::new()
            .with_endpoint(format!("{}/{AZURITE_ACCOUNT}", azurite.endpoint()))
            .with_allow_http(true)
            .with_account(AZURITE_ACCOUNT)
            .with_access_key(AZURITE_KEY)
            .with_container_name(container)
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
