//! What the request path does with the client's side of a pingora session: answer it
//! ([`respond`], [`respond_error`] with an OpenAI error body), know whether it speaks HTTP/1.0
//! (no chunked encoding), and notice when it goes away ([`client_gone`]).
//!
//! **Half-close.** A client that sends its whole request and then shuts down its sending side
//! (`nc -N`, some proxies and batch tools) still waits for the answer; one that closes its
//! socket does not. Both look the same to the gateway's read (end of file), so on that end of
//! file an HTTP/1.1 client is sent an interim `100 Continue` (which every HTTP/1.1 client must
//! accept and skip): a closed socket answers it with a reset, a half-closed one takes it and
//! keeps waiting. The gateway then watches the socket's TCP state and gives the request up
//! only when the reset came. An HTTP/1.0 client cannot be sent an interim answer, so its end of
//! file still means it left.

use std::time::Duration;

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use protocol::ApiError;

use crate::http::conn::GuardedStream;

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

/// Linux's `TCP_CLOSE`: the connection is gone (a reset arrived).
const TCP_CLOSE: u8 = 7;
/// How often a half-closed client's socket is looked at.
const HALF_CLOSED_POLL: Duration = Duration::from_millis(50);

/// Resolves when the client closed its connection (not on a pipelined next request, and not
/// when it only half-closed it: see the module docs).
pub async fn client_gone(session: &mut Session) {
    match session.read_body_or_idle(true).await {
        Err(e) if e.etype == pingora::ErrorType::ConnectionClosed => {
            if is_http10(session) || GuardedStream::peer_state(session).is_none() {
                return;
            }
            if !GuardedStream::mark_probed(session) {
                let sent = match ResponseHeader::build(100, Some(0)) {
                    Ok(h) => session
                        .write_response_header(Box::new(h), false)
                        .await
                        .is_ok(),
                    Err(_) => false,
                };
                if !sent {
                    return;
                }
            }
            loop {
                tokio::time::sleep(HALF_CLOSED_POLL).await;
                match GuardedStream::peer_state(session) {
                    Some(TCP_CLOSE) | None => return,
                    Some(_) => {}
                }
            }
        }
        Err(e) if e.etype == pingora::ErrorType::ReadError => {}
        _ => std::future::pending::<()>().await,
    }
}
