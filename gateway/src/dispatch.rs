//! Admission in the request path. A classified request is dispatched only when its route has
//! room (concurrency, prompt-token budget) and at least one replica of the route's pool is
//! admissible for it (`admission::admissible`: predicted TTFT and inter-token gap within the
//! promise, no KV high-water, no fresh preemptions); the route's policy then picks among the
//! admissible replicas, so cache affinity and admission compose. Otherwise the request waits
//! in the route's queue — only the head tries, so waiting is first come, first served within a
//! priority — and is shed with 429 as soon as its TTFT deadline can no longer be met, its wait
//! reaches the route's queue timeout, or it finds the queue full.
//!
//! Waiters wake when a request of the route finishes or leaves the queue, and every 20 ms
//! otherwise (load reports and learnt models change without an event).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use config::Priority;
use policies::RouteDecision;
use protocol::ApiError;

use crate::admission::{admissible, Shed, Slo, Ticket};
use crate::policy_store::{ActivePolicy, ActiveRoute};
use crate::registry::PendingPrefill;
use crate::route_runtime::RouteRuntime;
use crate::router::Prepared;
use crate::state::GatewayState;

/// How often a waiter re-checks without being woken.
const RECHECK: Duration = Duration::from_millis(20);

/// A dispatched request's share of its route's limits, released (and the queue woken) when
/// the request ends.
pub struct Admitted {
    rt: Arc<RouteRuntime>,
    tokens: u64,
    pub decision: RouteDecision,
    /// The chosen replica's share of queued prefill, taken at the decision so the next
    /// decision already sees it; with the prefill that was queued ahead of it.
    pub pending: Option<(PendingPrefill, u64)>,
    /// Blocks of the prompt the index believed cached at each replica.
    pub matched: Vec<usize>,
    pub queued: Duration,
}

impl Admitted {
    fn new(
        rt: Arc<RouteRuntime>,
        tokens: u64,
        decision: RouteDecision,
        matched: Vec<usize>,
        queued: Duration,
        pending: (PendingPrefill, u64),
    ) -> Self {
        rt.in_flight.fetch_add(1, Ordering::Relaxed);
        rt.in_flight_tokens.fetch_add(tokens, Ordering::Relaxed);
        rt.stats.queue_seconds.record(queued.as_secs_f64());
        rt.update_gauges();
        Admitted {
            rt,
            tokens,
            decision,
            pending: Some(pending),
            matched,
            queued,
        }
    }

    pub fn route(&self) -> &Arc<RouteRuntime> {
        &self.rt
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.rt.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.rt
            .in_flight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
        self.rt.update_gauges();
        self.rt.wake();
    }
}

/// A place in the queue, given up when dropped (dispatched, shed, or the client went away).
struct QueuePlace {
    rt: Arc<RouteRuntime>,
    ticket: Ticket,
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.rt.queue.remove(self.ticket);
        self.rt.update_gauges();
        self.rt.wake();
    }
}

/// Why a request was not dispatched.
pub enum Refusal {
    /// 429 with Retry-After.
    Shed(Shed),
    /// Nothing to wait for (no healthy replica in the pool).
    Error(ApiError),
}

enum Wait {
    /// Not now, and why. `blocking`: the route as a whole has no room (its limits, or no
    /// admissible replica in its pool), so those behind wait their turn; otherwise only this
    /// request's preferred replica is busy (affinity patience) and others may go ahead.
    Hold {
        reason: &'static str,
        blocking: bool,
    },
    Fail(ApiError),
}

impl GatewayState {
    /// Uncached prompt tokens of `p` at replica `i`.
    fn uncached(&self, p: &Prepared, matched: &[usize], i: usize) -> u64 {
        p.prompt_tokens
            .saturating_sub(matched.get(i).copied().unwrap_or(0) * self.router.block_size)
            as u64
    }

