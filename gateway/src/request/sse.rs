//! Reading a replica's answer on its way to the client (for the forward and relay stages). [`SseTap`] cuts the byte stream into
//! server-sent events (holding back only an incomplete event), notices `[DONE]`, error events
//! and the usage event, and rewrites what the usage says about cache hits per the policy's
//! [`HitPolicy`]. A stream that ends without `[DONE]` was cut: the relay then sends an
//! OpenAI-style error event, which the OpenAI SDKs raise as an exception, instead of letting
//! a truncated answer pass as a complete one. [`drain_ready`] joins the chunks a replica has
//! already sent into one client write; [`AnswerUsage`] is what an unstreamed answer's usage is
//! read as.

use std::time::Duration;

use bytes::Bytes;
use config::HitSignals;
use http_body_util::BodyExt;
use protocol::sse::{parse_event, SseEvent};
use protocol::ApiError;
use serde_json::Value;

use super::json_check::EventChecker;

/// What clients are told about cache hits.
#[derive(Debug, Clone, Copy)]
pub struct HitPolicy {
    pub mode: HitSignals,
    pub round_tokens: u64,
    pub block_size: usize,
}

impl HitPolicy {
    /// The cached-token count a client sees.
    pub fn shown_tokens(&self, cached: u64) -> u64 {
        match self.mode {
            HitSignals::Exact => cached,
            HitSignals::Rounded => cached / self.round_tokens.max(1) * self.round_tokens.max(1),
            HitSignals::Off => 0,
        }
    }

    /// The `x-kvgate-matched-blocks` value, or `None` when hit signals are off.
    pub fn matched_blocks_header(&self, blocks: usize) -> Option<String> {
        match self.mode {
            HitSignals::Off => None,
            _ => {
                let bs = self.block_size.max(1) as u64;
                Some((self.shown_tokens(blocks as u64 * bs) / bs).to_string())
            }
        }
    }

    /// Rewrites `usage.prompt_tokens_details.cached_tokens` in a response object; returns the
    /// true value when there was one.
    pub fn rewrite_usage(&self, v: &mut Value) -> Option<u64> {
        let details = v.get_mut("usage")?.get_mut("prompt_tokens_details")?;
        let cached = details.get("cached_tokens")?.as_u64()?;
        details["cached_tokens"] = Value::from(self.shown_tokens(cached));
        Some(cached)
    }
}

/// `data: {"error": …}` — how an OpenAI stream reports a failure.
pub fn error_event(e: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", e.to_json()))
}

/// Largest single event a replica may send (bytes before its blank line): an event that never
/// ends must not grow the gateway's buffer without bound.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// Follows an SSE stream event by event.
#[derive(Debug, Default)]
pub struct SseTap {
    pending: Vec<u8>,
    /// `data: [DONE]` was seen: the stream is complete.
    pub done: bool,
    /// The upstream itself reported an error event.
    pub saw_error: bool,
    /// An event whose data is neither `[DONE]` nor a JSON object: the stream is garbage.
    pub bad_event: bool,
    /// An event grew past [`MAX_EVENT_BYTES`] without ending.
    pub oversized: bool,
    /// Checks each event is a JSON object, cheaply for token events (see its docs).
    checker: EventChecker,
    /// Events carrying generated text (a chat delta's `content`, a completion's `text`): the
    /// output token count when the stream has no usage event.
    pub choice_events: u64,
    /// From the usage event, when the client asked for one.
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
}

/// End of the first event in `buf`: the index just past its blank line.
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &buf[from..]).map(|i| from + i) {
        match buf.get(i + 1) {
            Some(b'\n') => return Some(i + 2),
            Some(b'\r') if buf.get(i + 2) == Some(&b'\n') => return Some(i + 3),
            Some(_) => from = i + 1,
            None => return None,
        }
    }
    None
}

static CONTENT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"content\":"));
static TEXT: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"text\":"));
static USAGE: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));
static ERROR: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"error\""));

