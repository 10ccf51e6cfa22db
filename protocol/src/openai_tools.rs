//! `tools` in a chat request, checked as OpenAI checks it, with OpenAI's error wording
//! (`invalid_type`, `missing_required_parameter`, `invalid_value`, the parameter's path). A tool
//! the chat template cannot read is skipped by it, so the model would silently never see it:
//! the gateway and the replica refuse it instead.

use serde_json::Value;

use crate::ApiError;

/// How OpenAI names a JSON value's type in its "Invalid type" errors.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a decimal",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn invalid_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_request(format!(
        "Invalid type for '{param}': expected {expected}, but got {} instead.",
        json_type(got)
    ))
    .with_param(param)
    .with_code("invalid_type")
}

fn missing(param: &str) -> ApiError {
    ApiError::invalid_request(format!("Missing required parameter: '{param}'."))
        .with_param(param)
        .with_code("missing_required_parameter")
}

/// `tools` as OpenAI checks it: a non-empty list of `{"type": "function", "function": {"name":
/// …, "parameters": {…}}}`, the name 1–64 of `[a-zA-Z0-9_-]`. A tool that is not one of these
/// would otherwise be passed to the chat template, which skips what it cannot read: the model
/// would silently never see it.
pub fn validate_tools(tools: &[Value]) -> Result<(), ApiError> {
    if tools.is_empty() {
        return Err(ApiError::invalid_request(
            "Invalid 'tools': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        )
        .with_param("tools")
        .with_code("empty_array"));
    }
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(t) = tool else {
            return Err(invalid_type(&at, "an object", tool));
        };
        match t.get("type") {
            None => return Err(missing(&format!("{at}.type"))),
            Some(Value::String(k)) if k == "function" => {}
            Some(Value::String(k)) => {
                return Err(ApiError::invalid_request(format!(
                    "Invalid value: '{k}'. Supported values are: 'function'."
                ))
                .with_param(&format!("{at}.type"))
                .with_code("invalid_value"))
            }
            Some(v) => return Err(invalid_type(&format!("{at}.type"), "a string", v)),
        }
        let f = match t.get("function") {
            None => return Err(missing(&format!("{at}.function"))),
            Some(Value::Object(f)) => f,
            Some(v) => return Err(invalid_type(&format!("{at}.function"), "an object", v)),
        };
        let name_at = format!("{at}.function.name");
        match f.get("name") {
            None => return Err(missing(&name_at)),
            Some(Value::String(n)) => {
                let ok = (1..=64).contains(&n.len())
                    && n.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if !ok {
                    return Err(ApiError::invalid_request(format!(
                        "Invalid '{name_at}': string does not match pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$'."
                    ))
                    .with_param(&name_at)
                    .with_code("invalid_value"));
                }
            }
            Some(v) => return Err(invalid_type(&name_at, "a string", v)),
        }
        match f.get("parameters") {
            None | Some(Value::Object(_)) => {}
            Some(v) => {
                return Err(invalid_type(
                    &format!("{at}.function.parameters"),
                    "an object",
                    v,
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(tools: Value) -> (String, Option<String>, Option<String>) {
        let e = validate_tools(tools.as_array().unwrap()).unwrap_err();
        assert_eq!(e.status, 400);
        let b = e.body.error;
        (b.message, b.param, b.code)
    }

    #[test]
    fn a_function_tool_passes() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "d", "parameters": {"type": "object", "properties": {}}}},
            {"type": "function", "function": {"name": "a-b_9"}}]);
        assert!(validate_tools(tools.as_array().unwrap()).is_ok());
    }

    #[test]
    fn malformed_tools_are_refused_naming_the_field() {
        let (m, p, c) = refused(json!([1]));
        assert_eq!(p.as_deref(), Some("tools[0]"));
        assert_eq!(c.as_deref(), Some("invalid_type"));
        assert!(m.contains("expected an object, but got an integer"), "{m}");
        let (_, p, c) = refused(json!([{"type": "function", "function": {}}]));
        assert_eq!(p.as_deref(), Some("tools[0].function.name"));
        assert_eq!(c.as_deref(), Some("missing_required_parameter"));
        let (_, p, _) = refused(json!([{"function": {"name": "x"}}]));
        assert_eq!(p.as_deref(), Some("tools[0].type"));
        let (_, p, c) = refused(json!([{"type": "retrieval", "function": {"name": "x"}}]));
        assert_eq!(
            (p.as_deref(), c.as_deref()),
            (Some("tools[0].type"), Some("invalid_value"))
        );
        let (_, p, _) = refused(json!([{"type": "function", "function": {"name": "x"}},
            {"type": "function", "function": {"name": "has space"}}]));
        assert_eq!(p.as_deref(), Some("tools[1].function.name"));
        let (_, p, _) =
            refused(json!([{"type": "function", "function": {"name": "x", "parameters": []}}]));
        assert_eq!(p.as_deref(), Some("tools[0].function.parameters"));
        let (_, p, c) = refused(json!([]));
        assert_eq!(
            (p.as_deref(), c.as_deref()),
            (Some("tools"), Some("empty_array"))
        );
    }
}
