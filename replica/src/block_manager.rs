//! Paged KV blocks with prefix caching.
//!
//! The pool owns `num_blocks` blocks of `block_size` tokens. A block that holds a full, computed
//! block of some sequence carries that block's chained hash (from `protocol::hashing`) and is
//! findable by it. Blocks are reference-counted: a block in use by any sequence is never reused.
//! When its last user lets go it joins the free list but keeps its contents and hash — a later
//! request with the same prefix takes it back — and is evicted (hash dropped, `BlockRemoved`
//! emitted) only when a fresh block is needed and it is the least recently freed. A sequence
//! frees its blocks last-first, so the tail of a prefix is evicted before its head, as in vLLM.
//!
//! Unlike vLLM, free blocks wait in two tiers, each least-recently-freed first, and the
//! [`Tier::Background`] one is evicted before any block of the [`Tier::Foreground`] one. A block
//! joins the foreground tier once a foreground (interactive) sequence has let go of it since it
//! was handed out fresh; blocks only background (batch) sequences used, and blocks that hold no
//! hash, join the background tier. So a batch job streaming thousands of one-off prompts through
//! a replica evicts its own leftovers, not the conversations the replica's interactive traffic
//! will come back to (BENCHMARKS, issue 33: with one LRU list, follow-up turns lost their cached
//! prefix and were prefilled cold while a batch ran).
//!
//! Sequences hold their blocks through a [`BlockTable`], which returns them on drop (RAII).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use protocol::kv_events::KvEvent;

pub type BlockId = u32;
const NIL: u32 = u32::MAX;

/// Which free list a released block joins: background blocks are evicted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Foreground,
    Background,
}

impl Tier {
    /// The tier of a request of engine `priority` (vLLM's convention: lower is served first;
    /// 0 is the default, and kvgate's batch route sends 1): above 0 is background.
    pub fn of_priority(priority: i32) -> Self {
        if priority > 0 {
            Tier::Background
        } else {
            Tier::Foreground
        }
    }

    fn index(self) -> usize {
        match self {
            Tier::Background => 0,
            Tier::Foreground => 1,
        }
    }
}

#[derive(Debug, Clone)]
struct Block {
    hash: Option<u64>,
    ref_count: u32,
    prev: u32,
    next: u32,
    /// The free list it is in, if any.
    free_in: Option<Tier>,
    /// A foreground sequence has released it since it was last handed out fresh.
    foreground: bool,
}

/// One doubly linked free list (through `Block::prev`/`next`), least recently freed at `head`.
#[derive(Debug, Clone, Copy)]
struct FreeList {
    head: u32,
    tail: u32,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            head: NIL,
            tail: NIL,
        }
    }
}

