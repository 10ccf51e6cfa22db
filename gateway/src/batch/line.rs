//! One batch line through the unchanged request path. The line is written as an HTTP/1.1
//! request (with `x-kvgate-priority: batch` and the job's tenant) into one end of an in-memory
//! duplex pipe; the other end is a pingora session handed to [`request::generate`], as a client
//! connection's would be. So a batch line gets what an interactive request gets — the model's
//! tokenizer, the tenant's cache scope, prefix-aware placement, admission, retries elsewhere,
//! latency learning, the access log — with no second copy of the pipeline. Dropping the
//! future drops the client end; the pipeline sees its client gone and cancels the replica's
//! work, as for a client that hangs up.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use config::{Grant, Priority};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use pingora::proxy::Session;

use crate::access_log::AccessRecord;
use crate::request;
use crate::request::prepared::Endpoint;
use crate::state::GatewayState;

/// What the pipeline answered.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub request_id: Option<String>,
    pub body: Bytes,
}

/// Why a line got no answer at all (the in-memory pipe broke: never expected).
#[derive(Debug, thiserror::Error)]
#[error("the batch line's request failed inside the gateway: {0}")]
pub struct LineError(String);

/// The pipe's buffer each way: large enough for a typical body in one write.
const PIPE_BYTES: usize = 256 << 10;

/// Runs `body` as a request to `url` for `grant`'s tenant (`None`: the open API's one tenant),
/// on one of the replicas in `scope` now or not at all (a 503 `no_spare_replica`).
pub async fn run(
    state: Arc<GatewayState>,
    grant: Option<Grant>,
    scope: Arc<[usize]>,
    url: &str,
    body: Bytes,
) -> Result<Answer, LineError> {
    let endpoint = match url {
        "/v1/completions" => Endpoint::Completions,
        _ => Endpoint::ChatCompletions,
    };
    let (client_io, server_io) = tokio::io::duplex(PIPE_BYTES);
    let path = url.to_string();
    let server = tokio::spawn(async move {
        let mut session = Session::new_h1(Box::new(server_io));
        if !matches!(session.read_request().await, Ok(true)) {
            return;
        }
        let started = Instant::now();
        let mut rec = AccessRecord::new("POST", &path);
        rec.tenant = grant.as_ref().map(|g| g.tenant.clone());
        let status = request::generate(
            &state,
            &mut session,
            endpoint,
            started,
            grant,
            Some(scope),
            &mut rec,
        )
        .await;
        let _ = session.finish_body().await;
        if state.access_log.enabled() {
            rec.status = status;
            rec.e2e_ms = started.elapsed().as_secs_f64() * 1e3;
            state.access_log.write(&rec);
        }
    });
    // The server task ends by itself once the client end is gone.
    drop(server);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client_io))
        .await
        .map_err(|e| LineError(e.to_string()))?;
    // Dropped with this future (a cancel): the client end closes with it.
    let _conn = AbortOnDrop(tokio::spawn(conn));
    let req = http::Request::post(url)
        .header(http::header::HOST, "kvgate-batch")
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::CONTENT_LENGTH, body.len())
        .header(Priority::HEADER, Priority::Batch.label())
        .body(Full::new(body))
        .map_err(|e| LineError(e.to_string()))?;
    let answer = async {
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| LineError(e.to_string()))?;
        let status = resp.status().as_u16();
        let request_id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| LineError(e.to_string()))?
            .to_bytes();
        Ok(Answer {
            status,
            request_id,
            body,
        })
    }
    .await;
    answer
}

struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
