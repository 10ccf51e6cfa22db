//! Dot products of one weight row with a tile of activation rows. The quantised ones follow
//! llama.cpp's AVX2 scheme: per 32-value block, exact integer products summed in eight lanes of
//! four, each lane converted to f32 and fused-multiply-added into an eight-lane float
//! accumulator with the block's scale (`d_w × d_x`); Q4_1's minimum term (`m_w × s_x`) is summed
//! separately; the lanes are reduced in a fixed tree at the end. The scalar reference performs
//! exactly these operations in this order (`f32::mul_add` is the fused multiply-add), so the
//! AVX2 path equals it bit for bit (a test checks), and each token's result depends only on its
//! own activations: the same whatever else is in the tile. The AVX2 path unpacks each weight
//! block once for the whole tile.

use crate::quant::{f16_at, Format, Q8Tile, QK, TILE};

/// `out[t] = w · x_t` for a quantised weight row and each token `t` of a packed tile.
pub type QuantDot = fn(&[u8], &Q8Tile, &mut [f32]);

/// The fastest implementation of the quantised dot product for `format` on this CPU.
pub fn quant_dot(format: Format) -> QuantDot {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("avx512vnni")
        && std::is_x86_feature_detected!("avx512vl")
    {
        return match format {
            Format::Q4_0 => avx2::q4_0_vnni,
            Format::Q4_1 => avx2::q4_1_vnni,
            Format::Q8_0 => avx2::q8_0_vnni,
            _ => panic!("{} is not a quantised format", format.name()),
        };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
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

/// The fixed reduction of eight lanes: (j, j+4), then (j, j+2), then (0, 1).
#[inline]
fn reduce(l: &[f32; 8]) -> f32 {
    let s4 = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Scalar block kernel: `lanes_of` gives the exact integer sum of weights `4j..4j+3` times
/// their activations, lane by lane; `min_of` the block's minimum (Q4_1).
#[inline]
fn scalar_tile(
    w: &[u8],
    block_bytes: usize,
    x: &Q8Tile,
    out: &mut [f32],
    lanes_of: impl Fn(&[u8], &[i8]) -> [i32; 8],
    min_of: impl Fn(&[u8]) -> Option<f32>,
) {
    for (t, o) in out.iter_mut().enumerate().take(x.n) {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (b, blk) in w.chunks_exact(block_bytes).enumerate() {
            let li = lanes_of(blk, x.block(t, b));
            let d = f16_at(blk, 0) * x.d[b * TILE + t];
            for j in 0..8 {
                acc[j] = (li[j] as f32).mul_add(d, acc[j]);
            }
            if let Some(m) = min_of(blk) {
                summs += m * x.s[b * TILE + t];
            }
        }
        *o = reduce(&acc) + summs;
    }
}

/// Weight `i` of a Q4 block (`qs` = the 16 packed bytes).
#[inline]
fn nibble(qs: &[u8], i: usize) -> i32 {
    if i < 16 {
        (qs[i] & 0x0f) as i32
    } else {
        (qs[i - 16] >> 4) as i32
    }
}

fn lanes(f: impl Fn(usize) -> i32, x: &[i8]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (j, lj) in l.iter_mut().enumerate() {
        *lj = (4 * j..4 * j + 4).map(|i| f(i) * x[i] as i32).sum();
    }
    l
}

pub fn q4_1_scalar(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
    scalar_tile(
        w,
        20,
        x,
        out,
        |blk, x| lanes(|i| nibble(&blk[4..20], i), x),
        |blk| Some(f16_at(blk, 2)),
    );
}

pub fn q4_0_scalar(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
    scalar_tile(
        w,
        18,
        x,
        out,
        |blk, x| lanes(|i| nibble(&blk[2..18], i) - 8, x),
        |_| None,
    );
}

pub fn q8_0_scalar(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
    scalar_tile(
        w,
        34,
        x,
        out,
        |blk, x| lanes(|i| blk[2 + i] as i8 as i32, x),
        |_| None,
    );
}

/// The AVX2 implementation without AVX-512 VNNI, even where VNNI is available (tests compare
/// the two).
#[cfg(target_arch = "x86_64")]
pub fn avx2_dot(format: Format) -> Option<QuantDot> {
    if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
        return None;
    }
    Some(match format {
        Format::Q4_0 => avx2::q4_0,
        Format::Q4_1 => avx2::q4_1,
        Format::Q8_0 => avx2::q8_0,
        _ => panic!("{} is not a quantised format", format.name()),
    })
}

/// `a · b` over f32 in eight fixed lanes (vectorisable, and the same order on every machine).
#[inline]
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
    let mut s = reduce(&lanes);
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{f16_at, Q8Tile, QK, TILE};

    // Safe entry points: `quant_dot` / `avx2_dot` hand these out only after detecting AVX2
    // and FMA (and, for the `_vnni` ones, AVX-512 VNNI and VL).
    pub fn q4_1(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: chosen only when the CPU reports AVX2 and FMA.
        unsafe { tile_avx2::<20, 4, true, false>(w, x, out) }
    }

    pub fn q4_0(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { tile_avx2::<18, 2, false, true>(w, x, out) }
    }

    pub fn q8_0(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { tile_avx2::<34, 2, false, false>(w, x, out) }
    }

    pub fn q4_1_vnni(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: chosen only when the CPU reports AVX2, FMA, AVX-512 VNNI and VL.
        unsafe { tile_vnni::<20, 4, true, false>(w, x, out) }
    }

    pub fn q4_0_vnni(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { tile_vnni::<18, 2, false, true>(w, x, out) }
    }

    pub fn q8_0_vnni(w: &[u8], x: &Q8Tile, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { tile_vnni::<34, 2, false, false>(w, x, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_avx2<const BB: usize, const OFF: usize, const MIN: bool, const SIGNED: bool>(
        w: &[u8],
        x: &Q8Tile,
        out: &mut [f32],
    ) {
        tile::<BB, OFF, MIN, SIGNED, false>(w, x, out)
    }

    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn tile_vnni<const BB: usize, const OFF: usize, const MIN: bool, const SIGNED: bool>(
        w: &[u8],
        x: &Q8Tile,
        out: &mut [f32],
    ) {
        tile::<BB, OFF, MIN, SIGNED, true>(w, x, out)
    }

    /// Lane j = Σ of the products of bytes 4j..4j+3 (`u` unsigned, `s` signed), exactly:
    /// one VNNI instruction, or AVX2's pairwise multiply-add twice (no saturation: |u| ≤ 127).
    #[inline(always)]
    unsafe fn dot4<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
        }
    }

    #[inline(always)]
    unsafe fn reduce(v: __m256) -> f32 {
        // (j, j+4), then (j, j+2), then (0, 1): the scalar reference's tree.
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// One weight row against a tile of up to eight tokens, accumulators in registers. `BB`
    /// bytes per block; values from byte `OFF`: packed nibbles (Q4_*, `BB = OFF + 16`) or
    /// signed bytes (Q8_0, `BB = OFF + 32`). `MIN`: the block has a minimum (Q4_1); `SIGNED`:
    /// nibbles carry an offset of 8 (Q4_0). The eight products `d_w × d_x[t]` come from one
    /// vector multiply and are broadcast per token; Q4_1's `m_w × s_x[t]` terms are summed for
    /// the eight tokens in one vector. Each token's operations are the scalar reference's.
    #[inline(always)]
    unsafe fn tile<
        const BB: usize,
        const OFF: usize,
        const MIN: bool,
        const SIGNED: bool,
        const VNNI: bool,
    >(
        w: &[u8],
        x: &Q8Tile,
        out: &mut [f32],
    ) {
        let nb = w.len() / BB;
        assert!(x.nb == nb && x.qs.len() >= x.n * nb * QK);
        assert!(x.d.len() >= nb * TILE && x.s.len() >= nb * TILE && out.len() >= x.n);
        let n = x.n;
        let q8 = BB == OFF + 32;
        let mask = _mm_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let mut acc = [_mm256_setzero_ps(); TILE];
        let mut summs = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = &w[b * BB..(b + 1) * BB];
            // SAFETY: `blk` holds `BB` bytes: 16 packed bytes from OFF (Q4), 32 from OFF (Q8).
            let wv = if q8 {
                _mm256_loadu_si256(blk[OFF..].as_ptr() as *const __m256i)
            } else {
                let raw = _mm_loadu_si128(blk[OFF..].as_ptr() as *const __m128i);
                let lo = _mm_and_si128(raw, mask);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
                _mm256_set_m128i(hi, lo)
            };
            // Unsigned operand and the sign to move onto the activations.
            let (uw, sw) = if q8 {
                (_mm256_sign_epi8(wv, wv), Some(wv))
            } else if SIGNED {
                let ws = _mm256_sub_epi8(wv, eight);
                (_mm256_sign_epi8(ws, ws), Some(ws))
            } else {
                (wv, None)
            };
            // SAFETY: `d` and `s` hold TILE floats per block (asserted above).
            let dprod = _mm256_mul_ps(
                _mm256_set1_ps(f16_at(blk, 0)),
                _mm256_loadu_ps(x.d[b * TILE..].as_ptr()),
            );
            if MIN {
                let m = _mm256_set1_ps(f16_at(blk, 2));
                let sx = _mm256_loadu_ps(x.s[b * TILE..].as_ptr());
                summs = _mm256_add_ps(summs, _mm256_mul_ps(m, sx));
            }
            // A macro, not a closure: a closure would not inherit the wrapper's target features.
            macro_rules! token {
                ($t:expr, $a:expr) => {{
                    let t: usize = $t;
                    // SAFETY: token t's block is 32 bytes inside `qs` (asserted above).
                    let xv =
                        _mm256_loadu_si256(x.qs[(t * nb + b) * QK..].as_ptr() as *const __m256i);
                    let xs = match sw {
                        Some(sign) => _mm256_sign_epi8(xv, sign),
                        None => xv,
                    };
                    let li = _mm256_cvtepi32_ps(dot4::<VNNI>(uw, xs));
                    let d = _mm256_permutevar8x32_ps(dprod, _mm256_set1_epi32(t as i32));
                    *$a = _mm256_fmadd_ps(li, d, *$a);
                }};
            }
            // A full tile has a constant trip count, so the accumulators stay in registers.
            if n == TILE {
                for (t, a) in acc.iter_mut().enumerate() {
                    token!(t, a);
                }
            } else {
                for (t, a) in acc.iter_mut().enumerate().take(n) {
                    token!(t, a);
                }
            }
        }
        let mut sm = [0f32; TILE];
        _mm256_storeu_ps(sm.as_mut_ptr(), summs);
        for t in 0..n {
            out[t] = reduce(acc[t]) + sm[t];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row, Q8Row};

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
        let xs: Vec<Vec<f32>> = (0..8).map(|t| data(n, 99 + t)).collect();
        let rows: Vec<Q8Row> = xs.iter().map(|x| Q8Row::quantize(x)).collect();
        let xq = Q8Tile::pack(&rows);
        for format in [Format::Q4_0, Format::Q4_1, Format::Q8_0] {
            let wq = quantize_row(format, &w);
            let mut wd = vec![0f32; n];
            dequantize_row(format, &wq, &mut wd);
            let mut scalar = vec![0f32; xs.len()];
            let mut fast = vec![0f32; xs.len()];
            scalar_dot(format)(&wq, &xq, &mut scalar);
            quant_dot(format)(&wq, &xq, &mut fast);
            #[cfg(target_arch = "x86_64")]
            if let Some(avx2) = avx2_dot(format) {
                let mut plain = vec![0f32; xs.len()];
                avx2(&wq, &xq, &mut plain);
                assert_eq!(
                    plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{}: AVX2 and the fastest path differ",
                    format.name()
                );
            }
            for (t, x) in xs.iter().enumerate() {
                assert_eq!(
                    scalar[t].to_bits(),
                    fast[t].to_bits(),
                    "{} t{t}",
                    format.name()
                );
                let naive: f32 = wd.iter().zip(x).map(|(a, b)| a * b).sum();
                let scale: f32 = wd.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
                assert!(
                    (scalar[t] - naive).abs() <= 0.01 * scale,
                    "{}: {} vs {naive}",
                    format.name(),
                    scalar[t]
                );
                // A token alone gives the bit-identical result it gets in the tile.
                let mut alone = [0f32];
                quant_dot(format)(&wq, &Q8Tile::pack(&rows[t..t + 1]), &mut alone);
                assert_eq!(alone[0].to_bits(), fast[t].to_bits());
            }
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
