//! Assembling a replica: profiles → roofline → scheduler and backend → engine task → HTTP
//! server. [`build_server`] takes an already-bound listener (tests bind port 0) and returns a
//! server to run; the `kvgate replica` command only parses flags into a [`ReplicaConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use protocol::hashing::DEFAULT_BLOCK_SIZE;
use protocol::time::unix_now;
use protocol::tokenizer::TextTokenizer;
use tokio::net::TcpListener;

use crate::backend::{BackendKind, EngineBackend};
use crate::cpu::CpuBackend;
use crate::engine::Engine;
use crate::kv_hub::KvEventHub;
use crate::metrics::ReplicaMetrics;
use crate::model::{LlamaWeights, LoadOptions};
use crate::profiles::{self, ModelProfile};
use crate::roofline::{KvDtype, Roofline, DEFAULT_GPU_MEMORY_UTILIZATION};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sim::{SimBackend, CORPUS};
pub use crate::state::{AppState, ReplicaInfo};

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub replica_id: String,
    pub backend: BackendKind,
    /// `sim`: built-in profile name or path to a HF `config.json`. `cpu`: the model — a GGUF
    /// file, or a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).
    pub model: String,
    /// Name clients use in `model`; defaults to the profile's name.
    pub served_model_name: Option<String>,
    pub gpu: String,
    /// Tokenizer: a folder with `tokenizer.json`, or a GGUF file (its metadata).
    pub tokenizer_dir: PathBuf,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Prompt tokens a request prefills per step at most while a more important one is present.
    pub background_chunk_tokens: usize,
    pub max_model_len: Option<usize>,
    pub gpu_memory_utilization: f64,
    pub num_gpu_blocks: Option<usize>,
    pub kv_cache_dtype: KvDtype,
    pub enable_prefix_caching: bool,
    /// A prompt whose prefix another request is computing waits for it (the scheduler's
    /// `wait_for_prefix_in_flight`); off, the engine computes it again beside it, as vLLM does.
    pub wait_for_prefix_in_flight: bool,
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
    /// An API key required on `/v1/*` (vLLM's `--api-key`); the fleet token is accepted too.
    pub api_key: Option<String>,
    /// On shutdown: how long requests in progress may finish.
    pub drain_timeout: Duration,
    /// `cpu` backend: compute threads (default: every core).
    pub threads: Option<usize>,
    /// `cpu` backend: KV cache size when `num_gpu_blocks` is not set.
    pub kv_cache_mib: usize,
    /// Also publish KV events over ZMQ in vLLM's format (`tcp://*:5557`).
    pub kv_events_zmq: Option<String>,
    /// The replay (ROUTER) endpoint for those events.
    pub kv_events_replay: Option<String>,
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
            background_chunk_tokens: 256,
            max_model_len: None,
            gpu_memory_utilization: DEFAULT_GPU_MEMORY_UTILIZATION,
            num_gpu_blocks: None,
            kv_cache_dtype: KvDtype::Auto,
            enable_prefix_caching: true,
            wait_for_prefix_in_flight: true,
            compute_efficiency: crate::roofline::DEFAULT_COMPUTE_EFFICIENCY,
            bandwidth_efficiency: crate::roofline::DEFAULT_BANDWIDTH_EFFICIENCY,
            time_scale: 1.0,
            max_body_bytes: 64 << 20,
            fleet_token: None,
            restrict_api: false,
            api_key: None,
            drain_timeout: Duration::from_secs(30),
            threads: None,
            kv_cache_mib: 512,
            kv_events_zmq: None,
            kv_events_replay: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Profile(#[from] profiles::ProfileError),
    #[error("cannot load the tokenizer from {dir}: {reason}")]
    Tokenizer { dir: String, reason: String },
    #[error("cannot load the model: {0}")]
    Model(String),
    #[error("{0}")]
    BackendUnavailable(String),
    #[error("invalid setting: {0}")]
    Invalid(String),
    #[error("cannot read the listener's address: {0}")]
    Io(#[from] std::io::Error),
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

/// What a backend brings to the common assembly.
struct BackendParts {
    backend: Box<dyn EngineBackend>,
    tokenizer: Arc<TextTokenizer>,
    num_blocks: usize,
    max_model_len: usize,
    prefill_tokens_per_s: Option<f64>,
    served_model_name: String,
    model_profile: String,
    device: String,
    kv_cache_dtype: &'static str,
    stop_token_ids: Vec<u32>,
}

async fn load_tokenizer(path: &std::path::Path) -> Result<Arc<TextTokenizer>, BuildError> {
    let p = path.to_path_buf();
    let tokenizer = tokio::task::spawn_blocking(move || TextTokenizer::from_path(&p))
        .await
        .map_err(|e| BuildError::Invalid(e.to_string()))?
        .map_err(|e| BuildError::Tokenizer {
            dir: path.display().to_string(),
            reason: e.to_string(),
        })?;
    Ok(Arc::new(tokenizer))
}

/// The sim: roofline-timed steps for a named model profile and GPU.
async fn sim_parts(cfg: &ReplicaConfig) -> Result<BackendParts, BuildError> {
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
    let tokenizer = load_tokenizer(&cfg.tokenizer_dir).await?;

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
    let max_model_len = context_limit(cfg, model.max_position_embeddings as usize, num_blocks);
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
    let stop_token_ids = tokenizer.eos_token_id().into_iter().collect();
    let backend = SimBackend::new(roofline, corpus, tokenizer.eos_token_id(), cfg.time_scale);
    Ok(BackendParts {
        backend: Box::new(backend),
        tokenizer,
        num_blocks,
        max_model_len,
        prefill_tokens_per_s,
        served_model_name: cfg.served_model_name.clone().unwrap_or(model.name.clone()),
        model_profile: model.name.clone(),
        device: cfg.gpu.clone(),
        kv_cache_dtype: match cfg.kv_cache_dtype {
            KvDtype::Auto => "auto",
            KvDtype::Fp8 => "fp8",
        },
        stop_token_ids,
    })
}

/// The model's context, capped by the KV cache.
fn context_limit(cfg: &ReplicaConfig, native: usize, num_blocks: usize) -> usize {
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
            "max model length exceeds the model's native context"
        );
    }
    max_model_len
}

