//! Models from object storage: `model.path` as an `s3://`, `gs://`, `az://` or `http(s)://` URL of a GGUF file,
//! or of a Hugging Face directory (a prefix ending in `/`; over HTTP, its files are found by name), fetched once
//! into a local cache (`runtime.model_cache`) and read from there.
//!
//! A cache entry is keyed by the URL; each file in it is kept with the e_tag, size and sha256 it was fetched with
//! (`<file>.meta.json`). A file is fetched in 16 MiB ranges, 8 at a time, into `<file>.partial`, with the ranges
//! done listed beside it, so a killed download resumes where it stopped (while the object's e_tag is the same). A
//! file whose bytes no longer hash to its sha256 (a corrupt cache) is fetched again. Processes on one machine (the
//! shards of a job, several pods on a node) take the entry's lock in turn, so one fetches and the others find it
//! fetched.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectMeta, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::info;

use super::store;
use crate::engine::ModelError;

const CHUNK: u64 = 16 << 20;
const PARALLEL: usize = 8;

/// The range size: [`CHUNK`], or `NIGHTSHIFT_FETCH_CHUNK_BYTES` (for tests of resuming with small files).
fn chunk_bytes() -> u64 {
    std::env::var("NIGHTSHIFT_FETCH_CHUNK_BYTES").ok().and_then(|v| v.parse().ok()).filter(|&n: &u64| n > 0).unwrap_or(CHUNK)
}

/// Whether a `model.path` names an object store rather than a local path.
pub fn is_remote(path: &Path) -> bool {
    let s = path.to_string_lossy();
    ["s3://", "gs://", "az://", "abfs://", "abfss://", "http://", "https://"].iter().any(|scheme| s.starts_with(scheme))
}

fn is_http(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// The files of a Hugging Face directory, by name, for a prefix that cannot be listed (plain HTTP, such as
/// `https://huggingface.co/ORG/MODEL/resolve/main/`): whether each must be there. The weights are
/// `model.safetensors`, or the files `model.safetensors.index.json` names.
const HF_FILES: &[(&str, bool)] = &[
    ("config.json", true),
    ("tokenizer.json", true),
    ("tokenizer_config.json", false),
    ("generation_config.json", false),
    ("special_tokens_map.json", false),
    ("modules.json", false),
    ("sentence_bert_config.json", false),
    ("1_Pooling/config.json", false),
    ("model.safetensors", false),
    ("model.safetensors.index.json", false),
];

/// A Hugging Face directory under an HTTP prefix: its files found by name (a HEAD each), the weights' shards from
/// the index when there is one.
async fn http_directory(location: &store::Location, url: &str) -> Result<Vec<(String, ObjectMeta)>, ModelError> {
    let head = |name: String| async move {
        let path = name.split('/').fold(location.path.clone(), |path, part| path.join(part));
        match location.store.head(&path).await {
            Ok(meta) => Ok(Some((name, meta))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(url, e)),
        }
    };
    let found: Vec<Option<(String, ObjectMeta)>> = futures::stream::iter(HF_FILES.iter().map(|(name, _)| head(name.to_string()))).buffered(PARALLEL).try_collect().await?;
    let mut objects: Vec<(String, ObjectMeta)> = found.into_iter().flatten().collect();
    for (name, required) in HF_FILES {
        if *required && !objects.iter().any(|(n, _)| n == name) {
            return Err(fetch_err(url, format!("no `{name}` under this prefix (a Hugging Face directory has one)")));
        }
    }
    if let Some((_, index)) = objects.iter().find(|(n, _)| n == "model.safetensors.index.json") {
        let bytes = location.store.get(&index.location).await.map_err(|e| store_err(url, e))?.bytes().await.map_err(|e| store_err(url, e))?;
        let index: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| fetch_err(url, format!("model.safetensors.index.json: {e}")))?;
        let mut shards: Vec<String> = index["weight_map"].as_object().map(|m| m.values().filter_map(|v| v.as_str().map(String::from)).collect()).unwrap_or_default();
        shards.sort();
        shards.dedup();
        if shards.iter().any(|s| s.starts_with(['.', '/']) || s.contains("..")) {
            return Err(fetch_err(url, "model.safetensors.index.json names a file outside the directory"));
        }
        for shard in shards {
            let meta = head(shard.clone()).await?.ok_or_else(|| fetch_err(url, format!("`{shard}`, named by model.safetensors.index.json, is not under this prefix")))?;
            objects.push(meta);
        }
    } else if !objects.iter().any(|(n, _)| n == "model.safetensors") {
        return Err(fetch_err(url, "no `model.safetensors` or `model.safetensors.index.json` under this prefix"));
    }
    objects.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(objects)
}

