//! Object-store URLs (`s3://bucket/key`, `gs://bucket/key`, `az://container/key`): uploads
//! for `memsnap upload-agent`, reads and listings for the reading commands.
//!
//! Cold, CLI only: the preload library never links this (no async runtime or HTTP stack in
//! the host process). `object_store` does the requests, with its own retries and backoff
//! and each service's usual credentials, read from the environment by its builders:
//! - S3: the AWS chain (`AWS_*` variables, web identity, instance metadata);
//!   `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP=true` point it at an S3-compatible server.
//! - Google Cloud Storage: `GOOGLE_SERVICE_ACCOUNT` / `GOOGLE_SERVICE_ACCOUNT_PATH` /
//!   `GOOGLE_SERVICE_ACCOUNT_KEY`, `GOOGLE_APPLICATION_CREDENTIALS` (or gcloud's
//!   application-default file), then instance metadata;
//!   a service-account file's `gcs_base_url` (with `disable_oauth`) points it at another
//!   server.
//! - Azure Blob Storage: `AZURE_STORAGE_ACCOUNT_NAME` with `AZURE_STORAGE_ACCOUNT_KEY`, a SAS
//!   (`AZURE_STORAGE_SAS_KEY`), a service principal, or managed identity;
//!   `AZURE_STORAGE_USE_EMULATOR=true` (with `AZURITE_BLOB_STORAGE_URL`) targets Azurite.
//!
//! Each call runs on a small single-threaded runtime of its own thread.

use anyhow::{Context, Result, anyhow, bail};
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, RetryConfig};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long one request is retried (with backoff) before it is a failure: long enough
/// for a server that restarts, short enough that a dead one is said within the minute.
const RETRY_FOR: Duration = Duration::from_secs(30);

/// The object-store URL schemes read and written here (`MEMSNAP_REMOTE` accepts the same,
/// see `memsnap_format::config::REMOTE_SCHEMES`).
pub const SCHEMES: &[&str] = &["s3", "gs", "az"];

/// An object-store URL taken apart: `scheme://bucket/key` (the bucket is an Azure
/// container for `az://`).
#[derive(Debug, PartialEq, Eq)]
pub struct ObjectUrl<'a> {
    pub scheme: &'a str,
    pub bucket: &'a str,
    pub key: &'a str,
}

/// Parses an `s3://`, `gs://` or `az://` URL.
pub fn parse_url(url: &str) -> Result<ObjectUrl<'_>> {
    let (scheme, rest) = url
        .split_once("://")
        .filter(|(scheme, _)| SCHEMES.contains(scheme))
        .ok_or_else(|| {
            anyhow!("unsupported URL {url} (file://, s3://, gs:// and az:// are built in)")
        })?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        bail!("{url} names no bucket");
    }
    Ok(ObjectUrl {
        scheme,
        bucket,
        key,
    })
}

/// True for the URLs this module reads.
pub fn is_remote(path: &Path) -> bool {
    path.to_str().is_some_and(|s| {
        s.split_once("://")
            .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme))
    })
}

/// A client of one bucket (or container), its credentials and endpoint from the
/// environment.
fn build_store(scheme: &str, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    let retry = RetryConfig {
        retry_timeout: RETRY_FOR,
        ..RetryConfig::default()
    };
    let built: object_store::Result<Arc<dyn ObjectStore>> = match scheme {
        "s3" => AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as _),
        "gs" => GoogleCloudStorageBuilder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as _),
        "az" => MicrosoftAzureBuilder::from_env()
            .with_container_name(bucket)
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as _),
        other => bail!("unsupported URL scheme {other}://"),
    };
    // The callers name the URL; this says what is wrong with the setup (credentials).
    built.map_err(short)
}

/// One client per bucket and one runtime, made on first use.
#[derive(Default)]
pub struct Stores {
    runtime: Option<tokio::runtime::Runtime>,
    /// By `scheme://bucket`.
    buckets: HashMap<String, Arc<dyn ObjectStore>>,
}

impl Stores {
    fn store(
        &mut self,
        url: &ObjectUrl,
    ) -> Result<(Arc<dyn ObjectStore>, &tokio::runtime::Runtime)> {
        if self.runtime.is_none() {
            self.runtime = Some(
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("starting the upload runtime")?,
            );
        }
        let id = format!("{}://{}", url.scheme, url.bucket);
        let store = match self.buckets.get(&id) {
            Some(s) => s.clone(),
            None => {
                let s = build_store(url.scheme, url.bucket)?;
                self.buckets.insert(id, s.clone());
                s
            }
        };
        Ok((store, self.runtime.as_ref().expect("made above")))
    }

