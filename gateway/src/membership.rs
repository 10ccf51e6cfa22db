//! The fleet at run time: the listed replicas change from the gateway file (reloaded on change,
//! SIGHUP or `POST /admin/replicas/reload`) or from `PUT /admin/replicas`, and the replicas
//! found through `[discovery] dns` change with their DNS records (`fleet/discovery.rs`). All go
//! through [`Membership::apply_replicas`] — replicas still present keep their state, new ones
//! join, removed ones retire (`Registry::reconcile`), and the policy's pools are re-mapped, or
//! the change is refused whole. It joins the fleet and the policies, so it sits above both.

use std::path::PathBuf;
use std::sync::Arc;

use config::ConfigError;

use crate::fleet::discovery::{resolve, Discovery};
use crate::fleet::registry::Registry;
use crate::metrics::GatewayMetrics;
use crate::routes::store::PolicyStore;

/// The gateway file the fleet was started from, and the hash of its text last seen.
pub type GatewayFile = (PathBuf, parking_lot::Mutex<Option<u64>>);

/// What a reload of the gateway file did: whether the fleet changed, and the sections of the
/// file that differ from the configuration in force but apply only at a restart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reloaded {
    pub changed: bool,
    pub needs_restart: Vec<&'static str>,
}

/// Why a new replica list was refused (the list in force stays).
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("the gateway was not started from a file; nothing to reload")]
    NoFile,
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    File { path: String, source: ConfigError },
    #[error("{0}")]
    List(ConfigError),
    #[error("the active policy does not fit the new replica list: {0}")]
    Policy(ConfigError),
    #[error("{0}")]
    Body(String),
}

/// What changing the fleet touches: the registry, discovery, the policies' pools.
pub struct Membership<'a> {
    pub fleet: &'a Arc<Registry>,
    pub discovery: &'a Discovery,
    pub policies: &'a PolicyStore,
    pub gateway_file: Option<&'a GatewayFile>,
    pub metrics: &'a GatewayMetrics,
}

impl Membership<'_> {
    /// Re-reads the gateway file and applies its replica list, engines and discovery names (the
    /// only parts that reload; the sections that differ from the configuration in force and
    /// need a restart are returned and named in the log). A list the active policy cannot take
    /// (a pool names a replica it drops) is refused whole.
    pub fn reload_replicas(&self, force: bool) -> Result<Reloaded, MembershipError> {
        let Some((path, seen)) = self.gateway_file else {
            return Err(MembershipError::NoFile);
        };
        let text = std::fs::read_to_string(path).map_err(|source| MembershipError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let h = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
        if !force && *seen.lock() == Some(h) {
            return Ok(Reloaded::default());
        }
        *seen.lock() = Some(h);
        let result = config::GatewayConfig::from_toml(&text)
            .map_err(|source| MembershipError::File {
                path: path.display().to_string(),
                source,
            })
            .and_then(|mut cfg| {
                cfg.resolve_paths(path.parent().unwrap_or(std::path::Path::new(".")));
                let needs_restart = self.fleet.config().needs_restart(&cfg);
                if !needs_restart.is_empty() {
                    tracing::warn!(
                        sections = needs_restart.join(", "),
                        "gateway file: these sections changed and apply only at a restart"
                    );
                }
                self.fleet.set_engines(&cfg.engines);
                if self.discovery.names() != cfg.discovery.dns {
                    self.discovery.set_names(cfg.discovery.dns.clone());
                }
                let changed = self.set_listed(cfg.replicas)?;
                Ok(Reloaded {
                    changed,
                    needs_restart,
                })
            });
        if let Err(e) = &result {
            tracing::warn!(error = %e, "replica list reload rejected; the list in force stays");
        }
        result
    }

    /// Makes `listed` the static part of the fleet (the file's or the admin API's list), joined
    /// to what discovery finds. Refused whole, keeping the list in force, when the policy
    /// cannot take the fleet it makes.
    pub fn set_listed(&self, listed: Vec<String>) -> Result<bool, MembershipError> {
        let fleet = self.discovery.fleet_with(&listed);
        let changed = self.apply_replicas(&fleet)?;
        self.discovery.set_listed(listed);
        Ok(changed)
    }

    /// Makes `list` (normalised and checked) the fleet: listed replicas keep their state, new
    /// ones join, missing ones retire (`Registry::reconcile`). Refused whole when it is empty or
    /// the active policy's pools do not fit it. `Ok(false)`: it was the list in force already.
    pub fn apply_replicas(&self, list: &[String]) -> Result<bool, MembershipError> {
        config::gateway::replica_list(list).map_err(MembershipError::List)?;
        if self.policies.replica_names() == list {
            return Ok(false);
        }
        self.policies
            .check_replicas(list)
            .map_err(MembershipError::Policy)?;
        let slots = self.fleet.reconcile(list);
        self.policies
            .set_replicas(slots.into_iter().zip(list.iter().cloned()).collect());
        tracing::info!(replicas = list.len(), "replica list changed");
        Ok(true)
    }

    /// Resolves every discovery name once and re-applies the fleet when an answer changed.
    pub async fn rediscover(&self) {
        let names = self.discovery.names();
        let timeout = self.discovery.every.min(std::time::Duration::from_secs(5));
        let mut changed = false;
        for name in &names {
            let found = resolve(name, timeout).await;
            changed |= self.discovery.record(name, found);
        }
        self.publish_discovered();
        if changed {
            self.fleet.set_discovered_engines(&self.discovery.engines());
            if let Err(e) = self.apply_replicas(&self.discovery.fleet()) {
                tracing::warn!(error = %e, "discovery: the fleet it found was refused; the fleet in force stays");
            }
        }
    }

    /// Sets `kvgate_gateway_discovered_replicas` for every discovery name.
    pub fn publish_discovered(&self) {
        for (name, n) in self.discovery.counts() {
            self.metrics.discovered(&name).set(n as f64);
        }
    }
}
