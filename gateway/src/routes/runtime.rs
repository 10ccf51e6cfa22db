//! A route's live state — its admission queue, what it has in flight (requests and prompt
//! tokens), its wake-up signal and its metrics — kept across policy reloads by route name. The
//! policy store holds one per route; the admit stage (`request/admit.rs`) reserves through it
//! and its [`Admitted`](crate::routes::admitted::Admitted) releases.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::metrics::GatewayMetrics;
use crate::routes::goodput::RouteStats;
use crate::routes::queue::AdmissionQueue;

/// One route's use of its limits at one gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteUse {
    pub in_flight: u32,
    pub tokens: u64,
    pub queued: u32,
}

impl RouteUse {
    pub fn add(&mut self, o: &RouteUse) {
        self.in_flight += o.in_flight;
        self.tokens += o.tokens;
        self.queued += o.queued;
    }
}

/// A route's live state, kept across policy reloads by route name.
pub struct RouteRuntime {
    pub name: String,
    pub queue: AdmissionQueue,
    pub(crate) in_flight: AtomicU32,
    pub(crate) in_flight_tokens: AtomicU64,
    /// The route's use at the peer gateways, as last heard (`peers.rs`): requests and prompt
    /// tokens in flight (their queued requests are the queue's `others`).
    peer_in_flight: AtomicU32,
    peer_tokens: AtomicU64,
    pub(crate) notify: Notify,
    pub stats: RouteStats,
    clock: SystemClock,
}

impl RouteRuntime {
    pub fn new(name: &str, metrics: Arc<GatewayMetrics>) -> Self {
        RouteRuntime {
            name: name.to_string(),
            queue: AdmissionQueue::new(0),
            in_flight: AtomicU32::new(0),
            in_flight_tokens: AtomicU64::new(0),
            peer_in_flight: AtomicU32::new(0),
            peer_tokens: AtomicU64::new(0),
            notify: Notify::new(),
            stats: RouteStats::new(&metrics, name),
            clock: SystemClock::default(),
        }
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn in_flight_tokens(&self) -> u64 {
        self.in_flight_tokens.load(Ordering::Relaxed)
    }

    /// Requests in flight on this route at every gateway of the fleet (this one's own count
    /// plus its peers' as last heard): what `max_concurrency` is checked against.
    pub fn fleet_in_flight(&self) -> u32 {
        self.in_flight() + self.peer_in_flight.load(Ordering::Relaxed)
    }

    /// Prompt tokens in flight on this route fleet-wide (`max_prompt_tokens_in_flight`).
    pub fn fleet_in_flight_tokens(&self) -> u64 {
        self.in_flight_tokens() + self.peer_tokens.load(Ordering::Relaxed)
    }

    /// The route's use at the peers, as just heard; waiters are woken when it fell (room
    /// opened at another gateway).
    pub fn set_peer_use(&self, u: RouteUse) {
        let before = self.peer_in_flight.swap(u.in_flight, Ordering::Relaxed);
        let tokens_before = self.peer_tokens.swap(u.tokens, Ordering::Relaxed);
        self.queue.set_others(u.queued as usize);
        if u.in_flight < before || u.tokens < tokens_before {
            self.wake();
        }
    }

    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    pub fn now_s(&self) -> u64 {
        self.clock.now().as_secs()
    }

    pub(crate) fn wake(&self) {
        self.notify.notify_waiters();
    }

    pub(crate) fn update_gauges(&self) {
        self.stats.in_flight.set(f64::from(self.in_flight()));
        self.stats.queued.set(self.queue.len() as f64);
    }
}
