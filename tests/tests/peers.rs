//! Several gateways, one admission budget: two real gateways name each other as peers
//! (`[peers]`) in front of one sim replica, and the policy's route limits hold for the pair.

mod common;

use std::time::{Duration, Instant};

use common::{start_gateway_with_admin, start_replica, Gateway, PolicyFileOnDisk};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const POLICY: &str = r#"
[[routes]]
name = "chat"
max_concurrency = 2
queue_size = 1
queue_timeout_ms = 60000
"#;

/// A streamed request that holds its place for a few seconds on a time-scaled sim.
fn long_request(g: &Gateway, seed: u32) -> tokio::task::JoinHandle<u16> {
    let (client, base) = (g.client.clone(), g.base.clone());
    tokio::spawn(async move {
        let prompt: Vec<u32> = (0..64).map(|i| 1000 + seed * 97 + i).collect();
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(
                &json!({"model": "Qwen3-8B", "prompt": prompt, "max_tokens": 120,
                          "stream": true, "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let _ = r.bytes().await;
        status
    })
}

fn route_use(budget: &Value, field: &str) -> u64 {
    budget["routes"]["chat"][field].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_admission_budget() {
    let rep = start_replica(|c| c.time_scale = 4.0).await;
    let file = PolicyFileOnDisk::new("peers", POLICY);
    let admins = [
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    ];
    let admin_addrs: Vec<String> = admins
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let mut gateways = Vec::new();
    for admin in admins {
        let path = file.path.display().to_string();
        // Each lists both addresses, itself included, as a DNS name over all gateways would.
        let peers = admin_addrs.clone();
        gateways.push(
            start_gateway_with_admin(&[rep.host_port()], admin, move |c| {
                c.policy_file = Some(path);
                c.peers.addrs = peers;
                c.peers.every_ms = 20;
                c.peers.stale_ms = 2000;
            })
            .await,
        );
    }
    let (a, b) = (&gateways[0], &gateways[1]);

    // Two long requests through A fill the route's fleet-wide concurrency...
    let first = [long_request(a, 1), long_request(a, 2)];
    b.wait_admin("/admin/peers", "B hearing A's two requests", |v| {
        v["peers"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["routes"]["chat"]["in_flight"] == 2))
    })
    .await;
    // ... and each gateway found itself among the listed addresses and left itself out.
    assert_eq!(
        b.admin_json("/admin/peers").await["myself"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    // So a request through B waits in B's queue rather than running a third one at once.
    let third = long_request(b, 3);
    let budget = b
        .wait_admin("/admin/budget", "B taking the request", |v| {
            route_use(v, "queued") + route_use(v, "in_flight") > 0
        })
        .await;
    let a_now = a.admin_json("/admin/budget").await;
    assert_eq!(
        (
            route_use(&budget, "in_flight"),
            route_use(&budget, "queued")
        ),
        (0, 1),
        "B admitted past the fleet's max_concurrency while A had {a_now}"
    );

    // The route's one queue place is the fleet's: once A has heard of B's waiter, a request
    // through A is shed with 429 queue_full, though A's own queue is empty.
    a.wait_admin("/admin/peers", "A hearing B's waiter", |v| {
        v["peers"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["routes"]["chat"]["queued"] == 1))
    })
    .await;
    let r = a
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "Hello there", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full", "{body}");

    // When A's requests end, B hears the room and its waiter runs: nothing is lost.
    for f in first {
        assert_eq!(f.await.unwrap(), 200);
    }
    assert_eq!(third.await.unwrap(), 200);
    let live = a.metric("kvgate_gateway_peers").await;
    assert!(live >= 1.0, "A counts its live peer: {live}");
}

/// A long shared prompt: the same system text, a different question.
fn shared_chat(question: &str) -> Value {
    let system = "You are the support assistant of a parcel company. ".repeat(40);
    json!({"model": "Qwen3-8B", "max_tokens": 4,
           "messages": [{"role": "system", "content": system},
                        {"role": "user", "content": question}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_sent_through_one_gateway_is_matched_by_the_other() {
    let reps = [
        start_replica(|c| c.replica_id = "r0".into()).await,
        start_replica(|c| c.replica_id = "r1".into()).await,
    ];
    let addrs: Vec<String> = reps.iter().map(|r| r.host_port()).collect();
    let start = |addrs: Vec<String>| async move {
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        start_gateway_with_admin(&addrs, admin, |c| c.index.kv_events = true).await
    };
    let (a, b) = (start(addrs.clone()).await, start(addrs).await);
    // The first turn goes through A ...
    let r = a
        .post("/v1/chat/completions", shared_chat("Where is parcel 1?"))
        .await;
    assert_eq!(r.status(), 200);
    let holder = r.headers()["x-kvgate-replica"]
        .to_str()
        .unwrap()
        .to_string();
    // ... and B, which never saw it, learns from the replica's KV events where the prefix is:
    // the next turn through B goes to the same replica, as a prefix match.
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = shared_chat("And parcel 2?");
    loop {
        let v = b.explain(&body).await;
        if v["decision"]["reason"] == "prefix_match" {
            assert_eq!(v["decision"]["replica"], holder.as_str(), "{v}");
            assert!(
                v["decision"]["matched_blocks"].as_u64().unwrap() >= 20,
                "{v}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "B never matched A's prefix: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = b.post("/v1/chat/completions", body).await;
    assert_eq!(r.headers()["x-kvgate-replica"], holder.as_str());
    let usage: Value = r.json().await.unwrap();
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            >= 256,
        "the replica served the shared prefix from its cache: {usage}"
    );
}
