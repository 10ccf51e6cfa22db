//! Element-wise and per-row operations of a Llama-style block, in llama.cpp's arithmetic where
//! it matters for parity (RMSNorm's sum of squares in f64, RoPE angles advanced by repeated
//! multiplication).

/// `out = x / sqrt(mean(x²) + eps) * weight`, one row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == weight.len() && x.len() == out.len());
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// RMSNorm over every row of `x` (rows of `weight.len()` values).
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(xr, weight, eps, or);
    }
}

/// Rotary embedding settings of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// Dimensions rotated per head (the rest pass through).
    pub dims: usize,
    /// θ base (`rope_theta`, `rope.freq_base`).
    pub base: f32,
    /// Linear position scaling: positions are multiplied by this (1 / scaling factor).
    pub freq_scale: f32,
    /// Per-frequency divisors (Llama 3's `rope_freqs`), one per rotated pair.
    pub freq_factors: Option<Vec<f32>>,
}

impl Rope {
    /// The (cos, sin) of each rotated pair at position `pos`.
    pub fn angles(&self, pos: usize) -> Vec<(f32, f32)> {
        let scale = self.base.powf(-2.0 / self.dims as f32);
        let mut theta = pos as f32;
        (0..self.dims / 2)
            .map(|i| {
                let ff = self.freq_factors.as_ref().map_or(1.0, |f| f[i]);
                let t = self.freq_scale * (theta / ff);
                theta *= scale;
                (t.cos(), t.sin())
            })
            .collect()
    }
}

/// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `x` (heads of `head_dim`
/// values) — GGML's "normal" RoPE, which GGUF Llama weights are laid out for.
pub fn rope_interleaved(x: &mut [f32], head_dim: usize, angles: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in angles.iter().enumerate() {
            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = x0 * c - x1 * s;
            head[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

/// `gate = silu(gate) * up`, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Softmax in place; returns nothing for an empty slice.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalises() {
        let x = [1.0f32, -2.0, 3.0, -4.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        let ms: f32 = out.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
        rms_norm(&x, &[2.0; 4], 0.0, &mut out);
        assert!((out[3] / x[3] - 2.0 / (7.5f32).sqrt()).abs() < 1e-5);
    }

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let rope = Rope {
            dims: 4,
            base: 10000.0,
            freq_scale: 1.0,
            freq_factors: None,
        };
        let a = rope.angles(3);
        assert!((a[0].0 - 3f32.cos()).abs() < 1e-6);
        assert!((a[1].1 - (3.0f32 * 0.01).sin()).abs() < 1e-6);
        let mut x = [1.0f32, 0.0, 1.0, 0.0];
        rope_interleaved(&mut x, 4, &a);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        // Rotation keeps the norm; position 0 is the identity.
        let mut y = [0.3f32, -0.7, 0.2, 0.9];
        rope_interleaved(&mut y, 4, &rope.angles(0));
        assert_eq!(y, [0.3, -0.7, 0.2, 0.9]);
    }

    #[test]
    fn softmax_and_silu() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6 && x[2] > x[1]);
        let mut g = [0.0f32, 1.0];
        silu_mul(&mut g, &[5.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }
}
