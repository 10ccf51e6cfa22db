//! What a request is once it is prepared ([`Prepared`]): its endpoint, its prompt's size and
//! block hashes, its session, and the body as it will be forwarded. The prepare stage makes
//! one; every later stage reads it. Its own file so that the stages it passes through depend
//! on it, not on the stage that made it.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;

use crate::prefix::view::{uncached_tokens, PromptBlocks};

/// What a replica's `/tokenize` is asked, and the ids the gateway made of the same input
/// (a request sampled for the token-id drift check, `request/drift_sample.rs`).
#[derive(Debug)]
pub struct IdProbe {
    pub body: Bytes,
    pub ids: Arc<[u32]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
        }
    }
}

/// Who sends a request, as far as its prompt is concerned.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    pub session_id: Option<String>,
    /// The tenant's cache scope: prefixed to the request's own `cache_salt`, so tenants never
    /// share prefix blocks unless the policy groups them. `None`: the anonymous single tenant,
    /// whose own salt passes through.
    pub tenant_salt: Option<String>,
}

/// A parsed, tokenised, hashed request ready to route.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The model asked for: its position among the active policy's models (set by the
    /// caller, which picked the model; 0 until then).
    pub model: usize,
    /// That model's KV block size in tokens.
    pub block_size: usize,
    pub endpoint: Endpoint,
    pub stream: bool,
    /// Prompt tokens of the whole request (summed over a batched prompt list): what routes
    /// classify, budgets count and admission prices.
    pub prompt_tokens: usize,
    /// The longest single prompt of the request.
    pub largest_prompt_tokens: usize,
    /// Hashes of every full block of the (first) prompt (shared with the replica's prefill
    /// queue while the request is unanswered, not copied).
    pub hashes: Arc<[u64]>,
    /// Leading blocks a replica could serve from cache (the last prompt token is always
    /// computed).
    pub cacheable: usize,
    pub session_id: Option<String>,
    /// The most token-carrying events its answer may hold: `max_tokens` × choices (`n`, and
    /// each prompt of a list); `None` when the request sets no `max_tokens`.
    pub max_token_events: Option<u64>,
    pub tokenize_seconds: f64,
    /// Sampled for the token-id drift check: what to ask the replica's `/tokenize`.
    pub id_probe: Option<Arc<IdProbe>>,
    /// The body as it is forwarded: the client's `priority` removed, the tenant's salt in
    /// `cache_salt`; [`Prepared::body_for`] adds the route's engine priority.
    pub(crate) doc: Arc<serde_json::Map<String, Value>>,
    /// The replicas this request may go to, when its caller narrows them (a batch line: the
    /// replicas the trough found spare); such a request goes to one of them now or is refused
    /// with 503 `no_spare_replica`, never waits. `None`: the route's whole pool.
    pub scope: Option<Arc<[usize]>>,
}

#[derive(serde::Serialize)]
struct Outgoing<'a> {
    #[serde(flatten)]
    doc: &'a serde_json::Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<i32>,
}

impl Prepared {
    /// The body to send upstream, with `engine_priority` as the body's `priority` (left out
    /// when 0, which engines without priority scheduling require).
    pub fn body_for(&self, engine_priority: i32) -> Bytes {
        let out = Outgoing {
            doc: &self.doc,
            priority: (engine_priority != 0).then_some(engine_priority),
        };
        Bytes::from(serde_json::to_vec(&out).unwrap_or_default())
    }

    /// Prompt tokens a replica must compute with `matched[replica]` of the prompt's blocks
    /// cached there.
    pub fn uncached(&self, matched: &[usize], replica: usize) -> u64 {
        uncached_tokens(
            self.prompt_tokens,
            matched.get(replica).copied().unwrap_or(0),
            self.block_size,
        )
    }

    /// The prompt's blocks as the prefix index reads them.
    pub fn blocks(&self) -> PromptBlocks<'_> {
        PromptBlocks {
            hashes: &self.hashes,
            cacheable: self.cacheable,
        }
    }
}

/// Limits on the prompt, checked before and after tokenising.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    /// Tokens of one prompt.
    pub per_prompt: usize,
    /// Tokens of a request, summed over a batched prompt list.
    pub per_request: usize,
}
