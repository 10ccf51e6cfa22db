//! The `kvgate` binary: argument parsing and wiring only. Each subcommand hands a validated
//! configuration to its crate.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
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
}

#[derive(Args)]
struct ModelArgs {
    /// Built-in profile (qwen3-8b, llama-3.1-8b, mistral-7b, llama-3.1-70b-tp4) or a HF config.json.
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
    /// Engine backend: sim (roofline-timed), cpu, cuda.
    #[arg(long, default_value = "sim")]
    backend: String,
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// Folder with tokenizer.json and tokenizer_config.json (default: models/qwen3).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer: Option<PathBuf>,
    /// Model name clients send; defaults to the profile's name.
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
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Override the number of KV blocks computed from GPU memory.
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    #[arg(long)]
    no_prefix_caching: bool,
    /// Multiply every modelled step time (sim only; 1.0 = real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
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
    let tokenizer_dir = match a.tokenizer {
        Some(d) => d,
        None => protocol::tokenizer::default_tokenizer_dir().ok_or_else(|| {
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
    cfg.model = a.model.model;
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
    server
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    Ok(())
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Replica(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(run_replica(a))
        }
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
