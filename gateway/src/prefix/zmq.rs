//! KV events over ZMQ, as vLLM and SGLang publish them (`--kv-events-config` with publisher
//! `zmq`): a PUB socket sends `[topic, sequence (8 bytes, big-endian), msgpack batch]`, and an
//! optional ROUTER socket replays buffered batches from a sequence number on request
//! (`[empty, start (8 bytes)]` in, `[empty, seq, batch]`… out, ended by sequence −1 with an
//! empty payload). The gateway subscribes to every topic, translates each batch into its own
//! block hashes (`engine_events.rs`) and applies it to the prefix index.
//!
//! - A gap in the sequence is filled from the replay socket when there is one; when there is
//!   none, or the replay cannot fill it, what the index holds for the replica is dropped and
//!   rebuilt from the events that follow (a stale index would route to blocks long evicted).
//! - A sequence that goes back (the engine restarted) is the same: start over.
//! - A lost connection is the same too: the socket would reconnect by itself, but batches the
//!   engine published while nobody listened would be lost unseen (an engine that restarts and
//!   serves one request leaves no later batch to show the gap). So a disconnect ends `follow`,
//!   and the caller connects afresh, which catches up from the replay socket.
//! - A block size the gateway does not hash with is a configuration error: named in the log and
//!   on `/admin/replicas`, and nothing is indexed for the replica until it is fixed.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use protocol::kv_events::KvEventBatch;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::prefix::engine_events::{HashTranslator, TranslateError};
use crate::prefix::index::PrefixIndex;

/// How long a replay may take before the gap is given up on.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long connecting to the event socket may take. The socket's own retries back off to 30 s
/// between attempts, so an engine that comes back would be seen late; the caller retries
/// every half second instead.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What the follower reports back to the replica's record.
pub trait EventSink: Send + Sync {
    /// The stream is (or is no longer) keeping the index exact.
    fn set_live(&self, live: bool);
    /// A configuration error that stops indexing (`None` when it clears).
    fn set_error(&self, error: Option<String>);
    /// The engine reported more blocks than it can hold: `evicted` of its oldest were dropped
    /// from the index (a publisher that does not report its removals).
    fn overflowed(&self, evicted: usize);
}

/// Why following an engine's events stopped (the caller reconnects and starts over).
#[derive(Debug, thiserror::Error)]
pub enum ZmqError {
    #[error("connect {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("{0}")]
    Socket(#[from] zeromq::ZmqError),
    #[error("connect timed out")]
    ConnectTimeout,
    #[error("the engine closed the event connection")]
    Disconnected,
    #[error("replay stopped at {next} of {until}")]
    ReplayStalled { next: u64, until: u64 },
    #[error("the replay starts at {seq}, {next} was asked for")]
    ReplayStartsLate { seq: u64, next: u64 },
    #[error("the engine no longer buffers batches {next}..{until}")]
    NoLongerBuffered { next: u64, until: u64 },
}

/// Where one engine publishes.
#[derive(Debug, Clone)]
pub struct ZmqSource {
    pub events: String,
    pub replay: Option<String>,
}

/// Splits a published message into (sequence, payload).
fn parts(msg: &ZmqMessage) -> Option<(u64, Bytes)> {
    // [topic, seq, payload]; a publisher without a topic frame sends [seq, payload].
    let n = msg.len();
    if n < 2 {
        return None;
    }
    let seq = msg.get(n - 2)?;
    let seq = u64::from_be_bytes(seq.as_ref().try_into().ok()?);
    Some((seq, msg.get(n - 1)?.clone()))
}

/// Follows one engine's events until the connection fails; the caller retries.
pub async fn follow(
    source: &ZmqSource,
    slot: usize,
    index: &PrefixIndex,
    translator: &mut HashTranslator,
    sink: &dyn EventSink,
) -> Result<(), ZmqError> {
    let mut sub = zeromq::SubSocket::new();
    let mut monitor = sub.monitor();
    tokio::time::timeout(CONNECT_TIMEOUT, sub.connect(&source.events))
        .await
        .map_err(|_| ZmqError::ConnectTimeout)?
        .map_err(|source_err| ZmqError::Connect {
            endpoint: source.events.clone(),
            source: source_err,
        })?;
    sub.subscribe("").await?;
    // Nothing is known of the engine's cache until its events say so.
    index.clear_exact(slot);
    translator.clear();
    sink.set_error(None);
    let mut last: Option<u64> = None;
    // Joining: the replay buffer holds what the engine did before we connected (as far back as
    // it keeps), asked for now rather than at the engine's next batch, which an idle engine
    // may not send for a long time. Replaying adds blocks the engine still holds; what is
    // missing is only a missed hit, never a false one. Live batches the replay already
    // applied are skipped once.
    let mut replayed: Option<u64> = None;
    if let Some(r) = &source.replay {
        match replay(
            r,
            0,
            u64::MAX,
            slot,
            index,
            translator,
            sink,
            Replay::CatchUp,
        )
        .await
        {
            Ok(highest) => {
                replayed = highest;
                last = highest;
                sink.set_live(true);
            }
            Err(e) => {
                tracing::info!(endpoint = %r, error = %e, "no KV event history to catch up on")
            }
        }
    }
    loop {
        let msg = tokio::select! {
            msg = sub.recv() => msg?,
            event = monitor.next() => match event {
                Some(zeromq::SocketEvent::Disconnected(_)) | None => {
                    return Err(ZmqError::Disconnected)
                }
                Some(_) => continue,
            },
        };
        let Some((seq, payload)) = parts(&msg) else {
            tracing::warn!(endpoint = %source.events, frames = msg.len(), "KV event message of an unknown shape; ignored");
            continue;
        };
        if let Some(upto) = replayed {
            if seq <= upto {
                continue;
            }
            replayed = None;
        }
        match last {
            None => {}
            Some(l) if seq <= l => {
                tracing::info!(endpoint = %source.events, seq, last = l, "the engine's event sequence went back (restart?): starting over");
                index.clear_exact(slot);
                translator.clear();
            }
            Some(l) if seq > l + 1 => {
                let filled = match &source.replay {
                    Some(r) => replay(r, l + 1, seq, slot, index, translator, sink, Replay::Gap)
                        .await
                        .map_err(
                            |e| tracing::warn!(endpoint = %r, error = %e, "KV event replay failed"),
                        )
                        .is_ok(),
                    None => false,
                };
                if !filled {
                    tracing::warn!(endpoint = %source.events, missing = seq - l - 1, "KV events lost and not replayed: the replica's index starts over");
                    index.clear_exact(slot);
                    translator.clear();
                }
            }
            _ => {}
        }
        last = Some(seq);
        apply(&payload, slot, index, translator, sink);
        sink.set_live(true);
    }
}

/// Why batches are replayed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Replay {
    /// To fill a gap: every batch of it must come back.
    Gap,
    /// To learn the history before we joined: whatever the engine still buffers.
    CatchUp,
}

