//! How often a prefix is reused: a decaying count of recent requests per block hash.
//!
//! Each dispatched request counts once, at the deepest block any replica holds of its prompt
//! (the prefix the index matched: a shared system prompt, or a conversation's last turn). The
//! count halves every [`HALF_LIFE_S`] seconds. A prefix many requests reuse (an agent's system
//! prompt) keeps a high count; a conversation's history is reused by its next turn only, and
//! the block that turn matches was never counted before — so its count stays near zero.
//!
//! Placement reads it for each replica at that replica's match depth: what passing the replica
//! over would give up is amortised by later requests only when its prefix is shared. The
//! inter-token check (`itl_headroom`) passes over a holder only then.
//!
//! Memory is bounded: past [`CAPACITY`] prefixes, the ones whose count decayed under a tenth
//! of a request are dropped, and if that frees too little, the map starts over.

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;

/// Seconds for a count to halve.
pub const HALF_LIFE_S: f64 = 10.0;
/// Prefixes tracked before pruning.
pub const CAPACITY: usize = 65_536;

#[derive(Debug, Clone, Copy)]
struct Count {
    value: f64,
    at_s: f64,
}

impl Count {
    fn at(&self, now_s: f64) -> f64 {
        let dt = (now_s - self.at_s).max(0.0);
        self.value * (-dt * std::f64::consts::LN_2 / HALF_LIFE_S).exp()
    }
}

pub struct PrefixReuse {
    started: Instant,
    counts: Mutex<HashMap<u64, Count>>,
}

impl Default for PrefixReuse {
    fn default() -> Self {
        PrefixReuse {
            started: Instant::now(),
            counts: Mutex::new(HashMap::new()),
        }
    }
}

impl PrefixReuse {
    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Counts a request whose prompt's blocks are `hashes`, `matched[i]` of them held by
    /// replica `i`: one reuse of the deepest held block.
    pub fn record(&self, hashes: &[u64], matched: &[usize]) {
        self.record_at(hashes, matched, self.now_s())
    }

    /// Per replica: recent requests that reused the prefix of this prompt it holds (0 where it
    /// holds none).
    pub fn at_matches(&self, hashes: &[u64], matched: &[usize]) -> Vec<f64> {
        self.at_matches_at(hashes, matched, self.now_s())
    }

    pub fn record_at(&self, hashes: &[u64], matched: &[usize], now_s: f64) {
        let depth = matched.iter().copied().max().unwrap_or(0).min(hashes.len());
        let Some(&key) = depth.checked_sub(1).and_then(|d| hashes.get(d)) else {
            return;
        };
        let mut counts = self.counts.lock();
        if counts.len() >= CAPACITY && !counts.contains_key(&key) {
            counts.retain(|_, c| c.at(now_s) >= 0.1);
            if counts.len() >= CAPACITY * 3 / 4 {
                counts.clear();
            }
        }
        let c = counts.entry(key).or_insert(Count {
            value: 0.0,
            at_s: now_s,
        });
        *c = Count {
            value: c.at(now_s) + 1.0,
            at_s: now_s,
        };
    }

    pub fn at_matches_at(&self, hashes: &[u64], matched: &[usize], now_s: f64) -> Vec<f64> {
        let counts = self.counts.lock();
        matched
            .iter()
            .map(|&m| {
                m.min(hashes.len())
                    .checked_sub(1)
                    .and_then(|d| counts.get(&hashes[d]))
                    .map_or(0.0, |c| c.at(now_s))
            })
            .collect()
    }

    /// Prefixes tracked (for tests and the size check).
    pub fn len(&self) -> usize {
        self.counts.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_counts_up_and_a_conversation_does_not() {
        let r = PrefixReuse::default();
        let system: Vec<u64> = (1..=100).collect();
        // Ten agent requests: replica 0 holds the 100-block system prompt, their questions
        // differ after it.
        for i in 0..10u64 {
            let mut h = system.clone();
            h.push(1000 + i);
            r.record_at(&h, &[100, 0], i as f64 * 0.1);
        }
        let mut next = system.clone();
        next.push(2000);
        let at = r.at_matches_at(&next, &[100, 0], 1.0);
        assert!(at[0] > 9.0 && at[0] <= 10.0, "{at:?}");
        assert_eq!(at[1], 0.0);
        // A conversation: each turn matches the previous turn's end, a block no earlier
        // request was counted at.
        let mut conv = system.clone();
        for turn in 0..5u64 {
            conv.extend((0..20).map(|b| 10_000 + turn * 100 + b));
            let m = conv.len() - 10;
            assert!(r.at_matches_at(&conv, &[m, 100], 2.0)[0] < 1e-9);
            r.record_at(&conv, &[m, 100], 2.0);
        }
        // ... while a replica holding only the system prompt holds a shared prefix.
        // (ten requests 1.1-2.0 s ago, halving every 10 s: about 8.98)
        assert!(r.at_matches_at(&conv, &[0, 100], 2.0)[1] > 8.5);
    }

    #[test]
    fn counts_decay_and_memory_stays_bounded() {
        let r = PrefixReuse::default();
        r.record_at(&[1, 2, 3], &[3], 0.0);
        r.record_at(&[1, 2, 3], &[3], 0.0);
        let later = r.at_matches_at(&[1, 2, 3], &[3], HALF_LIFE_S)[0];
        assert!((later - 1.0).abs() < 1e-9, "{later}");
        // Nothing held: nothing counted.
        r.record_at(&[9, 9], &[0, 0], 0.0);
        assert_eq!(r.len(), 1);
        for k in 0..(CAPACITY as u64 + 10) {
            r.record_at(&[k + 100], &[1], 1_000.0);
        }
        assert!(r.len() <= CAPACITY, "{}", r.len());
    }
}
