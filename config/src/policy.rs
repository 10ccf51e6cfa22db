//! The routing-policy section of the policy file: a serde-tagged enum, one variant per policy,
//! each with its parameters and their defaults. `policies::build` turns it into a policy with one
//! exhaustive match.
//!
//! ```toml
//! [policy]
//! kind = "prefix_aware"
//! load_weight = 256.0
//! ```

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Validator};

/// How consistent hashing keys a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HashKey {
    /// The session id header, falling back to the prefix when absent.
    Session,
    /// The first `prefix_blocks` block hashes of the prompt.
    Prefix,
}

fn default_load_factor() -> f64 {
    1.25
}
fn default_virtual_nodes() -> usize {
    160
}
fn default_prefix_blocks() -> usize {
    4
}
fn default_kv_weight() -> f64 {
    4.0
}
fn default_prefill_weight() -> f64 {
    1.0
}
fn default_load_weight() -> f64 {
    256.0
}
fn default_kv_usage_weight() -> f64 {
    512.0
}
fn default_stall_weight() -> f64 {
    0.05
}
fn default_recompute_weight() -> f64 {
    1.0
}
fn default_displace_weight() -> f64 {
    1.0
}
fn default_tie_ms() -> f64 {
    50.0
}
fn default_tie_ratio() -> f64 {
    0.1
}
fn default_itl_headroom() -> f64 {
    0.85
}
fn default_itl_min_reuse() -> f64 {
    2.0
}
fn default_itl_fleet_ratio() -> f64 {
    0.0
}
fn default_warm_headroom() -> f64 {
    0.7
}
fn default_warm_queue_share() -> f64 {
    0.5
}
fn default_warm_min_reuse() -> f64 {
    4.0
}
/// The request-count guard's threshold under the `tokens` cost when none is set.
pub const TOKENS_ABS_THRESHOLD: u32 = 16;

impl PrefixAwareConfig {
    /// The load guard's absolute threshold in force, if any.
    pub fn abs_threshold(&self) -> Option<u32> {
        match (self.balance_abs_threshold, self.cost) {
            (Some(t), _) => Some(t),
            (None, CostModel::Tokens) => Some(TOKENS_ABS_THRESHOLD),
            (None, CostModel::Ttft) => None,
        }
    }
}
fn default_rel_threshold() -> f64 {
    1.5
}
fn default_session_header() -> String {
    "x-session-id".into()
}
fn default_fallback() -> Box<PolicyConfig> {
    Box::new(PolicyConfig::PrefixAware(PrefixAwareConfig::default()))
}

/// What `prefix_aware` minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CostModel {
    /// Predicted time to first token at each replica, in seconds (queued prefill, this
    /// request's uncached tokens, the learnt prefill rate, decode interference), plus the stall
    /// the prefill imposes on the replica's running streams.
    #[default]
    Ttft,
    /// Uncached prompt tokens against requests at the replica (`prefill_weight`,
    /// `load_weight`, `kv_usage_weight`): the pre-0.2 cost, kept for comparison.
    Tokens,
}

