//! Compare mode: the same workload at the same rates against several targets in one
//! invocation. Targets are interleaved — each rate runs every target before the next rate, in an
//! order rotated per rate — so machine drift spreads over all of them instead of favouring the
//! first. Before every run each `flush` URL gets `POST /flush_cache`, so every target starts
//! from a cold cache. One report: a JSON document, a Markdown table, and plots.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::run::{ms, run, Report, RunSpec};

#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub url: String,
}

impl Target {
    /// `NAME=URL`, or a bare URL named after itself. The URL may be `host:port` (http is
    /// assumed) and may end in `/v1` (what OpenAI clients take as their base URL): requests go
    /// to `URL/v1/...` either way.
    pub fn parse(s: &str) -> Self {
        let (name, url) = match s.split_once('=') {
            Some((n, u)) if !n.contains("://") => (n.to_string(), u),
            _ => (s.to_string(), s),
        };
        Target {
            name,
            url: normalise_url(url),
        }
    }
}

/// `host:port` → `http://host:port`; a trailing `/` or `/v1` is dropped.
fn normalise_url(u: &str) -> String {
    let mut url = if u.contains("://") {
        u.to_string()
    } else {
        format!("http://{u}")
    };
    loop {
        let trimmed = url.trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        if trimmed.len() == url.len() {
            return url;
        }
        url = trimmed.to_string();
    }
}

/// One `GET /v1/models` per target before anything runs, so a wrong URL fails in a second with
/// its address instead of as a run of errors.
pub async fn preflight(targets: &[Target]) -> Result<(), String> {
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    for t in targets {
        let url = format!("{}/v1/models", t.url);
        match client.get(&url).send().await {
            Ok(r) if r.status().is_success() || r.status() == 401 => {}
            Ok(r) => {
                return Err(format!(
                    "target {} ({url}) answered {}; is it an OpenAI-compatible server?",
                    t.name,
                    r.status()
                ))
            }
            Err(e) => return Err(format!("target {} ({url}) cannot be reached: {e}", t.name)),
        }
    }
    Ok(())
}

pub struct CompareSpec {
    pub targets: Vec<Target>,
    pub rates: Vec<f64>,
    /// Base URLs that get `POST /flush_cache` before every run.
    pub flush: Vec<String>,
    /// Everything else of a run (its URL, label and rate are replaced per run).
    pub base: RunSpec,
}

