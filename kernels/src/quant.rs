//! Tensor formats. The quantised ones are GGML's block formats, byte for byte as in GGUF files:
//! 32 weights per block, a little-endian f16 scale (and, for Q4_1, an f16 minimum), then the
//! packed values. In Q4_* blocks byte `j` holds weight `j` in its low nibble and weight `j + 16`
//! in its high nibble.
//!
//! Activations are quantised per 32-value block to 8 bits before a quantised dot product, as
//! llama.cpp does (Q8_0 for Q4_0/Q8_0 weights, Q8_1 — with the block's scaled sum — for Q4_1):
//! the dot product is then exact integer arithmetic plus one float multiply-add per block.

use half::{bf16, f16};

/// Values per quantisation block.
pub const QK: usize = 32;

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// Bytes one row of `n` elements takes; `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        match self {
            Format::F32 => Some(4 * n),
            Format::F16 | Format::BF16 => Some(2 * n),
            q => n.is_multiple_of(QK).then(|| n / QK * q.block_bytes()),
        }
    }

    /// Bytes per 32-value block (quantised formats).
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::F32 => 4 * QK,
            Format::F16 | Format::BF16 => 2 * QK,
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, Format::Q8_0 | Format::Q4_0 | Format::Q4_1)
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "F32",
            Format::F16 => "F16",
            Format::BF16 => "BF16",
            Format::Q8_0 => "Q8_0",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
        }
    }
}

