//! GGML's K-quants (256-value super-blocks), decoded to f32: Q4_K and Q6_K — what the common
//! "Q4_K_M" GGUF downloads hold. The engine does not compute on them directly: the loader
//! decodes each row and re-quantises it to Q8_0, whose dot products the kernels run (Q8_0 is
//! finer than either, so nothing the file holds is lost beyond one rounding per value).
//! Checked against llama.cpp's own reference decoder (`gguf.quants`) in
//! `kernels/tests/kquant.rs`.

use crate::quant::f16_at;

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuant {
    Q4K,
    Q6K,
}

impl KQuant {
    /// Bytes per 256-value super-block.
    pub fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4K => 144,
            KQuant::Q6K => 210,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KQuant::Q4K => "Q4_K",
            KQuant::Q6K => "Q6_K",
        }
    }

    /// Bytes one row of `n` values takes; `None` unless `n` is whole super-blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(QK_K)
            .then(|| n / QK_K * self.block_bytes())
    }

    /// Decodes `dst.len()` values from `src` (exactly `row_bytes(dst.len())` bytes).
    pub fn dequantize_row(self, src: &[u8], dst: &mut [f32]) {
        let bb = self.block_bytes();
        for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(QK_K)) {
            match self {
                KQuant::Q4K => q4_k_block(blk, out),
                KQuant::Q6K => q6_k_block(blk, out),
            }
        }
    }
}

/// Scale and minimum `j` (0..8) of a Q4_K super-block: 6 bits each, packed in 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `{ f16 d, f16 dmin, u8 scales[12], u8 qs[128] }`: eight 32-value sub-blocks, value =
/// d·scale·q − dmin·min, q a nibble (low nibbles of 32 bytes, then their high nibbles).
fn q4_k_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (k, chunk) in out.chunks_exact_mut(64).enumerate() {
        let q = &qs[k * 32..k * 32 + 32];
        let (s1, m1) = scale_min_k4(2 * k, scales);
        let (s2, m2) = scale_min_k4(2 * k + 1, scales);
        let (d1, min1) = (d * s1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * s2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            chunk[l] = d1 * (q[l] & 0x0f) as f32 - min1;
            chunk[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// `{ u8 ql[128], u8 qh[64], i8 scales[16], f16 d }`: sixteen 16-value sub-blocks, value =
/// d·scale·(q − 32), q 6 bits (4 low from `ql`, 2 high from `qh`).
fn q6_k_block(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for (n, chunk) in out.chunks_exact_mut(128).enumerate() {
        let ql = &b[n * 64..n * 64 + 64];
        let qh = &b[128 + n * 32..128 + n * 32 + 32];
        let sc = &b[192 + n * 8..192 + n * 8 + 8];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |i: usize| sc[i] as i8 as f32;
            chunk[l] = d * s(is) * q1 as f32;
            chunk[l + 32] = d * s(is + 2) * q2 as f32;
            chunk[l + 64] = d * s(is + 4) * q3 as f32;
            chunk[l + 96] = d * s(is + 6) * q4 as f32;
        }
    }
}
