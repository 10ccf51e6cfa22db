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

/// The default real model (SmolLM2-135M-Instruct, Q4_1 GGUF).
pub fn model_file() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "the default model is missing ({}): run scripts/fetch-models.sh",
        p.display()
    );
    p
}

/// Adjusts a replica config to serve the real default model on the `cpu` backend.
pub fn cpu_replica(c: &mut ReplicaConfig, threads: usize) {
    c.backend = replica::backend::BackendKind::Cpu;
    c.model = model_file().display().to_string();
    c.tokenizer_dir = model_file();
    c.threads = Some(threads);
    c.kv_cache_mib = 64;
    c.max_num_batched_tokens = 512;
}

/// The debug `kvgate` binary the process-level tests start (`scripts/test.sh` builds it).
pub fn kvgate_binary() -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/kvgate");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build`; scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// A TCP port nothing listens on now (for processes that take a port, not port 0).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `kvgate up ARGS` (free ports) from the checkout's root and waits for its ready line;
/// returns the process (killed on drop) and the gateway's URL.
pub async fn start_kvgate_up(
    args: &[&str],
    env: &[(&str, PathBuf)],
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut cmd = tokio::process::Command::new(kvgate_binary());
    cmd.arg("up")
        .args(args)
        .args(["--port", "0", "--admin-port", "0"])
        .env_remove("KVGATE_TOKENIZER_DIR")
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start kvgate up");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = tokio::time::timeout(Duration::from_secs(300), lines.next_line())
            .await
            .expect("kvgate up prints its URL")
            .unwrap()
            .expect("kvgate up exited early");
        if let Some(rest) = line.strip_prefix("kvgate gateway ready at ") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
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
    pub state: std::sync::Arc<gateway::state::GatewayState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Starts a gateway in front of `replicas` (health checks every 100 ms, load polled every
/// 50 ms) adjusted by `adjust`, and waits until it reports a healthy replica.
pub async fn start_gateway(
    replicas: &[&Replica],
    adjust: impl FnOnce(&mut config::GatewayConfig),
) -> Gateway {
    let addrs: Vec<String> = replicas.iter().map(|r| r.host_port()).collect();
    start_gateway_at(&addrs, |c| {
        c.index.kv_events = true;
        adjust(c)
    })
    .await
}

/// A gateway in front of replicas given by address (fakes included), health checks every
/// 100 ms, load polled every 50 ms, KV events off unless `adjust` turns them on.
pub async fn start_gateway_at(
    addrs: &[String],
    adjust: impl FnOnce(&mut config::GatewayConfig),
) -> Gateway {
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    start_gateway_with_admin(addrs, admin, adjust).await
}

/// [`start_gateway_at`] on an admin listener bound beforehand (gateways that name each
/// other as peers need each other's admin address before either starts).
pub async fn start_gateway_with_admin(
    addrs: &[String],
    admin: TcpListener,
    adjust: impl FnOnce(&mut config::GatewayConfig),
) -> Gateway {
    let mut cfg = config::GatewayConfig::with_replicas(addrs.to_vec());
    cfg.model.tokenizer_dir = Some(tokenizer_dir().display().to_string());
    cfg.health.interval_ms = 100;
    cfg.upstream.load_poll_ms = 50;
    cfg.index.kv_events = false;
    cfg.auth.fleet_token = Some(FLEET_TOKEN.into());
    adjust(&mut cfg);
    cfg.validate().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = gateway::build_gateway(cfg, listener, admin).await.unwrap();
    let base = format!("http://{}", server.local_addr());
    let admin = format!("http://{}", server.admin_addr());
    let state = server.state();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    wait_ready(&client, &base, "gateway").await;
    Gateway {
        base,
        admin,
        client,
        state,
        stop: Some(stop),
        task: Some(task),
    }
}

impl Gateway {
    /// `host:port` of the API listener.
    pub fn addr(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// Starts the drain (what SIGTERM does); the handle resolves when `run` returns.
    pub fn shutdown(&mut self) -> tokio::task::JoinHandle<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.take().expect("shut down once")
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        post_json(&self.client, format!("{}{path}", self.base), body).await
    }

    pub async fn admin_json(&self, path: &str) -> Value {
        get_json(&self.client, format!("{}{path}", self.admin)).await
    }

    /// Polls the admin `path` until `cond` holds (20 s at most; `what` names it if not).
    pub async fn wait_admin(&self, path: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = self.admin_json(path).await;
            if cond(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "{what} never happened: {v}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The admin API's dry run for `body` (`POST /admin/route/explain`).
    pub async fn explain(&self, body: &Value) -> Value {
        post_json(
            &self.client,
            format!("{}/admin/route/explain", self.admin),
            body.clone(),
        )
        .await
        .json()
        .await
        .unwrap()
    }

    pub async fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.client, format!("{}/metrics", self.admin), name, "").await
    }

    /// The admin port's whole `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// What a [`FakeReplica`] does with generation requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeMode {
    /// Streams `tokens` events 20 ms apart, then usage and `[DONE]`.
    Stream { tokens: usize },
    /// Sends `tokens` events, then drops the connection (a crash mid-stream).
    CutAfter { tokens: usize },
    /// Sends `tokens` events, then nothing, ever (a stalled process); `/health` hangs too.
    StallAfter { tokens: usize },
    /// Answers every generation request 200 with a body that is not JSON.
    NotJson,
    /// Answers every generation request 200 with an HTML page (`text/html`).
    Html,
    /// Streams token events every 5 ms and never ends.
    Endless,
    /// Streams `tokens` good events, then one whose data is not JSON.
    BadEvent { tokens: usize },
    /// Promises a 1,000-byte JSON body (`content-length`) and sends 10 bytes of it.
    ShortBody,
}

/// A stand-in replica that records every generation body it receives and answers as its
/// mode says: for checking what the gateway forwards and how it handles failures that a
/// real replica cannot be made to show on cue.
pub struct FakeReplica {
    pub addr: String,
    pub bodies: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
    pub mode: std::sync::Arc<std::sync::Mutex<FakeMode>>,
    /// What `GET /metrics` answers (a vLLM-style page, for instance).
    pub metrics: std::sync::Arc<std::sync::Mutex<String>>,
}

impl FakeReplica {
    pub async fn start(mode: FakeMode) -> FakeReplica {
        use http_body_util::BodyExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mode = std::sync::Arc::new(std::sync::Mutex::new(mode));
        let metrics = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (b, m, mt) = (bodies.clone(), mode.clone(), metrics.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (b, m, mt) = (b.clone(), m.clone(), mt.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let (b, m, mt) = (b.clone(), m.clone(), mt.clone());
                            async move {
                                let mode = *m.lock().unwrap();
                                let path = req.uri().path().to_string();
                                let stalled = matches!(mode, FakeMode::StallAfter { .. });
                                let body = req
                                    .into_body()
                                    .collect()
                                    .await
                                    .map(|c| c.to_bytes())
                                    .unwrap_or_default();
                                let full = |s: String| {
                                    http_body_util::Either::Left(http_body_util::Full::new(
                                        bytes::Bytes::from(s),
                                    ))
                                };
                                let resp = match path.as_str() {
                                "/health" if stalled => {
                                    std::future::pending::<()>().await;
                                    unreachable!()
                                }
                                "/health" => hyper::Response::new(full("{}".into())),
                                "/metrics" => hyper::Response::new(full(mt.lock().unwrap().clone())),
                                "/v1/models" => hyper::Response::new(full(
                                    r#"{"object":"list","data":[{"id":"Qwen3-8B","object":"model","max_model_len":40960}]}"#.into(),
                                )),
                                "/v1/chat/completions" | "/v1/completions" if matches!(mode, FakeMode::NotJson | FakeMode::Html | FakeMode::ShortBody) => {
                                    b.lock().unwrap().push(serde_json::from_slice(&body).unwrap_or(Value::Null));
                                    match mode {
                                        FakeMode::NotJson => hyper::Response::builder()
                                            .header("content-type", "application/json")
                                            .body(full("Internal things went sideways".into()))
                                            .unwrap(),
                                        FakeMode::Html => hyper::Response::builder()
                                            .header("content-type", "text/html")
                                            .body(full("<!doctype html><html><body>Welcome to nginx!</body></html>".into()))
                                            .unwrap(),
                                        _ => {
                                            let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>(1);
                                            tokio::spawn(async move {
                                                let _ = tx.send(Ok(hyper::body::Frame::data("{\"id\": \"x\",".into()))).await;
                                                tx.closed().await;
                                            });
                                            let stream = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
                                            hyper::Response::builder()
                                                .header("content-type", "application/json")
                                                .header("content-length", "1000")
                                                .body(http_body_util::Either::Right(stream))
                                                .unwrap()
                                        }
                                    }
                                }
                                "/v1/chat/completions" | "/v1/completions" => {
                                    b.lock().unwrap().push(serde_json::from_slice(&body).unwrap_or(Value::Null));
                                    let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>(8);
                                    tokio::spawn(async move {
                                        let (n, end) = match mode {
                                            FakeMode::Stream { tokens } => (tokens, 0),
                                            FakeMode::CutAfter { tokens } => (tokens, 1),
                                            FakeMode::StallAfter { tokens } => (tokens, 2),
                                            FakeMode::BadEvent { tokens } => (tokens, 3),
                                            _ => (usize::MAX, 2),
                                        };
                                        let gap = if n == usize::MAX { 5 } else { 20 };
                                        for i in 0..n {
                                            let ev = format!("data: {{\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}]}}\n\n");
                                            if tx.send(Ok(hyper::body::Frame::data(ev.into()))).await.is_err() {
                                                return;
                                            }
                                            tokio::time::sleep(Duration::from_millis(gap)).await;
                                        }
                                        match end {
                                            0 => {
                                                let usage = format!("data: {{\"id\":\"x\",\"choices\":[],\"usage\":{{\"prompt_tokens\":10,\"completion_tokens\":{n},\"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\ndata: [DONE]\n\n", n + 10);
                                                let _ = tx.send(Ok(hyper::body::Frame::data(usage.into()))).await;
                                            }
                                            1 => {
                                                let _ = tx.send(Err(std::io::Error::other("crash"))).await;
                                            }
                                            3 => {
                                                let _ = tx.send(Ok(hyper::body::Frame::data("data: <<garbage>>\n\n".into()))).await;
                                                tx.closed().await;
                                            }
                                            _ => {
                                                tx.closed().await;
                                            }
                                        }
                                    });
                                    let stream = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
                                    hyper::Response::builder()
                                        .header("content-type", "text/event-stream")
                                        .body(http_body_util::Either::Right(stream))
                                        .unwrap()
                                }
                                _ => hyper::Response::builder().status(404).body(full("{}".into())).unwrap(),
                            };
                                Ok::<_, std::convert::Infallible>(resp)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        FakeReplica {
            addr,
            bodies,
            mode,
            metrics,
        }
    }

    pub fn set_mode(&self, m: FakeMode) {
        *self.mode.lock().unwrap() = m;
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// A streamed answer read to its end: the data payloads, and whether `[DONE]` came.
pub async fn read_stream(r: reqwest::Response) -> (Vec<Value>, bool) {
    let text = r.text().await.unwrap_or_default();
    let mut events = Vec::new();
    let mut done = false;
    for block in text.split("\n\n") {
        for line in block.lines() {
            if let Some(d) = line.strip_prefix("data: ") {
                if d.trim() == "[DONE]" {
                    done = true;
                } else if let Ok(v) = serde_json::from_str::<Value>(d) {
                    events.push(v);
                }
            }
        }
    }
    (events, done)
}

/// A policy file in its own temporary folder, removed on drop.
pub struct PolicyFileOnDisk {
    dir: PathBuf,
    pub path: PathBuf,
}

impl PolicyFileOnDisk {
    pub fn new(tag: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvgate-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("policy.toml");
        std::fs::write(&path, text).unwrap();
        PolicyFileOnDisk { dir, path }
    }

    /// Replaces the file the way editors do: write a sibling, rename over.
    pub fn replace(&self, text: &str) {
        let tmp = self.dir.join("policy.toml.new");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }
}

impl Drop for PolicyFileOnDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
