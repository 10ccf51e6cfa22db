//! Which request fields an engine that implements them may accept. kvgate's replica refuses
//! every field it does not implement with a 400 that names it, rather than ignore it: a client
//! asking for JSON output, a forced tool call or a penalty must learn that it will not get it.
//! Fields whose value asks for nothing (a zero penalty, `tool_choice: "auto"`, an empty
//! `logit_bias`, `response_format: {"type": "text"}`) pass. The gateway does not apply these
//! rules: the engines behind it (vLLM, SGLang) implement more.

use serde_json::{Map, Value};

use crate::ApiError;

/// Fields both endpoints take: implemented, or carrying no request for behaviour.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "user",
    "n",
    "priority",
    "cache_salt",
    "ignore_eos",
    "logprobs",
    // Request ids that routers add for their own bookkeeping (sglang-router's `rid`).
    "rid",
    "request_id",
];

/// Fields only chat completions take.
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "add_generation_prompt",
    "top_logprobs",
    "metadata",
    "store",
    "service_tier",
];

/// Fields only (legacy) completions take.
const COMPLETION_FIELDS: &[&str] = &["prompt"];

/// Fields that may be present with a value that asks for nothing.
fn inert(key: &str, v: &Value) -> bool {
    match key {
        "presence_penalty" | "frequency_penalty" => v.as_f64() == Some(0.0),
        "repetition_penalty" => v.as_f64() == Some(1.0),
        "min_p" => v.as_f64() == Some(0.0),
        "logit_bias" => v.as_object().is_some_and(Map::is_empty),
        "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
        "modalities" => v.as_array().is_some_and(|a| a == &[Value::from("text")]),
        "echo" | "return_logprob" => v.as_bool() == Some(false),
        // sglang-router re-serialises every request with SGLang's defaults: at those values
        // they ask for nothing kvgate does not do (it skips special tokens when detokenising
        // and has no reasoning parser to separate or stream).
        "no_stop_trim" | "continue_final_message" | "return_hidden_states" => {
            v.as_bool() == Some(false)
        }
        "skip_special_tokens"
        | "spaces_between_special_tokens"
        | "separate_reasoning"
        | "stream_reasoning" => v.as_bool() == Some(true),
        "best_of" => v.as_u64() == Some(1),
        "suffix" => v.as_str().is_some_and(str::is_empty),
        _ => false,
    }
}

fn refuse(key: &str, v: &Value) -> ApiError {
    let what = match key {
        "response_format" => "structured output (response_format) is not supported".to_string(),
        "presence_penalty" | "frequency_penalty" | "repetition_penalty" => {
            format!("{key} is not supported (only 0, or 1 for repetition_penalty)")
        }
        "logit_bias" => "logit_bias is not supported".into(),
        "functions" | "function_call" => {
            format!("`{key}` (the legacy function-calling API) is not supported; use `tools`")
        }
        _ => format!("the field `{key}` is not supported by this server (value {v})"),
    };
    ApiError::invalid_request(what).with_param(key)
}

fn check(doc: &Map<String, Value>, allowed: &[&str]) -> Result<(), ApiError> {
    for (k, v) in doc {
        let known = COMMON_FIELDS.contains(&k.as_str()) || allowed.contains(&k.as_str());
        if v.is_null() || known || inert(k, v) {
            continue;
        }
        return Err(refuse(k, v));
    }
    Ok(())
}

/// Roles a chat may use.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Checks a `/v1/chat/completions` body for fields and values the replica does not implement.
pub fn check_chat(doc: &Map<String, Value>) -> Result<(), ApiError> {
    check(doc, CHAT_FIELDS)?;
    match doc.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "none" || s == "auto" => {}
        Some(v) => {
            return Err(ApiError::invalid_request(format!(
                "tool_choice {v} is not supported: the model may call tools (\"auto\") or not (\"none\"), but a call cannot be forced"
            ))
            .with_param("tool_choice"))
        }
    }
    if let Some(msgs) = doc.get("messages").and_then(Value::as_array) {
        for (i, m) in msgs.iter().enumerate() {
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                if !ROLES.contains(&role) {
                    return Err(ApiError::invalid_request(format!(
                        "messages[{i}].role `{role}` is not one of {}",
                        ROLES.join(", ")
                    ))
                    .with_param("messages"));
                }
            }
        }
    }
    match doc.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(_) => {
            return Err(
                ApiError::invalid_request("logprobs must be true or false").with_param("logprobs")
            )
        }
    }
    if let Some(t) = doc.get("top_logprobs").filter(|v| !v.is_null()) {
        match t.as_u64() {
            Some(n) if n <= 20 => {
                if doc.get("logprobs").and_then(Value::as_bool) != Some(true) {
                    return Err(ApiError::invalid_request(
                        "top_logprobs needs logprobs set to true",
                    )
                    .with_param("top_logprobs"));
                }
            }
            _ => {
                return Err(ApiError::invalid_request(
                    "top_logprobs must be an integer between 0 and 20",
                )
                .with_param("top_logprobs"))
            }
        }
    }
    Ok(())
}

