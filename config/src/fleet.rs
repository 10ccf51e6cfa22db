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
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            dns: Vec::new(),
            every_s: default_discovery_every(),
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
