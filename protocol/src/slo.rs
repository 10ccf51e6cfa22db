//! The latency promise and the goodput rule, one definition for the gateway (which keeps the
//! promise per route and counts its goodput) and the load tester (which judges what a client
//! saw), so the two can never disagree about which request was good.
//!
//! A request is *good* when its time to first token and the p95 (nearest rank) of its own
//! inter-token gaps are both within the targets; a timer without a target always passes. An
//! answer that is not streamed shows no token times: it is judged by its end-to-end time
//! against TTFT plus one inter-token gap per further token.

use std::time::Duration;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// A route's latency promise (p95 targets); `None` means no promise on that timer.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    pub ttft: Option<Duration>,
    pub itl: Option<Duration>,
}

/// Which promises a request kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub ttft_met: bool,
    pub itl_met: bool,
}

impl Verdict {
    pub fn good(self) -> bool {
        self.ttft_met && self.itl_met
    }
}

/// The p95 (nearest rank) of a request's gaps.
pub fn p95(gaps: &[Duration]) -> Option<Duration> {
    if gaps.is_empty() {
        return None;
    }
    let mut v = gaps.to_vec();
    v.sort_unstable();
    let rank = ((v.len() as f64) * 0.95).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

impl Slo {
    pub fn from_ms(ttft_ms: Option<u64>, itl_ms: Option<u64>) -> Self {
        Slo {
            ttft: ttft_ms.map(Duration::from_millis),
            itl: itl_ms.map(Duration::from_millis),
        }
    }

    pub fn ttft_s(&self) -> Option<f64> {
        self.ttft.map(|d| d.as_secs_f64())
    }

    pub fn itl_s(&self) -> Option<f64> {
        self.itl.map(|d| d.as_secs_f64())
    }

    /// A streamed answer with first token after `ttft` (`None`: never) and these gaps.
    pub fn judge_stream(&self, ttft: Option<Duration>, gaps: &[Duration]) -> Verdict {
        Verdict {
            ttft_met: match (self.ttft, ttft) {
                (None, _) => true,
                (Some(t), Some(x)) => x <= t,
                (Some(_), None) => false,
            },
            itl_met: match (self.itl, p95(gaps)) {
                (Some(t), Some(x)) => x <= t,
                _ => true,
            },
        }
    }

    /// An answer that was not streamed: `output_tokens` arrived at once after `e2e`.
    pub fn judge_whole(&self, e2e: Duration, output_tokens: u64) -> Verdict {
        let budget = self.ttft.map(|t| {
            t + self.itl.unwrap_or(Duration::ZERO) * output_tokens.saturating_sub(1) as u32
        });
        let met = budget.is_none_or(|b| e2e <= b);
        Verdict {
            ttft_met: met,
            itl_met: self.itl.is_none() || met,
        }
    }
}

/// As reports write it: `{"ttft_s": 1.0, "itl_s": 0.05}` (null without a target).
impl Serialize for Slo {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Slo", 2)?;
        st.serialize_field("ttft_s", &self.ttft_s())?;
        st.serialize_field("itl_s", &self.itl_s())?;
        st.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_stream_is_judged_by_its_ttft_and_the_p95_of_its_own_gaps() {
        let slo = Slo::from_ms(Some(1000), Some(50));
        assert!(slo.judge_stream(Some(500 * MS), &[40 * MS; 20]).good());
        let late = slo.judge_stream(Some(1500 * MS), &[40 * MS; 20]);
        assert_eq!((late.ttft_met, late.itl_met), (false, true));
        assert!(!slo.judge_stream(None, &[]).good());
        // One slow gap in 40 is under the p95; three are not (nearest rank 38 of 40).
        let mut gaps = vec![40 * MS; 39];
        gaps.push(500 * MS);
        assert!(slo.judge_stream(Some(MS), &gaps).good());
        gaps.truncate(37);
        gaps.extend([500 * MS; 3]);
        assert!(!slo.judge_stream(Some(MS), &gaps).good());
        // No promise: always good.
        assert!(Slo::default().judge_stream(None, &[10 * 1000 * MS]).good());
    }

    #[test]
    fn a_whole_answer_gets_ttft_plus_one_gap_per_further_token() {
        let slo = Slo::from_ms(Some(1000), Some(50));
        assert!(slo.judge_whole(1000 * MS + 49 * 50 * MS, 50).good());
        assert!(!slo.judge_whole(1001 * MS + 49 * 50 * MS, 50).good());
    }

    #[test]
    fn reports_write_seconds() {
        let v = serde_json::to_value(Slo::from_ms(Some(1500), None)).unwrap();
        assert_eq!(v, serde_json::json!({"ttft_s": 1.5, "itl_s": null}));
    }
}
