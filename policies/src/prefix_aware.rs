//! `prefix_aware`: send a request where its prefix is already cached, unless waiting there
//! costs more than prefilling it again elsewhere.
//!
//! **`cost = "ttft"` (the default)**: for every healthy replica, predict this request's time to
//! first token from what the gateway knows of it ([`SpeedView`]): the fixed overhead, plus the
//! prefill already queued there and this request's uncached tokens (from the prefix index's
//! longest run of matching blocks on that replica) at the learnt seconds per token, plus the
//! decode part of every step that prefill takes while the replica has streams running. Add the
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
//! **The inter-token check** (`itl_headroom`, 0.6 by default): before the cost, a replica whose
//! running streams already see a decode step over 0.6 × the route's inter-token promise is
//! passed over while another replica keeps within it. The cost prices this request's first
//! token; it does not see that one more stream on a large batch slows every stream there. A
//! holder is passed over only for a *shared* prefix (at least `itl_min_reuse` recent requests
//! reused it, [`RouteRequest::prefix_reuse`]): a second holder of a system prompt serves every
//! later request, but a conversation's history prefilled elsewhere serves one turn. The limit
//! is never under `itl_fleet_ratio` (1.1) × the fleet's median decode step: where every
//! replica is that slow, passing one over buys no inter-token time and costs a cold prefill.
//!
//! **`cost = "tokens"`**: `uncached prompt tokens × prefill_weight (1.0) + requests at the
//! replica × load_weight (256 token-equivalents) + KV usage ratio × kv_usage_weight (512)`,
//! the cheapest winning and the rendezvous hash of the prompt's first block breaking ties.
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
        // Never under `itl_fleet_ratio` × the fleet's median step: a replica as slow as the
        // rest is not worth a cold prefill elsewhere.
        let floor = fleet_step.map_or(0.0, |s| s * self.cfg.itl_fleet_ratio);
        let limit = req
            .itl_target_s
            .filter(|_| h > 0.0)
            .map(|t| (t * h).max(floor));
        // Only a replica with streams running can break a promise by taking one more; and a
        // holder is passed over only for a shared prefix, which a second holder amortises.
        let shared = req.matched(i) == 0 || req.reuse(i) >= self.cfg.itl_min_reuse;
        let step = r.speed.current_step_s.filter(|_| load > 0 && shared);
        let itl_over = match (self.cfg.cost, step, limit) {
            (CostModel::Ttft, Some(p), Some(l)) if p > l => Some(ItlOver {
                step_s: p,
                limit_s: l,
                reuse: Some(req.reuse(i)).filter(|n| req.matched(i) > 0 && n.is_finite()),
            }),
            _ => None,
        };
        let (cost, estimate) = match self.cfg.cost {
            CostModel::Ttft => {
                let e = r.speed.estimate(uncached, load);
                let stall = self.cfg.stall_weight * e.own_prefill_s * f64::from(load);
                let work = e.ttft_s - r.speed.overhead_s;
                (shared_overhead + work + stall, Some(e))
            }
            CostModel::Tokens => (
                uncached as f64 * self.cfg.prefill_weight
                    + f64::from(load) * self.cfg.load_weight
                    + r.load.kv_usage * self.cfg.kv_usage_weight,
                None,
            ),
        };
        ReplicaScore {
            replica: i,
            matched_blocks: req.matched(i),
            load,
            cost,
            estimate,
            itl_over,
        }
    }

    fn overloaded(&self, load: u32, min_load: u32) -> bool {
        self.cfg.abs_threshold().is_some_and(|abs| {
            load > min_load + abs
                && load as f64 > self.cfg.balance_rel_threshold * f64::from(min_load.max(1))
        })
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
        let scores: Vec<ReplicaScore> = set
            .healthy()
            .map(|(i, r)| self.score(req, i, r, shared_overhead, fleet_step))
            .collect();
        // The inter-token promise first (`itl_headroom`): a replica whose streams already see a
        // decode step over the limit is passed over while any keeps within it (when none
        // does, the cost alone decides) — unless it holds a prefix of this prompt few other
        // requests reuse (a conversation), whose prefill elsewhere nothing would amortise.
        let some_keep = scores.iter().any(|s| s.itl_over.is_none());
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
        let (chosen, reason) = if self.overloaded(best.load, min_load) {
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
        d.scores = scores;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
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
        // 20 ms + 1,040 tokens / 8k/s + 1 step × 20 ms decode.
        assert!(
            (e.ttft_s - (0.02 + 1040.0 / 8000.0 + 0.02)).abs() < 1e-9,
            "{e:?}"
        );
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
    fn a_holder_that_would_break_the_inter_token_promise_is_passed_over() {
        // Replica 0 holds the prompt and is quickest to a first token, but its streams see
        // a 140 ms decode step: over 0.6 x a 150 ms promise (90 ms; the fleet's median step,
        // 60 ms, x 1.1 is less). The request spreads to a replica that keeps it, and explain
        // says why.
        let hashes = [7u64; 250];
        let mut set = stepped_fleet(&[90, 20, 30], &[0.140, 0.060, 0.055]);
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
        assert!((over.limit_s - 0.090).abs() < 1e-9, "{over:?}");
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
        assert!(d.reason.to_string().contains("140 ms"), "{}", d.reason);
        // Without a promise, or when every replica is over it, the cost alone decides: the
        // holder.
        let no_promise = long_request(&hashes, &[250, 0, 0]);
        assert_eq!(checked.route(&no_promise, &set).unwrap().replica, 0);
        for r in &mut set.replicas {
            r.speed.current_step_s = Some(0.2);
        }
        assert_eq!(checked.route(&req, &set).unwrap().replica, 0);
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
        let mut set = stepped_fleet(&[90, 20, 30], &[0.140, 0.060, 0.055]);
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
        // reuse (the fleet's median step is now 140 ms, so the limit 154 ms).
        set.replicas[1].speed.current_step_s = Some(0.2);
        let d = route(&set, &[0.4, 0.0, 0.0]);
        assert_eq!(d.replica, 0, "{:?}", d.scores);
        let over = d.scores[1].itl_over.expect("replica 1 is over the limit");
        assert_eq!(over.reuse, None);
        assert!((over.limit_s - 0.154).abs() < 1e-9, "{over:?}");
    }

    #[test]
    fn a_holder_as_slow_as_the_fleet_is_not_passed_over() {
        // Every replica is busy at 85-95 ms a step (an L4 at load): the holder is over 0.6 x
        // the 150 ms promise, but not over 1.1 x the fleet's median step (97 ms). A cold
        // prefill elsewhere would buy no inter-token time: the holder keeps the prefix.
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
        // With the fleet ignored (0), the promise alone sets the limit: 90 ms.
        let promise_only = PrefixAware::new(PrefixAwareConfig {
            itl_fleet_ratio: 0.0,
            ..PrefixAwareConfig::default()
        });
        let d = promise_only.route(&req, &set).unwrap();
        assert_ne!(d.replica, 0, "{:?}", d.scores);
        assert!((d.scores[0].itl_over.unwrap().limit_s - 0.090).abs() < 1e-9);
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
}
