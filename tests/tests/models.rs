//! One gateway in front of several models (`[[models]]`): requests routed by their `model`
//! field to the replicas serving it, aliases forwarded as the model's name, each model's own
//! prompt limit, routes and prefix affinity, unknown models refused with the served names, and
//! `/v1/models` listing them all.

mod common;

use common::{
    start_gateway, start_gateway_at, start_replica, tokenizer_dir, FakeMode, FakeReplica, Replica,
};
use config::routes::PoolEntry;
use config::ModelConfig;
use serde_json::{json, Value};

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

/// The ids `GET /v1/models` lists at `base`, in order.
async fn model_ids(client: &reqwest::Client, base: &str) -> Vec<String> {
    let list: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

fn model(name: &str, aliases: &[&str], pool: &[&Replica]) -> ModelConfig {
    ModelConfig {
        name: name.into(),
        aliases: aliases.iter().map(|a| a.to_string()).collect(),
        tokenizer_dir: Some(tokenizer_dir().display().to_string()),
        replicas: pool
            .iter()
            .map(|r| PoolEntry::Name(r.host_port()))
            .collect(),
        ..ModelConfig::default()
    }
}

fn chat(model: &str, system: &str, user: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "ignore_eos": true,
    })
}

const SYSTEM: &str = "You are the billing assistant. Answer in two sentences, cite the billing \
    handbook by section, never guess figures, and hand over to a human when the customer asks \
    for one. The handbook covers onboarding, billing, outages, data retention and refunds.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_on_disjoint_pools_are_routed_by_the_model_field() {
    let big = [
        start_replica(|c| c.replica_id = "big-0".into()).await,
        start_replica(|c| c.replica_id = "big-1".into()).await,
    ];
    let small = start_replica(|c| {
        c.replica_id = "small-0".into();
        c.served_model_name = Some("Qwen3-mini".into());
    })
    .await;
    let mut mini = model("Qwen3-mini", &[], &[&small]);
    mini.max_model_len = Some(40);
    let gw = start_gateway(&[&big[0], &big[1], &small], |c| {
        c.model = ModelConfig::default();
        c.models = vec![model("Qwen3-8B", &["default"], &[&big[0], &big[1]]), mini];
        // A route of its own for the small model (first for it), the catch-all for both.
        let routes = "hit_signals = \"exact\"\n[policy]\nkind = \"prefix_aware\"\n\
                      [[routes]]\nname = \"small\"\nmodels = [\"Qwen3-mini\"]\n\
                      [[routes]]\nname = \"default\"\n";
        c.embedded_policy = Some(config::PolicyFile::from_toml(routes, &c.replicas).unwrap());
    })
    .await;

    // Each model's requests stay on its own replicas; the alias reaches the replica as the
    // model's name (a kvgate replica refuses any other).
    for (asked, pool) in [
        ("Qwen3-8B", vec![big[0].host_port(), big[1].host_port()]),
        ("default", vec![big[0].host_port(), big[1].host_port()]),
        ("Qwen3-mini", vec![small.host_port()]),
    ] {
        for i in 0..4 {
            let r = gw
                .post(
                    "/v1/chat/completions",
                    chat(asked, "Be brief.", &format!("q{i}")),
                )
                .await;
            let upstream = header(&r, "x-kvgate-upstream");
            let route = header(&r, "x-kvgate-route");
            if r.status() != 200 {
                panic!("{asked}: {} {:?}", r.status(), r.text().await);
            }
            assert!(pool.contains(&upstream), "{asked} went to {upstream}");
            let want = if asked == "Qwen3-mini" {
                "small"
            } else {
                "default"
            };
            assert_eq!(route, want, "{asked}");
            let v: Value = r.json().await.unwrap();
            let served = if asked == "Qwen3-mini" {
                asked
            } else {
                "Qwen3-8B"
            };
            assert_eq!(v["model"], served);
        }
    }

    // Prefix affinity within the model: the second request sharing a system prompt follows
    // the first to its holder, on the model's own pool.
    let first = gw
        .post("/v1/chat/completions", chat("Qwen3-8B", SYSTEM, "first"))
        .await;
    assert_eq!(first.status(), 200);
    let home = header(&first, "x-kvgate-upstream");
    let second = gw
        .post("/v1/chat/completions", chat("default", SYSTEM, "second"))
        .await;
    assert_eq!(second.status(), 200);
    assert_eq!(header(&second, "x-kvgate-upstream"), home);
    assert_eq!(header(&second, "x-kvgate-route-reason"), "prefix_match");

    // Explain names the model an alias stands for, and its route.
    let e = gw.explain(&chat("default", SYSTEM, "third")).await;
    assert_eq!(
        (e["model"].as_str(), e["route"].as_str()),
        (Some("Qwen3-8B"), Some("default"))
    );
    let e = gw.explain(&chat("Qwen3-mini", "Be brief.", "q")).await;
    assert_eq!(
        (e["model"].as_str(), e["route"].as_str()),
        (Some("Qwen3-mini"), Some("small"))
    );
    assert!(
        e["route_matched_because"]
            .as_str()
            .unwrap()
            .contains("models"),
        "{e}"
    );

    // Each model's own prompt limit: the system prompt is over Qwen3-mini's 40 tokens.
    let long = gw
        .post("/v1/chat/completions", chat("Qwen3-mini", SYSTEM, "q"))
        .await;
    assert_eq!(long.status(), 400);
    let v: Value = long.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");

    // An unknown model is a 404 naming every served name; a missing one a 400.
    let r = gw
        .post("/v1/chat/completions", chat("gpt-4o", "x", "y"))
        .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("`Qwen3-8B`, `default` or `Qwen3-mini`"),
        "{msg}"
    );
    let r = gw
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "missing_model");

    // /v1/models lists every model and alias; an alias's card names its model as root.
    let ids = model_ids(&gw.client, &gw.base).await;
    assert_eq!(ids, ["Qwen3-8B", "default", "Qwen3-mini"]);
    let alias: Value = gw
        .client
        .get(format!("{}/v1/models/default", gw.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(alias["root"], "Qwen3-8B");
    let gone = gw
        .client
        .get(format!("{}/v1/models/gpt-4o", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);

    // The hit ratio per model: its prompt tokens, and those expected cached (the shared
    // system prompt's second request on Qwen3-8B).
    let text = gw.metrics_text().await;
    let series = |name: &str, model: &str| -> f64 {
        let head = format!("{name}{{model=\"{model}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&head)?.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(series("kvgate_gateway_model_prompt_tokens_total", "Qwen3-mini") > 0.0);
    assert!(series("kvgate_gateway_model_prompt_tokens_total", "Qwen3-8B") > 0.0);
    assert!(
        series(
            "kvgate_gateway_model_predicted_hit_tokens_total",
            "Qwen3-8B"
        ) >= 32.0
    );
    assert_eq!(
        series(
            "kvgate_gateway_model_predicted_hit_tokens_total",
            "Qwen3-mini"
        ),
        0.0
    );

    // Route series carry the model beside the route.
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvgate_gateway_route_requests_total{")
                && l.contains("route=\"small\"")
                && l.contains("model=\"Qwen3-mini\"")),
        "{text}"
    );

    // Each model has its own runtime of every route, over the replicas serving it.
    let policy = gw.admin_json("/admin/policy").await;
    let routes: Vec<String> = policy["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{} {} {}",
                r["model"].as_str().unwrap(),
                r["name"].as_str().unwrap(),
                r["pool"].as_array().unwrap().len()
            )
        })
        .collect();
    assert_eq!(
        routes,
        // (Qwen3-mini's routes end at its own catch-all: the shared one never sees it.)
        ["Qwen3-8B default 2", "Qwen3-mini small 1"]
    );
}

/// The gateway file with `replicas` and one `[[models]]` entry per `(name, replica, tokenizer)`.
fn gateway_file(replicas: &[&Replica], models: &[(&str, &Replica, &str)]) -> String {
    let list: Vec<String> = replicas
        .iter()
        .map(|r| format!("{:?}", r.host_port()))
        .collect();
    let mut text = format!("replicas = [{}]\n", list.join(", "));
    for (name, r, tok) in models {
        text.push_str(&format!(
            "[[models]]\nname = {name:?}\ntokenizer_dir = {tok:?}\nreplicas = [{:?}]\n",
            r.host_port()
        ));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_and_removes_a_model_under_load_and_refuses_a_bad_entry_whole() {
    let big = start_replica(|c| c.replica_id = "big".into()).await;
    let small = start_replica(|c| {
        c.replica_id = "small".into();
        c.served_model_name = Some("Qwen3-mini".into());
    })
    .await;
    let tok = tokenizer_dir().display().to_string();
    let path = std::env::temp_dir().join(format!("kvgate-models-{}.toml", std::process::id()));
    std::fs::write(&path, gateway_file(&[&big], &[("Qwen3-8B", &big, &tok)])).unwrap();
    let gw = start_gateway(&[&big], |c| {
        c.model = ModelConfig::default();
        c.models = vec![model("Qwen3-8B", &[], &[&big])];
        c.config_path = Some(path.clone());
    })
    .await;

    // Load on the first model for the whole test: nothing may fail while models come and go.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Four clients in a loop, so requests are in flight at every reload.
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (client, base, stop) = (gw.client.clone(), gw.base.clone(), stop.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = client
                        .post(format!("{base}/v1/chat/completions"))
                        .json(&chat("Qwen3-8B", "Be brief.", "load"))
                        .send()
                        .await
                        .unwrap();
                    statuses.push(r.status().as_u16());
                }
                statuses
            })
        })
        .collect();
    let reload = || async {
        let r = gw
            .client
            .post(format!("{}/admin/replicas/reload", gw.admin))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    let ask = |m: &'static str| {
        let gw = &gw;
        async move {
            let r = gw
                .post("/v1/chat/completions", chat(m, "Be brief.", "hi"))
                .await;
            (r.status().as_u16(), header(&r, "x-kvgate-upstream"))
        }
    };
    assert_eq!(ask("Qwen3-mini").await.0, 404);

    // Added: a second model on a new replica, without a restart.
    std::fs::write(
        &path,
        gateway_file(
            &[&big, &small],
            &[("Qwen3-8B", &big, &tok), ("Qwen3-mini", &small, &tok)],
        ),
    )
    .unwrap();
    let (status, body) = reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["models"], json!(["Qwen3-8B", "Qwen3-mini"]));
    // (The test's gateway was started with faster health checks than the file's: those
    // sections are named, the models are not.)
    let restart = body["needs_restart"].as_array().unwrap();
    assert!(!restart.iter().any(|s| s == "models"), "{body}");
    gw.wait_admin("/admin/replicas", "the new replica healthy", |v| {
        v.as_array().is_some_and(|a| {
            a.iter()
                .any(|r| r["healthy"] == true && r["model"] == "Qwen3-mini")
        })
    })
    .await;
    assert_eq!(ask("Qwen3-mini").await, (200, small.host_port()));

    // A bad entry is refused whole: the models in force stay.
    let mut bad = gateway_file(
        &[&big, &small],
        &[("Qwen3-8B", &big, &tok), ("Qwen3-mini", &small, &tok)],
    );
    bad.push_str(
        "[[models]]\nname = \"broken\"\ntokenizer_dir = \"/nonexistent\"\nreplicas = [0]\n",
    );
    std::fs::write(&path, bad).unwrap();
    let (status, body) = reload().await;
    assert_eq!(status, 400, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("broken") && msg.contains("/nonexistent"),
        "{msg}"
    );
    assert_eq!(ask("Qwen3-mini").await.0, 200);
    assert_eq!(ask("broken").await.0, 404);

    // Removed, with its replica.
    std::fs::write(&path, gateway_file(&[&big], &[("Qwen3-8B", &big, &tok)])).unwrap();
    let (status, body) = reload().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["models"], json!(["Qwen3-8B"]));
    assert_eq!(ask("Qwen3-mini").await.0, 404);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut statuses = Vec::new();
    for l in load {
        statuses.extend(l.await.unwrap());
    }
    assert!(
        statuses.len() >= 8,
        "{} requests under load",
        statuses.len()
    );
    assert!(
        statuses.iter().all(|&s| s == 200),
        "a request failed while models changed: {statuses:?}"
    );
    let _ = std::fs::remove_file(&path);
}

