//! What the gateway learns about one replica's speed, for admission to predict from. A
//! [`LatencyModel`] learns from what the gateway forwards: time to first token as a plane over
//! the prefill in front of it and the request's own attention work (`fleet/ttft_fit.rs`:
//! `overhead + tokens / rate + attention cost`, where tokens are the uncached prompt tokens
//! queued ahead plus the request's own), and the inter-token gap as a function of the running
//! batch — its median (the decode step: the knee) and its p95 (stalls included, reported),
//! learnt per batch bucket and interpolated between buckets. The TTFT fit starts from a prior —
//! the replica's own estimate of its prefill rate when it reports one (`prefill_tokens_per_s`
//! in `/server_info`), a generic one otherwise — held as a light ridge: after a hundred short
//! prompts, the fit still knows what a 6k-token prompt costs instead of extrapolating the short
//! prompts' fixed overhead into a huge per-token cost, and where prompts vary the data rules.
//!
//! Each replica's record (`fleet/replica.rs`) holds one; the relay stage (`request/relay.rs`)
//! feeds it and the admission rule (`routes/admissible.rs`) judges requests by its
//! predictions. It holds no I/O and no clock.

use std::time::{Duration, Instant};

use crate::fleet::gap_stats::{bucket, Gaps, Quantile, RecentGaps, BATCH_BUCKETS};
use crate::fleet::step_fit::StepFit;
use crate::fleet::step_phase::StepPhase;
use crate::fleet::ttft_fit::{attention, TtftCoefficients, TtftFit};

pub use crate::fleet::ttft_fit::{GENERIC_OVERHEAD_S, GENERIC_PREFILL_RATE};

/// The prefill in front of one request's first token at a replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Prefill {
    /// Uncached prompt tokens already queued there when it was sent.
    pub ahead: u64,
    /// Its own uncached prompt tokens.
    pub tokens: u64,
    /// Its prompt tokens before those, cached there (what its own attend to).
    pub cached: u64,
    /// The rest of the step the replica was running when it was sent (s, `StepPhase`): not
    /// the fit's to learn.
    pub step_wait_s: f64,
    /// The decode step it joined (s; 0 on an idle replica). A prefill that fits under it (a
    /// memory-bound step hides the compute of a few hundred tokens) says only that: the fit
    /// does not learn from it.
    pub step_s: f64,
}

/// Gaps ending within this share of a step of each other (never under 3 ms) came from one
/// step end: its streams' tokens are relayed apart by the host's scheduling.
const SAME_STEP_SHARE: f64 = 0.3;
const SAME_STEP_MIN: Duration = Duration::from_millis(3);

/// A first token within this many decode steps of the step it joined came from a step its
/// prefill did not lengthen.
const HIDDEN_UNDER_STEP: f64 = 1.2;

/// What the gateway has learnt about one replica's speed.
#[derive(Debug, Clone, Default)]
pub struct LatencyModel {
    ttft: TtftFit,
    itl_by_batch: [Gaps; BATCH_BUCKETS.len()],
    recent: RecentGaps,
    /// The median of the latest gaps, whatever the batch: the step its streams see now.
    current: Quantile<500>,
    /// The 95th percentile of the latest gaps: the median plus the steps that carried prefill.
    current_p95: Quantile<950>,
    /// The step against the context in flight.
    step: StepFit,
    /// Where the replica is in its running step.
    phase: StepPhase,
    /// The step end the current step statistics last learnt from.
    step_sampled: Option<Instant>,
}

impl LatencyModel {
    /// Sets the prior of the TTFT fit: the replica's own prefill rate (tokens/s) and fixed
    /// overhead (s).
    pub fn set_prior(&mut self, prefill_tokens_per_s: f64, overhead_s: f64) {
        let rate = prefill_tokens_per_s;
        self.ttft.set_prior(
            (rate > 0.0 && rate.is_finite()).then(|| 1.0 / rate),
            (overhead_s >= 0.0 && overhead_s.is_finite()).then_some(overhead_s),
        );
    }

    /// A request with the prefill `p` in front of its first token saw it after `ttft`; the fit
    /// learns it less the rest of the step it was sent into, unless its own step was no longer
    /// than a decode step. A step costs the larger of its memory time (weights and KV read
    /// once) and its compute, so a small prefill on a busy replica takes one decode step
    /// whatever its size, and a line through those and the compute-bound ones fits neither:
    /// prediction is `max(decode step, line)` (`SpeedView::estimate`).
    pub fn observe_ttft(&mut self, p: Prefill, ttft: Duration) {
        if ttft > Duration::ZERO {
            let s = (ttft.as_secs_f64() - p.step_wait_s).max(0.0);
            if p.step_s > 0.0 && s <= HIDDEN_UNDER_STEP * p.step_s {
                return;
            }
            let work = (p.ahead + p.tokens) as f64;
            self.ttft.observe(work, attention(p.tokens, p.cached), s);
        }
    }

