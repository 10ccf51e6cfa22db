//! `/v1/completions` and `/v1/chat/completions`: parse and validate, render and tokenise on the
//! blocking pool, submit to the engine, then answer in one body or as an SSE stream. Streaming
//! runs one task per choice; when the client goes away the task's send fails, it drops its
//! request stream and the engine frees the sequence's blocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use protocol::hashing::root_hash;
use protocol::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionRequest, CompletionResponse,
    PromptInput, SamplingFields, Usage,
};
use protocol::sse::{data_event, DONE};
use protocol::time::unix_now;
use protocol::ApiError;
use tokio::sync::mpsc;

use crate::engine::{RequestStream, Submit};
use crate::generate::ChoiceState;
use crate::http_util::{json_response, parse_json, streaming_response, Body};
use crate::sampling::SamplingParams;
use crate::state::AppState;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if m == state.info.served_model_name => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m, &state.info.served_model_name)),
    }
}

/// Refuses a text prompt that certainly does not fit the context, with work bounded by the
/// limit rather than by the text (`protocol::token_bound`).
fn check_fits(
    tok: &protocol::tokenizer::TextTokenizer,
    text: &str,
    limit: usize,
) -> Result<(), ApiError> {
    match tok.check_limit(text, limit)? {
        protocol::token_bound::LimitCheck::MayFit => Ok(()),
        protocol::token_bound::LimitCheck::Exceeds { at_least, .. } => Err(ApiError::invalid_request(
            format!(
                "This model's maximum context length is {limit} tokens; the prompt has at least {at_least}."
            ),
        )
        .with_code("context_length_exceeded")),
    }
}

/// Runs tokenisation (tens of milliseconds for long prompts) on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("tokeniser task failed: {e}")))?
}

/// Parses a body after refusing the fields the replica does not implement (and logprobs on a
/// backend without logits); returns the request and the logprobs it asked for.
fn parse_checked<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: &[u8],
    chat: bool,
) -> Result<(T, Option<usize>), ApiError> {
    let doc: serde_json::Value = parse_json(body)?;
    let map = doc.as_object().ok_or_else(|| {
        ApiError::invalid_request("the body must be a JSON object").with_code("invalid_json")
    })?;
    if chat {
        protocol::openai_fields::check_chat(map)?;
    } else {
        protocol::openai_fields::check_completion(map)?;
    }
    let logprobs = protocol::openai_fields::requested_logprobs(map, chat);
    if logprobs.is_some() && state.info.backend == "sim" {
        return Err(ApiError::invalid_request(
            "logprobs need a backend that computes logits (--backend cpu); the sim has none",
        )
        .with_param("logprobs"));
    }
    let req = serde_json::from_value(doc).map_err(|e| {
        ApiError::invalid_request(format!("invalid request: {e}")).with_code("invalid_json")
    })?;
    Ok((req, logprobs))
}

fn submit_all(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    max_tokens: Option<usize>,
    s: &SamplingFields,
    logprobs: Option<usize>,
) -> Result<Vec<RequestStream>, ApiError> {
    let root = root_hash(&state.info.served_model_name, None, s.cache_salt.as_deref());
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| {
            state.engine.submit(Submit {
                prompt,
                max_tokens,
                priority: s.priority.unwrap_or(0),
                hash_root: root,
                // Each prompt of a batch gets its own stream of "randomness".
                seed: s.seed.map(|x| x.wrapping_add(i as u64)),
                stop_token_ids: state.stop_token_ids.clone(),
                ignore_eos: s.ignore_eos.unwrap_or(false),
                sampling: SamplingParams {
                    temperature: s.temperature.unwrap_or(1.0),
                    top_p: s.top_p.unwrap_or(1.0),
                    top_k: s.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
                    seed: 0,
                    logprobs,
                },
            })
        })
        .collect()
}

/// One choice's part of a stream event: (index, text, whether to send the role, finish
/// reason, log-probabilities).
type ChunkChoice<'a> = (
    u32,
    Option<String>,
    bool,
    Option<&'a str>,
    Option<serde_json::Value>,
);

/// The two response flavours share the generation driver and differ in framing.
#[derive(Clone)]
enum Flavor {
    Completion,
    Chat,
}

#[derive(Clone)]
struct Framing {
    flavor: Flavor,
    id: String,
    created: u64,
    model: String,
}

impl Framing {
    fn new(flavor: Flavor, state: &AppState) -> Self {
        let prefix = match flavor {
            Flavor::Completion => "cmpl",
            Flavor::Chat => "chatcmpl",
        };
        Framing {
            flavor,
            id: format!(
                "{prefix}-{}-{}",
                state.info.replica_id,
                NEXT_ID.fetch_add(1, Ordering::Relaxed)
            ),
            created: unix_now(),
            model: state.info.served_model_name.clone(),
        }
    }

