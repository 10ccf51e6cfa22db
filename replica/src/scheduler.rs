//! Continuous batching: which sequences run in the next engine step, and how many tokens each.
//!
//! Every step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
//! (`max_num_seqs`). Running sequences are served first, in priority-then-arrival order:
//! decodes (one token each) before prefill chunks, so a long prompt never stalls the streams
//! already running — it is sliced into chunks that take what budget the decodes leave (chunked
//! prefill). Waiting sequences are then admitted in the same order, reusing cached prefix blocks,
//! while budget, sequence slots and free blocks last — and before the prefill chunks of running
//! sequences less important than them, so a batch-priority prompt in progress yields the step's
//! budget to an interactive arrival (its decodes do not); while more important work is present
//! a less important prompt prefills at most `background_chunk_tokens` a step. When a running sequence needs a block and
//! none is free, the least important running sequence is preempted by recompute: its blocks go
//! back to the pool (where its prefix stays cached until evicted) and it returns to the waiting
//! queue to be recomputed later. The scheduler is clock-free; the engine supplies time.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use protocol::hashing::{cacheable_prompt_blocks, extend_block_hashes};

use crate::block_manager::{BlockPool, BlockTable, PrefixStats, Tier};
use crate::sampling::SamplingParams;

pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// A prompt whose next uncached block another request is computing waits for it rather
    /// than computing it again beside it (SGLang's in-batch prefix check; vLLM has none).
    pub wait_for_prefix_in_flight: bool,
    /// Prompt tokens a request prefills per step at most while a more important one is
    /// present (a batch-class prompt beside interactive work; 0: no cap), so a step carrying
    /// it stays short and an interactive arrival waits little for it.
    pub background_chunk_tokens: usize,
}

/// What a sequence asks of the engine.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    /// Lower values are served first (vLLM's convention); FCFS within a priority.
    pub priority: i32,
    /// Root of the block-hash chain (model, LoRA, cache salt).
    pub hash_root: u64,
    pub max_tokens: usize,
    pub seed: u64,
    /// Tokens that end the sequence (the model's EOS and end-of-turn ids).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// How real backends sample; the sim ignores it.
    pub sampling: Arc<SamplingParams>,
}

