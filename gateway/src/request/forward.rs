//! Forwarding an admitted request and relaying the answer.
//!
//! Nothing is written to the client until the answer's first event (a stream) or its whole
//! body (no stream) has arrived, so every failure before that — a refused connection, a 5xx,
//! a replica that dies or is ejected while the request waits on it — is retried on another
//! replica (bounded), never shown. Waiting stops early when the client goes away (the
//! upstream request is dropped, which makes the replica cancel it) and when the replica is
//! ejected by the health checks (a stalled replica is given up on as soon as it is ejected,
//! not after the first-byte timeout).
//!
//! After the first event, a stream is relayed event by event (`relay.rs`) with a per-event
//! idle deadline derived from the route's inter-token promise. A stream that ends without
//! `[DONE]` — the replica died, stalled past the deadline, was ejected, or the gateway's drain
//! ran out — gets an OpenAI error event and is counted as an error, not as a 200.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use protocol::ApiError;
use serde_json::Value;

use crate::access_log::AccessRecord;
use crate::dispatch::Admitted;
use crate::goodput::Outcome;
use crate::placement::{Outcome as Placed, Purpose};
use crate::policy_store::{ActivePolicy, ActiveRoute};
use crate::proxy::{is_http10, respond_error, GatewayState};
use crate::registry::{InFlight, PendingPrefill, ReplicaHandle};
use crate::relay::{drain_ready, error_event, AnswerUsage, HitPolicy, SseTap};
use crate::router::Prepared;

/// Largest unstreamed answer the gateway holds to rewrite its usage.
const MAX_WHOLE_BODY: usize = 32 << 20;