#[derive(Debug, Clone, Serialize)]
pub struct Knee {
    pub target: String,
    /// The highest rate at which the target served at least 90% of what was offered within
    /// the SLO (without an SLO: served 90% with p95 TTFT under twice its lowest-rate value).
    pub rate: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OracleAtRate {
    pub rate: f64,
    pub hit_ratio: f64,
    /// The TTFT floor of this rate's traffic (see [`crate::oracle::ttft_floor`]), when the
    /// replicas' speed is known: no router's run can have a lower percentile.
    pub ttft_floor_s: Option<crate::stats::Summary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub workload: String,
    pub model: String,
    pub seed: u64,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub slo: crate::run::Slo,
    pub rates: Vec<f64>,
    pub targets: Vec<String>,
    /// Runs in the order they ran (samples left out; see `ttft_samples_s`).
    pub runs: Vec<Report>,
    pub knees: Vec<Knee>,
    /// The ceiling: hit ratio with unlimited cache and perfect placement, per rate.
    pub oracle: Vec<OracleAtRate>,
    /// Per run (same order as `runs`), the measured TTFTs, for CDFs.
    #[serde(skip)]
    pub ttft_samples_s: Vec<Vec<f64>>,
    /// Per run (same order as `runs`), one line per measured request, for tail analysis
    /// (`samples.jsonl`).
    #[serde(skip)]
    pub request_lines: Vec<Vec<RequestLine>>,
    pub flush_errors: Vec<String>,
}

/// One measured request of a run, as `samples.jsonl` writes it: enough to see where a run's
/// tail and its missed promises come from (which replica, how cached, how slow its stream).
#[derive(Debug, Clone, Serialize)]
pub struct RequestLine {
    pub target: String,
    pub rate: f64,
    pub scheduled_s: f64,
    pub status: u16,
    pub replica: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    pub ttft_ms: Option<f64>,
    /// This request's own inter-token gaps: median, 95th percentile (what the SLO judges) and
    /// largest.
    pub itl_p50_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub itl_max_ms: Option<f64>,
    pub e2e_ms: f64,
    /// Met the run's SLO.
    pub good: bool,
}

impl RequestLine {
    fn of(r: &Report, x: &crate::client::Sample, slo: &crate::run::Slo) -> Self {
        let mut gaps = x.inter_token_s.clone();
        gaps.sort_by(f64::total_cmp);
        let pct = |p: f64| crate::stats::percentile(&gaps, p).map(|v| v * 1e3);
        RequestLine {
            target: r.target.clone(),
            rate: r.rate,
            scheduled_s: x.scheduled_s,
            status: x.status,
            replica: x.replica.clone(),
            prompt_tokens: x.prompt_tokens,
            cached_tokens: x.cached_tokens,
            completion_tokens: x.completion_tokens,
            ttft_ms: x.ttft_s.map(|t| t * 1e3),
            itl_p50_ms: pct(50.0),
            itl_p95_ms: pct(95.0),
            itl_max_ms: gaps.last().map(|v| v * 1e3),
            e2e_ms: x.e2e_s * 1e3,
            good: x.ok() && crate::run::is_good(slo, x),
        }
    }
}

/// `POST /flush_cache` at each replica; the replicas' fleet token (`KVGATE_FLEET_TOKEN`) is
/// sent when set, since the endpoint is internal.
async fn flush(client: &reqwest::Client, urls: &[String]) -> Vec<String> {
    let mut errors = Vec::new();
    let token = std::env::var("KVGATE_FLEET_TOKEN").ok();
    for u in urls {
        let url = format!("{}/flush_cache", u.trim_end_matches('/'));
        let mut req = client.post(&url).timeout(Duration::from_secs(10));
        if let Some(t) = &token {
            req = req.bearer_auth(t.trim());
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => errors.push(format!("{url}: {}", r.status())),
            Err(e) => errors.push(format!("{url}: {e}")),
        }
    }
    errors
}

/// A replica's `GET /server_info` (what it runs, and for a sim replica how fast), so a bench
/// can price the idle replica behind its TTFT floor.
pub async fn server_info(url: &str) -> Result<serde_json::Value, String> {
    let url = format!("{}/server_info", url.trim_end_matches('/'));
    let r = reqwest::Client::new()
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !r.status().is_success() {
        return Err(format!("{url}: {}", r.status()));
    }
    r.json().await.map_err(|e| format!("{url}: {e}"))
}

/// Runs every (rate, target) pair, interleaved.
pub async fn compare(
    spec: &CompareSpec,
    oracle: impl Fn(f64) -> Option<OracleAtRate>,
    mut on_run: impl FnMut(&Report),
) -> CompareReport {
    let client = reqwest::Client::new();
    let mut runs = Vec::new();
    let mut ttfts = Vec::new();
    let mut lines = Vec::new();
    let mut flush_errors = Vec::new();
    let mut oracles = Vec::new();
    let n = spec.targets.len();
    for (ri, &rate) in spec.rates.iter().enumerate() {
        oracles.extend(oracle(rate));
        for k in 0..n {
            let t = &spec.targets[(ri + k) % n];
            flush_errors.extend(flush(&client, &spec.flush).await);
            let mut s = spec.base.clone();
            s.base_url = t.url.clone();
            s.label = t.name.clone();
            s.rate = rate;
            let mut r = run(&s).await;
            on_run(&r);
            let warm = s.warmup.as_secs_f64();
            ttfts.push(
                r.samples
                    .iter()
                    .filter(|x| x.scheduled_s >= warm && x.ok())
                    .filter_map(|x| x.ttft_s)
                    .collect(),
            );
            lines.push(
                r.samples
                    .iter()
                    .filter(|x| x.scheduled_s >= warm)
                    .map(|x| RequestLine::of(&r, x, &spec.base.slo))
                    .collect(),
            );
            r.samples.clear();
            runs.push(r);
        }
    }
    let targets: Vec<String> = spec.targets.iter().map(|t| t.name.clone()).collect();
    let knees = targets
        .iter()
        .map(|t| Knee {
            target: t.clone(),
            rate: knee(runs.iter().filter(|r| &r.target == t), &spec.base.slo),
        })
        .collect();
    CompareReport {
        workload: spec.base.workload.name().to_string(),
        model: spec.base.model.clone(),
        seed: spec.base.seed,
        duration_s: spec.base.duration.as_secs_f64(),
        warmup_s: spec.base.warmup.as_secs_f64(),
        slo: spec.base.slo,
        rates: spec.rates.clone(),
        targets,
        runs,
        knees,
        oracle: oracles,
        ttft_samples_s: ttfts,
        request_lines: lines,
        flush_errors,
    }
}

/// See [`Knee::rate`].
pub fn knee<'a>(runs: impl Iterator<Item = &'a Report>, slo: &crate::run::Slo) -> Option<f64> {
    let mut rs: Vec<&Report> = runs.collect();
    rs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let base_p95 = rs.first()?.ttft_s.as_ref().map(|s| s.p95)?;
    let has_slo = slo.ttft.is_some() || slo.itl.is_some();
    rs.iter()
        .filter(|r| {
            if has_slo {
                r.goodput_requests_per_s >= 0.9 * r.offered_per_s
            } else {
                r.requests_per_s >= 0.9 * r.offered_per_s
                    && r.ttft_s.as_ref().is_some_and(|s| s.p95 <= 2.0 * base_p95)
            }
        })
        .map(|r| r.rate)
        .next_back()
}

