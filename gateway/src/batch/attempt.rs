//! One batch line's attempt: its body read from the database, run through the request
//! pipeline (`line.rs`) on the replicas its look found spare, and its result written before
//! it is reported to the runner (`runner.rs`), which counts it or puts it back.

use std::sync::Arc;

use bytes::Bytes;
use config::Grant;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::batch::line;
use crate::batch::objects::{answered_line, error_line};
use crate::batch::store::Store;
use crate::request::place::NO_SPARE_REPLICA;
use crate::state::GatewayState;

/// Attempts a line gets at a 5xx or a broken pipe before it is a failure.
const MAX_ATTEMPTS: u32 = 3;

/// What became of a started line.
pub(super) enum Outcome {
    /// Its result is in the database (`ok`: in the output file); `tokens` generated.
    Done { ok: bool, tokens: u64 },
    /// Back in the queue, for this reason.
    Retry(Again),
}

/// Why a line goes back to its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Again {
    /// A real attempt failed (a 5xx, a broken pipe, its row unreadable): it counts towards
    /// the line's attempts, and its batch waits before its next line.
    Failed,
    /// The fleet had no room after all (429, 503): its batch waits before its next line.
    Refused,
    /// The spare replicas it was started for filled up before it was placed: it never
    /// reached one, and goes first at the next look.
    Rescoped,
}

/// A finished attempt, as the runner hears of it.
pub(super) struct Report {
    pub batch: String,
    pub idx: i64,
    pub outcome: Outcome,
}

/// A line as the runner starts it.
pub(super) struct Started {
    pub batch: String,
    pub endpoint: String,
    pub grant: Option<Grant>,
    /// The replicas the look found spare: the line goes to one of them now, or back.
    pub scope: Arc<[usize]>,
    pub idx: i64,
    pub attempts: u32,
}

pub(super) async fn run_line(
    state: Arc<GatewayState>,
    store: Arc<Store>,
    line: Started,
    tx: mpsc::UnboundedSender<Report>,
) {
    let outcome = attempt(state, &store, &line).await;
    let _ = tx.send(Report {
        batch: line.batch,
        idx: line.idx,
        outcome,
    });
}

async fn attempt(state: Arc<GatewayState>, store: &Arc<Store>, started: &Started) -> Outcome {
    let (batch, idx) = (started.batch.as_str(), started.idx);
    let id = batch.to_string();
    let line = match store.call(move |s| s.line(&id, idx)).await {
        Ok(Some(l)) => l,
        // Gone (the batch was deleted) or unreadable: tried again, then left to the finish.
        _ => return Outcome::Retry(Again::Failed),
    };
    let last = started.attempts + 1 >= MAX_ATTEMPTS;
    let answer = match line::run(
        state,
        started.grant.clone(),
        started.scope.clone(),
        &started.endpoint,
        Bytes::from(line.body),
    )
    .await
    {
        Ok(a) => a,
        Err(e) if last => {
            tracing::warn!(batch, idx, error = %e, "batch line failed in the gateway; given up");
            let text = error_line(&line.custom_id, "internal_error", &e.to_string()).to_string();
            return record(store, batch, idx, false, text, 0).await;
        }
        Err(e) => {
            tracing::warn!(batch, idx, error = %e, "batch line failed in the gateway");
            return Outcome::Retry(Again::Failed);
        }
    };
    match answer.status {
        503 if no_spare_replica(&answer.body) => return Outcome::Retry(Again::Rescoped),
        429 | 503 => return Outcome::Retry(Again::Refused),
        s if s >= 500 && !last => return Outcome::Retry(Again::Failed),
        _ => {}
    }
    let ok = (200..300).contains(&answer.status);
    let body: Value = serde_json::from_slice(&answer.body).unwrap_or_else(
        |_| serde_json::json!({"error": {"message": String::from_utf8_lossy(&answer.body)}}),
    );
    let tokens = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    let text = answered_line(
        &line.custom_id,
        answer.status,
        answer.request_id.as_deref(),
        body,
    )
    .to_string();
    record(store, batch, idx, ok, text, tokens).await
}

/// Whether an error answer is placement's refusal of a scoped line: none of its spare
/// replicas could take it by the time it was placed.
fn no_spare_replica(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .is_ok_and(|v| v["error"]["code"].as_str() == Some(NO_SPARE_REPLICA))
}

/// Writes a line's result; the outcome to report.
async fn record(
    store: &Arc<Store>,
    batch: &str,
    idx: i64,
    ok: bool,
    text: String,
    tokens: u64,
) -> Outcome {
    let id = batch.to_string();
    match store.call(move |s| s.record(&id, idx, ok, &text)).await {
        Ok(true) => Outcome::Done { ok, tokens },
        // Already there (an earlier run of this line), or the batch has ended: nothing new.
        Ok(false) => Outcome::Done { ok, tokens: 0 },
        Err(e) => {
            tracing::warn!(batch, idx, error = %e, "cannot write a batch line's result");
            Outcome::Retry(Again::Refused)
        }
    }
}
