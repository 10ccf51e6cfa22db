//! The gateway in front of real replicas, all on 127.0.0.1:0.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{exact_hit_signals, start_gateway, start_replica};
use futures::StreamExt;
use protocol::sse::{SseDecoder, SseEvent};
use serde_json::{json, Value};

fn system_prompt(topic: &str) -> String {
    format!(
        "You are the {topic} assistant. Answer in two sentences, cite the {topic} handbook by \
         section, never guess figures, and hand over to a human when the customer asks for one. \
         The handbook covers onboarding, billing, outages, data retention and {topic} specifics."
    )
}

fn chat(system: &str, user: &str) -> Value {
    json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "ignore_eos": true,
    })
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_stick_and_distinct_prefixes_spread() {
    let reps = [
        start_replica(|c| c.replica_id = "r0".into()).await,
        start_replica(|c| c.replica_id = "r1".into()).await,
        start_replica(|c| c.replica_id = "r2".into()).await,
        start_replica(|c| c.replica_id = "r3".into()).await,
    ];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let sys = system_prompt("billing");
    let mut homes = HashSet::new();
    for i in 0..6 {
        let r = gw
            .post("/v1/chat/completions", chat(&sys, &format!("question {i}")))
            .await;
        assert_eq!(r.status(), 200);
        homes.insert(header(&r, "x-kvgate-replica"));
        if i > 0 {
            assert_eq!(header(&r, "x-kvgate-route-reason"), "prefix_match");
        }
    }
    assert_eq!(homes.len(), 1, "one system prompt, one replica: {homes:?}");
    let mut spread = HashSet::new();
    for topic in [
        "travel",
        "legal",
        "hardware",
        "gardening",
        "payroll",
        "shipping",
        "security",
        "music",
        "insurance",
        "catering",
        "plumbing",
        "astronomy",
        "recruiting",
        "pharmacy",
        "forestry",
        "aviation",
    ] {
        let r = gw
            .post("/v1/chat/completions", chat(&system_prompt(topic), "hi"))
            .await;
        assert_eq!(r.status(), 200);
        spread.insert(header(&r, "x-kvgate-replica"));
    }
    // Sixteen new prefixes on an idle fleet land by the rendezvous hash of their first block
    // (the replicas' addresses vary per run): all on two of four replicas has odds of ~1e-4.
    assert!(spread.len() >= 3, "distinct prefixes spread: {spread:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_blocks_equal_the_replicas_cached_tokens() {
    let reps = [start_replica(|_| {}).await, start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), exact_hit_signals).await;
    let sys = system_prompt("parity");
    let long_prefix = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let requests = [
        ("/v1/chat/completions", chat(&sys, "first")),
        (
            "/v1/chat/completions",
            chat(&sys, "second, a different question"),
        ),
        ("/v1/chat/completions", chat(&sys, "first")),
        (
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": format!("{long_prefix} one"), "max_tokens": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": format!("{long_prefix} two"), "max_tokens": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": format!("{long_prefix} two"), "max_tokens": 2, "cache_salt": "tenant-b"}),
        ),
    ];
    let mut hits = 0;
    for (path, body) in requests {
        let r = gw.post(path, body.clone()).await;
        assert_eq!(r.status(), 200);
        let predicted: usize = header(&r, "x-kvgate-matched-blocks").parse().unwrap();
        let v: Value = r.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize;
        assert_eq!(predicted * 16, cached, "{path} {body}");
        hits += usize::from(cached > 0);
    }
    assert!(hits >= 3, "the shared prefixes did hit");
    assert!(gw.metric("kvgate_gateway_predicted_hit_tokens_total").await > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_is_retried_around_then_ejected() {
    let mut reps = [
        start_replica(|c| c.replica_id = "a".into()).await,
        start_replica(|c| c.replica_id = "b".into()).await,
        start_replica(|c| c.replica_id = "c".into()).await,
    ];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |c| {
        c.policy = config::PolicyConfig::RoundRobin;
        // Only failed connects eject in this test, so the retry path is exercised for sure.
        c.health.interval_ms = 600_000;
    })
    .await;
    for _ in 0..3 {
        assert_eq!(
            gw.post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": "warm", "max_tokens": 2})
            )
            .await
            .status(),
            200
        );
    }
    reps[2].kill();
    let mut served_by = HashSet::new();
    for i in 0..9 {
        let r = gw
            .post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": format!("after {i}"), "max_tokens": 2}),
            )
            .await;
        assert_eq!(
            r.status(),
            200,
            "request {i} succeeds despite the dead replica"
        );
        served_by.insert(header(&r, "x-kvgate-replica"));
    }
    assert!(!served_by.contains("c"));
    assert!(gw.metric("kvgate_gateway_retries_total").await >= 1.0);
    let replicas = gw.admin_json("/admin/replicas").await;
    let dead = replicas
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == reps[2].host_port())
        .unwrap();
    assert_eq!(dead["healthy"], false, "{replicas}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_shaped_4xx() {
    let reps = [start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |c| {
        c.upstream.max_body_bytes = 4096
    })
    .await;
    let raw = gw
        .client
        .post(format!("{}/v1/chat/completions", gw.base))
        .body("{oops")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let cases = [
        (
            json!({"messages": [{"role": "user", "content": "x"}]}),
            400,
            "missing_model",
        ),
        (
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (
            json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "x".repeat(5000)}]}),
            413,
            "payload_too_large",
        ),
    ];
    for (body, status, code) in cases {
        let r = gw.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), status);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], code);
        assert!(e["error"]["message"].is_string());
    }
    let r = gw
        .client
        .get(format!("{}/v2/whatever", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_prompt_is_routed_and_answered() {
    // Room for ~250k prompt tokens, and no modelled wait for their prefill.
    let reps = [start_replica(|c| {
        c.max_model_len = Some(400_000);
        c.time_scale = 0.0;
    })
    .await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(1 << 20 >> 5);
    let prompt = &prompt[..1 << 20];
    assert_eq!(prompt.len(), 1 << 20);
    let r = gw
        .client
        .post(format!("{}/v1/completions", gw.base))
        .json(&json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": 2}))
        .timeout(Duration::from_secs(300))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let n = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n > 200_000, "the whole body arrived: {n} tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_passes_through_event_by_event() {
    let reps = [start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "stream please"}],
                   "max_tokens": 60, "ignore_eos": true, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    let mut body = r.bytes_stream();
    let mut dec = SseDecoder::new();
    let mut events = Vec::new();
    let mut seen_mid_stream = false;
    let started = Instant::now();
    while let Some(chunk) = body.next().await {
        events.extend(dec.feed(&chunk.unwrap()));
        if !seen_mid_stream
            && events
                .iter()
                .filter(|e| matches!(e, SseEvent::Data(_)))
                .count()
                >= 3
        {
            // Tokens reached the client while the replica is still generating.
            assert_eq!(reps[0].load().await["num_running_reqs"], 1);
            seen_mid_stream = true;
        }
        assert!(started.elapsed() < Duration::from_secs(60));
    }
    assert!(seen_mid_stream);
    assert_eq!(events.last(), Some(&SseEvent::Done));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_tokens_blocks_scores_and_decision() {
    let reps = [start_replica(|_| {}).await, start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let body = chat(&system_prompt("explain"), "why?");
    assert_eq!(
        gw.post("/v1/chat/completions", body.clone()).await.status(),
        200
    );
    let r = gw
        .client
        .post(format!("{}/admin/route/explain", gw.admin))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["policy"], "prefix_aware");
    assert!(v["prompt_tokens"].as_u64().unwrap() > 40);
    assert!(v["blocks_hashed"].as_u64().unwrap() >= 3);
    assert_eq!(v["replicas"].as_array().unwrap().len(), 2);
    assert_eq!(v["decision"]["reason"], "prefix_match");
    assert!(v["decision"]["matched_blocks"].as_u64().unwrap() >= 3);
    // Costs in seconds, every replica's predicted TTFT, and the holder the one chosen.
    assert!(
        v["cost_unit"].as_str().unwrap().starts_with("seconds"),
        "{v}"
    );
    let chosen = v["decision"]["replica"].as_str().unwrap();
    let ttft = |name: &str| {
        v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["replica"] == name)
            .unwrap()["predicted_ttft_s"]
            .as_f64()
            .unwrap()
    };
    let other = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["replica"].as_str().unwrap())
        .find(|n| *n != chosen)
        .unwrap();
    // Both priced in seconds; which is lower depends on what each replica's model has learnt
    // (one slow first request moves a fit), so only the cache difference is asserted.
    assert!(ttft(chosen) > 0.0 && ttft(other) > 0.0, "{v}");
    let blocks = |name: &str| {
        v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["replica"] == name)
            .unwrap()["matched_blocks"]
            .as_u64()
            .unwrap()
    };
    assert!(blocks(chosen) > blocks(other), "{v}");
    assert_eq!(
        v["decision"]["predicted_ttft_s"].as_f64(),
        Some(ttft(chosen))
    );
    assert_eq!(v["holders"][0]["replica"], chosen);
    assert_eq!(v["now"], "dispatched");
    assert_eq!(v["replicas"][0]["admission"]["verdict"], "admissible");
    assert!(v["route_matched_because"]
        .as_str()
        .unwrap()
        .contains("catch-all"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_cancels_the_upstream_request() {
    let reps = [start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "a long story", "max_tokens": 20000,
                   "ignore_eos": true, "stream": true}),
        )
        .await;
    let mut body = r.bytes_stream();
    let mut dec = SseDecoder::new();
    let mut n = 0;
    while n < 3 {
        n += dec.feed(&body.next().await.unwrap().unwrap()).len();
    }
    assert_eq!(reps[0].load().await["num_reqs"], 1);
    drop(body);
    reps[0]
        .wait_load(|l| l["num_reqs"] == 0 && l["kv_cache_usage"].as_f64() == Some(0.0))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_learns_each_replicas_speed_from_streams() {
    let reps = [start_replica(|_| {}).await];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let before = gw.admin_json("/admin/replicas").await;
    // Before any stream: the replica's own estimate (from /server_info) is the prior.
    let own: Value = reps[0].get_json("/server_info").await;
    let prior = before[0]["learnt"]["prefill_tokens_per_s"]
        .as_f64()
        .unwrap();
    assert!(
        (prior - own["prefill_tokens_per_s"].as_f64().unwrap()).abs() < 1.0,
        "{before} {own}"
    );
    assert_eq!(before[0]["learnt"]["ttft_observations"], 0);
    assert!(before[0]["learnt"]["itl_ms_batch_1"].is_null());
    // The step lag starts from its default: a couple of milliseconds, never negative.
    let lag = before[0]["learnt"]["step_lag_ms"].as_f64().unwrap();
    assert!((0.0..=50.0).contains(&lag), "{before}");
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": system_prompt("speed")}],
                   "max_tokens": 20, "ignore_eos": true, "stream": true}),
        )
        .await;
    let _ = r.bytes().await.unwrap();
    let after = gw.admin_json("/admin/replicas").await;
    let learnt = &after[0]["learnt"];
    assert!(
        learnt["prefill_tokens_per_s"].as_f64().unwrap() > 0.0,
        "{after}"
    );
    assert_eq!(learnt["ttft_observations"], 1, "{after}");
    assert!(learnt["itl_ms_batch_1"].as_f64().unwrap() > 0.0, "{after}");
    // Unstreamed answers teach it too: a one-token answer's time is its TTFT (a longer one's
    // less its decode at the learnt step) — but not one whose decode is most of its time, where
    // a small error in the step would make a large one in the TTFT.
    for max_tokens in [1, 200] {
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": system_prompt("whole")}],
                       "max_tokens": max_tokens, "ignore_eos": true}),
            )
            .await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await.unwrap();
    }
    let whole = gw.admin_json("/admin/replicas").await;
    assert_eq!(whole[0]["learnt"]["ttft_observations"], 2, "{whole}");
}

