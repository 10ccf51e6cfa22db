//! The pingora service: every request is answered in `request_filter` — read the whole body
//! (`body.rs` says why), classify it into a policy route, wait for admission (`dispatch.rs`) or
//! answer 429, forward with retries before the first byte reaches the client,
//! then pass the replica's answer through chunk by chunk (SSE events are never buffered),
//! timing TTFT and inter-token gaps from the stream it forwards. A client that goes away makes
//! the next write fail; the upstream response is then dropped, which closes that connection and
//! makes the replica cancel the request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::BodyExt;
use pingora::http::ResponseHeader;
use pingora::prelude::{HttpPeer, ProxyHttp};
use pingora::proxy::Session;
use pingora::{Error, ErrorType, Result};
use protocol::ApiError;

use crate::admission::{LatencyModel, Slo};
use crate::body::read_whole_body;
use crate::dispatch::{Admitted, Refusal};
use crate::goodput::Outcome;
use crate::policy_store::{ActiveRoute, PolicyStore};
use crate::registry::{HttpClient, InFlight, PendingPrefill};
use crate::router::{Endpoint, Prepared, Router};

pub struct GatewayState {
    pub router: Router,
    pub client: HttpClient,
    pub max_body_bytes: usize,
    pub retries: u32,
    pub retry_backoff: Duration,
    pub first_byte_timeout: Duration,
    pub session_header: String,
    /// Per replica, the latency model learnt from the streams this gateway relays.
    pub models: Vec<parking_lot::Mutex<LatencyModel>>,
    /// Routes, SLOs and admission thresholds (hot-reloaded).
    pub policies: PolicyStore,
}

/// What the relay needs to time the answer and teach the replica's latency model.
struct RelayContext {
    slot: usize,
    /// When the client's request arrived.
    started: Instant,
    /// When it was sent to the replica.
    sent_at: Instant,
    stream: bool,
    uncached_tokens: u64,
    /// Uncached prefill already queued at the replica when this one was sent.
    ahead_tokens: u64,
    pending: PendingPrefill,
    /// The route's promise when the request was admitted, for goodput accounting.
    slo: Slo,
    admitted: Admitted,
}

pub struct GatewayProxy {
    pub state: Arc<GatewayState>,
}

