//! The fleet's live gauges, refreshed every second:
//!
//! - **The autoscaling signal** (`kvgate_gateway_scale_signal`; scale out above 1.0: the
//!   90th percentile of the last minute's per-second readings), from leading indicators
//!   only — latency says trouble already arrived. Per route, the largest of:
//!   requests waiting in the gateway (this one's and its peers') per healthy replica of the
//!   pool; the pool's mean KV usage against the policy's `kv_high_water`; the pool's mean
//!   predicted wait for a first token (the prefill queued ahead of a new request, at the
//!   learnt rate) against the TTFT promise; and its mean predicted decode step with one more
//!   stream against the inter-token promise — both promises with the admission headroom, as
//!   admission itself reads them. Each part reaches 1.0 where the average replica of the pool
//!   stops taking new work within the promise: the knee, before goodput falls. The fleet's
//!   signal is the largest route's; each route's parts are exported too, so a scale-out says
//!   why.
//! - **Cost per million generated tokens** (`kvgate_gateway_cost_per_mtok{route}` over a
//!   route's pool, `kvgate_gateway_fleet_cost_per_mtok` over every replica): the replica-hours'
//!   price (`[cost]`) over the tokens the replicas generate in an hour at the throughput their
//!   own counters measured over `cost.window_s` — the capacity note's formula, live. Replicas
//!   that report no token counter (SGLang's `/get_load` has none) are left out of both sums.
//!   `kvgate_gateway_managed_cost_per_mtok` carries the managed-API price beside it.
//! - **Utilisation** (`kvgate_gateway_replica_busy_share` per replica over the last minute,
//!   `kvgate_gateway_fleet_busy_share{window="1m"|"10m"}` the healthy replicas' mean): the share
//!   of time with work in the batch, from each replica's busy-time counter
//!   (`fleet/throughput.rs`). That is a duty cycle: a replica stepping one stream is as busy
//!   as one stepping sixty. **Model FLOPs utilisation** (`kvgate_gateway_replica_mfu`,
//!   `kvgate_gateway_fleet_mfu{window}`: the model FLOPs the replicas' steps did per second
//!   over their summed peak, for replicas that report both — kvgate's sim) measures the work
//!   done, the runbook's measure.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use config::cost::CostConfig;

use crate::fleet::registry::Registry;
use crate::metrics::GatewayMetrics;
use crate::routes::store::{ActivePolicy, ActiveRoute, PolicyStore};

/// One route's autoscaling signal, part by part (each 1.0 at the pool's knee).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScaleParts {
    pub queue: f64,
    pub kv: f64,
    pub ttft: Option<f64>,
    pub itl: Option<f64>,
}

impl ScaleParts {
    pub fn signal(&self) -> f64 {
        [Some(self.queue), Some(self.kv), self.ttft, self.itl]
            .into_iter()
            .flatten()
            .fold(0.0, f64::max)
    }
}

fn mean(xs: &[f64]) -> Option<f64> {
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// One replica's leading indicators against targets (each 1.0 where it stops taking new
/// work within the promise): KV usage against the high-water mark, the predicted wait for a
/// first token against `ttft_target`, the predicted decode step with one more stream against
/// `itl_target` (targets in seconds, headroom applied by the caller). `None` for a replica
/// that is not healthy. Read by the autoscaling signal and by the Batch API's trough check.
pub fn replica_parts(
    a: &ActivePolicy,
    slot: usize,
    fleet: &Registry,
    ttft_target: Option<f64>,
    itl_target: Option<f64>,
) -> Option<ReplicaParts> {
    let r = fleet.replica(slot).filter(|r| r.is_healthy())?;
    let p = fleet.pressure(slot, Duration::from_millis(a.file.preemption_holdoff_ms), 0);
    let m = r.model.lock();
    let ttft = match (ttft_target, m.predict_ttft(p.queued_prefill_tokens, 1, 0)) {
        (Some(t), Some(wait)) => Some(wait.as_secs_f64() / t.max(1e-9)),
        _ => None,
    };
    let itl = match (itl_target, m.predict_itl(p.running + 1)) {
        (Some(t), Some(step)) => Some(step.as_secs_f64() / t.max(1e-9)),
        _ => None,
    };
    Some(ReplicaParts {
        kv: p.kv_usage / a.file.kv_high_water.max(1e-9),
        ttft,
        itl,
        preempting: p.preempting,
        queued_prefill_tokens: p.queued_prefill_tokens,
    })
}

/// [`replica_parts`]' answer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaParts {
    pub kv: f64,
    pub ttft: Option<f64>,
    pub itl: Option<f64>,
    pub preempting: bool,
    /// Uncached prompt tokens queued ahead of a new request.
    pub queued_prefill_tokens: u64,
}

