//! `session`: requests carrying a session id (the gateway reads it from the configured header,
//! default `x-session-id`) stick to one replica chosen by rendezvous hashing over the healthy
//! replicas — stable while the fleet is, and only a failed replica's sessions move. Requests
//! without one are routed by `fallback` (default `prefix_aware`).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::types::*;

const SESSION_SEED: u64 = 0x6b76_6761_7465_7373; // "kvgatess"

pub struct SessionAffinity {
    fallback: Box<dyn RoutingPolicy>,
}

impl SessionAffinity {
    pub fn new(fallback: Box<dyn RoutingPolicy>) -> Self {
        SessionAffinity { fallback }
    }
}

impl RoutingPolicy for SessionAffinity {
    fn name(&self) -> &'static str {
        "session"
    }

    fn cost_unit(&self) -> CostUnit {
        self.fallback.cost_unit()
    }

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let Some(session) = req.session_id else {
            let mut d = self.fallback.route(req, set)?;
            d.reason = DecisionReason::SessionFallback(Box::new(d.reason));
            return Ok(d);
        };
        let best = set
            .healthy()
            .max_by_key(|(_, r)| {
                let mut bytes = session.as_bytes().to_vec();
                bytes.push(0);
                bytes.extend_from_slice(r.name.as_bytes());
                xxh3_64_with_seed(&bytes, SESSION_SEED)
            })
            .map(|(i, _)| i)
            .ok_or(RouteError::NoHealthyReplica)?;
        Ok(RouteDecision::new(best, DecisionReason::Session, req))
    }

    fn observe(&self, event: &PolicyEvent) {
        self.fallback.observe(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RoundRobin;

    #[test]
    fn sticks_by_session_and_falls_back_without_one() {
        let p = SessionAffinity::new(Box::new(RoundRobin::default()));
        let set = fleet(&[0, 9, 0]);
        let mut req = request(&[1], &[]);
        req.session_id = Some("user-42");
        let first = p.route(&req, &set).unwrap();
        assert_eq!(first.reason, DecisionReason::Session);
        for _ in 0..5 {
            assert_eq!(p.route(&req, &set).unwrap().replica, first.replica);
        }
        let spread: std::collections::HashSet<usize> = (0..50)
            .map(|i| {
                let s = format!("user-{i}");
                let mut r = request(&[1], &[]);
                r.session_id = Some(&s);
                p.route(&r, &set).unwrap().replica
            })
            .collect();
        assert_eq!(spread.len(), 3);
        let d = p.route(&request(&[1], &[]), &set).unwrap();
        assert_eq!(
            d.reason,
            DecisionReason::SessionFallback(Box::new(DecisionReason::RoundRobin))
        );
        assert_eq!(d.reason.label(), "session_fallback");
    }
}
