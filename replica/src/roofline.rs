//! The roofline step-time model behind the `sim` backend and `kvgate capacity`.
//!
//! One engine step runs a batch of work items: decodes (one new token each) and prefill chunks
//! (many new tokens). Its cost is the larger of
//! - compute: `2 × layer params × new tokens` (the linear layers), `2 × LM head` per sampled
//!   token, plus attention `4 × layers × heads × head_dim` per (query, key) pair — causal within
//!   a chunk — at `compute_efficiency` of the GPUs' bf16 throughput;
//! - memory: the weights read once per step plus every item's KV cache read (its context) and
//!   written (its new tokens), at `bandwidth_efficiency` of HBM bandwidth.
//!
//! A tensor-parallel replica is modelled as one device with the summed throughput, bandwidth and
//! memory of its GPUs (collective communication is not modelled). Efficiencies default to 0.45
//! (a typical prefill MFU) and 0.9 (a good decode kernel's achieved bandwidth); with them an H100
//! turns compute-bound at batch ≈ 148, the "ridge around 150" of the reference runbook.

use crate::profiles::{GpuProfile, ModelProfile};

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// The model's dtype (bf16: 2 bytes).
    Auto,
    Fp8,
}

impl KvDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "bf16" | "bfloat16" | "fp16" => Some(KvDtype::Auto),
            "fp8" | "fp8_e4m3" | "fp8_e5m2" => Some(KvDtype::Fp8),
            _ => None,
        }
    }
}

pub const DEFAULT_COMPUTE_EFFICIENCY: f64 = 0.45;
pub const DEFAULT_BANDWIDTH_EFFICIENCY: f64 = 0.9;
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// One item of a step: `new_tokens` computed on top of `context` tokens already in the cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkItem {
    pub context: u64,
    pub new_tokens: u64,
    /// Whether this item ends with a sampled token (pays the LM head).
    pub samples: bool,
}

/// What bounds a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Memory,
    Compute,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    pub flops: f64,
    pub bytes: f64,
    pub kv_bytes: f64,
    pub seconds: f64,
    pub bound: Bound,
}

#[derive(Debug, Clone)]
pub struct Roofline {
    pub gpu: GpuProfile,
    pub model: ModelProfile,
    pub kv_dtype: KvDtype,
    pub compute_efficiency: f64,
    pub bandwidth_efficiency: f64,
}

impl Roofline {
    pub fn new(gpu: GpuProfile, model: ModelProfile, kv_dtype: KvDtype) -> Self {
        Roofline {
            gpu,
            model,
            kv_dtype,
            compute_efficiency: DEFAULT_COMPUTE_EFFICIENCY,
            bandwidth_efficiency: DEFAULT_BANDWIDTH_EFFICIENCY,
        }
    }

    fn tp(&self) -> f64 {
        self.model.tensor_parallel.max(1) as f64
    }

    /// Effective FLOP/s of the whole replica.
    pub fn effective_flops(&self) -> f64 {
        self.gpu.bf16_flops * self.compute_efficiency * self.tp()
    }

    /// Effective bytes/s of the whole replica.
    pub fn effective_bandwidth(&self) -> f64 {
        self.gpu.bandwidth * self.bandwidth_efficiency * self.tp()
    }

    pub fn kv_bytes_per_element(&self) -> f64 {
        match self.kv_dtype {
            // Engines keep the cache in bf16 unless told otherwise, whatever the weights are.
            KvDtype::Auto => 2.0,
            KvDtype::Fp8 => 1.0,
        }
    }

