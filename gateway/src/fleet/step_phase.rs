//! Where a replica is in its current step, for the time to first token of a request sent now.
//!
//! A continuous-batching engine plans each step when the previous one ends: a request that
//! arrives while a step runs waits for that step to finish and joins the next. So a mostly
//! cached request's TTFT on a busy replica is the rest of the running step plus one step of its
//! own — anywhere between one and two steps, by the phase it arrives at. Priced by a fit of
//! whole TTFTs, that phase is noise of up to a third either way (at a 100 ms step, 100–200 ms
//! around a predicted 150 ms): the bulk of placement's prediction error on the chat cells
//! (BENCHMARKS, issue 28).
//!
//! The gateway sees each step end: every stream it relays there gets a token at once. From the
//! latest relayed token and the replica's median step, [`StepPhase::wait`] tells how long the
//! running step has left. The TTFT fit learns from each TTFT less the wait its request was sent
//! into, and placement adds the wait back (`fleet/latency_model.rs`, `SpeedView::estimate`).
//!
//! A request sent a few milliseconds before the running step ends misses it: it reaches the
//! engine after the next step was planned (the proxy's write, the replica parsing and
//! tokenising the prompt, the gateway seeing the step end late by its own relay), and waits a
//! whole step more. On the chat cells, requests predicted to arrive with under 4 ms of the step
//! left came a decode step later than predicted in 63% of cases, 4–10 ms in 10–25%, past 10 ms
//! hardly ever (BENCHMARKS, issue 28). [`StepPhase::lag`] is that boundary as learnt per
//! replica: a request sent with less of the step left is predicted to join the step after the
//! next.
//!
//! It holds no I/O and no clock: callers pass the times.

use std::time::Instant;

/// The boundary a replica starts from before any request has tested it (s): a request sent
/// with less of the running step left than this misses it.
const INITIAL_LAG_S: f64 = 0.002;
/// How far the boundary moves per request that proved it wrong (s).
const LAG_STEP_S: f64 = 0.000_5;
/// Requests sent with more than this past the boundary say nothing about it (s): a step that
/// came late then ran long, it was not missed.
const LAG_WINDOW_S: f64 = 0.010;
/// The boundary never exceeds this (s), nor half a step.
const MAX_LAG_S: f64 = 0.050;

/// The latest step end this gateway saw at one replica, and how late a request may be sent
/// and still join the running step's successor.
#[derive(Debug, Clone, Copy)]
pub struct StepPhase {
    last_token: Option<Instant>,
    lag_s: f64,
}

impl Default for StepPhase {
    fn default() -> Self {
        StepPhase {
            last_token: None,
            lag_s: INITIAL_LAG_S,
        }
    }
}

impl StepPhase {
    /// A token (or a whole answer) came back from the replica at `at`: a step ended then.
    pub fn relayed(&mut self, at: Instant) {
        self.last_token = Some(self.last_token.map_or(at, |t| t.max(at)));
    }

    /// When the latest step end was seen (the running step's start, if it still runs).
    pub fn last_step_end(&self) -> Option<Instant> {
        self.last_token
    }

    /// Seconds until the running step ends for a request sent at `now`, given the replica's
    /// median `step` (s) and whether it has requests running (`busy`).
    /// - Idle: 0 (an idle engine plans a step as soon as a request arrives).
    /// - The last step end less than a step ago: the rest of that step.
    /// - Otherwise the phase is unknown (the running step carries a prefill chunk and runs long,
    ///   or its streams are another gateway's): half a step, the mean.
    pub fn wait(&self, now: Instant, step: Option<f64>, busy: bool) -> f64 {
        let Some(step) = step.filter(|&s| busy && s > 0.0) else {
            return 0.0;
        };
        match self.last_token {
            Some(t) => {
                let since = now.saturating_duration_since(t).as_secs_f64();
                if since < step {
                    step - since
                } else {
                    step / 2.0
                }
            }
            None => step / 2.0,
        }
    }

    /// Seconds of the running step that must be left when a request is sent for it to join
    /// the next step (as learnt).
    pub fn lag(&self) -> f64 {
        self.lag_s
    }

    /// A request was sent with `left_s` of the running step left (`step_s` its decode step)
    /// and `missed` the next step (its first token came a step later than joining it would
    /// give). The boundary moves only on a request that proved it wrong, near it: it settles
    /// where as many sent just before it miss as sent just after it make it.
    pub fn learn_lag(&mut self, left_s: f64, step_s: f64, missed: bool) {
        if left_s >= self.lag_s + LAG_WINDOW_S || left_s >= step_s / 2.0 {
            return;
        }
        let predicted_miss = left_s < self.lag_s;
        if predicted_miss && !missed {
            self.lag_s = (self.lag_s - LAG_STEP_S).max(0.0);
        } else if !predicted_miss && missed {
            self.lag_s = (self.lag_s + LAG_STEP_S).min(MAX_LAG_S.min(step_s / 2.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_rest_of_the_running_step_or_half_a_step_when_unknown() {
        let mut p = StepPhase::default();
        let t0 = Instant::now();
        // Nothing relayed yet: busy is half a step, idle nothing, no step learnt nothing.
        assert_eq!(p.wait(t0, Some(0.1), true), 0.05);
        assert_eq!(p.wait(t0, Some(0.1), false), 0.0);
        assert_eq!(p.wait(t0, None, true), 0.0);
        p.relayed(t0);
        // 30 ms into a 100 ms step: 70 ms left.
        let w = p.wait(t0 + 30 * MS, Some(0.1), true);
        assert!((w - 0.07).abs() < 1e-9, "{w}");
        // 130 ms in: a long step; its rest is unknown.
        assert_eq!(p.wait(t0 + 130 * MS, Some(0.1), true), 0.05);
        // A token relayed late (an older write of another stream) does not move the phase back.
        p.relayed(t0 + 60 * MS);
        p.relayed(t0 + 20 * MS);
        let w = p.wait(t0 + 90 * MS, Some(0.1), true);
        assert!((w - 0.07).abs() < 1e-9, "{w}");
    }

    #[test]
    fn the_lag_settles_where_requests_start_missing_the_step() {
        // Requests reach this replica's engine 6 ms after they are sent: those sent with less
        // of the step left miss it.
        let mut p = StepPhase::default();
        for i in 0..400 {
            let left = f64::from(i % 12) * 0.001;
            p.learn_lag(left, 0.1, left < 0.006);
        }
        assert!((p.lag() - 0.006).abs() <= 0.001, "{}", p.lag());
        // Far from the boundary a late first token is a long step, not a miss: no lesson.
        let before = p.lag();
        p.learn_lag(0.030, 0.1, true);
        assert_eq!(p.lag(), before);
        // Never more than half a step.
        let mut q = StepPhase::default();
        for _ in 0..200 {
            q.learn_lag(q.lag(), 0.01, true);
        }
        assert!(q.lag() <= 0.005 + 1e-12, "{}", q.lag());
    }
}
