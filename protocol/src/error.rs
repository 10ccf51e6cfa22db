//! OpenAI-shaped errors: every error a client can cause maps to an HTTP status and a body of the
//! form `{"error": {"message", "type", "param", "code"}}`, which every OpenAI SDK understands.

use serde::{Deserialize, Serialize};

/// The JSON body OpenAI returns for an error.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
}

/// An error with the HTTP status it is answered with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {}", body.error.message)]
pub struct ApiError {
    pub status: u16,
    pub body: ErrorBody,
}

impl ApiError {
    pub fn new(status: u16, kind: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            body: ErrorBody {
                error: ErrorDetail {
                    message: message.into(),
                    kind: kind.to_string(),
                    param: None,
                    code: None,
                },
            },
        }
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.body.error.param = Some(param.to_string());
        self
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.body.error.code = Some(code.to_string());
        self
    }

    /// 400: the request is malformed or asks for something this server does not do.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }

    /// 404: the model named in the request is not served here.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            format!("The model `{model}` does not exist; this server serves `{served}`."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 404: `model` is none of the `served` names (each model's name and aliases).
    pub fn model_not_found_among(model: &str, served: &[&str]) -> Self {
        let names: Vec<String> = served.iter().map(|n| format!("`{n}`")).collect();
        let list = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.concat(),
        };
        Self::new(
            404,
            "invalid_request_error",
            format!("The model `{model}` does not exist; this server serves {list}."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 400: the prompt (plus the requested completion) does not fit the model's context.
    pub fn context_length_exceeded(requested: usize, prompt: usize, max_model_len: usize) -> Self {
        Self::invalid_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, you requested \
             {requested} tokens ({prompt} in the prompt, {} for the completion). Please reduce the \
             prompt or the completion length.",
            requested.saturating_sub(prompt)
        ))
        .with_code("context_length_exceeded")
    }

    /// 413: the body is larger than the server accepts.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            format!("Request body exceeds the limit of {limit} bytes."),
        )
        .with_code("payload_too_large")
    }

    /// 404 for a path this server does not serve.
    pub fn not_found_path(path: &str) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            format!("No route for `{path}`."),
        )
        .with_code("not_found")
    }

    /// 405 for a known path called with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            "invalid_request_error",
            format!("Method {method} is not allowed on `{path}`."),
        )
    }

    /// 503: the server cannot take the request now (shutting down, engine gone).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, "service_unavailable", message)
    }

    /// 500: a bug or an internal failure; the message says which.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal_error", message)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.body).unwrap_or_else(|_| {
            "{\"error\":{\"message\":\"unserialisable error\",\"type\":\"internal_error\"}}"
                .to_string()
        })
    }
}
