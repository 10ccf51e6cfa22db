//! The `kvgate` binary: argument parsing and wiring only. Each subcommand hands a validated
//! configuration to its crate.

mod bench;
mod floor;
mod up;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use bench::{run_bench, BenchArgs};
use clap::{Args, Parser, Subcommand};
use replica::backend::BackendKind;
use replica::capacity::capacity_note;
use replica::profiles::{self, ModelProfile};
use replica::roofline::{KvDtype, Roofline};
use replica::ReplicaConfig;

#[derive(Parser)]
#[command(
    name = "kvgate",
    version,
    about = "Prefix-aware LLM gateway with a co-located engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an OpenAI-compatible engine replica.
    Replica(ReplicaArgs),
    /// Print the capacity note for a model on a GPU (cache per token, knee, cost).
    Capacity(CapacityArgs),
    /// Run the prefix-aware gateway in front of running replicas.
    Gateway(GatewayArgs),
    /// Start a gateway and its replicas (sim, cpu or cuda) on free ports, on the default model
    /// files.
    Up(up::UpArgs),
    /// Write a GGUF file's tokenizer as tokenizer.json + tokenizer_config.json (for tools that
    /// want a tokenizer folder; kvgate itself reads the GGUF file directly).
    ExportTokenizer(ExportTokenizerArgs),
    /// Open-loop load test of OpenAI endpoints: rate sweeps, several targets interleaved, goodput
    /// against an SLO, oracle hit ratio, JSON + Markdown report and plots.
    Bench(BenchArgs),
}

#[derive(Args)]
struct ExportTokenizerArgs {
    /// The GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// Folder to write tokenizer.json and tokenizer_config.json into (created if needed).
    #[arg(long)]
    out: PathBuf,
}

fn run_export_tokenizer(a: ExportTokenizerArgs) -> Result<()> {
    let header = protocol::gguf::GgufHeader::open(&a.model)?;
    let (tokenizer, config) = protocol::gguf_tokenizer::tokenizer_files(&header)?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    for (name, doc) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
    ] {
        let path = a.out.join(name);
        std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    // Prove the folder loads and agrees with the file before saying so.
    let from_dir = protocol::tokenizer::TextTokenizer::from_dir(&a.out)?;
    let from_file = protocol::tokenizer::TextTokenizer::from_gguf(&a.model)?;
    let probe = "Hello, world! 12345 <|im_start|>user";
    if from_dir.encode(probe, true)? != from_file.encode(probe, true)? {
        bail!("the exported tokenizer does not encode like the GGUF file's");
    }
    println!(
        "wrote {} and {} ({} tokens)",
        a.out.join("tokenizer.json").display(),
        a.out.join("tokenizer_config.json").display(),
        from_dir.vocab_size()
    );
    Ok(())
}

#[derive(Args)]
struct GatewayArgs {
    /// The gateway file (see config/gateway.toml).
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
    /// Validate the gateway file, the policy file, the API key file and the secrets, print
    /// what would run, and exit (non-zero when something is wrong).
    #[arg(long)]
    check: bool,
}

#[derive(Args)]
struct ModelArgs {
    /// sim: a built-in profile (qwen3-8b, llama-3.1-8b, mistral-7b, llama-3.1-70b-tp4) or a
    /// HF config.json. cpu and cuda: a GGUF file or a Hugging Face folder (default: the
    /// fetched SmolLM2-135M-Instruct GGUF).
    #[arg(long, default_value = "qwen3-8b")]
    model: String,
    /// GPU profile: h100, h200, a100, l4.
    #[arg(long, default_value = "h100")]
    gpu: String,
    /// KV cache element type: auto (bf16) or fp8.
    #[arg(long = "kv-dtype", alias = "kv-cache-dtype", default_value = "auto")]
    kv_dtype: String,
    /// Fraction of GPU memory the engine may use.
    #[arg(long, default_value_t = replica::roofline::DEFAULT_GPU_MEMORY_UTILIZATION)]
    gpu_memory_utilization: f64,
    /// Achieved fraction of peak bf16 FLOP/s (prefill).
    #[arg(long, default_value_t = replica::roofline::DEFAULT_COMPUTE_EFFICIENCY)]
    compute_efficiency: f64,
    /// Achieved fraction of peak HBM bandwidth (decode).
    #[arg(long, default_value_t = replica::roofline::DEFAULT_BANDWIDTH_EFFICIENCY)]
    bandwidth_efficiency: f64,
}

