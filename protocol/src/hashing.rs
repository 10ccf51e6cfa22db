//! Block hashing: the one function that names a block of KV cache across processes.
//!
//! A block's hash is xxh3-64, with the fixed seed [`BLOCK_HASH_SEED`], over the parent block's
//! hash (little-endian u64) followed by the block's token ids (each little-endian u32). The
//! first block's parent is a root hash derived from the model name, the LoRA adapter and the
//! request's `cache_salt`, so caches never match across models or tenants. Only full blocks are
//! hashed. The gateway predicts with this function and the replica caches with it; the golden
//! test below pins the values, so changing them is a deliberate, breaking change.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every block hash: ASCII "kvgate" and a format version.
pub const BLOCK_HASH_SEED: u64 = 0x6b76_6761_7465_0001;

/// Default KV block size in tokens.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The parent hash of a sequence's first block.
pub fn root_hash(model: &str, lora: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut bytes = Vec::with_capacity(16 + model.len());
    bytes.extend_from_slice(b"kvgate-root\0");
    bytes.extend_from_slice(model.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(lora.unwrap_or("").as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(cache_salt.unwrap_or("").as_bytes());
    xxh3_64_with_seed(&bytes, BLOCK_HASH_SEED)
}

/// The hash of one full block given its parent's hash.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + 4 * tokens.len());
    hash_into(&mut bytes, parent, tokens)
}

fn hash_into(scratch: &mut Vec<u8>, parent: u64, tokens: &[u32]) -> u64 {
    scratch.clear();
    scratch.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(scratch, BLOCK_HASH_SEED)
}

/// Extends `hashes` (the chain already computed for a prefix of `tokens`) with the hash of
/// every further full block of `tokens`. Incremental so a growing sequence hashes each block
/// once.
pub fn extend_block_hashes(hashes: &mut Vec<u64>, root: u64, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    if hashes.len() >= full {
        return;
    }
    let mut scratch = Vec::with_capacity(8 + 4 * block_size);
    let mut parent = hashes.last().copied().unwrap_or(root);
    for i in hashes.len()..full {
        let h = hash_into(
            &mut scratch,
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        );
        hashes.push(h);
        parent = h;
    }
}

/// The hashes of every full block of `tokens`.
pub fn block_hashes(root: u64, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    extend_block_hashes(&mut hashes, root, tokens, block_size);
    hashes
}

/// How many leading blocks of a prompt can be served from cache. The last prompt token is
/// always computed (its logits give the first output token), so a prompt of exactly k full
/// blocks can reuse at most k-1 of them, as in vLLM.
pub fn cacheable_prompt_blocks(prompt_len: usize, block_size: usize) -> usize {
    prompt_len.saturating_sub(1) / block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden values, cross-checked with the Python `xxhash` package: if this test fails, every deployed gateway and replica disagree on which
    /// prefixes are cached. Change them only together with `BLOCK_HASH_SEED`.
    #[test]
    fn golden_block_hashes() {
        let root = root_hash("Qwen3-8B", None, None);
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = block_hashes(root, &tokens, 16);
        assert_eq!(root, 0xebc0_ea81_e2bf_f070);
        assert_eq!(hashes, vec![0x9ced_7c95_a722_d632, 0xe292_46dc_d7d8_ec63]);
    }

    #[test]
    fn chains_through_the_parent() {
        let root = root_hash("m", None, None);
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[3] = 999; // differs in the first block only
        let ha = block_hashes(root, &a, 16);
        let hb = block_hashes(root, &b, 16);
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "second block differs because its parent does");
        assert_eq!(ha[1], block_hash(ha[0], &a[16..32]));
    }

    #[test]
    fn salt_and_model_separate_caches() {
        let t: Vec<u32> = (0..16).collect();
        let plain = block_hashes(root_hash("m", None, None), &t, 16);
        let salted = block_hashes(root_hash("m", None, Some("tenant-a")), &t, 16);
        let other = block_hashes(root_hash("n", None, None), &t, 16);
        let lora = block_hashes(root_hash("m", Some("adapter"), None), &t, 16);
        assert_ne!(plain, salted);
        assert_ne!(plain, other);
        assert_ne!(plain, lora);
    }

    #[test]
    fn hashes_full_blocks_only_and_extends_incrementally() {
        let root = root_hash("m", None, None);
        let t: Vec<u32> = (0..47).collect();
        assert_eq!(block_hashes(root, &t, 16).len(), 2);
        let mut inc = block_hashes(root, &t[..20], 16);
        extend_block_hashes(&mut inc, root, &t, 16);
        assert_eq!(inc, block_hashes(root, &t, 16));
    }

    #[test]
    fn last_prompt_token_is_never_cached() {
        assert_eq!(cacheable_prompt_blocks(32, 16), 1);
        assert_eq!(cacheable_prompt_blocks(33, 16), 2);
        assert_eq!(cacheable_prompt_blocks(1, 16), 0);
        assert_eq!(cacheable_prompt_blocks(0, 16), 0);
    }
}
