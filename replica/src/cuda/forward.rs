//! One forward pass on the GPU over a step's mixed batch — the CPU pass of
//! [`crate::model::forward`] with the same order of operations: embed, then per layer RMSNorm,
//! the fused QKV GEMM, RoPE, the new keys and values written to their cache slots, paged
//! attention over the sequence's blocks, the output GEMM added into the residual, RMSNorm, the
//! fused gate/up GEMM, SiLU·up and the down GEMM added into the residual; finally the norm and
//! the output head for the rows that sample. Logits stay on the device for sampling.

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use kernels::gpu::{AttentionLaunch, DevPtr, Gpu, GpuError};
use kernels::plan::{partitions, StepPlan};
use kernels::{AttentionShape, SeqSlice};

use super::weights::DeviceWeights;

/// Floats set aside for the attention's partial results (64 MiB).
const PARTIAL_FLOATS: usize = 16 << 20;

/// A device buffer that grows to what a step needs.
struct Buf<T> {
    s: CudaSlice<T>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    fn new(gpu: &Gpu, n: usize) -> Result<Self, GpuError> {
        Ok(Buf { s: gpu.zeros(n)? })
    }

    fn fit(&mut self, gpu: &Gpu, n: usize) -> Result<DevPtr, GpuError> {
        if self.s.len() < n {
            self.s = gpu.zeros(n.next_power_of_two())?;
        }
        Ok(gpu.ptr(&self.s))
    }

    fn put(&mut self, gpu: &Gpu, host: &[T]) -> Result<DevPtr, GpuError> {
        self.fit(gpu, host.len())?;
        gpu.write(host, &mut self.s)?;
        Ok(gpu.ptr(&self.s))
    }
}

/// The paged KV cache on the device: per layer `[block][kv_head][slot][head_dim]` f16, keys
/// and values apart — the CPU cache's layout.
pub struct DeviceKvCache {
    pub shape: AttentionShape,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
}

impl DeviceKvCache {
    pub fn new(gpu: &Gpu, shape: AttentionShape) -> Result<Self, GpuError> {
        let n =
            shape.layers * shape.num_blocks * shape.kv_heads * shape.block_size * shape.head_dim;
        Ok(DeviceKvCache {
            shape,
            k: gpu.zeros(n)?,
            v: gpu.zeros(n)?,
        })
    }

    fn layer_len(&self) -> usize {
        let s = &self.shape;
        s.num_blocks * s.kv_heads * s.block_size * s.head_dim
    }

    /// Device addresses of layer `l`'s keys and values.
    pub fn layer(&self, gpu: &Gpu, l: usize) -> (DevPtr, DevPtr) {
        let off = 2 * (l * self.layer_len()) as u64;
        (gpu.ptr(&self.k) + off, gpu.ptr(&self.v) + off)
    }

    pub fn bytes(&self) -> usize {
        4 * self.layer_len() * self.shape.layers
    }
}

/// The activations of a step, sized for the largest step seen.
pub struct Scratch {
    x: Buf<f32>,
    h16: Buf<u16>,
    qkv: Buf<f32>,
    attn16: Buf<u16>,
    gate_up: Buf<f32>,
    act16: Buf<u16>,
    logits: Buf<f32>,
    part_acc: Buf<f32>,
    part_ml: Buf<f32>,
    ids: Buf<u32>,
    pos: Buf<i32>,
    slots: Buf<i32>,
    tiles: Buf<i32>,
    table_off: Buf<i32>,
    tables: Buf<u32>,
    rows: Buf<i32>,
    logit_rows: Buf<i32>,
}

impl Scratch {
    /// Buffers for steps of up to `tokens` tokens and `seqs` sampled rows.
    pub fn new(gpu: &Gpu, w: &DeviceWeights, tokens: usize, seqs: usize) -> Result<Self, GpuError> {
        let c = &w.config;
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let t = tokens.max(1);
        Ok(Scratch {
            x: Buf::new(gpu, t * c.hidden)?,
            h16: Buf::new(gpu, t * c.hidden.max(qd))?,
            qkv: Buf::new(gpu, t * (qd + 2 * kvd))?,
            attn16: Buf::new(gpu, t * qd)?,
            gate_up: Buf::new(gpu, t * 2 * c.intermediate)?,
            act16: Buf::new(gpu, t * c.intermediate)?,
            logits: Buf::new(gpu, seqs.max(1) * c.vocab_size)?,
            part_acc: Buf::new(gpu, PARTIAL_FLOATS)?,
            part_ml: Buf::new(gpu, 2 * PARTIAL_FLOATS / c.head_dim.max(1))?,
            ids: Buf::new(gpu, t)?,
            pos: Buf::new(gpu, t)?,
            slots: Buf::new(gpu, t)?,
            tiles: Buf::new(gpu, 4 * t)?,
            table_off: Buf::new(gpu, seqs.max(1))?,
            tables: Buf::new(gpu, t)?,
            rows: Buf::new(gpu, t)?,
            logit_rows: Buf::new(gpu, seqs.max(1))?,
        })
    }

    /// The logits of the last forward pass (`rows × vocab`, on the device).
    pub fn logits(&self, gpu: &Gpu) -> DevPtr {
        gpu.ptr(&self.logits.s)
    }
}

