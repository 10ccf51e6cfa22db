//! The side-by-side benchmark end to end, small: `loadtest/compare.sh --smoke` starts two sim
//! replicas, five kvgate gateways (one per policy) and sglang-router (when its virtualenv can be
//! made), runs `kvgate bench` in compare mode at one low rate, and writes the report. This test
//! checks that results are produced and well formed — never how fast anything was.

use std::path::PathBuf;

use serde_json::Value;

#[test]
fn compare_script_produces_a_well_formed_report() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let bin = target.join("debug/kvgate");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build` first",
        bin.display()
    );
    let out = std::env::temp_dir().join(format!("kvgate-compare-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let status = std::process::Command::new("bash")
        .arg(root.join("loadtest/compare.sh"))
        .args(["--smoke", "--out"])
        .arg(&out)
        .env("KVGATE_BIN", &bin)
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .expect("run loadtest/compare.sh");
    assert!(
        status.success(),
        "compare.sh failed: {status}; logs in {}",
        out.display()
    );

    let report: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let targets: Vec<&str> = report["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    for t in [
        "round_robin",
        "least_load",
        "consistent_hash",
        "prefix_aware_approx",
        "prefix_aware_events",
    ] {
        assert!(targets.contains(&t), "{t} missing from {targets:?}");
    }
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(
        runs.len(),
        targets.len() * report["rates"].as_array().unwrap().len()
    );
    for r in runs {
        assert!(
            r["ok"].as_u64().unwrap() > 0,
            "a run with no successful request: {r}"
        );
        for timer in ["ttft_s", "inter_token_s", "e2e_s"] {
            let s = &r[timer];
            let (p50, p95, p99) = (
                s["p50"].as_f64().unwrap(),
                s["p95"].as_f64().unwrap(),
                s["p99"].as_f64().unwrap(),
            );
            assert!(0.0 <= p50 && p50 <= p95 && p95 <= p99, "{timer}: {s}");
        }
        let hit = r["prefix_hit_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit));
        assert!(!r["per_replica"].as_object().unwrap().is_empty());
    }
    let oracle = report["oracle"][0]["hit_ratio"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&oracle));
    assert_eq!(report["knees"].as_array().unwrap().len(), targets.len());
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| prefix_aware_events |"), "{md}");
    let png = std::fs::read(out.join("throughput_latency.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(out.join("throughput_latency.svg")).unwrap();
    assert!(svg.contains("<svg"));
    assert!(out
        .join(format!(
            "ttft_cdf_{:.2}rps.png",
            report["rates"][0].as_f64().unwrap()
        ))
        .exists());
    let _ = std::fs::remove_dir_all(&out);
}
