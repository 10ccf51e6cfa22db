//! The long-generation quality check the runbook asks for before a cache quantisation is turned
//! on: quantisation error in the KV cache accumulates over a long generation, where a short
//! benchmark never sees it.
//!
//! Three passes over the same weights, each stepping every sequence one token at a time (as
//! decode does, so every token reads all the keys and values before it through the cache):
//! 1. **reference** (f16 cache): greedy generations of `tokens` tokens from each prompt, and
//!    the log-probability of each token of a fixed text given the text before it;
//! 2. **candidate, forced**: the candidate cache fed the reference's generations and the text;
//!    at each position, does its greedy choice agree with the reference's token, and how far
//!    is its log-probability of that token from the reference's;
//! 3. **candidate, free**: its own greedy generations, to say where they first part from the
//!    reference's.
//!
//! Forced agreement is the score (free-running generations diverge for good at the first
//! near-tie, which says little about the cache), with the text's perplexity beside it.

use std::sync::Arc;
use std::time::Instant;

pub use kernels::KvElement;
use kernels::PagedKvCache;

use crate::cpu::ThreadError;
use crate::model::{forward, LlamaWeights, SeqSlice};
use crate::sampling::argmax;

const BLOCK: usize = 16;

/// What to run: prompts to generate from and a text to score (token ids).
#[derive(Debug, Clone)]
pub struct QualityPlan {
    pub prompts: Vec<Vec<u32>>,
    /// Tokens generated (and compared) per prompt.
    pub tokens: usize,
    /// A fixed text; its first token is the context for the second, and so on.
    pub text: Vec<u32>,
    pub threads: usize,
}

/// What one cache did.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheFigures {
    pub element: &'static str,
    pub kv_bytes_per_token: usize,
    /// Tokens per second over the decode steps (every sequence one token per step).
    pub decode_tokens_per_s: f64,
    /// Perplexity of the fixed text.
    pub text_perplexity: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct QualityReport {
    pub reference: CacheFigures,
    pub candidate: CacheFigures,
    /// Positions compared across all prompts.
    pub generated_tokens: usize,
    /// Share of generated positions where the candidate, fed the reference's tokens, picks the
    /// reference's next token.
    pub agreement: f64,
    /// Mean |Δ log p| of the reference's generated tokens, candidate vs reference.
    pub generation_logprob_delta: f64,
    /// Mean |Δ log p| over the text's tokens.
    pub text_logprob_delta: f64,
    /// Per prompt: the first position where the candidate's own greedy generation differs.
    pub first_divergence: Vec<Option<usize>>,
}

impl QualityReport {
    /// Candidate perplexity over reference perplexity, minus one.
    pub fn perplexity_increase(&self) -> f64 {
        self.candidate.text_perplexity / self.reference.text_perplexity - 1.0
    }
}

/// One sequence of a pass: a prompt and, when forced, the tokens fed after it.
struct Plan<'a> {
    prompt: &'a [u32],
    forced: Option<&'a [u32]>,
    steps: usize,
}

/// What a sequence did: per step, the greedy choice, the token fed, and its log-probability.
#[derive(Default)]
struct Outcome {
    greedy: Vec<u32>,
    fed: Vec<u32>,
    logprob: Vec<f64>,
}

struct PassResult {
    outcomes: Vec<Outcome>,
    decode_tokens_per_s: f64,
}

fn log_prob(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    logits[token as usize] as f64 - max - sum.ln()
}

