//! A replica's measured throughput: its own generated-token counter (kvgate's `/get_load`,
//! vLLM's `vllm:generation_tokens_total`), sampled at every load poll and turned into tokens
//! per second over a sliding window. The replica's counter, not what this gateway relayed, so
//! the figure is the replica's whole output however many gateways share it.
//!
//! The same sliding rate turns a busy-time counter into the replica's utilisation: kvgate
//! replicas count the microseconds their steps took (`busy_seconds` on `/get_load`); for an
//! engine that counts none (vLLM), [`BusyClock`] makes one from the polls.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How far back samples are kept (`cost.window_s` is at most this).
const MAX_AGE: Duration = Duration::from_secs(600);

/// `(when, counter)` samples of one replica's generated-token counter.
#[derive(Debug, Default)]
pub struct Throughput {
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl Throughput {
    /// Records the counter read at `at`, keeping about one sample a second whatever the poll
    /// interval (a newer reading within a second of the one before the last replaces the
    /// last). A counter that went down (the replica restarted) starts the window again.
    pub fn sample(&self, at: Instant, total: u64) {
        let mut s = self.samples.lock();
        if s.back().is_some_and(|&(_, last)| total < last) {
            s.clear();
        }
        let n = s.len();
        if n >= 2 && at.saturating_duration_since(s[n - 2].0) < Duration::from_secs(1) {
            s[n - 1] = (at, total);
        } else {
            s.push_back((at, total));
        }
        while s
            .front()
            .is_some_and(|(t, _)| at.saturating_duration_since(*t) > MAX_AGE)
        {
            s.pop_front();
        }
    }

    /// Tokens per second over the last `window` before `now` (from the oldest sample inside
    /// it to the newest); `None` before two samples span at least a second.
    pub fn tokens_per_s(&self, now: Instant, window: Duration) -> Option<f64> {
        let s = self.samples.lock();
        let &(t1, c1) = s.back()?;
        let &(t0, c0) = s
            .iter()
            .find(|(t, _)| now.saturating_duration_since(*t) <= window)?;
        let span = t1.saturating_duration_since(t0).as_secs_f64();
        (span >= 1.0).then(|| (c1 - c0) as f64 / span)
    }
}

/// A busy-time counter made from load polls, for engines that report none: each poll that
/// finds requests running counts the time since the previous poll as busy (so the share is
/// exact to within one poll interval at each edge of a busy period).
#[derive(Debug, Default)]
pub struct BusyClock {
    last: Mutex<Option<(Instant, u64)>>,
}

impl BusyClock {
    /// Notes a poll at `at` that found work (`busy`) or none; returns busy microseconds so far.
    pub fn tick(&self, at: Instant, busy: bool) -> u64 {
        let mut last = self.last.lock();
        let total = match *last {
            Some((t, c)) if busy => c + at.saturating_duration_since(t).as_micros() as u64,
            Some((_, c)) => c,
            None => 0,
        };
        *last = Some((at, total));
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_that_find_work_count_their_interval_as_busy() {
        let (c, t) = (BusyClock::default(), Throughput::default());
        let t0 = Instant::now();
        // Busy one poll in four, polls every 250 ms, for 20 s: a quarter of the time.
        for i in 0..=80u64 {
            let at = t0 + Duration::from_millis(250 * i);
            t.sample(at, c.tick(at, i % 4 == 0));
        }
        let share = t
            .tokens_per_s(t0 + Duration::from_secs(20), Duration::from_secs(60))
            .unwrap()
            / 1e6;
        assert!((share - 0.25).abs() < 0.02, "{share}");
    }

    #[test]
    fn rate_over_the_window_and_a_restart_starts_again() {
        let t = Throughput::default();
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        t.sample(s(0), 0);
        assert_eq!(t.tokens_per_s(s(0), Duration::from_secs(60)), None);
        for i in 1..=100 {
            t.sample(s(i), i * 50);
        }
        // The last 10 s: 50 tokens/s.
        let r = t.tokens_per_s(s(100), Duration::from_secs(10)).unwrap();
        assert!((r - 50.0).abs() < 1e-9, "{r}");
        t.sample(s(101), 7);
        assert_eq!(t.tokens_per_s(s(101), Duration::from_secs(60)), None);
        t.sample(s(103), 207);
        let r = t.tokens_per_s(s(103), Duration::from_secs(60)).unwrap();
        assert!((r - 100.0).abs() < 1e-9, "{r}");
        // A fast poll keeps about one sample a second, and the rate is the same.
        let f = Throughput::default();
        for i in 0..=400u64 {
            f.sample(t0 + Duration::from_millis(50 * i), i * 5);
        }
        assert!(f.samples.lock().len() <= 25, "{}", f.samples.lock().len());
        let r = f
            .tokens_per_s(t0 + Duration::from_secs(20), Duration::from_secs(60))
            .unwrap();
        assert!((r - 100.0).abs() < 1e-6, "{r}");
    }
}
