//! A replica as admission sees it ([`ReplicaPressure`]): running requests, the prefill queued
//! ahead, KV usage projected past the last load report, and whether it preempted recently.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::fleet::registry::Registry;

/// A replica's state as admission sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaPressure {
    pub running: u32,
    /// Uncached prompt tokens queued ahead of a new request.
    pub queued_prefill_tokens: u64,
    pub kv_usage: f64,
    /// Preemptions rose since the last poll.
    pub preempting: bool,
}

impl Registry {
    /// Records `tokens` of prompt sent to replica `slot` (projected KV until the next report),
    /// and, when it was sent there to use `matched_blocks` of its cache, one use of that cache
    /// (its reuse rate).
    pub fn note_dispatch(&self, slot: usize, tokens: u64, matched_blocks: usize) {
        if let Some(r) = self.replica(slot) {
            r.since_poll_tokens.fetch_add(tokens, Ordering::Relaxed);
            if matched_blocks > 0 {
                r.reuse.note(std::time::Instant::now());
            }
        }
    }

    /// Replica `slot` as admission sees it for a request of `own_tokens` prompt tokens: KV
    /// usage is projected from the last report plus what was sent since plus this request (the
    /// report lags by up to a poll interval, and a burst admitted inside one would otherwise all
    /// see the old figure); preemptions count as rising for `holdoff` after a poll saw the
    /// counter grow.
    pub fn pressure(&self, slot: usize, holdoff: Duration, own_tokens: u64) -> ReplicaPressure {
        let Some(r) = self.replica(slot) else {
            return ReplicaPressure::default();
        };
        let l = r.load();
        let at = r.preempted_at_ms.load(Ordering::Relaxed);
        let capacity = r.capacity_tokens.load(Ordering::Relaxed);
        let projected = if capacity > 0 {
            let extra = r.since_poll_tokens.load(Ordering::Relaxed) + own_tokens;
            l.kv_usage + extra as f64 / capacity as f64
        } else {
            l.kv_usage
        };
        ReplicaPressure {
            running: l.requests(),
            queued_prefill_tokens: r.own_prefill_remaining()
                + r.peer_prefill.load(Ordering::Relaxed),
            kv_usage: projected,
            preempting: at > 0 && self.now_ms() + 1 < at + holdoff.as_millis() as u64,
        }
    }
}
