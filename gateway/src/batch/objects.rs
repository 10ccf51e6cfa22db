//! The Batch API's objects as OpenAI shapes them: the file object, the batch object with its
//! statuses and `request_counts`, the lines of the output and error files, and their ids.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// Seconds since the Unix epoch (the API's timestamps).
pub fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A fresh id with `prefix` (`file-`, `batch_`, `batch_req_`): 24 hex digits from the clock,
/// the process and a counter, so ids from two gateways sharing a database do not collide.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut seed = [0u8; 24];
    seed[..8].copy_from_slice(&nanos.to_le_bytes());
    seed[8..16].copy_from_slice(&n.to_le_bytes());
    seed[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    let h = xxhash_rust::xxh3::xxh3_128(&seed);
    format!("{prefix}{:024x}", h & ((1u128 << 96) - 1))
}

/// A batch's status, as OpenAI names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Validating => "validating",
            Status::Failed => "failed",
            Status::InProgress => "in_progress",
            Status::Finalizing => "finalizing",
            Status::Completed => "completed",
            Status::Expired => "expired",
            Status::Cancelling => "cancelling",
            Status::Cancelled => "cancelled",
        }
    }

    /// Unknown text reads as `failed` (a database written by a newer gateway).
    pub fn parse(s: &str) -> Status {
        match s {
            "validating" => Status::Validating,
            "in_progress" => Status::InProgress,
            "finalizing" => Status::Finalizing,
            "completed" => Status::Completed,
            "expired" => Status::Expired,
            "cancelling" => Status::Cancelling,
            "cancelled" => Status::Cancelled,
            _ => Status::Failed,
        }
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            Status::Failed | Status::Completed | Status::Expired | Status::Cancelled
        )
    }
}

/// A stored file's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct FileRow {
    pub id: String,
    pub tenant: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub created_at: i64,
    pub expires_at: Option<i64>,
}

impl FileRow {
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": null,
        })
    }
}

/// A stored batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRow {
    pub id: String,
    pub tenant: String,
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    pub status: Status,
    pub created_at: i64,
    pub in_progress_at: Option<i64>,
    pub expires_at: i64,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub total: i64,
    pub completed: i64,
    pub failed: i64,
    /// The client's metadata, as JSON text.
    pub metadata: Option<String>,
    /// The model every line names (`None` when the lines name several).
    pub model: Option<String>,
    /// The tokens of the lines answered so far.
    pub usage: Usage,
}

/// Tokens a batch's answered lines used, summed as each line's result is kept (OpenAI's
/// `usage` on the batch object), from each answer's own `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: i64,
    pub cached_tokens: i64,
    pub output_tokens: i64,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        })
    }
}

impl BatchRow {
    pub fn to_json(&self) -> Value {
        let metadata = self
            .metadata
            .as_deref()
            .and_then(|m| serde_json::from_str::<Value>(m).ok())
            .unwrap_or(Value::Null);
        json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": null,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.as_str(),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": self.usage.to_json(),
            "metadata": metadata,
        })
    }
}

/// A line of the output or error file for a line the replica answered (`status`, its JSON
/// `body`, the answer's request id when it had one).
pub fn answered_line(custom_id: &str, status: u16, request_id: Option<&str>, body: Value) -> Value {
    json!({
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id.map_or_else(|| new_id("req_"), str::to_string),
            "body": body,
        },
        "error": null,
    })
}

/// A line of the error file for a line that got no answer.
pub fn error_line(custom_id: &str, code: &str, message: &str) -> Value {
    json!({
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": code, "message": message},
    })
}

/// A `{"object": "list", ...}` page of `items` (OpenAI's cursor pagination).
pub fn list(items: Vec<Value>, has_more: bool) -> Value {
    let first = items
        .first()
        .and_then(|v| v["id"].as_str())
        .map(str::to_string);
    let last = items
        .last()
        .and_then(|v| v["id"].as_str())
        .map(str::to_string);
    json!({
        "object": "list",
        "data": items,
        "first_id": first,
        "last_id": last,
        "has_more": has_more,
    })
}

/// A completion window: OpenAI's `24h`, or any whole number of hours or minutes (`1h`,
/// `30m`) for shorter jobs; its length in seconds.
pub fn window_seconds(w: &str) -> Option<i64> {
    let (n, unit) = match (w.strip_suffix('h'), w.strip_suffix('m')) {
        (Some(n), _) => (n, 3600),
        (_, Some(n)) => (n, 60),
        _ => return None,
    };
    let n: i64 = n.parse().ok().filter(|n| *n > 0)?;
    (n.checked_mul(unit)? <= 7 * 24 * 3600).then_some(n * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fresh_and_prefixed() {
        let a = new_id("batch_");
        let b = new_id("batch_");
        assert_ne!(a, b);
        assert!(a.starts_with("batch_") && a.len() == 6 + 24, "{a}");
    }

    #[test]
    fn windows_are_hours_or_minutes() {
        assert_eq!(window_seconds("24h"), Some(86_400));
        assert_eq!(window_seconds("30m"), Some(1_800));
        for bad in [
            "",
            "h",
            "0h",
            "24",
            "1d",
            "-1h",
            "9999h",
            "1\u{e9}",
            "24\u{447}",
            "\u{20ac}",
            "99999999999999999h",
        ] {
            assert_eq!(window_seconds(bad), None, "{bad}");
        }
    }

    #[test]
    fn statuses_round_trip() {
        for s in [
            Status::Validating,
            Status::Failed,
            Status::InProgress,
            Status::Finalizing,
            Status::Completed,
            Status::Expired,
            Status::Cancelling,
            Status::Cancelled,
        ] {
            assert_eq!(Status::parse(s.as_str()), s);
        }
        assert!(Status::Cancelled.is_final() && !Status::Cancelling.is_final());
    }
}
