//! From request body to routing decision: parse and validate the OpenAI request, render the chat
//! template and tokenise (segment cache, on the blocking pool), hash the prompt's blocks with the
//! protocol crate's one function, and ask the prefix index how much of it each replica holds.
//! Where the request goes is `placement.rs`'s question.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use serde::Deserialize;

use policies::RouteDecision;
use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::openai::{ChatCompletionRequest, CompletionRequest, PromptInput};
use protocol::segment_cache::SegmentCache;
use protocol::token_bound::LimitCheck;
use protocol::tokenizer::TextTokenizer;
use protocol::ApiError;
use serde_json::Value;

use crate::metrics::GatewayMetrics;
use crate::prefix_reuse::PrefixReuse;
use crate::registry::Registry;

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
    pub tokenize_seconds: f64,
    /// The body as it is forwarded: the client's `priority` removed, the tenant's salt in
    /// `cache_salt`; [`Prepared::body_for`] adds the route's engine priority.
    doc: Arc<serde_json::Map<String, Value>>,
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
}

/// Limits on the prompt, checked before and after tokenising.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    /// Tokens of one prompt.
    pub per_prompt: usize,
    /// Tokens of a request, summed over a batched prompt list.
    pub per_request: usize,
}

pub struct Router {
    pub tokenizer: Arc<TextTokenizer>,
    segments: SegmentCache,
    pub model: String,
    pub block_size: usize,
    pub registry: Arc<Registry>,
    pub metrics: Arc<GatewayMetrics>,
    /// How often each matched prefix is reused (the inter-token check's amortisation).
    pub reuse: PrefixReuse,
}

fn too_long(at_least: usize, limit: usize, exact: bool) -> ApiError {
    let n = if exact {
        format!("{at_least}")
    } else {
        format!("at least {at_least}")
    };
    ApiError::invalid_request(format!(
        "The prompt has {n} tokens; this gateway accepts at most {limit} tokens per prompt. \
         Please shorten the prompt."
    ))
    .with_param("messages")
    .with_code("context_length_exceeded")
}

