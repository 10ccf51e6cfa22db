//! Which replica holds which prefix block.
//!
//! One sharded map (`dashmap`) from block hash to a small entry: a bitmask of replicas that
//! *reported* the block through their KV event stream (exact), a bitmask of replicas the gateway
//! *believes* hold it because it routed the prefix there (approximate), and when that belief was
//! last refreshed. Replicas are slots assigned by the gateway's registry; slots are kept in
//! groups of 64 (one `u64` of bits per group), a group created when its first slot is used, so
//! a fleet of any size costs one map per 64 replicas and nothing more for fleets up to 64.
//!
//! - Exact mode: `BlockStored` sets the replica's exact bit, `BlockRemoved` clears both its
//!   bits, `AllBlocksCleared` (every snapshot starts with one) clears the replica everywhere.
//! - Approximate mode, for replicas without events: after routing, the request's blocks are
//!   recorded for the chosen replica with a TTL, and each replica keeps at most `capacity`
//!   such blocks (least recently recorded go first) — a stand-in for a cache it cannot see.
//! - Speculative insert: exact-mode replicas get the same approximate record right after
//!   routing, with a short TTL, so the next request of a conversation matches before the
//!   replica's event arrives.
//!
//! - Offload tier: an engine that copies blocks to CPU memory reports them with a `medium`
//!   other than `"GPU"`; those set the replica's offloaded bit (and its removals clear only
//!   that bit). A block there is cheaper than a miss (it is loaded, not recomputed) and dearer
//!   than a GPU hit: [`PrefixIndex::offloaded_lengths`] counts how far a match extends through
//!   such blocks beyond its GPU run, and the policy prices them apart.
//!
//! A match is the longest run of consecutive leading blocks present on a replica. Each entry is
//! 32 bytes plus its 8-byte key and the map's per-slot overhead: under 64 bytes per block.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};
use protocol::kv_events::KvEvent;

/// Replicas one group tracks (one bit each).
const GROUP: usize = 64;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry {
    exact: u64,
    approx: u64,
    /// Reported in an offload tier (CPU memory), not on the GPU.
    offloaded: u64,
    /// Seconds (index clock) when an approximate bit was last set.
    touched: u32,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.exact == 0 && self.approx == 0 && self.offloaded == 0
    }
}

/// The medium vLLM reports for blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";

/// Whether a reported `medium` is GPU memory (absent means GPU, as vLLM's default).
pub fn on_gpu(medium: &Option<String>) -> bool {
    medium
        .as_deref()
        .is_none_or(|m| m.eq_ignore_ascii_case(MEDIUM_GPU))
}

/// Bytes one indexed block costs, for the size metric: entry, key, and hashbrown's control byte
/// and load-factor slack.
pub const BYTES_PER_BLOCK: usize = std::mem::size_of::<Entry>() + 8 + 8;

/// Slots `64·g .. 64·g + 63` of the index.
struct Group {
    map: DashMap<u64, Entry>,
    /// Offloaded bits set (an upper bound): while 0, offload lookups are skipped.
    offloaded_bits: AtomicUsize,
    /// Per replica, approximate records in insertion order, for the capacity bound.
    approx_lru: Vec<Mutex<VecDeque<(u64, u32)>>>,
}

/// The index: one [`Group`] per 64 slots, created on first use.
pub struct PrefixIndex {
    groups: RwLock<Vec<Arc<Group>>>,
    approx_capacity: usize,
}

impl PrefixIndex {
    /// `approx_capacity`: approximate blocks kept per replica.
    pub fn new(approx_capacity: usize) -> Self {
        PrefixIndex {
            groups: RwLock::new(Vec::new()),
            approx_capacity,
        }
    }

    /// The group holding `slot`, and the slot's bit position in it.
    fn group(&self, slot: usize) -> (Arc<Group>, usize) {
        let g = slot / GROUP;
        if let Some(x) = self.groups.read().get(g) {
            return (x.clone(), slot % GROUP);
        }
        let mut w = self.groups.write();
        while w.len() <= g {
            w.push(Arc::new(Group::new()));
        }
        (w[g].clone(), slot % GROUP)
    }

    fn groups(&self) -> Vec<Arc<Group>> {
        self.groups.read().clone()
    }

