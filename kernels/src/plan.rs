//! What one engine step asks of the kernels, laid out for a device: the step's tokens and
//! positions, each token's cache slot, the sequences' block tables packed into one array, the
//! attention tiles and the rows that need logits. Pure host logic (no CUDA), so it is tested on
//! every machine; the `cuda` backend uploads these arrays and launches over them.

use crate::cuda_program::{ATT_CHUNK, ATT_MAX_ROWS};

/// One sequence's share of a step.
#[derive(Debug, Clone)]
pub struct SeqSlice<'a> {
    /// The tokens computed in this step.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence (tokens before it are in the cache).
    pub start: usize,
    /// The sequence's block table, covering at least `start + tokens.len()` positions.
    pub table: &'a [u32],
    /// Whether to return logits for the last token.
    pub logits: bool,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("sequence {seq}: its block table covers {covered} positions, the step needs {needed}")]
    TableTooShort {
        seq: usize,
        covered: usize,
        needed: usize,
    },
    #[error(
        "{group} query heads per key/value head: the attention kernel takes at most {ATT_MAX_ROWS}"
    )]
    GroupTooLarge { group: usize },
}

/// A step as flat arrays (i32 where the kernels read `int`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Token ids, sequence after sequence.
    pub ids: Vec<u32>,
    /// Each token's position in its sequence.
    pub pos: Vec<i32>,
    /// Each token's cache slot: block × block_size + offset.
    pub slots: Vec<i32>,
    /// Attention tiles, four values each: sequence, first token row, tokens, first position.
    pub tiles: Vec<i32>,
    /// Where each sequence's block table starts in `tables`.
    pub table_off: Vec<i32>,
    /// Every sequence's block table, one after the other.
    pub tables: Vec<u32>,
    /// The token rows whose logits are wanted (the last token of each sampling slice).
    pub logit_rows: Vec<i32>,
    /// The longest context any token attends to.
    pub max_ctx: usize,
}

/// Tokens of one sequence in an attention tile: as many as keep `tokens × group` rows within
/// the kernel's limit.
pub fn tile_tokens(group: usize) -> Result<usize, PlanError> {
    if group == 0 || group > ATT_MAX_ROWS {
        return Err(PlanError::GroupTooLarge { group });
    }
    Ok(ATT_MAX_ROWS / group)
}

