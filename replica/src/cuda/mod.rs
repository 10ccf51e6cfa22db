//! The `cuda` backend (feature `cuda`): the `cpu` backend's model and paged KV layout on an
//! NVIDIA GPU, through the kernels crate's device runtime. Weights are widened to f16 at load,
//! GEMMs run in cuBLAS (f16 inputs, f32 accumulation), the residual stream stays f32 and the
//! KV cache is f16 in the block manager's blocks. Greedy and top-p sampling run on the device;
//! a request that asks for top-k or log-probabilities has its row of logits copied back and
//! sampled by the CPU sampler.
//!
//! A device error in a step cannot be answered per request (the context is usually unusable
//! after one), so the step panics with the driver's message and the engine stops.

pub mod forward;
pub mod weights;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kernels::gpu::{Gpu, GpuError};
use kernels::SeqSlice;

use crate::backend::{EngineBackend, LogitCapture, StepResult};
use crate::model::LlamaWeights;
use crate::sampling::{sample, uniform_draw, SamplingParams};
use crate::scheduler::{ScheduledItem, SeqId};
use forward::{DeviceKvCache, Scratch};
use weights::DeviceWeights;

pub use kernels::gpu::probe;

pub struct CudaBackend {
    gpu: Gpu,
    weights: DeviceWeights,
    kv: DeviceKvCache,
    scratch: Scratch,
    sampled: cudarc::driver::CudaSlice<u32>,
    greedy: cudarc::driver::CudaSlice<u32>,
    params: cudarc::driver::CudaSlice<f32>,
    captured: LogitCapture,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("gpu", &self.gpu)
            .field("kv", &self.kv.shape)
            .finish_non_exhaustive()
    }
}

/// How the KV cache is sized.
#[derive(Debug, Clone, Copy)]
pub enum KvBlocks {
    /// Exactly this many blocks.
    Count(usize),
    /// What is left of this fraction of the device's memory once weights and activations are
    /// in place (vLLM's `--gpu-memory-utilization`).
    MemoryFraction(f64),
}

/// Where the backend's memory went.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMemory {
    pub weights: usize,
    pub kv_cache: usize,
    pub total: usize,
}

