//! Regression mode: a benchmark recorded with its exact spec (workload, seeds, rates, duration,
//! SLO) and its per-seed figures, re-run later against a new build and compared metric by
//! metric, with the seeds as the noise band.
//!
//! The rule, per rate and metric: each seed's change is measured against the same seed's
//! baseline (the same requests at the same times), oriented so that positive means worse. A
//! metric *regressed* when the median change is worse than its tolerance **and** every seed
//! is worse; *improved* symmetrically; otherwise it is within noise. With one seed the median
//! is that seed. The capacity note (the knee: the highest rate at which goodput is at least
//! 90% of what was offered, as `compare::knee`) is re-derived per seed beside the old one.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::compare::{compare as compare_runs, CompareSpec, Target};
use crate::run::{Report, RunSpec};

/// The file format's name and version.
pub const FORMAT: &str = "kvgate-bench-baseline/1";

/// Everything that decides which requests are sent and how they are judged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchSpec {
    /// A generated workload's name, or `trace`.
    pub workload: String,
    /// The trace file, for `trace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
    /// FNV-1a of the trace file's bytes: a changed trace is refused, not compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_fnv1a: Option<String>,
    pub model: String,
    pub rates: Vec<f64>,
    pub seeds: Vec<u64>,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub max_requests: usize,
    pub slo_ttft_ms: Option<u64>,
    pub slo_itl_ms: Option<u64>,
    pub unstreamed_share: f64,
    /// `--max-tokens`, when the baseline was recorded with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
}

/// One run's figures (one rate, one seed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunFigures {
    pub rate: f64,
    pub seed: u64,
    pub offered_per_s: f64,
    pub ok: usize,
    pub shed: usize,
    pub errors: usize,
    pub ttft_p95_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub itl_p95_s: Option<f64>,
    pub itl_p99_s: Option<f64>,
    pub goodput_per_s: f64,
    pub output_tokens_per_s: f64,
    pub prefix_hit_ratio: f64,
}

impl RunFigures {
    pub fn of(r: &Report, seed: u64) -> Self {
        RunFigures {
            rate: r.rate,
            seed,
            offered_per_s: r.offered_per_s,
            ok: r.ok,
            shed: r.shed,
            errors: r.errors,
            ttft_p95_s: r.ttft_s.as_ref().map(|s| s.p95),
            ttft_p99_s: r.ttft_s.as_ref().map(|s| s.p99),
            itl_p95_s: r.inter_token_s.as_ref().map(|s| s.p95),
            itl_p99_s: r.inter_token_s.as_ref().map(|s| s.p99),
            goodput_per_s: r.goodput_requests_per_s,
            output_tokens_per_s: r.output_tokens_per_s,
            prefix_hit_ratio: r.prefix_hit_ratio,
        }
    }
}

/// A recorded benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub format: String,
    /// Where it ran (informational: a re-run names its own target).
    pub target_url: String,
    /// Free text: the build, the machine, the fleet.
    #[serde(default)]
    pub note: String,
    pub spec: BenchSpec,
    pub runs: Vec<RunFigures>,
    /// The knee per seed, in `spec.seeds` order.
    pub knees: Vec<Option<f64>>,
}

#[derive(Debug, thiserror::Error)]
pub enum BaselineError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a bench baseline: {reason}")]
    Format { path: String, reason: String },
}

