//! The `cuda` backend against the `cpu` backend on a real GPU. Without a GPU these tests say
//! `skipped` and pass, unless `KVGATE_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`), which
//! makes a missing GPU a failure.
//!
//! Both backends run the same synthetic model: the GPU widens its Q4_0 blocks to f16, the CPU
//! multiplies with the same values widened to f32 (every weight is exact in f16), so what
//! differs is the arithmetic: f16 activations into the GEMMs and a different summation order.
//! "Within bf16 tolerance" is a logit error of at most 1/128 of the row's largest logit.

#![cfg(feature = "gpu")]

use std::sync::Arc;

use kernels::Format;
use replica::backend::EngineBackend;
use replica::cpu::CpuBackend;
use replica::cuda::{probe, CudaBackend, KvBlocks};
use replica::model::{synthetic, LlamaWeights};
use replica::sampling::SamplingParams;
use replica::scheduler::ScheduledItem;

const BLOCK: usize = 16;
const BLOCKS: usize = 2048;
const TOLERANCE: f32 = 1.0 / 128.0;

fn gpu_or_skip() -> bool {
    match probe() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var_os("KVGATE_REQUIRE_GPU").is_none(),
                "KVGATE_REQUIRE_GPU is set but: {e}"
            );
            eprintln!("skipped: {e}");
            false
        }
    }
}

fn model() -> LlamaWeights {
    // head_dim 64, 3 query heads per KV head (SmolLM2's shape, smaller).
    synthetic::weights(
        synthetic::config(2048, 384, 1024, 4, 6, 2, 4096),
        Format::Q4_0,
        11,
    )
}

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = replica::rng::splitmix64(x);
            (x % 2048) as u32
        })
        .collect()
}

/// Both backends over the same weights and block tables.
struct Pair {
    gpu: CudaBackend,
    cpu: CpuBackend,
    next_block: u32,
}

impl Pair {
    fn new() -> Pair {
        Pair::with(&model())
    }

    fn with(w: &LlamaWeights) -> Pair {
        let mut gpu = CudaBackend::new(0, w, BLOCK, KvBlocks::Count(BLOCKS), 4096, 128)
            .unwrap_or_else(|e| panic!("{e}"));
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut cpu =
            CpuBackend::new(Arc::new(synthetic::dequantized(w)), BLOCK, BLOCKS, threads).unwrap();
        gpu.capture_logits(true);
        cpu.capture_logits(true);
        Pair {
            gpu,
            cpu,
            next_block: 0,
        }
    }

    fn blocks(&mut self, n_tokens: usize) -> Vec<u32> {
        let n = n_tokens.div_ceil(BLOCK) as u32;
        let t = (self.next_block..self.next_block + n).collect();
        self.next_block += n;
        assert!(self.next_block as usize <= BLOCKS);
        t
    }

    /// Runs the step on both; returns (gpu, cpu) sampled tokens and logits per sampling item.
    #[allow(clippy::type_complexity)]
    fn step(
        &mut self,
        items: &[ScheduledItem],
    ) -> ((Vec<u32>, Vec<Vec<f32>>), (Vec<u32>, Vec<Vec<f32>>)) {
        let g = self.gpu.execute(items).sampled;
        let c = self.cpu.execute(items).sampled;
        let gl = self.gpu.take_logits().into_iter().map(|(_, l)| l).collect();
        let cl = self.cpu.take_logits().into_iter().map(|(_, l)| l).collect();
        ((g, gl), (c, cl))
    }
}

fn greedy() -> Arc<SamplingParams> {
    Arc::new(SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    })
}

fn item(
    seq: u64,
    tokens: &[u32],
    context: usize,
    table: &[u32],
    samples: bool,
    index: usize,
) -> ScheduledItem {
    ScheduledItem {
        seq_id: seq,
        context,
        num_tokens: tokens.len(),
        samples,
        output_index: index,
        seed: seq,
        ignore_eos: true,
        tokens: tokens.to_vec(),
        block_table: table.to_vec(),
        sampling: greedy(),
    }
}

