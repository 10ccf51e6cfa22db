//! The `cpu` backend: a real Llama-architecture transformer (see [`crate::model`]) computing
//! each step the scheduler plans, over the block manager's paged KV blocks, on a dedicated pool
//! of threads. The scheduler's item carries what the model needs: the step's token ids, the
//! sequence's block table and its sampling parameters.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kernels::{KvElement, PagedKvCache};

use crate::backend::{EngineBackend, LogitCapture, StepResult};
use crate::model::{forward, LlamaWeights, SeqSlice};
use crate::sampling::sample;
use crate::scheduler::{ScheduledItem, SeqId};

pub struct CpuBackend {
    weights: Arc<LlamaWeights>,
    kv: PagedKvCache,
    pool: rayon::ThreadPool,
    captured: LogitCapture,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("model", &self.weights.source)
            .field("kv", &self.kv)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot start {threads} compute threads: {reason}")]
pub struct ThreadError {
    threads: usize,
    reason: String,
}

impl ThreadError {
    pub(crate) fn new(threads: usize, reason: String) -> Self {
        ThreadError { threads, reason }
    }
}

impl CpuBackend {
    /// A backend over an f16 KV cache of `num_blocks` blocks of `block_size` tokens, computing
    /// on `threads` threads.
    pub fn new(
        weights: Arc<LlamaWeights>,
        block_size: usize,
        num_blocks: usize,
        threads: usize,
    ) -> Result<Self, ThreadError> {
        Self::with_kv_element(weights, block_size, num_blocks, threads, KvElement::F16)
    }

    /// The same over a cache of `elem` values (f16, or FP8 E4M3 with per-token scales).
    pub fn with_kv_element(
        weights: Arc<LlamaWeights>,
        block_size: usize,
        num_blocks: usize,
        threads: usize,
        elem: KvElement,
    ) -> Result<Self, ThreadError> {
        let kv = PagedKvCache::with_element(
            weights.config.attention_shape(block_size, num_blocks),
            elem,
        );
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("kvgate-cpu-{i}"))
            .build()
            .map_err(|e| ThreadError::new(threads, e.to_string()))?;
        Ok(CpuBackend {
            weights,
            kv,
            pool,
            captured: LogitCapture::default(),
        })
    }

    /// KV bytes per token for `weights` stored as `elem` (sizing the cache before building it).
    pub fn kv_bytes_per_token(weights: &LlamaWeights, elem: KvElement) -> usize {
        weights
            .config
            .attention_shape(1, 1)
            .bytes_per_token_as(elem)
    }

    pub fn weights(&self) -> &Arc<LlamaWeights> {
        &self.weights
    }

    /// Keeps each sampled item's logits from now on (detectors compare them).
    pub fn capture_logits(&mut self, on: bool) {
        self.captured.set(on);
    }

    /// The logits captured since the last call, as (sequence, logits) in step order.
    pub fn take_logits(&mut self) -> Vec<(SeqId, Vec<f32>)> {
        self.captured.take()
    }

    /// The paged cache itself (detectors plant faults in it).
    #[doc(hidden)]
    pub fn kv_cache_mut(&mut self) -> &mut PagedKvCache {
        &mut self.kv
    }

    /// Times a prefill of `tokens` tokens written to the first blocks of the cache (free at
    /// start-up, and overwritten before any sequence reads them); returns tokens per second.
    /// Also faults in the weights' pages, so the first request does not pay for it.
    pub fn measure_prefill(&mut self, tokens: usize) -> f64 {
        let bs = self.kv.shape().block_size;
        let tokens = tokens.min(self.kv.shape().num_blocks * bs).max(1);
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|i| (i * 7 + 11) % self.weights.config.vocab_size as u32)
            .collect();
        let table: Vec<u32> = (0..tokens.div_ceil(bs) as u32).collect();
        let slice = SeqSlice {
            tokens: &ids,
            start: 0,
            table: &table,
            logits: true,
        };
        let start = Instant::now();
        let (w, kv) = (&self.weights, &mut self.kv);
        self.pool
            .install(|| forward(w, kv, std::slice::from_ref(&slice)));
        tokens as f64 / start.elapsed().as_secs_f64().max(1e-9)
    }
}

impl EngineBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn computes(&self) -> bool {
        true
    }

    fn execute(&mut self, items: &[ScheduledItem]) -> StepResult {
        let slices: Vec<SeqSlice<'_>> = items
            .iter()
            .map(|i| SeqSlice {
                tokens: &i.tokens,
                start: i.context,
                table: &i.block_table,
                logits: i.samples,
            })
            .collect();
        let (w, kv) = (&self.weights, &mut self.kv);
        let logits = self.pool.install(|| forward(w, kv, &slices));
        let mut result = StepResult {
            wait: Duration::ZERO,
            ..StepResult::default()
        };
        for (item, l) in items.iter().filter(|i| i.samples).zip(logits) {
            let (token, lp) = sample(&l, &item.sampling, item.output_index);
            result.sampled.push(token);
            result.logprobs.push(lp.map(Arc::new));
            self.captured.push(item.seq_id, l);
        }
        result
    }
}
