//! One admission budget across the gateways of a fleet (`[peers]` in the gateway file).
//!
//! Each gateway serves its own use of the policy's limits on `GET /admin/budget` — per route
//! the requests and prompt tokens it has in flight and the requests it has queued, per replica
//! the prefill it sent there that is not done yet — and reads its peers' every `every_ms`. The
//! sums land in each route's runtime (`RouteRuntime::set_peer_use`) and each replica's handle
//! (`peer_prefill`), so a route's `max_concurrency`, `max_prompt_tokens_in_flight` and
//! `queue_size` are checked against the fleet's use, and admission's predicted TTFT counts the
//! prefill other gateways queued at a replica.
//!
//! Why peers read each other rather than a shared store: the numbers are each gateway's own
//! and live for seconds, every gateway already has an admin listener, and nothing new has to
//! be run or kept available. The price is slack: a peer's use is at most `every_ms` plus a
//! round trip old, so the fleet may admit what arrives in that window past a limit (measured in
//! BENCHMARKS). A peer not heard from for `stale_ms` stops counting (see `config::peers`).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use config::peers::PeersConfig;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::fleet::client::{http_client, FleetClient};
use crate::fleet::discovery::resolve;
use crate::fleet::registry::Registry;
use crate::metrics::GatewayMetrics;
use crate::routes::runtime::RouteUse;
use crate::routes::store::PolicyStore;

/// What `GET /admin/budget` answers: one gateway's own use, never what it heard from peers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetReport {
    /// The gateway's instance id (random at start): a gateway finds itself among its peers'
    /// addresses by it, and one peer reached under two addresses counts once.
    pub id: String,
    pub routes: BTreeMap<String, RouteUse>,
    /// Replica name → prompt tokens sent there whose prefill is not done yet.
    pub replicas: BTreeMap<String, u64>,
}

/// This gateway's own use of the budget now.
pub fn own_report(id: &str, policies: &PolicyStore, fleet: &Registry) -> BudgetReport {
    let routes = policies
        .runtimes()
        .iter()
        .map(|rt| {
            let u = RouteUse {
                in_flight: rt.in_flight(),
                tokens: rt.in_flight_tokens(),
                queued: rt.queue.len() as u32,
            };
            (rt.name.clone(), u)
        })
        .filter(|(_, u)| *u != RouteUse::default())
        .collect();
    let replicas = fleet
        .replicas()
        .iter()
        .filter(|r| !r.is_retired())
        .map(|r| (r.name.clone(), r.own_prefill_remaining()))
        .filter(|(_, t)| *t > 0)
        .collect();
    BudgetReport {
        id: id.to_string(),
        routes,
        replicas,
    }
}

/// What was last heard from one peer address.
#[derive(Debug, Clone)]
struct Heard {
    at: Instant,
    report: BudgetReport,
}

/// The peers' summed use, as applied.
#[derive(Debug, Default, PartialEq)]
pub struct PeerTotals {
    pub routes: HashMap<String, RouteUse>,
    pub replicas: HashMap<String, u64>,
    /// Distinct peers heard within `stale_ms`, and addresses that were heard from once but
    /// not within it.
    pub live: usize,
    pub stale: usize,
}

/// The other gateways, as heard.
pub struct Peers {
    pub id: String,
    cfg: PeersConfig,
    heard: Mutex<HashMap<SocketAddr, Heard>>,
    /// Addresses that have not answered since this instant (never heard, or failing since a
    /// last answer): past `stale_ms` they count as stale, so a mistyped or dead peer shows.
    failing: Mutex<HashMap<SocketAddr, (Instant, bool)>>,
    /// Addresses found among the peers that answered with this gateway's own id.
    myself: Mutex<Vec<SocketAddr>>,
}

