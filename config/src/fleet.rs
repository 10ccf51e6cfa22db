//! The gateway's fleet: the rules a replica list obeys (one set, shared by the gateway file and
//! `PUT /admin/replicas`), replicas given as tables naming their engine and its ZMQ KV event
//! endpoints, and `[discovery]` by DNS.

use serde::Deserialize;

use crate::error::{ConfigError, Validator};

/// `host:port` with a port other than 0.
pub(crate) fn is_host_port(r: &str) -> bool {
    r.rsplit_once(':').is_some_and(|(h, p)| {
        !h.is_empty() && !h.contains('/') && p.parse::<u16>().is_ok_and(|p| p > 0)
    })
}

/// `http://host:port/` → `host:port`; anything else unchanged.
pub fn normalize_replica(r: &str) -> String {
    let t = r.trim();
    match t.strip_prefix("http://") {
        Some(rest) => rest.trim_end_matches('/').to_string(),
        None => t.to_string(),
    }
}

/// The engine behind a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A kvgate replica: `/get_load`, KV events over HTTP (`/kv_events`), or over ZMQ when
    /// `kv_events` is given (`kvgate replica --kv-events`).
    #[default]
    Kvgate,
    /// vLLM: KV events over ZMQ when `kv_events` is given.
    Vllm,
    /// SGLang: KV events over ZMQ when `kv_events` is given.
    Sglang,
}

/// A replica given as a table in `replicas`:
/// `{ addr = "10.0.0.5:8000", backend = "vllm", kv_events = "tcp://10.0.0.5:5557",
///    kv_replay = "tcp://10.0.0.5:5558" }`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub addr: String,
    #[serde(default)]
    pub backend: Backend,
    /// The engine's ZMQ PUB endpoint (`tcp://host:port`).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay (ROUTER) endpoint, used to fill a gap in the sequence.
    #[serde(default)]
    pub kv_replay: Option<String>,
}

/// Replaces every table in `replicas` by its `addr` and returns the tables, so the rest of the
/// configuration sees a list of addresses.
pub(crate) fn split_engine_tables(table: &mut toml::Table) -> Result<Vec<EngineSpec>, ConfigError> {
    let Some(toml::Value::Array(list)) = table.get_mut("replicas") else {
        return Ok(Vec::new());
    };
    let mut specs = Vec::new();
    for (i, item) in list.iter_mut().enumerate() {
        if let toml::Value::Table(t) = item {
            let mut spec: EngineSpec = toml::Value::Table(t.clone())
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse(format!("replicas[{i}]: {e}")))?;
            spec.addr = normalize_replica(&spec.addr);
            *item = toml::Value::String(spec.addr.clone());
            specs.push(spec);
        }
    }
    Ok(specs)
}

/// `tcp://host:port` naming a host to connect to (not `*` or `0.0.0.0`, which are how an
/// engine spells the address it binds).
pub(crate) fn is_zmq_tcp(endpoint: &str) -> bool {
    endpoint.strip_prefix("tcp://").is_some_and(|hp| {
        is_host_port(hp) && !matches!(hp.rsplit_once(':').map(|(h, _)| h), Some("*" | "0.0.0.0"))
    })
}

/// `[discovery]`: replicas found by resolving names. Every A/AAAA record of `name:port` is one
/// replica `ip:port` (a Kubernetes headless service, a Consul DNS name, a round-robin record);
/// the names are re-resolved every `every_s` seconds and the fleet follows, joined to the
/// static `replicas`. A failed lookup keeps the addresses last found (health checks eject the
/// dead ones), so a DNS outage never empties the fleet.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `name:port` each.
    #[serde(default)]
    pub dns: Vec<String>,
    /// Seconds between resolutions.
    #[serde(default = "default_discovery_every")]
    pub every_s: u64,
    /// The engine behind every discovered address (a StatefulSet of vLLM or SGLang pods).
    #[serde(default)]
    pub backend: Backend,
    /// Port on each discovered host where the engine publishes KV events over ZMQ
    /// (`tcp://host:PORT`); unset: a kvgate replica's events over HTTP, or none.
    #[serde(default)]
    pub kv_events_port: Option<u16>,
    /// Port of its replay (ROUTER) socket; needs `kv_events_port`.
    #[serde(default)]
    pub kv_replay_port: Option<u16>,
}

