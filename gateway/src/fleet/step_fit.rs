//! How a replica's decode step grows with the context its running streams attend to.
//!
//! A decode step reads the weights once and every running sequence's KV cache: on a
//! memory-bound GPU its time is close to `a + b × (context tokens of the running batch)`, and
//! the context, not the request count, is what sets it — forty streams on a 3,000-token system
//! prompt step about half again as slowly as forty on a 1,000-token one (an L4 running Qwen3-8B:
//! ~145 ms against ~100 ms). Prefix caching does not change that: a shared prefix is stored
//! once but read once per sequence.
//!
//! [`StepFit`] learns `b` (seconds per context token) from the gaps the gateway relays, each
//! paired with the prompt tokens of its own requests in flight at that replica when it was
//! seen: a least-squares line over the recent gaps, forgetting old ones. Placement predicts the
//! step a new stream would see as the replica's current median step moved along that line by
//! the context that arrived since (requests dispatched that its gaps do not show yet) and by the
//! request's own prompt (`fleet/replica.rs`, `SpeedView::step_with`). It holds no I/O.

/// A decayed least-squares fit of inter-token gap (s) against context in flight (tokens).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepFit {
    w: f64,
    c: f64,
    g: f64,
    cc: f64,
    cg: f64,
    /// The context the replica's current median step was seen at: it follows the context at
    /// each step end as quickly as that median follows the steps (tens of step ends).
    anchor: Option<f64>,
}

impl StepFit {
    /// Each gap's weight falls by this per later gap: the fit covers the last few thousand
    /// gaps (seconds of a busy replica's streams).
    const DECAY: f64 = 1.0 - 1.0 / 4096.0;
    /// Fewer (weighted) gaps than this say nothing yet.
    const MIN_WEIGHT: f64 = 200.0;
    /// The context must have varied by at least this much (standard deviation, tokens) over
    /// the gaps for a slope to mean anything.
    const MIN_SPREAD_TOKENS: f64 = 1024.0;
    /// How fast the anchor follows the gaps' context (an EWMA weight).
    const ANCHOR_ALPHA: f64 = 0.05;

    /// One gap of `gap_s`, seen while `context` prompt tokens of the gateway's requests were in
    /// flight at the replica: every stream's gap counts for the slope.
    pub fn add(&mut self, context: u64, gap_s: f64) {
        if !gap_s.is_finite() || gap_s < 0.0 {
            return;
        }
        let c = context as f64;
        let d = Self::DECAY;
        self.w = self.w * d + 1.0;
        self.c = self.c * d + c;
        self.g = self.g * d + gap_s;
        self.cc = self.cc * d + c * c;
        self.cg = self.cg * d + c * gap_s;
    }

    /// A step end the current median step learnt from, seen while `context` prompt tokens were
    /// in flight: the anchor follows it. Called once per step end, as the median learns —
    /// not once per stream: with forty streams the anchor reached a burst's new context within
    /// a step while the median took tens of steps to follow, so the step a new stream would
    /// see was priced at the old context's (a hot prefix's holder took 141 requests in 6 s,
    /// its streams' p95 gap 265 ms against a 150 ms promise; BENCHMARKS, issue 28).
    pub fn follow(&mut self, context: u64) {
        let c = context as f64;
        self.anchor = Some(match self.anchor {
            None => c,
            Some(a) => a + Self::ANCHOR_ALPHA * (c - a),
        });
    }

    /// Seconds of decode step per token of context in flight, once the gaps show it (never
    /// negative: a replica does not step faster for holding more).
    pub fn seconds_per_token(&self) -> Option<f64> {
        if self.w < Self::MIN_WEIGHT {
            return None;
        }
        let (mc, mg) = (self.c / self.w, self.g / self.w);
        let var = self.cc / self.w - mc * mc;
        if var < Self::MIN_SPREAD_TOKENS * Self::MIN_SPREAD_TOKENS {
            return None;
        }
        let cov = self.cg / self.w - mc * mg;
        Some((cov / var).max(0.0))
    }

    /// The context the current median step belongs to (`None` before any gap).
    pub fn anchor_tokens(&self) -> Option<f64> {
        self.anchor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_the_slope_of_a_memory_bound_step() {
        // 60 ms of weights plus 0.5 µs per context token, with a prefill stall every 10th gap.
        let mut f = StepFit::default();
        for i in 0..5000u64 {
            let ctx = (i * 37) % 120_000;
            let stall = if i % 10 == 0 { 0.05 } else { 0.0 };
            f.add(ctx, 0.060 + 0.5e-6 * ctx as f64 + stall);
        }
        let b = f
            .seconds_per_token()
            .expect("enough gaps over a wide context");
        assert!((b - 0.5e-6).abs() < 0.05e-6, "slope {b}");
    }

    #[test]
    fn says_nothing_before_the_context_has_varied() {
        let mut f = StepFit::default();
        for _ in 0..1000 {
            f.add(30_000, 0.1);
            f.follow(30_000);
        }
        assert_eq!(f.seconds_per_token(), None);
        assert_eq!(f.anchor_tokens(), Some(30_000.0));
        let mut few = StepFit::default();
        for i in 0..50u64 {
            few.add(i * 1000, 0.1);
        }
        assert_eq!(few.seconds_per_token(), None, "too few gaps");
    }

    #[test]
    fn never_learns_a_negative_slope() {
        let mut f = StepFit::default();
        for i in 0..2000u64 {
            let ctx = (i * 91) % 50_000;
            f.add(ctx, 0.2 - 1e-6 * ctx as f64);
        }
        assert_eq!(f.seconds_per_token(), Some(0.0));
    }
}
