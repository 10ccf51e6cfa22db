//! CPU cost of one engine step (schedule + sim execute + update, KV events drained) with 256
//! running sequences of ~2,300 tokens, against the modelled GPU time of the same step. Eight sim
//! replicas share two cores only if the first is a small fraction of the second.

use criterion::{criterion_group, criterion_main, Criterion};
use replica::backend::EngineBackend;
use replica::profiles::{gpu, ModelProfile};
use replica::roofline::{KvDtype, Roofline};
use replica::scheduler::{Scheduler, SchedulerConfig, SeqRequest};
use replica::sim::SimBackend;

fn roofline() -> Roofline {
    Roofline::new(
        gpu("h100").unwrap(),
        ModelProfile::resolve("qwen3-8b").unwrap(),
        KvDtype::Auto,
    )
}

fn prompt(i: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..1000).collect();
    p.extend((0..1300).map(|t| 10_000 + (i as u32 % 256) * 1300 + t));
    p
}

fn request(id: u64) -> SeqRequest {
    SeqRequest {
        id,
        prompt: prompt(id),
        priority: 0,
        hash_root: 1,
        max_tokens: 64,
        seed: id,
        stop_token_ids: Vec::new(),
        sampling: Default::default(),
        ignore_eos: true,
    }
}

/// Steady state: 256 sequences of ~2,300 tokens (a shared 1,000-token system prompt), each
/// generating 64 tokens and replaced by a new request with the same prompt when it finishes, so
/// the batch stays at 256 and contexts stay near 2,300.
fn decoding_scheduler(backend: &mut SimBackend) -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 16,
        num_blocks: 60_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        max_model_len: 40_960,
        enable_prefix_caching: true,
        wait_for_prefix_in_flight: true,
        background_chunk_tokens: 0,
    });
    for i in 0..256u64 {
        s.add(request(i)).unwrap();
    }
    while s.num_waiting() > 0 {
        let out = s.schedule();
        let r = backend.execute(&out.items);
        s.update(&out, &r.sampled);
    }
    s.pool().lock().take_events();
    s
}

fn bench(c: &mut Criterion) {
    let mut backend = SimBackend::new(roofline(), (0..5000).collect(), None, 1.0);
    let mut sched = decoding_scheduler(&mut backend);
    assert_eq!(sched.num_running(), 256);
    let modelled = roofline().decode_cost(256, 2300).seconds;
    println!(
        "modelled H100 step for 256 x 2300 tokens: {:.2} ms",
        modelled * 1e3
    );
    let mut next_id = 256u64;
    c.bench_function("engine_step_256_running", |b| {
        b.iter(|| {
            let out = sched.schedule();
            let r = backend.execute(&out.items);
            let res = sched.update(&out, &r.sampled);
            for done in res.iter().filter(|o| o.finish.is_some()) {
                let _ = done;
                sched.add(request(next_id)).unwrap();
                next_id += 1;
            }
            sched.pool().lock().take_events()
        })
    });
    println!(
        "after the run: {} running, {} waiting, {} preemptions",
        sched.num_running(),
        sched.num_waiting(),
        sched.preemptions()
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
