//! What the gateway's request path shares: the router, the upstream client, the hot-reloaded
//! policies and keys, lifecycle, access log and limits ([`GatewayState`]). Its own module so
//! that the HTTP layer (`proxy`) and admission (`dispatch`) both depend on it, not on each
//! other; their methods on it live with them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::access_log::AccessLog;
use crate::auth::ApiKeyStore;
use crate::lifecycle::Lifecycle;
use crate::policy_store::PolicyStore;
use crate::registry::HttpClient;
use crate::router::Router;

/// The context limit used until a replica reports its own.
pub const FALLBACK_MODEL_LEN: usize = 131_072;

pub struct GatewayState {
    pub router: Router,
    pub client: HttpClient,
    pub max_body_bytes: usize,
    /// From the end of the request header to the end of its body.
    pub body_timeout: Duration,
    pub retries: u32,
    pub retry_backoff: Duration,
    pub first_byte_timeout: Duration,
    pub session_header: String,
    /// Routes, SLOs and admission thresholds (hot-reloaded).
    pub policies: PolicyStore,
    /// Client API keys (hot-reloaded).
    pub keys: ApiKeyStore,
    /// Bearer token of the admin port.
    pub admin_token: Option<String>,
    pub lifecycle: Arc<Lifecycle>,
    pub access_log: AccessLog,
    /// Prompts being tokenised at once.
    pub tokenize_slots: Arc<Semaphore>,
    pub tokenize_wait: Duration,
    pub max_request_prompt_tokens: usize,
    /// `model.max_model_len` from the gateway file.
    pub model_len_override: Option<usize>,
    /// Serialises admission decisions with their reservations (`dispatch.rs`).
    pub dispatch_lock: parking_lot::Mutex<()>,
    /// `GET /metrics` is also answered on the API port.
    pub metrics_on_api_port: bool,
    /// Where the fleet comes from: the listed replicas and the DNS names (`fleet.rs`).
    pub discovery: crate::discovery::Discovery,
    /// The gateway file and the hash of its text last seen, for replica-list reloads.
    pub gateway_file: Option<(std::path::PathBuf, parking_lot::Mutex<Option<u64>>)>,
}

impl GatewayState {
    /// Counts a request refused for its credentials on `port` (`api` or `admin`).
    pub(crate) fn auth_failed(&self, port: &'static str) {
        self.router
            .metrics
            .counter("kvgate_gateway_auth_failures_total", &[("port", port)])
            .increment(1);
    }
}