impl CudaBackend {
    /// Opens GPU `ordinal`, uploads `weights`, sizes the KV cache and the activations for steps
    /// of up to `max_tokens` tokens and `max_seqs` sequences.
    pub fn new(
        ordinal: usize,
        weights: &LlamaWeights,
        block_size: usize,
        blocks: KvBlocks,
        max_tokens: usize,
        max_seqs: usize,
    ) -> Result<Self, GpuError> {
        let c = &weights.config;
        if c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) {
            return Err(GpuError::Unsupported(format!(
                "{} query heads over {} key/value heads",
                c.heads, c.kv_heads
            )));
        }
        kernels::plan::tile_tokens(c.heads / c.kv_heads)
            .map_err(|e| GpuError::Unsupported(e.to_string()))?;
        if !c.head_dim.is_multiple_of(32) || c.head_dim > kernels::cuda_program::ATT_MAX_HD {
            return Err(GpuError::Unsupported(format!(
                "head dimension {}: the cuda backend takes multiples of 32 up to {}",
                c.head_dim,
                kernels::cuda_program::ATT_MAX_HD
            )));
        }
        let gpu = Gpu::new(ordinal)?;
        let dev = DeviceWeights::upload(&gpu, weights)?;
        let scratch = Scratch::new(&gpu, &dev, max_tokens, max_seqs)?;
        let per_block = 2 * 2 * c.layers * c.kv_heads * c.head_dim * block_size;
        let num_blocks = match blocks {
            KvBlocks::Count(n) => n,
            KvBlocks::MemoryFraction(f) => {
                gpu.sync()?;
                let (free, total) = gpu.memory()?;
                let used = total - free;
                // What is allocated later stays out of the cache: cuBLAS's workspace, buffers
                // that grow with a step (block tables, split-attention partials).
                let reserve = (total / 32).max(1 << 30);
                let budget = ((total as f64 * f) as usize).min(total.saturating_sub(reserve));
                budget.saturating_sub(used) / per_block
            }
        };
        if num_blocks == 0 {
            return Err(GpuError::Unsupported(format!(
                "no room for a single KV block of {per_block} bytes on {}",
                gpu.name()
            )));
        }
        let kv = DeviceKvCache::new(&gpu, c.attention_shape(block_size, num_blocks))?;
        let rows = max_seqs.max(1);
        Ok(CudaBackend {
            sampled: gpu.zeros(rows)?,
            greedy: gpu.zeros(rows)?,
            params: gpu.zeros(3 * rows)?,
            gpu,
            weights: dev,
            kv,
            scratch,
            captured: LogitCapture::default(),
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.kv.shape.num_blocks
    }

    pub fn device_name(&self) -> &str {
        self.gpu.name()
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Device addresses of layer `l`'s keys and values (kernel benchmarks).
    pub fn kv_layer(&self, l: usize) -> (kernels::gpu::DevPtr, kernels::gpu::DevPtr) {
        self.kv.layer(&self.gpu, l)
    }

    pub fn memory(&self) -> Result<DeviceMemory, GpuError> {
        Ok(DeviceMemory {
            weights: self.weights.bytes,
            kv_cache: self.kv.bytes(),
            total: self.gpu.memory()?.1,
        })
    }

    /// Keeps each sampled item's logits from now on (tests compare them with the CPU's).
    pub fn capture_logits(&mut self, on: bool) {
        self.captured.set(on);
    }

    /// The logits captured since the last call, as (sequence, logits) in step order.
    pub fn take_logits(&mut self) -> Vec<(SeqId, Vec<f32>)> {
        self.captured.take()
    }

    /// Runs a forward pass and waits for it; leaves the logits on the device.
    pub fn forward(&mut self, seqs: &[SeqSlice<'_>]) -> Result<usize, GpuError> {
        self.gpu.bind()?;
        let m = forward::forward(&self.gpu, &self.weights, &self.kv, &mut self.scratch, seqs)?;
        self.gpu.sync()?;
        Ok(m)
    }

    /// Times a prefill of `tokens` tokens written to the first blocks of the cache (free at
    /// start-up, overwritten before any sequence reads them); returns tokens per second.
    pub fn measure_prefill(&mut self, tokens: usize) -> Result<f64, GpuError> {
        let bs = self.kv.shape.block_size;
        let tokens = tokens.min(self.kv.shape.num_blocks * bs).max(1);
        let vocab = self.weights.config.vocab_size as u32;
        let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7 + 11) % vocab).collect();
        let table: Vec<u32> = (0..tokens.div_ceil(bs) as u32).collect();
        let slice = SeqSlice {
            tokens: &ids,
            start: 0,
            table: &table,
            logits: true,
        };
        self.forward(std::slice::from_ref(&slice))?; // warm-up: cuBLAS picks its kernels
        let start = Instant::now();
        self.forward(std::slice::from_ref(&slice))?;
        Ok(tokens as f64 / start.elapsed().as_secs_f64().max(1e-9))
    }

    fn step(&mut self, items: &[ScheduledItem]) -> Result<StepResult, GpuError> {
        self.gpu.bind()?;
        let slices: Vec<SeqSlice<'_>> = items
            .iter()
            .map(|i| SeqSlice {
                tokens: &i.tokens,
                start: i.context,
                table: &i.block_table,
                logits: i.samples,
            })
            .collect();
        let m = forward::forward(
            &self.gpu,
            &self.weights,
            &self.kv,
            &mut self.scratch,
            &slices,
        )?;
        let mut result = StepResult {
            wait: Duration::ZERO,
            ..StepResult::default()
        };
        if m == 0 {
            self.gpu.sync()?;
            return Ok(result);
        }
        let samplers: Vec<&ScheduledItem> = items.iter().filter(|i| i.samples).collect();
        debug_assert_eq!(samplers.len(), m);
        let vocab = self.weights.config.vocab_size;
        let logits = self.scratch.logits(&self.gpu);
        if self.sampled.len() < m {
            self.sampled = self.gpu.zeros(m.next_power_of_two())?;
            self.greedy = self.gpu.zeros(m.next_power_of_two())?;
            self.params = self.gpu.zeros(3 * m.next_power_of_two())?;
        }
        let on_host = |p: &SamplingParams| p.logprobs.is_some() || (p.top_k > 1 && p.top_k < vocab);
        let greedy = |p: &SamplingParams| p.temperature <= 0.0 || p.top_k == 1;
        self.gpu
            .argmax_rows(logits, m, vocab, self.gpu.ptr(&self.greedy))?;
        let drawn = samplers
            .iter()
            .any(|i| !greedy(&i.sampling) && !on_host(&i.sampling));
        if drawn {
            let mut params = Vec::with_capacity(3 * m);
            for i in &samplers {
                let p = &i.sampling;
                let t = if greedy(p) { 1.0 } else { p.temperature };
                params.extend_from_slice(&[
                    t,
                    p.top_p.clamp(0.0, 1.0),
                    uniform_draw(p, i.output_index),
                ]);
            }
            self.gpu.write(&params, &mut self.params)?;
            self.gpu.sample_top_p(
                logits,
                m,
                vocab,
                self.gpu.ptr(&self.params),
                self.gpu.ptr(&self.sampled),
            )?;
        }
        let by_argmax = self.gpu.read(&self.greedy, m)?;
        let by_draw = if drawn {
            self.gpu.read(&self.sampled, m)?
        } else {
            Vec::new()
        };
        for (r, item) in samplers.iter().enumerate() {
            let p = &item.sampling;
            let row_at = logits + (4 * r * vocab) as u64;
            let needs_row = on_host(p) || self.captured.is_on();
            let row = if needs_row {
                Some(self.gpu.read_at::<f32>(row_at, vocab)?)
            } else {
                None
            };
            let (token, lp) = if on_host(p) {
                sample(row.as_deref().unwrap_or_default(), p, item.output_index)
            } else if greedy(p) {
                (by_argmax[r], None)
            } else {
                (by_draw[r], None)
            };
            result.sampled.push(token);
            result.logprobs.push(lp.map(Arc::new));
            if let Some(row) = row.filter(|_| self.captured.is_on()) {
                self.captured.push(item.seq_id, row);
            }
        }
        Ok(result)
    }
}

impl EngineBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn computes(&self) -> bool {
        true
    }

    fn execute(&mut self, items: &[ScheduledItem]) -> StepResult {
        match self.step(items) {
            Ok(r) => r,
            Err(e) => panic!("the cuda backend's step failed on {}: {e}", self.gpu.name()),
        }
    }
}
