//! The operator CLIs' client of the console's API (`/api/v1`): the commands
//! `fedfleet-aggregator campaign …` and `fedfleet-registry list|show|publish|rollout|device …`
//! are requests to the same operations the dashboard uses, with the same access checks and
//! the same audit.
//!
//! Who the CLI is, as the console sees it: over HTTPS (`[console] tls = true`) it presents the
//! operator certificate (`servers/NAME.crt` of the PKI directory, a service named in the
//! service's `operators`); a bearer token in `FEDFLEET_API_TOKEN` is sent instead when set;
//! over plain HTTP on loopback it is the `loopback` caller.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{ClientRequest, send};

/// The environment variable holding a bearer token for the operator commands.
pub const TOKEN_ENV: &str = "FEDFLEET_API_TOKEN";

/// How long a refused connection is tried again (a service that is starting).
const CONNECT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Where a service's console is and how to reach it.
pub struct Target<'a> {
    /// The service (`registry`, `aggregator`), for messages.
    pub service: &'a str,
    /// The config file read, for messages.
    pub config: &'a Path,
    /// The service's `[console]`, if the config has it.
    pub console: Option<&'a crate::console::ConsoleConfig>,
    /// `--addr`: another console than the config's (an unspecified address is read as
    /// 127.0.0.1). Without `[console]`, HTTPS unless it is a loopback address.
    pub addr: Option<SocketAddr>,
    /// The PKI directory holding `ca.crt` and the operator's `servers/NAME.{crt,key}`.
    pub pki_dir: &'a Path,
    /// The operator certificate's name.
    pub operator: &'a str,
    /// The name the service's certificate must carry.
    pub server_name: &'a str,
}

/// A client of one service's console.
pub struct OperatorClient {
    addr: SocketAddr,
    tls: Option<(Arc<rustls::ClientConfig>, String)>,
    bearer: Option<String>,
}

/// A request that did not get a 200 answer.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("cannot reach the console at {addr} (is the service running, with `[console]` listening there?): {detail}")]
    Unreachable { addr: SocketAddr, detail: String },
    /// The service refused or failed the request: its status and message.
    #[error("{method} {path}: {status} {message}")]
    Answered { method: &'static str, path: String, status: u16, message: String },
    #[error("{path}: the answer is not what this CLI expects: {detail}")]
    Unexpected { path: String, detail: String },
}

impl OperatorError {
    /// The HTTP status the service answered with, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            OperatorError::Answered { status, .. } => Some(*status),
            _ => None,
        }
    }
}

impl OperatorClient {
    /// A client of `target`'s console; over HTTPS it loads the CA and, unless a token is set in
    /// [`TOKEN_ENV`], the operator certificate.
    pub fn new(target: &Target) -> Result<OperatorClient, String> {
        let Some(mut addr) = target.addr.or(target.console.map(|c| c.listen)) else {
            return Err(format!(
                "operator commands use the {} console's API: {} has no [console] (its `listen` address), and no --addr was given",
                target.service,
                target.config.display()
            ));
        };
        let tls = target.console.map_or(!addr.ip().is_loopback(), |c| c.tls);
        if addr.ip().is_unspecified() {
            addr = SocketAddr::new([127, 0, 0, 1].into(), addr.port());
        }
        let bearer = std::env::var(TOKEN_ENV).ok().filter(|t| !t.trim().is_empty());
        let tls = if tls {
            let pki = fedfleet_certs::Pki::open(target.pki_dir)
                .map_err(|e| format!("opening the PKI directory {} for the console's CA: {e}", target.pki_dir.display()))?;
            let config = match &bearer {
                Some(_) => fedfleet_certs::tls::anonymous_client_config(pki.ca(), &[]),
                None => {
                    let id = fedfleet_certs::ServerIdentity::load(target.pki_dir, target.operator).map_err(|e| {
                        format!(
                            "operator commands present the operator certificate {:?} (fedfleet-certs issue-server --name {}) or a token in {TOKEN_ENV}: {e}",
                            target.operator, target.operator
                        )
                    })?;
                    fedfleet_certs::tls::service_client_config(pki.ca(), &id, &[])
                }
            }
            .map_err(|e| format!("TLS client for the console: {e}"))?;
            Some((Arc::new(config), target.server_name.to_owned()))
        } else {
            None
        };
        Ok(OperatorClient { addr, tls, bearer })
    }

    /// The console's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Result<Value, OperatorError> {
        self.request("GET", path, None, None).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, OperatorError> {
        self.request("POST", path, Some(body.to_string().into_bytes()), None).await
    }

    /// `POST path` with `body` when there is one (an operation), else `GET path` (a view).
    pub async fn get_or_post(&self, path: &str, body: Option<&Value>) -> Result<Value, OperatorError> {
        match body {
            Some(body) => self.post(path, body).await,
            None => self.get(path).await,
        }
    }

    /// `POST path` with bytes (an upload operation).
    pub async fn upload(&self, path: &str, bytes: Bytes) -> Result<Value, OperatorError> {
        self.request("POST", path, None, Some(bytes)).await
    }

    async fn request(
        &self,
        method: &'static str,
        path: &str,
        json: Option<Vec<u8>>,
        octets: Option<Bytes>,
    ) -> Result<Value, OperatorError> {
        let r = ClientRequest { method, path, bearer: self.bearer.as_deref(), json, octets, tls: self.tls.clone() };
        // A service started a moment ago may not listen yet: a refused connection (the request
        // never reached it, so a retry is safe) is tried again for a while.
        let started = std::time::Instant::now();
        let (status, body) = loop {
            match send(self.addr, &r).await {
                Ok(answer) => break answer,
                Err(crate::ScrapeError::Io(e))
                    if e.kind() == std::io::ErrorKind::ConnectionRefused && started.elapsed() < CONNECT_PATIENCE =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(e) => return Err(OperatorError::Unreachable { addr: self.addr, detail: e.to_string() }),
            }
        };
        let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status == 200 {
            return Ok(value);
        }
        let message = value["error"].as_str().map_or_else(|| String::from_utf8_lossy(&body).into_owned(), str::to_owned);
        Err(OperatorError::Answered { method, path: path.to_owned(), status, message })
    }
}

/// Decodes an answer into the type the CLI prints.
pub fn decode<T: DeserializeOwned>(path: &str, v: Value) -> Result<T, OperatorError> {
    serde_json::from_value(v).map_err(|e| OperatorError::Unexpected { path: path.to_owned(), detail: e.to_string() })
}

/// `?k=v&...`, form-encoded (empty when `pairs` is).
pub fn query(pairs: &[(&str, String)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let mut q = form_urlencoded::Serializer::for_suffix(String::from("?"), 1);
    for (k, v) in pairs {
        q.append_pair(k, v);
    }
    q.finish()
}

/// Percent-encodes a path segment (a model, alias, rollout or device name).
pub fn segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_path_segments_are_percent_encoded() {
        assert_eq!(query(&[]), "");
        assert_eq!(query(&[("spec", r#"{"a": [1]}"#.into()), ("n", "x&y=z".into())]), "?spec=%7B%22a%22%3A+%5B1%5D%7D&n=x%26y%3Dz");
        assert_eq!(segment("digits v2/x"), "digits%20v2%2Fx");
    }
}
