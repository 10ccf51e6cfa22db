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

use crate::fleet::split_engine_tables;
pub use crate::fleet::{
    normalize_replica, replica_list, Backend, DiscoveryConfig, EngineSpec, MAX_REPLICAS,
};

use crate::error::ConfigError;
pub use crate::models::ModelConfig;
use crate::policy::PolicyConfig;

mod reload;
mod validate;

/// What one client connection may cost the gateway: deadlines for the request header and body,
/// the header's size, the number of open connections, tokeniser concurrency and the drain.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DownstreamConfig {
    /// From a request's first byte to the end of its header.
    #[serde(default = "default_header_timeout")]
    pub header_timeout_ms: u64,
    /// From the end of the header to the end of the body.
    #[serde(default = "default_body_timeout")]
    pub body_timeout_ms: u64,
    /// How long an idle kept-alive connection is held open.
    #[serde(default = "default_keepalive")]
    pub keepalive_timeout_s: u64,
    /// Largest request header (431 with an OpenAI error body beyond).
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Most header lines in one request (431 beyond).
    #[serde(default = "default_max_headers")]
    pub max_headers: usize,
    /// Open client connections at most; beyond it new ones get a 503 and are closed at once.
    /// Clamped to fit the process's open-file limit (each request also holds an upstream
    /// connection).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Prompts tokenised at once (0: one per CPU core).
    #[serde(default)]
    pub tokenize_concurrency: usize,
    /// Longest wait for a tokeniser slot before the request is shed with 429 (0: no timer; a
    /// request waits while the queue has room).
    #[serde(default)]
    pub tokenize_queue_timeout_ms: u64,
    /// Requests that may wait for a tokeniser at once (429 `tokenizer_busy` beyond).
    #[serde(default = "default_tokenize_queue")]
    pub tokenize_queue_max: usize,
    /// Bodies of waiting requests held at most, MiB (429 `tokenizer_busy` beyond).
    #[serde(default = "default_tokenize_queue_mib")]
    pub tokenize_queue_max_mib: usize,
    /// Prompt tokens of one request at most, summed over a batched prompt list.
    #[serde(default = "default_max_request_prompt_tokens")]
    pub max_request_prompt_tokens: usize,
    /// Memory for the chat tokeniser's segment cache (token ids of messages seen before, per
    /// tenant), MiB. It fills with distinct messages and then stays at this size; a
    /// conversation's turns are re-tokenised from it rather than from text.
    #[serde(default = "default_tokenizer_cache_mib")]
    pub tokenizer_cache_mib: usize,
    /// On SIGTERM: how long in-flight requests may finish before the gateway exits anyway.
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_s: u64,
    /// Also answer `GET /metrics` on the API port (load clients such as aiperf look for
    /// Prometheus metrics on the URL they test). Off by default: the admin port serves them.
    #[serde(default)]
    pub metrics_on_api_port: bool,
}

impl Default for DownstreamConfig {
    fn default() -> Self {
        DownstreamConfig {
            header_timeout_ms: default_header_timeout(),
            body_timeout_ms: default_body_timeout(),
            keepalive_timeout_s: default_keepalive(),
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            max_connections: default_max_connections(),
            tokenize_concurrency: 0,
            tokenize_queue_timeout_ms: 0,
            tokenize_queue_max: default_tokenize_queue(),
            tokenize_queue_max_mib: default_tokenize_queue_mib(),
            max_request_prompt_tokens: default_max_request_prompt_tokens(),
            tokenizer_cache_mib: default_tokenizer_cache_mib(),
            drain_timeout_s: default_drain_timeout(),
            metrics_on_api_port: false,
        }
    }
}