/// Runs the step; returns how many logit rows it left in `scratch` (one per slice that asked,
/// in order).
pub fn forward(
    gpu: &Gpu,
    w: &DeviceWeights,
    kv: &DeviceKvCache,
    s: &mut Scratch,
    seqs: &[SeqSlice<'_>],
) -> Result<usize, GpuError> {
    let c = &w.config;
    let (hidden, hd, heads, kvh) = (c.hidden, c.head_dim, c.heads, c.kv_heads);
    let (qd, kvd) = (heads * hd, kvh * hd);
    let qkv_d = qd + 2 * kvd;
    let inter = c.intermediate;
    let bs = kv.shape.block_size;
    let plan =
        StepPlan::build(seqs, bs, heads / kvh).map_err(|e| GpuError::Unsupported(e.to_string()))?;
    let n = plan.tokens();
    if n == 0 {
        return Ok(0);
    }
    let ids = s.ids.put(gpu, &plan.ids)?;
    let pos = s.pos.put(gpu, &plan.pos)?;
    let slots = s.slots.put(gpu, &plan.slots)?;
    let tiles = s.tiles.put(gpu, &plan.tiles)?;
    let table_off = s.table_off.put(gpu, &plan.table_off)?;
    let tables = s.tables.put(gpu, &plan.tables)?;
    let identity: Vec<i32> = (0..n as i32).collect();
    let rows = s.rows.put(gpu, &identity)?;
    let x = s.x.fit(gpu, n * hidden)?;
    let h16 = s.h16.fit(gpu, n * hidden.max(qd))?;
    let qkv = s.qkv.fit(gpu, n * qkv_d)?;
    let attn16 = s.attn16.fit(gpu, n * qd)?;
    let gate_up = s.gate_up.fit(gpu, n * 2 * inter)?;
    let act16 = s.act16.fit(gpu, n * inter)?;
    let (parts, part_len) = partitions(
        plan.num_tiles(),
        kvh,
        plan.max_ctx,
        gpu.multiprocessors(),
        n,
        heads,
        hd,
        PARTIAL_FLOATS,
    );
    // Partial results only when the context is split (a whole-context step never reads them).
    let (part_acc, part_ml) = if parts > 1 {
        (
            s.part_acc.fit(gpu, parts * n * qd)?,
            s.part_ml.fit(gpu, 2 * parts * n * heads)?,
        )
    } else {
        (gpu.ptr(&s.part_acc.s), gpu.ptr(&s.part_ml.s))
    };
    let att = AttentionLaunch {
        tiles: plan.num_tiles(),
        tokens: n,
        heads,
        kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
        stride: qkv_d,
        parts,
        part_len,
        scale: 1.0 / (hd as f32).sqrt(),
    };

    gpu.embed_rows(gpu.ptr(&w.embed), ids, x, n, hidden)?;
    for (l, lw) in w.layers.iter().enumerate() {
        gpu.rms_norm_rows(x, rows, gpu.ptr(&lw.attn_norm), h16, n, hidden, c.rms_eps)?;
        gpu.gemm_f16(h16, gpu.ptr(&lw.wqkv), qkv, n, qkv_d, hidden, qkv_d, 0.0)?;
        gpu.rope_qk(
            qkv,
            pos,
            gpu.ptr(&w.inv_freq),
            n,
            heads,
            kvh,
            hd,
            c.rope.dims,
            qkv_d,
        )?;
        let (kc, vc) = kv.layer(gpu, l);
        gpu.kv_write(qkv, slots, kc, vc, n, kvh, hd, bs, qkv_d, qd, qd + kvd)?;
        gpu.paged_attention(
            &att, qkv, kc, vc, tiles, table_off, tables, attn16, part_acc, part_ml,
        )?;
        gpu.gemm_f16(attn16, gpu.ptr(&lw.wo), x, n, hidden, qd, hidden, 1.0)?;
        gpu.rms_norm_rows(x, rows, gpu.ptr(&lw.ffn_norm), h16, n, hidden, c.rms_eps)?;
        gpu.gemm_f16(
            h16,
            gpu.ptr(&lw.w_gate_up),
            gate_up,
            n,
            2 * inter,
            hidden,
            2 * inter,
            0.0,
        )?;
        gpu.silu_mul(gate_up, act16, n, inter)?;
        gpu.gemm_f16(act16, gpu.ptr(&lw.w_down), x, n, hidden, inter, hidden, 1.0)?;
    }
    let m = plan.logit_rows.len();
    if m == 0 {
        return Ok(0);
    }
    let logit_rows = s.logit_rows.put(gpu, &plan.logit_rows)?;
    gpu.rms_norm_rows(x, logit_rows, gpu.ptr(&w.norm), h16, m, hidden, c.rms_eps)?;
    let vocab = c.vocab_size;
    let logits = s.logits.fit(gpu, m * vocab)?;
    gpu.gemm_f16(
        h16,
        gpu.ptr(w.lm_head()),
        logits,
        m,
        vocab,
        hidden,
        vocab,
        0.0,
    )?;
    Ok(m)
}
