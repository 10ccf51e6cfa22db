//! Prefixes being warmed on another replica (`request/warm.rs`): one warming request per
//! prefix at a time. While a warming prefill runs, its target already counts as a holder in
//! the index but has that prefill queued, so it looks pressed to the next request of the same
//! burst, which would warm a third replica, and so on: a burst of six warmed four replicas
//! with the same system prompt within 0.1 s. A prefix is warmed again only after its warming
//! request answered (or [`Warming::TTL`] passed), when the holders it added are priced as they
//! really are.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

#[derive(Debug, Default)]
pub struct Warming {
    /// Key of the prefix (the hash of its deepest block) → when its warming request was sent.
    started: Mutex<HashMap<u64, Instant>>,
}

impl Warming {
    /// Longest a warming request keeps its prefix from being warmed again.
    pub const TTL: Duration = Duration::from_secs(60);
    /// Entries kept at most (old ones are dropped first when full).
    const CAP: usize = 4096;

    /// Claims `prefix` for a warming request starting `now`; `false` when one is in flight.
    pub fn claim(&self, prefix: u64, now: Instant) -> bool {
        let mut m = self.started.lock();
        if m.get(&prefix)
            .is_some_and(|&t| now.duration_since(t) < Self::TTL)
        {
            return false;
        }
        if m.len() >= Self::CAP {
            m.retain(|_, t| now.duration_since(*t) < Self::TTL);
        }
        m.insert(prefix, now);
        true
    }

    /// The warming request for `prefix` answered (or failed).
    pub fn release(&self, prefix: u64) {
        self.started.lock().remove(&prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warming_request_per_prefix_at_a_time() {
        let w = Warming::default();
        let t = Instant::now();
        assert!(w.claim(7, t));
        assert!(!w.claim(7, t + Duration::from_millis(100)), "in flight");
        assert!(w.claim(8, t), "another prefix");
        w.release(7);
        assert!(w.claim(7, t + Duration::from_millis(200)), "answered");
        assert!(w.claim(8, t + Warming::TTL), "given up on after the TTL");
    }
}
