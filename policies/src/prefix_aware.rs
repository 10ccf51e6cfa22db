//! `prefix_aware`: send a request where its prefix is already cached, unless waiting there
//! costs more than prefilling it again elsewhere.
//!
//! **`cost = "ttft"` (the default)**: for every healthy replica, predict this request's time to
//! first token from what the gateway knows of it ([`SpeedView`]): the fixed overhead, plus the
//! prefill already queued there and this request's uncached tokens (from the prefix index's
//! longest run of matching blocks on that replica) at the learnt seconds per token (the fit
//! learns from whole measured TTFTs, so the running streams' share of each step is in it). Add the
//! stall this request's own prefill imposes on the streams already running there
//! (`stall_weight` × own prefill seconds × running streams). The fixed overhead is compared as
//! the fleet's smallest (each replica's own stays in its predicted TTFT): replicas differ in
//! the work in front of a request, and a young fit's intercept is mostly noise. The cheapest
//! replica wins; every
//! replica within `max(tie_ms, tie_ratio × cheapest)` of it counts as tied, and among tied
//! replicas the longest cached prefix wins (affinity breaks ties), then the fewest requests,
//! then the rendezvous hash. Costs inside the window are not compared again: there they
//! differ by the noise in each replica's learnt rate, and ordering by it sent every new prefix
//! on an idle fleet to whichever replica had happened to measure fastest.
//!
//! A hot prefix therefore spreads by itself: while the holder's queue is short it wins on the
//! cache it holds; once its queued prefill makes it slower than prefilling the prefix from
//! scratch on another replica, the request goes there (`spread`), and that replica becomes a
//! second holder — later requests are priced across both.
//!
//! **Repeating a held prefix behind a queue is paid twice** (`recompute_weight`, 1.0): a
//! replica that would prefill again tokens of the prompt another candidate holds, while it has
//! prefill queued itself, is charged those tokens' prefill seconds once more. The request's
//! own TTFT is not all it costs: the repeat is work the fleet would not otherwise do, and
//! whoever queues at that replica next waits for it too. When the fleet is busy everywhere (a
//! burst of new prompts, all replicas prefilling), prefix after prefix spread on the
//! prediction alone — each repeat deepening the queues that made the next spread look right
//! (inference-perf's shared-prefix shape: 23 spreads in 960 requests, 9 of them among the
//! first 75, ~30% more prefill in the burst; BENCHMARKS, issue 35). An idle replica is not
//! charged: a repeat there uses capacity nobody was using, and is how a hot prefix gets its
//! second holder. Nor is a repeat the inter-token check forces (a holder it passes over is
//! no alternative), nor one away from a holder whose streams would step over `warm_headroom`
//! × the inter-token promise: there the repeat buys decode headroom, which the charge does
//! not see, and on bursty traffic past the inter-token knee charging it kept streams on
//! holders just over the promise (goodput 0.72× and 0.91× sglang's against 0.86× and 1.13×
//! without the charge, seed 5).
//!
//! **A long prefill is priced for whom it holds up** (`displace_weight`, 1.0): an engine
//! prefills the prompts it is running before it admits new ones, so while a request's own
//! prefill runs, every request that arrives for what the replica holds waits for it. Each
//! replica is charged the expected wait: its reuse rate (requests a second recently sent there
//! to use its cache, [`SpeedView::reuse_rate`]) × own prefill seconds² / 2 (arrivals over
//! the prefill, each waiting half of it on average). A short prefill costs next to nothing
//! anywhere; a cold 5,000-token prompt (~2 s on a time-scaled A100) is sent to a replica
//! whose cache few requests use rather than to the holder of a busy application's prompt,
//! whose next requests would otherwise queue behind it. Measured (BENCHMARKS, issue 28): on
//! bursty L4 traffic past the inter-token knee the worst seed's p99 fell from 1.95 s to 0.97 s
//! and its goodput rose from 0.86× to 0.93× sglang's; chat at the knee and agent and the apps
//! shape are level to slightly better.
//!
//! **The inter-token check** (`itl_headroom`, 0.85 by default): before the cost, a replica whose
//! running streams would see a decode step over 0.85 × the route's inter-token promise is
//! passed over while another replica would keep within it. The step it would see is its
//! streams' current median gap moved along the replica's learnt step-per-context-token line by
//! the prompt tokens dispatched there since and by this request's own prompt
//! ([`SpeedView::step_with`]): a decode step reads every running sequence's context, so forty
//! streams of a 3,000-token system prompt step far slower than forty of a 1,000-token one. The
//! cost prices this request's first token; it does not see that one more stream on a large
//! batch slows every stream there. A
//! holder is passed over only for a *shared* prefix (at least `itl_min_reuse` recent requests
//! reused it, [`RouteRequest::prefix_reuse`]): a second holder of a system prompt serves every
//! later request, but a conversation's history prefilled elsewhere serves one turn. Where no
//! replica would keep within the limit, the cost alone decides (the holder keeps the stream:
//! spreading buys nothing there; `itl_overflow`, off by default, sends it to the replica
//! furthest over instead). `itl_fleet_ratio`, off by default, floors the limit at that many
//! times the fleet's median step.
//!
//! **`cost = "tokens"`**: `uncached prompt tokens × prefill_weight (1.0) + requests at the
//! replica × load_weight (256 token-equivalents) + KV usage ratio × kv_usage_weight (512)`,
//! the cheapest winning and the rendezvous hash of the prompt's first block breaking ties.
//!
//! **Warming** (`warm_headroom`, 0.7; `warm_queue_share`, 0.5; `warm_min_reuse`, 4): when a
//! request of a hot prefix goes to a holder and every replica holding as much of it is pressed
//! (its streams would step over 0.7 × the inter-token promise, or its predicted TTFT is over
//! half a cold replica's), the decision also names a replica to warm — the cheapest of those
//! holding less that would keep within the inter-token limit — and the gateway sends it the
//! prompt for one token: a second holder ahead of the burst, not after it (`warm.rs`).
//!
//! An imbalance guard (as SGLang's cache-aware router): if the winner's load exceeds the least
//! loaded replica's by more than `balance_abs_threshold` requests and by more than
//! `balance_rel_threshold` (1.5) ×, affinity is overridden and the cheapest replica within the
//! absolute threshold of the minimum load is chosen instead. It is on by default (16) under
//! `tokens`, whose cost cannot see queued work, and off unless set under `ttft`: seconds price
//! the load already, and on chat traffic the count guard only gave reuse away (BENCHMARKS,
//! issue 11: with it off, median p95 TTFT 7% lower below the knee and 12% lower at it, hit
//! ratio 1.4 and 4.2 points higher).

