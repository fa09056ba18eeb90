//! Object-store URLs -> stores. Shared by the source (inputs) and the sink (outputs).
//!
//! Stores are built from the standard environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`) so credentials never appear in
//! job files, with retries and timeouts set for batch work: large range reads of Parquet column chunks need more
//! than object_store's 30 s whole-request default.

use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreScheme, RetryConfig};
use url::Url;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("`{url}` is not a valid URL or path")]
    BadUrl { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error("`{url}`: the `{scheme}` scheme is not supported (use a local path, file://, s3://, gs:// or az://)")]
    Unsupported { url: String, scheme: String },
    #[error("cannot set up the object store for `{url}`")]
    Build { url: String, #[source] source: object_store::Error },
}

/// A store and a path inside it, with the URL as the user wrote it for messages.
#[derive(Clone, Debug)]
pub struct Location {
    pub store: Arc<dyn ObjectStore>,
    pub path: Path,
    pub url: String,
}

impl Location {
    /// The user-facing name of an object under this store (`s3://bucket/key` or a local path).
    pub fn display(&self, path: &Path) -> String {
        match self.url.find("://") {
            Some(i) if !self.url.starts_with("file://") => {
                let scheme = &self.url[..i];
                let bucket = self.url[i + 3..].split('/').next().unwrap_or_default();
                format!("{scheme}://{bucket}/{path}")
            }
            _ => format!("/{path}"),
        }
    }
}

/// Retries with jittered exponential backoff. object_store draws each wait uniformly between the initial wait
/// and `base` times the previous one, so with its default base of 2 the mean wait hardly grows: its 10 retries
/// from 100 ms give up after a few seconds of a store being unreachable (measured: 1.5 to 2.5 s; 20 retries
/// took 19 s). A nightly job should ride out a minute or two of an endpoint restarting or throttling: base 3
/// makes the mean wait grow 1.5x per retry, 20 retries from 250 ms with waits of at most 20 s, all within
/// object_store's 3-minute bound (requests are retried without re-signing, so the bound stays under 5 minutes).
/// `NIGHTSHIFT_STORE_RETRY_S` sets that bound in seconds: longer to ride out longer outages, shorter to fail fast.
fn retry() -> RetryConfig {
    RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: std::time::Duration::from_millis(250),
            max_backoff: std::time::Duration::from_secs(20),
            base: 3.0,
        },
        max_retries: 20,
        retry_timeout: std::time::Duration::from_secs(std::env::var("NIGHTSHIFT_STORE_RETRY_S").ok().and_then(|v| v.parse().ok()).unwrap_or(180)),
    }
}

/// Whole-request timeout when the environment sets none: long enough for a large column chunk on a slow link.
const REQUEST_TIMEOUT: &str = "300s";
const CONNECT_TIMEOUT: &str = "10s";

/// Sets the request and connect timeouts on a store builder, unless the environment sets them
/// (`<PREFIX>_TIMEOUT`, `<PREFIX>_CONNECT_TIMEOUT`, which `from_env` has read already).
fn with_timeouts<B>(mut builder: B, env_prefix: &str, set: impl Fn(B, ClientConfigKey, &str) -> B) -> B {
    for (key, name, value) in
        [(ClientConfigKey::Timeout, "TIMEOUT", REQUEST_TIMEOUT), (ClientConfigKey::ConnectTimeout, "CONNECT_TIMEOUT", CONNECT_TIMEOUT)]
    {
        if std::env::var_os(format!("{env_prefix}_{name}")).is_none() {
            builder = set(builder, key, value);
        }
    }
    builder
}

/// The cloud stores' TLS is rustls with the ring provider (no C/cmake crypto build); it is installed once, before
/// the first client is built.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An error means another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The absolute local path a plain path or `file://` URL names (`..` resolved against the file system, as the
/// kernel would: [`crate::files::absolute`]); `None` for another scheme.
pub fn local_path(url: &str) -> Option<Result<std::path::PathBuf, String>> {
    let has_scheme = url.contains("://");
    if has_scheme && !url.starts_with("file://") {
        return None;
    }
    let local = if has_scheme {
        match Url::parse(url).map_err(|e| e.to_string()).and_then(|u| u.to_file_path().map_err(|()| "not a file path".to_string())) {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        }
    } else {
        std::path::PathBuf::from(url)
    };
    Some(crate::files::absolute(&local).ok_or_else(|| "the current directory cannot be read".to_string()))
}

