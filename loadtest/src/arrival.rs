//! Open-loop arrivals: request start times drawn from a Poisson process at a fixed rate, from a
//! seed, so two runs (or two targets in a compare run) send the same schedule. Open loop means
//! a slow server does not slow the arrivals down — the queue it builds is what a benchmark must
//! see.

use std::time::Duration;

/// xoshiro256** seeded through splitmix64: small, fast, and good enough for load generation.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in (0, 1): never exactly 0, so `ln` is always finite.
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Exponential with the given mean.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        (-2.0 * self.unit().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.unit()).cos()
    }
}

/// Start offsets of a Poisson process at `rate` requests/s, bounded by a duration and a count.
pub fn poisson_schedule(
    rate: f64,
    duration: Duration,
    max_requests: usize,
    seed: u64,
) -> Vec<Duration> {
    assert!(rate > 0.0, "rate must be positive");
    let mut rng = Rng::new(seed);
    let mut t = 0.0;
    let mut out = Vec::new();
    let end = duration.as_secs_f64();
    while out.len() < max_requests {
        t += rng.exponential(1.0 / rate);
        if t >= end {
            break;
        }
        out.push(Duration::from_secs_f64(t));
    }
    out
}

/// Start offsets of a Poisson process whose rate follows one compressed day over `duration`:
/// a cosine from `low_share × peak` at the start and the end (night) to `peak` in the middle
/// (noon), drawn by thinning a process at `peak`, so the same seed gives the same schedule.
pub fn daily_schedule(
    peak: f64,
    low_share: f64,
    duration: Duration,
    max_requests: usize,
    seed: u64,
) -> Vec<Duration> {
    assert!(peak > 0.0 && (0.0..=1.0).contains(&low_share));
    let mut keep = Rng::new(seed ^ 0xda11_5c4e_d01e);
    let end = duration.as_secs_f64();
    poisson_schedule(peak, duration, usize::MAX, seed)
        .into_iter()
        .filter(|t| {
            let phase = 2.0 * std::f64::consts::PI * t.as_secs_f64() / end;
            let share = low_share + (1.0 - low_share) * (1.0 - phase.cos()) / 2.0;
            keep.unit() < share
        })
        .take(max_requests)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_day_is_quiet_at_night_and_busy_at_noon() {
        let day = Duration::from_secs(3_000);
        let s = daily_schedule(20.0, 0.125, day, usize::MAX, 3);
        let count = |from: f64, to: f64| {
            s.iter()
                .filter(|t| (from..to).contains(&t.as_secs_f64()))
                .count() as f64
        };
        // The first and the middle 100 s: about 2.5/s and 20/s.
        let night = count(0.0, 100.0) / 100.0;
        let noon = count(1_450.0, 1_550.0) / 100.0;
        assert!((1.5..4.0).contains(&night), "{night}");
        assert!((17.0..23.0).contains(&noon), "{noon}");
        // The mean is the midpoint of the cosine.
        let mean = s.len() as f64 / 3_000.0;
        assert!((mean - 20.0 * 0.5625).abs() < 0.4, "{mean}");
        assert_eq!(s, daily_schedule(20.0, 0.125, day, usize::MAX, 3));
    }

    #[test]
    fn rate_is_within_tolerance_over_a_long_seeded_run() {
        let s = poisson_schedule(20.0, Duration::from_secs(2_000), usize::MAX, 7);
        let rate = s.len() as f64 / 2_000.0;
        // 40k events: the standard error of the count is ~0.5%; allow 2%.
        assert!((rate - 20.0).abs() < 0.4, "{rate}");
        // Inter-arrival gaps of a Poisson process have mean 1/rate and coefficient of variation 1.
        let gaps: Vec<f64> = s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        let cv = var.sqrt() / mean;
        assert!((mean - 0.05).abs() < 0.001, "{mean}");
        assert!((cv - 1.0).abs() < 0.03, "{cv}");
    }

    #[test]
    fn same_seed_same_schedule_and_bounds_hold() {
        let a = poisson_schedule(5.0, Duration::from_secs(60), 100, 1);
        assert_eq!(a, poisson_schedule(5.0, Duration::from_secs(60), 100, 1));
        assert_ne!(a, poisson_schedule(5.0, Duration::from_secs(60), 100, 2));
        assert!(a.len() <= 100);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        assert!(poisson_schedule(1000.0, Duration::from_secs(10), 50, 3).len() == 50);
        assert!(poisson_schedule(1.0, Duration::from_secs(10), 1000, 3)
            .iter()
            .all(|t| t.as_secs_f64() < 10.0));
    }

    #[test]
    fn rng_helpers_stay_in_range() {
        let mut r = Rng::new(9);
        for _ in 0..10_000 {
            let u = r.unit();
            assert!(u > 0.0 && u < 1.0);
            assert!(r.below(7) < 7);
        }
        let mean = (0..50_000).map(|_| r.normal()).sum::<f64>() / 50_000.0;
        assert!(mean.abs() < 0.02, "{mean}");
    }
}