    /// A token or an answer came back at `at`: one of the replica's steps ended then.
    pub fn token_relayed(&mut self, at: Instant) {
        self.phase.relayed(at);
    }

    /// Seconds until the replica's running step ends, for a request sent at `now` (`busy`: it
    /// has requests running): the request joins the next step ([`StepPhase::wait`]).
    pub fn step_wait(&self, now: Instant, busy: bool) -> f64 {
        self.phase.wait(now, self.current.q, busy)
    }

    /// A busy replica's running step where its start is known: the last step end seen, and
    /// the median step (how long it runs without prefill).
    pub fn running_step(&self, busy: bool) -> Option<(Instant, f64)> {
        let step = self.current.q.filter(|&s| busy && s > 0.0)?;
        Some((self.phase.last_step_end()?, step))
    }

    /// The rest of a busy replica's running step on average, whatever its phase: half a step.
    pub fn mean_step_wait(&self) -> f64 {
        self.current.q.map_or(0.0, |s| s / 2.0)
    }

    /// TTFT observations so far.
    pub fn ttft_observations(&self) -> u64 {
        self.ttft.observed()
    }

    /// The fixed part of TTFT as learnt (seconds).
    pub fn ttft_overhead(&self) -> f64 {
        self.ttft.coefficients().overhead_s
    }

    /// The TTFT fit as learnt: overhead (s) and seconds per prefill token (the attention term
    /// aside: [`LatencyModel::ttft_plane`]).
    pub fn ttft_coefficients(&self) -> (f64, f64) {
        let c = self.ttft.coefficients();
        (c.overhead_s, c.seconds_per_token)
    }

    /// The whole TTFT fit, attention included.
    pub fn ttft_plane(&self) -> TtftCoefficients {
        self.ttft.coefficients()
    }

    /// An inter-token gap observed while the replica ran `batch` sequences.
    pub fn observe_itl(&mut self, batch: u32, gap: Duration) {
        self.learn_batch_gap(batch, gap.as_secs_f64());
        self.learn_step(gap.as_secs_f64());
    }

    /// The per-batch statistics and the recent-gap window: every gap counts.
    fn learn_batch_gap(&mut self, batch: u32, g: f64) {
        self.itl_by_batch[bucket(batch.max(1))].add(g);
        self.recent.add(g);
    }

    /// The step the replica's streams see now (median and p95).
    fn learn_step(&mut self, g: f64) {
        self.current.add(g);
        self.current_p95.add(g);
    }

    /// An inter-token gap ending at `at`, observed while the replica ran `batch` sequences,
    /// `context` prompt tokens of the gateway's requests in flight there. The step its streams
    /// see now (the median and p95 of [`Self::current_step`]) learns one gap per step end, not
    /// one per stream: every stream of a step reports the same gap, and a long step with forty
    /// streams moved the running median forty times (to 160–290 ms where decode steps were
    /// 65–110 ms), so a request sent just after a prefill-carrying step was priced with two
    /// such steps (BENCHMARKS, issue 28). The per-batch statistics count every gap.
    pub fn observe_gap_at(&mut self, at: Instant, batch: u32, context: u64, gap: Duration) {
        let g = gap.as_secs_f64();
        self.learn_batch_gap(batch, g);
        let same_step = Duration::from_secs_f64(self.current.q.unwrap_or(0.0) * SAME_STEP_SHARE)
            .max(SAME_STEP_MIN);
        if self.step_sampled.is_none_or(|t| at > t + same_step) {
            self.learn_step(g);
            self.step_sampled = Some(at);
        }
        self.step.add(context, g);
    }

    /// The decode step its streams would see with `context` prompt tokens in flight: the
    /// current median step moved along the learnt step-per-context-token line from the context
    /// it was seen at ([`StepFit`]); the current median alone until that line is learnt.
    pub fn step_at(&self, context: u64) -> Option<f64> {
        let now = self.current.q?;
        let moved = match (self.step.seconds_per_token(), self.step.anchor_tokens()) {
            (Some(b), Some(at)) => b * (context as f64 - at),
            _ => 0.0,
        };
        Some((now + moved).max(0.0))
    }