/// The little-endian f16 at byte `at` of `b`, as f32.
#[inline]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Decodes one row of `dst.len()` elements stored in `format` into f32. `src` must hold exactly
/// `format.row_bytes(dst.len())` bytes.
pub fn dequantize_row(format: Format, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(Some(src.len()), format.row_bytes(dst.len()));
    match format {
        Format::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Format::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Format::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Format::Q8_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        Format::Q4_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..18].iter().enumerate() {
                    out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                    out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        Format::Q4_1 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for (j, &q) in b[4..20].iter().enumerate() {
                    out[j] = (q & 0x0f) as f32 * d + m;
                    out[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
    }
}

/// Encodes f32 values as little-endian bytes of `format` (F32, F16 and BF16 only: the writers
/// of test checkpoints need no more).
pub fn encode_row(format: Format, src: &[f32]) -> Vec<u8> {
    match format {
        Format::F32 => src.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Format::F16 => src
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        Format::BF16 => src
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        q => panic!("encode_row does not write {}", q.name()),
    }
}

/// Quantises `src` (a whole number of blocks) to Q4_0, Q4_1 or Q8_0 with llama.cpp's reference
/// rounding. Used by tests and by benchmarks that need quantised matrices of any shape.
pub fn quantize_row(format: Format, src: &[f32]) -> Vec<u8> {
    assert_eq!(src.len() % QK, 0, "quantize_row needs whole blocks");
    let mut out = Vec::with_capacity(format.row_bytes(src.len()).unwrap_or(0));
    for x in src.chunks_exact(QK) {
        match format {
            Format::Q8_0 => {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
            Format::Q4_0 => {
                // The value of largest magnitude maps to -8.
                let max = x
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let a = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
                    let b = ((x[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(a | (b << 4));
                }
            }
            Format::Q4_1 => {
                let min = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let a = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    let b = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(a | (b << 4));
                }
            }
            other => panic!("quantize_row does not write {}", other.name()),
        }
    }
    out
}

/// One activation row quantised to 8 bits per value, 32 values per block.
#[derive(Debug, Clone, Default)]
pub struct Q8Row {
    /// Per block: the scale, rounded through f16 as the block format stores it.
    pub d: Vec<f32>,
    /// Per block: `d × Σ qs`, rounded through f16 (Q8_1's `s`, used by Q4_1 weights).
    pub s: Vec<f32>,
    /// Per block: `Σ qs` exactly (lets Q4_0 subtract its offset of 8 in integers).
    pub sum: Vec<i32>,
    pub qs: Vec<i8>,
}

impl Q8Row {
    /// Quantises one row (a whole number of blocks).
    pub fn quantize(x: &[f32]) -> Self {
        let nb = x.len() / QK;
        let mut r = Q8Row {
            d: Vec::with_capacity(nb),
            s: Vec::with_capacity(nb),
            sum: Vec::with_capacity(nb),
            qs: Vec::with_capacity(x.len()),
        };
        for block in x.chunks_exact(QK) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for &v in block {
                let q = (v * id).round() as i8;
                sum += q as i32;
                r.qs.push(q);
            }
            r.d.push(f16::from_f32(d).to_f32());
            r.s.push(f16::from_f32(sum as f32 * d).to_f32());
            r.sum.push(sum);
        }
        r
    }
}

/// Tokens per [`Q8Tile`].
pub const TILE: usize = 8;

/// Up to [`TILE`] quantised activation rows packed for the tiled dot products: each token's
/// values contiguous, and each block's scales and sums laid out across the tile's tokens, so a
/// kernel reads eight tokens' scales with one load.
#[derive(Debug, Clone, Default)]
pub struct Q8Tile {
    /// Tokens in the tile (the rest of the `TILE` lanes are zero).
    pub n: usize,
    /// Blocks per row.
    pub nb: usize,
    /// `[token][nb × 32]`.
    pub qs: Vec<i8>,
    /// `[block][TILE]`: each token's block scale (Q8Row's `d`).
    pub d: Vec<f32>,
    /// `[block][TILE]`: each token's scaled block sum (Q8Row's `s`).
    pub s: Vec<f32>,
}

impl Q8Tile {
    pub fn pack(rows: &[Q8Row]) -> Self {
        assert!(
            !rows.is_empty() && rows.len() <= TILE,
            "a tile holds 1 to {TILE} rows"
        );
        let nb = rows[0].d.len();
        let mut t = Q8Tile {
            n: rows.len(),
            nb,
            qs: Vec::with_capacity(rows.len() * nb * QK),
            d: vec![0.0; nb * TILE],
            s: vec![0.0; nb * TILE],
        };
        for (i, r) in rows.iter().enumerate() {
            t.qs.extend_from_slice(&r.qs[..nb * QK]);
            for b in 0..nb {
                t.d[b * TILE + i] = r.d[b];
                t.s[b * TILE + i] = r.s[b];
            }
        }
        t
    }

    /// Token `t`'s values of block `b`.
    pub fn block(&self, t: usize, b: usize) -> &[i8] {
        let at = (t * self.nb + b) * QK;
        &self.qs[at..at + QK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2654435761).rotate_left(13);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn quantised_rows_round_trip_within_their_step() {
        let x = data(128, 7);
        for (format, tol) in [
            (Format::Q8_0, 0.01),
            (Format::Q4_0, 0.15),
            (Format::Q4_1, 0.08),
        ] {
            let q = quantize_row(format, &x);
            assert_eq!(Some(q.len()), format.row_bytes(x.len()));
            let mut back = vec![0f32; x.len()];
            dequantize_row(format, &q, &mut back);
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= tol, "{}: {a} vs {b}", format.name());
            }
        }
    }

    #[test]
    fn float_formats_round_trip() {
        let x = data(64, 3);
        for format in [Format::F32, Format::F16, Format::BF16] {
            let mut back = vec![0f32; x.len()];
            dequantize_row(format, &encode_row(format, &x), &mut back);
            let tol = match format {
                Format::F32 => 0.0,
                Format::F16 => 1e-3,
                _ => 1e-2,
            };
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= tol);
            }
        }
    }

    #[test]
    fn a_hand_built_q4_1_block_decodes_as_the_format_says() {
        // d = 0.5, m = -1: nibble q decodes to q/2 - 1; byte j holds weights j and j + 16.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize_row(Format::Q4_1, &b, &mut out);
        assert_eq!(out[0], -1.0);
        assert_eq!(out[3], 0.5);
        assert_eq!(out[16], 6.5);
        assert_eq!(out[31], -1.0);
    }

    #[test]
    fn activation_blocks_carry_scale_and_sums() {
        let x = data(64, 11);
        let r = Q8Row::quantize(&x);
        assert_eq!(r.d.len(), 2);
        for b in 0..2 {
            let s: i32 = r.qs[b * 32..(b + 1) * 32].iter().map(|&q| q as i32).sum();
            assert_eq!(r.sum[b], s);
            for j in 0..32 {
                let v = r.qs[b * 32 + j] as f32 * r.d[b];
                assert!((v - x[b * 32 + j]).abs() < 0.01);
            }
        }
    }
}
