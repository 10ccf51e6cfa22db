//! OpenAI request and response types for `/v1/completions` and `/v1/chat/completions`, with the
//! vLLM extensions operators rely on (`priority`, `cache_salt`, `ignore_eos`). Unknown fields are
//! ignored (routers such as sglang-router add their own); what we cannot honour, such as `n > 1`,
//! is rejected by [`CompletionRequest::validate`] / [`ChatCompletionRequest::validate`] with a
//! clear 400 rather than silently answered differently.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ApiError;

/// `prompt` of a completion request: text, a batch of texts, token ids or a batch of token ids.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

/// One prompt of a (possibly batched) completion request.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Splits a batched prompt into its members, in order.
    pub fn inputs(&self) -> Vec<PromptInput> {
        match self {
            Prompt::Text(t) => vec![PromptInput::Text(t.clone())],
            Prompt::Texts(ts) => ts.iter().cloned().map(PromptInput::Text).collect(),
            Prompt::Tokens(ids) => vec![PromptInput::Tokens(ids.clone())],
            Prompt::TokenBatches(b) => b.iter().cloned().map(PromptInput::Tokens).collect(),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn strings(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

/// Sampling and scheduling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SamplingFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// vLLM extension: sample from the k most likely tokens only (0 or -1: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    /// vLLM extension: lower values are scheduled first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// vLLM extension: isolates this request's prefix cache from other tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    /// vLLM extension: keep generating to `max_tokens` even past end-of-sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
}

impl SamplingFields {
    fn validate(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid_request(format!(
                    "n={n} is not supported: kvgate returns exactly one choice per prompt (n must be 1)"
                ))
                .with_param("n"));
            }
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) || t.is_nan() {
                return Err(ApiError::invalid_request(format!(
                    "temperature must be between 0 and 2, got {t}"
                ))
                .with_param("temperature"));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(
                    ApiError::invalid_request(format!("top_p must be in (0, 1], got {p}"))
                        .with_param("top_p"),
                );
            }
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ApiError::invalid_request(format!(
                    "top_k must be -1 or 0 (off) or a positive number of tokens, got {k}"
                ))
                .with_param("top_k"));
            }
        }
        if let Some(Stop::Many(v)) = &self.stop {
            if v.len() > 4 {
                return Err(
                    ApiError::invalid_request("at most 4 stop sequences are allowed")
                        .with_param("stop"),
                );
            }
        }
        if self.stop_strings().iter().any(|s| s.is_empty()) {
            return Err(
                ApiError::invalid_request("stop sequences must not be empty").with_param("stop"),
            );
        }
        Ok(())
    }

    pub fn stop_strings(&self) -> Vec<String> {
        self.stop.as_ref().map(Stop::strings).unwrap_or_default()
    }
}

