//! Goodput-based admission: dispatch a request only while its latency promise can still be
//! kept, queue it briefly otherwise, and shed it early (429 + Retry-After) rather than thrash.
//!
//! Per replica, a [`LatencyModel`] learns from what the gateway forwards: time to first token
//! as an affine function of the prefill in front of it (`overhead + tokens / rate`, where
//! tokens are the uncached prompt tokens queued ahead plus the request's own), and the p95
//! inter-token gap as a function of the running batch — the knee, learnt per batch bucket and
//! interpolated between buckets. The TTFT fit starts from a prior — the replica's own
//! estimate of its prefill rate when it reports one (`prefill_tokens_per_s` in
//! `/server_info`), a generic one otherwise — held as two pseudo-observations, at 0 and at
//! 4,096 tokens: after a hundred short prompts, the fit still knows what a 6k-token prompt
//! costs instead of extrapolating the short prompts' fixed overhead into a huge per-token
//! cost. [`admissible`] asks: would this request's predicted TTFT and the predicted gap with
//! one more sequence both meet the route's SLO, and are the leading indicators (preemptions
//! rising, KV usage above the high-water mark) quiet? An idle replica is always admissible:
//! holding a request back from an idle replica helps nobody.
//!
//! The queue requests wait in, and why they are shed, is `admission_queue.rs`. Time comes
//! from a [`Clock`], so tests control it.
//!
//! `dispatch.rs` wires this controller into the request path; it holds no I/O itself.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Time source: seconds since an arbitrary origin.
pub trait Clock: Send + Sync {
    fn now(&self) -> Duration;
}

pub struct SystemClock(Instant);

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock(Instant::now())
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// A clock that moves only when told to.
#[derive(Default)]
pub struct ManualClock(Mutex<Duration>);

impl ManualClock {
    pub fn advance(&self, d: Duration) {
        *self.0.lock() += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        *self.0.lock()
    }
}

/// The latency promise (the one definition, shared with the load tester).
pub use protocol::slo::Slo;

/// Exponentially weighted moving average; `None` until the first sample.
#[derive(Debug, Clone, Copy, Default)]
struct Ewma(Option<f64>);

impl Ewma {
    const ALPHA: f64 = 0.2;