/// Token counters for the prefix cache: queried prompt tokens and those found cached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub query_tokens: u64,
    pub hit_tokens: u64,
}

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Indexed by [`Tier::index`]: background first, the order of eviction.
    free: [FreeList; 2],
    free_len: usize,
    cached: HashMap<u64, BlockId>,
    pending: Vec<KvEvent>,
    stats: PrefixStats,
    caching: bool,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        assert!(num_blocks < NIL as usize, "too many blocks");
        let mut pool = BlockPool {
            block_size,
            blocks: vec![
                Block {
                    hash: None,
                    ref_count: 0,
                    prev: NIL,
                    next: NIL,
                    free_in: None,
                    foreground: false,
                };
                num_blocks
            ],
            free: [FreeList::default(); 2],
            free_len: 0,
            cached: HashMap::new(),
            pending: Vec::new(),
            stats: PrefixStats::default(),
            caching: enable_prefix_caching,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free_tail(id, Tier::Background);
        }
        pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, whether or not they still hold cached data).
    pub fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_in_use(&self) -> usize {
        self.blocks.len() - self.free_len
    }

    /// Fraction of blocks in use by running sequences (the KV cache usage gauge).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            self.num_in_use() as f64 / self.blocks.len() as f64
        }
    }

    /// Blocks that hold a cached prefix block (in use or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_count
    }

    pub fn hash_of(&self, id: BlockId) -> Option<u64> {
        self.blocks[id as usize].hash
    }

    fn push_free_tail(&mut self, id: u32, tier: Tier) {
        let list = &mut self.free[tier.index()];
        let tail = list.tail;
        list.tail = id;
        if tail == NIL {
            list.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.free_in.is_none());
        b.free_in = Some(tier);
        b.prev = tail;
        b.next = NIL;
        self.free_len += 1;
    }

    fn unlink_free(&mut self, id: u32) {
        let (prev, next, tier) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next, b.free_in.expect("block is not free"))
        };
        let list = &mut self.free[tier.index()];
        if prev == NIL {
            list.head = next;
        }
        if next == NIL {
            list.tail = prev;
        }
        if prev != NIL {
            self.blocks[prev as usize].next = next;
        }
        if next != NIL {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.free_in = None;
        b.prev = NIL;
        b.next = NIL;
        self.free_len -= 1;
    }

    /// The block evicted next: the least recently freed of the background tier, else of the
    /// foreground one.
    fn next_victim(&self) -> u32 {
        self.free
            .iter()
            .map(|l| l.head)
            .find(|&h| h != NIL)
            .unwrap_or(NIL)
    }

    /// The longest run of leading `hashes` that are cached, as block ids. Read-only.
    pub fn lookup_prefix(&self, hashes: &[u64]) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `ids` are currently free (taking them shrinks the free list).
    pub fn count_free(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id as usize].ref_count == 0)
            .count()
    }

    /// Takes a reference on cached blocks found by [`lookup_prefix`](Self::lookup_prefix).
    pub fn acquire(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].ref_count == 0 {
                self.unlink_free(id);
            }
            self.blocks[id as usize].ref_count += 1;
        }
    }

    /// Records a prefix-cache lookup of `query` prompt tokens of which `hit` were cached.
    pub fn record_lookup(&mut self, query: usize, hit: usize) {
        self.stats.query_tokens += query as u64;
        self.stats.hit_tokens += hit as u64;
    }

    /// Hands out `n` fresh blocks, evicting the least recently freed cached ones, background
    /// tier first; `None` (and nothing changed) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.next_victim();
            self.unlink_free(id);
            self.blocks[id as usize].foreground = false;
            if let Some(h) = self.blocks[id as usize].hash.take() {
                if self.cached.get(&h) == Some(&id) {
                    self.cached.remove(&h);
                    self.emit_removed(h);
                }
            }
            self.blocks[id as usize].ref_count = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference on each block, last block first, so a sequence's tail is evicted
    /// before its head. `by` is the releasing sequence's tier: a block a foreground sequence
    /// used joins the foreground free list when its last user lets go.
    pub fn release(&mut self, ids: &[BlockId], by: Tier) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            assert!(b.ref_count > 0, "double release of block {id}");
            b.ref_count -= 1;
            b.foreground |= by == Tier::Foreground;
            if b.ref_count == 0 {
                let tier = if b.foreground && b.hash.is_some() {
                    Tier::Foreground
                } else {
                    Tier::Background
                };
                self.push_free_tail(id, tier);
            }
        }
    }

    /// Marks block `id` as holding the full block `hash` (child of `parent`, tokens `tokens`),
    /// making it findable. A block whose hash another block already holds stays anonymous.
    pub fn commit(&mut self, id: BlockId, hash: u64, parent: Option<u64>, tokens: &[u32]) {
        if !self.caching || self.blocks[id as usize].hash.is_some() {
            return;
        }
        if self.cached.contains_key(&hash) {
            return;
        }
        self.blocks[id as usize].hash = Some(hash);
        self.cached.insert(hash, id);
        // Consecutive blocks of one chain travel in one event, as vLLM sends them.
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        }) = self.pending.last_mut()
        {
            if parent.is_some() && block_hashes.last().copied() == parent {
                block_hashes.push(hash);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.pending.push(KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: self.block_size as u32,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        });
    }

    fn emit_removed(&mut self, hash: u64) {
        if let Some(KvEvent::BlockRemoved { block_hashes, .. }) = self.pending.last_mut() {
            block_hashes.push(hash);
            return;
        }
        self.pending.push(KvEvent::BlockRemoved {
            block_hashes: vec![hash],
            medium: Some("GPU".into()),
        });
    }

    /// Forgets every cached block no sequence holds (SGLang's `/flush_cache`): their hashes are
    /// dropped and reported removed; blocks in use keep theirs. Returns how many were dropped.
    pub fn flush_cached(&mut self) -> usize {
        let mut dropped = 0;
        for list in self.free {
            let mut id = list.head;
            while id != NIL {
                let next = self.blocks[id as usize].next;
                if let Some(h) = self.blocks[id as usize].hash.take() {
                    if self.cached.get(&h) == Some(&id) {
                        self.cached.remove(&h);
                        self.emit_removed(h);
                        dropped += 1;
                    }
                }
                id = next;
            }
        }
        dropped
    }

    /// Events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.pending)
    }
}

