//! What one client can cost the gateway: prompts far over the limit are refused before they are
//! tokenised in full, prompt lists are classified by their total, slow or oversized headers
//! and too many connections are cut with a clear answer, and HTTP/1.0 clients are answered
//! in a framing they understand.

mod common;

use std::time::{Duration, Instant};

use common::{start_gateway, start_replica, PolicyFileOnDisk};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Reads until the peer closes or `limit` passes; returns what came.
async fn read_all(s: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_prompts_are_refused_before_tokenising_them_whole() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    // ~7 MB of ordinary words: ~1.4M tokens against the replica's 40,960.
    let text = "the quick brown fox jumps over the lazy dog ".repeat(160_000);
    let before = rss_kib();
    let bodies = [
        json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        json!({"model": "Qwen3-8B", "prompt": text, "max_tokens": 4}),
        // Long tokens: the byte bound alone cannot decide, counting a piece does.
        json!({"model": "Qwen3-8B", "prompt": "x".repeat(7 << 20), "max_tokens": 4}),
        json!({"model": "Qwen3-8B", "prompt": ["hi", text], "max_tokens": 4}),
    ];
    let sends = bodies.iter().enumerate().map(|(i, b)| {
        let path = if i == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        gw.post(path, b.clone())
    });
    for resp in futures::future::join_all(sends).await {
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    let grown_mib = rss_kib().saturating_sub(before) / 1024;
    eprintln!("RSS grew by {grown_mib} MiB for four ~7 MB prompts");
    // Before the bound, four such prompts took 8.5 GB; the bodies themselves are ~30 MB, held
    // a few times over (client, gateway, parsed copy, rendered template).
    assert!(grown_mib < 600, "RSS grew by {grown_mib} MiB");
    let m = gw.metric("kvgate_gateway_prompts_refused_total").await;
    assert_eq!(m, 4.0, "all four refused before the exact pass");
    let text = reqwest::get(format!("{}/metrics", gw.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("stage=\"exact\"} 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_list_is_classified_by_its_total() {
    let r = start_replica(|_| {}).await;
    let file = PolicyFileOnDisk::new(
        "prompt-list",
        "version = \"t\"\nhit_signals = \"exact\"\n[policy]\nkind = \"least_load\"\n\
         [[routes]]\nname = \"long\"\nmin_prompt_tokens = 2000\n[[routes]]\nname = \"interactive\"\n",
    );
    let path = file.path.display().to_string();
    let gw = start_gateway(&[&r], |c| c.policy_file = Some(path)).await;
    let piece = "alpha beta gamma delta ".repeat(150); // ~600 tokens
    let body = json!({
        "model": "Qwen3-8B",
        "prompt": ["hi", piece, piece, piece, piece],
        "max_tokens": 1,
    });
    let resp = gw.post("/v1/completions", body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-kvgate-route"],
        "long",
        "~2,400 tokens in five prompts are a long request, whatever the first prompt is"
    );
    let single = gw
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": ["hi", "there"], "max_tokens": 1}),
        )
        .await;
    assert_eq!(single.headers()["x-kvgate-route"], "interactive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_header_is_cut_with_408() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |c| c.downstream.header_timeout_ms = 800).await;
    // One byte every 100 ms: each read is quick, the header never completes.
    let mut s = TcpStream::connect(gw.addr()).await.unwrap();
    let started = Instant::now();
    let header =
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";
    let mut cut = false;
    for b in header {
        if s.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if started.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    let answer = read_all(&mut s, Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "cut={cut}, got {answer:?}"
    );
    assert!(answer.contains("header_timeout"));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "cut near the deadline"
    );
    // A connection that sends nothing at all is closed too.
    let mut idle = TcpStream::connect(gw.addr()).await.unwrap();
    let answer = read_all(&mut idle, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(gw.metric("kvgate_gateway_connections_closed_total").await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connections_next_header_has_the_same_deadline() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |c| c.downstream.header_timeout_ms = 800).await;
    let mut s = TcpStream::connect(gw.addr()).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let started = Instant::now();
    for b in b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " {
        if s.write_all(&[*b]).await.is_err() || started.elapsed() > Duration::from_secs(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = read_all(&mut s, Duration::from_secs(5)).await;
    // What is left of the first answer may come first.
    assert!(answer.contains("HTTP/1.1 408"), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431_with_a_body() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    let big = "x".repeat(40 << 10);
    let resp = gw
        .client
        .get(format!("{}/v1/models", gw.base))
        .header("x-big", big)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 431);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "header_too_large");
    let mut many = reqwest::header::HeaderMap::new();
    for i in 0..150 {
        many.insert(
            reqwest::header::HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
            "1".parse().unwrap(),
        );
    }
    let resp = reqwest::Client::new()
        .get(format!("{}/v1/models", gw.base))
        .headers(many)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 431, "{:?}", resp.text().await);
    // The gateway still serves.
    let ok = gw
        .client
        .get(format!("{}/v1/models", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_limit_new_connections_get_503_at_once() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |c| c.downstream.max_connections = 8).await;
    // The readiness probe's pooled connection may still hold a slot; fill the rest.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(TcpStream::connect(gw.addr()).await.unwrap());
    }
    let mut extra = TcpStream::connect(gw.addr()).await.unwrap();
    let answer = read_all(&mut extra, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert!(answer.contains("connection_limit") && answer.contains("retry-after: 1"));
    assert!(gw.metric("kvgate_gateway_connections_refused_total").await >= 1.0);
    drop(held);
    // Slots come back as connections close.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let fresh = reqwest::Client::new();
        if let Ok(resp) = fresh.get(format!("{}/health", gw.base)).send().await {
            if resp.status() == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "slots never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_1_0_clients_get_a_close_delimited_stream() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    let body = json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 5,
        "stream": true,
    })
    .to_string();
    let mut s = TcpStream::connect(gw.addr()).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let answer = read_all(&mut s, Duration::from_secs(20)).await;
    let (head, rest) = answer.split_once("\r\n\r\n").expect("a whole response");
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 200") || head.starts_with("http/1.0 200"),
        "{head}"
    );
    assert!(
        !head.contains("transfer-encoding"),
        "no chunked for HTTP/1.0: {head}"
    );
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(
        !rest.starts_with(|c: char| c.is_ascii_hexdigit() && rest.contains("\r\n"))
            || rest.starts_with("data:")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_tokenisers_shed_with_429() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |c| {
        c.downstream.tokenize_concurrency = 1;
        c.downstream.tokenize_queue_timeout_ms = 1;
    })
    .await;
    let text = "lorem ipsum dolor sit amet ".repeat(6_000);
    let sends = (0..4).map(|i| {
        gw.post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": format!("{i} {text}"), "max_tokens": 1}),
        )
    });
    let statuses: Vec<u16> = futures::future::join_all(sends)
        .await
        .into_iter()
        .map(|r| r.status().as_u16())
        .collect();
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(
        statuses.contains(&429),
        "one tokeniser, no wait: {statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_whole_before_a_half_close_is_answered() {
    // A slow replica (4x the modelled step), so the answer comes well after the half-close.
    let r = start_replica(|c| c.time_scale = 4.0).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    for stream in [false, true] {
        let body = json!({
            "model": "Qwen3-8B",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8,
            "ignore_eos": true,
            "stream": stream,
        })
        .to_string();
        let mut s = TcpStream::connect(gw.addr()).await.unwrap();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        s.shutdown().await.unwrap(); // nc -N: no more to send, still listening
        let answer = read_all(&mut s, Duration::from_secs(20)).await;
        // An interim 100 Continue (which HTTP/1.1 clients skip) may come first.
        let last = answer
            .match_indices("HTTP/1.1 ")
            .last()
            .map(|(i, _)| &answer[i..])
            .unwrap_or("");
        assert!(
            last.starts_with("HTTP/1.1 200"),
            "stream={stream}: {answer}"
        );
        let done = if stream {
            "data: [DONE]"
        } else {
            "\"choices\""
        };
        assert!(last.contains(done), "stream={stream}: {answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tools_are_refused_naming_the_field_and_head_is_answered_like_get() {
    let r = start_replica(|_| {}).await;
    let gw = start_gateway(&[&r], |_| {}).await;
    for (tools, param) in [
        (json!([1]), "tools[0]"),
        (
            json!([{"type": "function", "function": {"description": "no name"}}]),
            "tools[0].function.name",
        ),
    ] {
        let resp = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
                       "tools": tools, "max_tokens": 2}),
            )
            .await;
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    for url in [
        format!("{}/health", gw.base),
        format!("{}/v1/models", gw.base),
        format!("{}/admin/policy", gw.admin),
        format!("{}/admin/replicas", gw.admin),
        format!("{}/metrics", gw.admin),
    ] {
        let resp = gw.client.head(&url).send().await.unwrap();
        assert_eq!(resp.status(), 200, "HEAD {url}");
    }
}
