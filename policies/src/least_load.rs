//! `least_load`: the replica with the least load, where load = requests at the replica (the
//! larger of the gateway's in-flight count and the replica's waiting + running) plus
//! `kv_usage_weight` (default 4) × its KV usage ratio. Ties go to the lowest index after a
//! rotating start, so equal replicas share work.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::types::*;

#[derive(Debug)]
pub struct LeastLoad {
    kv_usage_weight: f64,
    rotate: AtomicUsize,
}

impl LeastLoad {
    pub fn new(kv_usage_weight: f64) -> Self {
        LeastLoad {
            kv_usage_weight,
            rotate: AtomicUsize::new(0),
        }
    }

    pub(crate) fn score(&self, r: &ReplicaView) -> f64 {
        r.load.requests() as f64 + self.kv_usage_weight * r.load.kv_usage
    }
}

impl RoutingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let n = set.replicas.len();
        if n == 0 {
            return Err(RouteError::NoHealthyReplica);
        }
        let start = if req.dry_run {
            self.rotate.load(Ordering::Relaxed)
        } else {
            self.rotate.fetch_add(1, Ordering::Relaxed)
        } % n;
        let best = (0..n)
            .map(|k| (start + k) % n)
            .filter(|&i| set.replicas[i].healthy)
            .min_by(|&a, &b| {
                self.score(&set.replicas[a])
                    .total_cmp(&self.score(&set.replicas[b]))
            })
            .ok_or(RouteError::NoHealthyReplica)?;
        Ok(RouteDecision::new(best, DecisionReason::LeastLoad, req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_least_loaded_and_weighs_kv_usage() {
        let mut set = fleet(&[7, 2, 2]);
        set.replicas[1].load.kv_usage = 0.9;
        let p = LeastLoad::new(4.0);
        for _ in 0..3 {
            assert_eq!(p.route(&request(&[], &[]), &set).unwrap().replica, 2);
        }
        // The replica's own report counts when it exceeds our in-flight count.
        set.replicas[2].load.waiting = 10;
        assert_eq!(p.route(&request(&[], &[]), &set).unwrap().replica, 1);
    }

    #[test]
    fn rotates_between_equal_replicas() {
        let set = fleet(&[1, 1, 1]);
        let p = LeastLoad::new(4.0);
        let picks: std::collections::HashSet<usize> = (0..3)
            .map(|_| p.route(&request(&[], &[]), &set).unwrap().replica)
            .collect();
        assert_eq!(picks.len(), 3);
    }
}
