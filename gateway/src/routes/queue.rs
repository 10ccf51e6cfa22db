//! Waiting requests of one route, in (priority, deadline) order, bounded: a request whose TTFT
//! deadline has passed, or that finds the queue full, is shed with a Retry-After estimated
//! from the backlog (the admit stage, `request/admit.rs`, decides when; this holds the order and
//! the arithmetic).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// Why a request was answered with 429.
#[derive(Debug, Clone, PartialEq)]
pub enum Shed {
    QueueFull {
        retry_after: Duration,
    },
    DeadlineGone {
        retry_after: Duration,
    },
    /// Waited the route's whole queue timeout.
    Timeout {
        retry_after: Duration,
    },
}

impl Shed {
    pub fn label(&self) -> &'static str {
        match self {
            Shed::QueueFull { .. } => "queue_full",
            Shed::DeadlineGone { .. } => "deadline",
            Shed::Timeout { .. } => "timeout",
        }
    }

    /// Whole seconds for the `Retry-After` header (at least 1).
    pub fn retry_after_secs(&self) -> u64 {
        let d = match self {
            Shed::QueueFull { retry_after }
            | Shed::DeadlineGone { retry_after }
            | Shed::Timeout { retry_after } => *retry_after,
        };
        d.as_secs_f64().ceil().max(1.0) as u64
    }
}

/// A waiting request's place in the queue.
pub type Ticket = u64;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Waiter {
    tokens: u64,
    /// Its last attempt found no room in the route (its limits, or no admissible replica in
    /// its pool), or it has not tried yet: those behind it wait their turn. A waiter that only
    /// waits for its preferred replica (affinity patience) blocks nobody — the requests behind
    /// it may well be bound for other replicas.
    route_bound: bool,
}

/// Waiting requests of one route, in (priority, deadline) order, bounded.
pub struct AdmissionQueue {
    capacity: AtomicUsize,
    /// Places taken in this route's queues at the peer gateways (the capacity is the
    /// fleet's), as last heard.
    others: AtomicUsize,
    next: AtomicU64,
    entries: Mutex<BTreeMap<(i32, Duration, Ticket), Waiter>>,
}

