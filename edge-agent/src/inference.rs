//! The local inference endpoint: a unix socket speaking line-delimited JSON.
//!
//! Request (one line): `{"inputs": [[f32, ...], ...]}` — one row per example, `input_len`
//! values each (a row with one extra value, e.g. a CSV label, has it ignored).
//! Response (one line): `{"model": {"name":..,"version":..,"digest":..}, "predictions":
//! [{"label": 3, "probs": [...]}, ...], "latency_us": 812}` or `{"error": "..."}`. A regression
//! model answers `{"values": [...]}` per example, an autoencoder `{"values": [...],
//! "anomaly_score": 0.013}` (the mean squared reconstruction error).
//! Any number of requests per connection. The model is read from [`Serving`] per request, so
//! activations during updates take effect on the next request without dropping connections.
//!
//! With an [`Inbox`], the application also pushes labelled examples for training:
//! `{"examples": [{"input": [f32, ...], "label": 3}, ...]}` (regression: `"target": [f32, ...]`)
//! is answered, once they are durably stored, with `{"inbox": {"stored":.., "examples":..,
//! "bytes":.., "dropped":.., "fresh":..}}` or `{"error": "example 2: ..."}` (nothing stored).

use std::path::Path;

use fedfleet_learning::{Normalization, Prediction};
use fedfleet_protocol::ModelRef;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::agent::{Served, Serving};
use crate::inbox::{Example, Feedback, Inbox, InboxError, InboxStats};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub inputs: Vec<Vec<f32>>,
    /// Keep the inputs so that the application can answer the predictions later
    /// (`{"feedback": [...]}`); the response then carries one id per row.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub feedback: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub predictions: Vec<Prediction>,
    #[serde(default)]
    pub latency_us: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The inbox after a push.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbox: Option<InboxStats>,
    /// With `"feedback": true`: the id of each prediction, for `{"feedback": [...]}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<u64>,
}

impl Response {
    fn error(e: impl Into<String>) -> Self {
        Response { error: Some(e.into()), ..Response::default() }
    }

    fn pushed(stats: InboxStats) -> Self {
        Response { inbox: Some(stats), ..Response::default() }
    }
}

/// A push of labelled examples into the inbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Push {
    pub examples: Vec<Example>,
}

/// Answers to predictions asked with `"feedback": true`, for the inbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackPush {
    pub feedback: Vec<Feedback>,
}

/// Answers one request with the served model (blocking). Rows are raw feature values;
/// `normalization` is the one the model was trained with (`[data]`), applied here so that
/// inference sees what training saw.
pub fn answer(served: Option<Served>, req: &Request, normalization: &Normalization) -> Response {
    let Some(s) = served else { return Response::error("no active model") };
    let n_in = s.predictor.input_len();
    let mut flat = Vec::with_capacity(req.inputs.len() * n_in);
    for (i, row) in req.inputs.iter().enumerate() {
        if row.len() != n_in {
            let hint = if row.len() == n_in + 1 { " (is the label column still in?)" } else { "" };
            return Response::error(format!("row {i} has {} values, the model takes {n_in}{hint}", row.len()));
        }
        flat.extend_from_slice(row);
    }
    normalization.apply(&mut flat);
    let started = std::time::Instant::now();
    match s.predictor.predict(&flat, req.inputs.len()) {
        Ok(predictions) => {
            Response { model: Some(s.model), predictions, latency_us: started.elapsed().as_micros() as u64, ..Response::default() }
        }
        Err(e) => Response::error(e),
    }
}

/// Connections the inference socket serves at once (more are closed at once and logged).
const MAX_CONNECTIONS: usize = 256;

/// Serves `serving` on a unix socket at `path` until `shutdown` resolves.
pub async fn serve_unix(
    path: &Path,
    serving: Serving,
    normalization: Normalization,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    serve_unix_with_inbox(path, serving, normalization, None, shutdown).await
}

/// [`serve_unix`], also taking pushes into `inbox`.
pub async fn serve_unix_with_inbox(
    path: &Path,
    serving: Serving,
    normalization: Normalization,
    inbox: Option<Inbox>,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let listener = bind(path)?;
    serve_listener(listener, path, serving, normalization, inbox, shutdown).await
}

/// Binds the inference socket at `path` (replacing a stale one a stopped daemon left).
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path)
}

