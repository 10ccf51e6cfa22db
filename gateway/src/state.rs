//! The composition root of the request path: [`GatewayState`] owns every part the gateway's
//! requests share — the prepare stage's tokenisers, the prefix index's view, the fleet, the
//! hot-reloaded policies and keys, lifecycle, access log and limits — and hands each stage
//! only its share ([`GatewayState::placer`], [`GatewayState::admitter`],
//! [`GatewayState::forwarder`], [`GatewayState::membership`]). No stage holds the whole; this
//! is the only `impl GatewayState`.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::access_log::AccessLog;
use crate::fleet::client::UpstreamLimits;
use crate::fleet::discovery::Discovery;
use crate::fleet::registry::Registry;
use crate::http::auth::ApiKeyStore;
use crate::lifecycle::Lifecycle;
use crate::membership::{GatewayFile, Membership};
use crate::metrics::GatewayMetrics;
use crate::models::Catalog;
use crate::peers::Peers;
use crate::prefix::view::PrefixView;
use crate::request::admit::Admitter;
use crate::request::forward::Forwarder;
use crate::request::place::Placer;
use crate::request::prepare::Tokenizers;
use crate::routes::store::{ActivePolicy, PolicyStore};
use config::ModelConfig;

/// The context limit used until a replica reports its own.
pub const FALLBACK_MODEL_LEN: usize = 131_072;

pub struct GatewayState {
    /// The served models, each with its preparer (parse, tokenise, hash); reloaded with the
    /// gateway file (`membership.rs`).
    pub models: ArcSwap<Catalog>,
    /// The prepare stage's bounded tokeniser slots, shared by the models.
    pub tokenizers: Tokenizers,
    /// The request path's questions to the prefix index.
    pub prefix: PrefixView,
    /// The replicas.
    pub fleet: Arc<Registry>,
    pub metrics: Arc<GatewayMetrics>,
    /// Routes, SLOs and admission thresholds (hot-reloaded).
    pub policies: PolicyStore,
    /// Client API keys (hot-reloaded).
    pub keys: ApiKeyStore,
    /// Bearer token of the admin port.
    pub admin_token: Option<String>,
    pub lifecycle: Arc<Lifecycle>,
    pub access_log: AccessLog,
    pub max_body_bytes: usize,
    /// From the end of the request header to the end of its body.
    pub body_timeout: Duration,
    pub upstream: UpstreamLimits,
    pub session_header: String,
    pub max_request_prompt_tokens: usize,
    /// Serialises admission decisions with their reservations (`request/admit.rs`).
    pub dispatch_lock: parking_lot::Mutex<()>,
    /// `GET /metrics` is also answered on the API port.
    pub metrics_on_api_port: bool,
    /// Where the fleet comes from: the listed replicas and the DNS names (`membership.rs`).
    pub discovery: Discovery,
    /// The gateway file and the hash of its text last seen, for replica-list reloads.
    pub gateway_file: Option<GatewayFile>,
    /// The fleet's other gateways, sharing the admission budget (`peers.rs`).
    pub peers: Peers,
    /// Longest `/ready` waits after start for the replicas' KV events (`index.ready_wait_s`).
    pub ready_wait: Duration,
    /// The Batch API's database and settings (`None`: off).
    pub batch: Option<Arc<crate::batch::Batches>>,
}

impl GatewayState {
    /// Longest prompt the model at `model` in `active` takes: its entry's setting (`cfg`),
    /// else the smallest its replicas reported, else [`FALLBACK_MODEL_LEN`].
    pub fn model_limit(&self, cfg: &ModelConfig, active: &ActivePolicy, model: usize) -> usize {
        cfg.max_model_len
            .or_else(|| {
                self.fleet
                    .max_model_len_among(active.model_pool(model))
                    .map(|n| n as usize)
            })
            .unwrap_or(FALLBACK_MODEL_LEN)
    }

    /// `/ready`: 503 while draining, with no healthy replica, or (for at most `ready_wait`
    /// after start) while a healthy replica's KV events are not followed yet — a gateway whose
    /// index is still filling would route worse than its peers.
    pub fn readiness(&self) -> (u16, serde_json::Value) {
        let healthy = self.fleet.healthy_count();
        let (warm, expected) = self.fleet.events_warm();
        let warming = warm < expected && self.lifecycle.started.elapsed() < self.ready_wait;
        let status = match (self.lifecycle.is_draining(), healthy, warming) {
            (true, _, _) => "draining",
            (_, 0, _) => "no healthy replica",
            (_, _, true) => "warming",
            _ => "ready",
        };
        let body = serde_json::json!({
            "status": status,
            "healthy_replicas": healthy,
            "kv_events_followed": warm,
            "kv_events_expected": expected,
        });
        (if status == "ready" { 200 } else { 503 }, body)
    }

    /// Placement's share: the fleet and the prefix index.
    pub fn placer(&self) -> Placer<'_> {
        Placer {
            fleet: &self.fleet,
            prefix: &self.prefix,
        }
    }

    /// The admit stage's share: placement and the dispatch lock.
    pub fn admitter(&self) -> Admitter<'_> {
        Admitter {
            placer: self.placer(),
            lock: &self.dispatch_lock,
        }
    }

    /// The forward stage's share: the fleet, the prefix index, metrics, the drain, the limits.
    pub fn forwarder(&self) -> Forwarder<'_> {
        Forwarder {
            fleet: &self.fleet,
            prefix: &self.prefix,
            metrics: &self.metrics,
            lifecycle: &self.lifecycle,
            limits: self.upstream,
        }
    }

    /// Fleet membership's share: the fleet, discovery, the policies' pools, the gateway file.
    pub fn membership(&self) -> Membership<'_> {
        Membership {
            fleet: &self.fleet,
            discovery: &self.discovery,
            policies: &self.policies,
            gateway_file: self.gateway_file.as_ref(),
            metrics: &self.metrics,
            models: &self.models,
        }
    }
}