use config::policy::{CostModel, PrefixAwareConfig};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::types::*;

const TIE_SEED: u64 = 0x6b76_6761_7465_7469; // "kvgateti"

/// What a block in a replica's offload tier (CPU memory) costs, as a fraction of prefilling
/// it: copying a block's KV over PCIe takes roughly a sixth to a quarter of recomputing it for
/// an 8B model on a modern GPU. Cheaper than a miss, dearer than a GPU hit.
pub const OFFLOADED_TOKEN_COST: f64 = 0.25;

pub struct PrefixAware {
    cfg: PrefixAwareConfig,
}

impl PrefixAware {
    pub fn new(cfg: PrefixAwareConfig) -> Self {
        PrefixAware { cfg }
    }

    /// `shared_overhead`: the smallest fixed overhead among the candidates. Replicas are
    /// compared on the work in front of the request, not on their learnt fixed overheads: one
    /// slow first request moves a young fit's intercept by far more than replicas really
    /// differ there, and would make the replica holding a prefix look slower than a cold one.
    fn score(
        &self,
        req: &RouteRequest<'_>,
        i: usize,
        r: &ReplicaView,
        shared_overhead: f64,
        fleet_step: Option<f64>,
    ) -> ReplicaScore {
        let cached = (req.matched(i) * req.block_size).min(req.prompt_tokens);
        // Blocks in the replica's offload tier are loaded, not recomputed: each costs a
        // fraction of its prefill.
        let offloaded = (req.offloaded(i) * req.block_size).min(req.prompt_tokens - cached);
        let uncached = (req.prompt_tokens - cached - offloaded) as u64
            + (offloaded as f64 * OFFLOADED_TOKEN_COST).round() as u64;
        let load = r.load.requests();
        let h = self.cfg.itl_headroom;
        // When `itl_fleet_ratio` is set, never under that × the fleet's median step.
        let floor = fleet_step.map_or(0.0, |s| s * self.cfg.itl_fleet_ratio);
        let limit = req
            .itl_target_s
            .filter(|_| h > 0.0)
            .map(|t| (t * h).max(floor));
        // Only a replica with streams running can break a promise by taking one more; and a
        // holder is passed over only for a shared prefix, which a second holder amortises.
        let shared = req.matched(i) == 0 || req.reuse(i) >= self.cfg.itl_min_reuse;
        let step = r
            .speed
            .step_with(req.prompt_tokens as u64)
            .filter(|_| load > 0 && shared);
        let itl_over = match (self.cfg.cost, step, limit) {
            (CostModel::Ttft, Some(p), Some(l)) if p > l => Some(ItlOver {
                step_s: p,
                limit_s: l,
                reuse: Some(req.reuse(i)).filter(|n| req.matched(i) > 0 && n.is_finite()),
            }),
            _ => None,
        };
        let (cost, estimate, displace_s) = match self.cfg.cost {
            CostModel::Ttft => {
                let cached = (req.prompt_tokens as u64).saturating_sub(uncached);
                let e = r.speed.estimate(uncached, cached);
                let stall = self.cfg.stall_weight * e.own_prefill_s * f64::from(load);
                // The requests expected here for what it holds while this prefill runs, each
                // waiting half of it on average (module docs).
                let displace =
                    self.cfg.displace_weight * r.speed.reuse_rate * e.own_prefill_s.powi(2) / 2.0;
                let work = e.ttft_s - r.speed.overhead_s;
                (shared_overhead + work + stall + displace, Some(e), displace)
            }
            CostModel::Tokens => (
                uncached as f64 * self.cfg.prefill_weight
                    + f64::from(load) * self.cfg.load_weight
                    + r.load.kv_usage * self.cfg.kv_usage_weight,
                None,
                0.0,
            ),
        };
        ReplicaScore {
            replica: i,
            matched_blocks: req.matched(i),
            load,
            cost,
            estimate,
            recompute_s: 0.0,
            displace_s,
            itl_over,
        }
    }

