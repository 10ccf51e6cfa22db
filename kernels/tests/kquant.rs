//! K-quant decoding against llama.cpp's reference decoder: `scripts/kquant-vectors.py` wrote
//! random super-blocks and what `gguf.quants.dequantize` (gguf 0.19) makes of them.

use kernels::kquant::{KQuant, QK_K};

#[test]
fn k_quants_decode_like_llama_cpp() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/kquant_vectors.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    // A tiny reader for the generator's flat JSON (no serde in this crate).
    let mut checked = 0;
    for case in text.split("{\"format\": \"").skip(1) {
        let format = &case[..4];
        let kind = match format {
            "Q4_K" => KQuant::Q4K,
            "Q6_K" => KQuant::Q6K,
            other => panic!("unknown format {other}"),
        };
        let hex = case
            .split("\"bytes\": \"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let values: Vec<f32> = case
            .split("\"values\": [")
            .nth(1)
            .unwrap()
            .split(']')
            .next()
            .unwrap()
            .split(',')
            .map(|v| v.trim().parse::<f32>().unwrap())
            .collect();
        let n = bytes.len() / kind.block_bytes() * QK_K;
        assert_eq!(values.len(), n);
        let mut got = vec![0f32; n];
        kind.dequantize_row(&bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&values).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{format} value {i}: {g} vs {w}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 2);
}
