//! How many requests a second a replica is sent to use what it holds (their match there was
//! not empty): a count decayed exponentially over [`TAU_S`], read as a rate. Placement prices
//! a long prefill there by how many such requests it would hold up (`prefix_aware`'s
//! `displace_weight`).

use std::time::Instant;

/// The decay's time constant (s): long enough to see a popular application's rate at a few
/// requests a minute, short enough to follow a burst moving on.
pub const TAU_S: f64 = 30.0;

#[derive(Debug, Default)]
pub struct ReuseRate {
    state: parking_lot::Mutex<Option<(f64, Instant)>>,
}

impl ReuseRate {
    /// One request sent at `now` to use the replica's cache.
    pub fn note(&self, now: Instant) {
        let mut s = self.state.lock();
        let rate = decayed(*s, now);
        *s = Some((rate + 1.0 / TAU_S, now));
    }

    /// Requests a second at `now`.
    pub fn rate(&self, now: Instant) -> f64 {
        decayed(*self.state.lock(), now)
    }
}

fn decayed(state: Option<(f64, Instant)>, now: Instant) -> f64 {
    state.map_or(0.0, |(rate, at)| {
        rate * (-now.saturating_duration_since(at).as_secs_f64() / TAU_S).exp()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_steady_stream_reads_as_its_rate_and_fades_when_it_stops() {
        let r = ReuseRate::default();
        let t0 = Instant::now();
        assert_eq!(r.rate(t0), 0.0);
        // Two requests a second for five time constants.
        for k in 0..(2.0 * 5.0 * TAU_S) as u64 {
            r.note(t0 + Duration::from_millis(500 * k));
        }
        let end = t0 + Duration::from_secs_f64(5.0 * TAU_S);
        let rate = r.rate(end);
        assert!((rate - 2.0).abs() < 0.1, "{rate}");
        let later = r.rate(end + Duration::from_secs_f64(TAU_S));
        assert!((later - rate / std::f64::consts::E).abs() < 0.05, "{later}");
    }
}
