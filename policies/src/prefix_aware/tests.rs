use super::*;

fn policy() -> PrefixAware {
    PrefixAware::new(PrefixAwareConfig::default())
}

fn tokens_policy() -> PrefixAware {
    PrefixAware::new(PrefixAwareConfig {
        cost: CostModel::Tokens,
        ..PrefixAwareConfig::default()
    })
}

/// A fleet with the given running streams and queued prefill tokens per replica, all with
/// the generic speed (8k tokens/s, 20 ms, 2,048-token chunks) and a 20 ms decode step.
fn timed_fleet(running: &[u32], queued: &[u64]) -> ReplicaSet {
    let mut set = fleet(running);
    for (r, &q) in set.replicas.iter_mut().zip(queued) {
        r.speed.queued_prefill_tokens = q;
        r.speed.decode_step_s = Some(0.02);
    }
    set
}

/// `timed_fleet` with nothing queued and each replica's streams seeing `steps` (s).
fn stepped_fleet(running: &[u32], steps: &[f64]) -> ReplicaSet {
    let mut set = timed_fleet(running, &vec![0; running.len()]);
    for (r, &step) in set.replicas.iter_mut().zip(steps) {
        r.speed.current_step_s = Some(step);
    }
    set
}

fn long_request<'a>(hashes: &'a [u64], matched: &'a [usize]) -> RouteRequest<'a> {
    RouteRequest {
        prompt_tokens: hashes.len() * 16 + 40,
        ..request(hashes, matched)
    }
}

#[test]
fn the_holder_wins_while_its_queue_is_shorter_than_a_cold_prefill() {
    // 4,000 cached tokens at replica 0; its queue of 1,000 tokens is cheaper than
    // prefilling all 4,040 anywhere else.
    let hashes = [7u64; 250];
    let d = policy()
        .route(
            &long_request(&hashes, &[250, 0, 0]),
            &timed_fleet(&[2, 0, 0], &[1000, 0, 0]),
        )
        .unwrap();
    assert_eq!(d.replica, 0);
    assert_eq!(d.reason, DecisionReason::PrefixMatch { blocks: 250 });
    let e = d.scores[0].estimate.unwrap();
    // 20 ms + 1,040 tokens / 8k/s; the two running streams' decode work is in the learnt
    // rate, not added again.
    assert!((e.ttft_s - (0.02 + 1040.0 / 8000.0)).abs() < 1e-9, "{e:?}");
}

#[test]
fn offloaded_blocks_cost_a_fraction_of_a_prefill() {
    // Replica 0 holds 20 blocks on the GPU and the next 160 in CPU memory; replica 1 holds
    // 60 on the GPU. Loading 160 blocks costs a quarter of prefilling them: 0 is cheaper
    // (1,000 token-equivalents against 2,280), by more than the tie margin.
    let hashes = [7u64; 200];
    let set = timed_fleet(&[0, 0], &[0, 0]);
    let base = long_request(&hashes, &[20, 60]);
    let with_tier = RouteRequest {
        offloaded_blocks: &[160, 0],
        ..base
    };
    let d = policy().route(&with_tier, &set).unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    // Without the tier, replica 1's longer GPU run wins.
    assert_eq!(policy().route(&base, &set).unwrap().replica, 1);
    // A GPU hit is still cheaper than the same blocks offloaded.
    let gpu = long_request(&hashes, &[200, 20]);
    let offl = RouteRequest {
        offloaded_blocks: &[0, 180],
        ..gpu
    };
    assert_eq!(policy().route(&offl, &set).unwrap().replica, 0);
}

