//! The one request-body path: the whole body is read (up to a limit) before any routing.
//!
//! Why not pingora's own body handling: pingora picks the upstream (`upstream_peer`) before
//! `request_body_filter` sees the body, and the only way to read the body earlier — retry
//! buffering plus `read_request_body` in `request_filter` — re-sends at most 64 KiB
//! (`BODY_BUF_LIMIT` in pingora-core); beyond that the buffer is marked truncated and no body is
//! sent upstream at all, so the replica waits forever for `Content-Length` bytes (pingora issues
//! #349, #575, #780). A prefix-aware router must see the whole prompt to choose, so kvgate reads
//! the body itself in `request_filter`, answers the request there, and forwards it with its own
//! pooled HTTP client (`request/forward.rs`). One path for every size: a 10-byte and an 8 MiB
//! body go the same way, and the limit is checked against `Content-Length` before reading when
//! there is one.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;
use protocol::ApiError;

use crate::metrics::GatewayMetrics;

/// Reads the whole body within `timeout` of the end of the header: 413 past `limit`, 408 past
/// the deadline (counted as a connection closed for `body_timeout`). A failed read closes the
/// connection after the answer (its remaining bytes cannot be trusted as the next request).
pub async fn read_within(
    session: &mut Session,
    limit: usize,
    timeout: Duration,
    metrics: &GatewayMetrics,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, read_whole_body(session, limit)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            session.set_keepalive(None);
            Err(e)
        }
        Err(_) => {
            metrics
                .counter(
                    "kvgate_gateway_connections_closed_total",
                    &[("reason", "body_timeout")],
                )
                .increment(1);
            session.set_keepalive(None);
            Err(ApiError::new(
                408,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} ms",
                    timeout.as_millis()
                ),
            )
            .with_code("body_timeout"))
        }
    }
}

/// Reads the whole request body, refusing more than `limit` bytes with 413.
pub async fn read_whole_body(session: &mut Session, limit: usize) -> Result<Bytes, ApiError> {
    if let Some(len) = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        if len > limit {
            return Err(ApiError::payload_too_large(limit));
        }
    }
    let mut buf = BytesMut::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if buf.len() + chunk.len() > limit {
                    return Err(ApiError::payload_too_large(limit));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(buf.freeze()),
            Err(e) => {
                return Err(ApiError::invalid_request(format!(
                    "cannot read the request body: {e}"
                )))
            }
        }
    }
}
