//! Each replica's background work — health checks, load polls and its KV event stream (a
//! kvgate replica's over HTTP, a vLLM or SGLang engine's over ZMQ) — started when it joins,
//! stopped when it retires or the gateway exits.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use config::gateway::Backend;

use crate::fleet::registry::Registry;
use crate::fleet::replica::ReplicaHandle;
use crate::prefix::engine_events::HashTranslator;
use crate::prefix::zmq::{self, EventSink, ZmqSource};

impl Registry {
    /// Stops every replica's health check, load poll and KV event stream (the gateway has
    /// drained and is exiting).
    pub fn stop_background(&self) {
        for r in self.replicas().iter() {
            for t in r.tasks.lock().drain(..) {
                t.abort();
            }
        }
    }

    /// Starts health checks, load polling and (when enabled) KV event subscriptions for every
    /// listed replica.
    pub fn spawn_background(self: &Arc<Self>) {
        for r in self.replicas.load().iter() {
            self.spawn_tasks(r);
        }
    }

    pub(super) fn spawn_tasks(self: &Arc<Self>, r: &Arc<ReplicaHandle>) {
        let mut tasks = Vec::new();
        let (me, rep) = (self.clone(), r.clone());
        tasks.push(every(self.cfg.health.interval_ms, move || {
            let (me, rep) = (me.clone(), rep.clone());
            async move { me.check(&rep).await }
        }));
        let (me, rep) = (self.clone(), r.clone());
        tasks.push(every(self.cfg.upstream.load_poll_ms, move || {
            let (me, rep) = (me.clone(), rep.clone());
            async move { me.poll_load(&rep).await }
        }));
        let spec = self.engine(&r.name);
        if let Some(events) = spec.as_ref().and_then(|s| s.kv_events.clone()) {
            let source = ZmqSource {
                events,
                replay: spec.as_ref().and_then(|s| s.kv_replay.clone()),
            };
            let (index, rep) = (self.index.clone(), r.clone());
            let (model, block_size) = self.model_of(&r.name);
            tasks.push(tokio::spawn(async move {
                let mut translator = HashTranslator::new(&model, block_size);
                loop {
                    let outcome =
                        zmq::follow(&source, rep.slot, &index, &mut translator, &*rep).await;
                    if rep.events_live.swap(false, Ordering::Relaxed) {
                        tracing::info!(replica = %rep.name, reason = ?outcome, "ZMQ KV event stream lost; resyncing");
                    }
                    // A stream that cannot even be followed (a wrong endpoint) is named, not
                    // left to look like an idle engine. A closed connection is not an error:
                    // the engine restarted or the network blinked, and reconnecting says which.
                    if let Some(e) = outcome
                        .as_ref()
                        .err()
                        .filter(|e| !matches!(e, zmq::ZmqError::Disconnected))
                    {
                        EventSink::set_error(
                            &*rep,
                            Some(format!("cannot follow {}: {e}", source.events)),
                        );
                    }
                    index.clear_exact(rep.slot);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }));
        } else if self.cfg.index.kv_events
            && spec.as_ref().is_none_or(|s| s.backend == Backend::Kvgate)
        {
            let me = self.clone();
            let rep = r.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let outcome = me.follow_events(&rep).await;
                    if rep.events_live.swap(false, Ordering::Relaxed) {
                        tracing::info!(replica = %rep.name, reason = ?outcome, "KV event stream lost; resyncing");
                    }
                    me.index.clear_exact(rep.slot);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }));
        }
        *r.tasks.lock() = tasks;
    }
}

/// Runs `task` every `period_ms`, forever; a slow run delays the next instead of piling up.
fn every<F, Fut>(period_ms: u64, task: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(period_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            task().await;
        }
    })
}
