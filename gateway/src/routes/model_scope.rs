//! A served model as the policy store sees it ([`ModelScope`]): its name and the replicas
//! serving it, which every route's pool is narrowed to for that model's requests.

use config::routes::{resolve_pool, PoolEntry};
use config::ModelConfig;

/// A served model as the routes see it: its name and the replicas serving it (empty: all).
#[derive(Debug, Clone)]
pub struct ModelScope {
    pub name: String,
    pub pool: Vec<PoolEntry>,
}

impl ModelScope {
    /// One model served by every replica.
    pub fn every_replica(name: &str) -> Self {
        ModelScope {
            name: name.into(),
            pool: Vec::new(),
        }
    }

    pub fn of(m: &ModelConfig) -> Self {
        ModelScope {
            name: m.name.clone(),
            pool: m.replicas.clone(),
        }
    }

    /// Indices into `names` of the replicas serving the model.
    pub(crate) fn resolve(&self, names: &[String]) -> Vec<usize> {
        if self.pool.is_empty() {
            (0..names.len()).collect()
        } else {
            resolve_pool(&self.pool, names)
        }
    }
}
