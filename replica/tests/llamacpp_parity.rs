//! Detector (c): parity with llama.cpp on the same GGUF file. For ten fixed chat prompts the
//! reference (`replica/tests/data/llamacpp_smollm2.json`, written by
//! `scripts/llamacpp-reference.py` with the llama-cpp-python version it records) holds
//! llama.cpp's prompt token ids, its first 32 greedy tokens and its five largest logits at each
//! step. kvgate must tokenise the prompts identically and produce the same greedy tokens.
//!
//! The two engines do not round identically (llama.cpp rounds attention operands to f16 and
//! quantises activations with its own SIMD rounding), and at this model's scale such rounding
//! moves logits by a few tenths: llama.cpp itself, with flash attention on instead of off,
//! moves the first-token logits of these prompts by up to 0.26. So the test holds kvgate's top
//! logit to within `LOGIT_TOLERANCE` of llama.cpp's where both pick the same token, and where
//! the greedy choice differs it requires a near-tie: llama.cpp's own logits put kvgate's token
//! within `NEAR_TIE` of its choice. After a divergence the contexts differ, so the comparison
//! of that prompt stops. Measured on the committed reference: 3 of 10 prompts identical for 32
//! tokens, the others diverge at gaps of 0.004 to 0.118 (see the test's output for the
//! current figures).

use std::path::PathBuf;
use std::sync::Arc;

use protocol::tokenizer::TextTokenizer;
use replica::backend::EngineBackend;
use replica::cpu::CpuBackend;
use replica::model::{LlamaWeights, LoadOptions};
use replica::scheduler::{Scheduler, SchedulerConfig, SeqRequest};
use serde_json::Value;

/// The largest logit gap (in llama.cpp's logits) at which a different greedy choice counts
/// as a near-tie rather than a bug.
const NEAR_TIE: f64 = 0.25;
/// How far kvgate's top logit may sit from llama.cpp's at steps where both agree.
const LOGIT_TOLERANCE: f64 = 0.75;
/// Prompts that must match for all 32 tokens. Which prompts hit a near-tie is down to rounding
/// (a kernel change that kept every result within 1e-6 moved the count from 5 to 3), so this
/// only guards against a model that is wrong everywhere; the near-tie rule does the real work.
const MIN_IDENTICAL: usize = 2;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn greedy_tokens_match_llama_cpp_on_the_same_file() {
    let model = root().join("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.is_file(), "run scripts/fetch-models.sh");
    let data_path = root().join("replica/tests/data/llamacpp_smollm2.json");
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(&data_path)
            .expect("the llama.cpp reference is committed (scripts/llamacpp-reference.py)"),
    )
    .unwrap();
    let tok = TextTokenizer::from_path(&model).unwrap();
    let w = Arc::new(LlamaWeights::load(&model, LoadOptions::default()).unwrap());
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 10);
    let steps = data["steps"].as_u64().unwrap() as usize;

    // All ten prompts run as one batch (batch invariance makes that the same as one by one).
    let blocks = 1024;
    let mut sched = Scheduler::new(SchedulerConfig {
        block_size: 16,
        num_blocks: blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 4096,
        max_model_len: 2048,
        enable_prefix_caching: true,
        wait_for_prefix_in_flight: true,
        background_chunk_tokens: 0,
    });
    let mut backend = CpuBackend::new(w, 16, blocks, 2).unwrap();
    backend.capture_logits(true);
    for (i, c) in cases.iter().enumerate() {
        let ids: Vec<u32> = tok.encode(c["prompt"].as_str().unwrap(), false).unwrap();
        let want: Vec<u32> = c["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ids, want,
            "prompt {i}: tokenisation differs from llama.cpp's"
        );
        sched
            .add(SeqRequest::greedy(i as u64, ids, steps, 1))
            .unwrap();
    }
    let mut ours: Vec<Vec<(u32, f32)>> = vec![Vec::new(); cases.len()];
    while sched.has_work() {
        let plan = sched.schedule();
        let r = backend.execute(&plan.items);
        let logits = backend.take_logits();
        for (o, (id, l)) in sched.update(&plan, &r.sampled).iter().zip(logits) {
            assert_eq!(o.seq_id, id);
            ours[id as usize].push((o.token, l[o.token as usize]));
        }
    }

    let mut exact = 0;
    let mut worst = 0f64;
    let mut report = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let theirs: Vec<u32> = c["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let tops = c["top_logits"].as_array().unwrap();
        let mut same = 0;
        for (k, (&(mine, my_logit), &their)) in ours[i].iter().zip(&theirs).enumerate() {
            let top: Vec<(u32, f64)> = tops[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap()))
                .collect();
            if mine == their {
                let d = (my_logit as f64 - top[0].1).abs();
                worst = worst.max(d);
                assert!(
                    d <= LOGIT_TOLERANCE,
                    "prompt {i} step {k}: top logit {my_logit} vs llama.cpp's {} (|Δ| {d:.3})",
                    top[0].1
                );
                same += 1;
                continue;
            }
            let gap = top
                .iter()
                .find(|(t, _)| *t == mine)
                .map(|(_, l)| top[0].1 - l)
                .unwrap_or_else(|| {
                    panic!(
                        "prompt {i} step {k}: kvgate chose {mine}, not among llama.cpp's top five {top:?}"
                    )
                });
            assert!(
                gap <= NEAR_TIE,
                "prompt {i} step {k}: kvgate chose {mine} where llama.cpp's logits put it {gap:.3} below {their}"
            );
            report.push(format!("prompt {i} diverges at step {k} (gap {gap:.3})"));
            break;
        }
        if same == steps {
            exact += 1;
        }
    }
    eprintln!(
        "{exact} of {} prompts identical for {steps} tokens; largest top-logit difference {worst:.3}; {report:?}",
        cases.len()
    );
    assert!(
        exact >= MIN_IDENTICAL,
        "only {exact} of 10 prompts match llama.cpp exactly: {report:?}"
    );
}
