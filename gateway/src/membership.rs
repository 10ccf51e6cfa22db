//! The fleet at run time: the listed replicas and the served models change from the gateway
//! file (reloaded on change, SIGHUP or `POST /admin/replicas/reload`), the listed replicas from
//! `PUT /admin/replicas`, and the replicas found through `[discovery] dns` with their DNS
//! records (`fleet/discovery.rs`). All go through [`Membership::apply_fleet`] — replicas still
//! present keep their state, new ones join, removed ones retire (`Registry::reconcile`), the
//! policy's pools are re-mapped to the replicas and models, or the change is refused whole. It
//! joins the fleet, the policies and the models, so it sits above them.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use config::{ConfigError, ModelConfig};

use crate::fleet::discovery::{resolve, Discovery};
use crate::fleet::registry::Registry;
use crate::metrics::GatewayMetrics;
use crate::models::{Catalog, ModelLoadError};
use crate::routes::model_scope::ModelScope;
use crate::routes::store::PolicyStore;

/// The gateway file the fleet was started from, and the hash of its text last seen.
pub type GatewayFile = (PathBuf, parking_lot::Mutex<Option<u64>>);

/// What a reload of the gateway file did: whether the fleet changed, and the sections of the
/// file that differ from the configuration in force but apply only at a restart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reloaded {
    pub changed: bool,
    /// The served models changed (added, removed or edited).
    pub models_changed: bool,
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
    #[error("the active policy does not fit the new replica list or models: {0} (to remove a model the policy file names, take it out of the policy file first, then out of the gateway file)")]
    Policy(ConfigError),
    #[error("{0}; the models in force stay")]
    Models(ModelLoadError),
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
    pub models: &'a ArcSwap<Catalog>,
}

impl Membership<'_> {
    /// Re-reads the gateway file and applies its replica list, engines, discovery names and
    /// models (the parts that reload; the sections that differ from the configuration in force
    /// and need a restart are returned and named in the log). A file the active policy cannot
    /// take (a pool names a replica it drops), or with a model that cannot be loaded, is
    /// refused whole.
    pub async fn reload(&self, force: bool) -> Result<Reloaded, MembershipError> {
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
        let result = self.apply_file(path, &text).await;
        if let Err(e) = &result {
            tracing::warn!(error = %e, "gateway file reload rejected; the fleet and models in force stay");
        }
        result
    }

    async fn apply_file(
        &self,
        path: &std::path::Path,
        text: &str,
    ) -> Result<Reloaded, MembershipError> {
        let mut cfg =
            config::GatewayConfig::from_toml(text).map_err(|source| MembershipError::File {
                path: path.display().to_string(),
                source,
            })?;
        cfg.resolve_paths(path.parent().unwrap_or(std::path::Path::new(".")));
        let needs_restart = self.fleet.config().needs_restart(&cfg);
        if !needs_restart.is_empty() {
            tracing::warn!(
                sections = needs_restart.join(", "),
                "gateway file: these sections changed and apply only at a restart"
            );
        }
        // New models' tokenizers are loaded before anything changes.
        let served = cfg.served_models().to_vec();
        let current = self.models.load_full();
        let models_changed = current.all().iter().map(|m| &m.cfg).ne(served.iter());
        let catalog = match models_changed {
            true => Some(
                current
                    .reloaded(&served)
                    .await
                    .map_err(MembershipError::Models)?,
            ),
            false => None,
        };
        // Engines first: a joining replica's event task reads its engine's table.
        self.fleet.set_engines(&cfg.engines);
        if self.discovery.names() != cfg.discovery.dns {
            self.discovery.set_names(cfg.discovery.dns.clone());
        }
        let fleet = self.discovery.fleet_with(&cfg.replicas);
        let changed = self.apply_fleet(&fleet, models_changed.then_some(served))?;
        self.discovery.set_listed(cfg.replicas);
        if let Some(c) = catalog {
            let names = c.names().join(", ");
            self.models.store(Arc::new(c));
            tracing::info!(models = names, "served models changed");
        }
        Ok(Reloaded {
            changed,
            models_changed,
            needs_restart,
        })
    }

    /// Makes `listed` the static part of the fleet (the file's or the admin API's list), joined
    /// to what discovery finds. Refused whole, keeping the list in force, when the policy
    /// cannot take the fleet it makes.
    pub fn set_listed(&self, listed: Vec<String>) -> Result<bool, MembershipError> {
        let fleet = self.discovery.fleet_with(&listed);
        let changed = self.apply_fleet(&fleet, None)?;
        self.discovery.set_listed(listed);
        Ok(changed)
    }

    /// Makes `list` (normalised and checked) the fleet and, when given, `models` the served
    /// models: listed replicas keep their state, new ones join, missing ones retire
    /// (`Registry::reconcile`). Refused whole when the list is empty or the active policy's
    /// pools or the models' do not fit it. `Ok(false)`: the list was the one in force already.
    pub fn apply_fleet(
        &self,
        list: &[String],
        models: Option<Vec<ModelConfig>>,
    ) -> Result<bool, MembershipError> {
        config::gateway::replica_list(list).map_err(MembershipError::List)?;
        let same = self.policies.replica_names() == list;
        if same && models.is_none() {
            return Ok(false);
        }
        let scopes: Option<Vec<ModelScope>> = models
            .as_ref()
            .map(|m| m.iter().map(ModelScope::of).collect());
        match &scopes {
            Some(s) => self.policies.check_fleet(list, s),
            None => self.policies.check_replicas(list),
        }
        .map_err(MembershipError::Policy)?;
        // The models before the replicas join: a joining replica's event task reads its model.
        let served = models.unwrap_or_else(|| self.fleet.served_models());
        self.fleet.set_served(served, list.to_vec());
        let slots = self.fleet.reconcile(list);
        self.policies.set_fleet(
            slots.into_iter().zip(list.iter().cloned()).collect(),
            scopes,
        );
        if !same {
            tracing::info!(replicas = list.len(), "replica list changed");
        }
        Ok(!same)
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
            if let Err(e) = self.apply_fleet(&self.discovery.fleet(), None) {
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