/// What a cached file was fetched as.
#[derive(Serialize, Deserialize, PartialEq, Debug)]
struct Meta {
    e_tag: Option<String>,
    size: u64,
    sha256: String,
}

fn fetch_err(url: &str, message: impl std::fmt::Display) -> ModelError {
    ModelError::Fetch { url: crate::redact::redact_urls(url).into_owned(), message: message.to_string() }
}

/// A store's answer as a fetch error: a missing object, a refused credential or a bad path is the model's fault
/// (exit 4); anything else (the store unreachable, or failing, past the retries) may pass, and a rerun may
/// succeed (exit 75).
fn store_err(url: &str, e: object_store::Error) -> ModelError {
    use object_store::Error::*;
    match e {
        NotFound { .. } | PermissionDenied { .. } | Unauthenticated { .. } | InvalidPath { .. } | NotSupported { .. } | NotImplemented { .. } => fetch_err(url, e),
        other => ModelError::Unreachable { url: crate::redact::redact_urls(url).into_owned(), message: crate::redact::redact_urls(&other.to_string()).into_owned() },
    }
}

/// Opens a model file for reading, refusing a path that is not a regular file (a device or a pipe, such as
/// `/dev/zero`, would be read forever).
pub fn open_regular(path: &Path) -> Result<std::fs::File, ModelError> {
    let open = |source| ModelError::Open { path: path.into(), source };
    if !std::fs::metadata(path).map_err(open)?.is_file() {
        return Err(ModelError::NotAFile { path: path.into() });
    }
    std::fs::File::open(path).map_err(open)
}

/// What identifies a file's version on disk: device, inode, size and modification time (to the nanosecond).
type FileVersion = (u64, u64, u64, Option<std::time::SystemTime>);

fn file_version(meta: &std::fs::Metadata) -> FileVersion {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino(), meta.len(), meta.modified().ok())
}

/// The sha256 of files hashed by this process, by path and version: a model fetched (or found) in the cache is
/// hashed there, and the checks before loading it find the hash here instead of reading gigabytes again.
fn hashed() -> &'static std::sync::Mutex<std::collections::HashMap<PathBuf, (FileVersion, String)>> {
    static HASHED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<PathBuf, (FileVersion, String)>>> = std::sync::OnceLock::new();
    HASHED.get_or_init(Default::default)
}

/// sha256 of a model file, lower-case hex ([`open_regular`]); a file this process hashed before, unchanged since
/// (same inode, size and modification time), is not read again.
pub fn sha256_file(path: &Path) -> Result<String, ModelError> {
    let open = |source| ModelError::Open { path: path.into(), source };
    let mut file = open_regular(path)?;
    let version = file_version(&file.metadata().map_err(open)?);
    if let Some((seen, sha)) = hashed().lock().expect("not poisoned").get(path) {
        if *seen == version {
            return Ok(sha.clone());
        }
    }
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(open)?;
    let sha = format!("{:x}", hasher.finalize());
    hashed().lock().expect("not poisoned").insert(path.to_path_buf(), (version, sha.clone()));
    Ok(sha)
}

/// Records `sha` as the hash of `path` as it is now (a file hashed under another name, then renamed).
fn remember_sha256(path: &Path, sha: &str) {
    if let Ok(meta) = std::fs::metadata(path) {
        hashed().lock().expect("not poisoned").insert(path.to_path_buf(), (file_version(&meta), sha.to_string()));
    }
}

