//! Model files: a tiny Llama written as GGUF (quantised tensors), loaded, written back out as a
//! Hugging Face safetensors checkpoint from its dequantised weights, and loaded again: both
//! loaders must give the same logits bit for bit. Broken files must give errors that name the
//! file and the tensor or key, never a panic.

use std::path::{Path, PathBuf};

use kernels::quant::{quantize_row, Format};
use kernels::{AttentionShape, PagedKvCache};
use protocol::gguf::{ggml_type, write::gguf, Value};
use replica::model::{forward, LlamaWeights, LoadOptions, SeqSlice};

const V: usize = 96;
const D: usize = 64;
const H: usize = 4;
const KVH: usize = 2;
const HD: usize = D / H;
const FF: usize = 128;
const L: usize = 2;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
        })
        .collect()
}

fn q8(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    values(rows * cols, seed)
        .chunks_exact(cols)
        .flat_map(|r| quantize_row(Format::Q8_0, r))
        .collect()
}

fn f32s(n: usize, seed: u64) -> Vec<u8> {
    values(n, seed)
        .iter()
        .map(|v| 1.0 + v)
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

type Tensor = (String, Vec<u64>, u32, Vec<u8>);

fn tiny_tensors() -> Vec<Tensor> {
    let mut t: Vec<Tensor> = vec![
        (
            "token_embd.weight".into(),
            vec![D as u64, V as u64],
            ggml_type::Q8_0,
            q8(V, D, 1),
        ),
        (
            "output_norm.weight".into(),
            vec![D as u64],
            ggml_type::F32,
            f32s(D, 2),
        ),
        (
            "output.weight".into(),
            vec![D as u64, V as u64],
            ggml_type::Q8_0,
            q8(V, D, 3),
        ),
    ];
    for i in 0..L {
        let s = 100 * (i as u64 + 1);
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        t.push((b("attn_norm"), vec![D as u64], ggml_type::F32, f32s(D, s)));
        t.push((
            b("attn_q"),
            vec![D as u64, D as u64],
            ggml_type::Q8_0,
            q8(D, D, s + 1),
        ));
        t.push((
            b("attn_k"),
            vec![D as u64, (KVH * HD) as u64],
            ggml_type::Q8_0,
            q8(KVH * HD, D, s + 2),
        ));
        t.push((
            b("attn_v"),
            vec![D as u64, (KVH * HD) as u64],
            ggml_type::Q8_0,
            q8(KVH * HD, D, s + 3),
        ));
        t.push((
            b("attn_output"),
            vec![D as u64, D as u64],
            ggml_type::Q8_0,
            q8(D, D, s + 4),
        ));
        t.push((
            b("ffn_norm"),
            vec![D as u64],
            ggml_type::F32,
            f32s(D, s + 5),
        ));
        t.push((
            b("ffn_gate"),
            vec![D as u64, FF as u64],
            ggml_type::Q8_0,
            q8(FF, D, s + 6),
        ));
        t.push((
            b("ffn_up"),
            vec![D as u64, FF as u64],
            ggml_type::Q8_0,
            q8(FF, D, s + 7),
        ));
        t.push((
            b("ffn_down"),
            vec![FF as u64, D as u64],
            ggml_type::Q8_0,
            q8(D, FF, s + 8),
        ));
    }
    t
}

fn tiny_metadata() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(L as u32)),
        ("llama.context_length", Value::U32(256)),
        ("llama.embedding_length", Value::U32(D as u32)),
        ("llama.feed_forward_length", Value::U32(FF as u32)),
        ("llama.attention.head_count", Value::U32(H as u32)),
        ("llama.attention.head_count_kv", Value::U32(KVH as u32)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.vocab_size", Value::U32(V as u32)),
    ]
}

fn write_gguf(dir: &Path, name: &str, meta: &[(&str, Value)], tensors: &[Tensor]) -> PathBuf {
    let t: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, ty, b)| (n.as_str(), d.clone(), *ty, b.clone()))
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, gguf(meta, &t)).unwrap();
    path
}

