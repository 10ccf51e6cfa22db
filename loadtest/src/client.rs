//! The measuring client: sends one workload item as a chat completion and times what the user
//! would see — streamed: TTFT (first content), every inter-token gap, end to end; unstreamed:
//! end to end only — and records tokens in and out, `cached_tokens` from the usage and the
//! `x-kvgate-replica` header.

use std::time::{Duration, Instant};

use futures::StreamExt;
use protocol::sse::{SseDecoder, SseEvent};
use serde::Serialize;
use serde_json::{json, Value};

use crate::workload::WorkItem;

/// What one request measured.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    /// Offset of the scheduled start from the run's start, seconds.
    pub scheduled_s: f64,
    /// Sent streamed (else unstreamed: no TTFT or gaps, only end to end).
    pub stream: bool,
    pub status: u16,
    pub error: Option<String>,
    pub ttft_s: Option<f64>,
    pub inter_token_s: Vec<f64>,
    pub e2e_s: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub replica: Option<String>,
}

impl Sample {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none()
    }
}

/// Sends `item` to `base_url` (`http://host:port`) as a chat completion, streamed or not.
pub async fn send(
    client: &reqwest::Client,
    base_url: &str,
    model: &str,
    item: &WorkItem,
    scheduled_s: f64,
    timeout: Duration,
    stream: bool,
) -> Sample {
    let started = Instant::now();
    let mut sample = Sample {
        scheduled_s,
        stream,
        status: 0,
        error: None,
        ttft_s: None,
        inter_token_s: Vec::new(),
        e2e_s: 0.0,
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_tokens: 0,
        replica: None,
    };
    let mut body = json!({
        "model": model,
        "messages": item.messages,
        "max_tokens": item.max_tokens,
        "stream": stream,
        "ignore_eos": true,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let mut req = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(&body)
        .timeout(timeout);
    if let Some(s) = item.session {
        req = req.header("x-session-id", s.to_string());
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            sample.error = Some(e.to_string());
            sample.e2e_s = started.elapsed().as_secs_f64();
            return sample;
        }
    };
    sample.status = resp.status().as_u16();
    sample.replica = resp
        .headers()
        .get("x-kvgate-replica")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if sample.status != 200 {
        sample.error = resp.text().await.ok();
        sample.e2e_s = started.elapsed().as_secs_f64();
        return sample;
    }
    if !stream {
        match resp.json::<Value>().await {
            Ok(v) => usage_into(&mut sample, &v["usage"]),
            Err(e) => sample.error = Some(e.to_string()),
        }
        sample.e2e_s = started.elapsed().as_secs_f64();
        return sample;
    }
    let mut stream = resp.bytes_stream();
    let mut dec = SseDecoder::new();
    let mut last: Option<Instant> = None;
    'read: while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                sample.error = Some(e.to_string());
                break;
            }
        };
        for ev in dec.feed(&chunk) {
            let SseEvent::Data(d) = ev else { break 'read };
            let Ok(v) = serde_json::from_str::<Value>(&d) else {
                sample.error = Some(format!("malformed event: {d}"));
                break 'read;
            };
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage_into(&mut sample, u);
            }
            let has_content = v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty());
            if has_content {
                let now = Instant::now();
                match last {
                    None => sample.ttft_s = Some((now - started).as_secs_f64()),
                    Some(prev) => sample.inter_token_s.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    sample.e2e_s = started.elapsed().as_secs_f64();
    sample
}

/// Tokens in, out and cached from an OpenAI `usage` object.
fn usage_into(sample: &mut Sample, u: &Value) {
    sample.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
    sample.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
    sample.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
}