/// Serves a socket bound by [`bind`] at `path` until `shutdown` resolves, then removes it.
pub async fn serve_listener(
    listener: UnixListener,
    path: &Path,
    serving: Serving,
    normalization: Normalization,
    inbox: Option<Inbox>,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    tracing::info!(socket = %path.display(), "inference endpoint listening");
    let mut handlers = fedfleet_net::serve::accept_until(
        &listener,
        MAX_CONNECTIONS,
        shutdown,
        || tracing::warn!(limit = MAX_CONNECTIONS, "inference connection refused: too many open"),
        |stream| {
            let serving = serving.clone();
            let inbox = inbox.clone();
            async move {
                if let Err(e) = handle(stream, serving, normalization, inbox).await {
                    tracing::debug!(error = %e, "inference connection ended");
                }
            }
        },
    )
    .await;
    // Connections still open end with the endpoint.
    handlers.shutdown().await;
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// Longest request line without an inbox (an inference batch): 8 MiB.
const MAX_REQUEST_LINE: usize = 8 << 20;

/// What one bounded read of a line found.
#[derive(Debug, PartialEq)]
enum Line {
    /// A whole line is in the buffer (without its newline).
    Read,
    /// The line went past the limit: what was read of it is dropped, the rest skipped.
    TooLong,
    /// The connection ended.
    End,
}

/// Reads one line of at most `max` bytes into `buf`, never holding more than `max` bytes of a
/// longer one: memory stays bounded whatever a client sends.
async fn read_line_bounded<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R, buf: &mut Vec<u8>, max: usize) -> std::io::Result<Line> {
    buf.clear();
    let mut too_long = false;
    loop {
        let available = r.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (too_long, buf.is_empty()) {
                (true, _) => Line::TooLong,
                (false, true) => Line::End,
                (false, false) => Line::Read,
            });
        }
        let (chunk, end) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], Some(i + 1)),
            None => (available, None),
        };
        if !too_long && buf.len() + chunk.len() <= max {
            buf.extend_from_slice(chunk);
        } else {
            too_long = true;
            buf.clear();
        }
        let used = end.unwrap_or(available.len());
        r.consume(used);
        if end.is_some() {
            return Ok(if too_long { Line::TooLong } else { Line::Read });
        }
    }
}

async fn handle(stream: UnixStream, serving: Serving, normalization: Normalization, inbox: Option<Inbox>) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let max = inbox.as_ref().map_or(MAX_REQUEST_LINE, |i| i.max_push_line().max(MAX_REQUEST_LINE));
    let mut buf = Vec::new();
    loop {
        let resp = match read_line_bounded(&mut r, &mut buf, max).await? {
            Line::End => return Ok(()),
            Line::TooLong => Response::error(format!("request line longer than {max} bytes: refused, nothing stored")),
            Line::Read => match std::str::from_utf8(&buf) {
                Err(e) => Response::error(format!("request is not UTF-8 text (invalid byte at {})", e.valid_up_to())),
                Ok(line) if line.trim().is_empty() => continue,
                Ok(line) => respond(line, &serving, normalization, inbox.as_ref()).await,
            },
        };
        let mut out = serde_json::to_vec(&resp).expect("response serializes");
        out.push(b'\n');
        w.write_all(&out).await?;
    }
}

/// The keys that tell a push, feedback and an inference request apart, read without building
/// their values.
#[derive(Deserialize, Default)]
struct Keys {
    examples: Option<serde::de::IgnoredAny>,
    feedback: Option<serde::de::IgnoredAny>,
    inputs: Option<serde::de::IgnoredAny>,
}

/// The answer to one line: a push, feedback, or an inference request (told apart by their key).
async fn respond(line: &str, serving: &Serving, normalization: Normalization, inbox: Option<&Inbox>) -> Response {
    let keys = serde_json::from_str::<Keys>(line).unwrap_or_default();
    // Storing into the inbox flushes to disk before it is acknowledged.
    let store = async |what: &str, work: Box<dyn FnOnce(Inbox) -> Result<InboxStats, InboxError> + Send>| {
        let Some(inbox) = inbox.cloned() else { return Response::error("this agent has no inbox") };
        match tokio::task::spawn_blocking(move || work(inbox)).await {
            Ok(Ok(stats)) => Response::pushed(stats),
            Ok(Err(e)) => Response::error(e.to_string()),
            Err(e) => Response::error(format!("inbox {what} panicked: {e}")),
        }
    };
    if keys.examples.is_some() {
        return match serde_json::from_str::<Push>(line) {
            Ok(push) => store("push", Box::new(move |inbox| inbox.push(&push.examples))).await,
            Err(e) => Response::error(format!("bad push: {e}")),
        };
    }
    if keys.feedback.is_some() && keys.inputs.is_none() {
        return match serde_json::from_str::<FeedbackPush>(line) {
            Ok(f) => store("feedback", Box::new(move |inbox| inbox.feedback(&f.feedback))).await,
            Err(e) => Response::error(format!("bad feedback: {e}")),
        };
    }
    let req = match serde_json::from_str::<Request>(line) {
        Ok(req) => req,
        Err(e) => return Response::error(format!("bad request: {e}")),
    };
    let (served, inbox) = (serving.get(), inbox.cloned());
    tokio::task::spawn_blocking(move || {
        let mut resp = answer(served, &req, &normalization);
        if req.feedback && resp.error.is_none() {
            match inbox.map(|i| i.remember(&req.inputs)) {
                Some(Ok(ids)) => resp.ids = ids,
                Some(Err(e)) => return Response::error(format!("cannot keep the inputs for feedback: {e}")),
                None => return Response::error("this agent has no inbox to take feedback"),
            }
        }
        resp
    })
    .await
    .unwrap_or_else(|e| Response::error(format!("inference panicked: {e}")))
}

