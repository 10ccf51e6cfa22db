//! Health checks: the address re-resolved, `GET /health` with a deadline, ejection after
//! consecutive failures and readmission after consecutive passes, the replica's label settled
//! from what it reports about itself before it is first admitted.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;

use crate::fleet::client::FetchError;
use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;

impl Registry {
    pub(super) fn record_check(&self, r: &ReplicaHandle, ok: bool) {
        let h = &self.cfg.health;
        if ok {
            r.fails.store(0, Ordering::Relaxed);
            let oks = r.oks.fetch_add(1, Ordering::Relaxed) + 1;
            // The first pass admits a replica that was never seen; a previously ejected one
            // needs `successes_to_readmit` in a row.
            let never_seen = oks == 1 && r.fails.load(Ordering::Relaxed) == 0;
            if !r.is_healthy()
                && (oks >= h.successes_to_readmit || never_seen)
                && !self.outlier_held(r)
            {
                r.upstream_fails.store(0, Ordering::Relaxed);
                r.healthy.store(true, Ordering::Relaxed);
                r.metrics().healthy.set(1.0);
                tracing::info!(replica = %r.name, label = %r.label(), "replica admitted");
            }
        } else {
            r.oks.store(0, Ordering::Relaxed);
            let fails = r.fails.fetch_add(1, Ordering::Relaxed) + 1;
            if r.is_healthy() && fails >= h.failures_to_eject {
                self.eject(r);
                tracing::warn!(replica = %r.name, fails, "replica ejected");
            }
        }
    }

    /// Takes `r` out: no new requests, those waiting on it give up (and are retried elsewhere
    /// when nothing reached the client yet), its index bits dropped.
    pub(super) fn eject(&self, r: &ReplicaHandle) {
        r.healthy.store(false, Ordering::Relaxed);
        r.metrics().healthy.set(0.0);
        r.ejections.send_modify(|n| *n += 1);
        self.index.remove_replica(r.slot);
    }

    pub(super) async fn resolve(&self, r: &ReplicaHandle) -> Option<SocketAddr> {
        let found = tokio::net::lookup_host(r.name.as_str()).await.ok()?.next();
        if let Some(a) = found {
            *r.addr.write() = Some(a);
        }
        found.or_else(|| r.addr())
    }

    pub(super) async fn get(
        &self,
        addr: SocketAddr,
        path: &str,
        timeout: Duration,
    ) -> Option<Bytes> {
        self.client().fetch(addr, path, timeout).await.ok()
    }

    /// Runs one health check of `r` now.
    pub async fn check(&self, r: &ReplicaHandle) {
        let timeout = Duration::from_millis(self.cfg.health.timeout_ms);
        let addr = self.resolve(r).await;
        let result = match addr {
            Some(addr) => self
                .client()
                .fetch(addr, "/health", timeout)
                .await
                .map(|_| ()),
            None => Err(FetchError::Unresolved(r.name.clone())),
        };
        let ok = result.is_ok();
        // A replica that never answered is otherwise silent: say why, every 30 s at most.
        if let Err(why) = &result {
            let never_admitted = r.oks.load(Ordering::Relaxed) == 0 && !r.is_healthy();
            let now = self.now_ms() + 1;
            let last = r.warned_at_ms.load(Ordering::Relaxed);
            if never_admitted && (last == 0 || now >= last + 30_000) {
                r.warned_at_ms.store(now, Ordering::Relaxed);
                tracing::warn!(replica = %r.name, error = %why, "replica not admitted: its health check fails");
            }
        }
        // What the replica says about itself is learnt before it is admitted, so its label
        // (and its series) carry its own id from the start.
        let mut id = None;
        if let (true, Some(addr), None) = (ok, addr, r.max_model_len()) {
            self.learn_model_len(r, addr, timeout).await;
            id = self.learn_server_info(r, addr, timeout).await;
        }
        if !r.label_settled() {
            self.settle_label(r, id);
        }
        self.record_check(r, ok);
    }

    /// Settles `r`'s label: its reported id unless another listed replica already has it.
    pub(super) fn settle_label(&self, r: &ReplicaHandle, id: Option<String>) {
        let taken = |id: &str| {
            self.replicas.load().iter().any(|o| {
                o.slot != r.slot && !o.is_retired() && o.label_settled() && o.label() == id
            })
        };
        let label = match id {
            Some(id) if taken(&id) => {
                tracing::warn!(replica = %r.name, id = %id, "two replicas report the same replica_id; labelling this one by its address");
                r.name.clone()
            }
            Some(id) => id,
            None => r.name.clone(),
        };
        let _ = r.label.set(label);
    }
}
