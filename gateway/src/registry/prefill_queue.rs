//! The prefill this gateway has sent to one replica and not yet seen answered: the work in
//! front of the next request there. Counted in uncached prompt tokens from the moment a
//! request is sent until its first byte comes back.
//!
//! What is still *to do* is less than what is outstanding: the replica has been prefilling
//! since the queue last became non-empty (a busy period), at the rate the latency model has
//! learnt. A burst's followers, arriving while the first request's prefill is half done, see
//! half of it in front of them, not all of it: counting all of it made a holder look slower
//! than a cold replica and spread bursts over replicas that then paid for the whole prefix
//! (BENCHMARKS, issue 11, bursty traffic on A100-sized caches).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Default)]
struct BusyPeriod {
    /// When the outstanding count last rose from zero.
    since: Option<Instant>,
    /// Tokens of requests answered since then (their prefill is part of the work done).
    answered: u64,
}

#[derive(Debug, Default)]
pub struct PrefillQueue {
    outstanding: AtomicU64,
    busy: parking_lot::Mutex<BusyPeriod>,
}

impl PrefillQueue {
    /// Prefill sent and not answered, whatever was done of it.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// The outstanding prefill the replica has not done yet at `now`, had it worked through
    /// it since the busy period began at `seconds_per_token` after `overhead_s`.
    pub fn remaining(&self, now: Instant, overhead_s: f64, seconds_per_token: f64) -> u64 {
        let busy = self.busy.lock();
        let outstanding = self.outstanding();
        let Some(since) = busy.since else {
            return outstanding;
        };
        if seconds_per_token <= 0.0 {
            return outstanding;
        }
        let working = (now.saturating_duration_since(since).as_secs_f64() - overhead_s).max(0.0);
        let done = (working / seconds_per_token) as u64;
        outstanding.saturating_sub(done.saturating_sub(busy.answered))
    }

    /// Adds a request's `tokens`; returns the prefill still to do in front of it.
    pub fn add(&self, tokens: u64, now: Instant, overhead_s: f64, seconds_per_token: f64) -> u64 {
        let ahead = self.remaining(now, overhead_s, seconds_per_token);
        let mut busy = self.busy.lock();
        if self.outstanding.fetch_add(tokens, Ordering::Relaxed) == 0 {
            *busy = BusyPeriod {
                since: Some(now),
                answered: 0,
            };
        }
        ahead
    }

    /// A request's `tokens` were answered (first byte) or abandoned.
    pub fn done(&self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let mut busy = self.busy.lock();
        let before = self.outstanding.fetch_sub(tokens, Ordering::Relaxed);
        if before <= tokens {
            *busy = BusyPeriod::default();
        } else {
            busy.answered += tokens;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SPT: f64 = 1.0 / 2_000.0; // 2,000 tokens a second

    #[test]
    fn a_follower_sees_only_the_prefill_left_to_do() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        assert_eq!(q.add(1_400, t0, 0.02, SPT), 0);
        // 0.37 s later: 0.35 s of work done (700 tokens) of the 1,400.
        let ahead = q.add(50, t0 + Duration::from_millis(370), 0.02, SPT);
        assert!((690..=710).contains(&ahead), "{ahead}");
        assert_eq!(q.outstanding(), 1_450);
        // Long after, nothing is left to do even before the answers come back.
        assert_eq!(q.remaining(t0 + Duration::from_secs(5), 0.02, SPT), 0);
    }

    #[test]
    fn answered_work_is_not_counted_twice_and_an_empty_queue_starts_a_new_period() {
        let q = PrefillQueue::default();
        let t0 = Instant::now();
        q.add(1_000, t0, 0.0, SPT);
        q.add(1_000, t0, 0.0, SPT);
        // 0.6 s: 1,200 tokens done; the first request is answered.
        q.done(1_000);
        let left = q.remaining(t0 + Duration::from_millis(600), 0.0, SPT);
        assert!((790..=810).contains(&left), "{left}");
        q.done(1_000);
        assert_eq!(q.outstanding(), 0);
        // A new busy period: nothing done of new work yet.
        let t1 = t0 + Duration::from_secs(10);
        q.add(500, t1, 0.0, SPT);
        assert_eq!(q.remaining(t1, 0.0, SPT), 500);
    }
}
