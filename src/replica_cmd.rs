//! `kvgate replica` and `kvgate capacity`: the engine's arguments turned into a validated
//! [`ReplicaConfig`] and served until Ctrl-C or SIGTERM (or, under `kvgate up`, until standard
//! input closes); the roofline a named model and GPU make, and its capacity note.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use replica::backend::BackendKind;
use replica::capacity::capacity_note;
use replica::profiles::{self, ModelProfile};
use replica::roofline::{KvDtype, Roofline};
use replica::ReplicaConfig;

use crate::signals::shutdown_signal;
use crate::up;

#[derive(Args)]
pub struct ModelArgs {
    /// sim: a built-in profile (qwen3-8b, llama-3.1-8b, mistral-7b, llama-3.1-70b-tp4) or a
    /// HF config.json; the default, qwen3-8b, is the sim's. cpu and cuda: a GGUF file or a
    /// Hugging Face folder; left at the default, they take the fetched SmolLM2-135M-Instruct
    /// GGUF.
    #[arg(long, default_value = "qwen3-8b")]
    pub model: String,
    /// GPU profile: h100, h200, a100, l4.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// KV cache element type: auto (the model's: bf16 on sim, f16 on cpu and cuda) or fp8
    /// (E4M3; fp8_e5m2 is priced alike on sim and stored as E4M3 on cpu).
    #[arg(long = "kv-dtype", alias = "kv-cache-dtype", default_value = "auto")]
    pub kv_dtype: String,
    /// Fraction of GPU memory the engine may use.
    #[arg(long, default_value_t = replica::roofline::DEFAULT_GPU_MEMORY_UTILIZATION)]
    pub gpu_memory_utilization: f64,
    /// Achieved fraction of peak bf16 FLOP/s (prefill).
    #[arg(long, default_value_t = replica::roofline::DEFAULT_COMPUTE_EFFICIENCY)]
    pub compute_efficiency: f64,
    /// Achieved fraction of peak HBM bandwidth (decode).
    #[arg(long, default_value_t = replica::roofline::DEFAULT_BANDWIDTH_EFFICIENCY)]
    pub bandwidth_efficiency: f64,
}

#[derive(Args)]
pub struct ReplicaArgs {
    /// Engine backend: sim (the real scheduler, roofline-timed steps), cpu (a real Llama
    /// model from a GGUF file or Hugging Face folder given by --model) or cuda (the same model
    /// on the first visible NVIDIA GPU; KV cache sized by --gpu-memory-utilization unless
    /// --num-gpu-blocks is given).
    #[arg(long, default_value = "sim")]
    pub backend: String,
    /// cpu backend: compute threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// cpu backend: KV cache size in MiB (unless --num-gpu-blocks is given); resident memory
    /// grows as blocks are first used.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_mib: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8001)]
    pub port: u16,
    /// Folder with tokenizer.json and tokenizer_config.json, or a GGUF file (default: the
    /// model's own for --backend cpu and cuda, models/qwen3 for sim).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Model name clients send; defaults to the profile's name (sim) or the file's (cpu, cuda).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Identifier in the x-kvgate-replica header and metrics (default: replica-<port>).
    #[arg(long)]
    pub replica_id: Option<String>,
    #[arg(long, default_value_t = protocol::hashing::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (chunked prefill slices prompts to fit it).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Prompt tokens a request prefills per step at most while a more important one (a lower
    /// body `priority`, e.g. interactive work beside kvgate's batch route) is present, so
    /// interactive arrivals wait little behind it (0: no cap).
    #[arg(long, default_value_t = 256)]
    pub background_chunk_tokens: usize,
    /// Longest prompt + completion in tokens (default: the model's native context, capped by the KV cache).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Exactly this many KV blocks, instead of what --gpu-memory-utilization leaves (sim, cuda)
    /// or --kv-cache-mib holds (cpu).
    #[arg(long)]
    pub num_gpu_blocks: Option<usize>,
    /// Turn prefix caching off (every prompt is prefilled in full).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Compute a prompt's prefix again beside the request already computing it, as vLLM does,
    /// instead of waiting for it (the gateway then holds such prompts back itself).
    #[arg(long)]
    pub no_prefix_wait: bool,
    /// Multiply every modelled step time (sim only; 1.0 = real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// File holding the fleet token (env KVGATE_FLEET_TOKEN wins). Without one, the internal
    /// endpoints (/kv_events, /flush_cache, /tokenize, /detokenize) are refused.
    #[arg(long)]
    pub fleet_token_file: Option<PathBuf>,
    /// Require the fleet token on /v1/* too, so clients cannot go around the gateway.
    #[arg(long)]
    pub restrict_api: bool,
    /// Require this API key on /v1/* (as vLLM's --api-key; env KVGATE_API_KEY). The fleet
    /// token is accepted too, so a gateway in front still gets through.
    #[arg(long, env = "KVGATE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Also publish KV events over ZMQ in vLLM's wire format on this endpoint
    /// (e.g. tcp://*:5557), for routers that follow vLLM's events.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// The replay (ROUTER) endpoint for --kv-events (e.g. tcp://*:5558).
    #[arg(long)]
    pub kv_events_replay: Option<String>,
    /// On SIGTERM: seconds requests in progress may take to finish.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Exit when standard input closes (used by `kvgate up`, so replicas never outlive it).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
}

