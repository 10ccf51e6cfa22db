//! Measures a sim replica's inter-token latency against batch size, next to the roofline's
//! prediction for the same step, to show where the curve bends and why.
//!
//! `cargo run --release -p replica --example itl_sweep -- [model] [gpu] [context]`
//! (defaults: llama-3.1-8b h100 2300). Every sequence has `context` tokens of context (a shared
//! prefix, so prefill is cheap and the sweep quick, while each sequence still reads its whole
//! context every step) and decodes 48 tokens; gaps are timed as the engine delivers them.

use std::time::Instant;

use protocol::hashing::root_hash;
use replica::engine::{EngineEvent, Submit};
use replica::profiles::{gpu, ModelProfile};
use replica::roofline::{KvDtype, Roofline};
use replica::ReplicaConfig;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).cloned().unwrap_or("llama-3.1-8b".into());
    let gpu_name = args.get(2).cloned().unwrap_or("h100".into());
    let context: usize = args.get(3).and_then(|c| c.parse().ok()).unwrap_or(2300);
    let dir = protocol::tokenizer::default_tokenizer_dir().expect("run scripts/fetch-models.sh");
    let mut cfg = ReplicaConfig::new(dir);
    cfg.model = model.clone();
    cfg.gpu = gpu_name.clone();
    cfg.max_num_seqs = 512;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = replica::build_server(cfg, listener).await.unwrap();
    let state = server.state();
    let roof = Roofline::new(
        gpu(&gpu_name).unwrap(),
        ModelProfile::resolve(&model).unwrap(),
        KvDtype::Auto,
    );
    let root = root_hash(&state.info.served_model_name, None, None);
    let decode = 48usize;
    println!("model {model} on {gpu_name}, {context} tokens of context, {decode} tokens decoded per sequence");
    println!(
        "{:>6} {:>14} {:>14} {:>10} {:>8} {:>14}",
        "batch", "measured p50", "predicted", "ratio", "bound", "cache read"
    );
    for batch in [1usize, 8, 16, 32, 48, 64, 96, 128, 160, 200, 256] {
        let mut streams = Vec::new();
        for i in 0..batch {
            let mut prompt: Vec<u32> = (0..(context - decode / 2 - 8) as u32)
                .map(|t| 1000 + t % 20_000)
                .collect();
            prompt.extend((0..8).map(|k| 30_000 + (i * 8 + k) as u32 + batch as u32 * 4096));
            streams.push(
                state
                    .engine
                    .submit(Submit {
                        prompt,
                        max_tokens: Some(decode),
                        priority: 0,
                        hash_root: root,
                        seed: Some(i as u64),
                        stop_token_ids: Vec::new(),
                        ignore_eos: true,
                        sampling: Default::default(),
                    })
                    .unwrap(),
            );
        }
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                tokio::spawn(async move {
                    let mut times = Vec::new();
                    while let Some(ev) = s.next().await {
                        times.push(Instant::now());
                        if let EngineEvent::Token {
                            finish: Some(_), ..
                        } = ev
                        {
                            break;
                        }
                    }
                    times
                })
            })
            .collect();
        let mut gaps = Vec::new();
        for t in tasks {
            let times = t.await.unwrap();
            // Skip the first gaps while the batch is still being admitted.
            for w in times.windows(2).skip(8) {
                gaps.push((w[1] - w[0]).as_secs_f64());
            }
        }
        gaps.sort_by(f64::total_cmp);
        let p50 = gaps[gaps.len() / 2];
        let c = roof.decode_cost(batch as u64, context as u64);
        println!(
            "{:>6} {:>11.2} ms {:>11.2} ms {:>10.3} {:>8} {:>13.1}%",
            batch,
            p50 * 1e3,
            c.seconds * 1e3,
            p50 / c.seconds,
            format!("{:?}", c.bound).to_lowercase(),
            100.0 * c.kv_bytes / c.bytes
        );
    }
}
