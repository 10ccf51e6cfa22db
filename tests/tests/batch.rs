//! The Batch API end to end: the official openai SDK's round trip with two tenants, a
//! malformed file and a cancel (`python/openai_batch.py`), and a gateway process killed with
//! SIGKILL mid-job that, restarted on the same database, finishes it with every `custom_id`
//! in the output exactly once.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{free_port, kvgate_binary, start_gateway, start_replica, tokenizer_dir, FLEET_TOKEN};
use serde_json::{json, Value};

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-batch-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_runs_a_batch_and_tenants_cannot_see_each_other() {
    let dir = scratch("sdk");
    let keys = dir.join("keys.toml");
    std::fs::write(
        &keys,
        "[[keys]]\nkey = \"sk-tenant-a-0123456789\"\ntenant = \"a\"\npriorities = [\"interactive\", \"batch\"]\n\
         [[keys]]\nkey = \"sk-tenant-b-0123456789\"\ntenant = \"b\"\npriorities = [\"interactive\", \"batch\"]\n",
    )
    .unwrap();
    let reps = [start_replica(|_| {}).await, start_replica(|_| {}).await];
    let db = dir.join("batch.sqlite3");
    let gw = start_gateway(&[&reps[0], &reps[1]], |c| {
        c.auth.api_keys_file = Some(keys.display().to_string());
        c.batch.path = Some(db.display().to_string());
    })
    .await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_batch.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .arg(format!("{}/v1", gw.base))
        .args([
            "sk-tenant-a-0123456789",
            "sk-tenant-b-0123456789",
            "Qwen3-8B",
        ])
        .output()
        .await
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK run failed:\n{stdout}\n{stderr}");
    for check in ["roundtrip ok", "isolation ok", "malformed ok", "cancel ok"] {
        assert!(stdout.contains(check), "{check}:\n{stdout}");
    }
    // 6 round-trip lines and the cancelled batch's finished ones.
    let m = gw.metrics_text().await;
    assert!(completed_lines(&m) >= 7.0, "{m}");
    // The lines were batch-class requests on the replicas.
    assert!(gw.metric("kvgate_batch_generated_tokens_total").await >= 6.0 * 8.0);
}

/// A multipart upload as the SDK sends it (reqwest here has no multipart feature).
fn multipart(content: &str) -> (String, Vec<u8>) {
    let boundary = "kvgate-test-boundary-7f3a";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n{content}\r\n--{boundary}--\r\n"
    );
    (
        format!("multipart/form-data; boundary={boundary}"),
        body.into_bytes(),
    )
}

fn gateway_file(dir: &Path, name: &str, replica: &str, port: u16, admin: u16) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
             replicas = [\"{replica}\"]\n[model]\ntokenizer_dir = \"{}\"\n\
             [batch]\npath = \"batch.sqlite3\"\nmax_in_flight = 4\nlease_s = 3\n",
            tokenizer_dir().display()
        ),
    )
    .unwrap();
    path
}

