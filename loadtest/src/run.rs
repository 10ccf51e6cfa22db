//! One open-loop run: the workload's items sent at the arrival schedule's offsets (never waiting
//! for earlier answers), bounded by duration and request count, warm-up samples dropped from the
//! report, goodput judged against the SLO given.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::arrival::poisson_schedule;
use crate::client::{send, Sample};
use crate::stats::Summary;
use crate::trace::Trace;
use crate::workload::{generate, Kind, WorkItem};

/// Prompts under this many tokens count as short in `ttft_short_s`.
pub const SHORT_PROMPT_TOKENS: u64 = 8192;

/// What to send.
#[derive(Debug, Clone)]
pub enum Workload {
    Generated(Kind),
    Trace(Arc<Trace>),
    /// A generated workload whose arrivals follow one compressed day
    /// ([`crate::arrival::daily_schedule`]): the run's rate is noon's, the night's is this
    /// share of it.
    Daily(Kind, f64),
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Generated(k) => k.name(),
            Workload::Trace(_) => "trace",
            Workload::Daily(k, _) => k.name(),
        }
    }

    /// Offsets (seconds) and items of a run at `rate`.
    pub fn plan(
        &self,
        rate: f64,
        duration: Duration,
        max: usize,
        seed: u64,
    ) -> (Vec<f64>, Vec<WorkItem>) {
        match self {
            Workload::Generated(Kind::Bursty) => crate::bursty::plan(rate, duration, max, seed),
            Workload::Generated(kind) => {
                let at: Vec<f64> = poisson_schedule(rate, duration, max, seed)
                    .iter()
                    .map(Duration::as_secs_f64)
                    .collect();
                let items = generate(*kind, at.len(), seed);
                (at, items)
            }
            Workload::Daily(kind, low) => {
                let at: Vec<f64> = crate::arrival::daily_schedule(rate, *low, duration, max, seed)
                    .iter()
                    .map(Duration::as_secs_f64)
                    .collect();
                let items = generate(*kind, at.len(), seed);
                (at, items)
            }
            Workload::Trace(t) => {
                let at = t.schedule(rate, duration.as_secs_f64(), max);
                let items = t.items[..at.len()].to_vec();
                (at, items)
            }
        }
    }
}

/// The latency promise and goodput rule, as the gateway judges them (`protocol::slo`).
pub use protocol::slo::Slo;

/// Whether a sample was good: answered, and within the promise by the shared rule.
pub fn is_good(slo: &Slo, s: &Sample) -> bool {
    if !s.ok() {
        return false;
    }
    let gaps: Vec<Duration> = s
        .inter_token_s
        .iter()
        .map(|&g| Duration::from_secs_f64(g.max(0.0)))
        .collect();
    if !s.stream {
        return slo
            .judge_whole(
                Duration::from_secs_f64(s.e2e_s.max(0.0)),
                s.completion_tokens,
            )
            .good();
    }
    slo.judge_stream(s.ttft_s.map(|t| Duration::from_secs_f64(t.max(0.0))), &gaps)
        .good()
}

/// Whether the `index`-th request of a run goes unstreamed, for a share of `share` (a fixed
/// spread over indices, so every target of a comparison gets the same requests unstreamed).
pub fn unstreamed(index: usize, share: f64) -> bool {
    let h = (index as u64 ^ 0x5851_F42D_4C95_7F2D).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 11) as f64 / (1u64 << 53) as f64) < share
}

#[derive(Debug, Clone)]
pub struct RunSpec {
    pub base_url: String,
    /// Name in reports (the URL when not given).
    pub label: String,
    pub model: String,
    pub workload: Workload,
    pub rate: f64,
    pub duration: Duration,
    pub max_requests: usize,
    pub warmup: Duration,
    pub seed: u64,
    pub request_timeout: Duration,
    pub slo: Slo,
    /// Draw a progress line on standard error (only when it is a terminal).
    pub progress: bool,
    /// This share of the requests is sent unstreamed (0: every request streams).
    pub unstreamed_share: f64,
    /// Every answer capped at this many tokens (`None`: the workload's own lengths).
    pub max_tokens: Option<u32>,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub target: String,
    pub url: String,
    pub workload: String,
    pub rate: f64,
    pub sent: usize,
    pub measured: usize,
    pub ok: usize,
    /// Measured requests answered 429 (shed by admission).
    pub shed: usize,
    /// Measured requests that failed otherwise.
    pub errors: usize,
    /// Measured requests sent unstreamed (no TTFT or gaps: judged on end to end).
    pub unstreamed: usize,
    pub duration_s: f64,
    /// Measured requests per second of the measured window (what was offered).
    pub offered_per_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub slo: Slo,
    /// Measured requests that met the SLO.
    pub good: usize,
    pub goodput_requests_per_s: f64,
    pub ttft_s: Option<Summary>,
    /// TTFT of requests whose prompts are under 8,192 tokens: the short ones a long prefill
    /// can stall.
    pub ttft_short_s: Option<Summary>,
    pub inter_token_s: Option<Summary>,
    pub e2e_s: Option<Summary>,
    /// Cached prompt tokens / prompt tokens over measured requests.
    pub prefix_hit_ratio: f64,
    /// Requests per `x-kvgate-replica` value.
    pub per_replica: BTreeMap<String, usize>,
    pub samples: Vec<Sample>,
}

