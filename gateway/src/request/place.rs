//! Stage 4, place: the one answer to "where does this request go now?", asked for a first
//! dispatch (by the admit stage), for a retry after a failed attempt (the pipeline hands
//! [`Placer::retry`] to the forward stage) and for `explain`, so the three can never disagree.
//!
//! [`Placer::place`] takes the request, the route, the prefix index's match counts and the
//! purpose, reads one snapshot of the fleet (health, load, the learnt speed of every
//! replica: [`policies::SpeedView`]), and returns a [`Placement`]: the route's policy's
//! decision among the replicas admission allows, or why the request must wait, with every
//! replica's verdict for `explain`.
//!
//! - **Dispatch**: the route's limits (concurrency, prompt tokens in flight), then admission per
//!   pool replica (`routes/admissible.rs`: predicted TTFT and decode step within the promise,
//!   stall budget, KV high-water, preemptions), then affinity patience, then the policy among
//!   the admissible replicas. When no replica admits it, the route's queue waits behind it,
//!   unless every replica holds it only for `stalls` (its own long prefill on streams over
//!   the stall budget): a mostly cached request behind it stalls nobody and goes first.
//! - **Retry**: the request was admitted already; the policy chooses again without the replicas
//!   it tried.
//! - **Explain**: the dispatch path as a dry run — nothing reserved, no policy state advanced.
//!
//! **A prefix in flight** (dispatch and explain): when the chosen replica's match includes
//! blocks an earlier request was sent there to compute and the replica has not reported yet
//! (its KV events are live, and a request whose prompt carries the first unconfirmed block has
//! not answered there yet), the request waits
//! (`prefix_in_flight`, not blocking the queue) until the replica confirms them, for at most
//! `prefix_in_flight_wait_ms`. An engine caches only computed blocks: sent at once, a burst's
//! followers prefill the unfinished part of the shared prefix again beside the first request,
//! slowing it and themselves (BENCHMARKS, issue 11, bursty traffic). A kvgate replica waits
//! for such a prefix itself (its `/server_info` says `waits_for_prefix_in_flight`), joining the
//! step after the blocks are computed, so the gateway sends the request at once: no hold, and
//! no round trip through the KV events after the prefix is done.
//!
//! **A scoped request** (a batch line, `Prepared::scope`: the replicas the trough found spare)
//! may go only to a replica of its scope with no background prompt of this gateway's still
//! prefilling there — so the lines one look starts go to as many replicas, each the one of
//! them that holds most of its prefix — and goes now or not at all: where it would be held,
//! it is refused (503 `no_spare_replica`) and its runner puts it back. Before scopes, a line
//! went wherever the batch route's placement liked, and the replica holding a task's system
//! prompt ran 10–30 lines at once while the trough's per-replica gates assumed one or two
//! (BENCHMARKS, issue 33).

use std::time::Duration;

use policies::{ReplicaSet, RouteDecision, RouteRequest};
use protocol::slo::Slo;
use protocol::ApiError;

use crate::fleet::registry::Registry;
use crate::prefix::view::PrefixView;
use crate::request::prepared::Prepared;
use crate::routes::admissible::{admissible, Hold};
use crate::routes::store::{ActivePolicy, ActiveRoute};

/// The error code a scoped request is refused with when none of its replicas can take it.
pub const NO_SPARE_REPLICA: &str = "no_spare_replica";

/// Why a placement is asked for.
#[derive(Debug, Clone, Copy)]
pub enum Purpose<'a> {
    /// A first dispatch, after waiting `waited` in the route's queue so far.
    Dispatch { waited: Duration },
    /// Another attempt after `tried` failed before the first byte.
    Retry { tried: &'a [usize] },
    /// `POST /admin/route/explain`: as a dispatch now, nothing reserved.
    Explain,
}

impl Purpose<'_> {
    fn dry_run(&self) -> bool {
        matches!(self, Purpose::Explain)
    }

    fn waited(&self) -> Duration {
        match self {
            Purpose::Dispatch { waited } => *waited,
            _ => Duration::ZERO,
        }
    }
}

