//! The prepare stage's share of the drift checks (`[drift]`): which requests get their token
//! ids compared with the engine's (an [`IdProbe`] the pipeline sends to the replica's
//! `/tokenize` after the answer, `fleet/token_ids.rs`), and which rendered prompts are written
//! to the sample file.
//!
//! Sampling is by count, not chance: with a share of 0.02 every 50th request is taken, so a
//! low-traffic gateway checks as soon as it can and the rate is exact. The sample file is
//! written by a thread of its own through a bounded queue; when the disk falls behind, lines
//! are dropped (and counted), never waited for. Its lines carry the time (whole seconds), the
//! endpoint, the token count and the rendered text: no tenant, key, session or request id.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use config::drift::DriftConfig;
use metrics::Counter;
use protocol::openai::ChatCompletionRequest;
use serde_json::json;

use crate::metrics::GatewayMetrics;
use crate::request::prepared::{Endpoint, IdProbe};

/// Lines the sample file's queue holds before new ones are dropped.
const SAMPLE_QUEUE: usize = 256;

/// Takes every request whose running count crosses a multiple of `1 / share`.
#[derive(Debug, Default)]
struct Share {
    share: f64,
    seen: AtomicU64,
}

impl Share {
    fn new(share: f64) -> Self {
        Share {
            share: share.clamp(0.0, 1.0),
            seen: AtomicU64::new(0),
        }
    }

    fn take(&self) -> bool {
        if self.share <= 0.0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed) as f64;
        ((n + 1.0) * self.share).floor() > (n * self.share).floor()
    }
}

/// The sample file's writer: a bounded queue in front of a thread that appends lines.
struct SampleFile {
    tx: SyncSender<String>,
    written: Counter,
    dropped: Counter,
}

#[derive(Default)]
pub struct DriftSampler {
    ids: Share,
    prompts: Share,
    file: Option<SampleFile>,
}

impl std::fmt::Debug for DriftSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriftSampler")
            .field("ids", &self.ids.share)
            .field("prompts", &self.prompts.share)
            .finish()
    }
}

impl DriftSampler {
    /// The sampler `cfg` asks for; opens (creates, appends to) the sample file when prompts are
    /// sampled.
    pub fn new(cfg: &DriftConfig, metrics: &GatewayMetrics) -> std::io::Result<Self> {
        let file = match (cfg.prompt_sample_share > 0.0, &cfg.prompt_sample_path) {
            (true, Some(path)) => {
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| {
                        std::io::Error::new(
                            e.kind(),
                            format!("cannot open drift.prompt_sample_path {path}: {e}"),
                        )
                    })?;
                let (tx, rx) = sync_channel::<String>(SAMPLE_QUEUE);
                std::thread::Builder::new()
                    .name("kvgate-prompt-samples".into())
                    .spawn(move || {
                        for line in rx {
                            if let Err(e) = f.write_all(line.as_bytes()) {
                                tracing::warn!(error = %e, "cannot write the prompt sample file");
                            }
                        }
                    })?;
                Some(SampleFile {
                    tx,
                    written: metrics.counter(
                        "kvgate_gateway_prompt_samples_total",
                        &[("result", "written")],
                    ),
                    dropped: metrics.counter(
                        "kvgate_gateway_prompt_samples_total",
                        &[("result", "dropped")],
                    ),
                })
            }
            _ => None,
        };
        Ok(DriftSampler {
            ids: Share::new(cfg.token_id_share),
            prompts: Share::new(if file.is_some() {
                cfg.prompt_sample_share
            } else {
                0.0
            }),
            file,
        })
    }

    /// For a chat request the gateway rendered and tokenised into `ids`: the probe, when this
    /// request is one of the sample.
    pub fn chat_probe(
        &self,
        model: &str,
        r: &ChatCompletionRequest,
        ids: &[u32],
    ) -> Option<Arc<IdProbe>> {
        if !self.ids.take() {
            return None;
        }
        let mut body = json!({
            "model": r.model.as_deref().unwrap_or(model),
            "messages": r.messages,
            "add_generation_prompt": r.add_generation_prompt.unwrap_or(true),
            "add_special_tokens": false,
        });
        if let Some(t) = &r.tools {
            body["tools"] = json!(t);
        }
        if let Some(k) = &r.chat_template_kwargs {
            body["chat_template_kwargs"] = json!(k);
        }
        Some(Arc::new(IdProbe {
            body: Bytes::from(body.to_string()),
            ids: ids.into(),
        }))
    }

    /// The same for a completions prompt `text` (tokenised with the special tokens added).
    pub fn prompt_probe(&self, model: &str, text: &str, ids: &[u32]) -> Option<Arc<IdProbe>> {
        if !self.ids.take() {
            return None;
        }
        let body = json!({"model": model, "prompt": text, "add_special_tokens": true});
        Some(Arc::new(IdProbe {
            body: Bytes::from(body.to_string()),
            ids: ids.into(),
        }))
    }

    /// Writes `rendered` to the sample file when this request is one of the sample.
    pub fn sample_prompt(&self, endpoint: Endpoint, rendered: &str, tokens: usize) {
        let Some(file) = &self.file else {
            return;
        };
        if !self.prompts.take() {
            return;
        }
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut line = json!({
            "at_unix_s": at,
            "endpoint": endpoint.label(),
            "prompt_tokens": tokens,
            "rendered": rendered,
        })
        .to_string();
        line.push('\n');
        match file.tx.try_send(line) {
            Ok(()) => file.written.increment(1),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => file.dropped.increment(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_takes_evenly_spaced_requests() {
        let s = Share::new(0.25);
        let taken: Vec<bool> = (0..8).map(|_| s.take()).collect();
        assert_eq!(taken.iter().filter(|&&t| t).count(), 2);
        assert_eq!(
            taken,
            [false, false, false, true, false, false, false, true]
        );
        assert!((0..10).all(|_| Share::new(1.0).take()));
        assert!((0..10).all(|_| !Share::new(0.0).take()));
    }

    #[test]
    fn sampled_prompts_go_to_their_own_file_without_ids() {
        let dir = std::env::temp_dir().join(format!("kvgate-drift-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("prompts.jsonl");
        let cfg = DriftConfig {
            token_id_share: 0.0,
            prompt_sample_share: 0.5,
            prompt_sample_path: Some(path.display().to_string()),
        };
        let s = DriftSampler::new(&cfg, &GatewayMetrics::new()).unwrap();
        for i in 0..4 {
            s.sample_prompt(Endpoint::ChatCompletions, &format!("prompt {i}"), 3);
        }
        assert!(s.prompt_probe("m", "x", &[1]).is_none(), "ids are off");
        drop(s);
        // The writer thread ends when the queue closes; wait for its lines.
        let mut text = String::new();
        for _ in 0..200 {
            text = std::fs::read_to_string(&path).unwrap();
            if text.lines().count() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["rendered"], "prompt 1");
        assert_eq!(lines[1]["rendered"], "prompt 3");
        let keys: Vec<&String> = lines[0].as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["at_unix_s", "endpoint", "prompt_tokens", "rendered"],
            "nothing that names the caller"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