    /// How far the 95th percentile of the latest gaps lies over their median: the steps that
    /// carry prefill chunks, which every stream there sees too (0 before any gap).
    pub fn stall_margin(&self) -> f64 {
        match (self.current_p95.q, self.current.q) {
            (Some(p95), Some(p50)) => (p95 - p50).max(0.0),
            _ => 0.0,
        }
    }

    /// Seconds of decode step per token of context in flight (0 until learnt).
    pub fn step_per_context_token(&self) -> f64 {
        self.step.seconds_per_token().unwrap_or(0.0)
    }

    /// The median inter-token gap of the replica's latest streams, whatever their batch: the
    /// decode step its streams see now (`None` before any gap). It tracks within tens of gaps
    /// and keeps moving while the replica has streams, so a replica placement passes over for
    /// it sees it fall as its batch drains — unlike a batch bucket, which learns only while
    /// the replica runs that batch, and whose first gaps (often a stall) can hold it high.
    pub fn current_step(&self) -> Option<Duration> {
        self.current.q.map(Duration::from_secs_f64)
    }

    /// Share of the replica's recent gaps over `target` (`None` until enough were seen).
    pub fn stall_share(&self, target: Duration) -> Option<f64> {
        self.recent.share_over(target.as_secs_f64())
    }

    /// Prefill tokens per second as learnt (the prior until observations move it).
    pub fn prefill_rate(&self) -> Option<f64> {
        let b = self.ttft.coefficients().seconds_per_token;
        (b > 0.0).then(|| 1.0 / b)
    }