/// Parameters of `prefix_aware` (see `policies::prefix_aware` for the scoring).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixAwareConfig {
    /// What the policy minimises (`ttft`, the default, or `tokens`).
    #[serde(default)]
    pub cost: CostModel,
    /// `ttft` cost: seconds of cost per second of stall this request's prefill imposes on each
    /// stream already running at the replica (the inter-token promise of others).
    #[serde(default = "default_stall_weight")]
    pub stall_weight: f64,
    /// `ttft` cost: a replica that would prefill again part of the prompt another replica holds
    /// is charged this × the seconds of that repeated prefill on top of its predicted TTFT
    /// while it has prefill queued — whoever queues there next waits for the repeat too. An
    /// idle replica is not charged: the repeat uses capacity nobody was using. Nor is any when
    /// the holder is passed over by the inter-token check, or its streams would step over
    /// `warm_headroom` × the promise (the repeat then buys decode headroom). 0: off.
    #[serde(default = "default_recompute_weight")]
    pub recompute_weight: f64,
    /// `ttft` cost: a replica is charged this × the waiting its own prefill would impose on the
    /// requests expected to arrive for that replica's cache meanwhile: its reuse rate (requests
    /// a second that were sent there to use what it holds) × own prefill seconds² / 2. An
    /// engine prefills the prompts it is running before it admits new ones, so a long cold
    /// prompt on the holder of a busy prefix holds up that prefix's next requests; elsewhere it
    /// holds up nobody. 0: off.
    #[serde(default = "default_displace_weight")]
    pub displace_weight: f64,
    /// `ttft` cost: replicas whose cost is within `max(tie_ms, tie_ratio × best)` of the
    /// cheapest count as tied, and the one holding the longest prefix wins among them.
    #[serde(default = "default_tie_ms")]
    pub tie_ms: f64,
    #[serde(default = "default_tie_ratio")]
    pub tie_ratio: f64,
    /// `ttft` cost: a replica whose running streams would see a decode step (their median
    /// inter-token gap, moved by the context in flight there and this request's prompt) over
    /// this share of the route's inter-token promise is passed over while another replica
    /// would keep within it (the route's own promise, or the strictest of the routes sharing
    /// its replicas; no promise, no check) — when what it holds of the prompt is shared
    /// (`itl_min_reuse`). The rest of the promise is room for the steps that carry prefill and
    /// for the batch growing during a stream's life. 0 turns the check off.
    #[serde(default = "default_itl_headroom")]
    pub itl_headroom: f64,
    /// The inter-token check passes over a replica holding part of the prompt only when at
    /// least this many recent requests (a count halving every 10 s) reused that prefix: a
    /// second holder of a shared system prompt serves every later request, where passing a
    /// conversation's holder over costs its whole history's prefill for one turn (BENCHMARKS,
    /// issue 11: with the check on every holder, chat reuse at the knee fell from 71% to 58%).
    #[serde(default = "default_itl_min_reuse")]
    pub itl_min_reuse: f64,
    /// When set, the inter-token check's limit is never under this many times the fleet's
    /// median decode step (over the replicas with streams running). Off (0) by default: with
    /// five of eight replicas over the promise, the floor rose above it and kept every stream
    /// on a holder that broke it (BENCHMARKS, issue 28: bursty traffic on L4s). It dates from a
    /// 0.6 headroom, under which busy L4s at 85-95 ms a step looked over a 90 ms limit.
    #[serde(default = "default_itl_fleet_ratio")]
    pub itl_fleet_ratio: f64,
    /// When every replica would break the inter-token promise with a request, send it to the
    /// one furthest over (its streams are lost already) instead of the cheapest. Off by
    /// default: on bursty L4 traffic past the knee it piled the overflow's prefill onto one
    /// replica (TTFT p95 over 2 s) and kept fewer promises, not more (BENCHMARKS, issue 28).
    #[serde(default)]
    pub itl_overflow: bool,
    /// `ttft` cost, hot prefixes get a second holder before their holder breaks a promise: when
    /// a request goes to a holder of a prefix at least `warm_min_reuse` recent requests reused,
    /// and every replica holding as much of it would see a decode step over this share of the
    /// inter-token promise (or has `warm_queue_share` of a cold prefill queued, below), the
    /// gateway also sends the prompt, for one token, to the cheapest replica that would keep
    /// within the inter-token limit: the next requests of that prefix find it cached there.
    /// 0 turns warming off.
    #[serde(default = "default_warm_headroom")]
    pub warm_headroom: f64,
    /// ... or when each such holder's predicted TTFT is over this share of the best cold
    /// replica's (the prefill queued there is half-way to spreading by price). 0: on the
    /// inter-token step alone.
    #[serde(default = "default_warm_queue_share")]
    pub warm_queue_share: f64,
    /// A prefix is warmed elsewhere only when at least this many recent requests reused it.
    #[serde(default = "default_warm_min_reuse")]
    pub warm_min_reuse: f64,
    /// Cost of one uncached prompt token (prefill work).
    #[serde(default = "default_prefill_weight")]
    pub prefill_weight: f64,
    /// Cost of one request queued or running at the replica, in prompt-token equivalents.
    #[serde(default = "default_load_weight")]
    pub load_weight: f64,
    /// Cost of a full KV cache, in prompt-token equivalents (scaled by the usage ratio).
    #[serde(default = "default_kv_usage_weight")]
    pub kv_usage_weight: f64,
    /// Load guard: affinity is overridden when the preferred replica's load exceeds the least
    /// loaded replica's by more than this many requests ... Unset: 16 under the `tokens` cost,
    /// and no guard under `ttft` (seconds already price the load; the request-count guard only
    /// gave cache reuse away — BENCHMARKS, issue 11).
    #[serde(default)]
    pub balance_abs_threshold: Option<u32>,
    /// ... and by more than this factor.
    #[serde(default = "default_rel_threshold")]
    pub balance_rel_threshold: f64,
}

