//! Tokenising a rendered chat prompt segment by segment, with a bounded cache of the segments.
//!
//! HF tokenizers split the input on special added tokens (`<|im_start|>`, `<|im_end|>`, ...)
//! before anything else, and tokenise the text between them independently. Chat templates put
//! such tokens around every message, so a rendered conversation is a sequence of segments, and
//! turn N+1 repeats turns 1..N's segments verbatim. Encoding each segment separately and
//! concatenating gives exactly the whole-prompt ids (a test pins this against the Qwen3 files),
//! and caching segment ids means a multi-turn conversation is not re-tokenised from scratch each
//! turn. The equivalence needs special tokens that do not strip neighbouring whitespace; for a
//! tokenizer whose special tokens do, [`SegmentCache::encode`] falls back to whole-prompt
//! encoding.
//!
//! Keys are 128-bit xxh3 hashes of the segment text (a collision is a 2^-128 event), seeded by
//! the caller's cache scope, values the ids; eviction is least-recently-used within a byte
//! budget.
//!
//! **Long segments in pieces.** A segment longer than two [`CHUNK_BYTES`] — a long completions
//! prompt, one long message holding a shared document — is cut where its pieces tokenise to the
//! whole's ids (`text_chunks.rs`, proven per tokenizer at load) and each piece is cached as a
//! segment is, so a prompt that shares its first 3,000 tokens with an earlier one tokenises
//! only the rest. [`SegmentCache::encode_prompt_scoped`] does the same for a completions prompt,
//! special tokens added.
//!
//! **Scoped like the KV cache.** A cache hit is faster than a miss (a 29k-token message
//! tokenises in well under a millisecond instead of tens), so a cache shared by tenants would
//! let one tenant confirm a guess of another's exact message by timing. The gateway passes the
//! request's cache salt (its tenant's scope, as the KV cache's root hash is salted), so a
//! segment is reused only within the scope that tokenised it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64};

use crate::text_chunks::{chunk_bounds, pieces, ChunkSupport};
use crate::tokenizer::{TextTokenizer, TokenizerError};

/// Segments shorter than this are encoded directly: caching them costs more than it saves.
const MIN_CACHED_BYTES: usize = 32;

/// Pieces a long segment is cut into are at least this long (~250 tokens of prose).
pub const CHUNK_BYTES: usize = 1024;

struct Slot {
    ids: Arc<[u32]>,
    last_use: u64,
    bytes: usize,
}

#[derive(Default)]
struct Lru {
    map: HashMap<u128, Slot>,
    order: VecDeque<(u128, u64)>,
    clock: u64,
    bytes: usize,
    hits: u64,
    misses: u64,
}

/// Splits on special tokens and caches segment ids.
pub struct SegmentCache {
    splitter: Option<(AhoCorasick, Vec<u32>)>,
    /// Whether long segments may be tokenised in pieces, and what special tokens a prompt
    /// gets before its own ids (checked at load).
    support: ChunkSupport,
    max_bytes: usize,
    lru: Mutex<Lru>,
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes: usize,
    pub entries: usize,
}

