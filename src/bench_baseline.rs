//! `kvgate bench --record-baseline` and `--baseline`: the runbook's "on every model or engine
//! upgrade, re-run the same benchmark at the same request rate" as a command with a verdict
//! ([`loadtest::regression`]).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use loadtest::regression::{self, Baseline, BenchSpec, Metric};
use loadtest::run::{RunSpec, Slo};

use crate::bench::{rates_of, workload_of, BenchArgs};

/// The spec a new baseline records, from the command line.
fn spec_from_args(a: &BenchArgs) -> Result<BenchSpec> {
    let rates = rates_of(a);
    let trace_fnv1a = match &a.trace {
        Some(p) => Some(regression::fnv1a(
            &std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?,
        )),
        None => None,
    };
    Ok(BenchSpec {
        workload: if a.trace.is_some() {
            "trace".into()
        } else {
            a.workload.clone()
        },
        trace: a.trace.as_ref().map(|p| p.display().to_string()),
        trace_fnv1a,
        model: a.model.clone(),
        rates,
        seeds: if a.seeds.is_empty() {
            vec![a.seed]
        } else {
            a.seeds.clone()
        },
        duration_s: a.duration,
        warmup_s: a.warmup,
        max_requests: a.max_requests,
        slo_ttft_ms: a.slo_ttft_ms,
        slo_itl_ms: a.slo_itl_ms,
        unstreamed_share: a.unstreamed_share,
        max_tokens: a.max_tokens,
    })
}

fn tolerances(a: &BenchArgs) -> Result<BTreeMap<Metric, f64>> {
    a.tolerances
        .iter()
        .map(|t| {
            let (m, x) = t
                .split_once('=')
                .ok_or_else(|| anyhow!("--tolerance takes METRIC=X, got `{t}`"))?;
            let metric = Metric::parse(m.trim()).ok_or_else(|| {
                let names: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
                anyhow!(
                    "--tolerance: unknown metric `{m}` (one of {})",
                    names.join(", ")
                )
            })?;
            let x: f64 = x
                .trim()
                .parse()
                .ok()
                .filter(|x: &f64| *x >= 0.0 && x.is_finite())
                .ok_or_else(|| anyhow!("--tolerance {t}: X must be a non-negative number"))?;
            Ok((metric, x))
        })
        .collect()
}

pub async fn run(a: &BenchArgs) -> Result<()> {
    let old = a.baseline.as_ref().map(|p| Baseline::load(p)).transpose()?;
    let tolerances = tolerances(a)?;
    let spec = match &old {
        Some(b) => b.spec.clone(),
        None => spec_from_args(a)?,
    };
    if spec.rates.iter().any(|r| !(*r > 0.0 && r.is_finite()))
        || spec.seeds.is_empty()
        || !(spec.duration_s > 0.0 && spec.warmup_s >= 0.0 && spec.warmup_s < spec.duration_s)
    {
        bail!("rates and the duration must be positive, with at least one seed and 0 <= warm-up < duration");
    }
    let trace = spec.trace.as_ref().map(std::path::PathBuf::from);
    if let (Some(p), Some(want)) = (&trace, &spec.trace_fnv1a) {
        let got = regression::fnv1a(
            &std::fs::read(p).with_context(|| format!("cannot read the trace {}", p.display()))?,
        );
        if &got != want {
            bail!(
                "the trace {} changed since the baseline was recorded (FNV-1a {got}, recorded {want}): the runs would not send the same requests",
                p.display()
            );
        }
    }
    let workload = workload_of(&spec.workload, trace.as_deref())?;
    let target = match (a.targets.first(), &old) {
        (Some(t), _) => loadtest::compare::Target::parse(t),
        (None, Some(b)) => loadtest::compare::Target::parse(&b.target_url),
        (None, None) => bail!("--record-baseline needs a --target"),
    };
    if a.targets.len() > 1 {
        bail!("a baseline is recorded or compared against one --target");
    }
    loadtest::compare::preflight(std::slice::from_ref(&target))
        .await
        .map_err(|e| anyhow!(e))?;
    let base = RunSpec {
        base_url: target.url.clone(),
        label: target.name.clone(),
        model: spec.model.clone(),
        workload,
        rate: spec.rates[0],
        duration: Duration::from_secs_f64(spec.duration_s),
        max_requests: spec.max_requests,
        warmup: Duration::from_secs_f64(spec.warmup_s),
        seed: spec.seeds[0],
        request_timeout: Duration::from_secs(600),
        slo: Slo::from_ms(spec.slo_ttft_ms, spec.slo_itl_ms),
        progress: !a.no_progress,
        unstreamed_share: spec.unstreamed_share,
        max_tokens: spec.max_tokens,
    };
    let total = spec.rates.len() * spec.seeds.len();
    let mut done = 0;
    let new = regression::record(&base, &spec, &a.flush, a.note.clone(), |r, seed| {
        done += 1;
        println!(
            "[{done}/{total}] seed {seed} at {:.2}/s: ok {} shed {} errors {}  goodput {:.2}/s  TTFT p95 {} ms",
            r.rate,
            r.ok,
            r.shed,
            r.errors,
            r.goodput_requests_per_s,
            r.ttft_s.as_ref().map_or("-".into(), |s| format!("{:.0}", s.p95 * 1e3)),
        );
    })
    .await;
    if let Some(path) = &a.record_baseline {
        std::fs::write(path, serde_json::to_vec_pretty(&new)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("baseline written to {}", path.display());
    }
    if new.runs.iter().all(|r| r.ok == 0) {
        bail!("no request succeeded in any run");
    }
    let Some(old) = old else {
        return Ok(());
    };
    let cmp = regression::compare(&old, &new, &tolerances);
    println!(
        "\n## {} against the baseline ({} seeds: {:?}; {})\n{}",
        target.name,
        spec.seeds.len(),
        spec.seeds,
        if old.note.is_empty() {
            "no note"
        } else {
            old.note.as_str()
        },
        cmp.markdown()
    );
    if cmp.regressed() {
        let which: Vec<String> = cmp
            .changes
            .iter()
            .filter(|c| c.verdict == regression::Verdict::Regressed)
            .map(|c| format!("{} at {}/s", c.metric.name(), c.rate))
            .chain(
                (cmp.knee_verdict == regression::Verdict::Regressed)
                    .then(|| "the knee".to_string()),
            )
            .collect();
        bail!("regressed against the baseline: {}", which.join(", "));
    }
    println!("verdict: no regression");
    Ok(())
}