/// A client: sends one request (a [`Request`] or a [`Push`]) and reads the answer.
pub async fn query(path: &Path, req: &impl Serialize) -> std::io::Result<Response> {
    let stream = UnixStream::connect(path).await?;
    let (r, mut w) = stream.into_split();
    let mut line = serde_json::to_vec(req).expect("request serializes");
    line.push(b'\n');
    w.write_all(&line).await?;
    let mut lines = BufReader::new(r).lines();
    let resp = lines.next_line().await?.ok_or_else(|| std::io::Error::other("endpoint closed without answering"))?;
    serde_json::from_str(&resp).map_err(std::io::Error::other)
}

/// Parses CSV rows of numbers (no header; blank lines skipped).
pub fn parse_csv_rows(text: &str) -> Result<Vec<Vec<f32>>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let row: Result<Vec<f32>, _> = line.split(',').map(|v| v.trim().parse::<f32>()).collect();
        rows.push(row.map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Served {
        let spec = fedfleet_learning::ModelSpec::digits_mlp();
        let bytes = fedfleet_learning::model::init_bundle(&spec, 7).unwrap().encode();
        let spec_json = serde_json::to_string(&spec).unwrap();
        let model = fedfleet_protocol::ModelRef {
            name: "digits".into(),
            version: fedfleet_protocol::ModelVersion(1),
            digest: fedfleet_protocol::Digest::of(&bytes),
        };
        Served { model, predictor: crate::ml::load_served(&crate::GraphTrainer, &spec_json, &bytes, None).unwrap() }
    }

    #[test]
    fn a_row_with_the_label_column_is_refused_with_a_hint() {
        let req = Request { inputs: vec![vec![1.0; 65]], feedback: false };
        let err = answer(Some(served()), &req, &Normalization::None).error.expect("refused");
        assert!(err.contains("has 65 values, the model takes 64 (is the label column still in?)"), "{err}");
    }

    /// A line far past the limit is refused while it is read: the buffer never holds more
    /// than the limit, and the next line on the connection is read whole.
    #[tokio::test]
    async fn an_overlong_line_is_refused_with_bounded_memory_and_the_next_one_read() {
        let max = 1 << 20;
        let mut input = vec![b'x'; 63 << 20];
        input.extend_from_slice(b"\n{\"inputs\": []}\n\xff\xfe\n");
        let mut r = tokio::io::BufReader::new(input.as_slice());
        let mut buf = Vec::new();
        assert_eq!(read_line_bounded(&mut r, &mut buf, max).await.unwrap(), Line::TooLong);
        assert!(buf.capacity() <= max + (8 << 10), "held {} bytes of an overlong line", buf.capacity());
        assert_eq!(read_line_bounded(&mut r, &mut buf, max).await.unwrap(), Line::Read);
        assert_eq!(buf, b"{\"inputs\": []}");
        assert_eq!(read_line_bounded(&mut r, &mut buf, max).await.unwrap(), Line::Read);
        assert!(std::str::from_utf8(&buf).is_err());
        assert_eq!(read_line_bounded(&mut r, &mut buf, max).await.unwrap(), Line::End);
    }

    /// Every line gets an answer: an overlong one and one that is not UTF-8 included.
    #[tokio::test]
    async fn the_socket_answers_overlong_and_non_utf8_lines_and_stays_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = bind(&path).unwrap();
        let serving = Serving::default();
        serving.set(served());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn({
            let path = path.clone();
            async move {
                serve_listener(listener, &path, serving, Normalization::None, None, async {
                    let _ = rx.await;
                })
                .await
            }
        });
        let stream = UnixStream::connect(&path).await.unwrap();
        let (r, mut w) = stream.into_split();
        let mut lines = BufReader::new(r).lines();
        let writer = tokio::spawn(async move {
            w.write_all(&vec![b'1'; MAX_REQUEST_LINE + 10]).await.unwrap();
            w.write_all(b"\n\xff\xfe\n").await.unwrap();
            w.write_all(format!("{{\"inputs\": [{:?}]}}\n", vec![0.5f32; 64]).as_bytes()).await.unwrap();
            w
        });
        let first: Response = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert!(first.error.unwrap().contains(&format!("longer than {MAX_REQUEST_LINE} bytes")));
        let second: Response = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert!(second.error.unwrap().contains("not UTF-8"));
        let third: Response = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        assert_eq!(third.predictions.len(), 1, "{third:?}");
        drop(writer.await.unwrap());
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    #[test]
    fn raw_rows_are_scaled_as_in_training() {
        let raw = Request { inputs: vec![(0..64).map(|i| (i % 17) as f32).collect()], feedback: false };
        let scaled = Request { inputs: vec![raw.inputs[0].iter().map(|x| x / 16.0).collect()], feedback: false };
        let a = answer(Some(served()), &raw, &Normalization::Scale(1.0 / 16.0));
        let b = answer(Some(served()), &scaled, &Normalization::None);
        assert_eq!(a.predictions[0].probs, b.predictions[0].probs);
        let unscaled = answer(Some(served()), &raw, &Normalization::None);
        assert_ne!(unscaled.predictions[0].probs, b.predictions[0].probs);
    }
}
