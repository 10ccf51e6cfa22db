//! Stage 3, admit: a classified request waits here until placement lets it go. It is
//! dispatched only when its route has room (concurrency, prompt-token budget) and at least one replica of the route's pool is
//! admissible for it (`routes/admissible.rs`: predicted TTFT and inter-token gap within the
//! promise, no KV high-water, no fresh preemptions); the route's policy then picks among the
//! admissible replicas, so cache affinity and admission compose. Otherwise the request waits
//! in the route's queue — only the head tries, so waiting is first come, first served within a
//! priority — and is shed with 429 as soon as its TTFT deadline can no longer be met, its wait
//! reaches the route's queue timeout, or it finds the queue full.
//!
//! Waiters wake when a request of the route finishes or leaves the queue, and every 20 ms
//! otherwise (load reports and learnt models change without an event).

use std::sync::Arc;
use std::time::{Duration, Instant};

use config::Priority;
use parking_lot::Mutex;
use protocol::ApiError;

use crate::access_log::HoldSpan;
use crate::fleet::guards::PendingPrefill;
use crate::request::place::{Outcome, Placer, Purpose};
use crate::request::prepared::Prepared;
use crate::routes::admitted::Admitted;
use crate::routes::queue::{Shed, Ticket};
use crate::routes::runtime::RouteRuntime;
use crate::routes::store::{ActivePolicy, ActiveRoute};

/// How often a waiter re-checks without being woken.
const RECHECK: Duration = Duration::from_millis(20);

/// The holds a request meets while it waits, one span per change of reason; each closed span
/// goes to the route's `kvgate_gateway_hold_seconds{reason}` and to the access log.
struct HoldLog<'a> {
    rt: &'a RouteRuntime,
    spans: &'a mut Vec<HoldSpan>,
    /// The hold now: its reason, when it began, its predicted gain.
    open: Option<(&'static str, Instant, Option<f64>)>,
    /// The replica the request last waited for.
    waited_for: Option<usize>,
}

impl HoldLog<'_> {
    /// The request is held for `reason` now (`None`: not held any more).
    fn now(&mut self, reason: Option<&'static str>, gain_s: Option<f64>) {
        if self.open.map(|o| o.0) == reason {
            return;
        }
        self.close();
        self.open = reason.map(|r| (r, Instant::now(), gain_s));
    }

    fn close(&mut self) {
        if let Some((reason, since, gain_s)) = self.open.take() {
            let held = since.elapsed().as_secs_f64();
            self.rt.stats.hold_time(reason, held);
            self.spans.push(HoldSpan {
                reason,
                ms: held * 1e3,
                gain_ms: gain_s.map(|g| g * 1e3),
            });
        }
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

/// What the admit stage works with: placement (the fleet and the prefix index behind it), and
/// the lock that makes each decision and its reservations one step.
pub struct Admitter<'a> {
    pub placer: Placer<'a>,
    /// Serialises admission decisions with their reservations.
    pub lock: &'a Mutex<()>,
}

impl Admitter<'_> {
    /// Fleet prefill rate of the route's pool as learnt (tokens/s), for Retry-After.
    fn pool_prefill_rate(&self, route: &ActiveRoute) -> Option<f64> {
        let rates: Vec<f64> = route
            .pool
            .iter()
            .filter_map(|&i| self.placer.fleet.replica(i)?.model.lock().prefill_rate())
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
        let replicas = self.placer.fleet.replicas();
        let best = route
            .pool
            .iter()
            .filter_map(|&i| replicas.get(i).filter(|r| r.is_healthy()))
            .map(|r| {
                let uncached = p.uncached(matched, r.slot);
                let cached = (p.prompt_tokens as u64).saturating_sub(uncached);
                (r.model.lock())
                    .predict_ttft(0, uncached, cached)
                    .unwrap_or(Duration::ZERO)
            })
            .min()
            .unwrap_or(Duration::ZERO);
        waited + best > target
    }

    /// Dispatches `p` on `route` now or after a wait in its queue, or refuses it; every hold it
    /// met is appended to `holds`.
    #[allow(clippy::too_many_arguments)]
    pub async fn admit(
        &self,
        a: &ActivePolicy,
        route: &ActiveRoute,
        p: &Prepared,
        priority: Priority,
        arrived: Instant,
        holds: &mut Vec<HoldSpan>,
    ) -> Result<Admitted, Refusal> {
        let rt = &route.rt;
        let mut log = HoldLog {
            rt,
            spans: holds,
            open: None,
            waited_for: None,
        };
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
            let matched = self.placer.matched(p);
            if my_turn {
                // Deciding and reserving (pending prefill, route counts) is one step per
                // gateway: waiters woken together must not all admit against the same state.
                let _serial = self.lock.lock();
                let placed = self
                    .placer
                    .place(a, route, p, &matched, Purpose::Dispatch { waited });
                let gain = placed.hold_gain_s();
                let wanted = placed.preferred.as_ref().map(|d| d.replica);
                match placed.outcome {
                    Outcome::Go(d) => {
                        log.now(None, None);
                        if log.waited_for.is_some_and(|w| w != d.replica) {
                            rt.stats.holds_lost.increment(1);
                        }
                        let (fleet, prefix) = (self.placer.fleet, self.placer.prefix);
                        fleet.note_dispatch(d.replica, p.prompt_tokens as u64, d.matched_blocks);
                        prefix.sent(d.replica, p.blocks(), Some(&matched), fleet.now_s());
                        let Some(replica) = fleet.replica(d.replica) else {
                            continue;
                        };
                        let pending = PendingPrefill::new(
                            replica,
                            p.uncached(&matched, d.replica),
                            p.hashes.clone(),
                            route.background(),
                        );
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
                    Outcome::Fail(e) => {
                        log.now(None, None);
                        return Err(Refusal::Error(e));
                    }
                    Outcome::Hold { reason, blocking } => {
                        if place.is_none() {
                            rt.stats.held(reason);
                        }
                        log.now(Some(reason), gain);
                        if !blocking {
                            log.waited_for = wanted;
                        }
                        held_by = Some(blocking);
                    }
                }
            } else {
                if place.is_none() {
                    rt.stats.held("queue_order");
                }
                log.now(Some("queue_order"), None);
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
                        log.now(None, None);
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
                log.now(None, None);
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
