//! `x · Wᵀ` for a SmolLM2-sized MLP matrix (1536 × 576) at batch 1 and 16: Q4_1 (the default
//! model's format) against the same matrix in f32 as the baseline of the same run.
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kernels::quant::quantize_row;
use kernels::{matmul, Activations, Format, Matrix};

fn bench(c: &mut Criterion) {
    let (rows, cols) = (1536, 576);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let q: Vec<u8> = w
        .chunks_exact(cols)
        .flat_map(|r| quantize_row(Format::Q4_1, r))
        .collect();
    let len = q.len();
    let q41 = Matrix::from_bytes(Format::Q4_1, rows, cols, Arc::new(q), 0, len).unwrap();
    let f32m = Matrix::from_f32(rows, cols, w);
    let mut g = c.benchmark_group("matmul_1536x576");
    for tokens in [1usize, 16] {
        let x: Vec<f32> = (0..tokens * cols).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut out = vec![0f32; tokens * rows];
        for (name, m) in [("q4_1", &q41), ("f32", &f32m)] {
            g.bench_with_input(BenchmarkId::new(name, tokens), &tokens, |b, _| {
                b.iter(|| matmul(&Activations::new(&x, cols), m, &mut out))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
