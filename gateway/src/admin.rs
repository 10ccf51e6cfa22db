//! The admin API, on its own listener behind the admin token: `GET /metrics`,
//! `GET /admin/replicas` (each replica's state and what the gateway learnt of it),
//! `PUT /admin/replicas` and `POST /admin/replicas/reload` (the fleet, through
//! `membership.rs`), `GET /admin/policy` and `POST /admin/policy/reload`, and
//! `POST /admin/route/explain` (a dry run of the request path, `request/explain.rs`),
//! `GET /admin/budget` (this gateway's use of the admission budget, read by its peers) and
//! `GET /admin/peers` (what it heard from them, `peers.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use config::Priority;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use protocol::ApiError;

use crate::http::auth::check_bearer;
use crate::membership::MembershipError;
use crate::peers::own_report;
use crate::request::classify;
use crate::request::explain::explain;
use crate::request::prepared::{Caller, Endpoint, PromptLimits};
use crate::state::GatewayState;

/// Replica names by slot.
fn names(state: &GatewayState) -> Vec<String> {
    state
        .fleet
        .replicas()
        .iter()
        .map(|r| r.name.clone())
        .collect()
}

/// The listed replicas' names, in list order.
fn listed_names(state: &GatewayState) -> Vec<String> {
    state.fleet.listed().into_iter().map(|(_, n)| n).collect()
}

/// `PUT /admin/replicas` with `{"replicas": ["host:port", ...]}`: the fleet grows and shrinks
/// without a restart (the same rules as a reload of the gateway file's list).
async fn put_replicas(state: &GatewayState, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let limit = state.max_body_bytes;
    let body = match Limited::new(req.into_body(), limit).collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => {
            let e = ApiError::payload_too_large(limit);
            return json(e.status, e.to_json());
        }
    };
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Fleet {
        replicas: Vec<String>,
    }
    let applied = serde_json::from_slice::<Fleet>(&body)
        .map_err(|e| {
            MembershipError::Body(format!(
                "the body must be {{\"replicas\": [\"host:port\", ...]}}: {e}"
            ))
        })
        .and_then(|f| {
            // With discovery, the listed part may be empty: the fleet it makes is checked whole.
            if f.replicas.is_empty() && !state.discovery.names().is_empty() {
                return Ok(Vec::new());
            }
            config::gateway::replica_list(&f.replicas).map_err(MembershipError::List)
        })
        .and_then(|list| state.membership().set_listed(list));
    match applied {
        Ok(_) => json(
            200,
            serde_json::json!({"replicas": listed_names(state)}).to_string(),
        ),
        Err(e) => {
            let err = ApiError::invalid_request(e.to_string()).with_code("replicas_rejected");
            json(400, err.to_json())
        }
    }
}

fn json(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("static parts")
}

