//! The admission rule, per replica: may this request go to that replica now and still keep its
//! route's promise? Goodput-based admission dispatches a request only while its latency promise
//! can still be kept, queues it briefly otherwise, and sheds it early (429 + Retry-After) rather
//! than thrash; this file is the judgement, without I/O or a clock.
//!
//! Per replica, a [`LatencyModel`] (`fleet/latency_model.rs`) learns from what the gateway
//! forwards how long a request waits for its first token and how long the gaps between tokens
//! are at each batch size. [`admissible`] asks: would this request's predicted TTFT and the
//! predicted gap with one more sequence both meet the route's SLO, and are the leading
//! indicators (preemptions rising, KV usage above the high-water mark: `fleet/pressure.rs`)
//! quiet? An idle replica is always admissible: holding a request back from an idle replica
//! helps nobody.
//!
//! Placement (`request/place.rs`) asks it for every replica of the route's pool; the admit
//! stage (`request/admit.rs`) waits in the route's queue (`routes/queue.rs`) while no replica
//! is admissible, and sheds.

use std::time::Duration;

use protocol::slo::Slo;

use crate::fleet::latency_model::LatencyModel;
use crate::fleet::pressure::ReplicaPressure;

/// Share of a request's gaps that may exceed the inter-token target under a p95 promise.
pub const STALL_BUDGET: f64 = 0.05;

/// How much of its TTFT budget a request held for stalls keeps over its predicted TTFT: with
/// less left it goes (BENCHMARKS, issue 33: a cold prompt held for stalls waited into a TTFT
/// hold, blocked the queue behind it for a second and was then shed).
pub const STALL_HOLD_MARGIN: Duration = Duration::from_millis(100);

/// Why a request may not go to a replica now.
#[derive(Debug, Clone, PartialEq)]
pub enum Hold {
    Ttft {
        predicted: Duration,
    },
    Itl {
        predicted: Duration,
    },
    /// The replica's streams already stall too often, and this request's prefill would stall
    /// them once more.
    Stalls {
        share: f64,
    },
    KvHighWater {
        usage: f64,
    },
    Preempting,
}

impl std::fmt::Display for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hold::Ttft { predicted } => write!(
                f,
                "predicted TTFT {:.3} s is over the route's target",
                predicted.as_secs_f64()
            ),
            Hold::Itl { predicted } => write!(
                f,
                "predicted decode step {:.1} ms with one more sequence is over the inter-token target",
                predicted.as_secs_f64() * 1e3
            ),
            Hold::Stalls { share } => write!(
                f,
                "{:.1}% of its recent gaps already exceed the inter-token target (budget 5%) and this prefill would stall them again",
                share * 100.0
            ),
            Hold::KvHighWater { usage } => {
                write!(f, "projected KV usage {:.0}% is over the high-water mark", usage * 100.0)
            }
            Hold::Preempting => f.write_str("it preempted sequences within the hold-off"),
        }
    }
}

impl Hold {
    pub fn label(&self) -> &'static str {
        match self {
            Hold::Ttft { .. } => "ttft",
            Hold::Itl { .. } => "itl",
            Hold::Stalls { .. } => "stalls",
            Hold::KvHighWater { .. } => "kv_high_water",
            Hold::Preempting => "preempting",
        }
    }
}

/// Whether a request with `tokens` uncached prompt tokens after `cached` cached ones may be
/// dispatched to a replica now.
pub fn admissible(
    model: &LatencyModel,
    p: &ReplicaPressure,
    tokens: u64,
    cached: u64,
    slo: &Slo,
    kv_high_water: f64,
) -> Result<(), Hold> {
    // Holding a request back from an idle replica helps nobody: it goes, whatever the
    // prediction (its own size is the only thing in its way).
    if p.running == 0 && p.queued_prefill_tokens == 0 {
        return Ok(());
    }
    if p.preempting {
        return Err(Hold::Preempting);
    }
    // An idle replica takes whatever fits at all; the replica itself refuses what never does.
    if p.running > 0 && p.kv_usage > kv_high_water {
        return Err(Hold::KvHighWater { usage: p.kv_usage });
    }
    // Busy here: the request first waits for the running step, half of one on average, then
    // takes at least a decode step.
    let wait = Duration::from_secs_f64(model.mean_step_wait());
    let step = model.current_step().unwrap_or(Duration::ZERO);
    let predicted_ttft = model
        .predict_ttft(p.queued_prefill_tokens, tokens, cached)
        .map(|t| t.max(step) + wait);
    // What the TTFT budget left (`slo.ttft`, already less the time waited) has over the
    // prediction; unbounded without a TTFT promise.
    let mut slack = Duration::MAX;
    if let (Some(target), Some(predicted)) = (slo.ttft, predicted_ttft) {
        if predicted > target {
            return Err(Hold::Ttft { predicted });
        }
        slack = target - predicted;
    }
    if let (Some(target), Some(predicted)) = (slo.itl, model.predict_itl(p.running + 1)) {
        if predicted > target {
            return Err(Hold::Itl { predicted });
        }
    }
    // Stalls: the inter-token promise breaks when more than 5% of a stream's gaps carry a
    // prefill chunk. A request whose own prefill takes longer than the target is one more such
    // stall for every stream there; while the replica is already over budget it waits, and a
    // request that is mostly cached (a stall-free prefill) still goes. The wait is a
    // preference, not a promise: once the TTFT budget left covers the prediction by less
    // than `STALL_HOLD_MARGIN` it goes, rather than wait on into a TTFT hold (which blocks
    // the route's queue) and a shed.
    if let Some(target) = slo.itl.filter(|_| slack > STALL_HOLD_MARGIN) {
        let own_prefill = model
            .predict_ttft(0, tokens, cached)
            .map_or(Duration::ZERO, |t| {
                t.saturating_sub(Duration::from_secs_f64(model.ttft_overhead()))
            });
        if own_prefill > target {
            if let Some(share) = model.stall_share(target) {
                if share > STALL_BUDGET {
                    return Err(Hold::Stalls { share });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
