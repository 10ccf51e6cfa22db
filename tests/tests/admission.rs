//! Routes, goodput-based admission and policy hot reload, end to end: real sim replicas behind
//! a real gateway with a policy file on disk.

mod common;

use std::time::{Duration, Instant};

use common::{start_gateway, start_replica, Gateway, PolicyFileOnDisk};
use futures::StreamExt;
use serde_json::{json, Value};

/// What one streamed request saw.
#[derive(Debug)]
struct Seen {
    status: u16,
    ttft: Option<Duration>,
    retry_after: Option<u64>,
    route: Option<String>,
    body: Option<Value>,
}

async fn stream_completion(
    client: &reqwest::Client,
    base: &str,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Seen {
    let started = Instant::now();
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": max_tokens,
                      "stream": true, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let retry_after = header("retry-after").and_then(|v| v.parse().ok());
    let route = header("x-kvgate-route");
    if status != 200 {
        let body = r.json::<Value>().await.ok();
        return Seen {
            status,
            ttft: None,
            retry_after,
            route,
            body,
        };
    }
    let mut ttft = None;
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        let chunk = chunk.unwrap();
        if ttft.is_none() && chunk.windows(6).any(|w| w == b"\"text\"") {
            ttft = Some(started.elapsed());
        }
    }
    Seen {
        status,
        ttft,
        retry_after,
        route,
        body: None,
    }
}

/// A prompt of `n` token ids sharing no prefix with any other seed's.
fn unique_prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 1000 + (seed * 7919 + i * 104_729) % 100_000)
        .collect()
}

