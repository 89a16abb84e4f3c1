//! The services' HTTP surface: `GET /metrics` in the Prometheus/OpenMetrics text format, through
//! kept libraries (axum for HTTP, prometheus-client for the format). One implementation for every
//! service. [`console`]: the operator API and dashboard, on a listener of their own.
//!
//! ```no_run
//! # async fn demo(metrics: std::sync::Arc<dyn fedfleet_http::MetricsSource>) -> std::io::Result<()> {
//! let listener = fedfleet_http::bind("127.0.0.1:9464".parse().unwrap(), false).await?;
//! tokio::spawn(fedfleet_http::serve_metrics(listener, metrics));
//! # Ok(()) }
//! ```

pub mod console;
pub mod operator;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

pub use prometheus_client;

/// The content type of the OpenMetrics text prometheus-client writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Label sets both services use.
pub mod labels {
    use prometheus_client::encoding::EncodeLabelSet;

    /// `reason`: a refusal's named reason.
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    pub struct Reason {
        pub reason: String,
    }

    /// `event`: what happened (round events, rollout events).
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    pub struct Event {
        pub event: String,
    }

    /// `step`: a stage of work (e.g. of ingesting one update).
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    pub struct Step {
        pub step: String,
    }

    /// `metric`: a model evaluation metric's name (`accuracy`, `loss`, ...).
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    pub struct Metric {
        pub metric: String,
    }

    /// `device`: a device id.
    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    pub struct Device {
        pub device: String,
    }
}

/// Keeps `gauge` at the seconds until a service's own certificate expires: `check` (which also
/// logs the warning, e.g. `fedfleet_certs::renewal::warn_if_expiring`) runs now and every
/// `every` until the task is dropped.
pub async fn watch_certificate_expiry(
    gauge: prometheus_client::metrics::gauge::Gauge,
    every: std::time::Duration,
    check: impl Fn() -> i64,
) {
    loop {
        gauge.set(check());
        tokio::time::sleep(every).await;
    }
}

/// Something that renders its metrics as exposition text at scrape time.
pub trait MetricsSource: Send + Sync + 'static {
    fn render(&self) -> String;
}

/// Encodes a prometheus-client registry as exposition text.
pub fn encode(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// Binds the metrics listener; refuses a non-loopback address unless `allow_public` (metrics
/// name devices and carry no authentication).
pub async fn bind(addr: SocketAddr, allow_public: bool) -> std::io::Result<tokio::net::TcpListener> {
    if !addr.ip().is_loopback() && !allow_public {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("metrics address {addr} is not loopback (set metrics_public = true to allow)"),
        ));
    }
    tokio::net::TcpListener::bind(addr).await
}

/// The router: `GET /metrics`; every other path is 404.
pub fn router(source: Arc<dyn MetricsSource>) -> axum::Router {
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let source = source.clone();
                async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], source.render()) }
            }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n").into_response() })
}

/// Serves [`router`] on `listener` until the task is dropped.
pub async fn serve_metrics(listener: tokio::net::TcpListener, source: Arc<dyn MetricsSource>) {
    if let Err(e) = axum::serve(listener, router(source)).await {
        tracing::warn!(error = %e, "metrics endpoint stopped");
    }
}

/// (VmRSS, VmHWM) of this process in bytes, from /proc/self/status (0 where unavailable).
pub fn process_memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// GETs `http://addr{path}` over HTTP/1.1 with hyper (tests, benchmarks, `status` commands):
/// (status code, body).
pub async fn scrape(addr: SocketAddr, path: &str) -> Result<(u16, String), ScrapeError> {
    let (status, body) = scrape_bytes(addr, path).await?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// [`scrape`], the body as bytes.
pub async fn scrape_bytes(addr: SocketAddr, path: &str) -> Result<(u16, Vec<u8>), ScrapeError> {
    send(addr, &ClientRequest { method: "GET", path, ..ClientRequest::default() }).await
}

/// One HTTP/1.1 request of [`send`].
#[derive(Default)]
pub struct ClientRequest<'a> {
    pub method: &'a str,
    pub path: &'a str,
    /// `Authorization: Bearer ...`.
    pub bearer: Option<&'a str>,
    /// A JSON body (`Content-Type: application/json`).
    pub json: Option<Vec<u8>>,
    /// A byte body (`Content-Type: application/octet-stream`): an upload.
    pub octets: Option<axum::body::Bytes>,
    /// HTTPS: the client config (its certificate, if any, is presented) and the server's name.
    pub tls: Option<(Arc<rustls::ClientConfig>, String)>,
}

/// Sends `r` to `addr` with hyper (over tokio-rustls for HTTPS): (status code, body).
pub async fn send(addr: SocketAddr, r: &ClientRequest<'_>) -> Result<(u16, Vec<u8>), ScrapeError> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    match &r.tls {
        None => exchange(stream, addr, r).await,
        Some((config, name)) => {
            let mut config = (**config).clone();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            let name = rustls::pki_types::ServerName::try_from(name.clone()).map_err(|e| ScrapeError::Request(e.to_string()))?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, stream).await?;
            exchange(tls, addr, r).await
        }
    }
}

async fn exchange<Io>(io: Io, addr: SocketAddr, r: &ClientRequest<'_>) -> Result<(u16, Vec<u8>), ScrapeError>
where
    Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await?;
    tokio::spawn(conn);
    let mut req = axum::http::Request::builder().method(r.method).uri(r.path).header(header::HOST, addr.to_string());
    if let Some(token) = r.bearer {
        req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = match (&r.json, &r.octets) {
        (Some(json), _) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            axum::body::Bytes::from(json.clone())
        }
        (None, Some(octets)) => {
            req = req.header(header::CONTENT_TYPE, "application/octet-stream");
            octets.clone()
        }
        (None, None) => axum::body::Bytes::new(),
    };
    let body = http_body_util::Full::new(body);
    let req = req.body(body).map_err(|e| ScrapeError::Request(e.to_string()))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body.to_vec()))
}

/// Why [`scrape`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("connect: {0}")]
    Io(std::io::Error),
    #[error("http: {0}")]
    Http(hyper::Error),
    #[error("request: {0}")]
    Request(String),
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<hyper::Error> for ScrapeError {
    fn from(e: hyper::Error) -> Self {
        ScrapeError::Http(e)
    }
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<std::io::Error> for ScrapeError {
    fn from(e: std::io::Error) -> Self {
        ScrapeError::Io(e)
    }
}
