//! `[peers]`: the other gateways of the same fleet, for one admission budget across them.
//!
//! Every gateway of a fleet serves its own use of the policy's limits (requests and prompt
//! tokens in flight per route, queue places, prefill it sent to each replica) on
//! `GET /admin/budget`, and reads its peers' every `every_ms`; a route's limits are then checked
//! against the sum, so N gateways admit what one would, not N times as much.
//!
//! ```toml
//! [peers]
//! addrs = ["10.0.0.7:9090"]                              # their admin_listen
//! dns = ["kvgate-gateway-peers.kvgate.svc.cluster.local:9090"]
//! every_ms = 100
//! stale_ms = 2000
//! ```
//!
//! A gateway finds itself among the addresses a name resolves to and leaves itself out. A peer
//! not heard from for `stale_ms` stops counting: a gateway that died took its requests with it
//! (its client connections closed, so the replicas cancelled them). A peer that is alive but
//! cut off also stops counting, so while the partition lasts each side admits up to the whole
//! budget; `kvgate_gateway_peers{state="stale"}` says when that is happening.

use serde::Deserialize;

use crate::error::Validator;
use crate::fleet::is_host_port;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersConfig {
    /// Peer gateways' admin addresses, `host:port`.
    #[serde(default)]
    pub addrs: Vec<String>,
    /// `name:port` each; every address a name resolves to is a peer (a Kubernetes headless
    /// Service over the gateways' admin port). Re-resolved every `resolve_every_s`.
    #[serde(default)]
    pub dns: Vec<String>,
    /// How often each peer's use of the budget is read.
    #[serde(default = "default_every")]
    pub every_ms: u64,
    /// A peer not heard from for this long no longer counts.
    #[serde(default = "default_stale")]
    pub stale_ms: u64,
    /// Seconds between resolutions of `dns`.
    #[serde(default = "default_resolve_every")]
    pub resolve_every_s: u64,
}

impl Default for PeersConfig {
    fn default() -> Self {
        PeersConfig {
            addrs: Vec::new(),
            dns: Vec::new(),
            every_ms: default_every(),
            stale_ms: default_stale(),
            resolve_every_s: default_resolve_every(),
        }
    }
}

impl PeersConfig {
    /// No peer named: the gateway's budget is its own.
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty() && self.dns.is_empty()
    }

    pub(crate) fn check(&self, v: &mut Validator) {
        for (field, list) in [("peers.addrs", &self.addrs), ("peers.dns", &self.dns)] {
            for (i, a) in list.iter().enumerate() {
                v.check(
                    is_host_port(a),
                    &format!("{field}[{i}]"),
                    format!("{a:?}"),
                    "must be host:port (a peer gateway's admin_listen)",
                );
            }
        }
        v.check(
            (10..=10_000).contains(&self.every_ms),
            "peers.every_ms",
            self.every_ms,
            "must be between 10 and 10000 ms",
        );
        v.check(
            self.stale_ms >= 2 * self.every_ms && self.stale_ms <= 600_000,
            "peers.stale_ms",
            self.stale_ms,
            "must be at least twice peers.every_ms and at most 600000",
        );
        v.check(
            (1..=3600).contains(&self.resolve_every_s),
            "peers.resolve_every_s",
            self.resolve_every_s,
            "must be between 1 and 3600 seconds",
        );
    }
}

fn default_every() -> u64 {
    100
}
fn default_stale() -> u64 {
    2000
}
fn default_resolve_every() -> u64 {
    5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        let mut v = Validator::new();
        PeersConfig::default().check(&mut v);
        assert!(v.finish().is_ok());
        let bad = PeersConfig {
            addrs: vec!["nohost".into()],
            dns: vec!["svc:0".into()],
            every_ms: 5,
            stale_ms: 5,
            resolve_every_s: 0,
        };
        let mut v = Validator::new();
        bad.check(&mut v);
        let err = v.finish().unwrap_err().to_string();
        for f in [
            "peers.addrs[0]",
            "peers.dns[0]",
            "peers.every_ms",
            "peers.stale_ms",
            "peers.resolve_every_s",
        ] {
            assert!(err.contains(f), "{f} missing from {err}");
        }
    }
}
