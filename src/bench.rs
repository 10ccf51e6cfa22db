//! `kvgate bench`: its arguments and the wiring from them to the `loadtest` crate.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

use crate::floor::IdleReplica;

#[derive(Args)]
pub struct BenchArgs {
    /// Target base URL, or NAME=URL; repeat to compare targets in one interleaved run.
    #[arg(long = "target", required_unless_present_any = ["oracle_only", "baseline"])]
    pub targets: Vec<String>,
    /// Model name sent in every request (the served name).
    #[arg(long, default_value = "Qwen3-8B")]
    pub model: String,
    /// chat, agent, rag, mixed-tail, bursty (popular prefixes in clusters), apps (16 Zipf-popular
    /// applications with 1k–6k-token system prompts, multi-turn) or trace (with --trace).
    #[arg(long, default_value = "chat")]
    pub workload: String,
    /// JSONL trace to replay (timestamp + prompt or messages + max_tokens per line). Its
    /// spacing is kept, rescaled so the mean rate equals --rate / each of --rates.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Arrivals follow one compressed day over --duration: a cosine from this share of the
    /// rate (night, at the start and the end) to the rate (noon, in the middle).
    #[arg(long)]
    pub daily_low: Option<f64>,
    /// Arrival rate, requests per second (one rate; 2 when neither --rate nor --rates is given).
    #[arg(long, conflicts_with = "rates")]
    pub rate: Option<f64>,
    /// Rate sweep, e.g. 2,4,8 (every target at every rate).
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// Seconds of arrivals per run.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Upper bound on requests sent per run.
    #[arg(long, default_value_t = 10_000)]
    pub max_requests: usize,
    /// Seconds at the start of each run whose requests are not reported (must be shorter than
    /// --duration).
    #[arg(long, default_value_t = 5.0)]
    pub warmup: f64,
    /// Seed of the arrival schedule and the workload (same seed, same requests).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// TTFT target for goodput, milliseconds.
    #[arg(long)]
    pub slo_ttft_ms: Option<u64>,
    /// Inter-token target (p95 of each request's gaps) for goodput, milliseconds.
    #[arg(long)]
    pub slo_itl_ms: Option<u64>,
    /// Replica base URL to `POST /flush_cache` before every run (repeat for each replica).
    #[arg(long = "flush")]
    pub flush: Vec<String>,
    /// Write report.json, report.md and plots (PNG and SVG) into this folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write the report as JSON here (single target and rate: with every sample).
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Tokenizer folder for the oracle hit ratio (default: models/qwen3); the oracle is skipped
    /// when none is found.
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    pub tokenizer: Option<PathBuf>,
    /// KV block size the oracle hashes with.
    #[arg(long, default_value_t = protocol::hashing::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// The idle replica the TTFT floor is priced on, for sim fleets:
    /// `gpu=NAME[,model=NAME][,time_scale=X][,chunk=N]` (default: read from the first --flush
    /// replica's /server_info when it is a sim replica). The floor is the TTFT each request
    /// would get with the oracle's cache on an idle replica: no router's percentile is lower.
    #[arg(long)]
    pub floor: Option<String>,
    /// Print the oracle (hit ratio and TTFT floor) for each rate's traffic and exit; sends
    /// nothing.
    #[arg(long)]
    pub oracle_only: bool,
    /// No progress line on the terminal.
    #[arg(long)]
    pub no_progress: bool,
    /// Send this share of the requests unstreamed (0–1; the same requests for every target):
    /// SDK calls and batch clients that wait for the whole answer. They are judged on end to
    /// end (TTFT budget plus the inter-token budget per further token).
    #[arg(long, default_value_t = 0.0)]
    pub unstreamed_share: f64,
    /// Cap every answer at this many tokens (default: the workload's own, 128–256): short
    /// answers, as classification or extraction clients ask for.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: Option<u32>,
    /// Seeds for a recorded baseline (`--record-baseline`): every rate is run once per seed,
    /// and the seeds' spread is the noise band a later comparison reads changes against.
    #[arg(long, value_delimiter = ',')]
    pub seeds: Vec<u64>,
    /// Run the benchmark once per seed and rate against the one --target and write it, spec
    /// and figures, as a baseline file for a later `--baseline`.
    #[arg(long)]
    pub record_baseline: Option<PathBuf>,
    /// Re-run a recorded baseline's exact benchmark (its workload, seeds, rates, duration,
    /// warm-up, SLO and unstreamed share; the flags for those are ignored) against --target
    /// (default: the recorded URL) and compare: per metric the change, the seeds' range and
    /// a verdict; the knee beside the old one; a non-zero exit when anything regressed.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// A metric's tolerance in a baseline comparison, METRIC=X (relative; absolute for
    /// hit_ratio): ttft_p95 0.15, ttft_p99 0.25, itl_p95 0.15, itl_p99 0.25, goodput 0.05,
    /// throughput 0.05, hit_ratio 0.02 unless given.
    #[arg(long = "tolerance")]
    pub tolerances: Vec<String>,
    /// Free text stored in a recorded baseline (the build, the machine, the fleet).
    #[arg(long, default_value = "")]
    pub note: String,
}