/// A sequence's blocks; returned to the pool when dropped.
#[derive(Debug)]
pub struct BlockTable {
    pool: Arc<Mutex<BlockPool>>,
    ids: Vec<BlockId>,
    tier: Tier,
}

impl BlockTable {
    /// An empty table for a sequence of `tier`, which decides where its blocks wait when freed.
    pub fn new(pool: Arc<Mutex<BlockPool>>, tier: Tier) -> Self {
        BlockTable {
            pool,
            ids: Vec::new(),
            tier,
        }
    }

    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn push(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        self.ids.extend(ids);
    }

    /// Returns every block now (preemption, cancellation); the table stays usable.
    pub fn release_all(&mut self) {
        if !self.ids.is_empty() {
            let ids = std::mem::take(&mut self.ids);
            self.pool.lock().release(&ids, self.tier);
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(n, 4, true)
    }

    #[test]
    fn reuses_cached_prefix_blocks_after_release() {
        let mut p = pool(4);
        let a = p.allocate(2).unwrap();
        p.commit(a[0], 10, None, &[1, 2, 3, 4]);
        p.commit(a[1], 11, Some(10), &[5, 6, 7, 8]);
        p.release(&a, Tier::Foreground);
        assert_eq!(p.num_free(), 4);
        let hit = p.lookup_prefix(&[10, 11, 12]);
        assert_eq!(hit, a);
        assert_eq!(p.count_free(&hit), 2);
        p.acquire(&hit);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.ref_count(a[0]), 1);
        // Both blocks of the chain travel in one BlockStored event.
        let ev = p.take_events();
        assert_eq!(ev.len(), 1);
        match &ev[0] {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => {
                assert_eq!(block_hashes, &vec![10, 11]);
                assert_eq!(*parent_block_hash, None);
                assert_eq!(token_ids.len(), 8);
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn flush_drops_free_cached_blocks_only() {
        let pool = Arc::new(Mutex::new(BlockPool::new(8, 4, true)));
        let mut p = pool.lock();
        let kept = p.allocate(1).unwrap();
        let gone = p.allocate(2).unwrap();
        p.commit(kept[0], 1, None, &[1, 2, 3, 4]);
        p.commit(gone[0], 2, None, &[5, 6, 7, 8]);
        p.commit(gone[1], 3, Some(2), &[9, 10, 11, 12]);
        p.release(&gone, Tier::Foreground);
        p.take_events();
        assert_eq!(p.flush_cached(), 2);
        assert_eq!(p.lookup_prefix(&[2]), Vec::<BlockId>::new());
        assert_eq!(p.lookup_prefix(&[1]), kept);
        assert_eq!(
            p.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![3, 2],
                medium: Some("GPU".into()),
            }]
        );
    }

    #[test]
    fn evicts_least_recently_freed_and_tail_first() {
        let mut p = pool(4);
        let a = p.allocate(2).unwrap(); // chain A: 1 -> 2
        p.commit(a[0], 1, None, &[0; 4]);
        p.commit(a[1], 2, Some(1), &[0; 4]);
        let b = p.allocate(2).unwrap(); // chain B: 3 -> 4
        p.commit(b[0], 3, None, &[1; 4]);
        p.commit(b[1], 4, Some(3), &[1; 4]);
        p.release(&a, Tier::Foreground); // A freed first: its tail (2) then head (1)
        p.release(&b, Tier::Foreground);
        p.take_events();
        let got = p.allocate(1).unwrap();
        assert_eq!(
            got,
            vec![a[1]],
            "tail of the least recently freed chain goes first"
        );
        assert_eq!(p.lookup_prefix(&[1, 2]), vec![a[0]]);
        let got = p.allocate(2).unwrap();
        assert_eq!(got, vec![a[0], b[1]]);
        assert_eq!(
            p.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![2, 1, 4],
                medium: Some("GPU".into())
            }]
        );
        assert_eq!(p.lookup_prefix(&[3, 4]), vec![b[0]]);
    }

    #[test]
    fn background_leftovers_are_evicted_before_what_interactive_requests_used() {
        let mut p = pool(6);
        let chat = p.allocate(2).unwrap(); // an interactive conversation: 1 -> 2
        p.commit(chat[0], 1, None, &[0; 4]);
        p.commit(chat[1], 2, Some(1), &[0; 4]);
        let shared = p.allocate(1).unwrap(); // a prefix both classes use
        p.commit(shared[0], 3, None, &[1; 4]);
        let batch = p.allocate(2).unwrap(); // a batch line's own blocks: 4 -> 5
        p.commit(batch[0], 4, None, &[2; 4]);
        p.commit(batch[1], 5, Some(4), &[2; 4]);
        let partial = p.allocate(1).unwrap(); // never filled: no hash
        p.acquire(&shared);
        // The conversation is freed first, so under one LRU list it would go first.
        p.release(&chat, Tier::Foreground);
        p.release(&shared, Tier::Foreground);
        p.release(&partial, Tier::Foreground);
        p.release(&batch, Tier::Background);
        p.release(&shared, Tier::Background);
        p.take_events();
        // The hashless block, then the batch line's blocks (tail first)...
        assert_eq!(p.allocate(3).unwrap(), vec![partial[0], batch[1], batch[0]]);
        assert_eq!(p.lookup_prefix(&[1, 2]), chat);
        assert_eq!(p.lookup_prefix(&[3]), shared);
        // ...and only then, least recently freed first, what interactive requests used.
        assert_eq!(p.allocate(3).unwrap(), vec![chat[1], chat[0], shared[0]]);
        assert_eq!(
            p.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![5, 4, 2, 1, 3],
                medium: Some("GPU".into())
            }]
        );
    }

    #[test]
    fn a_block_handed_out_fresh_forgets_its_tier() {
        let mut p = pool(1);
        let a = p.allocate(1).unwrap();
        p.commit(a[0], 1, None, &[0; 4]);
        p.release(&a, Tier::Foreground);
        assert_eq!(p.blocks[a[0] as usize].free_in, Some(Tier::Foreground));
        let b = p.allocate(1).unwrap(); // evicted and handed out again, to a batch line
        assert_eq!(b, a);
        p.commit(b[0], 2, None, &[1; 4]);
        p.release(&b, Tier::Background);
        assert_eq!(p.blocks[b[0] as usize].free_in, Some(Tier::Background));
    }

    #[test]
    fn refcounts_never_free_a_block_in_use() {
        let mut p = pool(2);
        let a = p.allocate(1).unwrap();
        p.commit(a[0], 7, None, &[0; 4]);
        let shared = p.lookup_prefix(&[7]);
        p.acquire(&shared); // a second sequence shares the block
        p.release(&a, Tier::Foreground); // first sequence finishes
        assert_eq!(p.ref_count(a[0]), 1);
        assert_eq!(p.num_free(), 1);
        // Only the other block can be handed out; the shared one is not evictable.
        assert!(p.allocate(2).is_none());
        let other = p.allocate(1).unwrap();
        assert_ne!(other[0], a[0]);
        assert_eq!(p.hash_of(a[0]), Some(7));
        p.release(&shared, Tier::Foreground);
        assert_eq!(p.ref_count(a[0]), 0);
    }

    #[test]
    fn block_table_returns_blocks_on_drop() {
        let pool = Arc::new(Mutex::new(pool(3)));
        {
            let mut t = BlockTable::new(pool.clone(), Tier::Foreground);
            let ids = pool.lock().allocate(3).unwrap();
            t.push(ids);
            assert_eq!(pool.lock().num_free(), 0);
        }
        assert_eq!(pool.lock().num_free(), 3);
    }

    #[test]
    fn duplicate_content_stays_anonymous_and_caching_can_be_off() {
        let mut p = pool(2);
        let a = p.allocate(2).unwrap();
        p.commit(a[0], 5, None, &[0; 4]);
        p.commit(a[1], 5, None, &[0; 4]);
        assert_eq!(p.num_cached(), 1);
        let mut off = BlockPool::new(2, 4, false);
        let b = off.allocate(1).unwrap();
        off.commit(b[0], 5, None, &[0; 4]);
        assert!(off.lookup_prefix(&[5]).is_empty());
        assert!(off.take_events().is_empty());
    }
}
