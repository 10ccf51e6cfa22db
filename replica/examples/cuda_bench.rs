//! The GPU figures of docs/BENCHMARKS.md, run by `scripts/gpu-check.sh` (feature `cuda`):
//!
//! - decode tokens/s at batch 1, 16, 64 and 256 (512-token contexts) and one prefill step;
//! - the paged-attention decode kernel's achieved bandwidth against a device-to-device copy
//!   timed in the same run;
//! - the `sim` roofline's predicted step time for the same model on the named GPU profile
//!   against the measured one, and the efficiencies that would make them agree.
//!
//! The model is Llama-3.1-8B's shape with seeded random Q4_0 weights (no model file travels to
//! the GPU machine); the engine widens them to f16, as it would a real GGUF file's.
//!
//! `cargo run --release --features cuda --example cuda_bench -- [GPU_PROFILE] [MODEL_PROFILE]`

use std::sync::Arc;
use std::time::Instant;

use kernels::gpu::AttentionLaunch;
use kernels::plan::{partitions, StepPlan};
use kernels::{Format, SeqSlice};
use replica::backend::EngineBackend;
use replica::cuda::{CudaBackend, KvBlocks};
use replica::model::synthetic;
use replica::profiles::{self, ModelProfile};
use replica::roofline::{
    KvDtype, Roofline, WorkItem, DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_COMPUTE_EFFICIENCY,
};
use replica::sampling::SamplingParams;
use replica::scheduler::ScheduledItem;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const BLOCK: usize = 16;
const BLOCKS: usize = 20_000;
const CONTEXT: usize = 512;
const DECODE_STEPS: usize = 16;

fn item(
    seq: u64,
    tokens: Vec<u32>,
    context: usize,
    table: &[u32],
    sampling: &Arc<SamplingParams>,
) -> ScheduledItem {
    ScheduledItem {
        seq_id: seq,
        context,
        num_tokens: tokens.len(),
        samples: true,
        output_index: 0,
        seed: seq,
        ignore_eos: true,
        tokens,
        block_table: table.to_vec(),
        sampling: sampling.clone(),
    }
}

struct Row {
    what: String,
    measured_s: f64,
    predicted_s: f64,
    bound: String,
    figure: String,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    replica::cuda::probe()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let gpu_profile = args.first().map_or("h200", String::as_str);
    let model_profile = args.get(1).map_or("llama-3.1-8b", String::as_str);
    let profile = ModelProfile::resolve(model_profile)?;
    let config = synthetic::config(
        profile.vocab_size as usize,
        profile.hidden_size as usize,
        profile.intermediate_size as usize,
        profile.num_layers as usize,
        profile.num_heads as usize,
        profile.num_kv_heads as usize,
        8192,
    );
    let t = Instant::now();
    let weights = synthetic::weights(config.clone(), Format::Q4_0, 1);
    eprintln!(
        "synthetic {model_profile} weights in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let mut b = CudaBackend::new(0, &weights, BLOCK, KvBlocks::Count(BLOCKS), 8192, 256)?;
    drop(weights);
    let mem = b.memory()?;
    eprintln!(
        "{} loaded in {:.1} s: weights {} MiB, KV cache {} MiB of {} MiB",
        b.device_name(),
        t.elapsed().as_secs_f64(),
        mem.weights >> 20,
        mem.kv_cache >> 20,
        mem.total >> 20
    );
    let roof = Roofline::new(profiles::gpu(gpu_profile)?, profile.clone(), KvDtype::Auto);
    let greedy = Arc::new(SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    });
    let mut rows = Vec::new();

