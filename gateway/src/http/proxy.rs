//! The pingora service: every request is answered in `request_filter`. For a generation
//! request: authenticate the caller (API key → tenant and allowed priority classes), read the
//! whole body within its deadline (`body.rs` says why it is read whole), tokenise with bounded
//! work and a bounded number of tokenisers at once, classify into a policy route, wait for
//! admission (`dispatch.rs`) or answer 429, then forward (`forward.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use config::{Grant, Priority};
use http_body_util::BodyExt;
use pingora::http::ResponseHeader;
use pingora::prelude::{HttpPeer, ProxyHttp};
use pingora::proxy::Session;
use pingora::{Error, ErrorType, Result};
use protocol::ApiError;

use crate::access_log::AccessRecord;
use crate::body::read_whole_body;
use crate::conn::GuardedStream;
use crate::dispatch::Refusal;
use crate::router::{Caller, Endpoint, Prepared, PromptLimits};

/// Bodies up to this size are tokenised on the reactor (see [`GatewayState::prepare`]).
pub const INLINE_PREPARE_BYTES: usize = 1024;

pub use crate::state::{GatewayState, FALLBACK_MODEL_LEN};

pub struct GatewayProxy {
    pub state: Arc<GatewayState>,
}

/// Whether the client spoke HTTP/1.0, which knows no chunked encoding.
pub(crate) fn is_http10(session: &Session) -> bool {
    session.req_header().version == http::Version::HTTP_10
}

