//! The `trace` workload: replay a JSONL file, one request per line —
//! `{"timestamp": 12.5, "messages": [...], "max_tokens": 128}` or `{"timestamp": 12.5,
//! "prompt": "...", "session": "abc"}`. Timestamps are seconds (any origin); the replay keeps
//! their spacing, stretched or squeezed so the mean rate equals the rate asked for.

use std::path::Path;

use protocol::openai::ChatMessage;
use serde::Deserialize;

use crate::workload::WorkItem;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {0}: {1}")]
    Read(String, std::io::Error),
    #[error("{file}:{line}: {reason}")]
    Line {
        file: String,
        line: usize,
        reason: String,
    },
    #[error("{0} holds no request")]
    Empty(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    timestamp: f64,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    session: Option<serde_json::Value>,
}

/// A parsed trace: requests with their offsets from the first, in time order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub offsets_s: Vec<f64>,
    pub items: Vec<WorkItem>,
}

impl Trace {
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TraceError::Read(name.clone(), e))?;
        Self::parse(&name, &text)
    }

    pub fn parse(name: &str, text: &str) -> Result<Self, TraceError> {
        let mut rows: Vec<(f64, WorkItem)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            if raw.trim().is_empty() {
                continue;
            }
            let err = |reason: String| TraceError::Line {
                file: name.to_string(),
                line: i + 1,
                reason,
            };
            let l: Line = serde_json::from_str(raw).map_err(|e| err(e.to_string()))?;
            if !l.timestamp.is_finite() {
                return Err(err("timestamp must be a number of seconds".into()));
            }
            let messages = match (l.messages, l.prompt) {
                (Some(m), None) if !m.is_empty() => m,
                (None, Some(p)) => vec![ChatMessage::new("user", &p)],
                _ => {
                    return Err(err(
                        "give exactly one of messages (non-empty) or prompt".into()
                    ))
                }
            };
            let session = l.session.map(|s| match s {
                serde_json::Value::Number(n) => n.as_u64().unwrap_or(0),
                other => xxhash_like(&other.to_string()),
            });
            rows.push((
                l.timestamp,
                crate::workload::item(session, messages, l.max_tokens.unwrap_or(128)),
            ));
        }
        if rows.is_empty() {
            return Err(TraceError::Empty(name.to_string()));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let t0 = rows[0].0;
        Ok(Trace {
            offsets_s: rows.iter().map(|r| r.0 - t0).collect(),
            items: rows.into_iter().map(|r| r.1).collect(),
        })
    }

    /// The trace's own mean arrival rate (requests per second).
    pub fn mean_rate(&self) -> Option<f64> {
        let span = *self.offsets_s.last()?;
        (span > 0.0 && self.offsets_s.len() > 1).then(|| (self.offsets_s.len() - 1) as f64 / span)
    }

    /// Offsets rescaled to `rate` (unchanged when the trace has no span), cut at `duration_s`
    /// and `max` requests.
    pub fn schedule(&self, rate: f64, duration_s: f64, max: usize) -> Vec<f64> {
        let k = self.mean_rate().map_or(1.0, |own| own / rate);
        self.offsets_s
            .iter()
            .map(|o| o * k)
            .take_while(|o| *o < duration_s)
            .take(max)
            .collect()
    }
}

/// A stable numeric id for a non-numeric session id.
fn xxhash_like(s: &str) -> u64 {
    // FNV-1a: stable across runs and platforms, no dependency.
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"{"timestamp": 100.0, "prompt": "hello", "max_tokens": 8}
{"timestamp": 104.0, "messages": [{"role": "user", "content": "hi"}], "session": "abc"}

{"timestamp": 102.0, "prompt": "again", "session": 7}
"#;

    #[test]
    fn parses_sorts_and_rescales() {
        let t = Trace::parse("t.jsonl", TRACE).unwrap();
        assert_eq!(t.offsets_s, vec![0.0, 2.0, 4.0]);
        assert_eq!(t.items[0].max_tokens, 8);
        assert_eq!(t.items[1].session, Some(7));
        assert_eq!(t.items[2].max_tokens, 128);
        assert!(t.items[2].session.is_some());
        assert_eq!(t.mean_rate(), Some(0.5));
        // At 1 request/s the same spacing is halved; the duration cuts the last one.
        assert_eq!(t.schedule(1.0, 2.0, 100), vec![0.0, 1.0]);
        assert_eq!(t.schedule(0.5, 100.0, 2), vec![0.0, 2.0]);
    }

    #[test]
    fn reports_the_bad_line() {
        let e = Trace::parse(
            "t.jsonl",
            "{\"timestamp\": 1, \"prompt\": \"a\"}\n{\"prompt\": \"b\"}",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("t.jsonl:2:"), "{e}");
        let e = Trace::parse("t.jsonl", "{\"timestamp\": 1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("exactly one of messages"), "{e}");
        assert!(matches!(
            Trace::parse("t.jsonl", "\n"),
            Err(TraceError::Empty(_))
        ));
    }
}
