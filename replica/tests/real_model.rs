//! Correctness detectors on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF), driving
//! the scheduler and the `cpu` backend step by step, as the engine does:
//!  (a) prefix reuse is exact — logits of a request whose prefix came from the cache (written by
//!      another request, under chunked prefill, after a preemption) equal a full recomputation,
//!      bit for bit; and the detector fails when one cached block is corrupted;
//!  (b) batch invariance — a sequence's greedy output and logits are the same alone and in a
//!      batch with 15 others of different lengths.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use protocol::hashing::extend_block_hashes;
use protocol::tokenizer::TextTokenizer;
use replica::cpu::CpuBackend;
use replica::model::{LlamaWeights, LoadOptions};
use replica::scheduler::{Scheduler, SchedulerConfig, SeqId, SeqRequest};

use replica::backend::EngineBackend;

const BS: usize = 16;
const ROOT: u64 = 7;

fn model_file() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "the default model is missing ({}): run scripts/fetch-models.sh",
        p.display()
    );
    p
}

fn weights() -> Arc<LlamaWeights> {
    static W: OnceLock<Arc<LlamaWeights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(LlamaWeights::load(&model_file(), LoadOptions::default()).unwrap()))
        .clone()
}

fn tokenizer() -> &'static TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(|| TextTokenizer::from_path(&model_file()).unwrap())
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap()
}

struct Rig {
    sched: Scheduler,
    backend: CpuBackend,
}

impl Rig {
    fn new(num_blocks: usize, budget: usize, prefix_caching: bool) -> Self {
        let sched = Scheduler::new(SchedulerConfig {
            block_size: BS,
            num_blocks,
            max_num_seqs: 64,
            max_num_batched_tokens: budget,
            max_model_len: 4096,
            enable_prefix_caching: prefix_caching,
            wait_for_prefix_in_flight: true,
            background_chunk_tokens: 0,
        });
        let mut backend = CpuBackend::new(weights(), BS, num_blocks, 2).unwrap();
        backend.capture_logits(true);
        Rig { sched, backend }
    }

    fn add(&mut self, id: SeqId, prompt: Vec<u32>, max_tokens: usize) {
        self.sched
            .add(SeqRequest::greedy(id, prompt, max_tokens, ROOT))
            .unwrap();
    }

    /// Runs until idle; returns each sequence's generated tokens and the logits behind each,
    /// and the prompt tokens each found cached.
    fn run(&mut self) -> Run {
        let mut out = Run::default();
        while self.sched.has_work() {
            let plan = self.sched.schedule();
            assert!(!plan.items.is_empty(), "the scheduler stalled");
            for (id, cached) in &plan.first_scheduled {
                out.cached.insert(*id, *cached);
            }
            let step = self.backend.execute(&plan.items);
            for (id, logits) in self.backend.take_logits() {
                out.logits.entry(id).or_default().push(logits);
            }
            for o in self.sched.update(&plan, &step.sampled) {
                out.tokens.entry(o.seq_id).or_default().push(o.token);
            }
        }
        out
    }
}

#[derive(Default)]
struct Run {
    tokens: HashMap<SeqId, Vec<u32>>,
    logits: HashMap<SeqId, Vec<Vec<f32>>>,
    cached: HashMap<SeqId, usize>,
}

fn system_prompt() -> Vec<u32> {
    encode(
        "<|im_start|>system\nYou are a careful assistant for a railway company. Answer questions \
         about timetables, tickets and station facilities briefly and precisely. If you do not \
         know, say so. Never invent a train that does not exist. Prices are in euros, times \
         are local, and every answer ends with a short summary line.<|im_end|>\n",
    )
}

