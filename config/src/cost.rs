//! `[cost]`: what the fleet's replicas cost, so the gateway can say live what a million
//! generated tokens cost (`kvgate_gateway_cost_per_mtok`), beside what a managed API would
//! charge for them — the runbook's monthly two numbers, on the dashboard.
//!
//! ```toml
//! [cost]
//! gpu_hour_usd = 2.5            # one GPU-hour
//! gpus_per_replica = 1          # GPUs one replica runs on (its tensor-parallel size)
//! managed_usd_per_mtok = 0.60   # a managed API's price per million output tokens
//! [cost.replica_hour_usd]       # replicas priced differently (another GPU): a whole
//! "10.0.0.9:8000" = 4.0         # replica-hour, by the address the gateway lists
//! ```
//!
//! The formula is the capacity note's (`kvgate capacity --gpu-hour-usd`): a replica-hour's
//! price over the tokens it generates in an hour, at the throughput measured from the
//! replicas' own counters over the last `window_s`.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::Validator;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostConfig {
    /// One GPU-hour, USD. Unset: no cost gauge.
    #[serde(default)]
    pub gpu_hour_usd: Option<f64>,
    #[serde(default = "default_gpus")]
    pub gpus_per_replica: u32,
    /// A whole replica-hour, USD, for replicas priced unlike the rest (by listed address).
    #[serde(default)]
    pub replica_hour_usd: BTreeMap<String, f64>,
    /// A managed API's price per million output tokens, exported beside the fleet's own.
    #[serde(default)]
    pub managed_usd_per_mtok: Option<f64>,
    /// Seconds of throughput the gauge is priced on (at most 600).
    #[serde(default = "default_window")]
    pub window_s: u64,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            gpu_hour_usd: None,
            gpus_per_replica: default_gpus(),
            replica_hour_usd: BTreeMap::new(),
            managed_usd_per_mtok: None,
            window_s: default_window(),
        }
    }
}

impl CostConfig {
    /// What one hour of the replica listed as `addr` costs (`None`: not priced).
    pub fn replica_hour(&self, addr: &str) -> Option<f64> {
        self.replica_hour_usd.get(addr).copied().or_else(|| {
            self.gpu_hour_usd
                .map(|g| g * f64::from(self.gpus_per_replica))
        })
    }

    /// USD per million tokens for `replica_hour_usd` spent on `tokens_per_s` (the capacity
    /// note's formula); `None` while nothing is generated.
    pub fn per_mtok(replica_hour_usd: f64, tokens_per_s: f64) -> Option<f64> {
        (tokens_per_s > 0.0).then(|| replica_hour_usd / (tokens_per_s * 3600.0) * 1e6)
    }

    pub(crate) fn check(&self, v: &mut Validator) {
        let price = |x: f64| x.is_finite() && x >= 0.0;
        for (field, value) in [
            ("cost.gpu_hour_usd", self.gpu_hour_usd),
            ("cost.managed_usd_per_mtok", self.managed_usd_per_mtok),
        ] {
            if let Some(x) = value {
                v.check(
                    price(x),
                    field,
                    x,
                    "must be a price: finite and not negative",
                );
            }
        }
        for (addr, x) in &self.replica_hour_usd {
            v.check(
                crate::fleet::is_host_port(addr),
                &format!("cost.replica_hour_usd.{addr:?}"),
                format!("{addr:?}"),
                "must be a replica's host:port as the gateway lists it",
            );
            v.check(
                price(*x),
                &format!("cost.replica_hour_usd.{addr:?}"),
                x,
                "must be a price: finite and not negative",
            );
        }
        v.check(
            (1..=1024).contains(&self.gpus_per_replica),
            "cost.gpus_per_replica",
            self.gpus_per_replica,
            "must be between 1 and 1024",
        );
        v.check(
            (10..=600).contains(&self.window_s),
            "cost.window_s",
            self.window_s,
            "must be between 10 and 600 seconds (the gateway keeps ten minutes of samples)",
        );
    }
}

fn default_gpus() -> u32 {
    1
}
fn default_window() -> u64 {
    300
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_follow_the_capacity_note_formula() {
        let c = CostConfig {
            gpu_hour_usd: Some(2.5),
            gpus_per_replica: 2,
            replica_hour_usd: [("b:1".to_string(), 4.0)].into(),
            ..CostConfig::default()
        };
        assert_eq!(c.replica_hour("a:1"), Some(5.0));
        assert_eq!(c.replica_hour("b:1"), Some(4.0));
        // 5 USD an hour at 1,000 tokens/s: 3.6M tokens an hour, 1.39 USD per million.
        let p = CostConfig::per_mtok(5.0, 1000.0).unwrap();
        assert!((p - 5.0 / 3.6).abs() < 1e-9);
        assert_eq!(CostConfig::per_mtok(5.0, 0.0), None);
        // A price keyed by URL names the replica as the list does.
        let g = crate::GatewayConfig::from_toml(
            "replicas = [\"http://10.0.0.9:8000/\"]\n[cost]\ngpu_hour_usd = 1.0\n\
             [cost.replica_hour_usd]\n\"http://10.0.0.9:8000/\" = 4.0\n",
        )
        .unwrap();
        assert_eq!(g.cost.replica_hour("10.0.0.9:8000"), Some(4.0));
        let mut v = Validator::new();
        CostConfig {
            gpu_hour_usd: Some(-1.0),
            window_s: 1,
            ..CostConfig::default()
        }
        .check(&mut v);
        let e = v.finish().unwrap_err().to_string();
        assert!(
            e.contains("cost.gpu_hour_usd") && e.contains("cost.window_s"),
            "{e}"
        );
    }
}
