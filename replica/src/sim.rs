//! The `sim` backend: the real scheduler and block manager run unchanged; only the model's
//! forward pass is replaced by the roofline model's step time, which the engine then really
//! waits. Generated tokens are a deterministic walk through a built-in English corpus, chosen
//! by the request's seed, so outputs decode to readable text and repeat exactly for a seed.
//! Unless the request sets `ignore_eos`, a sequence ends with EOS at a "natural" length drawn
//! from its seed (log-normal, median 160 tokens), as a real model's answers vary in length.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{EngineBackend, StepResult};
use crate::roofline::{Roofline, WorkItem};
use crate::scheduler::ScheduledItem;

/// Text the sim "generates" from, tokenised at start-up with the served tokenizer.
pub const CORPUS: &str = "Prefix caching keeps the attention keys and values of a shared \
prompt in paged blocks, so a second request that starts the same way skips most of its prefill. \
A router that knows which replica holds which prefix can send each conversation back to the \
cache that already knows it, while a load guard keeps any one replica from becoming a hot spot. \
Below the knee of the throughput curve each extra user is nearly free, because the GPU is \
waiting on memory anyway; above it, every extra user slows everyone down. Chunked prefill \
slices a long prompt and interleaves it with the decodes already running, so nobody's stream \
freezes while a large document is read. When more work is admitted than the cache can hold, \
the scheduler preempts sequences and recomputes them later, and throughput falls while latency \
climbs: the answer is to admit less, queue briefly and serve well. Goodput counts only the \
tokens that met their latency promise, and it is the number worth watching on the dashboard. ";

pub struct SimBackend {
    roofline: Roofline,
    corpus: Arc<Vec<u32>>,
    eos_token_id: Option<u32>,
    time_scale: f64,
}

pub use crate::rng::splitmix64;

fn unit(x: u64) -> f64 {
    ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The output length at which the sim's "model" ends its answer for `seed`.
pub fn natural_length(seed: u64) -> usize {
    let a = unit(splitmix64(seed ^ 0x6e61_7475_7261_6c21));
    let b = unit(splitmix64(seed.rotate_left(17) ^ 0x6c65_6e67_7468_2121));
    let normal = (-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos();
    (160.0 * (0.7 * normal).exp()).round().clamp(4.0, 4096.0) as usize
}

impl SimBackend {
    pub fn new(
        roofline: Roofline,
        corpus: Vec<u32>,
        eos_token_id: Option<u32>,
        time_scale: f64,
    ) -> Self {
        assert!(
            !corpus.is_empty(),
            "the sim corpus must tokenise to something"
        );
        SimBackend {
            roofline,
            corpus: Arc::new(corpus),
            eos_token_id,
            time_scale,
        }
    }

    pub fn roofline(&self) -> &Roofline {
        &self.roofline
    }

    fn sample(&self, item: &ScheduledItem) -> u32 {
        if !item.ignore_eos {
            if let Some(eos) = self.eos_token_id {
                if item.output_index + 1 >= natural_length(item.seed) {
                    return eos;
                }
            }
        }
        let start = (splitmix64(item.seed) % self.corpus.len() as u64) as usize;
        self.corpus[(start + item.output_index) % self.corpus.len()]
    }
}

impl EngineBackend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn execute(&mut self, items: &[ScheduledItem]) -> StepResult {
        let work: Vec<WorkItem> = items.iter().map(ScheduledItem::work).collect();
        let cost = self.roofline.step_cost(&work);
        let sampled = items
            .iter()
            .filter(|i| i.samples)
            .map(|i| self.sample(i))
            .collect();
        StepResult {
            sampled,
            wait: Duration::from_secs_f64((cost.seconds * self.time_scale).max(0.0)),
            cost: Some(cost),
            logprobs: Vec::new(),
        }
    }

    fn peak_flops(&self) -> Option<f64> {
        let r = &self.roofline;
        Some(r.gpu.bf16_flops * r.model.tensor_parallel.max(1) as f64 / self.time_scale.max(1e-9))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles::{gpu, ModelProfile};
    use crate::roofline::KvDtype;

    fn backend() -> SimBackend {
        let r = Roofline::new(
            gpu("h100").unwrap(),
            ModelProfile::resolve("qwen3-8b").unwrap(),
            KvDtype::Auto,
        );
        SimBackend::new(r, (10..60).collect(), Some(2), 1.0)
    }

    fn item(seed: u64, output_index: usize, ignore_eos: bool) -> ScheduledItem {
        ScheduledItem {
            seq_id: 1,
            context: 100,
            num_tokens: 1,
            samples: true,
            output_index,
            seed,
            ignore_eos,
            ..Default::default()
        }
    }

    #[test]
    fn tokens_are_deterministic_per_seed_and_step_time_is_modelled() {
        let mut b = backend();
        let items: Vec<_> = (0..5).map(|k| item(7, k, true)).collect();
        let r1 = b.execute(&items);
        let r2 = b.execute(&items);
        assert_eq!(r1.sampled, r2.sampled);
        assert_ne!(b.execute(&[item(8, 0, true)]).sampled[0], 0);
        let expect = b.roofline().decode_cost(5, 100).seconds;
        let got = r1.wait.as_secs_f64();
        assert!((got - expect).abs() < 1e-6, "{got} vs {expect}");
    }

    #[test]
    fn ends_at_the_natural_length_unless_eos_is_ignored() {
        let b = backend();
        let n = natural_length(3);
        assert_eq!(b.sample(&item(3, n - 1, false)), 2);
        assert_ne!(b.sample(&item(3, n - 1, true)), 2);
        assert_ne!(b.sample(&item(3, n - 2, false)), 2);
        let lens: Vec<usize> = (0..2000).map(natural_length).collect();
        let mut sorted = lens.clone();
        sorted.sort_unstable();
        let median = sorted[1000];
        assert!((120..200).contains(&median), "median {median}");
    }
}