    fn overloaded(&self, load: u32, min_load: u32) -> bool {
        self.cfg.abs_threshold().is_some_and(|abs| {
            load > min_load + abs
                && load as f64 > self.cfg.balance_rel_threshold * f64::from(min_load.max(1))
        })
    }

    /// `recompute_weight`: each replica that would prefill again, behind prefill queued there,
    /// tokens of the prompt a `candidate` holds pays that prefill once more (module docs). The
    /// holders are the candidates only: one the inter-token check passes over is no
    /// alternative, and repeating its prefix elsewhere is then the only choice left.
    fn charge_repeats(
        &self,
        req: &RouteRequest<'_>,
        set: &ReplicaSet,
        scores: &mut [ReplicaScore],
        candidate: impl Fn(&ReplicaScore) -> bool,
    ) {
        if self.cfg.cost != CostModel::Ttft || self.cfg.recompute_weight == 0.0 {
            return;
        }
        // Tokens a replica has without prefilling them (offloaded blocks are loaded, not
        // repeated).
        let kept = |i: usize| {
            ((req.matched(i) + req.offloaded(i)) * req.block_size).min(req.prompt_tokens) as u64
        };
        let held = scores
            .iter()
            .filter(|s| candidate(s))
            .map(|s| kept(s.replica))
            .max()
            .unwrap_or(0);
        // A holder whose streams would step near the promise: a repeat elsewhere buys decode
        // headroom there, which this charge does not see — the inter-token side decides, as
        // without it.
        if held == 0
            || scores.iter().any(|s| {
                candidate(s)
                    && kept(s.replica) == held
                    && self.steps_near_promise(req, set, s.replica)
            })
        {
            return;
        }
        for s in scores.iter_mut() {
            let speed = &set.replicas[s.replica].speed;
            let cached = kept(s.replica);
            let repeated = held.saturating_sub(cached);
            if repeated == 0 || speed.queued_prefill_tokens == 0 {
                continue;
            }
            let uncached = req.prompt_tokens as u64 - cached;
            let with = speed.estimate(uncached, cached).own_prefill_s;
            let without = speed
                .estimate(uncached - repeated, cached + repeated)
                .own_prefill_s;
            s.recompute_s = self.cfg.recompute_weight * (with - without);
            s.cost += s.recompute_s;
        }
    }

