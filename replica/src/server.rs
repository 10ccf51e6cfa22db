//! The replica's HTTP/1.1 server on hyper: accepts connections, routes each request, turns
//! every error into an OpenAI-shaped body and stamps every response with `x-kvgate-replica`.
//!
//! Trust: the internal endpoints — `/kv_events` (every cached block's token ids),
//! `/tokenize`, `/detokenize` (which turn those ids back into other users' text) and
//! `/flush_cache` — answer only requests carrying the fleet token, and none at all on a replica
//! started without one. `/v1/*` can be restricted the same way (`--restrict-api`), so clients
//! cannot go around the gateway's admission. Health, load and model information stay open for
//! routers and monitoring.
//!
//! Shutdown drains: the listener closes, each connection finishes the requests it has (streams
//! included) and then closes, up to the drain timeout; then whatever is left is cut.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use protocol::ApiError;
use tokio::net::TcpListener;

use crate::http_util::{error_response, full, json_response, read_body, Body};
use crate::state::AppState;
use crate::{api, info};

const KNOWN: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/kv_events",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/get_load",
    "/flush_cache",
    "/reset_prefix_cache",
];

/// Endpoints that reveal or change the cache or the tokeniser: fleet token only.
const INTERNAL: &[&str] = &[
    "/kv_events",
    "/flush_cache",
    "/reset_prefix_cache",
    "/tokenize",
    "/detokenize",
];

fn authorize(state: &AppState, path: &str, headers: &http::HeaderMap) -> Result<(), ApiError> {
    // `--api-key` (as vLLM's): /v1/* need that key, or the fleet token the gateway sends.
    if let (Some(key), true) = (&state.api_key, path.starts_with("/v1/")) {
        let fleet_ok = state
            .fleet_token
            .as_ref()
            .is_some_and(|t| protocol::auth::check_bearer(headers, Some(t)).is_ok());
        if fleet_ok || protocol::auth::check_bearer(headers, Some(key)).is_ok() {
            return Ok(());
        }
        return Err(protocol::auth::unauthorized(
            "this replica requires an API key: send it as `Authorization: Bearer KEY`",
            "invalid_api_key",
        ));
    }
    let internal = INTERNAL.contains(&path);
    let api = state.restrict_api && path.starts_with("/v1/");
    if !internal && !api {
        return Ok(());
    }
    match &state.fleet_token {
        Some(t) => protocol::auth::check_bearer(headers, Some(t)),
        None => Err(protocol::auth::unauthorized(
            &format!(
                "{path} is an internal endpoint and this replica has no fleet token; start it \
                 with --fleet-token-file or KVGATE_FLEET_TOKEN and give the gateway the same token"
            ),
            "fleet_token_required",
        )),
    }
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let limit = state.max_body_bytes;
    authorize(&state, &path, req.headers())?;
    match (&method, path.as_str()) {
        (&Method::POST, "/v1/completions") => {
            let body = read_body(req, limit).await?;
            api::completions(state, &body).await
        }
        (&Method::POST, "/v1/chat/completions") => {
            let body = read_body(req, limit).await?;
            api::chat_completions(state, &body).await
        }
        (&Method::GET, "/v1/models") => Ok(info::models(&state)),
        (&Method::GET, p) if protocol::openai::model_id_in_path(p).is_some() => {
            let id = protocol::openai::model_id_in_path(p).unwrap_or_default();
            info::model(&state, &id)
        }
        (&Method::GET, "/health") => Ok(json_response(
            StatusCode::OK,
            &serde_json::json!({"status": "ok"}),
        )),
        (&Method::POST, "/tokenize") => {
            let body = read_body(req, limit).await?;
            info::tokenize(state, &body).await
        }
        (&Method::POST, "/detokenize") => {
            let body = read_body(req, limit).await?;
            info::detokenize(state, &body).await
        }
        (&Method::GET, "/metrics") => Ok(Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
            .body(full(state.metrics.render()))
            .expect("static response parts are valid")),
        (&Method::GET, "/kv_events") => Ok(info::kv_events(&state)),
        (&Method::GET, "/server_info" | "/get_server_info") => Ok(info::server_info(&state)),
        (&Method::GET, "/model_info" | "/get_model_info") => Ok(info::model_info(&state)),
        (&Method::GET, "/get_load") => Ok(info::get_load(&state)),
        // `/reset_prefix_cache` is vLLM's name for it (aiperf calls it between runs).
        (&Method::POST, "/flush_cache" | "/reset_prefix_cache") => {
            let n = state.engine.flush_cache().await?;
            Ok(json_response(
                StatusCode::OK,
                &serde_json::json!({"flushed_blocks": n}),
            ))
        }
        (m, p) if KNOWN.contains(&p) => Err(ApiError::method_not_allowed(m.as_str(), p)),
        (_, p) => Err(ApiError::not_found_path(p)),
    }
}

async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let header_value = state.replica_header.clone();
    let mut resp = match route(state, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    resp.headers_mut().insert("x-kvgate-replica", header_value);
    Ok(resp)
}

/// Accepts connections until `shutdown` resolves, then drains for up to `drain`: every
/// connection finishes the requests it has (streams included) and closes; what is left after
/// that is cut. With a zero `drain`, every connection closes at once, as if the process had
/// died.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) {
    tokio::pin!(shutdown);
    // 1: finish what you have, then close; 2: close now.
    let (closing_tx, closing) = tokio::sync::watch::channel(0u8);
    let mut conns = tokio::task::JoinSet::new();
    let mut backoff = Duration::ZERO;
    let mut last_log: Option<std::time::Instant> = None;
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => break,
            // Reap finished connection tasks so the set stays small.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            r = listener.accept() => match r {
                Ok(c) => {
                    backoff = Duration::ZERO;
                    c
                }
                Err(e) => {
                    // Out of descriptors, say: back off instead of spinning, log rarely.
                    if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                        tracing::warn!(error = %e, "accept failed; backing off");
                        last_log = Some(std::time::Instant::now());
                    }
                    backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let mut closing = closing.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| handle(state.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                        return;
                    }
                    changed = closing.changed() => {
                        match (changed, *closing.borrow()) {
                            (Ok(()), 1) => conn.as_mut().graceful_shutdown(),
                            _ => return,
                        }
                    }
                }
            }
        });
    }
    drop(listener);
    state.hub.close();
    if drain.is_zero() {
        let _ = closing_tx.send(2);
        return;
    }
    let _ = closing_tx.send(1);
    let open = conns.len();
    if open > 0 {
        tracing::info!(connections = open, deadline_s = drain.as_secs(), "draining");
    }
    let finished =
        tokio::time::timeout(drain, async { while conns.join_next().await.is_some() {} }).await;
    if finished.is_err() {
        tracing::warn!(
            left = conns.len(),
            "drain deadline passed; closing the remaining connections"
        );
        let _ = closing_tx.send(2);
        conns.shutdown().await;
    }
}