async fn respond(
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

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

async fn respond_error(session: &mut Session, e: &ApiError) -> u16 {
    respond(session, e.status, Bytes::from(e.to_json()), &[]).await
}

impl GatewayState {
    async fn models(&self, session: &mut Session) -> u16 {
        // The union of the healthy replicas' model lists.
        let mut ids: Vec<serde_json::Value> = Vec::new();
        for r in &self.router.registry.replicas {
            let (true, Some(addr)) = (r.is_healthy(), r.addr()) else {
                continue;
            };
            let Ok(req) = http::Request::get(format!("http://{addr}/v1/models"))
                .body(http_body_util::Full::new(Bytes::new()))
            else {
                continue;
            };
            let Ok(Ok(resp)) =
                tokio::time::timeout(Duration::from_secs(2), self.client.request(req)).await
            else {
                continue;
            };
            let Ok(body) = resp.into_body().collect().await else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
                continue;
            };
            for m in v["data"].as_array().into_iter().flatten() {
                if !ids.iter().any(|x| x["id"] == m["id"]) {
                    ids.push(m.clone());
                }
            }
        }
        let body = serde_json::json!({"object": "list", "data": ids});
        respond(session, 200, Bytes::from(body.to_string()), &[]).await
    }

    async fn generate(
        self: &Arc<Self>,
        session: &mut Session,
        endpoint: Endpoint,
        started: Instant,
    ) -> u16 {
        let body = match read_whole_body(session, self.max_body_bytes).await {
            Ok(b) => b,
            Err(e) => return respond_error(session, &e).await,
        };
        let session_id = session
            .req_header()
            .headers
            .get(self.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let priority = match session.req_header().headers.get(config::Priority::HEADER) {
            None => config::Priority::Interactive,
            Some(v) => match v.to_str().ok().and_then(config::Priority::parse) {
                Some(p) => p,
                None => {
                    let e = ApiError::invalid_request(format!(
                        "{} must be interactive or batch, got {:?}",
                        config::Priority::HEADER,
                        String::from_utf8_lossy(v.as_bytes())
                    ))
                    .with_code("invalid_priority");
                    return respond_error(session, &e).await;
                }
            },
        };
        let prepared = match self.prepare(endpoint, body.clone(), session_id).await {
            Ok(p) => p,
            Err(e) => return respond_error(session, &e).await,
        };
        // One policy version for the whole request, whatever reloads meanwhile.
        let active = self.policies.load();
        let route = active.route(prepared.prompt_tokens, priority);
        match self
            .admit(&active, route, &prepared, priority, started)
            .await
        {
            Ok(admitted) => {
                self.forward(session, route, &prepared, body, started, admitted)
                    .await
            }
            Err(Refusal::Error(e)) => respond_error(session, &e).await,
            Err(Refusal::Shed(shed)) => {
                let secs = shed.retry_after_secs();
                let e = ApiError::new(
                    429,
                    "rate_limit_exceeded",
                    format!(
                        "route {} cannot serve this request within its latency targets now ({}); retry after {secs} s",
                        route.cfg.name,
                        shed.label()
                    ),
                )
                .with_code(shed.label());
                respond(
                    session,
                    429,
                    Bytes::from(e.to_json()),
                    &[
                        ("retry-after", secs.to_string()),
                        ("x-kvgate-route", route.cfg.name.clone()),
                    ],
                )
                .await
            }
        }
    }

    /// Tokenising is CPU work: it runs on the blocking pool, never on the reactor.
    pub async fn prepare(
        self: &Arc<Self>,
        endpoint: Endpoint,
        body: Bytes,
        session_id: Option<String>,
    ) -> Result<Prepared, ApiError> {
        let started = Instant::now();
        let state = self.clone();
        let p =
            tokio::task::spawn_blocking(move || state.router.prepare(endpoint, &body, session_id))
                .await
                .map_err(|e| ApiError::internal(format!("tokeniser task failed: {e}")))??;
        let m = &self.router.metrics;
        m.tokenize_seconds.record(p.tokenize_seconds);
        m.route_seconds.record(started.elapsed().as_secs_f64());
        Ok(p)
    }

    async fn forward(
        &self,
        session: &mut Session,
        route: &ActiveRoute,
        p: &Prepared,
        body: Bytes,
        started: Instant,
        mut admitted: Admitted,
    ) -> u16 {
        let router = &self.router;
        let registry = &router.registry;
        let mut tried: Vec<usize> = Vec::new();
        let mut last_error = ApiError::unavailable("no healthy replica is available")
            .with_code("no_healthy_replica");
        let outside: Vec<usize> = (0..registry.replicas.len())
            .filter(|i| !route.pool.contains(i))
            .collect();
        let mut first = Some(admitted.decision.clone());
        for attempt in 0..=self.retries {
            if attempt > 0 {
                router.metrics.retries.increment(1);
                tokio::time::sleep(self.retry_backoff * attempt).await;
            }
            let decided = match first.take() {
                Some(d) => Ok(d),
                None => {
                    let exclude: Vec<usize> = outside.iter().chain(&tried).copied().collect();
                    router.decide_in(route.policy.as_ref(), p, &admitted.matched, &exclude, false)
                }
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
            let replica = registry.replicas[d.replica].clone();
            tried.push(d.replica);
            let Some(addr) = replica.addr() else {
                registry.report_failure(d.replica);
                continue;
            };
            let in_flight = InFlight::new(replica.clone());
            let uncached_tokens =
                p.prompt_tokens
                    .saturating_sub(d.matched_blocks * router.block_size) as u64;
            let (pending, ahead_tokens) = match admitted.pending.take() {
                Some(x) if attempt == 0 => x,
                _ => PendingPrefill::new(replica.clone(), uncached_tokens),
            };
            let req = match http::Request::post(format!("http://{addr}{}", p.endpoint.path()))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(body.clone()))
            {
                Ok(r) => r,
                Err(e) => return respond_error(session, &ApiError::internal(e.to_string())).await,
            };
            let sent_at = Instant::now();
            let resp = match tokio::time::timeout(self.first_byte_timeout, self.client.request(req))
                .await
            {
                Err(_) => {
                    let e = ApiError::new(
                        504,
                        "timeout",
                        format!(
                            "replica {} did not answer within {:?}",
                            replica.name, self.first_byte_timeout
                        ),
                    );
                    return respond_error(session, &e).await;
                }
                Ok(Err(e)) => {
                    if e.is_connect() {
                        registry.report_failure(d.replica);
                    }
                    tracing::warn!(replica = %replica.name, error = %e, attempt, "upstream request failed");
                    last_error = ApiError::new(
                        502,
                        "bad_gateway",
                        format!("replica {} failed: {e}", replica.name),
                    );
                    continue;
                }
                Ok(Ok(r)) => r,
            };
            let status = resp.status();
            if status.is_server_error() && attempt < self.retries {
                tracing::warn!(replica = %replica.name, %status, attempt, "replica answered 5xx; retrying elsewhere");
                last_error = ApiError::new(
                    502,
                    "bad_gateway",
                    format!("replica {} answered {status}", replica.name),
                );
                continue;
            }
            router.commit(route.policy.name(), p, &d);
            let obs = RelayContext {
                slot: d.replica,
                started,
                sent_at,
                stream: p.stream,
                uncached_tokens,
                ahead_tokens,
                pending,
                slo: route.slo,
                admitted,
            };
            let status = self
                .relay(session, resp, &replica.name, &route.cfg.name, &d, obs)
                .await;
            drop(in_flight);
            return status;
        }
        respond_error(session, &last_error).await
    }

    async fn relay(
        &self,
        session: &mut Session,
        resp: http::Response<hyper::body::Incoming>,
        replica: &str,
        route_name: &str,
        d: &policies::RouteDecision,
        mut obs: RelayContext,
    ) -> u16 {
        let (started, stream) = (obs.started, obs.stream);
        let stats = &obs.admitted.route().stats;
        let status = resp.status().as_u16();
        let (parts, mut body) = resp.into_parts();
        let Ok(mut h) = ResponseHeader::build(status, Some(8)) else {
            return status;
        };
        for name in ["content-type", "content-length", "cache-control"] {
            if let Some(v) = parts.headers.get(name) {
                let _ = h.insert_header(name, v.clone());
            }
        }
        if !parts.headers.contains_key("content-length") {
            let _ = h.insert_header("transfer-encoding", "chunked");
        }
        let upstream_id = parts
            .headers
            .get("x-kvgate-replica")
            .and_then(|v| v.to_str().ok())
            .unwrap_or(replica)
            .to_string();
        let _ = h.insert_header("x-kvgate-replica", upstream_id);
        let _ = h.insert_header("x-kvgate-upstream", replica);
        let _ = h.insert_header("x-kvgate-route-reason", d.reason.label());
        let _ = h.insert_header("x-kvgate-matched-blocks", d.matched_blocks.to_string());
        let _ = h.insert_header("x-kvgate-route", route_name);
        let _ = h.insert_header(
            "x-kvgate-queue-ms",
            obs.admitted.queued.as_millis().to_string(),
        );
        if session
            .write_response_header(Box::new(h), false)
            .await
            .is_err()
        {
            return 499;
        }
        let mut last: Option<Instant> = None;
        let mut outcome = Outcome {
            stream,
            ..Outcome::default()
        };
        // An unstreamed answer is small; it is kept to read its usage for goodput accounting.
        let mut whole: Vec<u8> = Vec::new();
        loop {
            // The same bound applies between chunks: a replica that stalls mid-answer is cut off.
            let Ok(next) = tokio::time::timeout(self.first_byte_timeout, body.frame()).await else {
                tracing::warn!(%replica, "replica stalled mid-answer; closing the response");
                break;
            };
            let Some(frame) = next else { break };
            let Ok(frame) = frame else {
                // The replica broke mid-answer: bytes already reached the client, so no retry.
                break;
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.is_empty() {
                continue;
            }
            let now = Instant::now();
            // Only a stream's chunk times are token times; a plain body arrives at the end.
            let learn = stream && status == 200;
            match last {
                None => {
                    obs.pending.done();
                    outcome.ttft = Some(now - started);
                    stats.ttft_seconds.record((now - started).as_secs_f64());
                    if learn {
                        self.models[obs.slot].lock().observe_ttft(
                            obs.ahead_tokens,
                            obs.uncached_tokens,
                            now - obs.sent_at,
                        );
                    }
                }
                Some(prev) if stream => {
                    outcome.gaps.push(now - prev);
                    stats.inter_token_seconds.record((now - prev).as_secs_f64());
                    if learn {
                        let batch = self.router.registry.replicas[obs.slot]
                            .load()
                            .requests()
                            .max(1);
                        self.models[obs.slot].lock().observe_itl(batch, now - prev);
                    }
                }
                Some(_) => {}
            }
            last = Some(now);
            if stream {
                // Streamed chunks (events other than [DONE]) stand for output tokens.
                outcome.output_tokens +=
                    count(&data, b"data:").saturating_sub(count(&data, b"[DONE]")) as u64;
            } else if whole.len() + data.len() <= 1 << 20 {
                whole.extend_from_slice(&data);
            }
            if session
                .write_response_body(Some(data), false)
                .await
                .is_err()
            {
                // Client gone: dropping `body` closes the upstream connection, and the replica
                // cancels the request.
                return 499;
            }
        }
        let _ = session.write_response_body(None, true).await;
        outcome.e2e = started.elapsed();
        stats.e2e_seconds.record(outcome.e2e.as_secs_f64());
        if status == 200 {
            if !stream {
                outcome.output_tokens = serde_json::from_slice::<serde_json::Value>(&whole)
                    .ok()
                    .and_then(|v| v["usage"]["completion_tokens"].as_u64())
                    .unwrap_or(1);
            }
            let rt = obs.admitted.route();
            stats.finished(rt.now_s(), &outcome, &obs.slo);
        }
        status
    }
}

#[async_trait]
impl ProxyHttp for GatewayProxy {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        let started = Instant::now();
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        let state = &self.state;
        let (route, status) = match (method.as_str(), path.as_str()) {
            ("POST", "/v1/completions") => (
                "completions",
                state
                    .generate(session, Endpoint::Completions, started)
                    .await,
            ),
            ("POST", "/v1/chat/completions") => (
                "chat_completions",
                state
                    .generate(session, Endpoint::ChatCompletions, started)
                    .await,
            ),
            ("GET", "/v1/models") => ("models", state.models(session).await),
            ("GET", "/health") => {
                let healthy = state.router.registry.healthy_count();
                let code = if healthy > 0 { 200 } else { 503 };
                let body = serde_json::json!({"status": if healthy > 0 {"ok"} else {"no healthy replica"}, "healthy_replicas": healthy});
                (
                    "health",
                    respond(session, code, Bytes::from(body.to_string()), &[]).await,
                )
            }
            (m, p) => {
                let e = if matches!(
                    p,
                    "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health"
                ) {
                    ApiError::method_not_allowed(m, p)
                } else {
                    ApiError::not_found_path(p)
                };
                ("other", respond_error(session, &e).await)
            }
        };
        state.router.metrics.request(route, status);
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        // Every request is answered in `request_filter`; pingora never gets here.
        Err(Error::new(ErrorType::InternalError))
    }
}
