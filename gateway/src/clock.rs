//! Where admission's time comes from: a [`Clock`] gives seconds since an arbitrary origin —
//! [`SystemClock`] in the gateway, [`ManualClock`] in tests, which moves only when told to — so
//! queue deadlines, waits and sheds are tested without sleeping.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Time source: seconds since an arbitrary origin.
pub trait Clock: Send + Sync {
    fn now(&self) -> Duration;
}

pub struct SystemClock(Instant);

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock(Instant::now())
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// A clock that moves only when told to.
#[derive(Default)]
pub struct ManualClock(Mutex<Duration>);

impl ManualClock {
    pub fn advance(&self, d: Duration) {
        *self.0.lock() += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        *self.0.lock()
    }
}
