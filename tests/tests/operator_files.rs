//! The operator files name only metrics the code really exports: every `kvgate_*` name in
//! `config/alerts.yml`, `config/dashboard.json` and the Kubernetes manifests (`config/k8s`)
//! must appear on a running replica's or gateway's `/metrics`.

mod common;

use std::collections::BTreeSet;

use common::{start_gateway, start_replica};
use serde_json::json;

fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("kvgate_") {
            out.insert(word.to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_and_dashboard_use_exported_metric_names() {
    let rep = start_replica(|_| {}).await;
    // Priced and with a peer listed, so the cost and peer series exist too.
    let gw = start_gateway(&[&rep], |c| {
        c.cost.gpu_hour_usd = Some(2.0);
        c.cost.managed_usd_per_mtok = Some(0.5);
        c.peers.addrs = vec!["127.0.0.1:1".into()];
        // The Batch API on, so its series exist too.
        c.batch.path = Some(
            std::env::temp_dir()
                .join(format!(
                    "kvgate-operator-files-{}.sqlite3",
                    std::process::id()
                ))
                .display()
                .to_string(),
        );
    })
    .await;
    // Traffic, so every labelled series exists.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "hello there", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut exported = BTreeSet::new();
    for url in [
        format!("{}/metrics", rep.base),
        format!("{}/metrics", gw.admin),
    ] {
        let text = gw
            .client
            .get(url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        exported.extend(metric_names(&text));
    }
    // Histograms are named by their series (_bucket, _sum, _count).
    let exported: BTreeSet<String> = exported
        .iter()
        .flat_map(|n| {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .map(str::to_string);
            std::iter::once(n.clone()).chain(base)
        })
        .collect();
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let mut files = vec![config.join("alerts.yml"), config.join("dashboard.json")];
    let mut dirs = vec![config.join("k8s")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                files.push(p);
            }
        }
    }
    for f in files {
        let used = metric_names(&std::fs::read_to_string(&f).unwrap());
        let missing: Vec<&String> = used.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "{} names metrics nobody exports: {missing:?}",
            f.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_records_route_replica_tokens_and_timers() {
    let rep = start_replica(|_| {}).await;
    let path = std::env::temp_dir().join(format!("kvgate-access-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let p = path.display().to_string();
    let gw = start_gateway(&[&rep], |c| {
        c.access_log.mode = config::gateway::AccessLogMode::Full;
        c.access_log.path = p;
    })
    .await;
    let ok = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3, "stream": true}),
        )
        .await;
    assert_eq!(ok.status(), 200);
    let _ = ok.text().await;
    let bad = gw
        .post("/v1/completions", json!({"model": "nope", "prompt": "x"}))
        .await;
    assert_eq!(bad.status(), 404);
    // The line is written as the request ends, which may be just after the client has its
    // answer: poll (bounded) rather than read once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() >= 2 || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let _ = std::fs::remove_file(&path);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    // Lines are written as requests end: the stream may end after the 404 did.
    let a = lines.iter().find(|l| l["status"] == 200).expect(&text);
    let missing = lines.iter().find(|l| l["status"] == 404).expect(&text);
    assert_eq!(a["route"], "default");
    assert_eq!(a["replica"], "test-replica", "the id the replica reports");
    assert_eq!(a["address"], rep.host_port());
    assert!(a["reason"].is_string() && a["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(a["ttft_ms"].as_f64().is_some() && a["e2e_ms"].as_f64().is_some());
    assert_eq!(a["output_tokens"], 3);
    // What the prediction was made of: the whole prompt cold, nothing in front of it on an
    // idle replica.
    assert!(
        a["predicted_ttft_ms"].as_f64().is_some_and(|t| t > 0.0),
        "{a}"
    );
    assert_eq!(a["predicted_uncached_tokens"], a["prompt_tokens"], "{a}");
    assert_eq!(a["ahead_tokens"], 0, "{a}");
    assert_eq!(a["step_wait_ms"].as_f64(), Some(0.0), "{a}");
    assert!(missing["ttft_ms"].is_null(), "{missing}");
    assert!(!text.contains("hi\""), "prompts are never logged");
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holds_reason_and_time_reach_the_access_log_and_the_metric() {
    // One request at a time on the route: the second of two concurrent requests is held for
    // `concurrency` until the first ends.
    let rep = start_replica(|c| c.time_scale = 2.0).await;
    let file = common::PolicyFileOnDisk::new(
        "holds",
        "version = \"holds-1\"\n[policy]\nkind = \"round_robin\"\n[[routes]]\nname = \"one\"\nmax_concurrency = 1\n",
    );
    let path = std::env::temp_dir().join(format!("kvgate-holds-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let (log, policy) = (path.display().to_string(), file.path.display().to_string());
    let gw = start_gateway(&[&rep], |c| {
        c.access_log.mode = config::gateway::AccessLogMode::Full;
        c.access_log.path = log;
        c.policy_file = Some(policy);
    })
    .await;
    let body = |i: u32| {
        json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": format!("question {i}")}],
               "max_tokens": 40, "ignore_eos": true})
    };
    let (a, b) = tokio::join!(
        gw.post("/v1/chat/completions", body(1)),
        gw.post("/v1/chat/completions", body(2))
    );
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() >= 2 || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let _ = std::fs::remove_file(&path);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let held: Vec<&serde_json::Value> = lines.iter().filter(|l| l["holds"].is_array()).collect();
    assert_eq!(held.len(), 1, "exactly one of the two waited: {text}");
    let span = &held[0]["holds"][0];
    assert_eq!(span["reason"], "concurrency", "{text}");
    let ms = span["ms"].as_f64().unwrap();
    assert!(ms > 0.0, "{text}");
    assert!(
        held[0]["queue_ms"].as_f64().unwrap() >= ms - 1.0,
        "the hold is inside the queue time"
    );
    let metrics = gw.metrics_text().await;
    let count = metrics
        .lines()
        .find(|l| {
            l.starts_with("kvgate_gateway_hold_seconds_count")
                && l.contains("route=\"one\"")
                && l.contains("reason=\"concurrency\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(count, Some(1.0), "{metrics}");
}

fn kvgate_binary() -> std::path::PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/kvgate");
    assert!(
        bin.exists(),
        "build the binary first (scripts/test.sh does)"
    );
    bin
}

#[test]
fn gateway_check_validates_every_file_and_exits() {
    let bin = kvgate_binary();
    let dir = std::env::temp_dir().join(format!("kvgate-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("gateway.toml"),
        "replicas = [\"http://127.0.0.1:8001\", \"127.0.0.1:8002\"]\npolicy_file = \"policy.toml\"\n",
    )
    .unwrap();
    std::fs::write(dir.join("policy.toml"), config::routes::DEFAULT_POLICY).unwrap();
    let run = || {
        std::process::Command::new(&bin)
            .args(["gateway", "--check", "--config"])
            .arg(dir.join("gateway.toml"))
            .env_remove("KVGATE_ADMIN_TOKEN")
            .env_remove("KVGATE_FLEET_TOKEN")
            .env_remove("KVGATE_API_KEYS")
            .output()
            .unwrap()
    };
    let good = run();
    let out = String::from_utf8_lossy(&good.stdout);
    assert!(
        good.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&good.stderr)
    );
    assert!(out.contains("routes: long, batch, interactive"), "{out}");
    std::fs::write(dir.join("policy.toml"), "").unwrap();
    let bad = run();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("must list its [[routes]]"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kvgate_up_refuses_a_bad_policy_file_before_starting_replicas() {
    let bin = kvgate_binary();
    let path = std::env::temp_dir().join(format!("kvgate-up-bad-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "version = \"x\"\nadmission_headroom = 2.0\n[policy]\nkind = \"prefix_aware\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(&bin)
        .args(["up", "--port", "0", "--admin-port", "0", "--policy-file"])
        .arg(&path)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("is invalid") && stderr.contains("admission_headroom"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("replica"),
        "no replica was started: {stdout}"
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_list_reloads_from_the_gateway_file() {
    let a = start_replica(|c| c.replica_id = "a".into()).await;
    let b = start_replica(|c| c.replica_id = "b".into()).await;
    let dir = std::env::temp_dir().join(format!("kvgate-list-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gateway.toml");
    let write = |list: &[&str]| {
        let tmp = dir.join("gateway.toml.new");
        let quoted: Vec<String> = list.iter().map(|r| format!("\"http://{r}\"")).collect();
        std::fs::write(&tmp, format!("replicas = [{}]\n", quoted.join(", "))).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    write(&[&a.host_port()]);
    let path = file.clone();
    let gw = start_gateway(&[&a], |c| {
        c.config_path = Some(path);
        c.policy = config::PolicyConfig::RoundRobin;
    })
    .await;
    let served_by = |n: usize| {
        let gw = &gw;
        async move {
            let mut seen = BTreeSet::new();
            for i in 0..n {
                let r = gw
                    .post(
                        "/v1/completions",
                        json!({"model": "Qwen3-8B", "prompt": format!("q{i}"), "max_tokens": 1}),
                    )
                    .await;
                assert_eq!(r.status(), 200);
                seen.insert(
                    r.headers()["x-kvgate-replica"]
                        .to_str()
                        .unwrap()
                        .to_string(),
                );
            }
            seen
        }
    };
    assert_eq!(served_by(4).await, BTreeSet::from(["a".to_string()]));
    // Add b: picked up from the file within a few seconds, admitted, used.
    write(&[&a.host_port(), &b.host_port()]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let v = gw.admin_json("/admin/replicas").await;
        let healthy = v
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["healthy"] == true)
            .count();
        if healthy == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b never admitted: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(served_by(4).await.len(), 2);
    // Remove a: no new request reaches it.
    write(&[&b.host_port()]);
    let r = gw
        .client
        .post(format!("{}/admin/replicas/reload", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The file's [policy] (the default, prefix_aware) is not the round-robin in force: named
    // as needing a restart, not applied. The replica list is not named: it reloaded.
    let body: serde_json::Value = r.json().await.unwrap();
    let restart: Vec<&str> = body["needs_restart"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(restart.contains(&"policy"), "{body}");
    assert!(!restart.contains(&"replicas"), "{body}");
    assert_eq!(served_by(4).await, BTreeSet::from(["b".to_string()]));
    // A list the policy cannot take is refused whole.
    let bad = dir.join("gateway.toml.bad");
    std::fs::write(&bad, "replicas = []\n").unwrap();
    std::fs::rename(&bad, &file).unwrap();
    let r = gw
        .client
        .post(format!("{}/admin/replicas/reload", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(served_by(2).await, BTreeSet::from(["b".to_string()]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fleet is set through the admin API, past 64 replicas (one prefix-index group), and every
/// replica is known by the id it reports, with its address beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_grows_the_fleet_past_64_and_replicas_keep_their_own_ids() {
    let a = start_replica(|c| c.replica_id = "alpha".into()).await;
    let b = start_replica(|c| c.replica_id = "beta".into()).await;
    let gw = start_gateway(&[&a], common::exact_hit_signals).await;
    // 70 addresses nothing listens on (refused at once), then b: b takes slot 71.
    let mut list: Vec<String> = vec![a.host_port()];
    list.extend((1..=70).map(|p| format!("127.0.0.1:{p}")));
    list.push(b.host_port());
    let put = |body: serde_json::Value| {
        gw.client
            .put(format!("{}/admin/replicas", gw.admin))
            .json(&body)
            .send()
    };
    let r = put(json!({"replicas": list})).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["replicas"].as_array().unwrap().len(), 72);
    // b is admitted and labelled by its own id.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let v = gw.admin_json("/admin/replicas").await;
        let beta = v
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == b.host_port())
            .cloned();
        if beta.as_ref().is_some_and(|r| r["healthy"] == true) {
            assert_eq!(beta.unwrap()["replica"], "beta");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "b never admitted: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let metrics = gw.metrics_text().await;
    let series = format!(
        "kvgate_gateway_replica_healthy{{replica=\"beta\",address=\"{}\"}} 1",
        b.host_port()
    );
    assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    // Shrink to the dead addresses and b: b keeps slot 71 (the second index group), a retires.
    let r = put(json!({"replicas": list[1..].to_vec()})).await.unwrap();
    assert_eq!(r.status(), 200);
    // A prompt cached at b is matched there: the index works past slot 63.
    let prompt = "The fleet grows without a restart. ".repeat(30);
    let body = json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": 1});
    let first = gw.post("/v1/completions", body.clone()).await;
    assert_eq!(first.headers()["x-kvgate-replica"], "beta");
    let second = gw.post("/v1/completions", body.clone()).await;
    assert_eq!(second.headers()["x-kvgate-route-reason"], "prefix_match");
    // Explain and the metrics use the same identity: the id, with the address beside it.
    let e = gw.explain(&body).await;
    assert_eq!(e["replicas"][71]["replica"], "beta", "{e}");
    assert_eq!(e["replicas"][71]["address"], b.host_port());
    assert!(
        e["replicas"][71]["matched_blocks"].as_u64().unwrap() > 0,
        "{e}"
    );
    assert_eq!(e["holders"][0]["replica"], "beta");
    assert_eq!(
        e["replicas"][0]["replica"], "alpha",
        "retired, still listed by slot"
    );
    // Bad bodies and bad lists are refused, and the fleet stays.
    for bad in [
        json!({"replicas": []}),
        json!({"replica": ["a:1"]}),
        json!({"replicas": ["https://x:1"]}),
    ] {
        let r = put(bad.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    assert_eq!(
        gw.admin_json("/admin/replicas")
            .await
            .as_array()
            .unwrap()
            .len(),
        71
    );
    // Shrinking further: b alone.
    let r = put(json!({"replicas": [b.host_port()]})).await.unwrap();
    assert_eq!(r.status(), 200);
    let second = gw.post("/v1/completions", body).await;
    assert_eq!(second.headers()["x-kvgate-replica"], "beta");
}

/// A gateway with no listed replicas finds its fleet through DNS: `localhost:port` resolves to
/// the loopback address a replica listens on, which joins the fleet and serves; a replica added
/// through the admin API joins beside it without dropping it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_is_found_through_dns_and_joined_to_the_listed_replicas() {
    let a = start_replica(|c| c.replica_id = "found".into()).await;
    let b = start_replica(|c| c.replica_id = "listed".into()).await;
    let port = a.host_port().rsplit_once(':').unwrap().1.to_string();
    let gw = start_gateway(&[], |c| {
        c.replicas = vec![];
        c.discovery.dns = vec![format!("localhost:{port}")];
        c.discovery.every_s = 1;
        c.policy = config::PolicyConfig::RoundRobin;
    })
    .await;
    let names = |v: serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_string())
            .collect()
    };
    let v = gw.admin_json("/admin/replicas").await;
    assert!(names(v.clone()).contains(&a.host_port()), "{v}");
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "found by name", "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvgate-replica"], "found");
    // The listed part is set through the admin API; the discovered replicas stay.
    let r = gw
        .client
        .put(format!("{}/admin/replicas", gw.admin))
        .json(&json!({"replicas": [b.host_port()]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    let fleet: Vec<String> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    assert!(fleet.contains(&b.host_port()), "{v}");
    assert!(fleet.contains(&a.host_port()), "{v}");
    // An empty listed part is accepted when discovery supplies the fleet.
    let r = gw
        .client
        .put(format!("{}/admin/replicas", gw.admin))
        .json(&json!({"replicas": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!names(gw.admin_json("/admin/replicas").await).contains(&b.host_port()));
    let metrics = gw.metrics_text().await;
    let series = format!("kvgate_gateway_discovered_replicas{{name=\"localhost:{port}\"}}");
    assert!(metrics.contains(&series), "no {series} in\n{metrics}");
}