/// Fetches the model at `url` into `cache` (unless it is there already) and returns its local path: the file, or
/// the directory holding a prefix's files.
pub async fn fetch(url: &str, cache: &Path) -> Result<PathBuf, ModelError> {
    let location = if is_http(url) { store::resolve_http(url) } else { store::resolve(url) }.map_err(|e| fetch_err(url, e))?;
    let prefix = url.ends_with('/');
    // The objects: one file, or every file under the prefix (hidden names skipped), or, over plain HTTP, which
    // cannot list, a Hugging Face directory's files by name.
    let objects: Vec<(String, ObjectMeta)> = if prefix && is_http(url) {
        http_directory(&location, url).await?
    } else if prefix {
        let listed: Vec<ObjectMeta> = location.store.list(Some(&location.path)).try_collect().await.map_err(|e| store_err(url, e))?;
        let mut objects: Vec<(String, ObjectMeta)> = listed
            .into_iter()
            .filter_map(|m| {
                let parts: Vec<String> = m.location.prefix_match(&location.path)?.map(|p| p.as_ref().to_string()).collect();
                (!parts.is_empty() && !parts.iter().any(|p| p.starts_with(['.', '_']))).then(|| (parts.join("/"), m))
            })
            .collect();
        objects.sort_by(|a, b| a.0.cmp(&b.0));
        if objects.is_empty() {
            return Err(fetch_err(url, "no files under this prefix"));
        }
        objects
    } else {
        let meta = location.store.head(&location.path).await.map_err(|e| store_err(url, e))?;
        let name = location.path.filename().unwrap_or("model").to_string();
        vec![(name, meta)]
    };
    let key = format!("{:x}", Sha256::digest(url.as_bytes()));
    let entry = cache.join("models").join(&key[..32]);
    let files = entry.join("files");
    std::fs::create_dir_all(&files).map_err(|e| fetch_err(url, format!("cannot create the model cache `{}`: {e}", files.display())))?;
    // One process at a time per entry: the others wait, then find the files fetched.
    let lock = std::fs::File::create(entry.join(".lock")).map_err(|e| fetch_err(url, e))?;
    let locked = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock)).await.map_err(|e| fetch_err(url, e))?;
    let _lock = locked.map_err(|e| fetch_err(url, format!("cannot lock the model cache: {e}")))?;
    for (relative, meta) in &objects {
        let dest = files.join(relative);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| fetch_err(url, e))?;
        }
        fetch_file(&location, meta, &dest, url).await?;
    }
    Ok(if prefix { files } else { files.join(&objects[0].0) })
}

