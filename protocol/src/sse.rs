//! Server-sent events as OpenAI streams them: one `data: <json>\n\n` event per chunk and a final
//! `data: [DONE]\n\n`. [`SseDecoder`] is the incremental reader the gateway and the load tester
//! use: bytes go in as they arrive from the socket, whole events come out.

use bytes::Bytes;
use serde::Serialize;

/// The last event of every OpenAI stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Frames one JSON value as an SSE `data:` event.
pub fn data_event<T: Serialize>(value: &T) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Serialising our own response types cannot fail: they hold no maps with non-string keys.
    serde_json::to_writer(&mut out, value).expect("response types serialise");
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// One decoded event: the `data:` payload (joined when spread over several lines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    Data(String),
    Done,
}

/// Incremental SSE reader: tolerates events split across reads and `\r\n` line endings.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes and returns every event completed by them, in order.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end + sep).collect();
            if let Some(ev) = parse_event(&raw[..end]) {
                events.push(ev);
            }
        }
        events
    }
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// One raw event (without its blank line) decoded: its `data:` lines joined, `None` for a
/// comment or keep-alive. The gateway's relay frames events itself (it forwards the bytes) and
/// decodes each with this.
pub fn parse_event(raw: &[u8]) -> Option<SseEvent> {
    let text = String::from_utf8_lossy(raw);
    let mut data: Vec<&str> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("data:") {
            data.push(rest.strip_prefix(' ').unwrap_or(rest));
        }
    }
    if data.is_empty() {
        return None; // a comment or keep-alive
    }
    let joined = data.join("\n");
    if joined == "[DONE]" {
        Some(SseEvent::Done)
    } else {
        Some(SseEvent::Data(joined))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_events_split_across_reads() {
        let mut d = SseDecoder::new();
        let wire = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        let mut events = Vec::new();
        for chunk in wire.chunks(5) {
            events.extend(d.feed(chunk));
        }
        assert_eq!(
            events,
            vec![
                SseEvent::Data("{\"a\":1}".into()),
                SseEvent::Data("{\"b\":2}".into()),
                SseEvent::Done
            ]
        );
    }

    #[test]
    fn frames_json_as_data_event() {
        let b = data_event(&serde_json::json!({"x": 1}));
        assert_eq!(&b[..], b"data: {\"x\":1}\n\n");
    }
}