impl SeqRequest {
    /// A greedy request that runs to `max_tokens` (ignores end-of-sequence): what detectors
    /// and benchmarks drive the engine with.
    pub fn greedy(id: SeqId, prompt: Vec<u32>, max_tokens: usize, hash_root: u64) -> Self {
        SeqRequest {
            id,
            prompt,
            priority: 0,
            hash_root,
            max_tokens,
            seed: id,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            sampling: Arc::new(SamplingParams {
                temperature: 0.0,
                ..Default::default()
            }),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model emitted end-of-sequence.
    Stop,
    /// `max_tokens` or the context limit was reached.
    Length,
}

#[derive(Debug)]
struct Sequence {
    req: SeqRequest,
    arrival: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    num_computed: usize,
    hashes: Vec<u64>,
    blocks: BlockTable,
    committed: usize,
    cached_tokens: Option<usize>,
    scheduled: usize,
    /// It has waited for a prefix another sequence was computing (counted once).
    waited_for_prefix: bool,
}

impl Sequence {
    fn key(&self) -> (i32, u64) {
        (self.req.priority, self.arrival)
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The hashes of the full prompt blocks not computed yet.
    fn uncomputed_prompt_blocks(&self, block_size: usize) -> impl Iterator<Item = u64> + '_ {
        let full = (self.prompt_len / block_size).min(self.hashes.len());
        let done = (self.num_computed / block_size).min(full);
        self.hashes[done..full].iter().copied()
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ScheduledItem {
    pub seq_id: SeqId,
    /// Tokens already in the cache before this step.
    pub context: usize,
    /// Tokens computed in this step.
    pub num_tokens: usize,
    /// Whether the step ends by sampling this sequence's next token.
    pub samples: bool,
    /// Index of the output token sampled (0 for the first generated token).
    pub output_index: usize,
    pub seed: u64,
    pub ignore_eos: bool,
    /// The token ids computed in this step (`num_tokens` of them, from position `context`).
    pub tokens: Vec<u32>,
    /// The sequence's KV blocks, covering `context + num_tokens` positions.
    pub block_table: Vec<u32>,
    pub sampling: Arc<SamplingParams>,
}

impl ScheduledItem {
    /// The item as the roofline model costs it.
    pub fn work(&self) -> crate::roofline::WorkItem {
        crate::roofline::WorkItem {
            context: self.context as u64,
            new_tokens: self.num_tokens as u64,
            samples: self.samples,
        }
    }
}

#[derive(Debug, Default)]
pub struct SchedulerOutput {
    pub items: Vec<ScheduledItem>,
    /// Sequences scheduled for the first time, with the prompt tokens found cached.
    pub first_scheduled: Vec<(SeqId, usize)>,
    pub preempted: Vec<SeqId>,
}

impl SchedulerOutput {
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.num_tokens).sum()
    }
}

/// A token produced for a sequence by a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqOutput {
    pub seq_id: SeqId,
    pub token: u32,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AdmitError {
    #[error("the prompt needs {needed} KV blocks but the cache holds only {total}")]
    TooLargeForCache { needed: usize, total: usize },
    #[error("a sequence with id {0} already exists")]
    DuplicateId(SeqId),
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: Arc<Mutex<BlockPool>>,
    waiting: BTreeMap<(i32, u64), Sequence>,
    running: Vec<Sequence>,
    next_arrival: u64,
    preemptions: u64,
    /// Sequences that waited for a prefix another one was computing (counted once each).
    prefix_waits: u64,
    /// The most important priority among the sequences at the last plan.
    best_present: i32,
}

fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let pool = Arc::new(Mutex::new(BlockPool::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
        )));
        Scheduler {
            cfg,
            pool,
            waiting: BTreeMap::new(),
            running: Vec::new(),
            best_present: 0,
            next_arrival: 0,
            preemptions: 0,
            prefix_waits: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &Arc<Mutex<BlockPool>> {
        &self.pool
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Tokens held by running sequences (SGLang's `num_tokens` load signal).
    pub fn num_running_tokens(&self) -> usize {
        self.running.iter().map(|s| s.tokens.len()).sum()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Sequences that waited for a prefix another one was computing, since start.
    pub fn prefix_waits(&self) -> u64 {
        self.prefix_waits
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.pool.lock().stats()
    }

    /// Queues a request. Fails only when the prompt could never fit in the whole cache.
    pub fn add(&mut self, req: SeqRequest) -> Result<(), AdmitError> {
        let needed = blocks_for(req.prompt.len() + 1, self.cfg.block_size);
        if needed > self.cfg.num_blocks {
            return Err(AdmitError::TooLargeForCache {
                needed,
                total: self.cfg.num_blocks,
            });
        }
        if self.contains(req.id) {
            return Err(AdmitError::DuplicateId(req.id));
        }
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, req.hash_root, &req.prompt, self.cfg.block_size);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let tier = Tier::of_priority(req.priority);
        let seq = Sequence {
            tokens: req.prompt.clone(),
            prompt_len: req.prompt.len(),
            req,
            arrival,
            num_computed: 0,
            hashes,
            blocks: BlockTable::new(self.pool.clone(), tier),
            committed: 0,
            cached_tokens: None,
            scheduled: 0,
            waited_for_prefix: false,
        };
        self.waiting.insert(seq.key(), seq);
        Ok(())
    }

    fn contains(&self, id: SeqId) -> bool {
        self.running.iter().any(|s| s.req.id == id) || self.waiting.values().any(|s| s.req.id == id)
    }

    /// Removes a sequence wherever it is; its blocks return to the pool at once.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            drop(self.running.swap_remove(i));
            return true;
        }
        if let Some(key) = self
            .waiting
            .iter()
            .find(|(_, s)| s.req.id == id)
            .map(|(k, _)| *k)
        {
            self.waiting.remove(&key);
            return true;
        }
        false
    }

    fn preempt(&mut self, index: usize, out: &mut SchedulerOutput) {
        let mut seq = self.running.remove(index);
        seq.blocks.release_all();
        seq.num_computed = 0;
        seq.committed = 0;
        seq.scheduled = 0;
        self.preemptions += 1;
        out.preempted.push(seq.req.id);
        self.waiting.insert(seq.key(), seq);
    }

    /// Whether a prompt waits for a prefix another is computing (prefix caching shares blocks;
    /// `wait_for_prefix_in_flight` asks for the wait).
    fn waits_for_prefixes(&self) -> bool {
        self.cfg.enable_prefix_caching && self.cfg.wait_for_prefix_in_flight
    }

    /// The hashes of the prompt blocks running sequences have still to compute: a waiting
    /// prompt that shares one waits for it (only with prefix caching, which shares them; not
    /// gathered in a step with nobody waiting).
    fn blocks_in_progress(&self) -> HashSet<u64> {
        if !self.waits_for_prefixes() || self.waiting.is_empty() {
            return HashSet::new();
        }
        self.running
            .iter()
            .flat_map(|s| s.uncomputed_prompt_blocks(self.cfg.block_size))
            .collect()
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let bs = self.cfg.block_size;
        self.running.sort_by_key(Sequence::key);
        for s in &mut self.running {
            s.scheduled = 0;
        }

        // Running sequences: decodes first, then unfinished prefills — those of a lower
        // priority than the most important waiting sequence after it is admitted, so an
        // interactive arrival's prefill never waits behind a batch prompt's chunks (their
        // decodes go on; they take what budget the admission leaves).
        let waiting_best = self.waiting.keys().next().map(|k| k.0);
        // The most important priority present: prompts less important than it prefill in
        // small chunks (`background_chunk_tokens`).
        self.best_present = self
            .running
            .iter()
            .map(|s| s.req.priority)
            .chain(waiting_best)
            .min()
            .unwrap_or(0);
        self.run_phase(true, None, &mut budget, &mut out);
        self.run_phase(false, waiting_best, &mut budget, &mut out);

        // Waiting sequences, in priority-then-arrival order; the head blocks those behind it
        // when it does not fit (FCFS), as in vLLM. A sequence whose next uncached block is
        // being computed for another one (a prompt in progress, or one admitted above) waits
        // for it instead of computing it again beside it, and does not block those behind.
        let mut in_progress = self.blocks_in_progress();
        let order: Vec<(i32, u64)> = self.waiting.keys().copied().collect();
        for key in order {
            if budget == 0 || self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let s = self.waiting.get_mut(&key).expect("keys taken above");
            let total = s.tokens.len();
            let mut pool = self.pool.lock();
            let max_hit = cacheable_prompt_blocks(total, bs).min(s.hashes.len());
            let hit = pool.lookup_prefix(&s.hashes[..max_hit]);
            if hit.len() < max_hit && in_progress.contains(&s.hashes[hit.len()]) {
                drop(pool);
                if !s.waited_for_prefix {
                    s.waited_for_prefix = true;
                    self.prefix_waits += 1;
                }
                continue;
            }
            let cached = hit.len() * bs;
            let n = (total - cached).min(budget).min(chunk_cap(
                &self.cfg,
                s.req.priority,
                self.best_present,
            ));
            let need = blocks_for(cached + n, bs) - hit.len();
            let available = pool.num_free() - pool.count_free(&hit);
            if need > available {
                break;
            }
            pool.acquire(&hit);
            let fresh = pool.allocate(need).expect("checked above");
            pool.record_lookup(total, cached);
            drop(pool);
            let committed = hit.len();
            s.blocks.push(hit);
            s.blocks.push(fresh);
            s.num_computed = cached;
            s.committed = committed;
            if s.cached_tokens.is_none() {
                s.cached_tokens = Some(cached);
                out.first_scheduled.push((s.req.id, cached));
            }
            s.scheduled = n;
            budget -= n;
            out.items.push(ScheduledItem {
                seq_id: s.req.id,
                context: cached,
                num_tokens: n,
                samples: cached + n == total,
                output_index: s.generated(),
                seed: s.req.seed,
                ignore_eos: s.req.ignore_eos,
                tokens: s.tokens[cached..cached + n].to_vec(),
                block_table: s.blocks.ids().to_vec(),
                sampling: s.req.sampling.clone(),
            });
            let seq = self.waiting.remove(&key).expect("keys taken above");
            if self.waits_for_prefixes() {
                in_progress.extend(seq.uncomputed_prompt_blocks(bs));
            }
            self.running.push(seq);
        }
        if waiting_best.is_some() {
            self.run_phase(false, None, &mut budget, &mut out);
        }
        out
    }

    /// Gives running sequences of one phase (decodes, or unfinished prefills) their tokens
    /// for this step, in priority-then-arrival order, while `budget` lasts; with
    /// `up_to_priority`, only those at least that important. Preempts by recompute when a
    /// sequence needs a block and none is free.
    fn run_phase(
        &mut self,
        decode_phase: bool,
        up_to_priority: Option<i32>,
        budget: &mut usize,
        out: &mut SchedulerOutput,
    ) {
        let bs = self.cfg.block_size;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let s = &self.running[i];
            let remaining = s.tokens.len() - s.num_computed;
            if s.scheduled > 0
                || (remaining == 1) != decode_phase
                || up_to_priority.is_some_and(|p| s.req.priority > p)
            {
                i += 1;
                continue;
            }
            let n =
                remaining
                    .min(*budget)
                    .min(chunk_cap(&self.cfg, s.req.priority, self.best_present));
            let need = blocks_for(s.num_computed + n, bs).saturating_sub(s.blocks.len());
            let mut preempted_self = false;
            loop {
                let fresh = self.pool.lock().allocate(need);
                if let Some(fresh) = fresh {
                    self.running[i].blocks.push(fresh);
                    break;
                }
                // Out of blocks: preempt the least important sequence not yet given work
                // this step, or this one if it is the least important.
                let victim = (i + 1..self.running.len())
                    .rev()
                    .find(|&j| self.running[j].scheduled == 0);
                match victim {
                    Some(j) => self.preempt(j, out),
                    None => {
                        self.preempt(i, out);
                        preempted_self = true;
                        break;
                    }
                }
            }
            if preempted_self {
                continue;
            }
            let s = &mut self.running[i];
            s.scheduled = n;
            *budget -= n;
            out.items.push(ScheduledItem {
                seq_id: s.req.id,
                context: s.num_computed,
                num_tokens: n,
                samples: s.num_computed + n == s.tokens.len(),
                output_index: s.generated(),
                seed: s.req.seed,
                ignore_eos: s.req.ignore_eos,
                tokens: s.tokens[s.num_computed..s.num_computed + n].to_vec(),
                block_table: s.blocks.ids().to_vec(),
                sampling: s.req.sampling.clone(),
            });
            i += 1;
        }
    }