    fn add(&mut self, x: f64) {
        self.0 = Some(match self.0 {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }
}

/// A running estimate of the `Q`-th quantile (per mille; stochastic approximation): each
/// sample above the estimate moves it up by `q × step`, each below it down by `(1 − q) × step`,
/// so it settles where a share `1 − q` of samples lie above. The step is a fraction of the
/// running mean, so the estimate adapts at the scale of what it tracks.
#[derive(Debug, Clone, Copy, Default)]
struct Quantile<const Q: u32> {
    mean: Ewma,
    q: Option<f64>,
}

impl<const Q: u32> Quantile<Q> {
    const STEP: f64 = 0.1;

    fn add(&mut self, x: f64) {
        let share = f64::from(Q) / 1000.0;
        self.mean.add(x);
        let scale = self.mean.0.unwrap_or(x) * Self::STEP;
        self.q = Some(match self.q {
            None => x,
            Some(q) if x > q => q + share * scale,
            Some(q) if x < q => (q - (1.0 - share) * scale).max(0.0),
            Some(q) => q,
        });
    }
}

/// Inter-token gaps at one batch size. Gaps are bimodal under chunked prefill: decode steps,
/// and the rarer steps that also carry a prefill chunk. The median is the decode step — what
/// grows with the batch, and so the knee admission can move; the p95 includes the stalls, which
/// the chunk budget decides and holding requests back does not fix (see BENCHMARKS: admission
/// that held on the p95 refused work the fleet would have served in time).
#[derive(Debug, Clone, Copy, Default)]
struct Gaps {
    p50: Quantile<500>,
    p95: Quantile<950>,
}

impl Gaps {
    fn add(&mut self, x: f64) {
        self.p50.add(x);
        self.p95.add(x);
    }
}

/// Upper edges of the batch buckets the inter-token gap is learnt in.
const BATCH_BUCKETS: [u32; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

fn bucket(batch: u32) -> usize {
    BATCH_BUCKETS
        .iter()
        .position(|&b| batch <= b)
        .unwrap_or(BATCH_BUCKETS.len() - 1)
}

/// The prefill rate assumed before a replica says or shows its own (tokens/s): an 8B model
/// on one mid-range GPU.
pub const GENERIC_PREFILL_RATE: f64 = 8_000.0;
/// Fixed cost of a request before its prefill (seconds), in the prior.
pub const GENERIC_OVERHEAD_S: f64 = 0.02;

/// `ttft ≈ a + b · tokens`, fitted by weighted least squares: every observation's weight
/// decays by [`TtftFit::FORGET`] per later observation (the replica's speed drifts with its
/// load), and two pseudo-observations of the prior, at 0 and [`TtftFit::PRIOR_SPAN`] tokens,
/// keep the line anchored where no data is.
#[derive(Debug, Clone)]
struct TtftFit {
    sw: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// Prior overhead (s) and cost per token (s).
    a0: f64,
    b0: f64,
    observed: u64,
}

impl Default for TtftFit {
    fn default() -> Self {
        TtftFit {
            sw: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            a0: GENERIC_OVERHEAD_S,
            b0: 1.0 / GENERIC_PREFILL_RATE,
            observed: 0,
        }
    }
}

impl TtftFit {
    const FORGET: f64 = 0.98;
    const PRIOR_SPAN: f64 = 4096.0;
    const PRIOR_WEIGHT: f64 = 0.5;

    fn observe(&mut self, x: f64, y: f64) {
        let f = Self::FORGET;
        self.sw = self.sw * f + 1.0;
        self.sx = self.sx * f + x;
        self.sy = self.sy * f + y;
        self.sxx = self.sxx * f + x * x;
        self.sxy = self.sxy * f + x * y;
        self.observed += 1;
    }

    /// `(a, b)`: overhead in seconds and seconds per token.
    fn coefficients(&self) -> (f64, f64) {
        let w = Self::PRIOR_WEIGHT;
        let (x1, y0, y1) = (
            Self::PRIOR_SPAN,
            self.a0,
            self.a0 + self.b0 * Self::PRIOR_SPAN,
        );
        let sw = self.sw + 2.0 * w;
        let sx = self.sx + w * x1;
        let sy = self.sy + w * (y0 + y1);
        let sxx = self.sxx + w * x1 * x1;
        let sxy = self.sxy + w * x1 * y1;
        let det = sw * sxx - sx * sx;
        if det <= f64::EPSILON {
            return (self.a0, self.b0);
        }
        // Never faster than 20x the prior per token, never negative.
        let b = ((sw * sxy - sx * sy) / det).max(self.b0 / 20.0);
        let a = ((sy - b * sx) / sw).max(0.0);
        (a, b)
    }
}

/// The replica's most recent inter-token gaps, whatever the batch: the share of them over a
/// target is the share of steps that stalled its streams. A step that carries a prefill chunk
/// gives every running stream one long gap, so stalls show as a share of gaps; a request keeps
/// its p95 promise while under 5% of its gaps are stalls.
#[derive(Debug, Clone)]
struct RecentGaps {
    gaps: std::collections::VecDeque<f32>,
}

impl Default for RecentGaps {
    fn default() -> Self {
        RecentGaps {
            gaps: std::collections::VecDeque::with_capacity(Self::WINDOW),
        }
    }
}

impl RecentGaps {
    /// About the last few seconds of a busy replica's streams.
    const WINDOW: usize = 4096;
    /// Fewer gaps than this say nothing yet.
    const MIN: usize = 200;

    fn add(&mut self, gap: f64) {
        if self.gaps.len() == Self::WINDOW {
            self.gaps.pop_front();
        }
        self.gaps.push_back(gap as f32);
    }

    fn share_over(&self, target: f64) -> Option<f64> {
        if self.gaps.len() < Self::MIN {
            return None;
        }
        let over = self.gaps.iter().filter(|&&g| f64::from(g) > target).count();
        Some(over as f64 / self.gaps.len() as f64)
    }
}

/// What the gateway has learnt about one replica's speed.
#[derive(Debug, Clone, Default)]
pub struct LatencyModel {
    ttft: TtftFit,
    itl_by_batch: [Gaps; BATCH_BUCKETS.len()],
    recent: RecentGaps,
}

impl LatencyModel {
    /// Sets the prior of the TTFT fit: the replica's own prefill rate (tokens/s) and fixed
    /// overhead (s).
    pub fn set_prior(&mut self, prefill_tokens_per_s: f64, overhead_s: f64) {
        if prefill_tokens_per_s > 0.0 && prefill_tokens_per_s.is_finite() {
            self.ttft.b0 = 1.0 / prefill_tokens_per_s;
        }
        if overhead_s >= 0.0 && overhead_s.is_finite() {
            self.ttft.a0 = overhead_s;
        }
    }

    /// A request with `tokens` uncached prompt tokens, behind `ahead` tokens of queued prefill,
    /// saw its first token after `ttft`.
    pub fn observe_ttft(&mut self, ahead: u64, tokens: u64, ttft: Duration) {
        let s = ttft.as_secs_f64();
        if s > 0.0 {
            self.ttft.observe((ahead + tokens) as f64, s);
        }
    }

    /// TTFT observations so far.
    pub fn ttft_observations(&self) -> u64 {
        self.ttft.observed
    }

    /// The fixed part of TTFT as learnt (seconds).
    pub fn ttft_overhead(&self) -> f64 {
        self.ttft.coefficients().0
    }

    /// The TTFT fit as learnt: overhead (s) and seconds per prefill token.
    pub fn ttft_coefficients(&self) -> (f64, f64) {
        self.ttft.coefficients()
    }

    /// An inter-token gap observed while the replica ran `batch` sequences.
    pub fn observe_itl(&mut self, batch: u32, gap: Duration) {
        self.itl_by_batch[bucket(batch.max(1))].add(gap.as_secs_f64());
        self.recent.add(gap.as_secs_f64());
    }

    /// Share of the replica's recent gaps over `target` (`None` until enough were seen).
    pub fn stall_share(&self, target: Duration) -> Option<f64> {
        self.recent.share_over(target.as_secs_f64())
    }

    /// Prefill tokens per second as learnt (the prior until observations move it).
    pub fn prefill_rate(&self) -> Option<f64> {
        let (_, b) = self.ttft.coefficients();
        (b > 0.0).then(|| 1.0 / b)
    }

    /// Predicted time to first token behind `ahead` queued tokens with `tokens` of its own.
    pub fn predict_ttft(&self, ahead: u64, tokens: u64) -> Option<Duration> {
        let (a, b) = self.ttft.coefficients();
        Some(Duration::from_secs_f64(a + b * (ahead + tokens) as f64))
    }

    /// The decode step (median gap) at `batch`: interpolated between the learnt buckets around
    /// it, extrapolated along the last learnt slope beyond them. Admission's knee.
    pub fn predict_itl(&self, batch: u32) -> Option<Duration> {
        self.interpolate(batch, |g| g.p50.q)
    }

    /// The p95 gap at `batch`, stalls included (reported, not used to hold).
    pub fn predict_itl_p95(&self, batch: u32) -> Option<Duration> {
        self.interpolate(batch, |g| g.p95.q)
    }

    fn interpolate(&self, batch: u32, pick: impl Fn(&Gaps) -> Option<f64>) -> Option<Duration> {
        let known: Vec<(f64, f64)> = BATCH_BUCKETS
            .iter()
            .zip(&self.itl_by_batch)
            .filter_map(|(&b, e)| pick(e).map(|v| (f64::from(b), v)))
            .collect();
        let x = f64::from(batch.max(1));
        let y = match known.as_slice() {
            [] => return None,
            [(_, v)] => *v,
            _ => {
                let i = known
                    .windows(2)
                    .position(|w| x <= w[1].0)
                    .unwrap_or(known.len() - 2);
                let ((x0, y0), (x1, y1)) = (known[i], known[i + 1]);
                let y = y0 + (y1 - y0) * (x - x0) / (x1 - x0);
                if x < x0 {
                    y0
                } else {
                    y.max(0.0)
                }
            }
        };
        Some(Duration::from_secs_f64(y))
    }
}

/// A replica's state as admission sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaPressure {
    pub running: u32,
    /// Uncached prompt tokens queued ahead of a new request.
    pub queued_prefill_tokens: u64,
    pub kv_usage: f64,
    /// Preemptions rose since the last poll.
    pub preempting: bool,
}

/// Share of a request's gaps that may exceed the inter-token target under a p95 promise.
pub const STALL_BUDGET: f64 = 0.05;

/// Why a request may not go to a replica now.
#[derive(Debug, Clone, PartialEq)]
pub enum Hold {
    Ttft {
        predicted: Duration,
    },
    Itl {
        predicted: Duration,
    },
    /// The replica's streams already stall too often, and this request's prefill would stall
    /// them once more.
    Stalls {
        share: f64,
    },
    KvHighWater {
        usage: f64,
    },
    Preempting,
}

impl std::fmt::Display for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hold::Ttft { predicted } => write!(
                f,
                "predicted TTFT {:.3} s is over the route's target",
                predicted.as_secs_f64()
            ),
            Hold::Itl { predicted } => write!(
                f,
                "predicted decode step {:.1} ms with one more sequence is over the inter-token target",
                predicted.as_secs_f64() * 1e3
            ),
            Hold::Stalls { share } => write!(
                f,
                "{:.1}% of its recent gaps already exceed the inter-token target (budget 5%) and this prefill would stall them again",
                share * 100.0
            ),
            Hold::KvHighWater { usage } => {
                write!(f, "projected KV usage {:.0}% is over the high-water mark", usage * 100.0)
            }
            Hold::Preempting => f.write_str("it preempted sequences within the hold-off"),
        }
    }
}

