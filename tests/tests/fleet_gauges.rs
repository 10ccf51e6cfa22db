//! The autoscaling signal, the cost gauge and the utilisation gauges (busy share and model
//! FLOPs utilisation), end to end: a real gateway in front of a real sim replica, priced in
//! `[cost]`.

mod common;

use std::time::{Duration, Instant};

use common::{start_gateway, start_replica, Gateway};
use serde_json::json;

/// The value of the unlabelled series `name` on the admin port's `/metrics`.
async fn gauge(g: &Gateway, name: &str) -> Option<f64> {
    let text = g.metrics_text().await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_per_mtok_is_priced_on_the_replicas_measured_throughput() {
    let rep = start_replica(|_| {}).await;
    let g = start_gateway(&[&rep], |c| {
        c.cost.gpu_hour_usd = Some(2.0);
        c.cost.gpus_per_replica = 2;
        c.cost.managed_usd_per_mtok = Some(0.6);
        c.cost.window_s = 60;
    })
    .await;
    // Idle, nothing is waiting: the fleet is below its knee.
    let idle = gauge(&g, "kvgate_gateway_scale_signal").await;
    assert!(idle.is_some_and(|s| s < 1.0), "idle signal {idle:?}");
    assert_eq!(
        gauge(&g, "kvgate_gateway_managed_cost_per_mtok").await,
        Some(0.6)
    );
    // Generate for a while, so the replica's counter is sampled over more than a second.
    let started = Instant::now();
    let mut generated = 0u64;
    while started.elapsed() < Duration::from_millis(2500) {
        let r = g
            .post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": "Count with me", "max_tokens": 64,
                       "ignore_eos": true}),
            )
            .await;
        assert_eq!(r.status(), 200);
        generated += 64;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let (cost, tps) = loop {
        let cost = gauge(&g, "kvgate_gateway_fleet_cost_per_mtok").await;
        let replicas = g.admin_json("/admin/replicas").await;
        let tps = replicas[0]["generation_tokens_per_s_1m"].as_f64();
        if let (Some(c), Some(t)) = (cost.filter(|c| c.is_finite()), tps) {
            break (c, t);
        }
        assert!(
            Instant::now() < deadline,
            "no cost gauge: {cost:?}, {replicas}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The throughput is the replica's own count over the time it took ...
    let elapsed = started.elapsed().as_secs_f64();
    assert!(
        tps > 0.0 && tps <= generated as f64 / 1.0,
        "{tps} tokens/s for {generated} tokens in {elapsed:.1} s"
    );
    // ... and the gauge is the capacity note's formula on it: 4 USD an hour (2 GPUs at 2).
    let expected = 4.0 / (tps * 3600.0) * 1e6;
    assert!(
        (cost / expected - 1.0).abs() < 0.25,
        "cost {cost} USD/Mtok, formula on {tps} tokens/s gives {expected}"
    );
    let route = g.metrics_text().await;
    assert!(
        route.contains("kvgate_gateway_cost_per_mtok{route="),
        "per-route series missing"
    );
    assert!(route.contains("kvgate_gateway_route_scale_signal{route="));
    // The replica was busy most of the time the requests ran back to back: its busy share
    // (its step time per second, from /get_load's busy_seconds) and the fleet's mean show it.
    let labelled = |text: &str, prefix: &str| -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let busy = labelled(&route, "kvgate_gateway_replica_busy_share{").unwrap();
    let fleet = labelled(&route, "kvgate_gateway_fleet_busy_share{window=\"1m\"}").unwrap();
    assert!(busy > 0.1 && busy <= 1.0, "busy share {busy}");
    assert!((fleet - busy).abs() < 0.2, "fleet {fleet}, replica {busy}");
    // Busy is a duty cycle: one stream decoding at a time keeps the replica busy while its
    // steps use a sliver of the GPU's arithmetic. Model FLOPs utilisation (the sim's modelled
    // FLOPs per second over its peak) says so, for the replica and the fleet alike.
    let mfu = labelled(&route, "kvgate_gateway_replica_mfu{").unwrap();
    let fleet_mfu = labelled(&route, "kvgate_gateway_fleet_mfu{window=\"1m\"}").unwrap();
    assert!(
        mfu > 0.0 && mfu < 0.05 && mfu < busy / 10.0,
        "mfu {mfu}, busy {busy}"
    );
    assert!(
        (fleet_mfu - mfu).abs() <= 0.1 * mfu,
        "fleet mfu {fleet_mfu}, replica {mfu}"
    );
}
