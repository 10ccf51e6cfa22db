//! Who may do what: the replicas' internal endpoints need the fleet token, the admin port its
//! bearer token, clients an API key whose tenant decides the cache scope and the priority
//! classes; a client's own `priority` is never forwarded, and hit signals are rounded.

mod common;

use common::{
    exact_hit_signals, start_gateway, start_gateway_at, start_replica, FakeMode, FakeReplica,
    FLEET_TOKEN,
};
use serde_json::{json, Value};

/// Removes a scratch folder when the test ends, passed or failed.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn chat(system: &str, user: &str) -> Value {
    json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    })
}

fn long_system(topic: &str) -> String {
    format!("You are the {topic} assistant number {topic}. ").repeat(100)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_replica_endpoints_need_the_fleet_token() {
    let r = start_replica(|_| {}).await;
    let plain = reqwest::Client::new();
    for (method, path) in [
        ("GET", "/kv_events"),
        ("POST", "/flush_cache"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ] {
        for auth in [None, Some("Bearer not-the-fleet-token-000000")] {
            let mut req = plain.request(method.parse().unwrap(), format!("{}{path}", r.base));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req
                .json(&json!({"tokens": [1, 2], "prompt": "x"}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 401, "{method} {path} with {auth:?}");
            let v: Value = resp.json().await.unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
        }
    }
    // The fleet's client (the test helper sends the token) is served.
    let ok = r.post("/detokenize", json!({"tokens": [9707]})).await;
    assert_eq!(ok.status(), 200);
    // Health, load and models stay open for routers and monitoring.
    for path in ["/health", "/get_load", "/v1/models", "/metrics"] {
        let resp = plain.get(format!("{}{path}", r.base)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_a_fleet_token_refuses_internal_endpoints_and_can_restrict_v1() {
    let open = start_replica(|c| c.fleet_token = None).await;
    let resp = open
        .client
        .get(format!("{}/kv_events", open.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "fleet_token_required");

    let restricted = start_replica(|c| c.restrict_api = true).await;
    let body = json!({"model": "Qwen3-8B", "prompt": "Hello", "max_tokens": 1});
    let plain = reqwest::Client::new();
    let direct = plain
        .post(format!("{}/v1/completions", restricted.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 401, "direct /v1 goes around admission");
    assert_eq!(restricted.post("/v1/completions", body).await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_needs_its_token() {
    let r = start_replica(|_| {}).await;
    let token = "admin-token-0123456789abcdef";
    let gw = start_gateway(&[&r], |c| c.auth.admin_token = Some(token.into())).await;
    for auth in [None, Some("Bearer bogus"), Some("Basic YWRtaW46YWRtaW4=")] {
        for path in ["/metrics", "/admin/policy", "/admin/replicas"] {
            let mut req = gw.client.get(format!("{}{path}", gw.admin));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{path} with {auth:?}");
        }
    }
    let reload = gw
        .client
        .post(format!("{}/admin/policy/reload", gw.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), 401);
    let ok = gw
        .client
        .get(format!("{}/admin/replicas", gw.admin))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let m = gw
        .client
        .get(format!("{}/metrics", gw.admin))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("kvgate_gateway_auth_failures_total{port=\"admin\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_port_beyond_loopback_without_a_token_is_refused_at_start() {
    let r = start_replica(|_| {}).await;
    let mut cfg = config::GatewayConfig::with_replicas(vec![r.host_port()]);
    cfg.model.tokenizer_dir = Some(common::tokenizer_dir().display().to_string());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let err = gateway::build_gateway(cfg, listener, admin)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("not loopback"), "{err}");
}

fn keys_file(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let p = dir.join("keys.toml");
    std::fs::write(
        &p,
        format!(
            "[[keys]]\nkey = \"sk-acme-0123456789abcdef\"\ntenant = \"acme\"\npriorities = [\"interactive\", \"batch\"]\n\
             [[keys]]\nkey = \"sk-beta-0123456789abcdef\"\ntenant = \"beta\"\n{extra}"
        ),
    )
    .unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_map_to_tenants_priority_classes_and_separate_caches() {
    let dir = std::env::temp_dir().join(format!("kvgate-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveOnDrop(dir.clone());
    let keys = keys_file(&dir, "");
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |c| {
        exact_hit_signals(c);
        c.auth.api_keys_file = Some(keys.display().to_string());
    })
    .await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let sys = long_system("billing");
    let send = |key: Option<&'static str>, prio: Option<&'static str>, body: Value| {
        let mut req = gw.client.post(url.clone()).json(&body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        if let Some(p) = prio {
            req = req.header("x-kvgate-priority", p);
        }
        req.send()
    };
    // No key, a wrong key: 401 with OpenAI's codes.
    let none = send(None, None, chat(&sys, "a")).await.unwrap();
    assert_eq!(none.status(), 401);
    assert_eq!(
        none.json::<Value>().await.unwrap()["error"]["code"],
        "missing_api_key"
    );
    let wrong = send(Some("sk-nobody-000000000000"), None, chat(&sys, "a"))
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert_eq!(
        wrong.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_api_key"
    );
    // beta may not use the batch class; acme may.
    let denied = send(
        Some("sk-beta-0123456789abcdef"),
        Some("batch"),
        chat(&sys, "a"),
    )
    .await
    .unwrap();
    assert_eq!(denied.status(), 403);
    let allowed = send(
        Some("sk-acme-0123456789abcdef"),
        Some("batch"),
        chat(&sys, "a"),
    )
    .await
    .unwrap();
    assert_eq!(allowed.status(), 200);
    // acme warmed the cache with this system prompt; beta must not hit it, acme must.
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let beta = send(Some("sk-beta-0123456789abcdef"), None, chat(&sys, "b"))
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(
        cached(&beta),
        0,
        "tenants do not share prefix blocks: {beta}"
    );
    let acme = send(Some("sk-acme-0123456789abcdef"), None, chat(&sys, "c"))
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert!(cached(&acme) > 0, "a tenant hits its own cache: {acme}");
    // A key added to the file works without a restart.
    keys_file(
        &dir,
        "[[keys]]\nkey = \"sk-gamma-0123456789abcdef\"\ntenant = \"gamma\"\n",
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = send(Some("sk-gamma-0123456789abcdef"), None, chat(&sys, "d"))
            .await
            .unwrap()
            .status();
        if s == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "new key never accepted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_decides_priority_and_salt_never_the_client() {
    let fake = FakeReplica::start(FakeMode::Stream { tokens: 2 }).await;
    let dir = std::env::temp_dir().join(format!("kvgate-prio-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveOnDrop(dir.clone());
    let keys = keys_file(&dir, "");
    let policy = dir.join("policy.toml");
    std::fs::write(
        &policy,
        "[policy]\nkind = \"round_robin\"\n[[routes]]\nname = \"batch\"\npriority = \"batch\"\nengine_priority = 10\n\
         [[routes]]\nname = \"interactive\"\n",
    )
    .unwrap();
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.auth.api_keys_file = Some(keys.display().to_string());
        c.policy_file = Some(policy.display().to_string());
    })
    .await;
    let mut body = chat("sys", "hi");
    body["priority"] = json!(-1000);
    body["cache_salt"] = json!("kvgate-tenant:acme");
    body["stream"] = json!(true);
    body["some_engine_extension"] = json!({"kept": true});
    let url = format!("{}/v1/chat/completions", gw.base);
    for prio in ["interactive", "batch"] {
        let r = gw
            .client
            .post(&url)
            .bearer_auth("sk-acme-0123456789abcdef")
            .header("x-kvgate-priority", prio)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.text().await;
    }
    let beta = gw
        .client
        .post(&url)
        .bearer_auth("sk-beta-0123456789abcdef")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(beta.status(), 200);
    let _ = beta.text().await;
    let seen = fake.bodies();
    assert_eq!(seen.len(), 3);
    assert!(
        seen[0].get("priority").is_none(),
        "forged priority stripped: {}",
        seen[0]
    );
    assert_eq!(seen[1]["priority"], 10, "the batch route's engine priority");
    assert_eq!(
        seen[0]["cache_salt"],
        "kvgate-tenant:acme/kvgate-tenant:acme"
    );
    assert_eq!(
        seen[2]["cache_salt"], "kvgate-tenant:beta/kvgate-tenant:acme",
        "another tenant cannot pick acme's cache scope"
    );
    assert_eq!(seen[0]["some_engine_extension"]["kept"], true);
    // The fleet token travels with every forwarded request.
    assert!(!FLEET_TOKEN.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hit_signals_are_rounded_by_default() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    let sys = long_system("rounding");
    for i in 0..3 {
        let resp = gw
            .post("/v1/chat/completions", chat(&sys, &format!("question {i}")))
            .await;
        assert_eq!(resp.status(), 200);
        let blocks: u64 = resp
            .headers()
            .get("x-kvgate-matched-blocks")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let v: Value = resp.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(cached % 256, 0, "{v}");
        assert_eq!(blocks % 16, 0);
        if i > 0 {
            assert!(
                cached >= 256,
                "the shared ~900-token prefix still shows: {v}"
            );
        }
    }
}

/// vLLM's habits: `--api-key` guards /v1/* (the fleet token still gets the gateway through),
/// `/reset_prefix_cache` flushes the cache, and the gateway can serve `/metrics` on its API
/// port for load clients that look there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_habits_api_key_reset_prefix_cache_and_metrics_on_the_api_port() {
    let r = start_replica(|c| c.api_key = Some("sk-replica-key".into())).await;
    let body = json!({"model": "Qwen3-8B", "prompt": "Hello", "max_tokens": 1});
    let plain = reqwest::Client::new();
    let url = format!("{}/v1/completions", r.base);
    let none = plain.post(&url).json(&body).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let v: Value = none.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let keyed = plain
        .post(&url)
        .bearer_auth("sk-replica-key")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(keyed.status(), 200);
    let gw = start_gateway(&[&r], |c| c.downstream.metrics_on_api_port = true).await;
    assert_eq!(gw.post("/v1/completions", body.clone()).await.status(), 200);
    let flushed = r.post("/reset_prefix_cache", json!({})).await;
    assert_eq!(flushed.status(), 200);
    let v: Value = flushed.json().await.unwrap();
    assert!(v["flushed_blocks"].is_u64(), "{v}");
    let m = plain
        .get(format!("{}/metrics", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(m.status(), 200);
    let text = m.text().await.unwrap();
    assert!(text.contains("kvgate_gateway_requests_total"), "{text}");
    // Off by default.
    let quiet = start_gateway(&[&r], |_| {}).await;
    let m = plain
        .get(format!("{}/metrics", quiet.base))
        .send()
        .await
        .unwrap();
    assert_eq!(m.status(), 404);
}
