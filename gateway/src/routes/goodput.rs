//! Goodput accounting per route: a finished request is *good* when its TTFT and the p95 of its
//! inter-token gaps both met the route's promise (a timer without a promise always meets it).
//! Counters for requests and output tokens (good and all), violations by kind, sheds by reason,
//! the queue-time histogram, the route's timers, and `kvgate_gateway_goodput_ratio`: good
//! requests over everything the route was asked in the last minute — finished or shed, since a
//! shed request did not get the promise either.

use std::collections::VecDeque;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};
use parking_lot::Mutex;
use protocol::slo::Slo;

use crate::metrics::GatewayMetrics;

/// What one finished request measured, as the relay saw it.
#[derive(Debug, Clone, Default)]
pub struct Served {
    pub ttft: Option<Duration>,
    pub gaps: Vec<Duration>,
    /// End to end, for answers that are not streamed (one chunk).
    pub e2e: Duration,
    pub output_tokens: u64,
    pub stream: bool,
}

pub use protocol::slo::Verdict;

/// Judges a served request against a promise with the shared goodput rule (`protocol::slo`): a
/// stream by its TTFT and the p95 of its own gaps, an answer that is not streamed by its
/// end-to-end time against TTFT plus one gap per further token.
pub fn judge(o: &Served, slo: &Slo) -> Verdict {
    if o.stream {
        slo.judge_stream(o.ttft, &o.gaps)
    } else {
        slo.judge_whole(o.e2e, o.output_tokens)
    }
}

/// Good and total counts per second over the last minute.
#[derive(Debug, Default)]
pub struct Window {
    slots: VecDeque<(u64, u64, u64)>,
}

impl Window {
    const SECONDS: u64 = 60;

    fn slot(&mut self, now_s: u64) -> &mut (u64, u64, u64) {
        while self
            .slots
            .front()
            .is_some_and(|s| s.0 + Self::SECONDS <= now_s)
        {
            self.slots.pop_front();
        }
        if self.slots.back().is_none_or(|s| s.0 != now_s) {
            self.slots.push_back((now_s, 0, 0));
        }
        self.slots.back_mut().expect("just pushed")
    }

    pub fn add(&mut self, now_s: u64, good: bool) {
        let s = self.slot(now_s);
        s.1 += u64::from(good);
        s.2 += 1;
    }

    /// Good / total over the window; `None` when the route saw nothing.
    pub fn ratio(&mut self, now_s: u64) -> Option<f64> {
        self.slot(now_s);
        let (g, t) = self
            .slots
            .iter()
            .fold((0, 0), |(g, t), s| (g + s.1, t + s.2));
        (t > 0).then(|| g as f64 / t as f64)
    }
}

