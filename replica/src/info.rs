//! The replica's non-generating endpoints: `/v1/models`, vLLM's `/tokenize` and `/detokenize`,
//! the KV event stream, and the worker endpoints sglang-router polls (`/server_info`,
//! `/model_info`, `/get_load`).

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use protocol::openai::{ChatMessage, ModelCard, ModelList};
use protocol::ApiError;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;

use crate::http_util::{json_response, parse_json, streaming_response, Body};
use crate::state::AppState;

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.info.served_model_name.clone(),
        object: "model".into(),
        created: state.info.created,
        owned_by: "kvgate".into(),
        max_model_len: Some(state.info.max_model_len),
    }
}

pub fn models(state: &AppState) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &ModelList {
            object: "list".into(),
            data: vec![card(state)],
        },
    )
}

/// `GET /v1/models/{id}`: the served model's card, or OpenAI's 404 for any other id.
pub fn model(state: &AppState, id: &str) -> Result<Response<Body>, protocol::ApiError> {
    if id != state.info.served_model_name {
        return Err(protocol::ApiError::model_not_found(
            id,
            &state.info.served_model_name,
        ));
    }
    Ok(json_response(StatusCode::OK, &card(state)))
}

#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    /// Tools the chat template renders (as in a chat completion).
    #[serde(default)]
    tools: Option<Vec<serde_json::Value>>,
    /// Extra variables for the chat template (as in a chat completion).
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    return_token_strs: bool,
}

#[derive(Serialize)]
struct TokenizeResponse {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    token_strs: Option<Vec<String>>,
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.info.served_model_name => {
            Err(ApiError::model_not_found(m, &state.info.served_model_name))
        }
        _ => Ok(()),
    }
}

pub async fn tokenize(state: Arc<AppState>, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let req: TokenizeRequest = parse_json(body)?;
    check_model(&state, req.model.as_deref())?;
    let tok = state.tokenizer.clone();
    let tokens = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        match (&req.prompt, &req.messages) {
            (Some(p), None) => Ok(tok.encode(p, req.add_special_tokens.unwrap_or(true))?),
            (None, Some(m)) => {
                let text = tok.apply_chat_template(
                    m,
                    req.add_generation_prompt.unwrap_or(true),
                    req.tools.as_deref(),
                    req.chat_template_kwargs.as_ref(),
                )?;
                Ok(tok.encode(&text, req.add_special_tokens.unwrap_or(false))?)
            }
            _ => Err(ApiError::invalid_request(
                "give exactly one of `prompt` or `messages`",
            )),
        }
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let token_strs = req.return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&t| state.tokenizer.id_to_token(t).unwrap_or_default())
            .collect()
    });
    Ok(json_response(
        StatusCode::OK,
        &TokenizeResponse {
            count: tokens.len(),
            max_model_len: state.info.max_model_len,
            tokens,
            token_strs,
        },
    ))
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn detokenize(state: Arc<AppState>, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let req: DetokenizeRequest = parse_json(body)?;
    check_model(&state, req.model.as_deref())?;
    let text = state.tokenizer.decode(&req.tokens, false)?;
    Ok(json_response(StatusCode::OK, &json!({ "prompt": text })))
}

/// `GET /kv_events`: the snapshot frame, then every later batch, until the client leaves or
/// falls too far behind (then the stream ends and the client must resubscribe).
pub fn kv_events(state: &AppState) -> Response<Body> {
    let (snapshot, mut rx) = state.hub.subscribe();
    let (tx, resp) = streaming_response("application/vnd.kvgate.kv-events");
    let replica = state.info.replica_id.clone();
    let closed = state.hub.closed();
    tokio::spawn(async move {
        tokio::pin!(closed);
        if tx.send(snapshot).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                r = rx.recv() => r,
                // Shutting down: end the stream so the connection can drain.
                _ = &mut closed => return,
            };
            let frame: Bytes = match next {
                Ok(f) => f,
                Err(RecvError::Lagged(n)) => {
                    tracing::warn!(%replica, missed = n, "KV event subscriber lagged; closing its stream");
                    return;
                }
                Err(RecvError::Closed) => return,
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    resp
}

pub fn server_info(state: &AppState) -> Response<Body> {
    let i = &state.info;
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": i.served_model_name,
            "served_model_name": i.served_model_name,
            "tokenizer_path": i.tokenizer_dir,
            "replica_id": i.replica_id,
            "backend": i.backend,
            "model_profile": i.model_profile,
            "gpu": i.gpu,
            "page_size": i.block_size,
            "block_size": i.block_size,
            "num_gpu_blocks": i.num_blocks,
            "max_total_num_tokens": i.num_blocks * i.block_size,
            "max_running_requests": i.max_num_seqs,
            "chunked_prefill_size": i.max_num_batched_tokens,
            "max_model_len": i.max_model_len,
            "context_length": i.max_model_len,
            "kv_cache_dtype": i.kv_cache_dtype,
            "enable_prefix_caching": i.enable_prefix_caching,
            // The scheduler admits a prompt whose next uncached block another request is
            // computing only once that block is computed (`scheduler.rs`).
            "waits_for_prefix_in_flight": i.waits_for_prefix_in_flight,
            "dp_size": 1,
            "tp_size": 1,
            "prefill_tokens_per_s": i.prefill_tokens_per_s,
            "roofline": i.sim_timing,
            "version": env!("CARGO_PKG_VERSION"),
        }),
    )
}

pub fn model_info(state: &AppState) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({
            "model_path": state.info.served_model_name,
            "tokenizer_path": state.info.tokenizer_dir,
            "is_generation": true,
        }),
    )
}

/// SGLang's load report: one entry per data-parallel rank.
pub fn get_load(state: &AppState) -> Response<Body> {
    let s = state.engine.stats();
    use std::sync::atomic::Ordering::Relaxed;
    let waiting = s.waiting.load(Relaxed);
    let running = s.running.load(Relaxed);
    json_response(
        StatusCode::OK,
        &json!([{
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_running_reqs": running,
            "num_tokens": s.running_tokens.load(Relaxed),
            "max_total_num_tokens": state.engine.limits().num_blocks * state.engine.limits().block_size,
            "kv_cache_usage": s.kv_usage(),
            "preemptions": s.preemptions.load(Relaxed),
            "generation_tokens": s.generated.load(Relaxed),
            "busy_seconds": s.busy_us.load(Relaxed) as f64 / 1e6,
            "model_flops": s.model_mflop.load(Relaxed) as f64 * 1e6,
            "peak_flops": s.peak_flops(),
        }]),
    )
}
