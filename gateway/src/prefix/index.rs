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
//! - A cap per replica on what its events may hold: its reported cache size plus a quarter
//!   ([`PrefixIndex::set_capacity`]), or `max_blocks_per_replica` until it reports one. Past
//!   it the replica's oldest reported blocks are dropped (and counted): a publisher that stores
//!   and never removes — a bug, or a restart in place that lost its removals — costs bounded
//!   memory, and its overflow is visible.
//!
//! A match is the longest run of consecutive leading blocks present on a replica. Each entry is
//! 32 bytes plus its 8-byte key and the map's per-slot overhead, and a reported block is 8 more
//! in its replica's order queue: under 72 bytes per block.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::RwLock;
use protocol::kv_events::KvEvent;

pub use crate::prefix::group::BYTES_PER_BLOCK;
use crate::prefix::group::{Group, GROUP};

/// The index: one [`Group`] per 64 slots, created on first use.
pub struct PrefixIndex {
    groups: RwLock<Vec<Arc<Group>>>,
    approx_capacity: usize,
    /// Reported blocks a replica may hold while its cache size is unknown.
    default_cap: usize,
}

/// The cap for a replica that reported a cache of `blocks`: a quarter more (events arrive in
/// batches, and an eviction may be reported after the store that caused it), plus a margin.
pub fn cap_for(blocks: usize) -> usize {
    blocks + blocks / 4 + 1024
}

impl PrefixIndex {
    /// `approx_capacity`: approximate blocks kept per replica; `default_cap`: reported blocks
    /// kept per replica until it says how many it holds.
    pub fn new(approx_capacity: usize, default_cap: usize) -> Self {
        PrefixIndex {
            groups: RwLock::new(Vec::new()),
            approx_capacity,
            default_cap,
        }
    }

    /// The reported blocks `replica` may hold now.
    pub fn cap(&self, replica: usize) -> usize {
        let (g, r) = self.group(replica);
        g.caps[r].load(Ordering::Relaxed)
    }

    /// Caps what `replica`'s events may hold at [`cap_for`] its reported cache of `blocks`
    /// (`None`: back to the default).
    pub fn set_capacity(&self, replica: usize, blocks: Option<usize>) {
        let (g, r) = self.group(replica);
        let cap = blocks.map_or(self.default_cap, cap_for);
        g.caps[r].store(cap, Ordering::Relaxed);
    }

    /// The group holding `slot`, and the slot's bit position in it.
    fn group(&self, slot: usize) -> (Arc<Group>, usize) {
        let g = slot / GROUP;
        if let Some(x) = self.groups.read().get(g) {
            return (x.clone(), slot % GROUP);
        }
        let mut w = self.groups.write();
        while w.len() <= g {
            w.push(Arc::new(Group::new(self.default_cap)));
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
        let groups = self.groups();
        let queued: usize = groups
            .iter()
            .flat_map(|g| {
                g.reported.iter().map(|q| {
                    let q = q.lock();
                    q.gpu.len() + q.cpu.len()
                })
            })
            .sum();
        let approx: usize = groups.iter().map(|g| g.approx_records()).sum();
        self.len() * BYTES_PER_BLOCK + queued * 8 + approx * 16
    }

    /// Applies one KV event reported by `replica`; returns how many of its oldest blocks were
    /// dropped because it now reports more than its cap.
    pub fn apply(&self, replica: usize, ev: &KvEvent) -> usize {
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

#[cfg(test)]
mod tests;