fn validate_max_tokens(value: Option<u32>, param: &str) -> Result<(), ApiError> {
    if value == Some(0) {
        return Err(
            ApiError::invalid_request(format!("{param} must be at least 1")).with_param(param),
        );
    }
    Ok(())
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

impl CompletionRequest {
    pub fn validate(&self) -> Result<(), ApiError> {
        self.sampling.validate()?;
        validate_max_tokens(self.max_tokens, "max_tokens")?;
        let empty = match &self.prompt {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Texts(ts) => ts.is_empty() || ts.iter().any(String::is_empty),
            Prompt::Tokens(ids) => ids.is_empty(),
            Prompt::TokenBatches(b) => b.is_empty() || b.iter().any(Vec::is_empty),
        };
        if empty {
            return Err(ApiError::invalid_request("prompt must not be empty").with_param("prompt"));
        }
        Ok(())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `content` of a chat message: a string or a list of typed parts.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

impl MessageContent {
    /// The text of the message; parts are joined without a separator, as vLLM does for text
    /// parts. Non-text parts are an error: a text-only model cannot see them.
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            MessageContent::Text(t) => Ok(t.clone()),
            MessageContent::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid_request(
                                "a content part of type `text` needs a `text` field",
                            )
                            .with_param("messages"))
                        }
                        (other, _) => {
                            return Err(ApiError::invalid_request(format!(
                                "content parts of type `{other}` are not supported by this text-only model"
                            ))
                            .with_param("messages"))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: Some(MessageContent::Text(content.to_string())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatCompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// vLLM extension: extra variables for the chat template (e.g. `enable_thinking`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM extension, default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

impl ChatCompletionRequest {
    pub fn validate(&self) -> Result<(), ApiError> {
        self.sampling.validate()?;
        validate_max_tokens(self.max_tokens, "max_tokens")?;
        validate_max_tokens(self.max_completion_tokens, "max_completion_tokens")?;
        if self.messages.is_empty() {
            return Err(
                ApiError::invalid_request("messages must not be empty").with_param("messages")
            );
        }
        if let Some(tools) = &self.tools {
            crate::openai_tools::validate_tools(tools)?;
        }
        Ok(())
    }

    /// `max_completion_tokens` wins over the deprecated `max_tokens`, as in OpenAI's API.
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }

    pub fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details
            .as_ref()
            .map_or(0, |d| d.cached_tokens)
    }

    /// Sums the usage of several choices (a batched completion request).
    pub fn add(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.total_tokens += other.total_tokens;
        let cached = self.cached_tokens() + other.cached_tokens();
        self.prompt_tokens_details = Some(PromptTokensDetails {
            cached_tokens: cached,
        });
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<String>,
}

/// Both the full `text_completion` response and each streamed chunk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AssistantMessage {
    pub role: String,
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// `{"content": [{token, logprob, bytes, top_logprobs}]}` when the request asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Value>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Value>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// The model id in a `GET /v1/models/{id}` path, `%XX` escapes decoded (Hugging Face ids
/// contain `/`, which clients may escape); `None` for any other path or an empty id.
pub fn model_id_in_path(path: &str) -> Option<String> {
    let raw = path.strip_prefix("/v1/models/")?;
    if raw.is_empty() {
        return None;
    }
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    Some(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_come_out_of_paths_decoded() {
        assert_eq!(
            model_id_in_path("/v1/models/Qwen3-8B").as_deref(),
            Some("Qwen3-8B")
        );
        assert_eq!(
            model_id_in_path("/v1/models/HuggingFaceTB%2FSmolLM2").as_deref(),
            Some("HuggingFaceTB/SmolLM2")
        );
        assert_eq!(model_id_in_path("/v1/models/a/b").as_deref(), Some("a/b"));
        assert_eq!(model_id_in_path("/v1/models/"), None);
        assert_eq!(model_id_in_path("/v1/model"), None);
    }

    #[test]
    fn parses_every_prompt_shape() {
        for (body, n) in [
            (r#"{"prompt":"hi"}"#, 1),
            (r#"{"prompt":["a","b"]}"#, 2),
            (r#"{"prompt":[1,2,3]}"#, 1),
            (r#"{"prompt":[[1,2],[3]]}"#, 2),
        ] {
            let r: CompletionRequest = serde_json::from_str(body).unwrap();
            assert_eq!(r.prompt.inputs().len(), n, "{body}");
        }
    }

    #[test]
    fn ignores_unknown_fields_and_reads_extensions() {
        let r: ChatCompletionRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "max_completion_tokens":7,"max_tokens":3,"rid":"sglang-added","priority":-1,
                "stream":true,"stream_options":{"include_usage":true},"seed":4,"stop":"x"}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens(), Some(7));
        assert_eq!(r.sampling.priority, Some(-1));
        assert!(r.include_usage());
        assert_eq!(
            r.messages[0].content.as_ref().unwrap().text().unwrap(),
            "ab"
        );
        r.validate().unwrap();
    }

    #[test]
    fn rejects_n_above_one_and_empty_prompts() {
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":"x","n":2}"#).unwrap();
        let e = r.validate().unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.body.error.param.as_deref(), Some("n"));
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":""}"#).unwrap();
        assert_eq!(r.validate().unwrap_err().status, 400);
        let r: ChatCompletionRequest = serde_json::from_str(r#"{"messages":[]}"#).unwrap();
        assert_eq!(r.validate().unwrap_err().status, 400);
    }

    #[test]
    fn usage_serialises_cached_tokens() {
        let u = Usage::new(10, 2, 8);
        let v = serde_json::to_value(&u).unwrap();
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(v["total_tokens"], 12);
    }
}
