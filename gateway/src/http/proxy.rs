//! The pingora service and the API port's endpoint table: every request is answered in
//! `request_filter`. `GET /health` and (when enabled) `GET /metrics` are answered here;
//! `GET /v1/models[/{id}]` by `models.rs`; a generation request (`POST /v1/completions`,
//! `POST /v1/chat/completions`) is authenticated (API key → tenant and allowed priority
//! classes) and handed to the request pipeline (`request/mod.rs`); the Files and Batches
//! endpoints go to `batch/api.rs`; anything else gets an
//! OpenAI-shaped 404 or 405. Each request is then counted and written to the access log.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::prelude::{HttpPeer, ProxyHttp};
use pingora::proxy::Session;
use pingora::{Error, ErrorType, Result};
use protocol::ApiError;

use crate::access_log::AccessRecord;
use crate::http::conn::GuardedStream;
use crate::http::models;
use crate::http::session::{is_http10, respond, respond_error};
use crate::request;
use crate::request::prepared::Endpoint;
use crate::state::GatewayState;

pub struct GatewayProxy {
    pub state: Arc<GatewayState>,
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
        // HEAD is answered wherever GET is (pingora leaves the body out).
        let readable = method == http::Method::GET || method == http::Method::HEAD;
        let generation = match (method.as_str(), path.as_str()) {
            ("POST", "/v1/completions") => Some(Endpoint::Completions),
            ("POST", "/v1/chat/completions") => Some(Endpoint::ChatCompletions),
            _ => None,
        };
        let (endpoint, status) = match (method.as_str(), path.as_str(), generation) {
            (_, "/health", _) if readable => {
                let healthy = state.fleet.healthy_count();
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
            // Kubernetes' probes: alive while the process answers (a drain must not be
            // killed), ready while it should get traffic.
            (_, "/live", _) if readable => (
                "health",
                respond(
                    session,
                    200,
                    Bytes::from_static(b"{\"status\":\"alive\"}"),
                    &[],
                )
                .await,
            ),
            (_, "/ready", _) if readable => {
                let (code, body) = state.readiness();
                (
                    "health",
                    respond(session, code, Bytes::from(body.to_string()), &[]).await,
                )
            }
            (_, "/metrics", _) if readable && state.metrics_on_api_port => {
                let text = state.metrics.render();
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
            (_, "/v1/models", _) if readable => {
                match state.keys.authenticate(&session.req_header().headers) {
                    Ok(_) => (
                        "models",
                        models::list(session, &state.fleet, &state.models.load()).await,
                    ),
                    Err(e) => {
                        state.metrics.auth_failed("api");
                        ("models", respond_error(session, &e).await)
                    }
                }
            }
            (_, p, _) if readable && protocol::openai::model_id_in_path(p).is_some() => {
                let id = protocol::openai::model_id_in_path(p).unwrap_or_default();
                match state.keys.authenticate(&session.req_header().headers) {
                    Ok(_) => (
                        "models",
                        models::one(session, &state.fleet, &state.models.load(), &id).await,
                    ),
                    Err(e) => {
                        state.metrics.auth_failed("api");
                        ("models", respond_error(session, &e).await)
                    }
                }
            }
            (_, p, _) if crate::batch::api::owns(p) => {
                match state.keys.authenticate(&session.req_header().headers) {
                    Ok(grant) => {
                        rec.tenant = grant.as_ref().map(|g| g.tenant.clone());
                        (
                            "batch",
                            crate::batch::api::handle(state, session, grant).await,
                        )
                    }
                    Err(e) => {
                        state.metrics.auth_failed("api");
                        ("batch", respond_error(session, &e).await)
                    }
                }
            }
            (_, _, Some(ep)) => {
                let status = match state.keys.authenticate(&session.req_header().headers) {
                    Ok(grant) => {
                        rec.tenant = grant.as_ref().map(|g| g.tenant.clone());
                        request::generate(state, session, ep, started, grant, None, &mut rec).await
                    }
                    Err(e) => {
                        state.metrics.auth_failed("api");
                        respond_error(session, &e).await
                    }
                };
                (ep.label(), status)
            }
            (m, p, None) => {
                let e = if matches!(
                    p,
                    "/v1/completions"
                        | "/v1/chat/completions"
                        | "/v1/models"
                        | "/health"
                        | "/live"
                        | "/ready"
                ) {
                    ApiError::method_not_allowed(m, p)
                } else {
                    ApiError::not_found_path(p)
                };
                ("other", respond_error(session, &e).await)
            }
        };
        GuardedStream::request_done(session);
        state.metrics.request(endpoint, status);
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
