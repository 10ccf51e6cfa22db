//! Assembling and running the gateway (wiring only): tokenizer, prefix index, fleet (with its
//! background health, load and KV-event tasks), the policy store and API keys (reloaded on
//! SIGHUP and when their files change), discovery, the pingora proxy app on the public listener
//! behind the connection guard (`http/conn.rs`), and the admin API (`admin.rs`) on its own
//! listener. Listeners are bound by the caller, so tests can use port 0. `run` serves until its
//! shutdown future resolves, then drains (`lifecycle.rs`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use config::{GatewayConfig, PolicyFile};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use pingora::apps::ServerApp;
use pingora::server::configuration::ServerConf;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::access_log::AccessLog;
use crate::admin::admin_handle;
use crate::fleet::client::http_client;
use crate::fleet::client::UpstreamLimits;
use crate::fleet::discovery::{resolve, Discovery};
use crate::fleet::registry::Registry;
use crate::http::accept::{accept_loop, connection_budget};
use crate::http::auth::{
    is_loopback, read_secret, ApiKeyStore, AuthError, ADMIN_TOKEN_ENV, FLEET_TOKEN_ENV,
};
use crate::http::conn::{ConnMetrics, GuardedStream, HeaderLimits};
use crate::http::proxy::GatewayProxy;
use crate::lifecycle::Lifecycle;
use crate::metrics::GatewayMetrics;
use crate::models::{Catalog, ModelLoadError};
use crate::peers::{PeerPoller, Peers};
use crate::prefix::index::PrefixIndex;
use crate::prefix::view::PrefixView;
use crate::request::drift_sample::DriftSampler;
use crate::request::prepare::Tokenizers;
use crate::request::tokenizer_pool::PoolLimits;
use crate::routes::fleet_gauges::FleetGauges;
use crate::routes::model_scope::ModelScope;
use crate::routes::store::PolicyStore;
use crate::state::GatewayState;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Model(#[from] ModelLoadError),
    #[error("policy file {0}: {1}")]
    Policy(String, String),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("access log {0}: {1}")]
    AccessLog(String, std::io::Error),
    #[error(
        "no replicas: `replicas` lists none and the discovery names ({0}) resolve to no address"
    )]
    NoReplicas(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Batch(#[from] crate::batch::store::StoreError),
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
    )
    .with_engines(&cfg.discovery);
    for name in &cfg.discovery.dns {
        // A failure is logged by `record`.
        discovery.record(name, resolve(name, Duration::from_secs(5)).await);
    }
    cfg.replicas = discovery.fleet();
    cfg.resolve_adapters();
    if cfg.replicas.is_empty() {
        return Err(GatewayError::NoReplicas(cfg.discovery.dns.join(", ")));
    }
    let admin_token = match &cfg.auth.admin_token {
        Some(t) => Some(t.clone()),
        None => read_secret(ADMIN_TOKEN_ENV, cfg.auth.admin_token_file.as_deref())?,
    };
    if admin_token.is_none() && !is_loopback(&admin.local_addr()?.to_string()) {
        return Err(AuthError::OpenAdminPort(admin.local_addr()?.to_string()).into());
    }
    let fleet_token = match &cfg.auth.fleet_token {
        Some(t) => Some(t.clone()),
        None => read_secret(FLEET_TOKEN_ENV, cfg.auth.fleet_token_file.as_deref())?,
    };
    let keys = ApiKeyStore::new(cfg.auth.api_keys_file.as_ref().map(PathBuf::from))?;
    let access_log = AccessLog::new(&cfg.access_log)
        .map_err(|e| GatewayError::AccessLog(cfg.access_log.path.clone(), e))?;
    let client = http_client(Duration::from_millis(cfg.upstream.connect_timeout_ms));
    let index = Arc::new(PrefixIndex::new(
        cfg.index.approx_capacity_blocks,
        cfg.index.max_blocks_per_replica,
    ));
    let metrics = Arc::new(GatewayMetrics::new());
    let drift = Arc::new(DriftSampler::new(&cfg.drift, &metrics)?);
    let models = Catalog::load(&cfg, &metrics, drift).await?;
    let registry = Arc::new(Registry::new(
        &cfg,
        index.clone(),
        client,
        fleet_token.as_deref(),
        metrics.clone(),
    ));
    // First health check before accepting traffic, so a ready gateway knows its fleet.
    let first = registry.replicas();
    futures::future::join_all(first.iter().map(|r| registry.check(r))).await;
    registry.set_discovered_engines(&discovery.engines());
    registry.spawn_background();
    let policies = load_policy(&cfg, &metrics)?;
    let d = &cfg.downstream;
    let tokenizer_slots = match d.tokenize_concurrency {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let state = Arc::new(GatewayState {
        models: arc_swap::ArcSwap::from_pointee(models),
        tokenizers: Tokenizers::new(
            PoolLimits {
                slots: tokenizer_slots,
                max_waiting: d.tokenize_queue_max,
                max_waiting_bytes: d.tokenize_queue_max_mib << 20,
                timeout: (d.tokenize_queue_timeout_ms > 0)
                    .then(|| Duration::from_millis(d.tokenize_queue_timeout_ms)),
            },
            metrics.clone(),
        ),
        prefix: PrefixView::new(index),
        fleet: registry,
        metrics,
        max_body_bytes: cfg.upstream.max_body_bytes,
        body_timeout: Duration::from_millis(d.body_timeout_ms),
        keys,
        admin_token,
        lifecycle: Arc::new(Lifecycle::default()),
        access_log,
        max_request_prompt_tokens: d.max_request_prompt_tokens,
        dispatch_lock: parking_lot::Mutex::new(()),
        metrics_on_api_port: d.metrics_on_api_port,
        discovery,
        gateway_file: cfg
            .config_path
            .clone()
            .map(|p| (p, parking_lot::Mutex::new(None))),
        upstream: UpstreamLimits {
            retries: cfg.upstream.retries,
            retry_backoff: Duration::from_millis(cfg.upstream.retry_backoff_ms),
            first_byte_timeout: Duration::from_secs(cfg.upstream.first_byte_timeout_s),
            body_idle_timeout: Duration::from_millis(cfg.upstream.body_idle_timeout_ms),
            max_response_bytes: cfg.upstream.max_response_bytes,
            max_stream_bytes: cfg.upstream.max_stream_bytes,
            stream_token_slack: cfg.upstream.stream_token_slack,
        },
        session_header: cfg.session_header.to_ascii_lowercase(),
        policies,
        peers: Peers::new(cfg.peers.clone()),
        ready_wait: Duration::from_secs(cfg.index.ready_wait_s),
        batch: crate::batch::Batches::open(&cfg.batch, listener.local_addr()?)?,
    });
    spawn_policy_reloaders(&state);
    spawn_peers(&state, &cfg.peers);
    spawn_discovery(&state);
    crate::batch::runner::spawn(&state);
    // Gauges that are cheaper to sample than to maintain.
    let fleet_gauges = FleetGauges::new(cfg.cost.clone(), &state.metrics);
    let weak = Arc::downgrade(&state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            let m = &s.metrics;
            let reg = &s.fleet;
            m.index_blocks.set(reg.index.len() as f64);
            m.index_bytes.set(reg.index.size_bytes() as f64);
            let cache: usize = s
                .models
                .load()
                .all()
                .iter()
                .map(|x| x.preparer.cache_stats().bytes)
                .sum();
            m.tokenizer_cache_bytes.set(cache as f64);
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
            let max_ttl = reg.index_ttls().into_iter().max().unwrap_or(0);
            reg.index.expire(reg.now_s(), max_ttl);
            for rt in s.policies.runtimes() {
                rt.stats.tick(rt.now_s());
            }
            fleet_gauges.update(&s.policies, &s.fleet, m);
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
            .and_then(|()| file.check_models(&served_names(cfg)))
            .map_err(|e| GatewayError::Policy("(embedded)".into(), e.to_string()))?;
        return Ok(PolicyStore::new(
            file,
            None,
            None,
            listed(&cfg.replicas),
            scopes(cfg),
            metrics.clone(),
        ));
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| GatewayError::Policy(path.clone(), e.to_string()))?;
    let file = PolicyFile::from_toml(&text, &cfg.replicas)
        .and_then(|f| f.check_models(&served_names(cfg)).map(|()| f))
        .map_err(|e| GatewayError::Policy(path.clone(), e.to_string()))?;
    Ok(PolicyStore::new(
        file,
        Some(&text),
        Some(PathBuf::from(path)),
        listed(&cfg.replicas),
        scopes(cfg),
        metrics.clone(),
    ))
}

/// The served models' names, as a policy file's `models` rules name them.
fn served_names(cfg: &GatewayConfig) -> Vec<&str> {
    cfg.served_models()
        .iter()
        .map(|m| m.name.as_str())
        .collect()
}

/// The served models as the policy store scopes routes to them.
fn scopes(cfg: &GatewayConfig) -> Vec<ModelScope> {
    cfg.served_models().iter().map(ModelScope::of).collect()
}

/// At start, slots are the list's order.
fn listed(replicas: &[String]) -> Vec<(usize, String)> {
    replicas.iter().cloned().enumerate().collect()
}

/// Reads the peer gateways' use of the budget every `peers.every_ms` (`peers.rs`).
fn spawn_peers(state: &Arc<GatewayState>, cfg: &config::peers::PeersConfig) {
    if !state.peers.enabled() {
        return;
    }
    let mut poller = PeerPoller::new(cfg, state.admin_token.as_deref(), &state.metrics);
    let every = Duration::from_millis(cfg.every_ms);
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            poller.round(&s.peers, &s.policies, &s.fleet).await;
        }
    });
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
            let _ = s.membership().reload(false).await;
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
                        let _ = s.membership().reload(true).await;
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; the file watcher still reloads")
            }
        }
    }
}

/// Re-resolves the discovery names every `discovery.every` for as long as the gateway lives.
fn spawn_discovery(state: &Arc<GatewayState>) {
    let weak = Arc::downgrade(state);
    state.membership().publish_discovered();
    let every = state.discovery.every;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            if !s.discovery.names().is_empty() {
                s.membership().rediscover().await;
            }
        }
    });
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
        let metrics = &self.state.metrics;
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
        self.state.metrics.gauge("kvgate_gateway_draining").set(1.0);
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
        if let Some(b) = &self.state.batch {
            b.release_claims();
        }
        // Stop health checks, load polls and KV event streams: the gateway is done with its
        // replicas (and they may be stopping too).
        self.state.fleet.stop_background();
    }
}
