//! Failures after the first byte and the gateway's own lifecycle: a stream cut by its replica
//! ends with an error event (never as a success), a stalled replica is given up on, a request
//! waiting on a replica that gets ejected is retried elsewhere, a client that leaves cancels
//! its unstreamed request, SIGTERM drains, and a broken policy file never replaces a good one.
//! A replica's answer is not trusted either: garbage is a 502 (retried elsewhere while nothing
//! reached the client), a stream that breaks its promises is cut with an error event, a body
//! that stalls is given up on, and a replica that keeps answering unusably is ejected.

mod common;

use std::time::{Duration, Instant};

use common::{
    read_stream, start_gateway, start_gateway_at, start_replica, FakeMode, FakeReplica,
    PolicyFileOnDisk,
};
use futures::StreamExt;
use serde_json::{json, Value};

fn stream_body(max_tokens: u32) -> Value {
    json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "user", "content": "Tell me about paged KV caches."}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
    })
}

async fn metric_text(admin: &str) -> String {
    reqwest::get(format!("{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_its_replica_ends_with_an_error_event() {
    let fake = FakeReplica::start(FakeMode::CutAfter { tokens: 3 }).await;
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |_| {}).await;
    let r = gw.post("/v1/chat/completions", stream_body(50)).await;
    assert_eq!(r.status(), 200, "headers went out with the first event");
    let (events, done) = read_stream(r).await;
    assert!(!done, "no [DONE] after a cut");
    let last = events.last().expect("events");
    assert_eq!(last["error"]["type"], "upstream_error", "{events:?}");
    assert_eq!(last["error"]["code"], "upstream_error");
    assert_eq!(events.len(), 4, "three tokens, then the error");
    let m = metric_text(&gw.admin).await;
    assert!(
        m.contains("kvgate_gateway_requests_total{endpoint=\"chat_completions\",status=\"502\"} 1"),
        "counted as an error, not a 200:\n{m}"
    );
    assert!(m.contains("kvgate_gateway_stream_errors_total{reason=\"upstream_error\"} 1"));
    assert!(m.contains("kvgate_gateway_route_errors_total{route=\"default\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_real_replica_mid_stream_is_reported_to_the_client() {
    let mut rep = start_replica(|c| c.time_scale = 4.0).await;
    let gw = start_gateway(&[&rep], |_| {}).await;
    let r = gw.post("/v1/chat/completions", stream_body(400)).await;
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    rep.kill();
    let mut rest = Vec::new();
    while let Some(Ok(chunk)) = body.next().await {
        rest.extend_from_slice(&chunk);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(!rest.contains("[DONE]"));
    assert!(rest.contains("\"error\""), "{rest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_replica_is_given_up_on_mid_stream() {
    let fake = FakeReplica::start(FakeMode::Stream { tokens: 3 }).await;
    let file = PolicyFileOnDisk::new(
        "stall",
        "[policy]\nkind = \"round_robin\"\n[[routes]]\nname = \"interactive\"\nslo = { itl_ms = 50 }\n",
    );
    let path = file.path.display().to_string();
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.policy_file = Some(path)
    })
    .await;
    // Admitted while well; from now on it answers three tokens and then hangs, /health too.
    fake.set_mode(FakeMode::StallAfter { tokens: 3 });
    let started = Instant::now();
    let r = gw.post("/v1/chat/completions", stream_body(50)).await;
    let (events, done) = read_stream(r).await;
    let took = started.elapsed();
    assert!(!done);
    let code = events.last().unwrap()["error"]["code"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        code == "idle_timeout" || code == "replica_ejected",
        "{events:?}"
    );
    // The promise's 50 ms gap gives a 2 s idle deadline (not the 600 s first-byte timeout).
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_on_a_replica_that_gets_ejected_is_retried_elsewhere() {
    let stalled = FakeReplica::start(FakeMode::StallAfter { tokens: 0 }).await;
    let healthy = FakeReplica::start(FakeMode::Stream { tokens: 5 }).await;
    let gw = start_gateway_at(&[healthy.addr.clone(), stalled.addr.clone()], |c| {
        c.policy = config::PolicyConfig::RoundRobin;
        c.health.timeout_ms = 200;
    })
    .await;
    // The stalled one answered its first health check before stalling? No: it hangs from the
    // start, so it is never admitted — admit it by hand to model "stalled after admission".
    gw.state.fleet.set_healthy(1, true);
    let started = Instant::now();
    let sends = (0..2).map(|_| gw.post("/v1/chat/completions", stream_body(5)));
    for r in futures::future::join_all(sends).await {
        assert_eq!(r.status(), 200);
        let (events, done) = read_stream(r).await;
        assert!(done, "{events:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        stalled.bodies().len(),
        1,
        "one request went to the stalled replica first"
    );
    assert_eq!(
        healthy.bodies().len(),
        2,
        "and was retried on the healthy one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_cancels_its_unstreamed_request() {
    let rep = start_replica(|_| {}).await;
    let gw = start_gateway(&[&rep], |_| {}).await;
    let body = json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "user", "content": "Write a long essay."}],
        "max_tokens": 4000,
        "ignore_eos": true,
    });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let r = client
        .post(format!("{}/v1/chat/completions", gw.base))
        .json(&body)
        .send()
        .await;
    assert!(r.is_err(), "the client gave up");
    // The replica was generating; it must stop soon, not ~40 s later.
    rep.wait_load(|l| l["num_reqs"] == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_twenty_streams_to_their_end() {
    let reps = [
        start_replica(|c| c.time_scale = 2.0).await,
        start_replica(|c| c.time_scale = 2.0).await,
    ];
    let mut gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let mut streams = Vec::new();
    for _ in 0..20 {
        let r = gw.post("/v1/chat/completions", stream_body(60)).await;
        assert_eq!(r.status(), 200);
        streams.push(r);
    }
    let stopped = gw.shutdown();
    // Draining: /health says so on a fresh connection, or the listener is already closed
    // (refused, or accepted by the closing listener and dropped unanswered). Never a 200.
    match reqwest::Client::new()
        .get(format!("{}/health", gw.base))
        .timeout(Duration::from_secs(5))
        .send()
        .await
    {
        Ok(r) => assert_eq!(r.status(), 503),
        Err(e) => assert!(
            !e.is_timeout(),
            "a draining gateway must answer or refuse: {e}"
        ),
    }
    let mut complete = 0;
    for r in streams {
        let (_, done) = read_stream(r).await;
        complete += usize::from(done);
    }
    assert_eq!(complete, 20, "every stream finished with [DONE]");
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("run returns once drained")
        .unwrap();
    assert!(reqwest::get(format!("{}/health", gw.base)).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_drain_deadline_open_streams_end_with_an_error_event() {
    let fake = FakeReplica::start(FakeMode::Stream { tokens: 400 }).await;
    let mut gw = start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.downstream.drain_timeout_s = 1
    })
    .await;
    let r = gw.post("/v1/chat/completions", stream_body(400)).await;
    assert_eq!(r.status(), 200);
    let stopped = gw.shutdown();
    let (events, done) = read_stream(r).await;
    assert!(!done);
    assert_eq!(events.last().unwrap()["error"]["code"], "drain");
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_truncated_or_reused_version_policy_file_is_refused() {
    let rep = start_replica(|_| {}).await;
    const GOOD: &str = "version = \"v1\"\n[policy]\nkind = \"prefix_aware\"\n\
                        [[routes]]\nname = \"interactive\"\nslo = { ttft_ms = 1000, itl_ms = 50 }\n";
    let file = PolicyFileOnDisk::new("truncate", GOOD);
    let path = file.path.display().to_string();
    let gw = start_gateway(&[&rep], |c| c.policy_file = Some(path)).await;
    let reload = || {
        gw.client
            .post(format!("{}/admin/policy/reload", gw.admin))
            .send()
    };
    for (text, needle) in [
        ("", "must list its [[routes]]"),
        ("version = \"v1\"\n", "must list its [[routes]]"),
        // Cut short after the route's name: the promise is gone, the version is not.
        (
            &GOOD[..GOOD.find("slo").unwrap()],
            "loaded before with different content",
        ),
    ] {
        file.replace(text);
        let r = reload().await.unwrap();
        assert_eq!(r.status(), 400, "{text:?}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{text:?}: {v}"
        );
        let active = gw.admin_json("/admin/policy").await;
        assert_eq!(active["version"], "v1");
        assert_eq!(
            active["routes"][0]["slo"]["ttft_ms"], 1000,
            "the promise stays"
        );
    }
    file.replace(&GOOD.replace("v1", "v2").replace("1000", "800"));
    assert_eq!(reload().await.unwrap().status(), 200);
    let active = gw.admin_json("/admin/policy").await;
    assert_eq!(active["version"], "v2");
    assert_eq!(active["routes"][0]["slo"]["ttft_ms"], 800);
}

fn chat_body(stream: bool, max_tokens: u32) -> Value {
    json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "user", "content": "Tell me about paged KV caches."}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// The `code` of an OpenAI error body or error event.
fn error_code(v: &Value) -> String {
    v["error"]["code"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_the_only_replica_is_a_502_never_a_200() {
    for (mode, stream, code) in [
        (FakeMode::NotJson, false, "upstream_error"),
        (FakeMode::Html, true, "upstream_error"),
        (FakeMode::Html, false, "upstream_error"),
    ] {
        let fake = FakeReplica::start(mode).await;
        let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |_| {}).await;
        let r = gw.post("/v1/chat/completions", chat_body(stream, 8)).await;
        assert_eq!(r.status(), 502, "{mode:?} stream={stream}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(error_code(&v), code, "{v}");
        let text = gw.metrics_text().await;
        assert!(
            text.lines()
                .any(|l| l.starts_with("kvgate_gateway_upstream_errors_total")
                    && (l.contains("reason=\"not_json\"") || l.contains("reason=\"not_sse\""))),
            "counted per replica with its reason: {mode:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_garbage_is_ejected_and_its_requests_served_elsewhere() {
    let bad = FakeReplica::start(FakeMode::NotJson).await;
    let good = FakeReplica::start(FakeMode::Stream { tokens: 3 }).await;
    let gw = start_gateway_at(&[bad.addr.clone(), good.addr.clone()], |c| {
        c.policy = config::PolicyConfig::RoundRobin;
        c.health.outlier_consecutive_errors = 3;
    })
    .await;
    for i in 0..12 {
        let r = gw.post("/v1/chat/completions", chat_body(false, 3)).await;
        assert_eq!(
            r.status(),
            200,
            "request {i} was retried on the good replica"
        );
    }
    assert_eq!(
        gw.metric("kvgate_gateway_outlier_ejections_total").await,
        1.0
    );
    let sent_bad = bad.bodies().len();
    assert_eq!(
        sent_bad, 3,
        "after 3 garbage answers in a row nothing more went there"
    );
    let replicas = gw.admin_json("/admin/replicas").await;
    let b = replicas
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == bad.addr)
        .unwrap();
    assert_eq!(b["healthy"], false, "ejected, though its /health answers");
    // Its health checks pass, but they cannot readmit it within the ejection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = gw.post("/v1/chat/completions", chat_body(false, 3)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(bad.bodies().len(), sent_bad);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_max_tokens_or_with_a_bad_event_is_cut() {
    let fake = FakeReplica::start(FakeMode::Endless).await;
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |_| {}).await;
    let started = Instant::now();
    let r = gw.post("/v1/chat/completions", chat_body(true, 16)).await;
    assert_eq!(r.status(), 200);
    let (events, done) = read_stream(r).await;
    assert!(!done, "never [DONE]");
    let last = events.last().unwrap();
    assert_eq!(error_code(last), "too_many_tokens", "{last}");
    let tokens = events.iter().filter(|e| e.get("choices").is_some()).count();
    assert!(
        (16..=33).contains(&tokens),
        "{tokens} token events for max_tokens 16"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    fake.set_mode(FakeMode::BadEvent { tokens: 2 });
    let r = gw.post("/v1/chat/completions", chat_body(true, 16)).await;
    let (events, done) = read_stream(r).await;
    assert!(!done);
    assert_eq!(
        error_code(events.last().unwrap()),
        "bad_event",
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_length_is_given_up_on_at_the_body_deadline() {
    let fake = FakeReplica::start(FakeMode::ShortBody).await;
    let gw = start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.upstream.body_idle_timeout_ms = 300;
        c.upstream.retries = 0;
    })
    .await;
    let started = Instant::now();
    let r = gw.post("/v1/chat/completions", chat_body(false, 8)).await;
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(error_code(&v), "upstream_timeout", "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}
