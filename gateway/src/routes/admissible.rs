//! Goodput-based admission: dispatch a request only while its latency promise can still be
//! kept, queue it briefly otherwise, and shed it early (429 + Retry-After) rather than thrash.
//!
//! Per replica, a [`LatencyModel`] (`latency_model.rs`) learns from what the gateway forwards
//! how long a request waits for its first token and how long the gaps between tokens are at
//! each batch size. [`admissible`] asks: would this request's predicted TTFT and the predicted
//! gap with one more sequence both meet the route's SLO, and are the leading indicators
//! (preemptions rising, KV usage above the high-water mark) quiet? An idle replica is always
//! admissible: holding a request back from an idle replica helps nobody.
//!
//! The queue requests wait in, and why they are shed, is `admission_queue.rs`. Time comes
//! from a `Clock` (`clock.rs`), so tests control it.
//!
//! `dispatch.rs` wires this controller into the request path; it holds no I/O itself.

use std::time::Duration;

use crate::latency_model::LatencyModel;

/// The latency promise (the one definition, shared with the load tester).
pub use protocol::slo::Slo;

/// A replica's state as admission sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaPressure {
    pub running: u32,
    /// Uncached prompt tokens queued ahead of a new request.
    pub queued_prefill_tokens: u64,
    pub kv_usage: f64,
    /// Preemptions rose since the last poll.
    pub preempting: bool,
}

/// Share of a request's gaps that may exceed the inter-token target under a p95 promise.
pub const STALL_BUDGET: f64 = 0.05;

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

