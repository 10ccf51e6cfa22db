//! `round_robin`: each healthy replica in turn. No parameters. The baseline that, with prefix
//! caching on, spreads every shared prefix over the whole fleet.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::types::*;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let healthy: Vec<usize> = set.healthy().map(|(i, _)| i).collect();
        if healthy.is_empty() {
            return Err(RouteError::NoHealthyReplica);
        }
        let n = if req.dry_run {
            self.next.load(Ordering::Relaxed)
        } else {
            self.next.fetch_add(1, Ordering::Relaxed)
        };
        let r = healthy[n % healthy.len()];
        Ok(RouteDecision::new(r, DecisionReason::RoundRobin, req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_over_healthy_replicas_only() {
        let mut set = fleet(&[0, 0, 0]);
        set.replicas[1].healthy = false;
        let p = RoundRobin::default();
        let picks: Vec<usize> = (0..4)
            .map(|_| p.route(&request(&[], &[]), &set).unwrap().replica)
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        let mut preview = request(&[], &[]);
        preview.dry_run = true;
        let a = p.route(&preview, &set).unwrap().replica;
        assert_eq!(
            p.route(&preview, &set).unwrap().replica,
            a,
            "a preview moves nothing"
        );
        assert_eq!(p.route(&request(&[], &[]), &set).unwrap().replica, a);
        set.replicas[0].healthy = false;
        set.replicas[2].healthy = false;
        assert_eq!(
            p.route(&request(&[], &[]), &set),
            Err(RouteError::NoHealthyReplica)
        );
    }
}