#[derive(Args)]
struct ReplicaArgs {
    /// Engine backend: sim (the real scheduler, roofline-timed steps), cpu (a real Llama
    /// model from a GGUF file or Hugging Face folder given by --model) or cuda (the same model
    /// on the first visible NVIDIA GPU; KV cache sized by --gpu-memory-utilization unless
    /// --num-gpu-blocks is given).
    #[arg(long, default_value = "sim")]
    backend: String,
    /// cpu backend: compute threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// cpu backend: KV cache size in MiB (unless --num-gpu-blocks is given); resident memory
    /// grows as blocks are first used.
    #[arg(long, default_value_t = 512)]
    kv_cache_mib: usize,
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// Folder with tokenizer.json and tokenizer_config.json, or a GGUF file (default: the
    /// model's own for --backend cpu and cuda, models/qwen3 for sim).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer: Option<PathBuf>,
    /// Model name clients send; defaults to the profile's name (sim) or the file's (cpu, cuda).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Identifier in the x-kvgate-replica header and metrics (default: replica-<port>).
    #[arg(long)]
    replica_id: Option<String>,
    #[arg(long, default_value_t = protocol::hashing::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Token budget of one engine step (chunked prefill slices prompts to fit it).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Longest prompt + completion in tokens (default: the model's native context, capped by the KV cache).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Exactly this many KV blocks, instead of what --gpu-memory-utilization leaves (sim, cuda)
    /// or --kv-cache-mib holds (cpu).
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// Turn prefix caching off (every prompt is prefilled in full).
    #[arg(long)]
    no_prefix_caching: bool,
    /// Multiply every modelled step time (sim only; 1.0 = real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// File holding the fleet token (env KVGATE_FLEET_TOKEN wins). Without one, the internal
    /// endpoints (/kv_events, /flush_cache, /tokenize, /detokenize) are refused.
    #[arg(long)]
    fleet_token_file: Option<PathBuf>,
    /// Require the fleet token on /v1/* too, so clients cannot go around the gateway.
    #[arg(long)]
    restrict_api: bool,
    /// Require this API key on /v1/* (as vLLM's --api-key; env KVGATE_API_KEY). The fleet
    /// token is accepted too, so a gateway in front still gets through.
    #[arg(long, env = "KVGATE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Also publish KV events over ZMQ in vLLM's wire format on this endpoint
    /// (e.g. tcp://*:5557), for routers that follow vLLM's events.
    #[arg(long)]
    kv_events: Option<String>,
    /// The replay (ROUTER) endpoint for --kv-events (e.g. tcp://*:5558).
    #[arg(long)]
    kv_events_replay: Option<String>,
    /// On SIGTERM: seconds requests in progress may take to finish.
    #[arg(long, default_value_t = 30)]
    drain_timeout_s: u64,
    /// Exit when standard input closes (used by `kvgate up`, so replicas never outlive it).
    #[arg(long, hide = true)]
    exit_with_stdin: bool,
}

#[derive(Args)]
struct CapacityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Average tokens of context per sequence (prompt plus output).
    #[arg(long, default_value_t = 2300)]
    context: u64,
    /// Price of one GPU-hour, for cost per million tokens.
    #[arg(long)]
    gpu_hour_usd: Option<f64>,
}

