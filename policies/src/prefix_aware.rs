//! `prefix_aware`: send a request where its prefix is already cached, unless that costs more in
//! queueing than it saves in prefill.
//!
//! For every healthy replica: `cost = uncached prompt tokens × prefill_weight (1.0) + requests
//! at the replica × load_weight (256 token-equivalents) + KV usage ratio × kv_usage_weight
//! (512)`, where uncached tokens come from the prefix index's longest run of consecutive
//! matching blocks on that replica. The cheapest replica wins; among equal costs a rendezvous
//! hash of the prompt's first block decides, so distinct prefixes spread over an idle fleet and
//! a repeated prefix lands where its first copy went even before the index has heard back.
//!
//! Imbalance guard (as SGLang's cache-aware router): if the winner's load exceeds the least
//! loaded replica's by more than `balance_abs_threshold` (16) requests and by more than
//! `balance_rel_threshold` (1.5) ×, affinity is overridden and the cheapest replica within the
//! absolute threshold of the minimum load is chosen instead, so affinity never becomes a hot
//! spot.

use config::policy::PrefixAwareConfig;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::types::*;

const TIE_SEED: u64 = 0x6b76_6761_7465_7469; // "kvgateti"

pub struct PrefixAware {
    cfg: PrefixAwareConfig,
}

impl PrefixAware {
    pub fn new(cfg: PrefixAwareConfig) -> Self {
        PrefixAware { cfg }
    }

    fn cost(&self, req: &RouteRequest<'_>, i: usize, r: &ReplicaView) -> f64 {
        let cached = (req.matched(i) * req.block_size).min(req.prompt_tokens);
        let uncached = (req.prompt_tokens - cached) as f64;
        uncached * self.cfg.prefill_weight
            + r.load.requests() as f64 * self.cfg.load_weight
            + r.load.kv_usage * self.cfg.kv_usage_weight
    }

    fn overloaded(&self, load: u32, min_load: u32) -> bool {
        load > min_load + self.cfg.balance_abs_threshold
            && load as f64 > self.cfg.balance_rel_threshold * f64::from(min_load.max(1))
    }
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

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let scores: Vec<ReplicaScore> = set
            .healthy()
            .map(|(i, r)| ReplicaScore {
                replica: i,
                matched_blocks: req.matched(i),
                load: r.load.requests(),
                cost: self.cost(req, i, r),
            })
            .collect();
        let min_load = scores
            .iter()
            .map(|s| s.load)
            .min()
            .ok_or(RouteError::NoHealthyReplica)?;
        let pick = |candidates: &mut dyn Iterator<Item = &ReplicaScore>| -> Option<usize> {
            candidates
                .min_by(|a, b| {
                    a.cost.total_cmp(&b.cost).then_with(|| {
                        tie_break(req, &set.replicas[b.replica].name)
                            .cmp(&tie_break(req, &set.replicas[a.replica].name))
                    })
                })
                .map(|s| s.replica)
        };
        let best = pick(&mut scores.iter()).expect("scores is non-empty");
        let best_score = scores.iter().find(|s| s.replica == best).expect("present");
        let (replica, reason) = if self.overloaded(best_score.load, min_load) {
            let within = scores
                .iter()
                .filter(|s| s.load <= min_load + self.cfg.balance_abs_threshold);
            let alt = pick(&mut within.into_iter()).expect("the least-loaded replica qualifies");
            (
                alt,
                DecisionReason::LoadGuard {
                    preferred: best,
                    preferred_blocks: best_score.matched_blocks,
                },
            )
        } else if best_score.matched_blocks > 0 {
            (
                best,
                DecisionReason::PrefixMatch {
                    blocks: best_score.matched_blocks,
                },
            )
        } else {
            (best, DecisionReason::NoMatch)
        };
        let mut d = RouteDecision::new(replica, reason, req);
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
        let d = policy().route(&request(&[1; 8], &[0, 8, 0]), &set).unwrap();
        assert_ne!(d.replica, 1);
        assert_eq!(d.reason, DecisionReason::NoMatch);
    }

    #[test]
    fn load_guard_overrides_affinity_on_a_hot_spot() {
        // Without a load weight, affinity alone would always win.
        let p = PrefixAware::new(PrefixAwareConfig {
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