impl Baseline {
    pub fn load(path: &Path) -> Result<Self, BaselineError> {
        let text = std::fs::read_to_string(path).map_err(|source| BaselineError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let b: Baseline = serde_json::from_str(&text).map_err(|e| BaselineError::Format {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        if b.format != FORMAT {
            return Err(BaselineError::Format {
                path: path.display().to_string(),
                reason: format!("format `{}`, expected `{FORMAT}`", b.format),
            });
        }
        Ok(b)
    }
}

/// Runs `spec` against `base`'s target: for each seed, every rate in order (flushing `flush`
/// before each run), and records the figures. `base` carries the client settings; its seed and
/// rate are replaced run by run.
pub async fn record(
    base: &RunSpec,
    spec: &BenchSpec,
    flush: &[String],
    note: String,
    mut on_run: impl FnMut(&Report, u64),
) -> Baseline {
    let (mut runs, mut knees) = (Vec::new(), Vec::new());
    for &seed in &spec.seeds {
        let mut b = base.clone();
        b.seed = seed;
        let cs = CompareSpec {
            targets: vec![Target {
                name: base.label.clone(),
                url: base.base_url.clone(),
            }],
            rates: spec.rates.clone(),
            flush: flush.to_vec(),
            base: b,
        };
        let rep = compare_runs(&cs, |_| None, |r| on_run(r, seed)).await;
        // A cache that was not flushed makes runs incomparable (a warm cache reads as an
        // improved hit ratio): say so loudly.
        for e in &rep.flush_errors {
            eprintln!("WARNING: flush failed, this run started warm: {e}");
        }
        runs.extend(rep.runs.iter().map(|r| RunFigures::of(r, seed)));
        knees.push(rep.knees.first().and_then(|k| k.rate));
    }
    Baseline {
        format: FORMAT.into(),
        target_url: base.base_url.clone(),
        note,
        spec: spec.clone(),
        runs,
        knees,
    }
}

/// FNV-1a (64-bit) of a file's bytes, as hex.
pub fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// What is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    TtftP95,
    TtftP99,
    ItlP95,
    ItlP99,
    Goodput,
    Throughput,
    HitRatio,
}

impl Metric {
    pub const ALL: [Metric; 7] = [
        Metric::TtftP95,
        Metric::TtftP99,
        Metric::ItlP95,
        Metric::ItlP99,
        Metric::Goodput,
        Metric::Throughput,
        Metric::HitRatio,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::TtftP95 => "ttft_p95",
            Metric::TtftP99 => "ttft_p99",
            Metric::ItlP95 => "itl_p95",
            Metric::ItlP99 => "itl_p99",
            Metric::Goodput => "goodput",
            Metric::Throughput => "throughput",
            Metric::HitRatio => "hit_ratio",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Metric::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The tolerance a change must exceed (relative; absolute for the hit ratio). Tail
    /// percentiles move more from run to run than medians or rates, so they get more room.
    pub fn default_tolerance(self) -> f64 {
        match self {
            Metric::TtftP95 | Metric::ItlP95 => 0.15,
            Metric::TtftP99 | Metric::ItlP99 => 0.25,
            Metric::Goodput | Metric::Throughput => 0.05,
            Metric::HitRatio => 0.02,
        }
    }

    fn value(self, r: &RunFigures) -> Option<f64> {
        match self {
            Metric::TtftP95 => r.ttft_p95_s,
            Metric::TtftP99 => r.ttft_p99_s,
            Metric::ItlP95 => r.itl_p95_s,
            Metric::ItlP99 => r.itl_p99_s,
            Metric::Goodput => Some(r.goodput_per_s),
            Metric::Throughput => Some(r.output_tokens_per_s),
            Metric::HitRatio => Some(r.prefix_hit_ratio),
        }
    }

    /// How much worse `new` is than `old`: a fraction of `old` (latencies up, rates down
    /// are positive), or the hit ratio's drop in points.
    fn worse_by(self, old: f64, new: f64) -> Option<f64> {
        match self {
            Metric::HitRatio => Some(old - new),
            Metric::TtftP95 | Metric::TtftP99 | Metric::ItlP95 | Metric::ItlP99 => {
                (old > 0.0).then(|| new / old - 1.0)
            }
            Metric::Goodput | Metric::Throughput => (old > 0.0).then(|| 1.0 - new / old),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Regressed,
    Improved,
    WithinNoise,
    /// Not measured in one of the two (e.g. no successful request).
    Missing,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Regressed => "REGRESSED",
            Verdict::Improved => "improved",
            Verdict::WithinNoise => "no regression",
            Verdict::Missing => "not measured",
        }
    }
}

/// One metric at one rate.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricChange {
    pub rate: f64,
    pub metric: Metric,
    pub old_median: Option<f64>,
    pub new_median: Option<f64>,
    /// Median and range over seeds of how much worse the new run is (see `Metric::worse_by`).
    pub worse_median: Option<f64>,
    pub worse_range: Option<(f64, f64)>,
    pub tolerance: f64,
    pub verdict: Verdict,
}

/// The whole comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub changes: Vec<MetricChange>,
    pub old_knee: Option<f64>,
    pub new_knee: Option<f64>,
    pub knee_verdict: Verdict,
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn median_knee(knees: &[Option<f64>]) -> Option<f64> {
    // A seed without a knee (no rate met the rule) counts as 0/s.
    let mut v: Vec<f64> = knees.iter().map(|k| k.unwrap_or(0.0)).collect();
    median(&mut v)
}

/// Compares `new` with `old` run by run (same rate, same seed).
pub fn compare(old: &Baseline, new: &Baseline, tolerances: &BTreeMap<Metric, f64>) -> Comparison {
    let find = |b: &Baseline, rate: f64, seed: u64| {
        b.runs
            .iter()
            .find(|r| r.seed == seed && (r.rate - rate).abs() < 1e-9)
            .cloned()
    };
    let mut changes = Vec::new();
    for &rate in &old.spec.rates {
        for metric in Metric::ALL {
            let tolerance = tolerances
                .get(&metric)
                .copied()
                .unwrap_or(metric.default_tolerance());
            let (mut olds, mut news, mut worse) = (Vec::new(), Vec::new(), Vec::new());
            for &seed in &old.spec.seeds {
                let (Some(o), Some(n)) = (find(old, rate, seed), find(new, rate, seed)) else {
                    continue;
                };
                let (Some(ov), Some(nv)) = (metric.value(&o), metric.value(&n)) else {
                    continue;
                };
                olds.push(ov);
                news.push(nv);
                if let Some(w) = metric.worse_by(ov, nv) {
                    worse.push(w);
                }
            }
            let range = worse
                .iter()
                .fold(None, |acc: Option<(f64, f64)>, &w| match acc {
                    None => Some((w, w)),
                    Some((lo, hi)) => Some((lo.min(w), hi.max(w))),
                });
            let worse_median = median(&mut worse.clone());
            let verdict = match (worse_median, range) {
                (Some(m), Some((lo, _))) if m > tolerance && lo > 0.0 => Verdict::Regressed,
                (Some(m), Some((_, hi))) if m < -tolerance && hi < 0.0 => Verdict::Improved,
                (Some(_), Some(_)) => Verdict::WithinNoise,
                _ => Verdict::Missing,
            };
            changes.push(MetricChange {
                rate,
                metric,
                old_median: median(&mut olds),
                new_median: median(&mut news),
                worse_median,
                worse_range: range,
                tolerance,
                verdict,
            });
        }
    }
    let (old_knee, new_knee) = (median_knee(&old.knees), median_knee(&new.knees));
    let knee_verdict = if old.spec.rates.len() < 2 {
        Verdict::Missing
    } else {
        match (old_knee, new_knee) {
            (Some(o), Some(n)) if n < o => Verdict::Regressed,
            (Some(o), Some(n)) if n > o => Verdict::Improved,
            (Some(_), Some(_)) => Verdict::WithinNoise,
            _ => Verdict::Missing,
        }
    };
    Comparison {
        changes,
        old_knee,
        new_knee,
        knee_verdict,
    }
}

impl Comparison {
    pub fn regressed(&self) -> bool {
        self.knee_verdict == Verdict::Regressed
            || self.changes.iter().any(|c| c.verdict == Verdict::Regressed)
    }

    /// A Markdown table per rate and the capacity note's line.
    pub fn markdown(&self) -> String {
        let fmt = |m: Metric, v: Option<f64>| match (m, v) {
            (_, None) => "-".to_string(),
            (Metric::TtftP95 | Metric::TtftP99 | Metric::ItlP95 | Metric::ItlP99, Some(x)) => {
                format!("{:.0} ms", x * 1e3)
            }
            (Metric::HitRatio, Some(x)) => format!("{:.3}", x),
            (_, Some(x)) => format!("{:.2}", x),
        };
        // Positive is worse for every metric: a fraction of the baseline, or the hit ratio's
        // drop in points. (Adding 0.0 turns a negative zero into a plain one.)
        let pct = |m: Metric, x: f64| match m {
            Metric::HitRatio => format!("{:+.3}", x + 0.0),
            _ => format!("{:+.1}%", x * 100.0 + 0.0),
        };
        let mut out = String::new();
        let mut rate = f64::NAN;
        for c in &self.changes {
            if c.rate != rate {
                rate = c.rate;
                out.push_str(&format!(
                    "\n### at {rate}/s\n\n| metric | baseline | new | worse by (median of seeds) | seeds' range | tolerance | verdict |\n|---|---|---|---|---|---|---|\n"
                ));
            }
            let (median, range) = match (c.worse_median, c.worse_range) {
                (Some(m), Some((lo, hi))) => (
                    pct(c.metric, m),
                    format!("{} … {}", pct(c.metric, lo), pct(c.metric, hi)),
                ),
                _ => ("-".into(), "-".into()),
            };
            let tol = match c.metric {
                Metric::HitRatio => format!("{:.3}", c.tolerance),
                _ => format!("{:.0}%", c.tolerance * 100.0),
            };
            out.push_str(&format!(
                "| {} | {} | {} | {median} | {range} | {tol} | {} |\n",
                c.metric.name(),
                fmt(c.metric, c.old_median),
                fmt(c.metric, c.new_median),
                c.verdict.name()
            ));
        }
        let knee = |k: Option<f64>| k.map_or("-".into(), |k| format!("{k}/s"));
        out.push_str(&format!(
            "\ncapacity note (knee: highest rate with goodput ≥ 90% of offered, median of seeds): baseline {}, new {} — {}\n",
            knee(self.old_knee),
            knee(self.new_knee),
            if self.knee_verdict == Verdict::Missing {
                "needs two or more rates".to_string()
            } else {
                self.knee_verdict.name().to_string()
            }
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(rate: f64, seed: u64, ttft: f64, goodput: f64) -> RunFigures {
        RunFigures {
            rate,
            seed,
            offered_per_s: rate,
            ok: 10,
            shed: 0,
            errors: 0,
            ttft_p95_s: Some(ttft),
            ttft_p99_s: Some(ttft * 1.5),
            itl_p95_s: Some(0.02),
            itl_p99_s: Some(0.03),
            goodput_per_s: goodput,
            output_tokens_per_s: 100.0,
            prefix_hit_ratio: 0.5,
        }
    }

    fn baseline(ttfts: [f64; 3], goodput: f64, knees: Vec<Option<f64>>) -> Baseline {
        Baseline {
            format: FORMAT.into(),
            target_url: "http://x".into(),
            note: String::new(),
            spec: BenchSpec {
                workload: "chat".into(),
                trace: None,
                trace_fnv1a: None,
                model: "m".into(),
                rates: vec![2.0, 4.0],
                seeds: vec![1, 2, 3],
                duration_s: 10.0,
                warmup_s: 1.0,
                max_requests: 100,
                slo_ttft_ms: Some(500),
                slo_itl_ms: None,
                unstreamed_share: 0.0,
                max_tokens: None,
            },
            runs: [2.0, 4.0]
                .iter()
                .flat_map(|&r| (0..3).map(move |i| figures(r, i as u64 + 1, ttfts[i], goodput)))
                .collect(),
            knees,
        }
    }

    fn verdict(c: &Comparison, rate: f64, m: Metric) -> Verdict {
        c.changes
            .iter()
            .find(|x| x.rate == rate && x.metric == m)
            .unwrap()
            .verdict
    }

    #[test]
    fn noise_is_not_a_regression_and_a_consistent_slowdown_is() {
        let old = baseline([0.10, 0.20, 0.15], 2.0, vec![Some(4.0); 3]);
        let tol = BTreeMap::new();
        // One seed much worse, the others better: within noise.
        let noisy = baseline([0.18, 0.18, 0.14], 2.0, vec![Some(4.0); 3]);
        let c = compare(&old, &noisy, &tol);
        assert_eq!(verdict(&c, 2.0, Metric::TtftP95), Verdict::WithinNoise);
        assert!(!c.regressed(), "{}", c.markdown());
        // Every seed 50% slower and goodput down 20%: regressed, and the knee falls.
        let slow = baseline(
            [0.15, 0.30, 0.225],
            1.6,
            vec![Some(2.0), Some(2.0), Some(4.0)],
        );
        let c = compare(&old, &slow, &tol);
        assert_eq!(verdict(&c, 4.0, Metric::TtftP95), Verdict::Regressed);
        assert_eq!(verdict(&c, 2.0, Metric::Goodput), Verdict::Regressed);
        assert_eq!(verdict(&c, 2.0, Metric::ItlP95), Verdict::WithinNoise);
        assert_eq!(c.knee_verdict, Verdict::Regressed);
        assert!(c.regressed());
        let md = c.markdown();
        assert!(
            md.contains(
                "| ttft_p95 | 150 ms | 225 ms | +50.0% | +50.0% … +50.0% | 15% | REGRESSED |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| hit_ratio | 0.500 | 0.500 | +0.000 |"),
            "{md}"
        );
        assert!(md.contains("baseline 4/s, new 2/s — REGRESSED"), "{md}");
        // A looser stated tolerance lets it through.
        let loose: BTreeMap<Metric, f64> = Metric::ALL.iter().map(|&m| (m, 0.6)).collect();
        let c = compare(&old, &slow, &loose);
        assert_eq!(verdict(&c, 4.0, Metric::TtftP95), Verdict::WithinNoise);
        // Faster everywhere: improved.
        let fast = baseline([0.05, 0.1, 0.07], 2.0, vec![Some(4.0); 3]);
        assert_eq!(
            verdict(&compare(&old, &fast, &tol), 2.0, Metric::TtftP95),
            Verdict::Improved
        );
    }

    #[test]
    fn a_baseline_round_trips_and_a_foreign_file_is_refused() {
        let b = baseline([0.125, 0.25, 0.5], 1.0, vec![None, Some(2.0), Some(4.0)]);
        let dir = std::env::temp_dir().join(format!("kvgate-baseline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("b.json");
        std::fs::write(&p, serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(Baseline::load(&p).unwrap(), b);
        std::fs::write(&p, r#"{"runs": []}"#).unwrap();
        let e = Baseline::load(&p).unwrap_err().to_string();
        assert!(e.contains("is not a bench baseline"), "{e}");
        assert_eq!(fnv1a(b"a"), "af63dc4c8601ec8c");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
