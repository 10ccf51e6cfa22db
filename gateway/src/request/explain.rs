//! `POST /admin/route/explain`: the placement a request would get now and everything behind it
//! — the route and why it matched, every replica's cached prefix, load, predicted TTFT, cost
//! (with its unit) and admission verdict, the decision and its reason, and whether the request
//! would be dispatched, queued or refused. Nothing is sent and nothing is reserved.

use serde_json::{json, Value};

use crate::request::place::{Outcome, Placer, Purpose};
use crate::request::prepared::Prepared;
use crate::routes::store::{ActivePolicy, ActiveRoute};

/// Why `route` took a request of `prompt_tokens` (routes are matched in order).
fn matched_because(route: &ActiveRoute, prompt_tokens: usize) -> String {
    let mut rules = Vec::new();
    if let Some(m) = route.cfg.min_prompt_tokens {
        rules.push(format!(
            "the prompt's {prompt_tokens} tokens are at least min_prompt_tokens = {m}"
        ));
    }
    if let Some(p) = route.cfg.priority {
        rules.push(format!("the x-kvgate-priority header is {}", p.label()));
    }
    if !route.cfg.models.is_empty() {
        rules.push(format!(
            "the model is one of models = {:?}",
            route.cfg.models
        ));
    }
    if rules.is_empty() {
        "no earlier route matched and this route has no rules (catch-all)".into()
    } else {
        format!(
            "first route in order whose rules hold: {}",
            rules.join(" and ")
        )
    }
}

