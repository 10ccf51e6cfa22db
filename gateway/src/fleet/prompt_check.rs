//! The detector for the failure that produces no error (the runbook's chat template): the
//! gateway renders and tokenises every prompt itself, and the engine reports its own count in
//! `usage.prompt_tokens`. On a healthy pair they are equal. A gateway whose tokenizer folder or
//! chat template drifted from the engine's (a model upgrade, a wrong folder) counts differently
//! — and with it the prefix hashes silently stop matching the engine's blocks, and the hit rate
//! and the prompts' meaning go with them. Each answer that carries a usage is checked; the
//! counts go to `kvgate_gateway_prompt_token_checks_total{result}` (the alert's ratio), and
//! the first mismatch per replica is kept for `/admin/replicas` and logged once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// The first request whose counts differed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Mismatch {
    /// The gateway's count (its rendering and tokenizer).
    pub gateway_tokens: u64,
    /// The engine's `usage.prompt_tokens`.
    pub engine_tokens: u64,
    /// The route it took.
    pub route: String,
    /// When it was seen, Unix seconds.
    pub at_unix_s: f64,
}

/// One replica's checks so far.
#[derive(Debug, Default)]
pub struct PromptCheck {
    checked: AtomicU64,
    mismatched: AtomicU64,
    first: parking_lot::Mutex<Option<Mismatch>>,
}

/// What [`PromptCheck::observe`] concluded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Match,
    Mismatch,
    /// The first mismatch on this replica (log it).
    FirstMismatch,
}

impl PromptCheck {
    /// Compares the two counts of one request, when both are known.
    pub fn observe(
        &self,
        gateway: Option<usize>,
        engine: Option<u64>,
        route: &str,
    ) -> Option<Verdict> {
        let (gateway, engine) = (gateway? as u64, engine?);
        self.checked.fetch_add(1, Ordering::Relaxed);
        if gateway == engine {
            return Some(Verdict::Match);
        }
        self.mismatched.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first.lock();
        if first.is_some() {
            return Some(Verdict::Mismatch);
        }
        *first = Some(Mismatch {
            gateway_tokens: gateway,
            engine_tokens: engine,
            route: route.to_string(),
            at_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        });
        Some(Verdict::FirstMismatch)
    }

    /// For `/admin/replicas`.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "checked": self.checked.load(Ordering::Relaxed),
            "mismatched": self.mismatched.load(Ordering::Relaxed),
            "first_mismatch": *self.first.lock(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_match_and_keep_the_first_mismatch() {
        let c = PromptCheck::default();
        assert_eq!(
            c.observe(Some(10), None, "r"),
            None,
            "no usage: nothing to check"
        );
        assert_eq!(c.observe(None, Some(10), "r"), None);
        assert_eq!(c.observe(Some(10), Some(10), "r"), Some(Verdict::Match));
        assert_eq!(
            c.observe(Some(10), Some(12), "a"),
            Some(Verdict::FirstMismatch)
        );
        assert_eq!(c.observe(Some(7), Some(9), "b"), Some(Verdict::Mismatch));
        let d = c.describe();
        assert_eq!(d["checked"], 3);
        assert_eq!(d["mismatched"], 2);
        assert_eq!(d["first_mismatch"]["gateway_tokens"], 10);
        assert_eq!(d["first_mismatch"]["engine_tokens"], 12);
        assert_eq!(d["first_mismatch"]["route"], "a");
    }
}