/// A real model's files, loaded for the `cpu` or `cuda` backend.
struct RealModel {
    path: PathBuf,
    weights: Arc<LlamaWeights>,
    tokenizer: Arc<TextTokenizer>,
    stop_token_ids: Vec<u32>,
    /// The served name when none is given: the file's stem.
    stem: String,
    /// The KV cache's element type, as `/server_info` names it.
    kv_cache_dtype: &'static str,
}

impl RealModel {
    /// The parts a real-model backend serves with.
    fn into_parts(
        self,
        cfg: &ReplicaConfig,
        backend: Box<dyn EngineBackend>,
        num_blocks: usize,
        max_model_len: usize,
        prefill_tokens_per_s: f64,
        device: String,
    ) -> BackendParts {
        BackendParts {
            backend,
            tokenizer: self.tokenizer,
            num_blocks,
            max_model_len,
            prefill_tokens_per_s: Some(prefill_tokens_per_s),
            served_model_name: cfg.served_model_name.clone().unwrap_or(self.stem),
            model_profile: format!("llama ({})", self.path.display()),
            device,
            kv_cache_dtype: self.kv_cache_dtype,
            stop_token_ids: self.stop_token_ids,
        }
    }
}

/// Weights from `cfg.model` (a GGUF file or a Hugging Face folder), the tokenizer, and the
/// tokens that end a turn.
async fn load_real_model(cfg: &ReplicaConfig) -> Result<RealModel, BuildError> {
    let path = PathBuf::from(&cfg.model);
    let p = path.clone();
    let weights =
        tokio::task::spawn_blocking(move || LlamaWeights::load(&p, LoadOptions::default()))
            .await
            .map_err(|e| BuildError::Invalid(e.to_string()))?
            .map_err(|e| BuildError::Model(e.to_string()))?;
    let weights = Arc::new(weights);
    let tokenizer = load_tokenizer(&cfg.tokenizer_dir).await?;
    if tokenizer.vocab_size() > weights.config.vocab_size {
        return Err(BuildError::Invalid(format!(
            "the tokenizer at {} has {} tokens but the model has {} embeddings: they do not belong together",
            cfg.tokenizer_dir.display(),
            tokenizer.vocab_size(),
            weights.config.vocab_size
        )));
    }
    let stop_token_ids = if path.is_file() {
        protocol::gguf::GgufHeader::open(&path)
            .map(|h| protocol::gguf_tokenizer::stop_token_ids(&h))
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let stop_token_ids = if stop_token_ids.is_empty() {
        tokenizer.eos_token_id().into_iter().collect()
    } else {
        stop_token_ids
    };
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    Ok(RealModel {
        path,
        weights,
        tokenizer,
        stop_token_ids,
        stem,
        kv_cache_dtype: kernels::KvElement::F16.name(),
    })
}

/// The real model on CPU.
async fn cpu_parts(cfg: &ReplicaConfig) -> Result<BackendParts, BuildError> {
    let mut model = load_real_model(cfg).await?;
    let (path, weights) = (model.path.clone(), model.weights.clone());
    let elem = match cfg.kv_cache_dtype {
        KvDtype::Auto => kernels::KvElement::F16,
        KvDtype::Fp8 => kernels::KvElement::Fp8E4m3,
    };
    model.kv_cache_dtype = elem.name();
    let per_token = CpuBackend::kv_bytes_per_token(&weights, elem);
    let num_blocks = match cfg.num_gpu_blocks {
        Some(n) => n,
        None => (cfg.kv_cache_mib << 20) / (per_token * cfg.block_size),
    };
    if num_blocks == 0 {
        return Err(BuildError::Invalid(format!(
            "--kv-cache-mib {} holds no {}-token block ({} bytes per token)",
            cfg.kv_cache_mib, cfg.block_size, per_token
        )));
    }
    let max_model_len = context_limit(cfg, weights.config.max_position, num_blocks);
    let threads = cfg.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let mut backend =
        CpuBackend::with_kv_element(weights.clone(), cfg.block_size, num_blocks, threads, elem)
            .map_err(|e| BuildError::Invalid(e.to_string()))?;
    // Time one prefill chunk (and fault the weights in) before serving.
    let probe = cfg.max_num_batched_tokens.min(256);
    let (backend, rate) = tokio::task::spawn_blocking(move || {
        let rate = backend.measure_prefill(probe);
        (backend, rate)
    })
    .await
    .map_err(|e| BuildError::Invalid(e.to_string()))?;
    tracing::info!(
        model = %path.display(),
        weights_mib = weights.bytes() >> 20,
        kv_cache_mib = (num_blocks * cfg.block_size * per_token) >> 20,
        kv_blocks = num_blocks,
        kv_bytes_per_token = per_token,
        kv_cache_dtype = elem.name(),
        threads,
        prefill_tokens_per_s = rate.round(),
        "cpu backend loaded"
    );
    Ok(model.into_parts(
        cfg,
        Box::new(backend),
        num_blocks,
        max_model_len,
        rate,
        format!("{threads} threads"),
    ))
}

/// The real model on an NVIDIA GPU (feature `cuda`).
#[cfg(feature = "gpu")]
async fn cuda_parts(cfg: &ReplicaConfig) -> Result<BackendParts, BuildError> {
    use crate::cuda::{CudaBackend, KvBlocks};
    // Before anything touches CUDA: no driver or no GPU is a one-line refusal.
    crate::cuda::probe()
        .map_err(|e| BuildError::BackendUnavailable(format!("--backend cuda: {e}")))?;
    if cfg.kv_cache_dtype != KvDtype::Auto {
        return Err(BuildError::Invalid(
            "--kv-dtype fp8 is not implemented on the cuda backend yet (the cpu backend has it)"
                .into(),
        ));
    }
    if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
        return Err(BuildError::Invalid(format!(
            "--gpu-memory-utilization must be in (0, 1], got {}",
            cfg.gpu_memory_utilization
        )));
    }
    let model = load_real_model(cfg).await?;
    let (path, weights) = (model.path.clone(), model.weights.clone());
    let blocks = match cfg.num_gpu_blocks {
        Some(n) => KvBlocks::Count(n),
        None => KvBlocks::MemoryFraction(cfg.gpu_memory_utilization),
    };
    let (block_size, tokens, seqs) = (cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs);
    let probe = tokens.min(512);
    let w = weights.clone();
    let (backend, rate) = tokio::task::spawn_blocking(move || {
        let mut b = CudaBackend::new(0, &w, block_size, blocks, tokens, seqs)?;
        let rate = b.measure_prefill(probe)?;
        Ok::<_, kernels::gpu::GpuError>((b, rate))
    })
    .await
    .map_err(|e| BuildError::Invalid(e.to_string()))?
    .map_err(|e| BuildError::BackendUnavailable(format!("--backend cuda: {e}")))?;
    let num_blocks = backend.num_blocks();
    let max_model_len = context_limit(cfg, weights.config.max_position, num_blocks);
    let device = backend.device_name().to_string();
    if let Ok(m) = backend.memory() {
        tracing::info!(
            model = %path.display(),
            device = %device,
            weights_mib = m.weights >> 20,
            kv_cache_mib = m.kv_cache >> 20,
            num_blocks,
            prefill_tokens_per_s = rate.round(),
            "cuda backend loaded"
        );
    }
    Ok(model.into_parts(
        cfg,
        Box::new(backend),
        num_blocks,
        max_model_len,
        rate,
        device,
    ))
}

