//! A kvgate replica's KV events over HTTP (`GET /kv_events`), and what any event follower
//! reports back to the replica's record ([`EventSink`]).

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http_body_util::BodyExt;
use protocol::kv_events::FrameDecoder;

use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;
use crate::prefix::zmq::EventSink;

impl EventSink for ReplicaHandle {
    fn set_live(&self, live: bool) {
        self.events_live.store(live, Ordering::Relaxed);
    }

    fn set_error(&self, error: Option<String>) {
        let mut e = self.events_error.lock();
        if *e != error {
            match &error {
                Some(msg) => {
                    tracing::error!(replica = %self.name, error = %msg, "KV events cannot be indexed")
                }
                None => tracing::info!(replica = %self.name, "KV events are indexed again"),
            }
            *e = error;
        }
    }

    fn overflowed(&self, evicted: usize) {
        self.factory
            .replica_counter(
                "kvgate_gateway_prefix_index_evicted_total",
                self.label(),
                &self.name,
                &[],
            )
            .increment(evicted as u64);
        let before = self.evicted.fetch_add(evicted as u64, Ordering::Relaxed);
        let after = before + evicted as u64;
        // Said once per tenfold: a flood is named without flooding the log.
        let decade = |n: u64| if n == 0 { 0 } else { n.ilog10() + 1 };
        if decade(after) > decade(before) {
            tracing::warn!(
                replica = %self.name,
                evicted_total = after,
                "the replica reports more KV blocks than its cache holds; the oldest are dropped \
                 from the prefix index (does its event publisher report its removals?)"
            );
        }
    }
}

/// Why a kvgate replica's event stream stopped (the follower reconnects and starts over).
#[derive(Debug, thiserror::Error)]
pub enum EventStreamError {
    #[error("no address yet")]
    NoAddress,
    #[error("{0}")]
    Transport(String),
    #[error("status {0}")]
    Status(http::StatusCode),
    #[error("{0}")]
    Frame(String),
    #[error("sequence gap: expected {want}, got {got}")]
    Gap { want: u64, got: u64 },
    #[error("stream ended")]
    Ended,
}

impl Registry {
    /// Follows `r`'s KV event stream until it ends or shows a gap; the index holds exactly what
    /// the replica reported while this runs.
    pub(super) async fn follow_events(&self, r: &ReplicaHandle) -> Result<(), EventStreamError> {
        let addr = r.addr().ok_or(EventStreamError::NoAddress)?;
        let req = self.client().request(
            http::Method::GET,
            format!("http://{addr}/kv_events"),
            Bytes::new(),
        );
        let resp = self
            .client()
            .send(req)
            .await
            .map_err(|e| EventStreamError::Transport(e.to_string()))?;
        if !resp.status().is_success() {
            if matches!(resp.status().as_u16(), 401 | 403)
                && !r.events_refused.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    replica = %r.name,
                    status = %resp.status(),
                    "the replica refuses its KV event stream: give the gateway the fleet's token \
                     (KVGATE_FLEET_TOKEN or auth.fleet_token_file); until then routing uses the \
                     approximate index"
                );
            }
            return Err(EventStreamError::Status(resp.status()));
        }
        let mut body = resp.into_body();
        let mut dec = FrameDecoder::new();
        let mut expected: Option<u64> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| EventStreamError::Transport(e.to_string()))?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            for (seq, batch) in dec
                .feed(data)
                .map_err(|e| EventStreamError::Frame(e.to_string()))?
            {
                if let Some(want) = expected {
                    if seq != want {
                        return Err(EventStreamError::Gap { want, got: seq });
                    }
                }
                expected = Some(seq + 1);
                for ev in &batch.events {
                    let evicted = self.index.apply(r.slot, ev);
                    if evicted > 0 {
                        r.overflowed(evicted);
                    }
                }
                r.events_live.store(true, Ordering::Relaxed);
            }
        }
        Err(EventStreamError::Ended)
    }
}
