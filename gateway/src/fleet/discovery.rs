//! Fleet membership from DNS (`[discovery] dns = ["name:port"]`): every address a name
//! resolves to is one replica `ip:port`, joined to the replicas listed by the file or the admin
//! API. The names are re-resolved on a timer; when what they resolve to changes, the fleet is
//! re-applied (`membership.rs`). A failed lookup keeps what the name last resolved to: the health
//! checks eject replicas that are gone, and a DNS outage never empties the fleet.

use std::collections::BTreeMap;
use std::time::Duration;

use config::gateway::{DiscoveryConfig, EngineSpec};
use parking_lot::Mutex;

/// The fleet's sources: the listed replicas and what each discovery name resolved to.
pub struct Discovery {
    pub every: Duration,
    inner: Mutex<Sources>,
    /// What runs behind each discovered address (its backend and ZMQ event ports).
    engines: DiscoveryConfig,
}

struct Sources {
    listed: Vec<String>,
    names: Vec<String>,
    /// name → its addresses at the last successful lookup (sorted, `ip:port`).
    found: BTreeMap<String, Vec<String>>,
}

impl Discovery {
    pub fn new(listed: Vec<String>, names: Vec<String>, every: Duration) -> Self {
        Discovery {
            every,
            inner: Mutex::new(Sources {
                listed,
                names,
                found: BTreeMap::new(),
            }),
            engines: DiscoveryConfig::default(),
        }
    }

    /// The engine behind every discovered address: `[discovery]`'s `backend` and ZMQ ports.
    pub fn with_engines(mut self, cfg: &DiscoveryConfig) -> Self {
        self.engines = cfg.clone();
        self
    }

    /// The engine tables of every discovered address (none for plain kvgate replicas).
    pub fn engines(&self) -> Vec<EngineSpec> {
        let s = self.inner.lock();
        s.found
            .values()
            .flatten()
            .filter_map(|a| self.engines.engine_for(a))
            .collect()
    }

    pub fn names(&self) -> Vec<String> {
        self.inner.lock().names.clone()
    }

    /// The fleet: the listed replicas in their order, then every discovered address (in name
    /// order, then address order) not listed already.
    pub fn fleet(&self) -> Vec<String> {
        let s = self.inner.lock();
        merge(&s.listed, &s.names, &s.found)
    }

    /// The fleet `listed` would make with what discovery found, without adopting it.
    pub fn fleet_with(&self, listed: &[String]) -> Vec<String> {
        let s = self.inner.lock();
        merge(listed, &s.names, &s.found)
    }

    /// Adopts a new static list (after the fleet it makes was applied).
    pub fn set_listed(&self, listed: Vec<String>) {
        self.inner.lock().listed = listed;
    }

    /// Adopts the discovery names from a reloaded file; what a dropped name found goes with it.
    pub fn set_names(&self, names: Vec<String>) {
        let mut s = self.inner.lock();
        s.found.retain(|n, _| names.contains(n));
        s.names = names;
    }

    /// Records a lookup of `name`. Returns whether what it resolves to changed. A failure, or
    /// an answer with no address, keeps the last addresses.
    pub fn record(&self, name: &str, lookup: Result<Vec<String>, String>) -> bool {
        let mut s = self.inner.lock();
        if !s.names.iter().any(|n| n == name) {
            return false;
        }
        match lookup {
            Ok(mut addrs) if !addrs.is_empty() => {
                addrs.sort();
                addrs.dedup();
                let old = s.found.insert(name.to_string(), addrs.clone());
                if old.as_ref() != Some(&addrs) {
                    tracing::info!(name, addresses = ?addrs, "discovery: the name resolves to a new set");
                    return true;
                }
                false
            }
            Ok(_) => {
                tracing::warn!(
                    name,
                    "discovery: the name resolved to no address; keeping the last ones"
                );
                false
            }
            Err(e) => {
                tracing::warn!(name, error = %e, "discovery: lookup failed; keeping the last addresses");
                false
            }
        }
    }

    /// How many addresses each name resolves to now.
    pub fn counts(&self) -> Vec<(String, usize)> {
        let s = self.inner.lock();
        s.names
            .iter()
            .map(|n| (n.clone(), s.found.get(n).map_or(0, Vec::len)))
            .collect()
    }
}

fn merge(
    listed: &[String],
    names: &[String],
    found: &BTreeMap<String, Vec<String>>,
) -> Vec<String> {
    let mut out = listed.to_vec();
    for n in names {
        for a in found.get(n).into_iter().flatten() {
            if !out.contains(a) {
                out.push(a.clone());
            }
        }
    }
    out
}

/// Every address `name:port` resolves to, as `ip:port` (`[v6]:port`), within `timeout`.
pub async fn resolve(name: &str, timeout: Duration) -> Result<Vec<String>, String> {
    match tokio::time::timeout(timeout, tokio::net::lookup_host(name)).await {
        Ok(Ok(addrs)) => Ok(addrs.map(|a| a.to_string()).collect()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> Discovery {
        Discovery::new(
            vec!["a:1".into()],
            vec!["svc:8000".into()],
            Duration::from_secs(1),
        )
    }

    #[test]
    fn the_fleet_follows_what_names_resolve_to_and_survives_failed_lookups() {
        let d = d();
        assert_eq!(d.fleet(), ["a:1"]);
        let two = vec!["10.0.0.2:8000".to_string(), "10.0.0.1:8000".to_string()];
        assert!(d.record("svc:8000", Ok(two.clone())));
        assert_eq!(d.fleet(), ["a:1", "10.0.0.1:8000", "10.0.0.2:8000"]);
        // The same set in another order is no change.
        assert!(!d.record("svc:8000", Ok(two.into_iter().rev().collect())));
        // A failure or an empty answer keeps the last set.
        assert!(!d.record("svc:8000", Err("SERVFAIL".into())));
        assert!(!d.record("svc:8000", Ok(vec![])));
        assert_eq!(d.fleet().len(), 3);
        // It shrinks when the records do.
        assert!(d.record("svc:8000", Ok(vec!["10.0.0.2:8000".into()])));
        assert_eq!(d.fleet(), ["a:1", "10.0.0.2:8000"]);
        assert_eq!(d.counts(), [("svc:8000".to_string(), 1)]);
    }

    #[test]
    fn listed_replicas_come_first_and_are_not_repeated() {
        let d = d();
        d.record("svc:8000", Ok(vec!["a:1".into(), "10.0.0.9:8000".into()]));
        assert_eq!(d.fleet(), ["a:1", "10.0.0.9:8000"]);
        assert_eq!(
            d.fleet_with(&["b:2".into()]),
            ["b:2", "10.0.0.9:8000", "a:1"]
        );
        d.set_listed(vec![]);
        assert_eq!(d.fleet(), ["10.0.0.9:8000", "a:1"]);
    }

    #[test]
    fn a_dropped_name_takes_its_replicas_with_it() {
        let d = d();
        d.record("svc:8000", Ok(vec!["10.0.0.1:8000".into()]));
        d.set_names(vec![]);
        assert_eq!(d.fleet(), ["a:1"]);
        assert!(!d.record("svc:8000", Ok(vec!["10.0.0.1:8000".into()])));
    }

    #[tokio::test]
    async fn localhost_resolves_to_loopback_addresses_with_the_port() {
        let got = resolve("localhost:8123", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            got.iter()
                .any(|a| a == "127.0.0.1:8123" || a == "[::1]:8123"),
            "{got:?}"
        );
    }
}