/// A scratch folder, removed when the test ends (passed or failed).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("kvgate-model-files-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn logits(w: &LlamaWeights, tokens: &[u32]) -> Vec<f32> {
    let mut kv = PagedKvCache::new(AttentionShape {
        layers: L,
        kv_heads: KVH,
        head_dim: HD,
        block_size: 16,
        num_blocks: 4,
    });
    let table = [2u32, 0, 3];
    forward(
        w,
        &mut kv,
        &[SeqSlice {
            tokens,
            start: 0,
            table: &table,
            logits: true,
        }],
    )
    .remove(0)
}

#[test]
fn a_safetensors_checkpoint_written_from_gguf_weights_gives_the_same_logits() {
    let dir = scratch("roundtrip");
    let path = write_gguf(&dir, "tiny.gguf", &tiny_metadata(), &tiny_tensors());
    let tokens: Vec<u32> = (0..37).map(|i| (i * 5 + 3) % V as u32).collect();

    let quantised = LlamaWeights::load(&path, LoadOptions::default()).unwrap();
    let dequantised = LlamaWeights::load(&path, LoadOptions { dequantize: true }).unwrap();
    let hf = dir.join("hf");
    dequantised.write_hf_dir(&hf).unwrap();
    let from_hf = LlamaWeights::load(&hf, LoadOptions::default()).unwrap();
    assert_eq!(from_hf.config.heads, H);

    let a = logits(&dequantised, &tokens);
    let b = logits(&from_hf, &tokens);
    assert_eq!(
        a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "GGUF (dequantised) and safetensors logits differ"
    );
    // The quantised path (8-bit activations) stays close to the float one.
    let q = logits(&quantised, &tokens);
    let max = a
        .iter()
        .zip(&q)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        max < 0.05 * scale.max(1.0),
        "quantised vs float logits differ by {max} (scale {scale})"
    );
}

#[test]
fn broken_files_are_errors_that_name_what_is_wrong() {
    let dir = scratch("broken");
    let good = write_gguf(&dir, "good.gguf", &tiny_metadata(), &tiny_tensors());
    let bytes = std::fs::read(&good).unwrap();

    // Truncated anywhere: an error naming the file, never a panic.
    for cut in [3, 40, bytes.len() / 3, bytes.len() - 100] {
        let p = dir.join(format!("cut-{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = LlamaWeights::load(&p, LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("cut-{cut}.gguf")), "{e}");
    }

    // A tensor of a type kvgate does not read.
    let mut tensors = tiny_tensors();
    tensors[4].2 = 13; // Q5_K
    let p = write_gguf(&dir, "qk.gguf", &tiny_metadata(), &tensors);
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("Q5_K"),
        "{e}"
    );

    // A missing tensor and a missing key.
    let mut tensors = tiny_tensors();
    tensors.retain(|t| t.0 != "blk.1.ffn_up.weight");
    let p = write_gguf(&dir, "missing.gguf", &tiny_metadata(), &tensors);
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.1.ffn_up.weight") && e.contains("missing"),
        "{e}"
    );
    let mut meta = tiny_metadata();
    meta.retain(|(k, _)| *k != "llama.embedding_length");
    let p = write_gguf(&dir, "nokey.gguf", &meta, &tiny_tensors());
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("llama.embedding_length"), "{e}");

    // A wrong shape.
    let mut tensors = tiny_tensors();
    tensors[5].1 = vec![32, 128];
    let p = write_gguf(&dir, "shape.gguf", &tiny_metadata(), &tensors);
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.attn_k.weight") && e.contains("expected"),
        "{e}"
    );

    // Another architecture.
    let mut meta = tiny_metadata();
    meta[0].1 = Value::String("mamba".into());
    let p = write_gguf(&dir, "arch.gguf", &meta, &tiny_tensors());
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("mamba"), "{e}");

    // Not a model at all, and a safetensors file with a lying header.
    let p = dir.join("notes.gguf");
    std::fs::write(&p, b"hello world, not a model").unwrap();
    let e = LlamaWeights::load(&p, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    let hf = dir.join("hf");
    LlamaWeights::load(&good, LoadOptions { dequantize: true })
        .unwrap()
        .write_hf_dir(&hf)
        .unwrap();
    let st = hf.join("model.safetensors");
    let b = std::fs::read(&st).unwrap();
    std::fs::write(&st, &b[..b.len() / 2]).unwrap();
    let e = LlamaWeights::load(&hf, LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}
