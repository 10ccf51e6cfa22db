//! A model's weights on the GPU. Matrices are uploaded as stored (quantised blocks straight
//! from the memory-mapped file, or the loader's f32) and widened to f16 on the device by the
//! dequantisation kernels. The query, key and value projections become one matrix, and so do
//! the gate and up projections, so each is one GEMM per layer.

use cudarc::driver::CudaSlice;
use kernels::gpu::{Gpu, GpuError};
use kernels::{Matrix, Stored};

use crate::model::{LlamaConfig, LlamaWeights};

pub struct DeviceLayer {
    pub attn_norm: CudaSlice<f32>,
    /// `wq`, `wk`, `wv` stacked: (heads + 2 × kv_heads) × head_dim rows of `hidden`.
    pub wqkv: CudaSlice<u16>,
    pub wo: CudaSlice<u16>,
    pub ffn_norm: CudaSlice<f32>,
    /// `w_gate` then `w_up`: 2 × intermediate rows of `hidden`.
    pub w_gate_up: CudaSlice<u16>,
    pub w_down: CudaSlice<u16>,
}

pub struct DeviceWeights {
    pub config: LlamaConfig,
    pub embed: CudaSlice<u16>,
    pub layers: Vec<DeviceLayer>,
    pub norm: CudaSlice<f32>,
    /// `None`: tied to the embedding.
    pub lm_head: Option<CudaSlice<u16>>,
    /// RoPE's angle per position for each rotated pair.
    pub inv_freq: CudaSlice<f32>,
    /// Bytes the weights take on the device.
    pub bytes: usize,
}

impl DeviceWeights {
    pub fn upload(gpu: &Gpu, w: &LlamaWeights) -> Result<Self, GpuError> {
        let c = &w.config;
        let mut bytes = 0;
        let mut f16 = |mats: &[&Matrix]| -> Result<CudaSlice<u16>, GpuError> {
            let s = stack(gpu, mats)?;
            bytes += s.len() * 2;
            Ok(s)
        };
        let embed = f16(&[&w.embed])?;
        let lm_head = w.lm_head.as_ref().map(|m| f16(&[m])).transpose()?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(DeviceLayer {
                attn_norm: gpu.upload(&l.attn_norm)?,
                wqkv: f16(&[&l.wq, &l.wk, &l.wv])?,
                wo: f16(&[&l.wo])?,
                ffn_norm: gpu.upload(&l.ffn_norm)?,
                w_gate_up: f16(&[&l.w_gate, &l.w_up])?,
                w_down: f16(&[&l.w_down])?,
            });
        }
        let inv_freq: Vec<f32> = (0..c.rope.dims / 2)
            .map(|i| {
                let ff = c.rope.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
                let base = c.rope.base as f64;
                (c.rope.freq_scale as f64 * base.powf(-2.0 * i as f64 / c.rope.dims as f64) / ff)
                    as f32
            })
            .collect();
        let norms = 4 * (w.norm.len() + 2 * c.layers * c.hidden);
        let out = DeviceWeights {
            config: c.clone(),
            embed,
            layers,
            norm: gpu.upload(&w.norm)?,
            lm_head,
            inv_freq: gpu.upload(&inv_freq)?,
            bytes: bytes + norms,
        };
        gpu.sync()?;
        Ok(out)
    }

    pub fn lm_head(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// The matrices' rows one after another, as f16 on the device.
fn stack(gpu: &Gpu, mats: &[&Matrix]) -> Result<CudaSlice<u16>, GpuError> {
    let cols = mats[0].cols();
    assert!(
        mats.iter().all(|m| m.cols() == cols),
        "stacked matrices share their columns"
    );
    let total: usize = mats.iter().map(|m| m.rows() * cols).sum();
    let out = gpu.zeros::<u16>(total)?;
    let base = gpu.ptr(&out);
    let mut at = 0usize;
    for m in mats {
        let n = m.rows() * cols;
        let dst = base + 2 * at as u64;
        match m.stored() {
            Stored::Dense(v) => {
                let src = gpu.upload(v)?;
                gpu.f32_to_f16(gpu.ptr(&src), dst, n)?;
                gpu.sync()?; // `src` is freed on return
            }
            Stored::Quant(b) => {
                let src = gpu.upload(b)?;
                gpu.dequant(m.format(), gpu.ptr(&src), dst, n / 32)?;
                gpu.sync()?;
            }
        }
        at += n;
    }
    Ok(out)
}
