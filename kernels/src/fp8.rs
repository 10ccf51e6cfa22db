//! FP8 E4M3 (the `e4m3fn` variant vLLM, CUDA and PyTorch call `float8_e4m3fn`): one sign bit,
//! four exponent bits (bias 7), three mantissa bits; no infinities, `S.1111.111` is NaN, so the
//! largest finite magnitude is 448 and the smallest subnormal 2⁻⁹.
//!
//! Encoding rounds to nearest, ties to even, and saturates at ±448 (a KV cache must never
//! store a NaN because one value overflowed). Decoding is a 256-entry table.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The bit pattern of the largest finite magnitude (0x7e = 448).
const MAX_CODE: u8 = 0x7e;
const NAN_CODE: u8 = 0x7f;

/// Every code's value.
static DECODE: [f32; 256] = decode_table();

const fn decode_one(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0x0f) as i32;
    let m = (code & 0x07) as f32;
    if code & 0x7f == NAN_CODE {
        return f32::NAN;
    }
    let mag = if e == 0 {
        // Subnormal: m/8 × 2⁻⁶.
        m / 8.0 / 64.0
    } else {
        let mut p = 1.0f32;
        let mut i = 0;
        if e >= 7 {
            while i < e - 7 {
                p *= 2.0;
                i += 1;
            }
        } else {
            while i < 7 - e {
                p /= 2.0;
                i += 1;
            }
        }
        p * (1.0 + m / 8.0)
    };
    sign * mag
}

const fn decode_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = decode_one(c as u8);
        c += 1;
    }
    t
}

/// The value of an E4M3 code.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    DECODE[code as usize]
}

/// The nearest E4M3 code to `x` (ties to even), saturating at ±448; NaN maps to NaN.
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | NAN_CODE;
    }
    // Below the smallest normal (2⁻⁶) the grid is uniform in steps of 2⁻⁹: the code is the
    // count of steps, and 8 steps land exactly on the smallest normal, code 0x08.
    if a < 1.0 / 64.0 {
        let steps = (a * 512.0).round_ties_even() as u8;
        return sign | steps;
    }
    // Normal: keep the f32's exponent and round its 23-bit mantissa to 3 bits, ties to even;
    // a carry out of the mantissa correctly bumps the exponent.
    let bits = a.to_bits();
    let rounded = (bits + 0x7_ffff + ((bits >> 20) & 1)) >> 20;
    // f32 exponent bias 127 → E4M3 bias 7: subtract 120 from the exponent field (<< 3).
    let code = rounded.saturating_sub(120 << 3);
    sign | code.min(MAX_CODE as u32) as u8
}

/// Encodes `x / scale` for every value of `src` into `dst`.
#[inline]
pub fn encode_scaled(src: &[f32], inv_scale: f32, dst: &mut [u8]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = f32_to_e4m3(x * inv_scale);
    }
}

/// Decodes `src` times `scale` into `dst`.
///
/// The fast way round: an E4M3 code's bits, moved into an f16's (sign to bit 15, the other
/// seven to bits 13..7), are an f16 worth exactly 2⁻⁸ of the code's value — the exponent
/// fields differ by the biases' gap (15 − 7) and subnormals line up too — so the widening is a
/// shift, the half crate's f16 → f32 conversion (F16C where the CPU has it) and one multiply
/// by `scale × 256`. The NaN codes become ±480 instead (the encoder never writes them).
#[inline]
pub fn decode_scaled(src: &[u8], scale: f32, dst: &mut [f32]) {
    use half::slice::HalfBitsSliceExt;
    use half::slice::HalfFloatSliceExt;
    let mut bits = [0u16; 64];
    let k = scale * 256.0;
    for (s, d) in src.chunks(64).zip(dst.chunks_mut(64)) {
        let b = &mut bits[..s.len()];
        for (o, &c) in b.iter_mut().zip(s) {
            *o = ((c as u16 & 0x80) << 8) | ((c as u16 & 0x7f) << 7);
        }
        b.reinterpret_cast::<half::f16>().convert_to_f32_slice(d);
        for x in d.iter_mut() {
            *x *= k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shifted_f16_decode_equals_the_table_for_every_finite_code() {
        let codes: Vec<u8> = (0u8..=255).filter(|c| c & 0x7f != 0x7f).collect();
        let mut fast = vec![0f32; codes.len()];
        decode_scaled(&codes, 0.75, &mut fast);
        for (&c, &f) in codes.iter().zip(&fast) {
            assert_eq!(f, e4m3_to_f32(c) * 0.75, "code {c:#04x}");
        }
    }

    #[test]
    fn known_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert!(e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn every_finite_code_round_trips() {
        for c in 0u8..=255 {
            let x = e4m3_to_f32(c);
            if x.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(x);
            // -0 and +0 are both exact.
            assert_eq!(e4m3_to_f32(back), x, "code {c:#04x}");
        }
    }

    #[test]
    fn rounds_to_the_nearest_code_ties_to_even_and_saturates() {
        let finite: Vec<(u8, f32)> = (0u8..=0x7e).map(|c| (c, e4m3_to_f32(c))).collect();
        let mut x = 0.0f32;
        while x < 500.0 {
            let got = f32_to_e4m3(x);
            let want = if x >= E4M3_MAX {
                MAX_CODE
            } else {
                // Brute force: nearest value, ties to the even code.
                let mut best = (0u8, f32::INFINITY);
                for &(c, v) in &finite {
                    let d = (v - x).abs();
                    if d < best.1 || (d == best.1 && c % 2 == 0) {
                        best = (c, d);
                    }
                }
                best.0
            };
            assert_eq!(got, want, "x = {x}");
            assert_eq!(f32_to_e4m3(-x), want | 0x80, "x = -{x}");
            x = if x < 1.0 {
                x + 1.0 / 4096.0
            } else {
                x * 1.0009 + 1.0 / 4096.0
            };
        }
        // Exact midpoints go to the even code: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7f, 0x7f);
    }
}
