//! The time-to-first-token fit of one replica:
//! `ttft ≈ a + b · work + d · attention`, where `work` is the prefill in front of the first
//! token (uncached prompt tokens queued ahead plus the request's own) and `attention` the
//! request's own attention work in tokens² over [`ATTENTION_UNIT`]: each of its `u`
//! uncached tokens attends to the `c` cached ones and to the half of its own before it,
//! `u · (c + u / 2)`. Without that term a mostly-cached long conversation was priced like a
//! short prompt: in front of a CPU vLLM, 355 new tokens after 2,848 cached took 0.82 s and 63
//! after 128 took 0.10 s, where the line through tokens alone predicted 0.41 s and 0.36 s
//! (BENCHMARKS, issue 29). Small models and long contexts make the term large; it is learnt,
//! so where attention is cheap it stays near zero.
//!
//! Weighted least squares: every observation's weight decays by [`TtftFit::FORGET`] per later
//! one (the replica's speed drifts with its load), and a ridge towards the prior (its overhead
//! and rate, no attention cost) keeps the plane anchored where the data does not vary and the
//! attention term at zero until observations show it. Pure arithmetic: no I/O, no clock.

use policies::ATTENTION_UNIT;

/// The prefill rate assumed before a replica says or shows its own (tokens/s): an 8B model
/// on one mid-range GPU.
pub const GENERIC_PREFILL_RATE: f64 = 8_000.0;
/// Fixed cost of a request before its prefill (seconds), in the prior.
pub const GENERIC_OVERHEAD_S: f64 = 0.02;

/// The fitted plane: seconds of overhead, per token of work, per unit of attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftCoefficients {
    pub overhead_s: f64,
    pub seconds_per_token: f64,
    /// Seconds per unit of [`attention`].
    pub seconds_per_attention: f64,
}

impl TtftCoefficients {
    /// Predicted TTFT behind `ahead` queued tokens, with `tokens` uncached after `cached`.
    pub fn predict(&self, ahead: u64, tokens: u64, cached: u64) -> f64 {
        self.overhead_s
            + self.seconds_per_token * (ahead + tokens) as f64
            + self.seconds_per_attention * attention(tokens, cached)
    }
}

/// A request's own attention work: `tokens` uncached after `cached`, in tokens² over
/// [`ATTENTION_UNIT`] (so its scale is that of a token count), as placement prices it.
pub fn attention(tokens: u64, cached: u64) -> f64 {
    let u = tokens as f64;
    u * (cached as f64 + u / 2.0) / ATTENTION_UNIT
}

#[derive(Debug, Clone)]
pub struct TtftFit {
    /// Decayed sums of the normal equations over (1, work, attention) and the TTFT.
    s: [[f64; 3]; 3],
    sy: [f64; 3],
    /// Prior overhead (s) and cost per token (s), and how much the prior is trusted.
    a0: f64,
    b0: f64,
    prior_weight: f64,
    observed: u64,
}

impl Default for TtftFit {
    fn default() -> Self {
        TtftFit {
            s: [[0.0; 3]; 3],
            sy: [0.0; 3],
            a0: GENERIC_OVERHEAD_S,
            b0: 1.0 / GENERIC_PREFILL_RATE,
            prior_weight: Self::GENERIC_PRIOR_WEIGHT,
            observed: 0,
        }
    }
}

impl TtftFit {
    const FORGET: f64 = 0.98;
    pub const PRIOR_SPAN: f64 = 4096.0;
    /// The ridge's weight for a prior the replica measured itself (`/server_info`'s
    /// `prefill_tokens_per_s`): half an observation at [`TtftFit::PRIOR_SPAN`] tokens.
    const MEASURED_PRIOR_WEIGHT: f64 = 0.5;
    /// For the generic prior, a guess: small. In front of a CPU vLLM (which reports no rate)
    /// the generic 8k tokens/s was 6× off, and at the measured weight it bent the line through
    /// prompts of a few hundred tokens into a 0.35 s overhead (measured 0.1 s).
    const GENERIC_PRIOR_WEIGHT: f64 = 0.002;

    /// One request: `work` tokens of prefill to its first token (queued ahead plus its own
    /// uncached), its own `attention` ([`attention`]), first token after `ttft_s`.
    pub fn observe(&mut self, work: f64, attention: f64, ttft_s: f64) {
        let f = Self::FORGET;
        let x = [1.0, work, attention];
        for i in 0..3 {
            for j in 0..3 {
                self.s[i][j] = self.s[i][j] * f + x[i] * x[j];
            }
            self.sy[i] = self.sy[i] * f + x[i] * ttft_s;
        }
        self.observed += 1;
    }