#[test]
fn a_hot_prefix_spreads_once_its_holder_is_slower_than_a_cold_prefill() {
    // The holder has 8,000 tokens of prefill queued (≈ 1 s), more than a cold 4,040-token
    // prefill elsewhere (≈ 0.5 s): the request goes elsewhere and says why.
    let hashes = [7u64; 250];
    let d = policy()
        .route(
            &long_request(&hashes, &[250, 0, 0]),
            &timed_fleet(&[4, 1, 3], &[8000, 0, 0]),
        )
        .unwrap();
    assert_eq!(d.replica, 1, "{:?}", d.scores);
    match d.reason {
        DecisionReason::Spread {
            holder: 0,
            holder_blocks: 250,
            holder_ttft_s,
            chosen_ttft_s,
            holder_itl: None,
        } => assert!(holder_ttft_s > chosen_ttft_s),
        other => panic!("{other:?}"),
    }
    // Once replica 1 holds it too, requests go to whichever holder is quicker.
    let d = policy()
        .route(
            &long_request(&hashes, &[250, 250, 0]),
            &timed_fleet(&[4, 1, 3], &[8000, 500, 0]),
        )
        .unwrap();
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::PrefixMatch { blocks: 250 });
}

#[test]
fn repeating_a_held_prefix_behind_a_queue_is_paid_twice() {
    // The holder has 6,000 tokens queued (≈ 0.78 s with this request's 40), the others 1,000
    // each: a cold prefill of 4,040 behind them is ≈ 0.65 s, so the prediction alone spreads.
    // But the 4,000 repeated tokens delay whoever queues there next as well (0.5 s more), so
    // the holder keeps it.
    let hashes = [7u64; 250];
    let req = long_request(&hashes, &[250, 0, 0]);
    let d = policy()
        .route(&req, &timed_fleet(&[4, 1, 1], &[6000, 1000, 1000]))
        .unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    let charge = d.scores[1].recompute_s;
    assert!((charge - 4000.0 / 8000.0).abs() < 1e-9, "{charge}");
    assert_eq!(d.scores[0].recompute_s, 0.0, "the holder repeats nothing");
    // Off, the same fleet spreads the prefix into a queue.
    let off = PrefixAware::new(PrefixAwareConfig {
        recompute_weight: 0.0,
        ..PrefixAwareConfig::default()
    });
    let d = off
        .route(&req, &timed_fleet(&[4, 1, 1], &[6000, 1000, 1000]))
        .unwrap();
    assert_ne!(d.replica, 0, "{:?}", d.scores);
    // An idle replica is not charged: the repeat uses capacity nobody was using.
    let d = policy()
        .route(&req, &timed_fleet(&[4, 1, 1], &[6000, 1000, 0]))
        .unwrap();
    assert_eq!(d.replica, 2, "{:?}", d.scores);
    assert_eq!(d.scores[2].recompute_s, 0.0);
    // A holder the inter-token check passes over is no alternative: repeating its prefix is
    // the only choice left, and nobody is charged for it.
    let mut set = timed_fleet(&[4, 1, 1], &[6000, 1000, 1000]);
    for (r, step) in set.replicas.iter_mut().zip([0.150, 0.060, 0.055]) {
        r.speed.current_step_s = Some(step);
    }
    let promised = RouteRequest {
        itl_target_s: Some(0.150),
        ..req
    };
    let uncharged = |d: &RouteDecision| d.scores.iter().all(|s| s.recompute_s == 0.0);
    let d = policy().route(&promised, &set).unwrap();
    assert_ne!(d.replica, 0, "{:?}", d.scores);
    assert!(uncharged(&d), "{:?}", d.scores);
    // Nor is a repeat away from a holder whose streams step near the promise (over 0.7 × it,
    // under the check's 0.85 ×): it buys decode headroom there.
    set.replicas[0].speed.current_step_s = Some(0.120);
    let d = policy().route(&promised, &set).unwrap();
    assert!(d.scores[0].itl_over.is_none(), "{:?}", d.scores);
    assert!(uncharged(&d), "{:?}", d.scores);
    set.replicas[0].speed.current_step_s = Some(0.080);
    let d = policy().route(&promised, &set).unwrap();
    assert!(d.scores[1].recompute_s > 0.0, "{:?}", d.scores);
}