/// Secrets: the admin token (bearer token for the admin port), the fleet token (sent to
/// replicas, which refuse their internal endpoints without it) and the client API keys. Each
/// secret comes from a file or an environment variable, never from this file itself; the
/// environment wins.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// File holding the admin token (env `KVGATE_ADMIN_TOKEN`). Required when `admin_listen`
    /// is not a loopback address.
    #[serde(default)]
    pub admin_token_file: Option<String>,
    /// File holding the fleet token (env `KVGATE_FLEET_TOKEN`).
    #[serde(default)]
    pub fleet_token_file: Option<String>,
    /// Client API keys (TOML, hot-reloaded; see `config/api_keys.toml`). Env `KVGATE_API_KEYS`
    /// (`key=tenant:interactive+batch,...`) adds keys. No keys at all: the API is open.
    #[serde(default)]
    pub api_keys_file: Option<String>,
    /// The admin token handed over by a program (`kvgate up`, tests); wins over the rest.
    #[serde(skip)]
    pub admin_token: Option<String>,
    /// The fleet token handed over by a program; wins over the rest.
    #[serde(skip)]
    pub fleet_token: Option<String>,
}

/// How much of each request the access log records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AccessLogMode {
    #[default]
    Off,
    /// A `sample` share of requests, plus every request that did not end in 200.
    Sampled,
    Full,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    #[serde(default)]
    pub mode: AccessLogMode,
    /// Share of successful requests logged in `sampled` mode.
    #[serde(default = "default_sample")]
    pub sample: f64,
    /// File to append JSON lines to; `-` for standard output.
    #[serde(default = "default_access_path")]
    pub path: String,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        AccessLogConfig {
            mode: AccessLogMode::Off,
            sample: default_sample(),
            path: default_access_path(),
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
    /// Outlier detection (as Envoy's): unusable answers in a row (a 5xx, a body that is not
    /// JSON, a stream that is not SSE or breaks its promises, a stall) that eject a replica.
    #[serde(default = "default_outlier_errors")]
    pub outlier_consecutive_errors: u32,
    /// How long an outlier stays ejected the first time; each further ejection adds as much
    /// again, up to `outlier_max_ejection_ms`. Health checks readmit it only after that.
    #[serde(default = "default_outlier_ejection")]
    pub outlier_ejection_ms: u64,
    #[serde(default = "default_outlier_max_ejection")]
    pub outlier_max_ejection_ms: u64,
    /// Most of the listed replicas outlier detection may hold out at once (one always may).
    #[serde(default = "default_outlier_percent")]
    pub outlier_max_ejected_percent: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_ms: default_health_interval(),
            timeout_ms: default_health_timeout(),
            failures_to_eject: default_failures(),
            successes_to_readmit: default_successes(),
            outlier_consecutive_errors: default_outlier_errors(),
            outlier_ejection_ms: default_outlier_ejection(),
            outlier_max_ejection_ms: default_outlier_max_ejection(),
            outlier_max_ejected_percent: default_outlier_percent(),
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
    /// Blocks a replica's KV events may hold in the index while it has not reported its cache
    /// size; once it has (`max_total_num_tokens`), its cap is that size plus a quarter. Past
    /// the cap the oldest are dropped and the overflow is counted: a publisher that never
    /// removes cannot grow the gateway's memory without bound.
    #[serde(default = "default_max_blocks")]
    pub max_blocks_per_replica: usize,
    /// `/ready` answers 503 after start until every healthy replica's KV events are followed
    /// (its cached blocks replayed into the index), for at most this many seconds: a gateway
    /// restarted under load joins its peers only once it routes as well as they do.
    #[serde(default = "default_ready_wait")]
    pub ready_wait_s: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            kv_events: true,
            approx_ttl_s: default_approx_ttl(),
            speculative_ttl_s: default_spec_ttl(),
            approx_capacity_blocks: default_approx_capacity(),
            max_blocks_per_replica: default_max_blocks(),
            ready_wait_s: default_ready_wait(),
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
    /// Longest pause within an unstreamed answer's body (and any other body a replica sends)
    /// once its head arrived: past it the answer is given up on (504, retried elsewhere).
    #[serde(default = "default_body_idle")]
    pub body_idle_timeout_ms: u64,
    /// Largest unstreamed answer held (502 past it).
    #[serde(default = "default_response_limit")]
    pub max_response_bytes: usize,
    /// Largest stream relayed: a replica that keeps sending is cut off with an error event.
    #[serde(default = "default_stream_limit")]
    pub max_stream_bytes: u64,
    /// Token events a stream may send past the request's `max_tokens` (times `n`) before it
    /// is cut off (some engines send a last event or two without new tokens).
    #[serde(default = "default_token_slack")]
    pub stream_token_slack: u64,
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
            body_idle_timeout_ms: default_body_idle(),
            max_response_bytes: default_response_limit(),
            max_stream_bytes: default_stream_limit(),
            stream_token_slack: default_token_slack(),
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
    /// `host:port` of each replica (names are re-resolved each health check). May be empty
    /// when `discovery.dns` finds the fleet.
    #[serde(default)]
    pub replicas: Vec<String>,
    /// Fleet membership from DNS: one replica per address a name resolves to.
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    /// The other gateways of the fleet: one admission budget across them (`crate::peers`).
    #[serde(default)]
    pub peers: crate::peers::PeersConfig,
    /// What the replicas cost: the live cost-per-million-tokens gauge (`crate::cost`).
    #[serde(default)]
    pub cost: crate::cost::CostConfig,
    /// Tokenizer and chat-template drift checks (`crate::drift`).
    #[serde(default)]
    pub drift: crate::drift::DriftConfig,
    /// The Batch API and its database (`crate::batch`).
    #[serde(default)]
    pub batch: crate::batch::BatchConfig,
    /// Replicas given as tables in `replicas` (`{ addr, backend, kv_events, kv_replay }`):
    /// their engine and where it publishes KV events. The table's `addr` is in `replicas`.
    #[serde(skip)]
    pub engines: Vec<EngineSpec>,
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// The one model served, over every replica (`crate::models`).
    #[serde(default)]
    pub model: ModelConfig,
    /// Several models, each over its own replicas; replaces `[model]` when given.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub index: IndexConfig,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    #[serde(default)]
    pub downstream: DownstreamConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub access_log: AccessLogConfig,
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
    /// The file this configuration was read from: its replica list is reloaded on SIGHUP and
    /// when it changes.
    #[serde(skip)]
    pub config_path: Option<std::path::PathBuf>,
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
fn default_ready_wait() -> u64 {
    30
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
fn default_body_idle() -> u64 {
    10_000
}
fn default_response_limit() -> usize {
    32 << 20
}
fn default_stream_limit() -> u64 {
    256 << 20
}
fn default_token_slack() -> u64 {
    16
}
fn default_outlier_errors() -> u32 {
    5
}
fn default_outlier_ejection() -> u64 {
    30_000
}
fn default_outlier_max_ejection() -> u64 {
    300_000
}
fn default_outlier_percent() -> u32 {
    50
}
fn default_max_blocks() -> usize {
    1 << 20
}
fn default_header_timeout() -> u64 {
    10_000
}
fn default_body_timeout() -> u64 {
    30_000
}
fn default_keepalive() -> u64 {
    60
}
fn default_max_header_bytes() -> usize {
    32 << 10
}
fn default_max_headers() -> usize {
    100
}
fn default_max_connections() -> usize {
    8192
}
fn default_tokenize_queue() -> usize {
    1024
}
fn default_tokenize_queue_mib() -> usize {
    256
}
fn default_tokenizer_cache_mib() -> usize {
    8
}
fn default_max_request_prompt_tokens() -> usize {
    262_144
}
fn default_drain_timeout() -> u64 {
    30
}
fn default_sample() -> f64 {
    0.01
}
fn default_access_path() -> String {
    "-".into()
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
            replicas: replicas.iter().map(|r| normalize_replica(r)).collect(),
            discovery: DiscoveryConfig::default(),
            peers: crate::peers::PeersConfig::default(),
            cost: crate::cost::CostConfig::default(),
            drift: crate::drift::DriftConfig::default(),
            batch: crate::batch::BatchConfig::default(),
            engines: Vec::new(),
            session_header: default_session_header(),
            model: ModelConfig::default(),
            models: Vec::new(),
            health: HealthConfig::default(),
            index: IndexConfig::default(),
            upstream: UpstreamConfig::default(),
            downstream: DownstreamConfig::default(),
            auth: AuthConfig::default(),
            access_log: AccessLogConfig::default(),
            policy: PolicyConfig::default(),
            policy_file: None,
            embedded_policy: None,
            config_path: None,
        }
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let engines = split_engine_tables(&mut table)?;
        let mut c: GatewayConfig = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        c.engines = engines;
        c.normalize_replicas();
        c.resolve_adapters();
        c.validate()?;
        Ok(c)
    }

    /// Accepts `http://host:port` (and a trailing `/`) for a replica as `host:port`; kvgate
    /// speaks plain HTTP to replicas, so `https://` stays as written and fails validation.
    pub fn normalize_replicas(&mut self) {
        for r in &mut self.replicas {
            *r = normalize_replica(r);
        }
        // Prices by replica name the replicas as the list does.
        let prices = std::mem::take(&mut self.cost.replica_hour_usd);
        self.cost.replica_hour_usd = prices
            .into_iter()
            .map(|(k, v)| (normalize_replica(&k), v))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_urls_are_accepted_and_tls_is_refused_clearly() {
        let c = GatewayConfig::from_toml("replicas = [\"http://127.0.0.1:8001/\", \"r2:8002\"]")
            .unwrap();
        assert_eq!(c.replicas, ["127.0.0.1:8001", "r2:8002"]);
        let e = GatewayConfig::from_toml("replicas = [\"https://10.0.0.1:8001\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("TLS to replicas is not supported"), "{e}");
        let e = GatewayConfig::from_toml("replicas = [\"a:1\", \"http://a:1\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("listed twice"), "{e}");
    }

    #[test]
    fn listen_addresses_must_be_host_and_port() {
        for bad in ["not-an-addr", "127.0.0.1:99999", ":8080"] {
            let e = GatewayConfig::from_toml(&format!(
                "listen = {bad:?}\nreplicas = [\"127.0.0.1:8001\"]"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("listen") && e.contains("host:port"),
                "{bad}: {e}"
            );
        }
        assert!(
            GatewayConfig::from_toml("listen = \"[::1]:0\"\nreplicas = [\"127.0.0.1:8001\"]")
                .is_ok()
        );
    }

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

    #[test]
    fn discovery_names_may_stand_in_for_the_list() {
        let c = GatewayConfig::from_toml("[discovery]\ndns = [\"replicas.svc:8000\"]").unwrap();
        assert!(c.replicas.is_empty());
        assert_eq!(c.discovery.every_s, 10);
        let e = GatewayConfig::from_toml("[discovery]\ndns = [\"nope\"]\nevery_s = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("discovery.dns[0]"), "{e}");
        assert!(e.contains("discovery.every_s"), "{e}");
        let e = GatewayConfig::from_toml("").unwrap_err().to_string();
        assert!(e.contains("or name them through discovery.dns"), "{e}");
    }

    #[test]
    fn replicas_may_be_tables_naming_their_engine() {
        let c = GatewayConfig::from_toml(
            r#"replicas = ["127.0.0.1:8001", { addr = "http://10.0.0.5:8000/", backend = "vllm", kv_events = "tcp://10.0.0.5:5557", kv_replay = "tcp://10.0.0.5:5558" }]"#,
        )
        .unwrap();
        assert_eq!(c.replicas, ["127.0.0.1:8001", "10.0.0.5:8000"]);
        assert_eq!(c.engines.len(), 1);
        assert_eq!(c.engines[0].addr, "10.0.0.5:8000");
        assert_eq!(c.engines[0].backend, Backend::Vllm);
        assert_eq!(
            c.engines[0].kv_replay.as_deref(),
            Some("tcp://10.0.0.5:5558")
        );
        let e = GatewayConfig::from_toml(
            r#"replicas = [{ addr = "a:1", backend = "vllm", kv_events = "10.0.0.5:5557" }, { addr = "b:1", kv_events = "tcp://b:2" }, { addr = "c:1", backend = "trt" }]"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("replicas[2]"), "{e}");
        let e = GatewayConfig::from_toml(
            r#"replicas = [{ addr = "a:1", backend = "vllm", kv_events = "10.0.0.5:5557" }, { addr = "b:1", kv_replay = "tcp://b:2" }, { addr = "c:1", kv_events = "tcp://*:5557" }]"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("must be tcp://host:port"), "{e}");
        assert!(e.contains("needs kv_events"), "{e}");
        assert!(e.contains("replicas[c:1].kv_events"), "{e}");
    }
}
