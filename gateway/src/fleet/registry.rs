//! The replica fleet as the gateway knows it: for each configured `host:port`, one record
//! ([`ReplicaHandle`]) with its resolved address (re-resolved on every health check, so DNS
//! names follow their records), health (ejected after consecutive failures, readmitted after
//! consecutive passes), load (polled from `/get_load`, plus the gateway's own in-flight count),
//! the latency model learnt from its streams, its metric handles and its KV event
//! subscription, which keeps the prefix index exact while it is live. Policies see a
//! [`ReplicaSet`] snapshot built from these per request.
//!
//! The list is reloadable ([`Registry::reconcile`]): a replica keeps its slot (its bit in the
//! prefix index) for as long as it is listed; a new one gets a free slot; a removed one is
//! retired — no new requests, its background tasks stopped, its index bits cleared — while the
//! requests it already has run to their end.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use config::gateway::{Backend, EngineSpec};
use config::GatewayConfig;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use parking_lot::RwLock;
use policies::{LoadSignal, ReplicaSet, ReplicaView, SpeedView};

use arc_swap::ArcSwap;

use crate::engine_events::HashTranslator;
use crate::latency_model::LatencyModel;
use crate::metrics::{GatewayMetrics, ReplicaMetrics};
use crate::prefix_index::PrefixIndex;
use crate::zmq_events::{self, ZmqSource};
use prefill_queue::PrefillQueue;

mod events;
mod health;
mod prefill_queue;
mod probes;

pub type HttpClient = Client<HttpConnector, http_body_util::Full<Bytes>>;

/// Builds the client used for replicas: pooled keep-alive, connect timeout, no Nagle.
pub fn http_client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

pub struct ReplicaHandle {
    pub slot: usize,
    pub name: String,
    /// What the gateway has learnt about this replica's speed from the streams it relays.
    pub model: parking_lot::Mutex<LatencyModel>,
    /// Its series, registered once its label is settled (see [`ReplicaHandle::label`]).
    metrics: OnceLock<ReplicaMetrics>,
    factory: Arc<GatewayMetrics>,
    /// Its identity in metrics, explain, the access log and the admin API: the `replica_id` its
    /// `/server_info` reports (the label its own metrics carry), or its address. Settled at the
    /// first health check.
    label: OnceLock<String>,
    /// Removed from the list: no new requests; the ones it has finish.
    retired: AtomicBool,
    /// Health, load and event tasks, stopped on retirement.
    tasks: parking_lot::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    addr: RwLock<Option<SocketAddr>>,
    healthy: AtomicBool,
    fails: AtomicU32,
    oks: AtomicU32,
    pub in_flight: AtomicU32,
    waiting: AtomicU32,
    running: AtomicU32,
    kv_usage_bits: AtomicU64,
    events_live: AtomicBool,
    /// Why an engine's events cannot be indexed (a block size the gateway does not hash with).
    events_error: parking_lot::Mutex<Option<String>>,
    /// Recognised as a vLLM engine by its `/metrics` (no engine table names it).
    detected_vllm: AtomicBool,
    /// The event stream was refused for want of a token (warned once).
    events_refused: AtomicBool,
    /// Requests this gateway saw finish at the replica, and how many had finished when the
    /// last load report was requested: a report taken before one of our requests finished
    /// still counts it, so it is ignored until the next poll.
    finished: AtomicU64,
    finished_at_poll: AtomicU64,
    /// Uncached prompt tokens of our requests sent here that have not shown a first byte, and
    /// how much of them the replica has likely done: the prefill ahead of the next one.
    prefill: PrefillQueue,
    /// The replica's preemption counter at the last poll (`u64::MAX` before the first).
    preemptions: AtomicU64,
    /// Registry-clock milliseconds + 1 of the last poll that saw preemptions rise (0: never).
    preempted_at_ms: AtomicU64,
    /// KV cache capacity in tokens (`max_total_num_tokens`; 0 when the replica does not say).
    capacity_tokens: AtomicU64,
    /// Prompt tokens this gateway sent there since the last load report: the KV the report
    /// does not show yet.
    since_poll_tokens: AtomicU64,
    /// Registry-clock ms + 1 of the last "not admitted" warning (0: never).
    warned_at_ms: AtomicU64,
    /// `max_model_len` from the replica's `/v1/models` (0: not known yet).
    max_model_len: AtomicU64,
    /// Prompt tokens the replica prefills per step (`chunked_prefill_size` in `/server_info`,
    /// as kvgate and SGLang report it; 0: not known).
    chunk_tokens: AtomicU64,
    /// Bumped each time the replica is ejected: requests waiting on it give up at once (and
    /// are retried elsewhere when nothing reached the client yet).
    ejections: tokio::sync::watch::Sender<u64>,
}

