//! The ceiling a routing policy is judged against: the prefix hit ratio a workload would reach
//! with an unlimited cache and perfect placement — every block ever computed is still cached,
//! on the replica the request goes to. Each prompt is rendered and tokenised as the replicas do
//! (the real tokenizer and chat template) and hashed in blocks; its cached share is its longest
//! run of leading blocks seen before, capped at the blocks a replica may serve from cache (the
//! last prompt token is always computed).

use std::collections::HashSet;

use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::tokenizer::TextTokenizer;

use crate::workload::WorkItem;

/// The oracle's count over the requests it was asked to measure.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OracleHits {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl OracleHits {
    pub fn ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Walks `items` in sending order; counts only those with `measure[i]` (warm-up requests fill
/// the cache but are not reported, as in a run).
pub fn oracle_hits(
    tok: &TextTokenizer,
    model: &str,
    block_size: usize,
    items: &[WorkItem],
    measure: &[bool],
) -> Result<OracleHits, protocol::ApiError> {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = OracleHits::default();
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
            out.prompt_tokens += ids.len() as u64;
            out.cached_tokens += (hit * block_size) as u64;
        }
        seen.extend(hashes);
    }
    Ok(out)
}
