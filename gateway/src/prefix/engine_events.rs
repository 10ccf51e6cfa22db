//! KV events from engines that hash blocks their own way (vLLM: sha256, sha256_cbor, Python's
//! seeded `hash`; SGLang: its own): the gateway rebuilds its own chained hash for every stored
//! block from the block's tokens and its parent's hash, and keeps a map from the engine's hash
//! to its own, so `BlockRemoved` and later parents find the block whatever the engine's hash
//! function. The translated events are what the prefix index applies.
//!
//! - A block's root: the model's root hash, or, for a LoRA adapter, the root of the base model
//!   with the adapter's name (`lora_name`) — what the gateway hashes a prompt for that adapter
//!   with (a `[[models]]` entry with `base`), so adapters' blocks match their own prompts and
//!   never a base-model prompt. An engine that sends only the numeric `lora_id` (it differs
//!   between engines) gets a root no prompt matches.
//! - Blocks reported with another `medium` (vLLM's CPU offload tier) keep their medium: the
//!   index holds them in its offload tier, priced between a GPU hit and a miss. Dropping a block
//!   from the offload tier keeps its mapping (its GPU copy, or blocks chained on it, may live).
//! - A stored block whose parent the gateway never saw (it joined after the parent was stored,
//!   or missed it) cannot be placed in the chain: it is skipped and counted.
//! - A block size other than the gateway's is an error the caller reports: the hashes could
//!   never agree.

use std::collections::{HashMap, VecDeque};

use protocol::hashing::{block_hash, root_hash};
use protocol::kv_events::KvEvent;

