//! Object-store URLs (`s3://bucket/key`): uploads for `memsnap upload-agent`, reads and
//! listings for the reading commands.
//!
//! Cold, CLI only: the preload library never links this (no async runtime or HTTP stack in
//! the host process). `object_store` does the requests, with its own retries and backoff
//! and the AWS credential chain (`AWS_*` variables, web identity, instance metadata);
//! `AWS_ENDPOINT_URL` and `AWS_ALLOW_HTTP=true` point it at an S3-compatible server. Each
//! call runs on a small single-threaded runtime of its own thread.

use anyhow::{Context, Result, anyhow, bail};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, RetryConfig};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long one request is retried (with backoff) before it is a failure: long enough
/// for a server that restarts, short enough that a dead one is said within the minute.
const RETRY_FOR: Duration = Duration::from_secs(30);

/// `(bucket, key)` of an `s3://bucket/key` URL.
pub fn parse_s3(url: &str) -> Result<(&str, &str)> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| anyhow!("unsupported URL {url} (file:// and s3:// are built in)"))?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        bail!("{url} names no bucket");
    }
    Ok((bucket, key))
}

/// True for the URLs this module reads.
pub fn is_remote(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with("s3://"))
}

/// One client per bucket and one runtime, made on first use.
#[derive(Default)]
pub struct Stores {
    runtime: Option<tokio::runtime::Runtime>,
    buckets: HashMap<String, Arc<dyn ObjectStore>>,
}

impl Stores {
    fn store(&mut self, bucket: &str) -> Result<(Arc<dyn ObjectStore>, &tokio::runtime::Runtime)> {
        if self.runtime.is_none() {
            self.runtime = Some(
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("starting the upload runtime")?,
            );
        }
        let store = match self.buckets.get(bucket) {
            Some(s) => s.clone(),
            None => {
                let retry = RetryConfig {
                    retry_timeout: RETRY_FOR,
                    ..RetryConfig::default()
                };
                let s: Arc<dyn ObjectStore> = Arc::new(
                    AmazonS3Builder::from_env()
                        .with_bucket_name(bucket)
                        .with_retry(retry)
                        .build()
                        .with_context(|| format!("s3://{bucket}"))?,
                );
                self.buckets.insert(bucket.to_string(), s.clone());
                s
            }
        };
        Ok((store, self.runtime.as_ref().expect("made above")))
    }

    /// Uploads `local` to `url` whole (one PUT: the object appears complete or not at all).
    pub fn upload(&mut self, local: &Path, url: &str) -> Result<()> {
        let (bucket, key) = parse_s3(url)?;
        let bytes = std::fs::read(local).with_context(|| format!("reading {}", local.display()))?;
        let (store, rt) = self.store(bucket)?;
        let path = StorePath::from(key);
        rt.block_on(store.put(&path, bytes.into())).map_err(short)?;
        Ok(())
    }

    /// The object's bytes, as a reader that fetches chunk by chunk while it is read.
    pub fn open(mut self, url: &str) -> Result<(Box<dyn std::io::Read + Send>, u64)> {
        let (bucket, key) = parse_s3(url)?;
        let (store, rt) = self.store(bucket)?;
        let got = rt
            .block_on(store.get(&StorePath::from(key)))
            .map_err(short)
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

    /// The `*.pickle` / `*.pkl` objects under the prefix `url`, as `s3://` URLs, sorted.
    pub fn list(&mut self, url: &str) -> Result<Vec<String>> {
        let (bucket, prefix) = parse_s3(url)?;
        let (store, rt) = self.store(bucket)?;
        let prefix = prefix.trim_end_matches('/');
        let prefix = (!prefix.is_empty()).then(|| StorePath::from(prefix));
        let listed = rt
            .block_on(store.list_with_delimiter(prefix.as_ref()))
            .map_err(short)
            .with_context(|| format!("cannot list {url}"))?;
        let mut urls: Vec<String> = listed
            .objects
            .iter()
            .map(|o| o.location.to_string())
            .filter(|k| k.ends_with(".pickle") || k.ends_with(".pkl"))
            .map(|k| format!("s3://{bucket}/{k}"))
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