fn roofline(m: &ModelArgs) -> Result<Roofline> {
    let kv = KvDtype::parse(&m.kv_dtype)
        .ok_or_else(|| anyhow!("--kv-dtype must be auto or fp8, got `{}`", m.kv_dtype))?;
    let mut r = Roofline::new(profiles::gpu(&m.gpu)?, ModelProfile::resolve(&m.model)?, kv);
    r.compute_efficiency = m.compute_efficiency;
    r.bandwidth_efficiency = m.bandwidth_efficiency;
    Ok(r)
}

async fn run_replica(a: ReplicaArgs) -> Result<()> {
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
    cfg.max_model_len = a.max_model_len;
    cfg.gpu_memory_utilization = a.model.gpu_memory_utilization;
    cfg.num_gpu_blocks = a.num_gpu_blocks;
    cfg.kv_cache_dtype = kv;
    cfg.enable_prefix_caching = !a.no_prefix_caching;
    cfg.compute_efficiency = a.model.compute_efficiency;
    cfg.bandwidth_efficiency = a.model.bandwidth_efficiency;
    cfg.time_scale = a.time_scale;
    cfg.fleet_token = gateway::auth::read_secret(
        gateway::auth::FLEET_TOKEN_ENV,
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

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Reads the gateway file; paths in it are relative to its folder.
fn load_gateway_file(path: &std::path::Path) -> Result<config::GatewayConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut cfg = config::GatewayConfig::from_toml(&text)
        .with_context(|| format!("invalid gateway file {}", path.display()))?;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let rel = |p: &Option<String>| p.as_ref().map(|p| dir.join(p).display().to_string());
    cfg.policy_file = rel(&cfg.policy_file);
    cfg.auth.api_keys_file = rel(&cfg.auth.api_keys_file);
    cfg.auth.admin_token_file = rel(&cfg.auth.admin_token_file);
    cfg.auth.fleet_token_file = rel(&cfg.auth.fleet_token_file);
    cfg.config_path = Some(path.to_path_buf());
    Ok(cfg)
}

/// `kvgate gateway --check`: everything `kvgate gateway` would load, validated, nothing bound.
fn check_gateway(path: &std::path::Path) -> Result<()> {
    let cfg = load_gateway_file(path)?;
    // The tokenizer, as the gateway will load it (a relative folder is taken from the working
    // directory the gateway starts in).
    let dir = match &cfg.model.tokenizer_dir {
        Some(d) => PathBuf::from(d),
        None => protocol::tokenizer::default_tokenizer_dir().ok_or_else(|| {
            anyhow!("no tokenizer folder configured or found (model.tokenizer_dir)")
        })?,
    };
    protocol::tokenizer::TextTokenizer::from_path(&dir).map_err(|e| {
        anyhow!(
            "model.tokenizer_dir {} (from {}): {e}",
            dir.display(),
            std::env::current_dir().map_or("?".into(), |d| d.display().to_string())
        )
    })?;
    if cfg.discovery.dns.is_empty() {
        println!("{}: ok ({} replicas)", path.display(), cfg.replicas.len());
    } else {
        println!(
            "{}: ok ({} listed replicas, and every address of {} every {} s; the gateway refuses \
             to start if these find none)",
            path.display(),
            cfg.replicas.len(),
            cfg.discovery.dns.join(", "),
            cfg.discovery.every_s
        );
    }
    match &cfg.policy_file {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("cannot read {p}"))?;
            let f = config::PolicyFile::from_toml(&text, &cfg.replicas)
                .with_context(|| format!("invalid policy file {p}"))?;
            let names: Vec<&str> = f.routes.iter().map(|r| r.name.as_str()).collect();
            println!("{p}: ok (routes: {})", names.join(", "));
        }
        None => println!("no policy file: one catch-all route with [policy]"),
    }
    let keys = gateway::auth::ApiKeyStore::new(cfg.auth.api_keys_file.as_ref().map(PathBuf::from))
        .map_err(|e| anyhow!(e))?;
    if keys.is_open() {
        println!("API keys: none (the API is open to anyone who can reach it)");
    } else {
        println!("API keys: {} keys", keys.count());
    }
    let admin = gateway::auth::read_secret(
        gateway::auth::ADMIN_TOKEN_ENV,
        cfg.auth.admin_token_file.as_deref(),
    )
    .map_err(|e| anyhow!(e))?;
    if admin.is_none() && !gateway::auth::is_loopback(&cfg.admin_listen) {
        bail!(
            "admin_listen {} is not loopback and there is no admin token ({} or auth.admin_token_file)",
            cfg.admin_listen,
            gateway::auth::ADMIN_TOKEN_ENV
        );
    }
    let fleet = gateway::auth::read_secret(
        gateway::auth::FLEET_TOKEN_ENV,
        cfg.auth.fleet_token_file.as_deref(),
    )
    .map_err(|e| anyhow!(e))?;
    let zmq_only = cfg.engines.iter().filter(|e| e.kv_events.is_some()).count();
    println!(
        "admin token: {}; fleet token: {}",
        if admin.is_some() {
            "set"
        } else {
            "none (loopback only)"
        },
        match (fleet.is_some(), cfg.replicas.len() == zmq_only) {
            (true, _) => "set",
            (false, true) => "none (every replica's events come over ZMQ, which needs none)",
            (false, false) => "none (kvgate replicas will refuse their HTTP KV events)",
        }
    );
    Ok(())
}

