//! The ceiling a routing policy is judged against: the prefix hit ratio a workload would reach
//! with an unlimited cache and perfect placement — every block ever computed is still cached,
//! on the replica the request goes to. Each prompt is rendered and tokenised as the replicas do
//! (the real tokenizer and chat template) and hashed in blocks; its cached share is its longest
//! run of leading blocks seen before, capped at the blocks a replica may serve from cache (the
//! last prompt token is always computed).
//!
//! The same walk gives each request's uncached tokens under that ceiling; priced by a model of
//! an idle replica ([`ttft_floor`]), they bound the TTFT any router can reach on the traffic:
//! no placement prefills fewer tokens, and no replica prefills faster than an idle one.

use std::collections::HashSet;

use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::tokenizer::TextTokenizer;

use crate::stats::Summary;
use crate::workload::WorkItem;

/// One measured request as the oracle sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleRequest {
    pub prompt_tokens: u64,
    /// Leading tokens an unlimited cache with perfect placement would serve.
    pub cached_tokens: u64,
}

/// The oracle's count over the requests it was asked to measure.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OracleHits {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl OracleHits {
    /// The totals over `reqs`.
    pub fn of(reqs: &[OracleRequest]) -> Self {
        reqs.iter().fold(OracleHits::default(), |mut h, r| {
            h.prompt_tokens += r.prompt_tokens;
            h.cached_tokens += r.cached_tokens;
            h
        })
    }

    pub fn ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Walks `items` in sending order; returns every measured request's (`measure[i]`) prompt and
/// oracle-cached tokens. Warm-up requests fill the cache but are not reported, as in a run.
pub fn oracle_requests(
    tok: &TextTokenizer,
    model: &str,
    block_size: usize,
    items: &[WorkItem],
    measure: &[bool],
) -> Result<Vec<OracleRequest>, protocol::ApiError> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    let root = root_hash(model, None, None);
    for (item, &m) in items.iter().zip(measure) {
        let ids = tok.encode_chat(&item.messages, true, None, None)?;
        let hashes = block_hashes(root, &ids, block_size);
        let cacheable = cacheable_prompt_blocks(ids.len(), block_size).min(hashes.len());
        let hit = hashes[..cacheable]
            .iter()
            .take_while(|h| seen.contains(h))
            .count();
        if m {
            out.push(OracleRequest {
                prompt_tokens: ids.len() as u64,
                cached_tokens: (hit * block_size) as u64,
            });
        }
        seen.extend(hashes);
    }
    Ok(out)
}

/// The TTFT floor of the traffic: each request's oracle-uncached prefill priced by
/// `idle_ttft_s(prompt_tokens, cached_tokens)` (the time an idle replica takes to its first
/// token), summarised. Each request's TTFT is at least its floor under any router, so each
/// percentile of the floor bounds that percentile of a run from below.
pub fn ttft_floor(
    reqs: &[OracleRequest],
    idle_ttft_s: impl Fn(u64, u64) -> f64,
) -> Option<Summary> {
    let v: Vec<f64> = reqs
        .iter()
        .map(|r| idle_ttft_s(r.prompt_tokens, r.cached_tokens))
        .collect();
    Summary::of(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_percentiles_follow_the_uncached_tokens() {
        let reqs: Vec<OracleRequest> = (1..=100)
            .map(|i| OracleRequest {
                prompt_tokens: 1000,
                cached_tokens: 1000 - 10 * i,
            })
            .collect();
        // One millisecond per uncached token: the floor is 10..=1000 ms.
        let s = ttft_floor(&reqs, |p, c| (p - c) as f64 * 1e-3).unwrap();
        assert_eq!(s.count, 100);
        assert!((s.max - 1.0).abs() < 1e-12);
        assert!((s.p50 - 0.505).abs() < 1e-9);
        assert!(ttft_floor(&[], |_, _| 1.0).is_none());
    }
}
