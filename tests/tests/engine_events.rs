//! The gateway in front of an engine that publishes KV events over ZMQ in vLLM's wire format:
//! a Python publisher (pyzmq + msgspec, structs shaped like vLLM's, tests/python) replays a
//! stream recorded from a simulated vLLM prefix cache (tests/python/make_vllm_stream.py), and
//! the gateway's matched blocks for every probe prompt must equal the stream's ground truth —
//! with a batch lost on the way and filled from the replay socket, in both of the layouts
//! engines use, across a publisher restart. The replica behind the address is a kvgate sim
//! replica (it answers health checks); its own HTTP events are not followed.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, start_gateway_at, start_replica, FakeMode, FakeReplica, Gateway};
use serde_json::{json, Value};

fn stream_file() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/vllm_events.json")
}

struct Publisher {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Publisher {
    fn start(pub_ep: &str, replay_ep: &str, stream: &std::path::Path, extra: &[&str]) -> Self {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/vllm_kv_publisher.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(["--pub", pub_ep, "--replay", replay_ep])
            .arg("--stream")
            .arg(stream)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the publisher (pyzmq and msgspec come with scripts/test.sh)");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stdin = child.stdin.take();
        let p = Publisher {
            child,
            stdin,
            lines,
        };
        p.expect_line("ready");
        p
    }

    fn expect_line(&self, prefix: &str) -> String {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the publisher never said {prefix:?}"));
        assert!(line.starts_with(prefix), "publisher said {line:?}");
        line
    }

