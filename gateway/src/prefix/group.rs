//! One group of the prefix index: the map from block hash to which of 64 replicas hold it
//! (exact, approximate, offloaded bits), and each replica's queues — approximate records for
//! their capacity bound, reported blocks in order for their cap (`index.rs` says why). The
//! index (`index.rs`) maps replica slots to groups.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;
use protocol::kv_events::KvEvent;

/// Replicas one group tracks (one bit each).
pub const GROUP: usize = 64;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
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

/// One replica's reported blocks in the order they were stored (one queue per tier), for
/// its cap. A queue may hold blocks removed since (skipped when met) and is compacted when
/// those dominate.
#[derive(Default)]
pub struct Reported {
    pub(super) gpu: VecDeque<u64>,
    pub(super) gpu_count: usize,
    pub(super) cpu: VecDeque<u64>,
    pub(super) cpu_count: usize,
}

/// A replica's two tiers of reported blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    Gpu,
    Offload,
}

/// Slots `64·g .. 64·g + 63` of the index.
pub struct Group {
    pub(super) map: DashMap<u64, Entry>,
    /// Offloaded bits set (an upper bound): while 0, offload lookups are skipped.
    offloaded_bits: AtomicUsize,
    /// Per replica, approximate records in insertion order, for the capacity bound.
    approx_lru: Vec<Mutex<VecDeque<(u64, u32)>>>,
    /// Per replica, reported blocks in order, and how many of them it may hold.
    pub(super) reported: Vec<Mutex<Reported>>,
    pub(super) caps: Vec<AtomicUsize>,
}

impl Group {
    pub(super) fn new(default_cap: usize) -> Self {
        Group {
            map: DashMap::new(),
            offloaded_bits: AtomicUsize::new(0),
            approx_lru: (0..GROUP).map(|_| Mutex::new(VecDeque::new())).collect(),
            reported: (0..GROUP).map(|_| Mutex::default()).collect(),
            caps: (0..GROUP).map(|_| AtomicUsize::new(default_cap)).collect(),
        }
    }

    fn bit(replica: usize) -> u64 {
        debug_assert!(replica < GROUP);
        1u64 << replica
    }

