//! A small write buffer for a client connection. pingora writes a response as several pieces
//! — the header, then each body chunk as size line, data and CRLF — and flushes when a piece
//! must reach the client (a streamed chunk, the end of a body). Over an unbuffered socket each
//! piece is a system call; gathered here, a flush sends them in one. pingora's own listeners
//! buffer the same way; the gateway accepts connections itself (`conn.rs`), so it buffers
//! itself.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::AsyncWrite;

/// Bytes written but not yet sent; a write that does not fit, or one larger than the buffer,
/// sends what is held first.
#[derive(Debug)]
pub struct WriteBuffer {
    buf: Vec<u8>,
    /// How much of `buf` is already sent.
    sent: usize,
    capacity: usize,
}

impl WriteBuffer {
    pub fn new(capacity: usize) -> Self {
        WriteBuffer {
            buf: Vec::new(),
            sent: 0,
            capacity,
        }
    }

    /// Sends everything held to `w` (not flushing `w` itself).
    pub fn poll_send<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let n = ready!(Pin::new(&mut *w).poll_write(cx, &self.buf[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.buf.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }

    pub fn poll_write<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(w, cx, &[IoSlice::new(data)])
    }

    pub fn poll_write_vectored<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if self.buf.len() + total > self.capacity {
            ready!(self.poll_send(w, cx))?;
        }
        if total > self.capacity {
            // Too big to gather: straight through (nothing is held now).
            return Pin::new(&mut *w).poll_write_vectored(cx, bufs);
        }
        if self.buf.capacity() == 0 {
            self.buf.reserve(self.capacity);
        }
        for b in bufs {
            self.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }

    pub fn poll_flush<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_send(w, cx))?;
        Pin::new(w).poll_flush(cx)
    }

    pub fn poll_shutdown<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_send(w, cx))?;
        Pin::new(w).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A writer over `WriteBuffer`, as `GuardedStream` uses it.
    struct Buffered<W> {
        w: W,
        b: WriteBuffer,
    }

    impl<W: AsyncWrite + Unpin> AsyncWrite for Buffered<W> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            let me = self.get_mut();
            me.b.poll_write(&mut me.w, cx, data)
        }
        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let me = self.get_mut();
            me.b.poll_write_vectored(&mut me.w, cx, bufs)
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            let me = self.get_mut();
            me.b.poll_flush(&mut me.w, cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            let me = self.get_mut();
            me.b.poll_shutdown(&mut me.w, cx)
        }
    }

    #[tokio::test]
    async fn pieces_are_held_until_a_flush_and_arrive_whole_and_in_order() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut w = Buffered {
            w: a,
            b: WriteBuffer::new(64),
        };
        w.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        let head: &[u8] = b"5\r\n";
        let mut chunk = bytes::Buf::chain(bytes::Buf::chain(head, &b"hello"[..]), &b"\r\n"[..]);
        w.write_all_buf(&mut chunk).await.unwrap();
        // Nothing reached the peer yet.
        let mut probe = [0u8; 1];
        let early =
            tokio::time::timeout(std::time::Duration::from_millis(20), b.read(&mut probe)).await;
        assert!(early.is_err(), "bytes left before the flush");
        w.flush().await.unwrap();
        // A piece larger than the buffer goes through, after what is held.
        let big = vec![b'x'; 200];
        w.write_all(&big).await.unwrap();
        w.shutdown().await.unwrap();
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        let mut want = b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n".to_vec();
        want.extend_from_slice(&big);
        assert_eq!(got, want);
    }
}