/// A burst's follower, sent while the first request is still prefilling the prefix they share,
/// finds the whole prefix cached: a kvgate replica holds it back itself until the blocks are
/// computed, so the gateway sends it at once; in front of an engine that does not (a replica
/// with `--no-prefix-wait`, as vLLM), the gateway waits for the replica to report those blocks
/// (`prefix_in_flight`); with neither wait it is sent at once and finds only the part computed
/// so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_waits_for_the_prefix_in_flight_instead_of_prefilling_it_again() {
    async fn burst(engine_waits: bool, wait_ms: u64) -> (u64, u64, f64) {
        // Small chunks and a slowed clock: the first prefill takes about 0.7 s.
        let rep = start_replica(|c| {
            c.max_num_batched_tokens = 256;
            c.time_scale = 10.0;
            c.wait_for_prefix_in_flight = engine_waits;
        })
        .await;
        let gw = start_gateway(&[&rep], |c| {
            let mut f = config::PolicyFile::single(c.policy.clone());
            f.hit_signals = config::HitSignals::Exact;
            f.prefix_in_flight_wait_ms = wait_ms;
            c.embedded_policy = Some(f);
        })
        .await;
        let shared = "The quick brown fox jumps over the lazy dog. ".repeat(150);
        let leader = {
            let (base, client, body) = (gw.base.clone(), gw.client.clone(), chat(&shared, "one"));
            tokio::spawn(async move {
                let r = client
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                r.json::<Value>().await.unwrap()
            })
        };
        rep.wait_load(|l| l["num_running_reqs"] == 1).await;
        let r = gw.post("/v1/chat/completions", chat(&shared, "two")).await;
        assert_eq!(r.status(), 200);
        let follower: Value = r.json().await.unwrap();
        let leader = leader.await.unwrap();
        let prompt = leader["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = follower["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let held = gw
            .metrics_text()
            .await
            .lines()
            .find(|l| {
                l.starts_with("kvgate_gateway_admission_holds_total")
                    && l.contains("reason=\"prefix_in_flight\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        (prompt, cached, held)
    }
    // Everything but the differing question (and the block it starts in) came from the cache.
    let (prompt, cached, held) = burst(true, 5_000).await;
    assert!(
        cached + 32 >= prompt,
        "engine waited: {cached} of {prompt} cached"
    );
    assert_eq!(
        held, 0.0,
        "the gateway does not hold what the engine waits for"
    );
    let (prompt, cached, held) = burst(false, 5_000).await;
    assert!(
        cached + 32 >= prompt,
        "gateway waited: {cached} of {prompt} cached"
    );
    assert!(held >= 1.0, "the wait is counted: {held}");
    let (prompt, cached, _) = burst(false, 0).await;
    assert!(
        cached + 32 < prompt,
        "sent at once: {cached} of {prompt} cached"
    );
}
