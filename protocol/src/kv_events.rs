//! KV-cache events, modelled on vLLM's `KVEventBatch` and encoded as vLLM encodes them with
//! msgspec (`array_like=True`, `tag=True`): a batch is the msgpack array `[ts, [event, ...]]`
//! (a third element, the data-parallel rank, only when set) and each event is an array whose
//! first element is its tag: `["BlockStored", block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
//! `["AllBlocksCleared"]`. The decoder accepts vLLM's and SGLang's batches too: that array
//! layout (SGLang; vLLM as its example subscriber shows it), the map layout of vLLM's main branch
//! (commit 0181ea3 read for this: batch and events are
//! msgpack maps, the event's tag under `"type"`), trailing fields it does not know, and block
//! hashes sent as bytes (folded to a u64 with xxh3).
//!
//! Over HTTP (`GET /kv_events` on a replica) batches travel as frames: an 8-byte big-endian
//! sequence number, a 4-byte big-endian payload length, then the msgpack payload. The sequence
//! number is the same one vLLM puts in its ZMQ multipart messages; a gap means a lost batch and
//! the subscriber must resync from a fresh snapshot.

use bytes::{BufMut, Bytes, BytesMut};
use rmpv::Value;

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<String>,
        /// The LoRA adapter's name (vLLM ≥ 0.11 publishes it beside the deprecated numeric
        /// id, which differs between engines): the key of the adapter's blocks.
        lora_name: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the batch was published.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvEventError {
    #[error("msgpack decode failed: {0}")]
    Msgpack(String),
    #[error("unexpected shape: {0}")]
    Shape(&'static str),
    #[error("unknown event tag `{0}`")]
    UnknownTag(String),
    #[error("frame of {0} bytes exceeds the {1}-byte limit")]
    FrameTooLarge(usize, usize),
}

fn opt_u64(v: Option<u64>) -> Value {
    v.map_or(Value::Nil, Value::from)
}

fn opt_str(v: &Option<String>) -> Value {
    v.as_ref().map_or(Value::Nil, |s| Value::from(s.as_str()))
}

fn hashes_value(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

impl KvEvent {
    fn to_value(&self) -> Value {
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
            } => {
                let mut fields = vec![
                    Value::from("BlockStored"),
                    hashes_value(block_hashes),
                    opt_u64(*parent_block_hash),
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    Value::from(*block_size),
                    opt_u64(*lora_id),
                    opt_str(medium),
                ];
                // Left out when absent, as engines before the field send it.
                if lora_name.is_some() {
                    fields.push(opt_str(lora_name));
                }
                Value::Array(fields)
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => Value::Array(vec![
                Value::from("BlockRemoved"),
                hashes_value(block_hashes),
                opt_str(medium),
            ]),
            KvEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
        }
    }

    /// An event as an array (`array_like`: the tag first, then the fields in order — SGLang,
    /// older vLLM, kvgate) or as a map (vLLM's main branch: the tag under `"type"`, fields by
    /// name).
    fn from_value(v: &Value) -> Result<Self, KvEventError> {
        if let Some(map) = v.as_map() {
            return Self::from_map(map);
        }
        let arr = v
            .as_array()
            .ok_or(KvEventError::Shape("event is neither an array nor a map"))?;
        let tag = arr
            .first()
            .and_then(Value::as_str)
            .ok_or(KvEventError::Shape("event has no tag"))?;
        let field = |i: usize| arr.get(i).unwrap_or(&Value::Nil);
        match tag {
            "BlockStored" => Ok(KvEvent::BlockStored {
                block_hashes: decode_hashes(field(1))?,
                parent_block_hash: decode_opt_hash(field(2))?,
                token_ids: field(3)
                    .as_array()
                    .ok_or(KvEventError::Shape("token_ids is not an array"))?
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|x| u32::try_from(x).ok())
                            .ok_or(KvEventError::Shape("token id is not a u32"))
                    })
                    .collect::<Result<_, _>>()?,
                block_size: field(4)
                    .as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or(KvEventError::Shape("block_size is not an integer"))?,
                lora_id: field(5).as_u64(),
                medium: field(6).as_str().map(str::to_string),
                lora_name: field(7).as_str().map(str::to_string),
            }),
            "BlockRemoved" => Ok(KvEvent::BlockRemoved {
                block_hashes: decode_hashes(field(1))?,
                medium: field(2).as_str().map(str::to_string),
            }),
            "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
            other => Err(KvEventError::UnknownTag(other.to_string())),
        }
    }

    fn from_map(map: &[(Value, Value)]) -> Result<Self, KvEventError> {
        let get = |name: &str| {
            map.iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map_or(&Value::Nil, |(_, v)| v)
        };
        let tag = get("type")
            .as_str()
            .ok_or(KvEventError::Shape("event map has no \"type\" tag"))?;
        // The array decoder does the field checks: lay the map out in its order.
        let fields: &[&str] = match tag {
            "BlockStored" => &[
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ],
            "BlockRemoved" => &["block_hashes", "medium"],
            "AllBlocksCleared" => &[],
            other => return Err(KvEventError::UnknownTag(other.to_string())),
        };
        let mut arr = vec![Value::from(tag)];
        arr.extend(fields.iter().map(|f| get(f).clone()));
        Self::from_value(&Value::Array(arr))
    }
}