/// The rates asked for: `--rate`, else `--rates`, else 2 per second.
pub(crate) fn rates_of(a: &BenchArgs) -> Vec<f64> {
    match (a.rate, a.rates.is_empty()) {
        (Some(r), _) => vec![r],
        (None, true) => vec![2.0],
        (None, false) => a.rates.clone(),
    }
}

/// The workload a name (or a trace file) stands for.
pub(crate) fn workload_of(
    name: &str,
    trace: Option<&std::path::Path>,
) -> Result<loadtest::run::Workload> {
    use loadtest::run::Workload;
    Ok(match (name, trace) {
        ("trace", Some(p)) | (_, Some(p)) => {
            Workload::Trace(std::sync::Arc::new(loadtest::trace::Trace::load(p)?))
        }
        ("trace", None) => bail!("--workload trace needs --trace FILE"),
        (w, None) => Workload::Generated(loadtest::workload::Kind::parse(w).ok_or_else(|| {
            anyhow!("--workload must be chat, agent, rag, mixed-tail, bursty, apps or trace")
        })?),
    })
}

pub async fn run_bench(a: BenchArgs) -> Result<()> {
    use loadtest::run::Slo;
    let workload = match (workload_of(&a.workload, a.trace.as_deref())?, a.daily_low) {
        (w, None) => w,
        (loadtest::run::Workload::Generated(k), Some(low))
            if (0.0..=1.0).contains(&low) && k != loadtest::workload::Kind::Bursty =>
        {
            loadtest::run::Workload::Daily(k, low)
        }
        _ => bail!(
            "--daily-low takes a share between 0 and 1 and a generated workload other than bursty"
        ),
    };
    let rates = rates_of(&a);
    if rates.iter().any(|r| !(*r > 0.0 && r.is_finite()))
        || !(a.duration > 0.0 && a.warmup >= 0.0 && a.warmup < a.duration)
    {
        bail!("rates and --duration must be positive, and 0 <= --warmup < --duration");
    }
    if !(0.0..=1.0).contains(&a.unstreamed_share) {
        bail!("--unstreamed-share must be between 0 and 1");
    }
    if a.oracle_only {
        return print_oracle(&a, &workload, &rates).await;
    }
    let targets: Vec<loadtest::compare::Target> = a
        .targets
        .iter()
        .map(|t| loadtest::compare::Target::parse(t))
        .collect();
    loadtest::compare::preflight(&targets)
        .await
        .map_err(|e| anyhow!(e))?;
    let base = loadtest::run::RunSpec {
        base_url: targets[0].url.clone(),
        label: targets[0].name.clone(),
        model: a.model.clone(),
        workload: workload.clone(),
        rate: rates[0],
        duration: std::time::Duration::from_secs_f64(a.duration),
        max_requests: a.max_requests,
        warmup: std::time::Duration::from_secs_f64(a.warmup),
        seed: a.seed,
        request_timeout: std::time::Duration::from_secs(600),
        slo: Slo::from_ms(a.slo_ttft_ms, a.slo_itl_ms),
        progress: !a.no_progress,
        unstreamed_share: a.unstreamed_share,
        max_tokens: a.max_tokens,
    };
    // Single target, single rate, no flush: one run, every sample in --json-out.
    if targets.len() == 1 && rates.len() == 1 && a.out.is_none() {
        let report = loadtest::run::run(&base).await;
        print!("{}", report.table());
        if let Some(path) = &a.json_out {
            std::fs::write(path, serde_json::to_vec_pretty(&report)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
            println!("report written to {}", path.display());
        }
        if report.ok == 0 {
            bail!(
                "no request succeeded; first error: {}",
                report
                    .samples
                    .iter()
                    .find_map(|s| s.error.clone())
                    .unwrap_or_else(|| "none recorded".into())
            );
        }
        return Ok(());
    }
    let oracle = Oracle::new(&a).await?;
    let oracle = |rate: f64| oracle.at(&a, &workload, rate);
    let spec = loadtest::compare::CompareSpec {
        targets,
        rates,
        flush: a.flush.clone(),
        base,
    };
    let total = spec.targets.len() * spec.rates.len();
    let mut done = 0;
    let report = loadtest::compare::compare(&spec, oracle, |r| {
        done += 1;
        println!("[{done}/{total}] {} at {:.2}/s: ok {} shed {} errors {}  req/s {:.2}  goodput {:.2}  TTFT p95 {} ms  prefix hit {:.1}%",
            r.target, r.rate, r.ok, r.shed, r.errors, r.requests_per_s, r.goodput_requests_per_s,
            r.ttft_s.as_ref().map_or("-".into(), |s| format!("{:.0}", s.p95 * 1e3)),
            r.prefix_hit_ratio * 100.0);
    })
    .await;
    print!("{}", report.markdown());
    let dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("loadtest/out/latest"));
    let (files, plot_error) = loadtest::plot::write_report(&report, &dir)
        .with_context(|| format!("cannot write the report into {}", dir.display()))?;
    for f in &files {
        println!("wrote {}", f.display());
    }
    let lines_path = dir.join("samples.jsonl");
    let mut lines = Vec::new();
    for l in report.request_lines.iter().flatten() {
        serde_json::to_writer(&mut lines, l)?;
        lines.push(b'\n');
    }
    std::fs::write(&lines_path, lines)
        .with_context(|| format!("cannot write {}", lines_path.display()))?;
    println!("wrote {}", lines_path.display());
    if let Some(e) = plot_error {
        eprintln!("plots skipped: {e}");
    }
    if let Some(path) = &a.json_out {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if report.runs.iter().all(|r| r.ok == 0) {
        bail!("no request succeeded in any run");
    }
    Ok(())
}

/// The ceiling a run is read against: the oracle's hit ratio, and the TTFT floor when the
/// replicas' speed is known.
struct Oracle {
    tok: Option<protocol::tokenizer::TextTokenizer>,
    idle: Option<IdleReplica>,
}

impl Oracle {
    async fn new(a: &BenchArgs) -> Result<Self> {
        let tok_dir = a
            .tokenizer
            .clone()
            .or_else(protocol::tokenizer::default_tokenizer_dir);
        let tok = tok_dir
            .as_ref()
            .and_then(|d| protocol::tokenizer::TextTokenizer::from_path(d).ok());
        if tok.is_none() {
            eprintln!("no tokenizer found: the oracle is left out (pass --tokenizer DIR)");
        }
        let idle = match (&a.floor, a.flush.first()) {
            (Some(spec), _) => Some(IdleReplica::parse(spec)?),
            (None, Some(url)) => match loadtest::compare::server_info(url).await {
                Ok(info) => IdleReplica::from_server_info(&info).unwrap_or_else(|e| {
                    eprintln!("TTFT floor left out: {e:#}");
                    None
                }),
                Err(e) => {
                    eprintln!("TTFT floor left out: {e}");
                    None
                }
            },
            (None, None) => None,
        };
        if let Some(i) = &idle {
            println!("TTFT floor priced on an idle replica: {}", i.describe());
        }
        Ok(Oracle { tok, idle })
    }

    fn at(
        &self,
        a: &BenchArgs,
        workload: &loadtest::run::Workload,
        rate: f64,
    ) -> Option<loadtest::compare::OracleAtRate> {
        let tok = self.tok.as_ref()?;
        let duration = std::time::Duration::from_secs_f64(a.duration);
        let (at, items) = workload.plan(rate, duration, a.max_requests, a.seed);
        let measure: Vec<bool> = at.iter().map(|t| *t >= a.warmup).collect();
        let reqs = loadtest::oracle::oracle_requests(tok, &a.model, a.block_size, &items, &measure)
            .ok()?;
        Some(loadtest::compare::OracleAtRate {
            rate,
            hit_ratio: loadtest::oracle::OracleHits::of(&reqs).ratio(),
            ttft_floor_s: self
                .idle
                .as_ref()
                .and_then(|i| loadtest::oracle::ttft_floor(&reqs, |p, c| i.ttft_s(p, c))),
        })
    }
}

/// `--oracle-only`: the ceiling of each rate's traffic, nothing sent.
async fn print_oracle(
    a: &BenchArgs,
    workload: &loadtest::run::Workload,
    rates: &[f64],
) -> Result<()> {
    let oracle = Oracle::new(a).await?;
    if oracle.tok.is_none() {
        bail!("--oracle-only needs a tokenizer (--tokenizer DIR)");
    }
    println!("| rate/s | oracle prefix hit | TTFT floor p50 / p95 / p99 ms |\n|---:|---:|---|");
    for &rate in rates {
        let o = oracle
            .at(a, workload, rate)
            .ok_or_else(|| anyhow!("the oracle could not tokenise the workload"))?;
        let floor = o.ttft_floor_s.map_or("- (pass --floor)".to_string(), |f| {
            format!(
                "{:.0} / {:.0} / {:.0}",
                f.p50 * 1e3,
                f.p95 * 1e3,
                f.p99 * 1e3
            )
        });
        println!("| {rate} | {:.1}% | {floor} |", o.hit_ratio * 100.0);
    }
    Ok(())
}
