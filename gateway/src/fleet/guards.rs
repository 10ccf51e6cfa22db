//! What a request holds at a replica while it is there: [`InFlight`] counts it in the replica's
//! in-flight load, [`PendingPrefill`] counts its uncached prompt tokens as prefill queued there
//! until its first byte. Both are released when dropped, whatever way the request ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::fleet::prefill_queue::PrefillQueue;
use crate::fleet::replica::{Joined, ReplicaHandle};

/// byte arrives (`done`) or it ends.
pub struct PendingPrefill {
    replica: Arc<ReplicaHandle>,
    /// The request's place in the replica's queue; `None` once answered.
    id: Option<u64>,
    /// In the replica's background queue (a route with `engine_priority` above 0).
    background: bool,
}

impl PendingPrefill {
    /// Adds `tokens` (the uncached part of a prompt whose block hashes are `blocks`), sent
    /// now; returns the guard and what they find in front of them there. A `background`
    /// request (the batch class on a route with an `engine_priority` above 0) is queued apart:
    /// the replica serves foreground prefill first, so it is not ahead of the next
    /// interactive request.
    pub fn new(
        replica: Arc<ReplicaHandle>,
        tokens: u64,
        blocks: Arc<[u64]>,
        background: bool,
    ) -> (Self, Joined) {
        let now = Instant::now();
        let joined = replica.joined(now);
        let id = replica
            .queue(background)
            .add(tokens, blocks, now, joined.ahead);
        (
            PendingPrefill {
                replica,
                id: Some(id),
                background,
            },
            joined,
        )
    }

    /// The request (`cached` prompt tokens before its own) is unstreamed: no first byte will
    /// say when its prefill is done ([`crate::fleet::prefill_queue::PrefillQueue::unstreamed`]).
    pub fn unstreamed(&self, cached: u64) {
        if let Some(id) = self.id {
            let fit = self.replica.model.lock().ttft_plane();
            self.replica
                .queue(self.background)
                .unstreamed(id, cached, &fit);
        }
    }

    pub fn done(&mut self) {
        if let Some(id) = self.id.take() {
            self.replica.queue(self.background).done(id, Instant::now());
        }
    }
}

impl ReplicaHandle {
    fn queue(&self, background: bool) -> &PrefillQueue {
        if background {
            &self.background_prefill
        } else {
            &self.prefill
        }
    }
}

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        self.done();
    }
}

/// Counts a request in flight at a replica, and its prompt tokens in the context there, for
/// as long as it lives; a `background` one (a route with an `engine_priority` above 0, such as
/// the batch class) in the replica's background count too.
pub struct InFlight(Arc<ReplicaHandle>, u64, bool);

impl InFlight {
    pub fn new(r: Arc<ReplicaHandle>, prompt_tokens: u64, background: bool) -> Self {
        r.in_flight.fetch_add(1, Ordering::Relaxed);
        if background {
            r.background_in_flight.fetch_add(1, Ordering::Relaxed);
        }
        r.context_in_flight
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        InFlight(r, prompt_tokens, background)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.2 {
            self.0.background_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        self.0
            .context_in_flight
            .fetch_sub(self.1, Ordering::Relaxed);
        self.0.finished.fetch_add(1, Ordering::Relaxed);
    }
}
