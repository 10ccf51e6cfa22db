//! What the request path does with the client's side of a pingora session: answer it
//! ([`respond`], [`respond_error`] with an OpenAI error body), know whether it speaks HTTP/1.0
//! (no chunked encoding), and notice when it goes away ([`client_gone`]).

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use protocol::ApiError;

/// Whether the client spoke HTTP/1.0, which knows no chunked encoding.
pub fn is_http10(session: &Session) -> bool {
    session.req_header().version == http::Version::HTTP_10
}

/// Writes a whole JSON answer; returns its status.
pub async fn respond(
    session: &mut Session,
    status: u16,
    body: Bytes,
    headers: &[(&'static str, String)],
) -> u16 {
    let Ok(mut h) = ResponseHeader::build(status, Some(4)) else {
        return status;
    };
    let _ = h.insert_header("content-type", "application/json");
    let _ = h.insert_header("content-length", body.len().to_string());
    for (k, v) in headers {
        let _ = h.insert_header(*k, v.as_str());
    }
    if session
        .write_response_header(Box::new(h), false)
        .await
        .is_ok()
    {
        let _ = session.write_response_body(Some(body), true).await;
    }
    status
}

/// Writes an OpenAI-shaped error (with `WWW-Authenticate` on a 401); returns its status.
pub async fn respond_error(session: &mut Session, e: &ApiError) -> u16 {
    let mut headers = Vec::new();
    if e.status == 401 {
        headers.push(("www-authenticate", "Bearer".to_string()));
    }
    respond(session, e.status, Bytes::from(e.to_json()), &headers).await
}

/// Resolves when the client closed its connection (not on a pipelined next request).
pub async fn client_gone(session: &mut Session) {
    if let Err(e) = session.read_body_or_idle(true).await {
        if matches!(
            e.etype,
            pingora::ErrorType::ConnectionClosed | pingora::ErrorType::ReadError
        ) {
            return;
        }
    }
    std::future::pending::<()>().await
}