/// `kvgate up --also cpu`: the sim fleet's model and the real SmolLM2 on the CPU behind one
/// gateway, each request answered by its own model's replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_also_cpu_serves_the_sim_model_and_the_real_one() {
    let (mut child, url) =
        common::start_kvgate_up(&["--replicas", "2", "--also", "cpu"], &[]).await;
    let client = reqwest::Client::new();
    let ids = model_ids(&client, &url).await;
    assert_eq!(ids, ["Qwen3-8B", "SmolLM2-135M-Instruct.Q4_1"]);
    for id in ids {
        let r = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&json!({"model": id, "max_tokens": 4,
                "messages": [{"role": "user", "content": "The capital of France is"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{id}");
        let replica = header(&r, "x-kvgate-replica");
        let want = if id == "Qwen3-8B" {
            "replica-"
        } else {
            "cpu-replica-"
        };
        assert!(replica.starts_with(want), "{id} answered by {replica}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["model"], id);
    }
    let _ = child.kill().await;
}

/// Two base models sharing a replica (engines that serve several, such as vLLM with several
/// models loaded): each model's requests stay on the replicas serving it, and the shared
/// replica's cache credits each model only with its own prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_sharing_a_replica_keep_their_pools_and_their_prefixes_apart() {
    let engines = [
        FakeReplica::start(FakeMode::Stream { tokens: 2 }).await,
        FakeReplica::start(FakeMode::Stream { tokens: 2 }).await,
    ];
    let addrs: Vec<String> = engines.iter().map(|e| e.addr.clone()).collect();
    let entry = |name: &str, pool: &[&String]| ModelConfig {
        name: name.into(),
        tokenizer_dir: Some(tokenizer_dir().display().to_string()),
        replicas: pool.iter().map(|a| PoolEntry::Name((*a).clone())).collect(),
        ..ModelConfig::default()
    };
    let gw = start_gateway_at(&addrs, |c| {
        c.model = ModelConfig::default();
        c.models = vec![
            entry("chat", &[&addrs[0], &addrs[1]]),
            entry("code", &[&addrs[1]]),
        ];
    })
    .await;
    let body = |model: &str, i: usize| {
        json!({"model": model, "stream": true, "max_tokens": 2,
               "prompt": format!("{SYSTEM} Ticket {i}: the invoice total is wrong.")})
    };
    for i in 0..6 {
        for model in ["chat", "code"] {
            let r = gw.post("/v1/completions", body(model, i)).await;
            assert_eq!(r.status(), 200);
            let upstream = header(&r, "x-kvgate-upstream");
            if model == "code" {
                assert_eq!(upstream, addrs[1], "code must stay on its replica");
            }
            let _ = r.text().await;
        }
    }
    // Both models' bodies reached the shared replica with their own names.
    let names: std::collections::HashSet<String> = engines[1]
        .bodies()
        .iter()
        .map(|b| b["model"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains("code"), "{names:?}");
    assert!(engines[0].bodies().iter().all(|b| b["model"] == "chat"));
    // The prefix the shared replica holds for one model is no hit for the other: a new
    // prompt sent for `chat` only matches for `chat`.
    let fresh = |model: &str| {
        json!({"model": model, "max_tokens": 1,
               "prompt": "Only the chat model was ever asked this: summarise the quarterly \
                          report in three bullet points, then list the open risks and the owner \
                          of each, and end with the next review date."})
    };
    let mut sent = fresh("chat");
    sent["stream"] = json!(true);
    let r = gw.post("/v1/completions", sent).await;
    assert_eq!(r.status(), 200);
    let home = header(&r, "x-kvgate-upstream");
    let _ = r.text().await;
    let slot = addrs.iter().position(|a| *a == home).unwrap();
    let matched = |e: &Value| e["replicas"][slot]["matched_blocks"].as_u64().unwrap();
    assert!(matched(&gw.explain(&fresh("chat")).await) > 0);
    assert_eq!(matched(&gw.explain(&fresh("code")).await), 0);
}
