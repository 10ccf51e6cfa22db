//! Stage 2, classify: which route of the active policy a request takes, and what it may ask
//! for. The caller's priority class comes from the `x-kvgate-priority` header and must be one
//! its API key grants; its tenant decides its cache scope (the salt its prompt is hashed with);
//! its prompt's size and priority pick the route (the first whose rules hold), whose own prompt
//! limit it must then fit.

use config::{Grant, Priority};
use http::HeaderMap;
use protocol::ApiError;

use crate::request::prepared::{Prepared, PromptLimits};
use crate::routes::store::{ActivePolicy, ActiveRoute};

/// The priority class the caller asked for (interactive when it asked for none), if its grant
/// allows it.
pub fn priority(headers: &HeaderMap, grant: Option<&Grant>) -> Result<Priority, ApiError> {
    let priority = match headers.get(Priority::HEADER) {
        None => Priority::Interactive,
        Some(v) => v.to_str().ok().and_then(Priority::parse).ok_or_else(|| {
            ApiError::invalid_request(format!(
                "{} must be interactive or batch, got {:?}",
                Priority::HEADER,
                String::from_utf8_lossy(v.as_bytes())
            ))
            .with_code("invalid_priority")
        })?,
    };
    if let Some(g) = grant {
        if !g.allows(priority) {
            return Err(ApiError::new(
                403,
                "permission_error",
                format!(
                    "tenant {} may not use the {} priority class",
                    g.tenant,
                    priority.label()
                ),
            )
            .with_code("priority_not_allowed"));
        }
    }
    Ok(priority)
}

/// The tenant's cache scope under the active policy (`None`: the anonymous single tenant).
pub fn tenant_salt(active: &ActivePolicy, grant: Option<&Grant>) -> Option<String> {
    let g = grant?;
    Some(format!(
        "kvgate-tenant:{}",
        active.file.cache_owner(&g.tenant)
    ))
}

/// The prompt limits a request is prepared under: the longest prompt some route takes (never
/// over the model's context), and the gateway's per-request total.
pub fn prompt_limits(
    active: &ActivePolicy,
    model_limit: usize,
    per_request: usize,
) -> PromptLimits {
    let per_prompt = match active.max_prompt_tokens() {
        Some(r) => r.min(model_limit),
        None => model_limit,
    };
    PromptLimits {
        per_prompt,
        per_request,
    }
}

/// The route `p` takes: the first whose rules hold for its size and priority.
pub fn route<'a>(active: &'a ActivePolicy, p: &Prepared, priority: Priority) -> &'a ActiveRoute {
    active.route(p.model, p.prompt_tokens, priority)
}

/// Whether `p` fits its route's own prompt limit.
pub fn fits(route: &ActiveRoute, p: &Prepared) -> Result<(), ApiError> {
    match route.cfg.max_prompt_tokens {
        Some(max) if p.largest_prompt_tokens > max => Err(ApiError::invalid_request(format!(
            "The prompt has {} tokens; route {} accepts at most {max}.",
            p.largest_prompt_tokens, route.cfg.name
        ))
        .with_code("context_length_exceeded")),
        _ => Ok(()),
    }
}
