//! What a client connection may cost before the gateway's own code sees a request: a guard
//! around each socket.
//!
//! pingora reads the request header itself, with only a per-read timeout (60 s by default), so
//! a client sending one byte per second holds a connection — and a file descriptor — forever,
//! and its header-size errors are bare 400s without a body. [`GuardedStream`] wraps the socket
//! pingora reads from and watches the bytes of each request header as they pass:
//! - a request's header must be complete within `header_timeout` of its first byte (a new
//!   connection must start one within the same time; a kept-alive one may idle for
//!   `keepalive_timeout`), else the client gets a 408 with an OpenAI error body and the
//!   connection is closed;
//! - a header over `max_header_bytes` or `max_headers` lines gets a 431 with a body, before
//!   pingora would answer a bare 400.
//!
//! The accept loop that hands sockets to it, and the connection budget, are in
//! [`crate::http::accept`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use metrics::{Counter, Gauge};
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType,
};
use protocol::ApiError;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::http::write_buffer::WriteBuffer;

/// Response bytes gathered per connection before a flush sends them (a TCP segment's worth).
const WRITE_BUFFER_BYTES: usize = 8 * 1024;

/// Deadlines and sizes for request headers.
#[derive(Debug, Clone, Copy)]
pub struct HeaderLimits {
    pub header_timeout: Duration,
    pub keepalive_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_headers: usize,
}

/// Counters the guard and the accept loop keep.
pub struct ConnMetrics {
    pub header_timeout: Counter,
    pub header_too_large: Counter,
    pub refused: Counter,
    pub open: Gauge,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No byte of the next request yet.
    Waiting { first: bool },
    /// Inside a request header.
    Header,
    /// Past the header: the body and the response, which the proxy bounds itself.
    Passed,
}

#[derive(Debug, Default)]
struct ConnShared {
    done: std::sync::atomic::AtomicBool,
    /// The client half-closed and was sent an interim `100 Continue` (`http/session.rs`).
    probed: std::sync::atomic::AtomicBool,
}

/// Size and line count of a request header seen in pieces.
#[derive(Debug, Default)]
struct HeaderScan {
    bytes: usize,
    lines: usize,
    /// The last three bytes seen, to find `\r\n\r\n` across reads.
    tail: [u8; 3],
}

impl HeaderScan {
    /// Takes the next bytes; true when the header ended in them.
    fn feed(&mut self, new: &[u8]) -> bool {
        // The previous read's last three bytes lead the window, so a terminator or a line
        // break split across reads is still seen — and counted once, by its last byte.
        let mut window = self.tail.to_vec();
        window.extend_from_slice(new);
        let end = window.windows(4).position(|w| w == b"\r\n\r\n");
        let stop = end.map_or(window.len(), |i| i + 4);
        self.lines += (4..=stop).filter(|&j| &window[j - 2..j] == b"\r\n").count();
        self.bytes += stop - 3;
        let n = window.len();
        self.tail.copy_from_slice(&window[n - 3..]);
        end.is_some()
    }
}