/// `kvgate gateway` as a process (SIGKILL-able), ready once `/health` answers 200.
async fn start_gateway_process(file: &Path, base: &str) -> tokio::process::Child {
    let child = tokio::process::Command::new(kvgate_binary())
        .args(["gateway", "--config"])
        .arg(file)
        .env("KVGATE_FLEET_TOKEN", FLEET_TOKEN)
        .env_remove("KVGATE_API_KEYS")
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvgate gateway");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = reqwest::get(format!("{base}/health")).await {
            if r.status().is_success() {
                return child;
            }
        }
        assert!(Instant::now() < deadline, "the gateway never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn batch(base: &str, id: &str) -> Value {
    reqwest::get(format!("{base}/v1/batches/{id}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Uploads `lines` completions requests and creates a batch over them; its id.
async fn submit(base: &str, lines: usize) -> String {
    let lines: Vec<Value> = (0..lines)
        .map(|i| {
            json!({
                "custom_id": format!("line-{i}"),
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "Qwen3-8B", "prompt": format!("Summarise item {i}."),
                         "max_tokens": 48, "ignore_eos": true},
            })
        })
        .collect();
    upload_batch(&reqwest::Client::new(), base, &lines).await
}

/// Uploads `lines` as a file and creates a batch over it (1 h window); the batch's id.
async fn upload_batch(client: &reqwest::Client, base: &str, lines: &[Value]) -> String {
    let content: Vec<String> = lines.iter().map(Value::to_string).collect();
    let (ct, body) = multipart(&content.join("\n"));
    let f: Value = client
        .post(format!("{base}/v1/files"))
        .header("content-type", ct)
        .body(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let b: Value = client
        .post(format!("{base}/v1/batches"))
        .json(
            &json!({"input_file_id": f["id"], "endpoint": "/v1/completions",
                      "completion_window": "1h"}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    b["id"].as_str().expect("a batch id").to_string()
}

/// Polls until the batch has at least `n` completed lines.
async fn wait_completed(base: &str, id: &str, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = batch(base, id).await["request_counts"]["completed"]
            .as_u64()
            .unwrap();
        if done >= n {
            return done;
        }
        assert!(Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls until the batch is completed; checks every line is in the output exactly once.
async fn wait_output(base: &str, id: &str, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(180);
    let ended = loop {
        let b = batch(base, id).await;
        if b["status"] == "completed" {
            break b;
        }
        assert_eq!(b["status"], "in_progress", "{b}");
        assert!(Instant::now() < deadline, "never finished: {b}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ended["request_counts"]["total"], lines);
    assert_eq!(ended["request_counts"]["completed"], lines, "{ended}");
    assert_eq!(ended["request_counts"]["failed"], 0);
    let out = reqwest::get(format!(
        "{base}/v1/files/{}/content",
        ended["output_file_id"].as_str().unwrap()
    ))
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    let mut ids: Vec<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["custom_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.len(), lines, "one output line per request");
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), lines, "each custom_id exactly once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_job_finishes_it_after_restart_with_each_line_once() {
    let dir = scratch("sigkill");
    let rep = start_replica(|_| {}).await;
    let (port, admin) = (free_port(), free_port());
    let base = format!("http://127.0.0.1:{port}");
    let file = gateway_file(&dir, "gateway.toml", &rep.host_port(), port, admin);
    let mut gw = start_gateway_process(&file, &base).await;

    const LINES: usize = 40;
    let id = submit(&base, LINES).await;

    // Kill it once some lines are done and others are not.
    let done_before = wait_completed(&base, &id, 5).await;
    gw.kill().await.unwrap(); // SIGKILL
    assert!((done_before as usize) < LINES, "killed before the end");
    // The same gateway file (the same node id): it takes its batch back at once.
    let _gw = start_gateway_process(&file, &base).await;
    wait_output(&base, &id, LINES).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_the_database_takes_over_a_dead_ones_batch() {
    let dir = scratch("takeover");
    let rep = start_replica(|_| {}).await;
    let (pa, aa, pb, ab) = (free_port(), free_port(), free_port(), free_port());
    let (base_a, base_b) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let mut a = start_gateway_process(
        &gateway_file(&dir, "a.toml", &rep.host_port(), pa, aa),
        &base_a,
    )
    .await;
    const LINES: usize = 240;
    let id = submit(&base_a, LINES).await;
    wait_completed(&base_a, &id, 3).await;
    let _b = start_gateway_process(
        &gateway_file(&dir, "b.toml", &rep.host_port(), pb, ab),
        &base_b,
    )
    .await;
    // B sees the batch (one database) but A holds it: B runs none of its lines.
    let seen = batch(&base_b, &id).await;
    assert_eq!(seen["status"], "in_progress", "{seen}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let metrics = |admin: u16| async move {
        let text = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        completed_lines(&text)
    };
    assert_eq!(metrics(ab).await, 0.0, "B ran a line A holds");
    let before = wait_completed(&base_a, &id, 6).await;
    a.kill().await.unwrap(); // SIGKILL: A's lease runs out in 3 s
    assert!((before as usize) < LINES);
    wait_output(&base_b, &id, LINES).await;
    assert!(metrics(ab).await > 0.0, "B ran the rest");
}

/// `kvgate_batch_lines_total{outcome="completed"}` in a `/metrics` text (0 when absent).
fn completed_lines(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvgate_batch_lines_total{outcome=\"completed\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_batch_line_starts_while_an_interactive_request_waits() {
    let dir = scratch("trough");
    // A slow replica (each step takes 20× its roofline time) and an interactive route that
    // takes one request at a time, so a second one waits in the gateway's queue.
    let rep = start_replica(|c| c.time_scale = 20.0).await;
    let gw = start_gateway(&[&rep], |c| {
        c.batch.path = Some(dir.join("batch.sqlite3").display().to_string());
        let routes = "[[routes]]\nname = \"batch\"\npriority = \"batch\"\nengine_priority = 10\n\
                      [[routes]]\nname = \"interactive\"\nmax_concurrency = 1\nqueue_size = 8\n\
                      queue_timeout_ms = 60000\n";
        c.embedded_policy = Some(config::PolicyFile::from_toml(routes, &c.replicas).unwrap());
    })
    .await;
    let long = json!({"model": "Qwen3-8B", "prompt": "Tell me a long story.",
                      "max_tokens": 20, "ignore_eos": true});
    let (c1, c2) = (gw.client.clone(), gw.client.clone());
    let url = format!("{}/v1/completions", gw.base);
    let (u1, u2, b1, b2) = (url.clone(), url, long.clone(), long);
    let first = tokio::spawn(async move { c1.post(u1).json(&b1).send().await.unwrap().status() });
    // The second waits in the interactive route's queue until the first is done.
    let deadline = Instant::now() + Duration::from_secs(20);
    let interactive = |name: &'static str| {
        let gw = &gw;
        async move { route_series(&gw.metrics_text().await, name, "route=\"interactive\"") }
    };
    while interactive("kvgate_gateway_route_in_flight").await < 1.0 {
        assert!(Instant::now() < deadline, "the first request never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = tokio::spawn(async move { c2.post(u2).json(&b2).send().await.unwrap().status() });
    while interactive("kvgate_gateway_route_queue_depth").await < 1.0 {
        assert!(Instant::now() < deadline, "the second request never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lines: Vec<Value> = (0..4)
        .map(|i| {
            json!({"custom_id": format!("b{i}"), "method": "POST", "url": "/v1/completions",
                   "body": {"model": "Qwen3-8B", "prompt": "Classify this.", "max_tokens": 2}})
        })
        .collect();
    let id = upload_batch(&gw.client, &gw.base, &lines).await;
    // While the interactive request waits, the runner looks many times and starts nothing.
    while interactive("kvgate_gateway_route_queue_depth").await >= 1.0 {
        let b = batch(&gw.base, &id).await;
        assert_eq!(b["request_counts"]["completed"], 0, "a line ran: {b}");
        let running = gw
            .metrics_text()
            .await
            .lines()
            .find_map(|l| {
                l.strip_prefix("kvgate_batch_lines{state=\"running\"} ")
                    .map(|v| v.trim().parse::<f64>().unwrap())
            })
            .unwrap_or(0.0);
        assert_eq!(
            running, 0.0,
            "a batch line started beside a waiting request"
        );
        assert!(Instant::now() < deadline, "the queue never drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(second.await.unwrap(), 200);
    // Then the trough opens and the batch runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let b = batch(&gw.base, &id).await;
        if b["status"] == "completed" {
            assert_eq!(b["request_counts"]["completed"], 4, "{b}");
            break;
        }
        assert!(Instant::now() < deadline, "the batch never ran: {b}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sum of `name`'s samples whose labels contain `label`.
fn route_series(metrics: &str, name: &str, label: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