impl Hold {
    pub fn label(&self) -> &'static str {
        match self {
            Hold::Ttft { .. } => "ttft",
            Hold::Itl { .. } => "itl",
            Hold::Stalls { .. } => "stalls",
            Hold::KvHighWater { .. } => "kv_high_water",
            Hold::Preempting => "preempting",
        }
    }
}

/// Whether a request with `tokens` uncached prompt tokens may be dispatched to a replica now.
pub fn admissible(
    model: &LatencyModel,
    p: &ReplicaPressure,
    tokens: u64,
    slo: &Slo,
    kv_high_water: f64,
) -> Result<(), Hold> {
    // Holding a request back from an idle replica helps nobody: it goes, whatever the
    // prediction (its own size is the only thing in its way).
    if p.running == 0 && p.queued_prefill_tokens == 0 {
        return Ok(());
    }
    if p.preempting {
        return Err(Hold::Preempting);
    }
    // An idle replica takes whatever fits at all; the replica itself refuses what never does.
    if p.running > 0 && p.kv_usage > kv_high_water {
        return Err(Hold::KvHighWater { usage: p.kv_usage });
    }
    if let (Some(target), Some(predicted)) = (
        slo.ttft,
        model.predict_ttft(p.queued_prefill_tokens, tokens),
    ) {
        if predicted > target {
            return Err(Hold::Ttft { predicted });
        }
    }
    if let (Some(target), Some(predicted)) = (slo.itl, model.predict_itl(p.running + 1)) {
        if predicted > target {
            return Err(Hold::Itl { predicted });
        }
    }
    // Stalls: the inter-token promise breaks when more than 5% of a stream's gaps carry a
    // prefill chunk. A request whose own prefill takes longer than the target is one more such
    // stall for every stream there; while the replica is already over budget it waits, and a
    // request that is mostly cached (a stall-free prefill) still goes.
    if let Some(target) = slo.itl {
        let own_prefill = model.predict_ttft(0, tokens).map_or(Duration::ZERO, |t| {
            t.saturating_sub(Duration::from_secs_f64(model.ttft_overhead()))
        });
        if own_prefill > target {
            if let Some(share) = model.stall_share(target) {
                if share > STALL_BUDGET {
                    return Err(Hold::Stalls { share });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn slo() -> Slo {
        Slo {
            ttft: Some(1000 * MS),
            itl: Some(50 * MS),
        }
    }

    /// A replica that prefills 10k tokens/s and whose gap grows from 10 ms at batch 1 to 40 ms
    /// at 32 and 80 ms at 64: the knee for a 50 ms promise lies between 32 and 64.
    fn learnt() -> LatencyModel {
        let mut m = LatencyModel::default();
        for _ in 0..20 {
            m.observe_ttft(0, 200, 20 * MS);
            m.observe_ttft(0, 1000, 100 * MS);
            m.observe_ttft(3000, 1000, 400 * MS);
            m.observe_itl(1, 10 * MS);
            m.observe_itl(32, 40 * MS);
            m.observe_itl(64, 80 * MS);
        }
        m
    }

    #[test]
    fn admits_under_the_slo() {
        let m = learnt();
        let rate = m.prefill_rate().unwrap();
        assert!((rate - 10_000.0).abs() < 500.0, "{rate}");
        let p = ReplicaPressure {
            running: 8,
            queued_prefill_tokens: 2_000,
            kv_usage: 0.5,
            preempting: false,
        };
        assert_eq!(admissible(&m, &p, 3_000, &slo(), 0.9), Ok(()));
        // A model with nothing learnt predicts from its prior (8k tokens/s): a busy replica
        // holds a prompt that would take minutes, an idle one takes anything.
        assert_eq!(
            admissible(&LatencyModel::default(), &p, 1_000_000, &slo(), 0.9)
                .unwrap_err()
                .label(),
            "ttft"
        );
        assert_eq!(
            admissible(
                &LatencyModel::default(),
                &ReplicaPressure::default(),
                1_000_000,
                &slo(),
                0.9
            ),
            Ok(())
        );
    }

    #[test]
    fn a_long_prompt_after_many_short_ones_is_priced_from_the_prior() {
        // A replica that says it prefills 20k tokens/s; 100 short prompts, each mostly fixed
        // overhead (50 tokens in 25 ms: "2,000 tokens/s" if read as a rate).
        let mut m = LatencyModel::default();
        m.set_prior(20_000.0, 0.02);
        for _ in 0..100 {
            m.observe_ttft(0, 50, 25 * MS);
        }
        let six_k = m.predict_ttft(0, 6_000).unwrap();
        assert!(
            six_k > 250 * MS && six_k < 450 * MS,
            "a 6k prompt is ~0.3 s of prefill, not 3 s: {six_k:?}"
        );
        let short = m.predict_ttft(0, 50).unwrap();
        assert!((short.as_secs_f64() - 0.025).abs() < 0.005, "{short:?}");
        // Busy, with 0.4 s of work queued: a 6k prompt still fits a 1 s promise.
        let busy = ReplicaPressure {
            running: 4,
            queued_prefill_tokens: 4_000,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &busy, 6_000, &slo(), 0.9), Ok(()));
    }

    #[test]
    fn a_cache_miss_waits_while_the_replicas_streams_stall_too_often() {
        // Decode steps of 30 ms; one step in twelve carries a 250 ms prefill chunk (8%).
        let mut m = LatencyModel::default();
        m.set_prior(4_000.0, 0.02);
        for i in 0..2000 {
            let gap = if i % 12 == 0 { 250 * MS } else { 30 * MS };
            m.observe_itl(16, gap);
        }
        let busy = ReplicaPressure {
            running: 16,
            ..ReplicaPressure::default()
        };
        let slo = Slo {
            ttft: Some(1000 * MS),
            itl: Some(150 * MS),
        };
        // The decode step (30 ms) is far from the knee, but 8% of gaps stall: a 2,000-token
        // miss (0.5 s of prefill, one more stall) waits; a mostly cached turn (100 tokens,
        // 25 ms) goes.
        match admissible(&m, &busy, 2_000, &slo, 0.9) {
            Err(Hold::Stalls { share }) => assert!((share - 1.0 / 12.0).abs() < 0.01),
            other => panic!("{other:?}"),
        }
        assert_eq!(admissible(&m, &busy, 100, &slo, 0.9), Ok(()));
        // At 3% stalls the same miss goes.
        let mut calm = LatencyModel::default();
        calm.set_prior(4_000.0, 0.02);
        for i in 0..2000 {
            let gap = if i % 33 == 0 { 250 * MS } else { 30 * MS };
            calm.observe_itl(16, gap);
        }
        assert_eq!(admissible(&calm, &busy, 2_000, &slo, 0.9), Ok(()));
    }

    #[test]
    fn what_the_data_shows_beats_the_prior() {
        // The prior says 8k tokens/s; the replica really does 2k.
        let mut m = LatencyModel::default();
        for i in 0..200u64 {
            let n = 100 + (i % 20) * 200;
            m.observe_ttft(0, n, Duration::from_secs_f64(0.01 + n as f64 / 2_000.0));
        }
        let rate = m.prefill_rate().unwrap();
        assert!((rate - 2_000.0).abs() < 200.0, "{rate}");
    }

    #[test]
    fn holds_when_the_replica_is_at_its_predicted_knee() {
        let m = learnt();
        // 40 running: one more sequence is predicted at 40 + (41-32)/32 * 40 = 51.25 ms > 50 ms.
        let at_knee = ReplicaPressure {
            running: 40,
            ..ReplicaPressure::default()
        };
        match admissible(&m, &at_knee, 100, &slo(), 0.9) {
            Err(Hold::Itl { predicted }) => {
                assert!((predicted.as_secs_f64() - 0.05125).abs() < 1e-6)
            }
            other => panic!("{other:?}"),
        }
        let below = ReplicaPressure {
            running: 30,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &below, 100, &slo(), 0.9), Ok(()));
        // Too much prefill queued ahead breaks the TTFT promise instead: (8k + 3k) / 10k = 1.1 s.
        let backed_up = ReplicaPressure {
            queued_prefill_tokens: 8_000,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &backed_up, 3_000, &slo(), 0.9)
                .unwrap_err()
                .label(),
            "ttft"
        );
    }

    #[test]
    fn leading_indicators_cut_admission_off() {
        let m = learnt();
        let preempting = ReplicaPressure {
            running: 1,
            preempting: true,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &preempting, 10, &slo(), 0.9),
            Err(Hold::Preempting)
        );
        let full = ReplicaPressure {
            running: 4,
            kv_usage: 0.95,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &full, 10, &slo(), 0.9),
            Err(Hold::KvHighWater { usage: 0.95 })
        );
        // An idle replica takes a prompt that fills most of its cache.
        let idle = ReplicaPressure {
            kv_usage: 0.95,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &idle, 10, &slo(), 0.9), Ok(()));
    }

    #[test]
    fn the_knee_follows_decode_steps_and_the_p95_sees_stalls() {
        // Decode steps of 80 ms, and one step in ten also carries a 600 ms prefill chunk: the
        // mean is 132 ms, the decode step (median) 80 ms, the p95 a stall.
        let mut m = LatencyModel::default();
        for i in 0..4000 {
            let gap = if i % 10 == 0 { 600 * MS } else { 80 * MS };
            m.observe_itl(16, gap);
        }
        let p95 = m.predict_itl_p95(16).unwrap().as_secs_f64();
        assert!(p95 > 0.3, "{p95}");
        let step = m.predict_itl(16).unwrap().as_secs_f64();
        assert!((step - 0.08).abs() < 0.01, "{step}");
        // One stall in a hundred stays under the p95.
        let mut m = LatencyModel::default();
        for i in 0..4000 {
            let gap = if i % 100 == 0 { 600 * MS } else { 80 * MS };
            m.observe_itl(16, gap);
        }
        let p = m.predict_itl_p95(16).unwrap().as_secs_f64();
        assert!(p < 0.12, "{p}");
    }

    #[test]
    fn itl_prediction_interpolates_and_extrapolates() {
        let m = learnt();
        assert_eq!(m.predict_itl(1), Some(10 * MS));
        let mid = m.predict_itl(48).unwrap().as_secs_f64();
        assert!((mid - 0.060).abs() < 1e-9, "{mid}");
        let far = m.predict_itl(128).unwrap().as_secs_f64();
        assert!((far - 0.160).abs() < 1e-9, "{far}");
        assert_eq!(LatencyModel::default().predict_itl(4), None);
    }
}
