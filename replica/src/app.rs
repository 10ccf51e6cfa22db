//! Assembling a replica: profiles → roofline → scheduler and backend → engine task → HTTP
//! server. [`build_server`] takes an already-bound listener (tests bind port 0) and returns a
//! server to run; the `kvgate replica` command only parses flags into a [`ReplicaConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use protocol::hashing::DEFAULT_BLOCK_SIZE;
use protocol::tokenizer::TextTokenizer;
use tokio::net::TcpListener;

use crate::backend::BackendKind;
use crate::engine::{Engine, EngineHandle};
use crate::kv_hub::KvEventHub;
use crate::metrics::ReplicaMetrics;
use crate::profiles::{self, ModelProfile};
use crate::roofline::{KvDtype, Roofline, DEFAULT_GPU_MEMORY_UTILIZATION};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sim::{SimBackend, CORPUS};

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub replica_id: String,
    pub backend: BackendKind,
    /// Built-in profile name or path to a HF `config.json`.
    pub model: String,
    /// Name clients use in `model`; defaults to the profile's name.
    pub served_model_name: Option<String>,
    pub gpu: String,
    pub tokenizer_dir: PathBuf,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: Option<usize>,
    pub gpu_memory_utilization: f64,
    pub num_gpu_blocks: Option<usize>,
    pub kv_cache_dtype: KvDtype,
    pub enable_prefix_caching: bool,
    pub compute_efficiency: f64,
    pub bandwidth_efficiency: f64,
    /// Multiplies every modelled step time (1.0 = real time).
    pub time_scale: f64,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// The fleet token: required for the internal endpoints (`/kv_events`, `/flush_cache`,
    /// `/tokenize`, `/detokenize`), which are refused altogether without one.
    pub fleet_token: Option<String>,
    /// Also require the fleet token on `/v1/*`, so clients cannot go around the gateway.
    pub restrict_api: bool,
    /// On shutdown: how long requests in progress may finish.
    pub drain_timeout: Duration,
}

