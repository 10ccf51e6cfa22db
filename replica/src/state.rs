//! What every request handler shares: the replica's static facts ([`ReplicaInfo`]) and the
//! handles to its tokenizer, engine, KV-event hub and metrics ([`AppState`]). Its own module so
//! that assembly (`app`) and serving (`server`, `api`, `info`) both depend on it, not on each
//! other.

use std::sync::Arc;

use http::HeaderValue;
use protocol::tokenizer::TextTokenizer;

use crate::engine::EngineHandle;
use crate::kv_hub::KvEventHub;
use crate::metrics::ReplicaMetrics;

/// Static facts about the replica that endpoints report.
#[derive(Debug, Clone)]
pub struct ReplicaInfo {
    pub replica_id: String,
    pub served_model_name: String,
    pub model_profile: String,
    pub gpu: String,
    pub backend: &'static str,
    pub tokenizer_dir: String,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub kv_cache_dtype: &'static str,
    pub enable_prefix_caching: bool,
    /// The scheduler holds back a prompt whose prefix another request is computing.
    pub waits_for_prefix_in_flight: bool,
    pub created: u64,
    /// The replica's own estimate of its prefill throughput (tokens/s) at full chunks: the
    /// gateway's admission starts from it (`prefill_tokens_per_s` in `/server_info`).
    pub prefill_tokens_per_s: Option<f64>,
    /// `sim` only: what, besides the GPU and model profiles, sets its step times (`roofline`
    /// in `/server_info`), so a benchmark can price an idle replica exactly.
    pub sim_timing: Option<SimTiming>,
}

/// The sim backend's roofline knobs and time scale.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SimTiming {
    pub compute_efficiency: f64,
    pub bandwidth_efficiency: f64,
    pub time_scale: f64,
}

/// Everything a request handler needs.
pub struct AppState {
    pub info: ReplicaInfo,
    pub tokenizer: Arc<TextTokenizer>,
    pub engine: EngineHandle,
    pub hub: Arc<KvEventHub>,
    pub metrics: Arc<ReplicaMetrics>,
    pub replica_header: HeaderValue,
    pub max_body_bytes: usize,
    pub fleet_token: Option<String>,
    pub restrict_api: bool,
    /// `--api-key`: required on /v1/* (the fleet token is accepted too).
    pub api_key: Option<String>,
    /// Tokens that end generation (the model's EOS and end-of-turn ids).
    pub stop_token_ids: Vec<u32>,
}
