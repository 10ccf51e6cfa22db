//! The detector for the failure that produces no error (the runbook's chat template): the
//! gateway renders and tokenises every prompt itself, and the engine reports its own count in
//! `usage.prompt_tokens`. On a healthy pair they are equal. A gateway whose tokenizer folder or
//! chat template drifted from the engine's (a model upgrade, a wrong folder) counts differently
//! — and with it the prefix hashes silently stop matching the engine's blocks, and the hit rate
//! and the prompts' meaning go with them. Each answer that carries a usage is checked; the
//! counts go to `kvgate_gateway_prompt_token_checks_total{result}` (the alert's ratio), and
//! the first mismatch per replica is kept for `/admin/replicas` and logged once.
//!
//! Equal counts do not prove equal prompts: a template that swaps one special token for
//! another, or a vocabulary with other ids, keeps the count. So a sample of requests
//! (`[drift] token_id_share`) also has its token ids compared with the engine's own, from
//! the replica's `/tokenize` (kvgate replicas and vLLM have it; an engine that answers 404
//! is not asked again), off the request path once the answer is sent.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::Serialize;

use crate::fleet::client::{FetchError, FleetClient};

/// How long a replica's `/tokenize` may take.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(5);

fn now_unix_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The first request whose token ids differed from the engine's.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IdMismatch {
    /// The first position where they differ.
    pub position: usize,
    /// The ids there (`None`: that side's prompt ended before it).
    pub gateway_id: Option<u32>,
    pub engine_id: Option<u32>,
    pub gateway_tokens: usize,
    pub engine_tokens: usize,
    pub route: String,
    pub at_unix_s: f64,
}

/// One replica's token-id comparisons.
#[derive(Debug, Default)]
struct IdChecks {
    checked: AtomicU64,
    mismatched: AtomicU64,
    first: parking_lot::Mutex<Option<IdMismatch>>,
    /// The engine has no `/tokenize`.
    unsupported: AtomicBool,
}

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
    ids: IdChecks,
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
            at_unix_s: now_unix_s(),
        });
        Some(Verdict::FirstMismatch)
    }

    /// Compares the gateway's token ids for one prompt with the engine's.
    pub fn observe_ids(&self, gateway: &[u32], engine: &[u32], route: &str) -> Verdict {
        self.ids.checked.fetch_add(1, Ordering::Relaxed);
        let Some(position) =
            (0..gateway.len().max(engine.len())).find(|&i| gateway.get(i) != engine.get(i))
        else {
            return Verdict::Match;
        };
        self.ids.mismatched.fetch_add(1, Ordering::Relaxed);
        let mut first = self.ids.first.lock();
        if first.is_some() {
            return Verdict::Mismatch;
        }
        *first = Some(IdMismatch {
            position,
            gateway_id: gateway.get(position).copied(),
            engine_id: engine.get(position).copied(),
            gateway_tokens: gateway.len(),
            engine_tokens: engine.len(),
            route: route.to_string(),
            at_unix_s: now_unix_s(),
        });
        Verdict::FirstMismatch
    }

    /// Asks the replica at `addr` to tokenise `body` (what the gateway tokenised into `ids`)
    /// and compares; `None` when there was no answer to compare (the error is logged; an
    /// engine without `/tokenize` is marked and not asked again).
    pub async fn compare_ids(
        &self,
        client: &FleetClient,
        addr: SocketAddr,
        body: Bytes,
        ids: &[u32],
        route: &str,
    ) -> Option<Verdict> {
        if self.ids.unsupported.load(Ordering::Relaxed) {
            return None;
        }
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        match client.post(addr, "/tokenize", body, TOKENIZE_TIMEOUT).await {
            Ok(b) => match serde_json::from_slice::<Tokenized>(&b) {
                Ok(t) => Some(self.observe_ids(ids, &t.tokens, route)),
                Err(e) => {
                    tracing::debug!(%addr, error = %e, "unreadable /tokenize answer");
                    None
                }
            },
            Err(FetchError::Status { status, .. })
                if matches!(status.as_u16(), 404 | 405 | 501) =>
            {
                self.ids.unsupported.store(true, Ordering::Relaxed);
                tracing::info!(%addr, "the replica has no /tokenize: its prompts' token ids are not compared, only their counts");
                None
            }
            Err(e) => {
                tracing::debug!(%addr, error = %e, "token-id check skipped");
                None
            }
        }
    }

    /// For `/admin/replicas`.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "checked": self.checked.load(Ordering::Relaxed),
            "mismatched": self.mismatched.load(Ordering::Relaxed),
            "first_mismatch": *self.first.lock(),
            "token_ids": {
                "checked": self.ids.checked.load(Ordering::Relaxed),
                "mismatched": self.ids.mismatched.load(Ordering::Relaxed),
                "first_mismatch": *self.ids.first.lock(),
                "unsupported": self.ids.unsupported.load(Ordering::Relaxed),
            },
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

    #[test]
    fn token_ids_compare_position_by_position() {
        let c = PromptCheck::default();
        assert_eq!(c.observe_ids(&[1, 2, 3], &[1, 2, 3], "r"), Verdict::Match);
        assert_eq!(
            c.observe_ids(&[1, 2, 3], &[1, 9, 3], "r"),
            Verdict::FirstMismatch
        );
        assert_eq!(c.observe_ids(&[1, 2], &[1, 2, 3], "r"), Verdict::Mismatch);
        let d = c.describe();
        assert_eq!(d["token_ids"]["checked"], 3);
        assert_eq!(d["token_ids"]["mismatched"], 2);
        let first = &d["token_ids"]["first_mismatch"];
        assert_eq!(first["position"], 1);
        assert_eq!(first["gateway_id"], 2);
        assert_eq!(first["engine_id"], 9);
        assert_eq!(d["checked"], 0, "the count check is separate");
    }
}
