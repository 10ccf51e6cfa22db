//! Turning a request's token stream into OpenAI text: incremental detokenisation, stop
//! strings (matched across token boundaries, with enough text held back that a partial match is
//! never streamed), finish reasons and usage. Runs in the request's own task, off the engine
//! loop, so detokenising never delays a step.

use std::sync::Arc;

use protocol::openai::Usage;
use protocol::tokenizer::{IncrementalDecoder, TextTokenizer, TokenizerError};
use serde_json::{json, Value};

use crate::engine::EngineEvent;
use crate::sampling::TokenLogprobs;
use crate::scheduler::FinishReason;

/// Text and state of one choice.
pub struct ChoiceState {
    pub index: u32,
    decoder: IncrementalDecoder,
    stops: Vec<String>,
    holdback: usize,
    text: String,
    sent: usize,
    pub completion_tokens: u32,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub finish_reason: Option<&'static str>,
    /// Each generated token with its log-probabilities, when the request asked for them.
    logprobs: Option<Vec<(u32, Arc<TokenLogprobs>)>>,
    /// Entries of `logprobs` already sent in stream chunks.
    logprobs_sent: usize,
}

/// Why a choice's text cannot go on; the request ends and the client is told this message.
#[derive(Debug, thiserror::Error)]
pub enum ChoiceError {
    /// The engine could not run the request (its message, as the engine gave it).
    #[error("{0}")]
    EngineFailed(String),
    /// A generated token could not be turned into text.
    #[error(transparent)]
    Detokenize(#[from] TokenizerError),
}

/// What one engine event adds to the choice.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    pub text: String,
    pub finish_reason: Option<&'static str>,
}

impl ChoiceState {
    pub fn new(index: u32, stops: Vec<String>, prompt_tokens: usize) -> Self {
        let holdback = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        ChoiceState {
            index,
            decoder: IncrementalDecoder::new(),
            stops,
            holdback,
            text: String::new(),
            sent: 0,
            completion_tokens: 0,
            prompt_tokens: prompt_tokens as u32,
            cached_tokens: 0,
            finish_reason: None,
            logprobs: None,
            logprobs_sent: 0,
        }
    }

    /// Collects each token's log-probabilities (the request asked for them).
    pub fn with_logprobs(mut self) -> Self {
        self.logprobs = Some(Vec::new());
        self
    }

    /// The log-probabilities not yet sent, in OpenAI's chat (`{"content": [...]}`) or
    /// completions (`{"tokens", "token_logprobs", "top_logprobs"}`) shape.
    pub fn take_logprobs(&mut self, tok: &TextTokenizer, chat: bool) -> Option<Value> {
        let all = self.logprobs.as_ref()?;
        let new = &all[self.logprobs_sent..];
        self.logprobs_sent = all.len();
        Some(render_logprobs(tok, new, chat))
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// Full text generated so far (after stop-string truncation once finished).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
        )
    }

    /// Consumes one engine event. An `Err` is a failure to report to the client.
    pub fn on_event(&mut self, tok: &TextTokenizer, ev: EngineEvent) -> Result<Delta, ChoiceError> {
        let (token, finish, prompt_tokens, cached) = match ev {
            EngineEvent::Token {
                token,
                finish,
                prompt_tokens,
                cached_tokens,
                logprobs,
            } => {
                if let (Some(all), Some(lp)) = (self.logprobs.as_mut(), logprobs) {
                    all.push((token, lp));
                }
                (token, finish, prompt_tokens, cached_tokens)
            }
            EngineEvent::Failed(msg) => return Err(ChoiceError::EngineFailed(msg)),
        };
        self.completion_tokens += 1;
        self.prompt_tokens = prompt_tokens as u32;
        self.cached_tokens = cached as u32;
        let piece = self.decoder.step(tok, token)?;
        self.text.push_str(&piece);
        // A stop string may straddle the previous piece: search from where it could start.
        if !self.stops.is_empty() {
            let from = floor_boundary(&self.text, self.sent.saturating_sub(self.holdback));
            let hit = self
                .stops
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
                .min();
            if let Some(pos) = hit {
                self.text.truncate(pos);
                return Ok(self.finish_with("stop"));
            }
        }
        if let Some(f) = finish {
            let reason = match f {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            };
            return Ok(self.finish_with(reason));
        }
        let safe = floor_boundary(&self.text, self.text.len().saturating_sub(self.holdback));
        let out = if safe > self.sent {
            let d = self.text[self.sent..safe].to_string();
            self.sent = safe;
            d
        } else {
            String::new()
        };
        Ok(Delta {
            text: out,
            finish_reason: None,
        })
    }

    fn finish_with(&mut self, reason: &'static str) -> Delta {
        self.finish_reason = Some(reason);
        let rest = if self.text.len() > self.sent {
            self.text[self.sent..].to_string()
        } else {
            String::new()
        };
        self.sent = self.text.len();
        Delta {
            text: rest,
            finish_reason: Some(reason),
        }
    }
}

fn piece(tok: &TextTokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

fn render_logprobs(
    tok: &TextTokenizer,
    entries: &[(u32, Arc<TokenLogprobs>)],
    chat: bool,
) -> Value {
    if chat {
        let content: Vec<Value> = entries
            .iter()
            .map(|(id, lp)| {
                let t = piece(tok, *id);
                json!({
                    "token": t, "logprob": lp.logprob, "bytes": t.as_bytes(),
                    "top_logprobs": lp.top.iter().map(|(alt, l)| {
                        let a = piece(tok, *alt);
                        json!({"token": a, "logprob": l, "bytes": a.as_bytes()})
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({ "content": content, "refusal": null })
    } else {
        let tokens: Vec<String> = entries.iter().map(|(id, _)| piece(tok, *id)).collect();
        let token_logprobs: Vec<f32> = entries.iter().map(|(_, lp)| lp.logprob).collect();
        let top: Vec<Value> = entries
            .iter()
            .map(|(_, lp)| {
                let m: serde_json::Map<String, Value> = lp
                    .top
                    .iter()
                    .map(|(alt, l)| (piece(tok, *alt), json!(l)))
                    .collect();
                Value::Object(m)
            })
            .collect();
        let mut offset = 0;
        let text_offset: Vec<usize> = tokens
            .iter()
            .map(|t| {
                let o = offset;
                offset += t.len();
                o
            })
            .collect();
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