    /// Predicted time to first token behind `ahead` queued tokens with `tokens` of its own
    /// after `cached` cached ones, from the start of the step it joins (add [`Self::step_wait`]
    /// or [`Self::mean_step_wait`] on a busy replica).
    pub fn predict_ttft(&self, ahead: u64, tokens: u64, cached: u64) -> Option<Duration> {
        let t = self.ttft.coefficients().predict(ahead, tokens, cached);
        Some(Duration::from_secs_f64(t))
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// `tokens` uncached behind `ahead`, nothing cached.
    pub(crate) fn p(ahead: u64, tokens: u64) -> Prefill {
        Prefill {
            ahead,
            tokens,
            cached: 0,
            step_wait_s: 0.0,
            step_s: 0.0,
        }
    }

    /// A replica that prefills 10k tokens/s and whose gap grows from 10 ms at batch 1 to 40 ms
    /// at 32 and 80 ms at 64: the knee for a 50 ms promise lies between 32 and 64. Shared with
    /// `admission.rs`'s tests.
    pub(crate) fn learnt() -> LatencyModel {
        let mut m = LatencyModel::default();
        for _ in 0..20 {
            m.observe_ttft(p(0, 200), 20 * MS);
            m.observe_ttft(p(0, 1000), 100 * MS);
            m.observe_ttft(p(3000, 1000), 400 * MS);
            m.observe_itl(1, 10 * MS);
            m.observe_itl(32, 40 * MS);
            m.observe_itl(64, 80 * MS);
        }
        m
    }

    #[test]
    fn what_the_data_shows_beats_the_prior() {
        // The prior says 8k tokens/s; the replica really does 2k.
        let mut m = LatencyModel::default();
        for i in 0..200u64 {
            let n = 100 + (i % 20) * 200;
            m.observe_ttft(p(0, n), Duration::from_secs_f64(0.01 + n as f64 / 2_000.0));
        }
        let rate = m.prefill_rate().unwrap();
        assert!((rate - 2_000.0).abs() < 200.0, "{rate}");
    }

    #[test]
    fn the_fit_learns_from_the_step_a_request_joins_not_the_one_it_waited_for() {
        // 100 ms steps; a 50-token request waits out the running step (sent at any phase),
        // then takes one step of its own. Told the wait, the fit learns the one step and the
        // prediction plus the wait is right at every phase; the fit alone is a step and a half.
        let (mut told, mut blind) = (LatencyModel::default(), LatencyModel::default());
        for i in 0..200u64 {
            let wait = (i * 37 % 100) as f64 / 1000.0;
            let ttft = Duration::from_secs_f64(wait + 0.1);
            told.observe_ttft(
                Prefill {
                    step_wait_s: wait,
                    ..p(0, 50)
                },
                ttft,
            );
            blind.observe_ttft(p(0, 50), ttft);
        }
        let own = told.predict_ttft(0, 50, 0).unwrap().as_secs_f64();
        assert!((own - 0.1).abs() < 0.005, "{own}");
        let mean = blind.predict_ttft(0, 50, 0).unwrap().as_secs_f64();
        assert!((mean - 0.15).abs() < 0.01, "{mean}");
    }

    #[test]
    fn prefills_hidden_under_a_decode_step_do_not_bend_the_line() {
        // A busy replica with 100 ms decode steps that computes 4k prefill tokens/s: a step
        // takes the larger of the two. The line learns from the steps prefill lengthened only.
        let truth = |u: u64| (0.01 + u as f64 / 4_000.0).max(0.1);
        let mut m = LatencyModel::default();
        for i in 0..300u64 {
            let u = 100 + (i * 131) % 1900;
            let pf = Prefill {
                step_s: 0.1,
                ..p(0, u)
            };
            m.observe_ttft(pf, Duration::from_secs_f64(truth(u)));
        }
        for u in [800, 2000] {
            let t = m.predict_ttft(0, u, 0).unwrap().as_secs_f64();
            assert!((t - truth(u)).abs() < 0.03 * truth(u), "{u}: {t}");
        }
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
    fn the_current_step_follows_the_latest_gaps_whatever_the_batch() {
        let mut m = LatencyModel::default();
        assert_eq!(m.current_step(), None);
        // A first stall, then a busy batch's 100 ms steps, then the batch drains to 60 ms.
        m.observe_itl(1, 400 * MS);
        for _ in 0..200 {
            m.observe_itl(64, 100 * MS);
        }
        let busy = m.current_step().unwrap().as_secs_f64();
        assert!((busy - 0.1).abs() < 0.01, "{busy}");
        for _ in 0..200 {
            m.observe_itl(4, 60 * MS);
        }
        let now = m.current_step().unwrap().as_secs_f64();
        assert!((now - 0.06).abs() < 0.01, "{now}");
        // The batch bucket of the first gap still holds the stall.
        assert_eq!(m.predict_itl(1), Some(400 * MS));
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

    #[test]
    fn the_step_ahead_moves_with_the_context_dispatched_since() {
        // 60 ms plus 0.5 µs per context token, seen as the context in flight rose from 0 to
        // 80k tokens: the current step is the last gaps' (~100 ms); 20k more tokens dispatched
        // since add ~10 ms, and as many finished take ~10 ms off.
        let mut m = LatencyModel::default();
        assert_eq!(m.step_at(1000), None);
        let mut t = Instant::now();
        for i in 0..4000u64 {
            let ctx = i * 20;
            let gap = Duration::from_secs_f64(0.060 + 0.5e-6 * ctx as f64);
            t += gap;
            m.observe_gap_at(t, 16, ctx, gap);
        }
        let now = m.current_step().unwrap().as_secs_f64();
        assert!((m.step_per_context_token() - 0.5e-6).abs() < 0.02e-6);
        let ahead = m.step_at(100_000).unwrap();
        assert!((ahead - now - 0.010).abs() < 0.002, "{ahead} vs {now}");
        let drained = m.step_at(60_000).unwrap();
        assert!((now - drained - 0.010).abs() < 0.002, "{drained} vs {now}");
        // Gaps seen without a context (`observe_itl`) move only the current step.
        let mut plain = LatencyModel::default();
        plain.observe_itl(16, 80 * MS);
        assert_eq!(plain.step_at(50_000), Some(0.08));
    }

    #[test]
    fn the_current_step_learns_one_gap_per_step_end_not_one_per_stream() {
        let mut m = LatencyModel::default();
        let mut t = Instant::now();
        // Forty streams, 80 ms decode steps for four seconds: each step end reported forty
        // times, a millisecond apart at most.
        for _ in 0..50 {
            t += 80 * MS;
            for k in 0..40u32 {
                m.observe_gap_at(t + Duration::from_micros(u64::from(k) * 25), 40, 0, 80 * MS);
            }
        }
        let before = m.current_step().unwrap().as_secs_f64();
        assert!((before - 0.08).abs() < 0.005, "{before}");
        // One 300 ms step (a prefill chunk), reported by all forty: the median moves once.
        t += 300 * MS;
        for k in 0..40u32 {
            m.observe_gap_at(
                t + Duration::from_micros(u64::from(k) * 25),
                40,
                0,
                300 * MS,
            );
        }
        let after = m.current_step().unwrap().as_secs_f64();
        assert!(after < 0.09, "one step moved the median to {after}");
    }
}