/// Redraws one status line while a run is going.
fn spawn_progress(
    label: String,
    rate: f64,
    planned: usize,
    sent: Arc<AtomicUsize>,
    done: Arc<AtomicUsize>,
    start: Instant,
) -> Option<tokio::task::JoinHandle<()>> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let (s, d) = (sent.load(Ordering::Relaxed), done.load(Ordering::Relaxed));
            let width = 30;
            let filled = (d * width).checked_div(planned).unwrap_or(width);
            let bar: String = (0..width)
                .map(|i| if i < filled { '#' } else { '.' })
                .collect();
            eprint!(
                "\r{label} @ {rate:.2}/s [{bar}] sent {s}/{planned} done {d} {:.0}s ",
                start.elapsed().as_secs_f64()
            );
            let _ = std::io::stderr().flush();
        }
    }))
}

pub async fn run(spec: &RunSpec) -> Report {
    let (schedule, mut items) =
        spec.workload
            .plan(spec.rate, spec.duration, spec.max_requests, spec.seed);
    if let Some(cap) = spec.max_tokens {
        for item in &mut items {
            item.max_tokens = item.max_tokens.min(cap);
        }
    }
    let client = reqwest::Client::new();
    let start = Instant::now();
    let spec_arc = Arc::new(spec.clone());
    let (sent, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let bar = spec
        .progress
        .then(|| {
            spawn_progress(
                spec.label.clone(),
                spec.rate,
                schedule.len(),
                sent.clone(),
                done.clone(),
                start,
            )
        })
        .flatten();
    let mut tasks = Vec::with_capacity(items.len());
    for (i, (at, item)) in schedule.iter().copied().zip(items).enumerate() {
        let stream = !unstreamed(i, spec_arc.unstreamed_share);
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let client = client.clone();
        let spec = spec_arc.clone();
        let done = done.clone();
        sent.fetch_add(1, Ordering::Relaxed);
        tasks.push(tokio::spawn(async move {
            let s = send(
                &client,
                &spec.base_url,
                &spec.model,
                &item,
                at,
                spec.request_timeout,
                stream,
            )
            .await;
            done.fetch_add(1, Ordering::Relaxed);
            s
        }));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(s) = t.await {
            samples.push(s);
        }
    }
    if let Some(b) = bar {
        b.abort();
        eprint!("\r\x1b[2K");
    }
    let elapsed = start.elapsed().as_secs_f64();
    summarise(spec, samples, elapsed)
}

pub fn summarise(spec: &RunSpec, samples: Vec<Sample>, elapsed: f64) -> Report {
    let warm = spec.warmup.as_secs_f64();
    let measured: Vec<&Sample> = samples.iter().filter(|s| s.scheduled_s >= warm).collect();
    let ok: Vec<&&Sample> = measured.iter().filter(|s| s.ok()).collect();
    // Rates are per second of the measured arrival window: at steady state an open-loop
    // target completes what arrives in it (answers still draining afterwards included).
    let window = (spec.duration.as_secs_f64() - warm).max(1e-9);
    let ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft_s).collect();
    let ttft_short: Vec<f64> = ok
        .iter()
        .filter(|s| s.prompt_tokens < SHORT_PROMPT_TOKENS)
        .filter_map(|s| s.ttft_s)
        .collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|s| s.inter_token_s.iter().copied())
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_s).collect();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let out_tokens: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    let good = ok.iter().filter(|s| is_good(&spec.slo, s)).count();
    let shed = measured.iter().filter(|s| s.status == 429).count();
    let mut per_replica = BTreeMap::new();
    for s in &ok {
        *per_replica
            .entry(s.replica.clone().unwrap_or_else(|| "unknown".into()))
            .or_insert(0) += 1;
    }
    Report {
        target: spec.label.clone(),
        url: spec.base_url.clone(),
        workload: spec.workload.name().to_string(),
        rate: spec.rate,
        sent: samples.len(),
        measured: measured.len(),
        ok: ok.len(),
        shed,
        errors: measured.len() - ok.len() - shed,
        unstreamed: measured.iter().filter(|s| !s.stream).count(),
        duration_s: elapsed,
        offered_per_s: measured.len() as f64 / window,
        requests_per_s: ok.len() as f64 / window,
        output_tokens_per_s: out_tokens as f64 / window,
        slo: spec.slo,
        good,
        goodput_requests_per_s: good as f64 / window,
        ttft_s: Summary::of(&ttft),
        ttft_short_s: Summary::of(&ttft_short),
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

pub(crate) fn ms(s: &Option<Summary>, f: fn(&Summary) -> f64) -> String {
    s.as_ref()
        .map_or("-".to_string(), |x| format!("{:.1}", f(x) * 1e3))
}

impl Report {
    /// The terminal table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "target {} ({})  rate {:.2}/s  sent {}  measured {}  ok {}  shed {}  errors {}\n\
             req/s {:.2}  goodput req/s {:.2}  out tok/s {:.0}  prefix hit {:.1}%\n",
            self.target,
            self.url,
            self.rate,
            self.sent,
            self.measured,
            self.ok,
            self.shed,
            self.errors,
            self.requests_per_s,
            self.goodput_requests_per_s,
            self.output_tokens_per_s,
            self.prefix_hit_ratio * 100.0
        );
        if self.unstreamed > 0 {
            out.push_str(&format!(
                "unstreamed {} (in e2e only; ttft and inter-token are the streamed ones')\n",
                self.unstreamed
            ));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ttft: f64, gaps: &[f64], status: u16) -> Sample {
        Sample {
            scheduled_s: 10.0,
            stream: true,
            status,
            error: None,
            ttft_s: Some(ttft),
            inter_token_s: gaps.to_vec(),
            e2e_s: ttft + gaps.iter().sum::<f64>(),
            prompt_tokens: 100,
            completion_tokens: gaps.len() as u64 + 1,
            cached_tokens: 50,
            replica: Some("r0".into()),
        }
    }

    #[test]
    fn the_unstreamed_share_is_a_fixed_spread() {
        let count = |share| (0..10_000).filter(|&i| unstreamed(i, share)).count();
        assert_eq!(count(0.0), 0);
        assert_eq!(count(1.0), 10_000);
        let c = count(0.3);
        assert!((2_800..3_200).contains(&c), "{c}");
        assert_eq!(unstreamed(17, 0.3), unstreamed(17, 0.3));
    }

    #[test]
    fn an_unstreamed_answer_is_judged_whole() {
        let slo = Slo::from_ms(Some(1000), Some(50));
        let mut s = sample(0.0, &[], 200);
        s.stream = false;
        s.ttft_s = None;
        s.completion_tokens = 11;
        s.e2e_s = 1.4; // within 1 s + 10 × 50 ms
        assert!(is_good(&slo, &s));
        s.e2e_s = 1.6;
        assert!(!is_good(&slo, &s));
    }

    #[test]
    fn goodput_judges_ttft_and_the_p95_gap() {
        let slo = Slo::from_ms(Some(1000), Some(50));
        assert!(is_good(&slo, &sample(0.5, &[0.04; 20], 200)));
        assert!(!is_good(&slo, &sample(1.5, &[0.04; 20], 200)));
        let mut gaps = vec![0.04; 18];
        gaps.extend([0.5, 0.5]);
        assert!(!is_good(&slo, &sample(0.5, &gaps, 200)));
        assert!(!is_good(&slo, &sample(0.5, &[0.04], 429)));
        assert!(is_good(&Slo::default(), &sample(100.0, &[9.0], 200)));
    }

    #[test]
    fn report_json_has_the_documented_schema() {
        let spec = RunSpec {
            base_url: "http://x".into(),
            label: "x".into(),
            model: "m".into(),
            workload: Workload::Generated(Kind::Chat),
            rate: 2.0,
            duration: Duration::from_secs(10),
            max_requests: 100,
            warmup: Duration::from_secs(5),
            seed: 1,
            request_timeout: Duration::from_secs(1),
            slo: Slo::from_ms(Some(1000), None),
            progress: false,
            unstreamed_share: 0.0,
            max_tokens: None,
        };
        let mut warm = sample(0.1, &[0.01], 200);
        warm.scheduled_s = 1.0;
        let samples = vec![
            warm,
            sample(0.2, &[0.01, 0.02], 200),
            sample(2.0, &[0.01], 200),
            sample(0.0, &[], 429),
        ];
        let r = summarise(&spec, samples, 15.0);
        let v = serde_json::to_value(&r).unwrap();
        for key in [
            "target",
            "url",
            "workload",
            "rate",
            "sent",
            "measured",
            "ok",
            "shed",
            "errors",
            "offered_per_s",
            "requests_per_s",
            "goodput_requests_per_s",
            "output_tokens_per_s",
            "slo",
            "ttft_s",
            "inter_token_s",
            "e2e_s",
            "prefix_hit_ratio",
            "per_replica",
            "samples",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        assert_eq!(v["sent"], 4);
        assert_eq!(v["measured"], 3);
        assert_eq!(v["ok"], 2);
        assert_eq!(v["shed"], 1);
        assert_eq!(v["good"], 1);
        assert_eq!(v["ttft_s"]["count"], 2);
        assert_eq!(v["prefix_hit_ratio"], 0.5);
        assert_eq!(v["per_replica"]["r0"], 2);
        for p in ["p50", "p95", "p99"] {
            assert!(v["ttft_s"][p].is_number());
        }
    }
}