/// Resolves when the client closed its connection (not on a pipelined next request).
async fn client_gone(session: &mut Session) {
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

/// Why waiting on a replica ended without what was awaited.
enum Stop {
    /// The replica failed or was ejected: try another.
    Replica(String),
    ClientGone,
    /// The drain deadline passed.
    Aborted,
    TimedOut,
}

/// Awaits `fut`, giving up when the replica is ejected, the client leaves, the drain ends or
/// `timeout` passes.
async fn watch<T>(
    fut: impl std::future::Future<Output = T>,
    timeout: Duration,
    ejected: &mut (impl std::future::Future<Output = ()> + Unpin),
    aborted: &mut (impl std::future::Future<Output = ()> + Unpin),
    session: &mut Session,
) -> Result<T, Stop> {
    tokio::select! {
        r = tokio::time::timeout(timeout, fut) => r.map_err(|_| Stop::TimedOut),
        _ = ejected => Err(Stop::Replica("the replica was ejected by its health checks".into())),
        _ = aborted => Err(Stop::Aborted),
        _ = client_gone(session) => Err(Stop::ClientGone),
    }
}

/// What arrived before anything is written to the client.
enum Head {
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

fn is_sse(parts: &http::response::Parts) -> bool {
    parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

impl GatewayState {
    fn hit_policy(&self, a: &ActivePolicy) -> HitPolicy {
        HitPolicy {
            mode: a.file.hit_signals,
            round_tokens: u64::from(a.file.hit_signal_round_tokens),
            block_size: self.router.block_size,
        }
    }

    fn stream_error(&self, reason: &'static str) {
        self.router
            .metrics
            .counter("kvgate_gateway_stream_errors_total", &[("reason", reason)])
            .increment(1);
    }

    /// Sends `p` to `replica` and waits for its first event or whole answer.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        session: &mut Session,
        replica: &Arc<ReplicaHandle>,
        p: &Prepared,
        body: Bytes,
        hits: &HitPolicy,
        ejected: &mut (impl std::future::Future<Output = ()> + Unpin),
        aborted: &mut (impl std::future::Future<Output = ()> + Unpin),
    ) -> Result<Head, Stop> {
        let addr = replica
            .addr()
            .ok_or_else(|| Stop::Replica("no address".into()))?;
        let req = self.router.registry.request(
            http::Method::POST,
            format!("http://{addr}{}", p.endpoint.path()),
            body,
        );
        let resp = watch(
            self.client.request(req),
            self.first_byte_timeout,
            ejected,
            aborted,
            session,
        )
        .await?
        .map_err(|e| {
            if e.is_connect() {
                self.router.registry.report_failure(replica.slot);
            }
            Stop::Replica(format!("{e}"))
        })?;
        let (parts, mut body) = resp.into_parts();
        if parts.status.is_server_error() {
            let bytes = watch(
                body.collect(),
                self.first_byte_timeout,
                ejected,
                aborted,
                session,
            )
            .await?
            .map(|c| c.to_bytes())
            .unwrap_or_default();
            return Err(Stop::Replica(format!(
                "answered {}: {}",
                parts.status,
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            )));
        }
        if parts.status == http::StatusCode::OK && is_sse(&parts) {
            let mut tap = SseTap::default();
            loop {
                let frame = watch(
                    body.frame(),
                    self.first_byte_timeout,
                    ejected,
                    aborted,
                    session,
                )
                .await?;
                let data = match frame {
                    None => {
                        return Err(Stop::Replica(
                            "the stream ended before its first event".into(),
                        ))
                    }
                    Some(Err(e)) => return Err(Stop::Replica(format!("{e}"))),
                    Some(Ok(f)) => match f.into_data() {
                        Ok(d) => d,
                        Err(_) => continue,
                    },
                };
                if let Some(first) = tap.feed(&data, hits) {
                    return Ok(Head::Stream {
                        parts,
                        body,
                        tap,
                        first,
                    });
                }
            }
        }
        let limited = http_body_util::Limited::new(body, MAX_WHOLE_BODY);
        let bytes = watch(
            limited.collect(),
            self.first_byte_timeout,
            ejected,
            aborted,
            session,
        )
        .await?
        .map_err(|e| Stop::Replica(format!("{e}")))?
        .to_bytes();
        Ok(Head::Whole { parts, body: bytes })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn forward(
        &self,
        session: &mut Session,
        active: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        started: Instant,
        mut admitted: Admitted,
        rec: &mut AccessRecord,
    ) -> u16 {
        let router = &self.router;
        let registry = &router.registry;
        let hits = self.hit_policy(active);
        let body = p.body_for(route.cfg.engine_priority);
        let mut tried: Vec<usize> = Vec::new();
        let mut last_error = ApiError::unavailable("no healthy replica is available")
            .with_code("no_healthy_replica");
        let mut first = Some(admitted.decision.clone());
        let mut aborted = Box::pin(self.lifecycle.aborted());
        for attempt in 0..=self.retries {
            if attempt > 0 {
                router.metrics.retries.increment(1);
                tokio::time::sleep(self.retry_backoff * attempt).await;
            }
            let decided = match first.take() {
                Some(d) => Ok(d),
                None => match self
                    .place(
                        active,
                        route,
                        p,
                        &admitted.matched,
                        Purpose::Retry { tried: &tried },
                    )
                    .outcome
                {
                    Placed::Go(d) => Ok(d),
                    Placed::Fail(e) => Err(e),
                    Placed::Hold { .. } => Err(last_error.clone()),
                },
            };
            let d = match decided {
                Ok(d) => d,
                Err(e) => {
                    if tried.is_empty() {
                        last_error = e;
                    }
                    break;
                }
            };
            tried.push(d.replica);
            let Some(replica) = registry.replica(d.replica) else {
                continue;
            };
            // Subscribed before sending, so an ejection in between is not missed.
            let mut ejected = Box::pin(replica.ejected());
            let in_flight = InFlight::new(replica.clone());
            let uncached_tokens =
                p.prompt_tokens
                    .saturating_sub(d.matched_blocks * router.block_size) as u64;
            let (pending, ahead_tokens) = match admitted.pending.take() {
                Some(x) if attempt == 0 => x,
                _ => {
                    router.sent(d.replica, p, None);
                    PendingPrefill::new(replica.clone(), uncached_tokens, p.hashes.clone())
                }
            };
            let sent_at = Instant::now();
            let head = match self
                .attempt(
                    session,
                    &replica,
                    p,
                    body.clone(),
                    &hits,
                    &mut ejected,
                    &mut aborted,
                )
                .await
            {
                Ok(h) => h,
                Err(Stop::Replica(why)) => {
                    tracing::warn!(replica = %replica.name, error = %why, attempt, "upstream request failed; retrying elsewhere");
                    last_error = ApiError::new(
                        502,
                        "bad_gateway",
                        format!("replica {} failed: {why}", replica.name),
                    )
                    .with_code("upstream_error");
                    continue;
                }
                Err(Stop::ClientGone) => {
                    rec.error = Some("client_gone".into());
                    admitted.route().stats.failed(admitted.route().now_s());
                    return 499;
                }
                Err(Stop::Aborted) => {
                    last_error =
                        ApiError::unavailable("the gateway is shutting down").with_code("draining");
                    break;
                }
                Err(Stop::TimedOut) => {
                    last_error = ApiError::new(
                        504,
                        "timeout",
                        format!(
                            "replica {} did not answer within {:?}",
                            replica.name, self.first_byte_timeout
                        ),
                    );
                    break;
                }
            };
            router.commit(route.policy.name(), p, &d);
            rec.replica = Some(replica.label().to_string());
            rec.address = Some(replica.name.clone());
            rec.reason = Some(d.reason.label());
            let mut ctx = RelayCtx {
                replica: &replica,
                route,
                d: &d,
                hits,
                started,
                sent_at,
                uncached_tokens,
                ahead_tokens,
                pending,
                admitted: &admitted,
                http10: is_http10(session),
            };
            let status = match head {
                Head::Whole { parts, body } => {
                    self.write_whole(session, &mut ctx, parts, body, rec).await
                }
                Head::Stream {
                    parts,
                    body,
                    tap,
                    first,
                } => {
                    self.relay_stream(
                        session,
                        &mut ctx,
                        parts,
                        body,
                        tap,
                        first,
                        &mut ejected,
                        &mut aborted,
                        rec,
                    )
                    .await
                }
            };
            drop(in_flight);
            return status;
        }
        rec.error = Some(last_error.body.error.message.clone());
        admitted.route().stats.failed(admitted.route().now_s());
        respond_error(session, &last_error).await
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
                let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
                rec.cached_tokens = cached;
                if cached.is_some_and(|c| ctx.hits.shown_tokens(c) != c) {
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
        let outcome = Outcome {
            stream: false,
            e2e: ctx.started.elapsed(),
            output_tokens,
            ..Outcome::default()
        };
        stats.e2e_seconds.record(outcome.e2e.as_secs_f64());
        rec.output_tokens = Some(output_tokens);
        rec.ttft_ms = Some((now - ctx.started).as_secs_f64() * 1e3);
        if status == 200 {
            let rt = ctx.admitted.route();
            stats.finished(rt.now_s(), &outcome, &rt_slo(ctx));
        }
        status
    }

    /// A stream: the first event(s), then event by event until `[DONE]` or a failure.
    #[allow(clippy::too_many_arguments)]
    async fn relay_stream(
        &self,
        session: &mut Session,
        ctx: &mut RelayCtx<'_>,
        parts: http::response::Parts,
        mut body: hyper::body::Incoming,
        mut tap: SseTap,
        first: Bytes,
        ejected: &mut (impl std::future::Future<Output = ()> + Unpin),
        aborted: &mut (impl std::future::Future<Output = ()> + Unpin),
        rec: &mut AccessRecord,
    ) -> u16 {
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
        let mut outcome = Outcome {
            stream: true,
            ..Outcome::default()
        };
        let mut last: Option<Instant> = None;
        let idle_timer = tokio::time::sleep(idle);
        tokio::pin!(idle_timer);
        let mut next = Some(first);
        // Chunks the replica had already sent when one is relayed go out with it, in one
        // write; each still counts as an inter-token gap (of zero) for the timers.
        let mut coalesced = 0usize;
        // A frame other than data met while coalescing, handled on the next turn.
        let mut stashed = None;
        let cut: Option<(&'static str, String)> = loop {
            if let Some(data) = next.take() {
                let now = Instant::now();
                match last {
                    None => {
                        ctx.pending.done();
                        outcome.ttft = Some(now - ctx.started);
                        stats.ttft_seconds.record((now - ctx.started).as_secs_f64());
                        ctx.replica.model.lock().observe_ttft(
                            ctx.ahead_tokens,
                            ctx.uncached_tokens,
                            now - ctx.sent_at,
                        );
                        if let Some(predicted) = ctx.d.predicted_ttft_s().filter(|&p| p > 0.0) {
                            let observed = (now - ctx.sent_at).as_secs_f64();
                            ctx.replica
                                .metrics()
                                .ttft_prediction_ratio
                                .record(observed / predicted);
                            rec.predicted_ttft_ms = Some(predicted * 1e3);
                        }
                    }
                    Some(prev) => {
                        let batch = ctx.replica.load().requests().max(1);
                        let mut model = ctx.replica.model.lock();
                        let gaps = std::iter::once(now - prev)
                            .chain(std::iter::repeat_n(Duration::ZERO, coalesced));
                        for gap in gaps {
                            outcome.gaps.push(gap);
                            stats.inter_token_seconds.record(gap.as_secs_f64());
                            model.observe_itl(batch, gap);
                        }
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
                }
            }
        };
        outcome.output_tokens = tap.completion_tokens.unwrap_or(tap.choice_events);
        rec.cached_tokens = tap.cached_tokens;
        rec.output_tokens = Some(outcome.output_tokens);
        rec.ttft_ms = outcome.ttft.map(|t| t.as_secs_f64() * 1e3);
        let rt = ctx.admitted.route();
        let result = match cut {
            None if !tap.saw_error => {
                let _ = session.write_response_body(None, true).await;
                stats.finished(rt.now_s(), &outcome, &rt_slo(ctx));
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

fn rt_slo(ctx: &RelayCtx<'_>) -> crate::admission::Slo {
    ctx.route.slo
}

/// What the relay needs to time the answer and teach the replica's latency model.
struct RelayCtx<'a> {
    replica: &'a Arc<ReplicaHandle>,
    route: &'a ActiveRoute,
    d: &'a policies::RouteDecision,
    hits: HitPolicy,
    /// When the client's request arrived.
    started: Instant,
    /// When it was sent to the replica.
    sent_at: Instant,
    uncached_tokens: u64,
    /// Uncached prefill already queued at the replica when this one was sent.
    ahead_tokens: u64,
    pending: PendingPrefill,
    admitted: &'a Admitted,
    /// The client spoke HTTP/1.0 (no chunked encoding).
    http10: bool,
}
