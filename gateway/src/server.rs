//! Assembling and running the gateway: tokenizer, prefix index, registry (with its background
//! health, load and KV-event tasks), the policy store and API keys (reloaded on SIGHUP and when
//! their files change), the pingora proxy app on the public listener behind the connection
//! guard (`conn.rs`), and a small hyper admin server (`/metrics`, `/admin/route/explain`,
//! `/admin/replicas`, `/admin/policy`, `/admin/policy/reload`) on its own listener, behind the
//! admin token. Listeners are bound by the caller, so tests can use port 0. `run` serves until
//! its shutdown future resolves, then drains (`lifecycle.rs`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use config::{GatewayConfig, PolicyFile, Priority};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use pingora::apps::ServerApp;
use pingora::server::configuration::ServerConf;
use protocol::tokenizer::TextTokenizer;
use protocol::ApiError;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::access_log::AccessLog;
use crate::auth::{
    check_bearer, is_loopback, read_secret, ApiKeyStore, ADMIN_TOKEN_ENV, FLEET_TOKEN_ENV,
};
use crate::conn::{accept_loop, connection_budget, ConnMetrics, GuardedStream, HeaderLimits};
use crate::discovery::{resolve, Discovery};
use crate::fleet::spawn_discovery;
use crate::lifecycle::Lifecycle;
use crate::metrics::GatewayMetrics;
use crate::policy_store::PolicyStore;
use crate::prefix_index::PrefixIndex;
use crate::proxy::{GatewayProxy, GatewayState};
use crate::registry::{http_client, Registry};
use crate::router::{Caller, Endpoint, PromptLimits, Router};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cannot load the tokenizer from {0}: {1}")]
    Tokenizer(String, String),
    #[error("no tokenizer folder configured or found (model.tokenizer_dir)")]
    NoTokenizer,
    #[error("policy file {0}: {1}")]
    Policy(String, String),
    #[error("{0}")]
    Auth(String),
    #[error("access log {0}: {1}")]
    AccessLog(String, std::io::Error),
    #[error(
        "no replicas: `replicas` lists none and the discovery names ({0}) resolve to no address"
    )]
    NoReplicas(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub struct GatewayServer {
    listener: TcpListener,
    admin: TcpListener,
    state: Arc<GatewayState>,
    limits: HeaderLimits,
    max_connections: usize,
    drain_timeout: Duration,
}

pub async fn build_gateway(
    mut cfg: GatewayConfig,
    listener: TcpListener,
    admin: TcpListener,
) -> Result<GatewayServer, GatewayError> {
    // The fleet at start: the listed replicas and what the discovery names resolve to now.
    let discovery = Discovery::new(
        cfg.replicas.clone(),
        cfg.discovery.dns.clone(),
        Duration::from_secs(cfg.discovery.every_s),
    );
    for name in &cfg.discovery.dns {
        // A failure is logged by `record`.
        discovery.record(name, resolve(name, Duration::from_secs(5)).await);
    }
    cfg.replicas = discovery.fleet();
    if cfg.replicas.is_empty() {
        return Err(GatewayError::NoReplicas(cfg.discovery.dns.join(", ")));
    }
    let dir = match &cfg.model.tokenizer_dir {
        Some(d) => Path::new(d).to_path_buf(),
        None => protocol::tokenizer::default_tokenizer_dir().ok_or(GatewayError::NoTokenizer)?,
    };
    let shown = dir.display().to_string();
    let tokenizer = tokio::task::spawn_blocking(move || TextTokenizer::from_path(&dir))
        .await
        .map_err(|e| GatewayError::Tokenizer(shown.clone(), e.to_string()))?
        .map_err(|e| GatewayError::Tokenizer(shown.clone(), e.to_string()))?;
    let admin_token = match &cfg.auth.admin_token {
        Some(t) => Some(t.clone()),
        None => read_secret(ADMIN_TOKEN_ENV, cfg.auth.admin_token_file.as_deref())
            .map_err(GatewayError::Auth)?,
    };
    if admin_token.is_none() && !is_loopback(&admin.local_addr()?.to_string()) {
        return Err(GatewayError::Auth(format!(
            "the admin port listens on {} (not loopback): give it a token with {ADMIN_TOKEN_ENV} \
             or auth.admin_token_file, or listen on 127.0.0.1",
            admin.local_addr()?
        )));
    }
    let fleet_token = match &cfg.auth.fleet_token {
        Some(t) => Some(t.clone()),
        None => read_secret(FLEET_TOKEN_ENV, cfg.auth.fleet_token_file.as_deref())
            .map_err(GatewayError::Auth)?,
    };
    let keys = ApiKeyStore::new(cfg.auth.api_keys_file.as_ref().map(PathBuf::from))
        .map_err(GatewayError::Auth)?;
    let access_log = AccessLog::new(&cfg.access_log)
        .map_err(|e| GatewayError::AccessLog(cfg.access_log.path.clone(), e))?;
    let client = http_client(Duration::from_millis(cfg.upstream.connect_timeout_ms));
    let index = Arc::new(PrefixIndex::new(cfg.index.approx_capacity_blocks));
    let metrics = Arc::new(GatewayMetrics::new());
    let registry = Arc::new(Registry::new(
        &cfg,
        index.clone(),
        client.clone(),
        fleet_token.as_deref(),
        metrics.clone(),
    ));
    // First health check before accepting traffic, so a ready gateway knows its fleet.
    let first = registry.replicas();
    futures::future::join_all(first.iter().map(|r| registry.check(r))).await;
    registry.spawn_background();
    let policies = load_policy(&cfg, &metrics)?;
    let router = Router::new(
        Arc::new(tokenizer),
        cfg.model.name.clone(),
        cfg.model.block_size,
        registry.clone(),
        metrics.clone(),
    );
    let d = &cfg.downstream;
    let tokenizers = match d.tokenize_concurrency {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let state = Arc::new(GatewayState {
        router,
        client,
        max_body_bytes: cfg.upstream.max_body_bytes,
        body_timeout: Duration::from_millis(d.body_timeout_ms),
        keys,
        admin_token,
        lifecycle: Arc::new(Lifecycle::default()),
        access_log,
        tokenize_slots: Arc::new(Semaphore::new(tokenizers)),
        tokenize_wait: Duration::from_millis(d.tokenize_queue_timeout_ms),
        max_request_prompt_tokens: d.max_request_prompt_tokens,
        model_len_override: cfg.model.max_model_len,
        dispatch_lock: parking_lot::Mutex::new(()),
        metrics_on_api_port: d.metrics_on_api_port,
        discovery,
        gateway_file: cfg
            .config_path
            .clone()
            .map(|p| (p, parking_lot::Mutex::new(None))),
        retries: cfg.upstream.retries,
        retry_backoff: Duration::from_millis(cfg.upstream.retry_backoff_ms),
        first_byte_timeout: Duration::from_secs(cfg.upstream.first_byte_timeout_s),
        session_header: cfg.session_header.to_ascii_lowercase(),
        policies,
    });
    spawn_policy_reloaders(&state);
    spawn_discovery(&state);
    // Gauges that are cheaper to sample than to maintain.
    let weak = Arc::downgrade(&state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            let m = &s.router.metrics;
            let reg = &s.router.registry;
            m.index_blocks.set(reg.index.len() as f64);
            m.index_bytes.set(reg.index.size_bytes() as f64);
            // Series appear once a replica's label is settled (its first health check).
            for r in reg
                .replicas()
                .iter()
                .filter(|r| !r.is_retired() && r.label_settled())
            {
                let m = r.metrics();
                m.healthy.set(if r.is_healthy() { 1.0 } else { 0.0 });
                m.in_flight.set(f64::from(r.load().in_flight));
                let indexed = r.events_live() || !reg.expects_events(r);
                m.kv_events_live.set(if indexed { 1.0 } else { 0.0 });
            }
            reg.index.expire(reg.now_s(), s_max_ttl(&cfg_ttls(&s)));
            for rt in s.policies.runtimes() {
                rt.stats.tick(rt.now_s());
            }
            m.upkeep();
        }
    });
    let limits = HeaderLimits {
        header_timeout: Duration::from_millis(d.header_timeout_ms),
        keepalive_timeout: Duration::from_secs(d.keepalive_timeout_s),
        max_header_bytes: d.max_header_bytes,
        max_headers: d.max_headers,
    };
    let max_connections = connection_budget(d.max_connections);
    Ok(GatewayServer {
        listener,
        admin,
        state,
        limits,
        max_connections,
        drain_timeout: Duration::from_secs(d.drain_timeout_s),
    })
}