    /// Whether replica `i`'s streams would step over `warm_headroom` × the route's inter-token
    /// promise with this request added: false without a promise, with the headroom at 0, or
    /// with no streams there. Such a replica is pressed on the inter-token side (warming, the
    /// repeat charge).
    pub(super) fn steps_near_promise(
        &self,
        req: &RouteRequest<'_>,
        set: &ReplicaSet,
        i: usize,
    ) -> bool {
        let r = &set.replicas[i];
        let near = req
            .itl_target_s
            .filter(|_| self.cfg.warm_headroom > 0.0)
            .map(|t| t * self.cfg.warm_headroom);
        let step = r.speed.step_with(req.prompt_tokens as u64);
        r.load.requests() > 0 && near.zip(step).is_some_and(|(n, p)| p > n)
    }

    /// The winner among `candidates`: under `ttft`, the longest cached prefix among those tied
    /// with the cheapest, then the fewest requests; under `tokens`, the cheapest. The
    /// rendezvous hash breaks what is left.
    fn pick<'s>(
        &self,
        req: &RouteRequest<'_>,
        set: &ReplicaSet,
        candidates: impl Iterator<Item = &'s ReplicaScore> + Clone,
    ) -> Option<&'s ReplicaScore> {
        let hash = |s: &ReplicaScore| tie_break(req, &set.replicas[s.replica].name);
        let best = candidates.clone().map(|s| s.cost).min_by(f64::total_cmp)?;
        let window = match self.cfg.cost {
            CostModel::Ttft => (self.cfg.tie_ms / 1000.0).max(self.cfg.tie_ratio * best),
            CostModel::Tokens => 0.0,
        };
        candidates
            .filter(|s| s.cost <= best + window)
            .min_by(|a, b| {
                b.matched_blocks
                    .cmp(&a.matched_blocks)
                    .then(a.load.cmp(&b.load))
                    .then_with(|| hash(b).cmp(&hash(a)))
            })
    }
}

/// The median decode step (s) of the healthy replicas with streams running; `None` when none
/// has any.
fn median_step(set: &ReplicaSet) -> Option<f64> {
    let mut steps: Vec<f64> = set
        .healthy()
        .filter(|(_, r)| r.load.requests() > 0)
        .filter_map(|(_, r)| r.speed.current_step_s)
        .collect();
    if steps.is_empty() {
        return None;
    }
    steps.sort_by(f64::total_cmp);
    let n = steps.len();
    Some(if n % 2 == 1 {
        steps[n / 2]
    } else {
        (steps[n / 2 - 1] + steps[n / 2]) / 2.0
    })
}

fn tie_break(req: &RouteRequest<'_>, name: &str) -> u64 {
    let key = req
        .block_hashes
        .first()
        .copied()
        .unwrap_or(req.prompt_tokens as u64);
    let mut bytes = key.to_le_bytes().to_vec();
    bytes.extend_from_slice(name.as_bytes());
    xxh3_64_with_seed(&bytes, TIE_SEED)
}