pub async fn admin_handle(
    state: Arc<GatewayState>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if let Err(e) = check_bearer(req.headers(), state.admin_token.as_deref()) {
        state.metrics.auth_failed("admin");
        let mut r = json(e.status, e.to_json());
        r.headers_mut()
            .insert("www-authenticate", http::HeaderValue::from_static("Bearer"));
        return Ok(r);
    }
    // HEAD is answered wherever GET is (hyper leaves the body out).
    let verb = match method.as_str() {
        "HEAD" => "GET",
        m => m,
    };
    let resp = match (verb, path.as_str()) {
        ("GET", "/metrics") => Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Full::new(Bytes::from(state.metrics.render())))
            .expect("static parts"),
        ("GET", "/admin/replicas") => {
            let reg = &state.fleet;
            let v: Vec<serde_json::Value> = reg
                .replicas()
                .iter()
                .filter(|r| !r.is_retired())
                .map(|r| {
                    let l = r.load();
                    let model = r.model.lock().clone();
                    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
                    let pressure = reg.pressure(
                        r.slot,
                        Duration::from_millis(state.policies.load().file.preemption_holdoff_ms),
                        0,
                    );
                    serde_json::json!({
                        "replica": r.label(),
                        "name": r.name,
                        "model": reg.model_of(&r.name).0,
                        "pending_prefill_tokens": pressure.queued_prefill_tokens,
                        "preempting": pressure.preempting,
                        "projected_kv_usage": pressure.kv_usage,
                        "address": r.addr().map(|a| a.to_string()),
                        "healthy": r.is_healthy(),
                        "kv_events": r.events_live(),
                        "backend": reg.backend(r),
                        "kv_events_error": r.events_error(),
                        "prompt_check": r.prompt_check.describe(),
                        "in_flight": l.in_flight,
                        "waiting": l.waiting,
                        "running": l.running,
                        "kv_usage": l.kv_usage,
                        "generation_tokens_per_s_1m": r
                            .throughput
                            .tokens_per_s(std::time::Instant::now(), Duration::from_secs(60)),
                        "learnt": {
                            "prefill_tokens_per_s": model.prefill_rate(),
                            "ttft_overhead_ms": model.ttft_overhead() * 1e3,
                            "ttft_observations": model.ttft_observations(),
                            "step_lag_ms": model.step_lag() * 1e3,
                            "itl_ms_batch_1": ms(model.predict_itl(1)),
                            "itl_ms_one_more": ms(model.predict_itl(l.running + 1)),
                            "itl_p95_ms_one_more": ms(model.predict_itl_p95(l.running + 1)),
                        },
                    })
                })
                .collect();
            json(200, serde_json::Value::Array(v).to_string())
        }
        ("GET", "/admin/budget") => json(
            200,
            serde_json::to_string(&own_report(&state.peers.id, &state.policies, &state.fleet))
                .unwrap_or_default(),
        ),
        ("GET", "/admin/peers") => json(
            200,
            state.peers.describe(std::time::Instant::now()).to_string(),
        ),
        ("GET", "/admin/policy") => json(200, state.policies.describe(&names(&state)).to_string()),
        ("PUT", "/admin/replicas") => put_replicas(&state, req).await,
        ("POST", "/admin/replicas/reload") => match state.membership().reload(true).await {
            Ok(r) => json(
                200,
                serde_json::json!({
                    "replicas": listed_names(&state),
                    "models": state.models.load().names(),
                    "models_changed": r.models_changed,
                    "needs_restart": r.needs_restart,
                })
                .to_string(),
            ),
            Err(e) => {
                let err = ApiError::invalid_request(e.to_string()).with_code("replicas_rejected");
                json(400, err.to_json())
            }
        },
        ("POST", "/admin/policy/reload") => match state.policies.reload(true) {
            Ok(_) => json(200, state.policies.describe(&names(&state)).to_string()),
            Err(e) => {
                let mut err =
                    ApiError::invalid_request(e.message.clone()).with_code("policy_rejected");
                if let Some(f) = e.fields.first() {
                    err = err.with_param(&f.field);
                }
                json(400, err.to_json())
            }
        },
        ("POST", "/admin/route/explain") => {
            let session = req
                .headers()
                .get(state.session_header.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let priority = req
                .headers()
                .get(Priority::HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(Priority::parse)
                .unwrap_or_default();
            let limit = state.max_body_bytes;
            match Limited::new(req.into_body(), limit).collect().await {
                Err(_) => {
                    let e = ApiError::payload_too_large(limit);
                    json(e.status, e.to_json())
                }
                Ok(c) => {
                    let body = c.to_bytes();
                    let endpoint = match serde_json::from_slice::<serde_json::Value>(&body) {
                        Ok(v) if v.get("messages").is_some() => Endpoint::ChatCompletions,
                        _ => Endpoint::Completions,
                    };
                    let caller = Caller {
                        session_id: session,
                        tenant_salt: None,
                    };
                    let active = state.policies.load();
                    let catalog = state.models.load_full();
                    let (served, model) = match catalog.pick_in(&body, |n| active.model_index(n)) {
                        Ok(x) => x,
                        Err(e) => return Ok(json(e.status, e.to_json())),
                    };
                    let limits = PromptLimits {
                        per_prompt: state.model_limit(&served.cfg, &active, model),
                        per_request: state.max_request_prompt_tokens,
                    };
                    let rank = priority.rank().clamp(0, 255) as u8;
                    match state
                        .tokenizers
                        .prepare(&served.preparer, endpoint, body, caller, limits, rank)
                        .await
                    {
                        Ok(mut p) => {
                            p.model = model;
                            let route = classify::route(&active, &p, priority);
                            json(
                                200,
                                explain(&state.placer(), &p, &active, route).to_string(),
                            )
                        }
                        Err(e) => json(e.status, e.to_json()),
                    }
                }
            }
        }
        (_, p) => {
            let e = ApiError::not_found_path(p);
            json(e.status, e.to_json())
        }
    };
    Ok(resp)
}
