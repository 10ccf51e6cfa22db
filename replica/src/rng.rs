//! The one deterministic generator step the engine uses for seeds and draws (the sim's
//! outputs, sampling's random numbers, default request seeds): splitmix64, so a seed gives the
//! same stream on every machine.

/// splitmix64: a tiny, well-mixed deterministic generator step.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
