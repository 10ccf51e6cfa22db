//! Dot products of one weight row with one activation row. The quantised ones sum each block in
//! exact integers, then add `sumi × (d_w × d_x)` (+ `m_w × s_x` for Q4_1) to a float
//! accumulator block by block, in order. The AVX2 versions compute the same integers with SIMD
//! and do the same float operations in the same order, so their results equal the scalar
//! reference bit for bit (a test checks it) and a machine without AVX2 gets the same logits.

use crate::quant::{f16_at, Format, Q8Row, QK};

/// `w · x` for a quantised weight row and a quantised activation row.
pub type QuantDot = fn(&[u8], &Q8Row) -> f32;

/// The fastest implementation of the quantised dot product for `format` on this CPU.
pub fn quant_dot(format: Format) -> QuantDot {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        return match format {
            Format::Q4_0 => avx2::q4_0,
            Format::Q4_1 => avx2::q4_1,
            Format::Q8_0 => avx2::q8_0,
            _ => panic!("{} is not a quantised format", format.name()),
        };
    }
    scalar_dot(format)
}

/// The scalar reference of [`quant_dot`].
pub fn scalar_dot(format: Format) -> QuantDot {
    match format {
        Format::Q4_0 => q4_0_scalar,
        Format::Q4_1 => q4_1_scalar,
        Format::Q8_0 => q8_0_scalar,
        _ => panic!("{} is not a quantised format", format.name()),
    }
}

pub fn q4_1_scalar(w: &[u8], x: &Q8Row) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(20).enumerate() {
        let qs = &x.qs[b * QK..(b + 1) * QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = blk[4 + j];
            sumi += (q & 0x0f) as i32 * qs[j] as i32 + (q >> 4) as i32 * qs[j + 16] as i32;
        }
        acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]) + f16_at(blk, 2) * x.s[b];
    }
    acc
}

pub fn q4_0_scalar(w: &[u8], x: &Q8Row) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(18).enumerate() {
        let qs = &x.qs[b * QK..(b + 1) * QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = blk[2 + j];
            sumi += (q & 0x0f) as i32 * qs[j] as i32 + (q >> 4) as i32 * qs[j + 16] as i32;
        }
        sumi -= 8 * x.sum[b];
        acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]);
    }
    acc
}

pub fn q8_0_scalar(w: &[u8], x: &Q8Row) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in w.chunks_exact(34).enumerate() {
        let qs = &x.qs[b * QK..(b + 1) * QK];
        let sumi: i32 = blk[2..34]
            .iter()
            .zip(qs)
            .map(|(&a, &c)| a as i8 as i32 * c as i32)
            .sum();
        acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]);
    }
    acc
}

/// `a · b` over f32 in eight fixed lanes (vectorisable, and the same order on every machine).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{f16_at, Q8Row, QK};

    // Safe entry points: `quant_dot` hands these out only after detecting AVX2.
    pub fn q4_1(w: &[u8], x: &Q8Row) -> f32 {
        // SAFETY: chosen by `quant_dot` only when the CPU reports AVX2.
        unsafe { q4_1_impl(w, x) }
    }

    pub fn q4_0(w: &[u8], x: &Q8Row) -> f32 {
        // SAFETY: chosen by `quant_dot` only when the CPU reports AVX2.
        unsafe { q4_0_impl(w, x) }
    }

    pub fn q8_0(w: &[u8], x: &Q8Row) -> f32 {
        // SAFETY: chosen by `quant_dot` only when the CPU reports AVX2.
        unsafe { q8_0_impl(w, x) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Σ nibble × x over one block: 16 packed bytes against 32 signed activations.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibble_block_sum(qs: &[u8], x: &[i8]) -> i32 {
        debug_assert!(qs.len() >= 16 && x.len() >= QK);
        // SAFETY: the slices hold at least 16 and 32 bytes (checked by the callers' lengths);
        // unaligned loads are used.
        let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
        let w = _mm256_set_m128i(hi, lo);
        let xv = _mm256_loadu_si256(x.as_ptr() as *const __m256i);
        let p16 = _mm256_maddubs_epi16(w, xv);
        hsum(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
    }

    #[target_feature(enable = "avx2")]
    unsafe fn q4_1_impl(w: &[u8], x: &Q8Row) -> f32 {
        let nb = w.len() / 20;
        assert!(x.qs.len() >= nb * QK && x.d.len() >= nb && x.s.len() >= nb);
        let mut acc = 0f32;
        for b in 0..nb {
            let blk = &w[b * 20..b * 20 + 20];
            let sumi = nibble_block_sum(&blk[4..20], &x.qs[b * QK..b * QK + QK]);
            acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]) + f16_at(blk, 2) * x.s[b];
        }
        acc
    }

    #[target_feature(enable = "avx2")]
    unsafe fn q4_0_impl(w: &[u8], x: &Q8Row) -> f32 {
        let nb = w.len() / 18;
        assert!(x.qs.len() >= nb * QK && x.d.len() >= nb && x.sum.len() >= nb);
        let mut acc = 0f32;
        for b in 0..nb {
            let blk = &w[b * 18..b * 18 + 18];
            let sumi = nibble_block_sum(&blk[2..18], &x.qs[b * QK..b * QK + QK]) - 8 * x.sum[b];
            acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]);
        }
        acc
    }

    #[target_feature(enable = "avx2")]
    unsafe fn q8_0_impl(w: &[u8], x: &Q8Row) -> f32 {
        let nb = w.len() / 34;
        assert!(x.qs.len() >= nb * QK && x.d.len() >= nb);
        let mut acc = 0f32;
        for b in 0..nb {
            let blk = &w[b * 34..b * 34 + 34];
            // SAFETY: `blk[2..34]` and the activation block are 32 bytes each.
            let wv = _mm256_loadu_si256(blk[2..].as_ptr() as *const __m256i);
            let xv = _mm256_loadu_si256(x.qs[b * QK..].as_ptr() as *const __m256i);
            // |w| × (x with w's sign): unsigned × signed, as maddubs needs (no -128 in Q8).
            let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            let sumi = hsum(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
            acc += sumi as f32 * (f16_at(blk, 0) * x.d[b]);
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_add(seed).wrapping_mul(2654435761) >> 7;
                (h % 4001) as f32 / 1000.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn quantised_dots_match_a_naive_float_reference_and_simd_matches_scalar_exactly() {
        let n = 256;
        let w = data(n, 1);
        let x = data(n, 99);
        let xq = Q8Row::quantize(&x);
        for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let wq = quantize_row(format, &w);
            let mut wd = vec![0f32; n];
            dequantize_row(format, &wq, &mut wd);
            let naive: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
            let scalar = scalar_dot(format)(&wq, &xq);
            let fast = quant_dot(format)(&wq, &xq);
            assert_eq!(scalar.to_bits(), fast.to_bits(), "{}", format.name());
            let scale: f32 = wd.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            assert!(
                (scalar - naive).abs() <= 0.01 * scale,
                "{}: {scalar} vs {naive}",
                format.name()
            );
        }
    }

    #[test]
    fn f32_dot_matches_the_naive_sum() {
        let a = data(77, 5);
        let b = data(77, 6);
        let naive: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot_f32(&a, &b) as f64 - naive).abs() < 1e-3);
    }
}