/// Whether every replica holds the request only because its own prefill would stall streams
/// already over the stall budget: a hold that a mostly cached request behind it does not share
/// (its prefill stalls nobody), so it does not block the queue. Any other hold (the predicted
/// TTFT or step, KV, preemptions) says the replica is short of room for everyone.
fn only_its_own_prefill_stalls(held: &[(usize, Hold)]) -> bool {
    !held.is_empty() && held.iter().all(|(_, h)| matches!(h, Hold::Stalls { .. }))
}

/// What placement concluded.
#[derive(Debug)]
pub enum Outcome {
    /// Send it there.
    Go(RouteDecision),
    /// Not now. `blocking`: the route as a whole has no room (its limits, or no admissible
    /// replica in its pool), so those queued behind wait their turn; otherwise only this
    /// request's preferred replica is busy (affinity patience), or only this request's own
    /// prefill is too long for the replicas' stalling streams, and others may go ahead.
    Hold {
        reason: &'static str,
        blocking: bool,
    },
    /// Nothing to wait for (no healthy replica in the pool).
    Fail(ApiError),
}

/// A placement and what it was made of.
#[derive(Debug)]
pub struct Placement {
    pub outcome: Outcome,
    /// The fleet as the policy saw it (every replica, by slot).
    pub fleet: ReplicaSet,
    /// Replicas of the pool admission held back, and why.
    pub held: Vec<(usize, Hold)>,
    /// The policy's choice had admission not held anyone back (only when some were held).
    pub preferred: Option<RouteDecision>,
}

impl Placement {
    /// What holding is predicted to win, seconds: the best TTFT among the replicas the request
    /// could go to now, less the TTFT at the one it waits for (`None` when the policy does not
    /// predict, or nothing else is open).
    pub fn hold_gain_s(&self) -> Option<f64> {
        let held: Vec<usize> = self.held.iter().map(|(h, _)| *h).collect();
        gain_s(self.preferred.as_ref()?, &held)
    }
}

/// The best predicted TTFT among `want`'s scored replicas other than its choice and those in
/// `closed`, less the TTFT at its choice: what waiting for the choice is predicted to win.
fn gain_s(want: &RouteDecision, closed: &[usize]) -> Option<f64> {
    let at = want.predicted_ttft_s()?;
    let best_open = want
        .scores
        .iter()
        .filter(|s| s.replica != want.replica && !closed.contains(&s.replica))
        .filter_map(|s| s.estimate.map(|e| e.ttft_s))
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))))?;
    Some(best_open - at)
}

/// What one placement asks the policy about, whatever the replicas it may choose from.
#[derive(Clone, Copy)]
struct Ask<'a> {
    route: &'a ActiveRoute,
    p: &'a Prepared,
    matched: &'a [usize],
    itl: Option<Duration>,
}

/// What placement reads: the fleet (health, load, learnt speed) and the prefix index.
#[derive(Clone, Copy)]
pub struct Placer<'a> {
    pub fleet: &'a Registry,
    pub prefix: &'a PrefixView,
}