impl SegmentCache {
    /// A cache for `tok` holding at most `max_bytes` of token ids.
    pub fn new(tok: &TextTokenizer, max_bytes: usize) -> Self {
        let specials = tok.special_tokens();
        let splitter = if specials.is_empty() || specials.iter().any(|s| s.strips_whitespace) {
            None
        } else {
            let patterns: Vec<&str> = specials.iter().map(|s| s.content.as_str()).collect();
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&patterns)
                .ok()
                .map(|ac| (ac, specials.iter().map(|s| s.id).collect()))
        };
        let support = ChunkSupport::check(tok);
        SegmentCache {
            splitter,
            support,
            max_bytes,
            lru: Mutex::new(Lru::default()),
        }
    }

    /// What the load-time check allowed for this tokenizer.
    pub fn chunk_support(&self) -> &ChunkSupport {
        &self.support
    }

    /// Encodes a whole prompt as `tok.encode(text, true)` does (special tokens added), reusing
    /// the pieces of it seen before in `scope`; without a proven way to assemble the added
    /// tokens, it is encoded whole.
    pub fn encode_prompt_scoped(
        &self,
        tok: &TextTokenizer,
        text: &str,
        scope: Option<&str>,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.support.added_prefix {
            Some(prefix) if self.support.chunking && self.splitter.is_some() => {
                let mut ids = prefix.clone();
                ids.extend(self.encode_scoped(tok, text, scope)?);
                Ok(ids)
            }
            _ => tok.encode(text, true),
        }
    }

    /// Whether segment-wise encoding is in use (false: whole-prompt fallback).
    pub fn is_segmenting(&self) -> bool {
        self.splitter.is_some()
    }

    pub fn stats(&self) -> SegmentCacheStats {
        let l = self.lru.lock();
        SegmentCacheStats {
            hits: l.hits,
            misses: l.misses,
            bytes: l.bytes,
            entries: l.map.len(),
        }
    }

    /// Encodes rendered chat text without adding special tokens (the template placed them);
    /// identical to `tok.encode(text, false)`. Uses the unscoped part of the cache (a single
    /// tenant's).
    pub fn encode(&self, tok: &TextTokenizer, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_scoped(tok, text, None)
    }

    /// [`SegmentCache::encode`] within `scope` (a tenant's cache salt): only segments this scope
    /// tokenised before are reused.
    pub fn encode_scoped(
        &self,
        tok: &TextTokenizer,
        text: &str,
        scope: Option<&str>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let seed = scope.map_or(0, |s| xxh3_64(s.as_bytes()));
        let Some((ac, ids)) = &self.splitter else {
            return tok.encode(text, false);
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in ac.find_iter(text) {
            if m.start() > at {
                self.encode_segment(tok, &text[at..m.start()], seed, &mut out)?;
            }
            out.push(ids[m.pattern().as_usize()]);
            at = m.end();
        }
        if at < text.len() {
            self.encode_segment(tok, &text[at..], seed, &mut out)?;
        }
        Ok(out)
    }

    fn encode_segment(
        &self,
        tok: &TextTokenizer,
        seg: &str,
        seed: u64,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if seg.len() < MIN_CACHED_BYTES {
            out.extend(tok.encode(seg, false)?);
            return Ok(());
        }
        if self.support.chunking && seg.len() > 2 * CHUNK_BYTES {
            let cuts = chunk_bounds(seg, CHUNK_BYTES);
            if !cuts.is_empty() {
                for piece in pieces(seg, &cuts) {
                    self.encode_piece(tok, piece, seed, out)?;
                }
                return Ok(());
            }
        }
        self.encode_piece(tok, seg, seed, out)
    }

    /// Encodes one piece through the cache.
    fn encode_piece(
        &self,
        tok: &TextTokenizer,
        seg: &str,
        seed: u64,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let key = xxh3_128_with_seed(seg.as_bytes(), seed);
        {
            let mut l = self.lru.lock();
            l.clock += 1;
            let now = l.clock;
            if let Some(slot) = l.map.get_mut(&key) {
                slot.last_use = now;
                out.extend_from_slice(&slot.ids);
                l.order.push_back((key, now));
                l.hits += 1;
                return Ok(());
            }
            l.misses += 1;
        }
        let ids: Arc<[u32]> = tok.encode(seg, false)?.into();
        out.extend_from_slice(&ids);
        self.insert(key, ids);
        Ok(())
    }

    fn insert(&self, key: u128, ids: Arc<[u32]>) {
        let bytes = ids.len() * 4 + 48;
        if bytes > self.max_bytes {
            return;
        }
        let mut l = self.lru.lock();
        l.clock += 1;
        let now = l.clock;
        if l.map.contains_key(&key) {
            return;
        }
        l.bytes += bytes;
        l.map.insert(
            key,
            Slot {
                ids,
                last_use: now,
                bytes,
            },
        );
        l.order.push_back((key, now));
        while l.bytes > self.max_bytes {
            let Some((k, used)) = l.order.pop_front() else {
                break;
            };
            // Only the newest queue record of a key is authoritative.
            if l.map.get(&k).is_some_and(|s| s.last_use == used) {
                if let Some(s) = l.map.remove(&k) {
                    l.bytes -= s.bytes;
                }
            }
        }
        // Stale records pile up on hits; compact when they dominate.
        if l.order.len() > 4 * l.map.len() + 64 {
            let Lru { map, order, .. } = &mut *l;
            order.retain(|(k, used)| map.get(k).is_some_and(|s| s.last_use == *used));
        }
    }
}