impl AdmissionQueue {
    pub fn new(capacity: usize) -> Self {
        AdmissionQueue {
            capacity: AtomicUsize::new(capacity),
            others: AtomicUsize::new(0),
            next: AtomicU64::new(0),
            entries: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// A reloaded policy may resize the queue; waiters already in it stay.
    pub fn set_capacity(&self, capacity: usize) {
        self.capacity.store(capacity, Ordering::Relaxed);
    }

    pub fn is_empty(&self) -> bool {
        self.entries.lock().is_empty()
    }

    /// Places taken at the peer gateways, as last heard.
    pub fn others(&self) -> usize {
        self.others.load(Ordering::Relaxed)
    }

    /// Places taken at the peer gateways, as just heard.
    pub fn set_others(&self, others: usize) {
        self.others.store(others, Ordering::Relaxed);
    }

    /// A new waiter would be shed with `queue_full`: the fleet's places (this queue's and
    /// the peers') are all taken.
    pub fn is_full(&self) -> bool {
        self.len() + self.others.load(Ordering::Relaxed) >= self.capacity.load(Ordering::Relaxed)
    }

    /// Prompt tokens waiting in the queue.
    pub fn backlog_tokens(&self) -> u64 {
        self.entries.lock().values().map(|w| w.tokens).sum()
    }

    /// Time for `rate` tokens/s of fleet prefill to work through the backlog: the wait a shed
    /// client is asked to observe.
    pub fn retry_after(&self, fleet_prefill_rate: Option<f64>) -> Duration {
        match fleet_prefill_rate {
            Some(r) if r > 0.0 => Duration::from_secs_f64(self.backlog_tokens() as f64 / r),
            _ => Duration::from_secs(1),
        }
    }

    /// Queues a request (lower `priority` first, then earlier `deadline`), or sheds it when
    /// the queue is full.
    pub fn push(
        &self,
        priority: i32,
        deadline: Duration,
        tokens: u64,
        fleet_prefill_rate: Option<f64>,
    ) -> Result<Ticket, Shed> {
        if self.is_full() {
            return Err(Shed::QueueFull {
                retry_after: self.retry_after(fleet_prefill_rate),
            });
        }
        let t = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries.lock().insert(
            (priority, deadline, t),
            Waiter {
                tokens,
                route_bound: true,
            },
        );
        Ok(t)
    }

    /// Records why `ticket`'s last attempt was held.
    pub fn set_route_bound(&self, ticket: Ticket, route_bound: bool) {
        if let Some(w) = self
            .entries
            .lock()
            .iter_mut()
            .find(|(k, _)| k.2 == ticket)
            .map(|(_, w)| w)
        {
            w.route_bound = route_bound;
        }
    }

    /// Whether `ticket` (or, with `None`, a newcomer) may try now: no waiter ahead of it is
    /// held by the route's own limits.
    pub fn may_try(&self, ticket: Option<Ticket>) -> bool {
        let e = self.entries.lock();
        for (k, w) in e.iter() {
            if Some(k.2) == ticket {
                return true;
            }
            if w.route_bound {
                return false;
            }
        }
        true
    }

    /// The ticket to try next.
    pub fn head(&self) -> Option<Ticket> {
        self.entries.lock().keys().next().map(|k| k.2)
    }

    /// Removes a ticket (dispatched, or its client went away).
    pub fn remove(&self, ticket: Ticket) -> bool {
        let mut e = self.entries.lock();
        let key = e.keys().find(|k| k.2 == ticket).copied();
        key.is_some_and(|k| e.remove(&k).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn waiters_held_by_their_replica_do_not_block_the_queue() {
        let q = AdmissionQueue::new(8);
        let a = q.push(0, 100 * MS, 10, None).unwrap();
        let b = q.push(0, 200 * MS, 10, None).unwrap();
        // a has not tried yet: b waits its turn, and so would a newcomer.
        assert!(q.may_try(Some(a)));
        assert!(!q.may_try(Some(b)));
        assert!(!q.may_try(None));
        // a is held by its replica's stalls: b may try; a newcomer once b has tried too.
        q.set_route_bound(a, false);
        assert!(q.may_try(Some(b)));
        assert!(!q.may_try(None));
        q.set_route_bound(b, false);
        assert!(q.may_try(None));
        // a is held by the route's concurrency limit: first come, first served again.
        q.set_route_bound(a, true);
        assert!(!q.may_try(Some(b)));
    }

    #[test]
    fn queue_orders_by_priority_then_deadline() {
        let q = AdmissionQueue::new(10);
        let batch = q.push(1, 100 * MS, 10, None).unwrap();
        let late = q.push(0, 900 * MS, 10, None).unwrap();
        let soon = q.push(0, 200 * MS, 10, None).unwrap();
        assert_eq!(q.head(), Some(soon));
        assert!(q.remove(soon));
        assert_eq!(q.head(), Some(late));
        assert!(q.remove(late));
        assert_eq!(q.head(), Some(batch));
    }

    #[test]
    fn sheds_with_a_correct_retry_after_when_the_deadline_is_gone() {
        let clock = ManualClock::default();
        let q = AdmissionQueue::new(2);
        let a = q
            .push(0, clock.now() + 1000 * MS, 20_000, Some(10_000.0))
            .unwrap();
        let b = q
            .push(0, clock.now() + 3000 * MS, 5_000, Some(10_000.0))
            .unwrap();
        // Full: shed at once, told to wait for the 25k-token backlog at 10k tokens/s.
        let full = q
            .push(0, clock.now() + 1000 * MS, 1, Some(10_000.0))
            .unwrap_err();
        assert_eq!(
            full,
            Shed::QueueFull {
                retry_after: 2500 * MS
            }
        );
        assert_eq!(full.retry_after_secs(), 3);
        // The first waiter leaves (its deadline passed: dispatch sheds it); the backlog that
        // remains is b's 5k tokens, half a second at 10k tokens/s.
        clock.advance(1500 * MS);
        assert!(q.remove(a));
        let retry_after = q.retry_after(Some(10_000.0));
        assert_eq!(retry_after, 500 * MS);
        assert_eq!(Shed::DeadlineGone { retry_after }.retry_after_secs(), 1);
        assert_eq!(q.head(), Some(b));
        assert_eq!(q.len(), 1);
    }
}
