//! The paged KV cache and attention over it. Keys and values are stored as f16 (llama.cpp's
//! default cache type) in fixed-size blocks that the replica's block manager hands out: a
//! sequence's block table maps its position `p` to slot `p % block_size` of block
//! `table[p / block_size]`. A block written by one sequence is read unchanged by every sequence
//! that later shares the prefix, which is what makes prefix caching save real work.
//!
//! Layout: `[layer][block][kv_head][slot][head_dim]`, so one block of one head is a contiguous
//! run of `block_size × head_dim` values, widened to f32 in one go before its dot products.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::dot::dot_f32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl AttentionShape {
    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * std::mem::size_of::<f16>()
    }
}

/// Keys and values as f16 bit patterns: a zeroed `u16` vector is allocated lazily by the OS, so
/// the cache costs resident memory only as blocks are first written.
pub struct PagedKvCache {
    shape: AttentionShape,
    k: Vec<u16>,
    v: Vec<u16>,
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKvCache")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl PagedKvCache {
    pub fn new(shape: AttentionShape) -> Self {
        let n =
            shape.layers * shape.num_blocks * shape.kv_heads * shape.block_size * shape.head_dim;
        PagedKvCache {
            shape,
            k: vec![0u16; n],
            v: vec![0u16; n],
        }
    }

    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<u16>()
    }

    fn offset(&self, layer: usize, block: usize, head: usize, slot: usize) -> usize {
        let s = &self.shape;
        (((layer * s.num_blocks + block) * s.kv_heads + head) * s.block_size + slot) * s.head_dim
    }

    /// Stores one token's keys and values (`kv_heads × head_dim` each) at `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for h in 0..self.shape.kv_heads {
            let at = self.offset(layer, block, h, slot);
            self.k[at..at + hd]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(&k[h * hd..(h + 1) * hd]);
            self.v[at..at + hd]
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// Overwrites every key and value of `block` with noise: the planted fault that the
    /// prefix-reuse detector must catch. Not for serving.
    #[doc(hidden)]
    pub fn scribble_block(&mut self, block: usize) {
        let run = self.shape.block_size * self.shape.head_dim;
        for layer in 0..self.shape.layers {
            for h in 0..self.shape.kv_heads {
                let at = self.offset(layer, block, h, 0);
                for (i, x) in self.k[at..at + run].iter_mut().enumerate() {
                    *x = f16::from_f32(((i * 7919) % 13) as f32 - 6.0).to_bits();
                }
            }
        }
    }

    /// Attention for a tile of consecutive tokens of one sequence (positions `first_pos ..
    /// first_pos + n`, each attending to itself and everything before it) and the `group` query
    /// heads that share key/value head `kv_head`. `q` holds, token by token, the group's queries (RoPE
    /// applied), one `head_dim` run per head; `out` receives the results in the same layout.
    /// Each block's keys and values are widened to f32 once for the whole tile. For every
    /// (token, head) the operations are those of attending alone — scores in position order,
    /// an exact softmax over exactly its positions, values accumulated in position order — so
    /// the result depends only on its query and the cached values, never on the tile, the
    /// batch or the chunking.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_tile(
        &self,
        layer: usize,
        table: &[u32],
        first_pos: usize,
        kv_head: usize,
        group: usize,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU reports AVX2. The same code with 256-bit vectors: the eight
            // lanes of `dot_f32` and the element-wise updates are the same operations, and
            // Rust never fuses a multiply and an add on its own, so results are unchanged.
            unsafe {
                return self.attend_tile_avx2(
                    layer, table, first_pos, kv_head, group, q, scale, out, scratch,
                );
            }
        }
        self.attend_tile_impl(
            layer, table, first_pos, kv_head, group, q, scale, out, scratch,
        )
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn attend_tile_avx2(
        &self,
        layer: usize,
        table: &[u32],
        first_pos: usize,
        kv_head: usize,
        group: usize,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        self.attend_tile_impl(
            layer, table, first_pos, kv_head, group, q, scale, out, scratch,
        )
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn attend_tile_impl(
        &self,
        layer: usize,
        table: &[u32],
        first_pos: usize,
        kv_head: usize,
        group: usize,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) {
        let s = &self.shape;
        let hd = s.head_dim;
        let bs = s.block_size;
        debug_assert_eq!(out.len(), q.len());
        // (token, head) pairs, `group` heads per token.
        let n = q.len() / hd;
        let n_tokens = n / group;
        let max_ctx = first_pos + n_tokens;
        let mut scores = vec![0f32; n * max_ctx];
        scratch.resize(bs * hd, 0.0);
        let ctx = |i: usize| first_pos + i + 1;
        let blocks = table.iter().enumerate().take(max_ctx.div_ceil(bs));
        for (b, &block) in blocks.clone() {
            let len = (max_ctx - b * bs).min(bs);
            let at = self.offset(layer, block as usize, kv_head, 0);
            self.k[at..at + len * hd]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(&mut scratch[..len * hd]);
            for i in 0..n_tokens {
                let limit = ctx(i).saturating_sub(b * bs).min(len);
                for g in 0..group {
                    let r = i * group + g;
                    let qh = &q[r * hd..(r + 1) * hd];
                    let row = &mut scores[r * max_ctx + b * bs..r * max_ctx + b * bs + limit];
                    for (sc, key) in row.iter_mut().zip(scratch[..limit * hd].chunks_exact(hd)) {
                        *sc = dot_f32(qh, key) * scale;
                    }
                }
            }
        }
        for i in 0..n_tokens {
            for g in 0..group {
                let r = i * group + g;
                crate::ops::softmax(&mut scores[r * max_ctx..r * max_ctx + ctx(i)]);
            }
        }
        out.fill(0.0);
        for (b, &block) in blocks {
            let len = (max_ctx - b * bs).min(bs);
            let at = self.offset(layer, block as usize, kv_head, 0);
            self.v[at..at + len * hd]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(&mut scratch[..len * hd]);
            for i in 0..n_tokens {
                let limit = ctx(i).saturating_sub(b * bs).min(len);
                for g in 0..group {
                    let r = i * group + g;
                    let w = &scores[r * max_ctx + b * bs..r * max_ctx + b * bs + limit];
                    let oh = &mut out[r * hd..(r + 1) * hd];
                    for (&wj, val) in w.iter().zip(scratch[..limit * hd].chunks_exact(hd)) {
                        for (o, &x) in oh.iter_mut().zip(val) {
                            *o += wj * x;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_over_scattered_blocks_matches_dense_attention() {
        let shape = AttentionShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            num_blocks: 10,
        };
        let mut cache = PagedKvCache::new(shape);
        let table = [7u32, 2, 9];
        let n_ctx = 10;
        let val = |p: usize, h: usize, d: usize, salt: usize| {
            (((p * 31 + h * 7 + d * 3 + salt) % 17) as f32 - 8.0) / 8.0
        };
        let mut dense_k: Vec<Vec<f32>> = Vec::new();
        let mut dense_v: Vec<Vec<f32>> = Vec::new();
        for p in 0..n_ctx {
            let k: Vec<f32> = (0..16).map(|i| val(p, i / 8, i % 8, 1)).collect();
            let v: Vec<f32> = (0..16).map(|i| val(p, i / 8, i % 8, 5)).collect();
            cache.write(1, table[p / 4] as usize, p % 4, &k, &v);
            // f16 round trip, as stored.
            let r = |x: &Vec<f32>| x.iter().map(|&a| f16::from_f32(a).to_f32()).collect();
            dense_k.push(r(&k));
            dense_v.push(r(&v));
        }
        let q: Vec<f32> = (0..8).map(|d| d as f32 / 10.0 - 0.3).collect();
        let mut out = vec![0f32; 8];
        let mut scratch = Vec::new();
        cache.attend_tile(1, &table, n_ctx - 1, 1, 1, &q, 0.35, &mut out, &mut scratch);
        let mut w: Vec<f32> = (0..n_ctx)
            .map(|p| (0..8).map(|d| q[d] * dense_k[p][8 + d]).sum::<f32>() * 0.35)
            .collect();
        crate::ops::softmax(&mut w);
        for d in 0..8 {
            let want: f32 = (0..n_ctx).map(|p| w[p] * dense_v[p][8 + d]).sum();
            assert!((out[d] - want).abs() < 1e-5, "{d}: {} vs {want}", out[d]);
        }
        // A scribbled block changes the answer.
        let before = out.clone();
        cache.scribble_block(2);
        cache.attend_tile(1, &table, n_ctx - 1, 1, 1, &q, 0.35, &mut out, &mut scratch);
        assert_ne!(before, out);
        // Two heads sharing the KV head at once equal each alone.
        let q2: Vec<f32> = q.iter().chain(q.iter().rev()).copied().collect();
        let mut both = vec![0f32; 16];
        cache.attend_tile(
            1,
            &table,
            n_ctx - 1,
            1,
            2,
            &q2,
            0.35,
            &mut both,
            &mut scratch,
        );
        assert_eq!(&both[..8], &out[..]);
        let mut second = vec![0f32; 8];
        cache.attend_tile(
            1,
            &table,
            n_ctx - 1,
            1,
            1,
            &q2[8..],
            0.35,
            &mut second,
            &mut scratch,
        );
        assert_eq!(&both[8..], &second[..]);
        // A tile of three consecutive tokens equals each token alone.
        let q3: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut tile = vec![0f32; 24];
        cache.attend_tile(
            1,
            &table,
            n_ctx - 3,
            1,
            1,
            &q3,
            0.35,
            &mut tile,
            &mut scratch,
        );
        for i in 0..3 {
            let mut alone = vec![0f32; 8];
            let qi = &q3[i * 8..(i + 1) * 8];
            cache.attend_tile(
                1,
                &table,
                n_ctx - 3 + i,
                1,
                1,
                qi,
                0.35,
                &mut alone,
                &mut scratch,
            );
            assert_eq!(&tile[i * 8..(i + 1) * 8], &alone[..], "token {i}");
        }
    }
}
