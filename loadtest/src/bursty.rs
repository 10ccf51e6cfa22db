//! The `bursty` workload: popular prefixes arriving in clusters.
//!
//! Real traffic is not Poisson per prefix: a deploy, a cron job, a product launch or a retry
//! storm sends a run of requests sharing one long system prompt within a second or two, and
//! the replica that holds that prefix becomes a hot spot. This is a seeded model of that
//! request process — a compound Poisson process of clusters:
//!
//! - eight system prompts of 800–3,300 words (log-uniform; each word about one token), chosen
//!   per cluster with Zipf popularity (exponent 1.2: the first prompt takes about 37% of
//!   clusters);
//! - cluster starts are Poisson at `rate / 6`; a cluster has a geometric number of requests
//!   (mean 6, at most 30), spaced by exponential gaps of mean 0.15 s, so a cluster of 12
//!   arrives in about 1.7 s;
//! - each request is a new conversation: the cluster's system prompt and a short question
//!   (log-normal, median 40 words), 128 output tokens.
//!
//! The offered rate is `rate` on average, but counts per second are overdispersed (variance
//! several times the mean, against 1× for Poisson) and consecutive requests mostly share a
//! prefix; the tests below measure both.

use std::time::Duration;

use protocol::openai::ChatMessage;

use crate::arrival::Rng;
use crate::words::{item, text, WorkItem};

const PROMPTS: usize = 8;
const ZIPF_S: f64 = 1.2;
pub const MEAN_CLUSTER: f64 = 6.0;
const MAX_CLUSTER: u64 = 30;
const GAP_MEAN_S: f64 = 0.15;

/// Zipf weights over `n` ranks with exponent `s`, as cumulative shares.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x / total;
            acc
        })
        .collect()
}

fn pick(rng: &mut Rng, cdf: &[f64]) -> usize {
    let u = rng.unit();
    cdf.iter().position(|&c| u <= c).unwrap_or(cdf.len() - 1)
}

/// Arrival times (seconds, ascending) and prefix ranks of the clustered process at `rate`
/// requests/s on average, bounded by `end` seconds and `max` arrivals.
fn arrivals(rng: &mut Rng, rate: f64, end: f64, max: usize) -> Vec<(f64, usize)> {
    let cdf = zipf_cdf(PROMPTS, ZIPF_S);
    let mut arrivals: Vec<(f64, usize)> = Vec::new();
    let mut t = 0.0;
    loop {
        t += rng.exponential(MEAN_CLUSTER / rate);
        if t >= end {
            break;
        }
        // Every later arrival comes after `t`: once `max` are before it, the first `max` are
        // known.
        if arrivals.len() >= max && arrivals.iter().filter(|a| a.0 < t).count() >= max {
            break;
        }
        let prefix = pick(rng, &cdf);
        // Geometric on 1.. with mean MEAN_CLUSTER.
        let mut size = 1;
        while size < MAX_CLUSTER && rng.unit() > 1.0 / MEAN_CLUSTER {
            size += 1;
        }
        let mut at = t;
        for _ in 0..size {
            if at < end {
                arrivals.push((at, prefix));
            }
            at += rng.exponential(GAP_MEAN_S);
        }
    }
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    arrivals.truncate(max);
    arrivals
}

/// Offsets (seconds, ascending) and requests of a bursty run at `rate` requests/s on average,
/// bounded by `duration` and `max`; reproducible from `seed`.
pub fn plan(rate: f64, duration: Duration, max: usize, seed: u64) -> (Vec<f64>, Vec<WorkItem>) {
    assert!(rate > 0.0, "rate must be positive");
    let mut rng = Rng::new(seed ^ 0x6275_7273_7479);
    let systems: Vec<String> = (0..PROMPTS)
        .map(|_| {
            let words = (800.0 * (3300.0f64 / 800.0).powf(rng.unit())) as usize;
            text(&mut rng, words)
        })
        .collect();
    let arrivals = arrivals(&mut rng, rate, duration.as_secs_f64(), max);
    let items = arrivals
        .iter()
        .enumerate()
        .map(|(i, &(_, prefix))| {
            let words = ((40.0 * (0.5 * rng.normal()).exp()) as usize).clamp(5, 400);
            item(
                Some(i as u64),
                vec![
                    ChatMessage::new("system", &systems[prefix]),
                    ChatMessage::new("user", &text(&mut rng, words)),
                ],
                128,
            )
        })
        .collect();
    (arrivals.iter().map(|a| a.0).collect(), items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrival::poisson_schedule;

    /// Variance ÷ mean of arrivals per 1 s window (1 for a Poisson process).
    fn dispersion(at: &[f64], end: f64) -> f64 {
        let mut counts = vec![0f64; end as usize];
        for &t in at {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1.0;
            }
        }
        let mean = counts.iter().sum::<f64>() / counts.len() as f64;
        let var = counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / counts.len() as f64;
        var / mean
    }

    fn system_of(w: &WorkItem) -> &str {
        match &w.messages[0].content {
            Some(protocol::openai::MessageContent::Text(t)) => t,
            _ => "",
        }
    }

    #[test]
    fn the_request_process_is_clustered_around_popular_prefixes() {
        let end = 1_500.0;
        let (at, items) = plan(5.0, Duration::from_secs_f64(end), usize::MAX, 1);
        assert_eq!(at.len(), items.len());
        assert!(at.windows(2).all(|w| w[0] <= w[1]));
        // The mean rate is the one asked for (±3% over 100k arrivals).
        let long = arrivals(&mut Rng::new(2), 5.0, 20_000.0, usize::MAX);
        let rate = long.len() as f64 / 20_000.0;
        assert!((rate - 5.0).abs() < 0.15, "{rate}");
        // Overdispersed: a Poisson schedule at the same rate measures ≈ 1.
        let d = dispersion(&at, end);
        let p = poisson_schedule(5.0, Duration::from_secs_f64(end), usize::MAX, 1);
        let dp = dispersion(
            &p.iter().map(Duration::as_secs_f64).collect::<Vec<_>>(),
            end,
        );
        assert!((0.9..1.1).contains(&dp), "poisson {dp}");
        assert!(d > 4.0, "bursty dispersion {d}");
        // Consecutive requests mostly share their prefix (clusters), far more than
        // independent Zipf draws would (Σ share² ≈ 0.2).
        let same = items
            .windows(2)
            .filter(|w| system_of(&w[0]) == system_of(&w[1]))
            .count() as f64
            / (items.len() - 1) as f64;
        assert!(same > 0.6, "{same}");
        // Zipf popularity: the most popular prefix carries about 37% of requests.
        let mut by_prefix = std::collections::HashMap::<&str, usize>::new();
        for w in &items {
            *by_prefix.entry(system_of(w)).or_default() += 1;
        }
        assert_eq!(by_prefix.len(), PROMPTS);
        let top = *by_prefix.values().max().unwrap() as f64 / items.len() as f64;
        assert!((0.30..0.45).contains(&top), "{top}");
        // Prefixes of 800-3,300 words.
        assert!(by_prefix
            .keys()
            .all(|s| (800..=3_300).contains(&s.split_whitespace().count())));
    }

    #[test]
    fn same_seed_same_plan_and_bounds_hold() {
        let a = plan(4.0, Duration::from_secs(60), 100, 3);
        assert_eq!(a, plan(4.0, Duration::from_secs(60), 100, 3));
        assert_ne!(a.0, plan(4.0, Duration::from_secs(60), 100, 4).0);
        assert!(a.0.len() <= 100);
        assert!(a.0.iter().all(|&t| t < 60.0));
    }
}