impl Default for PrefixAwareConfig {
    fn default() -> Self {
        PrefixAwareConfig {
            cost: CostModel::default(),
            stall_weight: default_stall_weight(),
            recompute_weight: default_recompute_weight(),
            displace_weight: default_displace_weight(),
            tie_ms: default_tie_ms(),
            tie_ratio: default_tie_ratio(),
            itl_headroom: default_itl_headroom(),
            itl_min_reuse: default_itl_min_reuse(),
            itl_fleet_ratio: default_itl_fleet_ratio(),
            itl_overflow: false,
            warm_headroom: default_warm_headroom(),
            warm_queue_share: default_warm_queue_share(),
            warm_min_reuse: default_warm_min_reuse(),
            prefill_weight: default_prefill_weight(),
            load_weight: default_load_weight(),
            kv_usage_weight: default_kv_usage_weight(),
            balance_abs_threshold: None,
            balance_rel_threshold: default_rel_threshold(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Each healthy replica in turn.
    RoundRobin,
    /// The replica with the fewest requests in flight (gateway's count or the replica's own
    /// waiting + running, whichever is larger), KV usage breaking near-ties.
    LeastLoad {
        /// Requests-equivalent of a full KV cache.
        #[serde(default = "default_kv_weight")]
        kv_usage_weight: f64,
    },
    /// Consistent hashing with bounded loads (CHWBL).
    ConsistentHash {
        #[serde(default = "default_hash_key")]
        key: HashKey,
        #[serde(default = "default_prefix_blocks")]
        prefix_blocks: usize,
        /// A replica takes at most `load_factor` × the average load before keys spill over.
        #[serde(default = "default_load_factor")]
        load_factor: f64,
        #[serde(default = "default_virtual_nodes")]
        virtual_nodes: usize,
    },
    /// Sticky by session id; requests without one use `fallback`.
    Session {
        #[serde(default = "default_session_header")]
        header: String,
        #[serde(default = "default_fallback")]
        fallback: Box<PolicyConfig>,
    },
    /// Longest cached prefix against load, with an imbalance guard.
    PrefixAware(PrefixAwareConfig),
}

fn default_hash_key() -> HashKey {
    HashKey::Session
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::PrefixAware(PrefixAwareConfig::default())
    }
}

impl PolicyConfig {
    /// The config `kind`, which is also the policy's metrics label.
    pub fn kind(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin => "round_robin",
            PolicyConfig::LeastLoad { .. } => "least_load",
            PolicyConfig::ConsistentHash { .. } => "consistent_hash",
            PolicyConfig::Session { .. } => "session",
            PolicyConfig::PrefixAware(_) => "prefix_aware",
        }
    }

    /// Parses a `[policy]` table from TOML text and validates it.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let p: PolicyConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        p.validate("policy")?;
        Ok(p)
    }

    /// Checks every parameter; `path` prefixes field names in errors.
    pub fn validate(&self, path: &str) -> Result<(), ConfigError> {
        let mut v = Validator::new();
        self.validate_into(path, &mut v);
        v.finish()
    }

