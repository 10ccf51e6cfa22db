//! Streaming statistics of a replica's inter-token gaps, for the latency model
//! (`fleet/latency_model.rs`): an EWMA, running quantile estimates, the median and p95 per
//! batch bucket, and the share of recent gaps over a target. No I/O, no clock.

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
pub(crate) struct Quantile<const Q: u32> {
    mean: Ewma,
    pub(crate) q: Option<f64>,
}

impl<const Q: u32> Quantile<Q> {
    const STEP: f64 = 0.1;

    pub(crate) fn add(&mut self, x: f64) {
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
pub(crate) struct Gaps {
    pub(crate) p50: Quantile<500>,
    pub(crate) p95: Quantile<950>,
}

impl Gaps {
    pub(crate) fn add(&mut self, x: f64) {
        self.p50.add(x);
        self.p95.add(x);
    }
}

/// Upper edges of the batch buckets the inter-token gap is learnt in.
pub(crate) const BATCH_BUCKETS: [u32; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

pub(crate) fn bucket(batch: u32) -> usize {
    BATCH_BUCKETS
        .iter()
        .position(|&b| batch <= b)
        .unwrap_or(BATCH_BUCKETS.len() - 1)
}

/// The replica's most recent inter-token gaps, whatever the batch: the share of them over a
/// target is the share of steps that stalled its streams. A step that carries a prefill chunk
/// gives every running stream one long gap, so stalls show as a share of gaps; a request keeps
/// its p95 promise while under 5% of its gaps are stalls.
#[derive(Debug, Clone)]
pub(crate) struct RecentGaps {
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

    pub(crate) fn add(&mut self, gap: f64) {
        if self.gaps.len() == Self::WINDOW {
            self.gaps.pop_front();
        }
        self.gaps.push_back(gap as f32);
    }

    pub(crate) fn share_over(&self, target: f64) -> Option<f64> {
        if self.gaps.len() < Self::MIN {
            return None;
        }
        let over = self.gaps.iter().filter(|&&g| f64::from(g) > target).count();
        Some(over as f64 / self.gaps.len() as f64)
    }
}