#[test]
fn a_holder_that_would_break_the_inter_token_promise_is_passed_over() {
    // Replica 0 holds the prompt and is quickest to a first token, but its streams see a
    // 150 ms step: over 0.85 x a 150 ms promise (127.5 ms). The request spreads to a replica
    // that keeps it, and explain says why.
    let hashes = [7u64; 250];
    let mut set = stepped_fleet(&[90, 20, 30], &[0.150, 0.060, 0.055]);
    let req = RouteRequest {
        itl_target_s: Some(0.150),
        ..long_request(&hashes, &[250, 0, 0])
    };
    let checked = policy();
    let unchecked = PrefixAware::new(PrefixAwareConfig {
        itl_headroom: 0.0,
        ..PrefixAwareConfig::default()
    });
    // With the check off: the holder.
    assert_eq!(unchecked.route(&req, &set).unwrap().replica, 0);
    let d = checked.route(&req, &set).unwrap();
    assert_ne!(d.replica, 0, "{:?}", d.scores);
    let over = d.scores[0].itl_over.expect("replica 0 is over the limit");
    assert!((over.limit_s - 0.1275).abs() < 1e-9, "{over:?}");
    match &d.reason {
        DecisionReason::Spread {
            holder: 0,
            holder_itl: Some(o),
            holder_ttft_s,
            chosen_ttft_s,
            ..
        } => {
            assert_eq!(*o, over);
            // It was not the first token that sent it away.
            assert!(holder_ttft_s < chosen_ttft_s);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        d.reason.to_string().contains("150 ms decode step"),
        "{}",
        d.reason
    );
    // Without a promise the cost alone decides: the holder.
    let no_promise = long_request(&hashes, &[250, 0, 0]);
    assert_eq!(checked.route(&no_promise, &set).unwrap().replica, 0);
    // When every replica is over it, the cost decides by default: the holder keeps it. With
    // `itl_overflow` the stream goes where the streams are lost already: the replica furthest
    // over (here replica 1).
    for (r, step) in set.replicas.iter_mut().zip([0.2, 0.3, 0.18]) {
        r.speed.current_step_s = Some(step);
    }
    assert_eq!(checked.route(&req, &set).unwrap().replica, 0);
    let overflow = PrefixAware::new(PrefixAwareConfig {
        itl_overflow: true,
        ..PrefixAwareConfig::default()
    });
    let d = overflow.route(&req, &set).unwrap();
    assert_eq!(d.replica, 1, "{:?}", d.scores);
    assert_eq!(d.reason.label(), "itl_overflow");
    assert!(d.reason.to_string().contains("300 ms step"), "{}", d.reason);
    for r in &mut set.replicas {
        r.speed.current_step_s = Some(0.2);
    }
    // A replica with nothing running breaks no stream's promise, whatever it last saw.
    let mut idle = timed_fleet(&[0, 20, 30], &[0, 0, 0]);
    idle.replicas[0].speed.current_step_s = Some(0.2);
    assert_eq!(checked.route(&req, &idle).unwrap().replica, 0);
    // The tokens cost keeps its old behaviour.
    set.replicas[1].speed.current_step_s = Some(0.05);
    assert!(PrefixAware::new(PrefixAwareConfig {
        cost: CostModel::Tokens,
        ..PrefixAwareConfig::default()
    })
    .route(&req, &set)
    .unwrap()
    .scores[0]
        .itl_over
        .is_none());
}

#[test]
fn a_holder_of_a_conversation_is_not_passed_over_for_the_inter_token_check() {
    // Replica 0 holds 250 blocks of the prompt and its streams are over the limit, as in
    // the test above. Whether it is passed over depends on who else reuses that prefix.
    let hashes = [7u64; 250];
    let mut set = stepped_fleet(&[90, 20, 30], &[0.150, 0.060, 0.055]);
    let route = |set: &ReplicaSet, reuse: &[f64]| {
        let req = RouteRequest {
            itl_target_s: Some(0.150),
            prefix_reuse: reuse,
            ..long_request(&hashes, &[250, 0, 0])
        };
        policy().route(&req, set).unwrap()
    };
    // A system prompt 30 recent requests reused: a second holder amortises its prefill.
    let shared = route(&set, &[30.0, 0.0, 0.0]);
    assert_ne!(shared.replica, 0);
    assert_eq!(shared.scores[0].itl_over.and_then(|o| o.reuse), Some(30.0));
    let why = shared.reason.to_string();
    assert!(why.contains("30.0 recent requests reused"), "{why}");
    // A conversation's own history (reused by no one else): its holder keeps it.
    let own = route(&set, &[0.4, 0.0, 0.0]);
    assert_eq!(own.replica, 0, "{:?}", own.scores);
    assert_eq!(own.scores[0].itl_over, None);
    // A replica holding nothing gives nothing up: the check applies to it whatever the
    // reuse.
    set.replicas[1].speed.current_step_s = Some(0.2);
    let d = route(&set, &[0.4, 0.0, 0.0]);
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    let over = d.scores[1].itl_over.expect("replica 1 is over the limit");
    assert_eq!(over.reuse, None);
    assert!((over.limit_s - 0.1275).abs() < 1e-9, "{over:?}");
}

#[test]
fn a_busy_fleet_under_the_promise_keeps_its_holders() {
    // Every replica is busy at 85-95 ms a step (an L4 at load), well inside 0.85 x the
    // 150 ms promise: a cold prefill elsewhere would buy no inter-token time, so the holder
    // keeps the prefix.
    let hashes = [7u64; 250];
    let set = stepped_fleet(&[40, 30, 30], &[0.095, 0.088, 0.085]);
    let req = RouteRequest {
        itl_target_s: Some(0.150),
        prefix_reuse: &[30.0, 0.0, 0.0],
        ..long_request(&hashes, &[250, 0, 0])
    };
    let d = policy().route(&req, &set).unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    assert!(d.scores.iter().all(|s| s.itl_over.is_none()));
    // The old setting (0.6 x the promise, floored at 1.1 x the fleet's median step) still
    // reads as before: 90 ms, raised to 1.1 x 88 ms.
    let old = PrefixAware::new(PrefixAwareConfig {
        itl_headroom: 0.6,
        itl_fleet_ratio: 1.1,
        ..PrefixAwareConfig::default()
    });
    assert_eq!(old.route(&req, &set).unwrap().replica, 0);
}

#[test]
fn a_holder_over_the_promise_spreads_even_when_most_of_the_fleet_is_as_slow() {
    // Five of eight replicas hold long system prompts and step at ~145 ms, three step at
    // ~100 ms (bursty traffic on L4s, BENCHMARKS issue 28): the holder's median step is over
    // the limit of 0.85 x the 150 ms promise (127.5 ms), the fast three are under it. A limit
    // floored at the fleet's median step (145 ms x 1.1) kept every such request on its
    // holder; the promise alone sends it to a replica that keeps it.
    let hashes = [7u64; 250];
    let steps = [0.145, 0.146, 0.144, 0.147, 0.150, 0.100, 0.092, 0.113];
    let set = stepped_fleet(&[40; 8], &steps);
    let req = RouteRequest {
        itl_target_s: Some(0.150),
        prefix_reuse: &[30.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ..long_request(&hashes, &[250, 0, 0, 0, 0, 0, 0, 0])
    };
    let d = policy().route(&req, &set).unwrap();
    assert!(d.replica >= 5, "{:?}", d.scores);
    assert!(
        matches!(d.reason, DecisionReason::Spread { holder: 0, .. }),
        "{}",
        d.reason
    );
    let floored = PrefixAware::new(PrefixAwareConfig {
        itl_fleet_ratio: 1.1,
        ..PrefixAwareConfig::default()
    });
    assert_eq!(floored.route(&req, &set).unwrap().replica, 0);
}

#[test]
fn the_step_a_replica_would_see_counts_the_context_in_flight_and_this_prompt() {
    // Replica 1's streams last saw a 115 ms step, under the 127.5 ms limit, but it has taken
    // prompts since that its gaps do not show yet (moved to the context now in flight, its
    // step is 125 ms), and each context token costs it 1 µs a step: with this 4,040-token
    // prompt its streams would step at ~129 ms. Replica 2, at 118 ms with nothing new, would
    // stay within.
    let hashes = [7u64; 250];
    let mut set = stepped_fleet(&[40, 40, 40], &[0.150, 0.115, 0.118]);
    set.replicas[1].speed.step_now_s = Some(0.125);
    for r in &mut set.replicas {
        r.speed.step_per_context_token_s = 1e-6;
    }
    let req = RouteRequest {
        itl_target_s: Some(0.150),
        prefix_reuse: &[30.0, 0.0, 0.0],
        ..long_request(&hashes, &[250, 0, 0])
    };
    let d = policy().route(&req, &set).unwrap();
    assert_eq!(d.replica, 2, "{:?}", d.scores);
    let over = d.scores[1].itl_over.expect("replica 1 would be over");
    assert!((over.step_s - (0.125 + 4040e-6)).abs() < 1e-9, "{over:?}");
}

#[test]
fn one_slow_first_request_does_not_make_the_holder_look_slow() {
    // The holder learnt a 0.3 s fixed overhead from one slow first answer; replica 1 still
    // has the prior's 20 ms. The holder's cached 1,024 tokens decide, not the intercepts.
    let hashes = [4u64; 64];
    let mut set = timed_fleet(&[0, 0], &[0, 0]);
    set.replicas[0].speed.overhead_s = 0.3;
    let d = policy()
        .route(&long_request(&hashes, &[64, 0]), &set)
        .unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    assert_eq!(d.reason, DecisionReason::PrefixMatch { blocks: 64 });
    // Its own overhead still shows in its predicted TTFT.
    assert!(d.scores[0].estimate.unwrap().ttft_s > 0.3);
}

#[test]
fn near_ties_go_to_the_longest_cached_prefix() {
    // Replica 1 holds 2 blocks (32 tokens): 4 ms less prefill than replica 0, which holds
    // nothing but has 20 tokens less queued. Within the tie window, the cache wins.
    let hashes = [1u64; 8];
    let d = policy()
        .route(&request(&hashes, &[0, 2]), &timed_fleet(&[0, 0], &[0, 64]))
        .unwrap();
    assert_eq!(d.replica, 1);
}

#[test]
fn a_cold_prefill_avoids_the_replica_with_more_streams_to_stall() {
    // Same queue, same (no) cache: the prefill's stall costs more where more streams run.
    let hashes = [3u64; 200];
    let set = timed_fleet(&[40, 2], &[0, 0]);
    let d = policy().route(&request(&hashes, &[0, 0]), &set).unwrap();
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::NoMatch);
    assert!(d.scores[0].cost > d.scores[1].cost);
}

#[test]
fn follows_the_longest_cached_prefix() {
    let set = fleet(&[1, 1, 1]);
    let hashes = [1, 2, 3, 4, 5, 6, 7, 8];
    let d = policy().route(&request(&hashes, &[2, 8, 0]), &set).unwrap();
    assert_eq!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::PrefixMatch { blocks: 8 });
    assert_eq!(d.matched_blocks, 8);
    assert_eq!(d.scores.len(), 3);
}