    /// Uploads `local` to `url` whole (one PUT: the object appears complete or not at all).
    pub fn upload(&mut self, local: &Path, url: &str) -> Result<()> {
        let parsed = parse_url(url)?;
        let bytes = std::fs::read(local).with_context(|| format!("reading {}", local.display()))?;
        let (store, rt) = self.store(&parsed)?;
        let path = StorePath::from(parsed.key);
        rt.block_on(store.put(&path, bytes.into())).map_err(short)?;
        Ok(())
    }

    /// The object's bytes, as a reader that fetches chunk by chunk while it is read.
    pub fn open(mut self, url: &str) -> Result<(Box<dyn std::io::Read + Send>, u64)> {
        let parsed = parse_url(url)?;
        let got = self
            .store(&parsed)
            .and_then(|(store, rt)| {
                rt.block_on(store.get(&StorePath::from(parsed.key)))
                    .map_err(short)
            })
            .with_context(|| format!("cannot read {url}"))?;
        let size = got.meta.size;
        let stream = got.into_stream();
        let runtime = self.runtime.take().expect("made by store()");
        Ok((
            Box::new(StreamReader {
                runtime,
                stream,
                chunk: Default::default(),
                at: 0,
                url: url.to_string(),
            }),
            size,
        ))
    }

    /// The `*.pickle` / `*.pkl` objects under the prefix `url`, as URLs of its scheme
    /// and bucket, sorted.
    pub fn list(&mut self, url: &str) -> Result<Vec<String>> {
        let parsed = parse_url(url)?;
        let prefix = parsed.key.trim_end_matches('/');
        let prefix = (!prefix.is_empty()).then(|| StorePath::from(prefix));
        let listed = self
            .store(&parsed)
            .and_then(|(store, rt)| {
                rt.block_on(store.list_with_delimiter(prefix.as_ref()))
                    .map_err(short)
            })
            .with_context(|| format!("cannot list {url}"))?;
        let mut urls: Vec<String> = listed
            .objects
            .iter()
            .map(|o| o.location.to_string())
            .filter(|k| k.ends_with(".pickle") || k.ends_with(".pkl"))
            .map(|k| format!("{}://{}/{k}", parsed.scheme, parsed.bucket))
            .collect();
        urls.sort();
        Ok(urls)
    }
}

/// The first line of an object-store error (they can carry a whole response body).
fn short(e: object_store::Error) -> anyhow::Error {
    let text = e.to_string();
    anyhow!("{}", text.lines().next().unwrap_or(&text))
}

/// A blocking `Read` over an object's body stream.
struct StreamReader {
    runtime: tokio::runtime::Runtime,
    stream: futures::stream::BoxStream<'static, object_store::Result<bytes::Bytes>>,
    chunk: bytes::Bytes,
    at: usize,
    url: String,
}

impl std::io::Read for StreamReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use futures::StreamExt;
        while self.at == self.chunk.len() {
            match self.runtime.block_on(self.stream.next()) {
                None => return Ok(0),
                Some(Ok(next)) => {
                    self.chunk = next;
                    self.at = 0;
                }
                Some(Err(e)) => {
                    return Err(std::io::Error::other(format!(
                        "reading {}: {}",
                        self.url,
                        short(e)
                    )));
                }
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::{ObjectUrl, is_remote, parse_url};
    use std::path::Path;

    #[test]
    fn object_urls_name_a_scheme_a_bucket_and_a_key() {
        for (url, scheme, bucket, key) in [
            (
                "s3://b/run/r0/exit-1.pickle",
                "s3",
                "b",
                "run/r0/exit-1.pickle",
            ),
            ("gs://my.bucket/run/", "gs", "my.bucket", "run/"),
            ("az://snaps/x.pickle", "az", "snaps", "x.pickle"),
            ("az://snaps", "az", "snaps", ""),
        ] {
            assert_eq!(
                parse_url(url).unwrap(),
                ObjectUrl {
                    scheme,
                    bucket,
                    key
                }
            );
            assert!(is_remote(Path::new(url)), "{url}");
        }
        for bad in ["gs:///x.pickle", "abfs://c/x", "http://h/x", "x.pickle"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        assert!(!is_remote(Path::new("file:///snaps/x.pickle")));
        assert!(!is_remote(Path::new("snaps/az://x")));
    }
}