async fn run_gateway(a: GatewayArgs) -> Result<()> {
    if a.check {
        return check_gateway(&a.config);
    }
    let cfg = load_gateway_file(&a.config)?;
    serve_gateway(cfg, shutdown_signal(), 0).await
}

/// Runs the gateway until `shutdown`, then drains. Ready is announced once `wait_for`
/// replicas are admitted (`kvgate up` waits for all of its own).
async fn serve_gateway(
    cfg: config::GatewayConfig,
    shutdown: impl std::future::Future<Output = ()>,
    wait_for: usize,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let admin = tokio::net::TcpListener::bind(&cfg.admin_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.admin_listen))?;
    let model = cfg.model.name.clone();
    let server = gateway::build_gateway(cfg, listener, admin).await?;
    let (addr, admin_addr) = (server.local_addr(), server.admin_addr());
    let registry = server.state().router.registry.clone();
    // The fleet as built: the listed replicas and what discovery found.
    let total = registry.listed().len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while registry.healthy_count() < wait_for {
        if std::time::Instant::now() > deadline {
            bail!(
                "only {} of {wait_for} replicas passed their health check within 30 s",
                registry.healthy_count()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let healthy = registry.healthy_count();
    if healthy == 0 {
        eprintln!(
            "warning: none of the {total} replicas answers /health yet; every request gets 503 \
             until one does (the log names each replica that failed and why)"
        );
    }
    println!(
        "kvgate gateway ready at http://{addr} ({healthy} of {total} replicas healthy); metrics and admin at http://{admin_addr}"
    );
    println!();
    println!("  curl -si http://{addr}/v1/chat/completions -H 'content-type: application/json' \\");
    println!(
        "    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":32}}'"
    );
    println!();
    server.run(shutdown).await;
    Ok(())
}

/// The name a replica serves for a profile (what clients must send as `model`).
fn served_model_name(profile: &str) -> String {
    ModelProfile::resolve(profile)
        .map(|p| p.name)
        .unwrap_or_else(|_| profile.to_string())
}

/// Errors end the process with one line, `Error: ` and the error's causes joined by `: `
/// (no backtrace, whatever RUST_BACKTRACE says: they are the user's errors, not ours).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Replica(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(run_replica(a))
        }
        Command::Gateway(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(run_gateway(a)),
        Command::Up(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(up::run_up(a)),
        Command::Bench(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(run_bench(a)),
        Command::ExportTokenizer(a) => run_export_tokenizer(a),
        Command::Capacity(a) => {
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
    }
}