impl CompareReport {
    /// The Markdown report: one table per rate, targets as rows.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "# kvgate bench compare: {} workload, model {}, seed {}\n\n\
             {} s per run after {} s warm-up (discarded); SLO: TTFT {} / inter-token {} (p95 per request).\n\n",
            self.workload,
            self.model,
            self.seed,
            self.duration_s,
            self.warmup_s,
            self.slo.ttft_s().map_or("none".into(), |t| format!("{:.0} ms", t * 1e3)),
            self.slo.itl_s().map_or("none".into(), |t| format!("{:.0} ms", t * 1e3)),
        );
        let oracle: BTreeMap<String, &OracleAtRate> = self
            .oracle
            .iter()
            .map(|o| (format!("{:.3}", o.rate), o))
            .collect();
        for &rate in &self.rates {
            out.push_str(&format!("## {rate:.2} requests/s"));
            if let Some(o) = oracle.get(&format!("{rate:.3}")) {
                out.push_str(&format!(
                    " (oracle prefix hit ratio {:.1}%",
                    o.hit_ratio * 100.0
                ));
                if let Some(f) = &o.ttft_floor_s {
                    out.push_str(&format!(
                        "; TTFT floor p50 / p95 / p99 {:.0} / {:.0} / {:.0} ms",
                        f.p50 * 1e3,
                        f.p95 * 1e3,
                        f.p99 * 1e3
                    ));
                }
                out.push(')');
            }
            out.push_str("\n\n| target | ok | shed | err | offered/s | req/s | goodput req/s | TTFT p50 / p95 / p99 ms | short-prompt TTFT p99 ms | ITL p50 / p95 / p99 ms | e2e p95 ms | out tok/s | prefix hit | replica spread (max/min) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
            for r in self.runs.iter().filter(|r| r.rate == rate) {
                let counts: Vec<usize> = r.per_replica.values().copied().collect();
                let spread = match (counts.iter().max(), counts.iter().min()) {
                    (Some(&a), Some(&b)) if b > 0 => format!("{:.2}", a as f64 / b as f64),
                    _ => "-".into(),
                };
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} / {} / {} | {} | {} / {} / {} | {} | {:.0} | {:.1}% | {} ({} replicas) |\n",
                    r.target,
                    r.ok,
                    r.shed,
                    r.errors,
                    r.offered_per_s,
                    r.requests_per_s,
                    r.goodput_requests_per_s,
                    ms(&r.ttft_s, |x| x.p50),
                    ms(&r.ttft_s, |x| x.p95),
                    ms(&r.ttft_s, |x| x.p99),
                    ms(&r.ttft_short_s, |x| x.p99),
                    ms(&r.inter_token_s, |x| x.p50),
                    ms(&r.inter_token_s, |x| x.p95),
                    ms(&r.inter_token_s, |x| x.p99),
                    ms(&r.e2e_s, |x| x.p95),
                    r.output_tokens_per_s,
                    r.prefix_hit_ratio * 100.0,
                    spread,
                    counts.len(),
                ));
            }
            out.push('\n');
        }
        out.push_str("## Knee (highest rate at which ≥ 90% of offered requests met the SLO)\n\n| target | knee rate |\n|---|---|\n");
        let top = self.rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for k in &self.knees {
            let label = match k.rate {
                None => "below the lowest rate".to_string(),
                // Every rate met the SLO: the knee lies beyond the sweep.
                Some(r) if r >= top => format!("not reached (≥ {r:.2}/s, the top rate)"),
                Some(r) => format!("{r:.2}/s"),
            };
            out.push_str(&format!("| {} | {} |\n", k.target, label));
        }
        if !self.flush_errors.is_empty() {
            out.push_str(&format!(
                "\nFlush errors (runs may not have started cold): {:?}\n",
                self.flush_errors
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_and_without_names() {
        let t = Target::parse("rr=http://127.0.0.1:1/");
        assert_eq!(
            (t.name.as_str(), t.url.as_str()),
            ("rr", "http://127.0.0.1:1")
        );
        let t = Target::parse("http://h:2?a=b");
        assert_eq!(t.name, "http://h:2?a=b");
        // host:port and an OpenAI base URL ending in /v1 mean the same server.
        assert_eq!(Target::parse("127.0.0.1:8080").url, "http://127.0.0.1:8080");
        assert_eq!(
            Target::parse("gw=localhost:8080/v1/").url,
            "http://localhost:8080"
        );
        assert_eq!(Target::parse("https://h/v1").url, "https://h");
    }
}
