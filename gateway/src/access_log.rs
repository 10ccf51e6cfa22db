//! The structured access log: one JSON line per request with what an operator asks first —
//! route, replica, routing reason, tenant, tokens in and cached, tokens out, queue time and the
//! holds behind it, TTFT, end-to-end time, status and error. `off`, `sampled` (a share of successful requests and
//! every one that failed) or `full`; to standard output or appended to a file. Prompts and
//! answers are never logged.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use config::gateway::{AccessLogConfig, AccessLogMode};
use parking_lot::Mutex;
use serde::Serialize;

/// One hold a request met before it was dispatched (or shed): why, for how long, and what
/// placement predicted waiting would win — the best replica it could have gone to instead,
/// less the one it waited for, in seconds of TTFT (when the policy predicts).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HoldSpan {
    pub reason: &'static str,
    pub ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gain_ms: Option<f64>,
}

/// What one request did, filled in along its way.
#[derive(Debug, Default, Clone, Serialize)]
pub struct AccessRecord {
    pub ts: f64,
    pub method: String,
    pub path: String,
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The model asked for (recorded when the gateway serves several).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// The `host:port` the gateway sent it to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    /// Every hold it met while queued, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<HoldSpan>,
    /// From arrival to the first token. For an unstreamed answer it is not seen but estimated:
    /// the whole answer's time less its decode at the replica's learnt step (absent while
    /// that step is unknown; a one-token answer needs none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// What placement predicted the replica's time to first token would be.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_ms: Option<f64>,
    /// What that prediction was made of: the prompt tokens the gateway took as uncached
    /// there, the unanswered prefill ahead of the request's own step, and the rest of the
    /// step the replica was running (`fleet/replica.rs`, `ReplicaHandle::joined`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_uncached_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ahead_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_wait_ms: Option<f64>,
    /// The replica warmed with this prompt, to hold its prefix too (`request/warm.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmed: Option<String>,
    pub e2e_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl AccessRecord {
    pub fn new(method: &str, path: &str) -> Self {
        AccessRecord {
            ts: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
            method: method.to_string(),
            path: path.to_string(),
            ..AccessRecord::default()
        }
    }
}

pub struct AccessLog {
    mode: AccessLogMode,
    /// Log one successful request in this many (sampled mode).
    every: u64,
    seen: AtomicU64,
    out: Option<Mutex<Box<dyn Write + Send>>>,
}

impl AccessLog {
    pub fn new(cfg: &AccessLogConfig) -> std::io::Result<Self> {
        let out: Option<Box<dyn Write + Send>> = match cfg.mode {
            AccessLogMode::Off => None,
            _ if cfg.path == "-" => Some(Box::new(std::io::LineWriter::new(std::io::stdout()))),
            _ => Some(Box::new(std::io::LineWriter::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&cfg.path)?,
            ))),
        };
        Ok(AccessLog {
            mode: cfg.mode,
            every: if cfg.sample > 0.0 {
                (1.0 / cfg.sample).round().max(1.0) as u64
            } else {
                u64::MAX
            },
            seen: AtomicU64::new(0),
            out: out.map(Mutex::new),
        })
    }

    pub fn enabled(&self) -> bool {
        self.out.is_some()
    }

    fn wanted(&self, r: &AccessRecord) -> bool {
        match self.mode {
            AccessLogMode::Off => false,
            AccessLogMode::Full => true,
            AccessLogMode::Sampled => {
                r.status != 200
                    || r.error.is_some()
                    || self
                        .seen
                        .fetch_add(1, Ordering::Relaxed)
                        .is_multiple_of(self.every)
            }
        }
    }

    pub fn write(&self, r: &AccessRecord) {
        let Some(out) = &self.out else { return };
        if !self.wanted(r) {
            return;
        }
        let Ok(mut line) = serde_json::to_vec(r) else {
            return;
        };
        line.push(b'\n');
        let _ = out.lock().write_all(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_mode_keeps_failures_and_a_share_of_successes() {
        let log = AccessLog {
            mode: AccessLogMode::Sampled,
            every: 4,
            seen: AtomicU64::new(0),
            out: None,
        };
        let ok = AccessRecord {
            status: 200,
            ..AccessRecord::default()
        };
        let kept = (0..100).filter(|_| log.wanted(&ok)).count();
        assert_eq!(kept, 25);
        let shed = AccessRecord {
            status: 429,
            ..AccessRecord::default()
        };
        assert!((0..10).all(|_| log.wanted(&shed)));
    }

    #[test]
    fn records_serialise_without_empty_fields() {
        let mut r = AccessRecord::new("POST", "/v1/chat/completions");
        r.status = 200;
        r.route = Some("interactive".into());
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["route"], "interactive");
        assert!(v.get("replica").is_none());
    }
}
