//! Shared helpers: start a real replica or gateway on 127.0.0.1:0 and wait until it answers.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use replica::ReplicaConfig;
use serde_json::Value;
use tokio::net::TcpListener;

/// The fleet token test replicas and gateways share.
pub const FLEET_TOKEN: &str = "test-fleet-token-0123456789abcdef";

pub fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "default model files missing in {}; run scripts/fetch-models.sh",
        dir.display()
    );
    dir
}

async fn wait_ready(client: &reqwest::Client, base: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(format!("{base}/health")).send().await {
            if r.status().is_success() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{what} never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn post_json(client: &reqwest::Client, url: String, body: Value) -> reqwest::Response {
    client.post(url).json(&body).send().await.unwrap()
}

async fn get_json(client: &reqwest::Client, url: String) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// Sum of the Prometheus samples of `name` at `url` whose labels contain `label`.
async fn metric_sum(client: &reqwest::Client, url: String, name: &str, label: &str) -> f64 {
    let text = client.get(url).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub struct Replica {
    pub base: String,
    pub client: reqwest::Client,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Starts a replica with the default config adjusted by `adjust`.
pub async fn start_replica(adjust: impl FnOnce(&mut ReplicaConfig)) -> Replica {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = ReplicaConfig::new(tokenizer_dir());
    cfg.replica_id = "test-replica".into();
    cfg.fleet_token = Some(FLEET_TOKEN.into());
    adjust(&mut cfg);
    let server = replica::build_server(cfg, listener).await.unwrap();
    let base = format!("http://{}", server.local_addr());
    let (kill, killed) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run_until_killed(async {
        let _ = killed.await;
    }));
    // The test's client is the fleet: it may use the internal endpoints.
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {FLEET_TOKEN}").parse().unwrap(),
    );
    let client = reqwest::Client::builder()
        .default_headers(auth)
        .build()
        .unwrap();
    wait_ready(&client, &base, "replica").await;
    Replica {
        base,
        client,
        kill: Some(kill),
    }
}

impl Replica {
    /// `host:port`, as a gateway config lists it.
    pub fn host_port(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Stops the replica as if its process died: the listener closes and so does every open
    /// connection.
    pub fn kill(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        post_json(&self.client, format!("{}{path}", self.base), body).await
    }

    pub async fn get_json(&self, path: &str) -> Value {
        get_json(&self.client, format!("{}{path}", self.base)).await
    }

    pub async fn load(&self) -> Value {
        self.get_json("/get_load").await[0].clone()
    }

    /// Polls `/get_load` until `pred` holds or 20 s pass.
    pub async fn wait_load(&self, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let l = self.load().await;
            if pred(&l) {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "load never reached the state: {l}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sum of the samples of metric `name` whose labels contain `label` (e.g. `reason="abort"`).
    pub async fn metric_with(&self, name: &str, label: &str) -> f64 {
        metric_sum(&self.client, format!("{}/metrics", self.base), name, label).await
    }

    pub async fn metric(&self, name: &str) -> f64 {
        self.metric_with(name, "").await
    }
}

/// Makes the gateway report cache hits exactly (the default rounds them), for tests that
/// compare its prediction with the replica's count.
pub fn exact_hit_signals(c: &mut config::GatewayConfig) {
    let mut f = config::PolicyFile::single(c.policy.clone());
    f.hit_signals = config::HitSignals::Exact;
    c.embedded_policy = Some(f);
}

pub struct Gateway {
    pub base: String,
    pub admin: String,
    pub client: reqwest::Client,
}

/// Starts a gateway in front of `replicas` (health checks every 100 ms, load polled every
/// 50 ms) adjusted by `adjust`, and waits until it reports a healthy replica.
pub async fn start_gateway(
    replicas: &[&Replica],
    adjust: impl FnOnce(&mut config::GatewayConfig),
) -> Gateway {
    let mut cfg =
        config::GatewayConfig::with_replicas(replicas.iter().map(|r| r.host_port()).collect());
    cfg.model.tokenizer_dir = Some(tokenizer_dir().display().to_string());
    cfg.health.interval_ms = 100;
    cfg.upstream.load_poll_ms = 50;
    cfg.auth.fleet_token = Some(FLEET_TOKEN.into());
    adjust(&mut cfg);
    cfg.validate().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = gateway::build_gateway(cfg, listener, admin).await.unwrap();
    let base = format!("http://{}", server.local_addr());
    let admin = format!("http://{}", server.admin_addr());
    tokio::spawn(server.run(std::future::pending()));
    let client = reqwest::Client::new();
    wait_ready(&client, &base, "gateway").await;
    Gateway {
        base,
        admin,
        client,
    }
}

impl Gateway {
    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        post_json(&self.client, format!("{}{path}", self.base), body).await
    }

    pub async fn admin_json(&self, path: &str) -> Value {
        get_json(&self.client, format!("{}{path}", self.admin)).await
    }

    pub async fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.client, format!("{}/metrics", self.admin), name, "").await
    }
}