impl ReplicaHandle {
    fn new(slot: usize, name: String, factory: Arc<GatewayMetrics>) -> Self {
        ReplicaHandle {
            slot,
            name,
            model: parking_lot::Mutex::new(LatencyModel::default()),
            metrics: OnceLock::new(),
            factory,
            label: OnceLock::new(),
            retired: AtomicBool::new(false),
            tasks: parking_lot::Mutex::new(Vec::new()),
            addr: RwLock::new(None),
            healthy: AtomicBool::new(false),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            running: AtomicU32::new(0),
            kv_usage_bits: AtomicU64::new(0f64.to_bits()),
            events_live: AtomicBool::new(false),
            events_error: parking_lot::Mutex::new(None),
            detected_vllm: AtomicBool::new(false),
            events_refused: AtomicBool::new(false),
            finished: AtomicU64::new(0),
            finished_at_poll: AtomicU64::new(0),
            prefill: PrefillQueue::default(),
            preemptions: AtomicU64::new(u64::MAX),
            preempted_at_ms: AtomicU64::new(0),
            capacity_tokens: AtomicU64::new(0),
            since_poll_tokens: AtomicU64::new(0),
            max_model_len: AtomicU64::new(0),
            chunk_tokens: AtomicU64::new(0),
            warned_at_ms: AtomicU64::new(0),
            ejections: tokio::sync::watch::Sender::new(0),
        }
    }

    /// The replica's identity: its reported id, or its address (`name`) when it reports none
    /// or another replica already uses that id.
    pub fn label(&self) -> &str {
        self.label.get().map_or(self.name.as_str(), String::as_str)
    }

    /// Whether the label is settled (the first health check has run).
    pub fn label_settled(&self) -> bool {
        self.label.get().is_some()
    }

    /// Its metric handles (registering them, and settling the label, on first use).
    pub fn metrics(&self) -> &ReplicaMetrics {
        self.metrics.get_or_init(|| {
            let _ = self.label.set(self.name.clone());
            self.factory.replica(self.label(), &self.name)
        })
    }

