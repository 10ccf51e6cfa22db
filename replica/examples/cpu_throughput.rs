//! Benchmark of the `cpu` backend on a model file, engine only (scheduler + backend, no HTTP):
//! prefill tokens/s, decode tokens/s at batch 1 and aggregate at batch 16, time to first token
//! for a chat prompt whose long system prompt is cached against uncached, and RSS with the
//! model loaded. Prints one JSON object; compare with `scripts/llamacpp-reference.py --bench`
//! (same file, same threads).
//!
//!   cargo run --release -p replica --example cpu_throughput -- [MODEL] [THREADS]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use protocol::tokenizer::TextTokenizer;
use replica::backend::EngineBackend;
use replica::cpu::CpuBackend;
use replica::model::{LlamaWeights, LoadOptions};
use replica::scheduler::{Scheduler, SchedulerConfig, SeqRequest};

const BS: usize = 16;

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

struct Rig {
    sched: Scheduler,
    backend: CpuBackend,
    next: u64,
}

impl Rig {
    fn new(w: &Arc<LlamaWeights>, threads: usize, budget: usize) -> Self {
        let blocks = 1024;
        Rig {
            sched: Scheduler::new(SchedulerConfig {
                block_size: BS,
                num_blocks: blocks,
                max_num_seqs: 64,
                max_num_batched_tokens: budget,
                max_model_len: 8192,
                enable_prefix_caching: true,
                wait_for_prefix_in_flight: true,
                background_chunk_tokens: 0,
            }),
            backend: CpuBackend::new(w.clone(), BS, blocks, threads).unwrap(),
            next: 1,
        }
    }

    fn add(&mut self, prompt: Vec<u32>, max_tokens: usize) {
        let id = self.next;
        self.next += 1;
        self.sched
            .add(SeqRequest::greedy(id, prompt, max_tokens, 1))
            .unwrap();
    }

    /// Runs one step; returns how many tokens were sampled.
    fn step(&mut self) -> usize {
        let plan = self.sched.schedule();
        let r = self.backend.execute(&plan.items);
        self.sched.update(&plan, &r.sampled);
        r.sampled.len()
    }

    fn drain(&mut self) {
        while self.sched.has_work() {
            self.step();
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let model = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into()),
    );
    let threads: usize = args.next().map_or(2, |t| t.parse().expect("THREADS"));
    let rss_before = rss_mib();
    let w = Arc::new(LlamaWeights::load(&model, LoadOptions::default()).expect("model loads"));
    let tok = TextTokenizer::from_path(&model).expect("tokenizer");
    let text =
        "The quick brown fox jumps over the lazy dog while the river runs to the sea. ".repeat(200);
    let ids = tok.encode(&text, false).unwrap();

    // Prefill: 1024 tokens in one step.
    let mut rig = Rig::new(&w, threads, 2048);
    rig.add(ids[..32].to_vec(), 1); // warm-up
    rig.drain();
    rig.add(ids[..1024].to_vec(), 1);
    let t = Instant::now();
    rig.step();
    let prefill = 1024.0 / t.elapsed().as_secs_f64();
    rig.drain();
    // Every weight page has been read; the KV cache holds ~1k tokens.
    let kv_mib = (1056 * CpuBackend::kv_bytes_per_token(&w, kernels::KvElement::F16)) as f64
        / (1 << 20) as f64;
    let rss_loaded = rss_mib() - rss_before;

    // Decode at batch 1 and 16: 32-token prompts, then timed decode steps.
    let mut decode = Vec::new();
    for batch in [1usize, 16] {
        let mut rig = Rig::new(&w, threads, 2048);
        let steps = 64;
        for s in 0..batch {
            let start = (s * 37) % 512;
            rig.add(ids[start..start + 32].to_vec(), steps + 2);
        }
        rig.step(); // all prefills
        rig.step();
        let t = Instant::now();
        let mut n = 0;
        for _ in 0..steps {
            n += rig.step();
        }
        decode.push(n as f64 / t.elapsed().as_secs_f64());
        rig.drain();
    }

    // TTFT of a ~1,500-token chat prompt whose ~1,400-token system prompt is cached, vs not.
    let system = format!(
        "<|im_start|>system\n{}<|im_end|>\n",
        "You answer questions about the railway timetable below. ".to_string()
            + &"Line 4 leaves the central station every twenty minutes for the harbour. "
                .repeat(90)
    );
    let sys_ids = tok.encode(&system, false).unwrap();
    let user = |q: &str| {
        tok.encode(
            &format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"),
            false,
        )
        .unwrap()
    };
    let p1: Vec<u32> = [
        sys_ids.clone(),
        user(&"When is the next train? ".repeat(10)),
    ]
    .concat();
    let p2: Vec<u32> = [sys_ids.clone(), user(&"Is there a late train? ".repeat(10))].concat();
    let mut rig = Rig::new(&w, threads, 2048);
    let t = Instant::now();
    rig.add(p1.clone(), 1);
    rig.step();
    let uncached = t.elapsed().as_secs_f64();
    rig.drain();
    let t = Instant::now();
    rig.add(p2.clone(), 1);
    rig.step();
    let cached = t.elapsed().as_secs_f64();
    rig.drain();

    println!(
        "{}",
        serde_json::json!({
            "model": model.display().to_string(),
            "threads": threads,
            "prefill_tokens_per_s": (prefill * 10.0).round() / 10.0,
            "decode_batch1_tokens_per_s": (decode[0] * 10.0).round() / 10.0,
            "decode_batch16_tokens_per_s": (decode[1] * 10.0).round() / 10.0,
            "ttft_prompt_tokens": p2.len(),
            "ttft_cached_prefix_tokens": sys_ids.len() / BS * BS,
            "ttft_uncached_ms": (uncached * 1e4).round() / 10.0,
            "ttft_cached_ms": (cached * 1e4).round() / 10.0,
            "rss_mib_after_first_prefill": rss_loaded.round(),
            "of_which_kv_cache_mib": kv_mib.round(),
            "weights_mib": w.bytes() >> 20,
        })
    );
}
