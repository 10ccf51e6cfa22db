//! Stage 6, relay: the answer's way to the client once its head has arrived. An unstreamed
//! answer is written whole, its usage rewritten per the policy's hit signals. A stream is
//! relayed event by event (the SSE reader is `sse.rs`) with a per-event idle deadline derived
//! from the route's inter-token promise; chunks the replica has already sent go out in one
//! write. A stream that ends without `[DONE]` — the replica died, stalled past the deadline,
//! was ejected, or the gateway's drain ran out — gets an OpenAI error event and is counted as
//! an error, not as a 200. On the way, the relay times the answer (TTFT, gaps) for the route's
//! goodput and teaches the replica's latency model.

use std::sync::{atomic::Ordering, Arc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use policies::RouteDecision;
use protocol::ApiError;
use serde_json::Value;

use crate::access_log::AccessRecord;
use crate::fleet::client::UpstreamLimits;
use crate::fleet::guards::PendingPrefill;
use crate::fleet::latency_model::{taught_prefill, Prefill};
use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;
use crate::metrics::GatewayMetrics;
use crate::request::sse::{
    drain_ready, error_event, write_gaps, AnswerUsage, HitPolicy, SseTap, MAX_EVENT_BYTES,
};
use crate::routes::admitted::Admitted;
use crate::routes::goodput::Served;
use crate::routes::store::ActiveRoute;

/// What arrived before anything is written to the client.
pub enum Head {
    /// A stream and its first event(s).
    Stream {
        parts: http::response::Parts,
        body: hyper::body::Incoming,
        tap: SseTap,
        first: Bytes,
    },
    /// A whole answer (any status).
    Whole {
        parts: http::response::Parts,
        body: Bytes,
    },
}

/// What the relay needs to time the answer and teach the replica's latency model.
pub struct RelayCtx<'a> {
    pub replica: &'a Arc<ReplicaHandle>,
    pub route: &'a ActiveRoute,
    pub d: &'a RouteDecision,
    pub hits: HitPolicy,
    /// When the client's request arrived.
    pub started: Instant,
    /// When it was sent to the replica.
    pub sent_at: Instant,
    /// The prefill in front of its first token there.
    pub prefill: Prefill,
    pub pending: PendingPrefill,
    pub admitted: &'a Admitted,
    /// The client spoke HTTP/1.0 (no chunked encoding).
    pub http10: bool,
}

/// The relay stage: it holds a stream to its promises (size, token count, well-formed events),
/// counts cut streams, and tells the fleet whether the replica's answer was usable.
pub struct Relay<'a> {
    pub metrics: &'a GatewayMetrics,
    pub fleet: &'a Registry,
    pub limits: &'a UpstreamLimits,
    /// The most token events the request's `max_tokens` allows (`None`: it set none).
    pub max_token_events: Option<u64>,
}

/// Cut reasons that are the replica's fault (counted towards outlier detection); the others —
/// it was ejected already, the gateway is draining — are not.
const REPLICA_FAULTS: [&str; 6] = [
    "upstream_error",
    "idle_timeout",
    "bad_event",
    "event_too_large",
    "too_many_tokens",
    "stream_too_large",
];