impl DiscoveryConfig {
    /// The engine table of a discovered `ip:port` (`None`: a plain kvgate replica).
    pub fn engine_for(&self, addr: &str) -> Option<EngineSpec> {
        if self.backend == Backend::Kvgate && self.kv_events_port.is_none() {
            return None;
        }
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        Some(EngineSpec {
            addr: addr.to_string(),
            backend: self.backend,
            kv_events: self.kv_events_port.map(|p| format!("tcp://{host}:{p}")),
            kv_replay: self
                .kv_replay_port
                .filter(|_| self.kv_events_port.is_some())
                .map(|p| format!("tcp://{host}:{p}")),
        })
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            dns: Vec::new(),
            every_s: default_discovery_every(),
            backend: Backend::Kvgate,
            kv_events_port: None,
            kv_replay_port: None,
        }
    }
}

fn default_discovery_every() -> u64 {
    10
}

/// Replicas one gateway may list: a sanity bound, not a data-structure limit (the prefix index
/// grows in groups of 64).
pub const MAX_REPLICAS: usize = 4096;

/// Checks a replica list (already normalised): non-empty, `host:port` each, no duplicates.
pub(crate) fn check_replicas(replicas: &[String], v: &mut Validator) {
    v.check(
        !replicas.is_empty(),
        "replicas",
        "[]",
        "list at least one replica (or name them through discovery.dns)",
    );
    v.check(
        replicas.len() <= MAX_REPLICAS,
        "replicas",
        replicas.len(),
        "at most 4096 replicas per gateway",
    );
    for (i, r) in replicas.iter().enumerate() {
        let field = format!("replicas[{i}]");
        if r.starts_with("https://") {
            v.check(
                false,
                &field,
                format!("{r:?}"),
                "kvgate talks plain HTTP to replicas; TLS to replicas is not supported (give host:port)",
            );
            continue;
        }
        v.check(
            is_host_port(r),
            &field,
            format!("{r:?}"),
            "must be host:port (http://host:port is accepted too)",
        );
        v.check(
            !replicas[..i].contains(r),
            &field,
            format!("{r:?}"),
            "listed twice",
        );
    }
}

/// Normalises and checks a replica list given at run time (`PUT /admin/replicas`), with the
/// same rules as the gateway file's `replicas`.
pub fn replica_list(list: &[String]) -> Result<Vec<String>, ConfigError> {
    let list: Vec<String> = list.iter().map(|r| normalize_replica(r)).collect();
    let mut v = Validator::new();
    check_replicas(&list, &mut v);
    v.finish()?;
    Ok(list)
}

#[cfg(test)]
mod discovery_tests {
    use super::*;

    #[test]
    fn discovered_engines_get_their_event_endpoints_on_their_own_host() {
        let plain = DiscoveryConfig::default();
        assert_eq!(plain.engine_for("10.1.2.3:8000"), None);
        let vllm = DiscoveryConfig {
            backend: Backend::Vllm,
            kv_events_port: Some(5557),
            kv_replay_port: Some(5558),
            ..DiscoveryConfig::default()
        };
        let e = vllm.engine_for("10.1.2.3:8000").unwrap();
        assert_eq!(e.backend, Backend::Vllm);
        assert_eq!(e.kv_events.as_deref(), Some("tcp://10.1.2.3:5557"));
        assert_eq!(e.kv_replay.as_deref(), Some("tcp://10.1.2.3:5558"));
        let v6 = vllm.engine_for("[fd00::7]:8000").unwrap();
        assert_eq!(v6.kv_events.as_deref(), Some("tcp://[fd00::7]:5557"));
    }
}