/// The policy file named by the gateway file, or its inline `[policy]` as one catch-all route.
fn load_policy(
    cfg: &GatewayConfig,
    metrics: &Arc<GatewayMetrics>,
) -> Result<PolicyStore, GatewayError> {
    let Some(path) = &cfg.policy_file else {
        let file = cfg
            .embedded_policy
            .clone()
            .unwrap_or_else(|| PolicyFile::single(cfg.policy.clone()));
        file.validate(&cfg.replicas)
            .map_err(|e| GatewayError::Policy("(embedded)".into(), e.to_string()))?;
        return Ok(PolicyStore::new(
            file,
            None,
            None,
            listed(&cfg.replicas),
            metrics.clone(),
        ));
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| GatewayError::Policy(path.clone(), e.to_string()))?;
    let file = PolicyFile::from_toml(&text, &cfg.replicas)
        .map_err(|e| GatewayError::Policy(path.clone(), e.to_string()))?;
    Ok(PolicyStore::new(
        file,
        Some(&text),
        Some(PathBuf::from(path)),
        listed(&cfg.replicas),
        metrics.clone(),
    ))
}

/// At start, slots are the list's order.
fn listed(replicas: &[String]) -> Vec<(usize, String)> {
    replicas.iter().cloned().enumerate().collect()
}

