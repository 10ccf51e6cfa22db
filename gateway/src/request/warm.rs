//! Warming a replica with a hot prefix (`prefix_aware`'s `warm`, `policies/src/prefix_aware/
//! warm.rs`): the request's own body, unstreamed and for one token, sent to the replica the
//! decision names, in the background. The replica prefills the prompt and keeps its blocks
//! like any other; the gateway records it as a holder at once (the speculative insert, as
//! for any request it sends) and counts the prefill in that replica's queue and the request in
//! its load until the answer, so the next requests of the prefix are priced with it, and a
//! follower waits for this prefill instead of repeating it. The client's request is not
//! delayed: it has gone to its holder.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use policies::{RouteDecision, Warm};
use serde_json::Value;

use crate::fleet::guards::{InFlight, PendingPrefill};
use crate::fleet::registry::Registry;
use crate::prefix::view::{uncached_tokens, PrefixView};
use crate::request::prepared::{Endpoint, Prepared};
use crate::routes::store::ActiveRoute;

/// A warming prefill that has not answered in this long is given up on.
const WARM_TIMEOUT: Duration = Duration::from_secs(60);

/// The request's body made a warming one: unstreamed, one token, one choice. `None` for a
/// completions request with a list of prompts (only the first is hashed).
pub fn warm_body(p: &Prepared, engine_priority: i32) -> Option<Bytes> {
    let mut doc = (*p.doc).clone();
    if p.endpoint == Endpoint::Completions
        && doc
            .get("prompt")
            .and_then(Value::as_array)
            .is_some_and(|a| a.first().is_some_and(|x| !x.is_number()))
    {
        return None;
    }
    doc.insert("stream".into(), Value::Bool(false));
    doc.remove("stream_options");
    doc.insert("max_tokens".into(), 1.into());
    if doc.contains_key("max_completion_tokens") {
        doc.insert("max_completion_tokens".into(), 1.into());
    }
    doc.insert("n".into(), 1.into());
    if engine_priority != 0 {
        doc.insert("priority".into(), engine_priority.into());
    }
    serde_json::to_vec(&doc).ok().map(Bytes::from)
}

/// Where a warming request goes and what it is recorded in.
pub struct Warmer<'a> {
    pub fleet: &'a Registry,
    pub prefix: &'a PrefixView,
}

impl Warmer<'_> {
    /// Sends the decision's warming request, if it names one; returns the warmed replica's
    /// label for the access log.
    pub fn warm(&self, route: &ActiveRoute, p: &Prepared, d: &RouteDecision) -> Option<String> {
        let Warm {
            replica: slot,
            reason,
        } = d.warm?;
        let replica = self.fleet.replica(slot)?;
        let addr = replica.addr()?;
        let body = warm_body(p, route.cfg.engine_priority)?;
        // The prefix the holders hold: one warming request for it at a time.
        let key = *p.hashes.get(d.matched_blocks.checked_sub(1)?)?;
        if !self.prefix.warming.claim(key, Instant::now()) {
            return None;
        }
        let matched = d
            .scores
            .iter()
            .find(|s| s.replica == slot)
            .map_or(0, |s| s.matched_blocks);
        let uncached = uncached_tokens(p.prompt_tokens, matched, p.block_size);
        self.prefix.sent(slot, p.blocks(), None, self.fleet.now_s());
        let (pending, _) = PendingPrefill::new(
            replica.clone(),
            uncached,
            p.hashes.clone(),
            route.background(),
        );
        let in_flight = InFlight::new(replica.clone(), p.prompt_tokens as u64, route.background());
        let counters = route.rt.stats.warms(reason.label());
        let client = self.fleet.client().clone();
        let path = p.endpoint.path();
        let label = replica.label().to_string();
        let who = Arc::clone(&replica);
        let warming = self.prefix.warming_handle();
        tokio::spawn(async move {
            let answer = client.post(addr, path, body, WARM_TIMEOUT).await;
            drop(pending);
            drop(in_flight);
            warming.release(key);
            match answer {
                Ok(_) => counters.0.increment(1),
                Err(e) => {
                    counters.1.increment(1);
                    tracing::debug!(replica = %who.label(), error = %e, "warming request failed");
                }
            }
        });
        Some(label)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(endpoint: Endpoint, doc: Value) -> Prepared {
        Prepared {
            model: 0,
            block_size: 16,
            endpoint,
            stream: true,
            prompt_tokens: 40,
            largest_prompt_tokens: 40,
            hashes: vec![1u64, 2].into(),
            cacheable: 2,
            session_id: None,
            max_token_events: None,
            tokenize_seconds: 0.0,
            id_probe: None,
            doc: Arc::new(doc.as_object().unwrap().clone()),
            scope: None,
        }
    }

    #[test]
    fn a_warming_body_asks_for_one_unstreamed_token() {
        let doc = serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "stream": true, "stream_options": {"include_usage": true},
            "max_completion_tokens": 500, "n": 3, "cache_salt": "tenant-a",
        });
        let p = prepared(Endpoint::ChatCompletions, doc.clone());
        let b: Value = serde_json::from_slice(&warm_body(&p, 0).unwrap()).unwrap();
        assert_eq!(b["stream"], false);
        assert_eq!(b["max_tokens"], 1);
        assert_eq!(b["max_completion_tokens"], 1);
        assert_eq!(b["n"], 1);
        assert!(b.get("stream_options").is_none());
        assert!(b.get("priority").is_none());
        // The tenant's salt stays: the warmed blocks are the ones its requests hash to.
        assert_eq!(b["cache_salt"], "tenant-a");
        assert_eq!(b["messages"], doc["messages"]);
        let b: Value = serde_json::from_slice(&warm_body(&p, 5).unwrap()).unwrap();
        assert_eq!(b["priority"], 5);
        // A list of prompts is not warmed (only the first is hashed).
        let list = serde_json::json!({"model": "m", "prompt": ["a", "b"]});
        assert!(warm_body(&prepared(Endpoint::Completions, list), 0).is_none());
        let ids = serde_json::json!({"model": "m", "prompt": [1, 2, 3]});
        assert!(warm_body(&prepared(Endpoint::Completions, ids), 0).is_some());
    }
}
