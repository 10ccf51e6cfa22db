//! The paged KV cache and attention over it. Keys and values are stored as f16 (llama.cpp's
//! default cache type) or FP8 E4M3 with per-token scales ([`KvElement`]) in fixed-size blocks that the replica's block manager hands out: a
//! sequence's block table maps its position `p` to slot `p % block_size` of block
//! `table[p / block_size]`. A block written by one sequence is read unchanged by every sequence
//! that later shares the prefix, which is what makes prefix caching save real work.
//!
//! Layout: `[layer][block][kv_head][slot][head_dim]`, so one block of one head is a contiguous
//! run of `block_size × head_dim` values, widened to f32 in one go before its dot products.

use crate::dot::dot_f32;
use crate::kv_store::{KvElement, Lanes};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl AttentionShape {
    /// Bytes of K and V for one token across all layers, stored as f16.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_as(KvElement::F16)
    }

    /// Bytes of K and V for one token across all layers, stored as `elem`.
    pub fn bytes_per_token_as(&self, elem: KvElement) -> usize {
        2 * self.layers * self.kv_heads * elem.bytes_per_head(self.head_dim)
    }
}

/// Keys and values in zeroed vectors allocated lazily by the OS, so the cache costs resident
/// memory only as blocks are first written.
pub struct PagedKvCache {
    shape: AttentionShape,
    elem: KvElement,
    k: Lanes,
    v: Lanes,
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKvCache")
            .field("shape", &self.shape)
            .field("element", &self.elem)
            .finish_non_exhaustive()
    }
}

impl PagedKvCache {
    /// An f16 cache.
    pub fn new(shape: AttentionShape) -> Self {
        Self::with_element(shape, KvElement::F16)
    }

    pub fn with_element(shape: AttentionShape, elem: KvElement) -> Self {
        let n =
            shape.layers * shape.num_blocks * shape.kv_heads * shape.block_size * shape.head_dim;
        PagedKvCache {
            shape,
            elem,
            k: Lanes::new(elem, n, shape.head_dim),
            v: Lanes::new(elem, n, shape.head_dim),
        }
    }

    pub fn element(&self) -> KvElement {
        self.elem
    }

    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        self.k.bytes() + self.v.bytes()
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
            self.k.store(at, &k[h * hd..(h + 1) * hd]);
            self.v.store(at, &v[h * hd..(h + 1) * hd]);
        }
    }

    /// Overwrites every key and value of `block` with noise: the planted fault that the
    /// prefix-reuse detector must catch. Not for serving.
    #[doc(hidden)]
    pub fn scribble_block(&mut self, block: usize) {
        let hd = self.shape.head_dim;
        for layer in 0..self.shape.layers {
            for h in 0..self.shape.kv_heads {
                for slot in 0..self.shape.block_size {
                    let at = self.offset(layer, block, h, slot);
                    let noise: Vec<f32> = (0..hd)
                        .map(|i| (((slot * hd + i) * 7919) % 13) as f32 - 6.0)
                        .collect();
                    self.k.store(at, &noise);
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
            self.k.widen(at, hd, &mut scratch[..len * hd]);
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
            self.v.widen(at, hd, &mut scratch[..len * hd]);
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
    use half::f16;

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

    #[test]
    fn an_fp8_cache_attends_close_to_f16_in_about_half_the_bytes() {
        let shape = AttentionShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 64,
            block_size: 4,
            num_blocks: 8,
        };
        let mut half_cache = PagedKvCache::new(shape);
        let mut fp8 = PagedKvCache::with_element(shape, KvElement::Fp8E4m3);
        let table = [5u32, 1, 3, 0];
        let n_ctx = 13;
        for p in 0..n_ctx {
            // Magnitudes from 0.01 to 30, as keys after RoPE and values span.
            let mag = 0.01 * 3f32.powi((p % 8) as i32);
            let k: Vec<f32> = (0..64)
                .map(|d| mag * ((p * 13 + d) as f32 * 0.7).sin())
                .collect();
            let v: Vec<f32> = (0..64).map(|d| ((p + d * 5) as f32 * 0.3).cos()).collect();
            half_cache.write(0, table[p / 4] as usize, p % 4, &k, &v);
            fp8.write(0, table[p / 4] as usize, p % 4, &k, &v);
        }
        let q: Vec<f32> = (0..64).map(|d| (d as f32 * 0.11).sin() * 0.2).collect();
        let (mut a, mut b, mut scratch) = (vec![0f32; 64], vec![0f32; 64], Vec::new());
        half_cache.attend_tile(0, &table, n_ctx - 1, 0, 1, &q, 0.125, &mut a, &mut scratch);
        fp8.attend_tile(0, &table, n_ctx - 1, 0, 1, &q, 0.125, &mut b, &mut scratch);
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 0.05, "fp8 attention off by {worst}");
        assert_ne!(a, b);
        let ratio =
            shape.bytes_per_token_as(KvElement::Fp8E4m3) as f64 / shape.bytes_per_token() as f64;
        assert!((ratio - 68.0 / 128.0).abs() < 1e-9, "{ratio}");
        assert_eq!(fp8.bytes() * 128, half_cache.bytes() * 68);
    }
}