impl Relay<'_> {
    /// Why a stream must be cut now, having relayed `bytes` (with what is about to go out).
    fn broken(&self, tap: &SseTap, bytes: u64, name: &str) -> Option<(&'static str, String)> {
        if tap.bad_event {
            return Some((
                "bad_event",
                format!("replica {name} sent an event that is not a JSON object"),
            ));
        }
        if tap.oversized {
            return Some((
                "event_too_large",
                format!("replica {name} sent an event over {MAX_EVENT_BYTES} bytes"),
            ));
        }
        let slack = self.limits.stream_token_slack;
        if let Some(max) = (self.max_token_events).filter(|&m| tap.choice_events > m + slack) {
            return Some((
                "too_many_tokens",
                format!(
                    "replica {name} sent {} token events; max_tokens allows {max}",
                    tap.choice_events
                ),
            ));
        }
        if bytes > self.limits.max_stream_bytes {
            return Some((
                "stream_too_large",
                format!(
                    "replica {name} sent more than {} bytes",
                    self.limits.max_stream_bytes
                ),
            ));
        }
        None
    }

    fn stream_error(&self, reason: &'static str) {
        self.metrics
            .counter("kvgate_gateway_stream_errors_total", &[("reason", reason)])
            .increment(1);
    }

    /// Teaches the TTFT fit from an unstreamed answer (else such traffic is priced from the prior
    /// forever, issue 29): its time from sending less its other tokens' decode at the learnt step,
    /// only while that decode is at most a quarter of the time — a step e off then moves the
    /// estimate at most e/3 (a half let a step 2× off in front of vLLM teach 7.8 s for 0.5 s).
    /// A batch line's answer teaches nothing ([`taught_prefill`]; BENCHMARKS, issue 33).
    fn learn_from_whole(ctx: &RelayCtx<'_>, now: Instant, output_tokens: u64) -> Option<Duration> {
        let total = now - ctx.sent_at;
        let mut model = ctx.replica.model.lock();
        model.token_relayed(now);
        let batch = ctx.replica.load().requests().max(1);
        let decode = match output_tokens {
            0 | 1 => Duration::ZERO,
            n => model.predict_itl(batch)?.mul_f64((n - 1) as f64),
        };
        let prefill = taught_prefill(total, decode, ctx.route.background())?;
        model.observe_ttft(ctx.prefill, prefill);
        Some(prefill)
    }

    /// Logs placement's predicted TTFT; records observed (or estimated) ÷ predicted.
    fn score_prediction(ctx: &RelayCtx<'_>, observed: Option<Duration>, rec: &mut AccessRecord) {
        if let Some(predicted) = ctx.d.predicted_ttft_s().filter(|&p| p > 0.0) {
            rec.predicted_ttft_ms = Some(predicted * 1e3);
            if let Some(t) = observed {
                let ratio = t.as_secs_f64() / predicted;
                ctx.replica.metrics().ttft_prediction_ratio.record(ratio);
            }
        }
    }

    /// Takes the answer whose head arrived to the client; returns the status the client got.
    pub async fn relay(
        &self,
        session: &mut Session,
        ctx: &mut RelayCtx<'_>,
        head: Head,
        ejected: &mut (impl std::future::Future<Output = ()> + Unpin),
        aborted: &mut (impl std::future::Future<Output = ()> + Unpin),
        rec: &mut AccessRecord,
    ) -> u16 {
        match head {
            Head::Whole { parts, body } => self.write_whole(session, ctx, parts, body, rec).await,
            Head::Stream {
                parts,
                body,
                tap,
                first,
            } => {
                let upstream = Upstream {
                    parts,
                    body,
                    tap,
                    first,
                };
                self.relay_stream(session, ctx, upstream, ejected, aborted, rec)
                    .await
            }
        }
    }

    fn response_head(
        &self,
        ctx: &RelayCtx<'_>,
        parts: &http::response::Parts,
        content_length: Option<usize>,
    ) -> Option<ResponseHeader> {
        let mut h = ResponseHeader::build(parts.status, Some(10)).ok()?;
        for name in ["content-type", "cache-control"] {
            if let Some(v) = parts.headers.get(name) {
                let _ = h.insert_header(name, v.clone());
            }
        }
        match content_length {
            Some(n) => {
                let _ = h.insert_header("content-length", n.to_string());
            }
            // HTTP/1.0 knows no chunked encoding: the body ends when the connection closes.
            None if ctx.http10 => {
                let _ = h.insert_header("connection", "close");
            }
            None => {
                let _ = h.insert_header("transfer-encoding", "chunked");
            }
        }
        let upstream_id = parts
            .headers
            .get("x-kvgate-replica")
            .and_then(|v| v.to_str().ok())
            .unwrap_or(ctx.replica.label())
            .to_string();
        let _ = h.insert_header("x-kvgate-replica", upstream_id);
        let _ = h.insert_header("x-kvgate-upstream", ctx.replica.name.as_str());
        let _ = h.insert_header("x-kvgate-route-reason", ctx.d.reason.label());
        if let Some(b) = ctx.hits.matched_blocks_header(ctx.d.matched_blocks) {
            let _ = h.insert_header("x-kvgate-matched-blocks", b);
        }
        let _ = h.insert_header("x-kvgate-route", ctx.route.cfg.name.as_str());
        let _ = h.insert_header(
            "x-kvgate-queue-ms",
            ctx.admitted.queued.as_millis().to_string(),
        );
        Some(h)
    }

    /// An unstreamed answer: its usage rewritten per the hit policy, written whole.
    async fn write_whole(
        &self,
        session: &mut Session,
        ctx: &mut RelayCtx<'_>,
        parts: http::response::Parts,
        mut body: Bytes,
        rec: &mut AccessRecord,
    ) -> u16 {
        let status = parts.status.as_u16();
        if status == 200 {
            self.fleet.upstream_ok(ctx.replica);
        }
        let now = Instant::now();
        ctx.pending.done();
        let stats = &ctx.admitted.route().stats;
        stats.ttft_seconds.record((now - ctx.started).as_secs_f64());
        let mut output_tokens = 1;
        if status == 200 {
            // Only the usage is read (the rest of the answer is skipped, not built); the
            // answer is re-serialised only when the hit policy changes what it says.
            if let Ok(a) = serde_json::from_slice::<AnswerUsage>(&body) {
                let usage = a.usage.unwrap_or_default();
                output_tokens = usage.completion_tokens.unwrap_or(1);
                let first_token = Self::learn_from_whole(ctx, now, output_tokens);
                rec.ttft_ms =
                    first_token.map(|t| (t + (ctx.sent_at - ctx.started)).as_secs_f64() * 1e3);
                Self::score_prediction(ctx, first_token, rec);
                ctx.replica.check_prompt(rec, usage.prompt_tokens);
                rec.cached_tokens = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
                if (rec.cached_tokens).is_some_and(|c| ctx.hits.shown_tokens(c) != c) {
                    if let Ok(mut v) = serde_json::from_slice::<Value>(&body) {
                        ctx.hits.rewrite_usage(&mut v);
                        body = Bytes::from(v.to_string());
                    }
                }
            }
        }
        let Some(h) = self.response_head(ctx, &parts, Some(body.len())) else {
            return status;
        };
        if session
            .write_response_header(Box::new(h), false)
            .await
            .is_err()
            || session.write_response_body(Some(body), true).await.is_err()
        {
            rec.error = Some("client_gone".into());
            return 499;
        }
        let outcome = Served {
            stream: false,
            e2e: ctx.started.elapsed(),
            output_tokens,
            ..Served::default()
        };
        stats.e2e_seconds.record(outcome.e2e.as_secs_f64());
        rec.output_tokens = Some(output_tokens);
        if status == 200 {
            let rt = ctx.admitted.route();
            stats.finished(rt.now_s(), &outcome, &ctx.route.slo);
        }
        status
    }

    /// A stream: the first event(s), then event by event until `[DONE]` or a failure.
    async fn relay_stream(
        &self,
        session: &mut Session,
        ctx: &mut RelayCtx<'_>,
        upstream: Upstream,
        ejected: &mut (impl std::future::Future<Output = ()> + Unpin),
        aborted: &mut (impl std::future::Future<Output = ()> + Unpin),
        rec: &mut AccessRecord,
    ) -> u16 {
        let Upstream {
            parts,
            mut body,
            mut tap,
            first,
        } = upstream;
        let status = parts.status.as_u16();
        let stats = &ctx.admitted.route().stats;
        let Some(h) = self.response_head(ctx, &parts, None) else {
            return status;
        };
        if session
            .write_response_header(Box::new(h), false)
            .await
            .is_err()
        {
            rec.error = Some("client_gone".into());
            return 499;
        }
        let idle = ctx.route.cfg.stream_idle_timeout();
        let mut outcome = Served {
            stream: true,
            ..Served::default()
        };
        let mut last: Option<Instant> = None;
        let idle_timer = tokio::time::sleep(idle);
        tokio::pin!(idle_timer);
        let mut next = Some(first);
        // Chunks the replica had already sent when one is relayed go out with it, in one
        // write; each counts as a gap of zero for the client's timers, and as an even share of
        // the write's gap for the replica's learnt decode step (`write_gaps`).
        let mut coalesced = 0usize;
        // A frame other than data met while coalescing, handled on the next turn.
        let mut stashed = None;
        let mut relayed = 0u64;
        let cut: Option<(&'static str, String)> = loop {
            if let Some(data) = next.take() {
                relayed += data.len() as u64;
                let now = Instant::now();
                match last {
                    None => {
                        ctx.pending.done();
                        outcome.ttft = Some(now - ctx.started);
                        stats.ttft_seconds.record((now - ctx.started).as_secs_f64());
                        let mut model = ctx.replica.model.lock();
                        model.observe_ttft(ctx.prefill, now - ctx.sent_at);
                        model.token_relayed(now);
                        drop(model);
                        Self::score_prediction(ctx, Some(now - ctx.sent_at), rec);
                    }
                    Some(prev) => {
                        let batch = ctx.replica.load().requests().max(1);
                        let context = ctx.replica.context_in_flight.load(Ordering::Relaxed);
                        let mut model = ctx.replica.model.lock();
                        for (seen, step) in write_gaps(now - prev, coalesced) {
                            outcome.gaps.push(seen);
                            stats.inter_token_seconds.record(seen.as_secs_f64());
                            model.observe_gap_at(now, batch, context, step);
                        }
                        model.token_relayed(now);
                    }
                }
                coalesced = 0;
                last = Some(now);
                if session
                    .write_response_body(Some(data), false)
                    .await
                    .is_err()
                {
                    // Client gone: dropping `body` closes the upstream connection, and the
                    // replica cancels the request.
                    rec.error = Some("client_gone".into());
                    return 499;
                }
            }
            if tap.done {
                break None;
            }
            // One idle timer for the whole stream, re-armed only when it fires early: a token
            // costs no timer registration.
            let frame = match stashed.take() {
                Some(f) => f,
                None => tokio::select! {
                f = body.frame() => f,
                _ = &mut idle_timer => {
                    let quiet_since = last.unwrap_or(ctx.sent_at);
                    if quiet_since.elapsed() >= idle {
                        break Some(("idle_timeout", format!(
                            "replica {} sent nothing for {} ms", ctx.replica.name, idle.as_millis())));
                    }
                    idle_timer.as_mut().reset((quiet_since + idle).into());
                    continue;
                }
                _ = &mut *ejected => break Some(("replica_ejected", format!(
                    "replica {} was ejected by its health checks mid-stream", ctx.replica.name))),
                _ = &mut *aborted => break Some(("drain", "the gateway shut down before the answer was complete".to_string())),
                },
            };
            match frame {
                None => {
                    break Some((
                        "upstream_error",
                        format!(
                            "replica {} ended the stream before it was complete",
                            ctx.replica.name
                        ),
                    ))
                }
                Some(Err(e)) => {
                    break Some((
                        "upstream_error",
                        format!("replica {} broke off the stream: {e}", ctx.replica.name),
                    ))
                }
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        next = tap.feed(&d, &ctx.hits);
                    }
                    if next.is_some() && !tap.done {
                        let (joined, n, other) =
                            drain_ready(&mut body, &mut tap, &ctx.hits, next.take()).await;
                        next = joined;
                        coalesced = n;
                        stashed = other;
                    }
                    let pending = next.as_ref().map_or(0, |b| b.len() as u64);
                    if let Some(fault) = self.broken(&tap, relayed + pending, &ctx.replica.name) {
                        break Some(fault);
                    }
                }
            }
        };
        outcome.output_tokens = tap.completion_tokens.unwrap_or(tap.choice_events);
        rec.cached_tokens = tap.cached_tokens;
        ctx.replica.check_prompt(rec, tap.prompt_tokens);
        rec.output_tokens = Some(outcome.output_tokens);
        rec.ttft_ms = outcome.ttft.map(|t| t.as_secs_f64() * 1e3);
        let rt = ctx.admitted.route();
        match &cut {
            None if !tap.saw_error => self.fleet.upstream_ok(ctx.replica),
            None => self.fleet.upstream_failed(ctx.replica, "error_event"),
            Some((reason, _)) if REPLICA_FAULTS.contains(reason) => {
                self.fleet.upstream_failed(ctx.replica, reason)
            }
            Some(_) => {}
        }
        let result = match cut {
            None if !tap.saw_error => {
                let _ = session.write_response_body(None, true).await;
                stats.finished(rt.now_s(), &outcome, &ctx.route.slo);
                status
            }
            None => {
                // The replica reported its own error event and ended the stream.
                self.stream_error("upstream_error");
                rec.error = Some("the replica reported an error mid-stream".into());
                let _ = session.write_response_body(None, true).await;
                rt.stats.failed(rt.now_s());
                502
            }
            Some((reason, message)) => {
                tracing::warn!(replica = %ctx.replica.name, reason, "stream cut; sending an error event");
                self.stream_error(reason);
                rec.error = Some(message.clone());
                if !tap.saw_error {
                    let e = ApiError::new(502, "upstream_error", message).with_code(reason);
                    let _ = session
                        .write_response_body(Some(error_event(&e)), false)
                        .await;
                }
                let _ = session.write_response_body(None, true).await;
                rt.stats.failed(rt.now_s());
                502
            }
        };
        stats
            .e2e_seconds
            .record(ctx.started.elapsed().as_secs_f64());
        result
    }
}

/// A stream whose first event(s) arrived.
struct Upstream {
    parts: http::response::Parts,
    body: hyper::body::Incoming,
    tap: SseTap,
    first: Bytes,
}