/// The explanation of where `p` would go on `route` now (a dry run of placement).
pub fn explain(placer: &Placer<'_>, p: &Prepared, a: &ActivePolicy, route: &ActiveRoute) -> Value {
    let block_size = p.block_size;
    let all = placer.fleet.replicas();
    let matched = placer.matched(p);
    let offloaded = placer.prefix.offloaded(p.blocks(), &matched);
    let confirmed = placer.confirmed(p);
    // Recent requests that reused the prefix each replica holds of this prompt.
    let reuse = placer.prefix.reuse(p.blocks(), &matched);
    let placed = placer.place(a, route, p, &matched, Purpose::Explain);
    let decision = match &placed.outcome {
        Outcome::Go(d) => Some(d),
        _ => placed.preferred.as_ref(),
    };
    let unit = route.policy.cost_unit();
    let label = |i: usize| {
        all.get(i).map_or_else(
            || placed.fleet.replicas[i].name.clone(),
            |h| h.label().to_string(),
        )
    };
    let replicas: Vec<Value> = placed
        .fleet
        .replicas
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let score = decision.and_then(|d| d.scores.iter().find(|s| s.replica == i));
            let held = placed.held.iter().find(|(h, _)| *h == i).map(|(_, h)| h);
            let in_pool = route.pool.contains(&i);
            let admission = match (in_pool && r.healthy, held) {
                (false, _) => json!({"verdict": "not_eligible"}),
                (true, None) => json!({"verdict": "admissible"}),
                (true, Some(h)) => {
                    json!({"verdict": "held", "reason": h.label(), "detail": h.to_string()})
                }
            };
            let blocks = matched.get(i).copied().unwrap_or(0);
            json!({
                "replica": label(i),
                "address": r.name,
                "resolved": all.get(i).and_then(|h| h.addr()).map(|a| a.to_string()),
                "healthy": r.healthy,
                "in_pool": in_pool,
                "kv_events": all.get(i).is_some_and(|h| h.events_live()),
                "retired": all.get(i).is_some_and(|h| h.is_retired()),
                "matched_blocks": blocks,
                "offloaded_blocks": offloaded.get(i).copied().unwrap_or(0),
                // Matched only by requests sent there, not yet reported by the replica.
                "unconfirmed_blocks": blocks.saturating_sub(confirmed.get(i).copied().unwrap_or(0)),
                "prefix_reuse": reuse.get(i).copied().unwrap_or(0.0),
                "predicted_cached_tokens": blocks * block_size,
                "load": {
                    "in_flight": r.load.in_flight,
                    "waiting": r.load.waiting,
                    "running": r.load.running,
                    "kv_usage": r.load.kv_usage,
                },
                "speed": {
                    "queued_prefill_tokens": r.speed.queued_prefill_tokens,
                    "prefill_tokens_per_s": 1.0 / r.speed.seconds_per_token,
                    "overhead_s": r.speed.overhead_s,
                    "seconds_per_attention_unit": r.speed.seconds_per_attention,
                    "decode_step_s": r.speed.decode_step_s,
                    "current_step_s": r.speed.current_step_s,
                    "step_now_s": r.speed.step_now_s,
                    "step_per_context_token_s": r.speed.step_per_context_token_s,
                    "stall_margin_s": r.speed.stall_margin_s,
                    "chunk_tokens": r.speed.chunk_tokens,
                    "step_wait_s": r.speed.step_wait_s,
                    "join_step_s": r.speed.join_step_s,
                    "reuse_rate": r.speed.reuse_rate,
                },
                "predicted_ttft_s": score.and_then(|s| s.estimate).map(|e| e.ttft_s),
                "own_prefill_s": score.and_then(|s| s.estimate).map(|e| e.own_prefill_s),
                "cost": score.map(|s| s.cost),
                "recompute_charge_s": score.map(|s| s.recompute_s),
                "displace_charge_s": score.map(|s| s.displace_s),
                "itl_over_limit": score.and_then(|s| s.itl_over).map(|o| json!({
                    "p95_gap_s": o.step_s,
                    "limit_s": o.limit_s,
                })),
                "admission": admission,
            })
        })
        .collect();
    let holders: Vec<Value> = placed
        .fleet
        .replicas
        .iter()
        .enumerate()
        .filter(|(i, _)| matched.get(*i).copied().unwrap_or(0) > 0)
        .map(|(i, _)| json!({"replica": label(i), "matched_blocks": matched[i]}))
        .collect();
    let (now, now_reason) = match &placed.outcome {
        Outcome::Go(_) => ("dispatched", None),
        Outcome::Hold { .. } if route.rt.queue.is_full() => ("refused", Some("queue_full")),
        Outcome::Hold { reason, .. } => ("queued", Some(*reason)),
        Outcome::Fail(_) => ("refused", Some("no_healthy_replica")),
    };
    let decision = match (&placed.outcome, decision) {
        (Outcome::Fail(e), _) => json!({"error": e.body.error.message}),
        (_, Some(d)) => json!({
            "replica": label(d.replica),
            "address": placed.fleet.replicas[d.replica].name,
            "reason": d.reason.label(),
            "detail": d.reason.to_string(),
            "matched_blocks": d.matched_blocks,
            "predicted_ttft_s": d.scores.iter().find(|s| s.replica == d.replica)
                .and_then(|s| s.estimate).map(|e| e.ttft_s),
            "admitted_now": matches!(placed.outcome, Outcome::Go(_)),
            "warm": d.warm.map(|w| json!({"replica": label(w.replica), "reason": w.reason.label()})),
        }),
        (_, None) => json!(null),
    };
    json!({
        "model": a.models.get(route.model).map(|(name, _)| name.as_str()),
        "route": route.cfg.name,
        "route_matched_because": matched_because(route, p.prompt_tokens),
        "slo": {
            "ttft_s": route.slo.ttft.map(|d| d.as_secs_f64()),
            "itl_s": route.slo.itl.map(|d| d.as_secs_f64()),
            "admission": route.cfg.admission,
        },
        "policy": route.policy.name(),
        "cost_unit": unit.describe(),
        "prompt_tokens": p.prompt_tokens,
        "block_size": block_size,
        "blocks_hashed": p.hashes.len(),
        "cacheable_blocks": p.cacheable,
        "first_block_hashes": p.hashes.iter().take(4).map(|h| format!("{h:016x}")).collect::<Vec<_>>(),
        "tokenize_seconds": p.tokenize_seconds,
        "holders": holders,
        "replicas": replicas,
        "decision": decision,
        "now": now,
        "now_reason": now_reason,
    })
}
