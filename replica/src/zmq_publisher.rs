//! The replica's KV events over ZMQ, in vLLM's wire format (`--kv-events tcp://*:5557`), so
//! routers that speak vLLM's events (llm-d, Dynamo, kvgate's own gateway) can follow a kvgate
//! replica as they follow vLLM: a PUB socket sends `[topic, sequence (8 bytes, big-endian),
//! msgpack batch]` for every batch of the event hub, and an optional ROUTER socket
//! (`--kv-events-replay tcp://*:5558`) answers `[empty, start]` with every buffered batch from
//! `start` on (`[empty, seq, batch]`) and then `[empty, -1, ""]`, as vLLM's
//! `ZmqEventPublisher` does. The batches are the hub's own, so the sequence numbers are the ones
//! `/kv_events` carries.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::broadcast;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv_hub::KvEventHub;

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BUFFER: usize = 10_000;

/// The topic every batch is sent under (vLLM's default is empty; subscribers take any).
pub const TOPIC: &[u8] = b"kv-events";

/// `tcp://*:5557` (vLLM's spelling of "every interface") → `tcp://0.0.0.0:5557`.
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Binds the sockets, then publishes every hub batch until the hub closes. Errors binding are
/// returned (the replica refuses to start); later send errors are logged and skipped.
pub async fn start(
    hub: Arc<KvEventHub>,
    endpoint: &str,
    replay: Option<&str>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let mut publisher = zeromq::PubSocket::new();
    publisher
        .bind(&bindable(endpoint))
        .await
        .map_err(|e| format!("--kv-events {endpoint}: {e}"))?;
    let mut router = match replay {
        Some(r) => {
            let mut s = zeromq::RouterSocket::new();
            s.bind(&bindable(r))
                .await
                .map_err(|e| format!("--kv-events-replay {r}: {e}"))?;
            Some(s)
        }
        None => None,
    };
    // The snapshot is for HTTP subscribers; ZMQ subscribers, as with vLLM, see what happens
    // from now on (and can replay the buffer).
    let (_snapshot, mut rx) = hub.subscribe();
    let closed = hub.closed();
    Ok(tokio::spawn(async move {
        tokio::pin!(closed);
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
        loop {
            tokio::select! {
                frame = rx.recv() => match frame {
                    Ok(frame) => {
                        let Some((seq, payload)) = split_frame(&frame) else { continue };
                        let mut msg = ZmqMessage::from(Bytes::from_static(TOPIC));
                        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                        msg.push_back(payload.clone());
                        if let Err(e) = publisher.send(msg).await {
                            tracing::warn!(error = %e, "cannot publish a KV event batch over ZMQ");
                        }
                        if buffer.len() == REPLAY_BUFFER {
                            buffer.pop_front();
                        }
                        buffer.push_back((seq, payload));
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        // Subscribers see the gap in the sequence and replay or start over.
                        tracing::warn!(missed = n, "the ZMQ publisher fell behind the event hub");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                req = async {
                    match router.as_mut() {
                        Some(r) => r.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if let (Ok(req), Some(r)) = (req, router.as_mut()) {
                        serve_replay(r, req, &buffer).await;
                    }
                }
                _ = &mut closed => return,
            }
        }
    }))
}

/// `[identity, empty, start]` → every buffered batch from `start`, then the end marker.
async fn serve_replay(
    router: &mut zeromq::RouterSocket,
    req: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let frames = req.into_vec();
    let [id, _, start] = frames.as_slice() else {
        tracing::warn!(frames = frames.len(), "malformed KV event replay request");
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
        return;
    };
    let reply = |seq: &[u8], payload: Bytes| {
        let mut m = ZmqMessage::from(id.clone());
        m.push_back(Bytes::new());
        m.push_back(Bytes::copy_from_slice(seq));
        m.push_back(payload);
        m
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if router
            .send(reply(&seq.to_be_bytes(), payload.clone()))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = router
        .send(reply(&(-1i64).to_be_bytes(), Bytes::new()))
        .await;
}

/// A hub frame (`seq u64 BE ‖ len u32 BE ‖ msgpack`) → (seq, msgpack).
fn split_frame(frame: &Bytes) -> Option<(u64, Bytes)> {
    let seq = u64::from_be_bytes(frame.get(..8)?.try_into().ok()?);
    let len = u32::from_be_bytes(frame.get(8..12)?.try_into().ok()?) as usize;
    (frame.len() == 12 + len).then(|| (seq, frame.slice(12..)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::kv_events::{encode_frame, KvEventBatch};

    #[test]
    fn hub_frames_split_into_sequence_and_batch() {
        let batch = KvEventBatch {
            ts: 1.0,
            events: vec![],
            data_parallel_rank: None,
        };
        let f = encode_frame(42, &batch);
        let (seq, payload) = split_frame(&f).unwrap();
        assert_eq!(seq, 42);
        assert_eq!(KvEventBatch::decode(&payload).unwrap(), batch);
        assert_eq!(split_frame(&f.slice(..10)), None);
        assert_eq!(bindable("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }
}
