//! The failure that produces no error (the runbook's chat template): a gateway whose tokenizer
//! folder is not the engine's counts every prompt differently, and its prefix hashes stop
//! matching the engine's blocks. The gateway checks each answer's `usage.prompt_tokens`
//! against its own count: quiet with the right folder, caught within a few requests with a
//! wrong one — in `/admin/replicas` (the first mismatch) and in the alert's counter.

mod common;

use common::{start_gateway, start_replica, Gateway};
use serde_json::{json, Value};

/// Two unstreamed chat requests and one streamed with a usage event, all answered 200.
async fn traffic(gw: &Gateway) {
    for (i, stream) in [false, false, true].into_iter().enumerate() {
        let mut body = json!({
            "model": "Qwen3-8B",
            "messages": [
                {"role": "system", "content": "You answer questions about the harbour timetable."},
                {"role": "user", "content": format!("When does ferry {i} leave?")}
            ],
            "max_tokens": 3,
            "stream": stream,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = gw.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), 200);
        let _ = r.text().await.unwrap();
    }
}

fn check(replicas: &Value) -> &Value {
    &replicas[0]["prompt_check"]
}

/// The counter's value for one result, summed over the replica's series.
fn counted(metrics: &str, result: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvgate_gateway_prompt_token_checks_total{"))
        .filter(|l| l.contains(&format!("result=\"{result}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_count_matches_with_the_right_tokenizer() {
    let rep = start_replica(|_| {}).await;
    let gw = start_gateway(&[&rep], |_| {}).await;
    traffic(&gw).await;
    let replicas = gw.admin_json("/admin/replicas").await;
    let c = check(&replicas);
    assert_eq!(c["checked"], 3, "every answer with a usage is checked: {c}");
    assert_eq!(c["mismatched"], 0, "{c}");
    assert!(c["first_mismatch"].is_null(), "{c}");
    let m = gw.metrics_text().await;
    assert_eq!(counted(&m, "match"), 3.0);
    assert_eq!(counted(&m, "mismatch"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_tokenizer_folder_is_caught_within_a_few_requests() {
    // The replica renders and tokenises with Qwen3's files; the gateway is given Llama 3's.
    let rep = start_replica(|_| {}).await;
    let llama = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/llama3");
    let gw = start_gateway(&[&rep], |c| {
        c.model.tokenizer_dir = Some(llama.display().to_string())
    })
    .await;
    traffic(&gw).await;
    let replicas = gw.admin_json("/admin/replicas").await;
    let c = check(&replicas);
    assert_eq!(c["checked"], 3, "{c}");
    assert_eq!(c["mismatched"], 3, "{c}");
    let first = &c["first_mismatch"];
    assert_ne!(first["gateway_tokens"], first["engine_tokens"], "{first}");
    assert_eq!(first["route"], "default");
    assert_eq!(counted(&gw.metrics_text().await, "mismatch"), 3.0);
}