/// Asks the replay socket for batches `from..until` and applies them; returns the highest
/// sequence applied.
#[allow(clippy::too_many_arguments)]
async fn replay(
    endpoint: &str,
    from: u64,
    until: u64,
    slot: usize,
    index: &PrefixIndex,
    translator: &mut HashTranslator,
    sink: &dyn EventSink,
    why: Replay,
) -> Result<Option<u64>, ZmqError> {
    let mut dealer = zeromq::DealerSocket::new();
    tokio::time::timeout(REPLAY_TIMEOUT, dealer.connect(endpoint))
        .await
        .map_err(|_| ZmqError::ConnectTimeout)??;
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(req).await?;
    let mut next = from;
    let mut highest = None;
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    while next < until {
        let msg = tokio::time::timeout_at(deadline, dealer.recv())
            .await
            .map_err(|_| ZmqError::ReplayStalled { next, until })??;
        let Some((seq, payload)) = parts(&msg) else {
            continue;
        };
        if seq == u64::MAX || payload.is_empty() {
            break; // end of what the engine still buffers
        }
        if seq < next {
            continue;
        }
        if seq >= until {
            break;
        }
        if seq > next && why == Replay::Gap {
            return Err(ZmqError::ReplayStartsLate { seq, next });
        }
        apply(&payload, slot, index, translator, sink);
        highest = Some(seq);
        next = seq + 1;
    }
    if next < until && why == Replay::Gap {
        return Err(ZmqError::NoLongerBuffered { next, until });
    }
    Ok(highest)
}

/// Decodes, translates and indexes one batch.
fn apply(
    payload: &[u8],
    slot: usize,
    index: &PrefixIndex,
    translator: &mut HashTranslator,
    sink: &dyn EventSink,
) {
    let batch = match KvEventBatch::decode(payload) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "undecodable KV event batch; ignored");
            return;
        }
    };
    let mut stored = false;
    translator.set_cap(index.cap(slot));
    for ev in &batch.events {
        match translator.translate(ev) {
            Ok(Some(ours)) => {
                stored |= matches!(ours, protocol::kv_events::KvEvent::BlockStored { .. });
                let evicted = index.apply(slot, &ours);
                if evicted > 0 {
                    sink.overflowed(evicted);
                }
            }
            Ok(None) => {}
            Err(e @ TranslateError::BlockSize { .. }) => {
                sink.set_error(Some(e.to_string()));
                return;
            }
            Err(e) => tracing::warn!(error = %e, "malformed KV event; ignored"),
        }
    }
    if stored {
        sink.set_error(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_with_and_without_a_topic_frame() {
        let seq = 7u64.to_be_bytes().to_vec();
        let mut m = ZmqMessage::from(Bytes::from_static(b"kv-events"));
        m.push_back(Bytes::from(seq.clone()));
        m.push_back(Bytes::from_static(b"payload"));
        assert_eq!(parts(&m), Some((7, Bytes::from_static(b"payload"))));
        let mut m = ZmqMessage::from(Bytes::from(seq));
        m.push_back(Bytes::from_static(b"p"));
        assert_eq!(parts(&m).map(|p| p.0), Some(7));
        assert_eq!(parts(&ZmqMessage::from(Bytes::from_static(b"x"))), None);
    }
}