pub(crate) async fn respond(
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

pub(crate) async fn respond_error(session: &mut Session, e: &ApiError) -> u16 {
    let mut headers = Vec::new();
    if e.status == 401 {
        headers.push(("www-authenticate", "Bearer".to_string()));
    }
    respond(session, e.status, Bytes::from(e.to_json()), &headers).await
}

fn parse_priority(session: &Session) -> Result<Priority, ApiError> {
    match session.req_header().headers.get(Priority::HEADER) {
        None => Ok(Priority::Interactive),
        Some(v) => v.to_str().ok().and_then(Priority::parse).ok_or_else(|| {
            ApiError::invalid_request(format!(
                "{} must be interactive or batch, got {:?}",
                Priority::HEADER,
                String::from_utf8_lossy(v.as_bytes())
            ))
            .with_code("invalid_priority")
        }),
    }
}

impl GatewayState {
    /// Longest prompt the model takes: the gateway file's setting, else what the replicas
    /// reported, else [`FALLBACK_MODEL_LEN`].
    pub fn model_limit(&self) -> usize {
        self.model_len_override
            .or_else(|| self.router.registry.max_model_len().map(|n| n as usize))
            .unwrap_or(FALLBACK_MODEL_LEN)
    }

    async fn models(&self, session: &mut Session) -> u16 {
        let ids = self.model_cards().await;
        let body = serde_json::json!({"object": "list", "data": ids});
        respond(session, 200, Bytes::from(body.to_string()), &[]).await
    }

    /// `GET /v1/models/{id}`: the card of a model some healthy replica serves, or 404.
    async fn model(&self, session: &mut Session, id: &str) -> u16 {
        let cards = self.model_cards().await;
        match cards.into_iter().find(|c| c["id"] == id) {
            Some(card) => respond(session, 200, Bytes::from(card.to_string()), &[]).await,
            None => {
                let e = ApiError::model_not_found(id, &self.router.model);
                respond_error(session, &e).await
            }
        }
    }

    /// The union of the healthy replicas' model cards.
    async fn model_cards(&self) -> Vec<serde_json::Value> {
        let mut ids: Vec<serde_json::Value> = Vec::new();
        for r in self.router.registry.replicas().iter() {
            let (true, Some(addr)) = (r.is_healthy(), r.addr()) else {
                continue;
            };
            let req = self.router.registry.request(
                http::Method::GET,
                format!("http://{addr}/v1/models"),
                Bytes::new(),
            );
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
        ids
    }

    /// The tenant's cache scope under the active policy.
    fn tenant_salt(&self, grant: Option<&Grant>) -> Option<String> {
        let g = grant?;
        let active = self.policies.load();
        Some(format!(
            "kvgate-tenant:{}",
            active.file.cache_owner(&g.tenant)
        ))
    }

    async fn generate(
        self: &Arc<Self>,
        session: &mut Session,
        endpoint: Endpoint,
        started: Instant,
        grant: Option<Grant>,
        rec: &mut AccessRecord,
    ) -> u16 {
        let priority = match parse_priority(session) {
            Ok(p) => p,
            Err(e) => return respond_error(session, &e).await,
        };
        if let Some(g) = &grant {
            if !g.allows(priority) {
                let e = ApiError::new(
                    403,
                    "permission_error",
                    format!(
                        "tenant {} may not use the {} priority class",
                        g.tenant,
                        priority.label()
                    ),
                )
                .with_code("priority_not_allowed");
                return respond_error(session, &e).await;
            }
        }
        let body = match tokio::time::timeout(
            self.body_timeout,
            read_whole_body(session, self.max_body_bytes),
        )
        .await
        {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                session.set_keepalive(None);
                return respond_error(session, &e).await;
            }
            Err(_) => {
                self.router
                    .metrics
                    .counter(
                        "kvgate_gateway_connections_closed_total",
                        &[("reason", "body_timeout")],
                    )
                    .increment(1);
                session.set_keepalive(None);
                let e = ApiError::new(
                    408,
                    "invalid_request_error",
                    format!(
                        "the request body did not arrive within {} ms",
                        self.body_timeout.as_millis()
                    ),
                )
                .with_code("body_timeout");
                return respond_error(session, &e).await;
            }
        };
        let caller = Caller {
            session_id: session
                .req_header()
                .headers
                .get(self.session_header.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            tenant_salt: self.tenant_salt(grant.as_ref()),
        };
        // One policy version for the whole request, whatever reloads meanwhile.
        let active = self.policies.load();
        let per_prompt = match active.max_prompt_tokens() {
            Some(r) => r.min(self.model_limit()),
            None => self.model_limit(),
        };
        let limits = PromptLimits {
            per_prompt,
            per_request: self.max_request_prompt_tokens,
        };
        let prepared = match self.prepare(endpoint, body, caller, limits).await {
            Ok(p) => p,
            Err(e) => return respond_error(session, &e).await,
        };
        rec.prompt_tokens = Some(prepared.prompt_tokens);
        rec.stream = Some(prepared.stream);
        let route = active.route(prepared.prompt_tokens, priority);
        rec.route = Some(route.cfg.name.clone());
        if let Some(max) = route.cfg.max_prompt_tokens {
            if prepared.largest_prompt_tokens > max {
                let e = ApiError::invalid_request(format!(
                    "The prompt has {} tokens; route {} accepts at most {max}.",
                    prepared.largest_prompt_tokens, route.cfg.name
                ))
                .with_code("context_length_exceeded");
                return respond_error(session, &e).await;
            }
        }
        match self
            .admit(&active, route, &prepared, priority, started)
            .await
        {
            Ok(admitted) => {
                rec.queue_ms = Some(admitted.queued.as_secs_f64() * 1e3);
                self.forward(session, &active, route, &prepared, started, admitted, rec)
                    .await
            }
            Err(Refusal::Error(e)) => respond_error(session, &e).await,
            Err(Refusal::Shed(shed)) => {
                let secs = shed.retry_after_secs();
                rec.error = Some(shed.label().to_string());
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

    /// Tokenising is CPU work: it runs on the blocking pool, never on the reactor, and at most
    /// `tokenize_slots` prompts at once; a request that cannot get a slot in time is shed. A
    /// small body (at most [`INLINE_PREPARE_BYTES`]: a few hundred tokens, tens of
    /// microseconds) is prepared where it is, on the reactor — the hand-off to the blocking
    /// pool and back would cost more than the work.
    pub async fn prepare(
        self: &Arc<Self>,
        endpoint: Endpoint,
        body: Bytes,
        caller: Caller,
        limits: PromptLimits,
    ) -> Result<Prepared, ApiError> {
        let started = Instant::now();
        if body.len() <= INLINE_PREPARE_BYTES {
            let p = self.router.prepare(endpoint, &body, &caller, limits)?;
            self.record_prepare(&p, started);
            return Ok(p);
        }
        let slot = tokio::time::timeout(
            self.tokenize_wait,
            self.tokenize_slots.clone().acquire_owned(),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| {
            ApiError::new(
                429,
                "rate_limit_exceeded",
                "every tokeniser is busy; retry shortly",
            )
            .with_code("tokenizer_busy")
        })?;
        let state = self.clone();
        let p = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            state.router.prepare(endpoint, &body, &caller, limits)
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokeniser task failed: {e}")))??;
        self.record_prepare(&p, started);
        Ok(p)
    }

    fn record_prepare(&self, p: &Prepared, started: Instant) {
        let m = &self.router.metrics;
        m.tokenize_seconds.record(p.tokenize_seconds);
        m.route_seconds.record(started.elapsed().as_secs_f64());
    }
}

#[async_trait]
impl ProxyHttp for GatewayProxy {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        let started = Instant::now();
        let state = &self.state;
        let _active = state.lifecycle.enter();
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        let mut rec = AccessRecord::new(method.as_str(), &path);
        if is_http10(session) {
            session.set_keepalive(None);
        }
        let generation = match (method.as_str(), path.as_str()) {
            ("POST", "/v1/completions") => Some(Endpoint::Completions),
            ("POST", "/v1/chat/completions") => Some(Endpoint::ChatCompletions),
            _ => None,
        };
        let (endpoint, status) = match (method.as_str(), path.as_str(), generation) {
            (_, "/health", _) if method == http::Method::GET => {
                let healthy = state.router.registry.healthy_count();
                let draining = state.lifecycle.is_draining();
                let (code, status) = match (draining, healthy) {
                    (true, _) => (503, "draining"),
                    (false, 0) => (503, "no healthy replica"),
                    _ => (200, "ok"),
                };
                let body = serde_json::json!({"status": status, "healthy_replicas": healthy});
                (
                    "health",
                    respond(session, code, Bytes::from(body.to_string()), &[]).await,
                )
            }
            (_, "/metrics", _) if method == http::Method::GET && state.metrics_on_api_port => {
                let text = state.router.metrics.render();
                (
                    "metrics",
                    respond(
                        session,
                        200,
                        Bytes::from(text),
                        &[("content-type", "text/plain; version=0.0.4".into())],
                    )
                    .await,
                )
            }
            _ if state.lifecycle.is_draining() => {
                session.set_keepalive(None);
                let e = ApiError::unavailable(
                    "the gateway is shutting down; retry on another instance",
                )
                .with_code("draining");
                ("other", respond_error(session, &e).await)
            }
            (_, "/v1/models", _) if method == http::Method::GET => {
                match state.keys.authenticate(&session.req_header().headers) {
                    Ok(_) => ("models", state.models(session).await),
                    Err(e) => {
                        state.auth_failed("api");
                        ("models", respond_error(session, &e).await)
                    }
                }
            }
            (_, p, _)
                if method == http::Method::GET
                    && protocol::openai::model_id_in_path(p).is_some() =>
            {
                let id = protocol::openai::model_id_in_path(p).unwrap_or_default();
                match state.keys.authenticate(&session.req_header().headers) {
                    Ok(_) => ("models", state.model(session, &id).await),
                    Err(e) => {
                        state.auth_failed("api");
                        ("models", respond_error(session, &e).await)
                    }
                }
            }
            (_, _, Some(ep)) => {
                let status = match state.keys.authenticate(&session.req_header().headers) {
                    Ok(grant) => {
                        rec.tenant = grant.as_ref().map(|g| g.tenant.clone());
                        state.generate(session, ep, started, grant, &mut rec).await
                    }
                    Err(e) => {
                        state.auth_failed("api");
                        respond_error(session, &e).await
                    }
                };
                (ep.label(), status)
            }
            (m, p, None) => {
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
        GuardedStream::request_done(session);
        state.router.metrics.request(endpoint, status);
        if endpoint != "health" && state.access_log.enabled() {
            rec.status = status;
            rec.e2e_ms = started.elapsed().as_secs_f64() * 1e3;
            state.access_log.write(&rec);
        }
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        // Every request is answered in `request_filter`; pingora never gets here.
        Err(Error::new(ErrorType::InternalError))
    }
}