/// Sends `count` requests at a fixed `rate`, open loop, and collects what each saw.
async fn offer(g: &Gateway, rate: f64, count: u32, prompt_tokens: usize, seed: u32) -> Vec<Seen> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..count {
        tokio::time::sleep_until((start + Duration::from_secs_f64(f64::from(i) / rate)).into())
            .await;
        let (client, base) = (g.client.clone(), g.base.clone());
        tasks.push(tokio::spawn(async move {
            stream_completion(&client, &base, unique_prompt(seed + i, prompt_tokens), 8).await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn p95(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    let rank = ((xs.len() as f64) * 0.95).ceil() as usize;
    xs[rank.clamp(1, xs.len()) - 1]
}

fn overload_policy(admission: bool) -> String {
    format!(
        "version = \"overload-{admission}\"\n[[routes]]\nname = \"interactive\"\nqueue_size = 64\nqueue_timeout_ms = 10000\nadmission = {admission}\nslo = {{ ttft_ms = 1500 }}\n"
    )
}

/// Two L4 replicas prefill a 1,500-token prompt in about 0.45 s each: together they serve
/// about 4.4 such requests per second. Offered 9 per second (about twice the knee) for 8 s,
/// without admission the backlog grows and TTFT with it; with admission the admitted requests
/// wait less and the excess is told to come back (429 + Retry-After), counted as shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_keeps_the_ttft_promise_at_twice_the_knee() {
    let l4 = |c: &mut replica::ReplicaConfig| c.gpu = "l4".into();
    let replicas = [start_replica(l4).await, start_replica(l4).await];
    let mut results = Vec::new();
    for admission in [false, true] {
        let file = PolicyFileOnDisk::new(
            &format!("overload-{admission}"),
            &overload_policy(admission),
        );
        let path = file.path.display().to_string();
        let g = start_gateway(&[&replicas[0], &replicas[1]], |c| {
            c.policy_file = Some(path);
        })
        .await;
        // Fresh prompts for each run: the replicas' caches outlive a gateway.
        let seed = if admission { 1000 } else { 1 };
        let seen = offer(&g, 9.0, 72, 1500, seed).await;
        let ok: Vec<Duration> = seen.iter().filter_map(|s| s.ttft).collect();
        let shed: Vec<&Seen> = seen.iter().filter(|s| s.status == 429).collect();
        let other: Vec<u16> = seen
            .iter()
            .map(|s| s.status)
            .filter(|s| *s != 200 && *s != 429)
            .collect();
        assert!(other.is_empty(), "unexpected statuses {other:?}");
        for s in &shed {
            assert!(
                s.retry_after.is_some_and(|r| r >= 1),
                "429 without Retry-After: {s:?}"
            );
            let b = s.body.as_ref().expect("429 has a JSON body");
            assert_eq!(b["error"]["type"], "rate_limit_exceeded", "{b}");
            assert!(b["error"]["message"]
                .as_str()
                .unwrap()
                .contains("retry after"));
            assert_eq!(s.route.as_deref(), Some("interactive"));
        }
        let p95_ttft = p95(ok.clone());
        eprintln!(
            "admission {admission}: {} served, {} shed, p95 TTFT {:?}",
            ok.len(),
            shed.len(),
            p95_ttft
        );
        if admission {
            let m = g.metric("kvgate_gateway_shed_total").await;
            assert_eq!(m as usize, shed.len(), "every 429 is counted as shed");
            let good = g.metric("kvgate_gateway_good_requests_total").await;
            let all = g.metric("kvgate_gateway_route_requests_total").await;
            assert_eq!(all as usize, ok.len());
            assert!(good > 0.0 && good <= all);
        }
        results.push((ok.len(), shed.len(), p95_ttft));
    }
    let (_, shed_off, p95_off) = results[0];
    let (served_on, shed_on, p95_on) = results[1];
    // The load really is past the knee: without admission the promise breaks ...
    assert_eq!(shed_off, 0);
    assert!(
        p95_off > Duration::from_millis(1500),
        "p95 without admission {p95_off:?}"
    );
    // ... with it, the excess is shed rather than left waiting, and what is admitted waits
    // less. That it keeps the 1.5 s promise is checked on a clock the test drives, where a
    // busy CI host cannot move the number (gateway/tests/admission_clock.rs).
    assert!(
        p95_on < p95_off,
        "p95 with admission {p95_on:?}, without {p95_off:?}"
    );
    assert!(shed_on >= 7, "only {shed_on} shed of 72");
    assert!(served_on >= 24, "only {served_on} served of 72");
}

const ROUTES_V1: &str = r#"
version = "v1"
[[routes]]
name = "long"
min_prompt_tokens = 2000
pool = [1]
max_concurrency = 1
[[routes]]
name = "batch"
priority = "batch"
[[routes]]
name = "interactive"
slo = { ttft_ms = 5000 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_take_their_route_and_pool() {
    let replicas = [
        start_replica(|c| c.replica_id = "r0".into()).await,
        start_replica(|c| c.replica_id = "r1".into()).await,
    ];
    let file = PolicyFileOnDisk::new("routes", ROUTES_V1);
    let path = file.path.display().to_string();
    let g = start_gateway(&[&replicas[0], &replicas[1]], |c| {
        c.policy_file = Some(path)
    })
    .await;
    // Long prompts: the long route, only on its pool (replica index 1).
    for i in 0..3 {
        let r = g
            .client
            .post(format!("{}/v1/completions", g.base))
            .json(&json!({"model": "Qwen3-8B", "prompt": unique_prompt(i, 2500), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kvgate-route"], "long");
        assert_eq!(r.headers()["x-kvgate-replica"], "r1");
    }
    let send = |priority: Option<&'static str>| {
        let mut rb = g
            .client
            .post(format!("{}/v1/completions", g.base))
            .json(&json!({"model": "Qwen3-8B", "prompt": "Hello", "max_tokens": 2}));
        if let Some(p) = priority {
            rb = rb.header("x-kvgate-priority", p);
        }
        rb.send()
    };
    let r = send(Some("batch")).await.unwrap();
    assert_eq!(r.headers()["x-kvgate-route"], "batch");
    let r = send(None).await.unwrap();
    assert_eq!(r.headers()["x-kvgate-route"], "interactive");
    let r = send(Some("urgent")).await.unwrap();
    assert_eq!(r.status(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["code"], "invalid_priority");
    // The admin view shows the routes, their pools and promises.
    let p = g.admin_json("/admin/policy").await;
    assert_eq!(p["version"], "v1");
    assert_eq!(p["routes"][0]["pool"], json!([replicas[1].host_port()]));
    assert_eq!(p["routes"][2]["slo"]["ttft_ms"], 5000);
    assert!(p["last_error"].is_null());
    // ... and every knob in force, defaults filled in.
    assert_eq!(p["prefix_in_flight_wait_ms"], 1000);
    for r in p["routes"].as_array().unwrap() {
        assert_eq!(r["policy_knobs"]["kind"], r["policy"], "{r}");
    }
    let d = &p["default_policy_knobs"];
    assert_eq!(d["kind"], p["default_policy"]);
    if d["kind"] == "prefix_aware" {
        assert_eq!(d["cost"], "ttft");
        // The defaults the config crate documents, not a copy of them.
        let knobs = config::policy::PrefixAwareConfig::default();
        assert_eq!(d["itl_headroom"], knobs.itl_headroom);
        assert!(
            d["balance_abs_threshold"].is_null(),
            "no count guard under ttft: {d}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_are_validated_atomic_and_lossless() {
    let replicas = [start_replica(|_| {}).await, start_replica(|_| {}).await];
    let file = PolicyFileOnDisk::new("reload", ROUTES_V1);
    let path = file.path.display().to_string();
    let g = start_gateway(&[&replicas[0], &replicas[1]], |c| {
        c.policy_file = Some(path)
    })
    .await;
    assert_eq!(g.admin_json("/admin/policy").await["generation"], 1);

    // An invalid file changes nothing and says why: field, value, reason.
    file.replace(&ROUTES_V1.replace("max_concurrency = 1", "max_concurrency = 0"));
    let p = g
        .wait_admin("/admin/policy", "rejection", |p| !p["last_error"].is_null())
        .await;
    assert_eq!(p["version"], "v1");
    assert_eq!(p["generation"], 1);
    let err = &p["last_error"];
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("routes[0].max_concurrency = 0"),
        "{err}"
    );
    assert_eq!(err["fields"][0]["field"], "routes[0].max_concurrency");
    assert_eq!(g.metric("kvgate_gateway_policy_last_reload_ok").await, 0.0);
    assert!(
        g.metric("kvgate_gateway_policy_reloads_total{result=\"rejected\"}")
            .await
            >= 1.0
    );
    let r = g
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "Hi", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.headers()["x-kvgate-route"], "interactive");

    // A valid file takes effect while requests stream, and none of them fails.
    let traffic = {
        let (client, base) = (g.client.clone(), g.base.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            let until = Instant::now() + Duration::from_secs(3);
            let mut i = 0;
            while Instant::now() < until {
                i += 1;
                seen.push(stream_completion(&client, &base, unique_prompt(i, 64), 16).await);
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    file.replace(
        &ROUTES_V1
            .replace("v1", "v2")
            .replace("name = \"interactive\"", "name = \"chat\""),
    );
    let p = g
        .wait_admin("/admin/policy", "reload", |p| p["version"] == "v2")
        .await;
    assert_eq!(p["generation"], 2);
    assert!(p["last_error"].is_null());
    let seen = traffic.await.unwrap();
    assert!(seen.len() >= 5, "{}", seen.len());
    assert!(seen.iter().all(|s| s.status == 200), "{seen:?}");
    assert!(seen.iter().any(|s| s.route.as_deref() == Some("chat")));
    assert_eq!(g.metric("kvgate_gateway_policy_last_reload_ok").await, 1.0);
    // The explicit reload endpoint answers with the active policy, or 400 and the reason.
    let reload = || async {
        g.client
            .post(format!("{}/admin/policy/reload", g.admin))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert_eq!(reload().await, 200);
    file.replace("[[routes]]\nname = \"x\"\nnonsense = true\n");
    assert_eq!(reload().await, 400);
    assert_eq!(g.admin_json("/admin/policy").await["version"], "v2");
}

/// A hundred short prompts teach the gateway little about long ones: it must still price a
/// 6k-token prompt by its tokens (from the replica's own prefill estimate, refined by what it
/// sees), not by extrapolating the short prompts' fixed overhead. The replica is busy (two
/// long streams), so the idle rule does not decide; the prediction does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_after_many_short_ones_is_admitted_when_it_fits() {
    let rep = start_replica(|_| {}).await;
    let file = PolicyFileOnDisk::new(
        "after-short",
        "version = \"t\"\n[[routes]]\nname = \"interactive\"\nqueue_timeout_ms = 3000\nslo = { ttft_ms = 1000 }\n",
    );
    let path = file.path.display().to_string();
    let g = start_gateway(&[&rep], |c| c.policy_file = Some(path)).await;
    for i in 0..100 {
        let s = stream_completion(&g.client, &g.base, unique_prompt(50_000 + i, 40), 1).await;
        assert_eq!(s.status, 200);
    }
    // Two long streams keep the replica busy.
    let busy: Vec<_> = (0..2)
        .map(|i| {
            let (client, base) = (g.client.clone(), g.base.clone());
            tokio::spawn(async move {
                stream_completion(&client, &base, unique_prompt(60_000 + i, 40), 3000).await
            })
        })
        .collect();
    rep.wait_load(|l| l["num_reqs"].as_u64() == Some(2)).await;
    for i in 0..5 {
        let s = stream_completion(&g.client, &g.base, unique_prompt(70_000 + i, 6_000), 2).await;
        assert_eq!(
            s.status, 200,
            "a 6k prompt fits a 1 s promise on an H100 ({:?})",
            s.body
        );
    }
    let replicas = g.admin_json("/admin/replicas").await;
    let rate = replicas[0]["learnt"]["prefill_tokens_per_s"]
        .as_f64()
        .unwrap();
    assert!(rate > 5_000.0, "learnt prefill rate {rate}");
    for b in busy {
        b.abort();
    }
}
