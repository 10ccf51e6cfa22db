//! Response and body helpers the HTTP handlers share: JSON and OpenAI-error responses, SSE
//! streaming responses fed by a channel, bounded body reading and JSON parsing. Its own module
//! so that the server (routing) and the handlers (`api`, `info`) both import it and never each
//! other in a circle.

use std::convert::Infallible;

use bytes::Bytes;
use futures::StreamExt;
use http::{header, Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use protocol::ApiError;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

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
