//! The workloads' word-based lengths track real token counts (Qwen3's tokenizer and chat
//! template from `models/qwen3`, fetched by scripts/fetch-models.sh).

use std::path::PathBuf;

use loadtest::workload::{generate, Kind};
use protocol::tokenizer::TextTokenizer;

#[test]
fn approximate_lengths_track_qwen3_token_counts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3");
    let tok = TextTokenizer::from_dir(&dir).expect("run scripts/fetch-models.sh");
    for kind in [Kind::Chat, Kind::Agent] {
        let w = generate(kind, 60, 21);
        let (mut approx, mut real) = (0usize, 0usize);
        for r in &w {
            approx += r.approx_tokens;
            real += tok
                .encode_chat(&r.messages, true, None, None)
                .unwrap()
                .len();
        }
        let ratio = real as f64 / approx as f64;
        assert!(
            (0.8..1.25).contains(&ratio),
            "{kind:?}: real/approx = {ratio}"
        );
    }
}
