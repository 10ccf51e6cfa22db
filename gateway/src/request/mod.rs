//! The request path of a generation request, as a pipeline. The endpoint table
//! (`http/proxy.rs`) hands an authenticated request to [`generate`], which runs the stages in
//! the order a request meets them, one file each:
//!
//! 1. [`prepare`] — parse, validate, salt, tokenise and hash the prompt ([`prepared`] is what
//!    it makes);
//! 2. [`classify`] — the priority class, the tenant's cache scope, the route;
//! 3. [`admit`] — wait in the route's queue until placement lets the request go, or shed it
//!    (429 + Retry-After);
//! 4. [`place`] — which replica, or why it must wait (asked by admit, by forward's retries
//!    through [`generate`], and by [`explain`]);
//! 5. [`forward`] — send it, retrying elsewhere while nothing reached the client (and, when
//!    placement says so, [`warm`] another replica with its prompt);
//! 6. [`relay`] — take the answer to the client, timing it (the SSE reader is [`sse`]).
//!
//! A stage never calls back up this order; what it hands on ([`prepared`], `routes/admitted.rs`)
//! lives below the stages, and each stage takes its share of the gateway's state as an
//! argument (`state.rs` hands it out). [`explain`] is the dry run of 1–4 for the admin API.

pub mod admit;
pub mod classify;
pub mod drift_sample;
pub mod explain;
pub mod forward;
pub mod json_check;
pub mod place;
pub mod prepare;
pub mod prepared;
pub mod relay;
pub mod sse;
pub mod tokenizer_pool;
pub mod warm;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use config::Grant;
use pingora::proxy::Session;
use protocol::ApiError;

use crate::access_log::AccessRecord;
use crate::http::body::read_within;
use crate::http::session::{respond, respond_error};
use crate::request::admit::Refusal;
use crate::request::prepared::{Caller, Endpoint};
use crate::state::GatewayState;

/// Runs a generation request through the pipeline and answers it; returns the status.
/// `scope` narrows the replicas it may go to ([`prepared::Prepared::scope`]).
pub async fn generate(
    state: &GatewayState,
    session: &mut Session,
    endpoint: Endpoint,
    started: Instant,
    grant: Option<Grant>,
    scope: Option<Arc<[usize]>>,
    rec: &mut AccessRecord,
) -> u16 {
    let priority = match classify::priority(&session.req_header().headers, grant.as_ref()) {
        Ok(p) => p,
        Err(e) => return respond_error(session, &e).await,
    };
    let body = match read_within(
        session,
        state.max_body_bytes,
        state.body_timeout,
        &state.metrics,
    )
    .await
    {
        Ok(b) => b,
        Err(e) => return respond_error(session, &e).await,
    };
    // One policy version and one set of models for the whole request, whatever reloads
    // meanwhile.
    let active = state.policies.load();
    let catalog = state.models.load_full();
    // The model first: its prompt limit, tokenizer and routes depend on it.
    let (served, model) = match catalog.pick_in(&body, |name| active.model_index(name)) {
        Ok(x) => x,
        Err(e) => return respond_error(session, &e).await,
    };
    if catalog.all().len() > 1 {
        rec.model = Some(served.cfg.name.clone());
    }
    let caller = Caller {
        session_id: session
            .req_header()
            .headers
            .get(state.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        tenant_salt: classify::tenant_salt(&active, grant.as_ref()),
    };
    let limits = classify::prompt_limits(
        &active,
        state.model_limit(&served.cfg, &active, model),
        state.max_request_prompt_tokens,
    );

    // 1. prepare (waiting for a tokeniser in priority order)
    let rank = priority.rank().clamp(0, 255) as u8;
    let mut prepared = match state
        .tokenizers
        .prepare(&served.preparer, endpoint, body, caller, limits, rank)
        .await
    {
        Ok(p) => p,
        Err(e) => return respond_error(session, &e).await,
    };
    prepared.model = model;
    prepared.scope = scope;
    rec.prompt_tokens = Some(prepared.prompt_tokens);
    rec.stream = Some(prepared.stream);

    // 2. classify
    let route = classify::route(&active, &prepared, priority);
    rec.route = Some(route.rt.name.clone());
    if let Err(e) = classify::fits(route, &prepared) {
        return respond_error(session, &e).await;
    }

    // 3. admit (asking 4. place)
    let admitted = match state
        .admitter()
        .admit(&active, route, &prepared, priority, started, &mut rec.holds)
        .await
    {
        Ok(a) => a,
        Err(Refusal::Error(e)) => return respond_error(session, &e).await,
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
            let headers = [
                ("retry-after", secs.to_string()),
                ("x-kvgate-route", route.cfg.name.clone()),
            ];
            return respond(session, 429, Bytes::from(e.to_json()), &headers).await;
        }
    };
    rec.queue_ms = Some(admitted.queued.as_secs_f64() * 1e3);

    // 5. forward, with 4. place for its retries; 6. relay
    let placer = state.placer();
    let again = |matched: &[usize], tried: &[usize]| {
        placer.retry(&active, route, &prepared, matched, tried)
    };
    state
        .forwarder()
        .forward(
            session, &active, route, &prepared, started, admitted, rec, &again,
        )
        .await
}
