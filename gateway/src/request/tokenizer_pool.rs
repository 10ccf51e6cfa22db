//! The tokeniser pool: at most `tokenize_concurrency` prompts are tokenised at once (it is CPU
//! work, on the blocking pool), and the others wait their turn in a bounded queue ordered as the
//! routes' admission queues are — interactive before batch, then first come, first served —
//! rather than racing for a semaphore on a fixed timer. A request is refused (429
//! `tokenizer_busy`, counted by reason) only when the queue is full (`tokenize_queue_max`
//! requests or `tokenize_queue_max_mib` of waiting bodies), or when it has waited past
//! `tokenize_queue_timeout_ms` (0, the default: no timer). A request whose client leaves gives
//! up its place.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Why a request got no tokeniser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// The queue holds as many requests, or as many body bytes, as it may.
    QueueFull,
    /// It waited `tokenize_queue_timeout_ms`.
    Timeout,
}

impl Busy {
    pub fn label(self) -> &'static str {
        match self {
            Busy::QueueFull => "queue_full",
            Busy::Timeout => "queue_timeout",
        }
    }
}

/// The pool's size and its queue's bounds.
#[derive(Debug, Clone, Copy)]
pub struct PoolLimits {
    pub slots: usize,
    pub max_waiting: usize,
    pub max_waiting_bytes: usize,
    /// `None`: wait as long as the queue has room.
    pub timeout: Option<Duration>,
}

#[derive(Default)]
struct State {
    busy: usize,
    /// (priority rank, arrival) → body bytes.
    waiting: BTreeMap<(u8, u64), usize>,
    waiting_bytes: usize,
    next: u64,
}

/// A bounded, ordered pool of tokeniser slots.
pub struct TokenizerPool {
    limits: PoolLimits,
    state: Mutex<State>,
    freed: Notify,
}

/// A tokeniser slot, given back when dropped.
pub struct Slot(Arc<TokenizerPool>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.state.lock().busy -= 1;
        self.0.freed.notify_waiters();
    }
}

/// A place in the queue, given up when dropped (served, refused, or the client left).
struct Place<'a> {
    pool: &'a TokenizerPool,
    key: (u8, u64),
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut s = self.pool.state.lock();
        if let Some(bytes) = s.waiting.remove(&self.key) {
            s.waiting_bytes -= bytes;
        }
        drop(s);
        self.pool.freed.notify_waiters();
    }
}

impl TokenizerPool {
    pub fn new(limits: PoolLimits) -> Arc<Self> {
        Arc::new(TokenizerPool {
            limits,
            state: Mutex::new(State::default()),
            freed: Notify::new(),
        })
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.state.lock().waiting.len()
    }

    /// A slot for a request of priority `rank` (lower goes first) carrying `bytes` of body:
    /// at once when one is free and nobody is ahead, else after those ahead.
    pub async fn acquire(self: &Arc<Self>, rank: u8, bytes: usize) -> Result<Slot, Busy> {
        let key = {
            let mut s = self.state.lock();
            if s.waiting.is_empty() && s.busy < self.limits.slots {
                s.busy += 1;
                return Ok(Slot(self.clone()));
            }
            if s.waiting.len() >= self.limits.max_waiting
                || s.waiting_bytes + bytes > self.limits.max_waiting_bytes
            {
                return Err(Busy::QueueFull);
            }
            let key = (rank, s.next);
            s.next += 1;
            s.waiting.insert(key, bytes);
            s.waiting_bytes += bytes;
            key
        };
        let place = Place { pool: self, key };
        let wait = async {
            loop {
                let freed = self.freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                {
                    let mut s = self.state.lock();
                    let first = s.waiting.keys().next() == Some(&key);
                    if first && s.busy < self.limits.slots {
                        s.busy += 1;
                        if let Some(b) = s.waiting.remove(&key) {
                            s.waiting_bytes -= b;
                        }
                        return Slot(self.clone());
                    }
                }
                freed.await;
            }
        };
        let slot = match self.limits.timeout {
            Some(t) => tokio::time::timeout(t, wait)
                .await
                .map_err(|_| Busy::Timeout)?,
            None => wait.await,
        };
        drop(place);
        Ok(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(slots: usize, max_waiting: usize, timeout: Option<Duration>) -> Arc<TokenizerPool> {
        TokenizerPool::new(PoolLimits {
            slots,
            max_waiting,
            max_waiting_bytes: 1 << 20,
            timeout,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_go_interactive_first_then_in_arrival_order() {
        let p = pool(1, 8, None);
        let held = p.acquire(0, 10).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, rank) in [
            ("batch-1", 1),
            ("inter-1", 0),
            ("batch-2", 1),
            ("inter-2", 0),
        ] {
            let (p, order) = (p.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _slot = p.acquire(rank, 10).await.unwrap();
                order.lock().push(name);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(p.waiting(), 4);
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            *order.lock(),
            vec!["inter-1", "inter-2", "batch-1", "batch-2"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_a_timer_only_when_set() {
        let p = pool(1, 1, None);
        let _held = p.acquire(0, 10).await.unwrap();
        let p2 = p.clone();
        let waiter = tokio::spawn(async move { p2.acquire(0, 10).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(p.acquire(0, 10).await.err(), Some(Busy::QueueFull));
        // No timer: the waiter is still waiting a minute later.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!waiter.is_finished());
        waiter.abort();
        let _ = waiter.await;
        tokio::task::yield_now().await;
        assert_eq!(p.waiting(), 0, "an abandoned place is given up");
        let timed = pool(1, 4, Some(Duration::from_millis(500)));
        let _held = timed.acquire(0, 10).await.unwrap();
        assert_eq!(timed.acquire(0, 10).await.err(), Some(Busy::Timeout));
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_bodies_are_bounded_in_bytes() {
        let p = TokenizerPool::new(PoolLimits {
            slots: 1,
            max_waiting: 100,
            max_waiting_bytes: 1000,
            timeout: None,
        });
        let _held = p.acquire(0, 10).await.unwrap();
        let p2 = p.clone();
        let _w = tokio::spawn(async move { p2.acquire(0, 800).await.map(|_| ()) });
        tokio::task::yield_now().await;
        assert_eq!(p.acquire(0, 300).await.err(), Some(Busy::QueueFull));
    }
}
