//! One open-loop run: the workload's items sent at the Poisson schedule's offsets (never waiting
//! for earlier answers), warm-up samples dropped from the report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::arrival::poisson_schedule;
use crate::client::{send, Sample};
use crate::stats::Summary;
use crate::workload::{generate, Kind};

#[derive(Debug, Clone)]
pub struct RunSpec {
    pub base_url: String,
    pub model: String,
    pub workload: Kind,
    pub rate: f64,
    pub duration: Duration,
    pub max_requests: usize,
    pub warmup: Duration,
    pub seed: u64,
    pub request_timeout: Duration,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub target: String,
    pub rate: f64,
    pub sent: usize,
    pub measured: usize,
    pub ok: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_s: Option<Summary>,
    pub inter_token_s: Option<Summary>,
    pub e2e_s: Option<Summary>,
    /// Cached prompt tokens / prompt tokens over measured requests.
    pub prefix_hit_ratio: f64,
    /// Requests per `x-kvgate-replica` value.
    pub per_replica: std::collections::BTreeMap<String, usize>,
    pub samples: Vec<Sample>,
}

pub async fn run(spec: &RunSpec) -> Report {
    let schedule = poisson_schedule(spec.rate, spec.duration, spec.max_requests, spec.seed);
    let items = generate(spec.workload, schedule.len(), spec.seed);
    let client = reqwest::Client::new();
    let start = Instant::now();
    let spec_arc = Arc::new(spec.clone());
    let mut tasks = Vec::with_capacity(items.len());
    for (at, item) in schedule.iter().copied().zip(items) {
        tokio::time::sleep_until((start + at).into()).await;
        let client = client.clone();
        let spec = spec_arc.clone();
        tasks.push(tokio::spawn(async move {
            send(
                &client,
                &spec.base_url,
                &spec.model,
                &item,
                at.as_secs_f64(),
                spec.request_timeout,
            )
            .await
        }));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(s) = t.await {
            samples.push(s);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    summarise(spec, samples, elapsed)
}

fn summarise(spec: &RunSpec, samples: Vec<Sample>, elapsed: f64) -> Report {
    let warm = spec.warmup.as_secs_f64();
    let measured: Vec<&Sample> = samples.iter().filter(|s| s.scheduled_s >= warm).collect();
    let ok: Vec<&&Sample> = measured.iter().filter(|s| s.ok()).collect();
    let window = (elapsed - warm).max(1e-9);
    let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_s).collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|s| s.inter_token_s.iter().copied())
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_s).collect();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let out_tokens: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    let mut per_replica = std::collections::BTreeMap::new();
    for s in &ok {
        *per_replica
            .entry(s.replica.clone().unwrap_or_else(|| "unknown".into()))
            .or_insert(0) += 1;
    }
    Report {
        target: spec.base_url.clone(),
        rate: spec.rate,
        sent: samples.len(),
        measured: measured.len(),
        ok: ok.len(),
        duration_s: elapsed,
        requests_per_s: ok.len() as f64 / window,
        output_tokens_per_s: out_tokens as f64 / window,
        ttft_s: Summary::of(&ttft),
        inter_token_s: Summary::of(&itl),
        e2e_s: Summary::of(&e2e),
        prefix_hit_ratio: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        per_replica,
        samples,
    }
}

impl Report {
    /// The terminal table.
    pub fn table(&self) -> String {
        let ms = |s: &Option<Summary>, f: fn(&Summary) -> f64| {
            s.as_ref()
                .map_or("-".to_string(), |x| format!("{:.1}", f(x) * 1e3))
        };
        let mut out = format!(
            "target {}  rate {:.2}/s  sent {}  measured {}  ok {}  req/s {:.2}  out tok/s {:.0}  prefix hit {:.1}%\n",
            self.target,
            self.rate,
            self.sent,
            self.measured,
            self.ok,
            self.requests_per_s,
            self.output_tokens_per_s,
            self.prefix_hit_ratio * 100.0
        );
        out.push_str("timer (ms)        p50      p95      p99\n");
        for (name, s) in [
            ("ttft", &self.ttft_s),
            ("inter-token", &self.inter_token_s),
            ("e2e", &self.e2e_s),
        ] {
            out.push_str(&format!(
                "{:<14} {:>8} {:>8} {:>8}\n",
                name,
                ms(s, |x| x.p50),
                ms(s, |x| x.p95),
                ms(s, |x| x.p99)
            ));
        }
        out.push_str(&format!("per replica: {:?}\n", self.per_replica));
        out
    }
}
