use super::*;

fn sample() -> KvEventBatch {
    KvEventBatch {
        ts: 1_700_000_000.5,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![1, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![5; 32],
                block_size: 16,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
            // A LoRA adapter's block, named as vLLM names it beside the numeric id.
            KvEvent::BlockStored {
                block_hashes: vec![2],
                parent_block_hash: Some(1),
                token_ids: vec![6; 16],
                block_size: 16,
                lora_id: Some(1),
                medium: Some("GPU".into()),
                lora_name: Some("sql-adapter".into()),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![7],
                medium: Some("GPU".into()),
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: None,
    }
}

#[test]
fn round_trips_through_msgpack() {
    let b = sample();
    assert_eq!(KvEventBatch::decode(&b.encode()).unwrap(), b);
}

/// The bytes msgspec writes for vLLM's `KVEventBatch(ts=1.5, events=[BlockRemoved(
/// block_hashes=[7], medium=None)])`: a 2-array of a float64 and a 1-array holding the
/// tagged 3-array.
#[test]
fn matches_vllm_wire_layout() {
    let b = KvEventBatch {
        ts: 1.5,
        events: vec![KvEvent::BlockRemoved {
            block_hashes: vec![7],
            medium: None,
        }],
        data_parallel_rank: None,
    };
    let mut expected = vec![0x92, 0xcb];
    expected.extend_from_slice(&1.5f64.to_be_bytes());
    expected.extend_from_slice(&[0x91, 0x93, 0xac]);
    expected.extend_from_slice(b"BlockRemoved");
    expected.extend_from_slice(&[0x91, 0x07, 0xc0]);
    assert_eq!(b.encode(), expected);
}

#[test]
fn decodes_sglangs_shorter_events() {
    // SGLang: BlockStored ends at lora_id, BlockRemoved has only its hashes.
    let batch = Value::Array(vec![
        Value::from(2.0),
        Value::Array(vec![
            Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(5u64)]),
                Value::Nil,
                Value::Array((0..16).map(Value::from).collect()),
                Value::from(16),
                Value::Nil,
            ]),
            Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![Value::from(5u64)]),
            ]),
        ]),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let b = KvEventBatch::decode(&bytes).unwrap();
    assert!(matches!(
        &b.events[0],
        KvEvent::BlockStored {
            medium: None,
            block_size: 16,
            ..
        }
    ));
    assert_eq!(
        b.events[1],
        KvEvent::BlockRemoved {
            block_hashes: vec![5],
            medium: None
        }
    );
}

#[test]
fn decodes_the_map_layout_of_newer_vllm() {
    // msgspec without array_like: the batch and each event are maps, the tag under "type".
    let m = |pairs: Vec<(&str, Value)>| {
        Value::Map(
            pairs
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        )
    };
    let stored = m(vec![
        ("type", Value::from("BlockStored")),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![7; 32])]),
        ),
        ("parent_block_hash", Value::Nil),
        (
            "token_ids",
            Value::Array((0..16).map(Value::from).collect()),
        ),
        ("block_size", Value::from(16)),
        ("lora_id", Value::Nil),
        ("medium", Value::from("GPU")),
        ("lora_name", Value::Nil),
    ]);
    let removed = m(vec![
        ("type", Value::from("BlockRemoved")),
        ("block_hashes", Value::Array(vec![Value::from(9u64)])),
        ("medium", Value::from("GPU")),
    ]);
    let batch = m(vec![
        ("ts", Value::from(1.5)),
        ("events", Value::Array(vec![stored, removed])),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let b = KvEventBatch::decode(&bytes).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.data_parallel_rank, None);
    match &b.events[0] {
        KvEvent::BlockStored {
            block_hashes,
            token_ids,
            block_size,
            medium,
            ..
        } => {
            assert_eq!(block_hashes, &[xxhash_rust::xxh3::xxh3_64(&[7; 32])]);
            assert_eq!(token_ids.len(), 16);
            assert_eq!(*block_size, 16);
            assert_eq!(medium.as_deref(), Some("GPU"));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(
        b.events[1],
        KvEvent::BlockRemoved {
            block_hashes: vec![9],
            medium: Some("GPU".into())
        }
    );
}

#[test]
fn decodes_vllm_extras_and_byte_hashes() {
    // A newer vLLM adds trailing fields and may send hashes as bytes.
    let v = Value::Array(vec![
        Value::from(2.0),
        Value::Array(vec![Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::Binary(vec![1, 2, 3]), Value::from(-5i64)]),
            Value::from(9u64),
            Value::Array(vec![Value::from(1u32)]),
            Value::from(16u32),
            Value::Nil,
            Value::from("GPU"),
            Value::from("lora-name"),
        ])]),
        Value::from(0i64),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    let b = KvEventBatch::decode(&bytes).unwrap();
    assert_eq!(b.data_parallel_rank, Some(0));
    match &b.events[0] {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            ..
        } => {
            assert_eq!(block_hashes[1], (-5i64) as u64);
            assert_eq!(*parent_block_hash, Some(9));
        }
        e => panic!("unexpected {e:?}"),
    }
}

#[test]
fn frames_survive_arbitrary_splits() {
    let mut wire = encode_frame(1, &sample()).to_vec();
    wire.extend_from_slice(&encode_frame(2, &sample()));
    let mut d = FrameDecoder::new();
    let mut got = Vec::new();
    for c in wire.chunks(7) {
        got.extend(d.feed(c).unwrap());
    }
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].0, 1);
    assert_eq!(got[1].1, sample());
}
