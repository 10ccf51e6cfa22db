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
    /// The rest of the step the replica was running when it was sent (s, `StepPhase`), the
    /// step after it included when it was predicted to miss the next: not the fit's to learn.
    pub step_wait_s: f64,
    /// Where the running step's start was known: how much of it was left when the request
    /// was sent (s), before any missed step. The replica's lag learns from it.
    pub step_left_s: Option<f64>,
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
    ///
    /// Where the running step's rest was known, the request either joined the next step or
    /// missed it and came a decode step later: the phase's lag learns which, and the fit
    /// learns the TTFT less the wait it actually had.
    pub fn observe_ttft(&mut self, p: Prefill, ttft: Duration) {
        if ttft > Duration::ZERO {
            let mut wait = p.step_wait_s;
            if let Some(left) = p.step_left_s.filter(|_| p.step_s > 0.0) {
                let own = self
                    .ttft
                    .coefficients()
                    .predict(p.ahead, p.tokens, p.cached)
                    .max(p.step_s);
                let missed = ttft.as_secs_f64() - left - own > p.step_s / 2.0;
                self.phase.learn_lag(left, p.step_s, missed);
                wait = if missed { left + p.step_s } else { left };
            }
            let s = (ttft.as_secs_f64() - wait).max(0.0);
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

    /// How much of the running step must be left for a request sent now to join the next
    /// (s, learnt: [`StepPhase::lag`]).
    pub fn step_lag(&self) -> f64 {
        self.phase.lag()
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
    /// such steps (BENCHMARKS, issue 28). The context that median belongs to (the step line's
    /// anchor) follows at the same pace; the per-batch statistics and the line's slope count
    /// every gap.
    pub fn observe_gap_at(&mut self, at: Instant, batch: u32, context: u64, gap: Duration) {
        let g = gap.as_secs_f64();
        self.learn_batch_gap(batch, g);
        let same_step = Duration::from_secs_f64(self.current.q.unwrap_or(0.0) * SAME_STEP_SHARE)
            .max(SAME_STEP_MIN);
        if self.step_sampled.is_none_or(|t| at > t + same_step) {
            self.learn_step(g);
            self.step.follow(context);
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

/// The prefill a whole (unstreamed) answer of `total` teaches the TTFT fit, `decode` of it
/// predicted for its other tokens (`request/relay.rs`): none for a background answer (a batch
/// line: prefilled after interactive work, in short chunks, its decode on steps the fit cannot
/// price), nor where the decode is over a quarter of the time. A few batch lines in 4,500 a run
/// passed the quarter test (3.3 s taught for 171 uncached tokens), and the replica looked too
/// slow to take anything for ~20 s, then took a herd (BENCHMARKS, issue 33).
pub fn taught_prefill(total: Duration, decode: Duration, background: bool) -> Option<Duration> {
    if background {
        return None;
    }
    total.checked_sub(decode).filter(|&p| p >= total * 3 / 4)
}

#[cfg(test)]
pub(crate) mod tests;