#[test]
fn trades_cache_reuse_against_queueing() {
    // Replica 1 holds 8 blocks (128 tokens) but has 2 more requests queued (512 tokens of
    // cost at the default load weight): replica 0 is cheaper.
    let set = fleet(&[0, 2, 0]);
    let d = tokens_policy()
        .route(&request(&[1; 8], &[0, 8, 0]), &set)
        .unwrap();
    assert_ne!(d.replica, 1);
    assert_eq!(d.reason, DecisionReason::NoMatch);
}

#[test]
fn load_guard_overrides_affinity_on_a_hot_spot() {
    // Without a load weight, affinity alone would always win.
    let p = PrefixAware::new(PrefixAwareConfig {
        cost: CostModel::Tokens,
        load_weight: 0.0,
        ..PrefixAwareConfig::default()
    });
    let d = p
        .route(&request(&[1; 64], &[64, 0, 0]), &fleet(&[40, 2, 3]))
        .unwrap();
    assert_eq!(d.replica, 1);
    assert_eq!(
        d.reason,
        DecisionReason::LoadGuard {
            preferred: 0,
            preferred_blocks: 64
        }
    );
    // Within the thresholds affinity holds.
    let d = p
        .route(&request(&[1; 64], &[64, 0, 0]), &fleet(&[10, 2, 3]))
        .unwrap();
    assert_eq!(d.replica, 0);
}

