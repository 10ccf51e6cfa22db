use super::*;
use crate::profiles::{gpu, ModelProfile};
use crate::roofline::{KvDtype, Roofline, WorkItem};

fn cfg(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 64,
        max_num_batched_tokens: 64,
        max_model_len: 100_000,
        enable_prefix_caching: true,
        wait_for_prefix_in_flight: true,
        background_chunk_tokens: 0,
    }
}

fn req(id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> SeqRequest {
    SeqRequest {
        id,
        prompt,
        priority: 0,
        hash_root: 42,
        max_tokens,
        seed: id,
        stop_token_ids: Vec::new(),
        sampling: Default::default(),
        ignore_eos: true,
    }
}

/// Deterministic stand-in for a backend's sampler.
fn token_for(item: &ScheduledItem) -> u32 {
    1000 + (item.seed as u32) * 100 + item.output_index as u32
}

fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<SeqOutput>) {
    let out = s.schedule();
    let sampled: Vec<u32> = out
        .items
        .iter()
        .filter(|i| i.samples)
        .map(token_for)
        .collect();
    let res = s.update(&out, &sampled);
    (out, res)
}

fn run_to_completion(s: &mut Scheduler) -> HashMap<SeqId, Vec<u32>> {
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    for _ in 0..10_000 {
        if !s.has_work() {
            break;
        }
        let (_, res) = step(s);
        for r in res {
            got.entry(r.seq_id).or_default().push(r.token);
        }
    }
    assert!(!s.has_work(), "did not finish");
    got
}

#[test]
fn reuses_cached_prefix_across_requests() {
    let mut s = Scheduler::new(cfg(64));
    let shared: Vec<u32> = (0..32).collect();
    let mut a = shared.clone();
    a.extend([500, 501, 502]);
    s.add(req(1, a, 3)).unwrap();
    run_to_completion(&mut s);
    let mut b = shared.clone();
    b.extend([600, 601]);
    s.add(req(2, b, 2)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.first_scheduled, vec![(2, 32)]);
    assert_eq!(out.items[0].context, 32);
    assert_eq!(out.items[0].num_tokens, 2);
    let st = s.prefix_stats();
    assert_eq!(st.query_tokens, 35 + 34);
    assert_eq!(st.hit_tokens, 32);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut s = Scheduler::new(cfg(64));
    let p: Vec<u32> = (0..16).collect();
    s.add(req(1, p.clone(), 1)).unwrap();
    run_to_completion(&mut s);
    s.add(req(2, p, 1)).unwrap();
    let (out, res) = step(&mut s);
    assert_eq!(out.first_scheduled, vec![(2, 12)]);
    assert_eq!(res[0].cached_tokens, 12);
}

#[test]
fn preemption_frees_blocks_and_later_recomputes_identically() {
    // Reference run with plenty of blocks.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (i * 100..i * 100 + 10).collect()).collect();
    let mut big = Scheduler::new(cfg(256));
    for (i, p) in prompts.iter().enumerate() {
        big.add(req(i as u64 + 1, p.clone(), 30)).unwrap();
    }
    let expected = run_to_completion(&mut big);
    assert_eq!(big.preemptions(), 0);

    // Four sequences growing to 40 tokens need 40 blocks; give them 24.
    let mut small = Scheduler::new(cfg(24));
    for (i, p) in prompts.iter().enumerate() {
        small.add(req(i as u64 + 1, p.clone(), 30)).unwrap();
    }
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut saw_preemption = false;
    while small.has_work() {
        let (out, res) = step(&mut small);
        if !out.preempted.is_empty() {
            saw_preemption = true;
            // The victim's blocks went back: every block in use belongs to a running sequence.
            let pool = small.pool().lock();
            let in_use: usize = small.running.iter().map(|s| s.blocks.len()).sum();
            assert!(pool.num_in_use() <= in_use);
        }
        for r in res {
            got.entry(r.seq_id).or_default().push(r.token);
        }
    }
    assert!(saw_preemption);
    assert!(small.preemptions() > 0);
    assert_eq!(
        got, expected,
        "recompute resumes each sequence where it stopped"
    );
    assert_eq!(small.pool().lock().num_in_use(), 0);
}

#[test]
fn abort_returns_blocks_at_once() {
    let mut s = Scheduler::new(cfg(16));
    s.add(req(1, (0..20).collect(), 100)).unwrap();
    step(&mut s);
    assert!(s.pool().lock().num_in_use() > 0);
    assert!(s.abort(1));
    assert_eq!(s.pool().lock().num_in_use(), 0);
    assert!(!s.abort(1));
    // Waiting sequences can be aborted too.
    s.add(req(2, (0..20).collect(), 1)).unwrap();
    assert!(s.abort(2));
    assert!(!s.has_work());
}