/// Checks a `/v1/completions` body likewise.
pub fn check_completion(doc: &Map<String, Value>) -> Result<(), ApiError> {
    check(doc, COMPLETION_FIELDS)?;
    if let Some(l) = doc.get("logprobs").filter(|v| !v.is_null()) {
        if l.as_u64().is_none_or(|n| n > 20) {
            return Err(ApiError::invalid_request(
                "logprobs must be an integer between 0 and 20 (alternatives per token)",
            )
            .with_param("logprobs"));
        }
    }
    Ok(())
}

/// The number of alternatives a request asked for: `None` when it asked for no logprobs.
pub fn requested_logprobs(doc: &Map<String, Value>, chat: bool) -> Option<usize> {
    if chat {
        (doc.get("logprobs").and_then(Value::as_bool) == Some(true))
            .then(|| doc.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0) as usize)
    } else {
        doc.get("logprobs")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn unimplemented_fields_are_named() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert!(check_chat(&obj(base.clone())).is_ok());
        for (k, v, needle) in [
            (
                "response_format",
                json!({"type": "json_object"}),
                "response_format",
            ),
            ("tool_choice", json!("required"), "tool_choice"),
            ("presence_penalty", json!(0.5), "presence_penalty"),
            ("logit_bias", json!({"50256": -100}), "logit_bias"),
            ("frobnicate", json!(1), "frobnicate"),
            ("logprobs", json!(3), "logprobs"),
        ] {
            let mut d = obj(base.clone());
            d.insert(k.into(), v);
            let e = check_chat(&d).unwrap_err();
            let body = serde_json::to_string(&e.body).unwrap();
            assert!(body.contains(needle), "{k}: {body}");
            assert_eq!(e.status, 400);
        }
        let mut d = obj(base.clone());
        d.insert(
            "messages".into(),
            json!([{"role": "wizard", "content": "x"}]),
        );
        assert!(check_chat(&d).is_err());
        for (k, v) in [
            ("response_format", json!({"type": "text"})),
            ("presence_penalty", json!(0)),
            ("tool_choice", json!("auto")),
            ("logprobs", json!(true)),
        ] {
            let mut d = obj(base.clone());
            d.insert(k.into(), v);
            assert!(check_chat(&d).is_ok(), "{k}");
        }
        let mut d = obj(base);
        d.insert("top_logprobs".into(), json!(2));
        assert!(check_chat(&d).is_err(), "top_logprobs without logprobs");
        d.insert("logprobs".into(), json!(true));
        assert_eq!(requested_logprobs(&d, true), Some(2));
    }

    #[test]
    fn what_sglang_router_adds_passes() {
        // The bodies sglang-router 0.3.2 forwards for a plain chat and completion request.
        let chat = json!({"messages":[{"role":"user","content":"hi"}],"model":"m","logprobs":false,
            "max_completion_tokens":4,"stream":false,"no_stop_trim":false,"ignore_eos":false,
            "continue_final_message":false,"skip_special_tokens":true,"separate_reasoning":true,
            "stream_reasoning":true,"return_hidden_states":false});
        assert!(check_chat(&obj(chat)).is_ok());
        let completion = json!({"model":"m","prompt":"hi","max_tokens":4,"stream":false,"echo":false,
            "no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,
            "return_hidden_states":false});
        assert!(check_completion(&obj(completion)).is_ok());
        // Asking for the non-default behaviour is refused.
        let d = obj(json!({"prompt": "x", "skip_special_tokens": false}));
        assert!(check_completion(&d).is_err());
    }

    #[test]
    fn completions_take_an_integer_logprobs() {
        let d = obj(json!({"prompt": "x", "logprobs": 3}));
        assert!(check_completion(&d).is_ok());
        assert_eq!(requested_logprobs(&d, false), Some(3));
        assert!(check_completion(&obj(json!({"prompt": "x", "logprobs": true}))).is_err());
        assert!(check_completion(&obj(json!({"prompt": "x", "echo": true}))).is_err());
    }
}
