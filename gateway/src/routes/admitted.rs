//! A dispatched request's share of its route's limits ([`Admitted`]): counted in the route's
//! in-flight requests and prompt tokens from the moment the admit stage lets it go, released
//! (and the route's queue woken) when the request ends, whichever way. It carries what the
//! stages after admission need of the decision: the replica chosen, the match it was chosen on,
//! the prefill reserved there and how long the request waited.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use policies::RouteDecision;

use crate::fleet::guards::PendingPrefill;
use crate::fleet::replica::Joined;
use crate::routes::runtime::RouteRuntime;

/// A dispatched request's share of its route's limits, released (and the queue woken) when
/// the request ends.
pub struct Admitted {
    rt: Arc<RouteRuntime>,
    tokens: u64,
    pub decision: RouteDecision,
    /// The chosen replica's share of queued prefill, taken at the decision so the next
    /// decision already sees it; with what it found in front of it there (prefill ahead, the
    /// running step's rest, the decode step it joins).
    pub pending: Option<(PendingPrefill, Joined)>,
    /// Blocks of the prompt the index believed cached at each replica.
    pub matched: Vec<usize>,
    pub queued: Duration,
}

impl Admitted {
    pub fn new(
        rt: Arc<RouteRuntime>,
        tokens: u64,
        decision: RouteDecision,
        matched: Vec<usize>,
        queued: Duration,
        pending: (PendingPrefill, Joined),
    ) -> Self {
        rt.in_flight.fetch_add(1, Ordering::Relaxed);
        rt.in_flight_tokens.fetch_add(tokens, Ordering::Relaxed);
        rt.stats.queue_seconds.record(queued.as_secs_f64());
        rt.update_gauges();
        Admitted {
            rt,
            tokens,
            decision,
            pending: Some(pending),
            matched,
            queued,
        }
    }

    pub fn route(&self) -> &Arc<RouteRuntime> {
        &self.rt
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.rt.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.rt
            .in_flight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
        self.rt.update_gauges();
        self.rt.wake();
    }
}