/// Whether an event's payload holds non-empty generated text (a `"content"` or `"text"` string
/// that is not empty; compact or spaced JSON alike).
fn carries_text(payload: &[u8]) -> bool {
    [&*CONTENT, &*TEXT].iter().any(|key| {
        key.find(payload).is_some_and(|i| {
            let rest = payload[i + key.needle().len()..].trim_ascii_start();
            rest.first() == Some(&b'"') && rest.get(1).is_some_and(|&c| c != b'"')
        })
    })
}

/// The payload of an event that is one `data:` line (what every engine sends per token),
/// borrowed; `None` for anything else (comments, several lines), which takes the full decoder.
fn single_data_line(event: &[u8]) -> Option<&[u8]> {
    let rest = event.strip_prefix(b"data:")?;
    let rest = rest.strip_prefix(b" ").unwrap_or(rest);
    let end = memchr::memchr(b'\n', rest)?;
    let line = &rest[..end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    // The rest of the event must be its blank line.
    matches!(&rest[end..], b"\n\n" | b"\n\r\n").then_some(line)
}

impl SseTap {
    /// Takes upstream bytes; returns the complete events among them (rewritten where needed),
    /// or `None` while only part of an event has arrived. Whole events that need no rewriting
    /// — every token event — are passed on as the same buffer, without a copy.
    pub fn feed(&mut self, data: &Bytes, hits: &HitPolicy) -> Option<Bytes> {
        if !self.pending.is_empty() {
            let mut joined = std::mem::take(&mut self.pending);
            joined.extend_from_slice(data);
            return self.feed(&Bytes::from(joined), hits);
        }
        let mut rewritten: Option<Vec<u8>> = None;
        let mut at = 0;
        while let Some(len) = event_end(&data[at..]) {
            let event = &data[at..at + len];
            match self.inspect(event, hits) {
                Some(new) => {
                    let out = rewritten.get_or_insert_with(|| data[..at].to_vec());
                    out.extend_from_slice(&new);
                }
                None => {
                    if let Some(out) = &mut rewritten {
                        out.extend_from_slice(event);
                    }
                }
            }
            at += len;
        }
        self.pending.extend_from_slice(&data[at..]);
        if self.pending.len() > MAX_EVENT_BYTES {
            self.oversized = true;
            self.pending = Vec::new();
        }
        match rewritten {
            Some(out) => Some(Bytes::from(out)),
            None => (at > 0).then(|| data.slice(..at)),
        }
    }

    /// Bytes of an event that never ended.
    pub fn has_partial(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Looks at one event; returns its replacement when it must change.
    fn inspect(&mut self, event: &[u8], hits: &HitPolicy) -> Option<Vec<u8>> {
        let decoded;
        let payload: &[u8] = match single_data_line(event) {
            Some(p) => p,
            None => match parse_event(event)? {
                SseEvent::Done => {
                    self.done = true;
                    return None;
                }
                SseEvent::Data(d) => {
                    decoded = d;
                    decoded.as_bytes()
                }
            },
        };
        let payload = payload.trim_ascii();
        if payload == b"[DONE]" {
            self.done = true;
            return None;
        }
        // Every event must be a JSON object (checked without building it): a replica that
        // sends anything else is broken, and the client's SDK would fail on it anyway.
        if !self.checker.check(payload) {
            self.bad_event = true;
            return None;
        }
        if carries_text(payload) {
            self.choice_events += 1;
        }
        let interesting = USAGE.find(payload).is_some() || ERROR.find(payload).is_some();
        if !interesting {
            return None;
        }
        let mut v: Value = serde_json::from_slice(payload).ok()?;
        if v.get("error").is_some_and(|e| !e.is_null()) {
            self.saw_error = true;
            return None;
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            self.completion_tokens = Some(n);
        }
        if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
            self.prompt_tokens = Some(n);
        }
        let cached = hits.rewrite_usage(&mut v)?;
        self.cached_tokens = Some(cached);
        if hits.shown_tokens(cached) == cached {
            return None;
        }
        Some(format!("data: {v}\n\n").into_bytes())
    }
}

/// Most chunks joined into one write.
const MAX_COALESCED: usize = 64;

/// What one relayed write stands for, chunk by chunk: the gap the client saw before it (the
/// first chunk `gap` after the previous write, the `coalesced` ones joined to it at once) and
/// the replica's decode step it is evidence of. The replica made the joined chunks one step
/// after another within `gap`, so each stands for an even share of it: learning the zero gaps
/// the client saw would teach a decode step far below the real one (the median of mostly
/// zeros), and every prediction built on it.
pub fn write_gaps(gap: Duration, coalesced: usize) -> impl Iterator<Item = (Duration, Duration)> {
    let step = gap / (coalesced as u32 + 1);
    (0..=coalesced).map(move |i| (if i == 0 { gap } else { Duration::ZERO }, step))
}

/// Appends to `first` the events of chunks the replica has already sent: the upstream
/// connection task decodes one chunk at a time, so each turn yields to let it decode the next
/// from what it has read, and stops at the first that is not there yet. A replica faster than
/// the client's reads (or many tokens in one TCP segment) then costs one write, not one per
/// token; a replica that sends a token at a time costs one extra poll. Returns the events to
/// write, how many chunks were joined, and a frame that was not data (the end, an error) to
/// handle next.
pub async fn drain_ready(
    body: &mut hyper::body::Incoming,
    tap: &mut SseTap,
    hits: &HitPolicy,
    first: Option<Bytes>,
) -> (
    Option<Bytes>,
    usize,
    Option<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>>,
) {
    let mut joined: Option<bytes::BytesMut> = None;
    let mut next = first;
    let mut n = 0;
    for _ in 0..MAX_COALESCED {
        if tap.done {
            break;
        }
        tokio::task::yield_now().await;
        let more = match futures::FutureExt::now_or_never(body.frame()) {
            None => break,
            Some(Some(Ok(f))) => match f.into_data().ok().and_then(|d| tap.feed(&d, hits)) {
                Some(more) => more,
                None => continue,
            },
            Some(other) => {
                let out = joined.map(bytes::BytesMut::freeze).or(next);
                return (out, n, Some(other));
            }
        };
        match (&mut joined, next.take()) {
            (Some(j), _) => j.extend_from_slice(&more),
            (None, Some(head)) => {
                let mut j = bytes::BytesMut::with_capacity(head.len() + more.len() * 8);
                j.extend_from_slice(&head);
                j.extend_from_slice(&more);
                joined = Some(j);
            }
            (None, None) => {
                next = Some(more);
                continue;
            }
        }
        n += 1;
    }
    (joined.map(bytes::BytesMut::freeze).or(next), n, None)
}

/// What an unstreamed answer says about its usage (every other field is skipped).
#[derive(serde::Deserialize)]
pub struct AnswerUsage {
    pub usage: Option<Usage>,
}

#[derive(serde::Deserialize, Default)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub prompt_tokens_details: Option<PromptDetails>,
}

