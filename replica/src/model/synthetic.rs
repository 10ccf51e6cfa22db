//! Llama-shaped models with seeded random weights, for tests and device benchmarks where no
//! model file can be shipped (the GPU check machine receives only the repository). Quantised
//! scales are chosen so that every dequantised weight is exactly representable in f16: a
//! device that widens the blocks to f16 holds the very values the CPU computes with, and
//! backends can be compared on their arithmetic alone.

use std::path::PathBuf;
use std::sync::Arc;

use kernels::ops::Rope;
use kernels::{Format, Matrix};

use super::{LlamaConfig, LlamaWeights};
use crate::model::weights::LayerWeights;
use crate::rng::splitmix64;

/// A model shape by its hyper-parameters (RoPE base 10,000 over the whole head).
#[allow(clippy::too_many_arguments)]
pub fn config(
    vocab_size: usize,
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    max_position: usize,
) -> LlamaConfig {
    let head_dim = hidden / heads;
    LlamaConfig {
        vocab_size,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim,
        rms_eps: 1e-5,
        rope: Rope {
            dims: head_dim,
            base: 10_000.0,
            freq_scale: 1.0,
            freq_factors: None,
        },
        max_position,
    }
}

struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = splitmix64(self.0);
        self.0
    }
}

/// A power of two times 1, 1.25 or 1.5 near `x` (three significant bits: times a 4- or 8-bit
/// quant, 128 at most, it stays exact in f16).
fn coarse(x: f32, d: &mut Draw) -> f32 {
    let e = x.log2().floor();
    [1.0, 1.25, 1.5][(d.next() % 3) as usize] * 2f32.powf(e)
}

fn quant_matrix(format: Format, rows: usize, cols: usize, std: f32, d: &mut Draw) -> Matrix {
    let blocks = rows * cols / 32;
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        match format {
            Format::Q8_0 => {
                // Uniform in [-128, 127]: standard deviation about 74.
                let scale = coarse(std / 74.0, d);
                bytes.extend_from_slice(&half::f16::from_f32(scale).to_le_bytes());
                for _ in 0..4 {
                    bytes.extend_from_slice(&d.next().to_le_bytes());
                }
            }
            Format::Q4_0 | Format::Q4_1 => {
                let scale = coarse(std / 4.6, d);
                bytes.extend_from_slice(&half::f16::from_f32(scale).to_le_bytes());
                if format == Format::Q4_1 {
                    // The minimum as a whole number of steps keeps d·q + m exact.
                    let m = -scale * (6 + d.next() % 4) as f32;
                    bytes.extend_from_slice(&half::f16::from_f32(m).to_le_bytes());
                }
                for _ in 0..2 {
                    bytes.extend_from_slice(&d.next().to_le_bytes());
                }
            }
            other => panic!("synthetic weights are quantised, not {}", other.name()),
        }
    }
    let len = bytes.len();
    Matrix::from_bytes(format, rows, cols, Arc::new(bytes), 0, len)
        .expect("synthetic matrix has the size of its blocks")
}

fn norm(n: usize, d: &mut Draw) -> Vec<f32> {
    (0..n)
        .map(|_| 1.0 + ((d.next() % 17) as f32 - 8.0) / 64.0)
        .collect()
}

/// Seeded random weights of `config`'s shape, every matrix in `format` (Q8_0, Q4_0 or Q4_1),
/// with an output head of its own.
pub fn weights(config: LlamaConfig, format: Format, seed: u64) -> LlamaWeights {
    let c = &config;
    let mut d = Draw(seed ^ 0x6b76_6761_7465);
    let (h, qd, kvd, i) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
    );
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    let embed = quant_matrix(format, c.vocab_size, h, 1.0, &mut d);
    let layers = (0..c.layers)
        .map(|_| LayerWeights {
            attn_norm: norm(h, &mut d),
            wq: quant_matrix(format, qd, h, inv(h), &mut d),
            wk: quant_matrix(format, kvd, h, inv(h), &mut d),
            wv: quant_matrix(format, kvd, h, inv(h), &mut d),
            wo: quant_matrix(format, h, qd, inv(qd), &mut d),
            ffn_norm: norm(h, &mut d),
            w_gate: quant_matrix(format, i, h, inv(h), &mut d),
            w_up: quant_matrix(format, i, h, inv(h), &mut d),
            w_down: quant_matrix(format, h, i, inv(i), &mut d),
        })
        .collect();
    // Logits with a spread of a few units, so greedy choices are seldom near-ties.
    let lm_head = quant_matrix(format, c.vocab_size, h, 4.0 * inv(h), &mut d);
    LlamaWeights {
        embed,
        layers,
        norm: norm(h, &mut d),
        lm_head: Some(lm_head),
        source: PathBuf::from(format!("synthetic-{}-seed{seed}", format.name())),
        config,
    }
}

/// The same model with every matrix widened to dense f32 (the CPU then multiplies in f32,
/// without quantising its activations).
pub fn dequantized(w: &LlamaWeights) -> LlamaWeights {
    let dense = |m: &Matrix| Matrix::from_f32(m.rows(), m.cols(), m.to_f32());
    LlamaWeights {
        config: w.config.clone(),
        embed: dense(&w.embed),
        layers: w
            .layers
            .iter()
            .map(|l| LayerWeights {
                attn_norm: l.attn_norm.clone(),
                wq: dense(&l.wq),
                wk: dense(&l.wk),
                wv: dense(&l.wv),
                wo: dense(&l.wo),
                ffn_norm: l.ffn_norm.clone(),
                w_gate: dense(&l.w_gate),
                w_up: dense(&l.w_up),
                w_down: dense(&l.w_down),
            })
            .collect(),
        norm: w.norm.clone(),
        lm_head: w.lm_head.as_ref().map(dense),
        source: w.source.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dequantised_weight_is_exact_in_f16() {
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            let w = weights(config(64, 64, 96, 1, 2, 1, 128), format, 7);
            for m in [&w.embed, &w.layers[0].wq, &w.layers[0].w_down] {
                for v in m.to_f32() {
                    assert_eq!(half::f16::from_f32(v).to_f32(), v, "{}", format.name());
                }
            }
        }
    }

    #[test]
    fn the_seed_decides_the_weights() {
        let c = config(64, 64, 96, 1, 2, 1, 128);
        let a = weights(c.clone(), Format::Q8_0, 1).embed.to_f32();
        assert_eq!(a, weights(c.clone(), Format::Q8_0, 1).embed.to_f32());
        assert_ne!(a, weights(c, Format::Q8_0, 2).embed.to_f32());
    }
}
