//! Draining. On SIGTERM the gateway stops accepting connections and answers `/health` with
//! 503 (so load balancers take it out), lets the requests it has — queued, waiting for a first
//! token or streaming — finish, and exits once none is left or the drain deadline passes. At
//! the deadline the streams still open are ended with an error event rather than cut silently.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

#[derive(Debug)]
pub struct Lifecycle {
    draining: AtomicBool,
    active: AtomicUsize,
    idle: Notify,
    /// Flips to true at the drain deadline: whatever is still streaming is ended.
    abort: watch::Sender<bool>,
    /// When the gateway was built (readiness waits for the index from then, `/ready`).
    pub started: Instant,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            draining: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            idle: Notify::new(),
            abort: watch::Sender::new(false),
            started: Instant::now(),
        }
    }
}

/// One request in progress; the drain waits for every one of them.
pub struct Active(Arc<Lifecycle>);

impl Drop for Active {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Lifecycle {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    pub fn enter(self: &Arc<Self>) -> Active {
        self.active.fetch_add(1, Ordering::AcqRel);
        Active(self.clone())
    }

    /// Resolves when the drain deadline has passed and open responses must end.
    pub fn aborted(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.abort.subscribe();
        async move {
            let _ = rx.wait_for(|a| *a).await;
        }
    }

    /// Starts draining and waits until no request is left or `deadline` passes; then ends the
    /// open ones and gives their relays `grace` to write the error event. Returns how many
    /// were still open at the deadline.
    pub async fn drain(&self, deadline: Duration, grace: Duration) -> usize {
        self.draining.store(true, Ordering::Release);
        let wait_idle = async {
            loop {
                let notified = self.idle.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.active() == 0 {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(deadline, wait_idle).await.is_ok() {
            return 0;
        }
        let left = self.active();
        self.abort.send_replace(true);
        let _ = tokio::time::timeout(grace, async {
            while self.active() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_requests_then_ends_the_rest() {
        let l = Arc::new(Lifecycle::default());
        let a = l.enter();
        let b = l.enter();
        let l2 = l.clone();
        let ended = tokio::spawn(async move {
            l2.aborted().await;
        });
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(a);
        });
        let left = l
            .drain(Duration::from_secs(5), Duration::from_millis(100))
            .await;
        assert!(l.is_draining());
        assert_eq!(left, 1, "b was still open at the deadline");
        ended.await.unwrap();
        drop(b);
        assert_eq!(l.active(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn drain_returns_as_soon_as_idle() {
        let l = Arc::new(Lifecycle::default());
        let a = l.enter();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(a);
        });
        let t0 = tokio::time::Instant::now();
        assert_eq!(l.drain(Duration::from_secs(30), Duration::ZERO).await, 0);
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