/// `route`'s promises as [`replica_parts`] reads them: the TTFT and inter-token targets in
/// seconds with the admission headroom (the inter-token one the strictest of the pool's when
/// the route has none).
pub fn route_targets(a: &ActivePolicy, route: &ActiveRoute) -> (Option<f64>, Option<f64>) {
    let h = a.file.admission_headroom;
    let ttft = route.slo.ttft.map(|t| t.as_secs_f64() * h);
    let itl = route
        .slo
        .itl
        .or_else(|| a.strictest_itl(&route.pool))
        .map(|t| t.as_secs_f64() * h);
    (ttft, itl)
}

/// `route`'s signal now.
pub fn route_scale(a: &ActivePolicy, route: &ActiveRoute, fleet: &Registry) -> ScaleParts {
    let (ttft_target, itl_target) = route_targets(a, route);
    let (mut kv, mut ttft, mut itl) = (Vec::new(), Vec::new(), Vec::new());
    for &i in &route.pool {
        let Some(p) = replica_parts(a, i, fleet, ttft_target, itl_target) else {
            continue;
        };
        kv.push(p.kv);
        ttft.extend(p.ttft);
        itl.extend(p.itl);
    }
    let waiting = route.rt.queue.len() + route.rt.queue.others();
    ScaleParts {
        // No healthy replica: every waiter is past the knee.
        queue: waiting as f64 / kv.len().max(1) as f64,
        kv: mean(&kv).unwrap_or(0.0),
        ttft: mean(&ttft),
        itl: mean(&itl),
    }
}

/// The window the exported signal summarises.
const PEAK_WINDOW: Duration = Duration::from_secs(60);

/// Refreshes the autoscaling signal and the cost gauges.
pub struct FleetGauges {
    cost: CostConfig,
    /// The fleet's per-second readings over the last [`PEAK_WINDOW`].
    readings: parking_lot::Mutex<std::collections::VecDeque<(Instant, f64)>>,
}

impl FleetGauges {
    pub fn new(cost: CostConfig, metrics: &GatewayMetrics) -> Self {
        if let Some(p) = cost.managed_usd_per_mtok {
            metrics.gauge("kvgate_gateway_managed_cost_per_mtok").set(p);
        }
        FleetGauges {
            cost,
            readings: parking_lot::Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// Records `now`'s reading and returns the 90th percentile of the last minute's. The knee
    /// is met first in bursts: a fleet whose queues fill for several seconds every minute is
    /// at it though its average reading is low, and Prometheus, scraping every 15 s, would
    /// miss those seconds in the instantaneous value; one cold burst (a single second) is not
    /// the knee, and the minute's maximum would scale out on it (measured: BENCHMARKS).
    fn peak(&self, now: Instant, reading: f64) -> f64 {
        let mut r = self.readings.lock();
        r.push_back((now, reading));
        while r
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > PEAK_WINDOW)
        {
            r.pop_front();
        }
        let mut xs: Vec<f64> = r.iter().map(|(_, x)| *x).collect();
        xs.sort_by(f64::total_cmp);
        xs[(xs.len() * 9 / 10).min(xs.len() - 1)]
    }

    pub fn update(&self, policies: &PolicyStore, fleet: &Registry, metrics: &GatewayMetrics) {
        let a = policies.load();
        let mut fleet_signal: f64 = 0.0;
        for route in &a.routes {
            let parts = route_scale(&a, route, fleet);
            let name = route.rt.name.as_str();
            let g = |part: &'static str, v: f64| {
                metrics
                    .route_gauge_with("kvgate_gateway_route_scale_signal", name, &[("part", part)])
                    .set(v)
            };
            g("queue", parts.queue);
            g("kv", parts.kv);
            g("ttft", parts.ttft.unwrap_or(0.0));
            g("itl", parts.itl.unwrap_or(0.0));
            fleet_signal = fleet_signal.max(parts.signal());
        }
        metrics
            .gauge("kvgate_gateway_scale_signal")
            .set(self.peak(Instant::now(), fleet_signal));
        busy_shares(fleet, metrics);
        if self.cost.gpu_hour_usd.is_none() && self.cost.replica_hour_usd.is_empty() {
            return;
        }
        let (now, window) = (Instant::now(), Duration::from_secs(self.cost.window_s));
        // (price per hour, tokens/s) of each measured, priced, healthy replica, by slot.
        let measured: Vec<Option<(f64, f64)>> = fleet
            .replicas()
            .iter()
            .map(|r| {
                if r.is_retired() || !r.is_healthy() {
                    return None;
                }
                Some((
                    self.cost.replica_hour(&r.name)?,
                    r.throughput.tokens_per_s(now, window)?,
                ))
            })
            .collect();
        let price = |slots: &mut dyn Iterator<Item = usize>| {
            let (usd, tps) = slots
                .filter_map(|i| measured.get(i).copied().flatten())
                .fold((0.0, 0.0), |(u, t), (pu, pt)| (u + pu, t + pt));
            CostConfig::per_mtok(usd, tps).unwrap_or(f64::NAN)
        };
        for route in &a.routes {
            metrics
                .route_gauge("kvgate_gateway_cost_per_mtok", &route.rt.name)
                .set(price(&mut route.pool.iter().copied()));
        }
        metrics
            .gauge("kvgate_gateway_fleet_cost_per_mtok")
            .set(price(&mut (0..measured.len())));
    }
}