/// Reloads the policy file and the API key file when they change (checked every second) and
/// on SIGHUP.
fn spawn_policy_reloaders(state: &Arc<GatewayState>) {
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            if s.policies.path().is_some() {
                let _ = s.policies.reload(false);
            }
            let _ = s.keys.reload(false);
            let _ = s.reload_replicas(false);
        }
    });
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let weak = Arc::downgrade(state);
        match signal(SignalKind::hangup()) {
            Ok(mut hup) => {
                tokio::spawn(async move {
                    while hup.recv().await.is_some() {
                        let Some(s) = weak.upgrade() else { return };
                        tracing::info!(
                            "SIGHUP: reloading the policy file, the API keys and the replica list"
                        );
                        if s.policies.path().is_some() {
                            let _ = s.policies.reload(true);
                        }
                        let _ = s.keys.reload(true);
                        let _ = s.reload_replicas(true);
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; the file watcher still reloads")
            }
        }
    }
}

fn cfg_ttls(s: &GatewayState) -> Vec<u32> {
    s.router.registry.index_ttls()
}

fn s_max_ttl(ttls: &[u32]) -> u32 {
    ttls.iter().copied().max().unwrap_or(0)
}

impl GatewayServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().expect("bound listener")
    }

    pub fn state(&self) -> Arc<GatewayState> {
        self.state.clone()
    }

    /// Serves both listeners until `shutdown` resolves, then drains: no new connections,
    /// `/health` answers 503, requests in progress finish (up to the drain timeout, after
    /// which open streams end with an error event), and the function returns.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let (tx, rx) = watch::channel(false);
        let conf = Arc::new(ServerConf::default());
        let app = Arc::new(pingora::proxy::http_proxy(
            &conf,
            GatewayProxy {
                state: self.state.clone(),
            },
        ));
        let metrics = &self.state.router.metrics;
        let conn_metrics = Arc::new(ConnMetrics {
            header_timeout: metrics.counter(
                "kvgate_gateway_connections_closed_total",
                &[("reason", "header_timeout")],
            ),
            header_too_large: metrics.counter(
                "kvgate_gateway_connections_closed_total",
                &[("reason", "header_too_large")],
            ),
            refused: metrics.counter("kvgate_gateway_connections_refused_total", &[]),
            open: metrics.gauge("kvgate_gateway_connections_open"),
        });
        let admin_state = self.state.clone();
        let admin = self.admin;
        let admin_errors = metrics.counter(
            "kvgate_gateway_accept_errors_total",
            &[("listener", "admin")],
        );
        let admin_task = tokio::spawn(async move {
            let listener = admin;
            accept_loop(
                &listener,
                "admin",
                None,
                None,
                admin_errors,
                std::future::pending::<()>(),
                move |stream, _| {
                    let st = admin_state.clone();
                    async move {
                        let svc = service_fn(move |req| admin_handle(st.clone(), req));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    }
                },
            )
            .await;
        });
        let slots = Arc::new(Semaphore::new(self.max_connections));
        let limits = self.limits;
        let api_errors =
            metrics.counter("kvgate_gateway_accept_errors_total", &[("listener", "api")]);
        let listener = self.listener;
        accept_loop(
            &listener,
            "api",
            Some(slots),
            Some(conn_metrics.clone()),
            api_errors,
            shutdown,
            |tcp, permit| {
                let (app, rx, m) = (app.clone(), rx.clone(), conn_metrics.clone());
                async move {
                    let _permit = permit;
                    m.open.increment(1.0);
                    let stream: pingora::protocols::Stream =
                        Box::new(GuardedStream::new(tcp, limits, m.clone()));
                    // pingora serves every request of a kept-alive connection in here.
                    let _ = app.process_new(stream, &rx).await;
                    m.open.decrement(1.0);
                }
            },
        )
        .await;
        drop(listener);
        let lifecycle = self.state.lifecycle.clone();
        self.state
            .router
            .metrics
            .gauge("kvgate_gateway_draining")
            .set(1.0);
        // Idle kept-alive connections close; requests in progress go on.
        let _ = tx.send(true);
        tracing::info!(
            in_flight = lifecycle.active(),
            deadline_s = self.drain_timeout.as_secs(),
            "draining: no new connections, waiting for requests in progress"
        );
        let left = lifecycle
            .drain(self.drain_timeout, Duration::from_secs(2))
            .await;
        if left > 0 {
            tracing::warn!(
                left,
                "drain deadline passed; open responses were ended with an error event"
            );
        } else {
            tracing::info!("drained");
        }
        admin_task.abort();
        // Stop health checks, load polls and KV event streams: the gateway is done with its
        // replicas (and they may be stopping too).
        self.state.router.registry.stop_background();
    }
}