    fn validate_into(&self, path: &str, v: &mut Validator) {
        let f = |name: &str| format!("{path}.{name}");
        match self {
            PolicyConfig::RoundRobin => {}
            PolicyConfig::LeastLoad { kv_usage_weight } => {
                v.check(
                    kv_usage_weight.is_finite() && *kv_usage_weight >= 0.0,
                    &f("kv_usage_weight"),
                    kv_usage_weight,
                    "must be a non-negative number",
                );
            }
            PolicyConfig::ConsistentHash {
                prefix_blocks,
                load_factor,
                virtual_nodes,
                ..
            } => {
                v.check(
                    *prefix_blocks >= 1,
                    &f("prefix_blocks"),
                    prefix_blocks,
                    "must be at least 1",
                );
                v.check(
                    load_factor.is_finite() && *load_factor >= 1.0,
                    &f("load_factor"),
                    load_factor,
                    "must be at least 1.0 (1.0 = perfectly even, larger allows more affinity)",
                );
                v.check(
                    (1..=4096).contains(virtual_nodes),
                    &f("virtual_nodes"),
                    virtual_nodes,
                    "must be between 1 and 4096",
                );
            }
            PolicyConfig::Session { header, fallback } => {
                v.check(
                    !header.is_empty()
                        && header
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
                    &f("header"),
                    format!("{header:?}"),
                    "must be a non-empty header name (letters, digits, '-', '_')",
                );
                if matches!(**fallback, PolicyConfig::Session { .. }) {
                    v.check(
                        false,
                        &f("fallback.kind"),
                        "session",
                        "a session policy cannot fall back to another session policy",
                    );
                } else {
                    fallback.validate_into(&f("fallback"), v);
                }
            }
            PolicyConfig::PrefixAware(c) => {
                for (name, x) in [
                    ("prefill_weight", c.prefill_weight),
                    ("load_weight", c.load_weight),
                    ("kv_usage_weight", c.kv_usage_weight),
                    ("stall_weight", c.stall_weight),
                    ("recompute_weight", c.recompute_weight),
                    ("displace_weight", c.displace_weight),
                    ("tie_ms", c.tie_ms),
                    ("tie_ratio", c.tie_ratio),
                ] {
                    v.check(
                        x.is_finite() && x >= 0.0,
                        &f(name),
                        x,
                        "must be a non-negative number",
                    );
                }
                v.check(
                    (0.0..=1.0).contains(&c.itl_headroom),
                    &f("itl_headroom"),
                    c.itl_headroom,
                    "must be between 0 and 1 (a share of the inter-token promise; 0: off)",
                );
                v.check(
                    c.itl_min_reuse.is_finite() && c.itl_min_reuse >= 0.0,
                    &f("itl_min_reuse"),
                    c.itl_min_reuse,
                    "must be a non-negative number of requests",
                );
                v.check(
                    (0.0..=1.0).contains(&c.warm_headroom),
                    &f("warm_headroom"),
                    c.warm_headroom,
                    "must be between 0 and 1 (a share of the inter-token promise; 0: off)",
                );
                v.check(
                    (0.0..=1.0).contains(&c.warm_queue_share),
                    &f("warm_queue_share"),
                    c.warm_queue_share,
                    "must be between 0 and 1 (a share of a cold prefill's TTFT; 0: off)",
                );
                v.check(
                    c.warm_min_reuse.is_finite() && c.warm_min_reuse >= 0.0,
                    &f("warm_min_reuse"),
                    c.warm_min_reuse,
                    "must be a non-negative number of requests",
                );
                v.check(
                    c.itl_fleet_ratio.is_finite() && c.itl_fleet_ratio >= 0.0,
                    &f("itl_fleet_ratio"),
                    c.itl_fleet_ratio,
                    "must be a non-negative number (a multiple of the fleet's median decode step; 0: off)",
                );
                v.check(
                    c.balance_rel_threshold.is_finite() && c.balance_rel_threshold >= 1.0,
                    &f("balance_rel_threshold"),
                    c.balance_rel_threshold,
                    "must be at least 1.0",
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind_with_defaults() {
        assert_eq!(
            PolicyConfig::from_toml("kind = \"round_robin\"").unwrap(),
            PolicyConfig::RoundRobin
        );
        let p = PolicyConfig::from_toml("kind = \"prefix_aware\"\nload_weight = 100.0").unwrap();
        match p {
            PolicyConfig::PrefixAware(c) => {
                assert_eq!(c.load_weight, 100.0);
                assert_eq!(
                    c.abs_threshold(),
                    None,
                    "no count guard under the ttft cost"
                );
                let tokens = PrefixAwareConfig {
                    cost: CostModel::Tokens,
                    ..c.clone()
                };
                assert_eq!(tokens.abs_threshold(), Some(16));
            }
            other => panic!("{other:?}"),
        }
        let s = PolicyConfig::from_toml(
            "kind = \"session\"\n[fallback]\nkind = \"consistent_hash\"\nkey = \"prefix\"",
        )
        .unwrap();
        assert_eq!(s.kind(), "session");
    }

    #[test]
    fn reports_field_value_and_reason() {
        let e = PolicyConfig::from_toml(
            "kind = \"session\"\nheader = \"\"\n[fallback]\nkind = \"consistent_hash\"\nload_factor = 0.5",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("policy.header"), "{text}");
        assert!(
            text.contains("policy.fallback.load_factor = 0.5: must be at least 1.0"),
            "{text}"
        );
    }

    #[test]
    fn the_inter_token_check_knobs_are_bounded() {
        let ok = PolicyConfig::from_toml(
            "kind = \"prefix_aware\"\nitl_headroom = 0.6\nitl_min_reuse = 2\nitl_fleet_ratio = 1.1",
        );
        assert!(ok.is_ok(), "{ok:?}");
        for (line, expect) in [
            (
                "itl_headroom = 5",
                "policy.itl_headroom = 5: must be between 0 and 1",
            ),
            (
                "itl_min_reuse = -1",
                "policy.itl_min_reuse = -1: must be a non-negative",
            ),
            (
                "itl_fleet_ratio = -1",
                "policy.itl_fleet_ratio = -1: must be a non-negative",
            ),
            (
                "warm_headroom = 1.5",
                "policy.warm_headroom = 1.5: must be between 0 and 1",
            ),
            (
                "warm_queue_share = -0.1",
                "policy.warm_queue_share = -0.1: must be between 0 and 1",
            ),
            (
                "warm_min_reuse = -2",
                "policy.warm_min_reuse = -2: must be a non-negative",
            ),
        ] {
            let e = PolicyConfig::from_toml(&format!("kind = \"prefix_aware\"\n{line}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(expect), "{line}: {e}");
        }
    }

    #[test]
    fn rejects_unknown_kinds_and_fields() {
        assert!(matches!(
            PolicyConfig::from_toml("kind = \"random\""),
            Err(ConfigError::Parse(_))
        ));
        let e = PolicyConfig::from_toml("kind = \"least_load\"\nfoo = 1").unwrap_err();
        assert!(e.to_string().contains("foo"), "{e}");
    }
}
