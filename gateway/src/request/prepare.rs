//! Stage 1, prepare: from request body to a [`Prepared`] request. Parse and validate the OpenAI
//! request, put the tenant's cache salt in it, render the chat template and tokenise (with
//! work bounded by the prompt limit, the segment cache for chat messages), and hash the
//! prompt's blocks with the protocol crate's one function. Tokenising is CPU work: it runs on
//! the blocking pool, never on the reactor, at most `tokenize_concurrency` prompts at once, the
//! others waiting in an ordered, bounded queue ([`Tokenizers`], `tokenizer_pool.rs`). A long
//! prompt is tokenised in pieces, and a piece its tenant sent before is not tokenised again
//! (protocol's `segment_cache.rs`).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::openai::{ChatCompletionRequest, CompletionRequest, PromptInput};
use protocol::segment_cache::{SegmentCache, SegmentCacheStats};
use protocol::text_chunks::ChunkSupport;
use protocol::token_bound::LimitCheck;
use protocol::tokenizer::TextTokenizer;
use protocol::ApiError;
use serde::Deserialize;
use serde_json::Value;

use crate::metrics::GatewayMetrics;
use crate::request::drift_sample::DriftSampler;
use crate::request::prepared::{Caller, Endpoint, Prepared, PromptLimits};
use crate::request::tokenizer_pool::{PoolLimits, TokenizerPool};

/// Bodies up to this size are tokenised on the reactor (see [`Tokenizers::prepare`]).
pub const INLINE_PREPARE_BYTES: usize = 1024;

/// Parses, tokenises and hashes a request's prompt (blocking work).
pub struct Preparer {
    pub tokenizer: Arc<TextTokenizer>,
    segments: SegmentCache,
    /// The served model name a request must ask for (or one of its aliases).
    pub model: String,
    aliases: Vec<String>,
    /// For a LoRA adapter: its base model, whose root its blocks hash from (with the
    /// adapter's name, as the engines key them).
    base: Option<String>,
    pub block_size: usize,
    metrics: Arc<GatewayMetrics>,
    /// Which requests are sampled for the drift checks (`[drift]`; off unless set).
    drift: Arc<DriftSampler>,
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

impl Preparer {
    /// A preparer with the default segment cache (64 MiB).
    pub fn new(
        tokenizer: Arc<TextTokenizer>,
        model: String,
        block_size: usize,
        metrics: Arc<GatewayMetrics>,
    ) -> Self {
        Self::with_cache(tokenizer, model, block_size, metrics, 64 << 20)
    }

    /// A preparer whose segment cache holds at most `cache_bytes`.
    pub fn with_cache(
        tokenizer: Arc<TextTokenizer>,
        model: String,
        block_size: usize,
        metrics: Arc<GatewayMetrics>,
        cache_bytes: usize,
    ) -> Self {
        let segments = SegmentCache::new(&tokenizer, cache_bytes);
        Preparer {
            tokenizer,
            segments,
            model,
            aliases: Vec::new(),
            base: None,
            block_size,
            metrics,
            drift: Arc::default(),
        }
    }

    /// Samples requests for the drift checks as `drift` says.
    pub fn with_drift(mut self, drift: Arc<DriftSampler>) -> Self {
        self.drift = drift;
        self
    }

    /// Makes this the preparer of a LoRA adapter of `base` (this model's name is the
    /// adapter's).
    pub fn with_base(mut self, base: Option<String>) -> Self {
        self.base = base;
        self
    }

    /// The other names the model answers to (forwarded as its name).
    pub fn with_aliases(mut self, aliases: Vec<String>) -> Self {
        self.aliases = aliases;
        self
    }

    /// Whether this tokenizer lets long prompts be tokenised in pieces (proven at load).
    pub fn chunk_support(&self) -> &ChunkSupport {
        self.segments.chunk_support()
    }