fn run_pass(
    weights: &LlamaWeights,
    elem: KvElement,
    pool: &rayon::ThreadPool,
    plans: &[Plan<'_>],
) -> PassResult {
    let c = &weights.config;
    let per_seq: Vec<usize> = plans
        .iter()
        .map(|p| (p.prompt.len() + p.steps + 1).div_ceil(BLOCK))
        .collect();
    let mut kv = PagedKvCache::with_element(c.attention_shape(BLOCK, per_seq.iter().sum()), elem);
    let mut first = 0u32;
    let tables: Vec<Vec<u32>> = per_seq
        .iter()
        .map(|&n| {
            let t = (first..first + n as u32).collect();
            first += n as u32;
            t
        })
        .collect();
    let prefill: Vec<SeqSlice<'_>> = plans
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqSlice {
            tokens: p.prompt,
            start: 0,
            table: t,
            logits: true,
        })
        .collect();
    let mut logits = pool.install(|| forward(weights, &mut kv, &prefill));
    let mut outcomes: Vec<Outcome> = plans.iter().map(|_| Outcome::default()).collect();
    let steps = plans.iter().map(|p| p.steps).max().unwrap_or(0);
    let (mut decoded, started) = (0usize, Instant::now());
    for step in 0..steps {
        let mut feed = Vec::new();
        // The previous forward's rows are the sequences still running, in order (a sequence
        // on its last step reads its row but is not fed again).
        let mut row = 0;
        for (s, p) in plans.iter().enumerate() {
            if step >= p.steps {
                continue;
            }
            let l = &logits[row];
            row += 1;
            let greedy = argmax(l);
            let fed = p.forced.map_or(greedy, |f| f[step]);
            let o = &mut outcomes[s];
            o.greedy.push(greedy);
            o.fed.push(fed);
            o.logprob.push(log_prob(l, fed));
            if step + 1 < p.steps {
                feed.push((s, [fed]));
            }
        }
        if feed.is_empty() {
            break;
        }
        let slices: Vec<SeqSlice<'_>> = feed
            .iter()
            .map(|(s, tok)| SeqSlice {
                tokens: tok,
                start: plans[*s].prompt.len() + step,
                table: &tables[*s],
                logits: true,
            })
            .collect();
        decoded += slices.len();
        logits = pool.install(|| forward(weights, &mut kv, &slices));
    }
    PassResult {
        outcomes,
        decode_tokens_per_s: decoded as f64 / started.elapsed().as_secs_f64().max(1e-9),
    }
}

fn perplexity(o: &Outcome) -> f64 {
    let n = o.logprob.len().max(1) as f64;
    (-o.logprob.iter().sum::<f64>() / n).exp()
}

fn mean_abs_delta(pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for (a, b) in pairs {
        sum += (a - b).abs();
        n += 1;
    }
    sum / n.max(1) as f64
}

