//! One gateway in front of several models (`[[models]]`): requests routed by their `model`
//! field to the replicas serving it, aliases forwarded as the model's name, each model's own
//! prompt limit, routes and prefix affinity, unknown models refused with the served names, and
//! `/v1/models` listing them all.

mod common;

use common::{exact_hit_signals, start_gateway, start_replica, tokenizer_dir, Replica};
use config::routes::PoolEntry;
use config::ModelConfig;
use serde_json::{json, Value};

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
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
        exact_hit_signals(c);
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
            if r.status() != 200 {
                panic!("{asked}: {} {:?}", r.status(), r.text().await);
            }
            assert!(pool.contains(&upstream), "{asked} went to {upstream}");
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
    let list: Value = gw
        .client
        .get(format!("{}/v1/models", gw.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
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

    // Each model has its own runtime of every route, over the replicas serving it.
    let policy = gw.admin_json("/admin/policy").await;
    let routes: Vec<(String, usize)> = policy["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["model"].as_str().unwrap().to_string(),
                r["pool"].as_array().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(
        routes,
        [("Qwen3-8B".to_string(), 2), ("Qwen3-mini".to_string(), 1)]
    );
}
