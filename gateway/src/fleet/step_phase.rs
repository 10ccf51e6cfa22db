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
//! It holds no I/O and no clock: callers pass the times.

use std::time::Instant;

/// The latest step end this gateway saw at one replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepPhase {
    last_token: Option<Instant>,
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
}
