//! Stage 5, forward: send an admitted request to its replica and wait for the answer's head,
//! retrying elsewhere while nothing has reached the client.
//!
//! Nothing is written to the client until the answer's first event (a stream) or its whole
//! body (no stream) has arrived, so every failure before that — a refused connection, a 5xx,
//! a replica that dies or is ejected while the request waits on it — is retried on another
//! replica (bounded; where to is placement's answer, which the pipeline hands in as `again`),
//! never shown. Waiting stops early when the client goes away (the upstream request is
//! dropped, which makes the replica cancel it) and when the replica is ejected by the health
//! checks (a stalled replica is given up on as soon as it is ejected, not after the
//! first-byte timeout). Once the head is here, the relay stage takes the answer to the client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use pingora::proxy::Session;
use policies::RouteDecision;
use protocol::ApiError;

use crate::access_log::AccessRecord;
use crate::fleet::client::UpstreamLimits;
use crate::fleet::guards::{InFlight, PendingPrefill};
use crate::fleet::latency_model::Prefill;
use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;
use crate::http::session::{client_gone, is_http10, respond_error};
use crate::lifecycle::Lifecycle;
use crate::metrics::GatewayMetrics;
use crate::prefix::view::{uncached_tokens, PrefixView};
use crate::request::json_check::is_json_object;
use crate::request::prepared::Prepared;
use crate::request::relay::{Head, Relay, RelayCtx};
use crate::request::sse::{HitPolicy, SseTap, MAX_EVENT_BYTES};
use crate::request::warm::Warmer;
use crate::routes::admitted::Admitted;
use crate::routes::store::{ActivePolicy, ActiveRoute};

/// The most of a 5xx answer's body read (for the message that names it).
const MAX_ERROR_BODY: usize = 64 << 10;

/// What the forward stage works with.
pub struct Forwarder<'a> {
    pub fleet: &'a Registry,
    pub prefix: &'a PrefixView,
    pub metrics: &'a GatewayMetrics,
    pub lifecycle: &'a Lifecycle,
    pub limits: UpstreamLimits,
}

/// Where an admitted request goes after the replicas in `tried` failed it, given the match it
/// was admitted on: placement's retry, handed in by the pipeline.
pub type Again<'a> = dyn Fn(&[usize], &[usize]) -> Result<RouteDecision, ApiError> + Sync + 'a;

/// Why waiting on a replica ended without what was awaited.
enum Stop {
    /// The replica failed, answered unusably, or was ejected: try another. `reason` is the
    /// bounded label it is counted under (`None`: not the replica's fault to count).
    Replica {
        reason: Option<&'static str>,
        why: String,
    },
    ClientGone,
    /// The drain deadline passed.
    Aborted,
    TimedOut,
}

impl Stop {
    fn replica(reason: &'static str, why: impl Into<String>) -> Stop {
        Stop::Replica {
            reason: Some(reason),
            why: why.into(),
        }
    }
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
        _ = ejected => Err(Stop::Replica {
            reason: None,
            why: "the replica was ejected by its health checks".into(),
        }),
        _ = aborted => Err(Stop::Aborted),
        _ = client_gone(session) => Err(Stop::ClientGone),
    }
}