#[derive(Args)]
pub struct CapacityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Average tokens of context per sequence (prompt plus output).
    #[arg(long, default_value_t = 2300)]
    pub context: u64,
    /// Price of one GPU-hour, for cost per million tokens.
    #[arg(long)]
    pub gpu_hour_usd: Option<f64>,
}

pub fn roofline(m: &ModelArgs) -> Result<Roofline> {
    let kv = KvDtype::parse(&m.kv_dtype)
        .ok_or_else(|| anyhow!("--kv-dtype must be auto or fp8, got `{}`", m.kv_dtype))?;
    let mut r = Roofline::new(profiles::gpu(&m.gpu)?, ModelProfile::resolve(&m.model)?, kv);
    r.compute_efficiency = m.compute_efficiency;
    r.bandwidth_efficiency = m.bandwidth_efficiency;
    Ok(r)
}

pub async fn run_replica(a: ReplicaArgs) -> Result<()> {
    let backend = BackendKind::parse(&a.backend)
        .ok_or_else(|| anyhow!("--backend must be sim, cpu or cuda, got `{}`", a.backend))?;
    if backend == BackendKind::Cuda {
        // Before anything else is said or loaded: no GPU is a one-line refusal.
        up::cuda_available()?;
    }
    let mut model = a.model.model.clone();
    let real = matches!(backend, BackendKind::Cpu | BackendKind::Cuda);
    if real && !std::path::Path::new(&model).exists() {
        if model != "qwen3-8b" {
            bail!("--model {model}: no such file or folder (the {} backend takes a GGUF file or a Hugging Face folder)", a.backend);
        }
        model = up::default_model_file()
            .ok_or_else(|| {
                anyhow!("no model given and the default ({}) is missing: run scripts/fetch-models.sh or pass --model FILE", up::DEFAULT_MODEL_FILE)
            })?
            .display()
            .to_string();
    }
    let tokenizer_dir = match (a.tokenizer, backend) {
        (Some(d), _) => d,
        (None, BackendKind::Cpu | BackendKind::Cuda) => PathBuf::from(&model),
        (None, _) => protocol::tokenizer::default_tokenizer_dir().ok_or_else(|| {
            anyhow!("no tokenizer found: run scripts/fetch-models.sh or pass --tokenizer DIR")
        })?,
    };
    let kv = KvDtype::parse(&a.model.kv_dtype)
        .ok_or_else(|| anyhow!("--kv-dtype must be auto or fp8, got `{}`", a.model.kv_dtype))?;
    let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    let port = listener.local_addr()?.port();
    let mut cfg = ReplicaConfig::new(tokenizer_dir);
    cfg.replica_id = a.replica_id.unwrap_or_else(|| format!("replica-{port}"));
    cfg.backend = backend;
    cfg.model = model;
    cfg.threads = a.threads;
    cfg.kv_cache_mib = a.kv_cache_mib;
    cfg.served_model_name = a.served_model_name;
    cfg.gpu = a.model.gpu;
    cfg.block_size = a.block_size;
    cfg.max_num_seqs = a.max_num_seqs;
    cfg.max_num_batched_tokens = a.max_num_batched_tokens;
    cfg.background_chunk_tokens = a.background_chunk_tokens;
    cfg.max_model_len = a.max_model_len;
    cfg.gpu_memory_utilization = a.model.gpu_memory_utilization;
    cfg.num_gpu_blocks = a.num_gpu_blocks;
    cfg.kv_cache_dtype = kv;
    cfg.enable_prefix_caching = !a.no_prefix_caching;
    cfg.wait_for_prefix_in_flight = !a.no_prefix_wait;
    cfg.compute_efficiency = a.model.compute_efficiency;
    cfg.bandwidth_efficiency = a.model.bandwidth_efficiency;
    cfg.time_scale = a.time_scale;
    cfg.fleet_token = gateway::http::auth::read_secret(
        gateway::http::auth::FLEET_TOKEN_ENV,
        a.fleet_token_file.as_ref().and_then(|p| p.to_str()),
    )
    .map_err(|e| anyhow!(e))?;
    cfg.restrict_api = a.restrict_api;
    cfg.api_key = a.api_key.filter(|k| !k.is_empty());
    cfg.kv_events_zmq = a.kv_events;
    cfg.kv_events_replay = a.kv_events_replay;
    cfg.drain_timeout = std::time::Duration::from_secs(a.drain_timeout_s);
    if cfg.fleet_token.is_none() {
        if cfg.kv_events_zmq.is_some() {
            tracing::warn!(
                "no fleet token (KVGATE_FLEET_TOKEN or --fleet-token-file): /kv_events, \
                 /flush_cache, /tokenize and /detokenize are refused; KV events still go out over \
                 ZMQ (--kv-events), which has no authentication of its own"
            );
        } else {
            tracing::warn!(
                "no fleet token (KVGATE_FLEET_TOKEN or --fleet-token-file): /kv_events, \
                 /flush_cache, /tokenize and /detokenize are refused, so a gateway routes without \
                 KV events"
            );
        }
    }
    let server = replica::build_server(cfg, listener).await?;
    let addr = server.local_addr();
    let info = server.state().info.clone();
    println!(
        "kvgate replica {} serving {} ({} on {}, {} KV blocks of {} tokens) at http://{addr}",
        info.replica_id,
        info.served_model_name,
        info.backend,
        info.gpu,
        info.num_blocks,
        info.block_size
    );
    let stdin_closed = async move {
        if a.exit_with_stdin {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 64];
            let mut stdin = tokio::io::stdin();
            while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        } else {
            std::future::pending::<()>().await;
        }
    };
    server
        .run(async {
            tokio::select! {
                _ = shutdown_signal() => {}
                _ = stdin_closed => {}
            }
        })
        .await;
    Ok(())
}

/// `kvgate capacity`: the capacity note for a model on a GPU.
pub fn run_capacity(a: CapacityArgs) -> Result<()> {
    if a.context == 0 {
        bail!("--context must be positive");
    }
    let r = roofline(&a.model)?;
    let note = capacity_note(
        &r,
        a.context,
        a.model.gpu_memory_utilization,
        a.gpu_hour_usd,
    );
    print!("{}", note.render());
    Ok(())
}