    fn go(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
        self.expect_line("sent");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn replicas(gw: &Gateway) -> Value {
    gw.admin_json("/admin/replicas").await
}

async fn wait_live(gw: &Gateway) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = replicas(gw).await;
        if v[0]["kv_events"] == true {
            return;
        }
        assert!(Instant::now() < deadline, "events never live: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The gateway's explain answer for `prompt` (token ids or text).
async fn explain(gw: &Gateway, prompt: &Value) -> Value {
    gw.explain(&json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": 1}))
        .await
}

/// Every replica's matched blocks for `prompt`.
async fn per_replica(gw: &Gateway, prompt: String) -> Vec<u64> {
    explain(gw, &Value::from(prompt)).await["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["matched_blocks"].as_u64().unwrap())
        .collect()
}

/// (GPU blocks, offloaded blocks after them) the gateway matches for `prompt`.
async fn matched(gw: &Gateway, prompt: &Value) -> (u64, u64) {
    let e = explain(gw, prompt).await;
    let r = &e["replicas"][0];
    let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("no {k} in {e}"));
    (n("matched_blocks"), n("offloaded_blocks"))
}

/// Polls until every probe's (GPU, offloaded) match equals `want(probe)`, or fails with the
/// difference.
async fn assert_probes(gw: &Gateway, probes: &[Value], want: impl Fn(&Value) -> (u64, u64)) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut got = Vec::new();
        for p in probes {
            got.push((matched(gw, &p["prompt"]).await, want(p)));
        }
        if got.iter().all(|(g, w)| g == w) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "((matched, offloaded), ground truth) per probe: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_vllm_events_over_zmq_through_gaps_layouts_and_restarts() {
    let stream: Value =
        serde_json::from_str(&std::fs::read_to_string(stream_file()).unwrap()).unwrap();
    let probes = stream["probes"].as_array().unwrap().clone();
    assert!(probes
        .iter()
        .any(|p| p["expected_blocks"].as_u64() > Some(3)));
    assert!(probes.iter().any(|p| p["expected_blocks"] == 0));
    assert!(probes
        .iter()
        .any(|p| p["expected_offloaded"].as_u64() > Some(0)));
    let replica = start_replica(|_| {}).await;
    for layout in ["map", "array"] {
        let (pub_ep, replay_ep) = (
            format!("tcp://127.0.0.1:{}", free_port()),
            format!("tcp://127.0.0.1:{}", free_port()),
        );
        // The map layout loses its 6th batch (a stored conversation) on the way; the replay
        // socket fills it.
        let lose: &[&str] = if layout == "map" {
            &["--drop-batch", "5"]
        } else {
            &[]
        };
        let mut args = vec!["--layout", layout];
        args.extend_from_slice(lose);
        let mut publisher = Publisher::start(&pub_ep, &replay_ep, &stream_file(), &args);
        let spec = config::gateway::EngineSpec {
            addr: replica.host_port(),
            backend: config::gateway::Backend::Vllm,
            kv_events: Some(pub_ep.clone()),
            kv_replay: Some(replay_ep.clone()),
        };
        let gw = start_gateway_at(&[replica.host_port()], |c| {
            c.engines = vec![spec];
            c.index.kv_events = true;
        })
        .await;
        assert_eq!(replicas(&gw).await[0]["backend"], "vllm");
        wait_live(&gw).await;
        publisher.go();
        assert_probes(&gw, &probes, |p| {
            (
                p["expected_blocks"].as_u64().unwrap(),
                p["expected_offloaded"].as_u64().unwrap(),
            )
        })
        .await;
        // A gateway that joins now, with the engine idle, learns the same from the replay
        // buffer at once (it does not wait for the engine's next batch).
        let late = start_gateway_at(&[replica.host_port()], |c| {
            c.engines = vec![config::gateway::EngineSpec {
                addr: replica.host_port(),
                backend: config::gateway::Backend::Vllm,
                kv_events: Some(pub_ep.clone()),
                kv_replay: Some(replay_ep.clone()),
            }];
        })
        .await;
        wait_live(&late).await;
        assert_probes(&late, &probes, |p| {
            (
                p["expected_blocks"].as_u64().unwrap(),
                p["expected_offloaded"].as_u64().unwrap(),
            )
        })
        .await;
        drop(late);
        // The engine restarts: its sequence starts again at 0 with an empty cache.
        drop(publisher);
        let empty = std::env::temp_dir().join(format!("kvgate-empty-{}.json", std::process::id()));
        std::fs::write(&empty, r#"{"batches": [], "probes": []}"#).unwrap();
        let mut restarted = Publisher::start(&pub_ep, &replay_ep, &empty, &["--layout", layout]);
        let _ = std::fs::remove_file(&empty);
        assert_probes(&gw, &probes, |_| (0, 0)).await;
        restarted.go();
        assert_eq!(replicas(&gw).await[0]["kv_events_error"], Value::Null);
        // It restarts again and publishes at once, before the gateway's socket is back (a real
        // engine serving its first request): those batches never reach the gateway live, and
        // no later batch shows a gap, so the reconnect itself must catch up from the replay.
        drop(restarted);
        let eager = Publisher::start(
            &pub_ep,
            &replay_ep,
            &stream_file(),
            &["--layout", layout, "--no-hello"],
        );
        eager.expect_line("sent");
        assert_probes(&gw, &probes, |p| {
            (
                p["expected_blocks"].as_u64().unwrap(),
                p["expected_offloaded"].as_u64().unwrap(),
            )
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_size_that_differs_is_named_on_the_admin_api() {
    let replica = start_replica(|_| {}).await;
    let (pub_ep, replay_ep) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    let mut publisher = Publisher::start(&pub_ep, &replay_ep, &stream_file(), &[]);
    let spec = config::gateway::EngineSpec {
        addr: replica.host_port(),
        backend: config::gateway::Backend::Vllm,
        kv_events: Some(pub_ep),
        kv_replay: None,
    };
    let gw = start_gateway_at(&[replica.host_port()], |c| {
        c.engines = vec![spec];
        c.model.block_size = 32;
    })
    .await;
    wait_live(&gw).await;
    publisher.go();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = replicas(&gw).await;
        if let Some(e) = v[0]["kv_events_error"].as_str() {
            assert!(e.contains("blocks of 16 tokens"), "{e}");
            assert!(e.contains("hashes blocks of 32"), "{e}");
            assert_eq!(
                v[0]["kv_events"], false,
                "not indexed while the error stands"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no error named: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The gauge alerts read says so too (sampled every second).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = gw.metrics_text().await;
        if text
            .lines()
            .any(|l| l.starts_with("kvgate_gateway_replica_kv_events_live{") && l.ends_with(" 0"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "no live gauge at 0 in\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A vLLM replica's load comes from its `/metrics` (it has no `/get_load`): running, waiting,
/// KV usage (the fullest engine's) and preemptions, which hold admission back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_replicas_load_is_read_from_its_metrics() {
    let fake = FakeReplica::start(FakeMode::Stream { tokens: 2 }).await;
    *fake.metrics.lock().unwrap() = "# TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5.0\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.3\n\
        vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 1.0\n"
        .into();
    let spec = config::gateway::EngineSpec {
        addr: fake.addr.clone(),
        backend: config::gateway::Backend::Vllm,
        kv_events: None,
        kv_replay: None,
    };
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |c| c.engines = vec![spec]).await;
    // A second gateway with no engine table recognises the engine from its /metrics.
    let detected = start_gateway_at(std::slice::from_ref(&fake.addr), |_| {}).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = replicas(&gw).await;
        let r = &v[0];
        if r["running"] == 5 && r["waiting"] == 2 {
            assert!((r["kv_usage"].as_f64().unwrap() - 0.3).abs() < 1e-9, "{r}");
            break;
        }
        assert!(Instant::now() < deadline, "load never read: {r}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = replicas(&detected).await;
        if v[0]["backend"] == "vllm" && v[0]["running"] == 5 {
            break;
        }
        assert!(Instant::now() < deadline, "vLLM never detected: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The counter rises: the replica is preempting, which explain names.
    *fake.metrics.lock().unwrap() =
        "vllm:num_requests_running 5\nvllm:num_preemptions_total 4\n".into();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = replicas(&gw).await;
        if v[0]["preempting"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "preemptions never seen: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// kvgate replicas publishing over ZMQ (`--kv-events`, vLLM's format) give the gateway the
/// same index as their HTTP event stream: a gateway following ZMQ and one following HTTP,
/// in front of the same two replicas, match the same blocks for every probe after traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_replicas_over_zmq_index_like_over_http() {
    let mut endpoints = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let (ev, rp) = (
            format!("tcp://127.0.0.1:{}", free_port()),
            format!("tcp://127.0.0.1:{}", free_port()),
        );
        let (e, r) = (ev.clone(), rp.clone());
        replicas.push(
            start_replica(move |c| {
                c.kv_events_zmq = Some(e);
                c.kv_events_replay = Some(r);
            })
            .await,
        );
        endpoints.push((ev, rp));
    }
    let http =
        common::start_gateway(&[&replicas[0], &replicas[1]], common::exact_hit_signals).await;
    let addrs: Vec<String> = replicas.iter().map(|r| r.host_port()).collect();
    let specs: Vec<config::gateway::EngineSpec> = addrs
        .iter()
        .zip(&endpoints)
        .map(|(a, (ev, rp))| config::gateway::EngineSpec {
            addr: a.clone(),
            backend: config::gateway::Backend::Kvgate,
            kv_events: Some(ev.clone()),
            kv_replay: Some(rp.clone()),
        })
        .collect();
    let zmq = start_gateway_at(&addrs, |c| {
        c.engines = specs;
        common::exact_hit_signals(c);
    })
    .await;
    // Traffic through the HTTP-following gateway: shared prefixes, several turns.
    let system = "You are the support assistant of a paged KV cache company. ".repeat(12);
    let mut probes = Vec::new();
    for i in 0..8 {
        let prompt = format!(
            "{system} Question {} about block sizes and eviction?",
            i % 3
        );
        let r = http
            .post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status(), 200);
        probes.push(prompt);
    }
    probes.push("A prompt nobody sent, long enough to span two blocks at least.".repeat(3));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut same = true;
        let mut seen = Vec::new();
        for p in &probes {
            let (a, b) = (
                per_replica(&http, p.clone()).await,
                per_replica(&zmq, p.clone()).await,
            );
            same &= a == b;
            seen.push((a, b));
        }
        let any_hit = seen.iter().any(|(a, _)| a.iter().any(|&m| m > 0));
        if same && any_hit {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "(HTTP, ZMQ) matched blocks per probe: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A replica that has published a batch is live (one that got no traffic has published
    // nothing yet, as a vLLM engine would not).
    let v = zmq.admin_json("/admin/replicas").await;
    assert!(
        v.as_array().unwrap().iter().any(|r| r["kv_events"] == true),
        "{v}"
    );
}

/// A LoRA adapter served as a model of its own (`[[models]]` with `base`): the engine's events
/// for the adapter's blocks (named by `lora_name`, as vLLM publishes them) credit prompts for
/// the adapter — routed to the engine that holds them, the adapter's name forwarded as sent —
/// and never the base model's prompts with the same text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_adapters_blocks_credit_the_adapter_and_never_its_base() {
    let engines = [
        FakeReplica::start(FakeMode::Stream { tokens: 2 }).await,
        FakeReplica::start(FakeMode::Stream { tokens: 2 }).await,
    ];
    let prompt = "You are the SQL assistant for the warehouse team. Answer with one query, \
                  explain each join in a comment, and never touch the staging schema. Question: \
                  which customers ordered twice last week, and which of them paid by invoice \
                  rather than by card, grouped by region and sorted by total spend?";
    let tok = protocol::tokenizer::TextTokenizer::from_dir(&common::tokenizer_dir()).unwrap();
    let ids = tok.encode(prompt, true).unwrap();
    assert!(ids.len() > 48, "{} tokens", ids.len());
    // Engine 1 has the adapter's first three blocks cached.
    let stream = std::env::temp_dir().join(format!("kvgate-lora-{}.json", std::process::id()));
    let stored = json!({"type": "BlockStored", "block_hashes": [7001, 7002, 7003],
        "parent_block_hash": null, "token_ids": ids[..48], "block_size": 16,
        "lora_id": 1, "medium": "GPU", "lora_name": "sql-adapter"});
    std::fs::write(
        &stream,
        json!({"block_size": 16, "batches": [[stored]]}).to_string(),
    )
    .unwrap();
    let (pub_ep, replay_ep) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    let mut publisher = Publisher::start(&pub_ep, &replay_ep, &stream, &[]);
    let addrs: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let gw = start_gateway_at(&addrs, |c| {
        c.engines = vec![
            config::gateway::EngineSpec {
                addr: addrs[1].clone(),
                backend: config::gateway::Backend::Vllm,
                kv_events: Some(pub_ep.clone()),
                kv_replay: Some(replay_ep.clone()),
            },
            config::gateway::EngineSpec {
                addr: addrs[0].clone(),
                backend: config::gateway::Backend::Vllm,
                kv_events: None,
                kv_replay: None,
            },
        ];
        c.index.kv_events = true;
        let tok = c.model.tokenizer_dir.clone();
        c.model = config::ModelConfig::default();
        c.models = vec![
            config::ModelConfig {
                name: "Qwen3-8B".into(),
                tokenizer_dir: tok,
                ..config::ModelConfig::default()
            },
            config::ModelConfig {
                name: "sql-adapter".into(),
                base: Some("Qwen3-8B".into()),
                ..config::ModelConfig::default()
            },
        ];
        c.resolve_adapters();
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replicas(&gw).await[1]["kv_events"]
        .as_bool()
        .unwrap_or(false)
    {
        assert!(Instant::now() < deadline, "events never live");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.go();
    let matched = |model: &'static str| {
        let gw = &gw;
        async move {
            let e = gw
                .explain(&json!({"model": model, "prompt": prompt, "max_tokens": 1}))
                .await;
            e["replicas"]
                .as_array()
                .unwrap_or_else(|| panic!("{e}"))
                .iter()
                .map(|r| r["matched_blocks"].as_u64().unwrap())
                .collect::<Vec<_>>()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while matched("sql-adapter").await != [0, 3] {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            matched("sql-adapter").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The base model's prompt with the same text matches nothing.
    assert_eq!(matched("Qwen3-8B").await, [0, 0]);
    // The adapter's request goes to the engine holding its blocks, named as sent.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "sql-adapter", "prompt": prompt, "max_tokens": 2, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-kvgate-upstream"].to_str().unwrap(),
        engines[1].addr
    );
    assert_eq!(r.headers()["x-kvgate-route-reason"], "prefix_match");
    let _ = r.text().await;
    assert_eq!(engines[1].bodies()[0]["model"], "sql-adapter");
    let _ = std::fs::remove_file(&stream);
}