fn is_sse(parts: &http::response::Parts) -> bool {
    parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// What the client is told about cache hits under the active policy.
fn hit_policy(a: &ActivePolicy, block_size: usize) -> HitPolicy {
    HitPolicy {
        mode: a.file.hit_signals,
        round_tokens: u64::from(a.file.hit_signal_round_tokens),
        block_size,
    }
}

/// One attempt's upstream call.
struct Attempt<'s, 'e> {
    session: &'s mut Session,
    ejected: &'e mut (dyn std::future::Future<Output = ()> + Unpin + Send),
    aborted: &'e mut (dyn std::future::Future<Output = ()> + Unpin + Send),
}

impl Forwarder<'_> {
    /// Reads a whole body, at most `limit` bytes, each chunk within the body idle timeout.
    async fn read_body(
        &self,
        at: &mut Attempt<'_, '_>,
        body: &mut hyper::body::Incoming,
        limit: usize,
    ) -> Result<Bytes, Stop> {
        let idle = self.limits.body_idle_timeout;
        let mut buf = bytes::BytesMut::new();
        loop {
            let frame = match watch(
                body.frame(),
                idle,
                &mut at.ejected,
                &mut at.aborted,
                at.session,
            )
            .await
            {
                Err(Stop::TimedOut) => {
                    return Err(Stop::replica(
                        "body_stall",
                        format!("its answer's body stalled for {} ms", idle.as_millis()),
                    ))
                }
                r => r?,
            };
            match frame {
                None => return Ok(buf.freeze()),
                Some(Err(e)) => return Err(Stop::replica("transport", format!("{e}"))),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        if buf.len() + d.len() > limit {
                            return Err(Stop::replica(
                                "body_too_large",
                                format!("its answer is larger than {limit} bytes"),
                            ));
                        }
                        buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }

    /// Sends `p` to `replica` and waits for its first event or whole answer; an answer the
    /// client could not use (not JSON, not a stream when one was asked for, an event that does
    /// not parse) is a failure of the replica, tried elsewhere.
    async fn attempt(
        &self,
        at: &mut Attempt<'_, '_>,
        replica: &Arc<ReplicaHandle>,
        p: &Prepared,
        body: Bytes,
        hits: &HitPolicy,
    ) -> Result<Head, Stop> {
        let timeout = self.limits.first_byte_timeout;
        let addr = replica.addr().ok_or_else(|| Stop::Replica {
            reason: None,
            why: "no address".into(),
        })?;
        let client = self.fleet.client();
        let req = client.request(
            http::Method::POST,
            format!("http://{addr}{}", p.endpoint.path()),
            body,
        );
        let resp = watch(
            client.send(req),
            timeout,
            &mut at.ejected,
            &mut at.aborted,
            at.session,
        )
        .await?
        .map_err(|e| {
            if e.is_connect() {
                self.fleet.report_failure(replica.slot);
                return Stop::Replica {
                    reason: None,
                    why: format!("{e}"),
                };
            }
            Stop::replica("transport", format!("{e}"))
        })?;
        let (parts, mut body) = resp.into_parts();
        if parts.status.is_server_error() {
            let bytes = self
                .read_body(at, &mut body, MAX_ERROR_BODY)
                .await
                .unwrap_or_default();
            return Err(Stop::replica(
                "status_5xx",
                format!(
                    "answered {}: {}",
                    parts.status,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                ),
            ));
        }
        if parts.status == http::StatusCode::OK && is_sse(&parts) {
            let mut tap = SseTap::default();
            loop {
                let frame = watch(
                    body.frame(),
                    timeout,
                    &mut at.ejected,
                    &mut at.aborted,
                    at.session,
                )
                .await?;
                let data = match frame {
                    None => {
                        return Err(Stop::replica(
                            "stream_ended",
                            "the stream ended before its first event",
                        ))
                    }
                    Some(Err(e)) => return Err(Stop::replica("transport", format!("{e}"))),
                    Some(Ok(f)) => match f.into_data() {
                        Ok(d) => d,
                        Err(_) => continue,
                    },
                };
                let first = tap.feed(&data, hits);
                if tap.bad_event {
                    return Err(Stop::replica(
                        "bad_event",
                        "its stream's first event is not a JSON object",
                    ));
                }
                if tap.oversized {
                    return Err(Stop::replica(
                        "event_too_large",
                        format!("its stream's first event is over {MAX_EVENT_BYTES} bytes"),
                    ));
                }
                if let Some(first) = first {
                    return Ok(Head::Stream {
                        parts,
                        body,
                        tap,
                        first,
                    });
                }
            }
        }
        if p.stream && parts.status == http::StatusCode::OK {
            return Err(Stop::replica(
                "not_sse",
                format!(
                    "a stream was asked for and it answered {:?}",
                    parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .map_or("no content type".into(), |v| String::from_utf8_lossy(
                            v.as_bytes()
                        ))
                ),
            ));
        }
        let bytes = self
            .read_body(at, &mut body, self.limits.max_response_bytes)
            .await?;
        if !is_json_object(&bytes) {
            return Err(Stop::replica(
                "not_json",
                format!(
                    "its {} answer is not a JSON object: {:?}",
                    parts.status,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(80)])
                ),
            ));
        }
        Ok(Head::Whole { parts, body: bytes })
    }

    /// Records a decision whose replica answered: the speculative insert refreshed, the
    /// decision and the predicted hit counted.
    fn commit(&self, route: &ActiveRoute, p: &Prepared, d: &RouteDecision, r: &ReplicaHandle) {
        self.prefix
            .speculate(d.replica, p.blocks(), self.fleet.now_s());
        self.metrics.decision(route.policy.name(), d.reason.label());
        let hit = (d.matched_blocks * p.block_size) as u64;
        r.metrics().prompt_tokens.increment(p.prompt_tokens as u64);
        r.metrics().predicted_hit_tokens.increment(hit);
        route.model_tokens.prompt.increment(p.prompt_tokens as u64);
        route.model_tokens.predicted_hit.increment(hit);
    }

    /// Sends an admitted request, retrying before the first byte, and hands the answer to the
    /// relay; returns the status the client got.
    #[allow(clippy::too_many_arguments)]
    pub async fn forward(
        &self,
        session: &mut Session,
        active: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        started: Instant,
        mut admitted: Admitted,
        rec: &mut AccessRecord,
        again: &Again<'_>,
    ) -> u16 {
        let block_size = p.block_size;
        let hits = hit_policy(active, block_size);
        let body = p.body_for(route.cfg.engine_priority);
        let mut tried: Vec<usize> = Vec::new();
        let mut last_error = ApiError::unavailable("no healthy replica is available")
            .with_code("no_healthy_replica");
        let mut first = Some(admitted.decision.clone());
        let mut aborted = Box::pin(self.lifecycle.aborted());
        for attempt in 0..=self.limits.retries {
            if attempt > 0 {
                self.metrics.retries.increment(1);
                tokio::time::sleep(self.limits.retry_backoff * attempt).await;
            }
            let decided = match first.take() {
                Some(d) => Ok(d),
                None => again(&admitted.matched, &tried),
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
            let Some(replica) = self.fleet.replica(d.replica) else {
                continue;
            };
            // Subscribed before sending, so an ejection in between is not missed.
            let mut ejected = Box::pin(replica.ejected());
            let in_flight =
                InFlight::new(replica.clone(), p.prompt_tokens as u64, route.background());
            let uncached_tokens = uncached_tokens(p.prompt_tokens, d.matched_blocks, block_size);
            let (pending, joined) = match admitted.pending.take() {
                Some(x) if attempt == 0 => x,
                _ => {
                    self.prefix
                        .sent(d.replica, p.blocks(), None, self.fleet.now_s());
                    PendingPrefill::new(
                        replica.clone(),
                        uncached_tokens,
                        p.hashes.clone(),
                        route.background(),
                    )
                }
            };
            let cached_tokens = (p.prompt_tokens as u64).saturating_sub(uncached_tokens);
            if !p.stream {
                pending.unstreamed(cached_tokens);
            }
            let sent_at = Instant::now();
            if attempt == 0 {
                let warmer = Warmer {
                    fleet: self.fleet,
                    prefix: self.prefix,
                };
                rec.warmed = warmer.warm(route, p, &d);
            }
            let mut at = Attempt {
                session,
                ejected: &mut ejected,
                aborted: &mut aborted,
            };
            let head = match self
                .attempt(&mut at, &replica, p, body.clone(), &hits)
                .await
            {
                Ok(h) => h,
                Err(Stop::Replica { reason, why }) => {
                    tracing::warn!(replica = %replica.name, error = %why, attempt, "upstream request failed; retrying elsewhere");
                    if let Some(reason) = reason {
                        self.fleet.upstream_failed(&replica, reason);
                    }
                    last_error = if reason == Some("body_stall") {
                        ApiError::new(
                            504,
                            "timeout",
                            format!("replica {} failed: {why}", replica.name),
                        )
                        .with_code("upstream_timeout")
                    } else {
                        ApiError::new(
                            502,
                            "bad_gateway",
                            format!("replica {} failed: {why}", replica.name),
                        )
                        .with_code("upstream_error")
                    };
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
                    self.fleet.upstream_failed(&replica, "first_byte_timeout");
                    last_error = ApiError::new(
                        504,
                        "timeout",
                        format!(
                            "replica {} did not answer within {:?}",
                            replica.name, self.limits.first_byte_timeout
                        ),
                    );
                    break;
                }
            };
            self.commit(route, p, &d, &replica);
            rec.replica = Some(replica.label().to_string());
            rec.address = Some(replica.name.clone());
            rec.reason = Some(d.reason.label());
            rec.predicted_uncached_tokens = Some(uncached_tokens);
            rec.ahead_tokens = Some(joined.ahead);
            rec.step_wait_ms = Some(joined.step_wait_s * 1e3);
            let mut ctx = RelayCtx {
                replica: &replica,
                route,
                d: &d,
                hits,
                started,
                sent_at,
                prefill: Prefill {
                    ahead: joined.ahead,
                    tokens: uncached_tokens,
                    cached: cached_tokens,
                    step_wait_s: joined.step_wait_s,
                    step_left_s: joined.step_left_s,
                    step_s: joined.step_s,
                },
                pending,
                admitted: &admitted,
                http10: is_http10(session),
            };
            let relay = Relay {
                metrics: self.metrics,
                fleet: self.fleet,
                limits: &self.limits,
                max_token_events: p.max_token_events,
            };
            let status = relay
                .relay(session, &mut ctx, head, &mut ejected, &mut aborted, rec)
                .await;
            drop(in_flight);
            if let (200, Some(probe)) = (status, &p.id_probe) {
                let (body, ids) = (probe.body.clone(), probe.ids.clone());
                let client = self.fleet.client().clone();
                replica.spawn_id_check(client, body, ids, route.cfg.name.clone());
            }
            return status;
        }
        rec.error = Some(last_error.body.error.message.clone());
        admitted.route().stats.failed(admitted.route().now_s());
        respond_error(session, &last_error).await
    }
}