#[test]
fn under_ttft_the_count_guard_is_off_unless_set() {
    // The holder runs 40 streams against 2 and 3; its cached 1,024 tokens still make it
    // the quickest, and with no guard set, seconds decide.
    let hashes = [1u64; 64];
    let set = timed_fleet(&[40, 2, 3], &[0, 0, 0]);
    let d = policy()
        .route(&long_request(&hashes, &[64, 0, 0]), &set)
        .unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    // An operator who sets a threshold gets the guard back.
    let guarded = PrefixAware::new(PrefixAwareConfig {
        balance_abs_threshold: Some(16),
        ..PrefixAwareConfig::default()
    });
    let d = guarded
        .route(&long_request(&hashes, &[64, 0, 0]), &set)
        .unwrap();
    assert_ne!(d.replica, 0);
    assert!(matches!(
        d.reason,
        DecisionReason::LoadGuard { preferred: 0, .. }
    ));
}

#[test]
fn distinct_prefixes_spread_and_repeats_stick_on_an_idle_fleet() {
    let set = fleet(&[0, 0, 0, 0]);
    let p = policy();
    let mut used = std::collections::HashSet::new();
    for k in 0..40u64 {
        let h = [k * 31 + 7];
        let a = p.route(&request(&h, &[0, 0, 0, 0]), &set).unwrap().replica;
        assert_eq!(
            p.route(&request(&h, &[0, 0, 0, 0]), &set).unwrap().replica,
            a
        );
        used.insert(a);
    }
    assert_eq!(used.len(), 4);
}

