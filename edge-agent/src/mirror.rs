//! Artifact mirrors: the registry's S3-compatible bucket, or any HTTP(S) server or CDN in front
//! of it, serving artifacts at `<base>/artifacts/<BLAKE3 hex>` (`[registry] mirrors`).
//!
//! Mirrors need no trust. The agent asks one for byte ranges of the artifact its verified TUF
//! metadata names, and the shell checks the whole against the signed digest before staging it.
//! An artifact whose mirrored bytes do not match is refused (reason `digest_mismatch`), and
//! with `registry_fallback` on the agent downloads it again from the registry, skipping the
//! mirrors for that digest from then on.
//!
//! HTTP/1.1 by hyper, one connection per range; `https://` bases are verified against the
//! system's roots (rustls-native-certs).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fedfleet_protocol::Digest;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;

/// How long one range request may take before the mirror counts as unreachable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// One configured base URL.
#[derive(Debug, Clone)]
struct Base {
    https: bool,
    host: String,
    port: u16,
    /// The path before `/artifacts/…`, without a trailing `/`.
    path: String,
    url: String,
}

impl Base {
    fn parse(url: &str) -> Result<Base, String> {
        let bad = |why: &str| format!("mirror {url:?}: {why}");
        let uri: hyper::Uri = url.parse().map_err(|e| bad(&format!("not a URL ({e})")))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad("the scheme must be http or https")),
        };
        let host = uri.host().ok_or_else(|| bad("no host"))?.trim_start_matches('[').trim_end_matches(']').to_owned();
        if uri.query().is_some() {
            return Err(bad("a query string is not allowed"));
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        Ok(Base { https, host, port, path: uri.path().trim_end_matches('/').to_owned(), url: url.to_owned() })
    }
}

/// Why a mirror did not serve a range.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    #[error("{url}: no such artifact (404)")]
    NotFound { url: String },
    #[error("{url}: {detail}")]
    Failed { url: String, detail: String },
}

/// The configured mirrors, tried in order.
pub struct Mirrors {
    bases: Vec<Base>,
    tls: tokio_rustls::TlsConnector,
    /// Whether the registry serves what no mirror could (else the download waits for a mirror).
    pub registry_fallback: bool,
    /// Artifacts whose mirrored bytes were refused: fetched from the registry from then on.
    refused: Mutex<HashSet<Digest>>,
}

impl std::fmt::Debug for Mirrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.bases.iter().map(|b| &b.url)).finish()
    }
}

/// Checks mirror URLs (what config validation needs: no TLS set-up, no certificate store read).
pub fn check_urls(urls: &[String]) -> Result<(), String> {
    urls.iter().try_for_each(|u| Base::parse(u).map(|_| ()))
}

impl Mirrors {
    pub fn new(urls: &[String], registry_fallback: bool) -> Result<Mirrors, String> {
        let bases = urls.iter().map(|u| Base::parse(u)).collect::<Result<Vec<_>, _>>()?;
        let mut roots = rustls::RootCertStore::empty();
        if bases.iter().any(|b| b.https) {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS for mirrors: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Mirrors { bases, tls: tokio_rustls::TlsConnector::from(Arc::new(tls)), registry_fallback, refused: Mutex::new(HashSet::new()) })
    }

    /// Whether mirrors may serve `digest` (not refused before, when the registry can serve it).
    pub fn serves(&self, digest: &Digest) -> bool {
        if self.bases.is_empty() {
            return false;
        }
        let refused = self.registry_fallback && self.refused.lock().unwrap_or_else(|p| p.into_inner()).contains(digest);
        !refused
    }

    /// Marks `digest` as served wrong by a mirror.
    pub fn refuse(&self, digest: &Digest) {
        self.refused.lock().unwrap_or_else(|p| p.into_inner()).insert(*digest);
    }

    /// Up to `len` bytes of the artifact `digest` from `offset`, from the first mirror that has
    /// them (unverified: the caller checks the whole against the signed digest).
    pub async fn read_range(&self, digest: &Digest, offset: u64, len: u32) -> Result<Vec<u8>, MirrorError> {
        let mut last = None;
        for base in &self.bases {
            match tokio::time::timeout(REQUEST_TIMEOUT, self.get(base, digest, offset, len)).await {
                Ok(Ok(bytes)) => return Ok(bytes),
                Ok(Err(e)) => last = Some(e),
                Err(_) => last = Some(MirrorError::Failed { url: base.url.clone(), detail: format!("no answer in {REQUEST_TIMEOUT:?}") }),
            }
        }
        Err(last.unwrap_or_else(|| MirrorError::Failed { url: String::new(), detail: "no mirror configured".into() }))
    }

    async fn get(&self, base: &Base, digest: &Digest, offset: u64, len: u32) -> Result<Vec<u8>, MirrorError> {
        let path = format!("{}/artifacts/{}", base.path, digest.to_hex());
        let url = format!("{}/artifacts/{}", base.url.trim_end_matches('/'), digest.to_hex());
        let failed = |detail: String| MirrorError::Failed { url: url.clone(), detail };
        let tcp = tokio::net::TcpStream::connect((base.host.as_str(), base.port)).await.map_err(|e| failed(format!("connect: {e}")))?;
        let req = hyper::Request::get(&path)
            .header(
                hyper::header::HOST,
                if base.port == 80 || base.port == 443 { base.host.clone() } else { format!("{}:{}", base.host, base.port) },
            )
            .header(hyper::header::RANGE, format!("bytes={offset}-{}", offset + u64::from(len.max(1)) - 1))
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        let resp = if base.https {
            let name = rustls::pki_types::ServerName::try_from(base.host.clone()).map_err(|e| failed(format!("TLS name: {e}")))?;
            let tls = self.tls.connect(name, tcp).await.map_err(|e| failed(format!("TLS: {e}")))?;
            send(hyper_util::rt::TokioIo::new(tls), req).await
        } else {
            send(hyper_util::rt::TokioIo::new(tcp), req).await
        }
        .map_err(|e| failed(e.to_string()))?;
        let status = resp.status();
        if status == hyper::StatusCode::NOT_FOUND {
            return Err(MirrorError::NotFound { url });
        }
        // 206: the range; 200: the whole artifact (a server that ignores Range), taken only
        // when it fits what was asked for; 416: `offset` is past the end.
        if status == hyper::StatusCode::RANGE_NOT_SATISFIABLE {
            return Ok(Vec::new());
        }
        if !(status == hyper::StatusCode::PARTIAL_CONTENT || (status == hyper::StatusCode::OK && offset == 0)) {
            return Err(failed(format!("answered {status}")));
        }
        let body = Limited::new(resp.into_body(), len as usize)
            .collect()
            .await
            .map_err(|e| failed(format!("body: {e} (more than the {len} bytes asked for?)")))?;
        Ok(body.to_bytes().to_vec())
    }
}

async fn send<T>(io: T, req: hyper::Request<Empty<Bytes>>) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender.send_request(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bases_parse_and_bad_ones_are_named() {
        let b = Base::parse("http://127.0.0.1:8333/models/").unwrap();
        assert_eq!((b.https, b.host.as_str(), b.port, b.path.as_str()), (false, "127.0.0.1", 8333, "/models"));
        let b = Base::parse("https://cdn.example.com").unwrap();
        assert_eq!((b.https, b.port, b.path.as_str()), (true, 443, ""));
        for (url, why) in [("ftp://x/y", "scheme"), ("not a url", "not a URL"), ("http://h/p?q=1", "query")] {
            let e = Base::parse(url).unwrap_err();
            assert!(e.contains(why), "{url}: {e}");
        }
    }
}