/// Whether a request with `tokens` uncached prompt tokens may be dispatched to a replica now.
pub fn admissible(
    model: &LatencyModel,
    p: &ReplicaPressure,
    tokens: u64,
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
    if let (Some(target), Some(predicted)) = (
        slo.ttft,
        model.predict_ttft(p.queued_prefill_tokens, tokens),
    ) {
        if predicted > target {
            return Err(Hold::Ttft { predicted });
        }
    }
    if let (Some(target), Some(predicted)) = (slo.itl, model.predict_itl(p.running + 1)) {
        if predicted > target {
            return Err(Hold::Itl { predicted });
        }
    }
    // Stalls: the inter-token promise breaks when more than 5% of a stream's gaps carry a
    // prefill chunk. A request whose own prefill takes longer than the target is one more such
    // stall for every stream there; while the replica is already over budget it waits, and a
    // request that is mostly cached (a stall-free prefill) still goes.
    if let Some(target) = slo.itl {
        let own_prefill = model.predict_ttft(0, tokens).map_or(Duration::ZERO, |t| {
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
mod tests {
    use super::*;
    use crate::latency_model::tests::learnt;

    const MS: Duration = Duration::from_millis(1);

    fn slo() -> Slo {
        Slo {
            ttft: Some(1000 * MS),
            itl: Some(50 * MS),
        }
    }

    #[test]
    fn admits_under_the_slo() {
        let m = learnt();
        let rate = m.prefill_rate().unwrap();
        assert!((rate - 10_000.0).abs() < 500.0, "{rate}");
        let p = ReplicaPressure {
            running: 8,
            queued_prefill_tokens: 2_000,
            kv_usage: 0.5,
            preempting: false,
        };
        assert_eq!(admissible(&m, &p, 3_000, &slo(), 0.9), Ok(()));
        // A model with nothing learnt predicts from its prior (8k tokens/s): a busy replica
        // holds a prompt that would take minutes, an idle one takes anything.
        assert_eq!(
            admissible(&LatencyModel::default(), &p, 1_000_000, &slo(), 0.9)
                .unwrap_err()
                .label(),
            "ttft"
        );
        assert_eq!(
            admissible(
                &LatencyModel::default(),
                &ReplicaPressure::default(),
                1_000_000,
                &slo(),
                0.9
            ),
            Ok(())
        );
    }

    #[test]
    fn a_long_prompt_after_many_short_ones_is_priced_from_the_prior() {
        // A replica that says it prefills 20k tokens/s; 100 short prompts, each mostly fixed
        // overhead (50 tokens in 25 ms: "2,000 tokens/s" if read as a rate).
        let mut m = LatencyModel::default();
        m.set_prior(20_000.0, 0.02);
        for _ in 0..100 {
            m.observe_ttft(0, 50, 25 * MS);
        }
        let six_k = m.predict_ttft(0, 6_000).unwrap();
        assert!(
            six_k > 250 * MS && six_k < 450 * MS,
            "a 6k prompt is ~0.3 s of prefill, not 3 s: {six_k:?}"
        );
        let short = m.predict_ttft(0, 50).unwrap();
        assert!((short.as_secs_f64() - 0.025).abs() < 0.005, "{short:?}");
        // Busy, with 0.4 s of work queued: a 6k prompt still fits a 1 s promise.
        let busy = ReplicaPressure {
            running: 4,
            queued_prefill_tokens: 4_000,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &busy, 6_000, &slo(), 0.9), Ok(()));
    }

    #[test]
    fn a_cache_miss_waits_while_the_replicas_streams_stall_too_often() {
        // Decode steps of 30 ms; one step in twelve carries a 250 ms prefill chunk (8%).
        let mut m = LatencyModel::default();
        m.set_prior(4_000.0, 0.02);
        for i in 0..2000 {
            let gap = if i % 12 == 0 { 250 * MS } else { 30 * MS };
            m.observe_itl(16, gap);
        }
        let busy = ReplicaPressure {
            running: 16,
            ..ReplicaPressure::default()
        };
        let slo = Slo {
            ttft: Some(1000 * MS),
            itl: Some(150 * MS),
        };
        // The decode step (30 ms) is far from the knee, but 8% of gaps stall: a 2,000-token
        // miss (0.5 s of prefill, one more stall) waits; a mostly cached turn (100 tokens,
        // 25 ms) goes.
        match admissible(&m, &busy, 2_000, &slo, 0.9) {
            Err(Hold::Stalls { share }) => assert!((share - 1.0 / 12.0).abs() < 0.01),
            other => panic!("{other:?}"),
        }
        assert_eq!(admissible(&m, &busy, 100, &slo, 0.9), Ok(()));
        // At 3% stalls the same miss goes.
        let mut calm = LatencyModel::default();
        calm.set_prior(4_000.0, 0.02);
        for i in 0..2000 {
            let gap = if i % 33 == 0 { 250 * MS } else { 30 * MS };
            calm.observe_itl(16, gap);
        }
        assert_eq!(admissible(&calm, &busy, 2_000, &slo, 0.9), Ok(()));
    }

    #[test]
    fn holds_when_the_replica_is_at_its_predicted_knee() {
        let m = learnt();
        // 40 running: one more sequence is predicted at 40 + (41-32)/32 * 40 = 51.25 ms > 50 ms.
        let at_knee = ReplicaPressure {
            running: 40,
            ..ReplicaPressure::default()
        };
        match admissible(&m, &at_knee, 100, &slo(), 0.9) {
            Err(Hold::Itl { predicted }) => {
                assert!((predicted.as_secs_f64() - 0.05125).abs() < 1e-6)
            }
            other => panic!("{other:?}"),
        }
        let below = ReplicaPressure {
            running: 30,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &below, 100, &slo(), 0.9), Ok(()));
        // Too much prefill queued ahead breaks the TTFT promise instead: (8k + 3k) / 10k = 1.1 s.
        let backed_up = ReplicaPressure {
            queued_prefill_tokens: 8_000,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &backed_up, 3_000, &slo(), 0.9)
                .unwrap_err()
                .label(),
            "ttft"
        );
    }

    #[test]
    fn leading_indicators_cut_admission_off() {
        let m = learnt();
        let preempting = ReplicaPressure {
            running: 1,
            preempting: true,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &preempting, 10, &slo(), 0.9),
            Err(Hold::Preempting)
        );
        let full = ReplicaPressure {
            running: 4,
            kv_usage: 0.95,
            ..ReplicaPressure::default()
        };
        assert_eq!(
            admissible(&m, &full, 10, &slo(), 0.9),
            Err(Hold::KvHighWater { usage: 0.95 })
        );
        // An idle replica takes a prompt that fills most of its cache.
        let idle = ReplicaPressure {
            kv_usage: 0.95,
            ..ReplicaPressure::default()
        };
        assert_eq!(admissible(&m, &idle, 10, &slo(), 0.9), Ok(()));
    }
}
