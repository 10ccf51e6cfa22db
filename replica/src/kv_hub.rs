//! The replica's KV event stream: every engine step's cache changes become one numbered
//! [`KvEventBatch`], broadcast to subscribers. A subscriber first receives a snapshot — an
//! `AllBlocksCleared` followed by a `BlockStored` for every block cached now — numbered with the
//! sequence of the last batch it reflects, then every later batch. Snapshot and subscription are
//! taken under one lock, so nothing falls between them. A subscriber that lags behind the
//! broadcast buffer is disconnected and must reconnect for a fresh snapshot, never silently
//! miss events.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use protocol::kv_events::{encode_frame, KvEvent, KvEventBatch};
use tokio::sync::broadcast;

/// Batches a subscriber may fall behind before it is cut off.
const BROADCAST_CAPACITY: usize = 4096;

struct MirrorBlock {
    order: u64,
    parent: Option<u64>,
    tokens: Vec<u32>,
}

#[derive(Default)]
struct Mirror {
    seq: u64,
    next_order: u64,
    blocks: HashMap<u64, MirrorBlock>,
    by_order: BTreeMap<u64, u64>,
}

impl Mirror {
    fn apply(&mut self, ev: &KvEvent) {
        match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                let bs = (*block_size as usize).max(1);
                let mut parent = *parent_block_hash;
                for (i, &h) in block_hashes.iter().enumerate() {
                    let tokens = token_ids
                        .get(i * bs..(i + 1) * bs)
                        .map(<[u32]>::to_vec)
                        .unwrap_or_default();
                    let order = self.next_order;
                    self.next_order += 1;
                    if let Some(old) = self.blocks.insert(
                        h,
                        MirrorBlock {
                            order,
                            parent,
                            tokens,
                        },
                    ) {
                        self.by_order.remove(&old.order);
                    }
                    self.by_order.insert(order, h);
                    parent = Some(h);
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    if let Some(old) = self.blocks.remove(h) {
                        self.by_order.remove(&old.order);
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                self.blocks.clear();
                self.by_order.clear();
            }
        }
    }
}

pub struct KvEventHub {
    block_size: u32,
    mirror: Mutex<Mirror>,
    tx: broadcast::Sender<Bytes>,
    closing: tokio::sync::watch::Sender<bool>,
}

/// One wire frame: the batch of `events`, stamped now, numbered `seq`.
fn frame(seq: u64, events: Vec<KvEvent>) -> Bytes {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    encode_frame(
        seq,
        &KvEventBatch {
            ts,
            events,
            data_parallel_rank: None,
        },
    )
}

impl KvEventHub {
    pub fn new(block_size: usize) -> Self {
        let (tx, _) = broadcast::channel(BROADCAST_CAPACITY);
        KvEventHub {
            block_size: block_size as u32,
            mirror: Mutex::new(Mirror::default()),
            tx,
            closing: tokio::sync::watch::channel(false).0,
        }
    }

    /// Ends every subscriber's stream (the replica is shutting down: an endless `/kv_events`
    /// response must not hold its connection open through the drain).
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once [`KvEventHub::close`] has been called.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closing.subscribe();
        async move {
            let _ = rx.wait_for(|c| *c).await;
        }
    }

    /// Publishes one step's events as the next batch.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let mut m = self.mirror.lock();
        for ev in &events {
            m.apply(ev);
        }
        m.seq += 1;
        let frame = frame(m.seq, events);
        // No subscribers is fine: the mirror keeps the state for the next one.
        let _ = self.tx.send(frame);
    }

    /// The snapshot frame and a receiver for every batch after it.
    pub fn subscribe(&self) -> (Bytes, broadcast::Receiver<Bytes>) {
        let m = self.mirror.lock();
        let mut events = Vec::with_capacity(m.blocks.len() + 1);
        events.push(KvEvent::AllBlocksCleared);
        for h in m.by_order.values() {
            let b = &m.blocks[h];
            events.push(KvEvent::BlockStored {
                block_hashes: vec![*h],
                parent_block_hash: b.parent,
                token_ids: b.tokens.clone(),
                block_size: self.block_size,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
            });
        }
        let frame = frame(m.seq, events);
        (frame, self.tx.subscribe())
    }

    pub fn sequence(&self) -> u64 {
        self.mirror.lock().seq
    }

    pub fn num_blocks(&self) -> usize {
        self.mirror.lock().blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::kv_events::FrameDecoder;

    fn stored(hashes: Vec<u64>, parent: Option<u64>) -> KvEvent {
        KvEvent::BlockStored {
            token_ids: vec![1; 4 * hashes.len()],
            block_hashes: hashes,
            parent_block_hash: parent,
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
        }
    }

    #[test]
    fn late_subscriber_sees_earlier_blocks_then_live_deltas() {
        let hub = KvEventHub::new(4);
        hub.publish(vec![stored(vec![1, 2, 3], None)]);
        hub.publish(vec![KvEvent::BlockRemoved {
            block_hashes: vec![3],
            medium: None,
        }]);
        let (snap, mut rx) = hub.subscribe();
        let mut d = FrameDecoder::new();
        let frames = d.feed(&snap).unwrap();
        assert_eq!(frames[0].0, 2);
        let ev = &frames[0].1.events;
        assert_eq!(ev[0], KvEvent::AllBlocksCleared);
        assert_eq!(ev.len(), 3);
        match &ev[2] {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                ..
            } => {
                assert_eq!(block_hashes, &vec![2]);
                assert_eq!(*parent_block_hash, Some(1));
            }
            e => panic!("{e:?}"),
        }
        hub.publish(vec![stored(vec![9], Some(2))]);
        let next = rx.try_recv().unwrap();
        let frames = d.feed(&next).unwrap();
        assert_eq!(frames[0].0, 3);
        assert_eq!(hub.num_blocks(), 3);
    }
}
