//! The replica's HTTP/1.1 server on hyper: accepts connections, routes each request, turns
//! every error into an OpenAI-shaped body and stamps every response with `x-kvgate-replica`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use protocol::ApiError;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::app::AppState;
use crate::{api, info};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

pub fn json_response<T: serde::Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    match serde_json::to_vec(value) {
        Ok(b) => Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, "application/json")
            .body(full(b))
            .expect("static response parts are valid"),
        Err(e) => error_response(&ApiError::internal(e.to_string())),
    }
}

pub fn error_response(e: &ApiError) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(e.to_json()))
        .expect("static response parts are valid")
}

/// A streaming response fed by a channel; the body ends when every sender is dropped, and a
/// client that goes away makes the senders' `send` fail.
pub fn streaming_response(content_type: &'static str) -> (mpsc::Sender<Bytes>, Response<Body>) {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let body =
        StreamBody::new(ReceiverStream::new(rx).map(|b| Ok::<_, Infallible>(Frame::data(b))));
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body.boxed_unsync())
        .expect("static response parts are valid");
    (tx, resp)
}

/// Reads the whole body, refusing more than the configured limit with 413.
pub async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::payload_too_large(limit))
        }
        Err(e) => Err(ApiError::invalid_request(format!(
            "cannot read the request body: {e}"
        ))),
    }
}

pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid_request(format!("invalid JSON body: {e}")).with_code("invalid_json")
    })
}

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
];

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let limit = state.max_body_bytes;
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
        (&Method::POST, "/flush_cache") => {
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

/// Accepts connections until `shutdown` resolves, then closes every open connection (in-flight
/// requests end as if the process had died, which is what callers of a shutdown expect).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let (closing_tx, closing) = tokio::sync::watch::channel(false);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => {
                let _ = closing_tx.send(true);
                return;
            }
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let mut closing = closing.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(state.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                }
                _ = closing.changed() => {}
            }
        });
    }
}