#[test]
fn priority_then_arrival_orders_admission() {
    let mut c = cfg(64);
    c.max_num_seqs = 1;
    let mut s = Scheduler::new(c);
    let mut low = req(1, vec![1, 2, 3], 1);
    low.priority = 5;
    s.add(low).unwrap();
    s.add(req(2, vec![4, 5, 6], 1)).unwrap();
    s.add(req(3, vec![7, 8, 9], 1)).unwrap();
    let mut order = Vec::new();
    while s.has_work() {
        let (out, _) = step(&mut s);
        order.extend(out.first_scheduled.iter().map(|(id, _)| *id));
    }
    assert_eq!(order, vec![2, 3, 1]);
}

#[test]
fn respects_token_budget_and_sequence_cap() {
    let mut c = cfg(256);
    c.max_num_seqs = 3;
    c.max_num_batched_tokens = 10;
    let mut s = Scheduler::new(c);
    for i in 0..5 {
        s.add(req(i, (0..8).collect(), 4)).unwrap();
    }
    for _ in 0..50 {
        if !s.has_work() {
            break;
        }
        let (out, _) = step(&mut s);
        assert!(out.num_tokens() <= 10);
        assert!(s.num_running() <= 3);
    }
}

#[test]
fn rejects_prompts_larger_than_the_cache() {
    let mut s = Scheduler::new(cfg(4));
    let e = s.add(req(1, (0..16).collect(), 1)).unwrap_err();
    assert_eq!(
        e,
        AdmitError::TooLargeForCache {
            needed: 5,
            total: 4
        }
    );
}

/// The runbook's first failure mode: one 50k-token prompt must not freeze running streams.
/// With chunked prefill every running decode gets a token in every step while the long prompt
/// prefills, and each step stays short on the sim clock (8B model on an H100).
#[test]
fn chunked_prefill_keeps_every_decode_progressing() {
    let roof = Roofline::new(
        gpu("h100").unwrap(),
        ModelProfile::resolve("llama-3.1-8b").unwrap(),
        KvDtype::Auto,
    );
    let mut s = Scheduler::new(SchedulerConfig {
        block_size: 16,
        num_blocks: 20_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
        background_chunk_tokens: 0,
        max_model_len: 131_072,
        enable_prefix_caching: true,
        wait_for_prefix_in_flight: true,
    });
    for i in 0..16 {
        s.add(req(
            i,
            (0..500).map(|t| t + i as u32 * 1000).collect(),
            10_000,
        ))
        .unwrap();
    }
    // Bring the 16 short requests into decode.
    let mut clock = 0.0;
    while s.running.iter().any(|q| q.num_computed < q.prompt_len) || s.num_waiting() > 0 {
        let (out, _) = step(&mut s);
        clock += cost(&roof, &out);
    }
    s.add(req(99, (0..50_000).map(|t| t % 30_000 + 7).collect(), 1))
        .unwrap();
    let start = clock;
    let mut steps = 0;
    let mut max_step: f64 = 0.0;
    loop {
        let (out, res) = step(&mut s);
        let dt = cost(&roof, &out);
        clock += dt;
        max_step = max_step.max(dt);
        steps += 1;
        let decodes: Vec<_> = out.items.iter().filter(|i| i.seq_id != 99).collect();
        assert_eq!(
            decodes.len(),
            16,
            "every running decode is scheduled in step {steps}"
        );
        assert!(decodes.iter().all(|i| i.num_tokens == 1));
        let long = out
            .items
            .iter()
            .find(|i| i.seq_id == 99)
            .expect("prefill chunk");
        assert!(long.num_tokens <= 2048 - 16);
        if res.iter().any(|r| r.seq_id == 99) {
            break;
        }
    }
    assert_eq!(steps, 50_000usize.div_ceil(2048 - 16));
    // A chunk of ~2k tokens costs ~0.1 s of H100 time; the whole prompt in one step would
    // have frozen every stream for seconds.
    assert!(max_step < 0.2, "longest step {max_step}");
    let unchunked = roof.step_cost(&[WorkItem {
        context: 0,
        new_tokens: 50_000,
        samples: true,
    }]);
    assert!(unchunked.seconds > 2.0, "{}", unchunked.seconds);
    assert!(
        clock - start > unchunked.seconds,
        "chunking costs the long prompt a little time"
    );
}

fn cost(roof: &Roofline, out: &SchedulerOutput) -> f64 {
    let items: Vec<WorkItem> = out.items.iter().map(ScheduledItem::work).collect();
    roof.step_cost(&items).seconds
}

#[test]
fn a_more_important_arrival_prefills_ahead_of_a_less_important_prompt_in_progress() {
    // Budget 64 tokens a step; a 200-token batch prompt is chunked over several steps.
    let mut s = Scheduler::new(cfg(256));
    let mut batch = req(1, (0..200).collect(), 1);
    batch.priority = 1;
    s.add(batch).unwrap();
    let (first, _) = step(&mut s);
    assert_eq!(first.items[0].num_tokens, 64);
    // An interactive request arrives mid-prompt: the next step is its whole prefill first.
    s.add(req(2, (1000..1040).collect(), 1)).unwrap();
    let (next, _) = step(&mut s);
    assert_eq!(next.items[0].seq_id, 2, "{:?}", next.items);
    assert_eq!(next.items[0].num_tokens, 40);
    // The batch prompt takes what is left of the budget, and goes on after.
    assert_eq!(next.items[1].seq_id, 1);
    assert_eq!(next.items[1].num_tokens, 24);
    // With equal priorities the prompt in progress keeps its place (FCFS as before).
    let mut s = Scheduler::new(cfg(256));
    s.add(req(1, (0..200).collect(), 1)).unwrap();
    step(&mut s);
    s.add(req(2, (1000..1040).collect(), 1)).unwrap();
    let (next, _) = step(&mut s);
    assert_eq!((next.items[0].seq_id, next.items[0].num_tokens), (1, 64));
}

