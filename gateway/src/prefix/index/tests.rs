use super::*;

fn stored(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 16,
        lora_id: None,
        medium: None,
        lora_name: None,
    }
}

#[test]
fn longest_consecutive_run_per_replica_from_events() {
    let idx = PrefixIndex::new(100, 1 << 20);
    idx.apply(0, &stored(&[1, 2, 3, 4]));
    idx.apply(1, &stored(&[1, 2]));
    idx.apply(2, &stored(&[2, 3])); // holds later blocks but not the first: no match
    assert_eq!(
        idx.match_lengths(&[1, 2, 3, 9], 3, 0, &[0; 3]),
        vec![3, 2, 0]
    );
    idx.apply(
        0,
        &KvEvent::BlockRemoved {
            block_hashes: vec![2],
            medium: None,
        },
    );
    assert_eq!(idx.match_lengths(&[1, 2, 3], 3, 0, &[0; 3]), vec![1, 2, 0]);
    idx.apply(1, &KvEvent::AllBlocksCleared);
    assert_eq!(idx.match_lengths(&[1, 2, 3], 3, 0, &[0; 3]), vec![1, 0, 0]);
}

#[test]
fn the_offload_tier_extends_a_match_apart_from_the_gpu_run() {
    let idx = PrefixIndex::new(100, 1 << 20);
    let tier = |hashes: &[u64], medium: &str| KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 16,
        lora_id: None,
        medium: Some(medium.into()),
        lora_name: None,
    };
    let h = [1, 2, 3, 4, 5];
    // Nothing offloaded anywhere: no lookups, zeros.
    idx.apply(0, &stored(&[1, 2]));
    assert_eq!(idx.offloaded_lengths(&h, &[2, 0]), vec![0, 0]);
    idx.apply(0, &tier(&[3, 4], "CPU"));
    idx.apply(1, &tier(&[1], "cpu"));
    let gpu = idx.match_lengths(&h, 2, 0, &[0; 2]);
    assert_eq!(gpu, vec![2, 0], "offloaded blocks are not GPU hits");
    assert_eq!(idx.offloaded_lengths(&h, &gpu), vec![2, 1]);
    // Dropping a block from the CPU tier cuts the run there; its GPU bits are untouched.
    idx.apply(
        0,
        &KvEvent::BlockRemoved {
            block_hashes: vec![4],
            medium: Some("CPU".into()),
        },
    );
    assert_eq!(idx.offloaded_lengths(&h, &gpu), vec![1, 1]);
    idx.apply(
        0,
        &KvEvent::BlockRemoved {
            block_hashes: vec![1],
            medium: Some("CPU".into()),
        },
    );
    assert_eq!(idx.match_lengths(&h, 2, 0, &[0; 2]), vec![2, 0]);
    // A cleared replica loses both tiers.
    idx.apply(1, &KvEvent::AllBlocksCleared);
    assert_eq!(idx.offloaded_lengths(&h, &[2, 0]), vec![1, 0]);
}

#[test]
fn approximate_records_expire_and_are_capacity_bounded() {
    let idx = PrefixIndex::new(4, 1 << 20);
    idx.record_routed(0, &[1, 2, 3], 10);
    assert_eq!(idx.match_lengths(&[1, 2, 3], 2, 15, &[60, 60]), vec![3, 0]);
    assert_eq!(
        idx.match_lengths(&[1, 2, 3], 2, 80, &[60, 60]),
        vec![0, 0],
        "expired"
    );
    // Capacity 4: recording two more blocks pushes out the oldest record (block 1).
    idx.record_routed(0, &[7, 8], 20);
    assert_eq!(idx.match_lengths(&[1, 2, 3], 1, 21, &[60]), vec![0]);
    assert_eq!(idx.match_lengths(&[7, 8], 1, 21, &[60]), vec![2]);
    idx.expire(200, 60);
    assert!(idx.is_empty());
}

#[test]
fn exact_bits_outlive_speculation_and_removal_clears_both() {
    let idx = PrefixIndex::new(100, 1 << 20);
    idx.record_routed(1, &[5, 6], 0);
    idx.apply(1, &stored(&[5]));
    assert_eq!(idx.match_lengths(&[5, 6], 2, 100, &[10, 10]), vec![0, 1]);
    idx.remove_replica(1);
    assert_eq!(idx.match_lengths(&[5, 6], 2, 0, &[10, 10]), vec![0, 0]);
    assert!(idx.is_empty());
}

