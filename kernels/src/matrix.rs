//! Weight matrices and `out = x · Wᵀ`. A matrix is stored the way the model file stores it:
//! quantised matrices keep their GGML blocks (read straight from the memory-mapped file, or
//! owned), dense ones (F32/F16/BF16) are widened to f32 once at load. Work is split over output
//! rows across the current rayon pool; each output element is one dot product computed the same
//! way whatever the batch, so results do not depend on batch composition or thread count.

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use crate::dot::{dot_f32, quant_dot};
use crate::quant::{dequantize_row, Format, Q8Row, Q8Tile, TILE};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MatrixError {
    #[error("{format} rows of {cols} values need {expected} bytes in all, got {got}")]
    Size {
        format: &'static str,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("{format} rows must be a whole number of 32-value blocks, got {cols} columns")]
    Blocks { format: &'static str, cols: usize },
}

/// Bytes shared with whoever owns them (a memory-mapped model file, or a plain vector).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

enum Storage {
    Dense(Vec<f32>),
    Quant {
        bytes: SharedBytes,
        offset: usize,
        len: usize,
    },
}

/// A matrix's values as held: dense f32 (row-major), or quantised blocks in its [`Format`].
#[derive(Debug, Clone, Copy)]
pub enum Stored<'a> {
    Dense(&'a [f32]),
    Quant(&'a [u8]),
}

/// A `rows × cols` weight matrix (rows = output features, cols = input features).
pub struct Matrix {
    format: Format,
    rows: usize,
    cols: usize,
    storage: Storage,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Matrix({} {}x{})",
            self.format.name(),
            self.rows,
            self.cols
        )
    }
}

impl Matrix {
    /// Wraps `len` bytes at `offset` of `bytes`, stored row-major in `format`. Dense formats are
    /// widened to f32 here; quantised ones stay in place.
    pub fn from_bytes(
        format: Format,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
        offset: usize,
        len: usize,
    ) -> Result<Self, MatrixError> {
        let row = format.row_bytes(cols).ok_or(MatrixError::Blocks {
            format: format.name(),
            cols,
        })?;
        let expected = row * rows;
        let available = (*bytes).as_ref().len().saturating_sub(offset);
        if len != expected || available < expected {
            return Err(MatrixError::Size {
                format: format.name(),
                cols,
                expected,
                got: len.min(available),
            });
        }
        let storage = if format.is_quantized() {
            Storage::Quant { bytes, offset, len }
        } else {
            let src = &(*bytes).as_ref()[offset..offset + len];
            let mut dense = vec![0f32; rows * cols];
            for (dst, s) in dense.chunks_exact_mut(cols).zip(src.chunks_exact(row)) {
                dequantize_row(format, s, dst);
            }
            Storage::Dense(dense)
        };
        Ok(Matrix {
            format,
            rows,
            cols,
            storage,
        })
    }

    /// A dense matrix from f32 values, row-major.
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Self {
        assert_eq!(values.len(), rows * cols, "matrix shape and data disagree");
        Matrix {
            format: Format::F32,
            rows,
            cols,
            storage: Storage::Dense(values),
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The matrix as stored: its dense f32 values, or its quantised rows' bytes (what a device
    /// uploads and dequantises itself).
    pub fn stored(&self) -> Stored<'_> {
        match &self.storage {
            Storage::Dense(v) => Stored::Dense(v),
            Storage::Quant { bytes, offset, len } => {
                Stored::Quant(&(**bytes).as_ref()[*offset..offset + len])
            }
        }
    }

    /// Bytes the matrix occupies as stored (what a forward pass streams through).
    pub fn stored_bytes(&self) -> usize {
        match &self.storage {
            Storage::Dense(v) => v.len() * 4,
            Storage::Quant { len, .. } => *len,
        }
    }

    fn quant_row(&self, r: usize) -> &[u8] {
        match &self.storage {
            Storage::Quant { bytes, offset, .. } => {
                let row = self.format.row_bytes(self.cols).unwrap_or(0);
                let all = (**bytes).as_ref();
                &all[offset + r * row..offset + (r + 1) * row]
            }
            Storage::Dense(_) => unreachable!("dense matrices have no quantised rows"),
        }
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::Dense(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
            Storage::Quant { .. } => dequantize_row(self.format, self.quant_row(r), out),
        }
    }

    /// Every row as f32, row-major (writing test checkpoints from a quantised file).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, dst) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_f32(r, dst);
        }
        out
    }
}

/// The input of a matmul: `rows` activation vectors of `cols` values, quantised on first use
/// by a quantised matrix (and then shared by every matrix that reads the same input).
pub struct Activations<'a> {
    x: &'a [f32],
    rows: usize,
    cols: usize,
    quantized: OnceLock<Vec<Q8Tile>>,
}