#[test]
fn learnt_rates_a_little_apart_do_not_pull_every_new_prefix_to_one_replica() {
    // Each replica learnt a slightly different prefill rate from its own few requests: the
    // fastest is 2 ms quicker on a short prompt, well inside the tie window. New prefixes
    // still spread by the hash, as on a fleet with identical fits.
    let mut set = fleet(&[0, 0, 0, 0]);
    for (i, r) in set.replicas.iter_mut().enumerate() {
        r.speed.seconds_per_token = (1.0 + 0.1 * i as f64) / 8_000.0;
    }
    let p = policy();
    let mut used = std::collections::HashSet::new();
    for k in 0..40u64 {
        let h = [k * 31 + 7; 4];
        used.insert(p.route(&request(&h, &[0, 0, 0, 0]), &set).unwrap().replica);
    }
    assert_eq!(used.len(), 4, "{used:?}");
}

#[test]
fn within_the_window_the_replica_with_fewer_requests_wins() {
    // Same (no) cache, replica 0 runs 3 streams, replica 1 one: the extra stall is a few
    // milliseconds, inside the window, and the request count decides.
    let hashes = [5u64; 4];
    let set = timed_fleet(&[3, 1], &[0, 0]);
    let d = policy().route(&request(&hashes, &[0, 0]), &set).unwrap();
    assert_eq!(d.replica, 1, "{:?}", d.scores);
}

#[test]
fn skips_unhealthy_replicas() {
    let mut set = fleet(&[0, 0]);
    set.replicas[1].healthy = false;
    let d = policy().route(&request(&[1, 2], &[0, 2]), &set).unwrap();
    assert_eq!(d.replica, 0);
    set.replicas[0].healthy = false;
    assert_eq!(
        policy().route(&request(&[1], &[0, 0]), &set),
        Err(RouteError::NoHealthyReplica)
    );
}

