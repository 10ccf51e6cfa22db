//! How the paged KV cache stores its keys and values: f16 (llama.cpp's default cache type), or
//! FP8 E4M3 with one f32 scale per (token, KV head) — half the bytes, plus four per head.
//!
//! Why a scale per token and head, not per block or per tensor: a token's keys and values are
//! written once, when it is computed, and are then read unchanged by every sequence that shares
//! the prefix. A per-token scale makes each write self-contained — nothing already in a block
//! is re-quantised when a later token with a larger value arrives, so cached blocks stay
//! immutable and prefix reuse stays bit-exact — and it needs no calibration. A per-tensor
//! scale (vLLM's `k_scale`/`v_scale`) needs calibrated scales from the checkpoint and falls
//! back to 1.0 without them; [`KvElement::Fp8E4m3Unscaled`] is that fallback, and
//! [`KvElement::Fp8E4m3ScalesDropped`] a kernel that forgets to apply the scales on read: both
//! are kept for the long-generation quality check, the second as the planted fault it must
//! catch.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::fp8::{decode_scaled, encode_scaled, E4M3_MAX};

/// The element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvElement {
    /// IEEE single precision, 4 bytes a value: the quality check's floor (what any change
    /// from f16 costs at the least).
    F32,
    /// IEEE half precision, 2 bytes a value.
    F16,
    /// FP8 E4M3 with a scale per (token, KV head): 1 byte a value plus 4 per head.
    Fp8E4m3,
    /// FP8 E4M3 with every scale fixed at 1.0 (an uncalibrated per-tensor cache). For the
    /// quality check; not for serving.
    #[doc(hidden)]
    Fp8E4m3Unscaled,
    /// FP8 E4M3 whose per-token scales are written but never applied on read: a planted fault
    /// for the quality check. Not for serving.
    #[doc(hidden)]
    Fp8E4m3ScalesDropped,
}

impl KvElement {
    /// Parses `f16`/`auto`, `fp8`/`fp8_e4m3`, and the planted fault `fp8-unscaled`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "auto" | "f16" | "fp16" | "half" => Some(KvElement::F16),
            "f32" | "fp32" | "float" => Some(KvElement::F32),
            "fp8" | "fp8_e4m3" | "e4m3" => Some(KvElement::Fp8E4m3),
            "fp8_unscaled" | "fp8_e4m3_unscaled" => Some(KvElement::Fp8E4m3Unscaled),
            "fp8_scales_dropped" | "fp8_e4m3_scales_dropped" => {
                Some(KvElement::Fp8E4m3ScalesDropped)
            }
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvElement::F32 => "f32",
            KvElement::F16 => "f16",
            KvElement::Fp8E4m3 => "fp8_e4m3",
            KvElement::Fp8E4m3Unscaled => "fp8_e4m3_unscaled",
            KvElement::Fp8E4m3ScalesDropped => "fp8_e4m3_scales_dropped",
        }
    }

    /// Bytes of one token's keys (or values) for one KV head of `head_dim` values.
    pub fn bytes_per_head(self, head_dim: usize) -> usize {
        match self {
            KvElement::F32 => 4 * head_dim,
            KvElement::F16 => 2 * head_dim,
            KvElement::Fp8E4m3 | KvElement::Fp8E4m3Unscaled | KvElement::Fp8E4m3ScalesDropped => {
                head_dim + 4
            }
        }
    }
}

/// One of the cache's two arrays (keys or values), `[layer][block][kv_head][slot][head_dim]`.
pub(crate) enum Lanes {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Fp8 {
        codes: Vec<u8>,
        /// One per (layer, block, kv_head, slot): the element offset divided by `head_dim`.
        scales: Vec<f32>,
        /// Scales computed on write (else 1.0).
        scaled: bool,
        /// Scales applied on read (else ignored).
        applied: bool,
    },
}