/// The largest |gpu − cpu| over the row, relative to the row's largest |cpu| logit.
fn rel_err(g: &[f32], c: &[f32]) -> f32 {
    assert_eq!(g.len(), c.len());
    let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    g.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// Whether the GPU's greedy token equals the CPU's; a difference is allowed only at a near-tie
/// the CPU itself sees (the two tokens' logits within tolerance), else the test fails naming
/// `at`.
fn same_or_near_tie(gpu: u32, cpu: u32, cpu_row: &[f32], at: &str) -> bool {
    if gpu == cpu {
        return true;
    }
    let scale = cpu_row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let gap = (cpu_row[cpu as usize] - cpu_row[gpu as usize]).abs();
    assert!(
        gap <= TOLERANCE * scale,
        "{at}: gpu chose {gpu} and cpu {cpu} with a logit gap of {gap} (scale {scale})"
    );
    false
}

#[test]
fn logits_match_the_cpu_backend_for_ten_prompts() {
    if !gpu_or_skip() {
        return;
    }
    let mut p = Pair::new();
    let mut worst = 0f32;
    for (i, len) in [1usize, 7, 16, 17, 33, 64, 100, 160, 250, 400]
        .into_iter()
        .enumerate()
    {
        let toks = tokens(i as u64 + 1, len);
        let table = p.blocks(len);
        let ((_, g), (_, c)) = p.step(&[item(i as u64, &toks, 0, &table, true, 0)]);
        let e = rel_err(&g[0], &c[0]);
        eprintln!("prompt of {len} tokens: logit error {e:.2e} of the largest logit");
        assert!(
            e <= TOLERANCE,
            "prompt of {len} tokens: error {e} > {TOLERANCE}"
        );
        worst = worst.max(e);
    }
    eprintln!("worst logit error over ten prompts: {worst:.2e}");
}

#[test]
fn greedy_tokens_equal_the_cpus_for_32_steps() {
    if !gpu_or_skip() {
        return;
    }
    let mut p = Pair::new();
    let (mut equal, mut ties) = (0, 0);
    for s in 0..4u64 {
        let prompt = tokens(100 + s, 24 + 13 * s as usize);
        let table = p.blocks(prompt.len() + 32);
        let ((g, _), _) = p.step(&[item(s, &prompt, 0, &table, true, 0)]);
        let mut last = g[0];
        for k in 0..32 {
            let ctx = prompt.len() + k;
            // Both continue from the GPU's token, so one near-tie cannot derail the rest.
            let ((g, _), (c, cl)) = p.step(&[item(s, &[last], ctx, &table, true, k + 1)]);
            if same_or_near_tie(g[0], c[0], &cl[0], &format!("sequence {s}, step {k}")) {
                equal += 1;
            } else {
                ties += 1;
            }
            last = g[0];
        }
    }
    eprintln!("greedy: {equal} of 128 tokens equal, {ties} near-ties");
    assert!(ties <= 2, "{ties} near-ties in 128 steps");
}

#[test]
fn a_cached_prefix_gives_what_recomputing_it_gives() {
    if !gpu_or_skip() {
        return;
    }
    let mut p = Pair::new();
    // A: 64 tokens in four blocks. B: A's first 48 tokens (three blocks, cached) then 20 of its
    // own. C: B's whole prompt recomputed in fresh blocks.
    let a = tokens(7, 64);
    let a_table = p.blocks(64);
    p.step(&[item(0, &a, 0, &a_table, true, 0)]);
    let b: Vec<u32> = a[..48].iter().copied().chain(tokens(8, 20)).collect();
    let mut b_table = a_table[..3].to_vec();
    b_table.extend(p.blocks(20));
    let ((gb, cached), _) = p.step(&[item(1, &b[48..], 48, &b_table, true, 0)]);
    let c_table = p.blocks(b.len());
    let ((gc, fresh), _) = p.step(&[item(2, &b, 0, &c_table, true, 0)]);
    let e = rel_err(&cached[0], &fresh[0]);
    let identical = cached[0] == fresh[0];
    eprintln!("prefix reuse on the GPU: bit-identical {identical}, error {e:.2e}");
    assert_eq!(gb, gc, "the cached prefix changed the greedy token");
    assert!(e <= 1e-3, "cached against recomputed: error {e}");
}

#[test]
fn a_batch_of_64_mixed_prefills_and_decodes_matches_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let mut p = Pair::new();
    let mut seqs = Vec::new();
    for s in 0..64u64 {
        let len = 8 + (s as usize * 37) % 120;
        let toks = tokens(1000 + s, len);
        let table = p.blocks(len + 8);
        seqs.push((toks, table));
    }
    // First step: sequences 0..32 prefill whole, 32..64 their first half.
    let first: Vec<ScheduledItem> = seqs
        .iter()
        .enumerate()
        .map(|(s, (t, table))| {
            let n = if s < 32 { t.len() } else { t.len() / 2 };
            item(s as u64, &t[..n], 0, table, s < 32, 0)
        })
        .collect();
    let ((g1, _), _) = p.step(&first);
    // The mixed step: 32 decodes and 32 prefill chunks, each with its own context.
    let mixed: Vec<ScheduledItem> = seqs
        .iter()
        .enumerate()
        .map(|(s, (t, table))| {
            if s < 32 {
                item(s as u64, &[g1[s]], t.len(), table, true, 1)
            } else {
                let h = t.len() / 2;
                item(s as u64, &t[h..], h, table, true, 0)
            }
        })
        .collect();
    let ((_, gl), (_, cl)) = p.step(&mixed);
    assert_eq!(gl.len(), 64);
    let worst = gl
        .iter()
        .zip(&cl)
        .map(|(g, c)| rel_err(g, c))
        .fold(0f32, f32::max);
    eprintln!("64 mixed sequences in one step: worst logit error {worst:.2e}");
    assert!(worst <= TOLERANCE, "worst error {worst}");
}

