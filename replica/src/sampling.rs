//! Choosing the next token from a model's logits: greedy, or temperature with top-k and top-p,
//! driven by a per-request seed. The random draw for output token `i` depends only on the seed
//! and `i`, so a sequence samples the same tokens whether it runs alone, in a batch, or is
//! preempted and recomputed. Log-probabilities (OpenAI's `logprobs`) are those of the model's
//! distribution before temperature, as vLLM reports them.

use crate::rng::splitmix64;

/// How a request samples (defaults: OpenAI's temperature 1, no top-k, top-p 1).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    pub seed: u64,
    /// Return the sampled token's log-probability and this many alternatives (`None`: no
    /// log-probabilities).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            logprobs: None,
        }
    }
}

/// A sampled token's log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// (token, log-probability), most likely first.
    pub top: Vec<(u32, f32)>,
}

fn unit(x: u64) -> f32 {
    ((x >> 40) as f32 + 0.5) / (1u64 << 24) as f32
}

/// The index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax_norm(logits: &[f32]) -> (f32, f32) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    (max, sum.ln() as f32)
}

/// The uniform draw in [0, 1) that picks output token number `index` of a request (the same
/// for every backend: the `cuda` backend's device sampler receives it from here).
pub fn uniform_draw(p: &SamplingParams, index: usize) -> f32 {
    unit(splitmix64(p.seed ^ splitmix64(index as u64 ^ 0x7361_6d70)))
}

/// Samples output token number `index` of a sequence.
pub fn sample(logits: &[f32], p: &SamplingParams, index: usize) -> (u32, Option<TokenLogprobs>) {
    let token = if p.temperature <= 0.0 || p.top_k == 1 {
        argmax(logits)
    } else {
        draw(logits, p, index)
    };
    let lp = p.logprobs.map(|n| {
        let (max, lse) = log_softmax_norm(logits);
        let lp = |i: usize| logits[i] - max - lse;
        let mut top: Vec<(u32, f32)> = Vec::new();
        if n > 0 {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            let n = n.min(idx.len());
            idx.select_nth_unstable_by(n - 1, |&a, &b| {
                logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
            });
            idx.truncate(n);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            top = idx.into_iter().map(|i| (i as u32, lp(i))).collect();
        }
        TokenLogprobs {
            logprob: lp(token as usize),
            top,
        }
    });
    (token, lp)
}

fn draw(logits: &[f32], p: &SamplingParams, index: usize) -> u32 {
    let inv_t = 1.0 / p.temperature;
    // Candidates, most likely first (ties by token id, so the order is total).
    let mut cand: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, by_logit);
        cand.truncate(p.top_k);
    }
    cand.sort_by(by_logit);
    let max = logits[cand[0] as usize];
    let probs: Vec<f64> = cand
        .iter()
        .map(|&i| (((logits[i as usize] - max) * inv_t) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q / total;
            if cum >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    // The draw walks the kept tokens in id order, as the `cuda` backend's device sampler does,
    // so a seed picks the same token on both (up to float rounding at a boundary).
    let mut kept: Vec<(u32, f64)> = cand[..keep].iter().copied().zip(probs).collect();
    kept.sort_unstable_by_key(|&(id, _)| id);
    let total: f64 = kept.iter().map(|&(_, q)| q).sum();
    let u = uniform_draw(p, index) as f64 * total;
    let mut cum = 0.0;
    for &(id, q) in &kept {
        cum += q;
        if u < cum {
            return id;
        }
    }
    kept[keep - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            seed,
            logprobs: None,
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let l = [0.1, 3.0, 2.9, 3.0];
        assert_eq!(sample(&l, &params(0.0, 1.0, 0, 1), 0).0, 1);
        assert_eq!(sample(&l, &params(1.0, 1.0, 1, 1), 0).0, 1);
    }

    #[test]
    fn sampling_follows_the_distribution_and_repeats_per_seed() {
        let l = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let p = params(1.0, 1.0, 0, 42);
        let draws: Vec<u32> = (0..4000).map(|i| sample(&l, &p, i).0).collect();
        let ones = draws.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert!(!draws.contains(&2));
        let again: Vec<u32> = (0..4000).map(|i| sample(&l, &p, i).0).collect();
        assert_eq!(draws, again);
    }

    #[test]
    fn top_p_and_top_k_cut_the_tail() {
        let l = [2.0f32, 1.0, 0.0, -1.0];
        for i in 0..500 {
            assert!(sample(&l, &params(1.0, 1.0, 2, 7), i).0 < 2);
            // p(0) ≈ 0.64 < 0.7 ≤ p(0) + p(1): the nucleus is tokens 0 and 1.
            assert!(sample(&l, &params(1.0, 0.7, 0, 9), i).0 < 2);
        }
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let mut p = params(0.0, 1.0, 0, 0);
        p.logprobs = Some(2);
        let (t, lp) = sample(&l, &p, 0);
        let lp = lp.unwrap();
        assert_eq!(t, 2);
        let z = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        assert!((lp.logprob - (3.0 - z)).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