impl Router {
    pub fn new(
        tokenizer: Arc<TextTokenizer>,
        model: String,
        block_size: usize,
        registry: Arc<Registry>,
        metrics: Arc<GatewayMetrics>,
    ) -> Self {
        let segments = SegmentCache::new(&tokenizer, 64 << 20);
        Router {
            tokenizer,
            segments,
            model,
            block_size,
            registry,
            metrics,
            reuse: PrefixReuse::default(),
        }
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Err(
                ApiError::invalid_request("you must provide a model parameter")
                    .with_param("model")
                    .with_code("missing_model"),
            ),
            Some(m) if m == self.model => Ok(()),
            Some(m) => Err(ApiError::model_not_found(m, &self.model)),
        }
    }

    fn refused(&self, stage: &'static str) {
        self.metrics
            .counter("kvgate_gateway_prompts_refused_total", &[("stage", stage)])
            .increment(1);
    }

    /// Tokenises `text` unless it is certainly over `limit`, with work bounded by the limit
    /// rather than by the text (see `protocol::token_bound`); `encode` does the exact pass.
    fn encode_bounded(
        &self,
        text: &str,
        limit: usize,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, ApiError>,
    ) -> Result<Vec<u32>, ApiError> {
        match self.tokenizer.check_limit(text, limit)? {
            LimitCheck::Exceeds {
                at_least,
                tokenized_bytes,
            } => {
                self.refused(if tokenized_bytes == 0 {
                    "bytes"
                } else {
                    "pieces"
                });
                Err(too_long(at_least, limit, false))
            }
            LimitCheck::MayFit => {
                let ids = encode(text)?;
                if ids.len() > limit {
                    self.refused("exact");
                    return Err(too_long(ids.len(), limit, true));
                }
                Ok(ids)
            }
        }
    }

    /// Parses, validates, tokenises and hashes (blocking: call from the blocking pool).
    pub fn prepare(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        caller: &Caller,
        limits: PromptLimits,
    ) -> Result<Prepared, ApiError> {
        let invalid_json = |e: serde_json::Error| {
            ApiError::invalid_request(format!("invalid JSON body: {e}")).with_code("invalid_json")
        };
        let started = Instant::now();
        let mut doc = match serde_json::from_slice::<Value>(body).map_err(invalid_json)? {
            Value::Object(m) => m,
            _ => {
                return Err(ApiError::invalid_request("the body must be a JSON object")
                    .with_code("invalid_json"))
            }
        };
        // The client's priority is never forwarded: the route decides it (`body_for`).
        doc.remove("priority");
        let client_salt = match doc.get("cache_salt") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::invalid_request("cache_salt must be a string")
                    .with_param("cache_salt"))
            }
        };
        let salt = match (&caller.tenant_salt, client_salt) {
            (Some(t), Some(c)) => Some(format!("{t}/{c}")),
            (Some(t), None) => Some(t.clone()),
            (None, c) => c,
        };
        match &salt {
            Some(s) => doc.insert("cache_salt".into(), Value::String(s.clone())),
            None => doc.remove("cache_salt"),
        };
        let view = Value::Object(doc);
        let limit = limits.per_prompt;
        let (first, total, largest, stream) = match endpoint {
            Endpoint::Completions => {
                let r = CompletionRequest::deserialize(&view).map_err(invalid_json)?;
                r.validate()?;
                self.check_model(r.model.as_deref())?;
                let mut first: Option<Vec<u32>> = None;
                let (mut total, mut largest) = (0usize, 0usize);
                // Every member is counted (the list is classified by its total); the first
                // decides where the request goes.
                for input in r.prompt.inputs() {
                    let ids = match input {
                        PromptInput::Text(t) => {
                            let budget = limit.min(limits.per_request.saturating_sub(total));
                            self.encode_bounded(&t, budget, |t| {
                                Ok(self.tokenizer.encode(t, true)?)
                            })?
                        }
                        PromptInput::Tokens(ids) if ids.len() > limit => {
                            self.refused("exact");
                            return Err(too_long(ids.len(), limit, true).with_param("prompt"));
                        }
                        PromptInput::Tokens(ids) => ids,
                    };
                    total += ids.len();
                    largest = largest.max(ids.len());
                    if total > limits.per_request {
                        self.refused("exact");
                        return Err(ApiError::invalid_request(format!(
                            "the prompts of this request have at least {total} tokens together; \
                             this gateway accepts at most {} per request",
                            limits.per_request
                        ))
                        .with_param("prompt")
                        .with_code("context_length_exceeded"));
                    }
                    first.get_or_insert(ids);
                }
                let first = first.ok_or_else(|| {
                    ApiError::invalid_request("prompt must not be empty").with_param("prompt")
                })?;
                (first, total, largest, r.stream)
            }
            Endpoint::ChatCompletions => {
                let r = ChatCompletionRequest::deserialize(&view).map_err(invalid_json)?;
                r.validate()?;
                self.check_model(r.model.as_deref())?;
                let text = self.tokenizer.apply_chat_template(
                    &r.messages,
                    r.add_generation_prompt.unwrap_or(true),
                    r.tools.as_deref(),
                    r.chat_template_kwargs.as_ref(),
                )?;
                let ids = self.encode_bounded(&text, limit.min(limits.per_request), |t| {
                    Ok(self.segments.encode(&self.tokenizer, t)?)
                })?;
                let n = ids.len();
                (ids, n, n, r.stream)
            }
        };
        let doc = match view {
            Value::Object(d) => d,
            _ => serde_json::Map::new(),
        };
        let tokenize_seconds = started.elapsed().as_secs_f64();
        let root = root_hash(&self.model, None, salt.as_deref());
        let hashes = block_hashes(root, &first, self.block_size);
        Ok(Prepared {
            endpoint,
            stream,
            prompt_tokens: total,
            largest_prompt_tokens: largest,
            cacheable: cacheable_prompt_blocks(first.len(), self.block_size).min(hashes.len()),
            hashes: hashes.into(),
            session_id: caller.session_id.clone(),
            tokenize_seconds,
            doc: Arc::new(doc),
        })
    }

    /// Per replica: blocks of the prompt the index believes are cached there.
    pub fn matched(&self, p: &Prepared) -> Vec<usize> {
        self.registry.index.match_lengths(
            &p.hashes[..p.cacheable],
            self.registry.slots(),
            self.registry.now_s(),
            &self.registry.index_ttls(),
        )
    }

    /// Per replica: leading blocks of the prompt it has itself reported cached (its KV events),
    /// without the speculative records of requests sent there.
    pub fn confirmed(&self, p: &Prepared) -> Vec<usize> {
        let n = self.registry.slots();
        self.registry.index.match_lengths(
            &p.hashes[..p.cacheable],
            n,
            self.registry.now_s(),
            &vec![0; n],
        )
    }

    /// Per replica: blocks after its match in `matched` that sit in its offload tier.
    pub fn offloaded(&self, p: &Prepared, matched: &[usize]) -> Vec<usize> {
        self.registry
            .index
            .offloaded_lengths(&p.hashes[..p.cacheable], matched)
    }

    /// The speculative index insert: `p`'s blocks are taken to be at `replica` from the moment
    /// it is sent there, until the replica's own KV events arrive (short-lived for replicas
    /// with live events, `speculative_ttl_s`), so a burst sharing a new prefix follows its
    /// first request instead of prefilling it cold on every replica. Refreshed at the first
    /// answer. *Decision*: at send, since the inter-token check (on by default) keeps a hot
    /// prefix's single holder from taking every stream; without the check, inserting at send
    /// sat agent traffic on three replicas (BENCHMARKS, issue 11).
    pub fn speculate(&self, replica: usize, p: &Prepared) {
        self.registry
            .index
            .record_routed(replica, &p.hashes, self.registry.now_s());
    }

    /// Records a request sent to `replica`: the speculative insert, and (first attempts only)
    /// one reuse of the deepest prefix the index matched.
    pub fn sent(&self, replica: usize, p: &Prepared, matched: Option<&[usize]>) {
        self.speculate(replica, p);
        if let Some(m) = matched {
            self.reuse.record(&p.hashes[..p.cacheable], m);
        }
    }

    /// Records a decision whose replica answered: the speculative insert refreshed, metrics.
    pub fn commit(&self, policy: &'static str, p: &Prepared, d: &RouteDecision) {
        self.speculate(d.replica, p);
        self.metrics.decision(policy, d.reason.label());
        if let Some(r) = self.registry.replica(d.replica) {
            r.metrics().prompt_tokens.increment(p.prompt_tokens as u64);
            r.metrics()
                .predicted_hit_tokens
                .increment((d.matched_blocks * self.block_size) as u64);
        }
    }
}