/// A client socket whose request headers are held to [`HeaderLimits`].
pub struct GuardedStream {
    inner: L4Stream,
    limits: HeaderLimits,
    metrics: Arc<ConnMetrics>,
    phase: Phase,
    deadline: Pin<Box<Sleep>>,
    scan: HeaderScan,
    /// Set by the proxy when a response is complete: the next bytes start a new request.
    shared: Arc<ConnShared>,
    /// A canned response being written before the connection is failed.
    closing: Option<(&'static str, std::io::ErrorKind)>,
    /// Response pieces gathered until pingora flushes (`write_buffer.rs`).
    out: WriteBuffer,
}

impl std::fmt::Debug for GuardedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedStream")
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

pub(crate) fn canned(status: u16, reason: &str, e: &ApiError, extra: &str) -> Vec<u8> {
    let body = e.to_json();
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

impl GuardedStream {
    pub fn new(tcp: TcpStream, limits: HeaderLimits, metrics: Arc<ConnMetrics>) -> Self {
        GuardedStream {
            inner: tcp.into(),
            limits,
            metrics,
            phase: Phase::Waiting { first: true },
            deadline: Box::pin(tokio::time::sleep(limits.header_timeout)),
            scan: HeaderScan::default(),
            shared: Arc::new(ConnShared::default()),
            closing: None,
            out: WriteBuffer::new(WRITE_BUFFER_BYTES),
        }
    }

    /// Tells the guard of `session`'s connection that its request was answered, so the next
    /// bytes are held to the limits of a new header. pingora keeps a connection alive inside
    /// its own loop, so the guard cannot see the boundary itself.
    pub fn request_done(session: &pingora::proxy::Session) {
        if let Some(g) = session
            .stream()
            .and_then(|s| s.as_any().downcast_ref::<GuardedStream>())
        {
            g.shared
                .done
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Marks `session`'s client as probed after its half-close; returns whether it was already.
    pub fn mark_probed(session: &pingora::proxy::Session) -> bool {
        session
            .stream()
            .and_then(|s| s.as_any().downcast_ref::<GuardedStream>())
            .is_some_and(|g| {
                g.shared
                    .probed
                    .swap(true, std::sync::atomic::Ordering::AcqRel)
            })
    }

    /// The kernel's TCP state of `session`'s client socket (`TCP_INFO`'s `tcpi_state`), when
    /// the session runs on a guarded socket.
    pub fn peer_state(session: &pingora::proxy::Session) -> Option<u8> {
        let g = session
            .stream()
            .and_then(|s| s.as_any().downcast_ref::<GuardedStream>())?;
        pingora::protocols::l4::ext::get_tcp_info(std::os::fd::AsRawFd::as_raw_fd(&g.inner))
            .ok()
            .map(|i| i.tcpi_state)
    }

    /// Arms the guard for the next request on a kept-alive connection.
    fn next_request(&mut self) {
        self.phase = Phase::Waiting { first: false };
        self.scan = HeaderScan::default();
        let at = tokio::time::Instant::now() + self.limits.keepalive_timeout;
        self.deadline.as_mut().reset(at);
    }

    /// Looks at bytes of the header as they pass; returns why the request must be refused.
    fn inspect(&mut self, new: &[u8]) -> Option<&'static str> {
        if new.is_empty() {
            return None;
        }
        if let Phase::Waiting { .. } = self.phase {
            self.phase = Phase::Header;
            let at = tokio::time::Instant::now() + self.limits.header_timeout;
            self.deadline.as_mut().reset(at);
        }
        if self.phase != Phase::Header {
            return None;
        }
        let ended = self.scan.feed(new);
        if self.scan.bytes > self.limits.max_header_bytes
            || self.scan.lines > self.limits.max_headers + 2
        {
            return Some("header_too_large");
        }
        if ended {
            self.phase = Phase::Passed;
        }
        None
    }

    /// Starts failing the connection with a canned response.
    fn refuse(&mut self, why: &'static str) -> Vec<u8> {
        let (status, reason, e, kind) = if why == "header_timeout" {
            self.metrics.header_timeout.increment(1);
            (
                408,
                "Request Timeout",
                ApiError::new(
                    408,
                    "invalid_request_error",
                    format!(
                        "the request header did not arrive within {} ms",
                        self.limits.header_timeout.as_millis()
                    ),
                )
                .with_code("header_timeout"),
                std::io::ErrorKind::TimedOut,
            )
        } else {
            self.metrics.header_too_large.increment(1);
            (
                431,
                "Request Header Fields Too Large",
                ApiError::new(
                    431,
                    "invalid_request_error",
                    format!(
                        "the request header is larger than {} bytes or has more than {} lines",
                        self.limits.max_header_bytes, self.limits.max_headers
                    ),
                )
                .with_code("header_too_large"),
                std::io::ErrorKind::InvalidData,
            )
        };
        self.closing = Some((why, kind));
        canned(status, reason, &e, "")
    }

    fn fail(&mut self, cx: &mut Context<'_>, why: &'static str) -> Poll<std::io::Result<()>> {
        let response = self.refuse(why);
        // Best effort: a small response fits the socket buffer; a client that does not read
        // does not get to hold the connection for it.
        let _ = Pin::new(&mut self.inner).poll_write(cx, &response);
        let kind = self.closing.map_or(std::io::ErrorKind::Other, |c| c.1);
        Poll::Ready(Err(std::io::Error::new(kind, why)))
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some((why, kind)) = this.closing {
            return Poll::Ready(Err(std::io::Error::new(kind, why)));
        }
        if this
            .shared
            .done
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            this.next_request();
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let new = buf.filled()[before..].to_vec();
                if let Some(why) = this.inspect(&new) {
                    buf.set_filled(before);
                    return this.fail(cx, why);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if this.phase == Phase::Passed || this.deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                match this.phase {
                    // An idle kept-alive connection: close it quietly (end of stream).
                    Phase::Waiting { first: false } => Poll::Ready(Ok(())),
                    _ => this.fail(cx, "header_timeout"),
                }
            }
        }
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        me.out.poll_write(&mut me.inner, cx, buf)
    }

    // Vectored and buffered: a streamed chunk's size line, data and CRLF, or a response's
    // header and body, leave in one system call at pingora's flush.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        me.out.poll_write_vectored(&mut me.inner, cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        me.out.poll_flush(&mut me.inner, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        me.out.poll_shutdown(&mut me.inner, cx)
    }
}

#[async_trait]
impl Shutdown for GuardedStream {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut self.inner).await
    }
}

impl UniqueID for GuardedStream {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for GuardedStream {}

impl GetTimingDigest for GuardedStream {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
}

impl GetProxyDigest for GuardedStream {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
}

impl GetSocketDigest for GuardedStream {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
}

#[async_trait]
impl Peek for GuardedStream {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_scan_finds_the_end_across_reads() {
        let header =
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}";
        for cut in 1..header.len() {
            let mut s = HeaderScan::default();
            let first = s.feed(&header[..cut]);
            let ended = first || s.feed(&header[cut..]);
            assert!(ended, "cut at {cut}");
            assert_eq!(s.lines, 4, "cut at {cut}");
            assert_eq!(s.bytes, header.len() - 2, "cut at {cut}");
        }
        let mut s = HeaderScan::default();
        for b in b"GET / HTTP/1.1\r\nx: y\r\n" {
            assert!(!s.feed(&[*b]));
        }
        assert_eq!(s.lines, 2);
        assert!(s.feed(b"\r\n"));
    }

    #[test]
    fn canned_response_is_valid_http() {
        let r = canned(
            408,
            "Request Timeout",
            &ApiError::invalid_request("x"),
            "retry-after: 1\r\n",
        );
        let text = String::from_utf8(r).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 408 Request Timeout\r\n"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        assert!(head.ends_with("retry-after: 1"));
        assert!(serde_json::from_str::<serde_json::Value>(body).unwrap()["error"].is_object());
    }
}