/// This build has no CUDA support: `--backend cuda` is refused in one line.
#[cfg(not(feature = "gpu"))]
async fn cuda_parts(_cfg: &ReplicaConfig) -> Result<BackendParts, BuildError> {
    Err(BuildError::BackendUnavailable(
        "--backend cuda: this kvgate was built without CUDA support; rebuild with `cargo build --release --features cuda` (CUDA 13) or `--features cuda12`".into(),
    ))
}

/// Builds the engine and the HTTP server on `listener`; spawns the engine task.
pub async fn build_server(
    cfg: ReplicaConfig,
    listener: TcpListener,
) -> Result<ReplicaServer, BuildError> {
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
    if cfg.num_gpu_blocks == Some(0) {
        return Err(BuildError::Invalid(
            "--num-gpu-blocks must be at least 1".into(),
        ));
    }
    let parts = match cfg.backend {
        BackendKind::Sim => sim_parts(&cfg).await?,
        BackendKind::Cpu => cpu_parts(&cfg).await?,
        BackendKind::Cuda => cuda_parts(&cfg).await?,
    };
    let BackendParts {
        backend,
        tokenizer,
        num_blocks,
        max_model_len,
        prefill_tokens_per_s,
        served_model_name,
        model_profile,
        device,
        kv_cache_dtype,
        stop_token_ids,
    } = parts;
    let backend_name = backend.name();
    let sched_cfg = SchedulerConfig {
        block_size: cfg.block_size,
        num_blocks,
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_model_len,
        enable_prefix_caching: cfg.enable_prefix_caching,
        wait_for_prefix_in_flight: cfg.wait_for_prefix_in_flight,
        background_chunk_tokens: cfg.background_chunk_tokens,
    };
    let metrics = Arc::new(ReplicaMetrics::new(&cfg.replica_id));
    let hub = Arc::new(KvEventHub::new(cfg.block_size));
    if let Some(endpoint) = &cfg.kv_events_zmq {
        crate::zmq_publisher::start(hub.clone(), endpoint, cfg.kv_events_replay.as_deref())
            .await
            .map_err(BuildError::Invalid)?;
    } else if cfg.kv_events_replay.is_some() {
        return Err(BuildError::Invalid(
            "--kv-events-replay needs --kv-events".into(),
        ));
    }
    let (engine, handle) = Engine::new(
        Scheduler::new(sched_cfg),
        backend,
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
        served_model_name,
        model_profile,
        gpu: device,
        backend: backend_name,
        tokenizer_dir: tokenizer.dir().display().to_string(),
        block_size: cfg.block_size,
        num_blocks,
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_model_len,
        kv_cache_dtype,
        enable_prefix_caching: cfg.enable_prefix_caching,
        waits_for_prefix_in_flight: cfg.enable_prefix_caching && cfg.wait_for_prefix_in_flight,
        created: unix_now(),
        prefill_tokens_per_s,
        sim_timing: matches!(cfg.backend, BackendKind::Sim).then_some(crate::state::SimTiming {
            compute_efficiency: cfg.compute_efficiency,
            bandwidth_efficiency: cfg.bandwidth_efficiency,
            time_scale: cfg.time_scale,
        }),
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
        device = %info.gpu,
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
            api_key: cfg.api_key.clone(),
            stop_token_ids,
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
