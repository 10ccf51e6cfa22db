//! Outlier detection, as Envoy does it: a replica that answers, but unusably — a 5xx, a body
//! that is not JSON, a stream that is not SSE, an event that does not parse, a stream past its
//! `max_tokens` or its size, a body that stalls — passes its health checks all the same, and
//! answering instantly it would draw most of the traffic. Each such answer is counted per
//! replica and reason (`kvgate_gateway_upstream_errors_total`); `outlier_consecutive_errors`
//! of them in a row eject the replica for `outlier_ejection_ms` × the times it was ejected
//! (capped at `outlier_max_ejection_ms`), during which its health checks cannot readmit it.
//! A usable answer ends the run. At most `outlier_max_ejected_percent` of the listed replicas
//! are held out at once this way (one always may be): garbage from the whole fleet is more
//! likely the gateway's own misreading than every replica failing.

use std::sync::atomic::Ordering;

use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;

impl Registry {
    /// `r` answered unusably (`reason`: a bounded label).
    pub fn upstream_failed(&self, r: &ReplicaHandle, reason: &'static str) {
        self.metrics
            .replica_counter(
                "kvgate_gateway_upstream_errors_total",
                r.label(),
                &r.name,
                &[("reason", reason)],
            )
            .increment(1);
        let h = &self.cfg.health;
        let fails = r.upstream_fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails < h.outlier_consecutive_errors || !r.is_healthy() {
            return;
        }
        let listed = self.listed().len();
        let held = self
            .replicas()
            .iter()
            .filter(|o| !o.is_retired() && self.outlier_held(o))
            .count();
        let allowed = (listed * h.outlier_max_ejected_percent as usize / 100).max(1);
        if held >= allowed {
            tracing::warn!(replica = %r.name, reason, fails, held, "outlier detection would eject this replica, but {held} of {listed} are held out already");
            return;
        }
        let times = r.outlier_ejections.fetch_add(1, Ordering::Relaxed) + 1;
        let ms = (h.outlier_ejection_ms * u64::from(times)).min(h.outlier_max_ejection_ms);
        r.outlier_until_ms
            .store(self.now_ms() + ms, Ordering::Relaxed);
        r.upstream_fails.store(0, Ordering::Relaxed);
        self.eject(r);
        self.metrics
            .replica_counter(
                "kvgate_gateway_outlier_ejections_total",
                r.label(),
                &r.name,
                &[],
            )
            .increment(1);
        tracing::warn!(replica = %r.name, reason, fails, ejected_ms = ms, "replica ejected as an outlier: its answers are unusable");
    }

    /// `r` answered usably: the run of unusable answers ends.
    pub fn upstream_ok(&self, r: &ReplicaHandle) {
        if r.upstream_fails.load(Ordering::Relaxed) != 0 {
            r.upstream_fails.store(0, Ordering::Relaxed);
        }
    }

    /// Whether `r` is still inside an outlier ejection (health checks do not readmit it).
    pub fn outlier_held(&self, r: &ReplicaHandle) -> bool {
        self.now_ms() < r.outlier_until_ms.load(Ordering::Relaxed)
    }
}
