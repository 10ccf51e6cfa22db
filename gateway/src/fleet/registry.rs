//! The replica fleet as the gateway knows it: one record per configured `host:port`
//! (`replica.rs`), by slot. Policies see a [`ReplicaSet`] snapshot built from these per request.
//!
//! The list is reloadable ([`Registry::reconcile`]): a replica keeps its slot (its bit in the
//! prefix index) for as long as it is listed; a new one gets a free slot; a removed one is
//! retired — no new requests, its background tasks stopped, its index bits cleared — while the
//! requests it already has run to their end.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use config::gateway::{Backend, EngineSpec};
use config::{GatewayConfig, ModelConfig};
use parking_lot::RwLock;
use policies::{ReplicaSet, ReplicaView};

use crate::fleet::client::{FleetClient, HttpClient};
use crate::fleet::replica::ReplicaHandle;
use crate::metrics::GatewayMetrics;
use crate::prefix::index::PrefixIndex;
use crate::prefix::view::IndexScope;

pub struct Registry {
    /// By slot; retired replicas stay in their slot until it is reused.
    pub(super) replicas: ArcSwap<Vec<Arc<ReplicaHandle>>>,
    pub index: Arc<PrefixIndex>,
    pub(super) metrics: Arc<GatewayMetrics>,
    pub(super) cfg: GatewayConfig,
    client: FleetClient,
    epoch: Instant,
    /// Replicas whose engine is not kvgate, or that publish KV events over ZMQ, by address.
    engines: RwLock<std::collections::HashMap<String, EngineSpec>>,
    /// Engine tables of discovered addresses.
    discovered_engines: RwLock<std::collections::HashMap<String, EngineSpec>>,
    /// The served models and the listed replicas their pools name (reloaded with the gateway
    /// file): which model's name and block size a replica's KV blocks have.
    served: ArcSwap<(Vec<ModelConfig>, Vec<String>)>,
}

impl Registry {
    pub fn new(
        cfg: &GatewayConfig,
        index: Arc<PrefixIndex>,
        client: HttpClient,
        fleet_token: Option<&str>,
        metrics: Arc<GatewayMetrics>,
    ) -> Self {
        let replicas = cfg
            .replicas
            .iter()
            .enumerate()
            .map(|(i, n)| Arc::new(ReplicaHandle::new(i, n.clone(), metrics.clone())))
            .collect();
        Registry {
            discovered_engines: RwLock::new(std::collections::HashMap::new()),
            engines: RwLock::new(
                cfg.engines
                    .iter()
                    .map(|e| (e.addr.clone(), e.clone()))
                    .collect(),
            ),
            replicas: ArcSwap::from_pointee(replicas),
            metrics,
            index,
            served: ArcSwap::from_pointee((cfg.served_models().to_vec(), cfg.replicas.clone())),
            cfg: cfg.clone(),
            client: FleetClient::new(client, fleet_token),
            epoch: Instant::now(),
        }
    }

    /// The model `replica` serves (its first, when it serves several): the name its engine's
    /// block hashes are rooted at, and their block size.
    pub fn model_of(&self, replica: &str) -> (String, usize) {
        let served = self.served.load();
        let m = config::models::model_of(&served.0, &served.1, replica);
        (m.name.clone(), m.block_size)
    }

    /// The served models in force.
    pub fn served_models(&self) -> Vec<ModelConfig> {
        self.served.load().0.clone()
    }

    /// The KV block size of the model `replica` serves ([`Registry::model_of`]).
    pub fn block_size_of(&self, replica: &str) -> usize {
        let served = self.served.load();
        config::models::model_of(&served.0, &served.1, replica).block_size
    }

    /// Sets the served models and the listed replicas their pools name.
    pub fn set_served(&self, models: Vec<ModelConfig>, listed: Vec<String>) {
        self.served.store(Arc::new((models, listed)));
    }