    // Decode at batch 1, 16, 64 and 256.
    for batch in [1usize, 16, 64, 256] {
        let per_seq = (CONTEXT + DECODE_STEPS + 2).div_ceil(BLOCK);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let prompt = |s: usize| -> Vec<u32> {
            (0..CONTEXT)
                .map(|i| ((s * 7919 + i * 31) % config.vocab_size) as u32)
                .collect()
        };
        for chunk in (0..batch).collect::<Vec<_>>().chunks(16) {
            let items: Vec<ScheduledItem> = chunk
                .iter()
                .map(|&s| item(s as u64, prompt(s), 0, &tables[s], &greedy))
                .collect();
            b.execute(&items);
        }
        let mut last = vec![1u32; batch];
        let run = |b: &mut CudaBackend, step: usize, last: &mut Vec<u32>| {
            let items: Vec<ScheduledItem> = (0..batch)
                .map(|s| item(s as u64, vec![last[s]], CONTEXT + step, &tables[s], &greedy))
                .collect();
            *last = b.execute(&items).sampled;
        };
        run(&mut b, 0, &mut last);
        run(&mut b, 1, &mut last);
        let t = Instant::now();
        for k in 0..DECODE_STEPS {
            run(&mut b, 2 + k, &mut last);
        }
        let step = t.elapsed().as_secs_f64() / DECODE_STEPS as f64;
        let work: Vec<WorkItem> = (0..batch)
            .map(|_| WorkItem {
                context: (CONTEXT + 2 + DECODE_STEPS / 2) as u64,
                new_tokens: 1,
                samples: true,
            })
            .collect();
        let cost = roof.step_cost(&work);
        rows.push(Row {
            what: format!("decode, batch {batch}, context {CONTEXT}"),
            measured_s: step,
            predicted_s: cost.seconds,
            bound: format!("{:?}", cost.bound),
            figure: format!("{:.0} tokens/s", batch as f64 / step),
        });
    }

    // One prefill step: 8 prompts of 1,024 tokens (8,192 tokens).
    {
        let n = 1024usize;
        let per_seq = n.div_ceil(BLOCK);
        let make = |base: usize| -> Vec<ScheduledItem> {
            (0..8)
                .map(|s| {
                    let table: Vec<u32> =
                        ((base + s * per_seq) as u32..(base + (s + 1) * per_seq) as u32).collect();
                    let toks = (0..n)
                        .map(|i| ((s * 104_729 + i * 13) % config.vocab_size) as u32)
                        .collect();
                    item(s as u64, toks, 0, &table, &greedy)
                })
                .collect()
        };
        b.execute(&make(0)); // warm-up: cuBLAS chooses its kernels for this shape
        let items = make(8 * per_seq);
        let t = Instant::now();
        b.execute(&items);
        let step = t.elapsed().as_secs_f64();
        let work: Vec<WorkItem> = (0..8)
            .map(|_| WorkItem {
                context: 0,
                new_tokens: n as u64,
                samples: true,
            })
            .collect();
        let cost = roof.step_cost(&work);
        rows.push(Row {
            what: "prefill, 8 × 1,024 tokens".into(),
            measured_s: step,
            predicted_s: cost.seconds,
            bound: format!("{:?}", cost.bound),
            figure: format!("{:.0} tokens/s", 8.0 * n as f64 / step),
        });
    }