/// Resolves a local path or a URL to a store. Local relative paths are taken from the current directory.
pub fn resolve(url: &str) -> Result<Location, StoreError> {
    let bad = |e: Box<dyn std::error::Error + Send + Sync>| StoreError::BadUrl { url: url.into(), source: e };
    if let Some(local) = local_path(url) {
        let absolute = local.map_err(|e| bad(e.into()))?;
        let path = Path::from_absolute_path(&absolute).map_err(|e| bad(e.into()))?;
        return Ok(Location { store: Arc::new(LocalFileSystem::new()), path, url: url.into() });
    }
    install_crypto_provider();
    let parsed = Url::parse(url).map_err(|e| bad(e.into()))?;
    let (scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|e| bad(e.into()))?;
    let build = |e| StoreError::Build { url: url.into(), source: e };
    let store: Arc<dyn ObjectStore> = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let b = AmazonS3Builder::from_env().with_url(url).with_retry(retry());
            let b = with_timeouts(b, "AWS", |b, key, value| b.with_config(AmazonS3ConfigKey::Client(key), value));
            Arc::new(b.build().map_err(build)?)
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            let b = GoogleCloudStorageBuilder::from_env().with_url(url).with_retry(retry());
            let b = with_timeouts(b, "GOOGLE", |b, key, value| b.with_config(GoogleConfigKey::Client(key), value));
            Arc::new(b.build().map_err(build)?)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let b = MicrosoftAzureBuilder::from_env().with_url(url).with_retry(retry());
            let b = with_timeouts(b, "AZURE", |b, key, value| b.with_config(AzureConfigKey::Client(key), value));
            Arc::new(b.build().map_err(build)?)
        }
        other => {
            let scheme = format!("{other:?}");
            return Err(StoreError::Unsupported { url: url.into(), scheme });
        }
    };
    Ok(Location { store, path, url: url.into() })
}

/// An `http://` or `https://` URL as a store: its origin (`scheme://host:port`) is the store, the rest the path.
/// Plain HTTP has no listing, so only named files can be read (models fetched by name: `source::model`).
pub fn resolve_http(url: &str) -> Result<Location, StoreError> {
    let bad = |e: Box<dyn std::error::Error + Send + Sync>| StoreError::BadUrl { url: url.into(), source: e };
    install_crypto_provider();
    let parsed = Url::parse(url).map_err(|e| bad(e.into()))?;
    let (ObjectStoreScheme::Http, path) = ObjectStoreScheme::parse(&parsed).map_err(|e| bad(e.into()))? else {
        return Err(bad("not an http:// or https:// URL".into()));
    };
    let origin = &parsed[..url::Position::BeforePath];
    let mut options = object_store::ClientOptions::new().with_allow_http(true);
    for (key, value) in [(ClientConfigKey::Timeout, REQUEST_TIMEOUT), (ClientConfigKey::ConnectTimeout, CONNECT_TIMEOUT)] {
        options = options.with_config(key, value);
    }
    let store = HttpBuilder::new().with_url(origin).with_client_options(options).with_retry(retry()).build();
    let store = store.map_err(|e| StoreError::Build { url: url.into(), source: e })?;
    Ok(Location { store: Arc::new(store), path, url: url.into() })
}

/// The characters that make a URL a glob.
const GLOB_CHARS: [char; 3] = ['*', '?', '['];

pub fn is_glob(s: &str) -> bool {
    s.contains(GLOB_CHARS)
}

/// A glob's literal directory: everything up to the `/` before its first glob character (empty when the pattern
/// starts at once). The input lists files under it and matches the rest against the pattern.
pub fn glob_prefix(url: &str) -> &str {
    let literal = &url[..url.find(GLOB_CHARS).unwrap_or(url.len())];
    &literal[..literal.rfind('/').map_or(0, |i| i + 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_relative_paths_become_absolute() {
        let loc = resolve("data/in.parquet").unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(format!("/{}", loc.path), cwd.join("data/in.parquet").to_string_lossy());
    }

    #[test]
    fn s3_url_names_bucket_and_key() {
        std::env::set_var("AWS_REGION", "us-east-1");
        let loc = resolve("s3://bucket/some/key.parquet").unwrap();
        assert_eq!(loc.path.as_ref(), "some/key.parquet");
        assert_eq!(loc.display(&loc.path), "s3://bucket/some/key.parquet");
    }

    #[test]
    fn unsupported_scheme_is_named() {
        let e = resolve("ftp://host/x.parquet").unwrap_err().to_string();
        assert!(e.contains("ftp://host/x.parquet"), "{e}");
    }
}