    /// The segment cache's counters (hits, misses, bytes held).
    pub fn cache_stats(&self) -> SegmentCacheStats {
        self.segments.stats()
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Err(
                ApiError::invalid_request("you must provide a model parameter")
                    .with_param("model")
                    .with_code("missing_model"),
            ),
            Some(m) if m == self.model => Ok(()),
            Some(m) => {
                let served: Vec<&str> = std::iter::once(self.model.as_str())
                    .chain(self.aliases.iter().map(String::as_str))
                    .collect();
                Err(ApiError::model_not_found_among(m, &served))
            }
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
        // An alias is forwarded as the model's name, which the replicas serve and hash with.
        if let Some(Value::String(m)) = doc.get_mut("model") {
            if self.aliases.contains(m) {
                m.clone_from(&self.model);
            }
        }
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
        let (first, total, largest, stream, max_events, id_probe) = match endpoint {
            Endpoint::Completions => {
                let r = CompletionRequest::deserialize(&view).map_err(invalid_json)?;
                r.validate()?;
                self.check_model(r.model.as_deref())?;
                let mut first: Option<Vec<u32>> = None;
                let mut probe = None;
                let (mut total, mut largest, mut prompts) = (0usize, 0usize, 0u64);
                // Every member is counted (the list is classified by its total); the first
                // decides where the request goes.
                for input in r.prompt.inputs() {
                    let ids = match input {
                        PromptInput::Text(t) => {
                            let budget = limit.min(limits.per_request.saturating_sub(total));
                            let ids = self.encode_bounded(&t, budget, |t| {
                                Ok(self.segments.encode_prompt_scoped(
                                    &self.tokenizer,
                                    t,
                                    salt.as_deref(),
                                )?)
                            })?;
                            if first.is_none() {
                                probe = self.drift.prompt_probe(&self.model, &t, &ids);
                                self.drift.sample_prompt(endpoint, &t, ids.len());
                            }
                            ids
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
                    prompts += 1;
                }
                let first = first.ok_or_else(|| {
                    ApiError::invalid_request("prompt must not be empty").with_param("prompt")
                })?;
                let choices = prompts * u64::from(r.sampling.n.unwrap_or(1).max(1));
                let events = r.max_tokens.map(|m| u64::from(m) * choices);
                (first, total, largest, r.stream, events, probe)
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
                    Ok(self
                        .segments
                        .encode_scoped(&self.tokenizer, t, salt.as_deref())?)
                })?;
                let n = ids.len();
                let probe = self.drift.chat_probe(&self.model, &r, &ids);
                self.drift.sample_prompt(endpoint, &text, n);
                let choices = u64::from(r.sampling.n.unwrap_or(1).max(1));
                let events = r.max_tokens().map(|m| u64::from(m) * choices);
                (ids, n, n, r.stream, events, probe)
            }
        };
        let doc = match view {
            Value::Object(d) => d,
            _ => serde_json::Map::new(),
        };
        let tokenize_seconds = started.elapsed().as_secs_f64();
        let root = match &self.base {
            None => root_hash(&self.model, None, salt.as_deref()),
            Some(base) => root_hash(base, Some(&self.model), salt.as_deref()),
        };
        let hashes = block_hashes(root, &first, self.block_size);
        Ok(Prepared {
            model: 0,
            block_size: self.block_size,
            endpoint,
            stream,
            prompt_tokens: total,
            largest_prompt_tokens: largest,
            cacheable: cacheable_prompt_blocks(first.len(), self.block_size).min(hashes.len()),
            hashes: hashes.into(),
            session_id: caller.session_id.clone(),
            max_token_events: max_events,
            tokenize_seconds,
            id_probe,
            doc: Arc::new(doc),
            scope: None,
        })
    }
}

/// The prepare stage as the request path runs it: the model's [`Preparer`] behind the
/// tokeniser pool (`tokenizer_pool.rs`, shared by every model: the slots are the CPU's) on the
/// blocking pool.
pub struct Tokenizers {
    pool: Arc<TokenizerPool>,
    metrics: Arc<GatewayMetrics>,
}

impl Tokenizers {
    pub fn new(limits: PoolLimits, metrics: Arc<GatewayMetrics>) -> Self {
        Tokenizers {
            pool: TokenizerPool::new(limits),
            metrics,
        }
    }

    /// Prepares `body` on the blocking pool once a tokeniser is free for a request of priority
    /// `rank` (its place in the queue), or refuses it when the queue is full. A small body (at
    /// most [`INLINE_PREPARE_BYTES`]: a few hundred tokens, tens of microseconds) is prepared
    /// where it is, on the reactor — the hand-off to the blocking pool and back would cost more
    /// than the work.
    #[allow(clippy::too_many_arguments)]
    pub async fn prepare(
        &self,
        preparer: &Arc<Preparer>,
        endpoint: Endpoint,
        body: Bytes,
        caller: Caller,
        limits: PromptLimits,
        rank: u8,
    ) -> Result<Prepared, ApiError> {
        let started = Instant::now();
        if body.len() <= INLINE_PREPARE_BYTES {
            let p = preparer.prepare(endpoint, &body, &caller, limits)?;
            self.record(&p, started);
            return Ok(p);
        }
        let slot = match self.pool.acquire(rank, body.len()).await {
            Ok(s) => s,
            Err(busy) => {
                self.metrics
                    .counter(
                        "kvgate_gateway_tokenizer_refused_total",
                        &[("reason", busy.label())],
                    )
                    .increment(1);
                return Err(ApiError::new(
                    429,
                    "rate_limit_exceeded",
                    "every tokeniser is busy and the queue for them is full; retry shortly",
                )
                .with_code("tokenizer_busy"));
            }
        };
        let preparer = preparer.clone();
        let p = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            preparer.prepare(endpoint, &body, &caller, limits)
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokeniser task failed: {e}")))??;
        self.record(&p, started);
        Ok(p)
    }

    fn record(&self, p: &Prepared, started: Instant) {
        self.metrics.tokenize_seconds.record(p.tokenize_seconds);
        self.metrics
            .route_seconds
            .record(started.elapsed().as_secs_f64());
    }
}
