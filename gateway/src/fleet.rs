//! The fleet at run time: the replica list changes from the gateway file (reloaded on change,
//! SIGHUP or `POST /admin/replicas/reload`) or from `PUT /admin/replicas`, both through
//! [`GatewayState::apply_replicas`] — listed replicas keep their state, new ones join, removed
//! ones retire (`Registry::reconcile`), and the policy's pools are re-mapped, or the change is
//! refused whole.

use crate::state::GatewayState;

impl GatewayState {
    /// Re-reads the gateway file and applies its replica list (the only part that reloads;
    /// other changes are named in the log as needing a restart). A list the active policy
    /// cannot take (a pool names a replica it drops) is refused whole.
    pub fn reload_replicas(&self, force: bool) -> Result<bool, String> {
        let Some((path, seen)) = &self.gateway_file else {
            return Err("the gateway was not started from a file; nothing to reload".into());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let h = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
        if !force && *seen.lock() == Some(h) {
            return Ok(false);
        }
        *seen.lock() = Some(h);
        let result = config::GatewayConfig::from_toml(&text)
            .map_err(|e| format!("{}: {e}", path.display()))
            .and_then(|cfg| self.apply_replicas(&cfg.replicas));
        if let Err(e) = &result {
            tracing::warn!(error = %e, "replica list reload rejected; the list in force stays");
        }
        result
    }

    /// Makes `list` (normalised and checked) the fleet: listed replicas keep their state, new
    /// ones join, missing ones retire (`Registry::reconcile`). Refused whole when the active
    /// policy's pools do not fit it. `Ok(false)`: it was the list in force already.
    pub fn apply_replicas(&self, list: &[String]) -> Result<bool, String> {
        if self.policies.replica_names() == list {
            return Ok(false);
        }
        self.policies
            .check_replicas(list)
            .map_err(|e| format!("the active policy does not fit the new replica list: {e}"))?;
        let slots = self.router.registry.reconcile(list)?;
        self.policies
            .set_replicas(slots.into_iter().zip(list.iter().cloned()).collect());
        tracing::info!(replicas = list.len(), "replica list changed");
        Ok(true)
    }
}