#[test]
fn a_background_prompt_prefills_in_small_chunks() {
    let mut c = cfg(256);
    c.background_chunk_tokens = 16;
    let mut s = Scheduler::new(c);
    let mut batch = req(1, (0..40).collect(), 1);
    batch.priority = 1;
    s.add(batch).unwrap();
    s.add(req(2, (100..140).collect(), 1)).unwrap();
    let (out, _) = step(&mut s);
    let tokens: Vec<_> = out.items.iter().map(|i| (i.seq_id, i.num_tokens)).collect();
    // The interactive prompt takes the budget it needs; the background one at most 16.
    assert_eq!(tokens, [(2, 40), (1, 16)]);
}

/// A burst's followers wait for the shared prefix the first request is computing (SGLang's
/// in-batch prefix check), so it is prefilled once, and a request behind them that shares
/// nothing is not held up.
#[test]
fn a_prompt_waits_for_the_prefix_another_is_computing_and_holds_nobody_up() {
    // Budget 64 tokens a step, blocks of 4: a 200-token shared prefix takes four steps.
    let shared: Vec<u32> = (0..200).collect();
    let with_tail =
        |tail: u32| -> Vec<u32> { shared.iter().copied().chain(tail..tail + 8).collect() };
    let mut s = Scheduler::new(cfg(1024));
    s.add(req(1, with_tail(1000), 2)).unwrap();
    let (first, _) = step(&mut s);
    assert_eq!(first.num_tokens(), 64);
    // Two followers of the same prefix and an unrelated prompt arrive mid-prefill.
    s.add(req(2, with_tail(2000), 2)).unwrap();
    s.add(req(3, with_tail(3000), 2)).unwrap();
    s.add(req(4, (5000..5048).collect(), 2)).unwrap();
    let mut computed: HashMap<SeqId, usize> = HashMap::new();
    let mut first_cached: HashMap<SeqId, usize> = HashMap::new();
    let (mut unrelated_at, mut leader_done_at) = (None, None);
    for n in 0.. {
        if !s.has_work() {
            break;
        }
        let (out, res) = step(&mut s);
        for it in &out.items {
            *computed.entry(it.seq_id).or_default() += it.num_tokens;
        }
        first_cached.extend(out.first_scheduled.iter().copied());
        if out.items.iter().any(|i| i.seq_id == 4) {
            unrelated_at.get_or_insert(n);
        }
        if res.iter().any(|r| r.seq_id == 1) {
            leader_done_at.get_or_insert(n);
        }
    }
    // The budget the leader's last chunk leaves goes to the unrelated prompt behind the
    // waiting followers: they do not block the queue.
    assert!(
        unrelated_at <= leader_done_at,
        "{unrelated_at:?} {leader_done_at:?}"
    );
    // Each follower found the whole shared prefix cached and computed only its own tail.
    for id in [2, 3] {
        assert_eq!(first_cached[&id], 200, "follower {id}");
        assert_eq!(
            computed[&id],
            8 + 2 - 1,
            "follower {id} computed the prefix again"
        );
    }
    assert_eq!(s.prefix_waits(), 2);

    // Off (as vLLM), the follower is admitted as soon as the budget allows, beside the
    // leader's last chunk, and computes again the shared blocks not done yet.
    let mut c = cfg(1024);
    c.wait_for_prefix_in_flight = false;
    let mut s = Scheduler::new(c);
    s.add(req(1, with_tail(1000), 2)).unwrap();
    step(&mut s);
    s.add(req(2, with_tail(2000), 2)).unwrap();
    let mut cached = None;
    while s.has_work() {
        let (out, _) = step(&mut s);
        cached = cached.or(out.first_scheduled.iter().find(|f| f.0 == 2).map(|f| f.1));
    }
    assert!(cached.is_some_and(|c| c < 200), "{cached:?}");
    assert_eq!(s.prefix_waits(), 0);
    // Nor does a prompt admitted in the same step as the first wait for it.
    let mut c = cfg(1024);
    c.wait_for_prefix_in_flight = false;
    c.max_num_batched_tokens = 1024;
    let mut s = Scheduler::new(c);
    s.add(req(1, with_tail(1000), 2)).unwrap();
    s.add(req(2, with_tail(2000), 2)).unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.items.len(), 2, "{:?}", out.items);
    assert_eq!(s.prefix_waits(), 0);
}