/// Replica names by slot.
fn names(state: &GatewayState) -> Vec<String> {
    state
        .router
        .registry
        .replicas()
        .iter()
        .map(|r| r.name.clone())
        .collect()
}

/// The listed replicas' names, in list order.
fn listed_names(state: &GatewayState) -> Vec<String> {
    state
        .router
        .registry
        .listed()
        .into_iter()
        .map(|(_, n)| n)
        .collect()
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
        .map_err(|e| format!("the body must be {{\"replicas\": [\"host:port\", ...]}}: {e}"))
        .and_then(|f| {
            // With discovery, the listed part may be empty: the fleet it makes is checked whole.
            if f.replicas.is_empty() && !state.discovery.names().is_empty() {
                return Ok(Vec::new());
            }
            config::gateway::replica_list(&f.replicas).map_err(|e| e.to_string())
        })
        .and_then(|list| state.set_listed(list));
    match applied {
        Ok(_) => json(
            200,
            serde_json::json!({"replicas": listed_names(state)}).to_string(),
        ),
        Err(e) => {
            let err = ApiError::invalid_request(e).with_code("replicas_rejected");
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

async fn admin_handle(
    state: Arc<GatewayState>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if let Err(e) = check_bearer(req.headers(), state.admin_token.as_deref()) {
        state.auth_failed("admin");
        let mut r = json(e.status, e.to_json());
        r.headers_mut()
            .insert("www-authenticate", http::HeaderValue::from_static("Bearer"));
        return Ok(r);
    }
    let resp = match (method.as_str(), path.as_str()) {
        ("GET", "/metrics") => Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Full::new(Bytes::from(state.router.metrics.render())))
            .expect("static parts"),
        ("GET", "/admin/replicas") => {
            let reg = &state.router.registry;
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
                        "pending_prefill_tokens": pressure.queued_prefill_tokens,
                        "preempting": pressure.preempting,
                        "projected_kv_usage": pressure.kv_usage,
                        "address": r.addr().map(|a| a.to_string()),
                        "healthy": r.is_healthy(),
                        "kv_events": r.events_live(),
                        "backend": reg.backend(r),
                        "kv_events_error": r.events_error(),
                        "in_flight": l.in_flight,
                        "waiting": l.waiting,
                        "running": l.running,
                        "kv_usage": l.kv_usage,
                        "learnt": {
                            "prefill_tokens_per_s": model.prefill_rate(),
                            "ttft_overhead_ms": model.ttft_overhead() * 1e3,
                            "ttft_observations": model.ttft_observations(),
                            "itl_ms_batch_1": ms(model.predict_itl(1)),
                            "itl_ms_one_more": ms(model.predict_itl(l.running + 1)),
                            "itl_p95_ms_one_more": ms(model.predict_itl_p95(l.running + 1)),
                        },
                    })
                })
                .collect();
            json(200, serde_json::Value::Array(v).to_string())
        }
        ("GET", "/admin/policy") => json(200, state.policies.describe(&names(&state)).to_string()),
        ("PUT", "/admin/replicas") => put_replicas(&state, req).await,
        ("POST", "/admin/replicas/reload") => match state.reload_replicas(true) {
            Ok(_) => json(
                200,
                serde_json::json!({"replicas": listed_names(&state)}).to_string(),
            ),
            Err(e) => {
                let err = ApiError::invalid_request(e).with_code("replicas_rejected");
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
                    let limits = PromptLimits {
                        per_prompt: state.model_limit(),
                        per_request: state.max_request_prompt_tokens,
                    };
                    match state.prepare(endpoint, body, caller, limits).await {
                        Ok(p) => {
                            let active = state.policies.load();
                            let route = active.route(p.prompt_tokens, priority);
                            json(200, state.explain(&p, &active, route).to_string())
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