    /// Indexed blocks (a block held in two groups counts twice).
    pub fn len(&self) -> usize {
        self.groups().iter().map(|g| g.map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.groups().iter().all(|g| g.map.is_empty())
    }

    /// Estimated memory of the index, for `kvgate_gateway_prefix_index_bytes`.
    pub fn size_bytes(&self) -> usize {
        self.len() * BYTES_PER_BLOCK
    }

    /// Applies one KV event reported by `replica`.
    pub fn apply(&self, replica: usize, ev: &KvEvent) {
        let (g, r) = self.group(replica);
        g.apply(r, ev)
    }

    /// Forgets everything `replica` reported (resync, or the replica left).
    pub fn clear_exact(&self, replica: usize) {
        let (g, r) = self.group(replica);
        g.clear_exact(r)
    }

    /// Forgets everything about `replica`, exact and approximate.
    pub fn remove_replica(&self, replica: usize) {
        let (g, r) = self.group(replica);
        g.remove_replica(r)
    }

    /// Records that `hashes` were just routed to `replica` (approximate / speculative).
    pub fn record_routed(&self, replica: usize, hashes: &[u64], now: u32) {
        let (g, r) = self.group(replica);
        g.record_routed(r, hashes, now, self.approx_capacity)
    }

    /// For each of the first `replicas` slots, how many leading blocks of `hashes` it holds:
    /// exact bits always count, approximate bits while younger than that replica's `ttl[r]`
    /// seconds.
    pub fn match_lengths(
        &self,
        hashes: &[u64],
        replicas: usize,
        now: u32,
        ttl: &[u32],
    ) -> Vec<usize> {
        // The read guard, not a copy of the group list: this runs for every request, and the
        // write side (a new group of 64) is taken once per 64 replicas ever added.
        let groups = self.groups.read();
        let mut out = Vec::with_capacity(replicas);
        for start in (0..replicas).step_by(GROUP) {
            let n = GROUP.min(replicas - start);
            match groups.get(start / GROUP) {
                Some(g) => {
                    out.extend(g.match_lengths(hashes, n, now, ttl.get(start..).unwrap_or(&[])))
                }
                None => out.extend(std::iter::repeat_n(0, n)),
            }
        }
        out
    }

    /// For each replica, how many blocks beyond its match in `gpu` (from
    /// [`PrefixIndex::match_lengths`]) sit in its offload tier — free when no engine reported
    /// any.
    pub fn offloaded_lengths(&self, hashes: &[u64], gpu: &[usize]) -> Vec<usize> {
        let groups = self.groups.read();
        let mut out = Vec::with_capacity(gpu.len());
        for (gi, chunk) in gpu.chunks(GROUP).enumerate() {
            match groups.get(gi) {
                Some(g) => out.extend(g.offloaded_lengths(hashes, chunk)),
                None => out.extend(std::iter::repeat_n(0, chunk.len())),
            }
        }
        out
    }

    /// Drops approximate bits older than `max_ttl` (a periodic sweep keeps the map bounded).
    pub fn expire(&self, now: u32, max_ttl: u32) {
        for g in self.groups() {
            g.expire(now, max_ttl);
        }
    }
}

impl Group {
    fn new() -> Self {
        Group {
            map: DashMap::new(),
            offloaded_bits: AtomicUsize::new(0),
            approx_lru: (0..GROUP).map(|_| Mutex::new(VecDeque::new())).collect(),
        }
    }

    fn bit(replica: usize) -> u64 {
        debug_assert!(replica < GROUP);
        1u64 << replica
    }