fn turn(question: &str) -> Vec<u32> {
    encode(&format!(
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The full recomputation of `prompt`: a fresh engine, no prefix cache, whole-prompt steps.
fn recomputed(prompt: &[u32], max_tokens: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut rig = Rig::new(512, 4096, false);
    rig.add(1, prompt.to_vec(), max_tokens);
    let mut run = rig.run();
    (
        run.tokens.remove(&1).unwrap(),
        run.logits.remove(&1).unwrap(),
    )
}

#[test]
fn prefix_reuse_is_bit_exact_and_a_corrupted_block_is_caught() {
    let sys = system_prompt();
    let first: Vec<u32> = [sys.clone(), turn("When does the first train leave?")].concat();
    let second: Vec<u32> = [sys.clone(), turn("Can I bring a bicycle on board?")].concat();
    assert!(
        sys.len() >= 3 * BS,
        "the shared prefix spans several blocks"
    );
    let (want_tokens, want_logits) = recomputed(&second, 4);

    // 1. The prefix was written by another request.
    let mut rig = Rig::new(512, 4096, true);
    rig.add(1, first.clone(), 1);
    rig.run();
    rig.add(2, second.clone(), 4);
    let run = rig.run();
    let cached = run.cached[&2];
    assert!(
        cached >= 3 * BS,
        "the second request reused the prefix ({cached} tokens)"
    );
    assert_eq!(run.tokens[&2], want_tokens);
    for (got, want) in run.logits[&2].iter().zip(&want_logits) {
        assert_eq!(
            bits(got),
            bits(want),
            "logits after a cache hit differ from recomputation"
        );
    }

    // 2. Under chunked prefill (13-token chunks, so chunks straddle blocks), and reusing the
    //    prefix the chunked request itself wrote.
    let mut rig = Rig::new(512, 13, true);
    rig.add(1, first.clone(), 1);
    rig.add(2, second.clone(), 4);
    let run = rig.run();
    assert_eq!(run.tokens[&2], want_tokens);
    for (got, want) in run.logits[&2].iter().zip(&want_logits) {
        assert_eq!(bits(got), bits(want), "logits under chunked prefill differ");
    }

    // 3. The planted fault: one cached block of the shared prefix is scribbled over, and the
    //    detector must see it.
    let mut rig = Rig::new(512, 4096, true);
    rig.add(1, first, 1);
    rig.run();
    let mut hashes = Vec::new();
    extend_block_hashes(&mut hashes, ROOT, &second, BS);
    let hit = rig.sched.pool().lock().lookup_prefix(&hashes[..2]);
    assert_eq!(hit.len(), 2, "the prefix blocks are cached");
    rig.backend.kv_cache_mut().scribble_block(hit[1] as usize);
    rig.add(2, second, 4);
    let run = rig.run();
    assert!(run.cached[&2] >= 2 * BS);
    assert_ne!(
        bits(&run.logits[&2][0]),
        bits(&want_logits[0]),
        "a corrupted cached block must change the logits"
    );
}

#[test]
fn preempted_and_recomputed_sequences_continue_exactly() {
    // A cache too small for three growing sequences: the scheduler preempts and recomputes.
    let prompts: Vec<Vec<u32>> = [
        "Write a long story about a lighthouse keeper.",
        "List every planet of the solar system with one fact each.",
        "Explain how a steam engine works, step by step.",
    ]
    .iter()
    .map(|q| [system_prompt(), turn(q)].concat())
    .collect();
    let gen = 24;
    // Room for the three prompts and one block more: growing, they must preempt each other.
    let blocks = prompts.iter().map(|p| p.len().div_ceil(BS)).sum::<usize>() + 1;
    let mut rig = Rig::new(blocks, 4096, false);
    for (i, p) in prompts.iter().enumerate() {
        rig.add(i as u64 + 1, p.clone(), gen);
    }
    let run = rig.run();
    assert!(
        rig.sched.preemptions() > 0,
        "the cache was sized to force a preemption"
    );
    for (i, p) in prompts.iter().enumerate() {
        let (tokens, logits) = recomputed(p, gen);
        let id = i as u64 + 1;
        assert_eq!(run.tokens[&id], tokens, "sequence {id} after preemption");
        for (k, (got, want)) in run.logits[&id].iter().zip(&logits).enumerate() {
            assert_eq!(bits(got), bits(want), "sequence {id}, output {k}");
        }
    }
}

#[test]
fn greedy_output_is_the_same_alone_and_in_a_batch_of_sixteen() {
    let questions = [
        "What is the capital of France? Answer in one word.",
        "Name three colours.",
        "Why is the sky blue? Explain it to a child in a few sentences, with an example.",
        "2 + 2 =",
        "Translate 'good morning' into Spanish.",
        "Write a haiku about autumn leaves falling in a quiet park at dusk.",
        "What is a prime number?",
        "Give me a synonym for happy.",
        "Summarise the plot of Romeo and Juliet in two sentences.",
        "How many legs does a spider have?",
        "What does a compiler do?",
        "Suggest a name for a cat.",
        "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
        "Hi",
        "Describe the smell of rain.",
        "Count from one to ten.",
    ];
    let prompts: Vec<Vec<u32>> = questions.iter().map(|q| turn(q)).collect();
    let lens: std::collections::HashSet<usize> = prompts.iter().map(Vec::len).collect();
    assert!(lens.len() >= 8, "prompts of many different lengths");
    let gen = 12;
    let mut batch = Rig::new(1024, 4096, true);
    for (i, p) in prompts.iter().enumerate() {
        batch.add(i as u64 + 1, p.clone(), gen);
    }
    let together = batch.run();
    for (i, p) in prompts.iter().enumerate().step_by(5) {
        let (tokens, logits) = recomputed(p, gen);
        let id = i as u64 + 1;
        assert_eq!(together.tokens[&id], tokens, "prompt {i} in a batch of 16");
        for (got, want) in together.logits[&id].iter().zip(&logits) {
            assert_eq!(bits(got), bits(want), "prompt {i}: logits in a batch");
        }
    }
}

#[test]
fn the_model_answers_a_question_it_knows() {
    let prompt = turn("What is the capital of France? Answer in one word.");
    let (tokens, _) = recomputed(&prompt, 16);
    let text = tokenizer().decode(&tokens, true).unwrap();
    assert!(text.contains("Paris"), "answer: {text:?}");
}