    fn chunk(
        &self,
        index: u32,
        text: Option<String>,
        role: bool,
        finish: Option<&str>,
        logprobs: Option<serde_json::Value>,
    ) -> Bytes {
        self.event(Some((index, text, role, finish, logprobs)), None)
    }

    fn usage_chunk(&self, usage: Usage) -> Bytes {
        self.event(None, Some(usage))
    }

    /// One stream event: a choice's delta, or (with no choice) the closing usage.
    fn event(&self, choice: Option<ChunkChoice<'_>>, usage: Option<Usage>) -> Bytes {
        let finish = |f: Option<&str>| f.map(str::to_string);
        match self.flavor {
            Flavor::Completion => data_event(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: choice
                    .into_iter()
                    .map(|(index, text, _, f, logprobs)| CompletionChoice {
                        index,
                        text: text.unwrap_or_default(),
                        logprobs,
                        finish_reason: finish(f),
                    })
                    .collect(),
                usage,
            }),
            Flavor::Chat => data_event(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.model.clone(),
                choices: choice
                    .into_iter()
                    .map(|(index, text, role, f, logprobs)| ChatChunkChoice {
                        index,
                        delta: ChatDelta {
                            role: role.then(|| "assistant".to_string()),
                            content: text,
                        },
                        logprobs,
                        finish_reason: finish(f),
                    })
                    .collect(),
                usage,
            }),
        }
    }
}

/// Drives one choice to its end, streaming its chunks. Returns its usage, or `None` when the
/// client went away (the stream is dropped, which aborts the sequence).
async fn stream_choice(
    state: Arc<AppState>,
    mut stream: RequestStream,
    mut choice: ChoiceState,
    framing: Framing,
    tx: mpsc::Sender<Bytes>,
) -> Option<Usage> {
    // The chat role chunk goes out with the first token, as vLLM sends it, so the first
    // event a client (or the gateway) sees marks the real time to first token.
    let mut role_pending = matches!(framing.flavor, Flavor::Chat);
    loop {
        let Some(ev) = stream.next().await else {
            let err = ApiError::unavailable("the engine stopped before the request finished");
            let _ = tx.send(data_event(&err.body)).await;
            return None;
        };
        if role_pending {
            role_pending = false;
            let role = framing.chunk(choice.index, Some(String::new()), true, None, None);
            if tx.send(role).await.is_err() {
                return None;
            }
        }
        let delta = match choice.on_event(&state.tokenizer, ev) {
            Ok(d) => d,
            Err(e) => {
                let _ = tx
                    .send(data_event(&ApiError::invalid_request(e.to_string()).body))
                    .await;
                return None;
            }
        };
        if !delta.text.is_empty() || delta.finish_reason.is_some() {
            let text = (!delta.text.is_empty() || matches!(framing.flavor, Flavor::Completion))
                .then_some(delta.text);
            let chat = matches!(framing.flavor, Flavor::Chat);
            let logprobs = choice.take_logprobs(&state.tokenizer, chat);
            let chunk = framing.chunk(choice.index, text, false, delta.finish_reason, logprobs);
            if tx.send(chunk).await.is_err() {
                return None;
            }
        }
        if choice.is_finished() {
            return Some(choice.usage());
        }
    }
}

fn stream_response(
    state: Arc<AppState>,
    streams: Vec<RequestStream>,
    choices: Vec<ChoiceState>,
    framing: Framing,
    include_usage: bool,
) -> Response<Body> {
    let (tx, resp) = streaming_response("text/event-stream");
    tokio::spawn(async move {
        let tasks: Vec<_> = streams
            .into_iter()
            .zip(choices)
            .map(|(s, c)| {
                tokio::spawn(stream_choice(
                    state.clone(),
                    s,
                    c,
                    framing.clone(),
                    tx.clone(),
                ))
            })
            .collect();
        let mut total = Usage::new(0, 0, 0);
        let mut complete = true;
        for t in tasks {
            match t.await {
                Ok(Some(u)) => total.add(&u),
                _ => complete = false,
            }
        }
        if complete {
            if include_usage {
                let _ = tx.send(framing.usage_chunk(total)).await;
            }
            let _ = tx.send(Bytes::from_static(DONE)).await;
        }
    });
    resp
}

/// Collects one choice completely (non-streaming).
async fn collect_choice(
    state: Arc<AppState>,
    mut stream: RequestStream,
    mut choice: ChoiceState,
) -> Result<ChoiceState, ApiError> {
    while !choice.is_finished() {
        let ev = stream.next().await.ok_or_else(|| {
            ApiError::unavailable("the engine stopped before the request finished")
        })?;
        choice
            .on_event(&state.tokenizer, ev)
            .map_err(|e| ApiError::invalid_request(e.to_string()))?;
    }
    Ok(choice)
}

