//! The model's Jinja chat template, rendered with minijinja the way HF transformers'
//! `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`startswith`, `split`, `strip`, ...) through minijinja-contrib's pycompat callback, and the
//! `raise_exception` and `strftime_now` helpers HF templates call. A template that renders
//! differently from HF is the failure in this stack that produces no error, so the renderer is
//! kept to exactly HF's environment.

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use crate::openai::ChatMessage;
use crate::ApiError;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

impl From<TemplateError> for ApiError {
    fn from(e: TemplateError) -> Self {
        ApiError::invalid_request(e.to_string()).with_param("messages")
    }
}

/// A compiled chat template plus the special-token strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// A message as the template sees it: content flattened to a string, as HF does for text
/// models. Absent content becomes "" so templates that test `'x' in message.content` work.
#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    // Templates use this for "today's date" lines; UTC from the system clock, formatted with
    // the common strftime fields.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    format
        .replace("%Y", &format!("{y:04}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages` to the prompt text the model sees.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, ApiError> {
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            let content = match &m.content {
                Some(c) => c.text()?,
                None => String::new(),
            };
            msgs.push(TemplateMessage {
                role: &m.role,
                content,
                name: m.name.as_deref(),
                tool_calls: m.tool_calls.as_ref(),
                tool_call_id: m.tool_call_id.as_deref(),
                reasoning_content: m.reasoning_content.as_deref(),
            });
        }
        let mut ctx = serde_json::Map::new();
        if let Some(extra) = extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), v.clone());
            }
        }
        ctx.insert(
            "messages".into(),
            serde_json::to_value(&msgs).map_err(|e| ApiError::internal(e.to_string()))?,
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        if let Some(tools) = tools {
            ctx.insert("tools".into(), serde_json::Value::Array(tools.to_vec()));
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::from(TemplateError::Render(e.to_string())))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| TemplateError::Render(e.to_string()).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_python_string_methods_and_trims_blocks() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {{ m.role }}:{{ m.content.strip() }}|{% if m.content.startswith('a') %}A{% endif %}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "abc ")], true, None, None)
            .unwrap();
        // lstrip_blocks strips before `{% %}` only; trim_blocks eats the newline after `{% endif %}`.
        assert_eq!(out, "  user:abc|A>");
    }

    #[test]
    fn raise_exception_becomes_a_400() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t
            .render(&[ChatMessage::new("user", "x")], true, None, None)
            .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.body.error.message.contains("roles must alternate"));
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
    }
}