/// One route's metric handles and its goodput window.
pub struct RouteStats {
    pub requests: Counter,
    pub good_requests: Counter,
    pub output_tokens: Counter,
    pub good_output_tokens: Counter,
    pub ttft_violations: Counter,
    pub itl_violations: Counter,
    pub queue_seconds: Histogram,
    pub ttft_seconds: Histogram,
    pub inter_token_seconds: Histogram,
    pub e2e_seconds: Histogram,
    pub goodput_ratio: Gauge,
    /// Admitted requests that ended in an error (upstream failure, cut stream).
    pub errors: Counter,
    pub in_flight: Gauge,
    pub queued: Gauge,
    shed: Vec<(&'static str, Counter)>,
    holds: Vec<(&'static str, Counter)>,
    /// Seconds requests spent in each kind of hold.
    hold_seconds: Vec<(&'static str, Histogram)>,
    /// Requests that waited for one replica and then went to another.
    pub holds_lost: Counter,
    /// Warming requests sent (`request/warm.rs`), by what pressed the holders, answered and
    /// failed.
    warms: Vec<(&'static str, (Counter, Counter))>,
    window: Mutex<Window>,
}

/// What pressed a warmed prefix's holders (`policies::WarmReason::label`).
const WARM_REASONS: [&str; 2] = ["inter_token", "queue"];

/// Every shed reason and hold reason, registered up front so each series exists at 0.
const SHED_REASONS: [&str; 3] = ["queue_full", "deadline", "timeout"];
const HOLD_REASONS: [&str; 9] = [
    "ttft",
    "itl",
    "stalls",
    "kv_high_water",
    "preempting",
    "concurrency",
    "token_budget",
    "queue_order",
    "prefix_in_flight",
];

impl RouteStats {
    pub fn new(m: &GatewayMetrics, route: &str) -> Self {
        RouteStats {
            requests: m.route_counter("kvgate_gateway_route_requests_total", route, &[]),
            good_requests: m.route_counter("kvgate_gateway_good_requests_total", route, &[]),
            output_tokens: m.route_counter("kvgate_gateway_route_output_tokens_total", route, &[]),
            good_output_tokens: m.route_counter(
                "kvgate_gateway_good_output_tokens_total",
                route,
                &[],
            ),
            ttft_violations: m.route_counter(
                "kvgate_gateway_slo_violations_total",
                route,
                &[("kind", "ttft")],
            ),
            itl_violations: m.route_counter(
                "kvgate_gateway_slo_violations_total",
                route,
                &[("kind", "itl")],
            ),
            queue_seconds: m.route_histogram("kvgate_gateway_queue_seconds", route),
            ttft_seconds: m.route_histogram("kvgate_gateway_ttft_seconds", route),
            inter_token_seconds: m.route_histogram("kvgate_gateway_inter_token_seconds", route),
            e2e_seconds: m.route_histogram("kvgate_gateway_e2e_seconds", route),
            goodput_ratio: m.route_gauge("kvgate_gateway_goodput_ratio", route),
            errors: m.route_counter("kvgate_gateway_route_errors_total", route, &[]),
            in_flight: m.route_gauge("kvgate_gateway_route_in_flight", route),
            queued: m.route_gauge("kvgate_gateway_route_queue_depth", route),
            shed: SHED_REASONS
                .iter()
                .map(|r| {
                    (
                        *r,
                        m.route_counter("kvgate_gateway_shed_total", route, &[("reason", r)]),
                    )
                })
                .collect(),
            holds: HOLD_REASONS
                .iter()
                .map(|r| {
                    (
                        *r,
                        m.route_counter(
                            "kvgate_gateway_admission_holds_total",
                            route,
                            &[("reason", r)],
                        ),
                    )
                })
                .collect(),
            hold_seconds: HOLD_REASONS
                .iter()
                .map(|r| {
                    (
                        *r,
                        m.route_histogram_with(
                            "kvgate_gateway_hold_seconds",
                            route,
                            &[("reason", r)],
                        ),
                    )
                })
                .collect(),
            holds_lost: m.route_counter("kvgate_gateway_holds_lost_total", route, &[]),
            warms: WARM_REASONS
                .iter()
                .map(|r| {
                    let c = |outcome| {
                        m.route_counter(
                            "kvgate_gateway_prefix_warms_total",
                            route,
                            &[("reason", r), ("outcome", outcome)],
                        )
                    };
                    (*r, (c("ok"), c("failed")))
                })
                .collect(),
            window: Mutex::new(Window::default()),
        }
    }

    /// The warming counters (answered, failed) for `reason`.
    pub fn warms(&self, reason: &str) -> (Counter, Counter) {
        self.warms
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or_else(|| self.warms[0].1.clone(), |(_, c)| c.clone())
    }

    /// Records a finished request; returns its verdict.
    pub fn finished(&self, now_s: u64, o: &Served, slo: &Slo) -> Verdict {
        let v = judge(o, slo);
        self.requests.increment(1);
        self.output_tokens.increment(o.output_tokens);
        if v.good() {
            self.good_requests.increment(1);
            self.good_output_tokens.increment(o.output_tokens);
        }
        if !v.ttft_met {
            self.ttft_violations.increment(1);
        }
        if !v.itl_met {
            self.itl_violations.increment(1);
        }
        let mut w = self.window.lock();
        w.add(now_s, v.good());
        self.goodput_ratio.set(w.ratio(now_s).unwrap_or(1.0));
        v
    }

    /// Records an admitted request that failed (no answer, or an answer cut short): asked
    /// and not served within the promise.
    pub fn failed(&self, now_s: u64) {
        self.errors.increment(1);
        let mut w = self.window.lock();
        w.add(now_s, false);
        self.goodput_ratio.set(w.ratio(now_s).unwrap_or(1.0));
    }

    /// Records a request answered with 429, and why.
    pub fn shed(&self, now_s: u64, reason: &'static str) {
        if let Some((_, c)) = self.shed.iter().find(|(r, _)| *r == reason) {
            c.increment(1);
        }
        let mut w = self.window.lock();
        w.add(now_s, false);
        self.goodput_ratio.set(w.ratio(now_s).unwrap_or(1.0));
    }

    /// Records why a request had to wait (the first hold it met).
    pub fn held(&self, reason: &'static str) {
        if let Some((_, c)) = self.holds.iter().find(|(r, _)| *r == reason) {
            c.increment(1);
        }
    }

    /// Records time a request spent in one hold.
    pub fn hold_time(&self, reason: &'static str, seconds: f64) {
        if let Some((_, h)) = self.hold_seconds.iter().find(|(r, _)| *r == reason) {
            h.record(seconds);
        }
    }

    /// Refreshes the ratio so it decays when traffic stops; 1 when the route saw nothing.
    pub fn tick(&self, now_s: u64) -> Option<f64> {
        let r = self.window.lock().ratio(now_s);
        self.goodput_ratio.set(r.unwrap_or(1.0));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn slo() -> Slo {
        Slo {
            ttft: Some(1000 * MS),
            itl: Some(50 * MS),
        }
    }

    fn streamed(ttft_ms: u32, gaps_ms: &[u32]) -> Served {
        Served {
            ttft: Some(ttft_ms * MS),
            gaps: gaps_ms.iter().map(|&g| g * MS).collect(),
            e2e: Duration::ZERO,
            output_tokens: gaps_ms.len() as u64 + 1,
            stream: true,
        }
    }

    #[test]
    fn judges_each_timer_against_its_promise() {
        let ok = judge(&streamed(900, &[40; 40]), &slo());
        assert!(ok.good());
        let slow_start = judge(&streamed(1100, &[40; 40]), &slo());
        assert_eq!(
            slow_start,
            Verdict {
                ttft_met: false,
                itl_met: true
            }
        );
        // One slow gap in 40 is under the p95; three are not (nearest rank 38 of 40).
        let mut gaps = vec![40; 39];
        gaps.push(400);
        assert!(judge(&streamed(100, &gaps), &slo()).itl_met);
        let mut gaps = vec![40; 37];
        gaps.extend([400, 400, 400]);
        assert!(!judge(&streamed(100, &gaps), &slo()).itl_met);
        // No promise: always met.
        let none = Slo {
            ttft: None,
            itl: None,
        };
        assert!(judge(&streamed(60_000, &[5_000]), &none).good());
    }

    #[test]
    fn unstreamed_answers_are_judged_end_to_end() {
        let o = Served {
            ttft: Some(2000 * MS),
            gaps: vec![],
            e2e: 2000 * MS,
            output_tokens: 21,
            stream: false,
        };
        // Budget: 1 s + 20 × 50 ms = 2 s.
        assert!(judge(&o, &slo()).good());
        let late = Served {
            e2e: 2001 * MS,
            ..o
        };
        assert!(!judge(&late, &slo()).good());
    }

    #[test]
    fn window_forgets_after_a_minute() {
        let mut w = Window::default();
        assert_eq!(w.ratio(0), None);
        w.add(0, true);
        w.add(1, false);
        w.add(1, true);
        assert!((w.ratio(1).unwrap() - 2.0 / 3.0).abs() < 1e-9);
        assert!((w.ratio(60).unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(w.ratio(61), None);
    }
}
