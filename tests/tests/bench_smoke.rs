//! A short open-loop run of the load tester against a real gateway and replicas: the pipeline
//! produces a well-formed report (this asserts shape and sanity, not speed).

mod common;

use std::time::Duration;

use common::{start_gateway, start_replica};
use loadtest::run::{run, RunSpec, Slo, Workload};
use loadtest::workload::Kind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_chat_run_produces_a_well_formed_report() {
    let reps = [
        start_replica(|c| c.replica_id = "a".into()).await,
        start_replica(|c| c.replica_id = "b".into()).await,
    ];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    let spec = RunSpec {
        base_url: gw.base.clone(),
        label: "gateway".into(),
        model: "Qwen3-8B".into(),
        workload: Workload::Generated(Kind::Chat),
        rate: 10.0,
        duration: Duration::from_secs(3),
        max_requests: 40,
        warmup: Duration::from_millis(500),
        seed: 3,
        request_timeout: Duration::from_secs(120),
        slo: Slo::from_ms(Some(30_000), None),
        progress: false,
        // A share of SDK-style unstreamed calls: answered whole, judged on end to end.
        unstreamed_share: 0.3,
        max_tokens: None,
    };
    let report = run(&spec).await;
    assert!(report.sent > 10, "{}", report.sent);
    assert_eq!(
        report.ok,
        report.measured,
        "every measured request succeeded: {}",
        report.table()
    );
    // The unstreamed ones came back whole: tokens counted, no TTFT of their own.
    let whole: Vec<_> = report.samples.iter().filter(|s| !s.stream).collect();
    assert!(!whole.is_empty() && whole.len() < report.samples.len());
    assert!(whole
        .iter()
        .all(|s| s.ttft_s.is_none() && s.completion_tokens > 0 && s.prompt_tokens > 0));
    let ttft = report.ttft_s.as_ref().expect("ttft summary");
    assert!(ttft.p50 <= ttft.p95 && ttft.p95 <= ttft.p99);
    assert!(report.inter_token_s.is_some());
    assert!(report.per_replica.values().sum::<usize>() == report.ok);
    assert!((0.0..=1.0).contains(&report.prefix_hit_ratio));
    let json = serde_json::to_value(&report).unwrap();
    for key in [
        "ttft_s",
        "inter_token_s",
        "e2e_s",
        "prefix_hit_ratio",
        "per_replica",
        "samples",
    ] {
        assert!(json.get(key).is_some(), "{key}");
    }
    assert!(report.table().contains("ttft"));
    // Generous promise on an idle fleet: every measured request is goodput.
    assert_eq!(report.good, report.ok);
}