impl ReplicaConfig {
    pub fn new(tokenizer_dir: PathBuf) -> Self {
        ReplicaConfig {
            replica_id: "replica-0".into(),
            backend: BackendKind::Sim,
            model: "qwen3-8b".into(),
            served_model_name: None,
            gpu: "h100".into(),
            tokenizer_dir,
            block_size: DEFAULT_BLOCK_SIZE,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            num_gpu_blocks: None,
            kv_cache_dtype: KvDtype::Auto,
            enable_prefix_caching: true,
            compute_efficiency: crate::roofline::DEFAULT_COMPUTE_EFFICIENCY,
            bandwidth_efficiency: crate::roofline::DEFAULT_BANDWIDTH_EFFICIENCY,
            time_scale: 1.0,
            max_body_bytes: 64 << 20,
            fleet_token: None,
            restrict_api: false,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Profile(#[from] profiles::ProfileError),
    #[error("cannot load the tokenizer from {dir}: {reason}")]
    Tokenizer { dir: String, reason: String },
    #[error("the `{0}` backend is not built yet; use `--backend sim`")]
    BackendUnavailable(&'static str),
    #[error("invalid setting: {0}")]
    Invalid(String),
    #[error("cannot read the listener's address: {0}")]
    Io(#[from] std::io::Error),
}

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
    pub created: u64,
    /// The replica's own estimate of its prefill throughput (tokens/s) at full chunks: the
    /// gateway's admission starts from it (`prefill_tokens_per_s` in `/server_info`).
    pub prefill_tokens_per_s: Option<f64>,
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
}

pub struct ReplicaServer {
    listener: TcpListener,
    state: Arc<AppState>,
    drain_timeout: Duration,
}

impl ReplicaServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then drains: stops accepting, lets requests in
    /// progress finish (up to the drain timeout) and closes every connection.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        crate::server::serve(self.listener, self.state, shutdown, self.drain_timeout).await;
    }

    /// Serves until `shutdown` resolves, then closes every connection at once, as if the
    /// process had died (tests of failure handling).
    pub async fn run_until_killed(self, shutdown: impl std::future::Future<Output = ()>) {
        crate::server::serve(self.listener, self.state, shutdown, Duration::ZERO).await;
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Builds the engine and the HTTP server on `listener`; spawns the engine task.
pub async fn build_server(
    cfg: ReplicaConfig,
    listener: TcpListener,
) -> Result<ReplicaServer, BuildError> {
    match cfg.backend {
        BackendKind::Sim => {}
        BackendKind::Cpu => return Err(BuildError::BackendUnavailable("cpu")),
        BackendKind::Cuda => return Err(BuildError::BackendUnavailable("cuda")),
    }
    if cfg.restrict_api && cfg.fleet_token.is_none() {
        return Err(BuildError::Invalid(
            "restricting /v1/* to the fleet needs a fleet token (--fleet-token-file or KVGATE_FLEET_TOKEN)".into(),
        ));
    }
    if cfg.block_size == 0 || cfg.max_num_seqs == 0 || cfg.max_num_batched_tokens == 0 {
        return Err(BuildError::Invalid(
            "block size, max_num_seqs and max_num_batched_tokens must be positive".into(),
        ));
    }
    if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
        return Err(BuildError::Invalid(format!(
            "gpu memory utilisation must be in (0, 1], got {}",
            cfg.gpu_memory_utilization
        )));
    }
    if !(cfg.time_scale >= 0.0 && cfg.time_scale.is_finite()) {
        return Err(BuildError::Invalid(format!(
            "time scale must be a non-negative number, got {}",
            cfg.time_scale
        )));
    }
    let gpu = profiles::gpu(&cfg.gpu)?;
    let model = ModelProfile::resolve(&cfg.model)?;
    let mut roofline = Roofline::new(gpu, model.clone(), cfg.kv_cache_dtype);
    roofline.compute_efficiency = cfg.compute_efficiency;
    roofline.bandwidth_efficiency = cfg.bandwidth_efficiency;

    let dir = cfg.tokenizer_dir.clone();
    let tokenizer = tokio::task::spawn_blocking(move || TextTokenizer::from_dir(&dir))
        .await
        .map_err(|e| BuildError::Invalid(e.to_string()))?
        .map_err(|e| BuildError::Tokenizer {
            dir: cfg.tokenizer_dir.display().to_string(),
            reason: e.to_string(),
        })?;
    let tokenizer = Arc::new(tokenizer);

    if cfg.num_gpu_blocks == Some(0) {
        return Err(BuildError::Invalid(
            "--num-gpu-blocks must be at least 1".into(),
        ));
    }
    let capacity_tokens = roofline.kv_capacity_tokens(cfg.gpu_memory_utilization) as usize;
    let num_blocks = cfg
        .num_gpu_blocks
        .unwrap_or(capacity_tokens / cfg.block_size);
    if num_blocks == 0 {
        return Err(BuildError::Invalid(format!(
            "no KV cache fits: {} does not leave room for any block on {} at utilisation {}",
            model.name, cfg.gpu, cfg.gpu_memory_utilization
        )));
    }
    let native = model.max_position_embeddings as usize;
    let wanted = cfg.max_model_len.unwrap_or(native);
    let max_model_len = wanted.min(num_blocks * cfg.block_size);
    if max_model_len < wanted {
        tracing::warn!(
            wanted,
            max_model_len,
            "max model length clamped to the KV cache's capacity"
        );
    }
    if max_model_len > native {
        tracing::warn!(
            max_model_len,
            native,
            "max model length exceeds the model's native context (max_position_embeddings)"
        );
    }
    let sched_cfg = SchedulerConfig {
        block_size: cfg.block_size,
        num_blocks,
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_model_len,
        enable_prefix_caching: cfg.enable_prefix_caching,
    };
    let corpus = tokenizer
        .encode(CORPUS, false)
        .map_err(|e| BuildError::Invalid(e.to_string()))?;
    // One full chunk of a 2k-token prompt, as modelled, stretched by the time scale.
    let chunk = cfg.max_num_batched_tokens.min(2048) as u64;
    let chunk_s = roofline
        .step_cost(&[crate::roofline::WorkItem {
            context: 2048u64.saturating_sub(chunk),
            new_tokens: chunk,
            samples: true,
        }])
        .seconds
        * cfg.time_scale;
    let prefill_tokens_per_s = (chunk_s > 0.0).then(|| chunk as f64 / chunk_s);
    let backend = SimBackend::new(roofline, corpus, tokenizer.eos_token_id(), cfg.time_scale);
    let metrics = Arc::new(ReplicaMetrics::new(&cfg.replica_id));
    let hub = Arc::new(KvEventHub::new(cfg.block_size));
    let (engine, handle) = Engine::new(
        Scheduler::new(sched_cfg),
        Box::new(backend),
        hub.clone(),
        metrics.clone(),
    );
    tokio::spawn(engine.run());
    let upkeep = Arc::downgrade(&metrics);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            match upkeep.upgrade() {
                Some(m) => m.upkeep(),
                None => return,
            }
        }
    });
    let info = ReplicaInfo {
        replica_id: cfg.replica_id.clone(),
        served_model_name: cfg.served_model_name.clone().unwrap_or(model.name.clone()),
        model_profile: model.name.clone(),
        gpu: cfg.gpu.clone(),
        backend: "sim",
        tokenizer_dir: cfg.tokenizer_dir.display().to_string(),
        block_size: cfg.block_size,
        num_blocks,
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_model_len,
        kv_cache_dtype: match cfg.kv_cache_dtype {
            KvDtype::Auto => "auto",
            KvDtype::Fp8 => "fp8",
        },
        enable_prefix_caching: cfg.enable_prefix_caching,
        created: unix_now(),
        prefill_tokens_per_s,
    };
    let replica_header = HeaderValue::from_str(&cfg.replica_id).map_err(|_| {
        BuildError::Invalid(format!(
            "replica id `{}` is not a valid header value",
            cfg.replica_id
        ))
    })?;
    tracing::info!(
        replica = %info.replica_id,
        model = %info.served_model_name,
        gpu = %info.gpu,
        num_blocks,
        max_model_len,
        "replica ready"
    );
    Ok(ReplicaServer {
        listener,
        drain_timeout: cfg.drain_timeout,
        state: Arc::new(AppState {
            fleet_token: cfg.fleet_token.clone(),
            restrict_api: cfg.restrict_api,
            info,
            tokenizer,
            engine: handle,
            hub,
            metrics,
            replica_header,
            max_body_bytes: cfg.max_body_bytes,
        }),
    })
}