    /// The replica's own measure of itself: its prefill rate and fixed overhead (either may be
    /// `None`), trusted more than the generic guess.
    pub fn set_prior(&mut self, seconds_per_token: Option<f64>, overhead_s: Option<f64>) {
        if let Some(b) = seconds_per_token {
            self.b0 = b;
            self.prior_weight = Self::MEASURED_PRIOR_WEIGHT;
        }
        if let Some(a) = overhead_s {
            self.a0 = a;
        }
    }

    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// The plane as learnt. Never faster than 20× the prior per token, never a negative
    /// overhead or attention cost: a fit that wants negative attention falls back to the line
    /// without it.
    pub fn coefficients(&self) -> TtftCoefficients {
        // The prior as a ridge: (a, b, d) pulled towards (a0, b0, 0) with the weight of a
        // share of an observation at PRIOR_SPAN tokens in each direction — decisive where the
        // data does not vary (a hundred 50-token prompts still price a 6k one by the prior's
        // rate), little where it does.
        let (mut s, mut sy) = (self.s, self.sy);
        let w = self.prior_weight;
        let span2 = Self::PRIOR_SPAN * Self::PRIOR_SPAN;
        let prior = [self.a0, self.b0, 0.0];
        for (k, lambda) in [w, w * span2, w * span2].into_iter().enumerate() {
            s[k][k] += lambda;
            sy[k] += lambda * prior[k];
        }
        let floor = self.b0 / 20.0;
        let plane = solve3(s, sy).filter(|p| p[2] >= 0.0);
        let [a, b, d] = plane.unwrap_or_else(|| {
            // The line through work alone (attention folded into the per-token cost).
            let det = s[0][0] * s[1][1] - s[0][1] * s[1][0];
            let b = (s[0][0] * sy[1] - s[1][0] * sy[0]) / det;
            [(sy[0] - s[0][1] * b) / s[0][0], b, 0.0]
        });
        TtftCoefficients {
            overhead_s: a.max(0.0),
            seconds_per_token: b.max(floor),
            seconds_per_attention: d,
        }
    }
}

/// Solves `m · p = v` (Cramer's rule); `None` when `m` is (nearly) singular.
fn solve3(m: [[f64; 3]; 3], v: [f64; 3]) -> Option<[f64; 3]> {
    let det = |m: &[[f64; 3]; 3]| {
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    };
    let d = det(&m);
    let scale = m.iter().flatten().fold(0.0f64, |a, x| a.max(x.abs()));
    if !d.is_finite() || d.abs() <= 1e-12 * scale.powi(3) {
        return None;
    }
    let mut out = [0.0; 3];
    for (k, o) in out.iter_mut().enumerate() {
        let mut mk = m;
        for i in 0..3 {
            mk[i][k] = v[i];
        }
        *o = det(&mk) / d;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-9)
    }

    #[test]
    fn without_data_the_prior_and_no_attention() {
        let f = TtftFit::default();
        let c = f.coefficients();
        assert!(close(c.overhead_s, GENERIC_OVERHEAD_S, 1e-6), "{c:?}");
        assert!(close(c.seconds_per_token, 1.0 / GENERIC_PREFILL_RATE, 1e-6));
        assert!(c.seconds_per_attention.abs() < 1e-12, "{c:?}");
    }

    #[test]
    fn learns_the_attention_a_long_cached_context_adds() {
        // 40 ms + 0.7 ms per token + 0.35 µs per token² of own attention (the CPU vLLM of the
        // benchmark), on a mix of short and long, cold and mostly cached prompts.
        let truth = |u: u64, c: u64| {
            0.04 + 0.0007 * u as f64 + 3.5e-7 * u as f64 * (c as f64 + u as f64 / 2.0)
        };
        let mut f = TtftFit::default();
        for i in 0..300u64 {
            let (u, c) = (50 + (i * 37) % 900, (i * 911) % 3000);
            f.observe(u as f64, attention(u, c), truth(u, c));
        }
        let k = f.coefficients();
        for (u, c) in [(63, 128), (355, 2848), (1005, 0), (833, 2272)] {
            let p = k.predict(0, u, c);
            assert!(
                close(p, truth(u, c), 0.05),
                "u={u} c={c}: {p} vs {}",
                truth(u, c)
            );
        }
    }

    #[test]
    fn where_attention_costs_nothing_the_term_stays_near_zero() {
        // The 2k tokens/s replica of latency_model's test: TTFT linear in tokens, whatever is
        // cached.
        let mut f = TtftFit::default();
        for i in 0..200u64 {
            let (u, c) = (100 + (i % 20) * 200, (i * 733) % 4000);
            f.observe(u as f64, attention(u, c), 0.01 + u as f64 / 2_000.0);
        }
        let k = f.coefficients();
        assert!(close(1.0 / k.seconds_per_token, 2_000.0, 0.05), "{k:?}");
        assert!(
            k.seconds_per_attention * attention(1000, 4000) < 0.01,
            "{k:?}"
        );
    }

    #[test]
    fn a_fit_that_wants_negative_attention_falls_back_to_the_line() {
        // Long cached contexts answered *faster*: no physical attention term explains it.
        let mut f = TtftFit::default();
        for i in 0..100u64 {
            let (u, c) = (200 + (i % 5) * 100, (i % 2) * 3000);
            let t = 0.02 + u as f64 / 4_000.0 - if c > 0 { 0.05 } else { 0.0 };
            f.observe(u as f64, attention(u, c), t);
        }
        let k = f.coefficients();
        assert_eq!(k.seconds_per_attention, 0.0);
        assert!(k.seconds_per_token > 0.0 && k.overhead_s >= 0.0, "{k:?}");
    }
}