impl Peers {
    pub fn new(cfg: PeersConfig) -> Self {
        Peers {
            id: instance_id(),
            cfg,
            heard: Mutex::new(HashMap::new()),
            failing: Mutex::new(HashMap::new()),
            myself: Mutex::new(Vec::new()),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.cfg.is_empty()
    }

    /// Records that `addr` did not answer at `at` (`why`: for the log, once it turns stale).
    fn missed(&self, addr: SocketAddr, at: Instant, why: &str) {
        let mut f = self.failing.lock();
        let (since, warned) = f.entry(addr).or_insert((at, false));
        if !*warned
            && at.saturating_duration_since(*since) > Duration::from_millis(self.cfg.stale_ms)
        {
            *warned = true;
            tracing::warn!(%addr, error = why, "a peer gateway does not answer; its use of the budget is not counted until it does");
        }
    }

    /// Records `report` heard from `addr` at `at`.
    fn heard(&self, addr: SocketAddr, report: BudgetReport, at: Instant) {
        self.failing.lock().remove(&addr);
        if report.id == self.id {
            let mut me = self.myself.lock();
            if !me.contains(&addr) {
                tracing::info!(%addr, "found this gateway among its peers; leaving it out");
                me.push(addr);
            }
            return;
        }
        self.heard.lock().insert(addr, Heard { at, report });
    }

    /// The peers' use summed: each distinct id once (its freshest report), stale ones left out.
    pub fn totals(&self, now: Instant) -> PeerTotals {
        let stale_after = Duration::from_millis(self.cfg.stale_ms);
        let heard = self.heard.lock();
        let mut freshest: HashMap<&str, &Heard> = HashMap::new();
        let mut t = PeerTotals::default();
        for h in heard.values() {
            if now.saturating_duration_since(h.at) > stale_after {
                t.stale += 1;
                continue;
            }
            let e = freshest.entry(h.report.id.as_str()).or_insert(h);
            if h.at > e.at {
                *e = h;
            }
        }
        t.live = freshest.len();
        // Addresses never heard (a typo, a peer down from the start) count as stale too.
        t.stale += self
            .failing
            .lock()
            .iter()
            .filter(|(a, (since, _))| {
                !heard.contains_key(a) && now.saturating_duration_since(*since) > stale_after
            })
            .count();
        for h in freshest.values() {
            for (route, u) in &h.report.routes {
                t.routes.entry(route.clone()).or_default().add(u);
            }
            for (replica, tokens) in &h.report.replicas {
                *t.replicas.entry(replica.clone()).or_default() += tokens;
            }
        }
        t
    }

    /// Hands the peers' totals to the routes and replicas.
    fn apply(&self, t: &PeerTotals, policies: &PolicyStore, fleet: &Registry) {
        for rt in policies.runtimes() {
            rt.set_peer_use(t.routes.get(&rt.name).copied().unwrap_or_default());
        }
        for r in fleet.replicas().iter() {
            let tokens = t.replicas.get(&r.name).copied().unwrap_or(0);
            r.peer_prefill.store(tokens, Ordering::Relaxed);
        }
    }

    /// Every peer's last report with its age (for `GET /admin/peers`).
    pub fn describe(&self, now: Instant) -> serde_json::Value {
        let heard = self.heard.lock();
        let mut peers: Vec<serde_json::Value> = heard
            .iter()
            .map(|(addr, h)| {
                let age = now.saturating_duration_since(h.at);
                serde_json::json!({
                    "address": addr.to_string(),
                    "id": h.report.id,
                    "age_ms": age.as_millis() as u64,
                    "stale": age > Duration::from_millis(self.cfg.stale_ms),
                    "routes": h.report.routes,
                    "replicas": h.report.replicas,
                })
            })
            .collect();
        for (addr, (since, _)) in self.failing.lock().iter() {
            if !heard.contains_key(addr) {
                peers.push(serde_json::json!({
                    "address": addr.to_string(),
                    "never_heard": true,
                    "failing_ms": now.saturating_duration_since(*since).as_millis() as u64,
                    "stale": now.saturating_duration_since(*since)
                        > Duration::from_millis(self.cfg.stale_ms),
                }));
            }
        }
        peers.sort_by_key(|p| p["address"].as_str().map(str::to_string));
        serde_json::json!({
            "id": self.id,
            "every_ms": self.cfg.every_ms,
            "stale_ms": self.cfg.stale_ms,
            "myself": self.myself.lock().iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "peers": peers,
        })
    }
}

/// The reading side: the peers' addresses (re-resolved every `resolve_every_s`), the client
/// that reads them, and the gauges of what was heard. The gateway's wiring calls
/// [`PeerPoller::round`] every `every_ms`.
pub struct PeerPoller {
    client: FleetClient,
    names: Vec<String>,
    targets: Vec<SocketAddr>,
    resolved_at: Option<Instant>,
    timeout: Duration,
    resolve_every: Duration,
    gauges: [metrics::Gauge; 2],
}

impl PeerPoller {
    /// `admin_token`: the peers' admin token (a fleet's gateways share it).
    pub fn new(cfg: &PeersConfig, admin_token: Option<&str>, metrics: &GatewayMetrics) -> Self {
        PeerPoller {
            client: FleetClient::new(
                http_client(Duration::from_millis(cfg.every_ms.max(200))),
                admin_token,
            ),
            names: cfg.addrs.iter().chain(&cfg.dns).cloned().collect(),
            targets: Vec::new(),
            resolved_at: None,
            // A peer that does not answer (a black-holed address) must not hold up the round
            // for the others: a few periods at most, within half the staleness bound.
            timeout: Duration::from_millis((cfg.every_ms * 3).max(250).min(cfg.stale_ms / 2)),
            resolve_every: Duration::from_secs(cfg.resolve_every_s),
            gauges: ["live", "stale"]
                .map(|s| metrics.gauge_with("kvgate_gateway_peers", &[("state", s)])),
        }
    }

