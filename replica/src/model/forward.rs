//! One forward pass over a step's mixed batch: every new token of every scheduled sequence
//! (prefill chunks and decodes together) goes through each matrix multiply as one batch, and
//! attention runs per sequence and head over that sequence's paged KV blocks. New keys and
//! values are written into the sequence's blocks before attention reads them, so a chunk
//! attends to itself and to everything cached before it.
//!
//! Nothing a token computes depends on the other tokens of the step: matmuls compute each
//! output as one dot product, attention reads only the sequence's own blocks, and the order of
//! every reduction is fixed. Prefix reuse and batching are therefore exact, bit for bit.

use kernels::ops::{add_assign, rms_norm_rows, rope_interleaved, silu_mul};
use kernels::{matmul, matmul_many, Activations, PagedKvCache};
use rayon::prelude::*;

use super::weights::LlamaWeights;

/// Tokens of one sequence whose attention shares one pass over the cached blocks.
const ATTENTION_TILE: usize = 16;

pub use kernels::SeqSlice;

/// Runs the step; returns the last-token logits of each slice that asked for them, in order.
pub fn forward(w: &LlamaWeights, kv: &mut PagedKvCache, seqs: &[SeqSlice<'_>]) -> Vec<Vec<f32>> {
    let c = &w.config;
    let (hidden, hd) = (c.hidden, c.head_dim);
    let (qd, kvd) = (c.heads * hd, c.kv_heads * hd);
    let bs = kv.shape().block_size;
    // Token t belongs to sequence owner[t] at position pos[t].
    let mut owner = Vec::new();
    let mut pos = Vec::new();
    let mut ids = Vec::new();
    for (s, sl) in seqs.iter().enumerate() {
        assert!(
            sl.table.len() * bs >= sl.start + sl.tokens.len(),
            "block table too short for the step"
        );
        for (i, &tok) in sl.tokens.iter().enumerate() {
            owner.push(s);
            pos.push(sl.start + i);
            ids.push(tok);
        }
    }
    let n = ids.len();
    if n == 0 {
        return Vec::new();
    }
    let angles: Vec<Vec<(f32, f32)>> = pos.par_iter().map(|&p| c.rope.angles(p)).collect();
    // Attention tiles: up to ATTENTION_TILE consecutive tokens of one sequence.
    let mut tiles = Vec::new();
    let mut t0 = 0;
    for sl in seqs {
        let mut i = 0;
        while i < sl.tokens.len() {
            let n_tok = (sl.tokens.len() - i).min(ATTENTION_TILE);
            tiles.push((t0 + i, n_tok));
            i += n_tok;
        }
        t0 += sl.tokens.len();
    }

    let mut x = vec![0f32; n * hidden];
    x.par_chunks_mut(hidden)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| w.embed.row_f32(id as usize, row));

    let mut h = vec![0f32; n * hidden];
    let mut q = vec![0f32; n * qd];
    let mut k = vec![0f32; n * kvd];
    let mut v = vec![0f32; n * kvd];
    let mut attn = vec![0f32; n * qd];
    let mut o = vec![0f32; n * hidden];
    let mut gate = vec![0f32; n * c.intermediate];
    let mut up = vec![0f32; n * c.intermediate];
    let scale = 1.0 / (hd as f32).sqrt();
    let group = c.heads / c.kv_heads;

    for (layer, lw) in w.layers.iter().enumerate() {
        norm_rows(&x, &lw.attn_norm, c.rms_eps, &mut h);
        {
            let a = Activations::new(&h, hidden);
            matmul_many(
                &a,
                &mut [(&lw.wq, &mut q), (&lw.wk, &mut k), (&lw.wv, &mut v)],
            );
        }
        let rope_dims = c.rope.dims;
        q.par_chunks_mut(qd)
            .zip(k.par_chunks_mut(kvd))
            .zip(angles.par_iter())
            .for_each(|((qt, kt), ang)| {
                rope_heads(qt, hd, rope_dims, ang);
                rope_heads(kt, hd, rope_dims, ang);
            });
        for t in 0..n {
            let sl = &seqs[owner[t]];
            let p = pos[t];
            kv.write(
                layer,
                sl.table[p / bs] as usize,
                p % bs,
                &k[t * kvd..(t + 1) * kvd],
                &v[t * kvd..(t + 1) * kvd],
            );
        }
        let cache: &PagedKvCache = kv;
        // One task per (tile of a sequence's consecutive tokens, key/value head): each block
        // is widened to f32 once for the tile's tokens and the group's query heads.
        let gw = group * hd;
        let results: Vec<(usize, usize, Vec<f32>)> = tiles
            .par_iter()
            .flat_map_iter(|&tile| (0..c.kv_heads).map(move |kvh| (tile, kvh)))
            .map_init(Vec::new, |scratch, ((t0, n_tok), kvh)| {
                let sl = &seqs[owner[t0]];
                let mut qt = Vec::with_capacity(n_tok * gw);
                for t in t0..t0 + n_tok {
                    qt.extend_from_slice(&q[t * qd + kvh * gw..t * qd + (kvh + 1) * gw]);
                }
                let mut out = vec![0f32; qt.len()];
                cache.attend_tile(
                    layer, sl.table, pos[t0], kvh, group, &qt, scale, &mut out, scratch,
                );
                (t0, kvh, out)
            })
            .collect();
        for (t0, kvh, out) in results {
            for (i, o) in out.chunks_exact(gw).enumerate() {
                let t = t0 + i;
                attn[t * qd + kvh * gw..t * qd + (kvh + 1) * gw].copy_from_slice(o);
            }
        }
        matmul(&Activations::new(&attn, qd), &lw.wo, &mut o);
        add_assign(&mut x, &o);

        norm_rows(&x, &lw.ffn_norm, c.rms_eps, &mut h);
        {
            let a = Activations::new(&h, hidden);
            matmul_many(&a, &mut [(&lw.w_gate, &mut gate), (&lw.w_up, &mut up)]);
        }
        gate.par_chunks_mut(c.intermediate)
            .zip(up.par_chunks(c.intermediate))
            .for_each(|(g, u)| silu_mul(g, u));
        matmul(&Activations::new(&gate, c.intermediate), &lw.w_down, &mut o);
        add_assign(&mut x, &o);
    }

    // Logits for the last token of each slice that samples.
    let mut last_rows = Vec::new();
    let mut t0 = 0;
    for sl in seqs {
        t0 += sl.tokens.len();
        if sl.logits && !sl.tokens.is_empty() {
            last_rows.push(t0 - 1);
        }
    }
    if last_rows.is_empty() {
        return Vec::new();
    }
    let mut hl = vec![0f32; last_rows.len() * hidden];
    for (r, &t) in last_rows.iter().enumerate() {
        hl[r * hidden..(r + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
    }
    let mut normed = vec![0f32; hl.len()];
    rms_norm_rows(&hl, &w.norm, c.rms_eps, &mut normed);
    let head = w.lm_head();
    let vocab = head.rows();
    let mut logits = vec![0f32; last_rows.len() * vocab];
    matmul(&Activations::new(&normed, hidden), head, &mut logits);
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, xr)| kernels::ops::rms_norm(xr, weight, eps, o));
}

/// RoPE on the first `dims` values of every head (partial rotary leaves the rest as is).
fn rope_heads(x: &mut [f32], hd: usize, dims: usize, angles: &[(f32, f32)]) {
    if dims == hd {
        rope_interleaved(x, hd, angles);
    } else {
        for head in x.chunks_exact_mut(hd) {
            rope_interleaved(&mut head[..dims], dims, angles);
        }
    }
}
