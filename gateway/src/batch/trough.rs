//! Where batch work may go now: the fleet's trough. A replica is *spare* while no interactive
//! request waits in the gateway for any route it serves, it is not preempting, and its
//! predicted signals — KV usage against the high-water mark, the predicted wait for a first
//! token against the TTFT promise, the predicted decode step with one more stream against the
//! inter-token promise (the autoscaling signal's per-replica parts, `routes/fleet_gauges.rs`),
//! the share of its streams' recent gaps over that promise against admission's stall budget
//! — stay under `headroom` of what the interactive routes on it promise, and it runs fewer
//! batch lines than [`line_cap`] allows: `per_replica` when idle, fewer as its KV usage or
//! stall share nears the headroom (the day's peak), none there. The stall share is counted
//! against half of admission's stall budget ([`BATCH_STALL_SHARE`]): the other half is the
//! interactive cold prompts'. The runner feeds at most one
//! new line per spare replica per look, scoped to the spare replicas (`request/place.rs`: a
//! line goes to one of them, or back to its queue), and looks once per predicted decode step,
//! so feeding stops within one step of interactive load rising; lines already running finish.

use std::sync::atomic::Ordering;
use std::time::Duration;

use config::Priority;

use crate::fleet::registry::Registry;
use crate::routes::admissible::STALL_BUDGET;
use crate::routes::fleet_gauges::{replica_parts, route_targets};
use crate::routes::store::ActivePolicy;

/// The shortest and longest pause between looks.
const MIN_TICK: Duration = Duration::from_millis(10);
const MAX_TICK: Duration = Duration::from_millis(200);
/// The pause while no replica has a learnt decode step.
const DEFAULT_TICK: Duration = Duration::from_millis(50);

/// The share of a replica's recent gaps over the inter-token promise that batch work may
/// fill up to (times `headroom`): half of admission's stall budget, so the cap closes at
/// 1.75% and the day's peak, where the interactive cold prompts' own stalls take the share to
/// 2–2.5% on average, runs 1–2 lines a replica. Against the whole budget it ran 2–3 there,
/// and the interactive p99 TTFT was 1.15× its batch-free value, its excess cold prompts held
/// for `stalls` (BENCHMARKS, issue 33, "Half the stall budget" and the section before it).
pub const BATCH_STALL_SHARE: f64 = STALL_BUDGET / 2.0;

/// One look at the fleet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trough {
    /// Replica slots that may take one more batch line.
    pub spare: Vec<usize>,
    /// Healthy replicas.
    pub healthy: usize,
    /// Until the next look: the fleet's mean predicted decode step now.
    pub tick: Duration,
}

fn min_some(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// Looks at the fleet under the active policy.
pub fn look(a: &ActivePolicy, fleet: &Registry, headroom: f64, per_replica: usize) -> Trough {
    let slots = fleet.replicas().len();
    let mut out = Trough::default();
    let mut steps = Vec::new();
    for slot in 0..slots {
        let interactive: Vec<_> = a
            .routes
            .iter()
            .filter(|r| r.cfg.priority != Some(Priority::Batch) && r.pool.contains(&slot))
            .collect();
        let waiting = interactive
            .iter()
            .any(|r| r.rt.queue.len() + r.rt.queue.others() > 0);
        let (ttft, itl) = interactive
            .iter()
            .map(|r| route_targets(a, r))
            .fold((None, None), |(t, i), (rt, ri)| {
                (min_some(t, rt), min_some(i, ri))
            });
        let Some(parts) = replica_parts(a, slot, fleet, ttft, itl) else {
            continue;
        };
        out.healthy += 1;
        let Some(r) = fleet.replica(slot) else {
            continue;
        };
        let running = fleet.pressure(slot, Duration::ZERO, 0).running.max(1);
        let stalls = {
            let m = r.model.lock();
            steps.extend(m.predict_itl(running));
            itl.and_then(|t| m.stall_share(Duration::from_secs_f64(t)))
        };
        let under = |x: Option<f64>| x.is_none_or(|x| x < headroom);
        let lines = r.background_in_flight.load(Ordering::Relaxed) as usize;
        let cap = line_cap(per_replica, room(parts.kv, stalls), headroom);
        tracing::trace!(
            slot,
            lines,
            cap,
            waiting,
            kv = parts.kv,
            ttft = parts.ttft,
            itl = parts.itl,
            stalls,
            streams = r.load_for(false).requests(),
            step_ms = r.model.lock().current_step().map(|s| s.as_secs_f64() * 1e3),
            "trough look"
        );
        if !waiting
            && lines < cap
            && parts.queued_prefill_tokens == 0
            && r.background_prefill_outstanding() == 0
            && !parts.preempting
            && under(parts.ttft)
            && under(parts.itl)
        {
            out.spare.push(slot);
        }
    }
    out.tick = if steps.is_empty() {
        DEFAULT_TICK
    } else {
        (steps.iter().sum::<Duration>() / steps.len() as u32).clamp(MIN_TICK, MAX_TICK)
    };
    out
}

/// A replica's room signal: the larger of its KV usage against the high-water mark (`kv`) and
/// its streams' stall share (`stalls`, none before enough gaps) against [`BATCH_STALL_SHARE`].
pub fn room(kv: f64, stalls: Option<f64>) -> f64 {
    kv.max(stalls.map_or(0.0, |s| s / BATCH_STALL_SHARE))
}

/// Batch lines a replica may run while its room signal — the larger of its KV usage against the
/// high-water mark and its stall share against [`BATCH_STALL_SHARE`] — is at `room`:
/// `per_replica` on an idle replica, fewer in proportion as the signal nears `headroom`, none
/// from there. Both signals are zero on an idle replica and grow with the interactive work on
/// it: KV held by running conversations leaves less room for idle ones' cached prefixes, and a
/// stall share near the budget holds cold follow-ups in the gateway. A flat cap ran as many
/// lines at the day's peak as at night, and the peak's evicted follow-ups made the tail
/// (BENCHMARKS, issue 33).
pub fn line_cap(per_replica: usize, room: f64, headroom: f64) -> usize {
    if room.is_nan() || room >= headroom {
        return 0;
    }
    let share = 1.0 - room.max(0.0) / headroom;
    ((per_replica as f64 * share).ceil() as usize).min(per_replica)
}

#[cfg(test)]
mod tests;
