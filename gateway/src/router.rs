//! From request body to routing decision: parse and validate the OpenAI request, render the chat
//! template and tokenise (segment cache, on the blocking pool), hash the prompt's blocks with the
//! protocol crate's one function, ask the prefix index how much of it each replica holds, and
//! let a route's policy choose. The same path serves `explain`, which returns every
//! intermediate value instead of sending the request.

use std::sync::Arc;
use std::time::Instant;

use policies::{RouteDecision, RouteRequest, RoutingPolicy};
use protocol::hashing::{block_hashes, cacheable_prompt_blocks, root_hash};
use protocol::openai::{ChatCompletionRequest, CompletionRequest, PromptInput};
use protocol::segment_cache::SegmentCache;
use protocol::tokenizer::TextTokenizer;
use protocol::ApiError;
use serde_json::{json, Value};

use crate::metrics::GatewayMetrics;
use crate::policy_store::ActiveRoute;
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

/// A parsed, tokenised, hashed request ready to route.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub endpoint: Endpoint,
    pub stream: bool,
    pub prompt_tokens: usize,
    /// Hashes of every full block of the prompt.
    pub hashes: Vec<u64>,
    /// Leading blocks a replica could serve from cache (the last prompt token is always
    /// computed).
    pub cacheable: usize,
    pub session_id: Option<String>,
    pub tokenize_seconds: f64,
}

pub struct Router {
    pub tokenizer: Arc<TextTokenizer>,
    segments: SegmentCache,
    pub model: String,
    pub block_size: usize,
    pub registry: Arc<Registry>,
    pub metrics: Arc<GatewayMetrics>,
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

    /// Parses, validates, tokenises and hashes (blocking: call from the blocking pool).
    pub fn prepare(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        session_id: Option<String>,
    ) -> Result<Prepared, ApiError> {
        let invalid_json = |e: serde_json::Error| {
            ApiError::invalid_request(format!("invalid JSON body: {e}")).with_code("invalid_json")
        };
        let started = Instant::now();
        let (tokens, stream, salt) = match endpoint {
            Endpoint::Completions => {
                let r: CompletionRequest = serde_json::from_slice(body).map_err(invalid_json)?;
                r.validate()?;
                self.check_model(r.model.as_deref())?;
                // A batch goes to one replica; its first prompt decides where.
                let first = r.prompt.inputs().into_iter().next().ok_or_else(|| {
                    ApiError::invalid_request("prompt must not be empty").with_param("prompt")
                })?;
                let tokens = match first {
                    PromptInput::Text(t) => self.tokenizer.encode(&t, true)?,
                    PromptInput::Tokens(ids) => ids,
                };
                (tokens, r.stream, r.sampling.cache_salt)
            }
            Endpoint::ChatCompletions => {
                let r: ChatCompletionRequest =
                    serde_json::from_slice(body).map_err(invalid_json)?;
                r.validate()?;
                self.check_model(r.model.as_deref())?;
                let text = self.tokenizer.apply_chat_template(
                    &r.messages,
                    r.add_generation_prompt.unwrap_or(true),
                    r.tools.as_deref(),
                    r.chat_template_kwargs.as_ref(),
                )?;
                let tokens = self.segments.encode(&self.tokenizer, &text)?;
                (tokens, r.stream, r.sampling.cache_salt)
            }
        };
        let tokenize_seconds = started.elapsed().as_secs_f64();
        let root = root_hash(&self.model, None, salt.as_deref());
        let hashes = block_hashes(root, &tokens, self.block_size);
        Ok(Prepared {
            endpoint,
            stream,
            prompt_tokens: tokens.len(),
            cacheable: cacheable_prompt_blocks(tokens.len(), self.block_size).min(hashes.len()),
            hashes,
            session_id,
            tokenize_seconds,
        })
    }

    /// Per replica: blocks of the prompt the index believes are cached there.
    pub fn matched(&self, p: &Prepared) -> Vec<usize> {
        self.registry.index.match_lengths(
            &p.hashes[..p.cacheable],
            self.registry.replicas.len(),
            self.registry.now_s(),
            &self.registry.index_ttls(),
        )
    }

    /// Asks `policy` for a replica, never one in `exclude` (outside the route's pool, not
    /// admissible, or already tried for this request).
    pub fn decide_in(
        &self,
        policy: &dyn RoutingPolicy,
        p: &Prepared,
        matched: &[usize],
        exclude: &[usize],
        dry_run: bool,
    ) -> Result<RouteDecision, ApiError> {
        let mut set = self.registry.snapshot();
        for &x in exclude {
            if let Some(r) = set.replicas.get_mut(x) {
                r.healthy = false;
            }
        }
        let req = RouteRequest {
            block_hashes: &p.hashes,
            prompt_tokens: p.prompt_tokens,
            block_size: self.block_size,
            matched_blocks: matched,
            session_id: p.session_id.as_deref(),
            dry_run,
        };
        policy
            .route(&req, &set)
            .map_err(|e| ApiError::unavailable(e.to_string()).with_code("no_healthy_replica"))
    }

    /// Records a decision that will be sent: speculative index insert and metrics.
    pub fn commit(&self, policy: &'static str, p: &Prepared, d: &RouteDecision) {
        self.registry
            .index
            .record_routed(d.replica, &p.hashes, self.registry.now_s());
        self.metrics.decision(policy, d.reason.label());
        if let Some(m) = self.metrics.replicas.get(d.replica) {
            m.prompt_tokens.increment(p.prompt_tokens as u64);
            m.predicted_hit_tokens
                .increment((d.matched_blocks * self.block_size) as u64);
        }
    }

    /// `POST /admin/route/explain`: the decision and everything behind it, nothing sent.
    pub fn explain(&self, p: &Prepared, route: &ActiveRoute) -> Value {
        let set = self.registry.snapshot();
        let matched = self.matched(p);
        let outside: Vec<usize> = (0..set.replicas.len())
            .filter(|i| !route.pool.contains(i))
            .collect();
        let decision = self.decide_in(route.policy.as_ref(), p, &matched, &outside, true);
        let replicas: Vec<Value> = set
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let score = decision
                    .as_ref()
                    .ok()
                    .and_then(|d| d.scores.iter().find(|s| s.replica == i))
                    .map(|s| s.cost);
                json!({
                    "replica": r.name,
                    "healthy": r.healthy,
                    "in_pool": route.pool.contains(&i),
                    "kv_events": self.registry.replicas[i].events_live(),
                    "matched_blocks": matched[i],
                    "predicted_cached_tokens": matched[i] * self.block_size,
                    "load": {
                        "in_flight": r.load.in_flight,
                        "waiting": r.load.waiting,
                        "running": r.load.running,
                        "kv_usage": r.load.kv_usage,
                    },
                    "cost": score,
                })
            })
            .collect();
        json!({
            "route": route.cfg.name,
            "policy": route.policy.name(),
            "prompt_tokens": p.prompt_tokens,
            "block_size": self.block_size,
            "blocks_hashed": p.hashes.len(),
            "cacheable_blocks": p.cacheable,
            "first_block_hashes": p.hashes.iter().take(4).map(|h| format!("{h:016x}")).collect::<Vec<_>>(),
            "tokenize_seconds": p.tokenize_seconds,
            "replicas": replicas,
            "decision": match decision {
                Ok(d) => json!({
                    "replica": set.replicas[d.replica].name,
                    "reason": d.reason.label(),
                    "detail": d.reason.to_string(),
                    "matched_blocks": d.matched_blocks,
                }),
                Err(e) => json!({"error": e.body.error.message}),
            },
        })
    }
}
