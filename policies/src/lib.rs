//! Routing policies: pure functions of a request's block hashes (and the prefix index's match
//! counts for it) and a snapshot of the replica set, returning a decision and its reason. No
//! I/O, no async, no proxy types, so every policy can be called from a unit test with a
//! fabricated fleet. [`build`] is the one factory, an exhaustive match over
//! [`config::PolicyConfig`].
#![forbid(unsafe_code)]

mod consistent_hash;
mod least_load;
mod prefix_aware;
mod round_robin;
mod session;
mod types;

pub use consistent_hash::ConsistentHash;
pub use least_load::LeastLoad;
pub use prefix_aware::PrefixAware;
pub use round_robin::RoundRobin;
pub use session::SessionAffinity;
pub use types::*;

use config::PolicyConfig;

/// Builds the policy a config describes.
pub fn build(cfg: &PolicyConfig) -> Box<dyn RoutingPolicy> {
    match cfg {
        PolicyConfig::RoundRobin => Box::new(RoundRobin::default()),
        PolicyConfig::LeastLoad { kv_usage_weight } => Box::new(LeastLoad::new(*kv_usage_weight)),
        PolicyConfig::ConsistentHash {
            key,
            prefix_blocks,
            load_factor,
            virtual_nodes,
        } => Box::new(ConsistentHash::new(
            *key,
            *prefix_blocks,
            *load_factor,
            *virtual_nodes,
        )),
        PolicyConfig::Session { fallback, .. } => Box::new(SessionAffinity::new(build(fallback))),
        PolicyConfig::PrefixAware(c) => Box::new(PrefixAware::new(c.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factory_names_match_config_kinds() {
        for text in [
            "kind = \"round_robin\"",
            "kind = \"least_load\"",
            "kind = \"consistent_hash\"",
            "kind = \"session\"",
            "kind = \"prefix_aware\"",
        ] {
            let cfg = PolicyConfig::from_toml(text).unwrap();
            assert_eq!(build(&cfg).name(), cfg.kind());
        }
    }
}