    /// Resolves when the replica is ejected after this call.
    pub fn ejected(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.ejections.subscribe();
        async move {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The replica's context limit, once it said.
    pub fn max_model_len(&self) -> Option<u64> {
        Some(self.max_model_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    pub fn addr(&self) -> Option<SocketAddr> {
        *self.addr.read()
    }

    /// Admitted by its health checks and still listed.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.is_retired()
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Whether a request this gateway sent here, not yet answered, has `hash` as its prompt's
    /// block `k`: that prefix is still being prefilled here.
    pub fn computing(&self, k: usize, hash: u64) -> bool {
        self.prefill.computing(k, hash)
    }

    /// Whether the KV event stream is connected and indexed (index exact for this replica):
    /// not while an error (a block size that differs) keeps its events out.
    pub fn events_live(&self) -> bool {
        self.events_live.load(Ordering::Relaxed) && self.events_error.lock().is_none()
    }

    /// Why its KV events cannot be indexed, if they cannot.
    pub fn events_error(&self) -> Option<String> {
        self.events_error.lock().clone()
    }

    pub fn load(&self) -> LoadSignal {
        let stale =
            self.finished.load(Ordering::Relaxed) != self.finished_at_poll.load(Ordering::Relaxed);
        let reported = |a: &AtomicU32| if stale { 0 } else { a.load(Ordering::Relaxed) };
        LoadSignal {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            waiting: reported(&self.waiting),
            running: reported(&self.running),
            kv_usage: f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)),
        }
    }
}

impl ReplicaHandle {
    /// What placement knows of this replica's speed now: the learnt TTFT fit, the prefill
    /// queued ahead, the decode step with one more sequence and the one its streams see now,
    /// the chunk budget.
    pub fn speed(&self) -> SpeedView {
        let batch = self.load().requests() + 1;
        let m = self.model.lock();
        let (overhead_s, seconds_per_token) = m.ttft_coefficients();
        let chunk = self.chunk_tokens.load(Ordering::Relaxed);
        SpeedView {
            overhead_s,
            seconds_per_token,
            queued_prefill_tokens: self.prefill.remaining(
                Instant::now(),
                overhead_s,
                seconds_per_token,
            ),
            decode_step_s: m.predict_itl(batch).map(|d| d.as_secs_f64()),
            current_step_s: m.current_step().map(|d| d.as_secs_f64()),
            chunk_tokens: if chunk > 0 {
                chunk
            } else {
                SpeedView::default().chunk_tokens
            },
        }
    }
}

/// Counts a request's uncached prompt tokens as prefill queued at a replica until its first
/// byte arrives (`done`) or it ends.
pub struct PendingPrefill {
    replica: Arc<ReplicaHandle>,
    /// The request's place in the replica's queue; `None` once answered.
    id: Option<u64>,
}

impl PendingPrefill {
    /// Adds `tokens` (the uncached part of a prompt whose block hashes are `blocks`); returns
    /// the guard and the prefill still to do ahead of them.
    pub fn new(replica: Arc<ReplicaHandle>, tokens: u64, blocks: Arc<[u64]>) -> (Self, u64) {
        let (overhead_s, seconds_per_token) = replica.model.lock().ttft_coefficients();
        let (id, ahead) = replica.prefill.add(
            tokens,
            blocks,
            Instant::now(),
            overhead_s,
            seconds_per_token,
        );
        (
            PendingPrefill {
                replica,
                id: Some(id),
            },
            ahead,
        )
    }

    pub fn done(&mut self) {
        if let Some(id) = self.id.take() {
            self.replica.prefill.done(id, Instant::now());
        }
    }
}

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        self.done();
    }
}

/// Counts a request in flight at a replica for as long as it lives.
pub struct InFlight(Arc<ReplicaHandle>);

impl InFlight {
    pub fn new(r: Arc<ReplicaHandle>) -> Self {
        r.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(r)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.finished.fetch_add(1, Ordering::Relaxed);
    }
}

pub struct Registry {
    /// By slot; retired replicas stay in their slot until it is reused.
    replicas: ArcSwap<Vec<Arc<ReplicaHandle>>>,
    pub index: Arc<PrefixIndex>,
    metrics: Arc<GatewayMetrics>,
    cfg: GatewayConfig,
    client: HttpClient,
    epoch: Instant,
    /// `Authorization` sent with every request to a replica (the fleet token).
    fleet_auth: Option<http::HeaderValue>,
    /// Replicas whose engine is not kvgate, or that publish KV events over ZMQ, by address.
    engines: RwLock<std::collections::HashMap<String, EngineSpec>>,
}