    fn apply(&self, replica: usize, ev: &KvEvent) {
        let bit = Self::bit(replica);
        match ev {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } if !on_gpu(medium) => {
                for h in block_hashes {
                    let mut e = self.map.entry(*h).or_default();
                    if e.offloaded & bit == 0 {
                        e.offloaded |= bit;
                        self.offloaded_bits.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            KvEvent::BlockStored { block_hashes, .. } => {
                for h in block_hashes {
                    self.map.entry(*h).or_default().exact |= bit;
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } if !on_gpu(medium) => {
                for h in block_hashes {
                    if let dashmap::Entry::Occupied(mut o) = self.map.entry(*h) {
                        let e = o.get_mut();
                        if e.offloaded & bit != 0 {
                            e.offloaded &= !bit;
                            self.offloaded_bits.fetch_sub(1, Ordering::Relaxed);
                        }
                        if e.is_empty() {
                            o.remove();
                        }
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    self.clear_bits(*h, bit);
                }
            }
            KvEvent::AllBlocksCleared => self.clear_exact(replica),
        }
    }

    fn clear_bits(&self, hash: u64, bit: u64) {
        if let dashmap::Entry::Occupied(mut o) = self.map.entry(hash) {
            let e = o.get_mut();
            e.exact &= !bit;
            e.approx &= !bit;
            if e.is_empty() {
                o.remove();
            }
        }
    }

    /// Forgets what `replica` reported, both tiers.
    fn clear_exact(&self, replica: usize) {
        let bit = Self::bit(replica);
        let mut cleared = 0;
        self.map.retain(|_, e| {
            e.exact &= !bit;
            if e.offloaded & bit != 0 {
                e.offloaded &= !bit;
                cleared += 1;
            }
            !e.is_empty()
        });
        self.release_offloaded(cleared);
    }

    fn remove_replica(&self, replica: usize) {
        let bit = Self::bit(replica);
        let mut cleared = 0;
        self.map.retain(|_, e| {
            e.exact &= !bit;
            e.approx &= !bit;
            if e.offloaded & bit != 0 {
                e.offloaded &= !bit;
                cleared += 1;
            }
            !e.is_empty()
        });
        self.release_offloaded(cleared);
        self.approx_lru[replica].lock().clear();
    }

    fn release_offloaded(&self, n: usize) {
        if n > 0 {
            let _ = self
                .offloaded_bits
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                    Some(v.saturating_sub(n))
                });
        }
    }

    /// Per replica, how many blocks after its GPU run (`gpu[r]`) continue in the offload tier
    /// (or on the GPU again, after an offloaded block).
    fn offloaded_lengths(&self, hashes: &[u64], gpu: &[usize]) -> Vec<usize> {
        if self.offloaded_bits.load(Ordering::Relaxed) == 0 {
            return vec![0; gpu.len()];
        }
        gpu.iter()
            .enumerate()
            .map(|(r, &start)| {
                let bit = Self::bit(r);
                hashes
                    .get(start..)
                    .unwrap_or(&[])
                    .iter()
                    .take_while(|h| {
                        self.map
                            .get(h)
                            .is_some_and(|e| (e.offloaded | e.exact) & bit != 0)
                    })
                    .count()
            })
            .collect()
    }

    fn record_routed(&self, replica: usize, hashes: &[u64], now: u32, capacity: usize) {
        let bit = Self::bit(replica);
        let mut lru = self.approx_lru[replica].lock();
        for &h in hashes {
            let mut e = self.map.entry(h).or_default();
            e.approx |= bit;
            e.touched = now;
            drop(e);
            lru.push_back((h, now));
        }
        while lru.len() > capacity {
            let Some((h, at)) = lru.pop_front() else {
                break;
            };
            if let dashmap::Entry::Occupied(mut o) = self.map.entry(h) {
                let e = o.get_mut();
                // Refreshed since this record: a later record in the queue covers it.
                if e.touched <= at {
                    e.approx &= !bit;
                    if e.is_empty() {
                        o.remove();
                    }
                }
            }
        }
    }

    fn match_lengths(&self, hashes: &[u64], replicas: usize, now: u32, ttl: &[u32]) -> Vec<usize> {
        let mut out = vec![0usize; replicas];
        let mut alive: u64 = if replicas >= 64 {
            u64::MAX
        } else {
            (1u64 << replicas) - 1
        };
        for (i, h) in hashes.iter().enumerate() {
            let present = match self.map.get(h) {
                Some(e) => {
                    let mut mask = e.exact;
                    let age = now.saturating_sub(e.touched);
                    for r in 0..replicas {
                        if e.approx & (1 << r) != 0 && age < ttl.get(r).copied().unwrap_or(0) {
                            mask |= 1 << r;
                        }
                    }
                    mask
                }
                None => 0,
            };
            let dropped = alive & !present;
            for (r, o) in out.iter_mut().enumerate() {
                if dropped & (1 << r) != 0 {
                    *o = i;
                }
            }
            alive &= present;
            if alive == 0 {
                return out;
            }
        }
        for (r, o) in out.iter_mut().enumerate() {
            if alive & (1 << r) != 0 {
                *o = hashes.len();
            }
        }
        out
    }

    fn expire(&self, now: u32, max_ttl: u32) {
        self.map.retain(|_, e| {
            if now.saturating_sub(e.touched) >= max_ttl {
                e.approx = 0;
            }
            !e.is_empty()
        });
    }
}

#[cfg(test)]
mod tests;