    /// KV cache bytes per token: K and V, every layer, every KV head.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * (self.model.num_layers * self.model.num_kv_heads * self.model.head_dim) as f64
            * self.kv_bytes_per_element()
    }

    /// Bytes of weights read by every step (the layers and the LM head; the embedding table is
    /// only gathered from).
    pub fn weight_read_bytes(&self) -> f64 {
        (self.model.layer_params() + self.model.lm_head_params()) * self.model.weight_bytes
    }

    /// Bytes the weights occupy in memory.
    pub fn weight_memory_bytes(&self) -> f64 {
        self.model.total_params() * self.model.weight_bytes
    }

    /// Tokens of KV cache that fit: memory × utilisation − weights.
    pub fn kv_capacity_tokens(&self, gpu_memory_utilization: f64) -> u64 {
        let free =
            self.gpu.memory_bytes * self.tp() * gpu_memory_utilization - self.weight_memory_bytes();
        if free <= 0.0 {
            0
        } else {
            (free / self.kv_bytes_per_token()) as u64
        }
    }

    fn attention_flops_per_pair(&self) -> f64 {
        4.0 * (self.model.num_layers * self.model.num_heads * self.model.head_dim) as f64
    }

    /// The modelled cost of one step over `items`.
    pub fn step_cost(&self, items: &[WorkItem]) -> StepCost {
        let mut new_tokens = 0u64;
        let mut sampled = 0u64;
        let mut pairs = 0f64;
        let mut kv_tokens = 0u64;
        for it in items {
            new_tokens += it.new_tokens;
            sampled += u64::from(it.samples);
            let q = it.new_tokens as f64;
            pairs += q * it.context as f64 + q * (q + 1.0) / 2.0;
            kv_tokens += it.context + it.new_tokens;
        }
        if items.is_empty() {
            return StepCost {
                flops: 0.0,
                bytes: 0.0,
                kv_bytes: 0.0,
                seconds: 0.0,
                bound: Bound::Memory,
            };
        }
        let flops = 2.0 * self.model.layer_params() * new_tokens as f64
            + 2.0 * self.model.lm_head_params() * sampled as f64
            + self.attention_flops_per_pair() * pairs;
        let kv_bytes = kv_tokens as f64 * self.kv_bytes_per_token();
        let bytes = self.weight_read_bytes() + kv_bytes;
        let t_compute = flops / self.effective_flops();
        let t_memory = bytes / self.effective_bandwidth();
        let (seconds, bound) = if t_compute > t_memory {
            (t_compute, Bound::Compute)
        } else {
            (t_memory, Bound::Memory)
        };
        StepCost {
            flops,
            bytes,
            kv_bytes,
            seconds,
            bound,
        }
    }

    /// A pure decode step: `batch` sequences, each with `context` tokens cached.
    pub fn decode_cost(&self, batch: u64, context: u64) -> StepCost {
        let items = vec![
            WorkItem {
                context,
                new_tokens: 1,
                samples: true,
            };
            batch as usize
        ];
        self.step_cost(&items)
    }

    /// Batch at which reading the KV cache costs as much as reading the weights (the memory
    /// knee) for sequences of `context` tokens.
    pub fn memory_knee_batch(&self, context: u64) -> f64 {
        self.weight_read_bytes() / (context as f64 * self.kv_bytes_per_token())
    }

    /// Batch at which decode turns compute-bound on the weights alone (the textbook ridge).
    pub fn compute_ridge_batch(&self) -> f64 {
        let flops_per_seq = 2.0 * (self.model.layer_params() + self.model.lm_head_params());
        (self.weight_read_bytes() / self.effective_bandwidth())
            / (flops_per_seq / self.effective_flops())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles::{gpu, ModelProfile};

    /// A toy model and GPU whose costs are easy to compute by hand.
    fn toy() -> Roofline {
        let model = ModelProfile {
            name: "toy".into(),
            num_layers: 2,
            hidden_size: 4,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            intermediate_size: 8,
            vocab_size: 10,
            tie_word_embeddings: true,
            weight_bytes: 2.0,
            max_position_embeddings: 64,
            tensor_parallel: 1,
        };
        let g = GpuProfile {
            name: "toy",
            memory_bytes: 1e6,
            bandwidth: 1000.0,
            bf16_flops: 1000.0,
        };
        let mut r = Roofline::new(g, model, KvDtype::Auto);
        r.compute_efficiency = 0.5;
        r.bandwidth_efficiency = 0.5;
        r
    }

    #[test]
    fn step_times_match_hand_computed_values() {
        let r = toy();
        // layer params: attn = 4*4 + 2*4*2 + 4*4 = 48, mlp = 3*4*8 = 96 -> 2 layers = 288.
        assert_eq!(r.model.layer_params(), 288.0);
        // kv bytes/token = 2 (K,V) * 2 layers * 1 head * 2 dim * 2 bytes = 16.
        assert_eq!(r.kv_bytes_per_token(), 16.0);
        // Decode of one sequence with 9 cached tokens:
        // flops = 2*288*1 + 2*40*1 + 4*2*2*2*(1*9 + 1) = 576 + 80 + 320 = 976 -> 976/500 = 1.952 s
        // bytes = (288+40)*2 + (9+1)*16 = 656 + 160 = 816 -> 816/500 = 1.632 s
        let c = r.decode_cost(1, 9);
        assert_eq!(c.flops, 976.0);
        assert_eq!(c.bytes, 816.0);
        assert!((c.seconds - 1.952).abs() < 1e-12);
        assert_eq!(c.bound, Bound::Compute);
        // Prefill chunk of 4 tokens after 2 cached, no sample:
        // flops = 2*288*4 + 32*(4*2 + 4*5/2) = 2304 + 576 = 2880 -> 5.76 s
        let p = r.step_cost(&[WorkItem {
            context: 2,
            new_tokens: 4,
            samples: false,
        }]);
        assert_eq!(p.flops, 2880.0);
        assert!((p.seconds - 5.76).abs() < 1e-12);
    }

    #[test]
    fn h100_8b_decode_is_memory_bound_and_grows_with_the_cache() {
        let r = Roofline::new(
            gpu("h100").unwrap(),
            ModelProfile::resolve("llama-3.1-8b").unwrap(),
            KvDtype::Auto,
        );
        let b1 = r.decode_cost(1, 2300);
        // ~15 GB of weights at 0.9 × 3.35 TB/s ≈ 5 ms.
        assert!((b1.seconds * 1e3 - 5.08).abs() < 0.1, "{}", b1.seconds);
        assert_eq!(b1.bound, Bound::Memory);
        let b200 = r.decode_cost(200, 2300);
        assert_eq!(b200.bound, Bound::Memory);
        assert!(b200.seconds > 4.0 * b1.seconds);
        let ridge = r.compute_ridge_batch();
        assert!((140.0..160.0).contains(&ridge), "{ridge}");
    }

    #[test]
    fn fp8_cache_halves_kv_bytes() {
        let m = ModelProfile::resolve("qwen3-8b").unwrap();
        let a = Roofline::new(gpu("h100").unwrap(), m.clone(), KvDtype::Auto);
        let b = Roofline::new(gpu("h100").unwrap(), m, KvDtype::Fp8);
        assert_eq!(a.kv_bytes_per_token(), 147_456.0);
        assert_eq!(b.kv_bytes_per_token() * 2.0, a.kv_bytes_per_token());
        assert!(b.kv_capacity_tokens(0.9) > a.kv_capacity_tokens(0.9) * 19 / 10);
    }
}