/// Runs the three passes, `candidate` against an f16 reference.
pub fn check(
    weights: &Arc<LlamaWeights>,
    candidate: KvElement,
    plan: &QualityPlan,
) -> Result<QualityReport, ThreadError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(plan.threads.max(1))
        .build()
        .map_err(|e| ThreadError::new(plan.threads, e.to_string()))?;
    let text_plan = |forced| Plan {
        prompt: &plan.text[..1.min(plan.text.len())],
        forced: Some(forced),
        steps: plan.text.len().saturating_sub(1),
    };
    let text_rest = plan.text.get(1..).unwrap_or(&[]);
    let mut reference_plans: Vec<Plan<'_>> = plan
        .prompts
        .iter()
        .map(|p| Plan {
            prompt: p,
            forced: None,
            steps: plan.tokens,
        })
        .collect();
    reference_plans.push(text_plan(text_rest));
    let reference = run_pass(weights, KvElement::F16, &pool, &reference_plans);
    let n = plan.prompts.len();

    let mut forced_plans: Vec<Plan<'_>> = plan
        .prompts
        .iter()
        .zip(&reference.outcomes)
        .map(|(p, o)| Plan {
            prompt: p,
            forced: Some(&o.fed),
            steps: plan.tokens,
        })
        .collect();
    forced_plans.push(text_plan(text_rest));
    let forced = run_pass(weights, candidate, &pool, &forced_plans);
    let free = run_pass(weights, candidate, &pool, &reference_plans[..n]);

    let (mut agree, mut total) = (0usize, 0usize);
    for (r, c) in reference.outcomes[..n].iter().zip(&forced.outcomes[..n]) {
        total += r.fed.len();
        agree += r.fed.iter().zip(&c.greedy).filter(|(a, b)| a == b).count();
    }
    let generation_logprob_delta = mean_abs_delta(
        reference.outcomes[..n]
            .iter()
            .zip(&forced.outcomes[..n])
            .flat_map(|(r, c)| r.logprob.iter().copied().zip(c.logprob.iter().copied())),
    );
    let (rt, ct) = (&reference.outcomes[n], &forced.outcomes[n]);
    let first_divergence = reference.outcomes[..n]
        .iter()
        .zip(&free.outcomes)
        .map(|(r, c)| r.fed.iter().zip(&c.fed).position(|(a, b)| a != b))
        .collect();
    let shape = weights.config.attention_shape(1, 1);
    Ok(QualityReport {
        reference: CacheFigures {
            element: KvElement::F16.name(),
            kv_bytes_per_token: shape.bytes_per_token_as(KvElement::F16),
            decode_tokens_per_s: reference.decode_tokens_per_s,
            text_perplexity: perplexity(rt),
        },
        candidate: CacheFigures {
            element: candidate.name(),
            kv_bytes_per_token: shape.bytes_per_token_as(candidate),
            decode_tokens_per_s: forced.decode_tokens_per_s,
            text_perplexity: perplexity(ct),
        },
        generated_tokens: total,
        agreement: agree as f64 / total.max(1) as f64,
        generation_logprob_delta,
        text_logprob_delta: mean_abs_delta(
            rt.logprob.iter().copied().zip(ct.logprob.iter().copied()),
        ),
        first_divergence,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic;

    fn model() -> Arc<LlamaWeights> {
        let c = synthetic::config(64, 64, 128, 2, 4, 2, 512);
        Arc::new(synthetic::weights(c, kernels::Format::Q8_0, 3))
    }

    fn plan() -> QualityPlan {
        QualityPlan {
            prompts: vec![vec![1, 5, 9, 2], vec![7, 3, 3, 8, 1, 4]],
            tokens: 40,
            text: (0..50).map(|i| (i * 7 + 3) % 60).collect(),
            threads: 2,
        }
    }

    #[test]
    fn the_reference_against_itself_agrees_exactly() {
        let w = model();
        let r = check(&w, KvElement::F16, &plan()).unwrap();
        assert_eq!(r.agreement, 1.0);
        assert_eq!(r.generated_tokens, 80);
        assert_eq!(r.text_logprob_delta, 0.0);
        assert_eq!(r.perplexity_increase(), 0.0);
        assert_eq!(r.first_divergence, vec![None, None]);
    }

    #[test]
    fn the_texts_score_does_not_depend_on_how_long_the_generations_run() {
        let w = model();
        let mut p = plan();
        let a = check(&w, KvElement::F16, &p)
            .unwrap()
            .reference
            .text_perplexity;
        p.tokens = 7;
        let b = check(&w, KvElement::F16, &p)
            .unwrap()
            .reference
            .text_perplexity;
        assert_eq!(a, b);
    }

    #[test]
    fn fp8_is_close_and_an_fp8_cache_that_drops_its_scales_is_far() {
        let w = model();
        let good = check(&w, KvElement::Fp8E4m3, &plan()).unwrap();
        let bad = check(&w, KvElement::Fp8E4m3ScalesDropped, &plan()).unwrap();
        assert!(good.candidate.kv_bytes_per_token < good.reference.kv_bytes_per_token);
        assert!(good.text_logprob_delta > 0.0, "fp8 changes something");
        assert!(
            bad.text_logprob_delta > 2.0 * good.text_logprob_delta,
            "scales dropped {} vs scaled {}",
            bad.text_logprob_delta,
            good.text_logprob_delta
        );
    }
}
