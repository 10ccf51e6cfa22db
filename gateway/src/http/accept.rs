//! Accepting client connections within a budget. The accept loop holds one permit per open
//! connection: past `max_connections` a new connection gets a 503 at once and is closed, so
//! descriptors run out for nobody. When `accept()` itself fails (the process is out of
//! descriptors, say), the loop backs off exponentially (5 ms to 1 s) and logs once per 10 s
//! with the count, instead of spinning and writing a line per failure. The budget itself is
//! sized to the open-file limit ([`connection_budget`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::Counter;
use protocol::ApiError;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::http::conn::{canned, ConnMetrics};

/// Logs a repeated condition at most once per period, with how often it happened.
pub struct RateLimitedLog {
    period: Duration,
    state: parking_lot::Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    pub fn new(period: Duration) -> Self {
        RateLimitedLog {
            period,
            state: parking_lot::Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many to report when a line is due now.
    pub fn hit(&self) -> Option<u64> {
        let mut s = self.state.lock();
        s.1 += 1;
        let due = s.0.is_none_or(|t| t.elapsed() >= self.period);
        if due {
            let n = s.1;
            *s = (Some(Instant::now()), 0);
            Some(n)
        } else {
            None
        }
    }
}

/// The open-connection budget, sized to fit the open-file limit.
pub fn connection_budget(configured: usize) -> usize {
    // Raise the soft limit to the hard one, as nginx's worker_rlimit_nofile would.
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024) as usize;
    // Each client request also holds an upstream connection; keep room for replicas' event
    // streams, health checks, the admin port and files.
    let fits = limit.saturating_sub(256) / 2;
    let budget = configured.min(fits.max(16));
    if budget < configured {
        tracing::warn!(
            configured,
            budget,
            open_file_limit = limit,
            "downstream.max_connections lowered to fit the open-file limit"
        );
    }
    budget
}

/// Accepts connections until `stop` resolves, each with a permit of `slots`; runs `serve`
/// for each. Past the limit a connection gets a 503 and is closed at once.
pub async fn accept_loop<F, Fut>(
    listener: &TcpListener,
    name: &'static str,
    slots: Option<Arc<Semaphore>>,
    metrics: Option<Arc<ConnMetrics>>,
    errors: Counter,
    stop: impl std::future::Future<Output = ()>,
    serve: F,
) where
    F: Fn(TcpStream, Option<OwnedSemaphorePermit>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::pin!(stop);
    let log = RateLimitedLog::new(Duration::from_secs(10));
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return,
            r = listener.accept() => r,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => {
                backoff = Duration::ZERO;
                tcp
            }
            Err(e) => {
                errors.increment(1);
                if let Some(n) = log.hit() {
                    tracing::warn!(listener = name, error = %e, failures = n, "accept failed; backing off");
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let permit = match &slots {
            None => None,
            Some(s) => match s.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    if let Some(m) = &metrics {
                        m.refused.increment(1);
                    }
                    let e = ApiError::unavailable(
                        "the gateway is at its connection limit; retry shortly",
                    )
                    .with_code("connection_limit");
                    let resp = canned(503, "Service Unavailable", &e, "retry-after: 1\r\n");
                    let _ = tcp.try_write(&resp);
                    continue;
                }
            },
        };
        tokio::spawn(serve(tcp, permit));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_log_reports_counts() {
        let l = RateLimitedLog::new(Duration::from_secs(3600));
        assert_eq!(l.hit(), Some(1));
        assert_eq!(l.hit(), None);
        assert_eq!(l.hit(), None);
    }
}
