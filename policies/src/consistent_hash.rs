//! `consistent_hash`: consistent hashing with bounded loads (CHWBL, Mirrokni et al.; the
//! algorithm behind HAProxy's `hash-balance-factor`).
//!
//! Parameters: `key` (`session`: the session id, falling back to the prefix; `prefix`: the first
//! `prefix_blocks` block hashes, default 4), `load_factor` (default 1.25: no replica takes more
//! than 1.25 × the average load + 1 before its keys spill clockwise to the next replica),
//! `virtual_nodes` per replica on the ring (default 160). A request with no key at all (no
//! session, prompt shorter than a block) goes to the least-loaded replica.

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::types::*;
use config::policy::HashKey;

const RING_SEED: u64 = 0x6b76_6761_7465_7269; // "kvgateri"

pub struct ConsistentHash {
    key: HashKey,
    prefix_blocks: usize,
    load_factor: f64,
    virtual_nodes: usize,
    ring: Mutex<Ring>,
}

/// The ring for the last seen replica names: (point, replica index), sorted by point.
#[derive(Default)]
struct Ring {
    names: Vec<String>,
    points: Vec<(u64, usize)>,
}

impl ConsistentHash {
    pub fn new(key: HashKey, prefix_blocks: usize, load_factor: f64, virtual_nodes: usize) -> Self {
        ConsistentHash {
            key,
            prefix_blocks: prefix_blocks.max(1),
            load_factor,
            virtual_nodes: virtual_nodes.max(1),
            ring: Mutex::new(Ring::default()),
        }
    }

    fn request_key(&self, req: &RouteRequest<'_>) -> Option<u64> {
        if self.key == HashKey::Session {
            if let Some(s) = req.session_id {
                return Some(xxh3_64_with_seed(s.as_bytes(), RING_SEED));
            }
        }
        if req.block_hashes.is_empty() {
            return None;
        }
        let n = self.prefix_blocks.min(req.block_hashes.len());
        let bytes: Vec<u8> = req.block_hashes[..n]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        Some(xxh3_64_with_seed(&bytes, RING_SEED))
    }

    fn ring_for(&self, set: &ReplicaSet) -> Vec<(u64, usize)> {
        let mut cached = self.ring.lock();
        let same = cached.names.len() == set.replicas.len()
            && cached
                .names
                .iter()
                .zip(&set.replicas)
                .all(|(a, b)| *a == b.name);
        if !same {
            let mut ring = Vec::with_capacity(set.replicas.len() * self.virtual_nodes);
            for (i, r) in set.replicas.iter().enumerate() {
                for v in 0..self.virtual_nodes {
                    let point = xxh3_64_with_seed(format!("{}#{v}", r.name).as_bytes(), RING_SEED);
                    ring.push((point, i));
                }
            }
            ring.sort_unstable();
            *cached = Ring {
                names: set.replicas.iter().map(|r| r.name.clone()).collect(),
                points: ring,
            };
        }
        cached.points.clone()
    }
}

impl RoutingPolicy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn route(&self, req: &RouteRequest<'_>, set: &ReplicaSet) -> Result<RouteDecision, RouteError> {
        let healthy: Vec<usize> = set.healthy().map(|(i, _)| i).collect();
        if healthy.is_empty() {
            return Err(RouteError::NoHealthyReplica);
        }
        let Some(key) = self.request_key(req) else {
            let least = healthy
                .iter()
                .copied()
                .min_by_key(|&i| set.replicas[i].load.requests())
                .expect("non-empty");
            return Ok(RouteDecision::new(least, DecisionReason::LeastLoad, req));
        };
        let total: u64 = healthy
            .iter()
            .map(|&i| u64::from(set.replicas[i].load.requests()))
            .sum();
        let cap = (self.load_factor * (total + 1) as f64 / healthy.len() as f64).ceil() as u32;
        let ring = self.ring_for(set);
        let start = ring.partition_point(|&(p, _)| p < key);
        let mut seen = vec![false; set.replicas.len()];
        let mut hops = 0;
        for k in 0..ring.len() {
            let (_, r) = ring[(start + k) % ring.len()];
            if seen[r] {
                continue;
            }
            seen[r] = true;
            let view = &set.replicas[r];
            if !view.healthy {
                continue;
            }
            if view.load.requests() < cap {
                return Ok(RouteDecision::new(
                    r,
                    DecisionReason::ConsistentHash { hops },
                    req,
                ));
            }
            hops += 1;
        }
        // Every replica is at its bound (possible when loads are stale): least loaded.
        let least = healthy
            .iter()
            .copied()
            .min_by_key(|&i| set.replicas[i].load.requests())
            .expect("non-empty");
        Ok(RouteDecision::new(
            least,
            DecisionReason::ConsistentHash { hops },
            req,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_replica_and_keys_spread() {
        let set = fleet(&[0, 0, 0, 0]);
        let p = ConsistentHash::new(HashKey::Prefix, 4, 1.25, 160);
        let mut counts = [0; 4];
        for k in 0..400u64 {
            let h = [k * 7919, 1, 2, 3, 4];
            let a = p.route(&request(&h, &[]), &set).unwrap();
            let b = p.route(&request(&h, &[]), &set).unwrap();
            assert_eq!(a.replica, b.replica);
            assert_eq!(a.reason, DecisionReason::ConsistentHash { hops: 0 });
            counts[a.replica] += 1;
        }
        assert!(counts.iter().all(|&c| c > 50), "{counts:?}");
    }

    #[test]
    fn bounded_load_spills_to_the_next_replica() {
        let h = [42u64, 43];
        let p = ConsistentHash::new(HashKey::Prefix, 4, 1.25, 160);
        let home = p
            .route(&request(&h, &[]), &fleet(&[0, 0, 0, 0]))
            .unwrap()
            .replica;
        let mut loads = [1u32; 4];
        loads[home] = 10; // cap = ceil(1.25 * 14 / 4) = 5
        let d = p.route(&request(&h, &[]), &fleet(&loads)).unwrap();
        assert_ne!(d.replica, home);
        assert_eq!(d.reason, DecisionReason::ConsistentHash { hops: 1 });
    }

    #[test]
    fn session_key_wins_over_prefix_and_removal_moves_few_keys() {
        let p = ConsistentHash::new(HashKey::Session, 4, 1.25, 160);
        let set = fleet(&[0, 0, 0, 0]);
        let mut req = request(&[1, 2, 3], &[]);
        req.session_id = Some("conv-1");
        let a = p.route(&req, &set).unwrap().replica;
        let other = request(&[9, 9, 9], &[]);
        let mut req2 = other;
        req2.session_id = Some("conv-1");
        assert_eq!(p.route(&req2, &set).unwrap().replica, a);
        // Marking one replica unhealthy only moves the keys it owned.
        let mut degraded = set.clone();
        degraded.replicas[3].healthy = false;
        let moved = (0..200u64)
            .filter(|k| {
                let h = [*k + 1000];
                let before = p.route(&request(&h, &[]), &set).unwrap().replica;
                let after = p.route(&request(&h, &[]), &degraded).unwrap().replica;
                before != after && before != 3
            })
            .count();
        assert_eq!(moved, 0);
    }
}