impl Registry {
    pub fn new(
        cfg: &GatewayConfig,
        index: Arc<PrefixIndex>,
        client: HttpClient,
        fleet_token: Option<&str>,
        metrics: Arc<GatewayMetrics>,
    ) -> Self {
        let fleet_auth = fleet_token.and_then(|t| {
            let mut v = http::HeaderValue::from_str(&format!("Bearer {t}")).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        let replicas = cfg
            .replicas
            .iter()
            .enumerate()
            .map(|(i, n)| Arc::new(ReplicaHandle::new(i, n.clone(), metrics.clone())))
            .collect();
        Registry {
            engines: RwLock::new(
                cfg.engines
                    .iter()
                    .map(|e| (e.addr.clone(), e.clone()))
                    .collect(),
            ),
            fleet_auth,
            replicas: ArcSwap::from_pointee(replicas),
            metrics,
            index,
            cfg: cfg.clone(),
            client,
            epoch: Instant::now(),
        }
    }

    /// Whether `r` is expected to publish KV events: it has a ZMQ endpoint, or it is a kvgate
    /// replica and the gateway follows events.
    pub fn expects_events(&self, r: &ReplicaHandle) -> bool {
        match self.engine(&r.name) {
            Some(e) if e.kv_events.is_some() => true,
            _ => self.cfg.index.kv_events && self.backend(r) == Backend::Kvgate,
        }
    }

    /// Adopts the engine tables of a reloaded file (for replicas that join from now on).
    pub fn set_engines(&self, specs: &[EngineSpec]) {
        *self.engines.write() = specs.iter().map(|e| (e.addr.clone(), e.clone())).collect();
    }

    /// The engine behind `name`, when the file names one.
    pub fn engine(&self, name: &str) -> Option<EngineSpec> {
        self.engines.read().get(name).cloned()
    }

    /// Every slot's replica (retired ones included; check [`ReplicaHandle::is_retired`]).
    /// Stops every replica's health check, load poll and KV event stream (the gateway has
    /// drained and is exiting).
    pub fn stop_background(&self) {
        for r in self.replicas().iter() {
            for t in r.tasks.lock().drain(..) {
                t.abort();
            }
        }
    }

    pub fn replicas(&self) -> Arc<Vec<Arc<ReplicaHandle>>> {
        self.replicas.load_full()
    }

    /// The replica in `slot`.
    pub fn replica(&self, slot: usize) -> Option<Arc<ReplicaHandle>> {
        self.replicas.load().get(slot).cloned()
    }

    /// Number of slots (retired included): the range of replica ids.
    pub fn slots(&self) -> usize {
        self.replicas.load().len()
    }

    /// The listed (not retired) replicas' names, in slot order, and their slots.
    pub fn listed(&self) -> Vec<(usize, String)> {
        self.replicas
            .load()
            .iter()
            .filter(|r| !r.is_retired())
            .map(|r| (r.slot, r.name.clone()))
            .collect()
    }

    /// Makes the listed replicas exactly `names`: a replica still listed keeps its slot and
    /// state, a new one takes a free slot (a never-used one, or a retired one with nothing in
    /// flight) and starts its background tasks, a removed one is retired. Returns the slot of
    /// each name, in order.
    pub fn reconcile(self: &Arc<Self>, names: &[String]) -> Result<Vec<usize>, String> {
        let old = self.replicas.load_full();
        let mut next: Vec<Arc<ReplicaHandle>> = old.as_ref().clone();
        let mut added = Vec::new();
        let mut slots = Vec::with_capacity(names.len());
        for n in names {
            if let Some(r) = next.iter().find(|r| &r.name == n && !r.is_retired()) {
                slots.push(r.slot);
                continue;
            }
            let free = next.iter().position(|r| {
                r.is_retired()
                    && r.in_flight.load(Ordering::Relaxed) == 0
                    && !names.contains(&r.name)
            });
            // A retired slot with nothing in flight is reused; otherwise the fleet grows (the
            // prefix index adds a group of 64 slots when needed).
            let slot = free.unwrap_or(next.len());
            let h = Arc::new(ReplicaHandle::new(slot, n.clone(), self.metrics.clone()));
            if slot == next.len() {
                next.push(h.clone());
            } else {
                next[slot] = h.clone();
            }
            self.index.remove_replica(slot);
            added.push(h);
            slots.push(slot);
        }
        let mut removed = Vec::new();
        for r in next.iter() {
            if !r.is_retired() && !names.contains(&r.name) {
                r.retired.store(true, Ordering::Relaxed);
                r.ejections.send_modify(|n| *n += 1);
                for t in r.tasks.lock().drain(..) {
                    t.abort();
                }
                self.index.remove_replica(r.slot);
                r.metrics().healthy.set(0.0);
                removed.push(r.name.clone());
            }
        }
        self.replicas.store(Arc::new(next));
        for h in &added {
            self.spawn_tasks(h);
        }
        if !added.is_empty() || !removed.is_empty() {
            tracing::info!(
                added = ?added.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
                removed = ?removed,
                "replica list reloaded"
            );
        }
        Ok(slots)
    }

    /// A request to a replica, carrying the fleet token.
    pub fn request(
        &self,
        method: http::Method,
        url: String,
        body: Bytes,
    ) -> http::Request<http_body_util::Full<Bytes>> {
        let mut b = http::Request::builder().method(method).uri(url);
        if let Some(a) = &self.fleet_auth {
            b = b.header(http::header::AUTHORIZATION, a.clone());
        }
        if !body.is_empty() {
            b = b.header(http::header::CONTENT_TYPE, "application/json");
        }
        b.body(http_body_util::Full::new(body))
            .unwrap_or_else(|_| http::Request::new(http_body_util::Full::new(Bytes::new())))
    }

    /// The smallest context limit the listed replicas reported, if any did.
    pub fn max_model_len(&self) -> Option<u64> {
        self.replicas
            .load()
            .iter()
            .filter(|r| !r.is_retired())
            .filter_map(|r| r.max_model_len())
            .min()
    }

    /// Seconds since start: the prefix index's clock.
    pub fn now_s(&self) -> u32 {
        self.epoch.elapsed().as_secs() as u32
    }

    pub fn snapshot(&self) -> ReplicaSet {
        ReplicaSet {
            replicas: self
                .replicas
                .load()
                .iter()
                .map(|r| ReplicaView {
                    name: r.name.clone(),
                    healthy: r.is_healthy(),
                    load: r.load(),
                    speed: r.speed(),
                })
                .collect(),
        }
    }

    /// Per replica: how long approximate index records are trusted.
    pub fn index_ttls(&self) -> Vec<u32> {
        self.replicas
            .load()
            .iter()
            .map(|r| {
                if r.events_live() {
                    self.cfg.index.speculative_ttl_s
                } else {
                    self.cfg.index.approx_ttl_s
                }
            })
            .collect()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Records `tokens` of prompt sent to replica `slot` (projected KV until the next report).
    pub fn note_dispatch(&self, slot: usize, tokens: u64) {
        if let Some(r) = self.replica(slot) {
            r.since_poll_tokens.fetch_add(tokens, Ordering::Relaxed);
        }
    }

    /// Replica `slot` as admission sees it for a request of `own_tokens` prompt tokens: KV
    /// usage is projected from the last report plus what was sent since plus this request (the
    /// report lags by up to a poll interval, and a burst admitted inside one would otherwise all
    /// see the old figure); preemptions count as rising for `holdoff` after a poll saw the
    /// counter grow.
    pub fn pressure(
        &self,
        slot: usize,
        holdoff: Duration,
        own_tokens: u64,
    ) -> crate::admission::ReplicaPressure {
        let Some(r) = self.replica(slot) else {
            return crate::admission::ReplicaPressure::default();
        };
        let l = r.load();
        let at = r.preempted_at_ms.load(Ordering::Relaxed);
        let capacity = r.capacity_tokens.load(Ordering::Relaxed);
        let projected = if capacity > 0 {
            let extra = r.since_poll_tokens.load(Ordering::Relaxed) + own_tokens;
            l.kv_usage + extra as f64 / capacity as f64
        } else {
            l.kv_usage
        };
        crate::admission::ReplicaPressure {
            running: l.requests(),
            queued_prefill_tokens: {
                let (overhead_s, seconds_per_token) = r.model.lock().ttft_coefficients();
                r.prefill
                    .remaining(Instant::now(), overhead_s, seconds_per_token)
            },
            kv_usage: projected,
            preempting: at > 0 && self.now_ms() + 1 < at + holdoff.as_millis() as u64,
        }
    }

    pub fn healthy_count(&self) -> usize {
        self.replicas
            .load()
            .iter()
            .filter(|r| r.is_healthy())
            .count()
    }

    /// Admits or ejects a replica by hand (operator override; benchmarks without a network).
    pub fn set_healthy(&self, slot: usize, healthy: bool) {
        if let Some(r) = self.replica(slot) {
            r.healthy.store(healthy, Ordering::Relaxed);
        }
    }

    /// A failed connect counts like a failed health check.
    pub fn report_failure(&self, slot: usize) {
        if let Some(r) = self.replica(slot) {
            self.record_check(&r, false);
        }
    }

    /// Starts health checks, load polling and (when enabled) KV event subscriptions for every
    /// listed replica.
    pub fn spawn_background(self: &Arc<Self>) {
        for r in self.replicas.load().iter() {
            self.spawn_tasks(r);
        }
    }

    fn spawn_tasks(self: &Arc<Self>, r: &Arc<ReplicaHandle>) {
        let mut tasks = Vec::new();
        let (me, rep) = (self.clone(), r.clone());
        tasks.push(every(self.cfg.health.interval_ms, move || {
            let (me, rep) = (me.clone(), rep.clone());
            async move { me.check(&rep).await }
        }));
        let (me, rep) = (self.clone(), r.clone());
        tasks.push(every(self.cfg.upstream.load_poll_ms, move || {
            let (me, rep) = (me.clone(), rep.clone());
            async move { me.poll_load(&rep).await }
        }));
        let spec = self.engine(&r.name);
        if let Some(events) = spec.as_ref().and_then(|s| s.kv_events.clone()) {
            let source = ZmqSource {
                events,
                replay: spec.as_ref().and_then(|s| s.kv_replay.clone()),
            };
            let (index, rep) = (self.index.clone(), r.clone());
            let (model, block_size) = (self.cfg.model.name.clone(), self.cfg.model.block_size);
            tasks.push(tokio::spawn(async move {
                let mut translator = HashTranslator::new(&model, block_size);
                loop {
                    let outcome =
                        zmq_events::follow(&source, rep.slot, &index, &mut translator, &*rep).await;
                    if rep.events_live.swap(false, Ordering::Relaxed) {
                        tracing::info!(replica = %rep.name, reason = ?outcome, "ZMQ KV event stream lost; resyncing");
                    }
                    // A stream that cannot even be followed (a wrong endpoint) is named, not
                    // left to look like an idle engine.
                    if let Err(e) = &outcome {
                        zmq_events::EventSink::set_error(
                            &*rep,
                            Some(format!("cannot follow {}: {e}", source.events)),
                        );
                    }
                    index.clear_exact(rep.slot);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }));
        } else if self.cfg.index.kv_events
            && spec.as_ref().is_none_or(|s| s.backend == Backend::Kvgate)
        {
            let me = self.clone();
            let rep = r.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let outcome = me.follow_events(&rep).await;
                    if rep.events_live.swap(false, Ordering::Relaxed) {
                        tracing::info!(replica = %rep.name, reason = ?outcome, "KV event stream lost; resyncing");
                    }
                    me.index.clear_exact(rep.slot);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }));
        }
        *r.tasks.lock() = tasks;
    }
}

/// Runs `task` every `period_ms`, forever; a slow run delays the next instead of piling up.
fn every<F, Fut>(period_ms: u64, task: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(period_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            task().await;
        }
    })
}