    /// Reads every peer once and applies the sums to the routes and replicas.
    pub async fn round(&mut self, peers: &Peers, policies: &PolicyStore, fleet: &Registry) {
        if self
            .resolved_at
            .is_none_or(|t| t.elapsed() >= self.resolve_every)
        {
            self.targets = resolve_all(&self.names).await;
            let targets = &self.targets;
            peers.heard.lock().retain(|a, _| targets.contains(a));
            peers.failing.lock().retain(|a, _| targets.contains(a));
            self.resolved_at = Some(Instant::now());
        }
        let me = peers.myself.lock().clone();
        let asks = self
            .targets
            .iter()
            .filter(|a| !me.contains(a))
            .map(|&addr| {
                let (client, timeout) = (&self.client, self.timeout);
                async move { (addr, client.fetch(addr, "/admin/budget", timeout).await) }
            });
        for (addr, got) in futures::future::join_all(asks).await {
            let report = got.map_err(|e| e.to_string()).and_then(|b| {
                serde_json::from_slice::<BudgetReport>(&b).map_err(|e| e.to_string())
            });
            match report {
                Ok(report) => peers.heard(addr, report, Instant::now()),
                Err(why) => peers.missed(addr, Instant::now(), &why),
            }
        }
        let t = peers.totals(Instant::now());
        peers.apply(&t, policies, fleet);
        self.gauges[0].set(t.live as f64);
        self.gauges[1].set(t.stale as f64);
    }
}

/// Every address the peer names resolve to (a name that does not resolve now is skipped and
/// tried again at the next resolution).
async fn resolve_all(names: &[String]) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for n in names {
        match resolve(n, Duration::from_secs(2)).await {
            Ok(addrs) => out.extend(addrs.iter().filter_map(|a| a.parse::<SocketAddr>().ok())),
            Err(e) => tracing::warn!(name = %n, error = %e, "cannot resolve a peer gateway"),
        }
    }
    out.sort();
    out.dedup();
    out
}

/// A random id for this gateway process.
fn instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(id: &str, in_flight: u32, prefill: u64) -> BudgetReport {
        BudgetReport {
            id: id.into(),
            routes: [(
                "chat".to_string(),
                RouteUse {
                    in_flight,
                    tokens: 100 * u64::from(in_flight),
                    queued: 1,
                },
            )]
            .into(),
            replicas: [("r1:8000".to_string(), prefill)].into(),
        }
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn peers_are_summed_once_each_and_stale_ones_stop_counting() {
        let peers = Peers::new(PeersConfig::default());
        let t0 = Instant::now();
        peers.heard(addr(1), report("a", 3, 500), t0);
        peers.heard(addr(2), report("b", 2, 100), t0);
        // The same gateway under a second address counts once, with its freshest report.
        peers.heard(addr(3), report("b", 4, 200), t0 + Duration::from_millis(50));
        let t = peers.totals(t0 + Duration::from_millis(100));
        assert_eq!(t.live, 2);
        assert_eq!(
            t.routes["chat"],
            RouteUse {
                in_flight: 7,
                tokens: 700,
                queued: 2
            }
        );
        assert_eq!(t.replicas["r1:8000"], 700);
        // Past stale_ms (2 s by default) only what was heard since counts.
        peers.heard(addr(2), report("b", 1, 0), t0 + Duration::from_millis(2100));
        let t = peers.totals(t0 + Duration::from_millis(2200));
        assert_eq!((t.live, t.stale), (1, 2));
        assert_eq!(t.routes["chat"].in_flight, 1);
    }

    #[test]
    fn a_peer_that_never_answers_turns_stale() {
        let peers = Peers::new(PeersConfig::default());
        let t0 = Instant::now();
        peers.missed(addr(7), t0, "connection refused");
        assert_eq!(peers.totals(t0 + Duration::from_millis(500)).stale, 0);
        peers.missed(
            addr(7),
            t0 + Duration::from_millis(2100),
            "connection refused",
        );
        assert_eq!(peers.totals(t0 + Duration::from_millis(2200)).stale, 1);
        let d = peers.describe(t0 + Duration::from_millis(2200));
        assert_eq!(d["peers"][0]["never_heard"], true);
        // Once it answers it is live, and no longer failing.
        peers.heard(addr(7), report("p", 1, 0), t0 + Duration::from_millis(2300));
        let t = peers.totals(t0 + Duration::from_millis(2400));
        assert_eq!((t.live, t.stale), (1, 0));
    }

    #[test]
    fn a_gateway_leaves_itself_out() {
        let peers = Peers::new(PeersConfig::default());
        let me = peers.id.clone();
        peers.heard(addr(9), report(&me, 5, 5), Instant::now());
        let t = peers.totals(Instant::now());
        assert_eq!(t.live, 0);
        assert!(t.routes.is_empty());
        assert_eq!(peers.describe(Instant::now())["myself"][0], "127.0.0.1:9");
    }

    #[test]
    fn instance_ids_differ() {
        assert_ne!(instance_id(), instance_id());
    }
}