    pub(super) fn apply(&self, replica: usize, ev: &KvEvent) -> usize {
        let bit = Self::bit(replica);
        match ev {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } if !on_gpu(medium) => {
                let mut q = self.reported[replica].lock();
                for h in block_hashes {
                    let mut e = self.map.entry(*h).or_default();
                    if e.offloaded & bit == 0 {
                        e.offloaded |= bit;
                        self.offloaded_bits.fetch_add(1, Ordering::Relaxed);
                        q.cpu_count += 1;
                        q.cpu.push_back(*h);
                    }
                }
                let cap = self.caps[replica].load(Ordering::Relaxed);
                self.evict(&mut q, bit, cap, Tier::Offload)
            }
            KvEvent::BlockStored { block_hashes, .. } => {
                let mut q = self.reported[replica].lock();
                for h in block_hashes {
                    let mut e = self.map.entry(*h).or_default();
                    if e.exact & bit == 0 {
                        e.exact |= bit;
                        q.gpu_count += 1;
                        q.gpu.push_back(*h);
                    }
                }
                let cap = self.caps[replica].load(Ordering::Relaxed);
                self.evict(&mut q, bit, cap, Tier::Gpu)
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } if !on_gpu(medium) => {
                let mut q = self.reported[replica].lock();
                for h in block_hashes {
                    if let dashmap::Entry::Occupied(mut o) = self.map.entry(*h) {
                        let e = o.get_mut();
                        if e.offloaded & bit != 0 {
                            e.offloaded &= !bit;
                            self.offloaded_bits.fetch_sub(1, Ordering::Relaxed);
                            q.cpu_count = q.cpu_count.saturating_sub(1);
                        }
                        if e.is_empty() {
                            o.remove();
                        }
                    }
                }
                let live = q.cpu_count;
                Self::compact(&mut q.cpu, live, |h| self.has(h, bit, Tier::Offload));
                0
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                let mut q = self.reported[replica].lock();
                for h in block_hashes {
                    if self.clear_bits(*h, bit) {
                        q.gpu_count = q.gpu_count.saturating_sub(1);
                    }
                }
                let live = q.gpu_count;
                Self::compact(&mut q.gpu, live, |h| self.has(h, bit, Tier::Gpu));
                0
            }
            // The engine's whole cache is gone, so are the blocks requests sent there were
            // taken to have: speculative records too, or the next request would be sent there
            // for a prefix the engine must prefill cold (issue 29: vLLM's reset_prefix_cache).
            KvEvent::AllBlocksCleared => {
                self.remove_replica(replica);
                0
            }
        }
    }

    /// Whether `hash` holds `bit` in `tier`.
    fn has(&self, hash: u64, bit: u64, tier: Tier) -> bool {
        self.map.get(&hash).is_some_and(|e| match tier {
            Tier::Gpu => e.exact & bit != 0,
            Tier::Offload => e.offloaded & bit != 0,
        })
    }

    /// Drops the oldest reported blocks of one replica's `tier` while it holds more than
    /// `cap`; returns how many.
    fn evict(&self, q: &mut Reported, bit: u64, cap: usize, tier: Tier) -> usize {
        let q = &mut *q;
        let mut evicted = 0;
        loop {
            let (queue, count) = match tier {
                Tier::Gpu => (&mut q.gpu, &mut q.gpu_count),
                Tier::Offload => (&mut q.cpu, &mut q.cpu_count),
            };
            if *count <= cap {
                break;
            }
            let Some(h) = queue.pop_front() else {
                *count = 0;
                break;
            };
            if let dashmap::Entry::Occupied(mut o) = self.map.entry(h) {
                let e = o.get_mut();
                let held = match tier {
                    Tier::Gpu => &mut e.exact,
                    Tier::Offload => &mut e.offloaded,
                };
                if *held & bit != 0 {
                    *held &= !bit;
                    *count -= 1;
                    evicted += 1;
                    if tier == Tier::Offload {
                        self.offloaded_bits.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                if e.is_empty() {
                    o.remove();
                }
            }
        }
        evicted
    }

    /// Drops queue records of blocks removed since (keeping the latest record of each) once
    /// they outnumber the live ones.
    fn compact(queue: &mut VecDeque<u64>, live: usize, held: impl Fn(u64) -> bool) {
        if queue.len() <= 2 * live + 1024 {
            return;
        }
        let mut seen = std::collections::HashSet::with_capacity(live);
        let kept: VecDeque<u64> = queue
            .iter()
            .rev()
            .filter(|&&h| held(h) && seen.insert(h))
            .copied()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        *queue = kept;
    }

    /// Clears `bit` from `hash` (both its exact and approximate record); returns whether
    /// the exact one was set.
    fn clear_bits(&self, hash: u64, bit: u64) -> bool {
        if let dashmap::Entry::Occupied(mut o) = self.map.entry(hash) {
            let e = o.get_mut();
            let was = e.exact & bit != 0;
            e.exact &= !bit;
            e.approx &= !bit;
            if e.is_empty() {
                o.remove();
            }
            return was;
        }
        false
    }

    /// Forgets what `replica` reported, both tiers.
    pub(super) fn clear_exact(&self, replica: usize) {
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
        *self.reported[replica].lock() = Reported::default();
    }

    pub(super) fn remove_replica(&self, replica: usize) {
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
        *self.reported[replica].lock() = Reported::default();
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
    pub(super) fn offloaded_lengths(&self, hashes: &[u64], gpu: &[usize]) -> Vec<usize> {
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

    pub(super) fn record_routed(&self, replica: usize, hashes: &[u64], now: u32, capacity: usize) {
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

    pub(super) fn match_lengths(
        &self,
        hashes: &[u64],
        replicas: usize,
        now: u32,
        ttl: &[u32],
    ) -> Vec<usize> {
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

    /// Drops approximate bits older than `max_ttl`, and their records in each replica's
    /// queue (oldest first): without that the queues only ever shrank at their capacity bound,
    /// and grew to it — 200k records a replica — however short the records' TTL.
    pub(super) fn expire(&self, now: u32, max_ttl: u32) {
        self.map.retain(|_, e| {
            if now.saturating_sub(e.touched) >= max_ttl {
                e.approx = 0;
            }
            !e.is_empty()
        });
        for q in &self.approx_lru {
            let mut q = q.lock();
            while q
                .front()
                .is_some_and(|&(_, at)| now.saturating_sub(at) >= max_ttl)
            {
                q.pop_front();
            }
            if q.capacity() > 4 * q.len().max(256) {
                q.shrink_to_fit();
            }
        }
    }

    /// Records in the replicas' approximate queues.
    pub(super) fn approx_records(&self) -> usize {
        self.approx_lru.iter().map(|q| q.lock().len()).sum()
    }
}
