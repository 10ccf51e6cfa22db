//! Regression mode against the committed baseline (`loadtest/baselines/ci-sim.json`): a fresh
//! sim fleet of this build re-runs the baseline's exact benchmark and must show no regression;
//! the same fleet with a planted slowdown (prefill at a third of its modelled speed) must be
//! flagged, with a non-zero exit naming the metrics.
//!
//! Each cell runs 12 s (13–36 requests a seed): with 6 s (4–18), a seed's TTFT p95 was its
//! slowest request or two, and one request placed differently (the step-phase prediction
//! reads live timing, so placement is not bit-for-bit repeatable) moved it by 15–20%: two
//! runs of one build passed and failed the 15% tolerance.
//!
//! Re-record the baseline (after a change that is meant to move the figures) with
//! `KVGATE_RECORD_BASELINE=1 cargo test -p kvgate-tests --test bench_regression`.

mod common;

use std::path::PathBuf;

use common::*;

fn baseline_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../loadtest/baselines/ci-sim.json")
}

/// Two sim replicas (qwen3-8b on an A100, steps stretched 4×, so modelled time dwarfs what a
/// slower CI machine adds in the debug build; `compute_efficiency` sets the prefill speed)
/// behind a prefix-aware gateway with KV events.
async fn fleet(compute_efficiency: f64) -> (Vec<Replica>, Gateway) {
    let mut reps = Vec::new();
    for id in ["a", "b"] {
        reps.push(
            start_replica(|c| {
                c.replica_id = id.into();
                c.gpu = "a100".into();
                c.compute_efficiency = compute_efficiency;
                c.time_scale = 4.0;
            })
            .await,
        );
    }
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |_| {}).await;
    (reps, gw)
}

async fn bench(gw: &Gateway, reps: &[Replica], args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(kvgate_binary());
    cmd.arg("bench")
        .args(["--target", &gw.base, "--no-progress"])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env("KVGATE_FLEET_TOKEN", FLEET_TOKEN);
    for r in reps {
        cmd.args(["--flush", &r.base]);
    }
    cmd.output().await.unwrap()
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_of_the_committed_baseline_passes_and_a_planted_slowdown_is_flagged() {
    let file = baseline_file();
    if std::env::var("KVGATE_RECORD_BASELINE").is_ok_and(|v| v == "1") {
        let (reps, gw) = fleet(replica::roofline::DEFAULT_COMPUTE_EFFICIENCY).await;
        let out = bench(
            &gw,
            &reps,
            &[
                "--record-baseline",
                file.to_str().unwrap(),
                "--workload",
                "chat",
                "--rates",
                "1,3",
                "--seeds",
                "1,2,3",
                "--duration",
                "12",
                "--warmup",
                "1",
                "--slo-ttft-ms",
                "3000",
                "--note",
                "CI guard: 2 sim replicas (qwen3-8b, a100, time scale 4) behind prefix_aware with KV events, \
                 in-process debug build (tests/tests/bench_regression.rs)",
            ],
        )
        .await;
        assert!(out.status.success(), "{}", text(&out));
        return;
    }
    let baseline = file.to_str().unwrap();
    let (reps, gw) = fleet(replica::roofline::DEFAULT_COMPUTE_EFFICIENCY).await;
    let same = bench(&gw, &reps, &["--baseline", baseline]).await;
    let out = text(&same);
    eprintln!("{out}");
    assert!(same.status.success(), "{out}");
    assert!(out.contains("verdict: no regression"), "{out}");
    assert!(
        out.contains("| ttft_p95 |") && out.contains("capacity note"),
        "{out}"
    );
    drop(gw);
    drop(reps);

    let (reps, gw) = fleet(replica::roofline::DEFAULT_COMPUTE_EFFICIENCY / 3.0).await;
    let slow = bench(&gw, &reps, &["--baseline", baseline]).await;
    let out = text(&slow);
    eprintln!("{out}");
    assert!(!slow.status.success(), "{out}");
    assert!(
        out.contains("regressed against the baseline") && out.contains("ttft_p95 at 1/s"),
        "{out}"
    );
}