impl<'a> Activations<'a> {
    pub fn new(x: &'a [f32], cols: usize) -> Self {
        assert!(
            cols > 0 && x.len().is_multiple_of(cols),
            "activations are whole rows"
        );
        Activations {
            x,
            rows: x.len() / cols,
            cols,
            quantized: OnceLock::new(),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    fn row(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }

    /// The rows quantised and packed in tiles of [`TILE`] tokens.
    fn q8(&self) -> &[Q8Tile] {
        self.quantized.get_or_init(|| {
            let rows: Vec<Q8Row> = (0..self.rows)
                .into_par_iter()
                .map(|t| Q8Row::quantize(self.row(t)))
                .collect();
            rows.chunks(TILE).map(Q8Tile::pack).collect()
        })
    }
}

/// Tokens per tile: a tile of activations stays in cache while a chunk of rows sweeps it.
const TOKEN_TILE: usize = TILE;

/// `out[t][n] = Σ_k x[t][k] · W[n][k]` for every activation row `t` and matrix row `n`;
/// `out` holds `x.rows() × w.rows()` values.
pub fn matmul(x: &Activations<'_>, w: &Matrix, out: &mut [f32]) {
    matmul_many(x, &mut [(w, out)]);
}

/// Several matmuls of the same input (a layer's Q, K and V, or its gate and up projections)
/// in one parallel pass, so the threads are woken once rather than once per matrix.
pub fn matmul_many(x: &Activations<'_>, jobs: &mut [(&Matrix, &mut [f32])]) {
    let t_rows = x.rows;
    for (w, out) in jobs.iter() {
        assert_eq!(x.cols, w.cols, "matmul: inner dimensions differ");
        assert_eq!(
            out.len(),
            t_rows * w.rows,
            "matmul: output has the wrong size"
        );
    }
    if t_rows == 0 || jobs.is_empty() {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let total: usize = jobs.iter().map(|(w, _)| w.rows).sum();
    let chunk = total.div_ceil(threads * 4).clamp(16, 512);
    // Tasks: (job, first row, end row).
    let mut tasks = Vec::new();
    for (j, (w, _)) in jobs.iter().enumerate() {
        let mut n0 = 0;
        while n0 < w.rows {
            tasks.push((j, n0, (n0 + chunk).min(w.rows)));
            n0 += chunk;
        }
    }
    let q8 = jobs
        .iter()
        .any(|(w, _)| w.format.is_quantized())
        .then(|| x.q8());
    // Each task computes a block of output columns for every token, transposed.
    let blocks: Vec<(usize, usize, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(j, n0, n1)| {
            let w = jobs[j].0;
            let dot = w.format.is_quantized().then(|| quant_dot(w.format));
            let mut res = vec![0f32; (n1 - n0) * t_rows];
            for t0 in (0..t_rows).step_by(TOKEN_TILE) {
                let t1 = (t0 + TOKEN_TILE).min(t_rows);
                for n in n0..n1 {
                    let dst = &mut res[(n - n0) * t_rows..(n - n0 + 1) * t_rows];
                    match (dot, q8, &w.storage) {
                        (Some(dot), Some(q), _) => {
                            dot(w.quant_row(n), &q[t0 / TILE], &mut dst[t0..t1])
                        }
                        (None, _, Storage::Dense(v)) => {
                            let wr = &v[n * w.cols..(n + 1) * w.cols];
                            for (t, d) in dst.iter_mut().enumerate().take(t1).skip(t0) {
                                *d = dot_f32(wr, x.row(t));
                            }
                        }
                        _ => unreachable!("quantised matrices have quantised activations"),
                    }
                }
            }
            (j, n0, res)
        })
        .collect();
    for (j, n0, res) in blocks {
        let n_rows = jobs[j].0.rows;
        let out = &mut jobs[j].1;
        let width = res.len() / t_rows;
        for t in 0..t_rows {
            for k in 0..width {
                out[t * n_rows + n0 + k] = res[k * t_rows + t];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32 ^ seed).wrapping_mul(2246822519) >> 9) as f32 / 8388608.0 - 1.0)
            .collect()
    }

    fn quantised(format: Format, rows: usize, cols: usize, w: &[f32]) -> Matrix {
        let bytes: Vec<u8> = w
            .chunks_exact(cols)
            .flat_map(|r| quantize_row(format, r))
            .collect();
        let len = bytes.len();
        Matrix::from_bytes(format, rows, cols, Arc::new(bytes), 0, len).unwrap()
    }

    #[test]
    fn matmul_matches_naive_and_is_batch_invariant() {
        let (rows, cols, tokens) = (70, 96, 19);
        let w = data(rows * cols, 3);
        let x = data(tokens * cols, 8);
        for format in [Format::F32, Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            let m = if format == Format::F32 {
                Matrix::from_f32(rows, cols, w.clone())
            } else {
                quantised(format, rows, cols, &w)
            };
            let deq = m.to_f32();
            let mut out = vec![0f32; tokens * rows];
            matmul(&Activations::new(&x, cols), &m, &mut out);
            for t in 0..tokens {
                for n in 0..rows {
                    let naive: f32 = (0..cols).map(|k| x[t * cols + k] * deq[n * cols + k]).sum();
                    let got = out[t * rows + n];
                    assert!(
                        (got - naive).abs() < 0.1,
                        "{}: {got} vs {naive}",
                        format.name()
                    );
                }
            }
            // Alone, a token's outputs are bit-identical to its outputs within the batch.
            let mut alone = vec![0f32; rows];
            matmul(
                &Activations::new(&x[5 * cols..6 * cols], cols),
                &m,
                &mut alone,
            );
            assert_eq!(&out[5 * rows..6 * rows], &alone[..], "{}", format.name());
        }
    }

    #[test]
    fn wrong_sizes_are_errors_not_panics() {
        let bytes: SharedBytes = Arc::new(vec![0u8; 100]);
        assert!(matches!(
            Matrix::from_bytes(Format::Q4_1, 2, 64, bytes.clone(), 0, 100),
            Err(MatrixError::Size { expected: 80, .. })
        ));
        assert!(matches!(
            Matrix::from_bytes(Format::Q4_1, 2, 33, bytes.clone(), 0, 100),
            Err(MatrixError::Blocks { .. })
        ));
        assert!(Matrix::from_bytes(Format::Q4_1, 2, 64, bytes.clone(), 40, 80).is_err());
        assert!(Matrix::from_bytes(Format::Q4_1, 2, 64, bytes, 20, 80).is_ok());
    }
}
