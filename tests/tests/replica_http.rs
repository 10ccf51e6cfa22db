//! HTTP tests against a real replica (sim backend, real tokenizer) on 127.0.0.1:0.

mod common;

use common::start_replica;
use futures::StreamExt;
use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::kv_events::{FrameDecoder, KvEvent, KvEventBatch};
use protocol::sse::{SseDecoder, SseEvent};
use serde_json::{json, Value};

const SYSTEM: &str = "You are the support assistant of a company that sells paged KV caches. \
Answer briefly, cite the manual section when you can, never invent part numbers, and ask for \
the customer's order id before discussing a refund. The manual has sections on installation, \
block sizes, eviction policies, prefix hashing, event streams and troubleshooting.";

fn chat(user: &str, max_tokens: u32) -> Value {
    json!({
        "model": "Qwen3-8B",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_arrives_event_by_event() {
    let r = start_replica(|_| {}).await;
    let resp = r
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "count"}], "max_tokens": 40,
                   "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-kvgate-replica"], "test-replica");
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.bytes_stream();
    let mut dec = SseDecoder::new();
    let mut events = Vec::new();
    let mut checked_mid_stream = false;
    while let Some(chunk) = body.next().await {
        events.extend(dec.feed(&chunk.unwrap()));
        let content_events = events
            .iter()
            .filter(|e| matches!(e, SseEvent::Data(d) if d.contains("\"content\":\"") && !d.contains("\"content\":\"\"")))
            .count();
        if content_events >= 1 && !checked_mid_stream {
            // The first token reached us while the request is still generating.
            let load = r.load().await;
            assert_eq!(load["num_running_reqs"], 1, "{load}");
            checked_mid_stream = true;
        }
    }
    assert!(checked_mid_stream);
    assert_eq!(events.last(), Some(&SseEvent::Done));
    let data: Vec<Value> = events
        .iter()
        .filter_map(|e| match e {
            SseEvent::Data(d) => Some(serde_json::from_str(d).unwrap()),
            SseEvent::Done => None,
        })
        .collect();
    assert_eq!(data[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = data
        .iter()
        .filter_map(|d| d["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    let finish: Vec<&Value> = data
        .iter()
        .map(|d| &d["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!("length")]);
    let usage = &data.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 40);
    assert!(data.len() > 30, "one event per token, got {}", data.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reports_cached_tokens_for_a_shared_prefix() {
    let r = start_replica(|_| {}).await;
    let first: Value = r
        .post("/v1/chat/completions", chat("How do I install it?", 4))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second: Value = r
        .post("/v1/chat/completions", chat("Which block size?", 4))
        .await
        .json()
        .await
        .unwrap();

    // Expected: the full blocks both rendered prompts share.
    let tok = |u: &str| {
        let body = json!({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]});
        let r = &r;
        async move {
            r.post("/tokenize", body)
                .await
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let a: Vec<u64> =
        serde_json::from_value(tok("How do I install it?").await["tokens"].clone()).unwrap();
    let b: Vec<u64> =
        serde_json::from_value(tok("Which block size?").await["tokens"].clone()).unwrap();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let expected = (common / 16).min(cacheable_prompt_blocks(b.len(), 16)) * 16;
    assert!(expected >= 48, "the system prompt spans several blocks");
    assert_eq!(second["usage"]["prompt_tokens"], b.len());
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        expected
    );
    assert!(
        r.metric("kvgate_replica_prefix_cache_hits_tokens_total")
            .await
            >= expected as f64
    );

    // After /flush_cache the same prompt finds nothing cached.
    let flushed: Value = r
        .post("/flush_cache", json!({}))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        flushed["flushed_blocks"].as_u64().unwrap() >= 3,
        "{flushed}"
    );
    let third: Value = r
        .post("/v1/chat/completions", chat("Which block size?", 4))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(third["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

async fn read_frames(
    stream: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    dec: &mut FrameDecoder,
    until: impl Fn(&[(u64, KvEventBatch)]) -> bool,
) -> Vec<(u64, KvEventBatch)> {
    let mut got = Vec::new();
    while !until(&got) {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(20), stream.next())
            .await
            .expect("KV events arrive")
            .expect("stream open")
            .unwrap();
        got.extend(dec.feed(&chunk).unwrap());
    }
    got
}

fn stored_hashes(frames: &[(u64, KvEventBatch)]) -> Vec<u64> {
    let mut out = Vec::new();
    for (_, b) in frames {
        for e in &b.events {
            if let KvEvent::BlockStored { block_hashes, .. } = e {
                out.extend(block_hashes);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_stream_shows_stored_blocks_and_a_late_snapshot() {
    let r = start_replica(|_| {}).await;
    let early = r
        .client
        .get(format!("{}/kv_events", r.base))
        .send()
        .await
        .unwrap();
    assert_eq!(early.headers()["x-kvgate-replica"], "test-replica");
    let mut early = early.bytes_stream();
    let mut dec = FrameDecoder::new();
    let snap = read_frames(&mut early, &mut dec, |f| !f.is_empty()).await;
    assert_eq!(snap[0].1.events, vec![KvEvent::AllBlocksCleared]);
    let start_seq = snap[0].0;

    let prompt: Vec<u32> = (1000..1100).collect();
    let resp: Value = r
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(resp["usage"]["prompt_tokens"], 100);
    let expected = block_hashes(root_hash("Qwen3-8B", None, None), &prompt, 16);
    assert_eq!(expected.len(), 6);
    let live = read_frames(&mut early, &mut dec, |f| {
        let h = stored_hashes(f);
        expected.iter().all(|e| h.contains(e))
    })
    .await;
    // Live batches are numbered consecutively after the snapshot.
    for (i, (seq, _)) in live.iter().enumerate() {
        assert_eq!(*seq, start_seq + 1 + i as u64);
    }

    // A subscriber that joins now sees the same blocks in its snapshot.
    let mut late = r
        .client
        .get(format!("{}/kv_events", r.base))
        .send()
        .await
        .unwrap()
        .bytes_stream();
    let mut dec2 = FrameDecoder::new();
    let snap2 = read_frames(&mut late, &mut dec2, |f| !f.is_empty()).await;
    assert_eq!(snap2[0].1.events[0], KvEvent::AllBlocksCleared);
    let h = stored_hashes(&snap2);
    assert!(
        expected.iter().all(|e| h.contains(e)),
        "late snapshot holds every cached block"
    );
    assert!(snap2[0].0 >= live.last().unwrap().0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnecting_client_frees_its_blocks() {
    let r = start_replica(|_| {}).await;
    let resp = r
        .post(
            "/v1/completions",
            json!({"prompt": "tell me a very long story", "max_tokens": 20000, "ignore_eos": true, "stream": true}),
        )
        .await;
    let mut body = resp.bytes_stream();
    let mut dec = SseDecoder::new();
    let mut n = 0;
    while n < 3 {
        n += dec.feed(&body.next().await.unwrap().unwrap()).len();
    }
    let during = r.load().await;
    assert_eq!(during["num_reqs"], 1);
    assert!(during["kv_cache_usage"].as_f64().unwrap() > 0.0);
    drop(body); // the client goes away mid-stream
    let after = r
        .wait_load(|l| l["num_reqs"] == 0 && l["kv_cache_usage"].as_f64() == Some(0.0))
        .await;
    assert_eq!(after["num_tokens"], 0);
    assert_eq!(
        r.metric_with("kvgate_replica_requests_finished_total", "reason=\"abort\"")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_changes_nothing() {
    let r = start_replica(|c| c.max_model_len = Some(256)).await;
    let raw = r
        .client
        .post(format!("{}/v1/completions", r.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status(), 400);
    let e: Value = raw.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("invalid JSON"));

    let cases = [
        ("/v1/completions", json!({"prompt": ""}), 400, "prompt"),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages",
        ),
        ("/v1/completions", json!({"prompt": "hi", "n": 2}), 400, "n"),
        (
            "/v1/completions",
            json!({"prompt": "hi", "model": "gpt-4o"}),
            404,
            "model",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model",
        ),
        (
            "/v1/completions",
            json!({"prompt": [999999999]}),
            400,
            "prompt",
        ),
    ];
    for (path, body, status, param) in cases {
        let resp = r.post(path, body.clone()).await;
        assert_eq!(resp.status(), status, "{body}");
        let e: Value = resp.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert!(e["error"]["message"].is_string());
    }

    let long = "word ".repeat(400);
    let resp = r
        .post("/v1/completions", json!({"prompt": long, "max_tokens": 4}))
        .await;
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.unwrap();
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("256"), "{msg}");
    assert!(
        msg.contains("401") || msg.contains("400"),
        "names the prompt length: {msg}"
    );
    assert_eq!(e["error"]["code"], "context_length_exceeded");

    let resp = r
        .post(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 300}),
        )
        .await;
    assert_eq!(resp.status(), 400);

    let resp = r
        .client
        .get(format!("{}/nope", r.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-kvgate-replica"], "test-replica");
    let resp = r
        .client
        .get(format!("{}/v1/completions", r.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);

    // Nothing was queued or allocated, and a good request still works.
    let l = r.load().await;
    assert_eq!(l["num_reqs"], 0);
    assert_eq!(l["kv_cache_usage"], 0.0);
    let ok = r
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 3}))
        .await;
    assert_eq!(ok.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_the_endpoints_sglang_router_and_vllm_clients_use() {
    let r = start_replica(|_| {}).await;
    let models = r.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "Qwen3-8B");
    let load = r.get_json("/get_load").await;
    for k in ["dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"] {
        assert!(load[0][k].is_number(), "{k} in {load}");
    }
    for p in ["/server_info", "/get_server_info"] {
        let s = r.get_json(p).await;
        assert_eq!(s["page_size"], 16);
        assert!(s["max_total_num_tokens"].as_u64().unwrap() > 100_000);
    }
    for p in ["/model_info", "/get_model_info"] {
        assert_eq!(r.get_json(p).await["is_generation"], true);
    }
    let t: Value = r
        .post("/tokenize", json!({"prompt": "Hello world"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(t["count"], 2);
    let d: Value = r
        .post("/detokenize", json!({"tokens": t["tokens"]}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(d["prompt"], "Hello world");
    // Routers' bookkeeping fields (sglang-router's `rid`) and fields that ask for nothing pass;
    // a batch prompt gets one choice each.
    let resp: Value = r
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": ["a b", "c d"], "max_tokens": 3,
                                        "ignore_eos": true, "rid": "x", "return_logprob": false}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(resp["choices"].as_array().unwrap().len(), 2);
    assert_eq!(resp["usage"]["completion_tokens"], 6);
    // A field the engine does not implement is refused, by name, not ignored.
    let resp = r
        .post(
            "/v1/chat/completions",
            json!({"model": "Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_object"}}),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let e: Value = resp.json().await.unwrap();
    assert_eq!(e["error"]["param"], "response_format");
    // The sim has no logits, so it refuses logprobs rather than invent them.
    let resp = r
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "hi", "logprobs": 2}),
        )
        .await;
    assert_eq!(resp.status(), 400);
    // A model card by id.
    let card = r.get_json("/v1/models/Qwen3-8B").await;
    assert_eq!(card["id"], "Qwen3-8B");
    let missing = r
        .client
        .get(format!("{}/v1/models/gpt-4", r.base))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_seeds_behave() {
    let r = start_replica(|_| {}).await;
    let body = json!({"prompt": "go", "max_tokens": 30, "seed": 7, "ignore_eos": true});
    let a: Value = r
        .post("/v1/completions", body.clone())
        .await
        .json()
        .await
        .unwrap();
    let b: Value = r.post("/v1/completions", body).await.json().await.unwrap();
    let text = a["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(
        text,
        b["choices"][0]["text"].as_str().unwrap(),
        "same seed, same text"
    );
    // Stop at the third word of that text.
    let words: Vec<&str> = text.split_whitespace().collect();
    let stop = words[2];
    let cut: Value = r
        .post("/v1/completions", json!({"prompt": "go", "max_tokens": 30, "seed": 7, "ignore_eos": true, "stop": [stop]}))
        .await
        .json()
        .await
        .unwrap();
    let got = cut["choices"][0]["text"].as_str().unwrap();
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert_eq!(got, &text[..text.find(stop).unwrap()]);
    // The stopped request was cancelled in the engine.
    r.wait_load(|l| l["num_reqs"] == 0 && l["kv_cache_usage"].as_f64() == Some(0.0))
        .await;
}