    // The attention kernel alone, against a device-to-device copy.
    let gpu = b.gpu();
    let copy_bytes = 2usize << 30;
    let src = gpu.zeros::<u8>(copy_bytes)?;
    let dst = gpu.zeros::<u8>(copy_bytes)?;
    let copy_s = gpu.timed(10, || gpu.copy(gpu.ptr(&src), gpu.ptr(&dst), copy_bytes))?;
    let copy_bw = 2.0 * copy_bytes as f64 / copy_s;
    drop((src, dst));
    let c = &config;
    let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let mut attention = Vec::new();
    for (batch, ctx) in [(1usize, 512usize), (1, 8192), (64, 4096), (256, 1024)] {
        let per_seq = ctx / BLOCK;
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let one = [0u32];
        let seqs: Vec<SeqSlice<'_>> = tables
            .iter()
            .map(|t| SeqSlice {
                tokens: &one,
                start: ctx - 1,
                table: t,
                logits: true,
            })
            .collect();
        let plan = StepPlan::build(&seqs, BLOCK, c.heads / c.kv_heads)?;
        let budget = 16 << 20;
        let (parts, part_len) = partitions(
            plan.num_tiles(),
            c.kv_heads,
            plan.max_ctx,
            gpu.multiprocessors(),
            batch,
            c.heads,
            c.head_dim,
            budget,
        );
        let qkv = gpu.zeros::<f32>(batch * (qd + 2 * kvd))?;
        let out = gpu.zeros::<u16>(batch * qd)?;
        let part_acc = gpu.zeros::<f32>(budget)?;
        let part_ml = gpu.zeros::<f32>(2 * budget / c.head_dim)?;
        let tiles = gpu.upload(&plan.tiles)?;
        let table_off = gpu.upload(&plan.table_off)?;
        let all_tables = gpu.upload(&plan.tables)?;
        let a = AttentionLaunch {
            tiles: plan.num_tiles(),
            tokens: batch,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            block_size: BLOCK,
            stride: qd + 2 * kvd,
            parts,
            part_len,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let (kc, vc) = b.kv_layer(0);
        let s = gpu.timed(20, || {
            gpu.paged_attention(
                &a,
                gpu.ptr(&qkv),
                kc,
                vc,
                gpu.ptr(&tiles),
                gpu.ptr(&table_off),
                gpu.ptr(&all_tables),
                gpu.ptr(&out),
                gpu.ptr(&part_acc),
                gpu.ptr(&part_ml),
            )
        })?;
        let bytes = (batch * ctx * kvd * 2 * 2) as f64;
        attention.push((batch, ctx, parts, s, bytes / s));
    }

    // The GEMMs alone (cuBLAS, f16 weights and activations, f32 output): each of a layer's
    // matrices and the LM head at the decode batches, as bandwidth against the copy's, and
    // what the model's GEMMs add up to per decode step (to set against the measured step).
    let inter = c.intermediate;
    let shapes = [
        ("qkv", qd + 2 * kvd, c.hidden, c.layers),
        ("o", c.hidden, qd, c.layers),
        ("gate+up", 2 * inter, c.hidden, c.layers),
        ("down", c.hidden, inter, c.layers),
        ("lm head", c.vocab_size, c.hidden, 1),
    ];
    let biggest = shapes.iter().map(|s| s.1 * s.2).max().unwrap_or(0);
    let wbuf = gpu.zeros::<u16>(biggest)?;
    let xbuf = gpu.zeros::<u16>(64 * inter.max(c.hidden))?;
    let cbuf = gpu.zeros::<f32>(64 * shapes.iter().map(|s| s.1).max().unwrap_or(0))?;
    let mut gemms = Vec::new();
    for n in [1usize, 16, 64] {
        let mut per_step = 0.0;
        for &(name, out_f, in_f, times) in &shapes {
            let s = gpu.timed(20, || {
                gpu.gemm_f16(
                    gpu.ptr(&xbuf),
                    gpu.ptr(&wbuf),
                    gpu.ptr(&cbuf),
                    n,
                    out_f,
                    in_f,
                    out_f,
                    0.0,
                )
            })?;
            per_step += s * times as f64;
            let bytes = (out_f * in_f * 2) as f64;
            gemms.push((n, name.to_string(), out_f, in_f, s, bytes / s));
        }
        gemms.push((n, "all of a decode step".into(), 0, 0, per_step, 0.0));
    }
    drop((wbuf, xbuf, cbuf));

    // The other kernels of a batch-1 decode step, each timed alone (back to back, so the GPU
    // is never short of work): what they add up to over the layers, set against the step and
    // its GEMMs, splits the rest of the step into kernel time and host time (the plan, the
    // uploads, sampling and read-back, and gaps between launches).
    let small = {
        let (hd, hidden) = (c.head_dim, c.hidden);
        let f = gpu.zeros::<f32>(2 * inter + qd + 2 * kvd + hidden)?;
        let h = gpu.zeros::<u16>(inter.max(hidden))?;
        let row = gpu.upload(&[0i32])?;
        let pos = gpu.upload(&[CONTEXT as i32])?;
        let slot = gpu.upload(&[(CONTEXT + 1) as i32])?;
        let (kc, vc) = b.kv_layer(0);
        let (f0, h0) = (gpu.ptr(&f), gpu.ptr(&h));
        let norm = gpu.timed(50, || {
            gpu.rms_norm_rows(f0, gpu.ptr(&row), f0, h0, 1, hidden, 1e-5)
        })?;
        let rope = gpu.timed(50, || {
            gpu.rope_qk(
                f0,
                gpu.ptr(&pos),
                f0,
                1,
                c.heads,
                c.kv_heads,
                hd,
                hd,
                qd + 2 * kvd,
            )
        })?;
        let kv = gpu.timed(50, || {
            gpu.kv_write(
                f0,
                gpu.ptr(&slot),
                kc,
                vc,
                1,
                c.kv_heads,
                hd,
                BLOCK,
                qd + 2 * kvd,
                qd,
                qd + kvd,
            )
        })?;
        let silu = gpu.timed(50, || gpu.silu_mul(f0, h0, 1, inter))?;
        let attn = attention.first().map_or(0.0, |a| a.3);
        vec![
            ("RMS norm (×2 a layer)", norm, 2 * c.layers),
            ("RoPE", rope, c.layers),
            ("KV write", kv, c.layers),
            (
                "paged attention, context 512 (and its combine)",
                attn,
                c.layers,
            ),
            ("SiLU × up", silu, c.layers),
        ]
    };

    let calibrate = |want: &str| -> Option<f64> {
        let r: Vec<&Row> = rows.iter().filter(|r| r.bound == want).collect();
        (!r.is_empty()).then(|| {
            let mut ratios: Vec<f64> = r.iter().map(|r| r.predicted_s / r.measured_s).collect();
            ratios.sort_by(f64::total_cmp);
            ratios[ratios.len() / 2]
        })
    };
    let mut md = String::new();
    md.push_str(&format!(
        "Device: {} ({}, {} multiprocessors). Model: {model_profile} shape, random Q4_0 weights widened to f16. Roofline profile: {gpu_profile}.\n\n",
        b.device_name(),
        gpu.arch(),
        gpu.multiprocessors()
    ));
    md.push_str("| step | measured | throughput | sim roofline predicts | predicted / measured | bound |\n|---|---|---|---|---|---|\n");
    for r in &rows {
        md.push_str(&format!(
            "| {} | {:.2} ms | {} | {:.2} ms | {:.2} | {} |\n",
            r.what,
            r.measured_s * 1e3,
            r.figure,
            r.predicted_s * 1e3,
            r.predicted_s / r.measured_s,
            r.bound
        ));
    }
    md.push_str(&format!(
        "\nDevice-to-device copy: {:.0} GB/s (bytes read + written).\n\n| paged attention (one layer) | partitions | time | bandwidth | of the copy's |\n|---|---|---|---|---|\n",
        copy_bw / 1e9
    ));
    for (batch, ctx, parts, s, bw) in &attention {
        md.push_str(&format!(
            "| batch {batch}, context {ctx} | {parts} | {:.1} µs | {:.0} GB/s | {:.0}% |\n",
            s * 1e6,
            bw / 1e9,
            100.0 * bw / copy_bw
        ));
    }
    md.push_str("\n| cuBLAS GEMM alone (f16 × f16 → f32) | tokens | time | weight bandwidth | of the copy's |\n|---|---|---|---|---|\n");
    for (n, name, out_f, in_f, s, bw) in &gemms {
        if *out_f == 0 {
            md.push_str(&format!(
                "| **{name}** (sum over the layers and the head) | {n} | **{:.2} ms** | | |\n",
                s * 1e3
            ));
        } else {
            md.push_str(&format!(
                "| {name} ({in_f} → {out_f}) | {n} | {:.1} µs | {:.0} GB/s | {:.0}% |\n",
                s * 1e6,
                bw / 1e9,
                100.0 * bw / copy_bw
            ));
        }
    }
    let step1 = rows.first().map_or(0.0, |r| r.measured_s);
    let gemm1 = gemms
        .iter()
        .find(|g| g.0 == 1 && g.2 == 0)
        .map_or(0.0, |g| g.4);
    md.push_str(
        "\n| batch-1 decode step, other kernels alone | each | per step | \n|---|---|---|\n",
    );
    let mut kernels_s = 0.0;
    for (name, s, times) in &small {
        kernels_s += s * *times as f64;
        md.push_str(&format!(
            "| {name} | {:.1} µs | {:.2} ms |\n",
            s * 1e6,
            s * *times as f64 * 1e3
        ));
    }
    md.push_str(&format!(
        "| **step {:.2} ms = GEMMs {:.2} + these kernels {:.2} + the rest (host, launch gaps, embedding, sampling) {:.2}** | | |\n",
        step1 * 1e3,
        gemm1 * 1e3,
        kernels_s * 1e3,
        (step1 - gemm1 - kernels_s) * 1e3
    ));
    if let Some(r) = calibrate("Memory") {
        md.push_str(&format!(
            "\nMemory-bound steps: the sim should use bandwidth efficiency {:.2} (it uses {DEFAULT_BANDWIDTH_EFFICIENCY}; predicted/measured {:.2}).\n",
            DEFAULT_BANDWIDTH_EFFICIENCY * r,
            r
        ));
    }
    if let Some(r) = calibrate("Compute") {
        md.push_str(&format!(
            "Compute-bound steps: the sim should use compute efficiency {:.2} (it uses {DEFAULT_COMPUTE_EFFICIENCY}; predicted/measured {:.2}).\n",
            DEFAULT_COMPUTE_EFFICIENCY * r,
            r
        ));
    }
    print!("{md}");
    if let Ok(path) = std::env::var("KVGATE_BENCH_OUT") {
        std::fs::write(path, &md)?;
    }
    Ok(())
}