#[test]
fn slots_beyond_64_live_in_further_groups() {
    let idx = PrefixIndex::new(100, 1 << 20);
    idx.apply(3, &stored(&[1, 2, 3]));
    idx.apply(70, &stored(&[1, 2]));
    idx.record_routed(130, &[1], 5);
    let ttl = vec![60; 140];
    let m = idx.match_lengths(&[1, 2, 3], 140, 6, &ttl);
    assert_eq!(m.len(), 140);
    assert_eq!((m[3], m[70], m[130]), (3, 2, 1));
    assert_eq!(m.iter().filter(|&&x| x > 0).count(), 3);
    // A fleet listed past the groups in use: the missing groups match nothing.
    assert_eq!(idx.match_lengths(&[1], 300, 6, &[60; 300])[200], 0);
    idx.remove_replica(70);
    assert_eq!(idx.match_lengths(&[1, 2], 140, 6, &ttl)[70], 0);
}

#[test]
fn stays_under_72_bytes_per_reported_block() {
    const { assert!(BYTES_PER_BLOCK <= 64) };
    let idx = PrefixIndex::new(10, 1 << 20);
    idx.apply(3, &stored(&(0..1000).collect::<Vec<_>>()));
    assert_eq!(idx.len(), 1000);
    // The entry, and the replica's order queue's record of it.
    assert_eq!(idx.size_bytes(), 1000 * (BYTES_PER_BLOCK + 8));
}

#[test]
fn a_publisher_that_never_removes_is_held_to_its_cap_oldest_first() {
    let idx = PrefixIndex::new(10, 1 << 20);
    idx.set_capacity(0, Some(1000));
    let cap = cap_for(1000);
    let mut evicted = 0;
    for batch in 0..100u64 {
        let hashes: Vec<u64> = (batch * 100..batch * 100 + 100).collect();
        evicted += idx.apply(0, &stored(&hashes));
    }
    assert_eq!(
        idx.len(),
        cap,
        "10,000 stored, none removed: the index holds the cap"
    );
    assert_eq!(evicted, 10_000 - cap);
    // The newest are kept, the oldest dropped.
    assert_eq!(idx.match_lengths(&[9_999], 1, 0, &[0]), vec![1]);
    assert_eq!(idx.match_lengths(&[0], 1, 0, &[0]), vec![0]);
    // Another replica's blocks are not touched by this one's cap.
    idx.apply(1, &stored(&[0, 1, 2]));
    assert_eq!(idx.match_lengths(&[0, 1, 2], 2, 0, &[0, 0]), vec![0, 3]);
}

#[test]
fn removals_keep_a_replica_under_its_cap_and_a_resync_starts_it_over() {
    let idx = PrefixIndex::new(10, 1 << 20);
    idx.set_capacity(0, Some(0)); // cap_for(0) = 1,024
    let removed = |hashes: &[u64]| KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: None,
    };
    // A well-behaved engine: stores and removes, churning far past the cap without eviction.
    let mut evicted = 0;
    for i in 0..50u64 {
        let hashes: Vec<u64> = (i * 1000..i * 1000 + 1000).collect();
        evicted += idx.apply(0, &stored(&hashes));
        idx.apply(0, &removed(&hashes));
    }
    assert_eq!(evicted, 0);
    assert!(idx.is_empty());
    assert!(
        idx.size_bytes() < 4096 * 8,
        "the order queue is compacted: {}",
        idx.size_bytes()
    );
    idx.apply(0, &stored(&(0..1000).collect::<Vec<_>>()));
    idx.apply(0, &KvEvent::AllBlocksCleared);
    assert_eq!(idx.apply(0, &stored(&(5000..6000).collect::<Vec<_>>())), 0);
    assert_eq!(idx.len(), 1000);
}

#[test]
fn expired_approximate_records_leave_their_queue_too() {
    let idx = PrefixIndex::new(200_000, 1 << 20);
    for t in 0..100u32 {
        let hashes: Vec<u64> = (u64::from(t) * 100..u64::from(t) * 100 + 100).collect();
        idx.record_routed(0, &hashes, t);
    }
    assert_eq!(idx.size_bytes(), 10_000 * (BYTES_PER_BLOCK + 16));
    // A 30 s TTL at t = 100: only the records of the last 30 seconds stay, map and queue.
    idx.expire(100, 30);
    assert_eq!(idx.len(), 2_900);
    assert_eq!(idx.size_bytes(), 2_900 * (BYTES_PER_BLOCK + 16));
    idx.expire(1_000, 30);
    assert_eq!(idx.size_bytes(), 0);
}

#[test]
fn all_blocks_cleared_drops_the_speculative_records_too() {
    let idx = PrefixIndex::new(1000, 1 << 20);
    idx.apply(0, &stored(&[1, 2]));
    idx.record_routed(0, &[1, 2, 3, 4], 5);
    idx.record_routed(1, &[1, 2, 3, 4], 5);
    assert_eq!(
        idx.match_lengths(&[1, 2, 3, 4], 2, 6, &[30, 30]),
        vec![4, 4]
    );
    idx.apply(0, &KvEvent::AllBlocksCleared);
    assert_eq!(
        idx.match_lengths(&[1, 2, 3, 4], 2, 6, &[30, 30]),
        vec![0, 4],
        "replica 0 holds nothing, not even what was sent there; replica 1 is untouched"
    );
}
