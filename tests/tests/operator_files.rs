//! The operator files name only metrics the code really exports: every `kvgate_*` name in
//! `config/alerts.yml` and `config/dashboard.json` must appear on a running replica's or
//! gateway's `/metrics`.

mod common;

use std::collections::BTreeSet;

use common::{start_gateway, start_replica};
use serde_json::json;

fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("kvgate_") {
            out.insert(word.to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_and_dashboard_use_exported_metric_names() {
    let rep = start_replica(|_| {}).await;
    let gw = start_gateway(&[&rep], |_| {}).await;
    // Traffic, so every labelled series exists.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "Qwen3-8B", "prompt": "hello there", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut exported = BTreeSet::new();
    for url in [
        format!("{}/metrics", rep.base),
        format!("{}/metrics", gw.admin),
    ] {
        let text = gw
            .client
            .get(url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        exported.extend(metric_names(&text));
    }
    let rules =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/alerts.yml"))
            .unwrap();
    let used = metric_names(&rules);
    assert!(used.len() >= 6, "{used:?}");
    let missing: Vec<&String> = used.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "alert rules name metrics nobody exports: {missing:?}"
    );
}