    /// Whether `r` is expected to publish KV events: it has a ZMQ endpoint, or it is a kvgate
    /// replica and the gateway follows events.
    pub fn expects_events(&self, r: &ReplicaHandle) -> bool {
        match self.engine(&r.name) {
            Some(e) if e.kv_events.is_some() => true,
            _ => self.cfg.index.kv_events && self.backend(r) == Backend::Kvgate,
        }
    }

    /// Healthy replicas whose KV events are expected, and how many of those are followed now
    /// (their snapshot or replay received): a gateway whose index is still filling routes
    /// worse than its peers, so `/ready` waits for it.
    pub fn events_warm(&self) -> (usize, usize) {
        let expected: Vec<bool> = self
            .replicas()
            .iter()
            // A stream the replica refuses (no fleet token) will not come however long we
            // wait: the log says why, and readiness does not hold for it.
            .filter(|r| {
                !r.is_retired()
                    && r.is_healthy()
                    && self.expects_events(r)
                    && !r.events_refused.load(Ordering::Relaxed)
            })
            .map(|r| r.events_live())
            .collect();
        (expected.iter().filter(|l| **l).count(), expected.len())
    }

    /// Adopts the engine tables of a reloaded file (for replicas that join from now on).
    pub fn set_engines(&self, specs: &[EngineSpec]) {
        *self.engines.write() = specs.iter().map(|e| (e.addr.clone(), e.clone())).collect();
    }

    /// Adopts the engine tables of the discovered addresses (`[discovery] backend` and its
    /// ports), before the fleet they join is applied.
    pub fn set_discovered_engines(&self, specs: &[EngineSpec]) {
        *self.discovered_engines.write() =
            specs.iter().map(|e| (e.addr.clone(), e.clone())).collect();
    }

    /// The engine behind `name`, when the file names one or discovery found it.
    pub fn engine(&self, name: &str) -> Option<EngineSpec> {
        let listed = self.engines.read().get(name).cloned();
        listed.or_else(|| self.discovered_engines.read().get(name).cloned())
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
    pub fn reconcile(self: &Arc<Self>, names: &[String]) -> Vec<usize> {
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
                // Retired, not ejected: what it has in flight (waiting for a first byte or
                // streaming) finishes there; only new work goes elsewhere.
                r.retired.store(true, Ordering::Relaxed);
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
        slots
    }

    /// The smallest context limit the listed replicas reported, if any did.
    /// The smallest context limit the replicas in `slots` report.
    pub fn max_model_len_among(&self, slots: &[usize]) -> Option<u64> {
        self.replicas
            .load()
            .iter()
            .filter(|r| !r.is_retired() && slots.contains(&r.slot))
            .filter_map(|r| r.max_model_len())
            .min()
    }

    /// Seconds since start: the prefix index's clock.
    pub fn now_s(&self) -> u32 {
        self.epoch.elapsed().as_secs() as u32
    }

    /// The fleet as a request of this class sees it (`background`: [`ReplicaHandle::load_for`]).
    pub fn snapshot(&self, background: bool) -> ReplicaSet {
        ReplicaSet {
            replicas: self
                .replicas
                .load()
                .iter()
                .map(|r| ReplicaView {
                    name: r.name.clone(),
                    healthy: r.is_healthy(),
                    load: r.load_for(background),
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

    /// What a prefix lookup needs from the fleet: its slots, the index clock and each
    /// replica's trust in approximate records.
    pub fn index_scope(&self) -> IndexScope {
        IndexScope {
            slots: self.slots(),
            now_s: self.now_s(),
            ttls: self.index_ttls(),
        }
    }

    /// The gateway configuration the fleet was started with (what a reload compares against).
    pub fn config(&self) -> &GatewayConfig {
        &self.cfg
    }

    /// The client every request to a replica goes through (it carries the fleet token).
    pub fn client(&self) -> &FleetClient {
        &self.client
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
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
}
