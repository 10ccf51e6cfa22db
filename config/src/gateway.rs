//! The gateway file (`config/gateway.toml`): where to listen, which replicas, which model
//! files, and the knobs of health checking, load polling, the prefix index, proxying and the
//! routing policy. Every field has a default except the replica list.
//!
//! ```toml
//! listen = "127.0.0.1:8080"
//! admin_listen = "127.0.0.1:9090"
//! replicas = ["127.0.0.1:8001", "127.0.0.1:8002"]
//! [model]
//! name = "Qwen3-8B"
//! tokenizer_dir = "models/qwen3"
//! [policy]
//! kind = "prefix_aware"
//! ```

use serde::Deserialize;

use crate::error::{ConfigError, Validator};
use crate::policy::PolicyConfig;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name clients send and replicas serve (part of every block hash's root).
    #[serde(default = "default_model")]
    pub name: String,
    /// Folder with tokenizer.json and tokenizer_config.json (the replicas' files).
    #[serde(default)]
    pub tokenizer_dir: Option<String>,
    /// Replicas' KV block size in tokens.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: default_model(),
            tokenizer_dir: None,
            block_size: default_block_size(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    #[serde(default = "default_health_interval")]
    pub interval_ms: u64,
    #[serde(default = "default_health_timeout")]
    pub timeout_ms: u64,
    /// Consecutive failed checks (or failed connects) before a replica is ejected.
    #[serde(default = "default_failures")]
    pub failures_to_eject: u32,
    /// Consecutive passed checks before an ejected replica is readmitted.
    #[serde(default = "default_successes")]
    pub successes_to_readmit: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_ms: default_health_interval(),
            timeout_ms: default_health_timeout(),
            failures_to_eject: default_failures(),
            successes_to_readmit: default_successes(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexConfig {
    /// Subscribe to each replica's `/kv_events` (exact); false: approximate only.
    #[serde(default = "default_true")]
    pub kv_events: bool,
    /// How long an approximate record (replica without events) is trusted, seconds.
    #[serde(default = "default_approx_ttl")]
    pub approx_ttl_s: u32,
    /// How long a speculative record (replica with events) is trusted before its event.
    #[serde(default = "default_spec_ttl")]
    pub speculative_ttl_s: u32,
    /// Approximate blocks remembered per replica.
    #[serde(default = "default_approx_capacity")]
    pub approx_capacity_blocks: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            kv_events: true,
            approx_ttl_s: default_approx_ttl(),
            speculative_ttl_s: default_spec_ttl(),
            approx_capacity_blocks: default_approx_capacity(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Longest wait for the first byte of a replica's answer, and between two of its chunks.
    #[serde(default = "default_first_byte_timeout")]
    pub first_byte_timeout_s: u64,
    /// Further replicas tried when a connect fails or a 5xx arrives before any byte was sent
    /// to the client.
    #[serde(default = "default_retries")]
    pub retries: u32,
    #[serde(default = "default_backoff")]
    pub retry_backoff_ms: u64,
    /// Largest request body accepted (413 beyond).
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: usize,
    /// Replica load polled this often (`/get_load`).
    #[serde(default = "default_load_poll")]
    pub load_poll_ms: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: default_connect_timeout(),
            first_byte_timeout_s: default_first_byte_timeout(),
            retries: default_retries(),
            retry_backoff_ms: default_backoff(),
            max_body_bytes: default_body_limit(),
            load_poll_ms: default_load_poll(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Admin API and Prometheus metrics.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// `host:port` of each replica (names are re-resolved each health check).
    pub replicas: Vec<String>,
    #[serde(default = "default_session_header")]
    pub session_header: String,
    #[serde(default)]
    pub model: ModelConfig,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub index: IndexConfig,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    /// Routing policy of the single catch-all route when no `policy_file` is given.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// The policy file (routes, SLOs, admission thresholds), hot-reloaded; relative paths are
    /// resolved against the gateway file's folder. Replaces `[policy]` when given.
    #[serde(default)]
    pub policy_file: Option<String>,
    /// A policy supplied by the program rather than a file (`kvgate up`'s embedded default);
    /// used when `policy_file` is absent, not reloadable.
    #[serde(skip)]
    pub embedded_policy: Option<crate::routes::PolicyFile>,
}

fn default_model() -> String {
    "Qwen3-8B".into()
}
fn default_block_size() -> usize {
    16
}
fn default_health_interval() -> u64 {
    1000
}
fn default_health_timeout() -> u64 {
    500
}
fn default_failures() -> u32 {
    2
}
fn default_successes() -> u32 {
    2
}
fn default_true() -> bool {
    true
}
fn default_approx_ttl() -> u32 {
    300
}
fn default_spec_ttl() -> u32 {
    30
}
fn default_approx_capacity() -> usize {
    200_000
}
fn default_connect_timeout() -> u64 {
    500
}
fn default_first_byte_timeout() -> u64 {
    600
}
fn default_retries() -> u32 {
    2
}
fn default_backoff() -> u64 {
    25
}
fn default_body_limit() -> usize {
    8 << 20
}
fn default_load_poll() -> u64 {
    250
}
fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}
fn default_session_header() -> String {
    "x-session-id".into()
}

impl GatewayConfig {
    /// A config for `replicas` with every default.
    pub fn with_replicas(replicas: Vec<String>) -> Self {
        GatewayConfig {
            listen: default_listen(),
            admin_listen: default_admin_listen(),
            replicas,
            session_header: default_session_header(),
            model: ModelConfig::default(),
            health: HealthConfig::default(),
            index: IndexConfig::default(),
            upstream: UpstreamConfig::default(),
            policy: PolicyConfig::default(),
            policy_file: None,
            embedded_policy: None,
        }
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let c: GatewayConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut v = Validator::new();
        v.check(
            !self.replicas.is_empty(),
            "replicas",
            "[]",
            "list at least one replica",
        );
        v.check(
            self.replicas.len() <= 64,
            "replicas",
            self.replicas.len(),
            "at most 64 replicas",
        );
        for (i, r) in self.replicas.iter().enumerate() {
            let ok = r
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            v.check(
                ok,
                &format!("replicas[{i}]"),
                format!("{r:?}"),
                "must be host:port",
            );
        }
        v.check(
            (1..=1024).contains(&self.model.block_size),
            "model.block_size",
            self.model.block_size,
            "must be between 1 and 1024 and equal the replicas' block size",
        );
        v.check(
            !self.model.name.is_empty(),
            "model.name",
            "\"\"",
            "must not be empty",
        );
        v.check(
            self.health.interval_ms >= 10,
            "health.interval_ms",
            self.health.interval_ms,
            "must be at least 10",
        );
        v.check(
            self.health.failures_to_eject >= 1,
            "health.failures_to_eject",
            self.health.failures_to_eject,
            "must be at least 1",
        );
        v.check(
            self.health.successes_to_readmit >= 1,
            "health.successes_to_readmit",
            self.health.successes_to_readmit,
            "must be at least 1",
        );
        v.check(
            self.upstream.max_body_bytes >= 1024,
            "upstream.max_body_bytes",
            self.upstream.max_body_bytes,
            "must be at least 1024",
        );
        v.check(
            self.upstream.retries <= 8,
            "upstream.retries",
            self.upstream.retries,
            "must be at most 8",
        );
        v.check(
            self.upstream.load_poll_ms >= 10,
            "upstream.load_poll_ms",
            self.upstream.load_poll_ms,
            "must be at least 10",
        );
        v.finish()?;
        self.policy.validate("policy")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_file_gets_defaults() {
        let c = GatewayConfig::from_toml("replicas = [\"127.0.0.1:8001\"]").unwrap();
        assert_eq!(c.upstream.max_body_bytes, 8 << 20);
        assert_eq!(c.policy.kind(), "prefix_aware");
        assert_eq!(c.model.block_size, 16);
    }

    #[test]
    fn reports_every_bad_field() {
        let e = GatewayConfig::from_toml(
            "replicas = [\"nohost\", \"a:0\"]\n[model]\nblock_size = 0\n[upstream]\nretries = 99",
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "replicas[0]",
            "replicas[1]",
            "model.block_size = 0",
            "upstream.retries = 99",
        ] {
            assert!(e.contains(needle), "{needle} in {e}");
        }
    }
}