/// Fetches one object into `dest`, unless `dest` holds it already, whole.
async fn fetch_file(location: &store::Location, object: &ObjectMeta, dest: &Path, url: &str) -> Result<(), ModelError> {
    let meta_path = PathBuf::from(format!("{}.meta.json", dest.display()));
    let wanted = |m: &Meta| m.e_tag == object.e_tag && m.size == object.size;
    if let Some(meta) = std::fs::read(&meta_path).ok().and_then(|b| serde_json::from_slice::<Meta>(&b).ok()).filter(wanted) {
        let path = dest.to_path_buf();
        let sha = tokio::task::spawn_blocking(move || sha256_file(&path)).await.map_err(|e| fetch_err(url, e))?;
        if sha.as_deref().ok() == Some(meta.sha256.as_str()) {
            info!(file = %dest.display(), "model file in the cache");
            return Ok(());
        }
        tracing::warn!(file = %dest.display(), "a cached model file does not match its sha256: fetched again");
        let _ = std::fs::remove_file(dest);
    }
    let _ = std::fs::remove_file(&meta_path);
    // Resume a partial download of the same object (its e_tag and size written first), or start one.
    let partial = PathBuf::from(format!("{}.partial", dest.display()));
    let done_path = PathBuf::from(format!("{}.partial.done", dest.display()));
    let chunk_size = chunk_bytes();
    // The ranges listed are of this object and this range size; anything else starts over.
    let stamp = format!("{:?} {} {chunk_size}", object.e_tag, object.size);
    let done_text = std::fs::read_to_string(&done_path).unwrap_or_default();
    let resumable = partial.exists() && done_text.lines().next() == Some(stamp.as_str());
    // Each range listed with its bytes' sha256: on resume, a range is kept only if the partial file still holds
    // those bytes (a crash can leave a range listed whose bytes the disk lost, zeroed), else it is fetched again.
    let listed: Vec<(u64, String)> = match resumable {
        true => done_text.lines().skip(1).filter_map(|l| l.split_once(' ').and_then(|(c, h)| Some((c.parse().ok()?, h.to_string())))).collect(),
        false => Vec::new(),
    };
    let done = {
        let (partial, size) = (partial.clone(), object.size);
        tokio::task::spawn_blocking(move || intact_ranges(&partial, size, chunk_size, listed)).await.map_err(|e| fetch_err(url, e))?
    };
    if !resumable {
        std::fs::write(&done_path, format!("{stamp}\n")).map_err(|e| fetch_err(url, e))?;
    }
    let file = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&partial).map_err(|e| fetch_err(url, e))?;
    file.set_len(object.size).map_err(|e| fetch_err(url, e))?;
    let log = std::sync::Mutex::new(std::fs::OpenOptions::new().append(true).open(&done_path).map_err(|e| fetch_err(url, e))?);
    let chunks: Vec<u64> = (0..object.size.div_ceil(chunk_size)).filter(|c| !done.contains(c)).collect();
    info!(file = %dest.display(), bytes = object.size, resumed_ranges = done.len(), "fetching a model file");
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let bar = indicatif::ProgressBar::new(object.size);
        if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        bar.set_position((done.len() as u64 * chunk_size).min(object.size));
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    futures::stream::iter(chunks)
        .map(|chunk| {
            let (file, log, bar) = (&file, &log, &bar);
            async move {
                let start = chunk * chunk_size;
                let end = (start + chunk_size).min(object.size);
                let bytes = location.store.get_range(&object.location, start..end).await.map_err(|e| store_err(url, e))?;
                if bytes.len() as u64 != end - start {
                    return Err(fetch_err(url, format!("a read of bytes {start}..{end} returned {} bytes", bytes.len())));
                }
                file.write_all_at(&bytes, start).map_err(|e| fetch_err(url, e))?;
                // On disk before it is listed as done, with its hash, which a resume checks the bytes against.
                file.sync_data().map_err(|e| fetch_err(url, e))?;
                writeln!(log.lock().expect("not poisoned"), "{chunk} {}", range_sha256(&bytes)).map_err(|e| fetch_err(url, e))?;
                bar.inc(end - start);
                Ok::<_, ModelError>(())
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<()>>()
        .await?;
    bar.finish_and_clear();
    file.sync_all().map_err(|e| fetch_err(url, e))?;
    drop(file);
    let path = partial.clone();
    let sha256 = tokio::task::spawn_blocking(move || sha256_file(&path)).await.map_err(|e| fetch_err(url, e))??;
    std::fs::rename(&partial, dest).map_err(|e| fetch_err(url, e))?;
    remember_sha256(dest, &sha256);
    let meta = Meta { e_tag: object.e_tag.clone(), size: object.size, sha256 };
    std::fs::write(&meta_path, serde_json::to_vec(&meta).expect("plain data")).map_err(|e| fetch_err(url, e))?;
    let _ = std::fs::remove_file(&done_path);
    Ok(())
}

/// A fetched range's sha256, as the resume log lists it.
fn range_sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(bytes))
}

/// The ranges of `listed` (range, sha256) whose bytes the partial file still holds: each read back and hashed.
/// A range whose bytes differ (lost in a crash, or changed) or cannot be read is left out, to be fetched again.
fn intact_ranges(partial: &Path, size: u64, chunk_size: u64, listed: Vec<(u64, String)>) -> std::collections::HashSet<u64> {
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(partial) else { return Default::default() };
    let mut buffer = Vec::new();
    let mut intact = std::collections::HashSet::new();
    for (chunk, sha) in listed {
        let start = chunk.saturating_mul(chunk_size);
        let end = start.saturating_add(chunk_size).min(size);
        if start >= end {
            continue;
        }
        buffer.resize((end - start) as usize, 0);
        if file.read_exact_at(&mut buffer, start).is_ok() && range_sha256(&buffer) == sha {
            intact.insert(chunk);
        } else {
            tracing::warn!(file = %partial.display(), range = chunk, "a range of an interrupted download no longer holds the bytes fetched: fetched again");
        }
    }
    intact
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_remembered_until_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("nightshift-sha-memo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.gguf");
        std::fs::write(&path, b"weights").unwrap();
        let real = format!("{:x}", Sha256::digest(b"weights"));
        assert_eq!(sha256_file(&path).unwrap(), real);
        // What this process recorded is what it answers, without reading the file: a stand-in proves it.
        remember_sha256(&path, "remembered");
        assert_eq!(sha256_file(&path).unwrap(), "remembered");
        // Rewritten (same size, another time): read and hashed again.
        std::fs::write(&path, b"WEIGHTS").unwrap();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000)).unwrap();
        drop(file);
        assert_eq!(sha256_file(&path).unwrap(), format!("{:x}", Sha256::digest(b"WEIGHTS")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
