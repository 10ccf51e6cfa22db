//! `kvgate gateway`: the gateway file read (paths relative to its folder), checked
//! (`--check`: everything the gateway would load, validated, nothing bound) or served until
//! Ctrl-C or SIGTERM. `kvgate up` serves its gateway through [`serve_gateway`] too.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

use crate::signals::shutdown_signal;

#[derive(Args)]
pub struct GatewayArgs {
    /// The gateway file (see config/gateway.toml).
    #[arg(long, default_value = "config/gateway.toml")]
    pub config: PathBuf,
    /// Validate the gateway file, the policy file, the API key file and the secrets, print
    /// what would run, and exit (non-zero when something is wrong).
    #[arg(long)]
    pub check: bool,
}

/// Reads the gateway file; paths in it are relative to its folder.
fn load_gateway_file(path: &std::path::Path) -> Result<config::GatewayConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut cfg = config::GatewayConfig::from_toml(&text)
        .with_context(|| format!("invalid gateway file {}", path.display()))?;
    cfg.resolve_paths(path.parent().unwrap_or(std::path::Path::new(".")));
    cfg.config_path = Some(path.to_path_buf());
    Ok(cfg)
}

/// `kvgate gateway --check`: everything `kvgate gateway` would load, validated, nothing bound.
fn check_gateway(path: &std::path::Path) -> Result<()> {
    let cfg = load_gateway_file(path)?;
    // Each model's tokenizer, as the gateway will load it (a relative folder is taken from the
    // working directory the gateway starts in).
    for m in cfg.served_models() {
        let dir = match &m.tokenizer_dir {
            Some(d) => PathBuf::from(d),
            None => protocol::tokenizer::default_tokenizer_dir().ok_or_else(|| {
                anyhow!(
                    "model {}: no tokenizer folder configured or found (tokenizer_dir)",
                    m.name
                )
            })?,
        };
        protocol::tokenizer::TextTokenizer::from_path(&dir).map_err(|e| {
            anyhow!(
                "model {}: tokenizer_dir {} (from {}): {e}",
                m.name,
                dir.display(),
                std::env::current_dir().map_or("?".into(), |d| d.display().to_string())
            )
        })?;
        println!("model {}: tokenizer {} ok", m.name, dir.display());
    }
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
            let served: Vec<&str> = cfg
                .served_models()
                .iter()
                .map(|m| m.name.as_str())
                .collect();
            let f = config::PolicyFile::from_toml(&text, &cfg.replicas)
                .and_then(|f| f.check_models(&served).map(|()| f))
                .with_context(|| format!("invalid policy file {p}"))?;
            let names: Vec<&str> = f.routes.iter().map(|r| r.name.as_str()).collect();
            println!("{p}: ok (routes: {})", names.join(", "));
        }
        None => println!("no policy file: one catch-all route with [policy]"),
    }
    match &cfg.batch.path {
        Some(p) => println!(
            "Batch API: on, database {p} (up to {} MiB; finished batches kept {} h)",
            cfg.batch.max_disk_mib, cfg.batch.retention_h
        ),
        None => println!("Batch API: off ([batch] path unset)"),
    }
    let keys =
        gateway::http::auth::ApiKeyStore::new(cfg.auth.api_keys_file.as_ref().map(PathBuf::from))
            .map_err(|e| anyhow!(e))?;
    if keys.is_open() {
        println!("API keys: none (the API is open to anyone who can reach it)");
    } else {
        println!("API keys: {} keys", keys.count());
    }
    let admin = gateway::http::auth::read_secret(
        gateway::http::auth::ADMIN_TOKEN_ENV,
        cfg.auth.admin_token_file.as_deref(),
    )
    .map_err(|e| anyhow!(e))?;
    if admin.is_none() && !gateway::http::auth::is_loopback(&cfg.admin_listen) {
        bail!(
            "admin_listen {} is not loopback and there is no admin token ({} or auth.admin_token_file)",
            cfg.admin_listen,
            gateway::http::auth::ADMIN_TOKEN_ENV
        );
    }
    let fleet = gateway::http::auth::read_secret(
        gateway::http::auth::FLEET_TOKEN_ENV,
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

pub async fn run_gateway(a: GatewayArgs) -> Result<()> {
    if a.check {
        return check_gateway(&a.config);
    }
    let cfg = load_gateway_file(&a.config)?;
    serve_gateway(cfg, shutdown_signal(), 0).await
}

/// Runs the gateway until `shutdown`, then drains. Ready is announced once `wait_for`
/// replicas are admitted (`kvgate up` waits for all of its own).
pub async fn serve_gateway(
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
    let models: Vec<String> = cfg.served_models().iter().map(|m| m.name.clone()).collect();
    let batch_db = cfg.batch.path.clone();
    let server = gateway::build_gateway(cfg, listener, admin).await?;
    let (addr, admin_addr) = (server.local_addr(), server.admin_addr());
    let registry = server.state().fleet.clone();
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
    // It serves now; a load balancer's readiness probe may still be told to wait.
    let (code, ready) = server.state().readiness();
    if code != 200 {
        println!(
            "  GET /ready answers {code} for now ({}: following {} of {} replicas' KV events); \
             it turns 200 once it follows them all, or after index.ready_wait_s",
            ready["status"].as_str().unwrap_or("not ready"),
            ready["kv_events_followed"],
            ready["kv_events_expected"],
        );
    }
    if let Some(db) = &batch_db {
        println!("  Batch API: http://{addr}/v1/files and /v1/batches (database {db})");
    }
    if models.len() > 1 {
        println!(
            "  models: {} (a request's \"model\" picks one)",
            models.join(", ")
        );
    }
    for model in &models {
        println!();
        println!(
            "  curl -si http://{addr}/v1/chat/completions -H 'content-type: application/json' \\"
        );
        println!(
            "    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":32}}'"
        );
    }
    println!();
    server.run(shutdown).await;
    Ok(())
}