impl Placer<'_> {
    /// Per replica: blocks of `p` the index believes are cached there now.
    pub fn matched(&self, p: &Prepared) -> Vec<usize> {
        self.prefix.matched(p.blocks(), &self.fleet.index_scope())
    }

    /// Per replica: blocks of `p` each replica has itself reported (its KV events).
    pub fn confirmed(&self, p: &Prepared) -> Vec<usize> {
        self.prefix.confirmed(p.blocks(), &self.fleet.index_scope())
    }

    /// Where an admitted request goes after the replicas in `tried` failed it (the policy again,
    /// without them), or why it cannot go anywhere.
    pub fn retry(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        matched: &[usize],
        tried: &[usize],
    ) -> Result<RouteDecision, ApiError> {
        match self
            .place(a, route, p, matched, Purpose::Retry { tried })
            .outcome
        {
            Outcome::Go(d) => Ok(d),
            Outcome::Fail(e) => Err(e),
            Outcome::Hold { reason, .. } => Err(ApiError::unavailable(format!(
                "no replica can take the request now ({reason})"
            ))
            .with_code("no_healthy_replica")),
        }
    }

    /// Where `p` goes now on `route`, or why it waits (see the module docs).
    pub fn place(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        matched: &[usize],
        purpose: Purpose<'_>,
    ) -> Placement {
        let mut placement = self.place_in_pool(a, route, p, matched, purpose);
        // A scoped request never waits (its scope was true when it started, not later), and
        // finding none of its replicas open is a refusal its caller retries, not a fault.
        if p.scope.is_some() && !matches!(placement.outcome, Outcome::Go(_)) {
            placement.outcome = Outcome::Fail(
                ApiError::new(
                    503,
                    "service_unavailable",
                    "none of the replicas this request was scoped to can take it now",
                )
                .with_code(NO_SPARE_REPLICA),
            );
        }
        placement
    }

    fn place_in_pool(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        matched: &[usize],
        purpose: Purpose<'_>,
    ) -> Placement {
        let registry = self.fleet;
        let fleet = registry.snapshot(route.background());
        let mut placement = Placement {
            outcome: Outcome::Hold {
                reason: "none",
                blocking: true,
            },
            fleet,
            held: Vec::new(),
            preferred: None,
        };
        let mut outside: Vec<usize> = (0..placement.fleet.replicas.len())
            .filter(|i| !route.pool.contains(i))
            .collect();
        if let Some(scope) = &p.scope {
            let replicas = registry.replicas();
            for (i, r) in replicas.iter().enumerate() {
                if !outside.contains(&i)
                    && (!scope.contains(&i) || r.background_prefill_outstanding() > 0)
                {
                    outside.push(i);
                }
            }
        }
        // The inter-token promise the stream is held to: a route without one (batch work)
        // still may not break the promise of the routes it shares replicas with.
        let itl = route.slo.itl.or_else(|| a.strictest_itl(&route.pool));
        let ask = Ask {
            route,
            p,
            matched,
            itl,
        };
        if let Purpose::Retry { tried } = purpose {
            let exclude: Vec<usize> = outside.iter().chain(tried).copied().collect();
            placement.outcome = match self.decide(&placement.fleet, &ask, &exclude, false) {
                Ok(d) => Outcome::Go(d),
                Err(e) => Outcome::Fail(e),
            };
            return placement;
        }
        let (cfg, rt) = (&route.cfg, &route.rt);
        let waited = purpose.waited();
        // The route's limits are the fleet's: this gateway's use plus its peers' (`peers.rs`).
        if cfg
            .max_concurrency
            .is_some_and(|m| rt.fleet_in_flight() >= m)
        {
            placement.outcome = Outcome::Hold {
                reason: "concurrency",
                blocking: true,
            };
            return placement;
        }
        // A single request larger than the whole budget still goes, alone.
        if cfg.max_prompt_tokens_in_flight.is_some_and(|b| {
            rt.fleet_in_flight() > 0 && rt.fleet_in_flight_tokens() + p.prompt_tokens as u64 > b
        }) {
            placement.outcome = Outcome::Hold {
                reason: "token_budget",
                blocking: true,
            };
            return placement;
        }
        let mut exclude = outside.clone();
        if cfg.admission {
            let h = a.file.admission_headroom;
            let slo = Slo {
                ttft: route.slo.ttft.map(|t| t.mul_f64(h).saturating_sub(waited)),
                itl: itl.map(|t| t.mul_f64(h)),
            };
            let holdoff = Duration::from_millis(a.file.preemption_holdoff_ms);
            let replicas = registry.replicas();
            for &i in &route.pool {
                let Some(r) = replicas.get(i).filter(|r| r.is_healthy()) else {
                    continue;
                };
                let pressure = registry.pressure(i, holdoff, p.prompt_tokens as u64);
                let uncached = p.uncached(matched, i);
                let verdict = admissible(
                    &r.model.lock(),
                    &pressure,
                    uncached,
                    (p.prompt_tokens as u64).saturating_sub(uncached),
                    &slo,
                    a.file.kv_high_water,
                );
                if let Err(h) = verdict {
                    exclude.push(i);
                    placement.held.push((i, h));
                }
            }
        }
        let dry_run = purpose.dry_run();
        if !placement.held.is_empty() {
            placement.preferred = self.decide(&placement.fleet, &ask, &outside, true).ok();
        }
        // Affinity patience: when the replica the policy prefers (ignoring admission) is held
        // and no admissible replica holds as much of the prompt, wait for it rather than send
        // the request where it must be prefilled again — that extra prefill is what stalls
        // everyone's decode and breaks the promise admission is keeping. Priced in seconds:
        // wait only while the time waited is under what waiting is predicted to win (the best
        // open replica's predicted TTFT less the preferred one's), so a request never waits
        // longer than its predicted gain; for a policy that does not predict in seconds, half
        // the TTFT budget (or of the queue timeout) as before.
        let patience = route
            .slo
            .ttft
            .map_or(Duration::from_millis(cfg.queue_timeout_ms / 2), |t| {
                t.mul_f64(a.file.admission_headroom / 2.0)
            });
        let patient = match placement.hold_gain_s() {
            Some(gain) => waited.as_secs_f64() < gain,
            None => waited < patience,
        };
        if let Some(pref) = placement.preferred.as_ref().filter(|_| patient) {
            if let Some((_, why)) = placement.held.iter().find(|(i, _)| *i == pref.replica) {
                let best_admissible = route
                    .pool
                    .iter()
                    .filter(|i| !exclude.contains(i))
                    .map(|&i| matched.get(i).copied().unwrap_or(0))
                    .max();
                if best_admissible.is_some_and(|b| b < matched[pref.replica]) {
                    placement.outcome = Outcome::Hold {
                        reason: why.label(),
                        blocking: false,
                    };
                    return placement;
                }
            }
        }
        placement.outcome = match self.decide(&placement.fleet, &ask, &exclude, dry_run) {
            // Waiting for a prefix in flight is priced as patience is: never longer than
            // what the replica computing it is predicted to win over the best other one.
            Ok(d)
                if self.prefix_in_flight(a, p, &d, waited)
                    && gain_s(&d, &exclude).is_none_or(|g| waited.as_secs_f64() < g) =>
            {
                placement.preferred = Some(d);
                Outcome::Hold {
                    reason: "prefix_in_flight",
                    blocking: false,
                }
            }
            Ok(d) => Outcome::Go(d),
            Err(e) => match placement.held.first() {
                Some((_, h)) => Outcome::Hold {
                    reason: h.label(),
                    blocking: !only_its_own_prefill_stalls(&placement.held),
                },
                None => Outcome::Fail(e),
            },
        };
        placement
    }

    /// Whether `d`'s replica is still computing part of the prefix it was chosen for (see the
    /// module docs), and `p` has waited less than `prefix_in_flight_wait_ms` for it.
    fn prefix_in_flight(
        &self,
        a: &ActivePolicy,
        p: &Prepared,
        d: &RouteDecision,
        waited: Duration,
    ) -> bool {
        let cap = Duration::from_millis(a.file.prefix_in_flight_wait_ms);
        if d.matched_blocks == 0 || waited >= cap {
            return false;
        }
        let Some(r) = self.fleet.replica(d.replica) else {
            return false;
        };
        if !r.events_live() || r.waits_for_prefix_in_flight() {
            return false;
        }
        let confirmed = self.confirmed(p).get(d.replica).copied().unwrap_or(0);
        // The first block the events have not confirmed must belong to a request still
        // prefilling there. Otherwise the speculative record is stale (its request answered,
        // and the blocks were evicted before the events showed them), and nothing will come.
        confirmed < d.matched_blocks && r.computing(confirmed, p.hashes[confirmed])
    }

    /// The route's policy over `fleet`, never choosing a replica in `exclude`.
    fn decide(
        &self,
        fleet: &ReplicaSet,
        ask: &Ask<'_>,
        exclude: &[usize],
        dry_run: bool,
    ) -> Result<RouteDecision, ApiError> {
        let Ask {
            route,
            p,
            matched,
            itl,
        } = *ask;
        let mut set = fleet.clone();
        for &x in exclude {
            if let Some(r) = set.replicas.get_mut(x) {
                r.healthy = false;
            }
        }
        let offloaded = self.prefix.offloaded(p.blocks(), matched);
        let reuse = self.prefix.reuse(p.blocks(), matched);
        let req = RouteRequest {
            block_hashes: &p.hashes,
            prompt_tokens: p.prompt_tokens,
            block_size: p.block_size,
            matched_blocks: matched,
            offloaded_blocks: &offloaded,
            session_id: p.session_id.as_deref(),
            itl_target_s: itl.map(|d| d.as_secs_f64()),
            prefix_reuse: &reuse,
            dry_run,
        };
        route
            .policy
            .route(&req, &set)
            .map_err(|e| ApiError::unavailable(e.to_string()).with_code("no_healthy_replica"))
    }
}

#[cfg(test)]
mod tests;
