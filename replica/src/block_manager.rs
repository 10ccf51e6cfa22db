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
//! Sequences hold their blocks through a [`BlockTable`], which returns them on drop (RAII).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use protocol::kv_events::KvEvent;

pub type BlockId = u32;
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    hash: Option<u64>,
    ref_count: u32,
    prev: u32,
    next: u32,
    in_free_list: bool,
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
    free_head: u32,
    free_tail: u32,
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
                    in_free_list: false,
                };
                num_blocks
            ],
            free_head: NIL,
            free_tail: NIL,
            free_len: 0,
            cached: HashMap::new(),
            pending: Vec::new(),
            stats: PrefixStats::default(),
            caching: enable_prefix_caching,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free_tail(id);
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

    fn push_free_tail(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(!b.in_free_list);
        b.in_free_list = true;
        b.prev = self.free_tail;
        b.next = NIL;
        if self.free_tail == NIL {
            self.free_head = id;
        } else {
            self.blocks[self.free_tail as usize].next = id;
        }
        self.free_tail = id;
        self.free_len += 1;
    }

    fn unlink_free(&mut self, id: u32) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_list);
            (b.prev, b.next)
        };
        if prev == NIL {
            self.free_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.in_free_list = false;
        b.prev = NIL;
        b.next = NIL;
        self.free_len -= 1;
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

    /// Hands out `n` fresh blocks, evicting the least recently freed cached ones; `None` (and
    /// nothing changed) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free_head;
            self.unlink_free(id);
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
    /// before its head.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            assert!(b.ref_count > 0, "double release of block {id}");
            b.ref_count -= 1;
            if b.ref_count == 0 {
                self.push_free_tail(id);
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
        let mut id = self.free_head;
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
}

impl BlockTable {
    pub fn new(pool: Arc<Mutex<BlockPool>>) -> Self {
        BlockTable {
            pool,
            ids: Vec::new(),
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
            self.pool.lock().release(&ids);
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
        p.release(&a);
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
        p.release(&gone);
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
        p.release(&a); // A freed first: its tail (2) then head (1)
        p.release(&b);
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
    fn refcounts_never_free_a_block_in_use() {
        let mut p = pool(2);
        let a = p.allocate(1).unwrap();
        p.commit(a[0], 7, None, &[0; 4]);
        let shared = p.lookup_prefix(&[7]);
        p.acquire(&shared); // a second sequence shares the block
        p.release(&a); // first sequence finishes
        assert_eq!(p.ref_count(a[0]), 1);
        assert_eq!(p.num_free(), 1);
        // Only the other block can be handed out; the shared one is not evictable.
        assert!(p.allocate(2).is_none());
        let other = p.allocate(1).unwrap();
        assert_ne!(other[0], a[0]);
        assert_eq!(p.hash_of(a[0]), Some(7));
        p.release(&shared);
        assert_eq!(p.ref_count(a[0]), 0);
    }

    #[test]
    fn block_table_returns_blocks_on_drop() {
        let pool = Arc::new(Mutex::new(pool(3)));
        {
            let mut t = BlockTable::new(pool.clone());
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