async fn collect_all(
    state: &Arc<AppState>,
    streams: Vec<RequestStream>,
    choices: Vec<ChoiceState>,
) -> Result<Vec<ChoiceState>, ApiError> {
    let futs = streams
        .into_iter()
        .zip(choices)
        .map(|(s, c)| collect_choice(state.clone(), s, c));
    futures::future::join_all(futs).await.into_iter().collect()
}

pub async fn completions(state: Arc<AppState>, body: &[u8]) -> Result<Response<Body>, ApiError> {
    let (req, logprobs): (CompletionRequest, _) = parse_checked(&state, body, false)?;
    req.validate()?;
    check_model(&state, req.model.as_deref())?;
    let tok = state.tokenizer.clone();
    let inputs = req.prompt.inputs();
    let limit = state.info.max_model_len;
    let prompts = blocking(move || {
        inputs
            .into_iter()
            .map(|input| match input {
                PromptInput::Text(t) => {
                    check_fits(&tok, &t, limit)?;
                    tok.encode(&t, true).map_err(ApiError::from)
                }
                PromptInput::Tokens(ids) => {
                    if let Some(bad) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
                        Err(ApiError::invalid_request(format!(
                            "token id {bad} is outside the vocabulary of {} tokens",
                            tok.vocab_size()
                        ))
                        .with_param("prompt"))
                    } else {
                        Ok(ids)
                    }
                }
            })
            .collect::<Result<Vec<_>, _>>()
    })
    .await?;
    // OpenAI's default for the legacy completions endpoint.
    let max_tokens = Some(req.max_tokens.unwrap_or(16) as usize);
    let stops = req.sampling.stop_strings();
    let choices: Vec<ChoiceState> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let c = ChoiceState::new(i as u32, stops.clone(), p.len());
            if logprobs.is_some() {
                c.with_logprobs()
            } else {
                c
            }
        })
        .collect();
    let streams = submit_all(&state, prompts, max_tokens, &req.sampling, logprobs)?;
    let framing = Framing::new(Flavor::Completion, &state);
    if req.stream {
        return Ok(stream_response(
            state,
            streams,
            choices,
            framing,
            req.include_usage(),
        ));
    }
    let mut done = collect_all(&state, streams, choices).await?;
    let mut usage = Usage::new(0, 0, 0);
    let choices = done
        .iter_mut()
        .map(|c| {
            usage.add(&c.usage());
            CompletionChoice {
                index: c.index,
                text: c.text().to_string(),
                logprobs: c.take_logprobs(&state.tokenizer, false),
                finish_reason: c.finish_reason.map(str::to_string),
            }
        })
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &CompletionResponse {
            id: framing.id,
            object: "text_completion".into(),
            created: framing.created,
            model: framing.model,
            choices,
            usage: Some(usage),
        },
    ))
}

pub async fn chat_completions(
    state: Arc<AppState>,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let (req, logprobs): (ChatCompletionRequest, _) = parse_checked(&state, body, true)?;
    req.validate()?;
    check_model(&state, req.model.as_deref())?;
    let tok = state.tokenizer.clone();
    let r = req.clone();
    let limit = state.info.max_model_len;
    let prompt = blocking(move || {
        let text = tok.apply_chat_template(
            &r.messages,
            r.add_generation_prompt.unwrap_or(true),
            r.tools.as_deref(),
            r.chat_template_kwargs.as_ref(),
        )?;
        check_fits(&tok, &text, limit)?;
        Ok(tok.encode(&text, false)?)
    })
    .await?;
    if prompt.is_empty() {
        return Err(
            ApiError::invalid_request("the rendered prompt is empty").with_param("messages")
        );
    }
    let mut choice = ChoiceState::new(0, req.sampling.stop_strings(), prompt.len());
    if logprobs.is_some() {
        choice = choice.with_logprobs();
    }
    let streams = submit_all(
        &state,
        vec![prompt],
        req.max_tokens().map(|m| m as usize),
        &req.sampling,
        logprobs,
    )?;
    let framing = Framing::new(Flavor::Chat, &state);
    if req.stream {
        return Ok(stream_response(
            state,
            streams,
            vec![choice],
            framing,
            req.include_usage(),
        ));
    }
    let mut done = collect_all(&state, streams, vec![choice]).await?;
    let mut c = done.remove(0);
    let logprobs = c.take_logprobs(&state.tokenizer, true);
    Ok(json_response(
        StatusCode::OK,
        &ChatCompletionResponse {
            id: framing.id,
            object: "chat.completion".into(),
            created: framing.created,
            model: framing.model,
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant".into(),
                    content: Some(c.text().to_string()),
                },
                logprobs,
                finish_reason: c.finish_reason.map(str::to_string),
            }],
            usage: c.usage(),
        },
    ))
}