impl Lanes {
    /// `n` zeroed values (allocated lazily by the OS) in runs of `head_dim`.
    pub(crate) fn new(elem: KvElement, n: usize, head_dim: usize) -> Self {
        match elem {
            KvElement::F32 => Lanes::F32(vec![0f32; n]),
            KvElement::F16 => Lanes::F16(vec![0u16; n]),
            _ => Lanes::Fp8 {
                codes: vec![0u8; n],
                scales: vec![0f32; n / head_dim],
                scaled: elem != KvElement::Fp8E4m3Unscaled,
                applied: elem != KvElement::Fp8E4m3ScalesDropped,
            },
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            Lanes::F32(v) => v.len() * 4,
            Lanes::F16(v) => v.len() * 2,
            Lanes::Fp8 { codes, scales, .. } => codes.len() + scales.len() * 4,
        }
    }

    /// Stores one head's run of values (`values.len()` = head_dim) at element offset `at`.
    pub(crate) fn store(&mut self, at: usize, values: &[f32]) {
        let hd = values.len();
        match self {
            Lanes::F32(v) => v[at..at + hd].copy_from_slice(values),
            Lanes::F16(v) => v[at..at + hd]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(values),
            Lanes::Fp8 {
                codes,
                scales,
                scaled,
                ..
            } => {
                let scale = if *scaled {
                    let amax = values.iter().fold(0f32, |m, &x| m.max(x.abs()));
                    if amax > 0.0 && amax.is_finite() {
                        amax / E4M3_MAX
                    } else {
                        1.0
                    }
                } else {
                    1.0
                };
                scales[at / hd] = scale;
                encode_scaled(values, 1.0 / scale, &mut codes[at..at + hd]);
            }
        }
    }

    /// Widens `out.len()` values (whole runs of `head_dim`) from element offset `at` to f32.
    pub(crate) fn widen(&self, at: usize, head_dim: usize, out: &mut [f32]) {
        match self {
            Lanes::F32(v) => out.copy_from_slice(&v[at..at + out.len()]),
            Lanes::F16(v) => v[at..at + out.len()]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(out),
            Lanes::Fp8 {
                codes,
                scales,
                applied,
                ..
            } => {
                for (i, run) in out.chunks_exact_mut(head_dim).enumerate() {
                    let from = at + i * head_dim;
                    let scale = if *applied {
                        scales[from / head_dim]
                    } else {
                        1.0
                    };
                    decode_scaled(&codes[from..from + head_dim], scale, run);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_runs_keep_their_own_scale_and_f16_is_exact_for_halves() {
        let hd = 8;
        let small: Vec<f32> = (0..hd).map(|i| (i as f32 - 3.5) * 1e-3).collect();
        let large: Vec<f32> = (0..hd).map(|i| (i as f32 - 3.5) * 300.0).collect();
        let mut lanes = Lanes::new(KvElement::Fp8E4m3, 4 * hd, hd);
        lanes.store(0, &small);
        lanes.store(hd, &large);
        let mut out = vec![0f32; 2 * hd];
        lanes.widen(0, hd, &mut out);
        for (got, want) in out.iter().zip(small.iter().chain(&large)) {
            // Three mantissa bits: within 1/16 of the value, at any magnitude.
            assert!((got - want).abs() <= want.abs() / 16.0, "{got} vs {want}");
        }
        assert_eq!(lanes.bytes(), 4 * hd + 4 * 4);
        // Without scales the small run falls into subnormals and the large one saturates.
        let mut bad = Lanes::new(KvElement::Fp8E4m3Unscaled, 4 * hd, hd);
        bad.store(0, &small);
        bad.store(hd, &large);
        bad.widen(0, hd, &mut out);
        assert!(out[hd..].iter().all(|x| x.abs() <= E4M3_MAX));
        assert!((out[0] - small[0]).abs() > small[0].abs() / 16.0);

        let mut f = Lanes::new(KvElement::F16, 2 * hd, hd);
        f.store(hd, &[0.5; 8]);
        let mut back = vec![0f32; hd];
        f.widen(hd, hd, &mut back);
        assert_eq!(back, vec![0.5; 8]);
        assert_eq!(KvElement::Fp8E4m3.bytes_per_head(64) * 2, 136);
        assert_eq!(KvElement::parse("fp8"), Some(KvElement::Fp8E4m3));
        assert_eq!(KvElement::parse("auto"), Some(KvElement::F16));
        assert_eq!(KvElement::parse("int4"), None);
    }
}