#[derive(serde::Deserialize)]
pub struct PromptDetails {
    pub cached_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hits(mode: HitSignals) -> HitPolicy {
        HitPolicy {
            mode,
            round_tokens: 256,
            block_size: 16,
        }
    }

    const USAGE: &str = r#"data: {"id":"x","choices":[],"usage":{"prompt_tokens":900,"completion_tokens":3,"total_tokens":903,"prompt_tokens_details":{"cached_tokens":592}}}"#;

    #[test]
    fn events_split_across_chunks_are_held_until_whole() {
        let mut tap = SseTap::default();
        let h = hits(HitSignals::Exact);
        let role = r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let token = r#"data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        let stream = format!("{role}\n\n{token}\n\n{USAGE}\n\ndata: [DONE]\n\n");
        let mut out = Vec::new();
        for chunk in stream.as_bytes().chunks(7) {
            if let Some(b) = tap.feed(&Bytes::copy_from_slice(chunk), &h) {
                out.extend_from_slice(&b);
            }
        }
        assert_eq!(out, stream.as_bytes());
        assert!(tap.done && !tap.has_partial());
        assert_eq!(tap.choice_events, 1);
        assert_eq!(tap.cached_tokens, Some(592));
        assert_eq!(tap.completion_tokens, Some(3));
    }

