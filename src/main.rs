//! The `kvgate` binary: it parses the command line and dispatches each subcommand to its own
//! file (`gateway_cmd.rs`, `replica_cmd.rs`, `up.rs`, `bench.rs` with `bench_baseline.rs`,
//! `export_tokenizer.rs`, `kv_check.rs`), which hands a validated configuration to its crate.

mod bench;
mod bench_baseline;
mod export_tokenizer;
mod floor;
mod gateway_cmd;
mod kv_check;
mod replica_cmd;
mod signals;
mod up;
mod vllm_fleet;

#[cfg(not(feature = "dhat-heap"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOCATOR: dhat::Alloc = dhat::Alloc;

use anyhow::Result;
use bench::{run_bench, BenchArgs};
use clap::{Parser, Subcommand};
use export_tokenizer::{run_export_tokenizer, ExportTokenizerArgs};
use gateway_cmd::{run_gateway, GatewayArgs};
use kv_check::{run_kv_check, KvCheckArgs};
use replica_cmd::{run_capacity, run_replica, CapacityArgs, ReplicaArgs};

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
    /// Judge a quantised KV cache (fp8) against f16 on long greedy generations and a fixed
    /// text, on a real model on CPU: agreement, perplexity, bytes and decode speed; exits
    /// non-zero when it fails its thresholds.
    KvCheck(KvCheckArgs),
}

/// Errors end the process with one line, `Error: ` and the error's causes joined by `: `
/// (no backtrace, whatever RUST_BACKTRACE says: they are the user's errors, not ours).
fn main() -> std::process::ExitCode {
    // Written to dhat-heap.json when dropped, as `main` returns.
    #[cfg(feature = "dhat-heap")]
    let _profiler = dhat::Profiler::new_heap();
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
            .block_on(async {
                if a.baseline.is_some() || a.record_baseline.is_some() {
                    bench_baseline::run(&a).await
                } else {
                    run_bench(a).await
                }
            }),
        Command::ExportTokenizer(a) => run_export_tokenizer(a),
        Command::Capacity(a) => run_capacity(a),
        Command::KvCheck(a) => run_kv_check(a),
    }
}
