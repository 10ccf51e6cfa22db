//! The request path's questions to the prefix index, in one place: how many leading blocks of
//! a prompt each replica holds (`matched`, speculative records included), how many it has
//! itself reported (`confirmed`), how far its offload tier extends a match (`offloaded`), how
//! often the prefix it holds was reused; and what a send leaves behind (the speculative insert
//! and one reuse count). It owns the reuse counts and shares the index with the fleet, which
//! writes the replicas' events into it.
//!
//! The index's clock and trust (its slot count, the time, each replica's TTL for approximate
//! records) belong to the fleet; a lookup takes them as an [`IndexScope`].

use std::sync::Arc;

use crate::prefix::index::PrefixIndex;
use crate::prefix::reuse::PrefixReuse;
use crate::prefix::warming::Warming;

/// A prompt's blocks as the index sees them.
#[derive(Debug, Clone, Copy)]
pub struct PromptBlocks<'a> {
    /// Hashes of every full block.
    pub hashes: &'a [u64],
    /// Leading blocks a replica could serve from cache (the last prompt token is always
    /// computed).
    pub cacheable: usize,
}

impl<'a> PromptBlocks<'a> {
    fn cacheable_hashes(&self) -> &'a [u64] {
        &self.hashes[..self.cacheable.min(self.hashes.len())]
    }
}

/// The fleet's side of a lookup: replica slots, the index clock, and per replica how long
/// approximate records are trusted.
#[derive(Debug, Clone, Default)]
pub struct IndexScope {
    pub slots: usize,
    pub now_s: u32,
    pub ttls: Vec<u32>,
}

/// Prompt tokens a replica must compute when `matched_blocks` of the prompt are cached there:
/// the one formula placement, admission and the relay's timing all use.
pub fn uncached_tokens(prompt_tokens: usize, matched_blocks: usize, block_size: usize) -> u64 {
    prompt_tokens.saturating_sub(matched_blocks * block_size) as u64
}

pub struct PrefixView {
    index: Arc<PrefixIndex>,
    /// How often each matched prefix is reused (the inter-token check's amortisation).
    reuse: PrefixReuse,
    /// Prefixes with a warming request in flight (`request/warm.rs`).
    pub warming: Arc<Warming>,
}

impl PrefixView {
    pub fn new(index: Arc<PrefixIndex>) -> Self {
        PrefixView {
            index,
            reuse: PrefixReuse::default(),
            warming: Arc::default(),
        }
    }

    /// The warming claims, for a warming request's task to release.
    pub fn warming_handle(&self) -> Arc<Warming> {
        Arc::clone(&self.warming)
    }

    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// Per replica: blocks of the prompt the index believes are cached there.
    pub fn matched(&self, p: PromptBlocks<'_>, scope: &IndexScope) -> Vec<usize> {
        self.index
            .match_lengths(p.cacheable_hashes(), scope.slots, scope.now_s, &scope.ttls)
    }

    /// Per replica: leading blocks of the prompt it has itself reported cached (its KV events),
    /// without the speculative records of requests sent there.
    pub fn confirmed(&self, p: PromptBlocks<'_>, scope: &IndexScope) -> Vec<usize> {
        self.index.match_lengths(
            p.cacheable_hashes(),
            scope.slots,
            scope.now_s,
            &vec![0; scope.slots],
        )
    }

    /// Per replica: blocks after its match in `matched` that sit in its offload tier.
    pub fn offloaded(&self, p: PromptBlocks<'_>, matched: &[usize]) -> Vec<usize> {
        self.index.offloaded_lengths(p.cacheable_hashes(), matched)
    }

    /// Per replica: recent requests that reused the prefix it holds of this prompt.
    pub fn reuse(&self, p: PromptBlocks<'_>, matched: &[usize]) -> Vec<f64> {
        self.reuse.at_matches(p.cacheable_hashes(), matched)
    }

    /// The speculative index insert: the prompt's blocks are taken to be at `replica` from the
    /// moment it is sent there, until the replica's own KV events arrive (short-lived for
    /// replicas with live events, `speculative_ttl_s`), so a burst sharing a new prefix follows
    /// its first request instead of prefilling it cold on every replica. Refreshed at the first
    /// answer. *Decision*: at send, since the inter-token check (on by default) keeps a hot
    /// prefix's single holder from taking every stream; without the check, inserting at send
    /// sat agent traffic on three replicas (BENCHMARKS, issue 11).
    pub fn speculate(&self, replica: usize, p: PromptBlocks<'_>, now_s: u32) {
        self.index.record_routed(replica, p.hashes, now_s);
    }

    /// Records a request sent to `replica`: the speculative insert, and (first attempts only,
    /// with the match they were placed on) one reuse of the deepest prefix the index matched.
    pub fn sent(&self, replica: usize, p: PromptBlocks<'_>, matched: Option<&[usize]>, now_s: u32) {
        self.speculate(replica, p, now_s);
        if let Some(m) = matched {
            self.reuse.record(p.cacheable_hashes(), m);
        }
    }
}