    /// Applies a finished step: advances each scheduled sequence, caches newly full blocks and
    /// appends the sampled tokens (`sampled` holds one token per item with `samples`, in order).
    /// Finished sequences leave the running set and release their blocks.
    pub fn update(&mut self, out: &SchedulerOutput, sampled: &[u32]) -> Vec<SeqOutput> {
        let bs = self.cfg.block_size;
        let index: HashMap<SeqId, usize> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, s)| (s.req.id, i))
            .collect();
        let mut results = Vec::new();
        let mut finished = Vec::new();
        let mut next_sample = sampled.iter();
        {
            let mut pool = self.pool.lock();
            for item in &out.items {
                let Some(&i) = index.get(&item.seq_id) else {
                    continue;
                };
                let s = &mut self.running[i];
                s.num_computed += item.num_tokens;
                s.scheduled = 0;
                let full = s.num_computed / bs;
                while s.committed < full {
                    let k = s.committed;
                    let parent = if k == 0 { None } else { Some(s.hashes[k - 1]) };
                    pool.commit(
                        s.blocks.ids()[k],
                        s.hashes[k],
                        parent,
                        &s.tokens[k * bs..(k + 1) * bs],
                    );
                    s.committed += 1;
                }
                if !item.samples {
                    continue;
                }
                let Some(&token) = next_sample.next() else {
                    break;
                };
                s.tokens.push(token);
                extend_block_hashes(&mut s.hashes, s.req.hash_root, &s.tokens, bs);
                let finish = if !s.req.ignore_eos && s.req.stop_token_ids.contains(&token) {
                    Some(FinishReason::Stop)
                } else if s.generated() >= s.req.max_tokens
                    || s.tokens.len() >= self.cfg.max_model_len
                {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                results.push(SeqOutput {
                    seq_id: s.req.id,
                    token,
                    finish,
                    prompt_tokens: s.prompt_len,
                    cached_tokens: s.cached_tokens.unwrap_or(0),
                });
                if finish.is_some() {
                    finished.push(s.req.id);
                }
            }
        }
        if !finished.is_empty() {
            self.running.retain(|s| !finished.contains(&s.req.id));
        }
        results
    }
}

#[cfg(test)]
mod tests;

/// The most prompt tokens a sequence of `priority` prefills in one step under `cfg`, while
/// the most important priority present is `best`.
fn chunk_cap(cfg: &SchedulerConfig, priority: i32, best: i32) -> usize {
    match cfg.background_chunk_tokens {
        n if n > 0 && priority > best => n,
        _ => usize::MAX,
    }
}