impl StepPlan {
    pub fn build(
        seqs: &[SeqSlice<'_>],
        block_size: usize,
        group: usize,
    ) -> Result<Self, PlanError> {
        let per_tile = tile_tokens(group)?;
        let mut p = StepPlan::default();
        for (s, sl) in seqs.iter().enumerate() {
            let end = sl.start + sl.tokens.len();
            if sl.table.len() * block_size < end {
                return Err(PlanError::TableTooShort {
                    seq: s,
                    covered: sl.table.len() * block_size,
                    needed: end,
                });
            }
            let first_row = p.ids.len();
            p.table_off.push(p.tables.len() as i32);
            p.tables
                .extend_from_slice(&sl.table[..end.div_ceil(block_size)]);
            for (i, &tok) in sl.tokens.iter().enumerate() {
                let pos = sl.start + i;
                p.ids.push(tok);
                p.pos.push(pos as i32);
                p.slots.push(
                    (sl.table[pos / block_size] as usize * block_size + pos % block_size) as i32,
                );
            }
            let mut i = 0;
            while i < sl.tokens.len() {
                let n = (sl.tokens.len() - i).min(per_tile);
                p.tiles.extend_from_slice(&[
                    s as i32,
                    (first_row + i) as i32,
                    n as i32,
                    (sl.start + i) as i32,
                ]);
                i += n;
            }
            if sl.logits && !sl.tokens.is_empty() {
                p.logit_rows.push((p.ids.len() - 1) as i32);
            }
            p.max_ctx = p.max_ctx.max(end);
        }
        Ok(p)
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    pub fn num_tiles(&self) -> usize {
        self.tiles.len() / 4
    }
}

/// How to split the attention's context: `(partitions, positions per partition)`.
///
/// A step with few tiles (decode at a small batch) would leave most of the GPU's
/// multiprocessors idle with one block per (tile, KV head); its context is then split so that
/// about four blocks run per multiprocessor, in partitions of at least [`MIN_PARTITION`]
/// positions. The partial results take `partitions × tokens × heads × (head_dim + 2)` floats, which must fit
/// in `budget_floats`.
/// The shortest context partition: one staged chunk. A block works through its chunks one
/// after another, about 6 µs each on an H200, so a decode at batch 1 and context 512 in
/// partitions of 256 (16 blocks for 8 KV heads) took 49 µs a layer, 1.6 ms of a 7.6 ms
/// step (BENCHMARKS, issue 34); more, shorter partitions run side by side.
pub const MIN_PARTITION: usize = ATT_CHUNK;

#[allow(clippy::too_many_arguments)]
pub fn partitions(
    tiles: usize,
    kv_heads: usize,
    max_ctx: usize,
    multiprocessors: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    budget_floats: usize,
) -> (usize, usize) {
    let whole = (1, max_ctx.max(1).next_multiple_of(ATT_CHUNK));
    let blocks = tiles * kv_heads;
    let target = 4 * multiprocessors;
    if blocks == 0 || blocks >= target || max_ctx <= MIN_PARTITION {
        return whole;
    }
    let wanted = target.div_ceil(blocks);
    let per_part = tokens * heads * (head_dim + 2);
    let affordable = budget_floats / per_part.max(1);
    let parts = wanted.min(affordable).min(max_ctx.div_ceil(MIN_PARTITION));
    if parts <= 1 {
        return whole;
    }
    let len = max_ctx
        .div_ceil(parts)
        .next_multiple_of(ATT_CHUNK)
        .max(MIN_PARTITION);
    (max_ctx.div_ceil(len), len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice<'a>(tokens: &'a [u32], start: usize, table: &'a [u32], logits: bool) -> SeqSlice<'a> {
        SeqSlice {
            tokens,
            start,
            table,
            logits,
        }
    }

    #[test]
    fn a_mixed_step_packs_tables_slots_tiles_and_logit_rows() {
        // A 20-token prefill chunk starting at 0 and a decode at position 37, block size 16,
        // 3 query heads per KV head (5 tokens per tile).
        let prefill: Vec<u32> = (100..120).collect();
        let decode = [7u32];
        let seqs = [
            slice(&prefill, 0, &[4, 9], false),
            slice(&decode, 37, &[1, 2, 3, 8], true),
        ];
        let p = StepPlan::build(&seqs, 16, 3).unwrap();
        assert_eq!(p.tokens(), 21);
        assert_eq!(p.tables, vec![4, 9, 1, 2, 3]);
        assert_eq!(p.table_off, vec![0, 2]);
        assert_eq!(p.slots[0], 4 * 16);
        assert_eq!(p.slots[17], 9 * 16 + 1);
        assert_eq!(p.slots[20], 3 * 16 + 5, "position 37 = block 2, offset 5");
        assert_eq!(p.pos[20], 37);
        assert_eq!(p.num_tiles(), 5);
        assert_eq!(&p.tiles[..4], &[0, 0, 5, 0]);
        assert_eq!(&p.tiles[12..16], &[0, 15, 5, 15]);
        assert_eq!(&p.tiles[16..], &[1, 20, 1, 37]);
        assert_eq!(p.logit_rows, vec![20]);
        assert_eq!(p.max_ctx, 38);
    }

    #[test]
    fn a_short_block_table_and_a_wide_group_are_refused() {
        let toks = [1u32; 17];
        let err = StepPlan::build(&[slice(&toks, 0, &[0], true)], 16, 1).unwrap_err();
        assert_eq!(
            err,
            PlanError::TableTooShort {
                seq: 0,
                covered: 16,
                needed: 17
            }
        );
        assert!(matches!(
            StepPlan::build(&[], 16, 32),
            Err(PlanError::GroupTooLarge { group: 32 })
        ));
    }

    #[test]
    fn decode_at_small_batch_splits_long_contexts_and_big_steps_do_not() {
        // One sequence, 8 KV heads, 4,000 positions, 132 multiprocessors: 8 blocks would run.
        let (parts, len) = partitions(1, 8, 4000, 132, 1, 32, 128, 1 << 24);
        assert!(
            parts > 1 && len >= MIN_PARTITION && len % ATT_CHUNK == 0,
            "{parts} × {len}"
        );
        assert!(parts * len >= 4000 && (parts - 1) * len < 4000);
        // A prefill of 256 tiles already fills the GPU.
        assert_eq!(partitions(256, 8, 4000, 132, 4096, 32, 128, 1 << 24).0, 1);
        // A decode at context 512 runs in one-chunk partitions (16 × 8 = 128 blocks).
        assert_eq!(partitions(1, 8, 512, 132, 1, 32, 128, 1 << 24), (16, 32));
        // A context of one chunk is never split, nor beyond the scratch budget.
        assert_eq!(partitions(1, 8, 32, 132, 1, 32, 128, 1 << 24).0, 1);
        assert_eq!(partitions(1, 8, 4000, 132, 1, 32, 128, 32 * 130).0, 1);
    }
}