    #[test]
    fn cached_tokens_are_rounded_or_hidden() {
        for (mode, shown) in [
            (HitSignals::Exact, 592),
            (HitSignals::Rounded, 512),
            (HitSignals::Off, 0),
        ] {
            let mut tap = SseTap::default();
            let out = tap
                .feed(&Bytes::from(format!("{USAGE}\n\n")), &hits(mode))
                .unwrap();
            let v: Value =
                serde_json::from_str(std::str::from_utf8(&out).unwrap()[6..].trim()).unwrap();
            assert_eq!(
                v["usage"]["prompt_tokens_details"]["cached_tokens"], shown,
                "{mode:?}"
            );
            assert_eq!(tap.cached_tokens, Some(592));
        }
        assert_eq!(
            hits(HitSignals::Rounded).matched_blocks_header(37),
            Some("32".into())
        );
        assert_eq!(
            hits(HitSignals::Exact).matched_blocks_header(37),
            Some("37".into())
        );
        assert_eq!(hits(HitSignals::Off).matched_blocks_header(37), None);
    }

    #[test]
    fn a_stream_without_done_is_not_complete_and_errors_are_seen() {
        let mut tap = SseTap::default();
        let h = hits(HitSignals::Exact);
        tap.feed(
            &Bytes::from_static(
                b"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: {\"cho",
            ),
            &h,
        );
        assert!(!tap.done && tap.has_partial());
        let mut tap = SseTap::default();
        tap.feed(
            &Bytes::from_static(
                b"data: {\"error\":{\"message\":\"engine stopped\",\"type\":\"x\"}}\n\n",
            ),
            &h,
        );
        assert!(tap.saw_error && !tap.done);
        let e = error_event(&ApiError::new(502, "upstream_error", "cut"));
        assert!(e.starts_with(b"data: {\"error\""));
        assert!(e.ends_with(b"\n\n"));
    }

    #[test]
    fn garbage_events_and_endless_events_are_flagged() {
        let h = hits(HitSignals::Exact);
        let mut tap = SseTap::default();
        tap.feed(&Bytes::from("data: <html>oops</html>\n\n"), &h);
        assert!(tap.bad_event);
        let mut tap = SseTap::default();
        tap.feed(&Bytes::from("data: {\"choices\": [\n\n"), &h);
        assert!(tap.bad_event, "a truncated object does not parse");
        let mut tap = SseTap::default();
        tap.feed(&Bytes::from(": keep-alive comment\n\ndata: [DONE]\n\n"), &h);
        assert!(!tap.bad_event && tap.done);
        let mut tap = SseTap::default();
        let chunk = Bytes::from(vec![b'x'; 64 << 10]);
        for _ in 0..(MAX_EVENT_BYTES / chunk.len() + 1) {
            assert!(tap.feed(&chunk, &h).is_none());
        }
        assert!(
            tap.oversized && !tap.has_partial(),
            "the buffer is dropped, not grown"
        );
        let mut tap = SseTap::default();
        tap.feed(&Bytes::from("data: {\"choices\": [{\"delta\": {\"content\": \"tok \"}}]}\n\ndata: {\"choices\": [{\"delta\": {\"content\": \"\"}}]}\n\n"), &h);
        assert_eq!(tap.choice_events, 1, "spaced JSON counts its tokens too");
    }

    #[test]
    fn a_joined_write_teaches_the_replicas_real_step_not_zero() {
        // Four chunks arrive together 20 ms after the last write: the client saw 20 ms then
        // three zeros; the replica stepped every 5 ms.
        let gaps: Vec<_> = write_gaps(Duration::from_millis(20), 3).collect();
        let seen: Vec<_> = gaps.iter().map(|g| g.0.as_millis()).collect();
        assert_eq!(seen, [20, 0, 0, 0]);
        assert!(gaps.iter().all(|g| g.1 == Duration::from_millis(5)));
        let mut model = crate::fleet::latency_model::LatencyModel::default();
        for _ in 0..5 {
            for (_, step) in write_gaps(Duration::from_millis(20), 3) {
                model.observe_itl(1, step);
            }
        }
        let learnt = model.predict_itl(1).unwrap().as_secs_f64() * 1e3;
        assert!((4.5..5.5).contains(&learnt), "learnt {learnt} ms, not 5");
        let one: Vec<_> = write_gaps(Duration::from_millis(7), 0).collect();
        assert_eq!(one, [(Duration::from_millis(7), Duration::from_millis(7))]);
    }
}