/// vLLM sends hashes as integers (possibly negative when they come from Python's `hash`) or,
/// with sha256 hashing, as bytes; both become a u64.
fn decode_hash(v: &Value) -> Result<u64, KvEventError> {
    if let Some(x) = v.as_u64() {
        return Ok(x);
    }
    if let Some(x) = v.as_i64() {
        return Ok(x as u64);
    }
    if let Some(b) = v.as_slice() {
        return Ok(xxhash_rust::xxh3::xxh3_64(b));
    }
    Err(KvEventError::Shape(
        "block hash is neither an integer nor bytes",
    ))
}

fn decode_opt_hash(v: &Value) -> Result<Option<u64>, KvEventError> {
    if v.is_nil() {
        Ok(None)
    } else {
        decode_hash(v).map(Some)
    }
}

fn decode_hashes(v: &Value) -> Result<Vec<u64>, KvEventError> {
    v.as_array()
        .ok_or(KvEventError::Shape("block_hashes is not an array"))?
        .iter()
        .map(decode_hash)
        .collect()
}

impl KvEventBatch {
    /// msgpack bytes, as vLLM's msgspec encoder writes them.
    pub fn encode(&self) -> Vec<u8> {
        let mut fields = vec![
            Value::from(self.ts),
            Value::Array(self.events.iter().map(KvEvent::to_value).collect()),
        ];
        if let Some(rank) = self.data_parallel_rank {
            fields.push(Value::from(rank));
        }
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        rmpv::encode::write_value(&mut out, &Value::Array(fields)).expect("write to Vec");
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, KvEventError> {
        let mut rd = bytes;
        let v =
            rmpv::decode::read_value(&mut rd).map_err(|e| KvEventError::Msgpack(e.to_string()))?;
        // A batch is `[ts, events, rank]`, or (vLLM's main branch) a map of those names.
        let arr = match v.as_map() {
            Some(map) => {
                let get = |name: &str| {
                    map.iter()
                        .find(|(k, _)| k.as_str() == Some(name))
                        .map_or(Value::Nil, |(_, v)| v.clone())
                };
                vec![get("ts"), get("events"), get("data_parallel_rank")]
            }
            None => v
                .as_array()
                .ok_or(KvEventError::Shape("batch is neither an array nor a map"))?
                .clone(),
        };
        let ts = arr
            .first()
            .and_then(|t| t.as_f64().or_else(|| t.as_i64().map(|x| x as f64)))
            .ok_or(KvEventError::Shape("batch has no timestamp"))?;
        let events = arr
            .get(1)
            .and_then(Value::as_array)
            .ok_or(KvEventError::Shape("batch has no event list"))?
            .iter()
            .map(KvEvent::from_value)
            .collect::<Result<_, _>>()?;
        let data_parallel_rank = arr.get(2).and_then(Value::as_i64);
        Ok(KvEventBatch {
            ts,
            events,
            data_parallel_rank,
        })
    }
}

/// Largest frame a decoder accepts: a snapshot of a very large cache still fits.
pub const MAX_FRAME_BYTES: usize = 256 << 20;

/// One frame of the HTTP event stream.
pub fn encode_frame(seq: u64, batch: &KvEventBatch) -> Bytes {
    let payload = batch.encode();
    let mut out = BytesMut::with_capacity(12 + payload.len());
    out.put_u64(seq);
    out.put_u32(payload.len() as u32);
    out.put_slice(&payload);
    out.freeze()
}

/// Incremental frame reader for the HTTP event stream.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns every complete `(sequence, batch)` in order.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<(u64, KvEventBatch)>, KvEventError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while self.buf.len() - start >= 12 {
            let head = &self.buf[start..start + 12];
            let seq = u64::from_be_bytes(head[..8].try_into().expect("8 bytes"));
            let len = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
            if len > MAX_FRAME_BYTES {
                return Err(KvEventError::FrameTooLarge(len, MAX_FRAME_BYTES));
            }
            if self.buf.len() - start < 12 + len {
                break;
            }
            let batch = KvEventBatch::decode(&self.buf[start + 12..start + 12 + len])?;
            out.push((seq, batch));
            start += 12 + len;
        }
        self.buf.drain(..start);
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