impl RoutingPolicy for PrefixAware {
    fn name(&self) -> &'static str {
        "prefix_aware"
    }

    fn cost_unit(&self) -> CostUnit {
        match self.cfg.cost {
            CostModel::Ttft => CostUnit::Seconds,
            CostModel::Tokens => CostUnit::TokenEquivalents,
        }
    }

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let shared_overhead = set
            .healthy()
            .map(|(_, r)| r.speed.overhead_s)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0);
        let fleet_step = median_step(set);
        let mut scores: Vec<ReplicaScore> = set
            .healthy()
            .map(|(i, r)| self.score(req, i, r, shared_overhead, fleet_step))
            .collect();
        // The inter-token promise first (`itl_headroom`): a replica whose streams already see a
        // decode step over the limit is passed over while any keeps within it (when none
        // does, the cost alone decides) — unless it holds a prefix of this prompt few other
        // requests reuse (a conversation), whose prefill elsewhere nothing would amortise.
        let some_keep = scores.iter().any(|s| s.itl_over.is_none());
        self.charge_repeats(req, set, &mut scores, |s| {
            !some_keep || s.itl_over.is_none()
        });
        let eligible = scores
            .iter()
            .filter(move |s| !some_keep || s.itl_over.is_none());
        let min_load = eligible
            .clone()
            .map(|s| s.load)
            .min()
            .ok_or(RouteError::NoHealthyReplica)?;
        let best = self
            .pick(req, set, eligible.clone())
            .expect("scores is non-empty");
        let ttft = |s: &ReplicaScore| s.estimate.map_or(0.0, |e| e.ttft_s);
        // The holder: the longest cached run of this prompt, the cheapest among equals.
        let holder = scores
            .iter()
            .filter(|s| s.matched_blocks > 0)
            .min_by(|a, b| {
                b.matched_blocks
                    .cmp(&a.matched_blocks)
                    .then(a.cost.total_cmp(&b.cost))
            });
        // Every replica over the inter-token limit: the stream breaks its promise wherever it
        // goes, so it goes where the streams are lost already — the replica furthest over —
        // rather than push a replica that still keeps most of its streams over the edge.
        let overflow = scores
            .iter()
            .filter_map(|s| s.itl_over.map(|o| (s, o)))
            .filter(|_| !some_keep && self.cfg.itl_overflow)
            .max_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
        let (chosen, reason) = if let Some((s, o)) = overflow {
            (
                s,
                DecisionReason::Overflow {
                    gap_s: o.step_s,
                    limit_s: o.limit_s,
                },
            )
        } else if self.overloaded(best.load, min_load) {
            let within = eligible
                .clone()
                .filter(|s| s.load <= min_load + self.cfg.abs_threshold().unwrap_or(u32::MAX));
            let alt = self
                .pick(req, set, within)
                .expect("the least-loaded replica qualifies");
            (
                alt,
                DecisionReason::LoadGuard {
                    preferred: best.replica,
                    preferred_blocks: best.matched_blocks,
                },
            )
        } else {
            let reason = match holder {
                Some(h)
                    if self.cfg.cost == CostModel::Ttft
                        && h.matched_blocks > best.matched_blocks =>
                {
                    DecisionReason::Spread {
                        holder: h.replica,
                        holder_blocks: h.matched_blocks,
                        holder_ttft_s: ttft(h),
                        chosen_ttft_s: ttft(best),
                        holder_itl: h.itl_over,
                    }
                }
                _ if best.matched_blocks > 0 => DecisionReason::PrefixMatch {
                    blocks: best.matched_blocks,
                },
                _ => DecisionReason::NoMatch,
            };
            (best, reason)
        };
        let mut d = RouteDecision::new(chosen.replica, reason, req);
        d.warm = self.warm(req, set, &scores, chosen);
        d.scores = scores;
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
mod warm;
