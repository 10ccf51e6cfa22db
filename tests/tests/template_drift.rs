//! The failure that produces no error (the runbook's chat template): a gateway whose tokenizer
//! folder is not the engine's counts every prompt differently, and its prefix hashes stop
//! matching the engine's blocks. The gateway checks each answer's `usage.prompt_tokens`
//! against its own count: quiet with the right folder, caught within a few requests with a
//! wrong one — in `/admin/replicas` (the first mismatch) and in the alert's counter. A
//! vocabulary that keeps the count but not the ids is caught by the sampled token-id check
//! against the replica's `/tokenize`; sampled rendered prompts go to a file of their own.

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

/// Waits until the replica's token-id checks (spawned after each answer) reach `n`.
async fn id_checks(gw: &Gateway, n: u64) -> Value {
    let r = gw
        .wait_admin("/admin/replicas", "token-id checks", |v| {
            v[0]["prompt_check"]["token_ids"]["checked"] == n
        })
        .await;
    r[0]["prompt_check"]["token_ids"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_count_matches_with_the_right_tokenizer() {
    let rep = start_replica(|_| {}).await;
    let dir = std::env::temp_dir().join(format!("kvgate-samples-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let samples = dir.join("rendered.jsonl");
    let path = samples.display().to_string();
    let gw = start_gateway(&[&rep], |c| {
        c.drift.token_id_share = 1.0;
        c.drift.prompt_sample_share = 1.0;
        c.drift.prompt_sample_path = Some(path);
    })
    .await;
    traffic(&gw).await;
    let ids = id_checks(&gw, 3).await;
    assert_eq!(ids["mismatched"], 0, "{ids}");
    let m = gw.metrics_text().await;
    assert!(
        m.contains("kvgate_gateway_prompt_token_id_checks_total{replica=\"test-replica\""),
        "{m}"
    );
    assert!(m.contains("kvgate_gateway_prompt_samples_total{result=\"written\"} 3"));
    // The rendered prompts, as the template made them, and nothing naming the caller.
    let text = std::fs::read_to_string(&samples).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    let rendered = lines[0]["rendered"].as_str().unwrap();
    assert!(
        rendered.starts_with("<|im_start|>system\nYou answer questions about the harbour"),
        "{rendered}"
    );
    assert!(lines[0].get("tenant").is_none() && lines[0].get("request_id").is_none());
    std::fs::remove_dir_all(&dir).unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vocabulary_with_other_ids_keeps_the_count_and_is_caught_by_the_id_check() {
    // Qwen3's files with the ids of " the" and " world" swapped: every prompt has the same
    // number of tokens, but not the same tokens.
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3");
    let dir = std::env::temp_dir().join(format!("kvgate-permuted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut t: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["Ġthe"].clone(), vocab["Ġworld"].clone());
    vocab.insert("Ġthe".into(), b.clone());
    vocab.insert("Ġworld".into(), a.clone());
    std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();

    let rep = start_replica(|_| {}).await;
    let folder = dir.display().to_string();
    let gw = start_gateway(&[&rep], |c| {
        c.model.tokenizer_dir = Some(folder);
        c.drift.token_id_share = 1.0;
    })
    .await;
    traffic(&gw).await;
    let ids = id_checks(&gw, 3).await;
    let replicas = gw.admin_json("/admin/replicas").await;
    assert_eq!(check(&replicas)["mismatched"], 0, "the counts agree");
    assert_eq!(ids["mismatched"], 3, "{ids}");
    let first = &ids["first_mismatch"];
    assert_eq!(first["gateway_id"], b, "{first}");
    assert_eq!(first["engine_id"], a, "{first}");
    assert_eq!(first["gateway_tokens"], first["engine_tokens"]);
    assert_eq!(counted_ids(&gw.metrics_text().await, "mismatch"), 3.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn counted_ids(metrics: &str, result: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvgate_gateway_prompt_token_id_checks_total{"))
        .filter(|l| l.contains(&format!("result=\"{result}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
