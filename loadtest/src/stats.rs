//! Percentiles and summaries for the report: every timer at p50, p95 and p99, because the tail
//! is where serving goes wrong. Percentiles interpolate linearly between order statistics (the
//! "R-7" definition NumPy and most dashboards use), so small samples give stable numbers.

use serde::Serialize;

/// The p-th percentile (0..=100) of `sorted` (ascending); `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0) / 100.0;
    let h = (sorted.len() - 1) as f64 * p;
    let lo = h.floor() as usize;
    let hi = h.ceil() as usize;
    Some(sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo]))
}

/// A timer's summary as the report prints and serialises it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Summarises `samples` (any order); `None` when empty. NaNs are dropped.
    pub fn of(samples: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Summary {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0)?,
            p95: percentile(&v, 95.0)?,
            p99: percentile(&v, 99.0)?,
            max: *v.last()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpys_linear_definition() {
        // numpy.percentile([1, 2, 3, 4], [50, 95, 99]) == [2.5, 3.85, 3.97]
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!((percentile(&v, 95.0).unwrap() - 3.85).abs() < 1e-12);
        assert!((percentile(&v, 99.0).unwrap() - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn summary_sorts_and_drops_nans() {
        let s = Summary::of(&[5.0, f64::NAN, 1.0, 3.0]).unwrap();
        assert_eq!(s.count, 3);
        assert_eq!(s.p50, 3.0);
        assert_eq!(s.max, 5.0);
        assert!((s.mean - 3.0).abs() < 1e-12);
        let tail: Vec<f64> = (1..=100).map(f64::from).collect();
        let t = Summary::of(&tail).unwrap();
        assert!((t.p99 - 99.01).abs() < 1e-9);
        assert!(Summary::of(&[]).is_none());
    }
}