#[test]
fn a_hot_prefix_is_warmed_elsewhere_before_its_holder_breaks_the_promise() {
    // Replica 0 holds a system prompt 30 recent requests reused; its streams would step at
    // 115 ms: within the 127.5 ms limit (it keeps the request) but over 0.7 x the 150 ms
    // promise. Replica 2 steps at 60 ms and holds nothing: it is warmed (replica 1, at
    // 110 ms, is pressed itself).
    let hashes = [7u64; 250];
    let set = stepped_fleet(&[40, 40, 20], &[0.115, 0.110, 0.060]);
    let reuse = [30.0, 0.0, 0.0];
    let req = RouteRequest {
        itl_target_s: Some(0.150),
        prefix_reuse: &reuse,
        ..long_request(&hashes, &[250, 0, 0])
    };
    let d = policy().route(&req, &set).unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    assert_eq!(
        d.warm,
        Some(Warm {
            replica: 2,
            reason: WarmReason::InterToken
        })
    );
    // A prefix few requests reuse (a conversation's history) is not warmed.
    let own = RouteRequest {
        prefix_reuse: &[1.0, 0.0, 0.0],
        ..req
    };
    assert_eq!(policy().route(&own, &set).unwrap().warm, None);
    // Nor is one with a second holder at ease: later requests go there by price.
    let two = RouteRequest {
        prefix_reuse: &[30.0, 30.0, 0.0],
        ..long_request(&hashes, &[250, 0, 250])
    };
    let two = RouteRequest {
        itl_target_s: Some(0.150),
        ..two
    };
    assert_eq!(policy().route(&two, &set).unwrap().warm, None);
    // Off when warm_headroom and warm_queue_share are 0.
    let off = PrefixAware::new(PrefixAwareConfig {
        warm_headroom: 0.0,
        warm_queue_share: 0.0,
        ..PrefixAwareConfig::default()
    });
    assert_eq!(off.route(&req, &set).unwrap().warm, None);
}

#[test]
fn a_holder_with_half_a_cold_prefill_queued_gets_a_second_holder() {
    // No inter-token promise. Replica 0 holds 4,000 of the prompt's 4,040 tokens but has
    // 3,000 tokens of prefill queued: 0.4 s to a first token there, against ~0.53 s cold on
    // an idle replica. It still wins, and replica 1 (the cheaper cold one) is warmed.
    let hashes = [7u64; 250];
    let set = timed_fleet(&[4, 0, 2], &[3000, 0, 200]);
    let req = RouteRequest {
        prefix_reuse: &[10.0, 0.0, 0.0],
        ..long_request(&hashes, &[250, 0, 0])
    };
    let d = policy().route(&req, &set).unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    assert_eq!(
        d.warm,
        Some(Warm {
            replica: 1,
            reason: WarmReason::Queue
        })
    );
    // With a short queue (0.1 s) it is not pressed.
    let calm = timed_fleet(&[4, 0, 2], &[600, 0, 200]);
    assert_eq!(policy().route(&req, &calm).unwrap().warm, None);
}

#[test]
fn a_long_cold_prefill_goes_where_it_holds_up_the_fewest_requests() {
    // A cold 4,040-token prompt (≈ 0.5 s here) on two idle replicas alike but for their
    // reuse: 4 requests a second come to use replica 0's cache, none replica 1's. On replica
    // 0 about 2 of them would wait a quarter of a second each for it.
    let hashes = [7u64; 250];
    let req = long_request(&hashes, &[0, 0]);
    let mut set = timed_fleet(&[1, 1], &[0, 0]);
    set.replicas[0].speed.reuse_rate = 4.0;
    let d = policy().route(&req, &set).unwrap();
    assert_eq!(d.replica, 1, "{:?}", d.scores);
    let own = d.scores[0].estimate.unwrap().own_prefill_s;
    let charge = d.scores[0].displace_s;
    assert!((charge - 4.0 * own * own / 2.0).abs() < 1e-9, "{charge}");
    assert_eq!(d.scores[1].displace_s, 0.0);
    // A turn of a conversation replica 0 holds still goes there: its own prefill is short,
    // and prefilling the whole history elsewhere would cost far more.
    let d = policy()
        .route(&long_request(&hashes, &[245, 0]), &set)
        .unwrap();
    assert_eq!(d.replica, 0, "{:?}", d.scores);
    // Off, the two replicas tie again and the charge is not made.
    let off = PrefixAware::new(PrefixAwareConfig {
        displace_weight: 0.0,
        ..PrefixAwareConfig::default()
    });
    let d = off.route(&req, &set).unwrap();
    assert!(
        d.scores.iter().all(|s| s.displace_s == 0.0),
        "{:?}",
        d.scores
    );
}