#[test]
fn top_p_sampling_on_the_device_keeps_to_the_nucleus() {
    if !gpu_or_skip() {
        return;
    }
    let mut p = Pair::new();
    let prompt = tokens(5, 40);
    let table = p.blocks(40);
    p.step(&[item(0, &prompt, 0, &table, true, 0)]);
    // Each draw recomputes the last token alone; the nucleus comes from that very step's
    // logits (captured by the first draw).
    let t = 0.7f32;
    let draw = |p: &mut Pair, seed: u64| {
        let mut it = item(0, &prompt[39..], 39, &table, true, 0);
        it.sampling = Arc::new(SamplingParams {
            temperature: t,
            top_p: 0.5,
            seed,
            ..SamplingParams::default()
        });
        let tok = p.gpu.execute(std::slice::from_ref(&it)).sampled[0];
        p.cpu.take_logits();
        (tok, p.gpu.take_logits().pop().unwrap().1)
    };
    let (_, logits) = draw(&mut p, 0);
    let max = logits.iter().fold(f32::MIN, |m, &v| m.max(v));
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let w: Vec<f64> = order
        .iter()
        .map(|&i| (((logits[i] - max) / t) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut cum = 0.0;
    let mut nucleus = std::collections::HashSet::new();
    for (k, &i) in order.iter().enumerate() {
        nucleus.insert(i as u32);
        cum += w[k] / total;
        if cum >= 0.5 {
            break;
        }
    }
    let mut seen = std::collections::HashSet::new();
    for seed in 0..64u64 {
        let (tok, _) = draw(&mut p, seed);
        assert!(
            nucleus.contains(&tok),
            "seed {seed}: token {tok} outside the nucleus of {}",
            nucleus.len()
        );
        seen.insert(tok);
    }
    if nucleus.len() > 1 {
        assert!(
            seen.len() > 1,
            "64 seeds all drew the same token from a nucleus of {}",
            nucleus.len()
        );
    }
}

/// SmolLM2-135M-Instruct (the `cpu` backend's default model, Q4_1) from `$KVGATE_SMOLLM2`, or
/// `models/smollm2/` under the working directory or the repository. `None` when absent.
fn smollm2_file() -> Option<std::path::PathBuf> {
    const FILE: &str = "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    let candidates = [
        std::env::var_os("KVGATE_SMOLLM2").map(std::path::PathBuf::from),
        Some(std::path::PathBuf::from(FILE)),
        Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(FILE),
        ),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

/// The real model: the GPU runs its Q4_1 weights widened to f16, the CPU the same values in
/// f32; a chat prompt's logits within tolerance, then 64 greedy tokens equal (both continue
/// from the GPU's token; a difference is allowed only at a near-tie the CPU itself sees).
#[test]
fn smollm2_on_the_gpu_answers_as_on_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let Some(file) = smollm2_file() else {
        eprintln!("skipped: SmolLM2 is not here (scripts/fetch-models.sh, or KVGATE_SMOLLM2)");
        return;
    };
    let w = LlamaWeights::load(&file, replica::model::LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let tok = protocol::tokenizer::TextTokenizer::from_path(&file).unwrap();
    let mut p = Pair::with(&w);
    let prompts = [
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    ];
    let (mut equal, mut ties, mut worst) = (0, 0, 0f32);
    for (s, text) in prompts.iter().enumerate() {
        let prompt = tok.encode(text, false).unwrap();
        let table = p.blocks(prompt.len() + 64);
        let ((g, gl), (_, cl)) = p.step(&[item(s as u64, &prompt, 0, &table, true, 0)]);
        worst = worst.max(rel_err(&gl[0], &cl[0]));
        let mut out = vec![g[0]];
        for k in 0..63 {
            let ctx = prompt.len() + k;
            let last = *out.last().unwrap();
            let ((g, gl), (c, cl)) = p.step(&[item(s as u64, &[last], ctx, &table, true, k + 1)]);
            worst = worst.max(rel_err(&gl[0], &cl[0]));
            if same_or_near_tie(g[0], c[0], &cl[0], &format!("prompt {s}, step {k}")) {
                equal += 1;
            } else {
                ties += 1;
            }
            out.push(g[0]);
        }
        eprintln!(
            "SmolLM2 prompt {s} on the GPU: {:?}",
            tok.decode(&out, true).unwrap_or_default()
        );
    }
    eprintln!(
        "SmolLM2: {equal} of 126 greedy tokens equal, {ties} near-ties; worst logit error \
         {worst:.2e} of the row's largest logit (tolerance {TOLERANCE:.2e})"
    );
    assert!(worst <= TOLERANCE, "worst logit error {worst}");
    assert!(ties <= 2, "{ties} near-ties in 126 steps");
}