    /// One attempt to place `p` now.
    fn try_dispatch(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        matched: &[usize],
        waited: Duration,
    ) -> Result<RouteDecision, Wait> {
        let (cfg, rt) = (&route.cfg, &route.rt);
        if cfg.max_concurrency.is_some_and(|m| rt.in_flight() >= m) {
            return Err(Wait::Hold {
                reason: "concurrency",
                blocking: true,
            });
        }
        // A single request larger than the whole budget still goes, alone.
        if cfg.max_prompt_tokens_in_flight.is_some_and(|b| {
            rt.in_flight() > 0 && rt.in_flight_tokens() + p.prompt_tokens as u64 > b
        }) {
            return Err(Wait::Hold {
                reason: "token_budget",
                blocking: true,
            });
        }
        let registry = &self.router.registry;
        let replicas = registry.replicas();
        let mut exclude: Vec<usize> = (0..replicas.len())
            .filter(|i| !route.pool.contains(i))
            .collect();
        let outside = exclude.clone();
        let mut hold: Option<&'static str> = None;
        let mut held: Vec<(usize, &'static str)> = Vec::new();
        if cfg.admission {
            let h = a.file.admission_headroom;
            // A route without an inter-token promise (batch work) still may not break the
            // promise of the routes it shares replicas with: it yields to the strictest.
            let itl = route.slo.itl.or_else(|| a.strictest_itl(&route.pool));
            let slo = Slo {
                ttft: route.slo.ttft.map(|t| t.mul_f64(h).saturating_sub(waited)),
                itl: itl.map(|t| t.mul_f64(h)),
            };
            let holdoff = Duration::from_millis(a.file.preemption_holdoff_ms);
            for &i in &route.pool {
                let Some(r) = replicas.get(i).filter(|r| r.is_healthy()) else {
                    continue;
                };
                let pressure = registry.pressure(i, holdoff, p.prompt_tokens as u64);
                let verdict = admissible(
                    &r.model.lock(),
                    &pressure,
                    self.uncached(p, matched, i),
                    &slo,
                    a.file.kv_high_water,
                );
                if let Err(h) = verdict {
                    exclude.push(i);
                    hold.get_or_insert(h.label());
                    held.push((i, h.label()));
                }
            }
        }
        // Affinity patience: when the replica the policy prefers (ignoring admission) is held
        // and no admissible replica holds as much of the prompt, wait for it rather than send
        // the request where it must be prefilled again — that extra prefill is what stalls
        // everyone's decode and breaks the promise admission is keeping. After half the TTFT
        // budget, take an admissible replica anyway.
        let patience = route
            .slo
            .ttft
            .map_or(Duration::from_millis(cfg.queue_timeout_ms / 2), |t| {
                t.mul_f64(a.file.admission_headroom / 2.0)
            });
        if !held.is_empty() && waited < patience {
            if let Ok(pref) =
                self.router
                    .decide_in(route.policy.as_ref(), p, matched, &outside, true)
            {
                if let Some(&(_, why)) = held.iter().find(|(i, _)| *i == pref.replica) {
                    let best_admissible = route
                        .pool
                        .iter()
                        .filter(|i| !exclude.contains(i))
                        .map(|&i| matched[i])
                        .max();
                    if best_admissible.is_some_and(|b| b < matched[pref.replica]) {
                        return Err(Wait::Hold {
                            reason: why,
                            blocking: false,
                        });
                    }
                }
            }
        }
        match self
            .router
            .decide_in(route.policy.as_ref(), p, matched, &exclude, false)
        {
            Ok(d) => Ok(d),
            Err(e) => match hold {
                Some(h) => Err(Wait::Hold {
                    reason: h,
                    blocking: true,
                }),
                None => Err(Wait::Fail(e)),
            },
        }
    }

    /// Fleet prefill rate of the route's pool as learnt (tokens/s), for Retry-After.
    fn pool_prefill_rate(&self, route: &ActiveRoute) -> Option<f64> {
        let rates: Vec<f64> = route
            .pool
            .iter()
            .filter_map(|&i| self.router.registry.replica(i)?.model.lock().prefill_rate())
            .collect();
        (!rates.is_empty()).then(|| rates.iter().sum())
    }

    /// Whether even the best replica of the pool, idle, could no longer answer within the TTFT
    /// promise.
    fn deadline_gone(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        matched: &[usize],
        waited: Duration,
    ) -> bool {
        let Some(target) = route.slo.ttft.map(|t| t.mul_f64(a.file.admission_headroom)) else {
            return false;
        };
        if !route.cfg.admission {
            return false;
        }
        let replicas = self.router.registry.replicas();
        let best = route
            .pool
            .iter()
            .filter_map(|&i| replicas.get(i).filter(|r| r.is_healthy()))
            .map(|r| {
                r.model
                    .lock()
                    .predict_ttft(0, self.uncached(p, matched, r.slot))
                    .unwrap_or(Duration::ZERO)
            })
            .min()
            .unwrap_or(Duration::ZERO);
        waited + best > target
    }

    /// Dispatches `p` on `route` now or after a wait in its queue, or refuses it.
    pub async fn admit(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        priority: Priority,
        arrived: Instant,
    ) -> Result<Admitted, Refusal> {
        let rt = &route.rt;
        let timeout = Duration::from_millis(route.cfg.queue_timeout_ms);
        let patience = match route.slo.ttft {
            Some(t) if route.cfg.admission => t.min(timeout),
            _ => timeout,
        };
        let deadline_key = (rt.now() + patience).saturating_sub(arrived.elapsed());
        let mut place: Option<QueuePlace> = None;
        loop {
            let notified = rt.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let waited = arrived.elapsed();
            // First come, first served while the route has no room; a waiter that only waits
            // for its preferred replica does not hold up the requests behind it.
            let my_turn = rt.queue.may_try(place.as_ref().map(|q| q.ticket));
            let mut held_by: Option<bool> = None;
            // The index lookup once per attempt, shared by placement and the deadline check.
            let matched = self.router.matched(p);
            if my_turn {
                // Deciding and reserving (pending prefill, route counts) is one step per
                // gateway: waiters woken together must not all admit against the same state.
                let _serial = self.dispatch_lock.lock();
                match self.try_dispatch(a, route, p, &matched, waited) {
                    Ok(d) => {
                        self.router
                            .registry
                            .note_dispatch(d.replica, p.prompt_tokens as u64);
                        let Some(replica) = self.router.registry.replica(d.replica) else {
                            continue;
                        };
                        let pending =
                            PendingPrefill::new(replica, self.uncached(p, &matched, d.replica));
                        let admitted = Admitted::new(
                            rt.clone(),
                            p.prompt_tokens as u64,
                            d,
                            matched,
                            waited,
                            pending,
                        );
                        drop(place);
                        return Ok(admitted);
                    }
                    Err(Wait::Fail(e)) => return Err(Refusal::Error(e)),
                    Err(Wait::Hold { reason, blocking }) => {
                        if place.is_none() {
                            rt.stats.held(reason);
                        }
                        held_by = Some(blocking);
                    }
                }
            } else if place.is_none() {
                rt.stats.held("queue_order");
            }
            let retry = || rt.queue.retry_after(self.pool_prefill_rate(route));
            if place.is_none() {
                match rt.queue.push(
                    priority.rank(),
                    deadline_key,
                    p.prompt_tokens as u64,
                    self.pool_prefill_rate(route),
                ) {
                    Ok(ticket) => {
                        place = Some(QueuePlace {
                            rt: rt.clone(),
                            ticket,
                        });
                        rt.update_gauges();
                    }
                    Err(shed) => {
                        rt.stats.shed(rt.now_s(), shed.label());
                        return Err(Refusal::Shed(shed));
                    }
                }
            }
            if let (Some(q), Some(blocking)) = (&place, held_by) {
                rt.queue.set_route_bound(q.ticket, blocking);
            }
            let shed = if waited >= timeout {
                Some(Shed::Timeout {
                    retry_after: retry(),
                })
            } else if self.deadline_gone(a, route, p, &matched, waited) {
                Some(Shed::DeadlineGone {
                    retry_after: retry(),
                })
            } else {
                None
            };
            if let Some(shed) = shed {
                drop(place);
                rt.stats.shed(rt.now_s(), shed.label());
                return Err(Refusal::Shed(shed));
            }
            let nap = RECHECK.min(timeout.saturating_sub(waited));
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }
}