use crate::prefix::group::{on_gpu, MEDIUM_GPU};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TranslateError {
    #[error("the engine stores blocks of {got} tokens; the gateway hashes blocks of {want} (set model.block_size to match)")]
    BlockSize { got: u32, want: usize },
    #[error("a stored event carries {tokens} tokens for {blocks} blocks of {block_size}")]
    Tokens {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
}

/// One engine's hash map: engine hash → (gateway hash, resident on the GPU).
#[derive(Debug)]
pub struct HashTranslator {
    model: String,
    block_size: usize,
    map: HashMap<u64, (u64, bool)>,
    /// Engine hashes in the order they were first mapped, for the cap (may hold hashes
    /// removed since).
    order: VecDeque<u64>,
    /// Mappings kept at most: the index's cap for this engine, so an engine that never reports
    /// its removals cannot grow the map without bound either.
    cap: usize,
    /// Stored blocks skipped because their parent was unknown.
    pub orphans: u64,
}

impl HashTranslator {
    pub fn new(model: &str, block_size: usize) -> Self {
        HashTranslator {
            model: model.to_string(),
            block_size,
            map: HashMap::new(),
            order: VecDeque::new(),
            cap: usize::MAX,
            orphans: 0,
        }
    }

    /// Keeps at most `cap` mappings from now on (the oldest go first).
    pub fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
    }

    fn bound(&mut self) {
        while self.map.len() > self.cap {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&old);
        }
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|h| map.contains_key(h));
        }
    }

    /// Blocks the gateway can name now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Forgets everything (the engine cleared its cache, restarted, or events were lost).
    pub fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    fn root(&self, lora_id: Option<u64>, lora_name: Option<&str>) -> u64 {
        match (lora_name, lora_id) {
            // The adapter's name, as the gateway roots prompts for a model entry with `base`.
            (Some(name), _) => root_hash(&self.model, Some(name), None),
            (None, None) => root_hash(&self.model, None, None),
            // An engine that publishes only the numeric id (which differs between engines):
            // a root of its own, which no prompt matches.
            (None, Some(id)) => root_hash(&self.model, Some(&format!("engine-lora-id:{id}")), None),
        }
    }

    /// The gateway's version of `ev` for the index (`None`: nothing to apply).
    pub fn translate(&mut self, ev: &KvEvent) -> Result<Option<KvEvent>, TranslateError> {
        match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
            } => {
                if *block_size as usize != self.block_size {
                    return Err(TranslateError::BlockSize {
                        got: *block_size,
                        want: self.block_size,
                    });
                }
                let bs = self.block_size;
                if token_ids.len() != block_hashes.len() * bs {
                    return Err(TranslateError::Tokens {
                        tokens: token_ids.len(),
                        blocks: block_hashes.len(),
                        block_size: *block_size,
                    });
                }
                let mut parent = match parent_block_hash {
                    None => self.root(*lora_id, lora_name.as_deref()),
                    Some(p) => match self.map.get(p) {
                        Some(&(ours, _)) => ours,
                        None => {
                            self.orphans += block_hashes.len() as u64;
                            return Ok(None);
                        }
                    },
                };
                let gpu = on_gpu(medium);
                let mut ours = Vec::with_capacity(block_hashes.len());
                for (i, engine) in block_hashes.iter().enumerate() {
                    let h = block_hash(parent, &token_ids[i * bs..(i + 1) * bs]);
                    let entry = self.map.entry(*engine).or_insert_with(|| {
                        self.order.push_back(*engine);
                        (h, false)
                    });
                    entry.0 = h;
                    entry.1 |= gpu;
                    ours.push(h);
                    parent = h;
                }
                self.bound();
                Ok(Some(KvEvent::BlockStored {
                    block_hashes: ours,
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: *block_size,
                    lora_id: *lora_id,
                    medium: if gpu {
                        Some(MEDIUM_GPU.into())
                    } else {
                        medium.clone()
                    },
                    lora_name: lora_name.clone(),
                }))
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                if !on_gpu(medium) {
                    // Dropped from the offload tier: the mapping stays.
                    let ours: Vec<u64> = block_hashes
                        .iter()
                        .filter_map(|h| self.map.get(h).map(|&(ours, _)| ours))
                        .collect();
                    return Ok((!ours.is_empty()).then(|| KvEvent::BlockRemoved {
                        block_hashes: ours,
                        medium: medium.clone(),
                    }));
                }
                let ours: Vec<u64> = block_hashes
                    .iter()
                    .filter_map(|h| self.map.remove(h).map(|(ours, _)| ours))
                    .collect();
                Ok((!ours.is_empty()).then(|| KvEvent::BlockRemoved {
                    block_hashes: ours,
                    medium: Some(MEDIUM_GPU.into()),
                }))
            }
            KvEvent::AllBlocksCleared => {
                self.clear();
                Ok(Some(KvEvent::AllBlocksCleared))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::hashing::block_hashes;

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }
    }

    #[test]
    fn engine_hashes_become_the_gateways_own_chain() {
        let mut t = HashTranslator::new("m", 4);
        let tokens: Vec<u32> = (0..12).collect();
        let want = block_hashes(root_hash("m", None, None), &tokens, 4);
        // Two events, the second chained on the first by the engine's hash.
        let a = t.translate(&stored(vec![901, 902], None, tokens[..8].to_vec()));
        let b = t.translate(&stored(vec![903], Some(902), tokens[8..].to_vec()));
        let got: Vec<u64> = [a, b]
            .into_iter()
            .flat_map(|e| match e.unwrap().unwrap() {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes,
                e => panic!("{e:?}"),
            })
            .collect();
        assert_eq!(got, want);
        // Removal goes through the map; an unknown hash is ignored.
        let r = t
            .translate(&KvEvent::BlockRemoved {
                block_hashes: vec![903, 12345],
                medium: None,
            })
            .unwrap();
        assert_eq!(
            r,
            Some(KvEvent::BlockRemoved {
                block_hashes: vec![want[2]],
                medium: Some("GPU".into())
            })
        );
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn an_engine_that_never_removes_keeps_only_its_newest_mappings() {
        let mut t = HashTranslator::new("m", 4);
        t.set_cap(100);
        let mut parent = None;
        for i in 0..1000u64 {
            t.translate(&stored(vec![i], parent, vec![i as u32; 4]))
                .unwrap()
                .unwrap();
            parent = Some(i);
        }
        assert_eq!(t.len(), 100);
        // The chain goes on from the newest; the oldest are forgotten (their children orphans).
        assert!(t
            .translate(&stored(vec![5000], Some(999), vec![1; 4]))
            .unwrap()
            .is_some());
        assert_eq!(
            t.translate(&stored(vec![5001], Some(3), vec![1; 4]))
                .unwrap(),
            None
        );
    }

    #[test]
    fn orphans_lora_offload_and_block_size_are_handled() {
        let mut t = HashTranslator::new("m", 4);
        assert_eq!(
            t.translate(&stored(vec![1], Some(77), vec![0; 4])).unwrap(),
            None
        );
        assert_eq!(t.orphans, 1);
        // An adapter's blocks hash from another root.
        let mut lora = stored(vec![2], None, vec![5; 4]);
        if let KvEvent::BlockStored { lora_id, .. } = &mut lora {
            *lora_id = Some(3);
        }
        let base = block_hash(root_hash("m", None, None), &[5; 4]);
        match t.translate(&lora).unwrap().unwrap() {
            KvEvent::BlockStored { block_hashes, .. } => assert_ne!(block_hashes, vec![base]),
            e => panic!("{e:?}"),
        }
        // Named, the adapter's blocks hash from the base's root with the adapter's name: what
        // the gateway hashes a prompt for that adapter with.
        let mut named = stored(vec![20], None, vec![5; 4]);
        if let KvEvent::BlockStored {
            lora_id, lora_name, ..
        } = &mut named
        {
            (*lora_id, *lora_name) = (Some(3), Some("sql".into()));
        }
        let adapter = block_hash(root_hash("m", Some("sql"), None), &[5; 4]);
        match t.translate(&named).unwrap().unwrap() {
            KvEvent::BlockStored { block_hashes, .. } => assert_eq!(block_hashes, vec![adapter]),
            e => panic!("{e:?}"),
        }
        // Offloaded blocks keep their medium (the index's offload tier).
        let mut cpu = stored(vec![3], None, vec![6; 4]);
        if let KvEvent::BlockStored { medium, .. } = &mut cpu {
            *medium = Some("CPU".into());
        }
        match t.translate(&cpu).unwrap().unwrap() {
            KvEvent::BlockStored { medium, .. } => assert_eq!(medium.as_deref(), Some("CPU")),
            e => panic!("{e:?}"),
        }
        assert!(t
            .translate(&stored(vec![4], Some(3), vec![7; 4]))
            .unwrap()
            .is_some());
        // A block size the gateway does not hash with is refused.
        let mut big = stored(vec![5], None, vec![0; 4]);
        if let KvEvent::BlockStored { block_size, .. } = &mut big {
            *block_size = 16;
        }
        assert!(matches!(
            t.translate(&big),
            Err(TranslateError::BlockSize { got: 16, want: 4 })
        ));
        assert_eq!(
            t.translate(&KvEvent::AllBlocksCleared).unwrap(),
            Some(KvEvent::AllBlocksCleared)
        );
        assert!(t.is_empty());
    }
}
