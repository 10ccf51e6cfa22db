//! Writes a small Llama model with seeded random weights as a Hugging Face folder
//! (`config.json` + `model.safetensors`), for serving checks on machines no model file can
//! reach (`scripts/gpu-check.sh` serves one through `kvgate up --backend cuda`). Its answers
//! are noise; what it checks is the path from the gateway through the engine to the GPU.
//!
//! `cargo run --example synthetic_model -- DIR VOCAB_SIZE`

use kernels::Format;
use replica::model::synthetic;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(dir), Some(vocab)) = (args.first(), args.get(1).and_then(|v| v.parse().ok())) else {
        eprintln!("usage: synthetic_model DIR VOCAB_SIZE");
        std::process::exit(2);
    };
    let w = synthetic::weights(
        synthetic::config(vocab, 256, 512, 2, 4, 2, 4096),
        Format::Q8_0,
        3,
    );
    if let Err(e) = synthetic::dequantized(&w).write_hf_dir(std::path::Path::new(dir)) {
        eprintln!("cannot write {dir}: {e}");
        std::process::exit(1);
    }
    println!("wrote a {vocab}-token synthetic model to {dir}");
}