/// The utilisation gauges: each replica's busy share over the last minute, and the healthy
/// replicas' mean over one and ten minutes (replicas without two samples yet left out).
fn busy_shares(fleet: &Registry, metrics: &GatewayMetrics) {
    let now = Instant::now();
    for (label, window) in [("1m", 60), ("10m", 600)] {
        let window = Duration::from_secs(window);
        let mut shares = Vec::new();
        for r in fleet.replicas().iter().filter(|r| r.is_healthy()) {
            let Some(us_per_s) = r.busy.tokens_per_s(now, window) else {
                continue;
            };
            let share = (us_per_s / 1e6).clamp(0.0, 1.0);
            if label == "1m" {
                r.metrics().busy_share.set(share);
            }
            shares.push(share);
        }
        metrics
            .gauge_with("kvgate_gateway_fleet_busy_share", &[("window", label)])
            .set(mean(&shares).unwrap_or(f64::NAN));
        let (mut done, mut peak) = (0.0, 0.0);
        for r in fleet.replicas().iter().filter(|r| r.is_healthy()) {
            let p = f64::from_bits(r.peak_flops_bits.load(Ordering::Relaxed));
            let Some(mflop_per_s) = r.flops.tokens_per_s(now, window).filter(|_| p > 0.0) else {
                continue;
            };
            if label == "1m" {
                r.metrics().mfu.set(mflop_per_s * 1e6 / p);
            }
            (done, peak) = (done + mflop_per_s * 1e6, peak + p);
        }
        metrics
            .gauge_with("kvgate_gateway_fleet_mfu", &[("window", label)])
            .set(if peak > 0.0 { done / peak } else { f64::NAN });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signal_is_its_largest_part() {
        let p = ScaleParts {
            queue: 0.2,
            kv: 0.7,
            ttft: Some(1.3),
            itl: None,
        };
        assert_eq!(p.signal(), 1.3);
        assert_eq!(ScaleParts::default().signal(), 0.0);
    }

    #[test]
    fn the_exported_signal_is_the_last_minutes_90th_percentile() {
        let g = FleetGauges::new(CostConfig::default(), &GatewayMetrics::new());
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(g.peak(at(0), 0.3), 0.3);
        // One second's burst in a quiet minute is not the knee ...
        for s in 1..30 {
            g.peak(at(s), 0.3);
        }
        assert_eq!(g.peak(at(30), 2.0), 0.3);
        // ... several seconds of it in the minute are.
        for s in 31..34 {
            g.peak(at(s), 1.5);
        }
        assert_eq!(g.peak(at(34), 1.5), 1.5);
        // Readings older than the minute are forgotten.
        assert_eq!(g.peak(at(100), 0.2), 0.2);
    }
}
